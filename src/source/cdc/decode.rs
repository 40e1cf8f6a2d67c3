//! Replication events to outbox rows: the relation cache, the open
//! transaction, chunks handed to the router.

use pgwire_replication::ReplicationEvent;
use replication::{decode, pg_micros_to_unix_micros, LogicalMessage, Lsn, RelationCache};
use tokio_postgres::Client;

use crate::event::OutboxEvent;
use crate::pipeline::watermark::TxnSeq;

use super::row::{owned_by_table, row_from_tuple, tuple_id, updated_row};
use super::*;

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
                    handed_on: None,
                    warned_late_update: false,
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
                        let now_us = std::time::SystemTime::now()
                            .duration_since(std::time::UNIX_EPOCH)
                            .map(|d| d.as_micros() as i64)
                            .unwrap_or(0);
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
            LogicalMessage::Insert { relation, new } => {
                let rel = self
                    .cache
                    .get(relation)
                    .ok_or_else(|| CdcError::Protocol(format!("Insert for unknown relation {relation}")))?;
                if rel.name != "outbox" || owned_by_table(rel, &new) {
                    return Ok(());
                }
                let t = self.txn.as_mut().ok_or_else(|| CdcError::Protocol("Insert outside a transaction".into()))?;
                let row = row_from_tuple(rel, &new, t.commit_time_us, Some(t.xid), t.final_lsn)?;
                t.buf_bytes += row.size();
                t.buffered.insert(row.id, t.buf.len());
                t.buf.push(row);
                if t.buf.len() >= CHUNK || t.buf_bytes >= CHUNK_BYTES {
                    let (seq, final_lsn, buf) = (t.seq, t.final_lsn, std::mem::take(&mut t.buf));
                    t.buf_bytes = 0;
                    t.note_handed_on(buf.iter().map(|e| e.id));
                    t.buffered.clear();
                    router.dispatch(sql, seq, self.replayed(final_lsn), buf).await?;
                }
            }
            LogicalMessage::Update { relation, new, .. } => {
                // A row its own transaction inserted and then changed is
                // sent as it stands at commit. Other updates (later
                // transactions, the relay's own marks) change nothing here.
                let Some(rel) = self.cache.get(relation).filter(|r| r.name == "outbox") else { return Ok(()) };
                let (Some(t), Some(id)) = (self.txn.as_mut(), tuple_id(rel, &new)) else { return Ok(()) };
                if let Some(&i) = t.buffered.get(&id) {
                    let row = updated_row(rel, &new, &t.buf[i])?;
                    t.buf_bytes = (t.buf_bytes + row.size()).saturating_sub(t.buf[i].size());
                    t.buf[i] = row;
                } else if t.handed_on.is_some_and(|(lo, hi)| (lo..=hi).contains(&id)) && !t.warned_late_update {
                    // Its chunk is on its way already: it goes out as inserted.
                    t.warned_late_update = true;
                    tracing::warn!(
                        id,
                        "a transaction updated an outbox row after its chunk ({CHUNK} rows or {CHUNK_BYTES} bytes) was \
                         handed on: if that row was inserted by the same transaction it is sent as inserted, not as \
                         committed"
                    );
                }
            }
            LogicalMessage::Delete { relation, key, old } => {
                // A row deleted by the transaction that inserted it is
                // transient: published, never settled in the table. Other
                // deletes (later transactions, the relay's own settlement)
                // need nothing.
                let Some(rel) = self.cache.get(relation).filter(|r| r.name == "outbox") else { return Ok(()) };
                let (Some(t), Some(id)) = (self.txn.as_mut(), key.or(old).and_then(|k| tuple_id(rel, &k))) else {
                    return Ok(());
                };
                if let Some(&i) = t.buffered.get(&id) {
                    t.buf[i].transient = true;
                }
            }
            LogicalMessage::Truncate { .. } => {
                tracing::warn!(
                    "TRUNCATE of the outbox seen in the stream; rows truncated before being published are gone"
                );
            }
            _ => {}
        }
        Ok(())
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
    /// The lowest and highest id of the chunks already handed on: an update
    /// of one of those rows by this transaction comes too late to be applied.
    pub(crate) handed_on: Option<(i64, i64)>,
    pub(crate) warned_late_update: bool,
}

impl OpenTxn {
    fn note_handed_on(&mut self, ids: impl Iterator<Item = i64>) {
        for id in ids {
            let (lo, hi) = self.handed_on.unwrap_or((id, id));
            self.handed_on = Some((lo.min(id), hi.max(id)));
        }
    }
}
