//! PostgreSQL connections, migrations and the start-up checks.

use std::str::FromStr;

use tokio_postgres::{Client, NoTls};

use crate::config::redact_url;

#[derive(Debug, thiserror::Error)]
pub enum DbError {
    #[error("cannot connect to PostgreSQL at {url}: {source}")]
    Connect { url: String, source: tokio_postgres::Error },
    #[error(transparent)]
    Query(#[from] tokio_postgres::Error),
    #[error("{0}")]
    Check(String),
}

/// Open a connection; its driver runs on a spawned task.
pub async fn connect(url: &str) -> Result<Client, DbError> {
    let (client, conn) = tokio_postgres::connect(url, NoTls)
        .await
        .map_err(|source| DbError::Connect { url: redact_url(url), source })?;
    tokio::spawn(async move {
        if let Err(e) = conn.await {
            tracing::debug!(error = %e, "postgres connection closed");
        }
    });
    Ok(client)
}

/// The migrations, in order; each runs once, recorded in `outbox_relay_migrations`.
pub const MIGRATIONS: &[(i32, &str, &str)] = &[
    (1, "outbox", include_str!("../migrations/0001_outbox.sql")),
    (2, "publication", include_str!("../migrations/0002_publication.sql")),
    (3, "spool", include_str!("../migrations/0003_spool.sql")),
    (4, "jobs", include_str!("../migrations/0004_jobs.sql")),
];

/// Apply the migrations not applied yet, under an advisory lock so concurrent
/// deploys do not race. Returns the versions applied now.
pub async fn migrate(client: &mut Client) -> Result<Vec<i32>, DbError> {
    client
        .batch_execute(
            "CREATE TABLE IF NOT EXISTS outbox_relay_migrations (
                 version int PRIMARY KEY,
                 name text NOT NULL,
                 applied_at timestamptz NOT NULL DEFAULT now())",
        )
        .await?;
    let tx = client.transaction().await?;
    tx.execute("SELECT pg_advisory_xact_lock(hashtext('outbox_relay_migrations'))", &[]).await?;
    let mut applied = Vec::new();
    for (version, name, sql) in MIGRATIONS {
        let done = tx
            .query_opt("SELECT 1 FROM outbox_relay_migrations WHERE version = $1", &[version])
            .await?
            .is_some();
        if done {
            continue;
        }
        tx.batch_execute(sql).await?;
        tx.execute(
            "INSERT INTO outbox_relay_migrations (version, name) VALUES ($1, $2)",
            &[version, name],
        )
        .await?;
        applied.push(*version);
    }
    tx.commit().await?;
    Ok(applied)
}

/// What the replication session needs from the URL.
pub struct ConnParts {
    pub host: String,
    pub port: u16,
    pub user: String,
    pub password: String,
    pub dbname: String,
}

pub fn conn_parts(url: &str) -> Result<ConnParts, DbError> {
    let c = tokio_postgres::Config::from_str(url)
        .map_err(|e| DbError::Check(format!("database_url {} is invalid: {e}", redact_url(url))))?;
    let host = match c.get_hosts().first() {
        Some(tokio_postgres::config::Host::Tcp(h)) => h.clone(),
        #[cfg(unix)]
        Some(tokio_postgres::config::Host::Unix(p)) => p.display().to_string(),
        None => "localhost".into(),
    };
    let port = c.get_ports().first().copied().unwrap_or(5432);
    let user = c
        .get_user()
        .map(str::to_owned)
        .or_else(|| std::env::var("PGUSER").ok())
        .ok_or_else(|| DbError::Check("database_url has no user name".into()))?;
    let password = c
        .get_password()
        .map(|p| String::from_utf8_lossy(p).into_owned())
        .or_else(|| std::env::var("PGPASSWORD").ok())
        .unwrap_or_default();
    let dbname = c.get_dbname().map(str::to_owned).unwrap_or_else(|| user.clone());
    Ok(ConnParts { host, port, user, password, dbname })
}

/// The outbox table exists (every mode needs it).
pub async fn check_outbox_table(client: &Client) -> Result<(), DbError> {
    let outbox = client.query_opt("SELECT to_regclass('outbox')::text", &[]).await?;
    if outbox.and_then(|r| r.get::<_, Option<String>>(0)).is_none() {
        return Err(DbError::Check(
            "the outbox table does not exist in this database: run `outbox-relay migrate --database-url ...` first".into(),
        ));
    }
    Ok(())
}

/// Start-up checks for CDC mode; each failure says how to fix it.
pub async fn check_cdc_prerequisites(client: &Client, publication: &str) -> Result<(), DbError> {
    let wal_level: String = client.query_one("SHOW wal_level", &[]).await?.get(0);
    if wal_level != "logical" {
        return Err(DbError::Check(format!(
            "wal_level is '{wal_level}', CDC mode needs 'logical': run ALTER SYSTEM SET wal_level = logical and restart PostgreSQL"
        )));
    }
    check_outbox_table(client).await?;
    let publ = client
        .query_opt("SELECT 1 FROM pg_publication WHERE pubname = $1", &[&publication])
        .await?;
    if publ.is_none() {
        return Err(DbError::Check(format!(
            "publication {publication:?} does not exist: run `outbox-relay migrate`, or CREATE PUBLICATION {publication} FOR TABLE outbox WITH (publish = 'insert')"
        )));
    }
    let row = client
        .query_one(
            "SELECT current_user::text, rolreplication OR rolsuper FROM pg_roles WHERE rolname = current_user",
            &[],
        )
        .await?;
    let (user, can): (String, bool) = (row.get(0), row.get(1));
    if !can {
        return Err(DbError::Check(format!(
            "role {user:?} may not replicate: ALTER ROLE {user} REPLICATION"
        )));
    }
    Ok(())
}
