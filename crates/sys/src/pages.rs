//! Socket buffers the data plane can give back: page-aligned buffers in anonymous mappings of this module, whose
//! pages can be discarded while their contents are not needed (an empty ring buffer) and come back zero-filled on
//! their next touch.
//!
//! smoltcp's ring buffers take a borrowed slice (`&'a mut [u8]`), and a socket set of `'static` sockets needs
//! `'static` slices; smoltcp never hands a buffer back. So the mappings are made in slabs and **never unmapped**:
//! [`buffer`] gives out a `'static` slice carved from a slab (the caller keeps the socket that holds it, and reuses
//! it rather than dropping it), and [`discard`] takes the address and length of a buffer that it gave out — the
//! slice itself is held by the socket — and drops its pages (`madvise(MADV_DONTNEED)`): they stop counting in the
//! process's resident memory, and read as zeros afterwards.
//!
//! Contract of [`discard`]: the bytes of the buffer change to zeros underneath the `&mut` slice that holds them, as
//! memory written by a device. The caller discards only a buffer whose bytes it no longer needs (a ring buffer with
//! nothing queued, whose next write goes anywhere in it) and on the thread that uses the slice, between two uses.
//! A range that is not inside a slab of this module is refused (nothing else is touched).

use std::io;
use std::sync::Mutex;

/// The slabs: every mapping made (start, length), in order of their start, and the part of the newest not yet given
/// out.
struct Slabs {
    maps: Vec<(usize, usize)>,
    next: usize,
    end: usize,
}

static SLABS: Mutex<Slabs> = Mutex::new(Slabs { maps: Vec::new(), next: 0, end: 0 });

/// Smallest slab: buffers are carved from mappings of at least this many bytes (one mapping, one system call, for
/// many buffers).
const SLAB: usize = 8 << 20;

/// The size of a page.
pub fn page_size() -> usize {
    // SAFETY: sysconf takes no pointers.
    let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if n > 0 {
        n as usize
    } else {
        4096
    }
}

/// A fresh private anonymous mapping of `size` bytes, readable and writable, zero, at an address of the kernel's
/// choice (it overlaps nothing of ours): its address.
pub(crate) fn map_anonymous(size: usize) -> io::Result<usize> {
    // SAFETY: no address given, no file: the kernel makes a new mapping and touches nothing else.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            size,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    Ok(p as usize)
}

/// A buffer of `len` bytes (rounded up to whole pages; at least one), page-aligned, zero, none of its pages resident
/// until written. It is never freed: keep what holds it and reuse it.
pub fn buffer(len: usize) -> io::Result<&'static mut [u8]> {
    let page = page_size();
    let len = len.max(1).div_ceil(page) * page;
    let mut s = SLABS.lock().unwrap_or_else(|e| e.into_inner());
    if s.end - s.next < len {
        let size = len.max(SLAB);
        let start = map_anonymous(size)?;
        let at = s.maps.partition_point(|&(a, _)| a < start);
        s.maps.insert(at, (start, size));
        (s.next, s.end) = (start, start + size);
    }
    let start = s.next;
    s.next += len;
    // SAFETY: [start, start + len) lies in a mapping of ours that is readable, writable and never unmapped (so
    // valid for 'static), zero-initialized by the kernel, and given out once: `next` moved past it under the lock.
    Ok(unsafe { std::slice::from_raw_parts_mut(start as *mut u8, len) })
}

/// The whole pages of [addr, addr + len) if the range lies inside one slab.
fn pages_of(addr: usize, len: usize) -> Option<(usize, usize)> {
    let page = page_size();
    let end = addr.checked_add(len)?;
    let s = SLABS.lock().unwrap_or_else(|e| e.into_inner());
    let i = s.maps.partition_point(|&(a, _)| a <= addr).checked_sub(1)?;
    let (start, size) = s.maps[i];
    if end > start + size {
        return None;
    }
    let (first, last) = (addr.div_ceil(page) * page, end / page * page);
    (first < last).then_some((first, last - first))
}

/// Discards the pages of the buffer at `addr` of `len` bytes (one [`buffer`] gave out, or part of it; only its
/// whole pages): they are no longer resident and read as zeros afterwards (see the module's contract). Returns
/// false when the range is not inside a slab of this module (nothing is done) or the kernel refused.
pub fn discard(addr: usize, len: usize) -> bool {
    let Some((first, n)) = pages_of(addr, len) else { return false };
    // SAFETY: the range is whole pages of one of our mappings, which stays mapped; MADV_DONTNEED on private
    // anonymous memory only drops its pages (zero-fill on the next touch): no memory becomes invalid.
    unsafe { libc::madvise(first as *mut libc::c_void, n, libc::MADV_DONTNEED) == 0 }
}

/// How many pages of the buffer at `addr` of `len` bytes are resident (`mincore`); for tests and measurements.
pub fn resident_pages(addr: usize, len: usize) -> io::Result<usize> {
    let Some((first, n)) = pages_of(addr, len) else {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "not a buffer of flexstack_sys::pages"));
    };
    let mut vec = vec![0u8; n / page_size()];
    // SAFETY: the range is whole pages of one of our mappings; `vec` has one byte per page, as mincore writes.
    let rc = unsafe { libc::mincore(first as *mut libc::c_void, n, vec.as_mut_ptr()) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(vec.iter().filter(|&&b| b & 1 != 0).count())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_page_aligned_zero_and_apart() {
        let page = page_size();
        let a = buffer(10_000).unwrap();
        let b = buffer(page).unwrap();
        assert_eq!(a.len(), 3 * page);
        assert_eq!(a.as_ptr() as usize % page, 0);
        assert_eq!(b.as_ptr() as usize % page, 0);
        assert!(a.iter().all(|&x| x == 0));
        a.fill(1);
        assert!(b.iter().all(|&x| x == 0), "a buffer does not overlap the next");
        let big = buffer(SLAB + 1).unwrap();
        assert_eq!(big.len(), SLAB + page);
        assert_eq!(resident_pages(big.as_ptr() as usize, big.len()).unwrap(), 0);
    }

    #[test]
    fn discarded_pages_leave_memory_and_read_as_zero() {
        let page = page_size();
        let buf = buffer(64 * page).unwrap();
        let (addr, len) = (buf.as_ptr() as usize, buf.len());
        assert_eq!(resident_pages(addr, len).unwrap(), 0, "untouched pages are not resident");
        buf[0] = 7;
        buf[5 * page + 3] = 9;
        assert_eq!(resident_pages(addr, len).unwrap(), 2);
        assert!(discard(addr, len));
        assert_eq!(resident_pages(addr, len).unwrap(), 0);
        assert_eq!((buf[0], buf[5 * page + 3]), (0, 0));
        // Usable again: written bytes stay.
        buf[5 * page..6 * page].fill(3);
        assert!(buf[5 * page..6 * page].iter().all(|&x| x == 3));
        assert!(buf.iter().all(|&x| x == 0 || x == 3));
        // Only whole pages are discarded: a range that starts mid-page keeps that page.
        buf[0] = 1;
        assert!(discard(addr + 1, len - 1));
        assert_eq!(buf[0], 1);
        assert_eq!(buf[5 * page], 0);
    }

    #[test]
    fn memory_that_is_not_a_slab_is_refused() {
        let heap = vec![1u8; 1 << 20];
        assert!(!discard(heap.as_ptr() as usize, heap.len()));
        assert!(heap.iter().all(|&x| x == 1));
        assert!(resident_pages(heap.as_ptr() as usize, heap.len()).is_err());
        let buf = buffer(4096).unwrap();
        assert!(!discard(page_size(), 4096), "a range below every slab");
        assert!(!discard(buf.as_ptr() as usize, usize::MAX), "a range past the end of the address space");
    }
}
