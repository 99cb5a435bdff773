//! Parsers for single values, shared by the config file and the command line. Errors are
//! phrased to follow a field name and a colon.

use std::net::IpAddr;
use std::time::Duration;
use std::{fmt, str::FromStr};

use ipnet::IpNet;
use ratelimit_common::caps;

/// A value parser's error after the name of the field or flag it was given to, worded alike in
/// the config file and on the command line: `ban_duration must be greater than 0`, `--for must
/// be greater than 0`; `deny: "x" is not an IP address or CIDR`, `entry 2: "x" is not ...`.
pub fn labelled(field: &str, msg: &str) -> String {
    if msg.starts_with("must ") {
        format!("{field} {msg}")
    } else {
        format!("{field}: {msg}")
    }
}

/// `"a", "b" or "c"`.
pub(super) fn quoted_list(items: &[&str]) -> String {
    let quoted: Vec<String> = items.iter().map(|s| format!("{s:?}")).collect();
    match quoted.split_last() {
        None => String::new(),
        Some((last, [])) => last.clone(),
        Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
    }
}

/// An IPv4 or IPv6 address, bare (a /32 or /128 network) or in CIDR notation. A CIDR with host
/// bits set is an error that suggests the network meant.
pub fn parse_net(s: &str) -> Result<IpNet, String> {
    let t = s.trim();
    let not_addr = || format!("{s:?} is not an IP address or CIDR");
    let Some((addr, len)) = t.split_once('/') else {
        let net = t
            .parse::<IpAddr>()
            .map(IpNet::from)
            .map_err(|_| not_addr())?;
        return match aliases_ipv4(&net) {
            Some(why) => Err(format!("{t} {why}")),
            None => Ok(net),
        };
    };
    let addr: IpAddr = addr.parse().map_err(|_| not_addr())?;
    let max = if addr.is_ipv4() { 32 } else { 128 };
    let len = Some(len)
        .filter(|l| !l.is_empty() && l.len() <= 3 && l.bytes().all(|b| b.is_ascii_digit()))
        .and_then(|l| l.parse::<u8>().ok())
        .filter(|&l| l <= max)
        .ok_or_else(|| format!("{t}: the prefix length must be a number from 0 to {max}"))?;
    let net = IpNet::new(addr, len).map_err(|_| not_addr())?;
    if net.trunc() != net {
        return Err(format!(
            "{t} has host bits set; did you mean {}?",
            net.trunc()
        ));
    }
    if let Some(why) = aliases_ipv4(&net) {
        return Err(format!("{t} {why}"));
    }
    Ok(net)
}

/// Why an IPv6 prefix inside `::ffff:0:0/96` (IPv4-mapped) or `::/96` (IPv4-compatible) is
/// refused, or `None` for any other prefix. Such a prefix spells IPv4 addresses in IPv6
/// notation: taken as written it would cover IPv4 clients (a pasted martian list's
/// `::ffff:0.0.0.0/96` in `deny` would drop every IPv4 client), and no IPv6 packet comes from
/// it (those sources are bogons, dropped before any list or rule). The families never alias, so
/// the operator writes the IPv4 prefix meant instead. A shorter IPv6 prefix that merely holds
/// these ranges (`::/0`, `::/64`) is an IPv6 prefix like any other and covers no IPv4 client.
pub fn aliases_ipv4(net: &IpNet) -> Option<String> {
    let IpNet::V6(n) = net else {
        return None;
    };
    if n.prefix_len() < 96 {
        return None;
    }
    let s = n.network().segments();
    if s[..5] != [0; 5] {
        return None;
    }
    let v4 = std::net::Ipv4Addr::from(n.network().to_bits() as u32);
    let as_v4 = format!("{v4}/{}", n.prefix_len() - 96);
    match s[5] {
        0xffff => Some(format!(
            "is inside ::ffff:0:0/96, the IPv4-mapped range: an IPv6 prefix never covers {}",
            format_args!("IPv4 clients; write the IPv4 prefix ({as_v4}) to mean those")
        )),
        0 => Some(
            concat!(
                "is inside ::/96 (the unspecified, loopback and IPv4-compatible addresses): ",
                "no packet from it reaches the lists or rules (such sources are bogons), ",
                "and an IPv6 prefix never covers IPv4 clients"
            )
            .to_string(),
        ),
        _ => None,
    }
}

/// A region: an ISO 3166 alpha-2 country code as two uppercase ASCII letters, `ZZ` for
/// unknown.
pub fn parse_region(s: &str) -> Result<[u8; 2], String> {
    match *s.as_bytes() {
        [a, b] if a.is_ascii_uppercase() && b.is_ascii_uppercase() => Ok([a, b]),
        [a, b] if a.is_ascii_alphabetic() && b.is_ascii_alphabetic() => {
            let upper = s.to_ascii_uppercase();
            Err(format!("{s:?} must be uppercase; did you mean {upper:?}?"))
        }
        _ => Err(format!(
            "{s:?} is not a two-letter country code (ISO 3166 alpha-2; \"ZZ\" is unknown)"
        )),
    }
}

/// A byte size: digits with an optional unit `B`, `KB`/`kB` (1000), `KiB` (1024), `MB`, `MiB`,
/// `GB` or `GiB`; a space between number and unit is allowed.
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let bad = || {
        format!(
            "{s:?} is not a byte size; use a whole number with an optional unit B, KB, KiB, MB, MiB, GB or GiB, e.g. \"10MiB\""
        )
    };
    let digits = t.bytes().take_while(u8::is_ascii_digit).count();
    if digits == 0 {
        return Err(bad());
    }
    let (number, unit) = t.split_at(digits);
    let multiplier: u64 = match unit.trim_start() {
        "" | "B" => 1,
        "KB" | "kB" => 1_000,
        "KiB" => 1 << 10,
        "MB" => 1_000_000,
        "MiB" => 1 << 20,
        "GB" => 1_000_000_000,
        "GiB" => 1 << 30,
        _ => return Err(bad()),
    };
    number
        .parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(multiplier))
        .ok_or_else(|| format!("{s:?} is too large"))
}

/// One port number, 1..=65535.
pub(super) fn check_port(n: i64) -> Result<u16, String> {
    match n {
        0 => Err("port 0 is not allowed".into()),
        1..=65535 => Ok(n as u16),
        _ => Err(format!("port {n} is out of range (1-65535)")),
    }
}

/// A destination port or inclusive port range: `"80"` or `"8000-8100"`.
pub fn parse_port_range(s: &str) -> Result<(u16, u16), String> {
    let port = |p: &str| -> Result<u16, String> {
        let p = p.trim();
        if p.is_empty() || !p.bytes().all(|b| b.is_ascii_digit()) {
            return Err(format!(
                "{s:?} is not a port or port range; write e.g. \"443\" or \"8000-8100\""
            ));
        }
        check_port(p.parse::<i64>().unwrap_or(i64::MAX))
    };
    let (lo, hi) = match s.split_once('-') {
        Some((lo, hi)) => (port(lo)?, port(hi)?),
        None => {
            let p = port(s)?;
            (p, p)
        }
    };
    if lo > hi {
        return Err(format!(
            "port range {lo}-{hi} is reversed; did you mean {hi}-{lo}?"
        ));
    }
    Ok((lo, hi))
}

/// TCP flags to match: names separated by `,` or `|`, `!name` for a flag that must be clear.
/// Each named flag goes in the mask; the un-negated ones also in the value. Exactly `"syn"`
/// alone is shorthand for `"syn,!ack"` (a connection attempt).
pub fn parse_tcp_flags(s: &str) -> Result<TcpFlags, String> {
    if s.trim().is_empty() {
        return Err("no flags given; use names fin, syn, rst, psh, ack, urg, ece, cwr".into());
    }
    let mut flags = TcpFlags { mask: 0, value: 0 };
    let mut count = 0;
    for token in s.split([',', '|']) {
        let token = token.trim();
        let (negated, name) = match token.strip_prefix('!') {
            Some(name) => (true, name.trim()),
            None => (false, token),
        };
        if name.is_empty() {
            return Err(format!("{s:?} has an empty flag name"));
        }
        let lower = name.to_ascii_lowercase();
        let Some(&(_, bit)) = TcpFlags::NAMES.iter().find(|(n, _)| *n == lower) else {
            return Err(format!(
                "unknown TCP flag {name:?}; use fin, syn, rst, psh, ack, urg, ece or cwr"
            ));
        };
        if flags.mask & bit != 0 {
            return Err(format!("flag {lower} is given more than once in {s:?}"));
        }
        flags.mask |= bit;
        if !negated {
            flags.value |= bit;
        }
        count += 1;
    }
    if count == 1 && flags.value == TcpFlags::SYN {
        flags.mask |= TcpFlags::ACK;
    }
    Ok(flags)
}

/// A duration: `"500ms"`, `"30s"`, `"20m"`, `"1h"`, `"1d"`, or combinations like `"1h30m"`.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s.trim()).map_err(|e| {
        format!("{s:?} is not a duration ({e}); write e.g. \"500ms\", \"30s\", \"20m\", \"1h\" or \"1d\"")
    })
}

/// The longest ban a rule or the operator may set: 10 years (of 365 days). Longer is not a
/// duration but "until removed" (`ban add` without `--for`), and a bound keeps every expiry
/// (now + duration, in ns of the monotonic clock and in ms of Unix time) far from wrapping.
pub const MAX_BAN_DURATION: Duration = Duration::from_secs(10 * 365 * 86_400);

/// A ban's duration, wherever it comes from (config `ban_duration`, `rule set --ban-duration`,
/// `ban add --for`, the control API): at least 1 ms (the control API carries milliseconds, and
/// a zero-length ban would be added already expired), at most [`MAX_BAN_DURATION`].
pub fn check_ban_duration(d: Duration) -> Result<(), String> {
    if d.is_zero() {
        return Err("must be greater than 0".into());
    }
    if d < Duration::from_millis(1) {
        return Err(format!(
            "{} is shorter than 1ms, the shortest ban",
            format_duration(d)
        ));
    }
    if d > MAX_BAN_DURATION {
        return Err(format!(
            "{} is longer than 10 years ({}), the longest ban; a ban without a duration lasts until removed",
            format_duration(d),
            format_duration(MAX_BAN_DURATION)
        ));
    }
    Ok(())
}

/// [`parse_duration`] then [`check_ban_duration`]: the one parser for every ban duration.
pub fn parse_ban_duration(s: &str) -> Result<Duration, String> {
    let d = parse_duration(s)?;
    check_ban_duration(d)?;
    Ok(d)
}

/// A threshold interval: greater than zero, at most `caps::MAX_INTERVAL_NS`. Errors follow
/// "interval ".
pub fn check_interval(d: Duration) -> Result<(), String> {
    if d.is_zero() {
        return Err("must be greater than 0".into());
    }
    if d.as_nanos() > u128::from(caps::MAX_INTERVAL_NS) {
        return Err(format!(
            "must be at most {}",
            format_duration(Duration::from_nanos(caps::MAX_INTERVAL_NS))
        ));
    }
    Ok(())
}

/// The smallest byte threshold or token-bucket byte burst: 64 KiB. A frame larger than the
/// threshold (or the bucket) can never be admitted, so a smaller one would drop every larger
/// frame forever. 64 KiB covers any frame native XDP hands the program (one page) and any IP
/// packet (at most 65,535 B); only a generic-mode frame carrying a maximal IP packet with its
/// link-layer header, or a BIG TCP aggregate, is larger.
pub const MIN_BYTE_AMOUNT: u64 = 64 << 10;

/// The fastest rates a threshold may state, in units per ns: 1 packet, 64 bytes (a minimum
/// Ethernet frame; 512 Gbit/s). The token bucket meters in whole ns rounded up, so a faster
/// rate would be enforced as a slower one than written (a packet rate above 1 per ns as 1 per
/// ns, whatever the config says).
pub const MAX_PACKETS_PER_NS: u64 = 1;
pub const MAX_BYTES_PER_NS: u64 = 64;

/// A threshold's amount against its unit and interval (already checked by [`check_interval`]):
/// not faster than the limiter can meter, and for bytes not below [`MIN_BYTE_AMOUNT`].
pub fn check_amount(amount: u64, unit: Unit, interval: Duration) -> Result<(), String> {
    let (per_ns, what) = match unit {
        Unit::Packets => (MAX_PACKETS_PER_NS, "1 packet"),
        Unit::Bytes => (MAX_BYTES_PER_NS, "64 bytes"),
    };
    if unit == Unit::Bytes && amount < MIN_BYTE_AMOUNT {
        return Err(format!(
            "{amount} B is below the minimum of 64KiB ({MIN_BYTE_AMOUNT} B): a frame larger than a byte threshold is never admitted, and an IP packet may be up to 65,535 B"
        ));
    }
    if u128::from(amount) > interval.as_nanos() * u128::from(per_ns) {
        return Err(format!(
            "{amount} per {} is faster than {what} per ns, the fastest rate the limiter meters exactly; use a longer interval or a smaller amount",
            format_duration(interval)
        ));
    }
    Ok(())
}

/// A token bucket's burst in bytes: not below [`MIN_BYTE_AMOUNT`], or every larger frame
/// would be refused forever.
pub fn check_byte_burst(burst: u64) -> Result<(), String> {
    if burst < MIN_BYTE_AMOUNT {
        return Err(format!(
            "{burst} B is below the minimum of 64KiB ({MIN_BYTE_AMOUNT} B) for a byte threshold's bucket: a frame larger than the bucket is never admitted"
        ));
    }
    Ok(())
}

/// A duration in the largest unit that states it exactly: `20m`, `1d`, `1500ms`. Parses back
/// with [`parse_duration`].
pub fn format_duration(d: Duration) -> String {
    const UNITS: [(&str, u128); 7] = [
        ("d", 86_400_000_000_000),
        ("h", 3_600_000_000_000),
        ("m", 60_000_000_000),
        ("s", 1_000_000_000),
        ("ms", 1_000_000),
        ("us", 1_000),
        ("ns", 1),
    ];
    let ns = d.as_nanos();
    if ns == 0 {
        return "0s".into();
    }
    let (unit, size) = UNITS
        .into_iter()
        .find(|(_, size)| ns.is_multiple_of(*size))
        .unwrap_or(("ns", 1));
    format!("{}{unit}", ns / size)
}

/// What a threshold counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Unit {
    Packets,
    Bytes,
}

impl Unit {
    /// `"packets"` or `"bytes"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Unit::Packets => "packets",
            Unit::Bytes => "bytes",
        }
    }
}

impl fmt::Display for Unit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// TCP flag match: `(flags & mask) == value`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TcpFlags {
    pub mask: u8,
    pub value: u8,
}

impl TcpFlags {
    pub const FIN: u8 = 0x01;
    pub const SYN: u8 = 0x02;
    pub const RST: u8 = 0x04;
    pub const PSH: u8 = 0x08;
    pub const ACK: u8 = 0x10;
    pub const URG: u8 = 0x20;
    pub const ECE: u8 = 0x40;
    pub const CWR: u8 = 0x80;
    /// Flag names in bit order.
    pub const NAMES: [(&'static str, u8); 8] = [
        ("fin", Self::FIN),
        ("syn", Self::SYN),
        ("rst", Self::RST),
        ("psh", Self::PSH),
        ("ack", Self::ACK),
        ("urg", Self::URG),
        ("ece", Self::ECE),
        ("cwr", Self::CWR),
    ];
}

/// Canonical form, e.g. `syn,!ack`; parses back to the same value.
impl fmt::Display for TcpFlags {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut first = true;
        for (name, bit) in Self::NAMES {
            if self.mask & bit == 0 {
                continue;
            }
            if !first {
                f.write_str(",")?;
            }
            first = false;
            if self.value & bit == 0 {
                f.write_str("!")?;
            }
            f.write_str(name)?;
        }
        Ok(())
    }
}

impl FromStr for TcpFlags {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        parse_tcp_flags(s)
    }
}
