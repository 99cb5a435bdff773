//! What the daemon keeps on disk: every file is made durable (the file, then the rename in its
//! directory).

use std::{
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use ratelimit_tests::{kernel_test, scenario::Scenario};

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
