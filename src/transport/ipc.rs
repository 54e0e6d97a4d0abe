//! The intra-node transport: a registered buffer and a flag array per rank, exported
//! with legacy CUDA IPC and mapped by every peer of the group (peers in this process
//! use the device pointers instead: `inproc.rs`). Puts are copy-engine
//! copies (0 SMs) or a copy kernel on a configurable number of SMs; signals and waits
//! are tiny kernels (waits spin with a timeout and record it in host-mapped memory).
//! Flag values are computed on the device from a per-object call counter in this rank's
//! memory (see `crate::transport::Slot`), so every call is capturable in a CUDA graph and
//! each replay synchronises afresh.
use super::inproc::{LOCAL_BYTES, Local, PeerMem, enable_access};
use super::{
    ALGO_SLOTS, Constructor, ErrorRecord, ExchangePart, FlagSlot, Group, MAX_PEERS, NUM_SLOTS,
    PeerMemory, PeerSet, RecvOp, SendOp, Timeout, Transport, TwoSided, WaitInfo,
};
use crate::bootstrap::Bootstrap;
use crate::cuda::StreamHandle;
use crate::cuda::resources::{DeviceMem, HostMapped, IpcMapping, copy_2d, copy_async, device_uuid};
use crate::cuda::{Binding, ContextGuard, DevPtr, DeviceInfo, Kernel, Signature, nvrtc};
use crate::error::Result;
use crate::unsupported;
use std::sync::Arc;

pub struct IpcTransport {
    group: Group,
    flags: DeviceMem,
    /// This rank's call counter (one u64, local: peers never touch it).
    counter: DeviceMem,
    peer_buffers: Vec<Option<PeerMem>>,
    peer_flags: Vec<Option<PeerMem>>,
    /// every peer is in this process (reached by device pointers, no CUDA IPC)
    in_process: bool,
    /// every peer's buffer is on another device than this rank's
    remote_peers: bool,
    error: HostMapped,
    use_ce: bool,
    comm_sms: u32,
    timeout_ns: u64,
    /// NVTE_COMM_CHECK: compare the peers' call descriptors at every arrival barrier
    check: bool,
    /// the module of `k`'s kernels, kept loaded as long as the object
    _module: Arc<nvrtc::Module>,
    k: IpcKernels,
}

/// wait_flags(FlagSet, const u64 *counter, u64 tag, u64 timeout_ns, ErrorRecord *err, u32
/// op, u32 step)
// SAFETY (each binding): the kernel's parameter list in kernels/comm.cu (FlagSet and
// CheckSet are PeerSet's layout, pointers are DevPtr, repr(transparent) u64).
const WAIT_FLAGS: Binding<(PeerSet, DevPtr, u64, u64, DevPtr, u32, u32)> =
    unsafe { Binding::new(&nvrtc::COMM, "wait_flags", "") };
/// wait_arrival_checked(FlagSet, CheckSet, const u64 *counter, u64 desc, u64 timeout_ns,
/// ErrorRecord *err, u32 op)
const WAIT_ARRIVAL_CHECKED: Binding<(PeerSet, PeerSet, DevPtr, u64, u64, DevPtr, u32)> =
    unsafe { Binding::new(&nvrtc::COMM, "wait_arrival_checked", "") };
/// signal_flags(FlagSet, const u64 *counter, u64 tag, u32 data)
const SIGNAL_FLAGS: Binding<(PeerSet, DevPtr, u64, u32)> =
    unsafe { Binding::new(&nvrtc::COMM, "signal_flags", "") };
/// begin_call(FlagSet, FlagSet, u64 *counter, u64 desc)
const BEGIN_CALL: Binding<(PeerSet, PeerSet, DevPtr, u64)> =
    unsafe { Binding::new(&nvrtc::COMM, "begin_call", "") };
/// put_bytes(u8 *dst, const u8 *src, u64 bytes)
const PUT_BYTES: Binding<(DevPtr, DevPtr, u64)> =
    unsafe { Binding::new(&nvrtc::COMM, "put_bytes", "") };

/// The kernel bindings of this transport (checked against kernels/comm.cu by
/// tests/kernel_signatures.rs).
pub fn kernel_signatures() -> Vec<Signature> {
    vec![
        WAIT_FLAGS.signature(),
        WAIT_ARRIVAL_CHECKED.signature(),
        SIGNAL_FLAGS.signature(),
        BEGIN_CALL.signature(),
        PUT_BYTES.signature(),
    ]
}

/// The kernels of kernels/comm.cu this transport launches.
#[derive(Clone, Copy)]
struct IpcKernels {
    wait_flags: Kernel<(PeerSet, DevPtr, u64, u64, DevPtr, u32, u32)>,
    wait_arrival_checked: Kernel<(PeerSet, PeerSet, DevPtr, u64, u64, DevPtr, u32)>,
    signal_flags: Kernel<(PeerSet, DevPtr, u64, u32)>,
    begin_call: Kernel<(PeerSet, PeerSet, DevPtr, u64)>,
    put_bytes: Kernel<(DevPtr, DevPtr, u64)>,
}

impl IpcKernels {
    /// Looked up now, outside any graph capture.
    fn new(m: &nvrtc::Module) -> Result<IpcKernels> {
        // SAFETY: `m` is kernels/comm.cu's module, the bindings' source.
        unsafe {
            Ok(IpcKernels {
                wait_flags: Kernel::new(m, &WAIT_FLAGS, &[])?,
                wait_arrival_checked: Kernel::new(m, &WAIT_ARRIVAL_CHECKED, &[])?,
                signal_flags: Kernel::new(m, &SIGNAL_FLAGS, &[])?,
                begin_call: Kernel::new(m, &BEGIN_CALL, &[])?,
                put_bytes: Kernel::new(m, &PUT_BYTES, &[])?,
            })
        }
    }
}

/// One block of 32 threads (one thread per peer): the flag kernels' shape.
const FLAG_SHAPE: ((u32, u32, u32), (u32, u32, u32)) = ((1, 1, 1), (32, 1, 1));

/// What [`IpcTransport::map_peers`] reached: each peer's buffer and flags (None: this
/// rank), whether every peer is in this process, whether every peer is on another device.
struct Mapped {
    buffers: Vec<Option<PeerMem>>,
    flags: Vec<Option<PeerMem>>,
    in_process: bool,
    remote_peers: bool,
}

// SAFETY: device addresses and owned handles; used from one thread at a time per object.
unsafe impl Send for IpcTransport {}

/// The call barrier's own flag slots, after the algorithms' ([`ALGO_SLOTS`]): "I finished
/// call seq" (nobody reads or writes my buffer for it any more), and "I entered call seq"
/// (signalled after my previous call completed on my GPU).
const DONE: FlagSlot = FlagSlot(ALGO_SLOTS as u8);
const ARRIVE: FlagSlot = FlagSlot(ALGO_SLOTS as u8 + 1);

/// The registry's entry: auto allows it where the whole group shares this node (and
/// picks it where every group of the world does).
pub const ENTRY: Constructor = Constructor {
    auto: |p| p.one_node,
    create: |s| {
        let st = s.settings;
        let settings = IpcSettings {
            buffer_bytes: st.buffer_bytes,
            use_ce: st.use_ce,
            comm_sms: st.comm_sms,
            timeout_ms: st.timeout_ms,
            check: st.check,
            away: s.placement.away.as_ref().map(|(w, host, mine)| {
                format!(
                    "world rank {w} (host {host}) is on another node than rank {} (host {mine}): the IPC transport needs the whole tensor-parallel group on one node (use the NCCL transport)",
                    s.bs.rank
                )
            }),
        };
        Ok(Box::new(IpcTransport::create(
            s.bs, s.group, s.guard, s.dev, &settings,
        )?))
    },
};

/// Byte offset of (slot, source) in a rank's flag array.
fn flag_offset(slot: FlagSlot, src: usize) -> usize {
    (slot.index() * MAX_PEERS + src) * 8
}

/// Byte offset of source `src`'s {descriptor, call number} check slot in a rank's flag
/// memory (after the flags).
fn check_offset(src: usize) -> usize {
    NUM_SLOTS * MAX_PEERS * 8 + src * 16
}

/// Bytes of a rank's flag memory: the flags, then one check slot per source.
const FLAG_BYTES: usize = NUM_SLOTS * MAX_PEERS * 8 + MAX_PEERS * 16;

pub struct IpcSettings {
    pub buffer_bytes: usize,
    pub use_ce: bool,
    pub comm_sms: u32,
    pub timeout_ms: u64,
    pub check: bool,
    /// why the group cannot use this transport (a member on another node), if it cannot:
    /// refused in the agreed local step, so that other groups are not left waiting
    pub away: Option<String>,
}

impl IpcTransport {
    /// The address `offset` bytes into `peer`'s buffer, where `rows` runs of `bytes`,
    /// `pitch` apart, are written: checked to stay inside the buffer (every rank's has
    /// this rank's size, checked when the group was made), an internal error otherwise.
    fn peer_range(
        &self,
        peer: usize,
        offset: usize,
        bytes: usize,
        rows: usize,
        pitch: usize,
    ) -> Result<DevPtr> {
        let span = rows
            .checked_sub(1)
            .map_or(Some(0), |r| r.checked_mul(pitch))
            .and_then(|s| s.checked_add(bytes))
            .and_then(|s| s.checked_add(offset));
        let size = self.group.buffer.bytes;
        if span.is_none_or(|end| end > size) || (rows > 1 && pitch < bytes) {
            return Err(crate::error::Error::internal(format!(
                "a put of {rows} x {bytes} bytes (pitch {pitch}) at offset {offset} leaves rank {peer}'s {size}-byte buffer"
            )));
        }
        Ok(self.peer_buffer(peer) + offset)
    }

    /// Collective over the world: every rank calls it with the same `group` (world ranks
    /// of its tensor-parallel group, in group order). Exchanges IPC handles through the
    /// bootstrap and maps the group's buffers and flags.
    pub fn create(
        bs: &Bootstrap,
        group: &[usize],
        guard: &ContextGuard,
        dev: &DeviceInfo,
        s: &IpcSettings,
    ) -> Result<IpcTransport> {
        if group.len() > MAX_PEERS {
            unsupported!(
                "tensor-parallel size {} exceeds the IPC transport's maximum of {MAX_PEERS}",
                group.len()
            );
        }
        // This rank's memory and kernels; every rank's outcome is exchanged before the
        // handles, so that one that fails here (out of memory, most likely) makes them
        // all fail instead of leaving them in the handle exchange.
        let local = || -> crate::error::Result<_> {
            if let Some(why) = &s.away {
                unsupported!("{why}");
            }
            let module = nvrtc::module(&nvrtc::COMM, guard.id, dev)?;
            let buffer = DeviceMem::new(s.buffer_bytes)?;
            let flags = DeviceMem::new(FLAG_BYTES)?;
            flags.zero()?;
            // the call counter, then the failure mark (kernels/comm.cu mark_failed)
            let counter = DeviceMem::new(16)?;
            counter.zero()?;
            let k = IpcKernels::new(&module)?;
            buffer.zero()?;
            let error = HostMapped::new(std::mem::size_of::<ErrorRecord>())?;
            let handles = [buffer.ipc_handle()?, flags.ipc_handle()?];
            Ok((module, buffer, flags, counter, k, error, handles))
        };
        let (module, buffer, flags, counter, k, error, handles) =
            bs.agree(local(), "make their IPC transport's memory")?;

        // Exchange the two IPC handles and this rank's in-process record (the group is on
        // one node: the local step refused it otherwise): a peer in another process is mapped
        // through its IPC handles, a peer in this process reached by its device pointers.
        let me = Local::new(guard.ctx, guard.device, buffer.ptr, flags.ptr);
        // ... and the device's UUID (all zero where unknown), which tells whether a peer
        // in another process is on another device.
        let uuid = device_uuid(guard.device);
        let mut mine = Vec::with_capacity(128 + LOCAL_BYTES + 16);
        mine.extend_from_slice(&handles.concat());
        mine.extend_from_slice(&me.to_bytes());
        mine.extend_from_slice(&uuid.unwrap_or_default());
        let rec = mine.len();
        let all = bs.allgather(&mine)?;
        let mapped = Self::map_peers(bs, group, &me, uuid, (&all, rec));
        // Nobody signals before every rank has zeroed its flags and mapped its peers; a
        // rank that could not map them says so here too (instead of leaving its peers at
        // a barrier until their timeout), and every rank fails together.
        let Mapped {
            buffers: peer_buffers,
            flags: peer_flags,
            in_process,
            remote_peers,
        } = bs.agree(
            mapped,
            "reach their peers' memory through the IPC transport",
        )?;
        Ok(IpcTransport {
            group: Group::new(bs.rank, group, buffer),
            flags,
            counter,
            peer_buffers,
            peer_flags,
            in_process: in_process && group.len() > 1,
            remote_peers: remote_peers && group.len() > 1,
            error,
            use_ce: s.use_ce,
            comm_sms: s.comm_sms.max(1),
            timeout_ns: s.timeout_ms.saturating_mul(1_000_000),
            check: s.check,
            _module: module,
            k,
        })
    }

    /// Map (other processes: CUDA IPC) or reach (this process: device pointers, peer
    /// access enabled) every peer's buffer and flags, from the allgathered records `all`
    /// of `rec` bytes each.
    fn map_peers(
        bs: &Bootstrap,
        group: &[usize],
        me: &Local,
        uuid: Option<[u8; 16]>,
        (all, rec): (&[u8], usize),
    ) -> Result<Mapped> {
        let entry = |w: usize| &all[w * rec..(w + 1) * rec];
        let mut p = Mapped {
            buffers: Vec::with_capacity(group.len()),
            flags: Vec::with_capacity(group.len()),
            in_process: true,
            remote_peers: true,
        };
        for &w in group {
            if w == bs.rank {
                p.buffers.push(None);
                p.flags.push(None);
                continue;
            }
            let e = entry(w);
            let peer = Local::from_bytes(&e[128..128 + LOCAL_BYTES]);
            let peer_uuid = &e[128 + LOCAL_BYTES..];
            if me.same_process(&peer) {
                enable_access(me, &peer)
                    .map_err(|er| er.context(format!("reaching world rank {w} in this process")))?;
                p.remote_peers &= peer.device != me.device;
                p.buffers.push(Some(PeerMem::InProcess(peer.buffer)));
                p.flags.push(Some(PeerMem::InProcess(peer.flags)));
                continue;
            }
            p.in_process = false;
            let hb: [u8; 64] = e[..64].try_into().unwrap();
            let hf: [u8; 64] = e[64..128].try_into().unwrap();
            p.remote_peers &=
                uuid.is_some_and(|u| u[..] != *peer_uuid && peer_uuid.iter().any(|&b| b != 0));
            p.buffers
                .push(Some(PeerMem::Ipc(IpcMapping::open(&hb).map_err(|er| {
                    er.context(format!("mapping the buffer of world rank {w}"))
                })?)));
            p.flags
                .push(Some(PeerMem::Ipc(IpcMapping::open(&hf).map_err(|er| {
                    er.context(format!("mapping the flags of world rank {w}"))
                })?)));
        }
        Ok(p)
    }

    fn flags_base(&self, peer: usize) -> DevPtr {
        if peer == self.group.tp_rank {
            self.flags.ptr
        } else {
            self.peer_flags[peer].as_ref().unwrap().ptr()
        }
    }

    fn flag_set(&self, peers: &[usize], addr: impl Fn(usize) -> DevPtr) -> PeerSet {
        PeerSet::new(peers, &self.group.world_ranks, addr)
    }
}

impl IpcTransport {
    fn others(&self) -> super::Peers {
        self.group.others()
    }
}

impl Transport for IpcTransport {
    fn group(&self) -> &Group {
        &self.group
    }
    /// "inproc" when every peer is in this process, else "ipc".
    fn name(&self) -> &'static str {
        if self.in_process { "inproc" } else { "ipc" }
    }
    fn idle_alone(&self) -> bool {
        true
    }
    fn peer_memory(&self) -> Option<&dyn PeerMemory> {
        Some(self)
    }
    fn two_sided(&self) -> Option<&dyn TwoSided> {
        Some(self)
    }
    /// The call counter is incremented, the call's descriptor written into every peer's
    /// check slot for this rank, then the arrival barrier (tag 1): a rank signals only
    /// once its previous call completed on its GPU, so passing it also means no peer still
    /// touches a buffer for the last call. One kernel increments, writes and signals, a
    /// second waits (and with NVTE_COMM_CHECK compares the peers' descriptors with this
    /// rank's: the same kernel, no extra launch). At tp 1 nothing reads the counter: no
    /// launch.
    fn begin_call(
        &self,
        _calls: u64,
        stream: StreamHandle,
        info: WaitInfo,
        desc: u64,
    ) -> Result<()> {
        let others = self.others();
        if others.is_empty() {
            return Ok(());
        }
        let me = self.group.tp_rank;
        let set = self.flag_set(&others, |p| self.flags_base(p) + flag_offset(ARRIVE, me));
        let check = self.flag_set(&others, |p| self.flags_base(p) + check_offset(me));
        let counter = self.counter.ptr;
        // SAFETY: begin_call(FlagSet, FlagSet, u64 *counter, u64 desc) of
        // kernels/comm.cu in this object's module (its device's context, current for calls
        // on `stream`); `set` and `check` (repr(C), the kernel's layout) hold the peers'
        // mapped flag and check-slot addresses, `counter` this object's device counter: all
        // live as long as the object.
        unsafe {
            self.k
                .begin_call
                .launch(FLAG_SHAPE, stream, (set, check, counter, desc))?
        };
        if !self.check {
            return self.wait(&others, ARRIVE, 1, stream, info);
        }
        let wait = self.flag_set(&others, |p| self.flags.ptr + flag_offset(ARRIVE, p));
        let slots = self.flag_set(&others, |p| self.flags.ptr + check_offset(p));
        let err = self.error.device;
        let op = info.op;
        let params = (wait, slots, counter, desc, self.timeout_ns, err, op);
        // SAFETY: wait_arrival_checked(FlagSet, CheckSet, const u64 *counter, u64
        // desc, u64 timeout_ns, ErrorRecord *err, u32 op) of kernels/comm.cu in this
        // object's module; `wait` / `slots` (repr(C)) hold this rank's own flag and check
        // slot addresses, `err` the device address of its host-mapped ErrorRecord: all live
        // as long as the object.
        unsafe {
            self.k
                .wait_arrival_checked
                .launch(FLAG_SHAPE, stream, params)
        }
    }
    /// "Done" with tag 1: (call number << 16) + 1.
    fn end_call(&self, _calls: u64, stream: StreamHandle) -> Result<()> {
        self.signal(&self.others(), DONE, 1, stream)
    }
    /// Waits for "done" >= (call number << 16) (tag 0): the peers' end of the last call
    /// begun here, and nothing when no call ever ran (counter 0).
    fn wait_done(&self, calls: u64, stream: StreamHandle, info: WaitInfo) -> Result<()> {
        if calls == 0 {
            return Ok(());
        }
        self.wait(&self.others(), DONE, 0, stream, info)
    }
    fn timeout(&self) -> Option<Timeout> {
        // SAFETY: the host side of this object's host-mapped record, written by the device.
        unsafe { ErrorRecord::read(self.error.host as *const ErrorRecord) }
    }

    fn comm_sms(&self) -> u32 {
        if self.use_ce { 0 } else { self.comm_sms }
    }
    fn set_comm_sms(&mut self, n: u32) {
        self.comm_sms = n.max(1);
    }
    fn set_use_ce(&mut self, on: bool) {
        self.use_ce = on;
    }
    /// Peers in this process write the buffer and flags by device pointer: leaked rather
    /// than freed, so the addresses cannot go to another allocation of this process.
    /// (Peers in other processes write through their IPC mappings of this allocation.)
    fn keep_memory_after_failure(&mut self) {
        let in_process = self
            .peer_flags
            .iter()
            .any(|p| matches!(p, Some(PeerMem::InProcess(_))));
        if in_process {
            self.group.buffer.leak();
            self.flags.leak();
        }
    }
}

impl PeerMemory for IpcTransport {
    fn peers_on_other_devices(&self) -> bool {
        self.remote_peers
    }
    fn peer_buffer(&self, peer: usize) -> DevPtr {
        if peer == self.group.tp_rank {
            self.group.buffer.ptr
        } else {
            // (mapped for every peer when the object was created)
            self.peer_buffers[peer]
                .as_ref()
                .map_or(DevPtr::NULL, |m| m.ptr())
        }
    }

    fn put(
        &self,
        peer: usize,
        offset: usize,
        src: DevPtr,
        bytes: usize,
        stream: StreamHandle,
    ) -> Result<()> {
        let dst = self.peer_range(peer, offset, bytes, 1, bytes)?;
        if self.use_ce {
            // SAFETY: `dst` is a checked range of the peer's mapped buffer; `src` is the
            // caller's device range of `bytes` (a plan's step: an engine buffer or a
            // checked tensor).
            return unsafe { copy_async(dst, src, bytes, stream) };
        }
        if bytes == 0 {
            return Ok(());
        }
        let n = bytes as u64;
        let shape = ((self.comm_sms, 1, 1), (1024, 1, 1));
        // SAFETY: put_bytes of this object's module (its device's context); `dst` lies in
        // the peer's mapped buffer (callers keep offset + bytes inside it), `src` is the
        // caller's device range.
        unsafe { self.k.put_bytes.launch(shape, stream, (dst, src, n)) }
    }

    fn signal(
        &self,
        peers: &[usize],
        slot: FlagSlot,
        tag: u64,
        stream: StreamHandle,
    ) -> Result<()> {
        if peers.is_empty() {
            return Ok(());
        }
        let me = self.group.tp_rank;
        let set = self.flag_set(peers, |p| self.flags_base(p) + flag_offset(slot, me));
        let counter = self.counter.ptr;
        // Data signals stop once this rank's waits failed (its peers then time out
        // instead of taking what it forwards); "done" does not (see kernels/comm.cu).
        let data = (slot != DONE) as u32;
        // SAFETY: signal_flags of this object's module (its device's context); `set`
        // (repr(C)) holds the peers' mapped flag addresses, `counter` this object's device
        // counter and failure mark: all live as long as the object.
        unsafe {
            self.k
                .signal_flags
                .launch(FLAG_SHAPE, stream, (set, counter, tag, data))
        }
    }

    fn wait(
        &self,
        peers: &[usize],
        slot: FlagSlot,
        tag: u64,
        stream: StreamHandle,
        info: WaitInfo,
    ) -> Result<()> {
        if peers.is_empty() {
            return Ok(());
        }
        let set = self.flag_set(peers, |p| self.flags.ptr + flag_offset(slot, p));
        let err = self.error.device;
        let counter = self.counter.ptr;
        let params = (set, counter, tag, self.timeout_ns, err, info.op, info.step);
        // SAFETY: wait_flags of this object's module (its device's context); `set`
        // (repr(C)) holds this rank's own flag addresses, `counter` its device counter and
        // `err` the device address of its host-mapped ErrorRecord (repr(C)): all live as
        // long as the object.
        unsafe { self.k.wait_flags.launch(FLAG_SHAPE, stream, params) }
    }
}

impl TwoSided for IpcTransport {
    /// Puts (the start), then one signal per destination and one wait for all sources
    /// (the finish).
    fn exchange(
        &self,
        part: ExchangePart,
        sends: &[SendOp],
        recvs: &[RecvOp],
        slot: FlagSlot,
        tag: u64,
        stream: StreamHandle,
        info: WaitInfo,
    ) -> Result<()> {
        if part != ExchangePart::Finish {
            for s in sends {
                if s.rows > 1 {
                    // A column slice: one 2D copy, whether puts go by copy engines or SM
                    // kernels (a copy engine across devices, a kernel within one).
                    let dst = self.peer_range(s.peer, s.dst_offset, s.bytes, s.rows, s.pitch)?;
                    // SAFETY: `dst` is a checked pitched range of the peer's mapped buffer;
                    // `src` the send's range (a plan's step) of the same shape.
                    unsafe { copy_2d(dst, s.pitch, s.src, s.pitch, s.bytes, s.rows, stream)? };
                } else {
                    self.put(s.peer, s.dst_offset, s.src, s.bytes, stream)?;
                }
            }
        }
        if part == ExchangePart::Start {
            return Ok(());
        }
        let dsts: super::Peers = sends.iter().map(|s| s.peer).collect();
        self.signal(&dsts, slot, tag, stream)?;
        let srcs: super::Peers = recvs.iter().map(|r| r.peer).collect();
        self.wait(&srcs, slot, tag, stream, info)
    }
    fn concurrent_streams(&self) -> bool {
        true
    }
    fn strided(&self) -> bool {
        true
    }
}
