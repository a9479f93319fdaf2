//! Runs of the command under test: processes killed with SIGKILL and
//! reaped, a steady feeder of integers, end offsets watched while they run,
//! and seeded kill plans that a failure can replay.

use std::collections::BTreeMap;
use std::fs::File;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, ExitStatus, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rand::SeedableRng;
use rand::rngs::StdRng;
use rdkafka::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};

use crate::{TestProducer, TestResult, wait_bounded};

/// How long a started `pipe` may take to write its first output: the mock
/// broker evicts a killed member only after its 6 s session timeout, then
/// rejoins the group after about 3 s.
pub const FIRST_OUTPUT_LIMIT: Duration = Duration::from_secs(60);

/// A [`Feeder`] never writes more than this: the mock keeps only about
/// 5 MiB per partition, and an output record carries about 60 bytes of
/// headers.
pub const FEED_CAP: u64 = 40_000;

/// The `replayguard` binary: `$REPLAYGUARD_BIN`, else the one cargo built
/// beside the running test (`target/<profile>/replayguard`).
///
/// # Errors
/// When it is in neither place.
pub fn replayguard_bin() -> TestResult<PathBuf> {
    if let Some(bin) = std::env::var_os("REPLAYGUARD_BIN") {
        return Ok(bin.into());
    }
    let exe = std::env::current_exe()?;
    for dir in exe.ancestors().skip(1).take(2) {
        let bin = dir.join("replayguard");
        if bin.is_file() {
            return Ok(bin);
        }
    }
    Err(format!(
        "the replayguard binary was not found beside {}; build it, or set REPLAYGUARD_BIN",
        exe.display()
    )
    .into())
}

/// The RNG seed: `$CRASH_SEED`, else the clock. Printed, so a failure can be
/// replayed.
pub fn seeded(test: &str) -> (u64, StdRng) {
    let seed = std::env::var("CRASH_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64)
        });
    println!("{test}: seed {seed} (replay with CRASH_SEED={seed})");
    (seed, StdRng::seed_from_u64(seed))
}

/// A test's result: a failure names the seed, and keeps the folder of the
/// runs' logs (each run's stderr at `RUST_LOG=info,librdkafka=debug`) and says
/// where it is. With `REPLAYGUARD_KEEP_LOGS` set, a success keeps them too.
pub fn outcome(result: TestResult, seed: u64, logs: tempfile::TempDir) -> TestResult {
    if result.is_ok() && std::env::var_os("REPLAYGUARD_KEEP_LOGS").is_some() {
        println!(
            "(seed {seed}; the runs' logs are in {})",
            logs.keep().display()
        );
        return Ok(());
    }
    result.map_err(|e| {
        let kept = logs.keep();
        format!(
            "{e}\n(seed {seed}; replay with CRASH_SEED={seed}; the runs' logs are in {})",
            kept.display()
        )
        .into()
    })
}

/// One run of the command under test: stderr goes to a log file, and the
/// process is killed with SIGKILL (and reaped) when the handle drops.
pub struct Proc {
    /// Its name in messages.
    pub name: String,
    /// The process.
    pub child: Child,
    /// Where its stderr goes.
    pub log: PathBuf,
}

impl Proc {
    /// Starts `command` with stdin closed and stderr into `log`; stdout is
    /// as `command` sets it.
    pub fn spawn(name: String, command: &mut Command, log: PathBuf) -> TestResult<Self> {
        let child = command
            .stdin(Stdio::null())
            .stderr(File::create(&log)?)
            .spawn()
            .map_err(|e| format!("could not start {name}: {e}"))?;
        Ok(Self { name, child, log })
    }

    pub fn take_stdout(&mut self) -> TestResult<ChildStdout> {
        Ok(self.child.stdout.take().ok_or("stdout is not piped")?)
    }

    /// The last lines it wrote to stderr.
    pub fn log_tail(&self) -> String {
        crate::process::file_tail(&self.log, 15)
    }

    /// Its exit status if it has exited.
    pub fn exited(&mut self) -> TestResult<Option<ExitStatus>> {
        Ok(self.child.try_wait()?)
    }

    /// Fails when it exited (it should run until killed).
    pub fn check_running(&mut self) -> TestResult {
        match self.exited()? {
            None => Ok(()),
            Some(status) => Err(format!(
                "{} exited by itself ({status}); stderr:\n{}",
                self.name,
                self.log_tail()
            )
            .into()),
        }
    }

    /// SIGKILL, then reaps it. Fails when it had already exited by itself.
    pub fn kill9(mut self) -> TestResult {
        self.check_running()?;
        self.child.kill()?;
        let status = wait_bounded(&mut self.child, Duration::from_secs(10))?;
        if status.signal() != Some(libc::SIGKILL) {
            return Err(format!(
                "{} exited by itself ({status}) just before the kill; stderr:\n{}",
                self.name,
                self.log_tail()
            )
            .into());
        }
        Ok(())
    }

    /// Waits for it to exit on its own, for at most `limit`.
    pub fn wait(&mut self, limit: Duration) -> TestResult<ExitStatus> {
        wait_bounded(&mut self.child, limit)
            .map_err(|e| format!("{}: {e}; stderr:\n{}", self.name, self.log_tail()).into())
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Writes 1, 2, 3, ... into a topic at a steady rate on its own thread,
/// keyed by the number's text, until [`Feeder::finish`] (or `FEED_CAP`).
pub struct Feeder {
    stop: Arc<AtomicBool>,
    handle: Option<JoinHandle<TestResult<u64>>>,
}

impl Feeder {
    pub fn start(bootstrap: &str, topic: &str, rate: f64) -> TestResult<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let mut producer = TestProducer::new(bootstrap, topic)?;
        let stopping = stop.clone();
        let handle = thread::spawn(move || -> TestResult<u64> {
            let started = Instant::now();
            let mut n = 0;
            while n < FEED_CAP && !stopping.load(Ordering::Relaxed) {
                let due = started + Duration::from_secs_f64(n as f64 / rate);
                if let Some(wait) = due.checked_duration_since(Instant::now()) {
                    thread::sleep(wait);
                }
                n += 1;
                producer.send_integer(n)?;
            }
            producer.flush(Duration::from_secs(180))?;
            Ok(n)
        });
        Ok(Self {
            stop,
            handle: Some(handle),
        })
    }

    /// Stops writing, waits for every ack, and returns the last integer
    /// written (all of `1..=n` are in the topic).
    pub fn finish(mut self) -> TestResult<u64> {
        self.stop.store(true, Ordering::Relaxed);
        let handle = self
            .handle
            .take()
            .ok_or("the feeder was already finished")?;
        handle.join().map_err(|_| "the feeder panicked")?
    }
}

impl Drop for Feeder {
    fn drop(&mut self) {
        // Not joined: it ends by itself once it sees the flag.
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// End offsets of topics, asked with one long-lived metadata client.
pub struct Ends {
    client: BaseConsumer,
    bootstrap: String,
    partitions: BTreeMap<String, i32>,
}

impl Ends {
    pub fn new(bootstrap: &str, topics: &[(&str, i32)]) -> TestResult<Self> {
        let client: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", bootstrap)
            .set("allow.auto.create.topics", "false")
            .create()?;
        let partitions = topics.iter().map(|(t, p)| ((*t).to_owned(), *p)).collect();
        Ok(Self {
            client,
            bootstrap: bootstrap.to_owned(),
            partitions,
        })
    }

    fn partitions_of(&self, topic: &str) -> TestResult<i32> {
        Ok(*self
            .partitions
            .get(topic)
            .ok_or_else(|| format!("unknown topic {topic}"))?)
    }

    /// `(low, high)` watermarks of each partition.
    pub fn watermarks(&self, topic: &str) -> TestResult<Vec<(i64, i64)>> {
        let count = self.partitions_of(topic)?;
        (0..count)
            .map(|p| {
                // A broker just thawed or restarted answers "not leader",
                // or the client's metadata says "unknown partition", for a
                // while; that is the broker settling, not a result. A fresh
                // client asks again from scratch.
                let deadline = Instant::now() + Duration::from_secs(60);
                let mut fresh: Option<BaseConsumer> = None;
                loop {
                    let client = fresh.as_ref().unwrap_or(&self.client);
                    match client.fetch_watermarks(topic, p, Duration::from_secs(10)) {
                        Ok(marks) => return Ok(marks),
                        Err(e) if Instant::now() < deadline => {
                            let _ = e;
                            thread::sleep(Duration::from_millis(200));
                            fresh = Some(
                                ClientConfig::new()
                                    .set("bootstrap.servers", &self.bootstrap)
                                    .set("allow.auto.create.topics", "false")
                                    .create()?,
                            );
                        }
                        Err(e) => return Err(e.into()),
                    }
                }
            })
            .collect()
    }

    /// The offsets `group` committed on each partition of `topic`, with
    /// their metadata (`None` where it committed nothing).
    pub fn committed(&self, group: &str, topic: &str) -> TestResult<Vec<Option<(i64, String)>>> {
        let count = self.partitions_of(topic)?;
        let reader: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", &self.bootstrap)
            .set("group.id", group)
            .create()?;
        let mut tpl = rdkafka::TopicPartitionList::new();
        for p in 0..count {
            tpl.add_partition(topic, p);
        }
        let got = reader.committed_offsets(tpl, Duration::from_secs(10))?;
        Ok(got
            .elements()
            .iter()
            .map(|e| match e.offset() {
                rdkafka::Offset::Offset(o) => Some((o, e.metadata().to_owned())),
                _ => None,
            })
            .collect())
    }

    /// Records in `topic`: the sum of its high watermarks.
    pub fn total(&self, topic: &str) -> TestResult<i64> {
        Ok(self.watermarks(topic)?.iter().map(|(_, hi)| hi).sum())
    }

    /// Fails when the broker dropped old records of `topic` (the mock keeps
    /// about 5 MiB per partition), which would make a check meaningless.
    pub fn check_nothing_dropped(&self, topic: &str) -> TestResult {
        let marks = self.watermarks(topic)?;
        if marks.iter().any(|(lo, _)| *lo != 0) {
            return Err(format!(
                "the broker dropped old records of {topic} (watermarks {marks:?}); write less"
            )
            .into());
        }
        Ok(())
    }

    /// Waits until `out` holds at least `target` records, while `p` runs,
    /// polling every `pause`; returns its total.
    pub fn wait_out(&self, target: i64, pause: Duration, p: &mut Proc) -> TestResult<i64> {
        let deadline = Instant::now() + FIRST_OUTPUT_LIMIT;
        let mut polls = 0u32;
        loop {
            let output = self.total("out")?;
            if output >= target {
                return Ok(output);
            }
            polls += 1;
            if polls.is_multiple_of(64) {
                p.check_running()?;
                if Instant::now() >= deadline {
                    return Err(format!(
                        "out has {output} records, not {target}, after {FIRST_OUTPUT_LIMIT:?}"
                    )
                    .into());
                }
            }
            thread::sleep(pause);
        }
    }

    /// Waits until `cond(in, out)` holds for the totals of `in` and `out`,
    /// while `procs` keep running.
    pub fn wait_for(
        &self,
        what: &str,
        limit: Duration,
        procs: &mut [&mut Proc],
        cond: impl Fn(i64, i64) -> bool,
    ) -> TestResult<(i64, i64)> {
        let deadline = Instant::now() + limit;
        loop {
            let (input, output) = (self.total("in")?, self.total("out")?);
            if cond(input, output) {
                return Ok((input, output));
            }
            for p in procs.iter_mut() {
                p.check_running()?;
            }
            if Instant::now() >= deadline {
                return Err(
                    format!("{what}: not reached in {limit:?} (in {input}, out {output})").into(),
                );
            }
            thread::sleep(Duration::from_millis(2));
        }
    }
}

/// Sleeps `d` in small steps, failing as soon as one of `procs` exits.
pub fn sleep_watching(d: Duration, procs: &mut [&mut Proc]) -> TestResult {
    let until = Instant::now() + d;
    loop {
        for p in procs.iter_mut() {
            p.check_running()?;
        }
        let now = Instant::now();
        if now >= until {
            return Ok(());
        }
        thread::sleep((until - now).min(Duration::from_millis(20)));
    }
}

/// The first line of `log` that reports the command's error.
pub fn error_line(log: &Path) -> String {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("replayguard: error: "))
        .unwrap_or("")
        .to_owned()
}

/// Whether the run that logged into `log` stopped because its group
/// session or its lease lapsed: on a loaded machine a broker may answer no
/// heartbeat for the whole session timeout. Such a run says to start it
/// again.
pub fn stopped_fenced(log: &Path) -> bool {
    std::fs::read_to_string(log).is_ok_and(|text| names_a_fenced_kind(&text))
}

/// Whether the failure that first stopped the run that logged into `log`
/// (its `replayguard stopped` line) was a lapsed group session or lease:
/// the command line then exits 75.
pub fn first_failure_fenced(log: &Path) -> bool {
    std::fs::read_to_string(log).is_ok_and(|text| {
        text.lines()
            .find(|l| l.contains("replayguard stopped"))
            .is_some_and(names_a_fenced_kind)
    })
}

fn names_a_fenced_kind(text: &str) -> bool {
    text.contains("error_kind=\"assignment_lost\"") || text.contains("error_kind=\"lease_lapsed\"")
}

/// Runs of [`run_restarted`] at the most.
pub const RESTARTED_RUNS: u32 = 3;

/// Runs `command` (stdout discarded, stderr into `log`) until it exits
/// successfully, each run for at most `limit`. A run that stopped fenced
/// ([`stopped_fenced`]) is started again, as a supervisor would, up to
/// [`RESTARTED_RUNS`] runs in all; any other failure fails at once. Every
/// run works on the same state, so the checks that follow cover them all.
///
/// # Errors
/// A run that failed otherwise, the last run's failure, or one that ran
/// past `limit`.
pub fn run_restarted(
    name: &str,
    log: &Path,
    limit: Duration,
    mut command: impl FnMut() -> Command,
) -> TestResult {
    for run in 1..=RESTARTED_RUNS {
        let log = if run == 1 {
            log.to_owned()
        } else {
            log.with_extension(format!("{run}.log"))
        };
        let mut p = Proc::spawn(
            name.to_owned(),
            command().stdout(Stdio::null()),
            log.clone(),
        )?;
        let status = p.wait(limit)?;
        if status.success() {
            return Ok(());
        }
        if !stopped_fenced(&log) || run == RESTARTED_RUNS {
            return Err(format!(
                "{name} failed ({status}, run {run} of at most {RESTARTED_RUNS}); stderr:\n{}",
                p.log_tail()
            )
            .into());
        }
        println!(
            "{name}: run {run} stopped fenced ({}); starting it again",
            error_line(&log)
        );
    }
    unreachable!("the last run returns")
}

/// A new command with `c`'s program, arguments, environment changes and
/// working folder (a `Command` cannot be cloned, and one run consumes its
/// stdio settings).
#[must_use]
pub fn clone_command(c: &Command) -> Command {
    let mut copy = Command::new(c.get_program());
    copy.args(c.get_args());
    for (k, v) in c.get_envs() {
        match v {
            Some(v) => copy.env(k, v),
            None => copy.env_remove(k),
        };
    }
    if let Some(dir) = c.get_current_dir() {
        copy.current_dir(dir);
    }
    copy
}
