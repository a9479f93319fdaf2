//! In-process broker helpers: librdkafka's mock cluster on its own thread.

#![allow(dead_code)]

use std::sync::mpsc;
use std::time::{Duration, Instant};

use rdkafka::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Header, Headers, Message, OwnedHeaders};
use rdkafka::mocking::MockCluster;
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};

pub type TestResult<T = ()> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// A record as read back: partition, value, headers.
pub type ReadRecord = (i32, String, Vec<(String, Vec<u8>)>);

/// A mock cluster living on its own thread until dropped.
pub struct Broker {
    pub bootstrap: String,
    stop: Option<mpsc::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Broker {
    /// Starts a one-broker mock cluster with the given topics.
    pub fn start(topics: &[(&str, i32)]) -> TestResult<Self> {
        let topics: Vec<(String, i32)> =
            topics.iter().map(|(t, p)| ((*t).to_owned(), *p)).collect();
        let (addr_tx, addr_rx) = mpsc::channel();
        let (stop_tx, stop_rx) = mpsc::channel::<()>();
        let thread = std::thread::spawn(move || {
            let cluster = match MockCluster::new(1) {
                Ok(c) => c,
                Err(e) => {
                    let _ = addr_tx.send(Err(e.to_string()));
                    return;
                }
            };
            for (t, p) in &topics {
                if let Err(e) = cluster.create_topic(t, *p, 1) {
                    let _ = addr_tx.send(Err(e.to_string()));
                    return;
                }
            }
            let _ = addr_tx.send(Ok(cluster.bootstrap_servers()));
            let _ = stop_rx.recv();
        });
        let bootstrap = addr_rx.recv()??;
        Ok(Broker {
            bootstrap,
            stop: Some(stop_tx),
            thread: Some(thread),
        })
    }

    pub fn consumer_config(&self, group: &str) -> ClientConfig {
        let mut c = ClientConfig::new();
        c.set("bootstrap.servers", &self.bootstrap)
            .set("group.id", group)
            .set("session.timeout.ms", "6000")
            .set("auto.offset.reset", "earliest");
        c
    }

    /// Produces the values, each as a decimal string, to one partition (or
    /// round-robin over `partitions`), with an optional header.
    pub async fn produce(&self, topic: &str, values: &[u64], partitions: i32) -> TestResult {
        let producer: FutureProducer = ClientConfig::new()
            .set("bootstrap.servers", &self.bootstrap)
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

    /// Reads every record of a topic up to its high watermarks:
    /// (partition, value, headers).
    pub fn read_all(&self, topic: &str, partitions: i32) -> TestResult<Vec<ReadRecord>> {
        let c: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", &self.bootstrap)
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
                // With enable.partition.eof, a partition already read to
                // its end reports EOF while others are still being read.
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

    /// The values of a topic, parsed as integers, in read order.
    pub fn values(&self, topic: &str, partitions: i32) -> TestResult<Vec<u64>> {
        self.read_all(topic, partitions)?
            .into_iter()
            .map(|(_, v, _)| Ok(v.parse::<u64>()?))
            .collect()
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Values that appear more than once, and values of `expected` missing.
pub fn dups_and_missing(
    got: &[u64],
    expected: impl IntoIterator<Item = u64>,
) -> (Vec<u64>, Vec<u64>) {
    let mut counts = std::collections::BTreeMap::new();
    for v in got {
        *counts.entry(*v).or_insert(0u32) += 1;
    }
    let dups = counts
        .iter()
        .filter(|(_, c)| **c > 1)
        .map(|(v, _)| *v)
        .collect();
    let missing = expected
        .into_iter()
        .filter(|v| !counts.contains_key(v))
        .collect();
    (dups, missing)
}

/// Drops a value off the async runtime with a bound: dropping a consumer
/// of the mock cluster can block for seconds.
pub fn drop_off_runtime<T: Send + 'static>(v: T) {
    std::thread::spawn(move || drop(v));
}
