//! `cargo xtask test`: every check and test, in order, failing fast.
//!
//! fmt, clippy, host tests, the daemon build, then the kernel end-to-end tests (root, `ip`,
//! bpffs). Without their preconditions the kernel tests are skipped, except under CI where
//! that is a failure.

use std::path::{Path, PathBuf};

use anyhow::{Context as _, Result, bail};
use clap::Args;

use crate::{bench, setup, util};

#[derive(Debug, Args)]
pub struct Options {
    /// Skip the kernel end-to-end tests.
    #[arg(long)]
    pub no_kernel: bool,
    /// Test-name filter for the kernel tests (after `--`).
    #[arg(last = true, value_name = "FILTER")]
    pub filter: Vec<String>,
}

const STEPS: usize = 6;

fn header(step: usize, title: &str) {
    println!();
    println!("==== xtask test [{step}/{STEPS}]: {title}");
}

/// Whether we run under CI (`CI=true` or `CI=1`): then missing kernel-test preconditions fail.
fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|value| value.eq_ignore_ascii_case("true") || value == "1")
}

/// Why the kernel tests cannot run here, if they cannot.
fn kernel_preconditions() -> Option<String> {
    let mut reasons = Vec::new();
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        reasons.push("not running as root".to_string());
    }
    if !util::works("ip", "-V") {
        reasons.push("`ip` (iproute2) is not available".to_string());
    }
    if !Path::new("/sys/fs/bpf").is_dir() {
        reasons.push("/sys/fs/bpf does not exist (no bpffs)".to_string());
    }
    (!reasons.is_empty()).then(|| reasons.join("; "))
}

/// Counts of the libtest summary lines (`test result: ok. N passed; M failed; ...`), summed
/// over every test binary of the step.
#[derive(Debug, Default, PartialEq, Eq)]
struct Counts {
    passed: u64,
    failed: u64,
    binaries: u64,
}

fn parse_counts(output: &str) -> Counts {
    let mut counts = Counts::default();
    for line in output.lines() {
        let Some(rest) = line.trim().strip_prefix("test result: ") else {
            continue;
        };
        counts.binaries += 1;
        let words: Vec<&str> = rest.split_whitespace().collect();
        for pair in words.windows(2) {
            let Ok(n) = pair[0].parse::<u64>() else {
                continue;
            };
            if pair[1].starts_with("passed") {
                counts.passed += n;
            } else if pair[1].starts_with("failed") {
                counts.failed += n;
            }
        }
    }
    counts
}

pub fn run(options: Options) -> Result<()> {
    setup::ensure()?;

    // Decide about the kernel tests up front, so CI fails before minutes of clippy.
    let kernel_skip = if options.no_kernel {
        Some("--no-kernel given".to_string())
    } else if let Some(reason) = kernel_preconditions() {
        if in_ci() {
            bail!("kernel tests cannot run under CI: {reason}");
        }
        Some(reason)
    } else {
        None
    };

    header(1, "format");
    util::run(&mut util::cargo(["fmt", "--all", "--", "--check"]))
        .context("formatting check (run `cargo fmt --all`)")?;

    header(2, "clippy");
    util::run(&mut util::cargo([
        "clippy",
        "--workspace",
        "--all-targets",
        "--",
        "-D",
        "warnings",
    ]))
    .context("clippy")?;

    header(3, "host tests");
    util::run(&mut util::cargo([
        "test",
        "-p",
        "ratelimit-common",
        "-p",
        "ratelimit-user",
        "-p",
        "xtask",
    ]))
    .context("host tests")?;

    header(4, "build the daemon");
    util::run(&mut util::cargo(["build", "-p", "ratelimit-user"]))
        .context("building the daemon")?;
    let bin = daemon_path()?;
    println!("daemon: {}", bin.display());

    header(5, "kernel tests");
    if let Some(reason) = kernel_skip {
        if options.no_kernel {
            println!("kernel tests skipped: {reason}");
        } else {
            println!("kernel tests SKIPPED: {reason}");
        }
        println!();
        println!("xtask test: ok; kernel tests: skipped ({reason})");
        return Ok(());
    }
    let mut cmd = util::cargo(["test", "-p", "ratelimit-tests", "--", "--test-threads=1"]);
    cmd.args(&options.filter)
        .env("RATELIMIT_BIN", &bin)
        .env("RATELIMIT_KERNEL_TESTS", "1");
    let (result, output) = util::run_tee(&mut cmd);
    let counts = parse_counts(&output);
    println!();
    println!(
        "xtask test: kernel tests: {} passed, {} failed",
        counts.passed, counts.failed
    );
    result.context("kernel tests")?;
    if counts.binaries == 0 {
        bail!("kernel tests: no libtest summary line in the output");
    }

    header(
        6,
        "benchmark suite (quick: every case runs, verdicts checked, no speed asserted)",
    );
    bench::run_suite(true)?;
    println!();
    println!("{} passed, {} failed", counts.passed, counts.failed);
    Ok(())
}

/// Absolute path of the debug daemon binary.
fn daemon_path() -> Result<PathBuf> {
    let target = util::target_dir()?;
    let bin = target.join("debug").join("ratelimit");
    let bin = if bin.is_absolute() {
        bin
    } else {
        util::workspace_root().join(bin)
    };
    if !bin.is_file() {
        bail!(
            "the daemon build succeeded but {} does not exist",
            bin.display()
        );
    }
    Ok(bin)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_are_summed_over_binaries() {
        let output = "\
running 2 tests
test a ... ok
test b ... FAILED

test result: FAILED. 1 passed; 1 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.01s

running 10 tests
test result: ok. 10 passed; 0 failed; 2 ignored; 0 measured; 3 filtered out; finished in 1.2s
";
        assert_eq!(
            parse_counts(output),
            Counts {
                passed: 11,
                failed: 1,
                binaries: 2
            }
        );
    }

    #[test]
    fn no_summary_no_counts() {
        assert_eq!(
            parse_counts("error: could not compile\n"),
            Counts::default()
        );
    }
}
