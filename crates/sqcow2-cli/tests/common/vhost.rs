//! A `sqcow2 serve` daemon under test and a libblkio client for it: the
//! independent vhost-user-blk frontend the daemon is checked against.

#![allow(dead_code)]

use std::mem::MaybeUninit;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use blkio::{Blkio, Blkioq, MemoryRegion, ReqFlags};

use super::sqcow2_bin;

/// One request on a control socket; `None` if no reply comes within
/// `timeout`.
pub fn control_within(
    path: &Path,
    req: serde_json::Value,
    timeout: Duration,
) -> Option<serde_json::Value> {
    let stream = std::os::unix::net::UnixStream::connect(path).expect("control socket");
    let reply = exchange(stream, &req, timeout).expect("request")?;
    Some(serde_json::from_str(&reply).expect("reply is JSON"))
}

/// One request on a control socket; `None` if the connection is refused
/// (a listen backlog full while the daemon's accept thread catches up) or
/// no reply comes within 10 s.
pub fn try_control(path: &Path, req: serde_json::Value) -> Option<serde_json::Value> {
    let stream = std::os::unix::net::UnixStream::connect(path).ok()?;
    let reply = exchange(stream, &req, Duration::from_secs(10)).ok()??;
    serde_json::from_str(&reply).ok()
}

/// Sends `req` as one line on `stream`; the reply line, if one comes
/// within `timeout`.
fn exchange(
    mut stream: std::os::unix::net::UnixStream,
    req: &serde_json::Value,
    timeout: Duration,
) -> std::io::Result<Option<String>> {
    use std::io::{BufRead, BufReader, Write};
    stream.set_read_timeout(Some(timeout))?;
    let mut line = req.to_string();
    line.push('\n');
    stream.write_all(line.as_bytes())?;
    let mut reply = String::new();
    Ok(match BufReader::new(stream).read_line(&mut reply) {
        Ok(n) if n > 0 => Some(reply),
        _ => None,
    })
}

/// One request on a control socket; its reply (within 60 s).
pub fn control(path: &Path, req: serde_json::Value) -> serde_json::Value {
    control_within(path, req, Duration::from_secs(60)).expect("control reply within 60 s")
}

/// A running `sqcow2 serve`.
pub struct Daemon {
    child: Option<Child>,
    pub socket: PathBuf,
    pub pidfile: PathBuf,
    log: PathBuf,
}

impl Daemon {
    /// Starts `sqcow2 serve` of `image` with `extra` arguments; returns
    /// once it accepts connections (its pidfile exists).
    pub fn start(dir: &Path, image: &Path, extra: &[&str]) -> Daemon {
        Daemon::start_with_env(dir, image, extra, &[])
    }

    /// [`Daemon::start`] with extra environment variables.
    pub fn start_with_env(
        dir: &Path,
        image: &Path,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Daemon {
        Daemon::start_bin(&sqcow2_bin(), dir, image, extra, env)
    }

    /// [`Daemon::start_with_env`] of the `sqcow2` binary at `bin` (an
    /// upgrade starts another one on the same socket).
    pub fn start_bin(
        bin: &Path,
        dir: &Path,
        image: &Path,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Daemon {
        let socket = dir.join("vhost.sock");
        // The suite runs the crash and restart tests once more with
        // SQCOW2_TEST_CACHE=none (`scripts/test.sh`): every daemon they
        // start serves with that --cache unless a test chose one.
        let cache: Vec<String> = match std::env::var("SQCOW2_TEST_CACHE") {
            Ok(mode) if !extra.contains(&"--cache") => vec!["--cache".into(), mode],
            _ => Vec::new(),
        };
        let mut args: Vec<std::ffi::OsString> = vec!["--socket".into(), socket.clone().into()];
        args.extend(cache.iter().map(Into::into));
        args.extend(extra.iter().map(Into::into));
        args.push(image.into());
        Daemon::spawn(bin, dir, &args, env)
    }

    /// `sqcow2 serve --pidfile PID ARGS...` (exports given in `args`):
    /// returns once it accepts connections.
    pub fn start_args(dir: &Path, args: &[String]) -> Daemon {
        let args: Vec<std::ffi::OsString> = args.iter().map(Into::into).collect();
        Daemon::spawn(&sqcow2_bin(), dir, &args, &[])
    }

    fn spawn(bin: &Path, dir: &Path, args: &[std::ffi::OsString], env: &[(&str, &str)]) -> Daemon {
        let socket = dir.join("vhost.sock");
        let pidfile = dir.join("serve.pid");
        let log = dir.join("serve.log");
        let _ = std::fs::remove_file(&pidfile);
        let child = Command::new(bin)
            .arg("serve")
            .arg("--pidfile")
            .arg(&pidfile)
            .args(args)
            .env("RUST_LOG", "info")
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("daemon log"))
            .spawn()
            .expect("spawn sqcow2 serve");
        let mut d = Daemon {
            child: Some(child),
            socket,
            pidfile,
            log,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while !d.pidfile.exists() {
            if let Some(status) = d.child.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
                panic!("sqcow2 serve exited early ({status}):\n{}", d.log());
            }
            assert!(
                Instant::now() < deadline,
                "sqcow2 serve not ready:\n{}",
                d.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        d
    }

    /// One request on `ctl`, this daemon's control socket; its reply
    /// (within 60 s). A missing reply fails with the daemon's log.
    pub fn control(&self, ctl: &Path, req: serde_json::Value) -> serde_json::Value {
        control_within(ctl, req.clone(), Duration::from_secs(60))
            .unwrap_or_else(|| panic!("no control reply to {req}; daemon log:\n{}", self.log()))
    }

    /// The daemon's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn pid(&self) -> i32 {
        self.child.as_ref().map(|c| c.id() as i32).unwrap_or(-1)
    }

    /// Whether the process still runs.
    pub fn is_running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| c.try_wait().ok().flatten().is_none())
    }

    /// Sends `signal` and waits (at most 60 s) for the exit.
    pub fn stop_with(&mut self, signal: i32) -> ExitStatus {
        let mut child = self.child.take().expect("daemon already stopped");
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(child.id() as i32, signal) };
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(status) = child.try_wait().expect("wait") {
                return status;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                panic!("sqcow2 serve ignored signal {signal}:\n{}", self.log());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGTERM; asserts a clean exit.
    pub fn stop(&mut self) {
        let status = self.stop_with(libc::SIGTERM);
        assert!(
            status.success(),
            "sqcow2 serve exited with {status}:\n{}",
            self.log()
        );
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Bytes of the client's I/O buffer.
pub const BUF_SIZE: usize = 8 << 20;

/// A libblkio `virtio-blk-vhost-user` connection.
pub struct Client {
    pub blkio: Blkio,
    pub queues: Vec<Blkioq>,
    pub region: MemoryRegion,
}

impl Client {
    /// Connects with `num_queues` queues and one mapped buffer region.
    pub fn connect(
        socket: &Path,
        num_queues: i32,
        read_only: bool,
    ) -> Result<Client, blkio::Error> {
        let mut blkio = Blkio::new("virtio-blk-vhost-user")?;
        blkio.set_str("path", socket.to_str().expect("utf-8 socket path"))?;
        blkio.set_bool("read-only", read_only)?;
        blkio.connect()?;
        blkio.set_i32("num-queues", num_queues)?;
        let queues = blkio.start()?.queues;
        // Mapped after start: the daemon sees it as ADD_MEM_REG.
        let region = blkio.alloc_mem_region(BUF_SIZE)?;
        blkio.map_mem_region(&region)?;
        Ok(Client {
            blkio,
            queues,
            region,
        })
    }

    /// Moves every queue to a thread of its own running
    /// `work(q, queue, region)`, `region` being the address of the mapped
    /// buffer region they share; the client keeps the connection.
    pub fn spawn_per_queue<T, F>(&mut self, work: F) -> Vec<std::thread::JoinHandle<T>>
    where
        T: Send + 'static,
        F: Fn(usize, Blkioq, usize) -> T + Clone + Send + 'static,
    {
        let region = self.region.addr;
        std::mem::take(&mut self.queues)
            .into_iter()
            .enumerate()
            .map(|(q, queue)| {
                let work = work.clone();
                std::thread::spawn(move || work(q, queue, region))
            })
            .collect()
    }

    pub fn capacity(&self) -> u64 {
        self.blkio.get_u64("capacity").expect("capacity")
    }

    /// The buffer region as bytes.
    pub fn buf(&mut self) -> &mut [u8] {
        // SAFETY: the region is BUF_SIZE bytes mapped by libblkio for this
        // client, alive as long as `self`; requests using it are waited
        // for before any method returns.
        unsafe { std::slice::from_raw_parts_mut(self.region.addr as *mut u8, self.region.len) }
    }

    /// Waits for `n` completions on queue `q`; returns their results by
    /// user_data.
    pub fn wait(&mut self, q: usize, n: usize) -> Vec<(usize, i32)> {
        let mut out = Vec::with_capacity(n);
        let mut completions: Vec<MaybeUninit<blkio::Completion>> =
            (0..n).map(|_| MaybeUninit::uninit()).collect();
        while out.len() < n {
            let mut timeout = Duration::from_secs(60);
            let want = n - out.len();
            let got = self.queues[q]
                .do_io(&mut completions[..want], want, Some(&mut timeout), None)
                .expect("do_io");
            assert!(got > 0, "no completion within 60 s");
            for c in &completions[..got] {
                // SAFETY: do_io initialised the first `got` entries.
                let c = unsafe { c.assume_init_ref() };
                out.push((c.user_data, c.ret));
            }
        }
        out
    }

    fn one(&mut self, q: usize) -> i32 {
        self.wait(q, 1)[0].1
    }

    /// The result of the one request on queue 0, if it completes within
    /// `timeout` (a daemon that hung up never completes it).
    fn one_within(&mut self, timeout: Duration) -> Option<i32> {
        let mut completion = [MaybeUninit::<blkio::Completion>::uninit()];
        let mut left = timeout;
        match self.queues[0].do_io(&mut completion, 1, Some(&mut left), None) {
            // SAFETY: do_io initialised the first entry.
            Ok(1) => Some(unsafe { completion[0].assume_init_ref() }.ret),
            _ => None,
        }
    }

    /// [`Client::try_write`] waiting at most `timeout`: `None` if no
    /// completion came.
    pub fn try_write_within(&mut self, offset: u64, data: &[u8], timeout: Duration) -> Option<i32> {
        assert!(data.len() <= BUF_SIZE);
        self.buf()[..data.len()].copy_from_slice(data);
        let ptr = self.region.addr as *const u8;
        self.queues[0].write(offset, ptr, data.len(), 0, ReqFlags::empty());
        self.one_within(timeout)
    }

    /// [`Client::try_read`] waiting at most `timeout`: `None` if no
    /// completion came.
    pub fn try_read_within(
        &mut self,
        offset: u64,
        len: usize,
        timeout: Duration,
    ) -> Option<Result<Vec<u8>, i32>> {
        assert!(len <= BUF_SIZE);
        let ptr = self.region.addr as *mut u8;
        self.queues[0].read(offset, ptr, len, 0, ReqFlags::empty());
        match self.one_within(timeout)? {
            0 => Some(Ok(self.buf()[..len].to_vec())),
            e => Some(Err(e)),
        }
    }

    /// Reads `len` bytes at `offset` (through the buffer region).
    pub fn try_read(&mut self, offset: u64, len: usize) -> Result<Vec<u8>, i32> {
        assert!(len <= BUF_SIZE);
        let ptr = self.region.addr as *mut u8;
        self.queues[0].read(offset, ptr, len, 0, ReqFlags::empty());
        match self.one(0) {
            0 => Ok(self.buf()[..len].to_vec()),
            e => Err(e),
        }
    }

    pub fn read(&mut self, offset: u64, len: usize) -> Vec<u8> {
        self.try_read(offset, len)
            .unwrap_or_else(|e| panic!("read at {offset}+{len}: {e}"))
    }

    pub fn try_write(&mut self, offset: u64, data: &[u8]) -> i32 {
        assert!(data.len() <= BUF_SIZE);
        self.buf()[..data.len()].copy_from_slice(data);
        let ptr = self.region.addr as *const u8;
        self.queues[0].write(offset, ptr, data.len(), 0, ReqFlags::empty());
        self.one(0)
    }

    pub fn write(&mut self, offset: u64, data: &[u8]) {
        let r = self.try_write(offset, data);
        assert_eq!(r, 0, "write at {offset}+{}", data.len());
    }

    pub fn try_flush(&mut self) -> i32 {
        self.queues[0].flush(0, ReqFlags::empty());
        self.one(0)
    }

    pub fn flush(&mut self) {
        assert_eq!(self.try_flush(), 0, "flush");
    }

    pub fn discard(&mut self, offset: u64, len: u64) {
        self.queues[0].discard(offset, len, 0, ReqFlags::empty());
        assert_eq!(self.one(0), 0, "discard at {offset}+{len}");
    }

    pub fn write_zeroes(&mut self, offset: u64, len: u64, unmap: bool) {
        let flags = if unmap {
            ReqFlags::empty()
        } else {
            ReqFlags::NO_UNMAP
        };
        self.queues[0].write_zeroes(offset, len, 0, flags);
        assert_eq!(self.one(0), 0, "write-zeroes at {offset}+{len}");
    }
}

/// Connects, retrying while the daemon still finishes with a previous
/// frontend (it refuses a second one meanwhile).
pub fn connect_retry(daemon: &Daemon, num_queues: i32, read_only: bool) -> Client {
    connect_retry_to(daemon, &daemon.socket, num_queues, read_only)
}

/// [`connect_retry`] to one of the daemon's sockets.
pub fn connect_retry_to(
    daemon: &Daemon,
    socket: &Path,
    num_queues: i32,
    read_only: bool,
) -> Client {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match Client::connect(socket, num_queues, read_only) {
            Ok(c) => return c,
            Err(e) if Instant::now() < deadline && is_refusal(&e) => {
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => panic!(
                "cannot connect to {}: {e}\n{}",
                socket.display(),
                daemon.log()
            ),
        }
    }
}

/// Whether `e` is the daemon hanging up on a connection it does not take.
pub fn is_refusal(e: &blkio::Error) -> bool {
    let m = e.message();
    m.contains("reset by peer") || m.contains("Broken pipe") || m.contains("refused")
}

/// Guest memory a test frontend shares with the daemon: `size` bytes at
/// guest address 0 in a file (sent with SET_MEM_TABLE), and where this
/// process maps them (the frontend's user addresses).
pub struct SharedGuestMemory {
    pub mem: vm_memory::GuestMemoryMmap<()>,
    pub file: std::fs::File,
    pub host: u64,
}

impl SharedGuestMemory {
    pub fn new(size: usize) -> Self {
        use vm_memory::{FileOffset, GuestAddress, GuestMemoryBackend};
        let file = tempfile::tempfile().unwrap();
        file.set_len(size as u64).unwrap();
        let mem = vm_memory::GuestMemoryMmap::<()>::from_ranges_with_files([(
            GuestAddress(0),
            size,
            Some(FileOffset::new(file.try_clone().unwrap(), 0)),
        )])
        .unwrap();
        let host = mem.get_host_address(GuestAddress(0)).unwrap() as u64;
        SharedGuestMemory { mem, file, host }
    }

    /// The one region, for SET_MEM_TABLE.
    pub fn region(&self) -> vhost::VhostUserMemoryRegionInfo {
        use std::os::fd::AsRawFd;
        vhost::VhostUserMemoryRegionInfo {
            guest_phys_addr: 0,
            memory_size: self.file.metadata().unwrap().len(),
            userspace_addr: self.host,
            mmap_offset: 0,
            mmap_handle: self.file.as_raw_fd(),
        }
    }
}

/// Waits (at most 10 s) until the daemon's log contains `needle`.
pub fn wait_for_log(daemon: &Daemon, needle: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !daemon.log().contains(needle) {
        assert!(
            Instant::now() < deadline,
            "the daemon never logged {needle:?}:\n{}",
            daemon.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits (at most 60 s) until the index statistics of the daemon behind
/// `ctl` satisfy `done`; its `stats`.
pub fn wait_index_state(
    ctl: &std::path::Path,
    what: &str,
    done: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let mut stats = serde_json::Value::Null;
    for _ in 0..1200 {
        stats = control(ctl, serde_json::json!({"command": "stats"}));
        if done(&stats["result"]["index"]) {
            return stats;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("{what}: not within 60 s: {stats}");
}

/// Waits until the daemon behind `ctl` has built the top's index (no
/// pending layer, no build running, no failed build); its `stats`.
pub fn wait_indexed(ctl: &std::path::Path) -> serde_json::Value {
    let stats = wait_index_state(ctl, "the top's index built", |index| {
        index["pending-layers"] == 0 && index["building"] == false
    });
    assert_eq!(
        stats["result"]["index"]["failures"], 0,
        "index builds failed: {stats}"
    );
    stats
}

/// The files of the chain the daemon behind `ctl` serves, base first.
#[allow(dead_code)]
pub fn served_layers(ctl: &std::path::Path) -> Vec<std::path::PathBuf> {
    let info = control(ctl, serde_json::json!({"command": "info"}));
    info["result"]["chain"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| std::path::PathBuf::from(p.as_str().unwrap()))
        .collect()
}

/// Waits (at most `secs` seconds) until the daemon's merge or live commit
/// has ended; its `stats` block.
#[allow(dead_code)]
pub fn wait_job_ended(ctl: &std::path::Path, secs: u64) -> serde_json::Value {
    for _ in 0..secs * 20 {
        let stats = control(ctl, serde_json::json!({"command": "stats"}));
        let m = &stats["result"]["merge"];
        if m["state"] != "copying" && m["state"] != "switching" && m["state"] != "measuring" {
            return m.clone();
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("the merge or commit did not end within {secs} s");
}
