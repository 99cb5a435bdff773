//! Empty library target: lets `ratelimit-bench` name this crate as a build dependency, so cargo
//! rebuilds the benchmark (which embeds this object) when the object's sources change.
#![no_std]
