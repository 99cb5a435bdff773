//! What a rule matches (`match = { ... }` and the rule's `except`): the model, the values
//! only matching has (ranges of lengths and TTLs, payload bytes), and the match written back
//! as the TOML inline table it reads from (`ratelimit rules`, suggestions).

use std::fmt::{self, Write as _};

use ipnet::IpNet;

use super::values::TcpFlags;
use super::{Fragment, PayloadFrom, Protocol, TcpState};

/// What a rule matches. The default matches every packet.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Match {
    /// `None` = any protocol.
    pub protocol: Option<Protocol>,
    /// Only with `protocol = Tcp`.
    pub tcp_flags: Option<TcpFlags>,
    /// Inclusive ranges, `lo <= hi`, no port 0; at most `caps::MAX_PORT_RANGES`; only with TCP
    /// or UDP; empty = any port.
    pub dst_ports: Vec<(u16, u16)>,
    /// As `dst_ports`, of the source port; at most `caps::MAX_SRC_PORT_RANGES`.
    pub src_ports: Vec<(u16, u16)>,
    /// Source networks the rule is limited to; empty = any source.
    pub src: Vec<IpNet>,
    /// Destination networks the rule is limited to; empty = any destination.
    pub dst: Vec<IpNet>,
    /// The rule's `except`: source networks it never matches.
    pub except: Vec<IpNet>,
    /// Ranges of the IP packet's length in bytes; at most `caps::MAX_LENGTH_RANGES`.
    pub length: Vec<(u16, u16)>,
    /// Ranges of the IPv4 TTL / IPv6 hop limit; at most `caps::MAX_LENGTH_RANGES`.
    pub ttl: Vec<(u8, u8)>,
    pub fragment: Option<Fragment>,
    /// Only with ICMP or ICMPv6.
    pub icmp_types: Vec<u8>,
    pub icmp_codes: Vec<u8>,
    /// At most `caps::MAX_PAYLOAD_MATCHES`.
    pub payload: Vec<Payload>,
    /// Only with TCP.
    pub tcp_state: Option<TcpState>,
}

/// One `match.payload` condition: `len` bytes at `offset` after `from`, big-endian, masked
/// with `mask`, equal to `value` (`value & !mask == 0`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Payload {
    pub from: PayloadFrom,
    pub offset: u16,
    /// 1..=4 bytes.
    pub len: u8,
    pub value: u32,
    pub mask: u32,
}

impl Payload {
    /// The read it needs: (from, offset, length).
    pub fn read(&self) -> (PayloadFrom, u16, u8) {
        (self.from, self.offset, self.len)
    }
}

/// An inclusive range of integers in `min..=max`: `"1000-1500"`, `"64"`, or a number. `what`
/// names a value in errors ("length", "TTL").
pub fn parse_range(s: &str, what: &str, min: u32, max: u32) -> Result<(u32, u32), String> {
    let one = |p: &str| -> Result<u32, String> {
        let p = p.trim();
        if p.is_empty() || !p.bytes().all(|b| b.is_ascii_digit()) {
            return Err(format!(
                "{s:?} is not a {what} or {what} range; write e.g. \"{min}\" or \"{min}-{max}\""
            ));
        }
        match p.parse::<u64>() {
            Ok(n) if (min as u64..=max as u64).contains(&n) => Ok(n as u32),
            _ => Err(format!("{what} {p} is out of range ({min}-{max})")),
        }
    };
    let (lo, hi) = match s.split_once('-') {
        Some((lo, hi)) => (one(lo)?, one(hi)?),
        None => {
            let n = one(s)?;
            (n, n)
        }
    };
    if lo > hi {
        return Err(format!(
            "{what} range {lo}-{hi} is empty; did you mean {hi}-{lo}?"
        ));
    }
    Ok((lo, hi))
}

/// 1-4 bytes written as hex: `"0x0000"`, `"0xff"` (an even count of digits after `0x`).
/// (value, length in bytes).
pub fn parse_hex_bytes(s: &str) -> Result<(u32, u8), String> {
    let t = s.trim();
    let digits = t
        .strip_prefix("0x")
        .or_else(|| t.strip_prefix("0X"))
        .ok_or_else(|| format!("{s:?} is not hex bytes; write e.g. \"0x0000\" (1 to 4 bytes)"))?;
    if digits.is_empty()
        || digits.len() % 2 != 0
        || digits.len() > 8
        || !digits.bytes().all(|b| b.is_ascii_hexdigit())
    {
        return Err(format!(
            "{s:?} is not 1 to 4 whole bytes of hex; write e.g. \"0x00\" or \"0x0000ffff\""
        ));
    }
    let v = u32::from_str_radix(digits, 16).map_err(|e| format!("{s:?}: {e}"))?;
    Ok((v, (digits.len() / 2) as u8))
}

fn ranges<T: fmt::Display + PartialEq>(v: &[(T, T)]) -> String {
    let items: Vec<String> = v
        .iter()
        .map(|(lo, hi)| {
            if lo == hi {
                format!("\"{lo}\"")
            } else {
                format!("\"{lo}-{hi}\"")
            }
        })
        .collect();
    format!("[{}]", items.join(", "))
}

fn nets(v: &[IpNet]) -> String {
    let items: Vec<String> = v.iter().map(|n| format!("\"{n}\"")).collect();
    format!("[{}]", items.join(", "))
}

fn hex(v: u32, len: u8) -> String {
    format!("0x{:0width$x}", v, width = len as usize * 2)
}

impl fmt::Display for Match {
    /// The TOML inline table of `match` that reads back as this match (`except` aside: it
    /// is the rule's own key). `{}` matches every packet.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts: Vec<String> = Vec::new();
        if let Some(p) = self.protocol {
            parts.push(format!("protocol = \"{p}\""));
        }
        if let Some(t) = &self.tcp_flags {
            parts.push(format!("tcp_flags = \"{t}\""));
        }
        if let Some(s) = self.tcp_state {
            parts.push(format!("tcp_state = \"{s}\""));
        }
        for (name, v) in [
            ("src_ports", &self.src_ports),
            ("dst_ports", &self.dst_ports),
        ] {
            if !v.is_empty() {
                parts.push(format!("{name} = {}", ranges(v)));
            }
        }
        for (name, v) in [("src", &self.src), ("dst", &self.dst)] {
            if !v.is_empty() {
                parts.push(format!("{name} = {}", nets(v)));
            }
        }
        if !self.length.is_empty() {
            parts.push(format!("length = {}", ranges(&self.length)));
        }
        if !self.ttl.is_empty() {
            parts.push(format!("ttl = {}", ranges(&self.ttl)));
        }
        if let Some(fr) = self.fragment {
            parts.push(format!("fragment = \"{fr}\""));
        }
        for (name, v) in [
            ("icmp_types", &self.icmp_types),
            ("icmp_codes", &self.icmp_codes),
        ] {
            if !v.is_empty() {
                let items: Vec<String> = v.iter().map(u8::to_string).collect();
                parts.push(format!("{name} = [{}]", items.join(", ")));
            }
        }
        if !self.payload.is_empty() {
            let mut s = String::from("payload = [");
            for (i, p) in self.payload.iter().enumerate() {
                if i > 0 {
                    s.push_str(", ");
                }
                let _ = write!(
                    s,
                    "{{ from = \"{}\", offset = {}, value = \"{}\", mask = \"{}\" }}",
                    p.from,
                    p.offset,
                    hex(p.value, p.len),
                    hex(p.mask, p.len)
                );
            }
            s.push(']');
            parts.push(s);
        }
        if parts.is_empty() {
            return f.write_str("{}");
        }
        write!(f, "{{ {} }}", parts.join(", "))
    }
}

#[cfg(test)]
mod tests;
