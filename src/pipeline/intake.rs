//! The stream's way into the pipeline: the slot's [`Change`]s in order, each
//! transaction registered with the watermark, its events handed to the
//! router, its commit recorded; what may be confirmed comes back out.

use std::sync::{Arc, Mutex};

use replication::Lsn;
use tokio_postgres::Client;

use crate::event::OutboxEvent;

use super::route::{RouteError, Router};
use super::watermark::{TxnSeq, Watermark};

/// What the slot's stream says, in the order it says it.
#[derive(Debug)]
pub enum Change {
    /// A transaction begins.
    Begin,
    /// Events of the open transaction; more may follow.
    Rows(Chunk),
    /// The open transaction's last events, then its commit: once they and
    /// every earlier transaction's events are settled, the slot may be
    /// confirmed up to `end`.
    Commit { rest: Chunk, end: Lsn },
    /// No transaction is open and the server has sent everything up to
    /// `wal_end` (a keepalive): with nothing unsettled, that may be confirmed.
    Idle { wal_end: Lsn },
}

/// Events of one transaction, in commit order.
#[derive(Debug, Default)]
pub struct Chunk {
    pub events: Vec<OutboxEvent>,
    /// Committed before rows may have been settled by another path (an
    /// earlier session, or the table while the stream was held): the
    /// pipeline filters out those already settled.
    pub replayed: bool,
}

/// Takes the stream's changes: route → lane → settle behind it, the
/// watermark beside it.
pub struct Intake {
    pub(crate) router: Router,
    watermark: Arc<Mutex<Watermark>>,
    /// The transaction whose events are arriving.
    open: Option<TxnSeq>,
}

impl Intake {
    pub(crate) fn new(router: Router, watermark: Arc<Mutex<Watermark>>) -> Intake {
        Intake { router, watermark, open: None }
    }

    /// One change. `sql` answers the replay filter's question (which of a
    /// replayed chunk's rows were settled already). Waits while a lane or
    /// the unsettled budget is full.
    pub async fn take(&mut self, sql: &Client, change: Change) -> Result<(), RouteError> {
        match change {
            Change::Begin => self.open = Some(self.watermark.lock().unwrap().begin()),
            Change::Rows(chunk) => self.route(sql, chunk).await?,
            Change::Commit { rest, end } => {
                self.route(sql, rest).await?;
                let seq = self.open.take().ok_or(RouteError::Order("a commit without its begin"))?;
                self.watermark.lock().unwrap().commit(seq, end);
            }
            Change::Idle { wal_end } => {
                if self.open.is_none() {
                    self.watermark.lock().unwrap().observe_idle(wal_end);
                }
            }
        }
        // Whatever the stream says (a keepalive, a heartbeat's transaction,
        // rows), lanes idle long enough close: at most once a second.
        self.router.retire_idle();
        Ok(())
    }

    async fn route(&mut self, sql: &Client, chunk: Chunk) -> Result<(), RouteError> {
        let seq = self.open.ok_or(RouteError::Order("rows outside a transaction"))?;
        self.router.dispatch(sql, seq, chunk.replayed, chunk.events).await
    }

    /// The furthest position whose events, and every earlier one's, are all
    /// settled.
    pub fn confirmable(&self) -> Lsn {
        self.watermark.lock().unwrap().confirmed()
    }
}
