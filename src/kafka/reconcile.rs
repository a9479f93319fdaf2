//! Output reconciliation: closes the crash window between a producer ack and
//! the input's identity reaching disk, without transactions.
//!
//! Every guarded output carries its input's source position and
//! fingerprint. On recovery the reader scans each output partition from the
//! last known sink position to its high watermark and records those inputs
//! as handled: the pipeline's own inputs, not those of another job that
//! writes to the same topic.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::{Duration, Instant};

use rdkafka::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::Message;
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};

use super::context::{Core, position_in};
use super::headers::{SourcePosition, read_guard_headers};
use super::setup::kafka;
use super::shared::SinkPositions;
use super::trouble::{patiently, watermarks};
use crate::error::{Error, Result};
use crate::fingerprint::Fingerprint;

/// An input by (topic, partition, offset).
type InputKey = (String, i32, i64);

/// Of an input with several outputs: its output count, the indices found,
/// and its fingerprint.
type PartsSeen = (u32, BTreeSet<u32>, Option<Fingerprint>);

pub(crate) struct Reconciler {
    reader: BaseConsumer,
    topic: String,
    partitions: usize,
    /// The pipeline's input topics: outputs of any other topic's records
    /// (another job writing to the same topic) are passed over.
    inputs: Vec<String>,
    timeout: Duration,
}

impl Reconciler {
    pub fn new(
        connection: &ClientConfig,
        group: &str,
        topic: &str,
        partitions: usize,
        inputs: &[String],
        timeout: Duration,
    ) -> Result<Self> {
        // The pipeline's own group: librdkafka wants one even for a reader
        // that only assigns, and the pipeline's principal already may use
        // it. The reader never joins it and commits nothing.
        let reader: BaseConsumer = connection
            .clone()
            .set("group.id", group)
            .set("enable.auto.commit", "false")
            .set("enable.partition.eof", "false")
            .set("isolation.level", "read_uncommitted")
            .create()
            .map_err(kafka("creating the reconciliation reader"))?;
        Ok(Reconciler {
            reader,
            topic: topic.to_owned(),
            partitions,
            inputs: inputs.to_vec(),
            timeout,
        })
    }

    /// The output's partitions now. Partitions added to it since the
    /// pipeline was built hold outputs too: another instance's producer
    /// (or this one's, once it refreshed its metadata) writes to them.
    fn output_partitions(&self) -> Result<usize> {
        let md = patiently(self.timeout, || {
            self.reader.fetch_metadata(Some(&self.topic), self.timeout)
        })
        .map_err(kafka("reading the output topic's metadata"))?;
        let now = md
            .topics()
            .iter()
            .find(|t| t.name() == self.topic)
            .map_or(0, |t| t.partitions().len());
        Ok(now.max(self.partitions))
    }

    /// Every output up to `scanned` is now accounted for: its input is
    /// recorded in the open epoch, which the next checkpoint writes together
    /// with the manifest. So the sink position may move there.
    fn advance_sink(&self, core: &Core, scanned: &BTreeMap<i32, i64>) {
        let mut s = core.lock();
        let sink = s.sink.get_or_insert_with(|| SinkPositions {
            topic: self.topic.clone(),
            ..SinkPositions::default()
        });
        for (p, hi) in scanned {
            let e = sink.ends.entry(*p).or_insert(*hi);
            *e = (*e).max(*hi);
        }
    }

    /// Reads every output partition from the earliest position any source
    /// names (or from its start when none does) to its high watermark, and
    /// records the inputs found as handled.
    pub fn reconcile(
        &self,
        core: &Core,
        manifest: Option<&SinkPositions>,
        commits: &[SinkPositions],
    ) -> Result<u64> {
        let started = Instant::now();
        let range = self.range(manifest, commits)?;
        if range.targets.is_empty() {
            self.advance_sink(core, &range.scanned);
            return Ok(0);
        }
        let (mut found, parts) = self.read_range(core, &range)?;
        found += settle_parts(core, parts)?;
        tracing::info!(
            topic = %self.topic,
            identities = found,
            ms = started.elapsed().as_millis() as u64,
            "output reconciled"
        );
        core.meters.reconciled.increment(found);
        Ok(found)
    }

    /// What to read: each output partition from the lowest end any writer
    /// recorded (or its start) to its high watermark. An output below a
    /// recorded end was recreated: an error.
    fn range(
        &self,
        manifest: Option<&SinkPositions>,
        commits: &[SinkPositions],
    ) -> Result<ReadRange> {
        let mut range = ReadRange {
            tpl: TopicPartitionList::new(),
            targets: BTreeMap::new(),
            scanned: BTreeMap::new(),
        };
        for p in 0..self.output_partitions()? as i32 {
            let from = manifest
                .into_iter()
                .chain(commits.iter())
                .filter(|s| s.topic == self.topic)
                .filter_map(|s| s.ends.get(&p).copied())
                .min();
            let (lo, hi) = watermarks(&self.reader, &self.topic, p, self.timeout)
                .map_err(kafka("reading output watermarks"))?;
            if let Some(known) = from
                && hi < known
            {
                return Err(Error::TopicRewound {
                    topic: self.topic.clone(),
                    partition: p,
                    end: hi,
                    known,
                    done: "written",
                    risk: "take outputs of the old topic for written and miss the crash window's",
                });
            }
            let from = from.unwrap_or(lo).max(lo);
            tracing::debug!(partition = p, from, lo, hi, "reconcile range");
            range.scanned.insert(p, hi);
            if from < hi {
                range
                    .tpl
                    .add_partition_offset(&self.topic, p, Offset::Offset(from))
                    .map_err(kafka("building the reconciliation assignment"))?;
                range.targets.insert(p, hi);
            }
        }
        Ok(range)
    }

    /// Reads `range` and records each input whose single output it finds;
    /// inputs with several outputs are gathered, to be decided once all is
    /// read. Returns the inputs recorded, and those gathered.
    fn read_range(
        &self,
        core: &Core,
        range: &ReadRange,
    ) -> Result<(u64, HashMap<InputKey, PartsSeen>)> {
        let mut targets = range.targets.clone();
        self.reader
            .assign(&range.tpl)
            .map_err(kafka("assigning output partitions for reconciliation"))?;
        let mut found = 0u64;
        let mut parts: HashMap<InputKey, PartsSeen> = HashMap::new();
        let mut last_progress = Instant::now();
        while !targets.is_empty() {
            let Some(r) = self.reader.poll(Duration::from_millis(200)) else {
                // A partition whose log ends with a transaction marker (a
                // transactional writer shares the topic, or wrote it
                // before) has no record at its end; the reader's position,
                // past the marker, says it was read.
                if let Ok(positions) = self.reader.position() {
                    targets.retain(|p, hi| {
                        position_in(&positions, &self.topic, *p).is_none_or(|o| o < *hi)
                    });
                    if targets.is_empty() {
                        break;
                    }
                }
                if last_progress.elapsed() > self.timeout {
                    let _ = self.reader.unassign();
                    return Err(Error::Stopped {
                        reason: format!(
                            "output reconciliation of {} made no progress for {:?}; partitions left: {:?}",
                            self.topic, self.timeout, targets
                        ),
                        after: None,
                    });
                }
                continue;
            };
            let m = r.map_err(kafka("reading the output for reconciliation"))?;
            last_progress = Instant::now();
            if let Some(h) =
                read_guard_headers(m.headers()).filter(|h| self.inputs.contains(&h.src.topic))
            {
                if h.part.1 > 1 {
                    let key = (h.src.topic.clone(), h.src.partition, h.src.offset);
                    let e = parts
                        .entry(key)
                        .or_insert_with(|| (h.part.1, BTreeSet::new(), h.fp));
                    e.1.insert(h.part.0);
                } else if record(core, &h.src, h.fp)? {
                    found += 1;
                }
            }
            if targets
                .get(&m.partition())
                .is_some_and(|hi| m.offset() + 1 >= *hi)
            {
                targets.remove(&m.partition());
            }
        }
        self.reader
            .unassign()
            .map_err(kafka("releasing the reconciliation reader"))?;
        Ok((found, parts))
    }
}

/// The output partitions a reconciliation reads.
struct ReadRange {
    tpl: TopicPartitionList,
    /// Partition to the high watermark to read up to.
    targets: BTreeMap<i32, i64>,
    /// Every partition's high watermark, read or not.
    scanned: BTreeMap<i32, i64>,
}

/// Decides the inputs with several outputs: one whose outputs were all
/// found is handled; one cut short by a crash keeps the parts written, so
/// that its replay writes only the missing ones. Returns the inputs
/// recorded.
fn settle_parts(core: &Core, parts: HashMap<InputKey, PartsSeen>) -> Result<u64> {
    let mut found = 0;
    for ((topic, partition, offset), (count, seen, fp)) in parts {
        if seen.len() as u32 >= count {
            let src = SourcePosition {
                topic,
                partition,
                offset,
            };
            if record(core, &src, fp)? {
                found += 1;
            }
        } else {
            tracing::warn!(
                topic = %topic,
                partition,
                offset,
                written = seen.len(),
                count,
                "an input's outputs were cut short by a crash; its replay writes only the missing ones"
            );
            core.lock().partial.insert((topic, partition, offset), seen);
        }
    }
    Ok(found)
}

/// Records an input found in the output as handled; true when it was new.
fn record(core: &Core, src: &SourcePosition, fp: Option<Fingerprint>) -> Result<bool> {
    let mut s = core.lock();
    let Some(lane) = s.lane(&src.topic, src.partition) else {
        return Ok(false);
    };
    match s.engine()? {
        Some(g) => Ok(g.record(lane, Some(src.offset as u64), fp)?.is_fresh()),
        None => Ok(false),
    }
}
