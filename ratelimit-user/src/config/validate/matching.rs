//! A rule's `match` table and its `except` list: each field read, then the combinations
//! that could never match refused (ports without TCP or UDP, ICMP types without ICMP,
//! `tcp_state` with a SYN, ...), so a rule that checks out can match something.

use ipnet::IpNet;
use ratelimit_common::caps;

use super::counts::Totals;
use super::{int_in, keyword, net};
use crate::config::tree::{Checker, Field, Node, Table};
use crate::config::values::{TcpFlags, check_port};
use crate::config::{
    Fragment, Match, Payload, PayloadFrom, Protocol, TcpState, parse_hex_bytes, parse_port_range,
    parse_range, parse_tcp_flags,
};

pub(super) fn matcher(mut t: Table, tot: &mut Totals, ck: &mut Checker) -> Match {
    let mut m = Match::default();
    // Err: the protocol was given but is invalid; no follow-on errors then.
    let protocol = match t.get("protocol") {
        None => Ok(None),
        Some(f) => keyword::<Protocol>(&f, ck).map(Some).ok_or(()),
    };
    m.protocol = protocol.unwrap_or(None);
    let needs = |f: &Field, ck: &mut Checker, ok: fn(Protocol) -> bool, what: &str| {
        if matches!(protocol, Ok(p) if !p.is_some_and(ok)) {
            f.error_at_key(ck, format!("needs match.protocol = {what}"));
        }
    };
    let tcp = |p: Protocol| p == Protocol::Tcp;
    let icmp = |p: Protocol| matches!(p, Protocol::Icmp | Protocol::Icmpv6);

    if let Some(f) = t.get("tcp_flags") {
        needs(&f, ck, tcp, "\"tcp\"");
        if let Some(s) = f.str(ck) {
            m.tcp_flags = parse_tcp_flags(s).map_err(|e| f.invalid(ck, e)).ok();
        }
    }
    for (name, out, max) in [
        ("dst_ports", &mut m.dst_ports, caps::MAX_PORT_RANGES),
        ("src_ports", &mut m.src_ports, caps::MAX_SRC_PORT_RANGES),
    ] {
        if let Some(f) = t.get(name) {
            needs(&f, ck, Protocol::has_ports, "\"tcp\" or \"udp\"");
            *out = ports(&f, ck, max);
        }
    }
    if let Some(f) = t.get("src") {
        m.src = nets(&f, ck, "source", &mut tot.src, &mut tot.src_reported);
    }
    if let Some(f) = t.get("dst") {
        let (set, reported) = (&mut tot.dst, &mut tot.dst_reported);
        m.dst = nets(&f, ck, "destination", set, reported);
    }
    if let Some(f) = t.get("length") {
        m.length = ranges(&f, ck, "length", 20, 65535)
            .into_iter()
            .map(|(lo, hi)| (lo as u16, hi as u16))
            .collect();
    }
    if let Some(f) = t.get("ttl") {
        m.ttl = ranges(&f, ck, "TTL", 0, 255)
            .into_iter()
            .map(|(lo, hi)| (lo as u8, hi as u8))
            .collect();
    }
    let fragment_field = t.get("fragment");
    m.fragment = fragment_field.as_ref().and_then(|f| keyword(f, ck));
    for (name, out) in [
        ("icmp_types", &mut m.icmp_types),
        ("icmp_codes", &mut m.icmp_codes),
    ] {
        if let Some(f) = t.get(name) {
            needs(&f, ck, icmp, "\"icmp\" or \"icmpv6\"");
            *out = numbers(&f, ck);
        }
    }
    if let Some(f) = t.get("payload") {
        m.payload = payloads(&f, tot, ck);
    }
    if let Some(f) = t.get("tcp_state") {
        needs(&f, ck, tcp, "\"tcp\"");
        m.tcp_state = keyword::<TcpState>(&f, ck);
        let syn = m
            .tcp_flags
            .is_some_and(|fl| fl.mask & fl.value & TcpFlags::SYN != 0);
        if syn {
            f.error_at_key(
                ck,
                "= \"no_connection\" never matches a SYN (tcp_flags asks for one): a SYN \
                 opens a connection, it does not belong to one",
            );
        }
    }
    if let (Some(f), Some(Fragment::Later)) = (&fragment_field, m.fragment)
        && (m.tcp_flags.is_some() || m.tcp_state.is_some())
    {
        f.error_at_key(
            ck,
            "= \"later\" never matches with tcp_flags or tcp_state: a non-first \
             fragment carries no TCP header",
        );
    }
    t.finish(ck);
    m
}

/// The items of the list `f` (none if it is not one, said so); an empty list is refused:
/// leaving the key out is how a rule matches `any`.
fn listed<'a>(f: &Field<'a>, ck: &mut Checker, any: &str) -> Vec<Field<'a>> {
    let Some(items) = f.array(ck) else {
        return Vec::new();
    };
    if items.is_empty() {
        f.error(
            ck,
            format!("must not be empty; leave it out to match {any}"),
        );
    }
    items
}

/// A rule's `except`: source networks it never matches.
pub(super) fn except(f: &Field, tot: &mut Totals, ck: &mut Checker) -> Vec<IpNet> {
    nets(f, ck, "source", &mut tot.src, &mut tot.src_reported)
}

/// `dst_ports` / `src_ports`: at most `max` ports or ranges.
fn ports(f: &Field, ck: &mut Checker, max: usize) -> Vec<(u16, u16)> {
    let mut out = Vec::new();
    let items = listed(f, ck, "any port");
    for (i, e) in items.iter().enumerate() {
        let range = match e.node() {
            Node::Int(n) => check_port(*n).map(|p| (p, p)),
            Node::Str(s) => parse_port_range(s),
            _ => {
                e.expected(ck, "a port number or a string such as \"8000-8100\"");
                continue;
            }
        };
        match range {
            Err(msg) => e.invalid(ck, msg),
            Ok(_) if i == max => e.invalid(ck, format!("too many port ranges; at most {max} fit")),
            Ok(r) if i < max => out.push(r),
            Ok(_) => {}
        }
    }
    out
}

/// `src`, `dst`, `except`: networks, each distinct one counted in `set` against what its
/// trie holds across all rules.
fn nets(
    f: &Field,
    ck: &mut Checker,
    what: &str,
    set: &mut std::collections::HashSet<IpNet>,
    reported: &mut bool,
) -> Vec<IpNet> {
    let mut out = Vec::new();
    let items = listed(f, ck, &format!("any {what}"));
    let cap = if what == "destination" {
        caps::MAX_RULE_DST_ENTRIES
    } else {
        caps::MAX_RULE_SRC_ENTRIES
    };
    for e in &items {
        let Some(n) = net(e, ck) else { continue };
        if out.contains(&n) {
            continue;
        }
        out.push(n);
        set.insert(n);
        if set.len() > cap as usize && !*reported {
            *reported = true;
            e.invalid(
                ck,
                format!("too many {what} networks; at most {cap} fit across all rules"),
            );
        }
    }
    out
}

/// `length` / `ttl`: at most `caps::MAX_LENGTH_RANGES` values or ranges in `min..=max`.
fn ranges(f: &Field, ck: &mut Checker, what: &str, min: u32, max: u32) -> Vec<(u32, u32)> {
    let mut out = Vec::new();
    let items = listed(f, ck, &format!("any {what}"));
    for (i, e) in items.iter().enumerate() {
        let r = match e.node() {
            Node::Int(n) => parse_range(&n.to_string(), what, min, max),
            Node::Str(s) => parse_range(s, what, min, max),
            _ => {
                e.expected(ck, &format!("a {what} or a string such as \"{min}-{max}\""));
                continue;
            }
        };
        match r {
            Err(msg) => e.invalid(ck, msg),
            Ok(_) if i == caps::MAX_LENGTH_RANGES => e.invalid(
                ck,
                format!(
                    "too many {what} ranges; at most {} fit",
                    caps::MAX_LENGTH_RANGES
                ),
            ),
            Ok(r) if i < caps::MAX_LENGTH_RANGES => out.push(r),
            Ok(_) => {}
        }
    }
    out
}

/// `icmp_types` / `icmp_codes`: numbers 0..=255, each once.
fn numbers(f: &Field, ck: &mut Checker) -> Vec<u8> {
    let mut out = Vec::new();
    let items = listed(f, ck, "any");
    for e in &items {
        if let Some(n) = int_in(e, ck, 0, 255)
            && !out.contains(&(n as u8))
        {
            out.push(n as u8);
        }
    }
    out
}

/// `payload`: at most `caps::MAX_PAYLOAD_MATCHES` conditions; the distinct reads of all
/// rules together at most `caps::MAX_PAYLOAD_FETCHES`.
fn payloads(f: &Field, tot: &mut Totals, ck: &mut Checker) -> Vec<Payload> {
    let mut out = Vec::new();
    let items = listed(f, ck, "any payload");
    if items.len() > caps::MAX_PAYLOAD_MATCHES {
        f.error(
            ck,
            format!(
                "has {} conditions; at most {} fit",
                items.len(),
                caps::MAX_PAYLOAD_MATCHES
            ),
        );
        return out;
    }
    for e in &items {
        let Some(mut t) = e.table(ck) else { continue };
        let Some(p) = payload(&mut t, ck) else {
            t.finish(ck);
            continue;
        };
        t.finish(ck);
        if !tot.reads.contains(&p.read()) {
            tot.reads.push(p.read());
            if tot.reads.len() > caps::MAX_PAYLOAD_FETCHES && !tot.reads_reported {
                tot.reads_reported = true;
                e.invalid(
                    ck,
                    format!(
                        "too many distinct payload reads (from, offset, length); at most {} \
                         fit across all rules",
                        caps::MAX_PAYLOAD_FETCHES
                    ),
                );
            }
        }
        out.push(p);
    }
    out
}

/// One `{ from, offset, value, mask }`.
fn payload(t: &mut Table, ck: &mut Checker) -> Option<Payload> {
    let from = match t.get("from") {
        Some(f) => keyword::<PayloadFrom>(&f, ck),
        None => {
            t.missing(ck, "from", " (\"l4\" or \"l4_payload\")");
            None
        }
    };
    let offset = match t.get("offset") {
        Some(f) => int_in(&f, ck, 0, caps::MAX_PAYLOAD_OFFSET as i64),
        None => Some(0),
    };
    let value = match t.get("value") {
        Some(f) => hex(f, ck),
        None => {
            t.missing(ck, "value", " (1 to 4 bytes of hex, e.g. \"0x0000\")");
            None
        }
    };
    let mask = t.get("mask").and_then(|f| hex(f, ck));
    let ((value, len), vf) = value?;
    let mask = match mask {
        Some(((m, mlen), mf)) => {
            if mlen != len {
                mf.invalid(
                    ck,
                    format!("has {mlen} bytes and the value {len}: give both the same length"),
                );
                return None;
            }
            m
        }
        None => u32::MAX >> (32 - 8 * len as u32),
    };
    if value & !mask != 0 {
        vf.invalid(
            ck,
            "has bits the mask clears, so it can never match; clear them or widen the mask",
        );
        return None;
    }
    Some(Payload {
        from: from?,
        offset: offset? as u16,
        len,
        value,
        mask,
    })
}

/// A `value` or `mask`: 1 to 4 bytes of hex, with its field for errors.
fn hex<'a>(f: Field<'a>, ck: &mut Checker) -> Option<((u32, u8), Field<'a>)> {
    let s = f.str(ck)?;
    match parse_hex_bytes(s) {
        Ok(v) => Some((v, f)),
        Err(e) => {
            f.invalid(ck, e);
            None
        }
    }
}
