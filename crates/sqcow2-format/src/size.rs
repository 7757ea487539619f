//! Sizes written the way qemu-img and qemu-io take them.

/// A size that cannot be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SizeError {
    /// Not a number with an optional suffix.
    #[error("invalid size {0:?}")]
    Invalid(String),
    /// Does not fit 64 bits.
    #[error("size {0:?} too large")]
    TooLarge(String),
}

/// Parses a size like qemu-img and qemu-io: bytes, or with a suffix
/// `k`/`K`, `M`, `G`, `T`, `P`, `E` (powers of 1024), optionally `B`/`b`
/// for bytes; a hexadecimal `0x...` or a decimal fraction (`1.5G`).
pub fn parse_size(s: &str) -> Result<u64, SizeError> {
    let invalid = || SizeError::Invalid(s.to_string());
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
    if let Some(hex) = num.strip_prefix("0x") {
        let v = u64::from_str_radix(hex, 16).map_err(|_| invalid())?;
        return v
            .checked_mul(mult)
            .ok_or_else(|| SizeError::TooLarge(s.to_string()));
    }
    if num.contains('.') {
        let f: f64 = num.parse().map_err(|_| invalid())?;
        if f.is_nan() || f < 0.0 {
            return Err(invalid());
        }
        let bytes = f * mult as f64;
        if bytes >= u64::MAX as f64 {
            return Err(SizeError::TooLarge(s.to_string()));
        }
        return Ok(bytes as u64);
    }
    let v: u64 = num.parse().map_err(|_| invalid())?;
    v.checked_mul(mult)
        .ok_or_else(|| SizeError::TooLarge(s.to_string()))
}

#[cfg(test)]
mod tests {
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
        assert!(parse_size("-1.5G").is_err());
    }
}
