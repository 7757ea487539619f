//! Long chains under small open-file limits. A chain of 10,000 layers
//! must not need 10,000 descriptors: lower layers are opened through a
//! bounded descriptor cache and reopened on demand (the same file, locks
//! taken again), the binaries raise their soft limit to the hard one as
//! QEMU does, and lower layers' L1 tables are read only when needed.
//!
//! Oracles: the generator's own record of which layer wrote each cluster
//! (QEMU's tools crash on chains this long), and `qemu-img convert` where
//! it still works (300 layers).

mod common;

use std::path::Path;
use std::process::Command;

use common::vhost::{connect_retry, Daemon};
use common::{gen_chain, qemu_raw, run_raw, s, sqcow2_bin};
use sqcow2_format::gen::{generate, owners, parse_tag, plan, Distribution, GenOptions};
use sqcow2_format::{Chain, ChainOptions};

/// Reads every cluster through a chain opened with at most `budget`
/// descriptors for its lower layers and checks each against the plan.
fn verify_with_budget(top: &Path, opts: &GenOptions, use_index: bool, budget: usize) {
    let chain = Chain::open(
        top,
        &ChainOptions {
            use_index,
            max_open_files: Some(budget),
            ..ChainOptions::default()
        },
    )
    .unwrap();
    let p = plan(opts);
    let clusters = opts.size.div_ceil(opts.cluster_size);
    let owner = owners(&p, clusters, opts.layers - 1);
    let mut buf = vec![0u8; opts.cluster_size as usize];
    for c in 0..clusters {
        chain.read_at(&mut buf, c * opts.cluster_size).unwrap();
        match owner[c as usize] {
            Some(layer) => assert_eq!(parse_tag(&buf), Some((layer, c)), "cluster {c}"),
            None => assert!(buf.iter().all(|&b| b == 0), "cluster {c} should be zeros"),
        }
    }
}

/// This process's hard limit of open files.
fn hard_limit() -> u64 {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into `lim`, which we own.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) }, 0);
    lim.rlim_max
}

/// `sqcow2 ARGS` with the open-file limit set to `soft:hard`.
fn sqcow2_limited(nofile: &str, args: &[&str]) -> std::process::Output {
    run_raw(
        Command::new("prlimit")
            .arg(format!("--nofile={nofile}"))
            .arg(sqcow2_bin())
            .args(args),
    )
}

#[test]
fn ten_thousand_layers_under_small_open_file_limits() {
    let tmp = tempfile::tempdir().unwrap();
    let opts = GenOptions {
        layers: 10_000,
        size: 4 << 20,
        cluster_size: 4096,
        fill: 0.5,
        seed: 7,
        distribution: Distribution::Uniform,
        index: true,
    };
    let top = generate(tmp.path(), &opts, &mut |_, _| {}).unwrap();
    // The usual default soft limit of 1024, raised to the hard one (as
    // QEMU does); then a hard limit of 1024, which only the descriptor
    // cache can live with (before: "Too many open files").
    let hard = hard_limit();
    for nofile in [format!("1024:{hard}"), "1024:1024".to_string()] {
        let nofile = nofile.as_str();
        let out = sqcow2_limited(nofile, &["info", "--output", "json", s(&top)]);
        assert!(
            out.status.success(),
            "info under --nofile={nofile}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let raw = tmp.path().join(format!("disk-{nofile}.raw"));
        let out = sqcow2_limited(nofile, &["convert", "-O", "raw", s(&top), s(&raw)]);
        assert!(
            out.status.success(),
            "convert under --nofile={nofile}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let bytes = std::fs::read(&raw).unwrap();
        let owner = owners(&plan(&opts), opts.size / 4096, opts.layers - 1);
        for (c, block) in bytes.chunks(4096).enumerate() {
            match owner[c] {
                Some(layer) => assert_eq!(parse_tag(block), Some((layer, c as u64)), "cluster {c}"),
                None => assert!(block.iter().all(|&b| b == 0), "cluster {c}"),
            }
        }
        std::fs::remove_file(&raw).unwrap();
    }
    // In process, 64 descriptors for 9,999 lower layers: indexed reads,
    // and a walk, which reads lower layers' L1 tables on demand.
    verify_with_budget(&top, &opts, true, 64);
    verify_with_budget(&top, &opts, false, 64);
}

/// Descriptors of a process.
fn open_fds(pid: i32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .count()
}

/// A daemon serving 300 layers with 16 descriptors for them: every byte
/// read through libblkio equals `qemu-img convert`, and the daemon never
/// holds more than its budget of layer descriptors (measured against the
/// same daemon serving one layer; the chain index file is one more).
#[test]
fn a_served_chain_stays_within_its_descriptor_budget() {
    let tmp = tempfile::tempdir().unwrap();
    let one = tmp.path().join("one");
    std::fs::create_dir_all(&one).unwrap();
    let lone = gen_chain(&one, 1, "16M", "0.5");
    let many = tmp.path().join("many");
    std::fs::create_dir_all(&many).unwrap();
    let top = gen_chain(&many, 300, "16M", "0.8");
    let expected = qemu_raw(&top, tmp.path());

    let mut daemon = Daemon::start(&one, &lone, &["--max-open-files", "16"]);
    let mut client = connect_retry(&daemon, 1, true);
    let _ = client.read(0, 4096);
    let baseline = open_fds(daemon.pid());
    drop(client);
    daemon.stop();

    let mut daemon = Daemon::start(&many, &top, &["--max-open-files", "16"]);
    let mut client = connect_retry(&daemon, 1, true);
    let mut most = 0;
    let step = 1 << 20;
    for offset in (0..expected.len()).step_by(step) {
        let got = client.read(offset as u64, step);
        assert!(
            got == expected[offset..offset + step],
            "bytes at {offset} differ from qemu-img convert"
        );
        most = most.max(open_fds(daemon.pid()));
    }
    drop(client);
    daemon.stop();
    assert!(
        most <= baseline + 1 + 16,
        "{most} descriptors open serving 300 layers, {baseline} for one layer, budget 16"
    );
}

/// A lower layer's L1 table is read when first needed (not at open) and
/// checked against what the chain saw at open: a file changed in between
/// (here behind the chain's back, locking off) is refused with a clear
/// error, never read as if it were the image the chain opened.
#[test]
fn a_lower_layer_changed_after_open_is_refused_not_misread() {
    use std::os::unix::fs::FileExt;
    let tmp = tempfile::tempdir().unwrap();
    let top = gen_chain(tmp.path(), 3, "16M", "0.5");
    let base = tmp.path().join("layer0000.qcow2");
    let chain = Chain::open(
        &top,
        &ChainOptions {
            use_index: false,
            locking: sqcow2_format::Locking::Off,
            ..ChainOptions::default()
        },
    )
    .unwrap();
    // Point the base's first L1 entry elsewhere.
    let file = std::fs::OpenOptions::new()
        .write(true)
        .read(true)
        .open(&base)
        .unwrap();
    let mut field = [0u8; 8];
    file.read_exact_at(&mut field, 40).unwrap();
    let l1_offset = u64::from_be_bytes(field);
    file.write_all_at(&0x8000_0000_0001_0000u64.to_be_bytes(), l1_offset)
        .unwrap();
    drop(file);
    let mut buf = vec![0u8; 16 << 20];
    let err = chain.read_at(&mut buf, 0).unwrap_err();
    assert!(
        matches!(err.kind, sqcow2_format::ErrorKind::LayerChanged),
        "{err}"
    );
    assert!(
        err.to_string()
            .contains("changed since the chain was opened"),
        "{err}"
    );
}
