//! `cargo xtask test`: every check and test, in order, failing fast.
//!
//! fmt, clippy, host tests, the daemon build, then the kernel end-to-end tests (root, `ip`,
//! bpffs), then the tests that load the real program ([`GUEST_TESTS`]) on each of the other
//! kernels docs/kernels.md promises, booted under qemu ([`vm`]). Without their preconditions the
//! kernel tests are skipped, except under CI where that is a failure.

use std::path::{Path, PathBuf};

use anyhow::{Context as _, Result, bail};
use clap::Args;

use crate::{bench, setup, util, vm};

#[derive(Debug, Args)]
pub struct Options {
    /// Skip the kernel end-to-end tests (and the other kernels).
    #[arg(long)]
    pub no_kernel: bool,
    /// Skip the tests on the other kernels (under qemu).
    #[arg(long, conflicts_with = "vm_only")]
    pub no_vm: bool,
    /// Run only the tests on the other kernels (step 6).
    #[arg(long, conflicts_with = "no_kernel")]
    pub vm_only: bool,
    /// Test-name filter for the kernel tests (after `--`).
    #[arg(last = true, value_name = "FILTER")]
    pub filter: Vec<String>,
}

const STEPS: usize = 7;

/// The test binaries (of `ratelimit-tests`) run in every guest kernel, with test-name filters
/// for what must not run there (and why). They load the real object and drive it through
/// BPF_PROG_TEST_RUN, which is what differs between kernels; the end-to-end tests add the
/// daemon and veth traffic, which do not, and would take an hour under software emulation.
/// The fixture tests take 40-150 s in a guest. Two depend on how fast the guest runs and are
/// left out there (they run on the host's kernel), with no defect behind their failures:
/// * `overflow_closes_to_new_sources_for_the_tick_exactly` gives one new source a second
///   (`new_sources_per_sec = 1`) and expects a loop of 20 policy writes and 1,020 runs to
///   finish before the budget admits another; under emulation it can take longer (6.1 guest:
///   the 51st run of a round passed).
/// * `new_states_per_tick_and_cpu_are_capped` needs a round of 192 runs to fit in one jiffy
///   (4 ms: about 20 us a run) for its exact count; under emulation none of 20 rounds did in
///   a 6.1 guest (its bound held in each), while on the host's kernel the first round fits.
///
/// The differential fuzz test runs 50,000 frames in each guest too (about 2,000 frames/s under
/// emulation: 25 s a kernel; the host's kernel runs its default 100,000), so the program and
/// the model are compared on every kernel docs/kernels.md promises, not only on the host's.
const GUEST_TESTS: &[GuestTest] = &[
    GuestTest {
        name: "fixtures",
        exclude: &[
            "overflow_closes_to_new_sources_for_the_tick_exactly",
            "new_states_per_tick_and_cpu_are_capped",
        ],
        env: &[],
    },
    GuestTest {
        name: "fuzz",
        exclude: &[],
        env: &[("RATELIMIT_FUZZ_FRAMES", "50000")],
    },
];

/// A test binary of `ratelimit-tests` run in the guests: the tests it leaves out there, and
/// environment it gets besides `RATELIMIT_KERNEL_TESTS=1`.
struct GuestTest {
    name: &'static str,
    exclude: &'static [&'static str],
    env: &'static [(&'static str, &'static str)],
}

/// The time limit of one guest run: the fixture tests take about a minute under TCG.
const GUEST_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(15 * 60);

fn header(step: usize, title: &str) {
    println!();
    println!("==== xtask test [{step}/{STEPS}]: {title}");
}

/// Whether we run under CI (`CI=true` or `CI=1`): then missing kernel-test preconditions fail.
fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|value| value.eq_ignore_ascii_case("true") || value == "1")
}

/// Why the kernel tests cannot run here, if they cannot.
fn kernel_preconditions() -> Option<String> {
    let mut reasons = Vec::new();
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        reasons.push("not running as root".to_string());
    }
    if !util::works("ip", "-V") {
        reasons.push("`ip` (iproute2) is not available".to_string());
    }
    if !Path::new("/sys/fs/bpf").is_dir() {
        reasons.push("/sys/fs/bpf does not exist (no bpffs)".to_string());
    }
    (!reasons.is_empty()).then(|| reasons.join("; "))
}

/// Counts of the libtest summary lines (`test result: ok. N passed; M failed; ...`), summed
/// over every test binary of the step.
#[derive(Debug, Default, PartialEq, Eq)]
struct Counts {
    passed: u64,
    failed: u64,
    binaries: u64,
}

fn parse_counts(output: &str) -> Counts {
    let mut counts = Counts::default();
    for line in output.lines() {
        let Some(rest) = line.trim().strip_prefix("test result: ") else {
            continue;
        };
        counts.binaries += 1;
        let words: Vec<&str> = rest.split_whitespace().collect();
        for pair in words.windows(2) {
            let Ok(n) = pair[0].parse::<u64>() else {
                continue;
            };
            if pair[1].starts_with("passed") {
                counts.passed += n;
            } else if pair[1].starts_with("failed") {
                counts.failed += n;
            }
        }
    }
    counts
}

pub fn run(options: Options) -> Result<()> {
    setup::ensure()?;
    if options.vm_only {
        header(6, "the program on other kernels (qemu, software emulation)");
        return other_kernels(&options.filter);
    }

    // Decide about the kernel tests up front, so CI fails before minutes of clippy.
    let kernel_skip = if options.no_kernel {
        Some("--no-kernel given".to_string())
    } else if let Some(reason) = kernel_preconditions() {
        if in_ci() {
            bail!("kernel tests cannot run under CI: {reason}");
        }
        Some(reason)
    } else {
        None
    };

    header(1, "format");
    util::run(&mut util::cargo(["fmt", "--all", "--", "--check"]))
        .context("formatting check (run `cargo fmt --all`)")?;

    header(2, "clippy (host, then the XDP objects on the BPF target)");
    util::run(&mut util::cargo([
        "clippy",
        "--workspace",
        "--all-targets",
        "--",
        "-D",
        "warnings",
    ]))
    .context("clippy")?;
    util::run(&mut clippy_bpf()).context("clippy on the XDP objects for the BPF target")?;

    header(3, "host tests");
    util::run(&mut util::cargo([
        "test",
        "-p",
        "ratelimit-common",
        "-p",
        "ratelimit-user",
        "-p",
        "ratelimit-bench",
        "-p",
        "xtask",
    ]))
    .context("host tests")?;

    header(4, "build the daemon");
    util::run(&mut util::cargo(["build", "-p", "ratelimit-user"]))
        .context("building the daemon")?;
    let bin = daemon_path()?;
    println!("daemon: {}", bin.display());

    header(5, "kernel tests");
    if let Some(reason) = kernel_skip {
        if options.no_kernel {
            println!("kernel tests skipped: {reason}");
        } else {
            println!("kernel tests SKIPPED: {reason}");
        }
        println!();
        println!("xtask test: ok; kernel tests: skipped ({reason})");
        return Ok(());
    }
    let mut cmd = util::cargo(["test", "-p", "ratelimit-tests", "--", "--test-threads=1"]);
    cmd.args(&options.filter)
        .env("RATELIMIT_BIN", &bin)
        .env("RATELIMIT_KERNEL_TESTS", "1");
    let (result, output) = util::run_tee(&mut cmd);
    let counts = parse_counts(&output);
    println!();
    println!(
        "xtask test: kernel tests: {} passed, {} failed",
        counts.passed, counts.failed
    );
    result.context("kernel tests")?;
    if counts.binaries == 0 {
        bail!("kernel tests: no libtest summary line in the output");
    }

    header(6, "the program on other kernels (qemu, software emulation)");
    if options.no_vm {
        println!("other kernels skipped: --no-vm given");
    } else {
        other_kernels(&options.filter)?;
    }

    header(
        7,
        "benchmark suite (quick: every case runs, verdicts checked, no speed asserted)",
    );
    bench::run_suite(true)?;
    println!();
    println!("{} passed, {} failed", counts.passed, counts.failed);
    Ok(())
}

/// Clippy on the eBPF crates (the program, `ratelimit-ebpf`, and the benchmark's object,
/// `ratelimit-bench-ebpf`) for the BPF target, the way aya lints its eBPF crates. Every module
/// of them is `cfg(target_arch = "bpf")`, so the host clippy above sees none of it. Same
/// toolchain, target and cfg as the objects `ratelimit-ebpf-build` builds, in a target
/// directory of its own so it invalidates none of their builds.
fn clippy_bpf() -> std::process::Command {
    let root = util::workspace_root();
    let mut cmd = std::process::Command::new("rustup");
    cmd.args([
        "run",
        "nightly",
        "cargo",
        "clippy",
        "--package",
        "ratelimit-ebpf",
        "--package",
        "ratelimit-bench-ebpf",
        "--target",
        "bpfel-unknown-none",
        "-Z",
        "build-std=core",
        "--release",
    ]);
    cmd.arg("--target-dir")
        .arg(root.join("target").join("clippy-ebpf"))
        .args(["--", "-D", "warnings"])
        .current_dir(&root)
        .env_remove("RUSTC")
        .env_remove("RUSTC_WORKSPACE_WRAPPER")
        .env(
            "CARGO_ENCODED_RUSTFLAGS",
            format!("--cfg=bpf_target_arch=\"{}\"", std::env::consts::ARCH),
        );
    cmd
}

/// Builds the [`GUEST_TESTS`] binaries once on the host, then runs each in a guest of each of
/// [`vm::KERNELS`], [`GUESTS_AT_ONCE`] guests at a time; prints each guest's output whole as
/// it ends, then per kernel and test the counts, the program's verified instruction count and
/// the time. Every guest runs even when one fails; the step fails if any kernel did not boot
/// or any test failed.
fn other_kernels(filter: &[String]) -> Result<()> {
    let mut build = util::cargo([
        "test",
        "-p",
        "ratelimit-tests",
        "--no-run",
        "--message-format=json-render-diagnostics",
    ]);
    for test in GUEST_TESTS {
        build.args(["--test", test.name]);
    }
    util::echo(&build);
    let out = build
        .stderr(std::process::Stdio::inherit())
        .output()
        .context("building the guest tests")?;
    if !out.status.success() {
        bail!("building the guest tests failed ({})", out.status);
    }
    let json = String::from_utf8_lossy(&out.stdout);
    let mut exes = Vec::new();
    for test in GUEST_TESTS {
        exes.push(test_executable(&json, test.name)?);
    }
    // Prepared one after the other (a first preparation downloads and unpacks packages).
    let mut results: Vec<Vec<Option<Guest>>> = Vec::new();
    let mut kernels = Vec::new();
    for kernel in vm::KERNELS {
        match vm::prepare(*kernel) {
            Ok(prepared) => {
                let label = format!(
                    "kernel {} ({}, {})",
                    kernel.name, prepared.release, prepared.version
                );
                kernels.push(Some((label, prepared)));
                results.push(vec![None; GUEST_TESTS.len()]);
            }
            Err(error) => {
                let line = format!("kernel {}: not prepared: {error:#}", kernel.name);
                println!("{line}");
                results.push(vec![Some(Guest { line, failed: true })]);
                kernels.push(None);
            }
        }
    }
    // The jobs, longest first (the fixtures, then the fuzz test; the newest kernel first),
    // taken by [`GUESTS_AT_ONCE`] workers: each guest is one emulation thread
    // (`tcg,thread=single`), so two keep a 2-core machine busy.
    let jobs: Vec<(usize, usize)> = (0..GUEST_TESTS.len())
        .flat_map(|t| (0..kernels.len()).rev().map(move |k| (k, t)))
        .filter(|&(k, _)| kernels[k].is_some())
        .collect();
    let queue = std::sync::Mutex::new(jobs.into_iter());
    let done = std::sync::Mutex::new(results);
    std::thread::scope(|scope| {
        for _ in 0..GUESTS_AT_ONCE {
            scope.spawn(|| {
                loop {
                    let next = queue.lock().unwrap_or_else(|e| e.into_inner()).next();
                    let Some((k, t)) = next else { break };
                    let Some((label, prepared)) = &kernels[k] else {
                        continue;
                    };
                    let (output, guest) =
                        one_guest(label, prepared, &GUEST_TESTS[t], &exes[t], filter);
                    let mut done = done.lock().unwrap_or_else(|e| e.into_inner());
                    // Printed whole, under the lock: guests' outputs never interleave.
                    print!("{output}");
                    done[k][t] = Some(guest);
                }
            });
        }
    });
    let results = done.into_inner().unwrap_or_else(|e| e.into_inner());
    println!();
    let mut failures = Vec::new();
    for guest in results.iter().flatten().flatten() {
        println!("{}", guest.line);
        if guest.failed {
            failures.push(guest.line.clone());
        }
    }
    if !failures.is_empty() {
        bail!("on other kernels:\n{}", failures.join("\n"));
    }
    Ok(())
}

/// How many guests run at once: each takes one host core.
const GUESTS_AT_ONCE: usize = 2;

/// What one guest found: its summary line, and whether it failed.
#[derive(Clone)]
struct Guest {
    line: String,
    failed: bool,
}

/// `test` (its executable `exe`) in a guest of the kernel `prepared` (`label` names it): the
/// guest's output (a header, what it printed, its summary line) and what it found.
fn one_guest(
    label: &str,
    prepared: &vm::Prepared,
    test: &GuestTest,
    exe: &str,
    filter: &[String],
) -> (String, Guest) {
    let mut command: Vec<std::ffi::OsString> = vec![
        exe.into(),
        "--test-threads=1".into(),
        // The fixture table prints the verified instruction count.
        "--nocapture".into(),
    ];
    command.extend(filter.iter().map(Into::into));
    for skip in test.exclude {
        command.push("--skip".into());
        command.push(skip.into());
    }
    let name = test.name;
    let mut output = format!("\n---- {label}: {name}\n");
    let mut env = vec![("RATELIMIT_KERNEL_TESTS".to_string(), "1".to_string())];
    env.extend(test.env.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    let guest = match vm::boot(prepared, &command, &env, GUEST_TIMEOUT, false) {
        Ok(run) => {
            output.push_str(&run.output);
            let counts = parse_counts(&run.output);
            let verified = parse_verified(&run.output)
                .map_or("not printed".to_string(), |(x, v)| {
                    format!("{v} verified ({x} translated)")
                });
            let line = format!(
                "{label}: {name}: {} passed, {} failed; program: {verified}; {:.0} s",
                counts.passed,
                counts.failed,
                run.elapsed.as_secs_f64()
            );
            let failed = run.status != 0 || counts.failed != 0 || counts.binaries == 0;
            Guest {
                line: if failed {
                    format!("{line} (exit status {})", run.status)
                } else {
                    line
                },
                failed,
            }
        }
        Err(error) => Guest {
            line: format!("{label}: {name}: did not run: {error:#}"),
            failed: true,
        },
    };
    output.push_str(&guest.line);
    output.push('\n');
    (output, guest)
}

/// The executable of integration test `name` in cargo's JSON messages.
fn test_executable(json: &str, name: &str) -> Result<String> {
    json.lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .find(|message| {
            message["reason"] == "compiler-artifact"
                && message["target"]["name"] == name
                && message["target"]["kind"]
                    .as_array()
                    .is_some_and(|kinds| kinds.iter().any(|kind| kind == "test"))
        })
        .and_then(|message| message["executable"].as_str().map(str::to_string))
        .with_context(|| format!("cargo built no executable for test {name}"))
}

/// `(translated, verified)` from the fixture table's line
/// `program: X translated instructions, Y verified instructions` (with `--nocapture`, after
/// libtest's `test fixture_table ... `).
fn parse_verified(output: &str) -> Option<(u64, u64)> {
    output.lines().find_map(|line| {
        let (_, rest) = line.trim().split_once("program: ")?;
        let (x, rest) = rest.split_once(" translated instructions, ")?;
        let v = rest.strip_suffix(" verified instructions")?;
        Some((x.parse().ok()?, v.parse().ok()?))
    })
}

/// Absolute path of the debug daemon binary.
fn daemon_path() -> Result<PathBuf> {
    let target = util::target_dir()?;
    let bin = target.join("debug").join("ratelimit");
    let bin = if bin.is_absolute() {
        bin
    } else {
        util::workspace_root().join(bin)
    };
    if !bin.is_file() {
        bail!(
            "the daemon build succeeded but {} does not exist",
            bin.display()
        );
    }
    Ok(bin)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_are_summed_over_binaries() {
        let output = "\
running 2 tests
test a ... ok
test b ... FAILED

test result: FAILED. 1 passed; 1 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.01s

running 10 tests
test result: ok. 10 passed; 0 failed; 2 ignored; 0 measured; 3 filtered out; finished in 1.2s
";
        assert_eq!(
            parse_counts(output),
            Counts {
                passed: 11,
                failed: 1,
                binaries: 2
            }
        );
    }

    #[test]
    fn verified_count_is_read_from_the_fixture_line() {
        let output = "running 13 tests\n\
                      test fixture_table ... program: 7035 translated instructions, 165766 verified instructions\n\
                      ok\n";
        assert_eq!(parse_verified(output), Some((7035, 165766)));
        assert_eq!(parse_verified("program: loaded\n"), None);
    }

    #[test]
    fn the_test_executable_is_found_among_other_artifacts() {
        let json = r#"{"reason":"compiler-artifact","target":{"name":"ratelimit-demo","kind":["bin"]},"executable":"/t/debug/ratelimit-demo"}
{"reason":"compiler-artifact","target":{"name":"ratelimit_tests","kind":["lib"]},"executable":null}
{"reason":"compiler-artifact","target":{"name":"fixtures","kind":["test"]},"executable":"/t/debug/deps/fixtures-1b4c"}
{"reason":"build-finished","success":true}"#;
        assert_eq!(
            test_executable(json, "fixtures").unwrap(),
            "/t/debug/deps/fixtures-1b4c"
        );
        assert!(test_executable(json, "ratelimit-demo").is_err());
    }

    #[test]
    fn no_summary_no_counts() {
        assert_eq!(
            parse_counts("error: could not compile\n"),
            Counts::default()
        );
    }
}
