//! Measures the hit ratio of each eviction policy on metadata lookup traces
//! shaped like a guest's: skewed (Zipf) random access, the same with
//! periodic full scans (a backup or `dd` reading the whole disk), uniform
//! random access, and a loop slightly larger than the cache.
//!
//! `cargo run --release -p sqcow2-cache --example policy_hit_ratios`

use std::sync::Arc;

use sqcow2_cache::{CacheConfig, Policy, SliceCache, SliceKey, Source};

const SLICE_ENTRIES: usize = 512; // a 4 KiB slice
const SLICES: u64 = 50_000;
const BUDGET_SLICES: u64 = 5_000;
const LOOKUPS: usize = 1_000_000;

struct Zipf {
    cdf: Vec<f64>,
}

impl Zipf {
    fn new(n: u64, s: f64) -> Self {
        let mut acc = 0.0;
        let mut cdf: Vec<f64> = (1..=n)
            .map(|k| {
                acc += 1.0 / (k as f64).powf(s);
                acc
            })
            .collect();
        for c in &mut cdf {
            *c /= acc;
        }
        Self { cdf }
    }

    fn sample(&self, rng: &mut fastrand::Rng) -> u64 {
        let u = rng.f64();
        self.cdf.partition_point(|&c| c < u) as u64
    }
}

fn trace(name: &str, rng: &mut fastrand::Rng) -> Vec<u64> {
    let zipf = Zipf::new(SLICES, 0.9);
    // Scatter the popular slices over the disk.
    let mut perm: Vec<u64> = (0..SLICES).collect();
    rng.shuffle(&mut perm);
    match name {
        "zipf" => (0..LOOKUPS)
            .map(|_| perm[zipf.sample(rng) as usize])
            .collect(),
        "zipf+scans" => {
            let mut t = Vec::with_capacity(LOOKUPS);
            while t.len() < LOOKUPS {
                for _ in 0..200_000 {
                    t.push(perm[zipf.sample(rng) as usize]);
                }
                t.extend(0..SLICES);
            }
            t.truncate(LOOKUPS);
            t
        }
        "uniform" => (0..LOOKUPS)
            .map(|_| rng.u64(0..2 * BUDGET_SLICES))
            .collect(),
        "loop" => (0..LOOKUPS as u64)
            .map(|i| i % (BUDGET_SLICES * 12 / 10))
            .collect(),
        _ => unreachable!(),
    }
}

fn main() {
    let weight = SLICE_ENTRIES as u64 * 8 + 64;
    let slice: Arc<[u64]> = vec![0u64; SLICE_ENTRIES].into();
    println!(
        "{:<12} {:>8} {:>8} {:>8}",
        "trace", "LRU", "CLOCK", "S3-FIFO"
    );
    for name in ["zipf", "zipf+scans", "uniform", "loop"] {
        let mut rng = fastrand::Rng::with_seed(7);
        let t = trace(name, &mut rng);
        let mut row = format!("{name:<12}");
        for policy in [Policy::Lru, Policy::Clock, Policy::S3Fifo] {
            let cache = SliceCache::new(CacheConfig {
                budget: BUDGET_SLICES * weight,
                shards: 16,
                policy,
            });
            for &s in &t {
                let key = SliceKey {
                    source: Source::Layer(0),
                    offset: s * 4096,
                };
                let _ = cache.get_or_load(key, || Ok::<_, ()>(slice.clone()));
            }
            let st = cache.stats().snapshot();
            row += &format!(
                " {:>7.2}%",
                100.0 * st.hits as f64 / (st.hits + st.misses) as f64
            );
        }
        println!("{row}");
    }
}
