//! The first slice through the whole path: the real daemon attaches to a veth from its
//! config, a deny CIDR drops one client's packets while another client passes, non-IP frames
//! pass, and `ratelimit stats --json` agrees exactly with independent receivers.

use std::{
    net::{IpAddr, Ipv4Addr},
    time::Duration,
};

use ratelimit_tests::{
    kernel_test,
    scenario::{Scenario, passed, verdict},
};

const PORT: u16 = 7000;

#[test]
fn deny_list_drops_one_client_and_stats_agree_with_receivers() {
    kernel_test!();
    let mut s = Scenario::new("rlf");
    // Exact agreement needs a quiet link: no IPv6 neighbour discovery, MLD or router
    // solicitations from the client's own kernel (this test's frames are IPv4 and non-IP).
    let iface = s.pair.a().name.clone();
    s.client
        .sysctl(&format!("net.ipv6.conf.{iface}.disable_ipv6"), "1");
    s.start("[lists]\ndeny = [\"198.19.1.0/24\"]\n");
    let denied = IpAddr::V4(Ipv4Addr::new(198, 19, 1, 5));
    let allowed = IpAddr::V4(Ipv4Addr::new(198, 19, 2, 5));

    let sink = s.sink(PORT);
    let tap = s.tap();
    tap.wait_quiet(Duration::from_millis(500));
    let s0 = s.stats();
    let t0 = tap.snapshot();

    let mut tx = s.sender();
    let non_ip = s.builder().ethertype_raw(0x88b5).payload(&[7; 46]).build();
    for i in 0..300u32 {
        if i < 200 {
            tx.send(&s.udp(denied, PORT)).unwrap();
        }
        tx.send(&s.udp(allowed, PORT)).unwrap();
        if i < 50 {
            tx.send(&non_ip).unwrap();
        }
    }
    sink.wait_quiet(Duration::from_millis(300));
    tap.wait_quiet(Duration::from_millis(500));
    let s1 = s.stats();
    let (sunk, tapped) = (sink.stop(), tap.stop());
    let background = tapped.total - t0.total - 300 - tapped.non_ip + t0.non_ip;
    assert_eq!(background, 0, "unexpected frames on the link: {tapped:?}");

    // Independent receivers: nothing from the denied client, everything from the other.
    assert_eq!(sunk.from(denied), 0, "{sunk:?}");
    assert_eq!(sunk.from(allowed), 300, "{sunk:?}");
    assert_eq!(tapped.from(denied), 0);
    assert_eq!(tapped.from(allowed), 300);
    assert_eq!(tapped.socket_drops, 0);

    // The daemon's counters agree exactly.
    let d = |name: &str| verdict(&s1, name) - verdict(&s0, name);
    assert_eq!(d("drop_deny"), 200);
    assert_eq!(d("pass_non_ip"), tapped.non_ip - t0.non_ip, "non-IP frames");
    assert!(d("pass_non_ip") >= 50);
    assert_eq!(
        passed(&s1) - passed(&s0),
        tapped.total - t0.total,
        "every frame the tap saw passed XDP, and only those"
    );
    let iface = &s1.interfaces[0];
    assert_eq!(iface.iface, s.pair.b().name);
    assert_eq!(
        iface.counters.verdict("drop_deny").packets,
        verdict(&s1, "drop_deny"),
        "per-interface counters"
    );
    assert_eq!(
        d("drop_deny") * 60,
        verdict(&s1, "drop_deny") * 60 - verdict(&s0, "drop_deny") * 60
    );
    assert_eq!(
        s1.all.verdict("drop_deny").bytes - s0.all.verdict("drop_deny").bytes,
        200 * 60,
        "bytes are frame lengths"
    );

    let status = s.daemon().status();
    assert_eq!(status.interfaces[0].iface, s.pair.b().name);
    assert!(status.program.expect("loaded").verified_insns > 0);
}

#[test]
fn detach_removes_program_and_pins() {
    kernel_test!();
    let mut s = Scenario::new("rld");
    s.start("");
    let out = s
        .server
        .exec(&["ip", "-j", "link", "show", &s.pair.b().name]);
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("\"xdp\""),
        "program attached"
    );
    s.daemon_mut().stop();
    // Still attached after the daemon exits: enforcement does not depend on it.
    let out = s
        .server
        .exec(&["ip", "-j", "link", "show", &s.pair.b().name]);
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("\"xdp\""),
        "still attached after stop"
    );
    let out = s.daemon().detach();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = s
        .server
        .exec(&["ip", "-j", "link", "show", &s.pair.b().name]);
    assert!(
        !String::from_utf8_lossy(&out.stdout).contains("\"xdp\""),
        "detached"
    );
    assert!(!s.bpffs().exists(), "pins removed");
}

#[test]
fn generic_mode_and_cli_interface_override() {
    kernel_test!();
    let mut s = Scenario::new("rlg").with_daemon_line("xdp_mode = \"generic\"");
    s.start("[lists]\ndeny = [\"198.19.3.0/24\"]\n");
    let status = s.daemon().cli_json(&["status"]);
    assert_eq!(status["interfaces"][0]["mode"], "generic");
    let sink = s.sink(PORT);
    let mut tx = s.sender();
    tx.send_n(
        std::iter::repeat(s.udp(IpAddr::V4(Ipv4Addr::new(198, 19, 3, 1)), PORT)),
        25,
        None,
    );
    tx.send_n(
        std::iter::repeat(s.udp(IpAddr::V4(Ipv4Addr::new(198, 19, 4, 1)), PORT)),
        25,
        None,
    );
    sink.wait_quiet(Duration::from_millis(300));
    let got = sink.stop();
    assert_eq!(got.total, 25);
    assert_eq!(verdict(&s.stats(), "drop_deny"), 25);
}

#[test]
fn startup_errors_are_clear() {
    kernel_test!();
    let s = Scenario::new("rly");
    // No such interface: the daemon refuses to start and says what to do.
    let mut d = ratelimit_tests::Daemon::spawn_in(&s.server, |dir| {
        format!(
            "[daemon]\ninterfaces = [\"nosuch0\"]\ncontrol_socket = \"ctl.sock\"\nstate_dir = \"{}/state\"\nbpffs_dir = \"{}\"\nhttp_listen = \"off\"\n",
            dir.display(),
            s.bpffs().display()
        )
    });
    let status = d
        .wait_exit(Duration::from_secs(10))
        .expect("daemon must exit");
    assert!(!status.success());
    assert!(
        d.logs().contains("no such interface: nosuch0"),
        "{}",
        d.logs()
    );
}
