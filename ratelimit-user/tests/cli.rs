//! The CLI without a kernel: `check-config` exit codes and `file:line:col: message` output,
//! clap's errors for bad arguments, and a clear error when no daemon is listening.

use std::process::Command;

fn ratelimit(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_ratelimit"))
        .args(args)
        .output()
        .expect("run ratelimit")
}

fn tmp(name: &str, text: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("rl-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

#[test]
fn check_config_accepts_a_good_file() {
    let p = tmp(
        "good.toml",
        "[lists]\ndeny = [\"203.0.113.0/24\"]\n\n[[rule]]\nname = \"syn\"\nmatch = { protocol = \"tcp\", tcp_flags = \"syn\" }\nthreshold = { count = 100, interval = \"1s\" }\n",
    );
    let out = ratelimit(&["check-config", p.to_str().unwrap()]);
    assert!(out.status.success(), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("ok (1 rules)"));
}

#[test]
fn check_config_reports_every_problem_with_position() {
    let p = tmp(
        "bad.toml",
        "[lists]\ndeny = [\"203.0.113.1/24\"]\n\n[[rule]]\nname = \"a\"\nthreshold = { count = 10, interval = \"0s\" }\ncolour = \"blue\"\n",
    );
    let out = ratelimit(&["check-config", p.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<&str> = err.lines().collect();
    assert_eq!(lines.len(), 3, "{err}");
    let f = p.display().to_string();
    assert!(
        lines[0].starts_with(&format!("{f}:2:")) && lines[0].contains("host bits"),
        "{err}"
    );
    assert!(
        lines[1].starts_with(&format!("{f}:6:")) && lines[1].contains("threshold.interval"),
        "{err}"
    );
    assert!(
        lines[2].starts_with(&format!("{f}:7:1:")) && lines[2].contains("colour"),
        "{err}"
    );
    let out = ratelimit(&["check-config", "/nonexistent/ratelimit.toml"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).starts_with("/nonexistent/ratelimit.toml:1:1:"));
}

#[test]
fn bad_arguments_get_clap_errors() {
    for args in [
        &["frobnicate"][..],
        &["top", "-n", "many"],
        &["ban"],
        &["rule", "set", "x", "--preview", "maybe"],
    ] {
        let out = ratelimit(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {out:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("error:") || err.contains("Usage:"),
            "{args:?}: {err}"
        );
    }
}

#[test]
fn no_daemon_is_a_clear_error() {
    let out = ratelimit(&["status", "--socket", "/nonexistent/ctl.sock"]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("cannot reach the daemon at /nonexistent/ctl.sock"),
        "{err}"
    );
}
