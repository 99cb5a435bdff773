//! This host's wall clock against the store's: measured every [`CLOCK_EVERY`] (the fastest
//! of [`CLOCK_SAMPLES`] round trips), judged against `fleet.max_clock_skew`, and whether this
//! host takes part in global counting because of it.

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, SystemTime},
};

use anyhow::Context as _;
use tracing::{info, warn};

use super::{
    CLOCK_EVERY, CLOCK_SAMPLES, REQUEST_TIMEOUT, Settings, Shared, fleet_line, store::Conn,
};
use crate::{config, events};

/// This host's wall clock against the store's: whether this host takes part in global
/// counting (read by `crate::fleet::global` before every round). Not before the first trusted
/// measurement, nor while the offset is beyond `bound` (`fleet.max_clock_skew`).
#[derive(Debug)]
pub struct Clock {
    bound: Duration,
    counting: AtomicBool,
}

impl Clock {
    pub fn new(bound: Duration) -> Self {
        Self {
            bound,
            counting: AtomicBool::new(false),
        }
    }

    /// `fleet.max_clock_skew`.
    pub fn bound(&self) -> Duration {
        self.bound
    }

    /// Whether this host takes part in global counting now.
    pub fn counting(&self) -> bool {
        self.counting.load(Ordering::Relaxed)
    }
}

/// One `TIME` round trip: this host's wall clock (unix ns) when it was sent and when it was
/// answered, and the store's answer (unix ns).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClockSample {
    pub sent_ns: i64,
    pub recv_ns: i64,
    pub store_ns: i64,
}

impl ClockSample {
    pub fn rtt_ns(&self) -> i64 {
        (self.recv_ns - self.sent_ns).max(0)
    }

    /// This host's clock minus the store's: `local - (store + rtt / 2)`, with `local` the
    /// answer's arrival (the store read its clock about half a round trip before).
    pub fn offset_ns(&self) -> i64 {
        self.recv_ns - (self.store_ns + self.rtt_ns() / 2)
    }
}

/// The sample answered fastest (the least uncertain offset).
pub fn best_sample(samples: &[ClockSample]) -> Option<ClockSample> {
    samples.iter().copied().min_by_key(ClockSample::rtt_ns)
}

/// What a measurement says of the clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClockVerdict {
    /// Its round trip exceeds half the bound: the offset is too uncertain to act on.
    Untrusted,
    Within,
    Over,
}

/// Judge an offset measured with round trip `rtt_ns` against `bound`: beyond the bound
/// either way is over; a round trip longer than half the bound (an offset uncertain by more
/// than a quarter of it) is not trusted.
pub fn judge_clock(offset_ns: i64, rtt_ns: i64, bound: Duration) -> ClockVerdict {
    let bound = bound.as_nanos() as i64;
    if rtt_ns > bound / 2 {
        ClockVerdict::Untrusted
    } else if offset_ns.unsigned_abs() > bound as u64 {
        ClockVerdict::Over
    } else {
        ClockVerdict::Within
    }
}

impl Shared {
    /// A clock measurement could not be made: the state stays as it is.
    fn clock_failed(&self, why: String) {
        self.lock().report.clock.last_error = Some(why);
    }

    /// A clock measurement: `sample` the fastest of its round trips. Crossing the bound
    /// either way changes whether this host counts globally, with an event and a log line.
    fn clock_measured(&self, clock: &Clock, sample: ClockSample) {
        let (offset, rtt) = (sample.offset_ns(), sample.rtt_ns());
        let bound = clock.bound();
        let verdict = judge_clock(offset, rtt, bound);
        let mut i = self.lock();
        let c = &mut i.report.clock;
        if verdict == ClockVerdict::Untrusted {
            c.last_error = Some(format!(
                "the store's fastest answer took {:.1} ms, more than half of \
                 fleet.max_clock_skew ({}): the offset was not trusted",
                rtt as f64 / 1e6,
                config::format_duration(bound)
            ));
            return;
        }
        let now = SystemTime::now();
        let offset_ms = offset as f64 / 1e6;
        let first = c.measured_at.is_none();
        let was_over = c.over_bound;
        c.offset_ms = Some(offset_ms);
        c.rtt_ms = Some(rtt as f64 / 1e6);
        c.measured_at = Some(crate::clock::rfc3339(now));
        c.last_error = None;
        let over = verdict == ClockVerdict::Over;
        c.over_bound = over;
        c.counting = !over;
        clock.counting.store(!over, Ordering::Relaxed);
        let how = if offset >= 0 { "ahead of" } else { "behind" };
        let bound_s = config::format_duration(bound);
        let (store, host_id) = (i.report.store.clone(), i.report.host_id.clone());
        if over && (first || !was_over) {
            i.report.clock.over_since = Some(crate::clock::rfc3339(now));
            let why = format!(
                "this host's clock is {:.0} ms {how} the store's, beyond fleet.max_clock_skew \
                 ({bound_s}): global rules are enforced locally",
                offset_ms.abs()
            );
            warn!(offset_ms, rtt_ms = rtt as f64 / 1e6, "{why}");
            let since = i.report.clock.over_since.clone();
            self.events.fleet(events::FleetLine {
                offset_ms: Some(offset_ms),
                max_skew_ms: Some(bound.as_millis() as u64),
                ..fleet_line(now, "fleet_clock_skew", (store, host_id), Some(why), since)
            });
        } else if !over && was_over {
            let since = i.report.clock.over_since.take();
            info!(
                offset_ms,
                "this host's clock is within fleet.max_clock_skew ({bound_s}) of the store's \
                 again: global counting resumes"
            );
            self.events.fleet(events::FleetLine {
                offset_ms: Some(offset_ms),
                max_skew_ms: Some(bound.as_millis() as u64),
                ..fleet_line(now, "fleet_clock_restored", (store, host_id), None, since)
            });
        } else if first {
            info!(
                offset_ms,
                rtt_ms = rtt as f64 / 1e6,
                "this host's clock is within fleet.max_clock_skew ({bound_s}) of the store's"
            );
        }
    }
}

/// The clock task: this host's clock measured against the store's at once, and every
/// [`CLOCK_EVERY`]. A failed measurement changes nothing (and the next one connects again).
pub(super) async fn clock_task(settings: Arc<Settings>, shared: Arc<Shared>) -> anyhow::Result<()> {
    let mut conn: Option<Conn> = None;
    let mut tick = tokio::time::interval(CLOCK_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        match measure_clock(&settings, &mut conn).await {
            Ok(sample) => shared.clock_measured(&settings.clock, sample),
            Err(e) => {
                conn = None;
                tracing::debug!("measuring the clock against the store's: {e:#}");
                shared.clock_failed(format!("{e:#}"));
            }
        }
    }
}

/// [`CLOCK_SAMPLES`] `TIME` round trips; the fastest.
async fn measure_clock(
    settings: &Settings,
    conn: &mut Option<Conn>,
) -> anyhow::Result<ClockSample> {
    if conn.is_none() {
        *conn = Some(settings.connect(REQUEST_TIMEOUT).await?);
    }
    let c = conn.as_mut().expect("connected above");
    let mut samples = Vec::with_capacity(CLOCK_SAMPLES);
    for _ in 0..CLOCK_SAMPLES {
        let sent_ns = crate::clock::wall_ns() as i64;
        let (secs, micros): (i64, i64) = redis::cmd("TIME")
            .query_async(c)
            .await
            .context("reading the store's clock (TIME)")?;
        let recv_ns = crate::clock::wall_ns() as i64;
        samples.push(ClockSample {
            sent_ns,
            recv_ns,
            store_ns: secs * 1_000_000_000 + micros * 1000,
        });
    }
    Ok(best_sample(&samples).expect("samples taken"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::{
        collections::VecDeque,
        sync::{Mutex, atomic::AtomicU64},
        time::Instant,
    };

    use super::super::{Inner, trust::Trust};

    #[test]
    fn the_clock_offset_is_the_fastest_sample_s_midpoint_against_the_store() {
        const MS: i64 = 1_000_000;
        // Sent at 1000 ms, answered at 1010 ms; the store said 6005 ms (5 s ahead): the
        // answer arrived 5 ms after the store read its clock, so this host is 5000 ms behind.
        let a = ClockSample {
            sent_ns: 1000 * MS,
            recv_ns: 1010 * MS,
            store_ns: 6005 * MS,
        };
        assert_eq!((a.rtt_ns(), a.offset_ns()), (10 * MS, -5000 * MS));
        // A slower round trip, its answer delayed on the way back: a worse estimate.
        let b = ClockSample {
            sent_ns: 2000 * MS,
            recv_ns: 2200 * MS,
            store_ns: 7001 * MS,
        };
        assert_eq!(b.offset_ns(), -4901 * MS);
        assert_eq!(best_sample(&[b, a, b]), Some(a));
        assert_eq!(best_sample(&[]), None);
        // This host ahead.
        let c = ClockSample {
            sent_ns: 10_000 * MS,
            recv_ns: 10_002 * MS,
            store_ns: 9_700 * MS,
        };
        assert_eq!(c.offset_ns(), 301 * MS);
        // A clock stepped back during the round trip: no negative round trip.
        let d = ClockSample {
            sent_ns: 5 * MS,
            recv_ns: 3 * MS,
            store_ns: 3 * MS,
        };
        assert_eq!((d.rtt_ns(), d.offset_ns()), (0, 0));
    }

    #[test]
    fn the_clock_is_judged_against_the_bound_either_way_when_the_round_trip_is_short() {
        const MS: i64 = 1_000_000;
        let bound = Duration::from_millis(250);
        assert_eq!(judge_clock(0, MS, bound), ClockVerdict::Within);
        assert_eq!(judge_clock(250 * MS, MS, bound), ClockVerdict::Within);
        assert_eq!(judge_clock(-250 * MS, MS, bound), ClockVerdict::Within);
        assert_eq!(judge_clock(251 * MS, MS, bound), ClockVerdict::Over);
        assert_eq!(judge_clock(-5000 * MS, MS, bound), ClockVerdict::Over);
        // Up to half the bound of round trip is trusted; beyond, nothing is decided.
        assert_eq!(judge_clock(-5000 * MS, 125 * MS, bound), ClockVerdict::Over);
        assert_eq!(
            judge_clock(-5000 * MS, 126 * MS, bound),
            ClockVerdict::Untrusted
        );
        assert_eq!(judge_clock(0, 126 * MS, bound), ClockVerdict::Untrusted);
    }

    #[test]
    fn crossing_the_clock_bound_switches_global_counting_with_an_event_each_way() {
        const MS: i64 = 1_000_000;
        let dir = std::env::temp_dir().join(format!("rl-fleet-clock-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("events.jsonl");
        let sink = config::EventsSink::File(file.clone());
        let shared = Shared {
            inner: Mutex::new(Inner::default()),
            outbox: Mutex::new(VecDeque::new()),
            outbox_gen: AtomicU64::new(0),
            cursor_file: Mutex::new(()),
            events: events::Events::start(Some(&sink), 1000, vec![]).unwrap(),
            global: Arc::default(),
            trust: Arc::new(Trust::new("default", None, Default::default())),
        };
        let clock = Clock::new(Duration::from_millis(250));
        let at = |offset_ms: i64, rtt_ms: i64| ClockSample {
            sent_ns: 1_000_000 * MS,
            recv_ns: (1_000_000 + rtt_ms) * MS,
            store_ns: (1_000_000 + rtt_ms - offset_ms) * MS - rtt_ms * MS / 2,
        };
        // Not counting until measured; a measurement not trusted changes nothing.
        assert!(!clock.counting());
        shared.clock_measured(&clock, at(0, 200));
        assert!(!clock.counting());
        assert!(
            shared
                .report()
                .clock
                .last_error
                .unwrap()
                .contains("not trusted")
        );
        shared.clock_measured(&clock, at(-30, 2));
        let r = shared.report().clock;
        assert!(clock.counting() && r.counting && !r.over_bound, "{r:?}");
        assert_eq!(r.offset_ms, Some(-30.0));
        shared.clock_measured(&clock, at(-5000, 2));
        let r = shared.report().clock;
        assert!(
            !clock.counting() && r.over_bound && r.over_since.is_some(),
            "{r:?}"
        );
        // Still over: no second event; a failed measurement keeps the state.
        shared.clock_measured(&clock, at(-4990, 2));
        shared.clock_failed("refused".into());
        assert!(!clock.counting());
        shared.clock_measured(&clock, at(100, 2));
        let r = shared.report().clock;
        assert!(
            clock.counting() && !r.over_bound && r.over_since.is_none(),
            "{r:?}"
        );
        let give_up = Instant::now() + Duration::from_secs(5);
        let lines = loop {
            let text = std::fs::read_to_string(&file).unwrap_or_default();
            let lines: Vec<serde_json::Value> = text
                .lines()
                .map(|l| serde_json::from_str(l).unwrap())
                .collect();
            if lines.len() >= 2 || Instant::now() > give_up {
                break lines;
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        assert_eq!(lines.len(), 2, "{lines:?}");
        assert_eq!(lines[0]["event"], "fleet_clock_skew");
        assert_eq!(lines[0]["offset_ms"], -5000.0);
        assert_eq!(lines[0]["max_skew_ms"], 250);
        assert_eq!(lines[1]["event"], "fleet_clock_restored");
        assert_eq!(lines[1]["offset_ms"], 100.0);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
