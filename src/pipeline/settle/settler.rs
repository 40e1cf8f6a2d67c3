//! The settler task: gathers settlements, marks them in flushes of at most
//! [`MAX_FLUSH`], counts them, and wakes the confirmation.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{mpsc, Notify};
use tracing::Instrument;

use crate::metrics::Metrics;
use crate::pipeline::owed::{Owed, RETRY_EVERY};
use crate::pipeline::watermark::Watermark;

use super::mark::mark;
use super::outcome::{Due, Marking, Outcome, Settlement};

/// Most settlements marked by one statement.
pub const MAX_FLUSH: usize = 5_000;

/// How long the settler gathers settlements after the first before it
/// marks them: at a low rate over many lanes (one message per call, calls
/// a fraction of a millisecond apart) a statement per call cost
/// PostgreSQL more than the relay's whole sending (`bench --many-only`,
/// 2026-12-06: the machine 6–13 points less busy at 1,000 × 2 rows/s).
/// Delivery does not wait on it; the slot's confirmation and the budget's
/// release wait this much more.
pub(super) const GATHER: Duration = Duration::from_millis(2);

/// Count a flushed batch in the metrics, and log each DEAD row once.
pub fn record(metrics: &Metrics, batch: &[Settlement]) {
    for s in batch {
        match &s.outcome {
            Outcome::Published => {
                metrics.events_published.with_label_values(&[&s.destination]).inc();
                if !s.has_row() {
                    metrics.events_transient.with_label_values(&[&s.destination]).inc();
                }
            }
            Outcome::Dead(r) => {
                tracing::warn!(id = ?s.id(), event_id = %s.event.event_id, destination = %s.destination, reason = r.code.as_str(), detail = %r.detail, "outbox row marked DEAD");
                metrics.events_dead.with_label_values(&[&s.destination, r.code.as_str()]).inc();
            }
            Outcome::Deferred(_, Due::Held) => {
                metrics.events_held.with_label_values(&[&s.destination]).inc();
            }
            Outcome::Deferred(e, _) => {
                tracing::debug!(id = ?s.id(), destination = %s.destination, error = %e, "outbox row deferred to the table");
                metrics.events_deferred.with_label_values(&[&s.destination]).inc();
            }
        }
    }
}

/// Settlements that came within [`GATHER`] of the first in `batch`, up to
/// [`MAX_FLUSH`]; a closed channel ends the gathering (what came is marked).
pub(super) async fn gather(rx: &mut mpsc::UnboundedReceiver<Settlement>, batch: &mut Vec<Settlement>) {
    let window = tokio::time::sleep(GATHER);
    tokio::pin!(window);
    while batch.len() < MAX_FLUSH {
        tokio::select! {
            biased;
            s = rx.recv() => match s {
                Some(s) => batch.push(s),
                None => return,
            },
            () = &mut window => return,
        }
    }
}

/// Receive settlements, mark them, then settle them in the watermark and wake
/// the confirmer. Returns when the channel closes, or with the database error
/// that stopped it (nothing unmarked is settled, so nothing is lost).
pub async fn run_settler(
    mut client: tokio_postgres::Client,
    mut rx: mpsc::UnboundedReceiver<Settlement>,
    watermark: Arc<Mutex<Watermark>>,
    confirm: Arc<Notify>,
    metrics: Arc<Metrics>,
    marking: Marking,
) -> Result<(), tokio_postgres::Error> {
    let mut batch = Vec::with_capacity(MAX_FLUSH);
    let mut owed = Owed::default();
    loop {
        let first = tokio::select! {
            first = rx.recv() => first,
            () = tokio::time::sleep(RETRY_EVERY), if !owed.is_empty() => None,
        };
        if owed.due() {
            owed.pay(&client).await?;
        }
        let Some(first) = first else {
            if rx.is_closed() && rx.is_empty() {
                return Ok(());
            }
            continue;
        };
        batch.push(first);
        gather(&mut rx, &mut batch).await;
        let span = tracing::info_span!("outbox_relay.settle", rows = batch.len());
        if batch.iter().all(|s| matches!(s.outcome, Outcome::Published)) {
            mark(&client, &batch, marking, &mut owed).instrument(span).await?;
        } else {
            // Rows handed to the table (deferred, or DEAD) become visible to
            // the table path together: marked rows and rows written back in
            // separate commits let a FIFO drain claim a group's later row
            // (marked) before its earlier one (written back) was there.
            let tx = client.transaction().await?;
            mark(&tx, &batch, marking, &mut owed).instrument(span).await?;
            tx.commit().await?;
        }
        {
            let mut wm = watermark.lock().unwrap();
            for s in &batch {
                if let Some(t) = s.txn {
                    wm.settle(t);
                }
            }
        }
        record(&metrics, &batch);
        for s in batch.drain(..) {
            metrics.in_flight_events.with_label_values(&[&s.destination]).dec();
            if let Some(u) = &s.unmarked {
                u.marked();
            }
        }
        confirm.notify_one();
    }
}
