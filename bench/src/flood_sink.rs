//! A cheap UDP sink for the legitimate clients of (M): one dual-stack socket in the receiving
//! namespace, drained with `recvmmsg` every millisecond by a thread pinned next to the
//! generator. It never sleeps on the socket, so a delivered datagram costs the receiving CPU
//! no wake-up of a reader (an inter-processor interrupt per datagram in this VM); the 64 MiB
//! buffer holds what arrives between two drains. Counts datagrams per source address.

use std::{
    collections::HashMap,
    io, mem,
    net::{IpAddr, Ipv6Addr, SocketAddr, UdpSocket},
    os::fd::AsRawFd,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    thread::JoinHandle,
    time::Duration,
};

use ratelimit_tests::{
    NetNs,
    receiver::{set_rcvbuf, socket_drops},
};

const BATCH: usize = 64;

pub struct Sink {
    counts: Arc<Mutex<HashMap<IpAddr, u64>>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<io::Result<u64>>>,
}

impl Sink {
    /// Binds `[::]:port` (dual stack) in `ns` and starts draining on a thread pinned to
    /// `cpu`.
    pub fn new(ns: &NetNs, port: u16, cpu: usize) -> Sink {
        let sock = ns
            .enter(|| -> io::Result<UdpSocket> {
                let s = UdpSocket::bind(SocketAddr::from((Ipv6Addr::UNSPECIFIED, port)))?;
                s.set_nonblocking(true)?;
                set_rcvbuf(s.as_raw_fd())?;
                Ok(s)
            })
            .unwrap_or_else(|e| panic!("UDP sink on port {port} in {}: {e}", ns.name()));
        let counts = Arc::new(Mutex::new(HashMap::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let (c, st) = (Arc::clone(&counts), Arc::clone(&stop));
        let thread = std::thread::Builder::new()
            .name("flood-sink".into())
            .spawn(move || {
                ratelimit_tests::sender::pin_current_thread(cpu)?;
                // SAFETY: setpriority on the calling thread has no memory effects.
                unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, -20) };
                drain_loop(&sock, &c, &st)
            })
            .expect("spawning the sink thread");
        Sink {
            counts,
            stop,
            thread: Some(thread),
        }
    }

    pub fn snapshot(&self) -> HashMap<IpAddr, u64> {
        self.counts.lock().expect("sink counts").clone()
    }

    /// Drains what is queued, stops, and returns the counts and the socket's drops.
    pub fn stop(mut self) -> (HashMap<IpAddr, u64>, u64) {
        self.stop.store(true, Ordering::Release);
        let drops = match self.thread.take().map(JoinHandle::join) {
            Some(Ok(Ok(d))) => d,
            Some(Ok(Err(e))) => panic!("sink thread: {e}"),
            Some(Err(p)) => std::panic::resume_unwind(p),
            None => 0,
        };
        (self.snapshot(), drops)
    }
}

impl Drop for Sink {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
    }
}

fn drain_loop(
    sock: &UdpSocket,
    counts: &Mutex<HashMap<IpAddr, u64>>,
    stop: &AtomicBool,
) -> io::Result<u64> {
    let fd = sock.as_raw_fd();
    let mut bufs = vec![[0u8; 128]; BATCH];
    // SAFETY: all-zero sockaddr_in6 / iovec / mmsghdr are valid starting values.
    let mut addrs: Vec<libc::sockaddr_in6> = vec![unsafe { mem::zeroed() }; BATCH];
    // SAFETY: as above.
    let mut iovs: Vec<libc::iovec> = vec![unsafe { mem::zeroed() }; BATCH];
    // SAFETY: as above.
    let mut msgs: Vec<libc::mmsghdr> = vec![unsafe { mem::zeroed() }; BATCH];
    loop {
        let stopping = stop.load(Ordering::Acquire);
        let mut local: HashMap<IpAddr, u64> = HashMap::new();
        loop {
            for i in 0..BATCH {
                iovs[i] = libc::iovec {
                    iov_base: bufs[i].as_mut_ptr().cast(),
                    iov_len: bufs[i].len(),
                };
                msgs[i].msg_hdr.msg_name = (&raw mut addrs[i]).cast();
                msgs[i].msg_hdr.msg_namelen = mem::size_of::<libc::sockaddr_in6>() as u32;
                msgs[i].msg_hdr.msg_iov = &raw mut iovs[i];
                msgs[i].msg_hdr.msg_iovlen = 1;
                msgs[i].msg_len = 0;
            }
            // SAFETY: every mmsghdr points at live buffers of the lengths given.
            let n = unsafe {
                libc::recvmmsg(
                    fd,
                    msgs.as_mut_ptr(),
                    BATCH as u32,
                    libc::MSG_DONTWAIT,
                    std::ptr::null_mut(),
                )
            };
            if n < 0 {
                let e = io::Error::last_os_error();
                match e.raw_os_error() {
                    Some(libc::EAGAIN | libc::EINTR) => break,
                    _ => return Err(e),
                }
            }
            for a in &addrs[..n as usize] {
                let ip = Ipv6Addr::from(a.sin6_addr.s6_addr);
                let ip = ip.to_ipv4_mapped().map_or(IpAddr::V6(ip), IpAddr::V4);
                *local.entry(ip).or_insert(0) += 1;
            }
            if (n as usize) < BATCH {
                break;
            }
        }
        if !local.is_empty() {
            let mut c = counts.lock().expect("sink counts");
            for (k, v) in local {
                *c.entry(k).or_insert(0) += v;
            }
        }
        if stopping {
            return socket_drops(fd);
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}
