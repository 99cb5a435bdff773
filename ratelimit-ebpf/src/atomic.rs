//! Atomic read-modify-write on map values. The BPF target exposes no `AtomicU64` RMW methods
//! (its spec declares no compare-and-swap), but LLVM lowers the intrinsics to BPF_ATOMIC
//! instructions (kernel 5.12+): add, and, or, xchg and cmpxchg, all with fetch.
//!
//! Every function takes a pointer into a map value that the caller got from a map lookup.
//! That is each function's whole safety contract (the `# Safety` sections below): the map
//! value stays allocated for the rest of the program's run (the kernel frees map values only
//! after an RCU grace period, and an XDP program runs inside an RCU read-side section), and
//! the word is aligned (map values are 8-byte aligned and every field used here sits at a
//! multiple of its size), which the BPF atomic instructions and the verifier require.
//!
//! The fetch-and-op functions are inline assembly: LLVM 22's BPF backend rewrites an
//! `atomicrmw add` whose result *is* used into the non-fetching form (its pre-emit check
//! misreads the tied register as dead), so the "previous value" silently became the operand.
//! Found by an end-to-end test that admitted every packet; the asm leaves no room for that.

use core::intrinsics::{self, AtomicOrdering::Relaxed};

/// Bounded retries of a compare-and-swap before giving up.
pub const CAS_RETRIES: u32 = 3;

/// A relaxed load. An aligned 64-bit BPF load is single-copy atomic; volatile keeps the
/// compiler from merging or tearing it (LLVM lowers atomic loads only for cpu v4).
///
/// # Safety
/// `p` points into a live map value, 8-byte aligned.
#[inline(always)]
pub unsafe fn load(p: *const u64) -> u64 {
    // SAFETY: the caller's contract: `p` is an aligned word of a live map value.
    unsafe { core::ptr::read_volatile(p) }
}

/// A relaxed store (see `load`).
///
/// # Safety
/// `p` points into a live map value, 8-byte aligned.
#[inline(always)]
pub unsafe fn store(p: *mut u64, v: u64) {
    // SAFETY: the caller's contract: `p` is an aligned word of a live map value.
    unsafe { core::ptr::write_volatile(p, v) }
}

/// Adds `v`, returning the previous value (BPF_ADD | BPF_FETCH).
///
/// # Safety
/// `p` points into a live map value, 8-byte aligned.
#[inline(always)]
pub unsafe fn fetch_add(p: *mut u64, v: u64) -> u64 {
    let mut r = v;
    // SAFETY: the caller's contract: `p` is an aligned word of a live map value; the
    // instruction touches those 8 bytes and the register `r` only (no stack: `nostack`).
    unsafe {
        core::arch::asm!(
            "{r} = atomic_fetch_add((u64 *)({p} + 0), {r})",
            r = inout(reg) r,
            p = in(reg) p,
            options(nostack),
        )
    };
    r
}

/// Adds `v` without reading the result (BPF_ADD): for counters nobody reads back here.
///
/// # Safety
/// `p` points into a live map value, 8-byte aligned.
#[inline(always)]
pub unsafe fn add(p: *mut u64, v: u64) {
    // SAFETY: the caller's contract: `p` is an aligned word of a live map value; the
    // instruction touches those 8 bytes only (no stack: `nostack`).
    unsafe {
        core::arch::asm!(
            "lock *(u64 *)({p} + 0) += {v}",
            v = in(reg) v,
            p = in(reg) p,
            options(nostack),
        )
    };
}

/// BPF_OR | BPF_FETCH.
///
/// # Safety
/// `p` points into a live map value, 8-byte aligned.
#[inline(always)]
pub unsafe fn fetch_or(p: *mut u64, v: u64) -> u64 {
    let mut r = v;
    // SAFETY: the caller's contract: `p` is an aligned word of a live map value; the
    // instruction touches those 8 bytes and the register `r` only (no stack: `nostack`).
    unsafe {
        core::arch::asm!(
            "{r} = atomic_fetch_or((u64 *)({p} + 0), {r})",
            r = inout(reg) r,
            p = in(reg) p,
            options(nostack),
        )
    };
    r
}

/// BPF_AND | BPF_FETCH.
///
/// # Safety
/// `p` points into a live map value, 8-byte aligned.
#[inline(always)]
pub unsafe fn fetch_and(p: *mut u64, v: u64) -> u64 {
    let mut r = v;
    // SAFETY: the caller's contract: `p` is an aligned word of a live map value; the
    // instruction touches those 8 bytes and the register `r` only (no stack: `nostack`).
    unsafe {
        core::arch::asm!(
            "{r} = atomic_fetch_and((u64 *)({p} + 0), {r})",
            r = inout(reg) r,
            p = in(reg) p,
            options(nostack),
        )
    };
    r
}

/// BPF_XCHG.
///
/// # Safety
/// `p` points into a live map value, 8-byte aligned.
#[inline(always)]
pub unsafe fn swap(p: *mut u64, v: u64) -> u64 {
    let mut r = v;
    // SAFETY: the caller's contract: `p` is an aligned word of a live map value; the
    // instruction touches those 8 bytes and the register `r` only (no stack: `nostack`).
    unsafe {
        core::arch::asm!(
            "{r} = xchg_64({p} + 0, {r})",
            r = inout(reg) r,
            p = in(reg) p,
            options(nostack),
        )
    };
    r
}

/// Compare-and-swap: true if `*p` was `old` and is now `new`.
///
/// # Safety
/// `p` points into a live map value, 8-byte aligned.
#[inline(always)]
pub unsafe fn cas(p: *mut u64, old: u64, new: u64) -> bool {
    // SAFETY: the caller's contract: `p` is an aligned word of a live map value.
    unsafe { intrinsics::atomic_cxchg::<u64, { Relaxed }, { Relaxed }>(p, old, new).1 }
}

/// A relaxed 32-bit load (see `load`).
///
/// # Safety
/// `p` points into a live map value, 4-byte aligned.
#[inline(always)]
pub unsafe fn load32(p: *const u32) -> u32 {
    // SAFETY: the caller's contract: `p` is an aligned word of a live map value.
    unsafe { core::ptr::read_volatile(p) }
}

/// A relaxed 32-bit store (see `load`).
///
/// # Safety
/// `p` points into a live map value, 4-byte aligned.
#[inline(always)]
pub unsafe fn store32(p: *mut u32, v: u32) {
    // SAFETY: the caller's contract: `p` is an aligned word of a live map value.
    unsafe { core::ptr::write_volatile(p, v) }
}

/// 32-bit BPF_XCHG (cpu v3, which the linker targets).
///
/// # Safety
/// `p` points into a live map value, 4-byte aligned.
#[inline(always)]
pub unsafe fn swap32(p: *mut u32, v: u32) -> u32 {
    // SAFETY: the caller's contract: `p` is an aligned word of a live map value.
    unsafe { intrinsics::atomic_xchg::<u32, { Relaxed }>(p, v) }
}

/// 32-bit compare-and-swap (cpu v3): true if `*p` was `old` and is now `new`.
///
/// # Safety
/// `p` points into a live map value, 4-byte aligned.
#[inline(always)]
pub unsafe fn cas32(p: *mut u32, old: u32, new: u32) -> bool {
    // SAFETY: the caller's contract: `p` is an aligned word of a live map value.
    unsafe { intrinsics::atomic_cxchg::<u32, { Relaxed }, { Relaxed }>(p, old, new).1 }
}
