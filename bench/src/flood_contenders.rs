//! The contenders on the receiving veth, each with the same policy (a per-source token bucket,
//! drop the excess: [`PER_SOURCE`] for the floods (F), (R), (M), [`BOTNET`] for (B)), and how
//! each one's own counters are read.

use std::{path::PathBuf, time::Duration};

use aya::programs::{Xdp, XdpMode, xdp::XdpLinkId};
use ratelimit_tests::{Daemon, NetNs, Scenario, scenario::rule_counter};

/// A policy every contender applies alike: a per-source token bucket of `rate` per second and
/// `burst`, with room for `state_max` sources (our `max_sources`, the nftables set `size`,
/// hashlimit's `htable-size` and `htable-max`); ours also refuses state to more than
/// `admission` new sources a second, when set (`tracking.new_sources_per_sec`, and its burst).
#[derive(Clone, Copy, Debug, serde::Serialize)]
pub struct Policy {
    pub rate: u64,
    pub burst: u64,
    pub state_max: u64,
    pub admission: Option<u64>,
}

/// (F), (R), (M): 1000 pps, burst 100 per source.
pub const PER_SOURCE: Policy = Policy {
    rate: 1000,
    burst: 100,
    state_max: 65_536,
    admission: Some(10_000),
};

/// (B): [`BOTNET_SOURCES`] real sources in turn, each allowed 1 pps, burst 1, and offered
/// several times that (a flood of a few Mpps over 100k sources); room for all of them. No admission budget for ours: every bot keeps sending from its own
/// address and earns its state, so a budget would only delay that.
pub const BOTNET: Policy = Policy {
    rate: 1,
    burst: 1,
    state_max: 262_144,
    admission: None,
};
pub const BOTNET_SOURCES: u64 = 100_000;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Contender {
    Ours,
    /// Ours with the packaged defaults: the same rule and nothing else (`[tracking]` as
    /// shipped: a store of 1,000,000 sources, the automatic admission budget).
    OursDefault,
    Nftables,
    Hashlimit,
    XdpDrop,
    /// Our parser, then XDP_DROP: what any filter that reads the headers pays at least.
    ParseDrop,
    NoFilter,
}

/// The reference programs a contender may attach.
pub struct RefProgs<'a> {
    pub drop: &'a mut Xdp,
    pub parse_drop: &'a mut Xdp,
}

impl RefProgs<'_> {
    fn of(&mut self, c: Contender) -> &mut Xdp {
        match c {
            Contender::ParseDrop => self.parse_drop,
            _ => self.drop,
        }
    }
}

impl Contender {
    pub fn name(self) -> &'static str {
        match self {
            Contender::Ours => "ours",
            Contender::OursDefault => "ours_default",
            Contender::Nftables => "nftables",
            Contender::Hashlimit => "hashlimit",
            Contender::XdpDrop => "xdp_drop",
            Contender::ParseDrop => "parse_drop",
            Contender::NoFilter => "no_filter",
        }
    }

    /// Whether the contender applies the rate-limit policy (so drop accuracy means something).
    pub fn limits(self) -> bool {
        matches!(
            self,
            Contender::Ours | Contender::OursDefault | Contender::Nftables | Contender::Hashlimit
        )
    }

    /// The tools it needs; `None` when all are present.
    pub fn missing_tool(self) -> Option<&'static str> {
        let need: &[&str] = match self {
            Contender::Nftables => &["nft"],
            Contender::Hashlimit => &["iptables-legacy", "ip6tables-legacy"],
            _ => &[],
        };
        need.iter().copied().find(|t| !tool_exists(t))
    }
}

pub fn tool_exists(tool: &str) -> bool {
    ["/usr/sbin", "/sbin", "/usr/bin", "/bin"]
        .iter()
        .any(|d| std::path::Path::new(d).join(tool).exists())
}

/// Our daemon's config for `p`; `tuned` false leaves `[tracking]` out: the store and the
/// admission budget as shipped, whatever `p` says of them.
pub fn ours_policy(p: &Policy, tuned: bool) -> String {
    let Policy {
        rate,
        burst,
        state_max,
        ..
    } = *p;
    let tracking = match p.admission {
        _ if !tuned => String::new(),
        Some(a) => format!(
            "[tracking]\nmax_sources = {state_max}\nnew_sources_per_sec = {a}\nnew_sources_burst = {a}\n"
        ),
        None => format!("[tracking]\nmax_sources = {state_max}\nnew_sources_per_sec = 0\n"),
    };
    format!(
        r#"
{tracking}
[[rule]]
name = "per-source"
key = "ip"
ipv4_prefix = 32
ipv6_prefix = 128
action = "throttle"
threshold = {{ count = {rate}, interval = "1s" }}
algorithm = "token_bucket"
burst = {burst}
exceed_action = "drop"
"#
    )
}

/// The nftables ruleset: netdev ingress on the receiving veth, one dynamic set per family.
pub fn nft_ruleset(dev: &str, p: &Policy) -> String {
    let Policy {
        rate,
        burst,
        state_max,
        ..
    } = *p;
    format!(
        r#"table netdev rlbench {{
    counter seen {{ }}
    counter dropped {{ }}
    set meter4 {{
        type ipv4_addr
        size {state_max}
        flags dynamic,timeout
        timeout 10s
    }}
    set meter6 {{
        type ipv6_addr
        size {state_max}
        flags dynamic,timeout
        timeout 10s
    }}
    chain ingress {{
        type filter hook ingress device "{dev}" priority 0; policy accept;
        counter name "seen"
        meta protocol ip update @meter4 {{ ip saddr limit rate over {rate}/second burst {burst} packets }} counter name "dropped" drop
        meta protocol ip6 update @meter6 {{ ip6 saddr limit rate over {rate}/second burst {burst} packets }} counter name "dropped" drop
    }}
}}
"#
    )
}

/// The iptables rules (both families, legacy backend, raw table): a counting rule, hashlimit,
/// and a counting rule for what got past it. (When its table is full, hashlimit drops a new
/// source's packet without counting it in its rule: the two counting rules see every drop.)
pub fn hashlimit_rules(dev: &str, v6: bool, p: &Policy) -> Vec<Vec<String>> {
    let Policy {
        rate,
        burst,
        state_max,
        ..
    } = *p;
    let name = if v6 { "rlbench6" } else { "rlbench4" };
    let count = format!("-t raw -A PREROUTING -i {dev}");
    let limit = format!(
        "-t raw -A PREROUTING -i {dev} -m hashlimit --hashlimit-above {rate}/sec --hashlimit-burst {burst} --hashlimit-mode srcip --hashlimit-name {name} --hashlimit-htable-size {state_max} --hashlimit-htable-max {state_max} --hashlimit-htable-expire 10000 -j DROP"
    );
    [count.clone(), limit, count]
        .iter()
        .map(|r| r.split(' ').map(str::to_string).collect())
        .collect()
}

/// A contender installed on the scenario's receiving end. The scenario's namespaces are
/// reused from contender to contender (deleting a namespace is slow work that the kernel does
/// in the background, and it would run during the next flood): `uninstall` removes each one.
pub struct Installed {
    pub contender: Contender,
    pub xdp_link: Option<XdpLinkId>,
    /// Ours: the daemon (dropping it stops it and detaches the program).
    pub daemon: Option<Daemon>,
}

/// Packets the contender itself counted: (seen, dropped). `seen` is `None` where the contender
/// has no counter for it.
#[derive(Clone, Copy, Debug, Default)]
pub struct Counters {
    pub seen: u64,
    pub dropped: u64,
}

fn exec_ok(ns: &NetNs, args: &[&str]) -> String {
    String::from_utf8_lossy(&ns.exec(args).stdout).into_owned()
}

/// Installs `c` on `sc`'s receiving end (the daemon is started here for ours; the scenario
/// must have been made `with_daemon_line("xdp_mode = \"native\"")`).
pub fn install(sc: &Scenario, c: Contender, p: &Policy, progs: &mut RefProgs) -> Installed {
    let dev = sc.pair.b().name.clone();
    let mut xdp_link = None;
    let mut daemon = None;
    match c {
        Contender::Ours | Contender::OursDefault => {
            let policy = ours_policy(p, c == Contender::Ours);
            let d = Daemon::start_in(&sc.server, |dir| {
                format!("{}{policy}", sc.daemon_table(dir))
            });
            let status = d.cli_json(&["status"]);
            let mode = status["interfaces"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|i| i["iface"] == dev.as_str())
                .and_then(|i| i["mode"].as_str())
                .unwrap_or("");
            assert_eq!(mode, "native", "ours must run in native XDP mode: {status}");
            daemon = Some(d);
        }
        Contender::Nftables => {
            let path = temp_file("nft", &nft_ruleset(&dev, p));
            exec_ok(&sc.server, &["nft", "-f", path.to_str().unwrap()]);
            let _ = std::fs::remove_file(&path);
        }
        Contender::Hashlimit => {
            for (tool, v6) in [("iptables-legacy", false), ("ip6tables-legacy", true)] {
                for rule in hashlimit_rules(&dev, v6, p) {
                    let mut args = vec![tool];
                    args.extend(rule.iter().map(String::as_str));
                    exec_ok(&sc.server, &args);
                }
            }
        }
        Contender::XdpDrop | Contender::ParseDrop => {
            let prog = progs.of(c);
            let id = sc
                .server
                .enter(|| prog.attach(&dev, XdpMode::Driver))
                .unwrap_or_else(|e| panic!("attaching {} to {dev}: {e:#}", c.name()));
            xdp_link = Some(id);
        }
        Contender::NoFilter => {}
    }
    Installed {
        contender: c,
        xdp_link,
        daemon,
    }
}

/// Removes the contender, leaving the receiving end bare.
pub fn uninstall(sc: &Scenario, inst: Installed, progs: &mut RefProgs) {
    if let Some(id) = inst.xdp_link {
        let _ = progs.of(inst.contender).detach(id);
    }
    drop(inst.daemon);
    match inst.contender {
        Contender::Nftables => {
            sc.server
                .try_exec(&["nft", "delete", "table", "netdev", "rlbench"]);
        }
        Contender::Hashlimit => {
            for tool in ["iptables-legacy", "ip6tables-legacy"] {
                sc.server.try_exec(&[tool, "-t", "raw", "-F", "PREROUTING"]);
            }
        }
        _ => {}
    }
}

fn temp_file(tag: &str, text: &str) -> PathBuf {
    let path = std::env::temp_dir().join(format!("rl-flood-{tag}-{}.conf", std::process::id()));
    std::fs::write(&path, text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    path
}

/// The veth's own counters (`ethtool -S` of the receiving end).
pub fn veth_stats(sc: &Scenario) -> std::collections::HashMap<String, u64> {
    sc.pair.b().ethtool_stats()
}

/// The contender's own counters.
pub fn counters(sc: &Scenario, inst: &Installed) -> Counters {
    match inst.contender {
        Contender::Ours | Contender::OursDefault => {
            let st = inst.daemon.as_ref().expect("ours runs a daemon").stats();
            Counters {
                seen: rule_counter(&st, "per-source", "matched"),
                dropped: rule_counter(&st, "per-source", "dropped"),
            }
        }
        Contender::Nftables => {
            let out = exec_ok(
                &sc.server,
                &[
                    "nft", "-j", "list", "counters", "table", "netdev", "rlbench",
                ],
            );
            let v: serde_json::Value = serde_json::from_str(&out)
                .unwrap_or_else(|e| panic!("nft -j list counters: {e}: {out}"));
            let get = |name: &str| {
                v["nftables"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .find(|o| o["counter"]["name"] == name)
                    .and_then(|o| o["counter"]["packets"].as_u64())
                    .unwrap_or_else(|| panic!("no nft counter {name} in {out}"))
            };
            Counters {
                seen: get("seen"),
                dropped: get("dropped"),
            }
        }
        Contender::Hashlimit => {
            let mut c = Counters::default();
            for tool in ["iptables-legacy", "ip6tables-legacy"] {
                let out = exec_ok(&sc.server, &[tool, "-t", "raw", "-nvx", "-L", "PREROUTING"]);
                // Header lines, then our three rules in order: count, hashlimit DROP, count.
                let rows: Vec<u64> = out
                    .lines()
                    .skip(2)
                    .filter_map(|l| l.split_whitespace().next()?.parse().ok())
                    .collect();
                assert!(rows.len() >= 3, "{tool} -L: {out}");
                c.seen += rows[0];
                c.dropped += rows[0] - rows[2].min(rows[0]);
            }
            c
        }
        Contender::XdpDrop | Contender::ParseDrop => {
            let s = veth_stats(sc);
            let drops = s.get("rx_queue_0_xdp_drops").copied().unwrap_or(0);
            Counters {
                seen: drops,
                dropped: drops,
            }
        }
        Contender::NoFilter => {
            let s = veth_stats(sc);
            Counters {
                seen: s.get("rx_queue_0_xdp_packets").copied().unwrap_or(0),
                dropped: 0,
            }
        }
    }
}

/// Makes the receiving end's NAPI a kernel thread (threaded NAPI) and pins it to `cpu`, so the
/// receiver runs on its own CPU while the generator has the other one. NAPI on a veth without
/// an XDP program needs GRO on (otherwise frames sent with XDP_TX from the peer are refused);
/// GRO is turned on for every contender alike. Returns the thread's pid.
pub fn receiver_thread(sc: &Scenario, cpu: usize) -> u32 {
    let dev = &sc.pair.b().name;
    sc.server.exec(&["ethtool", "-K", dev, "gro", "on"]);
    let path = format!("/sys/class/net/{dev}/threaded");
    sc.server.exec(&["sh", "-c", &format!("echo 1 > {path}")]);
    // The thread appears when NAPI is (re)enabled: look for it for a while.
    let prefix = napi_prefix(dev);
    for _ in 0..100 {
        if let Some(pid) = find_thread(&prefix) {
            pin_pid(pid, cpu);
            // Ahead of anything else that wants the CPU on this shared machine: real-time
            // (SCHED_FIFO), so no other thread (a host's memory-reclaim kernel thread, say) holds
            // the receiver off its 256-frame ring for longer than the ring lasts. The kernel's
            // real-time throttling still leaves the CPU 5% for everything else.
            let param = libc::sched_param { sched_priority: 50 };
            // SAFETY: sched_setscheduler and setpriority only read `param`.
            unsafe {
                if libc::sched_setscheduler(pid as i32, libc::SCHED_FIFO, &param) != 0 {
                    libc::setpriority(libc::PRIO_PROCESS, pid, -20);
                }
            }
            return pid;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("no NAPI thread {prefix}* for {dev}");
}

/// `napi/<dev>-<id>` as the kernel names the thread, cut to the 15 bytes of a task name.
fn napi_prefix(dev: &str) -> String {
    let full = format!("napi/{dev}-");
    full.chars().take(15).collect()
}

fn find_thread(prefix: &str) -> Option<u32> {
    let mut found = Vec::new();
    for e in std::fs::read_dir("/proc").ok()?.flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        if std::fs::read_to_string(e.path().join("comm"))
            .is_ok_and(|comm| comm.trim_end().starts_with(prefix))
        {
            found.push(pid);
        }
    }
    // The newest if NAPI was re-created (an XDP attach can do that).
    found.into_iter().max()
}

fn pin_pid(pid: u32, cpu: usize) {
    // SAFETY: cpu_set_t is plain data; sched_setaffinity only reads it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        if libc::sched_setaffinity(pid as i32, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            panic!(
                "pinning NAPI thread {pid} to CPU {cpu}: {}",
                std::io::Error::last_os_error()
            );
        }
    }
}

/// The receiving side's CPU while the receiver thread runs: (user+system ticks of the NAPI
/// thread).
pub fn thread_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = stat.rsplit_once(')')?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    // Fields after the comm: state is 0, utime is 11, stime is 12.
    Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
}

/// Ours only: frames of `clients` that the limiter itself dropped, from its per-client
/// counters (`ratelimit top --by packets`: the legitimate clients are the heaviest tracked
/// sources after the aggregate overflow state, random sources having one frame each). `None`
/// if a client is missing from the list.
pub fn ours_dropped_of(inst: &Installed, clients: &[std::net::IpAddr]) -> Option<u64> {
    let d = inst.daemon.as_ref()?;
    let n = (clients.len() * 2 + 16).to_string();
    let top = d.cli_json(&["top", "-n", &n, "--by", "packets"]);
    let mut rows = Vec::new();
    collect_clients(&top, &mut rows);
    let mut dropped = 0;
    for c in clients {
        let (single, exact) = (
            c.to_string(),
            format!("{c}/{}", if c.is_ipv4() { 32 } else { 128 }),
        );
        let row = rows
            .iter()
            .find(|r| r["client"] == single.as_str() || r["client"] == exact.as_str())?;
        dropped += row["drops"].as_u64()?;
    }
    Some(dropped)
}

fn collect_clients<'a>(v: &'a serde_json::Value, out: &mut Vec<&'a serde_json::Value>) {
    match v {
        serde_json::Value::Array(a) => {
            for x in a {
                if x.get("client").is_some() && x.get("drops").is_some() {
                    out.push(x);
                } else {
                    collect_clients(x, out);
                }
            }
        }
        serde_json::Value::Object(o) => o.values().for_each(|x| collect_clients(x, out)),
        _ => {}
    }
}
