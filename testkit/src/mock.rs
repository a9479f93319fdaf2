//! librdkafka's mock cluster: in its own process (the crash-test broker,
//! which outlives the clients a test kills) or on a thread of this one.

use std::io::Write;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::Duration;

use rdkafka::ClientConfig;
use rdkafka::mocking::MockCluster;

use crate::read::ReadRecord;

use crate::process::{lines_of, wait_bounded};
use crate::{COMMAND_LIMIT, START_LIMIT, TestResult};

/// The `replayguard-mock-broker` binary: `$REPLAYGUARD_MOCK_BROKER`, else
/// the one cargo built beside the running test, bench or example (tests and
/// benches run from `target/<profile>/deps/`, examples from
/// `target/<profile>/examples/`, the binaries sit in `target/<profile>/`).
///
/// # Errors
/// When it is in neither place; the message says how to build it.
pub fn mock_broker_bin() -> TestResult<std::path::PathBuf> {
    if let Some(bin) = std::env::var_os("REPLAYGUARD_MOCK_BROKER") {
        return Ok(bin.into());
    }
    let exe = std::env::current_exe()?;
    let name = "replayguard-mock-broker";
    for dir in exe.ancestors().skip(1).take(2) {
        let bin = dir.join(name);
        if bin.is_file() {
            return Ok(bin);
        }
    }
    Err(format!(
        "{name} was not found beside {}; build it with `cargo build --bin {name}` (cargo \
         builds it for the crate's own tests and benches), or set REPLAYGUARD_MOCK_BROKER",
        exe.display()
    )
    .into())
}

/// librdkafka's mock cluster, hosted in its own `replayguard-mock-broker`
/// process. Killed when dropped; it also exits by itself if the test process
/// dies, because its stdin (a pipe from the test) closes.
pub struct MockBroker {
    child: Child,
    stdin: ChildStdin,
    lines: Receiver<String>,
    bootstrap: String,
}

impl MockBroker {
    /// One broker with these topics, given as `(name, partitions)`.
    ///
    /// # Errors
    /// When the binary cannot start or prints no address within a minute.
    pub fn start(topics: &[(&str, i32)]) -> TestResult<Self> {
        Self::start_cluster(1, topics)
    }

    /// A cluster of `brokers` brokers with these topics, replication factor 1.
    ///
    /// # Errors
    /// As [`MockBroker::start`].
    pub fn start_cluster(brokers: i32, topics: &[(&str, i32)]) -> TestResult<Self> {
        let mut command = Command::new(mock_broker_bin()?);
        command
            .arg("--brokers")
            .arg(brokers.to_string())
            .arg("--exit-on-stdin-eof");
        for (name, partitions) in topics {
            command.arg("--topic").arg(format!("{name}:{partitions}"));
        }
        let mut child = command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| format!("could not start replayguard-mock-broker: {e}"))?;
        let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            let _ = child.kill();
            return Err("replayguard-mock-broker started without its pipes".into());
        };
        let lines = lines_of(stdout);
        let mut broker = Self {
            child,
            stdin,
            lines,
            bootstrap: String::new(),
        };
        broker.bootstrap = broker.next_line(START_LIMIT)?;
        if broker.bootstrap.is_empty() || !broker.bootstrap.contains(':') {
            return Err(format!(
                "replayguard-mock-broker printed `{}`, not a bootstrap address",
                broker.bootstrap
            )
            .into());
        }
        Ok(broker)
    }

    /// The bootstrap list, `127.0.0.1:PORT[,...]`.
    pub fn bootstrap(&self) -> &str {
        &self.bootstrap
    }

    /// The broker process's pid.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Creates another topic.
    ///
    /// # Errors
    /// When the broker refuses or does not answer.
    pub fn create_topic(&mut self, name: &str, partitions: i32) -> TestResult {
        self.command(&format!("create-topic {name}:{partitions}"))
    }

    /// Cuts the connections of broker `id` (ids start at 1) until
    /// [`MockBroker::broker_up`].
    ///
    /// # Errors
    /// When the broker refuses or does not answer.
    pub fn broker_down(&mut self, id: i32) -> TestResult {
        self.command(&format!("broker-down {id}"))
    }

    /// Restores broker `id`.
    ///
    /// # Errors
    /// When the broker refuses or does not answer.
    pub fn broker_up(&mut self, id: i32) -> TestResult {
        self.command(&format!("broker-up {id}"))
    }

    /// Answers the next `n` offset commits, of any client, with
    /// `REBALANCE_IN_PROGRESS`.
    ///
    /// # Errors
    /// When the broker refuses or does not answer.
    pub fn refuse_commits(&mut self, n: usize) -> TestResult {
        self.command(&format!("refuse-commits {n}"))
    }

    fn command(&mut self, line: &str) -> TestResult {
        writeln!(self.stdin, "{line}")?;
        self.stdin.flush()?;
        let reply = self.next_line(COMMAND_LIMIT)?;
        if reply == "ok" {
            Ok(())
        } else {
            Err(format!("mock broker: `{line}`: {reply}").into())
        }
    }

    fn next_line(&mut self, limit: Duration) -> TestResult<String> {
        match self.lines.recv_timeout(limit) {
            Ok(line) => Ok(line),
            Err(RecvTimeoutError::Timeout) => {
                Err(format!("replayguard-mock-broker said nothing within {limit:?}").into())
            }
            Err(RecvTimeoutError::Disconnected) => {
                let status = wait_bounded(&mut self.child, Duration::from_secs(5))
                    .map_or_else(|e| e.to_string(), |s| s.to_string());
                Err(format!("replayguard-mock-broker exited ({status})").into())
            }
        }
    }
}

impl Drop for MockBroker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// librdkafka's mock cluster on a thread of this process (`MockCluster` is
/// `!Send`), until dropped. For fast tests and benches; a test that kills
/// a client process needs [`MockBroker`], which outlives it.
pub struct InProcessBroker {
    bootstrap: String,
    stop: Option<std::sync::mpsc::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl InProcessBroker {
    /// A one-broker mock cluster with these topics, `(name, partitions)`.
    ///
    /// # Errors
    /// When the cluster or a topic cannot be created.
    pub fn start(topics: &[(&str, i32)]) -> TestResult<Self> {
        let topics: Vec<(String, i32)> =
            topics.iter().map(|(t, p)| ((*t).to_owned(), *p)).collect();
        let (addr_tx, addr_rx) = std::sync::mpsc::channel::<Result<String, String>>();
        let (stop_tx, stop_rx) = std::sync::mpsc::channel::<()>();
        let thread = std::thread::spawn(move || {
            let cluster = match MockCluster::new(1) {
                Ok(c) => c,
                Err(e) => {
                    let _ = addr_tx.send(Err(e.to_string()));
                    return;
                }
            };
            for (t, p) in &topics {
                if let Err(e) = cluster.create_topic(t, *p, 1) {
                    let _ = addr_tx.send(Err(format!("creating {t}: {e}")));
                    return;
                }
            }
            let _ = addr_tx.send(Ok(cluster.bootstrap_servers()));
            // Serves until the sender is dropped.
            let _ = stop_rx.recv();
        });
        let bootstrap = addr_rx.recv_timeout(START_LIMIT)??;
        Ok(Self {
            bootstrap,
            stop: Some(stop_tx),
            thread: Some(thread),
        })
    }

    /// The bootstrap list.
    pub fn bootstrap(&self) -> &str {
        &self.bootstrap
    }

    /// A consumer configuration for `group`: 6 s sessions, reading from
    /// the earliest offset.
    pub fn consumer_config(&self, group: &str) -> ClientConfig {
        let mut c = crate::client_config(&self.bootstrap);
        c.set("group.id", group)
            .set("session.timeout.ms", "6000")
            .set("auto.offset.reset", "earliest");
        c
    }

    /// Produces each value as decimal text (key `k<value>`, header `id`
    /// holding the value), round-robin over `partitions`.
    ///
    /// # Errors
    /// When a record is not acked within 10 s.
    pub async fn produce(&self, topic: &str, values: &[u64], partitions: i32) -> TestResult {
        crate::read::produce_values(&self.bootstrap, topic, values, partitions).await
    }

    /// Every record of `topic` up to its high watermarks, read in this
    /// process: (partition, value, headers).
    ///
    /// # Errors
    /// When the read fails or takes more than a minute.
    pub fn read_all(&self, topic: &str, partitions: i32) -> TestResult<Vec<ReadRecord>> {
        crate::read::read_all(&self.bootstrap, topic, partitions)
    }

    /// The values of `topic` as integers, in read order.
    ///
    /// # Errors
    /// As [`InProcessBroker::read_all`], or a value that is not an integer.
    pub fn values(&self, topic: &str, partitions: i32) -> TestResult<Vec<u64>> {
        self.read_all(topic, partitions)?
            .into_iter()
            .map(|(_, v, _)| Ok(v.parse::<u64>()?))
            .collect()
    }
}

impl Drop for InProcessBroker {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
