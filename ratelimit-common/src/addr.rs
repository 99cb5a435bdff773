//! Addresses as the maps see them: every address is 16 bytes, IPv4 mapped into `::ffff:0:0/96`,
//! so one LPM trie serves both families and an IPv4 /N prefix is an IPv6 /(96+N) prefix.

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
        self.addr[..10] == [0u8; 10] && self.addr[10] == 0xff && self.addr[11] == 0xff
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

#[cfg(test)]
mod tests {
    use super::*;

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
