//! The entry made from an outbox row: what a batch holds, for every kind of
//! destination. A message's rules (an SQS queue's, an SNS topic's) are
//! here, checked before any send, so a row the service would refuse becomes
//! DEAD with its reason instead of failing a whole batch: the attributes
//! ([`attributes`]), the deduplication and group ids ([`ids`]), the trace
//! header ([`trace`]), the size and the S3 pointer ([`prepare_message`]).

use std::sync::Arc;

use crate::event::OutboxEvent;
use crate::policy::dead::{DeadCode, DeadReason};
use crate::publish::offload::{Offload, OffloadTarget, SIZE_ATTRIBUTE};

mod attributes;
mod ids;
mod trace;

pub use attributes::{
    check_sqs_number, first_invalid_char, parse_attributes, Attribute, MAX_ATTRIBUTES, MAX_DATA_TYPE,
};
pub use ids::dedup_id;
use ids::is_sqs_token;
pub use trace::{trace_context, xray_trace_header, Traceparent, TRACEPARENT, TRACESTATE};

/// An event validated for its queue: ready to go into a batch.
#[derive(Debug, Clone)]
pub struct Entry {
    pub event: Arc<OutboxEvent>,
    pub attributes: Vec<Attribute>,
    /// Bytes SQS counts against the message and batch limits.
    pub size: usize,
    /// `MessageGroupId`: a FIFO queue's group, or a standard queue's
    /// fair-queue tenant.
    pub group_id: Option<String>,
    /// FIFO: the group's entries go in order, one batch of a group in
    /// flight at a time. A standard queue's groups impose no order.
    pub ordered: bool,
    /// The `AWSTraceHeader` system attribute (X-Ray format), from a W3C
    /// `traceparent` attribute: the trace joins producer and consumer.
    pub trace_header: Option<String>,
    /// FIFO only: `MessageDeduplicationId`.
    pub dedup_id: Option<String>,
    /// The body goes through S3: the message carries this pointer.
    pub offload: Option<Arc<Offload>>,
    /// `DelaySeconds` (standard queues: [`crate::policy::delay`]).
    pub delay_seconds: Option<u32>,
    /// An event bus's `Source` and `DetailType` (its `Detail` is the body).
    pub bus: Option<Box<BusHeaders>>,
}

/// What an EventBridge entry carries beside its `Detail`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BusHeaders {
    pub source: String,
    pub detail_type: String,
}

impl Entry {
    /// What the message's body is: the row's body, or the S3 pointer.
    pub fn message_body(&self) -> &str {
        self.offload.as_ref().map_or(self.event.body.as_str(), |o| o.pointer.as_str())
    }

    /// The group whose order this entry keeps: FIFO queues only.
    pub fn ordering_group(&self) -> Option<&str> {
        self.group_id.as_deref().filter(|_| self.ordered)
    }
}

/// What a message's rules need to know of its destination (a queue, or a
/// topic: their messages are made alike).
#[derive(Debug, Clone, Copy)]
pub struct MessageRules<'a> {
    /// The service and what it calls the destination, for the reasons
    /// (`SQS`, `queue`).
    pub service: &'static str,
    pub noun: &'static str,
    /// FIFO: a group key and a deduplication id per message.
    pub fifo: bool,
    /// Without order: the group key as a fair-queue tenant.
    pub fair: bool,
    /// Body plus attributes, bytes.
    pub max_message_size: usize,
    /// Bodies over the threshold go through S3.
    pub offload: Option<&'a Arc<OffloadTarget>>,
}

/// Validate `event` for `queue` and build its entry, or say why it is DEAD.
pub fn prepare_message(event: Arc<OutboxEvent>, queue: &MessageRules) -> Result<Entry, DeadReason> {
    let service = queue.service;
    if event.body.is_empty() {
        return Err(DeadReason::new(DeadCode::EmptyBody, format!("{service} refuses an empty message body")));
    }
    let mut attributes = match &event.attributes {
        Some(json) => parse_attributes(json)?,
        None => Vec::new(),
    };
    mark_replay(&event, &mut attributes);
    let (size, offload) = sized(&event, queue, &mut attributes)?;
    let (group_id, dedup) = group_and_dedup(&event, queue)?;
    let trace_header = attributes.iter().find(|a| a.name == TRACEPARENT).and_then(|a| xray_trace_header(&a.value));
    Ok(Entry {
        ordered: queue.fifo,
        trace_header,
        event,
        attributes,
        size,
        group_id,
        dedup_id: dedup,
        offload,
        delay_seconds: None,
        bus: None,
    })
}

/// The message attribute a replayed copy carries: the replay's id
/// ([`crate::ops::replay`]).
pub const REPLAY_ATTRIBUTE: &str = "outbox-replay";

/// A replayed copy says so ([`REPLAY_ATTRIBUTE`]) when it has room: its
/// row's attributes leave one for it and one for an S3 pointer's size. A
/// copy of a row with nine or ten attributes goes without it, as its
/// original went.
fn mark_replay(event: &OutboxEvent, attributes: &mut Vec<Attribute>) {
    let Some(replay) = event.replay_of else { return };
    if attributes.len() + 2 <= MAX_ATTRIBUTES && !attributes.iter().any(|a| a.name == REPLAY_ATTRIBUTE) {
        attributes.push(Attribute {
            name: REPLAY_ATTRIBUTE.into(),
            data_type: "String".into(),
            value: replay.to_string(),
        });
    }
}

/// The bytes SQS counts for the message, and its S3 object when the body
/// goes through S3 (the size attribute then added to `attributes`); DEAD
/// when the body has a character SQS refuses or the message is too large.
fn sized(
    event: &OutboxEvent,
    queue: &MessageRules,
    attributes: &mut Vec<Attribute>,
) -> Result<(usize, Option<Arc<Offload>>), DeadReason> {
    let attributes_size =
        |a: &[Attribute]| a.iter().map(|a| a.name.len() + a.data_type.len() + a.value.len()).sum::<usize>();
    let inline = event.body.len() + attributes_size(attributes);
    let offload = match queue.offload {
        Some(t) if t.threshold.offloads(inline, queue.max_message_size) => Some(offload(event, t, attributes)?),
        _ => None,
    };
    let size = match &offload {
        Some(o) => o.pointer.len() + attributes_size(attributes),
        None => inline,
    };
    // A body through S3 is not scanned: SQS never sees it.
    if let Some((i, c)) = offload.is_none().then(|| first_invalid_char(&event.body)).flatten() {
        return Err(DeadReason::new(
            DeadCode::InvalidCharacters,
            format!("body has character U+{:04X} at byte {i}, which {} refuses", c as u32, queue.service),
        ));
    }
    if size > queue.max_message_size {
        let through = if queue.offload.is_some() { " (its S3 pointer and attributes)" } else { "" };
        return Err(DeadReason::new(
            DeadCode::TooLarge,
            format!(
                "message{through} is {size} bytes with its attributes; the {} allows {}",
                queue.noun, queue.max_message_size
            ),
        ));
    }
    Ok((size, offload))
}

/// `MessageGroupId` and `MessageDeduplicationId`: a FIFO queue needs the
/// row's group key (DEAD without a valid one) and dedups by event id; a
/// standard queue takes the group key for fair queues, if SQS accepts it.
fn group_and_dedup(event: &OutboxEvent, queue: &MessageRules) -> Result<(Option<String>, Option<String>), DeadReason> {
    if !queue.fifo {
        // Fair queues: a group key SQS would refuse is left out (the
        // message is still delivered; fairness is per group only).
        return Ok((event.group_key.clone().filter(|g| queue.fair && is_sqs_token(g)), None));
    }
    match &event.group_key {
        None => Err(DeadReason::new(
            DeadCode::FifoWithoutGroup,
            format!("the destination is a FIFO {} and the row has no group_key", queue.noun),
        )),
        Some(g) if !is_sqs_token(g) => Err(DeadReason::new(
            DeadCode::InvalidGroupKey,
            "group_key must be 1 to 128 letters, digits or ASCII punctuation",
        )),
        Some(g) => Ok((Some(g.clone()), Some(dedup_id(&event.event_id)))),
    }
}

/// The body of `event` through S3 under `target`: its object (key chosen
/// now, written by the send stage) and the `ExtendedPayloadSize` attribute,
/// or DEAD when the body is over the target's maximum or the attribute has
/// no room.
fn offload(
    event: &OutboxEvent,
    target: &Arc<OffloadTarget>,
    attrs: &mut Vec<Attribute>,
) -> Result<Arc<Offload>, DeadReason> {
    if event.body.len() > target.max_body {
        return Err(DeadReason::new(
            DeadCode::TooLarge,
            format!("body is {} bytes; s3.max_body_bytes allows {}", event.body.len(), target.max_body),
        ));
    }
    // The row's own attributes never carry the name (parse_attributes refuses it).
    if attrs.len() >= MAX_ATTRIBUTES {
        return Err(DeadReason::new(
            DeadCode::InvalidAttributes,
            format!(
                "a body through S3 needs the {SIZE_ATTRIBUTE} attribute: at most {} attributes of the row's own",
                MAX_ATTRIBUTES - 1
            ),
        ));
    }
    attrs.push(Attribute {
        name: SIZE_ATTRIBUTE.into(),
        data_type: "Number".into(),
        value: event.body.len().to_string(),
    });
    Ok(Arc::new(Offload::new(target)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::publish::kind::Target;
    use crate::publish::offload::RESERVED_ATTRIBUTES;

    pub(crate) fn ev(id: i64, body: &str) -> Arc<OutboxEvent> {
        Arc::new(OutboxEvent { event_id: format!("e:{id}:0"), ..OutboxEvent::for_test(id, "orders", body) })
    }

    fn q(fifo: bool, max: usize) -> Target {
        Target::queue("http://q", fifo, max)
    }

    fn prepare(ev: Arc<OutboxEvent>, queue: &Target) -> Result<Entry, DeadReason> {
        queue.prepare(ev)
    }

    #[test]
    fn characters_sqs_refuses() {
        assert_eq!(first_invalid_char("héllo\t\n\r ✓ 😀"), None);
        assert_eq!(first_invalid_char("a\u{0}b"), Some((1, '\u{0}')));
        assert_eq!(first_invalid_char("\u{1f}"), Some((0, '\u{1f}')));
        assert_eq!(first_invalid_char("x\u{FFFE}"), Some((1, '\u{FFFE}')));
        let dead = prepare(ev(1, "bad\u{7}bell"), &q(false, 1000)).unwrap_err();
        assert_eq!(dead.code, DeadCode::InvalidCharacters);
        assert!(dead.last_error().contains("U+0007"));
    }

    #[test]
    fn size_counts_multibyte_body_and_attributes() {
        let mut e = (*ev(1, "é")).clone(); // 2 bytes
        e.attributes = Some(r#"{"k": "vv", "n": 12}"#.into());
        let entry = prepare(Arc::new(e.clone()), &q(false, 1000)).unwrap();
        // body 2 + ("k" 1 + "String" 6 + "vv" 2) + ("n" 1 + "Number" 6 + "12" 2)
        assert_eq!(entry.size, 2 + 9 + 9);
        let dead = prepare(Arc::new(e), &q(false, 19)).unwrap_err();
        assert_eq!(dead.code, DeadCode::TooLarge);
    }

    #[test]
    fn attributes_rules() {
        assert!(parse_attributes(r#"{"a": {"DataType": "Number.int", "StringValue": "3"}}"#).is_ok());
        let eleven: String =
            format!("{{{}}}", (0..11).map(|i| format!("\"a{i}\": \"v\"")).collect::<Vec<_>>().join(","));
        assert!(parse_attributes(&eleven).unwrap_err().detail.contains("at most 10"));
        assert!(parse_attributes("[1]").is_err());
        assert!(parse_attributes(r#"{"AWS.x": "v"}"#).is_err());
        assert!(parse_attributes(r#"{"a": {"DataType": "Binary", "StringValue": "x"}}"#).is_err());
        assert!(parse_attributes(r#"{"a": ""}"#).is_err());
        let label = |n: usize| format!(r#"{{"a": {{"DataType": "String.{}", "StringValue": "x"}}}}"#, "l".repeat(n));
        assert!(parse_attributes(&label(256 - 7)).is_ok());
        assert!(parse_attributes(&label(256 - 6)).unwrap_err().detail.contains("at most 256"));
        assert!(parse_attributes(r#"{"a": null}"#).is_err());
        assert_eq!(parse_attributes("null").unwrap(), vec![]);
    }

    #[test]
    fn numbers_keep_their_exact_text() {
        let a = parse_attributes(
            r#"{"big": 123456789012345678901234567890, "frac": 12345678901234.56789, "e": -1.5e-7, "z": 0}"#,
        )
        .unwrap();
        let v = |n: &str| a.iter().find(|x| x.name == n).map(|x| (x.data_type.as_str(), x.value.as_str())).unwrap();
        assert_eq!(v("big"), ("Number", "123456789012345678901234567890"));
        assert_eq!(v("frac"), ("Number", "12345678901234.56789"));
        assert_eq!(v("e"), ("Number", "-1.5e-7"));
        assert_eq!(v("z"), ("Number", "0"));
        // 38 significant digits pass (trailing zeros do not count); 39 are DEAD.
        let d38 = "1".repeat(38);
        assert!(parse_attributes(&format!(r#"{{"n": {d38}000}}"#)).is_ok());
        let e = parse_attributes(&format!(r#"{{"n": {d38}1}}"#)).unwrap_err();
        assert_eq!(e.code, DeadCode::InvalidAttributes);
        assert!(e.detail.contains("39 significant digits"), "{e:?}");
        assert!(parse_attributes(r#"{"n": 1e126}"#).unwrap_err().detail.contains("outside SQS's range"));
        assert!(parse_attributes(r#"{"n": 9.99e125}"#).is_ok());
        assert!(parse_attributes(r#"{"n": 1e-129}"#).unwrap_err().detail.contains("outside SQS's range"));
        assert!(parse_attributes(r#"{"n": 1e-128}"#).is_ok());
        // The explicit form is checked the same way.
        let explicit =
            |v: &str| parse_attributes(&format!(r#"{{"n": {{"DataType": "Number.price", "StringValue": "{v}"}}}}"#));
        assert_eq!(explicit("00012.50").unwrap()[0].value, "00012.50");
        assert!(explicit("twelve").unwrap_err().detail.contains("not a decimal number"));
        assert!(explicit("1.2.3").is_err());
        assert!(parse_attributes(r#"{"b": true}"#).unwrap()[0].value == "true");
        assert!(parse_attributes(r#"{"a": [1]}"#).unwrap_err().detail.contains("unsupported value"));
    }

    #[test]
    fn a_traceparent_becomes_the_xray_trace_header() {
        let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let want = "Root=1-4bf92f35-77b34da6a3ce929d0e0e4736;Parent=00f067aa0ba902b7;Sampled=1";
        assert_eq!(xray_trace_header(tp).as_deref(), Some(want));
        assert!(xray_trace_header("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00").unwrap().ends_with("=0"));
        // A later version may append fields; 00 may not.
        assert!(xray_trace_header("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x").is_some());
        for bad in [
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f35-00f067aa0ba902b7-01",
            "not a traceparent",
        ] {
            assert_eq!(xray_trace_header(bad), None, "{bad}");
        }
        let mut e = OutboxEvent::for_test(1, "orders", "{}");
        e.attributes = Some(format!(r#"{{"traceparent": "{tp}"}}"#));
        let entry = prepare(Arc::new(e), &q(false, 1 << 20)).unwrap();
        assert_eq!(entry.trace_header.as_deref(), Some(want));
        assert_eq!(entry.attributes[0].value, tp, "the attribute itself goes too");
    }

    proptest::proptest! {
        /// Any valid traceparent maps to a header naming its trace and parent.
        #[test]
        fn every_valid_traceparent_maps(trace in "[0-9a-f]{31}[1-9a-f]", parent in "[1-9a-f][0-9a-f]{15}", flags in 0u8..=255) {
            let h = xray_trace_header(&format!("00-{trace}-{parent}-{flags:02x}")).unwrap();
            proptest::prop_assert_eq!(&h, &format!("Root=1-{}-{};Parent={parent};Sampled={}", &trace[..8], &trace[8..], flags & 1));
            // The consumer library reads the producer's trace back from it.
            let back = outbox_consumer::sqs::traceparent_from_xray(&h).unwrap();
            proptest::prop_assert_eq!(back, format!("00-{trace}-{parent}-0{}", flags & 1));
        }
    }

    #[test]
    fn a_standard_queue_gets_the_group_as_a_fair_queue_tenant() {
        let mut e = OutboxEvent::for_test(1, "orders", "{}");
        e.group_key = Some("tenant-7".into());
        let entry = prepare(Arc::new(e.clone()), &q(false, 1 << 20)).unwrap();
        assert_eq!((entry.group_id.as_deref(), entry.dedup_id.as_deref()), (Some("tenant-7"), None));
        assert_eq!(entry.ordering_group(), None, "fair-queue groups impose no order");
        let mut off = q(false, 1 << 20);
        off.fair = false;
        assert_eq!(prepare(Arc::new(e.clone()), &off).unwrap().group_id, None);
        e.group_key = Some("has space".into());
        let entry = prepare(Arc::new(e), &q(false, 1 << 20)).unwrap();
        assert_eq!(entry.group_id, None, "a key SQS would refuse is left out, the message still goes");
    }

    #[test]
    fn fifo_needs_a_group_and_gets_a_dedup_id() {
        let dead = prepare(ev(1, "x"), &q(true, 1000)).unwrap_err();
        assert_eq!(dead.code, DeadCode::FifoWithoutGroup);
        let mut e = (*ev(1, "x")).clone();
        e.group_key = Some("customer-7".into());
        let entry = prepare(Arc::new(e.clone()), &q(true, 1000)).unwrap();
        assert_eq!(entry.group_id.as_deref(), Some("customer-7"));
        assert_eq!(entry.dedup_id.as_deref(), Some("e:1:0"));
        e.group_key = Some("has space".into());
        assert_eq!(prepare(Arc::new(e), &q(true, 1000)).unwrap_err().code, DeadCode::InvalidGroupKey);
    }

    fn through_s3(threshold: crate::publish::offload::Threshold, max_body: usize) -> Target {
        use crate::publish::offload::{MemoryStore, OffloadTarget};
        let target = OffloadTarget {
            store: Arc::new(MemoryStore::default()),
            bucket: "bodies".into(),
            key_prefix: "outbox/".into(),
            threshold,
            max_body,
            stall_timeout: std::time::Duration::from_secs(30),
        };
        let mut queue = q(false, 1000);
        queue.offload = Some(Arc::new(target));
        queue
    }

    #[test]
    fn a_body_over_the_limit_goes_through_s3_as_the_extended_client_points() {
        use crate::publish::offload::Threshold;
        let queue = through_s3(Threshold::QueueLimit, 10_000);
        let small = prepare(ev(1, &"x".repeat(1000)), &queue).unwrap();
        assert!(small.offload.is_none(), "at the limit: sent as it is");
        assert_eq!(small.message_body().len(), 1000);
        let big = prepare(ev(2, &"\u{7}".repeat(1001)), &queue).unwrap();
        let o = big.offload.as_ref().expect("over the limit: through S3");
        assert!(o.key.starts_with("outbox/") && o.key.len() == "outbox/".len() + 36, "{}", o.key);
        let pointer: serde_json::Value = serde_json::from_str(big.message_body()).unwrap();
        assert_eq!(pointer[0], "software.amazon.payloadoffloading.PayloadS3Pointer");
        assert_eq!(
            (pointer[1]["s3BucketName"].as_str(), pointer[1]["s3Key"].as_str()),
            (Some("bodies"), Some(&*o.key))
        );
        let size = big.attributes.iter().find(|a| a.name == "ExtendedPayloadSize").unwrap();
        assert_eq!((size.data_type.as_str(), size.value.as_str()), ("Number", "1001"));
        assert_eq!(
            big.size,
            big.message_body().len() + "ExtendedPayloadSize".len() + 6 + 4,
            "the pointer counts, not the body"
        );
        assert!(!o.is_written(), "written by the send stage, not here");
        // Characters SQS refuses are fine in S3; over s3.max_body_bytes is DEAD.
        let dead = prepare(ev(3, &"x".repeat(10_001)), &queue).unwrap_err();
        assert_eq!(dead.code, DeadCode::TooLarge);
        assert!(dead.detail.contains("s3.max_body_bytes"), "{dead:?}");
        // Without S3 the same row is DEAD, as before.
        assert_eq!(prepare(ev(2, &"x".repeat(1001)), &q(false, 1000)).unwrap_err().code, DeadCode::TooLarge);
    }

    #[test]
    fn always_offloads_and_the_size_attribute_needs_room() {
        use crate::publish::offload::Threshold;
        let queue = through_s3(Threshold::Always, 10_000);
        assert!(prepare(ev(1, "tiny"), &queue).unwrap().offload.is_some());
        let mut e = (*ev(2, "tiny")).clone();
        e.attributes =
            Some(format!("{{{}}}", (0..10).map(|i| format!("\"a{i}\": \"v\"")).collect::<Vec<_>>().join(",")));
        let dead = prepare(Arc::new(e.clone()), &queue).unwrap_err();
        assert_eq!(dead.code, DeadCode::InvalidAttributes);
        assert!(dead.detail.contains("ExtendedPayloadSize"), "{dead:?}");
        e.attributes = Some(r#"{"ExtendedPayloadSize": 3}"#.into());
        assert_eq!(prepare(Arc::new(e), &queue).unwrap_err().code, DeadCode::InvalidAttributes);
        let by_size = through_s3(Threshold::Bytes(100), 10_000);
        assert!(prepare(ev(3, &"x".repeat(100)), &by_size).unwrap().offload.is_none());
        assert!(prepare(ev(4, &"x".repeat(101)), &by_size).unwrap().offload.is_some());
    }

    /// A small inline message carrying the extended client's size attribute
    /// would be read as a pointer by every consumer of the queue (and fail
    /// them all): DEAD with the name in its reason, with S3 set or not.
    #[test]
    fn the_extended_clients_names_are_reserved_on_every_path() {
        use crate::publish::offload::Threshold;
        for name in RESERVED_ATTRIBUTES {
            for queue in [q(false, 1000), q(true, 1000), through_s3(Threshold::QueueLimit, 10_000)] {
                let mut e = (*ev(1, "tiny")).clone();
                e.group_key = Some("g".into());
                e.attributes = Some(format!(r#"{{"{name}": {{"DataType": "Number", "StringValue": "12"}}}}"#));
                let dead = prepare(Arc::new(e), &queue).unwrap_err();
                assert_eq!(dead.code, DeadCode::InvalidAttributes, "{name}");
                assert!(dead.detail.contains(name) && dead.detail.contains("reserved"), "{dead:?}");
            }
        }
    }

    #[test]
    fn long_or_odd_event_ids_are_hashed() {
        assert_eq!(dedup_id("order.created:abc:0"), "order.created:abc:0");
        let long = "x".repeat(129);
        assert_eq!(dedup_id(&long).len(), 64);
        assert_eq!(dedup_id(&long), dedup_id(&long));
        assert_eq!(dedup_id("with space").len(), 64);
        assert_eq!(dedup_id("ünïcode").len(), 64);
    }
}
