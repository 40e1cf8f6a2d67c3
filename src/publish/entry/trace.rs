//! The producer's W3C trace context, carried as SQS's `AWSTraceHeader`.

/// The W3C trace-context attribute a producer sets to join its trace.
pub const TRACEPARENT: &str = "traceparent";
/// Its vendors' part, carried beside it when a producer gives one.
pub const TRACESTATE: &str = "tracestate";

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

/// A trace-context column's value as (`traceparent`, `tracestate`): a W3C
/// `traceparent` as it is, or Debezium's span context (its outbox
/// extension's `tracingspancontext`: a Java properties text whose
/// `traceparent` and `tracestate` keys hold the W3C values). A value that
/// is neither goes as it is, as any invalid traceparent does.
pub fn trace_context(value: &str) -> (String, Option<String>) {
    if Traceparent::parse(value).is_some() {
        return (value.to_string(), None);
    }
    // Trace context is ASCII (W3C), which Java's properties encoding keeps as it is.
    match java_properties::read(value.as_bytes()) {
        Ok(mut p) => match p.remove(TRACEPARENT) {
            Some(tp) => (tp, p.remove(TRACESTATE).filter(|s| !s.is_empty())),
            None => (value.to_string(), None),
        },
        Err(_) => (value.to_string(), None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TP: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn a_traceparent_goes_as_it_is() {
        assert_eq!(trace_context(TP), (TP.to_string(), None));
    }

    /// What Debezium's Quarkus outbox extension stores (`Properties.store`):
    /// a date comment, then the keys, `=` and `:` in values escaped.
    #[test]
    fn debeziums_span_context_gives_its_traceparent_and_tracestate() {
        let stored = format!(
            "#Sun Dec 06 22:00:00 UTC 2026\ntracestate=congo\\=t61rcWkgMzE,rojo\\=00f067aa0ba902b7\ntraceparent={TP}\n"
        );
        assert_eq!(trace_context(&stored), (TP.to_string(), Some("congo=t61rcWkgMzE,rojo=00f067aa0ba902b7".into())));
        let crlf = format!("#comment\r\ntraceparent = {TP}\r\n");
        assert_eq!(trace_context(&crlf), (TP.to_string(), None));
        assert_eq!(xray_trace_header(&trace_context(&crlf).0).as_deref(), xray_trace_header(TP).as_deref());
    }

    #[test]
    fn anything_else_goes_as_it_is() {
        for v in ["uber-trace-id=abc:def:0:1", "#only a comment\n", "not a trace", ""] {
            assert_eq!(trace_context(v), (v.to_string(), None), "{v:?}");
        }
    }
}
