//! The relay against the real PostgreSQL and ministack started by the harness.
//! The suite runs in both modes: CDC (the slot) and polling (the table).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use outbox_relay::config::Mode;
use outbox_relay::publish::aws::AwsPublisher;
use testkit::process::RelayConfig;
use testkit::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cdc_thousands_of_rows_over_several_destinations_arrive_and_bad_rows_go_dead() {
    thousands_of_rows(Mode::Cdc).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn polling_thousands_of_rows_over_several_destinations_arrive_and_bad_rows_go_dead() {
    thousands_of_rows(Mode::Polling).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cdc_kill_9_mid_stream_then_restart_loses_nothing() {
    kill_9_mid_stream(Mode::Cdc).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn polling_kill_9_mid_stream_then_restart_loses_nothing() {
    kill_9_mid_stream(Mode::Polling).await;
}

async fn thousands_of_rows(mode: Mode) {
    let db = TestDb::new(&format!("e2e_{mode}")).await;
    let sqs = sqs().await;
    let orders = create_queue(&sqs, "orders", false, None).await;
    let audit = create_queue(&sqs, "audit", false, Some(1024)).await;
    let billing = create_queue(&sqs, "billing", true, None).await;
    let c = db.client().await;
    // Written before the relay (and its slot) exist: caught up from the table.
    insert_rows(&c, "early", "orders", 200, None).await;

    let mut cfg = config(&db, &[("orders", &orders), ("audit", &audit), ("billing", &billing)]);
    cfg.mode = mode;
    let relay = start(cfg, Arc::new(sqs.clone()));
    for round in 0..4 {
        insert_rows(&c, &format!("o{round}"), "orders", 500, None).await;
        insert_rows(&c, &format!("a{round}"), "audit", 300, None).await;
        insert_rows(&c, &format!("b{round}"), "billing", 200, Some(7)).await;
    }
    insert_refused_among_good(&c).await;

    let total_good = 200 + 4 * (500 + 300 + 200) + 2;
    wait_for("every row settled", Duration::from_secs(120), || async { db.count("status = 'NEW'").await == 0 }).await;
    // Published rows are deleted: what is left is DEAD.
    assert_eq!(db.count("status <> 'DEAD'").await, 0, "{total_good} good rows published");
    dead_with_their_reasons(&db).await;
    every_good_row_in_its_queue(&sqs, &orders, &audit, &billing).await;

    let m = relay.metrics.render();
    assert!(m.contains("outbox_relay_events_published_total{destination=\"orders\"} 2201"), "{m}");
    assert!(m.contains("outbox_relay_events_dead_total{destination=\"audit\",reason=\"too_large\"} 1"));
    assert!(m.contains(&format!("outbox_relay_mode{{mode=\"{mode}\"}} 1")), "{m}");
    if mode == Mode::Polling {
        // Polling never creates or reads a slot.
        assert_eq!(db.confirmed_flush_lsn().await, 0);
        relay.stop().await;
        return;
    }
    // The slot moved past everything.
    let after = db.current_lsn().await;
    wait_for("slot confirmed past the last insert", Duration::from_secs(20), || async {
        db.confirmed_flush_lsn().await >= after
    })
    .await;
    relay.stop().await;
}

/// Rows SQS would refuse, among good ones in the same transaction.
async fn insert_refused_among_good(c: &tokio_postgres::Client) {
    c.batch_execute(
        "BEGIN;
         INSERT INTO outbox (event_id, destination, body) VALUES ('bad:nowhere', 'nowhere', 'x');
         INSERT INTO outbox (event_id, destination, body) VALUES ('bad:char', 'orders', E'bell\\007');
         INSERT INTO outbox (event_id, destination, body) VALUES ('bad:big', 'audit', repeat('é', 600));
         INSERT INTO outbox (event_id, destination, body) VALUES ('bad:nogroup', 'billing', 'x');
         INSERT INTO outbox (event_id, destination, body, attributes)
              VALUES ('bad:attrs', 'orders', 'x', (SELECT jsonb_object_agg('k' || i, 'v') FROM generate_series(1, 11) i));
         INSERT INTO outbox (event_id, destination, body, attributes) VALUES ('good:attrs', 'orders', 'good:attrs', '{\"kind\": \"x\", \"n\": 5}');
         INSERT INTO outbox (event_id, destination, body) VALUES ('good:multibyte', 'audit', repeat('é', 500));
         COMMIT;",
    )
    .await
    .unwrap();
}

/// The five refused rows are DEAD, each with its reason.
async fn dead_with_their_reasons(db: &TestDb) {
    let c2 = db.client().await;
    let dead: HashMap<String, String> = c2
        .query("SELECT event_id, last_error FROM outbox WHERE status = 'DEAD'", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(dead.len(), 5, "{dead:?}");
    assert!(dead["bad:nowhere"].starts_with("unknown_destination"));
    assert!(dead["bad:char"].starts_with("invalid_characters"));
    assert!(dead["bad:big"].starts_with("too_large"));
    assert!(dead["bad:nogroup"].starts_with("fifo_without_group"));
    assert!(dead["bad:attrs"].starts_with("invalid_attributes"));
}

/// Every good row is in its queue; FIFO: every message, each group in
/// commit order.
async fn every_good_row_in_its_queue(sqs: &AwsPublisher, orders: &str, audit: &str, billing: &str) {
    let got_orders = receive_all(sqs, orders, 200 + 2000 + 1, Duration::from_secs(60)).await;
    let ids: HashSet<&str> = got_orders.iter().map(|(b, _)| b.as_str()).collect();
    assert_eq!(ids.len(), 200 + 2000 + 1);
    assert!(ids.contains("early:1") && ids.contains("o3:500") && ids.contains("good:attrs"));
    let got_audit = receive_all(sqs, audit, 1201, Duration::from_secs(60)).await;
    assert_eq!(got_audit.iter().map(|(b, _)| b.as_str()).collect::<HashSet<_>>().len(), 1201);
    let got_billing = receive_all(sqs, billing, 800, Duration::from_secs(60)).await;
    assert_eq!(got_billing.len(), 800);
    let mut per_group: HashMap<String, Vec<(usize, usize)>> = HashMap::new();
    for (body, group) in &got_billing {
        let (round, i) = body.trim_start_matches('b').split_once(':').unwrap();
        per_group
            .entry(group.clone().expect("group id"))
            .or_default()
            .push((round.parse().unwrap(), i.parse().unwrap()));
    }
    for (g, seq) in &per_group {
        let mut sorted = seq.clone();
        sorted.sort();
        assert_eq!(seq, &sorted, "group {g} out of commit order");
    }
}

async fn kill_9_mid_stream(mode: Mode) {
    let db = TestDb::new(&format!("kill_{mode}")).await;
    let sqs = sqs().await;
    let q = create_queue(&sqs, "kill", false, None).await;
    let config = RelayConfig::new(&db, &mode.to_string(), &[("orders", &q)], "");
    let spawn = || config.spawn();
    let relay = spawn();
    let c = db.client().await;
    let total = 6_000usize;
    let writer = {
        let c = db.client().await;
        tokio::spawn(async move {
            for k in 0..60 {
                insert_rows(&c, &format!("k{k}"), "orders", 100, None).await;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    };
    wait_for("some rows published", Duration::from_secs(60), || async { db.published().await >= 1_000 }).await;
    relay.kill(); // SIGKILL
    let published_at_kill = db.published().await;
    writer.await.unwrap();
    let relay = spawn();
    wait_for("every row published after restart", Duration::from_secs(120), || async { db.count("true").await == 0 })
        .await;
    let got = receive_all(&sqs, &q, total, Duration::from_secs(90)).await;
    // Drain stragglers (duplicates) for a moment.
    let extra = receive_all(&sqs, &q, usize::MAX, Duration::from_secs(2)).await;
    let all: Vec<&str> = got.iter().chain(extra.iter()).map(|(b, _)| b.as_str()).collect();
    let unique: HashSet<&str> = all.iter().copied().collect();
    eprintln!(
        "{mode}: kill -9 after {published_at_kill} of {total} published: {} messages received, {} unique, {} duplicates",
        all.len(),
        unique.len(),
        all.len() - unique.len()
    );
    assert_eq!(unique.len(), total, "every committed row arrives");
    let _ = c;

    // Graceful shutdown: SIGTERM, exit 0 within a few seconds.
    let status = relay.terminate(Duration::from_secs(10)).await.expect("relay exits within 10 s of SIGTERM");
    assert!(status.success(), "exit status {status:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn start_up_refuses_with_a_fix() {
    let db = TestDb::new("refuse").await;
    let sqs = sqs().await;
    let q = create_queue(&sqs, "ok", false, None).await;
    // A queue that does not exist.
    let cfg = config(&db, &[("orders", &q), ("ghost", &format!("{}/000000000000/no-such-queue", stack().sqs_url))]);
    let err = start_up_error(cfg, Arc::new(sqs.clone())).await;
    assert!(err.contains("destination \"ghost\"") && err.contains("GetQueueAttributes"), "{err}");
    // A missing publication.
    let mut cfg = config(&db, &[("orders", &q)]);
    cfg.publication = "nope".into();
    let err = start_up_error(cfg, Arc::new(sqs.clone())).await;
    assert!(err.contains("publication \"nope\" does not exist"), "{err}");
    // A role that may not replicate.
    let c = db.client().await;
    let role = format!("r_{}", db.name);
    c.batch_execute(&format!("CREATE ROLE {role} LOGIN; GRANT SELECT, UPDATE ON outbox TO {role}")).await.unwrap();
    let mut cfg = config(&db, &[("orders", &q)]);
    cfg.database_url = db.url.replacen("postgres@", &format!("{role}@"), 1);
    let err = start_up_error(cfg.clone(), Arc::new(sqs.clone())).await;
    assert!(err.contains("may not replicate") && err.contains("ALTER ROLE"), "{err}");
    // The same role on RDS or Aurora (told by the setting only they define):
    // the fix is the rds_replication role, which is all RDS allows.
    c.batch_execute(&format!("ALTER DATABASE {} SET rds.logical_replication = '1'", db.name)).await.unwrap();
    let err = start_up_error(cfg, Arc::new(sqs.clone())).await;
    assert!(err.contains("may not replicate") && err.contains(&format!("GRANT rds_replication TO {role}")), "{err}");
    c.batch_execute(&format!("DROP OWNED BY {role}; DROP ROLE {role}")).await.unwrap();
    // A slot of that name made by another plugin: someone else's.
    c.execute("SELECT pg_create_logical_replication_slot($1, 'test_decoding')", &[&db.slot]).await.unwrap();
    let err = start_up_error(config(&db, &[("orders", &q)]), Arc::new(sqs.clone())).await;
    assert!(err.contains("already exists as a logical slot of plugin \"test_decoding\""), "{err}");
    c.execute("SELECT pg_drop_replication_slot($1)", &[&db.slot]).await.unwrap();
    // Failover slots where the server has none (before 17); accepted on 17+.
    let version: i32 = c.query_one("SELECT current_setting('server_version_num')::int", &[]).await.unwrap().get(0);
    let mut cfg = config(&db, &[("orders", &q)]);
    cfg.failover = true;
    if version < 170_000 {
        let err = start_up_error(cfg, Arc::new(sqs.clone())).await;
        assert!(err.contains("failover = true needs PostgreSQL 17 or newer"), "{err}");
    } else {
        let relay = start(cfg, Arc::new(sqs.clone()));
        wait_for("the slot created with FAILOVER", Duration::from_secs(30), || {
            let (c, slot) = (&c, &db.slot);
            async move {
                c.query_opt("SELECT 1 FROM pg_replication_slots WHERE slot_name = $1 AND failover", &[slot])
                    .await
                    .unwrap()
                    .is_some()
            }
        })
        .await;
        relay.stop().await;
    }
}

/// Fair queues: rows with a group key reach a standard queue with it as their
/// `MessageGroupId`; rows without one arrive without.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standard_queue_gets_group_keys_as_fair_queue_groups() {
    let db = TestDb::new("fair").await;
    let sqs = sqs().await;
    let q = create_queue(&sqs, "fair", false, None).await;
    let relay = start(config(&db, &[("orders", &q)]), Arc::new(sqs.clone()));
    let c = db.client().await;
    insert_rows(&c, "grouped", "orders", 30, Some(3)).await;
    insert_rows(&c, "plain", "orders", 5, None).await;
    let got: HashMap<String, Option<String>> =
        receive_all(&sqs, &q, 35, Duration::from_secs(60)).await.into_iter().collect();
    relay.stop().await;
    assert_eq!(got.len(), 35);
    for i in 1..=30 {
        assert_eq!(got[&format!("grouped:{i}")].as_deref(), Some(format!("g{}", i % 3).as_str()));
    }
    assert!((1..=5).all(|i| got[&format!("plain:{i}")].is_none()));
}

/// `migrate --dry-run` prints what `migrate` would apply, with its SQL, and
/// applies nothing; after `migrate`, nothing is pending.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_dry_run_shows_the_sql_and_applies_nothing() {
    let name = unique("t_dry");
    let admin = outbox_relay::db::connect(&stack().pg_url).await.unwrap();
    admin.batch_execute(&format!("CREATE DATABASE {name}")).await.unwrap();
    let url = format!("{}/{name}", stack().pg_url.rsplit_once('/').unwrap().0);
    let migrate = |dry: bool| {
        let mut cmd = std::process::Command::new(testkit::process::relay_bin());
        cmd.args(["migrate", "--database-url", &url]);
        if dry {
            cmd.arg("--dry-run");
        }
        let out = cmd.output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    };
    let shown = migrate(true);
    assert!(shown.contains("-- migration 1: outbox") && shown.contains("CREATE TABLE"), "{shown}");
    assert!(shown.contains("-- migration 10:"), "{shown}");
    let c = outbox_relay::db::connect(&url).await.unwrap();
    let outbox: Option<String> = c.query_one("SELECT to_regclass('outbox')::text", &[]).await.unwrap().get(0);
    assert_eq!(outbox, None, "--dry-run created nothing");
    migrate(false);
    assert!(migrate(true).contains("up to date; nothing would be applied"));
    drop(c);
    admin.batch_execute(&format!("DROP DATABASE {name} WITH (FORCE)")).await.unwrap();
}

/// A database migrated before migrations 11 to 14 is brought up to date:
/// `deliver_at` and `commit_lsn` appear, `outbox_enqueue_job` takes the trace context,
/// mapped tables' oids get their table, and a call written for the
/// five-argument function works unchanged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_older_schema_is_migrated_and_old_enqueue_calls_still_work() {
    let name = unique("t_upgrade");
    let admin = outbox_relay::db::connect(&stack().pg_url).await.unwrap();
    admin.batch_execute(&format!("CREATE DATABASE {name}")).await.unwrap();
    let url = format!("{}/{name}", stack().pg_url.rsplit_once('/').unwrap().0);
    let mut c = outbox_relay::db::connect(&url).await.unwrap();
    let before = outbox_schema::ALL.iter().filter(|m| m.version <= 10);
    outbox_schema::apply(&mut c, before).await.unwrap();
    let overloads = "SELECT count(*) FROM pg_proc WHERE proname = 'outbox_enqueue_job'";
    c.batch_execute("SELECT outbox_enqueue_job('old', '{\"n\": 1}', 'jobs')").await.unwrap();
    let applied = outbox_relay::db::schema::migrate(&mut c).await.unwrap();
    assert_eq!(applied, vec![11, 12, 13, 14, 15, 16]);
    assert_eq!(c.query_one(overloads, &[]).await.unwrap().get::<_, i64>(0), 1, "one outbox_enqueue_job");
    c.batch_execute(
        "SELECT outbox_enqueue_job('old', '{\"n\": 2}', 'jobs');
         SELECT outbox_enqueue_job('new', '{\"n\": 3}', 'jobs', NULL, NULL, '00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01');
         INSERT INTO outbox (event_id, destination, body, deliver_at) VALUES ('later', 'jobs', 'x', now() + interval '1 h');",
    )
    .await
    .unwrap();
    let rows = c
        .query("SELECT attributes->>'traceparent' FROM outbox WHERE event_id LIKE '%:0' ORDER BY id", &[])
        .await
        .unwrap();
    let traces: Vec<Option<String>> = rows.iter().map(|r| r.get(0)).collect();
    assert_eq!(traces, [None, None, Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".to_string())]);
    drop(c);
    admin.batch_execute(&format!("DROP DATABASE {name} WITH (FORCE)")).await.unwrap();
}
