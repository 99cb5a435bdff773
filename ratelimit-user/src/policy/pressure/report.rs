//! The answer to `pressure` and `pressure set`, and the operator's mode as saved in
//! `state_dir`.

use serde::{Deserialize, Serialize};

use super::level::{Level, Mode, Reading};

/// The answer to `pressure` and `pressure set`.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Default)]
pub struct Report {
    /// The level in force.
    pub level: Level,
    /// `auto`: the signals decide; `high` or `low`: forced by the operator.
    pub mode: Mode,
    /// What the signals alone say.
    pub auto_level: Level,
    /// Since when the level has been what it is (RFC 3339).
    pub since: String,
    /// When a signal was last above its mark (RFC 3339).
    pub last_above: Option<String>,
    /// How long the level stays high after the last signal above its mark.
    pub hold_secs: f64,
    /// The CPUs watched; empty = every online CPU.
    pub cpus: Vec<u32>,
    pub signals: Vec<Reading>,
    /// Changes of the level since the daemon started.
    pub transitions: u64,
    /// Why the operator's mode could not be saved (it is in force until the daemon stops).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub not_saved: Option<String>,
    /// The level the XDP program holds now, read back from its map: `low` puts the elastic
    /// limits of rules and overrides with `elastic` in force, `high` their thresholds.
    /// `None` if the map could not be read.
    #[serde(default)]
    pub data_plane: Option<Level>,
}

/// The operator's mode as saved in `state_dir`.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
pub struct Saved {
    pub mode: Mode,
}
