//! Algorithms as plan + enqueue. An algorithm ([`Planner`]'s methods in `ag.rs`, `rs.rs`,
//! `ar.rs`, `bulk.rs`) validates its arguments and writes the call's work as a [`Plan`]:
//! a list of [`Step`]s on the call's logical streams ([`Lane`]), from the engine's
//! geometry, the transport's capabilities and the policy ([`Env`], a value) alone, with
//! no device call. [`enqueue`] then issues the steps in order through a [`Device`] (the
//! engine's streams, events, GEMMs and kernels) and the transport's capabilities. The
//! engine's device is the GPU; the host tests' is a recording fake, so the tests check
//! the very plans the GPU runs.
use super::policy::{Algo, Policy};
use super::schedule::PerRank;
use super::{Op, eb};
use crate::cuda::DevPtr;
use crate::cuda::StreamHandle;
use crate::error::{Error, Result};
use crate::gemm::GemmDesc;
use crate::gemm::sm90::{Hooks, SideCopy};
use crate::host::Small;
use crate::tensor::DType;
pub use crate::transport::ExchangePart as Part;
use crate::transport::{
    Caps, FlagSlot, FlagSlots, MAX_PEERS, Peers, RecvOp, SendOp, Transport, WaitInfo,
};

/// Words of a call's key (`begin`): the GEMM's check key and a few algorithm words.
pub(crate) const MAX_KEY_WORDS: usize = 16;

/// A stream of the call: compute stream i, comm stream j (0 runs the arrival barrier and
/// the call's end), or the caller's stream. An inline call maps every lane to the
/// caller's stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lane {
    Compute(usize),
    Comm(usize),
    Caller,
}

/// The flag slots the algorithms use, taken from the transport when the engine is
/// created (the transport does not know what they are for).
#[derive(Clone, Copy, Debug)]
pub struct AlgoSlots {
    /// ring all-gather, chunks travelling to the next rank
    pub ag_forward: FlagSlot,
    /// ring all-gather, chunks travelling to the previous rank
    pub ag_backward: FlagSlot,
    /// pipelined reduce-scatter / one-shot all-reduce: "my chunk i is computed"
    pub rs_ready: FlagSlot,
    /// ring reduce-scatter: "my partial for you has arrived"
    pub rs_p2p: FlagSlot,
    /// bulk collectives
    pub bulk: FlagSlot,
    /// all-reduce: "my reduced rows / slice of chunk i are there (load them)"
    pub ar_reduced: FlagSlot,
}

impl AlgoSlots {
    pub fn take(mut s: FlagSlots) -> Result<AlgoSlots> {
        Ok(AlgoSlots {
            ag_forward: s.take()?,
            ag_backward: s.take()?,
            rs_ready: s.take()?,
            rs_p2p: s.take()?,
            bulk: s.take()?,
            ar_reduced: s.take()?,
        })
    }
}

/// A reduction (kernels/comm.cu `reduce_<in>_<out>`): out[rows, cols] (row stride
/// `out_ld` elements) = sum over `srcs` (row stride `in_ld`) * `in_scale`.
#[derive(Clone, Copy, Debug)]
pub struct Reduce {
    pub out: DevPtr,
    pub out_type: DType,
    pub out_ld: usize,
    pub srcs: PerRank<DevPtr>,
    pub in_ld: usize,
    pub rows: usize,
    pub cols: usize,
    /// scale_inv of FP8 inputs (NULL: none)
    pub in_scale: DevPtr,
    /// an FP8 output's scale and amax (NULL: none)
    pub fp8_out: (DevPtr, DevPtr),
    /// nothing runs beside it: it may use every SM
    pub tail: bool,
}

/// Copy segments (dst, src, bytes) of one copy kernel.
pub type Segments = Small<(DevPtr, DevPtr, usize), MAX_PEERS>;

/// One step of a call's work.
#[derive(Clone, Debug)]
pub enum Step {
    /// the call's start: the arrival barrier; `gate_compute`: compute streams start after
    /// it (their GEMMs write memory peers read); `key`: what must agree across ranks
    Begin {
        op: Op,
        gate_compute: bool,
        key: Small<u64, MAX_KEY_WORDS>,
        full: Option<GemmDesc>,
    },
    /// the call's end: every stream joined into the caller's
    Finish,
    /// a GEMM on compute stream `index`; `concurrent`: GEMMs on other compute streams
    /// may run at the same time (the workspace is split); `side`: a copy the GEMM neither
    /// reads nor writes, done by the end of the step (in the same launch where our kernel
    /// computes the GEMM: gemm::run_copying, else the engine's copy kernel first; 0 bytes:
    /// none)
    Gemm {
        g: GemmDesc,
        index: usize,
        concurrent: bool,
        side: SideCopy,
    },
    /// record chunk event `ev` on `lane` / make `lane` wait for its last record
    Record {
        ev: usize,
        lane: Lane,
    },
    WaitEvent {
        ev: usize,
        lane: Lane,
    },
    /// two-sided exchange step (one send, one receive; `then`: a second pair moved after
    /// the first within the same step, before its one signal: the block scales of the
    /// all-gather's chunk behind its data)
    Exchange {
        send: SendOp,
        recv: RecvOp,
        then: Option<(SendOp, RecvOp)>,
        slot: FlagSlot,
        tag: u64,
        lane: Lane,
        info: WaitInfo,
        part: Part,
    },
    /// peer memory: put, signal, wait
    Put {
        peer: usize,
        offset: usize,
        src: DevPtr,
        bytes: usize,
        lane: Lane,
    },
    Signal {
        peers: Peers,
        slot: FlagSlot,
        tag: u64,
        lane: Lane,
    },
    Wait {
        peers: Peers,
        slot: FlagSlot,
        tag: u64,
        lane: Lane,
        info: WaitInfo,
    },
    /// local copies and a memset
    Copy {
        dst: DevPtr,
        src: DevPtr,
        bytes: usize,
        lane: Lane,
    },
    Copy2d {
        dst: DevPtr,
        dpitch: usize,
        src: DevPtr,
        spitch: usize,
        width: usize,
        height: usize,
        lane: Lane,
    },
    Memset {
        dst: DevPtr,
        bytes: usize,
        lane: Lane,
    },
    /// a u32 flag written once the lane's earlier work is done (cuStreamWriteValue32,
    /// with its memory barrier): the fused algorithms' local arrival flags
    WriteFlag {
        dst: DevPtr,
        value: u32,
        lane: Lane,
    },
    /// the lane waits until the u32 at `ptr` is >= `value` (cuStreamWaitValue32: no
    /// timeout, so only for signals of our own GEMM, which waits on nothing itself: the
    /// fused reduce-scatter's done signals)
    WaitFlag {
        ptr: DevPtr,
        value: u32,
        lane: Lane,
    },
    /// one launch of our own GEMM (`gemm::sm90`) on compute stream `index`, on at most
    /// `sms` SMs (0: all), waiting on / signalling through `hooks`
    FusedGemm {
        g: GemmDesc,
        hooks: Hooks,
        sms: usize,
        index: usize,
    },
    /// the engine's kernels
    Reduce {
        r: Reduce,
        lane: Lane,
    },
    CopySegments {
        segs: Segments,
        lane: Lane,
        tail: bool,
    },
    /// after the call: *out = max of the `n` amax slots, on the caller's stream (not in
    /// the report's comm-alone runs, which skip the GEMMs that write the slots)
    AmaxMax {
        out: DevPtr,
        slots: DevPtr,
        n: usize,
    },
    /// collectives
    AllReduce {
        src: DevPtr,
        dst: DevPtr,
        count: usize,
        dtype: DType,
        lane: Lane,
    },
    ReduceScatter {
        src: DevPtr,
        dst: DevPtr,
        count: usize,
        dtype: DType,
        lane: Lane,
    },
    AllGather {
        src: DevPtr,
        dst: DevPtr,
        bytes: usize,
        lane: Lane,
    },
    /// NVTE_COMM_NVTX: the next step's range; NVTE_COMM_TRACE: a timed mark on `lane`
    Nvtx(String),
    Mark {
        lane: Lane,
        name: String,
    },
}

/// A call's work, in issue order. Kept by the engine and reused (cleared) call after
/// call, so a steady-state call allocates nothing.
#[derive(Default)]
pub struct Plan {
    pub steps: Vec<Step>,
    /// the algorithm planned (`Planner::plan`)
    pub algo: Option<Algo>,
}

/// What an algorithm plans with: the engine's geometry and policy, and the transport's
/// capabilities, as values.
#[derive(Clone, Copy, Debug)]
pub struct Env {
    pub tp: usize,
    pub rank: usize,
    /// the buffer's element type, rows and cols
    pub dtype: DType,
    pub rows: usize,
    pub cols: usize,
    /// this rank's registered buffer and its bytes
    pub buffer: DevPtr,
    pub buffer_bytes: usize,
    /// with peer memory: every rank's buffer address (this rank's too); else empty
    pub peers: PerRank<DevPtr>,
    pub caps: Caps,
    pub slots: AlgoSlots,
    /// how the calls run (`super::policy`)
    pub policy: Policy,
    /// the device's SM count
    pub sm_count: i32,
    /// chunks of the chunked all-reduce at most this large (bytes) are all-reduced
    /// one-shot (`ar::ONE_SHOT_MAX_BYTES`; the host tests make it small)
    pub one_shot_max_bytes: usize,
    /// chunk events, compute streams
    pub events: usize,
    pub compute_streams: usize,
    /// the call runs inline (tp 1, no barrier: every lane is the caller's stream)
    pub inline: bool,
    /// our own GEMM, where loaded: why it cannot compute a GEMM (None: it can). The fused
    /// algorithms use it where it can, else cuBLASLt per chunk.
    pub own_gemm: Option<OwnGemm>,
    /// our own GEMM, where the device type takes it (loaded here or not: a load that
    /// failed on this rank alone leaves it set): why it cannot compute GEMMs of a call's
    /// kind, whatever this rank's m and pointers (`gemm::sm90::supports_kind`): what
    /// every rank of the call decides alike
    pub own_gemm_kind: Option<OwnGemm>,
    /// NVTE_COMM_NVTX ranges / NVTE_COMM_TRACE marks wanted
    pub nvtx: bool,
    pub trace: bool,
}

/// Why our own GEMM cannot compute a GEMM (None: it can): `gemm::sm90::supports` on the
/// GPU; the host tests' host GEMM computes every f32 GEMM.
pub type OwnGemm = fn(&GemmDesc) -> Option<&'static str>;

/// Arrival flags of the fused all-gather (u32 each): at most this many row blocks. The
/// flags scratch holds twice as many: the fused reduce-scatter's done signals and their
/// counters are its second half.
pub(crate) const MAX_FLAGS: usize = 256;

/// Device memory an algorithm may need besides the buffer, made on first use (outside
/// any call's work).
pub trait Scratch {
    /// Local staging as large as the buffer.
    fn staging(&mut self) -> Result<DevPtr>;
    /// Per-chunk amax slots (`super::MAX_AMAX_SLOTS` floats).
    fn amax_slots(&mut self) -> Result<DevPtr>;
    /// The fused algorithms' 2 * `MAX_FLAGS` u32 flags, zero when made (the algorithms
    /// leave them zero after every call).
    fn flags(&mut self) -> Result<DevPtr>;
}

/// An algorithm's view while it plans a call.
pub struct Planner<'a> {
    pub e: &'a Env,
    pub res: &'a mut dyn Scratch,
    pub plan: &'a mut Plan,
}

impl Planner<'_> {
    /// Issues `n` chunks' GEMMs, each followed by the start of its communication, whose
    /// completion (what waits for the transfer to end on its stream) comes after the next
    /// chunk's GEMM: GEMM 0, comm 0, GEMM 1, finish 0, comm 1, ..., finish n-1. Where every
    /// stream shares one hardware queue (`CUDA_DEVICE_MAX_CONNECTIONS=1`, TE's and
    /// Megatron's setting) the queue runs work in issue order and holds at a stream wait,
    /// or at a step whose stream is still busy: comm i then goes as soon as GEMM i ends
    /// and runs beside GEMM i+1. Issued with every GEMM first, no communication started
    /// before the last GEMM had been let go; with a transfer's completion before the next
    /// GEMM, that GEMM waited for the transfer (the protocol simulator's one-queue mode).
    pub(super) fn chunks_interleaved<G, C, F>(
        &mut self,
        n: usize,
        mut gemm: G,
        mut comm: C,
        mut finish: F,
    ) -> Result<()>
    where
        G: FnMut(&mut Self, usize) -> Result<()>,
        C: FnMut(&mut Self, usize) -> Result<()>,
        F: FnMut(&mut Self, usize) -> Result<()>,
    {
        for i in 0..n {
            gemm(self, i)?;
            if i > 0 {
                finish(self, i - 1)?;
            }
            comm(self, i)?;
        }
        if n > 0 {
            finish(self, n - 1)?;
        }
        Ok(())
    }

    pub fn tp(&self) -> usize {
        self.e.tp
    }
    pub fn tp_rank(&self) -> usize {
        self.e.rank
    }
    pub fn buffer(&self) -> DevPtr {
        self.e.buffer
    }
    pub fn dtype(&self) -> DType {
        self.e.dtype
    }
    fn push(&mut self, s: Step) {
        self.plan.steps.push(s);
    }
    /// Every member but this rank.
    pub fn others(&self) -> Peers {
        (0..self.e.tp).filter(|&p| p != self.e.rank).collect()
    }
    /// Group member `q`'s buffer (peer memory); an error without peer memory.
    pub fn peer(&self, q: usize) -> Result<DevPtr> {
        self.e.peers.get(q).copied().ok_or_else(|| {
            Error::internal(format!(
                "the plan loads from rank {q}'s buffer, but the transport has no peer memory"
            ))
        })
    }
    pub fn staging(&mut self) -> Result<DevPtr> {
        self.res.staging()
    }
    pub fn amax_slots(&mut self) -> Result<DevPtr> {
        self.res.amax_slots()
    }
    pub fn flags(&mut self) -> Result<DevPtr> {
        self.res.flags()
    }

    /// Whether the policy has the communication run on SMs beside the GEMMs: SM puts
    /// (`use_ce` off) over peer memory; over a transport without it, whose own kernels
    /// move the bytes (NCCL's run on SMs), `use_ce` off asks the GEMMs to leave them the
    /// comm SMs (the autotuner's margin candidates, src/tune.rs).
    pub fn comm_on_sms(&self) -> bool {
        !self.e.policy.comm.use_ce
    }

    /// SM count for the chunk GEMMs: leave the comm SMs free when SM kernels communicate.
    /// (None at tp 1: nothing communicates.)
    pub fn math_sms(&self, comm_uses_sms: bool) -> i32 {
        let c = &self.e.policy.comm;
        if c.sm_margin && comm_uses_sms && self.e.tp > 1 {
            self.e.sm_count - c.sms
        } else {
            0
        }
    }

    /// Error unless a [rows, cols] matrix of the buffer's dtype fits the buffer.
    pub fn check_capacity(&self, what: &str, shape: [usize; 2]) -> Result<()> {
        let need = shape[0] * shape[1] * eb(self.e.dtype);
        if need > self.e.buffer_bytes {
            crate::invalid!(
                "the buffer is too small: {what} [{}, {}] of {} needs {need} bytes, the buffer has {} ([{}, {}])",
                shape[0],
                shape[1],
                self.e.dtype.name(),
                self.e.buffer_bytes,
                self.e.rows,
                self.e.cols
            );
        }
        Ok(())
    }

    pub fn begin(&mut self, op: Op, gate_compute: bool, key: &[u64], full: Option<&GemmDesc>) {
        let mut k = Small::new();
        for &w in key.iter().take(MAX_KEY_WORDS) {
            k.push(w);
        }
        self.push(Step::Begin {
            op,
            gate_compute,
            key: k,
            full: full.copied(),
        });
    }
    pub fn finish(&mut self) {
        self.push(Step::Finish);
    }
    pub fn gemm(&mut self, g: &GemmDesc, index: usize, concurrent: bool) {
        self.gemm_copying(g, index, concurrent, SideCopy::default());
    }
    /// [`Self::gemm`] with a copy beside it (`Step::Gemm`'s `side`).
    pub fn gemm_copying(&mut self, g: &GemmDesc, index: usize, concurrent: bool, side: SideCopy) {
        self.push(Step::Gemm {
            g: *g,
            index,
            concurrent,
            side,
        });
    }
    pub fn record(&mut self, ev: usize, lane: Lane) {
        self.push(Step::Record { ev, lane });
    }
    pub fn wait_event(&mut self, ev: usize, lane: Lane) {
        self.push(Step::WaitEvent { ev, lane });
    }
    /// One exchange step; an error (at plan time) when the transport has no two-sided
    /// exchange.
    pub fn exchange(
        &mut self,
        send: SendOp,
        recv: RecvOp,
        (slot, tag): (FlagSlot, u64),
        lane: Lane,
        info: WaitInfo,
    ) -> Result<()> {
        self.exchange_part(send, recv, None, (slot, tag), lane, info, Part::Whole)
    }
    /// [`Self::exchange`] with a second send and receive behind the first (`then`: the
    /// same step, moved after the first pair's bytes and before the step's one signal),
    /// or `part` of it ([`Part`]: in two parts on `lane`, with other work issued between
    /// them).
    #[allow(clippy::too_many_arguments)]
    pub fn exchange_part(
        &mut self,
        send: SendOp,
        recv: RecvOp,
        then: Option<(SendOp, RecvOp)>,
        (slot, tag): (FlagSlot, u64),
        lane: Lane,
        info: WaitInfo,
        part: Part,
    ) -> Result<()> {
        self.need(self.e.caps.two_sided, "two-sided exchange")?;
        self.push(Step::Exchange {
            send,
            recv,
            then,
            slot,
            tag,
            lane,
            info,
            part,
        });
        Ok(())
    }
    pub fn put(
        &mut self,
        peer: usize,
        offset: usize,
        src: DevPtr,
        bytes: usize,
        lane: Lane,
    ) -> Result<()> {
        self.need(self.e.caps.peer_memory, "peer memory (puts)")?;
        self.push(Step::Put {
            peer,
            offset,
            src,
            bytes,
            lane,
        });
        Ok(())
    }
    pub fn signal(&mut self, peers: &[usize], slot: FlagSlot, tag: u64, lane: Lane) -> Result<()> {
        self.need(self.e.caps.peer_memory, "peer memory (flags)")?;
        self.push(Step::Signal {
            peers: peers.iter().copied().collect(),
            slot,
            tag,
            lane,
        });
        Ok(())
    }
    pub fn wait(
        &mut self,
        peers: &[usize],
        (slot, tag): (FlagSlot, u64),
        lane: Lane,
        info: WaitInfo,
    ) -> Result<()> {
        self.need(self.e.caps.peer_memory, "peer memory (flags)")?;
        self.push(Step::Wait {
            peers: peers.iter().copied().collect(),
            slot,
            tag,
            lane,
            info,
        });
        Ok(())
    }
    pub fn copy(&mut self, dst: DevPtr, src: DevPtr, bytes: usize, lane: Lane) {
        self.push(Step::Copy {
            dst,
            src,
            bytes,
            lane,
        });
    }
    #[allow(clippy::too_many_arguments)]
    pub fn copy_2d(
        &mut self,
        dst: DevPtr,
        dpitch: usize,
        src: DevPtr,
        spitch: usize,
        width: usize,
        height: usize,
        lane: Lane,
    ) {
        self.push(Step::Copy2d {
            dst,
            dpitch,
            src,
            spitch,
            width,
            height,
            lane,
        });
    }
    pub fn memset(&mut self, dst: DevPtr, bytes: usize, lane: Lane) {
        if bytes > 0 {
            self.push(Step::Memset { dst, bytes, lane });
        }
    }
    pub fn write_flag(&mut self, dst: DevPtr, value: u32, lane: Lane) {
        self.push(Step::WriteFlag { dst, value, lane });
    }
    pub fn wait_flag(&mut self, ptr: DevPtr, value: u32, lane: Lane) {
        self.push(Step::WaitFlag { ptr, value, lane });
    }
    pub fn fused_gemm(&mut self, g: &GemmDesc, hooks: Hooks, sms: usize, index: usize) {
        self.push(Step::FusedGemm {
            g: *g,
            hooks,
            sms,
            index,
        });
    }
    /// A reduction (nothing when it is empty).
    pub fn reduce(&mut self, r: Reduce, lane: Lane) {
        if r.rows == 0 || r.cols == 0 {
            return;
        }
        self.push(Step::Reduce { r, lane });
    }
    pub fn copy_segments(&mut self, segs: &[(DevPtr, DevPtr, usize)], lane: Lane, tail: bool) {
        let mut s = Segments::new();
        for &x in segs.iter().filter(|x| x.2 > 0) {
            s.push(x);
        }
        if !s.is_empty() {
            self.push(Step::CopySegments {
                segs: s,
                lane,
                tail,
            });
        }
    }
    pub fn amax_max(&mut self, out: DevPtr, slots: DevPtr, n: usize) {
        self.push(Step::AmaxMax { out, slots, n });
    }
    pub fn all_reduce(
        &mut self,
        (src, dst, count): (DevPtr, DevPtr, usize),
        dtype: DType,
        lane: Lane,
    ) -> Result<()> {
        self.need(self.e.caps.collectives, "collectives")?;
        self.push(Step::AllReduce {
            src,
            dst,
            count,
            dtype,
            lane,
        });
        Ok(())
    }
    pub fn reduce_scatter(
        &mut self,
        (src, dst, count): (DevPtr, DevPtr, usize),
        dtype: DType,
        lane: Lane,
    ) -> Result<()> {
        self.need(self.e.caps.collectives, "collectives")?;
        self.push(Step::ReduceScatter {
            src,
            dst,
            count,
            dtype,
            lane,
        });
        Ok(())
    }
    pub fn all_gather(&mut self, src: DevPtr, dst: DevPtr, bytes: usize, lane: Lane) -> Result<()> {
        self.need(self.e.caps.collectives, "collectives")?;
        self.push(Step::AllGather {
            src,
            dst,
            bytes,
            lane,
        });
        Ok(())
    }
    /// NVTE_COMM_NVTX: the next step of the call (the name is made only when wanted).
    pub fn step(&mut self, name: impl FnOnce() -> String) {
        if self.e.nvtx {
            self.push(Step::Nvtx(name()));
        }
    }
    /// NVTE_COMM_TRACE: a timed mark on `lane` (the name is made only when wanted).
    pub fn mark(&mut self, lane: Lane, name: impl FnOnce() -> String) {
        if self.e.trace {
            self.push(Step::Mark { lane, name: name() });
        }
    }
    fn need(&self, have: bool, what: &str) -> Result<()> {
        if have {
            Ok(())
        } else {
            Err(Error::internal(format!(
                "the plan needs {what}, which the transport does not have"
            )))
        }
    }
}

/// What [`enqueue`] issues the non-transport steps through: the engine's streams, events,
/// GEMMs and kernels (on the GPU), or a recording fake (host tests).
pub trait Device {
    fn transport(&self) -> &dyn Transport;
    fn begin(
        &mut self,
        op: Op,
        gate_compute: bool,
        key: &[u64],
        full: Option<&GemmDesc>,
    ) -> Result<()>;
    fn finish(&mut self) -> Result<()>;
    /// The stream of `lane` in the call in progress (forked at its first use).
    fn lane(&self, lane: Lane) -> Result<StreamHandle>;
    /// A GEMM on compute stream `index` (the device resolves the lane itself: a GEMM it
    /// skips forks nothing).
    fn gemm(&self, g: &GemmDesc, index: usize, concurrent: bool, side: SideCopy) -> Result<()>;
    fn record(&self, ev: usize, stream: StreamHandle) -> Result<()>;
    fn wait_event(&self, ev: usize, stream: StreamHandle) -> Result<()>;
    fn copy(&self, dst: DevPtr, src: DevPtr, bytes: usize, stream: StreamHandle) -> Result<()>;
    #[allow(clippy::too_many_arguments)]
    fn copy_2d(
        &self,
        dst: DevPtr,
        dpitch: usize,
        src: DevPtr,
        spitch: usize,
        width: usize,
        height: usize,
        stream: StreamHandle,
    ) -> Result<()>;
    fn memset(&self, dst: DevPtr, bytes: usize, stream: StreamHandle) -> Result<()>;
    fn write_flag(&self, dst: DevPtr, value: u32, stream: StreamHandle) -> Result<()>;
    fn wait_flag(&self, ptr: DevPtr, value: u32, stream: StreamHandle) -> Result<()>;
    /// Our own GEMM on compute stream `index` (resolved by the device, as [`Device::gemm`]).
    fn fused_gemm(&self, g: &GemmDesc, hooks: &Hooks, sms: usize, index: usize) -> Result<()>;
    fn reduce(&self, r: &Reduce, stream: StreamHandle) -> Result<()>;
    fn copy_segments(
        &self,
        segs: &[(DevPtr, DevPtr, usize)],
        stream: StreamHandle,
        tail: bool,
    ) -> Result<()>;
    /// On the caller's stream, after the call (skipped where the GEMMs were).
    fn amax_max(&self, out: DevPtr, slots: DevPtr, n: usize) -> Result<()>;
    fn nvtx(&self, name: &str);
    fn mark(&mut self, stream: StreamHandle, name: &str) -> Result<()>;
}

fn missing(what: &str) -> Error {
    Error::internal(format!(
        "the plan needs {what}, which the transport does not have"
    ))
}

/// Issue `plan`'s steps, in order, through `dev` and its transport's capabilities (a
/// capability the plan needs and the transport lacks is an error, never a panic).
pub fn enqueue(plan: &Plan, dev: &mut dyn Device) -> Result<()> {
    for s in &plan.steps {
        enqueue_step(s, dev)?;
    }
    Ok(())
}

fn enqueue_step(s: &Step, dev: &mut dyn Device) -> Result<()> {
    match s {
        Step::Begin {
            op,
            gate_compute,
            key,
            full,
        } => dev.begin(*op, *gate_compute, key, full.as_ref()),
        Step::Finish => dev.finish(),
        Step::Gemm {
            g,
            index,
            concurrent,
            side,
        } => dev.gemm(g, *index, *concurrent, *side),
        Step::Record { ev, lane } => dev.record(*ev, dev.lane(*lane)?),
        Step::WaitEvent { ev, lane } => dev.wait_event(*ev, dev.lane(*lane)?),
        Step::Copy {
            dst,
            src,
            bytes,
            lane,
        } => dev.copy(*dst, *src, *bytes, dev.lane(*lane)?),
        Step::Copy2d {
            dst,
            dpitch,
            src,
            spitch,
            width,
            height,
            lane,
        } => dev.copy_2d(
            *dst,
            *dpitch,
            *src,
            *spitch,
            *width,
            *height,
            dev.lane(*lane)?,
        ),
        Step::Memset { dst, bytes, lane } => dev.memset(*dst, *bytes, dev.lane(*lane)?),
        Step::WriteFlag { dst, value, lane } => dev.write_flag(*dst, *value, dev.lane(*lane)?),
        Step::WaitFlag { ptr, value, lane } => dev.wait_flag(*ptr, *value, dev.lane(*lane)?),
        Step::FusedGemm {
            g,
            hooks,
            sms,
            index,
        } => dev.fused_gemm(g, hooks, *sms, *index),
        Step::Reduce { r, lane } => dev.reduce(r, dev.lane(*lane)?),
        Step::CopySegments { segs, lane, tail } => dev.copy_segments(segs, dev.lane(*lane)?, *tail),
        Step::AmaxMax { out, slots, n } => dev.amax_max(*out, *slots, *n),
        Step::Nvtx(name) => {
            dev.nvtx(name);
            Ok(())
        }
        Step::Mark { lane, name } => {
            let st = dev.lane(*lane)?;
            dev.mark(st, name)
        }
        _ => enqueue_transport_step(s, dev),
    }
}

/// The steps a transport capability runs.
fn enqueue_transport_step(s: &Step, dev: &mut dyn Device) -> Result<()> {
    let t = dev.transport();
    match s {
        Step::Exchange {
            send,
            recv,
            then,
            slot,
            tag,
            lane,
            info,
            part,
        } => {
            let x = t.two_sided().ok_or_else(|| missing("two-sided exchange"))?;
            let stream = dev.lane(*lane)?;
            match then {
                None => x.exchange(*part, &[*send], &[*recv], *slot, *tag, stream, *info),
                Some((s2, r2)) => x.exchange(
                    *part,
                    &[*send, *s2],
                    &[*recv, *r2],
                    *slot,
                    *tag,
                    stream,
                    *info,
                ),
            }
        }
        Step::Put {
            peer,
            offset,
            src,
            bytes,
            lane,
        } => {
            let p = t.peer_memory().ok_or_else(|| missing("peer memory"))?;
            p.put(*peer, *offset, *src, *bytes, dev.lane(*lane)?)
        }
        Step::Signal {
            peers,
            slot,
            tag,
            lane,
        } => {
            let p = t.peer_memory().ok_or_else(|| missing("peer memory"))?;
            p.signal(peers, *slot, *tag, dev.lane(*lane)?)
        }
        Step::Wait {
            peers,
            slot,
            tag,
            lane,
            info,
        } => {
            let p = t.peer_memory().ok_or_else(|| missing("peer memory"))?;
            p.wait(peers, *slot, *tag, dev.lane(*lane)?, *info)
        }
        Step::AllReduce {
            src,
            dst,
            count,
            dtype,
            lane,
        } => {
            let c = t.collectives().ok_or_else(|| missing("collectives"))?;
            c.all_reduce(*src, *dst, *count, *dtype, dev.lane(*lane)?)
        }
        Step::ReduceScatter {
            src,
            dst,
            count,
            dtype,
            lane,
        } => {
            let c = t.collectives().ok_or_else(|| missing("collectives"))?;
            c.reduce_scatter(*src, *dst, *count, *dtype, dev.lane(*lane)?)
        }
        Step::AllGather {
            src,
            dst,
            bytes,
            lane,
        } => {
            let c = t.collectives().ok_or_else(|| missing("collectives"))?;
            c.all_gather_bytes(*src, *dst, *bytes, dev.lane(*lane)?)
        }
        _ => Err(Error::internal("a step of no transport capability")),
    }
}
