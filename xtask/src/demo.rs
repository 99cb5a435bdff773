//! `cargo xtask demo`: the self-contained lab (namespaces, veth links, floods, live bans).
//!
//! Builds the daemon and the `ratelimit-demo` binary of the lab crate, then runs the demo with
//! `RATELIMIT_BIN` naming the daemon and forwards its exit status. The demo makes its own
//! namespaces and cleans them up, also on Ctrl-C; this process ignores SIGINT meanwhile, so it
//! stays to report how the demo ended instead of returning the terminal mid-cleanup.

use std::path::PathBuf;

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
    let mut child = cmd
        .spawn()
        .with_context(|| format!("cannot start `{}`", util::display(&cmd)))?;
    // Ctrl-C reaches the whole foreground process group: the demo handles it (stops and cleans
    // up); we wait for that rather than die first.
    // SAFETY: signal(2) with SIG_IGN and then the previous disposition; no handler code runs.
    let previous = unsafe { libc::signal(libc::SIGINT, libc::SIG_IGN) };
    let status = child.wait();
    // SAFETY: as above, restoring what was there.
    unsafe { libc::signal(libc::SIGINT, previous) };
    let status = status.with_context(|| format!("waiting for `{}`", util::display(&cmd)))?;
    if status.success() {
        return Ok(());
    }
    let code = match status.code() {
        Some(code) => code,
        None => {
            use std::os::unix::process::ExitStatusExt as _;
            128 + status.signal().unwrap_or(0)
        }
    };
    eprintln!("xtask demo: the demo exited with status {code}");
    // Forward the demo's own status (130 after Ctrl-C, 1 when an observation was off).
    std::process::exit(code);
}

fn absolute(path: PathBuf) -> PathBuf {
    if path.is_absolute() {
        path
    } else {
        util::workspace_root().join(path)
    }
}
