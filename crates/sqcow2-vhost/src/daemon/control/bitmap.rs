//! The `bitmap` control command: the served top's persistent dirty
//! bitmaps edited live (qemu-img bitmap's operations, QMP's
//! `block-dirty-bitmap-*`), each edit written into the image at once.

use sqcow2_format::{Chain, Error, ErrorKind};

use super::protocol::{BitmapList, BitmapOp, BitmapRequest, BitmapState, FailureKind};
use super::{fail, Failure, Shared, SNAPSHOT_DRAIN_TIMEOUT};

/// Runs one `bitmap` request; the bitmaps after it.
pub(super) fn bitmap(shared: &Shared, request: &BitmapRequest) -> Result<BitmapList, Failure> {
    // No snapshot (whose new top takes the bitmaps on), merge switch or
    // handover meanwhile.
    let right = shared.take_right()?;
    if !shared.is_active() {
        return Err(fail(
            FailureKind::Inactive,
            "the daemon is inactive: activate it first",
        ));
    }
    if request.op == BitmapOp::List {
        return list(&shared.handle.get());
    }
    // An edit runs with the guest's requests drained, as QEMU's bitmap
    // transactions do: a write in flight is in the bitmaps before an
    // add or a clear, never half in them.
    let quiet = match right.pause().idle(SNAPSHOT_DRAIN_TIMEOUT) {
        Ok(quiet) => quiet,
        Err(pause) => {
            drop(pause.resume());
            return Err(fail(
                FailureKind::Busy,
                format!("requests still in flight after {SNAPSHOT_DRAIN_TIMEOUT:?}"),
            ));
        }
    };
    let edited = edit(&quiet.current(), request);
    drop(quiet.resume());
    edited
}

/// One edit of the bitmaps of `chain`'s top, stored at once; the
/// bitmaps after it.
fn edit(chain: &Chain, request: &BitmapRequest) -> Result<BitmapList, Failure> {
    let bitmaps = chain.bitmaps();
    let name = || {
        request
            .name
            .as_deref()
            .ok_or_else(|| fail(FailureKind::BadRequest, "bitmap needs \"name\""))
    };
    let edited = match request.op {
        BitmapOp::List => None,
        BitmapOp::Add => Some(bitmaps.add(name()?, request.granularity, !request.disabled)),
        BitmapOp::Remove => Some(bitmaps.remove(name()?)),
        BitmapOp::Clear => Some(bitmaps.clear(name()?)),
        BitmapOp::Enable => Some(bitmaps.set_enabled(name()?, true)),
        BitmapOp::Disable => Some(bitmaps.set_enabled(name()?, false)),
        BitmapOp::Merge => {
            let target = name()?;
            let source = request
                .source
                .as_deref()
                .ok_or_else(|| fail(FailureKind::BadRequest, "merge needs \"source\""))?;
            let ranges = match &request.source_layer {
                None => bitmaps.dirty(source),
                Some(layer) => sqcow2_format::reshape::find_layer(chain, &layer.into())
                    .and_then(|at| bitmaps.dirty_in_layer(at, source)),
            };
            Some(ranges.and_then(|r| bitmaps.merge(target, &r, chain.virtual_size())))
        }
    };
    if let Some(done) = edited {
        done.map_err(failure)?;
        bitmaps.persist().map_err(failure)?;
    }
    list(chain)
}

/// The bitmaps of `chain`'s top.
fn list(chain: &Chain) -> Result<BitmapList, Failure> {
    let bitmaps = chain
        .bitmaps()
        .list()
        .map_err(failure)?
        .into_iter()
        .map(|b| BitmapState {
            name: b.name,
            granularity: b.granularity,
            recording: b.recording,
            inconsistent: b.inconsistent,
            count: b.count,
        })
        .collect();
    Ok(BitmapList { bitmaps })
}

/// An input mistake is the client's; anything else an I/O error.
fn failure(e: Error) -> Failure {
    match e.kind {
        ErrorKind::InvalidArgument(m) => fail(FailureKind::BadRequest, m),
        _ => fail(FailureKind::IoError, e.to_string()),
    }
}
