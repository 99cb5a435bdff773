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

mod banning;
mod fleet;
mod level;
mod lift;
pub mod lock;
mod news;
mod reload;
mod start;
mod tasks;

pub use fleet::{FLEET_LIFTS_FILE, FLEET_LIFTS_MAX};
pub use reload::{IFACE_WATCH_PERIOD, retire_rule_slots};
pub use start::run;

use news::NewsBox;

use std::{
    collections::BTreeMap,
    path::PathBuf,
    sync::Arc,
    time::{Duration, Instant},
};

use ratelimit_common::{event::Event, maps::*};
use tokio::sync::{mpsc, oneshot};

use crate::{
    api::{self, Answer, Request, Response},
    config::{self, Config},
    events::Events,
    kernel::datapath::{Datapath, Maps},
    policy::apply::{self},
    policy::bans,
    policy::pressure::{self, Pressure},
    serve::reader::{self, Reports},
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

    pub fn rule_names(&self) -> Vec<String> {
        self.cfg.rules.iter().map(|r| r.name.clone()).collect()
    }

    /// Rules as the data plane holds them (live `rule set` changes included), each with its
    /// limit in force now as `limit` (its elastic limit while the pressure level is low), so
    /// client reports measure usage against what the program meters.
    pub fn live_rules(&self) -> Vec<(String, RuleConfig)> {
        let relaxed = self.relaxed();
        let reads = crate::policy::matching::payload_reads(&self.cfg.rules);
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
                        .unwrap_or_else(|_| apply::rule_config(r, &reads));
                    rc.limit = *rc.limit_now(relaxed);
                    rc
                })
            })
            .collect()
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
}

/// The event of a ban (`EV_BAN`) or its end (`EV_UNBAN`) by the operator, at `now`.
fn ban_event(kind: u32, b: &BanEntry, now: u64) -> Event {
    Event {
        kind,
        rule: b.rule,
        key_kind: KEY_IP as u32,
        prefix_len: b.prefix_len,
        addr: b.addr,
        src: [0; 16],
        ts_ns: now,
        count: 0,
        threshold: 0,
        expires_ns: b.expires_ns,
    }
}
