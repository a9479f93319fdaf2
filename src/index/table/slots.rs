//! [`Slots`]: the table's array of slots, resizable in place without a
//! copy, and on huge pages from its first write once it is large.

use std::ops::{Deref, DerefMut};

/// Bytes of slots from which the array gets a mapping of its own (on
/// Linux): two huge pages. Smaller arrays stay on the heap, where a huge
/// page would mostly be empty.
pub const MAPPED_BYTES: usize = 4 << 20;

/// The slots of a table: zeroed when made, and kept zero past their
/// length, so that growing only extends them with empty slots.
///
/// A small array lives on the heap. A large one, on Linux, gets a mapping
/// of its own, reserved well past its length and marked for huge pages
/// (`MADV_HUGEPAGE`) as a whole before it is touched: its pages are huge
/// from their first write, and it grows within the reservation without
/// moving, or, past it, by moving its pages to a larger reservation
/// (`mremap`), never by a copy. A heap array grown past a few huge pages
/// instead was extended by `realloc` on small pages, and had to be copied
/// onto huge pages once its epoch closed (`MADV_COLLAPSE`), a pause of a
/// few hundred milliseconds at 10M entries (BENCHMARKS.md).
pub enum Slots {
    /// On the heap.
    Heap(Box<[u128]>),
    /// In a mapping of its own.
    #[cfg(target_os = "linux")]
    Mapped(Mapping),
}

impl Default for Slots {
    fn default() -> Self {
        Slots::Heap(Box::default())
    }
}

impl std::fmt::Debug for Slots {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self {
            Slots::Heap(_) => "heap",
            #[cfg(target_os = "linux")]
            Slots::Mapped(_) => "mapped",
        };
        write!(f, "Slots({} {kind})", self.len())
    }
}

impl Deref for Slots {
    type Target = [u128];

    fn deref(&self) -> &[u128] {
        match self {
            Slots::Heap(b) => b,
            #[cfg(target_os = "linux")]
            Slots::Mapped(m) => m.as_slice(),
        }
    }
}

impl DerefMut for Slots {
    fn deref_mut(&mut self) -> &mut [u128] {
        match self {
            Slots::Heap(b) => b,
            #[cfg(target_os = "linux")]
            Slots::Mapped(m) => m.as_mut_slice(),
        }
    }
}

impl From<Vec<u128>> for Slots {
    fn from(v: Vec<u128>) -> Self {
        Slots::Heap(v.into_boxed_slice())
    }
}

impl Slots {
    /// `len` empty slots.
    #[must_use]
    pub fn zeroed(len: usize) -> Self {
        #[cfg(target_os = "linux")]
        if len * 16 >= MAPPED_BYTES
            && let Some(m) = Mapping::new(len)
        {
            return Slots::Mapped(m);
        }
        Slots::Heap(vec![0u128; len].into_boxed_slice())
    }

    /// Whether [`Slots::resize`] to `len` keeps the slots where they are
    /// or moves them without a copy: a mapping does; a heap array does
    /// while it stays small (a larger one is better laid out afresh into
    /// a mapping of its own, [`Slots::zeroed`]).
    #[must_use]
    pub fn resizes_in_place(&self, len: usize) -> bool {
        match self {
            Slots::Heap(_) => len * 16 < MAPPED_BYTES || cfg!(not(target_os = "linux")),
            #[cfg(target_os = "linux")]
            Slots::Mapped(_) => true,
        }
    }

    /// Makes the array `len` slots long: slots past the old length are
    /// empty, and the slots past `len` are dropped (the caller has moved
    /// every entry out of them).
    pub fn resize(&mut self, len: usize) {
        #[cfg(target_os = "linux")]
        if let Slots::Mapped(m) = self {
            if m.resize(len) {
                return;
            }
            // The kernel refused a larger reservation or the move: the
            // slots go to the heap, a copy.
            let mut v = Vec::with_capacity(len);
            v.extend_from_slice(m.as_slice());
            v.resize(len, 0);
            *self = Slots::from(v);
            return;
        }
        let mut v = std::mem::take(self).into_heap();
        if len > v.len() {
            v.reserve_exact(len - v.len());
        }
        v.resize(len, 0);
        *self = Slots::from(v);
    }

    /// The slots as a vector on the heap: the array itself, or a copy of
    /// a mapping.
    #[must_use]
    pub fn into_heap(self) -> Vec<u128> {
        match self {
            Slots::Heap(b) => b.into_vec(),
            #[cfg(target_os = "linux")]
            Slots::Mapped(m) => m.as_slice().to_vec(),
        }
    }

    /// Whether the array has a mapping of its own.
    #[cfg(test)]
    #[must_use]
    pub fn is_mapped(&self) -> bool {
        #[cfg(target_os = "linux")]
        if let Slots::Mapped(_) = self {
            return true;
        }
        false
    }
}

#[cfg(target_os = "linux")]
pub use mapping::Mapping;

#[cfg(target_os = "linux")]
mod mapping {
    use std::ptr::NonNull;

    /// The size of a huge page, and the alignment of every reservation, so
    /// that its pages can be huge from the first.
    const HUGE: usize = 2 << 20;

    /// A reservation, when made or grown past, is this many times the
    /// slots' length: a table grows by a fifth at a time, so about one
    /// growth in four moves the pages. Address space costs nothing until
    /// it is written to (`MAP_NORESERVE`), except where the kernel counts
    /// every writable mapping against a limit (`vm.overcommit_memory` 2),
    /// which is why the reservation is not larger.
    const RESERVE_FACTOR: usize = 2;

    /// An anonymous private mapping of `reserved` bytes, aligned to a huge
    /// page and marked for huge pages, of which the first `len` slots are
    /// the array. Bytes past `len` slots are zero: never written, or
    /// zeroed or given back (`MADV_DONTNEED`) when the array shrank.
    pub struct Mapping {
        ptr: NonNull<u128>,
        len: usize,
        reserved: usize,
    }

    // SAFETY: the mapping is owned by this value alone, like a `Box`.
    unsafe impl Send for Mapping {}
    // SAFETY: shared access only reads, like a `&[u128]`.
    unsafe impl Sync for Mapping {}

    fn round_up(bytes: usize, to: usize) -> usize {
        bytes.div_ceil(to) * to
    }

    /// Reserves `bytes` (a multiple of `HUGE`) of address space aligned to
    /// a huge page and marked for huge pages. Nothing is committed until
    /// it is written to (`MAP_NORESERVE`).
    fn reserve(bytes: usize) -> Option<NonNull<u128>> {
        let over = bytes.checked_add(HUGE)?;
        // SAFETY: a new anonymous mapping at an address the kernel picks;
        // it touches no memory of this process.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                over,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return None;
        }
        let base = p as usize;
        let start = round_up(base, HUGE);
        // SAFETY: both ranges lie inside the mapping just made, which
        // nothing else knows of; they trim it to the aligned part.
        unsafe {
            if start > base {
                libc::munmap(p, start - base);
            }
            let tail = start + bytes;
            if base + over > tail {
                libc::munmap(tail as *mut libc::c_void, base + over - tail);
            }
            // Advice for the whole mapping, so it stays one mapping. An
            // error leaves small pages: slower, not wrong.
            libc::madvise(start as *mut libc::c_void, bytes, libc::MADV_HUGEPAGE);
        }
        NonNull::new(start as *mut u128)
    }

    impl Mapping {
        /// `len` zero slots, or `None` if the kernel refuses the mapping.
        pub fn new(len: usize) -> Option<Self> {
            let reserved = round_up(len.checked_mul(16 * RESERVE_FACTOR)?.max(1), HUGE);
            Some(Mapping {
                ptr: reserve(reserved)?,
                len,
                reserved,
            })
        }

        /// A mapping with room for exactly `reserved_slots`, rounded up to
        /// a huge page, so that tests can grow past it.
        #[cfg(test)]
        pub fn with_room(len: usize, reserved_slots: usize) -> Option<Self> {
            let reserved = round_up((reserved_slots.max(len) * 16).max(1), HUGE);
            Some(Mapping {
                ptr: reserve(reserved)?,
                len,
                reserved,
            })
        }

        /// Bytes of address space reserved.
        #[cfg(test)]
        pub fn reserved(&self) -> usize {
            self.reserved
        }

        pub fn as_slice(&self) -> &[u128] {
            // SAFETY: the first `len` slots lie inside the mapping, which
            // is readable, aligned and owned by `self`.
            unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
        }

        pub fn as_mut_slice(&mut self) -> &mut [u128] {
            // SAFETY: as in `as_slice`, and `&mut self` makes it unique.
            unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
        }

        /// See [`super::Slots::resize`]; false, with nothing changed, if
        /// the kernel refuses the larger reservation a growth needs.
        #[must_use]
        pub fn resize(&mut self, len: usize) -> bool {
            if len < self.len {
                self.shrink(len);
            } else if len.checked_mul(16).is_none_or(|b| b > self.reserved)
                && !self.move_to_room_for(len)
            {
                return false;
            }
            self.len = len;
            true
        }

        /// Zeroes the slots from `len` on, giving whole huge pages of them
        /// back to the kernel.
        fn shrink(&mut self, len: usize) {
            let base = self.ptr.as_ptr() as usize;
            let (from, to) = (len * 16, self.len * 16);
            // Zeroed by hand up to the next huge page boundary, which
            // keeps the huge page the new end lies in whole.
            let boundary = round_up(from, HUGE).min(to);
            self.as_mut_slice()[len..boundary / 16].fill(0);
            let end = round_up(to, 4096);
            if end > boundary {
                // SAFETY: a range of whole pages inside the mapping, past
                // the new length; private anonymous pages read as zero
                // after `MADV_DONTNEED`, as the invariant wants.
                let r = unsafe {
                    libc::madvise(
                        (base + boundary) as *mut libc::c_void,
                        end - boundary,
                        libc::MADV_DONTNEED,
                    )
                };
                if r != 0 {
                    self.as_mut_slice()[boundary / 16..].fill(0);
                }
            }
        }

        /// Moves the pages to a new reservation with room for `len` slots
        /// and more, without copying them. False, with the slots where
        /// they were, if the kernel refuses the reservation or the move.
        fn move_to_room_for(&mut self, len: usize) -> bool {
            let Some(reserved) = len
                .checked_mul(16 * RESERVE_FACTOR)
                .and_then(|b| b.checked_next_multiple_of(HUGE))
            else {
                return false;
            };
            let Some(to) = reserve(reserved) else {
                return false;
            };
            // SAFETY: moves this mapping, whole, over the start of the new
            // reservation (`MREMAP_FIXED` replaces what is there), keeping
            // its pages and its huge-page mark; the old range is unmapped
            // by the move. Both are ours alone, aligned to huge pages.
            let moved = unsafe {
                libc::mremap(
                    self.ptr.as_ptr().cast(),
                    self.reserved,
                    reserved,
                    libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED,
                    to.as_ptr().cast::<libc::c_void>(),
                )
            };
            if moved == libc::MAP_FAILED {
                // The new reservation may be gone in part already (the
                // move unmaps it first), so nothing is copied into it.
                // SAFETY: the range is the reservation made above, ours
                // alone; unmapping what of it is left touches nothing else.
                unsafe {
                    libc::munmap(to.as_ptr().cast(), reserved);
                }
                return false;
            }
            self.ptr = to;
            self.reserved = reserved;
            true
        }
    }

    impl Drop for Mapping {
        fn drop(&mut self) {
            // SAFETY: the whole reservation is ours and nothing refers to
            // it past this point.
            unsafe {
                libc::munmap(self.ptr.as_ptr().cast(), self.reserved);
            }
        }
    }
}
