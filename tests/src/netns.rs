//! Network namespaces that clean up after themselves.
//!
//! Every lab test owns its namespaces, so its traffic can never leave the
//! machine and two tests never see each other's links. The guard deletes the
//! namespace on drop, including while unwinding from a failed assertion, so
//! a failing test does not leave the next run a machine full of stale state.
//!
//! Code runs "inside" a namespace in three ways, each for a reason:
//! - [`NetNs::exec`] runs `ip netns exec NAME ...`, convenient for one-off
//!   tools (`ip`, `ethtool`), and it remounts `/sys` so sysfs shows the
//!   namespace's devices;
//! - [`NetNs::enter`] runs a closure on a thread that has `setns()`-ed into
//!   the namespace: sockets it creates belong to the namespace for their
//!   whole life, whichever thread later uses them;
//! - [`NetNs::command_in`] starts a child process that `setns()`-es before
//!   `exec`, changing only the network namespace. The daemon is started this
//!   way because `ip netns exec` also remounts `/sys`, which would hide
//!   `/sys/fs/bpf` and the daemon's pins.

use std::ffi::OsStr;
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicU32, Ordering};

static COUNTER: AtomicU32 = AtomicU32::new(0);

/// A named network namespace (`/run/netns/NAME`), deleted on drop.
#[derive(Debug)]
pub struct NetNs {
    name: String,
    file: Option<File>,
}

impl NetNs {
    /// Creates `PREFIX-PID-N` (unique per process and call), with `lo` up.
    ///
    /// # Panics
    ///
    /// If the namespace cannot be created or opened.
    pub fn new(prefix: &str) -> NetNs {
        let pid = std::process::id();
        let name = loop {
            let n = COUNTER.fetch_add(1, Ordering::Relaxed);
            let name = format!("{prefix}-{pid}-{n}");
            // A namespace left by an earlier process with the same pid is
            // not ours to delete: skip its name.
            if !netns_path(&name).exists() {
                break name;
            }
        };
        run_checked(Command::new("ip").args(["netns", "add", &name]));
        // Build the guard before anything else can fail, so it is cleaned up.
        let mut ns = NetNs { name, file: None };
        let path = netns_path(&ns.name);
        ns.file =
            Some(File::open(&path).unwrap_or_else(|e| panic!("opening {}: {e}", path.display())));
        ns.exec(&["ip", "link", "set", "lo", "up"]);
        ns
    }

    /// The namespace name, as `ip netns` and `ip -n` use it.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The bind mount that names the namespace, `/run/netns/NAME`.
    pub fn path(&self) -> PathBuf {
        netns_path(&self.name)
    }

    /// The namespace file, for `setns(fd, CLONE_NEWNET)`.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.file().as_fd()
    }

    /// An owned duplicate of the namespace file, for holders (such as a
    /// daemon guard) that must be able to enter it later on their own.
    pub fn dup_fd(&self) -> OwnedFd {
        self.fd()
            .try_clone_to_owned()
            .unwrap_or_else(|e| panic!("duplicating the fd of netns {}: {e}", self.name))
    }

    fn file(&self) -> &File {
        self.file
            .as_ref()
            .expect("namespace file is open until drop")
    }

    /// Runs `ip netns exec NAME args...` and returns its output whatever the
    /// exit status.
    ///
    /// # Panics
    ///
    /// Only if the process cannot be started.
    pub fn try_exec(&self, args: &[&str]) -> Output {
        assert!(!args.is_empty(), "NetNs::exec needs a program");
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.name]).args(args);
        cmd.output()
            .unwrap_or_else(|e| panic!("starting `{}`: {e}", describe(&cmd)))
    }

    /// Like [`NetNs::try_exec`], but panics with stderr unless it succeeds.
    pub fn exec(&self, args: &[&str]) -> Output {
        let out = self.try_exec(args);
        if !out.status.success() {
            panic!(
                "`ip netns exec {} {}` failed ({}): {}{}",
                self.name,
                args.join(" "),
                out.status,
                String::from_utf8_lossy(&out.stderr),
                String::from_utf8_lossy(&out.stdout)
            );
        }
        out
    }

    /// Runs `ip -n NAME args...` (no remount, cheaper than `exec`), panicking
    /// with stderr on failure.
    pub fn ip(&self, args: &[&str]) -> Output {
        run_checked(Command::new("ip").args(["-n", &self.name]).args(args))
    }

    /// Sets a sysctl inside the namespace (`net.ipv4.conf.all.rp_filter`,
    /// value `0`) by writing `/proc/sys/...` from a thread that entered the
    /// namespace: `/proc/sys/net` resolves against the writer's namespace.
    ///
    /// # Panics
    ///
    /// If the write fails or does not read back as `value`.
    pub fn sysctl(&self, key: &str, value: &str) {
        let path = PathBuf::from("/proc/sys").join(key.replace('.', "/"));
        let got = self.enter(|| {
            std::fs::write(&path, value)?;
            std::fs::read_to_string(&path)
        });
        match got {
            Ok(v) if v.trim() == value.trim() => {}
            Ok(v) => panic!(
                "sysctl {key} in {}: wrote {value:?}, read back {:?}",
                self.name,
                v.trim()
            ),
            Err(e) => panic!("sysctl {key}={value} in {}: {e}", self.name),
        }
    }

    /// Runs `f` on a new thread that has joined this namespace and returns
    /// its result. Sockets created in `f` stay in the namespace when moved
    /// to other threads. A panic in `f` is re-raised here.
    ///
    /// # Panics
    ///
    /// If `setns` fails (before `f` runs), or if `f` panics.
    pub fn enter<T: Send>(&self, f: impl FnOnce() -> T + Send) -> T {
        in_netns(self.fd(), f)
    }

    /// A [`Command`] whose child joins this namespace (network only: mounts,
    /// including `/sys/fs/bpf`, stay those of the caller) before `exec`.
    pub fn command_in(&self, program: impl AsRef<OsStr>) -> Command {
        command_in_fd(self.dup_fd(), program)
    }
}

/// [`NetNs::enter`] for a holder of the namespace's file alone: runs `f` on a new thread that
/// has joined the namespace `fd`, and returns its result.
///
/// # Panics
///
/// If `setns` fails (before `f` runs), or if `f` panics.
pub fn in_netns<T: Send>(fd: BorrowedFd<'_>, f: impl FnOnce() -> T + Send) -> T {
    std::thread::scope(|s| {
        let handle = s.spawn(move || {
            setns_net(fd.as_raw_fd()).unwrap_or_else(|e| panic!("setns into a netns: {e}"));
            f()
        });
        match handle.join() {
            Ok(v) => v,
            Err(payload) => std::panic::resume_unwind(payload),
        }
    })
}

/// A [`Command`] whose child `setns()`-es into the network namespace `ns_fd`
/// before `exec`. The fd is owned by the command, so the caller may drop its
/// own handle on the namespace before spawning.
pub fn command_in_fd(ns_fd: OwnedFd, program: impl AsRef<OsStr>) -> Command {
    let mut cmd = Command::new(program);
    // SAFETY: the hook only calls setns(2), which is async-signal-safe, and
    // builds an io::Error from errno without allocating on success.
    unsafe {
        cmd.pre_exec(move || setns_net(ns_fd.as_raw_fd()));
    }
    cmd
}

impl Drop for NetNs {
    fn drop(&mut self) {
        // Close our handle first: an open namespace file keeps the namespace
        // (and any veth in it) alive after `ip netns del`.
        self.file = None;
        match Command::new("ip")
            .args(["netns", "del", &self.name])
            .output()
        {
            Ok(out) if out.status.success() => {}
            Ok(out) => eprintln!(
                "warning: `ip netns del {}` failed: {}",
                self.name,
                String::from_utf8_lossy(&out.stderr).trim()
            ),
            Err(e) => eprintln!("warning: `ip netns del {}`: {e}", self.name),
        }
    }
}

/// `/run/netns/NAME`.
pub fn netns_path(name: &str) -> PathBuf {
    Path::new("/run/netns").join(name)
}

/// Names listed by `ip netns list`, for tests that check cleanup.
pub fn list_netns() -> Vec<String> {
    let out = run_checked(Command::new("ip").args(["netns", "list"]));
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next().map(str::to_string))
        .collect()
}

fn setns_net(fd: i32) -> io::Result<()> {
    // SAFETY: setns only reads the fd; an invalid fd makes it fail with EBADF.
    if unsafe { libc::setns(fd, libc::CLONE_NEWNET) } == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Runs a command, panicking with its stderr unless it succeeds.
pub(crate) fn run_checked(cmd: &mut Command) -> Output {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("starting `{}`: {e}", describe(cmd)));
    if !out.status.success() {
        panic!(
            "`{}` failed ({}): {}{}",
            describe(cmd),
            out.status,
            String::from_utf8_lossy(&out.stderr),
            String::from_utf8_lossy(&out.stdout)
        );
    }
    out
}

/// `program arg arg...` for error messages.
pub(crate) fn describe(cmd: &Command) -> String {
    std::iter::once(cmd.get_program())
        .chain(cmd.get_args())
        .map(|s| s.to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join(" ")
}
