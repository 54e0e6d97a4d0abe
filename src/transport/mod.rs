//! Transports move chunks between the ranks of a tensor-parallel group. The algorithms in
//! `crate::overlap` are written once against [`Transport`]:
//! - `ipc`: one node; buffers shared through CUDA IPC, copy-engine or SM puts, flags
//!   with timed waits, and direct loads from peers' buffers;
//! - `inproc`: peers in the same process (one process driving several GPUs) are reached
//!   by their device pointers with peer access, by the same code as `ipc` (chosen per
//!   peer when the group is created);
//! - `nccl`: any placement (also across nodes); ncclSend / ncclRecv for the exchange
//!   steps and NCCL collectives where an algorithm needs peer loads.
pub mod inproc;
pub mod ipc;
pub mod nccl;

use crate::bootstrap::Bootstrap;
use crate::cuda::resources::DeviceMem;
use crate::cuda::{ContextGuard, DevPtr, DeviceInfo};
use crate::error::Result;
use crate::unsupported;

/// Which transport a group asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// peer memory when the whole group shares this node, else NCCL
    Auto,
    /// peer memory: CUDA IPC, or device pointers for peers in this process
    PeerMemory,
    /// NCCL point-to-point and collectives (any placement)
    Nccl,
}

/// What creating a transport needs besides the bootstrap and the group.
pub struct Settings {
    pub kind: Kind,
    pub buffer_bytes: usize,
    /// peer memory: copy-engine puts (else SM puts on `comm_sms` SMs)
    pub use_ce: bool,
    pub comm_sms: u32,
    pub timeout_ms: u64,
    /// NVTE_COMM_CHECK: compare the peers' call descriptors at every arrival
    pub check: bool,
}

/// The transport factory (collective over the world: every rank calls it with its
/// group): the one place that knows the transports. A new transport is its module plus
/// a `Kind` and an arm here.
pub fn create(
    bs: &Bootstrap,
    group: &[usize],
    guard: &ContextGuard,
    dev: &DeviceInfo,
    s: &Settings,
) -> Result<Box<dyn Transport>> {
    // Every rank's host and buffer size: all must have made the same buffer (puts into
    // peers are sized by this rank's view of it).
    let mut mine = crate::bootstrap::host_identity().to_vec();
    mine.extend_from_slice(&(s.buffer_bytes as u64).to_le_bytes());
    let ids = bs.allgather(&mine)?;
    let rec = mine.len();
    let id = |w: usize| &ids[w * rec..w * rec + 128];
    for &w in group {
        let b = u64::from_le_bytes(ids[w * rec + 128..(w + 1) * rec].try_into().unwrap());
        if b != s.buffer_bytes as u64 {
            crate::invalid!(
                "world rank {w} created its overlap object with a buffer of {b} bytes, world rank {} with {}: every rank of a group must create it with the same rows, cols and dtype",
                bs.rank,
                s.buffer_bytes
            );
        }
    }
    // Auto: peer memory when the whole group shares this node, else NCCL.
    let one_node = group.iter().all(|&w| id(w) == id(bs.rank));
    let use_nccl = s.kind == Kind::Nccl || (s.kind == Kind::Auto && !one_node);
    if !use_nccl && !one_node {
        let w = *group.iter().find(|&&w| id(w) != id(bs.rank)).unwrap();
        unsupported!(
            "world rank {w} (host {}) is on another node than rank {} (host {}): the IPC transport needs the whole tensor-parallel group on one node (use the NCCL transport)",
            crate::bootstrap::host_name(id(w)),
            bs.rank,
            crate::bootstrap::host_name(id(bs.rank))
        );
    }
    Ok(if use_nccl {
        let settings = nccl::NcclSettings {
            buffer_bytes: s.buffer_bytes,
            timeout_ms: s.timeout_ms,
            check: s.check,
        };
        Box::new(nccl::NcclTransport::create(
            bs, group, guard, dev, &settings,
        )?)
    } else {
        let settings = ipc::IpcSettings {
            buffer_bytes: s.buffer_bytes,
            use_ce: s.use_ce,
            comm_sms: s.comm_sms,
            timeout_ms: s.timeout_ms,
            check: s.check,
        };
        Box::new(ipc::IpcTransport::create(bs, group, guard, dev, &settings)?)
    })
}

/// Flag slots: each rank holds one monotonically increasing 64-bit counter per
/// (slot, source rank). A wait is "counter >= value", so flags never need resetting.
///
/// Flag values are never computed on the host: a value is (call number << 16) + tag,
/// where the call number is a counter in this rank's device memory that
/// [`Transport::begin_call`] increments on the stream, and the tag (see [`tag`]) names the
/// step. Every execution of a call, eager or a replay of a captured CUDA graph, therefore
/// signals and waits for new values; a value fixed on the host would be frozen into a
/// captured graph, and every replay after the first would find its waits satisfied.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Slot {
    /// ring all-gather, chunks travelling to the next rank
    AgForward = 0,
    /// ring all-gather, chunks travelling to the previous rank
    AgBackward = 1,
    /// pipelined reduce-scatter: "my chunk i is computed"
    RsReady = 2,
    /// ring reduce-scatter: "my partial for you has arrived"
    RsP2p = 3,
    /// bulk collectives
    Bulk = 4,
    /// "I finished call seq": nobody reads or writes my buffer for it any more
    Done = 5,
    /// "I entered call seq" (signalled after my previous call completed on my GPU)
    Arrive = 6,
    /// all-reduce (two-shot): "my slice of chunk i is reduced (load it)"
    ArReduced = 7,
}

pub const NUM_SLOTS: usize = 8;
pub const MAX_PEERS: usize = 16;

/// The tag of algorithm step `step` (flag value (call number << 16) + tag; steps < 65535).
pub fn tag(step: usize) -> u64 {
    debug_assert!(step < 0xFFFF);
    step as u64 + 1
}

/// What a wait is for: reported in the timeout message (with the call number the waiting
/// kernel read from the device-side counter).
#[derive(Clone, Copy, Debug)]
pub struct WaitInfo {
    pub op: u32,
    pub step: u32,
}

/// What stopped a call, as recorded by a transport.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FailureKind {
    /// a peer never signalled within the timeout
    Timeout,
    /// NVTE_COMM_CHECK: a peer called with another descriptor (operation, shapes, types)
    /// or another call number
    Mismatch,
    /// the transport failed (NCCL: an asynchronous error of the group's communicator)
    Transport,
}

/// A recorded failure of a call (a timeout, or a cross-rank mismatch).
#[derive(Clone, Debug)]
pub struct Timeout {
    pub kind: FailureKind,
    /// the peer that never signalled / that called differently (u32::MAX: unknown)
    pub peer_world_rank: u32,
    pub op: u32,
    pub step: u32,
    /// the call number (device-side counter) of the call that timed out
    pub seq: u64,
    pub waited_ms: f64,
    /// Mismatch: the peer's descriptor and call number
    pub peer_desc: u64,
    pub peer_seq: u64,
    /// the transport's own account (NCCL: which peers never arrived, NCCL's error)
    pub note: Option<String>,
}

impl Timeout {
    /// A failure of call `seq` in operation `op` noticed on the host (no peer named yet,
    /// no descriptors): the NCCL transport's watchdog and bounded waits.
    pub fn host(kind: FailureKind, op: u32, seq: u64, waited_ms: f64, note: String) -> Timeout {
        Timeout {
            kind,
            peer_world_rank: u32::MAX,
            op,
            step: 0,
            seq,
            waited_ms,
            peer_desc: 0,
            peer_seq: 0,
            note: Some(note),
        }
    }
}

/// The device-written failure record (kernels/comm.cu `ErrorRecord`), in host-mapped
/// memory: the first failing wait or check fills it; `code` 0 means none.
#[repr(C)]
pub struct ErrorRecord {
    pub code: u32,
    pub peer: u32,
    pub op: u32,
    pub step: u32,
    pub seq: u64,
    pub waited_ns: u64,
    pub peer_desc: u64,
    pub peer_seq: u64,
    /// claimed by the one device thread that records (it publishes `code` last)
    pub claim: u32,
    pub pad: u32,
}

impl ErrorRecord {
    /// The recorded failure, if any.
    ///
    /// # Safety
    /// `rec` is the host address of a live host-mapped `ErrorRecord`.
    pub unsafe fn read(rec: *const ErrorRecord) -> Option<Timeout> {
        // SAFETY: (caller) readable record; the device writes it, so volatile loads, and
        // `code` is published last (fence after the fields on the device).
        unsafe {
            // An acquire load of the code (published last by the device, after a system
            // fence): the fields read below are at least as new.
            let code = (*(std::ptr::addr_of!((*rec).code) as *const std::sync::atomic::AtomicU32))
                .load(std::sync::atomic::Ordering::Acquire);
            let kind = match code {
                0 => return None,
                2 => FailureKind::Mismatch,
                3 => FailureKind::Transport,
                _ => FailureKind::Timeout,
            };
            Some(Timeout {
                kind,
                peer_world_rank: std::ptr::read_volatile(&(*rec).peer),
                op: std::ptr::read_volatile(&(*rec).op),
                step: std::ptr::read_volatile(&(*rec).step),
                seq: std::ptr::read_volatile(&(*rec).seq),
                waited_ms: std::ptr::read_volatile(&(*rec).waited_ns) as f64 / 1e6,
                peer_desc: std::ptr::read_volatile(&(*rec).peer_desc),
                peer_seq: std::ptr::read_volatile(&(*rec).peer_seq),
                note: None,
            })
        }
    }
}

/// One address per peer, with the peers' world ranks (for error records): the layout of
/// kernels/comm.cu's `FlagSet` (flag addresses: this rank's own for waits, the peers' for
/// signals) and `CheckSet` (the peers' {descriptor, call number} check slots).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct PeerSet {
    pub addr: [DevPtr; MAX_PEERS],
    pub peer: [u32; MAX_PEERS],
    pub n: u32,
}

impl PeerSet {
    /// Addresses `addr(peer)` of group members `peers` (tp ranks); `world` maps tp ranks
    /// to world ranks.
    pub fn new(peers: &[usize], world: &[usize], addr: impl Fn(usize) -> DevPtr) -> PeerSet {
        let mut s = PeerSet {
            addr: [DevPtr::NULL; MAX_PEERS],
            peer: [0; MAX_PEERS],
            n: peers.len() as u32,
        };
        for (i, &p) in peers.iter().enumerate() {
            s.addr[i] = addr(p);
            s.peer[i] = world[p] as u32;
        }
        s
    }
}

/// A call's descriptor for the cross-rank check: a hash of the operation and of the
/// values that must agree on every rank (shapes, types, flags), the operation id in the
/// top byte (so a mismatch can name the peer's operation).
pub fn call_desc(op: u32, parts: &[u64]) -> u64 {
    // FNV-1a over the parts' bytes.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in std::iter::once(op as u64).chain(parts.iter().copied()) {
        for b in p.to_le_bytes() {
            h ^= b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    ((op as u64 & 0xff) << 56) | (h & 0x00ff_ffff_ffff_ffff)
}

/// The operation id in a descriptor from [`call_desc`].
pub fn desc_op(desc: u64) -> u32 {
    (desc >> 56) as u32
}

/// One point-to-point transfer of an exchange step: `bytes` from local `src` to
/// `dst_offset` in `peer`'s buffer.
#[derive(Clone, Copy, Debug)]
pub struct SendOp {
    pub peer: usize,
    pub src: DevPtr,
    pub dst_offset: usize,
    pub bytes: usize,
}

/// The matching receive: `bytes` from `peer` land at `dst_offset` in this rank's buffer.
#[derive(Clone, Copy, Debug)]
pub struct RecvOp {
    pub peer: usize,
    pub dst_offset: usize,
    pub bytes: usize,
}

/// What every transport holds: the group's members (world ranks, in group order), this
/// rank's index among them, and this rank's buffer.
pub struct Group {
    pub tp_rank: usize,
    pub world_ranks: Vec<usize>,
    pub buffer: DeviceMem,
}

impl Group {
    /// `me` is this rank's world rank; `members` contains it.
    pub fn new(me: usize, members: &[usize], buffer: DeviceMem) -> Group {
        let tp_rank = members
            .iter()
            .position(|&w| w == me)
            .expect("group contains this rank");
        Group {
            tp_rank,
            world_ranks: members.to_vec(),
            buffer,
        }
    }
    /// Every member but this rank (a list on the stack: no allocation per call).
    pub fn others(&self) -> Peers {
        (0..self.world_ranks.len())
            .filter(|&p| p != self.tp_rank)
            .collect()
    }
}

/// A list of group ranks (at most `MAX_PEERS`), on the stack.
pub type Peers = crate::host::Small<usize, MAX_PEERS>;

pub trait Transport: Send {
    /// The group and this rank's buffer.
    fn group(&self) -> &Group;
    /// "ipc", "inproc" or "nccl".
    fn name(&self) -> &'static str;
    /// One exchange step on `stream`: every send lands in its peer's buffer, and once the
    /// step is done (in stream order) every receive has landed here. IPC orders it with
    /// `slot` flags of value (call number << 16) + `tag`; NCCL with grouped send / recv.
    fn exchange(
        &self,
        sends: &[SendOp],
        recvs: &[RecvOp],
        slot: Slot,
        tag: u64,
        stream: usize,
        info: WaitInfo,
    ) -> Result<()>;
    /// Start of a call on `stream`: increment the device-side call counter, then the
    /// group's arrival barrier, which also carries the call's descriptor `desc` (see
    /// [`call_desc`]; compared across ranks with NVTE_COMM_CHECK). `calls`: the calls
    /// issued on the object so far, this one included (a host count, eager and captured
    /// calls alike: diagnostics only).
    fn begin_call(&self, calls: u64, stream: usize, info: WaitInfo, desc: u64) -> Result<()>;
    /// End of the call on `stream`, after all of this rank's work (IPC: "done" signal).
    fn end_call(&self, calls: u64, stream: usize) -> Result<()>;
    /// Make `stream` wait until every peer finished the last call begun on this rank
    /// (the call number read on the device; IPC; NCCL: stream order already implies it).
    /// `calls` = 0 (nothing was ever issued) makes it a no-op.
    fn wait_done(&self, calls: u64, stream: usize, info: WaitInfo) -> Result<()>;
    /// The NCCL transport, for algorithms that run NCCL collectives on the group.
    fn nccl(&self) -> Option<&nccl::NcclTransport> {
        None
    }
    /// Ranks in the group (tensor-parallel size) and this rank's index in it.
    fn size(&self) -> usize {
        self.group().world_ranks.len()
    }
    fn rank(&self) -> usize {
        self.group().tp_rank
    }
    /// World rank of group member `peer`.
    fn world_rank(&self, peer: usize) -> usize {
        self.group().world_ranks[peer]
    }
    /// This rank's registered buffer (device address) and its size in bytes.
    fn buffer(&self) -> DevPtr {
        self.group().buffer.ptr
    }
    fn buffer_bytes(&self) -> usize {
        self.group().buffer.bytes
    }
    /// Direct load/store address of a peer's buffer, when the transport has one.
    fn peer_buffer(&self, peer: usize) -> Option<DevPtr>;
    /// Copy `bytes` from local `src` to `offset` in `peer`'s buffer, on `stream`.
    fn put(
        &self,
        peer: usize,
        offset: usize,
        src: DevPtr,
        bytes: usize,
        stream: usize,
    ) -> Result<()>;
    /// After the work already on `stream`: set `slot` (from this rank) to (call number <<
    /// 16) + `tag` at each peer.
    fn signal(&self, peers: &[usize], slot: Slot, tag: u64, stream: usize) -> Result<()>;
    /// Make `stream` wait until each peer has signalled `slot` >= (call number << 16) +
    /// `tag`, or time out.
    fn wait(
        &self,
        peers: &[usize],
        slot: Slot,
        tag: u64,
        stream: usize,
        info: WaitInfo,
    ) -> Result<()>;
    /// The first timeout recorded by any wait, if one happened.
    fn timeout(&self) -> Option<Timeout>;
    /// SMs the transport's kernels use (0: copy engine only).
    fn comm_sms(&self) -> u32;
    /// Set the SM budget of the transport's put kernels (between calls; the engine's
    /// per-call comm_sm_count). Transports without SM kernels ignore it.
    fn set_comm_sms(&mut self, _n: u32) {}
    /// Copy-engine (true) or SM-kernel puts (between calls; the autotuner's choice).
    /// Transports that move no bytes themselves ignore it.
    fn set_use_ce(&mut self, _on: bool) {}
    /// The object failed and is being destroyed without waiting for its peers: do not
    /// free memory that peers may still write and that this process could reuse (peers in
    /// this process write it by device pointer). Default: nothing to keep.
    fn keep_memory_after_failure(&mut self) {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};

    /// The layouts kernels/comm.cu asserts with static_assert (same numbers).
    #[test]
    fn records_shared_with_the_kernels_have_their_layout() {
        assert_eq!(size_of::<ErrorRecord>(), 56);
        assert_eq!(offset_of!(ErrorRecord, claim), 48);
        assert_eq!(offset_of!(ErrorRecord, peer_desc), 32);
        assert_eq!(size_of::<PeerSet>(), 200);
        assert_eq!(offset_of!(PeerSet, peer), 128);
        assert_eq!(offset_of!(PeerSet, n), 192);
    }

    #[test]
    fn call_descriptors_keep_the_operation_and_tell_shapes_apart() {
        let a = call_desc(1, &[8192, 4096, 1024]);
        assert_eq!(desc_op(a), 1);
        assert_eq!(a, call_desc(1, &[8192, 4096, 1024]));
        assert_ne!(a, call_desc(1, &[8192, 4096, 1025]));
        assert_ne!(a, call_desc(2, &[8192, 4096, 1024]));
        assert_eq!(desc_op(call_desc(8, &[])), 8);
    }
}
