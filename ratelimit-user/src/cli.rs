//! The command line: `ratelimit run` starts the daemon; every other command is a thin client
//! of the daemon's control socket (or, for `check-config` and `detach`, works offline).

use std::{io, path::PathBuf};

use clap::{Args, CommandFactory as _, Parser, Subcommand, ValueEnum};

use crate::{api, config};
use clap_mangen::{
    Man,
    roff::{Roff, bold, italic, roman},
};

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
    /// Validate a config file: exit 0, or exit 1 with `file:line:col: message` lines.
    CheckConfig { file: PathBuf },
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

#[derive(Args, Debug)]
pub struct PressureArgs {
    #[command(subcommand)]
    pub action: Option<PressureCommand>,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Subcommand, Debug)]
pub enum PressureCommand {
    /// Force the level (`high`, `low`), for an operator or an L7 system that sees its backends
    /// saturate, or return it to the signals (`auto`). Kept across restarts.
    Set {
        /// high | low | auto
        mode: crate::policy::pressure::Mode,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
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
        /// In fleet mode: ban on this host only, not on the fleet.
        #[arg(long)]
        local: bool,
        #[arg(long)]
        json: bool,
    },
    /// Remove a ban (or every CIDR in --file), or lift a rule's aggregate ban (--rule).
    Del {
        cidr: Option<String>,
        #[arg(long, value_name = "FILE", conflicts_with = "cidr")]
        file: Option<PathBuf>,
        /// Lift the ban of a rule keyed `all` (or `region`, with --region): its shared meter
        /// starts clean.
        #[arg(long, value_name = "RULE", conflicts_with_all = ["cidr", "file"])]
        rule: Option<String>,
        /// The region (ISO 3166-1 alpha-2) whose ban to lift, for a rule keyed `region`.
        #[arg(long, value_name = "CC", requires = "rule")]
        region: Option<String>,
        /// In fleet mode: lift the ban on this host only, not on the fleet.
        #[arg(long, conflicts_with = "rule")]
        local: bool,
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand, Debug)]
pub enum FleetCommand {
    /// The store, this host's connection to it (connected, or degraded since when), the
    /// stream cursor and lag, the outbox, and the bans sent and received.
    Status(JsonArg),
    /// The hosts of the fleet, from their heartbeats in the store (written every second):
    /// version, last seen, bans published and received, stream cursor; a host not seen for
    /// 10 s is shown as stale.
    Peers(JsonArg),
    /// A client's counts under each global rule keyed `ip` (or the one named): ADDR masked to
    /// the rule's prefix, this host's state for it, and the fleet's counts of its current and
    /// previous window in the store (total and each host's own).
    Key(FleetKeyArgs),
}

#[derive(Args, Debug)]
pub struct FleetKeyArgs {
    /// The client's address (IPv4 or IPv6).
    pub addr: String,
    /// Only this global rule.
    #[arg(long, value_name = "NAME")]
    pub rule: Option<String>,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

#[derive(Subcommand, Debug)]
pub enum RuleCommand {
    /// Change fields of a live rule; unspecified fields keep their values. Kept across
    /// restarts and reloads until `rule reset`.
    Set(RuleSetArgs),
    /// Return a rule to the config's values (undo its `rule set` changes), counters kept.
    Reset {
        /// Rule name.
        name: String,
        #[arg(long)]
        json: bool,
    },
}

#[derive(Args, Debug, Clone, Default)]
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
    /// Elastic factor F > 1 (e.g. 2): up to F times every count of the rule while the host
    /// has room, the rule as written under pressure.
    #[arg(long)]
    pub elastic: Option<f64>,
    #[arg(long)]
    pub json: bool,
}

impl RuleSetArgs {
    /// The fields given, as the control API carries them.
    pub fn changes(&self) -> crate::policy::ruleset::RuleChanges {
        crate::policy::ruleset::RuleChanges {
            threshold: self.threshold.clone(),
            ban_threshold: self.ban_threshold.clone(),
            ban_duration: self.ban_duration.clone(),
            burst: self.burst,
            exceed_action: self.exceed_action.clone(),
            preview: self.preview,
            soft_limit: self.soft_limit,
            elastic: self.elastic,
        }
    }
}

#[derive(Subcommand, Debug)]
pub enum OverrideCommand {
    /// Set a rule's thresholds for one network (rules keyed `ip` or `all`) or one region
    /// (rules keyed `region`), replacing any override at the same key while it exists. Kept
    /// across restarts and reloads until `override del`.
    Add(OverrideAddArgs),
    /// Remove a live override; the config's override at the same key, if any, applies again.
    Del {
        /// Rule name.
        rule: String,
        #[command(flatten)]
        target: OverrideTargetArgs,
        #[arg(long)]
        json: bool,
    },
}

/// Whom an override is for: a network, or a region.
#[derive(Args, Debug, Clone, Default)]
pub struct OverrideTargetArgs {
    /// Address or CIDR, IPv4 or IPv6 (the most specific override wins).
    #[arg(required_unless_present = "region", conflicts_with = "region")]
    pub cidr: Option<String>,
    /// ISO 3166-1 alpha-2 country code (ZZ = unknown), for a rule keyed `region`.
    #[arg(long, value_name = "CC")]
    pub region: Option<String>,
}

#[derive(Args, Debug, Clone, Default)]
pub struct OverrideAddArgs {
    /// Rule name.
    pub rule: String,
    #[command(flatten)]
    pub target: OverrideTargetArgs,
    /// COUNT/INTERVAL or BYTES/INTERVAL, counting what the rule counts, e.g. 5000/20m.
    #[arg(long)]
    pub threshold: String,
    /// Token bucket capacity (token_bucket rules): packets, or bytes with a unit (e.g. 1MiB).
    /// Default: the threshold's amount.
    #[arg(long)]
    pub burst: Option<String>,
    /// Ban threshold (rate_based_ban rules), same form as --threshold. Default: the rule's ban
    /// threshold, or this threshold where it is higher.
    #[arg(long)]
    pub ban_threshold: Option<String>,
    /// Elastic factor F > 1 (e.g. 1.5): up to F times every count of this override while the
    /// host has room, the override as given under pressure. Default: the rule's.
    #[arg(long)]
    pub elastic: Option<String>,
    #[arg(long)]
    pub json: bool,
}

impl OverrideTargetArgs {
    /// The override's key on the control API.
    pub fn at(&self, rule: &str) -> crate::policy::live::OverrideAt {
        crate::policy::live::OverrideAt {
            rule: rule.to_string(),
            cidr: self.cidr.clone(),
            region: self.region.clone(),
        }
    }
}

impl OverrideAddArgs {
    /// The override as the control API carries it.
    pub fn spec(&self) -> crate::policy::live::OverrideSpec {
        crate::policy::live::OverrideSpec {
            at: self.target.at(&self.rule),
            threshold: self.threshold.clone(),
            burst: self.burst.clone(),
            ban_threshold: self.ban_threshold.clone(),
            elastic: self.elastic.clone(),
        }
    }
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

/// Writes the completion script of `shell` for the `ratelimit` command (`ratelimit completions
/// SHELL`).
pub fn write_completions(shell: clap_complete::Shell, out: &mut dyn io::Write) -> io::Result<()> {
    // Without the hidden commands: bash's generator would offer them.
    let full = Cli::command();
    let mut cmd = clap::Command::new("ratelimit")
        .version(env!("CARGO_PKG_VERSION"))
        .args(full.get_arguments().cloned())
        .subcommands(full.get_subcommands().filter(|s| !s.is_hide_set()).cloned());
    // Into a buffer first: `generate` panics when the writer fails (e.g. a closed pipe).
    let mut buf = Vec::new();
    clap_complete::generate(shell, &mut cmd, "ratelimit", &mut buf);
    out.write_all(&buf)
}

/// Writes the `ratelimit(8)` man page (`ratelimit manpage`).
///
/// One page for the whole tool, as for ip(8) or nft(8): the synopsis and global options come
/// from the clap definitions, then a COMMANDS section with one subsection per command
/// (`ratelimit run`, `ratelimit ban add`, ...), each with its synopsis, description and options
/// (also from the clap definitions, so the page cannot drift from `--help`), then the files,
/// signals, exit status and environment an operator needs. Hidden commands are left out.
pub fn write_manpage(out: &mut dyn io::Write) -> io::Result<()> {
    let mut cmd = Cli::command();
    cmd.build();
    let version = cmd.get_version().unwrap_or_default().to_owned();
    let man = Man::new(cmd.clone())
        .title("RATELIMIT")
        .section("8")
        .date(man_date())
        .source(format!("ratelimit {version}"))
        .manual("System Administration");

    let mut page = Roff::new().render(); // the preamble, once
    page += &piece(|w| man.render_title(w))?;
    page += &piece(|w| man.render_name_section(w))?;
    page += &piece(|w| man.render_synopsis_section(w))?;
    page += &roff(description());
    page += &piece(|w| man.render_options_section(w))?;

    let mut commands = Roff::new();
    commands.control("SH", ["COMMANDS"]);
    commands.text([roman(
        "Every command accepts the global options above. The client commands talk to the \
         running daemon over its root-only control socket; check-config and detach work \
         without a daemon.",
    )]);
    page += &roff(commands);
    let globals: Vec<clap::Id> = cmd
        .get_arguments()
        .filter(|a| a.is_global_set())
        .map(|a| a.get_id().clone())
        .collect();
    command_sections(&mut page, &cmd, &globals)?;

    page += &roff(trailer());
    page += &piece(|w| man.render_version_section(w))?;
    out.write_all(page.as_bytes())
}

/// The page's date, `YYYY-MM-DD`: `SOURCE_DATE_EPOCH` (reproducible builds) if set, else today.
fn man_date() -> String {
    let when = std::env::var("SOURCE_DATE_EPOCH")
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok())
        .map_or_else(std::time::SystemTime::now, |secs| {
            std::time::UNIX_EPOCH + std::time::Duration::from_secs(secs)
        });
    humantime::format_rfc3339_seconds(when).to_string()[..10].to_owned()
}

/// One subsection per visible command, depth first, without the global options (described
/// once at the top) and `--help`.
fn command_sections(
    page: &mut String,
    cmd: &clap::Command,
    globals: &[clap::Id],
) -> io::Result<()> {
    for sub in cmd
        .get_subcommands()
        .filter(|s| !s.is_hide_set() && s.get_name() != "help")
    {
        let mut sub = sub.clone();
        let hidden: Vec<clap::Id> = sub
            .get_arguments()
            .map(|a| a.get_id().clone())
            .filter(|id| id == "help" || globals.contains(id))
            .collect();
        for id in hidden {
            sub = sub.mut_arg(id, |a| a.hide(true));
        }
        let name = sub
            .get_bin_name()
            .map_or_else(|| format!("ratelimit {}", sub.get_name()), str::to_owned);
        let mut head = Roff::new();
        head.control("SS", [name.as_str()]);
        *page += &roff(head);
        let man = Man::new(sub.clone());
        *page += &without_headings(&piece(|w| man.render_synopsis_section(w))?);
        *page += ".PP\n";
        *page += &without_headings(&piece(|w| man.render_description_section(w))?);
        if sub.get_arguments().any(|a| !a.is_hide_set()) {
            *page += &without_headings(&piece(|w| man.render_options_section(w))?);
        }
        command_sections(page, &sub, globals)?;
    }
    Ok(())
}

/// Rendered roff of one part of the page, without the preamble `roff` starts each render with.
fn piece(render: impl FnOnce(&mut Vec<u8>) -> io::Result<()>) -> io::Result<String> {
    let mut buf = Vec::new();
    render(&mut buf)?;
    let text = String::from_utf8(buf).map_err(io::Error::other)?;
    let preamble = Roff::new().render();
    Ok(match text.strip_prefix(preamble.as_str()) {
        Some(rest) => rest.to_owned(),
        None => text,
    })
}

fn roff(r: Roff) -> String {
    piece(|w| r.to_writer(w)).expect("writing to a Vec does not fail")
}

/// A section's body without its `.SH` heading (for a command's subsection).
fn without_headings(text: &str) -> String {
    text.lines()
        .filter(|l| !l.starts_with(".SH "))
        .flat_map(|l| [l, "\n"])
        .collect()
}

fn para(r: &mut Roff, text: &str) {
    r.control("PP", []);
    r.text([roman(text)]);
}

/// A tagged paragraph: `term` in bold, then `text`.
fn item(r: &mut Roff, term: &str, text: &str) {
    r.control("TP", []);
    r.text([bold(term)]);
    r.text([roman(text)]);
}

fn description() -> Roff {
    let mut r = Roff::new();
    r.control("SH", ["DESCRIPTION"]);
    r.text([roman(
        "ratelimit loads an XDP program onto the host's network interfaces. The program keeps \
         per-client counters in BPF maps and drops, throttles or bans clients that exceed the \
         thresholds of the configured rules before the kernel allocates a socket buffer. \
         Packets are checked in this order: allow list (pass), deny list (drop), active ban \
         (drop), then the rules in file order; the first rule whose verdict is drop drops the \
         packet.",
    )]);
    para(
        &mut r,
        "ratelimit run is the daemon: it loads and attaches the program, pushes rules, \
         thresholds, overrides and bans into its maps, keeps bans across restarts in the state \
         directory, writes events, and serves Prometheus metrics and read-only JSON reports \
         over HTTP. The maps and the program are pinned under the bpffs directory: if the \
         daemon stops or crashes the program keeps enforcing the last rules and bans, and a \
         restarted daemon adopts the pinned state without losing a ban or resetting a counter. \
         Only ratelimit detach removes the program.",
    );
    para(
        &mut r,
        "Durations are written like 500ms, 30s, 20m, 1h or 1d. Addresses are IPv4 or IPv6, \
         bare or in CIDR notation. Thresholds on the command line are COUNT/INTERVAL (2000/20m) \
         or BYTES/INTERVAL (10MiB/1s).",
    );
    r
}

fn trailer() -> Roff {
    let mut r = Roff::new();
    r.control("SH", ["CONFIGURATION"]);
    r.text([
        roman("The daemon reads a TOML file given with "),
        bold("--config"),
        roman(
            ": sections [daemon], [tracking], [lists], [geoip] and one [[rule]] table per \
               rule. Bad input of any kind is rejected with ",
        ),
        italic("file:line:col: message"),
        roman(
            " naming the field; a running daemon keeps its old config when a reload is \
             rejected. An annotated example listing every key with its default ships as \
             ratelimit.example.toml.",
        ),
    ]);

    r.control("SH", ["FILES"]);
    item(
        &mut r,
        "/etc/ratelimit/ratelimit.toml",
        "The config file used by the systemd unit.",
    );
    item(
        &mut r,
        config::DEFAULT_CONTROL_SOCKET,
        "Control socket (daemon.control_socket), mode 0600: the client commands must run as root.",
    );
    item(
        &mut r,
        "/var/lib/ratelimit/",
        "State directory (daemon.state_dir): bans (bans.json) and live changes (live.json: \
         rule set, override add) survive restarts here. The running daemon holds a lock \
         (flock) on it and on the bpffs directory: a second daemon given either exits with an \
         error naming the first, having changed nothing.",
    );
    item(
        &mut r,
        "/sys/fs/bpf/ratelimit/",
        "Pinned maps and links (daemon.bpffs_dir), on a bpffs.",
    );
    item(
        &mut r,
        "/var/log/ratelimit/events.jsonl",
        "Events (daemon.events), one JSON object a line: ban, unban, soft_limit, \
         throttle_start, throttle_end.",
    );

    r.control("SH", ["SIGNALS"]);
    item(
        &mut r,
        "SIGHUP",
        "Reopen the events file (after log rotation), then re-read the config file, as \
         ratelimit reload does: live changes (rule set, override add) are applied on top of \
         it again.",
    );
    item(
        &mut r,
        "SIGUSR1",
        "Reopen the events file only (what the logrotate script sends).",
    );
    item(
        &mut r,
        "SIGTERM, SIGINT",
        "Save the bans and stop. The XDP program stays attached and enforcing.",
    );

    r.control("SH", ["EXIT STATUS"]);
    r.text([roman(
        "0 on success; 1 on any error, including a config file that check-config rejects.",
    )]);

    r.control("SH", ["ENVIRONMENT"]);
    item(
        &mut r,
        "RUST_LOG",
        "Log filter for the messages written to standard error (default: info), e.g. \
         RUST_LOG=debug.",
    );

    r.control("SH", ["EXAMPLES"]);
    for (cmd, what) in [
        (
            "ratelimit check-config /etc/ratelimit/ratelimit.toml",
            "Validate a config file before installing it.",
        ),
        (
            "ratelimit run --config /etc/ratelimit/ratelimit.toml --preview",
            "Run without dropping anything: report what every rule and ban would drop.",
        ),
        (
            "ratelimit ban add 203.0.113.7 --for 1h --reason scanner",
            "Ban a client for an hour.",
        ),
        (
            "ratelimit rule set syn-per-client --threshold 3000/20m",
            "Raise a live rule's threshold without resetting its counters.",
        ),
        (
            "ratelimit override add syn-per-client 192.0.2.10 --threshold 20000/20m",
            "Let one client send ten times the rule's threshold; kept across restarts and \
             reloads until ratelimit override del syn-per-client 192.0.2.10.",
        ),
        (
            "ratelimit top -n 20 --by drops",
            "The twenty clients with the most drops now.",
        ),
        (
            "ratelimit detach",
            "Remove the XDP program and the pinned state from every interface.",
        ),
    ] {
        item(&mut r, cmd, what);
    }

    r.control("SH", ["SEE ALSO"]);
    r.text([roman(
        "systemctl(1), journalctl(1), bpftool(8), ip-link(8), nft(8)",
    )]);
    r
}
