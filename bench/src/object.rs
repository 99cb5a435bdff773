//! The benchmark's XDP object (`bench-ebpf/`, built by `build.rs`): the program exactly as the
//! daemon's object has it, plus the benchmark's own programs and maps.

use std::path::Path;

use ratelimit_user::kernel::datapath::Datapath;

/// The object, embedded as the daemon embeds its own.
static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/ratelimit-bench"));

/// The daemon's Ethernet entry, the same code as in the daemon's object.
pub const OURS: &str = "ratelimit";
/// The same entry behind the per-run source variation (`bench-ebpf/src/vary.rs`): what the
/// cases that turn the variation on run.
pub const OURS_VARIED: &str = "ratelimit_varied";

/// Load the object as the daemon loads its own (maps pinned in `pin_dir`, per-source maps
/// sized for `max_sources`), with the memory floors' arrays (a line per source) as large.
pub fn load(pin_dir: &Path, max_sources: u32) -> anyhow::Result<Datapath> {
    Datapath::load_with(pin_dir, max_sources, |loader| {
        loader
            .map_max_entries("RL_BENCH_LINES64", max_sources)
            .map_max_entries("RL_BENCH_LINES16", max_sources)
            .load(OBJECT)
    })
}
