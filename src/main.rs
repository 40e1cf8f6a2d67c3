//! The `outbox-relay` command: parses the command line and calls the library.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context;
use clap::{Parser, Subcommand};
use outbox_relay::config::{Config, Mode, Overrides};
use outbox_relay::metrics::Metrics;
use outbox_relay::publisher::sqs::SqsPublisher;
use outbox_relay::{db, RelayHandle};

#[derive(Parser)]
#[command(name = "outbox-relay", version, about = "Transactional outbox relay: PostgreSQL logical replication in, Amazon SQS out")]
struct Cli {
    /// Log format: human or json.
    #[arg(long, global = true, default_value = "human", env = "OUTBOX_RELAY_LOG_FORMAT")]
    log_format: String,
    #[command(subcommand)]
    command: Command,
}

#[derive(clap::Args, Clone, Default)]
struct CommonArgs {
    /// Path to relay.toml.
    #[arg(long, short, env = "OUTBOX_RELAY_CONFIG")]
    config: Option<PathBuf>,
    #[arg(long)]
    database_url: Option<String>,
    #[arg(long)]
    slot: Option<String>,
    #[arg(long)]
    publication: Option<String>,
    #[arg(long)]
    sqs_endpoint_url: Option<String>,
}

#[derive(Subcommand)]
enum Command {
    /// Create or update the outbox table and publication (idempotent).
    Migrate {
        #[arg(long, env = "OUTBOX_RELAY_DATABASE_URL")]
        database_url: String,
    },
    /// Relay committed outbox rows to SQS until SIGTERM or SIGINT.
    Run {
        #[command(flatten)]
        common: CommonArgs,
        /// cdc | polling | auto
        #[arg(long)]
        mode: Option<Mode>,
        /// Address for /metrics, /healthz and /readyz ("off" to disable).
        #[arg(long)]
        metrics_addr: Option<String>,
    },
    /// Slot, lag and per-destination counts.
    Status {
        #[command(flatten)]
        common: CommonArgs,
        #[arg(long)]
        json: bool,
    },
}

fn overrides(c: &CommonArgs) -> Overrides {
    Overrides {
        database_url: c.database_url.clone(),
        slot: c.slot.clone(),
        publication: c.publication.clone(),
        sqs_endpoint_url: c.sqs_endpoint_url.clone(),
        ..Default::default()
    }
}

fn init_logging(format: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let b = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    if format == "json" {
        b.json().init();
    } else {
        b.init();
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging(&cli.log_format);
    match real_main(cli).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("outbox-relay: {e:#}");
            ExitCode::from(2)
        }
    }
}

async fn real_main(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Migrate { database_url } => {
            let mut client = db::connect(&database_url).await?;
            let applied = db::migrate(&mut client).await?;
            if applied.is_empty() {
                println!("migrations: up to date");
            } else {
                println!("migrations: applied {applied:?}");
            }
            Ok(())
        }
        Command::Run { common, mode, metrics_addr } => {
            let mut o = overrides(&common);
            o.mode = mode;
            o.metrics_addr = metrics_addr;
            let config = Config::load(common.config.as_deref(), &o)?;
            tracing::info!(?config, "starting");
            let publisher = SqsPublisher::new(&config.sqs_region, config.sqs_endpoint_url.as_deref()).await;
            let handle = RelayHandle { metrics: Metrics::new() };
            outbox_relay::run(config, Arc::new(publisher), handle, shutdown_signal()).await?;
            Ok(())
        }
        Command::Status { common, json } => {
            let config = Config::load(common.config.as_deref(), &overrides(&common))?;
            let client = db::connect(&config.database_url).await?;
            let status = outbox_relay::relay::status(&client, &config).await.context("reading status")?;
            if json {
                println!("{}", serde_json::to_string_pretty(&status)?);
            } else {
                print!("{}", outbox_relay::relay::format_status(&status));
            }
            Ok(())
        }
    }
}

async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    tracing::info!("shutdown requested");
}
