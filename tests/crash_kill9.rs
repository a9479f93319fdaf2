//! Crash tests for G1 and G3: the `replayguard` command, a real process, is
//! killed with SIGKILL at random moments while input keeps arriving, and
//! restarted over the same state folder. The broker is another process
//! that outlives every kill: Apache Kafka (the broker of truth), librdkafka's
//! mock cluster, or Tansu. The output is read back with confluent-kafka, a
//! client that is not ours, and on Kafka also with kafka-python and Kafka's
//! own console consumer, which must read the same.
//!
//! On Kafka and on the mock:
//! - `pipe`, 1 partition: every integer exactly once and in order, after
//!   20 kills during start-up, catch-up and at the tail.
//! - `pipe`, 3 partitions, two instances in one group with their own state
//!   folders, killed independently: every integer once, in order per
//!   partition, each output partition holding its input partition.
//! - The control: `--mode at-least-once` killed once it has copied a while
//!   writes duplicates, so the check above can fail.
//! - `consume` over upstream resends, killed mid-read. It writes and
//!   flushes a record to stdout, then acks it (the ack reaches the store
//!   before the next record is printed), so the record being printed when a
//!   kill lands may be printed again, first, by the next run. Asserted: the
//!   runs' output is the topic's distinct values once each, in topic order,
//!   apart from at most that one repeat per kill.
//! - The broker frozen with SIGSTOP for longer than the request and flush
//!   timeouts: `pipe` waits, or fails with an error line (and is
//!   restarted), and the output is still exactly once.
//!
//! On Kafka only:
//! - `--mode transactional` killed 12 times: every integer once and in
//!   order for `read_committed` readers, on a real transaction coordinator.
//! - The broker killed with SIGKILL and restarted on its log, down for 5 to
//!   40 s: `pipe` waits or fails with an error line, and the output is
//!   still exactly once and in order.
//!
//! On Tansu: the seed scenario. Two variants are ignored: Tansu 0.6's group
//! coordinator, not the guard, stalls them (the evidence is in their
//! `ignore` reasons); the third gives each run a new group.
//!
//! Every test draws its kill plan from a seeded RNG and prints the seed;
//! `CRASH_SEED=<seed>` replays the same plan (the processes' timing still
//! varies). A failure keeps the runs' logs and says where. Each test is
//! bounded in time, and every process it starts is killed when its handle
//! drops.

use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::mpsc::RecvTimeoutError;
use std::thread;
use std::time::{Duration, Instant};

use rand::Rng;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;

use replayguard_testkit::{
    Broker, Ends, FIRST_OUTPUT_LIMIT, Feeder, Frozen, KafkaBroker, MockBroker, Proc, PyClient,
    ReadOptions, Record, TansuBroker, TestResult, check_each_once, check_increasing, error_line,
    first_failure_fenced, integers, lines_of, outcome, produce_integers, read_topic,
    read_topic_with, run_restarted, seeded, sleep_watching, stopped_fenced,
};

/// How long a final `--stop-at-end` run may take (group join, recovery,
/// the rest of the input).
const FINAL_LIMIT: Duration = Duration::from_secs(120);

/// Input records per second written while the pipeline is killed.
const FEED_RATE: f64 = 150.0;

/// At a kill, an output behind its input by at least this many records is
/// catching up; closer, it is at the tail. (On Tansu, which answers a fetch
/// only after its wait time, the tail lags by up to about 75 records.)
const CATCH_UP_LAG: i64 = 100;

// ---------------------------------------------------------------------------
// Seeds, processes, input

/// The `replayguard` command, logging at `info` (into each run's log file).
fn replayguard() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_replayguard"));
    c.env("RUST_LOG", "info,librdkafka=debug")
        .env_remove("RUST_BACKTRACE");
    c
}

/// `replayguard pipe` from `in` to `out`.
fn pipe(bootstrap: &str, group: &str, state: &Path, mode: &str, extra: &[&str]) -> Command {
    let mut c = replayguard();
    c.arg("pipe")
        .args(["--brokers", bootstrap, "--group", group])
        .args(["--input", "in", "--output", "out", "--mode", mode])
        .arg("--state")
        .arg(state)
        .args(extra);
    // The new group protocol keeps the session timeout on the broker.
    let own_timeout = extra
        .iter()
        .any(|a| *a == "group.protocol=consumer" || a.starts_with("session.timeout.ms="));
    if !own_timeout {
        c.args(["-X", "session.timeout.ms=6000"]);
    }
    c
}

/// The final guarded `pipe --stop-at-end` of group `group` (see
/// [`run_final`]), logging into `pipe-final.log`.
fn final_guarded_pipe(bootstrap: &str, group: &str, state: &Path, logs: &Path) -> TestResult {
    run_final(
        "final pipe --stop-at-end",
        &logs.join("pipe-final.log"),
        || pipe(bootstrap, group, state, "guarded", &["--stop-at-end"]),
    )
}

/// Runs a final `--stop-at-end` pipe, `command`, to success (see
/// [`replayguard_testkit::run_restarted`]).
fn run_final(name: &str, log: &Path, command: impl FnMut() -> Command) -> TestResult {
    run_restarted(name, log, FINAL_LIMIT, command)
}

// ---------------------------------------------------------------------------
// Kill plans

/// When to kill one run of `pipe`.
#[derive(Debug, Clone, Copy)]
enum Plan {
    /// This long after it started, whatever it is doing.
    Timed(Duration),
    /// While it catches up: once it wrote its first output, after
    /// `fraction` of the backlog it found.
    CatchUp(f64),
    /// At the tail: once it caught up with the input, after this long.
    Tail(Duration),
}

/// Where a kill landed, judged from the watermarks just before it.
#[derive(Debug, Default, Clone, Copy)]
struct Landed {
    /// No output from this run yet: starting, joining the group,
    /// recovering.
    startup: u32,
    /// Output behind input by `CATCH_UP_LAG` or more.
    catch_up: u32,
    /// Output close behind input.
    tail: u32,
    /// No kill: the run stopped by itself first, fenced (see
    /// [`stopped_fenced`]).
    fenced: u32,
}

impl Landed {
    /// The runs that ended, killed or fenced.
    fn total(self) -> u32 {
        self.startup + self.catch_up + self.tail + self.fenced
    }

    fn record(&mut self, new_outputs: i64, lag: i64) -> &'static str {
        if new_outputs <= 0 {
            self.startup += 1;
            "start-up"
        } else if lag >= CATCH_UP_LAG {
            self.catch_up += 1;
            "catch-up"
        } else {
            self.tail += 1;
            "tail"
        }
    }
}

/// A shuffled plan of `kills` kills: a few early ones (during start-up or
/// recovery, the first possibly while the state folder is created), a few
/// at random times, and the rest split between catch-up and the tail.
fn kill_plans(rng: &mut StdRng, kills: usize) -> Vec<Plan> {
    let early = 2.min(kills);
    let timed = (kills / 5).min(kills - early);
    let rest = kills - early - timed;
    let mut plans: Vec<Plan> = Vec::with_capacity(kills);
    for _ in 0..early {
        plans.push(Plan::Timed(Duration::from_millis(rng.random_range(5..400))));
    }
    for _ in 0..timed {
        plans.push(Plan::Timed(Duration::from_millis(
            rng.random_range(400..9_000),
        )));
    }
    for i in 0..rest {
        if i % 2 == 0 {
            plans.push(Plan::CatchUp(rng.random_range(0.02..0.5)));
        } else {
            plans.push(Plan::Tail(Duration::from_millis(
                rng.random_range(0..2_000),
            )));
        }
    }
    plans.shuffle(rng);
    plans
}

/// What every run of `pipe` in a kill loop shares.
struct PipeRuns<'a> {
    bootstrap: &'a str,
    state: &'a Path,
    logs: &'a Path,
    /// Extra arguments of every run.
    extra: &'a [&'a str],
    /// Each run in a consumer group of its own, new to the broker: where
    /// to resume then comes from the state folder alone.
    fresh_group: bool,
    /// Before a run planned to be killed during catch-up, wait until the
    /// output is this far behind (a broker that lets a member rejoin at
    /// once leaves no backlog otherwise).
    backlog: i64,
    /// `--mode` of every run.
    mode: &'a str,
}

impl PipeRuns<'_> {
    /// Starts run `run` of guarded `pipe` with `args`.
    fn spawn(&self, run: &str, args: &[&str]) -> TestResult<Proc> {
        Proc::spawn(
            format!("pipe run {run}"),
            self.command(run, args).stdout(Stdio::null()),
            self.logs.join(format!("pipe-{run}.log")),
        )
    }

    /// The command of run `run` with `args`.
    fn command(&self, run: &str, args: &[&str]) -> Command {
        let group = if self.fresh_group {
            format!("crash-{run}")
        } else {
            "crash".to_owned()
        };
        // A new group is another job to the state folder: each run hands
        // the folder over on purpose. Its group holds no member killed
        // before, so nothing needs the short session timeout that expires
        // them, and a long one rides out a broker slowed by a loaded machine.
        let fresh: &[&str] = if self.fresh_group {
            &["--rebind", "-X", "session.timeout.ms=30000"]
        } else {
            &[]
        };
        pipe(
            self.bootstrap,
            &group,
            self.state,
            self.mode,
            &[args, self.extra, fresh].concat(),
        )
    }

    /// The final `--stop-at-end` run, to success (see [`run_final`]).
    fn finish(&self) -> TestResult {
        run_final("pipe run final", &self.logs.join("pipe-final.log"), || {
            self.command("final", &["--stop-at-end"])
        })
    }
}

/// Runs `pipe` once per plan and kills each run where its plan says. Input
/// must be arriving meanwhile.
fn kill_pipe_repeatedly(
    runs: &PipeRuns<'_>,
    ends: &Ends,
    plans: &[Plan],
    rng: &mut StdRng,
) -> TestResult<Landed> {
    let mut landed = Landed::default();
    for (i, plan) in plans.iter().enumerate() {
        // Short and long checkpoint intervals: kills land in checkpoints,
        // and after long stretches of unrecorded progress.
        let interval = ["200ms", "1s", "3s"][rng.random_range(0..3)];
        if let Plan::CatchUp(_) = plan {
            let deadline = Instant::now() + Duration::from_secs(30);
            while ends.total("in")? - ends.total("out")? < runs.backlog && Instant::now() < deadline
            {
                thread::sleep(Duration::from_millis(50));
            }
        }
        let out_before = ends.total("out")?;
        let mut p = runs.spawn(&i.to_string(), &["--checkpoint-interval", interval])?;
        let started = Instant::now();
        let log = p.log.clone();
        let watched = (|p: &mut Proc| -> TestResult<(i64, i64)> {
            match *plan {
                Plan::Timed(d) => sleep_watching(d, &mut [p])?,
                Plan::CatchUp(fraction) => {
                    // Only `out` is polled, and without a pause: a backlog
                    // of a thousand records is copied in tens of
                    // milliseconds.
                    let first = ends.wait_out(out_before + 1, Duration::from_millis(1), p)?;
                    let backlog = ends.total("in")? - out_before;
                    let target = out_before + ((backlog as f64 * fraction) as i64).max(1);
                    if first < target {
                        ends.wait_out(target, Duration::ZERO, p)?;
                    }
                }
                Plan::Tail(d) => {
                    ends.wait_for("tail", FIRST_OUTPUT_LIMIT, &mut [p], |i, o| {
                        o > out_before && i - o < CATCH_UP_LAG / 2
                    })?;
                    sleep_watching(d, &mut [p])?;
                }
            }
            Ok((ends.total("in")?, ends.total("out")?))
        })(&mut p);
        // kill9 fails when the run exited by itself just before.
        let killed = match watched {
            Ok(watermarks) => p.kill9().map(|()| watermarks),
            Err(e) if p.exited()?.is_some() => Err(e),
            Err(e) => return Err(e),
        };
        // A run that stopped by itself because its session or lease lapsed
        // was told to be started again, which the next run does.
        let (input, output) = match killed {
            Err(e) if !stopped_fenced(&log) => return Err(e),
            Err(_) => {
                landed.fenced += 1;
                println!(
                    "kill {i:2}: {plan:?}, checkpoint every {interval}: the run stopped by \
                     itself first, fenced after {:?}: {}",
                    started.elapsed(),
                    error_line(&log)
                );
                continue;
            }
            Ok(watermarks) => watermarks,
        };
        let phase = landed.record(output - out_before, input - output);
        println!(
            "kill {i:2}: {plan:?}, checkpoint every {interval}, after {:?}: {phase} \
             (in {input}, out {output}, {} new)",
            started.elapsed(),
            output - out_before
        );
    }
    Ok(landed)
}

/// Reads `out` with confluent-kafka, checking that the broker kept all of it.
fn read_output(bootstrap: &str, ends: &Ends) -> TestResult<Vec<Record>> {
    ends.check_nothing_dropped("in")?;
    ends.check_nothing_dropped("out")?;
    read_topic(bootstrap, "out", PyClient::Confluent)
}

/// The values of `records` by partition, each in read (offset) order.
fn by_partition(records: &[Record]) -> TestResult<BTreeMap<i32, Vec<u64>>> {
    let mut parts: BTreeMap<i32, Vec<u64>> = BTreeMap::new();
    for r in records {
        parts
            .entry(r.partition)
            .or_default()
            .extend(integers(std::slice::from_ref(r))?);
    }
    Ok(parts)
}

// ---------------------------------------------------------------------------
// pipe, one partition

/// A seed scenario: how many kills, and how the runs join their group.
struct Scenario<'a> {
    name: &'a str,
    kills: usize,
    /// Extra arguments of every run.
    extra: &'a [&'a str],
    /// See [`PipeRuns::fresh_group`].
    fresh_group: bool,
    /// See [`PipeRuns::backlog`].
    backlog: i64,
    /// Whether kills must be seen to land during catch-up. A broker that
    /// answers fetches in large bursts after a wait (Tansu) often copies a
    /// whole backlog between two looks at the watermarks.
    catch_up_seen: bool,
    /// `--mode` of every run: `guarded`, or `transactional`, whose output
    /// is read with `read_committed`.
    mode: &'a str,
    /// On Apache Kafka, the output is also read by kafka-python and by
    /// Kafka's own console consumer, which must read the same.
    kafka: Option<&'a KafkaBroker>,
}

/// The seed scenario on any broker: kills of `pipe` while integers arrive,
/// then `pipe --stop-at-end`; every integer once and in order.
fn seed_scenario(bootstrap: &str, sc: &Scenario<'_>) -> TestResult {
    let (test, kills) = (sc.name, sc.kills);
    let (seed, mut rng) = seeded(test);
    let started = Instant::now();
    let logs = tempfile::Builder::new().prefix("crash-logs-").tempdir()?;
    let result = (|| -> TestResult {
        let ends = Ends::new(bootstrap, &[("in", 1), ("out", 1)])?;
        let state = tempfile::tempdir()?;
        let runs = PipeRuns {
            bootstrap,
            state: state.path(),
            logs: logs.path(),
            extra: sc.extra,
            fresh_group: sc.fresh_group,
            backlog: sc.backlog,
            mode: sc.mode,
        };
        let plans = kill_plans(&mut rng, kills);
        let feeder = Feeder::start(bootstrap, "in", FEED_RATE)?;
        let landed = kill_pipe_repeatedly(&runs, &ends, &plans, &mut rng)?;
        let n = feeder.finish()?;
        runs.finish()?;
        let committed = sc.mode == "transactional";
        ends.check_nothing_dropped("in")?;
        ends.check_nothing_dropped("out")?;
        let read = |client| {
            read_topic_with(
                bootstrap,
                "out",
                &ReadOptions {
                    client,
                    read_committed: committed,
                    ..ReadOptions::default()
                },
            )
        };
        let values = integers(&read(PyClient::Confluent)?)?;
        check_each_once(&values, 1..=n)?;
        check_increasing(&values)?;
        if let Some(kafka) = sc.kafka {
            let by_python = integers(&read(PyClient::KafkaPython)?)?;
            let by_console: Vec<u64> = kafka
                .console_read("out", committed, Some(n), Duration::from_secs(15))?
                .into_iter()
                .map(|(_, v)| v.parse::<u64>())
                .collect::<Result<_, _>>()?;
            if by_python != values || by_console != values {
                return Err(format!(
                    "the clients disagree: confluent-kafka read {}, kafka-python {}, the \
                     console consumer {} values",
                    values.len(),
                    by_python.len(),
                    by_console.len()
                )
                .into());
            }
        }
        println!(
            "{test}: {} kills ({landed:?}), {n} integers each once and in order, {:?}",
            landed.total(),
            started.elapsed()
        );
        // Half the rest were planned for catch-up and half for the tail; a
        // catch-up plan lands at the tail when the backlog goes too fast.
        let planned = kills.saturating_sub(2 + kills / 5) as u32 / 2;
        if landed.total() != kills as u32
            || (sc.catch_up_seen && landed.catch_up < (planned / 3).max(1))
            || landed.tail < (planned / 2).max(1)
        {
            return Err(format!(
                "the kills did not land where planned: {landed:?} of {kills}; a test that \
                 never kills during catch-up or at the tail proves less than it says"
            )
            .into());
        }
        Ok(())
    })();
    outcome(result, seed, logs)
}

#[test]
fn pipe_killed_20_times_while_input_arrives_copies_each_integer_once_in_order() -> TestResult {
    let broker = MockBroker::start(&[("in", 1), ("out", 1)])?;
    seed_scenario(
        &broker.servers(),
        &Scenario {
            name: "seed scenario, mock broker",
            kills: 20,
            extra: &[],
            fresh_group: false,
            backlog: 0,
            catch_up_seen: true,
            mode: "guarded",
            kafka: None,
        },
    )
}

// ---------------------------------------------------------------------------
// pipe, three partitions, two instances

/// Kills of one of the two instances, in the loop.
const PAIR_KILLS: usize = 12;

fn two_pipes_killed_independently(broker: &dyn Broker) -> TestResult {
    let (seed, mut rng) = seeded(&format!("two instances, 3 partitions, {}", broker.kind()));
    let bootstrap = &broker.servers();
    let started = Instant::now();
    let logs = tempfile::Builder::new().prefix("crash-logs-").tempdir()?;
    let result = (|| -> TestResult {
        let ends = Ends::new(bootstrap, &[("in", 3), ("out", 3)])?;
        let states = [tempfile::tempdir()?, tempfile::tempdir()?];
        let names = ["A", "B"];
        let mut runs = [0usize; 2];
        let mut spawn = |who: usize| -> TestResult<Proc> {
            runs[who] += 1;
            let name = format!("pipe {} run {}", names[who], runs[who]);
            Proc::spawn(
                name.clone(),
                pipe(
                    bootstrap,
                    "pair",
                    states[who].path(),
                    "guarded",
                    &["--checkpoint-interval", "500ms"],
                )
                .stdout(Stdio::null()),
                logs.path().join(format!("{name}.log")),
            )
        };
        let feeder = Feeder::start(bootstrap, "in", FEED_RATE)?;
        let mut procs = [Some(spawn(0)?), Some(spawn(1)?)];
        let mut kills = [0u32; 2];
        let mut landed = Landed::default();
        let mut out_before = ends.total("out")?;
        for k in 0..PAIR_KILLS {
            let who = rng.random_range(0..2);
            let since = Instant::now();
            let mut both: Vec<&mut Proc> = procs.iter_mut().flatten().collect();
            // Mostly once the group writes again after the last kill (it
            // rebalances twice per kill), sometimes at any moment.
            let (when, delay) = if rng.random_bool(0.25) {
                (
                    "at any moment",
                    Duration::from_millis(rng.random_range(300..6_000)),
                )
            } else {
                ends.wait_for(
                    "output after a kill",
                    FIRST_OUTPUT_LIMIT,
                    &mut both,
                    |_, o| o > out_before,
                )?;
                (
                    "once output resumed",
                    Duration::from_millis(rng.random_range(0..3_000)),
                )
            };
            sleep_watching(delay, &mut both)?;
            let (input, output) = (ends.total("in")?, ends.total("out")?);
            // Killed before its successor starts: one state folder, one
            // process.
            procs[who].take().ok_or("no run to kill")?.kill9()?;
            procs[who] = Some(spawn(who)?);
            kills[who] += 1;
            let phase = landed.record(output - out_before, input - output);
            println!(
                "kill {k:2}: {} {when}, {delay:?} later ({:?} since the last kill): {phase} \
                 (in {input}, out {output}, {} new since the last kill)",
                names[who],
                since.elapsed(),
                output - out_before
            );
            out_before = output;
        }
        for p in procs.into_iter().flatten() {
            p.kill9()?;
        }
        let n = feeder.finish()?;
        // The last state of each partition is split between the two folders.
        // A alone takes all three over; then B, whose state is older for
        // every partition A finished, must find nothing left to write.
        for (who, state) in states.iter().enumerate() {
            run_final(
                &format!("final pipe {} --stop-at-end", names[who]),
                &logs.path().join(format!("final-{}.log", names[who])),
                || {
                    pipe(
                        bootstrap,
                        "pair",
                        state.path(),
                        "guarded",
                        &["--stop-at-end"],
                    )
                },
            )?;
        }
        let copied = read_output(bootstrap, &ends)?;
        check_each_once(&integers(&copied)?, 1..=n)?;
        // One output partition per input partition, in the same order.
        let input = by_partition(&read_topic(bootstrap, "in", PyClient::Confluent)?)?;
        let output = by_partition(&copied)?;
        for (p, values) in &output {
            check_increasing(values).map_err(|e| format!("out[{p}]: {e}"))?;
        }
        if input != output {
            return Err("each output partition should hold its input partition's values".into());
        }
        println!(
            "two instances: {} kills of A, {} of B, 2 at the end ({landed:?}); {n} integers each \
             once, in order per partition; {:?}",
            kills[0],
            kills[1],
            started.elapsed()
        );
        if landed.catch_up + landed.tail < PAIR_KILLS as u32 / 3 {
            return Err(format!(
                "too few kills landed while output moved: {landed:?}; the group spent the run \
                 rebalancing"
            )
            .into());
        }
        Ok(())
    })();
    outcome(result, seed, logs)
}

// ---------------------------------------------------------------------------
// The control: at-least-once under the same kills

fn control_at_least_once(broker: &dyn Broker) -> TestResult {
    const KILLS: usize = 5;
    let (seed, mut rng) = seeded(&format!("control, at-least-once, {}", broker.kind()));
    let bootstrap = &broker.servers();
    let started = Instant::now();
    let logs = tempfile::Builder::new().prefix("crash-logs-").tempdir()?;
    let result = (|| -> TestResult {
        let ends = Ends::new(bootstrap, &[("in", 1), ("out", 1)])?;
        let state = tempfile::tempdir()?;
        let feeder = Feeder::start(bootstrap, "in", FEED_RATE)?;
        for i in 0..KILLS {
            let out_before = ends.total("out")?;
            let mut p = Proc::spawn(
                format!("at-least-once pipe run {i}"),
                pipe(bootstrap, "control", state.path(), "at-least-once", &[])
                    .stdout(Stdio::null()),
                logs.path().join(format!("pipe-{i}.log")),
            )?;
            // Killed once it has copied a while, as the guarded runs are:
            // its last offset commit (every second) is behind what it wrote.
            let copies = rng.random_range(100..600);
            let output = ends.wait_out(out_before + copies, Duration::from_millis(1), &mut p)?;
            p.kill9()?;
            println!(
                "control kill {i}: after {} new outputs",
                output - out_before
            );
        }
        let n = feeder.finish()?;
        run_final(
            "final at-least-once pipe --stop-at-end",
            &logs.path().join("pipe-final.log"),
            || {
                pipe(
                    bootstrap,
                    "control",
                    state.path(),
                    "at-least-once",
                    &["--stop-at-end"],
                )
            },
        )?;
        let values = integers(&read_output(bootstrap, &ends)?)?;
        // Nothing lost: at least once holds.
        let distinct: BTreeSet<u64> = values.iter().copied().collect();
        if distinct != (1..=n).collect() {
            return Err(format!(
                "at-least-once lost records: {} distinct of {n}",
                distinct.len()
            )
            .into());
        }
        // A replay shows as a value not above the one before it.
        let replays = values.windows(2).filter(|w| w[1] <= w[0]).count();
        let duplicates = values.len() - distinct.len();
        println!(
            "control: {KILLS} kills, {duplicates} duplicates in {replays} replays, {:?}",
            started.elapsed()
        );
        if check_each_once(&values, 1..=n).is_ok() || replays < KILLS - 2 {
            return Err(format!(
                "at-least-once under {KILLS} kills should replay after most of them: \
                 {duplicates} duplicates in {replays} replays; the kills do not test what \
                 they claim"
            )
            .into());
        }
        Ok(())
    })();
    outcome(result, seed, logs)
}

// ---------------------------------------------------------------------------
// consume: the guarded reader

/// The topic: blocks of `1..=40` then the resends `32 34 35 36 40 41 46 31
/// 33 37 38 39 42 43 44 45` (41..=46 are new), each block shifted by 100;
/// then, after all blocks, the first five values of every tenth block sent
/// again, far from where they were first seen.
fn resend_topic(blocks: u64) -> Vec<u64> {
    const RESENT: [u64; 16] = [
        32, 34, 35, 36, 40, 41, 46, 31, 33, 37, 38, 39, 42, 43, 44, 45,
    ];
    let mut values = Vec::new();
    for b in 0..blocks {
        values.extend((1..=40).map(|v| b * 100 + v));
        values.extend(RESENT.iter().map(|v| b * 100 + v));
    }
    for b in (0..blocks).step_by(10) {
        values.extend((1..=5).map(|v| b * 100 + v));
    }
    values
}

/// What one `consume` run printed, and whether it was killed.
struct Printed {
    values: Vec<u64>,
    killed: bool,
}

/// Joins what the runs printed, removing the repeats a kill may cause: the
/// record being printed when the kill landed was written but maybe not
/// acked, so the next run that prints anything may print it first, again.
/// Returns the joined values and the repeats as `(run, value)`.
fn join_runs(runs: &[Printed]) -> (Vec<u64>, Vec<(usize, u64)>) {
    let mut joined: Vec<u64> = Vec::new();
    let mut repeats = Vec::new();
    let mut last_killed = false;
    for (i, run) in runs.iter().enumerate() {
        let mut values = &run.values[..];
        if last_killed && !values.is_empty() && values.first() == joined.last() {
            repeats.push((i, values[0]));
            values = &values[1..];
        }
        joined.extend_from_slice(values);
        if !run.values.is_empty() {
            last_killed = run.killed;
        } else {
            // A run that printed nothing passes the unacked record on.
            last_killed |= run.killed;
        }
    }
    (joined, repeats)
}

fn consume_killed_mid_read(broker: &dyn Broker) -> TestResult {
    const KILLS: usize = 6;
    let (seed, mut rng) = seeded(&format!("consume over resends, {}", broker.kind()));
    let bootstrap = &broker.servers();
    let started = Instant::now();
    let logs = tempfile::Builder::new().prefix("crash-logs-").tempdir()?;
    let result = (|| -> TestResult {
        let topic = resend_topic(100);
        produce_integers(bootstrap, "events", topic.iter().copied())?;
        let mut seen = BTreeSet::new();
        let expected: Vec<u64> = topic.iter().copied().filter(|v| seen.insert(*v)).collect();
        let state = tempfile::tempdir()?;
        let consume = |extra: &[&str]| {
            let mut c = replayguard();
            c.arg("consume")
                .args([
                    "--brokers",
                    bootstrap,
                    "--group",
                    "reader",
                    "--topic",
                    "events",
                ])
                .arg("--state")
                .arg(state.path())
                .args(["--retention-time", "1h", "-X", "session.timeout.ms=6000"])
                .args(extra)
                .stdout(Stdio::piped());
            c
        };
        let mut runs: Vec<Printed> = Vec::new();
        for i in 0..=KILLS {
            let last = i == KILLS;
            let interval = ["200ms", "1s"][rng.random_range(0..2)];
            let mut extra = vec!["--checkpoint-interval", interval];
            if last {
                extra.push("--stop-at-end");
            }
            let mut p = Proc::spawn(
                format!("consume run {i}"),
                &mut consume(&extra),
                logs.path().join(format!("consume-{i}.log")),
            )?;
            let lines = lines_of(p.take_stdout()?);
            // Spread the kills over what is left to print.
            let left = expected
                .len()
                .saturating_sub(runs.iter().map(|r| r.values.len()).sum());
            let kill_after =
                rng.random_range(1..=(2 * left / (KILLS + 1 - i)).clamp(1, left.max(1)));
            let mut values = Vec::new();
            let mut killed = false;
            loop {
                match lines.recv_timeout(FIRST_OUTPUT_LIMIT) {
                    Ok(line) => {
                        values.push(line.parse::<u64>().map_err(|e| {
                            format!("consume run {i} printed {line:?}, not a value: {e}")
                        })?);
                        if !last && !killed && values.len() >= kill_after {
                            // Later lines already in the pipe are still read.
                            p.check_running()?;
                            p.child.kill()?;
                            killed = true;
                        }
                    }
                    Err(RecvTimeoutError::Disconnected) => break,
                    Err(RecvTimeoutError::Timeout) => {
                        return Err(format!(
                            "consume run {i} printed nothing for {FIRST_OUTPUT_LIMIT:?} after {} \
                             lines; stderr:\n{}",
                            values.len(),
                            p.log_tail()
                        )
                        .into());
                    }
                }
            }
            let status = p.wait(Duration::from_secs(30))?;
            if killed && status.signal() != Some(libc::SIGKILL) {
                return Err(format!("consume run {i} exited by itself ({status})").into());
            }
            if !killed && !status.success() {
                return Err(format!(
                    "consume run {i} failed ({status}); stderr:\n{}",
                    p.log_tail()
                )
                .into());
            }
            println!(
                "consume run {i}: {} lines{}, checkpoint every {interval}",
                values.len(),
                if killed {
                    format!(", killed after line {kill_after}")
                } else {
                    String::new()
                }
            );
            runs.push(Printed { values, killed });
        }
        let (joined, repeats) = join_runs(&runs);
        println!(
            "consume: {KILLS} kills, {} values printed once, repeats at kills (run, value): \
             {repeats:?}; {:?}",
            joined.len(),
            started.elapsed()
        );
        if joined != expected {
            let at = joined
                .iter()
                .zip(&expected)
                .position(|(a, b)| a != b)
                .unwrap_or(joined.len().min(expected.len()));
            return Err(format!(
                "the runs printed {} values where {} were expected (each once, in topic \
                 order, apart from one repeat per kill); first difference at {at}: printed \
                 {:?}, expected {:?}",
                joined.len(),
                expected.len(),
                &joined[at.saturating_sub(3)..(at + 4).min(joined.len())],
                &expected[at.saturating_sub(3)..(at + 4).min(expected.len())]
            )
            .into());
        }
        Ok(())
    })();
    outcome(result, seed, logs)
}

// ---------------------------------------------------------------------------
// Broker trouble

fn pipe_through_a_frozen_broker(broker: &dyn Broker) -> TestResult {
    let (seed, mut rng) = seeded(&format!("broker frozen with SIGSTOP, {}", broker.kind()));
    let bootstrap = &broker.servers();
    let started = Instant::now();
    let logs = tempfile::Builder::new().prefix("crash-logs-").tempdir()?;
    let result = (|| -> TestResult {
        let ends = Ends::new(bootstrap, &[("in", 1), ("out", 1)])?;
        let state = tempfile::tempdir()?;
        let mut runs = 0;
        let mut spawn = || -> TestResult<Proc> {
            runs += 1;
            Proc::spawn(
                format!("pipe run {runs}"),
                pipe(bootstrap, "frozen", state.path(), "guarded", &[]).stdout(Stdio::null()),
                logs.path().join(format!("pipe-{runs}.log")),
            )
        };
        // (seconds frozen, when, kill the pipe while frozen). 40 s is past
        // librdkafka's 30 s request timeout and the pipeline's 30 s flush
        // timeout; at the tail little is in flight, during a catch-up much
        // is. The kill -9 leaves produce requests that the broker reads only
        // after the thaw, when their sender is gone.
        let mut episodes = [
            (40u64, "tail", false),
            (40, "catch-up", false),
            (15, "tail", true),
        ];
        episodes.shuffle(&mut rng);
        let feeder = Feeder::start(bootstrap, "in", FEED_RATE)?;
        let mut p = spawn()?;
        let mut outcomes = Vec::new();
        let mut kills = 0;
        for (secs, when, kill) in episodes {
            if when == "tail" {
                ends.wait_for(
                    "tail before the freeze",
                    FIRST_OUTPUT_LIMIT,
                    &mut [&mut p],
                    |i, o| o > 0 && i - o < CATCH_UP_LAG / 5,
                )?;
            } else {
                // A fresh run after a few seconds away has a backlog: freeze
                // as soon as it starts copying it.
                p.kill9()?;
                kills += 1;
                let out_before = ends.total("out")?;
                p = spawn()?;
                // A restart soon after a thaw has been seen to stay without
                // output (assigned, reconciled, then nothing for 60 s, on
                // Kafka 4.4): once, it is killed and started again.
                if let Err(e) = ends.wait_out(out_before + 1, Duration::ZERO, &mut p) {
                    if p.exited()?.is_some() {
                        return Err(e);
                    }
                    println!("before the catch-up freeze: {e}; killed and started again");
                    p.kill9()?;
                    kills += 1;
                    p = spawn()?;
                    ends.wait_out(out_before + 1, Duration::ZERO, &mut p)?;
                }
            }
            // While frozen nothing may ask the broker anything: it would hang.
            let frozen = Frozen::freeze(broker.broker_pid().ok_or("the broker has no process")?)?;
            let mut killed = false;
            if kill {
                thread::sleep(Duration::from_millis(rng.random_range(500..5_000)));
                p.check_running()?;
                p.child.kill()?;
                killed = true;
                kills += 1;
            }
            let until = Instant::now() + Duration::from_secs(secs);
            while Instant::now() < until && p.exited()?.is_none() {
                thread::sleep(Duration::from_millis(50));
            }
            thread::sleep(until.saturating_duration_since(Instant::now()));
            frozen.thaw()?;
            // Every output written before the freeze copies an input that
            // was in the topic then, so more outputs than the input held at
            // the thaw mean a run has copied since: the feeder's records
            // stay unacked while the broker is frozen, and without that
            // condition the tail could be reached by a run that writes
            // nothing.
            let in_at_thaw = ends.total("in")?;
            let copied_since_thaw = |i: i64, o: i64| o > in_at_thaw && i - o < CATCH_UP_LAG / 5;
            // It exits on its own only with an error; then it is restarted.
            let outcome = match p.exited()? {
                Some(status) if killed => format!("killed while frozen ({status})"),
                Some(status) => {
                    let line = error_line(&p.log);
                    if !stopped_with_an_error(status, &p.log, &line) {
                        return Err(format!(
                            "after a {secs} s freeze the pipe exited with {status} without \
                             an error line and its status; stderr:\n{}",
                            p.log_tail()
                        )
                        .into());
                    }
                    format!("exited {status}: {line}")
                }
                None => "waited".to_owned(),
            };
            if p.exited()?.is_some() {
                p = spawn()?;
            }
            // Back at the tail, having copied since the thaw, restarting
            // once more if the first restart also meets the aftermath of the
            // freeze.
            let caught_up = ends.wait_for(
                "tail after the thaw",
                Duration::from_secs(90),
                &mut [&mut p],
                copied_since_thaw,
            );
            // A run still up but with no output at all since the thaw met
            // the broker's own aftermath: once, on Kafka 4.4 under load, the
            // thawed broker left metadata requests unanswered for 35 s and
            // then gave a rejoining static member no assignment for 90 s.
            // It is killed, and then handled like a run that exited.
            let stuck =
                caught_up.is_err() && p.exited()?.is_none() && ends.total("out")? <= in_at_thaw;
            if stuck {
                p.child.kill()?;
                p.child.wait()?;
                kills += 1;
            }
            let outcome = match caught_up {
                Ok(_) => outcome,
                Err(e) if p.exited()?.is_some() => {
                    let again = if stuck {
                        format!("{outcome}; then no output for 90 s, killed")
                    } else {
                        format!("{outcome}; then {}", error_line(&p.log))
                    };
                    println!("after the thaw: {e}");
                    p = spawn()?;
                    ends.wait_for(
                        "tail after a second restart",
                        Duration::from_secs(90),
                        &mut [&mut p],
                        copied_since_thaw,
                    )?;
                    again
                }
                Err(e) => return Err(e),
            };
            let outcome = format!(
                "frozen {secs} s at the {when}{}: {outcome}",
                if kill { ", pipe killed meanwhile" } else { "" }
            );
            println!("{outcome}");
            outcomes.push(outcome);
        }
        p.kill9()?;
        kills += 1;
        let n = feeder.finish()?;
        final_guarded_pipe(bootstrap, "frozen", state.path(), logs.path())?;
        let values = integers(&read_output(bootstrap, &ends)?)?;
        check_each_once(&values, 1..=n)?;
        check_increasing(&values)?;
        println!(
            "broker frozen: {outcomes:?}; {kills} kills; {n} integers each once and in order, {:?}",
            started.elapsed()
        );
        Ok(())
    })();
    outcome(result, seed, logs)
}

// ---------------------------------------------------------------------------
// Tansu
//
// The seed scenario on Tansu 0.6 (sqlite storage, a fresh broker per test).
// Tansu's group coordinator, not the guard, breaks the first two; the third
// keeps the group out of the way, and is the one that runs.

#[test]
#[ignore = "known Tansu 0.6 gap: a static group member (group.instance.id, which replayguard \
            sets from its state folder) stops getting records. On a fresh Tansu the first \
            `pipe` copied its first fetch (1325 records), then nothing for 45 s while the \
            input grew to 6750, in guarded and at-least-once mode alike; a confluent-kafka \
            consumer with a group.instance.id got no record for 40 s; with dynamic \
            membership both keep up"]
fn pipe_killed_while_input_arrives_on_tansu_copies_each_integer_once_in_order() -> TestResult {
    let broker = TansuBroker::start(&[("in", 1), ("out", 1)])?;
    seed_scenario(
        &broker.servers(),
        &Scenario {
            name: "seed scenario, Tansu",
            kills: 10,
            extra: &[],
            fresh_group: false,
            backlog: 0,
            catch_up_seen: false,
            mode: "guarded",
            kafka: None,
        },
    )
}

#[test]
#[ignore = "known Tansu 0.6 gap: a killed member stays in the group for good. With \
            -X debug=cgrp the restarted (only live) member got JoinGroup generation 6 whose \
            leader was a member killed earlier, then SyncGroup success with 0 partitions \
            without the leader ever syncing, and heartbeated in generation 6 with no \
            assignment and no rebalance for 50 s; 2 of 5 runs stalled so, the 3 that \
            finished were exactly once"]
fn pipe_killed_while_input_arrives_on_tansu_as_a_dynamic_member_copies_each_integer_once()
-> TestResult {
    let broker = TansuBroker::start(&[("in", 1), ("out", 1)])?;
    // An empty group.instance.id makes the member dynamic.
    seed_scenario(
        &broker.servers(),
        &Scenario {
            name: "seed scenario, Tansu, dynamic membership",
            kills: 10,
            extra: &["-X", "group.instance.id="],
            fresh_group: false,
            backlog: 0,
            catch_up_seen: false,
            mode: "guarded",
            kafka: None,
        },
    )
}

#[test]
fn pipe_killed_while_input_arrives_on_tansu_resumes_from_its_state_in_a_new_group() -> TestResult {
    let broker = TansuBroker::start(&[("in", 1), ("out", 1)])?;
    // Every run in a group new to the broker: Tansu has no dead member to
    // keep, and the group has no committed offset, so each run resumes from
    // its state folder alone (DESIGN: the manifest is the truth).
    seed_scenario(
        &broker.servers(),
        &Scenario {
            name: "seed scenario, Tansu, a new group per run",
            kills: 12,
            extra: &["-X", "group.instance.id="],
            fresh_group: true,
            backlog: 1_000,
            catch_up_seen: false,
            mode: "guarded",
            kafka: None,
        },
    )
}

// ---------------------------------------------------------------------------
// The suites on each broker: librdkafka's mock cluster in its own process,
// and Apache Kafka, the broker of truth.

#[test]
fn on_kafka_pipe_killed_20_times_while_input_arrives_copies_each_integer_once_in_order()
-> TestResult {
    let broker = KafkaBroker::start(&[("in", 1), ("out", 1)])?;
    seed_scenario(
        &broker.servers(),
        &Scenario {
            name: "seed scenario, kafka",
            kills: 20,
            extra: &[],
            fresh_group: false,
            // A static member rejoins at once: without a backlog there is
            // no catch-up to kill in. Admitted 256 records a poll, a backlog
            // of 300 was copied in about two polls, and all but 1 of 7
            // catch-up kills landed at the tail.
            backlog: 1_200,
            catch_up_seen: true,
            mode: "guarded",
            kafka: Some(&broker),
        },
    )
}

#[test]
fn on_kafka_transactional_pipe_killed_12_times_copies_each_integer_once_for_read_committed()
-> TestResult {
    let broker = KafkaBroker::start(&[("in", 1), ("out", 1)])?;
    // The mock ignores read_committed; here the transaction coordinator is
    // real: each restart fences its killed predecessor's transactional id
    // and aborts its open transaction.
    seed_scenario(
        &broker.servers(),
        &Scenario {
            name: "seed scenario, transactional, kafka",
            kills: 12,
            extra: &[],
            fresh_group: false,
            backlog: 300,
            catch_up_seen: false,
            mode: "transactional",
            kafka: Some(&broker),
        },
    )
}

#[test]
fn on_kafka_pipe_with_the_new_group_protocol_killed_6_times_copies_each_integer_once() -> TestResult
{
    // KIP-848 (`group.protocol=consumer`): the member is dynamic (a killed
    // static member's id stays taken until the broker's session timeout,
    // and librdkafka treats the rejoin as fatal), so each restart gets its
    // partition once the broker has expired the killed member: 10 s in the
    // test broker's `group.consumer.session.timeout.ms`.
    let broker = KafkaBroker::start(&[("in", 1), ("out", 1)])?;
    seed_scenario(
        &broker.servers(),
        &Scenario {
            name: "seed scenario, group.protocol=consumer, kafka",
            kills: 6,
            extra: &["-X", "group.protocol=consumer"],
            fresh_group: false,
            backlog: 300,
            catch_up_seen: false,
            mode: "guarded",
            kafka: Some(&broker),
        },
    )
}

#[test]
fn two_pipes_in_one_group_killed_independently_copy_each_integer_once() -> TestResult {
    two_pipes_killed_independently(&MockBroker::start(&[("in", 3), ("out", 3)])?)
}

#[test]
fn on_kafka_two_pipes_in_one_group_killed_independently_copy_each_integer_once() -> TestResult {
    two_pipes_killed_independently(&KafkaBroker::start(&[("in", 3), ("out", 3)])?)
}

#[test]
fn control_at_least_once_pipe_killed_5_times_writes_duplicates() -> TestResult {
    control_at_least_once(&MockBroker::start(&[("in", 1), ("out", 1)])?)
}

#[test]
fn on_kafka_control_at_least_once_pipe_killed_5_times_writes_duplicates() -> TestResult {
    control_at_least_once(&KafkaBroker::start(&[("in", 1), ("out", 1)])?)
}

#[test]
fn consume_killed_mid_read_prints_each_value_once_but_the_record_at_a_kill() -> TestResult {
    consume_killed_mid_read(&MockBroker::start(&[("events", 1)])?)
}

#[test]
fn on_kafka_consume_killed_mid_read_prints_each_value_once_but_the_record_at_a_kill() -> TestResult
{
    consume_killed_mid_read(&KafkaBroker::start(&[("events", 1)])?)
}

#[test]
fn pipe_through_a_broker_frozen_past_its_timeouts_copies_each_integer_once() -> TestResult {
    pipe_through_a_frozen_broker(&MockBroker::start(&[("in", 1), ("out", 1)])?)
}

#[test]
fn on_kafka_pipe_through_a_broker_frozen_past_its_timeouts_copies_each_integer_once() -> TestResult
{
    pipe_through_a_frozen_broker(&KafkaBroker::start(&[("in", 1), ("out", 1)])?)
}

#[test]
fn on_kafka_pipe_through_a_broker_killed_and_restarted_copies_each_integer_once() -> TestResult {
    let mut broker = KafkaBroker::start(&[("in", 1), ("out", 1)])?;
    let (seed, mut rng) = seeded("broker killed with SIGKILL and restarted, kafka");
    let bootstrap = &broker.servers();
    let started = Instant::now();
    let logs = tempfile::Builder::new().prefix("crash-logs-").tempdir()?;
    let result = (|| -> TestResult {
        let state = tempfile::tempdir()?;
        let mut runs = 0;
        let mut spawn = || -> TestResult<Proc> {
            runs += 1;
            Proc::spawn(
                format!("pipe run {runs}"),
                pipe(bootstrap, "restarted", state.path(), "guarded", &[]).stdout(Stdio::null()),
                logs.path().join(format!("pipe-{runs}.log")),
            )
        };
        // (seconds down, when). 40 s is past the pipeline's 30 s flush
        // timeout: it may stop with an error, and is then started again.
        let mut episodes = [(5u64, "tail"), (40, "tail"), (10, "catch-up")];
        episodes.shuffle(&mut rng);
        let feeder = Feeder::start(bootstrap, "in", FEED_RATE)?;
        let mut p = spawn()?;
        let mut outcomes = Vec::new();
        for (secs, when) in episodes {
            {
                // A metadata client of its own per episode: one that lived
                // through a broker restart only slows the next look down.
                let ends = Ends::new(bootstrap, &[("in", 1), ("out", 1)])?;
                if when == "tail" {
                    ends.wait_for(
                        "tail before the kill",
                        FIRST_OUTPUT_LIMIT,
                        &mut [&mut p],
                        |i, o| o > 0 && i - o < CATCH_UP_LAG / 5,
                    )?;
                } else {
                    p.kill9()?;
                    let out_before = ends.total("out")?;
                    thread::sleep(Duration::from_secs(3));
                    p = spawn()?;
                    ends.wait_out(out_before + 1, Duration::ZERO, &mut p)?;
                }
            }
            broker.kill()?;
            thread::sleep(Duration::from_secs(secs));
            broker.restart()?;
            let outcome = match p.exited()? {
                Some(status) => {
                    let line = error_line(&p.log);
                    if !stopped_with_an_error(status, &p.log, &line) {
                        return Err(format!(
                            "with the broker down {secs} s the pipe exited with {status} \
                             without an error line and its status; stderr:\n{}",
                            p.log_tail()
                        )
                        .into());
                    }
                    p = spawn()?;
                    format!("exited {status}: {line}")
                }
                None => "waited".to_owned(),
            };
            let ends = Ends::new(bootstrap, &[("in", 1), ("out", 1)])?;
            let caught_up = ends.wait_for(
                "tail after the restart",
                Duration::from_secs(90),
                &mut [&mut p],
                |i, o| i - o < CATCH_UP_LAG / 5,
            );
            let outcome = match caught_up {
                Ok(_) => outcome,
                // The pipe may meet the restart's aftermath only later.
                Err(e) if p.exited()?.is_some() => {
                    let again = format!("{outcome}; then {}", error_line(&p.log));
                    println!("after the restart: {e}");
                    p = spawn()?;
                    ends.wait_for(
                        "tail after a second start",
                        Duration::from_secs(90),
                        &mut [&mut p],
                        |i, o| i - o < CATCH_UP_LAG / 5,
                    )?;
                    again
                }
                Err(e) => return Err(e),
            };
            let outcome = format!(
                "broker down {secs} s at the {when} (up again after {:?}): {outcome}",
                broker.last_start
            );
            println!("{outcome}");
            outcomes.push(outcome);
        }
        p.kill9()?;
        let n = feeder.finish()?;
        final_guarded_pipe(bootstrap, "restarted", state.path(), logs.path())?;
        let ends = Ends::new(bootstrap, &[("in", 1), ("out", 1)])?;
        let values = integers(&read_output(bootstrap, &ends)?)?;
        check_each_once(&values, 1..=n)?;
        check_increasing(&values)?;
        println!(
            "broker killed: {outcomes:?}; {n} integers each once and in order, {:?}",
            started.elapsed()
        );
        Ok(())
    })();
    outcome(result, seed, logs)
}

/// Whether a run that exited by itself stopped as the command line says it
/// should: with its error line (`line`, read from `log` by the caller),
/// and with status 75 when the failure that stopped it (the first the log
/// names) was a lapsed group session or lease, as a broker away for long
/// can cause, else 1.
fn stopped_with_an_error(
    status: std::process::ExitStatus,
    log: &std::path::Path,
    line: &str,
) -> bool {
    let expected = if first_failure_fenced(log) { 75 } else { 1 };
    status.code() == Some(expected) && !line.is_empty()
}
