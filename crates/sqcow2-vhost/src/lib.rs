//! vhost-user-blk backend that serves an sQcow2 chain to unmodified QEMU and
//! Cloud Hypervisor guests over virtio queues in shared memory.
//!
//! Not built yet: see the project's issue tracker.
