//! TE's comm_gemm.h (the cuBLASMp backend's API), with C linkage and TE's declarations.
//! These functions are void in TE: errors are recorded for nvte_comm_last_error();
//! nvte_comm_gemm_ctx_create returns NULL on failure with the reason recorded.
use super::enums::NVTECommGemmAlgoType;
use super::enums::NVTECommStatus;
use super::handles::CONTEXTS;
use super::overlap::{NVTECommBootstrap, ncclComm_t};
use super::{NVTETensor, cudaStream_t};
use crate::comm_gemm::{CommGemmCtx, GemmCall, Kind};
use crate::error::Result;
use crate::invalid;
use crate::tensor;
use std::sync::{Arc, Mutex};

/// Opaque context (TE: `typedef struct NVTECommGemmCtx NVTECommGemmCtx;`).
pub struct NVTECommGemmCtx {
    _private: (),
}

pub(super) fn ctx(h: *mut NVTECommGemmCtx) -> Result<Arc<Mutex<CommGemmCtx>>> {
    CONTEXTS.get(h as usize, "ctx")
}

/// A context over the NCCL communicator `comm` of the tensor-parallel group (not owned;
/// `nranks` and `rank` must match it). Collective. NULL on failure (reason recorded).
#[unsafe(no_mangle)]
pub extern "C" fn nvte_comm_gemm_ctx_create(
    comm: ncclComm_t,
    nranks: i32,
    rank: i32,
) -> *mut NVTECommGemmCtx {
    entry!(or std::ptr::null_mut(), {
        let c = CommGemmCtx::create(crate::cuda::NcclComm::from_c(comm), nranks, rank)?;
        Ok(CONTEXTS.insert(Arc::new(Mutex::new(c))) as *mut NVTECommGemmCtx)
    })
}

/// A context whose setup exchanges go through `bootstrap`: its NCCL communicator when set
/// (not owned; the group is that communicator's), else its allgather/barrier callbacks
/// with `world_rank` / `world_size` (no NCCL needed with the IPC transport; the callbacks
/// and `user_data` must stay valid until the context is destroyed, as the first call of
/// each operation, or `nvte_comm_xla_*`'s initialize stage, exchanges through them).
/// `*out` is NULL on failure. Collective over an NCCL communicator of more than one rank
/// (every rank must call it: the context makes its own exchange communicator, whose
/// unique id goes through that communicator); not collective with the callbacks.
#[unsafe(no_mangle)]
pub extern "C" fn nvte_comm_gemm_ctx_create_bootstrap(
    bootstrap: *const NVTECommBootstrap,
    out: *mut *mut NVTECommGemmCtx,
) -> NVTECommStatus {
    entry!(status, {
        let b = super::overlap::take_bootstrap(bootstrap, out)?;
        let c = CommGemmCtx::from_bootstrap(super::overlap::bootstrap_of(&b)?)?;
        let id = CONTEXTS.insert(Arc::new(Mutex::new(c)));
        // SAFETY: non-null output pointer.
        unsafe { *out = id as *mut NVTECommGemmCtx };
        Ok(())
    })
}

/// Destroy a context (waits, bounded, until the peers are done with its buffers). NULL is a no-op.
/// May run on any thread while another thread captures a CUDA graph (global mode too: a
/// garbage collector's finalizer): the capture stays valid, except for an NCCL-transport
/// engine's teardown (NCCL frees memory on its own threads; see the README's CUDA
/// graphs). Refused (an error recorded, the context kept) while a capture holding calls of
/// one of its engines is still open. Destroy the graphs that hold its calls first (with
/// the NCCL transport NCCL's teardown waits for them).
#[unsafe(no_mangle)]
pub extern "C" fn nvte_comm_gemm_ctx_destroy(ctx: *mut NVTECommGemmCtx) {
    entry!(void, {
        if ctx.is_null() {
            return Ok(());
        }
        CONTEXTS.destroy(
            ctx as usize,
            "ctx",
            CommGemmCtx::in_open_capture,
            "a CUDA graph capture that contains calls of this context is still open: its memory is in use; end the capture (cudaStreamEndCapture) and destroy that graph first",
        )
    })
}

/// This rank's share of `global_size` under block distribution (block ceil(global / nranks));
/// the last ranks may get fewer, possibly 0. Returns 0 with an error recorded on bad input.
#[unsafe(no_mangle)]
pub extern "C" fn nvte_comm_gemm_numroc(ctx: *mut NVTECommGemmCtx, global_size: i64) -> i64 {
    entry!(or 0, {
        let c = self::ctx(ctx)?;
        let g = c.lock().unwrap_or_else(|e| e.into_inner());
        g.numroc(global_size)
    })
}

/// Every declared algorithm is accepted (see `crate::comm_gemm`: the atomic ones select
/// the fused all-gather); undeclared values are an error.
fn check_algo(a: NVTECommGemmAlgoType) -> Result<()> {
    if a.name().is_none() {
        invalid!("argument `algo` = {a} is not a valid NVTECommGemmAlgoType");
    }
    Ok(())
}

/// The body of the three comm-GEMM entry points (their parameters, and the `kind` each
/// one is).
#[allow(clippy::too_many_arguments)]
fn call(
    kind: Kind,
    ctx: *mut NVTECommGemmCtx,
    m: i64,
    n: i64,
    k: i64,
    a: NVTETensor,
    b: NVTETensor,
    d: NVTETensor,
    bias: NVTETensor,
    pre_act_out: NVTETensor,
    transa: bool,
    transb: bool,
    grad: bool,
    accumulate: bool,
    comm_sm_count: i32,
    main_stream: cudaStream_t,
    algo_type: NVTECommGemmAlgoType,
) -> Result<()> {
    let c = self::ctx(ctx)?;
    check_algo(algo_type)?;
    let (ta, tb, td) = (
        super::handles::TENSORS.get(a as usize, "a")?,
        super::handles::TENSORS.get(b as usize, "b")?,
        super::handles::TENSORS.get(d as usize, "d")?,
    );
    // Empty tensors (no data) mean "none", as in TE.
    let some = |t: Option<tensor::Tensor>| t.filter(|t| !t.data.ptr.is_null());
    let tbias = some(super::handles::TENSORS.get_opt(bias as usize, "bias")?);
    let tpre = some(super::handles::TENSORS.get_opt(pre_act_out as usize, "pre_act_out")?);
    let call = GemmCall {
        kind,
        m,
        n,
        k,
        a: &ta,
        b: &tb,
        d: &td,
        bias: tbias.as_ref(),
        pre_act_out: tpre.as_ref(),
        transa,
        transb,
        grad,
        accumulate,
        comm_sm_count,
        b_gathered: None,
        tune: algo_type == NVTECommGemmAlgoType::kNVTECommGemmAlgoDefault,
        atomic: algo_type.is_atomic(),
    };
    let mut g = c.lock().unwrap_or_else(|e| e.into_inner());
    g.call(&call, crate::ffi::stream_of(main_stream))
}

/// All-gather GEMM: A's m and B's n split across ranks; B gathered along n; this rank gets
/// D = its m-share x all of n (local D is [n, numroc(m)]). D = A·B (+ bias; GELU with
/// pre_act_out storing the pre-activation when both are set).
#[unsafe(no_mangle)]
pub extern "C" fn nvte_all_gather_gemm(
    ctx: *mut NVTECommGemmCtx,
    m: i64,
    n: i64,
    k: i64,
    a: NVTETensor,
    b: NVTETensor,
    d: NVTETensor,
    bias: NVTETensor,
    pre_act_out: NVTETensor,
    transa: bool,
    transb: bool,
    grad: bool,
    accumulate: bool,
    comm_sm_count: i32,
    main_stream: cudaStream_t,
    algo: NVTECommGemmAlgoType,
) {
    entry!(void, {
        call(
            Kind::AllGather,
            ctx,
            m,
            n,
            k,
            a,
            b,
            d,
            bias,
            pre_act_out,
            transa,
            transb,
            grad,
            accumulate,
            comm_sm_count,
            main_stream,
            algo,
        )
    })
}

// Written out like nvte_all_gather_gemm, not generated: cbindgen makes the header from
// these declarations (see ffi/overlap.rs); the body is the one helper `call`.
/// GEMM reduce-scatter: k split; D summed over ranks and scattered along n (local D is
/// [numroc(n), m]); the bias is added once.
#[unsafe(no_mangle)]
pub extern "C" fn nvte_gemm_reduce_scatter(
    ctx: *mut NVTECommGemmCtx,
    m: i64,
    n: i64,
    k: i64,
    a: NVTETensor,
    b: NVTETensor,
    d: NVTETensor,
    bias: NVTETensor,
    pre_act_out: NVTETensor,
    transa: bool,
    transb: bool,
    grad: bool,
    accumulate: bool,
    comm_sm_count: i32,
    main_stream: cudaStream_t,
    algo: NVTECommGemmAlgoType,
) {
    entry!(void, {
        call(
            Kind::ReduceScatter,
            ctx,
            m,
            n,
            k,
            a,
            b,
            d,
            bias,
            pre_act_out,
            transa,
            transb,
            grad,
            accumulate,
            comm_sm_count,
            main_stream,
            algo,
        )
    })
}

/// GEMM all-reduce: k split; every rank gets the whole reduced D [n, m]; the bias is
/// added once. Chunked GEMM, each chunk all-reduced while the next computes.
#[unsafe(no_mangle)]
pub extern "C" fn nvte_gemm_all_reduce(
    ctx: *mut NVTECommGemmCtx,
    m: i64,
    n: i64,
    k: i64,
    a: NVTETensor,
    b: NVTETensor,
    d: NVTETensor,
    bias: NVTETensor,
    pre_act_out: NVTETensor,
    transa: bool,
    transb: bool,
    grad: bool,
    accumulate: bool,
    comm_sm_count: i32,
    main_stream: cudaStream_t,
    algo: NVTECommGemmAlgoType,
) {
    entry!(void, {
        call(
            Kind::AllReduce,
            ctx,
            m,
            n,
            k,
            a,
            b,
            d,
            bias,
            pre_act_out,
            transa,
            transb,
            grad,
            accumulate,
            comm_sm_count,
            main_stream,
            algo,
        )
    })
}
