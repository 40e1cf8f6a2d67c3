//! The relay as a whole: start-up checks, then replication sessions one after
//! another (a failed session is followed by a new one after a backoff), beside
//! the metrics server, the slot monitor and the heartbeat.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use std::sync::atomic::AtomicBool;

use crate::source::cdc::{run_stream, StreamContext, HEARTBEAT_PREFIX};
use crate::config::{Config, Mode};
use crate::db;
use crate::pipeline::lane::LaneState;
use crate::metrics::Metrics;
use crate::publish::Publisher;
use crate::pipeline::settle::Backoff;
use crate::source::table::{run_table_lane, run_unknown_destination_sweeper, Source, TableLaneConfig};

#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    /// Start-up refused: the message says how to fix it.
    #[error("{0}")]
    Startup(String),
}

/// What a caller keeps of a running relay.
#[derive(Clone)]
pub struct RelayHandle {
    pub metrics: Arc<Metrics>,
}

/// Run the relay until `shutdown` resolves. Start-up problems are returned at
/// once; problems after that (database restarts, network) are retried.
pub async fn run(
    config: Config,
    publisher: Arc<dyn Publisher>,
    handle: RelayHandle,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), RelayError> {
    let metrics = handle.metrics;
    let (stop_tx, mut stop_rx) = watch::channel(false);
    tokio::spawn(async move {
        shutdown.await;
        let _ = stop_tx.send(true);
    });

    // Every start-up step has a deadline, and SIGTERM ends start-up at any point.
    let started = tokio::select! {
        r = start_up(&config, publisher.as_ref(), &metrics) => r?,
        _ = stop_rx.wait_for(|s| *s) => {
            tracing::info!("shutdown requested during start-up; stopped");
            return Ok(());
        }
    };
    let Started { mode, sharded, queues, listener, retention } = started;
    let metrics_server = listener.map(|listener| {
        let mut stop = stop_rx.clone();
        let m = Arc::clone(&metrics);
        tokio::spawn(crate::metrics::serve(listener, m, async move {
            let _ = stop.wait_for(|s| *s).await;
        }))
    });
    let monitor = tokio::spawn(monitor(config.clone(), mode, Arc::clone(&metrics), stop_rx.clone()));
    let sweeper =
        retention.map(|r| tokio::spawn(sweep_retention(config.db(), r, Arc::clone(&metrics), stop_rx.clone())));

    // The table path: every destination in polling mode; the spool drain of
    // every destination in CDC mode (while this relay leads).
    let lanes: BTreeMap<String, Arc<LaneState>> =
        queues.keys().map(|n| (n.clone(), LaneState::new(n, Arc::clone(&metrics)))).collect();
    let spawn_table = |stop: watch::Receiver<bool>| {
        let mut set = tokio::task::JoinSet::new();
        for (name, queue) in &queues {
            let (source, state, poll_interval) = match mode {
                Mode::Polling => (Source::Poll, None, config.poll_interval),
                _ => (
                    Source::Spool,
                    Some(Arc::clone(&lanes[name])),
                    config.poll_interval.max(Duration::from_millis(500)),
                ),
            };
            let cfg = TableLaneConfig {
                name: Arc::from(name.as_str()),
                queue: queue.clone(),
                source,
                claim_limit: TABLE_CLAIM_LIMIT,
                claim_bytes: (config.max_unsettled_bytes / 4).max(1 << 20),
                poll_interval,
                linger: config.linger,
                max_in_flight: config.max_in_flight_batches,
                backoff: Backoff { base: config.retry_base, max: config.retry_max },
            };
            set.spawn(run_table_lane(
                cfg,
                config.db(),
                Arc::clone(&publisher),
                Arc::clone(&metrics),
                state,
                stop.clone(),
            ));
        }
        // Other shards' rows are not unknown: a shard leaves them alone.
        if !sharded {
            set.spawn(run_unknown_destination_sweeper(
                config.db(),
                queues.keys().cloned().collect(),
                if mode == Mode::Polling { Source::Poll } else { Source::Spool },
                Arc::clone(&metrics),
                stop,
            ));
        }
        set
    };

    if mode == Mode::Polling {
        // Polling relays are all active: SKIP LOCKED keeps them apart.
        let mut table_lanes = spawn_table(stop_rx.clone());
        metrics.set_ready(true);
        tracing::info!(destinations = queues.len(), "polling the outbox table");
        let _ = stop_rx.wait_for(|s| *s).await;
        metrics.set_ready(false);
        drain_table(&mut table_lanes).await;
    } else {
        let ctx = StreamContext {
            config: config.clone(),
            queues: queues.clone(),
            publisher: Arc::clone(&publisher),
            metrics: Arc::clone(&metrics),
            lanes: lanes.clone(),
            slot_seen: AtomicBool::new(false),
            shard: sharded.then(|| queues.keys().cloned().collect()),
            streaming_since: std::sync::Mutex::new(None),
        };
        // One relay per slot streams: the leader holds an advisory lock on a
        // connection of its own; the others wait for it to go.
        loop {
            let mut stop = stop_rx.clone();
            let lock = tokio::select! {
                l = acquire_leadership(&config, &metrics, &mut stop_rx) => l,
                _ = stop.wait_for(|s| *s) => None,
            };
            let Some(lock) = lock else { break };
            // Polled here, not spawned: if this task goes, the lock goes with it.
            let watchdog = watch_lock(lock, config.takeover_timeout);
            tokio::pin!(watchdog);
            let mut table_lanes = spawn_table(stop_rx.clone());
            let mut reconnect = crate::policy::retry::Reconnect::default();
            let lost = loop {
                if *stop_rx.borrow() {
                    break false;
                }
                let r = tokio::select! {
                    r = run_stream(&ctx, &mut stop_rx) => r,
                    // Lock gone: stop publishing at once, no draining.
                    _ = &mut watchdog => break true,
                };
                match r {
                    Ok(()) => break false,
                    Err(e) => {
                        metrics.stream_restarts.inc();
                        let streamed_for = ctx.streaming_since.lock().unwrap().take().map(|t| t.elapsed());
                        let wait = reconnect.session_ended(streamed_for);
                        tracing::error!(error = %e, retry_in = ?wait, "replication session ended; starting a new one");
                        tokio::select! {
                            _ = tokio::time::sleep(wait) => {}
                            _ = stop_rx.wait_for(|s| *s) => break false,
                            _ = &mut watchdog => break true,
                        }
                    }
                }
            };
            metrics.set_ready(false);
            metrics.is_leader.set(0);
            metrics.leader_changes.inc();
            if lost {
                table_lanes.abort_all();
                tracing::error!(slot = %config.slot, "lost the leader lock's connection: stopped publishing; trying to lead again");
                continue;
            }
            drain_table(&mut table_lanes).await;
            break;
        }
    }
    monitor.abort();
    if let Some(s) = sweeper {
        s.abort();
    }
    if let Some(s) = metrics_server {
        let _ = s.await;
    }
    Ok(())
}

/// What start-up found out.
struct Started {
    mode: Mode,
    sharded: bool,
    queues: BTreeMap<String, crate::event::QueueInfo>,
    listener: Option<tokio::net::TcpListener>,
    retention: Option<Duration>,
}

/// The start-up checks, each with a deadline: the database (connect_timeout,
/// query_timeout), the queues (the SQS client's own timeouts), the metrics
/// listener.
async fn start_up(config: &Config, publisher: &dyn Publisher, metrics: &Metrics) -> Result<Started, RelayError> {
    let startup = |e: db::DbError| RelayError::Startup(e.to_string());
    let db = config.db();
    let sql = db.connect().await.map_err(startup)?;
    let (mode, sharded) = resolve_mode(&sql, config).await?;
    for m in [Mode::Cdc, Mode::Polling] {
        metrics.mode.with_label_values(&[&m.to_string()]).set(i64::from(m == mode));
    }
    let mut queues = BTreeMap::new();
    for (name, url) in &config.destinations {
        let info = publisher.queue_info(url).await.map_err(|e| {
            RelayError::Startup(format!(
                "destination {name:?}: queue {url} did not answer GetQueueAttributes ({e}); check the queue URL, the region/endpoint and the credentials"
            ))
        })?;
        tracing::info!(destination = %name, url = %url, fifo = info.fifo, max_message_size = info.max_message_size, "queue ready");
        queues.insert(name.clone(), info);
    }
    let listener = match config.metrics_addr {
        Some(addr) => Some(
            crate::metrics::bind(addr)
                .await
                .map_err(|e| RelayError::Startup(format!("cannot listen on metrics_addr {addr}: {e}")))?,
        ),
        None => None,
    };
    if mode == Mode::Polling {
        let _ = tokio::time::timeout(config.query_timeout, warn_if_slot_retains_wal(&sql, &config.slot)).await;
    }
    let mut retention = config.retention;
    if retention.is_some()
        && !db.within("checking DELETE on the outbox", db::can_delete_outbox(&sql)).await.map_err(startup)?
    {
        tracing::warn!("the retention sweeper needs DELETE on the outbox table (GRANT DELETE ON outbox TO <role>); PUBLISHED rows are kept");
        retention = None;
    }
    Ok(Started { mode, sharded, queues, listener, retention })
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

/// Wait until this relay holds the slot's leader lock (a session advisory
/// lock on a connection of its own); `None` when asked to stop first.
async fn acquire_leadership(
    config: &Config,
    metrics: &Metrics,
    stop: &mut watch::Receiver<bool>,
) -> Option<tokio_postgres::Client> {
    let key = format!("outbox_relay_leader:{}", config.slot);
    let poll = (config.takeover_timeout / 10).max(Duration::from_millis(100));
    let mut waiting = false;
    loop {
        if *stop.borrow() {
            return None;
        }
        let db = config.db();
        match db.connect().await {
            Ok(c) => loop {
                match db
                    .query(
                        "taking the leader lock",
                        c.query_one("SELECT pg_try_advisory_lock(hashtextextended($1, 0))", &[&key]),
                    )
                    .await
                {
                    Ok(r) if r.get::<_, bool>(0) => {
                        tracing::info!(slot = %config.slot, "leader: holding the slot's lock; streaming");
                        metrics.is_leader.set(1);
                        metrics.leader_changes.inc();
                        return Some(c);
                    }
                    Ok(_) => {
                        if !waiting {
                            tracing::info!(slot = %config.slot, "standby: another relay leads this slot; taking over when it goes");
                            waiting = true;
                        }
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "leader lock query failed; reconnecting");
                        break;
                    }
                }
                tokio::select! {
                    _ = tokio::time::sleep(poll) => {}
                    _ = stop.wait_for(|s| *s) => return None,
                }
            },
            Err(e) => {
                tracing::warn!(error = %e, "cannot connect for the leader lock; retrying");
                tokio::select! {
                    _ = tokio::time::sleep(poll.max(Duration::from_secs(1))) => {}
                    _ = stop.wait_for(|s| *s) => return None,
                }
            }
        }
    }
}

/// Check the lock's connection every `takeover_timeout / 5`; return when it
/// is lost (an error, or no answer within that time). The lock is held as
/// long as the client lives: it is released when this future is dropped.
async fn watch_lock(client: tokio_postgres::Client, takeover_timeout: Duration) {
    let every = (takeover_timeout / 5).max(Duration::from_millis(100));
    loop {
        tokio::time::sleep(every).await;
        let ok = matches!(tokio::time::timeout(every, client.simple_query("SELECT 1")).await, Ok(Ok(_)));
        if !ok || client.is_closed() {
            return;
        }
    }
}

/// Rows one table-path transaction claims.
const TABLE_CLAIM_LIMIT: usize = 500;
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// `cdc` needs its prerequisites; `polling` the outbox table; `auto` takes
/// CDC when the server and role allow it, polling otherwise, and says why.
/// Also returns whether this CDC relay is one shard (a filtered publication).
async fn resolve_mode(sql: &tokio_postgres::Client, config: &Config) -> Result<(Mode, bool), RelayError> {
    let startup = |e: db::DbError| RelayError::Startup(e.to_string());
    let db = config.db();
    // The CDC checks, the shard's included; Ok(sharded).
    let cdc = || async {
        db.within("checking the CDC prerequisites", db::check_cdc_prerequisites(sql, &config.publication)).await?;
        let destinations: Vec<String> = config.destinations.keys().cloned().collect();
        db.within("checking the publication's shard", db::check_shard(sql, &config.publication, &destinations)).await
    };
    let outbox_table = || db.within("checking the outbox table", db::check_outbox_table(sql));
    match config.mode {
        Mode::Cdc => Ok((Mode::Cdc, cdc().await.map_err(startup)?)),
        Mode::Polling => {
            outbox_table().await.map_err(startup)?;
            Ok((Mode::Polling, false))
        }
        Mode::Auto => {
            outbox_table().await.map_err(startup)?;
            match cdc().await {
                Ok(sharded) => {
                    tracing::info!(
                        "mode auto: CDC (wal_level=logical, the role may replicate, the publication exists)"
                    );
                    Ok((Mode::Cdc, sharded))
                }
                Err(db::DbError::Check(why)) => {
                    tracing::warn!(reason = %why, "mode auto: polling, because CDC is not possible here");
                    Ok((Mode::Polling, false))
                }
                Err(e) => Err(startup(e)),
            }
        }
    }
}

/// Polling mode does not read the slot: if it exists, it only holds WAL.
async fn warn_if_slot_retains_wal(sql: &tokio_postgres::Client, slot: &str) {
    let row = sql
        .query_opt(
            "SELECT active, (pg_current_wal_lsn() - restart_lsn)::bigint FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await;
    if let Ok(Some(r)) = row {
        let (active, retained): (bool, Option<i64>) = (r.get(0), r.get(1));
        if !active {
            tracing::warn!(
                slot,
                retained_wal_bytes = retained.unwrap_or(0),
                "replication slot exists but nothing reads it while the relay polls: it retains WAL; remove it with `outbox-relay slot drop` if CDC will not resume"
            );
        }
    }
}

/// Every few seconds: slot lag, retained WAL and activity into the metrics
/// (a polling relay warns each minute about an inactive slot); in CDC mode,
/// every `heartbeat_interval`: a transactional logical message, so the slot
/// moves even when nothing is written to this database while others are busy.
async fn monitor(config: Config, mode: Mode, metrics: Arc<Metrics>, mut stop: watch::Receiver<bool>) {
    let db = config.db();
    let mut client = None;
    let mut lag_tick = tokio::time::interval(Duration::from_secs(2));
    let mut heartbeat = tokio::time::interval(config.heartbeat_interval);
    let mut warn_tick = tokio::time::interval(Duration::from_secs(60));
    let mut backlog_tick = tokio::time::interval(Duration::from_secs(10));
    let mut last_confirmed: (i64, std::time::Instant) = (-1, std::time::Instant::now());
    for t in [&mut lag_tick, &mut heartbeat, &mut warn_tick, &mut backlog_tick] {
        t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    }
    heartbeat.tick().await;
    warn_tick.tick().await;
    loop {
        let what = tokio::select! {
            _ = lag_tick.tick() => 0,
            _ = heartbeat.tick(), if mode == Mode::Cdc => 1,
            _ = warn_tick.tick(), if mode == Mode::Polling => 2,
            _ = backlog_tick.tick() => 3,
            _ = stop.wait_for(|s| *s) => return,
        };
        crate::faults::point("monitor::tick");
        if client.as_ref().is_none_or(|c: &tokio_postgres::Client| c.is_closed()) {
            client = db.connect().await.ok();
        }
        let Some(c) = client.as_ref() else { continue };
        let res = db
            .query(
                "running the slot monitor's queries",
                monitor_step(what, c, &config, mode, &metrics, &mut last_confirmed),
            )
            .await;
        if let Err(e) = res {
            tracing::debug!(error = %e, "monitor query failed; reconnecting");
            client = None;
        }
    }
}

/// One monitor tick: 0 lag and readiness, 1 heartbeat, 2 inactive-slot
/// warning, 3 backlog.
async fn monitor_step(
    what: u8,
    c: &tokio_postgres::Client,
    config: &Config,
    mode: Mode,
    metrics: &Metrics,
    last_confirmed: &mut (i64, std::time::Instant),
) -> Result<(), tokio_postgres::Error> {
    match what {
            1 => c
                .execute(
                    "SELECT pg_logical_emit_message(true, $1, (extract(epoch FROM clock_timestamp()) * 1000000)::bigint::text)",
                    &[&HEARTBEAT_PREFIX],
                )
                .await
                .map(|_| ()),
            2 => {
                warn_if_slot_retains_wal(c, &config.slot).await;
                Ok(())
            }
            3 => backlog(c, config, metrics).await,
            _ => c
                .query_opt(
                    "SELECT (pg_current_wal_lsn() - confirmed_flush_lsn)::bigint,
                            (pg_current_wal_lsn() - restart_lsn)::bigint, active, coalesce(wal_status, ''),
                            (confirmed_flush_lsn - '0/0')::bigint
                       FROM pg_replication_slots WHERE slot_name = $1",
                    &[&config.slot],
                )
                .await
                .map(|row| {
                    let status = row.as_ref().map(|r| r.get::<_, String>(3)).unwrap_or_default();
                    for s in ["reserved", "extended", "unreserved", "lost"] {
                        metrics.slot_wal_status.with_label_values(&[s]).set(i64::from(s == status));
                    }
                    match row {
                        Some(r) => {
                            let lag = r.get::<_, Option<i64>>(0).unwrap_or(0);
                            metrics.slot_lag_bytes.set(lag);
                            metrics.slot_retained_wal_bytes.set(r.get::<_, Option<i64>>(1).unwrap_or(0));
                            metrics.slot_active.set(i64::from(r.get::<_, bool>(2)));
                            // Readiness: the confirmed LSN must move while the slot has lag.
                            let confirmed = r.get::<_, Option<i64>>(4).unwrap_or(0);
                            if confirmed != last_confirmed.0 || lag <= 0 {
                                *last_confirmed = (confirmed, std::time::Instant::now());
                            }
                            let stuck = mode == Mode::Cdc && last_confirmed.1.elapsed() >= config.readiness_stall;
                            if stuck != metrics.stalled.load(std::sync::atomic::Ordering::Relaxed) {
                                if stuck {
                                    tracing::error!(lag_bytes = lag, stall = ?config.readiness_stall, "the slot's confirmed LSN has not moved while it has lag: not ready");
                                } else {
                                    tracing::info!("the slot's confirmed LSN moves again: ready");
                                }
                                metrics.stalled.store(stuck, std::sync::atomic::Ordering::Relaxed);
                            }
                        }
                        None => {
                            metrics.slot_lag_bytes.set(0);
                            metrics.slot_retained_wal_bytes.set(0);
                            metrics.slot_active.set(-1);
                        }
                    }
                }),
        }
}

/// Delete PUBLISHED rows older than `retention`, a thousand at a time, once a
/// minute (DELETEs are not in the publication: nothing is streamed).
async fn sweep_retention(db: db::Db, retention: Duration, metrics: Arc<Metrics>, mut stop: watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(Duration::from_secs(60));
    let mut client: Option<tokio_postgres::Client> = None;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        if client.as_ref().is_none_or(|c| c.is_closed()) {
            client = db.connect().await.ok();
        }
        let Some(c) = client.as_ref() else { continue };
        match sweep_once(c, retention).await {
            Ok(0) => {}
            Ok(n) => {
                metrics.retention_deleted.inc_by(n);
                tracing::info!(deleted = n, ?retention, "retention: deleted PUBLISHED rows");
            }
            Err(e) => {
                tracing::warn!(error = %e, "retention sweep failed; retrying next minute");
                client = None;
            }
        }
    }
}

/// One sweep: batches of 1,000 until none is left. Returns rows deleted.
///
/// No index on `published_at` (it would cost every publish an index insert):
/// a row is published after it is created, so only rows created before the
/// cutoff qualify, and ids grow with creation. The sweep walks the primary
/// key up to the first row created after the cutoff, which, swept every
/// minute, is a short walk.
pub async fn sweep_once(c: &tokio_postgres::Client, retention: Duration) -> Result<u64, tokio_postgres::Error> {
    let secs = retention.as_secs_f64();
    let boundary: i64 = c
        .query_opt(
            "SELECT id FROM outbox WHERE created_at >= now() - make_interval(secs => $1) ORDER BY id LIMIT 1",
            &[&secs],
        )
        .await?
        .map(|r| r.get(0))
        .unwrap_or(i64::MAX);
    let mut total = 0;
    loop {
        let n = c
            .execute(
                "DELETE FROM outbox WHERE id IN (
                     SELECT id FROM outbox
                      WHERE id < $2 AND status = 'PUBLISHED' AND published_at < now() - make_interval(secs => $1)
                      ORDER BY id LIMIT 1000)",
                &[&secs, &boundary],
            )
            .await?;
        total += n;
        if n < 1000 {
            return Ok(total);
        }
        tokio::task::yield_now().await;
    }
}

/// NEW rows and the oldest one's age per configured destination: a capped
/// count and one index probe each, not a scan per scrape.
async fn backlog(c: &tokio_postgres::Client, config: &Config, metrics: &Metrics) -> Result<(), tokio_postgres::Error> {
    for d in config.destinations.keys() {
        let r = c
            .query_one(
                "SELECT (SELECT count(*) FROM (SELECT 1 FROM outbox WHERE destination = $1 AND status = 'NEW' LIMIT 1000000) n),
                        coalesce((SELECT extract(epoch FROM now() - created_at)::float8 FROM outbox
                                   WHERE destination = $1 AND status = 'NEW' ORDER BY id LIMIT 1), 0)",
                &[d],
            )
            .await?;
        metrics.backlog_events.with_label_values(&[d]).set(r.get(0));
        metrics.oldest_unpublished_seconds.with_label_values(&[d]).set(r.get::<_, f64>(1).max(0.0));
    }
    Ok(())
}
