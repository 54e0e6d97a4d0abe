//! The userbuffers-style overlap engine: communication buffers registered across the
//! ranks of a tensor-parallel group, and algorithms that split a GEMM and its collective
//! into chunks so that one chunk's communication runs while another computes.
//!
//! Every call is asynchronous (no host synchronisation): the caller's stream fans out to
//! the engine's compute and comm streams and joins them at the end. At tp 1 over a
//! transport that is idle alone (IPC, NCCL: nothing to communicate) a call runs inline
//! instead: all of its work on the
//! caller's stream in program order, with no fork, join, barrier or flag
//! (`Overlap::inline_ok`). Waits for peers are
//! kernels with a timeout: a peer that never arrives makes the call's stream finish with
//! a recorded timeout (see [`Overlap::synchronize`]) and the object refuses further work.
//!
//! CUDA graphs: every call can be captured (cudaStreamBeginCapture on the caller's stream,
//! any capture mode) and replayed any number of times, interleaved with eager calls. A
//! call does nothing on the host that a capture would freeze: flag values come from a
//! device-side call counter that the call itself increments (`crate::transport::Slot`),
//! there are no host waits or event queries, and the one lazy allocation (the staging
//! buffer) is made with the thread's capture mode relaxed. Calls, replays included, must
//! still be made in the same order on every rank and be stream-ordered on each rank.
pub mod ag;
pub mod algo;
pub mod ar;
pub mod bulk;
mod device;
pub mod plan;
pub mod policy;
#[cfg(test)]
pub(crate) mod protocol;
pub mod reduce;
pub mod report;
pub mod rs;
pub mod schedule;

use crate::cuda::StreamHandle;
use crate::cuda::resources::{
    Capture, DeviceMem, Event, Stream, capture_status, copy_async, memset_async, write_value32,
};
use crate::cuda::{self, ContextGuard, DevPtr, DeviceInfo, nvrtc, nvtx};
use crate::error::ErrorKind as K;
use crate::error::{Error, Result};
use crate::gemm::sm90::SideCopy;
use crate::gemm::{self, GemmDesc};
use crate::tensor::{Buffer, DType, Shape, Tensor};
use crate::transport::{
    Caps, FailureKind, MAX_PEERS, Settings, Transport, WaitInfo, call_desc, desc_op, tag,
};
use crate::{bootstrap::Bootstrap, env, invalid, unsupported};
use plan::{AlgoSlots, MAX_KEY_WORDS};
pub use policy::{Pins, Policy, TRANSPORT_AUTO, TRANSPORT_IPC, TRANSPORT_NCCL, TransportChoice};
use reduce::EngineKernels;

/// Chunk amax slots of FP8 outputs (tp chunks of the all-gather).
const MAX_AMAX_SLOTS: usize = 64;

/// NVTE_COMM_TRACE (a boolean; default off), read when an object is created.
pub fn trace_enabled() -> Result<bool> {
    Ok(env::TRACE.get()?.unwrap_or(false))
}

/// NVTE_COMM_CHECK (a boolean; default off), read when an object is created: every call
/// compares its descriptor (operation, shapes, types, flags, call number) with every
/// peer's at the arrival barrier, so a rank that calls differently from its peers is
/// reported on every rank (INVALID_ARGUMENT naming the peer) instead of a timeout or a
/// silently wrong result (the call's transfers still run, inside the registered buffers,
/// whose sizes `transport::create` checks across ranks). Cost: IPC none beyond a compare
/// in the arrival kernel; NCCL one small kernel (the arrival tokens travel with or
/// without the check).
pub fn check_enabled() -> Result<bool> {
    Ok(env::CHECK.get()?.unwrap_or(false))
}

/// Operation ids (in timeout messages).
#[derive(Clone, Copy, Debug)]
#[repr(u32)]
pub enum Op {
    SplitAg = 1,
    SplitRs = 2,
    SplitRsP2p = 3,
    BulkAg = 4,
    BulkRs = 5,
    CopyIntoBuffer = 6,
    Destroy = 7,
    SplitAr = 8,
    FusedAg = 9,
}

fn op_name(op: u32) -> &'static str {
    match op {
        1 => "split_ag (ring all-gather + GEMM)",
        2 => "split_rs (pipelined GEMM + reduce-scatter)",
        3 => "split_rs_p2p (ring GEMM + reduce-scatter)",
        4 => "bulk all-gather",
        5 => "bulk reduce-scatter",
        6 => "copy_into_buffer",
        7 => "destroy",
        8 => "split_ar (pipelined GEMM + all-reduce)",
        9 => "fused_ag (ring all-gather into one GEMM on arrival flags)",
        _ => "?",
    }
}

/// An overlap object: the group's resources (transport, device, streams and events,
/// kernels, scratch memory), the state of the call in progress and of graph captures,
/// the diagnostics, and the [`Policy`] its calls run by.
pub struct Overlap {
    /// how the calls run (`policy.rs`): made at creation, replaced whole between calls
    /// ([`Overlap::set_policy`])
    policy: Policy,
    t: Box<dyn Transport>,
    group: Group,
    rows: usize,
    cols: usize,
    dtype: DType,
    streams: Lanes,
    call: CallState,
    /// set when a call failed in a way that leaves the object unusable
    broken: Option<Error>,
    mem: EngineMem,
    /// our own GEMM, loaded at the first call that wants it (Err: why it is not there)
    own_gemm: Option<OwnGemmSlot>,
    code: Code,
    diag: Diag,
}

/// The group as the object sees it.
struct Group {
    /// what the transport can do, and the flag slots the algorithms took from it
    caps: Caps,
    slots: AlgoSlots,
    /// the id of the context the object was made in ([`cuda::ContextGuard::id`])
    ctx: crate::cuda::CtxId,
    dev: DeviceInfo,
    world_rank: usize,
}

/// The object's streams and events.
struct Lanes {
    compute: Vec<Stream>,
    comm: Vec<Stream>,
    ev_start: Event,
    ev_arrived: Event,
    ev_comm: Vec<Event>,
    ev_compute: Vec<Event>,
    ev_chunk: Vec<Event>,
    ev_done: Event,
}

/// The call in progress, the calls so far, and CUDA-graph capture.
struct CallState {
    /// the plan of the call in progress (kept: its steps' memory is reused call after call)
    plan: plan::Plan,
    /// the caller's stream of the call in progress
    caller: StreamHandle,
    /// calls issued so far (eager and captured; a host count, diagnostics and `wait_done`)
    calls: u64,
    /// ev_done was recorded by an eager call
    done_recorded: bool,
    /// the call in progress is being captured into a CUDA graph
    capturing: bool,
    /// some call of this object was captured (its buffers may be used by a graph)
    captured: bool,
    /// the latest call was captured (its completion is a graph replay's)
    last_captured: bool,
    /// a call began and has not finished: set by `begin`, cleared by `finish` (still set
    /// at the next call means the last one failed half-way; its peers wait for it)
    in_call: bool,
    /// the streams the call in progress forked (bit i: compute stream i; bit 16 + j:
    /// comm stream j >= 1); `finish` joins exactly these
    forked: std::cell::Cell<u32>,
    /// the call in progress gates its compute streams on the arrival barrier
    gate_compute: bool,
    /// the caller's stream while an inline call runs ([`Overlap::inline_ok`]): every
    /// compute and comm stream of the call is that stream
    inline: Option<StreamHandle>,
}

/// Device memory made on first use.
#[derive(Default)]
struct EngineMem {
    staging: Option<DeviceMem>,
    /// per-chunk amax of FP8 outputs
    amax_slots: Option<DeviceMem>,
    /// the fused algorithms' flags (zeroed when made)
    flags: Option<DeviceMem>,
    /// where our GEMM's arrival waits record giving up (made with our GEMM: see
    /// [`Overlap::stall_error`])
    stall: Option<gemm::sm90::StallRecord>,
}

/// The engine's kernels and their module.
struct Code {
    module: std::sync::Arc<nvrtc::Module>,
    kernels: EngineKernels,
}

/// NVTE_COMM_TRACE, NVTE_COMM_NVTX and NVTE_COMM_REPORT.
struct Diag {
    trace: Option<Trace>,
    /// NVTE_COMM_NVTX: the open NVTX ranges of the call in progress and of its step
    nvtx_call: Option<nvtx::Range>,
    nvtx_step: std::cell::RefCell<Option<nvtx::Range>>,
    report: Option<Box<report::Report>>,
    /// the comm-GEMM context's global m, n, k of the call (NVTE_COMM_REPORT's shape key)
    report_dims: Option<[i64; 3]>,
}

/// What one rank makes for a new object before any exchange ([`Overlap::local_parts`]).
struct LocalParts {
    guard: ContextGuard,
    dev: DeviceInfo,
    tp: usize,
    bytes: usize,
    check: bool,
    code: (std::sync::Arc<nvrtc::Module>, EngineKernels),
    streams: Lanes,
    trace: Option<Trace>,
    report: Option<Box<report::Report>>,
}

/// Our own GEMM as an engine holds it once tried: loaded, or why not.
type OwnGemmSlot = std::result::Result<std::sync::Arc<gemm::sm90::Sm90Gemm>, String>;

/// NVTE_COMM_TRACE=1: timed events at the steps of the last call, printed (per rank, in
/// ms from the call's start) when the object is destroyed. A diagnostic, not a profiler.
struct Trace {
    events: Vec<Event>,
    names: Vec<String>,
}

impl Lanes {
    /// `ns` compute streams, the comm streams, and their events.
    fn new(ns: usize, p: &policy::Streams) -> Result<Lanes> {
        let compute = (0..ns)
            .map(|_| Stream::new(p.gemm_priority))
            .collect::<Result<Vec<_>>>()?;
        let comm = (0..NUM_COMM_STREAMS)
            .map(|_| Stream::new(p.comm_priority))
            .collect::<Result<Vec<_>>>()?;
        let events = |n: usize| (0..n).map(|_| Event::new()).collect::<Result<Vec<_>>>();
        Ok(Lanes {
            compute,
            comm,
            ev_start: Event::new()?,
            ev_arrived: Event::new()?,
            ev_comm: events(NUM_COMM_STREAMS)?,
            ev_compute: events(ns)?,
            ev_chunk: events(2 * MAX_PEERS.max(64))?,
            ev_done: Event::new()?,
        })
    }
}

/// Communication streams: 0 runs the arrival barrier and the end of every call; the
/// others start after the barrier (the two-shot all-reduce uses all three).
const NUM_COMM_STREAMS: usize = 3;

/// Element bytes (the engine's buffers hold byte-sized or larger types).
fn eb(d: DType) -> usize {
    d.bits() / 8
}

/// A GEMM's call key (`GemmDesc::check_key` / `sum_key`) with one word more: an
/// algorithm's parameter every rank must share (it goes into the call's descriptor).
fn key_with(key: [u64; 5], word: u64) -> [u64; 6] {
    [key[0], key[1], key[2], key[3], key[4], word]
}

impl Overlap {
    /// The buffer's bytes; checks made before anything is loaded.
    pub fn check_buffer(rows: usize, cols: usize, dtype: DType) -> Result<usize> {
        if !matches!(
            dtype,
            DType::F32 | DType::F16 | DType::BF16 | DType::E4M3 | DType::E5M2
        ) {
            unsupported!(
                "buffer dtype {} is not supported (float32, float16, bfloat16, fp8)",
                dtype.name()
            );
        }
        let bytes = rows
            .checked_mul(cols)
            .and_then(|x| x.checked_mul(eb(dtype)))
            .ok_or_else(|| {
                Error::invalid(format!(
                    "buffer shape [{rows}, {cols}] of {} overflows: its byte size exceeds usize",
                    dtype.name()
                ))
            })?;
        if bytes == 0 {
            invalid!("buffer shape [{rows}, {cols}] is empty");
        }
        Ok(bytes)
    }

    /// The buffer's rows are split among the `tp` ranks of a group.
    pub fn check_rows(rows: usize, tp: usize) -> Result<()> {
        if !rows.is_multiple_of(tp) {
            invalid!("buffer rows = {rows} must be divisible by tp_size = {tp}");
        }
        Ok(())
    }

    /// Collective over the world: every rank creates the object with the same policy and
    /// buffer shape. The current CUDA context (the caller's device) owns everything.
    /// `policy`: the C config's (or TE's defaults) with the environment's, and its pins
    /// read by the creator (the C entry, or a comm-GEMM context for its engines).
    pub fn create(
        bs: &Bootstrap,
        policy: Policy,
        rows: usize,
        cols: usize,
        dtype: DType,
    ) -> Result<Overlap> {
        // Everything local that can fail comes before the transport: once its creation
        // returned, the peers hold this rank's buffer and flags (a later failure here
        // would free memory that they go on to write). Every rank's outcome is exchanged
        // first, so that a rank that fails here (its arguments, memory, a compile) makes
        // every rank fail with it instead of leaving them in the transport's exchanges.
        let local = Self::local_parts(&policy, bs.size, (rows, cols, dtype));
        let LocalParts {
            guard,
            dev,
            tp,
            bytes,
            check,
            code: (module, kernels),
            streams,
            trace,
            report,
        } = bs.agree(local, "set up their overlap object")?;
        let t = Self::create_transport(bs, &policy, (&guard, &dev), (tp, bytes), check)?;
        let group = Group {
            caps: Caps::of(t.as_ref()),
            slots: AlgoSlots::take(t.flag_slots())?,
            ctx: guard.id,
            dev,
            world_rank: bs.rank,
        };
        Ok(Overlap {
            policy,
            t,
            group,
            rows,
            cols,
            dtype,
            streams,
            call: CallState {
                plan: plan::Plan::default(),
                caller: StreamHandle::NULL,
                calls: 0,
                done_recorded: false,
                capturing: false,
                captured: false,
                last_captured: false,
                in_call: false,
                forked: std::cell::Cell::new(0),
                gate_compute: false,
                inline: None,
            },
            broken: None,
            mem: EngineMem::default(),
            own_gemm: Self::own_gemm_at_creation(&policy, &guard),
            code: Code { module, kernels },
            diag: Diag {
                trace,
                nvtx_call: None,
                nvtx_step: Default::default(),
                report,
                report_dims: None,
            },
        })
    }

    /// What [`Self::create`] makes on this rank alone, before any exchange.
    fn local_parts(
        policy: &Policy,
        world: usize,
        (rows, cols, dtype): (usize, usize, DType),
    ) -> Result<LocalParts> {
        let bytes = Self::check_buffer(rows, cols, dtype)?;
        let trace = trace_enabled()?;
        let check = check_enabled()?;
        let guard = ContextGuard::for_stream(StreamHandle::NULL)?;
        let dev = cuda::device_info(guard.device)?;
        let tp = policy.validate(world, dev.sm_count)?;
        Self::check_rows(rows, tp)?;
        let code = Self::comm_module(&guard, &dev, dtype)?;
        let ns = policy.streams.compute as usize;
        let streams = Lanes::new(ns, &policy.streams)?;
        let trace = if trace {
            Some(Trace {
                events: (0..256).map(|_| Event::timed()).collect::<Result<_>>()?,
                names: Vec::new(),
            })
        } else {
            None
        };
        let report = if Self::report_enabled()? {
            Some(Box::new(report::Report::new()?))
        } else {
            None
        };
        Ok(LocalParts {
            guard,
            dev,
            tp,
            bytes,
            check,
            code,
            streams,
            trace,
            report,
        })
    }

    /// With config atomic_gemm: our GEMM, loaded now (outside any capture), or why not.
    fn own_gemm_at_creation(policy: &Policy, guard: &ContextGuard) -> Option<OwnGemmSlot> {
        policy
            .atomic_gemm
            .then(|| gemm::sm90::Sm90Gemm::get(guard).map_err(|e| e.msg))
    }

    /// The group's transport (collective over the world: groups of `tp` consecutive
    /// world ranks), with a buffer of `bytes`.
    fn create_transport(
        bs: &Bootstrap,
        policy: &Policy,
        (guard, dev): (&ContextGuard, &DeviceInfo),
        (tp, bytes): (usize, usize),
        check: bool,
    ) -> Result<Box<dyn Transport>> {
        let first = bs.rank / tp * tp;
        let group: Vec<usize> = (first..first + tp).collect();
        crate::transport::create(
            bs,
            &group,
            guard,
            dev,
            &Settings {
                kind: crate::transport::kind_of_choice(policy.transport.0),
                buffer_bytes: bytes,
                use_ce: policy.comm.use_ce,
                comm_sms: policy.comm.sms as u32,
                timeout_ms: policy.timeout_ms as u64,
                check,
            },
        )
    }

    /// The engine's kernels (kernels/comm.cu), every one a call may launch looked up now,
    /// outside any graph capture.
    fn comm_module(
        guard: &ContextGuard,
        dev: &DeviceInfo,
        dtype: DType,
    ) -> Result<(std::sync::Arc<nvrtc::Module>, EngineKernels)> {
        let module = nvrtc::module(&nvrtc::COMM, guard.id, dev)?;
        let kernels = EngineKernels::new(&module, dtype)?;
        Ok((module, kernels))
    }

    pub fn tp(&self) -> usize {
        self.t.size()
    }
    pub fn tp_rank(&self) -> usize {
        self.t.rank()
    }
    /// Replace the policy (between calls; the autotuner's choice of a call shape, with
    /// the comm-GEMM call's own comm SMs): what creation fixed stays, the per-call
    /// choices are checked; the transport takes the new copy-engine / SM puts and the
    /// comm SMs' budget.
    pub fn set_policy(&mut self, next: &Policy) -> Result<()> {
        self.policy
            .check_replacement(next, self.group.dev.sm_count)?;
        self.policy = *next;
        self.t.set_use_ce(next.comm.use_ce);
        self.t.set_comm_sms(next.comm.sms as u32);
        Ok(())
    }

    /// The policy the calls run by now.
    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    /// Some call of this object was captured into a CUDA graph (its buffers may be used
    /// by one).
    pub(crate) fn captured(&self) -> bool {
        self.call.captured
    }

    /// The transport's name, for messages: "ipc", "inproc" (every peer in this process)
    /// or "nccl".
    pub fn transport_name(&self) -> &'static str {
        self.t.name()
    }
    /// What the transport can do.
    pub fn caps(&self) -> Caps {
        self.group.caps
    }
    pub fn shape(&self) -> (usize, usize, DType) {
        (self.rows, self.cols, self.dtype)
    }
    fn buffer(&self) -> DevPtr {
        self.t.buffer()
    }

    /// Compute stream `i` of the call in progress, forked from the caller's stream at its
    /// first use in the call (it waits for the call's start, or its arrival barrier when
    /// the call gates compute): a call forks, and `finish` joins, only the streams it uses.
    fn compute_stream(&self, i: usize) -> Result<StreamHandle> {
        if let Some(s) = self.call.inline {
            return Ok(s);
        }
        let s = self.streams.compute[i].raw();
        let bit = 1u32 << i;
        if self.call.forked.get() & bit == 0 {
            if self.call.gate_compute {
                self.streams.ev_arrived.wait_on(s)?;
            } else {
                self.streams.ev_start.wait_on(s)?;
            }
            self.call.forked.set(self.call.forked.get() | bit);
        }
        Ok(s)
    }

    /// Comm stream `j` of the call in progress: stream 0 runs the call's barrier and end;
    /// the others are forked at their first use (after the arrival barrier), as
    /// [`Self::compute_stream`].
    fn comm_stream(&self, j: usize) -> Result<StreamHandle> {
        if let Some(s) = self.call.inline {
            return Ok(s);
        }
        let s = self.streams.comm[j].raw();
        let bit = 1u32 << (16 + j);
        if j > 0 && self.call.forked.get() & bit == 0 {
            self.streams.ev_arrived.wait_on(s)?;
            self.call.forked.set(self.call.forked.get() | bit);
        }
        Ok(s)
    }

    /// After how long our GEMM's waits for arrival flags give up: twice the transport's
    /// timeout. A peer that never sends is named by the transport's own wait first, and
    /// that wait's timeout still sets the flag; what is left is a flag whose writer never
    /// ran.
    fn stall_ms(&self) -> u64 {
        (self.policy.timeout_ms.max(1) as u64).saturating_mul(2)
    }

    /// Who this rank is, for messages.
    fn who(&self) -> String {
        format!(
            "world rank {} (tp rank {} of {})",
            self.group.world_rank,
            self.tp_rank(),
            self.tp()
        )
    }

    /// Our GEMM gave up waiting for an arrival flag (see [`gemm::sm90::Hooks::stall`]).
    fn stall_error(&self) -> Option<Error> {
        let st = self.mem.stall.as_ref()?.read()?;
        Some(Error::new(
            K::Timeout,
            format!(
                "timeout after {:.1} ms: on {}, our fused GEMM waited for arrival flag {} of an all-gather (set on this rank once a piece of a peer's chunk has landed) and gave up, so that call's output is wrong. \
                 The steps that set it never ran, and this rank's own waits for its peers did not time out: other kernels held the SMs the GEMM leaves free (comm_sm_count; ranks sharing one GPU inside one process or under MPS starve each other so), or the GPU is oversubscribed. The object is unusable now: destroy it.",
                st.waited_ms,
                self.who(),
                st.flag
            ),
        ))
    }

    fn timeout_error(&self) -> Option<Error> {
        let Some(to) = self.t.timeout() else {
            return self.stall_error();
        };
        let who = self.who();
        let peer = if to.peer_world_rank == u32::MAX {
            "a peer".to_string()
        } else {
            format!("world rank {}", to.peer_world_rank)
        };
        let note = to.note.map(|n| format!(" ({n})")).unwrap_or_default();
        let tail = "The object is unusable now: destroy it.";
        Some(match to.kind {
            FailureKind::Mismatch => Error::new(
                K::InvalidArgument,
                format!(
                    "cross-rank check (NVTE_COMM_CHECK): {who} called {} as call {} but {peer} called {} as call {} (descriptor {:#018x} vs this rank's): every rank of the group must make the same calls with the same shapes, types and flags.{note} {tail}",
                    op_name(to.op),
                    to.seq,
                    op_name(desc_op(to.peer_desc)),
                    to.peer_seq,
                    to.peer_desc
                ),
            ),
            FailureKind::Timeout => Error::new(
                K::Timeout,
                format!(
                    "timeout after {:.1} ms: {who} waited for {peer} in {} at step {} of call {}; \
                     the peer never signalled (it did not enter the call, e.g. because it called with other shapes, types or options, which NVTE_COMM_CHECK=1 reports as a cross-rank mismatch; or it failed, or hangs).{note} {tail}",
                    to.waited_ms,
                    op_name(to.op),
                    to.step,
                    to.seq
                ),
            ),
            FailureKind::Transport => Error::new(
                K::Nccl,
                format!(
                    "{who}: the {} transport failed in {} (call {}){note}. {tail}",
                    self.t.name(),
                    op_name(to.op),
                    to.seq
                ),
            ),
        })
    }

    /// Refuse work on a broken object; otherwise enter its context on `stream`, and note
    /// whether the call is being captured into a CUDA graph.
    fn enter(&mut self, stream: StreamHandle) -> Result<ContextGuard> {
        self.call.inline = None; // (set again by the call's begin)
        if self.broken.is_none()
            && let Some(e) = self.timeout_error()
        {
            self.broken = Some(e);
        }
        if self.call.in_call && self.broken.is_none() {
            self.broken = Some(Error::new(
                K::Internal,
                format!(
                    "an earlier call on world rank {} failed after it had started (its error was returned then); its peers wait for it and will time out. The object is unusable now: destroy it.",
                    self.group.world_rank
                ),
            ));
        }
        if let Some(e) = &self.broken {
            return Err(e.clone());
        }
        let guard = ContextGuard::for_stream_no_device(stream)?;
        if guard.id != self.group.ctx {
            invalid!(
                "argument `stream` belongs to a CUDA context of device {} other than the one the overlap object was created in (device {}; after a device reset that context is gone: make the object again)",
                cuda::current_device().unwrap_or(-1),
                self.group.dev.ordinal
            );
        }
        self.call.capturing = self.check_capture(stream)?;
        Ok(guard)
    }

    /// Whether a call on `stream` is captured; refuses what no capture can make right.
    /// The object's own streams join the capture of a captured call and stay in it until
    /// the capture ends: an eager call before that, or a call from another capture, would
    /// be recorded into that capture instead of running.
    fn check_capture(&self, stream: StreamHandle) -> Result<bool> {
        let caller = capture_status(stream)?;
        // An inline object's streams join only the captures of its captured calls: while
        // none was ever captured they are in none (one driver call saved per call).
        let ours = if self.inline_ok() && !self.call.captured {
            Capture::None
        } else {
            capture_status(self.streams.comm[0].raw())?
        };
        match (caller, ours) {
            (Capture::Invalidated, _) => Err(Error::new(
                K::Cuda,
                "argument `stream` is in a CUDA graph capture that was invalidated by an earlier illegal operation: end that capture (cudaStreamEndCapture) and capture again",
            )),
            (Capture::Active(a), Capture::Active(b)) if a != b => unsupported!(
                "argument `stream` is being captured into a CUDA graph while this overlap object's streams belong to another capture that is still open (one capture at a time per object): end that capture first"
            ),
            (Capture::None, Capture::Active(_)) => unsupported!(
                "an eager call on an overlap object whose earlier call was captured into a CUDA graph that is still being captured: the object's streams belong to that capture until it ends (cudaStreamEndCapture); end it first, or make this call in the same capture"
            ),
            (_, Capture::Invalidated) => unsupported!(
                "this overlap object's streams belong to a CUDA graph capture that was invalidated and not ended yet: end it (cudaStreamEndCapture) first"
            ),
            (Capture::Active(_), _) => Ok(true),
            (Capture::None, Capture::None) => Ok(false),
        }
    }

    /// NVTE_COMM_NVTX: the next step of the call (an NVTX range from here to the next
    /// step or the call's end, around the enqueueing of the step's work).
    fn step(&self, name: impl FnOnce() -> String) {
        if nvtx::enabled() {
            let mut s = self.diag.nvtx_step.borrow_mut();
            drop(s.take()); // pop before the next push: NVTX ranges are a stack
            *s = Some(nvtx::range(name));
        }
    }

    /// NVTE_COMM_TRACE: mark a step of this call on `stream`.
    /// Not while capturing: the trace is of the last eager call.
    fn mark(&mut self, stream: StreamHandle, name: impl FnOnce() -> String) -> Result<()> {
        if self.call.capturing {
            return Ok(());
        }
        if let Some(t) = &mut self.diag.trace
            && t.names.len() < t.events.len()
        {
            t.events[t.names.len()].record(stream)?;
            t.names.push(name());
        }
        Ok(())
    }

    fn print_trace(&self) {
        let Some(t) = &self.diag.trace else { return };
        if t.names.is_empty() {
            return;
        }
        // Completed: quiesce synchronized every stream.
        let mut rows: Vec<(f32, &str)> = Vec::new();
        for (e, n) in t.events.iter().zip(&t.names) {
            rows.push((e.elapsed_since(&t.events[0]).unwrap_or(f32::NAN), n));
        }
        rows.sort_by(|a, b| a.0.total_cmp(&b.0));
        let mut out = format!(
            "[te_comm trace] world rank {} (last call):",
            self.group.world_rank
        );
        for (ms, n) in rows {
            out += &format!(" {n}={ms:.3}");
        }
        eprintln!("{out}");
    }

    /// Start a call: the transport numbers it (IPC: increments the device-side call
    /// counter), then an arrival barrier of the group on comm stream 0. A peer signals
    /// arrival only after its previous call completed on its GPU, so passing the barrier
    /// also means no peer still touches any buffer for the last call; and a peer that
    /// never enters makes every rank time out here. Comm streams start after the barrier;
    /// compute streams too when `gate_compute` (their GEMMs write memory that peers read),
    /// else right away.
    ///
    /// `key`: what must agree across the ranks of the call (shapes, types, flags); hashed
    /// with the operation into the call's descriptor, which travels with the arrival and
    /// is compared with every peer's under NVTE_COMM_CHECK.
    fn begin(
        &mut self,
        stream: StreamHandle,
        op: Op,
        gate_compute: bool,
        key: &[u64],
        full: Option<&GemmDesc>,
    ) -> Result<()> {
        self.call.in_call = true;
        // A call that failed half-way left its ranges open: close them first (NVTX
        // ranges are a per-thread stack).
        drop(self.diag.nvtx_step.get_mut().take());
        drop(self.diag.nvtx_call.take());
        if self.inline_ok() {
            return self.begin_inline(stream, op);
        }
        self.diag.nvtx_call = Some(nvtx::range(|| {
            format!(
                "te_comm {op:?} call {} (tp {}, world rank {}, buffer {}x{} {})",
                self.call.calls + 1,
                self.tp(),
                self.group.world_rank,
                self.rows,
                self.cols,
                self.dtype.name()
            )
        }));
        // The descriptor's words: the buffer's shape and type, then the call's key (on
        // the stack: no allocation per call).
        let mut parts = [0u64; 3 + MAX_KEY_WORDS];
        if key.len() > MAX_KEY_WORDS {
            return Err(Error::internal(format!(
                "a call key of {} words exceeds {MAX_KEY_WORDS}",
                key.len()
            )));
        }
        parts[..3].copy_from_slice(&[self.rows as u64, self.cols as u64, self.dtype as u64]);
        parts[3..3 + key.len()].copy_from_slice(key);
        let parts = &parts[..3 + key.len()];
        let desc = call_desc(op as u32, parts);
        self.call.calls += 1;
        self.call.last_captured = self.call.capturing;
        self.call.captured |= self.call.capturing;
        self.report_begin(stream, op, full)?;
        if !self.call.capturing
            && let Some(t) = &mut self.diag.trace
        {
            t.names.clear();
        }
        self.mark(stream, || "start".into())?;
        self.streams.ev_start.record(stream)?;
        let cs = self.streams.comm[0].raw();
        self.streams.ev_start.wait_on(cs)?;
        self.t.begin_call(
            self.call.calls,
            cs,
            WaitInfo {
                op: op as u32,
                step: 0,
            },
            desc,
        )?;
        self.streams.ev_arrived.record(cs)?;
        self.mark(cs, || "arrived".into())?;
        // The other streams are forked when the call first uses them
        // (`compute_stream`, `comm_stream`).
        self.call.forked.set(0);
        self.call.gate_compute = gate_compute;
        Ok(())
    }

    /// Finish a call: comm stream 0 waits for everything, tells the peers this rank is
    /// done with the call, and the caller's stream waits for it. Every stream the call
    /// used (and only those: the ones it forked) is joined back into the caller's (as a
    /// capture requires).
    fn finish(&mut self, stream: StreamHandle) -> Result<()> {
        if self.call.inline.is_some() {
            return self.finish_inline(stream);
        }
        let cs = self.streams.comm[0].raw();
        let forked = self.call.forked.replace(0);
        for (i, (s, e)) in self
            .streams
            .compute
            .iter()
            .zip(self.streams.ev_compute.iter())
            .enumerate()
        {
            if forked & (1 << i) != 0 {
                e.record(s.raw())?;
                e.wait_on(cs)?;
            }
        }
        for (j, (c, e)) in self
            .streams
            .comm
            .iter()
            .zip(self.streams.ev_comm.iter())
            .enumerate()
            .skip(1)
        {
            if forked & (1 << (16 + j)) != 0 {
                e.record(c.raw())?;
                e.wait_on(cs)?;
            }
        }
        self.t.end_call(self.call.calls, cs)?;
        self.mark(cs, || "end".into())?;
        drop(self.diag.nvtx_step.get_mut().take());
        drop(self.diag.nvtx_call.take());
        self.streams.ev_comm[0].record(cs)?;
        self.streams.ev_comm[0].wait_on(stream)?;
        self.report_end(stream)?;
        self.call.in_call = false;
        if self.call.capturing {
            // An event recorded in a capture cannot be queried afterwards: synchronize()
            // leaves the replays of a captured call to the caller's stream.
            return Ok(());
        }
        self.call.done_recorded = true;
        self.streams.ev_done.record(stream)
    }

    /// Whether this object's calls run inline: tp 1 over a transport that enqueues nothing
    /// per call alone (`Caps::idle_alone`: IPC and NCCL; no peer, no flag, no barrier), without
    /// NVTE_COMM_REPORT (which times the comm alone on its streams) or NVTE_COMM_TRACE.
    /// Fixed for the object's life. An inline call enqueues its work on the caller's
    /// stream in program order (the order its dependencies already follow), its GEMMs
    /// with the whole workspace and no SM margin; it forks and joins nothing, so a
    /// comm-GEMM-sized call costs about one nvte_cublas_gemm of host time.
    pub(crate) fn inline_ok(&self) -> bool {
        self.tp() == 1
            && self.group.caps.idle_alone
            && self.diag.report.is_none()
            && self.diag.trace.is_none()
    }

    /// [`Self::begin`] of an inline call. While the caller's stream is captured, comm
    /// stream 0 joins the capture (an empty fork, joined back by `finish_inline`): the
    /// object then belongs to the capture until it ends, as a forking call's streams do,
    /// so `synchronize` and eager calls are refused meanwhile, as documented.
    fn begin_inline(&mut self, stream: StreamHandle, op: Op) -> Result<()> {
        if nvtx::enabled() {
            self.diag.nvtx_call = Some(nvtx::range(|| {
                format!(
                    "te_comm {op:?} call {} (tp 1, inline, world rank {}, buffer {}x{} {})",
                    self.call.calls + 1,
                    self.group.world_rank,
                    self.rows,
                    self.cols,
                    self.dtype.name()
                )
            }));
        }
        self.call.calls += 1;
        self.call.last_captured = self.call.capturing;
        self.call.captured |= self.call.capturing;
        if self.call.capturing {
            self.streams.ev_start.record(stream)?;
            self.streams.ev_start.wait_on(self.streams.comm[0].raw())?;
        }
        self.call.forked.set(0);
        self.call.gate_compute = false;
        self.call.inline = Some(stream);
        Ok(())
    }

    /// [`Self::finish`] of an inline call: the capture's join of comm stream 0, or (eager)
    /// the completion event `synchronize` waits for.
    fn finish_inline(&mut self, stream: StreamHandle) -> Result<()> {
        self.call.inline = None;
        if self.call.capturing {
            let cs = self.streams.comm[0].raw();
            self.streams.ev_comm[0].record(cs)?;
            self.streams.ev_comm[0].wait_on(stream)?;
        }
        drop(self.diag.nvtx_step.get_mut().take());
        drop(self.diag.nvtx_call.take());
        self.call.in_call = false;
        if self.call.capturing {
            return Ok(());
        }
        self.call.done_recorded = true;
        self.streams.ev_done.record(stream)
    }

    /// Wait (on `stream`) until every peer finished the last call begun on this rank (the
    /// call number is read on the device; no-op when no call was ever issued).
    fn wait_done(&self, stream: StreamHandle, op: Op) -> Result<()> {
        self.t.wait_done(
            self.call.calls,
            stream,
            WaitInfo {
                op: op as u32,
                step: 0,
            },
        )
    }

    /// The workspace slice of compute stream `i` when `n` streams run GEMMs at once
    /// (concurrent GEMMs must not share one; GEMMs in order use all of it).
    fn workspace_slice(full: &GemmDesc, i: usize, n: usize) -> (DevPtr, usize) {
        if n <= 1 {
            return (full.workspace, full.workspace_bytes);
        }
        if full.workspace.is_null() || full.workspace_bytes < 256 * n {
            return (DevPtr::NULL, 0);
        }
        let per = full.workspace_bytes / n / 256 * 256;
        (full.workspace + i * per, per)
    }

    /// Run a chunk GEMM on compute stream `stream_idx`; `concurrent`: whether GEMMs on
    /// other compute streams may run at the same time (then the workspace is split).
    fn run_gemm(
        &self,
        g: &GemmDesc,
        guard: &ContextGuard,
        (stream_idx, concurrent): (usize, bool),
        side: SideCopy,
    ) -> Result<()> {
        if self.skipping_gemms() {
            // NVTE_COMM_REPORT's comm-alone runs: the side copy is communication's share
            if side.bytes != 0 {
                let stream = self.compute_stream(stream_idx)?;
                // SAFETY: the plan's side copy (the shard into the engine's buffer).
                return unsafe {
                    self.copy_segments(&[(side.dst, side.src, side.bytes)], stream, true)
                };
            }
            return Ok(());
        }
        let mut g = *g;
        // Inline, every GEMM runs in order on the caller's stream: all of the workspace.
        let n = if concurrent && self.call.inline.is_none() {
            self.streams.compute.len()
        } else {
            1
        };
        let (w, wb) = Self::workspace_slice(&g, stream_idx, n);
        g.workspace = w;
        g.workspace_bytes = wb;
        let stream = self.compute_stream(stream_idx)?;
        // The side copy in our GEMM's launch where it runs it (inline, tp 1: nothing runs
        // beside it), else the engine's copy kernel first (a launch costs the host less
        // than a device-to-device cuMemcpyAsync).
        // SAFETY (here and below): `g` is a step of this call's plan: the planner derived
        // it from the call's full descriptor (`gemm::desc_from_te` of the caller's
        // tensors, whose extents it checked) or the engine's own buffers, inside their
        // extents (the protocol tests check every access is in bounds), and the
        // workspace is this stream's slice of the call's; the side copy is the plan's
        // (the shard into the engine's buffer). All stay alive until the call finishes.
        if self.call.inline.is_some() && unsafe { gemm::run_copying(&g, side, guard, stream)? } {
            return Ok(());
        }
        if side.bytes != 0 {
            // SAFETY: the plan's side copy (the shard into the engine's buffer).
            unsafe { self.copy_segments(&[(side.dst, side.src, side.bytes)], stream, true)? };
        }
        if self.call.inline.is_some() {
            // SAFETY: as above.
            unsafe { gemm::run(&g, guard, stream) }
        } else {
            // SAFETY: as above.
            unsafe { gemm::run_beside_comm(&g, guard, stream) }
        }
    }

    /// Our own GEMM on compute stream `stream_idx` (the fused algorithms). A launch that
    /// fails clears the flags it would have waited on (the next call starts from zero);
    /// where it does not run (a failed launch, NVTE_COMM_REPORT's comm-alone runs) its
    /// done signals are written all the same, so that no stream waits for them forever.
    fn run_fused(
        &self,
        g: &GemmDesc,
        hooks: &gemm::sm90::Hooks,
        sms: usize,
        stream_idx: usize,
    ) -> Result<()> {
        let s = self.compute_stream(stream_idx)?;
        let skip = self.skipping_gemms(); // NVTE_COMM_REPORT's comm-alone runs
        let hooks = &gemm::sm90::Hooks {
            stall: self.mem.stall.as_ref().map_or(DevPtr::NULL, |r| r.device()),
            stall_ns: self.stall_ms().saturating_mul(1_000_000),
            ..*hooks
        };
        let r = match &self.own_gemm {
            _ if skip => Ok(()),
            // SAFETY: `g` is a fused step of this call's plan (as in `run_gemm`); the hooks'
            // flags and done signals are this engine's flag slots, sized by the planner,
            // and the stall record is this engine's.
            Some(Ok(b)) => unsafe { b.run(g, hooks, sms, s) },
            _ => Err(Error::internal(
                "the plan runs our sm90 GEMM, which is not loaded",
            )),
        };
        if r.is_err() && !hooks.flags.is_null() {
            // SAFETY: the hooks' flags are this engine's flag memory, sized for n_flags.
            let _ = unsafe { memset_async(hooks.flags, 4 * hooks.n_flags(g.n), s) };
        }
        if (r.is_err() || skip) && !hooks.done.is_null() {
            for j in 0..g.n.div_ceil(hooks.done_rows.max(1)) {
                // SAFETY: the done signals are this engine's flags, one u32 per done block.
                let _ = unsafe { write_value32(hooks.done + 4 * j, hooks.done_value, s) };
            }
        }
        r
    }

    /// A tensor view of the buffer (TE's get_ubuf): the whole [rows, cols] or this
    /// rank's chunk [rows / tp, cols].
    pub fn view(&self, local_chunk: bool) -> Result<Tensor> {
        let (ptr, rows) = if local_chunk {
            let rc = self.rows / self.tp();
            (
                self.buffer() + self.tp_rank() * rc * self.cols * eb(self.dtype),
                rc,
            )
        } else {
            (self.buffer(), self.rows)
        };
        Ok(Tensor {
            data: Buffer::new(ptr, self.dtype, Shape::new(&[rows, self.cols])?)?,
            ..Default::default()
        })
    }

    /// Copy `input` into the buffer (this rank's chunk, or the whole buffer) on `stream`,
    /// after every peer has finished the previous call (which may read this buffer).
    pub fn copy_into_buffer(
        &mut self,
        input: crate::cuda::Checked<&Tensor>,
        local_chunk: bool,
        stream: StreamHandle,
    ) -> Result<()> {
        let input = *input;
        let _guard = self.enter(stream)?;
        let view = self.view(local_chunk)?;
        let i = &input.data;
        if i.dtype != self.dtype {
            invalid!(
                "tensor `input` dtype {} differs from the buffer dtype {}",
                i.dtype.name(),
                self.dtype.name()
            );
        }
        if i.numel() != view.data.numel() {
            invalid!(
                "tensor `input` has shape {} ({} elements) but the {} is {} ({} elements)",
                i.shape,
                i.numel(),
                if local_chunk { "local chunk" } else { "buffer" },
                view.data.shape,
                view.data.numel()
            );
        }
        if i.ptr.is_null() {
            invalid!("tensor `input` has a NULL data pointer");
        }
        self.wait_done(stream, Op::CopyIntoBuffer)?;
        // SAFETY: the view lies in this engine's buffer; `input` has its dtype and element
        // count (checked above), so both ranges hold the view's bytes.
        unsafe { copy_async(view.data.ptr, i.ptr, view.data.bytes(), stream) }
    }

    /// Whether a CUDA-graph capture holding this object's streams (its calls) is still
    /// open: then its memory must not be freed (the graph being captured uses it).
    pub fn in_open_capture(&self) -> bool {
        let Ok(_guard) = self.own_context() else {
            return false;
        };
        matches!(
            capture_status(self.streams.comm[0].raw()),
            Ok(Capture::Active(_) | Capture::Invalidated)
        )
    }

    /// Host-wait for the last call's work; reports a recorded timeout. Bounded: gives up
    /// (with a timeout error) after the configured timeout plus 5 s (twice the timeout
    /// plus 5 s once our GEMM, whose waits give up after that, has run). When the last call
    /// was captured into a CUDA graph, its replays run on the caller's stream, which the
    /// caller waits for: then only recorded timeouts are reported. Refused (nothing
    /// waited for, the capture left intact) while a capture holding this object's streams
    /// is open: a host wait cannot be part of a graph.
    pub fn synchronize(&mut self) -> Result<()> {
        if let Some(e) = &self.broken {
            return Err(e.clone());
        }
        let _guard = self.own_context()?;
        if !capture_status(self.streams.comm[0].raw())?.none() {
            unsupported!(
                "called while a CUDA graph capture that contains this overlap object's calls is still open: a host wait cannot be captured; end the capture (cudaStreamEndCapture) first, then synchronize the stream its graph is launched on"
            );
        }
        if self.call.last_captured {
            if let Some(e) = self.timeout_error() {
                self.broken = Some(e.clone());
                return Err(e);
            }
            return Ok(());
        }
        // (the longest a call can take on a device that records every failure: the
        // transport's timeout, or our GEMM's give-up time where it may have run)
        let longest = match self.mem.stall {
            Some(_) => self.stall_ms(),
            None => self.policy.timeout_ms as u64,
        };
        let limit = std::time::Duration::from_millis(longest) + std::time::Duration::from_secs(5);
        let t0 = std::time::Instant::now();
        loop {
            // Relaxed: an event query must not disturb another thread's global-mode capture.
            let done = !self.call.done_recorded
                || crate::cuda::resources::with_relaxed_capture(|| self.streams.ev_done.done())?;
            if let Some(e) = self.timeout_error() {
                self.broken = Some(e.clone());
                return Err(e);
            }
            if done {
                return Ok(());
            }
            if t0.elapsed() > limit {
                return Err(Error::new(
                    K::Timeout,
                    format!(
                        "the last call on world rank {} did not complete within {:?} (no peer timeout was recorded)",
                        self.group.world_rank, limit
                    ),
                ));
            }
            std::thread::sleep(std::time::Duration::from_micros(200));
        }
    }

    /// Before freeing: wait (bounded) until every peer finished reading / writing this
    /// rank's buffer for the last call. Graph replays are the caller's to have finished
    /// (the object must outlive every launch of a graph that holds its calls); nothing is
    /// waited for while a capture holding this object's streams is still open.
    pub fn quiesce(&mut self) {
        if self.broken.is_some() || self.timeout_error().is_some() || self.call.in_call {
            // Peers may still write this rank's memory: the transport keeps what they can
            // reach when it would otherwise be handed to another allocation.
            self.keep_memory_after_failure();
            return;
        }
        // The object's own context, whatever the caller's thread has current (a process
        // driving several GPUs destroys every rank's objects from one thread): the wait
        // below is a kernel on this object's stream.
        let Ok(_guard) = self.own_context() else {
            self.keep_memory_after_failure();
            return;
        };
        let cs = self.streams.comm[0].raw();
        if !matches!(capture_status(cs), Ok(Capture::None)) {
            return;
        }
        // Relaxed: these host waits on the object's own streams (in no capture) must not
        // disturb another thread's global-mode capture.
        let waited = crate::cuda::resources::with_relaxed_capture(|| {
            let waited = self.wait_done(cs, Op::Destroy).is_ok()
                && self.streams.comm[0].synchronize().is_ok();
            for s in self.streams.compute.iter().chain(self.streams.comm.iter()) {
                let _ = s.synchronize();
            }
            Ok(waited)
        });
        // Not known that every peer is done with this rank's memory (the wait could not
        // be enqueued, or it timed out: a broken peer's queued puts may still land): keep
        // what they can reach.
        if !matches!(waited, Ok(true)) || self.timeout_error().is_some() {
            self.keep_memory_after_failure();
        }
    }

    /// What peers, or our GEMM still running after it gave up, may still touch is not
    /// freed: the transport's memory and the stall record our GEMM polls.
    fn keep_memory_after_failure(&mut self) {
        self.t.keep_memory_after_failure();
        std::mem::forget(self.mem.stall.take());
    }

    /// Enter this object's own context (the one its streams belong to).
    fn own_context(&self) -> Result<ContextGuard> {
        ContextGuard::for_stream_no_device(self.streams.comm[0].raw())
    }
}

impl Drop for Overlap {
    fn drop(&mut self) {
        self.quiesce();
        self.print_trace();
        self.print_report();
    }
}

#[cfg(test)]
mod tests {
    use crate::transport::tag;

    #[test]
    fn flag_values_grow_across_calls_and_steps() {
        // Flag values are (call number << 16) + tag (computed on the device): waits are
        // "flag >= value", so values must never decrease for a given slot.
        let val = |call: u64, step: usize| (call << 16) + tag(step);
        assert!(val(1, 0) < val(1, 1) && val(1, 65533) < val(2, 0));
        assert!(val(1, 0) > 0);
        // "done" of call n (tag 1) satisfies wait_done's (n << 16) (tag 0), not n + 1's;
        // wait_done before any call (counter 0) waits for 0.
        assert!(val(3, 0) >= 3 << 16 && val(3, 0) < 4 << 16);
    }
}
