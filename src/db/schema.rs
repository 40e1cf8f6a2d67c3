//! The relay's side of the schema: the migrations (their home is the
//! `outbox-schema` crate, `migrations/`), the start-up checks that the tables
//! exist with the privileges the role needs, and the row status.

use tokio_postgres::Client;

use super::DbError;

/// An outbox row's `status` column.
///
/// The SQL of the relay spells these values as literals (`status = 'NEW'`),
/// not as parameters: the partial indexes (`... WHERE status = 'NEW'`) serve
/// only a statement whose predicate names the same literal. A test checks
/// that every such literal in `src/` is one of these.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RowStatus {
    /// Not settled yet: streamed, or waiting in the table (`next_attempt_at`).
    New,
    /// Published and kept (`published_rows = keep`).
    Published,
    /// Will not be sent: `last_error` says why; `dead redrive` makes it NEW.
    Dead,
}

impl RowStatus {
    pub const ALL: [RowStatus; 3] = [RowStatus::New, RowStatus::Published, RowStatus::Dead];

    /// The column's text.
    pub const fn as_str(self) -> &'static str {
        match self {
            RowStatus::New => "NEW",
            RowStatus::Published => "PUBLISHED",
            RowStatus::Dead => "DEAD",
        }
    }

    pub fn parse(s: &str) -> Option<RowStatus> {
        RowStatus::ALL.into_iter().find(|v| v.as_str() == s)
    }
}

impl std::fmt::Display for RowStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Every migration, relay's and consumer's, in order ([`outbox_schema::ALL`]).
pub use outbox_schema::{Migration, ALL as MIGRATIONS};

/// Apply the migrations not applied yet, under an advisory lock so concurrent
/// deploys do not race. Returns the versions applied now.
pub async fn migrate(client: &mut Client) -> Result<Vec<i32>, DbError> {
    Ok(outbox_schema::apply(client, MIGRATIONS).await?)
}

/// The migrations `migrate` would apply now, in order, with their SQL;
/// nothing is written (`migrate --dry-run`).
pub async fn pending(client: &Client) -> Result<Vec<&'static Migration>, DbError> {
    Ok(outbox_schema::pending(client).await?)
}

/// The outbox table exists (every mode needs it).
pub async fn check_outbox_table(client: &Client) -> Result<(), DbError> {
    let outbox = client.query_opt("SELECT to_regclass('outbox')::text", &[]).await?;
    if outbox.and_then(|r| r.get::<_, Option<String>>(0)).is_none() {
        return Err(DbError::Check(
            "the outbox table does not exist in this database: run `outbox-relay migrate --database-url ...` first"
                .into(),
        ));
    }
    check_outbox_columns(client).await?;
    let row = client
        .query_one(
            "SELECT current_user::text, has_table_privilege('outbox', 'SELECT'), has_table_privilege('outbox', 'UPDATE')",
            &[],
        )
        .await?;
    let (user, select, update): (String, bool, bool) = (row.get(0), row.get(1), row.get(2));
    let missing: Vec<&str> =
        [("SELECT", select), ("UPDATE", update)].iter().filter(|(_, ok)| !ok).map(|(p, _)| *p).collect();
    if !missing.is_empty() {
        return Err(DbError::Check(format!(
            "role {user:?} lacks {} on the outbox table: GRANT {} ON outbox TO {user}",
            missing.join(" and "),
            missing.join(", ")
        )));
    }
    Ok(())
}

/// The columns later migrations added to the outbox, with the migration
/// that adds each.
const LATER_COLUMNS: [(&str, i32); 4] = [("deliver_at", 11), ("commit_lsn", 13), ("commit_seq", 13), ("replay_of", 15)];

/// Every column the relay reads or writes is there: a table migrated by an
/// older relay is named with the migration to run, not met by a failing
/// statement mid-run.
async fn check_outbox_columns(client: &Client) -> Result<(), DbError> {
    let names: Vec<&str> = LATER_COLUMNS.iter().map(|(c, _)| *c).collect();
    let present: Vec<String> = client
        .query(
            "SELECT attname::text FROM pg_attribute
              WHERE attrelid = 'outbox'::regclass AND attname = ANY($1) AND NOT attisdropped",
            &[&names],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    match LATER_COLUMNS.iter().find(|(c, _)| !present.iter().any(|p| p == c)) {
        None => Ok(()),
        Some((column, version)) => Err(DbError::Check(format!(
            "the outbox table has no column {column}: run `outbox-relay migrate --database-url ...` (migration {version})"
        ))),
    }
}

/// A new slot's hand-off is recorded in `outbox_relay_handoffs` while it runs
/// (CDC mode): the table and the role's SELECT, INSERT and DELETE on it.
pub async fn check_handoffs(client: &Client) -> Result<(), DbError> {
    let exists: bool = client.query_one("SELECT to_regclass('outbox_relay_handoffs') IS NOT NULL", &[]).await?.get(0);
    if !exists {
        return Err(DbError::Check(
            "the table outbox_relay_handoffs does not exist: run `outbox-relay migrate --database-url ...` (migration 9)"
                .into(),
        ));
    }
    let user: String = client.query_one("SELECT current_user::text", &[]).await?.get(0);
    for privilege in ["SELECT", "INSERT", "DELETE"] {
        let ok: bool =
            client.query_one("SELECT has_table_privilege('outbox_relay_handoffs', $1)", &[&privilege]).await?.get(0);
        if !ok {
            return Err(DbError::Check(format!(
                "role {user:?} lacks {privilege} on outbox_relay_handoffs, where a new slot's hand-off is recorded: GRANT SELECT, INSERT, DELETE ON outbox_relay_handoffs TO {user}"
            )));
        }
    }
    Ok(())
}

/// Whether the current role may DELETE from the outbox (the retention sweeper).
pub async fn can_delete_outbox(client: &Client) -> Result<bool, DbError> {
    Ok(client.query_one("SELECT has_table_privilege('outbox', 'DELETE')", &[]).await?.get(0))
}

/// Each column's name and type.
pub async fn column_types(client: &tokio_postgres::Client, oid: u32) -> Result<Vec<(String, String)>, super::DbError> {
    let rows = client
        .query(
            "SELECT attname::text, format_type(atttypid, NULL) FROM pg_attribute
              WHERE attrelid = $1 AND attnum > 0 AND NOT attisdropped ORDER BY attnum",
            &[&oid],
        )
        .await?;
    Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
}

#[cfg(test)]
mod row_status_tests {
    use super::RowStatus;

    /// The quoted values a statement compares `status` with, in `text`:
    /// `status = 'X'`, `status <> 'X'`, `status IN ('X', 'Y')`.
    fn status_literals(text: &str) -> Vec<&str> {
        let mut found = Vec::new();
        for (i, _) in text.match_indices("status ") {
            // `wal_status` and the like are other columns.
            if text[..i].ends_with(|c: char| c.is_alphanumeric() || c == '_') {
                continue;
            }
            let rest = text[i + "status ".len()..].trim_start_matches(['=', '<', '>', ' ']);
            let list = match rest.strip_prefix("IN (") {
                Some(inner) => &inner[..inner.find(')').unwrap_or(0)],
                None if rest.starts_with('\'') => rest.get(..rest[1..].find('\'').map_or(0, |e| e + 2)).unwrap_or(""),
                None => continue,
            };
            found.extend(list.split(',').map(|v| v.trim().trim_matches('\'')));
        }
        found
    }

    /// Every status the relay's SQL (its code before the tests, and the
    /// outbox's migrations) compares with is a [`RowStatus`].
    #[test]
    fn every_status_literal_in_the_sql_is_a_row_status() {
        let mut texts: Vec<(String, String)> = outbox_schema::of(outbox_schema::Part::Relay)
            .map(|m| (format!("migration {}", m.version), m.sql.to_string()))
            .collect();
        let mut stack = vec![std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src")];
        while let Some(dir) = stack.pop() {
            for entry in std::fs::read_dir(&dir).unwrap() {
                let path = entry.unwrap().path();
                if path.is_dir() {
                    stack.push(path);
                } else {
                    let text = std::fs::read_to_string(&path).unwrap();
                    let code = text.split("#[cfg(test)]").next().unwrap().to_string();
                    texts.push((path.display().to_string(), code));
                }
            }
        }
        let mut seen = 0;
        for (name, text) in &texts {
            for value in status_literals(text) {
                assert!(RowStatus::parse(value).is_some(), "{name}: status '{value}'");
                seen += 1;
            }
        }
        assert!(seen > 20, "found only {seen} status literals: the scan is broken");
    }

    #[test]
    fn finds_each_form() {
        assert_eq!(status_literals("WHERE status = 'NEW' AND x"), ["NEW"]);
        assert_eq!(status_literals("status <> 'DEAD')"), ["DEAD"]);
        assert_eq!(status_literals("status IN ('NEW', 'DEAD') GROUP"), ["NEW", "DEAD"]);
        assert!(status_literals("status = $1").is_empty());
        assert!(status_literals("wal_status = 'lost'").is_empty());
    }

    #[test]
    fn parses_what_it_writes() {
        for v in RowStatus::ALL {
            assert_eq!(RowStatus::parse(v.as_str()), Some(v));
        }
        assert_eq!(RowStatus::parse("new"), None);
    }
}
