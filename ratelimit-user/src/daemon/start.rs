//! `ratelimit run`: start-up as named phases (config and locks, the program loaded, the
//! policy applied and attached, the owner and its tasks started), the signals, the shutdown.

use std::{
    collections::BTreeMap,
    path::PathBuf,
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};
use tokio::{
    io::unix::AsyncFd,
    sync::{Mutex, mpsc},
};
use tracing::{error, info, warn};

use super::{
    Handle, JOBS_QUEUED, KNOWN_REBUILD_PERIOD, Options, State,
    banning::persist_bans,
    fleet::load_fleet_lifts,
    level::{load_pressure_mode, sample_pressure},
    news::{EventsRing, NewsBox, read_events},
    own,
    reload::{
        config_rules, interfaces_wanted, load_regions, load_rule_names, rules_changed,
        save_rule_names, watch_interfaces,
    },
    tasks::{serve_control, watch_local_addrs},
};
use crate::{
    config::{self, Config},
    events::Events,
    kernel::datapath::{Datapath, Maps},
    kernel::known::KnownFilter,
    policy::apply,
    policy::bans,
    policy::pressure::{self, Pressure},
    serve::reader::{self, Reports},
    supervise,
};

pub(super) fn load_config(path: Option<&PathBuf>) -> anyhow::Result<Config> {
    match path {
        Some(p) => config::load(p).map_err(|e| anyhow::anyhow!("{e}")),
        None => {
            let text = config::default_policy(&config::host_resolvers());
            config::parse("<default policy>", &text).map_err(|e| anyhow::anyhow!("{e}"))
        }
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

/// What start-up settles before the kernel is touched.
struct Checked {
    cfg: Config,
    live: crate::policy::live::Live,
    fleet_settings: Option<crate::fleet::Settings>,
    http_listener: Option<tokio::net::TcpListener>,
    ifaces: Vec<String>,
    mode: config::XdpMode,
}

/// The program loaded (or adopted) with its maps, before any policy is written.
struct Loaded {
    dp: Datapath,
    maps: Maps,
    known: KnownFilter,
    /// An adopted state's aggregate bans by rule name, and the rule names they were issued
    /// under.
    adopted_rules: Option<(Vec<bans::HeldAggregate>, Vec<String>)>,
    /// When the new rules' positions took effect.
    cut: u64,
}

/// The policy in the maps and the program attached.
struct Enforced {
    pressure: Pressure,
    names: Vec<String>,
    restored: bans::Restored,
}

/// The daemon: the program attached and enforcing, the owner task and its background tasks
/// running; until SIGTERM or SIGINT, SIGHUP reloads and SIGUSR1 reopens the events file.
pub async fn run(opts: Options) -> anyhow::Result<()> {
    let cfg = load_config(opts.config_path.as_ref())?;
    // First of all: a daemon already running on these directories keeps them, untouched.
    let _locks = crate::daemon::lock::lock_dirs(&cfg.daemon.state_dir, &cfg.daemon.bpffs_dir)?;
    let mut checked = check(cfg, &opts).await?;
    let mut loaded = load(&checked.cfg)?;
    let enforced = enforce(&checked, &mut loaded, opts.preview)?;
    let http_listener = checked.http_listener.take();
    let (handle, events) = start_owner(checked, loaded, enforced, opts)?;
    let mut tasks = tokio::task::JoinSet::new();
    if let Some(l) = http_listener {
        tasks.spawn(crate::serve::http::serve(l, handle.clone()));
    }
    wait_for_signals(&handle, &events, tasks).await?;
    shut_down(&handle, &events).await;
    Ok(())
}

/// Phase 1, before the kernel is touched: the fleet's settings (the host id, the password file
/// read), the live changes over the config, the HTTP port bound, every interface found.
async fn check(cfg: Config, opts: &Options) -> anyhow::Result<Checked> {
    for w in cfg.fleet.iter().flat_map(config::fleet_warnings) {
        warn!("{w}");
    }
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
    Ok(Checked {
        cfg,
        live,
        fleet_settings,
        http_listener,
        ifaces,
        mode,
    })
}

/// Phase 2: the program loaded, or adopted from the pins, with its maps.
fn load(cfg: &Config) -> anyhow::Result<Loaded> {
    crate::kernel::datapath::check_pinned_layout(&cfg.daemon.bpffs_dir, &cfg.daemon.state_dir)?;
    let mut dp = Datapath::load(&cfg.daemon.bpffs_dir, cfg.tracking.max_sources)?;
    crate::kernel::log::spawn(dp.ebpf_mut());
    crate::kernel::datapath::record_pinned_layout(&cfg.daemon.state_dir)?;
    if let Some((x, v)) = dp.program_info() {
        info!(xlated_insns = x, verified_insns = v, "XDP program loaded");
    }
    let maps = dp.take_maps()?;
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
    Ok(Loaded {
        dp,
        maps,
        known,
        adopted_rules,
        cut,
    })
}

/// Phase 3: the policy written, then the program attached (it never runs against empty
/// policy maps): rules, the pressure level, regions, the saved bans, the host's addresses.
fn enforce(checked: &Checked, l: &mut Loaded, preview: bool) -> anyhow::Result<Enforced> {
    let cfg = &checked.cfg;
    let maps = &mut l.maps;
    let plan = apply::plan(cfg, preview);
    apply::apply(maps, &plan)?;
    warn_if_kernel_cookies_off(cfg);
    // The pressure level, from the operator's saved mode (the signals have no reading yet):
    // in the data plane before the program is attached, and right again after a restart.
    let pressure_marks = pressure::Marks::of(&cfg.pressure);
    let pressure_mode = load_pressure_mode(&cfg.daemon.state_dir);
    // Adopted maps keep the level the last daemon wrote (a fresh map's 0 reads as high, so
    // only adopted ones count).
    let was_high = l.dp.adopted && apply::read_relaxed(maps) == Some(false);
    let pressure = Pressure::resume(pressure_marks, pressure_mode, Instant::now(), was_high);
    apply::write_relaxed(maps, pressure.level() == pressure::Level::Low)?;
    load_regions(cfg, maps)?;
    let names: Vec<String> = cfg.rules.iter().map(|r| r.name.clone()).collect();
    let rules = config_rules(cfg);
    // Clear what no longer matches, and keep every ban with its rule by name.
    let mut dropped = match &l.adopted_rules {
        Some((held, old)) => rules_changed(maps, old, &names, &rules, held, l.cut),
        None => Vec::new(),
    };
    save_rule_names(&cfg.daemon.state_dir, &names);
    // Each saved ban on its own: what cannot be restored is reported, and the start goes on.
    let mut restored = bans::restore(&cfg.daemon.state_dir, maps, &rules);
    dropped.append(&mut restored.dropped);
    restored.dropped = dropped;
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
    for iface in &checked.ifaces {
        l.dp.attach(iface, checked.mode, maps)?;
    }
    Ok(Enforced {
        pressure,
        names,
        restored,
    })
}

/// Phase 4: the owner task started with the daemon's state, and the tasks around it (the
/// known-sources filter's rebuild, the control socket, the events, fleet mode, the watchers).
fn start_owner(
    checked: Checked,
    loaded: Loaded,
    enforced: Enforced,
    opts: Options,
) -> anyhow::Result<(Handle, Events)> {
    let Checked {
        cfg,
        live,
        fleet_settings,
        ..
    } = checked;
    let Loaded {
        dp,
        mut maps,
        known,
        ..
    } = loaded;
    let Enforced {
        pressure,
        names,
        restored,
    } = enforced;
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
    let fleet = fleet_settings
        .map(|settings| start_fleet(settings, &cfg, &dp, &tasks, &events, &reports, &handle));
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
    state.write_dropped(&restored.dropped);
    reports.publish(state.view());
    reports
        .spawn_census()
        .context("starting the reports' census thread")?;
    super::tasks::spawn_keyed_reaper(&reports, state.cfg.daemon.bpffs_dir.clone())
        .context("starting the idle keyed states' thread")?;
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
    spawn_watchers(&tasks, &handle);
    Ok((handle, events))
}

/// Fleet mode started: the link to the store (its publisher, reader and outbox), and the global
/// thresholds' task, one whatever `share_bans` says (it idles while no rule is global).
fn start_fleet(
    settings: crate::fleet::Settings,
    cfg: &Config,
    dp: &Datapath,
    tasks: &Arc<supervise::Tasks>,
    events: &Events,
    reports: &Arc<Reports>,
    handle: &Handle,
) -> crate::fleet::Link {
    let sync_interval = cfg
        .fleet
        .as_ref()
        .map_or(crate::config::DEFAULT_SYNC_INTERVAL, |f| f.sync_interval);
    let h = handle.clone();
    let link = crate::fleet::start(settings, tasks, events.clone(), move |rx| {
        let h = h.clone();
        async move { h.with(move |s| s.apply_fleet(rx)).await? }
    });
    reports.set_fleet(link.shared.clone(), link.settings.clone());
    match dp.open_maps() {
        Ok(maps) => {
            let store = Arc::new(maps.clients);
            let (settings, owner) = (link.settings.clone(), Arc::new(handle.clone()));
            let g = link.global.clone();
            let every = sync_interval;
            crate::supervise::spawn(
                tasks,
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
}

/// The tasks that hand their work to the owner on a period, each under the supervisor.
fn spawn_watchers(tasks: &Arc<supervise::Tasks>, handle: &Handle) {
    let first = Duration::from_secs(1);
    let h = handle.clone();
    supervise::spawn(tasks, "ban_persistence", first, move || {
        persist_bans(h.clone())
    });
    let h = handle.clone();
    supervise::spawn(tasks, "interface_watch", first, move || {
        watch_interfaces(h.clone())
    });
    let h = handle.clone();
    supervise::spawn(tasks, "pressure", first, move || sample_pressure(h.clone()));
    let h = handle.clone();
    supervise::spawn(tasks, "local_addresses", first, move || {
        watch_local_addrs(h.clone())
    });
}

/// Phase 5: serve until SIGTERM or SIGINT. SIGHUP reopens the events file and reloads the
/// config; SIGUSR1 reopens the events file only (log rotation without re-reading the config).
async fn wait_for_signals(
    handle: &Handle,
    events: &Events,
    mut tasks: tokio::task::JoinSet<anyhow::Result<()>>,
) -> anyhow::Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let mut hup = signal(SignalKind::hangup())?;
    let mut usr1 = signal(SignalKind::user_defined1())?;
    loop {
        tokio::select! {
            _ = term.recv() => return Ok(()),
            _ = int.recv() => return Ok(()),
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
}

/// Phase 6: the last job saves the bans (later jobs, a request that raced the signal, fail),
/// and the events still queued are written unless the sink is stalled. The program stays
/// attached.
async fn shut_down(handle: &Handle, events: &Events) {
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
    tokio::task::block_in_place(|| events.close(Duration::from_secs(1)));
    info!("stopping; the XDP program stays attached and enforcing (`ratelimit detach` removes it)");
}
