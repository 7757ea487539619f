//! `sqcow2 serve` against libblkio (the `blkio` crate's
//! `virtio-blk-vhost-user` driver), an independent vhost-user-blk
//! frontend; QEMU's tools are the oracle for the image content.

mod common;

use std::path::Path;

use common::vhost::{connect_retry, Client, Daemon};
use common::{env_count, gen_chain, journal_running, left_clean, qemu_raw, run_raw, s, sqcow2};

fn assert_qemu_check_clean(image: &Path) {
    let out =
        run_raw(std::process::Command::new("qemu-img").args(["check", "--output=json", s(image)]));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "qemu-img check {}: {text}",
        image.display()
    );
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(
        json.get("leaks").and_then(|v| v.as_u64()).unwrap_or(0),
        0,
        "{text}"
    );
    assert_eq!(
        json.get("corruptions")
            .and_then(|v| v.as_u64())
            .unwrap_or(0),
        0,
        "{text}"
    );
}

/// Stops the daemon (SIGTERM, exit 0), then checks the image with QEMU:
/// `qemu-img check` clean, `qemu-img convert` equal to `model`.
fn stop_and_verify(daemon: &mut Daemon, top: &Path, dir: &Path, model: &[u8]) {
    daemon.stop();
    verify_image(top, dir, model);
}

fn verify_image(top: &Path, dir: &Path, model: &[u8]) {
    assert_qemu_check_clean(top);
    let after = qemu_raw(top, dir);
    assert_eq!(
        first_difference(&after, model),
        None,
        "qemu-img convert differs from the model"
    );
}

fn read_all(client: &mut Client, len: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(len as usize);
    let chunk = 1 << 20;
    let mut pos = 0;
    while pos < len {
        let n = chunk.min(len - pos) as usize;
        out.extend_from_slice(&client.read(pos, n));
        pos += n as u64;
    }
    out
}

fn first_difference(a: &[u8], b: &[u8]) -> Option<usize> {
    a.iter().zip(b).position(|(x, y)| x != y)
}

#[test]
fn every_byte_of_a_100_layer_chain_matches_qemu() {
    let tmp = tempfile::tempdir().unwrap();
    let top = gen_chain(tmp.path(), 100, "64M", "0.6");
    let expected = qemu_raw(&top, tmp.path());
    let mut daemon = Daemon::start(tmp.path(), &top, &["--read-only"]);
    let mut client = connect_retry(&daemon, 1, true);
    assert_eq!(client.capacity(), expected.len() as u64);
    let got = read_all(&mut client, expected.len() as u64);
    assert_eq!(
        first_difference(&got, &expected),
        None,
        "guest view differs from qemu-img convert"
    );
    drop(client);
    daemon.stop();
}

/// A random 512-aligned range of at most `max` bytes inside `size`.
fn range(rng: &mut fastrand::Rng, size: u64, max: u64) -> (u64, u64) {
    let len = rng.u64(1..=max / 512) * 512;
    let offset = rng.u64(0..=(size - len) / 512) * 512;
    (offset, len)
}

#[test]
fn random_writes_discards_and_zeroes_match_a_model_and_qemu() {
    for seed in 0..env_count("SQCOW2_VHOST_SEEDS", 2u64) {
        model_run(0x5eed + seed, &[]);
    }
    // The same with the worker busy-polling its rings.
    model_run(0x9011, &["--poll-us", "50"]);
}

fn model_run(seed: u64, serve_args: &[&str]) {
    let tmp = tempfile::tempdir().unwrap();
    let top = gen_chain(tmp.path(), 100, "64M", "0.6");
    let mut model = qemu_raw(&top, tmp.path());
    let size = model.len() as u64;
    let cluster = 65536u64;
    let mut daemon = Daemon::start(tmp.path(), &top, serve_args);
    let mut client = connect_retry(&daemon, 1, false);
    let mut rng = fastrand::Rng::with_seed(seed);
    for step in 0..400 {
        match rng.u32(0..10) {
            0..=3 => {
                let (offset, len) = range(&mut rng, size, 256 << 10);
                let data: Vec<u8> = (0..len).map(|_| rng.u8(..)).collect();
                client.write(offset, &data);
                model[offset as usize..(offset + len) as usize].copy_from_slice(&data);
            }
            4 => client.flush(),
            5 => {
                let clusters = rng.u64(1..=4);
                let offset = rng.u64(0..size / cluster - clusters) * cluster;
                let len = clusters * cluster;
                client.discard(offset, len);
                model[offset as usize..(offset + len) as usize].fill(0);
            }
            6 => {
                let (offset, len) = range(&mut rng, size, 512 << 10);
                client.write_zeroes(offset, len, rng.bool());
                model[offset as usize..(offset + len) as usize].fill(0);
            }
            _ => {
                let (offset, len) = range(&mut rng, size, 1 << 20);
                let got = client.read(offset, len as usize);
                let want = &model[offset as usize..(offset + len) as usize];
                assert!(
                    got == want,
                    "step {step}: read at {offset}+{len} differs from the model"
                );
            }
        }
    }
    client.flush();
    let got = read_all(&mut client, size);
    assert_eq!(
        first_difference(&got, &model),
        None,
        "guest view differs from the model"
    );
    drop(client);
    stop_and_verify(&mut daemon, &top, tmp.path(), &model);
}

#[test]
fn four_queues_of_concurrent_io_on_two_threads() {
    let tmp = tempfile::tempdir().unwrap();
    let top = gen_chain(tmp.path(), 20, "64M", "0.6");
    let mut model = qemu_raw(&top, tmp.path());
    let mut daemon = Daemon::start(
        tmp.path(),
        &top,
        &["--num-queues", "4", "--queues-per-thread", "2"],
    );
    let mut client = connect_retry(&daemon, 4, false);
    assert_eq!(client.queues.len(), 4);
    const PIECE: u64 = 16 << 10;
    const DEPTH: usize = 8;
    const ROUNDS: u64 = 24;
    // Queue q owns pieces q, q + 4, q + 8, ...: neighbours share clusters
    // and L2 tables, so the queues contend for the same metadata.
    let piece_offset = |q: u64, i: u64| (i * 4 + q) * PIECE * 3;
    let workers = client.spawn_per_queue(move |q, mut queue, base| {
        let q = q as u64;
        let slot = |k: usize| (base + (q as usize * DEPTH + k) * PIECE as usize) as *mut u8;
        let fill = |i: u64| (i as u8).wrapping_mul(31) ^ (q as u8 + 1);
        let mut completions: Vec<std::mem::MaybeUninit<blkio::Completion>> = (0..DEPTH)
            .map(|_| std::mem::MaybeUninit::uninit())
            .collect();
        let mut wait_all = |queue: &mut blkio::Blkioq| {
            let mut done = 0;
            while done < DEPTH {
                let n = queue
                    .do_io(&mut completions[..DEPTH - done], DEPTH - done, None, None)
                    .expect("do_io");
                for c in &completions[..n] {
                    // SAFETY: do_io initialised the first n entries.
                    assert_eq!(unsafe { c.assume_init_ref() }.ret, 0, "queue {q}");
                }
                done += n;
            }
        };
        for round in 0..ROUNDS / DEPTH as u64 {
            for k in 0..DEPTH {
                let i = round * DEPTH as u64 + k as u64;
                // SAFETY: slot k of queue q is PIECE bytes of the
                // mapped region that only this thread touches.
                unsafe { std::ptr::write_bytes(slot(k), fill(i), PIECE as usize) };
                queue.write(
                    piece_offset(q, i),
                    slot(k),
                    PIECE as usize,
                    k,
                    blkio::ReqFlags::empty(),
                );
            }
            wait_all(&mut queue);
        }
        queue.flush(0, blkio::ReqFlags::empty());
        let mut one = [std::mem::MaybeUninit::uninit()];
        let n = queue.do_io(&mut one, 1, None, None).expect("flush");
        assert_eq!(n, 1);
        for round in 0..ROUNDS / DEPTH as u64 {
            for k in 0..DEPTH {
                let i = round * DEPTH as u64 + k as u64;
                queue.read(
                    piece_offset(q, i),
                    slot(k),
                    PIECE as usize,
                    k,
                    blkio::ReqFlags::empty(),
                );
            }
            wait_all(&mut queue);
            for k in 0..DEPTH {
                let i = round * DEPTH as u64 + k as u64;
                // SAFETY: as above; the read into slot k completed.
                let got = unsafe { std::slice::from_raw_parts(slot(k), PIECE as usize) };
                assert!(
                    got.iter().all(|&b| b == fill(i)),
                    "queue {q} piece {i} differs"
                );
            }
        }
    });
    for w in workers {
        w.join().expect("queue thread");
    }
    for q in 0..4u64 {
        for i in 0..ROUNDS {
            let off = piece_offset(q, i) as usize;
            model[off..off + PIECE as usize].fill((i as u8).wrapping_mul(31) ^ (q as u8 + 1));
        }
    }
    drop(client);
    stop_and_verify(&mut daemon, &top, tmp.path(), &model);
}

/// Many more requests at once than a worker takes in one batch, with
/// pauses longer than the busy-poll window between rounds (the worker
/// sleeps with the guest's notifications back on, and the next round must
/// wake it): with and without polling, on one and two queues per thread,
/// every write lands and reads back, nothing waits forever.
#[test]
fn deep_queues_and_idle_gaps_with_and_without_polling() {
    const DEPTH: usize = 64;
    const BLOCK: usize = 4096;
    for args in [
        &[][..],
        &["--poll-us", "200"][..],
        &[
            "--poll-us",
            "200",
            "--num-queues",
            "2",
            "--queues-per-thread",
            "2",
        ][..],
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let top = gen_chain(tmp.path(), 3, "16M", "0.6");
        let mut model = qemu_raw(&top, tmp.path());
        let mut daemon = Daemon::start(tmp.path(), &top, args);
        let mut client = connect_retry(&daemon, 1, false);
        let base = client.region.addr;
        let slot = |k: usize| (base + k * BLOCK) as *mut u8;
        for round in 0..6u64 {
            // Blocks spread over the disk, each round its own.
            let offset = |k: usize| ((k as u64 * 61 + round * 7) % 4096) * BLOCK as u64;
            for k in 0..DEPTH {
                let fill = (round as u8).wrapping_mul(37) ^ k as u8;
                // SAFETY: slot k is BLOCK bytes of the mapped region, which
                // no request in flight uses (all were waited for).
                unsafe { std::ptr::write_bytes(slot(k), fill, BLOCK) };
                client.queues[0].write(offset(k), slot(k), BLOCK, k, blkio::ReqFlags::empty());
                let at = offset(k) as usize;
                model[at..at + BLOCK].fill(fill);
            }
            let done = client.wait(0, DEPTH);
            assert!(
                done.iter().all(|(_, r)| *r == 0),
                "{args:?} round {round}: a write failed"
            );
            std::thread::sleep(std::time::Duration::from_millis(5));
            for k in 0..DEPTH {
                client.queues[0].read(offset(k), slot(k), BLOCK, k, blkio::ReqFlags::empty());
            }
            let done = client.wait(0, DEPTH);
            assert!(
                done.iter().all(|(_, r)| *r == 0),
                "{args:?} round {round}: a read failed"
            );
            for k in 0..DEPTH {
                let at = offset(k) as usize;
                // SAFETY: the read into slot k completed.
                let got = unsafe { std::slice::from_raw_parts(slot(k), BLOCK) };
                assert!(
                    got == &model[at..at + BLOCK],
                    "{args:?} round {round}: block {k} differs"
                );
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        drop(client);
        stop_and_verify(&mut daemon, &top, tmp.path(), &model);
    }
}

#[test]
fn reconnect_keeps_data_and_a_second_frontend_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let top = gen_chain(tmp.path(), 10, "16M", "0.6");
    let mut daemon = Daemon::start(tmp.path(), &top, &[]);
    let mut first = connect_retry(&daemon, 1, false);
    let flushed = vec![0xA5u8; 128 << 10];
    first.write(1 << 20, &flushed);
    first.flush();
    // Not flushed by the guest: the daemon flushes when the frontend goes.
    let unflushed = vec![0x3Cu8; 64 << 10];
    first.write(5 << 20, &unflushed);
    match Client::connect(&daemon.socket, 1, false) {
        Ok(_) => panic!("a second frontend was accepted while one is connected"),
        Err(e) => assert!(common::vhost::is_refusal(&e), "unexpected error: {e}"),
    }
    assert_eq!(
        first.read(1 << 20, flushed.len()),
        flushed,
        "first frontend disturbed"
    );
    drop(first);
    let mut second = connect_retry(&daemon, 1, false);
    assert_eq!(second.read(1 << 20, flushed.len()), flushed);
    assert_eq!(second.read(5 << 20, unflushed.len()), unflushed);
    drop(second);
    assert!(daemon.is_running(), "daemon exited after a disconnect");
    daemon.stop();
    assert_qemu_check_clean(&top);
    let raw = qemu_raw(&top, tmp.path());
    assert_eq!(&raw[1 << 20..(1 << 20) + flushed.len()], &flushed[..]);
    assert_eq!(&raw[5 << 20..(5 << 20) + unflushed.len()], &unflushed[..]);
}

/// A frontend's end leaves the image clean (journal ended); the next
/// frontend finds the journal running before its first write. Restarted
/// by that write instead, it made every change wait for a publish whose
/// sync covered all in-place writes since: 1.2-1.9 s stalls a few
/// seconds after each reconnect under a 70/30 random load.
#[test]
fn a_reconnected_frontend_writes_into_a_running_journal() {
    let tmp = tempfile::tempdir().unwrap();
    let top = gen_chain(tmp.path(), 2, "16M", "0.3");
    let mut daemon = Daemon::start(tmp.path(), &top, &[]);
    let mut first = connect_retry(&daemon, 1, false);
    first.write(1 << 20, &[0x11u8; 64 << 10]);
    assert!(
        top.with_extension("qcow2.sqjournal").exists(),
        "no journal while the first frontend writes"
    );
    drop(first);
    // The daemon ends the session (a flush that leaves the image clean).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while !left_clean(&top) && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert!(left_clean(&top), "not clean after the frontend left");
    let mut second = connect_retry(&daemon, 1, false);
    assert!(
        journal_running(&top),
        "the journal is not running when the next frontend starts:\n{}",
        daemon.log()
    );
    let data = vec![0x22u8; 64 << 10];
    second.write(9 << 20, &data);
    assert_eq!(second.read(9 << 20, data.len()), data);
    drop(second);
    daemon.stop();
    assert_qemu_check_clean(&top);
    let raw = qemu_raw(&top, tmp.path());
    assert_eq!(&raw[9 << 20..(9 << 20) + data.len()], &data[..]);
}

#[test]
fn memory_mapped_while_queues_run() {
    let tmp = tempfile::tempdir().unwrap();
    let top = gen_chain(tmp.path(), 5, "16M", "0.6");
    let expected = qemu_raw(&top, tmp.path());
    let mut daemon = Daemon::start(tmp.path(), &top, &[]);
    let mut client = connect_retry(&daemon, 1, false);
    assert_eq!(client.read(0, 4096), expected[..4096]);
    // A second region, mapped while the queue runs (ADD_MEM_REG).
    let extra = client.blkio.alloc_mem_region(2 << 20).unwrap();
    client.blkio.map_mem_region(&extra).unwrap();
    let ptr = extra.addr as *mut u8;
    client.queues[0].read(3 << 20, ptr, 1 << 20, 0, blkio::ReqFlags::empty());
    assert_eq!(client.wait(0, 1)[0].1, 0);
    // SAFETY: the region is 2 MiB mapped by libblkio; the read completed.
    let got = unsafe { std::slice::from_raw_parts(ptr, 1 << 20) };
    assert!(
        got == &expected[3 << 20..4 << 20],
        "read into the new region differs"
    );
    client.blkio.unmap_mem_region(&extra);
    assert_eq!(
        client.read(8 << 20, 8192),
        expected[8 << 20..(8 << 20) + 8192]
    );
    drop(client);
    daemon.stop();
}

/// The read-outs of a running daemon are written for a person by
/// default: sentences and units, no JSON braces, no field names, no
/// floats of 16 digits; `--output json` stays the machine's form.
#[test]
fn live_read_outs_are_human_by_default() {
    let tmp = tempfile::tempdir().unwrap();
    let top = gen_chain(tmp.path(), 3, "8M", "0.6");
    let control = tmp.path().join("control.sock");
    let mut daemon = Daemon::start(tmp.path(), &top, &["--control", s(&control)]);
    let mut client = connect_retry(&daemon, 1, false);
    client.write(0, &[7u8; 4096]);
    let new = tmp.path().join("new.qcow2");
    let long_float = |t: &str| {
        t.split(|c: char| !(c.is_ascii_digit() || c == '.'))
            .any(|w| w.split_once('.').is_some_and(|(_, f)| f.len() > 3))
    };
    for (args, wants) in [
        (vec!["snapshot", "--live", s(&control), s(&new)], "pause"),
        (vec!["info", "--live", s(&control)], "virtual size"),
        (vec!["stats", s(&control)], "uptime"),
        (vec!["merge", "--live", "--cancel", s(&control)], "merge"),
    ] {
        let out = common::run_raw(std::process::Command::new(common::sqcow2_bin()).args(&args));
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{args:?}: {text}");
        assert!(text.contains(wants), "{args:?}: {text}");
        assert!(
            !text.contains('{') && !text.contains('_'),
            "{args:?}: {text}"
        );
        assert!(!long_float(&text), "{args:?}: {text}");
        let new2 = tmp.path().join("new2.qcow2");
        let mut json_args = args.clone();
        if json_args[0] == "snapshot" {
            *json_args.last_mut().unwrap() = s(&new2);
        }
        json_args.insert(1, "--output");
        json_args.insert(2, "json");
        let out =
            common::run_raw(std::process::Command::new(common::sqcow2_bin()).args(&json_args));
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{json_args:?}: {text}");
        let _: serde_json::Value = serde_json::from_str(&text).expect("JSON");
    }
    drop(client);
    daemon.stop();
}

/// One HTTP GET on loopback: status line, headers, body.
fn http_get(addr: &str, path: &str) -> (String, String, String) {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(addr).expect("connect to the metrics endpoint");
    write!(stream, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").unwrap();
    let mut reply = String::new();
    stream.read_to_string(&mut reply).unwrap();
    let (head, body) = reply.split_once("\r\n\r\n").expect("HTTP reply");
    let (status, headers) = head.split_once("\r\n").unwrap_or((head, ""));
    (status.to_owned(), headers.to_owned(), body.to_owned())
}

/// `serve --metrics` answers a Prometheus scrape over HTTP with the
/// OpenMetrics text: counters named `_total`, units in the names,
/// request latency as a histogram whose numbers agree with the control
/// socket's stats and with the requests the client made.
#[test]
fn metrics_over_http_follow_the_prometheus_conventions() {
    let tmp = tempfile::tempdir().unwrap();
    let top = gen_chain(tmp.path(), 3, "8M", "0.6");
    let control = tmp.path().join("control.sock");
    let mut daemon = Daemon::start(
        tmp.path(),
        &top,
        &["--control", s(&control), "--metrics", "127.0.0.1:0"],
    );
    let log = daemon.log();
    let addr = log
        .split("http://")
        .nth(1)
        .and_then(|rest| rest.split("/metrics").next())
        .unwrap_or_else(|| panic!("no metrics URL logged:\n{log}"))
        .to_owned();
    let mut client = connect_retry(&daemon, 1, false);
    for i in 0..8u64 {
        client.write(i << 16, &[i as u8; 4096]);
    }
    for i in 0..4u64 {
        client.read(i << 16, 4096);
    }
    let (status, headers, text) = http_get(&addr, "/metrics");
    let stats = common::vhost::control(&control, serde_json::json!({"command": "stats"}));
    assert!(status.contains(" 200"), "{status}");
    assert!(
        headers
            .to_ascii_lowercase()
            .contains("application/openmetrics-text"),
        "{headers}"
    );
    assert_eq!(text.lines().last(), Some("# EOF"), "{text}");
    let queue = &stats["result"]["queues"][0];
    let requests = queue["requests"].as_u64().unwrap();
    assert!(requests >= 12, "{stats}");
    let sample = |name: &str| -> f64 {
        text.lines()
            .find_map(|l| l.strip_prefix(name).and_then(|v| v.strip_prefix(' ')))
            .unwrap_or_else(|| panic!("no sample {name}:\n{text}"))
            .parse()
            .unwrap()
    };
    assert_eq!(
        sample("sqcow2_queue_requests_total{queue=\"0\"}"),
        requests as f64,
        "{text}\n{stats}"
    );
    assert_eq!(
        sample("sqcow2_queue_written_bytes_total{queue=\"0\"}"),
        (8 * 4096) as f64
    );
    let measured = queue["latency-us-count"].as_u64().unwrap() as f64;
    assert_eq!(
        sample("sqcow2_queue_request_duration_seconds_count{queue=\"0\"}"),
        measured
    );
    assert_eq!(
        sample("sqcow2_queue_request_duration_seconds_bucket{le=\"+Inf\",queue=\"0\"}"),
        measured
    );
    assert!(sample("sqcow2_queue_request_duration_seconds_sum{queue=\"0\"}") > 0.0);
    let buckets: Vec<f64> = text
        .lines()
        .filter(|l| l.starts_with("sqcow2_queue_request_duration_seconds_bucket{"))
        .map(|l| l.rsplit(' ').next().unwrap().parse().unwrap())
        .collect();
    assert!(
        buckets.len() > 10 && buckets.windows(2).all(|w| w[0] <= w[1]),
        "{text}"
    );
    // Conventions: a counter's samples end in _total; no percentile gauges.
    let mut counter = None;
    for line in text.lines() {
        if let Some(family) = line.strip_prefix("# TYPE ") {
            let (name, kind) = family.split_once(' ').unwrap();
            counter = (kind == "counter").then(|| name.to_owned());
        } else if let (Some(family), false) = (&counter, line.starts_with('#')) {
            assert!(line.starts_with(&format!("{family}_total")), "{line}");
        }
        assert!(
            !line.contains("quantile") && !line.contains("_us"),
            "{line}"
        );
    }
    let (status, _, _) = http_get(&addr, "/other");
    assert!(status.contains(" 404"), "{status}");
    // Prometheus' own checker, where it is installed.
    if let Ok(mut promtool) = std::process::Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
    {
        use std::io::Write;
        promtool
            .stdin
            .take()
            .unwrap()
            .write_all(text.as_bytes())
            .unwrap();
        let out = promtool.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    drop(client);
    daemon.stop();
}

/// A command refused by the image locks of a running `sqcow2 serve`
/// names the way out that works for it: `--live` for a snapshot or a
/// merge, `-U` only for a read-out, stopping the daemon for the rest.
#[test]
fn a_lock_refusal_names_the_way_out() {
    let tmp = tempfile::tempdir().unwrap();
    let top = gen_chain(tmp.path(), 3, "8M", "0.6");
    let control = tmp.path().join("control.sock");
    let mut daemon = Daemon::start(tmp.path(), &top, &["--control", s(&control)]);
    let new = tmp.path().join("new.qcow2");
    let merged = tmp.path().join("m.qcow2");
    for (args, wants, never) in [
        (vec!["snapshot", s(&top), s(&new)], "snapshot --live", "-U"),
        (
            vec!["merge", s(&top), "0", "1", s(&merged)],
            "merge --live",
            "-U",
        ),
        (vec!["map", s(&top)], "-U", "--live"),
        (vec!["commit", s(&top)], "stop", "-U"),
    ] {
        let out = run_raw(std::process::Command::new(common::sqcow2_bin()).args(&args));
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(err.contains("lock"), "{args:?}: {err}");
        assert!(err.contains(wants), "{args:?}: {err}");
        assert!(!err.contains(never), "{args:?}: {err}");
    }
    daemon.stop();
}

/// The shipped systemd unit (`contrib/systemd/sqcow2@.service`) passes
/// `systemd-analyze verify` (with this build's binary and manual pages),
/// and the command line it runs serves: ready through sd_notify, a
/// client's write read back, a clean stop on SIGTERM.
#[test]
fn the_shipped_systemd_unit_verifies_and_serves() {
    let tmp = tempfile::tempdir().unwrap();
    let unit =
        std::fs::read_to_string(common::workspace_root().join("contrib/systemd/sqcow2@.service"))
            .unwrap()
            .replace("/usr/local/bin/sqcow2", s(&common::sqcow2_bin()));
    let units = tmp.path().join("units");
    std::fs::create_dir(&units).unwrap();
    std::fs::write(units.join("sqcow2@.service"), &unit).unwrap();
    let man = tmp.path().join("man");
    sqcow2(&["man", "--dir", s(&man.join("man1"))]);
    let out = run_raw(
        std::process::Command::new("systemd-analyze")
            .args(["verify", s(&units.join("sqcow2@vm1.service"))])
            .env("MANPATH", &man),
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && err.trim().is_empty(), "{err}");

    // The service's command line, as systemd would run it for vm1.
    let exec = unit
        .lines()
        .find_map(|l| l.strip_prefix("ExecStart="))
        .expect("ExecStart");
    let run = tmp.path().join("run");
    std::fs::create_dir(&run).unwrap();
    let top = gen_chain(tmp.path(), 3, "8M", "0.6");
    let line = exec
        .replace("%i", "vm1")
        .replace("/run/sqcow2", s(&run))
        .replace("$SQCOW2_OPTIONS", "--num-queues 2")
        .replace("${SQCOW2_IMAGE}", s(&top));
    let words: Vec<&str> = line.split_whitespace().collect();
    let notify_path = tmp.path().join("notify.sock");
    let notify = std::os::unix::net::UnixDatagram::bind(&notify_path).unwrap();
    notify
        .set_read_timeout(Some(std::time::Duration::from_secs(30)))
        .unwrap();
    let mut child = std::process::Command::new(words[0])
        .args(&words[1..])
        .env("NOTIFY_SOCKET", &notify_path)
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut msg = [0u8; 256];
    let n = notify.recv(&mut msg).expect("READY=1 from the service");
    assert!(String::from_utf8_lossy(&msg[..n]).contains("READY=1"));
    let socket = run.join("vm1.sock");
    assert!(run.join("vm1.ctl").exists(), "no control socket");
    let mut client = Client::connect(&socket, 2, false).expect("connect");
    client.write(1 << 20, &[9u8; 4096]);
    assert_eq!(client.read(1 << 20, 4096), vec![9u8; 4096]);
    drop(client);
    // SAFETY: kill(2) on our own child's pid.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    assert!(child.wait().unwrap().success());
    assert_qemu_check_clean(&top);
}

/// SIGHUP and SIGUSR1 stop the daemon as SIGTERM does, as they stop
/// qemu-storage-daemon (exit 0): drained, flushed, the image closed clean
/// (no dirty bit, no journal left), the socket and pidfile removed.
#[test]
fn sighup_and_sigusr1_stop_cleanly_as_qemu_storage_daemon_does() {
    for (name, signal) in [("SIGHUP", libc::SIGHUP), ("SIGUSR1", libc::SIGUSR1)] {
        let tmp = tempfile::tempdir().unwrap();
        let top = gen_chain(tmp.path(), 3, "8M", "0.6");
        let mut daemon = Daemon::start(tmp.path(), &top, &[]);
        let mut client = connect_retry(&daemon, 1, false);
        client.write(0, &[7u8; 4096]);
        drop(client);
        let status = daemon.stop_with(signal);
        assert!(
            status.success(),
            "{name}: exit status {status}:\n{}",
            daemon.log()
        );
        assert!(!daemon.socket.exists(), "{name}: socket left behind");
        assert!(!daemon.pidfile.exists(), "{name}: pidfile left behind");
        let journal = top.with_extension("qcow2.sqjournal");
        assert!(!journal.exists(), "{name}: journal left behind");
        let dirty = std::fs::read(&top).unwrap()[79] & 1 == 1;
        assert!(!dirty, "{name}: the image was left dirty");
        assert_qemu_check_clean(&top);
    }
}

#[test]
fn lifecycle_socket_mode_pidfile_signals() {
    let tmp = tempfile::tempdir().unwrap();
    let top = gen_chain(tmp.path(), 3, "8M", "0.6");
    let notify_path = tmp.path().join("notify.sock");
    let notify = std::os::unix::net::UnixDatagram::bind(&notify_path).unwrap();
    notify
        .set_read_timeout(Some(std::time::Duration::from_secs(30)))
        .unwrap();
    let mut daemon =
        Daemon::start_with_env(tmp.path(), &top, &[], &[("NOTIFY_SOCKET", s(&notify_path))]);
    let mut msg = [0u8; 256];
    let n = notify.recv(&mut msg).expect("sd_notify message");
    assert!(String::from_utf8_lossy(&msg[..n]).contains("READY=1"));
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    let meta = std::fs::metadata(&daemon.socket).unwrap();
    assert!(meta.file_type().is_socket());
    assert_eq!(meta.permissions().mode() & 0o777, 0o600);
    let pid: i32 = std::fs::read_to_string(&daemon.pidfile)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert_eq!(pid, daemon.pid());

    // A second daemon on the same socket is refused, the first keeps it
    // (locking off: the image locks would refuse it first, tests/locking.rs).
    let out = run_raw(std::process::Command::new(common::sqcow2_bin()).args([
        "--locking",
        "off",
        "serve",
        "--socket",
        s(&daemon.socket),
        s(&top),
    ]));
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("another server"));
    let mut client = connect_retry(&daemon, 1, false);
    client.write(0, &[7u8; 4096]);
    drop(client);

    // SIGINT drains, flushes, exits 0 and cleans up.
    let status = daemon.stop_with(libc::SIGINT);
    assert!(status.success(), "exit status {status}:\n{}", daemon.log());
    assert!(!daemon.socket.exists(), "socket left behind");
    assert!(!daemon.pidfile.exists(), "pidfile left behind");
    assert_qemu_check_clean(&top);

    // A regular file in the socket's place is never removed.
    let precious = tmp.path().join("precious");
    std::fs::write(&precious, b"keep me").unwrap();
    let out = run_raw(std::process::Command::new(common::sqcow2_bin()).args([
        "serve",
        "--socket",
        s(&precious),
        s(&top),
    ]));
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(std::fs::read(&precious).unwrap(), b"keep me");

    // A start that fails after the chain is open (a pidfile that cannot
    // be written; a control socket another daemon has) leaves the image
    // closed clean (no dirty bit, no journal) and none of its sockets.
    let dirty = |p: &std::path::Path| std::fs::read(p).unwrap()[79] & 1 == 1;
    for (what, extra) in [
        ("pidfile", vec!["--pidfile", "/nonexistent-dir/pid"]),
        ("control", vec!["--control", s(&precious)]),
    ] {
        let sock = tmp.path().join(format!("{what}.sock"));
        let ctl = tmp.path().join(format!("{what}.ctl"));
        let mut args = vec!["serve", "--socket", s(&sock)];
        if what != "control" {
            args.extend(["--control", s(&ctl)]);
        }
        args.extend(extra);
        args.push(s(&top));
        let out = run_raw(std::process::Command::new(common::sqcow2_bin()).args(&args));
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{what}: {err}");
        assert!(!dirty(&top), "{what}: the image was left dirty: {err}");
        let mut journal = top.as_os_str().to_owned();
        journal.push(".sqjournal");
        assert!(
            !std::path::Path::new(&journal).exists(),
            "{what}: a journal left"
        );
        assert!(!sock.exists() && !ctl.exists(), "{what}: a socket left");
        assert_eq!(std::fs::read(&precious).unwrap(), b"keep me");
    }
    assert_qemu_check_clean(&top);
}

/// SIGTERM while writes and reads are queued: the daemon finishes what it
/// took and flushes, exits 0; a completed write is on disk, one in flight
/// is there whole or not at all, `qemu-img check` is clean.
#[test]
fn sigterm_with_requests_in_flight_drains_and_flushes() {
    let tmp = tempfile::tempdir().unwrap();
    let top = gen_chain(tmp.path(), 20, "64M", "0.6");
    let mut model = qemu_raw(&top, tmp.path());
    let original = model.clone();
    let mut daemon = Daemon::start(tmp.path(), &top, &[]);
    let mut client = connect_retry(&daemon, 1, false);
    const N: usize = 16;
    const LEN: usize = 256 << 10;
    let base = client.region.addr;
    let queue_writes = |client: &mut Client, round: usize, model: &mut Vec<u8>| {
        for k in 0..N {
            let ptr = (base + k * LEN) as *mut u8;
            let fill = (round * N + k) as u8 + 1;
            // SAFETY: slot k lies in the client's 8 MiB mapped region, and
            // no request in flight uses it (see below).
            unsafe { std::ptr::write_bytes(ptr, fill, LEN) };
            let off = ((round * N + k) * 2 * LEN) as u64;
            client.queues[0].write(off, ptr, LEN, k, blkio::ReqFlags::empty());
            model[off as usize..off as usize + LEN].fill(fill);
        }
    };
    // A first batch, completed: it must all be on disk after the stop.
    queue_writes(&mut client, 0, &mut model);
    assert!(client.wait(0, N).iter().all(|(_, r)| *r == 0));
    // A second batch and reads queued at once, then SIGTERM while they
    // run (the daemon takes them a batch at a time: some may never be
    // taken).
    let mut in_flight = model.clone();
    queue_writes(&mut client, 1, &mut in_flight);
    for k in 0..N {
        // Past the writes' buffers: a write in flight may still read its
        // buffer (from guest memory, as a virtio device does).
        let ptr = (base + N * LEN + (k % 8) * LEN / 8) as *mut u8;
        client.queues[0].read(
            (k * LEN) as u64,
            ptr,
            LEN / 8,
            N + k,
            blkio::ReqFlags::empty(),
        );
    }
    let mut zero = std::time::Duration::ZERO;
    let mut completions: Vec<std::mem::MaybeUninit<blkio::Completion>> = (0..2 * N)
        .map(|_| std::mem::MaybeUninit::uninit())
        .collect();
    let _ = client.queues[0].do_io(&mut completions, 0, Some(&mut zero), None);
    let status = daemon.stop_with(libc::SIGTERM);
    assert!(status.success(), "exit status {status}:\n{}", daemon.log());
    drop(client);
    assert_qemu_check_clean(&top);
    let after = qemu_raw(&top, tmp.path());
    // The first batch whole; each write of the second either whole (taken,
    // completed and flushed before the exit) or not at all (never taken).
    for k in 0..N {
        let off = (N + k) * 2 * LEN;
        let got = &after[off..off + LEN];
        assert!(
            got == &in_flight[off..off + LEN] || got == &original[off..off + LEN],
            "write {k} of the second batch is torn"
        );
        model[off..off + LEN].copy_from_slice(got);
    }
    assert_eq!(
        first_difference(&after, &model),
        None,
        "qemu-img convert differs from the model"
    );
}

#[test]
fn bench_load_drives_the_daemon_without_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let top = gen_chain(tmp.path(), 10, "16M", "0.6");
    let mut daemon = Daemon::start(tmp.path(), &top, &["--num-queues", "2"]);
    for pattern in ["rand-read", "mixed", "seq-read"] {
        let out = common::run(
            std::process::Command::new(common::sqcow2_bench_bin()).args([
                "load",
                "--socket",
                s(&daemon.socket),
                "--pattern",
                pattern,
                "--queues",
                "2",
                "--iodepth",
                "4",
                "--duration",
                "0.5",
                "--output",
                "json",
            ]),
        );
        let json: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(json["errors"], 0, "{out}");
        assert!(json["ios"].as_u64().unwrap() > 0, "{out}");
        assert!(json["lat_p99_us"].as_f64().unwrap() >= json["lat_p50_us"].as_f64().unwrap());
    }
    daemon.stop();
    assert_qemu_check_clean(&top);
}

/// Log lines written to a file carry no colour escapes; with
/// `--log-format json` every line is one JSON object.
#[test]
fn log_lines_are_plain_in_files_and_json_on_request() {
    let tmp = tempfile::tempdir().unwrap();
    let top = gen_chain(tmp.path(), 2, "16M", "0.5");
    let mut daemon = Daemon::start(tmp.path(), &top, &[]);
    let client = connect_retry(&daemon, 1, false);
    drop(client);
    daemon.stop();
    let text = daemon.log();
    assert!(text.contains("ready for a vhost-user frontend"), "{text}");
    assert!(
        !text.contains('\u{1b}'),
        "colour escapes in a log file:\n{text}"
    );

    let control = tmp.path().join("control.sock");
    let mut daemon = Daemon::start(
        tmp.path(),
        &top,
        &["--log-format", "json", "--control", s(&control)],
    );
    // A live snapshot logs its steps: as values, not Rust's Debug text.
    let new = tmp.path().join("new.qcow2");
    sqcow2(&["snapshot", "--live", s(&control), s(&new)]);
    daemon.stop();
    let text = daemon.log();
    let lines: Vec<&str> = text.lines().filter(|l| !l.is_empty()).collect();
    assert!(!lines.is_empty());
    let mut snapshot_logged = false;
    for line in lines {
        let v: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
        assert!(v["level"].is_string() && v["fields"].is_object(), "{line}");
        for (key, value) in v["fields"].as_object().unwrap() {
            let debug_text = value
                .as_str()
                .is_some_and(|t| t.contains(" { ") || t.contains("Some(") || t.contains("[Job"));
            assert!(!debug_text, "field {key} holds Rust Debug text: {line}");
        }
        if v["fields"]["message"] == "live snapshot" {
            snapshot_logged = true;
            assert!(v["fields"]["drain_ms"].is_number(), "{line}");
        }
    }
    assert!(snapshot_logged, "no live snapshot line:\n{text}");

    // A fatal error is a JSON line too.
    let out = run_raw(std::process::Command::new(common::sqcow2_bin()).args([
        "--log-format",
        "json",
        "serve",
        "--socket",
        s(&tmp.path().join("x.sock")),
        s(&tmp.path().join("nothere.qcow2")),
    ]));
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<&str> = err.lines().filter(|l| !l.is_empty()).collect();
    assert!(!lines.is_empty());
    let mut fatal = false;
    for line in lines {
        let v: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
        fatal |= v["level"] == "ERROR" && line.contains("nothere.qcow2");
    }
    assert!(fatal, "no ERROR line naming the file:\n{err}");
}
