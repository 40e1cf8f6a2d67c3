//! The CDC source: the slot's pgoutput stream. One session reads it here,
//! start to end: [`decode`] turns each replication event into a
//! [`Change`](crate::pipeline::intake::Change), the pipeline's
//! [`crate::pipeline::intake::Intake`] routes, sends and settles it,
//! and the session confirms to the server what the intake says is settled
//! ([`Session::stream`], [`confirm_if_advanced`]).
//!
//! One call of [`run_stream`] is one replication session. Any error ends it
//! with everything unsettled abandoned: the slot was never confirmed past
//! those events, so the next session reads them again (at-least-once), and
//! rows already marked are filtered out of the replay.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pgwire_replication::ReplicationClient;
use replication::{Lsn, RelationCache};
use tokio::sync::{watch, Notify};
use tokio::task::JoinSet;
use tokio_postgres::Client;

use crate::db;
use crate::db::settled::Holder;
use crate::metrics::Metrics;
use crate::pipeline::assemble::{Parts, Settler, Streaming};
use crate::pipeline::watermark::Watermark;
use crate::source::mapped_table::{readable_again, run_resends, Resend};

mod decode;
pub mod mapped;
pub mod publication;
mod row;
mod session;
pub(crate) mod slot;

use crate::pipeline::intake::Intake;
use decode::{Decoder, Step};
pub use session::check_cdc;
pub(crate) use session::connect_replication;
use session::{open_session, Opened};
pub use slot::INVALIDATION_SQL;
pub(crate) use slot::{create_slot_exporting, hand_off_begins, hand_off_done, hand_to_table, import_snapshot};
mod held;
mod wal_watch;
pub use held::{server_hold, watch_down, HandedUntil};
use held::{watch_held, HeldWatch, StreamProgress};
use wal_watch::watch_wal;

/// Events of one transaction are checked against the table and dispatched in
/// chunks of this many, or of this many bytes, whichever comes first. A
/// chunk is held outside the byte budget until it is routed (with, a
/// transaction going on past it, its rows read back from the table beside
/// it): 4 MiB chunks and their copies passed the memory bound.
const CHUNK: usize = 1_000;
const CHUNK_BYTES: usize = 1 << 20;
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
    #[error("routing: {0}")]
    Route(#[from] crate::pipeline::route::RouteError),
}

/// Everything a session needs that outlives it.
pub struct StreamContext {
    /// The database, built once at start-up.
    pub db: crate::db::Db,
    /// The pipeline's settings, queues, lane states, publisher and metrics.
    pub parts: Arc<Parts>,
    /// This process has streamed from the slot: if it is missing now, it was
    /// dropped under us.
    pub slot_seen: AtomicBool,
    /// A sharded relay (filtered publication) catches up only its destinations.
    pub shard: Option<Vec<String>>,
    /// When the current session started streaming (taken by the relay when
    /// the session ends, to tell a healthy session from a failing one).
    pub streaming_since: Mutex<Option<std::time::Instant>>,
    /// Rows committed before this position may have been handed to the
    /// table while no stream brought them ([`held`]).
    pub handed_until: Arc<HandedUntil>,
}

/// Run one replication session until `shutdown` turns true (Ok) or an error.
/// Every step of opening it has a deadline, and `shutdown` is honoured at
/// every await: opening, catching up, and handing events to a full lane or
/// budget.
pub async fn run_stream(ctx: &StreamContext, shutdown: &mut watch::Receiver<bool>) -> Result<(), CdcError> {
    let stop = shutdown.clone();
    let opened = tokio::select! {
        o = open_session(ctx, &stop) => o?,
        _ = shutdown.wait_for(|s| *s) => return Ok(()),
    };
    let Opened { sql, mut repl, start_lsn, startup_lsn, skipped } = opened;
    ctx.slot_seen.store(true, Ordering::Relaxed);
    ctx.parts.metrics.set_ready(true);
    *ctx.streaming_since.lock().unwrap() = Some(std::time::Instant::now());
    tracing::info!(slot = %ctx.parts.settings.slot.name, start = %start_lsn, "streaming");

    let mut pipeline = match start_pipeline(ctx, &sql, start_lsn, skipped, &stop).await {
        Ok(p) => p,
        Err(e) => {
            let _ = repl.shutdown().await;
            return Err(e);
        }
    };
    let mut sent = start_lsn;
    let result = Session { ctx, sql: &sql, repl: &mut repl, pipeline: &mut pipeline, sent: &mut sent }
        .stream(startup_lsn, shutdown)
        .await;
    ctx.parts.metrics.set_ready(false);
    if result.is_ok() {
        sent = drain(&mut pipeline, &repl, sent, &ctx.parts.metrics).await;
        tracing::info!(confirmed = %sent, "replication stopped");
    }
    // Every task of the session ends with it.
    drop(pipeline);
    // What this session's watch held is released: the next session, or the
    // watch for one, judges afresh.
    ctx.parts.metrics.release_hold();
    ctx.parts.destinations.states().iter().for_each(|l| l.release());
    let _ = repl.shutdown().await;
    result
}

/// The tasks of a session beside its stream: aborted together when it
/// ends, however it ends (dropped with its [`Pipeline`]).
#[derive(Default)]
struct Tasks {
    handles: Vec<tokio::task::AbortHandle>,
    /// The lanes, those the router opens later included.
    lanes: Option<Arc<Mutex<JoinSet<()>>>>,
}

impl Tasks {
    /// Spawn a task the session owns.
    fn spawn<T: Send + 'static>(
        &mut self,
        task: impl std::future::Future<Output = T> + Send + 'static,
    ) -> tokio::task::JoinHandle<T> {
        let handle = tokio::spawn(task);
        self.handles.push(handle.abort_handle());
        handle
    }
}

impl Drop for Tasks {
    fn drop(&mut self) {
        if let Some(lanes) = &self.lanes {
            lanes.lock().unwrap().abort_all();
        }
        self.handles.iter().for_each(tokio::task::AbortHandle::abort);
    }
}

/// The running parts of a session: lanes, the intake in front of them and
/// the settler behind, the WAL and held-stream watches, the mapped tables'
/// resends; its [`Tasks`] own every task.
struct Pipeline {
    intake: Option<Intake>,
    settler: Settler,
    watermark: Arc<Mutex<Watermark>>,
    /// Notified when the settler has moved the watermark.
    confirm: Arc<Notify>,
    progress: Arc<StreamProgress>,
    /// Mapped rows set unpublished again, to their claims ([`run_resends`]).
    resend: tokio::sync::mpsc::UnboundedSender<Resend>,
    /// Ends with the name of a mapped table the catch-up skipped once it is
    /// readable again ([`readable_again`]): the session ends for the next
    /// one's catch-up.
    readable: tokio::task::JoinHandle<String>,
    tasks: Tasks,
}

impl Pipeline {
    fn intake(&mut self) -> &mut Intake {
        self.intake.as_mut().expect("the intake is taken only by the drain, after the stream")
    }
}

/// The session's pipeline ([`Streaming::start`]) from `start_lsn`, after
/// the lanes with rows in the table are set spooling; and the WAL and
/// held-row watches beside it.
async fn start_pipeline(
    ctx: &StreamContext,
    sql: &Client,
    start_lsn: Lsn,
    skipped: Vec<usize>,
    stop: &watch::Receiver<bool>,
) -> Result<Pipeline, CdcError> {
    let (cfg, db) = (&ctx.parts.settings, &ctx.db);
    let settler_client = db.connect().await?;
    spool_lanes_with_rows_in_table(ctx, sql).await?;
    let mut tasks = Tasks::default();
    tasks.spawn(watch_wal(db.clone(), cfg.slot.name.clone(), cfg.slot.max_retained_wal, Arc::clone(&ctx.parts)));
    let progress = Arc::new(StreamProgress::default());
    tasks.spawn(watch_held(HeldWatch {
        db: db.clone(),
        parts: Arc::clone(&ctx.parts),
        progress: Arc::clone(&progress),
        handed_until: Arc::clone(&ctx.handed_until),
    }));
    let watermark = Arc::new(Mutex::new(Watermark::new(start_lsn)));
    let confirm = Arc::new(Notify::new());
    let Streaming { intake, lanes, settler } = Streaming::start(&ctx.parts, settler_client, &watermark, &confirm);
    tasks.handles.push(settler.abort_handle());
    tasks.lanes = Some(lanes);
    let (resend, rx) = tokio::sync::mpsc::unbounded_channel();
    tasks.spawn(run_resends(db.clone(), Arc::clone(&ctx.parts), rx, stop.clone()));
    let readable = tasks.spawn(readable_again(db.clone(), Arc::clone(&ctx.parts), skipped));
    Ok(Pipeline { intake: Some(intake), settler, watermark, confirm, progress, resend, readable, tasks })
}

/// Lanes with rows in the table keep spooling until the drain empties it,
/// so a FIFO group is not overtaken by its own newer events.
async fn spool_lanes_with_rows_in_table(ctx: &StreamContext, sql: &Client) -> Result<(), CdcError> {
    let spooled: Vec<String> = ctx
        .db
        .query(
            "looking for spooled rows",
            sql.query(&format!("SELECT DISTINCT destination FROM outbox WHERE {}", Holder::Table.sql("")), &[]),
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    // A destination looked up on first use by an earlier run: looked up
    // again, so its lane spools behind its rows (or they wait, or are DEAD).
    for name in spooled.iter().filter(|n| ctx.parts.destinations.get(n).is_none()) {
        let _ = ctx.parts.destinations.resolve(name).await;
    }
    for d in ctx.parts.destinations.all() {
        d.state.reset_deferred();
        if spooled.iter().any(|s| **s == *d.name) {
            d.state.start_spooling(crate::policy::spool::SpoolCause::RowsInTable);
        }
    }
    Ok(())
}

/// Graceful end: no more reading; the lanes finish what they hold (within
/// the grace), the settler marks it, and the last settled position is
/// confirmed. Returns the confirmed position.
async fn drain(pipeline: &mut Pipeline, repl: &ReplicationClient, mut sent: Lsn, metrics: &Metrics) -> Lsn {
    drop(pipeline.intake.take());
    // The router is gone: no lane opens now.
    let lanes = pipeline.tasks.lanes.as_ref().map(|l| std::mem::take(&mut *l.lock().unwrap()));
    let drained = tokio::time::timeout(SHUTDOWN_GRACE, async {
        if let Some(mut lanes) = lanes {
            while lanes.join_next().await.is_some() {}
        }
        let _ = (&mut pipeline.settler).await;
    })
    .await;
    if drained.is_err() {
        tracing::warn!("in-flight batches abandoned at shutdown; their rows will be sent again");
    }
    let before = sent;
    let confirmable = pipeline.watermark.lock().unwrap().confirmed();
    sent = confirm_if_advanced(repl, confirmable, sent, metrics);
    if sent > before {
        // Let the worker send the final standby status before CopyDone.
        tokio::time::sleep(STATUS_INTERVAL + Duration::from_millis(200)).await;
    }
    sent
}

/// A streaming session: its connections, its pipeline, and the position
/// last confirmed to the server.
struct Session<'s> {
    ctx: &'s StreamContext,
    sql: &'s Client,
    repl: &'s mut ReplicationClient,
    pipeline: &'s mut Pipeline,
    sent: &'s mut Lsn,
}

impl Session<'_> {
    /// The session's loop, until shutdown or an error: receive, decode,
    /// hand the change to the pipeline, confirm what it has settled.
    /// `startup_lsn`: where the stream started this time (what comes before
    /// it is a replay).
    async fn stream(self, startup_lsn: Lsn, shutdown: &mut watch::Receiver<bool>) -> Result<(), CdcError> {
        let Session { ctx, sql, repl, pipeline, sent } = self;
        let mut decoder = Decoder {
            cache: RelationCache::new(),
            txn: None,
            startup_lsn,
            handed_until: Arc::clone(&ctx.handed_until),
            mapped: ctx.parts.settings.mapped.iter().map(|m| (m.clone(), m.published_column())).collect(),
            resend: pipeline.resend.clone(),
        };
        let confirm = Arc::clone(&pipeline.confirm);
        loop {
            tokio::select! {
                ev = repl.recv() => {
                    let ev = ev?.ok_or_else(|| CdcError::Protocol("replication stream ended".into()))?;
                    if let Some(lsn) = position(&ev) {
                        pipeline.progress.saw(lsn);
                    }
                    // Handing events on may wait for a lane or the budget:
                    // shutdown is honoured meanwhile (nothing unsettled is confirmed).
                    pipeline.progress.set_busy(true);
                    let went_on = tokio::select! {
                        r = take(ctx, sql, &mut decoder, pipeline.intake(), ev) => r?,
                        _ = shutdown.wait_for(|s| *s) => false,
                    };
                    if !went_on {
                        return Ok(());
                    }
                    pipeline.progress.set_busy(false);
                }
                _ = confirm.notified() => {}
                r = &mut pipeline.settler => return Err(settler_ended(r)),
                table = &mut pipeline.readable => return Err(CdcError::Protocol(format!(
                    "mapped table {} readable again: a new session catches up the rows that waited",
                    table.unwrap_or_default()
                ))),
                _ = shutdown.changed() => {
                    if *shutdown.borrow() {
                        return Ok(());
                    }
                }
            }
            *sent = confirm_if_advanced(repl, pipeline.intake().confirmable(), *sent, &ctx.parts.metrics);
        }
    }
}

/// One replication event, decoded and handed to the pipeline; false when
/// the stream reached its stop position.
async fn take(
    ctx: &StreamContext,
    sql: &Client,
    decoder: &mut Decoder,
    intake: &mut Intake,
    ev: pgwire_replication::ReplicationEvent,
) -> Result<bool, CdcError> {
    match decoder.handle(ev, sql).await? {
        Step::Change(change) => intake.take(sql, change).await?,
        Step::Heartbeat { written_us } => ctx.parts.metrics.heartbeat_returned(written_us),
        Step::Nothing => {}
        Step::Stopped => return Ok(false),
    }
    Ok(true)
}

/// Why the session ends when its settler has.
fn settler_ended(r: Result<Result<(), tokio_postgres::Error>, tokio::task::JoinError>) -> CdcError {
    CdcError::Settler(match r {
        Ok(Ok(())) => "settler ended".into(),
        Ok(Err(e)) => db::describe(&e),
        Err(e) => e.to_string(),
    })
}

/// How far the server has streamed, from an event that carries it
/// (keepalives do not: a held walsender still sends them).
fn position(ev: &pgwire_replication::ReplicationEvent) -> Option<Lsn> {
    use pgwire_replication::ReplicationEvent as E;
    match ev {
        E::XLogData { wal_start, .. } if wal_start.0 > 0 => Some(from_wire(*wal_start)),
        E::Commit { end_lsn, .. } => Some(from_wire(*end_lsn)),
        E::Message { lsn, .. } => Some(from_wire(*lsn)),
        _ => None,
    }
}

/// The replication client's position as the decoder's and the watermark's.
pub(crate) fn from_wire(lsn: pgwire_replication::Lsn) -> Lsn {
    Lsn(lsn.0)
}

/// Tell the server the slot may move up to `confirmable` if that is past
/// what it was last told (`sent`); returns what it has now been told.
fn confirm_if_advanced(repl: &ReplicationClient, confirmable: Lsn, sent: Lsn, metrics: &Metrics) -> Lsn {
    let c = confirmable;
    if c > sent {
        crate::faults::crash_point("cdc::before_confirm");
        repl.update_applied_lsn(pgwire_replication::Lsn(c.0));
        metrics.confirmed_lsn.set(c.0 as i64);
        c
    } else {
        sent
    }
}
