//! Queue URLs made from a template and a destination's name: routing by a
//! row's value to a queue of that name.

use crate::policy::dead::{DeadCode, DeadReason};
use crate::publish::kind::Kind;

/// A queue URL with `{destination}` (and optionally `{region}`) in it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueUrlTemplate {
    template: String,
    region: String,
}

impl QueueUrlTemplate {
    /// `template` must hold `{destination}`, and no other placeholder than
    /// `{region}`.
    pub fn new(template: &str, region: &str) -> Result<QueueUrlTemplate, String> {
        if !template.contains("{destination}") {
            return Err(format!("queue_url_template {template:?} has no {{destination}}"));
        }
        let rest = template.replace("{destination}", "").replace("{region}", "");
        if rest.contains('{') || rest.contains('}') {
            return Err(format!(
                "queue_url_template {template:?}: the placeholders are {{destination}} and {{region}}"
            ));
        }
        Ok(QueueUrlTemplate { template: template.to_string(), region: region.to_string() })
    }

    /// The kind of destination its addresses name.
    pub fn kind(&self) -> Kind {
        Kind::Queue
    }

    /// The queue URL of `destination`, if it can name a queue (SQS's rule:
    /// 1 to 80 letters, digits, `-` and `_`, a FIFO queue's ending in
    /// `.fifo`); otherwise its rows are DEAD with why.
    pub fn url(&self, destination: &str) -> Result<String, DeadReason> {
        let stem = destination.strip_suffix(".fifo").unwrap_or(destination);
        let ok = !stem.is_empty()
            && destination.len() <= 80
            && stem.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
        if !ok {
            return Err(DeadReason::new(
                DeadCode::QueueNotFound,
                format!(
                    "destination {destination:?} cannot name a queue (1 to 80 letters, digits, - and _, \
                     .fifo at the end of a FIFO queue's)"
                ),
            ));
        }
        Ok(self.template.replace("{destination}", destination).replace("{region}", &self.region))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn templates_name_queues_and_refuse_what_cannot_be_one() {
        let t = QueueUrlTemplate::new("https://sqs.{region}.amazonaws.com/1/{destination}", "eu-west-1").unwrap();
        assert_eq!(t.url("orders").unwrap(), "https://sqs.eu-west-1.amazonaws.com/1/orders");
        assert_eq!(t.url("tenant-7_a.fifo").unwrap(), "https://sqs.eu-west-1.amazonaws.com/1/tenant-7_a.fifo");
        for bad in ["", "a/b", "../x", "a b", ".fifo", &"x".repeat(81)] {
            assert_eq!(t.url(bad).unwrap_err().code, DeadCode::QueueNotFound, "{bad:?}");
        }
        assert!(QueueUrlTemplate::new("https://x/q", "r").is_err());
        assert!(QueueUrlTemplate::new("https://x/{account}/{destination}", "r").is_err());
    }
}
