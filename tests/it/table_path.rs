//! The table path: spooling lanes, polling relays side by side, slot creation
//! and loss, and the operator commands that act on the table.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use outbox_relay::config::{Mode, PublishedRows};
use outbox_relay::publish::memory::MemoryPublisher;
use outbox_relay::publish::CallError;
use testkit::*;

const A: &str = "http://memory.invalid/a";
const B: &str = "http://memory.invalid/b";
const C: &str = "http://memory.invalid/c";

fn gauge(metrics: &str, line_prefix: &str) -> Option<f64> {
    metrics.lines().find_map(|l| l.strip_prefix(line_prefix)).and_then(|v| v.trim().parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sick_lane_spools_the_slot_moves_on_and_it_streams_again_once_drained() {
    let db = TestDb::new("spool").await;
    let p = MemoryPublisher::new();
    for q in [A, B, C] {
        p.add_queue(q, false, 262_144);
    }
    let mut cfg = config(&db, &[("a", A), ("b", B), ("c", C)]);
    cfg.lane_stall_timeout = Duration::from_secs(1);
    cfg.retry_base = Duration::from_millis(200);
    cfg.retry_max = Duration::from_secs(1);
    let relay = start(cfg, Arc::new(p.clone()));
    wait_for("slot created", Duration::from_secs(30), || async { db.confirmed_flush_lsn().await > 0 }).await;
    let c = db.client().await;

    p.break_queue(
        B,
        CallError {
            code: "AWS.SimpleQueueService.NonExistentQueue".into(),
            message: "gone".into(),
            sender_fault: true,
        },
    );
    for k in 0..10 {
        insert_rows(&c, &format!("a{k}"), "a", 50, None).await;
        insert_rows(&c, &format!("b{k}"), "b", 50, None).await;
        insert_rows(&c, &format!("c{k}"), "c", 50, None).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Healthy lanes deliver while b is down.
    wait_for("a and c delivered", Duration::from_secs(30), || async {
        p.sent(A).len() == 500 && p.sent(C).len() == 500
    })
    .await;
    wait_for("b spools", Duration::from_secs(30), || async {
        gauge(&relay.metrics.render(), "outbox_relay_lane_spooled{destination=\"b\"}") == Some(1.0)
    })
    .await;
    // The slot moves past b's unsent rows.
    let after = db.current_lsn().await;
    wait_for("slot confirmed past every insert while b is down", Duration::from_secs(30), || async {
        db.confirmed_flush_lsn().await >= after
    })
    .await;
    assert_eq!(p.sent(B).len(), 0);
    let spooled = db.count("destination = 'b' AND status = 'NEW' AND next_attempt_at IS NOT NULL").await;
    assert_eq!(spooled, 500, "every b row waits in the table");
    // Rows arriving for a spooling lane go to the table at once.
    insert_rows(&c, "late", "b", 20, None).await;
    wait_for("late rows spooled", Duration::from_secs(10), || async {
        db.count("destination = 'b' AND status = 'NEW' AND next_attempt_at IS NOT NULL").await == 520
    })
    .await;

    p.fix_queue(B);
    wait_for("b drained from the table", Duration::from_secs(60), || async { db.count("status = 'NEW'").await == 0 })
        .await;
    wait_for("b streams again", Duration::from_secs(30), || async {
        gauge(&relay.metrics.render(), "outbox_relay_lane_spooled{destination=\"b\"}") == Some(0.0)
    })
    .await;
    insert_rows(&c, "after", "b", 30, None).await;
    wait_for("b streams new rows", Duration::from_secs(30), || async { db.count("status = 'NEW'").await == 0 }).await;
    let sent: HashSet<String> = p.sent(B).into_iter().map(|s| s.body).collect();
    assert_eq!(sent.len(), 550, "every b row arrived");
    assert_eq!(db.count("status = 'DEAD'").await, 0, "transient failures never make rows DEAD");
    // Streamed again, not spooled: no next_attempt_at on the newest rows.
    assert_eq!(db.count("event_id LIKE 'after:%' AND next_attempt_at IS NOT NULL").await, 0);
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_polling_relays_at_once_deliver_every_row_once() {
    let db = TestDb::new("twopoll").await;
    let sqs = sqs().await;
    let q = create_queue(&sqs, "twopoll", false, None).await;
    let fifo = create_queue(&sqs, "twopoll", true, None).await;
    let mut cfg = config(&db, &[("orders", &q), ("billing", &fifo)]);
    cfg.mode = Mode::Polling;
    cfg.poll_interval = Duration::from_millis(20);
    let r1 = start(cfg.clone(), Arc::new(sqs.clone()));
    let r2 = start(cfg, Arc::new(sqs.clone()));
    let c = db.client().await;
    for k in 0..10 {
        insert_rows(&c, &format!("o{k}"), "orders", 300, None).await;
        insert_rows(&c, &format!("b{k}"), "billing", 50, Some(5)).await;
    }
    wait_for("every row published", Duration::from_secs(120), || async { db.count("status = 'NEW'").await == 0 }).await;
    let got = receive_all(&sqs, &q, 3_000, Duration::from_secs(60)).await;
    let extra = receive_all(&sqs, &q, usize::MAX, Duration::from_secs(2)).await;
    let unique: HashSet<&str> = got.iter().map(|(b, _)| b.as_str()).collect();
    assert_eq!(unique.len(), 3_000);
    assert_eq!(got.len() + extra.len(), 3_000, "no row sent twice by the two relays");
    let billing = receive_all(&sqs, &fifo, 500, Duration::from_secs(60)).await;
    assert_eq!(billing.len(), 500);
    let m1 = r1.metrics.render();
    let m2 = r2.metrics.render();
    let n1 = gauge(&m1, "outbox_relay_events_published_total{destination=\"orders\"}").unwrap_or(0.0);
    let n2 = gauge(&m2, "outbox_relay_events_published_total{destination=\"orders\"}").unwrap_or(0.0);
    assert_eq!(n1 + n2, 3_000.0);
    eprintln!("two polling relays: {n1} + {n2} orders rows");
    r1.stop().await;
    r2.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_dropped_under_a_running_relay_is_recreated_and_nothing_is_lost() {
    let db = TestDb::new("slotdrop").await;
    let p = MemoryPublisher::new();
    p.add_queue(A, false, 262_144);
    let relay = start(config(&db, &[("a", A)]), Arc::new(p.clone()));
    wait_for("slot created", Duration::from_secs(30), || async { db.confirmed_flush_lsn().await > 0 }).await;
    let c = db.client().await;
    let writer = {
        let c = db.client().await;
        tokio::spawn(async move {
            for k in 0..40 {
                insert_rows(&c, &format!("w{k}"), "a", 50, None).await;
                tokio::time::sleep(Duration::from_millis(25)).await;
            }
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    // What an operator (or max_slot_wal_keep_size) does: the walsender goes,
    // then the slot.
    let admin = outbox_relay::db::connect(&stack().pg_url).await.unwrap();
    for _ in 0..50 {
        admin
            .execute("SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE slot_name = $1 AND active_pid IS NOT NULL", &[&db.slot])
            .await
            .unwrap();
        if admin
            .execute("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = $1 AND NOT active", &[&db.slot])
            .await
            .unwrap()
            == 1
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    writer.await.unwrap();
    wait_for("every row published", Duration::from_secs(60), || async { db.count("status = 'NEW'").await == 0 }).await;
    let sent: HashSet<String> = p.sent(A).into_iter().map(|s| s.body).collect();
    assert_eq!(sent.len(), 2_000, "every row arrived across the slot's loss");
    let m = relay.metrics.render();
    assert_eq!(gauge(&m, "outbox_relay_slot_recreated_total{reason=\"dropped\"}"), Some(1.0), "{m}");
    let _ = c;
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_written_before_slot_create_are_delivered() {
    let db = TestDb::new("slotcreate").await;
    let p = MemoryPublisher::new();
    p.add_queue(A, false, 262_144);
    let c = db.client().await;
    insert_rows(&c, "before", "a", 300, None).await;
    let cfg = config(&db, &[("a", A)]);
    let created = outbox_relay::ops::slot_create(&cfg).await.unwrap();
    assert_eq!(created.handed_to_table, 300);
    let err = outbox_relay::ops::slot_create(&cfg).await.unwrap_err().to_string();
    assert!(err.contains("already exists"), "{err}");
    insert_rows(&c, "after", "a", 200, None).await;
    let relay = start(cfg, Arc::new(p.clone()));
    wait_for("every row published", Duration::from_secs(60), || async { db.count("status = 'NEW'").await == 0 }).await;
    let sent: Vec<String> = p.sent(A).into_iter().map(|s| s.body).collect();
    let unique: HashSet<&String> = sent.iter().collect();
    assert_eq!(unique.len(), 500);
    assert_eq!(sent.len(), 500, "the table path and the stream never both send a row");
    relay.stop().await;
}

/// Run the built binary; returns (status, stdout, stderr).
pub(crate) fn cli(args: &[&str], env: &[(&str, &str)]) -> (bool, String, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_outbox-relay"))
        .args(args)
        .envs(env.iter().copied())
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_redrive_sends_a_fixed_row_again_and_status_json_is_stable() {
    let db = TestDb::new("redrive").await;
    let p = MemoryPublisher::new();
    p.add_queue(A, false, 262_144);
    let relay = start(config(&db, &[("a", A)]), Arc::new(p.clone()));
    let c = db.client().await;
    c.batch_execute(
        "INSERT INTO outbox (event_id, destination, body) VALUES ('fixme', 'a', E'bell\\007');
         INSERT INTO outbox (event_id, destination, body) VALUES ('ok', 'a', 'ok');",
    )
    .await
    .unwrap();
    wait_for("bad row DEAD", Duration::from_secs(30), || async { db.count("status = 'DEAD'").await == 1 }).await;

    let env = [
        ("OUTBOX_RELAY_DATABASE_URL", db.url.as_str()),
        ("OUTBOX_RELAY_SLOT", db.slot.as_str()),
        ("OUTBOX_RELAY_DESTINATIONS_A", A),
    ];
    let (ok, out, err) = cli(&["dead", "list"], &env);
    assert!(ok, "{err}");
    assert!(out.contains("fixme") && out.contains("invalid_characters"), "{out}");
    let (ok, out, _) = cli(&["dead", "list", "--json"], &env);
    assert!(ok);
    let rows: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(rows[0]["event_id"], "fixme");

    let (ok, out, _) = cli(&["status", "--json"], &env);
    assert!(ok);
    let s: outbox_relay::ops::Status =
        serde_json::from_str(&out).expect("status --json parses into its documented type");
    assert_eq!((s.format, s.mode, s.effective_mode), (1, Mode::Cdc, Mode::Cdc));
    assert!(s.slot.exists && s.slot.active == Some(true));
    let a = s.destinations.iter().find(|d| d.destination == "a").unwrap();
    assert_eq!((a.dead, a.spooled, a.configured), (1, 0, true));
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        (v["mode"].as_str(), v["effective_mode"].as_str()),
        (Some("cdc"), Some("cdc")),
        "modes as before: {out}"
    );
    for key in ["format", "mode", "effective_mode", "cdc_unavailable", "slot", "destinations"] {
        assert!(v.get(key).is_some(), "status --json lacks {key}: {out}");
    }
    let (ok, text, _) = cli(&["status"], &env);
    assert!(ok && text.contains("mode: cdc") && text.contains("spooled"), "{text}");

    // Refuses to redrive everything by accident.
    let (ok, _, err) = cli(&["dead", "redrive"], &env);
    assert!(!ok && err.contains("--all"), "{err}");
    // The operator fixes the row, then redrives it.
    c.batch_execute("UPDATE outbox SET body = 'fixed' WHERE event_id = 'fixme'").await.unwrap();
    let id: i64 = c.query_one("SELECT id FROM outbox WHERE event_id = 'fixme'", &[]).await.unwrap().get(0);
    let (ok, out, err) = cli(&["dead", "redrive", "--id", &id.to_string()], &env);
    assert!(ok, "{err}");
    assert!(out.contains("redrove 1"), "{out}");
    wait_for("redriven row published", Duration::from_secs(30), || async { db.count("event_id = 'fixme'").await == 0 })
        .await;
    assert!(p.sent(A).iter().any(|s| s.body == "fixed"));

    // slot status / drop refuse while the relay reads it.
    let (ok, out, _) = cli(&["slot", "status"], &env);
    assert!(ok && out.contains("active"), "{out}");
    let (ok, _, err) = cli(&["slot", "drop"], &env);
    assert!(!ok && err.contains("in use"), "{err}");
    relay.stop().await;
    // Stopped: the slot can be dropped.
    wait_for("slot inactive", Duration::from_secs(10), || async {
        let (_, out, _) = cli(&["slot", "status", "--json"], &env);
        out.contains("\"active\": false")
    })
    .await;
    let (ok, out, err) = cli(&["slot", "drop"], &env);
    assert!(ok, "{err}");
    assert!(out.contains("dropped"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_deletes_only_old_published_rows() {
    let db = TestDb::new("retention").await;
    let c = db.client().await;
    insert_rows(&c, "x", "a", 2_500, None).await;
    c.batch_execute(
        "UPDATE outbox SET created_at = now() - interval '9 days' WHERE id < (SELECT min(id) + 2000 FROM outbox);
         UPDATE outbox SET status = 'PUBLISHED', published_at = now() - interval '8 days' WHERE id % 2 = 0 AND created_at < now() - interval '8 days';
         UPDATE outbox SET status = 'PUBLISHED', published_at = now() WHERE id % 2 = 1 AND id % 5 = 0;
         UPDATE outbox SET status = 'DEAD' WHERE id % 7 = 0 AND status = 'NEW';",
    )
    .await
    .unwrap();
    let old = db.count("status = 'PUBLISHED' AND published_at < now() - interval '7 days'").await;
    let before = db.count("true").await;
    let n = outbox_relay::runtime::sweep_once(&c, Duration::from_secs(7 * 86_400)).await.unwrap();
    assert_eq!(n as i64, old);
    assert_eq!(db.count("true").await, before - old);
    assert_eq!(db.count("status = 'PUBLISHED' AND published_at < now() - interval '7 days'").await, 0);
    assert!(db.count("status = 'PUBLISHED'").await > 0, "recent PUBLISHED rows stay");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_mode_polls_when_the_role_may_not_replicate_and_streams_when_it_may() {
    let db = TestDb::new("auto").await;
    let p = MemoryPublisher::new();
    p.add_queue(A, false, 262_144);
    let c = db.client().await;
    let role = format!("r_{}", db.name);
    c.batch_execute(&format!("CREATE ROLE {role} LOGIN; GRANT SELECT, INSERT, UPDATE, DELETE ON outbox TO {role}; GRANT SELECT, INSERT, DELETE ON outbox_published_runs TO {role}; GRANT SELECT, INSERT, DELETE ON outbox_relay_handoffs TO {role}")).await.unwrap();
    insert_rows(&c, "x", "a", 100, None).await;

    let mut cfg = config(&db, &[("a", A)]);
    cfg.mode = Mode::Auto;
    cfg.database_url = db.url.replacen("postgres@", &format!("{role}@"), 1);
    let relay = start(cfg, Arc::new(p.clone()));
    wait_for("published by polling", Duration::from_secs(30), || async { db.count("status = 'NEW'").await == 0 }).await;
    let m = relay.metrics.render();
    assert!(m.contains("outbox_relay_mode{mode=\"polling\"} 1"), "{m}");
    assert_eq!(db.confirmed_flush_lsn().await, 0, "no slot was created");
    relay.stop().await;

    let mut cfg = config(&db, &[("a", A)]);
    cfg.mode = Mode::Auto;
    let relay = start(cfg, Arc::new(p.clone()));
    insert_rows(&c, "y", "a", 100, None).await;
    wait_for("published by the stream", Duration::from_secs(30), || async { db.count("status = 'NEW'").await == 0 })
        .await;
    let m = relay.metrics.render();
    assert!(m.contains("outbox_relay_mode{mode=\"cdc\"} 1"), "{m}");
    assert!(db.confirmed_flush_lsn().await > 0);
    assert_eq!(p.sent(A).len(), 200);
    relay.stop().await;
    c.batch_execute(&format!("DROP OWNED BY {role}; DROP ROLE {role}")).await.unwrap();
}

/// The stream can hand over a row whose commit it decoded before the commit
/// is visible to other sessions; marking must wait for it, not skip it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn marking_a_row_not_yet_visible_waits_for_it() {
    use outbox_relay::pipeline::settle::{mark, Outcome, Settlement};
    let db = TestDb::new("visible").await;
    let writer = db.client().await;
    writer
        .batch_execute("BEGIN; INSERT INTO outbox (event_id, destination, body) VALUES ('late', 'a', 'x')")
        .await
        .unwrap();
    let id: i64 = writer.query_one("SELECT id FROM outbox WHERE event_id = 'late'", &[]).await.unwrap().get(0);
    let xid = stream_xid(&writer).await;
    let marker = db.client().await;
    let task = tokio::spawn(async move {
        let s = published(id, "late", xid);
        mark(&marker, &[s], marking(PublishedRows::Keep), &mut Default::default()).await.unwrap()
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    writer.batch_execute("COMMIT").await.unwrap();
    let report = task.await.unwrap();
    assert_eq!(report.marked, 1, "the row was marked once it became visible: {report:?}");
    assert!(report.waits > 0, "{report:?}");
    assert_eq!(db.count("event_id = 'late' AND status = 'PUBLISHED'").await, 1);

    // A row settled before (a replay) is left as it is.
    let c = db.client().await;
    let s = Settlement::new(
        stream_event(id, "late", xid),
        None,
        Arc::from("a"),
        Outcome::Dead(outbox_relay::policy::dead::DeadReason::new(
            outbox_relay::policy::dead::DeadCode::SqsRejected,
            "y",
        )),
    );
    let report = mark(&c, &[s], marking(PublishedRows::Keep), &mut Default::default()).await.unwrap();
    assert_eq!((report.marked, report.gone, report.waits), (0, 1, 0));
    assert_eq!(db.count("event_id = 'late' AND status = 'PUBLISHED'").await, 1);
}

/// A settlement of row `id` as published, read from the stream in transaction `xid`.
fn published(id: i64, event_id: &str, xid: u32) -> outbox_relay::pipeline::settle::Settlement {
    use outbox_relay::pipeline::settle::{Outcome, Settlement};
    Settlement::new(stream_event(id, event_id, xid), None, Arc::from("a"), Outcome::Published)
}

/// Row `id` as the stream reads it: inserted by transaction `xid`, committed
/// at the start of WAL (any run of published ids comes after it).
fn stream_event(id: i64, event_id: &str, xid: u32) -> Arc<outbox_relay::event::OutboxEvent> {
    let commit = outbox_relay::event::Commit { xid, lsn: replication::Lsn(1), seq: 0 };
    Arc::new(outbox_relay::event::OutboxEvent {
        event_id: event_id.into(),
        destination: "a".into(),
        body: "x".into(),
        group_key: None,
        attributes: None,
        commit_time_us: 0,
        deliver_at: Default::default(),
        replay_of: None,
        origin: outbox_relay::event::Origin::Own { id, commit: Some(commit) },
    })
}

/// Marking with a test backoff, published rows kept or deleted.
fn marking(published: PublishedRows) -> outbox_relay::pipeline::settle::Marking {
    outbox_relay::pipeline::settle::Marking {
        base: Duration::from_secs(1),
        max: Duration::from_secs(2),
        published,
        bound_unpositioned: false,
    }
}

/// The low 32 bits of the current transaction's id, as pgoutput's Begin gives it.
async fn stream_xid(c: &tokio_postgres::Client) -> u32 {
    let full: i64 = c.query_one("SELECT txid_current()", &[]).await.unwrap().get(0);
    (full & 0xFFFF_FFFF) as u32
}

/// A row deleted before it was marked costs one query, not a wait: the
/// inserting transaction is visible, so its absence means it was deleted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn marking_a_deleted_row_does_not_wait() {
    use outbox_relay::pipeline::settle::{mark, Settlement};
    let db = TestDb::new("vanished").await;
    let c = db.client().await;
    c.batch_execute("BEGIN").await.unwrap();
    let xid = stream_xid(&c).await;
    let ids: Vec<i64> = c
        .query("INSERT INTO outbox (event_id, destination, body) SELECT 'v' || i, 'a', 'x' FROM generate_series(1, 3) i RETURNING id", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    // The first row is deleted by its own transaction (transient), the second later.
    c.execute("DELETE FROM outbox WHERE id = $1", &[&ids[0]]).await.unwrap();
    c.batch_execute("COMMIT").await.unwrap();
    c.execute("DELETE FROM outbox WHERE id = $1", &[&ids[1]]).await.unwrap();
    let batch: Vec<Settlement> =
        ids.iter().enumerate().map(|(i, &id)| published(id, &format!("v{}", i + 1), xid)).collect();
    let report = mark(&c, &batch, marking(PublishedRows::Delete), &mut Default::default()).await.unwrap();
    let expected = outbox_relay::pipeline::settle::MarkReport { marked: 1, gone: 2, ..Default::default() };
    assert_eq!(report, expected);
    assert_eq!(db.count("true").await, 0, "the published row is deleted");
    let runs: Vec<(i64, i64)> = c
        .query("SELECT lo, hi FROM outbox_published_runs", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(runs, vec![(ids[2], ids[2])], "its id is recorded for the replay filter");
}

/// The holder rule's SQL and its reading of a decoded row agree on every
/// status and `next_attempt_at` a row can have: the stream's skip and the
/// statements cannot split.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rows_holder_reads_the_same_in_sql_and_in_the_stream() {
    use outbox_relay::db::settled::Holder;
    let db = TestDb::new("holder").await;
    let c = db.client().await;
    let mut rows = Vec::new();
    for status in ["NEW", "PUBLISHED", "DEAD"] {
        for due in [false, true] {
            let id: i64 = c
                .query_one(
                    "INSERT INTO outbox (event_id, destination, body, status, next_attempt_at)
                     VALUES ($1, 'h', 'x', $2, CASE WHEN $3 THEN now() END) RETURNING id",
                    &[&format!("{status}:{due}"), &status, &due],
                )
                .await
                .unwrap()
                .get(0);
            rows.push((id, Holder::of(Some(status), due)));
        }
    }
    for holder in [Holder::Stream, Holder::Table, Holder::Settled] {
        let sql = format!("SELECT id FROM outbox WHERE {} ORDER BY id", holder.sql(""));
        let found: Vec<i64> = c.query(&sql, &[]).await.unwrap().iter().map(|r| r.get(0)).collect();
        let expected: Vec<i64> = rows.iter().filter(|r| r.1 == holder).map(|r| r.0).collect();
        assert_eq!(found, expected, "{holder:?}");
        assert!(!expected.is_empty(), "{holder:?} has a row");
    }
}
