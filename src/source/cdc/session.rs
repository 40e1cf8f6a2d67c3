//! Opening a replication session: the SQL connection, the slot looked up,
//! the replication connection, each within its deadline.

use std::sync::atomic::Ordering;
use std::time::Duration;

use pgwire_replication::{ReplicationClient, ReplicationConfig};
use replication::Lsn;
use tokio::sync::watch;
use tokio_postgres::Client;

use crate::db;
use crate::db::Db;
use crate::pipeline::budget::Memory;
use crate::pipeline::settings::SlotSettings;
use crate::source::mapped_table::catch_up_all;

use super::slot::{create_slot_exporting, hand_off_begins, hand_off_done, import_snapshot, prepare_slot, SlotState};
use super::slot::{drop_unfinished_slot, finish_hand_off, hand_to_table, make_failover};
use super::{CdcError, StreamContext, STATUS_INTERVAL};

/// A session's connections and where it starts.
pub(crate) struct Opened {
    pub(crate) sql: Client,
    pub(crate) repl: ReplicationClient,
    pub(crate) start_lsn: Lsn,
    /// The server's WAL position when the session began: replayed events
    /// before it are filtered against the table.
    pub(crate) startup_lsn: Lsn,
    /// Mapped tables the catch-up could not claim ([`crate::source::mapped_table::CaughtUp::skipped`]).
    pub(crate) skipped: Vec<usize>,
}

/// Connect, look the slot up (recreating a lost one), open the replication
/// connection, catch mapped tables up, and start streaming; each step within
/// its deadline.
pub(crate) async fn open_session(ctx: &StreamContext, stop: &watch::Receiver<bool>) -> Result<Opened, CdcError> {
    let (cfg, db) = (&ctx.parts.settings.slot, &ctx.db);
    let sql = db.connect().await?;
    let startup_lsn = db.within("reading the current WAL position", current_wal_lsn(&sql)).await?;
    let slot = db.within("looking up the replication slot", prepare_slot(&sql, &cfg.name)).await?;
    match &slot {
        SlotState::Lost { reason } => ctx.parts.metrics.slot_recreated.with_label_values(&[reason]).inc(),
        SlotState::Missing if ctx.slot_seen.load(Ordering::Relaxed) => {
            tracing::error!(slot = %cfg.name, "replication slot disappeared under the relay (dropped?); creating it again and catching up from the outbox table");
            ctx.parts.metrics.slot_recreated.with_label_values(&["dropped"]).inc();
        }
        _ => {}
    }
    let mut repl = connect_replication(db, cfg, ctx.parts.settings.memory).await?;
    // A new slot comes with a snapshot: the rows it will not stream are
    // handed to the table path before anything is published.
    let start_lsn = match slot {
        SlotState::Exists { confirmed_flush, failover } => {
            resume_slot(ctx, &sql, &mut repl, failover).await?;
            confirmed_flush
        }
        SlotState::Missing | SlotState::Lost { .. } => create_slot(ctx, &sql, &mut repl).await?,
    };
    // Mapped tables' rows their published column says were not published
    // (a polling relay's, or older than a new slot), now that the slot
    // streams everything after: the replay filter skips what this sent, for
    // the session's start position is read again after it.
    let caught_up = catch_up_all(db, &ctx.parts, stop).await?;
    let startup_lsn = if caught_up.settled > 0 {
        db.within("reading the current WAL position", current_wal_lsn(&sql)).await?
    } else {
        startup_lsn
    };
    db.within("starting replication", async {
        repl.start().await?;
        repl.wait_started().await?;
        Ok::<(), CdcError>(())
    })
    .await?;
    Ok(Opened { sql, repl, start_lsn, startup_lsn, skipped: caught_up.skipped })
}

/// An existing slot: made FAILOVER if configured so, and an interrupted
/// hand-off of older rows finished.
async fn resume_slot(
    ctx: &StreamContext,
    sql: &Client,
    repl: &mut ReplicationClient,
    failover: bool,
) -> Result<(), CdcError> {
    let (cfg, db) = (&ctx.parts.settings.slot, &ctx.db);
    if cfg.failover && !failover {
        db.within("altering the slot to FAILOVER", make_failover(repl, &cfg.name)).await?;
    }
    let pending = finish_hand_off(sql, &cfg.name, ctx.shard.as_deref());
    if let Some((rows, until)) = db.within("finishing an interrupted slot hand-off", pending).await? {
        ctx.handed_until.raise(until);
        tracing::warn!(slot = %cfg.name, rows, "the slot's hand-off of older rows had not finished (the relay stopped during it): every NEW row not streamed yet handed to the table path");
    }
    Ok(())
}

/// A new slot, and the NEW rows its snapshot sees handed to the table path
/// (the slot will never stream them); its consistent point.
async fn create_slot(ctx: &StreamContext, sql: &Client, repl: &mut ReplicationClient) -> Result<Lsn, CdcError> {
    let (cfg, db) = (&ctx.parts.settings.slot, &ctx.db);
    // Recorded first: a relay stopped before the hand-off ends leaves the
    // record, and the next session finishes it.
    db.within("recording the slot hand-off", hand_off_begins(sql, &cfg.name)).await?;
    // Creating a slot waits for running transactions: no deadline, but
    // shutdown still interrupts it.
    let (consistent, snapshot) = create_slot_exporting(repl, &cfg.name, cfg.failover).await?;
    let snap_client = db.connect().await?;
    db.within("importing the new slot's snapshot", import_snapshot(&snap_client, &snapshot)).await?;
    // A task of its own: a shutdown arriving meanwhile does not cut the
    // hand-off short.
    let handed = match tokio::spawn(hand_to_table(snap_client, ctx.shard.clone(), consistent)).await {
        Ok(Ok(n)) => n,
        failed => {
            // The slot must not stay without its hand-off: drop it, so the
            // next session creates it again.
            drop_unfinished_slot(db, &cfg.name, sql).await;
            return Err(match failed {
                Ok(Err(e)) => e,
                Err(e) => CdcError::Protocol(format!("hand-off task: {e}")),
                Ok(Ok(_)) => unreachable!(),
            });
        }
    };
    db.within("recording the end of the slot hand-off", hand_off_done(sql, &cfg.name)).await?;
    tracing::info!(slot = %cfg.name, consistent_point = %consistent, rows = handed, "created replication slot; NEW rows written before it handed to the table path");
    Ok(consistent)
}

/// Every CDC prerequisite: what SQL can tell ([`crate::source::cdc::publication::check_cdc_prerequisites`]),
/// then the capability itself: a replication connection is opened and
/// answers IDENTIFY_SYSTEM, within the deadlines. A refusal names the fix
/// for the platform (self-managed, RDS/Aurora, Cloud SQL, Azure).
pub async fn check_cdc(sql: &Client, db: &Db, cfg: &SlotSettings, memory: Memory) -> Result<(), db::DbError> {
    crate::source::cdc::publication::check_cdc_prerequisites(sql, &cfg.publication).await?;
    check_slot_kind(sql, &cfg.name).await?;
    let query_timeout = db.deadlines.query;
    let probe = async {
        let mut repl = connect_replication(db, cfg, memory).await?;
        let answer = tokio::time::timeout(query_timeout, repl.identify_system()).await;
        // A gated session not started ends when dropped.
        drop(repl);
        match answer {
            Ok(r) => r.map(|_| ()).map_err(CdcError::from),
            Err(_) => Err(CdcError::Protocol(format!("IDENTIFY_SYSTEM did not answer within {query_timeout:?}"))),
        }
    };
    match probe.await {
        Ok(()) => Ok(()),
        Err(CdcError::Db(e @ db::DbError::Timeout { .. })) => Err(e),
        Err(e) => {
            let user: String = sql.query_one("SELECT current_user::text", &[]).await?.get(0);
            let fix = db::server::Platform::detect(sql).await?.replication_fix(&user);
            Err(db::DbError::CdcUnavailable(format!(
                "role {user:?} may not replicate (a replication connection was refused: {e}): {fix}"
            )))
        }
    }
}

/// A slot of that name that is not a pgoutput slot of this database (another
/// plugin, physical, another database) is someone else's: refused at start-up.
async fn check_slot_kind(sql: &Client, slot: &str) -> Result<(), db::DbError> {
    let row = sql
        .query_opt(
            "SELECT slot_type, plugin, database::text, database = current_database() FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await?;
    let Some(r) = row else { return Ok(()) };
    let (kind, plugin, database, same): (String, Option<String>, Option<String>, Option<bool>) =
        (r.get(0), r.get(1), r.get(2), r.get(3));
    if plugin.as_deref() == Some("pgoutput") && same == Some(true) {
        return Ok(());
    }
    let what = match (kind.as_str(), plugin, database) {
        ("physical", _, _) => "a physical slot".to_string(),
        (_, Some(p), _) if p != "pgoutput" => format!("a logical slot of plugin {p:?}"),
        (_, _, d) => format!("a slot of database {:?}", d.unwrap_or_default()),
    };
    Err(db::DbError::Check(format!(
        "replication slot {slot:?} already exists as {what}, not a pgoutput slot of this database: set `slot` to another name, or drop that slot if nothing uses it"
    )))
}

/// The replication connection to the primary: the URL's hosts tried in
/// turn, each within `connect_timeout`; with `target_session_attrs=read-write`
/// (the default) a server in recovery is passed over, so a list of servers
/// follows a promotion. One host: its own error, unchanged.
pub(crate) async fn connect_replication(
    db: &Db,
    slot: &SlotSettings,
    memory: Memory,
) -> Result<ReplicationClient, CdcError> {
    let t = db.target()?;
    let connect_timeout = db.deadlines.connect;
    let mut passed = Vec::new();
    for (host, port) in &t.hosts {
        let server = format!("{host}:{port}");
        // Connecting and asking whether it is a standby, under one connect
        // deadline: a host that accepts TCP and never answers costs that.
        let one = async {
            match connect_host(db, replication_config(slot, memory, &t, host, *port)).await {
                Ok(repl) if !t.read_write => Ok(Ok(repl)),
                Ok(repl) => in_recovery(db, repl).await,
                Err(e) => Err(e),
            }
        };
        let attempt = match tokio::time::timeout(connect_timeout, one).await {
            Ok(a) => a,
            Err(_) => Err(CdcError::Db(db::DbError::Timeout {
                server: server.clone(),
                what: "opening the replication connection and asking pg_is_in_recovery()".into(),
                after: connect_timeout,
                key: "connect_timeout",
            })),
        };
        let why = match attempt {
            Ok(Ok(repl)) => {
                db::host_answered(&server);
                return Ok(repl);
            }
            Ok(Err(())) => format!("{server} is a standby (in recovery)"),
            Err(e) if t.hosts.len() == 1 => return Err(e),
            Err(e) => format!("{server}: {e}"),
        };
        db::host_passed_over(&server, &why);
        passed.push(why);
    }
    Err(CdcError::Db(db::DbError::Connect {
        url: t.shown.clone(),
        going: false,
        message: format!(
            "no primary for the replication connection ({}); the relay needs the primary (target_session_attrs=read-write) and retries",
            passed.join("; ")
        ),
    }))
}

/// One host, within `connect_timeout`.
async fn connect_host(db: &Db, rc: ReplicationConfig) -> Result<ReplicationClient, CdcError> {
    let server = format!("{}:{}", rc.host, rc.port);
    match tokio::time::timeout(db.deadlines.connect, ReplicationClient::connect_gated(rc)).await {
        Ok(r) => Ok(r?),
        Err(_) => Err(CdcError::Db(db::DbError::Timeout {
            server,
            what: "opening the replication connection".into(),
            after: db.deadlines.connect,
            key: "connect_timeout",
        })),
    }
}

/// The session back if its server is a primary, `Err(())` if it is in
/// recovery (a walsender answers plain SQL on a database connection).
async fn in_recovery(db: &Db, mut repl: ReplicationClient) -> Result<Result<ReplicationClient, ()>, CdcError> {
    let rows = match tokio::time::timeout(db.deadlines.query, repl.simple_query("SELECT pg_is_in_recovery()")).await {
        Ok(r) => r?,
        Err(_) => {
            return Err(CdcError::Protocol(format!(
                "pg_is_in_recovery() did not answer within {:?}",
                db.deadlines.query
            )))
        }
    };
    let standby = rows.first().and_then(|r| r.first()).and_then(|v| v.as_deref()) == Some(b"t".as_slice());
    Ok(if standby { Err(()) } else { Ok(repl) })
}

/// The replication connection's settings for one host of the URL.
pub(crate) fn replication_config(
    cfg: &SlotSettings,
    memory: Memory,
    t: &outbox_pgconn::Target,
    host: &str,
    port: u16,
) -> ReplicationConfig {
    let mode = match t.ssl {
        outbox_pgconn::SslMode::Disable => pgwire_replication::SslMode::Disable,
        outbox_pgconn::SslMode::Prefer => pgwire_replication::SslMode::Prefer,
        outbox_pgconn::SslMode::Require if t.root_cert.is_some() => pgwire_replication::SslMode::VerifyCa,
        outbox_pgconn::SslMode::Require => pgwire_replication::SslMode::Require,
        outbox_pgconn::SslMode::VerifyCa => pgwire_replication::SslMode::VerifyCa,
        outbox_pgconn::SslMode::VerifyFull => pgwire_replication::SslMode::VerifyFull,
    };
    let mut tls = pgwire_replication::TlsConfig { mode, ca_pem_path: t.root_cert.clone(), ..Default::default() };
    if let Some((c, k)) = &t.client_cert {
        tls = tls.with_client_cert(c.clone(), k.clone());
    }
    ReplicationConfig::new(
        host.to_string(),
        t.user.clone(),
        t.password.clone().unwrap_or_default(),
        t.dbname.clone(),
        cfg.name.clone(),
        cfg.publication.clone(),
    )
    .with_port(port)
    .with_tls(tls)
    .with_status_interval(STATUS_INTERVAL)
    .with_wakeup_interval(Duration::from_secs(5))
    .with_buffer_size(memory.replication_buffer_events())
    .with_application_name(format!("outbox-relay:{}", cfg.name))
    // pgoutput sends values as text in the walsender's DateStyle: ISO is
    // what the decoder reads (`deliver_at`), whatever the server's default.
    .with_options("-c datestyle=ISO,MDY")
}

pub(crate) async fn current_wal_lsn(sql: &Client) -> Result<Lsn, CdcError> {
    let s: String = sql.query_one("SELECT pg_current_wal_lsn()::text", &[]).await?.get(0);
    s.parse().map_err(|e| CdcError::Protocol(format!("{e}")))
}
