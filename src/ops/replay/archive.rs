//! A replay read from the archive ([`crate::pipeline::archive`]): the
//! segments of the selected destinations (or all), from the first written
//! at or after `since`, in key order (per destination, the order they were
//! written, which a FIFO group's events were sent in), each line the
//! selection takes copied into the outbox as the table's rows are. The
//! cursor is the segment's key and the lines of it examined, moved in the
//! transaction that wrote their copies.
//!
//! A line's time is taken when its segment is made, before it is written:
//! a segment being written when the plan lists the archive (its events
//! published within the last flush before `until`) is not counted, and is
//! copied if the copying finds it, so `copied` can pass `total` by those.
//! An `until` a few seconds back leaves no such segment.

use std::collections::HashSet;

use tokio_postgres::{Client, GenericClient};

use crate::config::Config;
use crate::pipeline::archive::{after, decode, folder, written_us, Archive, Line};
use crate::publish::CallError;

use super::{OpsError, Planned, Selection};

/// Keys listed per call.
const PAGE: usize = 1_000;

/// The archive of `config`, or a refusal naming the fix.
pub async fn open(config: &Config) -> Result<Archive, OpsError> {
    let Some(a) = &config.archive else {
        return Err(OpsError::Refused(
            "no archive is enabled: set [archive] bucket = \"...\" (and let the relay run with it) to keep every \
             published event for replays; what was published before that cannot be sent again"
                .into(),
        ));
    };
    Ok(Archive::on_s3(config, a).await)
}

fn s3(e: CallError) -> OpsError {
    OpsError::Refused(format!("the archive could not be read: {e}"))
}

/// A selection's bounds, in microseconds since the epoch (PostgreSQL reads
/// the times, as it does for the table).
#[derive(Debug, Clone, Copy)]
pub struct Bounds {
    pub since_us: Option<i64>,
    pub until_us: i64,
}

impl Bounds {
    pub async fn of(client: &impl GenericClient, selection: &Selection) -> Result<Bounds, OpsError> {
        let r = client
            .query_one(
                "SELECT (extract(epoch FROM $1::text::timestamptz) * 1000000)::bigint,
                        (extract(epoch FROM $2::text::timestamptz) * 1000000)::bigint",
                &[&selection.since, &selection.until],
            )
            .await
            .map_err(super::bad_time)?;
        Ok(Bounds { since_us: r.get(0), until_us: r.get::<_, Option<i64>>(1).unwrap_or(i64::MAX) })
    }
}

/// Whether `selection` takes `line` (a copy of an earlier replay never).
pub fn selects(selection: &Selection, bounds: Bounds, line: &Line) -> bool {
    line.replay_of.is_none()
        && selection.destination.as_ref().is_none_or(|d| &line.destination == d)
        && bounds.since_us.is_none_or(|s| line.published_us >= s)
        && line.published_us < bounds.until_us
        && (selection.event_ids.is_empty() || selection.event_ids.contains(&line.event_id))
        && selection.table.as_ref().is_none_or(|t| line.table.as_ref() == Some(t))
}

/// Where the selection's segments are listed: its destination's folder,
/// or the whole archive.
fn scope(archive: &Archive, selection: &Selection) -> String {
    let prefix = &archive.settings.key_prefix;
    selection.destination.as_deref().map_or_else(|| prefix.clone(), |d| folder(prefix, d))
}

/// The segment's folder (its key up to the last `/`).
fn folder_of(key: &str) -> &str {
    key.rfind('/').map_or("", |i| &key[..=i])
}

/// Up to [`PAGE`] keys of the selection's segments after `cursor`: none
/// written before `since` (its lines were all published before).
async fn next_keys(
    archive: &Archive,
    selection: &Selection,
    bounds: Bounds,
    cursor: Option<&str>,
) -> Result<Vec<String>, OpsError> {
    let scope = scope(archive, selection);
    let start = match (&selection.destination, bounds.since_us) {
        (Some(_), Some(since)) => Some(after(&scope, since)),
        _ => None,
    };
    let mut from = match (cursor, start) {
        (Some(c), Some(s)) => Some(c.to_string().max(s)),
        (c, s) => c.map(str::to_string).or(s),
    };
    let since = bounds.since_us.unwrap_or(i64::MIN);
    loop {
        let keys = archive.store.list(&archive.settings.bucket, &scope, from.as_deref(), PAGE).await.map_err(s3)?;
        let Some(last) = keys.last().cloned() else { return Ok(keys) };
        let kept: Vec<String> =
            keys.into_iter().filter(|k| written_us(folder_of(k), k).is_some_and(|t| t >= since)).collect();
        if !kept.is_empty() {
            return Ok(kept);
        }
        // A page of segments older than `since` (other destinations'
        // folders, listed from their start): on to the next.
        from = Some(last);
    }
}

/// A segment's lines.
async fn read(archive: &Archive, key: &str) -> Result<Vec<Line>, OpsError> {
    let bytes = archive.store.get(&archive.settings.bucket, key).await.map_err(s3)?;
    decode(&bytes).map_err(|e| OpsError::Refused(format!("archive segment {key}: {e}")))
}

/// What the selection would send, per destination it goes to; each event
/// counted once (an event archived twice, sent again after a crash before
/// its settlement, is one event).
pub async fn plan(archive: &Archive, selection: &Selection, bounds: Bounds) -> Result<Vec<Planned>, OpsError> {
    let mut by: std::collections::BTreeMap<String, Planned> = Default::default();
    let mut seen = HashSet::new();
    let mut cursor: Option<String> = None;
    loop {
        let keys = next_keys(archive, selection, bounds, cursor.as_deref()).await?;
        let Some(last) = keys.last().cloned() else { break };
        for key in &keys {
            for line in read(archive, key).await? {
                if !selects(selection, bounds, &line) || !seen.insert(line.event_id.clone()) {
                    continue;
                }
                let to = selection.to.clone().unwrap_or(line.destination);
                let p =
                    by.entry(to.clone()).or_insert(Planned { destination: to, events: 0, bytes: 0, without_group: 0 });
                p.events += 1;
                p.bytes += line.body.len() as i64;
                p.without_group += i64::from(line.group_key.is_none());
            }
        }
        cursor = Some(last);
    }
    Ok(by.into_values().collect())
}

/// Why the archive held nothing for a selection: since when it holds what.
pub async fn nothing_selected(archive: &Archive, selection: &Selection) -> Result<String, OpsError> {
    let scope = scope(archive, selection);
    let first = archive.store.list(&archive.settings.bucket, &scope, None, 1).await.map_err(s3)?;
    let of = selection.destination.as_deref().map_or(String::new(), |d| format!(" of destination {d:?}"));
    let window = archive.settings.window.map_or("off".to_string(), |w| humantime::format_duration(w).to_string());
    Ok(match first.first().and_then(|k| written_us(folder_of(k), k)) {
        Some(us) => format!(
            "no archived event matches: the archive{of} holds events published since {} (archive.window = {window} \
             deletes older ones)",
            humantime::format_rfc3339_seconds(
                std::time::UNIX_EPOCH + std::time::Duration::from_micros(us.max(0) as u64)
            )
        ),
        None => format!(
            "the archive{of} holds nothing: no event was published since [archive] was set, or archive.window = \
             {window} deleted them"
        ),
    })
}

/// The segment a replay is in: its key and lines (kept between
/// transactions, read once).
#[derive(Default)]
pub struct Reading {
    segment: Option<(String, Vec<Line>)>,
    /// Event ids copied by this run: an event archived twice is copied once.
    seen: HashSet<String>,
}

/// One transaction: up to `limit` of the selection's lines past the
/// cursor copied, the cursor and totals moved. Returns the lines copied,
/// and whether any was examined (none: the replay is done).
pub async fn copy_batch(
    client: &mut Client,
    archive: &Archive,
    reading: &mut Reading,
    id: i64,
    limit: i64,
) -> Result<(i64, bool), OpsError> {
    let tx = client.transaction().await?;
    let Some(r) = tx
        .query_opt(
            "SELECT selection::text, cursor_key, cursor_line FROM outbox_replays
              WHERE id = $1 AND state = 'RUNNING' FOR UPDATE",
            &[&id],
        )
        .await?
    else {
        return Ok((0, false));
    };
    let selection: Selection = serde_json::from_str(r.get::<_, &str>(0)).unwrap_or_default();
    let (key, line): (Option<String>, Option<i32>) = (r.get(1), r.get(2));
    let bounds = Bounds::of(&tx, &selection).await?;
    let Some(start) = position(archive, reading, &selection, bounds, key, line.unwrap_or(0) as usize).await? else {
        return Ok((0, false));
    };
    let (key, lines) = reading.segment.as_ref().expect("positioned");
    let mut picked: Vec<&Line> = Vec::new();
    let mut end = start;
    for l in &lines[start..] {
        if picked.len() as i64 >= limit {
            break;
        }
        end += 1;
        if selects(&selection, bounds, l) && reading.seen.insert(l.event_id.clone()) {
            picked.push(l);
        }
    }
    let bytes: i64 = picked.iter().map(|l| l.body.len() as i64).sum();
    insert_copies(&tx, &picked, id, selection.to.as_deref()).await?;
    tx.execute(
        "UPDATE outbox_replays SET cursor_key = $2, cursor_line = $3, copied = copied + $4,
                copied_bytes = copied_bytes + $5, updated_at = now() WHERE id = $1",
        &[&id, key, &(end as i32), &(picked.len() as i64), &bytes],
    )
    .await?;
    crate::faults::crash_point("replay::before_commit");
    tx.commit().await?;
    Ok((picked.len() as i64, true))
}

/// The cursor's segment in `reading`, and the first line not examined;
/// past its last line, the next segment's first. `None`: none is left.
async fn position(
    archive: &Archive,
    reading: &mut Reading,
    selection: &Selection,
    bounds: Bounds,
    mut key: Option<String>,
    mut line: usize,
) -> Result<Option<usize>, OpsError> {
    loop {
        if let Some(k) = &key {
            if reading.segment.as_ref().is_none_or(|(held, _)| held != k) {
                reading.segment = Some((k.clone(), read(archive, k).await?));
            }
            let (_, lines) = reading.segment.as_ref().expect("just read");
            if line < lines.len() {
                return Ok(Some(line));
            }
        }
        let next = next_keys(archive, selection, bounds, key.as_deref()).await?;
        let Some(n) = next.into_iter().next() else { return Ok(None) };
        key = Some(n);
        line = 0;
    }
}

/// The copies of `lines`, in their order, as new outbox rows of replay `id`.
async fn insert_copies(
    tx: &tokio_postgres::Transaction<'_>,
    lines: &[&Line],
    id: i64,
    to: Option<&str>,
) -> Result<(), OpsError> {
    if lines.is_empty() {
        return Ok(());
    }
    let col = |f: fn(&Line) -> Option<&str>| lines.iter().map(|l| f(l)).collect::<Vec<Option<&str>>>();
    tx.execute(
        "INSERT INTO outbox (event_id, destination, body, group_key, attributes, replay_of)
         SELECT u.e || '/replay-' || $6::bigint, coalesce($7, u.d), u.b, u.g, u.a::jsonb, $6
           FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[]) WITH ORDINALITY AS u(e, d, b, g, a, n)
          ORDER BY u.n
         ON CONFLICT (event_id) DO NOTHING",
        &[
            &col(|l| Some(&l.event_id)),
            &col(|l| Some(&l.destination)),
            &col(|l| Some(&l.body)),
            &col(|l| l.group_key.as_deref()),
            &col(|l| l.attributes.as_deref()),
            &id,
            &to,
        ],
    )
    .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    use crate::publish::offload::{MemoryStore, ObjectStore};

    /// Listed past pages of segments older than `since` (every
    /// destination's folder is listed from its start): none is missed.
    #[tokio::test]
    async fn keys_after_a_page_of_old_ones_are_found() {
        let store = Arc::new(MemoryStore::default());
        let archive = Archive::in_memory(&store);
        let key = |dest: &str, t: i64| format!("{}{t:020}-w.jsonl.gz", folder("a/", dest));
        for t in 0..(PAGE as i64 + 5) {
            store.put("b", &key("a", t), bytes::Bytes::new()).await.unwrap();
        }
        store.put("b", &key("b", 5_000), bytes::Bytes::new()).await.unwrap();
        let bounds = Bounds { since_us: Some(4_000), until_us: i64::MAX };
        let all = Selection::default();
        assert_eq!(next_keys(&archive, &all, bounds, None).await.unwrap(), [key("b", 5_000)]);
        assert!(next_keys(&archive, &all, bounds, Some(&key("b", 5_000))).await.unwrap().is_empty());
        let recent = Bounds { since_us: Some(PAGE as i64), until_us: i64::MAX };
        assert_eq!(next_keys(&archive, &all, recent, None).await.unwrap().len(), 6);
    }

    fn line(event_id: &str, published_us: i64) -> Line {
        Line {
            event_id: event_id.into(),
            destination: "orders".into(),
            body: "b".into(),
            group_key: None,
            attributes: None,
            committed_us: published_us,
            published_us,
            table: None,
            replay_of: None,
        }
    }

    #[test]
    fn a_selection_takes_what_it_names_and_never_a_copy() {
        let all = Selection::default();
        let b = Bounds { since_us: Some(10), until_us: 20 };
        assert!(selects(&all, b, &line("a", 10)));
        assert!(!selects(&all, b, &line("a", 9)), "before since");
        assert!(!selects(&all, b, &line("a", 20)), "until is exclusive");
        assert!(!selects(&all, b, &Line { replay_of: Some(1), ..line("a", 15) }), "a copy");
        let one = Selection { event_ids: vec!["b".into()], ..Default::default() };
        assert!(!selects(&one, b, &line("a", 15)));
        let table = Selection { table: Some("public.t".into()), ..Default::default() };
        assert!(!selects(&table, b, &line("a", 15)), "the relay's own table's event");
        assert!(selects(&table, b, &Line { table: Some("public.t".into()), ..line("a", 15) }));
        let other = Selection { destination: Some("billing".into()), ..Default::default() };
        assert!(!selects(&other, b, &line("a", 15)));
    }
}
