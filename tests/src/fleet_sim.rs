//! A deterministic simulation of global thresholds across a fleet of hosts: no kernel, no
//! store, no sleeping.
//!
//! Each simulated host judges its packets with the limiter's own arithmetic
//! (`ratelimit_common::limiter`, the window branch of the program's `limit_check`) on a
//! per-source state of its own, finds the clients to sync with [`GlobalRule::wants`] every
//! [`global::SCAN_EVERY`], and runs the daemon's real sync round ([`global::round`]) every
//! sync interval against one in-memory store ([`MemoryCounts`], the sync script's
//! semantics). A round reads the states when it starts and calls the store and adds the
//! totals one round trip later (a per-host round trip, with jitter); a call may be lost
//! (the request or the reply), and the store may be down for a span (every call fails).
//!
//! Traffic: one client offered at `k x L` per window, spread over `N_k` of the `N` hosts
//! (even, Zipf-skewed, or skewed with the heavy share moving on every half window), and one
//! background client per host at 1% of `L` (below the publish share: never synced).
//! Time is the wall clock in ns, so windows are the program's global windows.

use std::{
    cell::RefCell,
    cmp::Reverse,
    collections::BinaryHeap,
    future::Future,
    pin::pin,
    task::{Context, Poll, Waker},
};

use ratelimit_common::{limiter, maps::ClientState};
use ratelimit_user::{
    fleet::global::{self, CountStore, GlobalRule, MemoryCounts, SlotStates, Synced},
    kernel::clients::{Meter, SlotRef},
};

const NS: u64 = 1_000_000_000;
/// The simulation's epoch (unix s): a multiple of every interval swept.
const EPOCH_NS: u64 = 1_800_000_000 * NS;
/// Background clients' offered share of `L` per window.
const BACKGROUND_SHARE: f64 = 0.01;

pub use crate::rng::Rng;

/// How the hot client's traffic is spread over the hosts that see it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Split {
    Even,
    /// Zipf: host i gets a share proportional to 1 / (i + 1).
    Skewed,
    /// Skewed, and the shares move one host on every half window (anycast shifts).
    Shifting,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Scenario {
    pub name: String,
    /// Hosts in the fleet, and those that see the hot client.
    pub hosts: usize,
    pub hot_hosts: usize,
    pub split: Split,
    /// The hot client's offered load, in thresholds per window.
    pub offered: f64,
    pub threshold: u64,
    pub interval_s: u64,
    pub sync_ms: u64,
    pub fixed_window: bool,
    /// Mean store round trip (ms): each host's is drawn in [0.5, 1.5] of it, and each
    /// call adds an exponential jitter of a fifth of the host's.
    pub rtt_ms: f64,
    /// Share of calls lost.
    pub loss: f64,
    /// The store is down for the measured windows.
    pub outage: bool,
    pub warmup: u64,
    pub windows: u64,
    pub seed: u64,
}

impl Scenario {
    /// The steady case: `hosts`, `hot_hosts` (even split), interval, sync interval.
    pub fn steady(hosts: usize, hot_hosts: usize, interval_s: u64, sync_ms: u64) -> Scenario {
        let (warmup, windows) = match interval_s {
            0..=1 => (4, 8),
            2..=10 => (2, 4),
            _ => (2, 3),
        };
        Scenario {
            name: "steady".into(),
            hosts,
            hot_hosts,
            split: Split::Even,
            offered: 4.0,
            threshold: 4000,
            interval_s,
            sync_ms,
            fixed_window: false,
            rtt_ms: 2.0,
            loss: 0.0,
            outage: false,
            warmup,
            windows,
            seed: 1,
        }
    }

    pub fn named(mut self, name: &str) -> Scenario {
        self.name = name.into();
        self
    }
}

/// What a scenario measured.
#[derive(Clone, Debug, PartialEq)]
pub struct Outcome {
    pub scenario: Scenario,
    /// Windows measured (after the warm-up).
    pub windows: u64,
    /// The fleet's admitted count of the hot client per window against `L`: mean and max
    /// of `admitted / L - 1`.
    pub mean_over: f64,
    pub max_over: f64,
    /// §2.9's steady overshoot without prediction, `(lambda / T) (N_k - 1) / N_k`, with
    /// lambda the sync interval plus the mean round trip drawn.
    pub eps_ss: f64,
    /// The most one host admitted of the hot client in a measured window, against `L`.
    pub max_host: f64,
    /// Key updates (pairs sent) and store calls, per host (of all N) per second.
    pub updates_per_host_s: f64,
    pub calls_per_host_s: f64,
    /// Calls that failed (lost or store down), in all.
    pub errors: u64,
    /// Hosts that synced the hot client at the end.
    pub synced_hosts: usize,
}

/// The program's verdict for one packet of cost 1 on a window meter (`limit_check`'s
/// window branch, one CPU): rotate forward only, then admit iff the estimate plus the cost
/// stays within the threshold, and count it.
pub fn judge(st: &mut ClientState, now: u64, interval: u64, threshold: u64, fixed: bool) -> bool {
    let w = limiter::window_of(now, interval);
    let s = st.stamp;
    if w > s || w.wrapping_add(1) < s {
        st.stamp = w;
        let c = std::mem::take(&mut st.cur);
        st.prev = limiter::rotate(s, w, c, 0).1;
    }
    let weight = if fixed {
        0
    } else {
        limiter::prev_weight_in(now, interval, w)
    };
    let est = limiter::sliding_estimate(st.prev, st.cur, weight);
    if !limiter::sliding_admits(est, 1, threshold) {
        return false;
    }
    st.cur += 1;
    true
}

/// A host's per-source states: slot 0 the hot client, slot 1 its background client. A
/// round reads what was read when it started, and adds into the live states.
struct View<'a> {
    live: &'a RefCell<[ClientState; 2]>,
    read: &'a [ClientState; 2],
}

impl SlotStates for View<'_> {
    fn slot_state(&self, at: &SlotRef) -> Option<ClientState> {
        self.read.get(at.index as usize).copied()
    }

    fn add_in_window(
        &self,
        at: &SlotRef,
        meter: Meter,
        window: u64,
        to_prev: bool,
        delta: u64,
    ) -> bool {
        let mut live = self.live.borrow_mut();
        let Some(st) = live.get_mut(at.index as usize) else {
            return false;
        };
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

/// A host's connection to the shared in-memory store: loss and outage.
struct Client<'a> {
    store: &'a RefCell<MemoryCounts>,
    rng: &'a mut Rng,
    loss: f64,
    down: bool,
    calls: &'a mut u64,
    updates: &'a mut u64,
}

impl CountStore for Client<'_> {
    fn sync(
        &mut self,
        hash: &str,
        host: &str,
        expire_ms: u64,
        pairs: &[(&str, u64)],
    ) -> impl Future<Output = anyhow::Result<Vec<u64>>> + Send {
        let r = if self.down {
            Err(anyhow::anyhow!("store unavailable"))
        } else {
            let lost = self.loss > 0.0 && self.rng.unit() < self.loss;
            if lost && self.rng.unit() < 0.5 {
                Err(anyhow::anyhow!("request lost"))
            } else {
                *self.calls += 1;
                *self.updates += pairs.len() as u64;
                let totals = self.store.borrow_mut().run(hash, host, expire_ms, pairs);
                if lost {
                    Err(anyhow::anyhow!("reply lost"))
                } else {
                    Ok(totals)
                }
            }
        };
        std::future::ready(r)
    }
}

impl global::Announce for Client<'_> {
    async fn announce(&mut self, set: &str, expire_ms: u64, keys: &[String]) -> anyhow::Result<()> {
        if self.down {
            anyhow::bail!("store unavailable");
        }
        self.store.borrow_mut().add_to_set(set, expire_ms, keys);
        Ok(())
    }

    async fn announced(&mut self, sets: &[String]) -> Vec<Vec<String>> {
        if self.down {
            return vec![Vec::new(); sets.len()];
        }
        let s = self.store.borrow();
        sets.iter().map(|n| s.members(n)).collect()
    }
}

/// Run a future that never waits (the in-memory store answers at once).
fn at_once<F: Future>(f: F) -> F::Output {
    let mut f = pin!(f);
    match f.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(v) => v,
        Poll::Pending => unreachable!("the in-memory store never waits"),
    }
}

struct Host {
    name: String,
    live: RefCell<[ClientState; 2]>,
    read: [ClientState; 2],
    addrs: [[u8; 16]; 2],
    synced: Vec<Synced>,
    /// Slots whose client is synced.
    syncing: [bool; 2],
    phase_ns: u64,
    last_scan: Option<u64>,
    rtt_ns: f64,
    rng: Rng,
    calls: u64,
    updates: u64,
    errors: u64,
    /// Hot client's admitted count per window (from the start).
    admitted: Vec<u64>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Ev {
    Hot,
    Background,
    Tick(usize),
    Reply(usize),
}

fn addr(i: u32) -> [u8; 16] {
    std::net::Ipv4Addr::from(0x0a00_0000 + i)
        .to_ipv6_mapped()
        .octets()
}

/// Run one scenario.
pub fn run(sc: &Scenario) -> Outcome {
    let interval = sc.interval_s * NS;
    let sync = sc.sync_ms * 1_000_000;
    let scan = global::SCAN_EVERY.as_nanos() as u64;
    let total_windows = sc.warmup + sc.windows;
    let end = EPOCH_NS + total_windows * interval;
    let (down_from, down_to) = if sc.outage {
        (EPOCH_NS + sc.warmup * interval, end)
    } else {
        (u64::MAX, u64::MAX)
    };
    let rules = vec![GlobalRule {
        index: 0,
        name: "sim".into(),
        rid: "sim#00000000".into(),
        interval_ns: interval,
        threshold: sc.threshold,
        ban_interval_ns: 0,
        ban_threshold: 0,
        burst: None,
        burst_ns: 0,
        kind: ratelimit_common::maps::KEY_IP,
    }];
    let mut rng = Rng::new(sc.seed);
    let mut hosts: Vec<Host> = (0..sc.hosts)
        .map(|h| Host {
            name: format!("host-{h:03}"),
            live: RefCell::new([ClientState::default(); 2]),
            read: [ClientState::default(); 2],
            addrs: [addr(1), addr(1000 + h as u32)],
            synced: Vec::new(),
            syncing: [false; 2],
            phase_ns: (rng.unit() * sync as f64) as u64,
            last_scan: None,
            rtt_ns: sc.rtt_ms * 1e6 * (0.5 + rng.unit()),
            rng: Rng::new(rng.next_u64()),
            calls: 0,
            updates: 0,
            errors: 0,
            admitted: vec![0; total_windows as usize],
        })
        .collect();
    let hot = sc.hot_hosts.min(sc.hosts).max(1);
    let weights: Vec<f64> = (0..hot)
        .map(|i| match sc.split {
            Split::Even => 1.0,
            Split::Skewed | Split::Shifting => 1.0 / (i + 1) as f64,
        })
        .collect();
    let weight_sum: f64 = weights.iter().sum();
    let store = RefCell::new(MemoryCounts::default());
    let mut last_expire = 0u64;

    let mut queue = BinaryHeap::new();
    let mut seq = 0u64;
    let mut push = |q: &mut BinaryHeap<Reverse<(u64, u64, Ev)>>, t: u64, e: Ev| {
        seq += 1;
        q.push(Reverse((t, seq, e)));
    };
    let hot_gap = interval as f64 / (sc.offered * sc.threshold as f64);
    let bg_gap = interval as f64 / (BACKGROUND_SHARE * sc.threshold as f64 * sc.hosts as f64);
    push(&mut queue, EPOCH_NS, Ev::Hot);
    push(&mut queue, EPOCH_NS, Ev::Background);
    for (h, host) in hosts.iter().enumerate() {
        push(&mut queue, EPOCH_NS + host.phase_ns, Ev::Tick(h));
    }

    while let Some(Reverse((t, _, ev))) = queue.pop() {
        if t >= end {
            break;
        }
        match ev {
            Ev::Hot => {
                let mut u = rng.unit() * weight_sum;
                let mut i = 0;
                while i + 1 < hot && u >= weights[i] {
                    u -= weights[i];
                    i += 1;
                }
                if sc.split == Split::Shifting {
                    let shift = ((t - EPOCH_NS) / (interval / 2)) as usize;
                    i = (i + shift) % hot;
                }
                let host = &mut hosts[i];
                let ok = judge(
                    &mut host.live.borrow_mut()[0],
                    t,
                    interval,
                    sc.threshold,
                    sc.fixed_window,
                );
                if ok {
                    host.admitted[((t - EPOCH_NS) / interval) as usize] += 1;
                }
                push(&mut queue, t + rng.exp(hot_gap) as u64 + 1, Ev::Hot);
            }
            Ev::Background => {
                let h = (rng.next_u64() % sc.hosts as u64) as usize;
                judge(
                    &mut hosts[h].live.borrow_mut()[1],
                    t,
                    interval,
                    sc.threshold,
                    sc.fixed_window,
                );
                push(&mut queue, t + rng.exp(bg_gap) as u64 + 1, Ev::Background);
            }
            Ev::Tick(h) => {
                let host = &mut hosts[h];
                if host.last_scan.is_none_or(|s| t - s >= scan) {
                    host.last_scan = Some(t);
                    let live = *host.live.borrow();
                    let store_up = !(down_from..down_to).contains(&t);
                    for (i, st) in live.iter().enumerate() {
                        // As the daemon's walk: its own count worth sharing, or announced
                        // near its limit by another host in this window.
                        let announced = store_up && st.stamp != 0 && {
                            let name = global::key_name(&host.addrs[i], 128);
                            let set = global::announce_set(
                                &rules[0].rid,
                                Meter::Admitted,
                                global::bucket_of(&rules[0].rid, &name),
                                t / interval,
                            );
                            store.borrow().members(&set).contains(&name)
                        };
                        if !host.syncing[i] && (rules[0].wants(st) || announced) {
                            let at = SlotRef {
                                index: i as u64,
                                tag: 1,
                                addr: host.addrs[i],
                            };
                            host.synced.push(Synced::new(&rules, 0, at, 128));
                            host.syncing[i] = true;
                        }
                    }
                }
                if host.synced.is_empty() {
                    // The daemon's ticks until its next walk do nothing.
                    let next_scan = host.last_scan.unwrap_or(t) + scan;
                    let ticks = (next_scan - t).div_ceil(sync);
                    push(&mut queue, t + ticks * sync, Ev::Tick(h));
                    continue;
                }
                host.read = *host.live.borrow();
                let rtt = host.rtt_ns + host.rng.exp(host.rtt_ns / 5.0);
                push(&mut queue, t + rtt as u64, Ev::Reply(h));
                push(&mut queue, t + sync, Ev::Tick(h));
            }
            Ev::Reply(h) => {
                let window = t / interval;
                if window != last_expire {
                    last_expire = window;
                    let mut s = store.borrow_mut();
                    s.now_ms = t / 1_000_000;
                    s.expire();
                }
                store.borrow_mut().now_ms = t / 1_000_000;
                let Host {
                    name,
                    live,
                    read,
                    synced,
                    rng: host_rng,
                    calls,
                    updates,
                    errors,
                    ..
                } = &mut hosts[h];
                let view = View { live, read };
                let mut client = Client {
                    store: &store,
                    rng: host_rng,
                    loss: sc.loss,
                    down: (down_from..down_to).contains(&t),
                    calls,
                    updates,
                };
                if at_once(global::round(&mut client, name, &view, &rules, synced)).is_err() {
                    *errors += 1;
                }
            }
        }
    }

    let measured = sc.warmup as usize..total_windows as usize;
    let l = sc.threshold as f64;
    let overs: Vec<f64> = measured
        .clone()
        .map(|w| hosts.iter().map(|h| h.admitted[w]).sum::<u64>() as f64 / l - 1.0)
        .collect();
    let max_host = hosts
        .iter()
        .flat_map(|h| h.admitted[measured.clone()].iter())
        .copied()
        .max()
        .unwrap_or(0) as f64
        / l;
    let mean_rtt = hosts[..hot].iter().map(|h| h.rtt_ns * 1.2).sum::<f64>() / hot as f64;
    let lambda = sync as f64 + mean_rtt;
    let nk = hot as f64;
    let secs = (total_windows * sc.interval_s) as f64 * sc.hosts as f64;
    Outcome {
        scenario: sc.clone(),
        windows: sc.windows,
        mean_over: overs.iter().sum::<f64>() / overs.len().max(1) as f64,
        max_over: overs.iter().copied().fold(f64::MIN, f64::max),
        eps_ss: lambda / interval as f64 * (nk - 1.0) / nk,
        max_host,
        updates_per_host_s: hosts.iter().map(|h| h.updates).sum::<u64>() as f64 / secs,
        calls_per_host_s: hosts.iter().map(|h| h.calls).sum::<u64>() as f64 / secs,
        errors: hosts.iter().map(|h| h.errors).sum(),
        synced_hosts: hosts.iter().filter(|h| !h.synced.is_empty()).count(),
    }
}

/// The quick set: the targets' cases (N = 200, T = 60 s, sync 100 ms, even split, N_k = 8
/// and 64) and a store outage.
pub fn quick(seed: u64) -> Vec<Scenario> {
    let mut v = vec![
        Scenario::steady(200, 8, 60, 100),
        Scenario::steady(200, 64, 60, 100),
        outage(200, 10),
    ];
    for s in &mut v {
        s.seed = seed;
    }
    v
}

/// The store down for the measured windows: 4 hosts share a client offered at 8 L.
pub fn outage(hosts: usize, interval_s: u64) -> Scenario {
    Scenario {
        hot_hosts: 4,
        offered: 8.0,
        outage: true,
        ..Scenario::steady(hosts, 4, interval_s, 100)
    }
    .named("store outage")
}

/// The full sweep.
pub fn full(seed: u64) -> Vec<Scenario> {
    let mut v = Vec::new();
    for t in [1, 10, 60] {
        for sync in [20, 100, 250] {
            for nk in [1, 4, 8, 16, 64] {
                v.push(Scenario::steady(200, nk, t, sync));
            }
        }
    }
    for n in [100, 500] {
        for nk in [8, 64] {
            v.push(Scenario::steady(n, nk, 60, 100));
        }
    }
    for (split, name) in [(Split::Skewed, "skewed"), (Split::Shifting, "shifting")] {
        for t in [10, 60] {
            for nk in [8, 64] {
                v.push(
                    Scenario {
                        split,
                        ..Scenario::steady(200, nk, t, 100)
                    }
                    .named(name),
                );
            }
        }
    }
    v.push(
        Scenario {
            fixed_window: true,
            ..Scenario::steady(200, 8, 60, 100)
        }
        .named("fixed window"),
    );
    v.push(
        Scenario {
            offered: 3.0,
            ..Scenario::steady(200, 64, 60, 100)
        }
        .named("below publish share"),
    );
    for t in [10, 60] {
        v.push(
            Scenario {
                loss: 0.1,
                ..Scenario::steady(200, 8, t, 100)
            }
            .named("10% calls lost"),
        );
    }
    v.push(outage(200, 10));
    v.push(outage(500, 60));
    for s in &mut v {
        s.seed = seed;
    }
    v
}

/// The results as a markdown table.
pub fn table(out: &[Outcome]) -> String {
    let mut s = String::from(
        "| scenario | N | N_k | k | Δ ms | T s | windows | mean over % | max over % | ε_ss % | max host/L | upd/host/s | calls/host/s | errors | synced hosts |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for o in out {
        let c = &o.scenario;
        s += &format!(
            "| {} | {} | {} | {} | {} | {} | {} | {:.2} | {:.2} | {:.3} | {:.3} | {:.3} | {:.3} | {} | {} |\n",
            c.name,
            c.hosts,
            c.hot_hosts,
            c.offered,
            c.sync_ms,
            c.interval_s,
            o.windows,
            o.mean_over * 100.0,
            o.max_over * 100.0,
            o.eps_ss * 100.0,
            o.max_host,
            o.updates_per_host_s,
            o.calls_per_host_s,
            o.errors,
            o.synced_hosts,
        );
    }
    s
}
