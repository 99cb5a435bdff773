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

/// Whether any of `rules` keeps states in `RL_KEYED`.
pub fn any_keyed(rules: &[RuleConfig]) -> bool {
    rules.iter().any(|r| r.key == KEY_TUPLE)
}

/// Whether the state `s` of a key of rule `rule` holds nothing at `now_ns`
/// (CLOCK_MONOTONIC): its last packet more than the rule's `protect_ms` ago, no ban in force.
/// A state of a rule that is gone (no `rule`) holds nothing either.
pub fn idle(s: &SharedState, rule: Option<&RuleConfig>, now_ns: u64) -> bool {
    let memory_ns = rule.map_or(0, |r| u64::from(r.protect_ms) * 1_000_000);
    s.banned_until_ns <= now_ns && s.state.last_ns.saturating_add(memory_ns) < now_ns
}

/// Remove the idle states of `map` (see [`idle`]) at `now_ns`, `rules` being the rules in
/// force by position. Returns how many went.
pub fn reap(
    map: &mut HashMap<MapData, ClientKey, SharedState>,
    rules: &[RuleConfig],
    now_ns: u64,
) -> u64 {
    let gone: Vec<ClientKey> = map
        .iter()
        .filter_map(Result::ok)
        .filter(|(k, s)| idle(s, rules.get(k.rule as usize), now_ns))
        .map(|(k, _)| k)
        .collect();
    // A packet between the look and the removal makes the state new again: it was idle
    // for longer than it could remember, so that packet is counted in a fresh one.
    gone.iter().filter(|k| map.remove(k).is_ok()).count() as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_state_is_idle_after_its_rules_memory_and_not_while_banned() {
        let rule = RuleConfig {
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
        assert!(
            idle(&s(10 * sec, 0), None, 10 * sec + 1),
            "its rule is gone"
        );
        assert!(!idle(&s(u64::MAX, 0), Some(&rule), u64::MAX), "no overflow");
    }
}
