//! The progress line on a terminal's stderr, and a log writer that does not
//! write over it.

use std::io::{IsTerminal, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use replayguard::Stats;
use replayguard::kafka::{ConsumerStats, PipelineStats};

/// What the progress line shows, from either adapter's counters.
#[derive(Clone, Debug, Default)]
pub struct Counts {
    pub records_in: u64,
    pub outputs: u64,
    pub duplicates: u64,
    pub checkpoints: u64,
    pub guard: Option<Stats>,
    /// Records behind the high watermarks, summed over the assigned
    /// partitions; `None` before librdkafka's first statistics.
    pub lag: Option<i64>,
}

fn total_lag(lag: &std::collections::BTreeMap<(String, i32), i64>) -> Option<i64> {
    (!lag.is_empty()).then(|| lag.values().sum())
}

impl From<PipelineStats> for Counts {
    fn from(s: PipelineStats) -> Self {
        Counts {
            records_in: s.records_in,
            outputs: s.outputs,
            duplicates: s.duplicates,
            checkpoints: s.checkpoints,
            lag: total_lag(&s.lag),
            guard: s.guard,
        }
    }
}

impl From<ConsumerStats> for Counts {
    fn from(s: ConsumerStats) -> Self {
        Counts {
            records_in: s.records_in,
            outputs: s.delivered,
            duplicates: s.duplicates,
            checkpoints: s.checkpoints,
            lag: total_lag(&s.lag),
            guard: s.guard,
        }
    }
}

use tokio::task::JoinHandle;
use tracing_subscriber::fmt::MakeWriter;

/// True while a progress line (with no newline) is on the terminal.
static ON_SCREEN: AtomicBool = AtomicBool::new(false);

const CLEAR: &[u8] = b"\r\x1b[2K";

/// Erases the progress line, if one is shown, so that the next text starts
/// on a clean line.
pub fn clear_line() {
    if ON_SCREEN.swap(false, Ordering::SeqCst) {
        let _ = std::io::stderr().write_all(CLEAR);
    }
}

/// The tracing writer: stderr, after erasing the progress line.
pub struct LogWriter;

impl<'a> MakeWriter<'a> for LogWriter {
    type Writer = std::io::Stderr;

    fn make_writer(&'a self) -> Self::Writer {
        clear_line();
        std::io::stderr()
    }
}

/// A once-a-second progress line; does nothing unless enabled.
pub struct Progress {
    task: Option<JoinHandle<()>>,
    outputs: bool,
    started: Instant,
}

impl Progress {
    /// Shows `stats()` once a second on stderr when `enabled` and stderr is
    /// a terminal. `outputs` says whether the output count means anything.
    pub fn start<F>(enabled: bool, outputs: bool, stats: F) -> Progress
    where
        F: Fn() -> Counts + Send + 'static,
    {
        if !enabled || !std::io::stderr().is_terminal() {
            return Progress {
                task: None,
                outputs,
                started: Instant::now(),
            };
        }
        let started = Instant::now();
        let task = tokio::spawn(async move {
            let mut line = Line::new(outputs, started);
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let text = line.update(&stats());
                let mut err = std::io::stderr().lock();
                let _ = err.write_all(CLEAR);
                let _ = err.write_all(text.as_bytes());
                let _ = err.flush();
                ON_SCREEN.store(true, Ordering::SeqCst);
            }
        });
        Progress {
            task: Some(task),
            outputs,
            started,
        }
    }

    /// Stops the line; prints a last summary of `stats` when it was shown.
    pub async fn finish(self, stats: Counts) {
        let Some(task) = self.task else { return };
        task.abort();
        let _ = task.await;
        clear_line();
        // No sample before it: the rate is the whole run's.
        let text = Line::new(self.outputs, self.started).update(&stats);
        let _ = writeln!(std::io::stderr(), "{text}");
    }
}

/// What the line remembers between updates.
struct Line {
    outputs: bool,
    checkpoints: u64,
    last_checkpoint: Option<Instant>,
    /// The previous update's time and input count, for the rate; at first
    /// the start and 0.
    sample: (Instant, u64),
}

impl Line {
    fn new(outputs: bool, started: Instant) -> Self {
        Line {
            outputs,
            checkpoints: 0,
            last_checkpoint: None,
            sample: (started, 0),
        }
    }

    fn update(&mut self, s: &Counts) -> String {
        let now = Instant::now();
        if s.checkpoints != self.checkpoints {
            self.checkpoints = s.checkpoints;
            self.last_checkpoint = Some(now);
        }
        let (then, before) = std::mem::replace(&mut self.sample, (now, s.records_in));
        let seconds = now.duration_since(then).as_secs_f64();
        let rate = if seconds > 0.0 {
            s.records_in.saturating_sub(before) as f64 / seconds
        } else {
            0.0
        };
        let mut text = format!("in {} ({rate:.0}/s)", s.records_in);
        if self.outputs {
            text.push_str(&format!("  out {}", s.outputs));
        }
        if let Some(lag) = s.lag {
            text.push_str(&format!("  lag {lag}"));
        }
        text.push_str(&format!("  duplicates dropped {}", s.duplicates));
        match self.last_checkpoint {
            Some(at) => text.push_str(&format!(
                "  checkpoints {} (last {}s ago)",
                s.checkpoints,
                at.elapsed().as_secs()
            )),
            None => text.push_str("  no checkpoint yet"),
        }
        if let Some(g) = &s.guard {
            text.push_str(&format!(
                "  epoch {}  live fingerprints {}",
                g.epoch, g.live_fingerprints
            ));
        }
        text
    }
}
