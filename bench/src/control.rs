//! Control plane and daemon (issue 5, parts 5 and 6), measured with the real daemon and CLI in
//! a lab scenario (namespaces, veth, `ratelimit run`):
//!
//! * 100k bans applied end to end: `ratelimit ban add --file` against a running daemon, timed
//!   as the CLI process's wall clock, then read back (`status`, `bans --json`).
//! * `top` over 1M tracked sources: the daemon's pinned per-client map filled with 1M entries
//!   (see [`tracked_entry`]), then `ratelimit top -n 10` and `top -n 10 --json` timed and their
//!   answer checked (the entry given the most packets comes first).
//! * The daemon's RSS (VmRSS / VmHWM): idle with an empty map, after `top` over 1M, after the
//!   bans.
//! * A reload with 1k overrides under traffic with no misjudged packet (`control_reload.rs`).
//! * `status` under load: its latency over the control socket while 1M sources are tracked,
//!   new ones keep arriving, `/metrics` is fetched every 100 ms and 1k idle HTTP connections
//!   are open (the load of the kernel test `e2e_control_latency`, from the lab's
//!   `control_load`).
//!
//! `--quick`: 10k bans, 100k tracked sources, 100 overrides, `status` over 100k; correctness is asserted (the part
//! panics on a wrong answer), times are printed but not held against the targets. In the full
//! run a wrong answer is reported (and its target marked not met) rather than aborting the
//! suite.

#[path = "control_reload.rs"]
mod reload;

use std::{
    net::Ipv4Addr,
    path::Path,
    process::{Command, Output, Stdio},
    sync::mpsc,
    time::{Duration, Instant},
};

use ratelimit_common::{
    addr::IpKey,
    maps::{ClientKey, ClientState, KEY_IP},
};
use ratelimit_tests::{
    Daemon,
    control_load::{self, Load},
    scenario::Scenario,
};
use serde_json::json;

use crate::part::{Ctx, Section, TargetRow};

/// First address of the tracked set: entry `i` is `11.0.0.0 + i`.
const TRACKED_BASE: u32 = 0x0b00_0000;
/// The entry given the most packets: `top` must list it first.
const HOT: u32 = 4_242;
const HOT_PACKETS: u64 = 1_000_000;

/// Entry `i` of the tracked set `top` is measured over: a distinct IPv4 source per `i`
/// (11.0.0.0 + i, as the rule's /32 key), rule 0, and some packets, bytes and drops so `top`
/// has something to rank; entry [`HOT`] has the most packets ([`HOT_PACKETS`]).
/// (The one place that knows the key and value layouts.)
fn tracked_entry(i: u32) -> (ClientKey, ClientState) {
    let key = ClientKey {
        rule: 0,
        kind: KEY_IP,
        prefix_len: 128,
        addr: IpKey::from_v4((TRACKED_BASE + i).to_be_bytes()).addr,
        ..ClientKey::default()
    };
    // 1..=1000 packets, spread over the set; the hot entry far above every other.
    let packets = if i == HOT {
        HOT_PACKETS
    } else {
        1 + u64::from(i.wrapping_mul(2_654_435_761) % 1000)
    };
    let state = ClientState {
        packets,
        bytes: packets * 60,
        drops: packets / 10,
        ..Default::default()
    };
    (key, state)
}

/// The label `top` gives the hot entry.
fn hot_label() -> String {
    format!("{}/32", Ipv4Addr::from(TRACKED_BASE + HOT))
}

/// Sizes of one run.
struct Sizes {
    bans: u32,
    tracked: u32,
    overrides: u32,
    reloads: u32,
    traffic: Duration,
}

pub fn run(ctx: &Ctx) -> Option<Section> {
    let z = if ctx.quick {
        Sizes {
            bans: 10_000,
            tracked: 100_000,
            overrides: 100,
            reloads: 3,
            traffic: Duration::from_secs(5),
        }
    } else {
        Sizes {
            bans: 100_000,
            tracked: 1_000_000,
            overrides: 1_000,
            reloads: 10,
            traffic: Duration::from_secs(12),
        }
    };
    let t0 = Instant::now();
    let mut problems: Vec<String> = Vec::new();
    let cp = bans_top_memory(&z, &mut problems);
    println!(
        "  control: bans, top and memory in {:.1}s",
        t0.elapsed().as_secs_f64()
    );
    let t1 = Instant::now();
    let rl = reload::run(z.overrides, z.reloads, z.traffic, &mut problems);
    println!(
        "  control: reload under traffic in {:.1}s",
        t1.elapsed().as_secs_f64()
    );
    let t2 = Instant::now();
    let load = status_under_load(if ctx.quick { Load::QUICK } else { Load::FULL });
    println!(
        "  control: status under load in {:.1}s:\n    {}",
        t2.elapsed().as_secs_f64(),
        load.summary().replace('\n', "\n    ")
    );
    if ctx.quick {
        assert!(
            problems.is_empty(),
            "control plane: wrong answers:\n  {}",
            problems.join("\n  ")
        );
    } else {
        for p in &problems {
            println!("  control: WRONG: {p}");
        }
    }
    Some(section(ctx, &cp, &rl, &load, &problems))
}

/// The HTTP port of the `status` under load daemon, inside its namespace.
const LOAD_HTTP_PORT: u16 = 9478;

/// `status` latency under the load of [`control_load`], on a daemon of its own.
fn status_under_load(load: Load) -> control_load::Figures {
    let mut s = Scenario::new("rlbl").with_http(LOAD_HTTP_PORT);
    s.start(&load.config());
    control_load::measure(&s, LOAD_HTTP_PORT, load)
}

/// What the bans / `top` / memory daemon measured.
struct ControlPlane {
    bans: u32,
    ban_add_secs: f64,
    bans_json_secs: f64,
    bans_listed: u64,
    tracked: u32,
    max_sources: u32,
    populate_secs: f64,
    tracked_reported: u64,
    walk_secs: f64,
    top_secs: f64,
    top_json_secs: f64,
    top_first: String,
    top_first_packets: u64,
    rss_idle: Mem,
    rss_after_top: Mem,
    rss_after_bans: Mem,
    /// No wrong answer from `top` / from the bans.
    top_ok: bool,
    bans_ok: bool,
}

/// VmRSS and VmHWM of a process, KiB.
#[derive(Clone, Copy, Default, serde::Serialize)]
struct Mem {
    rss_kib: u64,
    hwm_kib: u64,
}

fn mem_of(pid: Option<u32>) -> Mem {
    let Some(pid) = pid else {
        return Mem::default();
    };
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap_or(0)
    };
    Mem {
        rss_kib: field("VmRSS:"),
        hwm_kib: field("VmHWM:"),
    }
}

fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

/// A CLI call and the wall clock of its process.
struct Timed {
    secs: f64,
    out: Output,
}

impl Timed {
    fn stdout(&self) -> String {
        String::from_utf8_lossy(&self.out.stdout).into_owned()
    }

    fn ok(&self) -> bool {
        self.out.status.success()
    }

    fn describe(&self) -> String {
        format!(
            "{}: {}",
            self.out.status,
            String::from_utf8_lossy(&self.out.stderr).trim()
        )
    }
}

/// Runs `ratelimit ARGS --socket S` and times the process from spawn to exit (no polling
/// granularity). A watchdog kills it after `timeout`.
fn timed_cli(socket: &Path, args: &[&str], timeout: Duration) -> Timed {
    let mut cmd = Command::new(ratelimit_tests::ratelimit_bin());
    cmd.args(args)
        .arg("--socket")
        .arg(socket)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let t = Instant::now();
    let child = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("starting `ratelimit {}`: {e}", args.join(" ")));
    let pid = child.id() as libc::pid_t;
    let (done, wait) = mpsc::channel::<()>();
    let dog = std::thread::spawn(move || {
        if let Err(mpsc::RecvTimeoutError::Timeout) = wait.recv_timeout(timeout) {
            // SAFETY: kill(2) on our child, which is not reaped until wait_with_output returns.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    });
    let out = child
        .wait_with_output()
        .unwrap_or_else(|e| panic!("waiting for `ratelimit {}`: {e}", args.join(" ")));
    let secs = t.elapsed().as_secs_f64();
    let _ = done.send(());
    let _ = dog.join();
    Timed { secs, out }
}

fn bans_top_memory(z: &Sizes, problems: &mut Vec<String>) -> ControlPlane {
    // Headroom over the set: the store's sets of 8 with two choices hold two thirds of their
    // slots with no source finding both its sets full.
    let problems_at_start = problems.len();
    let max_sources = z.tracked + z.tracked / 2;
    let mut s = Scenario::new("rlcp");
    s.start(&format!(
        r#"
[tracking]
max_sources = {max_sources}

[[rule]]
name = "udp"
match = {{ protocol = "udp", dst_ports = ["9000"] }}
threshold = {{ count = 1000, interval = "1s" }}
"#
    ));
    let d: &Daemon = s.daemon();
    let sock = d.socket_path().to_path_buf();
    // Let the daemon settle (its first ban save, the allocator's first growth) before reading.
    std::thread::sleep(Duration::from_millis(1200));
    let rss_idle = mem_of(d.pid());
    println!(
        "  control: daemon idle, empty map of {max_sources}: RSS {:.1} MiB (peak {:.1} MiB)",
        mib(rss_idle.rss_kib),
        mib(rss_idle.hwm_kib)
    );

    // `top` over the tracked set, filled in through the daemon's pinned map.
    let clients = ratelimit_user::kernel::clients::ClientStore::open(s.bpffs())
        .expect("open the daemon's pinned per-client maps");
    let populate_secs = {
        let t = Instant::now();
        for i in 0..z.tracked {
            let (k, v) = tracked_entry(i);
            clients.put(&k, &v).expect("populate RL_CLIENTS");
        }
        t.elapsed().as_secs_f64()
    };
    // The syscall part of `top`: one walk of keys and values from this process.
    let walk_secs = {
        let t = Instant::now();
        let mut n = 0usize;
        clients.walk(&mut |_, _| n += 1).expect("walk RL_CLIENTS");
        let secs = t.elapsed().as_secs_f64();
        if n != z.tracked as usize {
            problems.push(format!(
                "the pinned map holds {n} entries after {} inserts",
                z.tracked
            ));
        }
        secs
    };
    // Written from this process, not by the program: the daemon's census sees them once its
    // last one is older than `CENSUS_MAX_AGE`.
    let give_up = Instant::now() + ratelimit_user::serve::reader::CENSUS_MAX_AGE * 2;
    let tracked_reported = loop {
        let n = d.cli_json(&["status"])["tracked_clients"]
            .as_u64()
            .unwrap_or(0);
        if n == u64::from(z.tracked) || Instant::now() > give_up {
            break n;
        }
        std::thread::sleep(Duration::from_millis(250));
    };
    if tracked_reported != u64::from(z.tracked) {
        problems.push(format!(
            "status reports {tracked_reported} tracked clients, {} were inserted",
            z.tracked
        ));
    }
    let top = timed_cli(&sock, &["top", "-n", "10"], Duration::from_secs(60));
    let top_json = timed_cli(
        &sock,
        &["top", "-n", "10", "--json"],
        Duration::from_secs(60),
    );
    let rss_after_top = mem_of(d.pid());
    let want = hot_label();
    let (mut top_first, mut top_first_packets) = (String::new(), 0);
    if !top.ok() {
        problems.push(format!("`top -n 10` failed ({})", top.describe()));
    } else {
        let text = top.stdout();
        let first = text.lines().nth(1).unwrap_or("");
        if !first.split_whitespace().any(|w| w == want) || text.lines().count() != 11 {
            problems.push(format!(
                "`top -n 10` should list {want} first, in 10 rows:\n{text}"
            ));
        }
    }
    if !top_json.ok() {
        problems.push(format!(
            "`top -n 10 --json` failed ({})",
            top_json.describe()
        ));
    } else {
        match serde_json::from_str::<serde_json::Value>(&top_json.stdout()) {
            Ok(v) => {
                let rows = v.as_array().cloned().unwrap_or_default();
                top_first = rows
                    .first()
                    .and_then(|r| r["client"].as_str())
                    .unwrap_or("")
                    .to_string();
                top_first_packets = rows
                    .first()
                    .and_then(|r| r["packets"].as_u64())
                    .unwrap_or(0);
                let packets: Vec<u64> = rows.iter().filter_map(|r| r["packets"].as_u64()).collect();
                let sorted = packets.windows(2).all(|w| w[0] >= w[1]);
                // After the hot entry, the heaviest others carry 1000 packets (the spread's top).
                if rows.len() != 10
                    || top_first != want
                    || top_first_packets != HOT_PACKETS
                    || !sorted
                    || packets.get(1) != Some(&1000)
                {
                    problems.push(format!(
                        "`top -n 10 --json` should list {want} ({HOT_PACKETS} packets) first, then 1000-packet entries, 10 rows sorted: {v}"
                    ));
                }
            }
            Err(e) => problems.push(format!("`top -n 10 --json` printed no JSON: {e}")),
        }
    }
    println!(
        "  control: {} tracked sources (populated in {populate_secs:.2}s, walked in {walk_secs:.2}s): `top -n 10` {:.3}s, `top -n 10 --json` {:.3}s; daemon RSS {:.1} MiB, peak {:.1} MiB",
        z.tracked,
        top.secs,
        top_json.secs,
        mib(rss_after_top.rss_kib),
        mib(rss_after_top.hwm_kib)
    );

    let top_ok = problems.len() == problems_at_start;
    let problems_at_bans = problems.len();

    // Bans, end to end from a file.
    let file = d.config_dir().join("bans.txt");
    let mut text = String::with_capacity(z.bans as usize * 16);
    for i in 0..z.bans {
        // 100.64.0.0/10: 4M addresses, none of them a lab client.
        text.push_str(&format!("{}\n", Ipv4Addr::from(0x6440_0000 + i)));
    }
    std::fs::write(&file, text).expect("writing the ban file");
    let add = timed_cli(
        &sock,
        &[
            "ban",
            "add",
            "--file",
            file.to_str().unwrap(),
            "--for",
            "1h",
            "--json",
        ],
        Duration::from_secs(60),
    );
    if !add.ok() {
        problems.push(format!("`ban add --file` failed ({})", add.describe()));
    } else {
        let added = serde_json::from_str::<serde_json::Value>(&add.stdout())
            .ok()
            .and_then(|v| v["added"].as_u64());
        if added != Some(u64::from(z.bans)) {
            problems.push(format!(
                "`ban add --file` of {} said {}",
                z.bans,
                add.stdout().trim()
            ));
        }
    }
    let active = d.status().active_bans;
    let listed = timed_cli(&sock, &["bans", "--json"], Duration::from_secs(60));
    let bans_listed = serde_json::from_str::<serde_json::Value>(&listed.stdout())
        .ok()
        .and_then(|v| v.as_array().map(|a| a.len() as u64))
        .unwrap_or(0);
    if active != u64::from(z.bans) || bans_listed != u64::from(z.bans) {
        problems.push(format!(
            "after {} bans: status says {active} active, `bans --json` lists {bans_listed}",
            z.bans
        ));
    }
    let rss_after_bans = mem_of(d.pid());
    println!(
        "  control: {} bans applied with `ban add --file` in {:.3}s; `bans --json` listed {bans_listed} in {:.3}s; daemon RSS {:.1} MiB, peak {:.1} MiB",
        z.bans,
        add.secs,
        listed.secs,
        mib(rss_after_bans.rss_kib),
        mib(rss_after_bans.hwm_kib)
    );
    let bans_ok = problems.len() == problems_at_bans;
    drop(s);
    ControlPlane {
        top_ok,
        bans_ok,
        bans: z.bans,
        ban_add_secs: add.secs,
        bans_json_secs: listed.secs,
        bans_listed,
        tracked: z.tracked,
        max_sources,
        populate_secs,
        tracked_reported,
        walk_secs,
        top_secs: top.secs,
        top_json_secs: top_json.secs,
        top_first,
        top_first_packets,
        rss_idle,
        rss_after_top,
        rss_after_bans,
    }
}

fn section(
    ctx: &Ctx,
    cp: &ControlPlane,
    rl: &reload::Outcome,
    load: &control_load::Figures,
    problems: &[String],
) -> Section {
    let json = json!({
        "quick": ctx.quick,
        "bans": {
            "count": cp.bans,
            "ban_add_file_secs": cp.ban_add_secs,
            "bans_json_secs": cp.bans_json_secs,
            "bans_listed": cp.bans_listed,
        },
        "top": {
            "tracked_sources": cp.tracked,
            "max_sources": cp.max_sources,
            "populate_secs": cp.populate_secs,
            "tracked_reported": cp.tracked_reported,
            "walk_secs": cp.walk_secs,
            "top_secs": cp.top_secs,
            "top_json_secs": cp.top_json_secs,
            "first": cp.top_first,
            "first_packets": cp.top_first_packets,
        },
        "daemon_memory_kib": {
            "idle": cp.rss_idle,
            "after_top": cp.rss_after_top,
            "after_bans": cp.rss_after_bans,
        },
        "reload": rl.json(),
        "status_under_load": load,
        "problems": problems,
    });
    let tracked = human(u64::from(cp.tracked));
    let bans = human(u64::from(cp.bans));
    let mut md = String::from("## Control plane (the real daemon and CLI)\n\n");
    md.push_str(&format!(
        "Wall clock of the `ratelimit` CLI process against a running daemon (the dev build, whose profile compiles `ratelimit-user` and its dependencies at opt-level 2), {}.\n\n",
        if ctx.quick { "quick sizes" } else { "full sizes" }
    ));
    md.push_str("| operation | size | time |\n|---|---:|---:|\n");
    md.push_str(&format!(
        "| `ratelimit ban add --file` (parse, send, insert, reply) | {bans} bans | {:.3} s |\n",
        cp.ban_add_secs
    ));
    md.push_str(&format!(
        "| `ratelimit bans --json` | {bans} bans | {:.3} s |\n",
        cp.bans_json_secs
    ));
    md.push_str(&format!(
        "| `ratelimit top -n 10` | {tracked} tracked sources | {:.3} s |\n",
        cp.top_secs
    ));
    md.push_str(&format!(
        "| `ratelimit top -n 10 --json` | {tracked} tracked sources | {:.3} s |\n",
        cp.top_json_secs
    ));
    md.push_str(&format!(
        "| for comparison: one walk of the map's keys and values from another process | {tracked} tracked sources | {:.3} s |\n",
        cp.walk_secs
    ));
    md.push_str(&format!(
        "| `ratelimit reload`, {} overrides, under traffic | {} reloads | median {:.1} ms (min {:.1}, max {:.1}) |\n",
        rl.overrides,
        rl.reload_ms.len(),
        rl.median_ms(),
        rl.min_ms(),
        rl.max_ms()
    ));
    md.push_str(&format!(
        "\n`top` answered {} ({} packets) first, the entry given the most packets; the daemon reported {} tracked clients.\n",
        cp.top_first, cp.top_first_packets, cp.tracked_reported
    ));
    md.push_str(&format!(
        "\nDaemon memory (from /proc/PID/status): idle with an empty per-client map of {} entries, RSS {:.1} MiB; after `top` over {tracked} sources, RSS {:.1} MiB, peak (VmHWM) {:.1} MiB; after {bans} bans and `bans --json`, RSS {:.1} MiB, peak {:.1} MiB. (The maps themselves are kernel memory, not the daemon's RSS.)\n",
        human(u64::from(cp.max_sources)),
        mib(cp.rss_idle.rss_kib),
        mib(cp.rss_after_top.rss_kib),
        mib(cp.rss_after_top.hwm_kib),
        mib(cp.rss_after_bans.rss_kib),
        mib(cp.rss_after_bans.hwm_kib),
    ));
    md.push('\n');
    md.push_str(&rl.markdown());
    md.push_str(&format!(
        "\n### `status` under load\n\n{} sources tracked (one real packet each through the veth pair, filled in {:.1} s), 200 new sources a second arriving throughout, `/metrics` fetched every 100 ms, {} idle HTTP connections open; then {} `status` requests over the control socket, 20 ms apart, each timed from connect to the answer.\n\n| request | answered | p50 | p99 | max |\n|---|---:|---:|---:|---:|\n| `status` | {} | {:.2} ms | {:.2} ms | {:.2} ms |\n| `/metrics` | {} ({} turned away while the idle connections held the listener's slots) | {:.2} ms | {:.2} ms | - |\n",
        human(load.tracked),
        load.fill_secs,
        load.idle_connections,
        load.status_us.len(),
        load.status_us.len(),
        load.status_p50_ms,
        load.status_p99_ms,
        load.status_max_ms,
        load.metrics_us.len(),
        load.metrics_failed,
        load.metrics_p50_ms,
        load.metrics_p99_ms,
    ));
    if !problems.is_empty() {
        md.push_str("\n**Wrong answers in this run:**\n\n");
        for p in problems {
            md.push_str(&format!("- {}\n", p.replace('\n', " ")));
        }
    }
    let met = |ok: bool| if ctx.quick { None } else { Some(ok) };
    let (bans_ok, top_ok) = (cp.bans_ok, cp.top_ok);
    let top_secs = cp.top_secs.max(cp.top_json_secs);
    let targets = vec![
        TargetRow::new(
            "100k bans applied in < 1 s (`ban add --file`, end to end)",
            format!(
                "{bans} bans in {:.3} s{}",
                cp.ban_add_secs,
                if bans_ok { "" } else { " (wrong answer)" }
            ),
            met(bans_ok && cp.bans >= 100_000 && cp.ban_add_secs < 1.0),
        ),
        TargetRow::new(
            "`top` over 1M sources in < 3 s",
            format!(
                "{:.3} s over {tracked} (`top -n 10` {:.3} s, `--json` {:.3} s){}",
                top_secs,
                cp.top_secs,
                cp.top_json_secs,
                if top_ok { "" } else { " (wrong answer)" }
            ),
            met(top_ok && cp.tracked >= 1_000_000 && top_secs < 3.0),
        ),
        TargetRow::new(
            "reload with 1k overrides under traffic, no misjudged packet",
            format!(
                "{} reloads with {} overrides, median {:.1} ms; {} misjudged packets",
                rl.reload_ms.len(),
                rl.overrides,
                rl.median_ms(),
                rl.misjudged
            ),
            met(rl.ok && rl.overrides >= 1_000),
        ),
        TargetRow::new(
            "`status` p99 < 100 ms over 1M tracked clients, `/metrics` every 100 ms, 1k idle HTTP connections",
            format!(
                "p99 {:.2} ms (p50 {:.2}, max {:.2}) over {} tracked, {} idle connections",
                load.status_p99_ms,
                load.status_p50_ms,
                load.status_max_ms,
                human(load.tracked),
                load.idle_connections
            ),
            met(load.tracked >= 1_000_000
                && load.idle_connections >= 1_000
                && load.status_p99_ms < 100.0),
        ),
    ];
    Section {
        key: "control",
        json,
        markdown: md,
        targets,
    }
}

/// 1000 → "1k", 1000000 → "1M".
fn human(n: u64) -> String {
    if n >= 1_000_000 && n.is_multiple_of(1_000_000) {
        format!("{}M", n / 1_000_000)
    } else if n >= 1_000_000 && n.is_multiple_of(10_000) {
        format!("{}M", n as f64 / 1e6)
    } else if n >= 1_000 && n.is_multiple_of(1_000) {
        format!("{}k", n / 1_000)
    } else {
        n.to_string()
    }
}
