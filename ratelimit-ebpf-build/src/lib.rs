//! The one place that knows how an XDP object of this workspace is built: from a build script,
//! with aya-build (nightly, `-Z build-std=core`, bpf-linker through the wrapper that
//! `.cargo/config.toml` names for the BPF target), into the build script's `OUT_DIR`, where
//! `include_bytes_aligned!` picks it up. The daemon's object (`ratelimit-user/build.rs`) and
//! the benchmark's (`bench/build.rs`) are both built by [`build`].
use std::collections::BTreeSet;

use anyhow::{Context as _, anyhow};
use aya_build::Toolchain;
use cargo_metadata::{DependencyKind, Metadata, MetadataCommand, Package};

/// Build the bins of the workspace's eBPF package `name` in release for the BPF target, each to
/// `OUT_DIR/<bin name>`. Cargo reruns the calling build script when the package, or any
/// package of the workspace it depends on, changes: an eBPF package that compiles another's
/// library (as the benchmark's object does the program's) is rebuilt when that library's
/// sources change, which a host build dependency on it cannot see (every module of the
/// program is `cfg(target_arch = "bpf")`).
pub fn build(name: &str) -> anyhow::Result<()> {
    let metadata = MetadataCommand::new()
        .no_deps()
        .exec()
        .context("MetadataCommand::exec")?;
    let package = workspace_package(&metadata, name)?;
    let root_dir = package_dir(package)?;
    for dir in workspace_dependency_dirs(&metadata, package)? {
        println!("cargo:rerun-if-changed={dir}");
    }
    let package = aya_build::Package {
        name,
        root_dir,
        ..Default::default()
    };
    aya_build::build_ebpf([package], Toolchain::default())
}

fn workspace_package<'a>(metadata: &'a Metadata, name: &str) -> anyhow::Result<&'a Package> {
    metadata
        .packages
        .iter()
        .find(|p| p.name.as_str() == name)
        .ok_or_else(|| anyhow!("package {name} not found in the workspace"))
}

fn package_dir(package: &Package) -> anyhow::Result<&str> {
    Ok(package
        .manifest_path
        .parent()
        .ok_or_else(|| anyhow!("no parent for {}", package.manifest_path))?
        .as_str())
}

/// The directories of the workspace packages `package` depends on, directly or not
/// (aya-build watches `package`'s own).
fn workspace_dependency_dirs<'a>(
    metadata: &'a Metadata,
    package: &'a Package,
) -> anyhow::Result<BTreeSet<&'a str>> {
    let mut dirs = BTreeSet::new();
    let mut todo = vec![package];
    while let Some(p) = todo.pop() {
        for dep in &p.dependencies {
            if dep.path.is_none() || dep.kind != DependencyKind::Normal {
                continue;
            }
            let dep = workspace_package(metadata, &dep.name)?;
            if dirs.insert(package_dir(dep)?) {
                todo.push(dep);
            }
        }
    }
    Ok(dirs)
}
