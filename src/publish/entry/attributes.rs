//! A row's `attributes` JSON as SQS message attributes, and SQS's rules
//! for them (names, types, numbers, characters).

use crate::policy::dead::{DeadCode, DeadReason};
use crate::publish::offload::RESERVED_ATTRIBUTES;

/// A message attribute, in SQS's terms.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attribute {
    pub name: String,
    pub data_type: String,
    pub value: String,
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
