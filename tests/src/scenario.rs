//! A ready-made scenario: a client namespace and a protected namespace joined by a veth pair,
//! the real daemon attached to the protected end with a config made from a policy snippet,
//! and helpers to craft frames to the protected host, send them at a rate, and read the
//! daemon's counters and events. Fields drop in order: daemon (which detaches), link, then
//! the namespaces.

use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    path::PathBuf,
    sync::atomic::{AtomicU32, Ordering},
    thread::JoinHandle,
    time::Duration,
};

use ratelimit_user::policy::report::Stats;

use crate::{
    Daemon, NetNs, PacketSocket, SendStats, Tap, UdpSink, VethPair, disable_rp_filter,
    packet::Frame,
};

pub struct Scenario {
    daemon: Option<Daemon>,
    pub pair: VethPair,
    pub client: NetNs,
    pub server: NetNs,
    bpffs: PathBuf,
    /// Port of the daemon's HTTP listener on 127.0.0.1 inside the protected namespace.
    http_port: Option<u16>,
    /// Extra lines for the `[daemon]` table (e.g. `xdp_mode = "generic"`).
    daemon_extra: String,
    /// `daemon.events` when not the events file in the daemon's temp dir.
    events: Option<String>,
    /// Start the daemon with its stdout a pipe nobody reads.
    stdout_pipe: bool,
    /// More environment variables for the daemon.
    env: Vec<(String, String)>,
}

impl Scenario {
    /// Namespaces and a single-queue veth pair; rp_filter off on the protected side so
    /// spoofed sources are delivered.
    pub fn new(tag: &str) -> Scenario {
        Self::with_queues(tag, 1)
    }

    /// As `new`, with `queues` rx/tx queues on both ends (for multi-CPU tests).
    pub fn with_queues(tag: &str, queues: u32) -> Scenario {
        static N: AtomicU32 = AtomicU32::new(0);
        let client = NetNs::new(&format!("{tag}-c"));
        let server = NetNs::new(&format!("{tag}-s"));
        let pair = if queues > 1 {
            VethPair::with_queues(&client, &server, queues)
        } else {
            VethPair::new(&client, &server)
        };
        disable_rp_filter(&server, &pair.b().name);
        let bpffs = PathBuf::from(format!(
            "/sys/fs/bpf/rl-{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        Scenario {
            daemon: None,
            pair,
            client,
            server,
            bpffs,
            http_port: None,
            daemon_extra: String::new(),
            events: None,
            stdout_pipe: false,
            env: Vec::new(),
        }
    }

    /// Add a line to the generated `[daemon]` table (call before `start`).
    pub fn with_daemon_line(mut self, line: &str) -> Self {
        self.daemon_extra.push_str(line);
        self.daemon_extra.push('\n');
        self
    }

    /// Set `daemon.events` to `target` ("-" = stdout) instead of `events.jsonl` in the
    /// daemon's temp dir (call before `start`; [`Scenario::events`] reads only the latter).
    pub fn with_events(mut self, target: &str) -> Self {
        self.events = Some(target.to_string());
        self
    }

    /// Start the daemon with these environment variables too (call before `start`).
    pub fn with_env(mut self, env: Vec<(String, String)>) -> Self {
        self.env = env;
        self
    }

    /// Start the daemon with its stdout a pipe that nobody reads (call before `start`).
    pub fn with_stdout_pipe(mut self) -> Self {
        self.stdout_pipe = true;
        self
    }

    /// Have the daemon serve HTTP (/metrics, /v1/...) on 127.0.0.1:`port` in the protected
    /// namespace (call before `start`).
    pub fn with_http(mut self, port: u16) -> Self {
        self.http_port = Some(port);
        self
    }

    /// `GET path` from the daemon's HTTP listener: (status, body).
    pub fn http_get(&self, path: &str) -> (u16, String) {
        let (status, _, body) = self.http_request(path, "");
        (status, body)
    }

    /// `GET path` with the header lines `headers` (each ending in CRLF): (status, the
    /// response's header lines, body).
    pub fn http_request(&self, path: &str, headers: &str) -> (u16, String, String) {
        use std::io::{Read as _, Write as _};
        let port = self.http_port.expect("scenario built with_http");
        let (path, headers) = (path.to_string(), headers.to_string());
        self.server.enter(move || {
            let mut c = std::net::TcpStream::connect(("127.0.0.1", port))
                .expect("connect to the daemon's HTTP listener");
            c.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
            write!(
                c,
                "GET {path} HTTP/1.1\r\nHost: localhost\r\n{headers}Connection: close\r\n\r\n"
            )
            .unwrap();
            let mut resp = String::new();
            c.read_to_string(&mut resp).unwrap();
            let status = resp
                .split(' ')
                .nth(1)
                .and_then(|s| s.parse().ok())
                .unwrap_or(0);
            let (head, body) = resp.split_once("\r\n\r\n").unwrap_or((&resp, ""));
            (status, head.to_string(), body.to_string())
        })
    }

    /// The `[daemon]` table this scenario uses (control socket, state and events in the
    /// daemon's temp dir, its own bpffs directory, no HTTP listener).
    pub fn daemon_table(&self, dir: &std::path::Path) -> String {
        format!(
            "[daemon]\ninterfaces = [\"{}\"]\ncontrol_socket = \"ctl.sock\"\nstate_dir = \"{}/state\"\nbpffs_dir = \"{}\"\nhttp_listen = \"{}\"\nevents = {:?}\n{}\n",
            self.pair.b().name,
            dir.display(),
            self.bpffs.display(),
            self.http_port
                .map(|p| format!("127.0.0.1:{p}"))
                .unwrap_or_else(|| "off".into()),
            self.events
                .clone()
                .unwrap_or_else(|| format!("{}/events.jsonl", dir.display())),
            self.daemon_extra
        )
    }

    /// Start the daemon with `policy` (lists, tracking, rules) after the `[daemon]` table.
    pub fn start(&mut self, policy: &str) -> &Daemon {
        let config = |dir: &std::path::Path| format!("{}{policy}", self.daemon_table(dir));
        let d = if self.stdout_pipe {
            Daemon::start_in_with_stdout_pipe(&self.server, config)
        } else {
            Daemon::start_in_with_env(&self.server, config, self.env.clone())
        };
        self.daemon = Some(d);
        self.daemon()
    }

    /// A second daemon, without rules, attached to the client end. A reply the program sends
    /// back out of the protected end (`XDP_TX`: a SYN cookie) reaches the client only with an
    /// XDP program on the client's veth too (the kernel wakes a veth's reader for XDP frames
    /// only then). Drop it (it detaches) before the scenario.
    pub fn peer_program(&self) -> Daemon {
        let name = self.pair.a().name.clone();
        let bpffs = format!("{}-peer", self.bpffs.display());
        Daemon::start_in(&self.client, |dir| {
            format!(
                "[daemon]\ninterfaces = [\"{name}\"]\ncontrol_socket = \"ctl.sock\"\nstate_dir = \"{}/state\"\nbpffs_dir = \"{bpffs}\"\nhttp_listen = \"off\"\n",
                dir.display()
            )
        })
    }

    /// Delete the veth pair and create it again under the same names (new ifindexes and
    /// MACs), rp_filter off again on the protected end: an interface that came and went.
    pub fn recreate_link(&mut self) {
        self.pair.recreate(&self.client, &self.server);
        disable_rp_filter(&self.server, &self.pair.b().name);
    }

    pub fn daemon(&self) -> &Daemon {
        self.daemon.as_ref().expect("daemon started")
    }

    pub fn daemon_mut(&mut self) -> &mut Daemon {
        self.daemon.as_mut().expect("daemon started")
    }

    pub fn bpffs(&self) -> &std::path::Path {
        &self.bpffs
    }

    fn frame(&self) -> Frame {
        Frame::new(self.pair.a().mac, self.pair.b().mac)
    }

    /// A 60-byte UDP frame from `src` to the protected host's address of the same family.
    pub fn udp(&self, src: IpAddr, dport: u16) -> Vec<u8> {
        let f = match src {
            IpAddr::V4(s) => self.frame().ipv4(s, self.pair.b().ipv4),
            IpAddr::V6(s) => self.frame().ipv6(s, self.pair.b().ipv6),
        };
        f.udp(40000, dport).pad_to(60).build()
    }

    pub fn udp4(&self, src: Ipv4Addr, dport: u16) -> Vec<u8> {
        self.udp(IpAddr::V4(src), dport)
    }

    pub fn udp6(&self, src: Ipv6Addr, dport: u16) -> Vec<u8> {
        self.udp(IpAddr::V6(src), dport)
    }

    pub fn builder(&self) -> Frame {
        self.frame()
    }

    pub fn sender(&self) -> PacketSocket {
        PacketSocket::new(&self.client, self.pair.a().ifindex)
    }

    pub fn sink(&self, port: u16) -> UdpSink {
        UdpSink::new(&self.server, port)
    }

    pub fn tap(&self) -> Tap {
        Tap::new(&self.server, self.pair.b().ifindex)
    }

    /// Send `frame` at `pps` for `duration` from a thread of its own, optionally pinned to a
    /// CPU. Returns what was sent.
    pub fn blast(
        &self,
        frame: Vec<u8>,
        pps: u64,
        duration: Duration,
        cpu: Option<usize>,
    ) -> JoinHandle<SendStats> {
        let mut tx = self.sender();
        std::thread::spawn(move || {
            if let Some(c) = cpu {
                crate::sender::pin_current_thread(c).expect("pin sender");
            }
            tx.send_rate(|_| &frame, pps, duration)
        })
    }

    /// `ratelimit stats`, typed.
    pub fn stats(&self) -> Stats {
        self.daemon().stats()
    }

    /// Waits until every one of `sent` packets has been judged by `rule` (its `matched`
    /// counter) and `sink` holds every one the rule let through (`matched - dropped`), then
    /// for `sink` to stay quiet a little; returns the daemon's counters. A fixed quiet spell
    /// alone is not enough on a busy machine: the stack may hold the last datagrams longer.
    /// Gives up after 15 s (the assertions that follow then say what is missing).
    pub fn settle(&self, sink: &UdpSink, rule: &str, sent: u64) -> Stats {
        let deadline = std::time::Instant::now() + Duration::from_secs(15);
        let mut st = self.stats();
        while rule_counter(&st, rule, "matched") < sent && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
            st = self.stats();
        }
        let passed = rule_counter(&st, rule, "matched") - rule_counter(&st, rule, "dropped");
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        sink.wait_total(passed, left);
        sink.wait_quiet(Duration::from_millis(200));
        self.stats()
    }

    /// Events written so far (JSON lines), but for the pressure level's: on a busy machine the
    /// host's own load raises it (`pressure_high` / `pressure_low`) at any moment of any
    /// test. [`Scenario::all_events`] has them too.
    pub fn events(&self) -> Vec<serde_json::Value> {
        self.all_events()
            .into_iter()
            .filter(|e| {
                !e["event"]
                    .as_str()
                    .is_some_and(|name| name.starts_with("pressure_"))
            })
            .collect()
    }

    /// Every event written so far (JSON lines).
    pub fn all_events(&self) -> Vec<serde_json::Value> {
        self.events_text()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    }

    /// The events file as written so far, whole or torn lines alike ("" if there is none).
    pub fn events_text(&self) -> String {
        let path = self.daemon().config_dir().join("events.jsonl");
        std::fs::read_to_string(path).unwrap_or_default()
    }
}

impl Drop for Scenario {
    /// The daemon guard detaches using the config file, which a test may have left broken on
    /// purpose: detach by the bpffs directory as well, so no program or pin outlives the test.
    fn drop(&mut self) {
        drop(self.daemon.take());
        if self.bpffs.exists() {
            let _ = std::process::Command::new(crate::ratelimit_bin())
                .args(["detach", "--bpffs-dir"])
                .arg(&self.bpffs)
                .output();
        }
    }
}

/// Packets of a verdict in `stats`.
pub fn verdict(stats: &Stats, name: &str) -> u64 {
    stats.all.verdict(name).packets
}

/// Packets of a reason in `stats`.
pub fn reason(stats: &Stats, name: &str) -> u64 {
    stats.all.reason(name).packets
}

/// Packets of one counter of a rule in `stats` (0 if there is no such rule).
pub fn rule_counter(stats: &Stats, rule: &str, counter: &str) -> u64 {
    stats.rule(rule).map_or(0, |r| r.get(counter).packets)
}

/// The sum of the values of every series of `name` in an exposition (`/metrics`) that has
/// these labels, whatever its others: PromQL's `sum(name{labels})`.
pub fn metric_sum(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let (n, rest) = series.split_once('{').unwrap_or((series, ""));
            (n == name
                && labels
                    .iter()
                    .all(|(k, v)| rest.contains(&format!("{k}=\"{v}\""))))
            .then(|| value.parse::<f64>().ok())?
        })
        .sum()
}

/// Sum of the pass verdicts.
pub fn passed(stats: &Stats) -> u64 {
    ["pass", "pass_non_ip", "pass_malformed", "pass_allow"]
        .iter()
        .map(|v| verdict(stats, v))
        .sum()
}

/// Sleep until just after the next multiple of `interval` on CLOCK_MONOTONIC, the clock the
/// XDP program's windows use, so a test's traffic starts at a window boundary and measures the
/// algorithm rather than the phase it happened to start in.
pub fn align_to_window(interval: Duration) {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid out-pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    let now = ts.tv_sec as u128 * 1_000_000_000 + ts.tv_nsec as u128;
    let iv = interval.as_nanos();
    let wait = iv - now % iv + 2_000_000;
    std::thread::sleep(Duration::from_nanos(wait as u64));
}
