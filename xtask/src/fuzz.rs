//! `cargo xtask fuzz [--frames N] [--seed S]`: the differential fuzz test of the data plane
//! (`tests/tests/fuzz.rs`) at length: generated frames through the real XDP object and the
//! host model, compared frame by frame. The frame count and seed reach the test as
//! `RATELIMIT_FUZZ_FRAMES` and `RATELIMIT_FUZZ_SEED`, so the same test binary runs the same
//! way inside a qemu guest booted with another kernel.

use anyhow::{Context as _, Result, bail};
use clap::Args;

use crate::{setup, util};

#[derive(Debug, Args)]
pub struct Options {
    /// Frames to generate and compare.
    #[arg(long, default_value_t = 1_000_000)]
    pub frames: u64,
    /// Seed of the generator (default: a fresh one, printed, so a failing run can be repeated).
    #[arg(long)]
    pub seed: Option<u64>,
}

pub fn run(options: Options) -> Result<()> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!("the fuzz test loads the XDP program: run it as root");
    }
    setup::ensure()?;
    let seed = options.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64 ^ std::process::id() as u64)
    });
    println!(
        "xtask fuzz: {} frames, seed {seed} (repeat with --seed {seed})",
        options.frames
    );
    let mut cmd = util::cargo([
        "test",
        "-p",
        "ratelimit-tests",
        "--test",
        "fuzz",
        "--",
        "--test-threads=1",
        "--nocapture",
    ]);
    cmd.env("RATELIMIT_KERNEL_TESTS", "1")
        .env("RATELIMIT_FUZZ_FRAMES", options.frames.to_string())
        .env("RATELIMIT_FUZZ_SEED", seed.to_string());
    util::run(&mut cmd).with_context(|| {
        format!("fuzz run (seed {seed}): a difference is minimised into tests/fuzz-regressions/")
    })
}
