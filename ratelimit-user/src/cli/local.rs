//! The commands that work without the control socket: `run` (the daemon itself),
//! `check-config` and `detach`.

use std::{
    path::{Path, PathBuf},
    process::ExitCode,
};

use clap::{Args, ValueEnum};

use super::Cli;
use crate::{config, daemon, kernel::datapath};

#[derive(Args, Debug)]
pub struct RunArgs {
    /// Interface to attach to (repeatable); adds to the config's `interfaces`.
    #[arg(long = "iface", value_name = "IF")]
    pub ifaces: Vec<String>,
    /// XDP attach mode (overrides the config).
    #[arg(long, value_enum)]
    pub xdp_mode: Option<XdpModeArg>,
    /// Never drop: count and report what every rule and ban would have dropped.
    #[arg(long)]
    pub preview: bool,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum XdpModeArg {
    Auto,
    Native,
    Generic,
}

#[derive(Args, Debug)]
pub struct DetachArgs {
    /// Only this interface (repeatable); default: all.
    #[arg(long = "iface", value_name = "IF")]
    pub ifaces: Vec<String>,
    /// bpffs directory of the pinned state (default: the config's `bpffs_dir`); a directory
    /// that is not on a bpffs is refused, with nothing removed.
    #[arg(long, value_name = "DIR")]
    pub bpffs_dir: Option<PathBuf>,
}

/// `ratelimit run`: the daemon, until it stops.
pub(super) fn run(cli: &Cli, args: &RunArgs) -> anyhow::Result<ExitCode> {
    let opts = daemon::Options {
        config_path: cli.config.clone(),
        ifaces: args.ifaces.clone(),
        xdp_mode: args.xdp_mode.map(|m| match m {
            XdpModeArg::Auto => config::XdpMode::Auto,
            XdpModeArg::Native => config::XdpMode::Native,
            XdpModeArg::Generic => config::XdpMode::Generic,
        }),
        preview: args.preview,
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(daemon::run(opts))?;
    Ok(ExitCode::SUCCESS)
}

/// `ratelimit check-config FILE`: 0 for a file the daemon would accept, 1 with its errors.
pub(super) fn check_config(file: &Path) -> ExitCode {
    match config::load(file) {
        Ok(cfg) => match cfg
            .fleet
            .as_ref()
            .map(crate::fleet::check_files)
            .transpose()
        {
            Ok(_) => {
                for w in cfg.fleet.iter().flat_map(config::fleet_warnings) {
                    eprintln!("{}: warning: {w}", file.display());
                }
                println!("{}: ok ({} rules)", file.display(), cfg.rules.len());
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("{}: {e:#}", file.display());
                ExitCode::FAILURE
            }
        },
        Err(e) => {
            eprintln!("{e}");
            ExitCode::FAILURE
        }
    }
}

/// `ratelimit detach`: the program and the pinned state removed.
pub(super) fn detach(cli: &Cli, args: &DetachArgs) -> anyhow::Result<ExitCode> {
    let dir = match (&args.bpffs_dir, &cli.config) {
        (Some(d), _) => d.clone(),
        (None, Some(c)) => {
            config::load(c)
                .map_err(|e| anyhow::anyhow!("{e}"))?
                .daemon
                .bpffs_dir
        }
        (None, None) => config::Daemon::default().bpffs_dir,
    };
    let done = datapath::detach(&dir, &args.ifaces)?;
    if done.is_empty() {
        println!("nothing attached under {}", dir.display());
    } else {
        println!("detached from {}", done.join(", "));
    }
    Ok(ExitCode::SUCCESS)
}
