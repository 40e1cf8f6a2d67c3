//! The AWS configuration the SQS and S3 clients share.

use std::time::Duration;

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
