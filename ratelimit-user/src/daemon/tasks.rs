//! The supervised tasks that reach the owner as jobs: the control socket's connections, ban
//! persistence, and the host's addresses.

use std::{sync::Arc, time::Duration};

use tokio::io::{AsyncBufReadExt as _, AsyncWriteExt as _, BufReader};
use tracing::warn;

use super::Handle;
use crate::api::{Request, Response};

pub(super) async fn serve_control(
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
pub(super) const LARGE_EXCHANGE: usize = 1 << 20;

/// Return freed heap memory to the kernel. glibc keeps what a large request or report freed
/// in its arenas, so without this the daemon's RSS stays at its peak after one `bans --json`
/// over 100k bans.
pub(super) fn give_back_freed_memory() {
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim only releases free memory of the allocator's own arenas.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Follow the host's addresses: [`crate::kernel::local_addrs::LocalAddrs::refresh`] every [`crate::kernel::local_addrs::REFRESH`], on the owner.
pub(super) async fn watch_local_addrs(handle: Handle) -> anyhow::Result<()> {
    let mut tick = tokio::time::interval(crate::kernel::local_addrs::REFRESH);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        handle.with(|s| s.maps.refresh_local_addrs()).await?;
    }
}

/// Remove the idle states of keys of packet fields ([`crate::kernel::keyed`]) every
/// [`crate::kernel::keyed::PERIOD`], on a thread of its own with a handle of its own (a walk
/// of a full map takes a few hundred syscalls a millisecond, too long for the owner task).
/// Ends with the daemon's reports.
pub(super) fn spawn_keyed_reaper(
    reports: &Arc<crate::serve::reader::Reports>,
    pin_dir: std::path::PathBuf,
) -> anyhow::Result<()> {
    use crate::kernel::keyed;
    let me = Arc::downgrade(reports);
    let mut map = keyed::open(&pin_dir)?;
    std::thread::Builder::new()
        .name("keyed-reaper".into())
        .spawn(move || {
            loop {
                std::thread::sleep(keyed::PERIOD);
                let Some(r) = me.upgrade() else { break };
                let rules: Vec<_> = r.view().live_rules.iter().map(|(_, c)| *c).collect();
                let gone = keyed::reap(&mut map, &rules, crate::clock::mono_ns());
                // A ban that ended in a state nothing reaches again: its `unban`, at its end.
                let ended: Vec<_> = gone
                    .iter()
                    .filter_map(|(k, until)| until.map(|t| super::lift::unban_event(k, t)))
                    .collect();
                if !ended.is_empty() {
                    r.events.operator(ended);
                }
                if !gone.is_empty() {
                    tracing::debug!(
                        gone = gone.len(),
                        "idle states of keys of packet fields removed"
                    );
                }
            }
        })?;
    Ok(())
}
