//! The fleet simulation's quick set (no kernel, no root): the accuracy targets of the steady
//! case hold, a store outage leaves each host at most its threshold, and one seed gives the
//! same results every time.

use ratelimit_tests::fleet_sim::{self, Split};

#[test]
fn quick_fleet_simulation_meets_its_targets() {
    let set = fleet_sim::quick(7);
    let out: Vec<_> = set.iter().map(fleet_sim::run).collect();
    println!("{}", fleet_sim::table(&out));
    for o in &out {
        let c = &o.scenario;
        if c.outage {
            assert!(o.errors > 0, "{c:?}: the store was down");
            assert!(
                o.max_host <= 1.0,
                "{c:?}: a host admitted {:.3} L in a window without the store",
                o.max_host
            );
            continue;
        }
        assert_eq!(
            (c.split, c.interval_s, c.sync_ms, c.hosts),
            (Split::Even, 60, 100, 200)
        );
        let bound = match c.hot_hosts {
            8 => 0.02,
            64 => 0.05,
            n => panic!("no target for N_k = {n}"),
        };
        assert!(
            o.max_over <= bound,
            "N_k = {}: the fleet admitted {:.2}% over L (bound {:.0}%)",
            c.hot_hosts,
            o.max_over * 100.0,
            bound * 100.0
        );
        // Held to L, not starved.
        assert!(
            o.mean_over >= -0.05,
            "N_k = {}: the fleet admitted {:.2}% under L",
            c.hot_hosts,
            -o.mean_over * 100.0
        );
        assert_eq!(
            o.synced_hosts, c.hot_hosts,
            "every host of the client syncs it"
        );
    }
    let again: Vec<_> = set.iter().map(fleet_sim::run).collect();
    assert_eq!(out, again, "the same seed, the same results");
}
