//! `outbox-relay replay`: published events sent again, from the rows kept
//! or from the archive.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use outbox_relay::config::{ArchiveConfig, PublishedRows};
use outbox_relay::mapping::{Mapping, Preset};
use outbox_relay::ops::replay::{self, ReplayState, Selection};
use outbox_relay::pipeline::archive::{decode, sweep::sweep_once};
use outbox_relay::publish::entry::REPLAY_ATTRIBUTE;
use outbox_relay::publish::memory::{MemoryPublisher, Sent};
use testkit::*;

const F: &str = "http://memory.invalid/r1/orders.fifo";
const S: &str = "http://memory.invalid/r1/audit";
const FIFO_TOO: &str = "http://memory.invalid/r1/other.fifo";

/// A relay keeping its published rows, streaming to the three queues of
/// the memory publisher.
async fn keeping(name: &str) -> (TestDb, MemoryPublisher, outbox_relay::config::Config, Running) {
    let db = TestDb::new(name).await;
    let p = MemoryPublisher::new();
    for (url, fifo) in [(F, true), (S, false), (FIFO_TOO, true)] {
        p.add_queue(url, fifo, 262_144);
    }
    let mut cfg = config(&db, &[("orders.fifo", F), ("audit", S), ("other.fifo", FIFO_TOO)]);
    cfg.published_rows = PublishedRows::Keep;
    let relay = start(cfg.clone(), Arc::new(p.clone()));
    wait_for("slot created", Duration::from_secs(30), || async { db.confirmed_flush_lsn().await > 0 }).await;
    (db, p, cfg, relay)
}

/// The replay marker a message carries, if any.
fn replay_of(s: &Sent) -> Option<String> {
    s.attributes.iter().find(|a| a.0 == REPLAY_ATTRIBUTE).map(|a| a.2.clone())
}

/// Bodies sent per group, in order, of the messages `pick` takes.
fn by_group(sent: &[Sent], pick: impl Fn(&Sent) -> bool) -> HashMap<String, Vec<String>> {
    let mut groups: HashMap<String, Vec<String>> = HashMap::new();
    for s in sent.iter().filter(|s| pick(s)) {
        groups.entry(s.group_id.clone().unwrap_or_default()).or_default().push(s.body.clone());
    }
    groups
}

/// 2,000 events published to a FIFO queue, then lost by the consumer (a
/// purge): a replay by time range sends each once more, in its group's
/// order, marked, under a deduplication id of its own; an interrupted
/// replay resumes without copying an event twice; a replay to another
/// queue goes there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_purged_queues_events_are_sent_again_once_in_order_and_marked() {
    let (db, p, cfg, relay) = keeping("replay").await;
    let mut c = db.client().await;
    let before: String = c.query_one("SELECT now()::text", &[]).await.unwrap().get(0);
    for t in 0..4 {
        insert_rows(&c, &format!("t{t}"), "orders.fifo", 500, Some(7)).await;
    }
    insert_rows(&c, "other", "audit", 10, None).await;
    wait_for("2,010 published", Duration::from_secs(60), || async { db.count("status = 'PUBLISHED'").await == 2010 })
        .await;
    let originals = p.sent(F);
    assert_eq!(originals.len(), 2000);

    // A dry run says what would go and writes nothing.
    let mut sel =
        Selection { destination: Some("orders.fifo".into()), since: Some(before.clone()), ..Default::default() };
    let planned = replay::plan(&c, &cfg, &mut sel).await.unwrap();
    assert_eq!((planned.len(), planned[0].destination.as_str(), planned[0].events), (1, "orders.fifo", 2000));
    assert!(planned[0].bytes > 0);
    assert_eq!(db.count("replay_of IS NOT NULL").await, 0);

    // Interrupted after its first transaction (the command killed), then resumed.
    let id = replay::start(&c, &sel, &planned).await.unwrap();
    let shown = outbox_relay::ops::status(&c, &cfg).await.unwrap();
    assert_eq!((shown.replays.len(), shown.replays[0].total), (1, 2000), "status shows a replay running");
    let batches = std::sync::atomic::AtomicUsize::new(0);
    let once = |_: &replay::Replay| _ = batches.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let r = replay::run(&mut c, &cfg, id, None, once, || batches.load(std::sync::atomic::Ordering::Relaxed) >= 1)
        .await
        .unwrap();
    assert_eq!((r.state, r.copied), (ReplayState::Running, replay::COPY_BATCH));
    let r = replay::run(&mut c, &cfg, id, None, |_| {}, || false).await.unwrap();
    assert_eq!((r.state, r.copied, r.total), (ReplayState::Done, 2000, 2000));
    assert_eq!(db.count(&format!("replay_of = {id}")).await, 2000, "each event copied once");
    wait_for("the copies sent", Duration::from_secs(60), || async { p.sent(F).len() == 4000 }).await;

    let sent = p.sent(F);
    let again: Vec<&Sent> = sent.iter().filter(|s| replay_of(s).is_some()).collect();
    assert_eq!(again.len(), 2000);
    assert!(again.iter().all(|s| replay_of(s) == Some(id.to_string())), "each says which replay sent it");
    let mut bodies: Vec<&str> = again.iter().map(|s| s.body.as_str()).collect();
    bodies.sort_unstable();
    bodies.dedup();
    assert_eq!(bodies.len(), 2000, "every event once more");
    assert_eq!(
        by_group(&sent, |s| replay_of(s).is_some()),
        by_group(&originals, |_| true),
        "each group again in its commit order"
    );
    let original_dedup: std::collections::HashSet<_> = originals.iter().map(|s| s.dedup_id.clone()).collect();
    assert!(again.iter().all(|s| !original_dedup.contains(&s.dedup_id)), "SQS does not drop them as resends");

    // A later replay of the same range does not select the copies.
    let mut sel2 = Selection { destination: Some("orders.fifo".into()), since: Some(before), ..Default::default() };
    assert_eq!(replay::plan(&c, &cfg, &mut sel2).await.unwrap()[0].events, 2000);

    // One event, to another queue, at a rate.
    let one = originals[17].event_id.clone();
    let mut to = Selection { event_ids: vec![one.clone()], to: Some("audit".into()), ..Default::default() };
    let planned = replay::plan(&c, &cfg, &mut to).await.unwrap();
    assert_eq!((planned[0].destination.as_str(), planned[0].events), ("audit", 1));
    let id2 = replay::start(&c, &to, &planned).await.unwrap();
    assert_eq!(replay::run(&mut c, &cfg, id2, Some(50), |_| {}, || false).await.unwrap().state, ReplayState::Done);
    wait_for("sent to audit", Duration::from_secs(30), || async { p.sent(S).len() == 11 }).await;
    let moved = p.sent(S).into_iter().find(|s| replay_of(s).is_some()).unwrap();
    assert_eq!(moved.body, originals[17].body);
    assert_eq!(replay::list(&c, None).await.unwrap().len(), 2);
    relay.stop().await;
}

/// What a replay cannot do is refused at once, naming the fix.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_that_cannot_run_is_refused_with_the_fix() {
    let (db, _, cfg, relay) = keeping("replayno").await;
    let mut c = db.client().await;
    insert_rows(&c, "n", "audit", 5, None).await;
    wait_for("published", Duration::from_secs(30), || async { db.count("status = 'PUBLISHED'").await == 5 }).await;
    let refused = |e: outbox_relay::ops::OpsError| e.to_string();

    let mut deleting = cfg.clone();
    deleting.published_rows = PublishedRows::Delete;
    let e = refused(replay::plan(&c, &deleting, &mut Selection::default()).await.unwrap_err());
    assert!(e.contains("published_rows") && e.contains("keep") && e.contains("[archive]"), "{e}");
    let mut from_archive = Selection { source: Some(replay::Source::Archive), ..Default::default() };
    let e = refused(replay::plan(&c, &cfg, &mut from_archive).await.unwrap_err());
    assert!(e.contains("no archive is enabled") && e.contains("[archive] bucket"), "{e}");
    let mut one_table = Selection { table: Some("app.outboxevent".into()), ..Default::default() };
    let e = refused(replay::plan(&c, &cfg, &mut one_table).await.unwrap_err());
    assert!(e.contains("--table") && e.contains("--from archive"), "{e}");

    let mut unknown = Selection { destination: Some("nowhere".into()), ..Default::default() };
    let e = refused(replay::plan(&c, &cfg, &mut unknown).await.unwrap_err());
    assert!(e.contains("\"nowhere\" is not configured"), "{e}");

    let mut no_groups =
        Selection { destination: Some("audit".into()), to: Some("other.fifo".into()), ..Default::default() };
    let e = refused(replay::plan(&c, &cfg, &mut no_groups).await.unwrap_err());
    assert!(e.contains("5 of the selected events have no group key"), "{e}");

    let mut future = Selection { since: Some("2999-01-01 00:00:00+00".into()), ..Default::default() };
    let e = refused(replay::plan(&c, &cfg, &mut future).await.unwrap_err());
    assert!(e.contains("5 published events are kept, published from"), "{e}");

    let mut garbled = Selection { since: Some("yesterday-ish".into()), ..Default::default() };
    let e = refused(replay::plan(&c, &cfg, &mut garbled).await.unwrap_err());
    assert!(e.contains("--since/--until") && e.contains("ISO"), "{e}");

    // From the command line: a dry run as JSON, a refusal as exit code 2.
    let env = [
        ("OUTBOX_RELAY_DATABASE_URL", db.url.as_str()),
        ("OUTBOX_RELAY_SLOT", db.slot.as_str()),
        ("OUTBOX_RELAY_PUBLISHED_ROWS", "keep"),
        ("OUTBOX_RELAY_DESTINATIONS_AUDIT", S),
    ];
    let (ok, out, err) = crate::table_path::cli(&["replay", "--destination", "audit", "--dry-run", "--json"], &env);
    assert!(ok, "{err}");
    let planned: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!((planned[0]["destination"].as_str(), planned[0]["events"].as_i64()), (Some("audit"), Some(5)));
    let (ok, _, err) = crate::table_path::cli(&["replay", "--to", "elsewhere"], &env);
    assert!(!ok && err.contains("\"elsewhere\" is not configured"), "{err}");
    let (ok, out, err) = crate::table_path::cli(&["replay", "--destination", "audit"], &env);
    assert!(ok && out.contains("DONE: 5/5 events copied"), "{out} {err}");
    let (ok, out, _) = crate::table_path::cli(&["replay", "list"], &env);
    assert!(ok && out.contains("destination audit"), "{out}");

    // Cancelled: nothing more is copied, and it cannot be resumed.
    let mut all = Selection::default();
    let planned = replay::plan(&c, &cfg, &mut all).await.unwrap();
    let id = replay::start(&c, &all, &planned).await.unwrap();
    assert_eq!(replay::cancel(&c, id).await.unwrap().state, ReplayState::Cancelled);
    assert_eq!(replay::run(&mut c, &cfg, id, None, |_| {}, || false).await.unwrap().copied, 0);
    let e = refused(replay::cancel(&c, id).await.unwrap_err());
    assert!(e.contains("CANCELLED"), "{e}");
    let e = refused(replay::get(&c, 999_999).await.unwrap_err());
    assert!(e.contains("replay list"), "{e}");
    relay.stop().await;
}

const O: &str = "http://memory.invalid/r1/Order";

/// With `published_rows = "delete"`, rows deleted by their own transaction
/// and a Debezium table's insert-and-delete, the tables keep nothing (a
/// topic-payload table keeps its rows, marked); the
/// archive (ministack's S3) has every event settled, and a replay from it
/// sends each once more, marked and in its group's order, resuming where
/// it was interrupted; `--table` takes one mapped table's (Debezium's, the
/// topic-payload one); the window's
/// sweep deletes what is older, and a replay then says what is kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_archive_replays_what_the_tables_deleted() {
    let db = TestDb::new("replay_arch").await;
    crate::mapped::debezium_table(&db).await;
    crate::topic_payload::topic_payload_table(&db, true).await;
    let p = MemoryPublisher::new();
    for (url, fifo) in [(F, true), (S, false), (O, false)] {
        p.add_queue(url, fifo, 262_144);
    }
    let bucket = testkit::create_bucket("archive").await;
    let mut cfg = config(&db, &[("orders.fifo", F), ("audit", S), ("Order", O)]);
    cfg.mapped = vec![
        Mapping::preset(Preset::Debezium, "app", "outboxevent"),
        Mapping::preset(Preset::TopicPayload, "public", "outbox_messages"),
    ];
    cfg.archive = Some(ArchiveConfig {
        bucket: bucket.clone(),
        key_prefix: "it/".into(),
        endpoint_url: Some(stack().sqs_url.clone()),
        window: None,
        flush_interval: Duration::from_millis(50),
        segment_bytes: 1 << 20,
    });
    let relay = start(cfg.clone(), Arc::new(p.clone()));
    wait_for("slot created", Duration::from_secs(30), || async { db.confirmed_flush_lsn().await > 0 }).await;
    let mut c = db.client().await;
    let before: String = c.query_one("SELECT now()::text", &[]).await.unwrap().get(0);
    for t in 0..3 {
        insert_rows(&c, &format!("t{t}"), "orders.fifo", 300, Some(7)).await;
    }
    c.batch_execute(
        "BEGIN;
         INSERT INTO outbox (event_id, destination, body) SELECT 'tr' || i, 'audit', 'tr' || i FROM generate_series(1, 10) i;
         DELETE FROM outbox WHERE event_id LIKE 'tr%';
         COMMIT;
         DO $$ DECLARE eid uuid; BEGIN FOR i IN 1..5 LOOP
             eid := gen_random_uuid();
             INSERT INTO app.outboxevent (id, aggregatetype, aggregateid, type, payload)
             VALUES (eid, 'Order', 'agg' || i, 'OrderShipped', jsonb_build_object('shipped', i));
             DELETE FROM app.outboxevent WHERE id = eid;
         END LOOP; END $$;
         INSERT INTO outbox_messages (topic, payload) SELECT 'audit', jsonb_build_object('tp', i) FROM generate_series(1, 7) i;",
    )
    .await
    .unwrap();
    wait_for("every event published", Duration::from_secs(60), || async {
        (p.sent(F).len(), p.sent(S).len(), p.sent(O).len()) == (900, 17, 5)
    })
    .await;
    wait_for("every row settled, deleted", Duration::from_secs(60), || async { db.count("true").await == 0 }).await;
    let originals = p.sent(F);

    // Every settled event is in the archive.
    let archive = replay::archive::open(&cfg).await.unwrap();
    let keys = archive.store.list(&bucket, "it/", None, 10_000).await.unwrap();
    let mut archived = std::collections::HashSet::new();
    for k in &keys {
        for l in decode(&archive.store.get(&bucket, k).await.unwrap()).unwrap() {
            archived.insert(l.event_id);
        }
    }
    let sent = [p.sent(F), p.sent(S), p.sent(O)].concat();
    assert!(sent.iter().all(|s| archived.contains(&s.event_id)), "an event settled but not archived");

    // The archive is where a replay reads when the table keeps nothing.
    let mut sel = Selection { since: Some(before.clone()), ..Default::default() };
    let planned = replay::plan(&c, &cfg, &mut sel).await.unwrap();
    let counts: Vec<(&str, i64)> = planned.iter().map(|p| (p.destination.as_str(), p.events)).collect();
    assert_eq!(counts, [("Order", 5), ("audit", 17), ("orders.fifo", 900)]);
    assert_eq!(sel.source, Some(replay::Source::Archive));
    let id = replay::start(&c, &sel, &planned).await.unwrap();
    let batches = std::sync::atomic::AtomicUsize::new(0);
    let once = |_: &replay::Replay| _ = batches.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let stop = || batches.load(std::sync::atomic::Ordering::Relaxed) >= 2;
    let r = replay::run(&mut c, &cfg, id, Some(400), once, stop).await.unwrap();
    assert_eq!(r.state, ReplayState::Running, "interrupted");
    assert!(r.copied > 0 && r.copied < 922, "{r:?}");
    let r = replay::run(&mut c, &cfg, id, None, |_| {}, || false).await.unwrap();
    assert_eq!((r.state, r.copied, r.total), (ReplayState::Done, 922, 922));
    wait_for("the copies sent", Duration::from_secs(60), || async {
        (p.sent(F).len(), p.sent(S).len(), p.sent(O).len()) == (1800, 34, 10)
    })
    .await;
    let again = p.sent(F);
    assert_eq!(
        by_group(&again, |s| replay_of(s).is_some()),
        by_group(&originals, |_| true),
        "each group again in its commit order"
    );
    let all = [again, p.sent(S), p.sent(O)].concat();
    let copies: Vec<&Sent> = all.iter().filter(|s| replay_of(s) == Some(id.to_string())).collect();
    assert_eq!(copies.len(), 922, "every event once more, each marked");
    let mut ids: Vec<&str> = copies.iter().map(|s| s.event_id.as_str()).collect();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), 922, "none twice");

    // One mapped table's events; from the command line as JSON.
    let mut one = Selection { table: Some("app.outboxevent".into()), since: Some(before), ..Default::default() };
    let planned = replay::plan(&c, &cfg, &mut one).await.unwrap();
    assert_eq!(planned.iter().map(|p| (p.destination.as_str(), p.events)).collect::<Vec<_>>(), [("Order", 5)]);
    let mut tp = Selection { table: Some("public.outbox_messages".into()), ..Default::default() };
    let planned = replay::plan(&c, &cfg, &mut tp).await.unwrap();
    assert_eq!(planned.iter().map(|p| (p.destination.as_str(), p.events)).collect::<Vec<_>>(), [("audit", 7)]);
    let env = [
        ("OUTBOX_RELAY_DATABASE_URL", db.url.as_str()),
        ("OUTBOX_RELAY_SLOT", db.slot.as_str()),
        ("OUTBOX_RELAY_DESTINATIONS_AUDIT", S),
        ("OUTBOX_RELAY_ARCHIVE_BUCKET", bucket.as_str()),
        ("OUTBOX_RELAY_ARCHIVE_KEY_PREFIX", "it/"),
        ("OUTBOX_RELAY_S3_ENDPOINT_URL", stack().sqs_url.as_str()),
    ];
    let args = ["replay", "--destination", "audit", "--dry-run", "--json"];
    let (ok, out, err) = crate::table_path::cli(&args, &env);
    assert!(ok, "{err}");
    let shown: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(shown[0]["events"].as_i64(), Some(17), "{out}");

    // Past its window, the archive holds nothing, and says so.
    let deleted = sweep_once(&archive, outbox_relay::clock::now_unix_us() + 1).await.unwrap();
    assert_eq!(deleted, archive.store.list(&bucket, "it/", None, 10_000).await.unwrap().len() + deleted);
    assert!(deleted >= keys.len(), "{deleted} of {}", keys.len());
    let e = replay::plan(&c, &cfg, &mut Selection::default()).await.unwrap_err().to_string();
    assert!(e.contains("the archive holds nothing"), "{e}");
    relay.stop().await;
}

/// End to end on ministack, the relay and the command as processes: 2,000
/// events to a FIFO queue through a relay that deletes what it publishes
/// and archives it, the queue purged, then replayed by time range from the
/// archive: the command killed (SIGKILL) mid-way, the relay killed and
/// started again, the replay resumed. Every event arrives once more, each
/// group in its commit order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_survives_kill_9_of_the_command_and_the_relay() {
    use testkit::process::{RelayConfig, RelayProcess};
    // 2,000 here; ministack's FIFO queues take about 370 messages a second
    // and give fewer back, so 20,000 is a manual run:
    // OUTBOX_RELAY_REPLAY_KILL_EVENTS=20000.
    let n: usize = std::env::var("OUTBOX_RELAY_REPLAY_KILL_EVENTS").ok().and_then(|v| v.parse().ok()).unwrap_or(2_000);
    let db = TestDb::new("replay_kill").await;
    let sqs = sqs().await;
    let q = create_queue(&sqs, "replaykill", true, None).await;
    let bucket = testkit::create_bucket("replaykill").await;
    let extra = format!(
        "[archive]\nbucket = \"{bucket}\"\nflush_interval = \"100ms\"\n[s3]\nendpoint_url = \"{}\"",
        stack().sqs_url
    );
    let config = RelayConfig::new(&db, "cdc", &[("orders", &q)], &extra);
    let mut relay = config.spawn();
    wait_for("slot created", Duration::from_secs(60), || async { db.confirmed_flush_lsn().await > 0 }).await;
    let c = db.client().await;
    let before: String = c.query_one("SELECT now()::text", &[]).await.unwrap().get(0);
    let started = std::time::Instant::now();
    for t in 0..4 {
        insert_rows(&c, &format!("k{t}"), "orders", n / 4, Some(10)).await;
    }
    wait_for("every event published and deleted", Duration::from_secs(180), || async { db.count("true").await == 0 })
        .await;
    eprintln!("replay_kill: {n} published in {:?}", started.elapsed());
    sqs.sqs().purge_queue().queue_url(&q).send().await.unwrap();

    let path = config.path.to_str().unwrap().to_string();
    let command = |args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_outbox-relay"))
            .args(args)
            .args(["--config", &path])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };
    let copied = || async {
        let r = c.query_opt("SELECT id, copied FROM outbox_replays ORDER BY id DESC LIMIT 1", &[]).await.unwrap();
        r.map_or((0, 0), |r| (r.get::<_, i64>(0), r.get::<_, i64>(1)))
    };
    let rate = (n / 5).to_string();
    let mut cmd = command(&["replay", "--since", &before, "--rate", &rate]);
    wait_for("a part copied", Duration::from_secs(60), || async { copied().await.1 >= n as i64 / 5 }).await;
    cmd.kill().unwrap();
    cmd.wait().unwrap();
    relay.kill();
    let (id, at_kill) = copied().await;
    assert!(at_kill < n as i64, "killed before the end: {at_kill}");
    relay = RelayProcess::spawn(&config.path, &[]);
    let out = command(&["replay", "resume", &id.to_string()]).wait_with_output().unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{said} {}", String::from_utf8_lossy(&out.stderr));
    assert!(said.contains(&format!("DONE: {n}/{n} events copied")), "{said}");

    eprintln!("replay_kill: replayed in {:?}", started.elapsed());
    let mut last: HashMap<String, (usize, usize)> = HashMap::new();
    let mut seen = std::collections::HashSet::new();
    let (mut messages, end) = (0, std::time::Instant::now() + Duration::from_secs(240));
    while seen.len() < n && std::time::Instant::now() < end {
        let round = receive_round(&sqs, &q, 1).await.unwrap();
        messages += round.messages.len();
        for (body, group) in round.messages {
            let (tag, i) = body.split_once(':').unwrap();
            let at = (tag.trim_start_matches('k').parse::<usize>().unwrap(), i.parse::<usize>().unwrap());
            if seen.insert(body) {
                let before = last.insert(group.clone().unwrap(), at);
                assert!(before.is_none_or(|b| b < at), "group {group:?}: {at:?} after {before:?}");
            }
        }
    }
    eprintln!("replay_kill: {messages} messages received in {:?}", started.elapsed());
    assert_eq!(seen.len(), n, "every event once more");
    relay.kill();
}
