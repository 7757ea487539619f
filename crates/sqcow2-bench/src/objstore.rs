//! `sqcow2-bench object-store`: a long chain whose layers below the top
//! are in an S3 store (issue 48), served by `sqcow2 serve` through a proxy
//! that adds a round trip ([`crate::delay_proxy`]), side by side with the
//! same chain on local disk and with the store's own throughput for one
//! object. The store is the one the environment names (`AWS_*`,
//! `SQCOW2_S3_BUCKET`: `scripts/object-store.sh` writes them).
//!
//! Reported per added round trip: the daemon's start (time, GETs and
//! HEADs: sequential at open, so round trips), cold random 4 KiB reads at
//! depth 1 and 32 and cold sequential 1 MiB reads (each on a daemon
//! started with an empty cache) with GETs and bytes fetched per guest
//! read; and once, warm random reads (every block in the local cache,
//! no request) against the local chain.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};
use sqcow2_format::gen::{generate, Distribution, GenOptions};

use crate::delay_proxy::{self, Traffic};
use crate::load::{self, LoadResult, LoadSpec, Pattern, Target};

const START: &str = "<!-- bench-object-store:start -->";
const END: &str = "<!-- bench-object-store:end -->";

/// Arguments of `sqcow2-bench object-store`.
#[derive(Debug, clap::Args)]
pub struct ObjStoreArgs {
    /// Layers of the chain (all but the top go to the store).
    #[arg(long, default_value_t = 1000)]
    layers: usize,
    /// Virtual disk size.
    #[arg(long, default_value = "4G")]
    size: String,
    /// Share of the clusters written, spread over the layers.
    #[arg(long, default_value_t = 0.25)]
    fill: f64,
    /// Round trips added between the daemon and the store, milliseconds.
    #[arg(long, value_delimiter = ',', default_values_t = vec![0.0, 5.0, 20.0])]
    rtt_ms: Vec<f64>,
    /// Seconds per load.
    #[arg(long, default_value_t = 5.0)]
    seconds: f64,
    /// Where the chain, caches, logs and results go.
    #[arg(long, default_value = "bench-results/object-store")]
    out: PathBuf,
    /// Rewrite the section between the bench-object-store markers of this
    /// Markdown file.
    #[arg(long)]
    doc: Option<PathBuf>,
}

/// One load's figures, with what the store saw during it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Measured {
    pub load: LoadResult,
    /// GETs per guest read.
    pub gets_per_read: Option<f64>,
    /// Bytes the store answered per guest read.
    pub bytes_per_read: Option<f64>,
}

/// Everything measured at one added round trip.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AtRtt {
    pub rtt_ms: f64,
    /// The store's own throughput: one object read in one GET, MB/s.
    pub store_mb_per_s: f64,
    /// From the daemon's start to its first guest read completed.
    pub open_ms: f64,
    /// GETs and HEADs the start took.
    pub open_gets: u64,
    pub open_heads: u64,
    pub cold_rand_qd1: Option<Measured>,
    pub cold_rand_qd32: Option<Measured>,
    pub cold_seq: Option<Measured>,
    /// qemu-storage-daemon on the same chain through QEMU's curl driver
    /// (the bucket's public URL, through its own proxy adding the same
    /// round trip): its start and its cold reads.
    pub qemu: Option<QemuRun>,
    pub errors: Vec<String>,
}

/// QEMU's figures at one round trip.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct QemuRun {
    pub open_ms: f64,
    pub open_requests: u64,
    pub cold_rand_qd1: Measured,
    pub cold_seq: Measured,
}

/// A run's results.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ObjStoreResults {
    pub command: String,
    pub layers: usize,
    pub disk_size: u64,
    pub fill: f64,
    pub seconds: f64,
    pub pushed_bytes: u64,
    pub push_seconds: f64,
    pub local_rand_qd1: LoadResult,
    pub local_rand_qd32: LoadResult,
    pub local_seq: LoadResult,
    pub warm_rand_qd1: Option<Measured>,
    pub warm_rand_qd32: Option<Measured>,
    pub at: Vec<AtRtt>,
    pub wall_seconds: f64,
}

fn spec(target: &Target, pattern: Pattern, block: usize, depth: usize, seconds: f64) -> LoadSpec {
    LoadSpec {
        target: target.clone(),
        pattern,
        block_size: block,
        iodepth: depth,
        queues: 1,
        duration: Duration::from_secs_f64(seconds),
        flush_every: 0,
        flush_interval: None,
        timeline: None,
        phases: None,
        keep_samples: 100_000,
        slow_us: None,
    }
}

/// A daemon serving `top` read-only on `socket`.
struct Daemon {
    child: Child,
}

impl Daemon {
    fn start(
        sqcow2: &Path,
        top: &Path,
        socket: &Path,
        log: &Path,
        env: &[(&str, String)],
    ) -> anyhow::Result<Daemon> {
        let _ = std::fs::remove_file(socket);
        let mut cmd = Command::new(sqcow2);
        cmd.args(["serve", "--read-only", "--socket"])
            .arg(socket)
            .arg(top)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(log)?);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let child = cmd.spawn().context("starting sqcow2 serve")?;
        Ok(Daemon { child })
    }

    /// Waits for its first guest read (the open included).
    fn first_read(&mut self, target: &Target, limit: Duration) -> anyhow::Result<()> {
        let t0 = Instant::now();
        let Target::Socket(socket) = target else {
            return Ok(());
        };
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                bail!("sqcow2 serve exited ({status})");
            }
            if socket.exists() && load::first_read(target).is_ok() {
                return Ok(());
            }
            if t0.elapsed() > limit {
                bail!("no first read within {} s", limit.as_secs());
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        crate::servers::stop(&mut self.child);
    }
}

/// `load` on `target` with the store's traffic counted.
fn measured(
    target: &Target,
    load: LoadSpec,
    traffic: Option<&Traffic>,
) -> anyhow::Result<Measured> {
    let _ = target;
    let before = traffic.map(Traffic::snapshot);
    let r = load::run(&load)?;
    let after = traffic.map(Traffic::snapshot);
    let per = |n: u64| (r.ios > 0).then(|| n as f64 / r.ios as f64);
    let (gets, bytes) = match (before, after) {
        (Some(b), Some(a)) => (per(a.0 - b.0), per(a.2 - b.2)),
        _ => (None, None),
    };
    Ok(Measured {
        load: r,
        gets_per_read: gets,
        bytes_per_read: bytes,
    })
}

fn env_var(name: &str) -> anyhow::Result<String> {
    std::env::var(name).with_context(|| {
        format!("{name} unset: source the env file `scripts/object-store.sh start DIR` writes")
    })
}

/// The store's throughput for one object of `len` bytes (one GET through
/// a proxy adding `rtt`), MB/s.
fn store_throughput(key: &str, len: u64, connect_to: &str) -> anyhow::Result<f64> {
    let bucket = env_var("SQCOW2_S3_BUCKET")?;
    let mut config = sqcow2_store::StoreConfig::from_env(&bucket)?;
    config.connect_to = Some(connect_to.into());
    let store = sqcow2_store::ObjectStore::new(&config)?;
    let info = store.head(key)?;
    let mut sink = std::fs::OpenOptions::new().write(true).open("/dev/null")?;
    let t0 = Instant::now();
    store.get_to_file(key, &info.etag, len, &mut sink)?;
    Ok(len as f64 / t0.elapsed().as_secs_f64() / 1e6)
}

pub fn run(args: &ObjStoreArgs) -> anyhow::Result<()> {
    let started = Instant::now();
    let size = crate::parse_size(&args.size)?;
    let sqcow2 = std::env::current_exe()?.with_file_name("sqcow2");
    anyhow::ensure!(
        sqcow2.exists(),
        "{} missing: build it first",
        sqcow2.display()
    );
    let endpoint: url::Url = env_var("AWS_ENDPOINT_URL")?.parse()?;
    let bucket = env_var("SQCOW2_S3_BUCKET")?;
    let upstream = format!(
        "{}:{}",
        endpoint.host_str().context("endpoint host")?,
        endpoint.port_or_known_default().context("endpoint port")?
    );
    std::fs::create_dir_all(&args.out)?;
    let out = args.out.canonicalize()?;
    let dir = out.join("chain");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    eprintln!(
        "==> generating a {}-layer chain ({size} bytes)",
        args.layers
    );
    let top = generate(
        &dir,
        &GenOptions {
            layers: args.layers,
            size,
            cluster_size: 65536,
            fill: args.fill,
            seed: 1,
            distribution: Distribution::Uniform,
            index: true,
        },
        &mut |_, _| {},
    )?;
    let socket = out.join("objstore.sock");
    let target = Target::Socket(socket.clone());
    let log = out.join("serve.log");

    eprintln!("==> the chain on local disk");
    let (local_rand_qd1, local_rand_qd32, local_seq) = {
        let mut d = Daemon::start(&sqcow2, &top, &socket, &log, &[])?;
        d.first_read(&target, Duration::from_secs(120))?;
        let q1 = load::run(&spec(&target, Pattern::RandRead, 4096, 1, args.seconds))?;
        let q32 = load::run(&spec(&target, Pattern::RandRead, 4096, 32, args.seconds))?;
        let seq = load::run(&spec(&target, Pattern::SeqRead, 1 << 20, 1, args.seconds))?;
        (q1, q32, seq)
    };

    // The bucket's public URL (what QEMU's curl driver can read), if any.
    let public: Option<url::Url> = std::env::var("SQCOW2_S3_PUBLIC_URL")
        .ok()
        .and_then(|u| u.parse().ok());
    let prefix = format!("bench-{}", std::process::id());
    eprintln!("==> pushing the layers below the top to s3://{bucket}/{prefix}");
    let t0 = Instant::now();
    let pushed = Command::new(&sqcow2)
        .args(["push", "--output", "json"])
        .arg(&top)
        .arg(format!("s3://{bucket}/{prefix}"))
        .output()?;
    if !pushed.status.success() {
        bail!("push failed: {}", String::from_utf8_lossy(&pushed.stderr));
    }
    let push_seconds = t0.elapsed().as_secs_f64();
    let report: serde_json::Value = serde_json::from_slice(&pushed.stdout)?;
    let pushed_bytes: u64 = report["layers"]
        .as_array()
        .map(|l| l.iter().filter_map(|x| x["bytes"].as_u64()).sum())
        .unwrap_or(0);

    // One object for the store's own throughput.
    let big_len: u64 = 256 << 20;
    let big_key = format!("{prefix}/throughput.bin");
    {
        let big = out.join("throughput.bin");
        let f = std::fs::File::create(&big)?;
        let mut w = std::io::BufWriter::new(f);
        let mut block = vec![0u8; 1 << 20];
        for i in 0..(big_len >> 20) {
            block
                .iter_mut()
                .enumerate()
                .for_each(|(j, b)| *b = (i as usize * 31 + j) as u8);
            std::io::Write::write_all(&mut w, &block)?;
        }
        drop(w);
        let config = sqcow2_store::StoreConfig::from_env(&bucket)?;
        sqcow2_store::ObjectStore::new(&config)?.put_file(&big_key, &big)?;
        let _ = std::fs::remove_file(&big);
    }

    let mut results = ObjStoreResults {
        command: std::env::args().collect::<Vec<_>>().join(" "),
        layers: args.layers,
        disk_size: size,
        fill: args.fill,
        seconds: args.seconds,
        pushed_bytes,
        push_seconds,
        local_rand_qd1,
        local_rand_qd32,
        local_seq,
        warm_rand_qd1: None,
        warm_rand_qd32: None,
        at: Vec::new(),
        wall_seconds: 0.0,
    };
    for &rtt in &args.rtt_ms {
        eprintln!("==> {rtt} ms added round trip");
        let (proxy, traffic) =
            delay_proxy::spawn(Duration::from_secs_f64(rtt / 1000.0), &upstream)?;
        let cache = out.join(format!("cache-{rtt}"));
        let env = vec![
            ("SQCOW2_REMOTE_CACHE", cache.display().to_string()),
            ("SQCOW2_S3_CONNECT_TO", proxy.to_string()),
        ];
        let mut at = AtRtt {
            rtt_ms: rtt,
            store_mb_per_s: store_throughput(&big_key, big_len, &proxy.to_string())?,
            open_ms: 0.0,
            open_gets: 0,
            open_heads: 0,
            cold_rand_qd1: None,
            cold_rand_qd32: None,
            cold_seq: None,
            qemu: None,
            errors: Vec::new(),
        };
        let loads = [
            (Pattern::RandRead, 4096, 1),
            (Pattern::RandRead, 4096, 32),
            (Pattern::SeqRead, 1 << 20, 1),
        ];
        for (k, (pattern, block, depth)) in loads.into_iter().enumerate() {
            let _ = std::fs::remove_dir_all(&cache);
            let result = (|| -> anyhow::Result<Measured> {
                let before = traffic.snapshot();
                let t0 = Instant::now();
                let mut d = Daemon::start(&sqcow2, &top, &socket, &log, &env)?;
                d.first_read(&target, Duration::from_secs(600))?;
                if k == 0 {
                    let after = traffic.snapshot();
                    at.open_ms = t0.elapsed().as_secs_f64() * 1000.0;
                    at.open_gets = after.0 - before.0;
                    at.open_heads = after.1 - before.1;
                }
                measured(
                    &target,
                    spec(&target, pattern, block, depth, args.seconds),
                    Some(&traffic),
                )
            })();
            match (k, result) {
                (0, Ok(m)) => at.cold_rand_qd1 = Some(m),
                (1, Ok(m)) => at.cold_rand_qd32 = Some(m),
                (_, Ok(m)) => at.cold_seq = Some(m),
                (_, Err(e)) => at.errors.push(format!("{e:#}")),
            }
        }
        if let Some(public) = &public {
            eprintln!("==> qemu-storage-daemon through its curl driver");
            match qemu_run(&out, &top, public, rtt, &target, args.seconds) {
                Ok(q) => at.qemu = Some(q),
                Err(e) => at.errors.push(format!("qemu: {e:#}")),
            }
        }
        if results.warm_rand_qd1.is_none() {
            eprintln!("==> warm: every block in the local cache");
            let warm = (|| -> anyhow::Result<(Measured, Measured)> {
                let raw = out.join("warm.raw");
                let st = Command::new(&sqcow2)
                    .args(["convert", "-O", "raw"])
                    .arg(&top)
                    .arg(&raw)
                    .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
                    .status()?;
                let _ = std::fs::remove_file(&raw);
                anyhow::ensure!(st.success(), "the warming read failed");
                let mut d = Daemon::start(&sqcow2, &top, &socket, &log, &env)?;
                d.first_read(&target, Duration::from_secs(600))?;
                let q1 = measured(
                    &target,
                    spec(&target, Pattern::RandRead, 4096, 1, args.seconds),
                    Some(&traffic),
                )?;
                let q32 = measured(
                    &target,
                    spec(&target, Pattern::RandRead, 4096, 32, args.seconds),
                    Some(&traffic),
                )?;
                Ok((q1, q32))
            })();
            match warm {
                Ok((q1, q32)) => {
                    results.warm_rand_qd1 = Some(q1);
                    results.warm_rand_qd32 = Some(q32);
                }
                Err(e) => at.errors.push(format!("warm: {e:#}")),
            }
        }
        let _ = std::fs::remove_dir_all(&cache);
        results.at.push(at);
    }
    results.wall_seconds = started.elapsed().as_secs_f64();
    std::fs::write(
        out.join("results.json"),
        serde_json::to_string_pretty(&results)?,
    )?;
    let md = markdown(&results);
    std::fs::write(out.join("summary.md"), &md)?;
    if let Some(doc) = &args.doc {
        crate::report::replace_between(doc, START, END, &md)?;
    }
    println!("{md}");
    Ok(())
}

/// qemu-storage-daemon (`aio=io_uring`, an iothread) serving a copy of
/// `top` renamed to name its backing layer through a proxy adding `rtt`
/// in front of the public endpoint: cold each time (QEMU keeps no cache
/// across starts).
fn qemu_run(
    out: &Path,
    top: &Path,
    public: &url::Url,
    rtt: f64,
    target: &Target,
    seconds: f64,
) -> anyhow::Result<QemuRun> {
    let host = public.host_str().context("public host")?;
    let port = public.port_or_known_default().context("public port")?;
    let (proxy, traffic) = delay_proxy::spawn(
        Duration::from_secs_f64(rtt / 1000.0),
        &format!("127.0.0.1:{port}"),
    )?;
    // The same chain: the top copied, its backing name through the proxy.
    let info = Command::new("qemu-img")
        .args(["info", "--output=json", "-U"])
        .arg(top)
        .output()?;
    let info: serde_json::Value = serde_json::from_slice(&info.stdout)?;
    let backing = info["backing-filename"]
        .as_str()
        .context("the top's backing name")?;
    let path = backing
        .strip_prefix(public.as_str())
        .context("the top does not name the public URL")?;
    let via = format!("{}://{host}:{}/{path}", public.scheme(), proxy.port());
    let qtop = out.join("qemu-top.qcow2");
    std::fs::copy(top, &qtop)?;
    let st = Command::new("qemu-img")
        .args(["rebase", "-u", "-f", "qcow2", "-F", "qcow2", "-b", &via])
        .arg(&qtop)
        .status()?;
    anyhow::ensure!(st.success(), "qemu-img rebase -u failed");
    let Target::Socket(socket) = target else {
        bail!("a socket target");
    };
    let start = || -> anyhow::Result<Child> {
        let _ = std::fs::remove_file(socket);
        Ok(Command::new("qemu-storage-daemon")
            .args(["--object", "iothread,id=iot0"])
            .arg("--blockdev")
            .arg(format!(
                "driver=qcow2,node-name=top,read-only=on,file.driver=file,file.aio=io_uring,file.filename={}",
                qtop.display()
            ))
            .arg("--export")
            .arg(format!(
                "type=vhost-user-blk,id=e0,node-name=top,writable=off,iothread=iot0,addr.type=unix,addr.path={}",
                socket.display()
            ))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(out.join("qsd.log"))?)
            .spawn()?)
    };
    let mut runs = Vec::new();
    let mut open = (0.0, 0);
    for (k, (pattern, block)) in [(Pattern::RandRead, 4096), (Pattern::SeqRead, 1 << 20)]
        .into_iter()
        .enumerate()
    {
        let before = traffic.snapshot();
        let t0 = Instant::now();
        let mut d = Daemon { child: start()? };
        d.first_read(target, Duration::from_secs(900))?;
        if k == 0 {
            let after = traffic.snapshot();
            open = (
                t0.elapsed().as_secs_f64() * 1000.0,
                (after.0 - before.0) + (after.1 - before.1),
            );
        }
        runs.push(measured(
            target,
            spec(target, pattern, block, 1, seconds),
            Some(&traffic),
        )?);
    }
    let _ = std::fs::remove_file(&qtop);
    let cold_seq = runs.pop().context("seq")?;
    let cold_rand_qd1 = runs.pop().context("rand")?;
    Ok(QemuRun {
        open_ms: open.0,
        open_requests: open.1,
        cold_rand_qd1,
        cold_seq,
    })
}

fn opt(v: Option<f64>, digits: usize) -> String {
    v.map_or_else(|| "failed".into(), |x| format!("{x:.digits$}"))
}

/// The Markdown section of a run.
pub fn markdown(r: &ObjStoreResults) -> String {
    let mut md = String::new();
    let _ = writeln!(md, "{START}");
    let _ = writeln!(
        md,
        "Produced by `{}` in {:.0} s: a {}-layer chain from `gen-chain` (64 KiB clusters, {:.0} % \
         of the clusters written, spread uniformly over the layers, {} MiB disk); the {} layers \
         below the top pushed to Garage on loopback ({:.1} MiB in {:.1} s), read by `sqcow2 serve` \
         through a proxy adding the round trip; each cold load on a daemon started with an \
         empty cache; {:.0} s per load, one queue. GETs and bytes counted at the proxy.",
        r.command,
        r.wall_seconds,
        r.layers,
        r.fill * 100.0,
        r.disk_size >> 20,
        r.layers - 1,
        r.pushed_bytes as f64 / 1048576.0,
        r.push_seconds,
        r.seconds
    );
    let _ = writeln!(md);
    let _ = writeln!(
        md,
        "| added RTT | store, 1 object (MB/s) | open (ms) | open GETs+HEADs | cold rand 4K qd1 (IOPS) | GETs/read | cold rand 4K qd32 (IOPS) | GETs/read | cold seq 1M (MB/s) | vs store |"
    );
    let _ = writeln!(md, "|---|---|---|---|---|---|---|---|---|---|");
    for a in &r.at {
        let iops = |m: &Option<Measured>| opt(m.as_ref().map(|m| m.load.iops), 0);
        let gets = |m: &Option<Measured>| opt(m.as_ref().and_then(|m| m.gets_per_read), 2);
        let seq = a.cold_seq.as_ref().map(|m| m.load.mb_per_s);
        let _ = writeln!(
            md,
            "| {} ms | {:.0} | {:.0} | {}+{} | {} | {} | {} | {} | {} | {} |",
            a.rtt_ms,
            a.store_mb_per_s,
            a.open_ms,
            a.open_gets,
            a.open_heads,
            iops(&a.cold_rand_qd1),
            gets(&a.cold_rand_qd1),
            iops(&a.cold_rand_qd32),
            gets(&a.cold_rand_qd32),
            opt(seq, 0),
            opt(seq.map(|s| s / a.store_mb_per_s), 2),
        );
    }
    let _ = writeln!(md);
    let _ = writeln!(
        md,
        "QEMU (qemu-storage-daemon, `aio=io_uring`, an iothread) on the same chain through its curl driver (the bucket's public URL, the same added round trip), cold:"
    );
    let _ = writeln!(md);
    let _ = writeln!(
        md,
        "| added RTT | QEMU open (ms) | requests | QEMU rand 4K qd1 (IOPS) | requests/read | sqcow2 / QEMU | QEMU seq 1M (MB/s) | sqcow2 / QEMU |"
    );
    let _ = writeln!(md, "|---|---|---|---|---|---|---|---|");
    for a in &r.at {
        let Some(q) = &a.qemu else { continue };
        let ours_rand = a.cold_rand_qd1.as_ref().map(|m| m.load.iops);
        let ours_seq = a.cold_seq.as_ref().map(|m| m.load.mb_per_s);
        let _ = writeln!(
            md,
            "| {} ms | {:.0} | {} | {:.0} | {} | {} | {:.1} | {} |",
            a.rtt_ms,
            q.open_ms,
            q.open_requests,
            q.cold_rand_qd1.load.iops,
            opt(q.cold_rand_qd1.gets_per_read, 2),
            opt(ours_rand.map(|o| o / q.cold_rand_qd1.load.iops), 1),
            q.cold_seq.load.mb_per_s,
            opt(ours_seq.map(|o| o / q.cold_seq.load.mb_per_s), 1),
        );
    }
    let _ = writeln!(md);
    let warm = |w: &Option<Measured>, local: &LoadResult| {
        w.as_ref().map_or_else(
            || "failed".to_string(),
            |m| {
                format!(
                    "{:.0} IOPS vs {:.0} local: **{:.2}x** ({} GETs/read)",
                    m.load.iops,
                    local.iops,
                    m.load.iops / local.iops,
                    opt(m.gets_per_read, 3)
                )
            },
        )
    };
    let _ = writeln!(md, "Warm random 4 KiB reads (every block in the local cache), against the same chain on local disk (page cache warm):");
    let _ = writeln!(md);
    let _ = writeln!(
        md,
        "* depth 1: {}",
        warm(&r.warm_rand_qd1, &r.local_rand_qd1)
    );
    let _ = writeln!(
        md,
        "* depth 32: {}",
        warm(&r.warm_rand_qd32, &r.local_rand_qd32)
    );
    let _ = writeln!(
        md,
        "* local sequential 1 MiB: {:.0} MB/s",
        r.local_seq.mb_per_s
    );
    for a in &r.at {
        for e in &a.errors {
            let _ = writeln!(md, "* {} ms: failed: {e}", a.rtt_ms);
        }
    }
    let _ = writeln!(md, "{END}");
    md
}
