//! Reports, off the owner task. `status`, `stats`, `top`, `offenders`, `bans` and `/metrics`
//! read the maps through handles of their own (opened from the pins), on the blocking pool, at
//! most [`REPORTS_AT_ONCE`] at a time; what they need to know of the config (rule names, the
//! rules as the data plane holds them, ban reasons, interfaces) is a [`View`] the owner task
//! publishes after every change. A report never waits for the owner task, and the owner task
//! never waits for a report: a `top` over millions of clients delays neither a `ban add` nor
//! the events reader nor ban persistence.

use std::{
    sync::{
        Arc, RwLock,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, SystemTime},
};

use ratelimit_common::{maps::RuleConfig, stats::global};

pub use crate::api::status::{Admission, Program, RuleThreshold, Status};
use crate::{
    api::{Answer, Request, Response, TopBy},
    events::Events,
    kernel::datapath::{Attached, Maps},
    policy::bans,
    policy::report,
    supervise,
};

/// Reports running at once at most (the machine has few cores to spare; more wait for a
/// turn, and the HTTP listener answers 503 to those that wait too long).
pub const REPORTS_AT_ONCE: usize = 2;

/// How often the census thread looks for changes of the counts that take a walk (tracked
/// clients, bans in force). While the program keeps changing them (a flood: new states, bans
/// issued and expiring), `status` and `/metrics` show this thread's latest census, at most one
/// walk and this period old, instead of walking a million states per request. Otherwise a
/// request whose counts changed since the last census (a ban the program issued once, an
/// operator's `ban add`) counts afresh, so it shows them exactly.
pub const CENSUS_PERIOD: Duration = Duration::from_millis(500);

/// A census older than this is taken again by the request, flood or not: the census
/// thread is behind, or the maps were written by another process than the program and the
/// daemon (whose changes the census notices at once), such as a benchmark filling them.
pub const CENSUS_MAX_AGE: Duration = Duration::from_secs(3);

/// What the reports know of the daemon besides the maps: published by the owner task.
#[derive(Clone, Debug, Default)]
pub struct View {
    pub rule_names: Vec<String>,
    /// Remote bans spilled into the rules' table (`datapath::Maps::remote_bans_spilled`).
    pub remote_bans_spilled: u64,
    /// Rules as the data plane holds them (live `rule set` changes included).
    pub live_rules: Vec<(String, RuleConfig)>,
    /// The bans' reasons and origins (shared with the owner task, which writes them).
    pub ban_notes: crate::policy::ban_notes::BanNotes,
    /// (counter slot, interface).
    pub ifaces: Vec<(u32, String)>,
    pub attached: Vec<Attached>,
    pub max_sources: u32,
    pub admission: Admission,
    pub config: Option<String>,
    pub adopted: bool,
    pub bpffs_dir: String,
    pub preview_all: bool,
    /// (translated, verified) instructions of the loaded program.
    pub program: Option<(u32, u32)>,
    pub bans_restore: bans::RestoreReport,
    /// The live changes over the config file (`rule set`, `override add`).
    pub live_changes: crate::policy::live::Report,
    /// The pressure level and its signals (the sampler's latest).
    pub pressure: crate::policy::pressure::Report,
    /// Each rule's threshold in force now.
    pub thresholds: Vec<RuleThreshold>,
}

/// Counts that take a walk over maps: kept for `status` and `/metrics` while still true.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Census {
    pub tracked_clients: u64,
    pub active_bans: u64,
    /// What it was taken at: the owner's generation and the program's counters that change
    /// the counts (states created, bans issued and expired).
    mark: (u64, u64),
    at: std::time::Instant,
}

pub struct Reports {
    /// Handles of the reports' own; never written through (see [`ReadMaps`]).
    maps: ReadMaps,
    view: RwLock<Arc<View>>,
    permits: tokio::sync::Semaphore,
    census: std::sync::Mutex<Option<Census>>,
    /// The census thread saw the program's counters move between its last two looks.
    churning: std::sync::atomic::AtomicBool,
    /// Bumped by the owner task at every change of bans or states of its own.
    generation: AtomicU64,
    started: SystemTime,
    pub events: Events,
    pub tasks: Arc<supervise::Tasks>,
    pub known_status: Arc<std::sync::Mutex<Option<crate::kernel::known::Rebuilt>>>,
    /// Fleet mode's shared state (`fleet status`, `/v1/fleet`, `ratelimit_fleet_*`); unset
    /// without `[fleet]`.
    pub fleet: std::sync::OnceLock<Arc<crate::fleet::Shared>>,
    /// Fleet mode's store settings (`fleet key` reads the store with them); unset without
    /// `[fleet]`.
    pub fleet_settings: std::sync::OnceLock<Arc<crate::fleet::Settings>>,
    /// `fleet key`'s reads of the store: one connection, a cache, a rate bound.
    pub fleet_key_reads: crate::fleet::key_reads::KeyReads,
}

/// Map handles only read through: `Maps`' writing methods take `&mut`, which this never
/// hands out.
pub struct ReadMaps(Maps);

impl std::ops::Deref for ReadMaps {
    type Target = Maps;
    fn deref(&self) -> &Maps {
        &self.0
    }
}

impl Reports {
    pub fn new(
        maps: Maps,
        view: View,
        events: Events,
        tasks: Arc<supervise::Tasks>,
        known_status: Arc<std::sync::Mutex<Option<crate::kernel::known::Rebuilt>>>,
    ) -> Self {
        Self {
            maps: ReadMaps(maps),
            view: RwLock::new(Arc::new(view)),
            permits: tokio::sync::Semaphore::new(REPORTS_AT_ONCE),
            census: std::sync::Mutex::new(None),
            churning: std::sync::atomic::AtomicBool::new(false),
            generation: AtomicU64::new(0),
            started: SystemTime::now(),
            events,
            tasks,
            known_status,
            fleet: std::sync::OnceLock::new(),
            fleet_settings: std::sync::OnceLock::new(),
            fleet_key_reads: crate::fleet::key_reads::KeyReads::default(),
        }
    }

    /// Fleet mode is on: its state is reported from now on.
    pub fn set_fleet(
        &self,
        shared: Arc<crate::fleet::Shared>,
        settings: Arc<crate::fleet::Settings>,
    ) {
        let _ = self.fleet.set(shared);
        let _ = self.fleet_settings.set(settings);
    }

    /// The owner task's latest view.
    pub fn view(&self) -> Arc<View> {
        self.view.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Publish the owner task's view (after every job).
    pub fn publish(&self, view: View) {
        *self.view.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(view);
    }

    /// The owner task changed bans or states: the next request counts them afresh.
    pub fn changed(&self) {
        self.generation.fetch_add(1, Ordering::AcqRel);
    }

    pub fn maps(&self) -> &Maps {
        &self.maps
    }

    /// Whether `req` is a report (answered here) rather than a change (the owner task's).
    pub fn is_report(req: &Request) -> bool {
        matches!(
            req,
            Request::Status
                | Request::Stats
                | Request::Top { .. }
                | Request::Bans { .. }
                | Request::Offenders { .. }
                | Request::Pressure
                | Request::Fleet
                | Request::FleetKey { .. }
        )
    }

    /// Answer a report on the blocking pool, once a turn is free.
    pub async fn run(self: &Arc<Self>, req: Request) -> Response {
        // `fleet key` reads the store: it waits for it here (bounded), on no turn of the
        // blocking pool.
        if let Request::FleetKey { addr, rule } = &req {
            return match fleet_key_answer(self, addr, rule.as_deref()).await {
                Ok(k) => Response::ok(Answer::FleetKey(Box::new(k))),
                Err(e) => Response::err(format!("{e:#}")),
            };
        }
        // `status` reads no walk's worth unless its counts changed: it takes no turn, so it
        // answers while long reports run.
        let _permit = if matches!(req, Request::Status | Request::Pressure | Request::Fleet) {
            None
        } else {
            match self.permits.acquire().await {
                Ok(p) => Some(p),
                Err(_) => return Response::err("the daemon is stopping"),
            }
        };
        let me = self.clone();
        match tokio::task::spawn_blocking(move || me.answer(req)).await {
            Ok(r) => r,
            Err(e) => Response::err(format!("the report failed: {e}")),
        }
    }

    /// Run `f` on the blocking pool with a turn (for `/metrics`).
    pub async fn with_turn<T: Send + 'static>(
        self: &Arc<Self>,
        f: impl FnOnce(&Reports) -> T + Send + 'static,
    ) -> anyhow::Result<T> {
        let _permit = self
            .permits
            .acquire()
            .await
            .map_err(|_| anyhow::anyhow!("the daemon is stopping"))?;
        let me = self.clone();
        tokio::task::spawn_blocking(move || f(&me))
            .await
            .map_err(|e| anyhow::anyhow!("the report failed: {e}"))
    }

    pub fn answer(&self, req: Request) -> Response {
        match self.try_answer(req) {
            Ok(r) => r,
            Err(e) => Response::err(format!("{e:#}")),
        }
    }

    fn try_answer(&self, req: Request) -> anyhow::Result<Response> {
        let view = self.view();
        Ok(match req {
            Request::Status => Response::ok(Answer::Status(Box::new(self.status(&view)))),
            Request::Stats => Response::ok(Answer::Stats(Box::new(report::stats(
                &self.maps,
                &view.ifaces,
                &view.rule_names,
            )?))),
            Request::Top { n, by } => Response::ok(Answer::Top(report::top(
                &self.maps,
                &view.live_rules,
                n,
                match by {
                    TopBy::Packets => report::Rank::Packets,
                    TopBy::Bytes => report::Rank::Bytes,
                    TopBy::Drops => report::Rank::Drops,
                },
            )?)),
            Request::Bans { limit } => {
                let mut b = report::bans(&self.maps, &view.live_rules, Some(&view.ban_notes));
                if let Some(limit) = limit {
                    b.truncate(limit);
                }
                Response::ok(Answer::Bans(b))
            }
            Request::Offenders { limit } => {
                let mut c: Vec<_> = report::clients(&self.maps, &view.live_rules)?
                    .into_iter()
                    .filter(|c| c.throttled || c.above_soft_limit)
                    .collect();
                let by_usage = |c: &report::Client| std::cmp::Reverse(c.usage);
                if let Some(limit) = limit
                    && limit < c.len()
                {
                    // The `limit` highest first, without sorting the rest.
                    c.select_nth_unstable_by_key(limit, by_usage);
                    c.truncate(limit);
                }
                c.sort_by_key(by_usage);
                Response::ok(Answer::Offenders(c))
            }
            Request::Pressure => Response::ok(Answer::Pressure(Box::new(view.pressure.clone()))),
            Request::Fleet => match self.fleet.get() {
                Some(f) => Response::ok(Answer::Fleet(Box::new(f.report()))),
                None => Response::err("fleet mode is off: the config has no [fleet] section"),
            },
            other => anyhow::bail!("not a report: {other:?}"),
        })
    }

    fn mark(&self) -> (u64, u64) {
        let program = [
            global::STATE_CREATED,
            global::BANS_ISSUED,
            global::BANS_EXPIRED,
        ]
        .iter()
        .map(|&i| report::global_packets(&self.maps, i).unwrap_or(0))
        .fold(0u64, u64::wrapping_add);
        (self.generation.load(Ordering::Acquire), program)
    }

    fn cached(&self) -> Option<Census> {
        *self.census.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Walk the maps (without holding the cache, so no request waits for another's walk).
    fn take_census(&self, view: &View, mark: (u64, u64)) -> Census {
        let fresh = Census {
            tracked_clients: report::tracked_clients(&self.maps).unwrap_or(0),
            active_bans: report::bans(&self.maps, &view.live_rules, None).len() as u64,
            mark,
            at: std::time::Instant::now(),
        };
        *self.census.lock().unwrap_or_else(|e| e.into_inner()) = Some(fresh);
        fresh
    }

    /// The counts that take a walk: the last census while nothing changed them, or while
    /// the program keeps changing them (see [`CENSUS_PERIOD`]); else counted afresh.
    pub fn census(&self, view: &View) -> Census {
        let mark = self.mark();
        if let Some(c) = self.cached()
            && c.at.elapsed() < CENSUS_MAX_AGE
            && (c.mark == mark || (c.mark.0 == mark.0 && self.churning.load(Ordering::Acquire)))
        {
            return c;
        }
        self.take_census(view, mark)
    }

    /// The census thread: a census whenever the counts moved, so requests during a flood find
    /// a recent one.
    pub fn spawn_census(self: &Arc<Self>) -> anyhow::Result<()> {
        let me = Arc::downgrade(self);
        std::thread::Builder::new()
            .name("census".into())
            .spawn(move || {
                let mut last_look = None;
                while let Some(r) = me.upgrade() {
                    let mark = r.mark();
                    r.churning.store(
                        last_look.is_some_and(|(_, program)| program != mark.1),
                        Ordering::Release,
                    );
                    last_look = Some(mark);
                    let before = r.cached();
                    if before.is_none_or(|c| c.mark != mark) {
                        let view = r.view();
                        r.take_census(&view, mark);
                    }
                    drop(r);
                    std::thread::sleep(CENSUS_PERIOD);
                }
            })?;
        Ok(())
    }

    fn status(&self, view: &View) -> Status {
        let census = self.census(view);
        let ring_buffer_lost = report::global_packets(&self.maps, global::EVENTS_LOST).unwrap_or(0);
        Status {
            version: env!("CARGO_PKG_VERSION").to_string(),
            pid: std::process::id(),
            started: crate::clock::rfc3339(self.started),
            config: view.config.clone(),
            policy: if view.config.is_some() {
                "config"
            } else {
                "default"
            }
            .into(),
            adopted_pinned_state: view.adopted,
            bpffs_dir: view.bpffs_dir.clone(),
            preview_all: view.preview_all,
            interfaces: view.attached.clone(),
            program: view.program.map(|(x, v)| Program {
                xlated_insns: x,
                verified_insns: v,
            }),
            rules: view.rule_names.clone(),
            thresholds: view.thresholds.clone(),
            tracked_clients: census.tracked_clients,
            max_sources: view.max_sources,
            admission: view.admission,
            active_bans: census.active_bans,
            known_filter: self
                .known_status
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone(),
            events: self.events.status(ring_buffer_lost),
            tasks: self
                .tasks
                .snapshot()
                .into_iter()
                .map(|(name, health)| (name.to_string(), health))
                .collect(),
            bans_restore: view.bans_restore.clone(),
            live_changes: view.live_changes.clone(),
            pressure: view.pressure.clone(),
        }
    }
}

/// The answer to `fleet key` (the reports' side: never on the owner task).
pub async fn fleet_key_answer(
    reports: &Reports,
    addr: &str,
    rule: Option<&str>,
) -> anyhow::Result<crate::fleet::key::KeyReport> {
    use anyhow::bail;

    use crate::{
        fleet::global,
        fleet::key::{KeyReport, RuleKey, STORE_READ_TIMEOUT, WindowCounts, targets},
        fleet::key_reads::{self, Read, Want},
        kernel::clients::Meter,
    };
    let Some(settings) = reports.fleet_settings.get() else {
        bail!("fleet mode is off: the config has no [fleet] section");
    };
    let view = reports.view();
    let targets = targets(&view.live_rules, addr, rule)?;
    let now_ns = crate::clock::wall_ns();
    let mut rules: Vec<RuleKey> = targets
        .iter()
        .map(|t| t.local(reports.maps().clients.get(&t.key), now_ns))
        .collect();
    // Each rule's window and the one before.
    let want: Vec<Want> = rules
        .iter()
        .flat_map(|r| {
            [r.window, r.window.wrapping_sub(1)].map(|w| Want {
                hash: global::hash_name(&r.rid, Meter::Admitted, r.bucket, w),
                name: r.key.clone(),
            })
        })
        .collect();
    // Whose own counts are read: this host, then the peers its heartbeat keeps, most
    // recently seen first.
    let mut hosts = vec![settings.host_id.clone()];
    if let Some(f) = reports.fleet.get() {
        let mut peers = f.report().peers;
        peers.sort_by_key(|p| p.age_ms);
        hosts.extend(
            peers
                .into_iter()
                .filter(|p| p.host_id != settings.host_id)
                .map(|p| p.host_id),
        );
    }
    let reads = &reports.fleet_key_reads;
    let read = tokio::time::timeout(STORE_READ_TIMEOUT, reads.read(settings, &want, &hosts))
        .await
        .unwrap_or_else(|_| {
            Read::Failed(format!(
                "{} did not answer within {STORE_READ_TIMEOUT:?}",
                settings.store
            ))
        });
    let mut busy = None;
    match read {
        Read::Counts(counts, age) => {
            let mut counts = counts.into_iter();
            for r in &mut rules {
                let windows = [r.window, r.window.wrapping_sub(1)]
                    .into_iter()
                    .map(|w| {
                        let c = counts.next().unwrap_or_default();
                        WindowCounts {
                            window: w,
                            hash: global::hash_name(&r.rid, Meter::Admitted, r.bucket, w),
                            total: c.total,
                            hosts: c.hosts,
                        }
                    })
                    .collect();
                r.fleet = Some(windows);
                r.fleet_age_ms = Some(age.as_millis() as u64);
                if age >= key_reads::FRESH {
                    r.note = Some(format!(
                        "the fleet's counts as read {} ms ago: the store is read at most {} \
                         times a second for fleet key",
                        age.as_millis(),
                        key_reads::READS_PER_SEC
                    ));
                }
                if hosts.len() > key_reads::HOSTS_MAX {
                    let more = hosts.len() - key_reads::HOSTS_MAX;
                    let n = format!(
                        "each host's own count is read for {} hosts; {more} more are in the \
                         total only",
                        key_reads::HOSTS_MAX
                    );
                    r.note = Some(match r.note.take() {
                        Some(prev) => format!("{prev}; {n}"),
                        None => n,
                    });
                }
            }
        }
        Read::Busy(why) => {
            for r in &mut rules {
                r.note = Some(format!(
                    "the store was not read ({why}): this host's part only"
                ));
            }
            busy = Some(why);
        }
        Read::Failed(e) => {
            for r in &mut rules {
                r.note = Some(format!(
                    "the store could not be read ({e}): this host's part only"
                ));
            }
        }
    }
    Ok(KeyReport {
        addr: addr.trim().to_string(),
        host_id: settings.host_id.clone(),
        rules,
        busy,
    })
}
