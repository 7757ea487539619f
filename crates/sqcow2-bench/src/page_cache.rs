//! Puts an image file into a stated page-cache state before a server's
//! write loads. On Linux 6.x with ext4's large folios, what a 4 KiB
//! buffered overwrite costs depends on the size of the folio it lands in
//! (`ext4_block_write_begin` walks every block of it), which depends on
//! how the page came into the cache: a file written in 64 KiB pieces or
//! read sequentially (readahead) costs 3-20x more per overwrite than one
//! read in 4 KiB pieces. Every server gets the same state: written back,
//! dropped, and read back 4 KiB at a time without readahead — what a
//! guest's random I/O leaves behind.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;

use rustix::fs::{seek, Advice, SeekFrom};
use rustix::io::Errno;

/// Bytes per read: one page, so that every folio is one page.
const PAGE: usize = 4096;

/// Syncs `file`, drops its pages from the cache and reads every page of
/// its data back one at a time, with readahead off (holes are skipped: a
/// sparse base of tens of GiB would otherwise fill the cache with zeros).
pub fn cache_in_pages(path: &std::path::Path) -> io::Result<()> {
    let file = File::open(path)?;
    file.sync_all()?;
    advise(&file, Advice::DontNeed)?;
    advise(&file, Advice::Random)?;
    read_data(&file, PAGE)
}

/// Reads every byte of data of each regular file in `dir` (1 MiB reads,
/// holes skipped), so that what a run reads next comes from the page
/// cache. Needed before every measurement that assumes a warm cache: the
/// VMs here give file pages back to their host while idle (measured
/// 2026-11-27: `Cached` shrank by 700 MB in 45 idle seconds with 17 GB
/// free, no reclaim counted; a 1 GiB chain read 2 hours earlier had no
/// page left), so a file made at the start of a long run is partly on
/// disk by the time its turn comes.
pub fn warm_dir(dir: &std::path::Path) -> io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        if entry.file_type()?.is_file() {
            warm(&entry.path())?;
        }
    }
    Ok(())
}

/// Reads every byte of data of `path` (1 MiB reads, holes skipped).
pub fn warm(path: &std::path::Path) -> io::Result<()> {
    read_data(&File::open(path)?, 1 << 20)
}

/// Reads every data range of `file` (holes skipped, from the page its
/// data starts in) in reads of at most `chunk` bytes.
fn read_data(file: &File, chunk: usize) -> io::Result<()> {
    let len = file.metadata()?.len();
    let mut buf = vec![0u8; chunk];
    let mut at = 0u64;
    while at < len {
        let start = match seek(file, SeekFrom::Data(at)) {
            Ok(start) => start,
            // No data past `at`.
            Err(Errno::NXIO) => break,
            Err(e) => return Err(e.into()),
        };
        let end = seek(file, SeekFrom::Hole(start))?.min(len);
        let mut pos = start - start % PAGE as u64;
        while pos < end {
            let want = chunk.min((end - pos) as usize);
            let n = file.read_at(&mut buf[..want], pos)?;
            if n == 0 {
                break;
            }
            pos += n as u64;
        }
        at = end.max(start + 1);
    }
    Ok(())
}

fn advise(file: &File, advice: Advice) -> io::Result<()> {
    rustix::fs::fadvise(file, 0, None, advice).map_err(io::Error::from)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    /// What the page cache holds of `path` (util-linux's `fincore`).
    fn cached_bytes(path: &std::path::Path) -> u64 {
        let out = std::process::Command::new("fincore")
            .args(["--bytes", "--noheadings", "--output", "RES"])
            .arg(path)
            .output()
            .expect("fincore (util-linux-extra; scripts/test.sh installs it)");
        String::from_utf8_lossy(&out.stdout).trim().parse().unwrap()
    }

    /// Only the data is read back: of a 1 TiB sparse file with two pieces
    /// of data, their three pages are cached and nothing else (its holes
    /// would be 268 million pages of zeros); a file with no data at all
    /// needs no read.
    #[test]
    fn only_the_data_of_a_sparse_file_is_read() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sparse");
        let mut f = File::create(&path).unwrap();
        f.set_len(1 << 40).unwrap();
        f.write_all(&[1u8; 8192]).unwrap();
        f.write_at(&[2u8; 100], (1 << 40) - 100).unwrap();
        drop(f);
        cache_in_pages(&path).unwrap();
        // What the page cache holds of it (util-linux's `fincore`): the
        // three pages of data, read back after they were dropped.
        let cached = cached_bytes(&path);
        assert!(
            (3 * 4096..1 << 20).contains(&cached),
            "{cached} bytes of the file cached"
        );
        let empty = dir.path().join("empty");
        File::create(&empty).unwrap().set_len(1 << 30).unwrap();
        cache_in_pages(&empty).unwrap();
    }

    /// Warming reads the data back into the cache after it was dropped,
    /// and only the data.
    #[test]
    fn warming_a_directory_caches_the_data_of_its_files() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sparse");
        let f = File::create(&path).unwrap();
        f.set_len(1 << 40).unwrap();
        f.write_all_at(&[3u8; 3 << 20], 1 << 30).unwrap();
        f.sync_all().unwrap();
        advise(&f, Advice::DontNeed).unwrap();
        drop(f);
        std::fs::create_dir(dir.path().join("sub")).unwrap();
        warm_dir(dir.path()).unwrap();
        let cached = cached_bytes(&path);
        assert!(
            ((3 << 20)..(8 << 20)).contains(&cached),
            "{cached} bytes of the file cached"
        );
    }
}
