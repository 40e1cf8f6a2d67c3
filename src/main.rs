//! The `outbox-relay` command: parses the command line and calls the library.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use clap::{Parser, Subcommand};
use outbox_relay::config::{Config, Mode, Overrides};
use outbox_relay::db::{self, Db};
use outbox_relay::metrics::Metrics;
use outbox_relay::ops;
use outbox_relay::publish::aws::AwsPublisher;

#[derive(Parser)]
#[command(
    name = "outbox-relay",
    version,
    about = "Transactional outbox relay: PostgreSQL logical replication in, Amazon SQS out"
)]
struct Cli {
    /// Log format.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Human, env = "OUTBOX_RELAY_LOG_FORMAT")]
    log_format: LogFormat,
    /// Runtime threads. 1 runs everything on one thread, which spends less
    /// CPU on waking threads (10-17% less per event in the README's drains)
    /// but caps the relay at one core; 0 means one per core.
    #[arg(long, global = true, default_value_t = 0, env = "OUTBOX_RELAY_WORKER_THREADS")]
    worker_threads: usize,
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
        /// Print the migrations not applied yet, with their SQL, and apply nothing.
        #[arg(long)]
        dry_run: bool,
    },
    /// Relay committed outbox rows to SQS until SIGTERM or SIGINT.
    Run {
        #[command(flatten)]
        common: CommonArgs,
        /// cdc | polling | auto
        #[arg(long)]
        mode: Option<Mode>,
        /// Address for /metrics, /healthz, /readyz and /leader ("off" to disable).
        #[arg(long)]
        metrics_addr: Option<String>,
        /// Read and check the configuration (file, environment, flags), say
        /// what it sets, and exit: nothing is connected to.
        #[arg(long)]
        check: bool,
    },
    /// Mode, slot, lag and per-destination counts (NEW, spooled, DEAD, oldest).
    Status {
        #[command(flatten)]
        common: CommonArgs,
        /// Machine-readable output (its "format" field is the schema version).
        #[arg(long)]
        json: bool,
    },
    /// The replication slot: status, create (with catch-up of older rows), drop.
    Slot {
        #[command(subcommand)]
        action: SlotAction,
    },
    /// DEAD rows: list them, or send them again.
    Dead {
        #[command(subcommand)]
        action: DeadAction,
    },
    /// Send again what was published (rows kept: published_rows = "keep"),
    /// by destination, time and event id, to its destination or another.
    #[command(args_conflicts_with_subcommands = true)]
    Replay {
        #[command(subcommand)]
        action: Option<ReplayAction>,
        #[command(flatten)]
        args: Box<ReplayArgs>,
    },
}

#[derive(clap::Args, Clone, Default)]
struct ReplayArgs {
    #[command(flatten)]
    common: CommonArgs,
    /// Events published to this destination (default: every destination).
    #[arg(long)]
    destination: Option<String>,
    /// Published at or after this time (ISO: 2026-12-07 10:00:00+00).
    #[arg(long)]
    since: Option<String>,
    /// Published before this time (default: now).
    #[arg(long)]
    until: Option<String>,
    /// This event only; repeat for more.
    #[arg(long = "event-id")]
    event_ids: Vec<String>,
    /// Send them to this destination instead of their own.
    #[arg(long)]
    to: Option<String>,
    /// Events of this mapped table only (schema.table); read from the archive.
    #[arg(long)]
    table: Option<String>,
    /// Read what was published from the table's kept rows or the archive
    /// (default: the table with published_rows = "keep", else the archive).
    #[arg(long, value_parser = ["table", "archive"])]
    from: Option<String>,
    /// Say how many events and bytes would go, per destination; send nothing.
    #[arg(long)]
    dry_run: bool,
    /// At most this many events a second.
    #[arg(long)]
    rate: Option<u32>,
    #[arg(long)]
    json: bool,
}

#[derive(Subcommand)]
enum ReplayAction {
    /// Replays, newest first, with their progress.
    List {
        #[command(flatten)]
        common: CommonArgs,
        #[arg(long)]
        json: bool,
    },
    /// Go on with an interrupted replay (the command killed): from where its
    /// last copies were written, none twice.
    Resume {
        #[command(flatten)]
        common: CommonArgs,
        id: i64,
        #[arg(long)]
        rate: Option<u32>,
    },
    /// Copy nothing more of a replay; what was copied is sent.
    Cancel {
        #[command(flatten)]
        common: CommonArgs,
        id: i64,
    },
}

#[derive(Subcommand)]
enum SlotAction {
    /// Whether the slot exists, is read, how much WAL it holds.
    Status {
        #[command(flatten)]
        common: CommonArgs,
        #[arg(long)]
        json: bool,
    },
    /// Create the slot; NEW rows written before it are handed to the table path.
    Create {
        #[command(flatten)]
        common: CommonArgs,
        /// Create it with FAILOVER (PostgreSQL 17+): standbys running
        /// sync_replication_slots keep it (also `failover = true` in the config).
        #[arg(long)]
        failover: bool,
    },
    /// Drop the slot (refused while a relay reads it). Nothing is lost: NEW
    /// rows stay NEW and the next slot's catch-up publishes them.
    Drop {
        #[command(flatten)]
        common: CommonArgs,
    },
}

#[derive(Subcommand)]
enum DeadAction {
    /// DEAD rows with their reasons, oldest first.
    List {
        #[command(flatten)]
        common: CommonArgs,
        #[arg(long)]
        destination: Option<String>,
        /// A mapped table's rows only (`schema.table`; `public` if no schema).
        #[arg(long)]
        table: Option<String>,
        #[arg(long, default_value_t = 100)]
        limit: i64,
        #[arg(long)]
        json: bool,
    },
    /// DEAD → NEW with attempts reset: the relay sends them again.
    Redrive {
        #[command(flatten)]
        common: CommonArgs,
        #[arg(long)]
        destination: Option<String>,
        /// A mapped table's rows only (`schema.table`; `public` if no schema).
        #[arg(long)]
        table: Option<String>,
        #[arg(long)]
        id: Option<i64>,
        /// Redrive every DEAD row (required when neither --destination, --table nor --id is given).
        #[arg(long)]
        all: bool,
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

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum LogFormat {
    Human,
    Json,
}

/// The log on stderr and, when the environment names an OTLP collector,
/// the relay's spans exported to it ([`outbox_relay::telemetry`]).
fn init_logging(format: LogFormat) -> Result<Option<outbox_relay::telemetry::Telemetry>, String> {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    use tracing_subscriber::Layer;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        // pgwire-replication logs each failed connection at ERROR itself;
        // the relay reports those (once per host) with what it does next.
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,pgwire_replication=off"));
    // Colour only for a terminal: logs in a file or a pipe stay plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr).with_ansi(ansi);
    let fmt = if format == LogFormat::Json { fmt.json().boxed() } else { fmt.boxed() };
    let exported = outbox_relay::telemetry::Telemetry::from_env()?;
    let (telemetry, spans) = match exported {
        Some((t, tracer)) => {
            // Only the relay's own spans, not its libraries'.
            let only_relay =
                tracing_subscriber::filter::Targets::new().with_target("outbox_relay", tracing::Level::INFO);
            (Some(t), Some(tracing_opentelemetry::layer().with_tracer(tracer).with_filter(only_relay)))
        }
        None => (None, None),
    };
    tracing_subscriber::registry().with(fmt.with_filter(filter)).with(spans).init();
    Ok(telemetry)
}

/// A panic anywhere, a background task's included, ends the process: a relay
/// without its heartbeat, monitor or settler must not run on half alive.
/// Nothing is lost: what was not settled is read again at the next start.
fn exit_on_panic() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        default(info);
        tracing::error!(panic = %info, "a task panicked: stopping the process (exit status 70); unsettled events are read again at the next start");
        std::process::exit(70);
    }));
}

/// glibc's malloc serves a freed block's size from its heap once it has
/// freed one (its mmap threshold grows with each large free, up to 32 MiB),
/// and its arenas keep what they served: bodies of tens of MiB took peak RSS
/// well past `max_unsettled_bytes + 2 × s3.max_body_bytes + 64 MiB` (180–388
/// MiB at a 64 MB budget), though the relay held no more than that at once.
/// A fixed threshold of 1 MiB maps every large body and unmaps it when freed.
/// glibc reads it from the environment before `main`, so the relay sets it
/// and executes itself again, once, unless it is set already (an operator's
/// own value wins). Allocations under 1 MiB are served as before.
const MMAP_THRESHOLD: (&str, &str) = ("MALLOC_MMAP_THRESHOLD_", "1048576");

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn bound_large_allocations() {
    use std::os::unix::process::CommandExt;
    let (name, value) = MMAP_THRESHOLD;
    if std::env::var_os(name).is_some() {
        return;
    }
    let Ok(exe) = std::env::current_exe() else { return };
    let mut args = std::env::args_os();
    let arg0 = args.next().unwrap_or_else(|| exe.clone().into_os_string());
    // `exec` returns only if it failed: run on with glibc's defaults.
    let e = std::process::Command::new(&exe).arg0(arg0).args(args).env(name, value).exec();
    eprintln!("outbox-relay: could not set {name} (running with glibc's defaults): {e}");
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn bound_large_allocations() {
    let _ = MMAP_THRESHOLD;
}

fn main() -> ExitCode {
    bound_large_allocations();
    // For the fault measurement: is this binary able to fail where told?
    if std::env::args().nth(1).as_deref() == Some("--built-with-failpoints") {
        return if outbox_relay::faults::ENABLED { ExitCode::SUCCESS } else { ExitCode::FAILURE };
    }
    let cli = Cli::parse();
    let (telemetry, runtime) = match set_up(&cli) {
        Ok(parts) => parts,
        Err(e) => {
            eprintln!("outbox-relay: {e}");
            return ExitCode::from(2);
        }
    };
    let result = runtime.block_on(run_command(cli));
    drop(runtime);
    if let Some(t) = telemetry {
        t.shutdown();
    }
    exit_code(result)
}

/// Logging (and the relay's spans), the panic hook, fail points and the
/// runtime, before any command runs.
fn set_up(cli: &Cli) -> Result<(Option<outbox_relay::telemetry::Telemetry>, tokio::runtime::Runtime), String> {
    let telemetry = init_logging(cli.log_format)?;
    exit_on_panic();
    outbox_relay::faults::configure_from_env()?;
    let runtime = match cli.worker_threads {
        1 => tokio::runtime::Builder::new_current_thread().enable_all().build(),
        0 => tokio::runtime::Builder::new_multi_thread().enable_all().build(),
        n => tokio::runtime::Builder::new_multi_thread().worker_threads(n).enable_all().build(),
    };
    let runtime = runtime.map_err(|e| format!("cannot start the runtime: {e}"))?;
    Ok((telemetry, runtime))
}

/// The command; `Ok(false)` when a signal interrupted it (`run` takes the
/// signal itself, to stop gracefully).
async fn run_command(cli: Cli) -> anyhow::Result<bool> {
    if matches!(cli.command, Command::Run { .. }) {
        return real_main(cli).await.map(|()| true);
    }
    tokio::select! {
        r = real_main(cli) => r.map(|()| true),
        _ = shutdown_signal() => Ok(false),
    }
}

fn exit_code(result: anyhow::Result<bool>) -> ExitCode {
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!("outbox-relay: interrupted");
            ExitCode::from(130)
        }
        Err(e) => {
            eprintln!("outbox-relay: {e:#}");
            ExitCode::from(2)
        }
    }
}

async fn real_main(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Migrate { database_url, dry_run } => {
            let target = outbox_pgconn::parse(&database_url).map_err(anyhow::Error::msg)?;
            let mut client = db::connect_target(&target, db::Deadlines::default().connect).await?;
            if dry_run {
                return print_pending(&client).await;
            }
            let applied = db::schema::migrate(&mut client).await?;
            if applied.is_empty() {
                println!("migrations: up to date");
            } else {
                println!("migrations: applied {applied:?}");
            }
            Ok(())
        }
        Command::Run { common, mode, metrics_addr, check } => {
            let mut o = overrides(&common);
            o.mode = mode;
            o.metrics_addr = metrics_addr;
            let config = Config::load(common.config.as_deref(), &o)?;
            if check {
                println!("{}", config.summary());
                return Ok(());
            }
            tracing::info!(?config, "starting");
            let publisher = AwsPublisher::with_role(
                &config.sqs_region,
                config.sqs_endpoint_url.as_deref(),
                config.sqs_assume_role_arn.as_deref(),
            )
            .await;
            outbox_relay::run(config, Arc::new(publisher), Metrics::new(), shutdown_signal()).await?;
            Ok(())
        }
        Command::Status { common, json } => {
            let (config, db, client) = connected(&common).await?;
            let read = async { anyhow::Ok(ops::status(&client, &config).await?) };
            let status = db.within_connecting("reading the status", read).await?;
            print_answer(json, &status, ops::format_status)
        }
        Command::Slot { action } => slot_command(action).await,
        Command::Dead { action } => dead_command(action).await,
        Command::Replay { action, args } => replay_command(action, *args).await,
    }
}

/// `slot status|create|drop`.
async fn slot_command(action: SlotAction) -> anyhow::Result<()> {
    match action {
        SlotAction::Status { common, json } => {
            let (config, db, client) = connected(&common).await?;
            let read = async { anyhow::Ok(ops::slot_status(&client, &config.slot).await?) };
            let s = db.within("reading the slot's status", read).await?;
            print_answer(json, &s, ops::format_slot)
        }
        SlotAction::Create { common, failover } => {
            let mut config = Config::load(common.config.as_deref(), &overrides(&common))?;
            config.failover |= failover;
            let c = ops::slot_create(&config).await?;
            println!(
                "slot {} created at {}; {} NEW rows written before it handed to the table path",
                c.slot, c.consistent_point, c.handed_to_table
            );
            Ok(())
        }
        SlotAction::Drop { common } => {
            let config = Config::load(common.config.as_deref(), &overrides(&common))?;
            ops::slot_drop(&config).await?;
            println!("slot {} dropped; NEW rows stay NEW and the next slot's catch-up publishes them", config.slot);
            Ok(())
        }
    }
}

/// `dead list|redrive`.
async fn dead_command(action: DeadAction) -> anyhow::Result<()> {
    match action {
        DeadAction::List { common, destination, table, limit, json } => {
            let filter = ops::DeadFilter { destination: destination.as_deref(), table: table.as_deref() };
            let (_, db, client) = connected(&common).await?;
            let read = async { anyhow::Ok(ops::dead_list(&client, filter, limit).await?) };
            let rows = db.within("listing DEAD rows", read).await?;
            print_answer(json, &rows, |r| ops::format_dead(r))
        }
        DeadAction::Redrive { common, destination, table, id, all } => {
            if destination.is_none() && table.is_none() && id.is_none() && !all {
                anyhow::bail!("say which DEAD rows to redrive: --destination D, --table T, --id N, or --all");
            }
            let (_, _, client) = connected(&common).await?;
            let n = ops::dead_redrive(
                &client,
                ops::DeadFilter { destination: destination.as_deref(), table: table.as_deref() },
                id,
            )
            .await?;
            println!("redrove {n} DEAD rows: they are NEW again and the relay sends them");
            Ok(())
        }
    }
}

/// `replay`, `replay list|resume|cancel`.
async fn replay_command(action: Option<ReplayAction>, args: ReplayArgs) -> anyhow::Result<()> {
    match action {
        None => {
            let (config, _, mut client) = connected(&args.common).await?;
            let mut selection = ops::replay::Selection {
                destination: args.destination,
                since: args.since,
                until: args.until,
                event_ids: args.event_ids,
                to: args.to,
                source: args.from.as_deref().and_then(ops::replay::Source::parse),
                table: args.table,
            };
            let planned = ops::replay::plan(&client, &config, &mut selection).await?;
            if args.dry_run {
                return print_answer(args.json, &planned, |p| ops::replay::format_plan(p));
            }
            let id = ops::replay::start(&client, &selection, &planned).await?;
            eprint!("{}", ops::replay::format_plan(&planned));
            eprintln!("replay {id} started (interrupted, `outbox-relay replay resume {id}` goes on)");
            copy_replay(&mut client, &config, id, args.rate, args.json).await
        }
        Some(ReplayAction::Resume { common, id, rate }) => {
            let (config, _, mut client) = connected(&common).await?;
            copy_replay(&mut client, &config, id, rate, false).await
        }
        Some(ReplayAction::Cancel { common, id }) => {
            let (_, _, client) = connected(&common).await?;
            let r = ops::replay::cancel(&client, id).await?;
            println!("{}; the copies written are sent, nothing more is copied", ops::replay::format_replay(&r));
            Ok(())
        }
        Some(ReplayAction::List { common, json }) => {
            let (_, _, client) = connected(&common).await?;
            let replays = ops::replay::list(&client, None).await?;
            print_answer(json, &replays, |r| ops::replay::format_replays(r))
        }
    }
}

/// Copy replay `id`'s rows, its progress on stderr at most once a second.
async fn copy_replay(
    client: &mut tokio_postgres::Client,
    config: &outbox_relay::Config,
    id: i64,
    rate: Option<u32>,
    json: bool,
) -> anyhow::Result<()> {
    let mut shown = std::time::Instant::now();
    let progress = |r: &ops::replay::Replay| {
        if shown.elapsed() >= std::time::Duration::from_secs(1) {
            eprintln!("replay {}: {}/{} events copied", r.id, r.copied, r.total);
            shown = std::time::Instant::now();
        }
    };
    let r = ops::replay::run(client, config, id, rate, progress, || false).await?;
    print_answer(json, &r, |r| format!("{}\n", ops::replay::format_replay(r)))
}

/// An operator command's configuration, its database and a connection to it.
async fn connected(common: &CommonArgs) -> anyhow::Result<(Config, Db, tokio_postgres::Client)> {
    let config = Config::load(common.config.as_deref(), &overrides(common))?;
    let db = Db::of(&config);
    let client = db.connect().await?;
    Ok((config, db, client))
}

/// `migrate --dry-run`: what would be applied, nothing applied.
async fn print_pending(client: &tokio_postgres::Client) -> anyhow::Result<()> {
    let pending = db::schema::pending(client).await?;
    if pending.is_empty() {
        println!("migrations: up to date; nothing would be applied");
    }
    for m in &pending {
        println!("-- migration {}: {} (not applied: --dry-run)\n{}\n", m.version, m.name, m.sql.trim_end());
    }
    Ok(())
}

/// An answer as JSON (`--json`) or as text.
fn print_answer<T: serde::Serialize>(json: bool, answer: &T, text: impl Fn(&T) -> String) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string_pretty(answer)?);
    } else {
        print!("{}", text(answer));
    }
    Ok(())
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
