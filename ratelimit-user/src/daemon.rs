//! The daemon: loads and attaches the program, applies the config, and runs its tasks.
//!
//! ## Who owns what, and who may wait for whom
//! - **The owner task** ([`own`]) alone holds [`State`]: the config, the map handles it writes
//!   through and the datapath. It takes jobs from one bounded channel ([`Handle::with`]) and
//!   runs them one at a time: the control socket's changes (`ban add`, `ban del`, `rule set`,
//!   `reload`), SIGHUP's reload, the persistence task's sweep and save, the interface
//!   watcher's re-attach. It waits for nothing but the kernel's map calls and the disk.
//! - **Reports** (`status`, `stats`, `top`, `offenders`, `bans`, `/metrics`) run off the owner
//!   task ([`crate::serve::reader`]): map handles of their own, the [`reader::View`] the owner
//!   publishes after each job, the blocking pool, [`reader::REPORTS_AT_ONCE`] at a time. A
//!   report waits for a turn, never for the owner; the owner never waits for a report.
//! - **The events reader** drains the ring buffer into the events writer's queue (a thread of
//!   its own, `events.rs`) and leaves what the bans bookkeeping needs in a mailbox the owner
//!   empties ([`BanNews`]): it waits for no one.
//! - **Control connections and the HTTP listener** wait for the owner (a change) or a report
//!   turn (a report), each bounded: the HTTP listener answers 503 after its request timeout.
//! - **The pressure sampler** reads `/proc/stat` and `/proc/net/netstat` every
//!   [`crate::policy::pressure::SAMPLE_PERIOD`] and hands the readings to the owner, which keeps the
//!   level ([`State::pressure`]).
//! - **Ban persistence and the interface watcher** hand their work to the owner as jobs and
//!   wait for it; they run under a supervisor ([`crate::supervise`]): one that fails is
//!   restarted with backoff and shown in `status` and `/metrics`.
//!
//! SIGTERM and SIGINT leave the program attached and enforcing (its links are pinned);
//! `ratelimit detach` removes it.

pub mod lock;
use std::{
    collections::BTreeMap,
    path::PathBuf,
    sync::Arc,
    time::{Duration, Instant, SystemTime},
};

use anyhow::{Context as _, bail};
use aya::maps::{MapData, RingBuf};
use ipnet::IpNet;
use ratelimit_common::{
    addr::IpKey,
    event::{EV_BAN, EV_UNBAN, Event},
    maps::*,
};
use tokio::{
    io::{AsyncBufReadExt as _, AsyncWriteExt as _, BufReader, unix::AsyncFd},
    sync::{Mutex, Notify, mpsc, oneshot},
};
use tracing::{error, info, warn};

use crate::{
    api::{self, Answer, BanLifted, BanSpec, BansAdded, BansRemoved, Reloaded, Request, Response},
    config::{self, Config},
    events::{self, Events},
    kernel::datapath::{Attached, Datapath, Maps},
    policy::apply::{self, prefix},
    policy::bans,
    policy::pressure::{self, Pressure},
    policy::report,
    serve::reader::{self, Reports},
    supervise,
};

pub struct Options {
    pub config_path: Option<PathBuf>,
    pub ifaces: Vec<String>,
    pub xdp_mode: Option<config::XdpMode>,
    pub preview: bool,
}

pub struct State {
    pub cfg: Config,
    pub opts_ifaces: Vec<String>,
    pub config_path: Option<PathBuf>,
    pub preview_all: bool,
    pub xdp_mode_override: Option<config::XdpMode>,
    pub maps: Maps,
    pub dp: Datapath,
    /// The bans' reasons and origins, shared with the reports' view.
    pub ban_notes: crate::policy::ban_notes::BanNotes,
    /// Where event lines go (a queue to the events writer).
    pub events: Events,
    /// Bans changed since they were last written to `state_dir`.
    pub bans_dirty: bool,
    /// Earliest expiry (CLOCK_MONOTONIC) among the bans this daemon knows of: the expired-ban
    /// sweep walks the ban map only once it has passed. 0 = walk at the next tick.
    pub next_ban_expiry: u64,
    /// What became of the saved bans at start (and whether saving is refused).
    pub bans_restore: bans::RestoreReport,
    /// The reports' side, to publish the view to after every job.
    pub reports: Arc<Reports>,
    /// Live changes (`rule set`, `override add`) over the config file; `cfg` has them applied.
    pub live: crate::policy::live::Live,
    /// The pressure level.
    pub pressure: Pressure,
    /// The sampler's last readings, and when they were taken.
    pub pressure_counters: Option<(pressure::Counters, Instant)>,
    /// Why the operator's last mode could not be saved to `state_dir`.
    pub pressure_not_saved: Option<String>,
    /// Whether the data plane holds the level, checked at every sample.
    pub level_sync: pressure::LevelSync,
    /// The attached interfaces' receive CPUs (`cpu_busy` watches them without `pressure.cpus`).
    pub rx_cpus: crate::kernel::rx_cpus::RxCpus,
    /// Fleet mode (`[fleet]`): where this host's bans are published. `None` without it.
    pub fleet: Option<crate::fleet::Link>,
    /// In fleet mode: when (unix ms) `ban del` last lifted each prefix here, so that a fleet
    /// record issued before (read again from the stream, or from the snapshot at a resync)
    /// does not install it again. At most [`FLEET_LIFTS_MAX`], the latest kept.
    pub fleet_lifts: BTreeMap<String, u64>,
}

/// How many `ban del` times the daemon keeps for the fleet's records (see
/// [`State::fleet_lifts`]).
pub const FLEET_LIFTS_MAX: usize = 100_000;
/// [`State::fleet_lifts`] in `state_dir`, written at every `ban del` in fleet mode: a restart
/// that resyncs from the store's snapshot does not bring back a ban lifted here.
pub const FLEET_LIFTS_FILE: &str = "fleet-lifts.json";

/// The saved [`State::fleet_lifts`]: none if there is no file. A file that cannot be read is
/// moved aside, as for the other saved state.
fn load_fleet_lifts(dir: &std::path::Path) -> BTreeMap<String, u64> {
    let path = dir.join(FLEET_LIFTS_FILE);
    let text = match std::fs::read(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return BTreeMap::new(),
        Err(e) => {
            error!(
                "reading {}: {e}; bans lifted here before may return",
                path.display()
            );
            return BTreeMap::new();
        }
    };
    match serde_json::from_slice::<BTreeMap<String, u64>>(&text) {
        Ok(lifts) => lifts,
        Err(e) => {
            let aside = crate::durable::set_aside(&path, "bad")
                .map(|p| format!("moved to {}", p.display()))
                .unwrap_or_else(|e| format!("could not be moved aside: {e:#}"));
            error!(
                "{} is not a list of lifted bans ({e}); it was {aside}; bans lifted here before \
                 may return",
                path.display()
            );
            BTreeMap::new()
        }
    }
}

/// How often the daemon checks whether the known-sources filter needs a rebuild (a rebuild
/// that took `t` is followed by the next check `10 t` later at the earliest).
pub const KNOWN_REBUILD_PERIOD: Duration = Duration::from_secs(10);

/// A job for the owner task.
type Job = Box<dyn FnOnce(&mut State) + Send>;

/// Jobs waiting for the owner task at most; more wait to be queued.
const JOBS_QUEUED: usize = 64;

/// How the daemon's other tasks reach it: changes as jobs for the owner task, reports on
/// their own handles.
#[derive(Clone)]
pub struct Handle {
    jobs: mpsc::Sender<Job>,
    pub reports: Arc<Reports>,
}

impl crate::fleet::global::Owner for Handle {
    async fn rules(&self) -> anyhow::Result<Vec<crate::fleet::global::GlobalRule>> {
        self.with(|s| crate::fleet::global::GlobalRule::of(&s.live_rules()))
            .await
    }

    async fn check_clock(&self) -> anyhow::Result<bool> {
        self.with(|s| {
            apply::refresh_wall_offset(&mut s.maps, crate::fleet::global::CLOCK_TOLERANCE_NS)
        })
        .await?
    }
}

impl Handle {
    /// Run `f` on the owner task and wait for its result.
    pub async fn with<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut State) -> T + Send + 'static,
    ) -> anyhow::Result<T> {
        let (tx, rx) = oneshot::channel();
        self.jobs
            .send(Box::new(move |s: &mut State| {
                let _ = tx.send(f(s));
            }))
            .await
            .map_err(|_| anyhow::anyhow!("the daemon is stopping"))?;
        rx.await
            .map_err(|_| anyhow::anyhow!("the daemon is stopping"))
    }

    /// The control API's answer to `req`: a report here, a change on the owner task.
    pub async fn request(&self, req: Request) -> Response {
        if Reports::is_report(&req) {
            return self.reports.run(req).await;
        }
        self.with(move |s| s.handle(req))
            .await
            .unwrap_or_else(|e| Response::err(format!("{e:#}")))
    }
}

/// The HTTP listener's routes answer through the daemon's handle.
impl crate::serve::http::Backend for Handle {
    async fn request(&self, req: Request) -> api::Response {
        Handle::request(self, req).await
    }

    async fn snapshot(
        &self,
    ) -> anyhow::Result<(crate::policy::report::Stats, crate::serve::http::Gauges)> {
        self.reports.with_turn(crate::serve::http::snapshot).await?
    }
}

/// The owner task: runs jobs and applies the events reader's news, one at a time, and
/// publishes the reports' view after each job. Ends when every [`Handle`] is gone.
async fn own(mut s: State, mut jobs: mpsc::Receiver<Job>, news: Arc<NewsBox>) {
    loop {
        tokio::select! {
            job = jobs.recv() => match job {
                Some(job) => {
                    // Map calls are syscalls: off the async workers.
                    tokio::task::block_in_place(|| job(&mut s));
                    let view = s.view();
                    s.reports.publish(view);
                }
                None => break,
            },
            // Bookkeeping only: nothing the reports show.
            _ = news.ready.notified() => {
                tokio::task::block_in_place(|| news.take().apply_to(&mut s));
            }
        }
    }
}

/// One ban write of a request, to undo it: (table, prefix length, address, the ban that was
/// there before: `None` = none).
type BanUndo = (u32, u32, IpKey, Option<BanEntry>);

fn load_config(path: Option<&PathBuf>) -> anyhow::Result<Config> {
    match path {
        Some(p) => config::load(p).map_err(|e| anyhow::anyhow!("{e}")),
        None => Ok(config::parse("<defaults>", "").map_err(|e| anyhow::anyhow!("{e}"))?),
    }
}

impl State {
    /// What the reports need to know of the config and the datapath.
    pub fn view(&self) -> reader::View {
        reader::View {
            rule_names: self.rule_names(),
            remote_bans_spilled: self.maps.remote_bans_spilled,
            live_rules: self.live_rules(),
            ban_notes: self.ban_notes.clone(),
            ifaces: self.ifaces(),
            attached: self.dp.attached.clone(),
            max_sources: self.cfg.tracking.max_sources,
            admission: (&self.cfg.tracking).into(),
            config: self.config_path.as_ref().map(|p| p.display().to_string()),
            adopted: self.dp.adopted,
            bpffs_dir: self.cfg.daemon.bpffs_dir.display().to_string(),
            preview_all: self.preview_all,
            program: self.dp.program_info(),
            bans_restore: self.bans_restore.clone(),
            live_changes: self.live.report.clone(),
            pressure: self.pressure_report(),
            thresholds: self
                .cfg
                .rules
                .iter()
                .map(|r| reader::RuleThreshold {
                    rule: r.name.clone(),
                    threshold: r.threshold.to_string(),
                    elastic: r.elastic.map(crate::config::Elastic::factor),
                    threshold_now: crate::policy::live::threshold_now(r, self.relaxed())
                        .to_string(),
                })
                .collect(),
        }
    }

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
    fn watched_cpus(&mut self, now: Instant) -> Vec<u32> {
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
    fn pressure_set(&mut self, mode: pressure::Mode) -> pressure::Report {
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
    fn pressure_changed(&mut self, change: Option<pressure::Transition>) {
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
    fn write_level(&mut self) {
        let relaxed = self.relaxed();
        if let Err(e) = apply::write_relaxed(&mut self.maps, relaxed) {
            error!("writing the pressure level to the data plane: {e:#}");
        }
    }

    pub fn rule_names(&self) -> Vec<String> {
        self.cfg.rules.iter().map(|r| r.name.clone()).collect()
    }

    /// Rules as the data plane holds them (live `rule set` changes included), each with its
    /// limit in force now as `limit` (its elastic limit while the pressure level is low), so
    /// client reports measure usage against what the program meters.
    pub fn live_rules(&self) -> Vec<(String, RuleConfig)> {
        let relaxed = self.relaxed();
        self.cfg
            .rules
            .iter()
            .enumerate()
            .map(|(i, r)| {
                (r.name.clone(), {
                    let mut rc = self
                        .maps
                        .rules
                        .get(&(i as u32), 0)
                        .unwrap_or_else(|_| apply::rule_config(r));
                    rc.limit = *rc.limit_now(relaxed);
                    rc
                })
            })
            .collect()
    }

    fn ifaces(&self) -> Vec<(u32, String)> {
        self.dp.counter_slots()
    }

    fn interfaces_wanted(&self) -> Vec<String> {
        interfaces_wanted(&self.cfg, &self.opts_ifaces)
    }

    /// Note that bans changed; the persistence task writes them within a second. (Writing
    /// synchronously would make a 100k-entry `ban add` wait for a 100k-entry walk.)
    pub fn bans_changed(&mut self) {
        self.bans_dirty = true;
    }

    /// Write the bans to `state_dir`. On failure they stay marked changed, for the next try.
    /// Refused while the bans file found at start could neither be read nor moved aside (it
    /// may be the only copy of the bans): until the operator moves it away.
    pub fn save_bans(&mut self) -> anyhow::Result<()> {
        let dir = &self.cfg.daemon.state_dir;
        if let Some(why) = &self.bans_restore.save_refused {
            if dir.join(bans::FILE).exists() {
                self.bans_dirty = true;
                bail!("bans not saved: {why}");
            }
            info!(
                "{} was moved away: saving bans again",
                dir.join(bans::FILE).display()
            );
            self.bans_restore.save_refused = None;
        }
        self.bans_dirty = false;
        let rules = self.live_rules();
        let saved = bans::save(dir, &self.maps, &rules, &self.ban_notes.read());
        if saved.is_err() {
            self.bans_dirty = true;
        }
        saved
    }

    /// `unban` events for bans lifted because their rule is gone.
    fn write_dropped(&mut self, dropped: &[bans::Dropped]) {
        if dropped.is_empty() {
            return;
        }
        let time = crate::clock::rfc3339(SystemTime::now());
        let mut lines = Vec::with_capacity(dropped.len());
        for d in dropped {
            lines.push(events::EventLine {
                time: time.clone(),
                event: "unban",
                rule: d.rule.clone(),
                key: d.key,
                client: d.client.clone(),
                count: 0,
                threshold: 0,
                ban_expires: None,
                origin: None,
            });
        }
        self.events.operator_lines(lines);
        self.bans_changed();
    }

    /// Remove bans that expired without their client coming back (the program lifts a ban
    /// at the client's next packet; this reports the others) and write their `unban` events.
    pub fn sweep_expired_bans(&mut self) -> usize {
        let n = self.sweep_expired_bans_inner();
        if n > 0 {
            self.reports.changed();
        }
        n
    }

    /// Drop what the daemon keeps beside an operator's ban at `cidr` (its reason, and the
    /// host it came from), once the ban is gone: by expiry, `ban del`, or the fleet's unban.
    fn forget_ban_notes(&mut self, cidr: &str) {
        self.ban_notes.write().forget(cidr);
    }

    fn sweep_expired_bans_inner(&mut self) -> usize {
        let now = crate::clock::mono_ns();
        if self.next_ban_expiry == u64::MAX || now < self.next_ban_expiry {
            return 0;
        }
        let mut expired = Vec::new();
        let mut next = u64::MAX;
        for b in self.maps.all_bans() {
            if !ratelimit_common::limiter::ban_active(b.expires_ns, now) {
                expired.push(b);
            } else if b.expires_ns != 0 {
                next = next.min(b.expires_ns);
            }
        }
        self.next_ban_expiry = next;
        let mut lifted = Vec::new();
        for b in expired {
            // The program may have lifted it and issued a fresh ban at the same key since the
            // walk: remove only the entry we saw.
            let table = ban_table(b.flags);
            let addr = IpKey { addr: b.addr };
            match self.maps.ban_at(table, b.prefix_len, &addr) {
                Some(now_there)
                    if now_there.since_ns == b.since_ns && now_there.expires_ns == b.expires_ns => {
                }
                _ => continue,
            }
            if !matches!(self.maps.remove_ban(table, b.prefix_len, &addr), Ok(true)) {
                continue; // the program lifted it first and reported it
            }
            if b.flags & BAN_MANUAL != 0 {
                self.forget_ban_notes(
                    &crate::policy::apply::net_of(b.prefix_len, &addr).to_string(),
                );
            }
            // Capped like the program's own events: rule bans expire by the thousand after
            // a flood.
            lifted.push(Event {
                kind: ratelimit_common::event::EV_UNBAN,
                rule: b.rule,
                key_kind: KEY_IP as u32,
                prefix_len: b.prefix_len,
                addr: b.addr,
                ts_ns: b.expires_ns,
                count: 0,
                threshold: 0,
                expires_ns: b.expires_ns,
            });
        }
        let n = lifted.len();
        self.events.data_plane(lifted);
        if n > 0 {
            self.bans_changed();
        }
        n
    }

    pub fn handle(&mut self, req: Request) -> Response {
        let changes = !Reports::is_report(&req);
        let resp = match self.try_handle(req) {
            Ok(r) => r,
            Err(e) => Response::err(format!("{e:#}")),
        };
        if changes {
            // Even a failed change may have undone part of itself.
            self.reports.changed();
        }
        resp
    }

    fn try_handle(&mut self, req: Request) -> anyhow::Result<Response> {
        Ok(match req {
            // Reports are answered off this task (`Handle::request`); here only when asked
            // directly.
            Request::Status
            | Request::Stats
            | Request::Top { .. }
            | Request::Bans { .. }
            | Request::Offenders { .. }
            | Request::Fleet => self.reports.answer(req),
            // It waits for the store: never here.
            Request::FleetKey { .. } => {
                Response::err("fleet key is answered off the owner task (the reports' side)")
            }
            Request::BanAdd { bans, local } => {
                Response::ok(Answer::BanAdd(self.ban_add(&bans, local)?))
            }
            Request::BanDel { cidrs, local } => {
                Response::ok(Answer::BanDel(self.ban_del(&cidrs, local)?))
            }
            Request::BanLift { rule, region } => {
                Response::ok(Answer::BanLift(self.ban_lift(&rule, region.as_deref())?))
            }
            Request::RuleSet { name, changes } => {
                Response::ok(Answer::RuleSet(self.live.rule_set(
                    &mut self.maps,
                    &mut self.cfg,
                    self.preview_all,
                    &name,
                    &changes,
                )?))
            }
            Request::RuleReset { name } => Response::ok(Answer::RuleReset(self.live.rule_reset(
                &mut self.maps,
                &mut self.cfg,
                self.preview_all,
                &name,
            )?)),
            Request::Rules => {
                Response::ok(Answer::Rules(self.live.rules(&self.cfg, self.relaxed())))
            }
            Request::OverrideAdd { spec } => Response::ok(Answer::OverrideAdd(
                self.live
                    .override_add(&mut self.maps, &mut self.cfg, self.preview_all, &spec)?,
            )),
            Request::OverrideDel { at } => Response::ok(Answer::OverrideDel(
                self.live
                    .override_del(&mut self.maps, &mut self.cfg, self.preview_all, &at)?,
            )),
            Request::Overrides => Response::ok(Answer::Overrides(self.live.overrides(&self.cfg))),
            Request::Reload => Response::ok(Answer::Reload(self.reload()?)),
            Request::Pressure => Response::ok(Answer::Pressure(Box::new(self.pressure_report()))),
            Request::PressureSet { mode } => {
                Response::ok(Answer::PressureSet(Box::new(self.pressure_set(mode))))
            }
        })
    }

    /// `ban add`, all or nothing: every entry is checked before any is applied, and if a
    /// map write fails midway (the ban map is full) the bans this request inserted are
    /// removed and the ones it replaced put back, with no event for any of them.
    fn ban_add(&mut self, specs: &[BanSpec], local: bool) -> anyhow::Result<BansAdded> {
        let mut parsed = Vec::with_capacity(specs.len());
        for (n, s) in specs.iter().enumerate() {
            // The config's parser: a ban takes what `allow`, `deny` and overrides take.
            let net =
                config::parse_net(&s.cidr).map_err(|e| anyhow::anyhow!("entry {}: {e}", n + 1))?;
            if let Some(ms) = s.duration_ms {
                crate::config::check_ban_duration(Duration::from_millis(ms)).map_err(|e| {
                    anyhow::anyhow!("entry {}: {}: the ban's duration {e}", n + 1, s.cidr)
                })?;
            }
            parsed.push((net, s));
        }
        let now = crate::clock::mono_ns();
        let mut undo = Vec::new();
        let inserted = self.insert_bans(&parsed, now, &mut undo);
        if inserted.is_err() {
            self.undo_ban_writes(undo);
        }
        // Whatever was written (and undone), before any error is reported.
        self.maps
            .flush_ban_epoch()
            .context("voiding the program's fast-drop entries")?;
        inserted?;
        let mut added = Vec::with_capacity(parsed.len());
        let mut records = Vec::new();
        for (net, s) in &parsed {
            let (plen, key) = prefix(net);
            let entry = BanEntry::manual(plen, key.addr, now, ban_end(now, s.duration_ms));
            if entry.expires_ns != 0 {
                self.next_ban_expiry = self.next_ban_expiry.min(entry.expires_ns);
            }
            if let Some(f) = self.fleet.as_ref().filter(|_| !local) {
                let mut r = f.record(
                    crate::fleet::Op::Ban,
                    net.to_string(),
                    crate::fleet::unix_ms_of_mono(entry.expires_ns),
                    None,
                );
                r.reason = s.reason.clone();
                records.push(r);
            }
            added.push(ban_event(EV_BAN, &entry, now));
            self.ban_notes
                .write()
                .set_reason(&net.to_string(), s.reason.as_deref());
        }
        self.bans_changed();
        self.events.operator(added);
        if let Some(f) = &self.fleet {
            f.publish(records);
        }
        Ok(BansAdded {
            added: parsed.len(),
        })
    }

    /// Insert operator bans; `undo` gets, for each one written, its key and the entry it
    /// replaced. The error names the entry that failed and says nothing was applied (the
    /// caller undoes the rest).
    fn insert_bans(
        &mut self,
        parsed: &[(IpNet, &BanSpec)],
        now: u64,
        undo: &mut Vec<BanUndo>,
    ) -> anyhow::Result<()> {
        for (n, (net, s)) in parsed.iter().enumerate() {
            let (plen, key) = prefix(net);
            let entry = BanEntry::manual(plen, key.addr, now, ban_end(now, s.duration_ms));
            let before = self.maps.replace_ban_deferred(entry).map_err(|e| {
                anyhow::anyhow!(
                    "entry {}: {net}: adding the ban failed: {e} (the operator's ban table holds \
                     {} entries); nothing of this request was applied",
                    n + 1,
                    ratelimit_common::caps::MAX_OPERATOR_BANS
                )
            })?;
            undo.push((ban_table(entry.flags), plen, key, before));
        }
        Ok(())
    }

    /// Undo ban writes of a failed request, newest first: remove what it inserted, put back
    /// what it replaced or removed (`None` = there was no ban at that key before).
    fn undo_ban_writes(&mut self, undo: Vec<BanUndo>) {
        for (table, plen, key, before) in undo.into_iter().rev() {
            let res = match before {
                Some(entry) => self.maps.insert_ban_deferred(entry),
                None => self.maps.remove_ban(table, plen, &key).map(drop),
            };
            if let Err(e) = res {
                let net = crate::policy::apply::net_of(plen, &key);
                error!("undoing a failed ban request at {net}: {e}");
            }
        }
    }

    /// `ban del`, all or nothing like `ban add`: every entry is parsed before any ban is
    /// removed, and a removal that fails midway puts back the bans this request removed, with
    /// no `unban` event for them. Entries with no ban are reported, not an error, unless none
    /// of the entries had one.
    fn ban_del(&mut self, cidrs: &[String], local: bool) -> anyhow::Result<BansRemoved> {
        let mut nets = Vec::with_capacity(cidrs.len());
        for (n, c) in cidrs.iter().enumerate() {
            nets.push(config::parse_net(c).map_err(|e| anyhow::anyhow!("entry {}: {e}", n + 1))?);
        }
        let mut undo = Vec::new();
        let mut lifted = Vec::new();
        let mut missing = Vec::new();
        let mut failed = None;
        'nets: for (n, net) in nets.iter().enumerate() {
            let (plen, key) = prefix(net);
            let mut found = false;
            // The bans at this prefix in every table (the operator's, and rule bans).
            for entry in self.maps.bans_at(plen, &key) {
                let table = ban_table(entry.flags);
                match self.maps.remove_ban(table, plen, &key) {
                    Ok(true) => {
                        found = true;
                        undo.push((table, plen, key, Some(entry)));
                        lifted.push(ban_event(EV_UNBAN, &entry, crate::clock::mono_ns()));
                    }
                    // Expired and lifted by the program since the lookup: not an error.
                    Ok(false) => {}
                    Err(e) => {
                        failed = Some(anyhow::anyhow!(
                            "entry {}: {net}: removing the ban failed: {e}; nothing of this request was applied",
                            n + 1
                        ));
                        break 'nets;
                    }
                }
            }
            if !found {
                missing.push(net.to_string());
            }
        }
        if let Some(e) = failed {
            self.undo_ban_writes(undo);
            self.maps
                .flush_ban_epoch()
                .context("voiding the program's fast-drop entries")?;
            return Err(e);
        }
        for net in &nets {
            self.forget_ban_notes(&net.to_string());
        }
        let removed = lifted.len();
        let mut published_only = Vec::new();
        if let Some(f) = &self.fleet {
            let now_ms = crate::fleet::unix_ms(std::time::SystemTime::now());
            for n in &nets {
                self.fleet_lifts.insert(n.to_string(), now_ms);
            }
            if self.fleet_lifts.len() > FLEET_LIFTS_MAX {
                let mut times: Vec<u64> = self.fleet_lifts.values().copied().collect();
                let cut = FLEET_LIFTS_MAX / 2;
                times.select_nth_unstable_by(cut, |a, b| b.cmp(a));
                let keep_from = times[cut];
                self.fleet_lifts.retain(|_, at| *at > keep_from);
            }
            match serde_json::to_vec(&self.fleet_lifts) {
                Ok(bytes) => {
                    if let Err(e) = crate::durable::write_atomically(
                        &self.cfg.daemon.state_dir,
                        FLEET_LIFTS_FILE,
                        &bytes,
                    ) {
                        warn!(
                            "saving {FLEET_LIFTS_FILE}: {e:#}; a restart may bring back a ban lifted now"
                        );
                    }
                }
                Err(e) => warn!("encoding {FLEET_LIFTS_FILE}: {e}"),
            }
            // An `unban` for the fleet: lifts the ban on every host (whichever issued it),
            // also where this host holds none (ended here, or never installed).
            if !local && f.settings.share_bans {
                let records = nets
                    .iter()
                    .map(|n| f.record(crate::fleet::Op::Unban, n.to_string(), 0, None))
                    .collect();
                f.publish(records);
                published_only = std::mem::take(&mut missing);
            }
        }
        self.bans_changed();
        self.events.operator(lifted);
        if removed == 0 && !missing.is_empty() {
            bail!("no such ban: {}", missing.join(", "));
        }
        Ok(BansRemoved {
            removed,
            not_found: missing,
            published_only,
        })
    }

    /// Lift the aggregate ban of a rule keyed `all` or `region` (IP bans are removed by
    /// prefix). The shared state's meters start clean, as when a ban ends on its own; its
    /// totals stay. An `unban` event line says so, and the saved bans drop it.
    fn ban_lift(&mut self, rule: &str, region: Option<&str>) -> anyhow::Result<BanLifted> {
        let rules = self.live_rules();
        let Some(i) = rules.iter().position(|(n, _)| n == rule) else {
            bail!(
                "no rule named {rule:?} (rules: {})",
                self.rule_names().join(", ")
            );
        };
        let r = rules[i].1;
        if r.key != KEY_ALL && r.key != KEY_REGION {
            bail!(
                "rule {rule:?} is keyed {}: its bans are per client; remove one with `ratelimit ban del CIDR`",
                crate::policy::report::key_name(r.key)
            );
        }
        if r.action != ACTION_BAN {
            bail!("rule {rule:?} does not ban (its action is not rate_based_ban)");
        }
        let mut key = ClientKey {
            rule: i as u8,
            kind: r.key,
            ..ClientKey::default()
        };
        match (r.key, region) {
            (KEY_REGION, Some(cc)) => {
                let cc = cc.to_ascii_uppercase();
                match cc.as_bytes() {
                    &[x, y] if x.is_ascii_uppercase() && y.is_ascii_uppercase() => {
                        key.addr[0] = x;
                        key.addr[1] = y;
                    }
                    _ => bail!("--region {cc:?}: expected a two-letter region code, e.g. NL"),
                }
            }
            (KEY_REGION, None) => {
                bail!("rule {rule:?} is keyed region: say which region's ban with --region CC")
            }
            (_, Some(_)) => bail!("rule {rule:?} is keyed all: it has one ban, no --region"),
            (_, None) => {}
        }
        let now = crate::clock::mono_ns();
        let what = match region {
            Some(cc) => format!("rule {rule:?} in region {}", cc.to_ascii_uppercase()),
            None => format!("rule {rule:?}"),
        };
        let st = match self.maps.clients.shared.get(&key, 0) {
            Ok(st) if st.banned_until_ns > now => st,
            _ => bail!("no ban in force for {what}"),
        };
        // The meters are clean already: the program clears them when it issues a ban, and a
        // banned key's packets are not metered.
        let lifted = SharedState {
            banned_until_ns: 0,
            ..st
        };
        // BPF_EXIST: the state must still be there (an expiry in between would have lifted
        // it already).
        self.maps
            .clients
            .shared
            .insert(key, lifted, 2)
            .with_context(|| format!("lifting the ban of {what}"))?;
        self.events.operator(vec![Event {
            kind: EV_UNBAN,
            rule: u32::from(key.rule),
            key_kind: u32::from(key.kind),
            prefix_len: key.prefix_len,
            addr: key.addr,
            ts_ns: now,
            count: 0,
            threshold: 0,
            expires_ns: 0,
        }]);
        info!(%what, "aggregate ban lifted");
        self.bans_changed();
        Ok(BanLifted {
            lifted: 1,
            rule: rule.to_string(),
            key: report::Key::of(key.kind),
            region: region.map(|c| c.to_ascii_uppercase()),
        })
    }

    /// Re-read the config file and apply it whole, or not at all. Everything that can fail
    /// is prepared first (the config read and checked, the GeoIP database read, each new
    /// interface found and its entry point chosen, a new events file opened); then the new
    /// interfaces are attached and the maps written. If an attach or a map write still fails,
    /// what this reload did is undone (the interfaces it attached detached, the old config's
    /// maps written again) and the old config keeps running; the error names what failed.
    pub fn reload(&mut self) -> anyhow::Result<Reloaded> {
        let Some(path) = self.config_path.clone() else {
            bail!("the daemon was started without --config; nothing to reload");
        };
        const REJECTED: &str = "reload rejected, the running config is unchanged";
        let file = config::load(&path).map_err(|e| anyhow::anyhow!("{REJECTED}:\n{e}"))?;
        // The live changes that still fit the new file, applied on top of it.
        let resolved = self.live.resolve(file);
        let cfg = resolved.config.clone();
        if cfg.tracking.max_sources != self.cfg.tracking.max_sources {
            warn!(
                "tracking.max_sources changes take effect after `ratelimit detach` and a restart"
            );
        }
        if cfg.fleet != self.cfg.fleet {
            warn!("[fleet] changes take effect after a restart of the daemon");
        }
        // Prepare: nothing below touches a map or an interface.
        let regions = match &cfg.geoip {
            Some(g) => Some(crate::policy::geoip::load(&g.database).context(REJECTED)?),
            None => None,
        };
        let wanted = interfaces_wanted(&cfg, &self.opts_ifaces);
        let mut to_attach = Vec::new();
        for iface in &wanted {
            // Not attached yet, or re-created since (a new ifindex under the same name).
            let current = crate::kernel::datapath::ifindex(iface)
                .with_context(|| format!("{REJECTED}: interface {iface}"))?;
            crate::kernel::datapath::Entry::for_iface(iface)
                .with_context(|| format!("{REJECTED}: interface {iface}"))?;
            if !self
                .dp
                .attached
                .iter()
                .any(|a| &a.iface == iface && a.ifindex == current)
            {
                to_attach.push(iface.clone());
            }
        }
        let new_output = if cfg.daemon.events != self.cfg.daemon.events {
            Some(
                events::Output::open(cfg.daemon.events.as_ref())
                    .with_context(|| format!("{REJECTED}: the events sink"))?,
            )
        } else {
            None
        };
        let plan = apply::plan(&cfg, self.preview_all);
        let mode = self.xdp_mode_override.unwrap_or(cfg.daemon.xdp_mode);

        // Attach: the interfaces new to this config, judged by the running config's maps until
        // the maps are written below. One that fails undoes the others.
        let mut attached_now = Vec::new();
        for iface in &to_attach {
            let was = self.dp.attached.iter().find(|a| &a.iface == iface).cloned();
            match self.dp.attach(iface, mode, &mut self.maps) {
                Ok(_) => attached_now.push((iface.clone(), was)),
                Err(e) => {
                    self.undo_attach(attached_now);
                    return Err(e.context(format!("{REJECTED}: attaching to {iface}")));
                }
            }
        }

        // Commit the maps. A write that fails midway is undone by writing the old config's
        // maps again.
        let old_names = self.rule_names();
        let held = bans::aggregates_by_name(&self.maps, &old_names, crate::clock::mono_ns());
        // Bans issued from here on name the new rules' positions.
        let cut = crate::clock::mono_ns();
        let applied = apply::apply(&mut self.maps, &plan).and_then(|()| match &regions {
            Some(table) => crate::policy::geoip::apply(&mut self.maps.regions, table).map(drop),
            None => Ok(()),
        });
        if let Err(e) = applied {
            let old_plan = apply::plan(&self.cfg, self.preview_all);
            if let Err(undo) = apply::apply(&mut self.maps, &old_plan) {
                error!("writing the running config's maps again failed: {undo:#}");
            }
            self.undo_attach(attached_now);
            return Err(e.context(format!("{REJECTED}: writing the maps")));
        }
        let new_names: Vec<String> = cfg.rules.iter().map(|r| r.name.clone()).collect();
        let new_rules = config_rules(&cfg);
        let lifted = rules_changed(
            &mut self.maps,
            &old_names,
            &new_names,
            &new_rules,
            &held,
            cut,
        );
        save_rule_names(&cfg.daemon.state_dir, &new_names);
        self.events.set_rule_names(new_names);
        let dropped = resolved.dropped.clone();
        self.cfg = self.live.commit(resolved, Vec::new());
        self.pressure
            .set_marks(pressure::Marks::of(&self.cfg.pressure));
        match new_output {
            Some(out) => self.events.replace(out),
            None => self.events.reopen(),
        }
        self.events.set_per_sec(self.cfg.daemon.events_per_sec);
        self.write_dropped(&lifted);
        info!(config = %path.display(), "config reloaded");
        Ok(Reloaded {
            reloaded: path.display().to_string(),
            rules: self.rule_names(),
            live_changes_dropped: dropped,
        })
    }

    /// Detach what a failed reload attached (and take back over what it replaced).
    fn undo_attach(&mut self, attached_now: Vec<(String, Option<Attached>)>) {
        for (iface, was) in attached_now.into_iter().rev() {
            if let Err(e) = self.dp.detach_iface(&iface) {
                error!("undoing the attach to {iface}: {e:#}");
            }
            if let Some(was) = was {
                self.dp.attached.push(was);
            }
        }
    }
}

/// Per-client state and per-rule counters are kept by rule *position*. When the rule at a
/// position changes (a reload reordered, removed or renamed rules, or a restart brought a
/// different config), that position's state and counters are cleared, so a rule never
/// inherits another's counts or bans. Unchanged positions keep theirs.
pub fn retire_rule_slots(maps: &mut Maps, old: &[String], new: &[String]) -> usize {
    let stale: Vec<u8> = (0..old.len().max(new.len()))
        .filter(|&i| old.get(i) != new.get(i) && i < ratelimit_common::caps::MAX_RULES as usize)
        .map(|i| i as u8)
        .collect();
    if stale.is_empty() {
        return 0;
    }
    let retired = match maps.clients.retire_rules(&stale) {
        Ok(n) => n as usize,
        Err(e) => {
            warn!("retiring the states of changed rule positions: {e:#}");
            0
        }
    };
    for &r in &stale {
        let _ = maps.overflow.set(r as u32, ClientState::default(), 0);
        // Its pending totals and closed tick go with it.
        if let Ok(ncpu) = aya::util::nr_cpus()
            && let Ok(zero) = aya::maps::PerCpuValues::try_from(vec![FastEntry::default(); ncpu])
        {
            let _ = maps.ovf_tick.set(r as u32, zero, 0);
        }
    }
    // Fast-drop entries of those rules: their pending per-client counts go with the clients.
    // (A read-modify-write of each CPU's entry: a packet the program counts into another
    // entry of the same slot between the read and the write may lose up to one tick's
    // pending count, only at this rare moment.)
    for i in 0..FAST_ENTRIES {
        let Ok(per_cpu) = maps.fast.get(&i, 0) else {
            continue;
        };
        if !per_cpu
            .iter()
            .any(|e| e.jiffies != 0 && stale.contains(&e.rule))
        {
            continue;
        }
        let cleared: Vec<FastEntry> = per_cpu
            .iter()
            .map(|e| {
                if stale.contains(&e.rule) {
                    FastEntry::default()
                } else {
                    *e
                }
            })
            .collect();
        if let Ok(values) = aya::maps::PerCpuValues::try_from(cleared) {
            let _ = maps.fast.set(i, values, 0);
        }
    }
    if let Ok(ncpu) = aya::util::nr_cpus() {
        for &r in &stale {
            for slot in 0..ratelimit_common::caps::MAX_IFACES {
                for c in 0..ratelimit_common::stats::rule::COUNT {
                    let idx = ratelimit_common::stats::rule_index(slot, r as u32, c);
                    if let Ok(zero) = aya::maps::PerCpuValues::try_from(
                        vec![ratelimit_common::stats::Counter::default(); ncpu],
                    ) {
                        let _ = maps.stats.set(idx, zero, 0);
                    }
                }
            }
        }
    }
    info!(positions = ?stale, states = retired, "rules changed position: their per-client state and counters were cleared");
    retired
}

/// After the rule list changed from `old` to `new` (a reload, or a start that adopted the
/// maps of a daemon that ran other rules), with the new rules written at `cut`: the state of
/// the positions that changed is retired, every ban keeps its rule by name (`held`: the
/// aggregate bans read before, put back at their rule's new position), and the bans of rules
/// that are gone are lifted, as their counters are. Returns the lifted bans, for their
/// `unban` events.
fn rules_changed(
    maps: &mut Maps,
    old: &[String],
    new: &[String],
    rules: &[(String, RuleConfig)],
    held: &[bans::HeldAggregate],
    cut: u64,
) -> Vec<bans::Dropped> {
    retire_rule_slots(maps, old, new);
    let mut lifted = bans::follow_rules(maps, old, new, cut);
    lifted.extend(bans::put_back_aggregates(maps, rules, held));
    if let Err(e) = maps.flush_ban_epoch() {
        warn!("voiding the program's fast-drop entries: {e}");
    }
    if !lifted.is_empty() {
        let mut gone: Vec<&str> = lifted.iter().map(|d| d.rule.as_str()).collect();
        gone.sort_unstable();
        gone.dedup();
        info!(bans = lifted.len(), rules = ?gone, "rules removed: their bans were lifted");
    }
    lifted
}

/// The rules as a config (live changes applied) writes them into the data plane.
fn config_rules(cfg: &Config) -> Vec<(String, RuleConfig)> {
    cfg.rules
        .iter()
        .map(|r| (r.name.clone(), apply::rule_config(r)))
        .collect()
}

const RULES_FILE: &str = "rules.json";

fn load_rule_names(dir: &std::path::Path) -> Option<Vec<String>> {
    serde_json::from_slice(&std::fs::read(dir.join(RULES_FILE)).ok()?).ok()
}

/// Record the rule names by position, so a later start that adopts the pinned maps knows
/// which rule each position held. A failure is logged: that start would then keep every
/// position's state, as if no rule had moved.
fn save_rule_names(dir: &std::path::Path, names: &[String]) {
    let bytes = serde_json::to_vec(names).unwrap_or_default();
    if let Err(e) = crate::durable::write_atomically(dir, RULES_FILE, &bytes) {
        warn!("recording the rule names: {e:#}");
    }
}

/// Fill the region map from the config's GeoIP database, if any.
fn load_regions(cfg: &Config, maps: &mut Maps) -> anyhow::Result<()> {
    if let Some(g) = &cfg.geoip {
        let table = crate::policy::geoip::load(&g.database)?;
        let n = crate::policy::geoip::apply(&mut maps.regions, &table)?;
        info!(prefixes = n, database = %g.database.display(), kind = %table.database_type, "GeoIP regions loaded");
    }
    Ok(())
}

/// The config's interfaces, then those of `--iface` it does not name.
fn interfaces_wanted(cfg: &Config, extra: &[String]) -> Vec<String> {
    let mut v = cfg.daemon.interfaces.clone();
    for i in extra {
        if !v.contains(i) {
            v.push(i.clone());
        }
    }
    v
}

impl State {
    /// Publish the rule-issued bans the events reader saw (at these prefixes), each as the
    /// ban table holds it now: only bans that drop (a rule in preview, or with `exceed_action
    /// = pass`, bans nobody elsewhere).
    fn publish_rule_bans(&mut self, seen: &[(u32, [u8; 16], u32)]) {
        let Some(f) = self.fleet.as_ref().filter(|f| f.settings.share_bans) else {
            return;
        };
        let names = self.rule_names();
        let now = crate::clock::mono_ns();
        let mut records = Vec::new();
        for &(plen, addr, rule) in seen {
            let key = IpKey { addr };
            let Some(b) = self.maps.ban_at(BAN_TABLE_RULE, plen, &key) else {
                continue;
            };
            if b.rule != rule || !ratelimit_common::limiter::ban_active(b.expires_ns, now) {
                continue;
            }
            let net = crate::policy::apply::net_of(plen, &key);
            records.push(f.record(
                crate::fleet::Op::Ban,
                net.to_string(),
                crate::fleet::unix_ms_of_mono(b.expires_ns),
                names.get(rule as usize).cloned(),
            ));
        }
        f.publish(records);
    }

    /// Apply what the fleet's reader received: other hosts' bans installed (in the
    /// remote bans' table, marked [`crate::fleet::BAN_REMOTE`], with their absolute end; where
    /// a ban is in force here already, the later end wins), their `unban`s lifting the bans at
    /// their prefix in the operator's table (never a ban this host's rules issued). The
    /// records come bounded and, with the fleet key, authenticated (`crate::fleet::trust`).
    /// Nothing applied here is published again.
    pub fn apply_fleet(
        &mut self,
        rx: crate::fleet::Received,
    ) -> anyhow::Result<crate::fleet::Applied> {
        use crate::fleet::{BAN_REMOTE, Op, Received};
        // A snapshot's tombstones lift only the fleet's bans (see `Received::Snapshot`).
        let (records, snapshot) = match rx {
            Received::Records(r) => (r, false),
            Received::Snapshot(r) => (r, true),
        };
        let mut applied = crate::fleet::Applied::default();
        let now = crate::clock::mono_ns();
        // The event lines of what was applied, with the issuing host as `origin`, so whoever
        // follows this host's events sees every ban of the fleet.
        let mut lines = Vec::new();
        let mut time = |ns: u64| {
            crate::clock::rfc3339(
                std::time::UNIX_EPOCH
                    + Duration::from_millis(crate::fleet::unix_ms_of_mono(ns.max(1))),
            )
        };
        let mut line = |kind: u32, entry: &BanEntry, r: &crate::fleet::Record| {
            let mut l = events::line_with(&ban_event(kind, entry, now), &[], &mut time);
            l.rule = r.rule.clone().unwrap_or_default();
            l.origin = Some(r.host.clone());
            l
        };
        for r in &records {
            let Ok(net) = config::parse_net(&r.net) else {
                warn!(net = %r.net, host = %r.host, "a fleet record with a bad prefix was skipped");
                applied.skipped += 1;
                continue;
            };
            let (plen, key) = prefix(&net);
            let cidr = net.to_string();
            match r.op {
                Op::Ban => {
                    let Some(exp) = crate::fleet::mono_of_unix_ms(r.exp_ms) else {
                        applied.skipped += 1;
                        continue;
                    };
                    // Lifted here after it was issued: the later word stands.
                    if self.fleet_lifts.get(&cidr).is_some_and(|&at| at >= r.at_ms) {
                        applied.skipped += 1;
                        continue;
                    }
                    if let Some(e) = self.maps.remote_ban_at(plen, &key)
                        && ratelimit_common::limiter::ban_active(e.expires_ns, now)
                        && (e.expires_ns == 0 || (exp != 0 && e.expires_ns >= exp))
                    {
                        applied.skipped += 1;
                        continue;
                    }
                    let entry = BanEntry {
                        flags: BAN_MANUAL | BAN_REMOTE,
                        ..BanEntry::manual(plen, key.addr, now, exp)
                    };
                    if let Err(e) = self.maps.replace_ban_deferred(entry) {
                        warn!(%net, host = %r.host, "installing a fleet ban failed: {e}");
                        applied.skipped += 1;
                        continue;
                    }
                    if exp != 0 {
                        self.next_ban_expiry = self.next_ban_expiry.min(exp);
                    }
                    lines.push(line(EV_BAN, &entry, r));
                    let mut notes = self.ban_notes.write();
                    notes.origins.insert(cidr.clone(), r.host.clone());
                    notes.set_reason(&cidr, r.reason.as_deref());
                    applied.bans += 1;
                }
                Op::Unban => {
                    for entry in self.maps.bans_at(plen, &key) {
                        // Never a ban this host's rules issued (SPEC, "Trust boundaries"):
                        // only the fleet's copies (in the remote bans' table, or spilled into
                        // the rules' when it was full) and this host's operator bans (`ban
                        // del` lifts everywhere); a snapshot's tombstone, only the fleet's
                        // copies.
                        let fleet_copy = entry.flags & BAN_REMOTE != 0;
                        let operators = ban_table(entry.flags) == BAN_TABLE_OPERATOR;
                        if !(fleet_copy || (operators && !snapshot)) {
                            continue;
                        }
                        if let Ok(true) = self.maps.remove_ban(ban_table(entry.flags), plen, &key) {
                            applied.unbans += 1;
                            lines.push(line(EV_UNBAN, &entry, r));
                        }
                    }
                    self.forget_ban_notes(&cidr);
                }
            }
        }
        self.maps
            .flush_ban_epoch()
            .context("voiding the program's fast-drop entries")?;
        self.events.fleet_lines(lines);
        if applied.bans + applied.unbans > 0 {
            self.bans_changed();
            self.reports.changed();
        }
        Ok(applied)
    }
}

/// `tracking.syn_cookies` answers with the kernel's own cookies, which the kernel makes only
/// with `net.ipv4.tcp_syncookies` on: without them `apply::plan` leaves the feature off, and
/// the operator is told so once, at start.
fn warn_if_kernel_cookies_off(cfg: &Config) {
    if !cfg.tracking.syn_cookies {
        return;
    }
    // The same reading `apply::plan` turns the feature off by.
    if !apply::kernel_syncookies_on() {
        warn!(
            "net.ipv4.tcp_syncookies is 0: tracking.syn_cookies is off (TCP sources refused \
             state are judged in their rule's aggregate bucket); set it to 1"
        );
    }
}

pub async fn run(opts: Options) -> anyhow::Result<()> {
    let cfg = load_config(opts.config_path.as_ref())?;
    // First of all: a daemon already running on these directories keeps them, untouched.
    let _locks = crate::daemon::lock::lock_dirs(&cfg.daemon.state_dir, &cfg.daemon.bpffs_dir)?;
    for w in cfg.fleet.iter().flat_map(config::fleet_warnings) {
        warn!("{w}");
    }
    // The fleet's settings (the host id, the password file read) before anything is loaded.
    let fleet_settings = cfg
        .fleet
        .as_ref()
        .map(|f| crate::fleet::Settings::resolve(f, &cfg.daemon.state_dir))
        .transpose()?;
    // The live changes saved by the last run, on top of the config.
    let (live, cfg) = crate::policy::live::Live::load(cfg);
    // Before touching the kernel: a taken port fails the start with nothing attached.
    let http_listener = match cfg.daemon.http_listen {
        Some(addr) => Some(crate::serve::http::bind(addr).await?),
        None => None,
    };
    let ifaces = interfaces_wanted(&cfg, &opts.ifaces);
    if ifaces.is_empty() {
        bail!("no interface to attach to: pass --iface IF or set daemon.interfaces in the config");
    }
    // Fail before loading anything if an interface is missing.
    for iface in &ifaces {
        crate::kernel::datapath::ifindex(iface)?;
        crate::kernel::datapath::Entry::for_iface(iface)?;
    }
    let mode = opts.xdp_mode.unwrap_or(cfg.daemon.xdp_mode);
    crate::kernel::datapath::check_pinned_layout(&cfg.daemon.bpffs_dir, &cfg.daemon.state_dir)?;
    let mut dp = Datapath::load(&cfg.daemon.bpffs_dir, cfg.tracking.max_sources)?;
    crate::kernel::log::spawn(dp.ebpf_mut());
    crate::kernel::datapath::record_pinned_layout(&cfg.daemon.state_dir)?;
    if let Some((x, v)) = dp.program_info() {
        info!(xlated_insns = x, verified_insns = v, "XDP program loaded");
    }
    let mut maps = dp.take_maps()?;
    // Off until the first rebuild (after attach): pinned bits may predate this program.
    let known = dp.take_known()?;
    known.disable();
    // Adopted state from a daemon that ran another rule set: read its aggregate bans by rule
    // name before its rules' positions are overwritten.
    let adopted_rules = if dp.adopted {
        load_rule_names(&cfg.daemon.state_dir).map(|old| {
            (
                bans::aggregates_by_name(&maps, &old, crate::clock::mono_ns()),
                old,
            )
        })
    } else {
        None
    };
    // Bans issued from here on (the pinned program still runs) name the new rules' positions.
    let cut = crate::clock::mono_ns();
    // Policy first, then attach: the program never runs against empty policy maps.
    let plan = apply::plan(&cfg, opts.preview);
    apply::apply(&mut maps, &plan)?;
    warn_if_kernel_cookies_off(&cfg);
    // The pressure level, from the operator's saved mode (the signals have no reading yet):
    // in the data plane before the program is attached, and right again after a restart.
    let pressure_marks = pressure::Marks::of(&cfg.pressure);
    let pressure_mode = load_pressure_mode(&cfg.daemon.state_dir);
    // Adopted maps keep the level the last daemon wrote (a fresh map's 0 reads as high, so
    // only adopted ones count).
    let was_high = dp.adopted && apply::read_relaxed(&maps) == Some(false);
    let pressure = Pressure::resume(pressure_marks, pressure_mode, Instant::now(), was_high);
    apply::write_relaxed(&mut maps, pressure.level() == pressure::Level::Low)?;
    load_regions(&cfg, &mut maps)?;
    let names: Vec<String> = cfg.rules.iter().map(|r| r.name.clone()).collect();
    let rules = config_rules(&cfg);
    // Clear what no longer matches, and keep every ban with its rule by name.
    let mut dropped = match &adopted_rules {
        Some((held, old)) => rules_changed(&mut maps, old, &names, &rules, held, cut),
        None => Vec::new(),
    };
    save_rule_names(&cfg.daemon.state_dir, &names);
    // Each saved ban on its own: what cannot be restored is reported, and the start goes on.
    let restored = bans::restore(&cfg.daemon.state_dir, &mut maps, &rules);
    dropped.extend(restored.dropped);
    if restored.report.restored > 0 {
        info!(
            restored = restored.report.restored,
            "bans restored from {}",
            cfg.daemon.state_dir.display()
        );
    }
    // The host's addresses before the first packet: the only destinations a SYN is answered
    // for on a host that forwards nothing (`local_addrs`).
    maps.refresh_local_addrs();
    for iface in &ifaces {
        dp.attach(iface, mode, &mut maps)?;
    }
    let tasks = Arc::new(supervise::Tasks::default());
    let known_status = Arc::new(std::sync::Mutex::new(None));
    crate::kernel::known::spawn_rebuilder(
        &tasks,
        known,
        dp.open_clients()?,
        KNOWN_REBUILD_PERIOD,
        known_status.clone(),
    )
    .context("starting the known-sources filter's thread")?;
    let listener = Arc::new(crate::serve::control::bind(&cfg.daemon.control_socket)?);
    let events_ring: Option<EventsRing> = match maps.events.take() {
        Some(rb) => {
            // SAFETY: the ring buffer owns its fd and keeps it open for as long as the
            // AsyncFd lives.
            let fd = unsafe { AsyncFd::register(rb) }
                .map_err(|e| anyhow::anyhow!("polling the events ring buffer: {e}"))?;
            Some(Arc::new(Mutex::new(fd)))
        }
        None => None,
    };
    let events = Events::start(
        cfg.daemon.events.as_ref(),
        cfg.daemon.events_per_sec,
        names.clone(),
    )?;
    let reports = Arc::new(Reports::new(
        dp.open_maps().context("opening the maps for reports")?,
        reader::View::default(),
        events.clone(),
        tasks.clone(),
        known_status,
    ));
    let (jobs_tx, jobs_rx) = mpsc::channel(JOBS_QUEUED);
    let handle = Handle {
        jobs: jobs_tx,
        reports: reports.clone(),
    };
    let sync_interval = cfg
        .fleet
        .as_ref()
        .map_or(crate::config::DEFAULT_SYNC_INTERVAL, |f| f.sync_interval);
    let h_owner = handle.clone();
    let fleet = fleet_settings.map(|settings| {
        let h = handle.clone();
        let link = crate::fleet::start(settings, &tasks, events.clone(), move |rx| {
            let h = h.clone();
            async move { h.with(move |s| s.apply_fleet(rx)).await? }
        });
        reports.set_fleet(link.shared.clone(), link.settings.clone());
        // Global thresholds: one task, whatever `share_bans` says; it idles while no rule is
        // global.
        match dp.open_maps() {
            Ok(maps) => {
                let store = Arc::new(maps.clients);
                let (settings, owner) = (link.settings.clone(), Arc::new(h_owner.clone()));
                let g = link.global.clone();
                let every = sync_interval;
                crate::supervise::spawn(
                    &tasks,
                    "fleet_global",
                    Duration::from_millis(100),
                    move || {
                        crate::fleet::global::run(
                            settings.clone(),
                            every,
                            store.clone(),
                            owner.clone(),
                            g.clone(),
                        )
                    },
                );
            }
            Err(e) => warn!("global thresholds off: opening the per-source store: {e:#}"),
        }
        info!(
            store = %link.settings.store,
            host_id = %link.settings.host_id,
            share_bans = link.settings.share_bans,
            "fleet mode"
        );
        link
    });
    let share_bans = fleet.as_ref().is_some_and(|f| f.settings.share_bans);
    let fleet_lifts = if fleet.is_some() {
        load_fleet_lifts(&cfg.daemon.state_dir)
    } else {
        BTreeMap::new()
    };
    let mut state = State {
        cfg,
        opts_ifaces: opts.ifaces,
        config_path: opts.config_path,
        preview_all: opts.preview,
        xdp_mode_override: opts.xdp_mode,
        maps,
        dp,
        ban_notes: crate::policy::ban_notes::BanNotes::new(crate::policy::ban_notes::Notes {
            reasons: restored.reasons,
            origins: restored.origins,
        }),
        events: events.clone(),
        bans_dirty: false,
        next_ban_expiry: 0,
        bans_restore: restored.report,
        live,
        reports: reports.clone(),
        pressure,
        pressure_counters: None,
        pressure_not_saved: None,
        level_sync: pressure::LevelSync::default(),
        rx_cpus: crate::kernel::rx_cpus::RxCpus::default(),
        fleet,
        fleet_lifts,
    };
    state.write_dropped(&dropped);
    reports.publish(state.view());
    reports
        .spawn_census()
        .context("starting the reports' census thread")?;
    let control_socket = state.cfg.daemon.control_socket.clone();
    let news = Arc::new(NewsBox::default());
    tokio::spawn(own(state, jobs_rx, news.clone()));
    info!(socket = %control_socket.display(), "control socket ready");
    // Each background task under the supervisor: restarted with backoff if it fails.
    let first = Duration::from_secs(1);
    let h = handle.clone();
    supervise::spawn(&tasks, "control", first, move || {
        serve_control(listener.clone(), h.clone())
    });
    if let Some(ring) = events_ring {
        let ev = events.clone();
        let news = news.clone();
        supervise::spawn(&tasks, "events", first, move || {
            read_events(ring.clone(), news.clone(), ev.clone(), share_bans)
        });
    }
    let h = handle.clone();
    supervise::spawn(&tasks, "ban_persistence", first, move || {
        persist_bans(h.clone())
    });
    let h = handle.clone();
    supervise::spawn(&tasks, "interface_watch", first, move || {
        watch_interfaces(h.clone())
    });
    let h = handle.clone();
    supervise::spawn(&tasks, "pressure", first, move || {
        sample_pressure(h.clone())
    });
    let h = handle.clone();
    supervise::spawn(&tasks, "local_addresses", first, move || {
        watch_local_addrs(h.clone())
    });
    let mut tasks = tokio::task::JoinSet::new();
    if let Some(l) = http_listener {
        tasks.spawn(crate::serve::http::serve(l, handle.clone()));
    }
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let mut int = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())?;
    let mut hup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())?;
    // SIGUSR1: reopen the events file only (log rotation without re-reading the config).
    let mut usr1 = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::user_defined1())?;
    loop {
        tokio::select! {
            _ = term.recv() => break,
            _ = int.recv() => break,
            _ = usr1.recv() => events.reopen(),
            _ = hup.recv() => {
                // Log rotation first: the events file is reopened even if the reload fails.
                events.reopen();
                let reloaded = handle
                    .with(|s| {
                        if s.config_path.is_none() {
                            return Ok(());
                        }
                        let r = s.reload().map(drop);
                        s.reports.changed();
                        r
                    })
                    .await;
                if let Err(e) = reloaded.and_then(|r| r) {
                    error!("{e:#}");
                }
            }
            Some(res) = tasks.join_next() => {
                match res {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => error!("task failed: {e:#}"),
                    Err(e) => error!("task panicked: {e}"),
                }
            }
        }
    }
    // The last job: save the bans. Later jobs (a request that raced the signal) fail.
    let saved = handle
        .with(|s| {
            if let Some(f) = &s.fleet {
                f.save_cursor_now();
            }
            let saved = s.save_bans();
            let _ = std::fs::remove_file(&s.cfg.daemon.control_socket);
            saved
        })
        .await;
    match saved {
        Ok(Err(e)) | Err(e) => warn!("{e:#}"),
        Ok(Ok(())) => {}
    }
    // The lines still queued, unless the sink is stalled.
    tokio::task::block_in_place(|| events.close(Duration::from_secs(1)));
    info!("stopping; the XDP program stays attached and enforcing (`ratelimit detach` removes it)");
    Ok(())
}

async fn serve_control(
    listener: Arc<tokio::net::UnixListener>,
    handle: Handle,
) -> anyhow::Result<()> {
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(e) => {
                // E.g. out of file descriptors: keep serving once it passes.
                warn!("control socket accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let handle = handle.clone();
        tokio::spawn(async move {
            // The socket's mode (0600) keeps others out already; this check holds whatever
            // the mode and the directory's permissions have become.
            if crate::serve::control::peer_uid(&stream) != Some(0) {
                crate::serve::control::refuse(stream).await;
                return;
            }
            let (r, mut w) = stream.into_split();
            let mut lines = BufReader::new(r).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                let resp = match serde_json::from_str::<Request>(&line) {
                    Ok(req) => {
                        let writes_events = matches!(
                            req,
                            Request::BanAdd { .. }
                                | Request::BanDel { .. }
                                | Request::BanLift { .. }
                        );
                        let resp = handle.request(req).await;
                        // The answer follows the request's event lines, so whoever reads the
                        // events file after `ban add` finds them; unless the sink has stalled,
                        // which delays the answer by `events::STALL` at most.
                        if writes_events {
                            let events = &handle.reports.events;
                            events.written(events.last_seq()).await;
                        }
                        resp
                    }
                    Err(e) => Response::err(format!("bad request: {e}")),
                };
                let mut out = serde_json::to_vec(&resp).unwrap_or_default();
                out.push(b'\n');
                let large = line.len() + out.len() > LARGE_EXCHANGE;
                drop(resp);
                let sent = w.write_all(&out).await;
                drop(out);
                if large {
                    give_back_freed_memory();
                }
                if sent.is_err() {
                    break;
                }
            }
        });
    }
}

/// A request or response this large (100k bans, a million clients) leaves megabytes of
/// freed small allocations behind.
const LARGE_EXCHANGE: usize = 1 << 20;

/// Return freed heap memory to the kernel. glibc keeps what a large request or report freed
/// in its arenas, so without this the daemon's RSS stays at its peak after one `bans --json`
/// over 100k bans.
fn give_back_freed_memory() {
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim only releases free memory of the allocator's own arenas.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// The events ring buffer, registered with the runtime once: a restarted reader takes it up
/// where the last one failed.
type EventsRing = Arc<Mutex<AsyncFd<RingBuf<MapData>>>>;

/// Drain the events ring buffer into the events writer's queue, and leave what the bans
/// bookkeeping needs (the expiry sweep's next deadline, bans to save) in the owner's mailbox.
/// It waits for no one: a long report or a slow job of the owner's does not leave the ring
/// buffer to fill.
/// `share_bans`: rule-issued bans are noted for the fleet (in fleet mode, with `share_bans`).
async fn read_events(
    ring: EventsRing,
    news: Arc<NewsBox>,
    events: Events,
    share_bans: bool,
) -> anyhow::Result<()> {
    let mut fd = ring.lock().await;
    loop {
        let mut guard = fd.readable_mut().await?;
        let rb = guard.get_inner_mut();
        let mut batch = Vec::new();
        while let Some(item) = rb.next() {
            if item.len() >= std::mem::size_of::<Event>() {
                // SAFETY: the program writes whole `Event`s; read unaligned to be safe.
                let e: Event = unsafe { std::ptr::read_unaligned(item.as_ptr() as *const Event) };
                batch.push(e);
            }
        }
        guard.clear_ready();
        let n = BanNews::of(&batch, share_bans);
        events.data_plane(batch);
        if n.changed {
            news.put(n);
        }
    }
}

/// What events tell the ban bookkeeping: that bans changed (to be saved), and the earliest
/// expiry among new bans (for the expiry sweep).
#[derive(Debug, Clone)]
struct BanNews {
    changed: bool,
    earliest_expiry: u64,
    /// Rule-issued bans, (prefix length, address, rule), for the fleet; at most
    /// [`RULE_BANS_NOTED`] between two turns of the owner's.
    rule_bans: Vec<(u32, [u8; 16], u32)>,
}

/// Rule-issued bans noted for the fleet while the owner is busy, at most.
const RULE_BANS_NOTED: usize = 100_000;

impl Default for BanNews {
    fn default() -> Self {
        Self {
            changed: false,
            earliest_expiry: u64::MAX,
            rule_bans: Vec::new(),
        }
    }
}

impl BanNews {
    fn of(batch: &[Event], share_bans: bool) -> Self {
        let mut n = Self::default();
        for e in batch {
            if e.kind == EV_BAN || e.kind == EV_UNBAN {
                n.changed = true;
            }
            if e.kind == EV_BAN && e.expires_ns != 0 {
                n.earliest_expiry = n.earliest_expiry.min(e.expires_ns);
            }
            if share_bans && e.kind == EV_BAN && e.key_kind == u32::from(KEY_IP) {
                n.rule_bans.push((e.prefix_len, e.addr, e.rule));
            }
        }
        n
    }

    fn merge(&mut self, o: BanNews) {
        self.changed |= o.changed;
        self.earliest_expiry = self.earliest_expiry.min(o.earliest_expiry);
        let room = RULE_BANS_NOTED.saturating_sub(self.rule_bans.len());
        self.rule_bans.extend(o.rule_bans.into_iter().take(room));
    }

    fn apply_to(self, s: &mut State) {
        if !self.rule_bans.is_empty() {
            s.publish_rule_bans(&self.rule_bans);
        }
        s.next_ban_expiry = s.next_ban_expiry.min(self.earliest_expiry);
        if self.changed {
            s.bans_changed();
        }
    }
}

/// The events reader's news for the owner task: merged while the owner is busy, so the
/// reader never waits and nothing queues up.
#[derive(Default)]
struct NewsBox {
    news: std::sync::Mutex<BanNews>,
    ready: Notify,
}

impl NewsBox {
    fn put(&self, n: BanNews) {
        self.news.lock().unwrap_or_else(|e| e.into_inner()).merge(n);
        self.ready.notify_one();
    }

    fn take(&self) -> BanNews {
        std::mem::take(&mut *self.news.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

/// How much longer than a save took the saver waits before the next one: a save of many
/// bans (say 300,000, a second or more) then takes at most a tenth of the owner's time, and
/// the fleet's bans, the control requests and the events are not held up behind it.
const SAVE_SPACING: u32 = 9;

/// Write bans to `state_dir` within a second of a change, or [`SAVE_SPACING`] times the last
/// save's duration if that is longer (and every minute regardless, so remaining times stay
/// fresh on disk): a job of the owner's each second.
async fn persist_bans(handle: Handle) -> anyhow::Result<()> {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut n = 0u32;
    let mut not_before = Instant::now();
    loop {
        tick.tick().await;
        n = n.wrapping_add(1);
        let minute = n.is_multiple_of(60);
        let may_save = Instant::now() >= not_before;
        let took = handle
            .with(move |s| {
                s.sweep_expired_bans();
                s.maps.refresh_bans_present();
                if minute {
                    // Bans issued while events were lost would otherwise never be swept.
                    s.next_ban_expiry = 0;
                }
                if (s.bans_dirty && may_save) || minute {
                    let t0 = Instant::now();
                    s.save_bans().map(|()| Some(t0.elapsed()))
                } else {
                    Ok(None)
                }
            })
            // A failure ends this run: the supervisor shows it and retries with backoff.
            .await??;
        if let Some(took) = took {
            not_before = Instant::now() + took * SAVE_SPACING;
        }
    }
}

/// Follow the host's addresses: [`crate::kernel::local_addrs::LocalAddrs::refresh`] every [`crate::kernel::local_addrs::REFRESH`], on the owner.
async fn watch_local_addrs(handle: Handle) -> anyhow::Result<()> {
    let mut tick = tokio::time::interval(crate::kernel::local_addrs::REFRESH);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        handle.with(|s| s.maps.refresh_local_addrs()).await?;
    }
}

/// The pressure sampler: reads the counters every [`pressure::SAMPLE_PERIOD`] and hands them
/// to the owner. `/proc/net/netstat` is the network namespace's the daemon runs in. A failed
/// read ends this run (the supervisor shows it and restarts it); the restarted run's first
/// reading is a new base, with no rates.
async fn sample_pressure(handle: Handle) -> anyhow::Result<()> {
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
fn load_pressure_mode(dir: &std::path::Path) -> pressure::Mode {
    let path = dir.join(pressure::FILE);
    let text = match std::fs::read(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return pressure::Mode::Auto,
        Err(e) => {
            error!(
                "reading {}: {e}; the pressure mode is auto until `ratelimit pressure set`",
                path.display()
            );
            return pressure::Mode::Auto;
        }
    };
    match serde_json::from_slice::<pressure::Saved>(&text) {
        Ok(saved) => {
            info!(mode = %saved.mode, "pressure mode restored from {}", path.display());
            saved.mode
        }
        Err(e) => {
            let aside = crate::durable::set_aside(&path, "bad")
                .map(|p| format!("moved to {}", p.display()))
                .unwrap_or_else(|e| format!("could not be moved aside: {e:#}"));
            error!(
                "{} is not a saved pressure mode ({e}); it was {aside}; the pressure mode is auto",
                path.display()
            );
            pressure::Mode::Auto
        }
    }
}

/// How often the daemon looks for a protected interface re-created under its name.
pub const IFACE_WATCH_PERIOD: Duration = Duration::from_secs(2);

/// Interfaces come and go (a wireguard or VPN interface restarted, a tunnel re-created, a
/// container's veth): when the name of an interface the daemon protects now belongs to another
/// device, attach to it, without waiting for a reload. Until then the new device is
/// unprotected; at most one period. An attach that fails is logged once per device, not once
/// per period.
async fn watch_interfaces(handle: Handle) -> anyhow::Result<()> {
    let mut tick = tokio::time::interval(IFACE_WATCH_PERIOD);
    let failed: Arc<std::sync::Mutex<Vec<(String, u32)>>> = Arc::default();
    loop {
        tick.tick().await;
        let failed = failed.clone();
        handle
            .with(move |s| {
                let mut failed = failed.lock().unwrap_or_else(|e| e.into_inner());
                let wanted = s.interfaces_wanted();
                let recreated: Vec<(String, u32)> =
                    s.dp.attached
                        .iter()
                        .filter(|a| wanted.contains(&a.iface))
                        .filter_map(|a| match crate::kernel::datapath::ifindex(&a.iface) {
                            Ok(i) if i != a.ifindex => Some((a.iface.clone(), i)),
                            _ => None,
                        })
                        .filter(|k| !failed.contains(k))
                        .collect();
                let mode = s.xdp_mode_override.unwrap_or(s.cfg.daemon.xdp_mode);
                for (iface, ifindex) in recreated {
                    match s.dp.attach(&iface, mode, &mut s.maps) {
                        Ok(_) => info!(
                            iface,
                            ifindex, "{iface} was re-created: attached to the new device"
                        ),
                        Err(e) => {
                            error!(
                                "{iface} was re-created (ifindex {ifindex}) and attaching to it \
                                 failed, so it is unprotected: {e:#}; fix it and run `ratelimit \
                                 reload`"
                            );
                            failed.push((iface, ifindex));
                        }
                    }
                }
            })
            .await?;
    }
}

/// The event of a ban (`EV_BAN`) or its end (`EV_UNBAN`) by the operator, at `now`.
/// The monotonic expiry of an operator's ban of `duration_ms` added at `now` (0 = until
/// removed). Durations are checked to be at most 10 years; the sum saturates anyway.
fn ban_end(now: u64, duration_ms: Option<u64>) -> u64 {
    duration_ms
        .map(|ms| now.saturating_add(ms.saturating_mul(1_000_000)).max(1))
        .unwrap_or(0)
}

fn ban_event(kind: u32, b: &BanEntry, now: u64) -> Event {
    Event {
        kind,
        rule: b.rule,
        key_kind: KEY_IP as u32,
        prefix_len: b.prefix_len,
        addr: b.addr,
        ts_ns: now,
        count: 0,
        threshold: 0,
        expires_ns: b.expires_ns,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rule_bans_are_noted_for_the_fleet_only_when_bans_are_shared() {
        let ban = Event {
            kind: EV_BAN,
            key_kind: u32::from(KEY_IP),
            prefix_len: 128,
            expires_ns: 5,
            ..Event::default()
        };
        let n = BanNews::of(&[ban], false);
        assert!(n.changed && n.rule_bans.is_empty(), "{n:?}");
        assert_eq!(n.earliest_expiry, 5);
        assert_eq!(BanNews::of(&[ban], true).rule_bans.len(), 1);
    }
}
