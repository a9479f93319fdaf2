//! Input as real producers write it: every codec Kafka offers (zstd, lz4,
//! snappy, gzip, and none), written by confluent-kafka and by kafka-python
//! (two clients that share no code with ours or with each other), is
//! copied by `replayguard pipe` and printed by `replayguard consume`, each
//! record exactly once. On Apache Kafka with both writers; on the mock
//! broker process with confluent-kafka (kafka-python cannot bootstrap
//! against it).

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
        let out = run_bounded(
            &mut replayguard(&[
                "pipe",
                "--brokers",
                &bootstrap,
                "--group",
                &format!("copy-{input}"),
                "--input",
                &input,
                "--output",
                &output,
                "--stop-at-end",
                "--state",
                &state
                    .path()
                    .join(format!("pipe-{input}"))
                    .display()
                    .to_string(),
            ]),
            Duration::from_secs(120),
        )?;
        if !out.status.success() {
            return Err(format!(
                "pipe of {codec} written by {client:?} failed ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            )
            .into());
        }
        let copied = integers(&read_topic(&bootstrap, &output, PyClient::Confluent)?)?;
        check_each_once(&copied, 1..=RECORDS)
            .map_err(|e| format!("pipe, {codec} written by {client:?}: {e}"))?;
        let out = run_bounded(
            &mut replayguard(&[
                "consume",
                "--brokers",
                &bootstrap,
                "--group",
                &format!("read-{input}"),
                "--topic",
                &input,
                "--stop-at-end",
                "--state",
                &state
                    .path()
                    .join(format!("consume-{input}"))
                    .display()
                    .to_string(),
            ]),
            Duration::from_secs(120),
        )?;
        if !out.status.success() {
            return Err(format!(
                "consume of {codec} written by {client:?} failed ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            )
            .into());
        }
        let printed: Vec<u64> = String::from_utf8(out.stdout)?
            .lines()
            .map(str::parse)
            .collect::<Result<_, _>>()?;
        check_each_once(&printed, 1..=RECORDS)
            .map_err(|e| format!("consume, {codec} written by {client:?}: {e}"))?;
    }
    Ok(())
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
fn on_the_mock_every_codec_is_copied_and_consumed_exactly_once() -> TestResult {
    let topics = topics();
    let named: Vec<(&str, i32)> = topics.iter().map(|(t, p)| (t.as_str(), *p)).collect();
    let broker = MockBroker::start(&named)?;
    copy_and_consume_every_codec(&broker, PyClient::Confluent)
}
