//! `ratelimit`: the daemon (`ratelimit run`) and its command-line client.

use std::{
    io::Read as _,
    path::{Path, PathBuf},
    process::ExitCode,
};

use anyhow::Context as _;
use clap::Parser as _;

use ratelimit_user::{
    api::{Answer, BanSpec, Request},
    cli::{
        self, BanCommand, Cli, Command, FleetCommand, OverrideCommand, PressureCommand,
        RuleCommand, XdpModeArg,
    },
    config, daemon,
    kernel::datapath,
    policy::live,
    policy::report,
    serve,
};

fn main() -> ExitCode {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    match dispatch(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
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

fn dispatch(cli: Cli) -> anyhow::Result<ExitCode> {
    let req = match &cli.command {
        Command::Completions { shell } => {
            return print_generated(cli::write_completions(
                *shell,
                &mut std::io::stdout().lock(),
            ));
        }
        Command::Manpage => {
            return print_generated(cli::write_manpage(&mut std::io::stdout().lock()));
        }
        Command::Run(args) => {
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
            return Ok(ExitCode::SUCCESS);
        }
        Command::CheckConfig { file } => {
            return Ok(match config::load(file) {
                Ok(cfg) => match cfg
                    .fleet
                    .as_ref()
                    .map(ratelimit_user::fleet::check_files)
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
            });
        }
        Command::Detach(args) => {
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
            return Ok(ExitCode::SUCCESS);
        }
        Command::Status(_) => Request::Status,
        Command::Stats(_) => Request::Stats,
        Command::Top(t) => Request::Top {
            n: t.n,
            by: t.by.into(),
        },
        Command::Bans(_) => Request::Bans { limit: None },
        Command::Offenders(_) => Request::Offenders { limit: None },
        Command::Reload(_) => Request::Reload,
        Command::Ban {
            action:
                BanCommand::Add {
                    cidr,
                    duration,
                    reason,
                    file,
                    local,
                    ..
                },
        } => {
            // Bounded to 10 years by the shared check, so the milliseconds fit.
            let duration_ms = duration
                .as_deref()
                .map(|d| {
                    config::parse_ban_duration(d)
                        .map_err(|e| anyhow::anyhow!(config::labelled("--for", &e)))
                })
                .transpose()?
                .map(|d| d.as_millis() as u64);
            let cidrs = cidr_list(cidr.as_deref(), file.as_deref())?;
            Request::BanAdd {
                bans: cidrs
                    .into_iter()
                    .map(|c| BanSpec {
                        cidr: c,
                        duration_ms,
                        reason: reason.clone(),
                    })
                    .collect(),
                local: *local,
            }
        }
        Command::Ban {
            action:
                BanCommand::Del {
                    rule: Some(rule),
                    region,
                    ..
                },
        } => Request::BanLift {
            rule: rule.clone(),
            region: region.clone(),
        },
        Command::Ban {
            action: BanCommand::Del {
                cidr, file, local, ..
            },
        } => {
            if cidr.is_none() && file.is_none() {
                anyhow::bail!(
                    "give one CIDR, --file FILE, or --rule RULE to lift a rule's aggregate ban"
                );
            }
            Request::BanDel {
                cidrs: cidr_list(cidr.as_deref(), file.as_deref())?,
                local: *local,
            }
        }
        Command::Rule {
            action: RuleCommand::Set(set),
        } => Request::RuleSet {
            name: set.name.clone(),
            changes: set.changes(),
        },
        Command::Rule {
            action: RuleCommand::Reset { name, .. },
        } => Request::RuleReset { name: name.clone() },
        Command::Rules(_) => Request::Rules,
        Command::Override {
            action: OverrideCommand::Add(add),
        } => Request::OverrideAdd { spec: add.spec() },
        Command::Override {
            action: OverrideCommand::Del { rule, target, .. },
        } => Request::OverrideDel {
            at: target.at(rule),
        },
        Command::Overrides(_) => Request::Overrides,
        Command::Fleet {
            action: FleetCommand::Status(_) | FleetCommand::Peers(_),
        } => Request::Fleet,
        Command::Fleet {
            action: FleetCommand::Key(k),
        } => Request::FleetKey {
            addr: k.addr.clone(),
            rule: k.rule.clone(),
        },
        Command::Pressure(p) => match &p.action {
            None => Request::Pressure,
            Some(PressureCommand::Set { mode, .. }) => Request::PressureSet { mode: *mode },
        },
    };
    let json = match &cli.command {
        Command::Status(j)
        | Command::Stats(j)
        | Command::Bans(j)
        | Command::Offenders(j)
        | Command::Reload(j)
        | Command::Rules(j)
        | Command::Overrides(j) => j.json,
        Command::Top(t) => t.json,
        Command::Fleet {
            action: FleetCommand::Status(j) | FleetCommand::Peers(j),
        } => j.json,
        Command::Fleet {
            action: FleetCommand::Key(k),
        } => k.json,
        Command::Pressure(p) => match &p.action {
            None => p.json,
            Some(PressureCommand::Set { json, .. }) => p.json || *json,
        },
        Command::Ban {
            action: BanCommand::Add { json, .. } | BanCommand::Del { json, .. },
        } => *json,
        Command::Rule {
            action: RuleCommand::Set(s),
        } => s.json,
        Command::Rule {
            action: RuleCommand::Reset { json, .. },
        } => *json,
        Command::Override {
            action: OverrideCommand::Add(a),
        } => a.json,
        Command::Override {
            action: OverrideCommand::Del { json, .. },
        } => *json,
        _ => false,
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
            print_peers(f);
        }
        return Ok(ExitCode::SUCCESS);
    }
    if json {
        println!("{}", serde_json::to_string_pretty(&answer)?);
    } else {
        print_human(&answer)?;
    }
    Ok(ExitCode::SUCCESS)
}

/// The outcome of printing a completion script or the man page: a closed pipe (`| head`) is
/// not an error.
fn print_generated(res: std::io::Result<()>) -> anyhow::Result<ExitCode> {
    match res {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e.into()),
        _ => Ok(ExitCode::SUCCESS),
    }
}

/// One CIDR from the command line, or many from a file (`-` = stdin).
fn cidr_list(one: Option<&str>, file: Option<&Path>) -> anyhow::Result<Vec<String>> {
    match (one, file) {
        (Some(c), None) => Ok(vec![c.to_string()]),
        (None, Some(f)) => {
            let mut text = String::new();
            if f == Path::new("-") {
                std::io::stdin().read_to_string(&mut text)?;
            } else {
                text = std::fs::read_to_string(f)
                    .with_context(|| format!("reading {}", f.display()))?;
            }
            Ok(ratelimit_user::policy::bans::file_entries(&text))
        }
        _ => anyhow::bail!("give one CIDR or --file FILE"),
    }
}

fn print_human(answer: &Answer) -> anyhow::Result<()> {
    match answer {
        Answer::Status(status) => println!("{}", serde_json::to_string_pretty(status)?),
        Answer::Stats(stats) => print_stats(stats),
        Answer::Top(clients) | Answer::Offenders(clients) => print_clients(clients),
        Answer::Bans(bans) => print_bans(bans),
        Answer::BanAdd(a) => println!("added {} ban{}", a.added, plural(a.added)),
        Answer::BanDel(d) => {
            println!("removed {} ban{}", d.removed, plural(d.removed));
            if !d.not_found.is_empty() {
                println!("no ban at: {}", d.not_found.join(", "));
            }
            if !d.published_only.is_empty() {
                println!(
                    "no ban here at: {}; the unban was published to the fleet",
                    d.published_only.join(", ")
                );
            }
        }
        Answer::BanLift(l) => match &l.region {
            Some(cc) => println!("lifted the ban of rule {} in region {cc}", l.rule),
            None => println!("lifted the ban of rule {}", l.rule),
        },
        Answer::Overrides(entries) => print_overrides(entries),
        Answer::Rules(rules) => print_rules(rules),
        Answer::OverrideAdd(a) => {
            let replaced = match a.replaced {
                Some(live::Source::Config) => " (replaces the config's override while it exists)",
                Some(live::Source::Live) => " (replaces the earlier live override)",
                None => "",
            };
            println!(
                "rule {}: override for {} set to {}{replaced}",
                a.added.at.rule,
                target_label(&a.added.at),
                a.added.threshold
            );
        }
        Answer::OverrideDel(d) => {
            let now = match &d.restored {
                Some(c) => format!("the config's override applies again: {}", c.threshold),
                None => "the rule's own threshold applies".into(),
            };
            println!(
                "rule {}: live override for {} removed; {now}",
                d.removed.at.rule,
                target_label(&d.removed.at)
            );
        }
        Answer::RuleSet(c) | Answer::RuleReset(c) => match &c.live {
            Some(l) => println!("rule {}: live changes now {}", c.rule, l.describe()),
            None => println!("rule {}: the config's values apply", c.rule),
        },
        Answer::Pressure(p) | Answer::PressureSet(p) => print_pressure(p),
        Answer::Fleet(f) => print_fleet(f),
        Answer::FleetKey(k) => print!("{}", ratelimit_user::fleet::key::render_key(k)),
        Answer::Reload(r) => {
            println!("reloaded {}: rules {}", r.reloaded, r.rules.join(", "));
            for d in &r.live_changes_dropped {
                println!("live change dropped: {d}");
            }
        }
    }
    Ok(())
}

fn print_peers(f: &ratelimit_user::fleet::Report) {
    if f.peers.is_empty() {
        println!("no peers read from the store yet");
        return;
    }
    println!(
        "{:<24} {:<10} {:<26} {:>9} {:>12} {:>10} {:>10}  CURSOR",
        "HOST", "VERSION", "LAST SEEN", "AGE", "CLOCK OFFSET", "PUBLISHED", "RECEIVED"
    );
    for p in &f.peers {
        let name = format!(
            "{}{}",
            p.host_id,
            if p.this_host { " (this host)" } else { "" }
        );
        let age = format!("{:.1}s", p.age_ms as f64 / 1e3);
        let offset = p
            .clock_offset_ms
            .map_or("-".into(), |ms| format!("{ms:+.1}ms"));
        println!(
            "{:<24} {:<10} {:<26} {:>9} {:>12} {:>10} {:>10}  {}{}",
            name,
            p.version,
            p.last_seen,
            age,
            offset,
            p.bans_published,
            p.bans_received,
            p.cursor.as_deref().unwrap_or("-"),
            if p.stale { "  STALE" } else { "" }
        );
    }
    let more = f.peers_total.saturating_sub(f.peers.len() as u64);
    if more > 0 {
        println!(
            "... and {more} more peers in the store, not shown (at most {} are kept: this host \
             and the most recently seen)",
            ratelimit_user::fleet::peers::PEERS_MAX
        );
    }
}

fn print_fleet(f: &ratelimit_user::fleet::Report) {
    let state = match (&f.connected_since, &f.degraded_since) {
        _ if !f.share_bans => "not contacted: share_bans = false".to_string(),
        (Some(since), _) if f.connected => format!("connected since {since}"),
        (_, Some(since)) => format!(
            "DEGRADED since {since}: enforcing locally ({})",
            f.last_error.as_deref().unwrap_or("unreachable")
        ),
        _ => "connecting".to_string(),
    };
    let opt = |v: &Option<String>| v.clone().unwrap_or_else(|| "-".into());
    println!("store      {} ({state})", f.store);
    println!(
        "host_id    {}{}",
        f.host_id,
        if f.share_bans {
            ""
        } else {
            " (share_bans = false)"
        }
    );
    println!(
        "fleet      {} (authenticated: {}{})",
        f.fleet_name,
        f.authenticated,
        if f.authenticated {
            ""
        } else {
            "; no fleet.key_file: the store is trusted"
        }
    );
    if !f.records_rejected.is_empty() || !f.counts_rejected.is_empty() || f.bans_clamped > 0 {
        let list = |m: &std::collections::BTreeMap<String, u64>| {
            if m.is_empty() {
                "none".to_string()
            } else {
                m.iter()
                    .map(|(k, v)| format!("{v} {k}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            }
        };
        println!(
            "rejected   records: {}; counts: {}; {} bans clamped to fleet.remote_ban_max_duration",
            list(&f.records_rejected),
            list(&f.counts_rejected),
            f.bans_clamped
        );
    }
    println!("cursor     {}", opt(&f.cursor));
    println!(
        "lag        {}",
        f.lag_ms.map_or("-".into(), |ms| format!("{ms} ms"))
    );
    println!(
        "outbox     {} waiting{}",
        f.outbox,
        if f.outbox_dropped > 0 {
            format!(" ({} dropped: the outbox was full)", f.outbox_dropped)
        } else {
            String::new()
        }
    );
    println!(
        "sent       {} bans, {} unbans",
        f.bans_published, f.unbans_published
    );
    println!(
        "received   {} bans, {} unbans ({} skipped: expired, or held longer here); {} resyncs",
        f.bans_received, f.unbans_received, f.bans_skipped, f.resyncs
    );
    if let Some(ms) = f.store_rtt_ms {
        println!("store rtt  {ms:.2} ms (last)");
    }
    let c = &f.clock;
    let bound = format!("fleet.max_clock_skew {} ms", c.max_skew_ms);
    match c.offset_ms {
        None => println!(
            "clock      not measured yet: global counting waits ({}){}",
            bound,
            c.last_error
                .as_deref()
                .map_or(String::new(), |e| format!("; {e}"))
        ),
        Some(ms) => println!(
            "clock      {ms:+.1} ms against the store's (rtt {:.2} ms; {bound}){}",
            c.rtt_ms.unwrap_or(0.0),
            if c.over_bound {
                format!(
                    ": OVER THE BOUND since {}, global rules enforced locally",
                    c.over_since.as_deref().unwrap_or("-")
                )
            } else {
                ": within the bound".into()
            }
        ),
    }
    let d = &f.duplicate_id;
    if d.active {
        println!(
            "host id    DUPLICATE HOST ID since {}: another process (nonce {}) writes host id {}'s \
             heartbeat; global rules are enforced locally (this process's nonce {})",
            d.since.as_deref().unwrap_or("-"),
            d.other_nonce.as_deref().unwrap_or("-"),
            f.host_id,
            d.nonce
        );
    }
    if let Some(r) = &f.resync {
        println!(
            "resync     under way since {}: {} snapshot fields read in {} pages",
            r.since, r.fields, r.pages
        );
    }
    let stale = f.peers.iter().filter(|p| p.stale).count();
    let more = f.peers_total.saturating_sub(f.peers.len() as u64);
    println!(
        "peers      {} ({stale} stale{}; `ratelimit fleet peers`)",
        f.peers.len(),
        if more > 0 {
            format!("; {more} more in the store, not shown")
        } else {
            String::new()
        }
    );
    print!("{}", ratelimit_user::fleet::key::render_global(&f.global));
}

fn print_pressure(p: &ratelimit_user::policy::pressure::Report) {
    use ratelimit_user::policy::pressure::Mode;
    let how = match p.mode {
        Mode::Auto => "mode auto: from the signals".to_string(),
        m => format!(
            "mode {m}: forced (`ratelimit pressure set auto` returns it to the signals, which say {})",
            p.auto_level.name()
        ),
    };
    println!("level    {} ({how})", p.level.name());
    match p.data_plane {
        Some(ratelimit_user::policy::pressure::Level::Low) => println!(
            "data     low: rules and overrides with elastic = F admit up to F times their counts"
        ),
        Some(ratelimit_user::policy::pressure::Level::High) => {
            println!("data     high: rules and overrides with elastic are held to their thresholds")
        }
        None => println!("data     unknown (the map could not be read)"),
    }
    println!("since    {}", p.since);
    for r in &p.signals {
        let value = match r.value {
            Some(v) => format!("{v:.3}"),
            None => "-".into(),
        };
        let above = if r.above { "  ABOVE" } else { "" };
        println!(
            "signal   {:<26} {value:>10}  mark {}{above}",
            r.signal.name(),
            r.mark
        );
    }
    let cpus = if p.cpus.is_empty() {
        "every online CPU".to_string()
    } else {
        p.cpus
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(",")
    };
    println!("cpus     {cpus}");
    println!(
        "hold     {}s; last above: {}",
        p.hold_secs,
        p.last_above.as_deref().unwrap_or("never")
    );
    println!("changes  {}", p.transitions);
    if let Some(why) = &p.not_saved {
        println!("not saved: {why}");
    }
}

fn plural(n: usize) -> &'static str {
    if n == 1 { "" } else { "s" }
}

fn print_stats(stats: &report::Stats) {
    let row = |name: &str, c: report::Pb| {
        println!("{name:<22} {:>14} {:>16}", c.packets, c.bytes);
    };
    println!("{:<22} {:>14} {:>16}", "verdict", "packets", "bytes");
    for (verdict, c) in &stats.all.verdicts {
        row(verdict, *c);
    }
    row("total", stats.all.total);
    for r in &stats.rules {
        println!(
            "rule {:<17} matched {:>10}  admitted {:>10}  dropped {:>10}  would_drop {:>8}  bans {:>6}",
            r.name,
            r.get("matched").packets,
            r.get("admitted").packets,
            r.get("dropped").packets,
            r.get("would_drop").packets,
            r.get("bans").packets,
        );
    }
}

fn print_clients(clients: &[report::Client]) {
    println!(
        "{:<20} {:<8} {:<40} {:>10} {:>12} {:>8} {:>9} {:>9}",
        "rule", "key", "client", "packets", "bytes", "drops", "usage", "throttled"
    );
    for c in clients {
        println!(
            "{:<20} {:<8} {:<40} {:>10} {:>12} {:>8} {:>9} {:>9}",
            c.rule,
            c.key.as_str(),
            c.client,
            c.packets,
            c.bytes,
            c.drops,
            format!("{}/{}", c.usage, c.limit),
            c.throttled,
        );
    }
}

fn print_bans(bans: &[report::Ban]) {
    println!("{:<40} {:<20} {:<26} reason", "cidr", "rule", "expires");
    for b in bans {
        // Aggregate bans have no prefix: what they cover instead.
        let what = match (&b.cidr, b.key) {
            (Some(c), _) => c.clone(),
            (None, report::Key::Region) => {
                format!("(region {})", b.region.as_deref().unwrap_or("?"))
            }
            (None, k) => format!("({k})"),
        };
        let rule = match (&b.rule, b.manual, &b.origin) {
            (_, _, Some(host)) => format!("(fleet: {host})"),
            (Some(r), _, _) => r.clone(),
            (None, true, _) => "(manual)".into(),
            (None, false, _) => String::new(),
        };
        println!(
            "{:<40} {:<20} {:<26} {}",
            what,
            rule,
            b.expires.as_deref().unwrap_or("never"),
            b.reason.as_deref().unwrap_or(""),
        );
    }
}

fn print_overrides(entries: &[live::OverrideEntry]) {
    println!(
        "{:<20} {:<40} {:>14} {:>10} {:>14} {:>7}  source",
        "rule", "cidr/region", "threshold", "burst", "ban_threshold", "elastic"
    );
    for e in entries {
        let v = &e.values;
        let source = match (e.source, e.replaces_config) {
            (live::Source::Live, true) => "live (replaces the config's)",
            (live::Source::Live, false) => "live",
            (live::Source::Config, _) => "config",
        };
        println!(
            "{:<20} {:<40} {:>14} {:>10} {:>14} {:>7}  {source}",
            v.at.rule,
            target_label(&v.at),
            v.threshold,
            v.burst.as_deref().unwrap_or("-"),
            v.ban_threshold.as_deref().unwrap_or("-"),
            v.elastic
                .as_deref()
                .map_or_else(|| "-".to_string(), |e| format!("x{e}")),
        );
    }
}

fn print_rules(rules: &[live::RuleEntry]) {
    println!(
        "{:<20} {:<7} {:<15} {:<15} {:>14} {:>10} {:>7} {:>14} {:>9}  source",
        "rule", "key", "action", "algorithm", "threshold", "burst", "elastic", "now", "overrides"
    );
    for r in rules {
        let source = match &r.live {
            Some(c) => format!("live: {}", c.describe()),
            None => "config".into(),
        };
        println!(
            "{:<20} {:<7} {:<15} {:<15} {:>14} {:>10} {:>7} {:>14} {:>9}  {source}",
            r.name,
            r.key,
            r.action,
            r.algorithm,
            r.threshold,
            r.burst.map_or_else(|| "-".to_string(), |b| b.to_string()),
            r.elastic
                .map_or_else(|| "-".to_string(), |e| format!("x{e}")),
            r.threshold_now,
            r.overrides
        );
    }
}

fn target_label(at: &live::OverrideAt) -> String {
    match (&at.cidr, &at.region) {
        (Some(c), _) => c.clone(),
        (None, Some(r)) => format!("region {r}"),
        (None, None) => String::new(),
    }
}
