//! The external programs the lab runs (servers and traffic tools from Debian's packages):
//! finding their binaries, and stopping them.

use std::path::PathBuf;
use std::process::Child;
use std::time::{Duration, Instant};

/// `name` on `PATH`, or in `/usr/sbin` and `/sbin` (not on every root PATH).
///
/// # Panics
///
/// If there is none, saying how to install it: under `cargo xtask test` a test that cannot
/// run its tool has nothing to test, and must not pass.
pub fn find_binary(name: &str, package: &str) -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/sbin"), PathBuf::from("/sbin")])
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
        .unwrap_or_else(|| {
            panic!(
                "no `{name}` binary on PATH or in /usr/sbin: run `cargo xtask setup`, which \
                 installs the Debian package {package} (or `apt-get install {package}`)"
            )
        })
}

/// SIGTERM to `child`, then up to `timeout` for it to exit: whether it did (reaped). If not,
/// it is still running, for the caller to SIGKILL (with whatever else it must kill).
pub fn terminate(child: &mut Child, timeout: Duration) -> bool {
    if let Ok(pid) = libc::pid_t::try_from(child.id()) {
        // SAFETY: kill(2) on our own unreaped child's pid, which cannot be reused.
        unsafe { libc::kill(pid, libc::SIGTERM) };
    }
    let give_up = Instant::now() + timeout;
    while Instant::now() < give_up {
        if let Ok(Some(_)) = child.try_wait() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    false
}
