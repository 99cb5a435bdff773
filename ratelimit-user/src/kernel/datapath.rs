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
