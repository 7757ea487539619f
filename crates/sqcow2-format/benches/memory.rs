//! Metadata memory of the engine at chain lengths 1, 100 and 1000
//! (generated 1 GiB chains, 20,000 random 4 KiB reads, default 32 MiB
//! cache): cache bytes, per-layer structures, and the process RSS growth
//! measured side by side for indexed and walk mode.
//!
//! `cargo bench --bench memory`

use std::path::Path;

use sqcow2_format::gen::{generate, Distribution, GenOptions};
use sqcow2_format::{Chain, ChainOptions};

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

/// In a child process (fresh heap): opens the chain, reads, prints
/// `cache structures rss_growth_kib`.
fn child(top: &str, use_index: bool) {
    let before = rss_kib();
    let chain = Chain::open(
        Path::new(top),
        &ChainOptions {
            use_index,
            ..ChainOptions::default()
        },
    )
    .expect("open");
    let mut rng = fastrand::Rng::with_seed(1);
    let mut buf = vec![0u8; 4096];
    for _ in 0..20_000 {
        let off = rng.u64(0..(1u64 << 30) / 4096) * 4096;
        chain.read_at(&mut buf, off).expect("read");
    }
    let after = rss_kib();
    println!(
        "{} {} {}",
        chain.diagnostics().cache().bytes,
        chain.diagnostics().metadata_structure_bytes(),
        after.saturating_sub(before)
    );
}

fn main() {
    if let Ok(spec) = std::env::var("SQCOW2_MEMORY_CHILD") {
        let (mode, top) = spec.split_once(':').expect("mode:top");
        child(top, mode == "indexed");
        return;
    }
    // `cargo bench` passes flags such as --bench; none are needed here.
    println!("| layers | mode | cache bytes | per-layer structures | RSS growth | RSS growth per layer |");
    println!("| ---: | --- | ---: | ---: | ---: | ---: |");
    for layers in [1usize, 100, 1000] {
        let dir = tempfile::tempdir().expect("temporary directory");
        let opts = GenOptions {
            layers,
            size: 1 << 30,
            cluster_size: 65536,
            fill: 0.5,
            seed: 7,
            distribution: Distribution::Uniform,
            index: true,
        };
        let top = generate(dir.path(), &opts, &mut |_, _| {}).expect("generate");
        for mode in ["indexed", "walk"] {
            let out = std::process::Command::new(std::env::current_exe().expect("exe"))
                .env("SQCOW2_MEMORY_CHILD", format!("{mode}:{}", top.display()))
                .output()
                .expect("child");
            let text = String::from_utf8_lossy(&out.stdout);
            let v: Vec<u64> = text
                .split_whitespace()
                .filter_map(|x| x.parse().ok())
                .collect();
            let [cache, structures, growth] = v[..] else {
                panic!(
                    "child failed: {text} {}",
                    String::from_utf8_lossy(&out.stderr)
                );
            };
            println!(
                "| {layers} | {mode} | {:.1} MiB | {:.1} KiB ({} B/layer) | {:.1} MiB | {:.1} KiB |",
                cache as f64 / 1048576.0,
                structures as f64 / 1024.0,
                structures / layers as u64,
                growth as f64 / 1024.0,
                growth as f64 / layers as f64,
            );
        }
    }
}
