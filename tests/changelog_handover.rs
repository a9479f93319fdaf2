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

/// The pipelines' function: a faithful copy.
async fn copy(m: rdkafka::message::OwnedMessage) -> Result<Vec<OutputRecord>, Infallible> {
    Ok(vec![OutputRecord::copy_of(&m)])
}

/// The pipelines' output, read back by confluent-kafka, holds `expected`
/// each once.
fn check_output(broker: &KafkaBroker, expected: std::ops::RangeInclusive<u64>) -> TestResult {
    let out = integers(&read_topic(
        &broker.bootstrap(),
        "orders-copy",
        PyClient::Confluent,
    )?)?;
    check_each_once(&out, expected)
}

/// The error of the first `recv`, which must fail.
async fn first_recv_error(c: &GuardedConsumer) -> TestResult<String> {
    match c.recv().await {
        Err(e) => Ok(e.to_string()),
        Ok(r) => Err(format!("a record was delivered: {r:?}").into()),
    }
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
    let mut a = pipeline(&broker, a_dir.path(), "orders-changelog").await?;
    a.run(copy).await?;
    a.abort();
    drop(a_dir);
    produce_integers(&broker.bootstrap(), "orders", 50..=60)?;
    let mut b = pipeline(&broker, b_dir.path(), "orders-changelog").await?;
    b.run(copy).await?;
    b.close(Duration::from_secs(10)).await?;
    check_output(&broker, 1..=100)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changelog_topic_of_the_wrong_layout_is_refused_by_name() -> TestResult {
    let broker = KafkaBroker::start(&[("events", 3), ("small", 1), ("plain", 3)])?;
    for topic in ["small", "plain"] {
        let dir = tempfile::tempdir()?;
        let e = match consumer(&broker, dir.path(), "layout", Some(topic)).await {
            Ok(_) => return Err(format!("changelog {topic} was accepted").into()),
            Err(e) => e.to_string(),
        };
        assert!(
            e.contains(&format!("changelog topic {topic}")) && e.contains("compact"),
            "{e}"
        );
    }
    // Refused before it would be grown to the input's partitions.
    let small = replayguard_testkit::end_offsets(&broker.bootstrap(), "small")?;
    assert_eq!(small.len(), 1, "the refused topic was changed: {small:?}");
    Ok(())
}

/// A consumer in its own task, acking what it receives into `seen`, until
/// told to stop; then it closes (a clean revoke).
fn spawn_reader(
    c: std::sync::Arc<GuardedConsumer>,
    seen: std::sync::Arc<std::sync::Mutex<Vec<u64>>>,
    stop: std::sync::Arc<tokio::sync::Notify>,
) -> tokio::task::JoinHandle<TestResult> {
    tokio::spawn(async move {
        loop {
            tokio::select! {
                r = c.recv() => {
                    let Some(r) = r? else { continue };
                    let v: u64 = std::str::from_utf8(r.message().payload().unwrap_or_default())?.parse()?;
                    c.ack(&r)?;
                    seen.lock().map_err(|_| "poisoned")?.push(v);
                }
                () = stop.notified() => break,
            }
        }
        let c = std::sync::Arc::into_inner(c).ok_or("the consumer is still shared")?;
        c.close(Duration::from_secs(10)).await?;
        Ok(())
    })
}

async fn wait_for(what: &str, limit: Duration, mut done: impl FnMut() -> bool) -> TestResult {
    let deadline = std::time::Instant::now() + limit;
    while !done() {
        if std::time::Instant::now() > deadline {
            return Err(format!("timed out waiting for {what}").into());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scaling_from_one_instance_to_two_and_back_delivers_each_record_once_despite_resends()
-> TestResult {
    use std::sync::{Arc, Mutex};
    let broker = KafkaBroker::start(&[("events", 4)])?;
    let (a_dir, b_dir) = (tempfile::tempdir()?, tempfile::tempdir()?);
    let opts = || {
        GuardOptions::default()
            .retention_time(Some(Duration::from_secs(3600)))
            .checkpoint_interval(Duration::from_millis(200))
            .changelog("scale-changelog")
    };
    let build = |dir: std::path::PathBuf| {
        let mut cfg = broker.client_config();
        cfg.set("group.id", "scalers");
        GuardedConsumer::builder(cfg, dir)
            .topic("events")
            .options(opts())
            .build()
    };
    let seen = Arc::new(Mutex::new(Vec::new()));
    let count = |seen: &Arc<Mutex<Vec<u64>>>| seen.lock().map_or(0, |v| v.len());
    let a = Arc::new(build(a_dir.path().to_owned()).await?);
    let stop_a = Arc::new(tokio::sync::Notify::new());
    let task_a = spawn_reader(a.clone(), seen.clone(), stop_a.clone());
    produce_integers(&broker.bootstrap(), "events", 1..=100)?;
    wait_for("A to deliver 1..=100", Duration::from_secs(60), || {
        count(&seen) >= 100
    })
    .await?;

    // 1 -> 2: B joins and takes some partitions over from A.
    let b = Arc::new(build(b_dir.path().to_owned()).await?);
    let stop_b = Arc::new(tokio::sync::Notify::new());
    let task_b = spawn_reader(b.clone(), seen.clone(), stop_b.clone());
    wait_for("B to get partitions", Duration::from_secs(60), || {
        !b.assignment().is_empty() && a.assignment().len() < 4
    })
    .await?;
    println!("A holds {:?}, B holds {:?}", a.assignment(), b.assignment());
    drop((a, b));
    // Every record A handled is resent, then new ones follow.
    produce_integers(&broker.bootstrap(), "events", 1..=100)?;
    produce_integers(&broker.bootstrap(), "events", 101..=150)?;
    wait_for("101..=150", Duration::from_secs(60), || count(&seen) >= 150).await?;

    // 2 -> 1: B leaves; A takes its partitions back, and everything both
    // handled is resent.
    stop_b.notify_one();
    task_b.await??;
    produce_integers(&broker.bootstrap(), "events", 1..=150)?;
    produce_integers(&broker.bootstrap(), "events", 151..=160)?;
    wait_for("151..=160", Duration::from_secs(60), || count(&seen) >= 160).await?;
    // Room for a late duplicate to show.
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop_a.notify_one();
    task_a.await??;
    let seen = seen.lock().map_err(|_| "poisoned")?.clone();
    check_each_once(&seen, 1..=160)?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_foreign_record_in_the_changelog_stops_the_restore_naming_where_it_is() -> TestResult {
    let broker = KafkaBroker::start(&[("events", 1)])?;
    produce_integers(&broker.bootstrap(), "events", 1..=10)?;
    let dir = tempfile::tempdir()?;
    let c = consumer(&broker, dir.path(), "foreign", Some("events-changelog")).await?;
    // Something else writes into the changelog.
    produce_integers(&broker.bootstrap(), "events-changelog", 7..=7)?;
    drop(dir);
    c.abort();
    let dir = tempfile::tempdir()?;
    let c = consumer(&broker, dir.path(), "foreign", Some("events-changelog")).await?;
    let e = first_recv_error(&c).await?;
    assert!(
        e.contains("changelog topic events-changelog partition 0 at offset 0")
            && e.contains("something other than replayguard"),
        "{e}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_whose_changelog_records_are_not_acked_stops_and_moves_nothing() -> TestResult
{
    let broker = KafkaBroker::start(&[("events", 1)])?;
    produce_integers(&broker.bootstrap(), "events", 1..=50)?;
    let dir = tempfile::tempdir()?;
    let mut cfg = broker.client_config();
    cfg.set("group.id", "frozen");
    let c = GuardedConsumer::builder(cfg, dir.path())
        .topic("events")
        .options(
            options(Some("frozen-changelog"))
                .checkpoint_interval(Duration::from_secs(3600))
                .timeout(Duration::from_secs(2)),
        )
        .build()
        .await?;
    let got = read_to_end(&c).await?;
    assert_eq!(got.len(), 50);
    c.checkpoint().await?;
    let epoch = c.stats().guard.ok_or("no guard")?.epoch;
    // Acked after that checkpoint (no end reached, so no checkpoint), then
    // the broker stops answering.
    produce_integers(&broker.bootstrap(), "events", 51..=60)?;
    for _ in 51..=60 {
        let r = c.recv().await?.ok_or("the input ended early")?;
        c.ack(&r)?;
    }
    broker.pause()?;
    let e = c.checkpoint().await;
    broker.resume()?;
    let e = match e {
        Ok(()) => return Err("a checkpoint succeeded with the broker frozen".into()),
        Err(e) => e,
    };
    assert_eq!(e.kind(), "changelog", "{e}");
    assert!(e.to_string().contains("frozen-changelog"), "{e}");
    assert!(
        c.checkpoint().await.is_err(),
        "the guard goes on after the failure"
    );
    c.abort();
    // The folder's manifest did not move past what the changelog acked.
    // (`abort` lets go of the folder in the background.)
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let guard = loop {
        match replayguard::Guard::builder(dir.path()).open() {
            Err(replayguard::Error::InUse { .. }) if std::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            other => break other?,
        }
    };
    assert_eq!(
        guard.epoch(),
        epoch,
        "the failed checkpoint moved the manifest"
    );
    Ok(())
}

/// `replayguard consume` killed (SIGKILL) in the middle of a restore, then
/// started again on the same folder: the resends stay filtered, and every
/// new record is printed once.
#[test]
fn a_restore_killed_midway_and_started_again_loses_nothing_and_delivers_no_resend() -> TestResult {
    use std::process::Command;
    let broker = KafkaBroker::start(&[("events", 2)])?;
    let bootstrap = broker.bootstrap();
    produce_integers(&bootstrap, "events", 1..=100)?;
    let consume = |state: &Path| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_replayguard"));
        c.args([
            "consume",
            "--brokers",
            bootstrap.as_str(),
            "--group",
            "killed",
        ])
        .args([
            "--topic",
            "events",
            "--stop-at-end",
            "--retention-time",
            "1h",
        ])
        .args(["--changelog", "killed-changelog", "--state"])
        .arg(state)
        .env_remove("REPLAYGUARD_FAIL_AT");
        c
    };
    let values = |out: &std::process::Output| -> TestResult<Vec<u64>> {
        let mut v: Vec<u64> = std::str::from_utf8(&out.stdout)?
            .lines()
            .map(str::parse)
            .collect::<Result<_, _>>()?;
        v.sort_unstable();
        Ok(v)
    };
    let first = tempfile::tempdir()?;
    let a = replayguard_testkit::run_bounded(&mut consume(first.path()), Duration::from_secs(120))?;
    assert!(a.status.success(), "{}", String::from_utf8_lossy(&a.stderr));
    assert_eq!(values(&a)?, (1..=100).collect::<Vec<_>>());
    drop(first);
    produce_integers(&bootstrap, "events", 50..=60)?;
    produce_integers(&bootstrap, "events", 101..=110)?;
    let second = tempfile::tempdir()?;
    let killed = replayguard_testkit::run_bounded(
        consume(second.path()).env("REPLAYGUARD_FAIL_AT", "kill-mid-restore"),
        Duration::from_secs(120),
    )?;
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(
        killed.status.signal(),
        Some(9),
        "not killed mid-restore: {:?} {}",
        killed.status,
        String::from_utf8_lossy(&killed.stderr)
    );
    assert!(values(&killed)?.is_empty(), "printed before its restore");
    let again =
        replayguard_testkit::run_bounded(&mut consume(second.path()), Duration::from_secs(120))?;
    assert!(
        again.status.success(),
        "{}",
        String::from_utf8_lossy(&again.stderr)
    );
    assert_eq!(values(&again)?, (101..=110).collect::<Vec<_>>());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changelog_deleted_under_a_folder_that_wrote_to_it_is_an_error_not_an_empty_restore()
-> TestResult {
    let broker = KafkaBroker::start(&[("events", 1)])?;
    produce_integers(&broker.bootstrap(), "events", 1..=20)?;
    let dir = tempfile::tempdir()?;
    let c = consumer(&broker, dir.path(), "deleted", Some("gone-changelog")).await?;
    assert_eq!(read_to_end(&c).await?.len(), 20);
    c.close(Duration::from_secs(10)).await?;
    broker.delete_topic("gone-changelog")?;
    // The topic is created anew, empty: the folder knows it wrote more.
    let c = consumer(&broker, dir.path(), "deleted", Some("gone-changelog")).await?;
    let e = first_recv_error(&c).await?;
    assert!(
        e.contains("changelog topic gone-changelog partition 0")
            && e.contains("deleted, recreated or truncated"),
        "{e}"
    );
    Ok(())
}

async fn scaling_pipeline(
    broker: &KafkaBroker,
    state: &Path,
) -> replayguard::Result<GuardedPipeline> {
    let mut cfg = broker.client_config();
    cfg.set("group.id", "scaling-copiers");
    GuardedPipeline::builder(cfg, state)
        .input("orders")
        .output("orders-copy")
        .options(
            GuardOptions::default()
                .retention_time(Some(Duration::from_secs(3600)))
                .checkpoint_interval(Duration::from_millis(200))
                .changelog("orders-changelog"),
        )
        .build()
        .await
}

/// Runs a pipeline until told to stop, then closes it (a clean revoke).
fn spawn_pipeline(
    mut p: GuardedPipeline,
    stop: std::sync::Arc<tokio::sync::Notify>,
) -> tokio::task::JoinHandle<TestResult> {
    tokio::spawn(async move {
        tokio::select! {
            r = p.run(copy) => { r?; }
            () = stop.notified() => {}
        }
        p.close(Duration::from_secs(10)).await?;
        Ok(())
    })
}

fn output_count(broker: &KafkaBroker) -> TestResult<i64> {
    Ok(
        replayguard_testkit::end_offsets(&broker.bootstrap(), "orders-copy")?
            .values()
            .sum(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scaling_pipelines_from_one_to_two_and_back_write_each_record_once_despite_resends()
-> TestResult {
    use std::sync::Arc;
    let broker = KafkaBroker::start(&[("orders", 4), ("orders-copy", 4)])?;
    let (a_dir, b_dir) = (tempfile::tempdir()?, tempfile::tempdir()?);
    let a = scaling_pipeline(&broker, a_dir.path()).await?;
    let stats_a = a.stats_handle();
    let stop_a = Arc::new(tokio::sync::Notify::new());
    let task_a = spawn_pipeline(a, stop_a.clone());
    produce_integers(&broker.bootstrap(), "orders", 1..=100)?;
    wait_for("A to write 1..=100", Duration::from_secs(60), || {
        output_count(&broker).is_ok_and(|n| n >= 100)
    })
    .await?;
    let b = scaling_pipeline(&broker, b_dir.path()).await?;
    let stats_b = b.stats_handle();
    let stop_b = Arc::new(tokio::sync::Notify::new());
    let task_b = spawn_pipeline(b, stop_b.clone());
    // B holds partitions once it reads new records.
    let mut next = 101;
    while stats_b.stats().records_in == 0 {
        if next > 140 {
            return Err("B got no partition".into());
        }
        produce_integers(&broker.bootstrap(), "orders", next..=next)?;
        next += 1;
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    produce_integers(&broker.bootstrap(), "orders", 1..=100)?;
    produce_integers(&broker.bootstrap(), "orders", next..=150)?;
    wait_for("101..=150", Duration::from_secs(60), || {
        output_count(&broker).is_ok_and(|n| n >= 150)
    })
    .await?;
    stop_b.notify_one();
    task_b.await??;
    produce_integers(&broker.bootstrap(), "orders", 1..=150)?;
    produce_integers(&broker.bootstrap(), "orders", 151..=160)?;
    wait_for("151..=160", Duration::from_secs(60), || {
        output_count(&broker).is_ok_and(|n| n >= 160)
    })
    .await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let a = stats_a.stats();
    println!(
        "A read {} inputs, {} of them duplicates",
        a.records_in, a.duplicates
    );
    stop_a.notify_one();
    task_a.await??;
    check_output(&broker, 1..=160)
}

/// What the documentation promises of an ack when the machine is lost:
/// acks before the last checkpoint survive it (their resends are filtered
/// by the next owner), acks since then do not (their records are delivered
/// again), and nothing else is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_machine_loses_exactly_the_acks_since_its_last_checkpoint() -> TestResult {
    let broker = KafkaBroker::start(&[("events", 1)])?;
    produce_integers(&broker.bootstrap(), "events", 1..=50)?;
    let (a_dir, b_dir) = (tempfile::tempdir()?, tempfile::tempdir()?);
    let mut cfg = broker.client_config();
    cfg.set("group.id", "window");
    let build = |dir: std::path::PathBuf| {
        GuardedConsumer::builder(cfg.clone(), dir)
            .topic("events")
            .options(
                options(Some("window-changelog")).checkpoint_interval(Duration::from_secs(3600)),
            )
            .build()
    };
    let a = build(a_dir.path().to_owned()).await?;
    assert_eq!(read_to_end(&a).await?.len(), 50);
    a.checkpoint().await?;
    produce_integers(&broker.bootstrap(), "events", 51..=60)?;
    for _ in 51..=60 {
        let r = a.recv().await?.ok_or("the input ended early")?;
        a.ack(&r)?;
    }
    a.abort();
    drop(a_dir);
    // Resends of records acked before and after that checkpoint.
    produce_integers(&broker.bootstrap(), "events", 1..=5)?;
    produce_integers(&broker.bootstrap(), "events", 55..=56)?;
    let b = build(b_dir.path().to_owned()).await?;
    let mut delivered = read_to_end(&b).await?;
    delivered.sort_unstable();
    assert_eq!(
        delivered,
        (51..=60).collect::<Vec<u64>>(),
        "the acks since the last checkpoint, each once, and nothing else"
    );
    Ok(())
}
