use std::collections::HashMap;

use ratelimit_common::maps::{
    ClientKey, ClientState, FleetAdd, GLOBAL_TB_WINDOW_NS, KEY_ALL, KEY_IP, KEY_REGION,
};

use super::{
    synced::{Added, WARM_ROUNDS},
    *,
};
use crate::kernel::clients::{Meter, SlotRef};

#[test]
fn what_was_added_follows_the_program_s_rotation() {
    let mut a = Added {
        window: 7,
        cur: 30,
        prev: 5,
        rounds: 3,
        announced: true,
        ..Added::default()
    };
    a.roll(7);
    assert_eq!((a.window, a.cur, a.prev), (7, 30, 5));
    // The next window: the program moved cur into prev, and so did what was added.
    a.roll(8);
    assert_eq!((a.window, a.cur, a.prev, a.rounds), (8, 0, 30, 0));
    // A window skipped: the program started clean.
    a.cur = 4;
    a.roll(10);
    assert_eq!((a.window, a.cur, a.prev), (10, 0, 0));
}

#[test]
fn a_client_is_synced_from_a_share_of_its_threshold() {
    let g = GlobalRule {
        rid: "r#0".into(),
        ..rule().remove(0)
    };
    assert!(!g.worth(Meter::Admitted, 0));
    assert!(!g.worth(Meter::Admitted, 49));
    assert!(g.worth(Meter::Admitted, 50));
    assert_eq!(g.meters().count(), 1, "a throttle has no ban meter");
}

/// One client's state, as the program would hold it.
struct OneSlot(std::cell::RefCell<ClientState>);

impl SlotStates for OneSlot {
    fn slot_state(&self, _: &SlotRef) -> Option<ClientState> {
        Some(*self.0.borrow())
    }

    fn add_in_window(
        &self,
        _: &SlotRef,
        meter: Meter,
        window: u64,
        to_prev: bool,
        delta: u64,
    ) -> bool {
        let mut st = self.0.borrow_mut();
        if meter != Meter::Admitted || st.stamp != window {
            return false;
        }
        if to_prev {
            st.prev += delta;
        } else {
            st.cur += delta;
        }
        true
    }
}

fn rule() -> Vec<GlobalRule> {
    vec![GlobalRule {
        index: 0,
        name: "r".into(),
        rid: "r#1".into(),
        interval_ns: 1_000_000_000,
        threshold: 1000,
        ban_interval_ns: 0,
        ban_threshold: 0,
        burst: None,
        burst_ns: 0,
        kind: KEY_IP,
    }]
}

fn one_client(rules: &[GlobalRule]) -> Vec<Synced> {
    let at = SlotRef {
        index: 0,
        tag: 1,
        addr: std::net::Ipv6Addr::from([0, 0, 0, 0, 0, 0xffff, 0xc000, 0x0201]).octets(),
    };
    vec![Synced::new(rules, 0, at, 128)]
}

/// [`rule`] with one client synced whose state holds `cur` of its own in window 7, an empty
/// memory store, and the client's name and hash of admitted counts in window 7.
fn in_window_7(
    cur: u64,
) -> (
    Vec<GlobalRule>,
    Vec<Synced>,
    OneSlot,
    MemoryCounts,
    String,
    String,
) {
    let rules = rule();
    let synced = one_client(&rules);
    let slots = OneSlot(std::cell::RefCell::new(ClientState {
        stamp: 7,
        cur,
        ..Default::default()
    }));
    let name = synced[0].name.clone();
    let h = hash_name("r#1", Meter::Admitted, synced[0].bucket, 7);
    (rules, synced, slots, MemoryCounts::default(), name, h)
}

/// A round against the memory store (which answers at once).
fn now_round<S: SlotStates>(
    m: &mut MemoryCounts,
    slots: &S,
    rules: &[GlobalRule],
    synced: &mut [Synced],
) -> Round {
    ready(round(m, "a", slots, rules, synced))
}

/// A future of the memory store, which never waits.
fn ready<T>(f: impl std::future::Future<Output = anyhow::Result<T>>) -> T {
    let mut f = std::pin::pin!(f);
    match f
        .as_mut()
        .poll(&mut std::task::Context::from_waker(std::task::Waker::noop()))
    {
        std::task::Poll::Ready(r) => r.unwrap(),
        std::task::Poll::Pending => unreachable!("the memory store answers at once"),
    }
}

#[test]
fn a_client_no_other_host_counts_is_shared_at_the_warm_pace_however_near() {
    // 900 of 1000: near its limit, and it keeps moving.
    let (rules, mut synced, slots, mut m, _, _) = in_window_7(900);
    let rounds = |m: &mut MemoryCounts, synced: &mut Vec<Synced>, n: u32, step: u64| {
        (0..n)
            .map(|_| {
                let k = now_round(m, &slots, &rules, synced).keys;
                slots.0.borrow_mut().cur += step;
                k
            })
            .collect::<Vec<u64>>()
    };
    let next_window = |cur: u64| {
        let mut st = slots.0.borrow_mut();
        st.prev = st.cur;
        st.cur = cur;
        st.stamp += 1;
    };
    // Newly synced: taken as shared for the window it was found in (its count and the
    // previous window's, every round).
    assert_eq!(rounds(&mut m, &mut synced, 3, 5), [2, 2, 2]);
    // No other host counted it in that window: in the next, its first round (both
    // windows), then once in WARM_ROUNDS + 1.
    next_window(600);
    let keys = rounds(&mut m, &mut synced, WARM_ROUNDS + 2, 5);
    assert_eq!(keys, [2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]);
    // Another host counts it: seen at this host's next publish, every round from then on.
    let name = synced[0].name.clone();
    let h = hash_name("r#1", Meter::Admitted, synced[0].bucket, 8);
    m.run(&h, "b", u64::MAX, &[(&name, 10)]);
    let keys = rounds(&mut m, &mut synced, WARM_ROUNDS + 3, 1);
    let first = keys.iter().position(|&k| k == 1).expect("published");
    assert!(first <= WARM_ROUNDS as usize, "{keys:?}");
    assert!(keys[first..].iter().all(|&k| k == 1), "{keys:?}");
    // The next window stays shared every round (another host counted it in the last one).
    next_window(600);
    let keys = rounds(&mut m, &mut synced, 3, 1);
    assert!(keys.iter().all(|&k| k >= 1), "{keys:?}");
}

#[test]
fn what_another_writer_puts_in_the_store_adds_at_most_the_limit() {
    let (rules, mut synced, slots, mut m, name, h) = in_window_7(100);
    // Someone writes an absurd count for the client.
    m.run(&h, "evil", u64::MAX, &[(&name, 1 << 62)]);
    let r = now_round(&mut m, &slots, &rules, &mut synced);
    assert_eq!(r.added, 1000, "capped at the threshold");
    assert_eq!(slots.0.borrow().cur, 1100);
    // And published only its own 100.
    assert_eq!(
        m.run(&h, "a", u64::MAX, &[(&name, 0)]),
        vec![(1u64 << 62) + 100]
    );
}

#[test]
fn a_state_made_anew_is_all_its_own_and_a_restart_waits_a_window() {
    let (rules, mut synced, slots, mut m, name, h) = in_window_7(50);
    m.run(&h, "b", u64::MAX, &[(&name, 300)]);
    now_round(&mut m, &slots, &rules, &mut synced);
    assert_eq!(slots.0.borrow().cur, 350, "b's 300 added");
    // Evicted and back in the same window: its state holds 20 of its own only.
    slots.0.borrow_mut().cur = 20;
    now_round(&mut m, &slots, &rules, &mut synced);
    // The store keeps this host's 50 (a count never goes down), so the new state gets the
    // fleet's 350 less its own 20: b's 300 and the 30 the old state had counted.
    assert_eq!(
        slots.0.borrow().cur,
        350,
        "the fleet's count, into the new state"
    );
    assert_eq!(
        m.run(&h, "x", u64::MAX, &[(&name, 0)]),
        vec![350],
        "a's 50 kept"
    );

    // A task restarted finds a state holding b's 300 and its own 50: it publishes nothing
    // as its own and adds nothing in that window.
    let st = ClientState {
        stamp: 7,
        cur: 350,
        ..Default::default()
    };
    slots.0.replace(st);
    let mut synced: Vec<Synced> = one_client(&rules)
        .into_iter()
        .map(|s| s.cautious(&rules[0], &st))
        .collect();
    let r = now_round(&mut m, &slots, &rules, &mut synced);
    assert_eq!((r.calls, r.added), (0, 0));
    assert_eq!(slots.0.borrow().cur, 350);
    // Next window: shared again, and the previous one (which may hold what the last run
    // added) is not.
    slots.0.replace(ClientState {
        stamp: 8,
        cur: 10,
        prev: 350,
        ..Default::default()
    });
    let r = now_round(&mut m, &slots, &rules, &mut synced);
    assert_eq!(r.calls, 1, "window 8 only");
    let h8 = hash_name("r#1", Meter::Admitted, synced[0].bucket, 8);
    assert_eq!(m.run(&h8, "x", u64::MAX, &[(&name, 0)]), vec![10]);
}

/// A token bucket's state, and the bucket time charged to it.
struct BucketSlot(
    std::cell::RefCell<ClientState>,
    std::cell::RefCell<Vec<(u64, u64)>>,
);

impl SlotStates for BucketSlot {
    fn slot_state(&self, _: &SlotRef) -> Option<ClientState> {
        Some(*self.0.borrow())
    }

    fn add_in_window(&self, _: &SlotRef, _: Meter, _: u64, _: bool, _: u64) -> bool {
        panic!("nothing is added into a token bucket's counts")
    }

    fn charge_bucket(&self, _: &SlotRef, ns: u64, cap_ns: u64) -> bool {
        self.1.borrow_mut().push((ns, cap_ns));
        true
    }
}

#[test]
fn a_token_bucket_is_charged_what_the_other_hosts_admitted() {
    // 100 a second, burst 20: 10 ms of bucket time a packet, 200 ms of burst.
    let rules = vec![GlobalRule {
        burst: Some(20),
        // The daemon's `gcra_burst_ns(20, 100, 1 s)`.
        burst_ns: 200_000_000,
        threshold: 100,
        ..rule().remove(0)
    }];
    let g = &rules[0];
    assert_eq!(g.limit_of(Meter::Admitted), 100 * 10 + 20);
    // Burst 200 ms and an interval (1 s) of debt.
    assert_eq!(
        (g.bucket_ns(3), g.charge_cap_ns()),
        (30_000_000, 1_200_000_000)
    );
    assert_eq!(g.admitted_window_ns(), GLOBAL_TB_WINDOW_NS);
    let w = 176_000_000;
    // This host admitted 60 in wall window w (`cur`, its window in `prev`); the TAT is
    // no window.
    let st = ClientState {
        stamp: 987_654_321,
        cur: 60,
        prev: w,
        ..Default::default()
    };
    assert!(g.wants(&st));
    let slots = BucketSlot(std::cell::RefCell::new(st), Default::default());
    let mut synced = one_client(&rules);
    let mut m = MemoryCounts::default();
    let name = synced[0].name.clone();
    let h = hash_name(&g.rid, Meter::Admitted, synced[0].bucket, w);
    m.run(&h, "b", u64::MAX, &[(&name, 300)]);
    let r = now_round(&mut m, &slots, &rules, &mut synced);
    // Its own 60 published; b's 300 charged: 3 s of bucket time (the charge's cap holds
    // it to an empty bucket and an interval of debt).
    assert_eq!(r.added, 300);
    assert_eq!(
        slots.1.borrow().as_slice(),
        [(3_000_000_000, 1_200_000_000)]
    );
    assert_eq!(m.run(&h, "x", u64::MAX, &[(&name, 0)]), vec![360]);
    // b admits 10 more, this host 5: only b's 10 are charged.
    m.run(&h, "b", u64::MAX, &[(&name, 310)]);
    slots.0.borrow_mut().cur = 65;
    now_round(&mut m, &slots, &rules, &mut synced);
    assert_eq!(slots.1.borrow().last(), Some(&(100_000_000, 1_200_000_000)));
    assert_eq!(m.run(&h, "x", u64::MAX, &[(&name, 0)]), vec![375]);
    // Nothing new: nothing charged.
    let before = slots.1.borrow().len();
    now_round(&mut m, &slots, &rules, &mut synced);
    assert_eq!(slots.1.borrow().len(), before);

    // The next wall window: the program started its count anew. b's late 20 of window w
    // are still charged; this host's last published 65 is what it shares of w.
    {
        let mut st = slots.0.borrow_mut();
        st.prev = w + 1;
        st.cur = 4;
    }
    m.run(&h, "b", u64::MAX, &[(&name, 330)]);
    now_round(&mut m, &slots, &rules, &mut synced);
    assert!(
        slots.1.borrow().contains(&(200_000_000, 1_200_000_000)),
        "{:?}",
        slots.1.borrow()
    );
    assert_eq!(m.run(&h, "x", u64::MAX, &[(&name, 0)]), vec![395]);

    // A task restarted in a window: b's count so far is taken as charged (the previous
    // run may have), what b admits after it is charged.
    let h1 = hash_name(&g.rid, Meter::Admitted, synced[0].bucket, w + 1);
    m.run(&h1, "b", u64::MAX, &[(&name, 50)]);
    let st = *slots.0.borrow();
    let mut synced: Vec<Synced> = one_client(&rules)
        .into_iter()
        .map(|s| s.cautious(g, &st))
        .collect();
    slots.1.borrow_mut().clear();
    now_round(&mut m, &slots, &rules, &mut synced);
    assert!(slots.1.borrow().is_empty(), "{:?}", slots.1.borrow());
    m.run(&h1, "b", u64::MAX, &[(&name, 57)]);
    now_round(&mut m, &slots, &rules, &mut synced);
    assert_eq!(slots.1.borrow().as_slice(), [(70_000_000, 1_200_000_000)]);
}

/// One shared key's state, and what was written for it.
struct OneShared(
    ClientKey,
    std::cell::RefCell<ClientState>,
    std::cell::RefCell<Vec<FleetAdd>>,
);

impl SharedStates for OneShared {
    fn shared_keys(&self, _: &[u8]) -> anyhow::Result<Vec<ClientKey>> {
        Ok(vec![self.0])
    }

    fn shared_state(&self, key: &ClientKey) -> Option<ClientState> {
        (*key == self.0).then(|| *self.1.borrow())
    }

    fn set_fleet_add(&self, _: &ClientKey, add: &FleetAdd) -> anyhow::Result<()> {
        self.2.borrow_mut().push(*add);
        Ok(())
    }
}

#[test]
fn a_shared_key_gets_what_the_other_hosts_counted_in_its_windows() {
    let rules = vec![GlobalRule {
        kind: KEY_ALL,
        ..rule().remove(0)
    }];
    let key = ClientKey {
        rule: 0,
        kind: KEY_ALL,
        ..Default::default()
    };
    assert_eq!(shared_key_name(&key), "all");
    let region = ClientKey {
        kind: KEY_REGION,
        addr: [b'D', b'E', 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
        ..key
    };
    assert_eq!(shared_key_name(&region), "region:DE");
    // Wall window 7 of 1 s; the key's own counts: 100 in window 7, 40 in window 6.
    let unix_ns = 7_500_000_000;
    let mono = 50_000_000_000;
    let one = OneShared(
        key,
        std::cell::RefCell::new(ClientState {
            stamp: 7,
            cur: 100,
            prev: 40,
            last_ns: mono - 1_000_000,
            ..Default::default()
        }),
        Default::default(),
    );
    let mut m = MemoryCounts::default();
    let b = bucket_of("r#1", "all");
    let (h7, h6) = (
        hash_name("r#1", Meter::Admitted, b, 7),
        hash_name("r#1", Meter::Admitted, b, 6),
    );
    m.run(&h7, "b", u64::MAX, &[("all", 300)]);
    m.run(&h6, "b", u64::MAX, &[("all", 50)]);
    let mut last = HashMap::new();
    let keys = [key];
    let run = |m: &mut MemoryCounts, last: &mut HashMap<ClientKey, FleetAdd>, unix_ns| {
        ready(shared_round(
            m, "a", &one, &rules, &keys, last, mono, unix_ns,
        ))
    };
    let r = run(&mut m, &mut last, unix_ns);
    assert_eq!((r.calls, r.keys, r.added, r.shared_keys), (2, 2, 300, 1));
    let want = FleetAdd {
        window: 7,
        cur: 300,
        prev: 50,
        ..Default::default()
    };
    assert_eq!(one.2.borrow().as_slice(), [want]);
    // Its own counts published for each window.
    assert_eq!(m.run(&h7, "x", u64::MAX, &[("all", 0)]), vec![400]);
    assert_eq!(m.run(&h6, "x", u64::MAX, &[("all", 0)]), vec![90]);
    // Nothing new: nothing written again.
    run(&mut m, &mut last, unix_ns);
    assert_eq!(one.2.borrow().len(), 1);
    // The wall clock in window 8 while the key's state is still in 7: its 100 is window 7's
    // (the one before), and it has nothing of window 8.
    let r = run(&mut m, &mut last, 8_100_000_000);
    assert_eq!(r.keys, 2);
    let h8 = hash_name("r#1", Meter::Admitted, b, 8);
    assert_eq!(m.run(&h8, "x", u64::MAX, &[("all", 0)]), vec![0]);
    assert_eq!(
        one.2.borrow().last(),
        Some(&FleetAdd {
            window: 8,
            cur: 0,
            prev: 300,
            ..Default::default()
        })
    );
    // What another writer puts in the store counts at most the threshold.
    m.run(&h8, "evil", u64::MAX, &[("all", 1 << 60)]);
    run(&mut m, &mut last, 8_200_000_000);
    assert_eq!(one.2.borrow().last().unwrap().cur, 1000);
    // A key idle for two intervals is not shared.
    one.1.borrow_mut().last_ns = mono - 3_000_000_000;
    let r = run(&mut m, &mut last, 8_300_000_000);
    assert_eq!((r.calls, r.shared_keys), (0, 0));
}

#[test]
fn a_walk_reads_at_most_a_bounded_share_of_an_announcement_set() {
    let mut m = MemoryCounts::default();
    let keys: Vec<String> = (0..5_000)
        .map(|i| format!("198.18.{}.{}/32", i / 256, i % 256))
        .collect();
    m.add_to_set("s", u64::MAX, &keys);
    assert_eq!(m.members("s").len(), ANNOUNCED_READ_MAX);
    m.add_to_set("t", u64::MAX, &keys[..10]);
    assert_eq!(m.members("t").len(), 10);
}

#[test]
fn the_memory_store_follows_the_script() {
    let mut m = MemoryCounts {
        now_ms: 1_000,
        ..Default::default()
    };
    // Nothing of its own: no hash made, totals 0.
    assert_eq!(m.run("h", "a", 5_000, &[("k", 0)]), vec![0]);
    assert!(m.is_empty());
    assert_eq!(m.run("h", "a", 5_000, &[("k", 10), ("j", 3)]), vec![10, 3]);
    assert_eq!(m.run("h", "b", 5_000, &[("k", 4)]), vec![14]);
    // Absolute counts: a replay or a lower count changes nothing, a higher one adds the rise.
    assert_eq!(m.run("h", "a", 5_000, &[("k", 10)]), vec![14]);
    assert_eq!(m.run("h", "a", 5_000, &[("k", 7)]), vec![14]);
    assert_eq!(m.run("h", "a", 6_000, &[("k", 12)]), vec![16]);
    // Expired at its time (the last PEXPIREAT's).
    m.now_ms = 6_000;
    assert_eq!(m.run("h", "b", 9_000, &[("k", 4)]), vec![4]);
    m.now_ms = 9_000;
    m.expire();
    assert!(m.is_empty());
}

#[test]
fn store_names_are_readable_and_cluster_safe() {
    let v4: std::net::Ipv6Addr = "::ffff:198.51.100.7".parse().unwrap();
    assert_eq!(key_name(&v4.octets(), 128), "198.51.100.7/32");
    let v6: std::net::Ipv6Addr = "2001:db8::".parse().unwrap();
    assert_eq!(key_name(&v6.octets(), 64), "2001:db8::/64");
    assert_eq!(
        hash_name("r#00000001", Meter::Offered, 3, 42),
        "ratelimit:{g3}:o:r#00000001:42"
    );
}
