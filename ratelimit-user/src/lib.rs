//! The ratelimit daemon and its control client, as a library: the `ratelimit` binary is a thin
//! `main` over it, and the end-to-end tests load the same program object and read the same
//! map layouts through it.
//!
//! The modules form layers, each importing only from those below it (no import cycle: the
//! check is `cargo xtask test`'s, in `xtask/src/layers.rs`), bottom up:
//! 1. values with no dependency in the crate: `clock`, `config`, `durable`, `ban_notes`,
//!    `clients`, `kernel_log`, `local_addrs`, `http_slots`;
//! 2. `pressure`, `rx_cpus`, `ruleset`, `supervise`; then `events`, `known`;
//! 3. the kernel and the store: `datapath` (load, attach, pin, maps), `fleet` (the store, its
//!    trust, global counts, peers), `apply`, `lock`, `fleet_key`, `fleet_key_reads`;
//! 4. policy over the maps: `geoip`, `live`, `report`, `bans`;
//! 5. the API: `status`, `control` (the typed requests and answers, the socket);
//! 6. serving: `reader` (the reports), `http`; the command line, `cli`;
//! 7. `daemon`: the owner task, start-up and the supervised tasks.

pub mod apply;
pub mod ban_notes;
pub mod bans;
pub mod cli;
pub mod clients;
pub mod clock;
pub mod config;
pub mod control;
pub mod daemon;
pub mod datapath;
pub mod durable;
pub mod events;
pub mod fleet;
pub mod fleet_key;
pub mod fleet_key_reads;
pub mod geoip;
pub mod http;
pub mod http_slots;
pub mod kernel_log;
pub mod known;
pub mod live;
pub mod local_addrs;
pub mod lock;
pub mod pressure;
pub mod reader;
pub mod report;
pub mod ruleset;
pub mod rx_cpus;
pub mod status;
pub mod supervise;
