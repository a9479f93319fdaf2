//! Shared helpers for the real-broker tests: brokers, a producer, and the
//! independent reader.
//!
//! Use it from an integration test with `mod support;`. Every broker a test
//! starts is its own: a fresh process on a free `127.0.0.1` port, stopped
//! when its handle is dropped, so tests need no global broker and can run in
//! parallel.
//!
//! - [`MockBroker`]: librdkafka's mock cluster in its own process (the
//!   `replayguard-mock-broker` binary). It outlives any client the test
//!   kills. The crash-test broker.
//! - [`TansuBroker`]: Tansu with sqlite storage in a fresh temporary folder.
//!   The interoperability broker. Its binary comes from `$TANSU_BIN` or the
//!   cache folder that `scripts/test` installs into; when it is missing the
//!   test fails and says how to get it.
//! - [`TestProducer`], [`produce`] and [`produce_integers`]: an idempotent
//!   rdkafka producer that counts and waits for acks.
//! - [`read_topic`], [`read_topic_with`] and [`committed_offsets`]: read
//!   through `scripts/kafka_read.py` with confluent-kafka or kafka-python,
//!   clients that share no code with ours. The python comes from
//!   `$REPLAYGUARD_PYTHON` or `.venv/bin/python`.
//! - [`integers`] and [`check_each_once`]: turn records into numbers and
//!   check an exactly-once result.
//!
//! Every call that waits has a bound and fails with a message when it runs
//! out; nothing here waits forever.

#![allow(
    dead_code,
    reason = "each test crate uses a different subset; `expect` would fail in the crates that use everything they include"
)]

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, ExitStatus, Output, Stdio};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::thread;
use std::time::{Duration, Instant};

use rdkafka::ClientConfig;
use rdkafka::ClientContext;
use rdkafka::message::{DeliveryResult, Header, OwnedHeaders};
use rdkafka::producer::{BaseProducer, BaseRecord, Producer, ProducerContext};
use rdkafka::util::Timeout;
use serde::Deserialize;

/// The error type of every helper and test: anything, with a message.
pub type Error = Box<dyn std::error::Error + Send + Sync>;

/// `Result` for tests and helpers.
pub type TestResult<T = ()> = Result<T, Error>;

/// How long a broker may take to start and answer.
const START_LIMIT: Duration = Duration::from_secs(60);

/// How long one admin command (a topic creation) may take.
const COMMAND_LIMIT: Duration = Duration::from_secs(60);

/// The repository root (where `Cargo.toml` and `scripts/` are).
pub fn repo_root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// A TCP port on 127.0.0.1 that was free a moment ago.
///
/// # Errors
/// When no port can be bound.
pub fn free_port() -> TestResult<u16> {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
    Ok(listener.local_addr()?.port())
}

// ---------------------------------------------------------------------------
// Processes

/// Runs `command` to completion, killing it after `limit`.
///
/// Its stdin is `/dev/null`; its stdout and stderr are captured (drained on
/// threads, so a chatty child cannot block on a full pipe).
///
/// # Errors
/// When it cannot start, or runs past `limit` (then it is killed, and the
/// error holds what it printed).
pub fn run_bounded(command: &mut Command, limit: Duration) -> TestResult<Output> {
    let what = format!("{command:?}");
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("could not start {what}: {e}"))?;
    let stdout = drain(child.stdout.take());
    let stderr = drain(child.stderr.take());
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break Some(status);
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        thread::sleep(Duration::from_millis(20));
    };
    let stdout = stdout.join().map_err(|_| "stdout reader panicked")?;
    let stderr = stderr.join().map_err(|_| "stderr reader panicked")?;
    match status {
        Some(status) => Ok(Output {
            status,
            stdout,
            stderr,
        }),
        None => Err(format!(
            "{what} did not finish within {limit:?}; it was killed. stderr:\n{}",
            String::from_utf8_lossy(&stderr)
        )
        .into()),
    }
}

fn drain<R: Read + Send + 'static>(pipe: Option<R>) -> thread::JoinHandle<Vec<u8>> {
    thread::spawn(move || {
        let mut buf = Vec::new();
        if let Some(mut pipe) = pipe {
            let _ = pipe.read_to_end(&mut buf);
        }
        buf
    })
}

/// Forwards the lines of a pipe (a child's stdout, say) into a channel, so
/// they can be awaited with `recv_timeout`; the channel closes at EOF.
pub fn lines_of<R: Read + Send + 'static>(pipe: R) -> Receiver<String> {
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        for line in BufReader::new(pipe).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

/// Sends `signal` (a name such as `TERM`, `STOP` or `CONT`) to `pid`.
///
/// # Errors
/// When `kill` fails, for example because the process is gone.
pub fn send_signal(pid: u32, signal: &str) -> TestResult {
    let out = run_bounded(
        Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(pid.to_string()),
        Duration::from_secs(10),
    )?;
    if !out.status.success() {
        return Err(format!(
            "kill -{signal} {pid} failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )
        .into());
    }
    Ok(())
}

/// Whether a process with this pid exists (and is not a zombie).
pub fn process_alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state is the first field after the parenthesised name.
        Ok(stat) => stat
            .rsplit_once(") ")
            .is_some_and(|(_, rest)| !rest.starts_with('Z') && !rest.starts_with('X')),
        Err(_) => false,
    }
}

/// Waits for `child` to exit, for at most `limit`.
///
/// # Errors
/// When it is still running after `limit` (it is left running).
pub fn wait_bounded(child: &mut Child, limit: Duration) -> TestResult<ExitStatus> {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(status);
        }
        if Instant::now() >= deadline {
            return Err(format!("process {} still running after {limit:?}", child.id()).into());
        }
        thread::sleep(Duration::from_millis(20));
    }
}

/// Drops `value` on another thread and waits at most `limit` for it.
///
/// A librdkafka consumer's drop closes it (leaves its group), and that has
/// been seen to block for minutes; this bounds the wait. On time-out the
/// thread is left behind and an error returned.
///
/// # Errors
/// When the drop takes longer than `limit`.
pub fn drop_bounded<T: Send + 'static>(value: T, what: &str, limit: Duration) -> TestResult {
    let (tx, rx) = mpsc::channel();
    let started = Instant::now();
    thread::spawn(move || {
        drop(value);
        let _ = tx.send(());
    });
    match rx.recv_timeout(limit) {
        Ok(()) => Ok(()),
        Err(_) => Err(format!(
            "dropping {what} did not finish in {limit:?} (started {:?} ago)",
            started.elapsed()
        )
        .into()),
    }
}

// ---------------------------------------------------------------------------
// Mock broker

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
        let mut command = Command::new(env!("CARGO_BIN_EXE_replayguard-mock-broker"));
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

// ---------------------------------------------------------------------------
// Tansu

/// Where `scripts/test` installs Tansu: `$HOME/.cache/replayguard/tansu/bin/tansu`.
pub fn tansu_cache_path() -> Option<PathBuf> {
    std::env::var_os("HOME")
        .map(|home| PathBuf::from(home).join(".cache/replayguard/tansu/bin/tansu"))
}

/// The Tansu binary: `$TANSU_BIN`, else the cache path.
///
/// # Errors
/// When neither exists; the message says how to get it.
pub fn tansu_bin() -> TestResult<PathBuf> {
    if let Some(bin) = std::env::var_os("TANSU_BIN") {
        let bin = PathBuf::from(bin);
        if bin.is_file() {
            return Ok(bin);
        }
        return Err(format!(
            "TANSU_BIN={} is not a file. Unset it, or run scripts/test, which builds Tansu into \
             $HOME/.cache/replayguard/tansu (about 15 to 35 minutes once)",
            bin.display()
        )
        .into());
    }
    match tansu_cache_path() {
        Some(bin) if bin.is_file() => Ok(bin),
        _ => Err(
            "the Tansu broker is not installed. Run scripts/test, which builds it once, or \
                  `cargo install tansu --locked --features dynostore,libsql --root \
                  $HOME/.cache/replayguard/tansu` (15 to 35 minutes), or set TANSU_BIN to a \
                  tansu binary built with those features"
                .into(),
        ),
    }
}

/// A Tansu broker on a free 127.0.0.1 port, storing in sqlite in its own
/// temporary folder. Killed when dropped, and its folder removed.
pub struct TansuBroker {
    bin: PathBuf,
    dir: tempfile::TempDir,
    port: u16,
    child: Option<Child>,
    starts: u32,
}

impl TansuBroker {
    /// Starts a fresh broker and creates these topics, `(name, partitions)`.
    ///
    /// # Errors
    /// When Tansu is not installed (the message says how to get it), or
    /// does not start or create a topic within a minute.
    pub fn start(topics: &[(&str, i32)]) -> TestResult<Self> {
        let mut broker = Self {
            bin: tansu_bin()?,
            dir: tempfile::Builder::new().prefix("tansu-").tempdir()?,
            port: free_port()?,
            child: None,
            starts: 0,
        };
        broker.launch()?;
        for (name, partitions) in topics {
            broker.create_topic(name, *partitions)?;
        }
        Ok(broker)
    }

    /// The bootstrap address, `127.0.0.1:PORT`.
    pub fn bootstrap(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// The folder holding `broker.db` and the broker's logs.
    pub fn data_dir(&self) -> &Path {
        self.dir.path()
    }

    /// The running broker's pid, if it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Creates a topic with `tansu topic create`.
    ///
    /// # Errors
    /// When the command fails or takes more than a minute.
    pub fn create_topic(&self, name: &str, partitions: i32) -> TestResult {
        let out = run_bounded(
            Command::new(&self.bin)
                .current_dir(self.dir.path())
                .args(["topic", "create", name, "--broker"])
                .arg(format!("tcp://127.0.0.1:{}", self.port))
                .arg("--partitions")
                .arg(partitions.to_string()),
            COMMAND_LIMIT,
        )?;
        if !out.status.success() {
            return Err(format!(
                "tansu topic create {name} failed ({}): {}{}",
                out.status,
                String::from_utf8_lossy(&out.stdout).trim(),
                String::from_utf8_lossy(&out.stderr).trim()
            )
            .into());
        }
        Ok(())
    }

    /// Stops the broker cleanly: SIGTERM, then waits up to 30 s.
    ///
    /// # Errors
    /// When it does not exit in time (it is then killed) or exits with a
    /// failure.
    pub fn stop(&mut self) -> TestResult {
        let Some(mut child) = self.child.take() else {
            return Ok(());
        };
        send_signal(child.id(), "TERM")?;
        match wait_bounded(&mut child, Duration::from_secs(30)) {
            Ok(status) if status.success() => Ok(()),
            Ok(status) => Err(format!(
                "tansu exited with {status} on SIGTERM; log:\n{}",
                self.log_tail()
            )
            .into()),
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                Err(format!("tansu ignored SIGTERM: {e}").into())
            }
        }
    }

    /// Kills the broker with SIGKILL.
    ///
    /// # Errors
    /// When it cannot be killed.
    pub fn kill(&mut self) -> TestResult {
        if let Some(mut child) = self.child.take() {
            child.kill()?;
            child.wait()?;
        }
        Ok(())
    }

    /// Starts the broker again on the same port and data folder, after
    /// [`TansuBroker::stop`] or [`TansuBroker::kill`].
    ///
    /// # Errors
    /// When it is still running, or does not start within a minute.
    pub fn restart(&mut self) -> TestResult {
        if self.child.is_some() {
            return Err("restart: the broker is still running; stop or kill it first".into());
        }
        self.launch()
    }

    /// Freezes the broker with SIGSTOP (clients see it hang, not close).
    ///
    /// # Errors
    /// When it is not running.
    pub fn pause(&self) -> TestResult {
        send_signal(
            self.pid().ok_or("pause: the broker is not running")?,
            "STOP",
        )
    }

    /// Thaws a broker frozen by [`TansuBroker::pause`].
    ///
    /// # Errors
    /// When it is not running.
    pub fn resume(&self) -> TestResult {
        send_signal(
            self.pid().ok_or("resume: the broker is not running")?,
            "CONT",
        )
    }

    /// The last lines of the current run's log, for failure messages.
    pub fn log_tail(&self) -> String {
        let log = self.dir.path().join(format!("broker-{}.log", self.starts));
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }

    fn launch(&mut self) -> TestResult {
        self.starts += 1;
        let log =
            std::fs::File::create(self.dir.path().join(format!("broker-{}.log", self.starts)))?;
        let url = format!("tcp://127.0.0.1:{}", self.port);
        let mut child = Command::new(&self.bin)
            .current_dir(self.dir.path())
            .arg("broker")
            .arg("--listener-url")
            .arg(&url)
            .arg("--advertised-listener-url")
            .arg(&url)
            // Relative on purpose: an absolute sqlite:///path was misread.
            .arg("--storage-engine")
            .arg("sqlite://./broker.db")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .map_err(|e| format!("could not start {}: {e}", self.bin.display()))?;
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, self.port));
        let deadline = Instant::now() + START_LIMIT;
        loop {
            if let Some(status) = child.try_wait()? {
                return Err(format!(
                    "tansu exited during start-up ({status}); log:\n{}",
                    self.log_tail()
                )
                .into());
            }
            if TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() {
                break;
            }
            if Instant::now() >= deadline {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!(
                    "tansu did not listen on {addr} within {START_LIMIT:?}; log:\n{}",
                    self.log_tail()
                )
                .into());
            }
            thread::sleep(Duration::from_millis(50));
        }
        self.child = Some(child);
        Ok(())
    }
}

impl Drop for TansuBroker {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

// ---------------------------------------------------------------------------
// Producing

/// A record to produce.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NewRecord {
    /// The key, if any.
    pub key: Option<Vec<u8>>,
    /// The value, if any.
    pub value: Option<Vec<u8>>,
    /// Headers in order; a `None` value is a null header value.
    pub headers: Vec<(String, Option<Vec<u8>>)>,
    /// A fixed partition, or `None` for the partitioner (by key).
    pub partition: Option<i32>,
}

struct Acks {
    acked: AtomicU64,
    failures: Mutex<Vec<String>>,
}

impl ClientContext for Acks {}

impl ProducerContext for Acks {
    type DeliveryOpaque = ();

    fn delivery(&self, result: &DeliveryResult<'_>, _opaque: ()) {
        match result {
            Ok(_) => {
                self.acked.fetch_add(1, Ordering::Relaxed);
            }
            Err((e, _)) => {
                if let Ok(mut failures) = self.failures.lock() {
                    failures.push(e.to_string());
                }
            }
        }
    }
}

/// A long-lived idempotent producer (`enable.idempotence=true`,
/// `acks=all`) that counts acks, for tests that produce steadily.
pub struct TestProducer {
    producer: BaseProducer<Acks>,
    topic: String,
    sent: u64,
}

impl TestProducer {
    /// A producer writing to `topic`.
    ///
    /// # Errors
    /// When librdkafka refuses the configuration.
    pub fn new(bootstrap: &str, topic: &str) -> TestResult<Self> {
        let producer = ClientConfig::new()
            .set("bootstrap.servers", bootstrap)
            .set("enable.idempotence", "true")
            .set("acks", "all")
            .set("linger.ms", "5")
            .set("message.timeout.ms", "60000")
            .create_with_context(Acks {
                acked: AtomicU64::new(0),
                failures: Mutex::new(Vec::new()),
            })?;
        Ok(Self {
            producer,
            topic: topic.to_owned(),
            sent: 0,
        })
    }

    /// Queues one record; waits (at most 60 s) while the queue is full.
    ///
    /// # Errors
    /// When the queue stays full or librdkafka refuses the record.
    pub fn send(&mut self, record: &NewRecord) -> TestResult {
        let mut headers = OwnedHeaders::new();
        for (key, value) in &record.headers {
            headers = headers.insert(Header {
                key: key.as_str(),
                value: value.as_ref(),
            });
        }
        let mut base = BaseRecord::<[u8], [u8]>::to(&self.topic).headers(headers);
        if let Some(key) = &record.key {
            base = base.key(key.as_slice());
        }
        if let Some(value) = &record.value {
            base = base.payload(value.as_slice());
        }
        if let Some(partition) = record.partition {
            base = base.partition(partition);
        }
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            match self.producer.send(base) {
                Ok(()) => break,
                Err((e, returned)) => {
                    if Instant::now() >= deadline {
                        return Err(format!("produce to {}: {e}", self.topic).into());
                    }
                    base = returned;
                    self.producer.poll(Duration::from_millis(50));
                }
            }
        }
        self.sent += 1;
        self.producer.poll(Duration::ZERO);
        Ok(())
    }

    /// Queues one integer, key and value its decimal text.
    ///
    /// # Errors
    /// As [`TestProducer::send`].
    pub fn send_integer(&mut self, n: u64) -> TestResult {
        self.send(&NewRecord {
            key: Some(n.to_string().into_bytes()),
            value: Some(n.to_string().into_bytes()),
            ..NewRecord::default()
        })
    }

    /// Waits (at most `limit`) until every queued record is acked, and
    /// returns how many records were acked in all.
    ///
    /// # Errors
    /// When a record failed or is not acked in time.
    pub fn flush(&mut self, limit: Duration) -> TestResult<u64> {
        self.producer
            .flush(Timeout::After(limit))
            .map_err(|e| format!("produce to {}: not every record was acked: {e}", self.topic))?;
        let context = self.producer.context();
        let failures = context
            .failures
            .lock()
            .map_err(|_| "delivery failure list poisoned")?;
        if let Some(first) = failures.first() {
            return Err(format!(
                "produce to {}: {} of {} records failed, first: {first}",
                self.topic,
                failures.len(),
                self.sent
            )
            .into());
        }
        let acked = context.acked.load(Ordering::Relaxed);
        if acked != self.sent {
            return Err(format!(
                "produce to {}: {acked} of {} records acked",
                self.topic, self.sent
            )
            .into());
        }
        Ok(acked)
    }

    /// How many records were acked so far.
    pub fn acked(&self) -> u64 {
        self.producer.context().acked.load(Ordering::Relaxed)
    }
}

/// Produces `records` to `topic` with a fresh [`TestProducer`] and waits
/// for every ack, for at most 60 s. Returns how many were acked.
///
/// # Errors
/// When any record is not acked.
pub fn produce(
    bootstrap: &str,
    topic: &str,
    records: impl IntoIterator<Item = NewRecord>,
) -> TestResult<u64> {
    let mut producer = TestProducer::new(bootstrap, topic)?;
    let deadline = Instant::now() + Duration::from_secs(60);
    for record in records {
        producer.send(&record)?;
    }
    let left = deadline.saturating_duration_since(Instant::now());
    producer.flush(left.max(Duration::from_secs(1)))
}

/// Produces each integer as a record whose key and value are its decimal
/// text, so keyed partitioning spreads them over partitions.
///
/// # Errors
/// As [`produce`].
pub fn produce_integers(
    bootstrap: &str,
    topic: &str,
    values: impl IntoIterator<Item = u64>,
) -> TestResult<u64> {
    let mut producer = TestProducer::new(bootstrap, topic)?;
    let deadline = Instant::now() + Duration::from_secs(60);
    for n in values {
        producer.send_integer(n)?;
    }
    let left = deadline.saturating_duration_since(Instant::now());
    producer.flush(left.max(Duration::from_secs(1)))
}

/// The end offset (high watermark) of each partition of `topic`, asked
/// with a metadata-only rdkafka client (10 s per request).
///
/// # Errors
/// When the topic is unknown or the broker does not answer.
pub fn end_offsets(bootstrap: &str, topic: &str) -> TestResult<BTreeMap<i32, i64>> {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    let client: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("allow.auto.create.topics", "false")
        .create()?;
    let limit = Duration::from_secs(10);
    let metadata = client.fetch_metadata(Some(topic), limit)?;
    let partitions = metadata
        .topics()
        .iter()
        .find(|t| t.name() == topic && t.error().is_none())
        .map(|t| t.partitions().len() as i32)
        .ok_or_else(|| format!("end_offsets: topic {topic} is unknown"))?;
    let mut ends = BTreeMap::new();
    for p in 0..partitions {
        let (_, high) = client.fetch_watermarks(topic, p, limit)?;
        ends.insert(p, high);
    }
    Ok(ends)
}

// ---------------------------------------------------------------------------
// Reading with an independent client

/// The python with confluent-kafka and kafka-python: `$REPLAYGUARD_PYTHON`,
/// else `.venv/bin/python` in the repository.
///
/// # Errors
/// When neither exists; the message says how to make it.
pub fn python() -> TestResult<PathBuf> {
    if let Some(python) = std::env::var_os("REPLAYGUARD_PYTHON") {
        return Ok(PathBuf::from(python));
    }
    let venv = repo_root().join(".venv/bin/python");
    if venv.is_file() {
        return Ok(venv);
    }
    Err(
        "no python with the Kafka clients: run scripts/test (it makes .venv), or \
         `python3 -m venv .venv && .venv/bin/pip install confluent-kafka kafka-python`, \
         or set REPLAYGUARD_PYTHON"
            .into(),
    )
}

/// An independent Kafka client in `scripts/kafka_read.py`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PyClient {
    /// confluent-kafka (its own librdkafka build); works with both brokers.
    #[default]
    Confluent,
    /// kafka-python (pure Python); works with Tansu, not with the mock.
    KafkaPython,
}

impl PyClient {
    /// Both clients, for tests that check with each.
    pub const BOTH: [PyClient; 2] = [PyClient::Confluent, PyClient::KafkaPython];

    fn arg(self) -> &'static str {
        match self {
            PyClient::Confluent => "confluent",
            PyClient::KafkaPython => "kafka-python",
        }
    }
}

/// How far [`read_topic_with`] reads.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Until {
    /// To each partition's end offset as it was when the read started.
    End,
    /// Until no record arrived for this long.
    Idle(Duration),
}

/// Options of [`read_topic_with`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ReadOptions {
    /// Which client reads. Default confluent-kafka.
    pub client: PyClient,
    /// `isolation.level` read_committed; default false (read_uncommitted).
    pub read_committed: bool,
    /// Where to stop. Default [`Until::End`].
    pub until: Until,
    /// Give up (and fail) after this long. Default 60 s.
    pub timeout: Duration,
}

impl Default for ReadOptions {
    fn default() -> Self {
        Self {
            client: PyClient::Confluent,
            read_committed: false,
            until: Until::End,
            timeout: Duration::from_secs(60),
        }
    }
}

/// A record as the independent client read it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// Its partition.
    pub partition: i32,
    /// Its offset.
    pub offset: i64,
    /// The key, if not null.
    pub key: Option<Vec<u8>>,
    /// The value, if not null.
    pub value: Option<Vec<u8>>,
    /// Headers in order; `None` is a null header value.
    pub headers: Vec<(String, Option<Vec<u8>>)>,
}

impl Record {
    /// The value as UTF-8 text, if it is.
    pub fn value_str(&self) -> Option<&str> {
        self.value
            .as_deref()
            .and_then(|v| std::str::from_utf8(v).ok())
    }

    /// The first header named `key`: `Some(None)` when its value is null.
    pub fn header(&self, key: &str) -> Option<Option<&[u8]>> {
        self.headers
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_deref())
    }
}

#[derive(Deserialize)]
struct JsonHeader {
    key: String,
    value: Option<String>,
    value_b64: Option<String>,
}

#[derive(Deserialize)]
struct JsonRecord {
    partition: i32,
    offset: i64,
    key: Option<String>,
    key_b64: Option<String>,
    value: Option<String>,
    value_b64: Option<String>,
    headers: Vec<JsonHeader>,
}

fn bytes_of(text: Option<String>, b64: Option<String>) -> TestResult<Option<Vec<u8>>> {
    match (text, b64) {
        (Some(text), _) => Ok(Some(text.into_bytes())),
        (None, Some(b64)) => Ok(Some(base64_decode(&b64)?)),
        (None, None) => Ok(None),
    }
}

/// Reads all of `topic` with `client`, from the beginning to the end
/// offsets at start (read_uncommitted, 60 s limit).
///
/// # Errors
/// When the client fails, the topic is unknown, or the read times out.
pub fn read_topic(bootstrap: &str, topic: &str, client: PyClient) -> TestResult<Vec<Record>> {
    read_topic_with(
        bootstrap,
        topic,
        &ReadOptions {
            client,
            ..ReadOptions::default()
        },
    )
}

/// Reads `topic` with `scripts/kafka_read.py` under `options`. Records come
/// in the order the client received them: in offset order within a
/// partition, interleaved across partitions.
///
/// # Errors
/// As [`read_topic`].
pub fn read_topic_with(
    bootstrap: &str,
    topic: &str,
    options: &ReadOptions,
) -> TestResult<Vec<Record>> {
    let mut command = kafka_read_command(bootstrap, topic, options.client)?;
    command
        .arg("--isolation")
        .arg(if options.read_committed {
            "read_committed"
        } else {
            "read_uncommitted"
        })
        .arg("--timeout")
        .arg(options.timeout.as_secs_f64().to_string());
    match options.until {
        Until::End => command.args(["--until", "end"]),
        Until::Idle(idle) => command
            .args(["--until", "idle", "--idle"])
            .arg(idle.as_secs_f64().to_string()),
    };
    let stdout = run_kafka_read(&mut command, options.timeout)?;
    let mut records = Vec::new();
    let mut seen = BTreeSet::new();
    for line in stdout.lines().filter(|l| !l.trim().is_empty()) {
        let json: JsonRecord = serde_json::from_str(line).map_err(|e| {
            format!("kafka_read.py printed a line that is not a record ({e}): {line}")
        })?;
        let mut headers = Vec::with_capacity(json.headers.len());
        for h in json.headers {
            headers.push((h.key, bytes_of(h.value, h.value_b64)?));
        }
        // A reader that printed one position twice would fake duplicates.
        if !seen.insert((json.partition, json.offset)) {
            return Err(format!(
                "kafka_read.py printed partition {} offset {} twice",
                json.partition, json.offset
            )
            .into());
        }
        records.push(Record {
            partition: json.partition,
            offset: json.offset,
            key: bytes_of(json.key, json.key_b64)?,
            value: bytes_of(json.value, json.value_b64)?,
            headers,
        });
    }
    Ok(records)
}

/// The offsets `group` has committed on each partition of `topic`
/// (`None` where it has none), as `client` sees them.
///
/// # Errors
/// When the client fails or the topic is unknown.
pub fn committed_offsets(
    bootstrap: &str,
    topic: &str,
    group: &str,
    client: PyClient,
) -> TestResult<BTreeMap<i32, Option<i64>>> {
    #[derive(Deserialize)]
    struct Committed {
        partition: i32,
        committed: Option<i64>,
    }
    let mut command = kafka_read_command(bootstrap, topic, client)?;
    command.arg("--committed").arg(group);
    let stdout = run_kafka_read(&mut command, Duration::from_secs(60))?;
    let mut offsets = BTreeMap::new();
    for line in stdout.lines().filter(|l| !l.trim().is_empty()) {
        let c: Committed = serde_json::from_str(line)
            .map_err(|e| format!("kafka_read.py --committed printed ({e}): {line}"))?;
        offsets.insert(c.partition, c.committed);
    }
    Ok(offsets)
}

fn kafka_read_command(bootstrap: &str, topic: &str, client: PyClient) -> TestResult<Command> {
    let mut command = Command::new(python()?);
    command
        .arg(repo_root().join("scripts/kafka_read.py"))
        .arg("--brokers")
        .arg(bootstrap)
        .arg("--topic")
        .arg(topic)
        .arg("--client")
        .arg(client.arg());
    Ok(command)
}

fn run_kafka_read(command: &mut Command, timeout: Duration) -> TestResult<String> {
    // The script bounds itself; this outer bound only catches a hang.
    let out = run_bounded(command, timeout + Duration::from_secs(60))?;
    if !out.status.success() {
        return Err(format!(
            "kafka_read.py failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )
        .into());
    }
    Ok(String::from_utf8(out.stdout)?)
}

// ---------------------------------------------------------------------------
// Checking

/// The values of `records` parsed as decimal integers, in read order.
///
/// # Errors
/// When a value is null or not a decimal integer.
pub fn integers(records: &[Record]) -> TestResult<Vec<u64>> {
    records
        .iter()
        .map(|r| {
            r.value_str().and_then(|v| v.parse().ok()).ok_or_else(|| {
                format!(
                    "record at partition {} offset {} has value {:?}, not an integer",
                    r.partition, r.offset, r.value
                )
                .into()
            })
        })
        .collect()
}

/// Checks that `got` holds every value of `expected` exactly once and
/// nothing else, and lists what is missing, duplicated or unexpected.
///
/// # Errors
/// When it does not.
pub fn check_each_once(got: &[u64], expected: impl IntoIterator<Item = u64>) -> TestResult {
    let expected: BTreeSet<u64> = expected.into_iter().collect();
    let mut counts: BTreeMap<u64, usize> = BTreeMap::new();
    for &v in got {
        *counts.entry(v).or_default() += 1;
    }
    let missing: Vec<u64> = expected
        .iter()
        .filter(|v| !counts.contains_key(v))
        .copied()
        .collect();
    let duplicated: Vec<(u64, usize)> = counts
        .iter()
        .filter(|(_, c)| **c > 1)
        .map(|(v, c)| (*v, *c))
        .collect();
    let unexpected: Vec<u64> = counts
        .keys()
        .filter(|v| !expected.contains(v))
        .copied()
        .collect();
    if missing.is_empty() && duplicated.is_empty() && unexpected.is_empty() {
        return Ok(());
    }
    let mut message = format!(
        "not exactly once: {} values read, {} expected",
        got.len(),
        expected.len()
    );
    let _ = write!(
        message,
        "; missing {}: {:?}",
        missing.len(),
        &missing[..missing.len().min(20)]
    );
    let _ = write!(
        message,
        "; duplicated {} (value, count): {:?}",
        duplicated.len(),
        &duplicated[..duplicated.len().min(20)]
    );
    let _ = write!(
        message,
        "; unexpected {}: {:?}",
        unexpected.len(),
        &unexpected[..unexpected.len().min(20)]
    );
    Err(message.into())
}

/// Checks that `values` strictly increase.
///
/// # Errors
/// At the first place where they do not.
pub fn check_increasing(values: &[u64]) -> TestResult {
    match values.windows(2).position(|w| w[0] >= w[1]) {
        None => Ok(()),
        Some(i) => Err(format!(
            "not increasing at index {i}: {} then {} (around: {:?})",
            values[i],
            values[i + 1],
            &values[i.saturating_sub(5)..(i + 6).min(values.len())]
        )
        .into()),
    }
}

/// Decodes standard base64 (with or without padding).
///
/// # Errors
/// On a character outside the alphabet.
pub fn base64_decode(text: &str) -> TestResult<Vec<u8>> {
    let mut out = Vec::with_capacity(text.len() / 4 * 3);
    let mut acc = 0u32;
    let mut bits = 0u32;
    for c in text.bytes().filter(|&c| c != b'=') {
        let v = match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return Err(format!("not base64: {text:?}").into()),
        };
        acc = (acc << 6) | u32::from(v);
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
            acc &= (1 << bits) - 1;
        }
    }
    Ok(out)
}
