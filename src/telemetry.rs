//! The relay's own work as OpenTelemetry spans, exported over OTLP/HTTP
//! when the standard environment names a collector
//! (`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or `OTEL_EXPORTER_OTLP_ENDPOINT`;
//! `OTEL_SERVICE_NAME`, default `outbox-relay`; the SDK's other `OTEL_*`
//! variables apply too). Spans: `outbox_relay.route` (a decoded chunk of
//! one transaction: the replay filter and routing), `outbox_relay.send`
//! (one `SendMessageBatch`, with S3 writes before it; linked to each
//! producer's trace named by an entry's `traceparent`) and
//! `outbox_relay.settle` (one settlement flush). Without a collector the
//! spans cost a `tracing` span each and nothing is exported.

use opentelemetry::trace::{SpanContext, SpanId, TraceFlags, TraceId, TraceState, TracerProvider as _};
use opentelemetry_sdk::trace::{SdkTracer, SdkTracerProvider};
use tracing_opentelemetry::OpenTelemetrySpanExt;

use crate::publish::entry::Traceparent;

/// The exporter, kept to flush what is batched at exit.
pub struct Telemetry {
    provider: SdkTracerProvider,
}

/// Whether the environment names an OTLP collector for traces.
pub fn configured() -> bool {
    ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"]
        .iter()
        .any(|v| std::env::var(v).is_ok_and(|s| !s.trim().is_empty()))
}

impl Telemetry {
    /// The exporter and its tracer when [`configured`]; an error names what
    /// the SDK refused (an endpoint that is not a URL).
    pub fn from_env() -> Result<Option<(Telemetry, SdkTracer)>, String> {
        if !configured() {
            return Ok(None);
        }
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .build()
            .map_err(|e| format!("OTLP exporter: {e}"))?;
        let mut resource = opentelemetry_sdk::Resource::builder();
        if std::env::var("OTEL_SERVICE_NAME").is_err() {
            resource = resource.with_service_name("outbox-relay");
        }
        let provider =
            SdkTracerProvider::builder().with_batch_exporter(exporter).with_resource(resource.build()).build();
        let tracer = provider.tracer("outbox-relay");
        Ok(Some((Telemetry { provider }, tracer)))
    }

    /// Export what is batched and stop.
    pub fn shutdown(self) {
        if let Err(e) = self.provider.shutdown() {
            tracing::warn!(error = %e, "OTLP exporter: spans not flushed at exit");
        }
    }
}

/// A W3C `traceparent` as a remote span context; `None` when it is not one.
pub fn remote_context(traceparent: &str) -> Option<SpanContext> {
    let tp = Traceparent::parse(traceparent)?;
    let (trace, parent) = (TraceId::from_hex(tp.trace).ok()?, SpanId::from_hex(tp.parent).ok()?);
    Some(SpanContext::new(trace, parent, TraceFlags::new(tp.flags), true, TraceState::default()))
}

/// Link `span` to the producer's trace named by `traceparent`.
pub fn link_producer(span: &tracing::Span, traceparent: &str) {
    if let Some(cx) = remote_context(traceparent) {
        span.add_link(cx);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_traceparent_is_a_remote_context_and_nothing_else_is() {
        let cx = remote_context("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01").unwrap();
        assert_eq!(cx.trace_id().to_string(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(cx.span_id().to_string(), "00f067aa0ba902b7");
        assert!(cx.is_sampled() && cx.is_remote());
        for bad in ["", "00-00000000000000000000000000000000-00f067aa0ba902b7-01", "00-xyz-00f067aa0ba902b7-01"] {
            assert!(remote_context(bad).is_none(), "{bad}");
        }
    }
}
