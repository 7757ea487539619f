//! The metadata contexts an NBD client may select, as qemu-nbd names
//! them, and their block status: `base:allocation` (hole, zero),
//! `qemu:allocation-depth` (0 unallocated, 1 the top, n the n-th layer
//! from the top) and `qemu:dirty-bitmap:NAME` (1 dirty).

use std::ops::Range;

use sqcow2_format::{Chain, ExtentKind, GuestOffset};

/// A context a client can select.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Context {
    Allocation,
    Depth,
    DirtyBitmap(String),
}

const ALLOCATION: &str = "base:allocation";
const DEPTH: &str = "qemu:allocation-depth";
const BITMAP_PREFIX: &str = "qemu:dirty-bitmap:";

/// `NBD_STATE_HOLE` and `NBD_STATE_ZERO` of `base:allocation`.
const STATE_HOLE: u32 = 1;
const STATE_ZERO: u32 = 2;
/// Most descriptors in one reply chunk.
const MAX_DESCRIPTORS: usize = 2048;

impl Context {
    pub(crate) fn name(&self) -> String {
        match self {
            Context::Allocation => ALLOCATION.into(),
            Context::Depth => DEPTH.into(),
            Context::DirtyBitmap(b) => format!("{BITMAP_PREFIX}{b}"),
        }
    }

    /// Every context `chain` offers.
    pub(crate) fn all(chain: &Chain) -> Vec<Context> {
        let mut out = vec![Context::Allocation, Context::Depth];
        out.extend(bitmap_names(chain).into_iter().map(Context::DirtyBitmap));
        out
    }

    /// The contexts a query names: an exact name, or a namespace prefix
    /// (`base:`, `qemu:`) for a list; an empty query lists all.
    pub(crate) fn matching(chain: &Chain, query: &str, listing: bool) -> Vec<Context> {
        Context::all(chain)
            .into_iter()
            .filter(|c| {
                let name = c.name();
                name == query
                    || (listing
                        && (query.is_empty() || (query.ends_with(':') && name.starts_with(query))))
            })
            .collect()
    }

    /// Descriptors `(length, flags)` from `offset` on, covering at most
    /// `len` bytes (one if `one`), within the disk.
    pub(crate) fn status(
        &self,
        chain: &Chain,
        offset: u64,
        len: u64,
        one: bool,
    ) -> Result<Vec<(u32, u32)>, String> {
        let end = offset.saturating_add(len).min(chain.virtual_size());
        let limit = if one { 1 } else { MAX_DESCRIPTORS };
        let mut out: Vec<(u32, u32)> = Vec::new();
        let push = |len: u64, flags: u32, out: &mut Vec<(u32, u32)>| match out.last_mut() {
            Some(last) if last.1 == flags && u64::from(last.0) + len <= MAX_DESCRIPTOR => {
                last.0 += len as u32
            }
            _ => out.push((len.min(MAX_DESCRIPTOR) as u32, flags)),
        };
        match self {
            Context::Allocation | Context::Depth => {
                let top = chain.top_index().0;
                let mut pos = offset;
                while pos < end && out.len() <= limit {
                    let e = chain
                        .resolve(GuestOffset(pos), (end - pos).min(MAX_DESCRIPTOR), false)
                        .map_err(|e| e.to_string())?;
                    let allocated = !matches!(
                        e.kind,
                        ExtentKind::Zero {
                            allocated: false,
                            ..
                        }
                    );
                    let flags = match self {
                        Context::Allocation => match e.kind {
                            ExtentKind::Zero { .. } => STATE_HOLE | STATE_ZERO,
                            _ => 0,
                        },
                        _ if allocated => (top - e.layer.0 + 1) as u32,
                        _ => 0,
                    };
                    let n = e.len.min(end - pos);
                    push(n, flags, &mut out);
                    pos += n;
                }
            }
            Context::DirtyBitmap(name) => {
                let dirty = dirty_ranges(chain, name, offset..end)?;
                let mut pos = offset;
                for r in &dirty {
                    let start = r.start.max(offset);
                    if start > pos {
                        push(start - pos, 0, &mut out);
                    }
                    let stop = r.end.min(end);
                    push(stop - start, 1, &mut out);
                    pos = stop;
                }
                if pos < end {
                    push(end - pos, 0, &mut out);
                }
            }
        }
        out.truncate(limit);
        Ok(out)
    }
}

/// Longest descriptor: 4 GiB less a 64 KiB cluster, so that merged
/// lengths stay aligned.
const MAX_DESCRIPTOR: u64 = (1 << 32) - (1 << 16);

/// The bitmaps of the chain's top: those its writer keeps, or those its
/// file holds when it is served read-only.
fn bitmap_names(chain: &Chain) -> Vec<String> {
    if chain.is_writable() {
        return chain.bitmaps().usable_names().unwrap_or_default();
    }
    let top = chain.top();
    top.header()
        .and_then(|h| sqcow2_format::describe_bitmaps(h, &**top.storage()).ok())
        .map(|l| {
            l.into_iter()
                .filter(|b| !b.flags.contains(&"in-use"))
                .map(|b| b.name)
                .collect()
        })
        .unwrap_or_default()
}

/// The ranges bitmap `name` of the chain's top marks dirty within
/// `window` (only that part of its bits read).
fn dirty_ranges(chain: &Chain, name: &str, window: Range<u64>) -> Result<Vec<Range<u64>>, String> {
    if chain.is_writable() {
        return chain
            .bitmaps()
            .dirty_in(name, window)
            .map_err(|e| e.kind.to_string());
    }
    let top = chain.top();
    let header = top.header().ok_or("the top is not a qcow2 image")?;
    let read = sqcow2_format::read_dirty_ranges_in(header, &**top.storage(), name, window)
        .map_err(|e| e.to_string())?;
    read.dirty
        .ok_or_else(|| format!("Bitmap '{name}' is inconsistent and cannot be used"))
}
