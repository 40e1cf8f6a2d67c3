//! Settlement: published, DEAD and deferred rows are recorded in PostgreSQL
//! in bulk, one statement per flush, and only then does the watermark move.
//!
//! A published row is deleted (with its id recorded in a run of consecutive
//! ids, for the replay filter) or, with `published_rows = "keep"`, marked
//! PUBLISHED. DEAD and deferred rows are updated in place. A transient row
//! (deleted by its own transaction) needs nothing when published; DEAD or
//! deferred, it is written back to the table so its reason, or its retry,
//! is kept. So is any row found gone that nothing proves published: a row
//! deleted by its own transaction after its chunk was handed on, or on a
//! shard whose publication carries no deletes, looks persistent until then.

mod mapped;
mod mark;
mod outcome;
mod privileges;
mod restore;
mod settler;
mod sql;
mod visible;

pub use mark::{mark, MarkReport};
pub(crate) use outcome::seq_param;
pub use outcome::{Due, Marking, Outcome, Settlement, Unmarked};
pub use privileges::check_privileges;
pub use settler::{record, run_settler, MAX_FLUSH};
