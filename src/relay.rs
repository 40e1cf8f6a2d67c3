//! The relay as a whole: start-up checks, then replication sessions one after
//! another (a failed session is followed by a new one after a backoff), beside
//! the metrics server, the slot monitor and the heartbeat.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use crate::cdc::{run_stream, StreamContext, HEARTBEAT_PREFIX};
use crate::config::{Config, Mode};
use crate::db;
use crate::metrics::Metrics;
use crate::publisher::Publisher;

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

    let sql = db::connect(&config.database_url).await.map_err(|e| RelayError::Startup(e.to_string()))?;
    let mode = match config.mode {
        Mode::Cdc => Mode::Cdc,
        Mode::Polling => {
            return Err(RelayError::Startup(
                "polling mode is not implemented in this build; run with --mode cdc against a server with wal_level=logical".into(),
            ))
        }
        Mode::Auto => Mode::Cdc,
    };
    db::check_cdc_prerequisites(&sql, &config.publication)
        .await
        .map_err(|e| RelayError::Startup(e.to_string()))?;
    metrics.mode.with_label_values(&[&mode.to_string()]).set(1);

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

    let metrics_server = match config.metrics_addr {
        Some(addr) => {
            let listener = crate::metrics::bind(addr)
                .await
                .map_err(|e| RelayError::Startup(format!("cannot listen on metrics_addr {addr}: {e}")))?;
            let mut stop = stop_rx.clone();
            let m = Arc::clone(&metrics);
            Some(tokio::spawn(crate::metrics::serve(listener, m, async move {
                let _ = stop.wait_for(|s| *s).await;
            })))
        }
        None => None,
    };
    let monitor = tokio::spawn(monitor(config.clone(), Arc::clone(&metrics), stop_rx.clone()));

    let ctx = StreamContext { config, queues, publisher, metrics: Arc::clone(&metrics) };
    let mut failures = 0u32;
    loop {
        if *stop_rx.borrow() {
            break;
        }
        match run_stream(&ctx, &mut stop_rx).await {
            Ok(()) => break,
            Err(e) => {
                failures += 1;
                metrics.stream_restarts.inc();
                let wait = crate::retry::backoff(failures.min(6), Duration::from_millis(250), Duration::from_secs(10));
                tracing::error!(error = %e, retry_in = ?wait, "replication session ended; starting a new one");
                tokio::select! {
                    _ = tokio::time::sleep(wait) => {}
                    _ = stop_rx.wait_for(|s| *s) => break,
                }
            }
        }
    }
    monitor.abort();
    if let Some(s) = metrics_server {
        let _ = s.await;
    }
    Ok(())
}

/// Every few seconds: slot lag and retained WAL into the metrics; every
/// `heartbeat_interval`: a transactional logical message, so the slot moves
/// even when nothing is written to this database while others are busy.
async fn monitor(config: Config, metrics: Arc<Metrics>, mut stop: watch::Receiver<bool>) {
    let mut client = None;
    let mut lag_tick = tokio::time::interval(Duration::from_secs(2));
    let mut heartbeat = tokio::time::interval(config.heartbeat_interval);
    heartbeat.tick().await;
    loop {
        let beat = tokio::select! {
            _ = lag_tick.tick() => false,
            _ = heartbeat.tick() => true,
            _ = stop.wait_for(|s| *s) => return,
        };
        if client.is_none() {
            client = db::connect(&config.database_url).await.ok();
        }
        let Some(c) = client.as_ref() else { continue };
        let res = if beat {
            c.execute(
                "SELECT pg_logical_emit_message(true, $1, now()::text)",
                &[&HEARTBEAT_PREFIX],
            )
            .await
            .map(|_| ())
        } else {
            c.query_opt(
                "SELECT (pg_current_wal_lsn() - confirmed_flush_lsn)::bigint,
                        (pg_current_wal_lsn() - restart_lsn)::bigint
                   FROM pg_replication_slots WHERE slot_name = $1",
                &[&config.slot],
            )
            .await
            .map(|row| {
                if let Some(r) = row {
                    metrics.slot_lag_bytes.set(r.get::<_, Option<i64>>(0).unwrap_or(0));
                    metrics.slot_retained_wal_bytes.set(r.get::<_, Option<i64>>(1).unwrap_or(0));
                }
            })
        };
        if let Err(e) = res {
            tracing::debug!(error = %e, "monitor query failed; reconnecting");
            client = None;
        }
    }
}

/// What `outbox-relay status` reports.
#[derive(Debug, serde::Serialize)]
pub struct Status {
    pub slot: String,
    pub slot_exists: bool,
    pub slot_active: Option<bool>,
    pub slot_wal_status: Option<String>,
    pub slot_lag_bytes: Option<i64>,
    pub slot_retained_wal_bytes: Option<i64>,
    pub destinations: Vec<DestinationStatus>,
}

#[derive(Debug, serde::Serialize)]
pub struct DestinationStatus {
    pub destination: String,
    pub configured: bool,
    pub new: i64,
    pub dead: i64,
    pub oldest_new_age_seconds: Option<f64>,
}

pub async fn status(client: &tokio_postgres::Client, config: &Config) -> Result<Status, tokio_postgres::Error> {
    let slot = client
        .query_opt(
            "SELECT active, wal_status, (pg_current_wal_lsn() - confirmed_flush_lsn)::bigint,
                    (pg_current_wal_lsn() - restart_lsn)::bigint
               FROM pg_replication_slots WHERE slot_name = $1",
            &[&config.slot],
        )
        .await?;
    let rows = client
        .query(
            "SELECT destination,
                    count(*) FILTER (WHERE status = 'NEW'),
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
            dead: r.get(2),
            oldest_new_age_seconds: r.get(3),
        })
        .collect();
    for name in config.destinations.keys() {
        if !destinations.iter().any(|d| &d.destination == name) {
            destinations.push(DestinationStatus {
                destination: name.clone(),
                configured: true,
                new: 0,
                dead: 0,
                oldest_new_age_seconds: None,
            });
        }
    }
    destinations.sort_by(|a, b| a.destination.cmp(&b.destination));
    Ok(Status {
        slot: config.slot.clone(),
        slot_exists: slot.is_some(),
        slot_active: slot.as_ref().map(|r| r.get(0)),
        slot_wal_status: slot.as_ref().and_then(|r| r.get(1)),
        slot_lag_bytes: slot.as_ref().and_then(|r| r.get(2)),
        slot_retained_wal_bytes: slot.as_ref().and_then(|r| r.get(3)),
        destinations,
    })
}

pub fn format_status(s: &Status) -> String {
    let mut out = String::new();
    if s.slot_exists {
        out += &format!(
            "slot {}: {} wal_status={} lag={} bytes retained={} bytes\n",
            s.slot,
            if s.slot_active == Some(true) { "active" } else { "INACTIVE" },
            s.slot_wal_status.as_deref().unwrap_or("?"),
            s.slot_lag_bytes.unwrap_or(0),
            s.slot_retained_wal_bytes.unwrap_or(0),
        );
    } else {
        out += &format!("slot {}: does not exist (the relay creates it at start)\n", s.slot);
    }
    out += &format!("{:<24} {:>10} {:>10} {:>14}\n", "destination", "NEW", "DEAD", "oldest NEW (s)");
    for d in &s.destinations {
        out += &format!(
            "{:<24} {:>10} {:>10} {:>14}{}\n",
            d.destination,
            d.new,
            d.dead,
            d.oldest_new_age_seconds.map(|a| format!("{a:.1}")).unwrap_or_else(|| "-".into()),
            if d.configured { "" } else { "  (not configured)" }
        );
    }
    out
}
