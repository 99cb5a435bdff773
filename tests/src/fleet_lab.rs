//! The fleet lab: daemons, each in its own namespace with its own veth to a sender (a
//! [`Scenario`]), and one store they share in a "store" namespace, reached through a veth
//! from each host's namespace to it. The store is one `redis-server`, the same reached
//! through a delaying TCP proxy per host ([`DelayProxy`], a slow link made on demand), or a
//! Redis Cluster of three masters, or one `redis-server` speaking only TLS.
//!
//! Each host's config is the caller's, made from the host's index and the store's URL as that
//! host reaches it. Everything is a guard: the daemons, the proxies, the links, the store and
//! its namespace are removed on drop, also when a test panics.

use std::{
    net::{IpAddr, Ipv4Addr, SocketAddr},
    path::Path,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use ratelimit_user::{
    api::{Answer, Request},
    fleet,
    policy::report::Ban,
};

use crate::{
    Daemon, NetNs, Scenario, SendStats, VethPair,
    delay::DelayProxy,
    scenario::rule_counter,
    store::{Cluster, Redis, Sentinels, TlsServer},
};

/// The `redis-server`'s port (a single store).
pub const REDIS_PORT: u16 = 6379;
/// Each host's delaying proxy's port, on the store's end of that host's link.
pub const PROXY_PORT: u16 = 16379;

/// How the hosts reach their store.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Store {
    /// One `redis-server`, each host straight over its own link.
    Direct,
    /// One `redis-server`, each host through a delaying proxy of its own (no delay until
    /// [`DelayProxy::set_delay`] on [`FleetLab::proxies`]).
    Proxied,
    /// A Redis Cluster of three masters on `ports`, all announcing `ip`: an address on the
    /// store namespace's loopback, routed to through each host's own link.
    Cluster { ip: Ipv4Addr, ports: [u16; 3] },
    /// One `redis-server` speaking only TLS on `port` at `ip` (an address on the store
    /// namespace's loopback, routed to through each host's own link), with the certificates
    /// given to [`Setup::tls`]; the hosts reach it as `rediss://IP:PORT`.
    Tls { ip: Ipv4Addr, port: u16 },
    /// A Redis Cluster of three masters as [`Store::Cluster`], speaking only TLS (between its
    /// nodes too), with the certificates given to [`Setup::tls`]; reached as
    /// `rediss+cluster://`.
    TlsCluster { ip: Ipv4Addr, ports: [u16; 3] },
    /// A master, its replica and three sentinels ([`Sentinels`]) on `ip` (on the store
    /// namespace's loopback, routed to as for a cluster), at `ports`: the master's, the
    /// replica's, the sentinels'. The hosts reach it as `redis+sentinel://...`, or as
    /// `rediss+sentinel://...` with [`Setup::tls`] (see also [`Setup::sentinel_passwords`]).
    Sentinel { ip: Ipv4Addr, ports: [u16; 5] },
}

/// What a lab is made of; [`Setup::start`] makes it.
#[derive(Clone, Debug)]
pub struct Setup {
    tag: String,
    hosts: usize,
    store: Store,
    http_port: Option<u16>,
    tls: Option<TlsServer>,
    /// More environment variables for some hosts' daemons, by host index.
    env: Vec<(usize, Vec<(String, String)>)>,
    /// A [`Store::Sentinel`]'s passwords: the master's, the sentinels'.
    sentinel_passwords: (Option<String>, Option<String>),
}

impl Setup {
    /// Three hosts on a [`Store::Direct`] store, no HTTP listener. `tag` names the
    /// namespaces: `{tag}-st` for the store, `{tag}{i}` for host `i`'s.
    pub fn new(tag: &str) -> Setup {
        Setup {
            tag: tag.to_string(),
            hosts: 3,
            store: Store::Direct,
            http_port: None,
            tls: None,
            env: Vec::new(),
            sentinel_passwords: (None, None),
        }
    }

    /// A [`Store::Sentinel`] whose master and replica require `master` and whose sentinels
    /// require `sentinels` (each if given). With [`Setup::tls`], every one of them speaks
    /// only TLS, and the hosts reach them as `rediss+sentinel://`.
    pub fn sentinel_passwords(mut self, master: Option<&str>, sentinels: Option<&str>) -> Setup {
        self.sentinel_passwords = (master.map(str::to_string), sentinels.map(str::to_string));
        self
    }

    /// Host `i`'s daemon started with these environment variables too (e.g. a
    /// [`crate::faketime::FakeClock`]'s).
    pub fn host_env(mut self, i: usize, env: Vec<(String, String)>) -> Setup {
        self.env.push((i, env));
        self
    }

    /// The server's certificates for a [`Store::Tls`] store.
    pub fn tls(mut self, tls: TlsServer) -> Setup {
        self.tls = Some(tls);
        self
    }

    pub fn hosts(mut self, n: usize) -> Setup {
        self.hosts = n;
        self
    }

    pub fn store(mut self, store: Store) -> Setup {
        self.store = store;
        self
    }

    /// Each daemon's HTTP listener on this port (on 127.0.0.1 in its own namespace).
    pub fn http(mut self, port: u16) -> Setup {
        self.http_port = Some(port);
        self
    }

    /// The store, then every host's daemon started with `config(i, url)`: `url` is the
    /// store as host `i` reaches it. Nothing waits for the hosts to connect.
    pub fn start(self, config: impl Fn(usize, &str) -> String) -> FleetLab {
        let store = NetNs::new(&format!("{}-st", self.tag));
        let mut hosts: Vec<Scenario> = (0..self.hosts)
            .map(|i| {
                let s = Scenario::new(&format!("{}{i}", self.tag));
                let s = match self.env.iter().find(|(h, _)| *h == i) {
                    Some((_, env)) => s.with_env(env.clone()),
                    None => s,
                };
                match self.http_port {
                    Some(port) => s.with_http(port),
                    None => s,
                }
            })
            .collect();
        let links: Vec<VethPair> = hosts
            .iter()
            .map(|h| VethPair::new(&store, &h.server))
            .collect();
        let at = |ip: Ipv4Addr, port| SocketAddr::new(IpAddr::V4(ip), port);
        let (mut redis, mut cluster, mut proxies, mut sentinels) = (None, None, Vec::new(), None);
        // An address on the store's loopback, routed to from every host through its link.
        let loopback_addr = |ip: Ipv4Addr| {
            store.ip(&["addr", "add", &format!("{ip}/32"), "dev", "lo"]);
            for (h, l) in hosts.iter().zip(&links) {
                crate::link::add_route(
                    &h.server,
                    &format!("{ip}/32"),
                    &l.b().name,
                    Some(&l.a().ipv4.to_string()),
                );
            }
        };
        let urls: Vec<String> = match self.store {
            Store::Sentinel { ip, ports } => {
                loopback_addr(ip);
                let security = crate::store::SentinelSecurity {
                    password: self.sentinel_passwords.0.clone(),
                    sentinel_password: self.sentinel_passwords.1.clone(),
                    tls: self.tls.clone(),
                };
                let s = Sentinels::start_secured(&store, ip, ports, &security);
                let url = s.url();
                sentinels = Some(s);
                vec![url; self.hosts]
            }
            Store::Tls { ip, port } => {
                loopback_addr(ip);
                let tls = self.tls.as_ref().expect("Setup::tls for a TLS store");
                redis = Some(Redis::start_tls(&store, IpAddr::V4(ip), port, tls));
                vec![format!("rediss://{ip}:{port}"); self.hosts]
            }
            Store::Cluster { ip, ports } | Store::TlsCluster { ip, ports } => {
                loopback_addr(ip);
                let c = match self.store {
                    Store::TlsCluster { .. } => Cluster::start_tls(
                        &store,
                        ip,
                        ports,
                        self.tls.as_ref().expect("Setup::tls for a TLS store"),
                    ),
                    _ => Cluster::start(&store, ip, ports),
                };
                let url = c.url();
                cluster = Some(c);
                vec![url; self.hosts]
            }
            Store::Direct => {
                redis = Some(Redis::start(
                    &store,
                    IpAddr::V4(links[0].a().ipv4),
                    REDIS_PORT,
                ));
                links
                    .iter()
                    .map(|l| format!("redis://{}:{REDIS_PORT}", l.a().ipv4))
                    .collect()
            }
            Store::Proxied => {
                let server = links[0].a().ipv4;
                redis = Some(Redis::start(&store, IpAddr::V4(server), REDIS_PORT));
                proxies = links
                    .iter()
                    .map(|l| {
                        DelayProxy::start(
                            &store,
                            at(l.a().ipv4, PROXY_PORT),
                            at(server, REDIS_PORT),
                        )
                    })
                    .collect();
                proxies
                    .iter()
                    .map(|p| format!("redis://{}", p.addr()))
                    .collect()
            }
        };
        for (i, h) in hosts.iter_mut().enumerate() {
            h.start(&config(i, &urls[i]));
        }
        FleetLab {
            hosts,
            proxies,
            _links: links,
            redis,
            cluster,
            sentinels,
            _store: store,
        }
    }
}

/// The hosts and their store. Fields drop in order: the daemons (and their namespaces), the
/// proxies, the links to the store, the store, its namespace.
pub struct FleetLab {
    pub hosts: Vec<Scenario>,
    /// One per host, in front of the store ([`Store::Proxied`] only).
    pub proxies: Vec<DelayProxy>,
    _links: Vec<VethPair>,
    pub redis: Option<Redis>,
    pub cluster: Option<Cluster>,
    pub sentinels: Option<Sentinels>,
    _store: NetNs,
}

impl FleetLab {
    pub fn redis(&mut self) -> &mut Redis {
        self.redis.as_mut().expect("a single store")
    }

    pub fn cluster(&mut self) -> &mut Cluster {
        self.cluster.as_mut().expect("a cluster store")
    }

    pub fn sentinels(&mut self) -> &mut Sentinels {
        self.sentinels.as_mut().expect("a sentinel store")
    }

    pub fn d(&self, i: usize) -> &Daemon {
        self.hosts[i].daemon()
    }

    /// Host `i`'s `fleet status`.
    pub fn fleet(&self, i: usize) -> fleet::Report {
        match call(self.d(i).socket_path(), &Request::Fleet) {
            Answer::Fleet(r) => *r,
            other => panic!("fleet status answered {other:?}"),
        }
    }

    /// Every host connected to the store within `timeout`, or the test fails saying which.
    pub fn wait_connected(&self, timeout: Duration) {
        for i in 0..self.hosts.len() {
            assert!(
                wait_for(timeout, || self.fleet(i).connected),
                "host {i} never connected to the store: {:?}\n{}",
                self.fleet(i),
                self.d(i).logs()
            );
        }
    }

    /// The bans host `i` holds.
    pub fn bans(&self, i: usize) -> Vec<Ban> {
        match call(self.d(i).socket_path(), &Request::Bans { limit: None }) {
            Answer::Bans(b) => b,
            other => panic!("bans answered {other:?}"),
        }
    }

    pub fn holds(&self, i: usize, cidr: &str) -> Option<Ban> {
        self.bans(i)
            .into_iter()
            .find(|b| b.cidr.as_deref() == Some(cidr))
    }

    /// Datagrams from `src` to `port` that reach host `i`, of `n` sent.
    pub fn reaching(&self, i: usize, src: Ipv4Addr, port: u16, n: u64) -> u64 {
        let h = &self.hosts[i];
        let sink = h.sink(port);
        let mut tx = h.sender();
        tx.send_n(std::iter::repeat(h.udp4(src, port)), n, None);
        sink.wait_total(n, Duration::from_millis(500));
        sink.wait_quiet(Duration::from_millis(100));
        sink.stop().from(IpAddr::V4(src))
    }

    /// Host `i`'s events of one kind.
    pub fn events(&self, i: usize, kind: &str) -> Vec<serde_json::Value> {
        self.hosts[i]
            .events()
            .into_iter()
            .filter(|e| e["event"] == kind)
            .collect()
    }

    /// Packets `rule` let through on each host so far.
    pub fn admitted_by(&self, rule: &str) -> Vec<u64> {
        self.hosts
            .iter()
            .map(|h| {
                let st = h.stats();
                rule_counter(&st, rule, "matched") - rule_counter(&st, rule, "dropped")
            })
            .collect()
    }

    /// (matched, dropped) of `rule`, summed over the hosts.
    pub fn judged(&self, rule: &str) -> (u64, u64) {
        self.hosts.iter().fold((0, 0), |(m, d), h| {
            let st = h.stats();
            (
                m + rule_counter(&st, rule, "matched"),
                d + rule_counter(&st, rule, "dropped"),
            )
        })
    }
}

/// A control call that must be answered.
pub fn call(socket: &Path, req: &Request) -> Answer {
    ratelimit_user::serve::control::call(socket, req).unwrap_or_else(|e| panic!("{req:?}: {e:#}"))
}

/// `cond` polled every 2 ms for up to `timeout`; its last value.
pub fn wait_for(timeout: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let give_up = Instant::now() + timeout;
    loop {
        if cond() {
            return true;
        }
        if Instant::now() > give_up {
            return false;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// The `p` quantile (0 to 1) of `sorted`: the smallest value with at least that share of
/// the values at or below it.
pub fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i]
}

/// The `[fleet]` section of host `host` of a lab: its store and id, and a sync every 50 ms.
pub fn fleet_section(url: &str, host: usize) -> String {
    format!("[fleet]\nredis = \"{url}\"\nhost_id = \"h{host}\"\nsync_interval = \"50ms\"\n")
}

/// Sleep until `at` (a wall-clock time, since the Unix epoch).
pub fn sleep_until_wall(at: Duration) {
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
    if at > now {
        std::thread::sleep(at - now);
    }
}

/// The start of the next wall-clock window of `t_secs` seconds (windows as a global rule
/// counts them).
pub fn next_window_start(t_secs: u64) -> Duration {
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
    Duration::from_secs((now.as_secs() / t_secs + 1) * t_secs)
}

/// Traffic in whole wall-clock windows of `t_secs`: at the start of the next window `send`
/// starts the senders for `windows + 2` windows (given that duration), and `read` is read at
/// each boundary from the second on. Returns, for each of the `windows` whole windows after
/// the first, how much each of `read`'s values grew in it.
pub fn per_window(
    t_secs: u64,
    windows: u64,
    send: impl FnOnce(Duration) -> Vec<std::thread::JoinHandle<SendStats>>,
    mut read: impl FnMut() -> Vec<u64>,
) -> Vec<Vec<u64>> {
    let t = Duration::from_secs(t_secs);
    let first = next_window_start(t_secs);
    sleep_until_wall(first);
    let senders = send(t * (windows as u32 + 2));
    let mut marks = Vec::new();
    for w in 1..=windows + 1 {
        sleep_until_wall(first + t * w as u32);
        marks.push(read());
    }
    for s in senders {
        s.join().expect("sender");
    }
    marks
        .windows(2)
        .map(|m| m[1].iter().zip(&m[0]).map(|(b, a)| b - a).collect())
        .collect()
}

/// A throttle rule named `name` of `count` UDP packets to `port` per `interval_secs`, with
/// the sliding window, in `scope`.
pub fn udp_rule(name: &str, port: u16, count: u64, interval_secs: u64, scope: &str) -> String {
    format!(
        "[[rule]]\nname = \"{name}\"\nmatch = {{ protocol = \"udp\", dst_ports = [\"{port}\"] }}\n\
         action = \"throttle\"\nthreshold = {{ count = {count}, interval = \"{interval_secs}s\" }}\n\
         algorithm = \"sliding_window\"\nscope = \"{scope}\"\n"
    )
}
