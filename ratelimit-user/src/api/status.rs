//! The answer to `status` (the daemon, its program, interfaces, rules and the counts that take
//! a walk): the types the control API and the HTTP listener send, and the CLI reads.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::{kernel::datapath::Attached, policy::bans, supervise};

/// The answer to `status`: the daemon, its program and interfaces, and the counts that take a
/// walk (from the latest census).
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct Status {
    pub version: String,
    pub pid: u32,
    /// When the daemon started (RFC 3339).
    pub started: String,
    /// The config file, if the daemon was started with one.
    pub config: Option<String>,
    /// The policy in force: `"config"` (the file's), or `"default"` without a config file (the
    /// embedded default policy, which `ratelimit check-config --print-default` prints).
    pub policy: String,
    /// The daemon took over the maps and program a previous daemon pinned.
    pub adopted_pinned_state: bool,
    pub bpffs_dir: String,
    /// `ratelimit run --preview`: nothing is dropped.
    pub preview_all: bool,
    pub interfaces: Vec<Attached>,
    pub program: Option<Program>,
    /// The rules, in evaluation order.
    pub rules: Vec<String>,
    /// Each rule's threshold and elastic factor, and the threshold in force now.
    #[serde(default)]
    pub thresholds: Vec<RuleThreshold>,
    pub tracked_clients: u64,
    pub max_sources: u32,
    /// The new-source admission budget in force (`[tracking]`).
    #[serde(default)]
    pub admission: Admission,
    pub active_bans: u64,
    /// The known-sources filter's last rebuild.
    pub known_filter: Option<crate::kernel::known::Rebuilt>,
    pub events: crate::events::Status,
    /// The supervised background tasks, by name.
    pub tasks: BTreeMap<String, supervise::TaskHealth>,
    pub bans_restore: bans::RestoreReport,
    pub live_changes: crate::policy::live::Report,
    /// The pressure level and its signals.
    #[serde(default)]
    pub pressure: crate::policy::pressure::Report,
}

/// The new-source admission budget in force: at most `new_sources_per_sec` never-seen sources a
/// second get state of their own (bursts of `new_sources_burst`); 0 for no budget. `auto`:
/// derived from `max_sources` (`new_sources_per_sec = "auto"`, the default).
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Admission {
    pub new_sources_per_sec: u64,
    pub new_sources_burst: u64,
    pub auto: bool,
}

impl From<&crate::config::Tracking> for Admission {
    fn from(t: &crate::config::Tracking) -> Self {
        Admission {
            new_sources_per_sec: t.new_sources_per_sec,
            new_sources_burst: if t.new_sources_per_sec == 0 {
                0
            } else {
                t.new_sources_burst
            },
            auto: t.new_sources_auto,
        }
    }
}

/// The loaded program's size, as the verifier saw it.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
pub struct Program {
    pub xlated_insns: u32,
    pub verified_insns: u32,
}

/// A rule's threshold in force now, for `status`.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct RuleThreshold {
    pub rule: String,
    /// As configured (or set live).
    pub threshold: String,
    /// `elastic = F`, if the rule has it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub elastic: Option<f64>,
    /// The threshold times F while the pressure level is low, the threshold itself while it
    /// is high (or without elastic).
    pub threshold_now: String,
}
