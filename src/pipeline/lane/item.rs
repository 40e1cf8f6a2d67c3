//! An entry on its way through a lane, and what batching asks of it.

use std::time::Instant;

use crate::pipeline::batch::Batchable;
use crate::pipeline::budget::Permit;
use crate::pipeline::watermark::TxnSeq;
use crate::publish::entry::Entry;

/// An entry on its way through a lane.
pub struct LaneItem {
    pub entry: Entry,
    pub txn: Option<TxnSeq>,
    pub permit: Option<Permit>,
    pub arrived: Instant,
    /// The last entry for this lane of what its source hands over at once (a
    /// transaction's chunk, a table round): an idle lane sends when it has
    /// that much, not at the first entry while the rest is still arriving.
    pub chunk_end: bool,
}

impl LaneItem {
    /// An entry that ends its chunk (see [`LaneItem::ending_chunk`]).
    pub fn new(entry: Entry, txn: Option<TxnSeq>, permit: Option<Permit>) -> Self {
        Self { entry, txn, permit, arrived: Instant::now(), chunk_end: true }
    }

    /// Whether this entry ends its chunk (`false`: more of it follow).
    pub fn ending_chunk(mut self, end: bool) -> Self {
        self.chunk_end = end;
        self
    }
}

/// The FIFO groups of `items`, in order (none on a standard queue).
pub(crate) fn ordering_groups<'a>(items: impl IntoIterator<Item = &'a LaneItem>) -> Vec<String> {
    items.into_iter().filter_map(|i| i.entry.ordering_group().map(str::to_string)).collect()
}

impl Batchable for LaneItem {
    fn size(&self) -> usize {
        self.entry.size
    }
    fn group(&self) -> Option<&str> {
        self.entry.ordering_group()
    }
}
