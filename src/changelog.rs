//! The changelog's records: what a guard ships of each lane's epochs to a
//! log outside its machine (a compacted Kafka topic, in the adapters), so
//! that another instance can take its identities over. It knows no Kafka
//! types.
//!
//! A record holds one part of what one lane handled in one epoch, at most
//! [`PART_ITEMS`] hashes, ids and offsets each (under 0.5 MB), so many
//! identities go in one record, never one record per identity.
//!
//! - **Key**: `RGK1 | group (u16 length, bytes) | writer (u8 length,
//!   bytes) | topic (u16 length, bytes) | partition (i32 BE) | epoch (u64
//!   BE) | part (u32 BE)`. The group is the job's consumer group: a
//!   restore takes only its own group's records, so two jobs that share a
//!   changelog topic never take each other's identities. The writer is the
//!   state folder's instance token, so that two instances' records never
//!   share a key.
//! - **Value**: `RGV1` and the chunk as the store encodes it: its format
//!   version, the hashes, the offsets and ids as roaring bitmaps, and an
//!   xxh3 checksum. An empty value is a tombstone: the part left with its
//!   epoch.
//!
//! An epoch is shipped whole at the checkpoint that closes it, as parts
//! `0..n`; an open epoch shipped again (after a restart, or the offsets a
//! checkpoint carries into it) is shipped with the same keys and more
//! content, so the compacted topic keeps the latest copy of each part.
//! The number of parts is a function of the epoch's counts
//! ([`parts_for`]), which lets a restarted guard send the tombstones of
//! epochs it shipped before the restart.

// Only the Kafka adapters ship and restore.
#![cfg_attr(not(feature = "kafka"), allow(dead_code))]

use roaring::RoaringTreemap;

use crate::store::Chunk;

/// Hashes, ids and offsets in one record, at most (each).
pub const PART_ITEMS: usize = 16_384;

const KEY_MAGIC: &[u8; 4] = b"RGK1";
const VALUE_MAGIC: &[u8; 4] = b"RGV1";

/// Where a changelog record belongs.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ChangelogKey {
    /// The consumer group of the job that wrote it.
    pub group: String,
    /// The instance that wrote it (its state folder's token).
    pub writer: String,
    /// The input topic of the lane.
    pub topic: String,
    /// The input partition of the lane.
    pub partition: i32,
    /// The writer's epoch.
    pub epoch: u64,
    /// The part of that epoch.
    pub part: u32,
}

impl ChangelogKey {
    /// The key's bytes.
    #[must_use]
    pub fn encode(&self) -> Vec<u8> {
        let g = self.group.as_bytes();
        let w = self.writer.as_bytes();
        let t = self.topic.as_bytes();
        let mut out = Vec::with_capacity(4 + 2 + g.len() + 1 + w.len() + 2 + t.len() + 16);
        out.extend_from_slice(KEY_MAGIC);
        out.extend_from_slice(&(g.len().min(65_535) as u16).to_be_bytes());
        out.extend_from_slice(&g[..g.len().min(65_535)]);
        out.push(w.len().min(255) as u8);
        out.extend_from_slice(&w[..w.len().min(255)]);
        out.extend_from_slice(&(t.len().min(65_535) as u16).to_be_bytes());
        out.extend_from_slice(&t[..t.len().min(65_535)]);
        out.extend_from_slice(&self.partition.to_be_bytes());
        out.extend_from_slice(&self.epoch.to_be_bytes());
        out.extend_from_slice(&self.part.to_be_bytes());
        out
    }

    /// Reads a key.
    ///
    /// # Errors
    /// What is wrong with it, for a message.
    pub fn decode(b: &[u8]) -> Result<Self, String> {
        let mut r = b
            .strip_prefix(KEY_MAGIC.as_slice())
            .ok_or("the key does not start with RGK1: not a replayguard changelog record")?;
        let mut take = |n: usize| -> Result<&[u8], String> {
            let (head, tail) = r.split_at_checked(n).ok_or("the key is truncated")?;
            r = tail;
            Ok(head)
        };
        let gl = u16::from_be_bytes(take(2)?.try_into().map_err(|_| "the key is truncated")?);
        let group =
            String::from_utf8(take(gl as usize)?.to_vec()).map_err(|_| "the group is not UTF-8")?;
        let wl = take(1)?[0] as usize;
        let writer =
            String::from_utf8(take(wl)?.to_vec()).map_err(|_| "the writer is not UTF-8")?;
        let tl = u16::from_be_bytes(take(2)?.try_into().map_err(|_| "the key is truncated")?);
        let topic =
            String::from_utf8(take(tl as usize)?.to_vec()).map_err(|_| "the topic is not UTF-8")?;
        let partition = i32::from_be_bytes(take(4)?.try_into().map_err(|_| "truncated")?);
        let epoch = u64::from_be_bytes(take(8)?.try_into().map_err(|_| "truncated")?);
        let part = u32::from_be_bytes(take(4)?.try_into().map_err(|_| "truncated")?);
        if !r.is_empty() {
            return Err("the key has trailing bytes".into());
        }
        Ok(ChangelogKey {
            group,
            writer,
            topic,
            partition,
            epoch,
            part,
        })
    }
}

/// A record's value: one part of a lane's epoch.
///
/// # Errors
/// When the chunk cannot be encoded.
pub fn encode_value(part: &Chunk) -> crate::Result<Vec<u8>> {
    let chunk = part.encode()?;
    let mut out = Vec::with_capacity(4 + chunk.len());
    out.extend_from_slice(VALUE_MAGIC);
    out.extend_from_slice(&chunk);
    Ok(out)
}

/// Reads a record's value (not a tombstone), checking its format version
/// and checksum.
///
/// # Errors
/// What is wrong with it, for a message.
pub fn decode_value(b: &[u8]) -> Result<Chunk, String> {
    let chunk = b
        .strip_prefix(VALUE_MAGIC.as_slice())
        .ok_or("the value does not start with RGV1: not a replayguard changelog record")?;
    Chunk::decode(chunk)
}

/// The number of parts an epoch of these counts is shipped as.
#[must_use]
pub fn parts_for(hashes: u64, ids: u64, offsets: u64) -> u32 {
    let per = PART_ITEMS as u64;
    [hashes, ids, offsets]
        .iter()
        .map(|n| n.div_ceil(per))
        .max()
        .unwrap_or(0)
        .max(1) as u32
}

/// The parts of `c`, [`parts_for`] its counts of them.
#[must_use]
pub fn split(c: &Chunk) -> Vec<Chunk> {
    let n = parts_for(c.hashes.len() as u64, c.ids.len(), c.offsets.len()) as usize;
    let mut parts = vec![Chunk::default(); n];
    for (part, hashes) in parts.iter_mut().zip(c.hashes.chunks(PART_ITEMS)) {
        part.hashes = hashes.to_vec();
    }
    let spread =
        |set: &RoaringTreemap, parts: &mut [Chunk], pick: fn(&mut Chunk) -> &mut RoaringTreemap| {
            for (i, v) in set.iter().enumerate() {
                if let Some(part) = parts.get_mut(i / PART_ITEMS) {
                    let _ = pick(part).try_push(v);
                }
            }
        };
    spread(&c.ids, &mut parts, |p| &mut p.ids);
    spread(&c.offsets, &mut parts, |p| &mut p.offsets);
    parts
}

/// Adds `more` to `into` (a lane's content of one epoch so far).
pub fn merge(into: &mut Chunk, more: Chunk) {
    if into.hashes.is_empty() {
        into.hashes = more.hashes;
    } else {
        into.hashes.extend_from_slice(&more.hashes);
    }
    into.offsets |= more.offsets;
    into.ids |= more.ids;
}

/// What a guard hands its changelog: parts of a lane's epoch, or their
/// tombstones.
#[derive(Clone, Debug, PartialEq)]
pub struct Shipment {
    /// The lane's topic.
    pub topic: String,
    /// The lane's partition.
    pub partition: i32,
    /// The epoch.
    pub epoch: u64,
    /// What to write.
    pub what: Shipped,
}

/// The records of a [`Shipment`].
#[derive(Clone, Debug, PartialEq)]
pub enum Shipped {
    /// Parts `0..n`, in order.
    Parts(Vec<Chunk>),
    /// Tombstones of parts `0..n`.
    Tombstones(u32),
}

#[cfg(test)]
mod test {
    use super::*;

    #[test]
    fn keys_read_back_and_foreign_bytes_are_refused() {
        let k = ChangelogKey {
            group: "billing".into(),
            writer: "3f2a".into(),
            topic: "orders".into(),
            partition: 7,
            epoch: 12,
            part: 3,
        };
        assert_eq!(ChangelogKey::decode(&k.encode()), Ok(k.clone()));
        let mut long = k.encode();
        long.push(0);
        assert!(ChangelogKey::decode(&long).is_err());
        assert!(ChangelogKey::decode(b"hello").is_err());
        let bytes = k.encode();
        assert!(ChangelogKey::decode(&bytes[..bytes.len() - 1]).is_err());
    }

    #[test]
    fn an_epoch_splits_into_parts_that_hold_all_of_it_once() {
        let c = Chunk {
            hashes: (1..=40_000u128).map(|h| h * 0x9E37_79B9).collect(),
            ids: (0..20_000u64).map(|i| i * 3).collect(),
            offsets: (100..100_000u64).collect(),
        };
        let parts = split(&c);
        assert_eq!(
            parts.len() as u32,
            parts_for(40_000, 20_000, 99_900),
            "the count is the function of the counts"
        );
        let mut back = Chunk::default();
        for p in &parts {
            assert!(p.hashes.len() <= PART_ITEMS && p.ids.len() as usize <= PART_ITEMS);
            let v = encode_value(p).unwrap_or_default();
            assert!(v.len() < 1_000_000, "a part is {} bytes", v.len());
            merge(&mut back, decode_value(&v).unwrap_or_default());
        }
        assert_eq!(back, c);
        assert_eq!(split(&Chunk::default()).len(), 1);
    }

    #[test]
    fn a_damaged_value_is_refused_never_read_as_empty() {
        let c = Chunk {
            hashes: vec![5, 6],
            ..Chunk::default()
        };
        let mut v = encode_value(&c).unwrap_or_default();
        let last = v.len() - 3;
        v[last] ^= 1;
        assert!(decode_value(&v).is_err_and(|e| e.contains("checksum")));
        assert!(decode_value(b"RGV1").is_err());
        assert!(decode_value(b"{\"json\":1}").is_err());
    }
}
