//! The ratelimit daemon and its control client, as a library: the `ratelimit` binary is a thin
//! `main` over it, and the end-to-end tests load the same program object and read the same
//! map layouts through it.

pub mod apply;
pub mod ban_notes;
pub mod bans;
pub mod cli;
pub mod clients;
pub mod config;
pub mod control;
pub mod daemon;
pub mod datapath;
pub mod durable;
pub mod events;
pub mod fleet;
pub mod fleet_key;
pub mod fleet_key_reads;
pub mod fleet_trust;
pub mod geoip;
pub mod global;
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
pub mod supervise;
