//! The SQS entry made from an outbox row. Every rule SQS would enforce is
//! checked here, before any send, so a row SQS would refuse becomes DEAD
//! with its reason instead of failing a whole batch.

use std::sync::Arc;

use sha2::{Digest, Sha256};

use crate::event::OutboxEvent;
use crate::policy::dead::{DeadCode, DeadReason};
use crate::publish::offload::{Offload, OffloadTarget, RESERVED_ATTRIBUTES, SIZE_ATTRIBUTE};

/// What SQS needs to know about a queue to batch for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueInfo {
    pub url: String,
    pub fifo: bool,
    /// `MaximumMessageSize`, bytes (body plus attributes).
    pub max_message_size: usize,
    /// A standard queue gets the row's `group_key` as `MessageGroupId`
    /// (SQS fair queues: one busy tenant does not delay the others); from
    /// the `fair_queues` setting, on unless configured off.
    pub fair: bool,
    /// Bodies over the threshold go through S3 (none: they are DEAD,
    /// `too_large`).
    pub offload: Option<Arc<OffloadTarget>>,
}

impl QueueInfo {
    /// A queue as SQS describes it, fair-queue groups on, no S3.
    pub fn new(url: impl Into<String>, fifo: bool, max_message_size: usize) -> QueueInfo {
        QueueInfo { url: url.into(), fifo, max_message_size, fair: true, offload: None }
    }
}

/// A message attribute, in SQS's terms.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attribute {
    pub name: String,
    pub data_type: String,
    pub value: String,
}

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

/// The W3C trace-context attribute a producer sets to join its trace.
pub const TRACEPARENT: &str = "traceparent";

/// A W3C `traceparent` (`00-<32 hex trace id>-<16 hex parent id>-<2 hex
/// flags>`) as an X-Ray trace header (`Root=1-<8 hex>-<24 hex>;Parent=<16
/// hex>;Sampled=<0|1>`), which SQS carries as `AWSTraceHeader`; `None` when
/// it is not a valid traceparent (the attribute still goes as it is).
pub fn xray_trace_header(traceparent: &str) -> Option<String> {
    let Traceparent { trace, parent, flags } = Traceparent::parse(traceparent)?;
    Some(format!("Root=1-{}-{};Parent={parent};Sampled={}", &trace[..8], &trace[8..], flags & 1))
}

/// The parts of a valid W3C `traceparent`: 32 lower-case hex digits of
/// trace id, 16 of parent id (neither all zero), and the flags.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Traceparent<'a> {
    pub trace: &'a str,
    pub parent: &'a str,
    pub flags: u8,
}

impl<'a> Traceparent<'a> {
    /// `None` when `s` is not a valid traceparent (version `ff`, a version
    /// `00` with more than four parts, bad lengths or digits, zero ids).
    pub fn parse(s: &'a str) -> Option<Self> {
        let parts: Vec<&str> = s.trim().split('-').collect();
        let hex =
            |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
        let [version, trace, parent, flags, ..] = parts[..] else { return None };
        let zero = |s: &str| s.bytes().all(|b| b == b'0');
        let valid = hex(version, 2) && version != "ff" && (version != "00" || parts.len() == 4);
        if !valid || !hex(trace, 32) || !hex(parent, 16) || !hex(flags, 2) || zero(trace) || zero(parent) {
            return None;
        }
        Some(Traceparent { trace, parent, flags: u8::from_str_radix(flags, 16).ok()? })
    }
}

/// SQS's limit on an attribute's `DataType`, its custom label included.
pub const MAX_DATA_TYPE: usize = 256;

/// SQS's limit on attributes per message.
pub const MAX_ATTRIBUTES: usize = 10;

/// SQS accepts `#x9 | #xA | #xD | #x20-#xD7FF | #xE000-#xFFFD | #x10000-#x10FFFF`.
/// Rust strings hold no surrogates, so that leaves the C0 controls and
/// U+FFFE/U+FFFF to refuse.
pub fn first_invalid_char(s: &str) -> Option<(usize, char)> {
    s.char_indices().find(|&(_, c)| {
        let c = c as u32;
        !(c == 0x9 || c == 0xA || c == 0xD || (0x20..=0xFFFD).contains(&c) || c >= 0x10000)
    })
}

/// Deduplication and group ids: 1 to 128 of `[A-Za-z0-9]` and ASCII punctuation.
fn is_sqs_token(s: &str) -> bool {
    !s.is_empty() && s.len() <= 128 && s.bytes().all(|b| b.is_ascii_alphanumeric() || b.is_ascii_punctuation())
}

/// `MessageDeduplicationId` for an event: its `event_id` when SQS accepts it
/// as one, otherwise the hex SHA-256 of it (64 characters, deterministic, so a
/// resend within SQS's 5-minute window is still absorbed).
pub fn dedup_id(event_id: &str) -> String {
    if is_sqs_token(event_id) {
        event_id.to_string()
    } else {
        hex::encode(Sha256::digest(event_id.as_bytes()))
    }
}

/// Parse the `attributes` JSON: an object of at most 10 entries, each a string
/// (type String), a number (type Number, its JSON text carried exactly, never
/// through a float), a boolean (type String), or
/// `{"DataType": "String|Number[.label]", "StringValue": "..."}`.
pub fn parse_attributes(json: &str) -> Result<Vec<Attribute>, DeadReason> {
    use serde_json::value::RawValue;
    let bad = |d: String| DeadReason::new(DeadCode::InvalidAttributes, d);
    let top: &RawValue = serde_json::from_str(json).map_err(|e| bad(format!("not JSON: {e}")))?;
    let obj: std::collections::BTreeMap<String, &RawValue> = match top.get().trim_start().as_bytes().first() {
        Some(b'n') => return Ok(Vec::new()),
        Some(b'{') => serde_json::from_str(top.get()).map_err(|e| bad(format!("not JSON: {e}")))?,
        _ => return Err(bad(format!("expected a JSON object, got {}", top.get().trim()))),
    };
    if obj.len() > MAX_ATTRIBUTES {
        return Err(bad(format!("{} attributes; SQS allows at most {MAX_ATTRIBUTES}", obj.len())));
    }
    let mut out = Vec::with_capacity(obj.len());
    for (name, raw) in obj {
        validate_attribute_name(&name).map_err(bad)?;
        let (data_type, value) = attribute_value(&name, raw.get().trim()).map_err(bad)?;
        let base = data_type.split('.').next().unwrap_or_default();
        if base != "String" && base != "Number" {
            return Err(bad(format!(
                "attribute {name:?}: DataType {data_type:?} is not String or Number (Binary is not supported)"
            )));
        }
        if data_type.len() > MAX_DATA_TYPE {
            return Err(bad(format!(
                "attribute {name:?}: DataType is {} characters; SQS allows at most {MAX_DATA_TYPE}",
                data_type.len()
            )));
        }
        if value.is_empty() {
            return Err(bad(format!("attribute {name:?}: empty value")));
        }
        if base == "Number" {
            check_sqs_number(&value).map_err(|e| bad(format!("attribute {name:?}: {e}")))?;
        }
        if let Some((i, c)) = first_invalid_char(&value) {
            return Err(DeadReason::new(
                DeadCode::InvalidCharacters,
                format!("attribute {name:?} has character U+{:04X} at byte {i}, which SQS refuses", c as u32),
            ));
        }
        out.push(Attribute { name, data_type, value });
    }
    Ok(out)
}

/// One attribute's (DataType, value) from its raw JSON text.
fn attribute_value(name: &str, raw: &str) -> Result<(String, String), String> {
    let parse = |e: serde_json::Error| format!("attribute {name:?}: {e}");
    match raw.as_bytes().first() {
        Some(b'"') => Ok(("String".into(), serde_json::from_str::<String>(raw).map_err(parse)?)),
        Some(b't' | b'f') => Ok(("String".into(), serde_json::from_str::<bool>(raw).map_err(parse)?.to_string())),
        // The number's own text: 38 significant digits survive, as SQS keeps them.
        Some(b'-' | b'0'..=b'9') => Ok(("Number".into(), raw.to_string())),
        Some(b'{') => {
            let mut o: serde_json::Map<String, serde_json::Value> = serde_json::from_str(raw).map_err(parse)?;
            let t = o.remove("DataType").and_then(|t| t.as_str().map(str::to_owned));
            let s = o.remove("StringValue").and_then(|t| t.as_str().map(str::to_owned));
            match (t, s) {
                (Some(t), Some(s)) if o.is_empty() => Ok((t, s)),
                _ => Err(format!("attribute {name:?}: expected {{\"DataType\": ..., \"StringValue\": ...}}")),
            }
        }
        _ => Err(format!("attribute {name:?}: unsupported value {raw}")),
    }
}

/// SQS's rule for a Number attribute: a decimal number (optional sign,
/// fraction and exponent) of at most 38 significant digits, between 10^-128
/// and 10^+126 in magnitude (or zero). Leading and trailing zeros do not count.
pub fn check_sqs_number(s: &str) -> Result<(), String> {
    let not_a_number = || format!("Number value {s:?} is not a decimal number");
    let t = s.strip_prefix(['-', '+']).unwrap_or(s);
    let (mantissa, exp) = match t.find(['e', 'E']) {
        Some(i) => (&t[..i], t[i + 1..].parse::<i64>().map_err(|_| not_a_number())?),
        None => (t, 0),
    };
    let (int, frac) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    let digits_only = |p: &str| p.bytes().all(|b| b.is_ascii_digit());
    if (int.is_empty() && frac.is_empty()) || !digits_only(int) || !digits_only(frac) {
        return Err(not_a_number());
    }
    let digits = format!("{int}{frac}");
    let significant = digits.trim_matches('0');
    if significant.is_empty() {
        return Ok(());
    }
    if significant.len() > 38 {
        return Err(format!("Number value {s:?} has {} significant digits; SQS keeps at most 38", significant.len()));
    }
    let leading_zeros = (digits.len() - digits.trim_start_matches('0').len()) as i64;
    let magnitude = int.len() as i64 - 1 - leading_zeros + exp;
    if !(-128..126).contains(&magnitude) {
        return Err(format!("Number value {s:?} is outside SQS's range (10^-128 to 10^126)"));
    }
    Ok(())
}

fn validate_attribute_name(name: &str) -> Result<(), String> {
    if RESERVED_ATTRIBUTES.contains(&name) {
        return Err(format!(
            "attribute name {name:?} is reserved: AWS's SQS extended clients read a message carrying it as a \
             pointer to a body in S3 (the relay sets it itself when a body goes through S3)"
        ));
    }
    let lower = name.to_ascii_lowercase();
    let ok = !name.is_empty()
        && name.len() <= 256
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.')
        && !name.starts_with('.')
        && !name.ends_with('.')
        && !name.contains("..")
        && !lower.starts_with("aws.")
        && !lower.starts_with("amazon.");
    if ok {
        Ok(())
    } else {
        Err(format!("attribute name {name:?} is not allowed by SQS"))
    }
}

/// Validate `event` for `queue` and build its entry, or say why it is DEAD.
pub fn prepare(event: Arc<OutboxEvent>, queue: &QueueInfo) -> Result<Entry, DeadReason> {
    if event.body.is_empty() {
        return Err(DeadReason::new(DeadCode::EmptyBody, "SQS refuses an empty message body"));
    }
    let mut attributes = match &event.attributes {
        Some(json) => parse_attributes(json)?,
        None => Vec::new(),
    };
    let attributes_size =
        |a: &[Attribute]| a.iter().map(|a| a.name.len() + a.data_type.len() + a.value.len()).sum::<usize>();
    let mut size = event.body.len() + attributes_size(&attributes);
    let offload = match &queue.offload {
        Some(t) if t.threshold.offloads(size, queue.max_message_size) => Some(offload(&event, t, &mut attributes)?),
        _ => None,
    };
    if let Some(o) = &offload {
        size = o.pointer.len() + attributes_size(&attributes);
    } else if let Some((i, c)) = first_invalid_char(&event.body) {
        return Err(DeadReason::new(
            DeadCode::InvalidCharacters,
            format!("body has character U+{:04X} at byte {i}, which SQS refuses", c as u32),
        ));
    }
    if size > queue.max_message_size {
        let through = if queue.offload.is_some() { " (its S3 pointer and attributes)" } else { "" };
        return Err(DeadReason::new(
            DeadCode::TooLarge,
            format!(
                "message{through} is {size} bytes with its attributes; the queue allows {}",
                queue.max_message_size
            ),
        ));
    }
    let (group_id, dedup) = if queue.fifo {
        let group = match &event.group_key {
            None => {
                return Err(DeadReason::new(
                    DeadCode::FifoWithoutGroup,
                    "the destination is a FIFO queue and the row has no group_key",
                ))
            }
            Some(g) if !is_sqs_token(g) => {
                return Err(DeadReason::new(
                    DeadCode::InvalidGroupKey,
                    "group_key must be 1 to 128 letters, digits or ASCII punctuation",
                ))
            }
            Some(g) => g.clone(),
        };
        (Some(group), Some(dedup_id(&event.event_id)))
    } else {
        // Fair queues: a group key SQS would refuse is left out (the
        // message is still delivered; fairness is per group only).
        (event.group_key.clone().filter(|g| queue.fair && is_sqs_token(g)), None)
    };
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
    })
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

    pub(crate) fn ev(id: i64, body: &str) -> Arc<OutboxEvent> {
        Arc::new(OutboxEvent { event_id: format!("e:{id}:0"), ..OutboxEvent::for_test(id, "orders", body) })
    }

    fn q(fifo: bool, max: usize) -> QueueInfo {
        QueueInfo::new("http://q", fifo, max)
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
        let off = QueueInfo { fair: false, ..q(false, 1 << 20) };
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

    fn through_s3(threshold: crate::publish::offload::Threshold, max_body: usize) -> QueueInfo {
        use crate::publish::offload::{MemoryStore, OffloadTarget};
        let target = OffloadTarget {
            store: Arc::new(MemoryStore::default()),
            bucket: "bodies".into(),
            key_prefix: "outbox/".into(),
            threshold,
            max_body,
            stall_timeout: std::time::Duration::from_secs(30),
        };
        QueueInfo { offload: Some(Arc::new(target)), ..q(false, 1000) }
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
