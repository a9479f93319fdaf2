//! G1 on librdkafka's in-process mock cluster: a guarded pipeline that
//! "crashes" (its task is dropped with no checkpoint) and restarts still
//! writes every input exactly once; the at-least-once baseline does not.

use std::convert::Infallible;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use futures::FutureExt;

use replayguard::kafka::baseline::Baseline;
use replayguard::kafka::{GuardOptions, GuardedPipeline, OutputRecord};
use replayguard_testkit::{InProcessBroker as Broker, TestResult, dups_and_missing};

/// Runs one pipeline incarnation. With `crash_after`, drops it with no
/// checkpoint once that many inputs were processed; otherwise runs to the
/// end of the input.
async fn run_once(
    broker: &Broker,
    state: &Path,
    baseline: Option<Baseline>,
    reconcile: bool,
    crash_after: Option<u64>,
) -> TestResult<u64> {
    run_concurrently(broker, state, baseline, reconcile, crash_after, 1).await
}

/// As [`run_once`], with up to `concurrency` inputs processed at a time;
/// each waits a time of its own, so they finish out of order.
async fn run_concurrently(
    broker: &Broker,
    state: &Path,
    baseline: Option<Baseline>,
    reconcile: bool,
    crash_after: Option<u64>,
    concurrency: usize,
) -> TestResult<u64> {
    let mut builder = GuardedPipeline::builder(broker.consumer_config("copy"), state)
        .input("in")
        .output("out")
        .reconcile_output(reconcile)
        .options(
            GuardOptions::default()
                .checkpoint_interval(Duration::from_millis(150))
                .stop_at_end(crash_after.is_none()),
        );
    if let Some(b) = baseline {
        builder = builder.baseline(b);
    }
    let mut p = builder.build().await?;
    let seen = Arc::new(AtomicU64::new(0));
    let counter = seen.clone();
    let f = move |m: rdkafka::message::OwnedMessage| {
        let counter = counter.clone();
        async move {
            let n = counter.fetch_add(1, Ordering::SeqCst);
            // Slow enough that a crash lands between checkpoints; uneven,
            // so that concurrent inputs finish out of order.
            let wait = if concurrency > 1 {
                100 + (n * 7919) % 2000
            } else {
                500
            };
            tokio::time::sleep(Duration::from_micros(wait)).await;
            Ok::<_, Infallible>(vec![OutputRecord::copy_of(&m)])
        }
    };
    match crash_after {
        None => {
            p.run_concurrent(concurrency, f).await?;
        }
        Some(n) => {
            let watch = seen.clone();
            let crash = async move {
                while watch.load(Ordering::SeqCst) < n {
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
            };
            tokio::select! {
                r = p.run_concurrent(concurrency, f) => { r?; }
                () = crash => {}
            }
        }
    }
    let n = seen.load(Ordering::SeqCst);
    if crash_after.is_some() {
        // A crash: nothing is flushed or checkpointed on the way out.
        p.abort();
    } else {
        p.close(Duration::from_secs(30)).await?;
    }
    Ok(n)
}

async fn crash_and_restart(mode: Option<Baseline>, reconcile: bool) -> TestResult<Vec<u64>> {
    let broker = Broker::start(&[("in", 1), ("out", 1)])?;
    let input: Vec<u64> = (1..=2000).collect();
    broker.produce("in", &input, 1).await?;
    let dir = tempfile::tempdir()?;
    for crash_after in [400, 500, 600] {
        run_once(&broker, dir.path(), mode, reconcile, Some(crash_after)).await?;
    }
    run_once(&broker, dir.path(), mode, reconcile, None).await?;
    broker.values("out", 1)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guarded_pipeline_writes_each_input_once_across_crashes() -> TestResult {
    let _ = tracing_subscriber::fmt()
        .with_env_filter("replayguard=debug")
        .with_test_writer()
        .try_init();
    let out = crash_and_restart(None, true).await?;
    let (dups, missing) = dups_and_missing(&out, 1..=2000);
    assert!(dups.is_empty(), "duplicates in the output: {dups:?}");
    assert!(
        missing.is_empty(),
        "inputs missing from the output: {missing:?}"
    );
    assert_eq!(
        out,
        (1..=2000).collect::<Vec<_>>(),
        "one partition keeps input order"
    );
    Ok(())
}

/// Sixteen inputs at a time, finishing out of order, across crashes: each
/// input still appears once, and each partition's outputs keep its input
/// order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_processing_writes_each_input_once_in_partition_order_across_crashes()
-> TestResult {
    const PARTITIONS: i32 = 3;
    let broker = Broker::start(&[("in", PARTITIONS), ("out", PARTITIONS)])?;
    let input: Vec<u64> = (1..=3000).collect();
    broker.produce("in", &input, PARTITIONS).await?;
    let dir = tempfile::tempdir()?;
    for crash_after in [500, 700, 900] {
        run_concurrently(&broker, dir.path(), None, true, Some(crash_after), 16).await?;
    }
    run_concurrently(&broker, dir.path(), None, true, None, 16).await?;
    let out = broker.read_all("out", PARTITIONS)?;
    let values: Vec<u64> = out
        .iter()
        .map(|(_, v, _)| v.parse::<u64>())
        .collect::<Result<_, _>>()?;
    let (dups, missing) = dups_and_missing(&values, 1..=3000);
    assert!(dups.is_empty(), "duplicates in the output: {dups:?}");
    assert!(
        missing.is_empty(),
        "inputs missing from the output: {missing:?}"
    );
    // Input i went to partition (i - 1) % 3 in increasing order; the
    // output copies each input to its own partition number.
    for p in 0..PARTITIONS {
        let got: Vec<u64> = out
            .iter()
            .filter(|(q, _, _)| *q == p)
            .map(|(_, v, _)| v.parse::<u64>())
            .collect::<Result<_, _>>()?;
        let want: Vec<u64> = input
            .iter()
            .copied()
            .filter(|i| ((i - 1) % PARTITIONS as u64) as i32 == p)
            .collect();
        assert_eq!(got, want, "partition {p} keeps its input order");
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_least_once_baseline_duplicates_after_crashes() -> TestResult {
    let out = crash_and_restart(Some(Baseline::AtLeastOnce), false).await?;
    let (dups, missing) = dups_and_missing(&out, 1..=2000);
    assert!(
        missing.is_empty(),
        "the baseline must not lose inputs: {missing:?}"
    );
    assert!(
        !dups.is_empty(),
        "the baseline should replay some inputs after a crash"
    );
    Ok(())
}

/// The transactional baseline without crashes: every input once for a
/// `read_committed` reader. Across crashes the mock cluster shows the
/// records of the crashed producer's open transaction to `read_committed`
/// readers (seen here: exactly the inputs in flight at each crash), a gap of
/// the broker, so crashes are not part of this test.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transactional_baseline_copies_each_input_once() -> TestResult {
    let broker = Broker::start(&[("in", 1), ("out", 1)])?;
    broker
        .produce("in", &(1..=500).collect::<Vec<_>>(), 1)
        .await?;
    let dir = tempfile::tempdir()?;
    run_once(
        &broker,
        dir.path(),
        Some(Baseline::Transactional),
        false,
        None,
    )
    .await?;
    assert_eq!(broker.values("out", 1)?, (1..=500).collect::<Vec<_>>());
    Ok(())
}

/// A crash before the first checkpoint leaves no position at all; the
/// restart reads the output back, and a checkpoint taken before the replay
/// reaches those inputs must keep them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn identities_read_back_survive_checkpoints_before_any_position() -> TestResult {
    let broker = Broker::start(&[("in", 1), ("out", 1)])?;
    broker
        .produce("in", &(1..=200).collect::<Vec<_>>(), 1)
        .await?;
    let dir = tempfile::tempdir()?;
    let copy = |m: rdkafka::message::OwnedMessage| async move {
        Ok::<_, Infallible>(vec![OutputRecord::copy_of(&m)])
    };
    let mut first = GuardedPipeline::builder(broker.consumer_config("copy"), dir.path())
        .input("in")
        .output("out")
        .options(GuardOptions::default().checkpoint_interval(Duration::from_secs(3600)))
        .build()
        .await?;
    let all_out = async {
        while broker.read_all("out", 1).map(|v| v.len()).unwrap_or(0) < 200 {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    tokio::select! {
        r = first.run(copy) => { r?; }
        () = tokio::time::timeout(Duration::from_secs(60), all_out).map(|_| ()) => {}
    }
    first.abort();
    let mut second = GuardedPipeline::builder(broker.consumer_config("copy"), dir.path())
        .input("in")
        .output("out")
        .options(
            GuardOptions::default()
                .checkpoint_interval(Duration::from_millis(10))
                .stop_at_end(true),
        )
        .build()
        .await?;
    let stats = second.run(copy).await?;
    tokio::task::spawn_blocking(move || drop(second)).await?;
    assert_eq!(broker.values("out", 1)?, (1..=200).collect::<Vec<_>>());
    assert_eq!(
        stats.duplicates, 200,
        "every replayed input is filtered: {stats:?}"
    );
    Ok(())
}

/// Upstream duplicates right behind their first copy usually arrive while
/// that copy's output is still in flight; they are filtered all the same.
/// (A retention of many epochs keeps a checkpoint between two copies from
/// letting the second through, which the default retention would.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adjacent_upstream_duplicates_are_filtered_while_in_flight() -> TestResult {
    let broker = Broker::start(&[("in", 1), ("out", 1)])?;
    broker
        .produce("in", &[1, 2, 2, 3, 3, 3, 4, 2, 5], 1)
        .await?;
    let dir = tempfile::tempdir()?;
    let mut p = GuardedPipeline::builder(broker.consumer_config("copy"), dir.path())
        .input("in")
        .output("out")
        .options(
            GuardOptions::default()
                .retention_epochs(1000)
                .checkpoint_interval(Duration::from_millis(150))
                .stop_at_end(true),
        )
        .build()
        .await?;
    let stats = p
        .run(|m| async move { Ok::<_, Infallible>(vec![OutputRecord::copy_of(&m)]) })
        .await?;
    tokio::task::spawn_blocking(move || drop(p)).await?;
    assert_eq!(broker.values("out", 1)?, vec![1, 2, 3, 4, 5]);
    assert_eq!(stats.duplicates, 4);
    Ok(())
}
