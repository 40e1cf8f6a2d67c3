//! The CDC source: the slot's pgoutput stream, decoded, routed to lanes, with
//! the watermark deciding what is confirmed.
//!
//! One call of [`run_stream`] is one replication session. Any error ends it
//! with everything unsettled abandoned: the slot was never confirmed past
//! those events, so the next session reads them again (at-least-once), and
//! rows already marked are filtered out of the replay.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pgwire_replication::{ReplicationClient, ReplicationConfig, ReplicationEvent};
use replication::{decode, pg_micros_to_unix_micros, LogicalMessage, Lsn, RelationCache, Relation, Tuple, TupleValue};
use tokio::sync::{mpsc, watch, Notify};
use tokio::task::JoinSet;
use tokio_postgres::Client;

use crate::budget::Budget;
use crate::config::Config;
use crate::db;
use crate::event::{prepare, DeadReason, OutboxEvent, QueueInfo, OUTBOX_COLUMNS};
use crate::lane::{run_lane, LaneConfig, LaneItem, LaneState, RetryPolicy};
use crate::metrics::Metrics;
use crate::publisher::Publisher;
use crate::settle::{run_settler, Backoff, Outcome, Settlement};
use crate::watermark::{TxnSeq, Watermark};

/// Events of one transaction are checked against the table and dispatched in
/// chunks of this many, or of this many bytes, whichever comes first.
const CHUNK: usize = 1_000;
const CHUNK_BYTES: usize = 4 << 20;
/// Items a lane's channel holds (each holds its share of the budget).
const LANE_CHANNEL: usize = 4_096;
/// Lanes may lag this long behind a shutdown request before they are abandoned.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);
const STATUS_INTERVAL: Duration = Duration::from_millis(500);
/// Prefix of the heartbeat messages the relay writes.
pub const HEARTBEAT_PREFIX: &str = "outbox_relay_heartbeat";

impl From<tokio_postgres::Error> for CdcError {
    fn from(e: tokio_postgres::Error) -> Self {
        CdcError::Pg(e)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum CdcError {
    #[error("database: {0}")]
    Db(#[from] db::DbError),
    #[error("database: {}", db::describe(.0))]
    Pg(tokio_postgres::Error),
    #[error("replication: {0}")]
    Replication(#[from] pgwire_replication::PgWireError),
    #[error("pgoutput: {0}")]
    Decode(#[from] replication::DecodeError),
    #[error("{0}")]
    Protocol(String),
    #[error("settlement stopped: {0}")]
    Settler(String),
    /// Shutdown came while a new slot was being caught up.
    #[error("shutdown interrupted the catch-up")]
    Interrupted,
}

/// Everything a session needs that outlives it.
pub struct StreamContext {
    pub config: Config,
    pub queues: BTreeMap<String, QueueInfo>,
    pub publisher: Arc<dyn Publisher>,
    pub metrics: Arc<Metrics>,
    /// Per destination, outliving sessions: streaming or spooling.
    pub lanes: BTreeMap<String, Arc<LaneState>>,
    /// This process has streamed from the slot: if it is missing now, it was
    /// dropped under us.
    pub slot_seen: AtomicBool,
    /// A sharded relay (filtered publication) catches up only its destinations.
    pub shard: Option<Vec<String>>,
    /// When the current session started streaming (taken by the relay when
    /// the session ends, to tell a healthy session from a failing one).
    pub streaming_since: Mutex<Option<std::time::Instant>>,
}

impl StreamContext {
    pub fn backoff(&self) -> Backoff {
        Backoff { base: self.config.retry_base, max: self.config.retry_max }
    }
}

/// Run one replication session until `shutdown` turns true (Ok) or an error.
/// Every step of opening it has a deadline, and `shutdown` is honoured at
/// every await: opening, catching up, and handing events to a full lane or
/// budget.
pub async fn run_stream(ctx: &StreamContext, shutdown: &mut watch::Receiver<bool>) -> Result<(), CdcError> {
    let opened = tokio::select! {
        o = open_session(ctx) => o?,
        _ = shutdown.wait_for(|s| *s) => return Ok(()),
    };
    let Opened { sql, mut repl, start_lsn, startup_lsn, catch_up } = opened;
    ctx.slot_seen.store(true, Ordering::Relaxed);
    ctx.metrics.set_ready(true);
    *ctx.streaming_since.lock().unwrap() = Some(std::time::Instant::now());
    tracing::info!(slot = %ctx.config.slot, start = %start_lsn, "streaming");

    let watermark = Arc::new(Mutex::new(Watermark::new(start_lsn)));
    let confirm = Arc::new(Notify::new());
    let (mut pipeline, mut settler) = match start_pipeline(ctx, &sql, &watermark, &confirm).await {
        Ok(p) => p,
        Err(e) => {
            let _ = repl.shutdown().await;
            return Err(e);
        }
    };
    let mut sent = start_lsn;
    let result = match catch_up {
        Some((client, consistent)) => {
            tokio::select! {
                r = pipeline.router.catch_up(&client, ctx.shard.as_deref(), consistent) => r,
                _ = shutdown.wait_for(|s| *s) => Err(CdcError::Interrupted),
            }
        }
        None => Ok(()),
    };
    if let Err(e) = result {
        // The new slot's catch-up did not finish: drop the slot, so the next
        // start creates it again and catches up every NEW row.
        ctx.metrics.set_ready(false);
        let _ = repl.shutdown().await;
        pipeline.lanes.abort_all();
        pipeline.wal_watch.abort();
        settler.abort();
        drop_unfinished_slot(&ctx.config, &sql).await;
        return if matches!(e, CdcError::Interrupted) { Ok(()) } else { Err(e) };
    }
    let result = stream(ctx, &sql, &mut repl, &mut pipeline, &mut settler, &confirm, startup_lsn, &mut sent, shutdown).await;
    ctx.metrics.set_ready(false);
    if result.is_ok() {
        sent = drain(pipeline.router, &mut pipeline.lanes, &mut settler, &repl, &watermark, sent, &ctx.metrics).await;
        tracing::info!(confirmed = %sent, "replication stopped");
    }
    pipeline.lanes.abort_all();
    settler.abort();
    pipeline.wal_watch.abort();
    let _ = repl.shutdown().await;
    result
}

/// A session's connections and where it starts.
struct Opened {
    sql: Client,
    repl: ReplicationClient,
    start_lsn: Lsn,
    /// The server's WAL position when the session began: replayed events
    /// before it are filtered against the table.
    startup_lsn: Lsn,
    /// A new slot: the client holding its snapshot, and its consistent point.
    catch_up: Option<(Client, Lsn)>,
}

/// Connect, look the slot up (recreating a lost one), open the replication
/// connection and start streaming; each step within its deadline.
async fn open_session(ctx: &StreamContext) -> Result<Opened, CdcError> {
    let cfg = &ctx.config;
    let db = cfg.db();
    let sql = db.connect().await?;
    let startup_lsn = db.within("reading the current WAL position", current_wal_lsn(&sql)).await?;
    let slot = db.within("looking up the replication slot", prepare_slot(&sql, &cfg.slot)).await?;
    match slot {
        SlotState::Lost => ctx.metrics.slot_recreated.inc(),
        SlotState::Missing if ctx.slot_seen.load(Ordering::Relaxed) => {
            tracing::error!(slot = %cfg.slot, "replication slot disappeared under the relay (dropped?); creating it again and catching up from the outbox table");
            ctx.metrics.slot_recreated.inc();
        }
        _ => {}
    }
    let mut repl = connect_replication(cfg).await?;
    // A new slot comes with a snapshot: the rows it will not stream.
    let mut catch_up = None;
    let start_lsn = match slot {
        SlotState::Exists { confirmed_flush } => confirmed_flush,
        SlotState::Missing | SlotState::Lost => {
            // Creating a slot waits for running transactions: no deadline,
            // but shutdown still interrupts it.
            let (consistent, snapshot) = create_slot_exporting(&mut repl, &cfg.slot).await?;
            let snap_client = db.connect().await?;
            db.within("importing the new slot's snapshot", import_snapshot(&snap_client, &snapshot)).await?;
            tracing::info!(slot = %cfg.slot, consistent_point = %consistent, "created replication slot; publishing NEW rows written before it from the table");
            catch_up = Some((snap_client, consistent));
            consistent
        }
    };
    db.within("starting replication", async {
        repl.start().await?;
        repl.wait_started().await?;
        Ok::<(), CdcError>(())
    })
    .await?;
    Ok(Opened { sql, repl, start_lsn, startup_lsn, catch_up })
}

/// The replication connection, within `connect_timeout`.
pub(crate) async fn connect_replication(cfg: &Config) -> Result<ReplicationClient, CdcError> {
    let rc = replication_config(cfg)?;
    let server = format!("{}:{}", rc.host, rc.port);
    match tokio::time::timeout(cfg.connect_timeout, ReplicationClient::connect_gated(rc)).await {
        Ok(r) => Ok(r?),
        Err(_) => Err(CdcError::Db(db::DbError::Timeout {
            server,
            what: "opening the replication connection".into(),
            after: cfg.connect_timeout,
            key: "connect_timeout",
        })),
    }
}

/// After a catch-up that did not finish (shutdown, or an error): drop the slot this session created (its
/// walsender may take a moment to let go of it).
async fn drop_unfinished_slot(cfg: &Config, sql: &Client) {
    for _ in 0..20 {
        let r = tokio::time::timeout(
            cfg.query_timeout,
            sql.execute(
                "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = $1 AND NOT active",
                &[&cfg.slot],
            ),
        )
        .await;
        if matches!(r, Ok(Ok(1))) {
            tracing::warn!(slot = %cfg.slot, "the new slot's catch-up did not finish: dropped the slot, so the next start creates it again and catches up");
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tracing::error!(slot = %cfg.slot, "the new slot's catch-up did not finish and the slot could not be dropped: drop it (`outbox-relay slot drop`) before the next start so NEW rows written before it are caught up");
}

/// The running parts of a session: lanes, the router in front of them, and
/// the WAL watch.
struct Pipeline<'a> {
    router: Router<'a>,
    lanes: JoinSet<()>,
    wal_watch: tokio::task::JoinHandle<()>,
}

type Settler = tokio::task::JoinHandle<Result<(), tokio_postgres::Error>>;

/// Start the settler, one lane per destination, the WAL watch, and the router.
async fn start_pipeline<'a>(
    ctx: &'a StreamContext,
    sql: &Client,
    watermark: &Arc<Mutex<Watermark>>,
    confirm: &Arc<Notify>,
) -> Result<(Pipeline<'a>, Settler), CdcError> {
    let cfg = &ctx.config;
    let db = cfg.db();
    let (settle_tx, settle_rx) = mpsc::unbounded_channel();
    let settler_client = db.connect().await?;
    let settler = tokio::spawn(run_settler(
        settler_client,
        settle_rx,
        Arc::clone(watermark),
        Arc::clone(confirm),
        Arc::clone(&ctx.metrics),
        ctx.backoff(),
    ));
    // Lanes with rows in the table keep spooling until the drain empties it,
    // so a FIFO group is not overtaken by its own newer events.
    let spooled: Vec<String> = db
        .query(
            "looking for spooled rows",
            sql.query("SELECT DISTINCT destination FROM outbox WHERE status = 'NEW' AND next_attempt_at IS NOT NULL", &[]),
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    for (name, state) in &ctx.lanes {
        state.reset_deferred();
        if spooled.contains(name) {
            state.start_spooling("rows of this destination are waiting in the outbox table");
        }
    }
    let wal_watch = tokio::spawn(watch_wal(db, cfg.slot.clone(), cfg.max_retained_wal, ctx.lanes.values().cloned().collect()));
    let mut lanes = JoinSet::new();
    let mut lane_tx = HashMap::new();
    for (name, queue) in &ctx.queues {
        let (tx, rx) = mpsc::channel(LANE_CHANNEL);
        lane_tx.insert(name.clone(), tx);
        let lane_cfg = LaneConfig {
            name: Arc::from(name.as_str()),
            queue: queue.clone(),
            linger: cfg.linger,
            max_in_flight: cfg.max_in_flight_batches,
            retry_base: Duration::from_millis(200),
            retry_cap: Duration::from_secs(10),
            retry: RetryPolicy::InMemory,
            stall_timeout: Some(cfg.lane_stall_timeout),
        };
        let state = Arc::clone(&ctx.lanes[name]);
        lanes.spawn(run_lane(lane_cfg, Arc::clone(&ctx.publisher), rx, settle_tx.clone(), Arc::clone(&ctx.metrics), Some(state)));
    }
    let router = Router {
        queues: &ctx.queues,
        lanes: lane_tx,
        states: &ctx.lanes,
        settle: settle_tx,
        budget: Budget::new(cfg.max_unsettled_events, cfg.max_unsettled_bytes),
        watermark: Arc::clone(watermark),
        metrics: Arc::clone(&ctx.metrics),
    };
    Ok((Pipeline { router, lanes, wal_watch }, settler))
}

/// Graceful end: no more reading; the lanes finish what they hold (within
/// the grace), the settler marks it, and the last settled position is
/// confirmed. Returns the confirmed position.
async fn drain(
    router: Router<'_>,
    lanes: &mut JoinSet<()>,
    settler: &mut Settler,
    repl: &ReplicationClient,
    watermark: &Mutex<Watermark>,
    mut sent: Lsn,
    metrics: &Metrics,
) -> Lsn {
    drop(router);
    let drained = tokio::time::timeout(SHUTDOWN_GRACE, async {
        while lanes.join_next().await.is_some() {}
        let _ = settler.await;
    })
    .await;
    if drained.is_err() {
        tracing::warn!("in-flight batches abandoned at shutdown; their rows will be sent again");
    }
    let before = sent;
    sent = confirm_if_advanced(repl, watermark, sent, metrics);
    if sent > before {
        // Let the worker send the final standby status before CopyDone.
        tokio::time::sleep(STATUS_INTERVAL + Duration::from_millis(200)).await;
    }
    sent
}

/// The session's loop: decode, route, confirm, until shutdown or an error.
#[allow(clippy::too_many_arguments)]
async fn stream(
    ctx: &StreamContext,
    sql: &Client,
    repl: &mut ReplicationClient,
    pipeline: &mut Pipeline<'_>,
    settler: &mut Settler,
    confirm: &Notify,
    startup_lsn: Lsn,
    sent: &mut Lsn,
    shutdown: &mut watch::Receiver<bool>,
) -> Result<(), CdcError> {
    let mut decoder = Decoder { cache: RelationCache::new(), txn: None, startup_lsn };
    loop {
        tokio::select! {
            ev = repl.recv() => {
                let ev = match ev {
                    Ok(Some(ev)) => ev,
                    Ok(None) => return Err(CdcError::Protocol("replication stream ended".into())),
                    Err(e) => return Err(e.into()),
                };
                // Handing events on may wait for a lane or the budget:
                // shutdown is honoured meanwhile (nothing unsettled is confirmed).
                let handled = tokio::select! {
                    r = decoder.handle(ev, sql, &mut pipeline.router, ctx) => r?,
                    _ = shutdown.wait_for(|s| *s) => return Ok(()),
                };
                if handled == Handled::Stopped {
                    return Ok(());
                }
            }
            _ = confirm.notified() => {}
            r = &mut *settler => {
                return Err(CdcError::Settler(match r {
                    Ok(Ok(())) => "settler ended".into(),
                    Ok(Err(e)) => db::describe(&e),
                    Err(e) => e.to_string(),
                }));
            }
            _ = shutdown.changed() => {
                if *shutdown.borrow() {
                    return Ok(());
                }
            }
        }
        *sent = confirm_if_advanced(repl, &pipeline.router.watermark, *sent, &ctx.metrics);
    }
}

#[derive(Debug, PartialEq, Eq)]
enum Handled {
    Continue,
    /// The stream reached its stop position.
    Stopped,
}

/// Decoding state of one session: the relation cache and the open transaction.
struct Decoder {
    cache: RelationCache,
    txn: Option<OpenTxn>,
    startup_lsn: Lsn,
}

impl Decoder {
    /// One replication event: transactions are buffered in chunks (by count
    /// and by bytes) and dispatched to the router; commits move the watermark.
    async fn handle(&mut self, ev: ReplicationEvent, sql: &Client, router: &mut Router<'_>, ctx: &StreamContext) -> Result<Handled, CdcError> {
        match ev {
            ReplicationEvent::Begin { final_lsn, commit_time_micros, xid } => {
                let seq = router.watermark.lock().unwrap().begin();
                self.txn = Some(OpenTxn {
                    seq,
                    xid,
                    final_lsn: Lsn(final_lsn.0),
                    commit_time_us: pg_micros_to_unix_micros(commit_time_micros),
                    buf: Vec::new(),
                    buf_bytes: 0,
                });
            }
            ReplicationEvent::XLogData { data, .. } => self.xlog(&data, sql, router).await?,
            ReplicationEvent::Commit { end_lsn, .. } => {
                let mut t = self.txn.take().ok_or_else(|| CdcError::Protocol("Commit without Begin".into()))?;
                let buf = std::mem::take(&mut t.buf);
                router.dispatch(sql, t.seq, t.final_lsn < self.startup_lsn, buf).await?;
                router.watermark.lock().unwrap().commit(t.seq, Lsn(end_lsn.0));
            }
            ReplicationEvent::KeepAlive { wal_end, .. } => {
                if self.txn.is_none() {
                    router.watermark.lock().unwrap().observe_idle(Lsn(wal_end.0));
                }
            }
            ReplicationEvent::Message { prefix, content, .. } => {
                // Heartbeats: their transaction settles empty; the content is
                // the time they were written.
                if prefix == HEARTBEAT_PREFIX {
                    if let Some(sent_us) = std::str::from_utf8(&content).ok().and_then(|s| s.trim().parse::<i64>().ok()) {
                        let now_us = std::time::SystemTime::now()
                            .duration_since(std::time::UNIX_EPOCH)
                            .map(|d| d.as_micros() as i64)
                            .unwrap_or(0);
                        ctx.metrics.heartbeat_rtt_seconds.set((now_us - sent_us).max(0) as f64 / 1e6);
                    }
                }
            }
            ReplicationEvent::StoppedAt { .. } => return Ok(Handled::Stopped),
        }
        Ok(Handled::Continue)
    }

    async fn xlog(&mut self, data: &bytes::Bytes, sql: &Client, router: &mut Router<'_>) -> Result<(), CdcError> {
        let msg = decode(data)?;
        if self.cache.observe(&msg) {
            return Ok(());
        }
        match msg {
            LogicalMessage::Insert { relation, new } => {
                let rel = self.cache.get(relation).ok_or_else(|| CdcError::Protocol(format!("Insert for unknown relation {relation}")))?;
                if rel.name != "outbox" {
                    return Ok(());
                }
                let t = self.txn.as_mut().ok_or_else(|| CdcError::Protocol("Insert outside a transaction".into()))?;
                let row = row_from_tuple(rel, &new, t.commit_time_us, Some(t.xid))?;
                t.buf_bytes += row.size();
                t.buf.push(row);
                if t.buf.len() >= CHUNK || t.buf_bytes >= CHUNK_BYTES {
                    let (seq, final_lsn, buf) = (t.seq, t.final_lsn, std::mem::take(&mut t.buf));
                    t.buf_bytes = 0;
                    router.dispatch(sql, seq, final_lsn < self.startup_lsn, buf).await?;
                }
            }
            LogicalMessage::Truncate { .. } => {
                tracing::warn!("TRUNCATE of the outbox seen in the stream; rows truncated before being published are gone");
            }
            _ => {}
        }
        Ok(())
    }
}

/// The replication connection's settings, from the relay's configuration.
pub(crate) fn replication_config(cfg: &Config) -> Result<ReplicationConfig, CdcError> {
    let t = crate::pgconn::parse(&cfg.database_url).map_err(|e| CdcError::Db(db::DbError::Check(e)))?;
    let mode = match t.ssl {
        crate::pgconn::SslMode::Disable => pgwire_replication::SslMode::Disable,
        crate::pgconn::SslMode::Prefer => pgwire_replication::SslMode::Prefer,
        crate::pgconn::SslMode::Require if t.root_cert.is_some() => pgwire_replication::SslMode::VerifyCa,
        crate::pgconn::SslMode::Require => pgwire_replication::SslMode::Require,
        crate::pgconn::SslMode::VerifyCa => pgwire_replication::SslMode::VerifyCa,
        crate::pgconn::SslMode::VerifyFull => pgwire_replication::SslMode::VerifyFull,
    };
    let mut tls = pgwire_replication::TlsConfig { mode, ca_pem_path: t.root_cert.clone(), ..Default::default() };
    if let Some((c, k)) = &t.client_cert {
        tls = tls.with_client_cert(c.clone(), k.clone());
    }
    Ok(ReplicationConfig::new(t.host, t.user, t.password.unwrap_or_default(), t.dbname, cfg.slot.clone(), cfg.publication.clone())
        .with_port(t.port)
        .with_tls(tls)
        .with_status_interval(STATUS_INTERVAL)
        .with_wakeup_interval(Duration::from_secs(5))
        .with_buffer_size(crate::budget::replication_buffer_events(cfg.max_unsettled_bytes))
        .with_application_name(format!("outbox-relay:{}", cfg.slot)))
}

/// `CREATE_REPLICATION_SLOT ... (SNAPSHOT 'export')` on a gated session:
/// the slot's consistent point and the exported snapshot's name, valid until
/// the session runs another command.
pub(crate) async fn create_slot_exporting(repl: &mut ReplicationClient, slot: &str) -> Result<(Lsn, String), CdcError> {
    let rows = repl
        .simple_query(&format!("CREATE_REPLICATION_SLOT \"{slot}\" LOGICAL pgoutput (SNAPSHOT 'export')"))
        .await?;
    let row = rows.first().ok_or_else(|| CdcError::Protocol("CREATE_REPLICATION_SLOT returned no row".into()))?;
    let text = |i: usize| {
        row.get(i)
            .and_then(|v| v.as_ref())
            .map(|b| String::from_utf8_lossy(b).into_owned())
            .ok_or_else(|| CdcError::Protocol(format!("CREATE_REPLICATION_SLOT: column {i} missing")))
    };
    let consistent: Lsn = text(1)?.parse().map_err(|e| CdcError::Protocol(format!("{e}")))?;
    Ok((consistent, text(2)?))
}

/// Open a transaction on `client` that sees exactly the exported snapshot.
pub(crate) async fn import_snapshot(client: &Client, snapshot: &str) -> Result<(), CdcError> {
    client
        .batch_execute(&format!(
            "BEGIN ISOLATION LEVEL REPEATABLE READ; SET TRANSACTION SNAPSHOT '{}'",
            snapshot.replace('\'', "")
        ))
        .await?;
    Ok(())
}

fn confirm_if_advanced(repl: &ReplicationClient, wm: &Mutex<Watermark>, sent: Lsn, metrics: &Metrics) -> Lsn {
    let c = wm.lock().unwrap().confirmed();
    if c > sent {
        crate::faults::crash_point("cdc::before_confirm");
        repl.update_applied_lsn(pgwire_replication::Lsn(c.0));
        metrics.confirmed_lsn.set(c.0 as i64);
        c
    } else {
        sent
    }
}

struct OpenTxn {
    seq: TxnSeq,
    xid: u32,
    final_lsn: Lsn,
    commit_time_us: i64,
    buf: Vec<OutboxEvent>,
    buf_bytes: usize,
}

enum SlotState {
    Exists { confirmed_flush: Lsn },
    Missing,
    /// It lost its WAL and was dropped.
    Lost,
}

async fn current_wal_lsn(sql: &Client) -> Result<Lsn, CdcError> {
    let s: String = sql.query_one("SELECT pg_current_wal_lsn()::text", &[]).await?.get(0);
    s.parse().map_err(|e| CdcError::Protocol(format!("{e}")))
}

/// Look the slot up; drop it if its WAL is lost (it can no longer stream what
/// it promised), so it is created afresh with a snapshot catch-up.
async fn prepare_slot(sql: &Client, slot: &str) -> Result<SlotState, CdcError> {
    let row = sql
        .query_opt(
            "SELECT database = current_database(), plugin, coalesce(wal_status, ''), confirmed_flush_lsn::text
               FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await?;
    let Some(row) = row else { return Ok(SlotState::Missing) };
    let (same_db, plugin, wal_status, flush): (Option<bool>, Option<String>, String, Option<String>) =
        (row.get(0), row.get(1), row.get(2), row.get(3));
    if same_db != Some(true) || plugin.as_deref() != Some("pgoutput") {
        return Err(CdcError::Protocol(format!(
            "replication slot {slot:?} exists but is not a pgoutput slot of this database: choose another `slot` name or drop it"
        )));
    }
    if wal_status == "lost" {
        tracing::error!(slot, "replication slot lost its WAL (max_slot_wal_keep_size); dropping it and catching up from the outbox table");
        sql.execute("SELECT pg_drop_replication_slot($1)", &[&slot]).await?;
        return Ok(SlotState::Lost);
    }
    let confirmed_flush = flush.and_then(|s| s.parse().ok()).unwrap_or_default();
    Ok(SlotState::Exists { confirmed_flush })
}

/// The outbox columns, by name, from a decoded row.
fn row_from_tuple(rel: &Relation, t: &Tuple, commit_time_us: i64, xid: Option<u32>) -> Result<OutboxEvent, CdcError> {
    let col = |name: &str| -> Result<Option<&str>, CdcError> {
        let i = rel
            .column_index(name)
            .ok_or_else(|| CdcError::Protocol(format!("the outbox table has no column {name:?}")))?;
        match t.0.get(i) {
            None | Some(TupleValue::Null) => Ok(None),
            Some(v) => match v.as_str() {
                Some(Ok(s)) => Ok(Some(s)),
                Some(Err(e)) => Err(e.into()),
                None => Err(CdcError::Protocol(format!("column {name:?}: not a text value"))),
            },
        }
    };
    let id = col("id")?
        .and_then(|s| s.parse::<i64>().ok())
        .ok_or_else(|| CdcError::Protocol("outbox row without a numeric id".into()))?;
    Ok(OutboxEvent {
        id,
        event_id: col("event_id")?.unwrap_or_default().to_owned(),
        destination: col("destination")?.unwrap_or_default().to_owned(),
        body: col("body")?.unwrap_or_default().to_owned(),
        group_key: col("group_key")?.map(str::to_owned),
        attributes: col("attributes")?.map(str::to_owned),
        commit_time_us,
        xid,
    })
}

/// Routes events to their lanes, or straight to the settler as DEAD.
pub(crate) struct Router<'a> {
    pub queues: &'a BTreeMap<String, QueueInfo>,
    pub lanes: HashMap<String, mpsc::Sender<LaneItem>>,
    pub states: &'a BTreeMap<String, Arc<LaneState>>,
    pub settle: mpsc::UnboundedSender<Settlement>,
    pub budget: Budget,
    pub watermark: Arc<Mutex<Watermark>>,
    pub metrics: Arc<Metrics>,
}

impl Router<'_> {
    /// Dispatch a chunk of one transaction's events. `replayed`: the chunk was
    /// committed before this session started, so rows already settled by an
    /// earlier run are filtered out first (one indexed query).
    async fn dispatch(&mut self, sql: &Client, seq: TxnSeq, replayed: bool, mut events: Vec<OutboxEvent>) -> Result<(), CdcError> {
        if events.is_empty() {
            return Ok(());
        }
        if replayed {
            let ids: Vec<i64> = events.iter().map(|e| e.id).collect();
            let done: std::collections::HashSet<i64> = sql
                .query(
                    "SELECT id FROM outbox WHERE id = ANY($1) AND (status <> 'NEW' OR next_attempt_at IS NOT NULL)",
                    &[&ids],
                )
                .await?
                .iter()
                .map(|r| r.get(0))
                .collect();
            if !done.is_empty() {
                self.metrics.replayed_filtered.inc_by(done.len() as u64);
                events.retain(|e| !done.contains(&e.id));
            }
        }
        for ev in events {
            self.route(Some(seq), ev).await?;
        }
        Ok(())
    }

    async fn route(&mut self, seq: Option<TxnSeq>, ev: OutboxEvent) -> Result<(), CdcError> {
        let permit = self.budget.acquire(ev.size()).await;
        if let Some(seq) = seq {
            self.watermark.lock().unwrap().add(seq, 1);
        }
        let ev = Arc::new(ev);
        let (label, verdict) = match self.queues.get(&ev.destination) {
            None => (
                "unknown",
                Err(DeadReason::new(
                    "unknown_destination",
                    format!("destination {:?} is not configured in [destinations]", ev.destination),
                )),
            ),
            Some(q) => (ev.destination.as_str(), prepare(Arc::clone(&ev), q)),
        };
        self.metrics.in_flight_events.with_label_values(&[label]).inc();
        match verdict {
            Ok(_) if self.states[&ev.destination].is_spooling() => {
                // A spooling lane's new events go straight to the table.
                let state = &self.states[&ev.destination];
                state.deferring();
                let last = state.last_error();
                self.settle
                    .send(Settlement {
                        id: ev.id,
                        xid: ev.xid,
                        txn: seq,
                        destination: Arc::from(label),
                        outcome: Outcome::Deferred(if last.is_empty() { "spooled".into() } else { format!("spooled: {last}") }),
                        permit: Some(permit),
                        lane: Some(Arc::clone(state)),
                    })
                    .map_err(|_| CdcError::Settler("settler stopped".into()))?;
            }
            Ok(entry) => {
                let tx = self.lanes.get(&ev.destination).expect("a lane per configured destination");
                tx.send(LaneItem::new(entry, seq, Some(permit)))
                    .await
                    .map_err(|_| CdcError::Settler("lane stopped".into()))?;
            }
            Err(reason) => {
                self.settle
                    .send(Settlement {
                        id: ev.id,
                        xid: ev.xid,
                        txn: seq,
                        destination: Arc::from(label),
                        outcome: Outcome::Dead(reason),
                        permit: Some(permit),
                        lane: None,
                    })
                    .map_err(|_| CdcError::Settler("settler stopped".into()))?;
            }
        }
        Ok(())
    }

    /// Publish the NEW rows the new slot's snapshot sees, in id order, as one
    /// transaction of the watermark ending at the slot's consistent point.
    async fn catch_up(&mut self, client: &Client, shard: Option<&[String]>, consistent: Lsn) -> Result<(), CdcError> {
        let seq = self.watermark.lock().unwrap().begin();
        let n = self.catch_up_rows(client, seq, shard).await?;
        client.batch_execute("COMMIT").await?;
        self.watermark.lock().unwrap().commit(seq, consistent);
        tracing::info!(rows = n, "catch-up from the slot's snapshot dispatched");
        Ok(())
    }

    /// The rows, fetched in rounds sized so one round holds about
    /// [`CHUNK_BYTES`] whatever the bodies' size.
    async fn catch_up_rows(&mut self, client: &Client, seq: TxnSeq, shard: Option<&[String]>) -> Result<u64, CdcError> {
        let only = match shard {
            Some(d) => format!(
                " AND destination IN ({})",
                d.iter().map(|x| format!("'{}'", x.replace('\'', "''"))).collect::<Vec<_>>().join(", ")
            ),
            None => String::new(),
        };
        client
            .batch_execute(&format!(
                "DECLARE outbox_catch_up NO SCROLL CURSOR FOR
                 SELECT {OUTBOX_COLUMNS}
                   FROM outbox WHERE status = 'NEW' AND next_attempt_at IS NULL{only} ORDER BY id"
            ))
            .await?;
        let mut n = 0u64;
        let mut fetch = 16usize;
        loop {
            let rows = client.query(&format!("FETCH {fetch} FROM outbox_catch_up"), &[]).await?;
            if rows.is_empty() {
                break;
            }
            let mut bytes = 0usize;
            for r in rows {
                n += 1;
                let ev = OutboxEvent::from_row(&r);
                bytes += ev.size();
                self.route(Some(seq), ev).await?;
            }
            let per_row = (bytes / fetch).max(1);
            fetch = (CHUNK_BYTES / per_row).clamp(1, CHUNK);
        }
        Ok(n)
    }
}

/// Four times a second: if the slot holds more than half of
/// `max_retained_wal` (current WAL minus confirmed flush: the part the relay
/// controls), spool the lane whose oldest unsettled event is the oldest, as
/// that is the one holding the watermark back. Acting at half the budget
/// leaves room for the WAL written while the spool takes effect, so the slot
/// stays under the budget itself. Events younger than a second are in normal
/// flight, not holding anything, and are left alone.
async fn watch_wal(db: db::Db, slot: String, max_retained_wal: u64, lanes: Vec<Arc<LaneState>>) {
    const MIN_AGE: Duration = Duration::from_secs(1);
    let threshold = max_retained_wal / 2;
    let mut client: Option<Client> = None;
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if client.as_ref().is_none_or(|c| c.is_closed()) {
            client = db.connect().await.ok();
        }
        let Some(c) = client.as_ref() else { continue };
        let held = match db
            .query(
                "reading the slot's retained WAL",
                c.query_opt(
                    "SELECT (pg_current_wal_lsn() - confirmed_flush_lsn)::bigint FROM pg_replication_slots WHERE slot_name = $1",
                    &[&slot],
                ),
            )
            .await
        {
            Ok(Some(r)) => r.get::<_, Option<i64>>(0).unwrap_or(0).max(0) as u64,
            Ok(None) => continue,
            Err(_) => {
                client = None;
                continue;
            }
        };
        if held <= threshold {
            continue;
        }
        let worst = lanes
            .iter()
            .filter(|l| !l.is_spooling())
            .filter_map(|l| l.oldest_unsettled_age().map(|a| (a, l)))
            .filter(|(a, _)| *a >= MIN_AGE)
            .max_by_key(|(a, _)| *a);
        if let Some((age, lane)) = worst {
            lane.start_spooling(&format!(
                "slot holds {held} bytes of WAL, over half of max_retained_wal ({max_retained_wal}); this lane's oldest unsettled event is {:.1}s old",
                age.as_secs_f64()
            ));
        }
    }
}
