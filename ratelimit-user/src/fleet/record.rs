//! The records of the ban stream (a ban with its absolute end, or an unban), what the reader
//! hands the owner to apply, and the conversions between the wall clock they travel in and the
//! kernel's monotonic clock.

use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

/// What a record does.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Op {
    Ban,
    Unban,
}

/// One entry of the ban stream.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct Record {
    pub op: Op,
    /// The prefix, as `ban add` prints it (`203.0.113.0/24`, `2001:db8::/64`).
    pub net: String,
    /// Unix ms when the ban ends; 0 = until removed. 0 for an `unban`.
    #[serde(default)]
    pub exp_ms: u64,
    /// Unix ms when it was issued.
    pub at_ms: u64,
    /// The host that issued it.
    pub host: String,
    /// The rule that issued it there, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rule: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

pub fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).unwrap_or_default().as_millis() as u64
}

/// The CLOCK_MONOTONIC ns of the unix ms `ms` (0 stays 0: until removed); `None` if it has
/// passed.
pub fn mono_of_unix_ms(ms: u64) -> Option<u64> {
    if ms == 0 {
        return Some(0);
    }
    let now_ms = unix_ms(SystemTime::now());
    if ms <= now_ms {
        return None;
    }
    Some(
        crate::clock::mono_ns()
            .saturating_add((ms - now_ms).saturating_mul(1_000_000))
            .max(1),
    )
}

/// The unix ms of the CLOCK_MONOTONIC ns `ns` (0 stays 0).
pub fn unix_ms_of_mono(ns: u64) -> u64 {
    if ns == 0 {
        return 0;
    }
    let now = crate::clock::mono_ns();
    let now_ms = unix_ms(SystemTime::now());
    if ns >= now {
        now_ms + (ns - now).div_ceil(1_000_000)
    } else {
        now_ms.saturating_sub((now - ns) / 1_000_000).max(1)
    }
}

/// What the reader hands the owner to apply.
pub enum Received {
    /// Stream records, in order.
    Records(Vec<Record>),
    /// The snapshot: every ban of the fleet now, and the tombstones of recent `unban`s,
    /// which lift only bans received from the fleet. A ban held here that the snapshot lacks
    /// stays until its end (the store may have lost its data: a restart without
    /// persistence), so an `unban` whose tombstone was pruned before this host read it is
    /// missed.
    Snapshot(Vec<Record>),
}

/// What applying records did.
#[derive(Debug, Default, Clone, Copy)]
pub struct Applied {
    pub bans: u64,
    pub unbans: u64,
    pub skipped: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_convert_between_clocks() {
        assert_eq!(mono_of_unix_ms(0), Some(0));
        assert_eq!(unix_ms_of_mono(0), 0);
        let now = unix_ms(SystemTime::now());
        assert_eq!(mono_of_unix_ms(now - 1000), None);
        let mono = mono_of_unix_ms(now + 60_000).unwrap();
        let back = unix_ms_of_mono(mono);
        assert!(
            back.abs_diff(now + 60_000) < 50,
            "{back} vs {}",
            now + 60_000
        );
    }

    #[test]
    fn records_round_trip_and_old_fields_default() {
        let r = Record {
            op: Op::Ban,
            net: "192.0.2.0/24".into(),
            exp_ms: 5,
            at_ms: 1,
            host: "a".into(),
            rule: Some("syn".into()),
            reason: None,
        };
        let s = serde_json::to_string(&r).unwrap();
        assert_eq!(serde_json::from_str::<Record>(&s).unwrap(), r);
        let u: Record =
            serde_json::from_str(r#"{"op":"unban","net":"::1/128","at_ms":2,"host":"b"}"#).unwrap();
        assert_eq!((u.op, u.exp_ms, u.rule), (Op::Unban, 0, None));
    }
}
