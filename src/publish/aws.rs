//! The AWS services the relay sends to: [`AwsPublisher`] sends a batch to
//! a destination of any kind through its service's client (SQS:
//! [`super::sqs`], SNS: [`super::sns`], EventBridge: [`super::events`]),
//! all of them made from one
//! configuration ([`super::sdk::sdk_config`], which the S3 client shares).

use async_trait::async_trait;

use super::entry::Entry;
use super::kind::{Kind, Target};
use super::{CallError, EntryResult, Publisher};

/// The relay's destinations on AWS: queues, topics and buses. The SDKs' own
/// retries are off ([`crate::policy::retry`] is the only place that retries).
#[derive(Clone, Debug)]
pub struct AwsPublisher {
    sqs: aws_sdk_sqs::Client,
    sns: aws_sdk_sns::Client,
    events: aws_sdk_eventbridge::Client,
}

impl AwsPublisher {
    /// Clients from the standard AWS configuration chain, with `region` and
    /// an optional endpoint override. A local endpoint without credentials
    /// in the environment gets dummy ones, which compatible servers accept.
    pub async fn new(region: &str, endpoint_url: Option<&str>) -> Self {
        Self::with_role(region, endpoint_url, None).await
    }

    /// As [`new`](Self::new); with `role_arn`, assume that role through STS
    /// with the chain's credentials (refreshed before they expire).
    pub async fn with_role(region: &str, endpoint_url: Option<&str>, role_arn: Option<&str>) -> Self {
        let config = super::sdk::sdk_config(region, endpoint_url, role_arn).await;
        Self {
            sqs: aws_sdk_sqs::Client::new(&config),
            sns: aws_sdk_sns::Client::new(&config),
            events: aws_sdk_eventbridge::Client::new(&config),
        }
    }

    /// The SQS client.
    pub fn sqs(&self) -> &aws_sdk_sqs::Client {
        &self.sqs
    }

    /// The SNS client.
    pub fn sns(&self) -> &aws_sdk_sns::Client {
        &self.sns
    }

    /// The EventBridge client.
    pub fn events(&self) -> &aws_sdk_eventbridge::Client {
        &self.events
    }
}

#[async_trait]
impl Publisher for AwsPublisher {
    async fn describe(&self, kind: Kind, address: &str) -> Result<Target, CallError> {
        match kind {
            Kind::Queue => super::sqs::describe(&self.sqs, address).await,
            Kind::Topic => super::sns::describe(&self.sns, address).await,
            Kind::Bus => super::events::describe(&self.events, address).await,
        }
    }

    async fn send_batch(&self, target: &Target, entries: &[Entry]) -> Result<Vec<EntryResult>, CallError> {
        match target.kind {
            Kind::Queue => super::sqs::send(&self.sqs, &target.address, entries).await,
            Kind::Topic => super::sns::send(&self.sns, &target.address, entries).await,
            Kind::Bus => super::events::send(&self.events, &target.address, entries).await,
        }
    }
}
