//! [`Guard::inspect`]: what a state folder holds, read without changing it.

use std::collections::BTreeMap;
use std::path::Path;

use roaring::RoaringTreemap;

use super::{EST_BYTES_PER_HASH, Guard};
use crate::error::Result;
use crate::index::DiskFilter;
use crate::store::{LaneName, Manifest, Store};

/// What one lane handled in one live epoch, as its chunks on disk say.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct EpochContent {
    /// The lane.
    pub lane: LaneName,
    /// The epoch.
    pub epoch: u64,
    /// Content hashes recorded.
    pub hashes: u64,
    /// User ids recorded.
    pub ids: u64,
    /// Offsets recorded.
    pub offsets: u64,
}

/// What a state folder holds, as [`Guard::inspect`] read it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct FolderView {
    /// The last checkpoint's manifest; `None` before the first one.
    pub manifest: Option<Manifest>,
    /// The open epoch (the number of the last checkpoint).
    pub epoch: u64,
    /// Per lane and live epoch, by epoch then lane: what was handled.
    pub content: Vec<EpochContent>,
    /// Bytes on disk of the whole store.
    pub disk_bytes: u64,
    /// Of those, the index of sealed epochs' content hashes that a guard
    /// under a memory budget answers from disk.
    pub disk_index_bytes: u64,
    /// The newest epoch that index covers in full, if any.
    pub disk_index_through: Option<u64>,
    /// Chunks of epochs older than the oldest live one, left by a drop that
    /// a crash cut short; the next guard to open the folder deletes them.
    pub leftover_chunks: u64,
    /// Memory a guard would take for these identities with every live
    /// epoch in memory (the default, no budget): an estimate, about 20
    /// bytes a content hash plus the bitmaps of offsets and ids.
    pub memory_all_in: u64,
    /// Memory a guard would take with a budget of 0, every sealed epoch's
    /// hashes on disk: the open epoch's hashes, the bitmaps, and
    /// [`FolderView::disk_filter_bytes`]. An estimate too.
    pub memory_sealed_on_disk: u64,
    /// Of [`FolderView::memory_sealed_on_disk`], the filters in front of
    /// the hashes on disk (exact: their size follows from the counts).
    pub disk_filter_bytes: u64,
}

impl FolderView {
    /// Live content hashes of the open epoch.
    #[must_use]
    pub fn open_hashes(&self) -> u64 {
        self.content
            .iter()
            .filter(|c| c.epoch == self.epoch)
            .map(|c| c.hashes)
            .sum()
    }

    /// Live content hashes of the sealed epochs (those a budget can keep on
    /// disk).
    #[must_use]
    pub fn sealed_hashes(&self) -> u64 {
        self.content
            .iter()
            .filter(|c| c.epoch < self.epoch)
            .map(|c| c.hashes)
            .sum()
    }
}

impl Guard {
    /// Reads what the state folder at `path` holds without changing it:
    /// the manifest, and per lane and live epoch the hashes, ids and
    /// offsets its chunks hold, with the memory a guard would need for them.
    ///
    /// Unlike [`Guard::builder`]`(..).open()`, it loads no index, deletes
    /// no leftover chunk and builds no on-disk index of sealed hashes. It
    /// takes the folder's lock while it reads, so it fails with
    /// [`Error::InUse`](crate::Error::InUse) while a guard has the folder
    /// open. fjall may tidy its own files under `db/` as it opens (its
    /// journal, its version files); what the guard keeps there is read,
    /// never written.
    ///
    /// # Errors
    ///
    /// [`Error::StateFolder`](crate::Error::StateFolder) for a path that is
    /// not a state folder, and the errors of
    /// [`GuardBuilder::open`](super::GuardBuilder::open) for one that is in
    /// use, foreign, of another version or damaged.
    pub fn inspect(path: impl AsRef<Path>) -> Result<FolderView> {
        let path = path.as_ref();
        let Some((store, loaded)) = Store::open_read_only(path)? else {
            // Its creation was cut short: nothing was ever kept in it.
            return Ok(FolderView::default());
        };
        let lanes: BTreeMap<u32, LaneName> = loaded.lanes.into_iter().collect();
        let manifest = loaded.manifest;
        let epoch = manifest.as_ref().map_or(0, |m| m.epoch);
        let oldest = manifest
            .as_ref()
            .and_then(|m| m.epochs.first())
            .map_or(epoch, |e| e.epoch);

        #[derive(Default)]
        struct Sums {
            hashes: u64,
            ids: RoaringTreemap,
            offsets: RoaringTreemap,
        }
        let mut sums: BTreeMap<(u64, u32), Sums> = BTreeMap::new();
        store.read_chunks(oldest, None, |e, lane, _, chunk| {
            if !lanes.contains_key(&lane) {
                return Err(super::unknown_lane(path, lane));
            }
            let s = sums.entry((e, lane)).or_default();
            s.hashes += chunk.hashes.len() as u64;
            s.ids |= chunk.ids;
            s.offsets |= chunk.offsets;
            Ok(())
        })?;
        let mut leftover_chunks = 0;
        store.read_chunks(0, Some(oldest), |_, _, _, _| {
            leftover_chunks += 1;
            Ok(())
        })?;

        let (mut bitmaps, mut in_memory, mut sealed) = (0u64, 0u64, BTreeMap::<u32, u64>::new());
        let mut content = Vec::with_capacity(sums.len());
        for ((e, lane), s) in sums {
            // A sealed epoch's bitmaps are also in its lane's union.
            let copies = if e < epoch { 2 } else { 1 };
            bitmaps += copies * (s.ids.serialized_size() + s.offsets.serialized_size()) as u64;
            if e < epoch {
                *sealed.entry(lane).or_default() += s.hashes;
            } else {
                in_memory += s.hashes;
            }
            content.push(EpochContent {
                lane: lanes.get(&lane).cloned().unwrap_or(LaneName {
                    topic: String::new(),
                    partition: -1,
                }),
                epoch: e,
                hashes: s.hashes,
                ids: s.ids.len(),
                offsets: s.offsets.len(),
            });
        }
        // Recovery sizes each lane's filter for half as many again.
        let disk_filter_bytes = sealed
            .values()
            .filter(|&&n| n > 0)
            .map(|&n| DiskFilter::bytes_for(n * 3 / 2))
            .sum::<u64>();
        let all_hashes = in_memory + sealed.values().sum::<u64>();
        Ok(FolderView {
            epoch,
            content,
            disk_bytes: store.disk_bytes(),
            disk_index_bytes: store.sealed_disk_bytes(),
            disk_index_through: store.spilled()?,
            leftover_chunks,
            memory_all_in: all_hashes * EST_BYTES_PER_HASH + bitmaps,
            memory_sealed_on_disk: in_memory * EST_BYTES_PER_HASH + bitmaps + disk_filter_bytes,
            disk_filter_bytes,
            manifest,
        })
    }
}
