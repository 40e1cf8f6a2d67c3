//! PostgreSQL connections: the database handle, its deadlines, the hosts of
//! a multi-host URL, and the errors every query returns.

pub mod pool;
pub mod schema;
pub mod server;
pub mod settled;

use std::future::Future;
use std::time::Duration;

use tokio_postgres::Client;

use crate::policy::retry::{server_going, DbFailure};

#[derive(Debug, thiserror::Error)]
pub enum DbError {
    /// `going`: the server was reached and is shutting down or starting up,
    /// or dropped the connection while it was being made.
    #[error("cannot connect to PostgreSQL at {url}: {message}")]
    Connect { url: String, message: String, going: bool },
    /// The server took the connection (or the query) but did not answer in time.
    #[error("PostgreSQL at {server} did not answer within {} while {what} ({key}); check that the server is up, not overloaded or frozen, and reachable on this path", humantime::format_duration(*.after))]
    Timeout { server: String, what: String, after: Duration, key: &'static str },
    /// Shown once, in the server's words (no "db error" chain after it).
    #[error("{}", describe(.0))]
    Query(tokio_postgres::Error),
    #[error("{0}")]
    Check(String),
    /// CDC is not possible on this server or for this role (`wal_level`, the
    /// publication, replication permission): `--mode auto` polls instead.
    #[error("{0}")]
    CdcUnavailable(String),
}

impl From<tokio_postgres::Error> for DbError {
    fn from(e: tokio_postgres::Error) -> Self {
        DbError::Query(e)
    }
}

impl DbError {
    /// What this failure says about the server, for the retry policy.
    pub fn failure(&self) -> DbFailure {
        match self {
            DbError::Connect { going, .. } => DbFailure::Connect { going: *going },
            DbError::Query(e) => DbFailure::Query { going: server_going(e) },
            DbError::Timeout { .. } | DbError::Check(_) | DbError::CdcUnavailable(_) => DbFailure::Refusal,
        }
    }
}

/// A PostgreSQL error once, in the server's words (`ERROR: relation ... (42P01)`),
/// not tokio-postgres's "db error" wrapper around it.
pub fn describe(e: &tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => {
            let mut text = format!("{}: {} ({})", db.severity(), db.message(), db.code().code());
            if let Some(hint) = db.hint() {
                text.push_str(&format!("; hint: {hint}"));
            }
            text
        }
        None => {
            let mut text = e.to_string();
            let mut src = std::error::Error::source(e);
            while let Some(s) = src {
                text.push_str(&format!(": {s}"));
                src = s.source();
            }
            text
        }
    }
}

/// How long the relay waits for PostgreSQL.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Deadlines {
    /// One connection attempt: TCP, TLS, authentication.
    pub connect: Duration,
    /// A start-up check or a control query.
    pub query: Duration,
}

impl Default for Deadlines {
    fn default() -> Self {
        Self { connect: Duration::from_secs(10), query: Duration::from_secs(30) }
    }
}

/// A database the relay talks to: its URL (parsed again at each connection, so
/// a rotated password file is read anew) and how long to wait for it.
#[derive(Clone)]
pub struct Db {
    url: String,
    pub deadlines: Deadlines,
}

impl std::fmt::Debug for Db {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Db")
            .field("url", &outbox_pgconn::redact(&self.url))
            .field("deadlines", &self.deadlines)
            .finish()
    }
}

impl Db {
    pub fn new(url: &str, deadlines: Deadlines) -> Db {
        Db { url: url.to_string(), deadlines }
    }

    /// The configured database, with the configured deadlines: built once
    /// at start-up and handed down.
    pub fn of(config: &crate::config::Config) -> Db {
        Db::new(&config.database_url, Deadlines { connect: config.connect_timeout, query: config.query_timeout })
    }

    pub fn target(&self) -> Result<outbox_pgconn::Target, DbError> {
        outbox_pgconn::parse(&self.url).map_err(DbError::Check)
    }

    /// `host:port` of the server, for messages.
    pub fn server(&self) -> String {
        self.target().map(|t| t.server()).unwrap_or_else(|_| outbox_pgconn::redact(&self.url))
    }

    /// Open a connection within the connect deadline.
    pub async fn connect(&self) -> Result<Client, DbError> {
        connect_target(&self.target()?, self.deadlines.connect).await
    }

    /// Wait for `fut` (a query, or several) at most the query deadline.
    pub async fn within<T, E>(&self, what: &str, fut: impl Future<Output = Result<T, E>>) -> Result<T, E>
    where
        E: From<DbError>,
    {
        self.within_for(self.deadlines.query, what, fut).await
    }

    /// [`within`](Self::within) for work that also opens a connection (a
    /// replication probe, say): the query deadline plus a connect deadline
    /// per host of the URL, each of which may be tried in turn.
    pub async fn within_connecting<T, E>(&self, what: &str, fut: impl Future<Output = Result<T, E>>) -> Result<T, E>
    where
        E: From<DbError>,
    {
        let hosts = self.target().map(|t| t.hosts.len()).unwrap_or(1).max(1) as u32;
        self.within_for(self.deadlines.query + self.deadlines.connect * hosts, what, fut).await
    }

    async fn within_for<T, E>(
        &self,
        after: Duration,
        what: &str,
        fut: impl Future<Output = Result<T, E>>,
    ) -> Result<T, E>
    where
        E: From<DbError>,
    {
        match tokio::time::timeout(after, fut).await {
            Ok(r) => r,
            Err(_) => Err(E::from(DbError::Timeout {
                server: self.server(),
                what: what.to_string(),
                after,
                key: "query_timeout",
            })),
        }
    }

    /// [`within`](Self::within) for a tokio-postgres future.
    pub async fn query<T>(
        &self,
        what: &str,
        fut: impl Future<Output = Result<T, tokio_postgres::Error>>,
    ) -> Result<T, DbError> {
        self.within(what, async { fut.await.map_err(DbError::from) }).await
    }
}

/// The one connection a periodic loop keeps: opened when first needed, and
/// again once it closed or a query on it failed ([`Kept::lost`]).
pub struct Kept {
    db: Db,
    client: Option<Client>,
}

impl Kept {
    pub fn new(db: Db) -> Kept {
        Kept { db, client: None }
    }

    /// The connection, opened now if none is open; `None` when it cannot be
    /// (the loop tries again at its next turn).
    pub async fn get(&mut self) -> Option<&Client> {
        if self.client.as_ref().is_none_or(|c| c.is_closed()) {
            self.client = self
                .db
                .connect()
                .await
                .inspect_err(|e| tracing::debug!(error = %e, "cannot connect; trying again next time"))
                .ok();
        }
        self.client.as_ref()
    }

    /// A query on it failed: the next [`Kept::get`] opens another.
    pub fn lost(&mut self) {
        self.client = None;
    }
}

/// Open a connection (TLS per the URL's sslmode) with the default deadlines;
/// its driver runs on a spawned task.
pub async fn connect(url: &str) -> Result<Client, DbError> {
    Db::new(url, Deadlines::default()).connect().await
}

/// Connect within `deadline` (TCP, TLS and authentication together). With
/// several hosts, each is tried in turn with a deadline of its own, so a
/// host that accepts TCP and never answers costs one deadline, not every
/// connection: the next host is tried.
pub async fn connect_target(target: &outbox_pgconn::Target, deadline: Duration) -> Result<Client, DbError> {
    let tls = outbox_pgconn::connector(target).map_err(|e| DbError::Connect {
        url: target.shown.clone(),
        message: e,
        going: false,
    })?;
    if target.hosts.len() > 1 && target.hosts.iter().all(|(h, _)| !h.starts_with('/')) {
        return connect_each_host(target, tls, deadline).await;
    }
    let attempt = tokio::time::timeout(deadline, target.pg.connect(tls)).await.map_err(|_| DbError::Timeout {
        server: target.server(),
        what: "connecting (TCP, TLS and authentication)".into(),
        after: deadline,
        key: "connect_timeout",
    })?;
    let (client, conn) = attempt.map_err(|e| DbError::Connect {
        url: target.shown.clone(),
        message: outbox_pgconn::explain(target, &e),
        going: server_going(&e),
    })?;
    tokio::spawn(async move {
        if let Err(e) = conn.await {
            tracing::debug!(error = %e, "postgres connection closed");
        }
    });
    Ok(client)
}

/// Hosts of a several-host URL found unusable and not back since: each is
/// logged once when it is passed over and once when it answers again, not
/// at every connection.
static HOSTS_DOWN: std::sync::LazyLock<std::sync::Mutex<std::collections::HashSet<String>>> =
    std::sync::LazyLock::new(Default::default);

/// A host of a several-host URL was passed over for `why`.
pub(crate) fn host_passed_over(server: &str, why: &str) {
    if HOSTS_DOWN.lock().unwrap().insert(server.to_string()) {
        tracing::warn!(
            server,
            reason = why,
            "database host passed over; trying the next one (logged once until it answers again)"
        );
    }
}

/// A host of a several-host URL was connected to.
pub(crate) fn host_answered(server: &str) {
    if HOSTS_DOWN.lock().unwrap().remove(server) {
        tracing::info!(server, "database host answers again");
    }
}

/// Every host of the URL in order, each within `deadline`: the first that
/// answers and, under `target_session_attrs=read-write`, accepts writes.
async fn connect_each_host(
    target: &outbox_pgconn::Target,
    mut tls: outbox_pgconn::MakeRustlsConnect,
    deadline: Duration,
) -> Result<Client, DbError> {
    let mut passed = Vec::new();
    for (host, port) in &target.hosts {
        let server = format!("{host}:{port}");
        let why = match tokio::time::timeout(deadline, connect_host(target, &mut tls, host, *port)).await {
            Ok(Ok(Some(client))) => {
                host_answered(&server);
                return Ok(client);
            }
            Ok(Ok(None)) => format!("{server} does not accept writes (a standby)"),
            Ok(Err(e)) => format!("{server}: {e}"),
            Err(_) => format!("{server}: no answer within {deadline:?} (connect_timeout)"),
        };
        host_passed_over(&server, &why);
        passed.push(why);
    }
    Err(DbError::Connect {
        url: target.shown.clone(),
        going: false,
        message: format!(
            "no usable host ({}){}",
            passed.join("; "),
            if target.read_write { "; the relay needs the primary (target_session_attrs=read-write)" } else { "" }
        ),
    })
}

/// One host: TCP, TLS and authentication, then (read-write) whether it
/// accepts writes. `None`: it answered but is read-only.
async fn connect_host(
    target: &outbox_pgconn::Target,
    tls: &mut outbox_pgconn::MakeRustlsConnect,
    host: &str,
    port: u16,
) -> Result<Option<Client>, String> {
    use tokio_postgres::tls::MakeTlsConnect;
    let stream = tokio::net::TcpStream::connect((host, port)).await.map_err(|e| e.to_string())?;
    let _ = stream.set_nodelay(true);
    let connect =
        <_ as MakeTlsConnect<tokio::net::TcpStream>>::make_tls_connect(tls, host).map_err(|e| e.to_string())?;
    let (client, conn) =
        target.pg.connect_raw(stream, connect).await.map_err(|e| outbox_pgconn::explain(target, &e))?;
    tokio::spawn(async move {
        if let Err(e) = conn.await {
            tracing::debug!(error = %e, "postgres connection closed");
        }
    });
    if target.read_write {
        let ro = client.query_one("SHOW transaction_read_only", &[]).await.map_err(|e| e.to_string())?;
        if ro.get::<_, String>(0) == "on" {
            return Ok(None);
        }
    }
    Ok(Some(client))
}
