//! Rates: a threshold (`amount` per `interval`, in packets or bytes) and the elastic factor
//! that scales one while the host has room.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use super::values;
use super::{Unit, format_duration, parse_bytes, parse_duration};

/// A rate: `amount` packets or bytes per `interval`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Threshold {
    /// At least 1.
    pub amount: u64,
    pub unit: Unit,
    /// Greater than zero, at most `caps::MAX_INTERVAL_NS`.
    pub interval: Duration,
}

/// `2000/20m` for packets, `10485760B/1s` for bytes.
impl fmt::Display for Threshold {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let unit = match self.unit {
            Unit::Packets => "",
            Unit::Bytes => "B",
        };
        write!(
            f,
            "{}{unit}/{}",
            self.amount,
            format_duration(self.interval)
        )
    }
}

/// `COUNT/INTERVAL` as on the command line: `2000/20m` counts packets; a byte size with a unit
/// suffix (`10MiB/1s`, `1500B/1s`) counts bytes. Same limits as in the file.
impl FromStr for Threshold {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let Some((amount, interval)) = s.split_once('/') else {
            return Err(format!(
                "{s:?} is not a threshold; write COUNT/INTERVAL, e.g. \"2000/20m\" or \"10MiB/1s\""
            ));
        };
        let amount = amount.trim();
        let (amount, unit) = if !amount.is_empty() && amount.bytes().all(|b| b.is_ascii_digit()) {
            let n = amount
                .parse::<u64>()
                .map_err(|_| format!("{amount} is too large"))?;
            (n, Unit::Packets)
        } else {
            (parse_bytes(amount)?, Unit::Bytes)
        };
        if amount == 0 {
            return Err("the threshold amount must be at least 1".into());
        }
        let interval = parse_duration(interval)?;
        values::check_interval(interval).map_err(|e| format!("the interval {e}"))?;
        values::check_amount(amount, unit, interval)?;
        Ok(Threshold {
            amount,
            unit,
            interval,
        })
    }
}

/// `elastic = F`, F > 1: how far above its counts a rule (or override) lets clients go while
/// the host has room. Kept in thousandths (1.5 is 1500), so it compares exactly and scales
/// counts without floating point.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Elastic(u32);

impl Elastic {
    /// The largest factor: a hundred times the threshold is no longer a threshold.
    pub const MAX: u32 = 100;

    /// F from its number: greater than 1, at most [`Elastic::MAX`], at most three decimals.
    pub fn new(f: f64) -> Result<Elastic, String> {
        if !f.is_finite() || f <= 1.0 || f > Self::MAX as f64 {
            return Err(format!(
                "must be greater than 1 and at most {} (got {f}): the factor by which clients \
                 may exceed their threshold while the host has room",
                Self::MAX
            ));
        }
        let milli = (f * 1000.0).round();
        if (milli - f * 1000.0).abs() > 1e-6 || milli <= 1000.0 {
            return Err(format!("must have at most three decimals (got {f})"));
        }
        Ok(Elastic(milli as u32))
    }

    /// F in thousandths.
    pub fn milli(self) -> u32 {
        self.0
    }

    pub fn factor(self) -> f64 {
        self.0 as f64 / 1000.0
    }

    /// `n` times F, rounded down (never below `n`), saturating.
    pub fn scale(self, n: u64) -> u64 {
        let v = n as u128 * self.0 as u128 / 1000;
        v.clamp(n as u128, u64::MAX as u128) as u64
    }

    /// `t` times F (same unit and interval).
    pub fn scale_threshold(self, t: &Threshold) -> Threshold {
        Threshold {
            amount: self.scale(t.amount),
            ..*t
        }
    }
}

/// `1.5`, `2`: parses back to the same value.
impl fmt::Display for Elastic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.factor())
    }
}

impl FromStr for Elastic {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let f: f64 = s
            .trim()
            .parse()
            .map_err(|_| format!("{s:?} is not a number; write a factor such as 1.5 or 2"))?;
        Elastic::new(f)
    }
}

/// Why `elastic` is refused on a rule with `exceed_action = "pass"`.
pub const ELASTIC_WITH_PASS: &str = "has no effect with exceed_action = \"pass\": elastic only \
     changes which packets are dropped, and this rule drops none";
