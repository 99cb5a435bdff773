//! Everything the XDP program and the daemon must agree on: map capacities, key and value
//! layouts, counter indices, and the limiter arithmetic as pure integer functions.
//!
//! The kernel program calls the arithmetic with values it read from its maps; host tests check
//! the same functions against straightforward reference models. Nothing here allocates or
//! depends on `std`, so it compiles for `bpfel-unknown-none` unchanged.
#![no_std]

pub mod addr;
pub mod caps;
pub mod event;
pub mod limiter;
pub mod maps;
/// The program's verdict pipeline restated on the host, for differential tests (needs `std`).
#[cfg(not(target_arch = "bpf"))]
pub mod model;
pub mod proto;
pub mod stats;

#[cfg(feature = "user")]
mod pod {
    //! `aya::Pod` marks types that may be copied byte-for-byte into and out of BPF maps. Every
    //! type listed is `#[repr(C)]`, has no padding the kernel could leak, and is valid for any
    //! bit pattern.
    use crate::{
        addr::{IpKey, LpmAddr},
        event::Event,
        maps::*,
        stats::Counter,
    };

    macro_rules! pod {
        ($($t:ty),* $(,)?) => {
            $(
                // SAFETY: see the module's comment: `#[repr(C)]`, no padding, any bit
                // pattern valid (each type's layout test checks its size).
                unsafe impl aya::Pod for $t {}
            )*
        };
    }
    pod!(
        IpKey,
        LpmAddr,
        Counter,
        Event,
        RuleConfig,
        GlobalConfig,
        ClientKey,
        ClientState,
        SharedState,
        FleetAdd,
        Slot,
        BanEntry,
        OverrideValue,
        OverrideKey,
        RegionOverrideKey,
        Admission,
        ListValue,
        FastEntry,
    );
}
