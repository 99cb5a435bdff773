//! The pressure level against the real daemon: its marks, the operator's forced mode (kept
//! across a restart), the events and the metric of each change, and a real signal: a listener
//! whose accept queue overflows in the daemon's own network namespace.
//!
//! The CI machine is a busy 2-core box, so no test asserts "low" under the default marks:
//! `cpu_busy = 1` can never be exceeded (a share is at most 1), and a million listen drops a
//! second never happen here, so with those marks the signals alone say low for certain.

use std::time::{Duration, Instant};

use ratelimit_tests::{kernel_test, listen::overflow, scenario::Scenario, scenario::metric_sum};
use ratelimit_user::policy::pressure::{Cause, Level, Mode, Report, Signal};

const HTTP_PORT: u16 = 9477;

/// Marks the signals cannot reach on any machine.
const NEVER: &str =
    "[pressure]\ncpu_busy = 1.0\nlisten_overflows_per_sec = 1000000\nhold = \"1s\"\n";

/// Poll `ratelimit pressure` until `ok` holds, for at most `within`.
fn wait_for(s: &Scenario, within: Duration, what: &str, ok: impl Fn(&Report) -> bool) -> Report {
    let deadline = Instant::now() + within;
    loop {
        let r: Report = s.daemon().cli_as(&["pressure"]);
        if ok(&r) {
            return r;
        }
        assert!(
            Instant::now() < deadline,
            "{what} within {within:?}: {r:#?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Poll the events file until a line of `event` appears (the `n`th, 1-based).
fn wait_event(s: &Scenario, event: &str, n: usize) -> serde_json::Value {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let found: Vec<_> = s
            .all_events()
            .into_iter()
            .filter(|e| e["event"] == event)
            .collect();
        if found.len() >= n {
            return found[n - 1].clone();
        }
        assert!(
            Instant::now() < deadline,
            "no {n} {event} line(s) in:\n{}",
            s.events_text()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn metric(s: &Scenario, name: &str) -> f64 {
    let (status, body) = s.http_get("/metrics");
    assert_eq!(status, 200, "{body}");
    metric_sum(&body, name, &[])
}

#[test]
fn pressure_forced_high_shows_everywhere_returns_to_auto_and_survives_a_restart() {
    kernel_test!();
    let mut s = Scenario::new("rlprs").with_http(HTTP_PORT);
    s.start(NEVER);
    // Samples every 250 ms: both signals have values within a second or two (the first
    // reading is only a base).
    let r = wait_for(&s, Duration::from_secs(10), "signal values", |r| {
        r.signals.iter().all(|x| x.value.is_some())
    });
    assert_eq!(
        (r.level, r.mode, r.auto_level),
        (Level::Low, Mode::Auto, Level::Low)
    );
    assert_eq!(r.transitions, 0);
    assert_eq!(r.hold_secs, 1.0);
    let cpu = r
        .signals
        .iter()
        .find(|x| x.signal == Signal::CpuBusy)
        .unwrap();
    assert_eq!(cpu.mark, 1.0);
    let busy = cpu.value.unwrap();
    assert!((0.0..=1.0).contains(&busy), "{busy}");
    assert!(!cpu.above);
    assert_eq!(metric(&s, "ratelimit_pressure_high"), 0.0);
    let text = s.daemon().cli_ok(&["pressure"]);
    assert!(text.contains("level    low (mode auto"), "{text}");
    // `status` carries the same summary.
    assert_eq!(s.daemon().status().pressure.level, Level::Low);

    let r: Report = s.daemon().cli_as(&["pressure", "set", "high"]);
    assert_eq!(
        (r.level, r.mode, r.auto_level),
        (Level::High, Mode::High, Level::Low)
    );
    assert_eq!(r.transitions, 1);
    assert_eq!(r.not_saved, None);
    let e = wait_event(&s, "pressure_high", 1);
    assert_eq!(e["mode"], "high");
    assert_eq!(e["cause"], "operator");
    assert_eq!(e["signals"], serde_json::json!([]));
    assert_eq!(metric(&s, "ratelimit_pressure_high"), 1.0);
    assert_eq!(metric(&s, "ratelimit_pressure_transitions_total"), 1.0);
    let (status, body) = s.http_get("/v1/pressure");
    assert_eq!(status, 200, "{body}");
    let over_http: Report = serde_json::from_str(&body).unwrap();
    assert_eq!((over_http.level, over_http.mode), (Level::High, Mode::High));
    // Still high after the hold, with every signal below its mark: forced.
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(
        s.daemon().cli_as::<Report>(&["pressure"]).level,
        Level::High
    );

    let r: Report = s.daemon().cli_as(&["pressure", "set", "auto"]);
    assert_eq!((r.level, r.mode), (Level::Low, Mode::Auto));
    let e = wait_event(&s, "pressure_low", 1);
    assert_eq!(
        (e["mode"].as_str(), e["cause"].as_str()),
        (Some("auto"), Some("operator"))
    );
    assert_eq!(metric(&s, "ratelimit_pressure_high"), 0.0);
    assert_eq!(metric(&s, "ratelimit_pressure_transitions_total"), 2.0);

    // Forced, then restarted: still forced.
    s.daemon().cli_as::<Report>(&["pressure", "set", "high"]);
    s.daemon_mut().restart();
    let r: Report = s.daemon().cli_as(&["pressure"]);
    assert_eq!((r.level, r.mode), (Level::High, Mode::High));
    assert_eq!(r.transitions, 0, "started forced: no change");
    assert!(
        s.daemon().logs().contains("pressure mode restored"),
        "{}",
        s.daemon().logs()
    );
    // A bad mode is refused by the CLI.
    let out = s.daemon().cli(&["pressure", "set", "on"]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("expected high, low or auto"),
        "{out:?}"
    );
}

#[test]
fn pressure_rises_by_itself_when_a_listener_overflows_and_falls_after_the_hold() {
    kernel_test!();
    let mut s = Scenario::new("rlprl");
    // Any listen drop is above the mark; the CPU can never be.
    s.start("[pressure]\ncpu_busy = 1.0\nlisten_overflows_per_sec = 0\nhold = \"2s\"\n");
    wait_for(&s, Duration::from_secs(10), "signal values", |r| {
        r.signals.iter().all(|x| x.value.is_some())
    });
    // Nothing in this fresh namespace drops: low.
    assert_eq!(s.daemon().cli_as::<Report>(&["pressure"]).level, Level::Low);
    let flood = s.server.enter(|| overflow(18080, 64));
    let r = wait_for(&s, Duration::from_secs(10), "high from listen drops", |r| {
        r.level == Level::High
    });
    assert_eq!(r.mode, Mode::Auto);
    let e = wait_event(&s, "pressure_high", 1);
    assert_eq!(e["cause"], "signal");
    assert_eq!(e["signals"][0]["signal"], "listen_overflows_per_sec");
    assert!(e["signals"][0]["value"].as_f64().unwrap() > 0.0, "{e}");
    // The clients retransmit for a while; once closed, the drops stop and the level falls
    // after the hold.
    drop(flood);
    let r = wait_for(&s, Duration::from_secs(30), "low after the hold", |r| {
        r.level == Level::Low
    });
    assert_eq!(r.mode, Mode::Auto);
    let e = wait_event(&s, "pressure_low", 1);
    assert_eq!(e["cause"], serde_json::to_value(Cause::Hold).unwrap());
}

/// A local user's busy loop on every CPU is not pressure: `cpu_busy` counts the kernel's time
/// (system, irq, softirq) on the receive CPUs, not user time (a veth has no receive CPUs of
/// its own: every CPU is watched, which is the strictest case). Before, user time counted,
/// and any local user could force the level high.
#[test]
fn a_user_busy_loop_on_every_cpu_does_not_raise_pressure() {
    use std::sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    };
    kernel_test!();
    let mut s = Scenario::new("rlpbusy");
    s.start("[pressure]\ncpu_busy = 0.5\nlisten_overflows_per_sec = 1000000\nhold = \"1s\"\n");
    wait_for(&s, Duration::from_secs(10), "signal values", |r| {
        r.signals.iter().all(|x| x.value.is_some())
    });
    let stop = Arc::new(AtomicBool::new(false));
    let cpus = std::thread::available_parallelism().map_or(2, |n| n.get());
    // Bounded: each spinner stops by itself after 8 s whatever happens to the test.
    let spinners: Vec<_> = (0..cpus)
        .map(|_| {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let end = Instant::now() + Duration::from_secs(8);
                let mut x = 1u64;
                while !stop.load(Ordering::Relaxed) && Instant::now() < end {
                    for _ in 0..100_000 {
                        x = std::hint::black_box(
                            x.wrapping_mul(6364136223846793005).wrapping_add(1),
                        );
                    }
                }
                x
            })
        })
        .collect();
    // Let the spinners take the CPUs, then watch 3 s of samples (12 sampling periods).
    std::thread::sleep(Duration::from_millis(600));
    let until = Instant::now() + Duration::from_secs(3);
    let mut highest = 0.0f64;
    let mut went_high = None;
    while Instant::now() < until {
        let r: Report = s.daemon().cli_as(&["pressure"]);
        for x in &r.signals {
            if x.signal == Signal::CpuBusy {
                highest = highest.max(x.value.unwrap_or(0.0));
            }
        }
        if r.level == Level::High && went_high.is_none() {
            went_high = Some(r);
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    stop.store(true, Ordering::Relaxed);
    for t in spinners {
        t.join().unwrap();
    }
    assert!(
        went_high.is_none(),
        "a user busy loop raised the pressure level (highest cpu_busy {highest:.3}): {went_high:#?}"
    );
    assert!(
        highest < 0.5,
        "cpu_busy {highest:.3} under a user busy loop"
    );
}
