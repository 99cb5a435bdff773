//! Typed handles on the program's maps, taken from the loaded object or opened from their
//! pins, and the daemon's writes to the ban tables.

use anyhow::{Context as _, anyhow, bail};
use aya::maps::{Array, HashMap, LpmTrie, MapData, PerCpuArray, RingBuf, lpm_trie::Key};
use ratelimit_common::{
    addr::{IpKey, LpmAddr, lpm_prefix},
    maps::{
        BAN_REMOTE, BAN_SPILLED, BAN_TABLE_REMOTE, BAN_TABLE_RULE, BAN_TABLES, BanEntry,
        ClientState, FastEntry, GlobalConfig, HashKey, ListValue, OverrideKey, OverrideValue,
        RegionOverrideKey, RuleConfig, ban_table,
    },
    stats::Counter,
};

use super::Datapath;

/// Typed handles on every map.
pub struct Maps {
    pub global: Array<MapData, GlobalConfig>,
    pub rules: Array<MapData, RuleConfig>,
    pub sources: LpmTrie<MapData, LpmAddr, ListValue>,
    /// The rules' destination lists: per prefix, the rules whose `dst` covers it.
    pub dests: LpmTrie<MapData, LpmAddr, u32>,
    pub overrides: LpmTrie<MapData, OverrideKey, OverrideValue>,
    pub region_overrides: HashMap<MapData, RegionOverrideKey, OverrideValue>,
    pub regions: LpmTrie<MapData, LpmAddr, [u8; 4]>,
    pub clients: crate::kernel::clients::ClientStore,
    /// Per rule: the aggregate state of sources that got none of their own.
    pub overflow: Array<MapData, ClientState>,
    /// Per CPU: this tick's fast-drop entries, with per-client counts not yet in `clients`.
    pub fast: PerCpuArray<MapData, FastEntry>,
    /// Per CPU and rule: the tick its overflow state is closed to new sources, with the
    /// overflow state's pending totals.
    pub ovf_tick: PerCpuArray<MapData, FastEntry>,
    /// The ban tables, indexed by `BAN_TABLE_*` (operator, rule bans that drop, rule bans that
    /// pass, the fleet's): read and written only through the `Maps` ban methods below.
    pub bans: [LpmTrie<MapData, LpmAddr, BanEntry>; BAN_TABLES as usize],
    pub stats: PerCpuArray<MapData, Counter>,
    pub ifaces: HashMap<MapData, u32, u32>,
    pub ifslots: Array<MapData, u32>,
    /// Per ban table: whether it may hold an entry (see `Maps::insert_ban`).
    pub bans_present: Array<MapData, u64>,
    /// Bumped after every ban insert (see the program's `RL_BAN_EPOCH`).
    pub ban_epoch: Array<MapData, u64>,
    /// A ban was inserted and `ban_epoch` not bumped yet.
    ban_epoch_pending: bool,
    /// Per ban table: what this process last wrote to `bans_present` (only the daemon ever
    /// clears it).
    bans_flag_set: [bool; BAN_TABLES as usize],
    /// Remote bans that found the remote table full and went into the rules' table of bans
    /// that drop (`BAN_SPILLED`), since this process started.
    pub remote_bans_spilled: u64,
    /// The host's addresses, for the program's SYN answers (`RL_LOCAL_ADDRS`): the loaded
    /// object's (the map is not pinned, so handles opened from the pins have none).
    pub local_addrs: Option<crate::kernel::local_addrs::LocalAddrs>,
    pub events: Option<RingBuf<MapData>>,
}

impl Datapath {
    /// The known-sources filter's map, mmapped (once).
    pub fn take_known(&mut self) -> anyhow::Result<crate::kernel::known::KnownFilter> {
        match self.ebpf.take_map("RL_KNOWN") {
            Some(aya::maps::Map::Array(data)) => {
                crate::kernel::known::KnownFilter::new(data, self.hash_key)
            }
            Some(_) => bail!("map RL_KNOWN is not an array"),
            None => bail!("map RL_KNOWN missing"),
        }
    }

    /// A second handle on the per-client state, from its pins (for a thread of its own).
    pub fn open_clients(&self) -> anyhow::Result<crate::kernel::clients::ClientStore> {
        crate::kernel::clients::ClientStore::open(&self.pin_dir)
    }

    /// Handles of their own on the maps, from their pins, for the reports (read only: the
    /// presence flags of the ban tables are left as the owner's handles set them, and there
    /// is no ring buffer).
    pub fn open_maps(&self) -> anyhow::Result<Maps> {
        typed_maps(self.hash_key, |name| {
            let path = self.pin_dir.join(name);
            let data =
                MapData::from_pin(&path).with_context(|| format!("opening {}", path.display()))?;
            Ok(aya::maps::Map::from_map_data(data)?)
        })
    }

    /// Take typed handles on every map (once).
    pub fn take_maps(&mut self) -> anyhow::Result<Maps> {
        let e = &mut self.ebpf;
        let mut take = |name: &str| {
            e.take_map(name)
                .ok_or_else(|| anyhow!("map {name} missing"))
        };
        let mut maps = typed_maps(self.hash_key, &mut take)?;
        // Conservative at every start: the sweep clears it once the map is empty.
        for t in 0..BAN_TABLES {
            maps.bans_present.set(t, 1, 0)?;
        }
        maps.events = Some(RingBuf::try_from(take("RL_EVENTS")?)?);
        Ok(maps)
    }
}

/// Typed handles on every map but the ring buffer, each from `take`.
fn typed_maps(
    hash_key: HashKey,
    mut take: impl FnMut(&str) -> anyhow::Result<aya::maps::Map>,
) -> anyhow::Result<Maps> {
    Ok(Maps {
        global: Array::try_from(take("RL_GLOBAL")?)?,
        rules: Array::try_from(take("RL_RULES")?)?,
        sources: LpmTrie::try_from(take("RL_SOURCES")?)?,
        dests: LpmTrie::try_from(take("RL_DESTS")?)?,
        overrides: LpmTrie::try_from(take("RL_OVERRIDES")?)?,
        region_overrides: HashMap::try_from(take("RL_REGION_OVERRIDES")?)?,
        regions: LpmTrie::try_from(take("RL_REGIONS")?)?,
        clients: crate::kernel::clients::ClientStore::new(
            take("RL_SHARED")?,
            take("RL_KEYED")?,
            take("RL_FLEET_ADD")?,
            take("RL_CLIENTS")?,
            hash_key,
        )?,
        overflow: Array::try_from(take("RL_OVERFLOW")?)?,
        fast: PerCpuArray::try_from(take("RL_FAST")?)?,
        ovf_tick: PerCpuArray::try_from(take("RL_OVF_TICK")?)?,
        bans: [
            LpmTrie::try_from(take("RL_BANS_OPERATOR")?)?,
            LpmTrie::try_from(take("RL_BANS")?)?,
            LpmTrie::try_from(take("RL_BANS_PASSING")?)?,
            LpmTrie::try_from(take("RL_BANS_REMOTE")?)?,
        ],
        stats: PerCpuArray::try_from(take("RL_STATS")?)?,
        ifaces: HashMap::try_from(take("RL_IFACES")?)?,
        ifslots: Array::try_from(take("RL_IFSLOTS")?)?,
        bans_present: Array::try_from(take("RL_BANS_PRESENT")?)?,
        bans_flag_set: [true; BAN_TABLES as usize],
        remote_bans_spilled: 0,
        local_addrs: match take("RL_LOCAL_ADDRS") {
            Ok(m) => Some(crate::kernel::local_addrs::LocalAddrs::new(
                HashMap::try_from(m)?,
            )),
            Err(_) => None,
        },
        ban_epoch: Array::try_from(take("RL_BAN_EPOCH")?)?,
        ban_epoch_pending: false,
        events: None,
    })
}

/// The trie key of a ban of `addr/prefix_len` (a prefix over the 16-byte address).
pub fn ban_key(prefix_len: u32, addr: &IpKey) -> Key<LpmAddr> {
    Key::new(lpm_prefix(addr.is_v4(), prefix_len), LpmAddr::of(addr))
}

impl Maps {
    /// Insert (or replace) a ban in the table its flags name, then note that bans exist (in
    /// that order: the program skips the ban lookup while the flag is clear).
    pub fn insert_ban(&mut self, entry: BanEntry) -> Result<(), aya::maps::MapError> {
        self.insert_ban_deferred(entry)?;
        self.flush_ban_epoch()
    }

    /// [`Maps::insert_ban`] without the ban-epoch bump, for a batch: the caller must call
    /// [`Maps::flush_ban_epoch`] after the batch, whatever its outcome (two system calls per
    /// ban otherwise, a third of the time of 100k bans).
    pub fn insert_ban_deferred(&mut self, entry: BanEntry) -> Result<(), aya::maps::MapError> {
        self.replace_ban_deferred(entry).map(drop)
    }

    /// [`Maps::insert_ban_deferred`] that also returns the ban it replaced, for a caller that
    /// may have to put it back. The daemon's one write of a ban into a ban table (the one its
    /// flags name). A new key costs one system call (an insert that must not replace); only
    /// an existing one is read first. A remote ban that finds the remote table full goes into
    /// the rules' table of bans that drop, marked `BAN_SPILLED` (counted in
    /// [`Maps::remote_bans_spilled`]); if that one is full too, the error is the caller's.
    pub fn replace_ban_deferred(
        &mut self,
        entry: BanEntry,
    ) -> Result<Option<BanEntry>, aya::maps::MapError> {
        match self.replace_ban_in_table(entry) {
            Err(aya::maps::MapError::SyscallError(e))
                if e.io_error.raw_os_error() == Some(libc::ENOSPC)
                    && ban_table(entry.flags) == BAN_TABLE_REMOTE =>
            {
                let spilled = BanEntry {
                    flags: entry.flags | BAN_SPILLED,
                    ..entry
                };
                let replaced = self.replace_ban_in_table(spilled)?;
                self.remote_bans_spilled += 1;
                Ok(replaced)
            }
            r => r,
        }
    }

    /// [`Maps::replace_ban_deferred`] into the table `entry`'s flags name, or the error.
    fn replace_ban_in_table(
        &mut self,
        entry: BanEntry,
    ) -> Result<Option<BanEntry>, aya::maps::MapError> {
        /// `BPF_NOEXIST` (uapi/linux/bpf.h): fail with EEXIST rather than replace.
        const BPF_NOEXIST: u64 = 1;
        let t = ban_table(entry.flags) as usize;
        let key = ban_key(entry.prefix_len, &IpKey { addr: entry.addr });
        let replaced = match retry_enomem(|| self.bans[t].insert(&key, entry, BPF_NOEXIST)) {
            Ok(()) => None,
            Err(aya::maps::MapError::SyscallError(e))
                if e.io_error.raw_os_error() == Some(libc::EEXIST) =>
            {
                let old = self.bans[t].get(&key, 0).ok();
                retry_enomem(|| self.bans[t].insert(&key, entry, 0))?;
                old
            }
            Err(e) => return Err(e),
        };
        self.ban_epoch_pending = true;
        if !self.bans_flag_set[t] {
            self.bans_present.set(t as u32, 1, 0)?;
            self.bans_flag_set[t] = true;
        }
        Ok(replaced)
    }

    /// The ban in table `table` at exactly `addr/prefix_len`, if any.
    pub fn ban_at(&self, table: u32, prefix_len: u32, addr: &IpKey) -> Option<BanEntry> {
        self.bans[table as usize]
            .get(&ban_key(prefix_len, addr), 0)
            .ok()
    }

    /// Write this host's addresses into the program's `RL_LOCAL_ADDRS` (see
    /// [`crate::kernel::local_addrs`]); nothing on handles opened from the pins, which have none.
    pub fn refresh_local_addrs(&mut self) {
        if let Some(l) = &mut self.local_addrs {
            l.refresh();
        }
    }

    /// The remote ban at exactly `addr/prefix_len`, in the remote table or spilled into the
    /// rules' table (`BAN_SPILLED`), if any.
    pub fn remote_ban_at(&self, prefix_len: u32, addr: &IpKey) -> Option<BanEntry> {
        self.ban_at(BAN_TABLE_REMOTE, prefix_len, addr).or_else(|| {
            self.ban_at(BAN_TABLE_RULE, prefix_len, addr)
                .filter(|b| b.flags & BAN_REMOTE != 0)
        })
    }

    /// The bans at exactly `addr/prefix_len`, whatever their table.
    pub fn bans_at(&self, prefix_len: u32, addr: &IpKey) -> Vec<BanEntry> {
        (0..BAN_TABLES)
            .filter_map(|t| self.ban_at(t, prefix_len, addr))
            .collect()
    }

    /// Remove the ban in table `table` at exactly `addr/prefix_len`: whether there was one.
    /// With [`Maps::replace_ban_deferred`], the daemon's only writes to the ban tables.
    pub fn remove_ban(
        &mut self,
        table: u32,
        prefix_len: u32,
        addr: &IpKey,
    ) -> Result<bool, aya::maps::MapError> {
        match self.bans[table as usize].remove(&ban_key(prefix_len, addr)) {
            Ok(()) => Ok(true),
            Err(aya::maps::MapError::KeyNotFound) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Every ban in every table (the entry repeats its own key).
    pub fn all_bans(&self) -> Vec<BanEntry> {
        self.bans
            .iter()
            .flat_map(|t| t.iter().filter_map(|r| r.ok()).map(|(_, b)| b))
            .collect()
    }

    /// Void the program's fast-drop entries (they skip the ban lookup) if a ban was inserted
    /// since the last call: bump `RL_BAN_EPOCH`.
    pub fn flush_ban_epoch(&mut self) -> Result<(), aya::maps::MapError> {
        if self.ban_epoch_pending {
            let epoch = self.ban_epoch.get(&0, 0)?;
            self.ban_epoch.set(0, epoch.wrapping_add(1), 0)?;
            self.ban_epoch_pending = false;
        }
        Ok(())
    }

    /// Per table: clear its flag if it is empty; set it again if a ban arrived meanwhile (the
    /// program sets it after its own inserts, so no ban is ever left unlooked-up).
    pub fn refresh_bans_present(&mut self) {
        for t in 0..BAN_TABLES as usize {
            if self.bans[t].keys().next().is_some() {
                self.bans_flag_set[t] = self.bans_present.set(t as u32, 1, 0).is_ok();
                continue;
            }
            if self.bans_present.set(t as u32, 0, 0).is_err() {
                continue;
            }
            self.bans_flag_set[t] = false;
            if self.bans[t].keys().next().is_some() {
                self.bans_flag_set[t] = self.bans_present.set(t as u32, 1, 0).is_ok();
            }
        }
    }
}

/// Retries of an update that failed with ENOMEM ([`retry_enomem`]).
const ENOMEM_RETRIES: u32 = 10;

/// `update` (an insert into a map whose elements the kernel takes from its BPF memory
/// allocator: the LPM tries, hash maps without preallocation), retried while it fails with
/// ENOMEM. That allocator hands out elements from a per-CPU cache that it refills
/// asynchronously (irq_work), so a burst of updates from one thread can find the cache empty
/// and fail with ENOMEM while memory is plentiful: seen on 6.18 filling a ban table of 262,144
/// entries on a loaded machine (`ban add --file` failed at entry 47,887). Each retry first
/// sleeps (100 us, doubling up to 12.8 ms; at most ~50 ms in all), which lets the refill
/// run; a map that is really out of memory still fails, after the last retry.
pub fn retry_enomem<T>(
    mut update: impl FnMut() -> Result<T, aya::maps::MapError>,
) -> Result<T, aya::maps::MapError> {
    let mut tries = 0;
    loop {
        match update() {
            Err(aya::maps::MapError::SyscallError(e))
                if e.io_error.raw_os_error() == Some(libc::ENOMEM) && tries < ENOMEM_RETRIES =>
            {
                std::thread::sleep(std::time::Duration::from_micros(100 << tries.min(7)));
                tries += 1;
            }
            r => return r,
        }
    }
}
