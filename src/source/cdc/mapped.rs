//! Start-up refusals for a mapped table ([`crate::mapping`]) the stream
//! cannot read: each names the table, the column and the fix.

use tokio_postgres::Client;

use crate::db::DbError;
use crate::mapping::Mapping;

/// Types a body column may have: sent as text, or (bytea) as base64.
const BODY_TYPES: &[&str] = &["text", "character varying", "character", "json", "jsonb", "bytea"];

/// What start-up read of a mapped table ([`Mapping::settle_columns`]).
#[derive(Debug, Clone)]
pub struct Found {
    pub oid: u32,
    /// The key column's type.
    pub id_type: String,
    /// Every column of the table.
    pub columns: Vec<String>,
}

/// The table exists with every mapped column, the body and attributes
/// columns have types that carry them, its key cannot be NULL, the role has
/// the privileges the relay uses on it, producers' UPDATE and DELETE keep
/// working once it is published (a replica identity), and `publication`
/// carries it (`None`: polling, no publication), a partitioned table by its
/// root. Its oid is then recorded for the next start.
///
/// A grant missing on a table an earlier start accepted (it was taken back
/// since) is logged, not refused: the stream still carries its rows, what
/// the grant allows waits for it ([`Standing`] names it to the running
/// relay's watch and `status`), and every other source keeps flowing. A
/// relay restarted under a revoke must not stop them all.
pub async fn check_mapped(client: &Client, m: &Mapping, publication: Option<&str>) -> Result<Found, DbError> {
    let table = locate(client, m, Reading::StartUp).await?;
    let (oid, known) = table.as_ref().map_or((0, false), |t| (t.oid, t.known));
    let grants = if known { Grants::Tolerate } else { Grants::Refuse };
    let found = check_located(client, m, table, publication, grants).await?;
    remember(client, &format!("{}.{}", m.schema, m.table), oid).await;
    Ok(found)
}

/// What stands in a mapped table's way now, as start-up would judge it
/// (without recording anything): for `status` and the running relay's
/// watch. `now`: its name of the day when it is not the configured one.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Standing {
    /// Schema and name.
    pub now: Option<(String, String)>,
    /// The refusal start-up would give (dropped, a column gone, a key that
    /// may be NULL, a grant missing, out of the publication).
    pub trouble: Option<String>,
}

/// [`Standing`] of `m`.
pub async fn standing(client: &Client, m: &Mapping, publication: Option<&str>) -> Result<Standing, DbError> {
    let table = locate(client, m, Reading::Standing).await?;
    let now = table
        .as_ref()
        .map(|t| (t.schema.clone(), t.name.clone()))
        .filter(|(schema, name)| *schema != m.schema || *name != m.table);
    match check_located(client, m, table, publication, Grants::Refuse).await {
        Ok(_) => Ok(Standing { now, trouble: None }),
        Err(DbError::Check(why)) => Ok(Standing { now, trouble: Some(why) }),
        Err(e) => Err(e),
    }
}

/// Whether [`locate`] is start-up's (it says when it follows a rename, and
/// reads whether an earlier start accepted the table).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Reading {
    StartUp,
    Standing,
}

/// What a missing grant does ([`check_mapped`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Grants {
    Refuse,
    /// Logged: the table was accepted before, the grant taken back since.
    Tolerate,
}

/// [`check_mapped`] of the table [`locate`] found for `m` (`None`: none).
async fn check_located(
    client: &Client,
    m: &Mapping,
    table: Option<Located>,
    publication: Option<&str>,
    grants: Grants,
) -> Result<Found, DbError> {
    let Some(table) = table else {
        return Err(DbError::Check(format!(
            "mapped table {}.{}: no such table (dropped, or renamed before a relay first started with it): fix \
             `table` in [[outbox]] (schema.table), or create it",
            m.schema, m.table
        )));
    };
    // Checked under its name of the day (renamed since the last start).
    let m = &Mapping { schema: table.schema.clone(), table: table.name.clone(), ..m.clone() };
    let name = format!("{}.{}", m.schema, m.table);
    let types = crate::db::schema::column_types(client, table.oid).await?;
    check_types(m, &types).map_err(|what| DbError::Check(format!("mapped table {name}: {what}")))?;
    check_key(client, table.oid, m, &name).await?;
    match check_grants(client, table.oid, m, &name).await {
        Err(DbError::Check(why)) if grants == Grants::Tolerate => tracing::error!(
            "{why} (taken back since an earlier start: the table's rows are still read; what the grant allows \
             waits for it, and the other sources keep flowing)"
        ),
        r => r?,
    }
    let id_type = types.iter().find(|(n, _)| *n == m.id).map(|(_, t)| t.clone()).unwrap_or_default();
    let found = Found { oid: table.oid, id_type, columns: types.into_iter().map(|(n, _)| n).collect() };
    let Some(publication) = publication else { return Ok(found) };
    check_identity(client, table.oid, &table.identity, &name).await?;
    check_published(client, m, (table.oid, table.partitioned), publication).await?;
    Ok(found)
}

/// A mapped table as the catalog has it now.
struct Located {
    oid: u32,
    schema: String,
    name: String,
    /// `relreplident`.
    identity: String,
    partitioned: bool,
    /// An earlier start accepted it under the configured name (start-up's
    /// [`locate`] only).
    known: bool,
}

/// The table `m` names, or, if there is none by that name, the one an
/// earlier start found under it and that has been renamed or moved since
/// (by its oid, recorded in `outbox_relay_sources`): followed, with a
/// warning naming it. Start-up's reading says whether an earlier start
/// accepted the table ([`Located::known`]).
async fn locate(client: &Client, m: &Mapping, reading: Reading) -> Result<Option<Located>, DbError> {
    const BY: &str = "SELECT c.oid, n.nspname::text, c.relname::text, c.relreplident::text, c.relkind = 'p'
                        FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.relkind IN ('r', 'p')";
    let located = |r: tokio_postgres::Row| Located {
        oid: r.get(0),
        schema: r.get(1),
        name: r.get(2),
        identity: r.get(3),
        partitioned: r.get(4),
        known: false,
    };
    let configured = format!("{}.{}", m.schema, m.table);
    let by_name =
        client.query_opt(&format!("{BY} AND n.nspname = $1 AND c.relname = $2"), &[&m.schema, &m.table]).await?;
    let remembered = client.query_one("SELECT to_regclass('outbox_relay_sources') IS NOT NULL", &[]).await?.get(0);
    if let Some(mut found) = by_name.map(located) {
        if remembered && reading == Reading::StartUp {
            // A role that may not read the record (see [`remember`]): not known.
            let known = "SELECT EXISTS (SELECT 1 FROM outbox_relay_sources WHERE name = $1 AND relid = $2)";
            found.known = match client.query_one(known, &[&configured, &found.oid]).await {
                Ok(row) => row.get(0),
                Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::INSUFFICIENT_PRIVILEGE) => false,
                Err(e) => return Err(e.into()),
            };
        }
        return Ok(Some(found));
    }
    if !remembered {
        return Ok(None);
    }
    let sql = format!("{BY} AND c.oid = (SELECT relid FROM outbox_relay_sources WHERE name = $1)");
    let Some(mut found) = client.query_opt(&sql, &[&configured]).await?.map(located) else { return Ok(None) };
    if reading == Reading::Standing {
        return Ok(Some(found));
    }
    found.known = true;
    tracing::warn!(
        table = %configured, now = %format!("{}.{}", found.schema, found.name), oid = found.oid,
        "mapped table renamed or moved since the last start: followed by its oid; set `table` in [[outbox]] to its new name"
    );
    Ok(Some(found))
}

/// Record `oid` as the table configured as `name`. A role that may not
/// write the record (granted before migration 14) only loses the following
/// of a rename across a restart: said, not refused.
async fn remember(client: &Client, name: &str, oid: u32) {
    let upsert = "INSERT INTO outbox_relay_sources (name, relid) VALUES ($1, $2)
                  ON CONFLICT (name) DO UPDATE SET relid = EXCLUDED.relid, seen_at = now()
                  WHERE outbox_relay_sources.relid IS DISTINCT FROM EXCLUDED.relid";
    let Err(e) = client.execute(upsert, &[&name, &oid]).await else { return };
    if e.code() == Some(&tokio_postgres::error::SqlState::UNDEFINED_TABLE) {
        return; // before migration 14
    }
    let fix = if e.code() == Some(&tokio_postgres::error::SqlState::INSUFFICIENT_PRIVILEGE) {
        " (GRANT SELECT, INSERT, UPDATE ON outbox_relay_sources to the relay's role)"
    } else {
        ""
    };
    tracing::warn!(
        table = name, error = %crate::db::describe(&e),
        "cannot record the mapped table's oid: a rename is followed while the relay runs, not across a restart{fix}"
    );
}

/// Every mapped column is there, with a type that carries what it gives.
fn check_types(m: &Mapping, types: &[(String, String)]) -> Result<(), String> {
    for c in m.columns() {
        if !types.iter().any(|(n, _)| n == c) {
            let have: Vec<&str> = types.iter().map(|(n, _)| n.as_str()).collect();
            return Err(format!("no column {c:?} (it has {}): fix the mapping in [[outbox]]", have.join(", ")));
        }
    }
    let type_of = |c: &str| types.iter().find(|(n, _)| n == c).map(|(_, t)| t.as_str()).unwrap_or_default();
    if !BODY_TYPES.contains(&type_of(&m.body)) {
        return Err(format!(
            "body column {:?} is {}; it must be text, varchar, json, jsonb or bytea",
            m.body,
            type_of(&m.body)
        ));
    }
    if let Some(a) = &m.attributes {
        if !["json", "jsonb"].contains(&type_of(a)) {
            return Err(format!("attributes column {a:?} is {}; it must be json or jsonb", type_of(a)));
        }
    }
    if let Some(d) = &m.deliver_at {
        if type_of(d) != "timestamp with time zone" {
            return Err(format!("deliver_at column {d:?} is {}; it must be timestamptz", type_of(d)));
        }
    }
    if let Some(p) = &m.published {
        if !["timestamp with time zone", "timestamp without time zone"].contains(&type_of(p)) {
            return Err(format!("published column {p:?} is {}; it must be timestamptz or timestamp", type_of(p)));
        }
    }
    Ok(())
}

/// The key is a row's event id (unless another column is named) and how
/// its own transaction's UPDATE or DELETE is matched: a key that may be
/// NULL leaves a row nothing to be known by. A primary key is never NULL.
async fn check_key(client: &Client, oid: u32, m: &Mapping, name: &str) -> Result<(), DbError> {
    let not_null: bool = client
        .query_one("SELECT attnotnull FROM pg_attribute WHERE attrelid = $1 AND attname = $2", &[&oid, &m.id])
        .await?
        .get(0);
    if not_null {
        return Ok(());
    }
    Err(DbError::Check(format!(
        "mapped table {name}: its key column {:?} may be NULL, and a row without a key has no event id to be deduplicated by: ALTER TABLE {} ALTER COLUMN {} SET NOT NULL (or make it the primary key)",
        m.id,
        m.qualified(),
        crate::mapping::quote_ident(&m.id)
    )))
}

/// What the relay does to a mapped table with a published column (claims
/// its unpublished rows, sets the column) needs USAGE on its schema, SELECT
/// on the mapped columns and UPDATE of the published column; a table
/// without one is read from the stream alone and needs nothing. Each
/// missing privilege is named with its GRANT.
async fn check_grants(client: &Client, oid: u32, m: &Mapping, name: &str) -> Result<(), DbError> {
    let Some(published) = m.published.as_deref() else { return Ok(()) };
    let user: String = client.query_one("SELECT current_user::text", &[]).await?.get(0);
    let role = crate::mapping::quote_ident(&user);
    let usage: bool = client.query_one("SELECT has_schema_privilege($1::text, 'USAGE')", &[&m.schema]).await?.get(0);
    if !usage {
        return Err(DbError::Check(format!(
            "mapped table {name}: role {user:?} lacks USAGE on schema {:?}, which claiming its unpublished rows needs: \
             GRANT USAGE ON SCHEMA {} TO {role}",
            m.schema,
            crate::mapping::quote_ident(&m.schema)
        )));
    }
    let mut needed: Vec<(&str, &str)> = m.columns().into_iter().map(|c| (c, "SELECT")).collect();
    needed.push((published, "UPDATE"));
    for (column, privilege) in needed {
        let ok: bool = client
            .query_one("SELECT has_column_privilege($1::oid, $2::text, $3::text)", &[&oid, &column, &privilege])
            .await?
            .get(0);
        if !ok {
            let what =
                if privilege == "UPDATE" { "setting its published column" } else { "claiming its unpublished rows" };
            return Err(DbError::Check(format!(
                "mapped table {name}: role {user:?} lacks {privilege} on column {column:?}, which {what} needs: \
                 GRANT {privilege} ({}) ON {} TO {role}",
                crate::mapping::quote_ident(column),
                m.qualified()
            )));
        }
    }
    Ok(())
}

/// `publication` carries the table. A partitioned table's rows reach the
/// stream under its own name only if the publication publishes via the
/// partition root (otherwise under each partition's, which the relay does
/// not map, and a partition made later would not be named in the mapping).
async fn check_published(
    client: &Client,
    m: &Mapping,
    (oid, partitioned): (u32, bool),
    publication: &str,
) -> Result<(), DbError> {
    let name = format!("{}.{}", m.schema, m.table);
    if partitioned {
        let via_root: bool =
            client.query_one("SELECT pubviaroot FROM pg_publication WHERE pubname = $1", &[&publication]).await?.get(0);
        if !via_root {
            return Err(DbError::Check(format!(
                "mapped table {name} is partitioned, and publication {publication:?} publishes its rows under each \
                 partition's name: ALTER PUBLICATION {} SET (publish_via_partition_root = true)",
                crate::mapping::quote_ident(publication)
            )));
        }
    }
    // By its oid, in one statement: renamed or moved meanwhile, it is the
    // same table.
    let published = client
        .query_opt(
            "SELECT 1 FROM pg_publication_tables t JOIN pg_namespace n ON n.nspname = t.schemaname
               JOIN pg_class c ON c.relnamespace = n.oid AND c.relname = t.tablename
              WHERE t.pubname = $1 AND c.oid = $2",
            &[&publication, &oid],
        )
        .await?;
    if published.is_none() {
        return Err(DbError::Check(format!(
            "mapped table {name}: not in publication {publication:?}: ALTER PUBLICATION {publication} ADD TABLE {}",
            m.qualified()
        )));
    }
    Ok(())
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
