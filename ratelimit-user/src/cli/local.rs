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
pub struct CheckConfigArgs {
    /// The config file to validate.
    #[arg(
        required_unless_present = "print_default",
        conflicts_with = "print_default"
    )]
    pub file: Option<PathBuf>,
    /// Print the embedded default policy as config text (to start a config from), its
    /// reflection rule excepting the resolvers of `--resolv-conf`.
    #[arg(long)]
    pub print_default: bool,
    /// With `--print-default`: the resolv.conf whose resolvers the reflection rule excepts
    /// (default: /etc/resolv.conf, and the upstreams of a local systemd-resolved stub).
    #[arg(long, value_name = "FILE", requires = "print_default")]
    pub resolv_conf: Option<PathBuf>,
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

/// `ratelimit check-config FILE`: 0 for a file the daemon would accept, 1 with its errors;
/// `--print-default`: the embedded default policy.
pub(super) fn check_config(args: &CheckConfigArgs) -> ExitCode {
    let Some(file) = &args.file else {
        return print_default(args.resolv_conf.as_deref());
    };
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

/// `ratelimit check-config --print-default [--resolv-conf FILE]`.
fn print_default(resolv_conf: Option<&Path>) -> ExitCode {
    let resolvers = match resolv_conf {
        None => config::host_resolvers(),
        Some(f) => match std::fs::read_to_string(f) {
            Ok(text) => config::resolvers(&text),
            Err(e) => {
                eprintln!("{}: {e}", f.display());
                return ExitCode::FAILURE;
            }
        },
    };
    print!("{}", config::default_policy(&resolvers));
    ExitCode::SUCCESS
}
