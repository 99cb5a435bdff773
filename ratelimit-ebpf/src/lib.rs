//! Empty library target: lets `ratelimit-user` name this crate as a build dependency, so cargo
//! rebuilds the daemon (which embeds the program) when the program's sources change.
#![no_std]
