//! The data plane kept at the daemon's level: rewritten where it holds another.

use super::{SAMPLE_PERIOD, level::Level};

/// Keeps the level the data plane holds equal to the daemon's: on every tick of the sampler
/// the daemon compares what the global entry holds with the level it wants, and writes it again
/// where they differ (a write that failed at a change of the level, or an entry someone else
/// wrote). One warning an episode of disagreement, not one a tick, and one line when it ends
/// if it outlived its first rewrite.
#[derive(Debug, Default)]
pub struct LevelSync {
    /// Since the first tick of the current disagreement, until a tick finds them agreeing.
    disagreeing: bool,
    /// A rewrite in the current episode failed.
    failed: bool,
    /// Lines logged, for the tests.
    pub(super) lines: u64,
}

/// What one [`LevelSync::tick`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Synced {
    /// The data plane holds the level: nothing written.
    Agrees,
    /// It held the other level, or could not be read, and the level was written.
    Rewritten,
    /// As `Rewritten`, but the write failed: the next tick tries again.
    Failed,
}

impl LevelSync {
    /// Compare `held` (the data plane's level: `Some(true)` relaxed, `None` unreadable) with
    /// `relaxed` (the daemon's), and `write` the daemon's where they differ.
    pub fn tick(
        &mut self,
        relaxed: bool,
        held: Option<bool>,
        write: impl FnOnce(bool) -> anyhow::Result<()>,
    ) -> Synced {
        let name = |relaxed: bool| if relaxed { Level::Low } else { Level::High }.name();
        if held == Some(relaxed) {
            if self.disagreeing && self.failed {
                tracing::info!(
                    "the data plane holds the pressure level {} again",
                    name(relaxed)
                );
                self.lines += 1;
            }
            self.disagreeing = false;
            self.failed = false;
            return Synced::Agrees;
        }
        let first = !self.disagreeing;
        self.disagreeing = true;
        let held = held.map_or("an unreadable level", name);
        let result = write(relaxed);
        if first {
            self.lines += 1;
            match &result {
                Ok(()) => tracing::warn!(
                    "the data plane held {held} while the pressure level is {}: written again",
                    name(relaxed)
                ),
                Err(e) => tracing::error!(
                    "the data plane holds {held} while the pressure level is {}, and writing it \
                     failed: {e:#}; retrying every {} ms",
                    name(relaxed),
                    SAMPLE_PERIOD.as_millis()
                ),
            }
        }
        match result {
            Ok(()) => Synced::Rewritten,
            Err(_) => {
                self.failed = true;
                Synced::Failed
            }
        }
    }
}
