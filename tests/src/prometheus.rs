//! A real Prometheus server scraping the daemon, run in a lab namespace: what an operator's
//! monitoring reads back, through Prometheus' own parser, storage and PromQL rather than the
//! lab's reading of the exposition.
//!
//! Its [`Server`] guard owns the process and a private temp dir (the generated `prometheus.yml`, the
//! TSDB, the server's log). On drop it stops the server and removes the dir, also when a test
//! panics, and then prints the log, which is what a failed scrape is debugged with.
//!
//! The server runs in the namespace of the daemon it scrapes and listens on that namespace's
//! loopback: it reaches the daemon's `http_listen` there, never uses a host port, and no
//! system Prometheus (the Debian package's service, on 9090) can answer in its place.

use std::collections::BTreeMap;
use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::netns::NetNs;
use crate::server::{Server, Spec};

/// How long [`Prometheus::start`] waits for the server to say it is ready.
pub const READY_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a stop waits after SIGTERM before SIGKILL.
pub const STOP_TIMEOUT: Duration = Duration::from_secs(10);
/// How often the server scrapes its targets (`scrape_interval`).
pub const SCRAPE_INTERVAL: Duration = Duration::from_secs(1);
/// Upper bound on one request to the server's HTTP API.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// Prometheus as the lab runs it: stopped by SIGTERM, its log printed when a test fails.
const SPEC: Spec = Spec::new("prometheus", "prometheus.log")
    .ready_within(READY_TIMEOUT, Duration::from_millis(100))
    .stopped_by(libc::SIGTERM, STOP_TIMEOUT);

/// The `prometheus` binary on `PATH` (or in /usr/sbin).
///
/// # Panics
///
/// If there is none, saying how to install it: under `cargo xtask test` a test that cannot
/// run its server has nothing to test, and must not pass.
pub fn binary() -> PathBuf {
    crate::tool::find_binary("prometheus", "prometheus")
}

/// One series of a PromQL instant vector: its labels and value.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    pub labels: BTreeMap<String, String>,
    pub value: f64,
}

/// A running `prometheus` in a lab namespace, with its own temp dir.
#[derive(Debug)]
pub struct Prometheus {
    server: Server,
}

impl Prometheus {
    /// Starts `prometheus` in `ns`, serving its API on `listen` (a loopback address in `ns`)
    /// and scraping `targets` (addresses as seen from `ns`, path `/metrics`) every
    /// [`SCRAPE_INTERVAL`] as job `ratelimit`, and waits until it is ready.
    ///
    /// # Panics
    ///
    /// If the binary is missing (see [`binary`]), or the server exits or is not ready within
    /// [`READY_TIMEOUT`] (the message includes its log).
    pub fn start(ns: &NetNs, listen: SocketAddr, targets: &[SocketAddr]) -> Prometheus {
        let bin = binary();
        // The guard exists from here on, so the dir is removed even on panic.
        let mut server = Server::listening(SPEC, ns, listen);
        let targets: Vec<String> = targets.iter().map(|t| format!("\"{t}\"")).collect();
        let config = server.path("prometheus.yml");
        let secs = SCRAPE_INTERVAL.as_secs();
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: {secs}s\n  scrape_timeout: {secs}s\n\
                 scrape_configs:\n  - job_name: ratelimit\n    static_configs:\n      \
                 - targets: [{}]\n",
                targets.join(", ")
            ),
        )
        .unwrap_or_else(|e| panic!("writing {}: {e}", config.display()));
        let mut cmd = server.command(&bin);
        cmd.arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                server.path("data").display()
            ))
            .arg(format!("--web.listen-address={listen}"));
        server.launch(cmd, |server| match get(server, "/-/ready") {
            Ok((200, _)) => Ok(()),
            Ok((code, body)) => Err(format!("/-/ready answered {code}: {}", body.trim())),
            Err(e) => Err(e),
        });
        Prometheus { server }
    }

    /// The server's log so far.
    pub fn log(&self) -> String {
        self.server.log()
    }

    /// The server's temp dir (config, TSDB, log; removed on drop).
    pub fn dir(&self) -> &Path {
        self.server.dir()
    }

    /// `GET path` from the server (see [`get`]).
    fn get(&self, path: &str) -> Result<(u16, String), String> {
        get(&self.server, path)
    }

    /// The instant vector of `promql` at the server's now (`/api/v1/query`).
    ///
    /// # Panics
    ///
    /// If the request or the query fails, or the result is not a vector.
    pub fn query(&self, promql: &str) -> Vec<Sample> {
        let path = format!("/api/v1/query?query={}", percent_encode(promql));
        let (status, body) = self
            .get(&path)
            .unwrap_or_else(|e| panic!("query {promql:?}: {e}\n{}", self.log()));
        let v: serde_json::Value = serde_json::from_str(&body)
            .unwrap_or_else(|e| panic!("query {promql:?}: answer is not JSON ({e}): {body}"));
        assert!(
            status == 200 && v["status"] == "success",
            "query {promql:?} failed ({status}): {body}"
        );
        assert_eq!(
            v["data"]["resultType"], "vector",
            "query {promql:?}: {body}"
        );
        v["data"]["result"]
            .as_array()
            .unwrap_or_else(|| panic!("query {promql:?}: no result list: {body}"))
            .iter()
            .map(|r| Sample {
                labels: r["metric"]
                    .as_object()
                    .into_iter()
                    .flatten()
                    .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_string()))
                    .collect(),
                value: r["value"][1]
                    .as_str()
                    .and_then(|s| s.parse().ok())
                    .unwrap_or_else(|| panic!("query {promql:?}: no value in {r}")),
            })
            .collect()
    }

    /// The value of a query whose result is one series without labels (a `sum(...)`, say);
    /// None when the result is empty (nothing matched).
    ///
    /// # Panics
    ///
    /// As [`Prometheus::query`], and if the result has more than one series.
    pub fn value(&self, promql: &str) -> Option<f64> {
        let r = self.query(promql);
        assert!(
            r.len() <= 1,
            "query {promql:?}: more than one series: {r:?}"
        );
        r.first().map(|s| s.value)
    }

    /// Waits until the server holds a sample of `metric` from a scrape that started after
    /// `after`: a scrape of counters that were read once everything before `after` had
    /// been counted.
    ///
    /// # Panics
    ///
    /// If there is none within `timeout`, with the scrape's state and the server's log.
    pub fn wait_for_scrape_after(&self, metric: &str, after: SystemTime, timeout: Duration) {
        let after = after
            .duration_since(UNIX_EPOCH)
            .expect("after the epoch")
            .as_secs_f64();
        let give_up = Instant::now() + timeout;
        let mut last = None;
        loop {
            // The time of the latest sample (the scrape's start), in Unix seconds.
            last = self.value(&format!("timestamp({metric})")).or(last);
            if last.is_some_and(|t| t > after) {
                return;
            }
            if Instant::now() >= give_up {
                let targets = self.get("/api/v1/targets").map(|(_, body)| body);
                panic!(
                    "prometheus has no sample of {metric} scraped after {after:.3} within \
                     {timeout:?} (latest: {last:?}); targets: {targets:?}\n{}",
                    self.log()
                );
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// SIGTERM, then SIGKILL after [`STOP_TIMEOUT`].
    pub fn stop(&mut self) {
        self.server.stop();
    }
}

/// `GET path` from `server`, from inside its namespace: (status, body).
fn get(server: &Server, path: &str) -> Result<(u16, String), String> {
    let addr = server.addr();
    let path = path.to_string();
    server.in_netns(move || -> Result<(u16, String), String> {
        let mut c = TcpStream::connect_timeout(&addr, REQUEST_TIMEOUT)
            .map_err(|e| format!("connecting to prometheus at {addr}: {e}"))?;
        c.set_read_timeout(Some(REQUEST_TIMEOUT))
            .and_then(|()| c.set_write_timeout(Some(REQUEST_TIMEOUT)))
            .map_err(|e| e.to_string())?;
        // HTTP/1.0: the answer comes whole, not chunked, and the server closes after it.
        write!(c, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n")
            .map_err(|e| format!("GET {path}: {e}"))?;
        let mut raw = String::new();
        c.read_to_string(&mut raw)
            .map_err(|e| format!("GET {path}: reading the answer: {e}"))?;
        let (head, body) = raw
            .split_once("\r\n\r\n")
            .ok_or_else(|| format!("GET {path}: no end of headers in {raw:?}"))?;
        let status = head
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| format!("GET {path}: no status in {head:?}"))?;
        Ok((status, body.to_string()))
    })
}

/// `s` as a URL query value: every byte but the unreserved ones percent-encoded.
fn percent_encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                char::from(b).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn promql_is_percent_encoded() {
        assert_eq!(
            percent_encode(r#"sum by (verdict) (x{a=~"b.*"})"#),
            "sum%20by%20%28verdict%29%20%28x%7Ba%3D~%22b.%2A%22%7D%29"
        );
    }
}
