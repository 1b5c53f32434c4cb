//! Zeroed words in memory of their own, backed by transparent huge pages where the system has them.

use std::io;
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;
use std::sync::atomic::AtomicU64;

/// A huge page's size (x86-64, arm64 with 4 KiB pages).
const HUGE: usize = 2 << 20;

/// The mapping behind [`HugeWords`] and [`HugeBuf`] (whose documentation says what it is).
#[derive(Debug)]
struct Mapping {
    ptr: NonNull<u64>,
    words: usize,
}

// SAFETY: the mapping is owned by this value alone; `HugeWords` reaches it only as `&[AtomicU64]` (Sync and Send)
// and `HugeBuf` as `&[u64]` / `&mut [u64]` under the borrow rules, so moving or sharing the owner between threads
// shares nothing else.
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// A mapping of `words` zeroed words (rounded up to whole 2 MiB), or the kernel's error.
    fn new(words: usize) -> io::Result<Mapping> {
        let len = (words.max(1) * 8).next_multiple_of(HUGE);
        // Map one huge page more, to cut an aligned range out of it.
        let map = len + HUGE;
        let start = crate::pages::map_anonymous(map)?;
        let aligned = start.next_multiple_of(HUGE);
        // SAFETY: both ranges lie inside the mapping just made (head: [start, aligned), tail: [aligned + len,
        // start + map)), which nothing else refers to; what stays is [aligned, aligned + len).
        unsafe {
            if aligned > start {
                libc::munmap(start as *mut libc::c_void, aligned - start);
            }
            let tail = start + map - (aligned + len);
            if tail > 0 {
                libc::munmap((aligned + len) as *mut libc::c_void, tail);
            }
            // Advice only: refused where there are no transparent huge pages; the memory works either way.
            libc::madvise(aligned as *mut libc::c_void, len, libc::MADV_HUGEPAGE);
        }
        let ptr = NonNull::new(aligned as *mut u64).ok_or_else(|| io::Error::other("mmap returned null"))?;
        Ok(Mapping { ptr, words: len / 8 })
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: the range is the mapping `new` kept; no reference into it outlives `self` (they borrow it).
        unsafe {
            libc::munmap(self.ptr.as_ptr().cast(), self.words * 8);
        }
    }
}

/// Zeroed 64-bit words (atomic, to share between threads) in an anonymous mapping of their own, aligned to 2 MiB and advised to be backed by
/// transparent huge pages (`MADV_HUGEPAGE`): a table read at random (a flow table) then costs one TLB entry per
/// 2 MiB instead of one per 4 KiB page, and a TLB miss a shorter page walk (in a virtual machine each step of the
/// guest's walk is itself translated by the host's tables). The pages come from the kernel already zeroed, when
/// first touched: memory never touched is not resident. Unmapped when dropped. Where the system has no transparent
/// huge pages (or they are `never`), the advice is refused and the mapping is ordinary memory. For plain words of
/// one owner: [`HugeBuf`].
#[derive(Debug)]
pub struct HugeWords(Mapping);

impl HugeWords {
    /// At least `words` zeroed words (rounded up to whole 2 MiB), or the kernel's error.
    pub fn new(words: usize) -> io::Result<HugeWords> {
        Mapping::new(words).map(HugeWords)
    }
}

impl Deref for HugeWords {
    type Target = [AtomicU64];

    fn deref(&self) -> &[AtomicU64] {
        // SAFETY: `ptr` is the start of a live, readable and writable mapping of `words * 8` bytes owned by `self`,
        // aligned to 2 MiB (so to AtomicU64's 8 bytes); zeroed memory is a valid AtomicU64 (same layout as u64),
        // and the words are only ever reached as atomics.
        unsafe { std::slice::from_raw_parts(self.0.ptr.as_ptr().cast::<AtomicU64>(), self.0.words) }
    }
}

/// Zeroed plain words on huge pages, for one owner (a hash table's buckets): as [`HugeWords`], without atomics.
#[derive(Debug)]
pub struct HugeBuf(Mapping);

impl HugeBuf {
    /// At least `words` zeroed words (rounded up to whole 2 MiB), or the kernel's error.
    pub fn new(words: usize) -> io::Result<HugeBuf> {
        Mapping::new(words).map(HugeBuf)
    }
}

impl Deref for HugeBuf {
    type Target = [u64];

    fn deref(&self) -> &[u64] {
        // SAFETY: a live mapping of `words` zeroed, aligned u64s owned by `self`; shared borrows only read.
        unsafe { std::slice::from_raw_parts(self.0.ptr.as_ptr(), self.0.words) }
    }
}

impl DerefMut for HugeBuf {
    fn deref_mut(&mut self) -> &mut [u64] {
        // SAFETY: as above; `&mut self` makes this the only borrow of the mapping.
        unsafe { std::slice::from_raw_parts_mut(self.0.ptr.as_ptr(), self.0.words) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering;

    #[test]
    fn zeroed_aligned_and_writable() {
        let w = HugeWords::new(100).unwrap();
        assert_eq!(w.len(), HUGE / 8, "rounded up to a huge page");
        assert_eq!(w.as_ptr() as usize % HUGE, 0);
        assert!(w.iter().all(|x| x.load(Ordering::Relaxed) == 0));
        w[w.len() - 1].store(7, Ordering::Relaxed);
        assert_eq!(w[w.len() - 1].load(Ordering::Relaxed), 7);
        let mut big = HugeBuf::new(HUGE / 8 + 1).unwrap();
        assert_eq!(big.len(), 2 * HUGE / 8);
        assert!(big.iter().all(|&x| x == 0));
        big[HUGE / 8] = 9;
        assert_eq!(big[HUGE / 8], 9);
    }
}
