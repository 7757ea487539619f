//! Persistent dirty bitmaps, as QEMU keeps them in a qcow2 image
//! (`docs/interop/qcow2.txt`, "Bitmaps extension"): the directory
//! ([`directory`]), each bitmap's table and data ([`table`]), and what
//! `qemu-img info` lists of them, and the bitmaps a writer keeps up to
//! date ([`kept`]).

mod directory;
mod dirty_bits;
pub(crate) mod kept;
mod table;

pub(crate) use directory::{encode_directory, read_directory, BitmapEntry};
pub(crate) use table::{
    data_clusters, data_for_image, dirty_ranges, encode_table, ranges_in_window, read_entries,
    word_window, ENTRY_OFFSET,
};

pub use directory::{describe_bitmaps, BitmapInfo};
pub use table::{read_dirty_ranges, read_dirty_ranges_in, BitmapRead};
