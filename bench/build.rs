//! Builds the benchmark's XDP object (`bench-ebpf`) and leaves it in OUT_DIR for
//! `include_bytes_aligned!` (see `ratelimit-ebpf-build`: the daemon's object is built the same
//! way).
fn main() -> anyhow::Result<()> {
    ratelimit_ebpf_build::build("ratelimit-bench-ebpf")
}
