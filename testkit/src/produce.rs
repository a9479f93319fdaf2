//! Producing test input, and asking for end offsets.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use rdkafka::ClientConfig;
use rdkafka::ClientContext;
use rdkafka::message::{DeliveryResult, Header, OwnedHeaders};
use rdkafka::producer::{BaseProducer, BaseRecord, Producer, ProducerContext};
use rdkafka::util::Timeout;

use crate::TestResult;

/// A record to produce.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NewRecord {
    /// The key, if any.
    pub key: Option<Vec<u8>>,
    /// The value, if any.
    pub value: Option<Vec<u8>>,
    /// Headers in order; a `None` value is a null header value.
    pub headers: Vec<(String, Option<Vec<u8>>)>,
    /// A fixed partition, or `None` for the partitioner (by key).
    pub partition: Option<i32>,
    /// A create time in ms since the Unix epoch, or `None` for the time it
    /// is sent.
    pub timestamp: Option<i64>,
}

struct Acks {
    acked: AtomicU64,
    failures: Mutex<Vec<String>>,
}

impl ClientContext for Acks {}

impl ProducerContext for Acks {
    type DeliveryOpaque = ();

    fn delivery(&self, result: &DeliveryResult<'_>, _opaque: ()) {
        match result {
            Ok(_) => {
                self.acked.fetch_add(1, Ordering::Relaxed);
            }
            Err((e, _)) => {
                if let Ok(mut failures) = self.failures.lock() {
                    failures.push(e.to_string());
                }
            }
        }
    }
}

/// A long-lived idempotent producer (`enable.idempotence=true`,
/// `acks=all`) that counts acks, for tests that produce steadily.
pub struct TestProducer {
    producer: BaseProducer<Acks>,
    topic: String,
    sent: u64,
}

impl TestProducer {
    /// A producer writing to `topic`.
    ///
    /// # Errors
    /// When librdkafka refuses the configuration.
    pub fn new(bootstrap: &str, topic: &str) -> TestResult<Self> {
        let producer = ClientConfig::new()
            .set("bootstrap.servers", bootstrap)
            .set("enable.idempotence", "true")
            .set("acks", "all")
            .set("linger.ms", "5")
            // Long enough to outlive a broker killed and restarted by a test.
            .set("message.timeout.ms", "180000")
            .create_with_context(Acks {
                acked: AtomicU64::new(0),
                failures: Mutex::new(Vec::new()),
            })?;
        Ok(Self {
            producer,
            topic: topic.to_owned(),
            sent: 0,
        })
    }

    /// Queues one record; waits (at most 60 s) while the queue is full.
    ///
    /// # Errors
    /// When the queue stays full or librdkafka refuses the record.
    pub fn send(&mut self, record: &NewRecord) -> TestResult {
        let mut headers = OwnedHeaders::new();
        for (key, value) in &record.headers {
            headers = headers.insert(Header {
                key: key.as_str(),
                value: value.as_ref(),
            });
        }
        let mut base = BaseRecord::<[u8], [u8]>::to(&self.topic).headers(headers);
        if let Some(key) = &record.key {
            base = base.key(key.as_slice());
        }
        if let Some(value) = &record.value {
            base = base.payload(value.as_slice());
        }
        if let Some(partition) = record.partition {
            base = base.partition(partition);
        }
        if let Some(timestamp) = record.timestamp {
            base = base.timestamp(timestamp);
        }
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            match self.producer.send(base) {
                Ok(()) => break,
                Err((e, returned)) => {
                    if Instant::now() >= deadline {
                        return Err(format!("produce to {}: {e}", self.topic).into());
                    }
                    base = returned;
                    self.producer.poll(Duration::from_millis(50));
                }
            }
        }
        self.sent += 1;
        self.producer.poll(Duration::ZERO);
        Ok(())
    }

    /// Queues one integer, key and value its decimal text.
    ///
    /// # Errors
    /// As [`TestProducer::send`].
    pub fn send_integer(&mut self, n: u64) -> TestResult {
        self.send(&NewRecord {
            key: Some(n.to_string().into_bytes()),
            value: Some(n.to_string().into_bytes()),
            ..NewRecord::default()
        })
    }

    /// Waits (at most `limit`) until every queued record is acked, and
    /// returns how many records were acked in all.
    ///
    /// # Errors
    /// When a record failed or is not acked in time.
    pub fn flush(&mut self, limit: Duration) -> TestResult<u64> {
        self.producer
            .flush(Timeout::After(limit))
            .map_err(|e| format!("produce to {}: not every record was acked: {e}", self.topic))?;
        let context = self.producer.context();
        let failures = context
            .failures
            .lock()
            .map_err(|_| "delivery failure list poisoned")?;
        if let Some(first) = failures.first() {
            return Err(format!(
                "produce to {}: {} of {} records failed, first: {first}",
                self.topic,
                failures.len(),
                self.sent
            )
            .into());
        }
        let acked = context.acked.load(Ordering::Relaxed);
        if acked != self.sent {
            return Err(format!(
                "produce to {}: {acked} of {} records acked",
                self.topic, self.sent
            )
            .into());
        }
        Ok(acked)
    }

    /// How many records were acked so far.
    pub fn acked(&self) -> u64 {
        self.producer.context().acked.load(Ordering::Relaxed)
    }
}

/// Produces `records` to `topic` with a fresh [`TestProducer`] and waits
/// for every ack, for at most 60 s. Returns how many were acked.
///
/// # Errors
/// When any record is not acked.
pub fn produce(
    bootstrap: &str,
    topic: &str,
    records: impl IntoIterator<Item = NewRecord>,
) -> TestResult<u64> {
    let mut producer = TestProducer::new(bootstrap, topic)?;
    let deadline = Instant::now() + Duration::from_secs(60);
    for record in records {
        producer.send(&record)?;
    }
    let left = deadline.saturating_duration_since(Instant::now());
    producer.flush(left.max(Duration::from_secs(1)))
}

/// Produces each integer as a record whose key and value are its decimal
/// text, so keyed partitioning spreads them over partitions.
///
/// # Errors
/// As [`produce`].
pub fn produce_integers(
    bootstrap: &str,
    topic: &str,
    values: impl IntoIterator<Item = u64>,
) -> TestResult<u64> {
    let mut producer = TestProducer::new(bootstrap, topic)?;
    let deadline = Instant::now() + Duration::from_secs(60);
    for n in values {
        producer.send_integer(n)?;
    }
    let left = deadline.saturating_duration_since(Instant::now());
    producer.flush(left.max(Duration::from_secs(1)))
}

/// The end offset (high watermark) of each partition of `topic`, asked
/// with a metadata-only rdkafka client (10 s per request).
///
/// # Errors
/// When the topic is unknown or the broker does not answer.
pub fn end_offsets(bootstrap: &str, topic: &str) -> TestResult<BTreeMap<i32, i64>> {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    let client: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("allow.auto.create.topics", "false")
        .create()?;
    let limit = Duration::from_secs(10);
    let metadata = client.fetch_metadata(Some(topic), limit)?;
    let partitions = metadata
        .topics()
        .iter()
        .find(|t| t.name() == topic && t.error().is_none())
        .map(|t| t.partitions().len() as i32)
        .ok_or_else(|| format!("end_offsets: topic {topic} is unknown"))?;
    let mut ends = BTreeMap::new();
    for p in 0..partitions {
        let (_, high) = client.fetch_watermarks(topic, p, limit)?;
        ends.insert(p, high);
    }
    Ok(ends)
}

/// How [`write_with`] writes: which independent client, which codec, and
/// any extra client properties (librdkafka names, for confluent-kafka).
#[derive(Debug, Clone, Default)]
pub struct WriteOptions {
    /// confluent-kafka (default) or kafka-python.
    pub client: crate::PyClient,
    /// `none` (default when empty), `gzip`, `snappy`, `lz4` or `zstd`.
    pub compression: String,
    /// Client properties, `(key, value)`.
    pub properties: Vec<(String, String)>,
    /// With confluent-kafka: write in Kafka transactions of this many
    /// records, committed (0, the default: no transactions).
    pub transactions: u64,
    /// With `transactions`: follow each committed transaction with an
    /// aborted one of as many records, their values 1,000,000,000 more.
    pub aborted: bool,
}

/// Writes the integers `first..first + count` into `topic` with a client
/// that is not ours (`scripts/kafka_write.py`): key and value are the
/// decimal text. Waits for every ack.
///
/// # Errors
/// When the client fails or takes more than two minutes.
pub fn write_with(
    bootstrap: &str,
    topic: &str,
    first: u64,
    count: u64,
    options: &WriteOptions,
) -> TestResult {
    let mut command = std::process::Command::new(crate::python()?);
    command
        .arg(crate::repo_root().join("scripts/kafka_write.py"))
        .args(["--brokers", bootstrap, "--topic", topic])
        .args(["--client", options.client.arg()])
        .arg("--compression")
        .arg(if options.compression.is_empty() {
            "none"
        } else {
            &options.compression
        })
        .arg("--first")
        .arg(first.to_string())
        .arg("--count")
        .arg(count.to_string());
    for (k, v) in &options.properties {
        command.arg("--property").arg(format!("{k}={v}"));
    }
    if options.transactions > 0 {
        command
            .arg("--transactions")
            .arg(options.transactions.to_string());
    }
    if options.aborted {
        command.arg("--aborted");
    }
    let out = crate::run_bounded(&mut command, Duration::from_secs(120))?;
    if !out.status.success() {
        return Err(format!(
            "kafka_write.py failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )
        .into());
    }
    Ok(())
}
