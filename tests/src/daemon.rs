//! The real `ratelimit` daemon, run inside a lab namespace.
//!
//! End-to-end tests exercise the shipped binary, not a library call, so
//! config parsing, attach, the control socket and shutdown are all covered.
//! The guard owns everything the daemon creates: its process and a private temp
//! dir for the config, logs and (if the config puts it there) the control
//! socket, both in a [`Server`]; on drop it stops the daemon, runs `ratelimit
//! detach` so no XDP program or bpffs pin outlives the test, and prints the
//! daemon's log if the test is panicking, because a failed end-to-end test is
//! only debuggable with it.
//!
//! The daemon is started with [`command_in_fd`] (setns in `pre_exec`), not
//! `ip netns exec`, which would remount `/sys` and hide `/sys/fs/bpf`.

use std::io::{self, Read};
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Output, Stdio};
use std::time::{Duration, Instant};

use crate::netns::{NetNs, command_in_fd, describe};
use crate::server::{Server, Spec};
use ratelimit_user::{
    api::status::Status,
    policy::report::{Ban, Stats},
};

/// How long [`Daemon::start`] waits for the control socket to answer.
pub const READY_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a stop waits after SIGTERM before SIGKILL.
pub const STOP_TIMEOUT: Duration = Duration::from_secs(5);
/// Upper bound on any one CLI call, so a hung daemon fails the test instead
/// of hanging it.
pub const CLI_TIMEOUT: Duration = Duration::from_secs(30);

/// The daemon as the lab runs it: stopped by SIGTERM; its guard prints its logs itself (both
/// of them, with its exit status).
const SPEC: Spec = Spec::new("daemon", "daemon.stderr")
    .ready_within(READY_TIMEOUT, Duration::from_millis(50))
    .stopped_by(libc::SIGTERM, STOP_TIMEOUT)
    .quiet();

/// A running `ratelimit run` in a namespace, with its own temp dir.
#[derive(Debug)]
pub struct Daemon {
    server: Server,
    config: PathBuf,
    socket: PathBuf,
    ns_name: String,
    bin: PathBuf,
    /// Whether the daemon's stdout is a pipe (see [`Daemon::start_in_with_stdout_pipe`]).
    stdout_pipe: bool,
    /// The read end of that pipe, held open and never read: writes to it fill the pipe and
    /// then block, as a stalled log reader does.
    stdout_reader: Option<OwnedFd>,
    /// More environment variables for the daemon (also when restarted).
    env: Vec<(String, String)>,
}

impl Daemon {
    /// Writes `config_toml` (used verbatim; it must set
    /// `[daemon] control_socket`) to a fresh temp dir, starts the daemon in
    /// `ns` and waits until `ratelimit status` answers on the control socket.
    ///
    /// # Panics
    ///
    /// If the binary is missing, the config has no control socket, or the
    /// daemon exits or does not answer within [`READY_TIMEOUT`] (the panic
    /// message includes its log).
    pub fn start(ns: &NetNs, config_toml: &str) -> Daemon {
        Daemon::start_in(ns, |_| config_toml.to_string())
    }

    /// Like [`Daemon::start`], but the config is made by `make_config` from
    /// the daemon's fresh temp dir, so it can put the control socket, state
    /// dir and events file inside it (cleaned up with the guard).
    pub fn start_in(ns: &NetNs, make_config: impl FnOnce(&Path) -> String) -> Daemon {
        Daemon::start_with(ns, make_config, false, Vec::new())
    }

    /// Like [`Daemon::start_in`], with more environment variables for the daemon (kept for
    /// its restarts).
    pub fn start_in_with_env(
        ns: &NetNs,
        make_config: impl FnOnce(&Path) -> String,
        env: Vec<(String, String)>,
    ) -> Daemon {
        Daemon::start_with(ns, make_config, false, env)
    }

    /// Like [`Daemon::start_in`], with the daemon's stdout a pipe that nobody reads (the test
    /// holds its read end open until the guard drops): what `events = "-"` meets when the
    /// process reading the daemon's output stalls.
    pub fn start_in_with_stdout_pipe(
        ns: &NetNs,
        make_config: impl FnOnce(&Path) -> String,
    ) -> Daemon {
        Daemon::start_with(ns, make_config, true, Vec::new())
    }

    fn start_with(
        ns: &NetNs,
        make_config: impl FnOnce(&Path) -> String,
        stdout_pipe: bool,
        env: Vec<(String, String)>,
    ) -> Daemon {
        let mut d = Daemon::prepare(ns, make_config);
        d.stdout_pipe = stdout_pipe;
        d.env = env;
        d.launch();
        if let Err(e) = d.wait_ready(READY_TIMEOUT) {
            panic!("daemon did not become ready: {e}\n{}", d.logs());
        }
        d
    }

    /// Starts the daemon without waiting for it, for tests that expect it to
    /// fail (bad config, missing interface); see [`Daemon::wait_ready`] and
    /// [`Daemon::wait_exit`].
    pub fn spawn(ns: &NetNs, config_toml: &str) -> Daemon {
        Daemon::spawn_in(ns, |_| config_toml.to_string())
    }

    /// [`Daemon::spawn`] with the config made from the temp dir.
    pub fn spawn_in(ns: &NetNs, make_config: impl FnOnce(&Path) -> String) -> Daemon {
        let mut d = Daemon::prepare(ns, make_config);
        d.launch();
        d
    }

    /// The guard with its temp dir and config written, the daemon not started yet.
    fn prepare(ns: &NetNs, make_config: impl FnOnce(&Path) -> String) -> Daemon {
        let bin = crate::env::ratelimit_bin();
        // From here on the guard exists, so the dir is removed even on panic.
        let server = Server::new(SPEC, ns);
        let toml = make_config(server.dir());
        let config = server.path("ratelimit.toml");
        let mut d = Daemon {
            server,
            socket: PathBuf::new(),
            config,
            ns_name: ns.name().to_string(),
            bin,
            stdout_pipe: false,
            stdout_reader: None,
            env: Vec::new(),
        };
        d.write_config(&toml);
        d
    }

    fn launch(&mut self) {
        let stdout = if self.stdout_pipe {
            let (read, write) = pipe();
            self.stdout_reader = Some(read);
            Stdio::from(write)
        } else {
            Stdio::from(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(self.server.path("daemon.stdout"))
                    .expect("opening daemon.stdout"),
            )
        };
        // stderr to the server's log, `daemon.stderr`.
        let mut cmd = self.server.command(&self.bin);
        cmd.arg("run")
            .arg("--config")
            .arg(&self.config)
            .env("RUST_BACKTRACE", "1")
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdout(stdout);
        self.server.spawn(cmd);
    }

    /// The binary as a command whose child runs in the daemon's namespace.
    fn command(&self) -> Command {
        command_in_fd(self.server.dup_ns_fd(), &self.bin)
    }

    /// Polls until `ratelimit status` succeeds on the control socket.
    /// Err (with the reason) if the daemon exits first or `timeout` passes.
    pub fn wait_ready(&mut self, timeout: Duration) -> Result<(), String> {
        let (bin, socket) = (&self.bin, &self.socket);
        self.server.wait_ready(timeout, |_| {
            if !socket.exists() {
                return Err(format!(
                    "control socket {} does not exist yet",
                    socket.display()
                ));
            }
            let mut cmd = Command::new(bin);
            cmd.arg("status").arg("--socket").arg(socket);
            // One answer may wait behind a walk of a full table (262,144 bans) on a busy
            // machine: seconds, not the milliseconds it takes on an idle one.
            match run_with_timeout(&mut cmd, Duration::from_secs(5)) {
                Ok(out) if out.status.success() => Ok(()),
                Ok(out) => Err(format!(
                    "`ratelimit status --socket {}` failed ({}): {}",
                    socket.display(),
                    out.status,
                    String::from_utf8_lossy(&out.stderr).trim()
                )),
                Err(e) => Err(e),
            }
        })
    }

    /// Waits up to `timeout` for the daemon to exit on its own.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        self.server.wait_exit(timeout)
    }

    /// The exit status if the daemon has exited (None while running or if
    /// it was already reaped by a stop).
    pub fn try_wait(&mut self) -> Option<ExitStatus> {
        self.server.try_wait()
    }

    /// True while the daemon process is alive.
    pub fn is_running(&mut self) -> bool {
        self.server.is_running()
    }

    /// The daemon's pid while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.server.pid()
    }

    /// Sends `signal` (e.g. `libc::SIGHUP` to reload).
    ///
    /// # Panics
    ///
    /// If the daemon is not running or kill(2) fails.
    pub fn signal(&self, signal: i32) {
        if let Err(e) = self.server.signal(signal) {
            panic!("sending signal {signal} to the daemon: {e}");
        }
    }

    /// SIGTERM, then SIGKILL after [`STOP_TIMEOUT`]; returns the exit status
    /// (None if it was not running).
    pub fn stop(&mut self) -> Option<ExitStatus> {
        self.server.stop()
    }

    /// SIGKILL (a crash, for recovery tests: pins and attachments stay).
    /// Returns the exit status (None if it was not running).
    pub fn kill9(&mut self) -> Option<ExitStatus> {
        self.server.kill()
    }

    /// Stops the daemon if it runs, starts it again with the same config
    /// file (logs are appended) and waits until it answers.
    ///
    /// # Panics
    ///
    /// If it does not become ready within [`READY_TIMEOUT`].
    pub fn restart(&mut self) {
        self.stop();
        self.launch();
        if let Err(e) = self.wait_ready(READY_TIMEOUT) {
            panic!(
                "daemon did not become ready after restart: {e}\n{}",
                self.logs()
            );
        }
    }

    /// [`Daemon::restart`] for a start that may fail: Err with the daemon's logs if it exits
    /// or does not answer in time.
    pub fn try_restart(&mut self) -> Result<(), String> {
        self.stop();
        self.launch();
        self.wait_ready(READY_TIMEOUT)
            .map_err(|e| format!("{e}\n{}", self.logs()))
    }

    /// Replaces the config file (e.g. before `reload` or SIGHUP) and
    /// re-reads the control socket path from it.
    ///
    /// # Panics
    ///
    /// If the TOML does not parse or has no `[daemon] control_socket`.
    pub fn write_config(&mut self, config_toml: &str) {
        self.socket = control_socket(config_toml, self.server.dir());
        std::fs::write(&self.config, config_toml)
            .unwrap_or_else(|e| panic!("writing {}: {e}", self.config.display()));
    }

    /// The daemon's private temp dir (removed on drop).
    pub fn config_dir(&self) -> &Path {
        self.server.dir()
    }

    /// The config file the daemon runs with.
    pub fn config_path(&self) -> &Path {
        &self.config
    }

    /// The control socket from the config (relative paths are taken
    /// relative to [`Daemon::config_dir`], the daemon's working directory).
    pub fn socket_path(&self) -> &Path {
        &self.socket
    }

    /// The namespace the daemon runs in.
    pub fn netns(&self) -> &str {
        &self.ns_name
    }

    /// Runs `ratelimit ARGS --socket PATH` (from the test's namespace: the
    /// socket is a filesystem object) and returns its output whatever the
    /// exit status.
    ///
    /// # Panics
    ///
    /// If it cannot be started or runs longer than [`CLI_TIMEOUT`].
    pub fn cli(&self, args: &[&str]) -> Output {
        let mut cmd = Command::new(&self.bin);
        cmd.args(args).arg("--socket").arg(&self.socket);
        run_with_timeout(&mut cmd, CLI_TIMEOUT).unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`Daemon::cli`], panicking with stderr unless it exits 0; returns stdout.
    pub fn cli_ok(&self, args: &[&str]) -> String {
        let out = self.cli(args);
        if !out.status.success() {
            panic!(
                "`ratelimit {}` failed ({}): {}{}",
                args.join(" "),
                out.status,
                String::from_utf8_lossy(&out.stderr),
                String::from_utf8_lossy(&out.stdout)
            );
        }
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Runs `ratelimit ARGS --json --socket PATH` and parses stdout.
    ///
    /// # Panics
    ///
    /// Unless it exits 0 with JSON on stdout.
    pub fn cli_json(&self, args: &[&str]) -> serde_json::Value {
        self.cli_as(args)
    }

    /// Runs `ratelimit ARGS --json --socket PATH` and reads stdout as the control API's
    /// answer type `T` (`report::Stats` for `stats`, `Vec<report::Ban>` for `bans`, ...).
    ///
    /// # Panics
    ///
    /// Unless it exits 0 with an answer of that type on stdout.
    pub fn cli_as<T: serde::de::DeserializeOwned>(&self, args: &[&str]) -> T {
        let mut all = args.to_vec();
        all.push("--json");
        let stdout = self.cli_ok(&all);
        serde_json::from_str(&stdout).unwrap_or_else(|e| {
            panic!(
                "`ratelimit {}` printed no {} ({e}):\n{stdout}",
                all.join(" "),
                std::any::type_name::<T>()
            )
        })
    }

    /// `ratelimit status`, typed.
    pub fn status(&self) -> Status {
        self.cli_as(&["status"])
    }

    /// `ratelimit stats`, typed.
    pub fn stats(&self) -> Stats {
        self.cli_as(&["stats"])
    }

    /// `ratelimit bans`, typed.
    pub fn bans(&self) -> Vec<Ban> {
        self.cli_as(&["bans"])
    }

    /// Runs `ratelimit detach --config FILE` inside the namespace.
    pub fn detach(&self) -> Output {
        let mut cmd = self.command();
        cmd.arg("detach").arg("--config").arg(&self.config);
        run_with_timeout(&mut cmd, CLI_TIMEOUT).unwrap_or_else(|e| panic!("{e}"))
    }

    /// The daemon's stdout then stderr (all runs, for restarts).
    pub fn logs(&self) -> String {
        let read = |name: &str| {
            std::fs::read_to_string(self.server.path(name)).unwrap_or_else(|e| format!("({e})"))
        };
        format!(
            "----- daemon stdout ({}) -----\n{}\n----- daemon stderr -----\n{}\n----- end of daemon log -----",
            self.server.dir().display(),
            read("daemon.stdout"),
            read("daemon.stderr")
        )
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let status = self.stop();
        // Remove the program and pins even if the daemon crashed or ignored
        // SIGTERM; a failure here is reported but must not mask the test's.
        if self.config.exists() && self.bin.exists() {
            let mut cmd = self.command();
            cmd.arg("detach").arg("--config").arg(&self.config);
            match run_with_timeout(&mut cmd, CLI_TIMEOUT) {
                Ok(out) if out.status.success() => {}
                Ok(out) => eprintln!(
                    "warning: `ratelimit detach` after the test failed ({}): {}",
                    out.status,
                    String::from_utf8_lossy(&out.stderr).trim()
                ),
                Err(e) => eprintln!("warning: {e}"),
            }
        }
        if std::thread::panicking() {
            eprintln!("daemon exit status: {status:?}\n{}", self.logs());
        }
        // The server's guard removes the dir.
    }
}

/// `[daemon] control_socket` from a config, relative paths taken from `dir`.
fn control_socket(config_toml: &str, dir: &Path) -> PathBuf {
    let table: toml::Table = toml::from_str(config_toml)
        .unwrap_or_else(|e| panic!("the daemon config is not valid TOML: {e}\n{config_toml}"));
    let path = table
        .get("daemon")
        .and_then(|d| d.get("control_socket"))
        .and_then(toml::Value::as_str)
        .unwrap_or_else(|| {
            panic!(
                "the daemon config must set [daemon] control_socket (the lab reaches the daemon \
                 there; put it in the temp dir with Daemon::start_in):\n{config_toml}"
            )
        });
    dir.join(path)
}

/// A pipe (read end, write end), both close-on-exec (the child gets its end as stdout).
fn pipe() -> (OwnedFd, OwnedFd) {
    use std::os::fd::FromRawFd as _;
    let mut fds = [0; 2];
    // SAFETY: pipe2 writes two new fds into the array, which we then own.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        panic!("pipe2: {}", io::Error::last_os_error());
    }
    // SAFETY: both fds were just created and are owned by nothing else.
    unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) }
}

/// Runs `cmd` to completion with piped output, killing it after `timeout`.
pub fn run_with_timeout(cmd: &mut Command, timeout: Duration) -> Result<Output, String> {
    let what = describe(cmd);
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("starting `{what}`: {e}"))?;
    let drain = |r: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            if let Some(mut r) = r {
                let _ = r.read_to_end(&mut buf);
            }
            buf
        })
    };
    let out_t = drain(
        child
            .stdout
            .take()
            .map(|r| Box::new(r) as Box<dyn Read + Send>),
    );
    let err_t = drain(
        child
            .stderr
            .take()
            .map(|r| Box::new(r) as Box<dyn Read + Send>),
    );
    let give_up = Instant::now() + timeout;
    let status = loop {
        match child.try_wait() {
            Ok(Some(s)) => break s,
            Ok(None) if Instant::now() >= give_up => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("`{what}` did not finish within {timeout:?}"));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(10)),
            Err(e) => return Err(format!("waiting for `{what}`: {e}")),
        }
    };
    Ok(Output {
        status,
        stdout: out_t.join().unwrap_or_default(),
        stderr: err_t.join().unwrap_or_default(),
    })
}

/// The embedded default policy, as `ratelimit check-config --print-default --resolv-conf F`
/// prints it for a host whose resolv.conf is `resolv_conf`.
///
/// # Panics
///
/// If the command fails.
pub fn print_default(resolv_conf: &str) -> String {
    let dir = crate::server::temp_dir();
    std::fs::create_dir_all(&dir).expect("the temp dir");
    let conf = dir.join(format!(
        "resolv-{}-{:?}.conf",
        std::process::id(),
        std::thread::current().id()
    ));
    std::fs::write(&conf, resolv_conf).expect("writing the resolv.conf");
    let out = Command::new(crate::env::ratelimit_bin())
        .args(["check-config", "--print-default", "--resolv-conf"])
        .arg(&conf)
        .output();
    let _ = std::fs::remove_file(&conf);
    let out = out.expect("running ratelimit check-config --print-default");
    assert!(
        out.status.success(),
        "check-config --print-default: {out:?}"
    );
    String::from_utf8(out.stdout).expect("UTF-8")
}
