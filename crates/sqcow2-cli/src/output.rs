//! Output formats and human-readable sizes shared by the read-out commands.

/// How a read-out command prints its result.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OutputFormat {
    /// Text for people.
    Human,
    /// JSON for programs, with `qemu-img`'s field names where it has them.
    Json,
}

/// Writes `value` as pretty JSON and a newline.
pub fn print_json(
    out: &mut impl std::io::Write,
    value: &impl serde::Serialize,
) -> anyhow::Result<()> {
    serde_json::to_writer_pretty(&mut *out, value)?;
    writeln!(out)?;
    Ok(())
}

/// A size the way qemu-img prints it: `1 GiB`, `196 KiB`, `512 B`.
pub fn human_size(bytes: u64) -> String {
    const UNITS: [&str; 7] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        let s = format!("{value:.3}");
        let s = s.trim_end_matches('0').trim_end_matches('.');
        format!("{s} {}", UNITS[unit])
    }
}

/// Parses a size like qemu-img and qemu-io (see
/// [`sqcow2_format::parse_size`]).
pub fn parse_size(s: &str) -> anyhow::Result<u64> {
    Ok(sqcow2_format::parse_size(s)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(human_size(512), "512 B");
        assert_eq!(human_size(1 << 30), "1 GiB");
        assert_eq!(human_size(196 * 1024), "196 KiB");
        assert_eq!(human_size(1536), "1.5 KiB");
    }
}
