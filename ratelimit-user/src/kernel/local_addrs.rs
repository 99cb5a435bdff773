//! The addresses this host owns, for the program's `RL_LOCAL_ADDRS`: on a host that forwards
//! nothing, a SYN is answered from XDP (`tracking.syn_cookies`) only if it is addressed to one
//! of them (`ratelimit-ebpf/src/cookies.rs`, `for_this_host`). The daemon writes them before
//! it attaches, and again every [`REFRESH`] (an address added or removed is followed within
//! that), from the interfaces of its network namespace (`getifaddrs`).

use std::{collections::BTreeSet, net::IpAddr, time::Duration};

use aya::maps::{HashMap, MapData};
use ratelimit_common::addr::IpKey;
use tracing::warn;

/// How often the daemon reads the host's addresses again.
pub const REFRESH: Duration = Duration::from_secs(1);

/// The `IpKey` bytes of `ip` (IPv4, and IPv4-mapped IPv6, as `::ffff:a.b.c.d`), the map's key.
pub fn key_of(ip: IpAddr) -> [u8; 16] {
    match ip.to_canonical() {
        IpAddr::V4(v4) => IpKey::from_v4(v4.octets()).addr,
        IpAddr::V6(v6) => v6.octets(),
    }
}

/// The addresses of every interface of this network namespace (up or not).
pub fn read() -> std::io::Result<BTreeSet<[u8; 16]>> {
    let mut out = BTreeSet::new();
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs(3) fills `head` with a list we free below.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let mut p = head;
    while !p.is_null() {
        // SAFETY: a node of the list getifaddrs returned, not yet freed.
        let ifa = unsafe { &*p };
        p = ifa.ifa_next;
        if ifa.ifa_addr.is_null() {
            continue;
        }
        // SAFETY: `ifa_addr` points at a sockaddr whose family says its type.
        let ip = unsafe {
            match (*ifa.ifa_addr).sa_family as i32 {
                libc::AF_INET => {
                    let sa = &*(ifa.ifa_addr as *const libc::sockaddr_in);
                    IpAddr::from(u32::from_be(sa.sin_addr.s_addr).to_be_bytes())
                }
                libc::AF_INET6 => {
                    let sa = &*(ifa.ifa_addr as *const libc::sockaddr_in6);
                    IpAddr::from(sa.sin6_addr.s6_addr)
                }
                _ => continue,
            }
        };
        out.insert(key_of(ip));
    }
    // SAFETY: the list getifaddrs returned, freed once.
    unsafe { libc::freeifaddrs(head) };
    Ok(out)
}

/// The program's `RL_LOCAL_ADDRS`, and what this process last wrote into it.
pub struct LocalAddrs {
    map: HashMap<MapData, [u8; 16], u8>,
    written: BTreeSet<[u8; 16]>,
    /// A write failed (the map full, say): said once, until a write succeeds again.
    warned: bool,
}

impl LocalAddrs {
    pub fn new(map: HashMap<MapData, [u8; 16], u8>) -> Self {
        // Whatever an earlier process left (the map is not pinned: none) is replaced at the
        // first `sync`.
        let written = map.keys().filter_map(|k| k.ok()).collect();
        LocalAddrs {
            map,
            written,
            warned: false,
        }
    }

    /// Make the map hold exactly `addrs` (the ones that fit).
    pub fn sync(&mut self, addrs: &BTreeSet<[u8; 16]>) {
        let mut failed = None;
        for gone in self.written.difference(addrs).copied().collect::<Vec<_>>() {
            match self.map.remove(&gone) {
                Ok(()) | Err(aya::maps::MapError::KeyNotFound) => {
                    self.written.remove(&gone);
                }
                Err(e) => failed = Some(e),
            }
        }
        for new in addrs.difference(&self.written).copied().collect::<Vec<_>>() {
            match self.map.insert(new, 1, 0) {
                Ok(()) => {
                    self.written.insert(new);
                }
                Err(e) => failed = Some(e),
            }
        }
        match failed {
            Some(e) if !self.warned => {
                warn!(
                    "writing this host's addresses for the SYN answers failed ({e}); a SYN to an \
                     address not written is not answered from XDP (the map holds {} at most)",
                    ratelimit_common::caps::MAX_LOCAL_ADDRS
                );
                self.warned = true;
            }
            Some(_) => {}
            None => self.warned = false,
        }
    }

    /// Read the host's addresses and [`LocalAddrs::sync`] them.
    pub fn refresh(&mut self) {
        match read() {
            Ok(addrs) => self.sync(&addrs),
            Err(e) => {
                if !self.warned {
                    warn!("reading this host's addresses (getifaddrs): {e}");
                    self.warned = true;
                }
            }
        }
    }

    /// The addresses the map holds, as this process wrote them.
    pub fn written(&self) -> &BTreeSet<[u8; 16]> {
        &self.written
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_ip_keys_and_loopback_is_read() {
        assert_eq!(
            key_of("192.0.2.7".parse().unwrap()),
            IpKey::from_v4([192, 0, 2, 7]).addr
        );
        assert_eq!(
            key_of("::ffff:192.0.2.7".parse().unwrap()),
            IpKey::from_v4([192, 0, 2, 7]).addr,
            "an IPv4-mapped address is the IPv4 one"
        );
        let v6: std::net::Ipv6Addr = "2001:db8::1".parse().unwrap();
        assert_eq!(key_of(v6.into()), v6.octets());
        let all = read().expect("getifaddrs");
        assert!(
            all.contains(&key_of("127.0.0.1".parse().unwrap())),
            "lo's address"
        );
    }
}
