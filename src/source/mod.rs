//! Where events come from: the replication slot ([`cdc`]) and the outbox
//! table ([`table`]: polling mode and the spool drain).
//!
//! A source yields events and nothing else. The slot's session hands each
//! [`Change`] to the pipeline's [`Intake`](crate::pipeline::intake::Intake)
//! and acknowledges what it says is confirmable; the table path hands each
//! claim's events to [`publish_claim`](crate::pipeline::assemble::publish_claim)
//! and commits the claim. Routing, lanes and settlement are the pipeline's.

use replication::Lsn;

use crate::event::OutboxEvent;

pub mod cdc;
pub mod table;

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
