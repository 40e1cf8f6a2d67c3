//! Published columns owed: mapped rows settled (sent, or handed to the
//! relay's table) whose published column could not be set then, because an
//! operator took a grant back, moved the table to a schema the relay may not
//! use, or dropped the column for a while. The settler keeps their keys and
//! sets the column once it can, so a grant given back under a running relay
//! marks what was sent meanwhile (instead of leaving it to be sent again at
//! the next session's start).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_postgres::GenericClient;

use crate::event::{PublishedColumn, TableNow};

/// Keys kept at most, over every table: past it, a row stays unpublished in
/// its table, claimed (sent again) at the next session's start, as before
/// this was kept.
const MAX_KEYS: usize = 100_000;

/// How often [`Owed::pay`] tries while something is owed.
pub const RETRY_EVERY: Duration = Duration::from_secs(5);

/// The keys owed, by table.
#[derive(Debug, Default)]
pub struct Owed {
    keys: HashMap<Arc<PublishedColumn>, Vec<String>>,
    len: usize,
    tried: Option<Instant>,
}

impl Owed {
    /// Nothing owed.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// How many keys are owed.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Keep `keys` of `table` until their column can be set.
    pub fn owe(&mut self, table: &Arc<PublishedColumn>, keys: impl IntoIterator<Item = String>) {
        let room = MAX_KEYS - self.len;
        let keys: Vec<String> = keys.into_iter().collect();
        if keys.len() > room {
            tracing::warn!(table = %table.table, rows = keys.len() - room, "too many published columns owed: these rows stay unpublished in their table, sent again at the next session's start");
        }
        let kept = keys.len().min(room);
        self.len += kept;
        self.keys.entry(Arc::clone(table)).or_default().extend(keys.into_iter().take(kept));
    }

    /// Whether [`Self::pay`] is due: something is owed and [`RETRY_EVERY`]
    /// has passed since the last try.
    pub fn due(&self) -> bool {
        !self.is_empty() && self.tried.is_none_or(|t| t.elapsed() >= RETRY_EVERY)
    }

    /// Set the column of every owed row whose table allows it now; rows set
    /// already or deleted are let go. Returns the rows set.
    pub async fn pay<C: GenericClient>(&mut self, client: &C) -> Result<u64, tokio_postgres::Error> {
        self.tried = Some(Instant::now());
        let mut n = 0;
        let tables: Vec<Arc<PublishedColumn>> = self.keys.keys().cloned().collect();
        for table in tables {
            let name = match table.table_now(client).await? {
                TableNow::Ready(name) => name,
                TableNow::Refused(_) => continue,
                TableNow::Gone => {
                    self.forget(&table);
                    continue;
                }
            };
            let keys = self.keys.get(&table).map(Vec::as_slice).unwrap_or_default();
            let marked = client.query(&table.mark_sql(&name), &[&keys]).await?.len() as u64;
            tracing::info!(table = %table.table, rows = keys.len(), marked, "published column set on rows sent while it could not be");
            n += marked;
            self.forget(&table);
        }
        Ok(n)
    }

    fn forget(&mut self, table: &Arc<PublishedColumn>) {
        if let Some(keys) = self.keys.remove(table) {
            self.len -= keys.len();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(name: &str) -> Arc<PublishedColumn> {
        Arc::new(PublishedColumn {
            table: name.into(),
            oid: None,
            id: "\"id\"".into(),
            id_type: None,
            column: "\"published_at\"".into(),
        })
    }

    #[test]
    fn keys_are_kept_up_to_the_bound_over_every_table() {
        let mut owed = Owed::default();
        assert!(owed.is_empty() && !owed.due());
        owed.owe(&table("a"), (0..MAX_KEYS - 10).map(|i| i.to_string()));
        owed.owe(&table("b"), (0..25).map(|i| i.to_string()));
        assert_eq!(owed.len(), MAX_KEYS);
        assert_eq!(owed.keys[&table("b")].len(), 10);
        assert!(owed.due());
        owed.forget(&table("a"));
        assert_eq!(owed.len(), 10);
    }
}
