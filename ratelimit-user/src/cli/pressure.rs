//! `ratelimit pressure [set high|low|auto]`: the pressure level, its mode and signals.

use clap::{Args, Subcommand};

use crate::api::Request;

#[derive(Args, Debug)]
pub struct PressureArgs {
    #[command(subcommand)]
    pub action: Option<PressureCommand>,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Subcommand, Debug)]
pub enum PressureCommand {
    /// Force the level (`high`, `low`), for an operator or an L7 system that sees its backends
    /// saturate, or return it to the signals (`auto`). Kept across restarts.
    Set {
        /// high | low | auto
        mode: crate::policy::pressure::Mode,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
}

/// The request of a `pressure` command, and whether to print JSON.
pub(super) fn request(p: &PressureArgs) -> (Request, bool) {
    match &p.action {
        None => (Request::Pressure, p.json),
        Some(PressureCommand::Set { mode, json }) => {
            (Request::PressureSet { mode: *mode }, p.json || *json)
        }
    }
}

pub(super) fn print_pressure(p: &crate::policy::pressure::Report) {
    use crate::policy::pressure::Mode;
    let how = match p.mode {
        Mode::Auto => "mode auto: from the signals".to_string(),
        m => format!(
            "mode {m}: forced (`ratelimit pressure set auto` returns it to the signals, which say {})",
            p.auto_level.name()
        ),
    };
    println!("level    {} ({how})", p.level.name());
    match p.data_plane {
        Some(crate::policy::pressure::Level::Low) => println!(
            "data     low: rules and overrides with elastic = F admit up to F times their counts"
        ),
        Some(crate::policy::pressure::Level::High) => {
            println!("data     high: rules and overrides with elastic are held to their thresholds")
        }
        None => println!("data     unknown (the map could not be read)"),
    }
    println!("since    {}", p.since);
    for r in &p.signals {
        let value = match r.value {
            Some(v) => format!("{v:.3}"),
            None => "-".into(),
        };
        let above = if r.above { "  ABOVE" } else { "" };
        println!(
            "signal   {:<26} {value:>10}  mark {}{above}",
            r.signal.name(),
            r.mark
        );
    }
    let cpus = if p.cpus.is_empty() {
        "every online CPU".to_string()
    } else {
        p.cpus
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(",")
    };
    println!("cpus     {cpus}");
    println!(
        "hold     {}s; last above: {}",
        p.hold_secs,
        p.last_above.as_deref().unwrap_or("never")
    );
    println!("changes  {}", p.transitions);
    if let Some(why) = &p.not_saved {
        println!("not saved: {why}");
    }
}
