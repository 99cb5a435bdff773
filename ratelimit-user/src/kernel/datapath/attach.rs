//! The program's entry point for an interface (from its link type), and attaching it: afresh
//! in the mode asked for, or by taking over the link an earlier daemon pinned.

use std::{ffi::CString, fs};

use anyhow::{Context as _, anyhow, bail};
use aya::programs::{
    Xdp, XdpMode,
    links::{FdLink, PinnedLink},
    xdp::XdpLink,
};
use tracing::{info, warn};

use super::{
    Attached, Datapath, PROGRAM_NAME, PROGRAM_NAME_L3,
    maps::Maps,
    pin::{detach, drop_stale_link, link_pin},
    slots::{assign_slot, prune_slots},
};
use crate::config;

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

pub fn ifindex(iface: &str) -> anyhow::Result<u32> {
    let c = CString::new(iface)?;
    // SAFETY: valid C string.
    let idx = unsafe { libc::if_nametoindex(c.as_ptr()) };
    if idx == 0 {
        bail!("no such interface: {iface} (check `ip link`)");
    }
    Ok(idx)
}

impl Datapath {
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

    /// Detach the program from `iface` (its pinned link removed), leaving the maps and the
    /// other interfaces as they are: to undo an attach.
    pub fn detach_iface(&mut self, iface: &str) -> anyhow::Result<()> {
        detach(&self.pin_dir, &[iface.to_string()])?;
        self.attached.retain(|a| a.iface != iface);
        Ok(())
    }
}
