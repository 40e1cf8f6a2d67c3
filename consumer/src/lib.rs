//! The consumer library: makes the relay's at-least-once delivery harmless.
//!
//! - [`enqueue`] writes a job and its outbox event in the caller's
//!   transaction (the SQL function `outbox_enqueue_job` does the same for any
//!   language).
//! - [`Consumer::process`] judges a received message by the database, never
//!   by the message: terminal job → delete without running; retry not yet due
//!   → change visibility; PENDING (or due, or a lease expired) → CAS claim,
//!   run the handler *in a transaction*, then one CAS transition. The handler's
//!   writes commit in the same transaction as the transition to SUCCEEDED, so
//!   a fenced worker (its lease taken over, the job redriven) leaves no effect.
//! - [`redrive`] bumps the generation and emits a new event in one transaction;
//!   messages of older generations can no longer claim or close the job.
//! - [`Consumer::process_dlq`] marks jobs whose messages SQS gave up on DEAD,
//!   without touching a job whose lease is live.
//! - [`worker::Worker`] long-polls a queue and runs all this concurrently.

#[cfg(any(test, feature = "test-utils"))]
pub mod memory;
pub mod queue;
#[cfg(feature = "sqs")]
pub mod sqs;
pub mod worker;

mod job;
mod process;
mod producer;

pub use job::{Disposition, DlqDisposition, Handler, HandlerError, Job, JobMessage};
pub use process::{Claimed, Consumer, ConsumerConfig, QueueAction, Verdict};
pub use producer::{enqueue, job_id, redrive, request_cancel, NewJob};

/// Create or update the jobs table and the protocol's functions
/// (idempotent; the jobs part of [`outbox_schema`]), under the same advisory
/// lock and record as `outbox-relay migrate`, for a service that only
/// consumes. Returns whether anything was applied now.
pub async fn migrate(client: &mut tokio_postgres::Client) -> Result<bool, tokio_postgres::Error> {
    Ok(!outbox_schema::apply(client, outbox_schema::of(outbox_schema::Part::Jobs)).await?.is_empty())
}

#[derive(Debug, thiserror::Error)]
pub enum ConsumerError {
    #[error("database: {0}")]
    Db(#[from] tokio_postgres::Error),
    #[error("connection pool: {0}")]
    Pool(String),
    #[error(transparent)]
    Queue(#[from] queue::QueueError),
    /// The database answered something the protocol does not define
    /// (migrations out of date?).
    #[error("protocol: {0}")]
    Protocol(String),
}
