//! A TCP proxy that delays every byte by a set time each way: a slow link to a store (the
//! lab's kernel has no `netem`). It runs in a namespace of the lab, listening on one address
//! and connecting each client to the target; the delay can change while it runs.

use std::{
    io::{Read as _, Write as _},
    net::{Shutdown, SocketAddr, TcpListener, TcpStream},
    os::fd::{AsFd as _, OwnedFd},
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
        mpsc,
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use crate::netns::{NetNs, in_netns};

/// How often blocked reads and accepts look at the stop flag.
const POLL: Duration = Duration::from_millis(20);

pub struct DelayProxy {
    addr: SocketAddr,
    delay_us: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    accept: Option<JoinHandle<()>>,
}

impl DelayProxy {
    /// Listen on `listen` in `ns` and forward each connection to `target` (reached from `ns`
    /// too), with no delay until [`DelayProxy::set_delay`].
    pub fn start(ns: &NetNs, listen: SocketAddr, target: SocketAddr) -> DelayProxy {
        let listener = ns
            .enter(|| TcpListener::bind(listen))
            .unwrap_or_else(|e| panic!("delay proxy: binding {listen}: {e}"));
        listener
            .set_nonblocking(true)
            .expect("nonblocking listener");
        let ns_fd: OwnedFd = ns.dup_fd();
        let delay_us = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (d, s) = (delay_us.clone(), stop.clone());
        let accept = std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((client, _)) => {
                        let up = in_netns(ns_fd.as_fd(), || {
                            TcpStream::connect_timeout(&target, Duration::from_secs(1))
                        });
                        let Ok(up) = up else {
                            let _ = client.shutdown(Shutdown::Both);
                            continue;
                        };
                        let _ = client.set_nonblocking(false);
                        pipe(&client, &up, &d, &s);
                        pipe(&up, &client, &d, &s);
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        std::thread::sleep(POLL)
                    }
                    Err(_) => std::thread::sleep(POLL),
                }
            }
        });
        DelayProxy {
            addr: listen,
            delay_us,
            stop,
            accept: Some(accept),
        }
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Every byte from now on waits `d` in each direction (a round trip of 2 x `d` more).
    pub fn set_delay(&self, d: Duration) {
        self.delay_us.store(d.as_micros() as u64, Ordering::Relaxed);
    }
}

/// Copy `from` to `to`, each chunk held until its time: a reader thread stamps chunks, a
/// writer thread sends them when due.
fn pipe(from: &TcpStream, to: &TcpStream, delay_us: &Arc<AtomicU64>, stop: &Arc<AtomicBool>) {
    let (mut r, mut w) = (
        from.try_clone().expect("clone a proxied socket"),
        to.try_clone().expect("clone a proxied socket"),
    );
    let _ = r.set_read_timeout(Some(POLL));
    let (tx, rx) = mpsc::channel::<(Instant, Vec<u8>)>();
    let (d, s) = (delay_us.clone(), stop.clone());
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 64 * 1024];
        while !s.load(Ordering::Relaxed) {
            match r.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => {
                    let due = Instant::now() + Duration::from_micros(d.load(Ordering::Relaxed));
                    if tx.send((due, buf[..n].to_vec())).is_err() {
                        break;
                    }
                }
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) => {}
                Err(_) => break,
            }
        }
    });
    std::thread::spawn(move || {
        for (due, chunk) in rx {
            let now = Instant::now();
            if due > now {
                std::thread::sleep(due - now);
            }
            if w.write_all(&chunk).is_err() {
                break;
            }
        }
        let _ = w.shutdown(Shutdown::Write);
    });
}

impl Drop for DelayProxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(a) = self.accept.take() {
            let _ = a.join();
        }
    }
}
