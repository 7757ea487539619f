//! Commands that talk to a running `sqcow2 serve` over its control socket:
//! `snapshot --live`, `info --live`, `stats`.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use anyhow::{bail, Context};
use serde_json::{json, Value};

use crate::output::OutputFormat;

/// Sends one request; returns the `result` of a successful reply.
pub fn request(control: &Path, mut req: Value) -> anyhow::Result<Value> {
    let mut stream = UnixStream::connect(control)
        .with_context(|| format!("connecting to the control socket {}", control.display()))?;
    req["id"] = json!(1);
    let mut line = req.to_string();
    line.push('\n');
    stream.write_all(line.as_bytes())?;
    let mut reply = String::new();
    BufReader::new(stream).read_line(&mut reply)?;
    let reply: Value = serde_json::from_str(&reply).context("reply is not JSON")?;
    if reply["ok"] == json!(true) {
        Ok(reply["result"].clone())
    } else {
        bail!(
            "{}: {}",
            reply["error"]["kind"].as_str().unwrap_or("error"),
            reply["error"]["message"].as_str().unwrap_or("")
        )
    }
}

fn print(value: &Value, output: OutputFormat) -> anyhow::Result<()> {
    match output {
        OutputFormat::Json => println!("{}", serde_json::to_string_pretty(value)?),
        OutputFormat::Human => {
            if let Value::Object(map) = value {
                for (k, v) in map {
                    match v {
                        Value::Object(_) | Value::Array(_) => println!("{k}: {v}"),
                        Value::String(s) => println!("{k}: {s}"),
                        other => println!("{k}: {other}"),
                    }
                }
            }
        }
    }
    Ok(())
}

pub fn snapshot(control: &Path, new: &Path, output: OutputFormat) -> anyhow::Result<()> {
    let new = std::path::absolute(new)?;
    let r = request(control, json!({"command": "snapshot", "path": new}))?;
    print(&r, output)
}

pub fn info(control: &Path, output: OutputFormat) -> anyhow::Result<()> {
    print(&request(control, json!({"command": "info"}))?, output)
}

/// Arguments of `sqcow2 stats`.
#[derive(Debug, clap::Args)]
pub struct StatsArgs {
    /// Output format: human, json, or prometheus (text exposition format).
    #[arg(long, default_value = "human")]
    output: String,
    /// Print again every SECONDS until interrupted.
    #[arg(long)]
    watch: Option<f64>,
    /// The daemon's control socket.
    control: std::path::PathBuf,
}

pub fn stats(args: &StatsArgs) -> anyhow::Result<()> {
    loop {
        match args.output.as_str() {
            "prometheus" => {
                let r = request(
                    &args.control,
                    json!({"command": "stats", "format": "prometheus"}),
                )?;
                print!("{}", r["text"].as_str().unwrap_or(""));
            }
            "json" => print(
                &request(&args.control, json!({"command": "stats"}))?,
                OutputFormat::Json,
            )?,
            "human" => print(
                &request(&args.control, json!({"command": "stats"}))?,
                OutputFormat::Human,
            )?,
            other => bail!("unknown output format {other}"),
        }
        std::io::stdout().flush()?;
        match args.watch {
            Some(s) if s > 0.0 => std::thread::sleep(Duration::from_secs_f64(s)),
            _ => return Ok(()),
        }
    }
}
