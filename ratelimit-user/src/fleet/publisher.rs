//! The publisher: the owner's records into the outbox (`state_dir/fleet-outbox.json` while
//! the store cannot be reached), and the outbox to the store, oldest first, a batch at a time.

use std::{
    collections::VecDeque,
    path::Path,
    sync::{Arc, atomic::Ordering},
    time::Instant,
};

use anyhow::Context as _;
use tokio::sync::mpsc;
use tracing::{info, warn};

use super::{
    BACKOFF_FIRST, BACKOFF_MAX, BATCH, OUTBOX_FILE, OUTBOX_MAX, Op, PUBLISH_RETRY, REQUEST_TIMEOUT,
    Record, STREAM_MAXLEN, Settings, Shared,
    store::{Conn, Lua},
    trust,
};
use crate::durable::{self, Loaded};

pub(super) fn load_outbox(dir: &Path) -> VecDeque<Record> {
    let path = dir.join(OUTBOX_FILE);
    let parse = |b: &[u8]| serde_json::from_slice::<VecDeque<Record>>(b);
    match durable::load(&path, parse) {
        Loaded::Read(v) => {
            if !v.is_empty() {
                info!(
                    records = v.len(),
                    "fleet outbox read from {}: sent when the store is reachable",
                    path.display()
                );
            }
            v
        }
        Loaded::Bad { error: e, aside } => {
            warn!(
                "{} is not a fleet outbox ({e}); it was {}",
                path.display(),
                durable::aside_words(&aside)
            );
            VecDeque::new()
        }
        Loaded::Missing | Loaded::Unreadable(_) => VecDeque::new(),
    }
}

/// Publish one record: appended to the stream, and the snapshot's field for its prefix
/// updated (a ban that ends later, or never, is kept; an expired one or a tombstone is
/// replaced; an `unban` leaves its tombstone). With the fleet key, ARGV[7] is the snapshot
/// value's MAC (appended as `|<MAC>`) and ARGV[8] the record's (the stream entry's field
/// `m`); both empty without.
const PUBLISH_SCRIPT: &str = r#"
local suffix = ''
if ARGV[7] ~= '' then
  suffix = '|' .. ARGV[7]
end
local cur = redis.call('HGET', KEYS[2], ARGV[2])
if ARGV[3] == 'ban' then
  local keep = false
  if cur then
    local e = tonumber(string.match(cur, '^(%d+)|'))
    if e == 0 then
      keep = true
    elseif ARGV[4] ~= '0' and e and e >= tonumber(ARGV[4]) then
      keep = true
    end
  end
  if not keep then
    redis.call('HSET', KEYS[2], ARGV[2], ARGV[4] .. '|' .. ARGV[5] .. suffix)
  end
else
  redis.call('HSET', KEYS[2], ARGV[2], 't' .. ARGV[6] .. '|' .. ARGV[5] .. suffix)
end
if ARGV[8] ~= '' then
  return redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[1], '*', 'r', ARGV[5], 'm', ARGV[8])
end
return redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[1], '*', 'r', ARGV[5])
"#;

/// Publish one batch, in one round trip.
async fn publish_batch(
    settings: &Settings,
    conn: &mut Conn,
    lua: &mut Lua,
    batch: &[Record],
) -> anyhow::Result<()> {
    let trust = &settings.trust;
    lua.run(conn, batch, |cmd, r| {
        let json = serde_json::to_string(r)?;
        let snap_mac = trust.snapshot_mac(r, &json);
        let mac = trust.sign(trust::Kind::Record, &[json.as_bytes()]);
        cmd.arg(2)
            .arg(&settings.keys.stream)
            .arg(&settings.keys.snap)
            .arg(STREAM_MAXLEN)
            .arg(&r.net)
            .arg(match r.op {
                Op::Ban => "ban",
                Op::Unban => "unban",
            })
            .arg(r.exp_ms)
            .arg(&json)
            .arg(r.at_ms)
            .arg(snap_mac)
            .arg(mac);
        Ok(())
    })
    .await
}

/// Write the outbox whole (or remove the file when it is empty).
fn save_outbox(dir: &Path, records: &[Record]) -> anyhow::Result<()> {
    if records.is_empty() {
        match std::fs::remove_file(dir.join(OUTBOX_FILE)) {
            Ok(()) => crate::durable::sync_dir(dir),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(e).context("removing the fleet outbox"),
        }
    } else {
        crate::durable::write_atomically(dir, OUTBOX_FILE, &serde_json::to_vec(records)?)
    }
}

/// The publisher: takes the owner's records into the outbox and sends the outbox to the
/// store, oldest first. While the store cannot be reached the outbox is kept on disk.
pub(super) async fn publisher(
    settings: Arc<Settings>,
    shared: Arc<Shared>,
    rx: Arc<tokio::sync::Mutex<mpsc::UnboundedReceiver<Record>>>,
) -> anyhow::Result<()> {
    let mut rx = rx.lock().await;
    let mut conn: Option<Conn> = None;
    let mut lua = Lua::new(PUBLISH_SCRIPT);
    // The outbox's generation as last written to disk (or read from it), to write on change.
    let mut on_disk = shared.outbox_gen.load(Ordering::Relaxed);
    let mut retry = tokio::time::interval(PUBLISH_RETRY);
    retry.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut backoff = BACKOFF_FIRST;
    let mut next_try = Instant::now();
    loop {
        tokio::select! {
            r = rx.recv() => {
                let Some(r) = r else { return Ok(()) };
                let mut fresh = vec![r];
                while let Ok(r) = rx.try_recv() {
                    fresh.push(r);
                }
                let over = shared.change_outbox(|ob| {
                    ob.extend(fresh);
                    let over = ob.len().saturating_sub(OUTBOX_MAX);
                    ob.drain(..over);
                    over
                });
                if over > 0 {
                    shared.lock().report.outbox_dropped += over as u64;
                    warn!(dropped = over, "fleet outbox full: the oldest records were dropped");
                }
            }
            _ = retry.tick() => {}
        }
        if shared.outbox().is_empty() {
            continue;
        }
        if Instant::now() < next_try {
            persist(&settings, &shared, &mut on_disk).await;
            continue;
        }
        let sent = send_outbox(&settings, &shared, &mut conn, &mut lua).await;
        match sent {
            Ok(()) => backoff = BACKOFF_FIRST,
            Err(e) => {
                conn = None;
                next_try = Instant::now() + backoff;
                backoff = (backoff * 2).min(BACKOFF_MAX);
                shared.lock().report.last_error = Some(format!("{e:#}"));
            }
        }
        persist(&settings, &shared, &mut on_disk).await;
    }
}

/// Send the outbox, batch by batch, until it is empty or a batch fails.
async fn send_outbox(
    settings: &Settings,
    shared: &Shared,
    conn: &mut Option<Conn>,
    lua: &mut Lua,
) -> anyhow::Result<()> {
    loop {
        let batch: Vec<Record> = shared.outbox().iter().take(BATCH).cloned().collect();
        if batch.is_empty() {
            return Ok(());
        }
        if conn.is_none() {
            *conn = Some(settings.connect(REQUEST_TIMEOUT).await?);
        }
        let c = conn.as_mut().expect("connected above");
        let t0 = Instant::now();
        publish_batch(settings, c, lua, &batch)
            .await
            .with_context(|| format!("publishing to {}", settings.store))?;
        shared.rtt(t0);
        let (bans, unbans) = batch.iter().fold((0, 0), |(b, u), r| match r.op {
            Op::Ban => (b + 1, u),
            Op::Unban => (b, u + 1),
        });
        shared.change_outbox(|ob| {
            let n = batch.len().min(ob.len());
            ob.drain(..n);
        });
        let mut i = shared.lock();
        i.report.bans_published += bans;
        i.report.unbans_published += unbans;
    }
}

/// Write the outbox to disk if it changed since it was last written (`on_disk`: its
/// generation then).
async fn persist(settings: &Arc<Settings>, shared: &Arc<Shared>, on_disk: &mut u64) {
    let (records, generation): (Vec<Record>, u64) = {
        let ob = shared.outbox();
        let generation = shared.outbox_gen.load(Ordering::Relaxed);
        if generation == *on_disk {
            return;
        }
        (ob.iter().cloned().collect(), generation)
    };
    let dir = settings.state_dir.clone();
    let saved = tokio::task::spawn_blocking(move || save_outbox(&dir, &records)).await;
    match saved {
        Ok(Ok(())) => *on_disk = generation,
        Ok(Err(e)) => warn!("saving the fleet outbox: {e:#}"),
        Err(e) => warn!("saving the fleet outbox: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Mutex, atomic::AtomicU64};

    use super::super::{Clock, Inner, Keys, store::Client, trust::Trust};
    use crate::{config, events};

    #[tokio::test]
    async fn the_outbox_is_written_whenever_it_changed_even_at_the_same_length() {
        let dir = std::env::temp_dir().join(format!("rl-fleet-obgen-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let rec = |net: &str| Record {
            op: Op::Ban,
            net: net.into(),
            exp_ms: 0,
            at_ms: 1,
            host: "a".into(),
            rule: None,
            reason: None,
        };
        let settings = Arc::new(Settings {
            store: "redis://127.0.0.1:1".into(),
            host_id: "a".into(),
            share_bans: true,
            state_dir: dir.clone(),
            clock: Arc::new(Clock::new(config::DEFAULT_MAX_CLOCK_SKEW)),
            trust: Arc::new(Trust::new("default", None, Default::default())),
            keys: Keys::of("default"),
            id_guard: Arc::default(),
            client: Client::Single(redis::Client::open("redis://127.0.0.1:1").unwrap()),
        });
        let shared = Arc::new(Shared {
            inner: Mutex::new(Inner::default()),
            outbox: Mutex::new(VecDeque::new()),
            outbox_gen: AtomicU64::new(0),
            cursor_file: Mutex::new(()),
            events: events::Events::start(None, 1, vec![]).unwrap(),
            global: Arc::default(),
            trust: Arc::new(Trust::new("default", None, Default::default())),
        });
        let mut on_disk = shared.outbox_gen.load(Ordering::Relaxed);
        shared.change_outbox(|ob| ob.push_back(rec("192.0.2.1/32")));
        persist(&settings, &shared, &mut on_disk).await;
        assert_eq!(load_outbox(&dir), VecDeque::from(vec![rec("192.0.2.1/32")]));
        // One delivered and one added: the same length, other content.
        shared.change_outbox(|ob| {
            ob.pop_front();
            ob.push_back(rec("192.0.2.2/32"));
        });
        persist(&settings, &shared, &mut on_disk).await;
        assert_eq!(load_outbox(&dir), VecDeque::from(vec![rec("192.0.2.2/32")]));
        // Unchanged: not written again.
        std::fs::remove_file(dir.join(OUTBOX_FILE)).unwrap();
        persist(&settings, &shared, &mut on_disk).await;
        assert!(!dir.join(OUTBOX_FILE).exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_outbox_is_written_whole_and_removed_when_empty() {
        let dir = std::env::temp_dir().join(format!("rl-fleet-ob-{}", std::process::id()));
        let r = Record {
            op: Op::Unban,
            net: "192.0.2.1/32".into(),
            exp_ms: 0,
            at_ms: 1,
            host: "a".into(),
            rule: None,
            reason: None,
        };
        save_outbox(&dir, &[r.clone(), r.clone()]).unwrap();
        assert_eq!(load_outbox(&dir), VecDeque::from(vec![r.clone(), r]));
        save_outbox(&dir, &[]).unwrap();
        assert!(!dir.join(OUTBOX_FILE).exists());
        assert!(load_outbox(&dir).is_empty());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
