//! Sends crafted frames into a veth from inside a namespace, and counts them.
//!
//! Accuracy tests compare what the rate limiter passed with what was sent,
//! so "sent" must mean "handed to the wire", not "attempted". An AF_PACKET
//! send into a veth whose peer ring (or backlog) is full fails with ENOBUFS
//! and the frame is dropped before any XDP program sees it; that is retried
//! here (within a bounded time), so a test's send count is exact.
//!
//! The socket uses protocol 0, which registers no receive hook: it only
//! sends, and never queues copies of the traffic it is flooding.

use std::io;
use std::mem;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

use crate::netns::NetNs;

/// How long [`PacketSocket::send`] keeps retrying one frame on ENOBUFS/EAGAIN.
pub const SEND_RETRY_BUDGET: Duration = Duration::from_secs(5);

/// The most frames [`PacketSocket::send_rate`] sends in one call, whatever
/// rate and duration it is asked for: floods are bounded by construction.
pub const MAX_FRAMES_PER_CALL: u64 = 5_000_000;

/// What a bulk send did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SendStats {
    /// Frames the kernel accepted (each exactly once).
    pub sent: u64,
    /// ENOBUFS/EAGAIN results that were retried (a measure of back-pressure).
    pub retries: u64,
    /// Wall time of the call.
    pub elapsed: Duration,
}

/// An AF_PACKET raw socket bound to one interface in one namespace.
#[derive(Debug)]
pub struct PacketSocket {
    fd: OwnedFd,
    ifindex: u32,
    sent: u64,
    retries: u64,
}

impl PacketSocket {
    /// Opens a send-only packet socket in `ns`, bound to `ifindex` there.
    ///
    /// # Panics
    ///
    /// If the socket cannot be created or bound.
    pub fn new(ns: &NetNs, ifindex: u32) -> PacketSocket {
        let fd = ns.enter(|| open_bound(ifindex)).unwrap_or_else(|e| {
            panic!(
                "AF_PACKET socket on ifindex {ifindex} in {}: {e}",
                ns.name()
            )
        });
        PacketSocket {
            fd,
            ifindex,
            sent: 0,
            retries: 0,
        }
    }

    /// The interface this socket sends on.
    pub fn ifindex(&self) -> u32 {
        self.ifindex
    }

    /// Frames sent over this socket's life.
    pub fn sent(&self) -> u64 {
        self.sent
    }

    /// ENOBUFS/EAGAIN retries over this socket's life.
    pub fn retries(&self) -> u64 {
        self.retries
    }

    /// Sends one frame, retrying ENOBUFS/EAGAIN (full veth ring or backlog:
    /// the frame was not sent) for up to [`SEND_RETRY_BUDGET`]. Counts the
    /// frame only when the kernel accepted it.
    pub fn send(&mut self, frame: &[u8]) -> io::Result<()> {
        let mut deadline = None;
        let mut spins = 0u32;
        loop {
            // SAFETY: the buffer is valid for frame.len() bytes; the socket is bound.
            let n =
                unsafe { libc::send(self.fd.as_raw_fd(), frame.as_ptr().cast(), frame.len(), 0) };
            if n >= 0 {
                let n = usize::try_from(n).expect("non-negative");
                if n != frame.len() {
                    return Err(io::Error::other(format!(
                        "short AF_PACKET send: {n} of {} bytes",
                        frame.len()
                    )));
                }
                self.sent += 1;
                return Ok(());
            }
            let err = io::Error::last_os_error();
            match err.raw_os_error() {
                Some(libc::ENOBUFS | libc::EAGAIN) => {}
                Some(libc::EINTR) => continue,
                _ => return Err(err),
            }
            self.retries += 1;
            let deadline = *deadline.get_or_insert_with(|| Instant::now() + SEND_RETRY_BUDGET);
            if Instant::now() >= deadline {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("{err} for {SEND_RETRY_BUDGET:?}: the receiver is not draining"),
                ));
            }
            // Let the receiving NAPI/backlog drain: yield first, then sleep.
            spins += 1;
            if spins < 16 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    }

    /// Sends exactly `count` frames taken from `frames` (use
    /// `std::iter::repeat` or `.cycle()` to reuse frames), optionally one per
    /// `pace` on an absolute schedule (no drift; a late frame is sent at once).
    ///
    /// # Panics
    ///
    /// If `frames` runs out early or a send fails for good; the message
    /// says how many were sent.
    pub fn send_n<F: AsRef<[u8]>>(
        &mut self,
        frames: impl IntoIterator<Item = F>,
        count: u64,
        pace: Option<Duration>,
    ) -> SendStats {
        let start = Instant::now();
        let (sent0, retries0) = (self.sent, self.retries);
        let mut frames = frames.into_iter();
        for i in 0..count {
            let frame = frames
                .next()
                .unwrap_or_else(|| panic!("send_n: frame iterator ended after {i} of {count}"));
            if let Some(pace) = pace {
                wait_until(start + mul_duration(pace, i));
            }
            if let Err(e) = self.send(frame.as_ref()) {
                panic!("send_n: frame {i} of {count} failed: {e}");
            }
        }
        SendStats {
            sent: self.sent - sent0,
            retries: self.retries - retries0,
            elapsed: start.elapsed(),
        }
    }

    /// Sends `frame_fn(i)` for i = 0, 1, ... at `pps` frames per second for
    /// `duration`, at most `pps * duration` and at most
    /// [`MAX_FRAMES_PER_CALL`] frames. Stops at `duration` even if behind
    /// schedule, so `sent` can be lower than asked: use the returned count.
    ///
    /// # Panics
    ///
    /// If `pps` is 0 or a send fails for good.
    pub fn send_rate<F: AsRef<[u8]>>(
        &mut self,
        mut frame_fn: impl FnMut(u64) -> F,
        pps: u64,
        duration: Duration,
    ) -> SendStats {
        assert!(pps > 0, "send_rate: pps must be positive");
        let target = u64::try_from(duration.as_nanos() * u128::from(pps) / 1_000_000_000)
            .unwrap_or(u64::MAX)
            .min(MAX_FRAMES_PER_CALL);
        let start = Instant::now();
        let end = start + duration;
        let (sent0, retries0) = (self.sent, self.retries);
        for i in 0..target {
            let due = start
                + Duration::from_nanos(
                    u64::try_from(u128::from(i) * 1_000_000_000 / u128::from(pps))
                        .unwrap_or(u64::MAX),
                );
            wait_until(due);
            if Instant::now() >= end {
                break;
            }
            let frame = frame_fn(i);
            if let Err(e) = self.send(frame.as_ref()) {
                panic!("send_rate: frame {i} of {target} failed: {e}");
            }
        }
        SendStats {
            sent: self.sent - sent0,
            retries: self.retries - retries0,
            elapsed: start.elapsed(),
        }
    }
}

/// Pins the calling thread to one CPU, so e.g. two sender threads feed two
/// different veth queues (with XPS set) and XDP runs on both CPUs.
pub fn pin_current_thread(cpu: usize) -> io::Result<()> {
    // SAFETY: cpu_set_t is plain data; CPU_SET bounds-checks in debug and
    // sched_setaffinity(0, ...) affects only the calling thread.
    unsafe {
        let mut set: libc::cpu_set_t = mem::zeroed();
        if cpu >= 8 * mem::size_of::<libc::cpu_set_t>() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("cpu {cpu} out of range"),
            ));
        }
        libc::CPU_SET(cpu, &mut set);
        if libc::sched_setaffinity(0, mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Number of CPUs this process may run on.
pub fn online_cpus() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

fn open_bound(ifindex: u32) -> io::Result<OwnedFd> {
    // SAFETY: plain socket(2); the fd is owned right after the check.
    let raw = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW | libc::SOCK_CLOEXEC, 0) };
    if raw < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: raw is a fresh, valid fd that nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    bind_ll(&fd, ifindex, 0)?;
    Ok(fd)
}

/// Binds a packet socket to `ifindex` with `protocol` (host byte order).
pub(crate) fn bind_ll(fd: &OwnedFd, ifindex: u32, protocol: u16) -> io::Result<()> {
    // SAFETY: sockaddr_ll is plain data; all-zero is a valid start.
    let mut sll: libc::sockaddr_ll = unsafe { mem::zeroed() };
    sll.sll_family = libc::AF_PACKET as u16;
    sll.sll_protocol = protocol.to_be();
    sll.sll_ifindex = i32::try_from(ifindex)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "ifindex out of range"))?;
    // SAFETY: the pointer and length describe `sll`.
    let rc = unsafe {
        libc::bind(
            fd.as_raw_fd(),
            (&raw const sll).cast(),
            mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn mul_duration(d: Duration, n: u64) -> Duration {
    Duration::from_nanos(u64::try_from(d.as_nanos() * u128::from(n)).unwrap_or(u64::MAX))
}

/// Sleeps until `t`, spinning for the last stretch so sub-100 µs pacing
/// stays accurate.
fn wait_until(t: Instant) {
    loop {
        let now = Instant::now();
        if now >= t {
            return;
        }
        let left = t - now;
        if left > Duration::from_micros(200) {
            std::thread::sleep(left - Duration::from_micros(100));
        } else {
            std::hint::spin_loop();
        }
    }
}
