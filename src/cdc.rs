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
use tokio::sync::{mpsc, watch, Notify, Semaphore};
use tokio::task::JoinSet;
use tokio_postgres::Client;

use crate::config::Config;
use crate::db;
use crate::event::{prepare, DeadReason, OutboxEvent, QueueInfo, OUTBOX_COLUMNS};
use crate::lane::{run_lane, LaneConfig, LaneItem, LaneState, RetryPolicy};
use crate::metrics::Metrics;
use crate::publisher::Publisher;
use crate::settle::{run_settler, Backoff, Outcome, Settlement};
use crate::watermark::{TxnSeq, Watermark};

/// Events of one transaction are checked against the table and dispatched in
/// chunks of this many.
const CHUNK: usize = 1_000;
/// Lanes may lag this long behind a shutdown request before they are abandoned.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);
const STATUS_INTERVAL: Duration = Duration::from_millis(500);
/// Prefix of the heartbeat messages the relay writes.
pub const HEARTBEAT_PREFIX: &str = "outbox_relay_heartbeat";

#[derive(Debug, thiserror::Error)]
pub enum CdcError {
    #[error("database: {0}")]
    Db(#[from] db::DbError),
    #[error("database: {0}")]
    Pg(#[from] tokio_postgres::Error),
    #[error("replication: {0}")]
    Replication(#[from] pgwire_replication::PgWireError),
    #[error("pgoutput: {0}")]
    Decode(#[from] replication::DecodeError),
    #[error("{0}")]
    Protocol(String),
    #[error("settlement stopped: {0}")]
    Settler(String),
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
}

impl StreamContext {
    pub fn backoff(&self) -> Backoff {
        Backoff { base: self.config.retry_base, max: self.config.retry_max }
    }
}

/// Run one replication session until `shutdown` turns true (Ok) or an error.
pub async fn run_stream(ctx: &StreamContext, shutdown: &mut watch::Receiver<bool>) -> Result<(), CdcError> {
    let cfg = &ctx.config;
    let sql = db::connect(&cfg.database_url).await?;
    let startup_lsn = current_wal_lsn(&sql).await?;
    let slot = prepare_slot(&sql, &cfg.slot).await?;
    match slot {
        SlotState::Lost => {
            ctx.metrics.slot_recreated.inc();
        }
        SlotState::Missing if ctx.slot_seen.load(Ordering::Relaxed) => {
            tracing::error!(slot = %cfg.slot, "replication slot disappeared under the relay (dropped?); creating it again and catching up from the outbox table");
            ctx.metrics.slot_recreated.inc();
        }
        _ => {}
    }

    let mut repl = ReplicationClient::connect_gated(replication_config(cfg)?).await?;

    // A new slot comes with a snapshot: the rows it will not stream.
    let mut catch_up: Option<(Client, Lsn)> = None;
    let start_lsn = match slot {
        SlotState::Exists { confirmed_flush } => confirmed_flush,
        SlotState::Missing | SlotState::Lost => {
            let (consistent, snapshot) = create_slot_exporting(&mut repl, &cfg.slot).await?;
            let snap_client = db::connect(&cfg.database_url).await?;
            import_snapshot(&snap_client, &snapshot).await?;
            tracing::info!(slot = %cfg.slot, consistent_point = %consistent, "created replication slot; publishing NEW rows written before it from the table");
            catch_up = Some((snap_client, consistent));
            consistent
        }
    };
    repl.start().await?;
    repl.wait_started().await?;
    ctx.slot_seen.store(true, Ordering::Relaxed);
    ctx.metrics.set_ready(true);
    tracing::info!(slot = %cfg.slot, start = %start_lsn, "streaming");

    let watermark = Arc::new(Mutex::new(Watermark::new(start_lsn)));
    let confirm = Arc::new(Notify::new());
    let budget = Arc::new(Semaphore::new(cfg.max_unsettled_events));
    let (settle_tx, settle_rx) = mpsc::unbounded_channel();
    let settler_client = db::connect(&cfg.database_url).await?;
    let mut settler = tokio::spawn(run_settler(
        settler_client,
        settle_rx,
        Arc::clone(&watermark),
        Arc::clone(&confirm),
        Arc::clone(&ctx.metrics),
        ctx.backoff(),
    ));
    // Lanes with rows in the table keep spooling until the drain empties it,
    // so a FIFO group is not overtaken by its own newer events.
    let spooled: Vec<String> = sql
        .query("SELECT DISTINCT destination FROM outbox WHERE status = 'NEW' AND next_attempt_at IS NOT NULL", &[])
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
    let wal_watch = tokio::spawn(watch_wal(
        cfg.database_url.clone(),
        cfg.slot.clone(),
        cfg.max_retained_wal,
        ctx.lanes.values().cloned().collect(),
    ));
    let mut lanes = JoinSet::new();
    let mut lane_tx = HashMap::new();
    for (name, queue) in &ctx.queues {
        let (tx, rx) = mpsc::channel(4_096);
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
    let mut router = Router {
        queues: &ctx.queues,
        lanes: lane_tx,
        states: &ctx.lanes,
        settle: settle_tx,
        budget,
        watermark: Arc::clone(&watermark),
        metrics: Arc::clone(&ctx.metrics),
    };

    if let Some((client, consistent)) = catch_up.take() {
        let seq = watermark.lock().unwrap().begin();
        let n = router.catch_up(&client, seq, ctx.shard.as_deref()).await?;
        client.batch_execute("COMMIT").await?;
        watermark.lock().unwrap().commit(seq, consistent);
        tracing::info!(rows = n, "catch-up from the slot's snapshot dispatched");
    }

    let mut cache = RelationCache::new();
    let mut txn: Option<OpenTxn> = None;
    let mut sent = start_lsn;
    let result: Result<(), CdcError> = loop {
        tokio::select! {
            ev = repl.recv() => {
                let ev = match ev {
                    Ok(Some(ev)) => ev,
                    Ok(None) => break Err(CdcError::Protocol("replication stream ended".into())),
                    Err(e) => break Err(e.into()),
                };
                match ev {
                    ReplicationEvent::Begin { final_lsn, commit_time_micros, .. } => {
                        let seq = watermark.lock().unwrap().begin();
                        txn = Some(OpenTxn {
                            seq,
                            final_lsn: Lsn(final_lsn.0),
                            commit_time_us: pg_micros_to_unix_micros(commit_time_micros),
                            buf: Vec::new(),
                        });
                    }
                    ReplicationEvent::XLogData { data, .. } => {
                        let msg = decode(&data)?;
                        if cache.observe(&msg) {
                            continue;
                        }
                        if let LogicalMessage::Insert { relation, new } = msg {
                            let rel = cache.get(relation).ok_or_else(|| CdcError::Protocol(format!("Insert for unknown relation {relation}")))?;
                            if rel.name != "outbox" {
                                continue;
                            }
                            let t = txn.as_mut().ok_or_else(|| CdcError::Protocol("Insert outside a transaction".into()))?;
                            let row = row_from_tuple(rel, &new, t.commit_time_us)?;
                            t.buf.push(row);
                            if t.buf.len() >= CHUNK {
                                let (seq, final_lsn, buf) = (t.seq, t.final_lsn, std::mem::take(&mut t.buf));
                                router.dispatch(&sql, seq, final_lsn < startup_lsn, buf).await?;
                            }
                        } else if let LogicalMessage::Truncate { .. } = msg {
                            tracing::warn!("TRUNCATE of the outbox seen in the stream; rows truncated before being published are gone");
                        }
                    }
                    ReplicationEvent::Commit { end_lsn, .. } => {
                        let mut t = txn.take().ok_or_else(|| CdcError::Protocol("Commit without Begin".into()))?;
                        let buf = std::mem::take(&mut t.buf);
                        router.dispatch(&sql, t.seq, t.final_lsn < startup_lsn, buf).await?;
                        watermark.lock().unwrap().commit(t.seq, Lsn(end_lsn.0));
                    }
                    ReplicationEvent::KeepAlive { wal_end, .. } => {
                        if txn.is_none() {
                            watermark.lock().unwrap().observe_idle(Lsn(wal_end.0));
                        }
                    }
                    ReplicationEvent::Message { prefix, content, .. } => {
                        // Heartbeats: their transaction settles empty; the
                        // content is the time they were written.
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
                    ReplicationEvent::StoppedAt { .. } => break Ok(()),
                }
            }
            _ = confirm.notified() => {}
            r = &mut settler => {
                break Err(CdcError::Settler(match r {
                    Ok(Ok(())) => "settler ended".into(),
                    Ok(Err(e)) => e.to_string(),
                    Err(e) => e.to_string(),
                }));
            }
            _ = shutdown.changed() => {
                if *shutdown.borrow() {
                    break Ok(());
                }
            }
        }
        sent = confirm_if_advanced(&repl, &watermark, sent, &ctx.metrics);
    };
    ctx.metrics.set_ready(false);

    if result.is_ok() {
        // Graceful: no more reading; let the lanes finish what they hold.
        drop(router);
        let drained = tokio::time::timeout(SHUTDOWN_GRACE, async {
            while lanes.join_next().await.is_some() {}
            let _ = (&mut settler).await;
        })
        .await;
        if drained.is_err() {
            tracing::warn!("in-flight batches abandoned at shutdown; their rows will be sent again");
        }
        let before = sent;
        sent = confirm_if_advanced(&repl, &watermark, sent, &ctx.metrics);
        if sent > before {
            // Let the worker send the final standby status before CopyDone.
            tokio::time::sleep(STATUS_INTERVAL + Duration::from_millis(200)).await;
        }
        tracing::info!(confirmed = %sent, "replication stopped");
    }
    lanes.abort_all();
    settler.abort();
    wal_watch.abort();
    let _ = repl.shutdown().await;
    result
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
    final_lsn: Lsn,
    commit_time_us: i64,
    buf: Vec<OutboxEvent>,
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
fn row_from_tuple(rel: &Relation, t: &Tuple, commit_time_us: i64) -> Result<OutboxEvent, CdcError> {
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
    })
}

/// Routes events to their lanes, or straight to the settler as DEAD.
pub(crate) struct Router<'a> {
    pub queues: &'a BTreeMap<String, QueueInfo>,
    pub lanes: HashMap<String, mpsc::Sender<LaneItem>>,
    pub states: &'a BTreeMap<String, Arc<LaneState>>,
    pub settle: mpsc::UnboundedSender<Settlement>,
    pub budget: Arc<Semaphore>,
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
        let permit = Arc::clone(&self.budget).acquire_owned().await.expect("budget semaphore is never closed");
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

    /// Publish the NEW rows the slot's snapshot sees, in id order.
    async fn catch_up(&mut self, client: &Client, seq: TxnSeq, shard: Option<&[String]>) -> Result<u64, CdcError> {
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
        loop {
            let rows = client.query("FETCH 1000 FROM outbox_catch_up", &[]).await?;
            if rows.is_empty() {
                break;
            }
            for r in rows {
                n += 1;
                self.route(Some(seq), OutboxEvent::from_row(&r)).await?;
            }
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
async fn watch_wal(url: String, slot: String, max_retained_wal: u64, lanes: Vec<Arc<LaneState>>) {
    const MIN_AGE: Duration = Duration::from_secs(1);
    let threshold = max_retained_wal / 2;
    let mut client: Option<Client> = None;
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if client.as_ref().is_none_or(|c| c.is_closed()) {
            client = db::connect(&url).await.ok();
        }
        let Some(c) = client.as_ref() else { continue };
        let held = match c
            .query_opt(
                "SELECT (pg_current_wal_lsn() - confirmed_flush_lsn)::bigint FROM pg_replication_slots WHERE slot_name = $1",
                &[&slot],
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
