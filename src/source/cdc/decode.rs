//! Replication events to [`Change`]s: the relation cache, the open
//! transaction's rows, chunks of them. Decoding only: what becomes of the
//! rows is the pipeline's.

use pgwire_replication::ReplicationEvent;
use replication::{decode, pg_micros_to_unix_micros, LogicalMessage, Lsn, Relation, RelationCache, Tuple};
use tokio_postgres::Client;

use crate::event::{Commit, Origin, OutboxEvent, PublishedColumn};
use crate::mapping::Mapping;
use crate::pipeline::intake::{Change, Chunk};

use super::row::{
    as_committed, inserted_published, mapped_key, mapped_row, owned_by_table, row_from_tuple, tuple_id,
    unpublished_again, updated_row,
};
use crate::source::mapped_table::Resend;
use std::collections::HashMap;
use std::sync::Arc;

use super::{from_wire, CdcError, CHUNK, CHUNK_BYTES, HEARTBEAT_PREFIX};

/// What one replication event comes to.
#[derive(Debug)]
pub(crate) enum Step {
    /// Nothing for the pipeline (a relation, another table's change).
    Nothing,
    Change(Change),
    /// The relay's heartbeat came back; written at this time (µs since the
    /// Unix epoch).
    Heartbeat {
        written_us: i64,
    },
    /// The stream reached its stop position.
    Stopped,
}

/// Decoding state of one session: the relation cache and the open transaction.
pub(crate) struct Decoder {
    pub(crate) cache: RelationCache,
    pub(crate) txn: Option<OpenTxn>,
    pub(crate) startup_lsn: Lsn,
    pub(crate) handed_until: std::sync::Arc<super::held::HandedUntil>,
    /// The mapped tables read besides the relay's own, each with its
    /// published column ([`Mapping::published_column`]).
    pub(crate) mapped: Vec<(Mapping, Option<Arc<PublishedColumn>>)>,
    /// Where mapped rows set unpublished again go to be claimed.
    pub(crate) resend: tokio::sync::mpsc::UnboundedSender<Resend>,
}

/// Whose rows a relation holds.
#[derive(Clone, Copy)]
enum Table {
    /// The relay's own `outbox`.
    Outbox,
    /// A mapped table (its index in [`Decoder::mapped`]).
    Mapped(usize),
}

impl Decoder {
    /// A transaction committed at `final_lsn` is checked against the table
    /// before its rows are sent: committed before the session began (a
    /// replay), or before rows were last handed to the table while no stream
    /// brought them.
    fn replayed(&self, final_lsn: Lsn) -> bool {
        final_lsn < self.startup_lsn || final_lsn < self.handed_until.get()
    }

    /// Whose rows `rel` holds, if anyone's the relay reads: a mapped table
    /// by its oid (whatever it is called now: renamed, moved to another
    /// schema), or by the name the mapping gives (a table created again
    /// under it).
    fn table(&self, rel: &Relation) -> Option<Table> {
        let by_oid = || self.mapped.iter().position(|(m, _)| m.oid == Some(rel.oid));
        let by_name = || self.mapped.iter().position(|(m, _)| m.schema == rel.namespace && m.table == rel.name);
        match by_oid().or_else(by_name) {
            Some(i) => Some(Table::Mapped(i)),
            None if rel.name == "outbox" => Some(Table::Outbox),
            None => None,
        }
    }

    /// A relation the stream describes (before its first row in a session,
    /// and again after its definition changed): a mapped table under
    /// another name, or without a column its mapping reads, is said once
    /// here.
    fn on_relation(&self, rel: &Relation) {
        let Some(Table::Mapped(i)) = self.table(rel) else { return };
        let m = &self.mapped[i].0;
        let (configured, now) = (format!("{}.{}", m.schema, m.table), format!("{}.{}", rel.namespace, rel.name));
        if configured != now {
            tracing::warn!(
                table = %configured, now = %now, oid = rel.oid,
                "mapped table renamed or moved: its rows are read under its new name (the same table, by its oid); \
                 set `table` in [[outbox]] to the new name"
            );
        } else if m.oid.is_some_and(|oid| oid != rel.oid) {
            tracing::warn!(table = %configured, oid = rel.oid, was = ?m.oid, "mapped table created again under its name: its rows are read too");
        }
        for c in m.columns().into_iter().filter(|c| rel.column_index(c).is_none()) {
            if m.requires(c) {
                tracing::error!(
                    table = %now, column = c,
                    "a column the mapping needs is gone from the mapped table: each of its rows ends DEAD \
                     (unreadable_row) in the relay's table until the column is back or the mapping is fixed"
                );
            } else {
                tracing::warn!(table = %now, column = c, "a column the mapping reads is gone from the mapped table: read as NULL");
            }
        }
    }

    /// One replication event: a transaction's rows are buffered and come out
    /// in chunks (by count and by bytes); the last with its commit.
    pub(crate) async fn handle(&mut self, ev: ReplicationEvent, sql: &Client) -> Result<Step, CdcError> {
        let change = match ev {
            ReplicationEvent::Begin { final_lsn, commit_time_micros, xid } => {
                self.txn = Some(OpenTxn {
                    xid,
                    final_lsn: from_wire(final_lsn),
                    commit_time_us: pg_micros_to_unix_micros(commit_time_micros),
                    buf: Vec::new(),
                    rows: 0,
                    buf_bytes: 0,
                    buffered: HashMap::new(),
                    mapped_buffered: HashMap::new(),
                });
                Change::Begin
            }
            ReplicationEvent::XLogData { data, .. } => match self.xlog(&data, sql).await? {
                Some(chunk) => Change::Rows(chunk),
                None => return Ok(Step::Nothing),
            },
            ReplicationEvent::Commit { end_lsn, .. } => {
                let t = self.txn.take().ok_or_else(|| CdcError::Protocol("Commit without Begin".into()))?;
                let rest = Chunk { replayed: self.replayed(t.final_lsn), events: t.buf };
                Change::Commit { rest, end: from_wire(end_lsn) }
            }
            ReplicationEvent::KeepAlive { wal_end, .. } if self.txn.is_none() => {
                Change::Idle { wal_end: from_wire(wal_end) }
            }
            ReplicationEvent::KeepAlive { .. } => return Ok(Step::Nothing),
            // Heartbeats: their transaction settles empty; the content is the
            // time they were written.
            ReplicationEvent::Message { prefix, content, .. } if prefix == HEARTBEAT_PREFIX => {
                let written = std::str::from_utf8(&content).ok().and_then(|s| s.trim().parse::<i64>().ok());
                return Ok(written.map_or(Step::Nothing, |written_us| Step::Heartbeat { written_us }));
            }
            ReplicationEvent::Message { .. } => return Ok(Step::Nothing),
            ReplicationEvent::StoppedAt { .. } => return Ok(Step::Stopped),
        };
        Ok(Step::Change(change))
    }

    /// A change inside a transaction; a chunk of its rows when one is full.
    async fn xlog(&mut self, data: &bytes::Bytes, sql: &Client) -> Result<Option<Chunk>, CdcError> {
        let msg = decode(data)?;
        if self.cache.observe(&msg) {
            if let LogicalMessage::Relation(rel) = &msg {
                self.on_relation(rel);
            }
            return Ok(None);
        }
        match msg {
            LogicalMessage::Insert { relation, new } => return self.on_insert(relation, &new, sql).await,
            LogicalMessage::Update { relation, new, old, .. } => self.on_update(relation, &new, old.as_ref())?,
            LogicalMessage::Delete { relation, key, old } => self.on_delete(relation, key.or(old)),
            LogicalMessage::Truncate { .. } => {
                tracing::warn!(
                    "TRUNCATE of the outbox seen in the stream; rows truncated before being published are gone"
                );
            }
            _ => {}
        }
        Ok(None)
    }

    /// An outbox row inserted: buffered in its transaction; a full chunk
    /// comes out once the transaction goes on past it.
    async fn on_insert(&mut self, relation: u32, new: &Tuple, sql: &Client) -> Result<Option<Chunk>, CdcError> {
        let rel = self
            .cache
            .get(relation)
            .ok_or_else(|| CdcError::Protocol(format!("Insert for unknown relation {relation}")))?;
        let table = self.table(rel);
        let t = self.txn.as_mut().ok_or_else(|| CdcError::Protocol("Insert outside a transaction".into()))?;
        let commit = Commit { xid: t.xid, lsn: t.final_lsn, seq: t.rows };
        let (row, key) = match table {
            None => return Ok(None),
            Some(Table::Outbox) if owned_by_table(rel, new) => return Ok(None),
            Some(Table::Outbox) => (row_from_tuple(rel, new, t.commit_time_us, commit)?, None),
            Some(Table::Mapped(i)) if inserted_published(&self.mapped[i].0, rel, new) => return Ok(None),
            Some(Table::Mapped(i)) => {
                let (m, published) = &self.mapped[i];
                let fallback = || format!("no-key@{}#{}", t.final_lsn, t.rows);
                // Its published column is set once the transaction is visible.
                let row = mapped_row(m, rel, new, None, t.commit_time_us, published.as_ref(), fallback);
                (row.read_in(commit), mapped_key(m, rel, new).map(|k| (relation, k)))
            }
        };
        let mut full = None;
        if t.buf.len() >= CHUNK || t.buf_bytes >= CHUNK_BYTES {
            full = Some(self.hand_on(sql).await?);
        }
        let t = self.txn.as_mut().expect("checked above");
        t.rows += 1;
        let huge = crate::pipeline::budget::is_huge(row.body.len());
        t.buf_bytes += row.size();
        match (key, &row.origin) {
            (Some(key), _) => _ = t.mapped_buffered.insert(key, t.buf.len()),
            (None, Origin::Own { id, .. }) => _ = t.buffered.insert(*id, t.buf.len()),
            (None, _) => {}
        }
        t.buf.push(row);
        if huge && full.is_none() {
            // A body through S3 goes on at once, not when the next row
            // comes: held here while the next is read, it was one more body
            // outside the byte budget.
            return Ok(Some(self.hand_on(sql).await?));
        }
        Ok(full)
    }

    /// The open transaction's rows so far, as a chunk handed on before its
    /// end: what is left of the transaction may update them, so they are
    /// sent as committed (read back from the table).
    async fn hand_on(&mut self, sql: &Client) -> Result<Chunk, CdcError> {
        let t = self.txn.as_mut().ok_or_else(|| CdcError::Protocol("a chunk outside a transaction".into()))?;
        let (final_lsn, mut events) = (t.final_lsn, std::mem::take(&mut t.buf));
        t.buf_bytes = 0;
        t.buffered.clear();
        t.mapped_buffered.clear();
        as_committed(sql, &mut events).await?;
        Ok(Chunk { events, replayed: self.replayed(final_lsn) })
    }

    /// A row its own transaction inserted and then changed is sent as it
    /// stands at commit (a chunk handed on earlier was read back from the
    /// table). A mapped row a later transaction set unpublished again (its
    /// published column back to NULL) is claimed from its table and sent
    /// ([`Resend`]). Other updates (later transactions, the relay's own
    /// marks) change nothing here.
    fn on_update(&mut self, relation: u32, new: &Tuple, old: Option<&Tuple>) -> Result<(), CdcError> {
        let Some(rel) = self.cache.get(relation) else { return Ok(()) };
        let table = self.table(rel);
        if let Some(Table::Mapped(m_at)) = table {
            let (m, published) = &self.mapped[m_at];
            let (Some(t), Some(key)) = (self.txn.as_mut(), mapped_key(m, rel, new)) else { return Ok(()) };
            let Some(&i) = t.mapped_buffered.get(&(relation, key.clone())) else {
                if unpublished_again(m, rel, new, old) {
                    // The session's end drops the receiver: the row stays
                    // unpublished, sent at the next session's start.
                    let _ = self.resend.send(Resend { table: m_at, key });
                }
                return Ok(());
            };
            {
                let fallback = || t.buf[i].mapped().map(|r| r.key.clone()).unwrap_or_default();
                let row = mapped_row(m, rel, new, Some(&t.buf[i]), t.commit_time_us, published.as_ref(), fallback);
                let row = match t.buf[i].commit() {
                    Some(&commit) => row.read_in(commit),
                    None => row,
                };
                t.buf_bytes = (t.buf_bytes + row.size()).saturating_sub(t.buf[i].size());
                t.buf[i] = row;
            }
            return Ok(());
        }
        let Some(Table::Outbox) = table else { return Ok(()) };
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
    /// transactions, the relay's own settlement) need nothing; a mapped
    /// table's rows are settled as transient whether deleted or not.
    fn on_delete(&mut self, relation: u32, old: Option<Tuple>) {
        let Some(rel) = self.cache.get(relation).filter(|r| matches!(self.table(r), Some(Table::Outbox))) else {
            return;
        };
        let (Some(t), Some(id)) = (self.txn.as_mut(), old.and_then(|k| tuple_id(rel, &k))) else { return };
        if let Some(&i) = t.buffered.get(&id) {
            t.buf[i].origin.deleted_by_its_transaction();
        }
    }
}

pub(crate) struct OpenTxn {
    pub(crate) xid: u32,
    pub(crate) final_lsn: Lsn,
    pub(crate) commit_time_us: i64,
    pub(crate) buf: Vec<OutboxEvent>,
    /// Rows inserted so far: the next row's `commit_seq`.
    pub(crate) rows: u32,
    pub(crate) buf_bytes: usize,
    /// Id → index in `buf`, to find a row its own transaction deletes. A row
    /// already dispatched in an earlier chunk is settled as usual (its
    /// marking finds it gone: one lookup, no wait).
    pub(crate) buffered: HashMap<i64, usize>,
    /// A mapped table's rows by (relation, key), to find a row its own
    /// transaction updates.
    pub(crate) mapped_buffered: HashMap<(u32, String), usize>,
}
