//! The kernel side, as the daemon sees it: loading, attaching, pinning and adopting the XDP
//! program and its maps ([`datapath`]), the per-client state's handles ([`clients`]), the
//! idle states of keys of packet fields removed ([`keyed`]), the known-sources filter ([`known`]), the host's own addresses ([`local_addrs`]), the receive
//! CPUs ([`rx_cpus`]) and the program's log lines ([`log`]).

pub mod clients;
pub mod datapath;
pub mod keyed;
pub mod known;
pub mod local_addrs;
pub mod log;
pub mod mmap;
pub mod rx_cpus;
