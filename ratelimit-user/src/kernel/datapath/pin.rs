//! The bpffs and what is pinned on it: the directory (mounting a bpffs where there is none),
//! the layout of the pinned maps, the links pinned per interface, and `detach`, which removes
//! them.

use std::{
    ffi::CString,
    fs,
    path::{Path, PathBuf},
};

use anyhow::{Context as _, bail};
use aya::programs::links::PinnedLink;
use ratelimit_common::maps::{
    BAN_TABLES, BanEntry, ClientKey, ClientState, FastEntry, GlobalConfig, HashKey, RuleConfig,
};
use tracing::{info, warn};

const BPF_FS_MAGIC: i64 = 0xcafe4a11;

/// Make sure `/sys/fs/bpf` (or the parent of `dir`) is a bpffs, mounting one if it is not.
pub(crate) fn ensure_bpffs(dir: &Path) -> anyhow::Result<()> {
    let root = Path::new("/sys/fs/bpf");
    if !dir.starts_with(root) {
        fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        return Ok(());
    }
    if statfs_magic(root) != Some(BPF_FS_MAGIC) {
        fs::create_dir_all(root).ok();
        let src = CString::new("bpf")?;
        let target = CString::new("/sys/fs/bpf")?;
        // SAFETY: plain mount(2) with valid C strings.
        let rc = unsafe {
            libc::mount(
                src.as_ptr(),
                target.as_ptr(),
                src.as_ptr(),
                0,
                std::ptr::null(),
            )
        };
        if rc != 0 {
            bail!(
                "/sys/fs/bpf is not a bpffs and mounting one failed ({}); mount it with `mount -t bpf bpf /sys/fs/bpf`",
                std::io::Error::last_os_error()
            );
        }
        info!("mounted bpffs on /sys/fs/bpf");
    }
    fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    Ok(())
}

fn statfs_magic(path: &Path) -> Option<i64> {
    let c = CString::new(path.as_os_str().as_encoded_bytes()).ok()?;
    // SAFETY: statfs is plain C data: all zeros is a valid value.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: valid path and out-pointer.
    if unsafe { libc::statfs(c.as_ptr(), &mut st) } != 0 {
        return None;
    }
    Some(st.f_type as i64)
}

pub(super) fn link_pin(pin_dir: &Path, iface: &str) -> PathBuf {
    pin_dir.join(format!("link-{iface}"))
}

/// The layout of every pinned map's keys and values. `LAYOUT_VERSION` is bumped by hand
/// whenever one changes (a reordered field included), and when where a key is placed changes
/// (the per-source store's hash, `known_hash`) or what a value means (an elastic limit without
/// `elastic` is the limit itself, no longer all zero; global rules' windows on the wall clock;
/// a global token bucket's counts in `cur`/`prev`; a fourth ban table, the fleet's, and
/// `RL_BANS_PRESENT` with a flag for it; rules' `except` lists in the sources trie and their
/// `dst` lists in `RL_DESTS`); the sizes follow as a check.
const LAYOUT_VERSION: u32 = 15;

/// File in `daemon.state_dir` recording the layout of the maps pinned in `daemon.bpffs_dir`.
pub const LAYOUT_FILE: &str = "pinned-layout";

pub fn layout() -> String {
    use std::mem::size_of;
    format!(
        "v{LAYOUT_VERSION} client_key={} client_state={} store_set={} shared={} fleet_add={} fast_entry={} global={} rule={} list={} override={} ban={} ban_tables={} stats={} hash_key={}",
        size_of::<ClientKey>(),
        size_of::<ClientState>(),
        size_of::<ratelimit_common::maps::StoreSet>(),
        size_of::<ratelimit_common::maps::SharedState>(),
        size_of::<ratelimit_common::maps::FleetAdd>(),
        size_of::<FastEntry>(),
        size_of::<GlobalConfig>(),
        size_of::<RuleConfig>(),
        size_of::<ratelimit_common::maps::ListValue>(),
        size_of::<ratelimit_common::maps::OverrideValue>(),
        size_of::<BanEntry>(),
        BAN_TABLES,
        ratelimit_common::stats::STATS_LEN,
        size_of::<HashKey>(),
    )
}

/// Refuse to adopt maps pinned in `pin_dir` by a build with another layout (their values
/// would be misread): `state_dir` must record this build's layout for them.
pub fn check_pinned_layout(pin_dir: &Path, state_dir: &Path) -> anyhow::Result<()> {
    if !pin_dir.join("RL_STATS").exists() {
        return Ok(());
    }
    let file = state_dir.join(LAYOUT_FILE);
    let found = fs::read_to_string(&file).unwrap_or_default();
    if found.trim() == layout() {
        return Ok(());
    }
    bail!(
        "the maps pinned in {} were made by a build with another map layout ({}), which this \
         build would misread: run `ratelimit detach` (bans are restored from {}) and start again",
        pin_dir.display(),
        if found.trim().is_empty() {
            format!("{} records none", file.display())
        } else {
            format!(
                "{} says {:?}, this build {:?}",
                file.display(),
                found.trim(),
                layout()
            )
        },
        state_dir.display()
    )
}

/// Record this build's layout for the maps pinned in `pin_dir` (see [`check_pinned_layout`]),
/// atomically: a torn record would make the next start refuse maps it could have adopted.
pub fn record_pinned_layout(state_dir: &Path) -> anyhow::Result<()> {
    crate::durable::write_atomically(state_dir, LAYOUT_FILE, (layout() + "\n").as_bytes())
}

/// A link pinned for `iface` whose device is gone (deleted: the kernel detached it), or is now
/// another device than the one under that name (renamed away, another created in its place),
/// cannot be adopted (`bpf_link_update` fails with ENOLINK on a detached link). Unpin it, which
/// detaches it from the other device if it still has one, and say so.
pub(super) fn drop_stale_link(pin: &Path, iface: &str, ifindex: u32) -> anyhow::Result<()> {
    let found = pinned_link_ifindex(pin)
        .with_context(|| format!("reading the link pinned at {}", pin.display()))?;
    if found == Some(ifindex) {
        return Ok(());
    }
    match found {
        None => warn!(
            iface,
            "the link pinned at {} belonged to an interface {iface} that no longer exists \
             (deleted and re-created as ifindex {ifindex}): unpinning it and attaching afresh",
            pin.display()
        ),
        Some(old) => warn!(
            iface,
            "the link pinned at {} is on ifindex {old}, but {iface} is now ifindex {ifindex} \
             (renamed or re-created): detaching it from ifindex {old} and attaching afresh",
            pin.display()
        ),
    }
    let link = PinnedLink::from_pin(pin)
        .with_context(|| format!("opening {}", pin.display()))?
        .unpin()
        .with_context(|| format!("unpinning {}", pin.display()))?;
    drop(link); // the last reference: the kernel detaches it
    Ok(())
}

/// The ifindex of the device the XDP link pinned at `pin` is attached to, or None once that
/// device is gone (the kernel then reports ifindex 0). Raw BPF_OBJ_GET and
/// BPF_OBJ_GET_INFO_BY_FD: aya's `LinkInfo` does not expose the XDP part.
pub(super) fn pinned_link_ifindex(pin: &Path) -> std::io::Result<Option<u32>> {
    use std::os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd};
    const BPF_OBJ_GET: libc::c_long = 7;
    const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;
    /// `struct bpf_link_info`: type, id, prog_id, then the 8-aligned union whose `xdp` member
    /// is `{ __u32 ifindex; }`. Larger than the kernel's struct; its tail stays zero.
    const INFO_LEN: usize = 256;
    const XDP_IFINDEX_AT: usize = 16;
    let path = CString::new(pin.as_os_str().as_encoded_bytes())?;
    #[repr(C)]
    struct ObjGet {
        pathname: u64,
        bpf_fd: u32,
        file_flags: u32,
        path_fd: i32,
        /// The kernel refuses attributes with any non-zero byte past the command's fields.
        pad: u32,
    }
    let get = ObjGet {
        pathname: path.as_ptr() as u64,
        bpf_fd: 0,
        file_flags: 0,
        path_fd: 0,
        pad: 0,
    };
    // SAFETY: bpf(2) reads `get` (and the path it points to) only during the call.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_OBJ_GET,
            &get as *const ObjGet,
            std::mem::size_of::<ObjGet>(),
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    let mut info = [0u64; INFO_LEN / 8];
    #[repr(C)]
    struct GetInfo {
        bpf_fd: u32,
        info_len: u32,
        info: u64,
    }
    let mut req = GetInfo {
        bpf_fd: fd.as_raw_fd() as u32,
        info_len: INFO_LEN as u32,
        info: info.as_mut_ptr() as u64,
    };
    // SAFETY: bpf(2) writes at most `info_len` bytes into `info`, which outlives the call.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_OBJ_GET_INFO_BY_FD,
            &mut req as *mut GetInfo,
            std::mem::size_of::<GetInfo>(),
        )
    };
    if rc < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let bytes: Vec<u8> = info.iter().flat_map(|w| w.to_ne_bytes()).collect();
    let ifindex = u32::from_ne_bytes(
        bytes[XDP_IFINDEX_AT..XDP_IFINDEX_AT + 4]
            .try_into()
            .expect("4 bytes"),
    );
    Ok((ifindex != 0).then_some(ifindex))
}

/// Remove the program from the interfaces (all pinned links, or those named) and, when no link
/// is left, every pinned map. Returns the interfaces detached.
///
/// That removes every file in `pin_dir`, so a `pin_dir` that is not on a bpffs (a mistyped
/// `--bpffs-dir`, a config naming an ordinary directory) is refused before anything is read or
/// removed: only a bpffs holds pins, and nothing but pins.
pub fn detach(pin_dir: &Path, only: &[String]) -> anyhow::Result<Vec<String>> {
    let mut detached = Vec::new();
    if !pin_dir.exists() {
        return Ok(detached);
    }
    let why = match statfs_magic(pin_dir) {
        Some(BPF_FS_MAGIC) => None,
        Some(magic) => Some(format!(
            "its filesystem type is {magic:#x}, a bpffs is {BPF_FS_MAGIC:#x}"
        )),
        None => Some(format!(
            "statfs failed: {}",
            std::io::Error::last_os_error()
        )),
    };
    if let Some(why) = why {
        bail!(
            "{} is not a bpffs directory ({why}), so it holds no pins: `ratelimit detach` removes \
             every file of the directory it is given, and works only on the daemon's bpffs \
             directory (daemon.bpffs_dir, under /sys/fs/bpf); nothing was removed",
            pin_dir.display()
        );
    }
    let Ok(entries) = fs::read_dir(pin_dir) else {
        return Ok(detached);
    };
    let mut remaining_links = 0;
    let mut files = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if let Some(iface) = name.strip_prefix("link-") {
            if only.is_empty() || only.iter().any(|o| o == iface) {
                let pinned = PinnedLink::from_pin(entry.path())
                    .with_context(|| format!("opening {}", entry.path().display()))?;
                let link = pinned.unpin()?;
                drop(link); // last reference: the kernel detaches the program
                detached.push(iface.to_string());
            } else {
                remaining_links += 1;
            }
        } else {
            files.push(entry.path());
        }
    }
    if remaining_links == 0 {
        for f in files {
            fs::remove_file(&f).with_context(|| format!("removing {}", f.display()))?;
        }
        let _ = fs::remove_dir(pin_dir);
    }
    Ok(detached)
}
