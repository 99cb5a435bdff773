//! `cargo xtask run`: setup, build the daemon, exec it attached to the given interfaces.

use std::os::unix::process::CommandExt as _;
use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context as _, Result, bail};
use clap::Args;

use crate::{setup, util};

#[derive(Debug, Args)]
pub struct Options {
    /// Interface to attach the XDP program to (repeatable); optional with --config.
    #[arg(long = "iface", value_name = "IF", required_unless_present = "config")]
    pub ifaces: Vec<String>,
    /// Config file for the daemon.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Build and run the release profile.
    #[arg(long)]
    pub release: bool,
    /// Extra arguments for `ratelimit run` (after `--`).
    #[arg(last = true, value_name = "DAEMON_ARGS")]
    pub extra: Vec<String>,
}

pub fn run(options: Options) -> Result<()> {
    setup::ensure()?;
    let mut build = util::cargo(["build", "-p", "ratelimit-user"]);
    if options.release {
        build.arg("--release");
    }
    util::run(&mut build).context("building the daemon")?;

    let profile = if options.release { "release" } else { "debug" };
    let bin = util::target_dir()?.join(profile).join("ratelimit");
    if !bin.is_file() {
        bail!("the build succeeded but {} does not exist", bin.display());
    }
    // The daemon keeps the caller's working directory, so a relative --config works.
    let mut daemon = Command::new(&bin);
    daemon.arg("run");
    for iface in &options.ifaces {
        daemon.args(["--iface", iface]);
    }
    if let Some(config) = &options.config {
        daemon.arg("--config").arg(config);
    }
    daemon.args(&options.extra);
    util::echo(&daemon);
    // exec: the daemon takes over this process (stdio, signals, exit status).
    let error = daemon.exec();
    Err(error).with_context(|| format!("cannot exec {}", bin.display()))
}
