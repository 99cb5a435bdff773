//! The command line: `ratelimit run` starts the daemon; every other command is a thin client
//! of the daemon's control socket (or, for `check-config` and `detach`, works offline).

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

#[derive(Parser, Debug)]
#[command(
    name = "ratelimit",
    version,
    about = "XDP rate limiter for edge hosts: throttles and bans floods before the kernel allocates an skb"
)]
pub struct Cli {
    /// Control socket of the running daemon (default: the config's `control_socket`, else
    /// /run/ratelimit/control.sock).
    #[arg(long, global = true, value_name = "PATH")]
    pub socket: Option<PathBuf>,
    /// Config file (for `run`, `reload`, `detach`, and to find the control socket).
    #[arg(long, global = true, value_name = "FILE")]
    pub config: Option<PathBuf>,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Load and attach the XDP program and run the daemon.
    Run(RunArgs),
    /// Validate a config file: exit 0, or exit 1 with `file:line:col: message` lines.
    CheckConfig { file: PathBuf },
    /// Daemon, program and interface status.
    Status(JsonArg),
    /// Packet and byte counters by verdict, reason, interface and rule.
    Stats(JsonArg),
    /// The heaviest clients now.
    Top(TopArgs),
    /// Active bans.
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
    /// Re-read the config file (SIGHUP does the same).
    Reload(JsonArg),
    /// Remove the XDP program and the pinned state.
    Detach(DetachArgs),
}

#[derive(Args, Debug, Clone, Copy, Default)]
pub struct JsonArg {
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

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

#[derive(
    ValueEnum, Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize, Default,
)]
#[serde(rename_all = "snake_case")]
pub enum TopBy {
    #[default]
    Packets,
    Bytes,
    Drops,
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

#[derive(Subcommand, Debug)]
pub enum BanCommand {
    /// Ban a CIDR (or every CIDR in --file, one per line, `-` = stdin).
    Add {
        /// Address or CIDR, IPv4 or IPv6.
        cidr: Option<String>,
        /// Ban duration (e.g. 30s, 20m, 1h, 1d); default: until removed.
        #[arg(long = "for", value_name = "DURATION")]
        duration: Option<String>,
        /// Free text kept with the ban.
        #[arg(long)]
        reason: Option<String>,
        /// Read CIDRs from a file (`-` = stdin), one per line; `#` starts a comment.
        #[arg(long, value_name = "FILE", conflicts_with = "cidr")]
        file: Option<PathBuf>,
        #[arg(long)]
        json: bool,
    },
    /// Remove a ban (or every CIDR in --file).
    Del {
        cidr: Option<String>,
        #[arg(long, value_name = "FILE", conflicts_with = "cidr")]
        file: Option<PathBuf>,
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand, Debug)]
pub enum RuleCommand {
    /// Change fields of a live rule; unspecified fields keep their values.
    Set(RuleSetArgs),
}

#[derive(Args, Debug, Clone, serde::Serialize, serde::Deserialize, Default)]
pub struct RuleSetArgs {
    /// Rule name.
    pub name: String,
    /// COUNT/INTERVAL or BYTES/INTERVAL, e.g. 2000/20m or 10MiB/1s.
    #[arg(long)]
    pub threshold: Option<String>,
    /// Ban threshold, same form as --threshold.
    #[arg(long)]
    pub ban_threshold: Option<String>,
    /// Ban duration, e.g. 1h.
    #[arg(long)]
    pub ban_duration: Option<String>,
    /// Token bucket capacity.
    #[arg(long)]
    pub burst: Option<u64>,
    /// drop | pass
    #[arg(long)]
    pub exceed_action: Option<String>,
    /// true | false
    #[arg(long)]
    pub preview: Option<bool>,
    /// Share of the threshold (0..1] above which clients are reported as offenders.
    #[arg(long)]
    pub soft_limit: Option<f64>,
    #[arg(long)]
    #[serde(skip)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct DetachArgs {
    /// Only this interface (repeatable); default: all.
    #[arg(long = "iface", value_name = "IF")]
    pub ifaces: Vec<String>,
    /// bpffs directory of the pinned state (default: the config's `bpffs_dir`).
    #[arg(long, value_name = "DIR")]
    pub bpffs_dir: Option<PathBuf>,
}
