//! Where events come from: the replication slot ([`cdc`]) and the outbox
//! table ([`table`]: polling mode and the spool drain).
//!
//! A source yields events and nothing else. The slot's session hands each
//! [`Change`](crate::pipeline::intake::Change) to the pipeline's
//! [`Intake`](crate::pipeline::intake::Intake)
//! and acknowledges what it says is confirmable; the table path hands each
//! claim's events to [`publish_claim`](crate::pipeline::assemble::publish_claim)
//! and commits the claim. Routing, lanes and settlement are the pipeline's.

pub mod cdc;
pub mod claims;
pub mod mapped_table;
pub mod table;
