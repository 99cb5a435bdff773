//! The control API: one JSON request per line on a Unix socket, one JSON response per line.
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
    live::{OverrideAt, OverrideSpec},
    ruleset::RuleChanges,
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
    },
    BanDel {
        cidrs: Vec<String>,
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

#[derive(Serialize, Deserialize, Debug)]
pub struct Response {
    pub ok: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// The answer, already encoded: a large one (100k bans, a million clients) is written
    /// once as text instead of first becoming a tree of JSON values.
    #[serde(default = "null")]
    pub data: Box<serde_json::value::RawValue>,
}

fn null() -> Box<serde_json::value::RawValue> {
    serde_json::value::RawValue::from_string("null".into()).expect("valid JSON")
}

impl Response {
    pub fn ok(data: impl Serialize) -> Self {
        Self {
            ok: true,
            error: None,
            data: serde_json::value::to_raw_value(&data).unwrap_or_else(|_| null()),
        }
    }
    pub fn err(e: impl std::fmt::Display) -> Self {
        Self {
            ok: false,
            error: Some(e.to_string()),
            data: null(),
        }
    }
}

/// Send one request and wait for its response.
pub fn call(socket: &Path, req: &Request) -> anyhow::Result<serde_json::Value> {
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
    let resp: Response =
        serde_json::from_str(&resp).context("malformed response from the daemon")?;
    if !resp.ok {
        bail!("{}", resp.error.unwrap_or_else(|| "request failed".into()));
    }
    serde_json::from_str(resp.data.get()).context("malformed response from the daemon")
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
