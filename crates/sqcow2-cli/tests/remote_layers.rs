//! Layers in an object store (issue 48) against a real Garage, QEMU the
//! oracle: a chain pushed, served and pulled reads byte for byte as the
//! local chain did (`qemu-img` over the daemon's NBD export, and on the
//! chain pulled back); a store stopped or an object changed under a
//! reader fails its reads cleanly and never serves wrong bytes.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::object_store::Garage;
use common::vhost::{connect_retry, Daemon};
use common::{gen_chain, qemu_img, qemu_raw, run, run_raw, s, sqcow2, sqcow2_bin};

/// `sqcow2 ARGS` with the store's variables and `cache` as the remote
/// cache, which must succeed; its output.
fn sqcow2_remote(garage: &Garage, cache: &Path, args: &[&str]) -> String {
    run(garage
        .command(sqcow2_bin())
        .env("SQCOW2_REMOTE_CACHE", cache)
        .args(args))
}

/// The guest view of what `sock` exports, read by `qemu-img convert`.
fn raw_over_nbd(sock: &Path, out: &Path) -> Vec<u8> {
    qemu_img(&[
        "convert",
        "-O",
        "raw",
        &format!("nbd+unix:///?socket={}", sock.display()),
        s(out),
    ]);
    std::fs::read(out).unwrap()
}

/// `[offset, offset + len)` of what `sock` exports, read by `qemu-img
/// convert`; `Err` with QEMU's words when the read failed.
fn nbd_slice(sock: &Path, offset: u64, len: u64, out: &Path) -> Result<Vec<u8>, String> {
    let spec = format!(
        "json:{{\"driver\":\"raw\",\"offset\":{offset},\"size\":{len},\"file\":{{\"driver\":\"nbd\",\"server\":{{\"type\":\"unix\",\"path\":\"{}\"}}}}}}",
        sock.display()
    );
    let _ = std::fs::remove_file(out);
    let done = run_raw(Command::new("qemu-img").args(["convert", "-O", "raw", &spec, s(out)]));
    if !done.status.success() {
        return Err(String::from_utf8_lossy(&done.stderr).into_owned());
    }
    Ok(std::fs::read(out).unwrap())
}

/// The client of the store's bucket, to change objects under a reader.
fn bucket(garage: &Garage) -> sqcow2_store::ObjectStore {
    let config =
        sqcow2_store::StoreConfig::from_lookup(garage.bucket(), |k| garage.vars.get(k).cloned())
            .unwrap();
    sqcow2_store::ObjectStore::new(&config).unwrap()
}

/// Pushes the layers below `top` under `prefix`; the URLs of the layers,
/// highest first.
fn push(garage: &Garage, cache: &Path, top: &Path, prefix: &str) -> Vec<String> {
    let to = format!("s3://{}/{prefix}", garage.bucket());
    let pushed = sqcow2_remote(garage, cache, &["push", "--output", "json", s(top), &to]);
    let report: serde_json::Value = serde_json::from_str(&pushed).unwrap();
    report["layers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["to"].as_str().unwrap().to_string())
        .collect()
}

/// The key of a layer's URL in the bucket.
fn key_of(garage: &Garage, url: &str) -> String {
    let path_style = format!(
        "{}/{}/",
        garage.endpoint().trim_end_matches('/'),
        garage.bucket()
    );
    let public = &garage.vars["SQCOW2_S3_PUBLIC_URL"];
    url.strip_prefix(public.as_str())
        .or_else(|| url.strip_prefix(&path_style))
        .unwrap()
        .to_string()
}

fn serve_nbd(garage: &Garage, dir: &Path, top: &Path, cache: &Path) -> (Daemon, PathBuf) {
    let sock = dir.join("nbd.sock");
    let mut env = garage.env();
    let cache = cache.to_str().unwrap();
    env.push(("SQCOW2_REMOTE_CACHE", cache));
    let nbd = format!("unix:{}", sock.display());
    let daemon = Daemon::start_with_env(dir, top, &["--nbd", &nbd, "--read-only"], &env);
    common::vhost::wait_for_log(&daemon, "nbd export listening");
    (daemon, sock)
}

/// Push, serve, pull: the chain's layers below the top go to the bucket
/// (the top names the highest one's URL, its index rewritten, `qemu-img
/// check` clean), the daemon serves the chain from there byte for byte as
/// QEMU read the local chain, and a pull brings the layers back into
/// another directory, where QEMU reads the chain again, the same.
#[test]
fn a_chain_pushed_serves_and_pulls_back_byte_for_byte() {
    let garage = Garage::start();
    let d = tempfile::tempdir().unwrap();
    let d = d.path();
    let top = gen_chain(d, 6, "64M", "0.4");
    let expected = qemu_raw(&top, d);
    let cache = d.join("cache");

    let to = format!("s3://{}/chains/one", garage.bucket());
    let pushed = sqcow2_remote(&garage, &cache, &["push", "--output", "json", s(&top), &to]);
    let report: serde_json::Value = serde_json::from_str(&pushed).unwrap();
    assert_eq!(report["layers"].as_array().unwrap().len(), 5, "{pushed}");
    // Named by the bucket's public URL (Garage's website endpoint), which
    // QEMU's curl driver reads without credentials.
    let backing = report["backing"].as_str().unwrap();
    let public = &garage.vars["SQCOW2_S3_PUBLIC_URL"];
    assert!(
        backing.starts_with(&format!("{public}chains/one/")),
        "{backing}"
    );
    assert!(report["index"].is_string(), "index not rewritten: {pushed}");
    // The top as QEMU sees it: its header names the URL, nothing wrong.
    let info = qemu_img(&["info", "--output=json", "-U", s(&top)]);
    assert!(info.contains(backing), "{info}");
    let check = qemu_img(&["check", "-U", s(&top)]);
    assert!(check.contains("No errors were found"), "{check}");
    // QEMU follows the chain into the bucket by itself (curl, range
    // requests) and reads what it read before the push.
    let through_curl = d.join("curl");
    std::fs::create_dir_all(&through_curl).unwrap();
    assert!(
        qemu_raw(&top, &through_curl) == expected,
        "QEMU reads the pushed chain otherwise"
    );

    // The chain index still serves: valid, covering the remote layers.
    let ours = sqcow2_remote(&garage, &cache, &["info", "--output", "json", s(&top)]);
    assert!(ours.contains("\"valid\""), "{ours}");

    // Without the opt-in the URL is refused, naming what to do.
    let refused = run_raw(Command::new(sqcow2_bin()).args(["map", s(&top)]));
    assert!(!refused.status.success());
    let why = String::from_utf8_lossy(&refused.stderr);
    assert!(
        why.contains("object store") && why.contains("--remote-cache"),
        "{why}"
    );

    let (mut daemon, sock) = serve_nbd(&garage, d, &top, &cache);
    let served = raw_over_nbd(&sock, &d.join("served.raw"));
    assert!(
        served == expected,
        "the chain served from the bucket differs"
    );
    daemon.stop();
    // The local caches were kept for the next start.
    let kept = std::fs::read_dir(&cache)
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .path()
                .extension()
                .is_some_and(|x| x == "map")
        })
        .count();
    assert!(kept >= 1, "no cache map kept");

    let back = d.join("back");
    let pulled = sqcow2_remote(
        &garage,
        &cache,
        &["pull", "--output", "json", "--dir", s(&back), s(&top)],
    );
    assert!(pulled.contains("\"layers\""), "{pulled}");
    // QEMU reads the chain again by itself, from the pulled files.
    let info = qemu_img(&["info", "--output=json", "--backing-chain", s(&top)]);
    assert!(info.contains(s(&back)) && !info.contains("http"), "{info}");
    let again = qemu_raw(&top, &back);
    assert!(again == expected, "the chain pulled back differs");
    let check = qemu_img(&["check", s(&top)]);
    assert!(check.contains("No errors were found"), "{check}");
    // And its index is valid again (rewritten for the local name).
    let ours = sqcow2(&["info", "--output", "json", s(&top)]);
    assert!(ours.contains("\"valid\""), "{ours}");
}

/// Over vhost-user, reads of blocks the local cache holds go to its file
/// directly (no engine thread), the blocks pinned until the read is done:
/// with each layer's cache two blocks, so that every fetch evicts, reads
/// of every size at random places, twice (the second pass mostly from
/// the cache) and then in order, give the bytes QEMU reads from the
/// local chain.
#[test]
fn reads_from_a_cache_smaller_than_the_reads_are_right() {
    let garage = Garage::start();
    let d = tempfile::tempdir().unwrap();
    let d = d.path();
    let top = gen_chain(d, 5, "32M", "0.7");
    let expected = qemu_raw(&top, d);
    let cache = d.join("cache");
    push(&garage, &cache, &top, "small-cache");
    let mut env = garage.env();
    env.push(("SQCOW2_REMOTE_CACHE", cache.to_str().unwrap()));
    let mut daemon = Daemon::start_with_env(
        d,
        &top,
        &["--read-only", "--remote-cache-size", "128K"],
        &env,
    );
    let mut client = connect_retry(&daemon, 1, true);
    let mut rng = fastrand::Rng::with_seed(48);
    let size = expected.len() as u64;
    let places: Vec<(u64, usize)> = (0..300)
        .map(|_| {
            let len = [512usize, 4096, 65536, 196_608, 1 << 20][rng.usize(0..5)];
            let at = rng.u64(0..(size - len as u64) / 512) * 512;
            (at, len)
        })
        .collect();
    for pass in 0..2 {
        for &(at, len) in &places {
            let got = client
                .try_read(at, len)
                .unwrap_or_else(|e| panic!("{len} bytes at {at}: {e}\n{}", daemon.log()));
            assert!(
                got == expected[at as usize..at as usize + len],
                "pass {pass}: {len} bytes at {at} differ"
            );
        }
    }
    for at in (0..size).step_by(1 << 20) {
        let got = client.read(at, 1 << 20);
        assert!(
            got == expected[at as usize..at as usize + (1 << 20)],
            "1 MiB at {at} differs"
        );
    }
    drop(client);
    daemon.stop();
}

/// The store stopped under a daemon serving from it: reads of what the
/// local cache holds go on, a read that needs the store fails with an
/// I/O error after the bounded retry (no hang, no wrong bytes), and once
/// the store is back the same read succeeds, right, from the same daemon.
#[test]
fn a_stopped_store_fails_reads_cleanly_and_the_daemon_recovers() {
    let garage = Garage::start();
    let d = tempfile::tempdir().unwrap();
    let d = d.path();
    let top = gen_chain(d, 4, "32M", "0.6");
    let expected = qemu_raw(&top, d);
    let cache = d.join("cache");
    push(&garage, &cache, &top, "stopped");
    let (mut daemon, sock) = serve_nbd(&garage, d, &top, &cache);
    let out = d.join("slice.raw");
    let mib = 1u64 << 20;
    let want = |at: u64| &expected[at as usize..(at + mib) as usize];

    let warm = nbd_slice(&sock, 0, mib, &out).expect("read with the store up");
    assert!(warm == want(0));
    garage.stop();
    let cold = nbd_slice(&sock, 30 * mib, mib, &out);
    assert!(cold.is_err(), "a read needing the stopped store succeeded");
    let again = nbd_slice(&sock, 0, mib, &out).expect("a cached read with the store down");
    assert!(again == want(0), "cached bytes differ with the store down");

    garage.start_again();
    let back = nbd_slice(&sock, 30 * mib, mib, &out).expect("the read once the store is back");
    assert!(
        back == want(30 * mib),
        "the read after the store came back differs"
    );
    let all = raw_over_nbd(&sock, &d.join("all.raw"));
    assert!(all == expected);
    daemon.stop();
}

/// An object replaced or deleted after the push: every read either fails
/// or returns the pushed bytes, never the new object's; reads of the
/// other layers go on.
#[test]
fn a_changed_or_deleted_object_is_never_served() {
    let garage = Garage::start();
    let d = tempfile::tempdir().unwrap();
    let d = d.path();
    let top = gen_chain(d, 4, "16M", "0.8");
    let expected = qemu_raw(&top, d);
    let cache = d.join("cache");
    let urls = push(&garage, &cache, &top, "changed");
    assert_eq!(urls.len(), 3);
    let store = bucket(&garage);
    // The base: the same bytes but for its data, flipped (its header and
    // tables as they were, so that only the version tells).
    let base_key = key_of(&garage, &urls[2]);
    let base_file = d.join(urls[2].rsplit('/').next().unwrap());
    let mut bytes = std::fs::read(&base_file).unwrap();
    let n = bytes.len();
    for b in &mut bytes[n / 2..] {
        *b ^= 0xff;
    }
    store.put_bytes(&base_key, &bytes).unwrap();
    store.delete(&key_of(&garage, &urls[1])).unwrap();

    let (mut daemon, sock) = serve_nbd(&garage, d, &top, &cache);
    let out = d.join("slice.raw");
    let step = 256u64 << 10;
    let (mut failed, mut served) = (0, 0);
    for at in (0..expected.len() as u64).step_by(step as usize) {
        match nbd_slice(&sock, at, step, &out) {
            Ok(got) => {
                assert!(
                    got[..] == expected[at as usize..(at + step) as usize],
                    "wrong bytes served at {at}"
                );
                served += 1;
            }
            Err(_) => failed += 1,
        }
    }
    assert!(failed > 0, "no read touched the changed layers");
    assert!(served > 0, "no read was served at all");
    daemon.stop();
}

/// Bad input, each refused with one clear error and nothing local
/// changed: a bucket that does not exist, wrong credentials (the secret
/// in no message), and a URL that names an object that is not a qcow2
/// layer.
#[test]
fn bad_stores_and_objects_are_refused_and_change_nothing() {
    let garage = Garage::start();
    let d = tempfile::tempdir().unwrap();
    let d = d.path();
    let top = gen_chain(d, 3, "8M", "0.5");
    let before = common::sha256_file(&top);
    let cache = d.join("cache");
    let attempt = |cmd: &mut Command| {
        let out = run_raw(cmd);
        assert!(!out.status.success(), "{cmd:?} succeeded");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };

    let why =
        attempt(
            garage
                .command(sqcow2_bin())
                .args(["push", s(&top), "s3://no-such-bucket/x"]),
        );
    assert!(why.to_lowercase().contains("bucket"), "{why}");
    assert_eq!(common::sha256_file(&top), before);

    let secret = garage.vars["AWS_SECRET_ACCESS_KEY"].clone();
    let why = attempt(
        garage
            .command(sqcow2_bin())
            .env("AWS_SECRET_ACCESS_KEY", "not-the-secret")
            .args(["push", s(&top), &format!("s3://{}/y", garage.bucket())]),
    );
    assert!(why.contains("denied") || why.contains("403"), "{why}");
    assert!(
        !why.contains(&secret) && !why.contains("not-the-secret"),
        "{why}"
    );
    assert_eq!(common::sha256_file(&top), before);

    // A top renamed (as qemu-img rebase -u would) to an object that is
    // not a qcow2 layer.
    let store = bucket(&garage);
    store
        .put_bytes("garbage.qcow2", &vec![0x5a; 1 << 20])
        .unwrap();
    let url = format!(
        "{}/{}/garbage.qcow2",
        garage.endpoint().trim_end_matches('/'),
        garage.bucket()
    );
    qemu_img(&[
        "rebase",
        "-u",
        "-f",
        "qcow2",
        "-b",
        &url,
        "-F",
        "qcow2",
        s(&top),
    ]);
    let why = attempt(
        garage
            .command(sqcow2_bin())
            .env("SQCOW2_REMOTE_CACHE", &cache)
            .args(["map", s(&top)]),
    );
    assert!(why.contains(&url) && why.contains("qcow2"), "{why}");
}
