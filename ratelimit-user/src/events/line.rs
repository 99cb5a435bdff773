//! The lines' shapes: an event of the data plane or the operator, a change of the pressure
//! level or of the fleet store's health, the summary of a second's suppressed events.

use ratelimit_common::event::*;
use serde::Serialize;

use super::Tally;
use crate::policy::report::{client_label, key_name};

#[derive(Serialize, Debug, Clone)]
pub struct EventLine {
    pub time: String,
    pub event: &'static str,
    pub rule: String,
    pub key: &'static str,
    pub client: String,
    pub count: u64,
    pub threshold: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ban_expires: Option<String>,
    /// Fleet mode: the host that issued a ban installed (or an unban applied) here from the
    /// fleet; absent for this host's own.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub origin: Option<String>,
}

/// A change of the pressure level (`crate::policy::pressure`):
/// `{"time":..,"event":"pressure_high","mode":"auto","cause":"signal","signals":[{"signal":
/// "cpu_busy","value":0.93,"mark":0.8,"above":true}]}`. `signals` are those above their marks
/// at the change (none when it falls after the hold).
#[derive(Serialize, Debug, Clone)]
pub struct PressureLine {
    pub time: String,
    /// `pressure_high` or `pressure_low`.
    pub event: &'static str,
    pub mode: crate::policy::pressure::Mode,
    pub cause: crate::policy::pressure::Cause,
    pub signals: Vec<crate::policy::pressure::Reading>,
}

/// A change of the fleet store's health (the fleet module): `fleet_degraded` when the store
/// cannot be reached (with why, and since when), `fleet_restored` when it can again (with how
/// long it was out and the bans still waiting in the outbox to be sent).
#[derive(Serialize, Debug, Clone)]
pub struct FleetLine {
    pub time: String,
    /// `fleet_degraded`, `fleet_restored`, `fleet_clock_skew`, `fleet_clock_restored`,
    /// `fleet_duplicate_id` or `fleet_duplicate_id_cleared`.
    pub event: &'static str,
    pub store: String,
    pub host_id: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub since: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub down_for_ms: Option<u64>,
    pub outbox: usize,
    /// `fleet_clock_skew`, `fleet_clock_restored`: this host's clock minus the store's (ms),
    /// and `fleet.max_clock_skew` (ms).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub offset_ms: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_skew_ms: Option<u64>,
}

/// The summary line of a second in which events were suppressed ([`SUMMARY_EVENT`](super::SUMMARY_EVENT)).
#[derive(Serialize, Debug)]
pub(super) struct SummaryLine<'a> {
    pub(super) time: String,
    pub(super) event: &'static str,
    pub(super) count: u64,
    pub(super) threshold: u32,
    pub(super) events: &'a Tally,
}

pub fn kind_name(kind: u32) -> &'static str {
    match kind {
        EV_BAN => "ban",
        EV_UNBAN => "unban",
        EV_SOFT_LIMIT => "soft_limit",
        EV_THROTTLE_START => "throttle_start",
        EV_THROTTLE_END => "throttle_end",
        _ => "unknown",
    }
}

/// The line of `e`, its times formatted by `time` (monotonic ns to RFC 3339), so a batch of
/// events at the same few times can format each once.
pub fn line_with(
    e: &Event,
    rule_names: &[String],
    time: &mut dyn FnMut(u64) -> String,
) -> EventLine {
    let key = e.key();
    EventLine {
        time: time(e.ts_ns),
        event: kind_name(e.kind),
        // Empty for an operator's ban (`BAN_RULE_NONE`: no rule has that index).
        rule: rule_names.get(e.rule as usize).cloned().unwrap_or_default(),
        key: key_name(key.kind),
        client: client_label(&key),
        count: e.count,
        threshold: e.threshold,
        ban_expires: (e.kind == EV_BAN && e.expires_ns != 0).then(|| time(e.expires_ns)),
        origin: None,
    }
}
