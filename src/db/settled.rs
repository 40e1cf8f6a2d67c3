//! Whether a row of the relay's table is settled, and who holds it until it
//! is: the one rule that the stream's replay filter, the hand-offs to the
//! table path (a new slot's, a held stream's), settlement and the table
//! path's claims all read, with the statements that write it and read it
//! back. A column or status change is made here, or nowhere.
//!
//! - Two columns say who holds a row that is there ([`Holder`]): `status`
//!   and `next_attempt_at`.
//! - A row settlement deleted (`published_rows = "delete"`) is settled when
//!   a run of published ids proves it ([`PROVEN_BY_RUN`]): ids can be
//!   reused, so covering the id is not enough.
//! - A row in the table path's care carries its commit position
//!   (`commit_lsn`, `commit_seq`) where the stream knew it: a FIFO claim
//!   sends by it ([`COMMIT_ORDER`]).

use std::collections::HashSet;

use replication::Lsn;
use tokio_postgres::{Client, GenericClient};

use super::schema::RowStatus;

/// Who holds a row of the relay's table, as its columns say.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Holder {
    /// NEW, `next_attempt_at` NULL: not handed to anyone yet. The stream
    /// sends it (CDC); the poller claims it (polling).
    Stream,
    /// NEW, `next_attempt_at` set: the table path's (deferred, spooled,
    /// handed over by a slot or a held stream, a redrive). The stream skips
    /// it, and its replay filter counts it as settled.
    Table,
    /// PUBLISHED or DEAD: settled.
    Settled,
}

impl Holder {
    /// A row's holder by its `status` and whether `next_attempt_at` is set
    /// (the decoder's reading of a tuple). A status the relay does not
    /// know is not the stream's to send.
    pub fn of(status: Option<&str>, next_attempt_set: bool) -> Holder {
        match status.map(RowStatus::parse) {
            Some(Some(RowStatus::New)) | None if next_attempt_set => Holder::Table,
            Some(Some(RowStatus::New)) | None => Holder::Stream,
            Some(_) => Holder::Settled,
        }
    }

    /// The same, as an SQL condition over the row `row` (an alias with its
    /// dot, `"o."`, or `""`). The status is a literal: the partial indexes
    /// serve only statements that name it.
    pub fn sql(self, row: &str) -> String {
        let new = new_literal();
        match self {
            Holder::Stream => format!("{row}status = {new} AND {row}next_attempt_at IS NULL"),
            Holder::Table => format!("{row}status = {new} AND {row}next_attempt_at IS NOT NULL"),
            Holder::Settled => format!("{row}status <> {new}"),
        }
    }
}

/// Not settled: the stream's or the table path's.
pub fn unsettled_sql(row: &str) -> String {
    format!("{row}status = {}", new_literal())
}

/// `'NEW'`, quoted, from [`RowStatus`].
fn new_literal() -> String {
    format!("'{}'", RowStatus::New.as_str())
}

/// The order a FIFO claim sends rows with a commit position in: by it,
/// their place in their transaction, then id.
pub const COMMIT_ORDER: &str = "commit_lsn, commit_seq, id";

/// When a run of published ids (`r`) proves that the row with id `$id` and
/// event id `$event_id`, committed at `$commit`, was published: the run was
/// written after that commit, covers the id, and either its rows' commit
/// positions (stream rows) span the row's commit or it lists the event id
/// (rows the table path published: their commit is unknown). Covering the id
/// is not enough: the id may have been given to another row since (an
/// identity reset, or a row deleted and its id reused) and that row
/// published.
pub const PROVEN_BY_RUN: &str = "int8range(r.lo, r.hi, '[]') @> $id AND r.lsn > $commit
     AND ((r.commit_lo <= $commit AND r.commit_hi >= $commit) OR $event_id = ANY(r.event_ids))";

/// Settlement's record of the rows a statement deleted as published (the
/// CTE `deleted`, with `id`, `event_id` and the stream's `commit`, NULL for
/// rows the table path read): runs of consecutive ids with the range of
/// their commit positions, or, when a run has rows without one, its event
/// ids ([`PROVEN_BY_RUN`] reads them back).
pub fn record_runs(deleted: &str) -> String {
    format!(
        "INSERT INTO outbox_published_runs (lo, hi, commit_lo, commit_hi, event_ids)
         SELECT min(id), max(id),
                CASE WHEN bool_and(commit IS NOT NULL) THEN min(commit) END,
                CASE WHEN bool_and(commit IS NOT NULL) THEN max(commit) END,
                CASE WHEN NOT bool_and(commit IS NOT NULL) THEN array_agg(event_id ORDER BY id) END
           FROM (SELECT id, commit, event_id, id - row_number() OVER (ORDER BY id) AS g FROM {deleted}) r
          GROUP BY g RETURNING lo"
    )
}

/// Of the given (id, commit position, event id), the event ids a run proves
/// published ([`PROVEN_BY_RUN`]). A row read from the table has no commit
/// position and nothing proves it.
pub async fn proven_published<C: GenericClient>(
    c: &C,
    ids: &[Option<i64>],
    commits: &[Option<String>],
    event_ids: &[&str],
) -> Result<HashSet<String>, tokio_postgres::Error> {
    static SQL: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
        format!(
            "SELECT u.event_id FROM unnest($1::bigint[], $2::text[], $3::text[]) AS u(id, lsn, event_id)
              WHERE EXISTS (SELECT 1 FROM outbox_published_runs r WHERE {})",
            PROVEN_BY_RUN.replace("$id", "u.id").replace("$commit", "u.lsn::pg_lsn").replace("$event_id", "u.event_id")
        )
    });
    Ok(c.query(SQL.as_str(), &[&ids, &commits, &event_ids]).await?.iter().map(|r| r.get(0)).collect())
}

/// A row of a chunk the stream brings again (a replay) as the table tells
/// it: what [`replayed`] reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Replayed {
    /// A run whose commit positions span the chunk's commit: every id from
    /// `lo` to `hi` was published.
    Run { lo: i64, hi: i64 },
    /// A run of the table path (no commit positions): the ids from `lo` to
    /// `hi` whose event id it lists were published.
    Listed { lo: i64, hi: i64, event_ids: Vec<String> },
    /// The row is there and not the stream's any more ([`Holder::Table`] or
    /// [`Holder::Settled`]); `unpositioned`: in the table path's care with
    /// no commit position, or one before the chunk's ([`position_replayed`]).
    Row { id: i64, event_id: String, unpositioned: bool },
}

/// Of a replayed chunk's ids (`ids`, from `lo` to `hi`, all committed at
/// `commit`; `None`: read from the table), what says each was settled
/// before. One statement of two index scans: the runs overlapping that
/// range that may prove them (GiST on the id range), and the rows still in
/// the table that are no longer the stream's. Which ids the runs cover is
/// worked out by [`covered`]: a probe per id into the runs cost a backlog
/// drain more than the settlement itself.
pub async fn replayed(c: &Client, ids: &[i64], commit: Option<Lsn>) -> Result<Vec<Replayed>, tokio_postgres::Error> {
    let (Some(&lo), Some(&hi)) = (ids.iter().min(), ids.iter().max()) else { return Ok(Vec::new()) };
    static SQL: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
        format!(
            "SELECT false, lo, hi, NULL::text, CASE WHEN commit_lo <= $4::text::pg_lsn AND commit_hi >= $4::text::pg_lsn
                                              THEN NULL ELSE event_ids END, false
               FROM outbox_published_runs r
              WHERE int8range(lo, hi, '[]') && int8range($2, $3, '[]') AND lsn > $4::text::pg_lsn
                AND ((commit_lo <= $4::text::pg_lsn AND commit_hi >= $4::text::pg_lsn) OR event_ids IS NOT NULL)
             UNION ALL
             SELECT true, id, id, event_id, NULL,
                    {table} AND (commit_lsn IS NULL OR commit_lsn < $4::text::pg_lsn)
               FROM outbox WHERE id = ANY($1) AND NOT ({stream})",
            table = Holder::Table.sql(""),
            stream = Holder::Stream.sql(""),
        )
    });
    // Read from the table, nothing is later than its commit: only the rows
    // in the table can say.
    let at = commit.map_or_else(|| "FFFFFFFF/FFFFFFFF".to_string(), |l| l.to_string());
    let rows = c.query(SQL.as_str(), &[&ids, &lo, &hi, &at]).await?;
    Ok(rows
        .iter()
        .map(|r| {
            let (in_table, lo, hi): (bool, i64, i64) = (r.get(0), r.get(1), r.get(2));
            match (in_table, r.get::<_, Option<Vec<String>>>(4)) {
                (true, _) => Replayed::Row { id: lo, event_id: r.get(3), unpositioned: r.get(5) },
                (false, Some(event_ids)) => Replayed::Listed { lo, hi, event_ids },
                (false, None) => Replayed::Run { lo, hi },
            }
        })
        .collect())
}

/// Of `ids`, those settled: in `marked` (rows found settled one by one) or
/// covered by one of `runs` (inclusive id ranges settlement deleted; they
/// may overlap).
pub fn covered(ids: &[i64], mut runs: Vec<(i64, i64)>, marked: HashSet<i64>) -> HashSet<i64> {
    runs.sort_unstable();
    // The furthest end among runs starting at or before each run's start.
    let reach: Vec<i64> = runs
        .iter()
        .scan(i64::MIN, |far, r| {
            *far = (*far).max(r.1);
            Some(*far)
        })
        .collect();
    let covers = |id: i64| {
        let i = runs.partition_point(|r| r.0 <= id);
        i > 0 && reach[i - 1] >= id
    };
    ids.iter().copied().filter(|id| marked.contains(id) || covers(*id)).collect()
}

/// Rows in the table path's care that the stream meets again (`rows`: id,
/// event id, place in the transaction) get its commit position `at`, exact
/// where the one they had was a bound (a slot's hand-off) or missing (rows
/// the poller retried before the slot): a FIFO claim orders by it.
pub async fn position_replayed(
    c: &Client,
    rows: &[(i64, &str, Option<i32>)],
    at: Lsn,
) -> Result<u64, tokio_postgres::Error> {
    static SQL: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
        format!(
            "UPDATE outbox o SET commit_lsn = $3::text::pg_lsn, commit_seq = u.seq
               FROM unnest($1::bigint[], $2::text[], $4::int4[]) AS u(id, event_id, seq)
              WHERE o.id = u.id AND o.event_id = u.event_id AND {}
                AND (o.commit_lsn IS NULL OR o.commit_lsn < $3::text::pg_lsn)",
            Holder::Table.sql("o.")
        )
    });
    let ids: Vec<i64> = rows.iter().map(|r| r.0).collect();
    let event_ids: Vec<&str> = rows.iter().map(|r| r.1).collect();
    let seqs: Vec<Option<i32>> = rows.iter().map(|r| r.2).collect();
    c.execute(SQL.as_str(), &[&ids, &event_ids, &at.to_string(), &seqs]).await
}

/// Which rows [`position_handed`] gives a position.
pub enum PositionRows<'a> {
    Ids(&'a [i64]),
    /// Every row of these destinations (all: `None`).
    Destinations(Option<&'a [String]>),
}

/// Rows in the table path's care without a commit position get `at`: rows
/// the poller retried before a new slot, or a `dead redrive` brought back,
/// committed before the slot's consistent point, and after every row the
/// table holds with a position (a stream handed those over before it
/// reached them). A FIFO claim sends them after the latter and before the
/// rows the slot will hand over.
pub async fn position_handed(c: &Client, rows: PositionRows<'_>, at: Lsn) -> Result<u64, tokio_postgres::Error> {
    static SQL: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
        format!(
            "UPDATE outbox SET commit_lsn = $3::text::pg_lsn
              WHERE {} AND commit_lsn IS NULL
                AND ($1::bigint[] IS NULL OR id = ANY($1)) AND ($2::text[] IS NULL OR destination = ANY($2))",
            Holder::Table.sql("")
        )
    });
    let (ids, destinations) = match rows {
        PositionRows::Ids(ids) => (Some(ids), None),
        PositionRows::Destinations(d) => (None, d),
    };
    c.execute(SQL.as_str(), &[&ids, &destinations, &at.to_string()]).await
}

/// The ids of the rows a new slot will not stream, read in its snapshot:
/// the stream's, or the table path's without a commit position (this
/// shard's destinations, `None`: all), in id order.
pub async fn not_streamed(snap: &Client, shard: Option<&[String]>) -> Result<Vec<i64>, tokio_postgres::Error> {
    static SQL: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
        format!(
            "SELECT id FROM outbox WHERE ({} OR ({} AND commit_lsn IS NULL))
                AND ($1::text[] IS NULL OR destination = ANY($1)) ORDER BY id",
            Holder::Stream.sql(""),
            Holder::Table.sql("")
        )
    });
    Ok(snap.query(SQL.as_str(), &[&shard]).await?.iter().map(|r| r.get(0)).collect())
}

/// Hand the stream's rows among `ids` to the table path, due now, with `at`
/// as the commit position of those without one. Returns the rows handed.
pub async fn hand_ids(c: &Client, ids: &[i64], at: Lsn) -> Result<u64, tokio_postgres::Error> {
    static SQL: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
        format!("UPDATE outbox SET {} WHERE id = ANY($1) AND {}", to_table("$2::text::pg_lsn"), Holder::Stream.sql(""))
    });
    c.execute(SQL.as_str(), &[&ids, &at.to_string()]).await
}

/// Hand the stream's rows with ids in (`from`, `to`] (of `shard`'s
/// destinations; all: `None`) to the table path, 10,000 at most, in id
/// order, with `at` as the commit position of those without one. Returns
/// the last id handed (`None`: none was) and how many.
pub async fn hand_range(
    c: &Client,
    from: i64,
    to: i64,
    shard: Option<&[String]>,
    at: Lsn,
) -> Result<(Option<i64>, u64), tokio_postgres::Error> {
    static SQL: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
        format!(
            "WITH handed AS (
                 UPDATE outbox SET {}
                  WHERE id IN (SELECT id FROM outbox WHERE {}
                                  AND id > $1 AND id <= $2 AND ($3::text[] IS NULL OR destination = ANY($3))
                                ORDER BY id LIMIT 10000)
                 RETURNING id)
             SELECT max(id), count(*) FROM handed",
            to_table("$4::text::pg_lsn"),
            Holder::Stream.sql("")
        )
    });
    let r = c.query_one(SQL.as_str(), &[&from, &to, &shard, &at.to_string()]).await?;
    Ok((r.get(0), r.get::<_, i64>(1) as u64))
}

/// Hand up to `limit` of the stream's rows of `destinations` to the table
/// path, due now, `why` as their `last_error` (a held stream: no commit
/// position is known). Returns how many, and a WAL position every one of
/// them committed before.
pub async fn hand_held(
    c: &Client,
    destinations: &[String],
    why: &str,
    limit: i64,
) -> Result<(u64, String), tokio_postgres::Error> {
    static SQL: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
        format!(
            "WITH handed AS (
                 UPDATE outbox SET next_attempt_at = now(), last_error = $2
                  WHERE id IN (SELECT id FROM outbox WHERE {} AND destination = ANY($1) ORDER BY id LIMIT $3)
                 RETURNING 1)
             SELECT count(*), pg_current_wal_insert_lsn()::text FROM handed",
            Holder::Stream.sql("")
        )
    });
    let r = c.query_one(SQL.as_str(), &[&destinations, &why, &limit]).await?;
    Ok((r.get::<_, i64>(0) as u64, r.get(1)))
}

/// The set part handing a row to the table path: due now, and `position`
/// its commit position unless it has one.
fn to_table(position: &str) -> String {
    format!("next_attempt_at = now(), commit_lsn = coalesce(commit_lsn, {position})")
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_rows_holder_by_its_columns() {
        assert_eq!(Holder::of(Some("NEW"), false), Holder::Stream);
        assert_eq!(Holder::of(None, false), Holder::Stream, "no status in the tuple: a producer's insert");
        assert_eq!(Holder::of(Some("NEW"), true), Holder::Table);
        assert_eq!(Holder::of(Some("DEAD"), false), Holder::Settled);
        assert_eq!(Holder::of(Some("PUBLISHED"), true), Holder::Settled);
        assert_eq!(Holder::of(Some("ODD"), false), Holder::Settled, "a status it does not know is not sent");
    }

    proptest! {
        /// [`covered`] is a scan of every run, made fast.
        #[test]
        fn covered_matches_a_scan_of_every_run(
            ids in proptest::collection::vec(0i64..400, 0..60),
            starts in proptest::collection::vec((0i64..400, 0i64..60), 0..40),
            marked in proptest::collection::hash_set(0i64..400, 0..20),
        ) {
            let runs: Vec<(i64, i64)> = starts.iter().map(|&(lo, len)| (lo, lo + len)).collect();
            let expected: HashSet<i64> = ids
                .iter()
                .copied()
                .filter(|id| marked.contains(id) || runs.iter().any(|&(lo, hi)| lo <= *id && *id <= hi))
                .collect();
            let mut shuffled = runs.clone();
            shuffled.reverse();
            prop_assert_eq!(covered(&ids, shuffled, marked), expected);
        }
    }
}
