//! What a [`Scenario`](crate::Scenario) leaves behind when its process dies without unwinding
//! (SIGKILL, an abort): its two namespaces (and the veth pair in them), its bpffs directory
//! with the program's pins and links, the daemon's temp dir, and the daemon itself, which a
//! killed parent does not take with it.
//!
//! Every one of them is named after the scenario's tag and the pid of the process that made
//! it (`TAG-c-PID-N` and `TAG-s-PID-N` in `/run/netns`, `/sys/fs/bpf/rl-TAG-PID-N`, a temp
//! dir `ratelimit-lab-PID-N` whose config names that bpffs directory), so a later run finds
//! the leftovers of its own kind whose maker is gone ([`Leftovers::of_dead_runs`]) and removes
//! them ([`Leftovers::remove`]) without touching what a live run or anyone else made.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

/// Namespaces, bpffs directories and daemon temp dirs of lab runs.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Leftovers {
    pub netns: Vec<String>,
    pub bpffs: Vec<PathBuf>,
    pub dirs: Vec<PathBuf>,
}

impl Leftovers {
    /// What runs of scenarios tagged `tag` left behind whose process no longer exists.
    pub fn of_dead_runs(tag: &str) -> Leftovers {
        let mut found = Leftovers::default();
        for name in entries(Path::new("/run/netns")) {
            let dead = [format!("{tag}-c-"), format!("{tag}-s-")]
                .iter()
                .any(|p| name.strip_prefix(p.as_str()).is_some_and(made_by_dead_pid));
            if dead {
                found.netns.push(name);
            }
        }
        for name in entries(Path::new("/sys/fs/bpf")) {
            if name
                .strip_prefix(&format!("rl-{tag}-"))
                .is_some_and(made_by_dead_pid)
            {
                found.bpffs.push(Path::new("/sys/fs/bpf").join(name));
            }
        }
        let tmp = std::env::temp_dir();
        for name in entries(&tmp) {
            let Some(rest) = name.strip_prefix("ratelimit-lab-") else {
                continue;
            };
            if !made_by_dead_pid(rest) {
                continue;
            }
            // Tests make these dirs too: only the one whose daemon used this tag's bpffs dir.
            let pid = rest.split('-').next().unwrap_or_default();
            let dir = tmp.join(&name);
            let config = std::fs::read_to_string(dir.join("ratelimit.toml")).unwrap_or_default();
            if config.contains(&format!("/sys/fs/bpf/rl-{tag}-{pid}-")) {
                found.dirs.push(dir);
            }
        }
        found
    }

    pub fn is_empty(&self) -> bool {
        self.netns.is_empty() && self.bpffs.is_empty() && self.dirs.is_empty()
    }

    /// The part of these that still exists.
    pub fn present(&self) -> Leftovers {
        let names = crate::netns::list_netns();
        Leftovers {
            netns: self
                .netns
                .iter()
                .filter(|n| names.contains(n))
                .cloned()
                .collect(),
            bpffs: self.bpffs.iter().filter(|p| p.exists()).cloned().collect(),
            dirs: self.dirs.iter().filter(|p| p.exists()).cloned().collect(),
        }
    }

    /// Processes working in one of the temp dirs (a daemon that outlived its run), as pids.
    pub fn processes(&self) -> Vec<i32> {
        entries(Path::new("/proc"))
            .iter()
            .filter_map(|p| p.parse::<i32>().ok())
            .filter(|pid| {
                std::fs::read_link(format!("/proc/{pid}/cwd")).is_ok_and(|cwd| {
                    // A dir removed under a process reads "DIR (deleted)".
                    let cwd = cwd.to_string_lossy();
                    self.dirs.iter().any(|d| {
                        let d = d.to_string_lossy();
                        cwd == d || cwd == format!("{d} (deleted)")
                    })
                })
            })
            .collect()
    }

    /// Removes them, in the order that lets each step succeed: the processes working in the
    /// temp dirs are killed, the bpffs directories detached (program off its interfaces, pins
    /// unlinked), the temp dirs and the namespaces deleted. Returns what failed; the rest is
    /// removed either way.
    pub fn remove(&self) -> Vec<String> {
        let mut failed = Vec::new();
        for pid in self.processes() {
            // SAFETY: kill(2) has no memory effects; the pid works in a dir of a dead run.
            if unsafe { libc::kill(pid, libc::SIGKILL) } != 0 {
                failed.push(format!(
                    "killing pid {pid}: {}",
                    std::io::Error::last_os_error()
                ));
            }
        }
        for dir in &self.bpffs {
            if let Err(e) = ratelimit_user::kernel::datapath::detach(dir, &[]) {
                failed.push(format!("detaching {}: {e:#}", dir.display()));
            }
            match std::fs::remove_dir(dir) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    failed.push(format!("removing {}: {e}", dir.display()));
                }
                _ => {}
            }
        }
        for dir in &self.dirs {
            match std::fs::remove_dir_all(dir) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    failed.push(format!("removing {}: {e}", dir.display()));
                }
                _ => {}
            }
        }
        let names = crate::netns::list_netns();
        for ns in self.netns.iter().filter(|n| names.contains(n)) {
            match Command::new("ip").args(["netns", "del", ns]).output() {
                Ok(out) if out.status.success() => {}
                Ok(out) => failed.push(format!(
                    "`ip netns del {ns}`: {}",
                    String::from_utf8_lossy(&out.stderr).trim()
                )),
                Err(e) => failed.push(format!("`ip netns del {ns}`: {e}")),
            }
        }
        failed
    }
}

/// File names in `dir` (none if it cannot be read).
fn entries(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .collect()
}

/// `PID-N` of a name whose process `PID` no longer exists.
fn made_by_dead_pid(rest: &str) -> bool {
    let Some((pid, n)) = rest.split_once('-') else {
        return false;
    };
    let (Ok(pid), Ok(_)) = (pid.parse::<i32>(), n.parse::<u32>()) else {
        return false;
    };
    // SAFETY: kill(2) with signal 0 only checks that the process exists.
    pid > 0
        && unsafe { libc::kill(pid, 0) } != 0
        && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH)
}
