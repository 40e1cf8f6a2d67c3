//! A segment of the archive: the events one flush published to one
//! destination, as gzip-compressed JSON lines, under a key that sorts by
//! the time it was written.

use std::io::{Read, Write};

use bytes::Bytes;
use serde::{Deserialize, Serialize};

/// One published event, as the archive keeps it: what a replay needs to
/// send it again.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Line {
    pub event_id: String,
    /// The destination it was sent to.
    pub destination: String,
    pub body: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group_key: Option<String>,
    /// The `attributes` JSON text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attributes: Option<String>,
    /// Its transaction's commit time, microseconds since the Unix epoch.
    pub committed_us: i64,
    /// When it was published (settled), microseconds since the Unix epoch.
    pub published_us: i64,
    /// The mapped table it came from (`schema.table`); `None`: the relay's
    /// own table.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub table: Option<String>,
    /// The replay that sent it (a copy): a later replay does not select it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replay_of: Option<i64>,
}

/// A segment's lines as gzip-compressed JSON lines.
pub fn encode(lines: &[Line]) -> Bytes {
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    for l in lines {
        serde_json::to_writer(&mut gz, l).expect("a line is JSON");
        gz.write_all(b"\n").expect("writing to memory");
    }
    Bytes::from(gz.finish().expect("writing to memory"))
}

/// A segment's lines back; an error says what is wrong with the object.
pub fn decode(bytes: &[u8]) -> Result<Vec<Line>, String> {
    let mut text = String::new();
    flate2::read::GzDecoder::new(bytes)
        .read_to_string(&mut text)
        .map_err(|e| format!("not a gzip-compressed text: {e}"))?;
    text.lines()
        .filter(|l| !l.is_empty())
        .enumerate()
        .map(|(i, l)| serde_json::from_str(l).map_err(|e| format!("line {}: {e}", i + 1)))
        .collect()
}

/// Digits of a key's time: microseconds since the epoch, zero-padded, so
/// keys sort by it.
const TIME_DIGITS: usize = 20;

/// The folder of `destination`'s segments under `prefix`: its name with
/// every byte outside `A-Za-z0-9._-` as `%XX`, so a name from a template
/// (a column's value) cannot make a key of another folder.
pub fn folder(prefix: &str, destination: &str) -> String {
    let mut out = String::with_capacity(prefix.len() + destination.len() + 1);
    out.push_str(prefix);
    for b in destination.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out.push('/');
    out
}

/// A segment's key: its destination's folder, the time it was written and
/// `writer` (this process and its count of segments), `.jsonl.gz`.
pub fn key(prefix: &str, destination: &str, written_us: i64, writer: &str) -> String {
    format!("{}{:0width$}-{writer}.jsonl.gz", folder(prefix, destination), written_us.max(0), width = TIME_DIGITS)
}

/// The first key of `folder` written at or after `us`: listing after it
/// starts there.
pub fn after(folder: &str, us: i64) -> String {
    // Keys of that time sort after its digits followed by '-'; '-' sorts
    // before every digit, so a key written at `us` follows this.
    format!("{folder}{:0width$}", us.max(0), width = TIME_DIGITS)
}

/// The time a key in `folder` was written, if it is a segment's key.
pub fn written_us(folder: &str, key: &str) -> Option<i64> {
    let rest = key.strip_prefix(folder)?;
    let digits = rest.get(..TIME_DIGITS)?;
    if !rest[TIME_DIGITS..].starts_with('-') || !rest.ends_with(".jsonl.gz") {
        return None;
    }
    digits.parse().ok()
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn line(event_id: &str, body: &str) -> Line {
        Line {
            event_id: event_id.into(),
            destination: "orders".into(),
            body: body.into(),
            group_key: Some("g".into()),
            attributes: None,
            committed_us: 1,
            published_us: 2,
            table: None,
            replay_of: None,
        }
    }

    #[test]
    fn a_damaged_object_is_an_error_not_a_panic() {
        assert!(decode(b"not gzip").unwrap_err().contains("gzip"));
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        gz.write_all(b"{\"event_id\":1}\n").unwrap();
        assert!(decode(&gz.finish().unwrap()).unwrap_err().starts_with("line 1"));
    }

    #[test]
    fn a_name_cannot_leave_its_folder() {
        assert_eq!(folder("a/", "orders.fifo"), "a/orders.fifo/");
        assert_eq!(folder("a/", "x/../y"), "a/x%2F..%2Fy/");
        assert_eq!(folder("", "ü"), "%C3%BC/");
    }

    proptest! {
        #[test]
        fn lines_come_back_as_written(events in prop::collection::vec(("\\PC{0,12}", "\\PC{0,200}"), 0..20)) {
            let lines: Vec<Line> = events.iter().map(|(e, b)| line(e, b)).collect();
            prop_assert_eq!(decode(&encode(&lines)).unwrap(), lines);
        }

        #[test]
        fn keys_sort_by_their_time(a in 0i64..1 << 60, b in 0i64..1 << 60, dest in "\\PC{1,10}") {
            let f = folder("p/", &dest);
            let (ka, kb) = (key("p/", &dest, a, "1-0"), key("p/", &dest, b, "1-0"));
            prop_assert_eq!(written_us(&f, &ka), Some(a));
            prop_assert_eq!(a.cmp(&b), ka.cmp(&kb));
            prop_assert!(after(&f, a) < ka);
            if b > a {
                prop_assert!(after(&f, b) > ka);
            }
        }
    }
}
