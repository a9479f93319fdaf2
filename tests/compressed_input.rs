//! Input as real producers write it: every codec Kafka offers (zstd, lz4,
//! snappy, gzip, and none), written by confluent-kafka and by kafka-python
//! (two clients that share no code with ours or with each other), is
//! copied by `replayguard pipe` and printed by `replayguard consume`, each
//! record exactly once. On Apache Kafka with both writers; on the mock
//! broker process with confluent-kafka (kafka-python cannot bootstrap
//! against it). And input written in Kafka transactions, committed and
//! aborted, on Apache Kafka: each committed record once, no aborted one,
//! and `--stop-at-end` ends although each partition's log ends with a
//! transaction marker rather than a record; and an output topic that a
//! transactional writer shares, whose log ends with a marker too.

use std::ops::RangeInclusive;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use replayguard_testkit::{
    Broker, KafkaBroker, MockBroker, PyClient, TestResult, WriteOptions, check_each_once, integers,
    read_topic, run_bounded, write_with,
};

const CODECS: [&str; 5] = ["zstd", "lz4", "snappy", "gzip", "none"];
const RECORDS: u64 = 250;

fn replayguard(args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_replayguard"));
    c.args(args).stdin(Stdio::null());
    c
}

/// Writes a topic per codec with `client`, then copies and consumes each.
fn copy_and_consume_every_codec(broker: &dyn Broker, client: PyClient) -> TestResult {
    let bootstrap = broker.servers();
    let state = tempfile::tempdir()?;
    for codec in CODECS {
        let input = format!("{codec}-{client:?}");
        let output = format!("{input}-copy");
        write_with(
            &bootstrap,
            &input,
            1,
            RECORDS,
            &WriteOptions {
                client,
                compression: codec.into(),
                ..WriteOptions::default()
            },
        )?;
        copy_and_consume(&bootstrap, &input, &output, state.path(), 1..=RECORDS)
            .map_err(|e| format!("{codec} written by {client:?}: {e}"))?;
    }
    Ok(())
}

/// Copies `input` into `output` with `pipe --stop-at-end` and prints it
/// with `consume --stop-at-end`, each bounded in time, and checks that
/// both hold each of `expected` once and nothing else.
fn copy_and_consume(
    bootstrap: &str,
    input: &str,
    output: &str,
    state: &Path,
    expected: RangeInclusive<u64>,
) -> TestResult {
    let folder = |command: &str| {
        state
            .join(format!("{command}-{input}"))
            .display()
            .to_string()
    };
    run_to_end(&[
        "pipe",
        "--brokers",
        bootstrap,
        "--group",
        &format!("copy-{input}"),
        "--input",
        input,
        "--output",
        output,
        "--state",
        &folder("pipe"),
    ])?;
    let copied = integers(&read_topic(bootstrap, output, PyClient::Confluent)?)?;
    check_each_once(&copied, expected.clone()).map_err(|e| format!("pipe: {e}"))?;
    let printed = run_to_end(&[
        "consume",
        "--brokers",
        bootstrap,
        "--group",
        &format!("read-{input}"),
        "--topic",
        input,
        "--state",
        &folder("consume"),
    ])?;
    let printed: Vec<u64> = printed.lines().map(str::parse).collect::<Result<_, _>>()?;
    check_each_once(&printed, expected).map_err(|e| format!("consume: {e}"))?;
    Ok(())
}

/// Runs `replayguard ARGS --stop-at-end`, within two minutes, and returns
/// what it printed; an error if it failed or did not end.
fn run_to_end(args: &[&str]) -> TestResult<String> {
    let mut command = replayguard(args);
    command.arg("--stop-at-end");
    let out = run_bounded(&mut command, Duration::from_secs(120))?;
    if !out.status.success() {
        return Err(format!(
            "{} failed ({}): {}",
            args[0],
            out.status,
            String::from_utf8_lossy(&out.stderr)
        )
        .into());
    }
    Ok(String::from_utf8(out.stdout)?)
}

fn topics() -> Vec<(String, i32)> {
    let mut topics = Vec::new();
    for client in PyClient::BOTH {
        for codec in CODECS {
            topics.push((format!("{codec}-{client:?}"), 2));
            topics.push((format!("{codec}-{client:?}-copy"), 2));
        }
    }
    topics
}

#[test]
fn on_kafka_every_codec_from_two_independent_writers_is_copied_and_consumed_exactly_once()
-> TestResult {
    let topics = topics();
    let named: Vec<(&str, i32)> = topics.iter().map(|(t, p)| (t.as_str(), *p)).collect();
    let broker = KafkaBroker::start(&named)?;
    for client in PyClient::BOTH {
        copy_and_consume_every_codec(&broker, client)?;
    }
    Ok(())
}

#[test]
fn on_kafka_input_written_in_transactions_is_copied_and_consumed_exactly_once_to_its_end()
-> TestResult {
    const COMMITTED: u64 = 600;
    let broker = KafkaBroker::start(&[
        ("committed", 2),
        ("committed-copy", 2),
        ("aborted", 2),
        ("aborted-copy", 2),
    ])?;
    let bootstrap = broker.servers();
    let state = tempfile::tempdir()?;
    // Committed transactions only, so each log ends with a commit marker;
    // then a committed and an aborted transaction in turn, so it ends with
    // an abort marker after records a reader must not see.
    for (topic, aborted) in [("committed", false), ("aborted", true)] {
        write_with(
            &bootstrap,
            topic,
            1,
            COMMITTED,
            &WriteOptions {
                transactions: 50,
                aborted,
                ..WriteOptions::default()
            },
        )?;
        copy_and_consume(
            &bootstrap,
            topic,
            &format!("{topic}-copy"),
            state.path(),
            1..=COMMITTED,
        )
        .map_err(|e| format!("{topic} transactions: {e}"))?;
    }
    Ok(())
}

#[test]
fn on_kafka_an_output_shared_with_a_transactional_writer_is_reconciled_and_written_once()
-> TestResult {
    let broker = KafkaBroker::start(&[("plain", 2), ("shared", 2)])?;
    let bootstrap = broker.servers();
    // The other writer's transactions leave a commit marker at the end of
    // each partition of the output, where reconciliation reads up to.
    write_with(
        &bootstrap,
        "shared",
        1,
        100,
        &WriteOptions {
            transactions: 50,
            ..WriteOptions::default()
        },
    )?;
    write_with(&bootstrap, "plain", 101, 100, &WriteOptions::default())?;
    let state = tempfile::tempdir()?;
    run_to_end(&[
        "pipe",
        "--brokers",
        &bootstrap,
        "--group",
        "into-shared",
        "--input",
        "plain",
        "--output",
        "shared",
        "--state",
        &state.path().display().to_string(),
    ])?;
    let written = integers(&read_topic(&bootstrap, "shared", PyClient::Confluent)?)?;
    check_each_once(&written, 1..=200)
}

#[test]
fn on_the_mock_every_codec_is_copied_and_consumed_exactly_once() -> TestResult {
    let topics = topics();
    let named: Vec<(&str, i32)> = topics.iter().map(|(t, p)| (t.as_str(), *p)).collect();
    let broker = MockBroker::start(&named)?;
    copy_and_consume_every_codec(&broker, PyClient::Confluent)
}
