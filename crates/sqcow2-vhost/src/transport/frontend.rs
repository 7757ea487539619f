//! The vhost-user protocol of one frontend connection, served on the
//! `vhost` crate's message layer: guest memory, ring setup, config space,
//! and inflight I/O tracking (`VHOST_USER_PROTOCOL_F_INFLIGHT_SHMFD`),
//! which vhost-user-backend does not offer.
//!
//! Ring lifecycle: a ring is *started* by its kick eventfd and *stopped* by
//! `GET_VRING_BASE`; it is served while started and enabled. When a ring
//! starts with an inflight region, the requests a previous backend took
//! and never completed are resubmitted first, in the order it took them,
//! and the next available index comes from the region and the used ring
//! (as libvhost-user does), not from `SET_VRING_BASE` (which QEMU derives
//! from a used index it read at some earlier moment after a backend died).

use std::fs::File;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;
use std::time::Duration;

use tracing::{debug, info, warn};
use vhost::vhost_user::message::{
    VhostTransferStateDirection, VhostTransferStatePhase, VhostUserConfigFlags, VhostUserInflight,
    VhostUserLog, VhostUserMemoryRegion, VhostUserProtocolFeatures, VhostUserShMemConfig,
    VhostUserSharedMsg, VhostUserSingleMemoryRegion, VhostUserVirtioFeatures,
    VhostUserVringAddrFlags, VhostUserVringState,
};
use vhost::vhost_user::{
    Error as VhostError, GpuBackend, Result as VhostResult, VhostUserBackendReqHandlerMut,
};
use vhost::VhostUserMemoryRegionBase;
use virtio_queue::QueueT;
use vm_memory::{GuestAddress, GuestAddressSpace, GuestRegionMmap};
use vmm_sys_util::eventfd::EventFd;

use crate::transport::guest_mem::GuestMem;
use crate::transport::inflight::InflightRegion;
use crate::transport::vring::{SharedMem, Tracker, Vring};

/// Memory slots offered with `CONFIGURE_MEM_SLOTS`.
const MAX_MEM_SLOTS: u64 = 32;
/// Longest wait for a stopping ring's requests to finish.
const STOP_DRAIN_TIMEOUT: Duration = Duration::from_secs(10);
/// `VIRTIO_RING_F_EVENT_IDX`.
const EVENT_IDX: u64 = 1 << 29;

/// What the protocol needs of the device a connection serves: its
/// rings and the memory they live in, its config space, and whoever
/// serves a ring when its kick eventfd fires.
pub(crate) trait QueueDevice: Send + Sync + std::fmt::Debug {
    /// The device's virtio feature bits (the transport adds its own).
    fn features(&self) -> u64;
    /// Request queues offered.
    fn num_queues(&self) -> usize;
    /// Largest ring the frontend may set up.
    fn max_queue_size(&self) -> u16;
    /// Ring `queue`, if there is one.
    fn vring(&self, queue: usize) -> Option<&Vring>;
    /// The guest memory the rings and buffers live in.
    fn mem(&self) -> &SharedMem;
    /// Ring `queue` is served when `kick` fires.
    fn watch_kick(&self, queue: usize, kick: RawFd) -> std::io::Result<()>;
    /// No longer when `kick` fires.
    fn unwatch_kick(&self, queue: usize, kick: RawFd);
    /// Serves ring `queue` now (it became live).
    fn kick_now(&self, queue: usize);
    /// Waits at most `timeout` until ring `queue` has no request in
    /// flight; whether it happened.
    fn wait_queue_idle(&self, queue: usize, timeout: Duration) -> bool;
    /// `size` bytes of the config space from `offset`.
    fn read_config(&self, offset: u32, size: u32) -> Vec<u8>;
    /// A driver's write to the config space; whether the device took it.
    fn write_config(&self, offset: u32, data: &[u8]) -> bool;
}

/// Where the frontend's address space maps to guest-physical addresses.
#[derive(Debug, Clone, Copy)]
struct Mapping {
    user_addr: u64,
    size: u64,
    gpa: u64,
}

/// The protocol state of one connection.
#[derive(Debug)]
pub(crate) struct FrontendHandler<D> {
    device: D,
    owned: bool,
    acked_features: u64,
    acked_protocol: u64,
    /// Where the acked protocol features are told to the connection's
    /// reader (which takes the backend channel itself).
    negotiated: Option<Arc<std::sync::atomic::AtomicU64>>,
    mappings: Vec<Mapping>,
    inflight: Option<Arc<InflightRegion>>,
}

/// An eventfd the frontend sent (a queue's kick or call), checked to be
/// one and made non-blocking: the queue-worker thread that reads and
/// writes it serves other exports' queues too, and must never wait on
/// it. A blocking eventfd given as two queues' kick would block the
/// second read after one kick; a pipe would be readable for ever once
/// its writer closed, or block the writes once full. (QEMU's and Cloud
/// Hypervisor's eventfds are non-blocking already; the flag is on the
/// file they share, and changes nothing for them.)
fn eventfd(file: File) -> VhostResult<EventFd> {
    use rustix::fs::{fcntl_getfl, fcntl_setfl, OFlags};
    use std::os::fd::{FromRawFd, IntoRawFd};
    if !is_eventfd(&file) {
        return Err(invalid("a queue's kick or call is not an eventfd"));
    }
    let flags = fcntl_getfl(&file).map_err(internal)?;
    fcntl_setfl(&file, flags | OFlags::NONBLOCK).map_err(internal)?;
    // SAFETY: `file` owns the descriptor and gives it up here; the EventFd
    // becomes its only owner.
    Ok(unsafe { EventFd::from_raw_fd(file.into_raw_fd()) })
}

/// Whether `file` is an eventfd: `/proc` names its anonymous inode; where
/// `/proc` cannot say, an anonymous inode (no file type) is taken.
fn is_eventfd(file: &File) -> bool {
    use std::os::unix::fs::MetadataExt;
    match std::fs::read_link(format!("/proc/self/fd/{}", file.as_raw_fd())) {
        Ok(target) => target.as_os_str() == "anon_inode:[eventfd]",
        Err(_) => file.metadata().is_ok_and(|m| m.mode() & libc::S_IFMT == 0),
    }
}

fn invalid(what: &'static str) -> VhostError {
    VhostError::InvalidOperation(what)
}

fn internal(e: impl std::fmt::Display) -> VhostError {
    warn!("vhost-user: {e}");
    VhostError::ReqHandlerError(std::io::Error::other(e.to_string()))
}

impl<D: QueueDevice> FrontendHandler<D> {
    pub(crate) fn new(device: D) -> Self {
        FrontendHandler {
            device,
            owned: false,
            acked_features: 0,
            acked_protocol: 0,
            negotiated: None,
            mappings: Vec::new(),
            inflight: None,
        }
    }

    /// The same handler, recording the protocol features it acks in
    /// `negotiated` too.
    pub(crate) fn telling_negotiated(
        mut self,
        negotiated: Arc<std::sync::atomic::AtomicU64>,
    ) -> Self {
        self.negotiated = Some(negotiated);
        self
    }

    fn set_acked_protocol(&mut self, features: u64) {
        self.acked_protocol = features;
        if let Some(n) = &self.negotiated {
            n.store(features, std::sync::atomic::Ordering::Relaxed);
        }
    }

    fn features(&self) -> u64 {
        self.device.features() | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits()
    }

    fn vring(&self, index: u32) -> VhostResult<&Vring> {
        self.device
            .vring(index as usize)
            .ok_or(VhostError::InvalidParam)
    }

    fn to_gpa(&self, user_addr: u64) -> VhostResult<u64> {
        self.mappings
            .iter()
            .find(|m| user_addr >= m.user_addr && user_addr - m.user_addr < m.size)
            .map(|m| user_addr - m.user_addr + m.gpa)
            .ok_or(VhostError::InvalidParam)
    }

    /// Registers or unregisters the ring's kick eventfd with its worker
    /// thread as the ring becomes live or not; a ring becoming live is
    /// looked at at once.
    fn update_watch(&self, index: usize) {
        let Some(vring) = self.device.vring(index) else {
            return;
        };
        let (live, fd) = {
            let st = vring.lock();
            (st.is_live(), st.kick.as_ref().map(|k| k.as_raw_fd()))
        };
        if live {
            if let Some(fd) = fd {
                if let Err(e) = self.device.watch_kick(index, fd) {
                    warn!(queue = index, "watching the kick eventfd: {e}");
                }
            }
            // Also without a kick eventfd (`SET_VRING_KICK` with no file):
            // what the ring holds is taken all the same.
            self.device.kick_now(index);
        } else if let Some(fd) = fd {
            self.device.unwatch_kick(index, fd);
        }
    }

    /// The ring starts: recover from the inflight region if there is one.
    fn start_ring(&self, index: usize) {
        let Some(vring) = self.device.vring(index) else {
            return;
        };
        let mem = self.device.mem().memory();
        let mut st = vring.lock();
        st.started = true;
        st.stopping = false;
        st.queue.set_ready(true);
        let region = self
            .inflight
            .as_ref()
            .filter(|_| self.inflight_negotiated())
            .and_then(|r| r.queue(index as u16));
        let Some(region) = region else {
            st.tracker = None;
            return;
        };
        let ring = (
            st.queue
                .used_idx(&*mem, std::sync::atomic::Ordering::Acquire),
            st.queue
                .avail_idx(&*mem, std::sync::atomic::Ordering::Acquire),
        );
        let (Ok(used), Ok(avail)) = ring else {
            warn!(
                queue = index,
                "rings outside guest memory: inflight tracking off"
            );
            st.tracker = None;
            return;
        };
        let recovery = region.recover(used.0, avail.0);
        debug!(
            queue = index,
            base = st.queue.next_avail(),
            used = used.0,
            avail = avail.0,
            resubmit = recovery.resubmit.len(),
            next_avail = recovery.next_avail,
            "ring starts with an inflight region"
        );
        for what in &recovery.ignored {
            warn!(queue = index, "inflight region ignored: {what}");
        }
        let mut tracker = Tracker::new(region);
        if !recovery.resubmit.is_empty() {
            info!(
                queue = index,
                requests = recovery.resubmit.len(),
                "resubmitting requests in flight when the previous backend stopped"
            );
        }
        // Not the base: QEMU derives it from a used index it may have read
        // before the previous backend's last completions.
        st.queue.set_next_avail(recovery.next_avail);
        st.queue.set_next_used(used.0);
        tracker.resubmit = recovery.resubmit.into();
        st.tracker = Some(tracker);
    }

    fn inflight_negotiated(&self) -> bool {
        self.acked_protocol & VhostUserProtocolFeatures::INFLIGHT_SHMFD.bits() != 0
    }

    fn replace_memory(&mut self, mem: GuestMem) {
        let atomic = self.device.mem();
        atomic
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .replace(mem);
    }
}

impl<D: QueueDevice> VhostUserBackendReqHandlerMut for FrontendHandler<D> {
    fn set_owner(&mut self) -> VhostResult<()> {
        if self.owned {
            return Err(invalid("already owned"));
        }
        self.owned = true;
        Ok(())
    }

    fn reset_owner(&mut self) -> VhostResult<()> {
        self.owned = false;
        self.acked_features = 0;
        self.set_acked_protocol(0);
        Ok(())
    }

    fn reset_device(&mut self) -> VhostResult<()> {
        for index in 0..self.device.num_queues() {
            if let Some(v) = self.device.vring(index) {
                v.lock().enabled = false;
            }
            self.update_watch(index);
        }
        self.acked_features = 0;
        Ok(())
    }

    fn get_features(&mut self) -> VhostResult<u64> {
        Ok(self.features())
    }

    fn set_features(&mut self, features: u64) -> VhostResult<()> {
        if features & !self.features() != 0 {
            return Err(VhostError::InvalidParam);
        }
        self.acked_features = features;
        let event_idx = features & EVENT_IDX != 0;
        let enable_all = features & VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits() == 0;
        for index in 0..self.device.num_queues() {
            if let Some(v) = self.device.vring(index) {
                let mut st = v.lock();
                st.queue.set_event_idx(event_idx);
                if enable_all {
                    st.enabled = true;
                }
            }
            if enable_all {
                self.update_watch(index);
            }
        }
        Ok(())
    }

    fn set_mem_table(
        &mut self,
        ctx: &[VhostUserMemoryRegion],
        files: Vec<File>,
        postcopy: Option<bool>,
    ) -> VhostResult<Option<Vec<VhostUserMemoryRegionBase>>> {
        if postcopy.is_some() {
            return Err(invalid("postcopy not supported"));
        }
        let mut regions = Vec::new();
        let mut mappings = Vec::new();
        for (region, file) in ctx.iter().zip(files) {
            let mmap = region.mmap_region(file)?;
            let guest = GuestRegionMmap::new(mmap, GuestAddress(region.guest_phys_addr))
                .ok_or(VhostError::InvalidParam)?;
            regions.push(guest);
            mappings.push(Mapping {
                user_addr: region.user_addr,
                size: region.memory_size,
                gpa: region.guest_phys_addr,
            });
        }
        let mem = GuestMem::from_regions(regions).map_err(internal)?;
        self.replace_memory(mem);
        self.mappings = mappings;
        Ok(None)
    }

    fn set_vring_num(&mut self, index: u32, num: u32) -> VhostResult<()> {
        let max = u32::from(self.device.max_queue_size());
        if num == 0 || num > max || !num.is_power_of_two() {
            return Err(VhostError::InvalidParam);
        }
        self.vring(index)?.lock().queue.set_size(num as u16);
        Ok(())
    }

    fn set_vring_addr(
        &mut self,
        index: u32,
        _flags: VhostUserVringAddrFlags,
        descriptor: u64,
        used: u64,
        available: u64,
        _log: u64,
    ) -> VhostResult<()> {
        let (desc, avail, used) = (
            self.to_gpa(descriptor)?,
            self.to_gpa(available)?,
            self.to_gpa(used)?,
        );
        let mem = self.device.mem().memory();
        let mut st = self.vring(index)?.lock();
        let q = &mut st.queue;
        q.try_set_desc_table_address(GuestAddress(desc))
            .map_err(|_| VhostError::InvalidParam)?;
        q.try_set_avail_ring_address(GuestAddress(avail))
            .map_err(|_| VhostError::InvalidParam)?;
        q.try_set_used_ring_address(GuestAddress(used))
            .map_err(|_| VhostError::InvalidParam)?;
        // The used index lives in guest memory: after a restart it is
        // where the previous backend left it.
        if let Ok(idx) = q.used_idx(&*mem, std::sync::atomic::Ordering::Acquire) {
            q.set_next_used(idx.0);
        }
        Ok(())
    }

    fn set_vring_base(&mut self, index: u32, base: u32) -> VhostResult<()> {
        self.vring(index)?.lock().queue.set_next_avail(base as u16);
        Ok(())
    }

    fn get_vring_base(&mut self, index: u32) -> VhostResult<VhostUserVringState> {
        debug!(queue = index, "stopping the ring");
        let i = index as usize;
        let vring = self.vring(index)?;
        // No new request (not even found by a polling worker); those
        // running finish (and complete) first, so that the index returned
        // accounts for every request taken.
        let fd = {
            let mut st = vring.lock();
            st.stopping = true;
            st.kick.as_ref().map(|k| k.as_raw_fd())
        };
        if let Some(fd) = fd {
            self.device.unwatch_kick(i, fd);
        }
        if !self.device.wait_queue_idle(i, STOP_DRAIN_TIMEOUT) {
            warn!(
                queue = i,
                "requests still running when the ring stops: the inflight region keeps them"
            );
        }
        let mut st = vring.lock();
        st.started = false;
        st.queue.set_ready(false);
        st.kick = None;
        st.call = None;
        Ok(VhostUserVringState::new(
            index,
            u32::from(st.queue.next_avail()),
        ))
    }

    fn set_vring_kick(&mut self, index: u8, fd: Option<File>) -> VhostResult<()> {
        let i = usize::from(index);
        let vring = self.vring(u32::from(index))?;
        let kick = fd.map(eventfd).transpose()?;
        let old = vring.lock().kick.as_ref().map(|k| k.as_raw_fd());
        if let Some(old) = old {
            self.device.unwatch_kick(i, old);
        }
        vring.lock().kick = kick;
        self.start_ring(i);
        self.update_watch(i);
        Ok(())
    }

    fn set_vring_call(&mut self, index: u8, fd: Option<File>) -> VhostResult<()> {
        let call = fd.map(eventfd).transpose()?;
        // QEMU gives this eventfd after it started the ring (it unmasks the
        // guest notifiers last): a request completed in between (one left
        // by a previous backend) had no eventfd to signal, and the guest
        // would wait for it forever. One spurious interrupt is harmless
        // (libvhost-user signals a new eventfd the same way).
        if let Some(call) = &call {
            if let Err(e) = call.write(1) {
                warn!(queue = index, "signalling a new interrupt eventfd: {e}");
            }
        }
        self.vring(u32::from(index))?.lock().call = call;
        Ok(())
    }

    fn set_vring_err(&mut self, index: u8, _fd: Option<File>) -> VhostResult<()> {
        self.vring(u32::from(index))?;
        Ok(())
    }

    fn get_protocol_features(&mut self) -> VhostResult<VhostUserProtocolFeatures> {
        Ok(VhostUserProtocolFeatures::CONFIG
            | VhostUserProtocolFeatures::MQ
            | VhostUserProtocolFeatures::REPLY_ACK
            | VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS
            | VhostUserProtocolFeatures::INFLIGHT_SHMFD
            | VhostUserProtocolFeatures::BACKEND_REQ)
    }

    fn set_protocol_features(&mut self, features: u64) -> VhostResult<()> {
        self.set_acked_protocol(features);
        Ok(())
    }

    fn get_queue_num(&mut self) -> VhostResult<u64> {
        Ok(self.device.num_queues() as u64)
    }

    fn set_vring_enable(&mut self, index: u32, enable: bool) -> VhostResult<()> {
        self.vring(index)?.lock().enabled = enable;
        self.update_watch(index as usize);
        Ok(())
    }

    fn get_config(
        &mut self,
        offset: u32,
        size: u32,
        _flags: VhostUserConfigFlags,
    ) -> VhostResult<Vec<u8>> {
        Ok(self.device.read_config(offset, size))
    }

    fn set_config(
        &mut self,
        offset: u32,
        buf: &[u8],
        _flags: VhostUserConfigFlags,
    ) -> VhostResult<()> {
        if self.device.write_config(offset, buf) {
            Ok(())
        } else {
            Err(VhostError::InvalidParam)
        }
    }

    fn set_gpu_socket(&mut self, _gpu: GpuBackend) -> VhostResult<()> {
        Err(invalid("no GPU"))
    }

    fn get_shared_object(&mut self, _uuid: VhostUserSharedMsg) -> VhostResult<File> {
        Err(invalid("no shared objects"))
    }

    fn get_inflight_fd(
        &mut self,
        msg: &VhostUserInflight,
    ) -> VhostResult<(VhostUserInflight, File)> {
        let queues = usize::from(msg.num_queues);
        if queues == 0 || queues > self.device.num_queues() {
            warn!(
                num_queues = msg.num_queues,
                "inflight region asked for a queue count we do not offer"
            );
            return Err(VhostError::InvalidParam);
        }
        let region = InflightRegion::create(msg.num_queues, msg.queue_size).map_err(internal)?;
        let file = region.file().try_clone().map_err(internal)?;
        let reply = VhostUserInflight::new(region.size(), 0, msg.num_queues, msg.queue_size);
        self.inflight = Some(Arc::new(region));
        Ok((reply, file))
    }

    fn set_inflight_fd(&mut self, msg: &VhostUserInflight, file: File) -> VhostResult<()> {
        if usize::from(msg.num_queues) > self.device.num_queues() {
            warn!(
                num_queues = msg.num_queues,
                "inflight region for more queues than we offer: refused"
            );
            return Err(VhostError::InvalidParam);
        }
        let region = InflightRegion::open(
            file,
            msg.mmap_size,
            msg.mmap_offset,
            msg.num_queues,
            msg.queue_size,
        )
        .map_err(|e| {
            warn!("refusing the inflight region: {e}");
            VhostError::InvalidParam
        })?;
        self.inflight = Some(Arc::new(region));
        Ok(())
    }

    fn get_max_mem_slots(&mut self) -> VhostResult<u64> {
        Ok(MAX_MEM_SLOTS)
    }

    fn add_mem_region(
        &mut self,
        region: &VhostUserSingleMemoryRegion,
        fd: File,
        postcopy: Option<bool>,
    ) -> VhostResult<Option<VhostUserMemoryRegionBase>> {
        if postcopy.is_some() {
            return Err(invalid("postcopy not supported"));
        }
        let mmap = region.mmap_region(fd)?;
        let guest = GuestRegionMmap::new(mmap, GuestAddress(region.guest_phys_addr))
            .ok_or(VhostError::InvalidParam)?;
        let mem = self
            .device
            .mem()
            .memory()
            .insert_region(Arc::new(guest))
            .map_err(internal)?;
        self.replace_memory(mem);
        self.mappings.push(Mapping {
            user_addr: region.user_addr,
            size: region.memory_size,
            gpa: region.guest_phys_addr,
        });
        Ok(None)
    }

    fn remove_mem_region(&mut self, region: &VhostUserSingleMemoryRegion) -> VhostResult<()> {
        let (mem, _) = self
            .device
            .mem()
            .memory()
            .remove_region(GuestAddress(region.guest_phys_addr), region.memory_size)
            .map_err(internal)?;
        self.replace_memory(mem);
        self.mappings.retain(|m| m.gpa != region.guest_phys_addr);
        Ok(())
    }

    fn set_device_state_fd(
        &mut self,
        _direction: VhostTransferStateDirection,
        _phase: VhostTransferStatePhase,
        _fd: File,
    ) -> VhostResult<Option<File>> {
        Err(invalid("no device state transfer"))
    }

    fn check_device_state(&mut self) -> VhostResult<()> {
        Err(invalid("no device state transfer"))
    }

    fn get_shmem_config(&mut self) -> VhostResult<VhostUserShMemConfig> {
        Err(invalid("no shared memory regions"))
    }

    fn set_log_base(&mut self, _log: &VhostUserLog, _file: File) -> VhostResult<()> {
        Err(invalid("no dirty logging"))
    }
}
