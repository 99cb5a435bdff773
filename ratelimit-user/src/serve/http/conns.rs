//! The HTTP listener's own counts: connections open, rejected and timed out.

use std::sync::{
    Arc,
    atomic::{AtomicU64, Ordering},
};

/// The listener's own counts, for `/metrics`.
#[derive(Default)]
pub(super) struct Conns {
    pub(super) open: AtomicU64,
    pub(super) rejected: AtomicU64,
    pub(super) header_timeouts: AtomicU64,
    pub(super) request_timeouts: AtomicU64,
}

impl Conns {
    pub(super) fn counts(&self) -> HttpCounts {
        HttpCounts {
            open: self.open.load(Ordering::Relaxed),
            rejected: self.rejected.load(Ordering::Relaxed),
            header_timeouts: self.header_timeouts.load(Ordering::Relaxed),
            request_timeouts: self.request_timeouts.load(Ordering::Relaxed),
        }
    }
}

/// A reading of the listener's counts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HttpCounts {
    /// Connections being served now.
    pub open: u64,
    /// Connections closed at once because [`MAX_CONNECTIONS`](super::MAX_CONNECTIONS) were
    /// open, or their peer held [`crate::serve::http_slots::MAX_PER_PEER`].
    pub rejected: u64,
    /// Connections closed because the headers did not arrive within
    /// [`HEADER_READ_TIMEOUT`](super::HEADER_READ_TIMEOUT).
    pub header_timeouts: u64,
    /// Requests answered 503 after [`REQUEST_TIMEOUT`](super::REQUEST_TIMEOUT).
    pub request_timeouts: u64,
}

/// One served connection, counted in `open` while it lives.
pub(super) struct Served(pub(super) Arc<Conns>);

impl Served {
    pub(super) fn new(conns: Arc<Conns>) -> Self {
        conns.open.fetch_add(1, Ordering::Relaxed);
        Served(conns)
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::Relaxed);
    }
}
