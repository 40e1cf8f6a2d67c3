//! Routing: each event is judged for its destination's queue (validated, or
//! DEAD with its reason) and handed to its lane, to the table when the lane
//! spools, or straight to the settler when DEAD. [`judge`] is the one rule,
//! used by the stream's [`Router`] and by the table path alike.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use tokio::sync::mpsc;
use tokio_postgres::Client;

use crate::event::{prepare, Entry, OutboxEvent, QueueInfo};
use crate::metrics::Metrics;
use crate::pipeline::budget::Budget;
use crate::pipeline::lane::{LaneItem, LaneState};
use crate::pipeline::settle::{Outcome, Settlement};
use crate::pipeline::watermark::{TxnSeq, Watermark};
use crate::policy::dead::DeadReason;

/// The metric label of events whose destination is not configured.
pub const UNKNOWN_DESTINATION_LABEL: &str = "unknown";

/// Why routing stopped: the database (replay filter) or the stage behind it.
#[derive(Debug, thiserror::Error)]
pub enum RouteError {
    #[error("database: {}", crate::db::describe(.0))]
    Db(tokio_postgres::Error),
    #[error("the {0} stopped")]
    Stopped(&'static str),
}

impl From<tokio_postgres::Error> for RouteError {
    fn from(e: tokio_postgres::Error) -> Self {
        RouteError::Db(e)
    }
}

/// The verdict on one event: its metric label, and its entry or why it is DEAD.
pub fn judge<'a>(
    queues: &BTreeMap<String, QueueInfo>,
    ev: &'a Arc<OutboxEvent>,
) -> (&'a str, Result<Entry, DeadReason>) {
    match queues.get(&ev.destination) {
        None => (UNKNOWN_DESTINATION_LABEL, Err(DeadReason::unknown_destination(&ev.destination))),
        Some(q) => (ev.destination.as_str(), prepare(Arc::clone(ev), q)),
    }
}

/// Of replayed events, those settled by an earlier run: the row is DEAD,
/// PUBLISHED (kept) or handed to the table, or it is gone and its id is in a
/// run the settlement recorded when it deleted the row. A row gone without a
/// run was deleted by another transaction (its own: transient; or a later
/// one) and is sent again: nothing says it was published.
const REPLAYED_SQL: &str = "
SELECT u.id FROM unnest($1::bigint[]) AS u(id)
 WHERE EXISTS (SELECT 1 FROM outbox o WHERE o.id = u.id AND (o.status <> 'NEW' OR o.next_attempt_at IS NOT NULL))
    OR EXISTS (SELECT 1 FROM (SELECT r.hi FROM outbox_published_runs r WHERE r.lo <= u.id ORDER BY r.lo DESC LIMIT 1) r
                WHERE r.hi >= u.id)";

/// Routes events to their lanes, or straight to the settler as DEAD.
pub struct Router<'a> {
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
    pub async fn dispatch(
        &mut self,
        sql: &Client,
        seq: TxnSeq,
        replayed: bool,
        mut events: Vec<OutboxEvent>,
    ) -> Result<(), RouteError> {
        if events.is_empty() {
            return Ok(());
        }
        if replayed {
            let ids: Vec<i64> = events.iter().map(|e| e.id).collect();
            let done: std::collections::HashSet<i64> =
                sql.query(REPLAYED_SQL, &[&ids]).await?.iter().map(|r| r.get(0)).collect();
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

    pub async fn route(&mut self, seq: Option<TxnSeq>, ev: OutboxEvent) -> Result<(), RouteError> {
        let permit = self.budget.acquire(ev.size()).await;
        if let Some(seq) = seq {
            self.watermark.lock().unwrap().add(seq, 1);
        }
        let ev = Arc::new(ev);
        let (label, verdict) = judge(self.queues, &ev);
        self.metrics.in_flight_events.with_label_values(&[label]).inc();
        let (outcome, unmarked) = match verdict {
            Ok(_) if self.states[&ev.destination].is_spooling() => {
                // A spooling lane's new events go straight to the table.
                let state = &self.states[&ev.destination];
                (Outcome::Deferred(state.deferral("spooled")), Some(state.deferring()))
            }
            Ok(entry) => {
                let tx = self.lanes.get(&ev.destination).expect("a lane per configured destination");
                return tx.send(LaneItem::new(entry, seq, Some(permit))).await.map_err(|_| RouteError::Stopped("lane"));
            }
            Err(reason) => (Outcome::Dead(reason), None),
        };
        let (id, xid, destination) = (ev.id, ev.xid, Arc::from(label));
        let row = ev.transient.then(|| Arc::clone(&ev));
        let settlement = Settlement { id, xid, txn: seq, destination, outcome, permit: Some(permit), unmarked, row };
        self.settle.send(settlement).map_err(|_| RouteError::Stopped("settler"))
    }
}
