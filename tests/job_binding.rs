//! A state folder knows its job (G3, G5). Against Apache Kafka, through the
//! command line and the library:
//!
//! - another job's folder (another group, output or kind) is refused with
//!   status 1 and both jobs named, and nothing is skipped; `--rebind` and
//!   `replayguard reset` are the documented ways out; a re-bind cannot
//!   change the identity;
//! - safe changes are taken: an input added, more partitions on an input;
//!   every record still copied exactly once;
//! - an input that is also the output is a usage error (status 2);
//! - an output or an input topic deleted and recreated below the folder's
//!   offsets stops the run with status 1 and the topic named, never exit 0
//!   with records skipped.
//!
//! Output is read back with confluent-kafka.

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use rdkafka::ClientConfig;
use replayguard::Error;
use replayguard::kafka::{GuardedConsumer, GuardedPipeline};
use replayguard_testkit::{
    KafkaBroker, PyClient, TestResult, check_each_once, integers, produce_integers, read_topic,
    replayguard_bin, run_bounded,
};

fn replayguard(args: &[&str], state: &Path) -> TestResult<Output> {
    let mut c = Command::new(replayguard_bin()?);
    c.args(args).arg("--state").arg(state).stdin(Stdio::null());
    run_bounded(&mut c, Duration::from_secs(120))
}

fn pipe(broker: &KafkaBroker, group: &str, inputs: &[&str], output: &str) -> Vec<String> {
    let mut a: Vec<String> = ["pipe", "--brokers", &broker.bootstrap(), "--group", group]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
    for i in inputs {
        a.extend(["--input".to_owned(), (*i).to_owned()]);
    }
    a.extend([
        "--output".to_owned(),
        output.to_owned(),
        "--stop-at-end".to_owned(),
    ]);
    a
}

fn run(args: &[String], extra: &[&str], state: &Path) -> TestResult<Output> {
    let mut all: Vec<&str> = args.iter().map(String::as_str).collect();
    all.extend_from_slice(extra);
    replayguard(&all, state)
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn values(broker: &KafkaBroker, topic: &str) -> TestResult<Vec<u64>> {
    integers(&read_topic(
        &broker.bootstrap(),
        topic,
        PyClient::Confluent,
    )?)
}

#[test]
fn another_jobs_folder_is_refused_and_the_ways_out_work() -> TestResult {
    let broker = KafkaBroker::start(&[("in", 1), ("out1", 1), ("out2", 1), ("out3", 1)])?;
    produce_integers(&broker.bootstrap(), "in", 1..=100)?;
    let state = tempfile::tempdir()?;
    let first = run(&pipe(&broker, "g1", &["in"], "out1"), &[], state.path())?;
    assert!(first.status.success(), "{}", stderr(&first));
    check_each_once(&values(&broker, "out1")?, 1..=100)?;

    // Another group and output on the same folder: refused, nothing copied.
    let second = run(&pipe(&broker, "g2", &["in"], "out2"), &[], state.path())?;
    assert_eq!(second.status.code(), Some(1), "{}", stderr(&second));
    let e = stderr(&second);
    assert!(
        e.contains("belongs to another job")
            && e.contains("g1")
            && e.contains("g2")
            && e.contains("--rebind"),
        "the error should name both jobs and the way out: {e}"
    );
    assert!(
        values(&broker, "out2")?.is_empty(),
        "the refused run wrote output"
    );

    // A consumer on a pipeline's folder: refused too.
    let consumer = replayguard(
        &[
            "consume",
            "--brokers",
            &broker.bootstrap(),
            "--group",
            "g1",
            "--topic",
            "in",
            "--stop-at-end",
        ],
        state.path(),
    )?;
    assert_eq!(consumer.status.code(), Some(1), "{}", stderr(&consumer));
    assert!(consumer.stdout.is_empty());

    // The identity cannot change, even on purpose.
    let keyed = run(
        &pipe(&broker, "g1", &["in"], "out1"),
        &["--identity", "key", "--rebind"],
        state.path(),
    )?;
    assert_eq!(keyed.status.code(), Some(1), "{}", stderr(&keyed));
    assert!(stderr(&keyed).contains("identity"), "{}", stderr(&keyed));

    // inspect names the job.
    let inspect = replayguard(&["inspect"], state.path())?;
    let shown = String::from_utf8_lossy(&inspect.stdout).into_owned();
    assert!(
        shown.contains("pipeline of group \"g1\"") && shown.contains("\"out1\""),
        "{shown}"
    );

    // --rebind hands the folder over on purpose: its positions come along.
    let rebound = run(
        &pipe(&broker, "g2", &["in"], "out2"),
        &["--rebind"],
        state.path(),
    )?;
    assert!(rebound.status.success(), "{}", stderr(&rebound));
    assert!(
        values(&broker, "out2")?.is_empty(),
        "a re-bound folder keeps its positions"
    );

    // reset empties it (asking first); the next job starts afresh.
    let asked = replayguard(&["reset"], state.path())?;
    assert_eq!(
        asked.status.code(),
        Some(2),
        "reset without --yes: {}",
        stderr(&asked)
    );
    let reset = replayguard(&["reset", "--yes"], state.path())?;
    assert!(reset.status.success(), "{}", stderr(&reset));
    let fresh = run(&pipe(&broker, "g3", &["in"], "out3"), &[], state.path())?;
    assert!(fresh.status.success(), "{}", stderr(&fresh));
    check_each_once(&values(&broker, "out3")?, 1..=100)?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn the_library_refuses_another_jobs_folder_with_a_typed_error() -> TestResult {
    let broker = KafkaBroker::start(&[("in", 1), ("out", 1), ("other", 1)])?;
    let state = tempfile::tempdir()?;
    let config = |group: &str| {
        let mut c = ClientConfig::new();
        c.set("bootstrap.servers", broker.bootstrap())
            .set("group.id", group);
        c
    };
    let p = GuardedPipeline::builder(config("a"), state.path())
        .input("in")
        .output("out")
        .build()
        .await?;
    p.close(Duration::from_secs(30)).await?;
    for r in [
        GuardedPipeline::builder(config("b"), state.path())
            .input("in")
            .output("out")
            .build()
            .await
            .map(drop),
        GuardedPipeline::builder(config("a"), state.path())
            .input("in")
            .output("other")
            .build()
            .await
            .map(drop),
        GuardedConsumer::builder(config("a"), state.path())
            .topic("in")
            .build()
            .await
            .map(drop),
    ] {
        match r {
            Err(Error::JobMismatch { folder, given, .. }) => {
                assert_eq!(folder.group, "a");
                assert_ne!(*folder, *given);
            }
            other => return Err(format!("expected JobMismatch, got {other:?}").into()),
        }
    }
    Ok(())
}

#[test]
fn safe_changes_an_added_input_and_more_partitions_copy_each_record_once() -> TestResult {
    let broker = KafkaBroker::start(&[("a", 1), ("b", 1), ("out", 4)])?;
    let state = tempfile::tempdir()?;
    produce_integers(&broker.bootstrap(), "a", 1..=50)?;
    let out = run(&pipe(&broker, "g", &["a"], "out"), &[], state.path())?;
    assert!(out.status.success(), "{}", stderr(&out));
    // Another input, and a second partition on the first.
    produce_integers(&broker.bootstrap(), "b", 51..=80)?;
    broker.add_partitions("a", 2)?;
    produce_integers(&broker.bootstrap(), "a", 81..=120)?;
    let out = run(&pipe(&broker, "g", &["a", "b"], "out"), &[], state.path())?;
    assert!(out.status.success(), "{}", stderr(&out));
    check_each_once(&values(&broker, "out")?, 1..=120)?;
    Ok(())
}

#[test]
fn an_input_that_is_also_the_output_is_a_usage_error() -> TestResult {
    let broker = KafkaBroker::start(&[("in", 1)])?;
    let state = tempfile::tempdir()?;
    let out = run(&pipe(&broker, "g", &["in"], "in"), &[], state.path())?;
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("both an input and the output"),
        "{}",
        stderr(&out)
    );
    Ok(())
}

#[test]
fn recreated_topics_below_the_folders_offsets_stop_the_run_with_the_topic_named() -> TestResult {
    let broker = KafkaBroker::start(&[("in", 1), ("out", 1)])?;
    let state = tempfile::tempdir()?;
    produce_integers(&broker.bootstrap(), "in", 1..=100)?;
    let out = run(&pipe(&broker, "g", &["in"], "out"), &[], state.path())?;
    assert!(out.status.success(), "{}", stderr(&out));

    // The output deleted and recreated: its offsets start again below
    // what the folder wrote there.
    broker.delete_topic("out")?;
    broker.create_topic("out", 1)?;
    produce_integers(&broker.bootstrap(), "in", 101..=110)?;
    let out = run(&pipe(&broker, "g", &["in"], "out"), &[], state.path())?;
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("out[0] ends at offset 0") && stderr(&out).contains("recreated"),
        "{}",
        stderr(&out)
    );

    // The input deleted and recreated with fewer records than the folder
    // handled: before, they were all skipped and the run exited 0.
    let state = tempfile::tempdir()?;
    let broker = KafkaBroker::start(&[("in", 1), ("out", 1)])?;
    produce_integers(&broker.bootstrap(), "in", 1..=100)?;
    let out = run(&pipe(&broker, "g", &["in"], "out"), &[], state.path())?;
    assert!(out.status.success(), "{}", stderr(&out));
    broker.delete_topic("in")?;
    broker.create_topic("in", 1)?;
    produce_integers(&broker.bootstrap(), "in", 201..=210)?;
    let out = run(&pipe(&broker, "g", &["in"], "out"), &[], state.path())?;
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("in[0] ends at offset 10") && stderr(&out).contains("100"),
        "{}",
        stderr(&out)
    );
    Ok(())
}
