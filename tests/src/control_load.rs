//! The control plane under load, measured one way for the kernel test
//! (`e2e_control_latency`) and the benchmark (`cargo xtask bench`, control part): many sources
//! tracked through the veth pair with one real packet each, new sources arriving throughout
//! (so no count the reports keep stays valid for long), `/metrics` fetched every 100 ms, a
//! thousand idle HTTP connections open, then `status` requests over the control socket, timed
//! from connect to the answer read and decoded.

use std::{
    io::{Read as _, Write as _},
    net::{Ipv4Addr, TcpStream},
    path::Path,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use ratelimit_user::api::{Answer, Request};

use crate::{env::raise_own_nofile, scenario::Scenario};

/// The UDP port the rule matches.
pub const PORT: u16 = 9000;

/// The sizes of one measurement.
#[derive(Debug, Clone, Copy)]
pub struct Load {
    /// Clients that must be tracked before the measurement starts.
    pub clients: u32,
    /// Sources sent one packet each to get there (a few frames may be lost on the way).
    pub sources: u32,
    /// Idle HTTP connections held open while measuring.
    pub idle_connections: u32,
    /// `status` requests measured, 20 ms apart.
    pub samples: usize,
}

impl Load {
    /// The issue's load: a million tracked clients, a thousand idle connections.
    pub const FULL: Load = Load {
        clients: 1_000_000,
        sources: 1_050_000,
        idle_connections: 1_000,
        samples: 300,
    };
    /// The benchmark's quick run.
    pub const QUICK: Load = Load {
        clients: 100_000,
        sources: 105_000,
        idle_connections: 1_000,
        samples: 100,
    };

    /// The daemon's config for it: one UDP rule, a store for twice the clients, admission off
    /// (every new source gets its state).
    pub fn config(&self) -> String {
        format!(
            r#"
[tracking]
max_sources = {}
new_sources_per_sec = 0

[[rule]]
name = "udp"
match = {{ protocol = "udp", dst_ports = ["{PORT}"] }}
threshold = {{ count = 1000, interval = "1s" }}
"#,
            self.clients * 2
        )
    }
}

/// What one measurement saw.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Figures {
    /// Clients the daemon reported tracked before the measurement.
    pub tracked: u64,
    /// How long filling the store took, seconds.
    pub fill_secs: f64,
    pub idle_connections: usize,
    /// `status` round trips, sorted, microseconds.
    #[serde(skip)]
    pub status_us: Vec<u64>,
    /// `/metrics` fetches answered, sorted, microseconds.
    #[serde(skip)]
    pub metrics_us: Vec<u64>,
    /// `/metrics` fetches turned away or failed (the listener serves 64 connections at most:
    /// while the idle ones hold them, until the header timeout closes them, a scrape is turned
    /// away).
    pub metrics_failed: usize,
    pub status_p50_ms: f64,
    pub status_p99_ms: f64,
    pub status_max_ms: f64,
    pub metrics_p50_ms: f64,
    pub metrics_p99_ms: f64,
}

impl Figures {
    /// One line each for `status` and `/metrics`.
    pub fn summary(&self) -> String {
        format!(
            "status over the control socket, {} requests: p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms\n\
             /metrics every 100 ms, {} scrapes ({} failed): p50 {:.2} ms, p99 {:.2} ms",
            self.status_us.len(),
            self.status_p50_ms,
            self.status_p99_ms,
            self.status_max_ms,
            self.metrics_us.len(),
            self.metrics_failed,
            self.metrics_p50_ms,
            self.metrics_p99_ms,
        )
    }
}

/// The `p` quantile (0..=1) of sorted values, nearest rank; 0 when there are none.
pub fn quantile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let i = ((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i]
}

/// One `status` over the control socket (the API's own client): its round trip and the
/// tracked clients it shows.
pub fn status(socket: &Path) -> (Duration, u64) {
    let start = Instant::now();
    let answer = ratelimit_user::serve::control::call(socket, &Request::Status)
        .expect("status over the control socket");
    let took = start.elapsed();
    let Answer::Status(status) = answer else {
        panic!("status answered with {answer:?}");
    };
    (took, status.tracked_clients)
}

/// One `/metrics` fetch: whether it was answered with the metrics.
fn scrape(port: u16) -> bool {
    (|| -> std::io::Result<bool> {
        let mut c = TcpStream::connect(("127.0.0.1", port))?;
        c.set_read_timeout(Some(Duration::from_secs(30)))?;
        c.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")?;
        let mut resp = String::new();
        c.read_to_string(&mut resp)?;
        Ok(resp.starts_with("HTTP/1.1 200") && resp.contains("ratelimit_tracked_clients"))
    })()
    .unwrap_or(false)
}

/// Run the measurement against a scenario started with [`Load::config`] and HTTP on
/// `http_port`. Panics if the store does not reach `load.clients` within 60 s.
pub fn measure(s: &Scenario, http_port: u16, load: Load) -> Figures {
    raise_own_nofile(u64::from(load.idle_connections) + 256);
    let socket = s.daemon().socket_path().to_path_buf();

    // The sources, one packet each.
    let t = Instant::now();
    let mut tx = s.sender();
    let base = u32::from(Ipv4Addr::new(10, 0, 0, 0));
    tx.send_n(
        (0..load.sources).map(|i| s.udp4(Ipv4Addr::from(base + i), PORT)),
        u64::from(load.sources),
        None,
    );
    let mut tracked = 0;
    let give_up = Instant::now() + Duration::from_secs(60);
    while Instant::now() < give_up {
        tracked = status(&socket).1;
        if tracked >= u64::from(load.clients) {
            break;
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    let fill_secs = t.elapsed().as_secs_f64();
    assert!(
        tracked >= u64::from(load.clients),
        "only {tracked} of {} sources tracked",
        load.sources
    );

    // The idle HTTP connections.
    let idle: Vec<TcpStream> = s.server.enter(|| {
        (0..load.idle_connections)
            .filter_map(|_| {
                TcpStream::connect_timeout(
                    &([127, 0, 0, 1], http_port).into(),
                    Duration::from_secs(5),
                )
                .ok()
            })
            .collect()
    });
    let idle_connections = idle.len();

    let stop = Arc::new(AtomicBool::new(false));
    // New sources keep arriving: 200 a second, from addresses never seen before.
    let trickle = {
        let stop = stop.clone();
        let mut tx = s.sender();
        let frames: Vec<Vec<u8>> = (0..20_000u32)
            .map(|i| {
                s.udp4(
                    Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 64, 0, 0)) + i),
                    PORT,
                )
            })
            .collect();
        std::thread::spawn(move || {
            for f in frames {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                tx.send_n(std::iter::once(&f), 1, None);
                std::thread::sleep(Duration::from_millis(5));
            }
        })
    };
    let server = &s.server;
    let (status_us, metrics_us, metrics_failed) = std::thread::scope(|scope| {
        // `/metrics` every 100 ms.
        let scraper = {
            let stop = stop.clone();
            scope.spawn(move || {
                server.enter(move || {
                    let mut times = Vec::new();
                    let mut failed = 0;
                    while !stop.load(Ordering::Relaxed) {
                        let start = Instant::now();
                        let ok = scrape(http_port);
                        let took = start.elapsed();
                        if ok {
                            times.push(took.as_micros() as u64);
                        } else {
                            failed += 1;
                        }
                        std::thread::sleep(Duration::from_millis(100).saturating_sub(took));
                    }
                    (times, failed)
                })
            })
        };
        // Steady state: the reports have seen the counts keep moving (a census period or two).
        std::thread::sleep(ratelimit_user::serve::reader::CENSUS_PERIOD * 3);
        let status_us: Vec<u64> = (0..load.samples)
            .map(|_| {
                let t = status(&socket).0;
                std::thread::sleep(Duration::from_millis(20));
                t.as_micros() as u64
            })
            .collect();
        stop.store(true, Ordering::Relaxed);
        let (metrics_us, failed) = scraper.join().unwrap();
        (status_us, metrics_us, failed)
    });
    trickle.join().unwrap();
    drop(idle);
    let (mut status_us, mut metrics_us) = (status_us, metrics_us);
    status_us.sort_unstable();
    metrics_us.sort_unstable();
    let ms = |us: u64| us as f64 / 1000.0;
    Figures {
        tracked,
        fill_secs,
        idle_connections,
        status_p50_ms: ms(quantile(&status_us, 0.50)),
        status_p99_ms: ms(quantile(&status_us, 0.99)),
        status_max_ms: ms(status_us.last().copied().unwrap_or(0)),
        metrics_p50_ms: ms(quantile(&metrics_us, 0.50)),
        metrics_p99_ms: ms(quantile(&metrics_us, 0.99)),
        status_us,
        metrics_us,
        metrics_failed,
    }
}
