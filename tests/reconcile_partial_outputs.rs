//! An input with several outputs, cut short by a crash after its first
//! output: reconciliation must not count it as handled, and its replay must
//! write only the outputs that are missing.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use replayguard::kafka::{GuardOptions, GuardedPipeline, OutputRecord};
use replayguard_testkit::{InProcessBroker as Broker, TestResult};

/// Three outputs per input: "v-a", "v-b", "v-c".
async fn run(broker: &Broker, state: &Path) -> TestResult<replayguard::Result<()>> {
    let mut p = GuardedPipeline::builder(broker.consumer_config("fan"), state)
        .input("in")
        .output("out")
        .options(
            GuardOptions::default()
                .checkpoint_interval(Duration::from_millis(200))
                .stop_at_end(true),
        )
        .build()
        .await?;
    let r = p
        .run(|m| async move {
            use rdkafka::Message;
            let v = String::from_utf8_lossy(m.payload().unwrap_or_default()).into_owned();
            let outs = ["a", "b", "c"]
                .iter()
                .map(|s| OutputRecord::value(format!("{v}-{s}")))
                .collect();
            Ok::<_, std::convert::Infallible>(outs)
        })
        .await
        .map(|_| ());
    if r.is_err() {
        // Let the first output's delivery land, as it would have before a
        // real crash, then die.
        tokio::time::sleep(Duration::from_secs(1)).await;
        p.abort();
    } else {
        tokio::task::spawn_blocking(move || drop(p)).await?;
    }
    Ok(r)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_between_outputs_of_one_input_loses_and_repeats_nothing() -> TestResult {
    let broker = Broker::start(&[("in", 1), ("out", 1)])?;
    let dir = tempfile::tempdir()?;
    broker
        .produce("in", &(1..=20).collect::<Vec<_>>(), 1)
        .await?;
    // SAFETY: the only test in this binary; nothing reads the variable
    // concurrently.
    unsafe { std::env::set_var("REPLAYGUARD_FAIL_AT", "mid-outputs") };
    let crashed = run(&broker, dir.path()).await?;
    unsafe { std::env::remove_var("REPLAYGUARD_FAIL_AT") };
    let err = crashed.err().ok_or("the fault point did not fire")?;
    assert!(
        err.to_string().contains("between the outputs"),
        "unexpected error: {err}"
    );
    let before = broker.read_all("out", 1)?;
    assert!(
        !before.is_empty(),
        "the first output of the first input should have landed"
    );
    run(&broker, dir.path()).await??;
    let mut counts: BTreeMap<String, u32> = BTreeMap::new();
    for (_, v, _) in broker.read_all("out", 1)? {
        *counts.entry(v).or_default() += 1;
    }
    let mut expected: BTreeMap<String, u32> = BTreeMap::new();
    for v in 1..=20 {
        for s in ["a", "b", "c"] {
            expected.insert(format!("{v}-{s}"), 1);
        }
    }
    assert_eq!(counts, expected, "each output of each input exactly once");
    Ok(())
}
