//! `cargo xtask bench [--quick]`: the benchmark suite (the `ratelimit-bench` binary of the lab
//! crate). The full run writes bench/results.json and BENCHMARKS.md; `--quick` (under a
//! minute, part of `cargo xtask test`) proves every case runs with the right verdict and
//! asserts no speed.

use anyhow::{Context as _, Result, bail};
use clap::Args;

use crate::{setup, util};

#[derive(Debug, Args)]
pub struct Options {
    /// Fewer repeats and sizes; checks verdicts only.
    #[arg(long)]
    pub quick: bool,
}

pub fn run(options: Options) -> Result<()> {
    setup::ensure()?;
    run_suite(options.quick)
}

/// Build and run the suite (setup already done).
pub fn run_suite(quick: bool) -> Result<()> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!("the benchmark loads BPF programs: run it as root");
    }
    util::run(&mut util::cargo([
        "build",
        "-p",
        "ratelimit-tests",
        "--bin",
        "ratelimit-bench",
    ]))
    .context("building the benchmark")?;
    let bin = util::target_dir()?.join("debug").join("ratelimit-bench");
    let bin = if bin.is_absolute() {
        bin
    } else {
        util::workspace_root().join(bin)
    };
    let mut cmd = std::process::Command::new(bin);
    if quick {
        cmd.arg("--quick");
    }
    cmd.current_dir(util::workspace_root());
    util::run(&mut cmd).context("benchmark")
}
