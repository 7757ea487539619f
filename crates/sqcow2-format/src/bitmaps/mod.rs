//! Persistent dirty bitmaps, as QEMU keeps them in a qcow2 image
//! (`docs/interop/qcow2.txt`, "Bitmaps extension"): the directory
//! ([`directory`]), each bitmap's table and data ([`table`]), and what
//! `qemu-img info` lists of them. sqcow2 reads them; it keeps none up to
//! date yet: an image with any is not written (see `Active`).

mod directory;
mod table;

pub use directory::{describe_bitmaps, BitmapInfo};
pub use table::{read_dirty_ranges, BitmapRead};
