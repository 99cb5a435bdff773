//! The daemon's handle on per-client state: the per-source store (`RL_CLIENTS`, an array of
//! sets of `STORE_WAYS` slots, see `ratelimit_common::maps::Slot` and the program's
//! `store.rs`) and the shared keys' states (`RL_SHARED`, a hash map).
//!
//! Reads of the store go through BPF_MAP_LOOKUP_BATCH (a few hundred system calls for a
//! million slots, and none of its pages enter the daemon's resident set); the daemon writes
//! slots only through the store's mapping, with an atomic compare-and-swap of the tag, the
//! same claim the program makes, so it never tears a slot a CPU is writing.

use std::{
    os::fd::{AsFd as _, AsRawFd as _},
    path::Path,
    ptr::NonNull,
    sync::atomic::{AtomicU32, AtomicU64, Ordering},
};

use anyhow::{Context as _, anyhow, bail};
use aya::maps::{HashMap, Map, MapData};
use ratelimit_common::maps::{
    ClientKey, ClientState, FleetAdd, HashKey, KEY_IP, KEY_TUPLE, SLOT_BUSY, STORE_WAYS,
    SharedState, StoreSet, known_hash, slot_key, slot_ready, slot_tag, store_sets_of,
};

/// A window meter of a per-source state.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Meter {
    /// The threshold's: `stamp`, `cur` (admitted), `prev`.
    Admitted,
    /// The ban meter's: `ban_stamp`, `seen_cur` (offered), `seen_prev`.
    Offered,
}

/// A per-source state where it was found: its slot, the slot's tag and the address, which
/// must both still be there for the state to be the same client's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotRef {
    pub index: SlotIndex,
    pub tag: u32,
    pub addr: [u8; 16],
}

/// A slot: `set * STORE_WAYS + way`, as the program names it.
pub type SlotIndex = u64;

pub struct ClientStore {
    /// Shared keys (`all`, `region`).
    pub shared: HashMap<MapData, ClientKey, SharedState>,
    /// Keys of packet fields (`KEY_TUPLE`: `dst`, ports, protocol), `RL_KEYED`.
    pub keyed: HashMap<MapData, ClientKey, SharedState>,
    /// What the other hosts counted for the shared keys of global rules (`RL_FLEET_ADD`),
    /// written by the fleet's sync task only.
    fleet_add: std::sync::Mutex<HashMap<MapData, ClientKey, FleetAdd>>,
    sets_map: MapData,
    sets: u32,
    base: NonNull<StoreSet>,
    len_bytes: usize,
    /// The placement hash's key (`RL_HASH_KEY`), the program's.
    hash_key: HashKey,
}

// SAFETY: the mapping is shared memory; tags are accessed through atomics, and other fields
// are read as snapshots (a torn read is a report's momentary figure, as with the syscalls).
unsafe impl Send for ClientStore {}
// SAFETY: as above.
unsafe impl Sync for ClientStore {}

impl Drop for ClientStore {
    fn drop(&mut self) {
        // SAFETY: unmapping the region mapped in `new`, no longer referenced.
        unsafe { libc::munmap(self.base.as_ptr() as *mut libc::c_void, self.len_bytes) };
    }
}

impl ClientStore {
    /// From the program's maps `RL_SHARED`, `RL_KEYED`, `RL_FLEET_ADD` and `RL_CLIENTS`,
    /// placed under `hash_key`.
    pub fn new(
        shared: Map,
        keyed: Map,
        fleet_add: Map,
        sets_map: Map,
        hash_key: HashKey,
    ) -> anyhow::Result<Self> {
        let sets_map = match sets_map {
            Map::Array(d) => d,
            _ => bail!(
                "map RL_CLIENTS is not an array (pinned by an older build? `ratelimit detach` and restart)"
            ),
        };
        let info = sets_map.info().context("reading RL_CLIENTS's info")?;
        let sets = info.max_entries();
        if sets == 0 {
            bail!("RL_CLIENTS has no sets");
        }
        if info.value_size() as usize != size_of::<StoreSet>() {
            bail!(
                "RL_CLIENTS holds {}-byte values, this build {}-byte sets",
                info.value_size(),
                size_of::<StoreSet>()
            );
        }
        let len_bytes = super::mmap::mapped_len(sets as usize * size_of::<StoreSet>());
        let p = super::mmap::map_shared(sets_map.fd().as_fd(), len_bytes, "RL_CLIENTS")?;
        Ok(Self {
            shared: HashMap::try_from(shared)?,
            keyed: HashMap::try_from(keyed)?,
            fleet_add: std::sync::Mutex::new(HashMap::try_from(fleet_add)?),
            sets_map,
            sets,
            base: p.cast::<StoreSet>(),
            len_bytes,
            hash_key,
        })
    }

    /// A second handle from the pins in `pin_dir` (for a thread of its own).
    pub fn open(pin_dir: &Path) -> anyhow::Result<Self> {
        let open = |name: &str| {
            let path = pin_dir.join(name);
            MapData::from_pin(&path).with_context(|| format!("opening {}", path.display()))
        };
        let keys: aya::maps::Array<MapData, HashKey> =
            aya::maps::Array::try_from(Map::Array(open("RL_HASH_KEY")?))?;
        let hash_key = keys.get(&0, 0).context("reading RL_HASH_KEY")?;
        Self::new(
            Map::HashMap(open("RL_SHARED")?),
            Map::HashMap(open("RL_KEYED")?),
            Map::HashMap(open("RL_FLEET_ADD")?),
            Map::Array(open("RL_CLIENTS")?),
            hash_key,
        )
    }

    /// The placement hash's key.
    pub fn hash_key(&self) -> HashKey {
        self.hash_key
    }

    /// The keyed hash of per-source `key`, as the program computes it (`known_hash`).
    pub fn hash(&self, key: &ClientKey) -> u64 {
        known_hash(&self.hash_key, key.rule, key.prefix_len, &key.addr)
    }

    /// Sets in the store (what the program is told in `GlobalConfig::store_sets`).
    pub fn sets(&self) -> u32 {
        self.sets
    }

    /// Per-source states the store holds at most.
    pub fn capacity(&self) -> u64 {
        self.sets as u64 * STORE_WAYS as u64
    }

    fn set(&self, set: u32) -> *mut StoreSet {
        assert!(set < self.sets);
        // SAFETY: `set` is below the map's entries, all inside the mapping.
        unsafe { self.base.as_ptr().add(set as usize) }
    }

    fn tag(&self, i: SlotIndex) -> &AtomicU32 {
        let s = self.set((i / STORE_WAYS as u64) as u32);
        // SAFETY: an 8-aligned word inside the mapping, shared with the program, which
        // accesses it atomically too.
        unsafe { AtomicU32::from_ptr(&raw mut (*s).tags[(i % STORE_WAYS as u64) as usize]) }
    }

    fn slot(&self, i: SlotIndex) -> *mut ratelimit_common::maps::Slot {
        let s = self.set((i / STORE_WAYS as u64) as u32);
        // SAFETY: a slot inside the mapping.
        unsafe { &raw mut (*s).slots[(i % STORE_WAYS as u64) as usize] }
    }

    /// The slots of `key`'s two sets (the second's only if it is another set) and its tag.
    fn place(&self, key: &ClientKey) -> (Vec<SlotIndex>, u32) {
        let hash = self.hash(key);
        let (a, b) = store_sets_of(hash, self.sets);
        let w = STORE_WAYS as u64;
        let mut slots: Vec<SlotIndex> = (a as u64 * w..(a as u64 + 1) * w).collect();
        if b != a {
            slots.extend(b as u64 * w..(b as u64 + 1) * w);
        }
        (slots, slot_tag(key.rule, key.prefix_len, hash))
    }

    /// The slot holding per-source `key`.
    fn find(&self, key: &ClientKey) -> Option<SlotIndex> {
        let (slots, tag) = self.place(key);
        slots.into_iter().find(|&i| {
            // SAFETY: a slot inside the mapping; the address is read after its tag.
            self.tag(i).load(Ordering::Acquire) == tag
                && unsafe { std::ptr::read_volatile(&raw const (*self.slot(i)).addr) } == key.addr
        })
    }

    /// A snapshot of `key`'s state (per-source or shared).
    pub fn get(&self, key: &ClientKey) -> Option<ClientState> {
        if key.kind != KEY_IP {
            return self.shared_map(key.kind).get(key, 0).ok().map(|s| s.state);
        }
        let i = self.find(key)?;
        // SAFETY: a slot inside the mapping (a snapshot: the program may be updating it).
        let st = unsafe { std::ptr::read_volatile(&raw const (*self.slot(i)).state) };
        (self.tag(i).load(Ordering::Acquire) == self.place(key).1).then_some(st)
    }

    /// Write `state` for per-source `key` over its own slot or into a free slot of its sets
    /// (bench and test fixtures; the program creates states itself). Fails if both sets are
    /// full.
    pub fn put(&self, key: &ClientKey, state: &ClientState) -> anyhow::Result<()> {
        if key.kind != KEY_IP || key.prefix_len > 128 {
            bail!("only per-source keys live in the store");
        }
        let (slots, tag) = self.place(key);
        let claim = |i: SlotIndex, from: u32| {
            self.tag(i)
                .compare_exchange(from, tag | SLOT_BUSY, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
        };
        let i = match self.find(key) {
            Some(i) if claim(i, tag) => i,
            Some(_) => bail!("the slot of {key:?} changed hands"),
            None => {
                // As the program does: the set with more free slots first.
                let free = |set: &[SlotIndex]| {
                    set.iter()
                        .filter(|&&i| self.tag(i).load(Ordering::Relaxed) == 0)
                        .count()
                };
                let (a, b) = slots.split_at(STORE_WAYS.min(slots.len()));
                let order: Vec<SlotIndex> = if free(b) > free(a) {
                    b.iter().chain(a).copied().collect()
                } else {
                    a.iter().chain(b).copied().collect()
                };
                order
                    .into_iter()
                    .find(|&i| claim(i, 0))
                    .ok_or_else(|| anyhow!("both sets of {key:?} are full"))?
            }
        };
        let s = self.slot(i);
        // SAFETY: claimed above: no CPU writes this slot until the tag is published.
        unsafe {
            std::ptr::write_volatile(&raw mut (*s).addr, key.addr);
            std::ptr::write_volatile(&raw mut (*s).state, *state);
        }
        self.tag(i).store(tag, Ordering::Release);
        Ok(())
    }

    /// A snapshot of slot `i` if it holds `tag` and `addr` (a per-source state the program may
    /// be updating: the window meters' words are read one by one).
    pub fn slot_state(&self, at: &SlotRef) -> Option<ClientState> {
        let (i, tag, addr) = (at.index, at.tag, &at.addr);
        if i >= self.capacity() || self.tag(i).load(Ordering::Acquire) != tag {
            return None;
        }
        let s = self.slot(i);
        // SAFETY: a slot inside the mapping; read after its tag, checked again after.
        let (a, st) = unsafe {
            (
                std::ptr::read_volatile(&raw const (*s).addr),
                std::ptr::read_volatile(&raw const (*s).state),
            )
        };
        (a == *addr && self.tag(i).load(Ordering::Acquire) == tag).then_some(st)
    }

    /// The slot `at` names, if it still holds that client (its tag and address).
    fn held(&self, at: &SlotRef) -> Option<*mut ratelimit_common::maps::Slot> {
        let (i, tag) = (at.index, at.tag);
        if i >= self.capacity() || self.tag(i).load(Ordering::Acquire) != tag {
            return None;
        }
        let s = self.slot(i);
        // SAFETY: a slot inside the mapping, its address read after its tag.
        (unsafe { std::ptr::read_volatile(&raw const (*s).addr) } == at.addr).then_some(s)
    }

    /// Add `delta` to a window counter of slot `i` (`cur` or `prev` of the meter `meter`) if
    /// the slot still holds `tag` and `addr` and the meter is still in window `window`: how the
    /// fleet's counts of a global rule's client enter its state. An atomic add, as the
    /// program's, so no count of either is lost. False if the slot or window moved on.
    pub fn add_in_window(
        &self,
        at: &SlotRef,
        meter: Meter,
        window: u64,
        to_prev: bool,
        delta: u64,
    ) -> bool {
        let Some(s) = self.held(at) else {
            return false;
        };
        // SAFETY: a slot inside the mapping; its words are 8-aligned and the program updates
        // them atomically too.
        unsafe {
            let st = &raw mut (*s).state;
            let (stamp, cur, prev) = match meter {
                Meter::Admitted => (
                    &raw mut (*st).stamp,
                    &raw mut (*st).cur,
                    &raw mut (*st).prev,
                ),
                Meter::Offered => (
                    &raw mut (*st).ban_stamp,
                    &raw mut (*st).seen_cur,
                    &raw mut (*st).seen_prev,
                ),
            };
            if AtomicU64::from_ptr(stamp).load(Ordering::Acquire) != window {
                return false;
            }
            AtomicU64::from_ptr(if to_prev { prev } else { cur })
                .fetch_add(delta, Ordering::AcqRel);
        }
        true
    }

    /// Take `ns` of bucket time out of the token bucket (GCRA) in `at`: its TAT (`stamp`)
    /// moves to `max(TAT, now) + ns`, never past `now + cap_ns` (where the program's own
    /// clamp holds a global bucket), by compare-and-swap as the program moves it. `now` is
    /// CLOCK_MONOTONIC ns. False if the slot no longer holds the client.
    pub fn charge_bucket(&self, at: &SlotRef, ns: u64, cap_ns: u64, now: u64) -> bool {
        let Some(s) = self.held(at) else {
            return false;
        };
        // SAFETY: a slot inside the mapping; its words are 8-aligned and the program updates
        // them atomically too.
        unsafe {
            let tat = AtomicU64::from_ptr(&raw mut (*s).state.stamp);
            let horizon = now.saturating_add(cap_ns);
            let mut old = tat.load(Ordering::Acquire);
            // Bounded: each failure means a packet moved the TAT in between.
            for _ in 0..64 {
                let new = old.max(now).saturating_add(ns).min(horizon);
                if new <= old {
                    return true;
                }
                match tat.compare_exchange(old, new, Ordering::AcqRel, Ordering::Acquire) {
                    Ok(_) => return true,
                    Err(seen) => old = seen,
                }
            }
        }
        false
    }

    /// Retire per-source `key`'s state (as an eviction would). True if it had one.
    pub fn remove(&self, key: &ClientKey) -> bool {
        let Some(i) = self.find(key) else {
            return false;
        };
        let tag = self.place(key).1;
        self.tag(i)
            .compare_exchange(tag, 0, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
    }

    /// The map holding the states of a key of kind `kind` that is not per source.
    pub fn shared_map(&self, kind: u8) -> &HashMap<MapData, ClientKey, SharedState> {
        if kind == KEY_TUPLE {
            &self.keyed
        } else {
            &self.shared
        }
    }

    /// Retire every state (per-source, shared and keyed) of the rules `stale` says. Returns
    /// how many per-source states went.
    pub fn retire_rules(&mut self, stale: &[u8]) -> anyhow::Result<u64> {
        for map in [&mut self.shared, &mut self.keyed] {
            let keys: Vec<ClientKey> = map
                .keys()
                .filter_map(|k| k.ok())
                .filter(|k| stale.contains(&k.rule))
                .collect();
            for k in &keys {
                let _ = map.remove(k);
            }
        }
        let mut ready = Vec::new();
        self.walk_slots(&mut |i, tag, s| {
            if stale.contains(&slot_key(tag, s.addr).rule) {
                ready.push((i, tag));
            }
        })?;
        let mut gone = 0;
        for (i, tag) in ready {
            // Only if it still holds that client: a CPU may have given the slot to another.
            if self
                .tag(i)
                .compare_exchange(tag, 0, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
            {
                gone += 1;
            }
        }
        Ok(gone)
    }

    /// Call `f` on every state: the shared keys', the keyed ones, then the per-source ones.
    /// Each is a snapshot read whole, while the program may be updating it.
    pub fn walk(&self, f: &mut dyn FnMut(&ClientKey, &ClientState)) -> anyhow::Result<()> {
        for r in self.shared.iter().chain(self.keyed.iter()) {
            let (k, s) = r.map_err(|e| anyhow!("walking the shared states: {e}"))?;
            f(&k, &s.state);
        }
        self.walk_slots(&mut |_, tag, s| f(&slot_key(tag, s.addr), &s.state))
    }

    /// The shared keys (`KEY_ALL`, `KEY_REGION`) of the rules at `indexes`.
    pub fn shared_keys_of(&self, indexes: &[u8]) -> anyhow::Result<Vec<ClientKey>> {
        let mut out = Vec::new();
        for k in self.shared.keys() {
            let k = k.map_err(|e| anyhow!("walking the shared keys: {e}"))?;
            if indexes.contains(&k.rule) {
                out.push(k);
            }
        }
        Ok(out)
    }

    /// Write what the other hosts counted for shared key `key` (the program reads it whole).
    pub fn set_fleet_add(&self, key: &ClientKey, add: &FleetAdd) -> anyhow::Result<()> {
        let mut m = self.fleet_add.lock().unwrap_or_else(|e| e.into_inner());
        m.insert(key, add, 0)
            .map_err(|e| anyhow!("writing RL_FLEET_ADD: {e}"))
    }

    /// Remove what was written for the shared keys `keep` refuses (their rule is no longer
    /// a global one, or the key went). Returns how many went.
    pub fn retain_fleet_add(&self, keep: &dyn Fn(&ClientKey) -> bool) -> usize {
        let mut m = self.fleet_add.lock().unwrap_or_else(|e| e.into_inner());
        let gone: Vec<ClientKey> = m
            .keys()
            .filter_map(|k| k.ok())
            .filter(|k| !keep(k))
            .collect();
        gone.iter().filter(|k| m.remove(k).is_ok()).count()
    }

    /// Every key with a state now.
    pub fn keys(&self) -> anyhow::Result<Vec<ClientKey>> {
        let mut keys = Vec::new();
        self.walk(&mut |k, _| keys.push(*k))?;
        Ok(keys)
    }

    /// Call `f` on every ready slot: its index, tag and contents.
    pub fn walk_slots(
        &self,
        f: &mut dyn FnMut(SlotIndex, u32, &ratelimit_common::maps::Slot),
    ) -> anyhow::Result<()> {
        batch_walk::<u32, StoreSet>(&self.sets_map, 1024, &mut |set, s| {
            for (w, (&tag, slot)) in s.tags.iter().zip(&s.slots).enumerate() {
                if slot_ready(tag) {
                    f(*set as u64 * STORE_WAYS as u64 + w as u64, tag, slot)
                }
            }
        })
        .map_err(|e| anyhow!("reading the per-source store: {e}"))
    }
}

/// `union bpf_attr`'s `batch` member.
#[repr(C)]
struct BatchAttr {
    in_batch: u64,
    out_batch: u64,
    keys: u64,
    values: u64,
    count: u32,
    map_fd: u32,
    elem_flags: u64,
    flags: u64,
}

/// Call `f` on every entry of a map with BPF_MAP_LOOKUP_BATCH, `chunk` entries a call.
/// `K` and `V` must be the map's key and value layouts (plain data).
pub fn batch_walk<K: Copy + Default, V: Copy + Default>(
    map: &MapData,
    chunk: usize,
    f: &mut dyn FnMut(&K, &V),
) -> std::io::Result<()> {
    const BPF_MAP_LOOKUP_BATCH: libc::c_long = 24;
    let fd = map.fd().as_fd().as_raw_fd();
    let mut keys = vec![K::default(); chunk];
    let mut vals = vec![V::default(); chunk];
    // The batch token is the key's size for hash maps' buckets and arrays' indices alike:
    // 8 bytes hold either.
    let mut token: u64 = 0;
    let mut next: u64 = 0;
    let mut first = true;
    loop {
        let mut attr = BatchAttr {
            in_batch: if first { 0 } else { &raw const token as u64 },
            out_batch: &raw mut next as u64,
            keys: keys.as_mut_ptr() as u64,
            values: vals.as_mut_ptr() as u64,
            count: chunk as u32,
            map_fd: fd as u32,
            elem_flags: 0,
            flags: 0,
        };
        // SAFETY: the attr points at buffers of `chunk` keys and values of the map's key and
        // value sizes, and at two 8-byte batch tokens, all alive for the call.
        let r = unsafe {
            libc::syscall(
                libc::SYS_bpf,
                BPF_MAP_LOOKUP_BATCH,
                &raw mut attr,
                size_of::<BatchAttr>() as u32,
            )
        };
        let err = (r < 0).then(std::io::Error::last_os_error);
        let n = (attr.count as usize).min(chunk);
        for i in 0..n {
            f(&keys[i], &vals[i]);
        }
        match err {
            None => {}
            Some(e) if e.raw_os_error() == Some(libc::ENOENT) => return Ok(()),
            Some(e) => return Err(e),
        }
        token = next;
        first = false;
    }
}
