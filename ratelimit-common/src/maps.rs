//! Key and value layouts of the maps the daemon writes and the XDP program reads (and the
//! per-client state the program writes and the daemon reads). All `#[repr(C)]`, padding made
//! explicit so nothing uninitialised crosses the kernel boundary.
//!
//! By map: `rule` (`RULES`), `global` (`GLOBAL`, `ADMISSION`), `lists` (`RL_SOURCES`, `RL_DESTS`), `matching` (a rule's match fields),
//! `fast` (`RL_FAST`), `client` (the per-client state), `known` (`RL_KNOWN` and the
//! placement hash), `store` (`RL_CLIENTS`), `bans` (the ban tables) and `overrides`
//! (the override maps). Every item is re-exported here, where callers name it.

mod bans;
mod client;
mod fast;
mod global;
mod known;
mod lists;
mod matching;
mod overrides;
mod rule;
mod store;

pub use bans::*;
pub use client::*;
pub use fast::*;
pub use global::*;
pub use known::*;
pub use lists::*;
pub use matching::*;
pub use overrides::*;
pub use rule::*;
pub use store::*;

#[cfg(test)]
mod tests;
