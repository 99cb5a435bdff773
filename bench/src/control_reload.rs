//! A reload with many per-CIDR overrides under traffic, with no misjudged packet.
//!
//! The daemon runs on the protected end of a veth pair with one rule (UDP to 9000, per source,
//! 1000 packets per second, sliding window) and `overrides` per-CIDR overrides, plus an allow
//! and a deny list. One lab sender sends, interleaved, at fixed rates:
//!
//! * four clients at 1500 pps, above the rule's threshold but under their overrides (3000 or
//!   more per second): they lose packets the moment their override is missing;
//! * two clients at 375 pps with no override, under the rule's threshold;
//! * a heavy client at 750 pps against an override of 100 (or 120) per second: it must keep
//!   being dropped;
//! * an allow-listed and a deny-listed client at 750 pps each.
//!
//! While the traffic flows the config changes and is reloaded several times (`ratelimit
//! reload`, every third time SIGHUP): the overrides' thresholds change, a band of the
//! overrides is replaced by new ones, one client's /32 override alternates with a /24 that
//! covers it, and the lists gain and lose unrelated entries. Afterwards every client is
//! judged by a receiver in the protected namespace (what arrived) and by the daemon (its
//! per-client state and per-rule counters).

use std::{
    net::{IpAddr, Ipv4Addr},
    time::{Duration, Instant},
};

use ratelimit_tests::scenario::{Scenario, rule_counter, verdict};
use serde_json::json;

const PORT: u16 = 9000;
/// Frames per second, all clients together.
const RATE: u64 = 9_000;
/// The rule's own threshold per second.
const RULE_THRESHOLD: u64 = 1_000;
/// Overrides that cover the traffic's clients (the four under-override clients and the heavy
/// one): the rest of the overrides are filler.
const TRAFFIC_OVERRIDES: u32 = 5;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Role {
    /// Above the rule's threshold, under its override's.
    UnderOverride,
    /// No override, under the rule's threshold.
    UnderRule,
    /// Far over its override.
    Heavy,
    Allowed,
    Denied,
}

impl Role {
    fn name(self) -> &'static str {
        match self {
            Role::UnderOverride => "under its override (above the rule)",
            Role::UnderRule => "under the rule",
            Role::Heavy => "over its override",
            Role::Allowed => "allow-listed",
            Role::Denied => "deny-listed",
        }
    }
}

struct Client {
    addr: Ipv4Addr,
    role: Role,
    /// Share of the interleaved stream, in slots of a 24-slot cycle.
    slots: u32,
}

fn clients() -> Vec<Client> {
    let c = |a: [u8; 4], role, slots| Client {
        addr: Ipv4Addr::from(a),
        role,
        slots,
    };
    vec![
        c([198, 18, 0, 10], Role::UnderOverride, 4),
        c([198, 18, 0, 11], Role::UnderOverride, 4),
        c([198, 18, 0, 12], Role::UnderOverride, 4),
        c([198, 18, 0, 13], Role::UnderOverride, 4),
        c([198, 19, 0, 10], Role::UnderRule, 1),
        c([198, 19, 0, 11], Role::UnderRule, 1),
        c([198, 18, 1, 1], Role::Heavy, 2),
        c([198, 18, 250, 1], Role::Allowed, 2),
        c([198, 18, 251, 7], Role::Denied, 2),
    ]
}

/// The heavy client's override threshold in config version `v`.
fn heavy_threshold(v: u32) -> u64 {
    if v.is_multiple_of(2) { 100 } else { 120 }
}

/// The policy (everything after `[daemon]`) of config version `v` with `n` overrides.
fn policy(v: u32, n: u32) -> String {
    let odd = !v.is_multiple_of(2);
    let mut allow = vec!["198.18.250.1/32"];
    let mut deny = vec!["198.18.251.0/24"];
    if odd {
        allow.push("198.18.252.0/24");
    } else {
        deny.push("203.0.113.0/24");
    }
    let list = |v: &[&str]| {
        v.iter()
            .map(|s| format!("\"{s}\""))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let mut p = format!(
        "[lists]\nallow = [{}]\ndeny = [{}]\n\n[[rule]]\nname = \"udp\"\nmatch = {{ protocol = \"udp\", dst_ports = [\"{PORT}\"] }}\nthreshold = {{ count = {RULE_THRESHOLD}, interval = \"1s\" }}\n",
        list(&allow),
        list(&deny)
    );
    let mut over = |cidr: String, count: u64| {
        p.push_str(&format!(
            "\n[[rule.override]]\ncidr = \"{cidr}\"\nthreshold = {{ count = {count}, interval = \"1s\" }}\n"
        ));
    };
    // The under-override clients: /32s of 3000 (even) or 4000 (odd) per second; in odd
    // versions the first one is covered by a /24 of 3500 instead of its own /32.
    let g = if odd { 4000 } else { 3000 };
    if odd {
        over("198.18.0.0/24".into(), 3500);
    } else {
        over("198.18.0.10/32".into(), g);
    }
    for d in 11..=13 {
        over(format!("198.18.0.{d}/32"), g);
    }
    over("198.18.1.1/32".into(), heavy_threshold(v));
    // Filler: /24s in 172.16.0.0/12; each version shifts the band by a tenth (that many
    // removed, that many added) and changes every threshold.
    let step = (n / 10).max(1);
    let count = 500 + 10 * u64::from(v % 5);
    for k in v * step..v * step + n.saturating_sub(TRAFFIC_OVERRIDES) {
        over(
            format!("{}/24", Ipv4Addr::from(0xac10_0000u32 + (k << 8))),
            count,
        );
    }
    p
}

/// One client's result.
#[derive(serde::Serialize)]
pub struct Row {
    client: String,
    role: &'static str,
    sent: u64,
    received: u64,
    /// The daemon's per-client state (none for listed clients, which never reach the rule).
    daemon_packets: Option<u64>,
    daemon_drops: Option<u64>,
    misjudged: u64,
}

pub struct Outcome {
    pub overrides: u32,
    /// `ratelimit reload` wall clock, ms.
    pub reload_ms: Vec<f64>,
    /// SIGHUP to "config reloaded" in the daemon's log, ms.
    pub sighup_ms: Vec<f64>,
    pub rows: Vec<Row>,
    pub misjudged: u64,
    pub heavy_allowance: u64,
    pub rule_dropped: u64,
    pub rule_matched: u64,
    pub traffic_secs: f64,
    pub ok: bool,
}

fn stat(v: &[f64], f: impl Fn(f64, f64) -> f64, init: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.iter().copied().fold(init, f)
}

impl Outcome {
    pub fn median_ms(&self) -> f64 {
        let mut v = self.reload_ms.clone();
        if v.is_empty() {
            return f64::NAN;
        }
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    }

    pub fn min_ms(&self) -> f64 {
        stat(&self.reload_ms, f64::min, f64::INFINITY)
    }

    pub fn max_ms(&self) -> f64 {
        stat(&self.reload_ms, f64::max, 0.0)
    }

    pub fn json(&self) -> serde_json::Value {
        json!({
            "overrides": self.overrides,
            "reload_ms": self.reload_ms,
            "reload_median_ms": self.median_ms(),
            "sighup_to_logged_ms": self.sighup_ms,
            "traffic_secs": self.traffic_secs,
            "rate_pps": RATE,
            "clients": self.rows,
            "rule_matched": self.rule_matched,
            "rule_dropped": self.rule_dropped,
            "heavy_allowance": self.heavy_allowance,
            "misjudged": self.misjudged,
            "ok": self.ok,
        })
    }

    pub fn markdown(&self) -> String {
        let mut md = format!(
            "Reload under traffic: {} per-CIDR overrides, {} reloads with `ratelimit reload` (median {:.1} ms, min {:.1}, max {:.1}) and {} with SIGHUP ({}) during {:.1} s of traffic at {RATE} pps; each reload changed every override's threshold, replaced a tenth of the overrides, swapped one client's /32 override for a covering /24 (or back) and changed the lists. **{} misjudged packets.**\n\n",
            self.overrides,
            self.reload_ms.len(),
            self.median_ms(),
            self.min_ms(),
            self.max_ms(),
            self.sighup_ms.len(),
            if self.sighup_ms.is_empty() {
                "none".to_string()
            } else {
                format!(
                    "signal to logged completion: {}",
                    self.sighup_ms
                        .iter()
                        .map(|m| format!("{m:.0} ms"))
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            },
            self.traffic_secs,
            self.misjudged
        );
        md.push_str("| client | judged as | sent | received | daemon: packets | daemon: drops | misjudged |\n|---|---|---:|---:|---:|---:|---:|\n");
        let opt = |v: Option<u64>| v.map_or("-".to_string(), |v| v.to_string());
        for r in &self.rows {
            md.push_str(&format!(
                "| {} | {} | {} | {} | {} | {} | {} |\n",
                r.client,
                r.role,
                r.sent,
                r.received,
                opt(r.daemon_packets),
                opt(r.daemon_drops),
                r.misjudged
            ));
        }
        md.push_str(&format!(
            "\nThe heavy client may be admitted at most {} packets (its override's highest threshold over the traffic's seconds, plus one interval); the rule dropped {} of {} matched packets, all of them the heavy client's.\n",
            self.heavy_allowance, self.rule_dropped, self.rule_matched
        ));
        md
    }
}

/// Packets of `slots` out of a cycle of `cycle` slots, when `sent` frames went out in order and
/// the client holds the slots at `positions`.
fn sent_of(sent: u64, cycle: &[usize], client: usize) -> u64 {
    let len = cycle.len() as u64;
    let per_cycle = cycle.iter().filter(|&&c| c == client).count() as u64;
    let rest = cycle[..(sent % len) as usize]
        .iter()
        .filter(|&&c| c == client)
        .count() as u64;
    sent / len * per_cycle + rest
}

/// Lines of the daemon's log that say a reload was applied.
fn reloads_logged(s: &Scenario) -> usize {
    s.daemon().logs().matches("config reloaded").count()
}

pub fn run(overrides: u32, reloads: u32, traffic: Duration, problems: &mut Vec<String>) -> Outcome {
    let problems_before = problems.len();
    let cl = clients();
    // The interleaved stream: client i holds `slots` of the cycle, spread out.
    let mut cycle: Vec<usize> = Vec::new();
    let most = cl.iter().map(|c| c.slots).max().unwrap_or(1);
    for round in 0..most {
        for (i, c) in cl.iter().enumerate() {
            if round < c.slots {
                cycle.push(i);
            }
        }
    }
    let mut s = Scenario::new("rlcr");
    s.start(&policy(0, overrides));
    let frames: Vec<Vec<u8>> = cl.iter().map(|c| s.udp4(c.addr, PORT)).collect();
    let sink = s.sink(PORT);
    let mut tx = s.sender();
    let cyc = cycle.clone();
    let sender = std::thread::spawn(move || {
        let frames = frames;
        tx.send_rate(
            |i| &frames[cyc[(i % cyc.len() as u64) as usize]],
            RATE,
            traffic,
        )
    });
    let start = Instant::now();
    // Reloads spread over the traffic, after a warm-up (the windows fill) and before a tail.
    let warm = Duration::from_millis(1500);
    std::thread::sleep(warm);
    let span = traffic.saturating_sub(warm * 2);
    let mut reload_ms = Vec::new();
    let mut sighup_ms = Vec::new();
    for r in 0..reloads {
        let due = warm + span * r / reloads.max(1);
        if let Some(wait) = due.checked_sub(start.elapsed()) {
            std::thread::sleep(wait);
        }
        let v = r + 1;
        let dir = s.daemon().config_dir().to_path_buf();
        let full = format!("{}{}", s.daemon_table(&dir), policy(v, overrides));
        s.daemon_mut().write_config(&full);
        if r % 3 == 2 {
            let before = reloads_logged(&s);
            let t = Instant::now();
            s.daemon().signal(libc::SIGHUP);
            loop {
                if reloads_logged(&s) > before {
                    sighup_ms.push(t.elapsed().as_secs_f64() * 1e3);
                    break;
                }
                if t.elapsed() > Duration::from_secs(10) {
                    problems.push(format!(
                        "reload {v} (SIGHUP) was not logged as applied within 10 s"
                    ));
                    break;
                }
                std::thread::sleep(Duration::from_millis(2));
            }
        } else {
            let out = super::timed_cli(
                s.daemon().socket_path(),
                &["reload"],
                Duration::from_secs(30),
            );
            if out.ok() {
                reload_ms.push(out.secs * 1e3);
            } else {
                problems.push(format!("reload {v} failed ({})", out.describe()));
            }
        }
    }
    let sent_total = sender.join().expect("sender").sent;
    let traffic_secs = start.elapsed().as_secs_f64();
    sink.wait_quiet(Duration::from_millis(300));
    let got = sink.stop();
    let st = s.stats();
    let top = s.daemon().cli_json(&["top", "-n", "100"]);
    let state_of = |a: Ipv4Addr| {
        let label = format!("{a}/32");
        top.as_array()
            .into_iter()
            .flatten()
            .find(|c| c["client"] == label.as_str())
            .map(|c| {
                (
                    c["packets"].as_u64().unwrap_or(0),
                    c["drops"].as_u64().unwrap_or(0),
                )
            })
    };
    if got.socket_drops != 0 {
        problems.push(format!(
            "the receiver's socket dropped {} datagrams: its counts are a lower bound",
            got.socket_drops
        ));
    }
    let max_heavy = (0..=reloads).map(heavy_threshold).max().unwrap_or(0);
    let heavy_allowance = (max_heavy as f64 * (traffic_secs + 1.0)).ceil() as u64;
    let mut rows = Vec::new();
    let mut misjudged = 0;
    let (mut heavy_drops, mut under_drops) = (0, 0);
    for (i, c) in cl.iter().enumerate() {
        let sent = sent_of(sent_total, &cycle, i);
        let received = got.from(IpAddr::V4(c.addr));
        let state = state_of(c.addr);
        let (dp, dd) = (state.map(|s| s.0), state.map(|s| s.1));
        let lost = sent.saturating_sub(received);
        let wrong = match c.role {
            Role::UnderOverride | Role::UnderRule => {
                under_drops += dd.unwrap_or(0);
                if dp != Some(sent) {
                    problems.push(format!(
                        "{}: the daemon counted {dp:?} packets of {sent} sent",
                        c.addr
                    ));
                }
                lost.max(dd.unwrap_or(0))
            }
            Role::Allowed => lost,
            Role::Denied => received,
            Role::Heavy => {
                heavy_drops = dd.unwrap_or(0);
                if received > heavy_allowance || dd.unwrap_or(0) + received != sent {
                    problems.push(format!(
                        "the heavy client {}: {received} of {sent} admitted (allowance {heavy_allowance}), daemon drops {dd:?}",
                        c.addr
                    ));
                }
                0
            }
        };
        if wrong > 0 {
            problems.push(format!(
                "{} ({}): {wrong} misjudged packets (sent {sent}, received {received}, daemon drops {dd:?})",
                c.addr,
                c.role.name()
            ));
        }
        misjudged += wrong;
        rows.push(Row {
            client: c.addr.to_string(),
            role: c.role.name(),
            sent,
            received,
            daemon_packets: dp,
            daemon_drops: dd,
            misjudged: wrong,
        });
    }
    let rule_dropped = rule_counter(&st, "udp", "dropped");
    let rule_matched = rule_counter(&st, "udp", "matched");
    let sent_of_role = |roles: &[Role]| -> u64 {
        cl.iter()
            .enumerate()
            .filter(|(_, c)| roles.contains(&c.role))
            .map(|(i, _)| sent_of(sent_total, &cycle, i))
            .sum()
    };
    let want_matched = sent_of_role(&[Role::UnderOverride, Role::UnderRule, Role::Heavy]);
    if rule_matched != want_matched || rule_dropped != heavy_drops + under_drops {
        problems.push(format!(
            "rule counters: matched {rule_matched} (want {want_matched}), dropped {rule_dropped} (heavy client {heavy_drops}, others {under_drops})"
        ));
    }
    // Drops the rule counted beyond the heavy client's are someone else's misjudged packets,
    // whether or not a client's state shows them.
    let unexplained = rule_dropped.saturating_sub(heavy_drops + under_drops);
    misjudged += unexplained;
    let (allow_sent, deny_sent) = (
        sent_of_role(&[Role::Allowed]),
        sent_of_role(&[Role::Denied]),
    );
    if verdict(&st, "pass_allow") < allow_sent || verdict(&st, "drop_deny") != deny_sent {
        problems.push(format!(
            "list verdicts: pass_allow {} (sent {allow_sent}), drop_deny {} (sent {deny_sent})",
            verdict(&st, "pass_allow"),
            verdict(&st, "drop_deny")
        ));
    }
    if reload_ms.len() + sighup_ms.len() != reloads as usize {
        problems.push(format!(
            "{} of {reloads} reloads applied",
            reload_ms.len() + sighup_ms.len()
        ));
    }
    println!(
        "  control: {reloads} reloads with {overrides} overrides under {sent_total} frames in {traffic_secs:.1}s: `ratelimit reload` {} ms, SIGHUP {} ms; misjudged {misjudged}; heavy client admitted {} of {} (allowance {heavy_allowance})",
        reload_ms
            .iter()
            .map(|m| format!("{m:.1}"))
            .collect::<Vec<_>>()
            .join("/"),
        sighup_ms
            .iter()
            .map(|m| format!("{m:.0}"))
            .collect::<Vec<_>>()
            .join("/"),
        rows.iter()
            .find(|r| r.role == Role::Heavy.name())
            .map_or(0, |r| r.received),
        rows.iter()
            .find(|r| r.role == Role::Heavy.name())
            .map_or(0, |r| r.sent),
    );
    let ok = misjudged == 0 && problems.len() == problems_before;
    drop(s);
    Outcome {
        overrides,
        reload_ms,
        sighup_ms,
        rows,
        misjudged,
        heavy_allowance,
        rule_dropped,
        rule_matched,
        traffic_secs,
        ok,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policies_have_the_asked_number_of_overrides_and_parse() {
        for v in 0..4 {
            let p = policy(v, 1000);
            assert_eq!(p.matches("[[rule.override]]").count(), 1000, "version {v}");
            let cfg = ratelimit_user::config::parse("r.toml", &p).expect("valid policy");
            assert_eq!(cfg.rules[0].overrides.len(), 1000);
        }
    }

    #[test]
    fn sent_counts_follow_the_cycle() {
        let cycle = [0, 1, 1, 2];
        assert_eq!(sent_of(0, &cycle, 1), 0);
        assert_eq!(sent_of(3, &cycle, 1), 2);
        assert_eq!(sent_of(10, &cycle, 1), 5);
        assert_eq!(sent_of(10, &cycle, 2), 2);
        assert_eq!((0..3).map(|c| sent_of(1001, &cycle, c)).sum::<u64>(), 1001);
    }
}
