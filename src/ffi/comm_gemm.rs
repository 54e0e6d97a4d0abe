//! TE's comm_gemm.h (the cuBLASMp backend's API), with C linkage and TE's declarations.
//! These functions are void in TE: errors are recorded for nvte_comm_last_error();
//! nvte_comm_gemm_ctx_create returns NULL on failure with the reason recorded.
use super::enums::NVTECommGemmAlgoType;
use super::enums::NVTECommStatus;
use super::handles::CONTEXTS;
use super::overlap::{NVTECommBootstrap, ncclComm_t};
use super::{NVTETensor, cudaStream_t};
use crate::comm_gemm::{CommGemmCtx, GemmCall, Kind};
use crate::cuda::StreamHandle;
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

/// One comm-GEMM call in the core's terms, as each entry point converts its own arguments
/// into it: the C functions (`nvte_all_gather_gemm`, ...: tensor handles), the packed
/// call (`nvte_comm_gemm_call_packed`: pointers, dtypes and shapes) and the XLA handlers
/// (`ffi/xla.rs`: a call frame). Each converts its context argument first (NULL and
/// destroyed contexts are the error before any other argument's: [`ctx`]), then the
/// others. [`run`] is the one path all three then take: the same checks in the same
/// order, the same errors and messages, the same core call.
pub(super) struct Request {
    pub kind: Kind,
    /// the live context (the entry's context argument, looked up with [`ctx`])
    pub ctx: Arc<Mutex<CommGemmCtx>>,
    pub m: i64,
    pub n: i64,
    pub k: i64,
    pub a: tensor::Tensor,
    pub b: tensor::Tensor,
    pub d: tensor::Tensor,
    pub bias: Option<tensor::Tensor>,
    pub pre_act_out: Option<tensor::Tensor>,
    /// all-gather only (the XLA handlers' `gather_b` result)
    pub b_gathered: Option<tensor::Tensor>,
    pub transa: bool,
    pub transb: bool,
    pub grad: bool,
    pub accumulate: bool,
    pub comm_sm_count: i32,
    pub algo: NVTECommGemmAlgoType,
    /// how the entry names its algorithm argument in messages ("argument `algo`",
    /// "argument `args->algo`", "attribute `algo`")
    pub algo_arg: &'static str,
    pub stream: StreamHandle,
    /// make the engines and buffers the call needs and enqueue nothing (XLA's initialize
    /// stage: `CommGemmCtx::prepare`) instead of the call
    pub prepare: bool,
}

/// The shared path of every comm-GEMM entry point: the algorithm (every declared one is
/// accepted: see `crate::comm_gemm`; the atomic ones select the fused all-gather), then
/// the core call, which checks the rest.
pub(super) fn run(r: &Request) -> Result<()> {
    if r.algo.name().is_none() {
        invalid!(
            "{} = {} is not a valid NVTECommGemmAlgoType",
            r.algo_arg,
            r.algo
        );
    }
    let call = GemmCall {
        kind: r.kind,
        m: r.m,
        n: r.n,
        k: r.k,
        a: &r.a,
        b: &r.b,
        d: &r.d,
        bias: r.bias.as_ref(),
        pre_act_out: r.pre_act_out.as_ref(),
        transa: r.transa,
        transb: r.transb,
        grad: r.grad,
        accumulate: r.accumulate,
        comm_sm_count: r.comm_sm_count,
        b_gathered: r.b_gathered.as_ref(),
        tune: r.algo == NVTECommGemmAlgoType::kNVTECommGemmAlgoDefault,
        atomic: r.algo.is_atomic(),
    };
    let mut g = r.ctx.lock().unwrap_or_else(|e| e.into_inner());
    if r.prepare {
        g.prepare(&call, r.stream)
    } else {
        g.call(&call, r.stream)
    }
}

/// The body of the three C functions: their arguments as a [`Request`] (the context, then
/// the tensor handles looked up; an empty tensor, without data, means "none" as in TE),
/// then [`run`].
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
    let ctx = self::ctx(ctx)?;
    let t = &super::handles::TENSORS;
    let some = |x: Option<tensor::Tensor>| x.filter(|x| !x.data.ptr.is_null());
    run(&Request {
        kind,
        ctx,
        m,
        n,
        k,
        a: t.get(a as usize, "a")?,
        b: t.get(b as usize, "b")?,
        d: t.get(d as usize, "d")?,
        bias: some(t.get_opt(bias as usize, "bias")?),
        pre_act_out: some(t.get_opt(pre_act_out as usize, "pre_act_out")?),
        b_gathered: None,
        transa,
        transb,
        grad,
        accumulate,
        comm_sm_count,
        algo: algo_type,
        algo_arg: "argument `algo`",
        stream: crate::ffi::stream_of(main_stream),
        prepare: false,
    })
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

#[cfg(test)]
mod tests {
    use super::super::packed::{
        NVTE_COMM_GEMM_PACKED_ALL_GATHER, NVTECommGemmOperand, NVTECommGemmPacked,
        nvte_comm_gemm_call_packed,
    };
    use super::*;
    use crate::cuda::DevPtr;
    use crate::ffi::enums::NVTEDType;
    use crate::tensor::{Buffer, DType, Shape, Tensor};
    use std::ffi::c_void;

    unsafe extern "C" fn gather_self(
        _user: *mut c_void,
        global: *mut c_void,
        global_bytes: usize,
        local: *const c_void,
        local_bytes: usize,
    ) -> i32 {
        assert_eq!(global_bytes, local_bytes);
        // SAFETY: the bootstrap passes buffers of the stated sizes.
        unsafe {
            std::ptr::copy_nonoverlapping(local as *const u8, global as *mut u8, local_bytes)
        };
        0
    }
    unsafe extern "C" fn no_barrier(_user: *mut c_void) -> i32 {
        0
    }

    /// A one-rank context over callbacks (no GPU needed to make it).
    fn one_rank_ctx() -> *mut NVTECommGemmCtx {
        let b = NVTECommBootstrap {
            world_rank: 0,
            world_size: 1,
            nccl_comm: std::ptr::null_mut(),
            allgather: Some(gather_self),
            barrier: Some(no_barrier),
            user_data: std::ptr::null_mut(),
        };
        let mut out = std::ptr::null_mut();
        let st = nvte_comm_gemm_ctx_create_bootstrap(&b, &mut out);
        assert_eq!(st, NVTECommStatus::NVTE_COMM_SUCCESS, "{}", last_error());
        out
    }

    fn last_error() -> String {
        // SAFETY: a NUL-terminated string valid until this thread's next library call.
        unsafe { std::ffi::CStr::from_ptr(super::super::errors::nvte_comm_last_error()) }
            .to_string_lossy()
            .into_owned()
    }

    /// The message without the entry point's name ("nvte_x: message").
    fn body(msg: &str) -> String {
        msg.split_once(": ").map_or(msg, |m| m.1).to_string()
    }

    fn bf16(addr: u64, dims: &[usize]) -> Tensor {
        Tensor {
            data: Buffer::new(DevPtr::new(addr), DType::BF16, Shape::new(dims).unwrap()).unwrap(),
            ..Default::default()
        }
    }

    fn operand(addr: usize, dims: [usize; 2]) -> NVTECommGemmOperand {
        NVTECommGemmOperand {
            data: addr as *mut c_void,
            dtype: NVTEDType::kNVTEBFloat16,
            ndim: 2,
            shape: dims,
            scale_inv: std::ptr::null_mut(),
            scale: std::ptr::null_mut(),
            amax: std::ptr::null_mut(),
        }
    }

    /// The error of the same call through each entry: the C function (tensor handles),
    /// the packed call and the request the XLA handlers make (their frame decoded).
    fn errors_of(ctx: *mut NVTECommGemmCtx, m: i64, algo: u32) -> [String; 3] {
        let (a, b, d) = ([16, 64], [32, 64], [32, 16]);
        let t = &crate::ffi::handles::TENSORS;
        let h: Vec<NVTETensor> = [(0x1000, a), (0x2000, b), (0x3000, d)]
            .iter()
            .map(|&(p, s)| t.insert(bf16(p, &s)) as NVTETensor)
            .collect();
        let algo = NVTECommGemmAlgoType(algo);
        nvte_all_gather_gemm(
            ctx,
            m,
            32,
            64,
            h[0],
            h[1],
            h[2],
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            true,
            false,
            false,
            false,
            0,
            std::ptr::null_mut(),
            algo,
        );
        let c = last_error();
        let none = operand(0, [0, 0]);
        let p = NVTECommGemmPacked {
            op: NVTE_COMM_GEMM_PACKED_ALL_GATHER,
            comm_sm_count: 0,
            m,
            n: 32,
            k: 64,
            a: operand(0x1000, a),
            b: operand(0x2000, b),
            d: operand(0x3000, d),
            bias: NVTECommGemmOperand { ndim: 0, ..none },
            pre_act_out: NVTECommGemmOperand { ndim: 0, ..none },
            transa: true,
            transb: false,
            grad: false,
            accumulate: false,
            algo,
            stream: std::ptr::null_mut(),
        };
        assert_ne!(
            nvte_comm_gemm_call_packed(ctx, &p),
            NVTECommStatus::NVTE_COMM_SUCCESS
        );
        let packed = last_error();
        // The XLA handlers' order: the bound context, then the frame's operands.
        let xla = super::ctx(ctx)
            .and_then(|ctx| {
                run(&Request {
                    kind: Kind::AllGather,
                    ctx,
                    m,
                    n: 32,
                    k: 64,
                    a: bf16(0x1000, &a),
                    b: bf16(0x2000, &b),
                    d: bf16(0x3000, &d),
                    bias: None,
                    pre_act_out: None,
                    b_gathered: None,
                    transa: true,
                    transb: false,
                    grad: false,
                    accumulate: false,
                    comm_sm_count: 0,
                    algo,
                    algo_arg: "attribute `algo`",
                    stream: StreamHandle::NULL,
                    prepare: false,
                })
            })
            .unwrap_err()
            .msg;
        for x in h {
            t.remove(x as usize, "tensor").unwrap();
        }
        [c, packed, xla]
    }

    fn algo9() -> NVTECommGemmAlgoType {
        NVTECommGemmAlgoType(9)
    }

    #[test]
    fn the_three_entries_take_one_path_with_the_same_checks_and_messages() {
        let ctx = one_rank_ctx();
        // A core check (before any driver call): the same message from all three.
        let [c, packed, xla] = errors_of(ctx, -1, 0);
        assert!(
            c.starts_with("nvte_all_gather_gemm: ") && c.contains("m = -1"),
            "{c}"
        );
        assert!(
            packed.starts_with("nvte_comm_gemm_call_packed: "),
            "{packed}"
        );
        assert_eq!(body(&c), body(&packed));
        assert_eq!(body(&c), xla);
        // An undeclared algorithm: the same check, each naming its own argument.
        let [c, packed, xla] = errors_of(ctx, 16, 9);
        let tail = " = NVTECommGemmAlgoType(9) is not a valid NVTECommGemmAlgoType";
        assert_eq!(body(&c), format!("argument `algo`{tail}"));
        assert_eq!(body(&packed), format!("argument `args->algo`{tail}"));
        assert_eq!(xla, format!("attribute `algo`{tail}"));
        // A destroyed context comes first, before the algorithm.
        nvte_comm_gemm_ctx_destroy(ctx);
        let [c, packed, xla] = errors_of(ctx, 16, 9);
        assert!(c.contains("not a live context"), "{c}");
        assert_eq!(body(&c), body(&packed));
        assert_eq!(body(&c), xla);
        // ... and before every other argument: tensors that are no live ones either.
        let bogus = 0x1234 as NVTETensor;
        let null = std::ptr::null_mut();
        let t = true;
        nvte_gemm_all_reduce(
            ctx,
            -1,
            8,
            8,
            bogus,
            bogus,
            bogus,
            null,
            null,
            t,
            t,
            t,
            t,
            -1,
            null,
            algo9(),
        );
        assert!(last_error().contains("`ctx`"), "{}", last_error());
    }
}
