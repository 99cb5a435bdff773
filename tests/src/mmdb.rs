//! A minimal MaxMind DB writer, so tests can build GeoIP databases instead of shipping them.
//!
//! It follows the format specification (<https://maxmind.github.io/MaxMind-DB/>):
//!
//! - a binary search tree of `node_count` nodes, each two records of 24, 28 or 32 bits; a record
//!   below `node_count` is a node number, `node_count` itself means "no data", and a record
//!   above it points into the data section at `record - node_count - 16`;
//! - an IPv6 tree (`ip_version = 6`) keeps IPv4 under `::/96`; by default `::ffff:0:0/96`,
//!   `2001::/32` and `2002::/16` are aliases whose records point to that same IPv4 node, as in
//!   the databases MaxMind ships;
//! - 16 zero bytes, then the data section (each distinct record written once);
//! - `"\xAB\xCD\xEFMaxMind.com"`, then the metadata map.
//!
//! IPv6 networks inside `::/96` or inside an alias are rejected: that space is IPv4's.
//! Networks may nest: a less specific network is split around a more specific one, and the most
//! specific network wins, whatever the order they are given in.
//!
//! This file uses nothing but `std`, so it can also be compiled into other crates' unit tests
//! with `#[path = ...] mod ...;`.

use std::{collections::HashMap, io, net::IpAddr, path::Path};

/// A value of the data section (the subset of the format's types the writer needs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Value {
    Str(String),
    U16(u16),
    U32(u32),
    U64(u64),
    Bool(bool),
    Map(Vec<(String, Value)>),
    Array(Vec<Value>),
}

impl Value {
    pub fn str(s: &str) -> Value {
        Value::Str(s.to_owned())
    }

    /// A map from `(key, value)` pairs, in the given order.
    pub fn map<'a>(pairs: impl IntoIterator<Item = (&'a str, Value)>) -> Value {
        Value::Map(pairs.into_iter().map(|(k, v)| (k.to_owned(), v)).collect())
    }
}

/// The record a GeoIP2/GeoLite2 Country database holds for a network: `{"country": {"iso_code": ..}}`.
pub fn country_record(iso_code: &str) -> Value {
    Value::map([("country", Value::map([("iso_code", Value::str(iso_code))]))])
}

/// Everything about the database but its networks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Options {
    /// 4 (IPv4 networks only) or 6.
    pub ip_version: u16,
    /// 24, 28 or 32 bits per record.
    pub record_size: u16,
    pub database_type: String,
    pub build_epoch: u64,
    /// Language → description.
    pub description: Vec<(String, String)>,
    pub languages: Vec<String>,
    /// IPv6 prefixes that alias the IPv4 tree at `::/96` (IPv6 databases only). Networks inside
    /// them are rejected; networks around them are split.
    pub ipv4_aliases: Vec<String>,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            ip_version: 6,
            record_size: 28,
            database_type: "GeoLite2-Country".to_owned(),
            build_epoch: 1_700_000_000,
            description: vec![("en".to_owned(), "ratelimit test database".to_owned())],
            languages: vec!["en".to_owned()],
            ipv4_aliases: ["::ffff:0:0/96", "2001::/32", "2002::/16"]
                .map(str::to_owned)
                .to_vec(),
        }
    }
}

/// Writes a Country database (IPv6 tree, 28-bit records, IPv4 aliases) mapping each CIDR to
/// `{"country": {"iso_code": code}}`.
pub fn write_country_db(path: &Path, entries: &[(&str, &str)]) -> io::Result<()> {
    let entries: Vec<(&str, Value)> = entries
        .iter()
        .map(|(cidr, code)| (*cidr, country_record(code)))
        .collect();
    write_db(path, &Options::default(), &entries)
}

/// Writes a database with arbitrary records.
pub fn write_db(path: &Path, options: &Options, entries: &[(&str, Value)]) -> io::Result<()> {
    std::fs::write(path, build_db(options, entries)?)
}

fn invalid(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, msg)
}

/// Parses `addr/len` (a bare address is a host route); host bits must be zero.
pub fn parse_cidr(s: &str) -> io::Result<(IpAddr, u8)> {
    let (addr, len) = match s.split_once('/') {
        Some((a, l)) => (a, Some(l)),
        None => (s, None),
    };
    let addr: IpAddr = addr
        .parse()
        .map_err(|e| invalid(format!("{s:?}: bad address: {e}")))?;
    let max = if addr.is_ipv4() { 32 } else { 128 };
    let len = match len {
        Some(l) => l
            .parse::<u8>()
            .map_err(|e| invalid(format!("{s:?}: bad prefix length: {e}")))?,
        None => max,
    };
    if len > max {
        return Err(invalid(format!("{s:?}: prefix length above {max}")));
    }
    let (bits, _) = tree_bits(addr, len, 6);
    if bits & !mask(if addr.is_ipv4() { 96 + len } else { len }) != 0 {
        return Err(invalid(format!("{s:?}: host bits set")));
    }
    Ok((addr, len))
}

/// The network's path in the tree: the address left-aligned in 128 bits and the path length.
/// In an IPv6 tree IPv4 lives at `::/96`.
fn tree_bits(addr: IpAddr, len: u8, ip_version: u16) -> (u128, u8) {
    match addr {
        IpAddr::V4(a) if ip_version == 4 => ((u32::from(a) as u128) << 96, len),
        IpAddr::V4(a) => (u32::from(a) as u128, 96 + len),
        IpAddr::V6(a) => (u128::from(a), len),
    }
}

/// The first `len` bits set (left-aligned).
fn mask(len: u8) -> u128 {
    if len == 0 {
        0
    } else {
        u128::MAX << (128 - len as u32)
    }
}

fn bit(bits: u128, depth: u8) -> usize {
    ((bits >> (127 - depth as u32)) & 1) as usize
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Child {
    Empty,
    Node(usize),
    /// Offset in the data section.
    Data(usize),
}

struct Tree {
    nodes: Vec<[Child; 2]>,
}

impl Tree {
    /// Makes everything under the path `bits/len` resolve to `leaf`, splitting a shorter leaf
    /// that covered it.
    fn set(&mut self, bits: u128, len: u8, leaf: Child) {
        if len == 0 {
            self.nodes[0] = [leaf, leaf];
            return;
        }
        let mut node = 0;
        for depth in 0..len - 1 {
            let b = bit(bits, depth);
            node = match self.nodes[node][b] {
                Child::Node(n) => n,
                covering => {
                    self.nodes.push([covering, covering]);
                    let n = self.nodes.len() - 1;
                    self.nodes[node][b] = Child::Node(n);
                    n
                }
            };
        }
        self.nodes[node][bit(bits, len - 1)] = leaf;
    }

    /// What the path `bits/len` resolves to (a node, or the leaf covering it).
    fn get(&self, bits: u128, len: u8) -> Child {
        let mut child = Child::Node(0);
        for depth in 0..len {
            match child {
                Child::Node(n) => child = self.nodes[n][bit(bits, depth)],
                leaf => return leaf,
            }
        }
        child
    }
}

/// Builds the database file in memory.
pub fn build_db(options: &Options, entries: &[(&str, Value)]) -> io::Result<Vec<u8>> {
    if !matches!(options.ip_version, 4 | 6) {
        return Err(invalid(format!("ip_version {}", options.ip_version)));
    }
    if !matches!(options.record_size, 24 | 28 | 32) {
        return Err(invalid(format!("record_size {}", options.record_size)));
    }
    let aliases: Vec<(u128, u8)> = if options.ip_version == 6 {
        options
            .ipv4_aliases
            .iter()
            .map(|a| match parse_cidr(a)? {
                (IpAddr::V6(n), len) => Ok((u128::from(n), len)),
                _ => Err(invalid(format!("alias {a:?} is not IPv6"))),
            })
            .collect::<io::Result<_>>()?
    } else {
        Vec::new()
    };

    // Data section: each distinct record once.
    let mut data = Vec::new();
    let mut offsets: HashMap<Vec<u8>, usize> = HashMap::new();
    let mut paths = Vec::with_capacity(entries.len());
    for (i, (cidr, value)) in entries.iter().enumerate() {
        let (addr, len) = parse_cidr(cidr)?;
        if options.ip_version == 4 && addr.is_ipv6() {
            return Err(invalid(format!(
                "{cidr:?}: IPv6 network in an IPv4 database"
            )));
        }
        let (bits, depth) = tree_bits(addr, len, options.ip_version);
        if addr.is_ipv6() && depth >= 96 && bits & mask(96) == 0 {
            return Err(invalid(format!(
                "{cidr:?} is inside ::/96, where the database keeps IPv4"
            )));
        }
        if addr.is_ipv6()
            && let Some(a) = aliases
                .iter()
                .find(|(abits, alen)| depth >= *alen && (bits ^ abits) & mask(*alen) == 0)
        {
            return Err(invalid(format!(
                "{cidr:?} is inside the IPv4 alias {}/{}",
                std::net::Ipv6Addr::from(a.0),
                a.1
            )));
        }
        let mut encoded = Vec::new();
        encode(&mut encoded, value)?;
        let offset = *offsets.entry(encoded).or_insert_with_key(|e| {
            data.extend_from_slice(e);
            data.len() - e.len()
        });
        paths.push((depth, i, bits, offset));
    }

    // Less specific first, so more specific networks split them; equal ones: the last wins.
    paths.sort_by_key(|&(depth, i, _, _)| (depth, i));
    let mut tree = Tree {
        nodes: vec![[Child::Empty; 2]],
    };
    for &(depth, _, bits, offset) in &paths {
        tree.set(bits, depth, Child::Data(offset));
    }
    match tree.get(0, 96) {
        Child::Empty => {}
        ipv4 => {
            for &(bits, len) in &aliases {
                tree.set(bits, len, ipv4);
            }
        }
    }

    // Number the reachable nodes breadth first (the root is node 0; aliases share nodes).
    let mut number: Vec<Option<u32>> = vec![None; tree.nodes.len()];
    let mut order = vec![0usize];
    number[0] = Some(0);
    let mut next = 0;
    while next < order.len() {
        for child in tree.nodes[order[next]] {
            if let Child::Node(n) = child
                && number[n].is_none()
            {
                number[n] = Some(order.len() as u32);
                order.push(n);
            }
        }
        next += 1;
    }
    let node_count = order.len() as u64;
    let limit = 1u64 << options.record_size;
    if node_count + 16 + data.len() as u64 >= limit {
        return Err(invalid(format!(
            "{} nodes and {} data bytes do not fit {}-bit records",
            node_count,
            data.len(),
            options.record_size
        )));
    }
    let record = |c: Child| -> u32 {
        match c {
            Child::Empty => node_count as u32,
            Child::Node(n) => number[n].expect("reachable"),
            Child::Data(off) => (node_count + 16 + off as u64) as u32,
        }
    };

    let mut out = Vec::new();
    for &n in &order {
        let [l, r] = tree.nodes[n].map(record);
        out.extend_from_slice(&encode_node(options.record_size, l, r));
    }
    out.extend_from_slice(&[0u8; 16]);
    out.extend_from_slice(&data);

    out.extend_from_slice(b"\xAB\xCD\xEFMaxMind.com");
    let metadata = Value::map([
        ("node_count", Value::U32(node_count as u32)),
        ("record_size", Value::U16(options.record_size)),
        ("ip_version", Value::U16(options.ip_version)),
        ("database_type", Value::str(&options.database_type)),
        (
            "languages",
            Value::Array(options.languages.iter().map(|l| Value::str(l)).collect()),
        ),
        ("binary_format_major_version", Value::U16(2)),
        ("binary_format_minor_version", Value::U16(0)),
        ("build_epoch", Value::U64(options.build_epoch)),
        (
            "description",
            Value::Map(
                options
                    .description
                    .iter()
                    .map(|(lang, text)| (lang.clone(), Value::str(text)))
                    .collect(),
            ),
        ),
    ]);
    encode(&mut out, &metadata)?;
    Ok(out)
}

/// One search-tree node: two big-endian records of 24 or 32 bits; with 28 bits, each record's
/// low 24 bits, and the middle byte holding the left record's top 4 bits in its high nibble and
/// the right record's in its low nibble.
pub fn encode_node(record_size: u16, left: u32, right: u32) -> Vec<u8> {
    let (l, r) = (left.to_be_bytes(), right.to_be_bytes());
    match record_size {
        24 => [&l[1..], &r[1..]].concat(),
        28 => [&l[1..], &[(l[0] << 4) | (r[0] & 0x0f)], &r[1..]].concat(),
        _ => [l, r].concat(),
    }
}

// Data section type numbers.
const POINTER_TYPES_END: u8 = 7;
const STRING: u8 = 2;
const UINT16: u8 = 5;
const UINT32: u8 = 6;
const MAP: u8 = 7;
const UINT64: u8 = 9;
const ARRAY: u8 = 11;
const BOOLEAN: u8 = 14;

/// Control byte(s): type in the top 3 bits (0 and an extra byte for types above 7), size in the
/// low 5 bits, with 1-3 more bytes for sizes from 29 on.
fn control(out: &mut Vec<u8>, typ: u8, size: usize) -> io::Result<()> {
    let (low, extra): (u8, Vec<u8>) = match size {
        0..29 => (size as u8, vec![]),
        29..285 => (29, vec![(size - 29) as u8]),
        285..65_821 => (30, ((size - 285) as u16).to_be_bytes().to_vec()),
        65_821..16_843_037 => (31, ((size - 65_821) as u32).to_be_bytes()[1..].to_vec()),
        _ => return Err(invalid(format!("value of size {size} is too large"))),
    };
    if typ <= POINTER_TYPES_END {
        out.push((typ << 5) | low);
    } else {
        out.push(low);
        out.push(typ - 7);
    }
    out.extend_from_slice(&extra);
    Ok(())
}

fn encode_uint(out: &mut Vec<u8>, typ: u8, v: u64) -> io::Result<()> {
    let bytes = v.to_be_bytes();
    let skip = bytes.iter().take_while(|b| **b == 0).count();
    control(out, typ, 8 - skip)?;
    out.extend_from_slice(&bytes[skip..]);
    Ok(())
}

fn encode_str(out: &mut Vec<u8>, s: &str) -> io::Result<()> {
    control(out, STRING, s.len())?;
    out.extend_from_slice(s.as_bytes());
    Ok(())
}

fn encode(out: &mut Vec<u8>, v: &Value) -> io::Result<()> {
    match v {
        Value::Str(s) => encode_str(out, s),
        Value::U16(n) => encode_uint(out, UINT16, *n as u64),
        Value::U32(n) => encode_uint(out, UINT32, *n as u64),
        Value::U64(n) => encode_uint(out, UINT64, *n),
        Value::Bool(b) => control(out, BOOLEAN, *b as usize),
        Value::Map(pairs) => {
            control(out, MAP, pairs.len())?;
            for (k, v) in pairs {
                encode_str(out, k)?;
                encode(out, v)?;
            }
            Ok(())
        }
        Value::Array(items) => {
            control(out, ARRAY, items.len())?;
            items.iter().try_for_each(|i| encode(out, i))
        }
    }
}
