//! Addresses as the maps see them.
//!
//! Every address is 16 bytes, IPv4 mapped into `::ffff:0:0/96` ([`IpKey`]), so the per-source
//! store and the per-client keys hold both families in one shape and an IPv4 /N prefix is a
//! /(96+N) prefix of the 16 bytes. That alone would let an IPv6 prefix such as `::/64` or
//! `::/8` cover every IPv4 address, so the LPM tries are keyed by [`LpmAddr`] instead: a
//! family byte, then the address as its family has it (an IPv4 address's 4 bytes, an IPv6
//! address's 16), with the family's 8 bits in front of every prefix. No IPv6 prefix can then
//! cover an IPv4 key, nor an IPv4 prefix an IPv6 one.
//!
//! The family of a 16-byte key is read from the key itself ([`IpKey::is_v4`]): the program
//! drops IPv6 packets whose source is IPv4-mapped (or any other IPv6 bogon, see
//! [`is_v6_bogon`]) before giving them any key, and an IPv6 source masked to fewer than 96
//! bits keeps fewer than all of bits 80..96 set, so an IPv6 key never looks IPv4-mapped.

/// Prefix length of the IPv4-mapped range `::ffff:0:0/96`.
pub const V4_MAPPED_PREFIX: u32 = 96;

/// Data part of an LPM trie key (the prefix length is carried beside it by the map's key type).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default, PartialOrd, Ord)]
pub struct IpKey {
    pub addr: [u8; 16],
}

impl IpKey {
    #[inline(always)]
    pub const fn from_v4(octets: [u8; 4]) -> Self {
        let mut addr = [0u8; 16];
        addr[10] = 0xff;
        addr[11] = 0xff;
        addr[12] = octets[0];
        addr[13] = octets[1];
        addr[14] = octets[2];
        addr[15] = octets[3];
        Self { addr }
    }

    #[inline(always)]
    pub const fn from_v6(octets: [u8; 16]) -> Self {
        Self { addr: octets }
    }

    /// True when the address is in the IPv4-mapped range.
    #[inline(always)]
    pub fn is_v4(&self) -> bool {
        let a = &self.addr;
        let hi = u64::from_ne_bytes([a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]]);
        let mid = u32::from_be_bytes([a[8], a[9], a[10], a[11]]);
        hi == 0 && mid == 0x0000_ffff
    }

    /// Zeroes every bit after the first `prefix_len` bits (0..=128).
    #[inline(always)]
    pub fn masked(mut self, prefix_len: u32) -> Self {
        let mut i = 0usize;
        while i < 16 {
            let bit = (i as u32) * 8;
            if bit >= prefix_len {
                self.addr[i] = 0;
            } else if prefix_len - bit < 8 {
                self.addr[i] &= 0xffu8 << (8 - (prefix_len - bit));
            }
            i += 1;
        }
        self
    }
}

/// `LpmAddr::family` of an IPv4 key.
pub const FAMILY_V4: u8 = 4;
/// `LpmAddr::family` of an IPv6 key.
pub const FAMILY_V6: u8 = 6;
/// Prefix bits taken by `LpmAddr::family` in front of every trie prefix.
pub const FAMILY_BITS: u32 = 8;

/// Data part of the LPM tries' keys (lists, bans, regions): the family, then the address as
/// its family has it, an IPv6 address's 16 bytes or an IPv4 address's 4 bytes followed by 12
/// zero bytes. The trie prefix is `FAMILY_BITS` + the prefix over the family's own address
/// ([`lpm_prefix`]): at most 40 bits for IPv4, 136 for IPv6.
///
/// IPv4 up front, not where [`IpKey`] holds it (bytes 12..16): the kernel's LPM trie compares
/// a node with a key 8 bytes at a time, then 4, then 1 (`longest_prefix_match`), and stops
/// at the node's prefix. An IPv4 key's family and address are its first 5 bytes, so each node
/// of an IPv4 lookup takes one comparison; as `::ffff:a.b.c.d` behind the family byte they
/// took four (8 bytes, 4, 4, and the last one), on every list and ban lookup of every packet.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default, PartialOrd, Ord)]
pub struct LpmAddr {
    pub family: u8,
    pub addr: [u8; 16],
}

impl LpmAddr {
    /// The trie address of a 16-byte key, its family read from the key.
    #[inline(always)]
    pub fn of(key: &IpKey) -> Self {
        if key.is_v4() {
            Self {
                family: FAMILY_V4,
                addr: v4_in_front(&key.addr),
            }
        } else {
            Self {
                family: FAMILY_V6,
                addr: key.addr,
            }
        }
    }

    /// The 16-byte key of a trie address ([`LpmAddr::of`] undone).
    #[inline(always)]
    pub fn ip_key(&self) -> IpKey {
        if self.family == FAMILY_V4 {
            IpKey::from_v4([self.addr[0], self.addr[1], self.addr[2], self.addr[3]])
        } else {
            IpKey { addr: self.addr }
        }
    }
}

/// The 4 bytes of an IPv4-mapped address (bytes 12..16) up front, then zeros: an IPv4
/// [`LpmAddr`]'s address.
#[inline(always)]
pub const fn v4_in_front(addr: &[u8; 16]) -> [u8; 16] {
    let mut a = [0u8; 16];
    a[0] = addr[12];
    a[1] = addr[13];
    a[2] = addr[14];
    a[3] = addr[15];
    a
}

/// The trie prefix length of a prefix of `prefix_len` bits over the 16-byte key (as
/// [`IpKey`] holds it: an IPv4 /N is a /(96+N)) of an IPv4 address when `v4`.
#[inline(always)]
pub const fn lpm_prefix(v4: bool, prefix_len: u32) -> u32 {
    if v4 {
        FAMILY_BITS + prefix_len.saturating_sub(V4_MAPPED_PREFIX)
    } else {
        FAMILY_BITS + prefix_len
    }
}

/// The prefix over the 16-byte key ([`lpm_prefix`] undone) of a trie prefix of
/// `trie_prefix_len` bits over `addr`.
#[inline(always)]
pub const fn prefix_of_lpm(trie_prefix_len: u32, addr: &LpmAddr) -> u32 {
    let bits = trie_prefix_len.saturating_sub(FAMILY_BITS);
    if addr.family == FAMILY_V4 {
        V4_MAPPED_PREFIX + bits
    } else {
        bits
    }
}

/// Whether an IPv6 source address is a bogon no real packet from the outside carries:
/// unspecified (`::`), loopback (`::1`), IPv4-compatible (`::/96`, which holds both),
/// IPv4-mapped (`::ffff:0:0/96`, which would alias an IPv4 client) or multicast (`ff00::/8`).
#[inline(always)]
pub fn is_v6_bogon(addr: &[u8; 16]) -> bool {
    if addr[0] == 0xff {
        return true;
    }
    let hi = u64::from_be_bytes([
        addr[0], addr[1], addr[2], addr[3], addr[4], addr[5], addr[6], addr[7],
    ]);
    let mid = u32::from_be_bytes([addr[8], addr[9], addr[10], addr[11]]);
    hi == 0 && (mid == 0 || mid == 0x0000_ffff)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn v6_bogons_are_exactly_the_listed_classes() {
        let v6 = |s: &str| s.parse::<core::net::Ipv6Addr>().unwrap().octets();
        for a in [
            "::",
            "::1",
            "::203.0.113.9",
            "::ffff:203.0.113.9",
            "::ffff:0:0",
            "ff02::1",
            "ff0e::1234",
        ] {
            assert!(is_v6_bogon(&v6(a)), "{a}");
        }
        for a in [
            "2001:db8::1",
            "fe80::1",
            "fc00::1",
            "::1:0:0:1",
            "::fffe:0:1",
            "0:0:0:1::",
            "64:ff9b::203.0.113.9",
            "fe00::1",
        ] {
            assert!(!is_v6_bogon(&v6(a)), "{a}");
        }
    }

    #[test]
    fn masked_ipv6_keys_of_non_bogon_sources_never_look_ipv4() {
        // A non-bogon source masked to any length: never in `::ffff:0:0/96`, so its trie
        // family is IPv6 and the per-source store never holds it where an IPv4 key lives.
        let sources: [[u8; 16]; 4] = [
            "::1:0:0:1".parse::<core::net::Ipv6Addr>().unwrap().octets(),
            "::1:ffff:0:1"
                .parse::<core::net::Ipv6Addr>()
                .unwrap()
                .octets(),
            "0:0:0:0:0:fffe:ffff:ffff"
                .parse::<core::net::Ipv6Addr>()
                .unwrap()
                .octets(),
            "2001:db8::ffff:1:2"
                .parse::<core::net::Ipv6Addr>()
                .unwrap()
                .octets(),
        ];
        for src in sources {
            assert!(!is_v6_bogon(&src));
            for len in 0..=128 {
                let k = IpKey::from_v6(src).masked(len);
                assert!(!k.is_v4(), "{src:?}/{len}");
                assert_eq!(LpmAddr::of(&k).family, FAMILY_V6);
            }
        }
        for len in 0..=32 {
            let k = IpKey::from_v4([203, 0, 113, 9]).masked(V4_MAPPED_PREFIX + len);
            assert_eq!(LpmAddr::of(&k).family, FAMILY_V4);
        }
    }

    /// An IPv4 prefix's trie key holds the family and the 4 address bytes up front, its
    /// prefix counted over them; an IPv6 one the 16 bytes; both come back as they went in.
    #[test]
    fn trie_keys_hold_ipv4_up_front_and_round_trip() {
        let k = IpKey::from_v4([198, 18, 200, 1]).masked(96 + 24);
        let a = LpmAddr::of(&k);
        assert_eq!(a.family, FAMILY_V4);
        assert_eq!(
            a.addr,
            [198, 18, 200, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]
        );
        assert_eq!(lpm_prefix(true, 96 + 24), 32);
        assert_eq!(lpm_prefix(true, 128), 40);
        assert_eq!(prefix_of_lpm(32, &a), 96 + 24);
        assert_eq!(a.ip_key(), k);
        let v6 = IpKey::from_v6(
            "2001:db8::1"
                .parse::<core::net::Ipv6Addr>()
                .unwrap()
                .octets(),
        );
        let b = LpmAddr::of(&v6);
        assert_eq!((b.family, b.addr), (FAMILY_V6, v6.addr));
        assert_eq!(lpm_prefix(false, 64), 72);
        assert_eq!(prefix_of_lpm(72, &b), 64);
        assert_eq!(b.ip_key(), v6);
    }

    #[test]
    fn v4_mapping_and_masking() {
        let k = IpKey::from_v4([192, 168, 11, 3]);
        assert!(k.is_v4());
        assert_eq!(&k.addr[12..], &[192, 168, 11, 3]);
        assert_eq!(&k.masked(96 + 24).addr[12..], &[192, 168, 11, 0]);
        assert_eq!(&k.masked(96 + 20).addr[12..], &[192, 168, 0, 0]);
        assert_eq!(k.masked(128), k);
        assert_eq!(k.masked(0), IpKey::default());
        let v6 = IpKey::from_v6([
            0x20, 0x01, 0x0d, 0xb8, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,
        ]);
        assert!(!v6.is_v4());
        let m = v6.masked(64);
        assert_eq!(&m.addr[..8], &[0x20, 0x01, 0x0d, 0xb8, 1, 2, 3, 4]);
        assert_eq!(&m.addr[8..], &[0u8; 8]);
        assert_eq!(v6.masked(61).addr[7], 0);
        assert_eq!(v6.masked(63).addr[7], 4);
    }
}
