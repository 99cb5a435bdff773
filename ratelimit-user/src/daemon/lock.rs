//! One daemon per state: `ratelimit run` locks its state directory and its bpffs directory
//! before it touches anything, and holds both locks until it exits.
//!
//! Without them a second daemon given the same directories (the same config started twice,
//! or two configs sharing a directory) adopted the first's pinned maps, applied its own
//! policy to them, restored bans over the first's and swapped its program into the pinned
//! links, and only then found the control socket taken. Now it stops at the start, names the
//! daemon holding the directory, and has changed nothing.
//!
//! Both are flock(2) locks on the directories themselves, on descriptors kept open for the
//! daemon's life (close-on-exec, so no child inherits them). No lock file: nothing to create
//! in the bpffs directory, where only pins belong, and nothing to go stale. The kernel drops a
//! flock lock with the last descriptor of its open file, so a daemon that dies any way at all,
//! SIGKILL included, never blocks the next start. Both directories are locked because each
//! alone is shared state: the pinned maps and links in the one, the saved bans and the rules'
//! record in the other. The daemon holding a lock is named from /proc/locks.

use std::{
    fs::File,
    os::{fd::AsRawFd as _, unix::fs::MetadataExt as _},
    path::Path,
};

use anyhow::{Context as _, bail};

/// The daemon's locks on its directories, released when dropped (or when the process ends).
#[derive(Debug)]
pub struct DirLocks {
    _held: Vec<File>,
}

/// Lock `state_dir` and `bpffs_dir` (created if missing; bpffs mounted on /sys/fs/bpf if it
/// is not; a `state_dir` another user can write is refused), or fail without having changed anything in them if another process holds either.
pub fn lock_dirs(state_dir: &Path, bpffs_dir: &Path) -> anyhow::Result<DirLocks> {
    crate::durable::check_private_dir(state_dir, "daemon.state_dir")?;
    // Mounted first: a directory locked before bpffs were mounted over its parent would be one
    // the daemon then never sees.
    crate::kernel::datapath::ensure_bpffs(bpffs_dir)?;
    let mut held: Vec<File> = Vec::with_capacity(2);
    let mut locked = Vec::with_capacity(2);
    for (dir, what) in [(state_dir, "state"), (bpffs_dir, "bpffs")] {
        let file = File::open(dir).with_context(|| format!("opening {}", dir.display()))?;
        let meta = file
            .metadata()
            .with_context(|| format!("reading {}", dir.display()))?;
        // The same directory for both (an odd config, but valid): a second flock on another
        // descriptor of it would conflict with our own first.
        let id = (meta.dev(), meta.ino());
        if locked.contains(&id) {
            continue;
        }
        // SAFETY: flock(2) on a descriptor we own, open for the call.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            let err = std::io::Error::last_os_error();
            if err.raw_os_error() != Some(libc::EWOULDBLOCK) {
                return Err(err).with_context(|| format!("locking {}", dir.display()));
            }
            let holder = match holder_pid(meta.dev(), meta.ino()) {
                Some(pid) => format!("another ratelimit daemon (pid {pid})"),
                None => "another process".to_string(),
            };
            bail!(
                "{holder} is running with the {what} directory {}: stop it first, or give this \
                 daemon directories of its own (daemon.state_dir, daemon.bpffs_dir); nothing was \
                 changed",
                dir.display()
            );
        }
        locked.push(id);
        held.push(file);
    }
    Ok(DirLocks { _held: held })
}

/// The pid holding a flock lock on the inode `ino` of device `dev`, from /proc/locks, whose
/// lines read `1: FLOCK  ADVISORY  WRITE 1234 00:2a:5678 0 EOF` (major and minor in hex).
fn holder_pid(dev: u64, ino: u64) -> Option<u32> {
    let want = format!("{:02x}:{:02x}:{ino}", libc::major(dev), libc::minor(dev));
    std::fs::read_to_string("/proc/locks")
        .ok()?
        .lines()
        .find_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            (f.get(1) == Some(&"FLOCK") && f.get(5) == Some(&want.as_str()))
                .then(|| f.get(4)?.parse().ok())
                .flatten()
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two daemons are two processes, but flock locks of two open files conflict within one
    /// process too, which is what lets this test take the place of the second daemon.
    #[test]
    fn a_second_lock_on_either_directory_is_refused_naming_the_holder() {
        let base = std::env::temp_dir().join(format!("ratelimit-lock-{}", std::process::id()));
        let (state, pins, other) = (base.join("state"), base.join("pins"), base.join("other"));
        let first = lock_dirs(&state, &pins).unwrap();
        for (s, p) in [(&state, &other), (&other, &pins)] {
            let e = lock_dirs(s, p).unwrap_err().to_string();
            assert!(
                e.contains(&format!("(pid {})", std::process::id()))
                    && e.contains("nothing was changed"),
                "{e}"
            );
        }
        drop(first);
        let again = lock_dirs(&state, &pins).expect("released on drop");
        drop(again);
        // One directory for both is locked once, not refused by its own first lock.
        drop(lock_dirs(&state, &state).unwrap());
        std::fs::remove_dir_all(&base).unwrap();
    }
}
