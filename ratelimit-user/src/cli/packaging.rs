//! For packaging: the shell completion scripts and the `ratelimit(8)` man page, both from the
//! clap definitions.

use std::{io, process::ExitCode};

use clap::CommandFactory as _;
use clap_mangen::{
    Man,
    roff::{Roff, bold, italic, roman},
};

use super::Cli;
use crate::config;

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
        "0 on success; 1 on any error (a config file that check-config rejects, a daemon that \
         cannot be reached, a request the daemon refuses), with the reason on standard error; \
         2 for a usage error (an unknown command or option, a value that does not parse).",
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

/// The outcome of printing a completion script or the man page: a closed pipe (`| head`) is
/// not an error.
pub(super) fn print_generated(res: std::io::Result<()>) -> anyhow::Result<ExitCode> {
    match res {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e.into()),
        _ => Ok(ExitCode::SUCCESS),
    }
}
