//! A host-side model of the XDP program's whole verdict pipeline, for differential testing:
//! the fuzz test (`tests/tests/fuzz.rs`) runs the same frames through the real object with
//! BPF_PROG_TEST_RUN and through this model, and compares the XDP action and the deltas of
//! every per-CPU counter (`crate::stats`) frame by frame.
//!
//! It restates what `ratelimit-ebpf/src/{main,parse,limit}.rs` do, one function per stage
//! ([`parse_l2`], [`parse_ipv4`], [`parse_ipv6`], [`parse_l4`], [`Model::lists`],
//! [`Model::active_ban`], [`rule_matches`], [`Model::apply_rule`], [`limit_check`]), so a change
//! of semantics in one stage is a change of one function here. The arithmetic is not restated:
//! it is the same `crate::limiter` the program calls, and the model consumes the very map
//! values the daemon writes (`RuleConfig`, `GlobalConfig`, the sources trie's `ListValue`s,
//! `OverrideValue`s, `BanEntry`s), so the config → maps step is the real one too. The pressure
//! level is `GlobalConfig::relaxed`, as the program reads it: rules and overrides with
//! `elastic` meter against their elastic limit while it is set (`RuleConfig::limit_now`;
//! without elastic, that is the limit itself).
//!
//! What it leaves out, on purpose, because it cannot change a verdict or a counter of the
//! configurations it is meant for:
//! * The fast-drop tables (`fast.rs`): by design they give the verdicts and counters of the
//!   full evaluation, which is exactly what the comparison checks.
//! * Time: one `now` for a whole run. The caller keeps every window edge out of the run (see
//!   the fuzz test), uses token buckets of packets whose emission interval is longer than the
//!   run, and rules on the coarse clock. Bans do not expire within a run.
//! * The admission budget and store eviction: the caller configures no budget
//!   (`new_sources_per_sec = 0`) and a store far larger than the sources it sends, so every
//!   new key gets a state (`STATE_CREATED`), never `ADMISSION_REFUSED` or `STATE_EVICTED`.
//! * Events: they change no counter except `EVENTS_LOST`, which the caller prevents by
//!   draining the ring buffer.
//! * `key = "region"` rules (no GeoIP map): [`Model::new`] refuses them.
//! * Lost compare-and-swap races (`CONTENDED`): one CPU runs one frame at a time.

extern crate std;

use std::{collections::HashMap, format, string::String, vec::Vec};

use crate::{
    addr::{IpKey, V4_MAPPED_PREFIX, is_v6_bogon},
    caps::{MAX_IPV6_EXT_HEADERS, MAX_PORT_RANGES, MAX_RULES, MAX_VLAN_DEPTH, MAX_VLAN_WALK},
    limiter,
    maps::*,
    stats::{global, rule as rc},
};

pub use crate::proto::*;

/// XDP actions the program returns.
pub const XDP_DROP: u32 = 1;
pub const XDP_PASS: u32 = 2;

/// The parser's furthest header offset (`parse.rs`).
pub const MAX_L4_OFFSET: usize = 512;

const ETH_LEN: usize = 14;
const VLAN_LEN: usize = 4;
const IPV4_LEN: usize = 20;
const IPV6_LEN: usize = 40;

/// What the parser hands the policy (`parse::Parsed`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Parsed {
    pub src: IpKey,
    pub dport: u16,
    pub proto: u8,
    pub tcp_flags: u8,
    pub v4: bool,
    pub l4: bool,
    pub fragment: bool,
    pub l4_cut: bool,
    pub note: u32,
}

type Reason = u32;

/// The parser's one bounds check: `len` bytes at `off`.
fn hdr(f: &[u8], off: usize, len: usize) -> bool {
    off + len <= f.len()
}

fn be16(f: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([f[at], f[at + 1]])
}

/// What the parser made of a frame (`parse::Frame`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Frame {
    NonIp,
    /// An IP frame whose source cannot be read: the `MALFORMED_*` reason.
    Unreadable(Reason),
    /// An IPv6 frame from a bogon source.
    Bogon,
    Ip(Parsed),
}

pub fn parse(f: &[u8]) -> Frame {
    let (ethertype, off, note) = match parse_l2(f) {
        Ok(l2) => l2,
        Err(reason) => return Frame::Unreadable(reason),
    };
    let parsed = match ethertype {
        ETH_P_IP => parse_ipv4(f, off),
        ETH_P_IPV6 => parse_ipv6(f, off),
        _ => return Frame::NonIp,
    };
    match parsed {
        Ok(mut pkt) => {
            if pkt.note == 0 {
                pkt.note = note;
            }
            Frame::Ip(pkt)
        }
        Err(global::DROP_BOGON) => Frame::Bogon,
        Err(reason) => Frame::Unreadable(reason),
    }
}

/// Ethernet and up to `MAX_VLAN_WALK` tags: (inner ethertype, its offset, `MALFORMED_L2` as a
/// note when there were more than `MAX_VLAN_DEPTH`).
pub fn parse_l2(f: &[u8]) -> Result<(u16, usize, Reason), Reason> {
    if !hdr(f, 0, ETH_LEN) {
        return Err(global::MALFORMED_L2);
    }
    let is_vlan = |t: u16| t == ETH_P_8021Q || t == ETH_P_8021AD;
    let mut ethertype = be16(f, 12);
    let mut off = ETH_LEN;
    let mut tags = 0;
    for _ in 0..MAX_VLAN_WALK {
        if !is_vlan(ethertype) {
            break;
        }
        if !hdr(f, off, VLAN_LEN) {
            return Err(global::MALFORMED_L2);
        }
        ethertype = be16(f, off + 2);
        off += VLAN_LEN;
        tags += 1;
    }
    if is_vlan(ethertype) {
        return Err(global::MALFORMED_L2);
    }
    let note = if tags > MAX_VLAN_DEPTH {
        global::MALFORMED_L2
    } else {
        0
    };
    Ok((ethertype, off, note))
}

/// The source from the fixed header; a bad version, IHL or total length is noted and the
/// frame judged by L3 alone.
pub fn parse_ipv4(f: &[u8], off: usize) -> Result<Parsed, Reason> {
    const R: Reason = global::MALFORMED_IPV4;
    if !hdr(f, off, IPV4_LEN) {
        return Err(R);
    }
    let ver_ihl = f[off];
    let ihl = ((ver_ihl & 0x0f) as usize) * 4;
    let mut pkt = Parsed {
        src: IpKey::from_v4([f[off + 12], f[off + 13], f[off + 14], f[off + 15]]),
        proto: f[off + 9],
        v4: true,
        ..Parsed::default()
    };
    if ver_ihl >> 4 != 4 || ihl < IPV4_LEN || (be16(f, off + 2) as usize) < ihl {
        return Ok(cut(pkt, R));
    }
    pkt.fragment = be16(f, off + 6) & 0x1fff != 0;
    if !hdr(f, off, ihl) {
        return Ok(cut(pkt, R));
    }
    if !pkt.fragment {
        parse_l4(f, off + ihl, &mut pkt);
    }
    Ok(pkt)
}

fn is_ipv6_ext(proto: u8) -> bool {
    matches!(
        proto,
        IPPROTO_HOPOPTS | IPPROTO_ROUTING | IPPROTO_DSTOPTS | IPPROTO_AH | IPPROTO_FRAGMENT
    )
}

fn cut(mut pkt: Parsed, note: Reason) -> Parsed {
    pkt.l4_cut = true;
    pkt.note = note;
    pkt
}

pub fn parse_ipv6(f: &[u8], off: usize) -> Result<Parsed, Reason> {
    const R: Reason = global::MALFORMED_IPV6;
    if !hdr(f, off, IPV6_LEN) {
        return Err(R);
    }
    let mut src = [0u8; 16];
    src.copy_from_slice(&f[off + 8..off + 24]);
    if is_v6_bogon(&src) {
        return Err(global::DROP_BOGON);
    }
    let pkt = Parsed {
        src: IpKey::from_v6(src),
        proto: f[off + 6],
        ..Parsed::default()
    };
    if f[off] >> 4 != 6 {
        return Ok(cut(pkt, R));
    }
    let mut pkt = pkt;
    let mut off = off + IPV6_LEN;
    let mut done = false;
    for _ in 0..MAX_IPV6_EXT_HEADERS {
        let ext_len = match pkt.proto {
            IPPROTO_HOPOPTS | IPPROTO_ROUTING | IPPROTO_DSTOPTS | IPPROTO_AH => {
                if !hdr(f, off, 2) {
                    return Ok(cut(pkt, R));
                }
                let n = f[off + 1] as usize;
                let len = if pkt.proto == IPPROTO_AH {
                    (n + 2) * 4
                } else {
                    (n + 1) * 8
                };
                pkt.proto = f[off];
                len
            }
            IPPROTO_FRAGMENT => {
                if !hdr(f, off, 8) {
                    return Ok(cut(pkt, R));
                }
                pkt.proto = f[off];
                if be16(f, off + 2) & 0xfff8 != 0 {
                    pkt.fragment = true;
                    done = true;
                }
                8
            }
            _ => {
                done = true;
                0
            }
        };
        if pkt.fragment {
            return Ok(pkt);
        }
        if done {
            break;
        }
        if !hdr(f, off, ext_len) {
            return Ok(cut(pkt, R));
        }
        off += ext_len;
        if off > MAX_L4_OFFSET {
            return Ok(cut(pkt, global::IPV6_EXT_LIMIT));
        }
    }
    if !done && is_ipv6_ext(pkt.proto) {
        return Ok(cut(pkt, global::IPV6_EXT_LIMIT));
    }
    parse_l4(f, off, &mut pkt);
    Ok(pkt)
}

pub fn parse_l4(f: &[u8], off: usize, pkt: &mut Parsed) {
    const R: Reason = global::MALFORMED_L4;
    if off > MAX_L4_OFFSET {
        pkt.l4_cut = true;
        pkt.note = R;
        return;
    }
    let need = match pkt.proto {
        IPPROTO_TCP => 20,
        IPPROTO_UDP => 8,
        IPPROTO_ICMP | IPPROTO_ICMPV6 => 4,
        _ => return,
    };
    if !hdr(f, off, need) {
        pkt.l4_cut = true;
        pkt.note = R;
        return;
    }
    if pkt.proto == IPPROTO_TCP || pkt.proto == IPPROTO_UDP {
        pkt.dport = be16(f, off + 2);
    }
    if pkt.proto == IPPROTO_TCP {
        pkt.tcp_flags = f[off + 13];
    }
    pkt.l4 = true;
}

/// Protocol, destination ports and TCP flags (`rules::matches`).
pub fn rule_matches(rule: &RuleConfig, pkt: &Parsed) -> bool {
    if rule.protocol != PROTO_ANY && rule.protocol != pkt.proto {
        return false;
    }
    if rule.flags & RULE_TCP_FLAGS != 0 {
        if pkt.proto != PROTO_TCP {
            return false;
        }
        if pkt.l4 {
            if pkt.tcp_flags & rule.tcp_flags_mask != rule.tcp_flags_value {
                return false;
            }
        } else if !pkt.l4_cut {
            return false;
        }
    }
    if rule.port_count == 0 || pkt.fragment || pkt.l4_cut {
        return true;
    }
    if !pkt.l4 || (pkt.proto != PROTO_TCP && pkt.proto != PROTO_UDP) {
        return false;
    }
    let n = (rule.port_count as usize).min(MAX_PORT_RANGES);
    rule.ports[..n]
        .iter()
        .any(|r| pkt.dport >= r.lo && pkt.dport <= r.hi)
}

/// Whether `addr` lies in `prefix/plen` (16-byte keys, as in the LPM tries, where each
/// family is apart: an IPv6 prefix never covers an IPv4 address).
pub fn covers(prefix: &[u8; 16], plen: u32, addr: &[u8; 16]) -> bool {
    let (p, a) = (IpKey { addr: *prefix }, IpKey { addr: *addr });
    p.is_v4() == a.is_v4() && a.masked(plen) == p.masked(plen)
}

/// The policy as the daemon writes it into the maps.
#[derive(Clone, Debug, Default)]
pub struct Policy {
    pub global: GlobalConfig,
    pub rules: Vec<RuleConfig>,
    /// The sources trie (`RL_SOURCES`): (prefix length, prefix, value).
    pub sources: Vec<(u32, IpKey, ListValue)>,
    /// Per-CIDR overrides (`RL_OVERRIDES`): (rule, address prefix length, prefix, value).
    pub overrides: Vec<(u32, u32, IpKey, OverrideValue)>,
}

/// Counter deltas of one frame: packets and bytes of every global and per-rule counter of
/// interface slot 0.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Counters {
    pub global: [(u64, u64); global::COUNT as usize],
    pub rules: [[(u64, u64); rc::COUNT as usize]; MAX_RULES as usize],
}

impl Default for Counters {
    fn default() -> Self {
        Self {
            global: [(0, 0); global::COUNT as usize],
            rules: [[(0, 0); rc::COUNT as usize]; MAX_RULES as usize],
        }
    }
}

impl Counters {
    pub fn add(&mut self, counter: u32, len: u64) {
        let c = &mut self.global[counter as usize];
        c.0 += 1;
        c.1 += len;
    }

    pub fn add_rule(&mut self, rule: u32, counter: u32, len: u64) {
        let c = &mut self.rules[rule as usize][counter as usize];
        c.0 += 1;
        c.1 += len;
    }

    /// Add `other` to these.
    pub fn merge(&mut self, other: &Counters) {
        for (a, b) in self.global.iter_mut().zip(other.global.iter()) {
            a.0 += b.0;
            a.1 += b.1;
        }
        for (ra, rb) in self.rules.iter_mut().zip(other.rules.iter()) {
            for (a, b) in ra.iter_mut().zip(rb.iter()) {
                a.0 += b.0;
                a.1 += b.1;
            }
        }
    }

    /// Every non-zero counter as `name = packets/bytes`, for failure reports.
    pub fn describe(&self, rule_count: usize) -> Vec<String> {
        let mut out = Vec::new();
        for (i, c) in self.global.iter().enumerate() {
            if *c != (0, 0) {
                out.push(format!("{} = {}/{}", global::NAMES[i], c.0, c.1));
            }
        }
        for (r, counters) in self.rules.iter().enumerate().take(rule_count) {
            for (i, c) in counters.iter().enumerate() {
                if *c != (0, 0) {
                    out.push(format!("rule{r}/{} = {}/{}", rc::NAMES[i], c.0, c.1));
                }
            }
        }
        out
    }
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
                self.decide(&pkt, len, now, &mut o)
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
    fn decide(&mut self, pkt: &Parsed, len: u64, now: u64, o: &mut Outcome) -> u32 {
        let g = self.policy.global;
        let mut src_mask = None;
        if g.flags & (GLOBAL_HAS_ALLOW | GLOBAL_HAS_DENY) != 0 {
            let (flags, mask) = self.lists(&pkt.src);
            o.trace
                .push(format!("lists: flags {flags:#x}, rule sources {mask:#x}"));
            if flags & LIST_ALLOW != 0 {
                return global::PASS_ALLOW;
            }
            if flags & LIST_DENY != 0 {
                return global::DROP_DENY;
            }
            src_mask = Some(mask);
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
            if !rule_matches(&rule, pkt) {
                continue;
            }
            if rule.flags & RULE_SRC_MATCH != 0 {
                let mask = *src_mask.get_or_insert_with(|| self.lists(&pkt.src).1);
                if mask & (1 << i) == 0 {
                    continue;
                }
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

    /// The sources trie's longest match: (`LIST_*` flags, rules whose source list has `src`).
    pub fn lists(&self, src: &IpKey) -> (u32, u32) {
        self.policy
            .sources
            .iter()
            .filter(|(plen, p, _)| covers(&p.addr, *plen, &src.addr))
            .max_by_key(|(plen, _, _)| *plen)
            .map_or((0, 0), |(_, _, v)| (v.flags, v.rule_src_mask))
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

/// Rotate a window meter to `now` (`meters::rotate`, one CPU): the window index.
fn rotate(stamp: &mut u64, cur: &mut u64, prev: &mut u64, now: u64, interval: u64) -> u64 {
    let w = limiter::window_of(now, interval);
    let s = *stamp;
    if w > s || w.wrapping_add(1) < s {
        *stamp = w;
        let c = core::mem::take(cur);
        *prev = limiter::rotate(s, w, c, 0).1;
    }
    w
}

/// The offered-rate meter of a ban rule (`meters::rl_ban_meter`): over the ban threshold?
fn ban_meter(st: &mut ClientState, limit: &Limit, now: u64, cost: u64) -> bool {
    let interval = limit.ban_interval_ns;
    if interval == 0 {
        return false;
    }
    let w = rotate(
        &mut st.ban_stamp,
        &mut st.seen_cur,
        &mut st.seen_prev,
        now,
        interval,
    );
    st.seen_cur += cost;
    let seen = limiter::sliding_estimate(
        st.seen_prev,
        st.seen_cur,
        limiter::prev_weight_in(now, interval, w),
    );
    seen > limit.ban_threshold
}

/// The rule's algorithm (`meters::limit_check`, one CPU): admitted?
pub fn limit_check(
    st: &mut ClientState,
    algorithm: u8,
    limit: &Limit,
    now: u64,
    cost: u64,
) -> bool {
    let interval = limit.interval_ns;
    let threshold = limit.threshold;
    if interval == 0 || threshold == 0 {
        return true;
    }
    if algorithm == ALG_TOKEN_BUCKET {
        let inc = if cost == 1 {
            limit.gcra_inc_ns
        } else {
            limiter::gcra_increment(cost, threshold, interval)
        };
        return match limiter::gcra_admit(st.stamp, now, inc, limit.gcra_burst_ns) {
            None => {
                if let Some(c) = limiter::gcra_clamp(st.stamp, now, limit.gcra_burst_ns) {
                    st.stamp = c;
                }
                false
            }
            Some(new) => {
                st.stamp = new;
                true
            }
        };
    }
    let w = rotate(&mut st.stamp, &mut st.cur, &mut st.prev, now, interval);
    let weight = if algorithm == ALG_FIXED_WINDOW {
        0
    } else {
        limiter::prev_weight_in(now, interval, w)
    };
    let est = limiter::sliding_estimate(st.prev, st.cur, weight);
    if !limiter::sliding_admits(est, cost, threshold) {
        return false;
    }
    st.cur += cost;
    true
}

/// A frame as lowercase hex, 32 bytes a line, for failure reports and regression files.
pub fn hex_dump(frame: &[u8]) -> String {
    let mut s = String::new();
    for (i, chunk) in frame.chunks(32).enumerate() {
        s.push_str(&format!("{:04x}: ", i * 32));
        for b in chunk {
            s.push_str(&format!("{b:02x}"));
        }
        s.push('\n');
    }
    s
}

#[cfg(test)]
mod tests {
    use std::vec;

    use super::*;

    fn eth(ethertype: u16) -> Vec<u8> {
        let mut f = vec![0u8; 12];
        f.extend_from_slice(&ethertype.to_be_bytes());
        f
    }

    fn ipv4_udp(src: [u8; 4], dport: u16) -> Vec<u8> {
        let mut f = eth(ETH_P_IP);
        f.extend_from_slice(&[0x45, 0, 0, 28, 0, 0, 0, 0, 64, IPPROTO_UDP, 0, 0]);
        f.extend_from_slice(&src);
        f.extend_from_slice(&[198, 18, 0, 1]);
        f.extend_from_slice(&[0x9c, 0x40]);
        f.extend_from_slice(&dport.to_be_bytes());
        f.extend_from_slice(&[0, 8, 0, 0]);
        f
    }

    fn ip(p: Frame) -> Parsed {
        match p {
            Frame::Ip(p) => p,
            other => panic!("not judged: {other:?}"),
        }
    }

    #[test]
    fn parser_branches() {
        assert_eq!(parse(&eth(0x0806)), Frame::NonIp);
        assert_eq!(
            parse(&eth(ETH_P_IP)),
            Frame::Unreadable(global::MALFORMED_IPV4)
        );
        assert_eq!(
            parse(&eth(ETH_P_8021Q)),
            Frame::Unreadable(global::MALFORMED_L2)
        );
        let udp = ipv4_udp([198, 18, 1, 1], 53);
        let p = ip(parse(&udp));
        assert!(p.v4 && p.l4 && !p.l4_cut && p.dport == 53 && p.proto == IPPROTO_UDP);
        // Truncated UDP: judged by L3 with every L4 condition met.
        let p = ip(parse(&udp[..udp.len() - 1]));
        assert!(p.l4_cut && !p.l4 && p.note == global::MALFORMED_L4);
        // Total length shorter than the header: still judged by its source.
        let mut bad = udp.clone();
        bad[17] = 19;
        let p = ip(parse(&bad));
        assert!(p.l4_cut && p.note == global::MALFORMED_IPV4);
        assert_eq!(p.src, IpKey::from_v4([198, 18, 1, 1]));
        // Three tags: one more than a valid frame has, judged by its source.
        let tagged = |n: usize| {
            let mut q = eth(ETH_P_8021AD);
            for _ in 1..n {
                q.extend_from_slice(&[0, 1]);
                q.extend_from_slice(&ETH_P_8021Q.to_be_bytes());
            }
            q.extend_from_slice(&[0, 1]);
            q.extend_from_slice(&ETH_P_IP.to_be_bytes());
            q.extend_from_slice(&udp[14..]);
            q
        };
        assert_eq!(ip(parse(&tagged(2))).note, 0);
        assert_eq!(ip(parse(&tagged(3))).note, global::MALFORMED_L2);
        assert_eq!(
            parse(&tagged(MAX_VLAN_WALK + 1)),
            Frame::Unreadable(global::MALFORMED_L2)
        );
    }

    #[test]
    fn ipv6_bogon_sources_are_dropped_first() {
        let mut f = eth(ETH_P_IPV6);
        f.extend_from_slice(&[0x60, 0, 0, 0, 0, 8, IPPROTO_UDP, 64]);
        f.extend_from_slice(&[0u8; 15]);
        f.push(1); // ::1
        f.extend_from_slice(&[0x20, 0x01, 0x0d, 0xb8]);
        f.extend_from_slice(&[0u8; 12]);
        f.extend_from_slice(&[0x9c, 0x40, 0x23, 0x28, 0, 8, 0, 0]);
        assert_eq!(parse(&f), Frame::Bogon);
        f[14 + 8 + 15] = 0;
        f[14 + 8 + 7] = 1; // ::1:0:0:0:0 is no bogon
        assert!(matches!(parse(&f), Frame::Ip(_)));
    }

    fn policy(rule: RuleConfig) -> Policy {
        Policy {
            global: GlobalConfig {
                rule_count: 1,
                store_sets: 1,
                ..GlobalConfig::default()
            },
            rules: vec![rule],
            ..Policy::default()
        }
    }

    #[test]
    fn a_fixed_window_admits_exactly_its_threshold_per_source() {
        let rule = RuleConfig {
            key: KEY_IP,
            algorithm: ALG_FIXED_WINDOW,
            protocol: PROTO_UDP,
            v4_prefix: 24,
            v6_prefix: 64,
            limit: Limit {
                threshold: 3,
                interval_ns: 3_600_000_000_000,
                ..Limit::default()
            },
            ..RuleConfig::default()
        };
        let mut m = Model::new(policy(rule)).unwrap();
        let now = 10 * 3_600_000_000_000 + 5;
        let mut total = Counters::default();
        for i in 0..5u8 {
            // Same /24: one key.
            let o = m.run(&ipv4_udp([198, 18, 1, i], 53), now);
            assert_eq!(o.action, if i < 3 { XDP_PASS } else { XDP_DROP });
            total.merge(&o.counters);
        }
        assert_eq!(total.global[global::STATE_CREATED as usize], (1, 0));
        assert_eq!(total.global[global::PASS as usize].0, 3);
        assert_eq!(total.global[global::DROP_RULE as usize].0, 2);
        assert_eq!(total.rules[0][rc::MATCHED as usize].0, 5);
        assert_eq!(total.rules[0][rc::DROPPED as usize].0, 2);
        assert_eq!(m.tracked_sources(), 1);
    }

    #[test]
    fn a_ban_rule_bans_its_key_and_the_ban_drops_before_the_rules() {
        let rule = RuleConfig {
            key: KEY_IP,
            action: ACTION_BAN,
            algorithm: ALG_FIXED_WINDOW,
            v4_prefix: 32,
            v6_prefix: 64,
            limit: Limit {
                threshold: 2,
                interval_ns: 3_600_000_000_000,
                ban_threshold: 3,
                ban_interval_ns: 3_600_000_000_000,
                ban_duration_ns: 3_600_000_000_000,
                ..Limit::default()
            },
            ..RuleConfig::default()
        };
        let mut m = Model::new(policy(rule)).unwrap();
        let now = 7 * 3_600_000_000_000;
        let f = ipv4_udp([198, 18, 9, 9], 53);
        let actions: Vec<u32> = (0..6).map(|_| m.run(&f, now).action).collect();
        // 2 admitted, 1 over the threshold, the 4th crosses the ban threshold, then banned.
        assert_eq!(
            actions,
            [XDP_PASS, XDP_PASS, XDP_DROP, XDP_DROP, XDP_DROP, XDP_DROP]
        );
        let o = m.run(&f, now);
        assert_eq!(o.counters.global[global::DROP_BAN as usize].0, 1);
        assert_eq!(o.counters.rules[0][rc::MATCHED as usize].0, 0);
    }
}
