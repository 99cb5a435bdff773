//! The read-only HTTP listener against clients that do not play along: a thousand idle
//! connections, a client that sends its headers a byte at a time, and a `/v1/top` asking for
//! more than any answer may hold. The daemon runs with the file-descriptor limit a systemd
//! service gets by default (1,024), so a listener that kept every connection would run out.

use std::{
    io::{Read as _, Write as _},
    net::TcpStream,
    process::Command,
    time::{Duration, Instant},
};

use ratelimit_tests::{
    daemon::run_with_timeout, env::raise_own_nofile, kernel_test, scenario::Scenario,
};
use ratelimit_user::{
    policy::report::Ban,
    serve::http::{HEADER_READ_TIMEOUT, MAX_CONNECTIONS},
    serve::http_slots::{MAX_PER_PEER, METRICS_SLOTS},
};

const HTTP_PORT: u16 = 9477;

/// The soft RLIMIT_NOFILE systemd gives a service by default (`DefaultLimitNOFILE=1024:524288`),
/// which the shipped unit does not raise.
const SERVICE_NOFILE: u64 = 1024;

/// Lower the running daemon's soft file-descriptor limit to `soft`.
fn set_nofile(pid: u32, soft: u64) {
    let mut old = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: reads the limits of our own child into a valid struct.
    let rc = unsafe {
        libc::prlimit(
            pid as libc::pid_t,
            libc::RLIMIT_NOFILE,
            std::ptr::null(),
            &mut old,
        )
    };
    assert_eq!(rc, 0, "prlimit: {}", std::io::Error::last_os_error());
    let new = libc::rlimit {
        rlim_cur: soft,
        rlim_max: old.rlim_max.max(soft),
    };
    // SAFETY: sets the limits of our own child from a valid struct.
    let rc = unsafe {
        libc::prlimit(
            pid as libc::pid_t,
            libc::RLIMIT_NOFILE,
            &new,
            std::ptr::null_mut(),
        )
    };
    assert_eq!(rc, 0, "prlimit: {}", std::io::Error::last_os_error());
}

/// The daemon's open file descriptors and its soft limit, from /proc.
fn fds_and_limit(pid: u32) -> (usize, u64) {
    let open = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .count();
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
    let soft = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .and_then(|l| l.split_whitespace().nth(3))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no open-files limit in {limits}"));
    (open, soft)
}

/// `ratelimit ARGS --socket ...`, timed, with its own deadline.
fn timed_cli(
    s: &Scenario,
    args: &[&str],
    deadline: Duration,
) -> (Result<String, String>, Duration) {
    let mut cmd = Command::new(ratelimit_tests::ratelimit_bin());
    cmd.args(args).arg("--socket").arg(s.daemon().socket_path());
    let start = Instant::now();
    let out = run_with_timeout(&mut cmd, deadline);
    let took = start.elapsed();
    let out = out.and_then(|o| {
        if o.status.success() {
            Ok(String::from_utf8_lossy(&o.stdout).into_owned())
        } else {
            Err(format!(
                "exit {}: {}",
                o.status,
                String::from_utf8_lossy(&o.stderr).trim()
            ))
        }
    });
    (out, took)
}

/// How many of `conns` the server has not closed (yet): a read that would block.
fn still_open(conns: &[TcpStream]) -> usize {
    let mut buf = [0u8; 512];
    conns
        .iter()
        .filter(|c| {
            c.set_nonblocking(true).unwrap();
            let open = matches!(
                (&**c).read(&mut buf),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock
            );
            c.set_nonblocking(false).unwrap();
            open
        })
        .count()
}

/// Whether the server closed `c` (EOF or reset) within `within`.
fn closed_within(c: &mut TcpStream, within: Duration) -> bool {
    let give_up = Instant::now() + within;
    let mut buf = [0u8; 512];
    loop {
        let left = give_up.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return false;
        }
        c.set_read_timeout(Some(left)).unwrap();
        match c.read(&mut buf) {
            Ok(0) => return true,
            // A 408 or 400 the server sends as it gives up, then the close.
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return true,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                return false;
            }
            Err(e) => panic!("reading from the listener: {e}"),
        }
    }
}

/// A thousand idle connections and a slow client: the control socket still answers (`status`,
/// `ban add`), the listener still serves, excess connections are closed at once (and counted),
/// and every idle or slow one is closed within the header timeout.
#[test]
fn a_thousand_idle_http_connections_do_not_stall_the_daemon() {
    kernel_test!();
    let conns = 1000;
    raise_own_nofile(conns as u64 + 256);
    let mut s = Scenario::new("rlhc").with_http(HTTP_PORT);
    s.start("");
    let pid = s.daemon().pid().unwrap();
    set_nofile(pid, SERVICE_NOFILE);
    let (open, limit) = fds_and_limit(pid);
    println!("daemon: {open} fds open, soft limit {limit}");
    assert_eq!(limit, SERVICE_NOFILE);
    assert!(
        open + conns > limit as usize,
        "{conns} connections would not exhaust {limit} fds with {open} open: the test proves nothing"
    );

    // A slow client: a header byte every 500 ms, never the end of the headers.
    let slow_start = Instant::now();
    let slow = s.server.enter(move || {
        let mut c = TcpStream::connect(("127.0.0.1", HTTP_PORT)).unwrap();
        c.write_all(b"GET /v1/status HTTP/1.1\r\n").unwrap();
        c
    });
    let slow_writer = {
        let mut c = slow.try_clone().unwrap();
        std::thread::spawn(move || {
            for _ in 0..40 {
                std::thread::sleep(Duration::from_millis(500));
                if c.write_all(b"X").is_err() {
                    return;
                }
            }
        })
    };
    let opened = Instant::now();
    let mut idle: Vec<TcpStream> = s.server.enter(move || {
        (0..conns)
            .map(|i| {
                TcpStream::connect_timeout(
                    &([127, 0, 0, 1], HTTP_PORT).into(),
                    Duration::from_secs(5),
                )
                .unwrap_or_else(|e| panic!("connection {i}: {e}"))
            })
            .collect()
    });
    let opening = opened.elapsed();
    println!("{conns} connections open after {opening:?}");
    // Those over the cap are closed as soon as the listener takes them.
    let give_up = Instant::now() + Duration::from_secs(3);
    let mut open_now = still_open(&idle);
    while open_now > MAX_CONNECTIONS && Instant::now() < give_up {
        std::thread::sleep(Duration::from_millis(100));
        open_now = still_open(&idle);
    }
    println!(
        "{open_now} still open {:?} after the first was opened (cap {MAX_CONNECTIONS})",
        opened.elapsed()
    );
    assert!(
        open_now <= MAX_CONNECTIONS,
        "{open_now} connections are held open, more than the cap of {MAX_CONNECTIONS}"
    );

    let (out, took) = timed_cli(&s, &["status", "--json"], Duration::from_secs(10));
    out.unwrap_or_else(|e| {
        panic!("`ratelimit status` with {conns} idle HTTP connections failed after {took:?}: {e}")
    });
    println!("status answered in {took:?}");
    assert!(took < Duration::from_secs(2), "status took {took:?}");
    let (out, took) = timed_cli(
        &s,
        &["ban", "add", "203.0.113.7", "--for", "1h"],
        Duration::from_secs(10),
    );
    out.unwrap_or_else(|e| {
        panic!("`ratelimit ban add` with {conns} idle HTTP connections failed after {took:?}: {e}")
    });
    assert!(took < Duration::from_secs(2), "ban add took {took:?}");

    // Every idle connection the listener kept is closed when its header timeout passes (a
    // generous 5 s on top for a busy machine).
    let deadline = Instant::now() + HEADER_READ_TIMEOUT + Duration::from_secs(5);
    for (i, c) in idle.iter_mut().enumerate() {
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(
            closed_within(c, left.max(Duration::from_millis(1))),
            "idle connection {i} still open {:?} after it was opened",
            opened.elapsed()
        );
    }
    println!(
        "all {conns} idle connections closed after {:?}",
        opened.elapsed()
    );
    let mut slow = slow;
    assert!(
        closed_within(
            &mut slow,
            (slow_start + HEADER_READ_TIMEOUT + Duration::from_secs(5))
                .saturating_duration_since(Instant::now())
                .max(Duration::from_millis(1))
        ),
        "the slow client still connected {:?} after it started",
        slow_start.elapsed()
    );
    slow_writer.join().unwrap();
    drop(idle);

    // The listener serves again, and counted the connections it refused.
    let (code, body) = s.http_get("/v1/status");
    assert_eq!(code, 200, "{body}");
    let (code, text) = s.http_get("/metrics");
    assert_eq!(code, 200);
    let rejected: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix("ratelimit_http_connections_rejected_total "))
        .unwrap_or_else(|| panic!("no ratelimit_http_connections_rejected_total in\n{text}"))
        .parse()
        .unwrap();
    println!("rejected {rejected}");
    assert!(rejected > 0 && rejected <= conns as u64, "{rejected}");
    if opening < HEADER_READ_TIMEOUT {
        // No slot was freed while they were opened: all but the cap were refused.
        assert!(rejected >= (conns - MAX_CONNECTIONS) as u64, "{rejected}");
    }
    assert!(
        fds_and_limit(pid).0 < open + 50,
        "the daemon's fds went back down"
    );
}

/// `/v1/top?n=N` above the documented maximum is a 400 naming it; at the maximum it is
/// answered. The list endpoints are bounded the same way (`limit`).
#[test]
fn http_list_answers_are_bounded() {
    kernel_test!();
    let mut s = Scenario::new("rlhn").with_http(HTTP_PORT);
    s.start("");
    let (code, body) = s.http_get("/v1/top?n=1000000000");
    println!("/v1/top?n=1000000000: {code} {body}");
    assert_eq!(code, 400, "{body}");
    assert!(
        body.contains("10000"),
        "the error names the maximum: {body}"
    );
    let (code, body) = s.http_get("/v1/top?n=10000");
    assert_eq!(code, 200, "{body}");
    for path in ["/v1/bans", "/v1/offenders"] {
        let (code, body) = s.http_get(&format!("{path}?limit=1000000000"));
        assert_eq!(code, 400, "{path}: {body}");
        let (code, body) = s.http_get(&format!("{path}?limit=5"));
        assert_eq!(code, 200, "{path}: {body}");
    }
    // A list longer than the limit is cut to it, and says so.
    let list = s.daemon().config_dir().join("bans.txt");
    let text: String = (1..=20).map(|i| format!("10.9.0.{i}\n")).collect();
    std::fs::write(&list, text).unwrap();
    s.daemon()
        .cli_ok(&["ban", "add", "--file", list.to_str().unwrap()]);
    let (code, head, body) = get_with_head(&s, "/v1/bans?limit=5");
    assert_eq!(code, 200, "{body}");
    let bans: Vec<Ban> = serde_json::from_str(&body).unwrap();
    assert_eq!(bans.len(), 5, "{body}");
    assert!(head.contains("x-truncated: true"), "{head}");
    let (_, head, body) = get_with_head(&s, "/v1/bans");
    let bans: Vec<Ban> = serde_json::from_str(&body).unwrap();
    assert_eq!(bans.len(), 20, "{body}");
    assert!(!head.contains("x-truncated"), "{head}");
}

/// `GET path`: (status, lower-cased head, body).
fn get_with_head(s: &Scenario, path: &str) -> (u16, String, String) {
    let path = path.to_string();
    s.server.enter(move || {
        let mut c = TcpStream::connect(("127.0.0.1", HTTP_PORT)).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        write!(
            c,
            "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
        )
        .unwrap();
        let mut resp = String::new();
        c.read_to_string(&mut resp).unwrap();
        let (head, body) = resp.split_once("\r\n\r\n").unwrap();
        let code = head.split(' ').nth(1).unwrap().parse().unwrap();
        (code, head.to_ascii_lowercase(), body.to_string())
    })
}

/// A connection to the listener from `src` (a loopback address of the server's namespace).
fn connect_from(src: [u8; 4]) -> std::io::Result<TcpStream> {
    let sock = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)?;
    sock.bind(&std::net::SocketAddr::from((src, 0)).into())?;
    sock.connect_timeout(
        &std::net::SocketAddr::from(([127, 0, 0, 1], HTTP_PORT)).into(),
        Duration::from_secs(5),
    )?;
    Ok(sock.into())
}

/// `GET path` on a new connection from `src`: the status, or `None` when the connection was
/// closed without an answer (refused by the listener).
fn get_from(src: [u8; 4], path: &str) -> Option<(u16, String)> {
    let mut c = connect_from(src).ok()?;
    c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    write!(
        c,
        "GET {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut raw = String::new();
    c.read_to_string(&mut raw).ok()?;
    let (head, body) = raw.split_once("\r\n\r\n")?;
    Some((head.split(' ').nth(1)?.parse().ok()?, body.to_string()))
}

/// One client cannot take the listener from the others: a peer holds at most
/// `MAX_PER_PEER` connections, so one that opens `MAX_CONNECTIONS` idle ones leaves room
/// for Prometheus; and when many peers hold every general slot, the slots kept for
/// `/metrics` still answer a scrape (and only a scrape).
#[test]
fn one_http_client_cannot_lock_prometheus_out() {
    kernel_test!();
    let mut s = Scenario::new("rlhp").with_http(HTTP_PORT);
    s.start("");
    s.server.enter(|| {
        // One peer, every slot's worth of idle connections.
        let hog: Vec<TcpStream> = (0..MAX_CONNECTIONS)
            .filter_map(|_| connect_from([127, 0, 0, 1]).ok())
            .collect();
        std::thread::sleep(Duration::from_millis(300));
        let held = still_open(&hog);
        println!("one peer opened {} connections, {held} held", hog.len());
        assert!(held <= MAX_PER_PEER, "one peer holds {held} connections");
        let (code, body) =
            get_from([127, 0, 0, 2], "/metrics").expect("a scrape from another peer is answered");
        assert_eq!(code, 200, "{body}");
        drop(hog);
        // Until the listener has seen them go (only the scrape's own connection open).
        let give_up = Instant::now() + Duration::from_secs(10);
        loop {
            let (_, text) = get_from([127, 0, 0, 3], "/metrics").expect("a scrape");
            if text
                .lines()
                .any(|l| l == "ratelimit_http_connections_open 1")
            {
                break;
            }
            assert!(
                Instant::now() < give_up,
                "the hog's connections are still served"
            );
            std::thread::sleep(Duration::from_millis(100));
        }

        // Many peers, one connection each, until the general slots are gone.
        let general = MAX_CONNECTIONS - METRICS_SLOTS;
        let crowd: Vec<TcpStream> = (0..general)
            .map(|i| connect_from([127, 0, 1, i as u8 + 1]).unwrap())
            .collect();
        std::thread::sleep(Duration::from_millis(300));
        assert_eq!(still_open(&crowd), general, "every one of them is served");
        let (code, body) = get_from([127, 0, 2, 1], "/v1/status").expect("an answer");
        assert_eq!(code, 503, "{body}");
        assert!(body.contains("serves only /metrics"), "{body}");
        let (code, body) = get_from([127, 0, 2, 2], "/metrics").expect("a scrape is answered");
        assert_eq!(code, 200, "{body}");
        drop(crowd);
    });
}
