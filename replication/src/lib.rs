//! pgoutput, logical replication protocol version 1, decoded without I/O.
//!
//! Bytes in (the payload of one `XLogData` message), typed messages out:
//! [`decode()`] turns one message into a [`LogicalMessage`]; [`RelationCache`]
//! remembers the `Relation` messages that later row messages refer to by OID.
//! Malformed input is a [`DecodeError`]: lengths are checked against the bytes
//! actually present before anything is allocated, so hostile or truncated input
//! can neither panic nor make a huge allocation.
//!
//! Reference: PostgreSQL's "Logical Replication Message Formats" chapter.

mod decode;
mod lsn;
mod relation_cache;

pub use decode::{decode, Column, DecodeError, LogicalMessage, Relation, Tuple, TupleValue, MAX_COLUMNS};
pub use lsn::{Lsn, ParseLsnError};
pub use relation_cache::RelationCache;

/// Microseconds between the Unix epoch and PostgreSQL's epoch (2000-01-01 UTC).
pub const PG_EPOCH_OFFSET_MICROS: i64 = 946_684_800_000_000;

/// A PostgreSQL timestamp (microseconds since 2000-01-01 UTC) as microseconds
/// since the Unix epoch.
pub fn pg_micros_to_unix_micros(pg_micros: i64) -> i64 {
    pg_micros.saturating_add(PG_EPOCH_OFFSET_MICROS)
}
