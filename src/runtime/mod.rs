//! The relay as a whole: start-up checks, then replication sessions one after
//! another (a failed session is followed by a new one after a backoff), beside
//! the metrics server, the slot monitor and the heartbeat.

pub mod http;
mod leader;
mod monitor;
mod retention;
mod startup;

use leader::{acquire_leadership, watch_lock};
use monitor::monitor;
use retention::sweep_retention;
pub use retention::{prune_runs, sweep_once};
use startup::{start_up_until_done, Started};

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use std::sync::atomic::AtomicBool;

use crate::config::{Config, Mode};
use crate::db::pool::Pool;
use crate::db::{self, Db};
use crate::metrics::Metrics;
use crate::pipeline::archive::sweep::run_sweep;
use crate::pipeline::assemble::Parts;
use crate::pipeline::destinations::{Destination, Destinations, REREAD_EVERY};
use crate::pipeline::lane::LaneState;
use crate::pipeline::settings::Settings;
use crate::publish::limit::CallLimit;
use crate::publish::Publisher;
use crate::source::cdc::{run_stream, watch_down, StreamContext};
use crate::source::mapped_table::run_mapped_poller;
use crate::source::table::{
    lane_needed, run_table_lane, run_unknown_destination_sweeper, waiting_destinations, Claims, TableLaneConfig,
};

#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    /// Start-up refused: the message says how to fix it.
    #[error("{0}")]
    Startup(String),
}

/// Run the relay until `shutdown` resolves. Start-up problems are returned at
/// once; problems after that (database restarts, network) are retried.
pub async fn run(
    config: Config,
    publisher: Arc<dyn Publisher>,
    metrics: Arc<Metrics>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), RelayError> {
    let (stop_tx, mut stop_rx) = watch::channel(false);
    tokio::spawn(async move {
        shutdown.await;
        let _ = stop_tx.send(true);
    });
    let call_bytes = crate::pipeline::budget::call_bytes(config.max_unsettled_bytes);
    let publisher: Arc<dyn Publisher> = Arc::new(CallLimit::new(publisher, config.max_concurrent_calls, call_bytes));

    let metrics_server = serve_metrics(&config, &metrics, &stop_rx).await?;

    // Every start-up step has a deadline, and SIGTERM ends start-up at any point.
    let db = Db::of(&config);
    let started = start_up_until_done(&config, &db, publisher.as_ref(), &metrics, &mut stop_rx).await;
    let Ok(Some(started)) = started else {
        if let Some(s) = metrics_server {
            s.abort();
        }
        if started.is_ok() {
            tracing::info!("shutdown requested during start-up; stopped");
        }
        return started.map(|_| ());
    };
    let (mode, sharded) = (started.mode, started.sharded);
    let (parts, beside) = assemble(&config, &db, started, publisher, &metrics, &stop_rx);
    let env = Env { config: &config, db: &db, parts, mode, sharded };
    if mode == Mode::Polling {
        run_polling(&env, &mut stop_rx).await;
    } else {
        run_cdc(&env, &mut stop_rx).await;
    }
    beside.iter().for_each(tokio::task::JoinHandle::abort);
    if let Some(s) = metrics_server {
        let _ = s.await;
    }
    Ok(())
}

/// The metrics server, served from the start: `/healthz` answers while
/// start-up waits on PostgreSQL or AWS (a probe must not restart a relay
/// for their outage), `/readyz` says it is starting.
async fn serve_metrics(
    config: &Config,
    metrics: &Arc<Metrics>,
    stop: &watch::Receiver<bool>,
) -> Result<Option<tokio::task::JoinHandle<std::io::Result<()>>>, RelayError> {
    let Some(addr) = config.metrics_addr else { return Ok(None) };
    let listener = http::bind(addr)
        .await
        .map_err(|e| RelayError::Startup(format!("cannot listen on metrics_addr {addr}: {e}")))?;
    let mut stop = stop.clone();
    Ok(Some(tokio::spawn(http::serve(listener, Arc::clone(metrics), async move {
        let _ = stop.wait_for(|s| *s).await;
    }))))
}

/// Once start-up is done: the settings, derived once; the pipeline's
/// parts; and the tasks beside the sources (the monitor, the retention
/// sweeper, the archive's sweep, the queue limits' rereads, the mapped tables' watch), returned
/// to be stopped with the relay.
fn assemble(
    config: &Config,
    db: &Db,
    started: Started,
    publisher: Arc<dyn Publisher>,
    metrics: &Arc<Metrics>,
    stop: &watch::Receiver<bool>,
) -> (Arc<Parts>, Vec<tokio::task::JoinHandle<()>>) {
    let Started { mode, queues, retention, mapped, prepare, archive, .. } = started;
    let settings = Settings::of(config, mode, mapped);
    let template = config.destination_template.clone();
    let destinations = Destinations::new(queues, template, prepare, Arc::clone(&publisher), Arc::clone(metrics));
    let parts = Arc::new(Parts::new(settings, destinations, publisher, Arc::clone(metrics)).archiving(archive.clone()));
    let watched = monitor::Watched::of(config, mode);
    let publication = (mode != Mode::Polling).then(|| parts.settings.slot.publication.clone());
    let mapped = parts.settings.mapped.clone();
    let mut beside = vec![
        tokio::spawn(monitor(watched, db.clone(), Arc::clone(metrics), stop.clone())),
        tokio::spawn(sweep_retention(db.clone(), retention, Arc::clone(metrics), stop.clone())),
        tokio::spawn(reread_queue_limits(Arc::clone(&parts), stop.clone())),
        tokio::spawn(monitor::watch_mapped_tables(db.clone(), mapped, publication, Arc::clone(metrics), stop.clone())),
    ];
    if let Some(archive) = archive {
        beside.push(tokio::spawn(run_sweep(archive, Arc::clone(metrics), stop.clone())));
    }
    (parts, beside)
}

/// Every [`REREAD_EVERY`], every queue's `MaximumMessageSize` read again.
async fn reread_queue_limits(parts: Arc<Parts>, mut stop: watch::Receiver<bool>) {
    loop {
        tokio::select! {
            _ = tokio::time::sleep(REREAD_EVERY) => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        parts.destinations.reread_limits().await;
    }
}

/// What the running relay's parts share.
struct Env<'a> {
    config: &'a Config,
    db: &'a Db,
    /// The pipeline's parts, for both sources.
    parts: Arc<Parts>,
    mode: Mode,
    sharded: bool,
}

/// Polling relays are all active: SKIP LOCKED keeps them apart.
async fn run_polling(env: &Env<'_>, stop_rx: &mut watch::Receiver<bool>) {
    let mut table_lanes = spawn_table_path(env, stop_rx.clone());
    env.parts.metrics.set_ready(true);
    tracing::info!(destinations = env.parts.destinations.len(), "polling the outbox table");
    let _ = stop_rx.wait_for(|s| *s).await;
    env.parts.metrics.set_ready(false);
    drain_table(&mut table_lanes).await;
}

/// The table path: every destination in polling mode; the spool drain of
/// every destination in CDC mode (while this relay leads), each destination
/// looked up since included ([`run_table_lanes`]); mapped tables' polling;
/// and the sweeper of unknown destinations (not in a shard: other shards'
/// rows are theirs).
fn spawn_table_path(env: &Env<'_>, stop: watch::Receiver<bool>) -> tokio::task::JoinSet<()> {
    let mut set = tokio::task::JoinSet::new();
    let poll_interval = env.parts.settings.poll_interval;
    set.spawn(run_table_lanes(env.db.clone(), Arc::clone(&env.parts), env.mode, stop.clone()));
    if env.mode == Mode::Polling {
        for m in &env.parts.settings.mapped {
            let (db, parts) = (env.db.clone(), Arc::clone(&env.parts));
            set.spawn(run_mapped_poller(m.clone(), db, parts, poll_interval, stop.clone()));
        }
    }
    if !env.sharded {
        let source = if env.mode == Mode::Polling { Claims::Poll } else { Claims::Spool };
        set.spawn(run_unknown_destination_sweeper(env.db.clone(), Arc::clone(&env.parts), source, stop));
    }
    set
}

/// The table path's lanes, one per destination with rows to claim: every
/// poll (at least every 500 ms) one query finds the destinations whose
/// table rows are due ([`waiting_destinations`]) and a lane starts for each
/// (and for each whose stream lane spools: [`lane_needed`]) that has none;
/// a lane ends once idle. A thousand destinations streaming keep no table
/// lane and no connection of their own.
async fn run_table_lanes(db: Db, parts: Arc<Parts>, mode: Mode, mut stop: watch::Receiver<bool>) {
    let source = if mode == Mode::Polling { Claims::Poll } else { Claims::Spool };
    let every = table_poll_interval(&parts, mode);
    let mut lanes = tokio::task::JoinSet::new();
    let mut running: HashMap<tokio::task::Id, Arc<str>> = HashMap::new();
    let mut kept = db::Kept::new(db.clone());
    let pool = Pool::new(db.clone(), parts.settings.table_connections);
    loop {
        let waiting = waiting_now(&mut kept, source).await;
        for d in parts.destinations.all() {
            let wanted = waiting.contains(&*d.name) || (source == Claims::Spool && lane_needed(Some(&d.state)));
            if wanted && !running.values().any(|n| *n == d.name) {
                let (cfg, state) = table_lane(&parts, mode, &d);
                let lane = lanes.spawn(run_table_lane(cfg, pool.clone(), Arc::clone(&parts), state, stop.clone()));
                running.insert(lane.id(), Arc::clone(&d.name));
            }
        }
        pool.close_idle();
        parts.metrics.table_lanes.set(running.len() as i64);
        parts.metrics.table_connections.set(pool.open() as i64);
        tokio::select! {
            Some(done) = lanes.join_next_with_id() => {
                let id = match done { Ok((id, ())) => id, Err(e) => e.id() };
                running.remove(&id);
            }
            _ = tokio::time::sleep(every) => {}
            _ = stop.wait_for(|s| *s) => break,
        }
    }
    drain_table(&mut lanes).await;
}

/// The destinations with rows waiting in the table (none, logged, when the
/// query fails: lanes already running go on, and the next poll asks again).
async fn waiting_now(kept: &mut db::Kept, source: Claims) -> HashSet<String> {
    let Some(c) = kept.get().await else { return HashSet::new() };
    match waiting_destinations(c, source).await {
        Ok(w) => w,
        Err(e) => {
            tracing::warn!(error = %db::describe(&e), "table path: looking for waiting rows failed; retrying");
            kept.lost();
            HashSet::new()
        }
    }
}

/// How often the table path claims: `poll_interval` polling; at least every
/// 500 ms draining spools beside the stream.
fn table_poll_interval(parts: &Parts, mode: Mode) -> Duration {
    match mode {
        Mode::Polling => parts.settings.poll_interval,
        _ => parts.settings.poll_interval.max(Duration::from_millis(500)),
    }
}

/// A destination's table lane: polling every NEW row, or draining the spool.
fn table_lane(parts: &Parts, mode: Mode, d: &Destination) -> (TableLaneConfig, Option<Arc<LaneState>>) {
    let poll_interval = table_poll_interval(parts, mode);
    let (source, state) = match mode {
        Mode::Polling => (Claims::Poll, None),
        _ => (Claims::Spool, Some(Arc::clone(&d.state))),
    };
    let cfg = TableLaneConfig {
        name: Arc::clone(&d.name),
        target: d.target.clone(),
        source,
        claim_limit: TABLE_CLAIM_LIMIT,
        poll_interval,
    };
    (cfg, state)
}

/// One relay per slot streams: the leader holds an advisory lock on a
/// connection of its own; the others wait for it to go. A leader that loses
/// its lock stops publishing at once and tries to lead again.
async fn run_cdc(env: &Env<'_>, stop_rx: &mut watch::Receiver<bool>) {
    let ctx = StreamContext {
        db: env.db.clone(),
        parts: Arc::clone(&env.parts),
        slot_seen: AtomicBool::new(false),
        shard: env.sharded.then(|| env.parts.destinations.all().iter().map(|d| d.name.to_string()).collect()),
        streaming_since: std::sync::Mutex::new(None),
        handed_until: Arc::default(),
    };
    loop {
        let mut stop = stop_rx.clone();
        let lock = tokio::select! {
            l = acquire_leadership(env.config, env.db, &env.parts.metrics, stop_rx) => l,
            _ = stop.wait_for(|s| *s) => None,
        };
        let Some(lock) = lock else { break };
        let mut table_lanes = spawn_table_path(env, stop_rx.clone());
        let lost = lead(&ctx, lock, stop_rx).await;
        env.parts.metrics.set_ready(false);
        env.parts.metrics.is_leader.set(0);
        env.parts.metrics.leader_changes.inc();
        if lost {
            table_lanes.abort_all();
            // The session ended with the lock; the next one is a restart.
            env.parts.metrics.stream_restarts.inc();
            tracing::error!(slot = %env.config.slot, "lost the leader lock's connection: stopped publishing; trying to lead again");
            continue;
        }
        drain_table(&mut table_lanes).await;
        break;
    }
}

/// Replication sessions one after another while this relay holds `lock`,
/// each failure followed by the reconnect backoff. Returns true when the
/// lock was lost, false on shutdown.
async fn lead(ctx: &StreamContext, lock: tokio_postgres::Client, stop_rx: &mut watch::Receiver<bool>) -> bool {
    // Polled here, not spawned: if this task goes, the lock goes with it.
    let watchdog = watch_lock(lock, ctx.parts.settings.slot.takeover_timeout);
    tokio::pin!(watchdog);
    // No session streaming for long: the rows go by the table meanwhile.
    let last_error = std::sync::Mutex::new(None);
    let down = watch_down(ctx, &last_error);
    tokio::pin!(down);
    let mut reconnect = crate::policy::retry::Reconnect::default();
    loop {
        if *stop_rx.borrow() {
            return false;
        }
        let r = tokio::select! {
            r = run_stream(ctx, stop_rx) => r,
            // Lock gone: stop publishing at once, no draining.
            _ = &mut watchdog => return true,
            _ = &mut down => unreachable!("the session watch runs for as long as the relay leads"),
        };
        let Err(e) = r else { return false };
        ctx.parts.metrics.stream_restarts.inc();
        let streamed_for = ctx.streaming_since.lock().unwrap().take().map(|t| t.elapsed());
        let wait = reconnect.session_ended(streamed_for);
        tracing::error!(error = %e, retry_in = ?wait, "replication session ended; starting a new one");
        *last_error.lock().unwrap() = Some(e.to_string());
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = stop_rx.wait_for(|s| *s) => return false,
            _ = &mut watchdog => return true,
            _ = &mut down => unreachable!("the session watch runs for as long as the relay leads"),
        }
    }
}

/// Table lanes finish the claim they are in (its rows are marked and
/// committed) or, past the grace, are abandoned (their rows stay NEW).
async fn drain_table(set: &mut tokio::task::JoinSet<()>) {
    let drained = tokio::time::timeout(SHUTDOWN_GRACE, async { while set.join_next().await.is_some() {} }).await;
    if drained.is_err() {
        tracing::warn!("table claims abandoned at shutdown; their rows stay NEW and are sent again");
        set.abort_all();
    }
}

/// Rows one table-path transaction claims.
const TABLE_CLAIM_LIMIT: usize = 500;
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);
