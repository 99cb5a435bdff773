//! The events ring buffer, turned into JSON lines for L7 systems (`ban`, `unban`,
//! `soft_limit`, `throttle_start`, `throttle_end`), written to a file or stdout. The file is
//! reopened on SIGHUP so logrotate can move it away.

use std::{
    fs::{File, OpenOptions},
    io::Write as _,
    path::PathBuf,
};

use ratelimit_common::{event::*, maps::ClientKey};
use serde::Serialize;

use crate::report::{client_label, key_name, rfc3339, wall_of};

#[derive(Serialize, Debug, Clone)]
pub struct EventLine {
    pub time: String,
    pub event: &'static str,
    pub rule: String,
    pub key: &'static str,
    pub client: String,
    pub count: u64,
    pub threshold: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ban_expires: Option<String>,
}

pub fn kind_name(kind: u32) -> &'static str {
    match kind {
        EV_BAN => "ban",
        EV_UNBAN => "unban",
        EV_SOFT_LIMIT => "soft_limit",
        EV_THROTTLE_START => "throttle_start",
        EV_THROTTLE_END => "throttle_end",
        _ => "unknown",
    }
}

pub fn line_of(e: &Event, rule_names: &[String]) -> EventLine {
    line_with(e, rule_names, &mut |ns| rfc3339(wall_of(ns)))
}

/// [`line_of`] with the times formatted by `time` (monotonic ns to RFC 3339), so a batch of
/// events at the same few times formats each once.
pub fn line_with(
    e: &Event,
    rule_names: &[String],
    time: &mut dyn FnMut(u64) -> String,
) -> EventLine {
    let key = ClientKey {
        rule: e.rule as u8,
        kind: e.key_kind as u8,
        _pad: [0; 2],
        prefix_len: e.prefix_len,
        addr: e.addr,
    };
    EventLine {
        time: time(e.ts_ns),
        event: kind_name(e.kind),
        // Empty for an operator's ban (no rule issued it).
        rule: rule_names.get(e.rule as usize).cloned().unwrap_or_default(),
        key: key_name(key.kind),
        client: client_label(&key),
        count: e.count,
        threshold: e.threshold,
        ban_expires: (e.kind == EV_BAN && e.expires_ns != 0).then(|| time(e.expires_ns)),
    }
}

/// Where event lines go.
pub enum Sink {
    None,
    Stdout,
    File { path: PathBuf, file: File },
}

impl Sink {
    pub fn open(target: Option<&crate::config::EventsSink>) -> anyhow::Result<Self> {
        use anyhow::Context as _;
        Ok(match target {
            None => Sink::None,
            Some(crate::config::EventsSink::Stdout) => Sink::Stdout,
            Some(crate::config::EventsSink::File(path)) => {
                if let Some(dir) = path.parent() {
                    std::fs::create_dir_all(dir).ok();
                }
                let file = OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(path)
                    .with_context(|| format!("opening events file {}", path.display()))?;
                Sink::File {
                    path: path.clone(),
                    file,
                }
            }
        })
    }

    /// Reopen the file (after log rotation).
    pub fn reopen(&mut self) -> anyhow::Result<()> {
        if let Sink::File { path, file } = self {
            *file = OpenOptions::new().create(true).append(true).open(&*path)?;
        }
        Ok(())
    }

    /// Whether lines go nowhere.
    pub fn is_none(&self) -> bool {
        matches!(self, Sink::None)
    }

    pub fn write(&mut self, line: &EventLine) {
        let Ok(mut s) = serde_json::to_string(line) else {
            return;
        };
        s.push('\n');
        self.write_raw(s.as_bytes());
    }

    /// Bytes of whole lines.
    pub fn write_raw(&mut self, bytes: &[u8]) {
        if bytes.is_empty() {
            return;
        }
        match self {
            Sink::None => {}
            Sink::Stdout => {
                let mut out = std::io::stdout().lock();
                let _ = out.write_all(bytes);
                let _ = out.flush();
            }
            Sink::File { file, .. } => {
                let _ = file.write_all(bytes);
            }
        }
    }
}
