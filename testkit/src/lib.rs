//! replayguard's test kit: one home for what its tests, benches and
//! examples need around a broker. Not part of the library, never published.
//!
//! Every broker a test starts is its own: a fresh process (or thread) on
//! free `127.0.0.1` ports, stopped when its handle is dropped, so tests
//! need no global broker and can run in parallel.
//!
//! - [`KafkaBroker`]: Apache Kafka 4, one KRaft node, in its own JVM. The
//!   broker of truth: crash tests, transactions, restarts. Its jars come
//!   from `scripts/kafka/fetch` (which `scripts/test` runs).
//! - [`MockBroker`]: librdkafka's mock cluster in its own process (the
//!   `replayguard-mock-broker` binary); it outlives any client a test
//!   kills. [`InProcessBroker`]: the same mock on a thread of this process,
//!   for fast tests and the benches.
//! - [`TansuBroker`]: Tansu with sqlite storage, for interoperability.
//! - [`TestProducer`], [`produce`] and [`produce_integers`]: an idempotent
//!   producer that counts and waits for acks.
//! - [`read_topic`], [`read_topic_with`] and [`committed_offsets`]: read
//!   back through `scripts/kafka_read.py` with confluent-kafka or
//!   kafka-python, clients that share no code with ours; and
//!   [`KafkaBroker::console_read`], Kafka's own console consumer.
//! - [`integers`], [`check_each_once`], [`check_increasing`] and
//!   [`dups_and_missing`]: exactly-once checks.
//! - [`process`]: bounded runs, waits and drops, and signals.
//! - [`run`]: runs of the command under test ([`Proc`], killed with
//!   SIGKILL and reaped), a steady [`Feeder`] of integers, end offsets
//!   watched meanwhile ([`Ends`]), and seeded plans ([`seeded`]).
//!
//! Every call that waits has a bound and fails with a message when it runs
//! out; nothing here waits forever.

#![deny(clippy::unwrap_used, clippy::expect_used)]

pub mod check;
pub mod kafka;
pub mod mock;
pub mod process;
pub mod produce;
pub mod proxy;
pub mod read;
pub mod run;
pub mod tansu;

use std::net::{Ipv4Addr, TcpListener};
use std::path::Path;
use std::time::Duration;

pub use check::{base64_decode, check_each_once, check_increasing, dups_and_missing, integers};
pub use kafka::{KafkaBroker, KafkaOptions};
pub use mock::{InProcessBroker, MockBroker};
pub use process::{
    Frozen, drop_bounded, lines_of, process_alive, run_bounded, send_signal, wait_bounded,
};
pub use produce::{
    NewRecord, TestProducer, WriteOptions, end_offsets, produce, produce_integers, write_with,
};
pub use proxy::Proxy;
pub use read::{
    PyClient, ReadOptions, ReadRecord, Record, Until, committed_offsets, produce_values, python,
    read_all, read_topic, read_topic_with,
};
pub use run::{
    Ends, FEED_CAP, FIRST_OUTPUT_LIMIT, Feeder, Proc, clone_command, error_line,
    first_failure_fenced, outcome, replayguard_bin, run_restarted, seeded, sleep_watching,
    stopped_fenced,
};
pub use tansu::TansuBroker;

/// The error type of every helper and test: anything, with a message.
pub type Error = Box<dyn std::error::Error + Send + Sync>;

/// `Result` for tests and helpers.
pub type TestResult<T = ()> = Result<T, Error>;

/// How long a broker may take to start and answer.
pub(crate) const START_LIMIT: Duration = Duration::from_secs(60);

/// How long one admin command (a topic creation) may take.
pub(crate) const COMMAND_LIMIT: Duration = Duration::from_secs(60);

/// The repository root (where the main `Cargo.toml` and `scripts/` are).
pub fn repo_root() -> &'static Path {
    let kit = Path::new(env!("CARGO_MANIFEST_DIR"));
    kit.parent().unwrap_or(kit)
}

/// A TCP port on 127.0.0.1 that was free a moment ago.
///
/// # Errors
/// When no port can be bound.
pub fn free_port() -> TestResult<u16> {
    Ok(free_ports::<1>()?[0])
}

/// `N` different ports free on 127.0.0.1 when picked: all are held open
/// until the last is picked, so that the system cannot hand out one twice
/// (as picking them one by one can).
///
/// # Errors
/// When the system has no port to give.
pub fn free_ports<const N: usize>() -> TestResult<[u16; N]> {
    let mut held = Vec::with_capacity(N);
    let mut ports = [0; N];
    for port in &mut ports {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
        *port = listener.local_addr()?.port();
        held.push(listener);
    }
    Ok(ports)
}

/// A bootstrap address's client configuration, the base of every client
/// the kit makes.
pub fn client_config(bootstrap: &str) -> rdkafka::ClientConfig {
    let mut c = rdkafka::ClientConfig::new();
    c.set("bootstrap.servers", bootstrap);
    c
}

/// What a test needs of a running broker, whichever it is.
pub trait Broker {
    /// The bootstrap list.
    fn servers(&self) -> String;
    /// The broker process's pid, when it runs in a process of its own.
    fn broker_pid(&self) -> Option<u32>;
    /// A short name for messages: `mock`, `kafka`, `tansu`.
    fn kind(&self) -> &'static str;
    /// Whether it drops a batch that an idempotent producer sends again
    /// (Kafka does, by sequence). One that does not appends it twice, and
    /// an exactly-once check there must tell such copies from second
    /// writes (they keep their original's create time).
    fn drops_resent_batches(&self) -> bool {
        true
    }
}

impl Broker for MockBroker {
    fn servers(&self) -> String {
        self.bootstrap().to_owned()
    }
    fn broker_pid(&self) -> Option<u32> {
        Some(self.pid())
    }
    fn kind(&self) -> &'static str {
        "mock"
    }
    /// librdkafka's mock checks sequences only for transactional
    /// producers (`rd_kafka_mock_validate_records`).
    fn drops_resent_batches(&self) -> bool {
        false
    }
}

impl Broker for KafkaBroker {
    fn servers(&self) -> String {
        self.bootstrap()
    }
    fn broker_pid(&self) -> Option<u32> {
        self.pid()
    }
    fn kind(&self) -> &'static str {
        "kafka"
    }
}

impl Broker for TansuBroker {
    fn servers(&self) -> String {
        self.bootstrap()
    }
    fn broker_pid(&self) -> Option<u32> {
        self.pid()
    }
    fn kind(&self) -> &'static str {
        "tansu"
    }
}
