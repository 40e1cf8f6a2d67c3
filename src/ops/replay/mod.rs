//! `outbox-relay replay`: what was published is sent again. A replay copies
//! the published rows it selects (kept: `published_rows = "keep"`) into the
//! outbox as new rows, in the order they were published, which a FIFO
//! group's rows were in commit order; the relay sends the copies as it
//! sends any row (its lanes, limits, byte budget, spooling, DEAD, S3
//! offload), at once (a copy has no `deliver_at`). Each copy names its
//! replay (`replay_of`): its message carries the
//! [`REPLAY_ATTRIBUTE`](crate::publish::entry::REPLAY_ATTRIBUTE), and a
//! later replay does not select it. Its event id is the original's with
//! `/replay-<id>` after it: on a FIFO queue that is its deduplication id,
//! so SQS does not drop it as a resend of the original within its
//! five-minute window.
//!
//! The copies are written in transactions that also move the replay's
//! cursor (`outbox_replays`): a replay killed at any point resumes where
//! its last transaction left it, and copies no event twice.
//!
//! What the table does not keep (`published_rows = "delete"`, transient
//! rows, a mapped table's insert-and-delete) is read from the archive
//! instead ([`archive`]), the same way: `--from archive`, or by default
//! when the relay deletes what it publishes and an archive is enabled.

pub mod archive;

use std::time::{Duration, Instant};

use serde::Serialize;
use tokio_postgres::Client;

use crate::config::{Config, PublishedRows};
use crate::db::schema::RowStatus;
use crate::publish::kind::Kind;

use super::OpsError;

/// What to send again.
#[derive(Debug, Clone, Default, Serialize, serde::Deserialize, PartialEq, Eq)]
pub struct Selection {
    /// Rows published to this destination (all: `None`).
    pub destination: Option<String>,
    /// Published at or after this time (an ISO timestamp PostgreSQL reads).
    pub since: Option<String>,
    /// Published before this time; when not given, the time the replay
    /// started (what is published after it is not selected).
    pub until: Option<String>,
    /// These events only (none: every event of the rest of the selection).
    pub event_ids: Vec<String>,
    /// Send to this destination instead of each row's own.
    pub to: Option<String>,
    /// Where the published events are read (fixed by [`plan`]).
    #[serde(default)]
    pub source: Option<Source>,
    /// Events of this mapped table only (`schema.table`; the archive's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub table: Option<String>,
}

/// Where a replay reads what was published.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Source {
    /// The rows the relay's table keeps (`published_rows = "keep"`).
    Table,
    /// The archive in S3 (`[archive]`).
    Archive,
}

impl Source {
    pub fn parse(s: &str) -> Option<Source> {
        match s {
            "table" => Some(Source::Table),
            "archive" => Some(Source::Archive),
            _ => None,
        }
    }

    /// Where a selection that does not say reads: the table when it keeps
    /// what is published, else the archive when there is one.
    fn default_for(config: &Config) -> Source {
        if config.published_rows == PublishedRows::Delete && config.archive.is_some() {
            Source::Archive
        } else {
            Source::Table
        }
    }
}

/// What a replay would send, per destination it goes to.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct Planned {
    pub destination: String,
    pub events: i64,
    pub bytes: i64,
    /// Events without a group key: refused on a FIFO queue (`--to`).
    pub without_group: i64,
}

/// The rows a selection takes, over `o` (the outbox), `$1` being its JSON.
/// Copies of other replays are never selected.
fn selected_sql() -> String {
    format!(
        "o.status = {published} AND o.replay_of IS NULL
         AND ($1::text::jsonb->>'destination' IS NULL OR o.destination = $1::text::jsonb->>'destination')
         AND ($1::text::jsonb->>'since' IS NULL OR o.published_at >= ($1::text::jsonb->>'since')::timestamptz)
         AND o.published_at < ($1::text::jsonb->>'until')::timestamptz
         AND (jsonb_array_length($1::text::jsonb->'event_ids') = 0
              OR o.event_id IN (SELECT jsonb_array_elements_text($1::text::jsonb->'event_ids')))",
        published = published_literal()
    )
}

/// `'PUBLISHED'`, quoted, from [`RowStatus`].
fn published_literal() -> String {
    format!("'{}'", RowStatus::Published.as_str())
}

/// Check a selection against what the database (or the archive) keeps and
/// the configuration, and say what it would send, per destination. The
/// selection's `until` and `source` are fixed here (now, and the default
/// source, when not given).
pub async fn plan(client: &Client, config: &Config, selection: &mut Selection) -> Result<Vec<Planned>, OpsError> {
    let source = *selection.source.get_or_insert(Source::default_for(config));
    if source == Source::Table && config.published_rows == PublishedRows::Delete {
        return Err(OpsError::Refused(
            "nothing published is kept in the table: published_rows = \"delete\" deletes each row once it is sent. \
             Enable the archive ([archive] bucket = \"...\"), or set published_rows = \"keep\" (with a retention), \
             to keep what is published for replays; what was published before that cannot be sent again"
                .into(),
        ));
    }
    if source == Source::Table && selection.table.is_some() {
        return Err(OpsError::Refused(
            "--table selects a mapped table's events, which the archive keeps: replay --from archive (with \
             [archive] enabled)"
                .into(),
        ));
    }
    for name in selection.destination.iter().chain(&selection.to) {
        known_destination(config, name)?;
    }
    let now: String = client.query_one("SELECT now()::text", &[]).await?.get(0);
    selection.until.get_or_insert(now);
    let planned = match source {
        Source::Table => plan_table(client, selection).await?,
        Source::Archive => {
            let archive = archive::open(config).await?;
            let bounds = archive::Bounds::of(client, selection).await?;
            let planned = archive::plan(&archive, selection, bounds).await?;
            if planned.is_empty() {
                return Err(OpsError::Refused(archive::nothing_selected(&archive, selection).await?));
            }
            planned
        }
    };
    if let Some(to) = &selection.to {
        let without: i64 = planned.iter().map(|p| p.without_group).sum();
        if fifo(config, to) && without > 0 {
            return Err(OpsError::Refused(format!(
                "--to {to}: a FIFO queue needs a group for every message, and {without} of the selected events have \
                 no group key; replay them to a standard queue, or select only events with a group key"
            )));
        }
    }
    Ok(planned)
}

/// What a selection takes of the table's kept rows, per destination.
async fn plan_table(client: &Client, selection: &Selection) -> Result<Vec<Planned>, OpsError> {
    let json = serde_json::to_string(selection).expect("a selection is JSON");
    let sql = format!(
        "SELECT coalesce($2, o.destination), count(*), coalesce(sum(octet_length(o.body)), 0)::bigint,
                count(*) FILTER (WHERE o.group_key IS NULL)
           FROM outbox o WHERE {} GROUP BY 1 ORDER BY 1",
        selected_sql()
    );
    let rows = client.query(&sql, &[&json, &selection.to]).await.map_err(bad_time)?;
    let planned: Vec<Planned> = rows
        .iter()
        .map(|r| Planned { destination: r.get(0), events: r.get(1), bytes: r.get(2), without_group: r.get(3) })
        .collect();
    if planned.is_empty() {
        return Err(OpsError::Refused(nothing_selected(client, selection).await?));
    }
    Ok(planned)
}

/// A time PostgreSQL cannot read is the operator's to fix.
pub(crate) fn bad_time(e: tokio_postgres::Error) -> OpsError {
    match e.code() {
        Some(c) if c.code().starts_with("22") => OpsError::Refused(format!(
            "--since/--until: {} (give an ISO time: 2026-12-07 10:00:00+00)",
            crate::db::describe(&e)
        )),
        _ => e.into(),
    }
}

/// Why a selection took nothing: what is kept, and since when.
async fn nothing_selected(client: &Client, selection: &Selection) -> Result<String, OpsError> {
    let r = client
        .query_one(
            &format!(
                "SELECT count(*), min(published_at)::text, max(published_at)::text FROM outbox
                  WHERE status = {} AND replay_of IS NULL AND ($1::text IS NULL OR destination = $1)",
                published_literal()
            ),
            &[&selection.destination],
        )
        .await?;
    let (n, first, last): (i64, Option<String>, Option<String>) = (r.get(0), r.get(1), r.get(2));
    let of = selection.destination.as_deref().map_or(String::new(), |d| format!(" of destination {d:?}"));
    Ok(match (first, last) {
        (Some(first), Some(last)) => format!(
            "no published event matches: {n} published events{of} are kept, published from {first} to {last} \
             (the retention deletes older ones)"
        ),
        _ => format!(
            "no published event{of} is kept: none was published since published_rows = \"keep\" was set, or the \
             retention deleted them"
        ),
    })
}

/// A destination the configuration names, or one its template can make.
fn known_destination(config: &Config, name: &str) -> Result<(), OpsError> {
    if config.destinations.contains_key(name) {
        return Ok(());
    }
    match &config.destination_template {
        Some(t) if t.address(name).is_ok() => Ok(()),
        _ => Err(OpsError::Refused(format!(
            "destination {name:?} is not configured: add it under [destinations] (the relay sends a replay's copies \
             as it sends any row, so it must know where)"
        ))),
    }
}

/// Whether a destination is a FIFO queue or topic, by its address.
fn fifo(config: &Config, name: &str) -> bool {
    let address = match config.destinations.get(name) {
        Some(a) => a.clone(),
        None => match config.destination_template.as_ref().and_then(|t| t.address(name).ok()) {
            Some(a) => a,
            None => return false,
        },
    };
    Kind::of_address(&address).is_ok_and(|k| k != Kind::Bus) && address.ends_with(".fifo")
}

/// Where a replay stands (`outbox_replays.state`).
#[derive(Debug, Clone, Copy, Serialize, serde::Deserialize, PartialEq, Eq)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum ReplayState {
    /// Copying, or interrupted: `replay resume` goes on.
    Running,
    /// Every selected row copied.
    Done,
    /// Stopped by `replay cancel`: what was copied goes out, nothing more.
    Cancelled,
}

impl ReplayState {
    pub fn parse(s: &str) -> Option<ReplayState> {
        [ReplayState::Running, ReplayState::Done, ReplayState::Cancelled].into_iter().find(|v| v.as_str() == s)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            ReplayState::Running => "RUNNING",
            ReplayState::Done => "DONE",
            ReplayState::Cancelled => "CANCELLED",
        }
    }
}

/// A replay as `outbox_replays` records it.
#[derive(Debug, Clone, Serialize, serde::Deserialize, PartialEq, Eq)]
pub struct Replay {
    pub id: i64,
    pub state: ReplayState,
    pub selection: Selection,
    pub total: i64,
    pub total_bytes: i64,
    pub copied: i64,
    pub copied_bytes: i64,
    pub started_at: String,
    pub updated_at: String,
}

/// Record a planned replay; returns its id.
pub async fn start(client: &Client, selection: &Selection, planned: &[Planned]) -> Result<i64, OpsError> {
    let json = serde_json::to_string(selection).expect("a selection is JSON");
    let total: i64 = planned.iter().map(|p| p.events).sum();
    let bytes: i64 = planned.iter().map(|p| p.bytes).sum();
    let r = client
        .query_one(
            "INSERT INTO outbox_replays (selection, total, total_bytes) VALUES ($1::text::jsonb, $2, $3) RETURNING id",
            &[&json, &total, &bytes],
        )
        .await?;
    Ok(r.get(0))
}

/// Rows a replay copies per transaction.
pub const COPY_BATCH: i64 = 500;

/// Copy replay `id`'s rows until every one is copied, it is cancelled, or
/// `stop` says so (then it stays RUNNING, to resume); at most `rate` rows a
/// second. `progress` is told each transaction's totals. Returns the replay
/// as it stands.
pub async fn run(
    client: &mut Client,
    config: &Config,
    id: i64,
    rate: Option<u32>,
    mut progress: impl FnMut(&Replay),
    stop: impl Fn() -> bool,
) -> Result<Replay, OpsError> {
    let started = Instant::now();
    let mut copied_now = 0i64;
    let mut replay = get(client, id).await?;
    let mut reading = match replay.selection.source {
        Some(Source::Archive) => Some((archive::open(config).await?, archive::Reading::default())),
        _ => None,
    };
    loop {
        if replay.state != ReplayState::Running || stop() {
            return Ok(replay);
        }
        let batch = rate.map_or(COPY_BATCH, |r| COPY_BATCH.min(i64::from(r.max(1))));
        let (n, more) = match &mut reading {
            None => copy_batch(client, id, batch).await.map(|n| (n, n > 0))?,
            Some((a, r)) => archive::copy_batch(client, a, r, id, batch).await?,
        };
        copied_now += n;
        replay = get(client, id).await?;
        progress(&replay);
        if !more {
            let done = client
                .execute(
                    "UPDATE outbox_replays SET state = 'DONE', updated_at = now() WHERE id = $1 AND state = 'RUNNING'",
                    &[&id],
                )
                .await?;
            if done > 0 {
                return get(client, id).await;
            }
            continue;
        }
        if let Some(rate) = rate {
            // Ahead of the rate: wait until the rows copied are due.
            let due = Duration::from_secs_f64(copied_now as f64 / f64::from(rate.max(1)));
            if let Some(wait) = due.checked_sub(started.elapsed()) {
                tokio::time::sleep(wait).await;
            }
        }
    }
}

/// One transaction: up to `limit` rows past the replay's cursor copied,
/// the cursor and totals moved. Returns the rows copied.
async fn copy_batch(client: &mut Client, id: i64, limit: i64) -> Result<i64, OpsError> {
    let tx = client.transaction().await?;
    let Some(r) = tx
        .query_opt(
            "SELECT selection::text, cursor_at, cursor_id FROM outbox_replays WHERE id = $1 AND state = 'RUNNING' FOR UPDATE",
            &[&id],
        )
        .await?
    else {
        return Ok(0);
    };
    let selection: String = r.get(0);
    let cursor_at: Option<std::time::SystemTime> = r.get(1);
    let cursor_id: Option<i64> = r.get(2);
    let sql = format!(
        "WITH picked AS (
             SELECT o.id, o.event_id, o.destination, o.body, o.group_key, o.attributes, o.published_at
               FROM outbox o
              WHERE {} AND ($2::timestamptz IS NULL OR (o.published_at, o.id) > ($2, $3))
              ORDER BY o.published_at, o.id LIMIT $4),
         copied AS (
             INSERT INTO outbox (event_id, destination, body, group_key, attributes, replay_of)
             SELECT p.event_id || '/replay-' || $5::bigint, coalesce($1::text::jsonb->>'to', p.destination), p.body,
                    p.group_key, p.attributes, $5
               FROM picked p ORDER BY p.published_at, p.id
             ON CONFLICT (event_id) DO NOTHING
             RETURNING 1)
         SELECT (SELECT count(*) FROM picked), (SELECT coalesce(sum(octet_length(body)), 0)::bigint FROM picked),
                (SELECT published_at FROM picked ORDER BY published_at DESC, id DESC LIMIT 1),
                (SELECT id FROM picked ORDER BY published_at DESC, id DESC LIMIT 1),
                (SELECT count(*) FROM copied)",
        selected_sql()
    );
    let r = tx.query_one(&sql, &[&selection, &cursor_at, &cursor_id, &limit, &id]).await?;
    let (picked, bytes): (i64, i64) = (r.get(0), r.get(1));
    if picked > 0 {
        let (at, last): (Option<std::time::SystemTime>, Option<i64>) = (r.get(2), r.get(3));
        tx.execute(
            "UPDATE outbox_replays SET cursor_at = $2, cursor_id = $3, copied = copied + $4,
                    copied_bytes = copied_bytes + $5, updated_at = now() WHERE id = $1",
            &[&id, &at, &last, &picked, &bytes],
        )
        .await?;
    }
    crate::faults::crash_point("replay::before_commit");
    tx.commit().await?;
    Ok(picked)
}

/// Stop a replay: nothing more is copied. Copies written already are sent
/// (they are outbox rows like any other). Returns the replay.
pub async fn cancel(client: &Client, id: i64) -> Result<Replay, OpsError> {
    let n = client
        .execute(
            "UPDATE outbox_replays SET state = 'CANCELLED', updated_at = now() WHERE id = $1 AND state = 'RUNNING'",
            &[&id],
        )
        .await?;
    let replay = get(client, id).await?;
    if n == 0 {
        let state = replay.state.as_str();
        return Err(OpsError::Refused(format!("replay {id} is {state}: only a running replay is cancelled")));
    }
    Ok(replay)
}

/// Replay `id`, or a clear refusal when there is none.
pub async fn get(client: &Client, id: i64) -> Result<Replay, OpsError> {
    list(client, Some(id))
        .await?
        .into_iter()
        .next()
        .ok_or_else(|| OpsError::Refused(format!("there is no replay {id}: `outbox-relay replay list` lists them")))
}

/// Every replay (or replay `id`), newest first.
pub async fn list(client: &Client, id: Option<i64>) -> Result<Vec<Replay>, OpsError> {
    let rows = client
        .query(
            "SELECT id, state, selection::text, total, total_bytes, copied, copied_bytes, created_at::text, updated_at::text
               FROM outbox_replays WHERE $1::bigint IS NULL OR id = $1 ORDER BY id DESC LIMIT 100",
            &[&id],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| Replay {
            id: r.get(0),
            state: ReplayState::parse(r.get(1)).unwrap_or(ReplayState::Cancelled),
            selection: serde_json::from_str(r.get::<_, &str>(2)).unwrap_or_default(),
            total: r.get(3),
            total_bytes: r.get(4),
            copied: r.get(5),
            copied_bytes: r.get(6),
            started_at: r.get(7),
            updated_at: r.get(8),
        })
        .collect())
}

/// The replays still running (copying, or interrupted), for `status`;
/// none before migration 15, or for a role that may not read them (the
/// relay's own, least privileged: replays are an operator's).
pub async fn running(client: &Client) -> Result<Vec<Replay>, OpsError> {
    let readable: bool = client
        .query_one(
            "SELECT CASE WHEN to_regclass('outbox_replays') IS NULL THEN false
                         ELSE has_table_privilege('outbox_replays', 'SELECT') END",
            &[],
        )
        .await?
        .get(0);
    if !readable {
        return Ok(Vec::new());
    }
    Ok(list(client, None).await?.into_iter().filter(|r| r.state == ReplayState::Running).collect())
}

/// A plan as text: per destination, the events and bytes.
pub fn format_plan(planned: &[Planned]) -> String {
    let mut out = String::new();
    for p in planned {
        out += &format!("{}: {} events, {} bytes\n", p.destination, p.events, p.bytes);
    }
    let (n, b): (i64, i64) = (planned.iter().map(|p| p.events).sum(), planned.iter().map(|p| p.bytes).sum());
    out += &format!("total: {n} events, {b} bytes\n");
    out
}

/// Replays as text, one line each.
pub fn format_replays(replays: &[Replay]) -> String {
    if replays.is_empty() {
        return "no replay\n".into();
    }
    replays.iter().map(|r| format!("{}\n", format_replay(r))).collect()
}

/// One replay's line: its state and progress, and what it selected.
pub fn format_replay(r: &Replay) -> String {
    let s = &r.selection;
    let mut what = Vec::new();
    if let Some(d) = &s.destination {
        what.push(format!("destination {d}"));
    }
    if let Some(t) = &s.since {
        what.push(format!("since {t}"));
    }
    if let Some(t) = &s.until {
        what.push(format!("until {t}"));
    }
    if !s.event_ids.is_empty() {
        what.push(format!("{} event ids", s.event_ids.len()));
    }
    if let Some(t) = &s.table {
        what.push(format!("table {t}"));
    }
    if let Some(t) = &s.to {
        what.push(format!("to {t}"));
    }
    if s.source == Some(Source::Archive) {
        what.push("from the archive".into());
    }
    format!(
        "replay {} {}: {}/{} events copied ({}/{} bytes), started {}, {}",
        r.id,
        r.state.as_str(),
        r.copied,
        r.total,
        r.copied_bytes,
        r.total_bytes,
        r.started_at,
        what.join(", ")
    )
}
