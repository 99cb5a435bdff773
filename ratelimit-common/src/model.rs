//! A host-side model of the XDP program's whole verdict pipeline, for differential testing:
//! the fuzz test (`tests/tests/fuzz.rs`) runs the same frames through the real object with
//! BPF_PROG_TEST_RUN and through this model, and compares the XDP action and the deltas of
//! every per-CPU counter (`crate::stats`) frame by frame.
//!
//! It restates what `ratelimit-ebpf/src/{main,parse,limit}.rs` do, one function per stage
//! ([`parse_l2`], [`parse_ipv4`], [`parse_ipv6`], [`parse_l4`], [`Model::lists`],
//! [`Model::active_ban`], [`rule_matches`], [`Model::apply_rule`], [`limit_check`]), so a change
//! of semantics in one stage is a change of one function here. The arithmetic is not restated:
//! it is the same `crate::limiter` the program calls, and the model consumes the very map
//! values the daemon writes (`RuleConfig`, `GlobalConfig`, the sources trie's `ListValue`s,
//! `OverrideValue`s, `BanEntry`s), so the config → maps step is the real one too. The pressure
//! level is `GlobalConfig::relaxed`, as the program reads it: rules and overrides with
//! `elastic` meter against their elastic limit while it is set (`RuleConfig::limit_now`;
//! without elastic, that is the limit itself).
//!
//! What it leaves out, on purpose, because it cannot change a verdict or a counter of the
//! configurations it is meant for:
//! * The fast-drop tables (`fast.rs`): by design they give the verdicts and counters of the
//!   full evaluation, which is exactly what the comparison checks.
//! * Time: one `now` for a whole run. The caller keeps every window edge out of the run (see
//!   the fuzz test), uses token buckets of packets whose emission interval is longer than the
//!   run, and rules on the coarse clock. Bans do not expire within a run.
//! * The admission budget and store eviction: the caller configures no budget
//!   (`new_sources_per_sec = 0`) and a store far larger than the sources it sends, so every
//!   new key gets a state (`STATE_CREATED`), never `ADMISSION_REFUSED` or `STATE_EVICTED`.
//! * Events: they change no counter except `EVENTS_LOST`, which the caller prevents by
//!   draining the ring buffer.
//! * `key = "region"` rules (no GeoIP map): [`Model::new`] refuses them.
//! * Lost compare-and-swap races (`CONTENDED`): one CPU runs one frame at a time.
//!
//! Its modules, bottom-up: `parse`, `rules` (matching), `meters`, `counters`, and `program`
//! (the pipeline over them); every item is re-exported here.

extern crate std;

mod counters;
mod meters;
mod parse;
mod program;
mod rules;

use std::{format, string::String};

pub use counters::*;
pub use meters::*;
pub use parse::*;
pub use program::*;
pub use rules::*;

pub use crate::proto::*;

/// XDP actions the program returns.
pub const XDP_DROP: u32 = 1;
pub const XDP_PASS: u32 = 2;

/// A frame as lowercase hex, 32 bytes a line, for failure reports and regression files.
pub fn hex_dump(frame: &[u8]) -> String {
    let mut s = String::new();
    for (i, chunk) in frame.chunks(32).enumerate() {
        s.push_str(&format!("{:04x}: ", i * 32));
        for b in chunk {
            s.push_str(&format!("{b:02x}"));
        }
        s.push('\n');
    }
    s
}

#[cfg(test)]
mod tests;
