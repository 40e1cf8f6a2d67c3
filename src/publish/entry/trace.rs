//! The producer's W3C trace context, carried as SQS's `AWSTraceHeader`.

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
