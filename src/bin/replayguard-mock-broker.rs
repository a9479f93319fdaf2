//! Test-support broker: librdkafka's mock cluster hosted in its own process.
//!
//! Crash tests need a broker that outlives the pipeline process they kill
//! with SIGKILL, and the zero-setup demo needs a broker with nothing to
//! install. This binary starts `rdkafka::mocking::MockCluster`, creates the
//! topics named on the command line, prints the bootstrap address as one line
//! on stdout and then serves until it gets SIGTERM or SIGINT, or, with
//! `--exit-on-stdin-eof`, until its stdin closes (so a test harness that dies
//! takes its broker with it).
//!
//! ```text
//! replayguard-mock-broker --brokers 3 --topic input:3 --topic output:3
//! 127.0.0.1:41235,127.0.0.1:39821,127.0.0.1:45017
//! ```
//!
//! While it runs it reads commands from stdin, one a line, and answers each
//! with one line on stdout, `ok` or `error: ...`:
//!
//! - `broker-down ID` and `broker-up ID`: cut or restore a broker's
//!   connections (broker ids start at 1);
//! - `create-topic NAME:PARTITIONS`: create one more topic;
//! - `refuse-commits N`: answer the next N offset commits (of any client)
//!   with `REBALANCE_IN_PROGRESS`, as a broker does to a commit that meets
//!   a rebalance.
//!
//! It is not a Kafka broker for real data. The mock keeps only about 5 MiB
//! or 100k record batches per partition and drops older data, and its
//! timestamps are fake.

use std::io::{BufRead, Write};
use std::process::ExitCode;
use std::sync::mpsc;

use clap::Parser;
use rdkafka::mocking::MockCluster;
use rdkafka::producer::DefaultProducerContext;
use rdkafka::types::{RDKafkaApiKey, RDKafkaRespErr};

/// librdkafka's mock cluster in its own process, for tests and demos.
#[derive(Debug, Parser)]
#[command(version, about, long_about = None)]
struct Args {
    /// Number of brokers in the cluster (1 to 16).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(i32).range(1..=16))]
    brokers: i32,

    /// A topic to create, as NAME:PARTITIONS (repeatable), e.g. `input:3`.
    #[arg(long = "topic", value_name = "NAME:PARTITIONS", value_parser = parse_topic)]
    topics: Vec<TopicSpec>,

    /// Replication factor of the topics created; at most `--brokers`.
    #[arg(long, default_value_t = 1)]
    replication_factor: i32,

    /// Exit when stdin reaches end of file, for example when the parent
    /// process that holds the other end of the pipe dies.
    #[arg(long)]
    exit_on_stdin_eof: bool,
}

#[derive(Debug, Clone)]
struct TopicSpec {
    name: String,
    partitions: i32,
}

fn parse_topic(spec: &str) -> Result<TopicSpec, String> {
    let (name, partitions) = spec
        .rsplit_once(':')
        .ok_or_else(|| format!("`{spec}` is not NAME:PARTITIONS, e.g. `input:3`"))?;
    if name.is_empty() {
        return Err(format!("`{spec}` has an empty topic name"));
    }
    let partitions: i32 = partitions
        .parse()
        .map_err(|_| format!("`{partitions}` in `{spec}` is not a partition count"))?;
    if !(1..=10_000).contains(&partitions) {
        return Err(format!(
            "`{spec}`: the partition count must be between 1 and 10000"
        ));
    }
    Ok(TopicSpec {
        name: name.to_owned(),
        partitions,
    })
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("replayguard-mock-broker: {message}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &Args) -> Result<(), String> {
    if args.replication_factor < 1 || args.replication_factor > args.brokers {
        return Err(format!(
            "--replication-factor {} must be between 1 and --brokers ({})",
            args.replication_factor, args.brokers
        ));
    }
    // MockCluster is !Send: it stays on this thread for the whole run, and
    // only the bootstrap string leaves it.
    let cluster = MockCluster::new(args.brokers)
        .map_err(|e| format!("could not start the mock cluster: {e}"))?;
    for topic in &args.topics {
        create_topic(&cluster, args, topic)?;
    }

    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "{}", cluster.bootstrap_servers())
        .and_then(|()| stdout.flush())
        .map_err(|e| format!("could not print the bootstrap address: {e}"))?;
    drop(stdout);

    let (lines_tx, lines_rx) = mpsc::channel::<String>();
    // The reader thread only forwards lines; closing the channel means EOF
    // (or an unreadable stdin, which is treated the same way).
    std::thread::spawn(move || {
        for line in std::io::stdin().lock().lines() {
            let Ok(line) = line else { break };
            if lines_tx.send(line).is_err() {
                break;
            }
        }
    });

    while let Ok(line) = lines_rx.recv() {
        let reply = match command(&cluster, args, line.trim()) {
            Ok(()) => "ok".to_owned(),
            Err(message) => format!("error: {message}"),
        };
        // Nobody may be listening any more; that is not a broker failure.
        let mut stdout = std::io::stdout().lock();
        let _ = writeln!(stdout, "{reply}").and_then(|()| stdout.flush());
    }

    if !args.exit_on_stdin_eof {
        // Serve until a signal ends the process (default SIGTERM/SIGINT
        // action); there is no state to save.
        loop {
            std::thread::park();
        }
    }
    drop(cluster);
    Ok(())
}

fn create_topic(
    cluster: &MockCluster<'static, DefaultProducerContext>,
    args: &Args,
    topic: &TopicSpec,
) -> Result<(), String> {
    cluster
        .create_topic(&topic.name, topic.partitions, args.replication_factor)
        .map_err(|e| format!("could not create topic `{}`: {e}", topic.name))
}

fn command(
    cluster: &MockCluster<'static, DefaultProducerContext>,
    args: &Args,
    line: &str,
) -> Result<(), String> {
    let (verb, rest) = line.split_once(' ').unwrap_or((line, ""));
    let rest = rest.trim();
    let broker_id = || -> Result<i32, String> {
        let id: i32 = rest
            .parse()
            .map_err(|_| format!("`{rest}` is not a broker id"))?;
        if !(1..=args.brokers).contains(&id) {
            return Err(format!(
                "broker id {id} is not between 1 and {}",
                args.brokers
            ));
        }
        Ok(id)
    };
    match verb {
        "broker-down" => cluster
            .broker_down(broker_id()?)
            .map_err(|e| format!("broker-down failed: {e}")),
        "broker-up" => cluster
            .broker_up(broker_id()?)
            .map_err(|e| format!("broker-up failed: {e}")),
        "create-topic" => create_topic(cluster, args, &parse_topic(rest)?),
        "refuse-commits" => {
            let n: usize = rest
                .parse()
                .map_err(|_| format!("`{rest}` is not a number of commits"))?;
            cluster.request_errors(
                RDKafkaApiKey::OffsetCommit,
                &vec![RDKafkaRespErr::RD_KAFKA_RESP_ERR_REBALANCE_IN_PROGRESS; n],
            );
            Ok(())
        }
        _ => Err(format!(
            "unknown command `{line}`; expected broker-down ID, broker-up ID, create-topic NAME:PARTITIONS or refuse-commits N"
        )),
    }
}
