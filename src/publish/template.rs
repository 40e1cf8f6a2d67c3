//! Destination addresses made from a template and a destination's name:
//! routing by a row's value to a queue (a queue-URL template) or a topic (a
//! topic-ARN template) of that name.

use crate::policy::dead::DeadReason;
use crate::publish::kind::{bus, check_name, queue, topic, Kind};

/// A queue URL or a topic ARN with `{destination}` (and optionally
/// `{region}`) in it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AddressTemplate {
    kind: Kind,
    template: String,
    region: String,
}

impl AddressTemplate {
    /// `template` must hold `{destination}`, and no other placeholder than
    /// `{region}`; what it makes is a queue's URL or a topic's ARN.
    pub fn new(template: &str, region: &str) -> Result<AddressTemplate, String> {
        if !template.contains("{destination}") {
            return Err(format!("template {template:?} has no {{destination}}"));
        }
        let rest = template.replace("{destination}", "").replace("{region}", "");
        if rest.contains('{') || rest.contains('}') {
            return Err(format!("template {template:?}: the placeholders are {{destination}} and {{region}}"));
        }
        let example = template.replace("{destination}", "name").replace("{region}", region);
        let kind = Kind::of_address(&example).map_err(|why| format!("template {template:?}: {why}"))?;
        Ok(AddressTemplate { kind, template: template.to_string(), region: region.to_string() })
    }

    /// The kind of destination its addresses name.
    pub fn kind(&self) -> Kind {
        self.kind
    }

    /// The address of `destination`, if it can name a destination of the
    /// template's kind (SQS's rule for a queue: 1 to 80 letters, digits,
    /// `-` and `_`, a FIFO queue's ending in `.fifo`; SNS's for a topic: the
    /// same, up to 256); otherwise its rows are DEAD with why.
    pub fn address(&self, destination: &str) -> Result<String, DeadReason> {
        let checked = match self.kind {
            Kind::Queue => check_name(destination, queue::MAX_NAME, "queue"),
            Kind::Topic => check_name(destination, topic::MAX_NAME, "topic"),
            Kind::Bus => bus::check_resource(&format!("event-bus/{destination}")),
        };
        if let Err(why) = checked {
            return Err(DeadReason::new(self.kind.rules().missing(), format!("destination {destination:?}: {why}")));
        }
        Ok(self.template.replace("{destination}", destination).replace("{region}", &self.region))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::dead::DeadCode;

    #[test]
    fn templates_name_queues_and_refuse_what_cannot_be_one() {
        let t = AddressTemplate::new("https://sqs.{region}.amazonaws.com/1/{destination}", "eu-west-1").unwrap();
        assert_eq!(t.kind(), Kind::Queue);
        assert_eq!(t.address("orders").unwrap(), "https://sqs.eu-west-1.amazonaws.com/1/orders");
        assert_eq!(t.address("tenant-7_a.fifo").unwrap(), "https://sqs.eu-west-1.amazonaws.com/1/tenant-7_a.fifo");
        for bad in ["", "a/b", "../x", "a b", ".fifo", &"x".repeat(81)] {
            let dead = t.address(bad).unwrap_err();
            assert_eq!(dead.code, DeadCode::QueueNotFound, "{bad:?}");
            assert!(dead.detail.contains("cannot name a queue"), "{dead:?}");
        }
        assert!(AddressTemplate::new("https://x/q", "r").is_err());
        assert!(AddressTemplate::new("https://x/{account}/{destination}", "r").is_err());
    }

    #[test]
    fn templates_name_topics() {
        let t = AddressTemplate::new("arn:aws:sns:{region}:123456789012:{destination}", "eu-west-1").unwrap();
        assert_eq!(t.kind(), Kind::Topic);
        assert_eq!(t.address("orders.fifo").unwrap(), "arn:aws:sns:eu-west-1:123456789012:orders.fifo");
        assert_eq!(t.address(&"x".repeat(256)).unwrap().len(), "arn:aws:sns:eu-west-1:123456789012:".len() + 256);
        for bad in ["", "a:b", "a b", ".fifo", &"x".repeat(257)] {
            assert_eq!(t.address(bad).unwrap_err().code, DeadCode::TopicNotFound, "{bad:?}");
        }
        let wrong = AddressTemplate::new("arn:aws:sqs:{region}:1:{destination}", "r").unwrap_err();
        assert!(wrong.contains("an ARN of \"sqs\""), "{wrong}");
    }
}
