//! The reader: follows the ban stream from its cursor (or resyncs from the snapshot when the
//! stream no longer holds it), hands other hosts' records to the owner, keeps the cursor on
//! disk, and reports the store's reachability (`fleet_degraded`, `fleet_restored`).

use std::{
    path::Path,
    sync::Arc,
    time::{Duration, Instant, SystemTime},
};

use anyhow::Context as _;
use serde::{Deserialize, Serialize};
use tracing::{info, warn};

use super::{
    Applied, BACKOFF_FIRST, BACKOFF_MAX, BATCH, CURSOR_SAVE, Op, READ_BLOCK_MS, REQUEST_TIMEOUT,
    Received, Record, STATE_FILE, Settings, Shared, fleet_line, resync, trust::Trust, unix_ms,
};
use crate::events;

/// The saved cursor (`state_dir/fleet.json`).
#[derive(Serialize, Deserialize, Debug, Default)]
pub(super) struct Saved {
    host_id: String,
    pub(super) cursor: Option<String>,
}

pub(super) fn load_saved(dir: &Path) -> Saved {
    std::fs::read(dir.join(STATE_FILE))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default()
}

impl Shared {
    /// The store could not be reached: the first time since it could, a `fleet_degraded`
    /// event.
    fn degraded(&self, why: &str) {
        let outbox = self.outbox().len();
        let mut i = self.lock();
        i.report.last_error = Some(why.to_string());
        if !i.report.connected && i.report.degraded_since.is_some() {
            return;
        }
        let now = SystemTime::now();
        i.report.connected = false;
        i.report.connected_since = None;
        i.report.degraded_since = Some(crate::clock::rfc3339(now));
        i.down_at = Some(Instant::now());
        warn!(store = %i.report.store, "fleet store unreachable, enforcing locally: {why}");
        let who = (i.report.store.clone(), i.report.host_id.clone());
        let since = i.report.degraded_since.clone();
        self.events.fleet(events::FleetLine {
            outbox,
            ..fleet_line(now, "fleet_degraded", who, Some(why.to_string()), since)
        });
    }

    /// The reader is connected and caught up: after a degraded spell, `fleet_restored`.
    fn restored(&self) {
        let outbox = self.outbox().len();
        let mut i = self.lock();
        if i.report.connected {
            return;
        }
        let now = SystemTime::now();
        let was_down = i.report.degraded_since.take();
        i.report.connected = true;
        i.report.connected_since = Some(crate::clock::rfc3339(now));
        let down_for = i.down_at.take().map(|t| t.elapsed().as_millis() as u64);
        if let Some(since) = was_down {
            info!(store = %i.report.store, "fleet store reachable again");
            let who = (i.report.store.clone(), i.report.host_id.clone());
            self.events.fleet(events::FleetLine {
                down_for_ms: down_for,
                outbox,
                ..fleet_line(now, "fleet_restored", who, None, Some(since))
            });
        } else {
            info!(store = %i.report.store, "fleet store connected");
        }
    }
}

/// Records of a stream reply: `(last id, records)`.
type StreamReply = Option<Vec<(String, Vec<(String, Vec<(String, String)>)>)>>;

/// The records of stream entries this host accepts ([`Trust::stream_record`]: authenticated
/// with the fleet key if there is one, every field within its bounds), and the last entry's
/// id.
fn parse_entries(
    trust: &Trust,
    entries: Vec<(String, Vec<(String, String)>)>,
) -> (Option<String>, Vec<Record>) {
    let mut last = None;
    let mut out = Vec::with_capacity(entries.len());
    let now_ms = unix_ms(SystemTime::now());
    for (id, fields) in entries {
        let field = |name: &str| {
            fields
                .iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.as_str())
        };
        if let Some(r) = trust.stream_record(field("r"), field("m"), now_ms) {
            out.push(r);
        }
        last = Some(id);
    }
    (last, out)
}

/// The reader: keeps a connection to the store, resyncs from the snapshot when it has to,
/// and follows the stream from its cursor, handing other hosts' records to the owner.
pub(super) async fn reader<A, Fut>(
    settings: Arc<Settings>,
    shared: Arc<Shared>,
    apply: A,
) -> anyhow::Result<()>
where
    A: Fn(Received) -> Fut + Send + Sync + Clone + 'static,
    Fut: std::future::Future<Output = anyhow::Result<Applied>> + Send + 'static,
{
    let mut backoff = BACKOFF_FIRST;
    loop {
        match follow(&settings, &shared, &apply, &mut backoff).await {
            Ok(()) => backoff = BACKOFF_FIRST,
            Err(e) => {
                shared.degraded(&format!("{e:#}"));
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(BACKOFF_MAX);
            }
        }
    }
}

/// Follow the stream until an error; `backoff` (the wait before the next connection) starts
/// over once a read succeeds.
async fn follow<A, Fut>(
    settings: &Settings,
    shared: &Shared,
    apply: &A,
    backoff: &mut Duration,
) -> anyhow::Result<()>
where
    A: Fn(Received) -> Fut + Send + Sync + Clone + 'static,
    Fut: std::future::Future<Output = anyhow::Result<Applied>> + Send + 'static,
{
    let read_timeout = Duration::from_millis(READ_BLOCK_MS) + REQUEST_TIMEOUT;
    let mut conn = settings.connect(read_timeout).await?;
    let mut cursor = shared.lock().report.cursor.clone();
    // A cursor that the stream no longer holds: records may have been trimmed away (or the
    // store lost its data), so the snapshot is read; one it still holds is followed on.
    let mut cursor_found = false;
    if let Some(c) = &cursor {
        let t0 = Instant::now();
        let found: Vec<(String, Vec<(String, String)>)> = redis::cmd("XRANGE")
            .arg(&settings.keys.stream)
            .arg(c)
            .arg(c)
            .query_async(&mut conn)
            .await
            .context("reading the ban stream")?;
        shared.rtt(t0);
        cursor_found = !found.is_empty();
    }
    if !cursor_found {
        let last = resync::resync(settings, shared, &mut conn, apply).await?;
        save_cursor(settings, shared, &last).await;
        cursor = Some(last);
    }
    shared.restored();
    // When the cursor was last written to disk.
    let mut saved_at = Instant::now();
    loop {
        let from = cursor.clone().unwrap_or_else(|| "0-0".into());
        let reply: StreamReply = redis::cmd("XREAD")
            .arg("COUNT")
            .arg(BATCH)
            .arg("BLOCK")
            .arg(READ_BLOCK_MS)
            .arg("STREAMS")
            .arg(&settings.keys.stream)
            .arg(&from)
            .query_async(&mut conn)
            .await
            .context("reading the ban stream")?;
        *backoff = BACKOFF_FIRST;
        // A blocked read's time is the wait for records, not the store's round trip.
        let Some(streams) = reply else {
            // Nothing new for a while: the cursor is written if it moved.
            save_cursor_if_moved(settings, shared).await;
            saved_at = Instant::now();
            continue;
        };
        for (_, entries) in streams {
            let (last, records) = parse_entries(&settings.trust, entries);
            let received_at = unix_ms(SystemTime::now());
            let theirs: Vec<Record> = records
                .into_iter()
                .filter(|r| r.host != settings.host_id)
                .collect();
            if let Some(r) = theirs.last() {
                shared.lock().report.lag_ms = Some(received_at.saturating_sub(r.at_ms));
            }
            let (bans, unbans) = theirs.iter().fold((0, 0), |(b, u), r| match r.op {
                Op::Ban => (b + 1, u),
                Op::Unban => (b, u + 1),
            });
            if !theirs.is_empty() {
                let applied = apply(Received::Records(theirs)).await?;
                let mut i = shared.lock();
                i.report.bans_received += bans;
                i.report.unbans_received += unbans;
                i.report.bans_skipped += applied.skipped;
            }
            if let Some(last) = last {
                shared.lock().report.cursor = Some(last.clone());
                cursor = Some(last);
            }
        }
        if saved_at.elapsed() >= CURSOR_SAVE {
            save_cursor_if_moved(settings, shared).await;
            saved_at = Instant::now();
        }
    }
}

/// Write the cursor to `state_dir` (a temporary file renamed over the old one, durably).
pub(super) fn write_cursor(
    settings: &Settings,
    shared: &Shared,
    cursor: &str,
) -> anyhow::Result<()> {
    let _writing = shared.cursor_file.lock().unwrap_or_else(|e| e.into_inner());
    let saved = Saved {
        host_id: settings.host_id.clone(),
        cursor: Some(cursor.to_string()),
    };
    crate::durable::write_atomically(
        &settings.state_dir,
        STATE_FILE,
        &serde_json::to_vec(&saved)?,
    )
}

/// Take `cursor` as the reader's, and write it to disk now.
async fn save_cursor(settings: &Settings, shared: &Shared, cursor: &str) {
    shared.lock().report.cursor = Some(cursor.to_string());
    save_cursor_if_moved(settings, shared).await;
}

/// Write the reader's cursor to disk if it moved since it was last written.
async fn save_cursor_if_moved(settings: &Settings, shared: &Shared) {
    let cursor = {
        let i = shared.lock();
        if i.report.cursor == i.saved_cursor {
            return;
        }
        i.report.cursor.clone()
    };
    let Some(cursor) = cursor else { return };
    match tokio::task::block_in_place(|| write_cursor(settings, shared, &cursor)) {
        Ok(()) => shared.lock().saved_cursor = Some(cursor),
        Err(e) => warn!("saving the fleet cursor: {e:#}"),
    }
}
