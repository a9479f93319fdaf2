//! The metrics the adapters emit through the `metrics` facade, described
//! once: names, units and help text. The library installs no recorder;
//! an application that installs one (the command line's Prometheus
//! exporter, for one) calls [`describe_metrics`] to give each its help.
//!
//! Each guarded consumer or pipeline registers its own series when it is
//! built (`Meters`), with the labels of its options
//! ([`super::GuardOptions::metric_labels`]), so a recorder must be
//! installed before that.

use metrics::{
    Counter, Gauge, Histogram, Label, Unit, describe_counter, describe_gauge, describe_histogram,
};

/// Describes every metric the adapters emit to the installed recorder
/// (unit and help text). Without a recorder it does nothing. The counters
/// and the partition gauges read 0 from the moment a guarded consumer or
/// pipeline is built, under its labels.
///
/// Counters: `replayguard_records_in_total`,
/// `replayguard_duplicates_total` (label `reason`: `position` or
/// `content`), `replayguard_outputs_total`,
/// `replayguard_checkpoints_total`,
/// `replayguard_reconciled_identities_total`,
/// `replayguard_claims_refused_total`, `replayguard_acks_refused_total`.
/// Gauges:
/// `replayguard_consumer_lag` (labels `topic`, `partition`),
/// `replayguard_assigned_partitions`, `replayguard_held_partitions`,
/// `replayguard_live_epochs`, `replayguard_live_fingerprints`,
/// `replayguard_live_offsets`, `replayguard_epoch`,
/// `replayguard_state_memory_bytes`, `replayguard_state_disk_bytes`,
/// `replayguard_last_checkpoint_timestamp_seconds`. Histograms:
/// `replayguard_checkpoint_seconds`, `replayguard_recovery_seconds`,
/// `replayguard_fence_wait_seconds`.
pub fn describe_metrics() {
    describe_counter!(
        "replayguard_records_in_total",
        Unit::Count,
        "Input records received, duplicates included."
    );
    describe_counter!(
        "replayguard_duplicates_total",
        Unit::Count,
        "Input records filtered as already handled, by reason: position (a replay at the same offset) or content (a resend at another offset)."
    );
    describe_counter!(
        "replayguard_outputs_total",
        Unit::Count,
        "Outputs acked by the broker (a pipeline)."
    );
    describe_counter!(
        "replayguard_checkpoints_total",
        Unit::Count,
        "Checkpoints completed."
    );
    describe_counter!(
        "replayguard_reconciled_identities_total",
        Unit::Count,
        "Inputs found handled by reading the output back at recovery."
    );
    describe_counter!(
        "replayguard_changelog_records_total",
        Unit::Count,
        "Records handed to the changelog producer: parts of epochs, and tombstones (kind)."
    );
    describe_counter!(
        "replayguard_changelog_restored_identities_total",
        Unit::Count,
        "Identities taken over from the changelog: handled by another instance of the group."
    );
    describe_histogram!(
        "replayguard_changelog_wait_seconds",
        Unit::Seconds,
        "Time a checkpoint waited for the changelog's acks."
    );
    describe_gauge!(
        "replayguard_consumer_lag",
        Unit::Count,
        "Records behind the high watermark, per assigned partition (0 for a partition this instance no longer owns)."
    );
    describe_gauge!(
        "replayguard_assigned_partitions",
        Unit::Count,
        "Input partitions the group assigned to this instance."
    );
    describe_gauge!(
        "replayguard_held_partitions",
        Unit::Count,
        "Of the assigned partitions, those paused with nothing written for them: waiting for a previous owner's outputs in flight, or for the broker to take this instance's claim."
    );
    describe_gauge!(
        "replayguard_live_epochs",
        Unit::Count,
        "Live epochs, the open one included."
    );
    describe_gauge!(
        "replayguard_live_fingerprints",
        Unit::Count,
        "Live content fingerprints, in memory or on disk."
    );
    describe_gauge!(
        "replayguard_disk_fingerprints",
        Unit::Count,
        "Of the live fingerprints, the content hashes of sealed epochs kept on disk (under a memory budget)."
    );
    describe_gauge!(
        "replayguard_state_disk_filter_bytes",
        Unit::Bytes,
        "Of the index's memory, the filters in front of the content hashes kept on disk."
    );
    describe_gauge!(
        "replayguard_state_disk_index_bytes",
        Unit::Bytes,
        "Of the state folder's bytes, the index of the content hashes kept on disk."
    );
    describe_counter!(
        "replayguard_disk_reads_total",
        Unit::Count,
        "Lookups that read the index on disk because its filter let them through (every resend of a hash on disk, and a few fresh records), since the guard opened."
    );
    describe_counter!(
        "replayguard_claims_refused_total",
        Unit::Count,
        "Claims of taken partitions (a commit before their first output) the broker refused: each keeps its partitions paused, with nothing written for them, until a later claim is taken (or the pipeline stops, refused for the timeout)."
    );
    describe_counter!(
        "replayguard_acks_refused_total",
        Unit::Count,
        "Acks a guarded consumer refused because the record's partition left it in a rebalance after the record was delivered: the partition's owner delivers the record again (Error::Revoked)."
    );
    describe_counter!(
        "replayguard_disk_hits_total",
        Unit::Count,
        "Of those, the ones that found a live duplicate."
    );
    describe_gauge!(
        "replayguard_live_offsets",
        Unit::Count,
        "Live offsets (all in memory)."
    );
    describe_gauge!("replayguard_epoch", Unit::Count, "The open epoch.");
    describe_gauge!(
        "replayguard_state_memory_bytes",
        Unit::Bytes,
        "Memory the identity index holds (an estimate, as of the last checkpoint or recovery)."
    );
    describe_gauge!(
        "replayguard_state_disk_bytes",
        Unit::Bytes,
        "Bytes of the state folder on disk, as of the last checkpoint or recovery."
    );
    describe_gauge!(
        "replayguard_last_checkpoint_timestamp_seconds",
        Unit::Seconds,
        "Unix time of the last successful checkpoint."
    );
    describe_histogram!(
        "replayguard_checkpoint_seconds",
        Unit::Seconds,
        "Time a checkpoint took (periodic and on revoke)."
    );
    describe_histogram!(
        "replayguard_recovery_seconds",
        Unit::Seconds,
        "Time the recovery of assigned partitions took, output reconciliation included."
    );
    describe_histogram!(
        "replayguard_fence_wait_seconds",
        Unit::Seconds,
        "Time a new owner kept partitions paused for a previous owner's outputs in flight."
    );
}

/// Label names the adapters give some series themselves.
const OWN_LABELS: [&str; 4] = ["reason", "kind", "topic", "partition"];

/// Checks the labels of [`super::GuardOptions::metric_labels`]: Prometheus
/// label names (a letter or `_`, then letters, digits or `_`; none
/// beginning with `__`, which Prometheus keeps for itself), none of the
/// adapters' own, none twice.
pub(crate) fn check_labels(labels: &[(String, String)]) -> Result<(), String> {
    for (i, (name, _)) in labels.iter().enumerate() {
        let mut chars = name.chars();
        let well_formed = chars
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
            && chars.all(|c| c.is_ascii_alphanumeric() || c == '_');
        if !well_formed || name.starts_with("__") {
            return Err(format!(
                "metric label {name:?} is not a Prometheus label name (a letter or _, then letters, digits or _, not beginning with __)"
            ));
        }
        if OWN_LABELS.contains(&name.as_str()) {
            return Err(format!(
                "metric label {name:?} is one the adapters set themselves ({}); choose another name",
                OWN_LABELS.join(", ")
            ));
        }
        if labels[..i].iter().any(|(n, _)| n == name) {
            return Err(format!("metric label {name:?} is given twice"));
        }
    }
    Ok(())
}

/// The series of one guarded consumer or pipeline, registered once when it
/// is built, under its labels: two in one process then keep apart when
/// their labels differ (with the same labels, or none, they share the
/// series, and their gauges overwrite each other's). Registering reads 0
/// for the counters and the partition gauges at once.
pub(crate) struct Meters {
    labels: Vec<Label>,
    pub records_in: Counter,
    pub duplicates_position: Counter,
    pub duplicates_content: Counter,
    pub outputs: Counter,
    pub checkpoints: Counter,
    pub reconciled: Counter,
    pub claims_refused: Counter,
    pub acks_refused: Counter,
    pub disk_reads: Counter,
    pub disk_hits: Counter,
    pub assigned_partitions: Gauge,
    pub held_partitions: Gauge,
    pub live_epochs: Gauge,
    pub live_fingerprints: Gauge,
    pub live_offsets: Gauge,
    pub epoch: Gauge,
    pub state_memory_bytes: Gauge,
    pub state_disk_bytes: Gauge,
    pub disk_fingerprints: Gauge,
    pub state_disk_filter_bytes: Gauge,
    pub state_disk_index_bytes: Gauge,
    pub last_checkpoint: Gauge,
    pub checkpoint_seconds: Histogram,
    pub recovery_seconds: Histogram,
    pub fence_wait_seconds: Histogram,
}

/// The series of a changelog, registered only when a job keeps one.
pub(crate) struct ChangelogMeters {
    pub parts: Counter,
    pub tombstones: Counter,
    pub restored: Counter,
    pub wait_seconds: Histogram,
}

/// `base` with `extra` after it.
fn plus(base: &[Label], extra: impl IntoIterator<Item = Label>) -> Vec<Label> {
    base.iter().cloned().chain(extra).collect()
}

#[cfg(test)]
impl Default for Meters {
    /// The series without labels.
    fn default() -> Self {
        Meters::new(&[])
    }
}

impl Meters {
    /// Registers the series under `labels` with the recorder installed now.
    pub fn new(labels: &[(String, String)]) -> Self {
        let labels: Vec<Label> = labels
            .iter()
            .map(|(k, v)| Label::new(k.clone(), v.clone()))
            .collect();
        let with = |k: &'static str, v: &'static str| plus(&labels, [Label::new(k, v)]);
        let counter = |name: &'static str, l: Vec<Label>| {
            let c = metrics::counter!(name, l);
            c.increment(0);
            c
        };
        let gauge = |name: &'static str| metrics::gauge!(name, labels.clone());
        let histogram = |name: &'static str| metrics::histogram!(name, labels.clone());
        let m = Meters {
            records_in: counter("replayguard_records_in_total", labels.clone()),
            duplicates_position: counter(
                "replayguard_duplicates_total",
                with("reason", "position"),
            ),
            duplicates_content: counter("replayguard_duplicates_total", with("reason", "content")),
            outputs: counter("replayguard_outputs_total", labels.clone()),
            checkpoints: counter("replayguard_checkpoints_total", labels.clone()),
            reconciled: counter("replayguard_reconciled_identities_total", labels.clone()),
            claims_refused: counter("replayguard_claims_refused_total", labels.clone()),
            acks_refused: counter("replayguard_acks_refused_total", labels.clone()),
            disk_reads: counter("replayguard_disk_reads_total", labels.clone()),
            disk_hits: counter("replayguard_disk_hits_total", labels.clone()),
            assigned_partitions: gauge("replayguard_assigned_partitions"),
            held_partitions: gauge("replayguard_held_partitions"),
            live_epochs: gauge("replayguard_live_epochs"),
            live_fingerprints: gauge("replayguard_live_fingerprints"),
            live_offsets: gauge("replayguard_live_offsets"),
            epoch: gauge("replayguard_epoch"),
            state_memory_bytes: gauge("replayguard_state_memory_bytes"),
            state_disk_bytes: gauge("replayguard_state_disk_bytes"),
            disk_fingerprints: gauge("replayguard_disk_fingerprints"),
            state_disk_filter_bytes: gauge("replayguard_state_disk_filter_bytes"),
            state_disk_index_bytes: gauge("replayguard_state_disk_index_bytes"),
            last_checkpoint: gauge("replayguard_last_checkpoint_timestamp_seconds"),
            checkpoint_seconds: histogram("replayguard_checkpoint_seconds"),
            recovery_seconds: histogram("replayguard_recovery_seconds"),
            fence_wait_seconds: histogram("replayguard_fence_wait_seconds"),
            labels,
        };
        // No partition before the first assignment.
        m.assigned_partitions.set(0.0);
        m.held_partitions.set(0.0);
        m
    }

    /// The changelog's series, under the same labels.
    pub fn changelog(&self) -> ChangelogMeters {
        let with = |k: &'static str, v: &'static str| plus(&self.labels, [Label::new(k, v)]);
        ChangelogMeters {
            parts: metrics::counter!("replayguard_changelog_records_total", with("kind", "part")),
            tombstones: metrics::counter!(
                "replayguard_changelog_records_total",
                with("kind", "tombstone")
            ),
            restored: metrics::counter!(
                "replayguard_changelog_restored_identities_total",
                self.labels.clone()
            ),
            wait_seconds: metrics::histogram!(
                "replayguard_changelog_wait_seconds",
                self.labels.clone()
            ),
        }
    }

    /// The consumer-lag gauge of one partition.
    pub fn lag(&self, topic: &str, partition: i32) -> Gauge {
        let l = plus(
            &self.labels,
            [
                Label::new("topic", topic.to_owned()),
                Label::new("partition", partition.to_string()),
            ],
        );
        metrics::gauge!("replayguard_consumer_lag", l)
    }
}
