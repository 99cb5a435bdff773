//! What the daemon keeps on disk, and the tasks that keep it: a bans file that cannot be read
//! is moved aside and never overwritten, bans are restored one by one (one that cannot be
//! restored does not stop the start), rule bans keep their rule by name when rules move, every
//! file is made durable (the file, then the rename in its directory), and a background task
//! that fails is restarted with backoff and shown in `status` and `/metrics`.

use std::{
    net::{IpAddr, Ipv4Addr},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use ratelimit_tests::{kernel_test, scenario::Scenario};

const PORT: u16 = 9000;
const HTTP_PORT: u16 = 19477;

fn ip4(c: u8, d: u8) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(198, 19, c, d))
}

/// The value of one series in Prometheus text output (labels in any order).
fn metric(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    text.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        let (series, value) = l.rsplit_once(' ')?;
        let (n, rest) = series.split_once('{').unwrap_or((series, ""));
        if n != name {
            return None;
        }
        labels
            .iter()
            .all(|(k, v)| rest.contains(&format!("{k}=\"{v}\"")))
            .then(|| value.parse().ok())?
    })
}

/// `cond` polled every 50 ms for up to `timeout`; its last value.
fn wait_for(timeout: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let give_up = Instant::now() + timeout;
    loop {
        if cond() {
            return true;
        }
        if Instant::now() >= give_up {
            return false;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn state_dir(s: &Scenario) -> PathBuf {
    s.daemon().config_dir().join("state")
}

/// The files of `dir` whose names start with `prefix`, sorted.
fn files_starting(dir: &Path, prefix: &str) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.path())
                .filter(|p| {
                    p.file_name()
                        .and_then(|n| n.to_str())
                        .is_some_and(|n| n.starts_with(prefix))
                })
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// `ratelimit bans` as (cidr or key, rule name or "").
fn bans_by_rule(s: &Scenario) -> Vec<(String, String)> {
    let mut v: Vec<(String, String)> = s
        .daemon()
        .bans()
        .into_iter()
        .map(|b| {
            (
                b.cidr.unwrap_or_else(|| format!("key={}", b.key)),
                b.rule.unwrap_or_default(),
            )
        })
        .collect();
    v.sort();
    v
}

/// A bans file that does not parse (a torn write from an older version, a disk error, a bad
/// hand edit) is moved aside under a name of its own, the daemon says where, counts it in
/// `status` and `/metrics`, and starts. Saves after that write a new file and never touch the
/// copy, across restarts too.
#[test]
fn an_unreadable_bans_file_is_moved_aside_and_never_overwritten() {
    kernel_test!();
    let mut s = Scenario::new("rlp1").with_http(HTTP_PORT);
    s.start("");
    s.daemon()
        .cli_ok(&["ban", "add", "198.19.70.1", "--for", "1h"]);
    s.daemon_mut().stop();
    let dir = state_dir(&s);
    let file = dir.join("bans.json");
    assert!(file.exists(), "saved at stop");
    // Torn in the middle of its only entry.
    let torn = r#"[{"cidr":"198.19.70.1/32","expires_unix_ms":17"#;
    std::fs::write(&file, torn).unwrap();
    // A reboot loses bpffs: detach removes every pin, bans.json stays.
    assert!(s.daemon().detach().status.success());
    if let Err(e) = s.daemon_mut().try_restart() {
        panic!("the daemon must start with an unreadable bans file: {e}");
    }
    let aside = files_starting(&dir, "bans.json.bad-");
    assert_eq!(
        aside.len(),
        1,
        "the unreadable file is moved aside as bans.json.bad-<unix time> (state dir: {:?}; \
         bans.json now: {:?})",
        files_starting(&dir, ""),
        std::fs::read_to_string(&file).ok()
    );
    assert_eq!(std::fs::read_to_string(&aside[0]).unwrap(), torn);
    let aside_name = aside[0].display().to_string();
    let logs = s.daemon().logs();
    assert!(
        logs.lines().any(|l| l.contains("WARN")
            && l.contains(&aside_name)
            && l.contains(&*file.to_string_lossy())),
        "a warning names both paths:\n{logs}"
    );
    let status = s.daemon().status();
    assert_eq!(
        status.bans_restore.set_aside.as_deref(),
        Some(aside_name.as_str()),
        "{status:?}"
    );
    let (code, text) = s.http_get("/metrics");
    assert_eq!(code, 200);
    assert_eq!(
        metric(&text, "ratelimit_bans_files_set_aside_total", &[]),
        Some(1.0),
        "{text}"
    );
    // New bans are saved to a new file; the copy stays as it was.
    s.daemon()
        .cli_ok(&["ban", "add", "198.19.70.2", "--for", "1h"]);
    assert!(
        wait_for(Duration::from_secs(10), || std::fs::read_to_string(&file)
            .is_ok_and(|t| t.contains("198.19.70.2/32"))),
        "the new ban is saved within a second or so"
    );
    assert_eq!(std::fs::read_to_string(&aside[0]).unwrap(), torn);
    // And after a restart (the new file reads fine): nothing more is set aside.
    s.daemon_mut().stop();
    assert!(s.daemon().detach().status.success());
    s.daemon_mut().restart();
    assert_eq!(files_starting(&dir, "bans.json.bad-"), aside);
    assert_eq!(std::fs::read_to_string(&aside[0]).unwrap(), torn);
    assert_eq!(bans_by_rule(&s), [("198.19.70.2/32".into(), String::new())]);
    let restore = s.daemon().status().bans_restore;
    assert_eq!(restore.set_aside, None, "{restore:?}");
    assert_eq!(restore.restored, 1, "{restore:?}");
}

/// Each saved ban is restored on its own: one the maps cannot take (its table is full) and one
/// that does not parse are reported (log, `status`, `/metrics`) and kept in a copy of the file,
/// and the daemon starts with the others in force.
#[test]
fn bans_are_restored_one_by_one_and_one_that_fails_does_not_stop_the_start() {
    kernel_test!();
    use aya::maps::{LpmTrie, Map, MapData};
    use ratelimit_common::{
        addr::{IpKey, LpmAddr},
        caps::MAX_PASSING_BANS,
        maps::{BAN_PREVIEW, BanEntry},
    };
    let mut s = Scenario::new("rlp2").with_http(HTTP_PORT);
    s.start(
        r#"
[[rule]]
name = "udp-ban"
match = { protocol = "udp", dst_ports = ["9000"] }
action = "rate_based_ban"
threshold = { count = 100, interval = "1h" }
ban_threshold = { count = 200, interval = "1h" }
ban_duration = "1h"
preview = true
"#,
    );
    s.daemon_mut().stop();
    // The passing-ban table (preview bans) full, behind the daemon's back; the pins stay.
    let data = MapData::from_pin(s.bpffs().join("RL_BANS_PASSING")).expect("pinned table");
    let mut passing: LpmTrie<MapData, LpmAddr, BanEntry> =
        LpmTrie::try_from(Map::LpmTrie(data)).expect("lpm trie");
    for i in 0..MAX_PASSING_BANS {
        let mut e = ratelimit_tests::bans::flood_rule_ban(i, 0, 1);
        e.flags = BAN_PREVIEW;
        let key = ratelimit_user::kernel::datapath::ban_key(64, &IpKey { addr: e.addr });
        passing
            .insert(&key, e, 0)
            .expect("fill the passing-ban table");
    }
    drop(passing);
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let hour = now_ms + 3_600_000;
    let saved = serde_json::json!([
        {"cidr": "198.19.71.0/24", "expires_unix_ms": hour, "rule": null, "manual": true, "preview": false},
        {"cidr": "198.19.72.1/32", "expires_unix_ms": hour, "rule": "udp-ban", "manual": false, "preview": true},
        {"cidr": "198.19.300.0/24", "expires_unix_ms": hour, "rule": null, "manual": true, "preview": false},
        {"cidr": "2001:db8:71::/48", "expires_unix_ms": null, "rule": null, "manual": true, "preview": false},
    ]);
    let dir = state_dir(&s);
    let text = serde_json::to_string_pretty(&saved).unwrap();
    std::fs::write(dir.join("bans.json"), &text).unwrap();
    if let Err(e) = s.daemon_mut().try_restart() {
        panic!("one ban that cannot be restored must not stop the start: {e}");
    }
    let r = s.daemon().status().bans_restore;
    assert_eq!((r.restored, r.failed), (2, 2), "{r:?}");
    let failures = r.failures.join("\n");
    assert!(
        failures.contains("198.19.72.1/32") && failures.contains("198.19.300.0/24"),
        "{r:?}"
    );
    let copy = files_starting(&dir, "bans.json.unrestored-");
    assert_eq!(copy.len(), 1, "{:?}", files_starting(&dir, ""));
    assert_eq!(std::fs::read_to_string(&copy[0]).unwrap(), text);
    assert_eq!(r.kept_copy, Some(copy[0].display().to_string()), "{r:?}");
    let logs = s.daemon().logs();
    assert!(
        logs.lines()
            .any(|l| l.contains("WARN") && l.contains("198.19.72.1/32")),
        "{logs}"
    );
    let (_, metrics) = s.http_get("/metrics");
    for (outcome, n) in [("restored", 2.0), ("failed", 2.0), ("expired", 0.0)] {
        assert_eq!(
            metric(
                &metrics,
                "ratelimit_saved_bans_total",
                &[("outcome", outcome)]
            ),
            Some(n),
            "{outcome}: {metrics}"
        );
    }
    // The good ones are in force.
    let sink = s.sink(PORT + 1);
    let mut tx = s.sender();
    tx.send_n(std::iter::repeat(s.udp(ip4(71, 5), PORT + 1)), 10, None);
    tx.send_n(
        std::iter::repeat(s.udp("2001:db8:71::5".parse().unwrap(), PORT + 1)),
        10,
        None,
    );
    tx.send_n(std::iter::repeat(s.udp(ip4(73, 5), PORT + 1)), 10, None);
    sink.wait_quiet(Duration::from_millis(300));
    let got = sink.stop();
    assert_eq!(
        (
            got.from(ip4(71, 5)),
            got.from("2001:db8:71::5".parse().unwrap()),
            got.from(ip4(73, 5))
        ),
        (0, 0, 10)
    );
}

const TWO_RULES: &str = r#"
[[rule]]
name = "a"
match = { protocol = "udp", dst_ports = ["9000"] }
action = "rate_based_ban"
threshold = { count = 2, interval = "1h" }
algorithm = "fixed_window"
ban_threshold = { count = 3, interval = "1h" }
ban_duration = "1h"
"#;

const RULE_B: &str = r#"
[[rule]]
name = "b"
match = { protocol = "udp", dst_ports = ["9001"] }
action = "rate_based_ban"
threshold = { count = 2, interval = "1h" }
algorithm = "fixed_window"
ban_threshold = { count = 3, interval = "1h" }
ban_duration = "1h"
"#;

const RULE_ALL: &str = r#"
[[rule]]
name = "all"
match = { protocol = "udp", dst_ports = ["9002"] }
key = "all"
action = "rate_based_ban"
threshold = { count = 2, interval = "1h" }
algorithm = "fixed_window"
ban_threshold = { count = 3, interval = "1h" }
ban_duration = "1h"
"#;

/// Bans name their rule by name, whatever position the rule has: a reload or a restart that
/// reorders the rules leaves every ban (per client, and a rule's aggregate ban) with its own
/// rule, in `bans`, in the state file and after a reboot. A rule that is removed takes its
/// bans with it (lifted, with an `unban` event naming it), as it takes its counters.
#[test]
fn bans_keep_their_rule_by_name_when_rules_move() {
    kernel_test!();
    let mut s = Scenario::new("rlp3");
    s.start(&format!("{TWO_RULES}{RULE_B}{RULE_ALL}"));
    let head = {
        let cfg = std::fs::read_to_string(s.daemon().config_path()).unwrap();
        cfg.split("[[rule]]").next().unwrap().to_string()
    };
    let mut tx = s.sender();
    let (x, y) = (ip4(74, 1), ip4(74, 2));
    tx.send_n(std::iter::repeat(s.udp(x, PORT)), 5, None);
    tx.send_n(std::iter::repeat(s.udp(y, PORT + 1)), 5, None);
    tx.send_n(std::iter::repeat(s.udp(ip4(74, 3), PORT + 2)), 5, None);
    let want = vec![
        ("198.19.74.1/32".to_string(), "a".to_string()),
        ("198.19.74.2/32".into(), "b".into()),
        ("key=all".into(), "all".into()),
    ];
    let mut want_sorted = want.clone();
    want_sorted.sort();
    assert!(
        wait_for(Duration::from_secs(5), || bans_by_rule(&s) == want_sorted),
        "{:?}",
        bans_by_rule(&s)
    );
    // Reorder: all, b, a.
    s.daemon_mut()
        .write_config(&format!("{head}{RULE_ALL}{RULE_B}{TWO_RULES}"));
    s.daemon().cli_ok(&["reload"]);
    assert_eq!(bans_by_rule(&s), want_sorted, "after a reordering reload");
    // Saved by name, and after a reboot still the right rules.
    s.daemon_mut().stop();
    let saved = std::fs::read_to_string(state_dir(&s).join("bans.json")).unwrap();
    let saved: serde_json::Value = serde_json::from_str(&saved).unwrap();
    let rule_of = |cidr: &str| {
        saved
            .as_array()
            .unwrap()
            .iter()
            .find(|b| b["cidr"] == cidr)
            .map(|b| b["rule"].clone())
    };
    assert_eq!(rule_of("198.19.74.1/32"), Some("a".into()), "{saved}");
    assert_eq!(rule_of("198.19.74.2/32"), Some("b".into()), "{saved}");
    assert!(s.daemon().detach().status.success());
    s.daemon_mut().restart();
    assert_eq!(bans_by_rule(&s), want_sorted, "after a reboot");
    // A restart that adopts the pinned maps with the rules in yet another order.
    s.daemon_mut()
        .write_config(&format!("{head}{RULE_B}{TWO_RULES}{RULE_ALL}"));
    s.daemon_mut().restart();
    assert_eq!(bans_by_rule(&s), want_sorted, "after a reordering restart");
    // Rule a goes: its ban is lifted and says so; the others stay.
    s.daemon_mut()
        .write_config(&format!("{head}{RULE_ALL}{RULE_B}"));
    s.daemon().cli_ok(&["reload"]);
    assert_eq!(
        bans_by_rule(&s),
        [
            ("198.19.74.2/32".to_string(), "b".to_string()),
            ("key=all".into(), "all".into())
        ]
    );
    let unban: Vec<_> = s
        .events()
        .into_iter()
        .filter(|e| e["event"] == "unban")
        .collect();
    assert_eq!(unban.len(), 1, "{unban:?}");
    assert_eq!(unban[0]["rule"], "a", "{unban:?}");
    assert_eq!(unban[0]["client"], "198.19.74.1/32", "{unban:?}");
}

/// A running `strace` of the daemon, killed on drop.
struct Strace {
    child: Child,
    out: PathBuf,
}

impl Strace {
    /// Trace the daemon's syncs and renames into `out`, each fd with its path (`-y`), from
    /// half a second on (time to attach to every thread).
    fn attach(pid: u32, out: PathBuf) -> Strace {
        let child = Command::new("strace")
            .args([
                "-f",
                "-y",
                "-qq",
                "-e",
                "trace=fsync,fdatasync,rename,renameat,renameat2",
            ])
            .arg("-o")
            .arg(&out)
            .arg("-p")
            .arg(pid.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("strace (Debian package strace)");
        let mut st = Strace { child, out };
        // With -qq strace says nothing once attached: give it the moment, checking it lives.
        std::thread::sleep(Duration::from_millis(500));
        if let Ok(Some(status)) = st.child.try_wait() {
            panic!("strace exited at once: {status}");
        }
        st
    }

    fn lines(&self) -> Vec<String> {
        std::fs::read_to_string(&self.out)
            .unwrap_or_default()
            .lines()
            .map(str::to_string)
            .collect()
    }
}

impl Drop for Strace {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Whether the traced `lines` hold, for `name` in `dir`: an fsync of its temporary file, its
/// rename onto `name`, then an fsync of `dir` itself. (The rename is only durable once the
/// directory is; fsyncing the file alone leaves a crash free to lose the new name.)
fn durable_write(lines: &[String], dir: &Path, name: &str) -> bool {
    let dir = dir.display().to_string();
    let target = format!("{dir}/{name}");
    let Some(renamed) = lines
        .iter()
        .rposition(|l| l.contains("rename") && l.contains(&format!("\"{target}\"")))
    else {
        return false;
    };
    let file_synced = lines[..renamed]
        .iter()
        .any(|l| l.contains("fsync(") && l.contains(&format!("{dir}/.{name}")));
    let dir_synced = lines[renamed..]
        .iter()
        .any(|l| l.contains("fsync(") && l.contains(&format!("<{dir}>")));
    file_synced && dir_synced
}

/// Every file the daemon keeps by rename (the bans, the rule names) is written durably: the
/// file synced, renamed, and the directory synced.
#[test]
fn files_kept_by_rename_are_synced_and_so_is_their_directory() {
    kernel_test!();
    let mut s = Scenario::new("rlp4");
    s.start(TWO_RULES);
    let dir = std::fs::canonicalize(state_dir(&s)).unwrap();
    let trace = Strace::attach(
        s.daemon().pid().unwrap(),
        s.daemon().config_dir().join("strace.out"),
    );
    s.daemon()
        .cli_ok(&["ban", "add", "198.19.75.1", "--for", "1h"]);
    let bans_ok = wait_for(Duration::from_secs(10), || {
        durable_write(&trace.lines(), &dir, "bans.json")
    });
    // A reload writes the rule names.
    let cfg = std::fs::read_to_string(s.daemon().config_path()).unwrap();
    s.daemon_mut().write_config(&format!("{cfg}{RULE_B}"));
    s.daemon().cli_ok(&["reload"]);
    let rules_ok = wait_for(Duration::from_secs(10), || {
        durable_write(&trace.lines(), &dir, "rules.json")
    });
    let lines = trace.lines();
    drop(trace);
    assert!(
        bans_ok && rules_ok,
        "bans.json durable: {bans_ok}, rules.json durable: {rules_ok}; traced:\n{}",
        lines.join("\n")
    );
}

/// The ban persistence task, failing (here its file's name is taken by a directory), is
/// restarted with backoff, and `status` and `/metrics` show it down and its restarts; once the
/// cause is gone the next restart saves the bans and shows it up again.
#[test]
fn a_failing_background_task_is_restarted_and_shown() {
    kernel_test!();
    let mut s = Scenario::new("rlp5").with_http(HTTP_PORT);
    s.start("");
    let file = state_dir(&s).join("bans.json");
    let _ = std::fs::remove_file(&file);
    std::fs::create_dir_all(file.join("in-the-way")).unwrap();
    s.daemon()
        .cli_ok(&["ban", "add", "198.19.76.1", "--for", "1h"]);
    let task = |s: &Scenario| {
        s.daemon()
            .status()
            .tasks
            .remove("ban_persistence")
            .unwrap_or_default()
    };
    let failed = wait_for(Duration::from_secs(10), || task(&s).restarts >= 1);
    let status = s.daemon().status();
    assert!(failed, "the failure is shown in status: {status:?}");
    let t = task(&s);
    assert!(
        t.last_error
            .as_deref()
            .is_some_and(|e| e.contains("bans.json")),
        "{t:?}"
    );
    let (_, text) = s.http_get("/metrics");
    assert!(
        metric(
            &text,
            "ratelimit_task_restarts_total",
            &[("task", "ban_persistence")]
        )
        .is_some_and(|n| n >= 1.0),
        "{text}"
    );
    assert!(
        metric(&text, "ratelimit_task_up", &[("task", "events")]) == Some(1.0),
        "{text}"
    );
    // The cause goes: a restart (within the backoff) saves the ban and the task is up.
    std::fs::remove_dir_all(&file).unwrap();
    assert!(
        wait_for(Duration::from_secs(20), || std::fs::read_to_string(&file)
            .is_ok_and(|t| t.contains("198.19.76.1/32"))),
        "saved once the directory is gone: {:?}",
        task(&s)
    );
    assert!(
        wait_for(Duration::from_secs(5), || task(&s).up),
        "{:?}",
        task(&s)
    );
    let (_, text) = s.http_get("/metrics");
    assert_eq!(
        metric(&text, "ratelimit_task_up", &[("task", "ban_persistence")]),
        Some(1.0),
        "{text}"
    );
}
