//! SNS topics as destinations, against ministack's SNS with SQS
//! subscriptions: one topic fanned out to three queues (raw and envelope
//! delivery), each receiving every event with its attributes; a FIFO
//! topic's groups in order through a restart and the topic deleted and
//! created again; a 2 MiB body through S3 read on a raw subscription by
//! AWS's SQS extended client; a row due later held until due; a missing
//! topic, a name no topic can have and attributes SNS would refuse, each
//! with its reason.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use outbox_relay::publish::aws::AwsPublisher;
use outbox_relay::publish::template::AddressTemplate;
use testkit::proxy::Proxy;
use testkit::*;

use crate::s3::insert;

/// Every message of `url` within 60 s, up to `n`: its body, its `kind`
/// message attribute and when SQS took it (Unix ms).
async fn receive_with_attributes(sqs: &AwsPublisher, url: &str, n: usize) -> Vec<(String, Option<String>, i64)> {
    let end = std::time::Instant::now() + Duration::from_secs(60);
    let mut out = Vec::new();
    while out.len() < n && std::time::Instant::now() < end {
        let got = sqs
            .sqs()
            .receive_message()
            .queue_url(url)
            .max_number_of_messages(10)
            .wait_time_seconds(1)
            .message_attribute_names("All")
            .message_system_attribute_names(aws_sdk_sqs::types::MessageSystemAttributeName::SentTimestamp)
            .send()
            .await
            .unwrap();
        for m in got.messages.unwrap_or_default() {
            let kind = m.message_attributes.as_ref().and_then(|a| a.get("kind")).and_then(|v| v.string_value.clone());
            let sent = m
                .attributes
                .as_ref()
                .and_then(|a| a.get(&aws_sdk_sqs::types::MessageSystemAttributeName::SentTimestamp));
            let sent = sent.and_then(|t| t.parse().ok()).unwrap_or(0);
            out.push((m.body.clone().unwrap_or_default(), kind, sent));
            let handle = m.receipt_handle.unwrap();
            sqs.sqs().delete_message().queue_url(url).receipt_handle(handle).send().await.unwrap();
        }
    }
    out
}

async fn all_settled(db: &TestDb) {
    wait_for("every row settled", Duration::from_secs(90), || async { db.count("status = 'NEW'").await == 0 }).await;
}

/// A standard topic with two raw subscriptions and one in SNS's JSON
/// envelope: each queue receives every event once, body and attribute as
/// written; a row due in 2 s is held in the table (a topic takes no
/// per-message delay) and published once due.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_topic_fans_every_event_out_to_every_subscription() {
    let db = TestDb::new("topic_fanout").await;
    let sqs = sqs().await;
    let topic = create_topic(&sqs, "fan", false).await;
    let raw1 = subscribed_queue(&sqs, &topic, "fan_raw1", true).await;
    let raw2 = subscribed_queue(&sqs, &topic, "fan_raw2", true).await;
    let envelope = subscribed_queue(&sqs, &topic, "fan_env", false).await;
    let relay = start(config(&db, &[("events", &topic)]), Arc::new(sqs.clone()));
    let c = db.client().await;
    let mut want = HashSet::new();
    for i in 0..40 {
        let body = format!("{{\"n\": {i}}}");
        insert(&c, &format!("fan:{i}"), "events", &body, (i % 3 == 0).then_some("tenant-1")).await;
        want.insert(body);
    }
    let due_ms: i64 = c
        .query_one(
            "INSERT INTO outbox (event_id, destination, body, deliver_at) VALUES ('later', 'events', 'due later', now() + interval '2 seconds')
             RETURNING floor(extract(epoch FROM deliver_at) * 1000)::bigint",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    want.insert("due later".to_string());
    all_settled(&db).await;
    assert_eq!(db.count("status = 'DEAD'").await, 0);
    for raw in [&raw1, &raw2] {
        let got = receive_with_attributes(&sqs, raw, want.len()).await;
        let bodies: HashSet<String> = got.iter().map(|(b, _, _)| b.clone()).collect();
        assert_eq!((got.len(), &bodies), (want.len(), &want), "{raw}: every event once, as written");
        let kinds = got.iter().filter(|(b, k, _)| b != "due later" && k.as_deref() == Some("it")).count();
        assert_eq!(kinds, 40, "{raw}: the rows' attributes go as message attributes");
        let later = got.iter().find(|(b, _, _)| b == "due later").unwrap();
        assert!(later.2 >= due_ms, "{raw}: held until due: sent at {} ms, due at {due_ms}", later.2);
    }
    let got = receive_with_attributes(&sqs, &envelope, want.len()).await;
    let mut messages = HashSet::new();
    for (body, _, _) in &got {
        let env: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!((env["Type"].as_str(), env["TopicArn"].as_str()), (Some("Notification"), Some(topic.as_str())));
        if env["Message"] != "due later" {
            assert_eq!(env["MessageAttributes"]["kind"]["Value"], "it", "{env}");
        }
        messages.insert(env["Message"].as_str().unwrap().to_string());
    }
    assert_eq!(messages, want, "the envelope queue: every event once");
    let m = relay.metrics.render();
    assert!(m.contains("outbox_relay_destination_info{destination=\"events\",fifo=\"false\",kind=\"topic\"} 1"), "{m}");
    relay.stop().await;
}

/// Group `g`'s bodies of `got`, in the order they came.
fn group_order(got: &[(String, Option<String>)], g: &str) -> Vec<String> {
    got.iter().filter(|(_, group)| group.as_deref() == Some(g)).map(|(b, _)| b.clone()).collect()
}

/// A FIFO topic to a FIFO queue: each group's events arrive in commit
/// order, through a stop and start of the relay and through the topic
/// deleted and created again (the relay meets `NotFound`: its rows wait,
/// none is DEAD, and go once the topic is back).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fifo_topic_keeps_each_groups_order_through_a_restart_and_the_topic_deleted() {
    let db = TestDb::new("topic_fifo").await;
    let sqs = sqs().await;
    let topic = create_topic(&sqs, "ord", true).await;
    let queue = subscribed_queue(&sqs, &topic, "ord_q", true).await;
    // The relay reaches SNS through a proxy: the topic is deleted and made
    // again while it cannot, so nothing is published to a topic without
    // its subscription.
    let upstream = stack().sqs_url.trim_start_matches("http://").to_string();
    let proxy = Proxy::start(&upstream).await;
    let through = Arc::new(AwsPublisher::new("us-east-1", Some(&proxy.url)).await);
    let mut cfg = config(&db, &[("orders", &topic)]);
    cfg.lane_stall_timeout = Duration::from_secs(2);
    cfg.retry_base = Duration::from_millis(200);
    cfg.retry_max = Duration::from_secs(1);
    let relay = start(cfg.clone(), through.clone());
    let c = db.client().await;
    let groups = ["g0", "g1", "g2"];
    let mut want: HashMap<&str, Vec<String>> = HashMap::new();
    let mut write = |round: &str, n: usize| {
        let mut rows = Vec::new();
        for i in 0..n {
            let g = groups[i % 3];
            let body = format!("{round}:{g}:{i}");
            want.entry(g).or_default().push(body.clone());
            rows.push((format!("{round}:{i}"), body, g));
        }
        rows
    };
    for (id, body, g) in write("first", 30) {
        insert(&c, &id, "orders", &body, Some(g)).await;
    }
    all_settled(&db).await;
    relay.stop().await;
    for (id, body, g) in write("while-stopped", 15) {
        insert(&c, &id, "orders", &body, Some(g)).await;
    }
    let relay = start(cfg, through);
    all_settled(&db).await;

    proxy.down();
    sqs.sns().delete_topic().topic_arn(&topic).send().await.unwrap();
    proxy.up();
    for (id, body, g) in write("deleted", 30) {
        insert(&c, &id, "orders", &body, Some(g)).await;
    }
    wait_for("the rows wait in the table with SNS's NotFound", Duration::from_secs(60), || async {
        db.count("status = 'NEW' AND last_error LIKE '%NotFound%'").await > 0
    })
    .await;
    assert_eq!(db.count("status = 'DEAD'").await, 0, "a topic gone is an outage, not a refusal");
    proxy.down();
    let again = sqs.sns().create_topic().name(topic.rsplit(':').next().unwrap()).attributes("FifoTopic", "true");
    assert_eq!(again.send().await.unwrap().topic_arn.as_deref(), Some(topic.as_str()));
    let subscribed = sqs.sns().list_subscriptions_by_topic().topic_arn(&topic).send().await.unwrap();
    if subscribed.subscriptions.unwrap_or_default().is_empty() {
        let attrs = sqs
            .sqs()
            .get_queue_attributes()
            .queue_url(&queue)
            .attribute_names(aws_sdk_sqs::types::QueueAttributeName::QueueArn)
            .send()
            .await
            .unwrap();
        let arn = attrs.attributes.unwrap()[&aws_sdk_sqs::types::QueueAttributeName::QueueArn].clone();
        let sub = sqs.sns().subscribe().topic_arn(&topic).protocol("sqs").endpoint(arn);
        sub.attributes("RawMessageDelivery", "true").send().await.unwrap();
    }
    proxy.up();
    all_settled(&db).await;
    let total: usize = want.values().map(Vec::len).sum();
    let got = receive_all(&sqs, &queue, total, Duration::from_secs(60)).await;
    assert_eq!(got.len(), total, "every event, once");
    for g in groups {
        assert_eq!(group_order(&got, g), want[g], "group {g} in commit order");
    }
    relay.stop().await;
}

/// A 2 MiB body through S3, published to a topic as AWS's SNS extended
/// client publishes one (its pointer and attributes beside one that client
/// published, on a raw subscription), and read on another raw subscription
/// by AWS's SQS extended client for Python, body and attributes as written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_over_the_topics_limit_goes_through_s3_as_the_extended_clients_have_it() {
    let db = TestDb::new("topic_s3").await;
    let sqs = sqs().await;
    let topic = create_topic(&sqs, "big", false).await;
    let compared = subscribed_queue(&sqs, &topic, "big_cmp", true).await;
    let read = subscribed_queue(&sqs, &topic, "big_read", true).await;
    let bucket = create_bucket("topicbodies").await;
    let mut cfg = config(&db, &[("big", &topic)]);
    cfg.s3 = Some(outbox_relay::config::S3Config {
        bucket: Some(bucket.clone()),
        key_prefix: "it/".into(),
        endpoint_url: Some(stack().sqs_url.clone()),
        threshold: outbox_relay::publish::offload::Threshold::QueueLimit,
        max_body_bytes: 6 << 20,
        buckets: BTreeMap::new(),
    });
    let relay = start(cfg, Arc::new(sqs.clone()));
    let c = db.client().await;
    let big = format!("big:{}", "x".repeat((2 << 20) - 4));
    insert(&c, "big", "big", &big, None).await;
    insert(&c, "small", "big", "small", None).await;
    all_settled(&db).await;
    assert_eq!(db.count("status = 'DEAD'").await, 0);
    let theirs_len = 300_000;
    python(&["sns_extended_publish.py", &stack().sqs_url, &topic, &bucket, &theirs_len.to_string()]);

    // Ours and theirs, as the queue holds them: the same pointer and the
    // same size attribute.
    let raw = receive_raw(&sqs, &compared, 3).await;
    let pointers: Vec<&RawMessage> = raw.iter().filter(|(b, _)| b.starts_with('[')).collect();
    assert_eq!(pointers.len(), 2, "{raw:?}");
    for (body, attrs) in pointers {
        let p: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(p[0], "software.amazon.payloadoffloading.PayloadS3Pointer", "{body}");
        assert_eq!(p[1]["s3BucketName"], bucket.as_str(), "{body}");
        assert!(p[1]["s3Key"].is_string() && p[1].as_object().unwrap().len() == 2, "{body}");
        let (data_type, size) = &attrs["ExtendedPayloadSize"];
        assert_eq!(data_type, "Number");
        assert!([big.len(), theirs_len].contains(&size.parse().unwrap()), "{size}");
        assert_eq!(attrs["kind"], ("String".to_string(), "it".to_string()));
    }

    let out = python(&["extended_client_read.py", &stack().sqs_url, &read, &bucket, "3", "60"]);
    let got: Vec<serde_json::Value> = out.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let mut lens: Vec<u64> = got.iter().map(|m| m["len"].as_u64().unwrap()).collect();
    lens.sort();
    assert_eq!(lens, vec![5, theirs_len as u64, big.len() as u64], "{got:?}");
    assert!(got.iter().all(|m| m["attributes"]["kind"] == "it"), "{got:?}");
    let m = relay.metrics.render();
    assert!(m.contains("outbox_relay_offloaded_objects_total{destination=\"big\"} 1"), "{m}");
    relay.stop().await;
}

/// Run one of `tests/it/py`'s scripts with the stack's Python; its output.
fn python(args: &[&str]) -> String {
    let script = format!("{}/tests/it/py/{}", env!("CARGO_MANIFEST_DIR"), args[0]);
    let out = std::process::Command::new(&stack().python)
        .arg(script)
        .args(&args[1..])
        .output()
        .expect("run the stack's Python");
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(out.status.success(), "{}: {stdout}\n{}", args[0], String::from_utf8_lossy(&out.stderr));
    stdout
}

/// A message as SQS holds it: its body and every attribute (its type and
/// value).
type RawMessage = (String, BTreeMap<String, (String, String)>);

/// Up to `n` messages of `url` within 60 s, as SQS holds them.
async fn receive_raw(sqs: &AwsPublisher, url: &str, n: usize) -> Vec<RawMessage> {
    let end = std::time::Instant::now() + Duration::from_secs(60);
    let mut out = Vec::new();
    while out.len() < n && std::time::Instant::now() < end {
        let req = sqs.sqs().receive_message().queue_url(url).max_number_of_messages(10).wait_time_seconds(1);
        for m in req.message_attribute_names("All").send().await.unwrap().messages.unwrap_or_default() {
            let attrs = m
                .message_attributes
                .unwrap_or_default()
                .into_iter()
                .map(|(k, v)| (k, (v.data_type, v.string_value.unwrap_or_default())));
            out.push((m.body.unwrap_or_default(), attrs.collect()));
        }
    }
    out
}

/// Refusals with their reasons: by a topic-ARN template, a topic that does
/// not exist and a name no topic can have are DEAD `topic_not_found`;
/// eleven attributes are DEAD `invalid_attributes` (SQS subscriptions take
/// ten); a configured topic that does not exist stops start-up naming it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_topics_bad_names_and_attributes_are_refused_with_their_reason() {
    let db = TestDb::new("topic_refusals").await;
    let sqs = sqs().await;
    let topic = create_topic(&sqs, "tpl", false).await;
    let name = topic.rsplit(':').next().unwrap().to_string();
    let queue = subscribed_queue(&sqs, &topic, "tpl_raw", true).await;
    let prefix = topic.trim_end_matches(name.as_str());
    let mut cfg = config(&db, &[("none", "http://unused.invalid/q")]);
    cfg.destinations.clear();
    cfg.destination_template = Some(AddressTemplate::new(&format!("{prefix}{{destination}}"), "us-east-1").unwrap());
    let relay = start(cfg, Arc::new(sqs.clone()));
    let c = db.client().await;
    insert(&c, "ok", &name, "fine", None).await;
    insert(&c, "missing", "no-such-topic", "lost?", None).await;
    insert(&c, "bad-name", "has space", "never", None).await;
    let eleven: String = format!("{{{}}}", (0..11).map(|i| format!("\"a{i}\": \"v\"")).collect::<Vec<_>>().join(","));
    c.execute(
        "INSERT INTO outbox (event_id, destination, body, attributes) VALUES ('attrs', $1, 'x', $2::text::jsonb)",
        &[&name, &eleven],
    )
    .await
    .unwrap();
    all_settled(&db).await;
    let dead = c.query("SELECT event_id, last_error FROM outbox WHERE status = 'DEAD' ORDER BY event_id", &[]).await;
    let dead: Vec<(String, String)> = dead.unwrap().iter().map(|r| (r.get(0), r.get(1))).collect();
    assert_eq!(dead.len(), 3, "{dead:?}");
    assert!(dead[0].0 == "attrs" && dead[0].1.starts_with("invalid_attributes") && dead[0].1.contains("at most 10"));
    assert!(dead[1].0 == "bad-name" && dead[1].1.starts_with("topic_not_found: destination \"has space\""));
    assert!(dead[1].1.contains("cannot name a topic"), "{dead:?}");
    assert!(
        dead[2].0 == "missing"
            && dead[2].1.starts_with("topic_not_found: destination \"no-such-topic\": no topic at arn:")
    );
    let got = receive_all(&sqs, &queue, 1, Duration::from_secs(30)).await;
    assert_eq!(got.iter().map(|(b, _)| b.as_str()).collect::<Vec<_>>(), ["fine"]);
    relay.stop().await;

    let ghost = format!("{prefix}ghost-topic");
    let err = start_up_error(config(&db, &[("ghost", &ghost)]), Arc::new(sqs.clone())).await;
    assert!(err.contains("destination \"ghost\": topic") && err.contains("GetTopicAttributes"), "{err}");
}
