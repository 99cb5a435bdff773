//! veth pairs between two lab namespaces, with addresses, MACs and ifindexes.
//!
//! A veth pair is the lab's wire: frames sent into one end arrive at the
//! other end's XDP hook and stack exactly as from a NIC, but never leave the
//! machine. Each pair gets its own 198.18.N.0/24 and 2001:db8:N::/64 (RFC 2544
//! benchmarking and RFC 3849 documentation space), so addresses never clash
//! with the host's and a test can tell pairs apart by address alone.
//!
//! Tests craft frames by hand, so they need the peer's real MAC (the stack
//! drops frames to any other unicast MAC) and the ifindex (to bind
//! AF_PACKET sockets); [`VethEnd`] carries both.

use std::collections::HashMap;
use std::net::{Ipv4Addr, Ipv6Addr};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

use crate::netns::NetNs;

static PAIRS: AtomicU32 = AtomicU32::new(0);

/// One end of a [`VethPair`].
#[derive(Clone, Debug)]
pub struct VethEnd {
    /// Interface name (at most 15 bytes, unique per process).
    pub name: String,
    /// Name of the namespace the end lives in.
    pub netns: String,
    /// Interface index inside its namespace.
    pub ifindex: u32,
    /// Hardware address, for crafted frames' source/destination.
    pub mac: [u8; 6],
    /// 198.18.N.1 on end A, 198.18.N.2 on end B (prefix /24).
    pub ipv4: Ipv4Addr,
    /// 2001:db8:N::1 on end A, 2001:db8:N::2 on end B (prefix /64, no DAD).
    pub ipv6: Ipv6Addr,
}

impl VethEnd {
    /// Sets the transmit-queue CPU mask (XPS) of `queue`, e.g. `set_xps(0, 0b01)`
    /// and `set_xps(1, 0b10)`: with two queues this makes a sender pinned to
    /// CPU 1 use queue 1, so the peer's XDP runs on both CPUs.
    ///
    /// # Panics
    ///
    /// If the write fails (e.g. the queue does not exist).
    pub fn set_xps(&self, queue: u32, cpu_mask: u64) {
        let path = format!("/sys/class/net/{}/queues/tx-{queue}/xps_cpus", self.name);
        // `ip netns exec` remounts /sys so the namespace's devices are visible.
        crate::netns::run_checked(Command::new("ip").args([
            "netns",
            "exec",
            &self.netns,
            "sh",
            "-c",
            &format!("echo {cpu_mask:x} > {path}"),
        ]));
    }

    /// `ethtool -S` of this end as name -> value (e.g. `rx_queue_0_xdp_drops`),
    /// the kernel's own count of what XDP did to frames arriving here.
    pub fn ethtool_stats(&self) -> HashMap<String, u64> {
        let out = crate::netns::run_checked(Command::new("ip").args([
            "netns",
            "exec",
            &self.netns,
            "ethtool",
            "-S",
            &self.name,
        ]));
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| {
                let (k, v) = l.split_once(':')?;
                Some((k.trim().to_string(), v.trim().parse().ok()?))
            })
            .collect()
    }
}

/// A veth pair with end A in one namespace and end B in another, deleted on
/// drop (deleting one end deletes both).
#[derive(Debug)]
pub struct VethPair {
    a: VethEnd,
    b: VethEnd,
    index: u8,
}

impl VethPair {
    /// A single-queue pair, both ends up and addressed.
    pub fn new(ns_a: &NetNs, ns_b: &NetNs) -> VethPair {
        VethPair::build(ns_a, ns_b, None)
    }

    /// A pair with `queues` tx and rx queues on both ends, so XDP on the
    /// receiving end can run on several CPUs (see [`VethEnd::set_xps`]).
    pub fn with_queues(ns_a: &NetNs, ns_b: &NetNs, queues: u32) -> VethPair {
        assert!(queues >= 1, "a veth needs at least one queue");
        VethPair::build(ns_a, ns_b, Some(queues))
    }

    fn build(ns_a: &NetNs, ns_b: &NetNs, queues: Option<u32>) -> VethPair {
        let n = PAIRS.fetch_add(1, Ordering::Relaxed);
        // 1..=254 so the /24 and /64 are never .0 or .255-looking.
        let index = u8::try_from(n % 254 + 1).expect("n % 254 + 1 fits in u8");
        let pid = std::process::id() % 100_000;
        // "rl" + 5 + "-" + 5 + "a" = at most 14 bytes, inside IFNAMSIZ.
        let tag = format!("rl{pid}-{}", n % 100_000);
        let name_a = format!("{tag}a");
        let name_b = format!("{tag}b");
        Self::build_named(ns_a, ns_b, &name_a, &name_b, index, queues)
    }

    fn build_named(
        ns_a: &NetNs,
        ns_b: &NetNs,
        name_a: &str,
        name_b: &str,
        index: u8,
        queues: Option<u32>,
    ) -> VethPair {
        let q: Vec<String> = queues
            .map(|q| {
                vec![
                    "numtxqueues".into(),
                    q.to_string(),
                    "numrxqueues".into(),
                    q.to_string(),
                ]
            })
            .unwrap_or_default();
        // Create both ends directly in their namespaces, so the names only
        // need to be unique there and nothing ever appears in the root one.
        let mut cmd = Command::new("ip");
        cmd.args(["link", "add", name_a, "netns", ns_a.name()])
            .args(&q)
            .args(["type", "veth", "peer", "name", name_b, "netns", ns_b.name()])
            .args(&q);
        crate::netns::run_checked(&mut cmd);

        let ipv4_a = Ipv4Addr::new(198, 18, index, 1);
        let ipv4_b = Ipv4Addr::new(198, 18, index, 2);
        let ipv6_a = Ipv6Addr::new(0x2001, 0xdb8, u16::from(index), 0, 0, 0, 0, 1);
        let ipv6_b = Ipv6Addr::new(0x2001, 0xdb8, u16::from(index), 0, 0, 0, 0, 2);
        let placeholder = |name: &str, ns: &NetNs, ipv4, ipv6| VethEnd {
            name: name.to_string(),
            netns: ns.name().to_string(),
            ifindex: 0,
            mac: [0; 6],
            ipv4,
            ipv6,
        };
        // The guard exists from here on, so a later failure still deletes the pair.
        let mut pair = VethPair {
            a: placeholder(name_a, ns_a, ipv4_a, ipv6_a),
            b: placeholder(name_b, ns_b, ipv4_b, ipv6_b),
            index,
        };
        for (end, ns) in [(&mut pair.a, ns_a), (&mut pair.b, ns_b)] {
            ns.ip(&["addr", "add", &format!("{}/24", end.ipv4), "dev", &end.name]);
            ns.ip(&[
                "-6",
                "addr",
                "add",
                &format!("{}/64", end.ipv6),
                "dev",
                &end.name,
                "nodad",
            ]);
            ns.ip(&["link", "set", &end.name, "up"]);
            let (ifindex, mac) = link_info(ns, &end.name);
            end.ifindex = ifindex;
            end.mac = mac;
        }
        pair
    }

    /// Deletes the pair and creates it again with the same names and addresses, as an
    /// interface that goes away and comes back does: new ifindexes and MACs. `ns_a` and `ns_b`
    /// must be the namespaces the pair was made in.
    pub fn recreate(&mut self, ns_a: &NetNs, ns_b: &NetNs) {
        assert_eq!(
            (ns_a.name(), ns_b.name()),
            (self.a.netns.as_str(), self.b.netns.as_str()),
            "recreate in the pair's own namespaces"
        );
        ns_a.ip(&["link", "del", &self.a.name]);
        let (a, b) = (self.a.name.clone(), self.b.name.clone());
        let fresh = Self::build_named(ns_a, ns_b, &a, &b, self.index, None);
        // Move the new ends in, then let the placeholder drop without deleting anything.
        self.a = fresh.a.clone();
        self.b = fresh.b.clone();
        std::mem::forget(fresh);
    }

    /// End A (the first namespace; usually the client/sender side).
    pub fn a(&self) -> &VethEnd {
        &self.a
    }

    /// End B (the second namespace; usually the protected side).
    pub fn b(&self) -> &VethEnd {
        &self.b
    }

    /// N in this pair's 198.18.N.0/24 and 2001:db8:N::/64.
    pub fn index(&self) -> u8 {
        self.index
    }
}

impl Drop for VethPair {
    fn drop(&mut self) {
        // Fails harmlessly if the namespace is already gone (and took the
        // pair with it).
        let _ = Command::new("ip")
            .args(["-n", &self.a.netns, "link", "del", &self.a.name])
            .output();
    }
}

/// Ifindex and MAC of `iface` in `ns`, from `ip -j link show`.
///
/// # Panics
///
/// If the interface does not exist or the JSON is not as expected.
pub fn link_info(ns: &NetNs, iface: &str) -> (u32, [u8; 6]) {
    let out = ns.ip(&["-j", "link", "show", "dev", iface]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("`ip -j link show {iface}` is not JSON: {e}"));
    let link = &v[0];
    let ifindex = link["ifindex"]
        .as_u64()
        .and_then(|i| u32::try_from(i).ok())
        .unwrap_or_else(|| panic!("no ifindex for {iface} in {v}"));
    let mac = link["address"]
        .as_str()
        .and_then(parse_mac)
        .unwrap_or_else(|| panic!("no MAC for {iface} in {v}"));
    (ifindex, mac)
}

/// Parses `aa:bb:cc:dd:ee:ff`.
pub fn parse_mac(s: &str) -> Option<[u8; 6]> {
    let mut mac = [0u8; 6];
    let mut parts = s.split(':');
    for b in &mut mac {
        *b = u8::from_str_radix(parts.next()?, 16).ok()?;
    }
    parts.next().is_none().then_some(mac)
}

/// Lets `iface` in `ns` accept spoofed IPv4 sources: reverse-path filtering
/// off (`all`, `default` and the interface; the kernel uses the maximum of
/// `all` and the interface) and `accept_local` on, so frames from sources
/// with no route back still reach sockets.
pub fn disable_rp_filter(ns: &NetNs, iface: &str) {
    for scope in ["all", "default", iface] {
        ns.sysctl(&format!("net.ipv4.conf.{scope}.rp_filter"), "0");
        ns.sysctl(&format!("net.ipv4.conf.{scope}.accept_local"), "1");
    }
}

/// Keeps the stack of `ns` from sending anything out of `iface` on its own: IPv6 off on it
/// (no link-local address, so no router solicitations, neighbour discovery or MLD reports
/// minutes after the link came up; IPv4 sends nothing unless asked). The frames that reach
/// the other end are then exactly the ones the test sends, so counts of every frame there
/// (`ratelimit_packets_total` summed) can be exact. The test's own IPv6 frames, sent on a
/// packet socket, are not affected.
pub fn silence(ns: &NetNs, iface: &str) {
    ns.sysctl(&format!("net.ipv6.conf.{iface}.disable_ipv6"), "1");
}

/// Adds an extra address (`"198.19.5.1/24"`, `"2001:db8:ff::1/64"`) to
/// `iface`; IPv6 addresses are added without DAD so they work at once.
pub fn add_address(ns: &NetNs, iface: &str, cidr: &str) {
    if cidr.contains(':') {
        ns.ip(&["-6", "addr", "add", cidr, "dev", iface, "nodad"]);
    } else {
        ns.ip(&["addr", "add", cidr, "dev", iface]);
    }
}

/// Routes `dest` (`"198.19.0.0/16"`) out of `iface`, optionally via a
/// gateway, for replies to extra source ranges.
pub fn add_route(ns: &NetNs, dest: &str, iface: &str, via: Option<&str>) {
    let mut args = vec!["route", "add", dest];
    if let Some(gw) = via {
        args.extend(["via", gw]);
    }
    args.extend(["dev", iface]);
    ns.ip(&args);
}

/// A permanent neighbour entry, so the stack can send to `ip` without ARP/ND
/// (e.g. replies to a spoofed source nobody answers for).
pub fn add_neighbor(ns: &NetNs, iface: &str, ip: &str, mac: [u8; 6]) {
    ns.ip(&[
        "neigh",
        "replace",
        ip,
        "lladdr",
        &format_mac(mac),
        "dev",
        iface,
        "nud",
        "permanent",
    ]);
}

/// Formats a MAC as `aa:bb:cc:dd:ee:ff`.
pub fn format_mac(mac: [u8; 6]) -> String {
    mac.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}
