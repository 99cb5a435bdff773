//! The lab: everything end-to-end tests need to run the real rate limiter
//! against real traffic without leaving the machine.
//!
//! A test builds two network namespaces joined by a veth pair ([`netns`],
//! [`link`]), starts the daemon on the protected side ([`daemon`]), sends
//! crafted frames ([`packet`]) from the client side ([`sender`]) and counts
//! what arrived with receivers that do not trust the daemon ([`receiver`]).
//! A real Prometheus server can scrape the daemon there ([`prometheus`]); a real nginx can
//! serve behind it while hping3 floods it ([`nginx`]).
//! Every resource is a guard that cleans up on drop, also when a test panics; every process
//! the lab keeps running (the daemon, redis-server, nginx, Prometheus, hping3) is one kind of
//! guard ([`server`]).
//! Kernel tests start with [`kernel_test!`] ([`env`]), which skips them
//! outside `cargo xtask test`. Fixture tests run the real XDP object through
//! BPF_PROG_TEST_RUN, loaded and configured by one harness ([`fixture`]).
//!
//! Use it as `use ratelimit_tests as lab;`.

pub mod bans;
pub mod control_load;
pub mod daemon;
pub mod delay;
pub mod dns;
pub mod env;
pub mod faketime;
pub mod fixture;
pub mod fleet_lab;
pub mod fleet_sim;
pub mod fuzz;
pub mod leftovers;
pub mod link;
pub mod listen;
pub mod mmdb;
pub mod netns;
pub mod nginx;
pub mod packet;
pub mod pins;
pub mod prometheus;
pub mod receiver;
pub mod rng;
pub mod scenario;
pub mod sender;
pub mod server;
pub mod store;
pub mod tool;
pub mod tun;
pub mod webload;

pub use daemon::Daemon;
pub use env::{ratelimit_bin, require_kernel_tests, skip_unless_kernel};
pub use link::{VethEnd, VethPair, disable_rp_filter, silence};
pub use netns::NetNs;
pub use packet::Frame;
pub use receiver::{Counts, Tap, UdpSink};
pub use scenario::Scenario;
pub use sender::{PacketSocket, SendStats};
