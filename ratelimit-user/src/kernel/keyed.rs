//! The states of keys of packet fields (`RL_KEYED`: `key = "dst"`, `key = ["ip",
//! "dst_port"]`, ...) that no longer hold anything, removed. The program creates one for every
//! new combination of fields it meets and never removes one; a sender chooses its source
//! port and, with `ip` in the key, its source address, so without this a flood of spoofed
//! combinations would fill the map for good, and every new key after it would share the
//! rule's overflow state. A state whose last packet is older than what it can still remember
//! (its rule's `protect_ms`: two intervals for a sliding window, the burst for a token bucket,
//! two ban intervals for the ban meter) and that holds no ban in force is worth no more than
//! a fresh one: removing it resets nothing, as the per-source store's eviction does.

use std::{path::Path, time::Duration};

use anyhow::Context as _;
use aya::maps::{HashMap, Map, MapData};
use ratelimit_common::maps::{ClientKey, KEY_TUPLE, RuleConfig, SharedState};

/// How often the idle states are looked for.
pub const PERIOD: Duration = Duration::from_secs(5);

/// A handle of `RL_KEYED` of its own, from the pins in `pin_dir`.
pub fn open(pin_dir: &Path) -> anyhow::Result<HashMap<MapData, ClientKey, SharedState>> {
    let path = pin_dir.join("RL_KEYED");
    let map = MapData::from_pin(&path).with_context(|| format!("opening {}", path.display()))?;
    Ok(HashMap::try_from(Map::HashMap(map))?)
}

/// Whether the state `s` of a key of rule `rule` (the rule in force at the key's position, if
/// any) holds nothing at `now_ns` (CLOCK_MONOTONIC): its last packet more than the rule's
/// `protect_ms` ago and no ban in force, or its rule no longer keyed by packet fields (the
/// program no longer counts in it). A state whose rule is not known (a rule added since the
/// rules were read) or whose memory is not known (`protect_ms` 0) is kept.
pub fn idle(s: &SharedState, rule: Option<&RuleConfig>, now_ns: u64) -> bool {
    match rule {
        None => false,
        Some(r) if r.key != KEY_TUPLE => true,
        Some(r) if r.protect_ms == 0 => false,
        Some(r) => {
            let memory_ns = u64::from(r.protect_ms) * 1_000_000;
            s.banned_until_ns <= now_ns && s.state.last_ns.saturating_add(memory_ns) < now_ns
        }
    }
}

/// A state removed: its key, and the end of the ban it held, if it held one (ended: the
/// program sends a ban's `unban` only when the key's next packet comes, which for this key
/// it never will; the caller says so).
pub type Reaped = (ClientKey, Option<u64>);

/// Remove the idle states of `map` (see [`idle`]) at `now_ns`, `rules` being the rules in
/// force by position. Each is judged again just before its removal (a walk of a full map takes
/// a while), so a state that took a packet or a ban in between stays.
pub fn reap(
    map: &mut HashMap<MapData, ClientKey, SharedState>,
    rules: &[RuleConfig],
    now_ns: u64,
) -> Vec<Reaped> {
    let idle_now = |k: &ClientKey, s: &SharedState| idle(s, rules.get(k.rule as usize), now_ns);
    let candidates: Vec<ClientKey> = map
        .iter()
        .filter_map(Result::ok)
        .filter(|(k, s)| idle_now(k, s))
        .map(|(k, _)| k)
        .collect();
    let mut gone = Vec::new();
    for k in candidates {
        let Ok(s) = map.get(&k, 0) else { continue };
        // A packet between this look and the removal is counted in a fresh state: this one
        // was idle for longer than it could remember.
        if idle_now(&k, &s) && map.remove(&k).is_ok() {
            gone.push((k, (s.banned_until_ns != 0).then_some(s.banned_until_ns)));
        }
    }
    gone
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_state_is_idle_after_its_rules_memory_and_not_while_banned() {
        let rule = RuleConfig {
            key: KEY_TUPLE,
            protect_ms: 2_000,
            ..RuleConfig::default()
        };
        let s = |last_ns: u64, banned_until_ns: u64| {
            let mut s = SharedState {
                banned_until_ns,
                ..SharedState::default()
            };
            s.state.last_ns = last_ns;
            s
        };
        let sec = 1_000_000_000;
        assert!(
            !idle(&s(10 * sec, 0), Some(&rule), 12 * sec),
            "two seconds: not yet"
        );
        assert!(idle(&s(10 * sec, 0), Some(&rule), 12 * sec + 1));
        assert!(
            !idle(&s(10 * sec, 14 * sec), Some(&rule), 14 * sec - 1),
            "a ban in force"
        );
        assert!(
            idle(&s(10 * sec, 14 * sec), Some(&rule), 14 * sec),
            "a ban that ended"
        );
        assert!(!idle(&s(0, 0), None, 10 * sec), "a rule not known yet");
        let zero = RuleConfig {
            protect_ms: 0,
            ..rule
        };
        assert!(!idle(&s(0, 0), Some(&zero), 10 * sec), "a memory not known");
        let ip = RuleConfig {
            key: ratelimit_common::maps::KEY_IP,
            ..rule
        };
        assert!(
            idle(&s(10 * sec, 14 * sec), Some(&ip), 11 * sec),
            "no longer keyed so"
        );
        assert!(!idle(&s(u64::MAX, 0), Some(&rule), u64::MAX), "no overflow");
    }
}
