//! Transports move chunks between the ranks of a tensor-parallel group. The algorithms in
//! `crate::overlap` are written once against [`Transport`]:
//! - `ipc`: one node; buffers shared through CUDA IPC, copy-engine or SM puts, flags
//!   with timed waits, and direct loads from peers' buffers;
//! - `nccl`: any placement (also across nodes); ncclSend / ncclRecv for the exchange
//!   steps and NCCL collectives where an algorithm needs peer loads.
pub mod ipc;
pub mod nccl;

use crate::cuda::resources::DeviceMem;
use crate::error::Result;

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

/// A recorded timeout.
#[derive(Clone, Copy, Debug)]
pub struct Timeout {
    pub peer_world_rank: u32,
    pub op: u32,
    pub step: u32,
    /// the call number (device-side counter) of the call that timed out
    pub seq: u64,
    pub waited_ms: f64,
}

/// One point-to-point transfer of an exchange step: `bytes` from local `src` to
/// `dst_offset` in `peer`'s buffer.
#[derive(Clone, Copy, Debug)]
pub struct SendOp {
    pub peer: usize,
    pub src: usize,
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
    /// Every member but this rank.
    pub fn others(&self) -> Vec<usize> {
        (0..self.world_ranks.len())
            .filter(|&p| p != self.tp_rank)
            .collect()
    }
}

pub trait Transport: Send {
    /// The group and this rank's buffer.
    fn group(&self) -> &Group;
    /// "ipc" or "nccl".
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
    /// Start of a call on `stream` (IPC: increment the device-side call counter, then the
    /// group's arrival barrier). `calls`: the calls issued on the object so far, this one
    /// included (a host count, eager and captured calls alike: diagnostics only).
    fn begin_call(&self, calls: u64, stream: usize, info: WaitInfo) -> Result<()>;
    /// End of the call on `stream`, after all of this rank's work (IPC: "done" signal).
    fn end_call(&self, calls: u64, stream: usize) -> Result<()>;
    /// Make `stream` wait until every peer finished the last call begun on this rank
    /// (the call number read on the device; IPC; NCCL: stream order already implies it).
    /// `calls` = 0 (nothing was ever issued) makes it a no-op.
    fn wait_done(&self, calls: u64, stream: usize, info: WaitInfo) -> Result<()>;
    /// The NCCL communicator of the group, for transports that run collectives with it.
    fn nccl_comm(&self) -> Option<usize> {
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
    fn buffer(&self) -> usize {
        self.group().buffer.ptr
    }
    fn buffer_bytes(&self) -> usize {
        self.group().buffer.bytes
    }
    /// Direct load/store address of a peer's buffer, when the transport has one.
    fn peer_buffer(&self, peer: usize) -> Option<usize>;
    /// Copy `bytes` from local `src` to `offset` in `peer`'s buffer, on `stream`.
    fn put(
        &self,
        peer: usize,
        offset: usize,
        src: usize,
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
}
