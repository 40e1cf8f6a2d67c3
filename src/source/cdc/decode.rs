//! Replication events to outbox rows: the relation cache, the open
//! transaction, chunks handed to the router.

use pgwire_replication::ReplicationEvent;
use replication::{decode, pg_micros_to_unix_micros, LogicalMessage, Lsn, RelationCache, Tuple};
use tokio_postgres::Client;

use crate::event::OutboxEvent;
use crate::pipeline::watermark::TxnSeq;

use super::row::{as_committed, owned_by_table, row_from_tuple, tuple_id, updated_row};
use std::collections::HashMap;

use super::{CdcError, Router, StreamContext, CHUNK, CHUNK_BYTES, HEARTBEAT_PREFIX};

#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Handled {
    Continue,
    /// The stream reached its stop position.
    Stopped,
}

/// Decoding state of one session: the relation cache and the open transaction.
pub(crate) struct Decoder {
    pub(crate) cache: RelationCache,
    pub(crate) txn: Option<OpenTxn>,
    pub(crate) startup_lsn: Lsn,
    pub(crate) handed_until: std::sync::Arc<super::held::HandedUntil>,
}

impl Decoder {
    /// A transaction committed at `final_lsn` is checked against the table
    /// before its rows are sent: committed before the session began (a
    /// replay), or before rows were last handed to the table while no stream
    /// brought them.
    fn replayed(&self, final_lsn: Lsn) -> bool {
        final_lsn < self.startup_lsn || final_lsn < self.handed_until.get()
    }

    /// One replication event: transactions are buffered in chunks (by count
    /// and by bytes) and dispatched to the router; commits move the watermark.
    pub(crate) async fn handle(
        &mut self,
        ev: ReplicationEvent,
        sql: &Client,
        router: &mut Router<'_>,
        ctx: &StreamContext,
    ) -> Result<Handled, CdcError> {
        match ev {
            ReplicationEvent::Begin { final_lsn, commit_time_micros, xid } => {
                let seq = router.watermark.lock().unwrap().begin();
                self.txn = Some(OpenTxn {
                    seq,
                    xid,
                    final_lsn: Lsn(final_lsn.0),
                    commit_time_us: pg_micros_to_unix_micros(commit_time_micros),
                    buf: Vec::new(),
                    buf_bytes: 0,
                    buffered: HashMap::new(),
                });
            }
            ReplicationEvent::XLogData { data, .. } => self.xlog(&data, sql, router).await?,
            ReplicationEvent::Commit { end_lsn, .. } => {
                let mut t = self.txn.take().ok_or_else(|| CdcError::Protocol("Commit without Begin".into()))?;
                let buf = std::mem::take(&mut t.buf);
                router.dispatch(sql, t.seq, self.replayed(t.final_lsn), buf).await?;
                router.watermark.lock().unwrap().commit(t.seq, Lsn(end_lsn.0));
            }
            ReplicationEvent::KeepAlive { wal_end, .. } => {
                if self.txn.is_none() {
                    router.watermark.lock().unwrap().observe_idle(Lsn(wal_end.0));
                }
            }
            ReplicationEvent::Message { prefix, content, .. } => {
                // Heartbeats: their transaction settles empty; the content is
                // the time they were written.
                if prefix == HEARTBEAT_PREFIX {
                    if let Some(sent_us) = std::str::from_utf8(&content).ok().and_then(|s| s.trim().parse::<i64>().ok())
                    {
                        let now_us = crate::clock::now_unix_us();
                        ctx.metrics.heartbeat_rtt_seconds.set((now_us - sent_us).max(0) as f64 / 1e6);
                    }
                }
            }
            ReplicationEvent::StoppedAt { .. } => return Ok(Handled::Stopped),
        }
        Ok(Handled::Continue)
    }

    async fn xlog(&mut self, data: &bytes::Bytes, sql: &Client, router: &mut Router<'_>) -> Result<(), CdcError> {
        let msg = decode(data)?;
        if self.cache.observe(&msg) {
            return Ok(());
        }
        match msg {
            LogicalMessage::Insert { relation, new } => self.on_insert(relation, &new, sql, router).await?,
            LogicalMessage::Update { relation, new, .. } => self.on_update(relation, &new)?,
            LogicalMessage::Delete { relation, key, old } => self.on_delete(relation, key.or(old)),
            LogicalMessage::Truncate { .. } => {
                tracing::warn!(
                    "TRUNCATE of the outbox seen in the stream; rows truncated before being published are gone"
                );
            }
            _ => {}
        }
        Ok(())
    }

    /// An outbox row inserted: buffered in its transaction; a full chunk is
    /// handed on once the transaction goes on past it.
    async fn on_insert(
        &mut self,
        relation: u32,
        new: &Tuple,
        sql: &Client,
        router: &mut Router<'_>,
    ) -> Result<(), CdcError> {
        let rel = self
            .cache
            .get(relation)
            .ok_or_else(|| CdcError::Protocol(format!("Insert for unknown relation {relation}")))?;
        if rel.name != "outbox" || owned_by_table(rel, new) {
            return Ok(());
        }
        let t = self.txn.as_mut().ok_or_else(|| CdcError::Protocol("Insert outside a transaction".into()))?;
        let row = row_from_tuple(rel, new, t.commit_time_us, Some(t.xid), t.final_lsn)?;
        if t.buf.len() >= CHUNK || t.buf_bytes >= CHUNK_BYTES {
            // What is left of the transaction may update the chunk's rows,
            // so they are sent as committed (read back from the table).
            let (seq, final_lsn, mut buf) = (t.seq, t.final_lsn, std::mem::take(&mut t.buf));
            t.buf_bytes = 0;
            t.buffered.clear();
            as_committed(sql, &mut buf).await?;
            router.dispatch(sql, seq, self.replayed(final_lsn), buf).await?;
        }
        let t = self.txn.as_mut().expect("checked above");
        t.buf_bytes += row.size();
        t.buffered.insert(row.id, t.buf.len());
        t.buf.push(row);
        Ok(())
    }

    /// A row its own transaction inserted and then changed is sent as it
    /// stands at commit (a chunk handed on earlier was read back from the
    /// table). Other updates (later transactions, the relay's own marks)
    /// change nothing here.
    fn on_update(&mut self, relation: u32, new: &Tuple) -> Result<(), CdcError> {
        let Some(rel) = self.cache.get(relation).filter(|r| r.name == "outbox") else { return Ok(()) };
        let (Some(t), Some(id)) = (self.txn.as_mut(), tuple_id(rel, new)) else { return Ok(()) };
        if let Some(&i) = t.buffered.get(&id) {
            let row = updated_row(rel, new, &t.buf[i])?;
            t.buf_bytes = (t.buf_bytes + row.size()).saturating_sub(t.buf[i].size());
            t.buf[i] = row;
        }
        Ok(())
    }

    /// A row deleted by the transaction that inserted it is transient:
    /// published, never settled in the table. Other deletes (later
    /// transactions, the relay's own settlement) need nothing.
    fn on_delete(&mut self, relation: u32, old: Option<Tuple>) {
        let Some(rel) = self.cache.get(relation).filter(|r| r.name == "outbox") else { return };
        let (Some(t), Some(id)) = (self.txn.as_mut(), old.and_then(|k| tuple_id(rel, &k))) else { return };
        if let Some(&i) = t.buffered.get(&id) {
            t.buf[i].transient = true;
        }
    }
}

pub(crate) struct OpenTxn {
    pub(crate) seq: TxnSeq,
    pub(crate) xid: u32,
    pub(crate) final_lsn: Lsn,
    pub(crate) commit_time_us: i64,
    pub(crate) buf: Vec<OutboxEvent>,
    pub(crate) buf_bytes: usize,
    /// Id → index in `buf`, to find a row its own transaction deletes. A row
    /// already dispatched in an earlier chunk is settled as usual (its
    /// marking finds it gone: one lookup, no wait).
    pub(crate) buffered: HashMap<i64, usize>,
}
