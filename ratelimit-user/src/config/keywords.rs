//! The config's keywords (`xdp_mode`, `key`, `action`, `algorithm`, `exceed_action`,
//! `match.protocol`) as enums with their spellings, and the unit a threshold counts.

use std::fmt;
use std::str::FromStr;

use super::values;

/// Defines a config keyword enum with `as_str`, `Display` (the config spelling), `FromStr`
/// (exact config spelling; the error lists the choices).
macro_rules! keyword_enum {
    ($(#[$m:meta])* $name:ident { $($(#[$vm:meta])* $variant:ident = $text:literal),+ $(,)? }) => {
        $(#[$m])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum $name {
            $($(#[$vm])* $variant),+
        }

        impl $name {
            /// The spelling used in the config file and on the command line.
            pub fn as_str(self) -> &'static str {
                match self {
                    $($name::$variant => $text),+
                }
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl FromStr for $name {
            type Err = String;
            fn from_str(s: &str) -> Result<Self, String> {
                match s {
                    $($text => Ok($name::$variant),)+
                    _ => Err(format!(
                        "must be one of {} (got {s:?})",
                        values::quoted_list(&[$($text),+])
                    )),
                }
            }
        }
    };
}

keyword_enum!(
    /// How the XDP program is attached.
    #[derive(Default)]
    XdpMode {
        /// Native, falling back to generic.
        #[default]
        Auto = "auto",
        Native = "native",
        Generic = "generic",
    }
);

/// What a rule counts per: `key`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum KeyKind {
    /// One counter for all matching traffic.
    All,
    /// Per source address, aggregated to `ipv4_prefix` / `ipv6_prefix`. The default.
    #[default]
    Ip,
    /// Per country from the GeoIP database.
    Region,
    /// Per combination of packet fields (`key = "dst"`, `key = ["ip", "dst_port"]`): never
    /// empty, never `ip` alone (that is `Ip`).
    Fields(KeyFields),
}

keyword_enum!(
    /// A field of a composite key (`key = [..]`).
    KeyField {
        Ip = "ip",
        Dst = "dst",
        DstPort = "dst_port",
        SrcPort = "src_port",
        Protocol = "protocol",
    }
);

/// The fields of a `KeyKind::Fields` key, as a set (the program's `KEY_FIELD_*` bits).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct KeyFields(pub u8);

impl KeyFields {
    /// The fields in their order, with their `KEY_FIELD_*` bits.
    const BITS: [(KeyField, u8); 5] = [
        (KeyField::Ip, ratelimit_common::maps::KEY_FIELD_SRC),
        (KeyField::Dst, ratelimit_common::maps::KEY_FIELD_DST),
        (
            KeyField::DstPort,
            ratelimit_common::maps::KEY_FIELD_DST_PORT,
        ),
        (
            KeyField::SrcPort,
            ratelimit_common::maps::KEY_FIELD_SRC_PORT,
        ),
        (
            KeyField::Protocol,
            ratelimit_common::maps::KEY_FIELD_PROTOCOL,
        ),
    ];

    /// The bit of `f`.
    pub fn bit(f: KeyField) -> u8 {
        Self::BITS
            .iter()
            .find(|(g, _)| *g == f)
            .map_or(0, |(_, b)| *b)
    }

    /// The fields, in a fixed order.
    pub fn fields(self) -> impl Iterator<Item = KeyField> {
        Self::BITS
            .into_iter()
            .filter(move |(_, b)| self.0 & b != 0)
            .map(|(f, _)| f)
    }

    pub fn has(self, f: KeyField) -> bool {
        self.0 & Self::bit(f) != 0
    }
}

impl KeyKind {
    /// Whether the key holds the source address (aggregated to `ipv4_prefix` /
    /// `ipv6_prefix`): `"ip"`, or a list with `"ip"`.
    pub fn has_source(self) -> bool {
        match self {
            KeyKind::Ip => true,
            KeyKind::Fields(f) => f.has(KeyField::Ip),
            _ => false,
        }
    }

    /// `key = "dst"`.
    pub const DST: KeyKind = KeyKind::Fields(KeyFields(ratelimit_common::maps::KEY_FIELD_DST));
}

impl KeyKind {
    /// As the config writes it: `"ip"`, `"dst"`, or a list such as `["dst", "dst_port"]`.
    pub fn toml(self) -> String {
        match self {
            KeyKind::Fields(k) if self != KeyKind::DST => {
                let names: Vec<String> = k.fields().map(|x| format!("\"{x}\"")).collect();
                format!("[{}]", names.join(", "))
            }
            _ => format!("\"{self}\""),
        }
    }
}

/// The name reports show: `ip`, `dst`, or the fields joined by `+` (`dst+dst_port`).
impl fmt::Display for KeyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeyKind::All => f.write_str("all"),
            KeyKind::Ip => f.write_str("ip"),
            KeyKind::Region => f.write_str("region"),
            KeyKind::Fields(k) => {
                let names: Vec<&str> = k.fields().map(KeyField::as_str).collect();
                f.write_str(&names.join("+"))
            }
        }
    }
}

/// One keyword: `all`, `ip`, `region` or `dst` (a list is read field by field).
impl FromStr for KeyKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "all" => Ok(KeyKind::All),
            "ip" => Ok(KeyKind::Ip),
            "region" => Ok(KeyKind::Region),
            "dst" => Ok(KeyKind::DST),
            _ => Err(format!(
                "must be one of {}, or a list of up to three of {} (got {s:?})",
                values::quoted_list(&["all", "ip", "region", "dst"]),
                values::quoted_list(&["ip", "dst", "dst_port", "src_port", "protocol"]),
            )),
        }
    }
}

keyword_enum!(
    /// `action`.
    #[derive(Default)]
    Action {
        #[default]
        Throttle = "throttle",
        RateBasedBan = "rate_based_ban",
    }
);

keyword_enum!(
    /// `algorithm`.
    #[derive(Default)]
    Algorithm {
        #[default]
        SlidingWindow = "sliding_window",
        TokenBucket = "token_bucket",
        FixedWindow = "fixed_window",
    }
);

keyword_enum!(
    /// `exceed_action`: what happens to packets over the threshold.
    #[derive(Default)]
    ExceedAction {
        #[default]
        Drop = "drop",
        /// Count and report only.
        Pass = "pass",
    }
);

keyword_enum!(
    /// `match.protocol`.
    Protocol {
        Tcp = "tcp",
        Udp = "udp",
        Icmp = "icmp",
        Icmpv6 = "icmpv6",
    }
);

impl Protocol {
    /// Whether destination ports apply.
    pub fn has_ports(self) -> bool {
        matches!(self, Protocol::Tcp | Protocol::Udp)
    }
}

keyword_enum!(
    /// `match.fragment`.
    Fragment {
        /// Every fragment, first or later.
        Any = "any",
        /// Non-first fragments (a fragment offset above 0).
        Later = "later",
        /// Packets that are not fragments.
        None = "none",
    }
);

keyword_enum!(
    /// `match.tcp_state`.
    TcpState {
        /// A TCP segment without SYN that no local socket accepts.
        NoConnection = "no_connection",
    }
);

keyword_enum!(
    /// Where a `match.payload` offset counts from.
    PayloadFrom {
        /// The L4 header's first byte.
        L4 = "l4",
        /// The first byte after the L4 header (TCP with its options, UDP's 8 bytes, ICMP's 8).
        L4Payload = "l4_payload",
    }
);

#[cfg(test)]
mod tests;
