//! Amazon EventBridge event buses: `PutEvents` of up to 10 entries, each
//! `Source + DetailType + Detail` bytes within 1 MiB (AWS raised the limit
//! from 256 KiB on 2026-01-29), the entries together within 1 MiB.
//!
//! - `Detail` is the row's body, which must be a JSON object (rules match
//!   on `detail.*`): any other body is DEAD `invalid_detail`, not wrapped in
//!   an envelope the producer did not write and consumers would not expect.
//! - `DetailType` is the row's `type` attribute (the Debezium preset's
//!   `type` column), else the destination's name; `Source` is its `source`
//!   attribute, else `outbox-relay`. A `traceparent` attribute becomes the
//!   `TraceHeader` (X-Ray's format). A bus has no message attributes: a row
//!   with any other is DEAD `invalid_attributes` naming them, never sent
//!   without them.
//! - A bus keeps no order and takes no per-message delay: the group key
//!   plays no part, and a row due later is held in the table until due.
//! - A body over the limit is DEAD `too_large`: a bus takes no S3 pointer.

use std::sync::Arc;

use super::{BatchLimits, Codes, Kind, Rules, Target};
use crate::event::OutboxEvent;
use crate::metrics::Service;
use crate::policy::dead::{DeadCode, DeadReason};
use crate::publish::entry::{parse_attributes, xray_trace_header, BusHeaders, Entry, TRACEPARENT, TRACESTATE};

/// The rules of EventBridge buses.
#[derive(Debug, Clone, Copy, Default)]
pub struct EventBus;

/// An entry's size limit, and the entries' together.
pub const MAX_ENTRY_BYTES: usize = 1_048_576;

/// `Source` when the row has no `source` attribute.
pub const DEFAULT_SOURCE: &str = "outbox-relay";

/// The attributes a bus entry is made from: `DetailType`, `Source`.
const DETAIL_TYPE: &str = "type";
const SOURCE: &str = "source";

impl Rules for EventBus {
    fn kind(&self) -> Kind {
        Kind::Bus
    }

    fn prepare(&self, event: Arc<OutboxEvent>, target: &Target) -> Result<Entry, DeadReason> {
        check_detail(&event.body)?;
        let (headers, trace_header) = headers(&event)?;
        let size = headers.source.len() + headers.detail_type.len() + event.body.len();
        if size > target.max_message_size() {
            return Err(DeadReason::new(
                DeadCode::TooLarge,
                format!(
                    "the event is {size} bytes (Source, DetailType and Detail); the bus takes {} and no S3 pointer",
                    target.max_message_size()
                ),
            ));
        }
        Ok(Entry {
            event,
            attributes: Vec::new(),
            size,
            group_id: None,
            ordered: false,
            trace_header,
            dedup_id: None,
            offload: None,
            delay_seconds: None,
            bus: Some(Box::new(headers)),
        })
    }

    fn batch_limits(&self, _: &Target) -> BatchLimits {
        BatchLimits { entries: 10, bytes: MAX_ENTRY_BYTES }
    }

    fn codes(&self) -> &'static Codes {
        &CODES
    }

    fn delays(&self, _: &Target) -> bool {
        false
    }

    fn held(&self, _: &Target) -> &'static str {
        "held until deliver_at: an event bus takes no per-message delay"
    }

    fn rejected(&self) -> DeadCode {
        DeadCode::BusRejected
    }

    fn missing(&self) -> DeadCode {
        DeadCode::BusNotFound
    }

    fn service(&self) -> Service {
        Service::Events
    }

    fn call_name(&self) -> &'static str {
        "PutEvents"
    }

    fn describe_name(&self) -> &'static str {
        "DescribeEventBus"
    }
}

/// Whether an ARN's resource names a bus: `event-bus/` and 1 to 256
/// letters, digits, `.`, `-`, `_` and `/`.
pub fn check_resource(resource: &str) -> Result<(), String> {
    let name = resource.strip_prefix("event-bus/").unwrap_or("");
    let ok = !name.is_empty()
        && name.len() <= 256
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-/".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(format!("{resource:?} cannot name an event bus (event-bus/ and 1 to 256 letters, digits, . - _ /)"))
    }
}

/// The body as `Detail`: a JSON object, or DEAD with why.
fn check_detail(body: &str) -> Result<(), DeadReason> {
    let object = body.trim_start().starts_with('{');
    match serde_json::from_str::<serde::de::IgnoredAny>(body) {
        Ok(_) if object => Ok(()),
        Ok(_) => Err(DeadReason::new(
            DeadCode::InvalidDetail,
            "an event bus takes a JSON object as the event's detail; the body is other JSON",
        )),
        Err(e) => Err(DeadReason::new(
            DeadCode::InvalidDetail,
            format!("an event bus takes a JSON object as the event's detail; the body is not JSON ({e})"),
        )),
    }
}

/// `Source` and `DetailType` from the row's attributes (or the defaults),
/// and the `TraceHeader`; DEAD when the row has another attribute, or a
/// value EventBridge would refuse.
fn headers(event: &OutboxEvent) -> Result<(BusHeaders, Option<String>), DeadReason> {
    let attributes = match &event.attributes {
        Some(json) => parse_attributes(json)?,
        None => Vec::new(),
    };
    let known = [DETAIL_TYPE, SOURCE, TRACEPARENT, TRACESTATE];
    let others: Vec<&str> = attributes.iter().map(|a| a.name.as_str()).filter(|n| !known.contains(n)).collect();
    if !others.is_empty() {
        return Err(DeadReason::new(
            DeadCode::InvalidAttributes,
            format!(
                "an event bus carries no message attributes: {others:?} (its `type` attribute is the DetailType, \
                 `source` the Source, `traceparent` the TraceHeader; put the rest in the body)"
            ),
        ));
    }
    let value = |name: &str| attributes.iter().find(|a| a.name == name).map(|a| a.value.clone());
    let source = value(SOURCE).unwrap_or_else(|| DEFAULT_SOURCE.to_string());
    let detail_type = value(DETAIL_TYPE).unwrap_or_else(|| event.destination.to_string());
    if source.is_empty() || source.chars().count() > 256 || source.starts_with("aws.") {
        return Err(DeadReason::new(
            DeadCode::InvalidAttributes,
            format!("source {source:?}: 1 to 256 characters, not starting with aws."),
        ));
    }
    if detail_type.is_empty() || detail_type.chars().count() > 128 {
        return Err(DeadReason::new(
            DeadCode::InvalidAttributes,
            format!("the detail type {detail_type:?} must be 1 to 128 characters"),
        ));
    }
    let trace_header = value(TRACEPARENT).as_deref().and_then(xray_trace_header);
    Ok((BusHeaders { source, detail_type }, trace_header))
}

/// Codes that mean "slow down".
const SLOW_DOWN: &[&str] = &["ThrottlingException", "Throttling", "LimitExceededException"];

/// Codes of a bus that does not exist.
const MISSING: &[&str] = &["ResourceNotFoundException"];

/// Codes of the service's own trouble, and of what an operator must mend
/// (the credentials, the bus's policy, a KMS key), whoever is said at fault.
const PASSING: &[&str] = &[
    "InternalException",
    "InternalFailure",
    "ServiceUnavailable",
    "RequestTimeout",
    "AccessDeniedException",
    "AccessDenied",
    "NotAuthorizedForSourceException",
    "NotAuthorizedForDetailTypeException",
    "UnrecognizedClientException",
    "InvalidSignatureException",
    "ExpiredTokenException",
    "KMSAccessDeniedException",
    "KMSDisabledException",
    "KMSInvalidStateException",
    "KMSNotFoundException",
    "RequestCanceled",
];

/// EventBridge's error codes.
pub const CODES: Codes = Codes {
    slow_down: SLOW_DOWN,
    missing: MISSING,
    passing: PASSING,
    too_long: |_, message| {
        let lower = message.to_ascii_lowercase();
        lower.contains("size") && (lower.contains("exceed") || lower.contains("too large"))
    },
};

#[cfg(test)]
mod tests {
    use super::*;
    use crate::publish::kind::Failure;

    fn bus() -> Target {
        Target::new(Kind::Bus, "arn:aws:events:eu-west-1:1:event-bus/orders", false, MAX_ENTRY_BYTES)
    }

    fn event(body: &str, attributes: Option<&str>) -> Arc<OutboxEvent> {
        let mut e = OutboxEvent::for_test(1, "orders", body);
        e.attributes = attributes.map(str::to_string);
        e.group_key = Some("g".into());
        Arc::new(e)
    }

    #[test]
    fn an_entry_from_the_rows_type_source_and_trace() {
        let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let attrs = format!(r#"{{"type": "OrderCreated", "source": "com.example.orders", "traceparent": "{tp}"}}"#);
        let e = bus().prepare(event(r#"{"id": 7}"#, Some(&attrs))).unwrap();
        let h = e.bus.as_deref().unwrap();
        assert_eq!((h.source.as_str(), h.detail_type.as_str()), ("com.example.orders", "OrderCreated"));
        assert!(e.trace_header.as_deref().unwrap().starts_with("Root=1-4bf92f35-"));
        assert_eq!(e.size, "com.example.orders".len() + "OrderCreated".len() + r#"{"id": 7}"#.len());
        assert!(e.attributes.is_empty() && e.group_id.is_none() && !e.ordered, "no attributes, no order");
        let plain = bus().prepare(event(" {}", None)).unwrap();
        let h = plain.bus.as_deref().unwrap();
        assert_eq!((h.source.as_str(), h.detail_type.as_str()), (DEFAULT_SOURCE, "orders"));
    }

    #[test]
    fn what_a_bus_cannot_take_is_dead_with_why() {
        let dead = |body: &str, attrs: Option<&str>| bus().prepare(event(body, attrs)).unwrap_err();
        for body in ["[1]", "\"text\"", "12", "not json", "", "{\"a\": 1} trailing"] {
            assert_eq!(dead(body, None).code, DeadCode::InvalidDetail, "{body:?}");
        }
        let d = dead("{}", Some(r#"{"tenant": "t1", "type": "X"}"#));
        assert_eq!(d.code, DeadCode::InvalidAttributes);
        assert!(d.detail.contains("tenant") && d.detail.contains("put the rest in the body"), "{d:?}");
        assert_eq!(dead("{}", Some(r#"{"source": "aws.s3"}"#)).code, DeadCode::InvalidAttributes);
        let long = format!(r#"{{"type": "{}"}}"#, "t".repeat(129));
        assert_eq!(dead("{}", Some(&long)).code, DeadCode::InvalidAttributes);
        let big = format!(r#"{{"x": "{}"}}"#, "x".repeat(MAX_ENTRY_BYTES));
        let d = dead(&big, None);
        assert!(d.code == DeadCode::TooLarge && d.detail.contains("no S3 pointer"), "{d:?}");
    }

    #[test]
    fn buses_hold_rows_due_later_and_name_their_arns() {
        assert!(!bus().delays());
        assert_eq!(bus().batch_limits(), BatchLimits { entries: 10, bytes: MAX_ENTRY_BYTES });
        assert_eq!(Kind::of_address("arn:aws:events:eu-west-1:123456789012:event-bus/default"), Ok(Kind::Bus));
        assert_eq!(Kind::of_address("arn:aws:events:eu-west-1:1:event-bus/a.b-c_d/e"), Ok(Kind::Bus));
        for bad in [
            "arn:aws:events:eu-west-1:1:rule/x",
            "arn:aws:events:eu-west-1:1:event-bus/",
            "arn:aws:events:r:1:event-bus/a b",
        ] {
            assert!(Kind::of_address(bad).unwrap_err().contains("cannot name an event bus"), "{bad}");
        }
    }

    #[test]
    fn eventbridge_codes() {
        assert_eq!(CODES.failure("ThrottlingException", true, ""), Failure::Throttled);
        assert_eq!(CODES.failure("ResourceNotFoundException", true, "Event bus x does not exist."), Failure::Missing);
        assert_eq!(CODES.failure("AccessDeniedException", true, ""), Failure::Passing);
        assert_eq!(CODES.failure("InternalFailure", true, ""), Failure::Passing);
        assert_eq!(
            CODES.failure(
                "ValidationException",
                true,
                "Total size of the entries in the request is over the limit (exceeds)"
            ),
            Failure::TooLong
        );
        assert_eq!(CODES.failure("MalformedDetail", true, "Detail is malformed."), Failure::Refused);
    }
}
