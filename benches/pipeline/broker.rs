//! The brokers the benchmarks run on: librdkafka's mock cluster, in this
//! process (on a thread of its own, since `MockCluster` is `!Send`) or in a
//! `replayguard-mock-broker` process of its own.

use std::io::{BufRead, BufReader};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::Duration;

use rdkafka::mocking::MockCluster;
use serde::Serialize;

use crate::BenchResult;

/// Where the broker runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum BrokerKind {
    /// `rdkafka::mocking::MockCluster` in the benchmark process.
    InProcess,
    /// The same mock cluster in a `replayguard-mock-broker` process.
    Process,
}

impl BrokerKind {
    /// The label used in tables and charts.
    pub fn label(self) -> &'static str {
        match self {
            BrokerKind::InProcess => "mock, in-process",
            BrokerKind::Process => "mock, own process",
        }
    }
}

enum Host {
    Thread {
        stop: Option<mpsc::Sender<()>>,
        thread: Option<JoinHandle<()>>,
    },
    Process {
        child: Child,
        // Held open: the broker exits when its stdin closes.
        _stdin: ChildStdin,
    },
}

/// A one-broker mock cluster with its topics, stopped when dropped.
pub struct Broker {
    bootstrap: String,
    host: Host,
}

impl Broker {
    /// Starts a broker of `kind` with `topics` as `(name, partitions)`.
    pub fn start(kind: BrokerKind, topics: &[(&str, i32)]) -> BenchResult<Self> {
        match kind {
            BrokerKind::InProcess => Self::on_thread(topics),
            BrokerKind::Process => Self::in_process_of_its_own(topics),
        }
    }

    fn on_thread(topics: &[(&str, i32)]) -> BenchResult<Self> {
        let topics: Vec<(String, i32)> = topics.iter().map(|(t, p)| ((*t).into(), *p)).collect();
        let (addr_tx, addr_rx) = mpsc::channel::<Result<String, String>>();
        let (stop_tx, stop_rx) = mpsc::channel::<()>();
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
        let bootstrap = addr_rx.recv_timeout(Duration::from_secs(30))??;
        Ok(Broker {
            bootstrap,
            host: Host::Thread {
                stop: Some(stop_tx),
                thread: Some(thread),
            },
        })
    }

    fn in_process_of_its_own(topics: &[(&str, i32)]) -> BenchResult<Self> {
        let mut command = Command::new(env!("CARGO_BIN_EXE_replayguard-mock-broker"));
        command.arg("--exit-on-stdin-eof");
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
        let (line_tx, line_rx) = mpsc::channel();
        // Reads every line until the broker exits, so its stdout never fills.
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                let _ = line_tx.send(line);
            }
        });
        let bootstrap = match line_rx.recv_timeout(Duration::from_secs(60)) {
            Ok(line) if line.contains(':') => line,
            other => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("replayguard-mock-broker gave no address: {other:?}").into());
            }
        };
        Ok(Broker {
            bootstrap,
            host: Host::Process {
                child,
                _stdin: stdin,
            },
        })
    }

    /// The bootstrap list.
    pub fn bootstrap(&self) -> &str {
        &self.bootstrap
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        match &mut self.host {
            Host::Thread { stop, thread } => {
                drop(stop.take());
                if let Some(t) = thread.take() {
                    let _ = t.join();
                }
            }
            Host::Process { child, .. } => {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
    }
}
