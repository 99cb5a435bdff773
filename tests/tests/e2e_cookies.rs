//! Handshake-proven admission (`tracking.syn_cookies`; docs/rules-and-semantics.md):
//! while a random-source flood spends the admission budget and empties its rule's overflow
//! state, a new legitimate TCP client still connects in a round trip, and gets state of its
//! own once its handshake proves its address.
//!
//! * The flood goes to a closed port of the rule: the listener's SYN queue has room, so the
//!   new clients' SYNs are handed to it, and their established connections prove them.
//! * The flood goes to the listening port and fills its SYN queue: the new clients' SYNs are
//!   answered from XDP with cookies of the listener, and the kernel makes the connections
//!   from their ACKs.
//! * With `syn_cookies = false` a new client's SYN is dropped in the overflow state, and it
//!   waits for a retransmission.

use std::io::{Read as _, Write as _};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU16, Ordering};
use std::time::{Duration, Instant};

use ratelimit_user::policy::report::Stats;

use ratelimit_tests::{
    Daemon, kernel_test,
    link::{add_address, add_route},
    netns::NetNs,
    packet::tcp_flags,
    scenario::{Scenario, reason, rule_counter},
};

const OPEN: u16 = 8080;
const CLOSED: u16 = 8081;
const RULE: &str = "tcp-per-client";
/// The spoofed flood's rate and its longest run.
const FLOOD_PPS: u64 = 1000;
const FLOOD_MAX: Duration = Duration::from_secs(60);
/// The listener's backlog: the flood fills its SYN queue at once.
const BACKLOG: i32 = 1;
/// A SYN answered at once connects in a round trip; a dropped one waits for the client's
/// first retransmission, 1 s later. Half of that separates the two on a busy machine.
const FAST: Duration = Duration::from_millis(500);

/// A budget of one new source a second and a rule of 200 packets a minute: the flood spends
/// the budget as soon as it refills and the overflow state within its first quarter second.
fn policy(cookies: bool) -> String {
    format!(
        r#"
[tracking]
new_sources_per_sec = 1
syn_cookies = {cookies}

[[rule]]
name = "{RULE}"
match = {{ protocol = "tcp", dst_ports = [{OPEN}, {CLOSED}] }}
key = "ip"
action = "throttle"
threshold = {{ count = 200, interval = "60s" }}
"#
    )
}

/// An echo server on `addr` in `ns` with a short SYN queue: each connection gets its first
/// line back.
fn echo_server(ns: &NetNs, addr: SocketAddr) {
    use socket2::{Domain, Socket, Type};
    let l: TcpListener = ns.enter(|| {
        let domain = if addr.is_ipv4() {
            Domain::IPV4
        } else {
            Domain::IPV6
        };
        let s = Socket::new(domain, Type::STREAM, None).unwrap();
        s.set_reuse_address(true).unwrap();
        s.bind(&addr.into()).unwrap();
        s.listen(BACKLOG).unwrap();
        s.into()
    });
    std::thread::spawn(move || {
        for c in l.incoming() {
            let Ok(mut c) = c else { continue };
            std::thread::spawn(move || {
                let _ = c.set_read_timeout(Some(Duration::from_secs(5)));
                let mut buf = [0u8; 256];
                let mut got = Vec::new();
                while !got.contains(&b'\n') {
                    match c.read(&mut buf) {
                        Ok(0) | Err(_) => return,
                        Ok(n) => got.extend_from_slice(&buf[..n]),
                    }
                }
                let _ = c.write_all(&got);
            });
        }
    });
}

/// What one exchange saw: the connect's time, and whether the connection has any of the
/// options a handshake negotiates (window scaling, SACK, timestamps: `tcpi_options`). A
/// connection made from a cookie answered from XDP has none; the kernel's own handshake (and
/// its own cookies, which carry them in the timestamp) has them all here.
#[derive(Debug, Clone, Copy)]
struct Exchange {
    connect: Duration,
    options: bool,
}

/// `tcpi_options` of a connected socket.
fn tcpi_options(c: &TcpStream) -> u8 {
    use std::os::fd::AsRawFd as _;
    // SAFETY: getsockopt(2) writes at most `len` bytes of a `tcp_info` into `info`.
    unsafe {
        let mut info: libc::tcp_info = std::mem::zeroed();
        let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
        let rc = libc::getsockopt(
            c.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            &mut info as *mut _ as *mut libc::c_void,
            &mut len,
        );
        assert_eq!(rc, 0, "TCP_INFO");
        info.tcpi_options
    }
}

/// Connect from `src` to `server` (within `timeout`), send a line and read it back: what it
/// saw, or why it failed.
fn exchange(src: IpAddr, server: SocketAddr, timeout: Duration) -> Result<Exchange, String> {
    use socket2::{Domain, Socket, Type};
    let domain = if src.is_ipv4() {
        Domain::IPV4
    } else {
        Domain::IPV6
    };
    let sock = Socket::new(domain, Type::STREAM, None).map_err(|e| format!("socket: {e}"))?;
    sock.bind(&SocketAddr::new(src, 0).into())
        .map_err(|e| format!("bind {src}: {e}"))?;
    let t0 = Instant::now();
    sock.connect_timeout(&server.into(), timeout)
        .map_err(|e| format!("connect: {:?}", e.kind()))?;
    let took = t0.elapsed();
    let mut c: TcpStream = sock.into();
    let options = tcpi_options(&c) != 0;
    c.set_read_timeout(Some(Duration::from_secs(3)))
        .map_err(|e| e.to_string())?;
    let line = format!("hello from {src}\n");
    c.write_all(line.as_bytes())
        .map_err(|e| format!("send: {e}"))?;
    let mut back = vec![0u8; line.len()];
    c.read_exact(&mut back)
        .map_err(|e| format!("read: {:?}", e.kind()))?;
    if back != line.as_bytes() {
        return Err(format!("echo: {:?}", String::from_utf8_lossy(&back)));
    }
    Ok(Exchange {
        connect: took,
        options,
    })
}

/// The namespace's TcpExt counter `name`.
fn tcp_ext(ns: &NetNs, name: &str) -> i64 {
    let text = ns.enter(|| std::fs::read_to_string("/proc/thread-self/net/netstat").unwrap());
    let lines: Vec<&str> = text.lines().collect();
    for pair in lines.chunks(2) {
        let [head, vals] = pair else { continue };
        if let Some((_, v)) = head
            .split_whitespace()
            .zip(vals.split_whitespace())
            .find(|(k, _)| *k == name)
        {
            return v.parse().unwrap();
        }
    }
    panic!("no TcpExt {name}");
}

/// Spoofed SYNs from random sources (10.0.0.0/8 and /64s of 2001:db8:ff00::/40, in turn) to port
/// `port` (which may change) until `stop`, or for `FLOOD_MAX` at most: what was sent.
fn flood(
    s: &Scenario,
    port: Arc<AtomicU16>,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<u64> {
    let mut tx = s.sender();
    let (b4, b6, builder) = (s.pair.b().ipv4, s.pair.b().ipv6, s.builder());
    std::thread::spawn(move || {
        let t0 = Instant::now();
        let mut sent = 0;
        let mut n: u32 = 0x9e37_79b9;
        while !stop.load(Ordering::Relaxed) && t0.elapsed() < FLOOD_MAX {
            let dport = port.load(Ordering::Relaxed);
            let st = tx.send_rate(
                |i| {
                    n = n.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                    let f = if i % 2 == 0 {
                        builder
                            .clone()
                            .ipv4(Ipv4Addr::from(0x0a00_0000 | (n >> 8)), b4)
                    } else {
                        // A /64 of its own each time (the rule keys IPv6 by /64).
                        let src = Ipv6Addr::from(
                            (0x20_010d_b8ffu128 << 88) | (((n >> 8) as u128) << 64) | 1,
                        );
                        builder.clone().ipv6(src, b6)
                    };
                    f.tcp(40000 + (n & 0x3ff) as u16, dport, tcp_flags::SYN)
                        .build()
                },
                FLOOD_PPS,
                Duration::from_millis(200),
            );
            sent += st.sent;
        }
        sent
    })
}

/// The lab: clients' addresses on the client end, echo servers (both families) on the server
/// end, the daemon attached with `policy(true)`.
struct Lab {
    /// Dropped (detached) before the scenario.
    _peer: Daemon,
    s: Scenario,
    v4: Vec<IpAddr>,
    v6: Vec<IpAddr>,
    server4: SocketAddr,
    server6: SocketAddr,
}

impl Lab {
    fn new() -> Lab {
        Lab::with_policy("rlck", &policy(true))
    }

    /// The lab in namespaces tagged `tag`, with the daemon on `policy`.
    fn with_policy(tag: &str, policy: &str) -> Lab {
        let mut s = Scenario::new(tag);
        let (a, b) = (s.pair.a().clone(), s.pair.b().clone());
        let net = s.pair.index();
        let v4: Vec<IpAddr> = (0..12)
            .map(|i| IpAddr::V4(Ipv4Addr::new(198, 18, net, 101 + i)))
            .collect();
        // Each IPv6 client in a /64 of its own (the rule keys IPv6 sources by /64), routed
        // on-link from the server.
        let v6: Vec<IpAddr> = (0..12)
            .map(|i| {
                IpAddr::V6(Ipv6Addr::new(
                    0x2001,
                    0xdb8,
                    net as u16,
                    0x100 + i,
                    0,
                    0,
                    0,
                    1,
                ))
            })
            .collect();
        for ip in v4.iter().chain(&v6) {
            let len = if ip.is_ipv4() { 24 } else { 64 };
            add_address(&s.client, &a.name, &format!("{ip}/{len}"));
        }
        add_route(&s.server, &format!("2001:db8:{net:x}::/48"), &b.name, None);
        // Answers to the flood's sources leave by a default route, as on a host on the
        // Internet: without one the kernel keeps no half-open connection for them.
        add_route(&s.server, "default", &b.name, Some(&a.ipv4.to_string()));
        add_route(&s.server, "default", &b.name, Some(&a.ipv6.to_string()));
        let server4 = SocketAddr::new(IpAddr::V4(b.ipv4), OPEN);
        let server6 = SocketAddr::new(IpAddr::V6(b.ipv6), OPEN);
        echo_server(&s.server, server4);
        echo_server(&s.server, server6);
        s.start(policy);
        let peer = s.peer_program();
        Lab {
            _peer: peer,
            s,
            v4,
            v6,
            server4,
            server6,
        }
    }

    /// One exchange from each of `srcs`, one after another: the connect times, or a panic
    /// that says what the program counted.
    fn clients(&self, srcs: &[IpAddr], what: &str) -> Vec<Exchange> {
        let mut took = Vec::new();
        for src in srcs {
            let server = if src.is_ipv4() {
                self.server4
            } else {
                self.server6
            };
            let r = self
                .s
                .client
                .enter(|| exchange(*src, server, Duration::from_secs(3)));
            let t = r.unwrap_or_else(|e| {
                panic!(
                    "{what}: {src}: {e}; {}; server veth {:?}; client veth {:?}",
                    self.counters(),
                    self.s.pair.b().ethtool_stats(),
                    self.s.pair.a().ethtool_stats()
                )
            });
            took.push(t);
        }
        let ms: Vec<String> = took
            .iter()
            .map(|t| {
                format!(
                    "{:.1}{}",
                    t.connect.as_secs_f64() * 1e3,
                    if t.options { "" } else { " (no options)" }
                )
            })
            .collect();
        println!("{what}: connect times (ms): {}", ms.join(", "));
        took
    }

    fn counters(&self) -> String {
        let st = self.s.stats();
        let names = [
            "state_created",
            "admission_refused",
            "syn_cookies_sent",
            "syn_to_listener",
            "sources_proven",
            "proven_admitted",
            "connection_passed",
        ];
        let ours: Vec<String> = names
            .iter()
            .map(|n| format!("{n} {}", reason(&st, n)))
            .collect();
        format!(
            "{}; kernel SyncookiesSent {} SyncookiesRecv {} SyncookiesFailed {}",
            ours.join(", "),
            tcp_ext(&self.s.server, "SyncookiesSent"),
            tcp_ext(&self.s.server, "SyncookiesRecv"),
            tcp_ext(&self.s.server, "SyncookiesFailed"),
        )
    }
}

#[test]
fn new_tcp_clients_connect_at_once_while_a_flood_spends_the_admission_budget() {
    kernel_test!();
    let mut lab = Lab::new();
    let port = Arc::new(AtomicU16::new(CLOSED));
    let stop = Arc::new(AtomicBool::new(false));
    let flooding = flood(&lab.s, port.clone(), stop.clone());
    // The flood under way: the budget spent, the overflow state empty.
    std::thread::sleep(Duration::from_millis(1500));
    let st0 = lab.s.stats();
    assert!(
        reason(&st0, "admission_refused") > 500,
        "the flood did not spend the budget: {}",
        lab.counters()
    );
    assert_eq!(
        reason(&st0, "syn_cookies_sent") + reason(&st0, "syn_to_listener"),
        0,
        "a SYN to a closed port was answered or passed"
    );

    // (a) The listener has room: five new clients of each family are handed to it, connect
    // in a round trip, and their line comes back (the data needs the state the established
    // connection earned).
    let first: Vec<IpAddr> = lab.v4[..5].iter().chain(&lab.v6[..5]).copied().collect();
    let took = lab.clients(&first, "listener with room");
    let st1 = lab.s.stats();
    let d = |a: &Stats, b: &Stats, n: &str| reason(b, n) - reason(a, n);
    println!("{}", lab.counters());
    // A client's SYN may find the budget just refilled (the flood takes it within about a
    // millisecond of each refill): it then gets state at once and needs no proof. At most two
    // of ten are allowed that luck.
    let handed = d(&st0, &st1, "syn_to_listener");
    assert!(
        (8..=10).contains(&handed),
        "SYNs handed to the listener: {handed}"
    );
    // Each handed-over source is proven by its established connection and given state once
    // (the proof may ride on the exchange's last packets: a moment to count them).
    let settled = |want: u64| {
        let t0 = Instant::now();
        loop {
            let st = lab.s.stats();
            let (p, a) = (
                d(&st0, &st, "sources_proven"),
                d(&st0, &st, "proven_admitted"),
            );
            if (p, a) == (want, want) || t0.elapsed() > Duration::from_secs(2) {
                return (p, a);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    assert_eq!(settled(handed), (handed, handed), "{}", lab.counters());
    assert_eq!(d(&st0, &st1, "syn_cookies_sent"), 0);
    for (src, t) in first.iter().zip(&took) {
        assert!(t.connect < FAST, "{src} connected after {t:?}");
        assert!(
            t.options,
            "{src}: the kernel's own handshake negotiates options: {t:?}"
        );
    }
    // Each now has state of its own: its next connection is judged there.
    let again = lab.clients(&[first[0], first[5]], "again, with state");
    assert!(again.iter().all(|t| t.connect < FAST && t.options));
    let st2 = lab.s.stats();
    assert_eq!(d(&st1, &st2, "syn_to_listener"), 0);
    assert!(
        rule_counter(&st2, RULE, "admitted") >= 12,
        "{}",
        lab.counters()
    );

    // (b) The flood moves to the listening port and fills its SYN queue: the new clients'
    // SYNs are answered with cookies from XDP, the kernel makes the connections from their
    // ACKs.
    port.store(OPEN, Ordering::Relaxed);
    std::thread::sleep(Duration::from_millis(1500));
    let st3 = lab.s.stats();
    let recv0 = tcp_ext(&lab.s.server, "SyncookiesRecv");
    let failed0 = tcp_ext(&lab.s.server, "SyncookiesFailed");
    assert!(
        d(&st2, &st3, "syn_cookies_sent") > 500,
        "the flood's SYNs were not answered with cookies: {}",
        lab.counters()
    );
    let second: Vec<IpAddr> = lab.v4[5..10]
        .iter()
        .chain(&lab.v6[5..10])
        .copied()
        .collect();
    let took = lab.clients(&second, "listener's SYN queue full");
    let st4 = lab.s.stats();
    println!("{}", lab.counters());
    let recv = tcp_ext(&lab.s.server, "SyncookiesRecv") - recv0;
    for (src, t) in second.iter().zip(&took) {
        assert!(t.connect < FAST, "{src} connected after {t:?}");
    }
    // As above, at most two may have found the budget refilled, or the queue with room. The
    // connections made from cookies answered here have no options (the kernel's own cookies
    // would carry them in the timestamp): as many as the kernel made from cookies.
    let bare = took.iter().filter(|t| !t.options).count() as i64;
    assert!(
        (8..=10).contains(&recv) && bare == recv,
        "connections made from cookies: {recv}, without options: {bare}"
    );
    assert_eq!(tcp_ext(&lab.s.server, "SyncookiesFailed") - failed0, 0);
    assert!(d(&st3, &st4, "sources_proven") >= recv as u64);

    // (c) Cookies off (a reload): a new client's SYN is dropped in the overflow state, and it
    // is not connected within the time an answer takes (one of four may find the budget
    // just refilled).
    let cfg = std::fs::read_to_string(lab.s.daemon().config_path()).unwrap();
    let off = cfg.replace("syn_cookies = true", "syn_cookies = false");
    assert_ne!(cfg, off);
    lab.s.daemon_mut().write_config(&off);
    lab.s.daemon().cli_ok(&["reload"]);
    let st5 = lab.s.stats();
    let mut connected = 0;
    for src in [lab.v4[10], lab.v6[10], lab.v4[11], lab.v6[11]] {
        let server = if src.is_ipv4() {
            lab.server4
        } else {
            lab.server6
        };
        let r = lab.s.client.enter(|| exchange(src, server, FAST));
        println!("cookies off, new client {src}: {r:?}");
        connected += r.is_ok() as u32;
    }
    assert!(
        connected <= 1,
        "{connected} of 4 connected without an answer from XDP"
    );
    let st6 = lab.s.stats();
    assert_eq!(d(&st5, &st6, "syn_cookies_sent"), 0);
    assert_eq!(d(&st5, &st6, "syn_to_listener"), 0);
    stop.store(true, Ordering::Relaxed);
    let n = flooding.join().unwrap();
    println!("flood: {n} spoofed SYNs");
}

/// One handshake proves its own source, not the /64 it is in: under a rule that keys IPv6
/// sources by the whole address (`ipv6_prefix = 128`), after one client of a /64 proved itself,
/// a hundred other addresses of that /64 sending SYNs while the flood spends the admission
/// budget get no state past the budget (before, the proof was kept by /64, and every one of
/// them was admitted as proven).
#[test]
fn one_proof_does_not_admit_the_rest_of_its_64_past_the_admission_budget() {
    kernel_test!();
    let policy = policy(true).replace("key = \"ip\"\n", "key = \"ip\"\nipv6_prefix = 128\n");
    assert!(policy.contains("ipv6_prefix = 128"));
    let lab = Lab::with_policy("rlck6", &policy);
    let port = Arc::new(AtomicU16::new(CLOSED));
    let stop = Arc::new(AtomicBool::new(false));
    let flooding = flood(&lab.s, port, stop.clone());
    std::thread::sleep(Duration::from_millis(1500));
    let st0 = lab.s.stats();
    assert!(
        reason(&st0, "admission_refused") > 500,
        "the flood did not spend the budget: {}",
        lab.counters()
    );
    let d = |a: &Stats, b: &Stats, n: &str| reason(b, n) - reason(a, n);
    // Client A proves itself (its SYN is handed to the listener, its connection established;
    // it may also find the budget just refilled: then it needs no proof, so try a few).
    let mut proven = false;
    for src in &lab.v6[..4] {
        let before = lab.s.stats();
        lab.clients(&[*src], "client A");
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs(2) {
            if d(&before, &lab.s.stats(), "sources_proven") >= 1 {
                proven = true;
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        if proven {
            println!("proven: {src}");
            break;
        }
    }
    assert!(proven, "no client proved itself: {}", lab.counters());
    // B..: a hundred other addresses, 25 in the /64 of each client tried (the proven one's
    // among them), SYNs to the closed port while the flood goes on.
    let st1 = lab.s.stats();
    let mut tx = lab.s.sender();
    let (b6, builder) = (lab.s.pair.b().ipv6, lab.s.builder());
    let mut frames = Vec::new();
    for v in &lab.v6[..4] {
        let IpAddr::V6(v) = v else { unreachable!() };
        let s = v.segments();
        for i in 0..25u16 {
            let src = Ipv6Addr::new(s[0], s[1], s[2], s[3], 0xb, 0, 0, 0x100 + i);
            frames.push(
                builder
                    .clone()
                    .ipv6(src, b6)
                    .tcp(41000 + i, CLOSED, tcp_flags::SYN)
                    .build(),
            );
        }
    }
    let n = frames.len() as u64;
    tx.send_n(frames.iter(), n, Some(Duration::from_millis(2)));
    std::thread::sleep(Duration::from_millis(300));
    let st2 = lab.s.stats();
    println!("{}", lab.counters());
    stop.store(true, Ordering::Relaxed);
    flooding.join().unwrap();
    let admitted = d(&st1, &st2, "proven_admitted");
    assert!(
        admitted == 0,
        "{admitted} of {n} other addresses of a proven client's /64 were admitted as proven"
    );
}
