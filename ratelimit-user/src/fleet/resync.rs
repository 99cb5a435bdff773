//! The resync from the snapshot (`Keys::snap`, [`SNAP_KEY`] in the fleet `default`), a page at a time: a host with no cursor, or
//! whose cursor the stream no longer holds, takes the stream's last id, then walks the
//! snapshot with `HSCAN ... COUNT` [`RESYNC_PAGE`] and hands each page to the owner as it
//! comes (each page's read has its own timeout, the connection's, not one for the whole).
//! Where it is (the stream id and the walk's cursor) is kept: a resync cut off by an error
//! goes on from the page it reached once the store is back (unless the stream was trimmed
//! past the id it began at: then it begins again). A field that the walk returns twice is
//! applied twice, to the same effect.
//!
//! [`SNAP_KEY`]: super::SNAP_KEY

use std::time::{Instant, SystemTime};

use anyhow::Context as _;
use serde::{Deserialize, Serialize};
use tracing::info;

use super::{Applied, Conn, Op, Received, Record, Settings, Shared, unix_ms};
use crate::fleet::trust::Trust;

/// Snapshot fields read per page (`HSCAN COUNT`).
pub const RESYNC_PAGE: usize = 2000;

/// A resync under way, as `fleet status` and `/v1/fleet` show it.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Default)]
pub struct Progress {
    /// RFC 3339: when it began.
    pub since: String,
    /// The stream's last id when it began: the stream is followed from there after it.
    pub stream_end: String,
    /// The snapshot walk's cursor (`HSCAN`; 0 before the first page).
    pub scan: u64,
    pub pages: u64,
    /// Snapshot fields read so far.
    pub fields: u64,
}

/// The records of a page of the snapshot (`field → <end>|<record>`) this host applies:
/// every tombstone, and the bans of other hosts, each authenticated and bounded by
/// `fleet_trust` (what fails is dropped and counted there).
fn records_of(trust: &Trust, me: &str, page: &[(String, String)], now_ms: u64) -> Vec<Record> {
    page.iter()
        .filter_map(|(field, v)| trust.snapshot_record(field, v, now_ms))
        .filter(|r| r.op == Op::Unban || r.host != me)
        .collect()
}

/// Whether the stream still holds entry `id` (`0-0`: the stream was empty; always).
async fn in_stream(settings: &Settings, conn: &mut Conn, id: &str) -> anyhow::Result<bool> {
    if id == "0-0" {
        return Ok(true);
    }
    let found: Vec<(String, Vec<(String, String)>)> = redis::cmd("XRANGE")
        .arg(&settings.keys.stream)
        .arg(id)
        .arg(id)
        .query_async(conn)
        .await
        .context("reading the ban stream")?;
    Ok(!found.is_empty())
}

/// Resync from the snapshot, page by page, going on from where a resync cut off was; returns
/// the cursor to follow the stream from.
pub(super) async fn resync<A, Fut>(
    settings: &Settings,
    shared: &Shared,
    conn: &mut Conn,
    apply: &A,
) -> anyhow::Result<String>
where
    A: Fn(Received) -> Fut + Send + Sync + Clone + 'static,
    Fut: std::future::Future<Output = anyhow::Result<Applied>> + Send + 'static,
{
    let under_way = shared.lock().report.resync.clone();
    let resume = match &under_way {
        Some(p) => in_stream(settings, conn, &p.stream_end).await?,
        None => false,
    };
    let mut p = match under_way {
        Some(p) if resume => {
            info!(
                pages = p.pages,
                fields = p.fields,
                "fleet resync goes on from where it was cut off"
            );
            p
        }
        _ => {
            let t0 = Instant::now();
            // The last id first: a record added meanwhile is read again, harmlessly.
            let last: Vec<(String, Vec<(String, String)>)> = redis::cmd("XREVRANGE")
                .arg(&settings.keys.stream)
                .arg("+")
                .arg("-")
                .arg("COUNT")
                .arg(1)
                .query_async(conn)
                .await
                .context("reading the ban stream's last entry")?;
            shared.rtt(t0);
            Progress {
                since: crate::clock::rfc3339(SystemTime::now()),
                stream_end: last
                    .into_iter()
                    .next()
                    .map(|(id, _)| id)
                    .unwrap_or_else(|| "0-0".into()),
                ..Progress::default()
            }
        }
    };
    shared.lock().report.resync = Some(p.clone());
    loop {
        let t0 = Instant::now();
        let (next, page): (u64, Vec<(String, String)>) = redis::cmd("HSCAN")
            .arg(&settings.keys.snap)
            .arg(p.scan)
            .arg("COUNT")
            .arg(RESYNC_PAGE)
            .query_async(conn)
            .await
            .context("reading the ban snapshot")?;
        shared.rtt(t0);
        // Bans that have ended are skipped by the owner; tombstones lift the fleet's bans
        // held here (this host's own `unban`s too: a ban received before it may be held).
        let now_ms = unix_ms(SystemTime::now());
        let records = records_of(&settings.trust, &settings.host_id, &page, now_ms);
        if !records.is_empty() {
            let applied = apply(Received::Snapshot(records)).await?;
            let mut i = shared.lock();
            i.report.bans_received += applied.bans;
            i.report.bans_skipped += applied.skipped;
        }
        p.scan = next;
        p.pages += 1;
        p.fields += page.len() as u64;
        shared.lock().report.resync = Some(p.clone());
        if next == 0 {
            break;
        }
    }
    {
        let mut i = shared.lock();
        i.report.resync = None;
        i.report.resyncs += 1;
    }
    info!(
        fields = p.fields,
        pages = p.pages,
        stream_end = %p.stream_end,
        "fleet bans resynced from the snapshot"
    );
    Ok(p.stream_end)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_page_gives_the_other_hosts_bans_and_every_tombstone() {
        let rec = |op: &str, net: &str, host: &str| {
            format!(r#"{{"op":"{op}","net":"{net}","exp_ms":0,"at_ms":1,"host":"{host}"}}"#)
        };
        let page = vec![
            (
                "192.0.2.1/32".to_string(),
                format!("0|{}", rec("ban", "192.0.2.1/32", "h1")),
            ),
            (
                "192.0.2.2/32".to_string(),
                format!("0|{}", rec("ban", "192.0.2.2/32", "me")),
            ),
            (
                "192.0.2.3/32".to_string(),
                format!("t5|{}", rec("unban", "192.0.2.3/32", "me")),
            ),
            (
                "192.0.2.4/32".to_string(),
                "not a snapshot value".to_string(),
            ),
            ("192.0.2.5/32".to_string(), "0|{".to_string()),
        ];
        let trust = Trust::new("default", None, Default::default());
        let r = records_of(&trust, "me", &page, 10);
        assert_eq!(r.len(), 2);
        assert_eq!((r[0].op, r[0].host.as_str()), (Op::Ban, "h1"));
        assert_eq!(r[1].op, Op::Unban);
    }
}
