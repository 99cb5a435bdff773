//! `ratelimit ban add|del`: bans added or removed by CIDR (one, or a file of them), and a
//! rule's aggregate ban lifted.

use std::{
    io::Read as _,
    path::{Path, PathBuf},
};

use anyhow::Context as _;
use clap::Subcommand;

use crate::{
    api::{BanSpec, Request},
    config,
};

#[derive(Subcommand, Debug)]
pub enum BanCommand {
    /// Ban a CIDR (or every CIDR in --file, one per line, `-` = stdin).
    Add {
        /// Address or CIDR, IPv4 or IPv6.
        cidr: Option<String>,
        /// Ban duration (e.g. 30s, 20m, 1h, 1d); default: until removed.
        #[arg(long = "for", value_name = "DURATION")]
        duration: Option<String>,
        /// Free text kept with the ban.
        #[arg(long)]
        reason: Option<String>,
        /// Read CIDRs from a file (`-` = stdin), one per line; `#` starts a comment.
        #[arg(long, value_name = "FILE", conflicts_with = "cidr")]
        file: Option<PathBuf>,
        /// In fleet mode: ban on this host only, not on the fleet.
        #[arg(long)]
        local: bool,
        #[arg(long)]
        json: bool,
    },
    /// Remove a ban (or every CIDR in --file), or lift a rule's aggregate ban (--rule).
    Del {
        cidr: Option<String>,
        #[arg(long, value_name = "FILE", conflicts_with = "cidr")]
        file: Option<PathBuf>,
        /// Lift the ban of a rule keyed `all` (or `region`, with --region), or every ban of a
        /// rule keyed by packet fields: their meters start clean.
        #[arg(long, value_name = "RULE", conflicts_with_all = ["cidr", "file"])]
        rule: Option<String>,
        /// The region (ISO 3166-1 alpha-2) whose ban to lift, for a rule keyed `region`.
        #[arg(long, value_name = "CC", requires = "rule")]
        region: Option<String>,
        /// In fleet mode: lift the ban on this host only, not on the fleet.
        #[arg(long, conflicts_with = "rule")]
        local: bool,
        #[arg(long)]
        json: bool,
    },
}

/// The request of a `ban` command, and whether to print JSON.
pub(super) fn request(action: &BanCommand) -> anyhow::Result<(Request, bool)> {
    let req = match action {
        BanCommand::Add {
            cidr,
            duration,
            reason,
            file,
            local,
            ..
        } => {
            // Bounded to 10 years by the shared check, so the milliseconds fit.
            let duration_ms = duration
                .as_deref()
                .map(|d| {
                    config::parse_ban_duration(d)
                        .map_err(|e| anyhow::anyhow!(config::labelled("--for", &e)))
                })
                .transpose()?
                .map(|d| d.as_millis() as u64);
            let cidrs = cidr_list(cidr.as_deref(), file.as_deref())?;
            Request::BanAdd {
                bans: cidrs
                    .into_iter()
                    .map(|c| BanSpec {
                        cidr: c,
                        duration_ms,
                        reason: reason.clone(),
                    })
                    .collect(),
                local: *local,
            }
        }
        BanCommand::Del {
            rule: Some(rule),
            region,
            ..
        } => Request::BanLift {
            rule: rule.clone(),
            region: region.clone(),
        },
        BanCommand::Del {
            cidr, file, local, ..
        } => {
            if cidr.is_none() && file.is_none() {
                anyhow::bail!(
                    "give one CIDR, --file FILE, or --rule RULE to lift a rule's aggregate ban"
                );
            }
            Request::BanDel {
                cidrs: cidr_list(cidr.as_deref(), file.as_deref())?,
                local: *local,
            }
        }
    };
    let json = match action {
        BanCommand::Add { json, .. } | BanCommand::Del { json, .. } => *json,
    };
    Ok((req, json))
}

/// One CIDR from the command line, or many from a file (`-` = stdin).
fn cidr_list(one: Option<&str>, file: Option<&Path>) -> anyhow::Result<Vec<String>> {
    match (one, file) {
        (Some(c), None) => Ok(vec![c.to_string()]),
        (None, Some(f)) => {
            let mut text = String::new();
            if f == Path::new("-") {
                std::io::stdin().read_to_string(&mut text)?;
            } else {
                text = std::fs::read_to_string(f)
                    .with_context(|| format!("reading {}", f.display()))?;
            }
            Ok(crate::policy::bans::file_entries(&text))
        }
        _ => anyhow::bail!("give one CIDR or --file FILE"),
    }
}
