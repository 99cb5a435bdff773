//! `cargo xtask vm`: boots one of the kernels the program must load on (Debian 12's 6.1, its
//! 6.12, the newest in trixie-backports) under qemu and runs a command inside it.
//!
//! The host's KVM cannot boot stock kernels (see /work/shared/TOOLCHAIN.md, "Booting other
//! kernels"), so the guest runs under qemu's software emulation, single-threaded TCG (the
//! multi-threaded one oopsed in text_poke in 2 of 15 boots). The kernels come from Debian's
//! archive as .debs through a private apt configuration, so the host's own sources do not
//! matter; they are unpacked once into a cache ([`cache_dir`]) and reused.
//!
//! The guest needs no disk image: its root is the host's `/`, shared read-only over 9p as the
//! lower layer of an overlay with a tmpfs on top, so the command runs with the host's
//! binaries, libraries and paths, and whatever it writes vanishes with the guest. A second,
//! writable 9p share (the run directory) carries the command's output and exit status back;
//! the host copies the output to its stdout as it grows. A static busybox in a small
//! initramfs loads the modules the root needs (6.1 builds virtio-pci, 9p and overlay as
//! modules) and switches to the overlay, where the kernel's own modules are bind-mounted at
//! `/lib/modules/$(uname -r)` so that `ip link add ... type veth` loads veth as on a host.

use std::ffi::OsString;
use std::fmt::Write as _;
use std::io::{Read as _, Seek as _, SeekFrom, Write as _};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};
use clap::Args;

use crate::{setup, util};

/// Where a kernel comes from.
#[derive(Debug, Clone, Copy)]
enum Package {
    /// This exact image package: its numbers in docs/kernels.md are for this build.
    Exact(&'static str),
    /// Whatever image package `linux-image-amd64` of the suite depends on today.
    Newest,
}

/// A kernel the program is tested on.
#[derive(Debug, Clone, Copy)]
pub struct Kernel {
    /// The name `--kernel` takes and the test step prints.
    pub name: &'static str,
    /// The Debian suite that has it.
    suite: &'static str,
    package: Package,
}

/// The kernels `cargo xtask test` boots: the oldest docs/kernels.md promises (Debian 12's own),
/// Debian 12's newer one, and the newest Debian ships at all.
pub const KERNELS: &[Kernel] = &[
    Kernel {
        name: "6.1",
        suite: "bookworm-security",
        package: Package::Exact("linux-image-6.1.0-56-amd64"),
    },
    Kernel {
        name: "6.12",
        suite: "bookworm-security",
        package: Package::Exact("linux-image-6.12.117+deb12-amd64"),
    },
    Kernel {
        name: "backports",
        suite: "trixie-backports",
        package: Package::Newest,
    },
];

/// The default time limit of one guest run (boot, command, power-off).
const DEFAULT_TIMEOUT_S: u64 = 30 * 60;

#[derive(Debug, Args)]
pub struct Options {
    /// Which kernel to boot: 6.1, 6.12 or backports (the newest in trixie-backports).
    #[arg(long, default_value = "6.1")]
    pub kernel: String,
    /// Environment for the command in the guest, `NAME=VALUE` (repeatable).
    #[arg(long = "env", value_name = "NAME=VALUE")]
    pub env: Vec<String>,
    /// Give up (and fail) after this many seconds.
    #[arg(long, default_value_t = DEFAULT_TIMEOUT_S)]
    pub timeout: u64,
    /// The command to run in the guest, with its arguments (after `--`). The guest has no
    /// terminal: for a shell, pass a script (`sh -c '...'`).
    #[arg(last = true, required = true, value_name = "COMMAND")]
    pub command: Vec<String>,
}

pub fn run(options: Options) -> Result<()> {
    setup::ensure()?;
    let kernel = find(&options.kernel)?;
    let env = options
        .env
        .iter()
        .map(|pair| {
            pair.split_once('=')
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .with_context(|| format!("--env {pair}: expected NAME=VALUE"))
        })
        .collect::<Result<Vec<_>>>()?;
    let command: Vec<OsString> = options.command.iter().map(OsString::from).collect();
    let prepared = prepare(kernel)?;
    let run = boot(
        &prepared,
        &command,
        &env,
        Duration::from_secs(options.timeout),
        true,
    )?;
    println!(
        "vm: kernel {} ({}): command exited with status {} after {:.1} s",
        kernel.name,
        prepared.release,
        run.status,
        run.elapsed.as_secs_f64()
    );
    if run.status != 0 {
        bail!("the command failed in the guest (status {})", run.status);
    }
    Ok(())
}

/// The kernel called `name` in [`KERNELS`].
pub fn find(name: &str) -> Result<Kernel> {
    KERNELS
        .iter()
        .find(|k| k.name == name)
        .copied()
        .with_context(|| {
            let names: Vec<&str> = KERNELS.iter().map(|k| k.name).collect();
            format!(
                "unknown kernel {name:?}: choose one of {}",
                names.join(", ")
            )
        })
}

/// The kernel cache: `$RATELIMIT_KERNEL_CACHE`, else `/var/cache/ratelimit/kernels` (outside
/// `target/`, so that `cargo clean` and other worktrees do not fetch them again).
fn cache_dir() -> PathBuf {
    std::env::var_os("RATELIMIT_KERNEL_CACHE").map_or_else(
        || PathBuf::from("/var/cache/ratelimit/kernels"),
        PathBuf::from,
    )
}

/// A kernel unpacked and ready to boot.
#[derive(Debug)]
pub struct Prepared {
    /// `uname -r` in the guest, e.g. `6.1.0-56-amd64`.
    pub release: String,
    /// The image package's version, e.g. `6.1.192-2`.
    pub version: String,
    /// The kernel qemu boots: the uncompressed vmlinux when it could be taken out of the
    /// bzImage (its PVH entry boots about 3 s sooner under TCG), else the bzImage.
    image: PathBuf,
    /// `lib/modules/RELEASE` of the unpacked packages, with modules.dep.
    modules: PathBuf,
    initramfs: PathBuf,
}

/// A private apt configuration for one suite: its own sources list, indexes and cache, so the
/// host's sources (and their state) neither matter nor change.
struct Apt {
    root: PathBuf,
}

impl Apt {
    fn new(suite: &str) -> Result<Self> {
        let root = cache_dir().join("apt").join(suite);
        for dir in ["lists/partial", "cache/archives/partial", "parts"] {
            std::fs::create_dir_all(root.join(dir))
                .with_context(|| format!("creating {}", root.join(dir).display()))?;
        }
        let archive = if suite.ends_with("-security") {
            "http://deb.debian.org/debian-security"
        } else {
            "http://deb.debian.org/debian"
        };
        let line = format!(
            "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] {archive} {suite} main\n"
        );
        std::fs::write(root.join("sources.list"), line).context("writing the sources list")?;
        Ok(Self { root })
    }

    fn command(&self, program: &str) -> Command {
        let mut cmd = Command::new(program);
        let root = &self.root;
        for (key, value) in [
            ("Dir::Etc::SourceList", root.join("sources.list")),
            ("Dir::Etc::SourceParts", root.join("parts")),
            ("Dir::Etc::PreferencesParts", root.join("parts")),
            ("Dir::Etc::Preferences", root.join("parts/none")),
            ("Dir::State::Lists", root.join("lists")),
            ("Dir::Cache", root.join("cache")),
            ("Dir::State::status", PathBuf::from("/dev/null")),
            // The cache belongs to root: download as root rather than as `_apt`.
            ("APT::Sandbox::User", PathBuf::from("root")),
        ] {
            cmd.arg("-o").arg(format!("{key}={}", value.display()));
        }
        cmd
    }

    fn update(&self) -> Result<()> {
        util::output(self.command("apt-get").args(["-q", "update"]))
            .map(drop)
            .with_context(|| format!("apt-get update for {}", self.root.display()))
    }

    /// `Depends:` of a package (names only, alternatives flattened).
    fn depends(&self, package: &str) -> Result<Vec<String>> {
        let out =
            util::output(
                self.command("apt-cache")
                    .args(["show", "--no-all-versions", package]),
            )
            .with_context(|| format!("apt-cache show {package}"))?;
        Ok(parse_depends(&out))
    }

    fn version(&self, package: &str) -> Result<String> {
        let out =
            util::output(
                self.command("apt-cache")
                    .args(["show", "--no-all-versions", package]),
            )?;
        out.lines()
            .find_map(|line| line.strip_prefix("Version: "))
            .map(str::to_string)
            .with_context(|| format!("apt-cache show {package}: no Version"))
    }
}

/// The package names in a `Depends:` field of `apt-cache show` output.
fn parse_depends(show: &str) -> Vec<String> {
    let Some(field) = show.lines().find_map(|line| line.strip_prefix("Depends: ")) else {
        return Vec::new();
    };
    field
        .split([',', '|'])
        .filter_map(|dep| dep.split_whitespace().next())
        .map(str::to_string)
        .collect()
}

/// The image package of `kernel` and the packages it is split into (from 6.17 on Debian ships
/// the kernel binary and its modules as `linux-binary-*` and `linux-modules-*`).
fn packages(apt: &Apt, kernel: &Kernel) -> Result<Vec<String>> {
    let image = match kernel.package {
        Package::Exact(name) => name.to_string(),
        Package::Newest => apt
            .depends("linux-image-amd64")?
            .into_iter()
            .find(|dep| dep.starts_with("linux-image-"))
            .with_context(|| {
                format!(
                    "linux-image-amd64 in {} depends on no linux-image-* package",
                    kernel.suite
                )
            })?,
    };
    let mut all = vec![image.clone()];
    let depends = apt.depends(&image).with_context(|| {
        format!(
            "{image} is not in {}: Debian may have replaced it; put the current package \
             (`apt-cache policy linux-image-amd64`) in xtask/src/vm.rs",
            kernel.suite
        )
    })?;
    all.extend(
        depends
            .into_iter()
            .filter(|dep| dep.starts_with("linux-binary-") || dep.starts_with("linux-modules-")),
    );
    Ok(all)
}

/// Downloads (once) and unpacks (once) the kernel, and builds its initramfs.
pub fn prepare(kernel: Kernel) -> Result<Prepared> {
    let apt = Apt::new(kernel.suite)?;
    // The newest kernel is looked up every time; an exact one only when it is not cached.
    let marker = cache_dir().join(format!("{}.package", kernel.name));
    let cached = std::fs::read_to_string(&marker).ok();
    let image = match (kernel.package, &cached) {
        (Package::Exact(name), Some(line)) if line.starts_with(&format!("{name} ")) => {
            line.trim().to_string()
        }
        _ => {
            let resolved = apt.update().and_then(|()| {
                let packages = packages(&apt, &kernel)?;
                let version = apt.version(&packages[0])?;
                Ok((packages, version))
            });
            match (resolved, &cached) {
                (Ok((packages, version)), _) => {
                    let dir = unpack(&apt, &packages)?;
                    let line = format!("{} {version} {}", packages[0], dir.display());
                    std::fs::write(&marker, format!("{line}\n"))
                        .with_context(|| format!("writing {}", marker.display()))?;
                    line
                }
                (Err(error), Some(line)) => {
                    println!(
                        "vm: cannot look up kernel {} ({error:#}); using the cached {}",
                        kernel.name,
                        line.trim()
                    );
                    line.trim().to_string()
                }
                (Err(error), None) => return Err(error),
            }
        }
    };
    let mut words = image.split(' ');
    let (Some(_package), Some(version), Some(dir)) = (words.next(), words.next(), words.next())
    else {
        bail!("{} is malformed: remove it", marker.display());
    };
    let dir = PathBuf::from(dir);
    let modules_root = dir.join("lib/modules");
    let release = std::fs::read_dir(&modules_root)
        .with_context(|| format!("reading {}", modules_root.display()))?
        .filter_map(|entry| entry.ok())
        .map(|entry| entry.file_name().to_string_lossy().into_owned())
        .next()
        .with_context(|| format!("no kernel release under {}", modules_root.display()))?;
    let modules = modules_root.join(&release);
    let image = kernel_image(&dir, &release)?;
    let initramfs = dir.join("ratelimit-initramfs.cpio");
    if !initramfs.is_file() {
        build_initramfs(&dir, &release, &initramfs)?;
    }
    Ok(Prepared {
        release,
        version: version.to_string(),
        image,
        modules,
        initramfs,
    })
}

/// Downloads the packages and unpacks them into one directory of the cache (named after the
/// image package); skips both when that directory is complete.
fn unpack(apt: &Apt, packages: &[String]) -> Result<PathBuf> {
    let dir = cache_dir().join(&packages[0]);
    if dir.join(".complete").is_file() {
        return Ok(dir);
    }
    let debs = cache_dir().join("debs");
    std::fs::create_dir_all(&debs)?;
    let partial = cache_dir().join(format!("{}.partial", packages[0]));
    let _ = std::fs::remove_dir_all(&partial);
    std::fs::create_dir_all(&partial)?;
    for package in packages {
        println!("vm: downloading {package} ...");
        util::run(
            apt.command("apt-get")
                .args(["-q", "download", package])
                .current_dir(&debs),
        )
        .with_context(|| format!("downloading {package}"))?;
        let deb = std::fs::read_dir(&debs)?
            .filter_map(|entry| entry.ok())
            .map(|entry| entry.path())
            .find(|path| {
                path.file_name()
                    .and_then(|name| name.to_str())
                    .is_some_and(|name| {
                        name.starts_with(&format!("{package}_")) && name.ends_with(".deb")
                    })
            })
            .with_context(|| format!("apt-get download {package} left no .deb"))?;
        util::run(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&partial))
            .with_context(|| format!("unpacking {}", deb.display()))?;
        std::fs::remove_file(&deb)?;
    }
    // From 6.17 on (merged /usr) the modules and the kernel are in /usr/lib/modules/RELEASE:
    // `lib` -> `usr/lib` gives every kernel one layout (and depmod -b its usual path).
    if !partial.join("lib").exists() && partial.join("usr/lib/modules").is_dir() {
        std::os::unix::fs::symlink("usr/lib", partial.join("lib"))?;
    }
    let modules_root = partial.join("lib/modules");
    for entry in std::fs::read_dir(&modules_root)
        .with_context(|| format!("{} has no lib/modules", packages[0]))?
    {
        let release = entry?.file_name();
        // The packages ship no modules.dep: their maintainer scripts run depmod.
        util::run(Command::new("depmod").arg("-b").arg(&partial).arg(&release))
            .context("depmod")?;
    }
    std::fs::write(partial.join(".complete"), "")?;
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::rename(&partial, &dir)
        .with_context(|| format!("moving {} to {}", partial.display(), dir.display()))?;
    Ok(dir)
}

/// The uncompressed vmlinux taken out of `boot/vmlinuz-RELEASE` (made once), else the
/// bzImage itself.
fn kernel_image(dir: &Path, release: &str) -> Result<PathBuf> {
    let bzimage = [
        dir.join("boot").join(format!("vmlinuz-{release}")),
        dir.join("lib/modules").join(release).join("vmlinuz"),
    ]
    .into_iter()
    .find(|path| path.is_file())
    .with_context(|| format!("no vmlinuz for {release} in {}", dir.display()))?;
    let vmlinux = dir.join(format!("vmlinux-{release}"));
    if vmlinux.is_file() {
        return Ok(vmlinux);
    }
    let bytes = std::fs::read(&bzimage)?;
    // As the kernel's scripts/extract-vmlinux: try each compressed stream's magic in turn.
    let formats: [(&[u8], &[&str]); 3] = [
        (b"\xfd7zXZ\x00", &["xz", "-dcq"]),
        (b"\x28\xb5\x2f\xfd", &["zstd", "-dcq"]),
        (b"\x1f\x8b\x08", &["gzip", "-dcq"]),
    ];
    for (magic, tool) in formats {
        for start in find_all(&bytes, magic) {
            let Ok(mut child) = Command::new(tool[0])
                .args(&tool[1..])
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::null())
                .spawn()
            else {
                continue;
            };
            let mut stdin = child.stdin.take().context("decompressor stdin")?;
            let input = bytes[start..].to_vec();
            let writer = std::thread::spawn(move || {
                let _ = stdin.write_all(&input);
            });
            let mut out = Vec::new();
            let _ = child
                .stdout
                .take()
                .context("decompressor stdout")?
                .read_to_end(&mut out);
            let _ = child.wait();
            let _ = writer.join();
            // The stream is followed by the rest of the bzImage: the tool's complaint about
            // trailing data is expected; an ELF file is what counts.
            if out.len() > 1 << 20 && out.starts_with(b"\x7fELF") {
                let tmp = vmlinux.with_extension("partial");
                std::fs::write(&tmp, &out)?;
                std::fs::rename(&tmp, &vmlinux)?;
                return Ok(vmlinux);
            }
        }
    }
    println!(
        "vm: no vmlinux found in {}: booting the bzImage",
        bzimage.display()
    );
    Ok(bzimage)
}

fn find_all(haystack: &[u8], needle: &[u8]) -> Vec<usize> {
    haystack
        .windows(needle.len())
        .enumerate()
        .filter(|(_, window)| *window == needle)
        .map(|(i, _)| i)
        .collect()
}

/// Modules the guest needs before its root exists (those built into a kernel are skipped).
const ROOT_MODULES: &[&str] = &["virtio_pci", "9pnet_virtio", "9p", "overlay"];

/// The initramfs's /init: loads the root's modules, mounts the overlay root, moves the run
/// directory's share onto it and switches to it; stage 2 comes from the run directory.
const INIT: &str = r#"#!/bin/busybox sh
/bin/busybox mkdir -p /bin /proc /sys /dev /lower /rw /newroot
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
for m in $(cat /modules.order); do insmod "/modules/$m" || echo "init: insmod $m failed"; done
out=$(sed -n 's/.*rl\.out=\([^ ]*\).*/\1/p' /proc/cmdline)
mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=524288 host /lower || echo "init: no host root"
mount -t tmpfs -o mode=0755 tmpfs /rw
mkdir -p /rw/upper /rw/work
mount -t overlay -o lowerdir=/lower,upperdir=/rw/upper,workdir=/rw/work overlay /newroot || echo "init: no overlay"
mount -t 9p -o trans=virtio,version=9p2000.L,msize=524288 out "/newroot$out" || echo "init: no run directory"
mount --move /proc /newroot/proc
mount --move /sys /newroot/sys
mount --move /dev /newroot/dev
exec switch_root /newroot /bin/sh "$out/stage2.sh"
echo "init: switch_root failed"
poweroff -f
"#;

/// Builds the initramfs: busybox, /init, and the root's modules (decompressed: busybox's
/// insmod takes plain .ko files) in load order.
fn build_initramfs(dir: &Path, release: &str, initramfs: &Path) -> Result<()> {
    let staging = dir.join("initramfs.partial");
    let _ = std::fs::remove_dir_all(&staging);
    std::fs::create_dir_all(staging.join("bin"))?;
    std::fs::create_dir_all(staging.join("modules"))?;
    std::fs::copy("/bin/busybox", staging.join("bin/busybox"))
        .context("copying /bin/busybox (the busybox-static package)")?;
    let init = staging.join("init");
    std::fs::write(&init, INIT)?;
    set_mode(&init, 0o755)?;
    let mut order = Vec::new();
    for module in ROOT_MODULES {
        let Ok(out) = util::output(Command::new("modprobe").arg("-d").arg(dir).args([
            "-S",
            release,
            "--show-depends",
            module,
        ])) else {
            // Not a module: built in (the host's kmod may not read a newer kernel's
            // modules.builtin.bin). Were it missing, the guest would say "init: no host root".
            println!("vm: {release}: no module {module}, taken as built in");
            continue;
        };
        for line in out.lines() {
            let Some(path) = line.strip_prefix("insmod ") else {
                continue; // `builtin NAME`: nothing to load
            };
            let path = path.trim();
            let name = Path::new(path)
                .file_name()
                .and_then(|n| n.to_str())
                .context("module path")?;
            let plain = name
                .trim_end_matches(".xz")
                .trim_end_matches(".zst")
                .trim_end_matches(".gz")
                .to_string();
            if order.contains(&plain) {
                continue;
            }
            // modprobe -d prints paths under the base directory.
            let source = if Path::new(path).starts_with(dir) {
                PathBuf::from(path)
            } else {
                dir.join(path.trim_start_matches('/'))
            };
            let bytes = decompress(&source)?;
            std::fs::write(staging.join("modules").join(&plain), bytes)?;
            order.push(plain);
        }
    }
    std::fs::write(staging.join("modules.order"), order.join("\n") + "\n")?;
    let cpio = create_cpio(&staging, initramfs)?;
    std::fs::remove_dir_all(&staging)?;
    println!(
        "vm: initramfs for {release}: busybox and {} module(s) {}",
        order.len(),
        cpio
    );
    Ok(())
}

/// `find . | cpio -o -H newc` in `staging`, into `out`; returns its size for the log.
fn create_cpio(staging: &Path, out: &Path) -> Result<String> {
    let tmp = out.with_extension("partial");
    let file = std::fs::File::create(&tmp)?;
    let status = Command::new("sh")
        .args(["-c", "find . | cpio --quiet -o -H newc"])
        .current_dir(staging)
        .stdout(file)
        .status()
        .context("running cpio (the cpio package)")?;
    if !status.success() {
        bail!("cpio failed ({status})");
    }
    std::fs::rename(&tmp, out)?;
    let size = std::fs::metadata(out)?.len();
    Ok(format!("({} KiB)", size / 1024))
}

fn decompress(path: &Path) -> Result<Vec<u8>> {
    let tool = match path.extension().and_then(|e| e.to_str()) {
        Some("xz") => "xz",
        Some("zst") => "zstd",
        Some("gz") => "gzip",
        _ => return std::fs::read(path).with_context(|| format!("reading {}", path.display())),
    };
    let out = Command::new(tool)
        .arg("-dc")
        .arg(path)
        .output()
        .with_context(|| format!("running {tool}"))?;
    if !out.status.success() {
        bail!("{tool} -dc {} failed", path.display());
    }
    Ok(out.stdout)
}

fn set_mode(path: &Path, mode: u32) -> Result<()> {
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .with_context(|| format!("chmod {}", path.display()))
}

/// What a guest run gave.
#[derive(Debug)]
pub struct GuestRun {
    /// The command's exit status in the guest.
    pub status: i32,
    /// Its stdout and stderr, interleaved.
    pub output: String,
    /// From qemu's start to its exit.
    pub elapsed: Duration,
}

/// Single quotes for the guest's `sh`.
fn sh_quote(word: &str) -> String {
    format!("'{}'", word.replace('\'', r"'\''"))
}

/// Stage 2 of the guest's init (PID 1 in the overlay root): the file systems the tests use,
/// the kernel's modules, the command, its status, power-off.
fn stage2(
    prepared: &Prepared,
    out: &Path,
    command: &[OsString],
    env: &[(String, String)],
) -> String {
    let mut script = String::from("#!/bin/sh\n");
    let cwd = std::env::current_dir().unwrap_or_else(|_| PathBuf::from("/"));
    // An empty /tmp and /run of the guest's own, unless one would hide the project or the run
    // directory (a checkout under /tmp): the overlay's tmpfs upper layer keeps what the guest
    // writes there from the host either way.
    for dir in ["/tmp", "/run"] {
        if !cwd.starts_with(dir) && !out.starts_with(dir) {
            let _ = writeln!(script, "mount -t tmpfs tmpfs {dir}");
        }
    }
    script.push_str(
        "mount -t bpf bpf /sys/fs/bpf\n\
         mount -t cgroup2 cgroup2 /sys/fs/cgroup\n\
         mount -t debugfs debugfs /sys/kernel/debug\n\
         mkdir -p /dev/pts /dev/shm && mount -t devpts devpts /dev/pts && mount -t tmpfs tmpfs /dev/shm\n",
    );
    let modules = format!("/lib/modules/{}", prepared.release);
    let _ = writeln!(
        script,
        "mkdir -p {0} && mount --bind {1} {0}",
        sh_quote(&modules),
        sh_quote(&prepared.modules.to_string_lossy())
    );
    script.push_str("ip link set lo up\n");
    let _ = writeln!(script, "cd {} || exit 1", sh_quote(&cwd.to_string_lossy()));
    for key in ["PATH", "HOME", "TERM", "RUST_BACKTRACE"] {
        if let Ok(value) = std::env::var(key) {
            let _ = writeln!(script, "export {key}={}", sh_quote(&value));
        }
    }
    for (key, value) in env {
        let _ = writeln!(script, "export {key}={}", sh_quote(value));
    }
    let words: Vec<String> = command
        .iter()
        .map(|word| sh_quote(&word.to_string_lossy()))
        .collect();
    let output = sh_quote(&out.join("output").to_string_lossy());
    let status = sh_quote(&out.join("status").to_string_lossy());
    let _ = writeln!(script, "{} > {output} 2>&1 < /dev/null", words.join(" "));
    let _ = writeln!(script, "echo $? > {status}");
    script.push_str("sync\necho o > /proc/sysrq-trigger\nsleep 10\n");
    script
}

/// Boots `prepared` and runs `command` (with `env` added to the environment, in the current
/// directory) in it; copies its output to stdout as it comes when `echo` is set. An error if
/// the guest does not boot, does not report a status, or outlives `timeout`; a failing
/// command is not an error: see [`GuestRun::status`].
pub fn boot(
    prepared: &Prepared,
    command: &[OsString],
    env: &[(String, String)],
    timeout: Duration,
    echo: bool,
) -> Result<GuestRun> {
    let runs = util::target_dir()?.join("vm");
    std::fs::create_dir_all(&runs)?;
    // One directory per guest: guests of one kernel may run at once (`xtask test`'s pool).
    static GUESTS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = GUESTS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let out = runs.join(format!("{}-{}-{n}", prepared.release, std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    std::fs::create_dir_all(&out)?;
    let script = out.join("stage2.sh");
    std::fs::write(&script, stage2(prepared, &out, command, env))?;
    set_mode(&script, 0o755)?;
    let output_path = out.join("output");
    std::fs::write(&output_path, "")?;
    let console = out.join("console.log");

    let mut qemu = Command::new("qemu-system-x86_64");
    qemu.args([
        "-accel",
        "tcg,thread=single",
        "-M",
        "q35",
        "-smp",
        "2",
        "-m",
        "2G",
    ])
    .args(["-nodefaults", "-display", "none", "-no-reboot"])
    .arg("-kernel")
    .arg(&prepared.image)
    .arg("-initrd")
    .arg(&prepared.initramfs)
    .arg("-append")
    .arg(format!(
        "console=ttyS0 panic=-1 loglevel=4 mitigations=off rl.out={}",
        out.display()
    ))
    .arg("-serial")
    .arg(format!("file:{}", console.display()))
    .arg("-virtfs")
    .arg("local,path=/,mount_tag=host,security_model=none,readonly=on,multidevs=remap")
    .arg("-virtfs")
    .arg(format!(
        "local,path={},mount_tag=out,security_model=none",
        out.display()
    ))
    .stdin(Stdio::null())
    .stdout(Stdio::null())
    .stderr(Stdio::piped());
    util::echo(&qemu);
    let started = Instant::now();
    let mut child = qemu.spawn().context("starting qemu-system-x86_64")?;
    let mut reader = std::fs::File::open(&output_path)?;
    let mut output = Vec::new();
    let mut stdout = std::io::stdout();
    let mut copy = |reader: &mut std::fs::File, output: &mut Vec<u8>| {
        let mut chunk = Vec::new();
        let _ = reader.read_to_end(&mut chunk);
        if echo && !chunk.is_empty() {
            let _ = stdout.write_all(&chunk);
            let _ = stdout.flush();
        }
        output.extend_from_slice(&chunk);
    };
    let exit = loop {
        copy(&mut reader, &mut output);
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if started.elapsed() > timeout {
            let _ = child.kill();
            let _ = child.wait();
            bail!(
                "kernel {}: no result after {} s; console: {}",
                prepared.release,
                timeout.as_secs(),
                console.display()
            );
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let elapsed = started.elapsed();
    // Re-open: the guest's last writes went through 9p, not this file description's cache.
    let mut reader = std::fs::File::open(&output_path)?;
    reader.seek(SeekFrom::Start(output.len() as u64))?;
    copy(&mut reader, &mut output);
    let mut stderr = String::new();
    if let Some(mut pipe) = child.stderr.take() {
        let _ = pipe.read_to_string(&mut stderr);
    }
    let status = std::fs::read_to_string(out.join("status")).ok();
    let Some(status) = status.and_then(|s| s.trim().parse::<i32>().ok()) else {
        let tail = std::fs::read_to_string(&console).unwrap_or_default();
        let tail: Vec<&str> = tail.lines().rev().take(30).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        bail!(
            "kernel {}: the guest reported no exit status (qemu: {exit}{}); the console's last lines:\n{}",
            prepared.release,
            if stderr.trim().is_empty() {
                String::new()
            } else {
                format!(", {}", stderr.trim())
            },
            tail.join("\n")
        );
    };
    let _ = std::fs::remove_dir_all(&out);
    Ok(GuestRun {
        status,
        output: String::from_utf8_lossy(&output).into_owned(),
        elapsed,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn depends_are_names_without_versions_or_alternatives() {
        let show = "Package: linux-image-7.3.4+deb13-amd64\n\
                    Depends: dracut | initramfs-tools (>= 0.120+deb8u2), linux-binary-7.3.4+deb13-amd64 (= 7.3.4-1~bpo13+1), linux-modules-7.3.4+deb13-amd64 (= 7.3.4-1~bpo13+1)\n\
                    Size: 1900\n";
        assert_eq!(
            parse_depends(show),
            [
                "dracut",
                "initramfs-tools",
                "linux-binary-7.3.4+deb13-amd64",
                "linux-modules-7.3.4+deb13-amd64"
            ]
        );
        assert!(parse_depends("Package: x\n").is_empty());
    }

    #[test]
    fn every_kernel_name_is_found() {
        for kernel in KERNELS {
            assert_eq!(find(kernel.name).unwrap().name, kernel.name);
        }
        assert!(find("5.10").is_err());
    }
}
