//! Answers printed for people: each kind of answer in its form, and the tables of `stats`,
//! `top`, `offenders` and `bans`.

use super::{fleet, overrides, pressure, rule};
use crate::{
    api::Answer,
    policy::{live, report},
};

pub(super) fn print_human(answer: &Answer) -> anyhow::Result<()> {
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
        Answer::Overrides(entries) => overrides::print_overrides(entries),
        Answer::Rules(rules) => rule::print_rules(rules),
        Answer::OverrideAdd(a) => {
            let replaced = match a.replaced {
                Some(live::Source::Config) => " (replaces the config's override while it exists)",
                Some(live::Source::Live) => " (replaces the earlier live override)",
                None => "",
            };
            println!(
                "rule {}: override for {} set to {}{replaced}",
                a.added.at.rule,
                overrides::target_label(&a.added.at),
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
                overrides::target_label(&d.removed.at)
            );
        }
        Answer::RuleSet(c) | Answer::RuleReset(c) => match &c.live {
            Some(l) => println!("rule {}: live changes now {}", c.rule, l.describe()),
            None => println!("rule {}: the config's values apply", c.rule),
        },
        Answer::Pressure(p) | Answer::PressureSet(p) => pressure::print_pressure(p),
        Answer::Fleet(f) => fleet::print_fleet(f),
        Answer::FleetKey(k) => print!("{}", crate::fleet::key::render_key(k)),
        Answer::Reload(r) => {
            println!("reloaded {}: rules {}", r.reloaded, r.rules.join(", "));
            for d in &r.live_changes_dropped {
                println!("live change dropped: {d}");
            }
        }
    }
    Ok(())
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
