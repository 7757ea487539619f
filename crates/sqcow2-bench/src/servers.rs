//! The servers the suite compares, started on a generated chain.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use anyhow::Context;
use serde::Serialize;

/// A vhost-user-blk server configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Server {
    /// qemu-storage-daemon with QEMU's default caches.
    QsdDefault,
    /// qemu-storage-daemon with sqcow2's cache budget split over the layers.
    QsdBudget,
    /// sqcow2 serve, walking the chain like QEMU.
    Sqcow2Walk,
    /// sqcow2 serve with the chain index.
    Sqcow2Indexed,
}

impl Server {
    pub const ALL: [Server; 4] = [
        Server::QsdDefault,
        Server::QsdBudget,
        Server::Sqcow2Walk,
        Server::Sqcow2Indexed,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Server::QsdDefault => "qsd-default",
            Server::QsdBudget => "qsd-budget",
            Server::Sqcow2Walk => "sqcow2-walk",
            Server::Sqcow2Indexed => "sqcow2-indexed",
        }
    }
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

/// Starts `server` on `chain`, listening on `socket`, read-only.
pub fn spawn(
    server: Server,
    chain: &ChainFiles,
    socket: &Path,
    sqcow2: &Path,
    cache_bytes: u64,
    log: &Path,
) -> anyhow::Result<Child> {
    let _ = std::fs::remove_file(socket);
    let mut cmd = match server {
        Server::QsdDefault => {
            let mut c = Command::new("qemu-storage-daemon");
            c.arg("--blockdev").arg(format!(
                "driver=file,node-name=file,filename={},read-only=on",
                chain.top().display()
            ));
            c.arg("--blockdev")
                .arg("driver=qcow2,node-name=disk,file=file,read-only=on");
            c.arg("--export").arg(export_arg(socket));
            c
        }
        Server::QsdBudget => {
            let mut c = Command::new("qemu-storage-daemon");
            let per_layer = (cache_bytes / chain.layers.len() as u64 / 4096 * 4096).max(8192);
            for (i, layer) in chain.layers.iter().enumerate() {
                let backing = if i == 0 {
                    serde_json::Value::Null
                } else {
                    serde_json::Value::String(format!("l{}", i - 1))
                };
                let node = serde_json::json!({
                    "driver": "qcow2",
                    "node-name": format!("l{i}"),
                    "read-only": true,
                    "l2-cache-size": per_layer,
                    "l2-cache-entry-size": 4096,
                    "file": {"driver": "file", "filename": layer, "read-only": true},
                    "backing": backing,
                });
                c.arg("--blockdev").arg(node.to_string());
            }
            c.arg("--export").arg(export_arg(socket).replace(
                "node-name=disk",
                &format!("node-name=l{}", chain.layers.len() - 1),
            ));
            c
        }
        Server::Sqcow2Walk | Server::Sqcow2Indexed => {
            let mut c = Command::new(sqcow2);
            c.arg("--cache-size").arg(cache_bytes.to_string());
            if server == Server::Sqcow2Walk {
                c.arg("--walk");
            }
            c.args(["serve", "--read-only", "--socket"])
                .arg(socket)
                .arg(chain.top());
            c.env("RUST_LOG", "warn");
            c
        }
    };
    cmd.stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log).context("server log")?);
    cmd.spawn()
        .with_context(|| format!("starting {}", server.name()))
}

fn export_arg(socket: &Path) -> String {
    format!(
        "type=vhost-user-blk,id=exp,node-name=disk,addr.type=unix,addr.path={},num-queues=1",
        socket.display()
    )
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
