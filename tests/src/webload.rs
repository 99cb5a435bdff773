//! Web load for the real-tools labs: real TCP clients, each from its own address, fetching a
//! page from nginx on a new connection per request, what they measured, and the counters that
//! say where packets went (`/proc/net/netstat` and `snmp` of both ends, the veths' `ethtool -S`
//! and drop counters, the kernel's backlog drops).

use std::collections::{BTreeMap, HashMap};
use std::io::{Read as _, Write as _};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::time::{Duration, Instant};

use crate::{nginx::INDEX, scenario::Scenario};

/// A request that takes longer than this (connect, send, whole answer) failed.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);
/// Pause between a client's requests: 20 clients at most ~20 requests/s each.
pub const THINK: Duration = Duration::from_millis(50);
/// Size of the served file.
pub const BODY: usize = 2048;

/// What one phase measured.
#[derive(Debug, Default)]
pub struct Outcome {
    pub label: String,
    pub requests: u64,
    pub failures: u64,
    /// Failures by kind (connect timeout, read timeout, reset, ...).
    pub failure_kinds: BTreeMap<String, u64>,
    /// Successful requests' latencies, sorted.
    pub latencies: Vec<Duration>,
    pub flood_sent: Option<u64>,
    pub heavy_sent: Option<u64>,
    /// Counter deltas over the phase, by name, nonzero only.
    pub evidence: BTreeMap<String, i64>,
    /// Each late client's wait from its first attempt to its first answer (retrying failed
    /// requests), or None if it was not served before the phase ended.
    pub late: Vec<Option<Duration>>,
}

impl Outcome {
    pub fn pct(&self, p: f64) -> Duration {
        if self.latencies.is_empty() {
            return Duration::ZERO;
        }
        let i = ((self.latencies.len() as f64 * p).ceil() as usize).clamp(1, self.latencies.len());
        self.latencies[i - 1]
    }

    pub fn max(&self) -> Duration {
        self.latencies.last().copied().unwrap_or_default()
    }

    pub fn slow(&self, over: Duration) -> usize {
        self.latencies.iter().filter(|&&l| l >= over).count()
    }

    pub fn line(&self) -> String {
        let ms = |d: Duration| d.as_secs_f64() * 1000.0;
        format!(
            "{:<34} requests {:>5}  failed {:>3} ({:.2}%)  p50 {:>7.2} ms  p99 {:>7.2} ms  max {:>7.2} ms  >=200ms {:>3}  hping3 flood {:?} heavy {:?}  failures {:?}",
            self.label,
            self.requests,
            self.failures,
            100.0 * self.failures as f64 / self.requests.max(1) as f64,
            ms(self.pct(0.50)),
            ms(self.pct(0.99)),
            ms(self.max()),
            self.slow(Duration::from_millis(200)),
            self.flood_sent,
            self.heavy_sent,
            self.failure_kinds,
        )
    }
}

/// One HTTP/1.1 request on a new connection from `src`: its latency, or why it failed.
pub fn request(src: Ipv4Addr, server: SocketAddr) -> Result<Duration, String> {
    use socket2::{Domain, Socket, Type};
    let t0 = Instant::now();
    let deadline = t0 + REQUEST_TIMEOUT;
    let left = || deadline.saturating_duration_since(Instant::now());
    let sock = Socket::new(Domain::IPV4, Type::STREAM, None).map_err(|e| format!("socket: {e}"))?;
    sock.bind(&SocketAddr::V4(SocketAddrV4::new(src, 0)).into())
        .map_err(|e| format!("bind: {e}"))?;
    sock.connect_timeout(&server.into(), REQUEST_TIMEOUT)
        .map_err(|e| format!("connect: {:?}", e.kind()))?;
    let mut c: std::net::TcpStream = sock.into();
    c.set_write_timeout(Some(left().max(Duration::from_millis(1))))
        .map_err(|e| e.to_string())?;
    write!(
        c,
        "GET /{INDEX} HTTP/1.1\r\nHost: {server}\r\nConnection: close\r\n\r\n"
    )
    .map_err(|e| format!("send: {:?}", e.kind()))?;
    let mut got = Vec::with_capacity(BODY + 512);
    let mut buf = [0u8; 4096];
    loop {
        let left = left();
        if left.is_zero() {
            return Err("read: TimedOut".into());
        }
        c.set_read_timeout(Some(left)).map_err(|e| e.to_string())?;
        match c.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) => return Err(format!("read: {:?}", e.kind())),
        }
    }
    let elapsed = t0.elapsed();
    if elapsed > REQUEST_TIMEOUT {
        return Err("read: TimedOut".into());
    }
    if !got.starts_with(b"HTTP/1.1 200") || got.len() < BODY {
        return Err(format!(
            "answer: {:?}",
            String::from_utf8_lossy(&got[..got.len().min(40)])
        ));
    }
    Ok(elapsed)
}

/// A new client: requests from `src` until one is answered; how long that took from the first
/// attempt, or None if none was before `until`.
pub fn first_service(src: Ipv4Addr, server: SocketAddr, until: Instant) -> Option<Duration> {
    let t0 = Instant::now();
    while Instant::now() < until {
        if request(src, server).is_ok() {
            return Some(t0.elapsed());
        }
    }
    None
}

/// The clients: one thread each (in the caller's namespace), requests until `until`.
pub fn run_clients(srcs: &[Ipv4Addr], server: SocketAddr, until: Instant) -> Outcome {
    let results: Vec<Vec<Result<Duration, String>>> = std::thread::scope(|s| {
        let handles: Vec<_> = srcs
            .iter()
            .map(|&src| {
                s.spawn(move || {
                    let mut out = Vec::new();
                    while Instant::now() < until {
                        out.push(request(src, server));
                        std::thread::sleep(THINK);
                    }
                    out
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut o = Outcome::default();
    for r in results.into_iter().flatten() {
        o.requests += 1;
        match r {
            Ok(l) => o.latencies.push(l),
            Err(kind) => {
                o.failures += 1;
                *o.failure_kinds.entry(kind).or_default() += 1;
            }
        }
    }
    o.latencies.sort();
    o
}

/// Counters that say where packets went, read at one moment.
pub fn snapshot(s: &Scenario) -> HashMap<String, i64> {
    let mut m = HashMap::new();
    let wanted_tcp = [
        "ListenOverflows",
        "ListenDrops",
        "TCPReqQFullDrop",
        "TCPReqQFullDoCookies",
        "SyncookiesSent",
        "SyncookiesRecv",
        "SyncookiesFailed",
        "TCPBacklogDrop",
        "TCPTimeouts",
        "TCPSynRetrans",
        "TCPAbortOnTimeout",
        "PAWSEstab",
        "TCPLostRetransmit",
        "RetransSegs",
        "InErrs",
        "AttemptFails",
        "OutRsts",
    ];
    for (side, ns) in [("server", &s.server), ("client", &s.client)] {
        let text = ns.enter(|| {
            ["netstat", "snmp"]
                .iter()
                .map(|f| std::fs::read_to_string(format!("/proc/thread-self/net/{f}")).unwrap())
                .collect::<Vec<_>>()
                .join("")
        });
        let lines: Vec<&str> = text.lines().collect();
        for pair in lines.chunks(2) {
            let [head, vals] = pair else { continue };
            for (k, v) in head.split_whitespace().zip(vals.split_whitespace()).skip(1) {
                if wanted_tcp.contains(&k)
                    && let Ok(v) = v.parse::<i64>()
                {
                    m.insert(format!("{side} {k}"), v);
                }
            }
        }
    }
    for (side, end) in [("server veth", s.pair.b()), ("client veth", s.pair.a())] {
        for (k, v) in end.ethtool_stats() {
            if k != "peer_ifindex" {
                m.insert(format!("{side} ethtool {k}"), v as i64);
            }
        }
        let ns = if side.starts_with("server") {
            &s.server
        } else {
            &s.client
        };
        let out = ns.ip(&["-s", "-j", "link", "show", "dev", &end.name]);
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        for dir in ["rx", "tx"] {
            for what in ["packets", "dropped"] {
                if let Some(n) = v[0]["stats64"][dir][what].as_i64() {
                    m.insert(format!("{side} {dir}_{what}"), n);
                }
            }
        }
    }
    // The kernel's per-CPU backlog (netif_rx) drops and squeezes, machine-wide.
    let softnet = std::fs::read_to_string("/proc/net/softnet_stat").unwrap();
    let (mut dropped, mut squeezed) = (0, 0);
    for l in softnet.lines() {
        let cols: Vec<i64> = l
            .split_whitespace()
            .map(|c| i64::from_str_radix(c, 16).unwrap_or(0))
            .collect();
        dropped += cols.get(1).copied().unwrap_or(0);
        squeezed += cols.get(2).copied().unwrap_or(0);
    }
    m.insert("softnet dropped".into(), dropped);
    m.insert("softnet time_squeeze".into(), squeezed);
    m
}

pub fn delta(before: &HashMap<String, i64>, after: &HashMap<String, i64>) -> BTreeMap<String, i64> {
    after
        .iter()
        .map(|(k, v)| (k.clone(), v - before.get(k).copied().unwrap_or(0)))
        .filter(|(_, d)| *d != 0)
        .collect()
}

/// A kept-alive HTTP/1.1 connection to nginx: one request after another on the same TCP
/// connection, as a long-lived client's.
#[derive(Debug)]
pub struct KeepAlive {
    conn: std::net::TcpStream,
    server: SocketAddr,
}

impl KeepAlive {
    /// Connects from `src` (in the caller's namespace) and makes a first request.
    pub fn open(src: Ipv4Addr, server: SocketAddr) -> Result<KeepAlive, String> {
        use socket2::{Domain, Socket, Type};
        let sock =
            Socket::new(Domain::IPV4, Type::STREAM, None).map_err(|e| format!("socket: {e}"))?;
        sock.bind(&SocketAddr::V4(SocketAddrV4::new(src, 0)).into())
            .map_err(|e| format!("bind: {e}"))?;
        sock.connect_timeout(&server.into(), REQUEST_TIMEOUT)
            .map_err(|e| format!("connect: {:?}", e.kind()))?;
        let mut k = KeepAlive {
            conn: sock.into(),
            server,
        };
        k.request()?;
        Ok(k)
    }

    /// One request on the connection: its latency, or why it failed.
    pub fn request(&mut self) -> Result<Duration, String> {
        let t0 = Instant::now();
        let c = &mut self.conn;
        c.set_write_timeout(Some(REQUEST_TIMEOUT))
            .map_err(|e| e.to_string())?;
        c.set_read_timeout(Some(REQUEST_TIMEOUT))
            .map_err(|e| e.to_string())?;
        write!(
            c,
            "GET /{INDEX} HTTP/1.1\r\nHost: {}\r\nConnection: keep-alive\r\n\r\n",
            self.server
        )
        .map_err(|e| format!("send: {:?}", e.kind()))?;
        let mut got = Vec::with_capacity(BODY + 512);
        let mut buf = [0u8; 4096];
        // Headers, then exactly Content-Length bytes of body.
        let mut want = None;
        loop {
            if let Some(w) = want
                && got.len() >= w
            {
                break;
            }
            if t0.elapsed() > REQUEST_TIMEOUT {
                return Err("read: TimedOut".into());
            }
            match c.read(&mut buf) {
                Ok(0) => return Err("read: closed".into()),
                Ok(n) => got.extend_from_slice(&buf[..n]),
                Err(e) => return Err(format!("read: {:?}", e.kind())),
            }
            if want.is_none()
                && let Some(end) = got.windows(4).position(|w| w == b"\r\n\r\n")
            {
                let head = String::from_utf8_lossy(&got[..end]).to_ascii_lowercase();
                if !head.starts_with("http/1.1 200") {
                    return Err(format!("answer: {:?}", &head[..head.len().min(40)]));
                }
                let len = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length:"))
                    .and_then(|v| v.trim().parse::<usize>().ok())
                    .ok_or("answer: no content-length")?;
                want = Some(end + 4 + len);
            }
        }
        Ok(t0.elapsed())
    }
}

/// The web lab: a fresh scenario with nginx on its protected end (port 80, 2 workers,
/// [`BODY`] bytes a page) and a default route there, so that answers to spoofed sources leave
/// as on a host on the Internet (without one the server could not answer them, and would keep
/// no state for them). nginx stops before the scenario goes (fields drop in order).
pub struct WebLab {
    pub nginx: crate::nginx::Nginx,
    pub server: SocketAddr,
    pub s: Scenario,
}

impl WebLab {
    /// The lab, its names prefixed by `prefix`.
    pub fn new(prefix: &str) -> WebLab {
        let s = Scenario::new(prefix);
        let (a, b) = (s.pair.a().clone(), s.pair.b().clone());
        crate::link::add_route(&s.server, "default", &b.name, Some(&a.ipv4.to_string()));
        let server = SocketAddr::V4(SocketAddrV4::new(b.ipv4, 80));
        let nginx = crate::nginx::Nginx::start(&s.server, server, 2, BODY);
        WebLab { nginx, server, s }
    }

    /// `n` client addresses on the client end from `.first` of the lab's /24, each its own.
    pub fn clients(&self, first: u8, n: u8) -> Vec<Ipv4Addr> {
        let a = self.s.pair.a();
        let net = self.s.pair.index();
        (0..n)
            .map(|i| {
                let src = Ipv4Addr::new(198, 18, net, first + i);
                crate::link::add_address(&self.s.client, &a.name, &format!("{src}/24"));
                src
            })
            .collect()
    }

    /// One request from each of `srcs`, each of which must be served (addresses resolved,
    /// nginx warm).
    pub fn warm(&self, label: &str, srcs: &[Ipv4Addr]) {
        let server = self.server;
        let warm = self.s.client.enter(|| {
            srcs.iter()
                .map(|&src| request(src, server))
                .collect::<Vec<_>>()
        });
        for (src, r) in srcs.iter().zip(&warm) {
            assert!(r.is_ok(), "{label}: warm-up request from {src}: {r:?}");
        }
    }
}
