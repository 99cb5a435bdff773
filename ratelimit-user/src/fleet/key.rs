//! `fleet key ADDR`: one client's counts under each global rule, as this host holds them and
//! as the fleet's store holds them; and the text of `fleet status`'s global thresholds part.
//!
//! The store is read on the reports' side (never on the owner task), within
//! [`STORE_READ_TIMEOUT`], through [`crate::fleet::key_reads`]: one shared connection, a cache
//! and a rate bound, so that however many clients ask, the store sees a bounded load. When
//! the store cannot be read, the answer still has this host's part, with a note saying why;
//! when the rate bound leaves nothing to answer with, it says so (`busy`: HTTP 429).

use std::{
    collections::{BTreeMap, HashMap},
    fmt::Write as _,
    net::IpAddr,
    time::Duration,
};

use anyhow::bail;
use ratelimit_common::maps::{BAN_HELD_MARK, ClientKey, ClientState, KEY_IP, RuleConfig};
use serde::{Deserialize, Serialize};

use crate::{
    fleet::global::{self, GlobalReport, GlobalRule},
    kernel::clients::Meter,
};

/// How long the store's counts are waited for, connecting included.
pub const STORE_READ_TIMEOUT: Duration = Duration::from_secs(3);

/// The answer to `fleet key`.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Default)]
pub struct KeyReport {
    /// The address asked about.
    pub addr: String,
    /// This host's id in the fleet.
    pub host_id: String,
    /// One entry per global rule looked at (every global rule keyed `ip`, or the one named).
    pub rules: Vec<RuleKey>,
    /// The store was not read: the rate bound of `fleet key` was reached and no counts
    /// recent enough were cached (`/v1/fleet/key` answers 429). Why.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub busy: Option<String>,
}

/// One client's counts under one global rule.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Default)]
pub struct RuleKey {
    pub rule: String,
    /// The rule's id in the store (its name and a digest of how it counts).
    pub rid: String,
    /// The client's name in the store: the address masked to the rule's prefix.
    pub key: String,
    /// The store's bucket of the client.
    pub bucket: u64,
    pub threshold: u64,
    pub interval_ms: u64,
    /// A token bucket: its admissions are shared in windows of 10 s of the wall clock, and
    /// the other hosts' are taken out of its tokens (not added into its counts).
    #[serde(default)]
    pub token_bucket: bool,
    /// The window shown as the current one (`unix_ns / interval`): this host's state's, or
    /// the wall clock's when this host holds no state for the client.
    pub window: u64,
    /// This host's state for the client (its admitted counts include what other hosts
    /// counted, once synced); null when it holds none.
    pub local: Option<LocalState>,
    /// The fleet's admitted counts of `window` and the window before, from the store; null
    /// when the store could not be read.
    pub fleet: Option<Vec<WindowCounts>>,
    /// How old `fleet` is (ms): 0 when read for this answer, more when served from the cache.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fleet_age_ms: Option<u64>,
    /// Why part of the answer is missing.
    pub note: Option<String>,
}

/// This host's state for a client: the admitted meter, and the ban meter of a ban rule.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Default)]
pub struct LocalState {
    /// The admitted meter's window, and its counts in it and the window before.
    pub stamp: u64,
    pub cur: u64,
    pub prev: u64,
    /// The offered (ban) meter, for a rule that bans.
    pub ban: Option<BanMeter>,
}

#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Default)]
pub struct BanMeter {
    pub stamp: u64,
    pub seen_cur: u64,
    pub seen_prev: u64,
    /// The client is banned: the meter holds the ban, not counts.
    pub held: bool,
}

/// The fleet's count of a client in one window: the total and each host's own.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Default)]
pub struct WindowCounts {
    pub window: u64,
    /// The store's hash it was read from.
    pub hash: String,
    pub total: u64,
    /// Each host's own count, by host id.
    pub hosts: BTreeMap<String, u64>,
}

impl WindowCounts {
    /// The counts of client `name` among the fields of a hash (`<name>` the total,
    /// `<name>|<host>` each host's own).
    pub fn of(name: &str, window: u64, hash: String, fields: &HashMap<String, String>) -> Self {
        let num = |v: &String| v.trim().parse::<u64>().unwrap_or(0);
        let prefix = format!("{name}|");
        WindowCounts {
            window,
            hash,
            total: fields.get(name).map_or(0, num),
            hosts: fields
                .iter()
                .filter_map(|(f, v)| Some((f.strip_prefix(&prefix)?.to_string(), num(v))))
                .collect(),
        }
    }
}

/// A client under one global rule: where this host keeps its state, and its store names.
#[derive(Clone, Debug)]
pub struct Target {
    pub rule: GlobalRule,
    pub key: ClientKey,
    pub name: String,
    pub bucket: u64,
}

/// Keep the first `prefix_len` bits of `addr`.
fn mask(addr: &mut [u8; 16], prefix_len: u32) {
    let v = u128::from_be_bytes(*addr);
    let keep = match prefix_len {
        0 => 0,
        p if p >= 128 => u128::MAX,
        p => u128::MAX << (128 - p),
    };
    *addr = (v & keep).to_be_bytes();
}

/// The clients `addr` is under each global rule of `live_rules` keyed `ip` (or the one named
/// `rule`), masked to the rule's prefix as the program masks it.
pub fn targets(
    live_rules: &[(String, RuleConfig)],
    addr: &str,
    rule: Option<&str>,
) -> anyhow::Result<Vec<Target>> {
    let ip: IpAddr = addr.trim().parse().map_err(|_| {
        anyhow::anyhow!(
            "{addr:?} is not an IP address (give one address, such as 198.51.100.7 or 2001:db8::1)"
        )
    })?;
    let mut globals = GlobalRule::of(live_rules);
    globals.retain(|g| g.kind == KEY_IP);
    if globals.is_empty() {
        bail!("no global rule: no rule has scope = \"global\" and key = \"ip\"");
    }
    if let Some(name) = rule {
        globals.retain(|g| g.name == name);
        if globals.is_empty() {
            if live_rules.iter().any(|(n, _)| n == name) {
                bail!("rule {name} is not a global rule (scope = \"global\", key = \"ip\")");
            }
            bail!("no rule named {name}");
        }
    }
    Ok(globals
        .into_iter()
        .map(|g| {
            let cfg = &live_rules[g.index as usize].1;
            let (prefix_len, mut a) = match ip.to_canonical() {
                IpAddr::V4(v4) => (
                    ratelimit_common::addr::V4_MAPPED_PREFIX + u32::from(cfg.v4_prefix),
                    v4.to_ipv6_mapped().octets(),
                ),
                IpAddr::V6(v6) => (u32::from(cfg.v6_prefix), v6.octets()),
            };
            mask(&mut a, prefix_len);
            let name = global::key_name(&a, prefix_len);
            let bucket = global::bucket_of(&g.rid, &name);
            Target {
                key: ClientKey {
                    rule: g.index,
                    kind: KEY_IP,
                    proto: 0,
                    fields: 0,
                    prefix_len,
                    addr: a,
                    ..ClientKey::default()
                },
                name,
                bucket,
                rule: g,
            }
        })
        .collect())
}

impl Target {
    /// The entry of the answer with this host's part: `state` is this host's state for the
    /// client, if it holds one; `now_ns` the wall clock (unix ns).
    pub fn local(&self, state: Option<ClientState>, now_ns: u64) -> RuleKey {
        let g = &self.rule;
        let local = state.map(|st| LocalState {
            stamp: g.stamp_of(&st, Meter::Admitted),
            cur: g.own_counts(&st, Meter::Admitted).0,
            prev: g.own_counts(&st, Meter::Admitted).1,
            ban: (g.ban_interval_ns > 0).then_some(BanMeter {
                stamp: if st.ban_stamp == BAN_HELD_MARK {
                    0
                } else {
                    st.ban_stamp
                },
                seen_cur: st.seen_cur,
                seen_prev: st.seen_prev,
                held: st.ban_stamp == BAN_HELD_MARK,
            }),
        });
        let window = match &local {
            Some(l) => l.stamp,
            None => now_ns / g.admitted_window_ns().max(1),
        };
        RuleKey {
            rule: g.name.clone(),
            rid: g.rid.clone(),
            key: self.name.clone(),
            bucket: self.bucket,
            threshold: g.threshold,
            interval_ms: g.interval_ns / 1_000_000,
            token_bucket: g.burst.is_some(),
            window,
            local,
            fleet: None,
            fleet_age_ms: None,
            note: None,
        }
    }
}

/// The text of `fleet key`.
pub fn render_key(k: &KeyReport) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "address {} on host {}", k.addr, k.host_id);
    if let Some(why) = &k.busy {
        let _ = writeln!(s, "busy: {why}");
    }
    for r in &k.rules {
        let _ = writeln!(
            s,
            "rule {}: client {} ({} per {} ms; store bucket {})",
            r.rule, r.key, r.threshold, r.interval_ms, r.bucket
        );
        match &r.local {
            Some(l) if r.token_bucket => {
                let _ = writeln!(
                    s,
                    "  this host  window {} (10 s of the wall clock): {} admitted here (a token bucket: the other hosts' admissions are taken out of its tokens)",
                    l.stamp, l.cur
                );
            }
            Some(l) => {
                let _ = writeln!(
                    s,
                    "  this host  window {}: {} admitted, {} in the window before (other hosts' counts included)",
                    l.stamp, l.cur, l.prev
                );
                if let Some(b) = &l.ban {
                    if b.held {
                        let _ = writeln!(s, "  ban meter  holds a ban");
                    } else {
                        let _ = writeln!(
                            s,
                            "  ban meter  window {}: {} offered, {} in the window before",
                            b.stamp, b.seen_cur, b.seen_prev
                        );
                    }
                }
            }
            None => {
                let _ = writeln!(
                    s,
                    "  this host  no state for this client (window {} by the clock)",
                    r.window
                );
            }
        }
        if let Some(windows) = &r.fleet {
            for (i, w) in windows.iter().enumerate() {
                let hosts = w
                    .hosts
                    .iter()
                    .map(|(h, n)| format!("{h} {n}"))
                    .collect::<Vec<_>>()
                    .join(", ");
                let _ = writeln!(
                    s,
                    "  {:<9}  window {}: {} admitted{}",
                    if i == 0 { "fleet" } else { "" },
                    w.window,
                    w.total,
                    if hosts.is_empty() {
                        String::new()
                    } else {
                        format!(" ({hosts})")
                    }
                );
            }
        }
        if let Some(n) = &r.note {
            let _ = writeln!(s, "  note       {n}");
        }
    }
    s
}

/// The global thresholds part of `fleet status`.
pub fn render_global(g: &GlobalReport) -> String {
    let mut s = String::from("global thresholds\n");
    if g.rules.is_empty() {
        s.push_str("  rules        none (no rule has scope = \"global\")\n");
        return s;
    }
    let _ = writeln!(s, "  rules        {}", g.rules.join(", "));
    let _ = writeln!(
        s,
        "  synced keys  {}{}",
        g.synced_keys,
        if g.capped_keys > 0 {
            format!(
                " ({} more left to this host's count: at most {} are synced)",
                g.capped_keys,
                global::MAX_SYNCED_KEYS
            )
        } else {
            String::new()
        }
    );
    if g.shared_keys > 0 {
        let _ = writeln!(
            s,
            "  shared keys  {} (key = \"all\" / \"region\", every round)",
            g.shared_keys
        );
    }
    let _ = writeln!(
        s,
        "  rounds       {} ({} store calls, {} errors)",
        g.rounds, g.store_calls, g.store_errors
    );
    let _ = writeln!(
        s,
        "  added        {} (counts of other hosts added here)",
        g.added_total
    );
    let _ = writeln!(
        s,
        "  last round   {}",
        g.last_round_ms
            .map_or("-".into(), |ms| format!("{ms:.2} ms"))
    );
    let _ = writeln!(
        s,
        "  last error   {}",
        g.last_error.as_deref().unwrap_or("-")
    );
    s
}

/// One answer of `fleet key`, for tests of the wire format and the text.
#[cfg(test)]
pub(crate) fn sample() -> KeyReport {
    KeyReport {
        addr: "198.51.100.7".into(),
        host_id: "h0".into(),
        rules: vec![RuleKey {
            rule: "udp-global".into(),
            rid: "udp-global#0badcafe".into(),
            key: "198.51.100.0/24".into(),
            bucket: 5,
            threshold: 300,
            interval_ms: 3000,
            token_bucket: false,
            window: 588_000_000,
            local: Some(LocalState {
                stamp: 588_000_000,
                cur: 150,
                prev: 0,
                ban: Some(BanMeter {
                    stamp: 58_800_000,
                    seen_cur: 160,
                    seen_prev: 2,
                    held: false,
                }),
            }),
            fleet: Some(vec![
                WindowCounts {
                    window: 588_000_000,
                    hash: "ratelimit:{g5}:a:udp-global#0badcafe:588000000".into(),
                    total: 150,
                    hosts: [("h0".to_string(), 100), ("h1".to_string(), 50)].into(),
                },
                WindowCounts {
                    window: 587_999_999,
                    hash: "ratelimit:{g5}:a:udp-global#0badcafe:587999999".into(),
                    total: 0,
                    hosts: BTreeMap::new(),
                },
            ]),
            fleet_age_ms: None,
            note: Some("the store could not be read".into()),
        }],
        busy: None,
    }
}

#[cfg(test)]
mod tests {
    use ratelimit_common::maps::{ACTION_BAN, RULE_GLOBAL};

    use super::*;

    fn rule(global: bool, v4: u8, v6: u8) -> RuleConfig {
        let mut r = RuleConfig {
            key: KEY_IP,
            v4_prefix: v4,
            v6_prefix: v6,
            ..RuleConfig::default()
        };
        r.limit.interval_ns = 3_000_000_000;
        r.limit.threshold = 300;
        if global {
            r.flags |= RULE_GLOBAL;
        }
        r
    }

    #[test]
    fn an_address_is_masked_to_each_global_rule_s_prefix() {
        let rules = vec![
            ("local".to_string(), rule(false, 32, 128)),
            ("g24".to_string(), rule(true, 24, 64)),
            ("g32".to_string(), rule(true, 32, 128)),
        ];
        let t = targets(&rules, "198.51.100.7", None).unwrap();
        let names: Vec<_> = t
            .iter()
            .map(|t| (t.rule.name.as_str(), t.name.as_str()))
            .collect();
        assert_eq!(
            names,
            [("g24", "198.51.100.0/24"), ("g32", "198.51.100.7/32")]
        );
        assert_eq!(t[0].key.rule, 1);
        assert_eq!(t[0].key.prefix_len, 96 + 24);
        let v4: std::net::Ipv6Addr = "::ffff:198.51.100.0".parse().unwrap();
        assert_eq!(t[0].key.addr, v4.octets());
        assert_eq!(t[0].bucket, global::bucket_of(&t[0].rule.rid, &t[0].name));
        // The same client written as a mapped address, and one of IPv6.
        let m = targets(&rules, "::ffff:198.51.100.9", Some("g24")).unwrap();
        assert_eq!(m[0].name, "198.51.100.0/24");
        let v6 = targets(&rules, "2001:db8:1:2:3::4", Some("g24")).unwrap();
        assert_eq!(v6[0].name, "2001:db8:1:2::/64");
        assert_eq!(v6[0].key.prefix_len, 64);
    }

    #[test]
    fn fleet_key_errors_say_what_is_wrong() {
        let rules = vec![
            ("local".to_string(), rule(false, 32, 128)),
            ("g".to_string(), rule(true, 32, 128)),
        ];
        let e = |a: &str, r: Option<&str>| targets(&rules, a, r).unwrap_err().to_string();
        assert!(e("198.51.100", None).contains("is not an IP address"));
        assert!(e("198.51.100.0/24", None).contains("is not an IP address"));
        assert!(e("198.51.100.7", Some("local")).contains("not a global rule"));
        assert!(e("198.51.100.7", Some("nope")).contains("no rule named nope"));
        let none = targets(&rules[..1], "198.51.100.7", None).unwrap_err();
        assert!(none.to_string().contains("no global rule"), "{none}");
    }

    #[test]
    fn the_local_part_reads_both_meters() {
        let mut r = rule(true, 32, 128);
        r.action = ACTION_BAN;
        r.limit.ban_interval_ns = 1_000_000_000;
        r.limit.ban_threshold = 50;
        let t = targets(&[("b".into(), r)], "192.0.2.1", None).unwrap();
        let st = ClientState {
            stamp: 10,
            cur: 7,
            prev: 3,
            ban_stamp: 30,
            seen_cur: 9,
            seen_prev: 4,
            ..ClientState::default()
        };
        let k = t[0].local(Some(st), 0);
        assert_eq!(k.window, 10);
        let l = k.local.unwrap();
        assert_eq!((l.stamp, l.cur, l.prev), (10, 7, 3));
        let b = l.ban.unwrap();
        assert_eq!(
            (b.stamp, b.seen_cur, b.seen_prev, b.held),
            (30, 9, 4, false)
        );
        // No state here: the window is the wall clock's.
        let k = t[0].local(None, 31_500_000_000);
        assert_eq!((k.window, k.local), (10, None));
    }

    #[test]
    fn window_counts_keep_the_client_s_fields_only() {
        let fields: HashMap<String, String> = [
            ("198.51.100.7/32", "150"),
            ("198.51.100.7/32|h0", "100"),
            ("198.51.100.7/32|h1", "50"),
            ("198.51.100.70/32", "9"),
            ("198.51.100.70/32|h0", "9"),
        ]
        .into_iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect();
        let w = WindowCounts::of("198.51.100.7/32", 4, "h".into(), &fields);
        assert_eq!(w.total, 150);
        assert_eq!(
            w.hosts,
            BTreeMap::from([("h0".to_string(), 100), ("h1".to_string(), 50)])
        );
        let none = WindowCounts::of("203.0.113.1/32", 4, "h".into(), &fields);
        assert_eq!((none.total, none.hosts.len()), (0, 0));
    }

    #[test]
    fn fleet_key_text() {
        let text = render_key(&sample());
        for want in [
            "address 198.51.100.7 on host h0",
            "rule udp-global: client 198.51.100.0/24 (300 per 3000 ms; store bucket 5)",
            "  this host  window 588000000: 150 admitted, 0 in the window before",
            "  ban meter  window 58800000: 160 offered, 2 in the window before",
            "  fleet      window 588000000: 150 admitted (h0 100, h1 50)",
            "             window 587999999: 0 admitted",
            "  note       the store could not be read",
        ] {
            assert!(text.contains(want), "{want:?} missing from:\n{text}");
        }
        let mut k = sample();
        k.rules[0].local = None;
        k.rules[0].fleet = None;
        let text = render_key(&k);
        assert!(
            text.contains("no state for this client (window 588000000 by the clock)"),
            "{text}"
        );
        assert!(!text.contains("fleet "), "{text}");
    }

    #[test]
    fn global_status_text() {
        let g = GlobalReport {
            rules: vec!["udp-global".into(), "syn".into()],
            synced_keys: 12,
            shared_keys: 2,
            capped_keys: 3,
            rounds: 100,
            store_calls: 400,
            store_errors: 1,
            keys_published: 900,
            added_total: 5000,
            last_round_ms: Some(0.8),
            last_error: Some("connecting: refused".into()),
        };
        let text = render_global(&g);
        for want in [
            "global thresholds",
            "  rules        udp-global, syn",
            "  synced keys  12 (3 more left to this host's count: at most 100000 are synced)",
            "  shared keys  2 (key = \"all\" / \"region\", every round)",
            "  rounds       100 (400 store calls, 1 errors)",
            "  added        5000 (counts of other hosts added here)",
            "  last round   0.80 ms",
            "  last error   connecting: refused",
        ] {
            assert!(
                text.lines().any(|l| l == want),
                "{want:?} missing from:\n{text}"
            );
        }
        let none = render_global(&GlobalReport::default());
        assert!(
            none.contains("none (no rule has scope = \"global\")"),
            "{none}"
        );
    }
}
