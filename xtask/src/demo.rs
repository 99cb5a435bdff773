//! `cargo xtask demo`: the self-contained lab (namespaces, veth links, floods, live bans). Not built yet.

use anyhow::Result;
use clap::Args;

use crate::setup;

#[derive(Debug, Args)]
pub struct Options {}

pub fn run(_options: Options) -> Result<()> {
    setup::ensure()?;
    eprintln!("xtask demo: not built yet");
    std::process::exit(2);
}
