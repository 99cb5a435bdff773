use std::{collections::BTreeMap, time::Instant};

use super::*;

const MS: Duration = Duration::from_millis(1);

fn marks() -> Marks {
    Marks {
        cpu_busy: 0.8,
        listen_overflows_per_sec: 1.0,
        hold: Duration::from_secs(10),
    }
}

fn cpu(v: f64) -> Sample {
    Sample {
        cpu_busy: Some(v),
        listen_overflows_per_sec: Some(0.0),
    }
}

fn listen(v: f64) -> Sample {
    Sample {
        cpu_busy: Some(0.1),
        listen_overflows_per_sec: Some(v),
    }
}

#[test]
fn the_first_sample_has_no_rates_and_the_level_starts_low() {
    let t0 = Instant::now();
    let mut p = Pressure::new(marks(), Mode::Auto, t0);
    assert_eq!(p.level(), Level::Low);
    assert_eq!(p.since(), t0);
    // No earlier reading: no values.
    let first = Counters {
        cpus: BTreeMap::from([(
            0,
            CpuTimes {
                busy: 90,
                total: 100,
            },
        )]),
        listen_drops: Some(1_000_000),
    };
    let s = Sample::between(&Counters::default(), &first, SAMPLE_PERIOD, &[]);
    assert_eq!(s, Sample::default());
    assert_eq!(p.observe(s, t0 + 250 * MS), None);
    assert!(p.readings().iter().all(|r| r.value.is_none() && !r.above));
    assert_eq!(p.level(), Level::Low);
}

/// A daemon that takes over a high level stays high (no relaxed gap before its first
/// readings), and falls after the hold without a signal; a forced mode still decides.
#[test]
fn a_resumed_high_level_holds_until_the_hold_has_passed() {
    let t0 = Instant::now();
    let mut p = Pressure::resume(marks(), Mode::Auto, t0, true);
    assert_eq!((p.level(), p.transitions()), (Level::High, 0));
    assert_eq!(p.observe(cpu(0.1), t0 + 9_999 * MS), None);
    let t = p
        .observe(cpu(0.1), t0 + 10_000 * MS)
        .expect("low after the hold");
    assert_eq!((t.level, t.cause), (Level::Low, Cause::Hold));
    assert_eq!(
        Pressure::resume(marks(), Mode::Low, t0, true).level(),
        Level::Low
    );
    assert_eq!(
        Pressure::resume(marks(), Mode::Auto, t0, false).level(),
        Level::Low
    );
}

#[test]
fn exactly_at_the_mark_is_not_above_it_and_just_over_is() {
    let t0 = Instant::now();
    let mut p = Pressure::new(marks(), Mode::Auto, t0);
    assert_eq!(p.observe(cpu(0.8), t0 + 250 * MS), None);
    assert_eq!(p.observe(listen(1.0), t0 + 500 * MS), None);
    assert_eq!(p.level(), Level::Low);
    let t = p.observe(listen(1.0001), t0 + 750 * MS).unwrap();
    assert_eq!(t.level, Level::High);
    assert_eq!(t.cause, Cause::Signal);
    assert_eq!(t.above.len(), 1);
    assert_eq!(t.above[0].signal, Signal::ListenOverflowsPerSec);
    assert_eq!(t.above[0].value, Some(1.0001));
    assert_eq!(p.since(), t0 + 750 * MS);
    assert_eq!(p.transitions(), 1);
}

#[test]
fn cpu_busy_of_1_is_never_exceeded() {
    let t0 = Instant::now();
    let mut p = Pressure::new(
        Marks {
            cpu_busy: 1.0,
            ..marks()
        },
        Mode::Auto,
        t0,
    );
    // Every tick busy: the share is 1, not above 1.
    let a = Counters {
        cpus: BTreeMap::from([(
            0,
            CpuTimes {
                busy: 10,
                total: 10,
            },
        )]),
        listen_drops: Some(0),
    };
    let b = Counters {
        cpus: BTreeMap::from([(
            0,
            CpuTimes {
                busy: 35,
                total: 35,
            },
        )]),
        listen_drops: Some(0),
    };
    let s = Sample::between(&a, &b, SAMPLE_PERIOD, &[]);
    assert_eq!(s.cpu_busy, Some(1.0));
    assert_eq!(p.observe(s, t0 + 250 * MS), None);
    assert_eq!(p.level(), Level::Low);
}

#[test]
fn the_level_falls_exactly_hold_after_the_last_signal_above() {
    let t0 = Instant::now();
    let mut p = Pressure::new(marks(), Mode::Auto, t0);
    p.observe(cpu(0.9), t0 + 1000 * MS).unwrap();
    // Above again later: the hold counts from the last time.
    assert_eq!(p.observe(cpu(0.95), t0 + 2000 * MS), None);
    assert_eq!(p.last_above(), Some(t0 + 2000 * MS));
    assert_eq!(p.observe(cpu(0.1), t0 + 2250 * MS), None);
    assert_eq!(p.observe(cpu(0.1), t0 + 11_999 * MS), None);
    assert_eq!(p.level(), Level::High);
    let t = p.observe(cpu(0.1), t0 + 12_000 * MS).unwrap();
    assert_eq!(t.level, Level::Low);
    assert_eq!(t.cause, Cause::Hold);
    assert!(t.above.is_empty());
    assert_eq!(p.since(), t0 + 12_000 * MS);
    assert_eq!(p.transitions(), 2);
    // A sample without values does not hold the level up either.
    p.observe(cpu(0.9), t0 + 13_000 * MS).unwrap();
    assert_eq!(p.observe(Sample::default(), t0 + 22_999 * MS), None);
    assert_eq!(
        p.observe(Sample::default(), t0 + 23_000 * MS)
            .unwrap()
            .level,
        Level::Low
    );
}

#[test]
fn a_zero_hold_falls_at_the_first_sample_below() {
    let t0 = Instant::now();
    let mut p = Pressure::new(
        Marks {
            hold: Duration::ZERO,
            ..marks()
        },
        Mode::Auto,
        t0,
    );
    p.observe(cpu(0.9), t0 + 250 * MS).unwrap();
    assert_eq!(
        p.observe(cpu(0.2), t0 + 500 * MS).unwrap().level,
        Level::Low
    );
}

#[test]
fn a_forced_mode_overrides_the_signals_and_auto_returns_to_them() {
    let t0 = Instant::now();
    let mut p = Pressure::new(marks(), Mode::Auto, t0);
    let t = p.set_mode(Mode::High, t0 + 100 * MS).unwrap();
    assert_eq!(
        (t.level, t.cause, t.mode),
        (Level::High, Cause::Operator, Mode::High)
    );
    // Signals below: still high, and no transition.
    assert_eq!(p.observe(cpu(0.1), t0 + 20_000 * MS), None);
    assert_eq!(p.level(), Level::High);
    assert_eq!(p.auto_level(), Level::Low);
    // Back to auto: the signals' level at once.
    let t = p.set_mode(Mode::Auto, t0 + 20_100 * MS).unwrap();
    assert_eq!((t.level, t.cause), (Level::Low, Cause::Operator));
    // Forced low against a signal above.
    p.observe(listen(50.0), t0 + 20_250 * MS).unwrap();
    let t = p.set_mode(Mode::Low, t0 + 20_300 * MS).unwrap();
    assert_eq!(t.level, Level::Low);
    assert_eq!(t.above.len(), 1, "the signal above is reported");
    assert_eq!(p.observe(listen(50.0), t0 + 20_500 * MS), None);
    // Auto while the hold still runs: high.
    let t = p.set_mode(Mode::Auto, t0 + 21_000 * MS).unwrap();
    assert_eq!(t.level, Level::High);
    // Setting the mode in force changes nothing.
    assert_eq!(p.set_mode(Mode::Auto, t0 + 21_100 * MS), None);
    assert_eq!(p.transitions(), 5);
    // Started forced.
    let p = Pressure::new(marks(), Mode::High, t0);
    assert_eq!((p.level(), p.transitions()), (Level::High, 0));
}

const STAT: &str = "cpu  400 0 200 1000 0 0 0 0 0 0\n\
                    cpu0 100 10 50 500 20 5 15 3 7 0\n\
                    cpu1 300 0 150 500 0 0 0 0 0 0\n\
                    intr 1 2 3\nctxt 5\n";

#[test]
fn proc_stat_lines_give_busy_and_total_per_cpu() {
    let cpus = parse_stat(STAT);
    assert_eq!(cpus.len(), 2, "the total line is skipped");
    // busy = system + irq + softirq + steal; total adds user, nice, idle and iowait.
    assert_eq!(
        cpus[&0],
        CpuTimes {
            busy: 73,
            total: 703
        }
    );
    assert_eq!(
        cpus[&1],
        CpuTimes {
            busy: 150,
            total: 950
        }
    );
    // An old kernel's 4 columns.
    assert_eq!(
        parse_stat("cpu3 1 2 3 4\n")[&3],
        CpuTimes { busy: 3, total: 10 }
    );
}

/// A local user's busy loop (all user and nice time) is not pressure: only the kernel's
/// work on the CPU (system, irq, softirq) and steal count, out of every column.
#[test]
fn user_and_nice_time_are_not_busy_and_kernel_time_is() {
    // user nice system idle iowait irq softirq steal guest guest_nice
    let cpus = parse_stat("cpu0 900 50 20 0 0 5 15 10 0 0\ncpu1 0 0 300 600 0 0 100 0 0 0\n");
    assert_eq!(
        cpus[&0],
        CpuTimes {
            busy: 50,
            total: 1000
        },
        "a CPU spinning in user space is 5% busy (its kernel time)"
    );
    assert_eq!(
        cpus[&1],
        CpuTimes {
            busy: 400,
            total: 1000
        },
        "system and softirq time count whole"
    );
    // Two samples of a user busy loop on every CPU: far below any mark.
    let a = Counters {
        cpus: parse_stat("cpu0 1000 0 10 0 0 0 5 0 0 0\ncpu1 1000 0 10 0 0 0 5 0 0 0\n"),
        listen_drops: Some(0),
    };
    let b = Counters {
        cpus: parse_stat("cpu0 1025 0 10 0 0 0 5 0 0 0\ncpu1 1024 0 11 0 0 0 5 0 0 0\n"),
        listen_drops: Some(0),
    };
    assert_eq!(
        Sample::between(&a, &b, SAMPLE_PERIOD, &[]).cpu_busy,
        Some(1.0 / 50.0)
    );
}

const NETSTAT: &str = "TcpExt: SyncookiesSent ListenOverflows ListenDrops TCPTimeouts\n\
                       TcpExt: 0 7 9 3\n\
                       IpExt: InNoRoutes\nIpExt: 0\n";

#[test]
fn netstat_gives_listen_drops_or_else_overflows() {
    assert_eq!(parse_netstat(NETSTAT), Some(9));
    assert_eq!(
        parse_netstat("TcpExt: ListenOverflows\nTcpExt: 4\n"),
        Some(4)
    );
    assert_eq!(parse_netstat("IpExt: InNoRoutes\nIpExt: 0\n"), None);
    assert_eq!(parse_netstat(""), None);
}

fn reading(cpus: &[(u32, u64, u64)], drops: u64) -> Counters {
    Counters {
        cpus: cpus
            .iter()
            .map(|&(n, busy, total)| (n, CpuTimes { busy, total }))
            .collect(),
        listen_drops: Some(drops),
    }
}

#[test]
fn rates_come_from_deltas_of_the_watched_cpus() {
    let a = reading(&[(0, 100, 200), (1, 0, 100), (2, 50, 100)], 10);
    let b = reading(&[(0, 190, 300), (1, 10, 200), (2, 150, 200)], 15);
    let s = Sample::between(&a, &b, SAMPLE_PERIOD, &[]);
    // (90 + 10 + 100) / 300.
    assert!((s.cpu_busy.unwrap() - 200.0 / 300.0).abs() < 1e-12);
    assert_eq!(s.listen_overflows_per_sec, Some(20.0), "5 in 250 ms");
    let s = Sample::between(&a, &b, SAMPLE_PERIOD, &[1]);
    assert_eq!(s.cpu_busy, Some(0.1));
    // A watched CPU that is not online: no value.
    let s = Sample::between(&a, &b, SAMPLE_PERIOD, &[7]);
    assert_eq!(s.cpu_busy, None);
}

#[test]
fn a_cpu_going_offline_or_a_counter_reset_drops_out_of_one_interval() {
    let a = reading(&[(0, 100, 200), (1, 50, 100)], 10);
    // CPU 1 offline: only CPU 0 counts.
    let b = reading(&[(0, 150, 300)], 12);
    assert_eq!(
        Sample::between(&a, &b, SAMPLE_PERIOD, &[]).cpu_busy,
        Some(0.5)
    );
    // CPU 1 back, with counters reset; the drops counter wrapped.
    let c = reading(&[(0, 250, 400), (1, 5, 10)], 3);
    let s = Sample::between(&b, &c, SAMPLE_PERIOD, &[]);
    assert_eq!(s.cpu_busy, Some(1.0), "CPU 0 alone (CPU 1 was not in b)");
    assert_eq!(s.listen_overflows_per_sec, None);
    let s = Sample::between(&a, &c, SAMPLE_PERIOD, &[]);
    assert_eq!(
        s.cpu_busy,
        Some(150.0 / 200.0),
        "CPU 1 went backwards: left out"
    );
    // The next interval counts from the new readings.
    let d = reading(&[(0, 250, 500), (1, 15, 20)], 4);
    let s = Sample::between(&c, &d, SAMPLE_PERIOD, &[]);
    assert_eq!(s.cpu_busy, Some(10.0 / 110.0));
    assert_eq!(s.listen_overflows_per_sec, Some(4.0));
    // Every CPU gone: no value, not "idle".
    let none = reading(&[], 4);
    assert_eq!(
        Sample::between(&d, &none, SAMPLE_PERIOD, &[]).cpu_busy,
        None
    );
}

#[test]
fn modes_parse_and_print() {
    for m in [Mode::Auto, Mode::High, Mode::Low] {
        assert_eq!(m.to_string().parse::<Mode>(), Ok(m));
    }
    assert_eq!(
        "on".parse::<Mode>(),
        Err("\"on\" is not a pressure mode; expected high, low or auto".into())
    );
    assert_eq!(
        serde_json::to_string(&Saved { mode: Mode::High }).unwrap(),
        r#"{"mode":"high"}"#
    );
}

/// A level the data plane does not hold (a write that failed, or an entry written by
/// someone else) is written again on the next tick, and logged once an episode.
#[test]
fn the_data_plane_level_is_rewritten_until_it_holds() {
    struct Plane {
        held: Option<bool>,
        failures: u32,
        writes: u32,
    }
    impl Plane {
        fn write(&mut self, relaxed: bool) -> anyhow::Result<()> {
            self.writes += 1;
            if self.failures > 0 {
                self.failures -= 1;
                anyhow::bail!("injected failure");
            }
            self.held = Some(relaxed);
            Ok(())
        }
    }
    let mut sync = LevelSync::default();
    let mut plane = Plane {
        held: Some(false),
        failures: 0,
        writes: 0,
    };
    let tick = |sync: &mut LevelSync, plane: &mut Plane, relaxed: bool| {
        let held = plane.held;
        sync.tick(relaxed, held, |r| plane.write(r))
    };
    // Agreeing: nothing written, nothing logged.
    assert_eq!(tick(&mut sync, &mut plane, false), Synced::Agrees);
    assert_eq!((plane.writes, sync.lines), (0, 0));
    // The level went low and its write failed twice: rewritten on every tick until it
    // holds, one line when it starts and one when it ends.
    plane.failures = 2;
    assert_eq!(tick(&mut sync, &mut plane, true), Synced::Failed);
    assert_eq!(tick(&mut sync, &mut plane, true), Synced::Failed);
    assert_eq!(sync.lines, 1, "once an episode");
    assert_eq!(plane.held, Some(false));
    assert_eq!(tick(&mut sync, &mut plane, true), Synced::Rewritten);
    assert_eq!(plane.held, Some(true));
    assert_eq!(tick(&mut sync, &mut plane, true), Synced::Agrees);
    assert_eq!((plane.writes, sync.lines), (3, 2));
    assert_eq!(tick(&mut sync, &mut plane, true), Synced::Agrees);
    assert_eq!((plane.writes, sync.lines), (3, 2));
    // Someone else writes the entry: put back at once, one line.
    plane.held = Some(false);
    assert_eq!(tick(&mut sync, &mut plane, true), Synced::Rewritten);
    assert_eq!(tick(&mut sync, &mut plane, true), Synced::Agrees);
    assert_eq!((plane.held, plane.writes, sync.lines), (Some(true), 4, 3));
    // An entry that cannot be read is written.
    plane.held = None;
    assert_eq!(tick(&mut sync, &mut plane, true), Synced::Rewritten);
    assert_eq!(plane.held, Some(true));
}
