//! The store's names of global rules' counts: a client's name, its bucket, the hashes of its
//! counts and the sets announcing near-limit clients, and the names of shared keys.

use ratelimit_common::maps::{ClientKey, KEY_REGION};

use super::BUCKETS;
use crate::kernel::clients::Meter;

/// 32-bit FNV-1a.
pub fn fnv32(b: &[u8]) -> u32 {
    b.iter().fold(0x811c_9dc5u32, |h, &c| {
        (h ^ c as u32).wrapping_mul(0x0100_0193)
    })
}

/// The store's name of a client: its masked address and prefix length.
pub fn key_name(addr: &[u8; 16], prefix_len: u32) -> String {
    let a = std::net::Ipv6Addr::from(*addr);
    match a.to_ipv4_mapped() {
        Some(v4) if prefix_len >= 96 => format!("{v4}/{}", prefix_len - 96),
        _ => format!("{a}/{prefix_len}"),
    }
}

/// The bucket of client `name` of rule `rid`.
pub fn bucket_of(rid: &str, name: &str) -> u64 {
    fnv32(format!("{rid}|{name}").as_bytes()) as u64 % BUCKETS
}

/// The hash of `rid`'s counts of `meter` in `bucket` and `window`. The tag `{g<bucket>}`
/// keeps one call's keys in one Cluster slot.
pub fn hash_name(rid: &str, meter: Meter, bucket: u64, window: u64) -> String {
    format!(
        "ratelimit:{{g{bucket}}}:{}:{rid}:{window}",
        meter_tag(meter)
    )
}

/// When the hash of `window` (windows of `interval` ns) expires, in unix ms: two windows
/// after this one ends, plus a minute of clock skew.
pub fn expire_ms(window: u64, interval: u64) -> u64 {
    u64::try_from((window.saturating_add(2) as u128 * interval as u128) / 1_000_000)
        .unwrap_or(u64::MAX)
        .saturating_add(60_000)
}

/// A meter's letter in the store's names.
fn meter_tag(meter: Meter) -> &'static str {
    match meter {
        Meter::Admitted => "a",
        Meter::Offered => "o",
    }
}

/// The set announcing `rid`'s near-limit clients of `meter` in `bucket` and `window` (in
/// the bucket's Cluster slot, as its counts).
pub fn announce_set(rid: &str, meter: Meter, bucket: u64, window: u64) -> String {
    format!(
        "ratelimit:{{g{bucket}}}:n:{}:{rid}:{window}",
        meter_tag(meter)
    )
}

/// The store's name of a shared key: `all`, or `region:<code>` (`ZZ` for unknown).
pub fn shared_key_name(key: &ClientKey) -> String {
    if key.kind == KEY_REGION {
        let code: String = key.addr[..2]
            .iter()
            .map(|&c| {
                if c.is_ascii_alphanumeric() {
                    c as char
                } else {
                    '?'
                }
            })
            .collect();
        format!("region:{code}")
    } else {
        "all".into()
    }
}
