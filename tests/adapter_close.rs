//! How the adapters close.
//!
//! A guarded consumer or pipeline dropped without `close`, as on an error's
//! way out, closes its Kafka clients on a thread of its own and waits at
//! most the options' timeout, on Apache Kafka:
//!
//! - While the broker answers, the drop closes everything before it
//!   returns: the same state folder opens again at once.
//! - While the broker is frozen (SIGSTOP), both drops return within the
//!   timeout and a margin; an inline drop of the consumer had not returned
//!   after 4.5 minutes. Once the broker is thawed the close goes on to its
//!   end in the background, and the folders open again.
//!
//! A pipeline's [`StatsHandle`] kept after its `close` (by a metrics task,
//! say) keeps neither the state folder nor the pipeline's Kafka clients: a
//! new pipeline opens the folder at once, librdkafka's threads of the
//! closed pipeline end, and the handle still reads the counters.

mod common;

use std::convert::Infallible;
use std::path::Path;
use std::time::{Duration, Instant};

use replayguard::kafka::{
    GuardOptions, GuardedConsumer, GuardedPipeline, OutputRecord, StatsHandle,
};
use replayguard_testkit::{
    InProcessBroker, KafkaBroker, TestResult, drop_bounded, produce_integers,
};

/// The tests count librdkafka's threads in this process, so they run one
/// at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// librdkafka's threads in this process (each client's own, and the
/// in-process broker's), by their names.
fn librdkafka_threads() -> TestResult<usize> {
    let mut n = 0;
    for task in std::fs::read_dir("/proc/self/task")? {
        let comm = std::fs::read_to_string(task?.path().join("comm")).unwrap_or_default();
        if comm.starts_with("rdk:") {
            n += 1;
        }
    }
    Ok(n)
}

/// The options' timeout, which bounds a drop.
const TIMEOUT: Duration = Duration::from_secs(3);

/// Far above the timeout: an unbounded drop fails the test instead of
/// hanging it.
const LIMIT: Duration = Duration::from_secs(30);

fn options() -> GuardOptions {
    GuardOptions::default()
        .timeout(TIMEOUT)
        .checkpoint_interval(Duration::from_secs(3600))
        .stop_at_end(true)
}

async fn consumer(
    broker: &KafkaBroker,
    group: &str,
    state: &Path,
) -> replayguard::Result<GuardedConsumer> {
    let mut cfg = broker.client_config();
    cfg.set("group.id", group);
    GuardedConsumer::builder(cfg, state)
        .topic("in")
        .options(options())
        .build()
        .await
}

async fn pipeline(broker: &KafkaBroker, state: &Path) -> replayguard::Result<GuardedPipeline> {
    let mut cfg = broker.client_config();
    cfg.set("group.id", "copiers");
    pipeline_from(cfg, state).await
}

async fn pipeline_from(
    cfg: rdkafka::ClientConfig,
    state: &Path,
) -> replayguard::Result<GuardedPipeline> {
    GuardedPipeline::builder(cfg, state)
        .input("in")
        .output("out")
        .options(options())
        .build()
        .await
}

async fn copy(m: rdkafka::message::OwnedMessage) -> Result<Vec<OutputRecord>, Infallible> {
    Ok(vec![OutputRecord::copy_of(&m)])
}

/// Drops `value` (off the test's thread, failing past [`LIMIT`]) and
/// returns how long that took.
fn timed_drop<T: Send + 'static>(value: T, what: &str) -> TestResult<Duration> {
    let started = Instant::now();
    drop_bounded(value, what, LIMIT)?;
    Ok(started.elapsed())
}

/// Opens again with `open` once a close left in the background has let the
/// state folder go (within [`LIMIT`]).
async fn once_free<T>(open: impl AsyncFn() -> replayguard::Result<T>) -> TestResult<T> {
    let started = Instant::now();
    loop {
        match open().await {
            Ok(c) => return Ok(c),
            Err(replayguard::Error::InUse { .. }) if started.elapsed() < LIMIT => {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => return Err(e.into()),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drop_without_close_is_bounded_and_closes_the_state() -> TestResult {
    let _serial = SERIAL.lock().await;
    let broker = KafkaBroker::start(&[("in", 2), ("out", 2)])?;
    produce_integers(&broker.bootstrap(), "in", 1..=100)?;
    let (live, consumed, copied) = (
        tempfile::tempdir()?,
        tempfile::tempdir()?,
        tempfile::tempdir()?,
    );

    // The broker answers: the drop has closed the folder when it returns.
    let c = consumer(&broker, "live", live.path()).await?;
    assert_eq!(common::drain(&c).await?, 100);
    let took = timed_drop(c, "a consumer, the broker answering")?;
    println!("dropped a consumer in {took:?} while the broker answered");
    let again = consumer(&broker, "live", live.path()).await?;
    drop_bounded(again, "the reopened consumer", LIMIT)?;

    // The broker is frozen: each drop returns within the timeout and a
    // margin.
    let c = consumer(&broker, "frozen", consumed.path()).await?;
    assert_eq!(common::drain(&c).await?, 100);
    let mut p = pipeline(&broker, copied.path()).await?;
    p.run(copy).await?;
    broker.pause()?;
    let margin = TIMEOUT + Duration::from_secs(5);
    let took = timed_drop(c, "a consumer, the broker frozen");
    let took_p = timed_drop(p, "a pipeline, the broker frozen");
    broker.resume()?;
    let (took, took_p) = (took?, took_p?);
    println!(
        "dropped a consumer in {took:?} and a pipeline in {took_p:?} while the broker was frozen"
    );
    assert!(
        took < margin && took_p < margin,
        "a drop on a frozen broker took {took:?} (consumer) and {took_p:?} (pipeline), past the timeout of {TIMEOUT:?} and a margin"
    );

    // Thawed: the closes left in the background end, and the folders are
    // free again.
    let c = once_free(async || consumer(&broker, "frozen", consumed.path()).await).await?;
    drop_bounded(c, "the consumer reopened after the thaw", LIMIT)?;
    let p = once_free(async || pipeline(&broker, copied.path()).await).await?;
    drop_bounded(p, "the pipeline reopened after the thaw", LIMIT)?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stats_handle_kept_after_close_keeps_neither_the_folder_nor_the_clients() -> TestResult {
    let broker = InProcessBroker::start(&[("in", 2), ("out", 2)])?;
    broker
        .produce("in", &(1..=100).collect::<Vec<_>>(), 2)
        .await?;
    let _serial = SERIAL.lock().await;
    let before = librdkafka_threads()?;
    let state = tempfile::tempdir()?;
    let mut p = pipeline_from(broker.consumer_config("copiers"), state.path()).await?;
    p.run(copy).await?;
    let handle: StatsHandle = p.stats_handle();
    assert!(librdkafka_threads()? > before);
    p.close(LIMIT).await?;
    // A client's threads end with its last reference; give them a moment.
    let since = Instant::now();
    while librdkafka_threads()? > before && since.elapsed() < Duration::from_secs(10) {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let left = librdkafka_threads()?;
    assert_eq!(
        left, before,
        "{left} librdkafka threads after close with a stats handle kept, {before} before the pipeline"
    );
    let after = handle.stats();
    assert_eq!(after.records_in, 100);
    assert!(
        after.guard.is_some(),
        "the guard's last counters are gone after close"
    );
    let again = pipeline_from(broker.consumer_config("copiers"), state.path()).await?;
    again.close(LIMIT).await?;
    assert_eq!(handle.stats().outputs, 100);
    Ok(())
}
