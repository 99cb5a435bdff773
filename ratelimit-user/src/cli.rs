//! The command line: `ratelimit run` starts the daemon; every other command is a thin client
//! of the daemon's control socket (or, for `check-config` and `detach`, works offline).
//!
//! This module is the clap definition of the command line and [`run`], which carries out a
//! parsed one; each command group has a module of its own with its arguments, the request it
//! sends and how its answer is printed: [`local`] (`run`, `check-config`, `detach`), [`ban`],
//! [`rule`], [`overrides`] (`override`), [`fleet`], [`pressure`]; the other reports' tables
//! are in [`print`], the completions and the man page in [`packaging`].

use std::{path::PathBuf, process::ExitCode};

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::{
    api::{self, Answer, Request},
    config, serve,
};

pub mod ban;
pub mod fleet;
pub mod local;
pub mod overrides;
pub mod packaging;
pub mod pressure;
pub mod print;
pub mod rule;

pub use ban::BanCommand;
pub use fleet::{FleetCommand, FleetKeyArgs};
pub use local::{CheckConfigArgs, DetachArgs, RunArgs, XdpModeArg};
pub use overrides::{OverrideAddArgs, OverrideCommand, OverrideTargetArgs};
pub use packaging::{write_completions, write_manpage};
pub use pressure::{PressureArgs, PressureCommand};
pub use rule::{RuleCommand, RuleSetArgs};

#[derive(Parser, Debug)]
#[command(
    name = "ratelimit",
    version,
    about = "XDP rate limiter for edge hosts: throttles and bans floods before the kernel allocates an skb"
)]
pub struct Cli {
    /// Control socket of the running daemon.
    #[arg(long, global = true, value_name = "PATH", help = socket_help())]
    pub socket: Option<PathBuf>,
    /// Config file (for `run`, `reload`, `detach`, and to find the control socket).
    #[arg(long, global = true, value_name = "FILE")]
    pub config: Option<PathBuf>,
    #[command(subcommand)]
    pub command: Command,
}

/// The help of `--socket`, naming the default the daemon binds.
fn socket_help() -> String {
    format!(
        "Control socket of the running daemon (default: the config's `control_socket`, else {})",
        config::DEFAULT_CONTROL_SOCKET
    )
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Load and attach the XDP program and run the daemon.
    Run(RunArgs),
    /// Validate a config file: exit 0, or exit 1 with `file:line:col: message` lines; or print
    /// the embedded default policy (what `run` enforces without a config file).
    CheckConfig(CheckConfigArgs),
    /// Daemon, program and interface status.
    Status(JsonArg),
    /// Packet and byte counters by verdict, reason, interface and rule.
    Stats(JsonArg),
    /// The heaviest clients now.
    Top(TopArgs),
    /// Active bans: per prefix, and the aggregate bans of rules keyed by `all` or `region`.
    Bans(JsonArg),
    /// Clients above their soft limit or throttled now, with rates (for L7 follow-up).
    Offenders(JsonArg),
    /// Add or remove bans.
    Ban {
        #[command(subcommand)]
        action: BanCommand,
    },
    /// Change live rules without a restart and without resetting their counters.
    Rule {
        #[command(subcommand)]
        action: RuleCommand,
    },
    /// Every rule with its values in force, and the fields changed live (`rule set`).
    Rules(JsonArg),
    /// Add or remove per-client overrides live, without resetting a counter.
    Override {
        #[command(subcommand)]
        action: OverrideCommand,
    },
    /// Every override in force: its rule, CIDR or region, values, and source (config or live).
    Overrides(JsonArg),
    /// Re-read the config file (SIGHUP does the same).
    Reload(JsonArg),
    /// The pressure level (high: the host is under load), its mode and signals; `pressure set`
    /// forces it.
    Pressure(PressureArgs),
    /// Fleet mode (`[fleet]`): bans shared with other hosts through a Redis store.
    Fleet {
        #[command(subcommand)]
        action: FleetCommand,
    },
    /// Remove the XDP program and the pinned state.
    Detach(DetachArgs),
    /// Print a shell completion script to stdout (for packaging; see packaging/README.md).
    #[command(hide = true)]
    Completions {
        /// The shell to complete for.
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Print the ratelimit(8) man page (roff) to stdout (for packaging).
    #[command(hide = true)]
    Manpage,
}

#[derive(Args, Debug, Clone, Copy, Default)]
pub struct JsonArg {
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// `--by` of `top` (the control API's [`api::TopBy`]).
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum TopBy {
    #[default]
    Packets,
    Bytes,
    Drops,
}

impl From<TopBy> for api::TopBy {
    fn from(b: TopBy) -> Self {
        match b {
            TopBy::Packets => api::TopBy::Packets,
            TopBy::Bytes => api::TopBy::Bytes,
            TopBy::Drops => api::TopBy::Drops,
        }
    }
}

#[derive(Args, Debug)]
pub struct TopArgs {
    /// How many clients.
    #[arg(short = 'n', default_value_t = 10)]
    pub n: usize,
    /// Order by.
    #[arg(long, value_enum, default_value_t = TopBy::Packets)]
    pub by: TopBy,
    #[arg(long)]
    pub json: bool,
}

/// Carries out a parsed command line: the exit status, or the error (status 1).
pub fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    let (req, json) = match &cli.command {
        Command::Completions { shell } => {
            return packaging::print_generated(write_completions(
                *shell,
                &mut std::io::stdout().lock(),
            ));
        }
        Command::Manpage => {
            return packaging::print_generated(write_manpage(&mut std::io::stdout().lock()));
        }
        Command::Run(args) => return local::run(&cli, args),
        Command::CheckConfig(args) => return Ok(local::check_config(args)),
        Command::Detach(args) => return local::detach(&cli, args),
        Command::Status(j) => (Request::Status, j.json),
        Command::Stats(j) => (Request::Stats, j.json),
        Command::Top(t) => (
            Request::Top {
                n: t.n,
                by: t.by.into(),
            },
            t.json,
        ),
        Command::Bans(j) => (Request::Bans { limit: None }, j.json),
        Command::Offenders(j) => (Request::Offenders { limit: None }, j.json),
        Command::Reload(j) => (Request::Reload, j.json),
        Command::Ban { action } => ban::request(action)?,
        Command::Rule { action } => rule::request(action),
        Command::Rules(j) => (Request::Rules, j.json),
        Command::Override { action } => overrides::request(action),
        Command::Overrides(j) => (Request::Overrides, j.json),
        Command::Fleet { action } => fleet::request(action),
        Command::Pressure(p) => pressure::request(p),
    };
    let answer = serve::control::call(&socket_path(&cli)?, &req)?;
    if let (
        Command::Fleet {
            action: FleetCommand::Peers(_),
        },
        Answer::Fleet(f),
    ) = (&cli.command, &answer)
    {
        if json {
            println!("{}", serde_json::to_string_pretty(&f.peers)?);
        } else {
            fleet::print_peers(f);
        }
        return Ok(ExitCode::SUCCESS);
    }
    if json {
        println!("{}", serde_json::to_string_pretty(&answer)?);
    } else {
        print::print_human(&answer)?;
    }
    Ok(ExitCode::SUCCESS)
}

fn socket_path(cli: &Cli) -> anyhow::Result<PathBuf> {
    if let Some(s) = &cli.socket {
        return Ok(s.clone());
    }
    if let Some(c) = &cli.config {
        let cfg = config::load(c).map_err(|e| anyhow::anyhow!("{e}"))?;
        return Ok(cfg.daemon.control_socket);
    }
    Ok(PathBuf::from(config::DEFAULT_CONTROL_SOCKET))
}
