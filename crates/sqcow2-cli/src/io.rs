//! `sqcow2 io`: qemu-io's `read`, `write`, `discard` and `flush` commands,
//! with its syntax and output lines, so scripts run unchanged on this subset.

use std::io::Write;
use std::path::Path;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{bail, Context};
use sqcow2_format::{Chain, ChainOptions};

use crate::output::{human_size, parse_size};

/// One parsed command.
#[derive(Debug, PartialEq)]
enum Cmd {
    Read {
        pattern: Option<u8>,
        offset: u64,
        len: u64,
    },
    Write {
        pattern: u8,
        zero: bool,
        unmap: bool,
        offset: u64,
        len: u64,
    },
    Discard {
        offset: u64,
        len: u64,
    },
    Flush,
}

/// A pattern byte, 0 to 255 in decimal or hex (as qemu-io takes it).
fn parse_pattern(s: &str) -> anyhow::Result<u8> {
    let v = match s.strip_prefix("0x") {
        Some(h) => u8::from_str_radix(h, 16).ok(),
        None => s.parse().ok(),
    };
    v.with_context(|| format!("{s} is not a valid pattern byte"))
}

/// A command and whether it runs quietly (`-q`: no report of what was
/// done, as qemu-io; failures are still reported).
fn parse(cmd: &str) -> anyhow::Result<(Cmd, bool)> {
    let mut words = cmd.split_whitespace();
    let name = words.next().context("empty command")?;
    let mut pattern = None;
    let (mut zero, mut unmap, mut quiet) = (false, false, false);
    let mut args = Vec::new();
    let mut rest = words.peekable();
    while let Some(w) = rest.next() {
        match w {
            "-P" => pattern = Some(parse_pattern(rest.next().context("-P needs a pattern")?)?),
            "-z" => zero = true,
            "-u" => unmap = true,
            "-q" => quiet = true,
            _ if w.starts_with('-') && w.len() > 1 && !w[1..].starts_with(char::is_numeric) => {
                bail!("{name}: unsupported option {w}")
            }
            _ => args.push(w),
        }
    }
    let range = |args: &[&str]| -> anyhow::Result<(u64, u64)> {
        match args {
            [o, l] => Ok((parse_size(o)?, parse_size(l)?)),
            _ => bail!("{name}: expected OFFSET LENGTH"),
        }
    };
    let cmd = match name {
        "read" => {
            let (offset, len) = range(&args)?;
            Cmd::Read {
                pattern,
                offset,
                len,
            }
        }
        "write" => {
            let (offset, len) = range(&args)?;
            if unmap && !zero {
                bail!("write: -u needs -z");
            }
            Cmd::Write {
                pattern: pattern.unwrap_or(0xcd),
                zero,
                unmap,
                offset,
                len,
            }
        }
        "discard" => {
            let (offset, len) = range(&args)?;
            Cmd::Discard { offset, len }
        }
        "flush" => Cmd::Flush,
        other => bail!("command {other:?} is not supported (read, write, discard, flush)"),
    };
    Ok((cmd, quiet))
}

fn stats(out: &mut dyn Write, len: u64, start: Instant) -> std::io::Result<()> {
    let secs = start.elapsed().as_secs_f64().max(1e-9);
    writeln!(
        out,
        "{}, 1 ops; {:05.2} sec ({}/sec and {:.4} ops/sec)",
        human_size(len),
        secs,
        human_size((len as f64 / secs) as u64),
        1.0 / secs
    )
}

/// Runs `cmd`; `Ok(false)` if a read found other bytes than its
/// pattern. What was done is reported on `out`, unless `quiet`.
fn execute(chain: &Chain, cmd: &Cmd, quiet: bool, out: &mut dyn Write) -> anyhow::Result<bool> {
    let mut sink = std::io::sink();
    let done: &mut dyn Write = if quiet { &mut sink } else { &mut *out };
    let start = Instant::now();
    match *cmd {
        Cmd::Read {
            pattern,
            offset,
            len,
        } => {
            let mut buf = vec![0u8; usize::try_from(len)?];
            chain.read_at(&mut buf, offset)?;
            if let Some(p) = pattern {
                if let Some(bad) = buf.iter().position(|&b| b != p) {
                    let n = buf[bad..].iter().take_while(|&&b| b != p).count();
                    writeln!(
                        out,
                        "Pattern verification failed at offset {}, {n} bytes",
                        offset + bad as u64
                    )?;
                    return Ok(false);
                }
            }
            writeln!(done, "read {len}/{len} bytes at offset {offset}")?;
            stats(done, len, start)?;
        }
        Cmd::Write {
            pattern,
            zero,
            unmap,
            offset,
            len,
        } => {
            if zero {
                chain.write_zeroes(offset, len, unmap)?;
            } else {
                chain.write_at(&vec![pattern; usize::try_from(len)?], offset)?;
            }
            writeln!(done, "wrote {len}/{len} bytes at offset {offset}")?;
            stats(done, len, start)?;
        }
        Cmd::Discard { offset, len } => {
            chain.discard(offset, len)?;
            writeln!(done, "discard {len}/{len} bytes at offset {offset}")?;
            stats(done, len, start)?;
        }
        Cmd::Flush => chain.flush()?,
    }
    Ok(true)
}

/// Runs `sqcow2 io`: every command in order; exit code 1 if one failed.
pub fn run(
    image: &Path,
    commands: &[String],
    read_only: bool,
    options: &ChainOptions,
) -> anyhow::Result<ExitCode> {
    // As qemu-io: a command that does not parse is reported when its turn
    // comes, and the others still run (exit code 1).
    let cmds: Vec<(&String, anyhow::Result<(Cmd, bool)>)> =
        commands.iter().map(|c| (c, parse(c))).collect();
    let writes = cmds
        .iter()
        .any(|(_, c)| matches!(c, Ok((c, _)) if !matches!(c, Cmd::Read { .. })));
    if writes && read_only {
        bail!(
            "{}: write commands on an image opened with -r",
            image.display()
        );
    }
    let options = ChainOptions {
        writable: writes,
        ..options.clone()
    };
    let chain = Chain::open(image, &options)?;
    let mut out = std::io::stdout().lock();
    let mut ok = true;
    for (text, parsed) in &cmds {
        let (cmd, quiet) = match parsed {
            Ok(parsed) => parsed,
            Err(e) => {
                out.flush()?;
                eprintln!("sqcow2: command {text:?}: {e:#}");
                ok = false;
                continue;
            }
        };
        match execute(&chain, cmd, *quiet, &mut out) {
            Ok(true) => {}
            Ok(false) => ok = false,
            Err(e) => {
                let verb = match cmd {
                    Cmd::Read { .. } => "read",
                    Cmd::Write { .. } => "write",
                    Cmd::Discard { .. } => "discard",
                    Cmd::Flush => "flush",
                };
                writeln!(out, "{verb} failed: {e:#}")?;
                ok = false;
            }
        }
    }
    chain.close()?;
    Ok(if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qemu_io_syntax() {
        assert_eq!(
            parse("write -P 0x5a 64k 1M").unwrap().0,
            Cmd::Write {
                pattern: 0x5a,
                zero: false,
                unmap: false,
                offset: 65536,
                len: 1 << 20
            }
        );
        assert_eq!(
            parse("write -z -u 0 4096").unwrap().0,
            Cmd::Write {
                pattern: 0xcd,
                zero: true,
                unmap: true,
                offset: 0,
                len: 4096
            }
        );
        assert_eq!(
            parse("read -P 7 512 512").unwrap().0,
            Cmd::Read {
                pattern: Some(7),
                offset: 512,
                len: 512
            }
        );
        assert_eq!(
            parse("discard 0 1M").unwrap().0,
            Cmd::Discard {
                offset: 0,
                len: 1 << 20
            }
        );
        assert_eq!(parse("flush").unwrap(), (Cmd::Flush, false));
        assert!(parse("write -q 0 512").unwrap().1);
        // Pattern bytes as qemu-io takes them: 0-255, decimal or hex.
        assert!(parse("write -P 255 0 512").is_ok());
        for bad in ["300", "0x1ff", "-1", "x"] {
            let e = parse(&format!("write -P {bad} 0 512")).unwrap_err();
            assert!(
                format!("{e:#}").contains("not a valid pattern byte"),
                "{bad}: {e:#}"
            );
        }
        assert!(parse("write -u 0 1").is_err());
        assert!(parse("truncate 1M").is_err());
        assert!(parse("read 0").is_err());
    }
}
