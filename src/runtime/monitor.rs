//! The slot monitor: lag, retained WAL, readiness, backlog, and the
//! transactional heartbeat.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use crate::config::{Config, Mode};
use crate::db::Db;
use crate::mapping::Mapping;
use crate::metrics::Metrics;
use crate::source::cdc::mapped::{standing, Standing};
use crate::source::cdc::HEARTBEAT_PREFIX;

/// Polling mode does not read the slot: if it exists, it only holds WAL.
pub(crate) async fn warn_if_slot_retains_wal(sql: &tokio_postgres::Client, slot: &str) {
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

/// What the monitor watches, from the configuration and the mode start-up
/// chose.
pub(crate) struct Watched {
    pub mode: Mode,
    pub slot: String,
    /// In CDC mode, a logical message this often.
    pub heartbeat: Duration,
    /// Not ready while the slot's confirmed LSN does not move for this long
    /// though it has lag.
    pub readiness_stall: Duration,
    /// The configured destinations, whose backlog is measured.
    pub destinations: Vec<String>,
}

impl Watched {
    pub(crate) fn of(config: &Config, mode: Mode) -> Watched {
        Watched {
            mode,
            slot: config.slot.clone(),
            heartbeat: config.heartbeat_interval,
            readiness_stall: config.readiness_stall,
            destinations: config.destinations.keys().cloned().collect(),
        }
    }
}

/// Every few seconds: slot lag, retained WAL and activity into the metrics
/// (a polling relay warns each minute about an inactive slot); in CDC mode,
/// every `heartbeat_interval`: a transactional logical message, so the slot
/// moves even when nothing is written to this database while others are busy.
pub(crate) async fn monitor(config: Watched, db: Db, metrics: Arc<Metrics>, mut stop: watch::Receiver<bool>) {
    let mode = config.mode;
    let mut kept = crate::db::Kept::new(db.clone());
    let mut lag_tick = tokio::time::interval(Duration::from_secs(2));
    let mut heartbeat = tokio::time::interval(config.heartbeat);
    let mut warn_tick = tokio::time::interval(Duration::from_secs(60));
    let mut backlog_tick = tokio::time::interval(Duration::from_secs(10));
    let mut last_confirmed: (i64, std::time::Instant) = (-1, std::time::Instant::now());
    for t in [&mut lag_tick, &mut heartbeat, &mut warn_tick, &mut backlog_tick] {
        t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    }
    heartbeat.tick().await;
    warn_tick.tick().await;
    loop {
        let tick = tokio::select! {
            _ = lag_tick.tick() => Tick::Lag,
            _ = heartbeat.tick(), if mode == Mode::Cdc => Tick::Heartbeat,
            _ = warn_tick.tick(), if mode == Mode::Polling => Tick::InactiveSlot,
            _ = backlog_tick.tick() => Tick::Backlog,
            _ = stop.wait_for(|s| *s) => return,
        };
        crate::faults::point("monitor::tick");
        let Some(c) = kept.get().await else { continue };
        let res = db
            .query("running the slot monitor's queries", monitor_step(tick, c, &config, &metrics, &mut last_confirmed))
            .await;
        if let Err(e) = res {
            tracing::debug!(error = %e, "monitor query failed; reconnecting");
            kept.lost();
        }
    }
}

/// How often [`watch_mapped_tables`] looks.
const MAPPED_EVERY: Duration = Duration::from_secs(15);

/// Every [`MAPPED_EVERY`], each mapped table as start-up would judge it
/// ([`standing`]): what stands in its way now (dropped, a column the mapping
/// needs gone, a key let be NULL, a grant taken back, out of the
/// publication) and a new name, said in the log when it changes and in
/// `outbox_relay_mapped_table_trouble{table}`. The rows themselves never
/// wait on this: the stream and the settlement go on, each row sent, DEAD
/// with its reason, or left unpublished in its table.
pub(crate) async fn watch_mapped_tables(
    db: Db,
    mapped: Vec<Mapping>,
    publication: Option<String>,
    metrics: Arc<Metrics>,
    mut stop: watch::Receiver<bool>,
) {
    if mapped.is_empty() {
        return;
    }
    let mut kept = crate::db::Kept::new(db.clone());
    let mut said: Vec<Standing> = vec![Standing::default(); mapped.len()];
    loop {
        let mut failed = false;
        if let Some(c) = kept.get().await {
            for (m, said) in mapped.iter().zip(&mut said) {
                let table = format!("{}.{}", m.schema, m.table);
                let now = match db.within("looking at a mapped table", standing(c, m, publication.as_deref())).await {
                    Ok(now) => now,
                    Err(e) => {
                        tracing::debug!(table, error = %e, "mapped table watch failed; reconnecting");
                        failed = true;
                        break;
                    }
                };
                metrics.mapped_table_trouble.with_label_values(&[&table]).set(i64::from(now.trouble.is_some()));
                if now == *said {
                    continue;
                }
                match (&now.trouble, &said.trouble) {
                    (Some(why), _) => tracing::error!(table, "{why} (its rows are sent, DEAD with their reason, or left unpublished in it; no other table waits)"),
                    (None, Some(_)) => tracing::info!(table, "mapped table readable again"),
                    (None, None) => {}
                }
                if let (Some((schema, name)), true) = (&now.now, now.now != said.now) {
                    tracing::warn!(table, now = %format!("{schema}.{name}"), "mapped table renamed or moved: followed by its oid; set `table` in [[outbox]] to its new name");
                }
                *said = now;
            }
        }
        if failed {
            kept.lost();
        }
        tokio::select! {
            _ = tokio::time::sleep(MAPPED_EVERY) => {}
            _ = stop.wait_for(|s| *s) => return,
        }
    }
}

/// What a monitor tick does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Tick {
    /// Slot lag, retained WAL and activity into the metrics; readiness.
    Lag,
    /// A transactional logical message (CDC), so the slot moves on an idle
    /// database.
    Heartbeat,
    /// A polling relay's warning about a slot that retains WAL.
    InactiveSlot,
    /// NEW rows and the oldest one's age per destination.
    Backlog,
}

/// One monitor tick.
pub(crate) async fn monitor_step(
    tick: Tick,
    c: &tokio_postgres::Client,
    config: &Watched,
    metrics: &Metrics,
    last_confirmed: &mut (i64, std::time::Instant),
) -> Result<(), tokio_postgres::Error> {
    match tick {
        Tick::Heartbeat => c
            .execute(
                "SELECT pg_logical_emit_message(true, $1, (extract(epoch FROM clock_timestamp()) * 1000000)::bigint::text)",
                &[&HEARTBEAT_PREFIX],
            )
            .await
            .map(|_| ()),
        Tick::InactiveSlot => {
            warn_if_slot_retains_wal(c, &config.slot).await;
            Ok(())
        }
        Tick::Backlog => backlog(c, &config.destinations, metrics).await,
        Tick::Lag => slot_lag(c, config, metrics, last_confirmed).await,
    }
}

/// The slot's lag, retained WAL, activity and WAL status into the metrics;
/// not ready while the confirmed LSN does not move though the slot has lag.
async fn slot_lag(
    c: &tokio_postgres::Client,
    config: &Watched,
    metrics: &Metrics,
    last_confirmed: &mut (i64, std::time::Instant),
) -> Result<(), tokio_postgres::Error> {
    let row = c
        .query_opt(
            "SELECT (pg_current_wal_lsn() - confirmed_flush_lsn)::bigint,
                    (pg_current_wal_lsn() - restart_lsn)::bigint, active, coalesce(wal_status, ''),
                    (confirmed_flush_lsn - '0/0')::bigint
               FROM pg_replication_slots WHERE slot_name = $1",
            &[&config.slot],
        )
        .await?;
    let status = row.as_ref().map(|r| r.get::<_, String>(3)).unwrap_or_default();
    for s in ["reserved", "extended", "unreserved", "lost"] {
        metrics.slot_wal_status.with_label_values(&[s]).set(i64::from(s == status));
    }
    let Some(r) = row else {
        metrics.slot_lag_bytes.set(0);
        metrics.slot_retained_wal_bytes.set(0);
        metrics.slot_active.set(-1);
        return Ok(());
    };
    let lag = r.get::<_, Option<i64>>(0).unwrap_or(0);
    metrics.slot_lag_bytes.set(lag);
    metrics.slot_retained_wal_bytes.set(r.get::<_, Option<i64>>(1).unwrap_or(0));
    metrics.slot_active.set(i64::from(r.get::<_, bool>(2)));
    // Readiness: the confirmed LSN must move while the slot has lag.
    let confirmed = r.get::<_, Option<i64>>(4).unwrap_or(0);
    if confirmed != last_confirmed.0 || lag <= 0 {
        *last_confirmed = (confirmed, std::time::Instant::now());
    }
    let stuck = config.mode == Mode::Cdc && last_confirmed.1.elapsed() >= config.readiness_stall;
    if stuck != metrics.stalled.load(std::sync::atomic::Ordering::Relaxed) {
        if stuck {
            tracing::error!(lag_bytes = lag, stall = ?config.readiness_stall, "the slot's confirmed LSN has not moved while it has lag: not ready");
        } else {
            tracing::info!("the slot's confirmed LSN moves again: ready");
        }
        metrics.stalled.store(stuck, std::sync::atomic::Ordering::Relaxed);
    }
    Ok(())
}

/// NEW rows and the oldest one's age per configured destination, and the
/// rows held until a later `deliver_at` (not backlog: they wait by design)
/// with the time to the earliest: capped counts and index probes, not a
/// scan per scrape.
pub(crate) async fn backlog(
    c: &tokio_postgres::Client,
    destinations: &[String],
    metrics: &Metrics,
) -> Result<(), tokio_postgres::Error> {
    let sql = backlog_sql();
    for d in destinations {
        let r = c.query_one(&sql, &[d]).await?;
        metrics.backlog_events.with_label_values(&[d]).set(r.get(0));
        metrics.oldest_unpublished_seconds.with_label_values(&[d]).set(r.get::<_, f64>(1).max(0.0));
        metrics.held_events.with_label_values(&[d]).set(r.get(2));
        metrics.held_next_due_seconds.with_label_values(&[d]).set(r.get::<_, f64>(3).max(0.0));
    }
    Ok(())
}

fn backlog_sql() -> String {
    let held = crate::policy::delay::HELD_SQL;
    format!(
        "SELECT (SELECT count(*) FROM (SELECT 1 FROM outbox WHERE destination = $1 AND status = 'NEW' AND NOT {held}
                                        LIMIT 1000000) n),
                coalesce((SELECT extract(epoch FROM now() - created_at)::float8 FROM outbox
                           WHERE destination = $1 AND status = 'NEW' AND NOT {held} ORDER BY id LIMIT 1), 0),
                (SELECT count(*) FROM (SELECT 1 FROM outbox WHERE destination = $1 AND {held} LIMIT 1000000) h),
                coalesce((SELECT extract(epoch FROM min(deliver_at) - now())::float8 FROM outbox
                           WHERE destination = $1 AND {held}), 0)"
    )
}
