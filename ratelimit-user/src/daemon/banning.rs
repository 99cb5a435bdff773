//! The owner's bans: `ban add|del` (a rule's own bans are lifted in `lift.rs`), the expiry
//! sweep, the saves to `state_dir` and the events of operator bans.

use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context as _, bail};
use ipnet::IpNet;
use ratelimit_common::{
    addr::IpKey,
    event::{EV_BAN, EV_UNBAN, Event},
    maps::*,
};
use tracing::{error, info, warn};

use super::{
    Handle, State, ban_event,
    fleet::{FLEET_LIFTS_FILE, FLEET_LIFTS_MAX},
};
use crate::{
    api::{BanSpec, BansAdded, BansRemoved},
    config, events,
    policy::apply::prefix,
    policy::bans,
};

/// One ban write of a request, to undo it: (table, prefix length, address, the ban that was
/// there before: `None` = none).
pub(super) type BanUndo = (u32, u32, IpKey, Option<BanEntry>);

impl State {
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
    pub(super) fn write_dropped(&mut self, dropped: &[bans::Dropped]) {
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
    pub(super) fn forget_ban_notes(&mut self, cidr: &str) {
        self.ban_notes.write().forget(cidr);
    }

    pub(super) fn sweep_expired_bans_inner(&mut self) -> usize {
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
                src: [0; 16],
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

    /// `ban add`, all or nothing: every entry is checked before any is applied, and if a
    /// map write fails midway (the ban map is full) the bans this request inserted are
    /// removed and the ones it replaced put back, with no event for any of them.
    pub(super) fn ban_add(&mut self, specs: &[BanSpec], local: bool) -> anyhow::Result<BansAdded> {
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
    pub(super) fn insert_bans(
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
    pub(super) fn undo_ban_writes(&mut self, undo: Vec<BanUndo>) {
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
    pub(super) fn ban_del(&mut self, cidrs: &[String], local: bool) -> anyhow::Result<BansRemoved> {
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
}

/// The monotonic expiry of an operator's ban of `duration_ms` added at `now` (0 = until
/// removed). Durations are checked to be at most 10 years; the sum saturates anyway.
pub(super) fn ban_end(now: u64, duration_ms: Option<u64>) -> u64 {
    duration_ms
        .map(|ms| now.saturating_add(ms.saturating_mul(1_000_000)).max(1))
        .unwrap_or(0)
}

/// How much longer than a save took the saver waits before the next one: a save of many
/// bans (say 300,000, a second or more) then takes at most a tenth of the owner's time, and
/// the fleet's bans, the control requests and the events are not held up behind it.
pub(super) const SAVE_SPACING: u32 = 9;

/// Write bans to `state_dir` within a second of a change, or [`SAVE_SPACING`] times the last
/// save's duration if that is longer (and every minute regardless, so remaining times stay
/// fresh on disk): a job of the owner's each second.
pub(super) async fn persist_bans(handle: Handle) -> anyhow::Result<()> {
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
