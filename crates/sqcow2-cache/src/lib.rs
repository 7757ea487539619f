//! One unified metadata cache for a whole qcow2 backing chain.
//!
//! A single cache of resolved slices, keyed by guest slice number and bounded
//! by a byte budget that does not grow with the chain length. Not built yet:
//! the chain engine in `sqcow2-format` keeps a simple bounded L2 cache until
//! this crate lands (see the project's issue tracker).
