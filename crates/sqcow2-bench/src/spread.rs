//! The kernel's own cost of a long chain: the disk's bytes spread evenly
//! over as many files as the chain has layers, read at random 4 KiB
//! offsets with io_uring in this process (no vhost, no qcow2). Reading the
//! same amount of data from 10,000 files instead of one costs the kernel
//! more per read (a file, an inode and a page-cache tree per file, none of
//! them staying in the CPU's caches); a server reading a chain pays that
//! too, whatever its lookup costs. The ratio of this limit at N files to
//! one file is the best any server can do at N layers.

use std::os::fd::AsRawFd;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use io_uring::{opcode, types, IoUring};

use crate::load::{summarize, LoadResult, LoadSpec, Pattern, Target};

/// Block size of the reads.
const BLOCK: usize = 4096;

/// Writes `size` bytes of random data as `files` files of equal size in
/// `dir` (created; emptied first).
pub fn make_files(dir: &Path, files: usize, size: u64) -> anyhow::Result<()> {
    use std::io::Write;
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let per = (size / files as u64) / BLOCK as u64 * BLOCK as u64;
    if per == 0 {
        bail!("{size} bytes cannot be spread over {files} files of whole blocks");
    }
    let mut rng = fastrand::Rng::with_seed(11);
    let mut buf = vec![0u8; (per as usize).min(1 << 20)];
    for i in 0..files {
        let mut f = std::fs::File::create(dir.join(format!("f{i:05}")))?;
        let mut left = per;
        while left > 0 {
            let n = left.min(buf.len() as u64) as usize;
            rng.fill(&mut buf[..n]);
            f.write_all(&buf[..n])?;
            left -= n as u64;
        }
        // Written back before any read: a read that finds a page under
        // writeback goes to io_uring's worker threads (measured: unsynced
        // files read at depth 1 at 13,000-100,000 IOPS, synced ones at
        // 330,000-870,000).
        f.sync_all()?;
    }
    Ok(())
}

/// `sqcow2-bench spread`: the kernel's cost of reading data spread over
/// many files, alone.
#[derive(Debug, clap::Args)]
pub struct SpreadArgs {
    /// Numbers of files to spread the bytes over.
    #[arg(long, value_delimiter = ',', default_value = "1,50,100,500,1000,10000")]
    pub files: Vec<usize>,
    /// Bytes in all (the suite uses half its 1 GiB disk: what its chains
    /// hold).
    #[arg(long, default_value = "512M")]
    pub size: String,
    /// Seconds per run.
    #[arg(long, default_value_t = 4.0)]
    pub seconds: f64,
    /// Repetitions (medians are printed).
    #[arg(long, default_value_t = 3)]
    pub repeat: usize,
    /// Where the files go (removed afterwards).
    #[arg(long, default_value = "bench-results/spread")]
    pub dir: std::path::PathBuf,
    /// How the files are opened and read.
    #[command(flatten)]
    pub access: FileAccess,
}

/// How [`measure`] opens and reads the files (the default: plain
/// descriptors, as a server has them).
#[derive(Debug, Clone, Copy, Default, clap::Args)]
pub struct FileAccess {
    /// Registers the files with the ring (io_uring's fixed files: no
    /// file-table lookup and reference count per read) and reads them so.
    #[arg(long)]
    pub registered_files: bool,
    /// Opens the files with `O_NOATIME` (reads do not check whether the
    /// access time needs an update).
    #[arg(long)]
    pub noatime: bool,
}

/// Runs [`SpreadArgs`]: a Markdown table of the medians.
pub fn run_cli(args: &SpreadArgs) -> anyhow::Result<()> {
    let size = crate::parse_size(&args.size)?;
    let duration = Duration::from_secs_f64(args.seconds);
    let median = |v: Vec<f64>| crate::report::median(v).unwrap_or(0.0);
    println!("| files | IOPS, depth 1 | IOPS, depth 32 | CPU per I/O, depth 32 (µs) | depth 1 vs first | depth 32 vs first |");
    println!("| ---: | ---: | ---: | ---: | ---: | ---: |");
    let mut first: Option<(f64, f64)> = None;
    for &n in &args.files {
        let dir = args.dir.join(format!("{n}"));
        make_files(&dir, n, size)?;
        let (mut d1, mut d32, mut cpu) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..args.repeat.max(1) {
            d1.push(measure(&dir, 1, duration, args.access)?.iops);
            let r = measure(&dir, 32, duration, args.access)?;
            d32.push(r.iops);
            cpu.extend(r.server_cpu_us_per_io);
        }
        let _ = std::fs::remove_dir_all(&dir);
        let (a, b) = (median(d1), median(d32));
        let (fa, fb) = *first.get_or_insert((a, b));
        println!(
            "| {n} | {a:.0} | {b:.0} | {:.1} | {:.2} | {:.2} |",
            median(cpu),
            a / fa,
            b / fb
        );
    }
    Ok(())
}

/// Random 4 KiB reads over the files of `dir` (as [`make_files`] wrote
/// them) at `depth` for `duration`; the CPU time of this thread per read
/// is the result's `server_cpu_us_per_io`. The files are opened and read
/// as `access` says.
pub fn measure(
    dir: &Path,
    depth: usize,
    duration: Duration,
    access: FileAccess,
) -> anyhow::Result<LoadResult> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut files = Vec::new();
    let mut names: Vec<_> = std::fs::read_dir(dir)?
        .map(|e| e.map(|e| e.path()))
        .collect::<Result<_, _>>()?;
    names.sort();
    for p in &names {
        let flags = if access.noatime { libc::O_NOATIME } else { 0 };
        files.push(
            std::fs::OpenOptions::new()
                .read(true)
                .custom_flags(flags)
                .open(p)
                .with_context(|| format!("opening {}", p.display()))?,
        );
    }
    let Some(first) = files.first() else {
        bail!("no files in {}", dir.display());
    };
    let blocks = first.metadata()?.len() / BLOCK as u64;
    if blocks == 0 {
        bail!("files in {} are empty", dir.display());
    }
    let mut ring = IoUring::new(depth.next_power_of_two() as u32)?;
    if access.registered_files {
        let fds: Vec<i32> = files.iter().map(|f| f.as_raw_fd()).collect();
        ring.submitter()
            .register_files(&fds)
            .context("registering the files with the ring")?;
    }
    let mut buffers = vec![0u8; BLOCK * depth];
    let mut started = vec![Instant::now(); depth];
    let mut rng = fastrand::Rng::with_seed(0x5bead);
    let mut samples = Vec::new();
    let (mut ios, mut errors) = (0u64, 0u64);
    let cpu_before = thread_cpu_us();
    let start = Instant::now();
    let deadline = start + duration;
    let base = buffers.as_mut_ptr();
    let submit =
        |ring: &mut IoUring, slot: usize, rng: &mut fastrand::Rng, started: &mut [Instant]| {
            let i = rng.usize(0..files.len());
            let offset = rng.u64(0..blocks) * BLOCK as u64;
            // `base + slot * BLOCK` stays inside `buffers` (slot < depth).
            let buf = base.wrapping_add(slot * BLOCK);
            let read = if access.registered_files {
                // `i` indexes the table registered above, in `files` order.
                opcode::Read::new(types::Fixed(i as u32), buf, BLOCK as u32)
            } else {
                opcode::Read::new(types::Fd(files[i].as_raw_fd()), buf, BLOCK as u32)
            };
            let sqe = read.offset(offset).build().user_data(slot as u64);
            started[slot] = Instant::now();
            // SAFETY: the buffer is `buffers[slot * BLOCK..][..BLOCK]`, owned
            // by this function, not reused until this read's completion is
            // reaped below (each slot has one read in flight), and never
            // freed while a read may be in flight (every read is reaped
            // before the function returns, or the buffers are leaked); the
            // ring holds its own reference to the file once submitted.
            unsafe { ring.submission().push(&sqe) }.is_ok()
        };
    // Reads in flight, and the error that ended the run early.
    let mut in_flight = 0usize;
    let mut failure: Option<anyhow::Error> = None;
    for slot in 0..depth {
        // (The queue has at least `depth` entries: a push cannot fail.)
        if submit(&mut ring, slot, &mut rng, &mut started) {
            in_flight += 1;
        }
    }
    while in_flight > 0 {
        if let Err(e) = ring.submit_and_wait(1) {
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            failure = Some(e.into());
            break;
        }
        let done: Vec<(usize, i32)> = ring
            .completion()
            .map(|c| (c.user_data() as usize, c.result()))
            .collect();
        let now = Instant::now();
        for (slot, res) in done {
            in_flight -= 1;
            if res != BLOCK as i32 {
                errors += 1;
            }
            ios += 1;
            if samples.len() < 200_000 {
                samples.push(now.duration_since(started[slot]).as_nanos() as u64);
            }
            if now < deadline && submit(&mut ring, slot, &mut rng, &mut started) {
                in_flight += 1;
            }
        }
    }
    if let Some(e) = failure {
        // Reads may still be in flight into the buffers: never free them.
        std::mem::forget(buffers);
        return Err(e);
    }
    let seconds = start.elapsed().as_secs_f64();
    let cpu = thread_cpu_us().zip(cpu_before).map(|(a, b)| a - b);
    let spec = LoadSpec {
        target: Target::File(dir.to_owned()),
        pattern: Pattern::RandRead,
        block_size: BLOCK,
        iodepth: depth,
        queues: 1,
        duration,
        flush_every: 0,
        flush_interval: None,
        timeline: None,
        phases: None,
        keep_samples: 200_000,
        slow_us: None,
    };
    let mut r = summarize(&spec, seconds, ios, errors, samples);
    r.server_cpu_us_per_io = cpu.filter(|_| ios > 0).map(|us| us / ios as f64);
    Ok(r)
}

/// CPU time (user + system) of the calling thread, in microseconds.
pub(crate) fn thread_cpu_us() -> Option<f64> {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes into `ts`, which we own.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    (rc == 0).then(|| ts.tv_sec as f64 * 1e6 + ts.tv_nsec as f64 / 1e3)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_every_file_and_counts_no_errors() {
        let dir = tempfile::tempdir().unwrap();
        let files = dir.path().join("spread");
        make_files(&files, 8, 8 * 64 * 1024).unwrap();
        assert_eq!(std::fs::read_dir(&files).unwrap().count(), 8);
        let r = measure(&files, 4, Duration::from_millis(50), FileAccess::default()).unwrap();
        assert!(r.ios > 0);
        assert_eq!(r.errors, 0);
        let r = measure(
            &files,
            4,
            Duration::from_millis(50),
            FileAccess {
                registered_files: true,
                noatime: true,
            },
        )
        .unwrap();
        assert!(r.ios > 0);
        assert_eq!(r.errors, 0);
        assert!(r.server_cpu_us_per_io.is_some());
    }
}
