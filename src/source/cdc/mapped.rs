//! Start-up refusals for a mapped table ([`crate::mapping`]) the stream
//! cannot read: each names the table, the column and the fix.

use tokio_postgres::Client;

use crate::db::DbError;
use crate::mapping::Mapping;

/// Types a body column may have: sent as text, or (bytea) as base64.
const BODY_TYPES: &[&str] = &["text", "character varying", "character", "json", "jsonb", "bytea"];

/// The table exists with every mapped column, the body and attributes
/// columns have types that carry them, producers' UPDATE and DELETE keep
/// working once it is published (a replica identity), and `publication`
/// carries it (`None`: polling, no publication). Returns the key column's
/// type and the table's columns ([`Mapping::settle_columns`]).
pub async fn check_mapped(
    client: &Client,
    m: &Mapping,
    publication: Option<&str>,
) -> Result<(String, Vec<String>), DbError> {
    let name = format!("{}.{}", m.schema, m.table);
    let refuse = |what: String| Err(DbError::Check(format!("mapped table {name}: {what}")));
    let Some(table) = client
        .query_opt(
            "SELECT c.oid, c.relreplident::text FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
              WHERE n.nspname = $1 AND c.relname = $2 AND c.relkind IN ('r', 'p')",
            &[&m.schema, &m.table],
        )
        .await?
    else {
        return refuse("no such table: fix `table` in [[outbox]] (schema.table), or create it".into());
    };
    let (oid, identity): (u32, String) = (table.get(0), table.get(1));
    let types = crate::db::schema::column_types(client, oid).await?;
    for c in m.columns() {
        if !types.iter().any(|(n, _)| n == c) {
            let have: Vec<&str> = types.iter().map(|(n, _)| n.as_str()).collect();
            return refuse(format!("no column {c:?} (it has {}): fix the mapping in [[outbox]]", have.join(", ")));
        }
    }
    let type_of = |c: &str| types.iter().find(|(n, _)| n == c).map(|(_, t)| t.as_str()).unwrap_or_default();
    if !BODY_TYPES.contains(&type_of(&m.body)) {
        return refuse(format!(
            "body column {:?} is {}; it must be text, varchar, json, jsonb or bytea",
            m.body,
            type_of(&m.body)
        ));
    }
    if let Some(a) = &m.attributes {
        if !["json", "jsonb"].contains(&type_of(a)) {
            return refuse(format!("attributes column {a:?} is {}; it must be json or jsonb", type_of(a)));
        }
    }
    if let Some(d) = &m.deliver_at {
        if type_of(d) != "timestamp with time zone" {
            return refuse(format!("deliver_at column {d:?} is {}; it must be timestamptz", type_of(d)));
        }
    }
    if let Some(p) = &m.published {
        if !["timestamp with time zone", "timestamp without time zone"].contains(&type_of(p)) {
            return refuse(format!("published column {p:?} is {}; it must be timestamptz or timestamp", type_of(p)));
        }
    }
    let found = (type_of(&m.id).to_string(), types.iter().map(|(n, _)| n.clone()).collect());
    let Some(publication) = publication else { return Ok(found) };
    check_identity(client, oid, &identity, &name).await?;
    let published = client
        .query_opt(
            "SELECT 1 FROM pg_publication_tables WHERE pubname = $1 AND schemaname = $2 AND tablename = $3",
            &[&publication, &m.schema, &m.table],
        )
        .await?;
    if published.is_none() {
        return refuse(format!(
            "not in publication {publication:?}: ALTER PUBLICATION {publication} ADD TABLE {}",
            m.qualified()
        ));
    }
    Ok(found)
}

/// A published table without a replica identity refuses its producers'
/// UPDATE and DELETE (Debezium's convention deletes every row it inserts):
/// refused before the user adds it to the publication.
async fn check_identity(client: &Client, oid: u32, identity: &str, name: &str) -> Result<(), DbError> {
    let keyed = match identity {
        "f" => true,
        "n" => false,
        // Default: the primary key; index: the chosen index.
        _ => client
            .query_opt(
                "SELECT 1 FROM pg_index WHERE indrelid = $1 AND (indisprimary AND $2 = 'd' OR indisreplident AND $2 = 'i')",
                &[&oid, &identity],
            )
            .await?
            .is_some(),
    };
    if keyed {
        return Ok(());
    }
    Err(DbError::Check(format!(
        "mapped table {name}: no replica identity (no primary key, or REPLICA IDENTITY NOTHING): once published, \
         its producers' UPDATE and DELETE would fail; add a primary key, or ALTER TABLE {name} REPLICA IDENTITY FULL"
    )))
}
