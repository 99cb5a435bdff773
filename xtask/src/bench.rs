//! `cargo xtask bench [--quick] [--only PART]`: the benchmark suite (the `ratelimit-bench`
//! crate in bench/, which embeds its own XDP object, built from bench-ebpf/ by its build
//! script the way the daemon's is). The full run writes bench/results.json and BENCHMARKS.md;
//! `--quick` (under a minute, part of `cargo xtask test`) proves every case runs with the right
//! verdict and asserts no speed; `--only` runs one part and prints its figures, writing nothing.

use anyhow::{Context as _, Result, bail};
use clap::Args;

use crate::{setup, util};

#[derive(Debug, Args)]
pub struct Options {
    /// Fewer repeats and sizes; checks verdicts only.
    #[arg(long)]
    pub quick: bool,
    /// Run one part alone and print its figures (BENCHMARKS.md is not written): `program` is
    /// the program-cost table with the pass path across up to 1M tracked sources and one CPU's
    /// churn (a few minutes: what to run twice, in turn, to compare two trees); `cost` adds
    /// 10M sources, the sized stores and two CPUs; `flood` and `control` are the live floods
    /// and the control plane; `fleet` is fleet mode's simulation, lab accuracy and store cost.
    #[arg(long, value_enum)]
    pub only: Option<Only>,
}

/// A part of the suite (`RATELIMIT_BENCH_ONLY` of the bench binary).
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum Only {
    Program,
    Cost,
    Flood,
    Control,
    Fleet,
}

pub fn run(options: Options) -> Result<()> {
    setup::ensure()?;
    run_part(options.quick, options.only)
}

/// Build and run the suite (setup already done).
pub fn run_suite(quick: bool) -> Result<()> {
    run_part(quick, None)
}

/// Build and run the suite, or one part of it (setup already done).
fn run_part(quick: bool, only: Option<Only>) -> Result<()> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!("the benchmark loads BPF programs: run it as root");
    }
    util::run(&mut util::cargo([
        "build",
        "-p",
        "ratelimit-user",
        "-p",
        "ratelimit-bench",
        "--bin",
        "ratelimit",
        "--bin",
        "ratelimit-bench",
    ]))
    .context("building the daemon and the benchmark")?;
    let bin = util::target_dir()?.join("debug").join("ratelimit-bench");
    let bin = if bin.is_absolute() {
        bin
    } else {
        util::workspace_root().join(bin)
    };
    let daemon = bin.with_file_name("ratelimit");
    let mut cmd = std::process::Command::new(&bin);
    // The control part runs the real daemon: this build of it, never a stale one.
    cmd.env("RATELIMIT_BIN", &daemon);
    if quick {
        cmd.arg("--quick");
    }
    if let Some(only) = only {
        use clap::ValueEnum as _;
        let name = only.to_possible_value().expect("no variant is skipped");
        cmd.env("RATELIMIT_BENCH_ONLY", name.get_name());
    }
    cmd.current_dir(util::workspace_root());
    util::run(&mut cmd).context("benchmark")
}
