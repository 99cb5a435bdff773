//! `cargo xtask setup`: installs what the build and the tests need, skipping what is present.
//!
//! See /work/shared/TOOLCHAIN.md: Debian packages (LLVM 22 for bpf-linker, the network tools
//! the kernel tests use), rust-src for the nightly that builds the XDP program, and bpf-linker
//! built against LLVM 22.

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context as _, Result, bail};

use crate::util;

/// Debian packages: LLVM 22 and what bpf-linker links, then the tools of the kernel tests.
const DEBIAN_PACKAGES: &[&str] = &[
    "llvm-22-dev",
    "libpolly-22-dev",
    "libzstd-dev",
    "zlib1g-dev",
    "iproute2",
    "iputils-ping",
    "ethtool",
    "bpftool",
    "nftables",
    "iptables",
    // The fleet test's store (its own server, started by the test; the package's service is
    // disabled, see `PACKAGE_SERVICES`).
    "redis-server",
    // The fleet TLS test makes its throwaway CA and certificates with openssl.
    "openssl",
    // The fleet clock test runs a daemon whose wall clock libfaketime sets off (the package
    // `faketime` brings libfaketime).
    "faketime",
    // The metrics test has a real Prometheus scrape the daemon (its own server, started by
    // the test; the package's service is disabled, see `PACKAGE_SERVICES`).
    "prometheus",
    "tcpdump",
    // The real-tools test: a real web server under a real SYN flood tool (the nginx package's
    // service is disabled, see `PACKAGE_SERVICES`; the test runs nginx with its own config).
    "nginx-light",
    "hping3",
    // The reflection test: real reflectors (dnsmasq, the binary alone: no service, no config;
    // the test runs it with its own command line).
    "dnsmasq-base",
    // The live matching test floods pings (`ping -f`).
    "iputils-ping",
    // The durability test traces the daemon's fsyncs and renames.
    "strace",
    // The benchmark's plots draw their text with this font.
    "fonts-dejavu-core",
    // `cargo xtask vm`: other kernels booted under qemu's software emulation, a static busybox
    // as the initramfs's init, `cpio` to pack it, `depmod` (kmod) for the kernels' modules, and
    // `xz` to take the uncompressed kernel out of its bzImage.
    "qemu-system-x86",
    "busybox-static",
    "cpio",
    "kmod",
    "xz-utils",
];

/// Packages whose installation starts a system service the tests must not meet (the
/// Prometheus server on port 9090 scraping nothing of ours, nginx on port 80, a Redis server
/// on 6379): after setup installs one, the service is stopped and disabled. The tests start
/// servers of their own.
const PACKAGE_SERVICES: &[(&str, &str)] = &[
    ("prometheus", "prometheus"),
    ("nginx-light", "nginx"),
    ("redis-server", "redis-server"),
];

const LLVM_PREFIX: &str = "/usr/lib/llvm-22";

/// Makes sure everything is installed; prints one line per thing it installs and a summary.
pub fn ensure() -> Result<()> {
    cargo_bin_on_path()?;
    let mut installed = Vec::new();
    debian_packages(&mut installed)?;
    nightly_rust_src(&mut installed)?;
    bpf_linker(&mut installed)?;
    if installed.is_empty() {
        println!("setup: everything present, nothing installed");
    } else {
        println!(
            "setup: installed {}: {}",
            installed.len(),
            installed.join(", ")
        );
    }
    Ok(())
}

fn announce(what: &str) {
    println!("setup: installing {what} ...");
}

/// `$CARGO_HOME/bin`, by default `~/.cargo/bin`.
fn cargo_bin_dir() -> Option<PathBuf> {
    let home = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".cargo")))?;
    Some(home.join("bin"))
}

/// Prepends `~/.cargo/bin` to this process's PATH when it is missing, so that every child
/// (rustup, cargo, the bpf-linker wrapper) finds what `cargo install` put there.
fn cargo_bin_on_path() -> Result<()> {
    let Some(bin) = cargo_bin_dir() else {
        return Ok(());
    };
    let path = std::env::var_os("PATH").unwrap_or_default();
    if std::env::split_paths(&path).any(|dir| dir == bin) {
        return Ok(());
    }
    let new_path = std::env::join_paths(std::iter::once(bin).chain(std::env::split_paths(&path)))
        .context("building PATH with ~/.cargo/bin")?;
    // SAFETY: called from the main thread before xtask starts any other thread; nothing reads
    // the environment concurrently.
    unsafe { std::env::set_var("PATH", new_path) };
    Ok(())
}

fn dpkg_installed(package: &str) -> Result<bool> {
    let out = util::probe(Command::new("dpkg-query").args(["-W", "-f=${Status}", package]))
        .context("dpkg-query not found: setup supports Debian and its derivatives only")?;
    // An unknown package makes dpkg-query exit 1: that simply means "not installed".
    Ok(String::from_utf8_lossy(&out.stdout).contains("install ok installed"))
}

fn debian_packages(installed: &mut Vec<String>) -> Result<()> {
    let mut missing = Vec::new();
    for package in DEBIAN_PACKAGES {
        if !dpkg_installed(package)? {
            missing.push(*package);
        }
    }
    if missing.is_empty() {
        return Ok(());
    }
    for package in &missing {
        announce(&format!("Debian package {package}"));
    }
    util::run(Command::new("apt-get").arg("update")).context("apt-get update")?;
    util::run(
        Command::new("apt-get")
            .env("DEBIAN_FRONTEND", "noninteractive")
            .args(["install", "-y", "--no-install-recommends"])
            .args(&missing),
    )
    .with_context(|| format!("installing Debian packages {}", missing.join(" ")))?;
    for package in &missing {
        if !dpkg_installed(package)? {
            bail!("apt-get succeeded but Debian package {package} is still not installed");
        }
    }
    for (package, service) in PACKAGE_SERVICES {
        if missing.contains(package) {
            disable_service(service)?;
        }
    }
    installed.extend(
        missing
            .iter()
            .map(|package| format!("Debian package {package}")),
    );
    Ok(())
}

/// Stops `service` and keeps it from starting at boot. Without systemd running (a container)
/// there is nothing to stop: only the boot links are removed.
fn disable_service(service: &str) -> Result<()> {
    println!(
        "setup: disabling the {service} service the package installed (the tests run their own)"
    );
    let mut cmd = Command::new("systemctl");
    if std::path::Path::new("/run/systemd/system").is_dir() {
        cmd.args(["disable", "--now", service]);
    } else {
        cmd.args(["disable", service]);
    }
    util::run(&mut cmd).with_context(|| format!("disabling the {service} service"))
}

/// Whether `rustup toolchain list` output names the nightly toolchain (`nightly-<host>`, not a
/// dated `nightly-YYYY-MM-DD-<host>`).
fn has_nightly(toolchains: &str) -> bool {
    toolchains
        .lines()
        .filter_map(|line| line.split_whitespace().next())
        .any(|name| {
            name == "nightly"
                || name
                    .strip_prefix("nightly-")
                    .is_some_and(|rest| !rest.starts_with(|c: char| c.is_ascii_digit()))
        })
}

/// Whether `rustup component list --installed` output has rust-src.
fn has_rust_src(components: &str) -> bool {
    components
        .lines()
        .map(str::trim)
        .any(|line| line == "rust-src" || line.starts_with("rust-src-"))
}

fn nightly_rust_src(installed: &mut Vec<String>) -> Result<()> {
    let toolchains = util::output(Command::new("rustup").args(["toolchain", "list"]))
        .context("listing rustup toolchains (is rustup installed?)")?;
    if !has_nightly(&toolchains) {
        announce("the nightly Rust toolchain");
        util::run(Command::new("rustup").args([
            "toolchain",
            "install",
            "nightly",
            "--profile",
            "minimal",
        ]))
        .context("installing the nightly toolchain")?;
        installed.push("nightly toolchain".into());
    }
    let components = util::output(Command::new("rustup").args([
        "component",
        "list",
        "--toolchain",
        "nightly",
        "--installed",
    ]))
    .context("listing the nightly toolchain's components")?;
    if !has_rust_src(&components) {
        announce("rust-src for the nightly toolchain");
        util::run(Command::new("rustup").args([
            "component",
            "add",
            "rust-src",
            "--toolchain",
            "nightly",
        ]))
        .context("adding rust-src to the nightly toolchain")?;
        installed.push("nightly rust-src".into());
    }
    Ok(())
}

fn bpf_linker_works() -> bool {
    util::works("bpf-linker", "--version")
        || cargo_bin_dir().is_some_and(|bin| util::works(bin.join("bpf-linker"), "--version"))
}

fn bpf_linker(installed: &mut Vec<String>) -> Result<()> {
    if bpf_linker_works() {
        return Ok(());
    }
    announce("bpf-linker (built against LLVM 22, about a minute)");
    let path = std::env::var_os("PATH").unwrap_or_default();
    let mut llvm_path = OsString::from(format!("{LLVM_PREFIX}/bin:"));
    llvm_path.push(path);
    util::run(
        Command::new(util::cargo_program())
            .env("LLVM_PREFIX", LLVM_PREFIX)
            .env("PATH", llvm_path)
            .args([
                "install",
                "bpf-linker",
                "--locked",
                "--no-default-features",
                "--features",
                "llvm-22",
            ]),
    )
    .context("installing bpf-linker")?;
    if !bpf_linker_works() {
        bail!("bpf-linker was installed but `bpf-linker --version` still fails");
    }
    installed.push("bpf-linker".into());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nightly_is_found_but_not_a_dated_one() {
        let list = "stable-x86_64-unknown-linux-gnu (active, default)\n\
                    nightly-x86_64-unknown-linux-gnu\n1.95.0-x86_64-unknown-linux-gnu\n";
        assert!(has_nightly(list));
        assert!(!has_nightly("stable-x86_64-unknown-linux-gnu (default)\n"));
        assert!(!has_nightly(
            "nightly-2025-01-01-x86_64-unknown-linux-gnu\n"
        ));
    }

    #[test]
    fn rust_src_is_found() {
        assert!(has_rust_src(
            "cargo-x86_64-unknown-linux-gnu\nrust-src\nrustc-x86_64\n"
        ));
        assert!(!has_rust_src(
            "cargo-x86_64-unknown-linux-gnu\nrust-std-x86_64-unknown-linux-gnu\n"
        ));
    }
}
