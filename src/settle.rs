//! Settlement: published and DEAD rows are marked in PostgreSQL in bulk, one
//! statement per flush, and only then does the watermark move.

use std::sync::{Arc, Mutex};

use tokio::sync::{mpsc, Notify, OwnedSemaphorePermit};
use tokio_postgres::Client;

use crate::event::DeadReason;
use crate::metrics::Metrics;
use crate::watermark::{TxnSeq, Watermark};

/// How one event ended.
#[derive(Debug, Clone)]
pub enum Outcome {
    Published,
    Dead(DeadReason),
}

/// One event's settlement, on its way to the settler.
#[derive(Debug)]
pub struct Settlement {
    pub id: i64,
    /// `None`: not tied to the stream's watermark (table path).
    pub txn: Option<TxnSeq>,
    pub destination: Arc<str>,
    pub outcome: Outcome,
    /// Returned to the pipeline's budget of unsettled events when dropped.
    pub permit: Option<OwnedSemaphorePermit>,
}

/// Most settlements marked by one statement.
pub const MAX_FLUSH: usize = 5_000;

const MARK_SQL: &str = "
UPDATE outbox o
   SET status = u.status,
       published_at = CASE WHEN u.status = 'PUBLISHED' THEN now() ELSE o.published_at END,
       last_error = u.err,
       attempts = o.attempts + 1
  FROM unnest($1::bigint[], $2::text[], $3::text[]) AS u(id, status, err)
 WHERE o.id = u.id AND o.status = 'NEW'";

/// Mark a set of settlements in one statement.
pub async fn mark(client: &Client, batch: &[Settlement]) -> Result<u64, tokio_postgres::Error> {
    let mut ids = Vec::with_capacity(batch.len());
    let mut statuses = Vec::with_capacity(batch.len());
    let mut errors: Vec<Option<String>> = Vec::with_capacity(batch.len());
    for s in batch {
        ids.push(s.id);
        match &s.outcome {
            Outcome::Published => {
                statuses.push("PUBLISHED");
                errors.push(None);
            }
            Outcome::Dead(r) => {
                statuses.push("DEAD");
                errors.push(Some(r.last_error()));
            }
        }
    }
    client.execute(MARK_SQL, &[&ids, &statuses, &errors]).await
}

/// Receive settlements, mark them, then settle them in the watermark and wake
/// the confirmer. Returns when the channel closes, or with the database error
/// that stopped it (nothing unmarked is settled, so nothing is lost).
pub async fn run_settler(
    client: Client,
    mut rx: mpsc::UnboundedReceiver<Settlement>,
    watermark: Arc<Mutex<Watermark>>,
    confirm: Arc<Notify>,
    metrics: Arc<Metrics>,
) -> Result<(), tokio_postgres::Error> {
    let mut batch = Vec::with_capacity(MAX_FLUSH);
    while let Some(first) = rx.recv().await {
        batch.push(first);
        while batch.len() < MAX_FLUSH {
            match rx.try_recv() {
                Ok(s) => batch.push(s),
                Err(_) => break,
            }
        }
        mark(&client, &batch).await?;
        {
            let mut wm = watermark.lock().unwrap();
            for s in &batch {
                if let Some(t) = s.txn {
                    wm.settle(t);
                }
            }
        }
        for s in batch.drain(..) {
            metrics.backlog_events.with_label_values(&[&s.destination]).dec();
            match &s.outcome {
                Outcome::Published => metrics.events_published.with_label_values(&[&s.destination]).inc(),
                Outcome::Dead(r) => {
                    tracing::warn!(id = s.id, destination = %s.destination, reason = r.code, detail = %r.detail, "outbox row marked DEAD");
                    metrics.events_dead.with_label_values(&[&s.destination, r.code]).inc();
                }
            }
        }
        confirm.notify_one();
    }
    Ok(())
}
