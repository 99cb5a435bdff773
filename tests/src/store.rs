//! A real `redis-server`, the fleet's store, run in a lab namespace on its own port and
//! directory (no persistence: `--save ""`, `--appendonly no`).
//!
//! The guard owns the process and a private temp dir (the server's log). On drop it kills the
//! server (continuing it first if the test stopped it) and removes the dir, also when a test
//! panics. Tests can kill it, start it again on the same port, and stop or continue it
//! (SIGSTOP, SIGCONT) to see what the daemons do without their store.
//!
//! [`Cluster`] runs three such servers as a Redis Cluster of three masters and no replicas
//! (`--cluster-enabled yes`, then `redis-cli --cluster create`), each with its own port and
//! directory (its `nodes.conf` survives a kill, so a restarted master rejoins with its slots).

use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use crate::netns::{NetNs, command_in_fd, describe, in_netns};

/// How long a start waits for the server to answer `PING`.
pub const READY_TIMEOUT: Duration = Duration::from_secs(20);

/// The `redis-server` binary on `PATH` (or in /usr/sbin).
///
/// # Panics
///
/// If there is none, saying how to install it.
pub fn binary() -> PathBuf {
    crate::tool::find_binary("redis-server", "redis-server")
}

/// A running `redis-server` in a lab namespace.
pub struct Redis {
    child: Option<Child>,
    dir: PathBuf,
    ns_fd: OwnedFd,
    port: u16,
    /// An address of the server in its namespace, for the readiness check.
    probe: SocketAddr,
    stopped: bool,
    /// More `redis-server` arguments (the cluster's).
    extra: Vec<String>,
}

impl Redis {
    /// Starts `redis-server` in `ns` listening on every address of `ns` at `port`, and waits
    /// until it answers `PING` at `probe` (an address of `ns`).
    pub fn start(ns: &NetNs, probe: std::net::IpAddr, port: u16) -> Redis {
        Redis::start_with(ns, probe, port, &[])
    }

    /// [`Redis::start`] with more `redis-server` arguments.
    pub fn start_with(ns: &NetNs, probe: std::net::IpAddr, port: u16, extra: &[&str]) -> Redis {
        let mut r = Redis {
            child: None,
            dir: crate::daemon::make_temp_dir(),
            ns_fd: ns.dup_fd(),
            port,
            probe: SocketAddr::new(probe, port),
            stopped: false,
            extra: extra.iter().map(|a| a.to_string()).collect(),
        };
        r.launch();
        r
    }

    fn launch(&mut self) {
        assert!(self.child.is_none(), "redis-server already running");
        let log = self.dir.join("redis.log");
        let mut cmd = command_in_fd(self.ns_fd.try_clone().expect("dup netns fd"), binary());
        cmd.args(["--port", &self.port.to_string()])
            .args(["--bind", "0.0.0.0", "::"])
            .args(["--protected-mode", "no"])
            .args(["--save", ""])
            .args(["--appendonly", "no"])
            .args(["--daemonize", "no"])
            .arg("--dir")
            .arg(&self.dir)
            .arg("--logfile")
            .arg(&log)
            .args(&self.extra)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        self.child = Some(
            cmd.spawn()
                .unwrap_or_else(|e| panic!("starting `{}`: {e}", describe(&cmd))),
        );
        self.stopped = false;
        let give_up = Instant::now() + READY_TIMEOUT;
        loop {
            if self.ping() {
                return;
            }
            if let Some(c) = self.child.as_mut()
                && let Ok(Some(status)) = c.try_wait()
            {
                panic!("redis-server exited ({status}):\n{}", self.log());
            }
            if Instant::now() > give_up {
                panic!(
                    "redis-server did not answer PING within {READY_TIMEOUT:?}:\n{}",
                    self.log()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Whether the server answers `PING` within a second.
    pub fn ping(&self) -> bool {
        let addr = self.probe;
        in_netns(self.ns_fd_borrow(), move || {
            let Ok(mut c) = TcpStream::connect_timeout(&addr, Duration::from_secs(1)) else {
                return false;
            };
            let _ = c.set_read_timeout(Some(Duration::from_secs(1)));
            if c.write_all(b"PING\r\n").is_err() {
                return false;
            }
            let mut buf = [0u8; 16];
            matches!(c.read(&mut buf), Ok(n) if buf[..n].starts_with(b"+PONG"))
        })
    }

    fn ns_fd_borrow(&self) -> std::os::fd::BorrowedFd<'_> {
        use std::os::fd::AsFd as _;
        self.ns_fd.as_fd()
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// `redis-cli` against this server: its output (stdout and stderr), trimmed.
    pub fn cli(&self, args: &[&str]) -> String {
        let fd = self.ns_fd.try_clone().expect("dup netns fd");
        let mut cmd = command_in_fd(fd, cli_binary());
        cmd.arg("-h")
            .arg(self.probe.ip().to_string())
            .arg("-p")
            .arg(self.port.to_string())
            .args(args)
            .stdin(Stdio::null());
        let out = cmd
            .output()
            .unwrap_or_else(|e| panic!("running `{}`: {e}", describe(&cmd)));
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
        .trim()
        .to_string()
    }

    /// The running server's process id.
    pub fn pid(&self) -> Option<i32> {
        self.child.as_ref().map(|c| c.id() as i32)
    }

    /// SIGKILL, and wait for it: the store is gone (with its data).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            if self.stopped {
                // SAFETY: signalling our own child.
                unsafe { libc::kill(c.id() as i32, libc::SIGCONT) };
            }
            let _ = c.kill();
            let _ = c.wait();
        }
        self.stopped = false;
    }

    /// Start it again on the same port, empty.
    pub fn restart(&mut self) {
        self.kill();
        self.launch();
    }

    /// SIGSTOP: the server keeps its sockets but answers nothing.
    pub fn freeze(&mut self) {
        if let Some(pid) = self.pid() {
            // SAFETY: signalling our own child.
            unsafe { libc::kill(pid, libc::SIGSTOP) };
            self.stopped = true;
        }
    }

    /// SIGCONT after [`Redis::freeze`].
    pub fn thaw(&mut self) {
        if let Some(pid) = self.pid() {
            // SAFETY: signalling our own child.
            unsafe { libc::kill(pid, libc::SIGCONT) };
            self.stopped = false;
        }
    }

    /// The server's log so far.
    pub fn log(&self) -> String {
        let path = self.dir.join("redis.log");
        format!(
            "----- redis log ({}) -----\n{}\n----- end of redis log -----",
            path.display(),
            std::fs::read_to_string(&path).unwrap_or_else(|e| format!("({e})"))
        )
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The `redis-cli` binary beside `redis-server`.
pub fn cli_binary() -> PathBuf {
    binary().with_file_name("redis-cli")
}

/// A Redis Cluster of three masters (no replicas) in a lab namespace. Every node announces
/// the one address `announce` (put on the namespace's loopback by the caller, and routed to
/// from the daemons' namespaces), on its own port. Dropping it kills every node.
pub struct Cluster {
    pub nodes: Vec<Redis>,
    ns_fd: OwnedFd,
    announce: std::net::Ipv4Addr,
}

impl Cluster {
    /// Starts three nodes on `ports` and joins them into one cluster (`redis-cli --cluster
    /// create`, every slot assigned), waiting until each says `cluster_state:ok`.
    pub fn start(ns: &NetNs, announce: std::net::Ipv4Addr, ports: [u16; 3]) -> Cluster {
        let ip = announce.to_string();
        let nodes: Vec<Redis> = ports
            .iter()
            .map(|&port| {
                Redis::start_with(
                    ns,
                    std::net::IpAddr::V4(announce),
                    port,
                    &[
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        "nodes.conf",
                        "--cluster-node-timeout",
                        "2000",
                        // A master lost takes only its own slots out of service, as an
                        // operator running a fleet's store sets it.
                        "--cluster-require-full-coverage",
                        "no",
                        "--cluster-announce-ip",
                        &ip,
                    ],
                )
            })
            .collect();
        let c = Cluster {
            nodes,
            ns_fd: ns.dup_fd(),
            announce,
        };
        let mut args: Vec<String> = vec!["--cluster".into(), "create".into()];
        args.extend(ports.iter().map(|p| format!("{ip}:{p}")));
        args.extend(["--cluster-replicas", "0", "--cluster-yes"].map(String::from));
        let out = c.cli_raw(&args);
        assert!(
            out.status.success(),
            "redis-cli --cluster create failed: {}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        for i in 0..3 {
            assert!(
                c.wait_state(i, "ok", READY_TIMEOUT),
                "node {i} not ok: {}\n{}",
                c.cli(i, &["cluster", "info"]),
                c.nodes[i].log()
            );
        }
        c
    }

    fn cli_raw(&self, args: &[String]) -> std::process::Output {
        let mut cmd = command_in_fd(self.ns_fd.try_clone().expect("dup netns fd"), cli_binary());
        cmd.args(args).stdin(Stdio::null());
        cmd.output()
            .unwrap_or_else(|e| panic!("running `{}`: {e}", describe(&cmd)))
    }

    /// `redis-cli` against node `i` (no redirects followed): its output.
    pub fn cli(&self, i: usize, args: &[&str]) -> String {
        let mut all: Vec<String> = vec![
            "-h".into(),
            self.announce.to_string(),
            "-p".into(),
            self.nodes[i].port().to_string(),
        ];
        all.extend(args.iter().map(|a| a.to_string()));
        let out = self.cli_raw(&all);
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    }

    /// Waits until node `i` reports `cluster_state:<state>`.
    pub fn wait_state(&self, i: usize, state: &str, timeout: Duration) -> bool {
        let want = format!("cluster_state:{state}");
        let give_up = Instant::now() + timeout;
        loop {
            if self.cli(i, &["cluster", "info"]).contains(&want) {
                return true;
            }
            if Instant::now() > give_up {
                return false;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The node serving the slot of the key `key` (the others answer `MOVED`).
    pub fn owner_of(&self, key: &str) -> usize {
        (0..self.nodes.len())
            .find(|&i| {
                let out = self.cli(i, &["exists", key]);
                !out.contains("MOVED") && out.trim().ends_with(['0', '1'])
            })
            .unwrap_or_else(|| panic!("no node serves {key}"))
    }

    /// The nodes' `host:port`s, as a `redis+cluster://` address lists them.
    pub fn url(&self) -> String {
        let nodes: Vec<String> = self
            .nodes
            .iter()
            .map(|n| format!("{}:{}", self.announce, n.port()))
            .collect();
        format!("redis+cluster://{}", nodes.join(","))
    }

    /// The keys node `i` holds.
    pub fn dbsize(&self, i: usize) -> u64 {
        self.cli(i, &["dbsize"])
            .trim()
            .trim_start_matches("(integer) ")
            .parse()
            .unwrap_or(0)
    }
}
