//! `cargo xtask bench`: the benchmark suite. Not built yet.

use anyhow::Result;
use clap::Args;

use crate::setup;

#[derive(Debug, Args)]
pub struct Options {}

pub fn run(_options: Options) -> Result<()> {
    setup::ensure()?;
    eprintln!("xtask bench: not built yet");
    std::process::exit(2);
}
