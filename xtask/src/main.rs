//! `cargo xtask ...`: the developer and CI entry point of the workspace.
//!
//! Every command that builds something first runs [`setup::ensure`], so a fresh machine needs
//! nothing but Rust and rustup before `cargo xtask run` or `cargo xtask test`.

mod bench;
mod demo;
#[cfg(test)]
mod docs;
mod fuzz;
#[cfg(test)]
mod layers;
mod run;
mod setup;
#[cfg(test)]
mod sizes;
mod test;
mod util;
mod vm;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "xtask",
    about = "Developer commands for the ratelimit workspace"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Install what the build and the tests need (Debian packages, nightly rust-src,
    /// bpf-linker); idempotent, skips what is present.
    Setup,
    /// Build the daemon and run it attached to the given interfaces.
    Run(run::Options),
    /// Run every check and test: fmt, clippy, host tests, kernel end-to-end tests.
    Test(test::Options),
    /// A self-contained lab: namespaces, veth links, a flood, throttling and bans live.
    Demo(demo::Options),
    /// The benchmark suite (`bench/`, with its own XDP object from `bench-ebpf/`).
    Bench(bench::Options),
    /// Boot another kernel (6.1, 6.12, the newest in trixie-backports) under qemu and run a
    /// command in it: `cargo xtask vm --kernel 6.1 -- COMMAND ARGS`.
    Vm(vm::Options),
    /// Differential fuzzing of the data plane: generated frames through the XDP program
    /// and its host model, compared frame by frame.
    Fuzz(fuzz::Options),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Setup => setup::ensure(),
        Command::Run(options) => run::run(options),
        Command::Test(options) => test::run(options),
        Command::Demo(options) => demo::run(options),
        Command::Bench(options) => bench::run(options),
        Command::Vm(options) => vm::run(options),
        Command::Fuzz(options) => fuzz::run(options),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("xtask: error: {error:#}");
            ExitCode::FAILURE
        }
    }
}
