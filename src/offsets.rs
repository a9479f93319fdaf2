//! A set of offsets, as the engine hands them out.

use roaring::RoaringTreemap;

/// A set of offsets (of one lane), in ascending order.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct OffsetSet(pub(crate) RoaringTreemap);

impl OffsetSet {
    /// The smallest offset.
    #[must_use]
    pub fn min(&self) -> Option<u64> {
        self.0.min()
    }

    /// The largest offset.
    #[must_use]
    pub fn max(&self) -> Option<u64> {
        self.0.max()
    }

    /// How many offsets.
    #[must_use]
    pub fn len(&self) -> u64 {
        self.0.len()
    }

    /// Whether there is none.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether `offset` is in the set.
    #[must_use]
    pub fn contains(&self, offset: u64) -> bool {
        self.0.contains(offset)
    }

    /// The offsets, ascending.
    pub fn iter(&self) -> impl Iterator<Item = u64> + '_ {
        self.0.iter()
    }
}

impl From<RoaringTreemap> for OffsetSet {
    fn from(set: RoaringTreemap) -> Self {
        OffsetSet(set)
    }
}
