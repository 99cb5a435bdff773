//! Who may hold the HTTP listener's connection slots. Any local user (and, with a
//! non-loopback `http_listen`, anyone who can reach it) can connect, so no one client may take
//! the slots the others need:
//!
//! * a peer holds at most [`MAX_PER_PEER`] connections at once (an IPv4 address, or an IPv6
//!   /64: one host's addresses);
//! * [`METRICS_SLOTS`] of the the listener's `MAX_CONNECTIONS` are kept for `GET /metrics`:
//!   a connection that finds the others taken gets one of these, and on it every other path
//!   is a 503. However many peers hold the rest, Prometheus still scrapes.
//!
//! A connection over either bound is closed as soon as it is accepted, and counted.

use std::{
    collections::HashMap,
    net::IpAddr,
    sync::{Arc, Mutex},
};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Connections one peer may hold at once.
pub const MAX_PER_PEER: usize = 16;
/// Connections kept for `GET /metrics` (part of the listener's `MAX_CONNECTIONS`).
pub const METRICS_SLOTS: usize = 4;

/// The slots of one listener.
pub struct Slots {
    general: Arc<Semaphore>,
    metrics: Arc<Semaphore>,
    peers: Arc<Mutex<HashMap<IpAddr, usize>>>,
    max_per_peer: usize,
}

/// A connection's slot, given back when dropped.
pub struct Slot {
    _permit: OwnedSemaphorePermit,
    peer: IpAddr,
    peers: Arc<Mutex<HashMap<IpAddr, usize>>>,
    /// A slot kept for `/metrics`: the connection is served that path only.
    pub metrics_only: bool,
}

/// Why a connection was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// The peer holds [`MAX_PER_PEER`] connections already.
    PerPeer,
    /// Every slot is taken.
    Full,
}

/// The peer a connection is counted under: the IPv4 address, or the IPv6 /64 (an
/// IPv4-mapped IPv6 address counts as the IPv4 one).
fn peer_of(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6((u128::from(v6) & !((1u128 << 64) - 1)).into()),
        },
        v4 => v4,
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Slots {
    /// `total` slots, `metrics` of them kept for `/metrics`, at most `per_peer` a peer.
    pub fn new(total: usize, metrics: usize, per_peer: usize) -> Self {
        let metrics = metrics.min(total);
        Self {
            general: Arc::new(Semaphore::new(total - metrics)),
            metrics: Arc::new(Semaphore::new(metrics)),
            peers: Arc::default(),
            max_per_peer: per_peer,
        }
    }

    /// A slot for a connection from `ip`, or why there is none.
    pub fn admit(&self, ip: IpAddr) -> Result<Slot, Refused> {
        let peer = peer_of(ip);
        let mut peers = lock(&self.peers);
        let held = peers.get(&peer).copied().unwrap_or(0);
        if held >= self.max_per_peer {
            return Err(Refused::PerPeer);
        }
        let (permit, metrics_only) = match self.general.clone().try_acquire_owned() {
            Ok(p) => (p, false),
            Err(_) => match self.metrics.clone().try_acquire_owned() {
                Ok(p) => (p, true),
                Err(_) => return Err(Refused::Full),
            },
        };
        peers.insert(peer, held + 1);
        Ok(Slot {
            _permit: permit,
            peer,
            peers: self.peers.clone(),
            metrics_only,
        })
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut peers = lock(&self.peers);
        if let Some(n) = peers.get_mut(&self.peer) {
            *n -= 1;
            if *n == 0 {
                peers.remove(&self.peer);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn http_slots_per_peer_and_kept_for_metrics() {
        let slots = Slots::new(5, 2, 2);
        let a1 = slots.admit(ip("192.0.2.1")).unwrap();
        let _a2 = slots.admit(ip("192.0.2.1")).unwrap();
        assert_eq!(slots.admit(ip("192.0.2.1")).err(), Some(Refused::PerPeer));
        // One host's IPv6 addresses are one peer; another /64 is another.
        let _b1 = slots.admit(ip("2001:db8:1:1::1")).unwrap();
        assert!(!_b1.metrics_only);
        let b2 = slots.admit(ip("2001:db8:1:1::2")).unwrap();
        assert!(
            b2.metrics_only,
            "the general slots are taken: one kept for /metrics"
        );
        assert_eq!(
            slots.admit(ip("2001:db8:1:1::3")).err(),
            Some(Refused::PerPeer)
        );
        let c = slots.admit(ip("2001:db8:1:2::1")).unwrap();
        assert!(c.metrics_only);
        assert_eq!(slots.admit(ip("198.51.100.1")).err(), Some(Refused::Full));
        // A slot given back is taken again, and the peer's count with it.
        drop(a1);
        let again = slots.admit(ip("::ffff:192.0.2.1")).unwrap();
        assert!(!again.metrics_only);
        assert_eq!(slots.admit(ip("192.0.2.1")).err(), Some(Refused::PerPeer));
        drop((b2, c));
        assert!(slots.admit(ip("198.51.100.1")).unwrap().metrics_only);
    }
}
