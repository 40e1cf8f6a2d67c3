//! A mapped table's unpublished rows read from the table itself, for a
//! mapping with a published column (`topic-payload`'s `published_at`, NULL
//! until published): what a polling relay left, and rows written before the
//! slot existed, are sent at each stream session's start
//! ([`catch_up`], before the session reads its start position, so the
//! replay filter skips what it sent); in polling mode, all the time
//! ([`run_mapped_poller`]).
//!
//! One claim at a time per table (a transaction-scoped advisory lock), in
//! key order, `FOR UPDATE SKIP LOCKED`: each row's event goes through
//! [`publish_claim`] for its destination; settlement writes a row that
//! cannot go out now into the relay's own table and sets the published
//! column of every row it settled, in the claiming transaction.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio_postgres::{Client, GenericClient};

use crate::db;
use crate::event::{OutboxEvent, PublishedColumn, TableNow};
use crate::mapping::{quote_ident, Mapping, MappingError, Value};
use crate::pipeline::assemble::{publish_claim, Parts};
use crate::pipeline::destinations::Resolved;
use crate::pipeline::owed::Owed;
use crate::pipeline::route::UNKNOWN_DESTINATION_LABEL;
use crate::pipeline::settle::{mark, record, Due, Outcome, Settlement};
use crate::source::claims::{ClaimLoop, Next};

/// Rows one claim locks.
const CLAIM_LIMIT: i64 = 500;

/// A mapped table as its claims read it: the statements, made once.
pub struct MappedClaim {
    mapping: Mapping,
    published: Arc<PublishedColumn>,
    /// The rows not published yet, in key order, locked: key and body size.
    lock_sql: String,
    /// The same, of the keys in `$1` (text[]): rows set unpublished again
    /// ([`run_resends`]).
    lock_keys_sql: String,
    /// The locked rows' columns as text ([`Mapping::columns`]' order), then
    /// the database's clock.
    fetch_sql: String,
    /// Which of [`Mapping::columns`] are bytea (read as `\x` hex).
    bytea: Vec<bool>,
}

impl MappedClaim {
    /// The claims of `mapping` (with a published column), reading its
    /// columns' types from the database.
    pub async fn new(client: &Client, mapping: &Mapping) -> Result<MappedClaim, db::DbError> {
        let published = mapping.published_column().ok_or_else(|| {
            db::DbError::Check(format!("mapped table {}.{} has no published column", mapping.schema, mapping.table))
        })?;
        let oid: u32 = match mapping.oid {
            Some(oid) => oid,
            None => client
                .query_one("SELECT $1::text::regclass::oid", &[&mapping.qualified()])
                .await
                .map_err(db::DbError::from)?
                .get(0),
        };
        // By its oid: a table renamed or moved since start-up is claimed
        // under its name of the day.
        let name = format!("{}.{}", mapping.schema, mapping.table);
        let t = match published.table_now(client).await.map_err(db::DbError::from)? {
            TableNow::Ready(t) => t,
            TableNow::Gone => {
                return Err(db::DbError::Check(format!(
                    "mapped table {name} was dropped: its rows are gone; remove it from [[outbox]]"
                )))
            }
            TableNow::Refused(why) => return Err(db::DbError::Check(format!("mapped table {name}: {why}"))),
        };
        if t != published.table {
            tracing::warn!(table = %published.table, now = %t, "mapped table renamed or moved: followed by its oid; set `table` in [[outbox]] to its new name");
        }
        let types = db::schema::column_types(client, oid).await?;
        let type_of = |c: &str| types.iter().find(|(n, _)| n == c).map(|(_, t)| t.as_str()).unwrap_or("text");
        let columns = mapping.columns();
        let exprs: Vec<String> = columns.iter().map(|c| as_text(c, type_of(c))).collect();
        let (id, p) = (&published.id, &published.column);
        let lock_sql = format!(
            "SELECT {id}::text, octet_length({}::text) FROM {t} WHERE {p} IS NULL AND {id} IS NOT NULL ORDER BY {id} LIMIT $1 \
             FOR UPDATE SKIP LOCKED",
            quote_ident(&mapping.body)
        );
        let keys_in = published.keys_in();
        let lock_keys_sql = format!(
            "SELECT {id}::text, octet_length({}::text) FROM {t} WHERE {p} IS NULL AND {keys_in} ORDER BY {id} \
             FOR UPDATE SKIP LOCKED",
            quote_ident(&mapping.body)
        );
        let fetch_sql = format!(
            "SELECT {}, (extract(epoch FROM clock_timestamp()) * 1000000)::bigint FROM {t} WHERE {keys_in} ORDER BY {id}",
            exprs.join(", ")
        );
        let bytea = columns.iter().map(|c| type_of(c) == "bytea").collect();
        Ok(MappedClaim { mapping: mapping.clone(), published, lock_sql, lock_keys_sql, fetch_sql, bytea })
    }

    fn name(&self) -> String {
        format!("{}.{}", self.mapping.schema, self.mapping.table)
    }
}

/// A column as text the mapping reads as the stream gives it: bytea as
/// `\x` hex, timestamptz in ISO at UTC, whatever the session's settings.
fn as_text(column: &str, ty: &str) -> String {
    let c = quote_ident(column);
    match ty {
        "bytea" => format!("'\\x' || encode({c}, 'hex')"),
        "timestamp with time zone" => format!(
            "CASE WHEN isfinite({c}) THEN to_char({c} AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS.US') || '+00' \
             ELSE {c}::text END"
        ),
        _ => format!("{c}::text"),
    }
}

/// What one claim did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct MappedRound {
    pub claimed: usize,
    pub published: usize,
    /// DEAD or deferred: written into the relay's table.
    pub handed: usize,
}

/// One claim: lock unpublished rows, send them, settle them, commit.
pub async fn claim_mapped(
    client: &mut Client,
    claim: &MappedClaim,
    parts: &Parts,
) -> Result<MappedRound, tokio_postgres::Error> {
    claim_rows(client, claim, parts, None).await
}

/// A claim of the next unpublished rows (`keys` None: at most
/// [`CLAIM_LIMIT`], none if another claim of the table runs), or of those
/// of `keys` still unpublished (after any other claim of the table).
async fn claim_rows(
    client: &mut Client,
    claim: &MappedClaim,
    parts: &Parts,
    keys: Option<&[String]>,
) -> Result<MappedRound, tokio_postgres::Error> {
    let tx = client.transaction().await?;
    let lock = format!("outbox_relay:mapped:{}", claim.name());
    let got: bool = match keys {
        None => tx.query_one("SELECT pg_try_advisory_xact_lock(hashtextextended($1, 0))", &[&lock]).await?.get(0),
        Some(_) => tx.execute("SELECT pg_advisory_xact_lock(hashtextextended($1, 0))", &[&lock]).await.map(|_| true)?,
    };
    if !got {
        tx.commit().await?;
        return Ok(MappedRound::default());
    }
    let locked = match keys {
        None => tx.query(&claim.lock_sql, &[&CLAIM_LIMIT]).await?,
        Some(keys) => tx.query(&claim.lock_keys_sql, &[&keys]).await?,
    };
    let mut round = MappedRound { claimed: locked.len(), ..MappedRound::default() };
    let keys = within_budget(&locked, parts.settings.memory.table_claim_bytes());
    if keys.is_empty() {
        tx.commit().await?;
        return Ok(round);
    }
    let rows = tx.query(&claim.fetch_sql, &[&keys]).await?;
    let now_us: i64 = rows.first().map_or(0, |r| r.get(claim.bytea.len()));
    let events = rows.iter().filter_map(|r| row_event(claim, r, now_us)).collect();
    let settled = settle_claim(&tx, parts, events, now_us).await?;
    for s in &settled {
        match s.outcome {
            Outcome::Published => round.published += 1,
            _ => round.handed += 1,
        }
    }
    tx.commit().await?;
    record(&parts.metrics, &settled);
    Ok(round)
}

/// The keys of `locked` (key, body size) in order, as many as fit in
/// `budget` bytes (one at least).
fn within_budget(locked: &[tokio_postgres::Row], budget: u64) -> Vec<String> {
    let mut used = 0u64;
    let mut keys = Vec::new();
    for r in locked {
        let (Some(key), size) = (r.get::<_, Option<String>>(0), r.get::<_, Option<i32>>(1).unwrap_or(0)) else {
            continue;
        };
        used += size.max(0) as u64;
        if !keys.is_empty() && used > budget {
            break;
        }
        keys.push(key);
    }
    keys
}

/// A fetched row's event; a row the mapping cannot read is logged and left
/// (it has no key: nothing could mark it).
fn row_event(claim: &MappedClaim, r: &tokio_postgres::Row, now_us: i64) -> Option<Arc<OutboxEvent>> {
    let columns = claim.mapping.columns();
    let col = |name: &str| -> Result<Value<'_>, MappingError> {
        let i = columns.iter().position(|c| *c == name).expect("a column of the mapping");
        Ok(r.get::<_, Option<&str>>(i).map_or(Value::Null, |s| Value::Text(s.into())))
    };
    let bytea = |name: &str| columns.iter().position(|c| *c == name).is_some_and(|i| claim.bytea[i]);
    match claim.mapping.event(col, bytea, None, now_us, Some(&claim.published)) {
        Ok(ev) => Some(Arc::new(ev)),
        Err(e) => {
            tracing::warn!(table = %claim.name(), error = %e, "a mapped row the relay cannot read is left unpublished");
            None
        }
    }
}

/// A claim's events, per destination through [`publish_claim`] (which
/// settles them in `tx`). Those for destinations this relay does not know
/// are DEAD (or wait, while one cannot be looked up), and those behind their group's row in the relay's table are
/// deferred there ([`behind_waiting_groups`]): both written into the
/// relay's table at once.
async fn settle_claim<C: GenericClient>(
    tx: &C,
    parts: &Parts,
    events: Vec<Arc<OutboxEvent>>,
    now_us: i64,
) -> Result<Vec<Settlement>, tokio_postgres::Error> {
    let mut by_destination: BTreeMap<String, Vec<Arc<OutboxEvent>>> = BTreeMap::new();
    for ev in events {
        by_destination.entry(ev.destination.clone()).or_default().push(ev);
    }
    let (mut settled, mut here) = (Vec::new(), Vec::new());
    for (destination, events) in by_destination {
        let d = match parts.destinations.resolve(&destination).await {
            Resolved::Ready(d) => d,
            unsent => {
                let label: Arc<str> = Arc::from(UNKNOWN_DESTINATION_LABEL);
                let outcome = match unsent {
                    Resolved::Dead(reason) => Outcome::Dead(reason),
                    Resolved::Unavailable(why) => Outcome::Deferred(why, Due::Backoff),
                    Resolved::Ready(_) => unreachable!("matched above"),
                };
                here.extend(
                    events.into_iter().map(|ev| Settlement::new(ev, None, Arc::clone(&label), outcome.clone())),
                );
                continue;
            }
        };
        let events = if d.target.fifo { behind_waiting_groups(tx, &d.name, events, &mut here).await? } else { events };
        settled.extend(publish_claim(tx, parts, (&d.name, &d.target), events, now_us).await?);
    }
    if !here.is_empty() {
        // A claim locked its rows FOR UPDATE: their column can be set, or
        // they stay unpublished and the next claim takes them.
        mark(tx, &here, parts.settings.marking, &mut Owed::default()).await?;
        settled.append(&mut here);
    }
    Ok(settled)
}

/// On a FIFO destination, an event whose group has a row waiting in the
/// relay's table (deferred, spooled) goes there behind it rather than
/// overtake it: its settlement (deferred, due now) goes to `behind`.
/// Returns the others.
async fn behind_waiting_groups<C: GenericClient>(
    tx: &C,
    destination: &Arc<str>,
    events: Vec<Arc<OutboxEvent>>,
    behind: &mut Vec<Settlement>,
) -> Result<Vec<Arc<OutboxEvent>>, tokio_postgres::Error> {
    let groups: Vec<&str> = events.iter().filter_map(|e| e.group_key.as_deref()).collect();
    if groups.is_empty() {
        return Ok(events);
    }
    let waiting: std::collections::HashSet<String> = tx
        .query(
            "SELECT DISTINCT group_key FROM outbox WHERE destination = $1 AND status = 'NEW' AND group_key = ANY($2)",
            &[&&**destination, &groups],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    let (wait, go): (Vec<_>, Vec<_>) =
        events.into_iter().partition(|e| e.group_key.as_deref().is_some_and(|g| waiting.contains(g)));
    behind.extend(wait.into_iter().map(|ev| {
        let outcome = Outcome::Deferred("behind its group's earlier row in the table".into(), Due::Now);
        Settlement::new(ev, None, Arc::clone(destination), outcome)
    }));
    Ok(go)
}

/// Claims until a claim finds nothing more to send, or `stop`.
pub async fn catch_up(
    client: &mut Client,
    claim: &MappedClaim,
    parts: &Parts,
    stop: &watch::Receiver<bool>,
) -> Result<u64, tokio_postgres::Error> {
    let mut sent = 0u64;
    loop {
        if *stop.borrow() {
            return Ok(sent);
        }
        let round = claim_mapped(client, claim, parts).await?;
        sent += (round.published + round.handed) as u64;
        if round.claimed < CLAIM_LIMIT as usize || round.published + round.handed == 0 {
            return Ok(sent);
        }
    }
}

/// A mapped row a later transaction set unpublished again (its published
/// column back to NULL: the way to ask for it again): its table's index in
/// the mappings, and its key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resend {
    pub table: usize,
    pub key: String,
}

/// While a session streams: the rows the stream saw set unpublished again
/// are claimed by their keys and sent, as polling does (gathered for
/// [`RESEND_GATHER`], one claim per table). Until then they are unpublished
/// in their table: a relay stopped first sends them at its next session's
/// start. Ends when the stream drops its sender, or at `stop`.
pub async fn run_resends(
    db: db::Db,
    parts: Arc<Parts>,
    mut rx: tokio::sync::mpsc::UnboundedReceiver<Resend>,
    stop: watch::Receiver<bool>,
) {
    let mut conn: Option<Client> = None;
    let mut claims: BTreeMap<usize, MappedClaim> = BTreeMap::new();
    while let Some(first) = rx.recv().await {
        tokio::time::sleep(RESEND_GATHER).await;
        let mut keys: BTreeMap<usize, Vec<String>> = BTreeMap::new();
        keys.entry(first.table).or_default().push(first.key);
        while let Ok(r) = rx.try_recv() {
            keys.entry(r.table).or_default().push(r.key);
        }
        for (table, keys) in keys {
            let Some(mapping) = parts.settings.mapped.get(table) else { continue };
            if let Err(e) = resend(&db, &mut conn, &mut claims, (table, mapping), &parts, &keys, &stop).await {
                tracing::warn!(
                    table = %format!("{}.{}", mapping.schema, mapping.table), rows = keys.len(), error = %e,
                    "rows set unpublished again not sent now: they stay unpublished, sent at the next session's start"
                );
                conn = None;
                claims.clear();
            }
        }
    }
}

/// How long [`run_resends`] gathers keys after the first.
const RESEND_GATHER: Duration = Duration::from_millis(20);

/// Claims of `keys` of one table until none of them is left unpublished.
async fn resend(
    db: &db::Db,
    conn: &mut Option<Client>,
    claims: &mut BTreeMap<usize, MappedClaim>,
    (table, mapping): (usize, &Mapping),
    parts: &Parts,
    keys: &[String],
    stop: &watch::Receiver<bool>,
) -> Result<(), String> {
    if conn.as_ref().is_none_or(Client::is_closed) {
        *conn = Some(db.connect().await.map_err(|e| e.to_string())?);
    }
    let client = conn.as_mut().expect("connected above");
    let claim = match claims.entry(table) {
        std::collections::btree_map::Entry::Occupied(c) => c.into_mut(),
        std::collections::btree_map::Entry::Vacant(v) => {
            v.insert(MappedClaim::new(client, mapping).await.map_err(|e| e.to_string())?)
        }
    };
    while !*stop.borrow() {
        let round = claim_rows(client, claim, parts, Some(keys)).await.map_err(|e| db::describe(&e))?;
        if round.claimed == 0 || round.published + round.handed == 0 {
            break;
        }
        tracing::info!(table = %claim.name(), rows = round.published + round.handed, "rows set unpublished again sent");
    }
    Ok(())
}

/// What [`catch_up_all`] did.
#[derive(Debug, Default)]
pub struct CaughtUp {
    /// Rows settled.
    pub settled: u64,
    /// The mappings (their index) it could not catch up: the table's trouble
    /// (a grant taken, a column gone) is the operator's, and their rows wait
    /// for [`readable_again`].
    pub skipped: Vec<usize>,
}

/// Before a stream session starts: every mapped table with a published
/// column caught up ([`catch_up`]), on one connection.
pub async fn catch_up_all(db: &db::Db, parts: &Parts, stop: &watch::Receiver<bool>) -> Result<CaughtUp, db::DbError> {
    let mut done = CaughtUp::default();
    let tables: Vec<(usize, &Mapping)> =
        parts.settings.mapped.iter().enumerate().filter(|(_, m)| m.published.is_some()).collect();
    if tables.is_empty() {
        return Ok(done);
    }
    let mut client = db.connect().await?;
    committed_visible(&client).await?;
    for (i, m) in tables {
        let name = format!("{}.{}", m.schema, m.table);
        // What an operator did to one table (dropped it or a column, took a
        // grant) stops no other source: its rows stay unpublished, claimed
        // once it is readable again; the stream reads new ones.
        let skip = |why: String| {
            tracing::error!(table = %name, error = %why, "mapped table not caught up: its unpublished rows wait until it is readable again");
        };
        let claim = match MappedClaim::new(&client, m).await {
            Ok(claim) => claim,
            Err(e) if table_trouble(&e) => {
                skip(e.to_string());
                done.skipped.push(i);
                continue;
            }
            Err(e) => return Err(e),
        };
        let n = match catch_up(&mut client, &claim, parts, stop).await {
            Ok(n) => n,
            Err(e) if e.code().is_some_and(|c| c.code().starts_with("42")) => {
                skip(db::describe(&e));
                done.skipped.push(i);
                continue;
            }
            Err(e) => return Err(e.into()),
        };
        if n > 0 {
            tracing::info!(table = %claim.name(), rows = n, "mapped table caught up: rows its published column said were not published");
        }
        done.settled += n;
    }
    Ok(done)
}

/// How often [`readable_again`] looks.
const READABLE_EVERY: Duration = Duration::from_secs(15);

/// Returns once one of the `skipped` mappings can be claimed again (a grant
/// given back, a column restored), naming it; pending forever if none was
/// skipped. The session then ends, and the next one's [`catch_up_all`]
/// claims the rows that waited: a claim beside a running stream could send
/// a group's rows ahead of the stream's earlier ones.
pub async fn readable_again(db: db::Db, parts: Arc<Parts>, skipped: Vec<usize>) -> String {
    if skipped.is_empty() {
        return std::future::pending().await;
    }
    let mut kept = db::Kept::new(db);
    loop {
        tokio::time::sleep(READABLE_EVERY).await;
        let Some(client) = kept.get().await else { continue };
        for m in skipped.iter().filter_map(|i| parts.settings.mapped.get(*i)) {
            match MappedClaim::new(client, m).await {
                Ok(_) => return format!("{}.{}", m.schema, m.table),
                Err(e) if table_trouble(&e) => {}
                Err(_) => {
                    kept.lost();
                    break;
                }
            }
        }
    }
}

/// A failure of one table's statements, not of the server: the table or a
/// column is gone, a privilege was taken (SQLSTATE class 42), or the table
/// was dropped.
fn table_trouble(e: &db::DbError) -> bool {
    match e {
        db::DbError::Check(_) => true,
        db::DbError::Query(e) => e.code().is_some_and(|c| c.code().starts_with("42")),
        _ => false,
    }
}

/// Waits (10 s at most) until no transaction that has committed is still
/// invisible to new snapshots: one that committed before a new slot's
/// consistent point is not streamed, and the catch-up must see its rows
/// (the window between a commit's record and its visibility is brief).
async fn committed_visible(client: &Client) -> Result<(), db::DbError> {
    const SQL: &str =
        "SELECT count(*) FROM pg_snapshot_xip(pg_current_snapshot()) x WHERE pg_xact_status(x) = 'committed'";
    let started = std::time::Instant::now();
    for waits in 0.. {
        let pending: i64 = client.query_one(SQL, &[]).await.map_err(db::DbError::from)?.get(0);
        if pending == 0 {
            return Ok(());
        }
        if started.elapsed() > Duration::from_secs(10) {
            tracing::warn!(
                transactions = pending,
                "committed transactions still invisible after 10 s; catching up without waiting for them"
            );
            return Ok(());
        }
        tokio::time::sleep(crate::policy::retry::backoff(waits, Duration::from_millis(1), Duration::from_millis(100)))
            .await;
    }
    Ok(())
}

/// Polling mode: claims of `mapping`'s table every `poll_interval` (at once
/// after a full one) until `stop`; errors are logged and retried on a new
/// connection (an aborted claim leaves its rows unpublished).
pub async fn run_mapped_poller(
    mapping: Mapping,
    db: db::Db,
    parts: Arc<Parts>,
    poll_interval: Duration,
    mut stop: watch::Receiver<bool>,
) {
    let mut claims = ClaimLoop::new(poll_interval);
    let name = format!("{}.{}", mapping.schema, mapping.table);
    let mut conn: Option<(Client, MappedClaim)> = None;
    while !*stop.borrow() {
        // The claims go on until the table has nothing more to send.
        let next = match poll_once(&mut conn, &mapping, &db, &parts, &stop).await {
            Ok(()) => Next::Poll,
            Err(e) => {
                tracing::warn!(table = %name, error = %e, "mapped table claim failed; its rows stay unpublished and are claimed again");
                conn = None;
                Next::Failed
            }
        };
        if claims.wait(next, &mut stop).await {
            return;
        }
    }
}

/// Claims on `conn` (connected first if it is not) until the table has
/// nothing more to send.
async fn poll_once(
    conn: &mut Option<(Client, MappedClaim)>,
    mapping: &Mapping,
    db: &db::Db,
    parts: &Parts,
    stop: &watch::Receiver<bool>,
) -> Result<(), String> {
    if conn.as_ref().is_none_or(|(c, _)| c.is_closed()) {
        let client = db.connect().await.map_err(|e| e.to_string())?;
        let claim = MappedClaim::new(&client, mapping).await.map_err(|e| e.to_string())?;
        *conn = Some((client, claim));
    }
    let (client, claim) = conn.as_mut().expect("connected above");
    catch_up(client, claim, parts, stop).await.map_err(|e| db::describe(&e))?;
    Ok(())
}
