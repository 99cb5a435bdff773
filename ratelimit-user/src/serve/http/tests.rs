use std::{
    collections::BTreeSet,
    net::SocketAddr,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use axum::http::Uri;
use ratelimit_common::stats::{global, rule};
use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    net::TcpListener,
};

use ratelimit_common::{
    caps::{MAX_IFACES, RETIRED_SLOT, UNLISTED_SLOT},
    stats::PER_IFACE,
};

use super::*;
use super::{
    listener::{Limits, serve_with},
    metrics::{NON_PACKET_REASONS, PACKET_REASONS},
    routes::{parse_key, parse_top},
};
use crate::{
    api::{Answer, Request},
    events,
    policy::report::{self, Pb, Stats},
};

fn pb(packets: u64, bytes: u64) -> Pb {
    Pb { packets, bytes }
}

/// Raw counters as `report::read_all` gives them: `[slot][index]`, all zero.
fn raw_slots() -> Vec<Vec<Pb>> {
    vec![vec![Pb::default(); PER_IFACE as usize]; MAX_IFACES as usize]
}

fn rule_index(rule: u32, counter: u32) -> usize {
    (global::COUNT + rule * rule::COUNT + counter) as usize
}

const IFACES: [(u32, &str); 2] = [(1, "eth0"), (2, "eth1")];

fn stats_of(slots: &[Vec<Pb>], rules: &[&str]) -> Stats {
    let ifaces: Vec<(u32, String)> = IFACES.iter().map(|&(s, n)| (s, n.into())).collect();
    let rules: Vec<String> = rules.iter().map(|r| r.to_string()).collect();
    report::stats_of(slots, &ifaces, &rules)
}

/// Two interfaces (eth0, eth1), a frame's worth of an unlisted one, the counts of an
/// interface gone (in the retired slot), and one rule.
fn synthetic() -> Stats {
    let mut s = raw_slots();
    s[1][global::PASS as usize] = pb(20, 2000);
    s[1][global::DROP_RULE as usize] = pb(7, 700);
    s[2][global::PASS as usize] = pb(10, 1000);
    s[UNLISTED_SLOT as usize][global::PASS as usize] = pb(4, 400);
    s[RETIRED_SLOT as usize][global::PASS as usize] = pb(100, 10_000);
    s[1][global::STATE_CREATED as usize] = pb(12, 0);
    s[1][global::STATE_EVICTED as usize] = pb(7, 0);
    s[1][global::BANS_ISSUED as usize] = pb(2, 0);
    s[1][global::ADMISSION_REFUSED as usize] = pb(4, 240);
    s[1][global::EVENTS_LOST as usize] = pb(1, 0);
    s[1][rule_index(0, rule::MATCHED)] = pb(9, 900);
    s[1][rule_index(0, rule::ADMITTED)] = pb(2, 200);
    s[1][rule_index(0, rule::DROPPED)] = pb(7, 700);
    s[1][rule_index(0, rule::BANS)] = pb(2, 0);
    stats_of(&s, &["syn-per-client"])
}

const GAUGES: Gauges = Gauges {
    active_bans: 3,
    tracked_clients: 5,
    tracked_clients_capacity: 20,
    known_filter: Some((16, 64)),
    events: events::Counts {
        queued: 6,
        written: 100,
        suppressed: 40,
        lost_queue: 2,
        lost_write: 3,
    },
    http: HttpCounts {
        open: 1,
        rejected: 9,
        header_timeouts: 4,
        request_timeouts: 5,
    },
    tasks: Vec::new(),
    saved_bans: [
        ("restored", 2),
        ("pinned", 0),
        ("expired", 1),
        ("rule_gone", 0),
        ("failed", 1),
    ],
    bans_files_set_aside: 1,
    remote_bans_spilled: 0,
    pressure_high: false,
    pressure_signals: Vec::new(),
    pressure_transitions: 0,
    fleet: None,
};

/// Fleet mode's families, only with `[fleet]`; the latency histogram's buckets are
/// cumulative, `+Inf` last, as Prometheus reads them.
#[test]
fn http_metrics_fleet_series() {
    let text = render_metrics(&synthetic(), &GAUGES);
    assert!(!text.contains("ratelimit_fleet_"), "{text}");
    let mut latency = crate::fleet::Latency::default();
    latency.observe(0.0002);
    latency.observe(0.003);
    latency.observe(2.0);
    let gauges = Gauges {
        fleet: Some(FleetGauges {
            connected: true,
            bans_published: 5,
            unbans_published: 1,
            bans_received: 7,
            unbans_received: 2,
            outbox: 3,
            resyncs: 1,
            peers: 2,
            peers_stale: 1,
            latency,
            global: crate::fleet::global::GlobalReport {
                rules: vec!["udp-global".into()],
                synced_keys: 4,
                shared_keys: 1,
                capped_keys: 2,
                rounds: 90,
                store_calls: 180,
                store_errors: 1,
                keys_published: 900,
                added_total: 5000,
                last_round_ms: Some(2.5),
                last_error: None,
            },
            clock_offset_seconds: Some(-5.0025),
            clock_over_bound: true,
            authenticated: true,
            records_rejected: [("bad_mac".to_string(), 3)].into(),
            counts_rejected: Default::default(),
            bans_clamped: 2,
            duplicate_id: true,
            peers_in_store: 200_002,
            key_reads: crate::fleet::key_reads::Stats {
                store_reads: 40,
                cache_hits: 900,
                busy: 7,
                errors: 1,
            },
        }),
        ..GAUGES
    };
    let text = render_metrics(&synthetic(), &gauges);
    let l = lines(&text);
    for want in [
        "# TYPE ratelimit_fleet_connected gauge",
        "ratelimit_fleet_connected 1",
        "ratelimit_fleet_authenticated 1",
        "ratelimit_fleet_records_rejected_total{reason=\"bad_mac\"} 3",
        "ratelimit_fleet_records_rejected_total{reason=\"too_wide\"} 0",
        "ratelimit_fleet_counts_rejected_total{reason=\"unauthenticated\"} 0",
        "ratelimit_fleet_bans_clamped_total 2",
        "# TYPE ratelimit_fleet_records_published counter",
        "ratelimit_fleet_records_published_total{op=\"ban\"} 5",
        "ratelimit_fleet_records_published_total{op=\"unban\"} 1",
        "ratelimit_fleet_records_received_total{op=\"ban\"} 7",
        "ratelimit_fleet_records_received_total{op=\"unban\"} 2",
        "ratelimit_fleet_outbox_records 3",
        "ratelimit_fleet_resyncs_total 1",
        "# TYPE ratelimit_fleet_peers gauge",
        "ratelimit_fleet_peers{state=\"fresh\"} 2",
        "ratelimit_fleet_peers{state=\"stale\"} 1",
        "# TYPE ratelimit_fleet_store_latency_seconds histogram",
        "ratelimit_fleet_store_latency_seconds_count 3",
        "ratelimit_fleet_store_latency_seconds_bucket{le=\"0.0005\"} 1",
        "ratelimit_fleet_store_latency_seconds_bucket{le=\"0.005\"} 2",
        "ratelimit_fleet_store_latency_seconds_bucket{le=\"1.0\"} 2",
        "ratelimit_fleet_store_latency_seconds_bucket{le=\"+Inf\"} 3",
        "# TYPE ratelimit_fleet_global_rules gauge",
        "ratelimit_fleet_global_rules 1",
        "ratelimit_fleet_global_synced_keys 4",
        "ratelimit_fleet_global_shared_keys 1",
        "ratelimit_fleet_global_capped_keys 2",
        "# TYPE ratelimit_fleet_global_rounds counter",
        "ratelimit_fleet_global_rounds_total 90",
        "ratelimit_fleet_global_store_calls_total 180",
        "ratelimit_fleet_global_keys_published_total 900",
        "ratelimit_fleet_global_store_errors_total 1",
        "ratelimit_fleet_global_added_total 5000",
        "# TYPE ratelimit_fleet_global_round_seconds gauge",
        "ratelimit_fleet_global_round_seconds 0.0025",
        "# TYPE ratelimit_fleet_clock_offset_seconds gauge",
        "ratelimit_fleet_clock_offset_seconds -5.0025",
        "# TYPE ratelimit_fleet_clock_skewed gauge",
        "ratelimit_fleet_clock_skewed 1",
        "# TYPE ratelimit_fleet_duplicate_id gauge",
        "ratelimit_fleet_duplicate_id 1",
        "ratelimit_fleet_peers_in_store 200002",
        "# TYPE ratelimit_fleet_key_store_reads counter",
        "ratelimit_fleet_key_store_reads_total 40",
        "ratelimit_fleet_key_cache_hits_total 900",
        "ratelimit_fleet_key_busy_total 7",
        "ratelimit_fleet_key_store_errors_total 1",
    ] {
        assert!(l.contains(&want), "{want} missing from:\n{text}");
    }
    // Before the first round: no duration.
    let mut idle = gauges.clone();
    if let Some(f) = idle.fleet.as_mut() {
        f.global = crate::fleet::global::GlobalReport::default();
        (f.clock_offset_seconds, f.clock_over_bound) = (None, false);
    }
    let text = render_metrics(&synthetic(), &idle);
    let l = lines(&text);
    assert!(l.contains(&"ratelimit_fleet_global_rules 0"), "{text}");
    // The clock not measured yet: no offset.
    assert!(l.contains(&"ratelimit_fleet_clock_skewed 0"), "{text}");
    assert!(
        !l.iter()
            .any(|l| l.starts_with("ratelimit_fleet_clock_offset_seconds")),
        "{text}"
    );
    assert!(
        !l.iter()
            .any(|l| l.starts_with("ratelimit_fleet_global_round_seconds")),
        "{text}"
    );
}

#[test]
fn http_fleet_key_query_parsing() {
    let key = |q: &str| {
        let uri: Uri = format!("/v1/fleet/key{q}").parse().unwrap();
        parse_key(&uri).map(|r| serde_json::to_value(r).unwrap())
    };
    assert_eq!(
        key("?addr=198.51.100.7"),
        Ok(serde_json::json!({"cmd": "fleet_key", "addr": "198.51.100.7"}))
    );
    assert_eq!(
        key("?addr=2001:db8::1&rule=udp-global"),
        Ok(serde_json::json!({"cmd": "fleet_key", "addr": "2001:db8::1", "rule": "udp-global"}))
    );
    for bad in ["", "?rule=r", "?addr=1.2.3.4&n=3"] {
        let e = key(bad).expect_err(bad);
        assert!(e.contains("expected /v1/fleet/key?addr=A&rule=R"), "{e}");
    }
}

fn lines(text: &str) -> Vec<&str> {
    text.lines().collect()
}

/// One sample of an exposition.
#[derive(Debug, Clone)]
struct Sample {
    /// The family's name (`# TYPE` line), and its type.
    family: String,
    kind: String,
    /// The sample's own name (`_total`, `_info` added).
    name: String,
    labels: Vec<(String, String)>,
    value: f64,
}

/// Every family of an exposition: (name, help lines, type lines), and every sample.
fn parse(text: &str) -> (Vec<(String, usize, usize)>, Vec<Sample>) {
    let mut families: Vec<(String, usize, usize)> = Vec::new();
    let mut samples = Vec::new();
    let mut kind = String::new();
    let family_of = |families: &mut Vec<(String, usize, usize)>, name: &str| {
        if families.last().is_none_or(|f| f.0 != name) {
            families.push((name.into(), 0, 0));
        }
        families.len() - 1
    };
    for line in text.lines() {
        if line == "# EOF" {
            continue;
        }
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, help) = rest.split_once(' ').expect(line);
            assert!(!help.trim().is_empty(), "empty help: {line}");
            let i = family_of(&mut families, name);
            families[i].1 += 1;
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, k) = rest.split_once(' ').expect(line);
            let i = family_of(&mut families, name);
            families[i].2 += 1;
            kind = k.into();
            continue;
        }
        assert!(!line.starts_with('#'), "unexpected line {line:?}");
        let (series, value) = line.rsplit_once(' ').expect(line);
        let (name, labels) = match series.split_once('{') {
            Some((name, rest)) => (name, parse_labels(rest.strip_suffix('}').expect(line))),
            None => (series, Vec::new()),
        };
        samples.push(Sample {
            family: families.last().expect("a sample after its TYPE").0.clone(),
            kind: kind.clone(),
            name: name.into(),
            labels,
            value: value.parse().expect(line),
        });
    }
    (families, samples)
}

/// `a="x",b="y\"z"` → [(a, x), (b, y"z)].
fn parse_labels(s: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut chars = s.chars().peekable();
    while chars.peek().is_some() {
        let name: String = chars.by_ref().take_while(|&c| c != '=').collect();
        assert_eq!(chars.next(), Some('"'), "{s}");
        let mut value = String::new();
        while let Some(c) = chars.next() {
            match c {
                '"' => break,
                '\\' => match chars.next() {
                    Some('n') => value.push('\n'),
                    Some(c) => value.push(c),
                    None => panic!("{s}"),
                },
                c => value.push(c),
            }
        }
        out.push((name, value));
        if chars.peek() == Some(&',') {
            chars.next();
        }
    }
    out
}

#[test]
fn http_metrics_render_exact_series() {
    let gauges = Gauges {
        tasks: vec![("ban_persistence", true, 0), ("events", false, 3)],
        pressure_high: true,
        pressure_signals: vec![
            ("cpu_busy", Some(0.5), 0.8),
            ("listen_overflows_per_sec", None, 1.0),
        ],
        pressure_transitions: 3,
        ..GAUGES
    };
    let text = render_metrics(&synthetic(), &gauges);
    let l = lines(&text);
    for want in [
        "# HELP ratelimit_packets Frames seen by the XDP program, by verdict and by the interface that received them: each frame has one verdict and one interface, so a sum counts every frame once. An empty interface label stands for the interfaces beyond the per-interface counter slots (from their first frame on). A detached interface's series ends with it",
        "# TYPE ratelimit_packets counter",
        "ratelimit_bytes_total{verdict=\"drop_rule\",interface=\"eth0\"} 700",
        "ratelimit_bytes_total{verdict=\"pass\",interface=\"\"} 400",
        "# TYPE ratelimit_reason_packets counter",
        "ratelimit_reason_packets_total{reason=\"admission_refused\"} 4",
        "ratelimit_reason_packets_total{reason=\"contended\"} 0",
        "ratelimit_rule_matched_packets_total{rule=\"syn-per-client\"} 9",
        "ratelimit_rule_matched_bytes_total{rule=\"syn-per-client\"} 900",
        "ratelimit_rule_packets_total{rule=\"syn-per-client\",outcome=\"admitted\"} 2",
        "ratelimit_rule_packets_total{rule=\"syn-per-client\",outcome=\"dropped\"} 7",
        "ratelimit_rule_packets_total{rule=\"syn-per-client\",outcome=\"would_drop\"} 0",
        "ratelimit_rule_bytes_total{rule=\"syn-per-client\",outcome=\"dropped\"} 700",
        "ratelimit_rule_bans_issued_total{rule=\"syn-per-client\"} 2",
        "# TYPE ratelimit_active_bans gauge",
        "ratelimit_active_bans 3",
        "# TYPE ratelimit_bans_issued counter",
        "ratelimit_bans_issued_total 2",
        "ratelimit_bans_expired_total 0",
        "ratelimit_bans_held_in_state_total 0",
        "ratelimit_ban_insert_failures_total 0",
        "ratelimit_client_states_created_total 12",
        "ratelimit_client_states_evicted_total 7",
        "ratelimit_tracked_clients 5",
        "ratelimit_tracked_clients_capacity 20",
        "ratelimit_map_fill_ratio{map=\"clients\"} 0.25",
        "ratelimit_map_fill_ratio{map=\"known_filter\"} 0.25",
        "ratelimit_events_lost_total{stage=\"ring_buffer\"} 1",
        "ratelimit_events_lost_total{stage=\"queue\"} 2",
        "ratelimit_events_lost_total{stage=\"write\"} 3",
        "ratelimit_events_suppressed_total 40",
        "ratelimit_events_written_total 100",
        "ratelimit_events_queued 6",
        "ratelimit_http_connections_open 1",
        "ratelimit_http_connections_rejected_total 9",
        "ratelimit_http_timeouts_total{phase=\"headers\"} 4",
        "ratelimit_http_timeouts_total{phase=\"request\"} 5",
        "ratelimit_saved_bans_total{outcome=\"restored\"} 2",
        "ratelimit_saved_bans_total{outcome=\"failed\"} 1",
        "ratelimit_bans_files_set_aside_total 1",
        "ratelimit_task_up{task=\"events\"} 0",
        "# TYPE ratelimit_pressure_high gauge",
        "ratelimit_pressure_high 1",
        "ratelimit_pressure_signal{signal=\"cpu_busy\"} 0.5",
        "ratelimit_pressure_mark{signal=\"cpu_busy\"} 0.8",
        "ratelimit_pressure_mark{signal=\"listen_overflows_per_sec\"} 1.0",
        "ratelimit_pressure_transitions_total 3",
        "ratelimit_task_restarts_total{task=\"events\"} 3",
        "ratelimit_up 1",
        "# TYPE ratelimit_build info",
        &format!(
            "ratelimit_build_info{{version=\"{}\"}} 1",
            env!("CARGO_PKG_VERSION")
        ),
    ] {
        assert!(l.contains(&want), "missing {want:?} in:\n{text}");
    }
    assert!(text.ends_with("\n# EOF\n"), "{text}");
    // Per interface in slot order, then the unlisted ones; verdicts sorted by name. No
    // "all", and nothing of the interface gone (the retired slot's 100).
    let packets: Vec<_> = l
        .iter()
        .filter(|s| s.starts_with("ratelimit_packets_total") && !s.ends_with(" 0"))
        .collect();
    assert_eq!(
        packets,
        [
            &"ratelimit_packets_total{verdict=\"drop_rule\",interface=\"eth0\"} 7",
            &"ratelimit_packets_total{verdict=\"pass\",interface=\"eth0\"} 20",
            &"ratelimit_packets_total{verdict=\"pass\",interface=\"eth1\"} 10",
            &"ratelimit_packets_total{verdict=\"pass\",interface=\"\"} 4",
        ]
    );
    let verdicts = global::VERDICTS as usize;
    assert_eq!(
        l.iter()
            .filter(|s| s.starts_with("ratelimit_packets_total"))
            .count(),
        3 * verdicts,
        "every verdict of eth0, eth1 and the unlisted interfaces"
    );
    // Without a frame of an unlisted interface, no series of them.
    let mut stats = synthetic();
    stats.unlisted = report::Counters::default();
    let text = render_metrics(&stats, &gauges);
    assert_eq!(
        text.lines()
            .filter(|s| s.starts_with("ratelimit_packets_total"))
            .count(),
        2 * verdicts,
        "{text}"
    );
    assert!(
        !text
            .lines()
            .any(|l| !l.starts_with('#') && l.contains("interface=\"\"")),
        "{text}"
    );
}

/// Prometheus' conventions, for every family: one HELP and one TYPE line, a counter's
/// samples end in `_total` (and only a counter's), an info's in `_info` with the value 1,
/// a `_ratio` is a gauge from 0 to 1, names and label names in snake case, and no series
/// twice.
#[test]
fn http_metrics_follow_prometheus_naming_conventions() {
    let gauges = Gauges {
        tasks: vec![("ban_persistence", true, 0), ("events", false, 3)],
        ..GAUGES
    };
    let text = render_metrics(&synthetic(), &gauges);
    let (families, samples) = parse(&text);
    let snake = |s: &str| {
        s.starts_with(|c: char| c.is_ascii_lowercase())
            && s.chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
            && !s.contains("__")
    };
    let mut names = BTreeSet::new();
    for (family, helps, types) in &families {
        assert!(names.insert(family), "{family} declared twice");
        assert_eq!((helps, types), (&1, &1), "{family}: HELP and TYPE lines");
        assert!(
            family.starts_with("ratelimit_") && snake(family),
            "{family}: not a snake-case name in the ratelimit_ namespace"
        );
        assert!(
            !family.ends_with("_total") && !family.ends_with("_info"),
            "{family}: the suffix belongs to the samples"
        );
    }
    let mut series = BTreeSet::new();
    for s in &samples {
        let want = match s.kind.as_str() {
            "counter" => format!("{}_total", s.family),
            "info" => format!("{}_info", s.family),
            "gauge" => s.family.clone(),
            k => panic!("{}: unexpected type {k}", s.family),
        };
        assert_eq!(s.name, want, "{s:?}");
        if s.kind == "gauge" {
            assert!(
                !s.name.ends_with("_total"),
                "a gauge named as a counter: {s:?}"
            );
        }
        if s.kind == "info" {
            assert_eq!(s.value, 1.0, "{s:?}");
        }
        if s.family.ends_with("_ratio") {
            assert_eq!(s.kind, "gauge", "{s:?}");
            assert!((0.0..=1.0).contains(&s.value), "{s:?}");
        }
        for (label, _) in &s.labels {
            assert!(snake(label), "{s:?}: label name {label}");
        }
        let mut labels = s.labels.clone();
        labels.sort();
        assert!(series.insert((s.name.clone(), labels)), "twice: {s:?}");
    }
    // Units in the names: what counts bytes says so, and only that.
    for s in &samples {
        let bytes = s.family.ends_with("_bytes");
        assert_eq!(
            bytes,
            [
                "ratelimit_bytes",
                "ratelimit_rule_matched_bytes",
                "ratelimit_rule_bytes"
            ]
            .contains(&s.family.as_str()),
            "{s:?}"
        );
    }
}

/// Whether some two or more of `parts` add up to `total`.
fn is_a_sum_of(total: f64, parts: &[f64]) -> Option<Vec<f64>> {
    let parts: Vec<f64> = parts.iter().copied().filter(|&p| p != 0.0).collect();
    assert!(
        parts.len() < 24,
        "too many series for the subset sums: {parts:?}"
    );
    (1u32..1 << parts.len())
        .filter(|m| m.count_ones() >= 2)
        .map(|m| {
            (0..parts.len())
                .filter(|i| m & 1 << i != 0)
                .map(|i| parts[i])
                .collect::<Vec<_>>()
        })
        .find(|subset| subset.iter().sum::<f64>() == total)
}

/// A sum over a family's labels never counts anything twice: no series is the sum of
/// others of its family that differ from it in one label (an `interface="all"` beside the
/// interfaces, a rule's `matched` beside its outcomes). The counters are written as the
/// program writes them (a frame in one verdict of its interface's slot, a rule's matched
/// packet in `matched` and in one outcome), and every series that could be a part of
/// another is a sum of powers of two no other series has, so no sum comes out equal by
/// chance.
#[test]
fn http_metrics_no_series_is_the_sum_of_others_of_its_family() {
    let mut s = raw_slots();
    let power = |n: u32| pb(1 << n, 100 << n);
    // The verdicts (whose series are split by interface), then the reasons (whose
    // series are each a sum over the interfaces): each its own pair of powers.
    for k in 0..global::COUNT {
        let j = if k < global::VERDICTS {
            k
        } else {
            k - global::VERDICTS
        };
        s[1][k as usize] = power(2 * j);
        s[2][k as usize] = power(2 * j + 1);
    }
    // What the program does with a matched packet (`rules.rs`): `matched`, and one of
    // these (or none, when it passes the packet unmetered).
    let outcomes = [
        rule::ADMITTED,
        rule::DROPPED,
        rule::BANNED_DROPPED,
        rule::WOULD_DROP,
        rule::EXCEED_PASSED,
    ];
    for r in 0..2 {
        let mut matched = Pb::default();
        for (j, outcome) in (0..).zip(outcomes) {
            let p = power(r * 8 + j);
            s[1][rule_index(r, outcome)] = p;
            matched += p;
        }
        s[1][rule_index(r, rule::MATCHED)] = matched;
        s[1][rule_index(r, rule::BANS)] = power(r * 8 + 6);
    }
    // The daemon's own counters too, each a power of two of its own.
    let gauges = Gauges {
        events: events::Counts {
            lost_queue: 1 << 50,
            lost_write: 1 << 51,
            ..GAUGES.events
        },
        http: HttpCounts {
            header_timeouts: 1,
            request_timeouts: 2,
            ..GAUGES.http
        },
        tasks: vec![("a", true, 1), ("b", true, 2), ("c", false, 4)],
        saved_bans: [
            ("restored", 1),
            ("pinned", 2),
            ("expired", 4),
            ("rule_gone", 8),
            ("failed", 16),
        ],
        ..GAUGES
    };
    let text = render_metrics(&stats_of(&s, &["a", "b"]), &gauges);
    let (_, samples) = parse(&text);
    let mut checked = 0;
    for (i, sample) in samples.iter().enumerate() {
        if sample.kind != "counter" || sample.value == 0.0 {
            continue;
        }
        for (label, _) in &sample.labels {
            let rest = |x: &Sample| {
                let mut l: Vec<(String, String)> = x
                    .labels
                    .iter()
                    .filter(|(k, _)| k != label)
                    .cloned()
                    .collect();
                l.sort();
                l
            };
            let siblings: Vec<f64> = samples
                .iter()
                .enumerate()
                .filter(|(j, x)| *j != i && x.name == sample.name && rest(x) == rest(sample))
                .map(|(_, x)| x.value)
                .collect();
            if let Some(parts) = is_a_sum_of(sample.value, &siblings) {
                panic!(
                    "{} {:?} = {} is the sum of others over {label}: {parts:?}\n{text}",
                    sample.name, sample.labels, sample.value
                );
            }
            checked += 1;
        }
    }
    assert!(checked > 50, "{checked} series checked");
}

/// Every counter of the program is in `/metrics` exactly once: a verdict in
/// `ratelimit_packets_total`, a packet reason in `ratelimit_reason_packets_total`, any
/// other reason in a family of its own. A counter added to `stats::global` fails here
/// until it is given its place.
#[test]
fn http_metrics_export_every_counter_once() {
    let classified: Vec<u32> = (0..global::VERDICTS)
        .chain(PACKET_REASONS)
        .chain(NON_PACKET_REASONS.iter().map(|r| r.0))
        .chain([global::EVENTS_LOST])
        .collect();
    let mut sorted = classified.clone();
    sorted.sort();
    assert_eq!(
        sorted,
        (0..global::COUNT).collect::<Vec<_>>(),
        "each counter of stats::global classified once"
    );
    // Each counter of one interface's slot a value of its own: each value is in exactly
    // one packet series.
    let mut s = raw_slots();
    let value = |k: u32| 1000 + u64::from(k);
    for k in 0..global::COUNT {
        s[1][k as usize] = pb(value(k), 0);
    }
    let text = render_metrics(&stats_of(&s, &[]), &GAUGES);
    let (_, samples) = parse(&text);
    for k in 0..global::COUNT {
        let found: Vec<_> = samples
            .iter()
            .filter(|x| x.value == value(k) as f64 && !x.family.ends_with("_bytes"))
            .collect();
        assert_eq!(found.len(), 1, "{}: {found:?}", global::NAMES[k as usize]);
        let in_packets = found[0].family.ends_with("_packets");
        assert_eq!(
            in_packets,
            k < global::VERDICTS || PACKET_REASONS.contains(&k),
            "{} in {}",
            global::NAMES[k as usize],
            found[0].family
        );
    }
}

#[test]
fn http_metrics_evictions_and_empty_map() {
    let mut stats = synthetic();
    stats.all.reasons.insert("state_evicted".into(), pb(0, 0));
    let text = render_metrics(
        &stats,
        &Gauges {
            tracked_clients: 5,
            tracked_clients_capacity: 0,
            ..GAUGES
        },
    );
    let l = lines(&text);
    assert!(
        l.contains(&"ratelimit_client_states_evicted_total 0"),
        "{text}"
    );
    assert!(
        l.contains(&"ratelimit_map_fill_ratio{map=\"clients\"} 0.0"),
        "{text}"
    );
}

#[test]
fn http_metrics_escape_label_values() {
    let mut stats = synthetic();
    stats.rules[0].name = "a\"b\\c".into();
    let text = render_metrics(&stats, &GAUGES);
    assert!(
        text.contains("ratelimit_rule_bans_issued_total{rule=\"a\\\"b\\\\c\"} 2"),
        "{text}"
    );
    let (_, samples) = parse(&text);
    assert!(
        samples
            .iter()
            .any(|s| s.labels.contains(&("rule".into(), "a\"b\\c".into()))),
        "{text}"
    );
}

fn top(q: &str) -> Result<serde_json::Value, String> {
    let uri: Uri = format!("/v1/top{q}").parse().unwrap();
    parse_top(&uri).map(|r| serde_json::to_value(r).unwrap())
}

#[test]
fn http_top_query_parsing() {
    let want = |n: usize, by: &str| serde_json::json!({"cmd": "top", "n": n, "by": by});
    assert_eq!(top(""), Ok(want(10, "packets")));
    assert_eq!(top("?"), Ok(want(10, "packets")));
    assert_eq!(top("?n=5"), Ok(want(5, "packets")));
    assert_eq!(top("?by=drops"), Ok(want(10, "drops")));
    assert_eq!(top("?n=3&by=bytes"), Ok(want(3, "bytes")));
    assert_eq!(top("?by=packets&n=0"), Ok(want(0, "packets")));
    assert_eq!(top("?n=10000"), Ok(want(MAX_TOP_N, "packets")));
    for bad in [
        "?n=10001",
        "?n=18446744073709551615",
        "?n=-1",
        "?n=x",
        "?n=",
        "?by=rate",
        "?by=Bytes",
        "?limit=3",
        "?n=1&n=2",
    ] {
        let e = top(bad).expect_err(bad);
        assert!(
            e.contains("expected /v1/top?n=N&by=packets|bytes|drops"),
            "{e}"
        );
    }
    assert!(top("?by=rate").unwrap_err().contains("rate"));
}

/// A daemon stand-in: records the requests, answers with canned reports (`n` clients for
/// `top`, 30 offenders), after `delay`.
#[derive(Clone, Default)]
struct Fake(Arc<Mutex<Vec<serde_json::Value>>>, Duration);

impl Backend for Fake {
    async fn request(&self, req: Request) -> api::Response {
        use api::samples;
        tokio::time::sleep(self.1).await;
        self.0
            .lock()
            .unwrap()
            .push(serde_json::to_value(&req).unwrap());
        api::Response::ok(match req {
            Request::Bans { .. } => return api::Response::err("reading bans: boom"),
            Request::Offenders { limit } => Answer::Offenders(
                (0..limit.unwrap_or(usize::MAX).min(30) as u64)
                    .map(samples::client)
                    .collect(),
            ),
            Request::Top { n, .. } => Answer::Top((0..n as u64).map(samples::client).collect()),
            Request::Status => Answer::Status(Box::new(samples::status())),
            Request::Stats => Answer::Stats(Box::new(samples::stats())),
            Request::FleetKey { addr, .. } => {
                let mut k = crate::fleet::key::sample();
                if addr == "192.0.2.99" {
                    k.busy = Some(crate::fleet::key_reads::busy_message());
                }
                Answer::FleetKey(Box::new(k))
            }
            other => panic!("not a report: {other:?}"),
        })
    }
    async fn snapshot(&self) -> anyhow::Result<(Stats, Gauges)> {
        Ok((synthetic(), GAUGES))
    }
}

fn serve_fake(
    listener: TcpListener,
    fake: Fake,
    limits: Limits,
) -> tokio::task::JoinHandle<anyhow::Result<()>> {
    tokio::spawn(serve_with(listener, fake, limits))
}

/// One HTTP/1.1 exchange: (status, head, body).
async fn exchange(addr: SocketAddr, method: &str, target: &str) -> (u16, String, String) {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let req = format!(
        "{method} {target} HTTP/1.1\r\nHost: test\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).await.unwrap();
    let (head, body) = raw.split_once("\r\n\r\n").unwrap();
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    (status, head.to_ascii_lowercase(), body.to_string())
}

#[tokio::test]
async fn http_routes_status_codes_and_bodies() {
    let listener = bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let fake = Fake::default();
    let server = serve_fake(listener, fake.clone(), Limits::DEFAULT);

    // Without an Accept header: the classic text format (OpenMetrics on request: e2e_prometheus).
    let (st, head, body) = exchange(addr, "GET", "/metrics").await;
    assert_eq!(st, 200);
    assert!(
        head.contains("content-type: text/plain; version=0.0.4"),
        "{head}"
    );
    assert!(body.contains("ratelimit_up 1\n") && !body.contains("# EOF"));

    // The bodies are the control API's answers, read back as its types.
    use api::samples;
    for (path, req, want) in [
        (
            "/v1/status",
            Request::Status,
            Answer::Status(Box::new(samples::status())),
        ),
        (
            "/v1/stats",
            Request::Stats,
            Answer::Stats(Box::new(samples::stats())),
        ),
    ] {
        let (st, head, body) = exchange(addr, "GET", path).await;
        assert_eq!(st, 200, "{path}: {body}");
        assert!(head.contains("content-type: application/json"), "{head}");
        assert_eq!(Answer::decode(&req, &body).unwrap(), want);
    }

    let (st, _, body) = exchange(addr, "GET", "/v1/top?n=3&by=drops").await;
    assert_eq!(st, 200);
    let top: Vec<report::Client> = serde_json::from_str(&body).unwrap();
    assert_eq!(top, (0..3).map(samples::client).collect::<Vec<_>>());

    let (st, _, body) = exchange(addr, "GET", "/v1/top?by=rate").await;
    assert_eq!(st, 400);
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert!(v["error"].as_str().unwrap().contains("rate"), "{body}");

    // Lists: cut to `limit` (default and most: MAX_LIST), and said so.
    let (st, head, body) = exchange(addr, "GET", "/v1/offenders").await;
    assert_eq!(st, 200, "{body}");
    let v: Vec<report::Client> = serde_json::from_str(&body).unwrap();
    assert_eq!(v.len(), 30);
    assert!(!head.contains("x-truncated"), "{head}");
    let (st, head, body) = exchange(addr, "GET", "/v1/offenders?limit=5").await;
    assert_eq!(st, 200, "{body}");
    let v: Vec<report::Client> = serde_json::from_str(&body).unwrap();
    assert_eq!(v, (0..5).map(samples::client).collect::<Vec<_>>());
    assert!(head.contains("x-truncated: true"), "{head}");
    for bad in [
        "/v1/offenders?limit=10001",
        "/v1/offenders?limit=x",
        "/v1/bans?n=3",
        "/v1/top?n=10001",
    ] {
        let (st, _, body) = exchange(addr, "GET", bad).await;
        assert_eq!(st, 400, "{bad}: {body}");
    }

    let (st, _, body) = exchange(addr, "GET", "/v1/bans").await;
    assert_eq!(st, 500);
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v, serde_json::json!({"error": "reading bans: boom"}));

    let (st, _, body) = exchange(addr, "GET", "/v1/nope").await;
    assert_eq!(st, 404);
    assert!(body.contains("/v1/offenders"), "{body}");
    let (st, _, _) = exchange(addr, "GET", "/v1/stats/").await;
    assert_eq!(st, 404);

    for (method, path) in [
        ("POST", "/v1/bans"),
        ("DELETE", "/v1/bans"),
        ("PUT", "/metrics"),
    ] {
        let (st, head, body) = exchange(addr, method, path).await;
        assert_eq!(st, 405, "{method} {path}");
        assert!(head.contains("allow: get,head"), "{head}");
        assert!(body.contains("read-only"), "{body}");
    }

    // Only the GETs above reached the daemon: no 400/404/405 did.
    let seen: Vec<_> = fake.0.lock().unwrap().clone();
    let cmd = |c: &str| serde_json::json!({ "cmd": c });
    assert_eq!(
        seen,
        [
            cmd("status"),
            cmd("stats"),
            serde_json::json!({"cmd": "top", "n": 3, "by": "drops"}),
            serde_json::json!({"cmd": "offenders", "limit": MAX_LIST + 1}),
            serde_json::json!({"cmd": "offenders", "limit": 6}),
            serde_json::json!({"cmd": "bans", "limit": MAX_LIST + 1}),
        ]
    );
    server.abort();
}

/// Whether the server closed `s` within `within`, reading whatever it sent first.
async fn closed_within(s: &mut tokio::net::TcpStream, within: Duration) -> bool {
    let mut buf = Vec::new();
    matches!(
        tokio::time::timeout(within, s.read_to_end(&mut buf)).await,
        Ok(Ok(_) | Err(_))
    )
}

const SHORT: Limits = Limits {
    max_connections: 2,
    metrics_slots: 0,
    max_per_peer: 2,
    header_read_timeout: Duration::from_millis(300),
    request_timeout: Duration::from_millis(300),
    max_connection_age: Duration::from_secs(60),
};

#[tokio::test]
async fn http_fleet_key_beyond_the_store_s_read_bound_is_a_429_with_retry_after() {
    let listener = bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = serve_fake(listener, Fake::default(), Limits::DEFAULT);
    let (st, _, body) = exchange(addr, "GET", "/v1/fleet/key?addr=198.51.100.7").await;
    assert_eq!(st, 200, "{body}");
    let (st, head, body) = exchange(addr, "GET", "/v1/fleet/key?addr=192.0.2.99").await;
    assert_eq!(st, 429, "{body}");
    assert!(head.contains("retry-after: 1"), "{head}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert!(
        v["error"]
            .as_str()
            .is_some_and(|e| e.contains("at most 10 times a second")),
        "{body}"
    );
    server.abort();
}

#[tokio::test]
async fn http_connections_over_the_cap_are_closed_at_once_and_idle_ones_in_time() {
    let listener = bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let conns = {
        let fake = Fake::default();
        serve_fake(listener, fake, SHORT)
    };
    let connect = || tokio::net::TcpStream::connect(addr);
    let start = Instant::now();
    let (mut a, mut b) = (connect().await.unwrap(), connect().await.unwrap());
    // Give the listener time to take both before the third arrives.
    tokio::time::sleep(Duration::from_millis(50)).await;
    let mut c = connect().await.unwrap();
    assert!(
        closed_within(&mut c, Duration::from_millis(200)).await,
        "a third connection is closed at once"
    );
    // A slow client: half its headers, never the rest.
    b.write_all(b"GET /v1/status HTTP/1.1\r\nHo").await.unwrap();
    for s in [&mut a, &mut b] {
        assert!(closed_within(s, Duration::from_secs(5)).await);
    }
    let took = start.elapsed();
    assert!(
        took >= SHORT.header_read_timeout && took < Duration::from_secs(3),
        "closed after {took:?}"
    );
    // The slots are free again: a request is answered, and the counts say what happened.
    let (st, _, body) = exchange(addr, "GET", "/metrics").await;
    assert_eq!(st, 200);
    for want in [
        "ratelimit_http_connections_rejected_total 1",
        "ratelimit_http_timeouts_total{phase=\"headers\"} 2",
        "ratelimit_http_connections_open 1",
    ] {
        assert!(body.lines().any(|l| l == want), "{want} in\n{body}");
    }
    conns.abort();
}

#[tokio::test]
async fn http_a_request_the_daemon_is_too_busy_for_is_a_503_in_time() {
    let listener = bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let fake = Fake(Arc::default(), Duration::from_secs(30));
    let server = serve_fake(listener, fake, SHORT);
    let start = Instant::now();
    let (st, _, body) = exchange(addr, "GET", "/v1/status").await;
    assert_eq!(st, 503, "{body}");
    assert!(start.elapsed() < Duration::from_secs(5));
    assert!(body.contains("did not answer within"), "{body}");
    server.abort();
}

#[tokio::test]
async fn http_bind_address_in_use_is_explained() {
    let first = bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
    let addr = first.local_addr().unwrap();
    let e = bind(addr).await.unwrap_err().to_string();
    assert_eq!(
        e,
        format!(
            "http_listen {addr}: address in use; set [daemon] http_listen to another address or \"off\""
        )
    );
}

/// The classic text format of the whole exposition: every sample's family has its help and
/// type under the sample's own name (a histogram's under its base name), counters end in
/// `_total`, and nothing of OpenMetrics' own is left (`info`, `# UNIT`, `# EOF`).
#[test]
fn http_metrics_classic_format_names_every_family_by_its_samples() {
    use super::metrics::classic::to_classic;
    let om = render_metrics(&synthetic(), &GAUGES);
    assert!(om.ends_with("# EOF\n"));
    let text = to_classic(&om);
    let mut typed = std::collections::HashMap::new();
    let mut helped = std::collections::HashSet::new();
    let mut samples = 0;
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap();
            assert!(["counter", "gauge", "histogram"].contains(&kind), "{line}");
            assert_eq!(kind == "counter", name.ends_with("_total"), "{line}");
            typed.insert(name.to_string(), kind.to_string());
        } else if let Some(rest) = line.strip_prefix("# HELP ") {
            helped.insert(rest.split_once(' ').unwrap().0.to_string());
        } else {
            assert!(!line.starts_with('#'), "{line}");
            let name = line.split(['{', ' ']).next().unwrap();
            let family = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| {
                    name.strip_suffix(s)
                        .filter(|b| typed.get(*b).is_some_and(|k| k == "histogram"))
                })
                .unwrap_or(name);
            assert!(
                typed.contains_key(family) && helped.contains(family),
                "{line}"
            );
            samples += 1;
        }
    }
    assert!(samples > 50, "{samples}");
}
