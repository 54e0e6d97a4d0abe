//! The userbuffers-style engine: `nvte_comm_overlap_*`.
use super::config::Config;
use super::enums::{NVTECommOverlapType, NVTEDType};
use super::gemm::{GemmExtras, TeFlags};
use super::handles::OVERLAPS;
use super::{NVTECommStatus, NVTETensor, cudaStream_t};
use crate::bootstrap::{AllgatherFn, BarrierFn, Bootstrap};
use crate::error::Result;
use crate::invalid;
use crate::overlap::{
    Overlap, Pins, Policy, ag::AgArgs, bulk::BulkArgs, bulk::BulkKind, rs::RsArgs,
};
use crate::tensor::{DType, Tensor};
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

/// NCCL communicator handle as the header declares it (`struct ncclComm *`).
#[allow(non_camel_case_types)]
pub type ncclComm_t = *mut c_void;

/// Gather `local_bytes` from every rank into `global` (rank order); return 0 on success.
pub type NVTECommAllgatherFn = Option<
    unsafe extern "C" fn(
        user_data: *mut c_void,
        global: *mut c_void,
        global_bytes: usize,
        local: *const c_void,
        local_bytes: usize,
    ) -> i32,
>;
/// Block until every rank has arrived; return 0 on success.
pub type NVTECommBarrierFn = Option<unsafe extern "C" fn(user_data: *mut c_void) -> i32>;

/// How the ranks exchange setup data: through `nccl_comm` when it is not NULL (rank and
/// size are then taken from it), else through the callbacks (TE's ExtAllgatherOp /
/// ExtBarrierOp analog) with `world_rank` / `world_size`.
///
/// The library bounds its own exchanges (NVTE_COMM_TIMEOUT_MS) but cannot interrupt a
/// callback: a call that exchanges through the callbacks (a context's first call of an
/// operation, an autotuning call) returns no sooner than they do. Where a peer may never
/// join (a rank that failed, or one that called with other shapes), give the callbacks a
/// timeout of their own and return non-zero on it; the call then fails with that reason.
#[repr(C)]
pub struct NVTECommBootstrap {
    pub world_rank: i32,
    pub world_size: i32,
    pub nccl_comm: ncclComm_t,
    pub allgather: NVTECommAllgatherFn,
    pub barrier: NVTECommBarrierFn,
    pub user_data: *mut c_void,
}

// Engine settings: the C `NVTECommOverlapConfig` is `ffi::config::Config` (`repr(C)`;
// cbindgen.toml exports it under the C name), read here and converted into the engine's
// `Policy`. The entry points name it `Config` so that the header declares them
// with it.

/// Opaque overlap object (not repr(C): the header declares it incomplete).
pub struct NVTECommOverlap {
    _private: (),
}

pub(super) fn object(h: *mut NVTECommOverlap) -> Result<Arc<Mutex<Overlap>>> {
    OVERLAPS.get(h as usize, "overlap")
}

fn with<R>(h: *mut NVTECommOverlap, f: impl FnOnce(&mut Overlap) -> Result<R>) -> Result<R> {
    let o = object(h)?;
    let mut g = o.lock().unwrap_or_else(|e| e.into_inner());
    f(&mut g)
}

fn t(h: NVTETensor, what: &str) -> Result<Tensor> {
    super::handles::TENSORS.get(h as usize, what)
}
fn t_opt(h: NVTETensor, what: &str) -> Result<Option<Tensor>> {
    super::handles::TENSORS.get_opt(h as usize, what)
}

/// The caller's config, checked: its size first, then its bool fields (any byte may be
/// there; only 0 and 1 are bools), then read.
fn read_config(config: *const Config) -> Result<Config> {
    // SAFETY: non-null (checked by the caller); size checked before reading the rest.
    let size = unsafe { std::ptr::read_unaligned(config as *const usize) };
    if size != std::mem::size_of::<Config>() {
        invalid!(
            "config->struct_size = {size} but this library's NVTECommOverlapConfig has {} bytes (fill it with nvte_comm_overlap_config_default)",
            std::mem::size_of::<Config>()
        );
    }
    use std::mem::offset_of;
    for (off, name) in [
        (offset_of!(Config, set_sm_margin), "set_sm_margin"),
        (offset_of!(Config, use_ce), "use_ce"),
        (offset_of!(Config, aggregate), "aggregate"),
        (offset_of!(Config, atomic_gemm), "atomic_gemm"),
    ] {
        // SAFETY: within the struct_size bytes checked above.
        let b = unsafe { std::ptr::read_unaligned((config as *const u8).add(off)) };
        if b > 1 {
            invalid!("config->{name} = {b} is not a bool (0 or 1)");
        }
    }
    // SAFETY: the whole struct is readable and every field holds a valid value now.
    Ok(unsafe { std::ptr::read_unaligned(config) })
}

/// TE's defaults, then the environment overrides (NVTE_COMM_TIMEOUT_MS,
/// NVTE_COMM_OVERLAP_NUM_SPLITS, NVTE_COMM_OVERLAP_MAX_STREAMS, NVTE_COMM_OVERLAP_NUM_SM,
/// NVTE_COMM_OVERLAP_USE_CE, NVTE_COMM_OVERLAP_AGGREGATE, NVTE_COMM_OVERLAP_SM_MARGIN,
/// NVTE_COMM_TRANSPORT). A variable whose value does not parse or is out of range gives
/// NVTE_COMM_ERROR_INVALID_ARGUMENT naming it and its value; `*config` is then all zero.
#[unsafe(no_mangle)]
pub extern "C" fn nvte_comm_overlap_config_default(config: *mut Config) -> NVTECommStatus {
    entry!(status, {
        if config.is_null() {
            invalid!("argument `config` is NULL");
        }
        let c = Policy::from_env().map(|p| Config::of(&p));
        // SAFETY: non-null output pointer; all-zero bytes are a valid value of the struct.
        unsafe {
            match &c {
                Ok(c) => std::ptr::write_unaligned(config, *c),
                Err(_) => std::ptr::write_bytes(config, 0, 1),
            }
        }
        c.map(|_| ())
    })
}

/// The checks every creation from a bootstrap starts with: `out` non-NULL (then set to
/// NULL), `bootstrap` non-NULL; returns the caller's description.
pub(super) fn take_bootstrap<T>(
    bootstrap: *const NVTECommBootstrap,
    out: *mut *mut T,
) -> Result<NVTECommBootstrap> {
    if out.is_null() {
        invalid!("argument `out` is NULL");
    }
    // SAFETY: non-null output pointer.
    unsafe { *out = std::ptr::null_mut() };
    if bootstrap.is_null() {
        invalid!("argument `bootstrap` is NULL");
    }
    // SAFETY: non-null, points to the caller's struct (every bit pattern is valid).
    Ok(unsafe { std::ptr::read_unaligned(bootstrap) })
}

/// The core's bootstrap for the caller's description: its NCCL communicator when set,
/// else its callbacks.
pub(super) fn bootstrap_of(b: &NVTECommBootstrap) -> Result<Bootstrap> {
    if !b.nccl_comm.is_null() {
        Bootstrap::from_nccl(crate::cuda::NcclComm::from_c(b.nccl_comm))
    } else {
        Bootstrap::from_callbacks(
            b.world_rank,
            b.world_size,
            b.allgather.map(|f| f as AllgatherFn),
            b.barrier.map(|f| f as BarrierFn),
            b.user_data as usize,
        )
    }
}

/// Create an overlap object with a registered buffer of [rows, cols] `dtype` on every
/// rank of the world (collective: all ranks call it with the same arguments; each rank
/// uses the CUDA device current on its calling thread). Ranks are grouped in
/// consecutive blocks of `tp_size`; buffers are shared within a group through CUDA IPC
/// (the group must be on one node). `*out` is NULL on failure. The arguments (config,
/// shape, dtype, bootstrap) are checked before any CUDA library is loaded (except that
/// an NCCL bootstrap loads NCCL for the world size, which tp_size and rows are checked
/// against).
#[unsafe(no_mangle)]
pub extern "C" fn nvte_comm_overlap_create(
    bootstrap: *const NVTECommBootstrap,
    config: *const Config,
    rows: usize,
    cols: usize,
    dtype: NVTEDType,
    out: *mut *mut NVTECommOverlap,
) -> NVTECommStatus {
    entry!(status, {
        let b = take_bootstrap(bootstrap, out)?;
        // Everything that needs neither the world nor a device comes first.
        let args = overlap_args(config, rows, cols, dtype);
        // A rank whose own arguments are wrong tells its peers through callbacks (which
        // load nothing), so that they fail with it instead of waiting for it in their
        // next exchange, where callbacks such as MPI's have no timeout. (Over an NCCL
        // communicator those waits are bounded; NCCL is not loaded for a wrong argument.)
        if args.is_err() && !b.nccl_comm.is_null() {
            return args.map(|_| ());
        }
        // (a wrong argument is reported before a wrong bootstrap, as before either is used)
        let bs = bootstrap_of(&b).or_else(|e| args.clone().and(Err(e)))?;
        let args = args.and_then(|(policy, dt)| {
            Overlap::check_rows(rows, policy.tp_for(bs.size)?)?;
            Ok((policy, dt))
        });
        let (policy, dt) = bs.agree(args, "create their overlap object with valid arguments")?;
        let o = Overlap::create(&bs, policy, rows, cols, dt)?;
        let id = OVERLAPS.insert(Arc::new(Mutex::new(o)));
        // SAFETY: non-null output pointer.
        unsafe { *out = id as *mut NVTECommOverlap };
        Ok(())
    })
}

/// `nvte_comm_overlap_create`'s checks of its arguments that need neither the world nor
/// a device: the policy (the config's or the environment's, with the algorithm knobs,
/// read once here for the object's life), the dtype and the buffer's shape.
fn overlap_args(
    config: *const Config,
    rows: usize,
    cols: usize,
    dtype: NVTEDType,
) -> Result<(Policy, DType)> {
    let policy = if config.is_null() {
        Policy::from_env()?
    } else {
        read_config(config)?.policy(Pins::default())
    };
    policy.check()?;
    let dt = DType::from_c(dtype).map_err(|e| e.context("argument `dtype`"))?;
    Overlap::check_buffer(rows, cols, dt)?;
    crate::overlap::trace_enabled()?;
    let policy = Policy {
        pins: Pins::from_env()?,
        ..policy
    };
    Ok((policy, dt))
}

/// Destroy an object: waits (bounded by the timeout) until the peers are done with this
/// rank's buffer, then frees everything. Not collective. NULL is a no-op. May run on any
/// thread while another thread captures a CUDA graph (global mode too: a garbage
/// collector's finalizer): the capture stays valid, except for the NCCL transport's
/// teardown (NCCL frees memory on its own threads; see the README's CUDA graphs). Refused
/// (NVTE_COMM_ERROR_UNSUPPORTED, the object kept) while a capture holding the object's own
/// calls is still open: the graph being captured uses its memory. Destroy the graphs that
/// hold its calls first (with the NCCL transport NCCL's teardown waits for them).
#[unsafe(no_mangle)]
pub extern "C" fn nvte_comm_overlap_destroy(overlap: *mut NVTECommOverlap) -> NVTECommStatus {
    entry!(status, {
        if overlap.is_null() {
            return Ok(());
        }
        // (Dropped: quiesce, then free.)
        OVERLAPS.destroy(
            overlap as usize,
            "overlap",
            Overlap::in_open_capture,
            "a CUDA graph capture that contains this overlap object's calls is still open: its memory is in use; end the capture (cudaStreamEndCapture) and destroy that graph first",
        )
    })
}

/// tp size and this rank's index in its group (each out-pointer may be NULL; both are
/// set to 0 on error).
#[unsafe(no_mangle)]
pub extern "C" fn nvte_comm_overlap_tp(
    overlap: *mut NVTECommOverlap,
    tp_size: *mut i32,
    tp_rank: *mut i32,
) -> NVTECommStatus {
    entry!(status, {
        // Defined on every path: 0 unless the call succeeds.
        for p in [tp_size, tp_rank] {
            if !p.is_null() {
                // SAFETY: non-null output pointer.
                unsafe { *p = 0 };
            }
        }
        let (s, r) = with(overlap, |o| Ok((o.tp(), o.tp_rank())))?;
        if !tp_size.is_null() {
            // SAFETY: non-null output pointer.
            unsafe { *tp_size = s as i32 };
        }
        if !tp_rank.is_null() {
            unsafe { *tp_rank = r as i32 };
        }
        Ok(())
    })
}

/// A new tensor handle viewing the buffer (TE's get_ubuf): the whole [rows, cols], or
/// this rank's chunk [rows/tp, cols]. The caller destroys the handle; setting scale /
/// scale_inv on it gives FP8 buffers their scaling in the calls that take it.
#[unsafe(no_mangle)]
pub extern "C" fn nvte_comm_overlap_get_buffer(
    overlap: *mut NVTECommOverlap,
    local_chunk: bool,
    out: *mut NVTETensor,
) -> NVTECommStatus {
    entry!(status, {
        if out.is_null() {
            invalid!("argument `out` is NULL");
        }
        // SAFETY: non-null output pointer; NULL until a handle is made.
        unsafe { *out = std::ptr::null_mut() };
        let v = with(overlap, |o| o.view(local_chunk))?;
        let id = super::tensor::create(super::NVTEScalingMode::NVTE_DELAYED_TENSOR_SCALING)?;
        super::handles::TENSORS.update(id, "out", |t| {
            *t = Tensor {
                scaling_mode: t.scaling_mode,
                ..v
            };
            Ok(())
        })?;
        // SAFETY: non-null output pointer.
        unsafe { *out = id as NVTETensor };
        Ok(())
    })
}

/// Copy `input` into this rank's chunk (local_chunk) or the whole buffer, on `stream`,
/// once the peers are done with the previous call.
#[unsafe(no_mangle)]
pub extern "C" fn nvte_comm_overlap_copy_into_buffer(
    overlap: *mut NVTECommOverlap,
    input: NVTETensor,
    local_chunk: bool,
    stream: cudaStream_t,
) -> NVTECommStatus {
    entry!(status, {
        let i = t(input, "input")?;
        // SAFETY: the caller's tensor, resolved from a live handle; the function's
        // contract (TE's): its data is device memory of its shape, alive until the copy
        // on `stream` completes (dtype and size are checked against the buffer).
        let i = unsafe { crate::cuda::Checked::vouched(&i) };
        with(overlap, |o| {
            o.copy_into_buffer(i, local_chunk, crate::ffi::stream_of(stream))
        })
    })
}

/// All-gather + GEMM by ring exchange [TE SPLIT_PIPELINED_AG_P2P]: D = gather(B) x op(A)
/// with nvte_cublas_gemm's conventions (D is [n, m], n = gathered tokens). B is the
/// buffer view (local chunk filled) or this rank's shard [n/tp, k]. Bias, pre_gelu_out,
/// grad and accumulate apply to every chunk GEMM; `B_copy` (optional, [n, k]) receives
/// the gathered B (block-scaled B: with B's scaling mode and the GEMM-ready scales of
/// [n, k], which receive every rank's scales; 2D scales at tp > 1 need n/tp in whole
/// 128-row tiles). Asynchronous on `stream`.
#[unsafe(no_mangle)]
#[allow(non_snake_case)]
pub extern "C" fn nvte_comm_overlap_split_ag(
    overlap: *mut NVTECommOverlap,
    A: NVTETensor,
    transa: bool,
    B: NVTETensor,
    transb: bool,
    D: NVTETensor,
    bias: NVTETensor,
    pre_gelu_out: NVTETensor,
    grad: bool,
    workspace: NVTETensor,
    accumulate: bool,
    use_split_accumulator: bool,
    B_copy: NVTETensor,
    stream: cudaStream_t,
) -> NVTECommStatus {
    entry!(status, {
        let (a, b, d) = (t(A, "A")?, t(B, "B")?, t(D, "D")?);
        let extras = GemmExtras::resolve(bias, pre_gelu_out, workspace)?;
        let bc = t_opt(B_copy, "B_copy")?;
        let flags = TeFlags {
            transa,
            transb,
            grad,
            accumulate,
            use_split_accumulator,
        };
        let args = AgArgs {
            g: extras.operands(&a, &b, &d, flags, 0),
            b_copy: bc.as_ref(),
            key_m: None,
        };
        with(overlap, |o| {
            o.split_ag(&args, crate::ffi::stream_of(stream))
        })
    })
}

#[allow(non_snake_case, clippy::too_many_arguments)]
fn rs_call(
    p2p: bool,
    overlap: *mut NVTECommOverlap,
    A: NVTETensor,
    transa: bool,
    B: NVTETensor,
    transb: bool,
    D: NVTETensor,
    bias: NVTETensor,
    pre_gelu_out: NVTETensor,
    grad: bool,
    workspace: NVTETensor,
    accumulate: bool,
    use_split_accumulator: bool,
    rs_output: NVTETensor,
    stream: cudaStream_t,
) -> Result<()> {
    let (a, b, out) = (t(A, "A")?, t(B, "B")?, t(rs_output, "rs_output")?);
    let d = t_opt(D, "D")?;
    let extras = GemmExtras::resolve(bias, pre_gelu_out, workspace)?;
    let flags = TeFlags {
        transa,
        transb,
        grad,
        accumulate,
        use_split_accumulator,
    };
    let args = RsArgs {
        g: extras.operands(&a, &b, d.as_ref(), flags, 0),
        rs_output: &out,
    };
    with(overlap, |o| {
        if p2p {
            o.split_rs_p2p(&args, crate::ffi::stream_of(stream))
        } else {
            o.split_rs(&args, crate::ffi::stream_of(stream))
        }
    })
}

/// GEMM + reduce-scatter, pipelined [TE SPLIT_PIPELINED_RS]: the GEMM (output in the
/// buffer as [n, m]; `D` = the buffer view carrying FP8 scale / scale_inv, or NULL) is
/// split into num_splits column chunks, each reduce-scattered by a kernel reading the
/// peers' buffers while the next computes. `rs_output` [n/tp, m] gets this rank's rows of
/// the sum over ranks. Asynchronous on `stream`.
#[unsafe(no_mangle)]
#[allow(non_snake_case)]
pub extern "C" fn nvte_comm_overlap_split_rs(
    overlap: *mut NVTECommOverlap,
    A: NVTETensor,
    transa: bool,
    B: NVTETensor,
    transb: bool,
    D: NVTETensor,
    bias: NVTETensor,
    pre_gelu_out: NVTETensor,
    grad: bool,
    workspace: NVTETensor,
    accumulate: bool,
    use_split_accumulator: bool,
    rs_output: NVTETensor,
    stream: cudaStream_t,
) -> NVTECommStatus {
    entry!(status, {
        rs_call(
            false,
            overlap,
            A,
            transa,
            B,
            transb,
            D,
            bias,
            pre_gelu_out,
            grad,
            workspace,
            accumulate,
            use_split_accumulator,
            rs_output,
            stream,
        )
    })
}

// The TE entry points with identical parameter lists (split_rs / split_rs_p2p here, the
// three comm-GEMM calls in comm_gemm.rs) are written out on purpose: cbindgen makes the
// header from these declarations and does not expand macros. Their bodies are `entry!`
// around one helper each (`rs_call`, `call`); the macro, not the helper, names the call.
/// GEMM + reduce-scatter by ring exchange [TE SPLIT_PIPELINED_RS_P2P]: step i computes
/// the rows owned by rank (r+i+1) % tp and puts them there while the next step computes;
/// a final kernel sums the tp partials into `rs_output` [n/tp, m]. Arguments as split_rs.
#[unsafe(no_mangle)]
#[allow(non_snake_case)]
pub extern "C" fn nvte_comm_overlap_split_rs_p2p(
    overlap: *mut NVTECommOverlap,
    A: NVTETensor,
    transa: bool,
    B: NVTETensor,
    transb: bool,
    D: NVTETensor,
    bias: NVTETensor,
    pre_gelu_out: NVTETensor,
    grad: bool,
    workspace: NVTETensor,
    accumulate: bool,
    use_split_accumulator: bool,
    rs_output: NVTETensor,
    stream: cudaStream_t,
) -> NVTECommStatus {
    entry!(status, {
        rs_call(
            true,
            overlap,
            A,
            transa,
            B,
            transb,
            D,
            bias,
            pre_gelu_out,
            grad,
            workspace,
            accumulate,
            use_split_accumulator,
            rs_output,
            stream,
        )
    })
}

/// Bulk overlap [TE BULK_OVERLAP_AG / BULK_OVERLAP_RS]: the collective `comm_type` on the
/// pre-filled buffer (AG: gather every rank's chunk into every buffer; RS: sum the
/// buffers, this rank's rows into `rs_output` [rows/tp, cols]) runs beside the unrelated
/// GEMM D = op(B) x op(A) (nvte_cublas_gemm's arguments). `buffer` is the buffer view
/// carrying scale_inv for an FP8 RS (else may be NULL). Asynchronous on `stream`.
#[unsafe(no_mangle)]
#[allow(non_snake_case)]
pub extern "C" fn nvte_comm_overlap_bulk(
    overlap: *mut NVTECommOverlap,
    comm_type: NVTECommOverlapType,
    A: NVTETensor,
    transa: bool,
    B: NVTETensor,
    transb: bool,
    D: NVTETensor,
    bias: NVTETensor,
    pre_gelu_out: NVTETensor,
    grad: bool,
    workspace: NVTETensor,
    accumulate: bool,
    use_split_accumulator: bool,
    buffer: NVTETensor,
    rs_output: NVTETensor,
    stream: cudaStream_t,
) -> NVTECommStatus {
    entry!(status, {
        let kind = match comm_type {
            NVTECommOverlapType::NVTE_COMM_OVERLAP_AG => BulkKind::AllGather,
            NVTECommOverlapType::NVTE_COMM_OVERLAP_RS => BulkKind::ReduceScatter,
            other => invalid!("argument `comm_type` = {other} is not a valid NVTECommOverlapType"),
        };
        let (a, b, d) = (t(A, "A")?, t(B, "B")?, t(D, "D")?);
        let extras = GemmExtras::resolve(bias, pre_gelu_out, workspace)?;
        let (buf, out) = (t_opt(buffer, "buffer")?, t_opt(rs_output, "rs_output")?);
        let flags = TeFlags {
            transa,
            transb,
            grad,
            accumulate,
            use_split_accumulator,
        };
        let args = BulkArgs {
            kind,
            gemm: extras.operands(&a, &b, &d, flags, 0),
            buffer_view: buf.as_ref(),
            rs_output: out.as_ref(),
        };
        with(overlap, |o| o.bulk(&args, crate::ffi::stream_of(stream)))
    })
}

/// Host-wait until the object's last call has finished on the GPU. Returns
/// NVTE_COMM_ERROR_TIMEOUT, naming rank, peer, operation and step, when a wait for a peer
/// timed out (the object is then unusable: every later call returns that error).
/// CUDA graphs: while a capture holding this object's calls is open it returns
/// NVTE_COMM_ERROR_UNSUPPORTED (a host wait cannot be captured; the capture stays valid);
/// when the last call was captured it only reports recorded timeouts (waiting for the
/// graph's launches is the launching stream's business).
#[unsafe(no_mangle)]
pub extern "C" fn nvte_comm_overlap_synchronize(overlap: *mut NVTECommOverlap) -> NVTECommStatus {
    entry!(status, { with(overlap, |o| o.synchronize()) })
}
