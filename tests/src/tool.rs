//! The external programs the lab runs (servers and traffic tools from Debian's packages):
//! finding their binaries. [`crate::server`] runs and stops them.

use std::path::PathBuf;

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
