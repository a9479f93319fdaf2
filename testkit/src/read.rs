//! Reading a topic back with clients that are not ours: confluent-kafka
//! and kafka-python through `scripts/kafka_read.py`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use serde::Deserialize;

use crate::check::base64_decode;
use crate::process::run_bounded;
use crate::{TestResult, repo_root};

/// The python with confluent-kafka and kafka-python: `$REPLAYGUARD_PYTHON`,
/// else `.venv/bin/python` in the repository.
///
/// # Errors
/// When neither exists; the message says how to make it.
pub fn python() -> TestResult<PathBuf> {
    if let Some(python) = std::env::var_os("REPLAYGUARD_PYTHON") {
        return Ok(PathBuf::from(python));
    }
    let venv = repo_root().join(".venv/bin/python");
    if venv.is_file() {
        return Ok(venv);
    }
    Err(
        "no python with the Kafka clients: run scripts/test (it makes .venv), or \
         `python3 -m venv .venv && .venv/bin/pip install confluent-kafka kafka-python`, \
         or set REPLAYGUARD_PYTHON"
            .into(),
    )
}

/// An independent Kafka client in `scripts/kafka_read.py`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PyClient {
    /// confluent-kafka (its own librdkafka build); works with both brokers.
    #[default]
    Confluent,
    /// kafka-python (pure Python); works with Tansu, not with the mock.
    KafkaPython,
}

impl PyClient {
    /// Both clients, for tests that check with each.
    pub const BOTH: [PyClient; 2] = [PyClient::Confluent, PyClient::KafkaPython];

    pub(crate) fn arg(self) -> &'static str {
        match self {
            PyClient::Confluent => "confluent",
            PyClient::KafkaPython => "kafka-python",
        }
    }
}

/// How far [`read_topic_with`] reads.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Until {
    /// To each partition's end offset as it was when the read started.
    End,
    /// Until no record arrived for this long.
    Idle(Duration),
}

/// Options of [`read_topic_with`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ReadOptions {
    /// Which client reads. Default confluent-kafka.
    pub client: PyClient,
    /// `isolation.level` read_committed; default false (read_uncommitted).
    pub read_committed: bool,
    /// Where to stop. Default [`Until::End`].
    pub until: Until,
    /// Give up (and fail) after this long. Default 60 s.
    pub timeout: Duration,
}

impl Default for ReadOptions {
    fn default() -> Self {
        Self {
            client: PyClient::Confluent,
            read_committed: false,
            until: Until::End,
            timeout: Duration::from_secs(60),
        }
    }
}

/// A record as the independent client read it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// Its partition.
    pub partition: i32,
    /// Its offset.
    pub offset: i64,
    /// Its timestamp in ms (the producer's create time, unless the topic
    /// logs append time); `None` when the client saw none.
    pub timestamp: Option<i64>,
    /// The key, if not null.
    pub key: Option<Vec<u8>>,
    /// The value, if not null.
    pub value: Option<Vec<u8>>,
    /// Headers in order; `None` is a null header value.
    pub headers: Vec<(String, Option<Vec<u8>>)>,
}

impl Record {
    /// The value as UTF-8 text, if it is.
    pub fn value_str(&self) -> Option<&str> {
        self.value
            .as_deref()
            .and_then(|v| std::str::from_utf8(v).ok())
    }

    /// The first header named `key`: `Some(None)` when its value is null.
    pub fn header(&self, key: &str) -> Option<Option<&[u8]>> {
        self.headers
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_deref())
    }
}

#[derive(Deserialize)]
struct JsonHeader {
    key: String,
    value: Option<String>,
    value_b64: Option<String>,
}

#[derive(Deserialize)]
struct JsonRecord {
    partition: i32,
    offset: i64,
    #[serde(default)]
    timestamp: Option<i64>,
    key: Option<String>,
    key_b64: Option<String>,
    value: Option<String>,
    value_b64: Option<String>,
    headers: Vec<JsonHeader>,
}

fn bytes_of(text: Option<String>, b64: Option<String>) -> TestResult<Option<Vec<u8>>> {
    match (text, b64) {
        (Some(text), _) => Ok(Some(text.into_bytes())),
        (None, Some(b64)) => Ok(Some(base64_decode(&b64)?)),
        (None, None) => Ok(None),
    }
}

/// Reads all of `topic` with `client`, from the beginning to the end
/// offsets at start (read_uncommitted, 60 s limit).
///
/// # Errors
/// When the client fails, the topic is unknown, or the read times out.
pub fn read_topic(bootstrap: &str, topic: &str, client: PyClient) -> TestResult<Vec<Record>> {
    read_topic_with(
        bootstrap,
        topic,
        &ReadOptions {
            client,
            ..ReadOptions::default()
        },
    )
}

/// Reads `topic` with `scripts/kafka_read.py` under `options`. Records come
/// in the order the client received them: in offset order within a
/// partition, interleaved across partitions.
///
/// # Errors
/// As [`read_topic`].
pub fn read_topic_with(
    bootstrap: &str,
    topic: &str,
    options: &ReadOptions,
) -> TestResult<Vec<Record>> {
    let mut command = kafka_read_command(bootstrap, topic, options.client)?;
    command
        .arg("--isolation")
        .arg(if options.read_committed {
            "read_committed"
        } else {
            "read_uncommitted"
        })
        .arg("--timeout")
        .arg(options.timeout.as_secs_f64().to_string());
    match options.until {
        Until::End => command.args(["--until", "end"]),
        Until::Idle(idle) => command
            .args(["--until", "idle", "--idle"])
            .arg(idle.as_secs_f64().to_string()),
    };
    let stdout = run_kafka_read(&mut command, options.timeout)?;
    let mut records = Vec::new();
    let mut seen = BTreeSet::new();
    for line in stdout.lines().filter(|l| !l.trim().is_empty()) {
        let json: JsonRecord = serde_json::from_str(line).map_err(|e| {
            format!("kafka_read.py printed a line that is not a record ({e}): {line}")
        })?;
        let mut headers = Vec::with_capacity(json.headers.len());
        for h in json.headers {
            headers.push((h.key, bytes_of(h.value, h.value_b64)?));
        }
        // A reader that printed one position twice would fake duplicates.
        if !seen.insert((json.partition, json.offset)) {
            return Err(format!(
                "kafka_read.py printed partition {} offset {} twice",
                json.partition, json.offset
            )
            .into());
        }
        records.push(Record {
            partition: json.partition,
            offset: json.offset,
            timestamp: json.timestamp.filter(|t| *t >= 0),
            key: bytes_of(json.key, json.key_b64)?,
            value: bytes_of(json.value, json.value_b64)?,
            headers,
        });
    }
    Ok(records)
}

/// The offsets `group` has committed on each partition of `topic`
/// (`None` where it has none), as `client` sees them.
///
/// # Errors
/// When the client fails or the topic is unknown.
pub fn committed_offsets(
    bootstrap: &str,
    topic: &str,
    group: &str,
    client: PyClient,
) -> TestResult<BTreeMap<i32, Option<i64>>> {
    #[derive(Deserialize)]
    struct Committed {
        partition: i32,
        committed: Option<i64>,
    }
    let mut command = kafka_read_command(bootstrap, topic, client)?;
    command.arg("--committed").arg(group);
    let stdout = run_kafka_read(&mut command, Duration::from_secs(60))?;
    let mut offsets = BTreeMap::new();
    for line in stdout.lines().filter(|l| !l.trim().is_empty()) {
        let c: Committed = serde_json::from_str(line)
            .map_err(|e| format!("kafka_read.py --committed printed ({e}): {line}"))?;
        offsets.insert(c.partition, c.committed);
    }
    Ok(offsets)
}

fn kafka_read_command(bootstrap: &str, topic: &str, client: PyClient) -> TestResult<Command> {
    let mut command = Command::new(python()?);
    command
        .arg(repo_root().join("scripts/kafka_read.py"))
        .arg("--brokers")
        .arg(bootstrap)
        .arg("--topic")
        .arg(topic)
        .arg("--client")
        .arg(client.arg());
    Ok(command)
}

fn run_kafka_read(command: &mut Command, timeout: Duration) -> TestResult<String> {
    // The script bounds itself; this outer bound only catches a hang.
    let out = run_bounded(command, timeout + Duration::from_secs(60))?;
    if !out.status.success() {
        return Err(format!(
            "kafka_read.py failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )
        .into());
    }
    Ok(String::from_utf8(out.stdout)?)
}

/// A record as read back in this process: partition, value, headers.
pub type ReadRecord = (i32, String, Vec<(String, Vec<u8>)>);

/// Produces each value as decimal text (key `k<value>`, header `id` holding
/// the value), round-robin over `partitions`, and waits for the acks.
///
/// # Errors
/// When a record is not acked within 10 s.
pub async fn produce_values(
    bootstrap: &str,
    topic: &str,
    values: &[u64],
    partitions: i32,
) -> TestResult {
    use rdkafka::message::{Header, OwnedHeaders};
    use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
    let producer: FutureProducer = crate::client_config(bootstrap)
        .set("enable.idempotence", "true")
        .create()?;
    let texts: Vec<(String, String)> = values
        .iter()
        .map(|v| (format!("k{v}"), v.to_string()))
        .collect();
    let mut futs = Vec::new();
    for (i, (key, value)) in texts.iter().enumerate() {
        let p = (i as i32) % partitions.max(1);
        let rec = FutureRecord::to(topic)
            .key(key)
            .payload(value)
            .partition(p)
            .headers(OwnedHeaders::new().insert(Header {
                key: "id",
                value: Some(value.as_bytes()),
            }));
        futs.push(producer.send(rec, Duration::from_secs(10)));
    }
    for f in futs {
        f.await.map_err(|(e, _)| e)?;
    }
    producer.flush(Duration::from_secs(10))?;
    Ok(())
}

/// Every record of `topic` up to its high watermarks, read in this process
/// (read_committed): (partition, value, headers). A null header value reads
/// as empty here; [`read_topic`] tells them apart.
///
/// # Errors
/// When the read fails or takes more than a minute.
pub fn read_all(bootstrap: &str, topic: &str, partitions: i32) -> TestResult<Vec<ReadRecord>> {
    use rdkafka::Message;
    use rdkafka::consumer::{BaseConsumer, Consumer};
    use rdkafka::message::Headers;
    use rdkafka::topic_partition_list::{Offset, TopicPartitionList};
    use std::time::Instant;
    let c: BaseConsumer = crate::client_config(bootstrap)
        .set("group.id", "test-reader")
        .set("enable.auto.commit", "false")
        .set("enable.partition.eof", "true")
        .set("isolation.level", "read_committed")
        .create()?;
    let mut tpl = TopicPartitionList::new();
    let mut left = std::collections::HashMap::new();
    for p in 0..partitions {
        let (lo, hi) = c.fetch_watermarks(topic, p, Duration::from_secs(10))?;
        if hi > lo {
            tpl.add_partition_offset(topic, p, Offset::Offset(lo))?;
            left.insert(p, hi);
        }
    }
    let mut out = Vec::new();
    if left.is_empty() {
        return Ok(out);
    }
    c.assign(&tpl)?;
    let deadline = Instant::now() + Duration::from_secs(60);
    while !left.is_empty() {
        if Instant::now() > deadline {
            return Err(format!("reading {topic} timed out; left {left:?}").into());
        }
        let m = match c.poll(Duration::from_millis(200)) {
            None => continue,
            // With enable.partition.eof, a partition already read to its
            // end reports EOF while others are still being read.
            Some(Err(rdkafka::error::KafkaError::PartitionEOF(_))) => continue,
            Some(m) => m?,
        };
        let value = String::from_utf8_lossy(m.payload().unwrap_or_default()).into_owned();
        let headers = m
            .headers()
            .map(|h| {
                h.iter()
                    .map(|h| (h.key.to_owned(), h.value.unwrap_or_default().to_vec()))
                    .collect()
            })
            .unwrap_or_default();
        out.push((m.partition(), value, headers));
        if left
            .get(&m.partition())
            .is_some_and(|hi| m.offset() + 1 >= *hi)
        {
            left.remove(&m.partition());
        }
    }
    Ok(out)
}
