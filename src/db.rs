//! PostgreSQL connections, migrations and the start-up checks.

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

/// The migrations, in order; each runs once, recorded in `outbox_relay_migrations`.
pub const MIGRATIONS: &[(i32, &str, &str)] = &[
    (1, "outbox", include_str!("../migrations/0001_outbox.sql")),
    (2, "publication", include_str!("../migrations/0002_publication.sql")),
    (3, "spool", include_str!("../migrations/0003_spool.sql")),
    // The consumer's jobs table and functions, from its own crate.
    (outbox_consumer::JOBS_MIGRATION, "jobs", outbox_consumer::JOBS_SQL),
    (5, "published", include_str!("../migrations/0005_published.sql")),
    // The consumer's protocol functions, from its own crate.
    (outbox_consumer::PROTOCOL_MIGRATION, "job protocol", outbox_consumer::PROTOCOL_SQL),
    (7, "runs survive id reuse", include_str!("../migrations/0007_runs_reuse.sql")),
    (8, "publish updates", include_str!("../migrations/0008_publish_updates.sql")),
    (9, "durable slot hand-off", include_str!("../migrations/0009_handoffs.sql")),
    (10, "runs list the table path's event ids", include_str!("../migrations/0010_runs_event_ids.sql")),
];

/// Apply the migrations not applied yet, under an advisory lock so concurrent
/// deploys do not race. Returns the versions applied now.
pub async fn migrate(client: &mut Client) -> Result<Vec<i32>, DbError> {
    Ok(outbox_consumer::apply_migrations(client, MIGRATIONS).await?)
}

/// The outbox table exists (every mode needs it).
pub async fn check_outbox_table(client: &Client) -> Result<(), DbError> {
    let outbox = client.query_opt("SELECT to_regclass('outbox')::text", &[]).await?;
    if outbox.and_then(|r| r.get::<_, Option<String>>(0)).is_none() {
        return Err(DbError::Check(
            "the outbox table does not exist in this database: run `outbox-relay migrate --database-url ...` first"
                .into(),
        ));
    }
    let row = client
        .query_one(
            "SELECT current_user::text, has_table_privilege('outbox', 'SELECT'), has_table_privilege('outbox', 'UPDATE')",
            &[],
        )
        .await?;
    let (user, select, update): (String, bool, bool) = (row.get(0), row.get(1), row.get(2));
    let missing: Vec<&str> =
        [("SELECT", select), ("UPDATE", update)].iter().filter(|(_, ok)| !ok).map(|(p, _)| *p).collect();
    if !missing.is_empty() {
        return Err(DbError::Check(format!(
            "role {user:?} lacks {} on the outbox table: GRANT {} ON outbox TO {user}",
            missing.join(" and "),
            missing.join(", ")
        )));
    }
    Ok(())
}

/// A new slot's hand-off is recorded in `outbox_relay_handoffs` while it runs
/// (CDC mode): the table and the role's SELECT, INSERT and DELETE on it.
pub async fn check_handoffs(client: &Client) -> Result<(), DbError> {
    let exists: bool = client.query_one("SELECT to_regclass('outbox_relay_handoffs') IS NOT NULL", &[]).await?.get(0);
    if !exists {
        return Err(DbError::Check(
            "the table outbox_relay_handoffs does not exist: run `outbox-relay migrate --database-url ...` (migration 9)"
                .into(),
        ));
    }
    let user: String = client.query_one("SELECT current_user::text", &[]).await?.get(0);
    for privilege in ["SELECT", "INSERT", "DELETE"] {
        let ok: bool =
            client.query_one("SELECT has_table_privilege('outbox_relay_handoffs', $1)", &[&privilege]).await?.get(0);
        if !ok {
            return Err(DbError::Check(format!(
                "role {user:?} lacks {privilege} on outbox_relay_handoffs, where a new slot's hand-off is recorded: GRANT SELECT, INSERT, DELETE ON outbox_relay_handoffs TO {user}"
            )));
        }
    }
    Ok(())
}

/// Majors the relay supports: row-filtered publications (shards) and the
/// replication views it reads need 15; failover slots need 17.
pub const MIN_SERVER_VERSION: i32 = 150_000;
pub const FAILOVER_SERVER_VERSION: i32 = 170_000;

/// Whether a server of `version_num` (`server_version_num`) can run the relay
/// as configured; the refusal says why and what to do.
pub fn server_support(version_num: i32, shown: &str, failover: bool) -> Result<(), String> {
    if version_num < MIN_SERVER_VERSION {
        return Err(format!(
            "PostgreSQL {shown} is not supported: the relay needs PostgreSQL 15 or newer (15, 16, 17 and 18 are tested); upgrade the server"
        ));
    }
    if failover && version_num < FAILOVER_SERVER_VERSION {
        return Err(format!(
            "failover = true needs PostgreSQL 17 or newer (failover slots); this server is {shown}: set failover = false (a promoted standby then gets a new slot and the table catch-up)"
        ));
    }
    Ok(())
}

/// The server: a supported major, the primary (not a standby), and failover
/// slots only where they exist. Returns `server_version_num`.
pub async fn check_server(client: &Client, server: &str, failover: bool) -> Result<i32, DbError> {
    let r = client
        .query_one(
            "SELECT current_setting('server_version_num')::int, current_setting('server_version'), pg_is_in_recovery()",
            &[],
        )
        .await?;
    let (num, shown, recovery): (i32, String, bool) = (r.get(0), r.get(1), r.get(2));
    server_support(num, &shown, failover).map_err(DbError::Check)?;
    if recovery {
        return Err(DbError::Check(format!(
            "{server} is a standby (in recovery): the relay writes to the outbox and streams from the primary; give the primary's address, or every server (postgres://USER@primary,standby/DB) and the primary is taken"
        )));
    }
    Ok(num)
}

/// Whether the current role may DELETE from the outbox (the retention sweeper).
pub async fn can_delete_outbox(client: &Client) -> Result<bool, DbError> {
    Ok(client.query_one("SELECT has_table_privilege('outbox', 'DELETE')", &[]).await?.get(0))
}

/// Where PostgreSQL runs, as far as the fixes for CDC differ: managed
/// services forbid `ALTER ROLE … REPLICATION` and `ALTER SYSTEM`, and grant
/// replication through a role or a flag of their own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Platform {
    SelfManaged,
    /// Amazon RDS and Aurora (`rds.logical_replication` is defined).
    Rds,
    /// Google Cloud SQL (`cloudsql.logical_decoding`).
    CloudSql,
    /// Azure Database for PostgreSQL flexible server (`azure.extensions`).
    Azure,
}

impl Platform {
    /// Told by the settings only these services define.
    pub async fn detect(client: &Client) -> Result<Platform, DbError> {
        let r = client
            .query_one(
                "SELECT current_setting('rds.logical_replication', true) IS NOT NULL,
                        current_setting('cloudsql.logical_decoding', true) IS NOT NULL,
                        current_setting('azure.extensions', true) IS NOT NULL",
                &[],
            )
            .await?;
        Ok(match (r.get(0), r.get(1), r.get(2)) {
            (true, _, _) => Platform::Rds,
            (_, true, _) => Platform::CloudSql,
            (_, _, true) => Platform::Azure,
            _ => Platform::SelfManaged,
        })
    }

    /// How to let `user` open a replication connection here.
    pub fn replication_fix(self, user: &str) -> String {
        match self {
            Platform::SelfManaged => format!("ALTER ROLE {user} REPLICATION"),
            Platform::Rds => format!(
                "GRANT rds_replication TO {user} (RDS and Aurora: the master user cannot be given REPLICATION; membership of rds_replication is what allows it)"
            ),
            Platform::CloudSql => {
                format!("ALTER ROLE {user} WITH REPLICATION, as a cloudsqlsuperuser (Cloud SQL; the cloudsql.logical_decoding flag must be on)")
            }
            Platform::Azure => format!("ALTER ROLE {user} REPLICATION, as a member of azure_pg_admin (Azure flexible server)"),
        }
    }

    /// How to make `wal_level` logical here.
    pub fn wal_level_fix(self) -> &'static str {
        match self {
            Platform::SelfManaged => "run ALTER SYSTEM SET wal_level = logical and restart PostgreSQL",
            Platform::Rds => {
                "set rds.logical_replication = 1 in the instance's DB parameter group (Aurora: the DB cluster parameter group) and reboot"
            }
            Platform::CloudSql => "set the cloudsql.logical_decoding flag to on (the instance restarts)",
            Platform::Azure => "set the server parameter wal_level to logical and restart the server",
        }
    }
}

/// Start-up checks for CDC mode that SQL can answer; each failure says how to
/// fix it. Whether the role may replicate is decided by trying
/// (`source::cdc::check_cdc`), not from its attributes: managed services
/// grant it through roles of their own.
pub async fn check_cdc_prerequisites(client: &Client, publication: &str) -> Result<(), DbError> {
    let wal_level: String = client.query_one("SHOW wal_level", &[]).await?.get(0);
    if wal_level != "logical" {
        let fix = Platform::detect(client).await?.wal_level_fix();
        return Err(DbError::CdcUnavailable(format!("wal_level is '{wal_level}', CDC mode needs 'logical': {fix}")));
    }
    check_outbox_table(client).await?;
    let publ = client.query_opt("SELECT 1 FROM pg_publication WHERE pubname = $1", &[&publication]).await?;
    if publ.is_none() {
        return Err(DbError::CdcUnavailable(format!(
            "publication {publication:?} does not exist: run `outbox-relay migrate`, or CREATE PUBLICATION {publication} FOR TABLE outbox WITH (publish = 'insert, update, delete')"
        )));
    }
    Ok(())
}

/// The destinations a publication's row filter lets through, from
/// `pg_publication_tables.rowfilter` (`None`: no filter, every row).
pub fn filter_destinations(rowfilter: Option<&str>) -> Option<std::collections::BTreeSet<String>> {
    let f = rowfilter?;
    let mut out = std::collections::BTreeSet::new();
    let mut chars = f.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '\'' {
            continue;
        }
        let mut lit = String::new();
        loop {
            match chars.next() {
                Some('\'') if chars.peek() == Some(&'\'') => {
                    chars.next();
                    lit.push('\'');
                }
                Some('\'') | None => break,
                Some(ch) => lit.push(ch),
            }
        }
        out.insert(lit);
    }
    Some(out)
}

/// Shards: the publication's row filter must be exactly this relay's
/// destinations, and no other filtered publication of the outbox may carry
/// any of them (two relays would both send those rows). Returns whether this
/// relay's publication is filtered (sharded).
pub async fn check_shard(client: &Client, publication: &str, destinations: &[String]) -> Result<bool, DbError> {
    let rows = client
        .query(
            "SELECT pubname::text, rowfilter FROM pg_publication_tables WHERE tablename = 'outbox' AND schemaname = current_schema()",
            &[],
        )
        .await?;
    let mine: std::collections::BTreeSet<String> = destinations.iter().cloned().collect();
    let mut sharded = false;
    let mut shards = Vec::new();
    for r in &rows {
        let (name, filter): (String, Option<String>) = (r.get(0), r.get(1));
        let set = filter_destinations(filter.as_deref());
        if name == publication {
            if let Some(set) = set {
                sharded = true;
                if set != mine {
                    return Err(DbError::Check(format!(
                        "publication {publication:?} carries destinations {set:?} but this relay is configured for {mine:?}: they must be the same (or use another publication)"
                    )));
                }
            }
            continue;
        }
        if let Some(set) = set {
            let shared: Vec<&String> = set.intersection(&mine).collect();
            if !shared.is_empty() {
                return Err(DbError::Check(format!(
                    "destinations {shared:?} are also carried by publication {name:?} (another relay's shard): shards must have disjoint destinations"
                )));
            }
            shards.push(name);
        }
    }
    if !sharded && !shards.is_empty() {
        tracing::warn!(
            publication,
            ?shards,
            "this relay reads every row of the outbox while shard publications exist beside it: rows of the shards' destinations, which this relay does not know, end DEAD (unknown_destination) unless they are in its destinations; give this relay a shard of its own (`slot create` with a publication filtered to its destinations)"
        );
    }
    Ok(sharded)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn supported_majors_and_failover_slots() {
        assert!(server_support(140_012, "14.12", false).unwrap_err().contains("needs PostgreSQL 15 or newer"));
        assert!(server_support(150_008, "15.8", false).is_ok());
        assert!(server_support(160_004, "16.4", true).unwrap_err().contains("failover = true needs PostgreSQL 17"));
        assert!(server_support(170_010, "17.10", true).is_ok());
        assert!(server_support(180_004, "18.4", true).is_ok());
    }
}
