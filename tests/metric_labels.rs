//! Two guarded consumers in one process, each with labels of its own
//! (`GuardOptions::metric_labels`), keep their metric series apart: the
//! counters and gauges each shows under its labels are its own, read from
//! the Prometheus exporter the command line uses.

mod common;

use std::path::Path;
use std::time::Duration;

use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use replayguard::kafka::{GuardOptions, GuardedConsumer};
use replayguard_testkit::{InProcessBroker as Broker, TestResult};

async fn consumer(broker: &Broker, topic: &str, state: &Path) -> TestResult<GuardedConsumer> {
    let c = GuardedConsumer::builder(broker.consumer_config(&format!("group-{topic}")), state)
        .topic(topic)
        .options(
            GuardOptions::default()
                .checkpoint_interval(Duration::from_secs(3600))
                .retention_epochs(1)
                .stop_at_end(true)
                .metric_labels([("guard", topic), ("zone", "test")]),
        )
        .build()
        .await?;
    Ok(c)
}

/// The value of the series `name{labels}` (labels as the exporter renders
/// them: in the order given), or an error listing what is there.
fn value(handle: &PrometheusHandle, name: &str, labels: &str) -> TestResult<f64> {
    let text = handle.render();
    let series = format!("{name}{{{labels}}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&series))
        .map(|v| v.trim().parse::<f64>())
        .transpose()?
        .ok_or_else(|| {
            let seen: Vec<&str> = text.lines().filter(|l| l.starts_with(name)).collect();
            format!("no series {series:?}; {name} has: {seen:?}").into()
        })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_consumers_in_one_process_keep_their_series_apart() -> TestResult {
    let handle = PrometheusBuilder::new().install_recorder()?;
    replayguard::kafka::describe_metrics();
    let broker = Broker::start(&[("a", 1), ("b", 1)])?;
    broker
        .produce("a", &(1..=30).collect::<Vec<_>>(), 1)
        .await?;
    // b repeats 10 of its records: resends at new offsets.
    let mut b_input: Vec<u64> = (1..=50).collect();
    b_input.extend(1..=10);
    broker.produce("b", &b_input, 1).await?;
    let (dir_a, dir_b) = (tempfile::tempdir()?, tempfile::tempdir()?);
    let a = consumer(&broker, "a", dir_a.path()).await?;
    let b = consumer(&broker, "b", dir_b.path()).await?;
    assert_eq!(common::drain(&a).await?, 30);
    assert_eq!(common::drain(&b).await?, 50);
    a.checkpoint().await?;
    b.checkpoint().await?;

    let (la, lb) = (r#"guard="a",zone="test""#, r#"guard="b",zone="test""#);
    for (labels, records, duplicates, live) in [(la, 30.0, 0.0, 30.0), (lb, 60.0, 10.0, 50.0)] {
        let at = |name: &str| value(&handle, name, labels);
        assert_eq!(at("replayguard_records_in_total")?, records, "{labels}");
        assert_eq!(at("replayguard_live_fingerprints")?, live, "{labels}");
        assert_eq!(at("replayguard_checkpoints_total")?, 1.0, "{labels}");
        assert_eq!(at("replayguard_assigned_partitions")?, 1.0, "{labels}");
        let content = value(
            &handle,
            "replayguard_duplicates_total",
            &format!(r#"{labels},reason="content""#),
        )?;
        assert_eq!(content, duplicates, "{labels}");
    }
    // Nothing was emitted without the labels.
    let text = handle.render();
    let bare: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("replayguard_") && !l.contains("zone=\"test\""))
        .collect();
    assert!(bare.is_empty(), "series without the labels: {bare:?}");

    a.close(Duration::from_secs(30)).await?;
    b.close(Duration::from_secs(30)).await?;
    Ok(())
}
