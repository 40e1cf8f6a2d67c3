//! Decisions made in one place each: what is retried and how long to wait
//! ([`retry`]), why a row is DEAD ([`dead`]), when a lane spools ([`spool`]),
//! when a delayed row goes and how ([`delay`]), how many calls a lane keeps
//! in flight ([`concurrency`]).

pub mod concurrency;
pub mod dead;
pub mod delay;
pub mod retry;
pub mod spool;
