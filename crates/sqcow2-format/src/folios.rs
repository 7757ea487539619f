//! Test support: how the page cache holds a file's pages (folio sizes),
//! read from `/proc/self/pagemap` and `/proc/kpageflags` through a
//! mapping of the file (needs root; `None` without it).

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;

use crate::direct::PAGE_BYTES as PAGE;
/// `/proc/kpageflags`: a page of a compound page (a folio) after its
/// first.
const KPF_COMPOUND_TAIL: u64 = 1 << 16;
/// `/proc/self/pagemap`: the page is present; its frame number.
const PM_PRESENT: u64 = 1 << 63;
const PM_PFN: u64 = (1 << 55) - 1;

/// The largest folio, in pages, holding any page of `[offset, offset +
/// len)` of `file` (page aligned), every page read into the cache first;
/// `None` when the kernel does not say (frame numbers hidden: not root).
pub(crate) fn largest_folio_pages(file: &File, offset: u64, len: u64) -> io::Result<Option<u64>> {
    assert!(offset % PAGE == 0 && len % PAGE == 0 && len > 0);
    // SAFETY: a new shared read-only mapping of a file this function
    // borrows, unmapped before it returns; nothing else refers to it.
    let addr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len as usize,
            libc::PROT_READ,
            libc::MAP_SHARED,
            file.as_raw_fd(),
            offset as libc::off_t,
        )
    };
    if addr == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    let pages = len / PAGE;
    let mut entries = vec![0u8; pages as usize * 8];
    let read = (|| {
        for i in 0..pages {
            // SAFETY: within the mapping made above, which is readable.
            unsafe { std::ptr::read_volatile((addr as *const u8).add((i * PAGE) as usize)) };
        }
        File::open("/proc/self/pagemap")?.read_exact_at(&mut entries, addr as u64 / PAGE * 8)
    })();
    // SAFETY: the mapping made above, no longer used.
    unsafe { libc::munmap(addr, len as usize) };
    read?;
    let flags = File::open("/proc/kpageflags")?;
    let mut largest = 0;
    let mut run = 0;
    for e in entries.chunks_exact(8) {
        let e = u64::from_le_bytes(e.try_into().expect("8 bytes"));
        let pfn = e & PM_PFN;
        if e & PM_PRESENT == 0 || pfn == 0 {
            return Ok(None);
        }
        let mut f = [0u8; 8];
        flags.read_exact_at(&mut f, pfn * 8)?;
        let f = u64::from_le_bytes(f);
        run = if f & KPF_COMPOUND_TAIL != 0 {
            run + 1
        } else {
            1
        };
        largest = largest.max(run);
    }
    Ok(Some(largest))
}
