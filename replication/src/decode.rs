//! The pgoutput v1 message decoder.

use bytes::Bytes;
use std::sync::Arc;

use crate::Lsn;

/// PostgreSQL's MaxTupleAttributeNumber: no tuple has more columns.
pub const MAX_COLUMNS: usize = 1664;

/// Why a message could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("empty pgoutput message")]
    Empty,
    #[error("unknown pgoutput message tag {0:#04x}")]
    UnknownTag(u8),
    #[error("truncated {what}: need {need} more bytes, {have} left")]
    Truncated { what: &'static str, need: usize, have: usize },
    #[error("{what} is not NUL-terminated")]
    Unterminated { what: &'static str },
    #[error("{what} is not valid UTF-8")]
    NotUtf8 { what: &'static str },
    #[error("invalid {what}: {value}")]
    Invalid { what: &'static str, value: i64 },
    #[error("unknown tuple data kind {0:#04x}")]
    UnknownTupleKind(u8),
    #[error("unexpected tuple marker {0:#04x} in {1}")]
    UnexpectedMarker(u8, &'static str),
    #[error("{0} trailing bytes after the message")]
    Trailing(usize),
}

/// One column value of a tuple.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TupleValue {
    Null,
    /// A TOASTed value that did not change; the stream does not carry it.
    UnchangedToast,
    /// Text format (the type's output function).
    Text(Bytes),
    /// Binary format (the type's send function), with `binary 'true'`.
    Binary(Bytes),
}

impl TupleValue {
    /// The value as UTF-8 text, when it is a text value.
    pub fn as_str(&self) -> Option<Result<&str, DecodeError>> {
        match self {
            TupleValue::Text(b) => {
                Some(std::str::from_utf8(b).map_err(|_| DecodeError::NotUtf8 { what: "text value" }))
            }
            _ => None,
        }
    }
}

/// The column values of one row, in the relation's column order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tuple(pub Vec<TupleValue>);

/// A column of a `Relation` message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Column {
    /// Part of the replica identity key.
    pub key: bool,
    pub name: String,
    pub type_oid: u32,
    pub type_modifier: i32,
}

/// A table's shape, sent before the first row of it in a session and again
/// after it changes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Relation {
    pub oid: u32,
    pub namespace: String,
    pub name: String,
    /// `d` default, `n` nothing, `f` full, `i` index.
    pub replica_identity: u8,
    pub columns: Vec<Column>,
}

impl Relation {
    /// Index of the column called `name`.
    pub fn column_index(&self, name: &str) -> Option<usize> {
        self.columns.iter().position(|c| c.name == name)
    }
}

/// One pgoutput protocol v1 message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LogicalMessage {
    Begin {
        final_lsn: Lsn,
        /// Microseconds since 2000-01-01 UTC.
        commit_time: i64,
        xid: u32,
    },
    Commit {
        flags: u8,
        commit_lsn: Lsn,
        end_lsn: Lsn,
        commit_time: i64,
    },
    Origin {
        commit_lsn: Lsn,
        name: String,
    },
    Relation(Arc<Relation>),
    Type {
        oid: u32,
        namespace: String,
        name: String,
    },
    Insert {
        relation: u32,
        new: Tuple,
    },
    Update {
        relation: u32,
        /// The old key columns (`K`), when the key changed.
        key: Option<Tuple>,
        /// The whole old row (`O`), with `REPLICA IDENTITY FULL`.
        old: Option<Tuple>,
        new: Tuple,
    },
    Delete {
        relation: u32,
        key: Option<Tuple>,
        old: Option<Tuple>,
    },
    Truncate {
        /// 1 = CASCADE, 2 = RESTART IDENTITY.
        options: u8,
        relations: Vec<u32>,
    },
    Message {
        transactional: bool,
        lsn: Lsn,
        prefix: String,
        content: Bytes,
    },
}

/// Decode one pgoutput message (the payload of one `XLogData`).
pub fn decode(data: &Bytes) -> Result<LogicalMessage, DecodeError> {
    let mut r = Reader { buf: data, pos: 0 };
    let tag = r.u8("message tag").map_err(|_| DecodeError::Empty)?;
    let msg = match tag {
        b'B' => LogicalMessage::Begin {
            final_lsn: r.lsn("Begin final LSN")?,
            commit_time: r.i64("Begin commit time")?,
            xid: r.u32("Begin xid")?,
        },
        b'C' => LogicalMessage::Commit {
            flags: r.u8("Commit flags")?,
            commit_lsn: r.lsn("Commit LSN")?,
            end_lsn: r.lsn("Commit end LSN")?,
            commit_time: r.i64("Commit time")?,
        },
        b'O' => LogicalMessage::Origin { commit_lsn: r.lsn("Origin commit LSN")?, name: r.cstr("Origin name")? },
        b'R' => {
            let oid = r.u32("Relation OID")?;
            let namespace = r.cstr("Relation namespace")?;
            let name = r.cstr("Relation name")?;
            let replica_identity = r.u8("Relation replica identity")?;
            let n = r.count("Relation column count", 7)?;
            let mut columns = Vec::with_capacity(n);
            for _ in 0..n {
                let flags = r.u8("column flags")?;
                columns.push(Column {
                    key: flags & 1 == 1,
                    name: r.cstr("column name")?,
                    type_oid: r.u32("column type OID")?,
                    type_modifier: r.i32("column type modifier")?,
                });
            }
            LogicalMessage::Relation(Arc::new(Relation { oid, namespace, name, replica_identity, columns }))
        }
        b'Y' => LogicalMessage::Type {
            oid: r.u32("Type OID")?,
            namespace: r.cstr("Type namespace")?,
            name: r.cstr("Type name")?,
        },
        b'I' => {
            let relation = r.u32("Insert relation OID")?;
            match r.u8("Insert tuple marker")? {
                b'N' => LogicalMessage::Insert { relation, new: r.tuple()? },
                m => return Err(DecodeError::UnexpectedMarker(m, "Insert")),
            }
        }
        b'U' => {
            let relation = r.u32("Update relation OID")?;
            let (mut key, mut old) = (None, None);
            let new = loop {
                match r.u8("Update tuple marker")? {
                    b'K' if key.is_none() && old.is_none() => key = Some(r.tuple()?),
                    b'O' if key.is_none() && old.is_none() => old = Some(r.tuple()?),
                    b'N' => break r.tuple()?,
                    m => return Err(DecodeError::UnexpectedMarker(m, "Update")),
                }
            };
            LogicalMessage::Update { relation, key, old, new }
        }
        b'D' => {
            let relation = r.u32("Delete relation OID")?;
            let (key, old) = match r.u8("Delete tuple marker")? {
                b'K' => (Some(r.tuple()?), None),
                b'O' => (None, Some(r.tuple()?)),
                m => return Err(DecodeError::UnexpectedMarker(m, "Delete")),
            };
            LogicalMessage::Delete { relation, key, old }
        }
        b'T' => {
            let n = r.count32("Truncate relation count", 4)?;
            let options = r.u8("Truncate options")?;
            let mut relations = Vec::with_capacity(n);
            for _ in 0..n {
                relations.push(r.u32("Truncate relation OID")?);
            }
            LogicalMessage::Truncate { options, relations }
        }
        b'M' => {
            let flags = r.u8("Message flags")?;
            let lsn = r.lsn("Message LSN")?;
            let prefix = r.cstr("Message prefix")?;
            let len = r.len32("Message content length")?;
            LogicalMessage::Message {
                transactional: flags & 1 == 1,
                lsn,
                prefix,
                content: r.bytes(len, "Message content")?,
            }
        }
        other => return Err(DecodeError::UnknownTag(other)),
    };
    match data.len() - r.pos {
        0 => Ok(msg),
        n => Err(DecodeError::Trailing(n)),
    }
}

struct Reader<'a> {
    buf: &'a Bytes,
    pos: usize,
}

impl Reader<'_> {
    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn take<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N], DecodeError> {
        let have = self.remaining();
        if have < N {
            return Err(DecodeError::Truncated { what, need: N, have });
        }
        let mut out = [0u8; N];
        out.copy_from_slice(&self.buf[self.pos..self.pos + N]);
        self.pos += N;
        Ok(out)
    }

    fn u8(&mut self, what: &'static str) -> Result<u8, DecodeError> {
        Ok(self.take::<1>(what)?[0])
    }

    fn u32(&mut self, what: &'static str) -> Result<u32, DecodeError> {
        Ok(u32::from_be_bytes(self.take(what)?))
    }

    fn i32(&mut self, what: &'static str) -> Result<i32, DecodeError> {
        Ok(i32::from_be_bytes(self.take(what)?))
    }

    fn i64(&mut self, what: &'static str) -> Result<i64, DecodeError> {
        Ok(i64::from_be_bytes(self.take(what)?))
    }

    fn lsn(&mut self, what: &'static str) -> Result<Lsn, DecodeError> {
        Ok(Lsn(u64::from_be_bytes(self.take(what)?)))
    }

    /// A non-negative Int32 length, no larger than the bytes left.
    fn len32(&mut self, what: &'static str) -> Result<usize, DecodeError> {
        let v = self.i32(what)?;
        if v < 0 {
            return Err(DecodeError::Invalid { what, value: v.into() });
        }
        let v = v as usize;
        if v > self.remaining() {
            return Err(DecodeError::Truncated { what, need: v, have: self.remaining() });
        }
        Ok(v)
    }

    /// An Int16 element count, each element at least `min_size` bytes: checked
    /// against the bytes left before the caller allocates for it.
    fn count(&mut self, what: &'static str, min_size: usize) -> Result<usize, DecodeError> {
        let v = i16::from_be_bytes(self.take(what)?);
        self.check_count(what, v.into(), min_size)
    }

    fn count32(&mut self, what: &'static str, min_size: usize) -> Result<usize, DecodeError> {
        let v = self.i32(what)?;
        self.check_count(what, v.into(), min_size)
    }

    fn check_count(&self, what: &'static str, v: i64, min_size: usize) -> Result<usize, DecodeError> {
        if v < 0 {
            return Err(DecodeError::Invalid { what, value: v });
        }
        let n = v as usize;
        if n.saturating_mul(min_size) > self.remaining() {
            return Err(DecodeError::Truncated { what, need: n.saturating_mul(min_size), have: self.remaining() });
        }
        Ok(n)
    }

    fn bytes(&mut self, len: usize, what: &'static str) -> Result<Bytes, DecodeError> {
        if len > self.remaining() {
            return Err(DecodeError::Truncated { what, need: len, have: self.remaining() });
        }
        let out = self.buf.slice(self.pos..self.pos + len);
        self.pos += len;
        Ok(out)
    }

    fn cstr(&mut self, what: &'static str) -> Result<String, DecodeError> {
        let rest = &self.buf[self.pos..];
        let end = rest.iter().position(|&b| b == 0).ok_or(DecodeError::Unterminated { what })?;
        let s = std::str::from_utf8(&rest[..end]).map_err(|_| DecodeError::NotUtf8 { what })?;
        let s = s.to_owned();
        self.pos += end + 1;
        Ok(s)
    }

    fn tuple(&mut self) -> Result<Tuple, DecodeError> {
        let n = self.count("tuple column count", 1)?;
        if n > MAX_COLUMNS {
            return Err(DecodeError::Invalid { what: "tuple column count", value: n as i64 });
        }
        let mut values = Vec::with_capacity(n);
        for _ in 0..n {
            values.push(match self.u8("tuple value kind")? {
                b'n' => TupleValue::Null,
                b'u' => TupleValue::UnchangedToast,
                b't' => {
                    let len = self.len32("text value length")?;
                    TupleValue::Text(self.bytes(len, "text value")?)
                }
                b'b' => {
                    let len = self.len32("binary value length")?;
                    TupleValue::Binary(self.bytes(len, "binary value")?)
                }
                k => return Err(DecodeError::UnknownTupleKind(k)),
            });
        }
        Ok(Tuple(values))
    }
}
