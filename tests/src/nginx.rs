//! A real nginx serving a small static file in a lab namespace: the web server an operator
//! puts behind the rate limiter, with its own listen queue, accept loop and workers.
//!
//! The guard owns the master process and a private temp dir (the generated `nginx.conf`, the
//! document root, the pid file, the error log, nginx's temp paths). nginx runs in the
//! foreground (`daemon off`), so the child is the master; on drop the guard asks it for a fast
//! shutdown (SIGTERM), which takes the workers with it, and kills master and workers (their
//! pids read before) if it does not exit in time; then it removes the dir, also when a test
//! panics, and prints the error log on a panic. No system nginx is involved: the config names
//! every path the server writes, and the listen address is the lab's.

use std::fs::{File, OpenOptions};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::{AsFd as _, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use crate::netns::{NetNs, command_in_fd, describe, in_netns};
use crate::tool::{find_binary, terminate};

/// How long [`Nginx::start`] waits for the server to accept a connection.
pub const READY_TIMEOUT: Duration = Duration::from_secs(20);
/// How long a stop waits after SIGTERM before SIGKILL.
pub const STOP_TIMEOUT: Duration = Duration::from_secs(5);

/// The file [`Nginx`] serves, under `/`.
pub const INDEX: &str = "index.html";

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
    child: Option<Child>,
    dir: PathBuf,
    ns_fd: OwnedFd,
    addr: SocketAddr,
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
        let dir = crate::daemon::make_temp_dir();
        // The guard exists from here on, so the dir is removed even on panic.
        let mut n = Nginx {
            child: None,
            dir,
            ns_fd: ns.dup_fd(),
            addr: listen,
        };
        let www = n.dir.join("www");
        let tmp = n.dir.join("tmp");
        for d in [&www, &tmp] {
            std::fs::create_dir(d).unwrap_or_else(|e| panic!("creating {}: {e}", d.display()));
        }
        let page: String = "ratelimit lab\n".chars().cycle().take(body).collect();
        std::fs::write(www.join(INDEX), page).expect("writing the index file");
        let d = n.dir.display();
        let config = n.dir.join("nginx.conf");
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
        let log = n.log_file();
        let mut cmd = command_in_fd(n.ns_fd.try_clone().expect("dup netns fd"), &bin);
        cmd.arg("-p")
            .arg(&n.dir)
            .arg("-c")
            .arg(&config)
            .arg("-e")
            .arg(n.dir.join("error.log"))
            .current_dir(&n.dir)
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("dup log file"))
            .stderr(log);
        n.child = Some(
            cmd.spawn()
                .unwrap_or_else(|e| panic!("starting `{}`: {e}", describe(&cmd))),
        );
        if let Err(e) = n.wait_ready(READY_TIMEOUT) {
            panic!("nginx did not become ready: {e}\n{}", n.log());
        }
        n
    }

    fn log_file(&self) -> File {
        let path = self.dir.join("error.log");
        OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .unwrap_or_else(|e| panic!("opening {}: {e}", path.display()))
    }

    /// The server's error log so far (and what it printed).
    pub fn log(&self) -> String {
        let path = self.dir.join("error.log");
        format!(
            "----- nginx error log ({}) -----\n{}\n----- end of nginx error log -----",
            path.display(),
            std::fs::read_to_string(&path).unwrap_or_else(|e| format!("({e})"))
        )
    }

    /// The server's temp dir (config, document root, logs; removed on drop).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The address the server listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    fn wait_ready(&mut self, timeout: Duration) -> Result<(), String> {
        let give_up = Instant::now() + timeout;
        loop {
            if let Some(child) = self.child.as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                self.child = None;
                return Err(format!("nginx exited during startup ({status})"));
            }
            let addr = self.addr;
            let last = in_netns(self.ns_fd.as_fd(), move || {
                TcpStream::connect_timeout(&addr, Duration::from_secs(1)).map(drop)
            });
            match last {
                Ok(()) => return Ok(()),
                Err(e) if Instant::now() >= give_up => {
                    return Err(format!("no connection to {addr} within {timeout:?}: {e}"));
                }
                Err(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        }
    }

    /// Pids of the master's children (the workers), from `/proc`.
    fn workers(&self) -> Vec<libc::pid_t> {
        let Some(pid) = self.child.as_ref().map(Child::id) else {
            return Vec::new();
        };
        std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
            .unwrap_or_default()
            .split_whitespace()
            .filter_map(|p| p.parse().ok())
            .collect()
    }

    /// SIGTERM (nginx's fast shutdown: the master stops its workers and exits), then SIGKILL
    /// to master and workers after [`STOP_TIMEOUT`].
    pub fn stop(&mut self) {
        let workers = self.workers();
        let Some(mut child) = self.child.take() else {
            return;
        };
        if terminate(&mut child, STOP_TIMEOUT) {
            return;
        }
        eprintln!("nginx ignored SIGTERM for {STOP_TIMEOUT:?}: SIGKILL to it and its workers");
        for w in workers {
            // SAFETY: kill(2); the workers are children of our unreaped child, so their pids
            // cannot have been reused while it lives.
            unsafe { libc::kill(w, libc::SIGKILL) };
        }
        let _ = child.kill();
        let _ = child.wait();
    }
}

impl Drop for Nginx {
    fn drop(&mut self) {
        self.stop();
        if std::thread::panicking() {
            eprintln!("{}", self.log());
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A running `hping3` in a lab namespace: a real SYN flood tool, stopped on drop.
///
/// Its output (the statistics it prints when stopped) goes to a file in a private temp dir,
/// read by [`Hping3::stop`] and removed on drop.
#[derive(Debug)]
pub struct Hping3 {
    child: Option<Child>,
    dir: PathBuf,
    output: String,
}

impl Hping3 {
    /// `hping3 ARGS...` in `ns`, started now (e.g. `-S -p 80 --rand-source --flood -q -I IF
    /// TARGET`). The caller bounds it in time: [`Hping3::stop`], or the drop, ends it.
    ///
    /// # Panics
    ///
    /// If the binary is missing or cannot be started.
    pub fn start(ns: &NetNs, args: &[&str]) -> Hping3 {
        let bin = find_binary("hping3", "hping3");
        let dir = crate::daemon::make_temp_dir();
        let mut h = Hping3 {
            child: None,
            dir,
            output: String::new(),
        };
        let out = File::create(h.dir.join("hping3.out")).expect("creating hping3's output file");
        let mut cmd = ns.command_in(&bin);
        cmd.args(args)
            .stdin(Stdio::null())
            .stdout(out.try_clone().expect("dup output file"))
            .stderr(out);
        h.child = Some(
            cmd.spawn()
                .unwrap_or_else(|e| panic!("starting `{}`: {e}", describe(&cmd))),
        );
        h
    }

    /// Stops it (SIGINT, on which hping3 prints its statistics; SIGKILL after a second) and
    /// returns the number of packets it says it transmitted (None if it printed none).
    pub fn stop(&mut self) -> Option<u64> {
        if let Some(mut child) = self.child.take() {
            if let Ok(pid) = libc::pid_t::try_from(child.id()) {
                // SAFETY: kill(2) on our own unreaped child's pid, which cannot be reused.
                unsafe { libc::kill(pid, libc::SIGINT) };
            }
            let give_up = Instant::now() + Duration::from_secs(1);
            loop {
                if let Ok(Some(_)) = child.try_wait() {
                    break;
                }
                if Instant::now() >= give_up {
                    let _ = child.kill();
                    let _ = child.wait();
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            self.output = std::fs::read_to_string(self.dir.join("hping3.out")).unwrap_or_default();
        }
        transmitted(&self.output)
    }

    /// What it printed (after [`Hping3::stop`]).
    pub fn output(&self) -> &str {
        &self.output
    }
}

impl Drop for Hping3 {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
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
