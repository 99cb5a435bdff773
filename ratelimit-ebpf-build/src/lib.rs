//! The one place that knows how an XDP object of this workspace is built: from a build script,
//! with the nightly toolchain (`-Z build-std=core`, bpf-linker through the wrapper that
//! `.cargo/config.toml` names for the BPF target), into the build script's `OUT_DIR`, where
//! `include_bytes_aligned!` picks it up. The daemon's object (`ratelimit-user/build.rs`) and
//! the benchmark's (`bench/build.rs`) are both built by [`build`]. The recipe is aya-build's,
//! with one difference: the inner build's output is kept, not relayed line by line as cargo
//! warnings, so a build that succeeds prints none, and one that fails shows the whole log in
//! its error.
use std::{
    collections::BTreeSet,
    ffi::OsString,
    path::PathBuf,
    process::{Command, Stdio},
};

use anyhow::{Context as _, anyhow, bail};
use cargo_metadata::{Artifact, DependencyKind, Message, Metadata, MetadataCommand, Package};

/// Set to `1` (or `true`) to skip the object's build (for checks that do not need it).
const SKIP: &str = "AYA_BUILD_SKIP";

/// Build the bins of the workspace's eBPF package `name` in release for the BPF target, each to
/// `OUT_DIR/<bin name>`. Cargo reruns the calling build script when the package, or any
/// package of the workspace it depends on, changes: an eBPF package that compiles another's
/// library (as the benchmark's object does the program's) is rebuilt when that library's
/// sources change, which a host build dependency on it cannot see (every module of the
/// program is `cfg(target_arch = "bpf")`).
pub fn build(name: &str) -> anyhow::Result<()> {
    println!("cargo:rerun-if-env-changed={SKIP}");
    if std::env::var(SKIP).is_ok_and(|v| v == "1" || v.eq_ignore_ascii_case("true")) {
        println!("cargo:warning={SKIP}=1; skipping eBPF build");
        return Ok(());
    }
    let metadata = MetadataCommand::new()
        .no_deps()
        .exec()
        .context("MetadataCommand::exec")?;
    let package = workspace_package(&metadata, name)?;
    let root_dir = package_dir(package)?;
    println!("cargo:rerun-if-changed={root_dir}");
    for dir in workspace_dependency_dirs(&metadata, package)? {
        println!("cargo:rerun-if-changed={dir}");
    }
    let out_dir = PathBuf::from(std::env::var_os("OUT_DIR").context("OUT_DIR not set")?);
    let mut cmd = command(name, &out_dir)?;
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {cmd:?}"))?;
    let mut log = String::new();
    let mut executables = Vec::new();
    for message in Message::parse_stream(out.stdout.as_slice()) {
        match message.context("the inner cargo's JSON messages")? {
            Message::CompilerArtifact(Artifact {
                executable: Some(exe),
                target,
                ..
            }) => executables.push((target.name, exe.into_std_path_buf())),
            Message::CompilerMessage(m) => {
                log.push_str(&m.message.rendered.unwrap_or_default());
            }
            Message::TextLine(line) => {
                log.push_str(&line);
                log.push('\n');
            }
            _ => {}
        }
    }
    log.push_str(&String::from_utf8_lossy(&out.stderr));
    if !out.status.success() {
        bail!(
            "building the XDP object {name} failed ({}): {cmd:?}\n{log}",
            out.status
        );
    }
    for (bin, exe) in executables {
        let dst = out_dir.join(bin);
        std::fs::copy(&exe, &dst)
            .with_context(|| format!("copying {} to {}", exe.display(), dst.display()))?;
    }
    Ok(())
}

/// The inner build of package `name`: nightly cargo for the BPF target of the host's byte
/// order, `--cfg bpf_target_arch` the host's architecture, BTF in the object, a target
/// directory of its own under `out_dir` (cargo would otherwise wait on its own lock).
fn command(name: &str, out_dir: &std::path::Path) -> anyhow::Result<Command> {
    let var = |v: &str| std::env::var(v).with_context(|| format!("{v} not set"));
    let endian = var("CARGO_CFG_TARGET_ENDIAN")?;
    let target = match endian.as_str() {
        "little" => "bpfel-unknown-none",
        "big" => "bpfeb-unknown-none",
        e => bail!("unsupported endian {e}"),
    };
    let arch = var("CARGO_CFG_TARGET_ARCH")?;
    let arch = if arch.starts_with("riscv64") {
        "riscv64".to_string()
    } else {
        arch
    };
    let mut cmd = Command::new("rustup");
    cmd.args([
        "run",
        "nightly",
        "cargo",
        "build",
        "--package",
        name,
        "--bins",
    ])
    .args(["--message-format=json", "--release", "--target", target])
    .args(["-Z", "build-std=core"])
    .arg("--target-dir")
    .arg(out_dir.join("aya-build").join("target").join(name));
    let mut flags = OsString::new();
    for (i, f) in [
        format!("--cfg=bpf_target_arch=\"{arch}\""),
        "-Cdebuginfo=2".into(),
        "-Clink-arg=--btf".into(),
    ]
    .iter()
    .enumerate()
    {
        if i > 0 {
            flags.push("\x1f");
        }
        flags.push(f);
    }
    cmd.env("CARGO_ENCODED_RUSTFLAGS", flags);
    // The nightly toolchain's own compiler, not the outer build's.
    for key in ["RUSTC", "RUSTC_WORKSPACE_WRAPPER"] {
        cmd.env_remove(key);
    }
    Ok(cmd)
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
