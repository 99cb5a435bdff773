//! The override maps (per CIDR and per region), and the unknown region.

use super::rule::Limit;

/// Data part of the per-CIDR override LPM trie key: the rule index first, then the family
/// (both always matched in full, so the trie's prefix length is `OVERRIDE_RULE_BITS +
/// address prefix`), then the address.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OverrideKey {
    /// Rule index, big-endian so it forms the leading bits of the trie key.
    pub rule_be: u32,
    /// `addr::FAMILY_V4` or `FAMILY_V6`: an IPv6 override never covers an IPv4 client.
    pub family: u8,
    pub addr: [u8; 16],
    pub _pad: [u8; 3],
}

/// Prefix bits taken by `OverrideKey::rule_be` and `OverrideKey::family`: an override of a
/// prefix of `N` bits over the 16-byte address has the trie prefix `OVERRIDE_RULE_BITS + N`.
pub const OVERRIDE_RULE_BITS: u32 = 32 + crate::addr::FAMILY_BITS;

/// Key of the per-region override hash map.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct RegionOverrideKey {
    pub rule: u32,
    /// ISO 3166 alpha-2 code as two ASCII bytes, `ZZ` for unknown.
    pub region: [u8; 2],
    pub _pad: [u8; 2],
}

/// Value of both override maps.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OverrideValue {
    pub limit: Limit,
    /// The override's limit while the host has room (as [`RuleConfig::elastic`]); `limit`
    /// itself without elastic.
    ///
    /// [`RuleConfig::elastic`]: super::RuleConfig::elastic
    pub elastic: Limit,
}

impl OverrideValue {
    /// The override's limit in force (as [`RuleConfig::limit_now`]).
    ///
    /// [`RuleConfig::limit_now`]: super::RuleConfig::limit_now
    #[inline(always)]
    pub const fn limit_now(&self, relaxed: bool) -> &Limit {
        if relaxed { &self.elastic } else { &self.limit }
    }
}
/// Region code used when the GeoIP map has no entry for an address.
pub const REGION_UNKNOWN: [u8; 2] = *b"ZZ";
