//! `replayguard inspect`: what a state folder holds.

use std::collections::BTreeMap;
use std::io::{ErrorKind, Write};
use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use replayguard::FORMAT_VERSION;
use replayguard::{Error, Guard};
use serde::Serialize;

use crate::cli::InspectArgs;
use crate::common::{self, Failure};

#[derive(Debug, Serialize)]
struct Report {
    path: String,
    format: u32,
    /// The job the folder belongs to, once it has run one.
    job: Option<replayguard::Job>,
    /// The open epoch (the number of the last checkpoint).
    epoch: u64,
    checkpointed_at_ms: Option<u64>,
    positions: Vec<Position>,
    epochs: Vec<EpochRow>,
    disk_bytes: u64,
    /// Of `disk_bytes`, the on-disk index of sealed epochs' content hashes
    /// (written when a guard keeps them on disk under a memory budget).
    disk_index_bytes: u64,
    /// The newest epoch that index covers, if any.
    disk_index_through: Option<u64>,
    /// Chunks of dropped epochs that a crash left; the next run deletes them.
    leftover_chunks: u64,
    /// Live content hashes of the open epoch, and of the sealed epochs.
    open_hashes: u64,
    sealed_hashes: u64,
    /// Memory a guard needs for these identities, estimated: with every
    /// live epoch in memory, and with the sealed epochs' hashes on disk.
    memory_all_in_bytes: u64,
    memory_sealed_on_disk_bytes: u64,
    /// Of the latter, the filters in front of the hashes on disk.
    disk_filter_bytes: u64,
    /// The manifest's sink bytes, decoded when they are JSON.
    sink: Option<serde_json::Value>,
    /// The sink bytes in hex when they are not JSON.
    sink_hex: Option<String>,
    /// The changelog topic of the folder's job, and where its last
    /// checkpoint left each changelog partition.
    changelog: Option<ChangelogRow>,
}

#[derive(Debug, Serialize)]
struct ChangelogRow {
    topic: String,
    /// Changelog partition to the offset after this folder's last record
    /// there, as of its last checkpoint.
    ends: BTreeMap<i32, i64>,
}

#[derive(Debug, Serialize)]
struct Position {
    topic: String,
    partition: i32,
    next_offset: u64,
}

#[derive(Debug, Default, Serialize)]
struct EpochRow {
    epoch: u64,
    opened_at_ms: Option<u64>,
    closed_at_ms: Option<u64>,
    fingerprints: u64,
    offsets: u64,
    lanes: Vec<LaneRow>,
}

#[derive(Debug, Serialize)]
struct LaneRow {
    topic: String,
    partition: i32,
    fingerprints: u64,
    offsets: u64,
}

pub fn run(args: &InspectArgs) -> Result<(), Failure> {
    // Opening a folder that is not already a state folder would make one.
    common::check_state(&args.state, replayguard::FolderUse::Existing)?;
    let report = read(&args.state)?;
    let text = if args.json {
        let mut t = serde_json::to_string_pretty(&report)
            .map_err(|e| Failure::runtime(format!("encoding the report failed: {e}")))?;
        t.push('\n');
        t
    } else {
        table(&report)
    };
    match std::io::stdout().write_all(text.as_bytes()) {
        // A reader that stopped early (`| head`) is not a failure.
        Err(e) if e.kind() != ErrorKind::BrokenPipe => {
            Err(Failure::runtime(format!("writing to stdout failed: {e}")))
        }
        _ => Ok(()),
    }
}

fn read(path: &Path) -> Result<Report, Failure> {
    // Read-only: no index is loaded, and nothing the guard keeps is written.
    let view = Guard::inspect(path).map_err(|e| match e {
        Error::InUse { path } => Failure::runtime(format!(
            "state folder {} is in use by a running replayguard; stop it first (inspect needs the folder's lock)",
            path.display()
        )),
        e => Failure::runtime(e),
    })?;
    let manifest = view.manifest.clone();
    let mut epochs: BTreeMap<u64, EpochRow> = BTreeMap::new();
    let mut positions = Vec::new();
    let (mut sink, mut sink_hex) = (None, None);
    if let Some(m) = &manifest {
        for e in &m.epochs {
            let row = epochs.entry(e.epoch).or_default();
            row.opened_at_ms = Some(e.opened_at_ms);
            row.closed_at_ms = e.closed_at_ms;
        }
        for p in &m.positions {
            positions.push(Position {
                topic: p.lane.topic.clone(),
                partition: p.lane.partition,
                next_offset: p.next_offset,
            });
        }
        positions.sort_by(|a, b| (&a.topic, a.partition).cmp(&(&b.topic, b.partition)));
        if !m.sink.is_empty() {
            match serde_json::from_slice(&m.sink) {
                Ok(v) => sink = Some(v),
                Err(_) => sink_hex = Some(m.sink.iter().map(|b| format!("{b:02x}")).collect()),
            }
        }
    }
    for c in &view.content {
        let row = epochs.entry(c.epoch).or_default();
        row.fingerprints += c.hashes + c.ids;
        row.offsets += c.offsets;
        row.lanes.push(LaneRow {
            topic: c.lane.topic.clone(),
            partition: c.lane.partition,
            fingerprints: c.hashes + c.ids,
            offsets: c.offsets,
        });
    }
    let epochs = epochs
        .into_iter()
        .map(|(epoch, mut row)| {
            row.epoch = epoch;
            row.lanes
                .sort_by(|a, b| (&a.topic, a.partition).cmp(&(&b.topic, b.partition)));
            row
        })
        .collect();
    let job = replayguard::job::recorded(path).map_err(Failure::runtime)?;
    let changelog = job
        .as_ref()
        .and_then(|j| j.changelog.clone())
        .map(|topic| ChangelogRow {
            topic,
            ends: sink
                .as_ref()
                .and_then(|v: &serde_json::Value| v.get("l"))
                .and_then(|l| serde_json::from_value(l.clone()).ok())
                .unwrap_or_default(),
        });
    Ok(Report {
        path: path.display().to_string(),
        format: manifest.as_ref().map_or(FORMAT_VERSION, |m| m.format),
        job,
        epoch: view.epoch,
        checkpointed_at_ms: manifest.as_ref().map(|m| m.checkpointed_at_ms),
        positions,
        epochs,
        disk_bytes: view.disk_bytes,
        disk_index_bytes: view.disk_index_bytes,
        disk_index_through: view.disk_index_through,
        leftover_chunks: view.leftover_chunks,
        open_hashes: view.open_hashes(),
        sealed_hashes: view.sealed_hashes(),
        memory_all_in_bytes: view.memory_all_in,
        memory_sealed_on_disk_bytes: view.memory_sealed_on_disk,
        disk_filter_bytes: view.disk_filter_bytes,
        sink,
        sink_hex,
        changelog,
    })
}

fn time(ms: Option<u64>) -> String {
    match ms {
        Some(ms) => {
            humantime::format_rfc3339_seconds(UNIX_EPOCH + Duration::from_millis(ms)).to_string()
        }
        None => "-".into(),
    }
}

fn ago(ms: u64) -> String {
    let at = UNIX_EPOCH + Duration::from_millis(ms);
    match SystemTime::now().duration_since(at) {
        Ok(d) => format!(
            "{} ago",
            humantime::format_duration(Duration::from_secs(d.as_secs()))
        ),
        Err(_) => "in the future".into(),
    }
}

fn table(r: &Report) -> String {
    let mut t = String::new();
    let checkpoint = match r.checkpointed_at_ms {
        Some(ms) => format!("last checkpoint {} ({})", time(Some(ms)), ago(ms)),
        None => "no checkpoint yet".into(),
    };
    t += &format!("state folder  {}\n", r.path);
    t += &format!("format        {}\n", r.format);
    match &r.job {
        Some(job) => t += &format!("job           {job}\n"),
        None => t += "job           none recorded yet\n",
    }
    t += &format!("epoch         {} ({checkpoint})\n", r.epoch);
    let index = match r.disk_index_through {
        Some(e) if r.disk_index_bytes > 0 => format!(
            "{} bytes of it index the content hashes of sealed epochs through {e}",
            r.disk_index_bytes
        ),
        _ => "no index of sealed hashes on disk".into(),
    };
    t += &format!("on disk       {} bytes ({index})\n", r.disk_bytes);
    if r.leftover_chunks > 0 {
        t += &format!(
            "              {} chunks of dropped epochs left by a crash; the next run deletes them\n",
            r.leftover_chunks
        );
    }
    t += &format!(
        "hashes        {} in the open epoch, {} in sealed epochs\n",
        r.open_hashes, r.sealed_hashes
    );
    t += &format!(
        "memory        a guard needs about {} bytes for them with every epoch in memory, \
         about {} with sealed epochs' hashes on disk (--max-memory 0; {} bytes of it filters)\n",
        r.memory_all_in_bytes, r.memory_sealed_on_disk_bytes, r.disk_filter_bytes
    );

    t += "\npositions (next offset to read)\n";
    if r.positions.is_empty() {
        t += "  none\n";
    }
    let width = r
        .positions
        .iter()
        .map(|p| p.topic.len() + p.partition.to_string().len() + 2)
        .max()
        .unwrap_or(0);
    for p in &r.positions {
        let lane = format!("{}[{}]", p.topic, p.partition);
        t += &format!("  {lane:<width$}  {}\n", p.next_offset);
    }

    t += "\nlive epochs\n";
    t += &format!(
        "  {:<8} {:<22} {:<22} {:>12} {:>12}\n",
        "epoch", "opened", "closed", "fingerprints", "offsets"
    );
    for e in &r.epochs {
        let closed = match (e.closed_at_ms, e.epoch == r.epoch) {
            (None, true) => "open".to_owned(),
            (ms, _) => time(ms),
        };
        t += &format!(
            "  {:<8} {:<22} {:<22} {:>12} {:>12}\n",
            e.epoch,
            time(e.opened_at_ms),
            closed,
            e.fingerprints,
            e.offsets
        );
        for l in &e.lanes {
            let lane = format!("{}[{}]", l.topic, l.partition);
            t += &format!("    {lane:<52} {:>12} {:>12}\n", l.fingerprints, l.offsets);
        }
    }

    t += "\nchangelog\n";
    match &r.changelog {
        None => t += "  none (identities live in this folder only)\n",
        Some(c) => {
            t += &format!("  topic {}\n", c.topic);
            if c.ends.is_empty() {
                t += "  nothing written as of the last checkpoint\n";
            }
            for (p, end) in &c.ends {
                t += &format!("  partition {p}: this folder's records end at offset {end}\n");
            }
        }
    }

    t += "\nsink (output end offsets)\n";
    match (&r.sink, &r.sink_hex) {
        (Some(v), _) => t += &format!("  {v}\n"),
        (None, Some(hex)) => t += &format!("  0x{hex}\n"),
        (None, None) => t += "  none\n",
    }
    t
}
