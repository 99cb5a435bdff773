//! The config file: its model, parser and validator.
//!
//! [`parse`] turns TOML text into a [`Config`] or into every problem it can find at once
//! ([`ConfigErrors`]), each with the file, line and column of the offending key or value and a
//! message naming the field, e.g.
//! `ratelimit.toml:14:39: rule "syn-per-client": threshold.interval must be greater than 0`.
//! A config that parses fits the kernel maps (see [`ratelimit_common::caps`]): the daemon can
//! apply it without a partial failure.
//!
//! Value syntax, shared with the CLI through the `parse_*` helpers and the `FromStr` impls:
//! - durations: `"500ms"`, `"30s"`, `"20m"`, `"1h"`, `"1d"` ([`parse_duration`]);
//! - addresses: IPv4 or IPv6, bare (a /32 or /128) or CIDR; a CIDR with host bits set is an
//!   error ([`parse_net`]);
//! - byte sizes: an integer, or a string with a `B`, `KB`/`kB` (1000), `KiB` (1024), `MB`,
//!   `MiB`, `GB` or `GiB` suffix ([`parse_bytes`]);
//! - destination ports: `80`, `"80"` or `"8000-8100"` ([`parse_port_range`]);
//! - TCP flags: names `fin`, `syn`, `rst`, `psh`, `ack`, `urg`, `ece`, `cwr` separated by `,`
//!   or `|`, `!name` for a flag that must be clear. Exactly `"syn"` alone is shorthand for
//!   `"syn,!ack"`: a connection attempt, not a SYN-ACK ([`parse_tcp_flags`]);
//! - thresholds: `{ count = 2000, interval = "20m" }` or `{ bytes = "10MiB", interval = "1s" }`
//!   in the file, `2000/20m` or `10MiB/1s` on the command line ([`Threshold`]'s `FromStr`).
//!
//! Its modules, bottom-up: `values` (single values), `keywords` (the keyword enums), `rates`
//! (thresholds, the elastic factor), `matching` (what a rule matches), `rule`, `host` and `fleet` (the model, section by
//! section), `tree` (the TOML tree with positions), `validate` (the schema: the tree read into
//! a [`Config`]) and `exposure` (what a `[fleet]` section exposes).

use std::fmt;
use std::path::Path;

mod default_policy;
mod exposure;
mod fleet;
mod host;
mod keywords;
mod matching;
mod rates;
mod rule;
mod tree;
mod validate;
pub mod values;

pub use default_policy::{default_policy, host_resolvers, resolvers};
pub use exposure::fleet_warnings;
pub use fleet::*;
pub use host::*;
pub use keywords::*;
pub use matching::*;
pub use rates::*;
pub use rule::*;

#[cfg(test)]
mod tests;

pub use values::{
    MAX_BAN_DURATION, MIN_BYTE_AMOUNT, TcpFlags, Unit, aliases_ipv4, check_ban_duration,
    check_byte_burst, format_duration, labelled, parse_ban_duration, parse_bytes, parse_duration,
    parse_net, parse_port_range, parse_region, parse_tcp_flags,
};

/// A whole config file.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Config {
    pub daemon: Daemon,
    pub tracking: Tracking,
    pub lists: Lists,
    pub geoip: Option<GeoIp>,
    pub pressure: Pressure,
    /// `[fleet]`: `None` when the section is absent (no store is contacted).
    pub fleet: Option<Fleet>,
    /// In file order, which is evaluation order.
    pub rules: Vec<Rule>,
}

/// One problem in a config file. `line` and `col` are 1-based; `col` counts characters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    pub file: String,
    pub line: usize,
    pub col: usize,
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}:{}:{}: {}",
            self.file, self.line, self.col, self.message
        )
    }
}

impl std::error::Error for ConfigError {}

/// Every problem found, sorted by position. Displays one per line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigErrors(pub Vec<ConfigError>);

impl fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str("\n")?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

impl std::error::Error for ConfigErrors {}

/// Parses and validates config text. `file_name` only labels the errors.
pub fn parse(file_name: &str, text: &str) -> Result<Config, ConfigErrors> {
    let mut ck = tree::Checker::new(text);
    let config = match tree::parse_toml(text) {
        Ok(root) => Some(validate::build(&root, &mut ck)),
        Err((at, msg)) => {
            ck.error(at, format!("invalid TOML: {msg}"));
            None
        }
    };
    let errors = ck.into_errors(file_name);
    match config {
        Some(config) if errors.is_empty() => Ok(config),
        _ => Err(ConfigErrors(errors)),
    }
}

/// Reads and parses a config file. A read error is reported at 1:1.
pub fn load(path: &Path) -> Result<Config, ConfigErrors> {
    let file_name = path.display().to_string();
    match std::fs::read_to_string(path) {
        Ok(text) => parse(&file_name, &text),
        Err(e) => Err(ConfigErrors(vec![ConfigError {
            file: file_name,
            line: 1,
            col: 1,
            message: e.to_string(),
        }])),
    }
}
