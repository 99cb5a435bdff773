//! Builds the XDP program (`ratelimit-ebpf`) and leaves the object in OUT_DIR for
//! `include_bytes_aligned!` (see `ratelimit-ebpf-build`).
fn main() -> anyhow::Result<()> {
    ratelimit_ebpf_build::build("ratelimit-ebpf")
}
