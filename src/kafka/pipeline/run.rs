//! The read, process and write loop.
//!
//! Records are read in batches of what is ready, admitted with one engine
//! call per batch ([`crate::Guard::check_many`]), queued, and handed to the
//! user function, up to `concurrency` at a time. Results are written in
//! the order the records were read, so every input partition's outputs keep
//! their order. A checkpoint waits only for outputs already handed to the
//! producer: records still being processed are in flight, so the position
//! never passes them.

use std::collections::VecDeque;
use std::fmt::Display;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::FutureExt;
use futures::stream::{FuturesOrdered, StreamExt};
use rdkafka::consumer::CommitMode;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{BorrowedMessage, Message, OwnedMessage};
use rdkafka::producer::{BaseRecord, Producer};

use super::output::{OutputRecord, Ticket};
use super::{GuardedPipeline, PipelineStats};
use crate::error::{Error, Result};
use crate::fingerprint::Fingerprint;
use crate::kafka::headers::{SourcePosition, encode_part};

/// Records admitted with one engine call, at most.
const ADMIT_BATCH: usize = 256;

/// An admitted record, waiting for or under processing.
struct Input {
    topic: Arc<str>,
    partition: i32,
    offset: i64,
    fp: Option<Fingerprint>,
}

/// How the loop ends.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Ending {
    /// Keep going.
    No,
    /// Asked to stop: finish the records under processing, checkpoint.
    Stop,
    /// The end of the input: handle everything admitted, checkpoint.
    End,
}

impl GuardedPipeline {
    /// Runs until an error, or until the end of the input with
    /// `stop_at_end`.
    ///
    /// # Errors
    ///
    /// See [`GuardedPipeline::run_until`].
    pub async fn run<F, Fut, E>(&mut self, f: F) -> Result<PipelineStats>
    where
        F: FnMut(OwnedMessage) -> Fut,
        Fut: Future<Output = std::result::Result<Vec<OutputRecord>, E>>,
        E: Display,
    {
        self.run_concurrent_until(1, f, std::future::pending())
            .await
    }

    /// Runs until `stop` completes, an error, or (with `stop_at_end`) the
    /// end of the input; then takes a final checkpoint and returns the
    /// counters. One record is processed at a time.
    ///
    /// # Errors
    ///
    /// [`Error::Process`] when `f` fails (the input is not recorded, so it
    /// is processed again after a restart); [`Error::Delivery`],
    /// [`Error::Store`] (which poisons the guard), [`Error::Consume`],
    /// [`Error::LeaseLapsed`], a failed recovery. Positions never pass an
    /// input whose outputs were not all acked.
    pub async fn run_until<F, Fut, E, S>(&mut self, f: F, stop: S) -> Result<PipelineStats>
    where
        F: FnMut(OwnedMessage) -> Fut,
        Fut: Future<Output = std::result::Result<Vec<OutputRecord>, E>>,
        E: Display,
        S: Future<Output = ()>,
    {
        self.run_concurrent_until(1, f, stop).await
    }

    /// As [`GuardedPipeline::run`], with up to `concurrency` records
    /// processed at a time (at least 1). Outputs are written in the order
    /// their inputs were read, so each input partition's outputs keep their
    /// order, and exactly once as with one at a time.
    ///
    /// # Errors
    ///
    /// See [`GuardedPipeline::run_until`].
    pub async fn run_concurrent<F, Fut, E>(
        &mut self,
        concurrency: usize,
        f: F,
    ) -> Result<PipelineStats>
    where
        F: FnMut(OwnedMessage) -> Fut,
        Fut: Future<Output = std::result::Result<Vec<OutputRecord>, E>>,
        E: Display,
    {
        self.run_concurrent_until(concurrency, f, std::future::pending())
            .await
    }

    /// As [`GuardedPipeline::run_until`], with up to `concurrency` records
    /// processed at a time.
    ///
    /// # Errors
    ///
    /// See [`GuardedPipeline::run_until`].
    pub async fn run_concurrent_until<F, Fut, E, S>(
        &mut self,
        concurrency: usize,
        mut f: F,
        stop: S,
    ) -> Result<PipelineStats>
    where
        F: FnMut(OwnedMessage) -> Fut,
        Fut: Future<Output = std::result::Result<Vec<OutputRecord>, E>>,
        E: Display,
        S: Future<Output = ()>,
    {
        let concurrency = concurrency.max(1);
        let mut stop = std::pin::pin!(stop);
        let mut tick = tokio::time::interval(self.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        let mut transient = crate::kafka::trouble::TransientLog::default();
        let mut queue: VecDeque<(Input, OwnedMessage)> = VecDeque::new();
        let mut work = FuturesOrdered::new();
        let mut ending = Ending::No;
        let wake = self.core.lock().wake.clone();
        loop {
            self.check_failure()?;
            if self.stop_at_end
                && ending == Ending::No
                && queue.is_empty()
                && work.is_empty()
                && self.core.group_at_end(&*self.consumer)
            {
                tracing::warn!(
                    "no input partition is assigned to this instance, and its group has read the input to its end: it stops (a group with more members than partitions leaves some with none)"
                );
                ending = Ending::End;
            }
            while work.len() < concurrency
                && ending != Ending::Stop
                && let Some((input, m)) = queue.pop_front()
            {
                work.push_back(f(m).map(move |r| (input, r)));
            }
            if ending != Ending::No
                && work.is_empty()
                && (ending == Ending::Stop || queue.is_empty())
            {
                break;
            }
            // Partitions waiting for a previous owner's outputs in flight
            // are recovered once the wait is over.
            let held = self.core.recover_held(&*self.consumer)?;
            let release = async move {
                match held {
                    Some(at) => tokio::time::sleep_until(at.into()).await,
                    None => std::future::pending().await,
                }
            };
            let reading = ending == Ending::No && queue.is_empty();
            tokio::select! {
                biased;
                () = &mut stop, if ending == Ending::No => ending = Ending::Stop,
                Some((input, result)) = work.next(), if !work.is_empty() => {
                    let outputs = result.map_err(|e| Error::Process {
                        topic: input.topic.to_string(),
                        partition: input.partition,
                        offset: input.offset,
                        message: e.to_string(),
                    })?;
                    self.dispatch(&input, outputs).await?;
                }
                _ = tick.tick() => self.checkpoint(CommitMode::Async).await?,
                () = release => {}
                // Partitions held by a rebalance served inside `recv` (the
                // next round computes when to release them), or a callback
                // that stopped the guard (the next round returns it).
                () = wake.notified() => {}
                m = self.consumer.recv(), if reading => {
                    if self.read(m, &mut queue, &mut transient)? {
                        ending = Ending::End;
                    }
                }
            }
        }
        self.checkpoint(CommitMode::Sync).await?;
        Ok(self.stats())
    }

    /// Takes a received record and whatever else is ready (a batch), admits
    /// them, and queues the fresh ones. `true` at the end of the input with
    /// `stop_at_end`.
    fn read(
        &self,
        first: std::result::Result<BorrowedMessage<'_>, KafkaError>,
        queue: &mut VecDeque<(Input, OwnedMessage)>,
        transient: &mut crate::kafka::trouble::TransientLog,
    ) -> Result<bool> {
        let mut batch = Vec::new();
        let mut next = Some(first);
        while let Some(m) = next.take() {
            match m {
                Ok(m) => batch.push(m),
                Err(KafkaError::PartitionEOF(p)) if self.stop_at_end => {
                    // The records polled before the end event first: a
                    // record admitted after it would clear the partition's
                    // end again.
                    self.admit(std::mem::take(&mut batch), queue)?;
                    if self.core.at_end(&*self.consumer, p)? {
                        return Ok(true);
                    }
                }
                Err(KafkaError::PartitionEOF(_)) => {}
                Err(e) if crate::kafka::trouble::heals(&e) => transient.note(&e),
                Err(e) => return Err(self.core.consume_failure(&*self.consumer, e)),
            }
            if batch.len() < ADMIT_BATCH {
                next = self.consumer.recv().now_or_never();
            }
        }
        self.admit(batch, queue)?;
        Ok(false)
    }

    /// Admits a batch of records with one engine call; queues the fresh.
    fn admit(
        &self,
        batch: Vec<BorrowedMessage<'_>>,
        queue: &mut VecDeque<(Input, OwnedMessage)>,
    ) -> Result<()> {
        if batch.is_empty() {
            return Ok(());
        }
        let verdicts = self.core.admit_polled(&self.identity, &batch)?;
        for (m, (fp, ok)) in batch.into_iter().zip(verdicts) {
            if ok {
                let input = Input {
                    topic: Arc::from(m.topic()),
                    partition: m.partition(),
                    offset: m.offset(),
                    fp,
                };
                queue.push_back((input, m.detach()));
            }
        }
        Ok(())
    }

    /// Writes an input's outputs, each with its guard headers.
    async fn dispatch(&self, input: &Input, outputs: Vec<OutputRecord>) -> Result<()> {
        let (topic, partition, offset) = (&*input.topic, input.partition, input.offset);
        let count = outputs.len() as u32;
        let Some(outputs) = self.to_send(input, outputs)? else {
            return Ok(());
        };
        // Not a single output more once this instance may have lost its
        // partitions.
        self.core.check_lease(&*self.consumer)?;
        let src = SourcePosition {
            topic: topic.to_owned(),
            partition,
            offset,
        }
        .encode();
        let fp = input.fp.map(Fingerprint::to_bytes);
        for (index, out) in outputs {
            let part = encode_part(index, count);
            let headers = out.headers_with(
                (count > 1).then_some(&part[..]),
                &src,
                fp.as_ref().map(|b| &b[..]),
            );
            let mut record = self.record_of(input, &out, headers);
            loop {
                match self.producer.send(record) {
                    Ok(()) => break,
                    Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), r)) => {
                        record = r;
                        self.check_failure()?;
                        tokio::time::sleep(Duration::from_millis(1)).await;
                    }
                    Err((e, _)) => {
                        let input = format!("{topic}[{partition}]@{offset}");
                        // A producer that failed for good refuses every
                        // send: its fatal error is the cause.
                        let e = match self.producer.client().fatal_error() {
                            Some((code, reason)) => {
                                Error::producer_failed(input, KafkaError::Global(code), reason)
                            }
                            _ => Error::delivery(input, e),
                        };
                        return Err(self.core.stop(e));
                    }
                }
            }
            if count > 1 && crate::kafka::setup::fault("mid-outputs") {
                // As if the process died between two outputs of one input.
                return Err(self.core.stop(Error::Stopped {
                    reason: format!(
                        "injected crash between the outputs of {topic}[{partition}]@{offset}"
                    ),
                    after: None,
                }));
            }
        }
        // A pause between the check above and the sends (a frozen process
        // thawed, say) shows here: the outputs just queued are purged
        // before librdkafka's linger lets them go.
        self.core.check_lease(&*self.consumer)
    }

    /// The outputs of `input` still to send, numbered among all of its
    /// outputs: those a crash cut short are left out. `None` when nothing
    /// is to be sent: its partition left while it was processed (its new
    /// owner writes them), or it had no output left (it is then handled).
    fn to_send(
        &self,
        input: &Input,
        outputs: Vec<OutputRecord>,
    ) -> Result<Option<Vec<(u32, OutputRecord)>>> {
        let (topic, partition, offset) = (&*input.topic, input.partition, input.offset);
        let mut outputs: Vec<(u32, OutputRecord)> = (0..).zip(outputs).collect();
        let mut s = self.core.lock();
        if !s.partial.is_empty()
            && let Some(written) = s.partial.remove(&(topic.to_owned(), partition, offset))
        {
            // The function must be deterministic for this to hold: the
            // same input gives the same outputs in the same order.
            outputs.retain(|(i, _)| !written.contains(i));
        }
        if !s.dispatch(topic, partition, offset, outputs.len() as u32) {
            return Ok(None);
        }
        if outputs.is_empty() {
            let r = s.complete(topic, partition, offset);
            drop(s);
            return r.map(|()| None).map_err(|e| self.core.stop(e));
        }
        Ok(Some(outputs))
    }

    /// The producer record of one output of `input`, with its headers; an
    /// output with no partition of its own goes to its input's partition
    /// number when the output has that many.
    fn record_of<'a>(
        &'a self,
        input: &Input,
        out: &'a OutputRecord,
        headers: rdkafka::message::OwnedHeaders,
    ) -> BaseRecord<'a, [u8], [u8], Box<Ticket>> {
        let ticket = Box::new(Ticket {
            topic: input.topic.clone(),
            partition: input.partition,
            offset: input.offset,
        });
        let mut record: BaseRecord<'_, [u8], [u8], Box<Ticket>> =
            BaseRecord::with_opaque_to(&self.output, ticket).headers(headers);
        if let Some(k) = &out.key {
            record = record.key(&k[..]);
        }
        if let Some(v) = &out.value {
            record = record.payload(&v[..]);
        }
        if let Some(t) = out.timestamp {
            record = record.timestamp(t);
        }
        match out.partition {
            Some(p) => record = record.partition(p),
            None if input.partition < self.out_partitions => {
                record = record.partition(input.partition);
            }
            None => {}
        }
        record
    }

    fn check_failure(&self) -> Result<()> {
        match self.core.failure() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Waits for every output handed to the producer to be acked, then
    /// writes a checkpoint and commits input offsets. Records under
    /// processing stay in flight: the position does not pass them.
    async fn checkpoint(&self, mode: CommitMode) -> Result<()> {
        let started = Instant::now();
        let span = tracing::debug_span!("replayguard_checkpoint");
        let _e = span.enter();
        loop {
            self.check_failure()?;
            if self.core.lock().unacked() == 0 {
                break;
            }
            if started.elapsed() > self.timeout {
                return Err(self.core.stop(Error::Stopped {
                    reason: format!(
                        "outputs not acked within {:?}; is the broker up?",
                        self.timeout
                    ),
                    after: None,
                }));
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        if let Err(e) = self.core.checkpoint(&*self.consumer, None, mode) {
            return Err(self.core.stop(e));
        }
        if matches!(mode, CommitMode::Async)
            && let Err(e) = self.core.watch_assignment(&*self.consumer)
        {
            return Err(self.core.stop(e));
        }
        self.core
            .meters
            .checkpoint_seconds
            .record(started.elapsed().as_secs_f64());
        Ok(())
    }
}
