//! Transports move chunks between the ranks of a tensor-parallel group. The algorithms in
//! `crate::overlap` are written once against [`Transport`]:
//! - `ipc`: one node; buffers shared through CUDA IPC, copy-engine or SM puts, flags
//!   with timed waits, and direct loads from peers' buffers;
//! - `inproc`: peers in the same process (one process driving several GPUs) are reached
//!   by their device pointers with peer access, by the same code as `ipc` (chosen per
//!   peer when the group is created);
//! - `nccl`: any placement (also across nodes); ncclSend / ncclRecv for the exchange
//!   steps and NCCL collectives where an algorithm needs peer loads.
#[cfg(test)]
pub mod fake;
pub mod inproc;
pub mod ipc;
pub mod nccl;

use crate::bootstrap::Bootstrap;
use crate::cuda::StreamHandle;
use crate::cuda::resources::DeviceMem;
use crate::cuda::{ContextGuard, DevPtr, DeviceInfo};
use crate::error::Result;
use crate::tensor::DType;
use crate::unsupported;

/// Which transport a group asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// the first registered transport that reaches every group of the world (the
    /// registry's order: peer memory when every group shares a node, else NCCL; see
    /// [`create`])
    Auto,
    /// the registered transport of this name ([`Entry::name`])
    Named(&'static str),
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

/// Where the group's ranks are, as the factory found them (host identities exchanged
/// through the bootstrap).
pub struct Placement {
    /// every member of the group is on this rank's node
    pub one_node: bool,
    /// the first member on another node: (its world rank, its host, this rank's host)
    pub away: Option<(usize, String, String)>,
}

/// What a transport's constructor gets (collective over the world: every rank calls it
/// with its group).
pub struct Setup<'a> {
    pub bs: &'a Bootstrap,
    /// world ranks of this rank's group, in group order
    pub group: &'a [usize],
    pub guard: &'a ContextGuard,
    pub dev: &'a DeviceInfo,
    pub settings: &'a Settings,
    pub placement: &'a Placement,
}

/// What a transport module gives its table row: whether [`Kind::Auto`] may pick it for a
/// placement, and its constructor.
pub struct Constructor {
    pub auto: fn(&Placement) -> bool,
    pub create: fn(&Setup) -> Result<Box<dyn Transport>>,
}

/// A registered transport: a row of the transport table (`table.in`): its name, its C
/// value (`NVTECommTransport`), its auto rule and its constructor.
pub struct Entry {
    pub name: &'static str,
    pub value: u32,
    pub auto: fn(&Placement) -> bool,
    pub create: fn(&Setup) -> Result<Box<dyn Transport>>,
}

/// The registry, and the (value, name) of every choice, from the table's rows.
macro_rules! transport_table {
    (
        $(#[doc = $doc:literal])*
        after $after:ident;
        auto: $auto:ident = $auto_val:literal;
        $( $(#[$m:meta])* $var:ident = $val:literal, $name:literal => $($ctor:ident)::+ ; )*
    ) => {
        /// The transports, in the order [`Kind::Auto`] tries them.
        pub static REGISTRY: &[Entry] = &[
            $(
                $(#[$m])*
                Entry {
                    name: $name,
                    value: $val,
                    auto: $($ctor)::+.auto,
                    create: $($ctor)::+.create,
                },
            )*
        ];
        /// The config's value of [`Kind::Auto`].
        pub const AUTO_VALUE: u32 = $auto_val;
    };
}

include!("table.in");

/// The name of every choice, auto first, at the index of its C value (the words of
/// NVTE_COMM_TRANSPORT, whose index is the value: `src/env.rs` reads the same table).
pub fn choice_names() -> impl Iterator<Item = &'static str> {
    std::iter::once("auto").chain(REGISTRY.iter().map(|e| e.name))
}

/// The transport a config's choice asks for (the C API's `NVTECommTransport` values;
/// auto, or a value no row has: auto).
pub fn kind_of_choice(choice: u32) -> Kind {
    REGISTRY
        .iter()
        .find(|e| e.value == choice)
        .map_or(Kind::Auto, |e| Kind::Named(e.name))
}

/// The name of a config's transport choice (as NVTE_COMM_TRANSPORT spells it).
pub fn choice_name(choice: u32) -> &'static str {
    match kind_of_choice(choice) {
        Kind::Named(n) => n,
        Kind::Auto => "auto",
    }
}

/// Whether `choice` is a declared value (auto or a row's).
pub fn is_choice(choice: u32) -> bool {
    choice == AUTO_VALUE || REGISTRY.iter().any(|e| e.value == choice)
}

/// The declared values for a message: "0 (auto), 1 (ipc) or 2 (nccl)".
pub fn choices_text() -> String {
    let all: Vec<String> = std::iter::once(AUTO_VALUE)
        .chain(REGISTRY.iter().map(|e| e.value))
        .zip(choice_names())
        .map(|(v, n)| format!("{v} ({n})"))
        .collect();
    match all.split_last() {
        Some((last, rest)) if !rest.is_empty() => format!("{} or {last}", rest.join(", ")),
        _ => all.join(""),
    }
}

/// The registered transport named `name`.
pub fn entry(name: &str) -> Option<&'static Entry> {
    REGISTRY.iter().find(|e| e.name == name)
}

/// The transport factory (collective over the world: every rank calls it with its
/// group): checks that every rank made the same buffer, finds where the group's ranks
/// are, and creates the first registered transport that `s.kind` allows on every rank of
/// the world (one transport for all groups).
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
    let away = group.iter().find(|&&w| id(w) != id(bs.rank)).map(|&w| {
        (
            w,
            crate::bootstrap::host_name(id(w)),
            crate::bootstrap::host_name(id(bs.rank)),
        )
    });
    let placement = Placement {
        one_node: away.is_none(),
        away,
    };
    // The same buffer in the whole group, and a transport that reaches it: what one group
    // refuses here, every rank hears of (the other groups would go on into their
    // transport's exchanges and wait there for this one).
    let chosen = || -> Result<u32> {
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
        let allowed = allowed(s.kind, &placement);
        if allowed == 0 {
            unsupported!("no registered transport {:?} reaches this group", s.kind);
        }
        Ok(allowed)
    };
    let allowed = bs.agree(chosen(), "set up their group's transport")?;
    // One transport for the whole world: each transport's creation runs its own exchanges
    // over the world's bootstrap, so groups that chose differently (auto, where one group
    // shares a node and another spans two) would pair unrelated exchanges and hang or
    // mix their data. Every rank takes the first transport that every rank allows.
    let all = bs.allgather(&allowed.to_le_bytes())?;
    let e = common_entry(&all)?;
    (e.create)(&Setup {
        bs,
        group,
        guard,
        dev,
        settings: s,
        placement: &placement,
    })
}

/// The registry's entries (bit i: `REGISTRY[i]`) that `kind` allows for a group placed as
/// `placement`: auto, every transport whose rule reaches it; a name, its transport alone.
/// (The registry holds at most 32 rows: `at_most_32_transports`.)
fn allowed(kind: Kind, placement: &Placement) -> u32 {
    REGISTRY
        .iter()
        .enumerate()
        .take(32)
        .filter(|(_, e)| match kind {
            Kind::Auto => (e.auto)(placement),
            Kind::Named(n) => e.name == n,
        })
        .fold(0, |m, (i, _)| m | 1 << i)
}

/// The first registered transport that every rank allows (`all`: each world rank's
/// [`allowed`] bits, 4 bytes little-endian), or an error naming the first two ranks whose
/// transports differ (every rank computes the same verdict from the same bytes).
fn common_entry(all: &[u8]) -> Result<&'static Entry> {
    let masks: Vec<u32> = all
        .chunks_exact(4)
        .map(|b| u32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    let common = masks.iter().fold(u32::MAX, |m, &r| m & r);
    if let Some((_, e)) = REGISTRY
        .iter()
        .enumerate()
        .take(32)
        .find(|(i, _)| common & 1 << i != 0)
    {
        return Ok(e);
    }
    let names = |m: u32| -> Vec<&'static str> {
        REGISTRY
            .iter()
            .enumerate()
            .filter(|(i, _)| m & 1 << i != 0)
            .map(|(_, e)| e.name)
            .collect()
    };
    // (the first rank that shares nothing with the ranks before it)
    let mut before = u32::MAX;
    let mut pair = (0, 0);
    for (w, &m) in masks.iter().enumerate() {
        if before & m == 0 {
            let q = masks.iter().position(|&o| o & m == 0).unwrap_or(0);
            pair = (q, w);
            break;
        }
        before &= m;
    }
    let (q, w) = pair;
    unsupported!(
        "the groups of this world have no transport in common (every group must use the same one, whose creation exchanges over the whole world): world rank {q} can use {:?}, world rank {w} {:?}; set NVTE_COMM_TRANSPORT (or the config's transport) to one that every group reaches, e.g. nccl",
        names(masks[q]),
        names(masks[w])
    );
}

/// A flag slot: each rank holds one monotonically increasing 64-bit counter per (slot,
/// source rank). A wait is "counter >= value", so flags never need resetting. The
/// transport hands its slots out through [`FlagSlots`]; what a slot is for is the
/// algorithm's business (the transport keeps its own call barrier's slots apart).
///
/// Flag values are never computed on the host: a value is (call number << 16) + tag,
/// where the call number is a counter in this rank's device memory that
/// [`Transport::begin_call`] increments on the stream, and the tag (see [`tag`]) names the
/// step. Every execution of a call, eager or a replay of a captured CUDA graph, therefore
/// signals and waits for new values; a value fixed on the host would be frozen into a
/// captured graph, and every replay after the first would find its waits satisfied.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FlagSlot(pub(crate) u8);

impl FlagSlot {
    /// The slot's index in the transport's flag memory.
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// The flag slots a transport offers the algorithms: taken one at a time, each once.
#[derive(Clone, Copy, Debug)]
pub struct FlagSlots {
    next: u8,
    end: u8,
}

impl FlagSlots {
    /// Slots `0..n`.
    pub fn new(n: usize) -> FlagSlots {
        FlagSlots {
            next: 0,
            end: n.min(u8::MAX as usize) as u8,
        }
    }
    /// The next free slot; an error when the transport has no more.
    pub fn take(&mut self) -> Result<FlagSlot> {
        if self.next >= self.end {
            return Err(crate::error::Error::internal(format!(
                "the transport offers {} flag slots: all are taken",
                self.end
            )));
        }
        self.next += 1;
        Ok(FlagSlot(self.next - 1))
    }
}

pub const NUM_SLOTS: usize = 8;
/// Flag slots of the peer-memory transports for the algorithms: all but the call
/// barrier's own two (arrival, done).
pub(crate) const ALGO_SLOTS: usize = NUM_SLOTS - 2;
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

// SAFETY: a repr(C) struct passed by value (kernels/comm.cu's FlagSet and CheckSet, same
// layout: asserted there and in this module's tests).
unsafe impl crate::cuda::KernelArg for PeerSet {
    const INFO: crate::cuda::ParamInfo = crate::cuda::ParamInfo::by_value::<PeerSet>();
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
/// `dst_offset` in `peer`'s buffer; with `rows` > 1, `rows` runs of `bytes` each, `pitch`
/// bytes apart at both ends (a column slice of a row-major matrix: transports whose
/// [`TwoSided::strided`] is true only).
#[derive(Clone, Copy, Debug)]
pub struct SendOp {
    pub peer: usize,
    pub src: DevPtr,
    pub dst_offset: usize,
    pub bytes: usize,
    pub rows: usize,
    pub pitch: usize,
}

/// The matching receive: `bytes` (`rows` runs of them, `pitch` apart, as the send) from
/// `peer` land at `dst_offset` in this rank's buffer.
#[derive(Clone, Copy, Debug)]
pub struct RecvOp {
    pub peer: usize,
    pub dst_offset: usize,
    pub bytes: usize,
    pub rows: usize,
    pub pitch: usize,
}

impl SendOp {
    /// `bytes` in one contiguous run.
    pub fn contiguous(peer: usize, src: DevPtr, dst_offset: usize, bytes: usize) -> SendOp {
        SendOp {
            peer,
            src,
            dst_offset,
            bytes,
            rows: 1,
            pitch: bytes,
        }
    }
}

impl RecvOp {
    /// `bytes` in one contiguous run.
    pub fn contiguous(peer: usize, dst_offset: usize, bytes: usize) -> RecvOp {
        RecvOp {
            peer,
            dst_offset,
            bytes,
            rows: 1,
            pitch: bytes,
        }
    }
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

/// What every transport does: the group, the call's arrival barrier and end, failure
/// records and its settings. What it can move is asked of its capabilities
/// ([`Transport::peer_memory`], [`Transport::two_sided`], [`Transport::collectives`]):
/// the algorithms choose their variant from them when they plan a call, never from the
/// transport's name.
pub trait Transport: Send {
    /// The group and this rank's buffer.
    fn group(&self) -> &Group;
    /// The transport's name, for messages ("ipc", "inproc", "nccl"); never a decision.
    fn name(&self) -> &'static str;
    /// Start of a call on `stream`: increment the device-side call counter, then the
    /// group's arrival barrier, which also carries the call's descriptor `desc` (see
    /// [`call_desc`]; compared across ranks with NVTE_COMM_CHECK). `calls`: the calls
    /// issued on the object so far, this one included (a host count, eager and captured
    /// calls alike: diagnostics only).
    fn begin_call(&self, calls: u64, stream: StreamHandle, info: WaitInfo, desc: u64)
    -> Result<()>;
    /// End of the call on `stream`, after all of this rank's work (IPC: "done" signal).
    fn end_call(&self, calls: u64, stream: StreamHandle) -> Result<()>;
    /// Make `stream` wait until every peer finished the last call begun on this rank
    /// (the call number read on the device; IPC; NCCL: stream order already implies it).
    /// `calls` = 0 (nothing was ever issued) makes it a no-op.
    fn wait_done(&self, calls: u64, stream: StreamHandle, info: WaitInfo) -> Result<()>;
    /// Whether `begin_call`, `end_call` and `wait_done` enqueue nothing when the group is
    /// this rank alone (then an engine may run a call inline on the caller's stream).
    fn idle_alone(&self) -> bool {
        false
    }
    /// One-sided access to the peers' buffers and flags, if the transport has it.
    fn peer_memory(&self) -> Option<&dyn PeerMemory> {
        None
    }
    /// Two-sided exchange steps, if the transport has them.
    fn two_sided(&self) -> Option<&dyn TwoSided> {
        None
    }
    /// Collectives on the group, if the transport has them.
    fn collectives(&self) -> Option<&dyn Collectives> {
        None
    }
    /// The flag slots the algorithms may take (none without peer memory: two-sided
    /// exchanges of such a transport ignore their slot).
    fn flag_slots(&self) -> FlagSlots {
        FlagSlots::new(ALGO_SLOTS)
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

/// Capability: the peers' buffers are addressable (loads and stores by kernels, puts),
/// and flags order them.
pub trait PeerMemory {
    /// Direct load/store address of group member `peer`'s buffer (this rank's own too).
    fn peer_buffer(&self, peer: usize) -> DevPtr;
    /// Copy `bytes` from local `src` to `offset` in `peer`'s buffer, on `stream`.
    fn put(
        &self,
        peer: usize,
        offset: usize,
        src: DevPtr,
        bytes: usize,
        stream: StreamHandle,
    ) -> Result<()>;
    /// After the work already on `stream`: set `slot` (from this rank) to (call number <<
    /// 16) + `tag` at each peer.
    fn signal(&self, peers: &[usize], slot: FlagSlot, tag: u64, stream: StreamHandle)
    -> Result<()>;
    /// Make `stream` wait until each peer has signalled `slot` >= (call number << 16) +
    /// `tag`, or time out.
    fn wait(
        &self,
        peers: &[usize],
        slot: FlagSlot,
        tag: u64,
        stream: StreamHandle,
        info: WaitInfo,
    ) -> Result<()>;
    /// Whether every peer's buffer is on another device than this rank's, so that copies
    /// to it can run on copy engines (a copy within one device is a kernel on the H100
    /// and H200: bench/RESULTS.md, 2026-11-26 third session). Default: not known, false.
    fn peers_on_other_devices(&self) -> bool {
        false
    }
}

/// Which part of an exchange step to issue: the whole step, or the step in two parts on
/// one stream, so that other work can be issued between them (with one hardware queue,
/// work behind a step's trailing wait is held until the step's bytes have moved): `Start`
/// moves the bytes (peer memory: the puts), `Finish` with the same arguments completes
/// the step (peer memory: the signal to the destinations and the wait for the sources).
/// A transport whose step is one operation issues it on `Start` and nothing on `Finish`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExchangePart {
    Whole,
    Start,
    Finish,
}

/// Capability: two-sided exchange steps (every send matched by the peer's receive).
pub trait TwoSided {
    /// One exchange step on `stream` (or its `part`): every send lands in its peer's
    /// buffer, and once the step is done (in stream order) every receive has landed
    /// here. Peer memory orders it with `slot` flags of value (call number << 16) +
    /// `tag`; NCCL with grouped send / recv (ignoring the slot).
    #[allow(clippy::too_many_arguments)]
    fn exchange(
        &self,
        part: ExchangePart,
        sends: &[SendOp],
        recvs: &[RecvOp],
        slot: FlagSlot,
        tag: u64,
        stream: StreamHandle,
        info: WaitInfo,
    ) -> Result<()>;
    /// Whether exchange steps may run on several streams at once (NCCL: the operations of
    /// one communicator must not run concurrently on two streams).
    fn concurrent_streams(&self) -> bool;
    /// Whether sends and receives may be strided (`rows` > 1). Default: no.
    fn strided(&self) -> bool {
        false
    }
}

/// Capability: sum reductions and gathers over the group.
pub trait Collectives {
    /// All-reduce (sum) of `count` elements of `d` from `src` into `dst`.
    fn all_reduce(
        &self,
        src: DevPtr,
        dst: DevPtr,
        count: usize,
        d: DType,
        stream: StreamHandle,
    ) -> Result<()>;
    /// Reduce-scatter (sum): `src` holds tp * `recv_count` elements, `dst` gets this
    /// rank's `recv_count`.
    fn reduce_scatter(
        &self,
        src: DevPtr,
        dst: DevPtr,
        recv_count: usize,
        d: DType,
        stream: StreamHandle,
    ) -> Result<()>;
    /// All-gather of `bytes` per rank from `src` into `dst` (tp * `bytes`, rank order).
    fn all_gather_bytes(
        &self,
        src: DevPtr,
        dst: DevPtr,
        bytes: usize,
        stream: StreamHandle,
    ) -> Result<()>;
}

/// What a transport can do, as the algorithms plan with it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Caps {
    pub peer_memory: bool,
    pub two_sided: bool,
    pub collectives: bool,
    /// two-sided exchange steps may run on several streams at once
    pub concurrent_exchange: bool,
    /// the per-call barrier enqueues nothing when the group is this rank alone
    pub idle_alone: bool,
    /// peer memory on other devices only ([`PeerMemory::peers_on_other_devices`])
    pub remote_peers: bool,
    /// exchange steps may move strided column slices ([`TwoSided::strided`])
    pub strided_exchange: bool,
}

impl Caps {
    pub fn of(t: &dyn Transport) -> Caps {
        Caps {
            peer_memory: t.peer_memory().is_some(),
            two_sided: t.two_sided().is_some(),
            collectives: t.collectives().is_some(),
            concurrent_exchange: t.two_sided().is_some_and(|x| x.concurrent_streams()),
            idle_alone: t.idle_alone(),
            remote_peers: t.peer_memory().is_some_and(|p| p.peers_on_other_devices()),
            strided_exchange: t.two_sided().is_some_and(|x| x.strided()),
        }
    }
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

    #[test]
    fn at_most_32_transports() {
        assert!(REGISTRY.len() <= 32, "the transports' masks are u32");
    }

    #[test]
    fn every_group_of_a_world_takes_one_common_transport() {
        let place = |one_node: bool| Placement {
            one_node,
            away: (!one_node).then(|| (4, "b".to_string(), "a".to_string())),
        };
        let (here, across) = (place(true), place(false));
        let bytes = |m: &[u32]| -> Vec<u8> { m.iter().flat_map(|v| v.to_le_bytes()).collect() };
        let (ipc, nccl) = (
            allowed(Kind::Named("ipc"), &here),
            allowed(Kind::Named("nccl"), &here),
        );
        // auto: a group on one node reaches ipc and nccl, one across nodes nccl alone
        assert_eq!(allowed(Kind::Auto, &here), ipc | nccl);
        assert_eq!(allowed(Kind::Auto, &across), nccl);
        // every group on one node: ipc (the registry's first)
        let all = bytes(&[allowed(Kind::Auto, &here); 8]);
        assert_eq!(common_entry(&all).unwrap().name, "ipc");
        // one group spans two nodes: every group takes nccl, the one-node groups too
        let mixed = [true, true, false, false, true, true];
        let all = bytes(&mixed.map(|one| allowed(Kind::Auto, &place(one))));
        assert_eq!(common_entry(&all).unwrap().name, "nccl");
        // ranks naming different transports: the same error on every rank, naming both
        let Err(e) = common_entry(&bytes(&[ipc, ipc, nccl, nccl])) else {
            panic!("ranks naming ipc and nccl agreed on a transport");
        };
        assert_eq!(e.kind, crate::error::ErrorKind::Unsupported);
        assert!(
            e.msg
                .contains("world rank 0 can use [\"ipc\"], world rank 2 [\"nccl\"]"),
            "{}",
            e.msg
        );
        // a name and auto: the name where auto reaches it
        assert_eq!(
            common_entry(&bytes(&[nccl, ipc | nccl])).unwrap().name,
            "nccl"
        );
    }

    /// One rank's allgather: its own bytes.
    unsafe extern "C" fn gather_self(
        _user: *mut std::ffi::c_void,
        global: *mut std::ffi::c_void,
        global_bytes: usize,
        local: *const std::ffi::c_void,
        local_bytes: usize,
    ) -> i32 {
        assert_eq!(global_bytes, local_bytes);
        // SAFETY: the bootstrap passes buffers of the stated sizes.
        unsafe {
            std::ptr::copy_nonoverlapping(local as *const u8, global as *mut u8, local_bytes)
        };
        0
    }
    unsafe extern "C" fn no_barrier(_user: *mut std::ffi::c_void) -> i32 {
        0
    }

    /// A transport is chosen by its name through the user's path: NVTE_COMM_TRANSPORT's
    /// word (parsed as the knob parses it) gives the config's value, the value the
    /// registry's row, and the factory makes that transport.
    #[test]
    fn the_fake_transport_is_chosen_by_its_name_through_the_knob_and_the_factory() {
        let crate::env::Kind::Choice(words) = crate::env::TRANSPORT.0.kind else {
            panic!("NVTE_COMM_TRANSPORT is a choice");
        };
        assert_eq!(words, choice_names().collect::<Vec<_>>());
        let value =
            crate::env::parse_choice(crate::env::TRANSPORT.0.name, "Fake", words).unwrap() as u32;
        assert!(is_choice(value) && !is_choice(value + 1));
        assert_eq!(kind_of_choice(value), Kind::Named("fake"));
        assert_eq!(choice_name(value), "fake");
        assert_eq!(kind_of_choice(AUTO_VALUE), Kind::Auto);
        let bs = Bootstrap::from_callbacks(0, 1, Some(gather_self), Some(no_barrier), 0).unwrap();
        let dev = DeviceInfo {
            ordinal: 0,
            sm_count: 132,
            cc_major: 9,
            cc_minor: 0,
        };
        let settings = Settings {
            kind: kind_of_choice(value),
            buffer_bytes: 4096,
            use_ce: true,
            comm_sms: 2,
            timeout_ms: 1000,
            check: false,
        };
        let guard = ContextGuard::host_test();
        let t = create(&bs, &[0], &guard, &dev, &settings).unwrap();
        assert_eq!(t.name(), "fake");
        assert_eq!(t.group().world_ranks, [0]);
        // The config check's message for a value no row has lists the table's choices.
        assert_eq!(
            choices_text(),
            "0 (auto), 1 (ipc), 2 (nccl) or 3 (fake)",
            "the unit tests' table"
        );
    }

    /// The table's values are the choices' indices (NVTE_COMM_TRANSPORT's word index is
    /// the config's value), each once.
    #[test]
    fn transport_values_are_their_choice_index() {
        assert_eq!(AUTO_VALUE, 0);
        for (i, e) in REGISTRY.iter().enumerate() {
            assert_eq!(e.value as usize, i + 1, "{}", e.name);
            assert_eq!(entry(e.name).map(|x| x.value), Some(e.value));
        }
    }
}
