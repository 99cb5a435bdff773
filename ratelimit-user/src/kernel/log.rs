//! Lines the XDP program writes through aya-log, forwarded to the daemon's log (tracing).
//!
//! The program writes only rare data-plane conditions (a full ban table, a state it could not
//! place, events lost to a full ring), each at most once a second per CPU with the count it
//! stands for (`ratelimit-ebpf/src/rare.rs`); the counters carry every occurrence.
//!
//! The ring the lines travel in (`AYA_LOGS`) is not pinned: every load of the program makes
//! its own, and the process that loaded it reads it. A restarted daemon loads a new program
//! against the pinned maps and swaps it into the pinned links, so the ring it reads is the one
//! the attached program writes. Lines written while no daemon ran are lost with the old
//! program's ring; its counters are not.

use aya::Ebpf;
use aya_log::EbpfLogger;
use tokio::io::unix::AsyncFd;
use tracing::{debug, error, info, trace, warn};

/// The tracing target of forwarded lines (`RUST_LOG=ratelimit::kernel=warn` keeps them alone).
const TARGET: &str = "ratelimit::kernel";

/// Starts reading the program's log ring with `logger`. `None` for an object whose program
/// writes no lines (no `AYA_LOGS` map).
pub fn open<T: log::Log>(ebpf: &mut Ebpf, logger: T) -> anyhow::Result<Option<EbpfLogger<T>>> {
    match EbpfLogger::init_with_logger(ebpf, logger) {
        Ok(l) => Ok(Some(l)),
        Err(aya_log::Error::MapNotFound) => Ok(None),
        Err(e) => Err(anyhow::anyhow!(
            "opening the XDP program's log ring: {e}; the daemon runs on, but the program's \
             warnings (full tables, lost events) reach only its counters"
        )),
    }
}

/// Forward the program's lines to tracing from a task of their own, for as long as the
/// runtime runs. A failure is logged, not returned: enforcement does not depend on it.
pub fn spawn(ebpf: &mut Ebpf) {
    let logger = match open(ebpf, Forward) {
        Ok(Some(l)) => l,
        Ok(None) => {
            warn!(
                "this build of the XDP program has no log ring: its warnings reach only counters"
            );
            return;
        }
        Err(e) => {
            warn!("{e:#}");
            return;
        }
    };
    // SAFETY: the logger owns the ring's fd and keeps it open for as long as the AsyncFd lives.
    let mut fd = match unsafe { AsyncFd::register(logger) } {
        Ok(fd) => fd,
        Err(e) => {
            warn!(
                "polling the XDP program's log ring: {e}; its warnings (full tables, lost \
                 events) reach only its counters"
            );
            return;
        }
    };
    tokio::spawn(async move {
        loop {
            let mut guard = match fd.readable_mut().await {
                Ok(g) => g,
                Err(e) => {
                    error!(
                        "polling the XDP program's log ring failed ({e}); its warnings now \
                         reach only its counters"
                    );
                    return;
                }
            };
            guard.get_inner_mut().flush();
            guard.clear_ready();
        }
    });
}

/// A `log::Log` that hands every record to tracing at the level the program gave it.
pub struct Forward;

impl log::Log for Forward {
    fn enabled(&self, _: &log::Metadata<'_>) -> bool {
        true
    }

    fn log(&self, record: &log::Record<'_>) {
        let line = record.args();
        match record.level() {
            log::Level::Error => error!(target: TARGET, "{line}"),
            log::Level::Warn => warn!(target: TARGET, "{line}"),
            log::Level::Info => info!(target: TARGET, "{line}"),
            log::Level::Debug => debug!(target: TARGET, "{line}"),
            log::Level::Trace => trace!(target: TARGET, "{line}"),
        }
    }

    fn flush(&self) {}
}
