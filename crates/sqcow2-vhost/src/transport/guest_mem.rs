//! Guest memory as the daemon maps it, and a buffer known to lie in it:
//! the lowest layer of the device, imported by the rings, the descriptor
//! walk and the requests, importing none of them.

use vm_memory::{GuestAddress, GuestMemoryAtomic, GuestMemoryMmap};

/// Guest memory as the daemon maps it.
pub type GuestMem = GuestMemoryMmap<()>;
/// Guest memory that the frontend may remap at any time.
pub type GuestMemAtomic = GuestMemoryAtomic<GuestMem>;

/// A guest buffer: `len` bytes at `addr`, known to lie in guest memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct GuestBuffer {
    /// First guest-physical byte.
    pub addr: GuestAddress,
    /// Length in bytes.
    pub len: u32,
}
