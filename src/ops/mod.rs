//! What operators run beside the relay: `status`, `slot status|create|drop`,
//! `dead list|redrive`. Each reads or changes the database directly; none
//! needs the relay to be running.

use pgwire_replication::ReplicationClient;
use tokio_postgres::Client;

use crate::source::cdc::{create_slot_exporting, import_snapshot, replication_config, CdcError};
use crate::config::{Config, Mode};
use crate::db;

impl From<tokio_postgres::Error> for OpsError {
    fn from(e: tokio_postgres::Error) -> Self {
        OpsError::Pg(e)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum OpsError {
    #[error(transparent)]
    Db(#[from] db::DbError),
    #[error("database: {}", db::describe(.0))]
    Pg(tokio_postgres::Error),
    #[error(transparent)]
    Cdc(#[from] CdcError),
    #[error("{0}")]
    Refused(String),
}

/// Format version of `status --json`; bumped only when a field changes meaning
/// or disappears (new fields may be added).
pub const STATUS_FORMAT: u32 = 1;

/// What `outbox-relay status` reports.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct Status {
    pub format: u32,
    /// The mode in the configuration.
    pub mode: String,
    /// What `run` would use now (`auto` resolved against the server).
    pub effective_mode: String,
    /// Why CDC is not possible, when it is not.
    pub cdc_unavailable: Option<String>,
    pub slot: SlotStatus,
    pub destinations: Vec<DestinationStatus>,
}

#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct SlotStatus {
    pub name: String,
    pub exists: bool,
    pub active: Option<bool>,
    pub active_pid: Option<i32>,
    pub wal_status: Option<String>,
    /// Current WAL minus the confirmed flush LSN.
    pub lag_bytes: Option<i64>,
    /// Current WAL minus the restart LSN: what the server keeps for the slot.
    pub retained_wal_bytes: Option<i64>,
    pub confirmed_flush_lsn: Option<String>,
}

#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct DestinationStatus {
    pub destination: String,
    pub configured: bool,
    /// NEW rows for the stream or the poller (`next_attempt_at` unset).
    pub new: i64,
    /// NEW rows handed to the table path (spooled, retried later, redriven).
    pub spooled: i64,
    pub dead: i64,
    /// Age of the oldest NEW row (spooled or not).
    pub oldest_new_age_seconds: Option<f64>,
}

pub async fn slot_status(client: &Client, slot: &str) -> Result<SlotStatus, tokio_postgres::Error> {
    let row = client
        .query_opt(
            "SELECT active, active_pid, wal_status, (pg_current_wal_lsn() - confirmed_flush_lsn)::bigint,
                    (pg_current_wal_lsn() - restart_lsn)::bigint, confirmed_flush_lsn::text
               FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await?;
    Ok(SlotStatus {
        name: slot.to_string(),
        exists: row.is_some(),
        active: row.as_ref().map(|r| r.get(0)),
        active_pid: row.as_ref().and_then(|r| r.get(1)),
        wal_status: row.as_ref().and_then(|r| r.get(2)),
        lag_bytes: row.as_ref().and_then(|r| r.get(3)),
        retained_wal_bytes: row.as_ref().and_then(|r| r.get(4)),
        confirmed_flush_lsn: row.as_ref().and_then(|r| r.get(5)),
    })
}

pub async fn status(client: &Client, config: &Config) -> Result<Status, OpsError> {
    // Before `migrate` there is nothing to report: say what to run.
    db::check_outbox_table(client).await?;
    let cdc = db::check_cdc_prerequisites(client, &config.publication).await;
    let cdc_unavailable = match cdc {
        Ok(()) => None,
        Err(db::DbError::Check(why)) => Some(why),
        Err(e) => return Err(e.into()),
    };
    let effective = match (config.mode, &cdc_unavailable) {
        (Mode::Polling, _) | (Mode::Auto, Some(_)) => Mode::Polling,
        _ => Mode::Cdc,
    };
    let rows = client
        .query(
            "SELECT destination,
                    count(*) FILTER (WHERE status = 'NEW' AND next_attempt_at IS NULL),
                    count(*) FILTER (WHERE status = 'NEW' AND next_attempt_at IS NOT NULL),
                    count(*) FILTER (WHERE status = 'DEAD'),
                    extract(epoch FROM now() - min(created_at) FILTER (WHERE status = 'NEW'))::float8
               FROM outbox WHERE status IN ('NEW', 'DEAD') GROUP BY destination ORDER BY destination",
            &[],
        )
        .await?;
    let mut destinations: Vec<DestinationStatus> = rows
        .iter()
        .map(|r| DestinationStatus {
            destination: r.get(0),
            configured: config.destinations.contains_key(r.get::<_, &str>(0)),
            new: r.get(1),
            spooled: r.get(2),
            dead: r.get(3),
            oldest_new_age_seconds: r.get(4),
        })
        .collect();
    for name in config.destinations.keys() {
        if !destinations.iter().any(|d| &d.destination == name) {
            destinations.push(DestinationStatus {
                destination: name.clone(),
                configured: true,
                new: 0,
                spooled: 0,
                dead: 0,
                oldest_new_age_seconds: None,
            });
        }
    }
    destinations.sort_by(|a, b| a.destination.cmp(&b.destination));
    Ok(Status {
        format: STATUS_FORMAT,
        mode: config.mode.to_string(),
        effective_mode: effective.to_string(),
        cdc_unavailable,
        slot: slot_status(client, &config.slot).await?,
        destinations,
    })
}

pub fn format_slot(s: &SlotStatus) -> String {
    if !s.exists {
        return format!(
            "slot {}: does not exist (the relay creates it at start, or `outbox-relay slot create`)\n",
            s.name
        );
    }
    format!(
        "slot {}: {} wal_status={} lag={} bytes retained={} bytes confirmed_flush_lsn={}\n",
        s.name,
        match (s.active, s.active_pid) {
            (Some(true), Some(pid)) => format!("active (pid {pid})"),
            (Some(true), None) => "active".into(),
            _ => "INACTIVE (retaining WAL)".into(),
        },
        s.wal_status.as_deref().unwrap_or("?"),
        s.lag_bytes.unwrap_or(0),
        s.retained_wal_bytes.unwrap_or(0),
        s.confirmed_flush_lsn.as_deref().unwrap_or("?"),
    )
}

pub fn format_status(s: &Status) -> String {
    let mut out = format!("mode: {} (configured {})\n", s.effective_mode, s.mode);
    if let (Some(why), "auto" | "cdc") = (&s.cdc_unavailable, s.mode.as_str()) {
        out += &format!("CDC unavailable: {why}\n");
    }
    out += &format_slot(&s.slot);
    out += &format!("{:<24} {:>10} {:>10} {:>10} {:>14}\n", "destination", "NEW", "spooled", "DEAD", "oldest NEW (s)");
    for d in &s.destinations {
        out += &format!(
            "{:<24} {:>10} {:>10} {:>10} {:>14}{}\n",
            d.destination,
            d.new,
            d.spooled,
            d.dead,
            d.oldest_new_age_seconds.map(|a| format!("{a:.1}")).unwrap_or_else(|| "-".into()),
            if d.configured { "" } else { "  (not configured)" }
        );
    }
    out
}

/// What `slot create` did.
#[derive(Debug, serde::Serialize)]
pub struct SlotCreated {
    pub slot: String,
    pub consistent_point: String,
    /// NEW rows committed before the slot existed, handed to the table path
    /// (the slot will never stream them).
    pub handed_to_table: u64,
}

/// Create the slot with an exported snapshot. The NEW rows that snapshot sees
/// are exactly the rows the slot will never stream: they get a
/// `next_attempt_at`, so the relay's table path publishes them.
pub async fn slot_create(config: &Config) -> Result<SlotCreated, OpsError> {
    let sql = db::connect(&config.database_url).await?;
    let destinations: Vec<String> = config.destinations.keys().cloned().collect();
    let exists =
        sql.query_opt("SELECT 1 FROM pg_publication WHERE pubname = $1", &[&config.publication]).await?.is_some();
    if !exists {
        // A relay's own shard: a publication filtered to its destinations.
        db::check_shard(&sql, &config.publication, &destinations).await?;
        let list: Vec<String> = destinations.iter().map(|d| format!("'{}'", d.replace('\'', "''"))).collect();
        sql.batch_execute(&format!(
            "CREATE PUBLICATION \"{}\" FOR TABLE outbox WHERE (destination IN ({})) WITH (publish = 'insert')",
            config.publication.replace('"', ""),
            list.join(", ")
        ))
        .await?;
    }
    db::check_cdc_prerequisites(&sql, &config.publication).await?;
    let sharded = db::check_shard(&sql, &config.publication, &destinations).await?;
    if slot_status(&sql, &config.slot).await?.exists {
        return Err(OpsError::Refused(format!("slot {:?} already exists", config.slot)));
    }
    let mut repl = ReplicationClient::connect_gated(replication_config(config)?).await.map_err(CdcError::from)?;
    let created = async {
        let (consistent, snapshot) = create_slot_exporting(&mut repl, &config.slot).await?;
        let snap = db::connect(&config.database_url).await?;
        import_snapshot(&snap, &snapshot).await?;
        let only: Option<Vec<String>> = sharded.then(|| destinations.clone());
        let ids: Vec<i64> = snap
            .query(
                "SELECT id FROM outbox WHERE status = 'NEW' AND next_attempt_at IS NULL AND ($1::text[] IS NULL OR destination = ANY($1))",
                &[&only],
            )
            .await?
            .iter()
            .map(|r| r.get(0))
            .collect();
        snap.batch_execute("COMMIT").await?;
        Ok::<_, OpsError>((consistent, ids))
    }
    .await;
    repl.abort();
    let (consistent, ids) = created?;
    let mut handed = 0;
    for chunk in ids.chunks(10_000) {
        handed += sql
            .execute(
                "UPDATE outbox SET next_attempt_at = now()
                  WHERE id = ANY($1) AND status = 'NEW' AND next_attempt_at IS NULL",
                &[&chunk],
            )
            .await?;
    }
    Ok(SlotCreated { slot: config.slot.clone(), consistent_point: consistent.to_string(), handed_to_table: handed })
}

/// Drop the slot; refused while a relay reads it.
pub async fn slot_drop(config: &Config) -> Result<(), OpsError> {
    let sql = db::connect(&config.database_url).await?;
    let s = slot_status(&sql, &config.slot).await?;
    if !s.exists {
        return Err(OpsError::Refused(format!("slot {:?} does not exist", config.slot)));
    }
    if s.active == Some(true) {
        return Err(OpsError::Refused(format!(
            "slot {:?} is in use by pid {}: stop the relay reading it first",
            config.slot,
            s.active_pid.map(|p| p.to_string()).unwrap_or_else(|| "?".into())
        )));
    }
    sql.execute("SELECT pg_drop_replication_slot($1)", &[&config.slot]).await?;
    Ok(())
}

/// A DEAD row, for `dead list`.
#[derive(Debug, serde::Serialize)]
pub struct DeadRow {
    pub id: i64,
    pub destination: String,
    pub event_id: String,
    pub attempts: i32,
    pub last_error: Option<String>,
    pub created_at: String,
}

pub async fn dead_list(
    client: &Client,
    destination: Option<&str>,
    limit: i64,
) -> Result<Vec<DeadRow>, tokio_postgres::Error> {
    let rows = client
        .query(
            "SELECT id, destination, event_id, attempts, last_error, created_at::text
               FROM outbox
              WHERE status = 'DEAD' AND ($1::text IS NULL OR destination = $1)
              ORDER BY id LIMIT $2",
            &[&destination, &limit],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| DeadRow {
            id: r.get(0),
            destination: r.get(1),
            event_id: r.get(2),
            attempts: r.get(3),
            last_error: r.get(4),
            created_at: r.get(5),
        })
        .collect())
}

pub fn format_dead(rows: &[DeadRow]) -> String {
    let mut out = format!("{:>10}  {:<16} {:<32} {:>8}  last_error\n", "id", "destination", "event_id", "attempts");
    for r in rows {
        out += &format!(
            "{:>10}  {:<16} {:<32} {:>8}  {}\n",
            r.id,
            r.destination,
            r.event_id,
            r.attempts,
            r.last_error.as_deref().unwrap_or("")
        );
    }
    out
}

/// DEAD → NEW with attempts reset and `next_attempt_at = now()`, so the table
/// path (the polling relay, or a CDC relay's spool drain) sends it again.
/// Returns rows redriven.
pub async fn dead_redrive(
    client: &Client,
    destination: Option<&str>,
    id: Option<i64>,
) -> Result<u64, tokio_postgres::Error> {
    client
        .execute(
            "UPDATE outbox
                SET status = 'NEW', attempts = 0, last_error = NULL, next_attempt_at = now(), published_at = NULL
              WHERE status = 'DEAD' AND ($1::text IS NULL OR destination = $1) AND ($2::bigint IS NULL OR id = $2)",
            &[&destination, &id],
        )
        .await
}
