//! The control API: one JSON request per line on a Unix socket, one JSON response per line.
//! [`Request`] and [`Answer`] are the one typed API of the daemon: the control socket, the CLI,
//! the HTTP listener's reports and the tests all speak it.
//! The socket is created mode 0600 in a root-owned directory, and the server also checks the
//! peer's credentials (SO_PEERCRED): only root may drive the daemon.

use std::{
    io::{BufRead as _, BufReader, Write as _},
    os::unix::{fs::PermissionsExt as _, net::UnixStream},
    path::Path,
    time::Duration,
};

use anyhow::{Context as _, bail};
use serde::{Deserialize, Serialize};

use crate::{
    live::{
        OverrideAdded, OverrideAt, OverrideEntry, OverrideRemoved, OverrideSpec, RuleChanged,
        RuleEntry,
    },
    report::{Ban, Client, Key, Stats},
    ruleset::RuleChanges,
    status::Status,
};

#[derive(Serialize, Deserialize, Debug, Clone)]
#[serde(tag = "cmd", rename_all = "snake_case")]
pub enum Request {
    Status,
    Stats,
    Top {
        n: usize,
        by: TopBy,
    },
    /// Bans in force; at most `limit` of them (in their listed order) when given.
    Bans {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        limit: Option<usize>,
    },
    /// Offenders, highest usage first; at most `limit` of them when given.
    Offenders {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        limit: Option<usize>,
    },
    BanAdd {
        bans: Vec<BanSpec>,
        /// In fleet mode: this host only (not published to the fleet).
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        local: bool,
    },
    BanDel {
        cidrs: Vec<String>,
        /// In fleet mode: this host only (no `unban` published to the fleet).
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        local: bool,
    },
    /// Lift the aggregate ban of a rule keyed `all` or `region`.
    BanLift {
        rule: String,
        region: Option<String>,
    },
    /// Change fields of a live rule; kept across restarts and reloads.
    RuleSet {
        name: String,
        changes: RuleChanges,
    },
    /// Return a rule to the config's values.
    RuleReset {
        name: String,
    },
    /// Every rule with its values in force and its live changes.
    Rules,
    /// Add (or replace) a per-client override live; kept across restarts and reloads.
    OverrideAdd {
        spec: OverrideSpec,
    },
    /// Remove a live override (the config's at the same key, if any, applies again).
    OverrideDel {
        at: OverrideAt,
    },
    /// Every override in force, with where it comes from.
    Overrides,
    Reload,
    /// The pressure level, its mode and signals.
    Pressure,
    /// Force the pressure level (`high`, `low`) or return it to the signals (`auto`); kept
    /// across restarts.
    PressureSet {
        mode: crate::pressure::Mode,
    },
    /// Fleet mode: the store, the connection to it, the cursor, the outbox, the bans shared.
    Fleet,
    /// Fleet mode: a client's counts under each global rule (or the one named), on this host
    /// and in the fleet's store.
    FleetKey {
        addr: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        rule: Option<String>,
    },
}

/// The order of `top`.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Default)]
#[serde(rename_all = "snake_case")]
pub enum TopBy {
    #[default]
    Packets,
    Bytes,
    Drops,
}

#[derive(Serialize, Deserialize, Debug, Clone)]
pub struct BanSpec {
    pub cidr: String,
    /// Milliseconds; None = until removed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub duration_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// The answer to `ban add`.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct BansAdded {
    /// Bans added (or replaced): every entry of the request.
    pub added: usize,
}

/// The answer to `ban del`.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct BansRemoved {
    /// Bans removed (a prefix may have had one in each ban table).
    pub removed: usize,
    /// The entries that had no ban (and, in fleet mode, no `unban` was published for).
    pub not_found: Vec<String>,
    /// In fleet mode: the entries that had no ban here, whose `unban` was published to the
    /// fleet all the same.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub published_only: Vec<String>,
}

/// The answer to `ban del --rule`: the aggregate ban lifted.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct BanLifted {
    pub lifted: u32,
    pub rule: String,
    /// `all` or `region`.
    pub key: Key,
    /// The region whose ban was lifted (for a rule keyed `region`).
    pub region: Option<String>,
}

/// The answer to `reload`.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct Reloaded {
    /// The config file read.
    pub reloaded: String,
    /// The rules now in force, in order.
    pub rules: Vec<String>,
    /// Live changes the new file no longer takes, each with why.
    pub live_changes_dropped: Vec<String>,
}

/// The answer to each [`Request`], carrying its report: one variant per request, named as
/// the request is. On the wire (the control socket's `data`, the HTTP listener's body, the
/// CLI's `--json`) an answer is its report alone, serialized straight from the structs; the
/// request it answers says which one it is ([`Answer::decode`]).
#[derive(Serialize, Debug, Clone, PartialEq)]
#[serde(untagged)]
pub enum Answer {
    Status(Box<Status>),
    Stats(Box<Stats>),
    /// The heaviest clients, heaviest first.
    Top(Vec<Client>),
    Bans(Vec<Ban>),
    /// Offenders, highest usage first.
    Offenders(Vec<Client>),
    BanAdd(BansAdded),
    BanDel(BansRemoved),
    BanLift(BanLifted),
    RuleSet(RuleChanged),
    RuleReset(RuleChanged),
    Rules(Vec<RuleEntry>),
    OverrideAdd(OverrideAdded),
    OverrideDel(OverrideRemoved),
    Overrides(Vec<OverrideEntry>),
    Reload(Reloaded),
    Pressure(Box<crate::pressure::Report>),
    PressureSet(Box<crate::pressure::Report>),
    Fleet(Box<crate::fleet::Report>),
    FleetKey(Box<crate::fleet_key::KeyReport>),
}

impl Answer {
    /// Read `data`, the encoded answer to `req`, as the type the daemon wrote it from.
    pub fn decode(req: &Request, data: &str) -> serde_json::Result<Answer> {
        use serde_json::from_str as read;
        Ok(match req {
            Request::Status => Answer::Status(read(data)?),
            Request::Stats => Answer::Stats(read(data)?),
            Request::Top { .. } => Answer::Top(read(data)?),
            Request::Bans { .. } => Answer::Bans(read(data)?),
            Request::Offenders { .. } => Answer::Offenders(read(data)?),
            Request::BanAdd { .. } => Answer::BanAdd(read(data)?),
            Request::BanDel { .. } => Answer::BanDel(read(data)?),
            Request::BanLift { .. } => Answer::BanLift(read(data)?),
            Request::RuleSet { .. } => Answer::RuleSet(read(data)?),
            Request::RuleReset { .. } => Answer::RuleReset(read(data)?),
            Request::Rules => Answer::Rules(read(data)?),
            Request::OverrideAdd { .. } => Answer::OverrideAdd(read(data)?),
            Request::OverrideDel { .. } => Answer::OverrideDel(read(data)?),
            Request::Overrides => Answer::Overrides(read(data)?),
            Request::Reload => Answer::Reload(read(data)?),
            Request::Pressure => Answer::Pressure(read(data)?),
            Request::PressureSet { .. } => Answer::PressureSet(read(data)?),
            Request::Fleet => Answer::Fleet(read(data)?),
            Request::FleetKey { .. } => Answer::FleetKey(read(data)?),
        })
    }

    /// A list answer cut to its first `n` entries; whether anything was cut. Other answers
    /// are left as they are.
    pub fn truncate(&mut self, n: usize) -> bool {
        fn cut<T>(v: &mut Vec<T>, n: usize) -> bool {
            let cut = v.len() > n;
            v.truncate(n);
            cut
        }
        match self {
            Answer::Top(v) | Answer::Offenders(v) => cut(v, n),
            Answer::Bans(v) => cut(v, n),
            Answer::Rules(v) => cut(v, n),
            Answer::Overrides(v) => cut(v, n),
            _ => false,
        }
    }
}

/// The daemon's response to one request: its answer, or why it failed. On the wire:
/// `{"ok": true, "data": ANSWER}` or `{"ok": false, "error": "...", "data": null}`, one line.
#[derive(Debug, Clone, PartialEq)]
pub struct Response(pub Result<Answer, String>);

impl Response {
    pub fn ok(answer: Answer) -> Self {
        Self(Ok(answer))
    }

    pub fn err(e: impl std::fmt::Display) -> Self {
        Self(Err(e.to_string()))
    }

    /// Read a response line as the answer to `req`.
    pub fn decode(req: &Request, line: &str) -> anyhow::Result<Self> {
        #[derive(Deserialize)]
        struct Wire<'a> {
            ok: bool,
            #[serde(default)]
            error: Option<String>,
            #[serde(default, borrow)]
            data: Option<&'a serde_json::value::RawValue>,
        }
        let wire: Wire =
            serde_json::from_str(line).context("malformed response from the daemon")?;
        if !wire.ok {
            return Ok(Self::err(
                wire.error.unwrap_or_else(|| "request failed".into()),
            ));
        }
        let data = wire.data.map_or("null", |d| d.get());
        let answer = Answer::decode(req, data).context("malformed response from the daemon")?;
        Ok(Self::ok(answer))
    }
}

impl Serialize for Response {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        #[derive(Serialize)]
        struct Wire<'a> {
            ok: bool,
            #[serde(skip_serializing_if = "Option::is_none")]
            error: Option<&'a str>,
            data: Option<&'a Answer>,
        }
        match &self.0 {
            Ok(a) => Wire {
                ok: true,
                error: None,
                data: Some(a),
            },
            Err(e) => Wire {
                ok: false,
                error: Some(e),
                data: None,
            },
        }
        .serialize(s)
    }
}

/// Send one request and wait for its answer.
pub fn call(socket: &Path, req: &Request) -> anyhow::Result<Answer> {
    let mut stream = UnixStream::connect(socket).with_context(|| {
        format!(
            "cannot reach the daemon at {} (is `ratelimit run` running? pass --socket or --config)",
            socket.display()
        )
    })?;
    stream.set_read_timeout(Some(Duration::from_secs(60)))?;
    let mut line = serde_json::to_vec(req)?;
    line.push(b'\n');
    stream.write_all(&line)?;
    let mut reader = BufReader::new(stream);
    let mut resp = String::new();
    reader
        .read_line(&mut resp)
        .context("reading the daemon's response")?;
    if resp.is_empty() {
        bail!("the daemon closed the connection without answering");
    }
    Response::decode(req, &resp)?
        .0
        .map_err(|e| anyhow::anyhow!(e))
}

/// Bind the control socket: parent directory created (0700 if new), stale socket removed,
/// socket file chmod 0600 before anyone can connect (bound under a restrictive umask).
pub fn bind(path: &Path) -> anyhow::Result<tokio::net::UnixListener> {
    if let Some(dir) = path.parent()
        && !dir.as_os_str().is_empty()
        && !dir.exists()
    {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
    }
    if path.exists() {
        // A live daemon answers; a stale file from a killed one does not.
        if UnixStream::connect(path).is_ok() {
            bail!("another daemon is already listening on {}", path.display());
        }
        std::fs::remove_file(path).with_context(|| format!("removing stale {}", path.display()))?;
    }
    // SAFETY: umask is process-wide but only narrows permissions for the bind below.
    let old = unsafe { libc::umask(0o177) };
    let listener = tokio::net::UnixListener::bind(path);
    unsafe { libc::umask(old) };
    let listener =
        listener.with_context(|| format!("binding control socket {}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    Ok(listener)
}

/// The peer's uid (SO_PEERCRED).
pub fn peer_uid(stream: &tokio::net::UnixStream) -> Option<u32> {
    stream.peer_cred().ok().map(|c| c.uid())
}

/// The answer to a peer that is not root.
pub const REFUSAL: &str = "permission denied: the control socket is for root only";
/// How long a refused peer may take to finish sending its request.
pub const REFUSAL_LINGER: Duration = Duration::from_secs(1);
/// The most of a refused peer's request that is read (and thrown away).
const REFUSAL_READ_MAX: usize = 64 * 1024;

/// Answer a peer that is not root with [`REFUSAL`], then read and drop what it sends until it
/// closes, for at most [`REFUSAL_LINGER`] and [`REFUSAL_READ_MAX`] bytes. Closing at once
/// would race the peer's request: a request written after the close fails with EPIPE, and
/// its sender never reads why it was refused.
pub async fn refuse(stream: tokio::net::UnixStream) {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let (mut r, mut w) = stream.into_split();
    let mut line = serde_json::to_vec(&Response::err(REFUSAL)).unwrap_or_default();
    line.push(b'\n');
    if w.write_all(&line).await.is_err() || w.shutdown().await.is_err() {
        return;
    }
    let mut buf = [0u8; 4096];
    let mut read = 0;
    let _ = tokio::time::timeout(REFUSAL_LINGER, async {
        while read < REFUSAL_READ_MAX {
            match r.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => read += n,
            }
        }
    })
    .await;
}

/// One answer of each kind, with every optional field set, for tests of the wire format.
#[cfg(test)]
pub(crate) mod samples {
    use std::collections::BTreeMap;

    use super::*;
    use crate::{
        datapath::{Attached, Entry},
        live::Source,
        report::{Counters, IfaceCounters, Pb, RuleCounters},
    };

    pub fn status() -> Status {
        Status {
            version: "0.1.0".into(),
            pid: 4242,
            started: "2024-05-01T10:00:00.000Z".into(),
            config: Some("/etc/ratelimit/ratelimit.toml".into()),
            adopted_pinned_state: true,
            bpffs_dir: "/sys/fs/bpf/ratelimit".into(),
            preview_all: false,
            interfaces: vec![Attached {
                iface: "eth0".into(),
                ifindex: 2,
                mode: "native".into(),
                slot: 1,
                entry: Entry::Ethernet,
            }],
            program: Some(crate::status::Program {
                xlated_insns: 9000,
                verified_insns: 120_000,
            }),
            rules: vec!["syn-per-client".into()],
            thresholds: vec![crate::status::RuleThreshold {
                rule: "syn-per-client".into(),
                threshold: "2000/20m".into(),
                elastic: Some(1.5),
                threshold_now: "3000/20m".into(),
            }],
            tracked_clients: 12,
            max_sources: 1 << 20,
            admission: crate::status::Admission {
                new_sources_per_sec: 17_477,
                new_sources_burst: 17_477,
                auto: true,
            },
            active_bans: 3,
            known_filter: Some(crate::known::Rebuilt {
                states: 12,
                bits_set: 10,
                bits: 1 << 16,
                secs: 0.25,
                half: 1,
            }),
            events: crate::events::Status {
                sink: "stdout".into(),
                lines_per_sec: 1000,
                queued: 1,
                written: 2,
                suppressed: 3,
                lost: crate::events::Lost {
                    ring_buffer: 4,
                    queue: 5,
                    write: 6,
                },
            },
            tasks: BTreeMap::from([(
                "events".to_string(),
                crate::supervise::TaskHealth {
                    up: false,
                    restarts: 2,
                    last_error: Some("boom".into()),
                    last_failure: Some("2024-05-01T10:00:01.000Z".into()),
                    restarts_at: Some("2024-05-01T10:00:03.000Z".into()),
                },
            )]),
            bans_restore: crate::bans::RestoreReport {
                file: "/var/lib/ratelimit/bans.json".into(),
                restored: 1,
                failed: 1,
                failures: vec!["198.51.100.0/33: bad prefix".into()],
                set_aside: Some("bans.json.bad".into()),
                ..Default::default()
            },
            pressure: pressure(),
            live_changes: crate::live::Report {
                file: "/var/lib/ratelimit/live.json".into(),
                rules_changed: 1,
                drops: vec!["rule \"gone\": no such rule".into()],
                dropped: 1,
                kept_copy: Some("live.json.kept".into()),
                ..Default::default()
            },
        }
    }

    pub fn pressure() -> crate::pressure::Report {
        use crate::pressure::{Level, Mode, Reading, Signal};
        crate::pressure::Report {
            level: Level::High,
            mode: Mode::High,
            auto_level: Level::Low,
            since: "2024-05-01T10:00:00.000Z".into(),
            last_above: Some("2024-05-01T09:59:00.000Z".into()),
            hold_secs: 10.0,
            cpus: vec![0, 1],
            signals: vec![
                Reading {
                    signal: Signal::CpuBusy,
                    value: Some(0.25),
                    mark: 0.8,
                    above: false,
                },
                Reading {
                    signal: Signal::ListenOverflowsPerSec,
                    value: None,
                    mark: 1.0,
                    above: false,
                },
            ],
            transitions: 3,
            not_saved: Some(
                "writing /var/lib/ratelimit/.pressure.json.tmp: No space left on device".into(),
            ),
            data_plane: Some(Level::High),
        }
    }

    pub fn stats() -> Stats {
        let named = |names: &[&str]| -> BTreeMap<String, Pb> {
            names
                .iter()
                .enumerate()
                .map(|(i, n)| {
                    let i = i as u64 + 1;
                    (
                        n.to_string(),
                        Pb {
                            packets: i,
                            bytes: 60 * i,
                        },
                    )
                })
                .collect()
        };
        let counters = Counters {
            total: Pb {
                packets: 3,
                bytes: 180,
            },
            verdicts: named(&["pass", "drop"]),
            reasons: named(&["allow_list", "state_evicted"]),
        };
        Stats {
            all: counters.clone(),
            interfaces: vec![IfaceCounters {
                iface: "eth0".into(),
                slot: 1,
                counters: counters.clone(),
            }],
            // Not on the wire (`/metrics` only).
            unlisted: Counters::default(),
            rules: vec![RuleCounters {
                name: "syn-per-client".into(),
                counters: named(&["matched", "dropped"]),
            }],
        }
    }

    pub fn client(i: u64) -> Client {
        Client {
            rule: "syn-per-client".into(),
            key: Key::Ip,
            client: format!("198.51.100.{i}/32"),
            packets: 100 + i,
            bytes: 6000 + i,
            drops: i,
            usage: 50,
            limit: 100,
            admitted_per_sec: 2.5,
            offered_per_sec: Some(7.25),
            throttled: i.is_multiple_of(2),
            above_soft_limit: true,
            last_seen: "2024-05-01T10:00:00.000Z".into(),
        }
    }

    pub fn bans() -> Vec<Ban> {
        vec![
            Ban {
                cidr: Some("198.51.100.0/24".into()),
                key: Key::Ip,
                region: None,
                // Not on the wire (for saving only).
                expires_ns: None,
                rule: None,
                manual: true,
                preview: false,
                since: "2024-05-01T10:00:00.000Z".into(),
                expires: Some("2024-05-01T11:00:00.000Z".into()),
                remaining_secs: Some(3599.5),
                reason: Some("scanner".into()),
                origin: Some("edge-fra-07".into()),
            },
            Ban {
                cidr: None,
                key: Key::Region,
                region: Some("NL".into()),
                expires_ns: None,
                rule: Some("per-region".into()),
                manual: false,
                preview: true,
                since: "2024-05-01T10:00:00.000Z".into(),
                expires: None,
                remaining_secs: None,
                reason: None,
                origin: None,
            },
        ]
    }

    fn spec(cidr: Option<&str>, region: Option<&str>) -> OverrideSpec {
        OverrideSpec {
            at: OverrideAt {
                rule: "syn-per-client".into(),
                cidr: cidr.map(Into::into),
                region: region.map(Into::into),
            },
            threshold: "5000/20m".into(),
            burst: Some("100".into()),
            ban_threshold: Some("9000/20m".into()),
            elastic: Some("1.5".into()),
        }
    }

    fn changes() -> RuleChanges {
        RuleChanges {
            threshold: Some("3000/20m".into()),
            ban_threshold: Some("6000/20m".into()),
            ban_duration: Some("1h".into()),
            burst: Some(10),
            exceed_action: Some("pass".into()),
            preview: Some(true),
            soft_limit: Some(0.5),
            elastic: Some(2.0),
        }
    }

    /// Every request, each with an answer to it.
    pub fn exchanges() -> Vec<(Request, Answer)> {
        let changed = RuleChanged {
            rule: "syn-per-client".into(),
            index: 0,
            live: Some(changes()),
        };
        vec![
            (Request::Status, Answer::Status(Box::new(status()))),
            (Request::Stats, Answer::Stats(Box::new(stats()))),
            (
                Request::Top {
                    n: 2,
                    by: TopBy::Drops,
                },
                Answer::Top(vec![client(1), client(2)]),
            ),
            (Request::Bans { limit: None }, Answer::Bans(bans())),
            (
                Request::Offenders { limit: Some(1) },
                Answer::Offenders(vec![client(3)]),
            ),
            (
                Request::BanAdd {
                    bans: vec![BanSpec {
                        cidr: "198.51.100.0/24".into(),
                        duration_ms: Some(3_600_000),
                        reason: Some("scanner".into()),
                    }],
                    local: true,
                },
                Answer::BanAdd(BansAdded { added: 1 }),
            ),
            (
                Request::BanDel {
                    cidrs: vec!["198.51.100.0/24".into(), "192.0.2.1".into()],
                    local: false,
                },
                Answer::BanDel(BansRemoved {
                    removed: 1,
                    not_found: vec!["192.0.2.1/32".into()],
                    published_only: vec!["192.0.2.2/32".into()],
                }),
            ),
            (
                Request::BanLift {
                    rule: "per-region".into(),
                    region: Some("nl".into()),
                },
                Answer::BanLift(BanLifted {
                    lifted: 1,
                    rule: "per-region".into(),
                    key: Key::Region,
                    region: Some("NL".into()),
                }),
            ),
            (
                Request::RuleSet {
                    name: "syn-per-client".into(),
                    changes: changes(),
                },
                Answer::RuleSet(changed.clone()),
            ),
            (
                Request::RuleReset {
                    name: "syn-per-client".into(),
                },
                Answer::RuleReset(RuleChanged {
                    live: None,
                    ..changed
                }),
            ),
            (
                Request::Rules,
                Answer::Rules(vec![RuleEntry {
                    name: "syn-per-client".into(),
                    key: "ip".into(),
                    action: "rate_based_ban".into(),
                    algorithm: "sliding_window".into(),
                    threshold: "3000/20m".into(),
                    burst: Some(10),
                    ban_threshold: Some("6000/20m".into()),
                    ban_duration: Some("1h".into()),
                    elastic: Some(2.0),
                    threshold_now: "6000/20m".into(),
                    exceed_action: "drop".into(),
                    preview: false,
                    soft_limit: 0.8,
                    overrides: 2,
                    source: Source::Live,
                    live: Some(changes()),
                }]),
            ),
            (
                Request::OverrideAdd {
                    spec: spec(Some("192.0.2.0/24"), None),
                },
                Answer::OverrideAdd(OverrideAdded {
                    added: spec(Some("192.0.2.0/24"), None),
                    replaced: Some(Source::Config),
                }),
            ),
            (
                Request::OverrideDel {
                    at: spec(None, Some("NL")).at,
                },
                Answer::OverrideDel(OverrideRemoved {
                    removed: spec(None, Some("NL")),
                    restored: Some(spec(None, Some("NL"))),
                }),
            ),
            (
                Request::Overrides,
                Answer::Overrides(vec![OverrideEntry {
                    values: spec(Some("192.0.2.0/24"), None),
                    source: Source::Live,
                    replaces_config: true,
                }]),
            ),
            (
                Request::Reload,
                Answer::Reload(Reloaded {
                    reloaded: "/etc/ratelimit/ratelimit.toml".into(),
                    rules: vec!["syn-per-client".into()],
                    live_changes_dropped: vec!["rule \"gone\": no such rule".into()],
                }),
            ),
            (Request::Pressure, Answer::Pressure(Box::new(pressure()))),
            (
                Request::PressureSet {
                    mode: crate::pressure::Mode::High,
                },
                Answer::PressureSet(Box::new(pressure())),
            ),
            (
                Request::Fleet,
                Answer::Fleet(Box::new(crate::fleet::Report {
                    store: "redis://10.1.0.5:6379".into(),
                    host_id: "edge-fra-07".into(),
                    share_bans: true,
                    connected: false,
                    connected_since: None,
                    degraded_since: Some("2026-01-02T03:04:05.000Z".into()),
                    last_error: Some("connecting to redis://10.1.0.5:6379: refused".into()),
                    cursor: Some("1767323045000-0".into()),
                    lag_ms: Some(3),
                    outbox: 2,
                    outbox_dropped: 0,
                    bans_published: 10,
                    unbans_published: 1,
                    bans_received: 7,
                    unbans_received: 0,
                    bans_skipped: 1,
                    resyncs: 1,
                    store_rtt_ms: Some(0.25),
                    peers: vec![crate::fleet::Peer {
                        host_id: "edge-fra-07".into(),
                        version: "0.1.0".into(),
                        last_seen: "2026-01-02T03:04:05.000Z".into(),
                        age_ms: 400,
                        stale: false,
                        this_host: true,
                        bans_published: 10,
                        bans_received: 7,
                        cursor: Some("1767323045000-0".into()),
                        clock_offset_ms: Some(-1.5),
                    }],
                    global: crate::fleet::global::GlobalReport {
                        rules: vec!["syn-per-client".into()],
                        synced_keys: 12,
                        shared_keys: 0,
                        capped_keys: 0,
                        rounds: 100,
                        store_calls: 400,
                        store_errors: 1,
                        keys_published: 900,
                        added_total: 5000,
                        last_round_ms: Some(0.8),
                        last_error: None,
                    },
                    clock: crate::fleet::ClockReport {
                        offset_ms: Some(-1.5),
                        rtt_ms: Some(0.2),
                        max_skew_ms: 250,
                        over_bound: false,
                        counting: true,
                        measured_at: Some("2026-01-02T03:04:05.000Z".into()),
                        over_since: None,
                        last_error: None,
                    },
                    fleet_name: "default".into(),
                    authenticated: true,
                    records_rejected: [("bad_mac".to_string(), 2)].into(),
                    counts_rejected: Default::default(),
                    bans_clamped: 1,
                    peers_total: 1,
                    resync: None,
                    duplicate_id: crate::fleet::dup::DuplicateReport {
                        nonce: "0123456789abcdef".into(),
                        ..Default::default()
                    },
                })),
            ),
            (
                Request::FleetKey {
                    addr: "198.51.100.7".into(),
                    rule: Some("udp-global".into()),
                },
                Answer::FleetKey(Box::new(crate::fleet_key::sample())),
            ),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every request of the API has an exchange in [`samples::exchanges`]: a new request
    /// fails to compile here until it has one.
    fn sampled(req: &Request) -> &'static str {
        match req {
            Request::Status => "status",
            Request::Stats => "stats",
            Request::Top { .. } => "top",
            Request::Bans { .. } => "bans",
            Request::Offenders { .. } => "offenders",
            Request::BanAdd { .. } => "ban_add",
            Request::BanDel { .. } => "ban_del",
            Request::BanLift { .. } => "ban_lift",
            Request::RuleSet { .. } => "rule_set",
            Request::RuleReset { .. } => "rule_reset",
            Request::Rules => "rules",
            Request::OverrideAdd { .. } => "override_add",
            Request::OverrideDel { .. } => "override_del",
            Request::Overrides => "overrides",
            Request::Reload => "reload",
            Request::Pressure => "pressure",
            Request::PressureSet { .. } => "pressure_set",
            Request::Fleet => "fleet",
            Request::FleetKey { .. } => "fleet_key",
        }
    }

    /// Each answer goes over the wire as the daemon writes it and comes back equal, as the
    /// answer to its request; re-encoded, it is the same JSON.
    #[test]
    fn every_answer_round_trips_through_the_wire() {
        let exchanges = samples::exchanges();
        let mut kinds: Vec<&str> = exchanges.iter().map(|(r, _)| sampled(r)).collect();
        kinds.sort_unstable();
        kinds.dedup();
        assert_eq!(kinds.len(), 19, "one exchange per request");
        for (req, answer) in exchanges {
            // The request, as the CLI sends it and the daemon reads it.
            let line = serde_json::to_string(&req).unwrap();
            let read: Request = serde_json::from_str(&line).unwrap();
            assert_eq!(serde_json::to_string(&read).unwrap(), line);

            let resp = serde_json::to_string(&Response::ok(answer.clone())).unwrap();
            assert!(!resp.contains('\n'), "one line: {resp}");
            let back = Response::decode(&req, &resp).unwrap();
            assert_eq!(back, Response::ok(answer.clone()), "{}", sampled(&req));
            assert_eq!(
                serde_json::to_value(&back).unwrap(),
                serde_json::to_value(Response::ok(answer)).unwrap()
            );
        }
    }

    /// The wire form of the envelope: `ok` and `data`, or `ok`, `error` and a null `data`.
    #[test]
    fn responses_have_the_documented_envelope() {
        let ok = Response::ok(Answer::BanAdd(BansAdded { added: 2 }));
        assert_eq!(
            serde_json::to_string(&ok).unwrap(),
            r#"{"ok":true,"data":{"added":2}}"#
        );
        let err = Response::err("no such ban: 192.0.2.1/32");
        let line = serde_json::to_string(&err).unwrap();
        assert_eq!(
            line,
            r#"{"ok":false,"error":"no such ban: 192.0.2.1/32","data":null}"#
        );
        let req = Request::BanDel {
            cidrs: vec![],
            local: false,
        };
        assert_eq!(Response::decode(&req, &line).unwrap(), err);
        // An answer that is not the one the request asks for is malformed.
        let wrong = serde_json::to_string(&ok).unwrap();
        assert!(Response::decode(&Request::Bans { limit: None }, &wrong).is_err());
    }

    /// The report fields operators and scripts read from `--json` (README, tests, bench).
    #[test]
    fn report_json_keeps_its_field_names() {
        let v = serde_json::to_value(Answer::Bans(samples::bans())).unwrap();
        let keys: Vec<&str> = v[0]
            .as_object()
            .unwrap()
            .keys()
            .map(String::as_str)
            .collect();
        assert_eq!(
            keys,
            [
                "cidr",
                "expires",
                "key",
                "manual",
                "origin",
                "preview",
                "reason",
                "region",
                "remaining_secs",
                "rule",
                "since"
            ]
        );
        assert_eq!(v[1]["key"], "region");
        let v = serde_json::to_value(samples::client(1)).unwrap();
        assert_eq!(v["key"], "ip");
        assert_eq!(v["client"], "198.51.100.1/32");
        let v = serde_json::to_value(samples::stats()).unwrap();
        for key in ["total", "verdicts", "reasons", "interfaces", "rules"] {
            assert!(v.get(key).is_some(), "{key} in {v}");
        }
        assert_eq!(v["interfaces"][0]["iface"], "eth0");
        assert_eq!(v["interfaces"][0]["verdicts"]["drop"]["packets"], 2);
        assert!(v.get("unlisted").is_none());
        let v = serde_json::to_value(samples::status()).unwrap();
        assert_eq!(v["program"]["verified_insns"], 120_000);
        assert_eq!(v["tasks"]["events"]["restarts"], 2);
    }
}
