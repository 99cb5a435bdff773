//! `cargo xtask demo`: the self-contained lab (namespaces, veth links, floods, live bans).
//!
//! Builds the daemon and the `ratelimit-demo` binary of the lab crate, then execs the demo with
//! `RATELIMIT_BIN` naming the daemon. The demo makes its own namespaces and cleans them up, also
//! when it is stopped by a signal (Ctrl-C, SIGTERM, SIGHUP). It replaces this process (as
//! `cargo run` replaced cargo's with this one) instead of running as its child: a signal sent
//! to `cargo xtask demo`'s pid, as `timeout`, a CI runner or `kill` send it, then reaches the
//! demo itself, and no parent exits before it has cleaned up. Its exit status is the command's.

use std::{os::unix::process::CommandExt as _, path::PathBuf};

use anyhow::{Context as _, Result, bail};
use clap::Args;

use crate::{setup, util};

#[derive(Debug, Args)]
pub struct Options {
    /// Shorter phases (about 20 s instead of 30 s).
    #[arg(long)]
    pub quick: bool,
}

pub fn run(options: Options) -> Result<()> {
    setup::ensure()?;

    util::run(&mut util::cargo(["build", "-p", "ratelimit-user"]))
        .context("building the daemon")?;
    util::run(&mut util::cargo([
        "build",
        "-p",
        "ratelimit-tests",
        "--bin",
        "ratelimit-demo",
    ]))
    .context("building the demo")?;
    let debug = util::target_dir()?.join("debug");
    let daemon = absolute(debug.join("ratelimit"));
    let demo = absolute(debug.join("ratelimit-demo"));
    for bin in [&daemon, &demo] {
        if !bin.is_file() {
            bail!("the build succeeded but {} does not exist", bin.display());
        }
    }

    // SAFETY: geteuid has no preconditions and cannot fail.
    let euid = unsafe { libc::geteuid() };
    if euid != 0 {
        bail!(
            "the demo needs root (euid is {euid}): it creates network namespaces and veth links \
             and attaches an XDP program, which need CAP_NET_ADMIN and CAP_SYS_ADMIN. \
             Run `cargo xtask demo` as root."
        );
    }

    let mut cmd = std::process::Command::new(&demo);
    cmd.env("RATELIMIT_BIN", &daemon);
    if options.quick {
        cmd.arg("--quick");
    }
    util::echo(&cmd);
    let error = cmd.exec();
    Err(error).with_context(|| format!("cannot start `{}`", util::display(&cmd)))
}

fn absolute(path: PathBuf) -> PathBuf {
    if path.is_absolute() {
        path
    } else {
        util::workspace_root().join(path)
    }
}
