//! `sqcow2 compare`: whether two images read the same, as `qemu-img
//! compare` (its messages and exit codes: 0 identical, 1 different, 2 an
//! image could not be opened, 3 a mapping could not be read, 4 data could
//! not be read).

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use sqcow2_format::ChainOptions;

use crate::input::{Format, Image};

/// `sqcow2 compare` (qemu-img compare's arguments).
#[derive(Debug, clap::Args)]
pub(crate) struct CompareArgs {
    /// Format of the first image (probed when not given, as qemu-img).
    #[arg(short = 'f', value_enum)]
    format1: Option<Format>,
    /// Format of the second image.
    #[arg(short = 'F', value_enum)]
    format2: Option<Format>,
    /// Strict: images of different sizes, or whose ranges differ in
    /// allocation, differ.
    #[arg(short = 's')]
    strict: bool,
    /// Quiet: the exit code only.
    #[arg(short = 'q')]
    quiet: bool,
    /// Show progress.
    #[arg(short = 'p')]
    progress: bool,
    /// Open the images even if another process writes them.
    #[arg(short = 'U', long = "force-share")]
    force_share: bool,
    image1: PathBuf,
    image2: PathBuf,
}

/// Bytes compared at once (QEMU's IO_BUF_SIZE).
const CHUNK: u64 = 2 << 20;
/// What a mismatch is reported in (QEMU compares 512-byte sectors).
const SECTOR: usize = 512;

/// How a comparison ended: the exit code and its message.
enum Outcome {
    Identical,
    Differ(String),
    /// An error of kind `code` (3 mapping, 4 data).
    Failed(u8, anyhow::Error),
}

/// Runs `sqcow2 compare`.
pub(crate) fn run(args: &CompareArgs, options: &ChainOptions) -> ExitCode {
    let options = ChainOptions {
        force_share: args.force_share,
        ..options.clone()
    };
    let open = |path: &Path, format| Image::open(path, format, &options);
    let (a, b) = match (
        open(&args.image1, args.format1),
        open(&args.image2, args.format2),
    ) {
        (Ok(a), Ok(b)) => (a, b),
        (Err(e), _) | (_, Err(e)) => {
            eprintln!("sqcow2: {e:#}");
            return ExitCode::from(2);
        }
    };
    let say = |line: &str| {
        if !args.quiet {
            println!("{line}");
        }
    };
    let (size_a, size_b) = (a.size(), b.size());
    if size_a != size_b && args.strict {
        say("Strict mode: Image size mismatch!");
        return ExitCode::from(1);
    }
    let total = size_a.max(size_b);
    let bar = crate::output::progress_bar(
        total,
        args.progress && !args.quiet,
        "{bar:40} {percent:>3}% {bytes}/{total_bytes}",
    );
    let outcome = compare(&a, &b, args.strict, &|n| bar.inc(n), &|| {
        say("Warning: Image size mismatch!")
    });
    bar.finish_and_clear();
    match outcome {
        Outcome::Identical => {
            say("Images are identical.");
            ExitCode::SUCCESS
        }
        Outcome::Differ(line) => {
            say(&line);
            ExitCode::from(1)
        }
        Outcome::Failed(code, e) => {
            eprintln!("sqcow2: {e:#}");
            ExitCode::from(code)
        }
    }
}

/// Compares `a` and `b` over the size they share, then (after
/// `size_mismatch`) checks that the rest of the larger reads as zeros.
fn compare(
    a: &Image,
    b: &Image,
    strict: bool,
    progress: &dyn Fn(u64),
    size_mismatch: &dyn Fn(),
) -> Outcome {
    let common = a.size().min(b.size());
    let mut buf_a = vec![0u8; CHUNK as usize];
    let mut buf_b = vec![0u8; CHUNK as usize];
    let mut pos = 0u64;
    while pos < common {
        // Each image's run up to its own end, as QEMU asks (its statuses
        // also say whether a run reaches the end of its image).
        let ((sa, na), (sb, nb)) = match (a.run(pos, a.size() - pos), b.run(pos, b.size() - pos)) {
            (Ok(ra), Ok(rb)) => (ra, rb),
            (Err(e), _) | (_, Err(e)) => return Outcome::Failed(3, e),
        };
        let n = na.min(nb).min(common - pos).min(CHUNK);
        let eof = |size: u64, len: u64| pos + len >= size;
        if strict && (sa != sb || eof(a.size(), na) != eof(b.size(), nb)) {
            return Outcome::Differ(format!("Strict mode: Offset {pos} block status mismatch!"));
        }
        if !(sa.reads_zeros() && sb.reads_zeros()) {
            let (x, y) = (&mut buf_a[..n as usize], &mut buf_b[..n as usize]);
            if let Err(e) = a.read(x, pos).and_then(|()| b.read(y, pos)) {
                return Outcome::Failed(4, e);
            }
            if let Some(i) = first_difference(x, y) {
                return Outcome::Differ(format!("Content mismatch at offset {}!", pos + i));
            }
        }
        pos += n;
        progress(n);
    }
    if a.size() != b.size() {
        size_mismatch();
    }
    let larger = if a.size() > b.size() { a } else { b };
    while pos < larger.size() {
        let max = (larger.size() - pos).min(CHUNK);
        let (status, n) = match larger.run(pos, max) {
            Ok((s, n)) => (s, n.min(max)),
            Err(e) => return Outcome::Failed(3, e),
        };
        if !status.reads_zeros() {
            let x = &mut buf_a[..n as usize];
            if let Err(e) = larger.read(x, pos) {
                return Outcome::Failed(4, e);
            }
            if let Some(i) = first_difference(x, &buf_b[..0]) {
                return Outcome::Differ(format!("Content mismatch at offset {}!", pos + i));
            }
        }
        pos += n;
        progress(n);
    }
    Outcome::Identical
}

/// Offset of the first 512-byte sector where `x` and `y` differ (`y`
/// empty: where `x` is not zero).
fn first_difference(x: &[u8], y: &[u8]) -> Option<u64> {
    let sectors = x.chunks(SECTOR).enumerate();
    for (i, sx) in sectors {
        let differs = if y.is_empty() {
            sx.iter().any(|&v| v != 0)
        } else {
            sx != &y[i * SECTOR..(i * SECTOR + sx.len()).min(y.len())]
        };
        if differs {
            return Some((i * SECTOR) as u64);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_differing_sector_is_reported() {
        let a = vec![0u8; 4096];
        let mut b = a.clone();
        assert_eq!(first_difference(&a, &b), None);
        b[1500] = 1;
        assert_eq!(first_difference(&a, &b), Some(1024));
        assert_eq!(first_difference(&b, &[]), Some(1024));
        assert_eq!(first_difference(&a, &[]), None);
    }
}
