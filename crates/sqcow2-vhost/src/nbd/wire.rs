//! The NBD protocol's bytes (`doc/proto.md` of the NBD project, as
//! qemu-nbd speaks it): the fixed newstyle handshake's options, the
//! transmission phase's requests, parsed into validated types, and the
//! replies (simple and structured) encoded.

use std::io::{self, Read, Write};

pub(crate) const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
pub(crate) const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
const OPTION_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
const REQUEST_MAGIC: u32 = 0x2560_9513;
const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

/// Handshake flags the server sends.
pub(crate) const FLAG_FIXED_NEWSTYLE: u16 = 1;
pub(crate) const FLAG_NO_ZEROES: u16 = 2;
/// Client flags it may send back.
pub(crate) const FLAG_C_FIXED_NEWSTYLE: u32 = 1;
pub(crate) const FLAG_C_NO_ZEROES: u32 = 2;

/// Options.
pub(crate) const OPT_EXPORT_NAME: u32 = 1;
pub(crate) const OPT_ABORT: u32 = 2;
pub(crate) const OPT_LIST: u32 = 3;
pub(crate) const OPT_INFO: u32 = 6;
pub(crate) const OPT_GO: u32 = 7;
pub(crate) const OPT_STRUCTURED_REPLY: u32 = 8;
pub(crate) const OPT_LIST_META_CONTEXT: u32 = 9;
pub(crate) const OPT_SET_META_CONTEXT: u32 = 10;

/// Option replies.
pub(crate) const REP_ACK: u32 = 1;
pub(crate) const REP_SERVER: u32 = 2;
pub(crate) const REP_INFO: u32 = 3;
pub(crate) const REP_META_CONTEXT: u32 = 4;
pub(crate) const REP_ERR_UNSUP: u32 = (1 << 31) + 1;
pub(crate) const REP_ERR_INVALID: u32 = (1 << 31) + 3;
pub(crate) const REP_ERR_UNKNOWN: u32 = (1 << 31) + 6;

/// `NBD_REP_INFO` kinds.
pub(crate) const INFO_EXPORT: u16 = 0;
pub(crate) const INFO_BLOCK_SIZE: u16 = 3;

/// Transmission flags.
pub(crate) const TF_HAS_FLAGS: u16 = 1;
pub(crate) const TF_READ_ONLY: u16 = 2;
pub(crate) const TF_SEND_FLUSH: u16 = 4;
pub(crate) const TF_SEND_FUA: u16 = 8;
pub(crate) const TF_SEND_TRIM: u16 = 32;
pub(crate) const TF_SEND_WRITE_ZEROES: u16 = 64;
pub(crate) const TF_CAN_MULTI_CONN: u16 = 256;

/// Command flags.
pub(crate) const CMD_FLAG_FUA: u16 = 1;
pub(crate) const CMD_FLAG_NO_HOLE: u16 = 2;
pub(crate) const CMD_FLAG_DF: u16 = 4;
pub(crate) const CMD_FLAG_REQ_ONE: u16 = 8;
pub(crate) const CMD_FLAG_FAST_ZERO: u16 = 16;

/// Structured reply chunk types and flags.
const REPLY_FLAG_DONE: u16 = 1;
const REPLY_TYPE_NONE: u16 = 0;
const REPLY_TYPE_OFFSET_DATA: u16 = 1;
const REPLY_TYPE_OFFSET_HOLE: u16 = 2;
const REPLY_TYPE_BLOCK_STATUS: u16 = 5;
const REPLY_TYPE_ERROR: u16 = (1 << 15) + 1;

/// Errors (errno values on the wire).
pub(crate) const EPERM: u32 = 1;
pub(crate) const EIO: u32 = 5;
pub(crate) const EINVAL: u32 = 22;
pub(crate) const ENOSPC: u32 = 28;
pub(crate) const ENOTSUP: u32 = 95;

/// The longest option a client may send (qemu-nbd's limit is alike).
pub(crate) const MAX_OPTION: u32 = 64 << 10;
/// The longest read or write (qemu-nbd's `NBD_MAX_BUFFER_SIZE`).
pub(crate) const MAX_PAYLOAD: u32 = 32 << 20;
/// The longest string in an option (name, query).
pub(crate) const MAX_STRING: u32 = 4096;

/// One option the client sent.
#[derive(Debug)]
pub(crate) struct ClientOption {
    pub(crate) option: u32,
    pub(crate) data: Vec<u8>,
}

/// Reads the next option; an error when its framing is broken (the
/// connection is closed then) or it is longer than [`MAX_OPTION`].
pub(crate) fn read_option(r: &mut impl Read) -> io::Result<ClientOption> {
    let mut head = [0u8; 16];
    r.read_exact(&mut head)?;
    if be64(&head[0..8]) != IHAVEOPT {
        return Err(invalid("an option without IHAVEOPT"));
    }
    let option = be32(&head[8..12]);
    let len = be32(&head[12..16]);
    if len > MAX_OPTION {
        return Err(invalid("option too long"));
    }
    let mut data = vec![0u8; len as usize];
    r.read_exact(&mut data)?;
    Ok(ClientOption { option, data })
}

/// Writes an option reply.
pub(crate) fn option_reply(
    w: &mut impl Write,
    option: u32,
    kind: u32,
    data: &[u8],
) -> io::Result<()> {
    let mut out = Vec::with_capacity(20 + data.len());
    out.extend_from_slice(&OPTION_REPLY_MAGIC.to_be_bytes());
    out.extend_from_slice(&option.to_be_bytes());
    out.extend_from_slice(&kind.to_be_bytes());
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    out.extend_from_slice(data);
    w.write_all(&out)
}

/// A cursor over an option's data, failing on a short read.
pub(crate) struct Fields<'a> {
    data: &'a [u8],
}

impl<'a> Fields<'a> {
    pub(crate) fn new(data: &'a [u8]) -> Self {
        Fields { data }
    }

    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.data.len() < n {
            return None;
        }
        let (head, rest) = self.data.split_at(n);
        self.data = rest;
        Some(head)
    }

    pub(crate) fn u16(&mut self) -> Option<u16> {
        self.take(2).map(|b| u16::from_be_bytes([b[0], b[1]]))
    }

    pub(crate) fn u32(&mut self) -> Option<u32> {
        self.take(4).map(be32)
    }

    /// A `u32` length and that many bytes of UTF-8, at most
    /// [`MAX_STRING`].
    pub(crate) fn string(&mut self) -> Option<String> {
        let len = self.u32()?;
        if len > MAX_STRING {
            return None;
        }
        String::from_utf8(self.take(len as usize)?.to_vec()).ok()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.data.is_empty()
    }
}

/// A transmission request's command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Cmd {
    Read,
    Write,
    Disconnect,
    Flush,
    Trim,
    Cache,
    WriteZeroes,
    BlockStatus,
    Unknown(u16),
}

/// One request.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Request {
    pub(crate) flags: u16,
    pub(crate) cmd: Cmd,
    pub(crate) cookie: u64,
    pub(crate) offset: u64,
    pub(crate) len: u32,
}

/// Reads the next request header (a write's data follows it).
pub(crate) fn read_request(r: &mut impl Read) -> io::Result<Request> {
    let mut b = [0u8; 28];
    r.read_exact(&mut b)?;
    if be32(&b[0..4]) != REQUEST_MAGIC {
        return Err(invalid("bad request magic"));
    }
    let cmd = match u16::from_be_bytes([b[6], b[7]]) {
        0 => Cmd::Read,
        1 => Cmd::Write,
        2 => Cmd::Disconnect,
        3 => Cmd::Flush,
        4 => Cmd::Trim,
        5 => Cmd::Cache,
        6 => Cmd::WriteZeroes,
        7 => Cmd::BlockStatus,
        other => Cmd::Unknown(other),
    };
    Ok(Request {
        flags: u16::from_be_bytes([b[4], b[5]]),
        cmd,
        cookie: be64(&b[8..16]),
        offset: be64(&b[16..24]),
        len: be32(&b[24..28]),
    })
}

/// A simple reply (`data` for a read's payload).
pub(crate) fn simple_reply(
    w: &mut impl Write,
    cookie: u64,
    error: u32,
    data: &[u8],
) -> io::Result<()> {
    let mut head = [0u8; 16];
    head[0..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
    head[4..8].copy_from_slice(&error.to_be_bytes());
    head[8..16].copy_from_slice(&cookie.to_be_bytes());
    w.write_all(&head)?;
    w.write_all(data)
}

/// The flags of a chunk: `DONE` on the reply's last.
fn last_flag(last: bool) -> u16 {
    if last {
        REPLY_FLAG_DONE
    } else {
        0
    }
}

fn chunk_head(flags: u16, kind: u16, cookie: u64, len: u32) -> [u8; 20] {
    let mut h = [0u8; 20];
    h[0..4].copy_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
    h[4..6].copy_from_slice(&flags.to_be_bytes());
    h[6..8].copy_from_slice(&kind.to_be_bytes());
    h[8..16].copy_from_slice(&cookie.to_be_bytes());
    h[16..20].copy_from_slice(&len.to_be_bytes());
    h
}

/// A structured reply's last chunk with nothing in it.
pub(crate) fn done(w: &mut impl Write, cookie: u64) -> io::Result<()> {
    w.write_all(&chunk_head(REPLY_FLAG_DONE, REPLY_TYPE_NONE, cookie, 0))
}

/// An `OFFSET_DATA` chunk.
pub(crate) fn data_chunk(
    w: &mut impl Write,
    cookie: u64,
    last: bool,
    offset: u64,
    data: &[u8],
) -> io::Result<()> {
    let flags = last_flag(last);
    w.write_all(&chunk_head(
        flags,
        REPLY_TYPE_OFFSET_DATA,
        cookie,
        8 + data.len() as u32,
    ))?;
    w.write_all(&offset.to_be_bytes())?;
    w.write_all(data)
}

/// An `OFFSET_HOLE` chunk.
pub(crate) fn hole_chunk(
    w: &mut impl Write,
    cookie: u64,
    last: bool,
    offset: u64,
    len: u32,
) -> io::Result<()> {
    let flags = last_flag(last);
    let mut out = chunk_head(flags, REPLY_TYPE_OFFSET_HOLE, cookie, 12).to_vec();
    out.extend_from_slice(&offset.to_be_bytes());
    out.extend_from_slice(&len.to_be_bytes());
    w.write_all(&out)
}

/// A `BLOCK_STATUS` chunk of context `id`: `(length, flags)` descriptors.
pub(crate) fn status_chunk(
    w: &mut impl Write,
    cookie: u64,
    last: bool,
    id: u32,
    extents: &[(u32, u32)],
) -> io::Result<()> {
    let flags = last_flag(last);
    let len = 4 + 8 * extents.len() as u32;
    let mut out = chunk_head(flags, REPLY_TYPE_BLOCK_STATUS, cookie, len).to_vec();
    out.extend_from_slice(&id.to_be_bytes());
    for (l, f) in extents {
        out.extend_from_slice(&l.to_be_bytes());
        out.extend_from_slice(&f.to_be_bytes());
    }
    w.write_all(&out)
}

/// An `ERROR` chunk, the reply's last.
pub(crate) fn error_chunk(
    w: &mut impl Write,
    cookie: u64,
    error: u32,
    message: &str,
) -> io::Result<()> {
    let msg = &message.as_bytes()[..message.len().min(4096)];
    let mut out = chunk_head(
        REPLY_FLAG_DONE,
        REPLY_TYPE_ERROR,
        cookie,
        6 + msg.len() as u32,
    )
    .to_vec();
    out.extend_from_slice(&error.to_be_bytes());
    out.extend_from_slice(&(msg.len() as u16).to_be_bytes());
    out.extend_from_slice(msg);
    w.write_all(&out)
}

fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}

fn be64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_be_bytes(a)
}

fn invalid(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.to_string())
}
