//! One answer of each kind, with every optional field set, for tests of the wire format.

use std::collections::BTreeMap;

use super::*;
use crate::{
    kernel::datapath::{Attached, Entry},
    policy::live::Source,
    policy::report::{Counters, IfaceCounters, Pb, RuleCounters},
};

pub fn status() -> Status {
    Status {
        version: "0.1.0".into(),
        pid: 4242,
        started: "2024-05-01T10:00:00.000Z".into(),
        config: Some("/etc/ratelimit/ratelimit.toml".into()),
        policy: "config".into(),
        adopted_pinned_state: true,
        bpffs_dir: "/sys/fs/bpf/ratelimit".into(),
        preview_all: false,
        interfaces: vec![Attached {
            iface: "eth0".into(),
            ifindex: 2,
            mode: "native".into(),
            slot: 1,
            entry: Entry::Ethernet,
        }],
        program: Some(crate::api::status::Program {
            xlated_insns: 9000,
            verified_insns: 120_000,
        }),
        rules: vec!["syn-per-client".into()],
        thresholds: vec![crate::api::status::RuleThreshold {
            rule: "syn-per-client".into(),
            threshold: "2000/20m".into(),
            elastic: Some(1.5),
            threshold_now: "3000/20m".into(),
        }],
        tracked_clients: 12,
        max_sources: 1 << 20,
        admission: crate::api::status::Admission {
            new_sources_per_sec: 17_477,
            new_sources_burst: 17_477,
            auto: true,
        },
        active_bans: 3,
        known_filter: Some(crate::kernel::known::Rebuilt {
            states: 12,
            bits_set: 10,
            bits: 1 << 16,
            secs: 0.25,
            half: 1,
        }),
        events: crate::events::Status {
            sink: "stdout".into(),
            lines_per_sec: 1000,
            queued: 1,
            written: 2,
            suppressed: 3,
            lost: crate::events::Lost {
                ring_buffer: 4,
                queue: 5,
                write: 6,
            },
        },
        tasks: BTreeMap::from([(
            "events".to_string(),
            crate::supervise::TaskHealth {
                up: false,
                restarts: 2,
                last_error: Some("boom".into()),
                last_failure: Some("2024-05-01T10:00:01.000Z".into()),
                restarts_at: Some("2024-05-01T10:00:03.000Z".into()),
            },
        )]),
        bans_restore: crate::policy::bans::RestoreReport {
            file: "/var/lib/ratelimit/bans.json".into(),
            restored: 1,
            failed: 1,
            failures: vec!["198.51.100.0/33: bad prefix".into()],
            set_aside: Some("bans.json.bad".into()),
            ..Default::default()
        },
        pressure: pressure(),
        live_changes: crate::policy::live::Report {
            file: "/var/lib/ratelimit/live.json".into(),
            rules_changed: 1,
            drops: vec!["rule \"gone\": no such rule".into()],
            dropped: 1,
            kept_copy: Some("live.json.kept".into()),
            ..Default::default()
        },
    }
}

pub fn pressure() -> crate::policy::pressure::Report {
    use crate::policy::pressure::{Level, Mode, Reading, Signal};
    crate::policy::pressure::Report {
        level: Level::High,
        mode: Mode::High,
        auto_level: Level::Low,
        since: "2024-05-01T10:00:00.000Z".into(),
        last_above: Some("2024-05-01T09:59:00.000Z".into()),
        hold_secs: 10.0,
        cpus: vec![0, 1],
        signals: vec![
            Reading {
                signal: Signal::CpuBusy,
                value: Some(0.25),
                mark: 0.8,
                above: false,
            },
            Reading {
                signal: Signal::ListenOverflowsPerSec,
                value: None,
                mark: 1.0,
                above: false,
            },
        ],
        transitions: 3,
        not_saved: Some(
            "writing /var/lib/ratelimit/.pressure.json.tmp: No space left on device".into(),
        ),
        data_plane: Some(Level::High),
    }
}

pub fn stats() -> Stats {
    let named = |names: &[&str]| -> BTreeMap<String, Pb> {
        names
            .iter()
            .enumerate()
            .map(|(i, n)| {
                let i = i as u64 + 1;
                (
                    n.to_string(),
                    Pb {
                        packets: i,
                        bytes: 60 * i,
                    },
                )
            })
            .collect()
    };
    let counters = Counters {
        total: Pb {
            packets: 3,
            bytes: 180,
        },
        verdicts: named(&["pass", "drop"]),
        reasons: named(&["allow_list", "state_evicted"]),
    };
    Stats {
        all: counters.clone(),
        interfaces: vec![IfaceCounters {
            iface: "eth0".into(),
            slot: 1,
            counters: counters.clone(),
        }],
        // Not on the wire (`/metrics` only).
        unlisted: Counters::default(),
        rules: vec![RuleCounters {
            name: "syn-per-client".into(),
            counters: named(&["matched", "dropped"]),
        }],
    }
}

pub fn client(i: u64) -> Client {
    Client {
        rule: "syn-per-client".into(),
        key: Key::Ip,
        client: format!("198.51.100.{i}/32"),
        packets: 100 + i,
        bytes: 6000 + i,
        drops: i,
        usage: 50,
        limit: 100,
        admitted_per_sec: 2.5,
        offered_per_sec: Some(7.25),
        throttled: i.is_multiple_of(2),
        above_soft_limit: true,
        last_seen: "2024-05-01T10:00:00.000Z".into(),
    }
}

pub fn bans() -> Vec<Ban> {
    vec![
        Ban {
            cidr: Some("198.51.100.0/24".into()),
            key: Key::Ip,
            region: None,
            // Not on the wire (for saving only).
            expires_ns: None,
            rule: None,
            manual: true,
            preview: false,
            since: "2024-05-01T10:00:00.000Z".into(),
            expires: Some("2024-05-01T11:00:00.000Z".into()),
            remaining_secs: Some(3599.5),
            reason: Some("scanner".into()),
            origin: Some("edge-fra-07".into()),
        },
        Ban {
            cidr: None,
            key: Key::Region,
            region: Some("NL".into()),
            expires_ns: None,
            rule: Some("per-region".into()),
            manual: false,
            preview: true,
            since: "2024-05-01T10:00:00.000Z".into(),
            expires: None,
            remaining_secs: None,
            reason: None,
            origin: None,
        },
    ]
}

fn spec(cidr: Option<&str>, region: Option<&str>) -> OverrideSpec {
    OverrideSpec {
        at: OverrideAt {
            rule: "syn-per-client".into(),
            cidr: cidr.map(Into::into),
            region: region.map(Into::into),
        },
        threshold: "5000/20m".into(),
        burst: Some("100".into()),
        ban_threshold: Some("9000/20m".into()),
        elastic: Some("1.5".into()),
    }
}

fn changes() -> RuleChanges {
    RuleChanges {
        threshold: Some("3000/20m".into()),
        ban_threshold: Some("6000/20m".into()),
        ban_duration: Some("1h".into()),
        burst: Some(10),
        exceed_action: Some("pass".into()),
        preview: Some(true),
        soft_limit: Some(0.5),
        elastic: Some(2.0),
    }
}

/// Every request, each with an answer to it.
pub fn exchanges() -> Vec<(Request, Answer)> {
    let changed = RuleChanged {
        rule: "syn-per-client".into(),
        index: 0,
        live: Some(changes()),
    };
    vec![
        (Request::Status, Answer::Status(Box::new(status()))),
        (Request::Stats, Answer::Stats(Box::new(stats()))),
        (
            Request::Top {
                n: 2,
                by: TopBy::Drops,
            },
            Answer::Top(vec![client(1), client(2)]),
        ),
        (Request::Bans { limit: None }, Answer::Bans(bans())),
        (
            Request::Offenders { limit: Some(1) },
            Answer::Offenders(vec![client(3)]),
        ),
        (
            Request::BanAdd {
                bans: vec![BanSpec {
                    cidr: "198.51.100.0/24".into(),
                    duration_ms: Some(3_600_000),
                    reason: Some("scanner".into()),
                }],
                local: true,
            },
            Answer::BanAdd(BansAdded { added: 1 }),
        ),
        (
            Request::BanDel {
                cidrs: vec!["198.51.100.0/24".into(), "192.0.2.1".into()],
                local: false,
            },
            Answer::BanDel(BansRemoved {
                removed: 1,
                not_found: vec!["192.0.2.1/32".into()],
                published_only: vec!["192.0.2.2/32".into()],
            }),
        ),
        (
            Request::BanLift {
                rule: "per-region".into(),
                region: Some("nl".into()),
            },
            Answer::BanLift(BanLifted {
                lifted: 1,
                rule: "per-region".into(),
                key: Key::Region,
                region: Some("NL".into()),
            }),
        ),
        (
            Request::RuleSet {
                name: "syn-per-client".into(),
                changes: changes(),
            },
            Answer::RuleSet(changed.clone()),
        ),
        (
            Request::RuleReset {
                name: "syn-per-client".into(),
            },
            Answer::RuleReset(RuleChanged {
                live: None,
                ..changed
            }),
        ),
        (
            Request::Rules,
            Answer::Rules(vec![RuleEntry {
                name: "syn-per-client".into(),
                matcher:
                    r#"{ protocol = "tcp", tcp_flags = "syn,!ack", dst_ports = ["80", "443"] }"#
                        .into(),
                except: vec!["192.0.2.53/32".into()],
                key: "ip".into(),
                action: "rate_based_ban".into(),
                algorithm: "sliding_window".into(),
                threshold: "3000/20m".into(),
                burst: Some(10),
                ban_threshold: Some("6000/20m".into()),
                ban_duration: Some("1h".into()),
                elastic: Some(2.0),
                threshold_now: "6000/20m".into(),
                exceed_action: "drop".into(),
                preview: false,
                soft_limit: 0.8,
                overrides: 2,
                source: Source::Live,
                live: Some(changes()),
            }]),
        ),
        (
            Request::OverrideAdd {
                spec: spec(Some("192.0.2.0/24"), None),
            },
            Answer::OverrideAdd(OverrideAdded {
                added: spec(Some("192.0.2.0/24"), None),
                replaced: Some(Source::Config),
            }),
        ),
        (
            Request::OverrideDel {
                at: spec(None, Some("NL")).at,
            },
            Answer::OverrideDel(OverrideRemoved {
                removed: spec(None, Some("NL")),
                restored: Some(spec(None, Some("NL"))),
            }),
        ),
        (
            Request::Overrides,
            Answer::Overrides(vec![OverrideEntry {
                values: spec(Some("192.0.2.0/24"), None),
                source: Source::Live,
                replaces_config: true,
            }]),
        ),
        (
            Request::Reload,
            Answer::Reload(Reloaded {
                reloaded: "/etc/ratelimit/ratelimit.toml".into(),
                rules: vec!["syn-per-client".into()],
                live_changes_dropped: vec!["rule \"gone\": no such rule".into()],
            }),
        ),
        (Request::Pressure, Answer::Pressure(Box::new(pressure()))),
        (
            Request::PressureSet {
                mode: crate::policy::pressure::Mode::High,
            },
            Answer::PressureSet(Box::new(pressure())),
        ),
        (
            Request::Fleet,
            Answer::Fleet(Box::new(crate::fleet::Report {
                store: "redis://10.1.0.5:6379".into(),
                host_id: "edge-fra-07".into(),
                share_bans: true,
                connected: false,
                connected_since: None,
                degraded_since: Some("2026-01-02T03:04:05.000Z".into()),
                last_error: Some("connecting to redis://10.1.0.5:6379: refused".into()),
                cursor: Some("1767323045000-0".into()),
                lag_ms: Some(3),
                outbox: 2,
                outbox_dropped: 0,
                bans_published: 10,
                unbans_published: 1,
                bans_received: 7,
                unbans_received: 0,
                bans_skipped: 1,
                resyncs: 1,
                store_rtt_ms: Some(0.25),
                peers: vec![crate::fleet::Peer {
                    host_id: "edge-fra-07".into(),
                    version: "0.1.0".into(),
                    last_seen: "2026-01-02T03:04:05.000Z".into(),
                    age_ms: 400,
                    stale: false,
                    this_host: true,
                    bans_published: 10,
                    bans_received: 7,
                    cursor: Some("1767323045000-0".into()),
                    clock_offset_ms: Some(-1.5),
                }],
                global: crate::fleet::global::GlobalReport {
                    rules: vec!["syn-per-client".into()],
                    synced_keys: 12,
                    shared_keys: 0,
                    capped_keys: 0,
                    rounds: 100,
                    store_calls: 400,
                    store_errors: 1,
                    keys_published: 900,
                    added_total: 5000,
                    last_round_ms: Some(0.8),
                    last_error: None,
                },
                clock: crate::fleet::ClockReport {
                    offset_ms: Some(-1.5),
                    rtt_ms: Some(0.2),
                    max_skew_ms: 250,
                    over_bound: false,
                    counting: true,
                    measured_at: Some("2026-01-02T03:04:05.000Z".into()),
                    over_since: None,
                    last_error: None,
                },
                fleet_name: "default".into(),
                authenticated: true,
                records_rejected: [("bad_mac".to_string(), 2)].into(),
                counts_rejected: Default::default(),
                bans_clamped: 1,
                peers_total: 1,
                resync: None,
                duplicate_id: crate::fleet::dup::DuplicateReport {
                    nonce: "0123456789abcdef".into(),
                    ..Default::default()
                },
            })),
        ),
        (
            Request::FleetKey {
                addr: "198.51.100.7".into(),
                rule: Some("udp-global".into()),
            },
            Answer::FleetKey(Box::new(crate::fleet::key::sample())),
        ),
    ]
}
