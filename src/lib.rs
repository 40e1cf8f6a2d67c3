//! outbox-relay: committed outbox rows in PostgreSQL, read through a logical
//! replication slot, published to Amazon SQS; the slot's LSN is confirmed only
//! once the messages are published and their rows marked.
//!
//! The pipeline, one module a stage:
//! [`cdc`] (slot → decoded outbox rows) → [`event`] (row → validated SQS entry,
//! or DEAD) → [`lane`] (per-destination batching, several batches in flight)
//! → [`publisher`] (the network call) with [`retry`] (the one place that decides
//! what is retried) → [`settle`] (rows marked in bulk) → [`watermark`] (the LSN
//! that may be confirmed).

pub mod batch;
pub mod budget;
pub mod cdc;
pub mod config;
pub mod consumer;
pub mod db;
pub mod event;
pub mod faults;
pub mod lane;
pub mod metrics;
pub mod ops;
pub mod pgconn;
pub mod publisher;
pub mod relay;
pub mod retry;
pub mod settle;
pub mod table;
pub mod watermark;

pub use config::Config;
pub use relay::{run, RelayHandle};
