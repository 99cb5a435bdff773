//! The gate every kernel test passes first, and where the daemon binary is.
//!
//! Kernel tests need root, namespaces and a built daemon, so a plain
//! `cargo test` on a developer laptop must not fail because of them: without
//! `RATELIMIT_KERNEL_TESTS=1` they print a line and pass. `cargo xtask test`
//! sets the variable; once it is set, a missing precondition is a *failure*,
//! not a skip, so CI can never go green by silently testing nothing.

use std::path::PathBuf;
use std::process::{Command, Stdio};

/// Environment variable that turns kernel tests on (set by `cargo xtask test`).
pub const KERNEL_TESTS_ENV: &str = "RATELIMIT_KERNEL_TESTS";

/// Environment variable naming the daemon binary (set by `cargo xtask test`).
pub const BIN_ENV: &str = "RATELIMIT_BIN";

/// What a gated test prints when it does not run.
pub const SKIP_MESSAGE: &str =
    "skipped: kernel tests run under `cargo xtask test` (RATELIMIT_KERNEL_TESTS=1)";

/// True when `RATELIMIT_KERNEL_TESTS=1`.
pub fn kernel_tests_enabled() -> bool {
    std::env::var(KERNEL_TESTS_ENV).is_ok_and(|v| v.trim() == "1")
}

/// Checks what every kernel test needs (root, a working `ip`), returning the
/// first thing missing. Independent of the environment variable.
pub fn check_preconditions() -> Result<(), String> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    let euid = unsafe { libc::geteuid() };
    if euid != 0 {
        return Err(format!(
            "kernel tests need root (euid is {euid}): namespaces, veth and XDP require CAP_NET_ADMIN and CAP_SYS_ADMIN"
        ));
    }
    match Command::new("ip")
        .arg("-V")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
    {
        Ok(s) if s.success() => {}
        Ok(s) => return Err(format!("`ip -V` failed ({s}): iproute2 is broken")),
        Err(e) => return Err(format!("cannot run `ip` ({e}): install iproute2")),
    }
    Ok(())
}

/// The gate: `Ok(())` means run the test; `Err(SKIP_MESSAGE)` means the
/// kernel tests are not enabled.
///
/// # Panics
///
/// If kernel tests are enabled but a precondition fails, because under
/// `cargo xtask test` that is a broken environment, not a reason to skip.
pub fn require_kernel_tests() -> Result<(), String> {
    if !kernel_tests_enabled() {
        return Err(SKIP_MESSAGE.to_string());
    }
    if let Err(reason) = check_preconditions() {
        panic!("{KERNEL_TESTS_ENV}=1 but a kernel test precondition failed: {reason}");
    }
    Ok(())
}

/// Returns `true` (after printing the skip message) when the calling test
/// should return early; see [`require_kernel_tests`] for when it panics.
/// Prefer the [`kernel_test!`](crate::kernel_test) macro, which also returns.
pub fn skip_unless_kernel() -> bool {
    match require_kernel_tests() {
        Ok(()) => false,
        Err(msg) => {
            println!("{msg}");
            true
        }
    }
}

/// First line of every kernel test: returns early (test passes, prints
/// [`SKIP_MESSAGE`]) unless kernel tests are enabled, and panics if they are
/// enabled but the machine cannot run them. In a test returning a value,
/// pass what to return: `kernel_test!(Ok(()))`.
#[macro_export]
macro_rules! kernel_test {
    () => {
        if $crate::env::skip_unless_kernel() {
            return;
        }
    };
    ($ret:expr) => {
        if $crate::env::skip_unless_kernel() {
            return $ret;
        }
    };
}

/// The daemon binary: `$RATELIMIT_BIN`, else `<workspace>/target/debug/ratelimit`.
///
/// # Panics
///
/// If the file does not exist, saying how to build it, because a test that
/// cannot start the daemon has nothing to test.
pub fn ratelimit_bin() -> PathBuf {
    let (bin, source) = match std::env::var_os(BIN_ENV) {
        Some(p) if !p.is_empty() => (PathBuf::from(p), format!("${BIN_ENV}")),
        _ => (
            workspace_root()
                .join("target")
                .join("debug")
                .join("ratelimit"),
            "the default location".to_string(),
        ),
    };
    assert!(
        bin.is_file(),
        "daemon binary {} ({source}) does not exist: build it with `cargo build -p ratelimit-user` \
         or run the kernel tests with `cargo xtask test`",
        bin.display()
    );
    bin
}

/// The workspace root (the parent of this crate's directory).
pub fn workspace_root() -> PathBuf {
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    manifest
        .parent()
        .map_or_else(|| manifest.clone(), |p| p.to_path_buf())
}

/// Raise this process's soft limit of open files to at least `need` (a test that holds
/// a thousand sockets), up to the hard limit.
///
/// # Panics
///
/// If the hard limit is lower than `need`, or the limit cannot be set.
pub fn raise_own_nofile(need: u64) {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: valid out-pointer.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) }, 0);
    assert!(
        lim.rlim_max >= need,
        "this test needs {need} file descriptors; the hard limit is {}",
        lim.rlim_max
    );
    lim.rlim_cur = lim.rlim_cur.max(need);
    // SAFETY: valid in-pointer.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) }, 0);
}
