//! `ratelimit-demo`: the lab behind `cargo xtask demo`.
//!
//! Builds two network namespaces joined by a veth pair, starts the real daemon on the protected
//! side with a small, readable policy, and plays four short scenes against it from simulated
//! clients: legitimate traffic, one heavy client, a SYN flood and a random-source flood. Once a
//! second it prints what the daemon counted (`ratelimit stats --json` deltas) beside what an
//! independent packet tap on the protected interface actually received, plus every event the
//! daemon writes. Every packet stays inside the namespaces made here, every flood is bounded
//! in count and time, and everything is removed at the end, also when the demo is stopped
//! early: by Ctrl-C (SIGINT), SIGTERM (`timeout`, a CI runner, `kill`) or SIGHUP (its terminal
//! closed). A run killed outright (SIGKILL) cannot clean up; the next run does, at its start:
//! it removes the namespaces, pins, temp dir and daemon of every earlier run whose process is
//! gone ([`Leftovers`]).
//!
//! Run it through `cargo xtask demo [--quick]`, which builds the daemon and sets
//! `RATELIMIT_BIN`. It needs root.

use std::{
    io::Write as _,
    net::{IpAddr, Ipv4Addr},
    process::ExitCode,
    sync::atomic::{AtomicI32, Ordering},
    thread::JoinHandle,
    time::{Duration, Instant},
};

use ratelimit_tests::{
    Scenario, Tap, UdpSink,
    leftovers::Leftovers,
    packet::tcp_flags,
    receiver::Counts,
    scenario::{passed, reason, verdict},
};
use ratelimit_user::policy::report::Stats;
use serde_json::Value;

/// UDP port the protected host's application listens on.
const PORT: u16 = 9000;
/// Legitimate clients: 198.19.1.1 ..= 198.19.1.20, each at `LEGIT_PPS`.
const LEGIT_CLIENTS: u8 = 20;
const LEGIT_PPS: u64 = 50;
/// The heavy client sends three times its allowance of 200/s.
const HEAVY: Ipv4Addr = Ipv4Addr::new(198, 19, 2, 1);
const HEAVY_PPS: u64 = 600;
/// The SYN flooder: 1000 SYN/s for 2 s, then it comes back politely at 5/s.
const SYN_SRC: Ipv4Addr = Ipv4Addr::new(198, 19, 3, 1);
const SYN_PPS: u64 = 1000;
const SYN_FLOOD: Duration = Duration::from_secs(2);
const SYN_SLOW_PPS: u64 = 5;
/// An address on the deny list.
const DENIED: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 7);
const DENIED_PPS: u64 = 20;
/// The random-source flood: this many frames, each from a random address in 172.16.0.0/12.
const FLOOD_FRAMES: u64 = 20_000;
const FLOOD_PPS: u64 = 10_000;

const POLICY: &str = r#"[lists]
deny = ["203.0.113.0/24"]           # always dropped, before any rule

[tracking]
new_sources_per_sec = 500           # at most 500 never-seen clients get their own state per second

[[rule]]
name = "udp-per-client"             # every UDP client may send 200 packets per second
match = { protocol = "udp" }
key = "ip"
action = "throttle"
threshold = { count = 200, interval = "1s" }
soft_limit = 0.5                    # above 100/s a client is reported (soft_limit event)

[[rule]]
name = "syn-ban"                    # SYNs to port 80: 50/s allowed, above 100/s banned for 5 s
match = { protocol = "tcp", tcp_flags = "syn", dst_ports = ["80"] }
key = "ip"
action = "rate_based_ban"
threshold = { count = 50, interval = "1s" }
ban_threshold = { count = 100, interval = "1s" }
ban_duration = "5s"

[[rule]]
name = "backstop"                   # one counter for everything the rules above let through
key = "all"
threshold = { count = 3000, interval = "1s" }
"#;

/// The name of the lab's namespaces and bpffs directory (`rldemo-c-PID-N`, ...), by which a
/// later run recognises what a killed one left.
const TAG: &str = "rldemo";

/// The signal that stops the demo (0: none yet).
static STOP: AtomicI32 = AtomicI32::new(0);

/// The signals that stop the demo early, cleaning up: Ctrl-C, `timeout` / CI runners / `kill`,
/// and a closed terminal.
const STOP_SIGNALS: [libc::c_int; 3] = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP];

extern "C" fn on_stop_signal(signal: libc::c_int) {
    if signal == libc::SIGHUP {
        // The terminal is gone, and writes to it fail (EIO), which makes `println!` panic:
        // from here on the output goes nowhere instead, so the cleanup runs to its end.
        // SAFETY: open(2), dup2(2) and close(2) are async-signal-safe; the path is a C string.
        unsafe {
            let null = libc::open(c"/dev/null".as_ptr(), libc::O_WRONLY);
            if null >= 0 {
                libc::dup2(null, libc::STDOUT_FILENO);
                libc::dup2(null, libc::STDERR_FILENO);
                libc::close(null);
            }
        }
    }
    STOP.store(signal, Ordering::SeqCst);
}

/// A stop signal only sets a flag: the senders and the live loop check it and return, and the
/// lab's guards then stop the daemon, detach XDP and delete the namespaces as they drop. (The
/// default action of each ends the process at once, which would leave all of it behind.)
fn install_stop_handlers() {
    let handler = on_stop_signal as extern "C" fn(libc::c_int);
    for signal in STOP_SIGNALS {
        // SAFETY: sigaction(2) with a zeroed struct, an empty mask and a handler that only
        // makes async-signal-safe calls and stores to an atomic.
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = handler as libc::sighandler_t;
            sa.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut sa.sa_mask);
            if libc::sigaction(signal, &sa, std::ptr::null_mut()) != 0 {
                eprintln!(
                    "warning: cannot install a handler for signal {signal}: {}",
                    std::io::Error::last_os_error()
                );
            }
        }
    }
}

fn stopped() -> bool {
    STOP.load(Ordering::SeqCst) != 0
}

/// The exit status of a demo stopped by a signal: 128 + its number, as a shell reports a
/// process the signal ended (130 after Ctrl-C).
fn stopped_status() -> ExitCode {
    ExitCode::from(128 + u8::try_from(STOP.load(Ordering::SeqCst)).unwrap_or(0))
}

/// A stop signal arrived.
#[derive(Debug)]
struct Interrupted;

type Step<T = ()> = Result<T, Interrupted>;

/// Sleeps until `t` in short steps; Err if a stop signal arrives first.
fn sleep_until(t: Instant) -> Step {
    loop {
        if stopped() {
            return Err(Interrupted);
        }
        let now = Instant::now();
        if now >= t {
            return Ok(());
        }
        std::thread::sleep((t - now).min(Duration::from_millis(50)));
    }
}

fn legit_ip(n: u8) -> Ipv4Addr {
    Ipv4Addr::new(198, 19, 1, n)
}

fn is_legit(ip: &IpAddr) -> bool {
    matches!(ip, IpAddr::V4(v4) if v4.octets()[..3] == [198, 19, 1] && (1..=LEGIT_CLIENTS).contains(&v4.octets()[3]))
}

/// Traffic from a simulated client or attacker: any IPv4 source that is neither a legitimate
/// client nor the lab's own veth addresses (198.18.0.0/16). IPv6 neighbour discovery is
/// neither.
fn is_attack(ip: &IpAddr) -> bool {
    matches!(ip, IpAddr::V4(v4) if !is_legit(ip) && v4.octets()[..2] != [198, 18])
}

fn sum_where(c: &Counts, pred: impl Fn(&IpAddr) -> bool) -> u64 {
    c.per_src
        .iter()
        .filter(|(ip, _)| pred(ip))
        .map(|(_, n)| n)
        .sum()
}

/// Delivered from `pred` sources between two snapshots of a receiver.
fn delivered(before: &Counts, after: &Counts, pred: impl Fn(&IpAddr) -> bool + Copy) -> u64 {
    sum_where(after, pred).saturating_sub(sum_where(before, pred))
}

fn pct(part: u64, whole: u64) -> f64 {
    if whole == 0 {
        0.0
    } else {
        100.0 * part as f64 / whole as f64
    }
}

/// One paced sender: `frames` round robin at `pps`, starting after `delay`, for `duration`,
/// never more than `max` frames, stopping early on a stop signal.
struct Stream {
    label: &'static str,
    frames: Vec<Vec<u8>>,
    pps: u64,
    delay: Duration,
    duration: Duration,
    max: u64,
}

impl Stream {
    fn new(label: &'static str, frames: Vec<Vec<u8>>, pps: u64, duration: Duration) -> Stream {
        Stream {
            label,
            frames,
            pps,
            delay: Duration::ZERO,
            duration,
            max: u64::MAX,
        }
    }

    fn after(mut self, delay: Duration) -> Stream {
        self.delay = delay;
        self
    }

    fn at_most(mut self, max: u64) -> Stream {
        self.max = max;
        self
    }

    /// When it will have sent its last frame, counted from its spawn.
    fn end(&self) -> Duration {
        let by_count = Duration::from_nanos(
            u64::try_from(u128::from(self.max) * 1_000_000_000 / u128::from(self.pps))
                .unwrap_or(u64::MAX),
        );
        self.delay + self.duration.min(by_count)
    }

    fn spawn(self, s: &Scenario) -> JoinHandle<u64> {
        let mut tx = s.sender();
        std::thread::spawn(move || {
            if sleep_until(Instant::now() + self.delay).is_err() {
                return 0;
            }
            let total =
                u64::try_from(u128::from(self.pps) * self.duration.as_nanos() / 1_000_000_000)
                    .unwrap_or(u64::MAX)
                    .min(self.max);
            let start = Instant::now();
            let mut sent = 0u64;
            while sent < total && !stopped() {
                // An absolute schedule: no drift, a late frame goes at once.
                let due = start
                    + Duration::from_nanos(
                        u64::try_from(u128::from(sent) * 1_000_000_000 / u128::from(self.pps))
                            .unwrap_or(u64::MAX),
                    );
                let now = Instant::now();
                if due > now {
                    std::thread::sleep(due - now);
                }
                let frame = &self.frames[usize::try_from(sent).unwrap_or(0) % self.frames.len()];
                if let Err(e) = tx.send(frame) {
                    eprintln!("sender {}: {e}; stopping it", self.label);
                    break;
                }
                sent += 1;
            }
            sent
        })
    }
}

/// Counters at one moment: cumulative ones from `ratelimit stats --json` and the tap, gauges
/// from `ratelimit status --json`.
#[derive(Clone, Copy, Debug, Default)]
struct Sample {
    passed: u64,
    deny: u64,
    ban: u64,
    rule: u64,
    refused: u64,
    created: u64,
    legit_rx: u64,
    attack_rx: u64,
    bans: u64,
    tracked: u64,
}

/// One line of the closing summary.
struct Row {
    what: String,
    sent: u64,
    got: u64,
    expect: &'static str,
}

struct Demo {
    // Receivers first: they drop (and stop reading) before the scenario deletes their namespace.
    tap: Tap,
    sink: UdpSink,
    s: Scenario,
    quick: bool,
    seen_events: usize,
    events: Vec<Value>,
    rows: Vec<Row>,
    failures: Vec<String>,
    legit_sent: u64,
    legit_got: u64,
}

impl Demo {
    fn new(quick: bool) -> Demo {
        println!("Setting up the lab: two network namespaces joined by a veth pair ...");
        let mut s = Scenario::new(TAG);
        println!();
        println!("Policy given to the daemon (plus a [daemon] table naming the veth, a temp dir");
        println!("for the control socket, state and events, and a private bpffs directory):");
        println!();
        for line in POLICY.lines() {
            println!("    {line}");
        }
        s.start(POLICY);
        let tap = s.tap();
        let sink = s.sink(PORT);
        let (a, b) = (s.pair.a(), s.pair.b());
        let status = s.daemon().cli(&["status", "--json"]);
        let mode = serde_json::from_slice::<Value>(&status.stdout)
            .ok()
            .and_then(|st| {
                st["interfaces"]
                    .get(0)
                    .and_then(|i| i.get("mode"))
                    .and_then(Value::as_str)
                    .map(str::to_string)
            })
            .unwrap_or_else(|| "?".into());
        println!();
        println!("The lab:");
        println!(
            "    clients    netns {:<22} {} {}    (simulated clients send crafted frames here)",
            s.client.name(),
            a.name,
            a.ipv4
        );
        println!(
            "    protected  netns {:<22} {} {}    (the daemon, XDP mode {mode}; a UDP app on :{PORT})",
            s.server.name(),
            b.name,
            b.ipv4
        );
        println!("    daemon dir {}", s.daemon().config_dir().display());
        println!("    bpffs      {}", s.bpffs().display());
        Demo {
            tap,
            sink,
            s,
            quick,
            seen_events: 0,
            events: Vec::new(),
            rows: Vec::new(),
            failures: Vec::new(),
            legit_sent: 0,
            legit_got: 0,
        }
    }

    fn secs(&self, normal: u64, quick: u64) -> Duration {
        Duration::from_secs(if self.quick { quick } else { normal })
    }

    fn check(&mut self, ok: bool, what: String) {
        if ok {
            println!("    ok   {what}");
        } else {
            println!("    !!   {what}  <- NOT as expected");
            self.failures.push(what);
        }
    }

    /// `ratelimit ARGS --json`, or Err if a stop signal made it fail.
    /// `ratelimit stats`, typed.
    fn stats(&self) -> Step<Stats> {
        let v = self.cli_json(&["stats"])?;
        Ok(serde_json::from_value(v).expect("`ratelimit stats --json` prints the stats"))
    }

    fn cli_json(&self, args: &[&str]) -> Step<Value> {
        let mut all = args.to_vec();
        all.push("--json");
        let out = self.s.daemon().cli(&all);
        if stopped() {
            return Err(Interrupted);
        }
        if !out.status.success() {
            panic!(
                "`ratelimit {}` failed ({}): {}",
                all.join(" "),
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("`ratelimit {}` printed no JSON: {e}", all.join(" "))))
    }

    /// Prints `ratelimit ARGS` indented, as an operator would see it.
    fn show(&self, args: &[&str]) -> Step {
        println!();
        println!("  $ ratelimit {}", args.join(" "));
        let out = self.s.daemon().cli(args);
        if stopped() {
            return Err(Interrupted);
        }
        let text = String::from_utf8_lossy(&out.stdout);
        let text = if text.trim().is_empty() {
            String::from_utf8_lossy(&out.stderr).into_owned()
        } else {
            text.into_owned()
        };
        for line in text.lines() {
            println!("    {line}");
        }
        if text.trim().is_empty() {
            println!("    (nothing)");
        }
        println!();
        Ok(())
    }

    fn sample(&self) -> Step<Sample> {
        let st = self.stats()?;
        let status = self.cli_json(&["status"])?;
        let tap = self.tap.snapshot();
        Ok(Sample {
            passed: passed(&st),
            deny: verdict(&st, "drop_deny"),
            ban: verdict(&st, "drop_ban"),
            rule: verdict(&st, "drop_rule"),
            refused: reason(&st, "admission_refused"),
            created: reason(&st, "state_created"),
            legit_rx: sum_where(&tap, is_legit),
            attack_rx: sum_where(&tap, is_attack),
            bans: status["active_bans"].as_u64().unwrap_or(0),
            tracked: status["tracked_clients"].as_u64().unwrap_or(0),
        })
    }

    fn print_header() {
        println!(
            "         {:-^44}   {:-^19}   {:-^13}",
            " daemon: packets in this second ", " tap: received ", " now "
        );
        println!(
            "  {:>5}  {:>7} {:>7} {:>7} {:>7} {:>12}   {:>9} {:>9}   {:>4} {:>8}",
            "time",
            "passed",
            "deny",
            "ban",
            "rule",
            "adm.refused",
            "legit",
            "attack",
            "bans",
            "tracked"
        );
    }

    fn print_row(t: u64, prev: &Sample, cur: &Sample) {
        println!(
            "  {:>5}  {:>7} {:>7} {:>7} {:>7} {:>12}   {:>9} {:>9}   {:>4} {:>8}",
            format!("+{t}s"),
            cur.passed.saturating_sub(prev.passed),
            cur.deny.saturating_sub(prev.deny),
            cur.ban.saturating_sub(prev.ban),
            cur.rule.saturating_sub(prev.rule),
            cur.refused.saturating_sub(prev.refused),
            cur.legit_rx.saturating_sub(prev.legit_rx),
            cur.attack_rx.saturating_sub(prev.attack_rx),
            cur.bans,
            cur.tracked,
        );
    }

    /// Prints the events the daemon wrote since the last call (at most a few per second, the
    /// rest summarised).
    fn print_new_events(&mut self) {
        let all = self.s.events();
        let new: Vec<Value> = all.into_iter().skip(self.seen_events).collect();
        self.seen_events += new.len();
        const SHOWN: usize = 6;
        for e in new.iter().take(SHOWN) {
            let time = e["time"].as_str().unwrap_or("");
            let time = time.get(11..23).unwrap_or(time);
            let kind = e["event"].as_str().unwrap_or("?");
            let key = e["key"].as_str().unwrap_or("?");
            let client = e["client"].as_str().unwrap_or("?");
            let client = if key == "ip" {
                client.to_string()
            } else {
                format!("{client} ({key})")
            };
            let mut line = format!(
                "         event {time}  {kind:<14} rule {:<15} client {client:<16}",
                e["rule"].as_str().unwrap_or("?"),
            );
            if e["threshold"].as_u64().unwrap_or(0) != 0 {
                line.push_str(&format!(
                    " count {} threshold {}",
                    e["count"], e["threshold"]
                ));
            }
            if let Some(exp) = e["ban_expires"].as_str() {
                line.push_str(&format!(" until {}", exp.get(11..19).unwrap_or(exp)));
            }
            println!("{}", line.trim_end());
        }
        if new.len() > SHOWN {
            println!("         ... and {} more events", new.len() - SHOWN);
        }
        self.events.extend(new);
    }

    fn event_seen(&self, kind: &str, client: &str) -> bool {
        self.events
            .iter()
            .any(|e| e["event"] == kind && e["client"] == client)
    }

    /// Starts `streams`, prints a live line once a second until they are all done (and
    /// `at_tick` runs after the line of the second it names), then joins them and returns
    /// what each sent, in order.
    fn play(
        &mut self,
        streams: Vec<Stream>,
        mut at_tick: impl FnMut(&mut Demo, u64) -> Step,
    ) -> Step<Vec<u64>> {
        let mut prev = self.sample()?;
        let planned = streams.iter().map(Stream::end).max().unwrap_or_default();
        let handles: Vec<JoinHandle<u64>> =
            streams.into_iter().map(|st| st.spawn(&self.s)).collect();
        let start = Instant::now();
        Self::print_header();
        let result = (|| -> Step {
            let mut t = 0;
            loop {
                t += 1;
                let tick = Duration::from_secs(t);
                sleep_until(start + tick)?;
                if tick >= planned {
                    // The senders end on this tick: give them a moment to send their last frames
                    // so this is the phase's final line.
                    let give_up = Instant::now() + Duration::from_secs(1);
                    while !handles.iter().all(JoinHandle::is_finished) && Instant::now() < give_up {
                        std::thread::sleep(Duration::from_millis(10));
                    }
                    self.settle();
                }
                let done = handles.iter().all(JoinHandle::is_finished);
                let cur = self.sample()?;
                Self::print_row(t, &prev, &cur);
                self.print_new_events();
                at_tick(self, t)?;
                prev = cur;
                if done {
                    return Ok(());
                }
            }
        })();
        // Senders stop by themselves at their end or on a stop signal: join them either way.
        let sent: Vec<u64> = handles.into_iter().map(|h| h.join().unwrap_or(0)).collect();
        result?;
        let _ = std::io::stdout().flush();
        Ok(sent)
    }

    fn legit_frames(&self) -> Vec<Vec<u8>> {
        (1..=LEGIT_CLIENTS)
            .map(|n| self.s.udp4(legit_ip(n), PORT))
            .collect()
    }

    fn legit_stream(&self, duration: Duration) -> Stream {
        Stream::new(
            "legitimate",
            self.legit_frames(),
            LEGIT_PPS * u64::from(LEGIT_CLIENTS),
            duration,
        )
    }

    /// Books the legitimate clients' traffic of a phase and checks none of it was lost.
    fn legit_result(&mut self, phase: &str, sent: u64, before: &Counts, after: &Counts) {
        let got = delivered(before, after, is_legit);
        self.legit_sent += sent;
        self.legit_got += got;
        self.rows.push(Row {
            what: format!("{phase}: legitimate clients"),
            sent,
            got,
            expect: "all delivered",
        });
        self.check(
            got == sent,
            format!(
                "legitimate clients: sent {sent}, delivered {got} to the app's UDP socket ({:.1}%)",
                pct(got, sent)
            ),
        );
    }

    fn banner(n: u32, title: &str, what: &[&str]) {
        println!();
        println!("==== Phase {n}: {title}");
        for line in what {
            println!("     {line}");
        }
        println!();
    }

    fn settle(&self) {
        self.tap.wait_quiet(Duration::from_millis(300));
        self.sink.wait_quiet(Duration::from_millis(300));
    }

    fn phase1(&mut self) -> Step {
        let d = self.secs(5, 3);
        Self::banner(
            1,
            "legitimate clients",
            &[
                &format!(
                    "{LEGIT_CLIENTS} clients (198.19.1.1-{LEGIT_CLIENTS}) send {LEGIT_PPS} UDP packets/s each, well under their 200/s."
                ),
                &format!(
                    "Beside them, {DENIED} (on the deny list) sends {DENIED_PPS}/s. Watch: ~1000 passed and"
                ),
                "delivered per second, the denied address dropped in the `deny` column, no events.",
            ],
        );
        let before = self.sink.snapshot();
        let denied_frame = self.s.udp4(DENIED, PORT);
        let sent = self.play(
            vec![
                self.legit_stream(d),
                Stream::new("deny-listed", vec![denied_frame], DENIED_PPS, d),
            ],
            |_, _| Ok(()),
        )?;
        self.settle();
        let after = self.sink.snapshot();
        self.legit_result("1", sent[0], &before, &after);
        let denied_got = after.from(DENIED.into()) - before.from(DENIED.into());
        self.rows.push(Row {
            what: "1: deny-listed address".into(),
            sent: sent[1],
            got: denied_got,
            expect: "all dropped",
        });
        self.check(
            denied_got == 0,
            format!(
                "deny-listed {DENIED}: sent {}, delivered {denied_got}",
                sent[1]
            ),
        );
        Ok(())
    }

    fn phase2(&mut self) -> Step {
        let d = self.secs(8, 4);
        Self::banner(
            2,
            "one heavy client at 3x its limit",
            &[
                &format!(
                    "{HEAVY} sends {HEAVY_PPS} UDP packets/s; rule udp-per-client allows 200/s per client."
                ),
                "Watch: ~400 dropped per second in the `rule` column (about 2/3 of its traffic),",
                "a soft_limit and a throttle_start event for it, and the legitimate clients untouched.",
            ],
        );
        let before = self.sink.snapshot();
        let heavy = self.s.udp4(HEAVY, PORT);
        // `top` in the last second of the phase, while the heavy client is being throttled.
        let top_at = d.as_secs() - 1;
        // Start on a window boundary of the rule's 1 s interval, so the heavy client meets the
        // limiter in a clean state and its share of drops is the steady one from the start.
        ratelimit_tests::scenario::align_to_window(Duration::from_secs(1));
        let sent = self.play(
            vec![
                self.legit_stream(d),
                Stream::new("heavy", vec![heavy], HEAVY_PPS, d),
            ],
            |demo, t| {
                if t == top_at {
                    demo.show(&["top", "-n", "5"])?;
                    Self::print_header();
                }
                Ok(())
            },
        )?;
        self.settle();
        let after = self.sink.snapshot();
        println!();
        self.legit_result("2", sent[0], &before, &after);
        let got = after.from(HEAVY.into()) - before.from(HEAVY.into());
        let dropped = pct(sent[1] - got.min(sent[1]), sent[1]);
        self.rows.push(Row {
            what: "2: heavy client (3x limit)".into(),
            sent: sent[1],
            got,
            expect: "~2/3 dropped",
        });
        self.check(
            (55.0..=75.0).contains(&dropped),
            format!(
                "heavy client: sent {}, delivered {got}, dropped {dropped:.1}% (3x the limit: ~66.7% expected)",
                sent[1]
            ),
        );
        let client = format!("{HEAVY}/32");
        let (soft, start) = (
            self.event_seen("soft_limit", &client),
            self.event_seen("throttle_start", &client),
        );
        self.check(
            soft && start,
            format!("events for {client}: soft_limit {soft}, throttle_start {start}"),
        );
        Ok(())
    }

    fn phase3(&mut self) -> Step {
        Self::banner(
            3,
            "a SYN flood from one source",
            &[
                &format!(
                    "{SYN_SRC} sends {SYN_PPS} SYN/s to port 80 for {}s (rule syn-ban: 50/s, ban above 100/s).",
                    SYN_FLOOD.as_secs()
                ),
                "Watch: a ban event at once, its packets counted under `ban`; then it retries politely",
                &format!(
                    "at {SYN_SLOW_PPS}/s: still dropped while banned, until the ban expires after 5 s (unban event)"
                ),
                "and its SYNs are delivered again.",
            ],
        );
        let before = self.tap.snapshot();
        let before_sink = self.sink.snapshot();
        let syn = self
            .s
            .builder()
            .ipv4(SYN_SRC, self.s.pair.b().ipv4)
            .tcp(40000, 80, tcp_flags::SYN)
            .pad_to(60)
            .build();
        // The flood starts at +0.5 s and ends at +2.5 s; the ban (5 s) ends near +5.6 s; the
        // polite retries run from +3 s to +8 s.
        let flood_start = Duration::from_millis(500);
        let sent = self.play(
            vec![
                self.legit_stream(Duration::from_secs(8)),
                Stream::new("syn-flood", vec![syn.clone()], SYN_PPS, SYN_FLOOD)
                    .after(flood_start)
                    .at_most(SYN_PPS * SYN_FLOOD.as_secs()),
                Stream::new("syn-retry", vec![syn], SYN_SLOW_PPS, Duration::from_secs(5))
                    .after(Duration::from_secs(3)),
            ],
            |demo, t| {
                if t == 3 {
                    demo.show(&["bans"])?;
                    Self::print_header();
                }
                Ok(())
            },
        )?;
        self.settle();
        let after = self.tap.snapshot();
        let after_sink = self.sink.snapshot();
        println!();
        self.legit_result("3", sent[0], &before_sink, &after_sink);
        let got = after.from(SYN_SRC.into()) - before.from(SYN_SRC.into());
        let syn_sent = sent[1] + sent[2];
        self.rows.push(Row {
            what: "3: SYN flooder (flood + retries)".into(),
            sent: syn_sent,
            got,
            expect: "banned, then back",
        });
        let client = format!("{SYN_SRC}/32");
        let (ban, unban) = (
            self.event_seen("ban", &client),
            self.event_seen("unban", &client),
        );
        self.check(
            ban && unban,
            format!("events for {client}: ban {ban}, unban {unban}"),
        );
        self.check(
            got < syn_sent / 5,
            format!(
                "SYN flooder: sent {syn_sent} SYNs, {got} delivered ({:.1}%): the first ~50-100 before the ban and the retries after it",
                pct(got, syn_sent)
            ),
        );
        Ok(())
    }

    fn phase4(&mut self) -> Step {
        let d = self.secs(6, 4);
        Self::banner(
            4,
            "a random-source flood while the legitimate clients go on",
            &[
                &format!(
                    "{FLOOD_FRAMES} UDP frames at {FLOOD_PPS}/s, each from a random (spoofed) address in 172.16.0.0/12."
                ),
                "Each new source would need its own state; the admission budget (500 new/s) refuses the",
                "rest (`adm.refused`), which share one `overflow` bucket of 200/s. Watch: most of the flood",
                "dropped under `rule`, tracked clients bounded, legitimate clients still fully delivered.",
            ],
        );
        let before = self.sink.snapshot();
        let start_sample = self.sample()?;
        let mut seed: u32 = 0x9e37_79b9;
        let flood: Vec<Vec<u8>> = (0..FLOOD_FRAMES)
            .map(|_| {
                // xorshift32: a fixed, repeatable spread of sources.
                seed ^= seed << 13;
                seed ^= seed >> 17;
                seed ^= seed << 5;
                self.s
                    .udp4(Ipv4Addr::from(0xac10_0000 | (seed & 0x000f_ffff)), PORT)
            })
            .collect();
        let sent = self.play(
            vec![
                self.legit_stream(d),
                Stream::new(
                    "random-source flood",
                    flood,
                    FLOOD_PPS,
                    Duration::from_secs(FLOOD_FRAMES.div_ceil(FLOOD_PPS) + 1),
                )
                .after(Duration::from_millis(1500))
                .at_most(FLOOD_FRAMES),
            ],
            |demo, t| {
                // In the middle of the flood.
                if t == 3 {
                    demo.show(&["top", "-n", "5"])?;
                    Self::print_header();
                }
                Ok(())
            },
        )?;
        self.settle();
        let after = self.sink.snapshot();
        let end_sample = self.sample()?;
        println!();
        self.legit_result("4", sent[0], &before, &after);
        let flooded = |ip: &IpAddr| matches!(ip, IpAddr::V4(v4) if (v4.to_bits() & 0xfff0_0000) == 0xac10_0000);
        let got = delivered(&before, &after, flooded);
        self.rows.push(Row {
            what: "4: random-source flood".into(),
            sent: sent[1],
            got,
            expect: "mostly dropped",
        });
        let refused = end_sample.refused - start_sample.refused;
        let created = end_sample.created - start_sample.created;
        self.check(
            got * 4 < sent[1],
            format!(
                "flood: sent {}, delivered {got} ({:.1}%)",
                sent[1],
                pct(got, sent[1])
            ),
        );
        self.check(
            refused > 0 && end_sample.tracked < sent[1] / 2,
            format!(
                "admissions refused {refused}; new client states {created} (budget: burst 500 + 500/s); tracked clients now {} (not one per flood source)",
                end_sample.tracked
            ),
        );
        Ok(())
    }

    fn summary(&self) -> Step {
        let st = self.stats()?;
        println!();
        println!("==== Summary");
        println!();
        println!(
            "    {:<34} {:>8} {:>10} {:>9}   expected",
            "traffic", "sent", "delivered", "dropped"
        );
        for r in &self.rows {
            println!(
                "    {:<34} {:>8} {:>10} {:>8.1}%   {}",
                r.what,
                r.sent,
                r.got,
                pct(r.sent.saturating_sub(r.got), r.sent),
                r.expect
            );
        }
        println!();
        println!(
            "    legitimate clients over all phases: sent {}, delivered {} ({:.2}%)",
            self.legit_sent,
            self.legit_got,
            pct(self.legit_got, self.legit_sent)
        );
        println!(
            "    daemon totals: passed {}, dropped by deny {} / ban {} / rule {}; bans issued {}, expired {}; events {}",
            passed(&st),
            verdict(&st, "drop_deny"),
            verdict(&st, "drop_ban"),
            verdict(&st, "drop_rule"),
            reason(&st, "bans_issued"),
            reason(&st, "bans_expired"),
            self.events.len()
        );
        Ok(())
    }

    fn legend() {
        println!();
        println!("How to read the live view (one line per second):");
        println!(
            "    passed deny ban rule  the daemon's verdicts in that second (`ratelimit stats --json`):"
        );
        println!(
            "                          passed, dropped by the deny list, by an active ban, by a rule"
        );
        println!(
            "    adm.refused           packets from new sources refused their own state by the admission"
        );
        println!("                          budget; they share one `overflow` bucket of the rule");
        println!(
            "    legit attack          frames an independent packet tap on the protected interface really"
        );
        println!(
            "                          received, from the 20 legitimate clients and from everyone else"
        );
        println!(
            "    bans tracked          active bans and per-client states in the kernel now (`ratelimit status`)"
        );
        println!(
            "    event ...             a new line in the daemon's events file (JSON lines for L7 systems)"
        );
    }

    fn run(&mut self) -> Step {
        Self::legend();
        self.phase1()?;
        self.phase2()?;
        self.phase3()?;
        self.phase4()?;
        self.summary()
    }
}

fn usage() -> &'static str {
    "usage: ratelimit-demo [--quick]\n\n\
     A self-contained lab: network namespaces, a veth link, the ratelimit daemon and simulated\n\
     clients; shows throttling, bans and a random-source flood live, then cleans up.\n\
     Run it with `cargo xtask demo [--quick]` (needs root; RATELIMIT_BIN names the daemon).\n\
     --quick  shorter phases (about 20 s instead of 30 s)"
}

fn main() -> ExitCode {
    let mut quick = false;
    for arg in std::env::args().skip(1) {
        match arg.as_str() {
            "--quick" => quick = true,
            "-h" | "--help" => {
                println!("{}", usage());
                return ExitCode::SUCCESS;
            }
            other => {
                eprintln!("ratelimit-demo: unknown argument {other:?}\n\n{}", usage());
                return ExitCode::from(2);
            }
        }
    }
    // SAFETY: geteuid has no preconditions and cannot fail.
    let euid = unsafe { libc::geteuid() };
    if euid != 0 {
        eprintln!(
            "ratelimit-demo: needs root (euid is {euid}): it creates network namespaces and a veth \
             link and attaches an XDP program (CAP_NET_ADMIN, CAP_SYS_ADMIN)"
        );
        return ExitCode::from(1);
    }
    if let Err(why) = ratelimit_tests::env::check_preconditions() {
        eprintln!("ratelimit-demo: cannot run: {why}");
        return ExitCode::from(1);
    }
    let bin = std::env::var_os(ratelimit_tests::env::BIN_ENV).map(std::path::PathBuf::from);
    if !bin.as_ref().is_some_and(|b| b.is_file()) {
        eprintln!(
            "ratelimit-demo: set RATELIMIT_BIN to the daemon binary (`cargo xtask demo` builds it and does this)"
        );
        return ExitCode::from(1);
    }
    install_stop_handlers();
    // A stop signal sent to the process group (Ctrl-C, `timeout`) also reaches the daemon and
    // the `ip` commands; if that happens while the lab is still being built, a lab helper
    // panics. The guards clean up while unwinding either way: report that as an interruption,
    // not as a crash.
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if !stopped() {
            default_hook(info);
        }
    }));
    match std::panic::catch_unwind(|| demo_main(quick)) {
        Ok(code) => code,
        Err(_) if stopped() => {
            println!();
            println!("Interrupted while setting up; what was made has been removed.");
            stopped_status()
        }
        Err(_) => ExitCode::from(101),
    }
}

fn demo_main(quick: bool) -> ExitCode {
    println!("ratelimit demo: the XDP rate limiter against simulated clients, live.");
    println!(
        "Every packet stays inside two network namespaces made for this demo; Ctrl-C stops it and cleans up."
    );
    println!();
    remove_leftovers();
    let started = Instant::now();
    let mut demo = Demo::new(quick);
    let netns = [
        demo.s.client.name().to_string(),
        demo.s.server.name().to_string(),
    ];
    let bpffs = demo.s.bpffs().to_path_buf();
    let outcome = demo.run();
    let failures = std::mem::take(&mut demo.failures);

    println!();
    if outcome.is_err() {
        println!("Interrupted: cleaning up ...");
    } else {
        println!("Cleaning up: stopping the daemon, detaching XDP, deleting the namespaces ...");
    }
    // The guards do the work: daemon (stop + `ratelimit detach`), veth pair, namespaces.
    drop(demo);
    let left: Vec<String> = ratelimit_tests::netns::list_netns()
        .into_iter()
        .filter(|n| netns.contains(n))
        .collect();
    if left.is_empty() && !bpffs.exists() {
        println!(
            "Clean: namespaces {} and {} deleted, {} removed.",
            netns[0],
            netns[1],
            bpffs.display()
        );
    } else {
        eprintln!(
            "warning: left behind: namespaces {left:?}, bpffs dir exists: {}",
            bpffs.exists()
        );
    }
    if outcome.is_err() {
        return stopped_status();
    }
    println!("Done in {:.0} s.", started.elapsed().as_secs_f64());
    if failures.is_empty() {
        println!("Everything behaved as described.");
        ExitCode::SUCCESS
    } else {
        println!("{} observation(s) were NOT as expected:", failures.len());
        for f in &failures {
            println!("    {f}");
        }
        ExitCode::from(1)
    }
}

/// Removes what earlier runs killed outright (SIGKILL, a crash) left behind: their
/// namespaces, bpffs pins, temp dirs and daemons. Only this demo's, and only of runs whose
/// process is gone, so a demo running beside this one keeps its lab.
fn remove_leftovers() {
    let found = Leftovers::of_dead_runs(TAG);
    if found.is_empty() {
        return;
    }
    println!("Removing what earlier runs that were killed left behind:");
    for ns in &found.netns {
        println!("    namespace {ns}");
    }
    for path in found.bpffs.iter().chain(&found.dirs) {
        println!("    {}", path.display());
    }
    for pid in found.processes() {
        println!("    the daemon still running for one of them (pid {pid})");
    }
    for failure in found.remove() {
        eprintln!("warning: {failure}");
    }
    println!();
}
