//! The servers the suite compares, started on a generated chain.
//!
//! Every qemu-storage-daemon configuration a QEMU user would pick is here,
//! not only the default: `aio=io_uring` (what QEMU's documentation and
//! tuning guides use for speed) and an iothread with polling, so that each
//! comparison is against QEMU at its best. `docs/benchmarks.md` gives the
//! exact command lines.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use anyhow::Context;
use serde::Serialize;

/// A vhost-user-blk server configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Server {
    /// qemu-storage-daemon with QEMU's defaults (`aio=threads`, the main
    /// loop, default caches): for reference.
    QsdDefault,
    /// qemu-storage-daemon with `aio=io_uring`.
    QsdIoUring,
    /// qemu-storage-daemon with `aio=io_uring` and the export in an
    /// iothread that polls (`poll-max-ns`).
    QsdIothread,
    /// As `QsdIothread`, every layer a node of its own with sqcow2's cache
    /// budget split over the layers.
    QsdBudget,
    /// sqcow2 serve, walking the chain like QEMU.
    Sqcow2Walk,
    /// sqcow2 serve with the chain index.
    Sqcow2Indexed,
    /// sqcow2 serve with the chain index, its worker threads busy-polling
    /// (`--poll-us`).
    Sqcow2Poll,
}

/// The busy-poll window of `Sqcow2Poll`, in microseconds.
pub const SQCOW2_POLL_US: u64 = 50;

/// Polling of qemu-storage-daemon's iothread (QEMU's default for
/// iothreads, given explicitly).
const QSD_POLL_MAX_NS: u64 = 32768;

impl Server {
    pub const ALL: [Server; 7] = [
        Server::QsdDefault,
        Server::QsdIoUring,
        Server::QsdIothread,
        Server::QsdBudget,
        Server::Sqcow2Walk,
        Server::Sqcow2Indexed,
        Server::Sqcow2Poll,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Server::QsdDefault => "qsd-default",
            Server::QsdIoUring => "qsd-io_uring",
            Server::QsdIothread => "qsd-iothread",
            Server::QsdBudget => "qsd-budget",
            Server::Sqcow2Walk => "sqcow2-walk",
            Server::Sqcow2Indexed => "sqcow2-indexed",
            Server::Sqcow2Poll => "sqcow2-poll",
        }
    }

    /// Whether this is a qemu-storage-daemon configuration.
    pub fn is_qemu(self) -> bool {
        matches!(
            self,
            Server::QsdDefault | Server::QsdIoUring | Server::QsdIothread | Server::QsdBudget
        )
    }
}

/// The programs the benchmarks start.
#[derive(Debug, Clone)]
pub struct Programs {
    /// The `sqcow2` binary under test.
    pub sqcow2: PathBuf,
    /// The qemu-storage-daemon compared with (a path, or a name looked up
    /// in `PATH`).
    pub qsd: PathBuf,
}

/// A generated chain: its layers, base first.
#[derive(Debug, Clone)]
pub struct ChainFiles {
    pub layers: Vec<PathBuf>,
}

impl ChainFiles {
    pub fn top(&self) -> &Path {
        self.layers
            .last()
            .map(PathBuf::as_path)
            .unwrap_or(Path::new(""))
    }
}

/// How a server exports its disk.
#[derive(Debug, Clone, Copy)]
pub struct Export {
    pub writable: bool,
    pub queues: usize,
}

impl Export {
    /// Read-only, one queue.
    pub const READ: Export = Export {
        writable: false,
        queues: 1,
    };
}

/// The qemu-storage-daemon command line of `server` on `chain` (its top,
/// or every layer for `QsdBudget`).
fn qsd_command(
    qsd: &Path,
    server: Server,
    chain: &ChainFiles,
    socket: &Path,
    cache_bytes: u64,
    export: Export,
) -> Command {
    let mut c = Command::new(qsd);
    let ro = !export.writable;
    let aio = match server {
        Server::QsdDefault => None,
        _ => Some("io_uring"),
    };
    let iothread = matches!(server, Server::QsdIothread | Server::QsdBudget);
    if iothread {
        c.arg("--object")
            .arg(format!("iothread,id=iot0,poll-max-ns={QSD_POLL_MAX_NS}"));
    }
    let node = if server == Server::QsdBudget {
        let per_layer = (cache_bytes / chain.layers.len() as u64 / 4096 * 4096).max(8192);
        for (i, layer) in chain.layers.iter().enumerate() {
            let backing = if i == 0 {
                serde_json::Value::Null
            } else {
                serde_json::Value::String(format!("l{}", i - 1))
            };
            let top = i + 1 == chain.layers.len();
            let mut file = serde_json::json!({
                "driver": "file",
                "filename": layer,
                "read-only": ro || !top,
            });
            if let Some(aio) = aio {
                file["aio"] = aio.into();
            }
            let node = serde_json::json!({
                "driver": "qcow2",
                "node-name": format!("l{i}"),
                "read-only": ro || !top,
                "l2-cache-size": per_layer,
                "l2-cache-entry-size": 4096,
                "file": file,
                "backing": backing,
            });
            c.arg("--blockdev").arg(node.to_string());
        }
        format!("l{}", chain.layers.len() - 1)
    } else {
        let aio = aio.map(|a| format!(",aio={a}")).unwrap_or_default();
        c.arg("--blockdev").arg(format!(
            "driver=file,node-name=file,filename={},read-only={}{aio}",
            chain.top().display(),
            on_off(ro),
        ));
        c.arg("--blockdev").arg(format!(
            "driver=qcow2,node-name=disk,file=file,read-only={}",
            on_off(ro)
        ));
        "disk".to_string()
    };
    c.arg("--export")
        .arg(export_arg(socket, &node, export, iothread));
    c
}

/// qemu-storage-daemon exporting a raw file (`aio=io_uring`, iothread):
/// the vhost-user path's limit without qcow2.
pub fn spawn_qsd_raw(qsd: &Path, raw: &Path, socket: &Path, log: &Path) -> anyhow::Result<Child> {
    let _ = std::fs::remove_file(socket);
    let mut c = Command::new(qsd);
    c.arg("--object")
        .arg(format!("iothread,id=iot0,poll-max-ns={QSD_POLL_MAX_NS}"));
    c.arg("--blockdev").arg(format!(
        "driver=file,node-name=disk,filename={},read-only=on,aio=io_uring",
        raw.display()
    ));
    c.arg("--export")
        .arg(export_arg(socket, "disk", Export::READ, true));
    start(c, log, "qsd-raw")
}

fn on_off(b: bool) -> &'static str {
    if b {
        "on"
    } else {
        "off"
    }
}

/// Starts `server` on `chain`, listening on `socket`.
pub fn spawn(
    server: Server,
    chain: &ChainFiles,
    socket: &Path,
    programs: &Programs,
    cache_bytes: u64,
    export: Export,
    log: &Path,
) -> anyhow::Result<Child> {
    spawn_with(
        server,
        chain,
        socket,
        programs,
        cache_bytes,
        export,
        log,
        &[],
    )
}

/// [`spawn`] with more arguments for `sqcow2 serve` (`extra`; ignored by
/// qemu-storage-daemon).
#[allow(clippy::too_many_arguments)]
pub fn spawn_with(
    server: Server,
    chain: &ChainFiles,
    socket: &Path,
    programs: &Programs,
    cache_bytes: u64,
    export: Export,
    log: &Path,
    extra: &[String],
) -> anyhow::Result<Child> {
    let _ = std::fs::remove_file(socket);
    let cmd = if server.is_qemu() {
        qsd_command(&programs.qsd, server, chain, socket, cache_bytes, export)
    } else {
        let mut c = Command::new(&programs.sqcow2);
        c.arg("--cache-size").arg(cache_bytes.to_string());
        if server == Server::Sqcow2Walk {
            c.arg("--walk");
        }
        c.arg("serve");
        if server == Server::Sqcow2Poll {
            c.arg("--poll-us").arg(SQCOW2_POLL_US.to_string());
        }
        if !export.writable {
            c.arg("--read-only");
        }
        c.arg("--num-queues").arg(export.queues.to_string());
        c.args(extra);
        c.arg("--socket").arg(socket).arg(chain.top());
        c.env("RUST_LOG", "warn");
        c
    };
    start(cmd, log, server.name())
}

fn start(mut cmd: Command, log: &Path, name: &str) -> anyhow::Result<Child> {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log).context("server log")?);
    cmd.spawn().with_context(|| format!("starting {name}"))
}

fn export_arg(socket: &Path, node: &str, export: Export, iothread: bool) -> String {
    let mut a = format!(
        "type=vhost-user-blk,id=exp,node-name={node},addr.type=unix,addr.path={},num-queues={},writable={}",
        socket.display(),
        export.queues,
        on_off(export.writable),
    );
    if iothread {
        a.push_str(",iothread=iot0");
    }
    a
}

/// The first line `program --version` prints (empty if it does not run).
pub fn version(program: &Path) -> String {
    first_output_line(program, &["--version"])
}

/// The first line `program args` prints on stdout (empty if it does not
/// run).
pub fn first_output_line(program: &Path, args: &[&str]) -> String {
    Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .ok()
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .next()
                .unwrap_or("")
                .to_string()
        })
        .unwrap_or_default()
}

/// Peak resident set of process `pid` (VmHWM) in KiB.
pub fn peak_rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
}

/// CPU time (user + system) process `pid` has used so far, in
/// microseconds (clock-tick resolution).
pub fn cpu_us(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name, which is in parentheses and may hold
    // spaces: state is field 3, utime 14, stime 15.
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    // SAFETY: sysconf has no preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if ticks <= 0 {
        return None;
    }
    Some((utime + stime) * 1e6 / ticks as f64)
}

/// SIGTERM, then SIGKILL after 10 s.
pub fn stop(child: &mut Child) {
    let _ = Command::new("kill")
        .args(["-s", "TERM", &child.id().to_string()])
        .status();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while std::time::Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(c: &Command) -> Vec<String> {
        c.get_args()
            .map(|a| a.to_string_lossy().into_owned())
            .collect()
    }

    #[test]
    fn qemu_configurations_are_what_their_names_say() {
        let chain = ChainFiles {
            layers: vec!["/c/l0.qcow2".into(), "/c/l1.qcow2".into()],
        };
        let sock = Path::new("/s.sock");
        let qsd = Path::new("qemu-storage-daemon");
        let cmd = |s| args(&qsd_command(qsd, s, &chain, sock, 32 << 20, Export::READ)).join(" ");
        let default = cmd(Server::QsdDefault);
        assert!(!default.contains("aio=") && !default.contains("iothread"));
        let uring = cmd(Server::QsdIoUring);
        assert!(uring.contains("aio=io_uring") && !uring.contains("iothread"));
        let iot = cmd(Server::QsdIothread);
        assert!(iot.contains("aio=io_uring") && iot.contains("iothread,id=iot0,poll-max-ns="));
        assert!(iot.contains(",iothread=iot0"));
        let budget = cmd(Server::QsdBudget);
        assert!(budget.contains("\"aio\":\"io_uring\"") && budget.contains("l2-cache-size"));
        assert!(budget.contains("node-name=l1"));
        let rw = args(&qsd_command(
            qsd,
            Server::QsdIothread,
            &chain,
            sock,
            32 << 20,
            Export {
                writable: true,
                queues: 4,
            },
        ))
        .join(" ");
        assert!(rw.contains("writable=on") && rw.contains("num-queues=4"));
        assert!(rw.contains("read-only=off"));
    }

    #[test]
    fn cpu_time_of_this_process_is_read() {
        let t = cpu_us(std::process::id()).expect("own stat");
        assert!(t >= 0.0);
    }
}
