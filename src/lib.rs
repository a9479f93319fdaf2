//! # replayguard
//!
//! Exactly-once *results* for Kafka pipelines, without Kafka transactions.
//!
//! A pipeline that reads Kafka, processes and writes Kafka replays
//! everything since its last checkpoint after a crash, so its output gets
//! duplicates. replayguard records the identity of every record handled
//! since checkpoint N in epoch state kept in an embedded LSM store (fjall),
//! filters replayed records against it after a crash, restart or rebalance,
//! and drops epoch N whole once checkpoint N+1 is durable. Paired with an
//! idempotent producer, every input appears in the output exactly once,
//! readable as soon as the producer has its ack.
//!
//! It is not a transaction manager and not a general key-value cache: it
//! remembers identities for a bounded retention, and nothing else.
//!
//! ## Guarantees
//!
//! - **G1 guarded pipeline**: the outputs of every input record appear
//!   exactly once across `kill -9`s, restarts and lost connections
//!   ([`kafka::GuardedPipeline`]).
//! - **G2 guarded consumer**: a record handled within the retention is not
//!   delivered again, whether replayed at the same offset or resent upstream
//!   at a new one ([`kafka::GuardedConsumer`]).
//! - **G3 nothing lost**: a record is filtered only if its identity is
//!   recorded as handled; a failure stops the guard with an error.
//! - **G4 bounded state**: old identities leave by whole epochs.
//! - **G5 honest storage**: versioned on-disk format; damage is an error,
//!   never a silent reset.
//!
//! ## Example
//!
//! ```
//! use replayguard::{Fingerprint, Guard, Verdict};
//! # fn main() -> replayguard::Result<()> {
//! let dir = tempfile::tempdir()?;
//! let mut guard = Guard::builder(dir.path()).open()?;
//! let lane = guard.lane("numbers", 0);
//! for offset in 0..3u64 {
//!     let fp = Fingerprint::content(None, Some(&offset.to_be_bytes()));
//!     assert_eq!(guard.record(lane, Some(offset), Some(fp))?, Verdict::Fresh);
//! }
//! // A crash before the checkpoint: the flushed records are still known.
//! guard.flush()?;
//! drop(guard);
//! let mut guard = Guard::builder(dir.path()).open()?;
//! let fp = Fingerprint::content(None, Some(&1u64.to_be_bytes()));
//! assert!(!guard.check(lane, Some(1), Some(fp))?.is_fresh());
//! # Ok(()) }
//! ```
//!
//! A guarded pipeline copying a topic (the README's example; it needs a
//! broker, so it is compiled here but not run). Run it again after a crash
//! with the same state folder and nothing is written twice:
//!
//! ```no_run
//! use std::convert::Infallible;
//! use std::time::Duration;
//!
//! use rdkafka::ClientConfig;
//! use replayguard::kafka::{GuardOptions, GuardedPipeline, OutputRecord};
//!
//! async fn copy_orders() -> replayguard::Result<()> {
//!     let mut config = ClientConfig::new();
//!     config
//!         .set("bootstrap.servers", "127.0.0.1:9092")
//!         .set("group.id", "order-copier");
//!     // This instance's own folder, kept across restarts.
//!     let mut pipeline = GuardedPipeline::builder(config, "/var/lib/order-copier")
//!         .input("orders")
//!         .output("orders-copy")
//!         .options(GuardOptions::default().checkpoint_interval(Duration::from_secs(1)))
//!         .build()
//!         .await?;
//!     // Any async function from an input record to its output records.
//!     pipeline
//!         .run(|m| async move { Ok::<_, Infallible>(vec![OutputRecord::copy_of(&m)]) })
//!         .await?;
//!     pipeline.close(Duration::from_secs(10)).await
//! }
//! # let _ = copy_orders;
//! ```
//!
//! ## Layout
//!
//! - [`fingerprint`]: identity extraction and hashing.
//! - `index`: what each lane handled, over all its live epochs at once: one
//!   epoch-tagged hash table and a few roaring bitmaps per lane, so a
//!   lookup costs the same with 1 live epoch or thousands, and a filter in
//!   front of the hashes of sealed epochs kept on disk. A table entry is
//!   12 bytes: the hash's top 64 bits and `7 + s` more in a table of
//!   `2^s` homes, beside its epoch tag; at 1M records/s into a table
//!   grown to 1e9 identities, a false duplicate at most about 8.4e-10
//!   times a day. On disk the index keeps the top 104 bits.
//! - `store`: fjall-backed chunks and the manifest, with the format
//!   version, and the on-disk index of sealed epochs' hashes. Private; its
//!   types that callers see ([`Manifest`], [`Durability`], [`LanePosition`])
//!   are re-exported here.
//! - [`job`]: the job a state folder serves, and the changes it accepts.
//! - `folder`: the checks on a state folder before anything opens it
//!   ([`check_state_folder`]).
//! - [`OffsetSet`]: the offsets of a lane that are handled, as ranges.
//! - `guard`: the engine ([`Guard`]): check, record, checkpoint, recover,
//!   one record at a time or a batch at a time ([`Guard::check_many`],
//!   [`Guard::record_many`]), within an optional memory budget
//!   ([`GuardBuilder::max_memory_bytes`]). It has no Kafka types.
//! - [`kafka`] (feature `kafka`, on by default): the rdkafka adapters, with
//!   [`kafka::GuardOptions`] shared by both. The `baselines` feature adds
//!   the at-least-once and transactional modes they are measured against;
//!   the `cli` feature (default) builds the `replayguard` command line.

#![deny(clippy::unwrap_used, clippy::expect_used)]
#![warn(missing_docs)]

mod changelog;
mod error;
pub mod fingerprint;
mod folder;
mod guard;
mod index;
pub mod job;
#[cfg(feature = "kafka")]
pub mod kafka;
mod offsets;
mod store;

pub use error::{Error, Result, StoreError};
pub use fingerprint::{Fingerprint, Identity, IdentityFn};
pub use folder::{FolderUse, check_state_folder};
pub use guard::{
    CheckpointReport, EpochContent, FolderView, Guard, GuardBuilder, LaneId, Probe, Stats, Verdict,
};
pub use index::Reason;
pub use job::{Binding, Job, JobKind};
pub use offsets::OffsetSet;
pub use store::{Durability, EpochInfo, FORMAT_VERSION, LaneName, LanePosition, Manifest};
