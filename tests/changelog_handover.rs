//! G6 on Apache Kafka: with a changelog topic, identities outlive the
//! machine that handled them. An instance handles 1..=100 and its machine
//! is lost (its state folder with it); a second instance with an empty
//! folder takes the partitions over while the upstream resends 50..=60 at
//! new offsets. With the changelog it delivers none of them; without it,
//! all 11 (the control, which shows the test can see the hole). The
//! pipeline's output is read back with confluent-kafka.

use std::convert::Infallible;
use std::path::Path;
use std::time::Duration;

use rdkafka::Message;
use replayguard::kafka::{GuardOptions, GuardedConsumer, GuardedPipeline, OutputRecord};
use replayguard_testkit::{
    KafkaBroker, PyClient, TestResult, check_each_once, integers, produce_integers, read_topic,
};

fn options(changelog: Option<&str>) -> GuardOptions {
    let o = GuardOptions::default()
        .retention_time(Some(Duration::from_secs(3600)))
        .checkpoint_interval(Duration::from_millis(200))
        .stop_at_end(true);
    match changelog {
        Some(t) => o.changelog(t),
        None => o,
    }
}

async fn consumer(
    broker: &KafkaBroker,
    state: &Path,
    group: &str,
    changelog: Option<&str>,
) -> replayguard::Result<GuardedConsumer> {
    let mut cfg = broker.client_config();
    cfg.set("group.id", group);
    GuardedConsumer::builder(cfg, state)
        .topic("events")
        .options(options(changelog))
        .build()
        .await
}

/// Reads to the end, acking each record, and returns the values.
async fn read_to_end(c: &GuardedConsumer) -> TestResult<Vec<u64>> {
    let mut out = Vec::new();
    while let Some(r) = c.recv().await? {
        out.push(std::str::from_utf8(r.message().payload().unwrap_or_default())?.parse()?);
        c.ack(&r)?;
    }
    Ok(out)
}

/// The scenario for a guarded consumer: what the second instance delivers.
async fn consumer_handover(
    broker: &KafkaBroker,
    group: &str,
    changelog: Option<&str>,
) -> TestResult<Vec<u64>> {
    let (a_dir, b_dir) = (tempfile::tempdir()?, tempfile::tempdir()?);
    let a = consumer(broker, a_dir.path(), group, changelog).await?;
    let mut first = read_to_end(&a).await?;
    first.sort_unstable();
    assert_eq!(first, (1..=100).collect::<Vec<_>>());
    a.checkpoint().await?;
    // The machine is lost: no close, no revoke, and its folder is gone.
    a.abort();
    drop(a_dir);
    produce_integers(&broker.bootstrap(), "events", 50..=60)?;
    let b = consumer(broker, b_dir.path(), group, changelog).await?;
    let delivered = read_to_end(&b).await?;
    b.close(Duration::from_secs(10)).await?;
    Ok(delivered)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_on_an_empty_folder_takes_identities_over_from_the_changelog() -> TestResult {
    let broker = KafkaBroker::start(&[("events", 2)])?;
    produce_integers(&broker.bootstrap(), "events", 1..=100)?;
    let with = consumer_handover(&broker, "with-changelog", Some("events-changelog")).await?;
    assert!(
        with.is_empty(),
        "with the changelog, the new owner delivered resends {with:?}"
    );
    // The control, on the same topic with a new group: the 11 resends
    // (written once more) pass without the changelog.
    // The first instance filters the first round as resends of its own.
    let mut without = consumer_handover(&broker, "without-changelog", None).await?;
    without.sort_unstable();
    assert_eq!(
        without,
        (50..=60).collect::<Vec<u64>>(),
        "without the changelog the new owner should deliver the resends"
    );
    Ok(())
}

async fn pipeline(
    broker: &KafkaBroker,
    state: &Path,
    changelog: &str,
) -> replayguard::Result<GuardedPipeline> {
    let mut cfg = broker.client_config();
    cfg.set("group.id", "copiers");
    GuardedPipeline::builder(cfg, state)
        .input("orders")
        .output("orders-copy")
        .options(options(Some(changelog)))
        .build()
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pipeline_on_an_empty_folder_writes_no_resend_handled_by_a_lost_machine() -> TestResult {
    let broker = KafkaBroker::start(&[("orders", 2), ("orders-copy", 2)])?;
    produce_integers(&broker.bootstrap(), "orders", 1..=100)?;
    let (a_dir, b_dir) = (tempfile::tempdir()?, tempfile::tempdir()?);
    let copy = |m: rdkafka::message::OwnedMessage| async move {
        Ok::<_, Infallible>(vec![OutputRecord::copy_of(&m)])
    };
    let mut a = pipeline(&broker, a_dir.path(), "orders-changelog").await?;
    a.run(copy).await?;
    a.abort();
    drop(a_dir);
    produce_integers(&broker.bootstrap(), "orders", 50..=60)?;
    let mut b = pipeline(&broker, b_dir.path(), "orders-changelog").await?;
    b.run(copy).await?;
    b.close(Duration::from_secs(10)).await?;
    let out = integers(&read_topic(
        &broker.bootstrap(),
        "orders-copy",
        PyClient::Confluent,
    )?)?;
    check_each_once(&out, 1..=100)?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changelog_topic_of_the_wrong_layout_is_refused_by_name() -> TestResult {
    let broker = KafkaBroker::start(&[("events", 3), ("small", 1), ("plain", 3)])?;
    for (topic, says) in [("small", "1 partitions"), ("plain", "compact")] {
        let dir = tempfile::tempdir()?;
        let e = match consumer(&broker, dir.path(), "layout", Some(topic)).await {
            Ok(_) => return Err(format!("changelog {topic} was accepted").into()),
            Err(e) => e.to_string(),
        };
        assert!(
            e.contains(&format!("changelog topic {topic}")) && e.contains(says),
            "{e}"
        );
    }
    Ok(())
}
