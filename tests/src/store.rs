//! A real `redis-server`, the fleet's store, run in a lab namespace on its own port and
//! directory (no persistence: `--save ""`, `--appendonly no`).
//!
//! Its [`Server`] guard owns the process and a private temp dir (the server's log). On drop it
//! kills the server (continuing it first if the test stopped it) and removes the dir, also
//! when a test panics. Tests can kill it, start it again on the same port, and stop or continue it
//! (SIGSTOP, SIGCONT) to see what the daemons do without their store.
//!
//! [`Cluster`] runs three such servers as a Redis Cluster of three masters and no replicas
//! (`--cluster-enabled yes`, then `redis-cli --cluster create`), each with its own port and
//! directory (its `nodes.conf` survives a kill, so a restarted master rejoins with its slots).
//!
//! [`Sentinels`] runs a master, its replica and three Redis Sentinels watching them, which
//! promote the replica when the master is lost.
//!
//! [`TlsFiles`] makes a throwaway CA, a server certificate for given addresses and a client
//! certificate (with `openssl`), and a second CA that signed neither; [`Redis::start_tls`]
//! runs a server that speaks only TLS with them.

use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::netns::{NetNs, command_in_fd, describe};
use crate::server::{Server, Spec};

/// How long a start waits for the server to answer `PING`.
pub const READY_TIMEOUT: Duration = Duration::from_secs(20);

/// `redis-server` as the lab runs it: the store's data never matters after a test, so it is
/// killed (SIGKILL) on drop.
const SPEC: Spec = Spec::new("redis-server", "redis.log")
    .ready_within(READY_TIMEOUT, Duration::from_millis(20))
    .stopped_by(libc::SIGKILL, Duration::from_secs(5))
    .quiet();

/// The `redis-server` binary on `PATH` (or in /usr/sbin).
///
/// # Panics
///
/// If there is none, saying how to install it.
pub fn binary() -> PathBuf {
    crate::tool::find_binary("redis-server", "redis-server")
}

/// A running `redis-server` in a lab namespace. Its guard listens on an address of the
/// server in its namespace, the one the readiness check and `redis-cli` use.
pub struct Redis {
    server: Server,
    setup: Setup,
}

/// How a [`Redis`] is started again, and how `redis-cli` reaches it.
struct Setup {
    /// More `redis-server` arguments (the cluster's).
    extra: Vec<String>,
    /// TLS only, with these files: the server's, and the client's for `redis-cli`.
    tls: Option<TlsServer>,
    /// A config file given first (a sentinel's: `redis-server FILE --sentinel`).
    sentinel_conf: Option<PathBuf>,
    /// The password `redis-cli` (and the readiness check) authenticates with.
    password: Option<String>,
}

/// What a TLS server is started with (paths into a [`TlsFiles`]' directory).
#[derive(Clone, Debug)]
pub struct TlsServer {
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
    /// `--tls-auth-clients yes`: a client without a certificate of the CA is refused.
    pub auth_clients: bool,
}

impl Redis {
    /// Starts `redis-server` in `ns` listening on every address of `ns` at `port`, and waits
    /// until it answers `PING` at `probe` (an address of `ns`).
    pub fn start(ns: &NetNs, probe: std::net::IpAddr, port: u16) -> Redis {
        Redis::start_with(ns, probe, port, &[])
    }

    /// [`Redis::start`] with more `redis-server` arguments.
    pub fn start_with(ns: &NetNs, probe: std::net::IpAddr, port: u16, extra: &[&str]) -> Redis {
        Redis::start_full(ns, probe, port, extra, None, None)
    }

    /// [`Redis::start`] speaking only TLS on `port` (`--port 0 --tls-port PORT`), with the
    /// certificates of `tls`.
    pub fn start_tls(ns: &NetNs, probe: std::net::IpAddr, port: u16, tls: &TlsServer) -> Redis {
        Redis::start_full(ns, probe, port, &[], Some(tls.clone()), None)
    }

    /// A `redis-server` with all its options: `extra` arguments, TLS, a password.
    fn start_full(
        ns: &NetNs,
        probe: std::net::IpAddr,
        port: u16,
        extra: &[&str],
        tls: Option<TlsServer>,
        password: Option<&str>,
    ) -> Redis {
        let mut extra: Vec<String> = extra.iter().map(|a| a.to_string()).collect();
        if let Some(pw) = password {
            extra.extend(["--requirepass".to_string(), pw.to_string()]);
        }
        let mut r = Redis {
            server: Server::listening(SPEC, ns, SocketAddr::new(probe, port)),
            setup: Setup {
                extra,
                tls,
                sentinel_conf: None,
                password: password.map(str::to_string),
            },
        };
        r.launch();
        r
    }

    /// [`Redis::start_with`] speaking TLS if `tls` is given, and requiring `password`
    /// (`--requirepass`) if one is, which its own `redis-cli` calls then give.
    pub fn start_secured(
        ns: &NetNs,
        probe: std::net::IpAddr,
        port: u16,
        extra: &[&str],
        tls: Option<&TlsServer>,
        password: Option<&str>,
    ) -> Redis {
        Redis::start_full(ns, probe, port, extra, tls.cloned(), password)
    }

    /// A Redis Sentinel (`redis-server FILE --sentinel`) on `port`, its config file (which
    /// it rewrites) in its directory holding `conf`.
    pub fn start_sentinel(ns: &NetNs, probe: std::net::IpAddr, port: u16, conf: &str) -> Redis {
        Redis::start_sentinel_secured(ns, probe, port, conf, None, None)
    }

    /// [`Redis::start_sentinel`] speaking only TLS if `tls` is given (and reaching the
    /// servers it watches over TLS: `--tls-replication yes`), its `redis-cli` calls giving
    /// `password` (the sentinel's own `requirepass`, which `conf` sets).
    pub fn start_sentinel_secured(
        ns: &NetNs,
        probe: std::net::IpAddr,
        port: u16,
        conf: &str,
        tls: Option<&TlsServer>,
        password: Option<&str>,
    ) -> Redis {
        let server = Server::listening(SPEC, ns, SocketAddr::new(probe, port));
        let file = server.path("sentinel.conf");
        std::fs::write(&file, conf).expect("writing sentinel.conf");
        let mut r = Redis {
            server,
            setup: Setup {
                extra: if tls.is_some() {
                    vec!["--tls-replication".into(), "yes".into()]
                } else {
                    Vec::new()
                },
                tls: tls.cloned(),
                sentinel_conf: Some(file),
                password: password.map(str::to_string),
            },
        };
        r.launch();
        r
    }

    fn launch(&mut self) {
        let (server, setup) = (&mut self.server, &self.setup);
        let mut cmd = server.command(binary());
        if let Some(conf) = &setup.sentinel_conf {
            cmd.arg(conf).arg("--sentinel");
        }
        let port = server.port().to_string();
        match &setup.tls {
            None => {
                cmd.args(["--port", &port]);
            }
            Some(t) => {
                cmd.args(["--port", "0", "--tls-port", &port])
                    .arg("--tls-cert-file")
                    .arg(&t.cert)
                    .arg("--tls-key-file")
                    .arg(&t.key)
                    .arg("--tls-ca-cert-file")
                    .arg(&t.ca)
                    .args([
                        "--tls-auth-clients",
                        if t.auth_clients { "yes" } else { "no" },
                    ]);
            }
        }
        cmd.args(["--bind", "0.0.0.0", "::"])
            .args(["--protected-mode", "no"])
            .args(["--save", ""])
            .args(["--appendonly", "no"])
            .args(["--daemonize", "no"])
            .arg("--dir")
            .arg(server.dir())
            .arg("--logfile")
            .arg(server.path(SPEC.log))
            .args(&setup.extra);
        server.launch(cmd, |server| {
            if setup.ping(server) {
                Ok(())
            } else {
                Err(format!("no answer to PING at {}", server.addr()))
            }
        });
    }

    /// Whether the server answers `PING` within a second.
    pub fn ping(&self) -> bool {
        self.setup.ping(&self.server)
    }

    pub fn port(&self) -> u16 {
        self.server.port()
    }

    /// `redis-cli` against this server: its output (stdout and stderr), trimmed.
    pub fn cli(&self, args: &[&str]) -> String {
        self.setup.cli(&self.server, args)
    }

    /// Send `commands` (each a list of arguments) to the server at once, through `redis-cli
    /// --pipe` (the Redis protocol on its standard input): for a test that writes many records
    /// straight into the store. Returns what redis-cli printed (its summary: `errors: 0,
    /// replies: N`).
    pub fn pipe(&self, commands: &[Vec<String>]) -> String {
        let mut input = Vec::new();
        for c in commands {
            input.extend_from_slice(format!("*{}\r\n", c.len()).as_bytes());
            for a in c {
                input.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
                input.extend_from_slice(a.as_bytes());
                input.extend_from_slice(b"\r\n");
            }
        }
        let mut cmd = self.setup.cli_command(&self.server, false);
        cmd.arg("--pipe")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("running `{}`: {e}", describe(&cmd)));
        let mut stdin = child.stdin.take().expect("stdin");
        let writer = std::thread::spawn(move || stdin.write_all(&input));
        let out = child.wait_with_output().expect("redis-cli --pipe");
        writer.join().unwrap().expect("writing to redis-cli --pipe");
        output_text(&out)
    }

    /// The running server's process id.
    pub fn pid(&self) -> Option<i32> {
        self.server.pid().map(|p| p as i32)
    }

    /// SIGKILL, and wait for it: the store is gone (with its data).
    pub fn kill(&mut self) {
        self.server.kill();
    }

    /// Start it again on the same port, empty.
    pub fn restart(&mut self) {
        self.kill();
        self.launch();
    }

    /// SIGSTOP: the server keeps its sockets but answers nothing.
    pub fn freeze(&mut self) {
        self.server.freeze();
    }

    /// SIGCONT after [`Redis::freeze`].
    pub fn thaw(&mut self) {
        self.server.thaw();
    }

    /// The server's log so far.
    pub fn log(&self) -> String {
        self.server.log()
    }
}

impl Setup {
    /// Whether `server` answers `PING` within a second.
    fn ping(&self, server: &Server) -> bool {
        if self.tls.is_some() || self.password.is_some() {
            return self.cli(server, &["PING"]) == "PONG";
        }
        let addr = server.addr();
        server.in_netns(move || {
            let Ok(mut c) = TcpStream::connect_timeout(&addr, Duration::from_secs(1)) else {
                return false;
            };
            let _ = c.set_read_timeout(Some(Duration::from_secs(1)));
            if c.write_all(b"PING\r\n").is_err() {
                return false;
            }
            let mut buf = [0u8; 16];
            matches!(c.read(&mut buf), Ok(n) if buf[..n].starts_with(b"+PONG"))
        })
    }

    /// `redis-cli` against `server`: its output (stdout and stderr), trimmed.
    fn cli(&self, server: &Server, args: &[&str]) -> String {
        let mut cmd = self.cli_command(server, true);
        cmd.args(args).stdin(Stdio::null());
        let out = cmd
            .output()
            .unwrap_or_else(|e| panic!("running `{}`: {e}", describe(&cmd)));
        output_text(&out)
    }

    /// `redis-cli -h IP -p PORT` in `server`'s namespace, with its TLS files if `tls` (and the
    /// server speaks it) and its password.
    fn cli_command(&self, server: &Server, tls: bool) -> Command {
        let mut cmd = command_in_fd(server.dup_ns_fd(), cli_binary());
        cmd.arg("-h")
            .arg(server.addr().ip().to_string())
            .arg("-p")
            .arg(server.port().to_string());
        if let Some(t) = self.tls.as_ref().filter(|_| tls) {
            tls_args(&mut cmd, t);
        }
        if let Some(pw) = &self.password {
            cmd.arg("--no-auth-warning").arg("-a").arg(pw);
        }
        cmd
    }
}

/// `redis-cli`'s options for a TLS server.
fn tls_args(cmd: &mut Command, t: &TlsServer) {
    cmd.arg("--tls")
        .arg("--cacert")
        .arg(&t.ca)
        .arg("--cert")
        .arg(&t.client_cert)
        .arg("--key")
        .arg(&t.client_key);
}

/// What a command printed, stdout then stderr, trimmed.
fn output_text(out: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
    .trim()
    .to_string()
}

/// The `redis-cli` binary beside `redis-server`.
pub fn cli_binary() -> PathBuf {
    binary().with_file_name("redis-cli")
}

/// A Redis Cluster of three masters (no replicas) in a lab namespace. Every node announces
/// the one address `announce` (put on the namespace's loopback by the caller, and routed to
/// from the daemons' namespaces), on its own port. Dropping it kills every node.
pub struct Cluster {
    pub nodes: Vec<Redis>,
    ns_fd: OwnedFd,
    announce: std::net::Ipv4Addr,
    tls: Option<TlsServer>,
}

impl Cluster {
    /// Starts three nodes on `ports` and joins them into one cluster (`redis-cli --cluster
    /// create`, every slot assigned), waiting until each says `cluster_state:ok`.
    pub fn start(ns: &NetNs, announce: std::net::Ipv4Addr, ports: [u16; 3]) -> Cluster {
        Cluster::start_inner(ns, announce, ports, None)
    }

    /// [`Cluster::start`] speaking only TLS, to clients and between nodes (`--tls-cluster
    /// yes`), with the certificates of `tls` (the server's for the address `announce`).
    pub fn start_tls(
        ns: &NetNs,
        announce: std::net::Ipv4Addr,
        ports: [u16; 3],
        tls: &TlsServer,
    ) -> Cluster {
        Cluster::start_inner(ns, announce, ports, Some(tls))
    }

    fn start_inner(
        ns: &NetNs,
        announce: std::net::Ipv4Addr,
        ports: [u16; 3],
        tls: Option<&TlsServer>,
    ) -> Cluster {
        let ip = announce.to_string();
        let nodes: Vec<Redis> = ports
            .iter()
            .map(|&port| {
                Redis::start_full(
                    ns,
                    std::net::IpAddr::V4(announce),
                    port,
                    &[
                        "--tls-cluster",
                        if tls.is_some() { "yes" } else { "no" },
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        "nodes.conf",
                        "--cluster-node-timeout",
                        "2000",
                        // A master lost takes only its own slots out of service, as an
                        // operator running a fleet's store sets it.
                        "--cluster-require-full-coverage",
                        "no",
                        "--cluster-announce-ip",
                        &ip,
                    ],
                    tls.cloned(),
                    None,
                )
            })
            .collect();
        let c = Cluster {
            nodes,
            ns_fd: ns.dup_fd(),
            announce,
            tls: tls.cloned(),
        };
        let mut args: Vec<String> = vec!["--cluster".into(), "create".into()];
        args.extend(ports.iter().map(|p| format!("{ip}:{p}")));
        args.extend(["--cluster-replicas", "0", "--cluster-yes"].map(String::from));
        let out = c.cli_raw(&args);
        assert!(
            out.status.success(),
            "redis-cli --cluster create failed: {}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        for i in 0..3 {
            assert!(
                c.wait_state(i, "ok", READY_TIMEOUT),
                "node {i} not ok: {}\n{}",
                c.cli(i, &["cluster", "info"]),
                c.nodes[i].log()
            );
        }
        c
    }

    /// `redis-cli ARGS`, killed after [`READY_TIMEOUT`] (`--cluster create` waits for the
    /// nodes to agree, which nodes that cannot talk to each other never do).
    fn cli_raw(&self, args: &[String]) -> std::process::Output {
        let mut cmd = command_in_fd(
            self.ns_fd.try_clone().expect("dup netns fd"),
            crate::tool::find_binary("timeout", "coreutils"),
        );
        cmd.args(["-s", "KILL", &READY_TIMEOUT.as_secs().to_string()])
            .arg(cli_binary());
        if let Some(t) = &self.tls {
            tls_args(&mut cmd, t);
        }
        cmd.args(args).stdin(Stdio::null());
        cmd.output()
            .unwrap_or_else(|e| panic!("running `{}`: {e}", describe(&cmd)))
    }

    /// `redis-cli` against node `i` (no redirects followed): its output.
    pub fn cli(&self, i: usize, args: &[&str]) -> String {
        let mut all: Vec<String> = vec![
            "-h".into(),
            self.announce.to_string(),
            "-p".into(),
            self.nodes[i].port().to_string(),
        ];
        all.extend(args.iter().map(|a| a.to_string()));
        let out = self.cli_raw(&all);
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    }

    /// Waits until node `i` reports `cluster_state:<state>`.
    pub fn wait_state(&self, i: usize, state: &str, timeout: Duration) -> bool {
        let want = format!("cluster_state:{state}");
        let give_up = Instant::now() + timeout;
        loop {
            if self.cli(i, &["cluster", "info"]).contains(&want) {
                return true;
            }
            if Instant::now() > give_up {
                return false;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The node serving the slot of the key `key` (the others answer `MOVED`).
    pub fn owner_of(&self, key: &str) -> usize {
        (0..self.nodes.len())
            .find(|&i| {
                let out = self.cli(i, &["exists", key]);
                !out.contains("MOVED") && out.trim().ends_with(['0', '1'])
            })
            .unwrap_or_else(|| panic!("no node serves {key}"))
    }

    /// The nodes' `host:port`s, as a `redis+cluster://` address lists them.
    pub fn url(&self) -> String {
        url("cluster", self.tls.is_some(), self.announce, &self.nodes)
    }

    /// The keys node `i` holds.
    pub fn dbsize(&self, i: usize) -> u64 {
        self.cli(i, &["dbsize"])
            .trim()
            .trim_start_matches("(integer) ")
            .parse()
            .unwrap_or(0)
    }
}

/// A throwaway PKI in a private temp dir (removed on drop): a CA, a server certificate for
/// the given addresses (its subject alternative names; usable as a client's too, as the nodes
/// of a TLS cluster are each other's clients) and a client certificate, both signed by the
/// CA, and another CA that signed neither. Keys are P-256, PKCS#8, mode 0600.
pub struct TlsFiles {
    dir: PathBuf,
}

impl TlsFiles {
    /// Makes every file with `openssl` (panics, saying what failed, if it cannot).
    pub fn generate(server_ips: &[std::net::IpAddr]) -> TlsFiles {
        let files = TlsFiles {
            dir: crate::server::temp_dir(),
        };
        let d = &files.dir;
        let openssl = |args: &[&str]| {
            let mut cmd =
                std::process::Command::new(crate::tool::find_binary("openssl", "openssl"));
            cmd.current_dir(d).args(args).stdin(Stdio::null());
            let out = cmd
                .output()
                .unwrap_or_else(|e| panic!("running `{}`: {e}", describe(&cmd)));
            assert!(
                out.status.success(),
                "`{}` failed: {}",
                describe(&cmd),
                String::from_utf8_lossy(&out.stderr)
            );
        };
        let key = [
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
        ];
        for ca in ["ca", "other-ca"] {
            let mut args = vec!["req", "-x509"];
            args.extend(key);
            let (k, c, subj) = (
                format!("{ca}.key"),
                format!("{ca}.crt"),
                format!("/CN=ratelimit test {ca}"),
            );
            args.extend(["-keyout", &k, "-out", &c, "-days", "2", "-subj", &subj]);
            openssl(&args);
        }
        let san: Vec<String> = server_ips.iter().map(|ip| format!("IP:{ip}")).collect();
        for (name, usage, san) in [
            ("server", "serverAuth,clientAuth", san.join(",")),
            ("client", "clientAuth", String::new()),
        ] {
            let (k, csr, c, ext) = (
                format!("{name}.key"),
                format!("{name}.csr"),
                format!("{name}.crt"),
                format!("{name}.ext"),
            );
            let mut args = vec!["req"];
            args.extend(key);
            let subj = format!("/CN=ratelimit test {name}");
            args.extend(["-keyout", &k, "-out", &csr, "-subj", &subj]);
            openssl(&args);
            let mut text = format!(
                "basicConstraints=CA:FALSE\nkeyUsage=digitalSignature\nextendedKeyUsage={usage}\n"
            );
            if !san.is_empty() {
                text.push_str(&format!("subjectAltName={san}\n"));
            }
            std::fs::write(d.join(&ext), text).expect("writing the extensions");
            openssl(&[
                "x509",
                "-req",
                "-in",
                &csr,
                "-CA",
                "ca.crt",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-out",
                &c,
                "-days",
                "2",
                "-extfile",
                &ext,
            ]);
        }
        for k in ["ca.key", "other-ca.key", "server.key", "client.key"] {
            use std::os::unix::fs::PermissionsExt as _;
            std::fs::set_permissions(d.join(k), std::fs::Permissions::from_mode(0o600))
                .expect("chmod 600");
        }
        files
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// The CA that signed the server's and the client's certificates.
    pub fn ca(&self) -> PathBuf {
        self.path("ca.crt")
    }

    /// A CA that signed neither.
    pub fn other_ca(&self) -> PathBuf {
        self.path("other-ca.crt")
    }

    pub fn client_cert(&self) -> PathBuf {
        self.path("client.crt")
    }

    pub fn client_key(&self) -> PathBuf {
        self.path("client.key")
    }

    /// A server's settings with these files.
    pub fn server(&self, auth_clients: bool) -> TlsServer {
        TlsServer {
            ca: self.ca(),
            cert: self.path("server.crt"),
            key: self.path("server.key"),
            client_cert: self.client_cert(),
            client_key: self.client_key(),
            auth_clients,
        }
    }
}

impl Drop for TlsFiles {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The master's name the sentinels watch.
pub const SENTINEL_MASTER: &str = "fleet";

/// A master, one replica of it and three sentinels (quorum 2) in a lab namespace, every one
/// on the address `ip` (on the namespace's loopback, put there by the caller) at its own
/// port. The sentinels judge the master down after 500 ms without an answer
/// (`down-after-milliseconds`) and give a failover 3 s (`failover-timeout`). Dropping it
/// kills every process.
pub struct Sentinels {
    pub sentinels: Vec<Redis>,
    pub master: Redis,
    pub replica: Redis,
    ip: std::net::Ipv4Addr,
    /// Every one speaks only TLS (`rediss+sentinel://`).
    tls: bool,
}

/// Passwords and TLS for [`Sentinels::start_secured`]; the default has neither.
#[derive(Clone, Debug, Default)]
pub struct SentinelSecurity {
    /// The master's and the replica's password.
    pub password: Option<String>,
    /// The sentinels' own password.
    pub sentinel_password: Option<String>,
    pub tls: Option<TlsServer>,
}

impl Sentinels {
    /// `ports`: the master's, the replica's, then the three sentinels'. Waits until the
    /// replica is in sync and every sentinel knows the replica and the two other sentinels.
    pub fn start(ns: &NetNs, ip: std::net::Ipv4Addr, ports: [u16; 5]) -> Sentinels {
        Sentinels::start_secured(ns, ip, ports, &SentinelSecurity::default())
    }

    /// [`Sentinels::start`] with passwords and TLS: `security.password` on the master and
    /// the replica (`requirepass`, `masterauth`; the sentinels' `auth-pass`),
    /// `security.sentinel_password` on the sentinels (`requirepass`, and `sentinel-pass`
    /// between them), and every one speaking only TLS with `security.tls` (replication, and
    /// the sentinels' links, too).
    pub fn start_secured(
        ns: &NetNs,
        ip: std::net::Ipv4Addr,
        ports: [u16; 5],
        security: &SentinelSecurity,
    ) -> Sentinels {
        let at = std::net::IpAddr::V4(ip);
        let ips = ip.to_string();
        let tls = security.tls.as_ref();
        let pw = security.password.as_deref();
        let mut common: Vec<&str> = vec!["--replica-announce-ip", &ips];
        if tls.is_some() {
            common.extend(["--tls-replication", "yes"]);
        }
        if let Some(pw) = pw {
            common.extend(["--masterauth", pw]);
        }
        let master = Redis::start_secured(ns, at, ports[0], &common, tls, pw);
        let master_port = ports[0].to_string();
        let mut replica_args = vec!["--replicaof", &ips, &master_port];
        replica_args.extend(&common);
        let replica = Redis::start_secured(ns, at, ports[1], &replica_args, tls, pw);
        let give_up = Instant::now() + READY_TIMEOUT;
        while !replica
            .cli(&["info", "replication"])
            .contains("master_link_status:up")
        {
            assert!(
                Instant::now() < give_up,
                "the replica never synced: {}\n{}",
                replica.cli(&["info", "replication"]),
                replica.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        let mut conf = format!(
            "sentinel monitor {SENTINEL_MASTER} {ip} {} 2\n\
             sentinel down-after-milliseconds {SENTINEL_MASTER} 500\n\
             sentinel failover-timeout {SENTINEL_MASTER} 3000\n\
             sentinel parallel-syncs {SENTINEL_MASTER} 1\n\
             sentinel announce-ip {ip}\n",
            ports[0]
        );
        if let Some(pw) = pw {
            conf.push_str(&format!("sentinel auth-pass {SENTINEL_MASTER} {pw}\n"));
        }
        let spw = security.sentinel_password.as_deref();
        if let Some(spw) = spw {
            conf.push_str(&format!(
                "requirepass {spw}\nsentinel sentinel-pass {spw}\n"
            ));
        }
        let sentinels: Vec<Redis> = ports[2..]
            .iter()
            .map(|&p| Redis::start_sentinel_secured(ns, at, p, &conf, tls, spw))
            .collect();
        let s = Sentinels {
            sentinels,
            master,
            replica,
            ip,
            tls: tls.is_some(),
        };
        // Sentinels find each other through the master every 2 s (hello messages).
        for (i, sn) in s.sentinels.iter().enumerate() {
            loop {
                let out = sn.cli(&["sentinel", "master", SENTINEL_MASTER]);
                if field(&out, "num-slaves") == Some(1)
                    && field(&out, "num-other-sentinels") == Some(2)
                {
                    break;
                }
                assert!(
                    Instant::now() < give_up,
                    "sentinel {i} does not see the replica and the other sentinels: {out}\n{}",
                    sn.log()
                );
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        s
    }

    /// `redis+sentinel://IP:PORT,IP:PORT,IP:PORT/NAME`.
    pub fn url(&self) -> String {
        let nodes = url("sentinel", self.tls, self.ip, &self.sentinels);
        format!("{nodes}/{SENTINEL_MASTER}")
    }

    /// The master's port as sentinel `i` names it.
    pub fn master_port(&self, i: usize) -> Option<u16> {
        let out = self.sentinels[i].cli(&["sentinel", "get-master-addr-by-name", SENTINEL_MASTER]);
        out.lines().nth(1)?.trim().parse().ok()
    }
}

/// `redis[s]+KIND://IP:PORT,...`: the address of `servers`, every one on `ip`.
fn url(kind: &str, tls: bool, ip: std::net::Ipv4Addr, servers: &[Redis]) -> String {
    let hosts: Vec<String> = servers
        .iter()
        .map(|s| format!("{ip}:{}", s.port()))
        .collect();
    let scheme = if tls { "rediss" } else { "redis" };
    format!("{scheme}+{kind}://{}", hosts.join(","))
}

/// The value after the line `name` in `redis-cli`'s output of a flat array (a number).
fn field(out: &str, name: &str) -> Option<u64> {
    let mut lines = out.lines();
    lines.find(|l| l.trim() == name)?;
    lines.next()?.trim().parse().ok()
}
