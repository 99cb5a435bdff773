//! Builds the XDP program with aya-build (nightly, bpf-linker) and leaves the object in OUT_DIR
//! for `include_bytes_aligned!`.
use anyhow::{Context as _, anyhow};
use aya_build::Toolchain;

fn main() -> anyhow::Result<()> {
    let cargo_metadata::Metadata { packages, .. } = cargo_metadata::MetadataCommand::new()
        .no_deps()
        .exec()
        .context("MetadataCommand::exec")?;
    let ebpf_package = packages
        .into_iter()
        .find(|cargo_metadata::Package { name, .. }| name.as_str() == "ratelimit-ebpf")
        .ok_or_else(|| anyhow!("ratelimit-ebpf package not found"))?;
    let cargo_metadata::Package {
        name,
        manifest_path,
        ..
    } = ebpf_package;
    let root_dir = manifest_path
        .parent()
        .ok_or_else(|| anyhow!("no parent for {manifest_path}"))?
        .as_str();
    let ebpf_package = aya_build::Package {
        name: name.as_str(),
        root_dir,
        ..Default::default()
    };
    aya_build::build_ebpf([ebpf_package], Toolchain::default())
}
