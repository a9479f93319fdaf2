//! The command line surface: every flag name here is relied on by users and
//! scripts (issue 4), so rename nothing.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use replayguard::Identity;
use replayguard::kafka::GuardOptions;
use replayguard::kafka::baseline::Baseline;

use crate::format::Format;

/// Exactly-once results for Kafka without transactions: a dedup bridge
/// (`pipe`), a guarded reader (`consume`) and a state viewer (`inspect`).
#[derive(Debug, Parser)]
#[command(
    name = "replayguard",
    version,
    after_help = "Exit status: 0 success (also after SIGINT/SIGTERM and a final checkpoint), \
                  1 runtime failure, 2 usage error.\n\
                  Logs go to stderr; set RUST_LOG (default `warn`, which leaves out rdkafka's own \
                  log; `RUST_LOG=info,rdkafka=info` shows it)."
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    Pipe(PipeArgs),
    Consume(ConsumeArgs),
    Inspect(InspectArgs),
    Reset(ResetArgs),
}

/// Empty a stopped instance's state folder, so that it can start over,
/// for this job or another.
///
/// Everything the folder remembers goes: positions, identities, its job.
/// A pipeline started on it again resumes from its group's committed
/// offsets and reconciles its output from there; a consumer resumes from
/// the group's offsets and has forgotten which records it delivered.
///
/// Example: `replayguard reset --state /var/lib/replayguard/copy --yes`
#[derive(Debug, Args)]
pub struct ResetArgs {
    /// The state folder.
    #[arg(long, value_name = "DIR")]
    pub state: PathBuf,

    /// Confirm: without it nothing is removed.
    #[arg(long)]
    pub yes: bool,
}

/// Options shared by `pipe` and `consume`.
#[derive(Debug, Args)]
pub struct GuardArgs {
    /// Bootstrap brokers, `host:port[,host:port...]`.
    #[arg(long, value_name = "LIST")]
    pub brokers: String,

    /// Consumer group id.
    #[arg(long, value_name = "ID")]
    pub group: String,

    /// State folder of this instance. Created if missing (its parent must
    /// exist); never shared by two running instances.
    #[arg(long, value_name = "DIR")]
    pub state: PathBuf,

    /// What makes two records the same: `content` (key and value),
    /// `key`, `header:NAME` or `offset` (replays at the same position only).
    /// Under `key` or `header:NAME` a record without a key or that header
    /// is told apart by its position only.
    #[arg(long, value_name = "IDENTITY", default_value = "content", value_parser = parse_identity)]
    pub identity: Identity,

    /// Time between checkpoints, for example `500ms`, `2s`, `1m`.
    #[arg(long, value_name = "DURATION", default_value = "1s", value_parser = parse_duration)]
    pub checkpoint_interval: Duration,

    /// Completed epochs kept besides the open one: duplicates are caught
    /// that far back.
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub retention_epochs: u32,

    /// Also keep epochs closed less than this long ago, for example `1h`.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub retention_time: Option<Duration>,

    /// Memory the index may hold, for example `512MiB` or `2GB`; past it
    /// each checkpoint moves the oldest sealed epochs' content hashes to
    /// disk, behind a filter of about 1.8 bytes a hash, and a restart loads
    /// only what fits. `0` keeps every sealed epoch's hashes on disk.
    /// Default: no limit. The open epoch, offsets and ids stay in memory.
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    pub max_memory: Option<u64>,

    /// Once every assigned partition is read to its end as a
    /// read_committed reader sees it (its high watermark, or the first
    /// record of a transaction still open; past any transaction marker,
    /// and at once where nothing is left to read, every record deleted by
    /// retention), take a final checkpoint and exit 0. An instance its
    /// group gives no partition exits 0, with a warning, once the group's
    /// committed offsets reach the end of the input.
    #[arg(long)]
    pub stop_at_end: bool,

    /// A librdkafka property, `key=value` (repeatable). Not
    /// `bootstrap.servers` or `group.id` (--brokers and --group set them),
    /// nor auto-commit: offsets are committed at each checkpoint.
    #[arg(short = 'X', value_name = "KEY=VALUE", value_parser = parse_property)]
    pub properties: Vec<(String, String)>,

    /// Metadata probes before giving up on unreachable brokers (about 3.5 s
    /// each).
    #[arg(long, value_name = "N", default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub connect_attempts: u32,

    /// The longest stall (the process frozen or starved) after which this
    /// instance still hands on work; after a longer one it stops (default:
    /// the session timeout less the heartbeat interval less a margin, 4 s
    /// with the defaults; 5 s with `-X group.protocol=consumer`). Keep it
    /// below the time the broker takes to expire a silent member: longer
    /// than the session timeout less the heartbeat interval, it is refused.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub lease: Option<Duration>,

    /// Serve Prometheus metrics at `http://HOST:PORT/metrics` and the
    /// guard's health at `/health` (200 while it runs and checkpoints, 503
    /// with the reason otherwise), for example `0.0.0.0:9464`. The address
    /// is taken before any broker is contacted: one in use is a usage
    /// error.
    #[arg(long, value_name = "HOST:PORT")]
    pub metrics_addr: Option<String>,

    /// With --metrics-addr: after the run ends, keep answering /metrics and
    /// /health (503, saying why it stopped) this long, or until a signal,
    /// before exiting, so that a last scrape and probe see the end.
    #[arg(long, value_name = "DURATION", default_value = "0s", value_parser = parse_duration, requires = "metrics_addr")]
    pub metrics_linger: Duration,

    /// Log lines on stderr: `text` (for people) or `json` (one object a
    /// line, with fields such as topic, partition, epoch and error_kind;
    /// the final error line too).
    #[arg(long, value_name = "FORMAT", default_value = "text", value_parser = parse_log_format)]
    pub log_format: LogFormat,

    /// Hand the state folder to this job even if it belongs to another
    /// (another group, output, or no input in common): its positions and
    /// identities are then taken as this job's. The identity cannot change
    /// this way; that needs a new folder (or `replayguard reset`).
    #[arg(long)]
    pub rebind: bool,

    /// Keep the identities in this Kafka topic too, so that they outlive
    /// the machine: a partition that moves to an instance with an empty
    /// or older state folder takes them over before it delivers anything.
    /// Created if missing (compacted, a partition per input partition),
    /// and grown when an input gains partitions.
    /// An acked record is in it from the next checkpoint on.
    #[arg(long, value_name = "TOPIC")]
    pub changelog: Option<String>,
}

/// Copy records from an input topic to an output topic, each exactly once.
///
/// Key, value, headers and timestamp are kept, and every output carries the
/// `replayguard-fp` (fingerprint) and `replayguard-src` headers. The output
/// partition is the input's when the output has enough partitions, else
/// the key's. Outputs are written by an idempotent producer and readable as
/// soon as they are acked; after a crash or `kill -9`, restarting with the
/// same --state writes nothing twice.
#[derive(Debug, Args)]
#[command(after_help = "Example:\n  \
    replayguard pipe --brokers 127.0.0.1:9092 --group copy-orders \\\n    \
    --input orders --output orders-dedup --state /var/lib/replayguard/copy-orders \\\n    \
    --checkpoint-interval 2s -X security.protocol=plaintext\n\n\
    SIGINT/SIGTERM: stop reading, wait for every output's ack, checkpoint, exit 0.")]
pub struct PipeArgs {
    #[command(flatten)]
    pub guard: GuardArgs,

    /// Input topic (repeatable).
    #[arg(long, value_name = "TOPIC", required = true)]
    pub input: Vec<String>,

    /// Output topic.
    #[arg(long, value_name = "TOPIC")]
    pub output: String,

    /// `guarded`: replayguard (exactly once, no transactions);
    /// `at-least-once`: a plain copy, duplicates after a crash (baseline);
    /// `transactional`: Kafka transactions committed at every checkpoint.
    #[arg(long, value_name = "MODE", default_value = "guarded", value_parser = parse_mode)]
    pub mode: Mode,

    /// How long an output may take to reach the broker before the run
    /// stops with an error. It also bounds how long a new owner waits
    /// after an unclean handover (this, plus the producer's request
    /// timeout, plus 1 s). Between 100ms and 1h.
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = parse_duration)]
    pub delivery_timeout: Duration,
}

/// Print each fresh record of a topic once, and mark it handled once
/// written.
///
/// Records handled within the retention are not printed again, whether the
/// group replays them at the same offset or upstream resent them at new
/// ones. A record is marked handled only after it was written and flushed
/// to stdout; one that could not be written is printed again by the next
/// run.
#[derive(Debug, Args)]
#[command(
    after_help = "Format (like kcat -f): %s value, %k key, %t topic, %p partition, \
    %o offset, %h headers (k=v,k=v), %% a percent sign; \\n newline, \\t tab, \\\\ backslash.\n\n\
    Example:\n  \
    replayguard consume --brokers 127.0.0.1:9092 --group audit --topic payments \\\n    \
    --state ./audit-state --retention-time 1h --format '%p:%o %k=%s\\n' --stop-at-end"
)]
pub struct ConsumeArgs {
    #[command(flatten)]
    pub guard: GuardArgs,

    /// Topic to read (repeatable).
    #[arg(long, value_name = "TOPIC", required = true)]
    pub topic: Vec<String>,

    /// Output format of each record (see below).
    #[arg(long, value_name = "FORMAT", default_value = "%s\\n", value_parser = parse_format)]
    pub format: Format,
}

/// Show a state folder: format version, epoch, positions, live epochs with
/// their fingerprint and offset counts, bytes on disk and a memory
/// estimate.
///
/// The folder must not be in use: stop its pipe or consume first.
#[derive(Debug, Args)]
#[command(after_help = "Example:\n  \
    replayguard inspect --state /var/lib/replayguard/copy-orders\n  \
    replayguard inspect --state /var/lib/replayguard/copy-orders --json | jq .positions")]
pub struct InspectArgs {
    /// The state folder.
    #[arg(long, value_name = "DIR")]
    pub state: PathBuf,

    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s)
        .map_err(|e| format!("{e} (use a duration such as 500ms, 2s, 1m or 1h)"))
}

fn parse_size(s: &str) -> Result<u64, String> {
    s.parse::<bytesize::ByteSize>()
        .map(|b| b.as_u64())
        .map_err(|e| format!("{e} (use a size such as 0, 512MiB, 2GB or 1GiB)"))
}

fn parse_format(s: &str) -> Result<Format, String> {
    s.parse()
}

fn parse_identity(s: &str) -> Result<Identity, String> {
    s.parse().map_err(config_text)
}

/// `--log-format`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

fn parse_log_format(s: &str) -> Result<LogFormat, String> {
    match s {
        "text" => Ok(LogFormat::Text),
        "json" => Ok(LogFormat::Json),
        other => Err(format!("unknown log format {other:?}: use text or json")),
    }
}

impl Command {
    /// The log format the command asked for (text for those without the
    /// flag).
    pub fn log_format(&self) -> LogFormat {
        match self {
            Command::Pipe(p) => p.guard.log_format,
            Command::Consume(c) => c.guard.log_format,
            Command::Inspect(_) | Command::Reset(_) => LogFormat::Text,
        }
    }
}

/// `pipe --mode`: the product, or a baseline to measure it against.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Guarded,
    Baseline(Baseline),
}

fn parse_mode(s: &str) -> Result<Mode, String> {
    match s {
        "guarded" => Ok(Mode::Guarded),
        other => other.parse().map(Mode::Baseline).map_err(|_| {
            format!("unknown mode {other:?}: use guarded, at-least-once or transactional")
        }),
    }
}

impl GuardArgs {
    /// The guard's options, built once for `pipe` and `consume`.
    pub fn options(&self) -> GuardOptions {
        let mut o = GuardOptions::default()
            .identity(self.identity.clone())
            .checkpoint_interval(self.checkpoint_interval)
            .retention_epochs(self.retention_epochs)
            .retention_time(self.retention_time)
            .max_memory_bytes(self.max_memory)
            .stop_at_end(self.stop_at_end)
            .connect_attempts(self.connect_attempts)
            .rebind(self.rebind);
        if let Some(lease) = self.lease {
            o = o.lease(lease);
        }
        if let Some(topic) = &self.changelog {
            o = o.changelog(topic.clone());
        }
        o
    }
}

/// The library's text without its "invalid configuration" prefix, which
/// clap's own wording already says.
fn config_text(e: replayguard::Error) -> String {
    match e {
        replayguard::Error::Config(text) => text,
        e => e.to_string(),
    }
}

fn parse_property(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.trim().is_empty() => {
            let k = k.trim();
            // The flags set these after every -X, which would be dropped
            // without a word.
            let flag = match k {
                "group.id" => Some("--group"),
                "bootstrap.servers" | "metadata.broker.list" => Some("--brokers"),
                _ => None,
            };
            // The guard commits at its checkpoints and turns these off;
            // on, they would commit records not yet handled.
            let auto = matches!(k, "enable.auto.commit" | "enable.auto.offset.store")
                && v.trim() == "true";
            match flag {
                Some(flag) => Err(format!("{k} is set by {flag}, not by -X")),
                None if auto => Err(format!(
                    "{k}=true is refused: replayguard commits offsets itself, at each checkpoint"
                )),
                None => Ok((k.to_owned(), v.to_owned())),
            }
        }
        _ => Err(format!("expected KEY=VALUE, got {s:?}")),
    }
}

#[cfg(test)]
mod test {
    use super::*;

    #[test]
    fn parses_the_documented_surface() -> Result<(), Box<dyn std::error::Error>> {
        let cli = Cli::try_parse_from([
            "replayguard",
            "pipe",
            "--brokers",
            "b:1",
            "--group",
            "g",
            "--input",
            "i",
            "--output",
            "o",
            "--state",
            "s",
            "--mode",
            "at-least-once",
            "--identity",
            "header:id",
            "--checkpoint-interval",
            "500ms",
            "--retention-time",
            "1h",
            "--max-memory",
            "512MiB",
            "-X",
            "linger.ms=7",
        ])?;
        let Command::Pipe(p) = cli.command else {
            return Err(format!("parsed as another command: {cli:?}").into());
        };
        assert_eq!(p.mode, Mode::Baseline(Baseline::AtLeastOnce));
        assert_eq!(p.guard.identity, Identity::Header("id".into()));
        assert_eq!(p.guard.checkpoint_interval, Duration::from_millis(500));
        assert_eq!(p.guard.retention_time, Some(Duration::from_secs(3600)));
        assert_eq!(p.guard.max_memory, Some(512 << 20));
        assert_eq!(
            p.guard.properties,
            vec![("linger.ms".to_owned(), "7".to_owned())]
        );
        Ok(())
    }

    #[test]
    fn bad_values_are_usage_errors() {
        for bad in [
            ["--identity", "colour"],
            ["--checkpoint-interval", "soon"],
            ["-X", "novalue"],
            ["--format", "%x"],
            ["--log-format", "xml"],
            ["--metrics-linger", "5s"],
            ["--max-memory", "lots"],
        ] {
            let mut args = vec![
                "replayguard",
                "consume",
                "--brokers",
                "b:1",
                "--group",
                "g",
                "--topic",
                "t",
                "--state",
                "s",
            ];
            args.extend(bad);
            let e = Cli::try_parse_from(args).err();
            assert_eq!(e.map(|e| e.exit_code()), Some(2), "{bad:?}");
        }
    }

    #[test]
    fn clap_definition_is_consistent() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }
}
