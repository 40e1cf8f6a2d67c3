//! Tables teams already have, read as outbox rows: which column gives each
//! field of an event, from a preset (Debezium's outbox convention) with
//! overrides, or named one by one.
//!
//! A mapped table is a source the stream reads; it gets no bookkeeping
//! columns. Its rows are settled like transient rows of the relay's own
//! table: published from the stream and recorded by the confirmed LSN alone;
//! a row that cannot go out now (DEAD, deferred, its lane spooling) is
//! copied into the relay's `outbox` table with its mapped fields, where the
//! table path (or `dead list`) finds it. A table with a published column
//! (`topic-payload`'s `published_at`) also has it set on each row settled,
//! and its rows with it NULL are claimed from the table too: at each
//! session's start (rows written before the slot, or left by a polling
//! relay) and, in polling mode, all the time.

use std::borrow::Cow;
use std::sync::Arc;

use crate::event::{DeliverAt, MappedRow, Origin, OutboxEvent, PublishedColumn};

/// The attribute a bytea body's message carries: the body is base64.
pub const BODY_ENCODING_ATTRIBUTE: &str = "content-transfer-encoding";

/// A preset's column names and meaning.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Preset {
    /// Debezium's outbox convention (the Outbox Event Router, the Quarkus
    /// and Spring extensions): `id uuid, aggregatetype, aggregateid, type,
    /// payload`; routed by `aggregatetype`, grouped by `aggregateid`, `type`
    /// an attribute, `id` the event id. Rows are usually inserted and
    /// deleted by one transaction.
    Debezium,
    /// The minimal polling outbox: `id bigserial, topic, payload,
    /// published_at` (NULL: not published yet); routed by `topic`, rows
    /// kept, `published_at` set once published.
    TopicPayload,
}

impl Preset {
    pub const NAMES: &'static str = "debezium, topic-payload";

    pub fn parse(s: &str) -> Option<Preset> {
        match s {
            "debezium" => Some(Preset::Debezium),
            "topic-payload" => Some(Preset::TopicPayload),
            _ => None,
        }
    }
}

/// Which column gives each field of an event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mapping {
    pub schema: String,
    pub table: String,
    /// The row's key: a delete by the row's own transaction is matched by
    /// it (it must be in the table's replica identity).
    pub id: String,
    /// The idempotency key (FIFO deduplication id), prefixed with
    /// `schema.table:` so two tables' keys never meet in the relay's table;
    /// the `id` column unless named.
    pub event_id: String,
    /// Routed by this column's value: a `[destinations]` name.
    pub destination: String,
    /// text, varchar, json or jsonb as it is; bytea as base64, with the
    /// [`BODY_ENCODING_ATTRIBUTE`] attribute.
    pub body: String,
    /// FIFO `MessageGroupId` (fair-queue group on a standard queue).
    pub group_key: Option<String>,
    /// A json or jsonb object of message attributes, as the relay's own
    /// `attributes` column takes them.
    pub attributes: Option<String>,
    /// Columns sent as String attributes named as the column.
    pub attribute_columns: Vec<String>,
    /// A timestamptz column: when the message may be delivered
    /// (`DelaySeconds`, or held in the relay's table until due).
    pub deliver_at: Option<String>,
    /// A column holding the producer's W3C `traceparent` (or Debezium's
    /// span context): sent as the `traceparent` attribute and as
    /// `AWSTraceHeader` ([`crate::publish::entry::trace_context`]).
    pub traceparent: Option<String>,
    /// Read as `traceparent` when the table has this column and
    /// `traceparent` is not set: the Debezium preset's `tracingspancontext`,
    /// which its Quarkus extension adds only when tracing is on. Settled at
    /// start-up ([`Mapping::settle_columns`]).
    pub traceparent_if_present: Option<String>,
    /// A timestamptz (or timestamp) column, NULL until the row is published:
    /// the relay sets it, sends only rows with it NULL, and claims those
    /// from the table as well as from the stream.
    pub published: Option<String>,
    /// The key column's type, as the database names it: read at start-up
    /// (so marking and the replay filter use the key's index).
    pub id_type: Option<String>,
    /// The table's oid, read at start-up: the stream names a relation by
    /// it, so the table is followed through a rename or a move to another
    /// schema, and its published column is set under its name of the day.
    pub oid: Option<u32>,
}

/// A column's value in a row as the source reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Value<'a> {
    Null,
    Text(Cow<'a, str>),
    /// Not sent: a TOASTed value an UPDATE left alone (the row's value
    /// before the update stands).
    Unchanged,
}

/// Why a row of a mapped table could not be read at all.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{table}: {what}")]
pub struct MappingError {
    pub table: String,
    pub what: String,
}

impl Mapping {
    /// `schema.table` with its key, destination and body columns named,
    /// the key the event id, and no optional field.
    pub fn of(schema: &str, table: &str, id: &str, destination: &str, body: &str) -> Mapping {
        Mapping {
            schema: schema.into(),
            table: table.into(),
            id: id.into(),
            event_id: id.into(),
            destination: destination.into(),
            body: body.into(),
            group_key: None,
            attributes: None,
            attribute_columns: vec![],
            deliver_at: None,
            traceparent: None,
            traceparent_if_present: None,
            published: None,
            id_type: None,
            oid: None,
        }
    }

    /// A preset's mapping of `schema.table`.
    pub fn preset(preset: Preset, schema: &str, table: &str) -> Mapping {
        match preset {
            Preset::Debezium => Mapping {
                group_key: Some("aggregateid".into()),
                attribute_columns: vec!["type".into()],
                traceparent_if_present: Some("tracingspancontext".into()),
                ..Mapping::of(schema, table, "id", "aggregatetype", "payload")
            },
            Preset::TopicPayload => Mapping {
                published: Some("published_at".into()),
                ..Mapping::of(schema, table, "id", "topic", "payload")
            },
        }
    }

    /// What start-up read of the table: its oid, the key's type, and
    /// whether the optional trace-context column is there.
    pub fn settle_columns(&mut self, oid: u32, id_type: String, has: impl Fn(&str) -> bool) {
        self.oid = Some(oid);
        self.id_type = Some(id_type);
        if self.traceparent.is_none() {
            self.traceparent = self.traceparent_if_present.take().filter(|c| has(c));
        }
    }

    /// The published column's place, if the table has one.
    pub fn published_column(&self) -> Option<Arc<PublishedColumn>> {
        let column = self.published.as_deref()?;
        Some(Arc::new(PublishedColumn {
            table: self.qualified(),
            oid: self.oid,
            id: quote_ident(&self.id),
            id_type: self.id_type.clone(),
            column: quote_ident(column),
        }))
    }

    /// `schema.table`, quoted for SQL.
    pub fn qualified(&self) -> String {
        format!("{}.{}", quote_ident(&self.schema), quote_ident(&self.table))
    }

    /// Whether a row cannot become an event without `column`: the key, the
    /// event id, the destination and the body. Any other column the table
    /// no longer has is read as NULL.
    pub fn requires(&self, column: &str) -> bool {
        [&self.id, &self.event_id, &self.destination, &self.body].iter().any(|c| *c == column)
    }

    /// Every column the mapping reads, each once.
    pub fn columns(&self) -> Vec<&str> {
        let mut all: Vec<&str> = vec![&self.id, &self.event_id, &self.destination, &self.body];
        all.extend(self.group_key.as_deref());
        all.extend(self.attributes.as_deref());
        all.extend(self.attribute_columns.iter().map(String::as_str));
        all.extend(self.deliver_at.as_deref());
        all.extend(self.traceparent.as_deref());
        all.extend(self.published.as_deref());
        let mut seen = std::collections::HashSet::new();
        all.retain(|c| seen.insert(*c));
        all
    }

    /// `schema.table`, as configured.
    pub fn name(&self) -> Arc<str> {
        Arc::from(format!("{}.{}", self.schema, self.table))
    }

    /// The event of a row: `col` gives a column's value by name and
    /// `bytea` whether it is a bytea column; `before`, for a row its own
    /// transaction updated, the event as inserted (for values the update
    /// did not send). A NULL destination or body makes an event that is
    /// DEAD when routed, with its reason; a row without its key is refused.
    /// `published`: the table's published column ([`Self::published_column`]).
    pub fn event<'r>(
        &self,
        col: impl Fn(&str) -> Result<Value<'r>, MappingError>,
        bytea: impl Fn(&str) -> bool,
        before: Option<&OutboxEvent>,
        commit_time_us: i64,
        published: Option<&Arc<PublishedColumn>>,
    ) -> Result<OutboxEvent, MappingError> {
        let text = |name: &str, old: Option<&str>| -> Result<Option<String>, MappingError> {
            Ok(match col(name)? {
                Value::Null => None,
                Value::Text(t) => Some(t.into_owned()),
                Value::Unchanged => old.map(str::to_owned),
            })
        };
        let id = text(&self.id, None)?.ok_or_else(|| {
            self.error(format!(
                "a row without its key column {:?} (NULL), which is its event id: make the key NOT NULL \
                 (ALTER TABLE {} ALTER COLUMN {} SET NOT NULL); this row is sent by `outbox-relay dead redrive` \
                 under the event id it has in the relay's table",
                self.id,
                self.qualified(),
                quote_ident(&self.id)
            ))
        })?;
        let key = id.clone();
        let prefixed = |key: &str| format!("{}.{}:{key}", self.schema, self.table);
        let event_id = match col(&self.event_id)? {
            Value::Text(t) => prefixed(&t),
            // The key did not change: the event's as inserted.
            Value::Unchanged if before.is_some() => before.map(|b| b.event_id.clone()).unwrap_or_default(),
            Value::Null | Value::Unchanged => prefixed(&id),
        };
        let destination = text(&self.destination, before.map(|b| b.destination.as_str()))?.unwrap_or_default();
        let body = self.body_of(&col, bytea(&self.body), before)?;
        let group_key = match &self.group_key {
            Some(c) => text(c, before.and_then(|b| b.group_key.as_deref()))?,
            None => None,
        };
        let attributes = self.attributes_json(&col, bytea(&self.body), before)?;
        let deliver_at = self.deliver_at_of(&col, before)?;
        Ok(OutboxEvent {
            event_id,
            destination,
            body,
            group_key,
            attributes,
            commit_time_us,
            deliver_at,
            replay_of: None,
            // Not in the relay's table: published from the stream, written
            // there only when it cannot go out now.
            origin: Origin::Mapped {
                row: MappedRow { table: self.name(), key, published: published.cloned(), unreadable: None },
                commit: None,
            },
        })
    }

    /// The body column's value, read once: a bytea value sent now is hex
    /// text to decode (as base64); one the update left alone is the event's
    /// body already; NULL is empty (DEAD when routed).
    fn body_of<'r>(
        &self,
        col: &impl Fn(&str) -> Result<Value<'r>, MappingError>,
        bytea: bool,
        before: Option<&OutboxEvent>,
    ) -> Result<String, MappingError> {
        Ok(match col(&self.body)? {
            Value::Null => String::new(),
            Value::Text(t) if bytea => {
                bytea_to_base64(&t).ok_or_else(|| self.error(format!("{:?} is not bytea text", self.body)))?
            }
            Value::Text(t) => t.into_owned(),
            Value::Unchanged => before.map(|b| b.body.clone()).unwrap_or_default(),
        })
    }

    /// The delivery time column's value, if the mapping has one.
    fn deliver_at_of<'r>(
        &self,
        col: &impl Fn(&str) -> Result<Value<'r>, MappingError>,
        before: Option<&OutboxEvent>,
    ) -> Result<DeliverAt, MappingError> {
        let Some(c) = &self.deliver_at else { return Ok(DeliverAt::Unset) };
        Ok(match col(c)? {
            Value::Null => DeliverAt::Unset,
            Value::Text(t) => crate::event::deliver_at(&t),
            Value::Unchanged => before.map_or(DeliverAt::Unset, |b| b.deliver_at),
        })
    }

    /// The event of a row [`Self::event`] refused with `error`: DEAD when
    /// routed, with that reason, carrying what could be read of it (its
    /// destination and body, for `dead list` and a redrive once mended).
    /// `fallback`: its key when it has none (unique to the row: its
    /// transaction's commit position and its place in it). A row without a
    /// key has no published column to set.
    pub fn unreadable<'r>(
        &self,
        col: impl Fn(&str) -> Result<Value<'r>, MappingError>,
        error: &MappingError,
        fallback: &str,
        commit_time_us: i64,
        published: Option<&Arc<PublishedColumn>>,
    ) -> OutboxEvent {
        let text = |c: &str| match col(c) {
            Ok(Value::Text(t)) => Some(t.into_owned()),
            _ => None,
        };
        let key = text(&self.id);
        let event_key = text(&self.event_id).or_else(|| key.clone()).unwrap_or_else(|| fallback.to_string());
        OutboxEvent {
            event_id: format!("{}.{}:{event_key}", self.schema, self.table),
            destination: text(&self.destination).unwrap_or_default(),
            body: text(&self.body).unwrap_or_default(),
            group_key: self.group_key.as_deref().and_then(text),
            attributes: None,
            commit_time_us,
            deliver_at: DeliverAt::Unset,
            replay_of: None,
            origin: Origin::Mapped {
                row: MappedRow {
                    table: self.name(),
                    published: key.is_some().then(|| published.cloned()).flatten(),
                    key: key.unwrap_or_else(|| fallback.to_string()),
                    unreadable: Some(error.to_string()),
                },
                commit: None,
            },
        }
    }

    /// The attributes' JSON: the attributes column's object, the attribute
    /// columns, and the body's encoding when it is bytea.
    fn attributes_json<'r>(
        &self,
        col: &impl Fn(&str) -> Result<Value<'r>, MappingError>,
        bytea_body: bool,
        before: Option<&OutboxEvent>,
    ) -> Result<Option<String>, MappingError> {
        let old: serde_json::Map<String, serde_json::Value> =
            before.and_then(|b| b.attributes.as_deref()).and_then(|j| serde_json::from_str(j).ok()).unwrap_or_default();
        let mut out = serde_json::Map::new();
        if let Some(c) = &self.attributes {
            match col(c)? {
                Value::Null => {}
                Value::Unchanged => out.extend(old.iter().map(|(k, v)| (k.clone(), v.clone()))),
                // Not an object: kept as text, so the route makes the row
                // DEAD (invalid_attributes) with what it holds.
                Value::Text(t) => match serde_json::from_str::<serde_json::Value>(&t) {
                    Ok(serde_json::Value::Object(o)) => out.extend(o),
                    _ => return Ok(Some(t.into_owned())),
                },
            }
        }
        // A column as a String attribute named `name`: an unchanged value
        // keeps the attribute as inserted.
        let mut string_attribute = |name: &str, c: &str| -> Result<(), MappingError> {
            let value = match col(c)? {
                Value::Null => None,
                Value::Text(t) => Some(serde_json::Value::String(t.into_owned())),
                Value::Unchanged => old.get(name).cloned(),
            };
            if let Some(v) = value {
                out.insert(name.to_string(), v);
            }
            Ok(())
        };
        for c in &self.attribute_columns {
            string_attribute(c, c)?;
        }
        if let Some(c) = &self.traceparent {
            trace_attributes(&mut out, col(c)?, &old);
        }
        if bytea_body {
            out.insert(BODY_ENCODING_ATTRIBUTE.into(), serde_json::Value::String("base64".into()));
        }
        Ok((!out.is_empty()).then(|| serde_json::Value::Object(out).to_string()))
    }

    fn error(&self, what: String) -> MappingError {
        MappingError { table: format!("{}.{}", self.schema, self.table), what }
    }
}

type Attributes = serde_json::Map<String, serde_json::Value>;

/// The trace-context column's value as the `traceparent` attribute, with a
/// `tracestate` when Debezium's span context holds one and the row's own
/// attributes do not ([`crate::publish::entry::trace_context`]); an unchanged value keeps both as
/// inserted, a blank one gives neither.
fn trace_attributes(out: &mut Attributes, value: Value<'_>, old: &Attributes) {
    use crate::publish::entry::{trace_context, TRACEPARENT, TRACESTATE};
    match value {
        Value::Null => {}
        Value::Unchanged => {
            for name in [TRACEPARENT, TRACESTATE] {
                if let Some(v) = old.get(name) {
                    out.insert(name.into(), v.clone());
                }
            }
        }
        // Blank: no trace (SQS takes no empty attribute).
        Value::Text(t) if t.trim().is_empty() => {}
        Value::Text(t) => {
            let (traceparent, state) = trace_context(&t);
            out.insert(TRACEPARENT.into(), traceparent.into());
            if let Some(state) = state {
                out.entry(TRACESTATE).or_insert(state.into());
            }
        }
    }
}

/// A bytea value as PostgreSQL writes it in text (`\x` and hex digits), as
/// base64.
fn bytea_to_base64(text: &str) -> Option<String> {
    use base64::Engine;
    let hex_digits = text.strip_prefix("\\x")?;
    let bytes = hex::decode(hex_digits).ok()?;
    Some(base64::engine::general_purpose::STANDARD.encode(bytes))
}

/// An identifier quoted for SQL.
pub fn quote_ident(s: &str) -> String {
    format!("\"{}\"", s.replace('"', "\"\""))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn row<'a>(cols: &'a [(&'a str, Option<&'a str>)]) -> impl Fn(&str) -> Result<Value<'a>, MappingError> + 'a {
        let m: HashMap<&str, Option<&str>> = cols.iter().copied().collect();
        move |name| {
            Ok(match m.get(name) {
                Some(Some(v)) => Value::Text(Cow::Borrowed(*v)),
                Some(None) | None => Value::Null,
            })
        }
    }

    #[test]
    fn a_debezium_row_is_routed_by_aggregatetype_and_grouped_by_aggregateid() {
        let m = Mapping::preset(Preset::Debezium, "public", "outboxevent");
        let cols = [
            ("id", Some("7f1c1d7e-0000-4000-8000-000000000001")),
            ("aggregatetype", Some("orders")),
            ("aggregateid", Some("42")),
            ("type", Some("OrderCreated")),
            ("payload", Some("{\"total\": 3}")),
        ];
        let ev = m.event(row(&cols), |_| false, None, 5, None).unwrap();
        assert_eq!(ev.event_id, "public.outboxevent:7f1c1d7e-0000-4000-8000-000000000001");
        assert_eq!(ev.destination, "orders");
        assert_eq!(ev.group_key.as_deref(), Some("42"));
        assert_eq!(ev.body, "{\"total\": 3}");
        assert_eq!(ev.attributes.as_deref(), Some("{\"type\":\"OrderCreated\"}"));
        assert!(ev.mapped().is_some_and(|m| m.key.starts_with("7f1c")) && ev.row_id().is_none());
    }

    #[test]
    fn a_bytea_body_goes_as_base64_and_says_so() {
        let m = Mapping { attribute_columns: vec![], ..Mapping::preset(Preset::Debezium, "s", "t") };
        let cols = [("id", Some("1")), ("aggregatetype", Some("d")), ("payload", Some("\\x68690a"))];
        let ev = m.event(row(&cols), |c| c == "payload", None, 0, None).unwrap();
        assert_eq!(ev.body, "aGkK");
        assert_eq!(ev.attributes.as_deref(), Some("{\"content-transfer-encoding\":\"base64\"}"));
    }

    #[test]
    fn nulls_make_an_event_the_route_refuses_and_a_missing_key_is_an_error() {
        let m = Mapping::preset(Preset::Debezium, "s", "t");
        let ev = m.event(row(&[("id", Some("1"))]), |_| false, None, 0, None).unwrap();
        assert_eq!((ev.destination.as_str(), ev.body.as_str()), ("", ""));
        assert!(m.event(row(&[("payload", Some("x"))]), |_| false, None, 0, None).is_err());
    }

    #[test]
    fn an_update_keeps_what_it_did_not_send() {
        let m = Mapping::preset(Preset::Debezium, "s", "t");
        let cols = [("id", Some("1")), ("aggregatetype", Some("d")), ("type", Some("A")), ("payload", Some("old"))];
        let before = m.event(row(&cols), |_| false, None, 0, None).unwrap();
        let unchanged_body = |name: &str| -> Result<Value<'static>, MappingError> {
            Ok(match name {
                "payload" | "type" => Value::Unchanged,
                "id" => Value::Text("1".into()),
                "aggregatetype" => Value::Text("e".into()),
                _ => Value::Null,
            })
        };
        let after = m.event(unchanged_body, |_| false, Some(&before), 0, None).unwrap();
        assert_eq!((after.destination.as_str(), after.body.as_str()), ("e", "old"));
        assert_eq!(after.attributes, before.attributes);
    }

    #[test]
    fn delay_and_trace_context_columns() {
        let m = Mapping {
            deliver_at: Some("due".into()),
            traceparent: Some("tp".into()),
            ..Mapping::preset(Preset::Debezium, "s", "t")
        };
        let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let cols = [("id", Some("1")), ("due", Some("1970-01-01 00:00:10+00")), ("tp", Some(tp))];
        let ev = m.event(row(&cols), |_| false, None, 0, None).unwrap();
        assert_eq!(ev.deliver_at, DeliverAt::At(10_000_000));
        assert!(ev.attributes.unwrap().contains(tp));
        let ev = m.event(row(&[("id", Some("1"))]), |_| false, None, 0, None).unwrap();
        assert_eq!((ev.deliver_at, ev.attributes), (DeliverAt::Unset, None));
    }

    /// Debezium's table reads `tracingspancontext` when it has the column
    /// (its Quarkus extension adds it with tracing on), and its Java
    /// properties text gives the traceparent and tracestate.
    #[test]
    fn debeziums_span_context_column_when_the_table_has_it() {
        let mut with = Mapping::preset(Preset::Debezium, "s", "t");
        with.settle_columns(1, "uuid".into(), |c| c == "tracingspancontext");
        assert_eq!(with.traceparent.as_deref(), Some("tracingspancontext"));
        assert!(with.columns().contains(&"tracingspancontext"));
        let mut without = Mapping::preset(Preset::Debezium, "s", "t");
        without.settle_columns(1, "uuid".into(), |_| false);
        assert_eq!((without.traceparent, without.id_type.as_deref()), (None, Some("uuid")));
        let mut named = Mapping { traceparent: Some("tp".into()), ..Mapping::preset(Preset::Debezium, "s", "t") };
        named.settle_columns(1, "uuid".into(), |_| true);
        assert_eq!(named.traceparent.as_deref(), Some("tp"), "a named column wins");

        let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let context = format!("#Sun Dec 06 22:00:00 UTC 2026\ntraceparent={tp}\ntracestate=rojo\\=00f067aa0ba902b7\n");
        let cols = [("id", Some("1")), ("tracingspancontext", Some(context.as_str()))];
        let attrs: serde_json::Value =
            serde_json::from_str(&with.event(row(&cols), |_| false, None, 0, None).unwrap().attributes.unwrap())
                .unwrap();
        assert_eq!(attrs["traceparent"], tp);
        assert_eq!(attrs["tracestate"], "rojo=00f067aa0ba902b7");
        let blank = [("id", Some("1")), ("tracingspancontext", Some(" "))];
        assert_eq!(with.event(row(&blank), |_| false, None, 0, None).unwrap().attributes, None);
    }

    #[test]
    fn an_attributes_column_that_is_not_an_object_is_left_for_the_route_to_refuse() {
        let m = Mapping { attributes: Some("attrs".into()), ..Mapping::preset(Preset::Debezium, "s", "t") };
        let cols = [("id", Some("1")), ("attrs", Some("[1]")), ("type", Some("A"))];
        let ev = m.event(row(&cols), |_| false, None, 0, None).unwrap();
        assert_eq!(ev.attributes.as_deref(), Some("[1]"));
    }
}
