//! A bpffs directory for one loaded program's pinned maps, named uniquely per process and
//! guard, and removed (program detached, pins unlinked) on drop, also when a test panics.

use std::{
    path::PathBuf,
    sync::atomic::{AtomicU32, Ordering},
};

use ratelimit_user::kernel::datapath;

/// `/sys/fs/bpf/rl-<what>-<pid>-<n>`, removed on drop.
pub struct Pins(pub PathBuf);

impl Pins {
    /// A fresh directory name for a program loaded by `what` (e.g. "fixtures", "fuzz").
    pub fn new(what: &str) -> Self {
        static N: AtomicU32 = AtomicU32::new(0);
        Self(PathBuf::from(format!(
            "/sys/fs/bpf/rl-{what}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        )))
    }
}

impl Drop for Pins {
    fn drop(&mut self) {
        let _ = datapath::detach(&self.0, &[]);
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
