//! The daemon's background tasks (the control socket, the event reader, ban persistence, the
//! interface watcher, the known-sources filter's rebuild) run under a supervisor: a task that
//! fails, by an error or a panic, is started again after a backoff, and its health (up or
//! waiting to restart, restarts, last error) is shown in `ratelimit status` (`tasks`) and in
//! `/metrics` (`ratelimit_task_up`, `ratelimit_task_restarts_total`). Unsupervised, a task that
//! failed was logged once and gone: bans stopped being saved, or events being read, while the
//! daemon went on answering as if all were well.

use std::{
    collections::BTreeMap,
    future::Future,
    sync::{Arc, Mutex},
    time::{Duration, Instant, SystemTime},
};

use serde::Serialize;
use tracing::error;

/// The longest wait before a restart.
pub const MAX_BACKOFF: Duration = Duration::from_secs(60);
/// A run at least this long counts as healthy: the next failure waits the first backoff
/// again instead of twice the last one.
pub const HEALTHY_RUN: Duration = Duration::from_secs(60);

/// The wait before restarting a task that failed after running for `ran`: `first` after a
/// healthy run (or the first failure), else twice the last wait, at most [`MAX_BACKOFF`]
/// (or `first`, if that is longer).
pub fn next_backoff(last: Option<Duration>, ran: Duration, first: Duration) -> Duration {
    match last {
        Some(last) if ran < HEALTHY_RUN => last.saturating_mul(2).min(MAX_BACKOFF.max(first)),
        _ => first,
    }
}

/// One task's health, as `status` shows it.
#[derive(Debug, Clone, Default, Serialize, serde::Deserialize, PartialEq, Eq)]
pub struct TaskHealth {
    /// Running now (false while it waits to be restarted).
    pub up: bool,
    /// Times it failed and was (or is about to be) started again.
    pub restarts: u64,
    /// Why it last failed.
    pub last_error: Option<String>,
    /// When it last failed (RFC 3339).
    pub last_failure: Option<String>,
    /// When it starts again, while it waits (RFC 3339).
    pub restarts_at: Option<String>,
}

/// The health of every supervised task, by name.
#[derive(Debug, Default)]
pub struct Tasks(Mutex<BTreeMap<&'static str, TaskHealth>>);

impl Tasks {
    pub fn snapshot(&self) -> BTreeMap<&'static str, TaskHealth> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn update(&self, name: &'static str, f: impl FnOnce(&mut TaskHealth)) {
        f(self
            .0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(name)
            .or_default());
    }

    fn started(&self, name: &'static str) {
        self.update(name, |h| {
            h.up = true;
            h.restarts_at = None;
        });
    }

    /// Record a failure; returns the restart count.
    fn failed(&self, name: &'static str, why: &str, wait: Duration) -> u64 {
        let now = SystemTime::now();
        let mut restarts = 0;
        self.update(name, |h| {
            h.up = false;
            h.restarts += 1;
            h.last_error = Some(why.to_string());
            h.last_failure = Some(crate::clock::rfc3339(now));
            h.restarts_at = Some(crate::clock::rfc3339(now + wait));
            restarts = h.restarts;
        });
        restarts
    }

    /// Why a run ended, its backoff, and the log line, shared by both kinds of task.
    fn ended(
        &self,
        name: &'static str,
        why: &str,
        last: &mut Option<Duration>,
        ran: Duration,
        first: Duration,
    ) -> Duration {
        let wait = next_backoff(*last, ran, first);
        *last = Some(wait);
        let restarts = self.failed(name, why, wait);
        error!(
            task = name,
            restarts, "background task {name} failed: {why}; restarting it in {wait:?}"
        );
        wait
    }
}

/// Aborts the task it holds when dropped, so a supervisor that is itself stopped (at
/// shutdown) does not leave its current run behind.
struct AbortOnDrop(tokio::task::JoinHandle<anyhow::Result<()>>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The message of a panic's payload.
fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".to_string())
}

/// Run the task `start` makes, on a tokio task of its own, for as long as the daemon runs:
/// each time it fails (an error, a panic, or returning at all: these tasks are loops), wait
/// the backoff ([`next_backoff`], from `first`) and start a new run.
pub fn spawn<F, Fut>(
    tasks: &Arc<Tasks>,
    name: &'static str,
    first: Duration,
    mut start: F,
) -> tokio::task::JoinHandle<()>
where
    F: FnMut() -> Fut + Send + 'static,
    Fut: Future<Output = anyhow::Result<()>> + Send + 'static,
{
    let tasks = tasks.clone();
    tasks.started(name);
    tokio::spawn(async move {
        let mut last = None;
        loop {
            tasks.started(name);
            let t0 = Instant::now();
            let mut run = AbortOnDrop(tokio::spawn(start()));
            let why = match (&mut run.0).await {
                Ok(Ok(())) => "it returned".to_string(),
                Ok(Err(e)) => format!("{e:#}"),
                Err(e) if e.is_panic() => {
                    format!("panicked: {}", panic_message(&*e.into_panic()))
                }
                // Cancelled: the runtime is shutting down.
                Err(_) => return,
            };
            let wait = tasks.ended(name, &why, &mut last, t0.elapsed(), first);
            tokio::time::sleep(wait).await;
        }
    })
}

/// [`spawn`] for a task that runs on a thread of its own (it blocks, e.g. for seconds-long
/// map walks): `body` is called again after each failure (an error or a panic) and backoff.
pub fn spawn_thread(
    tasks: &Arc<Tasks>,
    name: &'static str,
    first: Duration,
    mut body: impl FnMut() -> anyhow::Result<()> + Send + 'static,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    let tasks = tasks.clone();
    tasks.started(name);
    std::thread::Builder::new()
        .name(name.replace('_', "-"))
        .spawn(move || {
            let mut last = None;
            loop {
                tasks.started(name);
                let t0 = Instant::now();
                let why = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(&mut body)) {
                    Ok(Ok(())) => "it returned".to_string(),
                    Ok(Err(e)) => format!("{e:#}"),
                    Err(p) => format!("panicked: {}", panic_message(&*p)),
                };
                let wait = tasks.ended(name, &why, &mut last, t0.elapsed(), first);
                std::thread::sleep(wait);
            }
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    #[test]
    fn backoff_doubles_to_its_cap_and_starts_over_after_a_healthy_run() {
        let s = Duration::from_secs;
        let first = s(1);
        let mut last = None;
        let mut waits = Vec::new();
        for _ in 0..9 {
            let w = next_backoff(last, s(2), first);
            waits.push(w.as_secs());
            last = Some(w);
        }
        assert_eq!(waits, [1, 2, 4, 8, 16, 32, 60, 60, 60]);
        assert_eq!(next_backoff(last, HEALTHY_RUN, first), first);
        // A first wait above the cap is kept, not cut to it.
        assert_eq!(next_backoff(Some(s(100)), s(1), s(100)), s(100));
    }

    /// A task that fails twice (an error, then a panic) runs a third time, after the backoff,
    /// and its health says so.
    #[tokio::test(start_paused = true)]
    async fn a_failing_task_is_restarted_with_backoff_and_its_health_shown() {
        let tasks = Arc::new(Tasks::default());
        let runs = Arc::new(AtomicU32::new(0));
        let t0 = tokio::time::Instant::now();
        let r = runs.clone();
        let _sup = spawn(&tasks, "t", Duration::from_secs(1), move || {
            let r = r.clone();
            async move {
                match r.fetch_add(1, Ordering::SeqCst) {
                    0 => anyhow::bail!("disk full"),
                    1 => panic!("bad state"),
                    _ => std::future::pending().await,
                }
            }
        });
        // The first run fails at once: down, one restart, waiting a second.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let h = tasks.snapshot()["t"].clone();
        assert!(!h.up, "{h:?}");
        assert_eq!(h.restarts, 1);
        assert_eq!(h.last_error.as_deref(), Some("disk full"));
        assert!(h.restarts_at.is_some());
        // Second run at 1 s panics; the third starts 2 s later and stays up.
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert_eq!(runs.load(Ordering::SeqCst), 2);
        let h = tasks.snapshot()["t"].clone();
        assert_eq!(
            (h.up, h.restarts, h.last_error.as_deref()),
            (false, 2, Some("panicked: bad state"))
        );
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert_eq!(runs.load(Ordering::SeqCst), 3);
        let h = tasks.snapshot()["t"].clone();
        assert!(h.up && h.restarts == 2 && h.restarts_at.is_none(), "{h:?}");
        assert!(t0.elapsed() >= Duration::from_secs(3));
    }

    #[test]
    fn a_failing_thread_is_restarted_with_backoff() {
        let tasks = Arc::new(Tasks::default());
        let runs = Arc::new(AtomicU32::new(0));
        let r = runs.clone();
        let t0 = Instant::now();
        spawn_thread(&tasks, "th", Duration::from_millis(20), move || {
            match r.fetch_add(1, Ordering::SeqCst) {
                0 => anyhow::bail!("walk failed"),
                1 => panic!("bad state"),
                _ => loop {
                    std::thread::sleep(Duration::from_secs(3600));
                },
            }
        })
        .unwrap();
        let give_up = Instant::now() + Duration::from_secs(30);
        while runs.load(Ordering::SeqCst) < 3 && Instant::now() < give_up {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(runs.load(Ordering::SeqCst), 3);
        // 20 ms, then 40 ms of backoff.
        assert!(t0.elapsed() >= Duration::from_millis(60));
        let h = tasks.snapshot()["th"].clone();
        assert!(h.up && h.restarts == 2, "{h:?}");
        assert_eq!(h.last_error.as_deref(), Some("panicked: bad state"));
    }
}
