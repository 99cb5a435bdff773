//! The owner's pressure level: the sampler's readings taken in, the operator's mode, the level
//! written to the data plane and reported, and the mode saved in `state_dir`.

use std::time::{Instant, SystemTime};

use tracing::{error, info};

use super::{Handle, State};
use crate::{
    durable::{self, Loaded, aside_words},
    events,
    policy::apply,
    policy::pressure,
};

impl State {
    /// The pressure level as `ratelimit pressure` shows it.
    pub fn pressure_report(&self) -> pressure::Report {
        let p = &self.pressure;
        let (mono, wall) = (Instant::now(), SystemTime::now());
        let wall_of = |t: Instant| crate::clock::rfc3339(wall - mono.saturating_duration_since(t));
        pressure::Report {
            level: p.level(),
            mode: p.mode(),
            auto_level: p.auto_level(),
            since: wall_of(p.since()),
            last_above: p.last_above().map(wall_of),
            hold_secs: p.marks().hold.as_secs_f64(),
            cpus: if self.cfg.pressure.cpus.is_empty() {
                self.rx_cpus.cached().to_vec()
            } else {
                self.cfg.pressure.cpus.clone()
            },
            signals: p.readings(),
            transitions: p.transitions(),
            not_saved: self.pressure_not_saved.clone(),
            data_plane: apply::read_relaxed(&self.maps).map(|relaxed| {
                if relaxed {
                    pressure::Level::Low
                } else {
                    pressure::Level::High
                }
            }),
        }
    }

    /// The CPUs `cpu_busy` watches: `pressure.cpus`, else the attached interfaces' receive
    /// CPUs; empty: every CPU.
    pub(super) fn watched_cpus(&mut self, now: Instant) -> Vec<u32> {
        if !self.cfg.pressure.cpus.is_empty() {
            return self.cfg.pressure.cpus.clone();
        }
        let ifaces: Vec<String> = self.dp.attached.iter().map(|a| a.iface.clone()).collect();
        self.rx_cpus.get(&ifaces, now).to_vec()
    }

    /// The sampler's readings, taken at `at`: the rates since the last ones, and the level.
    pub fn observe_pressure(&mut self, counters: pressure::Counters, at: Instant) {
        let watched = self.watched_cpus(at);
        let sample = match &self.pressure_counters {
            Some((before, then)) => pressure::Sample::between(
                before,
                &counters,
                at.saturating_duration_since(*then),
                &watched,
            ),
            None => pressure::Sample::default(),
        };
        self.pressure_counters = Some((counters, at));
        let change = self.pressure.observe(sample, at);
        self.pressure_changed(change);
        // Whatever became of the last write: the data plane holds the level, or gets it
        // again now.
        let held = apply::read_relaxed(&self.maps);
        let (relaxed, maps) = (self.relaxed(), &mut self.maps);
        self.level_sync
            .tick(relaxed, held, |r| apply::write_relaxed(maps, r));
    }

    /// `pressure set`: the mode from now on, saved to `state_dir` for the next start. A mode
    /// that cannot be saved is in force all the same (an operator forcing the level in an
    /// emergency should not depend on the disk); the answer says it was not saved.
    pub(super) fn pressure_set(&mut self, mode: pressure::Mode) -> pressure::Report {
        let saved = pressure::Saved { mode };
        self.pressure_not_saved = serde_json::to_vec(&saved)
            .map_err(anyhow::Error::from)
            .and_then(|bytes| {
                crate::durable::write_atomically(&self.cfg.daemon.state_dir, pressure::FILE, &bytes)
            })
            .err()
            .map(|e| {
                let why = format!("{e:#}; the mode holds until the daemon stops");
                error!("saving the pressure mode: {why}");
                why
            });
        info!(%mode, "pressure mode set");
        let change = self.pressure.set_mode(mode, Instant::now());
        self.pressure_changed(change);
        self.pressure_report()
    }

    /// Log and write the event of a change of the level.
    pub(super) fn pressure_changed(&mut self, change: Option<pressure::Transition>) {
        let Some(t) = change else { return };
        // The data plane first: elastic limits follow the level within the sampler's period.
        self.write_level();
        let above: Vec<&str> = t.above.iter().map(|r| r.signal.name()).collect();
        info!(
            level = t.level.name(),
            mode = t.mode.name(),
            above = above.join(","),
            "pressure {}",
            t.level.name()
        );
        self.events.pressure(events::PressureLine {
            time: crate::clock::rfc3339(SystemTime::now()),
            event: match t.level {
                pressure::Level::High => "pressure_high",
                pressure::Level::Low => "pressure_low",
            },
            mode: t.mode,
            cause: t.cause,
            signals: t.above,
        });
    }

    /// Whether the host has room: the elastic limits are in force.
    pub fn relaxed(&self) -> bool {
        self.pressure.level() == pressure::Level::Low
    }

    /// Write the level into the data plane (a failure is logged; the sampler's next tick
    /// finds the data plane holding the other level and writes it again, [`pressure::LevelSync`]).
    pub(super) fn write_level(&mut self) {
        let relaxed = self.relaxed();
        if let Err(e) = apply::write_relaxed(&mut self.maps, relaxed) {
            error!("writing the pressure level to the data plane: {e:#}");
        }
    }
}

/// The pressure sampler: reads the counters every [`pressure::SAMPLE_PERIOD`] and hands them
/// to the owner. `/proc/net/netstat` is the network namespace's the daemon runs in. A failed
/// read ends this run (the supervisor shows it and restarts it); the restarted run's first
/// reading is a new base, with no rates.
pub(super) async fn sample_pressure(handle: Handle) -> anyhow::Result<()> {
    let mut tick = tokio::time::interval(pressure::SAMPLE_PERIOD);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let counters = pressure::read_counters()?;
        let at = Instant::now();
        handle
            .with(move |s| s.observe_pressure(counters, at))
            .await?;
    }
}

/// The operator's pressure mode saved in `state_dir`: `auto` if there is none. A file that
/// cannot be read is moved aside (and the mode is `auto`), as for the other saved state.
pub(super) fn load_pressure_mode(dir: &std::path::Path) -> pressure::Mode {
    let path = dir.join(pressure::FILE);
    match durable::load(&path, |b: &[u8]| {
        serde_json::from_slice::<pressure::Saved>(b)
    }) {
        Loaded::Read(saved) => {
            info!(mode = %saved.mode, "pressure mode restored from {}", path.display());
            saved.mode
        }
        Loaded::Missing => pressure::Mode::Auto,
        Loaded::Unreadable(e) => {
            error!(
                "reading {}: {e}; the pressure mode is auto until `ratelimit pressure set`",
                path.display()
            );
            pressure::Mode::Auto
        }
        Loaded::Bad { error: e, aside } => {
            error!(
                "{} is not a saved pressure mode ({e}); it was {}; the pressure mode is auto",
                path.display(),
                aside_words(&aside)
            );
            pressure::Mode::Auto
        }
    }
}
