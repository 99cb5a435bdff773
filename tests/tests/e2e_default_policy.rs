//! `ratelimit run --iface IF` without a config file, as the README's quick start runs it: the
//! daemon enforces the embedded default policy (`ratelimit check-config --print-default`),
//! `status` says so, and its rules drop what they are there for.
//!
//! The daemon runs with its default paths (control socket, state directory, bpffs
//! directory), as an operator's would: the test refuses to run beside a daemon that already
//! uses them, and removes what it made of them, also when it fails.

use std::path::Path;
use std::time::{Duration, Instant};

use ratelimit_tests::{
    kernel_test,
    scenario::{Scenario, rule_counter},
    server::{Server, Spec},
};
use ratelimit_user::config::{DEFAULT_BPFFS_DIR, DEFAULT_CONTROL_SOCKET, DEFAULT_STATE_DIR};

const SPEC: Spec =
    Spec::new("ratelimit", "daemon.log").stopped_by(libc::SIGTERM, Duration::from_secs(10));

/// What the default paths held before the test: only what it made goes afterwards.
struct DefaultPaths {
    made_state_dir: bool,
    made_socket_dir: bool,
}

impl DefaultPaths {
    fn claim() -> DefaultPaths {
        assert!(
            !Path::new(DEFAULT_CONTROL_SOCKET).exists() && !Path::new(DEFAULT_BPFFS_DIR).exists(),
            "a daemon with the default paths is installed or running here ({DEFAULT_CONTROL_SOCKET}, \
             {DEFAULT_BPFFS_DIR}): this test runs one of its own with them"
        );
        DefaultPaths {
            made_state_dir: !Path::new(DEFAULT_STATE_DIR).exists(),
            made_socket_dir: !Path::new(DEFAULT_CONTROL_SOCKET).parent().unwrap().exists(),
        }
    }
}

impl Drop for DefaultPaths {
    fn drop(&mut self) {
        let _ = std::process::Command::new(ratelimit_tests::env::ratelimit_bin())
            .args(["detach", "--bpffs-dir", DEFAULT_BPFFS_DIR])
            .output();
        let _ = std::fs::remove_dir_all(DEFAULT_BPFFS_DIR);
        let _ = std::fs::remove_file(DEFAULT_CONTROL_SOCKET);
        if self.made_socket_dir {
            let _ = std::fs::remove_dir(Path::new(DEFAULT_CONTROL_SOCKET).parent().unwrap());
        }
        if self.made_state_dir {
            let _ = std::fs::remove_dir_all(DEFAULT_STATE_DIR);
        }
    }
}

fn cli_json(args: &[&str]) -> Result<serde_json::Value, String> {
    let out = std::process::Command::new(ratelimit_tests::env::ratelimit_bin())
        .args(args)
        .arg("--json")
        .output()
        .map_err(|e| e.to_string())?;
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    serde_json::from_slice(&out.stdout).map_err(|e| e.to_string())
}

#[test]
fn without_a_config_file_the_daemon_enforces_the_embedded_default_policy() {
    kernel_test!();
    let paths = DefaultPaths::claim();
    let s = Scenario::new("rldp");
    let b = s.pair.b().clone();
    let mut daemon = Server::new(SPEC, &s.server);
    let mut cmd = daemon.command(ratelimit_tests::env::ratelimit_bin());
    cmd.args(["run", "--iface", &b.name]);
    daemon.spawn(cmd);
    let give_up = Instant::now() + Duration::from_secs(30);
    let status = loop {
        match cli_json(&["status"]) {
            Ok(v) => break v,
            Err(e) if Instant::now() > give_up => panic!("no status: {e}\n{}", daemon.log()),
            Err(_) => std::thread::sleep(Duration::from_millis(100)),
        }
    };
    assert_eq!(status["policy"], "default", "{status}");
    assert_eq!(status["config"], serde_json::Value::Null, "{status}");
    let rules = cli_json(&["rules"]).unwrap();
    let names: Vec<&str> = rules
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "syn-per-client",
            "udp-reflection",
            "out-of-state-tcp",
            "per-source-backstop"
        ]
    );
    // The out-of-state rule at work: 100 ACKs of no connection, one a second admitted.
    let mut tx = s.sender();
    let ack = s
        .builder()
        .ipv4("198.18.77.1".parse().unwrap(), b.ipv4)
        .tcp(40000, 80, ratelimit_tests::packet::tcp_flags::ACK)
        .build();
    tx.send_n(std::iter::repeat(&ack), 100, None);
    let stats = loop {
        let st: ratelimit_user::policy::report::Stats =
            serde_json::from_value(cli_json(&["stats"]).unwrap()).unwrap();
        if rule_counter(&st, "out-of-state-tcp", "matched") >= 100 || Instant::now() > give_up {
            break st;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(rule_counter(&stats, "out-of-state-tcp", "matched"), 100);
    assert!(rule_counter(&stats, "out-of-state-tcp", "dropped") >= 98);
    daemon.stop();
    drop(paths);
}
