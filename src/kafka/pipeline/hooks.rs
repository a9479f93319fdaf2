//! What a pipeline adds to the context's recovery and checkpoints.

use std::sync::Arc;
use std::time::Duration;

use rdkafka::consumer::ConsumerGroupMetadata;
use rdkafka::producer::{Producer, PurgeConfig, ThreadedProducer};
use rdkafka::topic_partition_list::TopicPartitionList;

use super::output::DeliveryContext;
use crate::error::{Error, Result};
use crate::kafka::context::{Core, Hooks};
use crate::kafka::reconcile::Reconciler;
use crate::kafka::setup::kafka;
use crate::kafka::shared::SinkPositions;

pub(crate) struct PipelineHooks {
    pub producer: Arc<ThreadedProducer<DeliveryContext>>,
    /// The guarded mode's; none in the baselines.
    pub reconciler: Option<Reconciler>,
    /// The transactional baseline commits inside its transaction.
    pub transactional: bool,
    pub timeout: Duration,
}

impl Hooks for PipelineHooks {
    fn writes(&self) -> bool {
        self.reconciler.is_some()
    }

    fn flush(&self, timeout: Duration) -> Result<()> {
        self.producer
            .flush(timeout)
            .map_err(kafka("flushing outputs before a revoke"))
    }

    fn reconcile(
        &self,
        core: &Core,
        manifest: Option<&SinkPositions>,
        commits: &[SinkPositions],
    ) -> Result<()> {
        match &self.reconciler {
            Some(r) => r.reconcile(core, manifest, commits).map(drop),
            None => Ok(()),
        }
    }

    fn commit(
        &self,
        tpl: &TopicPartitionList,
        group: Option<ConsumerGroupMetadata>,
    ) -> Result<bool> {
        if !self.transactional {
            return Ok(false);
        }
        let group = group.ok_or_else(|| {
            Error::Config("the transactional baseline needs a consumer group".into())
        })?;
        let p = &self.producer;
        p.send_offsets_to_transaction(tpl, &group, self.timeout)
            .map_err(kafka("sending offsets to the transaction"))?;
        p.commit_transaction(self.timeout)
            .map_err(kafka("committing the transaction"))?;
        p.begin_transaction()
            .map_err(kafka("beginning a transaction"))?;
        // librdkafka's mock cluster acknowledges transactional offsets
        // without storing them; the plain commit of the same offsets that
        // follows makes the baseline resumable there. On a real broker it is
        // redundant.
        Ok(false)
    }

    fn purge(&self) {
        self.producer.purge(PurgeConfig::default().queue());
    }
}
