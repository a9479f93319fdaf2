//! Two guarded pipelines in one group, each with its own state folder:
//! partitions move when the second joins and again when the first crashes,
//! and every input still appears exactly once in the output.

use std::convert::Infallible;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use replayguard::kafka::{GuardOptions, GuardedPipeline, OutputRecord};
use replayguard_testkit::{InProcessBroker as Broker, TestResult, dups_and_missing};

const N: u64 = 3000;

async fn pipeline(broker: &Broker, state: PathBuf) -> replayguard::Result<GuardedPipeline> {
    GuardedPipeline::builder(broker.consumer_config("movers"), state)
        .input("in")
        .output("out")
        .options(GuardOptions::default().checkpoint_interval(Duration::from_millis(200)))
        .build()
        .await
}

type Copied = std::pin::Pin<Box<dyn Future<Output = Result<Vec<OutputRecord>, Infallible>> + Send>>;

/// Copies slowly, counting inputs processed.
fn copy(seen: Arc<AtomicU64>) -> impl FnMut(rdkafka::message::OwnedMessage) -> Copied {
    move |m| {
        let seen = seen.clone();
        Box::pin(async move {
            seen.fetch_add(1, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(2)).await;
            Ok(vec![OutputRecord::copy_of(&m)])
        })
    }
}

fn output_len(broker: &Broker) -> TestResult<i64> {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    let c: BaseConsumer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", broker.bootstrap())
        .create()?;
    let mut n = 0;
    for p in 0..3 {
        let (lo, hi) = c.fetch_watermarks("out", p, Duration::from_secs(5))?;
        n += hi - lo;
    }
    Ok(n)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitions_moving_between_instances_keep_output_exactly_once() -> TestResult {
    let broker = Broker::start(&[("in", 3), ("out", 3)])?;
    broker
        .produce("in", &(1..=N).collect::<Vec<_>>(), 3)
        .await?;
    let (dir_a, dir_b) = (tempfile::tempdir()?, tempfile::tempdir()?);

    let seen_a = Arc::new(AtomicU64::new(0));
    let mut a = pipeline(&broker, dir_a.path().to_owned()).await?;
    let watch = seen_a.clone();
    let task_a = tokio::spawn(async move {
        // A runs until it has processed 1500 inputs, then crashes.
        let crash = async move {
            while watch.load(Ordering::SeqCst) < 1500 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        };
        let r = tokio::select! {
            r = a.run(copy(seen_a)) => r.map(|_| ()),
            () = crash => Ok(()),
        };
        a.abort();
        r
    });
    // B joins while A is mid-stream, so partitions move to it.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let seen_b = Arc::new(AtomicU64::new(0));
    let mut b = pipeline(&broker, dir_b.path().to_owned()).await?;
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let task_b = tokio::spawn(async move {
        let r = b
            .run_until(copy(seen_b), async move { drop(stop_rx.await) })
            .await;
        (b, r)
    });
    task_a.await??;
    // B takes over A's partitions after A's session times out.
    let deadline = Instant::now() + Duration::from_secs(90);
    while output_len(&broker)? < N as i64 {
        assert!(
            Instant::now() < deadline,
            "output stalled at {} of {N}",
            output_len(&broker)?
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Give B time to write anything it would (wrongly) write twice.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let _ = stop_tx.send(());
    let (b, r) = task_b.await?;
    r?;
    b.close(Duration::from_secs(30)).await?;

    let out = broker.values("out", 3)?;
    let (dups, missing) = dups_and_missing(&out, 1..=N);
    assert!(dups.is_empty(), "duplicates: {dups:?}");
    assert!(missing.is_empty(), "missing: {missing:?}");
    assert_eq!(out.len() as u64, N);
    Ok(())
}
