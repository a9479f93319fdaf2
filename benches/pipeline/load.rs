//! Input load and output observation.
//!
//! Every input value is [`RECORD_BYTES`] long: a sequence number (u64 BE), the
//! time it was handed to the producer in microseconds since the start of the
//! benchmark (u64 BE), then filler. The pipelines copy values unchanged, so
//! a reader of the output knows when each record was produced.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rdkafka::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::Message;
use rdkafka::producer::{BaseProducer, BaseRecord, Producer, ThreadedProducer};
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};

use crate::BenchResult;

/// Bytes in every input value.
pub const RECORD_BYTES: usize = 100;

static BASE: OnceLock<Instant> = OnceLock::new();

/// Microseconds since the benchmark started: the clock of every stamp.
pub fn now_us() -> u64 {
    BASE.get_or_init(Instant::now).elapsed().as_micros() as u64
}

/// Writes record `seq`, stamped `stamp_us`, into `buf`.
pub fn fill(buf: &mut [u8; RECORD_BYTES], seq: u64, stamp_us: u64) {
    buf[..8].copy_from_slice(&seq.to_be_bytes());
    buf[8..16].copy_from_slice(&stamp_us.to_be_bytes());
    buf[16..].fill(b'.');
}

/// The sequence number and stamp of a value written by [`fill`].
pub fn parse(value: &[u8]) -> Option<(u64, u64)> {
    let seq = u64::from_be_bytes(value.get(..8)?.try_into().ok()?);
    let stamp = u64::from_be_bytes(value.get(8..16)?.try_into().ok()?);
    Some((seq, stamp))
}

/// Produces records `seqs` round-robin over `partitions` as fast as the
/// broker takes them, in large batches, and waits for every ack.
///
/// The mock cluster answers a fetch with one produce batch per partition
/// and finds a batch by scanning the partition's batches from the oldest
/// (librdkafka 2.12, `rd_kafka_mock_msgset_find`), so an input written in
/// small batches caps every consumer at the same rate: about 118k records/s
/// here with `linger.ms` 5, in all three modes alike.
pub fn produce_bulk(
    bootstrap: &str,
    topic: &str,
    partitions: i32,
    seqs: std::ops::Range<u64>,
) -> BenchResult {
    let producer: BaseProducer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("linger.ms", "100")
        .set("queue.buffering.max.messages", "1000000")
        .set("batch.num.messages", "100000")
        .set("batch.size", "4000000")
        .create()?;
    let mut buf = [0u8; RECORD_BYTES];
    for seq in seqs {
        fill(&mut buf, seq, now_us());
        let mut record: BaseRecord<'_, (), [u8]> = BaseRecord::to(topic)
            .payload(&buf[..])
            .partition((seq % partitions as u64) as i32);
        loop {
            match producer.send(record) {
                Ok(()) => break,
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), r)) => {
                    record = r;
                    producer.poll(Duration::from_millis(5));
                }
                Err((e, _)) => return Err(format!("producing the input: {e}").into()),
            }
        }
        if seq % 1024 == 0 {
            producer.poll(Duration::ZERO);
        }
    }
    producer.flush(Duration::from_secs(120))?;
    // A broker that drops the oldest records before the run reads them
    // would leave the run waiting for inputs that no longer exist: the
    // mock cluster keeps about 5 MiB of batches a partition (librdkafka
    // 2.12, `rd_kafka_mock_partition_log_append`): 47,150 records of this
    // size were left of 93,750 in a trial.
    for p in 0..partitions {
        let (low, high) = producer
            .client()
            .fetch_watermarks(topic, p, Duration::from_secs(10))?;
        if low > 0 {
            return Err(format!(
                "the broker kept only offsets {low}..{high} of {topic} [{p}] and dropped \
                 the {low} before: write fewer records, or over more partitions"
            )
            .into());
        }
    }
    Ok(())
}

/// A producer thread sending stamped records at an adjustable steady rate.
pub struct Paced {
    stop: Arc<AtomicBool>,
    sent: Arc<AtomicU64>,
    rate: Arc<AtomicU64>,
    full: Arc<AtomicU64>,
    thread: JoinHandle<BenchResult>,
}

impl Paced {
    /// Starts sending `rate` records a second round-robin over `partitions`,
    /// with librdkafka's default batching (`linger.ms` 5).
    ///
    /// The mock cluster answers a fetch with one produce batch per
    /// partition, so a consumer at the tail gets about `linger.ms` worth of
    /// input per round trip; with `linger.ms` 1 a tail reader fell behind
    /// 20k/s here.
    pub fn start(bootstrap: &str, topic: &str, partitions: i32, rate: u64) -> BenchResult<Self> {
        let producer: ThreadedProducer<_> = ClientConfig::new()
            .set("bootstrap.servers", bootstrap)
            .create()?;
        let stop = Arc::new(AtomicBool::new(false));
        let sent = Arc::new(AtomicU64::new(0));
        let rate = Arc::new(AtomicU64::new(rate));
        let full = Arc::new(AtomicU64::new(0));
        let (stop2, sent2, rate2, full2) = (stop.clone(), sent.clone(), rate.clone(), full.clone());
        let topic = topic.to_owned();
        let thread = std::thread::spawn(move || -> BenchResult {
            let mut buf = [0u8; RECORD_BYTES];
            let mut seq = 0u64;
            let mut last = Instant::now();
            let mut credit = 0.0f64;
            while !stop2.load(Ordering::Relaxed) {
                let now = Instant::now();
                credit += (now - last).as_secs_f64() * rate2.load(Ordering::Relaxed) as f64;
                last = now;
                while credit >= 1.0 {
                    fill(&mut buf, seq, now_us());
                    let record: BaseRecord<'_, (), [u8]> = BaseRecord::to(&topic)
                        .payload(&buf[..])
                        .partition((seq % partitions as u64) as i32);
                    let mut record = record;
                    // A full queue means the broker fell behind: wait, and
                    // the wait counts in the record's latency (its stamp
                    // is older than its send).
                    loop {
                        match producer.send(record) {
                            Ok(()) => break,
                            Err((
                                KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull),
                                r,
                            )) => {
                                record = r;
                                full2.fetch_add(1, Ordering::Relaxed);
                                std::thread::sleep(Duration::from_millis(1));
                            }
                            Err((e, _)) => {
                                return Err(format!("producing at a steady rate: {e}").into());
                            }
                        }
                    }
                    seq += 1;
                    credit -= 1.0;
                    sent2.store(seq, Ordering::Release);
                }
                std::thread::sleep(Duration::from_micros(500));
            }
            producer.flush(Duration::from_secs(30))?;
            Ok(())
        });
        Ok(Paced {
            stop,
            sent,
            rate,
            full,
            thread,
        })
    }

    /// Changes the rate, in records a second.
    pub fn set_rate(&self, rate: u64) {
        self.rate.store(rate, Ordering::Relaxed);
    }

    /// Records handed to the producer so far; the next one has this number.
    pub fn sent(&self) -> u64 {
        self.sent.load(Ordering::Acquire)
    }

    /// Stops sending, waits for the outstanding acks, and returns how many
    /// times the producer's queue was full (the broker fell behind).
    pub fn stop(self) -> BenchResult<u64> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread
            .join()
            .map_err(|_| "the paced producer panicked")??;
        Ok(self.full.load(Ordering::Relaxed))
    }
}

/// When each record was seen, by sequence number.
#[derive(Default)]
struct Seen {
    /// (produce stamp, seen), microseconds; seen is 0 while unseen.
    at: Vec<(u64, u64)>,
    duplicates: u64,
}

/// A reader of the output, on a thread of its own, noting when each record
/// becomes visible to it.
pub struct Reader {
    stop: Arc<AtomicBool>,
    seen: Arc<Mutex<Seen>>,
    thread: JoinHandle<BenchResult>,
}

/// What a reader saw of a window of sequence numbers.
pub struct Observed {
    /// (sequence number, produce stamp, seen), microseconds, for every
    /// record of the window seen.
    pub records: Vec<(u64, u64, u64)>,
    /// Records of the window never seen.
    pub missing: u64,
    /// Records seen more than once (any sequence number).
    pub duplicates: u64,
}

impl Reader {
    /// Reads every partition of `topic` from the beginning, with
    /// `read_committed` isolation or not.
    pub fn start(
        bootstrap: &str,
        topic: &str,
        partitions: i32,
        read_committed: bool,
    ) -> BenchResult<Self> {
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", bootstrap)
            .set("group.id", "bench-reader")
            .set("enable.auto.commit", "false")
            .set("fetch.wait.max.ms", crate::scenarios::FETCH_WAIT_MS)
            .set(
                "fetch.queue.backoff.ms",
                crate::scenarios::FETCH_QUEUE_BACKOFF_MS,
            )
            .set(
                "isolation.level",
                if read_committed {
                    "read_committed"
                } else {
                    "read_uncommitted"
                },
            )
            .create()?;
        let mut tpl = TopicPartitionList::new();
        for p in 0..partitions {
            tpl.add_partition_offset(topic, p, Offset::Beginning)?;
        }
        consumer.assign(&tpl)?;
        let stop = Arc::new(AtomicBool::new(false));
        let seen = Arc::new(Mutex::new(Seen::default()));
        let (stop2, seen2) = (stop.clone(), seen.clone());
        let thread = std::thread::spawn(move || -> BenchResult {
            while !stop2.load(Ordering::Relaxed) {
                let Some(m) = consumer.poll(Duration::from_millis(50)) else {
                    continue;
                };
                let now = now_us();
                let Some((seq, stamp)) = m.ok().and_then(|m| m.payload().and_then(parse)) else {
                    continue;
                };
                let mut s = seen2.lock().map_err(|_| "reader state poisoned")?;
                let i = seq as usize;
                if s.at.len() <= i {
                    s.at.resize(i + 1, (0, 0));
                }
                if s.at[i].1 == 0 {
                    s.at[i] = (stamp, now);
                } else {
                    s.duplicates += 1;
                }
            }
            // Dropping a consumer of the mock can block; it is only a reader.
            std::thread::spawn(move || drop(consumer));
            Ok(())
        });
        Ok(Reader { stop, seen, thread })
    }

    /// How many records of `lo..hi` were seen.
    pub fn count_in(&self, lo: u64, hi: u64) -> u64 {
        let Ok(s) = self.seen.lock() else { return 0 };
        let end = (hi as usize).min(s.at.len());
        let start = (lo as usize).min(end);
        s.at[start..end].iter().filter(|a| a.1 != 0).count() as u64
    }

    /// Stops reading and returns what was seen of `lo..hi`.
    pub fn finish(self, lo: u64, hi: u64) -> BenchResult<Observed> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().map_err(|_| "the reader panicked")??;
        let s = self.seen.lock().map_err(|_| "reader state poisoned")?;
        let records: Vec<(u64, u64, u64)> = (lo..hi)
            .filter_map(|i| s.at.get(i as usize).map(|a| (i, a.0, a.1)))
            .filter(|r| r.2 != 0)
            .collect();
        Ok(Observed {
            missing: (hi - lo) - records.len() as u64,
            records,
            duplicates: s.duplicates,
        })
    }
}
