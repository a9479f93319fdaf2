//! The brokers the benchmarks run on, from the test kit: librdkafka's mock
//! cluster in this process or in a `replayguard-mock-broker` process of its
//! own, and Apache Kafka (one KRaft node on loopback, its jars from
//! `$KAFKA_LIBS` or the test rig's cache).

use replayguard_testkit::{Broker as _, InProcessBroker, KafkaBroker, MockBroker};
use serde::Serialize;

use crate::BenchResult;

/// Where the broker runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum BrokerKind {
    /// `rdkafka::mocking::MockCluster` in the benchmark process.
    InProcess,
    /// The same mock cluster in a `replayguard-mock-broker` process.
    Process,
    /// Apache Kafka 4, one combined broker and controller.
    Kafka,
}

impl BrokerKind {
    /// The label used in tables and charts.
    pub fn label(self) -> &'static str {
        match self {
            BrokerKind::InProcess => "mock, in-process",
            BrokerKind::Process => "mock, own process",
            BrokerKind::Kafka => "Apache Kafka",
        }
    }

    /// The kind named `name` (`in-process`, `process`, `kafka`).
    pub fn named(name: &str) -> Option<BrokerKind> {
        match name {
            "in-process" => Some(BrokerKind::InProcess),
            "process" => Some(BrokerKind::Process),
            "kafka" => Some(BrokerKind::Kafka),
            _ => None,
        }
    }
}

enum Host {
    InProcess(InProcessBroker),
    Process(MockBroker),
    Kafka(KafkaBroker),
}

/// A one-broker cluster with its topics, stopped when dropped.
pub struct Broker {
    bootstrap: String,
    _host: Host,
}

impl Broker {
    /// Starts a broker of `kind` with `topics` as `(name, partitions)`.
    pub fn start(kind: BrokerKind, topics: &[(&str, i32)]) -> BenchResult<Self> {
        let host = match kind {
            BrokerKind::InProcess => Host::InProcess(InProcessBroker::start(topics)?),
            BrokerKind::Process => Host::Process(MockBroker::start(topics)?),
            BrokerKind::Kafka => Host::Kafka(KafkaBroker::start(topics)?),
        };
        let bootstrap = match &host {
            Host::InProcess(b) => b.bootstrap().to_owned(),
            Host::Process(b) => b.servers(),
            Host::Kafka(b) => b.servers(),
        };
        Ok(Broker {
            bootstrap,
            _host: host,
        })
    }

    /// The bootstrap list.
    pub fn bootstrap(&self) -> &str {
        &self.bootstrap
    }
}
