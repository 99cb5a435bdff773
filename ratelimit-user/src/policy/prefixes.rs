//! Address prefixes as the LPM tries key them (a family, then the 16-byte address), and a
//! set of listed prefixes closed over covering ones, so that a longest-prefix match alone
//! answers for every list that covers an address.

use std::collections::BTreeMap;

use aya::maps::lpm_trie::Key;
use ipnet::IpNet;
use ratelimit_common::{
    addr::{IpKey, LpmAddr, V4_MAPPED_PREFIX, lpm_prefix},
    maps::ListValue,
};

/// An address prefix over the 16-byte address: (prefix length, address). An IPv4 /N is the
/// /(96+N) of its `::ffff:0:0/96` form; an IPv6 prefix of that range is read as the IPv4
/// prefix it spells (no IPv6 packet from it is ever judged: such sources are bogons). The
/// tries key it with its family in front ([`lpm_key`]), so that an IPv6 prefix never covers
/// an IPv4 address.
pub type Prefix = (u32, IpKey);

/// The LPM trie key of a prefix: its family, then the address.
pub fn lpm_key(p: &Prefix) -> Key<LpmAddr> {
    Key::new(lpm_prefix(p.1.is_v4(), p.0), LpmAddr::of(&p.1))
}

/// Back from an LPM trie key to a prefix.
pub fn prefix_of_lpm(k: &Key<LpmAddr>) -> Prefix {
    let data = k.data();
    (
        ratelimit_common::addr::prefix_of_lpm(k.prefix_len(), &data),
        data.ip_key(),
    )
}

pub fn prefix(net: &IpNet) -> Prefix {
    match net {
        IpNet::V4(n) => (
            V4_MAPPED_PREFIX + n.prefix_len() as u32,
            IpKey::from_v4(n.network().octets()),
        ),
        IpNet::V6(n) => (n.prefix_len() as u32, IpKey::from_v6(n.network().octets())),
    }
}

/// Back from a trie prefix to an `IpNet`.
pub fn net_of(prefix_len: u32, key: &IpKey) -> IpNet {
    if key.is_v4() && prefix_len >= V4_MAPPED_PREFIX {
        let a = std::net::Ipv4Addr::new(key.addr[12], key.addr[13], key.addr[14], key.addr[15]);
        IpNet::V4(ipnet::Ipv4Net::new(a, (prefix_len - V4_MAPPED_PREFIX) as u8).expect("valid"))
    } else {
        IpNet::V6(
            ipnet::Ipv6Net::new(
                std::net::Ipv6Addr::from(key.addr),
                prefix_len.min(128) as u8,
            )
            .expect("valid"),
        )
    }
}

/// Every listed prefix with the union of the values of all listed prefixes that cover it
/// (itself included), so that a longest-prefix match alone is complete. Prefixes form a
/// laminar family: sorted by (address, length), the prefixes covering one are exactly the
/// chain left on a stack after popping those that do not cover it. O(n log n).
///
/// Each family is closed on its own: an IPv6 prefix never covers an IPv4 one (`::/64` holds
/// `::ffff:0:0/96` as bits, not as addresses).
pub fn close_over_covering(own: &[(Prefix, ListValue)]) -> BTreeMap<Prefix, ListValue> {
    let (v4, v6): (Vec<_>, Vec<_>) = own.iter().partition(|((_, key), _)| key.is_v4());
    let mut out = close_one_family(&v4);
    out.extend(close_one_family(&v6));
    out
}

fn close_one_family(own: &[&(Prefix, ListValue)]) -> BTreeMap<Prefix, ListValue> {
    let mut merged: BTreeMap<(u128, u32), ListValue> = BTreeMap::new();
    for ((len, key), v) in own.iter().copied() {
        let e = merged
            .entry((u128::from_be_bytes(key.addr), *len))
            .or_default();
        e.flags |= v.flags;
        e.rule_src_mask |= v.rule_src_mask;
        e.rule_except_mask |= v.rule_except_mask;
    }
    let covers = |(a, l): (u128, u32), (b, m): (u128, u32)| {
        l <= m && (l == 0 || (a >> (128 - l)) == (b >> (128 - l)))
    };
    let mut stack: Vec<((u128, u32), ListValue)> = Vec::new();
    let mut out = BTreeMap::new();
    for (p, v) in merged {
        while let Some((q, _)) = stack.last() {
            if covers(*q, p) {
                break;
            }
            stack.pop();
        }
        let mut acc = v;
        if let Some((_, up)) = stack.last() {
            acc.flags |= up.flags;
            acc.rule_src_mask |= up.rule_src_mask;
            acc.rule_except_mask |= up.rule_except_mask;
        }
        stack.push((p, acc));
        out.insert(
            (
                p.1,
                IpKey {
                    addr: p.0.to_be_bytes(),
                },
            ),
            acc,
        );
    }
    out
}
