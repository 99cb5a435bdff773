//! Devices the Ethernet parser does not fit, and interfaces that come and go: a tun device
//! (no link-layer header, like wireguard and ip tunnels) judged from its IP header; a link left
//! pinned by a deleted or renamed interface that must not stop the daemon; and interfaces
//! created and deleted until more distinct ifindexes were seen than there are counter slots.

use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    time::Duration,
};

use ratelimit_tests::{
    Daemon, NetNs, UdpSink, VethPair, kernel_test,
    packet::Frame,
    scenario::{Scenario, metric_sum, verdict},
    tun::{Tun, ip_packet},
};
use ratelimit_user::policy::report::{IfaceCounters, Stats};

const PORT: u16 = 9000;

const POLICY: &str = r#"
[lists]
deny = ["198.19.66.0/24", "2001:db8:66::/48"]

[[rule]]
name = "udp"
match = { protocol = "udp", dst_ports = ["9000"] }
action = "rate_based_ban"
threshold = { count = 100, interval = "1h" }
ban_threshold = { count = 150, interval = "1h" }
ban_duration = "1h"
"#;

/// `stats --json` once `done` holds, or after 10 s: the program runs in softirq context, which
/// a busy machine may defer (to ksoftirqd) past a fixed sleep. The caller asserts exact numbers
/// on what is returned either way.
fn stats_when(d: &Daemon, done: impl Fn(&Stats) -> bool) -> Stats {
    let give_up = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let st = d.stats();
        if done(&st) || std::time::Instant::now() >= give_up {
            return st;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `stats`' entry for `iface`.
fn iface_stats<'a>(stats: &'a Stats, iface: &str) -> &'a IfaceCounters {
    stats
        .interfaces
        .iter()
        .find(|i| i.iface == iface)
        .unwrap_or_else(|| panic!("no interface {iface} in {stats:?}"))
}

fn iface_verdict(stats: &Stats, iface: &str, name: &str) -> u64 {
    stats.iface(iface).map_or(0, |c| c.verdict(name).packets)
}

/// A tun device has no Ethernet header (link type ARPHRD_NONE, as wireguard): the daemon
/// attaches the program's L3 entry, which reads the IP header first, and the limiter throttles,
/// bans and denies there exactly as on Ethernet, in both address families. Before the L3
/// entry, every packet on such a device passed unjudged as non-IP.
#[test]
fn a_tun_device_is_judged_from_its_ip_header() {
    kernel_test!();
    let ns = NetNs::new("rltun");
    let mut tun = Tun::new(&ns, "rltun0", 231);
    let pins = format!("/sys/fs/bpf/rl-tun-{}", std::process::id());
    let daemon = Daemon::start_in(&ns, |dir| {
        format!(
            "[daemon]\ninterfaces = [\"rltun0\"]\ncontrol_socket = \"ctl.sock\"\nstate_dir = \
             \"{d}/state\"\nbpffs_dir = \"{pins}\"\nhttp_listen = \"off\"\n{POLICY}",
            d = dir.display()
        )
    });
    let sink = UdpSink::new(&ns, PORT);
    let udp = |src: IpAddr| {
        let f = Frame::new([2, 0, 0, 0, 0, 1], [2, 0, 0, 0, 0, 2]);
        let f = match src {
            IpAddr::V4(s) => f.ipv4(s, tun.ipv4),
            IpAddr::V6(s) => f.ipv6(s, tun.ipv6),
        };
        ip_packet(&f.udp(40000, PORT).payload(&[0; 8]).build())
    };
    let heavy4 = IpAddr::V4(Ipv4Addr::new(198, 19, 7, 1));
    let heavy6 = IpAddr::V6(Ipv6Addr::new(0x2001, 0xdb8, 7, 0, 0, 0, 0, 1));
    let light = IpAddr::V4(Ipv4Addr::new(198, 19, 7, 2));
    let denied4 = IpAddr::V4(Ipv4Addr::new(198, 19, 66, 3));
    let denied6 = IpAddr::V6(Ipv6Addr::new(0x2001, 0xdb8, 0x66, 0, 0, 0, 0, 3));
    let (p_heavy4, p_heavy6, p_light) = (udp(heavy4), udp(heavy6), udp(light));
    let (p_denied4, p_denied6) = (udp(denied4), udp(denied6));
    tun.send_n(&p_heavy4, 200);
    tun.send_n(&p_heavy6, 200);
    tun.send_n(&p_light, 50);
    tun.send_n(&p_denied4, 20);
    tun.send_n(&p_denied6, 20);
    let st = stats_when(&daemon, |st| {
        verdict(st, "pass") + verdict(st, "drop_rule") + verdict(st, "drop_ban") >= 450
    });
    sink.wait_quiet(Duration::from_millis(300));
    let got = sink.snapshot();
    assert_eq!(
        (got.from(heavy4), got.from(heavy6), got.from(light)),
        (100, 100, 50),
        "admitted up to the threshold in each family, others untouched"
    );
    assert_eq!((got.from(denied4), got.from(denied6)), (0, 0), "denied");
    assert_eq!(verdict(&st, "drop_deny"), 40);
    assert_eq!(
        verdict(&st, "pass_non_ip"),
        0,
        "every packet was read as IP"
    );
    assert_eq!(
        verdict(&st, "drop_rule") + verdict(&st, "drop_ban"),
        200,
        "both heavy sources lost all above the threshold"
    );
    let bans = daemon.cli_json(&["bans"]);
    let mut cidrs: Vec<&str> = bans
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|b| b["cidr"].as_str())
        .collect();
    cidrs.sort();
    // (IPv6 clients are keyed by their /64 unless the rule says otherwise.)
    assert_eq!(
        cidrs,
        ["198.19.7.1/32", "2001:db8:7::/64"],
        "banned past 150"
    );
    // Banned: everything from them is dropped as banned, whatever the port.
    let before = daemon.stats();
    let other_port = |src: Ipv4Addr| {
        ip_packet(
            &Frame::new([2, 0, 0, 0, 0, 1], [2, 0, 0, 0, 0, 2])
                .ipv4(src, tun.ipv4)
                .icmp_echo(1, 1)
                .build(),
        )
    };
    tun.send_n(&other_port(Ipv4Addr::new(198, 19, 7, 1)), 10);
    let banned_before = verdict(&before, "drop_ban");
    let after = stats_when(&daemon, |st| verdict(st, "drop_ban") >= banned_before + 10);
    assert_eq!(
        verdict(&after, "drop_ban") - verdict(&before, "drop_ban"),
        10
    );
    let status = daemon.cli_json(&["status"]);
    assert_eq!(status["interfaces"][0]["entry"], "l3", "{status}");
    assert_eq!(iface_verdict(&after, "rltun0", "drop_deny"), 40);
    drop(daemon);
}

/// A daemon killed (its pins left behind), then the interface deleted and created again under
/// the same name: the pinned link belongs to a device that no longer exists and cannot be
/// adopted. The daemon starts anyway, says it dropped the stale link, and protects the new
/// device. Before, it failed to start ("replacing the program in the pinned link").
#[test]
fn a_link_pinned_for_a_deleted_interface_does_not_stop_the_daemon() {
    kernel_test!();
    let mut s = Scenario::new("rlre");
    s.start(POLICY);
    let old_ifindex = s.pair.b().ifindex;
    s.daemon_mut().kill9();
    s.recreate_link();
    assert_ne!(s.pair.b().ifindex, old_ifindex, "a new device");
    if let Err(e) = s.daemon_mut().try_restart() {
        panic!("the daemon did not start over the stale link: {e}");
    }
    assert!(
        s.daemon().logs().contains("no longer exists"),
        "the stale link is reported:\n{}",
        s.daemon().logs()
    );
    let status = s.daemon().cli_json(&["status"]);
    assert_eq!(
        status["interfaces"][0]["ifindex"],
        u64::from(s.pair.b().ifindex),
        "{status}"
    );
    // Enforcing on the new device: denied, throttled, others pass.
    let sink = s.sink(PORT);
    let mut tx = s.sender();
    let heavy = IpAddr::V4(Ipv4Addr::new(198, 19, 8, 1));
    let denied = IpAddr::V4(Ipv4Addr::new(198, 19, 66, 8));
    tx.send_n(std::iter::repeat(s.udp(heavy, PORT)), 130, None);
    tx.send_n(std::iter::repeat(s.udp(denied, PORT)), 20, None);
    let name = s.pair.b().name.clone();
    let st = stats_when(s.daemon(), |st| {
        iface_verdict(st, &name, "drop_deny") + iface_verdict(st, &name, "drop_rule") >= 50
    });
    sink.wait_quiet(Duration::from_millis(300));
    let got = sink.stop();
    assert_eq!((got.from(heavy), got.from(denied)), (100, 0));
    assert_eq!(iface_verdict(&st, &s.pair.b().name, "drop_deny"), 20);
    assert_eq!(iface_verdict(&st, &s.pair.b().name, "drop_rule"), 30);
}

/// Whether `iface` in `ns` has an XDP program attached.
fn has_xdp(ns: &NetNs, iface: &str) -> bool {
    let out = ns.ip(&["-j", "link", "show", "dev", iface]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    !v[0]["xdp"].is_null()
}

/// An interface deleted and created again while the daemon runs (a VPN or tunnel interface
/// restarting): the daemon notices within its watch period (2 s) and attaches to the new
/// device on its own, no reload needed. Before, the new device stayed unprotected until a
/// reload or restart.
#[test]
fn an_interface_re_created_while_the_daemon_runs_is_protected_again_on_its_own() {
    kernel_test!();
    let mut s = Scenario::new("rlw");
    s.start(POLICY);
    s.recreate_link();
    let new_ifindex = u64::from(s.pair.b().ifindex);
    // Two watch periods and slack for a busy machine.
    let give_up = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let status = s.daemon().cli_json(&["status"]);
        if status["interfaces"][0]["ifindex"] == new_ifindex {
            break;
        }
        assert!(
            std::time::Instant::now() < give_up,
            "not re-attached after 10 s: {status}\n{}",
            s.daemon().logs()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(s.daemon().logs().contains("was re-created: attached"));
    let mut tx = s.sender();
    let denied = IpAddr::V4(Ipv4Addr::new(198, 19, 66, 4));
    tx.send_n(std::iter::repeat(s.udp(denied, PORT)), 9, None);
    let name = s.pair.b().name.clone();
    let st = stats_when(s.daemon(), |st| iface_verdict(st, &name, "drop_deny") >= 9);
    assert_eq!(iface_verdict(&st, &name, "drop_deny"), 9);
}

/// The same, with the interface renamed away and another device (here a tun) created under
/// its name: the pinned link is still attached to the renamed device. The daemon must not
/// adopt it (it would go on enforcing on a device it no longer lists, and leave the new one
/// unprotected): it detaches it from the renamed device, says so, and attaches to the new one.
#[test]
fn a_link_pinned_on_a_renamed_interface_is_detached_from_it() {
    kernel_test!();
    let mut s = Scenario::new("rlrn");
    s.start(POLICY);
    let name = s.pair.b().name.clone();
    let renamed = format!("{}x", &name[..name.len().min(13)]);
    s.daemon_mut().kill9();
    s.server.ip(&["link", "set", &name, "down"]);
    s.server.ip(&["link", "set", &name, "name", &renamed]);
    s.server.ip(&["link", "set", &renamed, "up"]);
    assert!(
        has_xdp(&s.server, &renamed),
        "the pinned link followed the rename"
    );
    let mut tun = Tun::new(&s.server, &name, 232);
    if let Err(e) = s.daemon_mut().try_restart() {
        panic!("the daemon did not start: {e}");
    }
    assert!(
        !has_xdp(&s.server, &renamed),
        "the renamed device still runs the program:\n{}",
        s.daemon().logs()
    );
    assert!(
        s.daemon().logs().contains("renamed or re-created"),
        "the stale link is reported:\n{}",
        s.daemon().logs()
    );
    let status = s.daemon().cli_json(&["status"]);
    assert_eq!(status["interfaces"][0]["entry"], "l3", "{status}");
    let denied = Frame::new([2, 0, 0, 0, 0, 1], [2, 0, 0, 0, 0, 2])
        .ipv4(Ipv4Addr::new(198, 19, 66, 5), tun.ipv4)
        .udp(1, PORT)
        .build();
    tun.send_n(&ip_packet(&denied), 7);
    let st = stats_when(s.daemon(), |st| iface_verdict(st, &name, "drop_deny") >= 7);
    assert_eq!(iface_verdict(&st, &name, "drop_deny"), 7);
}

/// Interfaces attached, then deleted, twenty times over (a tunnel or a container's veth that
/// comes and goes): each new one gets a counter slot of its own, because slots of interfaces
/// no longer attached are freed. A freed slot's counts stay in the totals and the next
/// interface starts from zero. Before, slots were never freed: the 15th new interface counted
/// in the shared slot 0 and the 16th could not be attached at all. In `/metrics`, an
/// interface's series ends with it, and no other series takes over its counts (which
/// Prometheus would read as a burst of that many frames).
#[test]
fn interfaces_that_come_and_go_never_run_out_of_counter_slots() {
    kernel_test!();
    let mut s = Scenario::new("rlslot").with_http(19478);
    s.start("[lists]\ndeny = [\"198.19.66.0/24\"]\n");
    let dir = s.daemon().config_dir().to_path_buf();
    let base = s.daemon_table(&dir) + "[lists]\ndeny = [\"198.19.66.0/24\"]\n";
    let main = s.pair.b().name.clone();
    let only_main = format!("interfaces = [\"{main}\"]");
    assert!(base.contains(&only_main));
    let denied = Ipv4Addr::new(198, 19, 66, 9);
    for round in 1..=20u64 {
        let extra = VethPair::new(&s.client, &s.server);
        let cfg = base.replace(
            &only_main,
            &format!("interfaces = [\"{main}\", \"{}\"]", extra.b().name),
        );
        s.daemon_mut().write_config(&cfg);
        let out = s.daemon().cli(&["reload"]);
        assert!(
            out.status.success(),
            "round {round}: reload failed: {}\n{}",
            String::from_utf8_lossy(&out.stderr),
            s.daemon().logs()
        );
        let frame = Frame::new(extra.a().mac, extra.b().mac)
            .ipv4(denied, extra.b().ipv4)
            .udp(1, PORT)
            .build();
        let mut tx = ratelimit_tests::PacketSocket::new(&s.client, extra.a().ifindex);
        tx.send_n(std::iter::repeat(&frame), 3, None);
        let st = stats_when(s.daemon(), |st| verdict(st, "drop_deny") >= 3 * round);
        let mine = iface_stats(&st, &extra.b().name);
        assert_ne!(mine.slot, 0, "round {round}: a slot of its own: {st:?}");
        assert_eq!(
            mine.counters.verdict("drop_deny").packets,
            3,
            "round {round}: its own counts only, none inherited: {st:?}"
        );
        assert_eq!(
            verdict(&st, "drop_deny"),
            3 * round,
            "round {round}: the totals keep the counts of the interfaces gone"
        );
        let (code, text) = s.http_get("/metrics");
        assert_eq!(code, 200, "{text}");
        let deny = |labels: &[(&str, &str)]| {
            metric_sum(
                &text,
                "ratelimit_packets_total",
                &[&[("verdict", "drop_deny")], labels].concat(),
            )
        };
        assert_eq!(
            (deny(&[]), deny(&[("interface", &extra.b().name)])),
            (3.0, 3.0),
            "round {round}: the series of the interfaces attached now, the one gone in none\n{text}"
        );
        assert!(
            !text.contains("interface=\"\"} "),
            "round {round}: no frame of an unlisted interface\n{text}"
        );
        drop(tx);
        drop(extra);
    }
}

/// Seventeen interfaces attached at once, more than there are counter slots: every one is
/// attached and protected; the first fourteen have a series of their own, the others count
/// together in the unlisted slot (`interface=""` in `/metrics`), not with another interface's
/// counts. Before, the seventeenth could not be attached at all (the slot map was full) and
/// the reload failed.
#[test]
fn more_interfaces_at_once_than_counter_slots_are_all_attached_and_protected() {
    kernel_test!();
    let mut s = Scenario::new("rlmany").with_http(19479);
    let deny = "[lists]\ndeny = [\"198.19.66.0/24\"]\n";
    s.start(deny);
    let extras: Vec<VethPair> = (0..16)
        .map(|_| VethPair::new(&s.client, &s.server))
        .collect();
    let dir = s.daemon().config_dir().to_path_buf();
    let main = s.pair.b().name.clone();
    let mut all = vec![format!("\"{main}\"")];
    all.extend(extras.iter().map(|e| format!("\"{}\"", e.b().name)));
    let cfg = s.daemon_table(&dir).replace(
        &format!("interfaces = [\"{main}\"]"),
        &format!("interfaces = [{}]", all.join(", ")),
    ) + deny;
    s.daemon_mut().write_config(&cfg);
    let out = s.daemon().cli(&["reload"]);
    assert!(
        out.status.success(),
        "reload failed: {}\n{}",
        String::from_utf8_lossy(&out.stderr),
        s.daemon().logs()
    );
    let status = s.daemon().status();
    let slots: Vec<u32> = status.interfaces.iter().map(|i| i.slot).collect();
    assert_eq!(slots.len(), 17, "{status:?}");
    assert_eq!(slots.iter().filter(|&&s| s == 0).count(), 3, "{slots:?}");
    for e in &extras {
        let frame = Frame::new(e.a().mac, e.b().mac)
            .ipv4(Ipv4Addr::new(198, 19, 66, 1), e.b().ipv4)
            .udp(1, PORT)
            .build();
        let mut tx = ratelimit_tests::PacketSocket::new(&s.client, e.a().ifindex);
        tx.send_n(std::iter::repeat(&frame), 2, None);
    }
    let st = stats_when(s.daemon(), |st| verdict(st, "drop_deny") >= 32);
    assert_eq!(verdict(&st, "drop_deny"), 32, "every interface enforces");
    let listed = &st.interfaces;
    assert_eq!(
        listed.len(),
        14,
        "only interfaces with a slot of their own: {st:?}"
    );
    for i in listed.iter().filter(|i| i.iface != main) {
        assert_eq!(i.counters.verdict("drop_deny").packets, 2, "{i:?}");
    }
    // In /metrics: the three without a slot of their own in one series, and the sum over
    // the interfaces is every frame denied.
    let (code, text) = s.http_get("/metrics");
    assert_eq!(code, 200, "{text}");
    let deny = |labels: &[(&str, &str)]| {
        metric_sum(
            &text,
            "ratelimit_packets_total",
            &[&[("verdict", "drop_deny")], labels].concat(),
        )
    };
    assert_eq!(deny(&[("interface", "")]), 6.0, "{text}");
    assert_eq!(deny(&[]), 32.0, "{text}");
}
