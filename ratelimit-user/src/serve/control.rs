//! The control socket: one JSON [`Request`] per line, one JSON [`Response`] per line. The
//! socket is created mode 0600 in a root-owned directory, and the server also checks the peer's
//! credentials (SO_PEERCRED): only root may drive the daemon. [`call`] is the client's side.

use std::{
    io::{BufRead as _, BufReader, Write as _},
    os::unix::{fs::PermissionsExt as _, net::UnixStream},
    path::Path,
    time::Duration,
};

use anyhow::{Context as _, bail};

use crate::api::{Answer, Request, Response};

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
    // SAFETY: puts back the mask taken above; umask cannot fail.
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
