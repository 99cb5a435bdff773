//! Differential fuzzing of the data plane: generated frames (`ratelimit_tests::fuzz`) run
//! through the real XDP object with BPF_PROG_TEST_RUN and through the host model of the
//! verdict pipeline (`ratelimit_common::model`); the XDP action of every frame and the deltas
//! of every global and per-rule counter must agree.
//!
//! Determinism on a busy machine, by construction rather than by tolerance:
//! * Window intervals are chosen at the start of each epoch so that no window edge falls
//!   within the epoch (`window_interval_s`), and an epoch ends after `EPOCH_SECS` or
//!   `EPOCH_FRAMES` (a fresh program, maps and model for the next): the model's one `now` is
//!   then in the window of every coarse `now` the program reads.
//! * Token buckets count packets and emit one packet per 20 min, longer than an epoch, so no
//!   token refills within one (a bucket of bytes refills by the nanosecond, and a frame of
//!   some length always fits in what the last few milliseconds refilled: none is used); bans
//!   last an hour.
//! * No admission budget and a store far larger than the sources sent: every new key gets
//!   its state, nothing is evicted. One thread: no lost compare-and-swap race.
//! * The events ring buffer is drained after every batch, so no event is lost (`events_lost`).
//!
//! Counters are read per batch of `BATCH` frames (the action is compared per frame); on a
//! difference the epoch is replayed on a fresh program up to that batch and the batch is
//! run frame by frame to find the frame, which is shrunk and written to
//! `tests/fuzz-regressions/` (replayed by every run) before the test fails.
//!
//! `RATELIMIT_FUZZ_FRAMES` (default 100,000) and `RATELIMIT_FUZZ_SEED` (default 1) set the run;
//! `cargo xtask fuzz` runs a million frames with a fresh seed.

use std::{
    fmt::Write as _,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use ratelimit_common::{
    caps::MAX_RULES,
    maps::{BAN_MANUAL, BAN_REMOTE, BAN_TABLE_REMOTE, BanEntry, FAST_ENTRIES},
    model::{self, Counters, Model, Policy, hex_dump},
    stats::{self, global, rule as rc},
};
use ratelimit_tests::{
    fixture::{Fixture, HOUR_NS, manual_ban, prefix},
    fuzz, kernel_test,
};
use ratelimit_user::policy::apply;

/// Frames whose counters are read and compared together.
const BATCH: usize = 64;
/// An epoch (one program load) lasts at most this long...
const EPOCH_SECS: u64 = 300;
/// ...and this many frames.
const EPOCH_FRAMES: u64 = 50_000;
/// Per-source store: 32,768 sets of 8, for the few thousand keys an epoch creates (pools of
/// sources, and ~3% of frames with a random one; ~3,400 measured): at under 0.25 keys a set,
/// the chance that some key of a million-frame run finds both of its sets full (8 keys each)
/// is below 1e-15, and an eviction would show as a `state_evicted` the model does not
/// predict, not as a silent pass.
const MAX_SOURCES: u32 = 1 << 18;

/// The first fuzz config; `{I}` is the window interval in seconds (see `window_interval_s`).
/// Rule by rule: a SYN ban rule per /32 and /124 (fixed window), a token bucket of packets,
/// one ICMP bucket for everyone (sliding window), a UDP ban rule in preview, a TCP/22 ban rule
/// whose exceed action is pass, a source-list rule with an override for half its /24, a byte
/// threshold per /2 (byte thresholds are at least 64 KiB), an ICMPv6 ban of the shared key,
/// and a TCP ban rule keyed by the client's /28 (/120) and destination port. The ban rules' IPv6 prefixes are
/// long (/124, /120) so that a ban covers few of the generated sources and the rest of the
/// epoch still has rule verdicts to compare (that an IPv6 ban never covers an IPv4 client is
/// kept by `fuzz-regressions/aliasing-bogons-malformed.hex`). The pressure level is low: the
/// SYN ban rule, the token bucket and the override are elastic, and meter against their
/// elastic limits.
const CONFIG_LISTS: &str = include_str!("../configs/fuzz-lists.toml");

/// The second config, used by every other epoch: no allow or deny list (so a source-list
/// rule looks its sources up itself), a key = all rule on SYN-ACK flags with an override, a
/// byte threshold on a sliding window with exceed action pass and eight port ranges per /1,
/// a token bucket of burst 1 per /28 and /100, a preview rule that matches every packet, an
/// ICMP ban rule on bytes with an override, and a catch-all shared bucket. The pressure level
/// is high: the SYN-ACK rule and its override are elastic, and held to their thresholds.
const CONFIG_NO_LISTS: &str = include_str!("../configs/fuzz-no-lists.toml");

/// The configs epochs take in turn.
const CONFIGS: [&str; 2] = [CONFIG_LISTS, CONFIG_NO_LISTS];

/// Operator bans, inserted as `ratelimit ban add` does (an hour: longer than any epoch).
const BANS: [&str; 3] = ["198.18.70.0/24", "2001:db8:ba::/48", "198.18.40.77/32"];

/// Bans received from the fleet, inserted as the daemon installs them (`BAN_MANUAL |
/// BAN_REMOTE`, in the remote bans' table): over sources the rules also ban, with bans that
/// drop and bans that pass, so the model checks that a passing ban never hides a remote one.
const REMOTE_BANS: [&str; 3] = ["45.1.0.0/16", "2a00:1450:0:1::/64", "8.2.3.0/24"];

/// A window interval (seconds, at least an hour) whose current window has more than an
/// epoch left, and began long enough ago that the coarse clock is in it too: every window
/// meter of the epoch stays in one window, as the model assumes.
fn window_interval_s(now_ns: u64) -> u64 {
    let margin = (EPOCH_SECS + 120) * 1_000_000_000;
    (3600..)
        .find(|i| {
            let i = i * 1_000_000_000;
            (now_ns - 2_000_000_000) / i == (now_ns + margin) / i
        })
        .unwrap()
}

/// One program with the fuzz config applied, and the model of it.
struct Lab {
    fx: Fixture,
    model: Model,
    now: u64,
    rules: usize,
    started: Instant,
    /// Counters of slot 0 as last read.
    last: Counters,
}

impl Lab {
    /// A fresh program with `CONFIGS[config]`.
    fn new(config: usize) -> Self {
        let now = ratelimit_user::clock::mono_ns();
        let interval = window_interval_s(now);
        let text = CONFIGS[config].replace("{I}", &interval.to_string());
        let mut fx = Fixture::builder()
            .pins("fuzz")
            .max_sources(MAX_SOURCES)
            .load(&text);
        // The pressure level: low (elastic limits in force) where the config says so, high
        // (every limit as configured, elastic or not) otherwise; the model reads it from the
        // global config like the program.
        let relaxed = text.contains("# pressure: low");
        apply::write_relaxed(&mut fx.maps, relaxed).expect("write the pressure level");
        // `apply` writes the store's size into the global config.
        let global = fx.maps.global.get(&0, 0).expect("global config");
        let plan = &fx.plan;
        let policy = Policy {
            global,
            rules: plan.rules.clone(),
            sources: plan
                .sources
                .iter()
                .map(|((l, k), v)| (*l, *k, *v))
                .collect(),
            dests: plan.dests.iter().map(|((l, k), v)| (*l, *k, *v)).collect(),
            overrides: plan
                .overrides
                .iter()
                .map(|((r, (l, k)), v)| (*r, *l, *k, *v))
                .collect(),
        };
        let mut model = Model::new(policy).expect("the model covers the fuzz config");
        for cidr in BANS {
            let entry = manual_ban(cidr, now, now + HOUR_NS);
            fx.insert_ban(entry);
            model.insert_ban(entry);
        }
        for cidr in REMOTE_BANS {
            let (plen, key) = prefix(cidr);
            let entry = BanEntry {
                flags: BAN_MANUAL | BAN_REMOTE,
                ..manual_ban(cidr, now, now + HOUR_NS)
            };
            fx.insert_ban(entry);
            assert_eq!(
                fx.maps.ban_at(BAN_TABLE_REMOTE, plen, &key),
                Some(entry),
                "a remote ban goes into the remote table"
            );
            model.insert_ban(entry);
        }
        let rules = fx.rules.len();
        let mut lab = Lab {
            fx,
            model,
            now,
            rules,
            started: Instant::now(),
            last: Counters::default(),
        };
        lab.last = lab.read();
        lab
    }

    /// Slot 0's counters, summed over CPUs.
    fn read(&self) -> Counters {
        let mut c = Counters::default();
        let get = |i: u32| -> (u64, u64) {
            let v = self.fx.maps.stats.get(&i, 0).expect("read a counter");
            v.iter()
                .fold((0, 0), |a, x| (a.0 + x.packets, a.1 + x.bytes))
        };
        for g in 0..global::COUNT {
            c.global[g as usize] = get(stats::global_index(0, g));
        }
        for r in 0..self.rules as u32 {
            for k in 0..rc::COUNT {
                c.rules[r as usize][k as usize] = get(stats::rule_index(0, r, k));
            }
        }
        c
    }

    /// Counter deltas since the last read.
    fn delta(&mut self) -> Counters {
        let now = self.read();
        let mut d = Counters::default();
        for (i, (a, b)) in now.global.iter().zip(self.last.global.iter()).enumerate() {
            d.global[i] = (a.0 - b.0, a.1 - b.1);
        }
        for r in 0..MAX_RULES as usize {
            for k in 0..rc::COUNT as usize {
                let (a, b) = (now.rules[r][k], self.last.rules[r][k]);
                d.rules[r][k] = (a.0 - b.0, a.1 - b.1);
            }
        }
        self.last = now;
        d
    }

    fn drain_events(&mut self) {
        if let Some(rb) = self.fx.maps.events.as_mut() {
            while rb.next().is_some() {}
        }
    }

    /// Run one frame through both: (program's action, model's outcome).
    fn step(&mut self, frame: &[u8]) -> (u32, model::Outcome) {
        (self.fx.run(frame, 1), self.model.run(frame, self.now))
    }

    fn expired(&self, frames: u64) -> bool {
        frames >= EPOCH_FRAMES || self.started.elapsed() >= Duration::from_secs(EPOCH_SECS)
    }
}

/// A frame on which program and model disagree.
struct Difference {
    frame: Vec<u8>,
    report: String,
}

/// Run `frames` on `lab`, frame by frame: the first difference, if any.
fn first_difference(
    lab: &mut Lab,
    frames: &[Vec<u8>],
    label: &dyn Fn(usize) -> String,
) -> Option<Difference> {
    for (k, f) in frames.iter().enumerate() {
        let (action, want) = lab.step(f);
        let got = lab.delta();
        lab.drain_events();
        if action != want.action || got != want.counters {
            return Some(Difference {
                frame: f.clone(),
                report: describe(&label(k), f, action, &got, &want, lab.rules),
            });
        }
    }
    None
}

fn describe(
    what: &str,
    frame: &[u8],
    action: u32,
    got: &Counters,
    want: &model::Outcome,
    rules: usize,
) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "{what}: {} bytes", frame.len());
    s.push_str(&hex_dump(frame));
    let _ = writeln!(
        s,
        "program: action {action}, counters {:?}",
        got.describe(rules)
    );
    let _ = writeln!(
        s,
        "model:   action {}, counters {:?}",
        want.action,
        want.counters.describe(rules)
    );
    let _ = writeln!(s, "model trace:");
    for t in &want.trace {
        let _ = writeln!(s, "  {t}");
    }
    s
}

/// Whether `frames`, run on a fresh program and model, differ at the last frame or before.
fn reproduces(config: usize, frames: &[Vec<u8>]) -> Option<Difference> {
    let mut lab = Lab::new(config);
    first_difference(&mut lab, frames, &|k| {
        format!("frame {k} of {}", frames.len())
    })
}

/// Shrink the last frame of `context` while the difference stays (fresh program each try,
/// a bounded number of tries).
fn shrink(config: usize, mut context: Vec<Vec<u8>>) -> Vec<Vec<u8>> {
    let mut tries = 0;
    'outer: while tries < 200 {
        let last = context.last().unwrap().clone();
        for candidate in fuzz::shrink_candidates(&last) {
            tries += 1;
            let mut c = context.clone();
            *c.last_mut().unwrap() = candidate;
            if reproduces(config, &c).is_some() {
                context = c;
                continue 'outer;
            }
            if tries >= 200 {
                break 'outer;
            }
        }
        break;
    }
    context
}

fn regressions_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz-regressions")
}

/// The frames of the run (seed, indices epoch_start..at) with `frame`'s source, then it: the
/// smallest history that usually explains a difference that needs one.
fn same_source_history(seed: u64, epoch_start: u64, at: u64, frame: &[u8]) -> Vec<Vec<u8>> {
    let src = |f: &[u8]| match model::parse(f) {
        model::Frame::Ip(p) => Some(p.src),
        _ => None,
    };
    let Some(s) = src(frame) else {
        return vec![frame.to_vec()];
    };
    let mut out: Vec<Vec<u8>> = (epoch_start..at)
        .map(|i| fuzz::frame(seed, i))
        .filter(|f| src(f) == Some(s))
        .collect();
    out.push(frame.to_vec());
    out
}

/// Minimise a difference found at frame `at` of the run, write it as a regression file, and
/// return what to report.
fn record(config: usize, seed: u64, epoch_start: u64, at: u64, d: &Difference) -> String {
    let alone = vec![d.frame.clone()];
    let history = same_source_history(seed, epoch_start, at, &d.frame);
    let (context, note) = if reproduces(config, &alone).is_some() {
        (shrink(config, alone), "reproduces alone; shrunk")
    } else if reproduces(config, &history).is_some() {
        (
            shrink(config, history),
            "needs the earlier frames of its source; last frame shrunk",
        )
    } else {
        (
            history,
            "did not reproduce on a fresh program (depends on other sources)",
        )
    };
    let dir = regressions_dir();
    let _ = std::fs::create_dir_all(&dir);
    let path = dir.join(format!("seed{seed}-frame{at}.hex"));
    let mut text = format!(
        "# Found by the differential fuzz test: seed {seed}, frame {at} ({note}).\n# Replayed on a fresh program, frame by frame, by every run of tests/tests/fuzz.rs.\n# config: {config}\n"
    );
    for f in &context {
        text.push_str(&fuzz::hex_line(f));
        text.push('\n');
    }
    let written = std::fs::write(&path, text).is_ok();
    let minimal = reproduces(config, &context).map_or_else(
        || "(minimised frames no longer differ)".to_string(),
        |m| m.report,
    );
    format!(
        "{}\nminimised ({note}, {} frame(s)){}:\n{minimal}",
        d.report,
        context.len(),
        if written {
            format!(", written to {}", path.display())
        } else {
            String::new()
        }
    )
}

/// The config a regression file is replayed with: its `# config: N` line, else the first.
fn config_of(text: &str) -> usize {
    text.lines()
        .find_map(|l| l.strip_prefix("# config: "))
        .and_then(|n| n.trim().parse().ok())
        .filter(|n| *n < CONFIGS.len())
        .unwrap_or(0)
}

fn env_u64(name: &str, default: u64) -> u64 {
    match std::env::var(name) {
        Ok(v) if !v.is_empty() => v
            .replace('_', "")
            .parse()
            .unwrap_or_else(|_| panic!("{name}={v}: expected a whole number")),
        _ => default,
    }
}

/// Every regression file, replayed on a fresh program: the model and the program agree on
/// each of its frames.
#[test]
fn regressions_replay_without_difference() {
    kernel_test!();
    let dir = regressions_dir();
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .map(|d| d.filter_map(|e| e.ok()).map(|e| e.path()).collect())
        .unwrap_or_default();
    files.retain(|p| p.extension().is_some_and(|e| e == "hex"));
    files.sort();
    assert!(
        !files.is_empty(),
        "no regression files in {}",
        dir.display()
    );
    let mut failures = Vec::new();
    for path in &files {
        let text = std::fs::read_to_string(path).expect("read a regression file");
        let frames =
            fuzz::parse_hex_frames(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let mut lab = Lab::new(config_of(&text));
        let name = path.file_name().unwrap_or_default().to_string_lossy();
        for (k, f) in frames.iter().enumerate() {
            let (action, want) = lab.step(f);
            let got = lab.delta();
            lab.drain_events();
            println!(
                "{name} frame {k}: action {action}, {:?}",
                got.describe(lab.rules)
            );
            if action != want.action || got != want.counters {
                let what = format!("{} frame {k}", path.display());
                failures.push(describe(&what, f, action, &got, &want, lab.rules));
                break;
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    println!("{} regression files replayed", files.len());
}

/// Generated frames through the program and the model: the same action for every frame and
/// the same counter deltas for every batch.
#[test]
fn program_and_model_agree_on_generated_frames() {
    kernel_test!();
    let frames = env_u64("RATELIMIT_FUZZ_FRAMES", 100_000);
    let seed = env_u64("RATELIMIT_FUZZ_SEED", 1);
    println!("fuzz: {frames} frames, seed {seed}");
    let started = Instant::now();
    let mut lab = Lab::new(0);
    let mut epoch_start = 0u64;
    let mut epochs = 1;
    let mut i = 0u64;
    let mut actions = [0u64; 3];
    // Per config: rule counters mean different rules in each.
    let mut totals = vec![Counters::default(); CONFIGS.len()];
    while i < frames {
        if lab.expired(i - epoch_start) {
            lab = Lab::new(epochs % CONFIGS.len());
            epoch_start = i;
            epochs += 1;
        }
        let end = (i + BATCH as u64).min(frames);
        let batch: Vec<Vec<u8>> = (i..end).map(|k| fuzz::frame(seed, k)).collect();
        let mut want = Counters::default();
        let mut bad_action = None;
        for (k, f) in batch.iter().enumerate() {
            let (action, o) = lab.step(f);
            if action != o.action && bad_action.is_none() {
                bad_action = Some(k);
            }
            if (action as usize) < actions.len() {
                actions[action as usize] += 1;
            }
            want.merge(&o.counters);
        }
        let got = lab.delta();
        lab.drain_events();
        if bad_action.is_some() || got != want {
            // Replay the epoch on a fresh program up to this batch, then the batch frame by
            // frame, to find the frame.
            let config = (epochs - 1) % CONFIGS.len();
            let mut replay = Lab::new(config);
            for k in epoch_start..i {
                let f = fuzz::frame(seed, k);
                replay.step(&f);
                if (k - epoch_start).is_multiple_of(BATCH as u64) {
                    replay.drain_events();
                }
            }
            replay.delta();
            replay.drain_events();
            let found = first_difference(&mut replay, &batch, &|k| {
                format!("seed {seed}, frame {}", i + k as u64)
            });
            let Some(d) = found else {
                panic!(
                    "seed {seed}: frames {i}..{end} differ (program {:?}, model {:?}) but not when replayed one by one",
                    got.describe(lab.rules),
                    want.describe(lab.rules)
                );
            };
            let at = i + batch.iter().position(|f| *f == d.frame).unwrap_or(0) as u64;
            panic!(
                "config {config}: {}",
                record(config, seed, epoch_start, at, &d)
            );
        }
        totals[(epochs - 1) % CONFIGS.len()].merge(&want);
        i = end;
    }
    let secs = started.elapsed().as_secs_f64();
    let mut total = Counters::default();
    for t in &totals {
        total.merge(t);
    }
    let g = |c: u32| total.global[c as usize].0;
    println!(
        "fuzz: {frames} frames, seed {seed}, {epochs} epoch(s), {secs:.1} s ({:.0} frames/s), 0 differences",
        frames as f64 / secs
    );
    println!(
        "fuzz: pass {} / drop {}; pass {} non_ip {} malformed {} allow {} deny {} ban {} rule {}; states {} bans issued {} fragments {} ipv6_ext_limit {} malformed l2/v4/v6/l4 {}/{}/{}/{}",
        actions[2],
        actions[1],
        g(global::PASS),
        g(global::PASS_NON_IP),
        g(global::PASS_MALFORMED),
        g(global::PASS_ALLOW),
        g(global::DROP_DENY),
        g(global::DROP_BAN),
        g(global::DROP_RULE),
        g(global::STATE_CREATED),
        g(global::BANS_ISSUED),
        g(global::FRAGMENTS),
        g(global::IPV6_EXT_LIMIT),
        g(global::MALFORMED_L2),
        g(global::MALFORMED_IPV4),
        g(global::MALFORMED_IPV6),
        g(global::MALFORMED_L4),
    );
    let fast_entries = (0..FAST_ENTRIES)
        .map(|k| {
            lab.fx
                .maps
                .fast
                .get(&k, 0)
                .map_or(0, |v| v.iter().filter(|e| e.jiffies != 0).count())
        })
        .sum::<usize>();
    let mut per_rule = String::new();
    for (config, total) in totals.iter().enumerate() {
        let _ = write!(per_rule, "\n  config {config}:");
        for r in 0..MAX_RULES as usize {
            let c = |k: u32| total.rules[r][k as usize].0;
            if c(rc::MATCHED) == 0 {
                continue;
            }
            let _ = write!(
                per_rule,
                " [{r}] {}/{}/{}/{}/{}/{}/{}",
                c(rc::MATCHED),
                c(rc::ADMITTED),
                c(rc::DROPPED),
                c(rc::WOULD_DROP),
                c(rc::EXCEED_PASSED),
                c(rc::BANS),
                c(rc::BANNED_DROPPED)
            );
        }
    }
    println!(
        "fuzz: rules (matched/admitted/dropped/would_drop/exceed_passed/bans/banned_dropped):{per_rule}; fast-drop entries in use at the end: {fast_entries}"
    );
    // Like packets within a tick were answered by the fast-drop table (entries are never
    // emptied once made, so any use in the last epoch shows).
    assert!(
        frames - epoch_start < 10_000 || fast_entries > 0,
        "the last epoch ({} frames) never made a fast-drop entry",
        frames - epoch_start
    );
    // The run is only worth something if it reached every stage.
    for (what, c) in [
        ("pass", global::PASS),
        ("drop_rule", global::DROP_RULE),
        ("drop_deny", global::DROP_DENY),
        ("drop_ban", global::DROP_BAN),
        ("pass_allow", global::PASS_ALLOW),
        ("bans_issued", global::BANS_ISSUED),
        ("ban_pass", global::BAN_PASS),
        ("malformed_l4", global::MALFORMED_L4),
    ] {
        assert!(
            frames < 10_000 || g(c) > 0,
            "{frames} frames never reached {what}"
        );
    }
}
