//! The ratelimit daemon and its control client, as a library: the `ratelimit` binary is a thin
//! `main` over it, and the end-to-end tests load the same program object and read the same
//! map layouts through it.
//!
//! The modules form layers, each importing only from those below it (no import cycle: the
//! check is `cargo xtask test`'s, in `xtask/src/layers.rs`), bottom up:
//! 1. values with no dependency in the crate: `clock`, `durable`, `config`, `supervise`;
//! 2. `kernel`: the program and its maps (load, attach, pin, per-client state, the
//!    known-sources filter, the host's addresses, the receive CPUs, the program's log);
//! 3. `policy`: the config turned into map contents, live changes, bans, GeoIP, pressure, and
//!    the data plane read back;
//! 4. `events`: event lines for L7 systems;
//! 5. `fleet`: the shared store, its trust, bans shared across hosts, global counts, peers;
//! 6. `api`: the typed requests and answers;
//! 7. `serve`: the control socket, the reports off the owner task, the HTTP listener;
//! 8. `daemon`: the owner task, start-up and the supervised tasks, the lock; `cli`: the
//!    command line.

pub mod api;
pub mod cli;
pub mod clock;
pub mod config;
pub mod daemon;
pub mod durable;
pub mod events;
pub mod fleet;
pub mod kernel;
pub mod policy;
pub mod serve;
pub mod supervise;
