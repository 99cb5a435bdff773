//! `ratelimit fleet status|peers|key`: the fleet store, its peers, and one client's global
//! counts.

use clap::{Args, Subcommand};

use super::JsonArg;
use crate::api::Request;

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

/// The request of a `fleet` command, and whether to print JSON.
pub(super) fn request(action: &FleetCommand) -> (Request, bool) {
    match action {
        FleetCommand::Status(j) | FleetCommand::Peers(j) => (Request::Fleet, j.json),
        FleetCommand::Key(k) => (
            Request::FleetKey {
                addr: k.addr.clone(),
                rule: k.rule.clone(),
            },
            k.json,
        ),
    }
}

pub(super) fn print_peers(f: &crate::fleet::Report) {
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
            crate::fleet::peers::PEERS_MAX
        );
    }
}

pub(super) fn print_fleet(f: &crate::fleet::Report) {
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
    print!("{}", crate::fleet::key::render_global(&f.global));
}
