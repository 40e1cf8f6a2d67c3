//! What every AWS client of the relay shares: its configuration
//! ([`sdk_config`]), and how a service's answer becomes the relay's
//! ([`call_error`], [`entry_results`]).

use std::time::Duration;

use aws_sdk_sqs::config::http::HttpResponse;
use aws_sdk_sqs::error::{ProvideErrorMetadata, SdkError};

use super::{CallError, EntryResult};

/// A failed call in the relay's terms: the service's code and whether it
/// blamed the sender, or `timeout` / `transport` when no answer came.
pub fn call_error<E>(e: SdkError<E, HttpResponse>) -> CallError
where
    E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
{
    match &e {
        SdkError::ServiceError(se) => {
            let sender_fault = se.raw().status().is_client_error();
            CallError {
                code: se.err().code().unwrap_or("unknown").to_string(),
                message: se.err().message().unwrap_or("").to_string(),
                sender_fault,
            }
        }
        SdkError::TimeoutError(_) => {
            CallError { code: "timeout".into(), message: format!("{e:?}"), sender_fault: false }
        }
        _ => CallError::transport(format!("{}", aws_smithy_types::error::display::DisplayErrorContext(&e))),
    }
}

/// Each of a batch's `n` entries' result, from the ids its request gave
/// them (their positions) and the response's lists of those that
/// succeeded and those that failed (id, code, sender's fault, message); an
/// entry the response leaves out is unknown, so sent again.
pub fn entry_results<'a>(
    n: usize,
    successful: impl IntoIterator<Item = &'a str>,
    failed: impl IntoIterator<Item = (&'a str, String, bool, String)>,
    call: &str,
) -> Vec<EntryResult> {
    let mut results: Vec<Option<EntryResult>> = vec![None; n];
    let mut place = |id: &str, r: EntryResult| {
        if let Some(slot) = id.parse::<usize>().ok().and_then(|i| results.get_mut(i)) {
            // A failure reported beside a success for one id wins.
            if slot.is_none() || matches!(r, EntryResult::Failed { .. }) {
                *slot = Some(r);
            }
        }
    };
    for id in successful {
        place(id, EntryResult::Sent);
    }
    for (id, code, sender_fault, message) in failed {
        place(id, EntryResult::Failed { code, sender_fault, message });
    }
    results
        .into_iter()
        .map(|r| {
            r.unwrap_or_else(|| EntryResult::Failed {
                code: "MissingFromResponse".into(),
                sender_fault: false,
                message: format!("entry absent from the {call} response"),
            })
        })
        .collect()
}

/// The standard AWS configuration chain, with `region` and an optional
/// endpoint override. The SDK's own retries are off ([`crate::policy::retry`]
/// is the only place that retries). With `role_arn`, that role is assumed
/// through STS with the chain's credentials (refreshed before they expire).
/// A local endpoint without credentials in the environment gets dummy ones,
/// which SQS- and S3-compatible servers accept.
pub async fn sdk_config(region: &str, endpoint_url: Option<&str>, role_arn: Option<&str>) -> aws_config::SdkConfig {
    let region = aws_config::Region::new(region.to_string());
    let mut loader = aws_config::defaults(aws_config::BehaviorVersion::latest())
        .region(region.clone())
        .retry_config(aws_config::retry::RetryConfig::disabled())
        .timeout_config(
            aws_config::timeout::TimeoutConfig::builder()
                .operation_attempt_timeout(Duration::from_secs(20))
                .connect_timeout(Duration::from_secs(5))
                .build(),
        );
    if let Some(arn) = role_arn {
        let base = aws_config::defaults(aws_config::BehaviorVersion::latest()).region(region).load().await;
        let provider = aws_config::sts::AssumeRoleProvider::builder(arn)
            .session_name("outbox-relay")
            .configure(&base)
            .build()
            .await;
        loader = loader.credentials_provider(provider);
    }
    if let Some(url) = endpoint_url {
        loader = loader.endpoint_url(url);
        let no_credentials =
            std::env::var_os("AWS_ACCESS_KEY_ID").is_none() && std::env::var_os("AWS_PROFILE").is_none();
        if role_arn.is_none() && no_credentials {
            loader = loader.credentials_provider(aws_sdk_sqs::config::Credentials::new(
                "local",
                "local",
                None,
                None,
                "outbox-relay-local-endpoint",
            ));
        }
    }
    loader.load().await
}
