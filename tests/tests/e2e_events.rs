//! The events sink under stress: a stdout pipe nobody reads does not stall the control plane,
//! a full disk leaves only whole lines and counts the lines it lost, and a flood of events is
//! written at most `daemon.events_per_sec` lines a second, with summary lines that account for
//! every event left out.

use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr},
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use ratelimit_tests::{
    daemon::run_with_timeout,
    kernel_test,
    scenario::{Scenario, rule_counter},
};

const PORT: u16 = 9000;

/// A rule under which a client's first packet reaches its soft limit (1 of a threshold of 1):
/// every new source makes exactly one `soft_limit` event, so spoofed sources turn packets into
/// event lines one for one. The pressure marks are out of reach (see [`NO_PRESSURE_EVENTS`]).
const ONE_EVENT_PER_SOURCE: &str = r#"
[pressure]
cpu_busy = 1.0
listen_overflows_per_sec = 1000000

[[rule]]
name = "udp"
match = { protocol = "udp" }
threshold = { count = 1, interval = "1h" }
"#;

/// Pressure marks no machine reaches: a busy machine (the flood itself, or other work) would
/// otherwise raise the level under the default marks and add `pressure_high` and
/// `pressure_low` lines to the counts these tests make exactly.
const NO_PRESSURE_EVENTS: &str = "[pressure]\ncpu_busy = 1.0\nlisten_overflows_per_sec = 1000000\n";

/// The default of `daemon.events_per_sec`.
const DEFAULT_EVENTS_PER_SEC: usize = 1000;

/// One frame each from `n` distinct spoofed sources (198.20.0.0/16 upwards).
fn spoofed(s: &Scenario, n: u32) -> Vec<Vec<u8>> {
    (0..n)
        .map(|i| s.udp(IpAddr::V4(Ipv4Addr::from(0xc614_0000_u32 + i)), PORT))
        .collect()
}

/// `ratelimit ARGS --socket ...` with its own deadline, timed: a hung daemon fails the test
/// with the time it took instead of hanging it.
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

/// Every line of `text` as JSON; panics (with the line) at a line that is not whole JSON, and
/// if the text does not end with a newline.
fn whole_lines(text: &str) -> Vec<serde_json::Value> {
    assert!(
        text.is_empty() || text.ends_with('\n'),
        "the events file ends with a torn line: {:?}",
        &text[text.len().saturating_sub(200)..]
    );
    text.lines()
        .enumerate()
        .map(|(i, l)| {
            serde_json::from_str(l).unwrap_or_else(|e| {
                panic!("line {} is not a whole JSON object ({e}): {l:?}", i + 1)
            })
        })
        .collect()
}

/// With `events = "-"` and the daemon's stdout a pipe that nobody reads, a flood of events
/// fills the pipe; the control socket still answers at once (a stalled reader costs events,
/// counted, never the control plane).
#[test]
fn a_stalled_stdout_pipe_does_not_stall_the_control_plane() {
    kernel_test!();
    let mut s = Scenario::new("rlevp").with_events("-").with_stdout_pipe();
    s.start(ONE_EVENT_PER_SOURCE);
    // 4,000 sources in 2 s: about 700 KB of event lines, ten times what a pipe holds (64 KiB).
    let frames = spoofed(&s, 4000);
    let mut tx = s.sender();
    let flood = std::thread::spawn(move || {
        tx.send_n(frames.iter(), 4000, Some(Duration::from_micros(500)))
    });
    let tolerance = Duration::from_secs(1);
    let mut slowest = Duration::ZERO;
    let mut probes = 0;
    // Probe during the flood and for a second after it.
    let until = Instant::now() + Duration::from_secs(3);
    while Instant::now() < until {
        let (out, took) = timed_cli(&s, &["status", "--json"], Duration::from_secs(10));
        if let Err(e) = out {
            panic!(
                "`ratelimit status` failed after {took:?} while the events pipe was stalled: {e}"
            );
        }
        slowest = slowest.max(took);
        probes += 1;
        std::thread::sleep(Duration::from_millis(200));
    }
    let sent = flood.join().unwrap().sent;
    println!("{probes} status probes, slowest {slowest:?}; {sent} frames sent");
    assert!(
        slowest < tolerance,
        "`ratelimit status` took {slowest:?} (tolerance {tolerance:?}) while the events pipe was stalled"
    );
    // An operator command that itself writes an event answers too.
    let (out, took) = timed_cli(&s, &["ban", "add", "203.0.113.9"], Duration::from_secs(10));
    out.unwrap_or_else(|e| panic!("`ratelimit ban add` failed after {took:?}: {e}"));
    assert!(took < Duration::from_secs(2), "`ban add` took {took:?}");
    // The flood did fill the pipe: event lines are waiting, and none were written to it since.
    let ev = s.daemon().status().events;
    println!("status.events: {ev:?}");
    assert_eq!(ev.sink, "stdout", "{ev:?}");
    assert!(
        ev.queued + ev.lost.queue > 0,
        "the pipe never filled: {ev:?}"
    );
    assert_eq!(rule_counter(&s.stats(), "udp", "matched"), sent);
}

/// A small tmpfs of our own, unmounted (lazily: the daemon may still hold a file on it) and
/// removed on drop.
struct SmallFs(PathBuf);

impl SmallFs {
    fn new(size: &str) -> SmallFs {
        let dir = std::env::temp_dir().join(format!("rl-enospc-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let fs = SmallFs(dir);
        let out = Command::new("mount")
            .args([
                "-t",
                "tmpfs",
                "-o",
                &format!("size={size},mode=0700"),
                "rl-enospc",
            ])
            .arg(&fs.0)
            .output()
            .expect("running mount");
        assert!(
            out.status.success(),
            "mounting a tmpfs at {}: {}",
            fs.0.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        fs
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for SmallFs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).output();
        let _ = std::fs::remove_dir(&self.0);
    }
}

/// `ratelimit_events_lost_total{stage="..."}` from `/metrics`.
fn lost_metric(s: &Scenario, stage: &str) -> Option<u64> {
    let (code, text) = s.http_get("/metrics");
    assert_eq!(code, 200);
    let want = format!("ratelimit_events_lost_total{{stage=\"{stage}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(want.as_str()))
        .map(|v| v.trim().parse().unwrap())
}

/// The events file on a full filesystem: every line in it is whole (a write that fails midway
/// is cut back to the last whole line), every line that could not be written is counted (in
/// `status` and `/metrics`), and once there is room again lines are written again.
#[test]
fn a_full_disk_leaves_no_torn_event_line_and_counts_the_lost_lines() {
    kernel_test!();
    let fs = SmallFs::new("128k");
    let events = fs.path().join("events.jsonl");
    let mut s = Scenario::new("rlevd")
        .with_events(events.to_str().unwrap())
        .with_http(9477);
    s.start(NO_PRESSURE_EVENTS);
    // 3,000 operator bans: about 500 KB of `ban` lines for 128 KiB of room.
    let n = 3000u32;
    let list = s.daemon().config_dir().join("bans.txt");
    let text: String = (0..n)
        .map(|i| format!("{}\n", Ipv4Addr::from(0x0a00_0000_u32 + i)))
        .collect();
    std::fs::write(&list, text).unwrap();
    s.daemon()
        .cli_ok(&["ban", "add", "--file", list.to_str().unwrap()]);
    let written = whole_lines(&std::fs::read_to_string(&events).unwrap());
    assert!(
        written.iter().all(|e| e["event"] == "ban"),
        "only ban lines"
    );
    let kept = written.len() as u64;
    let ev = s.daemon().status().events;
    println!("{kept} of {n} ban lines written; status.events: {ev:?}");
    assert!(kept > 0 && kept < u64::from(n), "{kept} lines written");
    assert_eq!(ev.written, kept, "{ev:?}");
    assert_eq!(
        ev.lost.write,
        u64::from(n) - kept,
        "every line that was not written is counted: {ev:?}"
    );
    assert_eq!(lost_metric(&s, "write"), Some(u64::from(n) - kept));

    // Room again (an operator frees space): the next lines are written, whole.
    std::fs::OpenOptions::new()
        .write(true)
        .open(&events)
        .unwrap()
        .set_len(0)
        .unwrap();
    let more: String = (0..10u32)
        .map(|i| format!("{}\n", Ipv4Addr::from(0x0b00_0000_u32 + i)))
        .collect();
    std::fs::write(&list, more).unwrap();
    s.daemon()
        .cli_ok(&["ban", "add", "--file", list.to_str().unwrap()]);
    let after = whole_lines(&std::fs::read_to_string(&events).unwrap());
    assert_eq!(after.len(), 10, "{after:?}");
    assert!(after.iter().all(|e| e["event"] == "ban"));
    let ev = s.daemon().status().events;
    assert_eq!(ev.written, kept + 10);
    assert_eq!(ev.lost.write, u64::from(n) - kept);
}

/// A flood of new sources under a low-threshold rule makes far more events than the default
/// cap of 1,000 lines a second: no second of the file holds more event lines than that, each
/// second with suppressed events gets one summary line, and the summaries add up exactly to
/// what was suppressed (lines + suppressed = one event per source sent).
#[test]
fn an_event_flood_is_capped_per_second_with_exact_summaries() {
    kernel_test!();
    let mut s = Scenario::new("rlevc").with_http(9477);
    s.start(ONE_EVENT_PER_SOURCE);
    // 9,000 sources in 3 s: about 3,000 events a second, three times the cap.
    let n = 9000u32;
    let frames = spoofed(&s, n);
    let mut tx = s.sender();
    let sent = tx
        .send_n(
            frames.iter(),
            u64::from(n),
            Some(Duration::from_micros(333)),
        )
        .sent;
    // Until the last second's summary is out (written once its second has passed).
    std::thread::sleep(Duration::from_secs(3));
    let all = whole_lines(&s.events_text());
    let (summaries, lines): (Vec<_>, Vec<_>) = all.iter().partition(|e| e["event"] == "suppressed");
    let second = |e: &serde_json::Value| e["time"].as_str().unwrap()[..19].to_string();
    let mut per_second: BTreeMap<String, usize> = BTreeMap::new();
    for e in &lines {
        *per_second.entry(second(e)).or_default() += 1;
    }
    println!(
        "{sent} sources sent; {} event lines per second: {per_second:?}; {} summaries: {summaries:?}",
        lines.len(),
        summaries.len()
    );
    for (sec, count) in &per_second {
        assert!(
            *count <= DEFAULT_EVENTS_PER_SEC,
            "second {sec} has {count} event lines, more than the cap of {DEFAULT_EVENTS_PER_SEC}"
        );
    }
    let mut summary_seconds: Vec<String> = summaries.iter().map(|e| second(e)).collect();
    summary_seconds.dedup();
    assert_eq!(
        summary_seconds.len(),
        summaries.len(),
        "one summary line a second at most: {summaries:?}"
    );
    assert!(!summaries.is_empty(), "nothing was suppressed");
    let suppressed: u64 = summaries.iter().map(|e| e["count"].as_u64().unwrap()).sum();
    let suppressed_soft: u64 = summaries
        .iter()
        .map(|e| e["events"]["soft_limit"].as_u64().unwrap_or(0))
        .sum();
    for e in &summaries {
        let by_kind: u64 = e["events"]
            .as_object()
            .unwrap()
            .values()
            .map(|v| v.as_u64().unwrap())
            .sum();
        assert_eq!(by_kind, e["count"].as_u64().unwrap(), "{e}");
        assert_eq!(e["threshold"], DEFAULT_EVENTS_PER_SEC, "{e}");
    }
    let ev = s.daemon().status().events;
    println!("status.events: {ev:?}");
    // Nothing lost on the way, so lines and summaries account for every event.
    assert_eq!(
        (ev.lost.ring_buffer, ev.lost.queue, ev.lost.write),
        (0, 0, 0),
        "{ev:?}"
    );
    assert_eq!(ev.suppressed, suppressed, "{ev:?}");
    assert_eq!(ev.written, lines.len() as u64, "{ev:?}");
    assert_eq!(ev.lines_per_sec as usize, DEFAULT_EVENTS_PER_SEC, "{ev:?}");
    let soft_lines = lines.iter().filter(|e| e["event"] == "soft_limit").count() as u64;
    assert_eq!(
        soft_lines + suppressed_soft,
        sent,
        "one soft_limit event per source: written + suppressed"
    );
    assert_eq!(rule_counter(&s.stats(), "udp", "matched"), sent);
    let (code, text) = s.http_get("/metrics");
    assert_eq!(code, 200);
    assert!(
        text.lines()
            .any(|l| l == format!("ratelimit_events_suppressed_total {suppressed}")),
        "{text}"
    );
}
