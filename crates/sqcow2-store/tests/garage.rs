//! The client against a real S3 store: Garage, started on loopback for
//! each test by `scripts/object-store.sh` (built from crates.io the first
//! time), its bucket and credentials read from the `env` file it writes.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use std::sync::Arc;

use sqcow2_store::{CacheStart, ObjectStore, RemoteObject, StoreConfig, StoreError};

/// A running store; stopped when dropped.
struct Garage {
    dir: tempfile::TempDir,
    vars: HashMap<String, String>,
    stopped: std::cell::Cell<bool>,
}

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/object-store.sh")
}

impl Garage {
    fn start() -> Garage {
        let dir = tempfile::tempdir().unwrap();
        let out = Command::new(script())
            .arg("start")
            .arg(dir.path())
            .output()
            .expect("scripts/object-store.sh");
        assert!(
            out.status.success(),
            "object store did not start: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let printed = String::from_utf8_lossy(&out.stdout);
        assert!(
            printed.starts_with("endpoint=http://127.0.0.1:"),
            "{printed}"
        );
        let env = std::fs::read_to_string(dir.path().join("env")).unwrap();
        let vars = env
            .lines()
            .filter_map(|l| l.strip_prefix("export "))
            .filter_map(|l| l.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Garage {
            dir,
            vars,
            stopped: std::cell::Cell::new(false),
        }
    }

    /// The store's bucket, with `changed` variables over the store's own.
    fn store_with(&self, changed: &[(&str, &str)]) -> ObjectStore {
        let mut vars = self.vars.clone();
        for (k, v) in changed {
            vars.insert(k.to_string(), v.to_string());
        }
        let config =
            StoreConfig::from_lookup(&vars["SQCOW2_S3_BUCKET"], |k| vars.get(k).cloned()).unwrap();
        ObjectStore::new(&config).unwrap()
    }

    fn store(&self) -> ObjectStore {
        self.store_with(&[])
    }

    fn stop(&self) {
        if self.stopped.replace(true) {
            return;
        }
        let st = Command::new(script())
            .arg("stop")
            .arg(self.dir.path())
            .status()
            .unwrap();
        assert!(st.success());
    }
}

impl Drop for Garage {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Bytes that differ everywhere (no run a wrong offset would match).
fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[1] ^ seed)
        .collect()
}

/// An object written whole and read back by ranges, pinned to its
/// version: a changed object is refused, never mixed with the old bytes;
/// a missing one, wrong credentials and a range past the end are errors
/// that say so.
#[test]
fn objects_round_trip_by_range_and_version() {
    let garage = Garage::start();
    let store = garage.store();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("layer.qcow2");
    let len = (1 << 20) + 12_345;
    let data = pattern(len, 0);
    std::fs::write(&file, &data).unwrap();

    let put = store.put_file("layers/l1.qcow2", &file).unwrap();
    assert_eq!(put.len, len as u64);
    let head = store.head("layers/l1.qcow2").unwrap();
    assert_eq!(head, put);

    let whole = store
        .get_range("layers/l1.qcow2", 0, len, Some(&head.etag))
        .unwrap();
    assert!(whole == data, "the object read back differs");
    for (offset, n) in [(65_536u64, 4096usize), (1 << 20, 12_345), (7, 1)] {
        let got = store
            .get_range("layers/l1.qcow2", offset, n, Some(&head.etag))
            .unwrap();
        assert!(
            got[..] == data[offset as usize..offset as usize + n],
            "range {offset}+{n}"
        );
    }

    // Another version under the same key: the old ETag is refused.
    std::fs::write(&file, pattern(len, 0x5a)).unwrap();
    let second = store.put_file("layers/l1.qcow2", &file).unwrap();
    assert_ne!(second.etag, head.etag, "a new version kept its ETag");
    let stale = store.get_range("layers/l1.qcow2", 0, 4096, Some(&head.etag));
    assert!(
        matches!(stale, Err(StoreError::Changed { .. })),
        "{stale:?}"
    );

    let missing = store.head("layers/none.qcow2");
    assert!(
        matches!(missing, Err(StoreError::NotFound { .. })),
        "{missing:?}"
    );
    let missing = store.get_range("layers/none.qcow2", 0, 10, None);
    assert!(
        matches!(missing, Err(StoreError::NotFound { .. })),
        "{missing:?}"
    );
    let past = store.get_range("layers/l1.qcow2", len as u64 + 10, 10, None);
    assert!(past.is_err(), "a range past the end: {past:?}");

    let wrong = garage.store_with(&[("AWS_SECRET_ACCESS_KEY", "not-the-secret")]);
    let denied = wrong.head("layers/l1.qcow2");
    assert!(
        matches!(denied, Err(StoreError::AccessDenied { .. })),
        "{denied:?}"
    );
    let shown = denied.unwrap_err().to_string();
    assert!(!shown.contains("not-the-secret"), "{shown}");

    store.delete("layers/l1.qcow2").unwrap();
    assert!(matches!(
        store.head("layers/l1.qcow2"),
        Err(StoreError::NotFound { .. })
    ));
}

/// The store stopped: requests fail at once with an error naming the
/// endpoint, not a panic or a hang.
#[test]
fn a_stopped_store_is_unreachable() {
    let garage = Garage::start();
    let store = garage.store();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("small");
    std::fs::write(&file, b"0123456789").unwrap();
    let info = store.put_file("small", &file).unwrap();
    garage.stop();
    let gone = store.get_range("small", 0, 10, Some(&info.etag));
    match gone {
        Err(StoreError::Unreachable { endpoint, .. }) => {
            assert!(endpoint.starts_with("http://127.0.0.1:"), "{endpoint}")
        }
        other => panic!("{other:?}"),
    }
}

/// A remote object read through its local cache: each run of missing
/// blocks costs one GET, a block held costs none, a restart keeps what
/// was fetched; a new version of the object is never mixed with the old
/// one's blocks.
#[test]
fn a_remote_object_fetches_each_missing_run_once() {
    const BLOCK: u64 = 65_536;
    let garage = Garage::start();
    let store = Arc::new(garage.store());
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("layer");
    let len = 20 * BLOCK as usize + 777;
    let data = pattern(len, 3);
    std::fs::write(&file, &data).unwrap();
    store.put_file("l", &file).unwrap();
    let cache = dir.path().join("cache");
    std::fs::create_dir(&cache).unwrap();

    let open =
        || RemoteObject::open(store.clone(), "l", &cache, "l", BLOCK as u32, 64 << 20).unwrap();
    let (remote, start) = open();
    assert_eq!(start, CacheStart::New);
    let read = |remote: &RemoteObject, offset: u64, n: usize| {
        let before = store.requests();
        let mut buf = vec![0u8; n];
        remote.read_range(offset, &mut buf).unwrap();
        assert!(
            buf[..] == data[offset as usize..offset as usize + n],
            "{n} bytes at {offset}"
        );
        store.requests() - before
    };
    assert_eq!(read(&remote, BLOCK + 100, 4096), 1, "a cold block");
    assert_eq!(read(&remote, BLOCK + 5000, 100), 0, "a block held");
    // Blocks 0..=3: 1 held, so two runs, two GETs.
    assert_eq!(read(&remote, 10, 4 * BLOCK as usize - 20), 2);
    // Blocks 5..=8 missing, one run, one GET; the short last block.
    assert_eq!(read(&remote, 5 * BLOCK, 4 * BLOCK as usize), 1);
    assert_eq!(read(&remote, 20 * BLOCK, 777), 1);
    assert_eq!(read(&remote, 0, len), 2, "blocks 4 and 9..=19");
    assert_eq!(read(&remote, 0, len), 0, "everything held");
    remote.persist().unwrap();
    drop(remote);

    let (remote, start) = open();
    assert_eq!(start, CacheStart::Reused { blocks: 21 });
    assert_eq!(read(&remote, 0, len), 0, "fetched again after a restart");

    // A new version under the key: a reopened cache starts afresh.
    let new = pattern(len, 9);
    std::fs::write(&file, &new).unwrap();
    store.put_file("l", &file).unwrap();
    drop(remote);
    let (remote, start) = open();
    assert!(matches!(start, CacheStart::Dropped(_)), "{start:?}");
    let mut buf = vec![0u8; 4096];
    remote.read_range(3 * BLOCK, &mut buf).unwrap();
    assert!(buf[..] == new[3 * BLOCK as usize..3 * BLOCK as usize + 4096]);
}

/// An object replaced while a reader holds it open: the reader's next
/// fetch is refused (`Changed`), never served from the new version.
#[test]
fn a_remote_object_replaced_under_a_reader_is_refused() {
    let garage = Garage::start();
    let store = Arc::new(garage.store());
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("layer");
    std::fs::write(&file, pattern(300_000, 1)).unwrap();
    store.put_file("l", &file).unwrap();
    let (remote, _) =
        RemoteObject::open(store.clone(), "l", dir.path(), "l", 65_536, 1 << 20).unwrap();
    let mut buf = vec![0u8; 100];
    remote.read_range(0, &mut buf).unwrap();
    std::fs::write(&file, pattern(300_000, 2)).unwrap();
    store.put_file("l", &file).unwrap();
    // Block 0 is held: served from the version it came from.
    remote.read_range(0, &mut buf).unwrap();
    let changed = remote.read_range(200_000, &mut buf);
    assert!(
        matches!(changed, Err(StoreError::Changed { .. })),
        "{changed:?}"
    );
    let past = remote.read_range(299_950, &mut buf);
    assert!(past.is_err(), "a read past the end: {past:?}");
}

/// A qcow2 layer made by qemu-img, kept in the bucket, opens as a layer
/// through a remote object (its header and L1 table read by ranged GETs)
/// and its guest data reads back as qemu-io wrote it.
#[test]
fn a_qcow2_layer_opens_from_the_bucket() {
    use sqcow2_format::storage::Storage;
    let garage = Garage::start();
    let store = Arc::new(garage.store());
    let dir = tempfile::tempdir().unwrap();
    let image = dir.path().join("layer.qcow2");
    let ok = |c: &mut Command| assert!(c.status().unwrap().success(), "{c:?}");
    ok(Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2"])
        .arg(&image)
        .arg("64M"));
    ok(Command::new("qemu-io")
        .arg("-c")
        .arg("write -P 0x5a 1M 64k")
        .arg(&image));
    store.put_file("layers/base.qcow2", &image).unwrap();
    let cache = dir.path().join("cache");
    std::fs::create_dir(&cache).unwrap();
    let (remote, _) = RemoteObject::open(
        store.clone(),
        "layers/base.qcow2",
        &cache,
        "base",
        65_536,
        16 << 20,
    )
    .unwrap();
    let remote = Arc::new(remote);
    let before = store.requests();
    let layer = sqcow2_format::Qcow2Layer::open(
        Path::new("layers/base.qcow2"),
        remote.clone() as Arc<dyn Storage>,
    )
    .unwrap();
    assert_eq!(layer.header().size, 64 << 20);
    let l1 = layer.l1().unwrap().to_vec();
    assert!(
        store.requests() - before <= 2,
        "{} GETs to open a layer",
        store.requests() - before
    );
    // The cluster at guest 1 MiB, found as QEMU finds it: L1, L2, data.
    const OFFSET: u64 = 0x00ff_ffff_ffff_fe00;
    let l2 = l1[0] & OFFSET;
    let mut entry = [0u8; 8];
    remote
        .read_at(&mut entry, l2 + (1 << 20) / 65_536 * 8)
        .unwrap();
    let host = u64::from_be_bytes(entry) & OFFSET;
    assert_ne!(host, 0, "the written cluster is not mapped");
    let mut data = vec![0u8; 65_536];
    remote.read_at(&mut data, host).unwrap();
    assert!(
        data.iter().all(|b| *b == 0x5a),
        "the cluster's bytes differ"
    );
    // Past the object's end: zeros, as a file gives them.
    let mut past = [1u8; 16];
    remote.read_at(&mut past, remote.info().len + 100).unwrap();
    assert_eq!(past, [0u8; 16]);
}
