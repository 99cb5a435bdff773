//! A wall clock set off for one process, with libfaketime (Debian's package `faketime`):
//! `LD_PRELOAD` of its library, and the offset read from a file at every call
//! (`FAKETIME_TIMESTAMP_FILE`, `FAKETIME_NO_CACHE=1`), so a test can move the clock of a
//! running process. Only the wall clock moves (`FAKETIME_DONT_FAKE_MONOTONIC=1`): timers and
//! the kernel's monotonic clock go on as before, as on a host whose wall clock is wrong.
//!
//! (It is the daemon's clock that is set off, not the store's: Debian's `redis-server` links
//! jemalloc, whose start under libfaketime 0.9.10 recurses into `clock_gettime` and hangs,
//! "libfaketime: Unexpected recursive calls to clock_gettime()". The offset measured is the
//! same either way: this host's clock against the store's.)
//!
//! The guard owns a temp dir holding the offset file; it is removed on drop.

use std::path::PathBuf;

/// Where Debian puts libfaketime.
pub const LIBRARY: &str = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1";

/// The library, checked.
///
/// # Panics
///
/// If it is missing, saying how to install it (a test that cannot skew a clock has nothing
/// to test, and must not pass).
pub fn library() -> PathBuf {
    let p = PathBuf::from(LIBRARY);
    assert!(
        p.is_file(),
        "no {LIBRARY}: run `cargo xtask setup`, which installs the Debian package faketime \
         (or `apt-get install faketime`)"
    );
    p
}

/// An offset file for libfaketime, and the environment that makes a process read it.
pub struct FakeClock {
    dir: PathBuf,
}

impl FakeClock {
    /// A clock `offset` off the real one, in libfaketime's syntax: `"-5s"`, `"+0"`.
    pub fn new(offset: &str) -> FakeClock {
        library();
        let c = FakeClock {
            dir: crate::server::temp_dir(),
        };
        c.set(offset);
        c
    }

    fn file(&self) -> PathBuf {
        self.dir.join("faketime.rc")
    }

    /// Move the clock of every process started with [`FakeClock::env`] to `offset` off the
    /// real one (from their next reading of it on). Written whole, then renamed over.
    pub fn set(&self, offset: &str) {
        let tmp = self.dir.join("faketime.rc.tmp");
        std::fs::write(&tmp, format!("{offset}\n")).expect("writing the faketime offset");
        std::fs::rename(&tmp, self.file()).expect("renaming the faketime offset");
    }

    /// The environment of a process whose wall clock follows this file.
    pub fn env(&self) -> Vec<(String, String)> {
        vec![
            ("LD_PRELOAD".into(), library().display().to_string()),
            (
                "FAKETIME_TIMESTAMP_FILE".into(),
                self.file().display().to_string(),
            ),
            ("FAKETIME_NO_CACHE".into(), "1".into()),
            ("FAKETIME_DONT_FAKE_MONOTONIC".into(), "1".into()),
        ]
    }
}

impl Drop for FakeClock {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
