//! The relay as a whole: start-up checks, then replication sessions one after
//! another (a failed session is followed by a new one after a backoff), beside
//! the metrics server, the slot monitor and the heartbeat.

pub mod http;
mod leader;
mod monitor;
mod retention;
mod startup;

use leader::{acquire_leadership, watch_lock};
use monitor::{monitor, warn_if_slot_retains_wal};
pub use retention::sweep_once;
use retention::sweep_retention;
use startup::{start_up, Started};

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use std::sync::atomic::AtomicBool;

use crate::config::{Config, Mode};
use crate::metrics::Metrics;
use crate::pipeline::lane::LaneState;
use crate::pipeline::settle::Backoff;
use crate::publish::Publisher;
use crate::source::cdc::{run_stream, StreamContext};
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
        tokio::spawn(http::serve(listener, m, async move {
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
