//! One NBD client: the fixed newstyle handshake, then its requests
//! served on the chain the daemon serves (through the request gate, so
//! that a live snapshot's or a merge's pause waits for them as for the
//! guest's).

use std::io::{BufReader, BufWriter, Read, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::Duration;

use sqcow2_format::{Chain, ExtentKind, GuestOffset};

use super::contexts::Context;
use super::wire::{self, Cmd, Fields, Request};
use super::Export;
use crate::daemon::control::Shared;
use crate::device::handle::gate::Admission;

/// Most options before the transmission phase.
const MAX_OPTIONS: usize = 1024;

/// What the handshake settled.
struct Negotiated {
    structured: bool,
    contexts: Vec<(u32, Context)>,
    /// The export chosen.
    target: Target,
}

/// An export: the live disk, or a point-in-time one.
#[derive(Clone)]
enum Target {
    Live,
    Frozen(Arc<Chain>),
}

impl Target {
    /// The export named `name`, if there is one.
    fn named(shared: &Shared, export: &Export, name: &str) -> Option<Target> {
        if name == export.name {
            return Some(Target::Live);
        }
        shared.frozen.get(name).map(Target::Frozen)
    }

    /// The chain it reads now.
    fn chain(&self, shared: &Shared) -> Arc<Chain> {
        match self {
            Target::Live => shared.handle.get(),
            Target::Frozen(c) => c.clone(),
        }
    }

    fn writable(&self, export: &Export) -> bool {
        matches!(self, Target::Live) && export.writable
    }
}

/// Serves one client on `stream` until it disconnects or breaks the
/// protocol (an error it cannot be told of ends the connection; every
/// other client and the guest go on).
pub(crate) fn serve(
    reader: impl Read,
    writer: impl Write + Send,
    shared: &Arc<Shared>,
    export: &Export,
    workers: usize,
) -> std::io::Result<()> {
    let mut w = BufWriter::new(writer);
    let mut r = BufReader::new(reader);
    let Some(negotiated) = handshake(&mut r, &mut w, shared, export)? else {
        return Ok(());
    };
    transmission(&mut r, &mut w, shared, export, &negotiated, workers)
}

fn handshake(
    r: &mut impl Read,
    w: &mut impl Write,
    shared: &Shared,
    export: &Export,
) -> std::io::Result<Option<Negotiated>> {
    w.write_all(&wire::NBDMAGIC.to_be_bytes())?;
    w.write_all(&wire::IHAVEOPT.to_be_bytes())?;
    w.write_all(&(wire::FLAG_FIXED_NEWSTYLE | wire::FLAG_NO_ZEROES).to_be_bytes())?;
    w.flush()?;
    let mut flags = [0u8; 4];
    r.read_exact(&mut flags)?;
    let client = u32::from_be_bytes(flags);
    if client & !(wire::FLAG_C_FIXED_NEWSTYLE | wire::FLAG_C_NO_ZEROES) != 0 {
        return Ok(None);
    }
    let no_zeroes = client & wire::FLAG_C_NO_ZEROES != 0;
    let mut n = Negotiated {
        structured: false,
        contexts: Vec::new(),
        target: Target::Live,
    };
    for _ in 0..MAX_OPTIONS {
        // Every reply out before the next option is awaited (an error
        // reply left buffered hung nbdinfo on an unknown export).
        w.flush()?;
        let opt = wire::read_option(r)?;
        let o = opt.option;
        match o {
            wire::OPT_EXPORT_NAME => {
                let name = String::from_utf8_lossy(&opt.data);
                let Some(target) = Target::named(shared, export, &name) else {
                    return Ok(None);
                };
                let chain = target.chain(shared);
                w.write_all(&chain.virtual_size().to_be_bytes())?;
                w.write_all(&transmission_flags(target.writable(export)).to_be_bytes())?;
                n.target = target;
                if !no_zeroes {
                    w.write_all(&[0u8; 124])?;
                }
                w.flush()?;
                return Ok(Some(n));
            }
            wire::OPT_ABORT => {
                wire::option_reply(w, o, wire::REP_ACK, &[])?;
                w.flush()?;
                return Ok(None);
            }
            wire::OPT_LIST if opt.data.is_empty() => {
                let mut d = (export.name.len() as u32).to_be_bytes().to_vec();
                d.extend_from_slice(export.name.as_bytes());
                wire::option_reply(w, o, wire::REP_SERVER, &d)?;
                wire::option_reply(w, o, wire::REP_ACK, &[])?;
            }
            wire::OPT_STRUCTURED_REPLY if opt.data.is_empty() => {
                n.structured = true;
                wire::option_reply(w, o, wire::REP_ACK, &[])?;
            }
            wire::OPT_LIST_META_CONTEXT | wire::OPT_SET_META_CONTEXT => {
                meta_context(w, &opt, shared, export, &mut n)?;
            }
            wire::OPT_INFO | wire::OPT_GO => {
                let mut f = Fields::new(&opt.data);
                let parsed = f.string().and_then(|name| {
                    let count = f.u16()?;
                    let asked: Option<Vec<u16>> = (0..count).map(|_| f.u16()).collect();
                    f.is_empty().then_some((name, asked?))
                });
                let Some((name, asked)) = parsed else {
                    reply_error(w, o, wire::REP_ERR_INVALID, "malformed request")?;
                    continue;
                };
                let Some(target) = Target::named(shared, export, &name) else {
                    reply_error(w, o, wire::REP_ERR_UNKNOWN, "no such export")?;
                    continue;
                };
                let chain = target.chain(shared);
                let mut info = wire::INFO_EXPORT.to_be_bytes().to_vec();
                info.extend_from_slice(&chain.virtual_size().to_be_bytes());
                info.extend_from_slice(&transmission_flags(target.writable(export)).to_be_bytes());
                wire::option_reply(w, o, wire::REP_INFO, &info)?;
                if asked.contains(&wire::INFO_BLOCK_SIZE) {
                    let mut b = wire::INFO_BLOCK_SIZE.to_be_bytes().to_vec();
                    for v in [1u32, 4096, wire::MAX_PAYLOAD] {
                        b.extend_from_slice(&v.to_be_bytes());
                    }
                    wire::option_reply(w, o, wire::REP_INFO, &b)?;
                }
                wire::option_reply(w, o, wire::REP_ACK, &[])?;
                if o == wire::OPT_GO {
                    w.flush()?;
                    n.target = target;
                    return Ok(Some(n));
                }
            }
            wire::OPT_LIST | wire::OPT_STRUCTURED_REPLY => {
                reply_error(w, o, wire::REP_ERR_INVALID, "this option takes no data")?;
            }
            _ => reply_error(w, o, wire::REP_ERR_UNSUP, "option not supported")?,
        }
        w.flush()?;
    }
    Ok(None)
}

fn reply_error(w: &mut impl Write, option: u32, kind: u32, message: &str) -> std::io::Result<()> {
    wire::option_reply(w, option, kind, message.as_bytes())
}

/// `NBD_OPT_LIST_META_CONTEXT` and `NBD_OPT_SET_META_CONTEXT`.
fn meta_context(
    w: &mut impl Write,
    opt: &wire::ClientOption,
    shared: &Shared,
    export: &Export,
    n: &mut Negotiated,
) -> std::io::Result<()> {
    let o = opt.option;
    let set = o == wire::OPT_SET_META_CONTEXT;
    if set && !n.structured {
        return reply_error(w, o, wire::REP_ERR_INVALID, "structured replies first");
    }
    let mut f = Fields::new(&opt.data);
    let parsed = f.string().and_then(|name| {
        let count = f.u32()?;
        let queries: Option<Vec<String>> = (0..count.min(1024)).map(|_| f.string()).collect();
        (f.is_empty()).then_some((name, queries?))
    });
    let Some((name, queries)) = parsed else {
        return reply_error(w, o, wire::REP_ERR_INVALID, "malformed request");
    };
    let Some(target) = Target::named(shared, export, &name) else {
        return reply_error(w, o, wire::REP_ERR_UNKNOWN, "no such export");
    };
    let chain = &*target.chain(shared);
    let mut chosen: Vec<Context> = Vec::new();
    if queries.is_empty() && !set {
        chosen = Context::all(chain);
    }
    for q in &queries {
        for c in Context::matching(chain, q, !set) {
            if !chosen.contains(&c) {
                chosen.push(c);
            }
        }
    }
    if set {
        n.contexts.clear();
    }
    for (k, c) in chosen.into_iter().enumerate() {
        let id = k as u32 + 1;
        let mut d = id.to_be_bytes().to_vec();
        d.extend_from_slice(c.name().as_bytes());
        wire::option_reply(w, o, wire::REP_META_CONTEXT, &d)?;
        if set {
            n.contexts.push((id, c));
        }
    }
    wire::option_reply(w, o, wire::REP_ACK, &[])
}

fn transmission_flags(writable: bool) -> u16 {
    let mut f =
        wire::TF_HAS_FLAGS | wire::TF_SEND_FLUSH | wire::TF_SEND_FUA | wire::TF_CAN_MULTI_CONN;
    if writable {
        f |= wire::TF_SEND_TRIM | wire::TF_SEND_WRITE_ZEROES;
    } else {
        f |= wire::TF_READ_ONLY;
    }
    f
}

/// Runs `work` on the target's chain: the served one while holding a
/// request permit (a pause waits for it; it waits for a pause), a
/// point-in-time one (immutable files) as it is.
fn on_chain<T>(shared: &Shared, target: &Target, work: impl FnOnce(&Chain) -> T) -> Result<T, u32> {
    if let Target::Frozen(chain) = target {
        return Ok(work(chain));
    }
    // Waits for a pause to end polling, from 200 µs up to 10 ms apart:
    // a switch's pause costs a request little, and the workers of every
    // client polling through a long one (an inactive daemon) cost the
    // pause holder and the CPU little.
    let mut wait = Duration::from_micros(200);
    loop {
        match shared.gate().try_start() {
            Admission::Start(permit) => {
                let chain = shared.handle.get();
                let out = work(&chain);
                drop(chain);
                drop(permit);
                return Ok(out);
            }
            Admission::Wait => {
                std::thread::sleep(wait);
                wait = (wait * 2).min(Duration::from_millis(10));
            }
            Admission::Refuse => return Err(wire::EIO),
        }
    }
}

fn errno_of(e: &sqcow2_format::Error) -> u32 {
    match &e.kind {
        sqcow2_format::ErrorKind::ReadOnly => wire::EPERM,
        sqcow2_format::ErrorKind::Io(io) if io.raw_os_error() == Some(28) => wire::ENOSPC,
        sqcow2_format::ErrorKind::OutOfRange { .. } => wire::EINVAL,
        _ => wire::EIO,
    }
}

/// Requests of one client served at a time at most (a backup tool keeps
/// many in flight on one connection to reach the disk's parallelism;
/// replies go out in the order they finish).
pub(crate) const WORKERS: usize = 8;

/// Bytes of data (a write's, a read's reply) one client may have in
/// flight at a time: the reader waits for them before it reads more.
const IN_FLIGHT_BYTES: u64 = 2 * wire::MAX_PAYLOAD as u64;

/// The transmission phase: requests read here in order (a write's data
/// with it), served by `workers` threads, each reply written whole.
/// Ends at a disconnect (requests read before it are answered first), a
/// broken request, or a client gone (its first failed reply returned).
fn transmission(
    r: &mut impl Read,
    w: &mut (impl Write + Send),
    shared: &Shared,
    export: &Export,
    n: &Negotiated,
    workers: usize,
) -> std::io::Result<()> {
    let out = Mutex::new(Replies { w, failed: None });
    let flow = Flow::default();
    let (tx, rx) = std::sync::mpsc::sync_channel::<(Request, Vec<u8>)>(workers);
    let rx = Mutex::new(rx);
    let read = std::thread::scope(|s| {
        // Owned here: dropped whichever way this ends, so that the
        // workers end too and the scope's join returns.
        let tx = tx;
        let mut started = 0;
        for _ in 0..workers {
            let work = || loop {
                let next = rx.lock().unwrap_or_else(PoisonError::into_inner).recv();
                let Ok((req, payload)) = next else { break };
                if !flow.gone.load(Ordering::Acquire) {
                    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        answer(shared, export, n, &req, &payload)
                    }))
                    .unwrap_or_else(|_| {
                        tracing::error!(cookie = req.cookie, "nbd: a request panicked: EIO");
                        Err((wire::EIO, "internal error".into()))
                    });
                    drop(payload);
                    // Held across the reply's socket write on purpose: the
                    // chunks of one reply must not interleave with
                    // another's (NBD's rule); nothing else waits on it
                    // but the other workers' replies.
                    let mut out = out.lock().unwrap_or_else(PoisonError::into_inner);
                    if !out.send(n, &req, outcome) {
                        flow.gone.store(true, Ordering::Release);
                    }
                }
                flow.release(cost(&req));
            };
            match std::thread::Builder::new()
                .name("nbd-worker".into())
                .spawn_scoped(s, work)
            {
                Ok(_) => started += 1,
                Err(e) => tracing::warn!("nbd: cannot start a worker: {e}"),
            }
        }
        if started == 0 {
            return Err(std::io::Error::other("no nbd worker thread could start"));
        }
        read_requests(r, &tx, &flow)
        // `tx` dropped here: the workers answer what is queued and end.
    });
    match out
        .into_inner()
        .unwrap_or_else(PoisonError::into_inner)
        .failed
    {
        Some(e) => Err(e),
        None => read,
    }
}

/// Bytes request `req` holds in flight: a write's data, a read's reply.
fn cost(req: &Request) -> u64 {
    match req.cmd {
        Cmd::Write | Cmd::Read if req.len <= wire::MAX_PAYLOAD => u64::from(req.len),
        _ => 0,
    }
}

/// What the reader and the workers of one client share.
#[derive(Default)]
struct Flow {
    /// Bytes in flight (at most [`IN_FLIGHT_BYTES`]).
    bytes: Mutex<u64>,
    freed: Condvar,
    /// A reply could not be written: nothing more is served.
    gone: AtomicBool,
}

impl Flow {
    /// Waits until `n` more bytes fit in flight, and takes them.
    fn take(&self, n: u64) {
        let mut bytes = self.bytes.lock().unwrap_or_else(PoisonError::into_inner);
        while *bytes > 0 && *bytes + n > IN_FLIGHT_BYTES {
            bytes = self
                .freed
                .wait(bytes)
                .unwrap_or_else(PoisonError::into_inner);
        }
        *bytes += n;
    }

    fn release(&self, n: u64) {
        if n == 0 {
            return;
        }
        let mut bytes = self.bytes.lock().unwrap_or_else(PoisonError::into_inner);
        *bytes = bytes.saturating_sub(n);
        drop(bytes);
        self.freed.notify_one();
    }
}

/// Reads requests and hands them to the workers until a disconnect, an
/// error, or the client is gone.
fn read_requests(
    r: &mut impl Read,
    tx: &std::sync::mpsc::SyncSender<(Request, Vec<u8>)>,
    flow: &Flow,
) -> std::io::Result<()> {
    loop {
        let req = wire::read_request(r)?;
        if req.cmd == Cmd::Write && req.len > wire::MAX_PAYLOAD {
            // Its data cannot be skipped safely: the connection ends.
            return Ok(());
        }
        if req.cmd == Cmd::Disconnect || flow.gone.load(Ordering::Acquire) {
            return Ok(());
        }
        flow.take(cost(&req));
        let mut payload = Vec::new();
        if req.cmd == Cmd::Write {
            payload.resize(req.len as usize, 0);
            if let Err(e) = r.read_exact(&mut payload) {
                flow.release(cost(&req));
                return Err(e);
            }
        }
        if let Err(back) = tx.send((req, payload)) {
            flow.release(cost(&back.0 .0));
            return Ok(());
        }
    }
}

/// The client's replies: written one whole reply at a time; the first
/// failure (the client gone) ends the writing.
struct Replies<'w, W: Write> {
    w: &'w mut W,
    failed: Option<std::io::Error>,
}

impl<W: Write> Replies<'_, W> {
    /// Writes and flushes one reply; whether the client can still be
    /// written to.
    fn send(
        &mut self,
        n: &Negotiated,
        req: &Request,
        outcome: Result<Reply, (u32, String)>,
    ) -> bool {
        if self.failed.is_some() {
            return false;
        }
        let sent = write_reply(self.w, n, req, outcome).and_then(|()| self.w.flush());
        if let Err(e) = sent {
            self.failed = Some(e);
            return false;
        }
        true
    }
}

/// What request `req` (a write's data in `payload`) comes to.
fn answer(
    shared: &Shared,
    export: &Export,
    n: &Negotiated,
    req: &Request,
    payload: &[u8],
) -> Result<Reply, (u32, String)> {
    let size = n.target.chain(shared).virtual_size();
    let writable = n.target.writable(export);
    let in_range = req
        .offset
        .checked_add(u64::from(req.len))
        .is_some_and(|end| end <= size);
    match req.cmd {
        // (The reader ends at a disconnect: none reaches here.)
        Cmd::Disconnect => Ok(Reply::Done),
        _ if !in_range && req.cmd != Cmd::Flush => {
            Err((wire::EINVAL, "beyond the end of the export".into()))
        }
        Cmd::Read if req.len > wire::MAX_PAYLOAD => Err((wire::EINVAL, "read too long".into())),
        Cmd::Read if n.structured && req.flags & wire::CMD_FLAG_DF == 0 => {
            read_sparse(shared, &n.target, req)
        }
        Cmd::Read => read(shared, &n.target, req),
        Cmd::Write | Cmd::Trim | Cmd::WriteZeroes if !writable => {
            Err((wire::EPERM, "the export is read-only".into()))
        }
        Cmd::Write => change(shared, req, |c| c.write_at(payload, req.offset)),
        Cmd::Trim => change(shared, req, |c| c.discard(req.offset, u64::from(req.len))),
        Cmd::Flush if !writable => Ok(Reply::Done),
        Cmd::WriteZeroes if req.flags & wire::CMD_FLAG_FAST_ZERO != 0 => {
            Err((wire::ENOTSUP, "no fast zeroing".into()))
        }
        Cmd::WriteZeroes => change(shared, req, |c| {
            c.write_zeroes(
                req.offset,
                u64::from(req.len),
                req.flags & wire::CMD_FLAG_NO_HOLE == 0,
            )
        }),
        Cmd::Flush => on_engine(shared, &n.target, |c| c.flush()).map(|()| Reply::Done),
        Cmd::Cache => Ok(Reply::Done),
        Cmd::BlockStatus if !n.structured || n.contexts.is_empty() => {
            Err((wire::EINVAL, "no metadata context selected".into()))
        }
        Cmd::BlockStatus => block_status(shared, req, n),
        Cmd::Unknown(_) => Err((wire::EINVAL, "unknown command".into())),
    }
}

/// Writes the reply to `req` (not flushed).
fn write_reply(
    w: &mut impl Write,
    n: &Negotiated,
    req: &Request,
    outcome: Result<Reply, (u32, String)>,
) -> std::io::Result<()> {
    match outcome {
        Ok(Reply::Done) if n.structured => wire::done(w, req.cookie),
        Ok(Reply::Done) => wire::simple_reply(w, req.cookie, 0, &[]),
        Ok(Reply::Data(data)) if n.structured => {
            if data.is_empty() {
                wire::done(w, req.cookie)
            } else if req.flags & wire::CMD_FLAG_DF == 0 && data.iter().all(|&b| b == 0) {
                wire::hole_chunk(w, req.cookie, true, req.offset, req.len)
            } else {
                wire::data_chunk(w, req.cookie, true, req.offset, &data)
            }
        }
        Ok(Reply::Data(data)) => wire::simple_reply(w, req.cookie, 0, &data),
        Ok(Reply::Pieces(pieces)) => {
            let last = pieces.len().saturating_sub(1);
            for (k, piece) in pieces.iter().enumerate() {
                match piece {
                    Piece::Hole(at, len) => {
                        wire::hole_chunk(w, req.cookie, k == last, *at, *len as u32)?
                    }
                    Piece::Data(at, data) => wire::data_chunk(w, req.cookie, k == last, *at, data)?,
                }
            }
            if pieces.is_empty() {
                wire::done(w, req.cookie)?;
            }
            Ok(())
        }
        Ok(Reply::Status(chunks)) => {
            let last = chunks.len().saturating_sub(1);
            for (k, (id, extents)) in chunks.iter().enumerate() {
                wire::status_chunk(w, req.cookie, k == last, *id, extents)?;
            }
            Ok(())
        }
        Err((errno, message)) if n.structured => wire::error_chunk(w, req.cookie, errno, &message),
        Err((errno, _)) => wire::simple_reply(w, req.cookie, errno, &[]),
    }
}

enum Reply {
    Done,
    Data(Vec<u8>),
    /// A read's chunks, in order (structured replies only).
    Pieces(Vec<Piece>),
    Status(Vec<(u32, Vec<(u32, u32)>)>),
}

/// [`on_chain`] of engine work: the gate's refusal and the engine's
/// errors as NBD errors.
fn on_engine<T>(
    shared: &Shared,
    target: &Target,
    work: impl FnOnce(&Chain) -> Result<T, sqcow2_format::Error>,
) -> Result<T, (u32, String)> {
    on_chain(shared, target, work)
        .map_err(|e| (e, "refused".into()))?
        .map_err(|e| (errno_of(&e), e.to_string()))
}

fn read(shared: &Shared, target: &Target, req: &Request) -> Result<Reply, (u32, String)> {
    let mut buf = vec![0u8; req.len as usize];
    on_engine(shared, target, |c| c.read_at(&mut buf, req.offset))?;
    Ok(Reply::Data(buf))
}

/// A read answered in pieces (structured replies, the client allowing
/// fragments): the ranges the chain maps as zeros or holes sent as
/// holes without reading them, the rest read, a run of data at a time
/// (as qemu-nbd's sparse reads).
fn read_sparse(shared: &Shared, target: &Target, req: &Request) -> Result<Reply, (u32, String)> {
    let end = req.offset + u64::from(req.len);
    let pieces = on_engine(shared, target, |c| {
        let mut pieces: Vec<Piece> = Vec::new();
        let mut data_from: Option<u64> = None;
        let mut pos = req.offset;
        let flush_data = |from: u64, to: u64, pieces: &mut Vec<Piece>| {
            let mut buf = vec![0u8; (to - from) as usize];
            c.read_at(&mut buf, from)?;
            pieces.push(Piece::Data(from, buf));
            Ok::<(), sqcow2_format::Error>(())
        };
        while pos < end {
            let e = c.resolve(GuestOffset(pos), end - pos, false)?;
            let n = e.len.clamp(1, end - pos);
            if let ExtentKind::Zero { .. } = e.kind {
                if let Some(from) = data_from.take() {
                    flush_data(from, pos, &mut pieces)?;
                }
                match pieces.last_mut() {
                    Some(Piece::Hole(_, len)) => *len += n,
                    _ => pieces.push(Piece::Hole(pos, n)),
                }
            } else if data_from.is_none() {
                data_from = Some(pos);
            }
            pos += n;
        }
        if let Some(from) = data_from {
            flush_data(from, end, &mut pieces)?;
        }
        Ok(pieces)
    })?;
    Ok(Reply::Pieces(pieces))
}

/// One chunk of a read's structured reply.
enum Piece {
    /// Zeros at a guest offset, that long.
    Hole(u64, u64),
    /// Data at a guest offset.
    Data(u64, Vec<u8>),
}

fn change(
    shared: &Shared,
    req: &Request,
    work: impl FnOnce(&Chain) -> Result<(), sqcow2_format::Error>,
) -> Result<Reply, (u32, String)> {
    let fua = req.flags & wire::CMD_FLAG_FUA != 0;
    on_engine(shared, &Target::Live, |c| {
        work(c).and_then(|()| if fua { c.flush() } else { Ok(()) })
    })?;
    Ok(Reply::Done)
}

fn block_status(shared: &Shared, req: &Request, n: &Negotiated) -> Result<Reply, (u32, String)> {
    let one = req.flags & wire::CMD_FLAG_REQ_ONE != 0;
    let len = u64::from(req.len.max(1));
    let chunks = on_chain(shared, &n.target, |c| {
        n.contexts
            .iter()
            .map(|(id, ctx)| ctx.status(c, req.offset, len, one).map(|d| (*id, d)))
            .collect::<Result<Vec<_>, String>>()
    })
    .map_err(|e| (e, "refused".into()))?
    .map_err(|m| (wire::EINVAL, m))?;
    Ok(Reply::Status(chunks))
}
