//! The metrics the adapters emit through the `metrics` facade, described
//! once: names, units and help text. The library installs no recorder;
//! an application that installs one (the command line's Prometheus
//! exporter, for one) calls [`describe_metrics`] to give each its help.

use metrics::{Unit, describe_counter, describe_gauge, describe_histogram};

/// Describes every metric the adapters emit to the installed recorder
/// (unit and help text), and registers the counters and the partition
/// gauges so that they read 0 before their first event. Without a
/// recorder it does nothing.
///
/// Counters: `replayguard_records_in_total`,
/// `replayguard_duplicates_total` (label `reason`: `position` or
/// `content`), `replayguard_outputs_total`,
/// `replayguard_checkpoints_total`,
/// `replayguard_reconciled_identities_total`,
/// `replayguard_claims_refused_total`. Gauges:
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
    for name in [
        "replayguard_records_in_total",
        "replayguard_outputs_total",
        "replayguard_checkpoints_total",
        "replayguard_reconciled_identities_total",
        "replayguard_disk_reads_total",
        "replayguard_disk_hits_total",
        "replayguard_claims_refused_total",
    ] {
        metrics::counter!(name).increment(0);
    }
    for reason in ["position", "content"] {
        metrics::counter!("replayguard_duplicates_total", "reason" => reason).increment(0);
    }
    // No partition before the first assignment.
    for name in [
        "replayguard_assigned_partitions",
        "replayguard_held_partitions",
    ] {
        metrics::gauge!(name).set(0.0);
    }
}
