//! What `pipe` and `consume` share: failures and exit codes, the client
//! configuration, the state folder pre-check, signals, and starting and
//! closing the Kafka clients off the async runtime.

use std::fmt::Display;
use std::io::Write;
use std::path::Path;
use std::time::Duration;

use rdkafka::ClientConfig;
use rdkafka::error::KafkaError;
use replayguard::Error;
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::watch;

use crate::cli::GuardArgs;

/// Exit status of a runtime failure.
pub const RUNTIME: u8 = 1;
/// Exit status of a usage error.
pub const USAGE: u8 = 2;

/// Why the command failed: the exit status and the one line to print.
#[derive(Debug)]
pub struct Failure {
    pub code: u8,
    pub message: String,
}

impl Failure {
    pub fn runtime(message: impl Display) -> Self {
        Failure {
            code: RUNTIME,
            message: message.to_string(),
        }
    }

    pub fn usage(message: impl Display) -> Self {
        Failure {
            code: USAGE,
            message: message.to_string(),
        }
    }

    /// A failure to start: a configuration the library refuses before it
    /// touches a broker or the state is a usage error; anything else is a
    /// runtime failure.
    pub fn starting(e: Error) -> Self {
        match e {
            Error::Config(_) => Failure::usage(e),
            e @ Error::JobMismatch { .. } => {
                let path = match &e {
                    Error::JobMismatch { path, .. } => path.display().to_string(),
                    _ => String::new(),
                };
                Failure::runtime(format!(
                    "{e} (--rebind hands the folder to this job; `replayguard reset --state {path} --yes` empties it)"
                ))
            }
            e => Failure::runtime(e),
        }
    }
}

impl From<Error> for Failure {
    fn from(e: Error) -> Self {
        Failure::runtime(e)
    }
}

/// Properties only a producer reads; the consumer does not get them.
fn producer_only(k: &str) -> bool {
    matches!(
        k,
        "linger.ms"
            | "acks"
            | "request.required.acks"
            | "enable.idempotence"
            | "message.timeout.ms"
            | "delivery.timeout.ms"
            | "request.timeout.ms"
            | "transactional.id"
            | "transaction.timeout.ms"
            | "compression.type"
            | "compression.codec"
            | "compression.level"
            | "partitioner"
            | "retries"
            | "message.send.max.retries"
            | "sticky.partitioning.linger.ms"
    ) || k.starts_with("queue.buffering.")
        || k.starts_with("batch.")
}

/// Properties only a consumer reads; the producer does not get them.
fn consumer_only(k: &str) -> bool {
    matches!(
        k,
        "session.timeout.ms"
            | "heartbeat.interval.ms"
            | "partition.assignment.strategy"
            | "auto.offset.reset"
            | "isolation.level"
            | "max.poll.interval.ms"
            | "enable.partition.eof"
            | "check.crcs"
            | "auto.commit.interval.ms"
            | "enable.auto.commit"
            | "enable.auto.offset.store"
    ) || k.starts_with("group.")
        || k.starts_with("fetch.")
        || k.starts_with("queued.")
        || k.starts_with("consume.")
}

/// The consumer configuration: every `-X` a consumer reads, then
/// `--brokers` and `--group`.
pub fn consumer_config(args: &GuardArgs) -> ClientConfig {
    let mut cfg = ClientConfig::new();
    for (k, v) in &args.properties {
        if !producer_only(k) {
            cfg.set(k, v);
        }
    }
    cfg.set("bootstrap.servers", &args.brokers);
    cfg.set("group.id", &args.group);
    cfg
}

/// The producer configuration: `--brokers` and every `-X` a producer
/// reads (librdkafka would warn about the others).
pub fn producer_config(args: &GuardArgs) -> ClientConfig {
    let mut cfg = ClientConfig::new();
    for (k, v) in &args.properties {
        if !consumer_only(k) {
            cfg.set(k, v);
        }
    }
    cfg.set("bootstrap.servers", &args.brokers);
    cfg
}

/// Checks every `-X` with librdkafka without creating a client, so that a
/// misspelt property is a usage error before anything is touched.
pub fn check_properties(args: &GuardArgs) -> Result<(), Failure> {
    for (k, v) in &args.properties {
        let mut one = ClientConfig::new();
        one.set(k, v);
        if let Err(e) = one.create_native_config() {
            let why = match e {
                KafkaError::ClientConfig(_, desc, _, _) => desc,
                e => e.to_string(),
            };
            return Err(Failure::usage(format!(
                "-X {k}={v} is refused by librdkafka: {why}"
            )));
        }
    }
    Ok(())
}

const MARKER: &str = replayguard::store::MARKER_FILE;

/// Refuses a `--state` that the guard would refuse, before any broker is
/// contacted, and a path whose parent is missing (most likely a typo, which
/// would otherwise start from empty state and repeat everything).
pub fn check_state_for_run(path: &Path) -> Result<(), Failure> {
    match std::fs::metadata(path) {
        Ok(m) if !m.is_dir() => Err(Failure::runtime(format!(
            "--state {} is a file, not a folder; point --state at a folder",
            path.display()
        ))),
        Ok(_) => {
            let new = replayguard::store::is_new_folder(path).map_err(|e| {
                Failure::runtime(format!("cannot read --state {}: {e}", path.display()))
            })?;
            if path.join(MARKER).is_file() || new {
                Ok(())
            } else {
                Err(Failure::runtime(Error::ForeignState {
                    path: path.to_owned(),
                }))
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let parent = match path.parent() {
                Some(p) if !p.as_os_str().is_empty() => p,
                _ => Path::new("."),
            };
            if parent.is_dir() {
                Ok(())
            } else {
                Err(Failure::runtime(format!(
                    "the parent folder of --state {} does not exist; create it, or fix the path \
                     (only the state folder itself is created)",
                    path.display()
                )))
            }
        }
        Err(source) => Err(Failure::runtime(Error::Open {
            path: path.to_owned(),
            source,
        })),
    }
}

/// Refuses a `--state` that is not an existing replayguard state folder,
/// without creating or changing anything.
pub fn check_state_exists(path: &Path) -> Result<(), Failure> {
    match std::fs::metadata(path) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => {
            return Err(Failure::runtime(format!(
                "--state {} is a file, not a replayguard state folder; check the path",
                path.display()
            )));
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(Failure::runtime(format!(
                "state folder {} does not exist; check --state",
                path.display()
            )));
        }
        Err(source) => {
            return Err(Failure::runtime(Error::Open {
                path: path.to_owned(),
                source,
            }));
        }
    }
    if path.join(MARKER).is_file() {
        Ok(())
    } else {
        Err(Failure::runtime(format!(
            "{} is not a replayguard state folder (it has no {MARKER} marker); check --state",
            path.display()
        )))
    }
}

/// SIGINT and SIGTERM. The first asks for a stop (finish the record at
/// hand, checkpoint, exit 0); a second exits at once with status 1, without
/// a checkpoint, which is as safe as a crash.
#[derive(Clone)]
pub struct Stop {
    rx: watch::Receiver<bool>,
}

impl Stop {
    /// Installs the handlers.
    pub fn install() -> Result<Stop, Failure> {
        let handler =
            |e: std::io::Error| Failure::runtime(format!("cannot install a signal handler: {e}"));
        let mut term = signal(SignalKind::terminate()).map_err(handler)?;
        let mut int = signal(SignalKind::interrupt()).map_err(handler)?;
        let (tx, rx) = watch::channel(false);
        tokio::spawn(async move {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
            tracing::info!("stop requested; finishing with a checkpoint");
            let _ = tx.send(true);
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
            crate::progress::clear_line();
            let _ = writeln!(
                std::io::stderr(),
                "replayguard: error: stopped by a second signal before the final checkpoint; \
                 the next run resumes from the last checkpoint"
            );
            std::process::exit(i32::from(RUNTIME));
        });
        Ok(Stop { rx })
    }

    /// Completes when a stop was asked for.
    pub fn wait(&self) -> impl Future<Output = ()> + Send + 'static {
        let mut rx = self.rx.clone();
        async move {
            if rx.wait_for(|stop| *stop).await.is_err() {
                // The handler task is gone: no stop will ever come.
                std::future::pending::<()>().await;
            }
        }
    }
}

/// Runs `build` (which blocks: broker probes, opening the state) on a
/// blocking thread. `None` when a stop was asked for first.
pub async fn start<T, F>(build: F, stop: &Stop) -> Result<Option<T>, Failure>
where
    T: Send + 'static,
    F: FnOnce() -> replayguard::Result<T> + Send + 'static,
{
    let task = tokio::task::spawn_blocking(build);
    tokio::select! {
        joined = task => match joined {
            Ok(built) => built.map(Some).map_err(Failure::starting),
            Err(e) => Err(Failure::runtime(format!("start-up failed: {e}"))),
        },
        () = stop.wait() => Ok(None),
    }
}

/// Drops the Kafka clients and the state on a thread of their own, waiting
/// at most `limit`: closing a consumer can block for seconds. Everything
/// that matters is already checkpointed, so an exit before it finishes is
/// as safe as a crash.
pub fn close<T: Send + 'static>(what: T, limit: Duration) {
    let (tx, rx) = std::sync::mpsc::channel();
    let spawned = std::thread::Builder::new()
        .name("replayguard-close".into())
        .spawn(move || {
            drop(what);
            let _ = tx.send(());
        });
    match spawned {
        Ok(_) => {
            if rx.recv_timeout(limit).is_err() {
                tracing::warn!(
                    seconds = limit.as_secs(),
                    "closing the Kafka clients is slow; exiting without waiting"
                );
            }
        }
        Err(e) => tracing::warn!(error = %e, "cannot start a thread to close the clients"),
    }
}
