//! The statements settlement runs, assembled once: marking, deleting with
//! a run of published ids ([`settled::record_runs`]), the visibility check
//! and writing rows back. What makes a row settled, and the proof of an
//! earlier publication, is [`crate::db::settled`]'s.

use crate::db::settled;

/// The set part of marking a DEAD or deferred row (and, kept, a PUBLISHED one).
/// A row from the stream left NEW or DEAD keeps its transaction's commit
/// position and its place in it: a FIFO claim orders by them
/// ([`crate::source::table`]); a PUBLISHED one needs neither.
pub(super) fn update_set() -> String {
    format!(
        "SET status = u.status,
             published_at = CASE WHEN u.status = 'PUBLISHED' THEN now() ELSE o.published_at END,
             next_attempt_at = CASE u.defer WHEN 1 THEN now() + make_interval(secs => {})
                                            WHEN 2 THEN now() ELSE o.next_attempt_at END,
             last_error = u.err,
             attempts = o.attempts + CASE WHEN u.defer = 2 THEN 0 ELSE 1 END,
             commit_lsn = CASE WHEN u.commit IS NULL OR u.status = 'PUBLISHED' THEN o.commit_lsn
                               ELSE u.commit::pg_lsn END,
             commit_seq = CASE WHEN u.commit IS NULL OR u.status = 'PUBLISHED' THEN o.commit_seq ELSE u.seq END",
        crate::policy::retry::backoff_sql("o.attempts", "$4", "$5")
    )
}

pub(super) const MARK_INPUT: &str =
    "unnest($1::bigint[], $7::text[], $2::text[], $3::text[], $6::int2[], $8::text[], $9::int4[])
                          AS u(id, event_id, status, err, defer, commit, seq)";

/// A row is the settlement's row when both its id and its event id match
/// (ids can be reused: an identity reset, a restore; event ids are unique)
/// and it is not settled.
fn same_row() -> String {
    format!("o.id = u.id AND o.event_id = u.event_id AND {}", settled::unsettled_sql("o."))
}

/// `published_rows = "keep"`: one UPDATE marks a flush PUBLISHED, DEAD, or
/// deferred (NEW with `next_attempt_at` from the retry policy's backoff).
pub(super) static KEEP_SQL: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!("UPDATE outbox o {} FROM {MARK_INPUT} WHERE {} RETURNING o.event_id", update_set(), same_row())
});

/// `published_rows = "delete"`: one statement deletes the published rows,
/// records their ids as runs of consecutive ids with the range of their
/// commit positions (for the replay filter: [`settled::PROVEN_BY_RUN`]), and updates
/// the DEAD and deferred ones.
pub(super) static DELETE_SQL: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!(
        "WITH u AS (SELECT * FROM {MARK_INPUT}),
         upd AS (UPDATE outbox o {} FROM u
                  WHERE {same} AND u.status <> 'PUBLISHED' RETURNING o.event_id),
         del AS (DELETE FROM outbox o USING u
                  WHERE {same} AND u.status = 'PUBLISHED' RETURNING o.id, o.event_id, u.commit::pg_lsn AS commit),
         runs AS ({})
         SELECT event_id FROM upd UNION ALL SELECT event_id FROM del",
        update_set(),
        settled::record_runs("del"),
        same = same_row(),
    )
});

/// Write rows back to the table, DEAD or deferred: `own_id` under their own
/// id (so a FIFO group keeps its order in the table), otherwise under a new
/// one, for rows whose id another row has taken since (ids reused) and whose
/// event is not in the table. The insert reaches the stream with a status or
/// `next_attempt_at` set, which the decoder skips. A row keeps its commit
/// position and its place in its transaction; one the stream did not bring
/// (a mapped table's claim) gets, in CDC mode (`$15`), the WAL's insert
/// position, past its commit and before any transaction committing later
/// ([`super::Marking::bound_unpositioned`]).
/// Returns the event ids written.
pub(super) fn restore_sql(own_id: bool) -> String {
    let (id_col, id_val, overriding, unless) = if own_id {
        ("id, ", "u.id, ", "OVERRIDING SYSTEM VALUE", "")
    } else {
        ("", "", "", "WHERE NOT EXISTS (SELECT 1 FROM outbox o WHERE o.event_id = u.event_id)")
    };
    format!(
        "INSERT INTO outbox ({id_col}event_id, destination, body, group_key, attributes, created_at,
                             status, attempts, next_attempt_at, last_error, deliver_at, commit_lsn, commit_seq,
                             replay_of)
         {overriding}
         SELECT {id_val}u.event_id, u.destination, u.body, u.group_key, u.attributes::jsonb,
                to_timestamp(u.created_us / 1e6), u.status, CASE WHEN u.defer = 2 THEN 0 ELSE 1 END,
                CASE u.defer WHEN 1 THEN now() + make_interval(secs => {}) WHEN 2 THEN now() END, u.err,
                CASE WHEN u.deliver_us = {never} THEN 'infinity'::timestamptz
                     WHEN u.deliver_us = -{never} THEN '-infinity'::timestamptz
                     ELSE to_timestamp(u.deliver_us / 1e6) END,
                CASE WHEN u.commit IS NOT NULL THEN u.commit::pg_lsn WHEN $15 THEN pg_current_wal_insert_lsn() END,
                u.seq, u.replay_of
           FROM unnest($1::bigint[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[], $7::float8[],
                       $8::text[], $9::int2[], $10::text[], $13::bigint[], $14::text[], $16::int4[], $17::bigint[])
                AS u(id, event_id, destination, body, group_key, attributes, created_us, status, defer, err, deliver_us,
                     commit, seq, replay_of)
         {unless}
         ON CONFLICT DO NOTHING
         RETURNING event_id",
        crate::policy::retry::backoff_sql("0", "$11", "$12"),
        never = crate::event::DeliverAt::NEVER,
    )
}

pub(super) static RESTORE_SQL: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| restore_sql(true));
pub(super) static RESTORE_NEW_ID_SQL: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| restore_sql(false));

/// Of the rows a mark did not update, in one statement: whether the row is
/// there (same id and event id) and whether it is still NEW (mark it again
/// now), and whether its inserting transaction is visible to this
/// statement's snapshot. Visible and there but not NEW: settled before (a
/// replay, the table path). Visible and absent: deleted (by its own
/// transaction or a later one, or published and deleted before). Not
/// visible: the commit was decoded before it left the server's proc array;
/// wait.
///
/// The stream gives 32-bit xids; they are widened against the snapshot's
/// xmax (a committed transaction is less than 2^31 behind it).
pub(super) static MISSING_SQL: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!(
        "SELECT u.event_id, {}, o.id IS NOT NULL, {XID_VISIBLE} AS visible
           FROM unnest($1::bigint[], $2::bigint[], $3::text[]) AS u(id, xid, event_id)
           LEFT JOIN outbox o ON o.id = u.id AND o.event_id = u.event_id
          {XID_SNAPSHOT}",
        settled::unsettled_sql("o.")
    )
});

/// Joined to rows `u` with a 32-bit `xid` (from the stream): the
/// statement's snapshot, and each xid's distance below its xmax.
pub(super) const XID_SNAPSHOT: &str = "CROSS JOIN (SELECT pg_current_snapshot() AS snap,
                    pg_snapshot_xmax(pg_current_snapshot())::text::bigint AS xmax) s
 CROSS JOIN LATERAL (SELECT ((s.xmax % 4294967296) - u.xid + 4294967296) % 4294967296 AS delta) d";

/// Over [`XID_SNAPSHOT`]: `u.xid`'s transaction is visible to the snapshot
/// (true for no xid).
pub(super) const XID_VISIBLE: &str = "(u.xid IS NULL OR (d.delta > 0 AND d.delta < 2147483648
                         AND pg_visible_in_snapshot((s.xmax - d.delta)::text::xid8, s.snap)))";

/// The identity moved past every id in the table, never back (it needs
/// UPDATE on the identity's sequence; without it the flush fails, and is
/// made again).
pub(super) const BUMP_IDENTITY_SQL: &str =
    "SELECT setval(s, greatest((SELECT max(id) FROM outbox), pg_sequence_last_value(s), 1))
    FROM CAST(pg_get_serial_sequence('outbox', 'id') AS regclass) s";

pub(super) const RESTORE_FAILED_SQL: &str = "DO $$ BEGIN RAISE EXCEPTION
    'outbox rows to write back kept getting ids already in use: the flush fails and its events are sent again'; END $$";
