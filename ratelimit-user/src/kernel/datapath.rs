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
//!
//! The parts: loading the object and running it on test frames ([`load`]), the entry point
//! per interface and attaching it ([`attach`]), the interfaces' counter slots ([`slots`]), the
//! bpffs, the pins and the pinned layout ([`pin`]), and the typed handles on the maps
//! ([`maps`]).

use std::path::PathBuf;

use aya::Ebpf;
use ratelimit_common::maps::HashKey;

pub mod attach;
pub mod load;
pub mod maps;
pub mod pin;
pub mod slots;

pub use attach::{Entry, ifindex, link_type};
pub use maps::{Maps, ban_key, retry_enomem};
pub(crate) use pin::ensure_bpffs;
pub use pin::{LAYOUT_FILE, check_pinned_layout, detach, layout, record_pinned_layout};

/// The compiled XDP program, built by build.rs.
static PROGRAM: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/ratelimit"));

/// Every map of the program, by the name it is pinned under in `daemon.bpffs_dir` (the daemon
/// pins them all, adopts them at a restart, and `detach` removes them). A load whose object
/// lacks one fails naming it; a test checks this list against the maps the embedded object
/// defines, and every map name the daemon's code spells against this list.
pub const MAP_NAMES: &[&str] = &[
    "RL_ADMISSION",
    "RL_BANS",
    "RL_BANS_OPERATOR",
    "RL_BANS_PASSING",
    "RL_BANS_PRESENT",
    "RL_BANS_REMOTE",
    "RL_BAN_EPOCH",
    "RL_CLIENTS",
    "RL_COOKIE_BUF",
    "RL_COOKIE_TIME",
    "RL_DESTS",
    "RL_EVENTS",
    "RL_FAST",
    "RL_FLEET_ADD",
    "RL_GLOBAL",
    "RL_HASH_KEY",
    "RL_IFACES",
    "RL_IFSLOTS",
    "RL_KEYED",
    "RL_KNOWN",
    "RL_LOCAL_ADDRS",
    "RL_OVERFLOW",
    "RL_OVERRIDES",
    "RL_OVF_TICK",
    "RL_PROVEN",
    "RL_PROVEN_NETS",
    "RL_RARE",
    "RL_REGIONS",
    "RL_REGION_OVERRIDES",
    "RL_RULES",
    "RL_SCRATCH",
    "RL_SHARED",
    "RL_SOURCES",
    "RL_STATS",
    "RL_TICK",
];

const PROGRAM_NAME: &str = "ratelimit";
const PROGRAM_NAME_L3: &str = "ratelimit_l3";

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

#[cfg(test)]
mod tests;
