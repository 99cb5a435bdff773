//! The program's verdict pipeline (`ratelimit-ebpf/src/program.rs`) over the policy the daemon
//! writes: lists, bans, then the rules in order, with the per-client state stores.

extern crate std;

use std::{collections::HashMap, format, string::String, vec::Vec};

use crate::{
    addr::{IpKey, V4_MAPPED_PREFIX},
    caps::MAX_RULES,
    limiter,
    maps::*,
    stats::{global, rule as rc},
};

use super::counters::Counters;
use super::meters::{ban_meter, limit_check};
use super::parse::{Frame, Parsed, parse};
use super::rules::{Fetched, covers, fetch, rule_matches};
use super::{XDP_DROP, XDP_PASS};

/// The policy as the daemon writes it into the maps.
#[derive(Clone, Debug, Default)]
pub struct Policy {
    pub global: GlobalConfig,
    pub rules: Vec<RuleConfig>,
    /// The sources trie (`RL_SOURCES`): (prefix length, prefix, value).
    pub sources: Vec<(u32, IpKey, ListValue)>,
    /// The destinations trie (`RL_DESTS`): (prefix length, prefix, rules whose `dst` holds it).
    pub dests: Vec<(u32, IpKey, u32)>,
    /// Per-CIDR overrides (`RL_OVERRIDES`): (rule, address prefix length, prefix, value).
    pub overrides: Vec<(u32, u32, IpKey, OverrideValue)>,
}
/// The model's answer for one frame.
#[derive(Clone, Debug)]
pub struct Outcome {
    /// `XDP_PASS` or `XDP_DROP`.
    pub action: u32,
    pub counters: Counters,
    /// How the model reached the verdict, one step a line.
    pub trace: Vec<String>,
}

/// What a rule says of a packet it matched (`rules::RuleVerdict`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum RuleVerdict {
    Pass,
    Drop,
}

/// The per-client state stores of the program (`RL_CLIENTS` and `RL_SHARED`) and the ban
/// trie, with the policy.
#[derive(Clone, Debug)]
pub struct Model {
    pub policy: Policy,
    /// The ban tables (`RL_BANS_OPERATOR`, `RL_BANS`, `RL_BANS_REMOTE`, `RL_BANS_PASSING`: by
    /// `ban_table`),
    /// keyed by (table, prefix length, masked address).
    pub bans: HashMap<(u32, u32, [u8; 16]), BanEntry>,
    clients: HashMap<ClientKey, ClientState>,
    shared: HashMap<ClientKey, SharedState>,
}

impl Model {
    /// A model of a freshly loaded program with `policy` applied.
    pub fn new(policy: Policy) -> Result<Self, String> {
        if policy.rules.len() != policy.global.rule_count as usize {
            return Err("rule_count does not match the rules".into());
        }
        if let Some(i) = policy.rules.iter().position(|r| r.key == KEY_REGION) {
            return Err(format!("rule {i}: key = region is not modelled"));
        }
        if policy.global.admission_inc_ns != 0 || policy.global.admission_tick_cap != 0 {
            return Err("the admission budget is not modelled (new_sources_per_sec = 0)".into());
        }
        if policy.global.store_sets == 0 {
            return Err("the per-source store has no sets".into());
        }
        if policy.global.preview_all != 0 {
            return Err("preview_all is not modelled".into());
        }
        if let Some(i) = policy
            .rules
            .iter()
            .position(|r| r.flags & RULE_TCP_STATE != 0)
        {
            return Err(format!(
                "rule {i}: tcp_state (a socket lookup) is not modelled"
            ));
        }
        Ok(Self {
            policy,
            bans: HashMap::new(),
            clients: HashMap::new(),
            shared: HashMap::new(),
        })
    }

    /// A ban the daemon inserts (an operator's, as `ratelimit ban add` does, or one from the
    /// fleet), in the table its flags name.
    pub fn insert_ban(&mut self, entry: BanEntry) {
        let key = IpKey { addr: entry.addr }.masked(entry.prefix_len).addr;
        self.bans
            .insert((ban_table(entry.flags), entry.prefix_len, key), entry);
    }

    /// Per-source keys (`KEY_IP`) holding state.
    pub fn tracked_sources(&self) -> usize {
        self.clients.len()
    }

    /// One frame through the program (`ratelimit-ebpf/src/program.rs`): the XDP action and the counters it bumps.
    pub fn run(&mut self, frame: &[u8], now: u64) -> Outcome {
        let mut o = Outcome {
            action: XDP_PASS,
            counters: Counters::default(),
            trace: Vec::new(),
        };
        let len = frame.len() as u64;
        let verdict = match parse(frame) {
            Frame::NonIp => {
                o.trace.push("parse: not IP".into());
                global::PASS_NON_IP
            }
            Frame::Bogon => {
                o.trace.push("parse: IPv6 bogon source".into());
                global::DROP_BOGON
            }
            Frame::Unreadable(reason) => {
                o.trace.push(format!(
                    "parse: malformed ({})",
                    global::NAMES[reason as usize]
                ));
                o.counters.add(reason, len);
                global::PASS_MALFORMED
            }
            Frame::Ip(pkt) => {
                o.trace.push(format!("parse: {pkt:?}"));
                if pkt.note != 0 {
                    o.counters.add(pkt.note, len);
                }
                if pkt.fragment {
                    o.counters.add(global::FRAGMENTS, len);
                }
                let fetched = fetch(&self.policy.global, frame, &pkt);
                self.decide(&pkt, &fetched, len, now, &mut o)
            }
        };
        o.counters.add(verdict, len);
        o.action = match verdict {
            global::DROP_DENY | global::DROP_BAN | global::DROP_RULE | global::DROP_BOGON => {
                XDP_DROP
            }
            _ => XDP_PASS,
        };
        o.trace
            .push(format!("verdict: {}", global::NAMES[verdict as usize]));
        o
    }

    /// Lists → bans → rules (`program.rs::decide`): the verdict counter.
    fn decide(
        &mut self,
        pkt: &Parsed,
        fetched: &Fetched,
        len: u64,
        now: u64,
        o: &mut Outcome,
    ) -> u32 {
        let g = self.policy.global;
        let mut src_list = None;
        if g.flags & (GLOBAL_HAS_ALLOW | GLOBAL_HAS_DENY) != 0 {
            let v = self.lists(&pkt.src);
            o.trace.push(format!(
                "lists: flags {:#x}, rule sources {:#x}, except {:#x}",
                v.flags, v.rule_src_mask, v.rule_except_mask
            ));
            if v.flags & LIST_ALLOW != 0 {
                return global::PASS_ALLOW;
            }
            if v.flags & LIST_DENY != 0 {
                return global::DROP_DENY;
            }
            src_list = Some(v);
        }
        let mut ban_matched = false;
        if let Some(flags) = self.active_ban(&pkt.src, now) {
            o.trace.push(format!("ban: flags {flags:#x}"));
            if flags & (BAN_PREVIEW | BAN_EXCEED_PASS) == 0 {
                return global::DROP_BAN;
            }
            o.counters.add(global::BAN_PASS, len);
            if flags & BAN_PREVIEW != 0 {
                o.counters.add(global::PREVIEW_WOULD_DROP, len);
            }
            ban_matched = true;
        }
        let _ = ban_matched; // Only decides whether a fast-drop entry is made.
        for i in 0..g.rule_count.min(MAX_RULES) {
            let rule = self.policy.rules[i as usize];
            if !rule_matches(&rule, pkt, fetched) {
                continue;
            }
            if rule.flags & (RULE_SRC_MATCH | RULE_EXCEPT) != 0 {
                let v = *src_list.get_or_insert_with(|| self.lists(&pkt.src));
                if rule.flags & RULE_SRC_MATCH != 0 && v.rule_src_mask & (1 << i) == 0 {
                    continue;
                }
                if v.rule_except_mask & (1 << i) != 0 {
                    continue;
                }
            }
            if rule.flags & RULE_DST_MATCH != 0 && self.dests(&pkt.dst) & (1 << i) == 0 {
                continue;
            }
            o.counters.add_rule(i, rc::MATCHED, len);
            let v = self.apply_rule(i, &rule, pkt, len, now, o);
            o.trace.push(format!("rule {i}: {v:?}"));
            if v == RuleVerdict::Drop {
                return global::DROP_RULE;
            }
        }
        global::PASS
    }

    /// The sources trie's longest match covering `src`.
    pub fn lists(&self, src: &IpKey) -> ListValue {
        self.policy
            .sources
            .iter()
            .filter(|(plen, p, _)| covers(&p.addr, *plen, &src.addr))
            .max_by_key(|(plen, _, _)| *plen)
            .map_or(ListValue::default(), |(_, _, v)| *v)
    }

    /// The destinations trie's longest match: the rules whose `dst` list holds `dst`.
    pub fn dests(&self, dst: &IpKey) -> u32 {
        self.policy
            .dests
            .iter()
            .filter(|(plen, p, _)| covers(&p.addr, *plen, &dst.addr))
            .max_by_key(|(plen, _, _)| *plen)
            .map_or(0, |(_, _, v)| *v)
    }

    /// One ban table's longest match covering `src` (in its family).
    fn ban_lookup(&self, table: u32, src: &IpKey) -> Option<BanEntry> {
        (0..=128u32).rev().find_map(|p| {
            let e = self.bans.get(&(table, p, src.masked(p).addr))?;
            covers(&e.addr, p, &src.addr).then_some(*e)
        })
    }

    /// The flags of the ban that decides for `src` (`bans::active_ban`): the operator's
    /// table, then the rules' bans that drop, then the fleet's (which drop), then those that
    /// pass; the first match decides.
    pub fn active_ban(&mut self, src: &IpKey, now: u64) -> Option<u32> {
        for table in [
            BAN_TABLE_OPERATOR,
            BAN_TABLE_RULE,
            BAN_TABLE_REMOTE,
            BAN_TABLE_PASSING,
        ] {
            if let Some(entry) = self.ban_lookup(table, src) {
                if !limiter::ban_active(entry.expires_ns, now) {
                    // The caller keeps bans from expiring within a run (see the module comment).
                    panic!("a ban expired within the run: {entry:?}");
                }
                return Some(entry.flags);
            }
        }
        None
    }

    /// The most specific per-CIDR override of rule `i` covering `src`.
    fn cidr_override(&self, i: u32, src: &IpKey) -> Option<Limit> {
        self.policy
            .overrides
            .iter()
            .filter(|(r, plen, p, _)| *r == i && covers(&p.addr, *plen, &src.addr))
            .max_by_key(|(_, plen, _, _)| *plen)
            .map(|(_, _, _, v)| *v.limit_now(self.policy.global.relaxed != 0))
    }

    /// One matching rule for one packet (`rules::apply`).
    fn apply_rule(
        &mut self,
        i: u32,
        rule: &RuleConfig,
        pkt: &Parsed,
        len: u64,
        now: u64,
        o: &mut Outcome,
    ) -> RuleVerdict {
        let cost = if rule.flags & RULE_BYTES != 0 { len } else { 1 };
        let mut key = ClientKey {
            rule: i as u8,
            kind: rule.key,
            ..ClientKey::default()
        };
        let mut limit = *rule.limit_now(self.policy.global.relaxed != 0);
        if rule.key == KEY_IP {
            let plen = if pkt.v4 {
                V4_MAPPED_PREFIX + rule.v4_prefix as u32
            } else {
                rule.v6_prefix as u32
            };
            key.prefix_len = plen;
            key.addr = pkt.src.masked(plen).addr;
        } else if rule.key == KEY_TUPLE {
            let plen = if pkt.v4 {
                V4_MAPPED_PREFIX + rule.v4_prefix as u32
            } else {
                rule.v6_prefix as u32
            };
            key = ClientKey::tuple(
                i as u8,
                rule.key_fields,
                &pkt.src.masked(plen).addr,
                &pkt.dst.addr,
                pkt.dport,
                pkt.sport,
                pkt.proto,
            );
        }
        if rule.flags & RULE_CIDR_OVERRIDES != 0
            && let Some(l) = self.cidr_override(i, &pkt.src)
        {
            limit = l;
        }
        let preview = rule.flags & RULE_PREVIEW != 0;
        let exceed_pass = rule.flags & RULE_EXCEED_PASS != 0;
        let ban_flags =
            if preview { BAN_PREVIEW } else { 0 } | if exceed_pass { BAN_EXCEED_PASS } else { 0 };
        let is_ban = rule.action == ACTION_BAN;
        let exceeded = |o: &mut Outcome, drop_counter: u32| {
            if preview {
                o.counters.add_rule(i, rc::WOULD_DROP, len);
                o.counters.add(global::PREVIEW_WOULD_DROP, len);
                RuleVerdict::Pass
            } else if exceed_pass {
                o.counters.add_rule(i, rc::EXCEED_PASSED, len);
                o.counters.add(global::EXCEED_PASS, len);
                RuleVerdict::Pass
            } else {
                o.counters.add_rule(i, drop_counter, len);
                RuleVerdict::Drop
            }
        };
        // The state: the source's own (created on its first packet), or the shared key's.
        let created;
        let (st, until) = if key.kind == KEY_IP {
            created = !self.clients.contains_key(&key);
            (self.clients.entry(key).or_default(), None)
        } else {
            created = !self.shared.contains_key(&key);
            let s = self.shared.entry(key).or_default();
            (&mut s.state, Some(&mut s.banned_until_ns))
        };
        if created {
            o.counters.add(global::STATE_CREATED, 0);
            o.trace.push(format!("rule {i}: new state {key:?}"));
        }
        st.packets += 1;
        st.bytes += len;
        // An aggregate key's ban lives in its state.
        if is_ban && let Some(u) = &until {
            let u = **u;
            if u != 0 && now < u {
                st.drops += 1;
                return exceeded(o, rc::BANNED_DROPPED);
            }
        }
        if is_ban && ban_meter(st, &limit, now, cost) {
            let expires = limiter::ban_expiry(now, limit.ban_duration_ns);
            let issued = match until {
                None => {
                    // BPF_NOEXIST: a ban already at this exact prefix, in the table this
                    // one belongs in, is left as it is.
                    match self
                        .bans
                        .entry((ban_table(ban_flags), key.prefix_len, key.addr))
                    {
                        std::collections::hash_map::Entry::Occupied(_) => false,
                        std::collections::hash_map::Entry::Vacant(v) => {
                            v.insert(BanEntry {
                                expires_ns: expires,
                                since_ns: now,
                                rule: i,
                                flags: ban_flags,
                                prefix_len: key.prefix_len,
                                _pad: 0,
                                addr: key.addr,
                            });
                            true
                        }
                    }
                }
                Some(u) => {
                    if *u == 0 {
                        *u = if expires == 0 { u64::MAX } else { expires };
                        true
                    } else {
                        false
                    }
                }
            };
            o.trace.push(format!(
                "rule {i}: over the ban threshold, ban {}",
                if issued { "issued" } else { "already there" }
            ));
            if issued {
                st.cur = 0;
                st.prev = 0;
                st.seen_cur = 0;
                st.seen_prev = 0;
                if rule.algorithm == ALG_TOKEN_BUCKET {
                    st.stamp = 0;
                }
                st.drops += 1;
                o.counters.add(global::BANS_ISSUED, 0);
                o.counters.add_rule(i, rc::BANS, 0);
            }
            return exceeded(o, rc::DROPPED);
        }
        if limit_check(st, rule.algorithm, &limit, now, cost) {
            o.counters.add_rule(i, rc::ADMITTED, len);
            return RuleVerdict::Pass;
        }
        st.drops += 1;
        exceeded(o, rc::DROPPED)
    }
}
