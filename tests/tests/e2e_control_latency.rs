//! The control plane under load: `ratelimit status` answers within 100 ms (p99) while a
//! million clients are tracked, `/metrics` is scraped every 100 ms, a thousand idle HTTP
//! connections are open, and new sources keep arriving (so no count the reports keep can be
//! reused for long). The figures are printed for BENCHMARKS.md.

use std::{
    io::{BufRead as _, BufReader, Read as _, Write as _},
    net::{Ipv4Addr, TcpStream},
    os::unix::net::UnixStream,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use ratelimit_tests::{env::raise_own_nofile, kernel_test, scenario::Scenario};

const PORT: u16 = 9000;
const HTTP_PORT: u16 = 9478;
/// Clients tracked before the measurement, at least.
const CLIENTS: u32 = 1_000_000;
/// Sources sent one packet each to get there (a few frames may be lost on the way).
const SOURCES: u32 = 1_050_000;
/// `status` requests measured.
const SAMPLES: usize = 300;
/// The bound on their 99th percentile.
const P99_BOUND: Duration = Duration::from_millis(100);

/// One `status` over the control socket: its round trip and the tracked clients it shows.
fn status(socket: &std::path::Path) -> (Duration, u64) {
    let start = Instant::now();
    let mut c = UnixStream::connect(socket).expect("connecting to the control socket");
    c.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    c.write_all(b"{\"cmd\":\"status\"}\n").unwrap();
    let mut line = String::new();
    BufReader::new(&c).read_line(&mut line).unwrap();
    let took = start.elapsed();
    let v: serde_json::Value = serde_json::from_str(&line).expect("a JSON answer");
    assert_eq!(v["ok"], true, "{line}");
    (took, v["data"]["tracked_clients"].as_u64().unwrap_or(0))
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i]
}

#[test]
fn status_answers_within_100ms_p99_over_a_million_clients_while_metrics_are_scraped() {
    kernel_test!();
    raise_own_nofile(1000 + 256);
    let mut s = Scenario::new("rlcl").with_http(HTTP_PORT);
    s.start(&format!(
        r#"
[tracking]
max_sources = {}
new_sources_per_sec = 0

[[rule]]
name = "udp"
match = {{ protocol = "udp", dst_ports = ["9000"] }}
threshold = {{ count = 1000, interval = "1s" }}
"#,
        CLIENTS * 2
    ));
    let socket = s.daemon().socket_path().to_path_buf();

    // A million sources, one packet each.
    let t = Instant::now();
    let mut tx = s.sender();
    let base = u32::from(Ipv4Addr::new(10, 0, 0, 0));
    tx.send_n(
        (0..SOURCES).map(|i| s.udp4(Ipv4Addr::from(base + i), PORT)),
        u64::from(SOURCES),
        None,
    );
    let mut tracked = 0;
    let give_up = Instant::now() + Duration::from_secs(60);
    while Instant::now() < give_up {
        tracked = status(&socket).1;
        if tracked >= u64::from(CLIENTS) {
            break;
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    println!("{tracked} clients tracked after {:?}", t.elapsed());
    assert!(
        tracked >= u64::from(CLIENTS),
        "only {tracked} of {SOURCES} sources tracked"
    );

    // A thousand idle HTTP connections.
    let idle: Vec<TcpStream> = s.server.enter(|| {
        (0..1000)
            .filter_map(|_| {
                TcpStream::connect_timeout(
                    &([127, 0, 0, 1], HTTP_PORT).into(),
                    Duration::from_secs(5),
                )
                .ok()
            })
            .collect()
    });
    println!("{} idle HTTP connections opened", idle.len());

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
    // `/metrics` every 100 ms.
    let server = &s.server;
    std::thread::scope(|scope| {
        let scraper = {
            let stop = stop.clone();
            scope.spawn(move || {
                server.enter(move || {
                    let mut times = Vec::new();
                    let mut failed = 0;
                    while !stop.load(Ordering::Relaxed) {
                        let start = Instant::now();
                        let ok = (|| -> std::io::Result<bool> {
                            let mut c = TcpStream::connect(("127.0.0.1", HTTP_PORT))?;
                            c.set_read_timeout(Some(Duration::from_secs(30)))?;
                            c.write_all(
                                b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
                            )?;
                            let mut resp = String::new();
                            c.read_to_string(&mut resp)?;
                            Ok(resp.starts_with("HTTP/1.1 200")
                                && resp.contains("ratelimit_tracked_clients"))
                        })()
                        .unwrap_or(false);
                        let took = start.elapsed();
                        if ok {
                            times.push(took);
                        } else {
                            failed += 1;
                        }
                        std::thread::sleep(Duration::from_millis(100).saturating_sub(took));
                    }
                    (times, failed)
                })
            })
        };
        // Steady state: the reports have seen the counts keep moving (a census period or
        // two).
        std::thread::sleep(ratelimit_user::reader::CENSUS_PERIOD * 3);

        let mut took: Vec<Duration> = (0..SAMPLES)
            .map(|_| {
                let t = status(&socket).0;
                std::thread::sleep(Duration::from_millis(20));
                t
            })
            .collect();
        stop.store(true, Ordering::Relaxed);
        trickle.join().unwrap();
        let (mut scrapes, failed) = scraper.join().unwrap();
        drop(idle);
        took.sort();
        scrapes.sort();
        println!(
            "status over the control socket, {SAMPLES} requests: p50 {:?}, p99 {:?}, max {:?}",
            percentile(&took, 0.50),
            percentile(&took, 0.99),
            took[took.len() - 1]
        );
        println!(
            "/metrics every 100 ms, {} scrapes ({failed} failed): p50 {:?}, p99 {:?}, max {:?}",
            scrapes.len(),
            percentile(&scrapes, 0.50),
            percentile(&scrapes, 0.99),
            scrapes.last().copied().unwrap_or_default()
        );
        // The listener serves 64 connections at most: while the idle ones hold them (until the
        // header timeout closes them) a scrape is turned away, and counted here.
        assert!(
            scrapes.len() >= 10,
            "{} scrapes answered, {failed} turned away",
            scrapes.len()
        );
        assert!(
            percentile(&took, 0.99) < P99_BOUND,
            "status p99 {:?} over {P99_BOUND:?}",
            percentile(&took, 0.99)
        );
    });
}
