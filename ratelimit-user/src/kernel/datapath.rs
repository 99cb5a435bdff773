//! Loading, attaching, pinning and adopting the XDP program and its maps.
//!
//! Everything lives under one bpffs directory (`daemon.bpffs_dir`): every map pinned by name,
//! and one pinned bpf_link per interface (`link-<ifname>`). Pinned links keep the program
//! attached when the daemon exits or is killed, so enforcement never depends on the daemon
//! being up. A restarted daemon loads the program against the pinned maps (same counters,
//! same bans) and swaps it into the existing links with `bpf_link_update`, atomically: there
//! is no instant without a program on the interface.
//!
//! The object has two entry points: `ratelimit` parses from an Ethernet header, `ratelimit_l3`
//! from the IP header, for devices that have no link-layer header (tun, wireguard, ipip, sit,
//! gre, ppp). Each interface gets the one its link type calls for ([`Entry::for_iface`]).

use std::{
    ffi::CString,
    fs,
    path::{Path, PathBuf},
};

use anyhow::{Context as _, anyhow, bail};
use aya::{
    Ebpf, EbpfLoader,
    maps::{Array, HashMap, LpmTrie, MapData, PerCpuArray, RingBuf, lpm_trie::Key},
    programs::{
        Xdp, XdpMode,
        links::{FdLink, PinnedLink},
        xdp::XdpLink,
    },
};
use ratelimit_common::{
    addr::{IpKey, LpmAddr, lpm_prefix},
    caps::{IFSLOT_ARRAY_LEN, RETIRED_SLOT, UNLISTED_SLOT},
    maps::{
        BAN_REMOTE, BAN_SPILLED, BAN_TABLE_REMOTE, BAN_TABLE_RULE, BAN_TABLES, BanEntry, ClientKey,
        ClientState, FastEntry, GlobalConfig, HASH_KEY_WORDS, HashKey, ListValue, OverrideKey,
        OverrideValue, RegionOverrideKey, RuleConfig, ban_table,
    },
    stats::Counter,
};
use tracing::{debug, info, warn};

use crate::config;

/// The compiled XDP program, built by build.rs.
static PROGRAM: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/ratelimit"));

const PROGRAM_NAME: &str = "ratelimit";
const PROGRAM_NAME_L3: &str = "ratelimit_l3";
const BPF_FS_MAGIC: i64 = 0xcafe4a11;

/// Typed handles on every map.
pub struct Maps {
    pub global: Array<MapData, GlobalConfig>,
    pub rules: Array<MapData, RuleConfig>,
    pub sources: LpmTrie<MapData, LpmAddr, ListValue>,
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

pub struct Datapath {
    ebpf: Ebpf,
    pin_dir: PathBuf,
    /// Interfaces this daemon attached or adopted, with the mode in use.
    pub attached: Vec<Attached>,
    /// True when pinned state from an earlier daemon was found and adopted.
    pub adopted: bool,
    /// The placement hash's key (`RL_HASH_KEY`): drawn when the maps were created, read
    /// back when they were adopted.
    pub hash_key: HashKey,
}

#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Attached {
    pub iface: String,
    pub ifindex: u32,
    pub mode: String,
    pub slot: u32,
    /// Which entry point parses its frames.
    pub entry: Entry,
}

/// The program's entry point for an interface: what its frames start with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Entry {
    /// An Ethernet header (and VLAN tags), then IP.
    Ethernet,
    /// The IP header itself: devices without a link layer.
    L3,
}

/// `ARPHRD_*` link types (linux/if_arp.h) whose frames start with an Ethernet header.
const ETHERNET_LINK_TYPES: &[(u16, &str)] = &[(1, "ether"), (772, "loopback")];

/// Link types whose frames reach XDP starting at the IP header: the device has no link-layer
/// header (the kernel points the XDP data at the network header).
const L3_LINK_TYPES: &[(u16, &str)] = &[
    (512, "ppp"),
    (519, "rawip"),
    (768, "tunnel (ipip)"),
    (769, "tunnel6 (ip6tnl)"),
    (776, "sit"),
    (778, "ipgre"),
    (823, "ip6gre"),
    (65534, "none (tun, wireguard)"),
];

impl Entry {
    /// The entry for `iface`, from its link type; an error naming the interface and its type
    /// when the program cannot parse its frames at all (attaching would pass every packet
    /// unjudged as non-IP).
    pub fn for_iface(iface: &str) -> anyhow::Result<Entry> {
        Self::for_link(iface, link_type(iface)?)
    }

    /// [`Entry::for_iface`] for an interface of link type `t`.
    pub fn for_link(iface: &str, t: u16) -> anyhow::Result<Entry> {
        Self::for_link_type(t).ok_or_else(|| {
            anyhow!(
                "{iface} has link type {t} (ARPHRD_*, linux/if_arp.h), whose frames the XDP \
                 program cannot parse: it reads Ethernet ({}) and bare IP ({}); remove {iface} \
                 from daemon.interfaces / --iface",
                names(ETHERNET_LINK_TYPES),
                names(L3_LINK_TYPES)
            )
        })
    }

    pub fn for_link_type(t: u16) -> Option<Entry> {
        if ETHERNET_LINK_TYPES.iter().any(|&(n, _)| n == t) {
            Some(Entry::Ethernet)
        } else if L3_LINK_TYPES.iter().any(|&(n, _)| n == t) {
            Some(Entry::L3)
        } else {
            None
        }
    }

    fn program(self) -> &'static str {
        match self {
            Entry::Ethernet => PROGRAM_NAME,
            Entry::L3 => PROGRAM_NAME_L3,
        }
    }
}

fn names(types: &[(u16, &str)]) -> String {
    types
        .iter()
        .map(|(n, name)| format!("{n} {name}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The link type (`ARPHRD_*`) of `iface` in this process's network namespace, from
/// SIOCGIFHWADDR (not /sys/class/net, which shows the namespace sysfs was mounted in).
pub fn link_type(iface: &str) -> anyhow::Result<u16> {
    use std::os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd};
    // SAFETY: ifreq is plain C data (integers, arrays and a union of them): all zeros is a
    // valid value.
    let mut ifr: libc::ifreq = unsafe { std::mem::zeroed() };
    if iface.len() >= ifr.ifr_name.len() || iface.contains('\0') {
        bail!("{iface:?} is not an interface name (at most 15 bytes)");
    }
    for (d, s) in ifr.ifr_name.iter_mut().zip(iface.bytes()) {
        *d = s as libc::c_char;
    }
    // SAFETY: plain socket(2); the fd is owned at once.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        bail!(
            "a socket to read the link type of {iface}: {}",
            std::io::Error::last_os_error()
        );
    }
    // SAFETY: fd is a fresh descriptor nothing else owns.
    let sock = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: SIOCGIFHWADDR fills the ifreq we pass, which outlives the call.
    if unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFHWADDR, &mut ifr) } != 0 {
        bail!(
            "reading the link type of {iface}: {} (check `ip link`)",
            std::io::Error::last_os_error()
        );
    }
    // SAFETY: SIOCGIFHWADDR sets the hwaddr member of the union.
    Ok(unsafe { ifr.ifr_ifru.ifru_hwaddr.sa_family })
}

/// Make sure `/sys/fs/bpf` (or the parent of `dir`) is a bpffs, mounting one if it is not.
pub(crate) fn ensure_bpffs(dir: &Path) -> anyhow::Result<()> {
    let root = Path::new("/sys/fs/bpf");
    if !dir.starts_with(root) {
        fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        return Ok(());
    }
    if statfs_magic(root) != Some(BPF_FS_MAGIC) {
        fs::create_dir_all(root).ok();
        let src = CString::new("bpf")?;
        let target = CString::new("/sys/fs/bpf")?;
        // SAFETY: plain mount(2) with valid C strings.
        let rc = unsafe {
            libc::mount(
                src.as_ptr(),
                target.as_ptr(),
                src.as_ptr(),
                0,
                std::ptr::null(),
            )
        };
        if rc != 0 {
            bail!(
                "/sys/fs/bpf is not a bpffs and mounting one failed ({}); mount it with `mount -t bpf bpf /sys/fs/bpf`",
                std::io::Error::last_os_error()
            );
        }
        info!("mounted bpffs on /sys/fs/bpf");
    }
    fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    Ok(())
}

fn statfs_magic(path: &Path) -> Option<i64> {
    let c = CString::new(path.as_os_str().as_encoded_bytes()).ok()?;
    // SAFETY: statfs is plain C data: all zeros is a valid value.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: valid path and out-pointer.
    if unsafe { libc::statfs(c.as_ptr(), &mut st) } != 0 {
        return None;
    }
    Some(st.f_type as i64)
}

fn link_pin(pin_dir: &Path, iface: &str) -> PathBuf {
    pin_dir.join(format!("link-{iface}"))
}

pub fn ifindex(iface: &str) -> anyhow::Result<u32> {
    let c = CString::new(iface)?;
    // SAFETY: valid C string.
    let idx = unsafe { libc::if_nametoindex(c.as_ptr()) };
    if idx == 0 {
        bail!("no such interface: {iface} (check `ip link`)");
    }
    Ok(idx)
}

/// The layout of every pinned map's keys and values. `LAYOUT_VERSION` is bumped by hand
/// whenever one changes (a reordered field included), and when where a key is placed changes
/// (the per-source store's hash, `known_hash`) or what a value means (an elastic limit without
/// `elastic` is the limit itself, no longer all zero; global rules' windows on the wall clock;
/// a global token bucket's counts in `cur`/`prev`; a fourth ban table, the fleet's, and
/// `RL_BANS_PRESENT` with a flag for it); the sizes follow as a check.
const LAYOUT_VERSION: u32 = 14;

/// File in `daemon.state_dir` recording the layout of the maps pinned in `daemon.bpffs_dir`.
pub const LAYOUT_FILE: &str = "pinned-layout";

pub fn layout() -> String {
    use std::mem::size_of;
    format!(
        "v{LAYOUT_VERSION} client_key={} client_state={} store_set={} shared={} fleet_add={} fast_entry={} global={} rule={} override={} ban={} ban_tables={} stats={} hash_key={}",
        size_of::<ClientKey>(),
        size_of::<ClientState>(),
        size_of::<ratelimit_common::maps::StoreSet>(),
        size_of::<ratelimit_common::maps::SharedState>(),
        size_of::<ratelimit_common::maps::FleetAdd>(),
        size_of::<FastEntry>(),
        size_of::<GlobalConfig>(),
        size_of::<RuleConfig>(),
        size_of::<ratelimit_common::maps::OverrideValue>(),
        size_of::<BanEntry>(),
        BAN_TABLES,
        ratelimit_common::stats::STATS_LEN,
        size_of::<HashKey>(),
    )
}

/// Refuse to adopt maps pinned in `pin_dir` by a build with another layout (their values
/// would be misread): `state_dir` must record this build's layout for them.
pub fn check_pinned_layout(pin_dir: &Path, state_dir: &Path) -> anyhow::Result<()> {
    if !pin_dir.join("RL_STATS").exists() {
        return Ok(());
    }
    let file = state_dir.join(LAYOUT_FILE);
    let found = fs::read_to_string(&file).unwrap_or_default();
    if found.trim() == layout() {
        return Ok(());
    }
    bail!(
        "the maps pinned in {} were made by a build with another map layout ({}), which this \
         build would misread: run `ratelimit detach` (bans are restored from {}) and start again",
        pin_dir.display(),
        if found.trim().is_empty() {
            format!("{} records none", file.display())
        } else {
            format!(
                "{} says {:?}, this build {:?}",
                file.display(),
                found.trim(),
                layout()
            )
        },
        state_dir.display()
    )
}

/// Record this build's layout for the maps pinned in `pin_dir` (see [`check_pinned_layout`]),
/// atomically: a torn record would make the next start refuse maps it could have adopted.
pub fn record_pinned_layout(state_dir: &Path) -> anyhow::Result<()> {
    crate::durable::write_atomically(state_dir, LAYOUT_FILE, (layout() + "\n").as_bytes())
}

impl Datapath {
    /// Load the program against the pinned maps in `pin_dir` (created if absent).
    pub fn load(pin_dir: &Path, max_sources: u32) -> anyhow::Result<Self> {
        Self::load_with(pin_dir, max_sources, |loader| loader.load(PROGRAM))
    }

    /// [`Datapath::load`], with the object loaded by `load` from the loader it is handed (map
    /// pins in `pin_dir`, the per-source maps sized for `max_sources`): for an object that
    /// links the program beside programs and maps of its own, which `load` may size (the
    /// benchmark's).
    pub fn load_with(
        pin_dir: &Path,
        max_sources: u32,
        load: impl FnOnce(&mut EbpfLoader<'_>) -> Result<Ebpf, aya::EbpfError>,
    ) -> anyhow::Result<Self> {
        if let Err(e) = raise_memlock() {
            debug!(
                "raising RLIMIT_MEMLOCK failed ({e}); not needed on kernels with memcg accounting"
            );
        }
        ensure_bpffs(pin_dir)?;
        let adopted = pin_dir.join("RL_STATS").exists();
        let mut loader = EbpfLoader::new();
        loader
            .default_map_pin_directory(pin_dir)
            .map_max_entries(
                "RL_CLIENTS",
                ratelimit_common::maps::store_sets(max_sources),
            )
            .map_max_entries(
                "RL_KNOWN",
                ratelimit_common::maps::known_map_entries(max_sources),
            );
        let ebpf = load(&mut loader).context("loading the XDP program and its maps")?;
        let mut dp = Self {
            ebpf,
            pin_dir: pin_dir.to_owned(),
            attached: Vec::new(),
            adopted,
            hash_key: [0; HASH_KEY_WORDS],
        };
        dp.hash_key = dp.ensure_hash_key()?;
        let prog: &mut Xdp = dp
            .ebpf
            .program_mut(PROGRAM_NAME)
            .ok_or_else(|| anyhow!("program {PROGRAM_NAME} missing from the object"))?
            .try_into()?;
        prog.load()
            .map_err(|e| anyhow!("the kernel verifier rejected the XDP program: {e:#}"))?;
        if adopted {
            info!(dir = %pin_dir.display(), "adopted pinned maps: counters and bans carried over");
        }
        Ok(dp)
    }

    /// The placement hash's key: the pinned one, or (maps just created, or pinned by a
    /// daemon that stopped before it drew one, and which therefore hold no state) a new one
    /// from the OS's random source, written before any policy gives the store its sets.
    fn ensure_hash_key(&mut self) -> anyhow::Result<HashKey> {
        let map = self
            .ebpf
            .map_mut("RL_HASH_KEY")
            .ok_or_else(|| anyhow!("map RL_HASH_KEY missing from the object"))?;
        let mut a: Array<&mut MapData, HashKey> = Array::try_from(map)?;
        let key = a.get(&0, 0).context("reading RL_HASH_KEY")?;
        if key != [0; HASH_KEY_WORDS] {
            return Ok(key);
        }
        let key = random_hash_key()?;
        a.set(0, key, 0).context("writing RL_HASH_KEY")?;
        Ok(key)
    }

    /// The loaded object: maps no typed handle covers (the log ring, say), and any other
    /// program in it.
    pub fn ebpf_mut(&mut self) -> &mut Ebpf {
        &mut self.ebpf
    }

    /// Verifier statistics of the loaded program: (xlated instruction count, verified insns).
    pub fn program_info(&self) -> Option<(u32, u32)> {
        let prog: &Xdp = self.ebpf.program(PROGRAM_NAME)?.try_into().ok()?;
        let info = prog.info().ok()?;
        Some((
            info.size_translated().unwrap_or(0) / 8,
            info.verified_instruction_count().unwrap_or(0),
        ))
    }

    /// Run the program on one frame with BPF_PROG_TEST_RUN, `repeat` times: (XDP action of the
    /// last run, mean time per run). Maps are the real ones, so counters and state change.
    pub fn test_run(
        &self,
        frame: &[u8],
        repeat: u32,
    ) -> anyhow::Result<(u32, std::time::Duration)> {
        use aya::programs::{TestRun as _, TestRunOptions};
        let prog: &Xdp = self
            .ebpf
            .program(PROGRAM_NAME)
            .expect("loaded")
            .try_into()?;
        let mut opts = TestRunOptions::new();
        opts.data_in = Some(frame);
        opts.repeat = repeat.max(1);
        let r = prog.test_run(opts).context("BPF_PROG_TEST_RUN")?;
        Ok((r.return_value, r.duration))
    }

    /// [`Datapath::test_run`] once, with the frame as the program left it (a reply it sends
    /// back out with `XDP_TX`, say).
    pub fn test_run_out(&self, frame: &[u8]) -> anyhow::Result<(u32, Vec<u8>)> {
        use aya::programs::{TestRun as _, TestRunOptions};
        let prog: &Xdp = self
            .ebpf
            .program(PROGRAM_NAME)
            .expect("loaded")
            .try_into()?;
        let mut out = vec![0u8; frame.len().max(256)];
        let mut opts = TestRunOptions::new();
        opts.data_in = Some(frame);
        opts.data_out = Some(&mut out);
        let r = prog.test_run(opts).context("BPF_PROG_TEST_RUN")?;
        out.truncate(r.data_size_out as usize);
        Ok((r.return_value, out))
    }

    /// BPF_PROG_TEST_RUN of any program in the object, by name (loading it on first use):
    /// `ratelimit_l3`, say, which [`Datapath::test_run`] does not run.
    pub fn test_run_program(
        &mut self,
        name: &str,
        frame: &[u8],
        repeat: u32,
    ) -> anyhow::Result<(u32, std::time::Duration)> {
        use aya::programs::{TestRun as _, TestRunOptions};
        let prog: &mut Xdp = self
            .ebpf
            .program_mut(name)
            .ok_or_else(|| anyhow!("no program {name} in the object"))?
            .try_into()?;
        if prog.fd().is_err() {
            prog.load().with_context(|| format!("loading {name}"))?;
        }
        let mut opts = TestRunOptions::new();
        opts.data_in = Some(frame);
        opts.repeat = repeat.max(1);
        let r = prog.test_run(opts).context("BPF_PROG_TEST_RUN")?;
        Ok((r.return_value, r.duration))
    }

    /// Attach to `iface` (or take over its pinned link from an earlier daemon), with the
    /// entry point its link type calls for.
    pub fn attach(
        &mut self,
        iface: &str,
        mode: config::XdpMode,
        maps: &mut Maps,
    ) -> anyhow::Result<Attached> {
        let idx = ifindex(iface)?;
        let entry = Entry::for_iface(iface)?;
        let pin = link_pin(&self.pin_dir, iface);
        if pin.exists() {
            drop_stale_link(&pin, iface, idx)?;
        }
        // The slot before the program: its counts land in the interface's own slot from the
        // first packet on.
        let freed = prune_slots(maps, &self.pin_dir, idx)?;
        self.attached.retain(|a| !freed.contains(&a.ifindex));
        let slot = assign_slot(&mut maps.ifaces, &mut maps.ifslots, idx)?;
        let prog: &mut Xdp = self
            .ebpf
            .program_mut(entry.program())
            .ok_or_else(|| anyhow!("program {} missing from the object", entry.program()))?
            .try_into()?;
        if prog.fd().is_err() {
            prog.load().map_err(|e| {
                anyhow!(
                    "the kernel verifier rejected the XDP program {}: {e:#}",
                    entry.program()
                )
            })?;
        }
        let (link_id, mode_used) = if pin.exists() {
            let pinned =
                PinnedLink::from_pin(&pin).with_context(|| format!("opening {}", pin.display()))?;
            let fd_link = FdLink::from(pinned);
            let xdp_link = XdpLink::try_from(fd_link).context("adopting the pinned XDP link")?;
            let id = prog
                .attach_to_link(xdp_link)
                .with_context(|| format!("replacing the program in the pinned link on {iface}"))?;
            (id, "adopted".to_string())
        } else {
            match mode {
                config::XdpMode::Native => (
                    prog.attach(iface, XdpMode::Driver)
                        .with_context(|| format!("attaching in native (driver) mode on {iface}; try xdp_mode = \"generic\""))?,
                    "native".to_string(),
                ),
                config::XdpMode::Generic => (
                    prog.attach(iface, XdpMode::Skb).with_context(|| format!("attaching in generic mode on {iface}"))?,
                    "generic".to_string(),
                ),
                config::XdpMode::Auto => match prog.attach(iface, XdpMode::Driver) {
                    Ok(id) => (id, "native".to_string()),
                    Err(e) => {
                        warn!(
                            iface,
                            "native XDP attach failed on {iface} ({e}); retrying in generic mode, which runs after the kernel allocates an skb and costs more per packet"
                        );
                        (
                            prog.attach(iface, XdpMode::Skb)
                                .with_context(|| format!("attaching in generic mode on {iface}"))?,
                            "generic".to_string(),
                        )
                    }
                },
            }
        };
        let link = prog.take_link(link_id)?;
        let fd_link: FdLink = link
            .try_into()
            .context("XDP attach did not produce a bpf_link")?;
        if pin.exists() {
            fs::remove_file(&pin).with_context(|| format!("replacing {}", pin.display()))?;
        }
        let pinned = fd_link
            .pin(&pin)
            .with_context(|| format!("pinning {}", pin.display()))?;
        drop(pinned); // the pin keeps the link (and the program) attached
        let a = Attached {
            iface: iface.to_string(),
            ifindex: idx,
            mode: mode_used,
            slot,
            entry,
        };
        info!(iface, mode = %a.mode, slot, entry = ?entry, "XDP program attached");
        self.attached.retain(|o| o.iface != iface);
        self.attached.push(a.clone());
        Ok(a)
    }

    /// (slot, interface) of the attached interfaces with counters of their own: one beyond
    /// the slots counts in [`UNLISTED_SLOT`], which is no interface's series.
    pub fn counter_slots(&self) -> Vec<(u32, String)> {
        self.attached
            .iter()
            .filter(|a| a.slot != UNLISTED_SLOT)
            .map(|a| (a.slot, a.iface.clone()))
            .collect()
    }

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

    /// Detach the program from `iface` (its pinned link removed), leaving the maps and the
    /// other interfaces as they are: to undo an attach.
    pub fn detach_iface(&mut self, iface: &str) -> anyhow::Result<()> {
        detach(&self.pin_dir, &[iface.to_string()])?;
        self.attached.retain(|a| a.iface != iface);
        Ok(())
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
        overrides: LpmTrie::try_from(take("RL_OVERRIDES")?)?,
        region_overrides: HashMap::try_from(take("RL_REGION_OVERRIDES")?)?,
        regions: LpmTrie::try_from(take("RL_REGIONS")?)?,
        clients: crate::kernel::clients::ClientStore::new(
            take("RL_SHARED")?,
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

/// Counter slot for `ifindex`: the one already assigned, else the lowest free one. With every
/// slot taken the interface is not listed, and counts in [`UNLISTED_SLOT`] with the other
/// unlisted interfaces (counted, and said in a warning, rather than refusing to protect it).
fn assign_slot(
    ifaces: &mut HashMap<MapData, u32, u32>,
    ifslots: &mut Array<MapData, u32>,
    ifindex: u32,
) -> anyhow::Result<u32> {
    match ifaces.get(&ifindex, 0) {
        // Pinned by a daemon that gave interfaces the last slot too: its counts stay there
        // as retired ones, and the interface gets a slot of its own from here on.
        Ok(RETIRED_SLOT) => {
            ifaces.remove(&ifindex).ok();
        }
        Ok(s) => {
            if ifindex < IFSLOT_ARRAY_LEN {
                ifslots.set(ifindex, s, 0)?;
            }
            return Ok(s);
        }
        Err(_) => {}
    }
    let used: Vec<u32> = ifaces
        .iter()
        .filter_map(|r| r.ok().map(|(_, v)| v))
        .collect();
    let Some(slot) = (UNLISTED_SLOT + 1..RETIRED_SLOT).find(|s| !used.contains(s)) else {
        warn!(
            ifindex,
            "all {} per-interface counter slots are in use by attached interfaces: this one's \
             counts go to the series of unlisted interfaces (interface=\"\") and the totals, \
             not to a series of its own",
            RETIRED_SLOT - UNLISTED_SLOT - 1
        );
        return Ok(UNLISTED_SLOT);
    };
    ifaces
        .insert(ifindex, slot, 0)
        .context("recording the interface's counter slot (RL_IFACES)")?;
    if ifindex < IFSLOT_ARRAY_LEN {
        ifslots.set(ifindex, slot, 0)?;
    }
    Ok(slot)
}

/// Free the counter slots of interfaces no link in `pin_dir` is attached to any more (deleted,
/// or detached), except `keep` (the one being attached). Without this, every interface ever
/// attached kept its slot: the 16th distinct ifindex (an interface re-created 15 times) got
/// the shared slot 0 and the 17th could not be attached at all.
///
/// A freed slot's counters are added to [`RETIRED_SLOT`] and zeroed: the totals (`ratelimit
/// stats`, the reasons' and the rules' counters) stay monotonic, as counters must, and the
/// next interface given the slot starts from zero instead of inheriting another device's
/// counts. The interface's series of `/metrics` ends; no other series takes its counts (which
/// Prometheus would read as that many frames arriving at once). An interface re-created under
/// the same name is a new device: its series restarts from zero, which Prometheus reads as a
/// counter reset.
fn prune_slots(maps: &mut Maps, pin_dir: &Path, keep: u32) -> anyhow::Result<Vec<u32>> {
    let mut live = vec![keep];
    if let Ok(entries) = fs::read_dir(pin_dir) {
        for e in entries.flatten() {
            if !e.file_name().to_string_lossy().starts_with("link-") {
                continue;
            }
            match pinned_link_ifindex(&e.path()) {
                Ok(Some(i)) => live.push(i),
                // Its interface was deleted: the kernel detached it, the pin is all that is left.
                Ok(None) => {
                    if fs::remove_file(e.path()).is_ok() {
                        info!(
                            "removed {}: its interface no longer exists",
                            e.path().display()
                        );
                    }
                }
                Err(_) => {}
            }
        }
    }
    let stale: Vec<(u32, u32)> = maps
        .ifaces
        .iter()
        .filter_map(|r| r.ok())
        .filter(|(i, _)| !live.contains(i))
        .collect();
    for &(ifindex, slot) in &stale {
        maps.ifaces.remove(&ifindex).ok();
        if ifindex < IFSLOT_ARRAY_LEN {
            maps.ifslots.set(ifindex, 0, 0)?;
        }
        if slot != UNLISTED_SLOT && slot < RETIRED_SLOT {
            retire_slot(&mut maps.stats, slot)?;
        }
        info!(
            ifindex,
            slot, "freed the counter slot of an interface that is no longer attached"
        );
    }
    Ok(stale.into_iter().map(|(i, _)| i).collect())
}

/// Add every counter of `slot` to [`RETIRED_SLOT`]'s and zero it, CPU by CPU. (Nothing counts
/// in either any more: the program is no longer attached to the slot's interface, and no
/// frame is ever counted in the retired slot.)
fn retire_slot(stats: &mut PerCpuArray<MapData, Counter>, slot: u32) -> anyhow::Result<()> {
    use ratelimit_common::stats::{PER_IFACE, global_index};
    for k in 0..PER_IFACE {
        let from = global_index(slot, k);
        let to = global_index(RETIRED_SLOT, k);
        let src = stats.get(&from, 0)?;
        if src.iter().all(|c| c.packets == 0 && c.bytes == 0) {
            continue;
        }
        let dst = stats.get(&to, 0)?;
        let sum: Vec<Counter> = dst
            .iter()
            .zip(src.iter())
            .map(|(d, s)| Counter {
                packets: d.packets + s.packets,
                bytes: d.bytes + s.bytes,
            })
            .collect();
        let zero = vec![Counter::default(); sum.len()];
        stats.set(to, aya::maps::PerCpuValues::try_from(sum)?, 0)?;
        stats.set(from, aya::maps::PerCpuValues::try_from(zero)?, 0)?;
    }
    Ok(())
}

/// A link pinned for `iface` whose device is gone (deleted: the kernel detached it), or is now
/// another device than the one under that name (renamed away, another created in its place),
/// cannot be adopted (`bpf_link_update` fails with ENOLINK on a detached link). Unpin it, which
/// detaches it from the other device if it still has one, and say so.
fn drop_stale_link(pin: &Path, iface: &str, ifindex: u32) -> anyhow::Result<()> {
    let found = pinned_link_ifindex(pin)
        .with_context(|| format!("reading the link pinned at {}", pin.display()))?;
    if found == Some(ifindex) {
        return Ok(());
    }
    match found {
        None => warn!(
            iface,
            "the link pinned at {} belonged to an interface {iface} that no longer exists \
             (deleted and re-created as ifindex {ifindex}): unpinning it and attaching afresh",
            pin.display()
        ),
        Some(old) => warn!(
            iface,
            "the link pinned at {} is on ifindex {old}, but {iface} is now ifindex {ifindex} \
             (renamed or re-created): detaching it from ifindex {old} and attaching afresh",
            pin.display()
        ),
    }
    let link = PinnedLink::from_pin(pin)
        .with_context(|| format!("opening {}", pin.display()))?
        .unpin()
        .with_context(|| format!("unpinning {}", pin.display()))?;
    drop(link); // the last reference: the kernel detaches it
    Ok(())
}

/// The ifindex of the device the XDP link pinned at `pin` is attached to, or None once that
/// device is gone (the kernel then reports ifindex 0). Raw BPF_OBJ_GET and
/// BPF_OBJ_GET_INFO_BY_FD: aya's `LinkInfo` does not expose the XDP part.
fn pinned_link_ifindex(pin: &Path) -> std::io::Result<Option<u32>> {
    use std::os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd};
    const BPF_OBJ_GET: libc::c_long = 7;
    const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;
    /// `struct bpf_link_info`: type, id, prog_id, then the 8-aligned union whose `xdp` member
    /// is `{ __u32 ifindex; }`. Larger than the kernel's struct; its tail stays zero.
    const INFO_LEN: usize = 256;
    const XDP_IFINDEX_AT: usize = 16;
    let path = CString::new(pin.as_os_str().as_encoded_bytes())?;
    #[repr(C)]
    struct ObjGet {
        pathname: u64,
        bpf_fd: u32,
        file_flags: u32,
        path_fd: i32,
        /// The kernel refuses attributes with any non-zero byte past the command's fields.
        pad: u32,
    }
    let get = ObjGet {
        pathname: path.as_ptr() as u64,
        bpf_fd: 0,
        file_flags: 0,
        path_fd: 0,
        pad: 0,
    };
    // SAFETY: bpf(2) reads `get` (and the path it points to) only during the call.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_OBJ_GET,
            &get as *const ObjGet,
            std::mem::size_of::<ObjGet>(),
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    let mut info = [0u64; INFO_LEN / 8];
    #[repr(C)]
    struct GetInfo {
        bpf_fd: u32,
        info_len: u32,
        info: u64,
    }
    let mut req = GetInfo {
        bpf_fd: fd.as_raw_fd() as u32,
        info_len: INFO_LEN as u32,
        info: info.as_mut_ptr() as u64,
    };
    // SAFETY: bpf(2) writes at most `info_len` bytes into `info`, which outlives the call.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_OBJ_GET_INFO_BY_FD,
            &mut req as *mut GetInfo,
            std::mem::size_of::<GetInfo>(),
        )
    };
    if rc < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let bytes: Vec<u8> = info.iter().flat_map(|w| w.to_ne_bytes()).collect();
    let ifindex = u32::from_ne_bytes(
        bytes[XDP_IFINDEX_AT..XDP_IFINDEX_AT + 4]
            .try_into()
            .expect("4 bytes"),
    );
    Ok((ifindex != 0).then_some(ifindex))
}

/// Remove the program from the interfaces (all pinned links, or those named) and, when no link
/// is left, every pinned map. Returns the interfaces detached.
///
/// That removes every file in `pin_dir`, so a `pin_dir` that is not on a bpffs (a mistyped
/// `--bpffs-dir`, a config naming an ordinary directory) is refused before anything is read or
/// removed: only a bpffs holds pins, and nothing but pins.
pub fn detach(pin_dir: &Path, only: &[String]) -> anyhow::Result<Vec<String>> {
    let mut detached = Vec::new();
    if !pin_dir.exists() {
        return Ok(detached);
    }
    let why = match statfs_magic(pin_dir) {
        Some(BPF_FS_MAGIC) => None,
        Some(magic) => Some(format!(
            "its filesystem type is {magic:#x}, a bpffs is {BPF_FS_MAGIC:#x}"
        )),
        None => Some(format!(
            "statfs failed: {}",
            std::io::Error::last_os_error()
        )),
    };
    if let Some(why) = why {
        bail!(
            "{} is not a bpffs directory ({why}), so it holds no pins: `ratelimit detach` removes \
             every file of the directory it is given, and works only on the daemon's bpffs \
             directory (daemon.bpffs_dir, under /sys/fs/bpf); nothing was removed",
            pin_dir.display()
        );
    }
    let Ok(entries) = fs::read_dir(pin_dir) else {
        return Ok(detached);
    };
    let mut remaining_links = 0;
    let mut files = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if let Some(iface) = name.strip_prefix("link-") {
            if only.is_empty() || only.iter().any(|o| o == iface) {
                let pinned = PinnedLink::from_pin(entry.path())
                    .with_context(|| format!("opening {}", entry.path().display()))?;
                let link = pinned.unpin()?;
                drop(link); // last reference: the kernel detaches the program
                detached.push(iface.to_string());
            } else {
                remaining_links += 1;
            }
        } else {
            files.push(entry.path());
        }
    }
    if remaining_links == 0 {
        for f in files {
            fs::remove_file(&f).with_context(|| format!("removing {}", f.display()))?;
        }
        let _ = fs::remove_dir(pin_dir);
    }
    Ok(detached)
}

/// The placement hash's key, every bit from the kernel's random source (getrandom(2), which
/// blocks only until the pool is first seeded).
fn random_hash_key() -> anyhow::Result<HashKey> {
    let mut b = [0u8; 8 * HASH_KEY_WORDS];
    let mut got = 0;
    while got < b.len() {
        // SAFETY: writes at most `b.len() - got` bytes into `b` from `got` on.
        let n = unsafe { libc::getrandom(b[got..].as_mut_ptr().cast(), b.len() - got, 0) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e).context("drawing the placement hash's key from getrandom(2)");
        }
        got += n as usize;
    }
    let key: HashKey = core::array::from_fn(|i| {
        u64::from_le_bytes(b[8 * i..8 * i + 8].try_into().expect("8 bytes"))
    });
    if key == [0; HASH_KEY_WORDS] {
        bail!("getrandom(2) returned only zero bytes: the kernel's random source is broken");
    }
    Ok(key)
}

fn raise_memlock() -> std::io::Result<()> {
    let rlim = libc::rlimit {
        rlim_cur: libc::RLIM_INFINITY,
        rlim_max: libc::RLIM_INFINITY,
    };
    // SAFETY: valid rlimit struct.
    if unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &rlim) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
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

#[cfg(test)]
mod tests {
    use super::Entry;

    #[test]
    fn detach_refuses_a_directory_off_bpffs_and_removes_nothing() {
        let dir = std::env::temp_dir().join(format!("ratelimit-detach-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("RL_STATS"), "not a pin").unwrap();
        let e = super::detach(&dir, &[]).unwrap_err().to_string();
        assert!(
            e.contains("not a bpffs") && e.contains("nothing was removed"),
            "{e}"
        );
        assert!(dir.join("RL_STATS").exists());
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(
            super::detach(&dir, &[]).unwrap(),
            Vec::<String>::new(),
            "absent: nothing to do"
        );
    }

    /// The object the daemon embeds is the program and nothing else: its only programs are
    /// the two entry points, and no symbol of the benchmark's object (per-run source
    /// variation, reference and floor programs, the flood generator, their maps) is in it.
    #[test]
    fn the_embedded_object_holds_the_two_entry_points_and_nothing_of_the_benchmark() {
        use object::{Object as _, ObjectSection as _, ObjectSymbol as _, SymbolKind};
        let file = object::File::parse(super::PROGRAM).expect("the embedded object is ELF");
        let mut programs = std::collections::BTreeSet::new();
        let mut foreign = Vec::new();
        for sym in file.symbols() {
            let name = sym.name().expect("a symbol name in UTF-8");
            let lower = name.to_ascii_lowercase();
            if lower.contains("bench")
                || lower.contains("vary")
                || name.starts_with("ref_")
                || name.starts_with("gen_")
            {
                foreign.push(name.to_string());
            }
            // A program is a function in a section of its own (`xdp`); global functions are
            // in `.text`.
            let section = sym
                .section_index()
                .and_then(|i| file.section_by_index(i).ok())
                .and_then(|s| s.name().ok().map(str::to_string));
            if sym.kind() == SymbolKind::Text
                && sym.is_global()
                && section.as_deref().is_some_and(|s| s != ".text")
            {
                programs.insert(name.to_string());
            }
        }
        let want: std::collections::BTreeSet<String> =
            [super::PROGRAM_NAME, super::PROGRAM_NAME_L3]
                .map(String::from)
                .into();
        assert!(
            programs == want && foreign.is_empty(),
            "programs {programs:?} (want exactly {want:?}); benchmark symbols {foreign:?} (want none)"
        );
    }

    #[test]
    fn each_link_type_gets_the_entry_that_parses_it_or_a_refusal_naming_it() {
        assert_eq!(Entry::for_link_type(1), Some(Entry::Ethernet));
        assert_eq!(Entry::for_link_type(772), Some(Entry::Ethernet));
        for l3 in [512, 519, 768, 769, 776, 778, 823, 65534] {
            assert_eq!(Entry::for_link_type(l3), Some(Entry::L3), "type {l3}");
        }
        // InfiniBand (32), CAN (280), 802.15.4 (804): neither Ethernet nor bare IP.
        for other in [32, 280, 804] {
            let e = Entry::for_link("ib0", other).unwrap_err().to_string();
            assert!(
                e.starts_with(&format!("ib0 has link type {other} ")) && e.contains("remove ib0"),
                "{e}"
            );
        }
    }
}
