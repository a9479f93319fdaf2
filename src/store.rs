//! The fjall-backed state: epoch chunks, the lane table and the manifest.
//!
//! Layout of a state folder:
//!
//! - `REPLAYGUARD`: a marker file naming the format version. A non-empty
//!   folder without it is refused as foreign.
//! - `db/`: a fjall database with three keyspaces:
//!   - `meta`: `format` (magic and version) and `manifest` (checksummed JSON).
//!   - `lanes`: lane id (u32, big-endian) to `{topic, partition}` JSON.
//!   - `chunks`: `epoch (u64 BE) | lane (u32 BE) | seq (u64 BE)` to a packed
//!     chunk of what that lane handled in that epoch: many fingerprints in
//!     one value, so the write path does one insert per batch, not one per
//!     record. An epoch is dropped by deleting its few chunk keys.
//!   - `sealed`: `lane (u32 BE) | hash (its top 104 bits, BE)` to
//!     `epoch (u64 BE)`, for the content hashes of sealed epochs kept on
//!     disk under a memory budget (see `GuardBuilder::max_memory_bytes`).
//!     It is an index derived from the chunks, which stay the truth: it
//!     is written by bulk ingestion when epochs leave the memory, with
//!     `meta: spilled` (u64 BE) naming the newest epoch it covers, and an
//!     entry of a dropped epoch never answers and is removed by a
//!     compaction filter. A build that does not know this keyspace reads
//!     the folder correctly from the chunks, and this build rebuilds what
//!     the keyspace lacks from them, so the format version stays 1.
//!     `meta: sealed_layout` (one byte, 2) says its tables partition their
//!     filter and index blocks; a keyspace without it is rebuilt.
//!   - `counts`: the same keys as `chunks`, each to its chunk's number of
//!     content hashes (u32 LE), written in the chunk's batch. Recovery under
//!     a memory budget reads them to decide what fits, instead of reading
//!     every chunk twice. `meta: counted` (`from` u64 BE, then the xxh3 of
//!     the manifest value it was written with, u64 BE) says that every
//!     chunk of the epochs from `from` on has its count; the open epoch's
//!     chunks are checked at open, since a build that does not know
//!     `counts` may have written some after the manifest. Such a build
//!     writes manifests without the key beside them, so the sum no longer
//!     matches and the counts are not trusted; chunks without a trusted
//!     count are counted from their headers, as before.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use fjall::config::PartitioningPolicy;
use fjall::{Database, Keyspace, KeyspaceCreateOptions, PersistMode};
use roaring::RoaringTreemap;
use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::xxh3_64;

use crate::error::{Error, Result, StoreError};

/// The on-disk format version this build writes. 2: each live epoch has an
/// entry of its own, and the manifest names their range.
pub const FORMAT_VERSION: u32 = 2;

/// The oldest format this build reads. A folder of an older format it
/// supports is marked with the current one when opened for writing, so
/// that a build that cannot read what this one writes refuses it by its
/// version, not as damage.
const OLDEST_FORMAT: u32 = 1;

/// Whether this build reads folders of format `found`.
fn reads_format(found: u32) -> bool {
    (OLDEST_FORMAT..=FORMAT_VERSION).contains(&found)
}

const MARKER: &str = "REPLAYGUARD";
/// Third line of the marker while a new folder is being set up.
const CREATING: &str = "creating";
const MAGIC: &[u8; 8] = b"RPGUARD\0";
const CHUNK_VERSION: u8 = 1;

/// A topic partition, as the engine names it.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct LaneName {
    /// Topic (or any stream name).
    pub topic: String,
    /// Partition number.
    pub partition: i32,
}

impl std::fmt::Display for LaneName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}[{}]", self.topic, self.partition)
    }
}

/// One lane's position in a manifest.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LanePosition {
    /// The lane.
    #[serde(flatten)]
    pub lane: LaneName,
    /// The next offset to read: everything before it was handled.
    pub next_offset: u64,
}

/// A live epoch as the manifest lists it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EpochInfo {
    /// Epoch number.
    pub epoch: u64,
    /// When the epoch was opened (ms since the Unix epoch).
    pub opened_at_ms: u64,
    /// When the checkpoint that closed it completed, if it is closed.
    pub closed_at_ms: Option<u64>,
}

/// The truth about a guard, written atomically and fsynced at each checkpoint.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    /// Format version of the state.
    pub format: u32,
    /// The open epoch after this checkpoint (equal to the checkpoint number).
    pub epoch: u64,
    /// Next position of every lane the guard has seen.
    pub positions: Vec<LanePosition>,
    /// Opaque bytes from the caller, for example output end offsets.
    pub sink: Vec<u8>,
    /// Live epochs, oldest first; the last is the open one.
    pub epochs: Vec<EpochInfo>,
    /// When this checkpoint completed (ms since the Unix epoch).
    pub checkpointed_at_ms: u64,
}

/// What one lane handled in one epoch, as stored in one chunk.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Chunk {
    /// 128-bit content fingerprints.
    pub hashes: Vec<u128>,
    /// Offsets handled.
    pub offsets: RoaringTreemap,
    /// User-supplied ids handled.
    pub ids: RoaringTreemap,
}

impl Chunk {
    /// Encodes the chunk: version, hashes, two roaring bitmaps, checksum.
    pub fn encode(&self) -> Result<Vec<u8>> {
        let mut out = Vec::with_capacity(
            1 + 4
                + self.hashes.len() * 16
                + 8
                + self.offsets.serialized_size()
                + self.ids.serialized_size()
                + 8,
        );
        out.push(CHUNK_VERSION);
        out.extend_from_slice(&(self.hashes.len() as u32).to_le_bytes());
        for h in &self.hashes {
            out.extend_from_slice(&h.to_le_bytes());
        }
        for map in [&self.offsets, &self.ids] {
            out.extend_from_slice(&(map.serialized_size() as u32).to_le_bytes());
            map.serialize_into(&mut out)?;
        }
        let sum = xxh3_64(&out);
        out.extend_from_slice(&sum.to_le_bytes());
        Ok(out)
    }

    /// Decodes a chunk, verifying its checksum.
    pub fn decode(bytes: &[u8]) -> std::result::Result<Self, String> {
        let (body, sum) = bytes
            .split_at_checked(bytes.len().saturating_sub(8))
            .ok_or("chunk too short")?;
        let sum: [u8; 8] = sum.try_into().map_err(|_| "chunk too short")?;
        if xxh3_64(body) != u64::from_le_bytes(sum) {
            return Err("chunk checksum mismatch".into());
        }
        let mut r = Reader(body);
        let version = r.take(1)?[0];
        if version != CHUNK_VERSION {
            return Err(format!("unknown chunk version {version}"));
        }
        let n = r.u32()? as usize;
        let raw = r.take(n.checked_mul(16).ok_or("bad hash count")?)?;
        let hashes = raw
            .chunks_exact(16)
            .map(|c| u128::from_le_bytes(c.try_into().unwrap_or([0; 16])))
            .collect();
        let mut maps = [RoaringTreemap::new(), RoaringTreemap::new()];
        for map in &mut maps {
            let len = r.u32()? as usize;
            *map = RoaringTreemap::deserialize_from(r.take(len)?)
                .map_err(|e| format!("bad bitmap: {e}"))?;
        }
        if !r.0.is_empty() {
            return Err("trailing bytes in chunk".into());
        }
        let [offsets, ids] = maps;
        Ok(Chunk {
            hashes,
            offsets,
            ids,
        })
    }
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> std::result::Result<&'a [u8], String> {
        let (head, tail) = self.0.split_at_checked(n).ok_or("chunk truncated")?;
        self.0 = tail;
        Ok(head)
    }
    fn u32(&mut self) -> std::result::Result<u32, String> {
        let b: [u8; 4] = self.take(4)?.try_into().map_err(|_| "chunk truncated")?;
        Ok(u32::from_le_bytes(b))
    }
}

/// The key of a chunk.
#[must_use]
pub fn chunk_key(epoch: u64, lane: u32, seq: u64) -> [u8; 20] {
    let mut k = [0u8; 20];
    k[..8].copy_from_slice(&epoch.to_be_bytes());
    k[8..12].copy_from_slice(&lane.to_be_bytes());
    k[12..].copy_from_slice(&seq.to_be_bytes());
    k
}

fn parse_chunk_key(k: &[u8]) -> Option<(u64, u32, u64)> {
    let k: &[u8; 20] = k.try_into().ok()?;
    let epoch = u64::from_be_bytes(k[..8].try_into().ok()?);
    let lane = u32::from_be_bytes(k[8..12].try_into().ok()?);
    let seq = u64::from_be_bytes(k[12..].try_into().ok()?);
    Some((epoch, lane, seq))
}

/// How hard a chunk write tries to reach the disk.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Durability {
    /// Each chunk is handed to the operating system (`write`) but not
    /// fsynced. It survives a crash or `kill -9` of the process; an OS crash
    /// or power loss can lose what was written since the last checkpoint
    /// (which is always fsynced). Records lost that way are delivered again
    /// (or, in a pipeline, recovered from the output), never dropped.
    #[default]
    Process,
    /// Each chunk is fdatasynced: it survives power loss too, at about
    /// 165 µs a chunk on these machines.
    Sync,
}

impl Durability {
    fn mode(self) -> PersistMode {
        match self {
            Durability::Process => PersistMode::Buffer,
            Durability::Sync => PersistMode::SyncData,
        }
    }
}

/// A chunk to be written.
pub struct ChunkWrite<'a> {
    /// Epoch it belongs to.
    pub epoch: u64,
    /// Lane id.
    pub lane: u32,
    /// Sequence within (epoch, lane).
    pub seq: u64,
    /// The content.
    pub chunk: &'a Chunk,
}

/// The opened store.
pub struct Store {
    path: PathBuf,
    db: Database,
    meta: Keyspace,
    lanes: Keyspace,
    chunks: Keyspace,
    sealed: Keyspace,
    counts: Keyspace,
    /// Every chunk of the epochs from this one on has its count in
    /// `counts`.
    counted_from: u64,
    /// The oldest live epoch, as the compaction filter of `sealed` sees it.
    oldest_live: Arc<AtomicU64>,
    /// The epochs whose entries (`epoch_key`) the last manifest written or
    /// read lists, oldest and open; `None` when none are stored (a new
    /// folder, or one whose manifest still lists its epochs itself).
    epoch_keys: Option<(u64, u64)>,
}

/// The key of a hash in `sealed`.
fn sealed_key(lane: u32, key: u128) -> [u8; 17] {
    let mut k = [0u8; 17];
    k[..4].copy_from_slice(&lane.to_be_bytes());
    k[4..].copy_from_slice(&key.to_be_bytes()[..13]);
    k
}

fn parse_sealed(k: &[u8], v: &[u8]) -> Option<(u128, u64)> {
    let k: &[u8; 17] = k.try_into().ok()?;
    let mut key = [0u8; 16];
    key[..13].copy_from_slice(&k[4..]);
    let epoch = u64::from_be_bytes(v.try_into().ok()?);
    Some((u128::from_be_bytes(key), epoch))
}

/// Removes the entries of dropped epochs from `sealed` as the store
/// compacts it.
struct ExpireDropped(Arc<AtomicU64>);

struct ExpireFilter(u64);

impl fjall::compaction::filter::Factory for ExpireDropped {
    fn name(&self) -> &str {
        "replayguard-expire-dropped-epochs"
    }

    fn make_filter(
        &self,
        _: &fjall::compaction::filter::Context,
    ) -> Box<dyn fjall::compaction::filter::CompactionFilter> {
        Box::new(ExpireFilter(self.0.load(Ordering::Acquire)))
    }
}

impl fjall::compaction::filter::CompactionFilter for ExpireFilter {
    fn filter_item(
        &mut self,
        item: fjall::compaction::filter::ItemAccessor<'_>,
        _: &fjall::compaction::filter::Context,
    ) -> fjall::compaction::filter::CompactionFilterResult {
        use fjall::compaction::filter::Verdict;
        let value = item.value()?;
        Ok(match <[u8; 8]>::try_from(&value[..]) {
            Ok(v) if u64::from_be_bytes(v) < self.0 => Verdict::Remove,
            _ => Verdict::Keep,
        })
    }
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

/// A keyspace's name, a key and its value.
#[cfg(test)]
pub(crate) type KeptEntry = (&'static str, Vec<u8>, Vec<u8>);

/// What recovery read from disk.
#[derive(Debug, Default)]
pub struct Loaded {
    /// The latest durable manifest, if any checkpoint completed.
    pub manifest: Option<Manifest>,
    /// Every lane ever recorded.
    pub lanes: Vec<(u32, LaneName)>,
}

impl Store {
    /// Opens (or creates) the state folder.
    ///
    /// # Errors
    ///
    /// [`Error::ForeignState`], [`Error::UnsupportedVersion`],
    /// [`Error::Corrupt`], [`Error::InUse`] or [`Error::Open`], each naming
    /// the folder.
    pub fn open(path: &Path) -> Result<(Self, Loaded)> {
        match Self::open_with(path, false)? {
            Some(opened) => Ok(opened),
            None => Err(Error::Corrupt {
                path: path.to_owned(),
                what: "the store did not open".into(),
            }),
        }
    }

    /// Opens an existing state folder to read it, writing nothing that the
    /// guard keeps: no leftover chunk is deleted, no index of sealed hashes
    /// is built or rebuilt, and no marker or format key is written. fjall
    /// may still tidy its own files under `db/` (its journal, its version
    /// files), and a folder written before the `counts` or `sealed`
    /// keyspace existed gets it, empty. `None` for a folder whose creation
    /// was cut short: it holds nothing yet. Use only [`Store`]'s reads on
    /// what it returns.
    ///
    /// # Errors
    ///
    /// As [`Store::open`], and [`Error::StateFolder`] for a path that is
    /// not a state folder.
    pub fn open_read_only(path: &Path) -> Result<Option<(Self, Loaded)>> {
        crate::folder::check_state_folder(path, crate::folder::FolderUse::Existing)?;
        Self::open_with(path, true)
    }

    fn open_with(path: &Path, read_only: bool) -> Result<Option<(Self, Loaded)>> {
        let open_err = |source| Error::Open {
            path: path.to_owned(),
            source,
        };
        if !read_only {
            std::fs::create_dir_all(path).map_err(open_err)?;
        }
        let marker = path.join(MARKER);
        let db_path = path.join("db");
        // The marker says "creating" until the database holds its format
        // key. A folder past that point whose database is gone is damage,
        // not a new folder: recreating it would be a silent reset.
        let mut marked = FORMAT_VERSION;
        let creating = match std::fs::read_to_string(&marker) {
            Ok(text) => {
                marked = check_marker(path, &text)?;
                let creating = text.lines().nth(2) == Some(CREATING);
                if !creating && !db_path.is_dir() {
                    return Err(Error::Corrupt {
                        path: path.to_owned(),
                        what: "its database folder db/ is missing".into(),
                    });
                }
                if creating && read_only {
                    return Ok(None);
                }
                creating
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && read_only => {
                return Err(Error::ForeignState {
                    path: path.to_owned(),
                });
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                if !is_new_folder(path).map_err(open_err)? {
                    return Err(Error::ForeignState {
                        path: path.to_owned(),
                    });
                }
                write_marker(path, true).map_err(open_err)?;
                true
            }
            Err(e) => return Err(open_err(e)),
        };
        if creating && db_path.exists() {
            // Creation was interrupted before the database held its format
            // key, so it holds nothing of the guard's: start it afresh
            // (fjall cannot reopen a database whose creation was cut short).
            std::fs::remove_dir_all(&db_path).map_err(open_err)?;
        }
        let oldest_live = Arc::new(AtomicU64::new(0));
        let expire: Arc<dyn fjall::compaction::filter::Factory> =
            Arc::new(ExpireDropped(oldest_live.clone()));
        let db = Database::builder(&db_path)
            .with_compaction_filter_factories(Arc::new(move |name: &str| {
                (name == "sealed").then(|| expire.clone())
            }))
            .open()
            .map_err(|e| match e {
                fjall::Error::Locked => Error::InUse {
                    path: path.to_owned(),
                },
                fjall::Error::Io(source)
                    if !matches!(
                        source.kind(),
                        std::io::ErrorKind::UnexpectedEof | std::io::ErrorKind::InvalidData
                    ) =>
                {
                    Error::Open {
                        path: path.to_owned(),
                        source,
                    }
                }
                other => Error::Corrupt {
                    path: path.to_owned(),
                    what: format!("the database does not open: {}", StoreError(other)),
                },
            })?;
        let ks = |name: &str| {
            db.keyspace(name, KeyspaceCreateOptions::default)
                .map_err(|e| read_err(path, e))
        };
        let meta = ks("meta")?;
        let sealed = if read_only {
            db.keyspace("sealed", sealed_options)
                .map_err(|e| read_err(path, e))?
        } else {
            open_sealed(&db, &meta, path)?
        };
        let mut store = Store {
            path: path.to_owned(),
            meta,
            lanes: ks("lanes")?,
            chunks: ks("chunks")?,
            sealed,
            counts: ks("counts")?,
            counted_from: 0,
            oldest_live,
            epoch_keys: None,
            db,
        };
        let (loaded, manifest_sum, stored) = store.load_meta(creating)?;
        store.counted_from = store.counted_from(loaded.manifest.as_ref(), manifest_sum)?;
        if !read_only && stored < FORMAT_VERSION {
            tracing::info!(
                path = %path.display(),
                from = stored,
                to = FORMAT_VERSION,
                "the state folder is marked with this build's format; its content is read as it is"
            );
            let mut b = store.db.batch().durability(Some(PersistMode::SyncData));
            b.insert(&store.meta, "format", format_value());
            b.commit().map_err(|e| store.err(e))?;
        }
        if creating || (!read_only && marked < FORMAT_VERSION) {
            write_marker(path, false).map_err(open_err)?;
        }
        Ok(Some((store, loaded)))
    }

    /// Makes the folder look as if a build before the partitioned
    /// `sealed` layout had written it.
    #[cfg(test)]
    pub(crate) fn forget_sealed_layout(&self) -> Result<()> {
        self.meta
            .remove(SEALED_LAYOUT_KEY)
            .map_err(|e| self.err(e))?;
        self.db
            .persist(PersistMode::SyncAll)
            .map_err(|e| self.err(e))
    }

    /// Every key and value the guard keeps, by keyspace: what a read-only
    /// open must leave as it found it.
    #[cfg(test)]
    pub(crate) fn dump(&self) -> Result<Vec<KeptEntry>> {
        let mut out = Vec::new();
        for (name, ks) in [
            ("meta", &self.meta),
            ("lanes", &self.lanes),
            ("chunks", &self.chunks),
            ("sealed", &self.sealed),
            ("counts", &self.counts),
        ] {
            for g in ks.iter() {
                let (k, v) = g.into_inner().map_err(|e| self.read_err(e))?;
                out.push((name, k.to_vec(), v.to_vec()));
            }
        }
        Ok(out)
    }

    /// The state folder.
    #[must_use]
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn corrupt(&self, what: impl Into<String>) -> Error {
        Error::Corrupt {
            path: self.path.clone(),
            what: what.into(),
        }
    }

    fn err(&self, e: fjall::Error) -> Error {
        store_err(&self.path, e)
    }

    fn read_err(&self, e: fjall::Error) -> Error {
        read_err(&self.path, e)
    }

    /// The first epoch from which every chunk has a trusted count: the one
    /// the `counted` key names if it was written with the manifest found,
    /// else the epoch after the open one (whose chunks may lack counts).
    /// With no manifest and no chunks, every chunk to come is counted.
    ///
    /// A build that does not know `counts` and stopped before its first
    /// checkpoint leaves the manifest as it was, with chunks of the open
    /// epoch that have no count. This build would close that epoch under
    /// the same claim, so the open epoch's chunks are checked here.
    fn counted_from(&self, manifest: Option<&Manifest>, manifest_sum: Option<u64>) -> Result<u64> {
        let (Some(m), Some(sum)) = (manifest, manifest_sum) else {
            let empty = self.chunks.first_key_value().is_none();
            return Ok(if empty { 0 } else { 1 });
        };
        let counted = self.meta.get("counted").map_err(|e| self.read_err(e))?;
        if let Some(c) = counted
            && let Ok(c) = <[u8; 16]>::try_from(&*c)
            && c[8..] == sum.to_be_bytes()
        {
            let (from, _) = c.split_at(8);
            let from = u64::from_be_bytes(from.try_into().unwrap_or_default());
            if from > m.epoch || self.all_counted(m.epoch)? {
                return Ok(from);
            }
        }
        Ok(m.epoch + 1)
    }

    /// Whether every chunk of `epoch` has its count.
    fn all_counted(&self, epoch: u64) -> Result<bool> {
        for g in self.chunks.prefix(epoch.to_be_bytes()) {
            let k = g.key().map_err(|e| self.read_err(e))?;
            if !self.counts.contains_key(&k).map_err(|e| self.read_err(e))? {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// The manifest and the lane table, and the xxh3 of the manifest's
    /// value (what `counted` is checked against).
    fn load_meta(&mut self, creating: bool) -> Result<(Loaded, Option<u64>, u32)> {
        let mut stored = FORMAT_VERSION;
        match self.meta.get("format").map_err(|e| self.read_err(e))? {
            Some(v) => {
                if v.len() != 12 || &v[..8] != MAGIC {
                    return Err(self.corrupt("the format key has no replayguard magic"));
                }
                let found = u32::from_be_bytes([v[8], v[9], v[10], v[11]]);
                if !reads_format(found) {
                    return Err(Error::UnsupportedVersion {
                        path: self.path.clone(),
                        found,
                        supported: FORMAT_VERSION,
                    });
                }
                stored = found;
            }
            None => {
                // A folder whose creation was interrupted has the marker and
                // nothing else. Anything more without the format key is damage.
                if !creating
                    || self
                        .meta
                        .get("manifest")
                        .map_err(|e| self.read_err(e))?
                        .is_some()
                    || self.chunks.first_key_value().is_some()
                {
                    return Err(self.corrupt("the format key is missing"));
                }
                let mut b = self.db.batch().durability(Some(PersistMode::SyncData));
                b.insert(&self.meta, "format", format_value());
                b.commit().map_err(|e| self.err(e))?;
            }
        }
        let (manifest, manifest_sum) =
            match self.meta.get("manifest").map_err(|e| self.read_err(e))? {
                None => (None, None),
                Some(v) => {
                    let (mut m, range) = decode_manifest(&v).map_err(|w| self.corrupt(w))?;
                    if let Some((from, to)) = range {
                        m.epochs = self.read_epochs(from, to)?;
                    }
                    self.epoch_keys = range;
                    (Some(m), Some(xxh3_64(&v)))
                }
            };
        let mut lanes = Vec::new();
        for g in self.lanes.iter() {
            let (k, v) = g.into_inner().map_err(|e| self.read_err(e))?;
            let id: [u8; 4] = (*k)
                .try_into()
                .map_err(|_| self.corrupt("a lane key is malformed"))?;
            let name: LaneName = serde_json::from_slice(&v)
                .map_err(|e| self.corrupt(format!("a lane entry is malformed: {e}")))?;
            lanes.push((u32::from_be_bytes(id), name));
        }
        Ok((Loaded { manifest, lanes }, manifest_sum, stored))
    }

    /// Streams every chunk of the epochs at or after `oldest`, calling `f`
    /// with (epoch, lane, seq, chunk). Chunks of older epochs are left over from a
    /// drop that a crash interrupted; they are deleted.
    ///
    /// # Errors
    ///
    /// [`Error::Corrupt`] for a malformed key or chunk; [`Error::Store`] for I/O.
    pub fn load_chunks(
        &self,
        oldest: u64,
        f: impl FnMut(u64, u32, u64, Chunk) -> Result<()>,
    ) -> Result<()> {
        if oldest > 0 {
            self.drop_epochs_before(oldest)?;
        }
        self.read_chunks(oldest, None, f)
    }

    /// Streams every chunk of the epochs from `from` on and, with `to`,
    /// before it, calling `f` with (epoch, lane, seq, chunk). Changes
    /// nothing.
    ///
    /// # Errors
    ///
    /// [`Error::Corrupt`] for a malformed key or chunk; [`Error::Store`] for I/O.
    pub fn read_chunks(
        &self,
        from: u64,
        to: Option<u64>,
        mut f: impl FnMut(u64, u32, u64, Chunk) -> Result<()>,
    ) -> Result<()> {
        use std::ops::Bound;
        let end = to.map_or(Bound::Unbounded, |e| Bound::Excluded(chunk_key(e, 0, 0)));
        for g in self
            .chunks
            .range((Bound::Included(chunk_key(from, 0, 0)), end))
        {
            let (k, v) = g.into_inner().map_err(|e| self.read_err(e))?;
            let (epoch, lane, seq) =
                parse_chunk_key(&k).ok_or_else(|| self.corrupt("a chunk key is malformed"))?;
            let chunk = Chunk::decode(&v)
                .map_err(|w| self.corrupt(format!("chunk {epoch}/{lane}/{seq}: {w}")))?;
            f(epoch, lane, seq, chunk)?;
        }
        Ok(())
    }

    /// The entries of the epochs `from..=to`, which a manifest names as
    /// its live ones: every one must be there.
    fn read_epochs(&self, from: u64, to: u64) -> Result<Vec<EpochInfo>> {
        let mut out = Vec::new();
        for g in self.meta.range(epoch_key(from)..=epoch_key(to)) {
            let (k, v) = g.into_inner().map_err(|e| self.read_err(e))?;
            let info = decode_epoch(&k, &v).ok_or_else(|| {
                self.corrupt(format!("the entry of a live epoch is malformed ({k:?})"))
            })?;
            if info.epoch != from + out.len() as u64 {
                break;
            }
            out.push(info);
        }
        if out.len() as u64 != to - from + 1 {
            let missing = from + out.len() as u64;
            return Err(self.corrupt(format!(
                "the manifest lists epochs {from} to {to}, and the entry of epoch {missing} is missing"
            )));
        }
        Ok(out)
    }

    /// Puts the manifest in `b`, with the entries of its epochs that
    /// changed since the last one: those opened since, and the one open
    /// then, which is now closed. Entries of epochs it no longer lists
    /// are removed. So a checkpoint writes a few entries, however many
    /// epochs are live. Returns the epochs that are then stored.
    fn put_manifest(
        &self,
        b: &mut fjall::OwnedWriteBatch,
        m: &Manifest,
    ) -> Result<Option<(u64, u64)>> {
        let range = m
            .epochs
            .first()
            .zip(m.epochs.last())
            .map(|(a, z)| (a.epoch, z.epoch));
        let changed_from = self.epoch_keys.map_or(0, |(_, open)| open);
        let changed = m.epochs.partition_point(|e| e.epoch < changed_from);
        for e in &m.epochs[changed..] {
            b.insert(&self.meta, epoch_key(e.epoch), encode_epoch(e));
        }
        if let Some((old_from, old_to)) = self.epoch_keys {
            let listed = |e: &u64| range.is_some_and(|(from, to)| (from..=to).contains(e));
            for e in (old_from..=old_to).filter(|e| !listed(e)) {
                b.remove(&self.meta, epoch_key(e));
            }
        }
        let raw = encode_manifest(m, range)?;
        let mut counted = self.counted_from.to_be_bytes().to_vec();
        counted.extend_from_slice(&xxh3_64(&raw).to_be_bytes());
        b.insert(&self.meta, "manifest", raw);
        b.insert(&self.meta, "counted", counted);
        Ok(range)
    }

    /// Writes chunks and new lane entries in one atomic batch.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] if the write or sync failed.
    pub fn write(
        &mut self,
        chunks: &[ChunkWrite<'_>],
        new_lanes: &[(u32, &LaneName)],
        manifest: Option<&Manifest>,
        durability: Durability,
    ) -> Result<()> {
        let mut b = self.db.batch();
        for (id, name) in new_lanes {
            let v = serde_json::to_vec(name)
                .map_err(|e| self.corrupt(format!("lane encoding: {e}")))?;
            b.insert(&self.lanes, id.to_be_bytes(), v);
        }
        for c in chunks {
            let key = chunk_key(c.epoch, c.lane, c.seq);
            let n = u32::try_from(c.chunk.hashes.len())
                .map_err(|_| self.corrupt("a chunk holds more than 2^32 hashes"))?;
            b.insert(&self.chunks, key, c.chunk.encode()?);
            b.insert(&self.counts, key, n.to_le_bytes());
        }
        let (mode, stored) = if let Some(m) = manifest {
            (PersistMode::SyncData, Some(self.put_manifest(&mut b, m)?))
        } else {
            (durability.mode(), None)
        };
        if b.is_empty() {
            return Ok(());
        }
        fail_point("store-write")?;
        b.durability(Some(mode)).commit().map_err(|e| self.err(e))?;
        if let Some(range) = stored {
            self.epoch_keys = range;
        }
        Ok(())
    }

    /// Deletes every chunk of the epochs before `oldest`: a few keys per
    /// (epoch, lane), never one per fingerprint.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] if the delete failed.
    pub fn drop_epochs_before(&self, oldest: u64) -> Result<usize> {
        let mut b = self.db.batch();
        // Reading a chunk's key loads its value too. Every chunk of the
        // epochs from `counted_from` on has a count under the same key, so
        // those keys come from `counts`, which holds 4 bytes a chunk.
        let counted = chunk_key(self.counted_from.min(oldest), 0, 0);
        for g in self.chunks.range(..counted) {
            let k = g.key().map_err(|e| self.err(e))?;
            b.remove(&self.chunks, k);
        }
        let mut n = b.len();
        for g in self.counts.range(..chunk_key(oldest, 0, 0)) {
            let k = g.key().map_err(|e| self.err(e))?;
            if *k >= counted[..] {
                b.remove(&self.chunks, k.clone());
                n += 1;
            }
            b.remove(&self.counts, k);
        }
        if n > 0 {
            b.durability(Some(PersistMode::Buffer))
                .commit()
                .map_err(|e| self.err(e))?;
        }
        Ok(n)
    }

    /// Bytes on disk.
    #[must_use]
    pub fn disk_bytes(&self) -> u64 {
        self.db.disk_space().unwrap_or(0)
    }

    /// Bytes on disk of the `sealed` index.
    #[must_use]
    pub fn sealed_disk_bytes(&self) -> u64 {
        self.sealed.disk_space()
    }

    /// Tells the compaction of `sealed` which epochs are dropped. Call it
    /// only once a manifest with that oldest epoch is durable.
    pub fn set_oldest_live(&self, epoch: u64) {
        self.oldest_live.fetch_max(epoch, Ordering::Release);
    }

    /// Counts the content hashes of every chunk of the epochs at or after
    /// `oldest`, per chunk as (epoch, lane, count). The epochs whose counts
    /// are trusted are read from `counts`; older ones from each chunk's
    /// header (reading the chunk). The full read that follows checks the
    /// checksums.
    ///
    /// # Errors
    ///
    /// [`Error::Corrupt`] for a malformed key, count or header;
    /// [`Error::Store`] for I/O.
    pub fn count_hashes(&self, oldest: u64, mut f: impl FnMut(u64, u32, u64)) -> Result<()> {
        let counted = self.counted_from.max(oldest);
        self.count_headers(oldest, Some(counted), &mut f)?;
        for g in self.counts.range(chunk_key(counted, 0, 0)..) {
            let (k, v) = g.into_inner().map_err(|e| self.read_err(e))?;
            let (epoch, lane, _) =
                parse_chunk_key(&k).ok_or_else(|| self.corrupt("a count key is malformed"))?;
            let n = <[u8; 4]>::try_from(&*v).map_err(|_| {
                self.corrupt(format!("the count of chunk {epoch}/{lane}: malformed"))
            })?;
            f(epoch, lane, u64::from(u32::from_le_bytes(n)));
        }
        Ok(())
    }

    /// Counts from each chunk's header, for the epochs from `from` on and,
    /// with `to`, before it.
    fn count_headers(
        &self,
        from: u64,
        to: Option<u64>,
        f: &mut impl FnMut(u64, u32, u64),
    ) -> Result<()> {
        use std::ops::Bound;
        let end = to.map_or(Bound::Unbounded, |e| Bound::Excluded(chunk_key(e, 0, 0)));
        for g in self
            .chunks
            .range((Bound::Included(chunk_key(from, 0, 0)), end))
        {
            let (k, v) = g.into_inner().map_err(|e| self.read_err(e))?;
            let (epoch, lane, _) =
                parse_chunk_key(&k).ok_or_else(|| self.corrupt("a chunk key is malformed"))?;
            let n: [u8; 4] = v
                .get(1..5)
                .and_then(|b| b.try_into().ok())
                .ok_or_else(|| self.corrupt(format!("chunk {epoch}/{lane}: truncated")))?;
            f(epoch, lane, u64::from(u32::from_le_bytes(n)));
        }
        Ok(())
    }

    /// The newest epoch whose content hashes `sealed` holds in full, if any.
    ///
    /// # Errors
    ///
    /// [`Error::Corrupt`] for a malformed value; [`Error::Store`] for I/O.
    pub fn spilled(&self) -> Result<Option<u64>> {
        match self.meta.get("spilled").map_err(|e| self.read_err(e))? {
            None => Ok(None),
            Some(v) => {
                let b: [u8; 8] = (*v)
                    .try_into()
                    .map_err(|_| self.corrupt("the spilled key is malformed"))?;
                Ok(Some(u64::from_be_bytes(b)))
            }
        }
    }

    /// Writes content hashes of sealed epochs to `sealed` by bulk
    /// ingestion, as `(lane, key, epoch)` in ascending (lane, key) order,
    /// then records (fsynced) that every epoch up to `upto` is covered.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] if a write failed.
    pub fn spill(
        &self,
        entries: impl IntoIterator<Item = (u32, u128, u64)>,
        upto: u64,
    ) -> Result<()> {
        fail_point("store-spill")?;
        let mut ingestion = self.sealed.start_ingestion().map_err(|e| self.err(e))?;
        for (lane, key, epoch) in entries {
            ingestion
                .write(sealed_key(lane, key), epoch.to_be_bytes())
                .map_err(|e| self.err(e))?;
        }
        ingestion.finish().map_err(|e| self.err(e))?;
        // The ingested tables are written; make sure they are on disk
        // before the marker says so.
        self.db
            .persist(PersistMode::SyncAll)
            .map_err(|e| self.err(e))?;
        let mut b = self.db.batch().durability(Some(PersistMode::SyncData));
        b.insert(&self.meta, "spilled", upto.to_be_bytes());
        b.commit().map_err(|e| self.err(e))
    }

    /// The epoch that `sealed` holds for a content hash of a lane, if any.
    /// It may be a dropped epoch: the caller checks.
    ///
    /// # Errors
    ///
    /// [`Error::Corrupt`] for a malformed entry; [`Error::Store`] for I/O.
    pub fn sealed_get(&self, lane: u32, key: u128) -> Result<Option<u64>> {
        match self
            .sealed
            .get(sealed_key(lane, key))
            .map_err(|e| self.read_err(e))?
        {
            None => Ok(None),
            Some(v) => {
                let b: [u8; 8] = (*v)
                    .try_into()
                    .map_err(|_| self.corrupt("a sealed entry is malformed"))?;
                Ok(Some(u64::from_be_bytes(b)))
            }
        }
    }

    /// Calls `f(key, epoch)` for every entry of a lane in `sealed`, in key
    /// order, dropped epochs included.
    ///
    /// # Errors
    ///
    /// [`Error::Corrupt`] for a malformed entry; [`Error::Store`] for I/O.
    pub fn sealed_scan(&self, lane: u32, mut f: impl FnMut(u128, u64)) -> Result<()> {
        for g in self.sealed.prefix(lane.to_be_bytes()) {
            let (k, v) = g.into_inner().map_err(|e| self.read_err(e))?;
            let (key, epoch) =
                parse_sealed(&k, &v).ok_or_else(|| self.corrupt("a sealed entry is malformed"))?;
            f(key, epoch);
        }
        Ok(())
    }
}

/// The layout of the `sealed` keyspace's tables, in `meta`.
const SEALED_LAYOUT_KEY: &str = "sealed_layout";

/// 2: filter and index blocks partitioned at every level.
const SEALED_LAYOUT: u8 = 2;

/// A point read in `sealed` probes each table whose key range holds the key,
/// and every spill writes tables across the whole range. A table's filter and
/// index in one block are megabytes at 100M hashes, and past the block cache
/// each read loaded them whole. In blocks of a few KiB a read loads only the
/// ones it needs.
fn sealed_options() -> KeyspaceCreateOptions {
    KeyspaceCreateOptions::default()
        .filter_block_partitioning_policy(PartitioningPolicy::all(true))
        .index_block_partitioning_policy(PartitioningPolicy::all(true))
}

/// Opens `sealed`. fjall keeps the options a keyspace was created with, so a
/// `sealed` made by an earlier build (no layout key) is dropped and made
/// afresh: it is an index derived from the chunks, and with `spilled` gone
/// the guard's open rebuilds it from them. `spilled` goes first, durably, so
/// that a crash on the way leaves a folder that rebuilds it, never one that
/// trusts a partial index.
fn open_sealed(db: &Database, meta: &Keyspace, path: &Path) -> Result<Keyspace> {
    let err = |e| store_err(path, e);
    let existed = db.keyspace_exists("sealed");
    let sealed = db
        .keyspace("sealed", sealed_options)
        .map_err(|e| read_err(path, e))?;
    let layout = meta.get(SEALED_LAYOUT_KEY).map_err(|e| read_err(path, e))?;
    if layout.as_deref() == Some(&[SEALED_LAYOUT][..]) {
        return Ok(sealed);
    }
    let sealed = if existed {
        tracing::info!(
            path = %path.display(),
            "the on-disk index of sealed hashes has an earlier layout; it is rebuilt from the chunks"
        );
        let mut b = db.batch().durability(Some(PersistMode::SyncData));
        b.remove(meta, "spilled");
        b.commit().map_err(err)?;
        db.delete_keyspace(sealed).map_err(err)?;
        db.keyspace("sealed", sealed_options)
            .map_err(|e| read_err(path, e))?
    } else {
        sealed
    };
    let mut b = db.batch().durability(Some(PersistMode::SyncData));
    b.insert(meta, SEALED_LAYOUT_KEY, [SEALED_LAYOUT]);
    b.commit().map_err(err)?;
    Ok(sealed)
}

fn store_err(path: &Path, e: fjall::Error) -> Error {
    Error::Store {
        path: path.to_owned(),
        source: StoreError(e),
    }
}

/// A read error: damage the store detected (a checksum, a malformed block,
/// a journal that does not replay) is [`Error::Corrupt`]; anything else,
/// such as an I/O error, is [`Error::Store`].
fn read_err(path: &Path, e: fjall::Error) -> Error {
    use fjall::LsmError;
    let damage = match &e {
        fjall::Error::Storage(inner) => !matches!(inner, LsmError::Io(_)),
        fjall::Error::JournalRecovery(_)
        | fjall::Error::InvalidVersion(_)
        | fjall::Error::Decompress(_)
        | fjall::Error::InvalidTrailer
        | fjall::Error::InvalidTag(_)
        | fjall::Error::Unrecoverable => true,
        _ => false,
    };
    if damage {
        Error::Corrupt {
            path: path.to_owned(),
            what: format!("the store found damage: {}", StoreError(e)),
        }
    } else {
        store_err(path, e)
    }
}

/// Whether a folder without a marker may become a state folder: it is
/// empty, or holds only the marker's temporary file (a kill while the first
/// open wrote the marker). Anything else is somebody else's folder.
///
/// # Errors
///
/// The folder cannot be listed.
pub fn is_new_folder(path: &Path) -> std::io::Result<bool> {
    let tmp_name = format!("{MARKER}.tmp");
    for entry in std::fs::read_dir(path)? {
        if entry?.file_name() != tmp_name.as_str() {
            return Ok(false);
        }
    }
    Ok(true)
}

/// The name of the marker file of a state folder.
pub const MARKER_FILE: &str = MARKER;

/// The format the marker names, if this build reads it.
fn check_marker(path: &Path, text: &str) -> Result<u32> {
    let mut lines = text.lines();
    if lines.next() != Some("replayguard state") {
        return Err(Error::Corrupt {
            path: path.to_owned(),
            what: format!("{MARKER} does not start with 'replayguard state'"),
        });
    }
    let found = lines
        .next()
        .and_then(|l| l.strip_prefix("format "))
        .and_then(|v| v.trim().parse::<u32>().ok())
        .ok_or_else(|| Error::Corrupt {
            path: path.to_owned(),
            what: format!("{MARKER} has no format line"),
        })?;
    if !reads_format(found) {
        return Err(Error::UnsupportedVersion {
            path: path.to_owned(),
            found,
            supported: FORMAT_VERSION,
        });
    }
    Ok(found)
}

/// The value of `meta`'s format key: the magic, then the format.
fn format_value() -> Vec<u8> {
    let mut v = MAGIC.to_vec();
    v.extend_from_slice(&FORMAT_VERSION.to_be_bytes());
    v
}

/// Writes the marker atomically; `creating` adds the third line that says
/// the database is not initialised yet.
fn write_marker(path: &Path, creating: bool) -> std::io::Result<()> {
    let tmp = path.join(format!("{MARKER}.tmp"));
    let mut f = std::fs::File::create(&tmp)?;
    writeln!(f, "replayguard state\nformat {FORMAT_VERSION}")?;
    if creating {
        writeln!(f, "{CREATING}")?;
    }
    f.sync_all()?;
    std::fs::rename(&tmp, path.join(MARKER))?;
    std::fs::File::open(path)?.sync_all()
}

/// The manifest as stored. Its live epochs are named by their range, and
/// each has an entry of its own in `meta` (`epoch_key`), written when it
/// changes: a manifest that listed them all grew with every live epoch, and
/// each checkpoint wrote it again (about 270 KB at 3,600 live epochs, kept
/// in the store's memtable until a flush).
#[derive(Serialize)]
struct StoredManifest<'a> {
    format: u32,
    epoch: u64,
    positions: &'a [LanePosition],
    sink: &'a [u8],
    /// The oldest and the open epoch; `None` when it lists none.
    epoch_range: Option<(u64, u64)>,
    checkpointed_at_ms: u64,
}

/// A stored manifest as read: either layout. Format 1 listed the live
/// epochs in `epochs`; format 2 names their range in `epoch_range`, and a
/// format 1 build refuses it by the folder's format before it reads this.
#[derive(Deserialize)]
struct ReadManifest {
    format: u32,
    epoch: u64,
    positions: Vec<LanePosition>,
    sink: Vec<u8>,
    #[serde(default)]
    epochs: Option<Vec<EpochInfo>>,
    #[serde(default)]
    epoch_range: Option<(u64, u64)>,
    checkpointed_at_ms: u64,
}

fn encode_manifest(m: &Manifest, epoch_range: Option<(u64, u64)>) -> Result<Vec<u8>> {
    let stored = StoredManifest {
        format: m.format,
        epoch: m.epoch,
        positions: &m.positions,
        sink: &m.sink,
        epoch_range,
        checkpointed_at_ms: m.checkpointed_at_ms,
    };
    let json = serde_json::to_vec(&stored)
        .map_err(|e| Error::Config(format!("manifest encoding: {e}")))?;
    let mut out = xxh3_64(&json).to_le_bytes().to_vec();
    out.extend_from_slice(&json);
    Ok(out)
}

/// The manifest, and the range of epochs whose entries hold its live
/// epochs (its `epochs` are then empty, to be read from them).
fn decode_manifest(v: &[u8]) -> std::result::Result<(Manifest, Option<(u64, u64)>), String> {
    let (sum, json) = v.split_at_checked(8).ok_or("the manifest is truncated")?;
    let sum: [u8; 8] = sum.try_into().map_err(|_| "the manifest is truncated")?;
    if xxh3_64(json) != u64::from_le_bytes(sum) {
        return Err("the manifest checksum does not match".into());
    }
    let m: ReadManifest =
        serde_json::from_slice(json).map_err(|e| format!("the manifest is malformed: {e}"))?;
    if !reads_format(m.format) {
        return Err(format!("the manifest names format {}", m.format));
    }
    let range = match (&m.epochs, m.epoch_range) {
        (Some(_), Some(_)) => return Err("the manifest both lists and ranges its epochs".into()),
        (None, Some((from, to))) if from > to || to != m.epoch => {
            return Err(format!(
                "the manifest's epochs {from} to {to} do not end at its open epoch {}",
                m.epoch
            ));
        }
        (_, range) => range,
    };
    let manifest = Manifest {
        format: m.format,
        epoch: m.epoch,
        positions: m.positions,
        sink: m.sink,
        epochs: m.epochs.unwrap_or_default(),
        checkpointed_at_ms: m.checkpointed_at_ms,
    };
    Ok((manifest, range))
}

/// The key of a live epoch's entry in `meta`.
fn epoch_key(epoch: u64) -> [u8; 13] {
    let mut k = [0u8; 13];
    k[..5].copy_from_slice(b"epoch");
    k[5..].copy_from_slice(&epoch.to_be_bytes());
    k
}

/// An epoch's entry: when it opened and closed (`u64::MAX` while open).
fn encode_epoch(e: &EpochInfo) -> [u8; 16] {
    let mut v = [0u8; 16];
    v[..8].copy_from_slice(&e.opened_at_ms.to_le_bytes());
    v[8..].copy_from_slice(&e.closed_at_ms.unwrap_or(u64::MAX).to_le_bytes());
    v
}

fn decode_epoch(k: &[u8], v: &[u8]) -> Option<EpochInfo> {
    let epoch = u64::from_be_bytes(k.strip_prefix(b"epoch")?.try_into().ok()?);
    let opened: [u8; 8] = v.get(..8)?.try_into().ok()?;
    let closed: [u8; 8] = v.get(8..)?.try_into().ok()?;
    let closed = u64::from_le_bytes(closed);
    Some(EpochInfo {
        epoch,
        opened_at_ms: u64::from_le_bytes(opened),
        closed_at_ms: (closed != u64::MAX).then_some(closed),
    })
}

/// Test-only fault injection: when the environment variable
/// `REPLAYGUARD_FAIL_AT` equals `name`, the write fails as a disk would;
/// with `REPLAYGUARD_FAIL_ARMED` set to a path, only once that path exists
/// (so that a test can let a process start cleanly, then fail its disk).
/// In unit tests, also when [`FAIL_HERE`] names it on the calling thread.
fn fail_point(name: &str) -> Result<()> {
    #[cfg(test)]
    let here = FAIL_HERE.with(|f| f.get() == Some(name));
    #[cfg(not(test))]
    let here = false;
    if here
        || cfg!(any(test, feature = "fault-injection"))
            && std::env::var("REPLAYGUARD_FAIL_AT").is_ok_and(|v| v == name)
            && std::env::var_os("REPLAYGUARD_FAIL_ARMED")
                .is_none_or(|armed| std::path::Path::new(&armed).exists())
    {
        return Err(Error::Io(std::io::Error::other(format!(
            "injected failure at {name}"
        ))));
    }
    Ok(())
}

#[cfg(test)]
thread_local! {
    /// A fail point armed for the calling thread alone: unit tests run side
    /// by side in one process, so one of them cannot set the environment
    /// without failing the others' writes.
    pub(crate) static FAIL_HERE: std::cell::Cell<Option<&'static str>> =
        const { std::cell::Cell::new(None) };
}

/// Milliseconds since the Unix epoch.
#[must_use]
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

#[cfg(test)]
mod test {
    use super::*;

    #[test]
    fn chunk_round_trips_and_detects_damage() -> Result<()> {
        let mut c = Chunk {
            hashes: vec![1, u128::MAX, 77],
            ..Chunk::default()
        };
        c.offsets.insert_range(10..5000);
        c.ids.insert(42);
        let bytes = c.encode()?;
        assert_eq!(Chunk::decode(&bytes).map_err(Error::Config)?, c);
        for i in [0, 3, bytes.len() / 2, bytes.len() - 1] {
            let mut bad = bytes.clone();
            bad[i] ^= 0x40;
            assert!(Chunk::decode(&bad).is_err(), "flip at {i} not caught");
        }
        assert!(Chunk::decode(&bytes[..bytes.len() - 3]).is_err());
        assert!(Chunk::decode(&[]).is_err());
        Ok(())
    }

    fn manifest(epoch: u64) -> Manifest {
        Manifest {
            format: FORMAT_VERSION,
            epoch,
            positions: Vec::new(),
            sink: Vec::new(),
            epochs: Vec::new(),
            checkpointed_at_ms: epoch,
        }
    }

    fn chunk(n: u128) -> Chunk {
        Chunk {
            hashes: (0..n).collect(),
            ..Chunk::default()
        }
    }

    /// Writes two chunks (lanes 0 and 1) of `epoch`, `10 * epoch + 1` and
    /// `10 * epoch + 2` hashes, with the manifest that closes the epoch.
    fn write_epoch(store: &mut Store, epoch: u64) -> Result<()> {
        let (a, b) = (
            chunk(10 * u128::from(epoch) + 1),
            chunk(10 * u128::from(epoch) + 2),
        );
        let name = LaneName {
            topic: "t".into(),
            partition: 0,
        };
        let writes = [(0, &a), (1, &b)].map(|(lane, chunk)| ChunkWrite {
            epoch,
            lane,
            seq: 0,
            chunk,
        });
        let lanes = [(0, &name), (1, &name)];
        store.write(
            &writes,
            &lanes,
            Some(&manifest(epoch + 1)),
            Durability::Process,
        )
    }

    /// A chunk as a build that does not know `counts` wrote it: no count.
    fn write_uncounted(store: &Store, key: [u8; 20], hashes: u128) -> Result<()> {
        store
            .chunks
            .insert(key, chunk(hashes).encode()?)
            .map_err(|e| store.err(e))
    }

    fn counted(store: &Store, oldest: u64) -> Result<Vec<(u64, u32, u64)>> {
        let mut out = Vec::new();
        store.count_hashes(oldest, |e, l, n| out.push((e, l, n)))?;
        out.sort_unstable();
        Ok(out)
    }

    fn expected(epochs: std::ops::Range<u64>) -> Vec<(u64, u32, u64)> {
        epochs
            .flat_map(|e| [(e, 0, 10 * e + 1), (e, 1, 10 * e + 2)])
            .collect()
    }

    #[test]
    fn counts_come_from_their_keyspace_when_the_manifest_vouches_for_them() -> Result<()> {
        let dir = tempfile::tempdir().map_err(|e| Error::Config(e.to_string()))?;
        {
            let (mut store, _) = Store::open(dir.path())?;
            for e in 0..3 {
                write_epoch(&mut store, e)?;
            }
            // Epoch 3 is open: its chunk has no manifest after it.
            let c = chunk(7);
            let w = ChunkWrite {
                epoch: 3,
                lane: 0,
                seq: 0,
                chunk: &c,
            };
            store.write(&[w], &[], None, Durability::Process)?;
        }
        let (store, loaded) = Store::open(dir.path())?;
        assert_eq!(loaded.manifest.map(|m| m.epoch), Some(3));
        assert_eq!(store.counted_from, 0);
        let mut want = expected(0..3);
        want.push((3, 0, 7));
        assert_eq!(counted(&store, 0)?, want);
        assert_eq!(counted(&store, 1)?, want[2..].to_vec());
        // A count is read from `counts`, not from its chunk: a count that
        // says otherwise wins, in a closed epoch and in the open one.
        store
            .counts
            .insert(chunk_key(1, 0, 0), 99u32.to_le_bytes())
            .map_err(|e| store.err(e))?;
        store
            .counts
            .insert(chunk_key(3, 0, 0), 99u32.to_le_bytes())
            .map_err(|e| store.err(e))?;
        want[2].2 = 99;
        want[6].2 = 99;
        assert_eq!(counted(&store, 0)?, want);
        // Dropping epochs drops their counts too.
        assert_eq!(store.drop_epochs_before(2)?, 4);
        assert_eq!(store.counts.range(..chunk_key(2, 0, 0)).count(), 0);
        assert_eq!(store.chunks.range(..chunk_key(2, 0, 0)).count(), 0);
        assert_eq!(counted(&store, 2)?, want[4..].to_vec());
        Ok(())
    }

    /// A manifest whose live epochs are `from..=to`, each opened at
    /// `1000 * epoch` and closed when the next opened.
    fn ranged(from: u64, to: u64) -> Manifest {
        let epochs = (from..=to)
            .map(|e| EpochInfo {
                epoch: e,
                opened_at_ms: 1000 * e,
                closed_at_ms: (e < to).then_some(1000 * (e + 1)),
            })
            .collect();
        Manifest {
            epochs,
            ..manifest(to)
        }
    }

    fn epoch_entries(store: &Store) -> Vec<u64> {
        store
            .meta
            .prefix(b"epoch")
            .filter_map(|g| g.key().ok())
            .filter_map(|k| Some(u64::from_be_bytes(k.get(5..)?.try_into().ok()?)))
            .collect()
    }

    fn stored_manifest_len(store: &Store) -> Result<usize> {
        let v = store.meta.get("manifest").map_err(|e| store.err(e))?;
        Ok(v.map_or(0, |v| v.len()))
    }

    #[test]
    fn a_checkpoint_writes_the_same_bytes_however_many_epochs_are_live() -> Result<()> {
        let dir = tempfile::tempdir().map_err(|e| Error::Config(e.to_string()))?;
        {
            let (mut store, _) = Store::open(dir.path())?;
            // 3,000 epochs stay live, then a window of 1,000 rolls on.
            let mut sizes = Vec::new();
            for to in 1_000..4_000 {
                store.write(&[], &[], Some(&ranged(0, to)), Durability::Process)?;
                sizes.push(stored_manifest_len(&store)?);
            }
            assert_eq!(sizes.iter().min(), sizes.iter().max(), "{sizes:?}");
            assert_eq!(epoch_entries(&store), (0..4_000).collect::<Vec<_>>());
            for to in 4_000..4_100 {
                store.write(&[], &[], Some(&ranged(to - 999, to)), Durability::Process)?;
            }
            assert_eq!(epoch_entries(&store), (3_100..4_100).collect::<Vec<_>>());
        }
        let (_, loaded) = Store::open(dir.path())?;
        assert_eq!(loaded.manifest, Some(ranged(3_100, 4_099)));
        Ok(())
    }

    #[test]
    fn a_manifest_that_lists_its_epochs_still_opens_and_moves_them_to_entries() -> Result<()> {
        let dir = tempfile::tempdir().map_err(|e| Error::Config(e.to_string()))?;
        {
            let (store, _) = Store::open(dir.path())?;
            // As a build before the epoch entries wrote it: the whole list.
            let json =
                serde_json::to_vec(&ranged(5, 9)).map_err(|e| Error::Config(e.to_string()))?;
            let mut raw = xxh3_64(&json).to_le_bytes().to_vec();
            raw.extend_from_slice(&json);
            store
                .meta
                .insert("manifest", raw)
                .map_err(|e| store.err(e))?;
        }
        let (mut store, loaded) = Store::open(dir.path())?;
        assert_eq!(loaded.manifest, Some(ranged(5, 9)));
        assert!(epoch_entries(&store).is_empty());
        // The next checkpoint writes an entry for every live epoch.
        store.write(&[], &[], Some(&ranged(6, 10)), Durability::Process)?;
        assert_eq!(epoch_entries(&store), (6..=10).collect::<Vec<_>>());
        drop(store);
        let (_, loaded) = Store::open(dir.path())?;
        assert_eq!(loaded.manifest, Some(ranged(6, 10)));
        Ok(())
    }

    #[test]
    fn a_live_epoch_without_its_entry_is_corruption() -> Result<()> {
        let dir = tempfile::tempdir().map_err(|e| Error::Config(e.to_string()))?;
        {
            let (mut store, _) = Store::open(dir.path())?;
            store.write(&[], &[], Some(&ranged(3, 8)), Durability::Process)?;
            store.meta.remove(epoch_key(5)).map_err(|e| store.err(e))?;
        }
        match Store::open(dir.path()) {
            Err(Error::Corrupt { what, .. }) => {
                assert!(what.contains("entry of epoch 5 is missing"), "{what}");
            }
            other => panic!("expected Error::Corrupt, got {:?}", other.map(|(_, l)| l)),
        }
        Ok(())
    }

    #[test]
    fn counts_are_not_trusted_after_a_manifest_written_without_them() -> Result<()> {
        let dir = tempfile::tempdir().map_err(|e| Error::Config(e.to_string()))?;
        {
            let (mut store, _) = Store::open(dir.path())?;
            write_epoch(&mut store, 0)?;
            // A build that does not know `counts`: its chunks of epochs 1
            // and 2 have no count, and its manifests no `counted` beside them.
            for e in 1..3 {
                for (lane, n) in [(0, 10 * e + 1), (1, 10 * e + 2)] {
                    write_uncounted(&store, chunk_key(e, lane, 0), u128::from(n))?;
                }
                store
                    .meta
                    .insert("manifest", encode_manifest(&manifest(e + 1), None)?)
                    .map_err(|e| store.err(e))?;
            }
        }
        let (mut store, _) = Store::open(dir.path())?;
        assert_eq!(store.counted_from, 4);
        assert_eq!(counted(&store, 0)?, expected(0..3));
        // This build closes epochs 3 and 4; from 4 on its counts are trusted
        // again (epoch 3 was open when it came, so its chunks may lack them).
        write_epoch(&mut store, 3)?;
        write_epoch(&mut store, 4)?;
        drop(store);
        let (store, _) = Store::open(dir.path())?;
        assert_eq!(store.counted_from, 4);
        assert_eq!(counted(&store, 0)?, expected(0..5));
        // Chunks without a count are dropped all the same.
        assert_eq!(store.drop_epochs_before(5)?, 10);
        assert_eq!(store.chunks.iter().count(), 0);
        assert_eq!(store.counts.iter().count(), 0);
        Ok(())
    }

    #[test]
    fn an_open_epoch_with_chunks_of_an_older_build_is_not_counted() -> Result<()> {
        let dir = tempfile::tempdir().map_err(|e| Error::Config(e.to_string()))?;
        {
            let (mut store, _) = Store::open(dir.path())?;
            write_epoch(&mut store, 0)?;
            write_epoch(&mut store, 1)?;
            // An older build then wrote a chunk of the open epoch 2 and
            // stopped before its first checkpoint.
            write_uncounted(&store, chunk_key(2, 0, 1), 5)?;
        }
        let (mut store, _) = Store::open(dir.path())?;
        assert_eq!(store.counted_from, 3);
        // This build closes epoch 2 with chunks of its own.
        write_epoch(&mut store, 2)?;
        drop(store);
        let (store, _) = Store::open(dir.path())?;
        assert_eq!(store.counted_from, 3);
        let mut want = expected(0..3);
        want.push((2, 0, 5));
        want.sort_unstable();
        assert_eq!(counted(&store, 0)?, want);
        assert_eq!(store.drop_epochs_before(3)?, 7);
        assert_eq!(store.chunks.iter().count(), 0);
        Ok(())
    }

    #[test]
    fn keys_sort_by_epoch_then_lane() {
        assert!(chunk_key(1, 9, 9) < chunk_key(2, 0, 0));
        assert!(chunk_key(256, 0, 0) > chunk_key(255, u32::MAX, u64::MAX));
        assert_eq!(parse_chunk_key(&chunk_key(5, 6, 7)), Some((5, 6, 7)));
    }
}
