//! Independent receivers on the protected side, counting deliveries per source.
//!
//! The daemon's own statistics are what is under test, so they cannot be the
//! evidence. These receivers count what actually got through:
//! - [`Tap`] is an AF_PACKET `ETH_P_ALL` socket on the protected interface.
//!   Packet taps run after XDP, so it sees exactly the frames XDP passed
//!   (IP or not, to any port), and nothing it dropped.
//! - [`UdpSink`] is a UDP socket: a datagram counted there went through XDP,
//!   the stack's checks (MAC, checksums, rp_filter) and socket delivery, the
//!   strongest proof that a passed frame was really usable.
//!
//! Both read on a background thread until stopped, and both report kernel
//! drops at the socket (`SO_MEMINFO`), so a test can tell "the rate limiter
//! dropped it" from "the receiver could not keep up".

use std::collections::HashMap;
use std::io;
use std::mem;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::netns::NetNs;
use crate::packet::parse_src_ip;

/// Receive buffer forced on receivers (SO_RCVBUFFORCE), big enough that a
/// burst from the lab's senders is buffered rather than dropped.
pub const RCVBUF_BYTES: i32 = 64 << 20;

/// How often reader threads wake up to check whether they were stopped.
const POLL: Duration = Duration::from_millis(20);

/// The longest [`Tap::wait_quiet`] / [`UdpSink::wait_quiet`] waits for quiet.
pub const WAIT_QUIET_MAX: Duration = Duration::from_secs(60);

/// What a receiver counted.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    /// Frames (Tap) or datagrams (UdpSink) per IP source address.
    pub per_src: HashMap<IpAddr, u64>,
    /// Frames without a parsable IP source (ARP, other ethertypes, runts).
    pub non_ip: u64,
    /// Everything counted: the sum of `per_src` and `non_ip`.
    pub total: u64,
    /// Packets the kernel dropped at this receiver's socket(s) because its
    /// buffer was full (`SK_MEMINFO_DROPS`). Non-zero means the counts are
    /// a lower bound, not evidence of the rate limiter dropping.
    pub socket_drops: u64,
}

impl Counts {
    /// Count for one source (0 if none arrived).
    pub fn from(&self, src: IpAddr) -> u64 {
        self.per_src.get(&src).copied().unwrap_or(0)
    }

    fn add(&mut self, src: Option<IpAddr>) {
        match src {
            Some(ip) => *self.per_src.entry(ip).or_insert(0) += 1,
            None => self.non_ip += 1,
        }
        self.total += 1;
    }
}

/// Shared state between a receiver handle and its reader threads.
#[derive(Debug)]
struct Shared {
    counts: Mutex<Counts>,
    /// Nanoseconds after `start` of the last counted packet, +1 (0 = none yet).
    last_rx: AtomicU64,
    start: Instant,
    stop: AtomicBool,
}

impl Shared {
    fn new() -> Arc<Shared> {
        Arc::new(Shared {
            counts: Mutex::new(Counts::default()),
            last_rx: AtomicU64::new(0),
            start: Instant::now(),
            stop: AtomicBool::new(false),
        })
    }

    fn record(&self, src: Option<IpAddr>) {
        self.counts.lock().expect("counts lock").add(src);
        let ns = u64::try_from(self.start.elapsed().as_nanos()).unwrap_or(u64::MAX - 1);
        self.last_rx.store(ns + 1, Ordering::Release);
    }

    fn snapshot(&self) -> Counts {
        self.counts.lock().expect("counts lock").clone()
    }

    fn wait_quiet(&self, quiet: Duration) {
        let called = Instant::now();
        let give_up = called + WAIT_QUIET_MAX;
        loop {
            let last = match self.last_rx.load(Ordering::Acquire) {
                0 => self.start,
                ns => self.start + Duration::from_nanos(ns - 1),
            };
            // Quiet since the call at the earliest: frames the caller has just sent may not
            // have reached the receiver yet, however long it was silent before.
            let silent = last.max(called).elapsed();
            if silent >= quiet {
                return;
            }
            assert!(
                Instant::now() < give_up,
                "receiver never went quiet for {quiet:?} within {WAIT_QUIET_MAX:?}: {:?}",
                self.snapshot()
            );
            std::thread::sleep((quiet - silent).min(Duration::from_millis(10)));
        }
    }

    fn wait_total(&self, total: u64, timeout: Duration) -> bool {
        let give_up = Instant::now() + timeout;
        loop {
            if self.counts.lock().expect("counts lock").total >= total {
                return true;
            }
            if Instant::now() >= give_up {
                return false;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

/// Joins reader threads and returns the final counts plus socket drops.
fn finish(shared: &Shared, threads: Vec<JoinHandle<io::Result<u64>>>) -> Counts {
    shared.stop.store(true, Ordering::Release);
    let mut drops = 0;
    for t in threads {
        match t.join() {
            Ok(Ok(d)) => drops += d,
            Ok(Err(e)) => panic!("receiver thread failed: {e}"),
            Err(p) => std::panic::resume_unwind(p),
        }
    }
    let mut counts = shared.snapshot();
    counts.socket_drops = drops;
    counts
}

/// Counts every frame the protected interface receives after XDP.
#[derive(Debug)]
pub struct Tap {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<io::Result<u64>>>,
}

impl Tap {
    /// Starts tapping `ifindex` in `ns`. Frames the namespace itself sends
    /// (PACKET_OUTGOING) are not counted.
    ///
    /// # Panics
    ///
    /// If the socket cannot be opened, sized or bound.
    pub fn new(ns: &NetNs, ifindex: u32) -> Tap {
        let fd = ns
            .enter(|| -> io::Result<OwnedFd> {
                // SAFETY: plain socket(2); owned right after the check.
                let raw = unsafe {
                    libc::socket(
                        libc::AF_PACKET,
                        libc::SOCK_RAW | libc::SOCK_CLOEXEC,
                        i32::from((libc::ETH_P_ALL as u16).to_be()),
                    )
                };
                if raw < 0 {
                    return Err(io::Error::last_os_error());
                }
                // SAFETY: raw is a fresh fd nothing else owns.
                let fd = unsafe { OwnedFd::from_raw_fd(raw) };
                set_rcvbuf(fd.as_raw_fd())?;
                set_rcvtimeo(fd.as_raw_fd(), POLL)?;
                crate::sender::bind_ll(&fd, ifindex, libc::ETH_P_ALL as u16)?;
                Ok(fd)
            })
            .unwrap_or_else(|e| panic!("tap on ifindex {ifindex} in {}: {e}", ns.name()));
        let shared = Shared::new();
        let s = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name(format!("tap-{ifindex}"))
            .spawn(move || tap_loop(&fd, ifindex, &s))
            .expect("spawning the tap thread");
        Tap {
            shared,
            threads: vec![thread],
        }
    }

    /// Counts so far (socket drops are only filled in by [`Tap::stop`]).
    pub fn snapshot(&self) -> Counts {
        self.shared.snapshot()
    }

    /// Returns once no frame has arrived for `quiet`, counted from the call at
    /// the earliest (so frames just sent have time to arrive).
    ///
    /// # Panics
    ///
    /// If traffic never pauses within [`WAIT_QUIET_MAX`].
    pub fn wait_quiet(&self, quiet: Duration) {
        self.shared.wait_quiet(quiet);
    }

    /// Waits until at least `total` frames were counted; false on timeout.
    pub fn wait_total(&self, total: u64, timeout: Duration) -> bool {
        self.shared.wait_total(total, timeout)
    }

    /// Stops the reader and returns the final counts.
    pub fn stop(mut self) -> Counts {
        finish(&self.shared, std::mem::take(&mut self.threads))
    }
}

impl Drop for Tap {
    fn drop(&mut self) {
        // After stop() the threads are gone; otherwise tell them to exit.
        self.shared.stop.store(true, Ordering::Release);
    }
}

fn tap_loop(fd: &OwnedFd, ifindex: u32, shared: &Shared) -> io::Result<u64> {
    let mut buf = vec![0u8; 65_536];
    loop {
        // Once stopped, drain what is already queued without blocking, so
        // stop() never loses frames that had arrived.
        let stopping = shared.stop.load(Ordering::Acquire);
        let flags = if stopping { libc::MSG_DONTWAIT } else { 0 };
        // SAFETY: sockaddr_ll is plain data.
        let mut sll: libc::sockaddr_ll = unsafe { mem::zeroed() };
        let mut len = mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t;
        // SAFETY: buffer and address pointers are valid for the given sizes.
        let n = unsafe {
            libc::recvfrom(
                fd.as_raw_fd(),
                buf.as_mut_ptr().cast(),
                buf.len(),
                flags,
                (&raw mut sll).cast(),
                &mut len,
            )
        };
        if n < 0 {
            let err = io::Error::last_os_error();
            match err.raw_os_error() {
                Some(libc::EAGAIN) if stopping => break,
                Some(libc::EAGAIN | libc::EINTR) => continue,
                _ => return Err(err),
            }
        }
        if sll.sll_pkttype == libc::PACKET_OUTGOING
            || u32::try_from(sll.sll_ifindex).ok() != Some(ifindex)
        {
            continue;
        }
        let n = usize::try_from(n).expect("non-negative");
        shared.record(parse_src_ip(&buf[..n]));
    }
    socket_drops(fd.as_raw_fd())
}

/// Counts UDP datagrams delivered to a port in the protected namespace.
#[derive(Debug)]
pub struct UdpSink {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<io::Result<u64>>>,
    port: u16,
}

impl UdpSink {
    /// Binds `0.0.0.0:port` and `[::]:port` (IPv6-only, so each family has
    /// its own socket) in `ns` and starts counting.
    ///
    /// # Panics
    ///
    /// If either bind fails (e.g. the port is taken), or `port` is 0.
    pub fn new(ns: &NetNs, port: u16) -> UdpSink {
        assert!(
            port != 0,
            "UdpSink needs a fixed port shared by both families"
        );
        let sockets = ns
            .enter(|| -> io::Result<[UdpSocket; 2]> {
                let v4 = UdpSocket::bind(SocketAddr::from((Ipv4Addr::UNSPECIFIED, port)))?;
                let v6 = bind_v6_only(port)?;
                for s in [&v4, &v6] {
                    set_rcvbuf(s.as_raw_fd())?;
                    s.set_read_timeout(Some(POLL))?;
                }
                Ok([v4, v6])
            })
            .unwrap_or_else(|e| panic!("UDP sink on port {port} in {}: {e}", ns.name()));
        let shared = Shared::new();
        let threads = sockets
            .into_iter()
            .enumerate()
            .map(|(i, sock)| {
                let s = Arc::clone(&shared);
                std::thread::Builder::new()
                    .name(format!(
                        "udp-sink-{port}-{}",
                        if i == 0 { "v4" } else { "v6" }
                    ))
                    .spawn(move || udp_loop(&sock, &s))
                    .expect("spawning a UDP sink thread")
            })
            .collect();
        UdpSink {
            shared,
            threads,
            port,
        }
    }

    /// The port both sockets are bound to.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Counts so far (socket drops are only filled in by [`UdpSink::stop`]).
    pub fn snapshot(&self) -> Counts {
        self.shared.snapshot()
    }

    /// Returns once no datagram has arrived for `quiet`, counted from the call
    /// at the earliest (so datagrams just sent have time to arrive).
    ///
    /// # Panics
    ///
    /// If traffic never pauses within [`WAIT_QUIET_MAX`].
    pub fn wait_quiet(&self, quiet: Duration) {
        self.shared.wait_quiet(quiet);
    }

    /// Waits until at least `total` datagrams were counted; false on timeout.
    pub fn wait_total(&self, total: u64, timeout: Duration) -> bool {
        self.shared.wait_total(total, timeout)
    }

    /// Stops the readers and returns the final counts.
    pub fn stop(mut self) -> Counts {
        finish(&self.shared, std::mem::take(&mut self.threads))
    }
}

impl Drop for UdpSink {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
    }
}

fn udp_loop(sock: &UdpSocket, shared: &Shared) -> io::Result<u64> {
    let mut buf = vec![0u8; 65_536];
    let mut stopping = false;
    loop {
        if !stopping && shared.stop.load(Ordering::Acquire) {
            // Drain what is already queued, then stop.
            stopping = true;
            sock.set_nonblocking(true)?;
        }
        match sock.recv_from(&mut buf) {
            Ok((_, from)) => shared.record(Some(canonical(from.ip()))),
            Err(e) if stopping && e.kind() == io::ErrorKind::WouldBlock => break,
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock
                        | io::ErrorKind::TimedOut
                        | io::ErrorKind::Interrupted
                ) => {}
            Err(e) => return Err(e),
        }
    }
    socket_drops(sock.as_raw_fd())
}

/// IPv4-mapped IPv6 sources count under their IPv4 address.
fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4),
        v4 => v4,
    }
}

fn bind_v6_only(port: u16) -> io::Result<UdpSocket> {
    // std cannot set IPV6_V6ONLY before bind, so build the socket by hand.
    // SAFETY: plain socket(2); owned right after the check.
    let raw = unsafe { libc::socket(libc::AF_INET6, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if raw < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: raw is a fresh fd nothing else owns.
    let sock = unsafe { UdpSocket::from_raw_fd(raw) };
    setsockopt_int(raw, libc::IPPROTO_IPV6, libc::IPV6_V6ONLY, 1)?;
    // SAFETY: sockaddr_in6 is plain data.
    let mut sa: libc::sockaddr_in6 = unsafe { mem::zeroed() };
    sa.sin6_family = libc::AF_INET6 as u16;
    sa.sin6_port = port.to_be();
    sa.sin6_addr.s6_addr = Ipv6Addr::UNSPECIFIED.octets();
    // SAFETY: pointer and length describe `sa`.
    let rc = unsafe {
        libc::bind(
            raw,
            (&raw const sa).cast(),
            mem::size_of::<libc::sockaddr_in6>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(sock)
}

fn setsockopt_int(fd: RawFd, level: i32, name: i32, value: i32) -> io::Result<()> {
    // SAFETY: the pointer and length describe `value`.
    let rc = unsafe {
        libc::setsockopt(
            fd,
            level,
            name,
            (&raw const value).cast(),
            mem::size_of::<i32>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Forces the socket's receive buffer to [`RCVBUF_BYTES`] (SO_RCVBUFFORCE, root).
pub fn set_rcvbuf(fd: RawFd) -> io::Result<()> {
    setsockopt_int(fd, libc::SOL_SOCKET, libc::SO_RCVBUFFORCE, RCVBUF_BYTES)
}

fn set_rcvtimeo(fd: RawFd, timeout: Duration) -> io::Result<()> {
    let tv = libc::timeval {
        tv_sec: libc::time_t::try_from(timeout.as_secs()).unwrap_or(libc::time_t::MAX),
        tv_usec: libc::suseconds_t::from(timeout.subsec_micros()),
    };
    // SAFETY: the pointer and length describe `tv`.
    let rc = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            (&raw const tv).cast(),
            mem::size_of::<libc::timeval>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The socket's drop counter (`SO_MEMINFO[SK_MEMINFO_DROPS]`).
pub fn socket_drops(fd: RawFd) -> io::Result<u64> {
    let mut info = [0u32; 16];
    let mut len = mem::size_of_val(&info) as libc::socklen_t;
    // SAFETY: the pointer and length describe `info`; the kernel writes at most len bytes.
    let rc = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_MEMINFO,
            info.as_mut_ptr().cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    let idx = usize::try_from(libc::SK_MEMINFO_DROPS).expect("small index");
    Ok(u64::from(info[idx]))
}
