//! The cuBLASMp-style API of TE's `comm_gemm.h` on top of the overlap engine.
//!
//! Global sizes m, n, k in cuBLAS (column-major) terms, D = op(A) op(B); local tensors
//! follow nvte_cublas_gemm's row-major conventions (A is transa ? [m, k] : [k, m], B is
//! transb ? [k, n] : [n, k], D is [n, m], each with this rank's share). Distribution is
//! by blocks of ceil(global / nranks) ([`numroc`]):
//! - all-gather GEMM: m and n split; B gathered along n; D = [n, m_local];
//! - GEMM reduce-scatter: k split; D summed and scattered along n: [n_local, m];
//! - GEMM all-reduce: k split; every rank gets the whole sum [n, m].
//!
//! The bias (length of D's m) is added once. Sizes not divisible by nranks are padded
//! internally. The context owns its engines (one per buffer dtype), created on first use
//! and re-created larger when a larger call arrives (collectively: every rank makes the
//! same calls).
//!
//! At one rank (nothing to communicate) a call is its GEMM: validated as at any size, then
//! one cuBLASLt GEMM on the caller's stream with the context's workspace, no SM reserved
//! and no engine (plus the copy into `b_gathered` when asked), unless NVTE_COMM_REPORT or
//! NVTE_COMM_TRACE asked for the engine's figures at the context's creation, or the
//! reduce-scatter writes an FP8 output from 16-bit inputs (which cuBLASLt cannot: the
//! engine's bf16 partials and scaling kernel do it).
//!
//! CUDA graphs: a call can be captured (any capture mode) once the context has an engine
//! large enough for it, i.e. after one eager call of that operation with those (or larger)
//! sizes (warm-up): creating an engine is collective (NCCL exchanges, allocation,
//! synchronisation) and cannot be captured, so a call that would need one returns
//! NVTE_COMM_ERROR_UNSUPPORTED during a capture, before enqueueing anything. Engines and
//! scratch buffers that a captured call used are kept (not freed) when a larger eager call
//! replaces them, so the graph stays valid for the context's life. At one rank the same
//! warm-up rule holds (the sizes of the eager calls are recorded; no engine is made), so
//! that code written at one rank captures the same way at any size.
use crate::bootstrap::Bootstrap;
use crate::cuda::StreamHandle;
use crate::cuda::resources::{
    Capture, DeviceMem, capture_status, copy_2d, copy_async, memset_async,
};
use crate::cuda::{ContextGuard, DevPtr};
use crate::error::{Error, Result};
use crate::gemm::{Operands, TeGemm};
use crate::overlap::policy::Tiles;
use crate::overlap::{Overlap, Pins, Policy, ag::AgArgs, ar::ArArgs, rs::RsArgs};
use crate::tensor::{Buffer, DType, Shape, Tensor};
use crate::transport::nccl::channel::Owned as _;
use crate::tune;
use crate::{invalid, unsupported};
use call::EngineId;
use std::collections::HashMap;

mod agree;
pub(crate) mod call;
#[cfg(test)]
mod protocol;

/// The calls of the context (the autotuner's operations).
pub use crate::tune::Op as Kind;

/// NVTE_COMM_GEMM_FP8_FAST_ACCUM (a boolean; default off), read once when a context is
/// created: 1 runs the comm-GEMM calls' FP8 GEMMs with cuBLASLt's fast accumulation
/// (`CUBLASLT_MATMUL_DESC_FAST_ACCUM`, `use_split_accumulator = false`); 0 or unset
/// accumulates at full precision, as TE's comm-GEMM (cuBLASMp) backend does.
pub fn fp8_fast_accum() -> Result<bool> {
    Ok(crate::env::GEMM_FP8_FAST_ACCUM.get()?.unwrap_or(false))
}

/// This rank's share of `global` under block distribution with block ceil(global / nranks).
pub fn numroc(global: i64, nranks: usize, rank: usize) -> i64 {
    if global <= 0 {
        return 0;
    }
    let block = (global as u64).div_ceil(nranks as u64) as i64;
    (global - rank as i64 * block).clamp(0, block)
}

pub struct GemmCall<'a> {
    pub kind: Kind,
    pub m: i64,
    pub n: i64,
    pub k: i64,
    pub a: &'a Tensor,
    pub b: &'a Tensor,
    pub d: &'a Tensor,
    pub bias: Option<&'a Tensor>,
    pub pre_act_out: Option<&'a Tensor>,
    pub transa: bool,
    pub transb: bool,
    pub grad: bool,
    pub accumulate: bool,
    pub comm_sm_count: i32,
    /// All-gather only: receives the gathered B ([n, k], needs transb = false), e.g. for
    /// the weight-gradient GEMM of a training step.
    pub b_gathered: Option<&'a Tensor>,
    /// the caller left the algorithm to the library (algo Default): the autotuner may
    /// choose the configuration (see `crate::tune`)
    pub tune: bool,
    /// kNVTECommGemmAlgoAtomicP2P / AtomicMulticast: the engine's `atomic` setting (the
    /// fused all-gather, and our GEMM in one launch for the ring reduce-scatter)
    pub atomic: bool,
}

impl<'a> GemmCall<'a> {
    /// The engine operands of this call with B `b`, output `d` and workspace `ws`: its A
    /// and layout; no bias, pre-activation output, gradient epilogue or accumulation
    /// (each call site sets those it passes on). FP8 GEMMs accumulate at full precision
    /// (TE's comm-GEMM backend) unless `fast_accum` (the context's
    /// NVTE_COMM_GEMM_FP8_FAST_ACCUM) asks for cuBLASLt's fast accumulation.
    fn operands<D>(
        &self,
        b: &'a Tensor,
        d: D,
        ws: &'a Tensor,
        fast_accum: bool,
    ) -> Operands<'a, D> {
        Operands {
            a: self.a,
            b,
            d,
            bias: None,
            pre_gelu_out: None,
            transa: self.transa,
            transb: self.transb,
            grad: false,
            workspace: Some(ws),
            accumulate: false,
            use_split_accumulator: !fast_accum,
            math_sm_count: 0,
        }
    }
}

/// A comm-GEMM context: the group (bootstrap, ranks), the [`Policy`] its engines are made
/// with, its engines (one per buffer dtype), its memory, the call in progress, the options
/// read at its creation and the autotuner's state.
pub struct CommGemmCtx {
    bs: Bootstrap,
    nranks: usize,
    rank: usize,
    /// the engines' policy: TE's defaults, the environment and its pins, read at the
    /// context's creation (a call's tuned policy is this one with the tuner's choices)
    policy: Policy,
    engines: Vec<Overlap>,
    mem: CtxMem,
    call: CtxCall,
    opts: CtxOptions,
    tuner: Tuner,
}

/// The context's device memory, and what it keeps for graphs.
#[derive(Default)]
struct CtxMem {
    workspace: Option<DeviceMem>,
    scratch: Vec<DeviceMem>,
    /// engines and scratch replaced by larger ones while a graph may still use them
    retired_engines: Vec<Overlap>,
    retired_scratch: Vec<DeviceMem>,
    /// the direct calls' stand-in for the engines: the largest buffer (bytes) an eager
    /// call of each buffer dtype would have sized its engine to (the warm-up rule)
    direct_sizes: Vec<(DType, usize)>,
}

/// The call in progress and the calls so far.
#[derive(Default)]
struct CtxCall {
    /// the call in progress is being captured into a CUDA graph
    capturing: bool,
    /// some call was captured: replaced scratch buffers may be used by a graph
    captured: bool,
    /// `prepare`: create the engine and buffers a call needs, enqueue nothing
    preparing: bool,
    /// the engine of the last call (NVTE_COMM_REPORT)
    last_engine: Option<EngineId>,
    /// the eager calls agreed on so far (the agreement's call number)
    agreed: u64,
    /// the tuned policy of the call in progress (None: the context's)
    current: Option<Policy>,
}

/// What the environment said at the context's creation besides the policy.
#[derive(Clone, Copy, Debug)]
struct CtxOptions {
    /// NVTE_COMM_REPORT: its engines report
    report: bool,
    /// NVTE_COMM_GEMM_FP8_FAST_ACCUM: FP8 GEMMs use cuBLASLt's fast accumulation
    /// (default off: full-precision accumulation, as TE's backend)
    fp8_fast_accum: bool,
    /// one rank, no report or trace: every call is its GEMM (module doc)
    direct: bool,
    /// NVTE_COMM_CHECK: eager calls agree with the peers on the host first (`agree`)
    check: bool,
}

/// The autotuner: NVTE_COMM_TUNE and its knobs at the context's creation, the agreed
/// policies of this context by key, and the disk cache.
struct Tuner {
    mode: tune::Mode,
    env: TuneEnv,
    tuned: HashMap<tune::Key, Policy>,
    cache: tune::Cache,
}

/// The autotuner's environment knobs besides its mode, read when a context is created.
#[derive(Clone, Copy, Debug)]
struct TuneEnv {
    budget_ms: f64,
    pick: Option<i32>,
    verbose: bool,
}

/// The environment a context is created with (`CommGemmCtx::read_env`).
struct CtxEnv {
    tune_env: TuneEnv,
    policy: Policy,
    trace: bool,
    tune_mode: tune::Mode,
    fp8_fast_accum: bool,
    check: bool,
}

fn shape_of(t: &Tensor, what: &str) -> Result<(usize, usize)> {
    let (b, transposed) = data_of(t);
    let shape = b.rows_cols().ok_or_else(|| {
        Error::invalid(format!(
            "tensor `{what}` must have 2 dimensions, got {}{}",
            b.shape,
            if transposed {
                " (its columnwise data)"
            } else {
                ""
            }
        ))
    })?;
    Ok(if transposed {
        (shape.1, shape.0)
    } else {
        shape
    })
}

/// The data a tensor's logical shape comes from: its rowwise data, or, for a
/// block-scaled tensor that holds only columnwise data (the transposed copy: a weight
/// quantized for transa = false), that data, transposed (`true`), as TE's Tensor::shape.
fn data_of(t: &Tensor) -> (&Buffer, bool) {
    let present = |b: &Buffer| !b.ptr.is_null() || b.numel() > 0;
    let block = crate::tensor::BlockMode::from_scaling_mode(t.scaling_mode).is_some();
    if block && !present(&t.data) && present(&t.columnwise_data) {
        (&t.columnwise_data, true)
    } else {
        (&t.data, false)
    }
}

/// The error of a call that needs a new or larger buffer while the context's stream is
/// being captured (creating or growing one cannot be captured; nothing is enqueued).
fn needs_warmup(kind: Kind, dtype: DType, bytes: usize, smaller: bool, what_to_do: &str) -> Error {
    Error::unsupported(format!(
        "{} was called during a CUDA graph capture, but the context has no {} engine with {bytes} bytes of buffer{}: {what_to_do}; nothing was enqueued",
        kind.api_name(),
        dtype.name(),
        if smaller {
            " (the one it has is smaller)"
        } else {
            " yet"
        }
    ))
}

fn expect_shape(t: &Tensor, what: &str, want: [usize; 2], why: &str) -> Result<()> {
    let got = shape_of(t, what)?;
    let (data, transposed) = data_of(t);
    if got != (want[0], want[1]) {
        invalid!(
            "tensor `{what}` has shape {} but must be [{}, {}] ({why})",
            if transposed {
                format!(
                    "[{}, {}] (its columnwise data {}, transposed)",
                    got.0, got.1, data.shape
                )
            } else {
                data.shape.to_string()
            },
            want[0],
            want[1]
        );
    }
    if data.ptr.is_null() && want[0] * want[1] > 0 {
        invalid!(
            "tensor `{what}` has a NULL {} data pointer",
            if transposed { "columnwise" } else { "rowwise" }
        );
    }
    Ok(())
}

/// A copy of `t` whose data is `ptr` with shape `shape` (scales kept).
fn rebased(t: &Tensor, ptr: DevPtr, shape: &[usize]) -> Result<Tensor> {
    let mut c = t.clone();
    c.data = Buffer::new(ptr, t.data.dtype, Shape::new(shape)?)?;
    Ok(c)
}

impl CommGemmCtx {
    /// `comm` is the group's NCCL communicator (not owned); nranks / rank must match it.
    pub fn create(comm: crate::cuda::NcclComm, nranks: i32, rank: i32) -> Result<CommGemmCtx> {
        // Argument checks come before anything is loaded.
        if nranks <= 0 || rank < 0 || rank >= nranks {
            invalid!(
                "nranks = {nranks} and rank = {rank} are inconsistent (need nranks >= 1 and 0 <= rank < nranks)"
            );
        }
        let env = Self::read_env()?;
        let bs = Bootstrap::from_nccl(comm)?;
        if bs.size == 0 {
            invalid!("the communicator reports size 0");
        }
        if nranks as i64 != bs.size as i64 || rank as i64 != bs.rank as i64 {
            invalid!(
                "nranks = {nranks}, rank = {rank} disagree with the communicator (size {}, rank {})",
                bs.size,
                bs.rank
            );
        }
        let _guard = ContextGuard::for_stream(StreamHandle::NULL)?;
        Self::with_env(bs, env)
    }

    /// The context's environment knobs, each read once (strict: a bad value is an error
    /// naming it), before anything is loaded.
    fn read_env() -> Result<CtxEnv> {
        let policy = Policy::from_env()?;
        policy.check()?;
        let policy = Policy {
            pins: Pins::from_env()?,
            ..policy
        };
        let trace = crate::overlap::trace_enabled()?;
        let tune_mode = tune::mode()?;
        let tune_env = TuneEnv {
            budget_ms: tune::budget_ms()?,
            pick: tune::forced_pick()?,
            verbose: crate::env::TUNE_VERBOSE.get()?.unwrap_or(false),
        };
        Ok(CtxEnv {
            tune_env,
            policy,
            trace,
            tune_mode,
            fp8_fast_accum: fp8_fast_accum()?,
            check: crate::overlap::check_enabled()?,
        })
    }

    /// A context whose setup exchanges go through `bs` (an NCCL communicator or the
    /// caller's allgather/barrier callbacks). Collective over an NCCL communicator of
    /// several ranks (the context's own communicator is made here), else nothing
    /// collective happens here: the engines are created, collectively, by the first call
    /// (or `prepare`) of each kind.
    pub fn from_bootstrap(bs: Bootstrap) -> Result<CommGemmCtx> {
        Self::with_env(bs, Self::read_env()?)
    }

    fn with_env(bs: Bootstrap, env: CtxEnv) -> Result<CommGemmCtx> {
        // Over a caller's NCCL communicator of several ranks, the one collective step
        // here: the context's own communicator, which every later exchange uses (its
        // waits end by aborting it, so none can leave a kernel on the GPU for good; see
        // `crate::transport::nccl::channel`). Otherwise no CUDA here: each call enters its
        // stream's context (a framework thread may have none current, and device 0 may
        // not be this rank's).
        let timeout = std::time::Duration::from_millis(env.policy.timeout_ms.max(1) as u64);
        let bs = bs.owned(timeout)?;
        let report = Overlap::report_enabled()?;
        let direct = bs.size == 1 && !report && !env.trace;
        Ok(CommGemmCtx {
            nranks: bs.size,
            rank: bs.rank,
            bs,
            policy: env.policy,
            engines: Vec::new(),
            mem: CtxMem::default(),
            call: CtxCall::default(),
            opts: CtxOptions {
                report,
                fp8_fast_accum: env.fp8_fast_accum,
                direct,
                check: env.check,
            },
            tuner: Tuner {
                mode: env.tune_mode,
                env: env.tune_env,
                tuned: HashMap::new(),
                cache: tune::Cache::default(),
            },
        })
    }

    /// Everything `call(c, stream)` would create (engine, scratch and workspace
    /// buffers), created now, with nothing enqueued: collective like the call. Lets a
    /// framework allocate outside a later graph capture (XLA's initialize stage).
    pub fn prepare(&mut self, c: &GemmCall, stream: StreamHandle) -> Result<()> {
        self.call.preparing = true;
        let r = self.call(c, stream);
        self.call.preparing = false;
        r
    }

    pub fn numroc(&self, global: i64) -> Result<i64> {
        if global < 0 {
            invalid!("global_size = {global} must be >= 0");
        }
        Ok(numroc(global, self.nranks, self.rank))
    }

    /// The engine for `dtype` with at least `bytes` of buffer (re-created larger if needed;
    /// never during a graph capture: see the module doc).
    fn engine(&mut self, kind: Kind, dtype: DType, bytes: usize) -> Result<EngineId> {
        let existing = self.engines.iter().position(|e| e.shape().2 == dtype);
        if let Some(i) = existing {
            let (r, c, _) = self.engines[i].shape();
            if r * c * dtype.bits() / 8 >= bytes {
                self.call.last_engine = Some(EngineId::new(i));
                return Ok(EngineId::new(i));
            }
        }
        if self.call.capturing {
            return Err(needs_warmup(
                kind,
                dtype,
                bytes,
                existing.is_some(),
                "creating one is collective (NCCL exchanges, allocation, synchronisation) and cannot be captured. Make one eager call of this operation with these (or larger) sizes on every rank before capturing (warm-up)",
            ));
        }
        if let Some(i) = existing {
            let old = self.engines.remove(i);
            if old.captured() {
                // A captured graph may still use its buffers, flags and peers' mappings
                // (every rank keeps its own: the calls are collective).
                self.mem.retired_engines.push(old);
            } // else dropped: waits for peers, frees
        }
        let tp = self.nranks;
        let cols = 256usize;
        let e = dtype.bits() / 8;
        let rows = bytes.div_ceil(cols * e).div_ceil(tp).max(1) * tp;
        let policy = Policy {
            tp_size: tp as i32,
            ..self.policy
        };
        let mut o = Overlap::create(&self.bs, policy, rows, cols, dtype)?;
        if self.opts.report {
            o.enable_report()?;
        }
        self.engines.push(o);
        let id = EngineId::new(self.engines.len() - 1);
        self.call.last_engine = Some(id);
        Ok(id)
    }

    /// The direct calls' warm-up rule ([`Self::engine`]'s, without an engine): a call
    /// whose buffer dtype has not yet been sized to `bytes` by an eager call is refused
    /// during a capture, else the size is recorded.
    fn direct_size(&mut self, kind: Kind, dtype: DType, bytes: usize) -> Result<()> {
        let existing = self.mem.direct_sizes.iter().position(|e| e.0 == dtype);
        if let Some(i) = existing
            && self.mem.direct_sizes[i].1 >= bytes
        {
            return Ok(());
        }
        if self.call.capturing {
            return Err(needs_warmup(
                kind,
                dtype,
                bytes,
                existing.is_some(),
                "make one eager call of this operation with these (or larger) sizes before capturing (warm-up; at one rank no engine is made, but the rule is the same as at any size)",
            ));
        }
        match existing {
            Some(i) => self.mem.direct_sizes[i].1 = bytes,
            None => self.mem.direct_sizes.push((dtype, bytes)),
        }
        Ok(())
    }

    /// A direct call (one rank, module doc): the GEMM `g` on `stream` with no SM margin,
    /// after `copy` (dst, src, bytes) when given; `kind`, `dtype` and `bytes` are what
    /// the engine path would size its engine by (the warm-up rule). `comm_sm_count`
    /// (nothing communicates) is checked against the device as the engine would.
    #[allow(clippy::too_many_arguments)]
    fn direct_call(
        &mut self,
        c: &GemmCall,
        dtype: DType,
        bytes: usize,
        g: &TeGemm,
        copies: &[(DevPtr, DevPtr, usize)],
        guard: &ContextGuard,
        stream: StreamHandle,
    ) -> Result<()> {
        let block = crate::gemm::block::is_block(g);
        let desc = if block {
            crate::gemm::block::check_block(g)?;
            None
        } else {
            Some(crate::gemm::desc_from_te(g)?)
        };
        if c.comm_sm_count > 0 {
            let sms = crate::cuda::device_info(crate::cuda::current_device()?)?.sm_count;
            if c.comm_sm_count >= sms {
                invalid!(
                    "comm_sm_count = {} must be in 1..{sms} (the device's SM count)",
                    c.comm_sm_count
                );
            }
        }
        self.direct_size(c.kind, dtype, bytes)?;
        if self.call.preparing {
            return Ok(());
        }
        for &(dst, src, bytes) in copies {
            // SAFETY: the call's own copies (B and its scales into the gathered output),
            // both ranges of its tensors, whose sizes the call's checks fixed.
            unsafe { copy_async(dst, src, bytes, stream)? };
        }
        match desc {
            // SAFETY: `desc` is `gemm::desc_from_te` of the call's operands: the request's
            // tensors, which the C boundary resolved and validated, and the context's own
            // scratch, sized by the call's checks; all alive until the caller's stream
            // runs it.
            Some(desc) => unsafe { crate::gemm::run(&desc, guard, stream) },
            // SAFETY: `g` holds the request's tensors (resolved and validated by the C
            // boundary; block_desc checks data and scales against each other) and the
            // context's workspace, alive until the caller's stream runs the GEMM.
            None => unsafe { crate::gemm::block::run_block(g, stream) },
        }
    }

    /// Whether a CUDA-graph capture holding calls of one of its engines is still open
    /// (see `Overlap::in_open_capture`; a context without engines cannot tell).
    pub fn in_open_capture(&self) -> bool {
        self.engines.iter().any(|e| e.in_open_capture())
    }

    /// NVTE_COMM_REPORT: the last timed call's figures (of the engine of the last call).
    pub fn last_report(&mut self) -> Result<Option<crate::overlap::report::Figures>> {
        match self
            .call
            .last_engine
            .and_then(|i| self.engines.get_mut(i.index()))
        {
            Some(e) => e.last_report(),
            None => Ok(None),
        }
    }

    /// Scratch buffer `slot` of at least `bytes` (allocations also during a capture; a
    /// replaced buffer is kept when a graph may use it).
    fn scratch(&mut self, slot: usize, bytes: usize) -> Result<DevPtr> {
        while self.mem.scratch.len() <= slot {
            self.mem.scratch.push(DeviceMem::new_relaxed(1)?);
        }
        if self.mem.scratch[slot].bytes < bytes {
            let old =
                std::mem::replace(&mut self.mem.scratch[slot], DeviceMem::new_relaxed(bytes)?);
            if self.call.captured || self.call.capturing {
                self.mem.retired_scratch.push(old);
            }
        }
        Ok(self.mem.scratch[slot].ptr)
    }

    fn workspace(&mut self) -> Result<Tensor> {
        if self.mem.workspace.is_none() {
            self.mem.workspace = Some(DeviceMem::new_relaxed(32 << 20)?);
        }
        let w = self.mem.workspace.as_ref().unwrap();
        Ok(Tensor {
            data: Buffer::new(w.ptr, DType::Byte, Shape::new(&[w.bytes])?)?,
            ..Default::default()
        })
    }

    pub fn call(&mut self, c: &GemmCall, stream: StreamHandle) -> Result<()> {
        self.call.current = None;
        // Argument checks first: no driver call (capture status, tuning) before them,
        // except that under NVTE_COMM_CHECK the ranks agree on the call (and on the
        // checks' verdict) before any collective step, so that a rank that called
        // differently cannot take another collective path than its peers.
        let checked = self.check_operands(c);
        if self.opts.check && self.nranks > 1 {
            let agreed = self.agree(c, stream, checked.is_err());
            checked?;
            agreed?;
        } else {
            checked?;
        }
        if let Some(key) = self.tune_key(c)? {
            // At most MAX_KEYS keys are tuned per context: a workload with ever new
            // shapes (varying token counts) must not keep tuning. The count is the same on
            // every rank (same calls in the same order).
            if !self.tuner.tuned.contains_key(&key)
                && self.tuner.tuned.len() < tune::MAX_KEYS
                && !capture_status(stream)?.active()
            {
                self.tune(c, stream, key)?;
            }
            self.call.current = self.tuner.tuned.get(&key).copied();
        }
        self.call_inner(c, stream)
    }

    /// NVTE_COMM_CHECK's host-side agreement of an eager call (see `agree`): every rank's
    /// record of the call (with this rank's verdict on its arguments, `failed`, and
    /// whether the call autotunes now) gathered through the bootstrap and compared. A
    /// captured call cannot wait for its peers on the host: the in-kernel check at the
    /// arrival barrier applies to it (and to every replay). Cost: one bootstrap exchange
    /// of a few bytes per eager call (over NCCL, tens of microseconds), only under the
    /// check.
    fn agree(&mut self, c: &GemmCall, stream: StreamHandle, failed: bool) -> Result<()> {
        // Not in an invalidated capture either: its peers (capturing) do not exchange, and
        // the call fails with the capture's error below without a collective step.
        if !capture_status(stream)?.none() {
            return Ok(());
        }
        self.call.agreed += 1;
        // (also when this rank's checks failed: its record then differs from its peers'
        // only by `failed`, so they report its failed checks, not another call)
        let tunes = self.tune_key(c)?.is_some_and(|k| {
            !self.tuner.tuned.contains_key(&k) && self.tuner.tuned.len() < tune::MAX_KEYS
        });
        let mode = match self.tuner.mode {
            tune::Mode::Off => 0,
            tune::Mode::On => 1,
            tune::Mode::Force => 2,
        };
        let rec = agree::Record::of(
            c,
            self.call.agreed,
            failed,
            self.call.preparing,
            (tunes, mode),
        );
        let all = self.bs.allgather(&rec.encode())?;
        agree::verdict(&all, self.rank)
    }

    /// The autotuner's key of this call, None when the call is not tuned.
    fn tune_key(&self, c: &GemmCall) -> Result<Option<tune::Key>> {
        if self.tuner.mode == tune::Mode::Off
            || !c.tune
            || self.nranks < 2
            || self.call.preparing
            || c.accumulate
            // block-scaled inputs run fixed block-aware algorithms whatever the candidate
            // (and their key would collide with per-tensor e4m3's): not tuned
            || call::is_block(c)
        {
            return Ok(None);
        }
        Ok(Some(tune::Key {
            op: c.kind,
            types: [c.a.data.dtype, c.b.data.dtype, c.d.data.dtype],
            trans: [c.transa, c.transb],
            dims: [c.m, c.n, c.k],
            tp: self.nranks,
            transport: crate::transport::choice_name(self.policy.transport.0),
            pins: tune::Key::pins_for(c.kind, &self.policy.pins),
            fast_accum: self.opts.fp8_fast_accum && c.a.data.dtype.is_fp8(),
        }))
    }

    /// Give engine `eng` the call's policy: the tuned one of its key (else the
    /// context's), with the fused algorithms where the call's algo asks for them
    /// (`GemmCall::atomic`) and the call's own comm_sm_count where it gives one. `c`'s
    /// global m, n, k become the engine's report key. Returns the policy.
    fn configure(&mut self, eng: EngineId, c: &GemmCall) -> Result<Policy> {
        let ch = self.call.current.unwrap_or(self.policy);
        let mut p = Policy {
            tp_size: self.nranks as i32,
            fused: match c.atomic {
                true => Some(ch.fused.unwrap_or(Tiles::Rule)),
                false => ch.fused,
            },
            ..ch
        };
        if c.comm_sm_count > 0 {
            p.comm.sms = c.comm_sm_count;
        }
        let e = &mut self.engines[eng.index()];
        e.set_policy(&p)?;
        e.set_report_dims(Some([c.m, c.n, c.k]));
        Ok(p)
    }

    /// Measure the candidates of `key` on this call's data (collectively: every rank
    /// runs the same candidates in the same order) and keep the fastest by the slowest
    /// rank; or take the disk cache's choice when every rank has the same one.
    fn tune(&mut self, c: &GemmCall, stream: StreamHandle, tkey: tune::Key) -> Result<()> {
        let key = tkey.to_string(); // the disk cache's key
        // Every decision below is taken from data gathered from all ranks (rank 0's
        // settings, the slowest rank's times, every rank's success), so all ranks run the
        // same candidates and pick the same one even when their environments differ.
        // The stream's context stays current for the whole tuning (the timing events are
        // made in it).
        let guard = ContextGuard::for_stream(stream)?;
        let agreed = self.tune_agree(&guard, &key)?;
        if let Some(ch) = agreed.cached {
            self.tuner.tuned.insert(tkey, ch);
            return Ok(());
        }
        let default = agreed.default;
        let (first, err) = self.tune_run(c, stream, &key, default)?;
        if let Some(e) = err {
            return Err(e);
        }
        if first.is_nan() {
            // Another rank failed: keep the defaults (its call reports the cause).
            self.tuner.tuned.insert(tkey, default);
            return Ok(());
        }
        let peer_memory = self
            .call
            .last_engine
            .is_none_or(|e| self.engines[e.index()].caps().peer_memory);
        // Where NVTE_COMM_RS_RING forces how rings sum, the accumulating candidates would
        // measure the same as others (and the key records the override).
        // Likewise the narrow candidates where NVTE_COMM_FUSED_TILES pins the width.
        let pins = &tkey.pins;
        let accumulating = pins.rs_ring.is_none() && pins.ag_pieces.is_none();
        let (accumulating, narrow) = (accumulating, pins.fused_tiles.is_none());
        let cands = tune::candidates(
            c.kind,
            self.nranks,
            peer_memory,
            default,
            agreed.sm_count,
            (accumulating, narrow),
        );
        // Rounds over the candidates (interleaved, so drift hits all alike); the budget
        // covers all of them.
        let n = tune::affordable(
            cands.len(),
            first as f64 * tune::ROUNDS as f64,
            agreed.budget_ms,
        );
        let (times, err) = self.tune_rounds(c, stream, &key, &cands[..n], first)?;
        if let Some(e) = err {
            // This rank failed (its peers see NaN and stop too): the defaults.
            self.tuner.tuned.insert(tkey, default);
            return Err(e);
        }
        let medians = tune::medians(&times);
        let mut best = tune::pick_with_margin(&medians, tune::MARGIN);
        if let Some(p) = agreed.pick {
            best = p as usize % n; // tests: run a given candidate (every rank the same)
        }
        let ch = cands[best];
        self.tuner.tuned.insert(tkey, ch);
        if agreed.pick.is_none() && !medians.iter().any(|t| t.is_nan()) {
            self.tuner.cache.put(&key, &ch); // a forced pick is not the fastest: not cached
        }
        if self.tuner.env.verbose && self.rank == 0 {
            let worst: Vec<String> = medians.iter().map(|w| format!("{w:.3}")).collect();
            eprintln!(
                "[te_comm tune] {key}: {} of {} candidates, median of {} rounds of the slowest rank's ms [{}], chose #{best} {}",
                n,
                cands.len(),
                tune::ROUNDS,
                worst.join(", "),
                ch.summary()
            );
        }
        Ok(())
    }

    /// The tuning settings every rank agrees on for `key` (rank 0's): the disk cache's
    /// choice when every rank has the same one, the defaults, the SM count, the budget.
    fn tune_agree(&mut self, guard: &ContextGuard, key: &str) -> Result<tune::Agreed> {
        let dev = crate::cuda::device_info(guard.device)?;
        self.tuner
            .cache
            .load(|| tune::fingerprint(&crate::cuda::device_name(guard.device)?, dev.sm_count))?;
        if self.tuner.mode == tune::Mode::Force {
            self.tuner.cache.forget(key);
        }
        let cached = self.tuner.cache.get(key).unwrap_or([0; 8]);
        let settings = tune::Settings {
            cached,
            default: self.policy,
            sm_count: dev.sm_count,
            budget_ms: self.tuner.env.budget_ms,
            pick: self.tuner.env.pick,
        };
        let all = self.bs.allgather(&settings.encode())?;
        tune::Settings::agree(&all, &self.policy)
    }

    /// One candidate on every rank, then its slowest-rank time (NaN: some rank failed)
    /// and this rank's error, if it failed.
    fn tune_run(
        &mut self,
        c: &GemmCall,
        stream: StreamHandle,
        key: &str,
        ch: Policy,
    ) -> Result<(f32, Option<Error>)> {
        self.call.current = Some(ch);
        let timeout_ms = self.policy.timeout_ms;
        let timed = crate::cuda::resources::mean_time(
            self,
            stream,
            timeout_ms,
            &format!("autotuning {key}: a candidate's calls"),
            3,
            |t| t.call_inner(c, stream),
        );
        let (t, err) = match timed {
            Ok(t) => (t, None),
            Err(e) => (f32::NAN, Some(e)),
        };
        let all = self.bs.allgather(&t.to_le_bytes())?;
        Ok((tune::slowest(&all), err))
    }

    /// `tune::ROUNDS` interleaved rounds over `cands` (the first's first time is
    /// `first`): each candidate's slowest-rank times. Stops early (NaN) when another rank
    /// failed, and with this rank's error when it failed.
    fn tune_rounds(
        &mut self,
        c: &GemmCall,
        stream: StreamHandle,
        key: &str,
        cands: &[Policy],
        first: f32,
    ) -> Result<(Vec<Vec<f32>>, Option<Error>)> {
        let mut times: Vec<Vec<f32>> = vec![vec![first]];
        times.resize(cands.len(), Vec::new());
        for round in 0..tune::ROUNDS {
            for (i, ch) in cands.iter().enumerate() {
                if round == 0 && i == 0 {
                    continue; // measured above
                }
                let (t, err) = self.tune_run(c, stream, key, *ch)?;
                if err.is_some() {
                    return Ok((times, err));
                }
                times[i].push(t);
                if t.is_nan() {
                    return Ok((times, None)); // another rank failed: stop here, as it does
                }
            }
        }
        Ok((times, None))
    }

    /// The all-gather's `b_gathered` (if any): [n, k] of B's dtype, transb = false.
    fn check_b_gathered(c: &GemmCall, n: usize, k: usize, dt: DType) -> Result<()> {
        if let Some(g) = c.b_gathered {
            if c.transb {
                unsupported!(
                    "b_gathered needs transb = false (B stored [n, k], gathered along its rows)"
                );
            }
            expect_shape(g, "b_gathered", [n, k], "all of B, gathered")?;
            if g.data.dtype != dt {
                invalid!(
                    "tensor `b_gathered` has dtype {} but B has {}",
                    g.data.dtype.name(),
                    dt.name()
                );
            }
            if let Some(mode) = c.b.block_mode() {
                crate::gemm::block::check_gathered_scales(g, "b_gathered", mode, n, k)?;
            }
        }
        Ok(())
    }

    /// The checks of a call's arguments that need no device: sizes, element types and the
    /// operands' shapes for this rank's shares. Run first, before any driver or library
    /// call (also before tuning), so a bad argument is reported as such on any machine.
    fn check_operands(&self, c: &GemmCall) -> Result<()> {
        for (v, name) in [(c.m, "m"), (c.n, "n"), (c.k, "k")] {
            if v < 0 {
                invalid!("{name} = {v} must be >= 0");
            }
        }
        // Sub-byte element types (fp4) have no byte size for the slicing of the calls.
        for (t, name) in [(Some(c.a), "a"), (Some(c.b), "b"), (Some(c.d), "d")]
            .into_iter()
            .chain([(c.bias, "bias"), (c.pre_act_out, "pre_act_out")])
        {
            if let Some(t) = t
                && t.data.dtype.bits() < 8
            {
                crate::unsupported!(
                    "argument `{name}` has dtype {}: the comm-GEMM calls take 8-, 16- and 32-bit elements",
                    t.data.dtype.name()
                );
            }
        }
        if c.comm_sm_count < 0 {
            invalid!(
                "comm_sm_count = {} must be >= 0 (0: the default)",
                c.comm_sm_count
            );
        }
        self.check_block(c)?;
        let (m, n, k) = (c.m as usize, c.n as usize, c.k as usize);
        let share = |g: usize| numroc(g as i64, self.nranks, self.rank) as usize;
        match c.kind {
            Kind::AllGather => {
                let (ml, nl) = (share(m), share(n));
                expect_shape(
                    c.a,
                    "a",
                    if c.transa { [ml, k] } else { [k, ml] },
                    "m is split: this rank's share is numroc(m)",
                )?;
                expect_shape(
                    c.b,
                    "b",
                    if c.transb { [k, nl] } else { [nl, k] },
                    "n is split: this rank's share is numroc(n)",
                )?;
                expect_shape(c.d, "d", [n, ml], "D = this rank's m-share x all of n")?;
                Self::check_b_gathered(c, n, k, c.b.data.dtype)?;
                if let Some(b) = c.bias
                    && b.data.numel() != ml
                {
                    invalid!(
                        "tensor `bias` has {} elements but must have numroc(m) = {ml}",
                        b.data.numel()
                    );
                }
            }
            Kind::ReduceScatter | Kind::AllReduce => {
                if c.b_gathered.is_some() {
                    invalid!(
                        "b_gathered is an all-gather output: {} gathers nothing",
                        c.kind.api_name()
                    );
                }
                let kl = share(k);
                expect_shape(
                    c.a,
                    "a",
                    if c.transa { [m, kl] } else { [kl, m] },
                    "k is split: this rank's share is numroc(k)",
                )?;
                expect_shape(
                    c.b,
                    "b",
                    if c.transb { [kl, n] } else { [n, kl] },
                    "k is split: this rank's share is numroc(k)",
                )?;
                let (dshape, why) = if c.kind == Kind::AllReduce {
                    ([n, m], "every rank gets all of D")
                } else {
                    ([share(n), m], "D is scattered along n")
                };
                expect_shape(c.d, "d", dshape, why)?;
            }
        }
        self.check_block_operands(c)
    }

    /// Block-scaled FP8 inputs: what this context takes ([`call::check_block`]).
    fn check_block(&self, c: &GemmCall) -> Result<()> {
        call::check_block(c, self.nranks, self.opts.direct)
    }

    /// Block-scaled FP8 inputs: the GEMM this rank runs, checked with no device call
    /// ([`call::check_block_operands`]).
    fn check_block_operands(&self, c: &GemmCall) -> Result<()> {
        call::check_block_operands(c, (self.nranks, self.rank), self.opts.direct)
    }

    fn call_inner(&mut self, c: &GemmCall, stream: StreamHandle) -> Result<()> {
        self.check_operands(c)?;
        // The stream's context stays current for the whole call (engines are created in it).
        let guard = ContextGuard::for_stream_no_device(stream)?;
        let capture = capture_status(stream)?;
        if capture == Capture::Invalidated {
            return Err(Error::new(
                crate::error::ErrorKind::Cuda,
                "argument `main_stream` is in a CUDA graph capture that was invalidated by an earlier illegal operation: end that capture (cudaStreamEndCapture) and capture again",
            ));
        }
        self.call.capturing = capture.active();
        if !self.opts.direct {
            // (a direct call leaves no buffer a graph could hold)
            self.call.captured |= self.call.capturing;
        }
        let ws = if self.mem.workspace.is_none() && self.nranks > 1 && !self.call.capturing {
            // The context's first call, before its first engine's creation (collective): a
            // rank that cannot allocate the workspace fails with its peers instead of
            // leaving them in that creation's exchanges. After a failure no rank keeps its
            // workspace, so that the next call agrees again on every rank alike.
            let made = self.workspace();
            let what = "allocate their comm-GEMM context's cuBLASLt workspace";
            match self.bs.agree(made, what) {
                Ok(ws) => ws,
                Err(e) => {
                    self.mem.workspace = None;
                    return Err(e);
                }
            }
        } else {
            self.workspace()?
        };
        // The algorithm choice: the atomic values make the all-gather the fused one
        // (`GemmCall::atomic`, applied in `configure`), everything else runs the split
        // (P2P) algorithms; multicast is never used by this library. Default lets the
        // autotuner choose the configuration (`tune`), the fused all-gather among its
        // candidates.
        call::run(
            &mut GpuCall {
                ctx: self,
                guard: &guard,
                stream,
            },
            c,
            &ws,
        )
    }
}

/// A call of the context on the GPU: its engines, on the caller's stream.
struct GpuCall<'a> {
    ctx: &'a mut CommGemmCtx,
    guard: &'a ContextGuard,
    stream: StreamHandle,
}

impl call::CallBackend for GpuCall<'_> {
    fn ranks(&self) -> (usize, usize) {
        (self.ctx.nranks, self.ctx.rank)
    }
    fn direct(&self) -> bool {
        self.ctx.opts.direct
    }
    fn fast_accum(&self) -> bool {
        self.ctx.opts.fp8_fast_accum
    }
    fn preparing(&self) -> bool {
        self.ctx.call.preparing
    }
    fn direct_call(
        &mut self,
        c: &GemmCall,
        dtype: DType,
        bytes: usize,
        g: &TeGemm,
        copies: &[(DevPtr, DevPtr, usize)],
    ) -> Result<()> {
        self.ctx
            .direct_call(c, dtype, bytes, g, copies, self.guard, self.stream)
    }
    fn engine(&mut self, kind: Kind, dtype: DType, bytes: usize) -> Result<EngineId> {
        self.ctx.engine(kind, dtype, bytes)
    }
    fn configure(&mut self, eng: EngineId, c: &GemmCall) -> Result<bool> {
        Ok(self.ctx.configure(eng, c)?.rs_ring())
    }
    fn scratch(&mut self, slot: usize, bytes: usize) -> Result<DevPtr> {
        self.ctx.scratch(slot, bytes)
    }
    fn memset(&mut self, dst: DevPtr, bytes: usize) -> Result<()> {
        // SAFETY: the call's steps (`comm_gemm/call.rs`) clear ranges of the context's
        // scratch buffers and the call's checked output.
        unsafe { memset_async(dst, bytes, self.stream) }
    }
    fn copy(&mut self, dst: DevPtr, src: DevPtr, bytes: usize) -> Result<()> {
        // SAFETY: as `memset`: ranges of scratch buffers and the call's checked tensors.
        unsafe { copy_async(dst, src, bytes, self.stream) }
    }
    fn copy_2d(
        &mut self,
        dst: DevPtr,
        dpitch: usize,
        src: DevPtr,
        spitch: usize,
        width: usize,
        height: usize,
    ) -> Result<()> {
        // SAFETY: as `memset`: pitched ranges of scratch buffers and checked tensors.
        unsafe { copy_2d(dst, dpitch, src, spitch, width, height, self.stream) }
    }
    fn split_ag(&mut self, eng: EngineId, x: &AgArgs) -> Result<()> {
        self.ctx.engines[eng.index()].split_ag(x, self.stream)
    }
    fn split_rs(&mut self, eng: EngineId, x: &RsArgs, ring: bool) -> Result<()> {
        if ring {
            self.ctx.engines[eng.index()].split_rs_p2p(x, self.stream)
        } else {
            self.ctx.engines[eng.index()].split_rs(x, self.stream)
        }
    }
    fn split_ar(&mut self, eng: EngineId, x: &ArArgs) -> Result<()> {
        self.ctx.engines[eng.index()].split_ar(x, self.stream)
    }
}

#[cfg(test)]
mod tests {
    use super::numroc;

    #[test]
    fn numroc_is_block_distribution() {
        // block = ceil(global / nranks); the last ranks may get fewer, possibly none.
        assert_eq!(
            (0..4).map(|r| numroc(256, 4, r)).collect::<Vec<_>>(),
            vec![64, 64, 64, 64]
        );
        assert_eq!(
            (0..4).map(|r| numroc(250, 4, r)).collect::<Vec<_>>(),
            vec![63, 63, 63, 61]
        );
        assert_eq!(
            (0..4).map(|r| numroc(3, 4, r)).collect::<Vec<_>>(),
            vec![1, 1, 1, 0]
        );
        assert_eq!(
            (0..4).map(|r| numroc(5, 4, r)).collect::<Vec<_>>(),
            vec![2, 2, 1, 0]
        );
        assert_eq!(numroc(0, 4, 0), 0);
        for (g, n) in [(1000i64, 3usize), (7, 8), (1, 1), (129, 16)] {
            assert_eq!(
                (0..n).map(|r| numroc(g, n, r)).sum::<i64>(),
                g,
                "shares of {g} over {n} ranks add up"
            );
        }
    }
}
