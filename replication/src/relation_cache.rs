//! The relation cache: `Relation` messages by OID, for the row messages that
//! refer to them.

use std::collections::HashMap;
use std::sync::Arc;

use crate::{LogicalMessage, Relation};

/// Relations seen on this replication session, by OID. A later `Relation`
/// message for the same OID (after `ALTER TABLE`) replaces the earlier one.
#[derive(Debug, Default, Clone)]
pub struct RelationCache {
    by_oid: HashMap<u32, Arc<Relation>>,
}

impl RelationCache {
    pub fn new() -> Self {
        Self::default()
    }

    /// Remember `msg` if it is a `Relation` message; returns whether it was.
    pub fn observe(&mut self, msg: &LogicalMessage) -> bool {
        if let LogicalMessage::Relation(rel) = msg {
            self.by_oid.insert(rel.oid, Arc::clone(rel));
            true
        } else {
            false
        }
    }

    pub fn get(&self, oid: u32) -> Option<&Arc<Relation>> {
        self.by_oid.get(&oid)
    }

    pub fn len(&self) -> usize {
        self.by_oid.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_oid.is_empty()
    }

    pub fn clear(&mut self) {
        self.by_oid.clear();
    }
}
