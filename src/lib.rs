//! outbox-relay: committed outbox rows in PostgreSQL, read through a logical
//! replication slot, published to Amazon SQS; the slot's LSN is confirmed only
//! once the messages are published and their rows settled.
//!
//! The layout is the pipeline:
//!
//! - [`source`]: where events come from — [`source::cdc`] (the slot:
//!   session, slot, row mapping) and [`source::table`] (polling and the spool
//!   drain).
//! - [`pipeline`]: the stages both sources share — [`pipeline::route`]
//!   (validate for the queue, or DEAD) → [`pipeline::lane`] (batch, several
//!   batches in flight, reconcile per entry) → [`publish`] (the network call)
//!   → [`pipeline::settle`] (recorded in bulk) → [`pipeline::watermark`] (the
//!   LSN that may be confirmed), within [`pipeline::budget`].
//! - [`policy`]: the decisions made in one place each — retry classification
//!   and every backoff, DEAD reasons, spooling.
//! - [`runtime`]: the process around it — start-up, leadership, monitor,
//!   retention; [`ops`]: what operators run (`status`, `slot`, `dead`).

pub mod clock;
pub mod config;
pub mod db;
pub mod event;
pub mod faults;
pub mod mapping;
pub mod metrics;
pub mod ops;
pub mod pipeline;
pub mod policy;
pub mod publish;
pub mod runtime;
pub mod source;
pub mod telemetry;

pub use config::Config;
pub use runtime::run;
