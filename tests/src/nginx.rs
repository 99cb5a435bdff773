//! A real nginx serving a small static file in a lab namespace: the web server an operator
//! puts behind the rate limiter, with its own listen queue, accept loop and workers.
//!
//! Its [`Server`] guard owns the master process and a private temp dir (the generated
//! `nginx.conf`, the document root, the pid file, the error log, nginx's temp paths). nginx
//! runs in the foreground (`daemon off`), so the child is the master; on drop the guard asks it
//! for a fast shutdown (SIGTERM), which takes the workers with it, and kills master and workers
//! (their pids read before) if it does not exit in time; then it removes the dir, also when a
//! test panics, and prints the error log on a panic. No system nginx is involved: the config
//! names every path the server writes, and the listen address is the lab's.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::netns::NetNs;
use crate::server::{Server, Spec};
use crate::tool::find_binary;

/// How long [`Nginx::start`] waits for the server to accept a connection.
pub const READY_TIMEOUT: Duration = Duration::from_secs(20);
/// How long a stop waits after SIGTERM before SIGKILL.
pub const STOP_TIMEOUT: Duration = Duration::from_secs(5);

/// The file [`Nginx`] serves, under `/`.
pub const INDEX: &str = "index.html";

/// nginx as the lab runs it: stopped by SIGTERM (a fast shutdown, which takes the workers
/// with it), its error log printed when a test fails.
const SPEC: Spec = Spec::new("nginx", "error.log")
    .ready_within(READY_TIMEOUT, Duration::from_millis(50))
    .stopped_by(libc::SIGTERM, STOP_TIMEOUT);

/// The `nginx` binary on `PATH` or in `/usr/sbin`.
///
/// # Panics
///
/// If there is none, saying how to install it.
pub fn binary() -> PathBuf {
    find_binary("nginx", "nginx-light")
}

/// A running nginx in a lab namespace, with its own temp dir.
#[derive(Debug)]
pub struct Nginx {
    server: Server,
}

impl Nginx {
    /// Starts nginx in `ns` listening on `listen` (an address of `ns`) with `workers` worker
    /// processes and the default listen backlog, serving [`INDEX`] (`body` bytes of text), and
    /// waits until it accepts a connection.
    ///
    /// # Panics
    ///
    /// If the binary is missing (see [`binary`]), the config is refused, or the server exits
    /// or does not accept within [`READY_TIMEOUT`] (the message includes its error log).
    pub fn start(ns: &NetNs, listen: SocketAddr, workers: u32, body: usize) -> Nginx {
        let bin = binary();
        // The guard exists from here on, so the dir is removed even on panic.
        let mut server = Server::listening(SPEC, ns, listen);
        let www = server.path("www");
        let tmp = server.path("tmp");
        for d in [&www, &tmp] {
            std::fs::create_dir(d).unwrap_or_else(|e| panic!("creating {}: {e}", d.display()));
        }
        let page: String = "ratelimit lab\n".chars().cycle().take(body).collect();
        std::fs::write(www.join(INDEX), page).expect("writing the index file");
        let d = server.dir().display();
        let config = server.path("nginx.conf");
        // `user root`: the temp dir is 0700, and the workers serve files from it.
        std::fs::write(
            &config,
            format!(
                "user root;\nworker_processes {workers};\ndaemon off;\npid {d}/nginx.pid;\n\
                 error_log {d}/error.log warn;\n\
                 events {{ worker_connections 4096; }}\n\
                 http {{\n  access_log off;\n  client_body_temp_path {d}/tmp/body;\n  \
                 proxy_temp_path {d}/tmp/proxy;\n  fastcgi_temp_path {d}/tmp/fastcgi;\n  \
                 uwsgi_temp_path {d}/tmp/uwsgi;\n  scgi_temp_path {d}/tmp/scgi;\n  \
                 keepalive_timeout 10s;\n  \
                 server {{\n    listen {listen};\n    root {www};\n    \
                 location / {{ }}\n  }}\n}}\n",
                www = www.display(),
            ),
        )
        .unwrap_or_else(|e| panic!("writing {}: {e}", config.display()));
        let mut cmd = server.command(&bin);
        cmd.arg("-p")
            .arg(server.dir())
            .arg("-c")
            .arg(&config)
            .arg("-e")
            .arg(server.path("error.log"));
        server.launch(cmd, Server::connects);
        Nginx { server }
    }

    /// The server's error log so far (and what it printed).
    pub fn log(&self) -> String {
        self.server.log()
    }

    /// The server's temp dir (config, document root, logs; removed on drop).
    pub fn dir(&self) -> &Path {
        self.server.dir()
    }

    /// The address the server listens on.
    pub fn addr(&self) -> SocketAddr {
        self.server.addr()
    }

    /// SIGTERM (nginx's fast shutdown: the master stops its workers and exits), then SIGKILL
    /// to master and workers after [`STOP_TIMEOUT`].
    pub fn stop(&mut self) {
        self.server.stop();
    }
}

/// A running `hping3` in a lab namespace: a real SYN flood tool, stopped on drop.
///
/// Its output (the statistics it prints when stopped) goes to a file in a private temp dir,
/// read by [`Hping3::stop`] and removed on drop.
#[derive(Debug)]
pub struct Hping3 {
    server: Server,
    output: String,
}

/// hping3 as the lab runs it: SIGINT stops it (and makes it print its statistics), SIGKILL a
/// second later.
const HPING3: Spec = Spec::new("hping3", "hping3.out")
    .stopped_by(libc::SIGINT, Duration::from_secs(1))
    .quiet();

impl Hping3 {
    /// `hping3 ARGS...` in `ns`, started now (e.g. `-S -p 80 --rand-source --flood -q -I IF
    /// TARGET`). The caller bounds it in time: [`Hping3::stop`], or the drop, ends it.
    ///
    /// # Panics
    ///
    /// If the binary is missing or cannot be started.
    pub fn start(ns: &NetNs, args: &[&str]) -> Hping3 {
        let bin = find_binary("hping3", "hping3");
        let mut server = Server::new(HPING3, ns);
        let mut cmd = server.command(&bin);
        cmd.args(args);
        server.spawn(cmd);
        Hping3 {
            server,
            output: String::new(),
        }
    }

    /// Stops it (SIGINT, on which hping3 prints its statistics; SIGKILL after a second) and
    /// returns the number of packets it says it transmitted (None if it printed none).
    pub fn stop(&mut self) -> Option<u64> {
        if self.server.pid().is_some() {
            self.server.stop();
            self.output = std::fs::read_to_string(self.server.path(HPING3.log)).unwrap_or_default();
        }
        transmitted(&self.output)
    }

    /// What it printed (after [`Hping3::stop`]).
    pub fn output(&self) -> &str {
        &self.output
    }
}

/// N from hping3's "N packets transmitted, ..." line.
fn transmitted(output: &str) -> Option<u64> {
    output.lines().find_map(|l| {
        l.split_once(" packets transmitted")
            .and_then(|(n, _)| n.trim().parse().ok())
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn hping3_statistics_are_read() {
        let out = "HPING 198.18.1.2 (a 198.18.1.2): S set, 40 headers + 0 data bytes\n\
                   hping in flood mode, no replies will be shown\n\n\
                   --- 198.18.1.2 hping statistic ---\n\
                   344212 packets transmitted, 0 packets received, 100% packet loss\n";
        assert_eq!(super::transmitted(out), Some(344_212));
        assert_eq!(super::transmitted("nothing"), None);
    }
}
