//! The daemon's XDP object: the program (this package's library) and nothing else. Every
//! program, map and function in the object comes from the library (see its documentation);
//! `ratelimit-user` embeds the object, and a unit test there checks what it holds.
#![cfg_attr(target_arch = "bpf", no_std)]
#![cfg_attr(target_arch = "bpf", no_main)]

#[cfg(target_arch = "bpf")]
use ratelimit as _;

#[cfg(not(target_arch = "bpf"))]
fn main() {}
