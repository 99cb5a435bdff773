//! Atomic read-modify-write on map values. The BPF target exposes no `AtomicU64` RMW methods
//! (its spec declares no compare-and-swap), but LLVM lowers the intrinsics to BPF_ATOMIC
//! instructions (kernel 5.12+): add, and, or, xchg and cmpxchg, all with fetch.
//!
//! Every function takes a pointer into a map value that the caller got from a map lookup.

use core::intrinsics::{self, AtomicOrdering::Relaxed};

/// A relaxed load. An aligned 64-bit BPF load is single-copy atomic; volatile keeps the
/// compiler from merging or tearing it (LLVM lowers atomic loads only for cpu v4).
#[inline(always)]
pub unsafe fn load(p: *const u64) -> u64 {
    unsafe { core::ptr::read_volatile(p) }
}

/// A relaxed store (see `load`).
#[inline(always)]
pub unsafe fn store(p: *mut u64, v: u64) {
    unsafe { core::ptr::write_volatile(p, v) }
}

/// Adds `v`, returning the previous value.
#[inline(always)]
pub unsafe fn fetch_add(p: *mut u64, v: u64) -> u64 {
    unsafe { intrinsics::atomic_xadd::<u64, u64, { Relaxed }>(p, v) }
}

/// Subtracts `v` (adds its two's complement), returning the previous value.
#[inline(always)]
pub unsafe fn fetch_sub(p: *mut u64, v: u64) -> u64 {
    unsafe { intrinsics::atomic_xadd::<u64, u64, { Relaxed }>(p, v.wrapping_neg()) }
}

#[inline(always)]
pub unsafe fn fetch_or(p: *mut u64, v: u64) -> u64 {
    unsafe { intrinsics::atomic_or::<u64, u64, { Relaxed }>(p, v) }
}

#[inline(always)]
pub unsafe fn fetch_and(p: *mut u64, v: u64) -> u64 {
    unsafe { intrinsics::atomic_and::<u64, u64, { Relaxed }>(p, v) }
}

#[inline(always)]
pub unsafe fn swap(p: *mut u64, v: u64) -> u64 {
    unsafe { intrinsics::atomic_xchg::<u64, { Relaxed }>(p, v) }
}

/// Compare-and-swap: true if `*p` was `old` and is now `new`.
#[inline(always)]
pub unsafe fn cas(p: *mut u64, old: u64, new: u64) -> bool {
    unsafe { intrinsics::atomic_cxchg::<u64, { Relaxed }, { Relaxed }>(p, old, new).1 }
}
