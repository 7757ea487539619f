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

/// Parses a size like qemu-img and qemu-io: bytes, or with a suffix
/// `k`/`K`, `M`, `G`, `T`, `P`, `E` (powers of 1024), optionally `B`/`b`
/// for bytes.
pub fn parse_size(s: &str) -> anyhow::Result<u64> {
    let t = s.trim();
    let (num, mult) = match t.chars().last() {
        Some('k' | 'K') => (&t[..t.len() - 1], 1u64 << 10),
        Some('m' | 'M') => (&t[..t.len() - 1], 1 << 20),
        Some('g' | 'G') => (&t[..t.len() - 1], 1 << 30),
        Some('t' | 'T') => (&t[..t.len() - 1], 1 << 40),
        Some('p' | 'P') => (&t[..t.len() - 1], 1 << 50),
        Some('e' | 'E') => (&t[..t.len() - 1], 1 << 60),
        Some('b' | 'B') => (&t[..t.len() - 1], 1),
        _ => (t, 1),
    };
    let value: u64 = if let Some(hex) = num.strip_prefix("0x") {
        u64::from_str_radix(hex, 16)?
    } else if num.contains('.') {
        let f: f64 = num.parse()?;
        anyhow::ensure!(f >= 0.0, "negative size {s:?}");
        return Ok((f * mult as f64) as u64);
    } else {
        num.parse()
            .map_err(|_| anyhow::anyhow!("invalid size {s:?}"))?
    };
    value
        .checked_mul(mult)
        .ok_or_else(|| anyhow::anyhow!("size {s:?} too large"))
}

#[cfg(test)]
mod size_tests {
    use super::parse_size;

    #[test]
    fn sizes_with_suffixes() {
        assert_eq!(parse_size("512").unwrap(), 512);
        assert_eq!(parse_size("64k").unwrap(), 65536);
        assert_eq!(parse_size("1M").unwrap(), 1 << 20);
        assert_eq!(parse_size("1.5G").unwrap(), 3 << 29);
        assert_eq!(parse_size("0x200").unwrap(), 512);
        assert!(parse_size("-1").is_err());
        assert!(parse_size("abc").is_err());
        assert!(parse_size("99999999999E").is_err());
    }
}
