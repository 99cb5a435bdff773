//! The ratelimit XDP program.
//!
//! Per packet: parse (`parse`; from the IP header on devices without one, `ratelimit_l3`),
//! then this tick's fast-drop entry (`fast`) → allow list → deny list → active ban (`bans`)
//! → rules in file order (`policy`, `rules`, with `matching` for what a rule asks of the
//! frame and `conn` for `tcp_state`), write the lines of any rare condition the rules
//! met (`rare`), record the verdict in the per-CPU counters and return. Every exit goes
//! through `program::finish`, so every frame is counted in exactly one verdict counter.
//!
//! The program is this library. Its entry points (`program.rs`), maps, global functions and
//! license are exported symbols, so an object that links the library carries all of them,
//! compiled once, unchanged. The daemon's object (`main.rs`) links it and nothing else; the
//! benchmark's (`bench-ebpf/`) links it beside programs of its own, with the few items below
//! that those build on.
#![no_std]
#![cfg_attr(target_arch = "bpf", feature(core_intrinsics, asm_experimental_arch))]
#![cfg_attr(
    target_arch = "bpf",
    expect(internal_features, reason = "BPF atomics, see atomic.rs")
)]
// Every `unsafe` in the program says why it is sound: the workspace's lint policy
// (`Cargo.toml`), which clippy on the BPF target (`cargo xtask test`, step 2) enforces.

#[cfg(target_arch = "bpf")]
mod admission;
#[cfg(target_arch = "bpf")]
pub mod atomic;
#[cfg(target_arch = "bpf")]
mod bans;
#[cfg(target_arch = "bpf")]
pub mod clock;
#[cfg(target_arch = "bpf")]
mod conn;
#[cfg(target_arch = "bpf")]
mod cookies;
#[cfg(target_arch = "bpf")]
mod events;
#[cfg(target_arch = "bpf")]
mod fast;
#[cfg(target_arch = "bpf")]
mod known;
#[cfg(target_arch = "bpf")]
mod matching;
#[cfg(target_arch = "bpf")]
mod meters;
#[cfg(target_arch = "bpf")]
pub mod parse;
#[cfg(target_arch = "bpf")]
pub mod policy;
#[cfg(target_arch = "bpf")]
pub mod program;
#[cfg(target_arch = "bpf")]
mod rare;
#[cfg(target_arch = "bpf")]
mod rules;
#[cfg(target_arch = "bpf")]
mod scratch;
#[cfg(target_arch = "bpf")]
mod state;
#[cfg(target_arch = "bpf")]
mod stats;
#[cfg(target_arch = "bpf")]
mod store;

/// How a packet finds its client's state: the key, and the lookup without admission or
/// insert.
#[cfg(target_arch = "bpf")]
pub use state::{client_key, client_state};

#[cfg(target_arch = "bpf")]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[cfg(target_arch = "bpf")]
#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
