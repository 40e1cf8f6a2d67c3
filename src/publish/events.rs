//! Amazon EventBridge through aws-sdk-eventbridge: a bus's description and
//! `PutEvents`.

use aws_sdk_eventbridge::types::PutEventsRequestEntry;

use super::entry::Entry;
use super::kind::bus::MAX_ENTRY_BYTES;
use super::kind::{Kind, Target};
use super::sdk::call_error;
use super::{CallError, EntryResult};

/// A bus, if it exists (a bus keeps no order; its limit is EventBridge's).
/// Asked by its ARN (a bus of another account), then by its name: some
/// compatible servers know a bus by its name only.
pub(super) async fn describe(client: &aws_sdk_eventbridge::Client, bus_arn: &str) -> Result<Target, CallError> {
    let by_arn = client.describe_event_bus().name(bus_arn).send().await.map_err(call_error);
    if let Err(e) = by_arn {
        let name = bus_arn.split_once(":event-bus/").map(|(_, name)| name);
        match name {
            Some(name) if e.code == "ResourceNotFoundException" => {
                client.describe_event_bus().name(name).send().await.map_err(call_error)?;
            }
            _ => return Err(e),
        }
    }
    Ok(Target::new(Kind::Bus, bus_arn, false, MAX_ENTRY_BYTES))
}

/// One `PutEvents`: its results come back in the entries' order.
pub(super) async fn send(
    client: &aws_sdk_eventbridge::Client,
    bus_arn: &str,
    entries: &[Entry],
) -> Result<Vec<EntryResult>, CallError> {
    let mut req = client.put_events();
    for e in entries {
        req = req.entries(request_entry(bus_arn, e)?);
    }
    let out = req.send().await.map_err(call_error)?;
    let mut answered = out.entries.unwrap_or_default().into_iter();
    let results = entries
        .iter()
        .map(|_| match answered.next() {
            Some(r) if r.error_code.is_none() && r.event_id.is_some() => EntryResult::Sent,
            Some(r) => EntryResult::Failed {
                code: r.error_code.unwrap_or_else(|| "unknown".into()),
                sender_fault: true,
                message: r.error_message.unwrap_or_default(),
            },
            None => EntryResult::Failed {
                code: "MissingFromResponse".into(),
                sender_fault: false,
                message: "entry absent from the PutEvents response".into(),
            },
        })
        .collect();
    Ok(results)
}

/// The request entry of `e`: its `Source` and `DetailType`, the body as
/// `Detail`, the trace as `TraceHeader`.
fn request_entry(bus_arn: &str, e: &Entry) -> Result<PutEventsRequestEntry, CallError> {
    let Some(headers) = e.bus.as_deref() else {
        return Err(CallError::transport("an entry for an event bus without its Source and DetailType"));
    };
    let mut b = PutEventsRequestEntry::builder()
        .event_bus_name(bus_arn)
        .source(headers.source.clone())
        .detail_type(headers.detail_type.clone())
        .detail(e.message_body());
    if let Some(t) = &e.trace_header {
        b = b.trace_header(t.clone());
    }
    Ok(b.build())
}
