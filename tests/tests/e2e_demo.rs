//! The demo (`cargo xtask demo` execs the `ratelimit-demo` binary) ended the ways a demo ends
//! besides Ctrl-C: SIGTERM to its process group (as `timeout` and CI runners send it), a closed
//! terminal (SIGHUP, and output to the hung-up terminal failing), and SIGKILL, after which the
//! next run removes what the killed one left. Each test runs the real demo binary until its lab
//! is up, ends it, and checks that no namespace, bpffs directory, temp dir or daemon of that
//! run is left.

use std::{
    io::{BufRead as _, BufReader, Read},
    os::{
        fd::{FromRawFd as _, OwnedFd},
        unix::process::{CommandExt as _, ExitStatusExt as _},
    },
    process::{Child, Command, ExitStatus, Stdio},
    sync::mpsc,
    time::{Duration, Instant},
};

use ratelimit_tests::{kernel_test, leftovers::Leftovers};

/// The tag the demo gives its lab (`Scenario::new`).
const DEMO_TAG: &str = "rldemo";

/// How long a demo may take to build its lab (namespaces, veth, the daemon ready).
const SETUP_TIMEOUT: Duration = Duration::from_secs(120);
/// How long a demo may take to clean up once told to stop (the daemon's stop alone may take
/// 5 s).
const CLEANUP_TIMEOUT: Duration = Duration::from_secs(60);

/// A demo started by a test: its process, the lab it reported, and a guard that removes that
/// lab (and kills the demo) on drop if the demo did not, so a failing test leaves nothing.
/// A demo that never reported its lab (stuck in setup) is killed and what it made found by
/// its name.
struct DemoRun {
    child: Option<Child>,
    lab: Leftovers,
}

impl DemoRun {
    /// Starts the demo in a process group of its own, output on a pipe, and waits until it
    /// printed its lab.
    fn start() -> DemoRun {
        let mut cmd = demo_command();
        cmd.process_group(0)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let mut child = cmd.spawn().expect("starting the demo");
        let stdout = child.stdout.take().expect("piped");
        let mut run = DemoRun {
            child: Some(child),
            lab: Leftovers::default(),
        };
        run.lab = read_lab(stdout, drain);
        run
    }

    /// Starts the demo as the session leader on a pseudo-terminal, and closes the terminal
    /// (hangs it up, as closing a terminal window does) once the demo printed its lab.
    fn start_and_hang_up() -> DemoRun {
        let (mut master, mut slave) = (0, 0);
        // SAFETY: openpty(3) writes two fds into the out-pointers; no name, termios or size.
        let rc = unsafe {
            libc::openpty(
                &mut master,
                &mut slave,
                std::ptr::null_mut(),
                std::ptr::null(),
                std::ptr::null(),
            )
        };
        assert_eq!(rc, 0, "openpty: {}", std::io::Error::last_os_error());
        // Neither may leak into the demo beyond its stdio: a master open in it would keep the
        // terminal from ever hanging up.
        for fd in [master, slave] {
            // SAFETY: fcntl(2) on the descriptors openpty just made.
            let set = unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) };
            assert_eq!(set, 0);
        }
        // SAFETY: fresh descriptors nothing else owns.
        let (master, slave) =
            unsafe { (OwnedFd::from_raw_fd(master), OwnedFd::from_raw_fd(slave)) };
        let mut cmd = demo_command();
        cmd.stdin(slave.try_clone().unwrap())
            .stdout(slave.try_clone().unwrap())
            .stderr(slave);
        // SAFETY: setsid(2) and ioctl(2) are async-signal-safe; the child makes the terminal
        // on its stdin its controlling terminal, as a shell's session has one.
        unsafe {
            cmd.pre_exec(|| {
                if libc::setsid() < 0 || libc::ioctl(0, libc::TIOCSCTTY, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = cmd.spawn().expect("starting the demo on a terminal");
        drop(cmd); // the parent's copies of the terminal's slave side
        let mut run = DemoRun {
            child: Some(child),
            lab: Leftovers::default(),
        };
        // The master is the only one: dropping it after the lab is read hangs the terminal up.
        run.lab = read_lab(std::fs::File::from(master), drop);
        run
    }

    fn pid(&self) -> i32 {
        self.child.as_ref().expect("running").id() as i32
    }

    /// Sends `signal` to the demo's process group: the demo, its daemon and whatever command
    /// it runs at that moment, as `timeout` and a terminal do.
    fn signal_group(&self, signal: i32) {
        // SAFETY: kill(2) on the process group of our own unreaped child.
        assert_eq!(unsafe { libc::kill(-self.pid(), signal) }, 0);
    }

    /// Waits until the demo exits on its own.
    fn wait(&mut self, timeout: Duration) -> ExitStatus {
        let child = self.child.as_mut().expect("running");
        let give_up = Instant::now() + timeout;
        loop {
            if let Some(status) = child.try_wait().expect("waiting for the demo") {
                self.child = None;
                return status;
            }
            assert!(
                Instant::now() < give_up,
                "the demo did not exit within {timeout:?} of being told to stop"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// SIGKILL to the demo alone, reaped.
    fn kill9(&mut self) {
        let mut child = self.child.take().expect("running");
        child.kill().expect("SIGKILL");
        child.wait().expect("reaping the demo");
    }

    /// Asserts that nothing of this run is left: namespaces, bpffs dir, temp dir, daemon.
    fn assert_clean(&self, how: &str) {
        let left = self.lab.present();
        assert!(left.is_empty(), "after {how} the demo left {left:?}");
        // The daemon gets a moment to die of a SIGKILL sent to it.
        let give_up = Instant::now() + Duration::from_secs(10);
        while !self.lab.processes().is_empty() && Instant::now() < give_up {
            std::thread::sleep(Duration::from_millis(100));
        }
        assert_eq!(
            self.lab.processes(),
            Vec::<i32>::new(),
            "after {how} a process of the demo still works in {:?}",
            self.lab.dirs
        );
    }
}

impl Drop for DemoRun {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            // SAFETY: kill(2) on the process group of our own unreaped child.
            unsafe { libc::kill(-(child.id() as i32), libc::SIGKILL) };
            let _ = child.wait();
        }
        let lab = if self.lab.is_empty() {
            Leftovers::of_dead_runs(DEMO_TAG)
        } else {
            self.lab.clone()
        };
        for failure in lab.remove() {
            eprintln!("warning: cleaning up after the test: {failure}");
        }
    }
}

fn demo_command() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_ratelimit-demo"));
    cmd.arg("--quick")
        .env(
            ratelimit_tests::env::BIN_ENV,
            ratelimit_tests::ratelimit_bin(),
        )
        .stdin(Stdio::null());
    cmd
}

/// Reads the demo's output until it printed its lab (namespaces, daemon dir, bpffs dir), then
/// hands the reader to `then` (to keep it drained or drop it) on a thread of its own.
fn read_lab<R: Read + Send + 'static>(out: R, then: fn(BufReader<R>)) -> Leftovers {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut out = BufReader::new(out);
        let mut lab = Leftovers::default();
        let mut line = String::new();
        let mut seen = String::new();
        loop {
            line.clear();
            // A hung-up terminal reads as an error (EIO): the end, as EOF is.
            if !matches!(out.read_line(&mut line), Ok(n) if n > 0) {
                let _ = tx.send(Err(seen));
                return;
            }
            seen.push_str(&line);
            let words: Vec<&str> = line.split_whitespace().collect();
            match words.as_slice() {
                ["clients" | "protected", "netns", name, ..] => lab.netns.push(name.to_string()),
                ["daemon", "dir", dir] => lab.dirs.push(dir.into()),
                ["bpffs", dir] => {
                    lab.bpffs.push(dir.into());
                    let _ = tx.send(Ok(lab));
                    break;
                }
                _ => {}
            }
        }
        then(out);
    });
    match rx.recv_timeout(SETUP_TIMEOUT) {
        Ok(Ok(lab)) => {
            assert_eq!((lab.netns.len(), lab.dirs.len()), (2, 1), "{lab:?}");
            lab
        }
        Ok(Err(seen)) => panic!("the demo ended before its lab was up:\n{seen}"),
        Err(e) => panic!("the demo did not report its lab within {SETUP_TIMEOUT:?}: {e}"),
    }
}

/// Keeps reading (and discarding) the demo's output, so it never blocks on a full pipe.
fn drain<R: Read>(out: BufReader<R>) {
    for _ in out.lines() {}
}

#[test]
fn sigterm_to_the_demo_removes_its_namespaces_pins_and_temp_dir() {
    kernel_test!();
    let mut run = DemoRun::start();
    assert!(run.lab.present() == run.lab, "the lab is up: {:?}", run.lab);
    run.signal_group(libc::SIGTERM);
    let status = run.wait(CLEANUP_TIMEOUT);
    run.assert_clean("SIGTERM");
    assert_eq!(status.code(), Some(128 + libc::SIGTERM), "{status:?}");
}

#[test]
fn a_closed_terminal_ends_the_demo_and_it_cleans_up() {
    kernel_test!();
    let mut run = DemoRun::start_and_hang_up();
    let status = run.wait(CLEANUP_TIMEOUT);
    run.assert_clean("its terminal was closed");
    assert_eq!(
        (status.code(), status.signal()),
        (Some(128 + libc::SIGHUP), None),
        "{status:?}"
    );
}

#[test]
fn a_demo_killed_by_sigkill_is_cleaned_up_by_the_next_run() {
    kernel_test!();
    let mut killed = DemoRun::start();
    killed.kill9();
    // SIGKILL leaves everything: the namespaces, the pins, the temp dir and the daemon.
    assert_eq!(killed.lab.present(), killed.lab);
    let mut next = DemoRun::start();
    killed.assert_clean("SIGKILL and the next run's start");
    next.signal_group(libc::SIGTERM);
    next.wait(CLEANUP_TIMEOUT);
    next.assert_clean("SIGTERM");
}
