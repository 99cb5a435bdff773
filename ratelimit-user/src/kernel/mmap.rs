//! A `BPF_F_MMAPABLE` array's value area mapped into the daemon, shared and read-write: the
//! per-source store's sets ([`super::clients`]) and the known-sources filter's words
//! ([`super::known`]). Each owner unmaps its mapping when dropped.

use std::{
    os::fd::{AsRawFd as _, BorrowedFd},
    ptr::NonNull,
};

use anyhow::{Context as _, bail};

/// The bytes a mapping of `value_bytes` takes: whole pages.
pub fn mapped_len(value_bytes: usize) -> usize {
    const PAGE: usize = 4096;
    value_bytes.div_ceil(PAGE) * PAGE
}

/// Map the first `len_bytes` ([`mapped_len`]) of the array `fd` opens, shared and read-write;
/// `name` (the map's) for the error.
pub fn map_shared(fd: BorrowedFd<'_>, len_bytes: usize, name: &str) -> anyhow::Result<NonNull<u8>> {
    // SAFETY: mmap of a BPF_F_MMAPABLE array's whole value area, shared, read-write; the
    // kernel checks the length against the map's.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len_bytes,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd.as_raw_fd(),
            0,
        )
    };
    if p == libc::MAP_FAILED {
        bail!(
            "mapping {name}: {} (a map pinned by an older build? `ratelimit detach` and restart)",
            std::io::Error::last_os_error()
        );
    }
    NonNull::new(p.cast::<u8>()).context("mmap returned null")
}
