//! The connection to the store: one server, a Redis Cluster, or the master the sentinels
//! name, with every command's answer awaited within a bound; and the Lua scripts run on it.

use std::time::Duration;

use anyhow::{Context as _, bail};
use redis::aio::MultiplexedConnection;

use super::{CONNECT_TIMEOUT, REQUEST_TIMEOUT, Settings};

/// How the store is reached: one server, the nodes a Redis Cluster is discovered from, or the
/// sentinels that name the master.
#[derive(Debug, Clone)]
pub(super) enum Client {
    Single(redis::Client),
    /// The nodes, and the TLS material for a `rediss+cluster://` store.
    Cluster(Vec<redis::ConnectionInfo>, Option<redis::TlsCertificates>),
    /// Redis Sentinel: the sentinels, the master's name, and how both are reached (their
    /// passwords; TLS, with the TLS files, for a `rediss+sentinel://` store: to the
    /// sentinels and to the master alike). Each connection asks the sentinels for the master
    /// in office (and checks that it says it is one), so a connection lost to a failover is
    /// made again to the promoted replica.
    Sentinel(Box<SentinelStore>),
}

/// How a store behind sentinels is reached.
#[derive(Debug, Clone)]
pub(super) struct SentinelStore {
    /// `ConnectionAddr::Tcp`, or `TcpTls` over TLS.
    pub(super) sentinels: Vec<redis::ConnectionAddr>,
    pub(super) master: String,
    pub(super) tls: bool,
    pub(super) certs: Option<redis::TlsCertificates>,
    /// The master's password (`fleet.password_file`), and the sentinels'
    /// (`fleet.sentinel_password_file`).
    pub(super) password: Option<String>,
    pub(super) sentinel_password: Option<String>,
}

impl SentinelStore {
    pub(super) fn client(&self) -> redis::RedisResult<redis::sentinel::SentinelClient> {
        let mut b = redis::sentinel::SentinelClientBuilder::new(
            self.sentinels.clone(),
            &self.master,
            redis::sentinel::SentinelServerType::Master,
        )?;
        if let Some(pw) = &self.password {
            b = b.set_client_to_redis_password(pw);
        }
        if let Some(pw) = &self.sentinel_password {
            b = b.set_client_to_sentinel_password(pw);
        }
        if self.tls {
            b = b
                .set_client_to_redis_tls_mode(redis::TlsMode::Secure)
                .set_client_to_sentinel_tls_mode(redis::TlsMode::Secure);
            if let Some(certs) = &self.certs {
                b = b
                    .set_client_to_redis_certificates(certs.clone())
                    .set_client_to_sentinel_certificates(certs.clone());
            }
        }
        b.build()
    }
}

/// A connection to the store: one server's, or a Redis Cluster's (which routes each command
/// to the master of its keys' slot; every key here carries the tag `{bans}`, so all of them,
/// and the script that updates two at once, live in one slot). Every command's answer is
/// awaited [`Conn::timeout`] at most, retries inside the cluster client included.
#[derive(Clone)]
pub struct Conn {
    inner: ConnKind,
    timeout: Duration,
}

#[derive(Clone)]
enum ConnKind {
    Single(MultiplexedConnection),
    Cluster(redis::cluster_async::ClusterConnection),
}

fn timed_out(what: &str, t: Duration) -> redis::RedisError {
    redis::RedisError::from(std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        format!("{what}: no answer within {t:?}"),
    ))
}

impl redis::aio::ConnectionLike for Conn {
    fn req_packed_command<'a>(
        &'a mut self,
        cmd: &'a redis::Cmd,
    ) -> redis::RedisFuture<'a, redis::Value> {
        let t = self.timeout;
        Box::pin(async move {
            let fut = match &mut self.inner {
                ConnKind::Single(c) => c.req_packed_command(cmd),
                ConnKind::Cluster(c) => c.req_packed_command(cmd),
            };
            tokio::time::timeout(t, fut)
                .await
                .unwrap_or_else(|_| Err(timed_out("the store", t)))
        })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<redis::Value>> {
        let t = self.timeout;
        Box::pin(async move {
            let fut = match &mut self.inner {
                ConnKind::Single(c) => c.req_packed_commands(pipeline, offset, count),
                ConnKind::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
            };
            tokio::time::timeout(t, fut)
                .await
                .unwrap_or_else(|_| Err(timed_out("the store", t)))
        })
    }

    fn get_db(&self) -> i64 {
        match &self.inner {
            ConnKind::Single(c) => c.get_db(),
            ConnKind::Cluster(c) => c.get_db(),
        }
    }
}

/// A connection being made (`connecting`) awaited within twice [`CONNECT_TIMEOUT`]; an error
/// names `store`.
async fn connected<C>(
    store: &str,
    connecting: impl std::future::Future<Output = redis::RedisResult<C>>,
) -> anyhow::Result<C> {
    match tokio::time::timeout(CONNECT_TIMEOUT * 2, connecting).await {
        Ok(Ok(c)) => Ok(c),
        Ok(Err(e)) => bail!("connecting to {store}: {e}"),
        Err(_) => bail!(
            "connecting to {store}: no answer within {:?}",
            CONNECT_TIMEOUT * 2
        ),
    }
}

impl Settings {
    /// A connection for global thresholds' counts.
    pub async fn connect_for_counts(&self) -> anyhow::Result<Conn> {
        self.connect(REQUEST_TIMEOUT).await
    }

    /// A connection whose commands are answered within `response` (or fail).
    pub(super) async fn connect(&self, response: Duration) -> anyhow::Result<Conn> {
        let inner = match &self.client {
            Client::Single(client) => {
                let cfg = redis::AsyncConnectionConfig::new()
                    .set_connection_timeout(Some(CONNECT_TIMEOUT))
                    .set_response_timeout(Some(response));
                // The client's own timeouts, and one over the whole (a handshake that hangs).
                let connecting = client.get_multiplexed_async_connection_with_config(&cfg);
                ConnKind::Single(connected(&self.store, connecting).await?)
            }
            Client::Sentinel(store) => {
                let cfg = redis::AsyncConnectionConfig::new()
                    .set_connection_timeout(Some(CONNECT_TIMEOUT))
                    .set_response_timeout(Some(response));
                let mut client = store
                    .client()
                    .with_context(|| format!("fleet.redis {}", self.store))?;
                // The sentinels asked (a few at once), the master's role checked, the
                // connection made: one bound over all of it.
                let connecting = client.get_async_connection_with_config(&cfg);
                ConnKind::Single(connected(&self.store, connecting).await?)
            }
            Client::Cluster(nodes, tls) => {
                // Few retries inside the client: a slot whose master is gone fails fast, and
                // the tasks' own backoff takes over.
                let mut builder = redis::cluster::ClusterClientBuilder::new(nodes.clone())
                    .connection_timeout(CONNECT_TIMEOUT)
                    .response_timeout(response)
                    .retries(2)
                    .min_retry_wait(50)
                    .max_retry_wait(200);
                if let Some(certs) = tls {
                    builder = builder.certs(certs.clone());
                }
                let client = builder
                    .build()
                    .with_context(|| format!("fleet.redis {}", self.store))?;
                ConnKind::Cluster(connected(&self.store, client.get_async_connection()).await?)
            }
        };
        // The command's own timeout, and a little more for the client's retries.
        Ok(Conn {
            inner,
            timeout: response + REQUEST_TIMEOUT,
        })
    }
}

/// A Lua script run by its SHA1 (`EVALSHA`): loaded once (`SCRIPT LOAD`, on every master of
/// a cluster), and again when the store answers that it does not know it (`NOSCRIPT`: a
/// store restarted, or its scripts flushed).
pub struct Lua {
    code: &'static str,
    sha: Option<String>,
}

impl Lua {
    pub const fn new(code: &'static str) -> Self {
        Self { code, sha: None }
    }

    /// Run the script once per item of `calls` in one pipeline (one round trip): `args`
    /// adds the keys and arguments of one call after `EVALSHA <sha>`.
    pub(super) async fn run<T>(
        &mut self,
        conn: &mut Conn,
        calls: &[T],
        args: impl Fn(&mut redis::Cmd, &T) -> anyhow::Result<()>,
    ) -> anyhow::Result<()> {
        if calls.is_empty() {
            return Ok(());
        }
        let mut retried = false;
        loop {
            let sha = match &self.sha {
                Some(sha) => sha.clone(),
                None => {
                    let sha: String = redis::cmd("SCRIPT")
                        .arg("LOAD")
                        .arg(self.code)
                        .query_async(conn)
                        .await
                        .context("loading a script into the store")?;
                    self.sha = Some(sha.clone());
                    sha
                }
            };
            let mut pipe = redis::pipe();
            for c in calls {
                let mut cmd = redis::cmd("EVALSHA");
                cmd.arg(&sha);
                args(&mut cmd, c)?;
                pipe.add_command(cmd);
            }
            let replies: Vec<redis::Value> = match pipe.query_async(conn).await {
                Ok(v) => v,
                Err(e) if e.code() == Some("NOSCRIPT") && !retried => {
                    self.sha = None;
                    retried = true;
                    continue;
                }
                Err(e) => return Err(e.into()),
            };
            let no_script = replies
                .iter()
                .any(|v| matches!(v, redis::Value::ServerError(e) if e.code() == "NOSCRIPT"));
            if no_script && !retried {
                // Replays are harmless: the calls that ran run again to the same effect.
                self.sha = None;
                retried = true;
                continue;
            }
            if let Some(redis::Value::ServerError(e)) = replies
                .iter()
                .find(|v| matches!(v, redis::Value::ServerError(_)))
            {
                bail!("the store refused a script: {e:?}");
            }
            return Ok(());
        }
    }
}
