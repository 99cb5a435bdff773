use std::{io, path::PathBuf, time::SystemTime};

use ratelimit_common::event::*;

use super::*;
use super::{
    cap::Limiter,
    line::SummaryLine,
    sink::{LineOutput, write_lines},
    writer::rfc3339_ns,
};
use crate::{
    clock::{mono_ns, rfc3339},
    config::EventsSink,
};

fn ev(kind: u32, ts_ns: u64) -> Event {
    Event {
        kind,
        rule: 0,
        key_kind: ratelimit_common::maps::KEY_IP as u32,
        prefix_len: 128,
        addr: [0; 16],
        src: [0; 16],
        ts_ns,
        count: 1,
        threshold: 1,
        expires_ns: 0,
    }
}

#[test]
fn events_limiter_caps_each_second_and_closes_it_after_the_next() {
    let mut l = Limiter::new(2);
    let mut closed = Vec::new();
    let admitted: Vec<bool> = (0..5)
        .map(|_| l.admit(100, 100, "soft_limit", &mut closed))
        .collect();
    assert_eq!(admitted, [true, true, false, false, false]);
    // A late event of the second before still counts there.
    assert!(l.admit(99, 100, "ban", &mut closed));
    assert!(closed.is_empty());
    assert_eq!(l.next_summary_ns(), Some(102_000_000_000));
    // Second 101: 99 closes (nothing suppressed), 100 stays open for late events.
    assert!(l.admit(101, 101, "ban", &mut closed));
    assert_eq!(closed.iter().map(|w| w.sec).collect::<Vec<_>>(), [99]);
    closed.clear();
    l.advance(102, &mut closed);
    assert_eq!(closed.len(), 1);
    assert_eq!(closed[0].sec, 100);
    assert_eq!(closed[0].suppressed, Tally::from([("soft_limit", 3)]));
    // An event far in the past (an old ban's expiry) counts in the current second.
    closed.clear();
    assert!(l.admit(5, 102, "unban", &mut closed));
    assert!(l.admit(5, 102, "unban", &mut closed));
    assert!(!l.admit(102, 102, "unban", &mut closed));
    // The wall clock stepped back: everything open closes.
    closed.clear();
    assert!(l.admit(50, 50, "ban", &mut closed));
    assert_eq!(closed.iter().map(|w| w.sec).collect::<Vec<_>>(), [101, 102]);
}

fn temp_file(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("rl-events-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join(name);
    let _ = std::fs::remove_file(&p);
    p
}

/// An output that takes `room` more bytes, then fails like a full disk; a file (which can
/// be cut back) or not (a pipe).
struct Full {
    data: Vec<u8>,
    room: usize,
    file: bool,
}

impl io::Write for Full {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if self.room == 0 {
            return Err(io::Error::from_raw_os_error(libc::ENOSPC));
        }
        // Short writes, as a filesystem does when it fills.
        let n = buf.len().min(self.room).min(5);
        self.data.extend_from_slice(&buf[..n]);
        self.room -= n;
        Ok(n)
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl LineOutput for Full {
    fn end(&mut self) -> Option<u64> {
        self.file.then_some(self.data.len() as u64)
    }
    fn cut(&mut self, len: u64) -> io::Result<()> {
        self.room += self.data.len() - len as usize;
        self.data.truncate(len as usize);
        Ok(())
    }
}

#[test]
fn events_a_write_that_fails_partway_leaves_whole_lines() {
    let bytes = b"{\"a\":1}\n{\"b\":2}\n{\"c\":3}\n";
    let ends = [8, 16, 24];
    // A file: cut back to the last whole line.
    let mut f = Full {
        data: b"{\"old\":1}\n".to_vec(),
        room: 20,
        file: true,
    };
    let w = write_lines(&mut f, bytes, &ends);
    assert_eq!(w.whole, 16);
    assert!(w.torn_rest.is_empty());
    assert_eq!(
        w.error.unwrap().raw_os_error(),
        Some(libc::ENOSPC),
        "the error is reported"
    );
    assert_eq!(f.data, b"{\"old\":1}\n{\"a\":1}\n{\"b\":2}\n");
    // A pipe: the torn line's rest comes first at the next write.
    let mut p = Full {
        data: Vec::new(),
        room: 12,
        file: false,
    };
    let w = write_lines(&mut p, bytes, &ends);
    assert_eq!((w.whole, w.torn_rest.as_slice()), (8, &b":2}\n"[..]));
    p.room = 100;
    let mut next = w.torn_rest.clone();
    next.extend_from_slice(b"{\"d\":4}\n");
    let w = write_lines(&mut p, &next, &[4, 12]);
    assert!(w.error.is_none() && w.whole == 12);
    assert_eq!(p.data, b"{\"a\":1}\n{\"b\":2}\n{\"d\":4}\n");
    // Everything fits: all of it, no error.
    let mut ok = Full {
        data: Vec::new(),
        room: 100,
        file: true,
    };
    let w = write_lines(&mut ok, bytes, &ends);
    assert!(w.error.is_none() && w.whole == 24 && ok.data == bytes);
}

#[test]
fn events_writer_caps_summarizes_and_keeps_operator_lines() {
    let path = temp_file("writer.jsonl");
    let sink = EventsSink::File(path.clone());
    let events = Events::start(Some(&sink), 3, vec!["r".into()]).unwrap();
    let now = mono_ns();
    events.data_plane((0..10).map(|_| ev(EV_SOFT_LIMIT, now)).collect());
    events.data_plane((0..2).map(|_| ev(EV_THROTTLE_START, now)).collect());
    let mut op = ev(EV_BAN, now);
    op.rule = ratelimit_common::maps::BAN_RULE_NONE;
    events.operator(vec![op; 5]);
    events.close(Duration::from_secs(5));
    let text = std::fs::read_to_string(&path).unwrap();
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let of = |e: &str| lines.iter().filter(|l| l["event"] == e).count();
    // The batch may straddle a second: at most 3 capped lines a second.
    let capped = of("soft_limit") + of("throttle_start");
    assert!((3..=6).contains(&capped), "{text}");
    assert_eq!(of("ban"), 5, "the operator's lines are not capped");
    let summaries: Vec<_> = lines
        .iter()
        .filter(|l| l["event"] == "suppressed")
        .collect();
    let suppressed: u64 = summaries.iter().map(|s| s["count"].as_u64().unwrap()).sum();
    assert_eq!(capped as u64 + suppressed, 12, "{text}");
    assert!(summaries.iter().all(|s| s["threshold"] == 3), "{text}");
    let c = events.counts();
    assert_eq!(
        (c.written, c.suppressed, c.queued),
        (capped as u64 + 5, suppressed, 0)
    );
    let b = lines.iter().find(|l| l["event"] == "ban").unwrap();
    assert_eq!(b["rule"], "");
    std::fs::remove_file(&path).unwrap();
}

#[test]
fn events_queue_is_bounded_and_counts_what_it_drops() {
    let path = temp_file("queue.jsonl");
    let sink = EventsSink::File(path.clone());
    let events = Events::start(Some(&sink), MAX_PER_SEC, vec![]).unwrap();
    // Fill the queue beyond its bound while the writer is busy: whatever it took is
    // written or queued, the rest is counted.
    let now = mono_ns();
    let n = QUEUE + 10_000;
    events.data_plane(vec![ev(EV_SOFT_LIMIT, now); n]);
    let c = events.counts();
    assert_eq!(c.lost_queue, 10_000);
    events.close(Duration::from_secs(30));
    let c = events.counts();
    assert_eq!(c.written + c.suppressed + c.lost_queue, n as u64);
    std::fs::remove_file(&path).unwrap();
}

/// The lines of a fleet-wide ban wave share the data plane's cap, summaries and queue
/// bound; the operator's own lines are never capped.
#[test]
fn events_fleet_lines_are_capped_and_bounded() {
    let path = temp_file("fleet.jsonl");
    let sink = EventsSink::File(path.clone());
    let events = Events::start(Some(&sink), 3, vec![]).unwrap();
    let line = |event: &'static str| EventLine {
        time: rfc3339(SystemTime::now()),
        event,
        rule: String::new(),
        key: "ip",
        client: "198.51.100.7/32".into(),
        count: 0,
        threshold: 0,
        ban_expires: None,
        origin: Some("edge-2".into()),
    };
    events.fleet_lines((0..40).map(|_| line("ban")).collect());
    events.fleet_lines((0..10).map(|_| line("unban")).collect());
    events.operator_lines((0..4).map(|_| line("unban")).collect());
    events.close(Duration::from_secs(5));
    let text = std::fs::read_to_string(&path).unwrap();
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let of = |e: &str| lines.iter().filter(|l| l["event"] == e).count();
    let fleet = of("ban") + of("unban") - 4;
    assert!((3..=6).contains(&fleet), "at most 3 a second:\n{text}");
    let suppressed: u64 = lines
        .iter()
        .filter(|l| l["event"] == "suppressed")
        .map(|s| s["count"].as_u64().unwrap())
        .sum();
    assert_eq!(fleet as u64 + suppressed, 50, "{text}");
    assert_eq!(events.counts().suppressed, suppressed);
    std::fs::remove_file(&path).unwrap();

    // The queue: a wave beyond the data plane's bound is cut to it and counted.
    let path = temp_file("fleet-queue.jsonl");
    let sink = EventsSink::File(path.clone());
    let events = Events::start(Some(&sink), MAX_PER_SEC, vec![]).unwrap();
    let n = QUEUE + 5_000;
    events.fleet_lines(vec![line("ban"); n]);
    assert_eq!(events.counts().lost_queue, 5_000);
    events.close(Duration::from_secs(30));
    let c = events.counts();
    assert_eq!(c.written + c.suppressed + c.lost_queue, n as u64);
    std::fs::remove_file(&path).unwrap();
}

#[test]
fn events_line_shape() {
    let mut e = ev(EV_BAN, 1_000_000_000);
    e.expires_ns = 2_000_000_000;
    let line = line_with(&e, &["r".into()], &mut |ns| ns.to_string());
    let v = serde_json::to_value(&line).unwrap();
    assert_eq!(
        v,
        serde_json::json!({
            "time": "1000000000", "event": "ban", "rule": "r", "key": "ip",
            "client": "::/128", "count": 1, "threshold": 1, "ban_expires": "2000000000"
        })
    );
    let tally = Tally::from([("ban", 2), ("soft_limit", 5)]);
    let s = SummaryLine {
        time: rfc3339_ns(1_700_000_000_000_000_000),
        event: SUMMARY_EVENT,
        count: 7,
        threshold: 1000,
        events: &tally,
    };
    assert_eq!(
        serde_json::to_string(&s).unwrap(),
        "{\"time\":\"2023-11-14T22:13:20.000Z\",\"event\":\"suppressed\",\"count\":7,\
         \"threshold\":1000,\"events\":{\"ban\":2,\"soft_limit\":5}}"
    );
}
