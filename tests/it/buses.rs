//! EventBridge buses and the mapped-table presets to a bus and a topic,
//! against ministack: rules routing by `detail-type` to two queues, the
//! rows' `type` as the DetailType (the Debezium preset's column), bodies a
//! bus cannot take DEAD with their reason, a missing bus refused at
//! start-up; a `topic-payload` table's rows fanned out by an SNS topic.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use outbox_relay::mapping::{Mapping, Preset};
use outbox_relay::publish::aws::AwsPublisher;
use testkit::*;

/// A bus of its own; its ARN.
async fn create_bus(sqs: &AwsPublisher, base: &str) -> String {
    let name = unique(base);
    sqs.events().create_event_bus().name(&name).send().await.unwrap().event_bus_arn.unwrap()
}

/// A queue of its own that receives the events of `bus` whose
/// `detail-type` is `detail_type`; its URL.
async fn routed_queue(sqs: &AwsPublisher, bus: &str, detail_type: &str, base: &str) -> String {
    use aws_sdk_sqs::types::QueueAttributeName as A;
    let url = create_queue(sqs, base, false, None).await;
    let attrs = sqs.sqs().get_queue_attributes().queue_url(&url).attribute_names(A::QueueArn).send().await.unwrap();
    let arn = attrs.attributes.unwrap()[&A::QueueArn].clone();
    let (rule, bus) = (unique(base), bus.rsplit('/').next().unwrap());
    let pattern = serde_json::json!({ "detail-type": [detail_type] }).to_string();
    sqs.events().put_rule().name(&rule).event_bus_name(bus).event_pattern(pattern).send().await.unwrap();
    let target = aws_sdk_eventbridge::types::Target::builder().id("q").arn(arn).build().unwrap();
    sqs.events().put_targets().rule(&rule).event_bus_name(bus).targets(target).send().await.unwrap();
    url
}

/// The events a rule put on `url`, as EventBridge wrote them.
async fn events_on(sqs: &AwsPublisher, url: &str, n: usize) -> Vec<serde_json::Value> {
    let got = receive_all(sqs, url, n, Duration::from_secs(60)).await;
    got.iter().map(|(body, _)| serde_json::from_str(body).unwrap()).collect()
}

async fn all_settled(db: &TestDb) {
    wait_for("every row settled", Duration::from_secs(90), || async { db.count("status = 'NEW'").await == 0 }).await;
}

/// Rows of the relay's table and of a Debezium table (its producers'
/// insert-and-delete) to one bus: each reaches the queue of the rule its
/// `type` matches, its body the event's `detail`, its `type` the
/// `detail-type`, `outbox-relay` (or its `source`) the `source`; a body
/// that is not a JSON object and an attribute a bus cannot carry are DEAD
/// with their reason, and hold nothing back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bus_routes_each_event_by_its_detail_type_to_the_rules_queues() {
    let db = TestDb::new("bus_rules").await;
    let sqs = sqs().await;
    let bus = create_bus(&sqs, "orders").await;
    let created = routed_queue(&sqs, &bus, "OrderCreated", "bus_created").await;
    let shipped = routed_queue(&sqs, &bus, "OrderShipped", "bus_shipped").await;
    crate::mapped::debezium_table(&db).await;
    let mut cfg = config(&db, &[("orders", &bus), ("Order", &bus)]);
    cfg.mapped = vec![Mapping::preset(Preset::Debezium, "app", "outboxevent")];
    let relay = start(cfg, Arc::new(sqs.clone()));
    // The producers' insert-and-delete is seen only by a slot that exists.
    wait_for("slot created", Duration::from_secs(30), || async { db.confirmed_flush_lsn().await > 0 }).await;
    let c = db.client().await;
    let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    for i in 0..10 {
        let attrs = if i == 0 {
            format!(r#"{{"type": "OrderCreated", "source": "com.example.orders", "traceparent": "{tp}"}}"#)
        } else {
            r#"{"type": "OrderCreated"}"#.to_string()
        };
        c.execute(
            "INSERT INTO outbox (event_id, destination, body, attributes) VALUES ($1, 'orders', $2, $3::text::jsonb)",
            &[&format!("c{i}"), &format!("{{\"order\": {i}}}"), &attrs],
        )
        .await
        .unwrap();
    }
    c.batch_execute(
        "DO $$ DECLARE eid uuid; BEGIN FOR i IN 1..5 LOOP
             eid := gen_random_uuid();
             INSERT INTO app.outboxevent (id, aggregatetype, aggregateid, type, payload)
             VALUES (eid, 'Order', 'agg' || i, 'OrderShipped', jsonb_build_object('shipped', i));
             DELETE FROM app.outboxevent WHERE id = eid;
         END LOOP; END $$;
         INSERT INTO outbox (event_id, destination, body) VALUES ('not-an-object', 'orders', '[1, 2]');
         INSERT INTO outbox (event_id, destination, body, attributes)
             VALUES ('extra', 'orders', '{}', '{\"tenant\": \"t1\"}');",
    )
    .await
    .unwrap();
    all_settled(&db).await;
    wait_for("the Debezium rows published", Duration::from_secs(60), || async {
        relay.metrics.events_published.with_label_values(&["Order"]).get() >= 5
    })
    .await;
    let dead = c.query("SELECT event_id, last_error FROM outbox WHERE status = 'DEAD' ORDER BY event_id", &[]).await;
    let dead: Vec<(String, String)> = dead.unwrap().iter().map(|r| (r.get(0), r.get(1))).collect();
    assert_eq!(dead.len(), 2, "{dead:?}");
    assert!(dead[0].0 == "extra" && dead[0].1.starts_with("invalid_attributes") && dead[0].1.contains("tenant"));
    assert!(dead[1].0 == "not-an-object" && dead[1].1.starts_with("invalid_detail"), "{dead:?}");

    let got = events_on(&sqs, &created, 10).await;
    let orders: BTreeSet<i64> = got.iter().map(|e| e["detail"]["order"].as_i64().unwrap()).collect();
    assert_eq!(orders, (0..10).collect(), "every OrderCreated event, its body the detail");
    assert!(got.iter().all(|e| e["detail-type"] == "OrderCreated"));
    let sources: BTreeMap<String, usize> = got.iter().fold(BTreeMap::new(), |mut m, e| {
        *m.entry(e["source"].as_str().unwrap().to_string()).or_default() += 1;
        m
    });
    assert_eq!(sources, BTreeMap::from([("com.example.orders".into(), 1), ("outbox-relay".into(), 9)]));
    let got = events_on(&sqs, &shipped, 5).await;
    let shipped_ids: BTreeSet<i64> = got.iter().map(|e| e["detail"]["shipped"].as_i64().unwrap()).collect();
    assert_eq!(shipped_ids, (1..=5).collect(), "the Debezium rows, their type column the detail-type");
    let m = relay.metrics.render();
    assert!(m.contains("outbox_relay_destination_info{destination=\"orders\",fifo=\"false\",kind=\"bus\"} 1"), "{m}");
    relay.stop().await;

    let ghost = format!("{}-ghost", bus);
    let err = start_up_error(config(&db, &[("ghost", &ghost)]), Arc::new(sqs.clone())).await;
    assert!(err.contains("destination \"ghost\": bus") && err.contains("DescribeEventBus"), "{err}");
}

/// A `topic-payload` table whose `topic` names an SNS topic: each row's
/// payload reaches the topic's subscriber, and its `published_at` is set.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_topic_payload_table_fans_out_through_a_topic() {
    let db = TestDb::new("bus_tp_topic").await;
    let sqs = sqs().await;
    let topic = create_topic(&sqs, "tp", false).await;
    let sub = subscribed_queue(&sqs, &topic, "tp_sub", true).await;
    crate::topic_payload::topic_payload_table(&db, true).await;
    let mut cfg = config(&db, &[("events", &topic)]);
    cfg.mapped = vec![Mapping::preset(Preset::TopicPayload, "public", "outbox_messages")];
    let relay = start(cfg, Arc::new(sqs.clone()));
    let c = db.client().await;
    c.execute(
        "INSERT INTO outbox_messages (topic, payload) SELECT 'events', jsonb_build_object('n', i) FROM generate_series(1, 20) i",
        &[],
    )
    .await
    .unwrap();
    wait_for("every row marked published", Duration::from_secs(60), || async {
        c.query_one("SELECT count(*) FROM outbox_messages WHERE published_at IS NULL", &[])
            .await
            .unwrap()
            .get::<_, i64>(0)
            == 0
    })
    .await;
    let got = receive_all(&sqs, &sub, 20, Duration::from_secs(60)).await;
    let ns: BTreeSet<i64> =
        got.iter().map(|(b, _)| serde_json::from_str::<serde_json::Value>(b).unwrap()["n"].as_i64().unwrap()).collect();
    assert_eq!(ns, (1..=20).collect());
    relay.stop().await;
}
