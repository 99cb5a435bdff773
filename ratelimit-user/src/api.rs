//! The daemon's API: [`Request`] and [`Answer`] are its one typed API, which the control socket
//! (`serve::control`, one JSON line each way), the CLI, the HTTP listener's reports and the
//! tests all speak; [`status`] holds the `status` answer's types.

pub mod status;

use anyhow::Context as _;
use serde::{Deserialize, Serialize};

use crate::{
    api::status::Status,
    policy::live::{
        OverrideAdded, OverrideAt, OverrideEntry, OverrideRemoved, OverrideSpec, RuleChanged,
        RuleEntry,
    },
    policy::report::{Ban, Client, Key, Stats},
    policy::ruleset::RuleChanges,
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
        mode: crate::policy::pressure::Mode,
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
    Pressure(Box<crate::policy::pressure::Report>),
    PressureSet(Box<crate::policy::pressure::Report>),
    Fleet(Box<crate::fleet::Report>),
    FleetKey(Box<crate::fleet::key::KeyReport>),
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

/// One answer of each kind, with every optional field set, for tests of the wire format.
#[cfg(test)]
pub(crate) mod samples;

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
