//! The crash window between an output's ack and its input's identity
//! reaching disk: a fault point fails the pipeline right after the broker
//! acks an output. Without output reconciliation the restart writes that
//! output again; with it, it does not.

use std::convert::Infallible;
use std::path::Path;
use std::time::Duration;

use replayguard::kafka::{GuardOptions, GuardedPipeline, OutputRecord};
use replayguard_testkit::{InProcessBroker as Broker, TestResult, dups_and_missing};

async fn run(
    broker: &Broker,
    state: &Path,
    reconcile: bool,
) -> TestResult<replayguard::Result<()>> {
    let mut p = GuardedPipeline::builder(broker.consumer_config("copy"), state)
        .input("in")
        .output("out")
        .reconcile_output(reconcile)
        .options(
            GuardOptions::default()
                .checkpoint_interval(Duration::from_millis(200))
                .stop_at_end(true),
        )
        .build()
        .await?;
    let r = p
        .run(|m| async move { Ok::<_, Infallible>(vec![OutputRecord::copy_of(&m)]) })
        .await
        .map(|_| ());
    if r.is_err() {
        p.abort();
    } else {
        tokio::task::spawn_blocking(move || drop(p)).await?;
    }
    Ok(r)
}

/// Returns the output after: a clean run over 1..=100, a run over
/// 101..=200 that dies right after its first ack, and a clean restart.
async fn scenario(reconcile: bool) -> TestResult<Vec<u64>> {
    let broker = Broker::start(&[("in", 1), ("out", 1)])?;
    let dir = tempfile::tempdir()?;
    broker
        .produce("in", &(1..=100).collect::<Vec<_>>(), 1)
        .await?;
    run(&broker, dir.path(), reconcile).await??;
    broker
        .produce("in", &(101..=200).collect::<Vec<_>>(), 1)
        .await?;
    // SAFETY of the env change: this binary has one test, so no other
    // thread reads the variable concurrently.
    unsafe { std::env::set_var("REPLAYGUARD_FAIL_AT", "after-ack") };
    let crashed = run(&broker, dir.path(), reconcile).await?;
    unsafe { std::env::remove_var("REPLAYGUARD_FAIL_AT") };
    let err = crashed.err().ok_or("the fault point did not fire")?;
    assert!(
        err.to_string().contains("injected crash after the ack"),
        "unexpected error: {err}"
    );
    run(&broker, dir.path(), reconcile).await??;
    broker.values("out", 1)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconciliation_closes_the_ack_to_disk_window() -> TestResult {
    let without = scenario(false).await?;
    let (dups, missing) = dups_and_missing(&without, 1..=200);
    assert!(
        missing.is_empty(),
        "lost inputs without reconciliation: {missing:?}"
    );
    assert!(
        dups.contains(&101),
        "without reconciliation the acked output 101 is written again; dups: {dups:?}"
    );

    let with = scenario(true).await?;
    let (dups, missing) = dups_and_missing(&with, 1..=200);
    assert!(dups.is_empty(), "duplicates with reconciliation: {dups:?}");
    assert!(
        missing.is_empty(),
        "lost inputs with reconciliation: {missing:?}"
    );
    assert_eq!(with, (1..=200).collect::<Vec<_>>());
    Ok(())
}
