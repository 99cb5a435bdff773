//! A real DNS server (dnsmasq, Debian's `dnsmasq-base`) in a lab namespace, answering on
//! several addresses with records of its own, and the two sides of a DNS exchange as the labs
//! need them: a query's bytes, and a lookup made through a real socket.
//!
//! Its [`Server`] guard owns the process and a private temp dir (pid file, log); dnsmasq runs
//! in the foreground with no config file, no upstream and no hosts file: it answers only the
//! records given on its command line, and nothing on the machine is read or changed.

use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::sync::atomic::{AtomicU16, Ordering};
use std::time::{Duration, Instant};

use crate::netns::NetNs;
use crate::server::{Server, Spec};
use crate::tool::find_binary;

/// A name with a large answer: [`TXT_RECORDS`] TXT records of 250 bytes each (a response of
/// about 800 bytes: what reflection attacks ask for).
pub const BIG: &str = "big.lab.test";
pub const TXT_RECORDS: usize = 3;
/// The size of each TXT string of [`BIG`].
const TXT_LEN: usize = 250;

const SPEC: Spec = Spec::new("dnsmasq", "dnsmasq.log")
    .ready_within(Duration::from_secs(20), Duration::from_millis(50))
    .stopped_by(libc::SIGTERM, Duration::from_secs(5));

/// A running dnsmasq in a lab namespace.
#[derive(Debug)]
pub struct Dnsmasq {
    server: Server,
    addrs: Vec<IpAddr>,
}

impl Dnsmasq {
    /// Starts dnsmasq in `ns` answering on port 53 of each of `addrs` (addresses of `ns`),
    /// with the records of [`BIG`], and waits until the first answers a lookup.
    ///
    /// # Panics
    ///
    /// If the binary is missing, or the server exits or does not answer in time (the message
    /// has its log).
    pub fn start(ns: &NetNs, addrs: &[IpAddr]) -> Dnsmasq {
        let bin = find_binary("dnsmasq", "dnsmasq-base");
        let mut server = Server::new(SPEC, ns);
        let mut cmd = server.command(&bin);
        cmd.arg("--keep-in-foreground")
            .arg("--conf-file=/dev/null")
            .arg("--no-resolv")
            .arg("--no-hosts")
            .arg("--no-poll")
            .arg("--bind-interfaces")
            .arg("--port=53")
            .arg("--user=root")
            .arg("--cache-size=0")
            .arg(format!(
                "--pid-file={}",
                server.path("dnsmasq.pid").display()
            ))
            .arg(format!(
                "--log-facility={}",
                server.path(SPEC.log).display()
            ));
        for a in addrs {
            cmd.arg(format!("--listen-address={a}"));
        }
        for i in 0..TXT_RECORDS {
            let text: String = std::iter::repeat_n((b'a' + i as u8) as char, TXT_LEN).collect();
            cmd.arg(format!("--txt-record={BIG},{text}"));
        }
        let first = SocketAddr::new(addrs[0], 53);
        server.launch(cmd, |s| {
            s.in_netns(|| lookup(first, BIG, Duration::from_millis(500)).map(drop))
        });
        Dnsmasq {
            server,
            addrs: addrs.to_vec(),
        }
    }

    /// The addresses it answers on.
    pub fn addrs(&self) -> &[IpAddr] {
        &self.addrs
    }

    /// What it logged.
    pub fn log(&self) -> String {
        self.server.log()
    }
}

/// A TXT query for `name` with id `id` (recursion desired), as on the wire, with an EDNS0
/// record offering 4096-byte answers (without one, an answer over 512 bytes comes truncated;
/// reflection attacks offer the most they can).
pub fn query(id: u16, name: &str) -> Vec<u8> {
    let mut q = Vec::with_capacity(29 + name.len());
    q.extend_from_slice(&id.to_be_bytes());
    // RD; one question, one additional record.
    q.extend_from_slice(&[0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 1]);
    for label in name.split('.') {
        q.push(label.len() as u8);
        q.extend_from_slice(label.as_bytes());
    }
    // The root, type TXT (16), class IN.
    q.extend_from_slice(&[0, 0, 16, 0, 1]);
    // OPT: the root, type 41, the UDP payload size in the class, no extended flags, no data.
    q.extend_from_slice(&[0, 0, 41, 0x10, 0x00, 0, 0, 0, 0, 0, 0]);
    q
}

/// One lookup of `name` from the caller's namespace: a query from an ephemeral port to
/// `server`, and its answer (the response's bytes) if one with the query's id and no error
/// came within `timeout`.
pub fn lookup(server: SocketAddr, name: &str, timeout: Duration) -> Result<Vec<u8>, String> {
    let bind: SocketAddr = match server {
        SocketAddr::V4(_) => "0.0.0.0:0".parse().unwrap(),
        SocketAddr::V6(_) => "[::]:0".parse().unwrap(),
    };
    let sock = UdpSocket::bind(bind).map_err(|e| format!("bind: {e}"))?;
    static NEXT: AtomicU16 = AtomicU16::new(1);
    let id = NEXT.fetch_add(1, Ordering::Relaxed);
    sock.send_to(&query(id, name), server)
        .map_err(|e| format!("send: {e}"))?;
    let deadline = Instant::now() + timeout;
    let mut buf = [0u8; 4096];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(format!("no answer from {server} within {timeout:?}"));
        }
        sock.set_read_timeout(Some(left))
            .map_err(|e| e.to_string())?;
        match sock.recv_from(&mut buf) {
            Ok((n, from)) if from == server && n >= 12 && buf[..2] == id.to_be_bytes() => {
                if buf[3] & 0x0f != 0 {
                    return Err(format!("{server} answered with rcode {}", buf[3] & 0x0f));
                }
                return Ok(buf[..n].to_vec());
            }
            Ok(_) => continue,
            Err(e) => return Err(format!("no answer from {server}: {e}")),
        }
    }
}
