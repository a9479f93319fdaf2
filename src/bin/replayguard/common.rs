//! What `pipe` and `consume` share: failures and exit codes, the client
//! configuration, the state folder pre-check, signals, and starting and
//! closing the Kafka clients off the async runtime.

use std::fmt::Display;
use std::io::IsTerminal;
use std::io::Write;
use std::path::Path;

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
/// Exit status of a stop because the instance may no longer own its
/// partitions (a lapsed lease, a lost group session): `EX_TEMPFAIL`, for a
/// supervisor to start it again.
pub const FENCED: u8 = 75;

/// Why the command failed: the exit status, the one line to print, and
/// the kind of failure for JSON logs (the library's [`Error::kind`],
/// `usage`, or `runtime` for the command's own).
#[derive(Debug)]
pub struct Failure {
    pub code: u8,
    pub message: String,
    pub kind: &'static str,
}

impl Failure {
    pub fn runtime(message: impl Display) -> Self {
        Failure {
            code: RUNTIME,
            message: message.to_string(),
            kind: "runtime",
        }
    }

    pub fn usage(message: impl Display) -> Self {
        Failure {
            code: USAGE,
            message: message.to_string(),
            kind: "usage",
        }
    }

    /// The same failure, of the library's kind `kind`.
    fn of_kind(mut self, kind: &'static str) -> Self {
        self.kind = kind;
        self
    }

    /// A failure to start: a configuration the library refuses before it
    /// touches a broker or the state is a usage error; anything else is a
    /// runtime failure.
    pub fn starting(e: Error) -> Self {
        let kind = e.kind();
        let failure = match e {
            Error::Config(msg) => Failure::usage(in_flag_terms(&msg)),
            Error::Unreachable {
                brokers,
                attempts,
                last,
            } => Failure::runtime(format!(
                "no broker reachable at {brokers} after {attempts} attempts ({last}); check --brokers and that the broker is up"
            )),
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
        };
        if failure.code == USAGE {
            failure
        } else {
            failure.of_kind(kind)
        }
    }
}

/// A library refusal of an option, said in terms of the flag that set it.
fn in_flag_terms(msg: &str) -> String {
    const FLAGS: [(&str, &str); 5] = [
        ("changelog ", "--changelog: the changelog "),
        (
            "checkpoint_interval ",
            "--checkpoint-interval: the checkpoint interval ",
        ),
        (
            "connect_attempts ",
            "--connect-attempts: the connect attempts ",
        ),
        ("lease ", "--lease: the lease "),
        (
            "delivery_timeout ",
            "--delivery-timeout: the delivery timeout ",
        ),
    ];
    FLAGS
        .iter()
        .find_map(|(name, flag)| msg.strip_prefix(name).map(|rest| format!("{flag}{rest}")))
        .unwrap_or_else(|| msg.to_owned())
}

impl From<Error> for Failure {
    fn from(e: Error) -> Self {
        let kind = e.kind();
        let fenced = e.is_fenced();
        let mut failure = Failure::runtime(e).of_kind(kind);
        if fenced {
            failure.code = FENCED;
        }
        failure
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

/// librdkafka's statistics interval when someone looks at the lag (the
/// metrics endpoint, or the progress line on a terminal) and `-X` sets
/// none: the lag comes from them. Off otherwise, as librdkafka has it: a
/// run nobody watches gains nothing from a statistics callback a second.
const STATISTICS_INTERVAL_MS: &str = "1000";

/// The consumer configuration: every `-X` a consumer reads, then
/// `--brokers` and `--group`.
pub fn consumer_config(args: &GuardArgs) -> ClientConfig {
    let mut cfg = ClientConfig::new();
    if args.metrics_addr.is_some() || std::io::stderr().is_terminal() {
        cfg.set("statistics.interval.ms", STATISTICS_INTERVAL_MS);
    }
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

/// Refuses a `--state` that the guard would refuse, before any broker is
/// contacted; see [`replayguard::check_state_folder`].
pub fn check_state(path: &Path, purpose: replayguard::FolderUse) -> Result<(), Failure> {
    replayguard::check_state_folder(path, purpose).map_err(|e| match e {
        Error::StateFolder { path, what } => {
            Failure::runtime(format!("--state {}: {what}", path.display()))
        }
        Error::ForeignState { path } => Failure::runtime(format!(
            "{} is not a replayguard state folder (it is not empty and has no REPLAYGUARD marker); refusing to touch it: point --state at an empty or new folder",
            path.display()
        )),
        e => Failure::runtime(e),
    })
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

/// Awaits `build` (the adapters' async open). `None` when a stop was
/// asked for first.
pub async fn start<T>(
    build: impl Future<Output = replayguard::Result<T>>,
    stop: &Stop,
) -> Result<Option<T>, Failure> {
    tokio::select! {
        built = build => built.map(Some).map_err(Failure::starting),
        () = stop.wait() => Ok(None),
    }
}

/// Awaits an adapter's bounded close; a close that runs out of time is
/// logged, not a failure: everything that matters is checkpointed, so an
/// exit before it finishes is as safe as a crash.
pub async fn close(closing: impl Future<Output = replayguard::Result<()>>) {
    if let Err(e) = closing.await {
        tracing::warn!(error = %e, "closing the Kafka clients");
    }
}
