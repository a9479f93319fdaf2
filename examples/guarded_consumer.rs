//! A guarded consumer in front of an application that must not handle an
//! event twice (guarantee G2).
//!
//! The upstream producer is at-least-once: after a timeout it resends a run
//! of orders it had already written, so they sit in the topic twice, at new
//! offsets. The application charges each order, and it is killed once in
//! the middle of its work, so on restart Kafka hands it again everything
//! since its last checkpoint.
//!
//! [`GuardedConsumer`] is built from the application's own `ClientConfig`
//! and wraps an rdkafka `StreamConsumer` (reachable through
//! [`GuardedConsumer::consumer`]). Its default identity, a 128-bit hash of
//! key and value, catches both kinds of repeat: the resends (same content,
//! new offset) and the replays after the crash (same offset). Every order is
//! charged exactly once. The example exits non-zero otherwise.
//!
//! Runs on librdkafka's in-process mock cluster:
//! `cargo run --release --example guarded_consumer`.

use std::collections::BTreeMap;
use std::error::Error;
use std::process::ExitCode;
use std::time::Duration;

use futures::StreamExt;
use rdkafka::ClientConfig;
use rdkafka::message::Message;
use rdkafka::mocking::MockCluster;
use rdkafka::producer::{FutureProducer, FutureRecord};
use replayguard::kafka::{GuardOptions, GuardedConsumer, GuardedRecord};

type Result<T = (), E = Box<dyn Error + Send + Sync>> = std::result::Result<T, E>;

const TOPIC: &str = "orders";
const ORDERS: u32 = 600;
/// Orders the upstream writes a second time, at new offsets.
const RESENT: std::ops::RangeInclusive<u32> = 301..=450;
/// Orders charged before the application is killed.
const CRASH_AFTER: usize = 350;
const CHECKPOINT: Duration = Duration::from_secs(1);
/// What charging a card costs, so that the crash falls between checkpoints.
const WORK: Duration = Duration::from_millis(5);

#[tokio::main]
async fn main() -> ExitCode {
    match run().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("guarded_consumer: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run() -> Result {
    let cluster = MockCluster::new(1)?;
    cluster.create_topic(TOPIC, 2, 1)?;
    let bootstrap = cluster.bootstrap_servers();
    upstream(&bootstrap).await?;
    let written = ORDERS as usize + RESENT.count();
    println!(
        "Upstream wrote {written} records to {TOPIC:?}: {ORDERS} orders, of which {} were resent\n\
         at new offsets after a timeout.\n",
        RESENT.count()
    );

    let state = tempfile::tempdir()?;
    let mut config = ClientConfig::new();
    config
        .set("bootstrap.servers", &bootstrap)
        .set("group.id", "billing")
        .set("session.timeout.ms", "6000")
        .set("auto.offset.reset", "earliest");
    let open = || {
        GuardedConsumer::builder(config.clone(), state.path())
            .topic(TOPIC)
            .options(
                GuardOptions::default()
                    .checkpoint_interval(CHECKPOINT)
                    // Resends are caught only while their first copy is
                    // remembered.
                    .retention_time(Some(Duration::from_secs(600)))
                    .stop_at_end(true),
            )
            .build()
    };
    let mut charges: BTreeMap<String, u32> = BTreeMap::new();

    // First run: killed after CRASH_AFTER charges, between two checkpoints.
    let consumer = open().await?;
    let mut handled = 0;
    while let Some(record) = consumer.recv().await? {
        charge(&record, &mut charges).await?;
        consumer.ack(&record)?;
        handled += 1;
        if handled == CRASH_AFTER {
            break;
        }
    }
    let first = consumer.stats();
    consumer.abort();
    println!(
        "Run 1 charged {handled} orders and was killed (no checkpoint, no commit); the guard\n\
         had filtered {} resends.",
        first.duplicates
    );

    // Restart over the same state folder, reading through the stream API.
    let consumer = open().await?;
    let mut after = 0;
    {
        let mut records = std::pin::pin!(consumer.stream());
        while let Some(record) = records.next().await {
            let record = record?;
            charge(&record, &mut charges).await?;
            consumer.ack(&record)?;
            after += 1;
        }
    }
    consumer.checkpoint().await?;
    let second = consumer.stats();
    let guard = second.guard.unwrap_or_default();
    let assignment = consumer.assignment();
    println!(
        "Run 2 restarted from the last checkpoint, read {} records and charged {after} more.\n\
         The guard filtered {} replays of orders charged before the crash (same offset) and\n\
         {} resends (same content, new offset). The wrapped consumer held {} partitions.\n",
        second.records_in,
        guard.duplicates_same_position,
        guard.duplicates_same_content,
        assignment.len()
    );
    consumer.close(Duration::from_secs(10)).await?;

    let twice: Vec<&String> = charges
        .iter()
        .filter(|(_, n)| **n > 1)
        .map(|(k, _)| k)
        .collect();
    let missing = (1..=ORDERS)
        .filter(|i| !charges.contains_key(&order_key(*i)))
        .count();
    println!(
        "Orders charged: {} of {ORDERS}; charged twice: {}; never charged: {missing}.",
        charges.len(),
        twice.len()
    );
    if !twice.is_empty() || missing > 0 {
        let shown: Vec<&String> = twice.iter().take(10).copied().collect();
        return Err(format!(
            "not exactly once: {} orders charged twice (first {shown:?}), {missing} never",
            twice.len()
        )
        .into());
    }
    drop(cluster);
    Ok(())
}

fn order_key(i: u32) -> String {
    format!("order-{i:04}")
}

/// The application's side effect.
async fn charge(record: &GuardedRecord, charges: &mut BTreeMap<String, u32>) -> Result {
    let m = record.message();
    let key = std::str::from_utf8(m.key().unwrap_or_default())?.to_owned();
    tokio::time::sleep(WORK).await;
    *charges.entry(key).or_insert(0) += 1;
    Ok(())
}

/// An at-least-once upstream: every order, then a run of them again.
async fn upstream(bootstrap: &str) -> Result {
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .create()?;
    for i in (1..=ORDERS).chain(RESENT) {
        let key = order_key(i);
        let value = format!("{{\"order\":{i},\"cents\":{}}}", 100 + i % 900);
        producer
            .send(
                FutureRecord::to(TOPIC).key(&key).payload(&value),
                Duration::from_secs(10),
            )
            .await
            .map_err(|(e, _)| e)?;
    }
    Ok(())
}
