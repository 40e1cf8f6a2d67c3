//! Where events come from: the replication slot ([`cdc`]) and the outbox
//! table ([`table`]: polling mode and the spool drain).

pub mod cdc;
pub mod table;
