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

keyword_enum!(
    /// What a rule counts per: `key`.
    #[derive(Default)]
    KeyKind {
        /// One counter for all matching traffic.
        All = "all",
        /// Per source address, aggregated to `ipv4_prefix` / `ipv6_prefix`. The default.
        #[default]
        Ip = "ip",
        /// Per country from the GeoIP database.
        Region = "region",
    }
);

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
