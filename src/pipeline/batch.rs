//! Cutting batches out of a lane's pending entries, within the limits of
//! the destination's kind ([`BatchLimits`]: for an SQS queue at most 10
//! entries, at most 1 MiB together; each entry already fits the
//! destination's `MaximumMessageSize`, see [`crate::publish::kind::Rules::prepare`]).
//!
//! FIFO destinations: a batch holds at most one entry per message group, and never
//! an entry of a group that is already in flight. A group's entries therefore
//! reach SQS one at a time, in commit order, and a failed entry is retried
//! before anything later in its group is sent.

use std::collections::{HashSet, VecDeque};

use crate::publish::entry::Entry;
use crate::publish::kind::BatchLimits;

/// How far into the pending entries a FIFO lane looks for sendable groups.
pub const FIFO_SCAN_LIMIT: usize = 512;

/// What the batcher needs to know of a pending item.
pub trait Batchable {
    /// Bytes counted against the batch limit.
    fn size(&self) -> usize;
    /// FIFO message group, if any.
    fn group(&self) -> Option<&str>;
}

impl Batchable for Entry {
    fn size(&self) -> usize {
        self.size
    }
    fn group(&self) -> Option<&str> {
        self.ordering_group()
    }
}

/// Take the next batch from the front of `pending`, within `limits`. `busy`
/// holds the FIFO groups in flight; it is ignored for standard queues
/// (entries have no group).
pub fn take_batch<T: Batchable>(pending: &mut VecDeque<T>, busy: &HashSet<String>, limits: BatchLimits) -> Vec<T> {
    let mut batch: Vec<T> = Vec::with_capacity(limits.entries);
    let mut bytes = 0usize;
    let mut blocked: HashSet<String> = HashSet::new();
    let mut i = 0usize;
    while i < pending.len() && i < FIFO_SCAN_LIMIT && batch.len() < limits.entries {
        let size = pending[i].size();
        if bytes + size > limits.bytes && !batch.is_empty() {
            break;
        }
        if let Some(g) = pending[i].group() {
            if busy.contains(g) || blocked.contains(g) {
                // Later entries of this group must not overtake this one.
                blocked.insert(g.to_owned());
                i += 1;
                continue;
            }
            blocked.insert(g.to_owned());
        }
        let entry = pending.remove(i).expect("index checked");
        bytes += size;
        batch.push(entry);
    }
    batch
}

/// Whether `pending` holds a full batch's worth of sendable entries: no reason
/// to wait for the linger.
pub fn full_batch_ready<T: Batchable>(pending: &VecDeque<T>, fifo: bool, limits: BatchLimits) -> bool {
    if !fifo {
        let mut bytes = 0;
        for (n, e) in pending.iter().enumerate() {
            bytes += e.size();
            if n + 1 >= limits.entries || bytes > limits.bytes {
                return true;
            }
        }
        return false;
    }
    pending.len() >= limits.entries
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::OutboxEvent;
    use crate::publish::kind::queue::BATCH_LIMITS as SQS;
    use proptest::prelude::*;
    use std::sync::Arc;

    fn entry(id: i64, size: usize, group: Option<u8>) -> Entry {
        Entry {
            event: Arc::new(OutboxEvent::for_test(id, "d", "")),
            attributes: vec![],
            size,
            group_id: group.map(|g| format!("g{g}")),
            ordered: true,
            trace_header: None,
            dedup_id: None,
            offload: None,
            delay_seconds: None,
            bus: None,
        }
    }

    /// A standard queue's fair-queue groups impose no order: a group in
    /// flight does not hold its next entries back.
    #[test]
    fn fair_queue_groups_are_not_serialised() {
        let mut p: VecDeque<_> = (0..12).map(|i| Entry { ordered: false, ..entry(i, 100, Some(1)) }).collect();
        let busy: HashSet<String> = ["g1".to_string()].into();
        assert_eq!(take_batch(&mut p, &busy, SQS).len(), 10);
    }

    #[test]
    fn ten_entries_or_one_mebibyte() {
        let mut p: VecDeque<_> = (0..25).map(|i| entry(i, 100, None)).collect();
        assert_eq!(take_batch(&mut p, &HashSet::new(), SQS).len(), 10);
        assert_eq!(p.len(), 15);
        let mut p: VecDeque<_> = (0..5).map(|i| entry(i, 300_000, None)).collect();
        let b = take_batch(&mut p, &HashSet::new(), SQS);
        assert_eq!(b.len(), 3); // 900,000 bytes; a fourth would pass 1,048,576
        let mut p: VecDeque<_> = (0..2).map(|i| entry(i, 262_144 * 4, None)).collect();
        assert_eq!(take_batch(&mut p, &HashSet::new(), SQS).len(), 1);
    }

    #[test]
    fn fifo_one_per_group_and_never_a_busy_group() {
        let mut p: VecDeque<_> =
            [(1, 1), (2, 1), (3, 2), (4, 3), (5, 2)].into_iter().map(|(id, g)| entry(id, 10, Some(g))).collect();
        let busy: HashSet<String> = ["g3".to_string()].into();
        let b: Vec<i64> = take_batch(&mut p, &busy, SQS).iter().map(|e| e.event.row_id().unwrap()).collect();
        assert_eq!(b, vec![1, 3]);
        let left: Vec<i64> = p.iter().map(|e| e.event.row_id().unwrap()).collect();
        assert_eq!(left, vec![2, 4, 5]);
    }

    proptest! {
        #[test]
        fn batches_respect_every_limit(
            specs in proptest::collection::vec((1usize..400_000, proptest::option::of(0u8..6)), 0..80),
            busy_groups in proptest::collection::hash_set(0u8..6, 0..3),
        ) {
            let busy: HashSet<String> = busy_groups.iter().map(|g| format!("g{g}")).collect();
            let mut pending: VecDeque<Entry> = specs.iter().enumerate()
                .map(|(i, (size, g))| entry(i as i64, *size, *g)).collect();
            loop {
                let before: Vec<(i64, Option<String>)> =
                    pending.iter().map(|e| (e.event.row_id().unwrap(), e.group_id.clone())).collect();
                let batch = take_batch(&mut pending, &busy, SQS);
                if batch.is_empty() { break; }
                prop_assert!(batch.len() <= SQS.entries);
                prop_assert!(batch.iter().map(|e| e.size).sum::<usize>() <= SQS.bytes);
                let mut seen = HashSet::new();
                for e in &batch {
                    if let Some(g) = &e.group_id {
                        prop_assert!(!busy.contains(g));
                        prop_assert!(seen.insert(g.clone()), "group twice in one batch");
                        // Nothing earlier of the same group stayed behind.
                        let pos = before.iter().position(|(id, _)| *id == e.event.row_id().unwrap()).unwrap();
                        prop_assert!(before[..pos].iter().all(|(id, og)| og.as_ref() != Some(g)
                            || batch.iter().any(|b| b.event.row_id().unwrap() == *id)));
                    }
                }
                // Standard queues keep commit order exactly.
                if batch.iter().all(|e| e.group_id.is_none()) && before.iter().all(|(_, g)| g.is_none()) {
                    let ids: Vec<i64> = batch.iter().map(|e| e.event.row_id().unwrap()).collect();
                    let expect: Vec<i64> = before.iter().take(ids.len()).map(|(id, _)| *id).collect();
                    prop_assert_eq!(ids, expect);
                }
            }
            // Only busy groups' entries can be left.
            prop_assert!(pending.iter().all(|e| e.group_id.as_ref().is_some_and(|g| busy.contains(g))));
        }
    }
}
