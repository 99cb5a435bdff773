//! The one guard for every process the lab starts and keeps running: the servers (the daemon,
//! `redis-server`, nginx, Prometheus) and the traffic tools (hping3), each in a lab namespace.
//!
//! A [`Server`] owns the child process, a private temp dir (the process's config, data and
//! log) and the address it listens on. [`Server::launch`] spawns the command its module built
//! and waits until the module's probe says it is ready; if the process exits first, or the
//! probe does not answer in time, it panics with the process's log. It can be signalled,
//! frozen (SIGSTOP) and thawed, killed and started again. On drop it stops the process (its
//! [`Spec::stop_signal`], then SIGKILL to it and to its children after
//! [`Spec::stop_timeout`]), reaps it, prints its log if the test is panicking and removes the
//! dir, also when a test panics.
//!
//! A server module only says how to start its server (a [`Spec`] and a command) and how to
//! tell that it is ready (a probe).

use std::ffi::OsStr;
use std::fs::{File, OpenOptions};
use std::io;
use std::net::{SocketAddr, TcpStream};
use std::os::fd::{AsFd as _, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::{Duration, Instant};

use crate::netns::{NetNs, command_in_fd, describe, in_netns};

/// What differs from one kind of server to the next, besides its command and its probe: made
/// with [`Spec::new`] and changed where a server differs from the defaults.
#[derive(Clone, Copy, Debug)]
pub struct Spec {
    /// Its name in messages and in its log's banner ("nginx").
    pub name: &'static str,
    /// Its log: a file in its dir, where its stdout and stderr go ("error.log").
    pub log: &'static str,
    /// How long [`Server::launch`] waits for it to be ready.
    pub ready_timeout: Duration,
    /// How often the probe asks.
    pub poll: Duration,
    /// The signal that stops it (SIGTERM, SIGINT; SIGKILL for a server whose data does not
    /// matter).
    pub stop_signal: i32,
    /// How long a stop waits after that signal before SIGKILL.
    pub stop_timeout: Duration,
    /// Whether the guard prints the log when it is dropped by a panicking test.
    pub log_on_panic: bool,
}

impl Spec {
    /// A server called `name` that logs to `log`: ready within 20 s (asked every 50 ms),
    /// stopped by SIGTERM with 5 s to exit, its log printed when a test fails.
    pub const fn new(name: &'static str, log: &'static str) -> Spec {
        Spec {
            name,
            log,
            ready_timeout: Duration::from_secs(20),
            poll: Duration::from_millis(50),
            stop_signal: libc::SIGTERM,
            stop_timeout: Duration::from_secs(5),
            log_on_panic: true,
        }
    }

    /// Ready within `timeout`, asked every `poll`.
    pub const fn ready_within(self, timeout: Duration, poll: Duration) -> Spec {
        Spec {
            ready_timeout: timeout,
            poll,
            ..self
        }
    }

    /// Stopped by `signal`, with `timeout` to exit before SIGKILL.
    pub const fn stopped_by(self, signal: i32, timeout: Duration) -> Spec {
        Spec {
            stop_signal: signal,
            stop_timeout: timeout,
            ..self
        }
    }

    /// Its log not printed when a test fails (its guard's owner prints what matters).
    pub const fn quiet(self) -> Spec {
        Spec {
            log_on_panic: false,
            ..self
        }
    }
}

/// A process of the lab (see the module's doc). Nothing runs until [`Server::spawn`] or
/// [`Server::launch`].
#[derive(Debug)]
pub struct Server {
    spec: Spec,
    child: Option<Child>,
    dir: PathBuf,
    ns_fd: OwnedFd,
    addr: Option<SocketAddr>,
    /// Stopped with SIGSTOP: continued before any other signal.
    frozen: AtomicBool,
}

impl Server {
    /// The guard of a server of kind `spec` in `ns`, with its fresh temp dir.
    pub fn new(spec: Spec, ns: &NetNs) -> Server {
        Server {
            spec,
            child: None,
            dir: temp_dir(),
            ns_fd: ns.dup_fd(),
            addr: None,
            frozen: AtomicBool::new(false),
        }
    }

    /// [`Server::new`] for a server listening on `addr` (an address of `ns`).
    pub fn listening(spec: Spec, ns: &NetNs, addr: SocketAddr) -> Server {
        let mut server = Server::new(spec, ns);
        server.addr = Some(addr);
        server
    }

    /// Its temp dir (removed on drop).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// A file in its temp dir.
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// The address it listens on.
    ///
    /// # Panics
    ///
    /// If it was made with [`Server::new`], without one.
    pub fn addr(&self) -> SocketAddr {
        self.addr
            .unwrap_or_else(|| panic!("{} listens on no address", self.spec.name))
    }

    /// The port it listens on.
    pub fn port(&self) -> u16 {
        self.addr().port()
    }

    /// Its namespace.
    pub fn ns_fd(&self) -> BorrowedFd<'_> {
        self.ns_fd.as_fd()
    }

    /// A duplicate of its namespace's fd.
    pub fn dup_ns_fd(&self) -> OwnedFd {
        self.ns_fd
            .try_clone()
            .unwrap_or_else(|e| panic!("duplicating the netns fd of {}: {e}", self.spec.name))
    }

    /// `f` run on a thread in its namespace.
    pub fn in_netns<T: Send>(&self, f: impl FnOnce() -> T + Send) -> T {
        in_netns(self.ns_fd(), f)
    }

    /// `program` as a command whose child runs in its namespace, in its dir, with no input,
    /// its output appended to its log.
    pub fn command(&self, program: impl AsRef<OsStr>) -> Command {
        let mut cmd = command_in_fd(self.dup_ns_fd(), program);
        let log = self.log_file();
        cmd.current_dir(&self.dir)
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("dup the log file"))
            .stderr(log);
        cmd
    }

    /// Starts `cmd` (made with [`Server::command`]), without waiting for it.
    ///
    /// # Panics
    ///
    /// If it is running already, or `cmd` cannot be started.
    pub fn spawn(&mut self, mut cmd: Command) {
        assert!(self.child.is_none(), "{} already running", self.spec.name);
        self.child = Some(
            cmd.spawn()
                .unwrap_or_else(|e| panic!("starting `{}`: {e}", describe(&cmd))),
        );
        self.frozen.store(false, Ordering::Relaxed);
    }

    /// Starts `cmd` and waits until `probe` says it is ready ([`Server::wait_ready`] with
    /// [`Spec::ready_timeout`]).
    ///
    /// # Panics
    ///
    /// If it cannot be started, exits, or is not ready in time: the message has its log.
    pub fn launch(&mut self, cmd: Command, probe: impl FnMut(&Server) -> Result<(), String>) {
        self.spawn(cmd);
        if let Err(e) = self.wait_ready(self.spec.ready_timeout, probe) {
            panic!(
                "{} did not become ready: {e}\n{}",
                self.spec.name,
                self.log()
            );
        }
    }

    /// Asks `probe` every [`Spec::poll`] until it answers `Ok`: Err (the reason) if the
    /// process exits first or `timeout` passes.
    pub fn wait_ready(
        &mut self,
        timeout: Duration,
        mut probe: impl FnMut(&Server) -> Result<(), String>,
    ) -> Result<(), String> {
        let give_up = Instant::now() + timeout;
        loop {
            if let Some(status) = self.try_wait() {
                return Err(format!(
                    "{} exited during startup ({status})",
                    self.spec.name
                ));
            }
            match probe(self) {
                Ok(()) => return Ok(()),
                Err(e) if Instant::now() >= give_up => {
                    return Err(format!("not ready after {timeout:?}: {e}"));
                }
                Err(_) => std::thread::sleep(self.spec.poll),
            }
        }
    }

    /// The probe of a TCP server: a connection to its address within a second.
    pub fn connects(&self) -> Result<(), String> {
        let addr = self.addr();
        self.in_netns(move || {
            TcpStream::connect_timeout(&addr, Duration::from_secs(1))
                .map(drop)
                .map_err(|e| format!("no connection to {addr}: {e}"))
        })
    }

    /// Its pid while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// The exit status if it has exited (reaped then); None while it runs, or if it was
    /// reaped already.
    ///
    /// # Panics
    ///
    /// If waiting for it fails.
    pub fn try_wait(&mut self) -> Option<ExitStatus> {
        let child = self.child.as_mut()?;
        match child.try_wait() {
            Ok(Some(s)) => {
                self.child = None;
                Some(s)
            }
            Ok(None) => None,
            Err(e) => panic!("waiting for {}: {e}", self.spec.name),
        }
    }

    /// True while the process is alive.
    pub fn is_running(&mut self) -> bool {
        self.try_wait();
        self.child.is_some()
    }

    /// Waits up to `timeout` for it to exit on its own.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let give_up = Instant::now() + timeout;
        loop {
            if let Some(s) = self.try_wait() {
                return Some(s);
            }
            if Instant::now() >= give_up || self.child.is_none() {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Sends `signal` to it (continued first if frozen, unless the signal freezes it).
    pub fn signal(&self, signal: i32) -> io::Result<()> {
        let pid = self
            .pid()
            .ok_or_else(|| io::Error::other(format!("{} is not running", self.spec.name)))?;
        let pid = libc::pid_t::try_from(pid).map_err(io::Error::other)?;
        let frozen = signal == libc::SIGSTOP;
        if self.frozen.swap(frozen, Ordering::Relaxed) && !frozen && signal != libc::SIGCONT {
            // SAFETY: kill(2) on our own unreaped child's pid, which cannot be reused.
            unsafe { libc::kill(pid, libc::SIGCONT) };
        }
        // SAFETY: as above.
        if unsafe { libc::kill(pid, signal) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// SIGSTOP: it keeps its sockets but answers nothing (until [`Server::thaw`]).
    pub fn freeze(&self) {
        let _ = self.signal(libc::SIGSTOP);
    }

    /// SIGCONT after [`Server::freeze`].
    pub fn thaw(&self) {
        let _ = self.signal(libc::SIGCONT);
    }

    /// SIGKILL, and reap it: its exit status (None if it was not running).
    pub fn kill(&mut self) -> Option<ExitStatus> {
        let _ = self.signal(libc::SIGKILL);
        let mut child = self.child.take()?;
        let _ = child.kill();
        Some(
            child
                .wait()
                .unwrap_or_else(|e| panic!("waiting for the killed {}: {e}", self.spec.name)),
        )
    }

    /// [`Spec::stop_signal`], then SIGKILL to it and its children (an nginx master's
    /// workers, say) after [`Spec::stop_timeout`]: its exit status (None if it was not
    /// running). Never panics: it runs from drop, possibly while unwinding.
    pub fn stop(&mut self) -> Option<ExitStatus> {
        self.try_wait();
        let children = self.children();
        let signal = self.spec.stop_signal;
        if self.signal(signal).is_ok()
            && let Some(s) = self.wait_exit(self.spec.stop_timeout)
        {
            return Some(s);
        }
        if self.child.is_some() && signal != libc::SIGKILL {
            eprintln!(
                "{} ignored {} for {:?}: SIGKILL",
                self.spec.name,
                signal_name(signal),
                self.spec.stop_timeout
            );
            for pid in children {
                // SAFETY: kill(2); they are children of our unreaped child, so their pids
                // cannot have been reused while it lives.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
        }
        let mut child = self.child.take()?;
        let _ = child.kill();
        child.wait().ok()
    }

    /// Pids of its children, from `/proc`.
    fn children(&self) -> Vec<libc::pid_t> {
        let Some(pid) = self.pid() else {
            return Vec::new();
        };
        std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
            .unwrap_or_default()
            .split_whitespace()
            .filter_map(|p| p.parse().ok())
            .collect()
    }

    /// Its log file, opened to append (created if absent).
    pub fn log_file(&self) -> File {
        let path = self.path(self.spec.log);
        OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .unwrap_or_else(|e| panic!("opening {}: {e}", path.display()))
    }

    /// Its log so far, between banners.
    pub fn log(&self) -> String {
        let path = self.path(self.spec.log);
        let name = self.spec.name;
        format!(
            "----- {name} log ({}) -----\n{}\n----- end of {name} log -----",
            path.display(),
            std::fs::read_to_string(&path).unwrap_or_else(|e| format!("({e})"))
        )
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop();
        if self.spec.log_on_panic && std::thread::panicking() {
            eprintln!("{}", self.log());
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn signal_name(signal: i32) -> String {
    match signal {
        libc::SIGTERM => "SIGTERM".into(),
        libc::SIGINT => "SIGINT".into(),
        s => format!("signal {s}"),
    }
}

/// A fresh, private `/tmp/ratelimit-lab-PID-N` (mode 0700), for the caller to remove.
pub fn temp_dir() -> PathBuf {
    use std::os::unix::fs::DirBuilderExt;
    static DIRS: AtomicU32 = AtomicU32::new(0);
    let pid = std::process::id();
    loop {
        let n = DIRS.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("ratelimit-lab-{pid}-{n}"));
        match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
            Ok(()) => return dir,
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => panic!("creating {}: {e}", dir.display()),
        }
    }
}
