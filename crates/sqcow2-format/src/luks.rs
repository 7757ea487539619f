//! What `qemu-img info` shows of the LUKS header of an encrypted qcow2
//! image (the header only: sqcow2 does not decrypt). LUKS1 on-disk
//! format: a 592-byte header of fixed fields and eight key slots.

use serde::Serialize;

use crate::bytes::be_u32;
use crate::error::ErrorKind;
use crate::storage::Storage;

/// Bytes of the LUKS1 header proper.
const HEADER_LEN: usize = 592;
/// Where the key slots start, and each one's length.
const SLOTS_AT: usize = 208;
const SLOT_LEN: usize = 48;
/// A key slot in use.
const SLOT_ACTIVE: u32 = 0x00ac_71f3;
/// LUKS sectors.
const SECTOR: u64 = 512;

/// One key slot, with QEMU's field names.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct LuksSlot {
    /// Whether a key is stored in it.
    pub active: bool,
    /// PBKDF2 iterations (active slots).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub iters: Option<u32>,
    /// Where its key material starts, in bytes.
    pub key_offset: u64,
    /// Anti-forensic stripes (active slots).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stripes: Option<u32>,
}

/// The LUKS header, as QEMU's `QCryptoBlockInfoLUKS` shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct LuksInfo {
    /// IV generator (`plain64`, `essiv`, ...).
    pub ivgen_alg: String,
    /// Hash of the key derivation.
    pub hash_alg: String,
    /// Cipher and key size (`aes-256`).
    pub cipher_alg: String,
    /// The header's UUID.
    pub uuid: String,
    /// The IV generator's hash, for `essiv`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ivgen_hash_alg: Option<String>,
    /// Always `luks`.
    pub format: &'static str,
    /// Block cipher mode (`xts`, `cbc`).
    pub cipher_mode: String,
    /// The eight key slots.
    pub slots: Vec<LuksSlot>,
    /// Where the encrypted payload would start, in bytes.
    pub payload_offset: u64,
    /// PBKDF2 iterations of the master key digest.
    pub master_key_iters: u32,
}

/// A NUL-terminated string field.
fn text(bytes: &[u8]) -> String {
    let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
    String::from_utf8_lossy(&bytes[..end]).into_owned()
}

/// Reads the LUKS header at `offset` (`len` bytes long) of `storage`.
pub fn read_luks(storage: &dyn Storage, offset: u64, len: u64) -> Result<LuksInfo, ErrorKind> {
    let bad = |reason: &str| ErrorKind::InvalidHeader {
        field: "luks",
        reason: reason.to_string(),
    };
    if len < HEADER_LEN as u64 {
        return Err(bad("the LUKS header is shorter than 592 bytes"));
    }
    if offset
        .checked_add(HEADER_LEN as u64)
        .is_none_or(|end| end > storage.len().unwrap_or(0))
    {
        return Err(bad("the LUKS header lies past the end of the file"));
    }
    let mut h = vec![0u8; HEADER_LEN];
    storage.read_at(&mut h, offset)?;
    if &h[..6] != b"LUKS\xba\xbe" {
        return Err(bad("no LUKS magic"));
    }
    if u16::from_be_bytes([h[6], h[7]]) != 1 {
        return Err(bad("not LUKS version 1"));
    }
    let cipher = text(&h[8..40]);
    let mode = text(&h[40..72]);
    let hash = text(&h[72..104]);
    let key_bytes = be_u32(&h, 108);
    // "xts-plain64", "cbc-essiv:sha256": the mode, then its IV generator.
    let (cipher_mode, ivgen) = mode.split_once('-').unwrap_or((mode.as_str(), "plain"));
    let (ivgen_alg, ivgen_hash_alg) = match ivgen.split_once(':') {
        Some((alg, hash)) => (alg.to_string(), Some(hash.to_string())),
        None => (ivgen.to_string(), None),
    };
    // XTS splits the key in two.
    let key_bits = key_bytes * 8 / if cipher_mode == "xts" { 2 } else { 1 };
    let cipher_alg = match cipher.as_str() {
        "aes" | "twofish" | "serpent" | "cast5" => format!("{cipher}-{key_bits}"),
        other => other.to_string(),
    };
    let slots = (0..8)
        .map(|i| {
            let s = &h[SLOTS_AT + i * SLOT_LEN..SLOTS_AT + (i + 1) * SLOT_LEN];
            let active = be_u32(s, 0) == SLOT_ACTIVE;
            LuksSlot {
                active,
                iters: active.then(|| be_u32(s, 4)),
                key_offset: u64::from(be_u32(s, 40)) * SECTOR,
                stripes: active.then(|| be_u32(s, 44)),
            }
        })
        .collect();
    Ok(LuksInfo {
        ivgen_alg,
        ivgen_hash_alg,
        hash_alg: hash,
        cipher_alg,
        uuid: text(&h[168..208]),
        format: "luks",
        cipher_mode: cipher_mode.to_string(),
        slots,
        payload_offset: u64::from(be_u32(&h, 104)) * SECTOR,
        master_key_iters: be_u32(&h, 164),
    })
}
