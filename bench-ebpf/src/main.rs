//! The benchmark's XDP object. It links the program exactly as the daemon's object does (the
//! `ratelimit-ebpf` library: the entry points `ratelimit` and `ratelimit_l3`, every map and
//! global function, compiled once, unchanged), and adds what only the benchmark loads:
//!
//! * `vary.rs`: per-run source variation, and `ratelimit_varied`, the daemon's Ethernet entry
//!   behind it;
//! * `reference.rs`: reference programs (XDP_PASS, XDP_DROP, our parser) and floors (the
//!   clock, one per-client lookup, a line per source);
//! * `generator.rs`: the live-frames flood generator, `gen_flood`.
//!
//! Built by `bench/build.rs` through the same recipe as the daemon's object
//! (`ratelimit-ebpf-build`); none of this reaches the daemon's object.
#![cfg_attr(target_arch = "bpf", no_std)]
#![cfg_attr(target_arch = "bpf", no_main)]
// As in the program: every `unsafe` says why it is sound (the workspace's lint policy).

#[cfg(target_arch = "bpf")]
mod generator;
#[cfg(target_arch = "bpf")]
mod reference;
#[cfg(target_arch = "bpf")]
mod vary;

#[cfg(not(target_arch = "bpf"))]
fn main() {}
