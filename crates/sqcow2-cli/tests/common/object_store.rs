//! A real S3 store for the tests: Garage, started on loopback by
//! `scripts/object-store.sh` (built from crates.io the first time), its
//! bucket and credentials read from the `env` file the script writes.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Command;

use super::workspace_root;

/// A running store; stopped when dropped.
pub struct Garage {
    pub dir: tempfile::TempDir,
    pub vars: HashMap<String, String>,
    running: std::cell::Cell<bool>,
}

fn script() -> PathBuf {
    workspace_root().join("scripts/object-store.sh")
}

impl Garage {
    pub fn start() -> Garage {
        let dir = tempfile::tempdir().unwrap();
        let mut garage = Garage {
            dir,
            vars: HashMap::new(),
            running: std::cell::Cell::new(false),
        };
        garage.start_again();
        let env = std::fs::read_to_string(garage.dir.path().join("env")).unwrap();
        garage.vars = env
            .lines()
            .filter_map(|l| l.strip_prefix("export "))
            .filter_map(|l| l.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        garage
    }

    /// Starts the store again (same data, port and credentials).
    pub fn start_again(&self) {
        let out = Command::new(script())
            .arg("start")
            .arg(self.dir.path())
            .output()
            .expect("scripts/object-store.sh");
        assert!(
            out.status.success(),
            "object store did not start: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        self.running.set(true);
    }

    pub fn bucket(&self) -> &str {
        &self.vars["SQCOW2_S3_BUCKET"]
    }

    pub fn endpoint(&self) -> &str {
        &self.vars["AWS_ENDPOINT_URL"]
    }

    /// The variables a client of the store needs, as `(name, value)`.
    pub fn env(&self) -> Vec<(&str, &str)> {
        self.vars
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect()
    }

    /// A command with the store's variables set.
    pub fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut cmd = Command::new(program);
        cmd.envs(self.vars.iter());
        cmd
    }

    pub fn stop(&self) {
        if !self.running.replace(false) {
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
