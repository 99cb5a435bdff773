//! The kernel fixture harness: the real XDP object loaded against a bpffs directory of its
//! own, a config applied to its maps as the daemon applies it, and the operations fixture tests
//! share (run a frame through BPF_PROG_TEST_RUN, read the counters and their deltas, ban a
//! CIDR, apply another config), so that a test says only what it sends and what it expects.
//!
//! ```ignore
//! let mut fx = Fixture::load(CONFIG);
//! fx.ban("198.18.60.0/24");
//! fx.expect(&v4([198, 18, 60, 1]).udp(1, 53).build(), 1, XDP_DROP, "drop_ban=1 pass=0");
//! ```
//!
//! [`Fixture::builder`] loads it otherwise (the store's size, the pins' name);
//! [`Fixture::run_table`] runs a table of [`case`]s through the program or another entry point
//! of the object (`ratelimit_l3`). A fixture owns its pins: dropping it detaches the program
//! and removes the directory, also when a test panics. [`frames`] builds the frames the
//! fixtures send.

pub mod frames;

use std::collections::BTreeMap;

use ratelimit_common::{
    addr::IpKey,
    maps::{BanEntry, ClientKey, KEY_IP, RuleConfig},
};
use ratelimit_user::{
    config::{self, Config},
    kernel::datapath::{Datapath, Maps},
    policy::apply::{self, Plan},
    policy::report,
};

use crate::pins::Pins;

/// XDP actions, as BPF_PROG_TEST_RUN returns them.
pub const XDP_DROP: u32 = 1;
pub const XDP_PASS: u32 = 2;
pub const XDP_TX: u32 = 3;

/// One hour in nanoseconds: how long [`Fixture::ban`] bans.
pub const HOUR_NS: u64 = 3_600_000_000_000;

/// How a [`Fixture`] is loaded: the store's size and its pins' name. [`Fixture::load`] takes
/// the defaults.
#[derive(Clone, Debug)]
pub struct Builder {
    what: &'static str,
    max_sources: u32,
}

impl Default for Builder {
    fn default() -> Self {
        Self {
            what: "fixtures",
            max_sources: 4096,
        }
    }
}

impl Builder {
    /// The per-source store sized for `n` sources (`max_sources`; 4096 unless set).
    pub fn max_sources(mut self, n: u32) -> Self {
        self.max_sources = n;
        self
    }

    /// The pins' directory named after `what` (`/sys/fs/bpf/rl-<what>-...`; "fixtures" unless
    /// set).
    pub fn pins(mut self, what: &'static str) -> Self {
        self.what = what;
        self
    }

    /// Loads the program against fresh pins and applies `config` (TOML, as the daemon reads
    /// it; "" is the empty config).
    ///
    /// # Panics
    ///
    /// If the program does not load (not root, no bpffs) or the config does not parse or apply.
    pub fn load(self, config: &str) -> Fixture {
        let pins = Pins::new(self.what);
        self.load_at(pins, &parse(config))
    }

    fn load_at(self, pins: Pins, cfg: &Config) -> Fixture {
        let mut dp = Datapath::load(&pins.0, self.max_sources)
            .expect("load the program (are you root, with bpffs at /sys/fs/bpf?)");
        let maps = dp.take_maps().expect("maps");
        let mut fx = Fixture {
            maps,
            dp,
            plan: apply::plan(cfg, false),
            rules: Vec::new(),
            config: cfg.clone(),
            builder: self,
            pins,
        };
        fx.apply_config(cfg);
        fx
    }
}

/// The program loaded with its maps and a config applied. Fields are public for what the
/// methods do not cover; the pins stay private, removed on drop.
pub struct Fixture {
    pub maps: Maps,
    pub dp: Datapath,
    /// The config last applied.
    pub config: Config,
    /// Its plan, as applied.
    pub plan: Plan,
    /// Its rules' names, in file order (the counters name rule counters `<rule>/<counter>`).
    pub rules: Vec<String>,
    builder: Builder,
    // Last: dropped after the program and its maps.
    pins: Pins,
}

impl Fixture {
    /// The program with a store of 4096 sources and `config` applied.
    pub fn load(config: &str) -> Fixture {
        Builder::default().load(config)
    }

    /// A fixture loaded otherwise ([`Builder`]).
    pub fn builder() -> Builder {
        Builder::default()
    }

    /// The program loaded again against the same pinned maps (as a restarted daemon does:
    /// the maps adopted, their state kept) with the config last applied.
    pub fn reload(self) -> Fixture {
        let Fixture {
            maps,
            dp,
            config,
            builder,
            pins,
            ..
        } = self;
        drop(maps);
        drop(dp);
        builder.load_at(pins, &config)
    }

    /// Parses `config` and applies it, as the daemon does on a start or a reload.
    ///
    /// # Panics
    ///
    /// If it does not parse or apply.
    pub fn apply(&mut self, config: &str) {
        self.apply_config(&parse(config));
    }

    /// Applies a parsed config (one the test changed, say).
    pub fn apply_config(&mut self, cfg: &Config) {
        let plan = apply::plan(cfg, false);
        self.apply_plan(&plan);
        self.rules = cfg.rules.iter().map(|r| r.name.clone()).collect();
        self.config = cfg.clone();
        self.plan = plan;
    }

    /// Applies `plan` (the last applied, again, say); the config and its rules stay.
    pub fn apply_plan(&mut self, plan: &Plan) {
        apply::apply(&mut self.maps, plan).expect("apply");
    }

    /// Writes rule `slot` and then a new policy generation: the last two map writes of
    /// [`apply::apply`], alone (for a test that races them against the program's tick).
    pub fn write_rule(&mut self, slot: u32, rule: RuleConfig) {
        let mut global = self.maps.global.get(&0, 0).expect("read the global config");
        global.generation = global.generation.wrapping_add(1);
        self.maps.rules.set(slot, rule, 0).expect("write a rule");
        self.maps
            .global
            .set(0, global, 0)
            .expect("write the generation");
    }

    /// Runs `frame` through the program `repeat` times: the action of the last run.
    pub fn run(&self, frame: &[u8], repeat: u32) -> u32 {
        run(&self.dp, frame, repeat)
    }

    /// Runs `frame` `repeat` times (as [`Fixture::run`]) and asserts the action of the last
    /// run and the counters the runs moved (as [`Deltas::assert`]).
    #[track_caller]
    pub fn expect(&self, frame: &[u8], repeat: u32, action: u32, deltas: &str) {
        let before = self.counters();
        let got = self.run(frame, repeat);
        let d = self.delta(&before);
        assert_eq!(
            got, action,
            "the action of the last of {repeat} run(s); deltas {d:?}"
        );
        d.assert(deltas);
    }

    /// Runs `frame` through the program `n` times, each run a BPF_PROG_TEST_RUN of its own
    /// (where [`Fixture::run`] repeats it within one): the action of the last.
    pub fn run_singly(&self, frame: &[u8], n: u32) -> u32 {
        (0..n)
            .map(|_| self.run(frame, 1))
            .last()
            .unwrap_or(XDP_PASS)
    }

    /// Runs `frame` once: the action and the frame as the program left it (a reply).
    pub fn run_out(&self, frame: &[u8]) -> (u32, Vec<u8>) {
        self.dp.test_run_out(frame).expect("BPF_PROG_TEST_RUN")
    }

    /// Runs every case of a fixture table through `program` (`ratelimit`, or another entry
    /// point of the object), then fails with the list of those whose action or counter deltas
    /// were not as expected.
    pub fn run_table(&mut self, program: &str, cases: &[Case]) {
        let mut failures = Vec::new();
        for c in cases {
            let before = self.counters();
            let (action, _) = self
                .dp
                .test_run_program(program, &c.frame, c.repeat)
                .unwrap_or_else(|e| panic!("{}: {e:#}", c.what));
            let got = self.delta(&before);
            let mut want = parse_deltas(c.deltas);
            want.retain(|_, n| *n != 0);
            if action != c.action || got.0 != want {
                failures.push(format!(
                    "{}: action {action} (want {}), deltas {got:?} (want {want:?})",
                    c.what, c.action
                ));
            }
        }
        assert!(
            failures.is_empty(),
            "{} of {} fixtures failed:\n{}",
            failures.len(),
            cases.len(),
            failures.join("\n")
        );
        println!("{} fixtures passed through {program}", cases.len());
    }

    /// Every counter now, summed over CPUs and slots.
    pub fn counters(&self) -> Counters {
        counters(&self.maps, &self.rules)
    }

    /// What the counters moved since `before`.
    pub fn delta(&self, before: &Counters) -> Deltas {
        before.delta(&self.counters())
    }

    /// What the counters moved while `f` ran.
    pub fn delta_of<T>(&mut self, f: impl FnOnce(&mut Fixture) -> T) -> Deltas {
        let before = self.counters();
        f(self);
        self.delta(&before)
    }

    /// Bans `cidr` for an hour in the operator's table, as `ratelimit ban add` does.
    pub fn ban(&mut self, cidr: &str) {
        let now = ratelimit_user::clock::mono_ns();
        self.insert_ban(manual_ban(cidr, now, now + HOUR_NS));
    }

    /// Inserts `entry` into the ban table its flags name.
    pub fn insert_ban(&mut self, entry: BanEntry) {
        self.maps.insert_ban(entry).expect("insert a ban");
    }

    /// Removes the ban of `cidr` from `table`: whether there was one.
    pub fn unban(&mut self, table: u32, cidr: &str) -> bool {
        let (plen, key) = prefix(cidr);
        self.maps
            .remove_ban(table, plen, &key)
            .expect("remove a ban")
    }

    /// Per client (rule, IPv4 address): (packets, drops), the fast-drop table's pending counts
    /// included.
    pub fn client_totals(&self) -> BTreeMap<(u8, [u8; 4]), (u64, u64)> {
        let mut m = BTreeMap::new();
        report::for_each_client(&self.maps, |k, s| {
            let a = [k.addr[12], k.addr[13], k.addr[14], k.addr[15]];
            m.insert((k.rule, a), (s.packets, s.drop_count()));
        })
        .expect("read the clients");
        m
    }

    /// Pending fast-drop counts still in the per-CPU table (`RL_FAST`).
    pub fn fast_pending(&self) -> u64 {
        (0..ratelimit_common::maps::FAST_ENTRIES)
            .map(|i| pending(&self.maps.fast, i))
            .sum()
    }

    /// Pending counts of the overflow states still on the CPUs (`RL_OVF_TICK`).
    pub fn ovf_pending(&self) -> u64 {
        (0..ratelimit_common::caps::MAX_RULES)
            .map(|r| pending(&self.maps.ovf_tick, r))
            .sum()
    }

    /// The two sets the program places `key` in, under the key of this load.
    pub fn sets_of(&self, key: &ClientKey) -> (u32, u32) {
        ratelimit_common::maps::store_sets_of(self.maps.clients.hash(key), self.maps.clients.sets())
    }

    /// The first `n` IPv6 sources ([`v6_source`]) whose two sets are the two distinct `sets`:
    /// what an attacker who knew the placement hash (with a fixed hash, anyone) would send to
    /// take a client's slots. Each of them sees the same 16 slots.
    pub fn colliding(&self, sets: (u32, u32), n: usize) -> Vec<(String, ClientKey)> {
        assert_ne!(sets.0, sets.1);
        (1..)
            .map(v6_source)
            .filter(|(_, k)| {
                let (x, y) = self.sets_of(k);
                (x, y) == sets || (y, x) == sets
            })
            .take(n)
            .collect()
    }

    /// The lines the program writes through aya-log, from now on.
    pub fn kernel_log(&mut self) -> KernelLog {
        let lines = Lines::default();
        let mut logger = ratelimit_user::kernel::log::open(self.dp.ebpf_mut(), lines.clone())
            .expect("open the log ring");
        KernelLog {
            lines,
            flush: Box::new(move || {
                if let Some(l) = logger.as_mut() {
                    l.flush();
                }
            }),
        }
    }
}

/// A row of a fixture table ([`Fixture::run_table`]): a frame, how many times it runs, the
/// action of its last run, and the counters the runs move: exactly, a counter not named must
/// not move.
pub struct Case {
    pub what: &'static str,
    pub frame: Vec<u8>,
    pub repeat: u32,
    pub action: u32,
    /// The counters moved, space-separated: `name` moved by 1, `name=N` by N.
    pub deltas: &'static str,
}

impl Case {
    /// The case run `n` times (its deltas are the runs' total).
    pub fn times(self, n: u32) -> Case {
        Case { repeat: n, ..self }
    }
}

/// A [`Case`] run once: `what` it is, the `action` expected, the counters it moves (see
/// [`Case::deltas`]), and the frame.
pub fn case(
    what: &'static str,
    action: u32,
    deltas: &'static str,
    frame: impl Into<Vec<u8>>,
) -> Case {
    Case {
        what,
        frame: frame.into(),
        repeat: 1,
        action,
        deltas,
    }
}

/// BPF_PROG_TEST_RUN of `frame`, `repeat` times, through `dp`'s program: the last action.
/// (For a closure that holds the program while the maps are borrowed apart.)
pub fn run(dp: &Datapath, frame: &[u8], repeat: u32) -> u32 {
    dp.test_run(frame, repeat).expect("BPF_PROG_TEST_RUN").0
}

/// The sum of the `pending_packets` of entry `i` of a per-CPU fast-drop table over CPUs.
fn pending(
    map: &aya::maps::PerCpuArray<aya::maps::MapData, ratelimit_common::maps::FastEntry>,
    i: u32,
) -> u64 {
    map.get(&i, 0)
        .expect("read a fast-drop entry")
        .iter()
        .map(|e| e.pending_packets)
        .sum()
}

/// Counters by name: verdicts and reasons by theirs, rule counters as `<rule>/<counter>`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Counters(pub BTreeMap<String, u64>);

impl Counters {
    /// What moved from these to `after` (counters that did not move are absent).
    pub fn delta(&self, after: &Counters) -> Deltas {
        Deltas(
            after
                .0
                .iter()
                .filter_map(|(k, v)| {
                    let d = v - self.0.get(k).copied().unwrap_or(0);
                    (d != 0).then(|| (k.clone(), d))
                })
                .collect(),
        )
    }
}

/// The counters of `maps`, rule counters named after `rules` (in file order).
pub fn counters(maps: &Maps, rules: &[String]) -> Counters {
    let s = report::stats(maps, &[], rules).expect("stats");
    let mut m = BTreeMap::new();
    for (k, v) in s.all.verdicts.iter().chain(s.all.reasons.iter()) {
        m.insert(k.to_string(), v.packets);
    }
    for r in &s.rules {
        for (k, v) in &r.counters {
            m.insert(format!("{}/{}", r.name, k), v.packets);
        }
    }
    Counters(m)
}

/// Counter deltas by name; a counter that did not move is absent (0).
#[derive(Clone, Default, PartialEq)]
pub struct Deltas(pub BTreeMap<String, u64>);

impl std::fmt::Debug for Deltas {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl Deltas {
    /// The delta of `counter` (`None` if it did not move).
    pub fn get(&self, counter: &str) -> Option<&u64> {
        self.0.get(counter)
    }

    /// The delta of `counter`, 0 if it did not move.
    pub fn of(&self, counter: &str) -> u64 {
        self.get(counter).copied().unwrap_or(0)
    }

    /// Asserts the deltas of the counters `want` names (space-separated: `name=N` moved by N,
    /// 0 for not at all; `name` alone moved by 1); counters not named may have moved. The
    /// message lists every mismatch and all deltas.
    #[track_caller]
    pub fn assert(&self, want: &str) {
        let wrong: Vec<String> = parse_deltas(want)
            .into_iter()
            .filter(|(k, v)| self.of(k) != *v)
            .map(|(k, v)| format!("{k}: {} (want {v})", self.of(&k)))
            .collect();
        assert!(wrong.is_empty(), "{}; deltas {self:?}", wrong.join(", "));
    }
}

/// `name=N` (or `name`, for 1) pairs, space-separated.
fn parse_deltas(text: &str) -> BTreeMap<String, u64> {
    text.split_whitespace()
        .map(|d| match d.split_once('=') {
            Some((k, n)) => (
                k.to_string(),
                n.parse()
                    .unwrap_or_else(|e| panic!("{d}: a count after `=`: {e}")),
            ),
            None => (d.to_string(), 1),
        })
        .collect()
}

/// `text` as the daemon reads a config file.
///
/// # Panics
///
/// If it does not parse, with the errors.
pub fn parse(text: &str) -> Config {
    config::parse("fixture.toml", text).unwrap_or_else(|e| panic!("the config: {e}\n{text}"))
}

/// `cidr`'s prefix as the ban and list tables key it: (prefix length, address).
pub fn prefix(cidr: &str) -> (u32, IpKey) {
    let net = config::parse_net(cidr).unwrap_or_else(|e| panic!("{cidr}: {e}"));
    apply::prefix(&net)
}

/// An operator's ban of `cidr` (as `ratelimit ban add` makes it) from `now_ns` until
/// `until_ns` (0: no end).
pub fn manual_ban(cidr: &str, now_ns: u64, until_ns: u64) -> BanEntry {
    let (plen, key) = prefix(cidr);
    BanEntry::manual(plen, key.addr, now_ns, until_ns)
}

/// Rule 0's key of IPv4 source `a` (a /32: 128 bits of the mapped address).
pub fn key_v4(a: [u8; 4]) -> ClientKey {
    ClientKey {
        rule: 0,
        kind: KEY_IP,
        prefix_len: 128,
        addr: IpKey::from_v4(a).addr,
        ..ClientKey::default()
    }
}

/// IPv6 source `2001:db8:<n>::1`, and rule 0's key of it (its /64, the default prefix).
pub fn v6_source(n: u32) -> (String, ClientKey) {
    let src = format!("2001:db8:{:x}:{:x}::1", n >> 16, n & 0xffff);
    let mut addr = [0u8; 16];
    addr[..8].copy_from_slice(&src.parse::<std::net::Ipv6Addr>().unwrap().octets()[..8]);
    let key = ClientKey {
        prefix_len: 64,
        addr,
        ..key_v4([0; 4])
    };
    (src, key)
}

/// CLOCK_MONOTONIC_COARSE now and its resolution (a timer tick), in nanoseconds.
pub fn coarse_ns() -> (u64, u64) {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    let mut res = ts;
    // SAFETY: valid out-pointers.
    unsafe {
        libc::clock_gettime(libc::CLOCK_MONOTONIC_COARSE, &mut ts);
        libc::clock_getres(libc::CLOCK_MONOTONIC_COARSE, &mut res);
    }
    (
        ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64,
        res.tv_sec as u64 * 1_000_000_000 + res.tv_nsec as u64,
    )
}

/// The lines the program wrote through aya-log, as the daemon's forwarder gets them
/// ([`Fixture::kernel_log`]).
pub struct KernelLog {
    lines: Lines,
    flush: Box<dyn FnMut()>,
}

impl KernelLog {
    /// Reads what the program wrote since the last flush.
    pub fn flush(&mut self) {
        (self.flush)();
    }

    /// The lines starting with `what`, with the count each stands for (the number after it).
    ///
    /// # Panics
    ///
    /// If such a line is not a warning.
    pub fn counts(&self, what: &str) -> Vec<(u64, String)> {
        self.lines
            .0
            .lock()
            .unwrap()
            .iter()
            .filter_map(|(level, line)| {
                let rest = line.strip_prefix(what)?;
                assert_eq!(*level, log::Level::Warn, "{line}");
                let n = rest.split(' ').next()?.parse().ok()?;
                Some((n, line.clone()))
            })
            .collect()
    }
}

#[derive(Clone, Default)]
struct Lines(std::sync::Arc<std::sync::Mutex<Vec<(log::Level, String)>>>);

impl log::Log for Lines {
    fn enabled(&self, _: &log::Metadata<'_>) -> bool {
        true
    }
    fn log(&self, record: &log::Record<'_>) {
        let line = record.args().to_string();
        self.0.lock().unwrap().push((record.level(), line));
    }
    fn flush(&self) {}
}
