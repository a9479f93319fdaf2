//! The `replayguard` command: a dedup bridge between two topics (`pipe`), a
//! guarded reader (`consume`) and a state viewer (`inspect`), for users who
//! want the guarantees without writing Rust.
//!
//! Errors are one line on stderr, `replayguard: error: ...`, with exit
//! status 1 for a runtime failure, 2 for a usage error (clap's own, or a
//! configuration the library refuses before touching a broker) and 75 for
//! a stop because the instance may no longer own its partitions (its lease
//! lapsed or its group session timed out; start it again).

#![deny(clippy::unwrap_used, clippy::expect_used)]

mod cli;
mod common;
mod consume;
mod endpoint;
mod format;
mod inspect;
mod pipe;
mod progress;
mod reset;

use std::io::{IsTerminal, Write};
use std::process::ExitCode;

use clap::Parser;
use tracing_subscriber::EnvFilter;

use crate::cli::{Cli, Command, LogFormat};
use crate::common::Failure;

/// Our own warnings and errors. rdkafka's log (which repeats every
/// connection failure, and reports each partition end as an error) and the
/// storage engine's (which logs a damaged journal at ERROR before it
/// returns the error that the library reports as a corrupt state folder)
/// only on request: the library turns the failures that matter into its
/// errors.
const DEFAULT_LOG: &str = "warn,rdkafka=off,librdkafka=off,fjall=off,lsm_tree=off";

fn main() -> ExitCode {
    // Usage errors exit 2 here, `--help` and `--version` exit 0.
    let cli = Cli::parse();
    let format = cli.command.log_format();
    init_logging(format);
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            return report(
                &Failure::runtime(format!("cannot start the runtime: {e}")),
                format,
            );
        }
    };
    let result = runtime.block_on(run(cli));
    // A start-up interrupted by a signal can leave a blocking broker probe
    // behind; exit without waiting for it.
    runtime.shutdown_background();
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(failure) => report(&failure, format),
    }
}

async fn run(cli: Cli) -> Result<(), Failure> {
    match cli.command {
        Command::Pipe(args) => pipe::run(args).await,
        Command::Consume(args) => consume::run(args).await,
        Command::Inspect(args) => inspect::run(&args),
        Command::Reset(args) => reset::run(&args),
    }
}

/// The final error line with `--log-format json`, its fields in the order
/// of the log lines before it.
#[derive(serde::Serialize)]
struct ErrorLine<'a> {
    timestamp: String,
    level: &'static str,
    message: &'a str,
    error_kind: &'static str,
    exit_status: u8,
    target: &'static str,
}

/// Prints the one error line and returns the exit status. With JSON logs
/// the line is a JSON object like the log lines before it.
fn report(failure: &Failure, format: LogFormat) -> ExitCode {
    progress::clear_line();
    let message = failure.message.replace(['\n', '\r'], " ");
    let line = match format {
        LogFormat::Text => format!("replayguard: error: {message}"),
        LogFormat::Json => serde_json::to_string(&ErrorLine {
            timestamp: humantime::format_rfc3339_micros(std::time::SystemTime::now()).to_string(),
            level: "ERROR",
            message: &message,
            error_kind: failure.kind,
            exit_status: failure.code,
            target: "replayguard",
        })
        .unwrap_or_else(|_| format!("replayguard: error: {message}")),
    };
    // Nothing more can be done when stderr itself is closed.
    let _ = writeln!(std::io::stderr(), "{line}");
    ExitCode::from(failure.code)
}

fn init_logging(format: LogFormat) {
    let filter = match std::env::var("RUST_LOG") {
        Ok(spec) => EnvFilter::try_new(&spec).unwrap_or_else(|e| {
            let _ = writeln!(
                std::io::stderr(),
                "replayguard: warning: RUST_LOG={spec:?} is not a valid filter ({e}); using `{DEFAULT_LOG}`"
            );
            EnvFilter::new(DEFAULT_LOG)
        }),
        Err(_) => EnvFilter::new(DEFAULT_LOG),
    };
    // Fails only when a subscriber is already installed, which is fine.
    let _ = match format {
        LogFormat::Text => tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_ansi(std::io::stderr().is_terminal())
            .with_writer(progress::LogWriter)
            .try_init(),
        // One object a line; the event's fields (topic, partition, epoch,
        // error_kind, ...) at the top level beside message and level.
        LogFormat::Json => tracing_subscriber::fmt()
            .json()
            .flatten_event(true)
            .with_current_span(true)
            .with_span_list(false)
            .with_env_filter(filter)
            .with_writer(progress::LogWriter)
            .try_init(),
    };
}
