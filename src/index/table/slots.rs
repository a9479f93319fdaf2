//! [`Slots`]: the table's array of slots, resizable in place without a
//! copy, and on huge pages from its first write once it is large.

use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

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
pub struct Slots {
    ptr: NonNull<u128>,
    len: usize,
    /// Bytes of address space of the mapping the slots have to themselves,
    /// or 0 for a heap array (a `Box<[u128]>` of `len` slots).
    reserved: usize,
}

// SAFETY: the slots are owned by this value alone, like a `Box`.
unsafe impl Send for Slots {}
// SAFETY: shared access only reads, like a `&[u128]`.
unsafe impl Sync for Slots {}

impl Default for Slots {
    fn default() -> Self {
        Slots::from(Vec::new())
    }
}

impl std::fmt::Debug for Slots {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = if self.reserved == 0 { "heap" } else { "mapped" };
        write!(f, "Slots({} {kind})", self.len)
    }
}

impl Deref for Slots {
    type Target = [u128];

    #[inline]
    fn deref(&self) -> &[u128] {
        // SAFETY: `ptr` holds `len` initialized slots, in a box or in the
        // mapping, owned by `self`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl DerefMut for Slots {
    #[inline]
    fn deref_mut(&mut self) -> &mut [u128] {
        // SAFETY: as in `deref`, and `&mut self` makes it unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl From<Vec<u128>> for Slots {
    fn from(v: Vec<u128>) -> Self {
        let b: &mut [u128] = Box::leak(v.into_boxed_slice());
        Slots {
            len: b.len(),
            ptr: NonNull::from(b).cast(),
            reserved: 0,
        }
    }
}

impl Drop for Slots {
    fn drop(&mut self) {
        if self.reserved == 0 {
            // SAFETY: a heap array is the box `From<Vec<u128>>` leaked,
            // of `len` slots, and is dropped once, here.
            drop(unsafe {
                Box::from_raw(std::ptr::slice_from_raw_parts_mut(
                    self.ptr.as_ptr(),
                    self.len,
                ))
            });
        } else {
            #[cfg(target_os = "linux")]
            mapping::unmap(self.ptr, self.reserved);
        }
    }
}

impl Slots {
    /// `len` empty slots.
    #[must_use]
    pub fn zeroed(len: usize) -> Self {
        #[cfg(target_os = "linux")]
        if len * 16 >= MAPPED_BYTES
            && let Some((ptr, reserved)) = mapping::reserve_for(len)
        {
            return Slots { ptr, len, reserved };
        }
        Slots::from(vec![0u128; len])
    }

    /// Whether [`Slots::resize`] to `len` keeps the slots where they are
    /// or moves them without a copy: a mapping does; a heap array does
    /// while it stays small (a larger one is better laid out afresh into
    /// a mapping of its own, [`Slots::zeroed`]).
    #[must_use]
    pub fn resizes_in_place(&self, len: usize) -> bool {
        self.reserved != 0 || len * 16 < MAPPED_BYTES || cfg!(not(target_os = "linux"))
    }

    /// Makes the array `len` slots long: slots past the old length are
    /// empty, and the slots past `len` are dropped (the caller has moved
    /// every entry out of them).
    pub fn resize(&mut self, len: usize) {
        #[cfg(target_os = "linux")]
        if self.reserved != 0 {
            if len < self.len {
                mapping::shrink(self, len);
                self.len = len;
                return;
            }
            if len.checked_mul(16).is_some_and(|b| b <= self.reserved) {
                self.len = len;
                return;
            }
            if let Some((ptr, reserved)) = mapping::move_to_room_for(self.ptr, self.reserved, len) {
                (self.ptr, self.reserved, self.len) = (ptr, reserved, len);
                return;
            }
            // The kernel refused a larger reservation or the move: the
            // slots go to the heap, a copy.
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
        if self.reserved != 0 {
            return self.to_vec();
        }
        let me = std::mem::ManuallyDrop::new(self);
        // SAFETY: as in `drop`; `me` is not dropped, so the box is owned
        // by the vector alone.
        unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(me.ptr.as_ptr(), me.len)) }
            .into_vec()
    }

    /// Whether the array has a mapping of its own.
    #[cfg(test)]
    #[must_use]
    pub fn is_mapped(&self) -> bool {
        self.reserved != 0
    }

    /// `len` empty slots in a mapping with room for `room` slots, rounded
    /// up to a huge page, so that tests can grow past it.
    #[cfg(all(test, target_os = "linux"))]
    #[must_use]
    pub fn mapped_with_room(len: usize, room: usize) -> Option<Self> {
        let reserved = (room.max(len) * 16).max(1).next_multiple_of(mapping::HUGE);
        Some(Slots {
            ptr: mapping::reserve(reserved)?,
            len,
            reserved,
        })
    }

    /// Bytes of address space reserved for a mapping, 0 on the heap.
    #[cfg(test)]
    #[must_use]
    pub fn reserved(&self) -> usize {
        self.reserved
    }
}

#[cfg(target_os = "linux")]
mod mapping {
    use std::ptr::NonNull;

    use super::Slots;

    /// The size of a huge page, and the alignment of every reservation, so
    /// that its pages can be huge from the first.
    pub const HUGE: usize = 2 << 20;

    /// A reservation, when made or grown past, is this many times the
    /// slots' length: a table grows by a fifth at a time, so about one
    /// growth in four moves the pages. Address space costs nothing until
    /// it is written to (`MAP_NORESERVE`), except where the kernel counts
    /// every writable mapping against a limit (`vm.overcommit_memory` 2),
    /// which is why the reservation is not larger.
    const RESERVE_FACTOR: usize = 2;

    /// Reserves `bytes` (a multiple of `HUGE`) of address space aligned to
    /// a huge page and marked for huge pages, or `None` if the kernel
    /// refuses. Nothing is committed until it is written to
    /// (`MAP_NORESERVE`); it reads as zero.
    pub fn reserve(bytes: usize) -> Option<NonNull<u128>> {
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
        let start = base.next_multiple_of(HUGE);
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

    /// A reservation for `len` slots and room to grow: its start and size.
    pub fn reserve_for(len: usize) -> Option<(NonNull<u128>, usize)> {
        let bytes = len
            .checked_mul(16 * RESERVE_FACTOR)?
            .max(1)
            .checked_next_multiple_of(HUGE)?;
        Some((reserve(bytes)?, bytes))
    }

    /// Unmaps a reservation.
    pub fn unmap(ptr: NonNull<u128>, reserved: usize) {
        // SAFETY: the whole reservation belongs to the slots being
        // dropped or moved, and nothing refers to it past this point.
        unsafe {
            libc::munmap(ptr.as_ptr().cast(), reserved);
        }
    }

    /// Zeroes the mapped slots from `len` on, giving whole huge pages of
    /// them back to the kernel, so that all past the new length reads zero.
    pub fn shrink(s: &mut Slots, len: usize) {
        let base = s.ptr.as_ptr() as usize;
        let (from, to) = (len * 16, s.len * 16);
        // Zeroed by hand up to the next huge page boundary, which keeps
        // the huge page the new end lies in whole.
        let boundary = from.next_multiple_of(HUGE).min(to);
        s[len..boundary / 16].fill(0);
        let end = to.next_multiple_of(4096);
        if end > boundary {
            // SAFETY: a range of whole pages inside the mapping, past the
            // new length; private anonymous pages read as zero after
            // `MADV_DONTNEED`, as the slots want.
            let r = unsafe {
                libc::madvise(
                    (base + boundary) as *mut libc::c_void,
                    end - boundary,
                    libc::MADV_DONTNEED,
                )
            };
            if r != 0 {
                s[boundary / 16..].fill(0);
            }
        }
    }

    /// Moves a reservation's pages to a new one with room for `len` slots
    /// and more, without copying them: the new start and size. `None`,
    /// with the slots where they were, if the kernel refuses the
    /// reservation or the move.
    pub fn move_to_room_for(
        ptr: NonNull<u128>,
        reserved: usize,
        len: usize,
    ) -> Option<(NonNull<u128>, usize)> {
        let (to, bytes) = reserve_for(len)?;
        // SAFETY: moves the old mapping, whole, over the start of the new
        // reservation (`MREMAP_FIXED` replaces what is there), keeping its
        // pages and its huge-page mark; the old range is unmapped by the
        // move. Both are ours alone, aligned to huge pages.
        let moved = unsafe {
            libc::mremap(
                ptr.as_ptr().cast(),
                reserved,
                bytes,
                libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED,
                to.as_ptr().cast::<libc::c_void>(),
            )
        };
        if moved == libc::MAP_FAILED {
            // The new reservation may be gone in part already (the move
            // unmaps it first), so nothing is copied into it.
            unmap(to, bytes);
            return None;
        }
        Some((to, bytes))
    }
}
