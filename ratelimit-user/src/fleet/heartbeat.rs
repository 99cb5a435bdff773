//! The heartbeat task: this host's heartbeat into the peers hash every [`HEARTBEAT`], and the
//! snapshot swept of ended bans and old tombstones, a bounded step at a time.

use std::{sync::Arc, time::SystemTime};

use anyhow::Context as _;

use super::{
    HEARTBEAT, Keys, SWEEP_COUNT, Settings, Shared, peers,
    store::{Conn, Lua},
    unix_ms,
};

/// Remove a snapshot field if it still holds the value the sweep saw.
const PRUNE_SCRIPT: &str = r#"
if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then
  return redis.call('HDEL', KEYS[1], ARGV[1])
end
return 0
"#;

/// The heartbeat: every [`HEARTBEAT`], this host's [`Heartbeat`] into [`PEERS_KEY`], and the
/// others' read back within a bound ([`peers`]); then, when bans are shared, the next
/// [`SWEEP_COUNT`] fields of the snapshot looked at, and the stale ones pruned. A failure
/// waits for the next beat (the reader reports the store's health).
pub(super) async fn heartbeat(settings: Arc<Settings>, shared: Arc<Shared>) -> anyhow::Result<()> {
    let mut conn: Option<Conn> = None;
    let mut tick = tokio::time::interval(HEARTBEAT);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut prune = Lua::new(PRUNE_SCRIPT);
    let mut scan: u64 = 0;
    let mut known = peers::Peers::default();
    loop {
        tick.tick().await;
        let res = match peers::beat(&settings, &shared, &mut conn, &mut known).await {
            Ok(()) if !settings.share_bans => Ok(()),
            Ok(()) => {
                let c = conn.as_mut().expect("connected by the beat");
                sweep_snapshot(&settings.keys, c, &mut prune, &mut scan).await
            }
            Err(e) => Err(e),
        };
        if let Err(e) = res {
            conn = None;
            tracing::debug!("fleet heartbeat: {e:#}");
        }
    }
}

/// Whether a snapshot value is stale at `now_ms`: a ban that has ended, or a tombstone older
/// than `first_ms`, the stream's first entry (`None`: the stream is empty; tombstones stay).
fn stale_in_snapshot(value: &str, now_ms: u64, first_ms: Option<u64>) -> bool {
    let Some((head, _)) = value.split_once('|') else {
        return true;
    };
    match head.strip_prefix('t') {
        Some(at) => match (at.parse::<u64>(), first_ms) {
            (Ok(at), Some(first)) => at < first,
            (Ok(_), None) => false,
            (Err(_), _) => true,
        },
        None => match head.parse::<u64>() {
            Ok(end) => end != 0 && end <= now_ms,
            Err(_) => true,
        },
    }
}

/// One step of the snapshot's sweep: the next fields from `scan` (an `HSCAN` cursor, 0 = a
/// new pass), and those stale removed unless they changed since.
async fn sweep_snapshot(
    keys: &Keys,
    c: &mut Conn,
    prune: &mut Lua,
    scan: &mut u64,
) -> anyhow::Result<()> {
    let (next, fields): (u64, Vec<(String, String)>) = redis::cmd("HSCAN")
        .arg(&keys.snap)
        .arg(*scan)
        .arg("COUNT")
        .arg(SWEEP_COUNT)
        .query_async(c)
        .await
        .context("scanning the ban snapshot")?;
    *scan = next;
    let first: Vec<(String, Vec<(String, String)>)> =
        if fields.iter().any(|(_, v)| v.starts_with('t')) {
            redis::cmd("XRANGE")
                .arg(&keys.stream)
                .arg("-")
                .arg("+")
                .arg("COUNT")
                .arg(1)
                .query_async(c)
                .await
                .context("reading the ban stream's first entry")?
        } else {
            Vec::new()
        };
    let first_ms = first
        .first()
        .and_then(|(id, _)| id.split('-').next()?.parse::<u64>().ok());
    let now_ms = unix_ms(SystemTime::now());
    let stale: Vec<(String, String)> = fields
        .into_iter()
        .filter(|(_, v)| stale_in_snapshot(v, now_ms, first_ms))
        .collect();
    prune
        .run(c, &stale, |cmd, (field, value)| {
            cmd.arg(1).arg(&keys.snap).arg(field).arg(value);
            Ok(())
        })
        .await
        .context("pruning the ban snapshot")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stale_snapshot_entries_are_ended_bans_and_tombstones_before_the_stream() {
        let now = 10_000;
        // Bans: ended, not yet, until removed.
        assert!(stale_in_snapshot("9999|{}", now, None));
        assert!(stale_in_snapshot("10000|{}", now, Some(1)));
        assert!(!stale_in_snapshot("10001|{}", now, None));
        assert!(!stale_in_snapshot("0|{}", now, Some(20_000)));
        // Tombstones: kept while the stream reaches back to them, or is empty.
        assert!(stale_in_snapshot("t4999|{}", now, Some(5000)));
        assert!(!stale_in_snapshot("t5000|{}", now, Some(5000)));
        assert!(!stale_in_snapshot("t1|{}", now, None));
        // What is not ours.
        assert!(stale_in_snapshot("junk", now, None));
        assert!(stale_in_snapshot("tx|{}", now, Some(1)));
    }
}
