//! The files the benchmarks measure, made at run time.

use std::path::Path;

/// Share of the clusters the generated chains hold data in.
pub(crate) const CHAIN_FILL: f64 = 0.5;

pub(crate) fn make_raw(path: &Path, size: u64) -> anyhow::Result<()> {
    use std::io::Write;
    let mut f = std::fs::File::create(path)?;
    let mut rng = fastrand::Rng::with_seed(7);
    let mut buf = vec![0u8; 1 << 20];
    for _ in 0..size / buf.len() as u64 {
        rng.fill(&mut buf);
        f.write_all(&buf)?;
    }
    f.sync_all()?;
    Ok(())
}
