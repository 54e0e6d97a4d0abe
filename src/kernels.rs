//! Typed launches of the kernels in `kernels/cast.cu`: quantize (rowwise and / or the
//! transposed columnwise FP8 output in one pass), amax, current and delayed scaling,
//! transpose, dequantize, random fill.
use crate::cuda::StreamHandle;
use crate::cuda::{self, Binding, Checked, ContextGuard, DevPtr, Kernel, Params, Signature, nvrtc};
use crate::error::Result;
use crate::tensor::{Buffer, DType, Tensor};
use crate::{invalid, unsupported};
use std::sync::Mutex;

pub mod block;

const BLOCK: u32 = 256;

fn short(d: DType) -> Option<&'static str> {
    Some(match d {
        DType::F32 => "f32",
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        DType::E4M3 => "e4m3",
        DType::E5M2 => "e5m2",
        _ => return None,
    })
}

fn grid_for(n: usize, sm_count: i32) -> u32 {
    let blocks = n.div_ceil(BLOCK as usize);
    blocks.clamp(1, (sm_count.max(1) as usize) * 8) as u32
}

// The kernels of kernels/cast.cu, each family with its parameter list. Pointers are
// DevPtr (repr(transparent) u64), u64 is the kernels' u64, i32 their int, f32 their float.
// SAFETY (each binding): the parameter list of every kernel of kernels/cast.cu its
// pattern names, as the comment above it states (checked by tests/kernel_signatures.rs).

/// quantize_<in>_<out>(const I::T *in, O::T *out, u64 n, const float *scale, float *amax,
/// float *scale_inv)
const QUANTIZE: Binding<(DevPtr, DevPtr, u64, DevPtr, DevPtr, DevPtr)> =
    unsafe { Binding::new(&nvrtc::CAST, "quantize_{}_{}", "quantize") };
/// quantize_fp8_<in>_<out>(const I::T *in, u8 *out, u64 n, const float *scale, float *amax,
/// float *sinv, float *sinv_t, const float *noop, int vec)
type QuantizeFp8Params = (
    DevPtr,
    DevPtr,
    u64,
    DevPtr,
    DevPtr,
    DevPtr,
    DevPtr,
    DevPtr,
    i32,
);
const QUANTIZE_FP8: Binding<QuantizeFp8Params> =
    unsafe { Binding::new(&nvrtc::CAST, "quantize_fp8_{}_{}", "quantize") };
/// cast_transpose(_slow)_<in>_<out>(const I::T *in, u8 *out, u8 *out_t, u64 rows, u64 cols,
/// const float *scale, float *amax, float *sinv, float *sinv_t, const float *noop)
type CastTransposeParams = (
    DevPtr,
    DevPtr,
    DevPtr,
    u64,
    u64,
    DevPtr,
    DevPtr,
    DevPtr,
    DevPtr,
    DevPtr,
);
const CAST_TRANSPOSE: Binding<CastTransposeParams> =
    unsafe { Binding::new(&nvrtc::CAST, "cast_transpose_{}_{}", CT_WHAT) };
const CAST_TRANSPOSE_SLOW: Binding<CastTransposeParams> =
    unsafe { Binding::new(&nvrtc::CAST, "cast_transpose_slow_{}_{}", CT_WHAT) };
/// ct2_<vec|any>_<in>_<out> and the bench variants ct2x_*: cast_transpose's parameters,
/// then int t_vec
type Ct2Params = (
    DevPtr,
    DevPtr,
    DevPtr,
    u64,
    u64,
    DevPtr,
    DevPtr,
    DevPtr,
    DevPtr,
    DevPtr,
    i32,
);
const CT2: Binding<Ct2Params> = unsafe { Binding::new(&nvrtc::CAST, "ct2_{}_{}_{}", CT_WHAT) };
/// (compiled into CAST_VARIANTS: kernels/cast.cu with TE_COMM_CT2_VARIANTS defined)
const CT2X: Binding<Ct2Params> =
    unsafe { Binding::new(&nvrtc::CAST, "ct2x_tr{}_g{}_pf{}_cs{}_m{}", CT_WHAT) };
/// The v3 bench variants (CAST_VARIANTS): ct3_r<TR>_c<TC>_b<BS>_m<MINB>, CT2X's
/// parameters.
const CT3: Binding<Ct2Params> =
    unsafe { Binding::new(&nvrtc::CAST, "ct3_r{}_c{}_b{}_m{}", CT_WHAT) };
/// The v3 cast + transpose, the default where its tiles fit (kernels/cast.cu
/// ct3_<in>_<out>: 256 x 128 tiles, one a block, 512 threads, 16-bit inputs), CT2X's
/// parameters.
const CT3_DEFAULT: Binding<Ct2Params> = unsafe { Binding::new(&nvrtc::CAST, "ct3_{}_{}", CT_WHAT) };
/// Rows and columns of a v3 tile (kernels/cast.cu CT3_DEFAULT).
const CT3_TILE: (usize, usize) = (256, 128);
/// zero_amax(float *amax, const float *noop)
const ZERO_AMAX: Binding<(DevPtr, DevPtr)> =
    unsafe { Binding::new(&nvrtc::CAST, "zero_amax", "zero_amax") };
/// amax_<in>(const I::T *in, u64 n, float *amax, const float *noop, int vec)
const AMAX: Binding<(DevPtr, u64, DevPtr, DevPtr, i32)> =
    unsafe { Binding::new(&nvrtc::CAST, "amax_{}", "compute_amax") };
/// scale_from_amax(const float *amax, float *scale, float fp8_max, int pow2, float
/// epsilon, const float *noop)
const SCALE_FROM_AMAX: Binding<(DevPtr, DevPtr, f32, i32, f32, DevPtr)> =
    unsafe { Binding::new(&nvrtc::CAST, "scale_from_amax", "compute_scale_from_amax") };
/// delayed_scaling_update(const float *hist, const float *scale, float *upd_hist, float
/// *upd_scale, u64 len, u64 stride, int algo, float scaled_max)
type DelayedParams = (DevPtr, DevPtr, DevPtr, DevPtr, u64, u64, i32, f32);
const DELAYED_SCALING_UPDATE: Binding<DelayedParams> = unsafe {
    Binding::new(
        &nvrtc::CAST,
        "delayed_scaling_update",
        "delayed_scaling_update",
    )
};
/// transpose(_vec)_b<size>(const T *in, T *out, u64 rows, u64 cols)
const TRANSPOSE: Binding<(DevPtr, DevPtr, u64, u64)> =
    unsafe { Binding::new(&nvrtc::CAST, "transpose_b{}", "transpose") };
const TRANSPOSE_VEC: Binding<(DevPtr, DevPtr, u64, u64)> =
    unsafe { Binding::new(&nvrtc::CAST, "transpose_vec_b{}", "transpose") };
/// dequantize_vec_<in>_<out>(const u8 *in, O::T *out, u64 n, const float *scale_inv, int vec)
const DEQUANTIZE: Binding<(DevPtr, DevPtr, u64, DevPtr, i32)> =
    unsafe { Binding::new(&nvrtc::CAST, "dequantize_vec_{}_{}", "dequantize") };
/// fill_uniform_<out>(O::T *out, u64 n, u64 seed, float lo, float hi)
const FILL_UNIFORM: Binding<(DevPtr, u64, u64, f32, f32)> =
    unsafe { Binding::new(&nvrtc::CAST, "fill_uniform_{}", "fill_uniform") };

/// What launch errors of the cast + transpose kernels say.
const CT_WHAT: &str = "quantize (cast + transpose)";

/// The kernel bindings of this module (checked against kernels/cast.cu by
/// tests/kernel_signatures.rs).
pub fn kernel_signatures() -> Vec<Signature> {
    vec![
        QUANTIZE.signature(),
        QUANTIZE_FP8.signature(),
        CAST_TRANSPOSE.signature(),
        CAST_TRANSPOSE_SLOW.signature(),
        CT2.signature(),
        CT2X.signature(),
        CT3.signature(),
        CT3_DEFAULT.signature(),
        ZERO_AMAX.signature(),
        AMAX.signature(),
        SCALE_FROM_AMAX.signature(),
        DELAYED_SCALING_UPDATE.signature(),
        TRANSPOSE.signature(),
        TRANSPOSE_VEC.signature(),
        DEQUANTIZE.signature(),
        FILL_UNIFORM.signature(),
    ]
}

/// Launch element-wise kernel `k` over `n` elements (grid-stride loops; BLOCK threads a
/// block, at most 8 blocks an SM).
///
/// # Safety
/// As [`Kernel::launch`] (any grid and block of this shape).
unsafe fn launch_elementwise<P: Params>(
    k: &Kernel<P>,
    sms: i32,
    n: usize,
    params: P,
    stream: StreamHandle,
) -> Result<()> {
    // SAFETY: the caller's obligations.
    unsafe { k.launch(((grid_for(n, sms), 1, 1), (BLOCK, 1, 1)), stream, params) }
}

/// Block size (the kernel's `__launch_bounds__`) and resident blocks per SM of a kernel
/// launched without dynamic shared memory, read off the function once per context (by
/// the context's id `ctx`: after a device reset another kernel may get a function's
/// address, and its launch bounds must not be taken for this one's).
fn launch_shape(ctx: cuda::CtxId, f: cudarc::driver::sys::CUfunction) -> Result<(u32, u32)> {
    use cudarc::driver::sys as cu;
    type Entry = ((cuda::CtxId, cuda::FunctionHandle), (u32, u32));
    static CACHE: Mutex<Vec<Entry>> = Mutex::new(Vec::new());
    let key = (ctx, cuda::FunctionHandle::from_raw(f));
    if let Some(&(_, v)) = CACHE
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .find(|(k, _)| *k == key)
    {
        return Ok(v);
    }
    let mut threads = 0;
    // SAFETY: `f` is a loaded function; out pointer.
    cuda::check(
        unsafe {
            cu::cuFuncGetAttribute(
                &mut threads,
                cu::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK,
                f,
            )
        },
        "cuFuncGetAttribute(MAX_THREADS_PER_BLOCK)",
    )?;
    let threads = threads.clamp(32, 1024);
    let mut blocks = 0;
    // SAFETY: as above.
    cuda::check(
        unsafe { cu::cuOccupancyMaxActiveBlocksPerMultiprocessor(&mut blocks, f, threads, 0) },
        "cuOccupancyMaxActiveBlocksPerMultiprocessor",
    )?;
    let v = (threads as u32, blocks.max(1) as u32);
    CACHE
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push((key, v));
    Ok(v)
}

/// Grid of a grid-stride kernel: enough blocks for `work` items of `per_block` each, at
/// most one full wave (`sm_count` x resident blocks an SM).
fn persistent_grid(work: usize, per_block: usize, sms: i32, blocks_per_sm: u32) -> u32 {
    let full = sms.max(1) as usize * blocks_per_sm.max(1) as usize;
    work.div_ceil(per_block.max(1)).clamp(1, full) as u32
}

/// Chunks a thread takes per pass in the rowwise quantize and the amax kernels (cast.cu's
/// QROW_U and AMAX_U).
const QROW_U: usize = 2;
const AMAX_U: usize = 4;

/// The grid of the streaming kernels (rowwise quantize, amax) over `work` vector chunks,
/// `per_thread` a thread: one block per `block * per_thread` consecutive chunks, a single
/// pass (at 64M bf16 elements 82.6 / 82.1 % of the H100's nominal HBM bandwidth for the
/// cast / amax traffic, against 79.7-80.8 / 81.0 % with a persistent grid-stride grid:
/// `bench/hbm_probe.cu`, bench/RESULTS.md 2026-11-26, seventh session); the kernels stride
/// over whatever a smaller grid leaves. NVTE_COMM_QUANT_GRID=persistent (read once; for
/// A/B benches) keeps the persistent grid.
fn flat_grid(work: usize, block: u32, per_thread: usize, sms: i32, per_sm: u32) -> Result<u32> {
    static PERSISTENT: std::sync::OnceLock<std::result::Result<bool, String>> =
        std::sync::OnceLock::new();
    let persistent =
        crate::env::once(&PERSISTENT, || Ok(crate::env::QUANT_GRID.get()? == Some(1)))?;
    if persistent {
        return Ok(persistent_grid(work, block as usize, sms, per_sm));
    }
    Ok(work
        .div_ceil((block as usize * per_thread).max(1))
        .clamp(1, i32::MAX as usize) as u32)
}

/// Kernel `parts` of binding `b` in the cast module of the guard's context, and the
/// device's SM count.
fn kernel<P: Params>(
    guard: &ContextGuard,
    b: &Binding<P>,
    parts: &[&str],
) -> Result<(Kernel<P>, i32)> {
    let dev = cuda::device_info(guard.device)?;
    let m = nvrtc::module(&nvrtc::CAST, guard.id, &dev)?;
    // SAFETY: `m` is kernels/cast.cu's module, the source of every binding of this module.
    Ok((unsafe { Kernel::new(&m, b, parts)? }, dev.sm_count))
}

fn need_data(b: &Buffer, what: &str) -> Result<()> {
    if b.numel() > 0 && b.ptr.is_null() {
        invalid!(
            "tensor `{what}` has {} elements but a NULL data pointer",
            b.numel()
        );
    }
    Ok(())
}

fn opt_ptr(b: &Buffer) -> DevPtr {
    Tensor::scalar_ptr(b).unwrap_or_default()
}

/// Options of a quantization (TE's NVTEQuantizationConfig, resolved for a call).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct QuantConfig {
    /// Round current-scaling scales down to a power of 2.
    pub force_pow_2_scales: bool,
    /// Lower bound of the amax used for a current-scaling scale.
    pub amax_epsilon: f32,
    /// Device float: kernels given a flag holding 1 do nothing (NULL: none).
    pub noop: DevPtr,
}

/// Largest finite value of an FP8 type (TE's max_norm).
pub fn fp8_max(d: DType) -> Option<f32> {
    match d {
        DType::E4M3 => Some(448.0),
        DType::E5M2 => Some(57344.0),
        _ => None,
    }
}

/// TE's 2-D view of a buffer: leading dimensions flattened into rows (a 1-D or scalar
/// tensor is one row).
pub fn flat_2d(b: &Buffer) -> (usize, usize) {
    let s = b.shape.as_slice();
    match s.len() {
        0 => (1, 1),
        n => (s[..n - 1].iter().product(), s[n - 1]),
    }
}

/// Checks that `cw` can hold the columnwise (transposed) copy of a [rows, cols] input:
/// as many elements, and cols first (TE's transposed shape [cols, rest...]).
pub fn check_columnwise_shape(cw: &Buffer, rows: usize, cols: usize) -> Result<()> {
    let s = cw.shape.as_slice();
    if cw.numel() != rows * cols || (rows * cols > 0 && s.first() != Some(&cols)) {
        invalid!(
            "tensor `output` columnwise data has shape {} but the input is [{rows}, {cols}] as 2-D: expected the transpose [{cols}, {rows}] (cols first, {} elements)",
            cw.shape,
            rows * cols
        );
    }
    Ok(())
}

/// Whether `d` is an unquantized input type of the casts (float32, bfloat16, float16).
pub(crate) fn is_float_input(d: DType) -> bool {
    matches!(d, DType::F32 | DType::BF16 | DType::F16)
}

/// TE's nvte_quantize / nvte_quantize_v2 for per-tensor scaling. An FP8 output gets
/// rowwise data = cast(input * scale) when it has kNVTERowwiseData, columnwise data = the
/// cast transpose ([cols, rows] of the input's 2-D view) when it has kNVTEColumnwiseData
/// (both from one pass over the input), amax = max(amax, max|input|) (not zeroed: TE's
/// atomic max), scale_inv and columnwise_scale_inv = 1/scale. A float output
/// (float32/bf16/fp16) is a plain cast (times the scale when one is set).
pub fn quantize(
    input: Checked<&Tensor>,
    output: Checked<&Tensor>,
    cfg: &QuantConfig,
    stream: StreamHandle,
) -> Result<()> {
    let (input, output) = (*input, *output);
    let (has_row, has_col, rows, cols, out_dtype) = match quantize_kind(input, output)? {
        Quantize::Plain => return cast_plain(input, output, stream),
        Quantize::Nothing => return Ok(()),
        Quantize::Fp8 {
            has_row,
            has_col,
            rows,
            cols,
            out_dtype,
        } => (has_row, has_col, rows, cols, out_dtype),
    };
    let (i, o, cw) = (&input.data, &output.data, &output.columnwise_data);
    let guard = ContextGuard::for_stream(stream)?;
    let iname = short(i.dtype).unwrap();
    let oname = short(out_dtype).unwrap();
    let dev = cuda::device_info(guard.device)?;
    let m = nvrtc::module(&nvrtc::CAST, guard.id, &dev)?;
    let p = QuantPtrs {
        src: i.ptr,
        scale: opt_ptr(&output.scale),
        amax: opt_ptr(&output.amax),
        sinv: opt_ptr(&output.scale_inv),
        sinv_t: opt_ptr(&output.columnwise_scale_inv),
        noop: cfg.noop,
    };
    let names = (iname, oname);
    if !has_col {
        return quantize_rowwise(&m, &dev, names, (&p, o.ptr, i.numel()), stream);
    }
    let dst = if has_row { o.ptr } else { DevPtr::NULL };
    let ctx = (&*m, &dev, guard.id);
    cast_transpose(ctx, names, (&p, dst, cw.ptr), (rows, cols), stream)
}

/// What nvte_quantize does with its arguments (checked; the checks come before anything
/// is loaded).
enum Quantize {
    /// a float-to-float cast
    Plain,
    /// an empty input: nothing
    Nothing,
    /// FP8: rowwise and / or columnwise data of the input's 2-D view [rows, cols]
    Fp8 {
        has_row: bool,
        has_col: bool,
        rows: usize,
        cols: usize,
        out_dtype: DType,
    },
}

fn quantize_kind(input: &Tensor, output: &Tensor) -> Result<Quantize> {
    let i = &input.data;
    let (o, cw) = (&output.data, &output.columnwise_data);
    // Rowwise is wanted unless only the columnwise data is set.
    let has_row = !o.ptr.is_null() || cw.ptr.is_null();
    let has_col = !cw.ptr.is_null();
    if o.ptr.is_null() && cw.ptr.is_null() && i.numel() > 0 {
        invalid!(
            "tensor `output` has neither rowwise nor columnwise data (set kNVTERowwiseData and / or kNVTEColumnwiseData)"
        );
    }
    if has_row && i.numel() != o.numel() {
        invalid!(
            "tensor `input` has {} elements ({}) but `output` has {} ({})",
            i.numel(),
            i.shape,
            o.numel(),
            o.shape
        );
    }
    if !is_float_input(i.dtype) {
        unsupported!(
            "tensor `input` dtype {} is not supported: expected kNVTEFloat32, kNVTEBFloat16 or kNVTEFloat16",
            i.dtype.name()
        );
    }
    need_data(i, "input")?;
    let out_dtype = if has_row { o.dtype } else { cw.dtype };
    if !out_dtype.is_fp8() {
        if has_col {
            unsupported!(
                "tensor `output` has columnwise data of dtype {}: the columnwise (transposed) output is FP8 only (kNVTEFloat8E4M3 / kNVTEFloat8E5M2)",
                cw.dtype.name()
            );
        }
        return Ok(Quantize::Plain);
    }
    if has_row && has_col && cw.dtype != o.dtype {
        invalid!(
            "tensor `output` rowwise data is {} but its columnwise data is {}: both must be the same FP8 type",
            o.dtype.name(),
            cw.dtype.name()
        );
    }
    let (rows, cols) = flat_2d(i);
    if has_col {
        check_columnwise_shape(cw, rows, cols)?;
    }
    if has_row {
        need_data(o, "output")?;
    }
    if Tensor::scalar_ptr(&output.scale).is_none() {
        invalid!(
            "tensor `output` is {} but has no scale (set kNVTEScale)",
            out_dtype.name()
        );
    }
    if i.numel() == 0 {
        return Ok(Quantize::Nothing);
    }
    Ok(Quantize::Fp8 {
        has_row,
        has_col,
        rows,
        cols,
        out_dtype,
    })
}

/// The device addresses of a quantization: input, scale, amax, scale_inv, columnwise
/// scale_inv, noop flag (each NULL or one float).
struct QuantPtrs {
    src: DevPtr,
    scale: DevPtr,
    amax: DevPtr,
    sinv: DevPtr,
    sinv_t: DevPtr,
    noop: DevPtr,
}

/// Rowwise FP8 only: quantize_fp8_<in>_<out> over the `numel` elements into `dst`.
fn quantize_rowwise(
    m: &nvrtc::Module,
    dev: &cuda::DeviceInfo,
    (iname, oname): (&str, &str),
    (p, dst, numel): (&QuantPtrs, DevPtr, usize),
    stream: StreamHandle,
) -> Result<()> {
    let QuantPtrs {
        src,
        scale,
        amax,
        sinv,
        sinv_t,
        noop,
    } = *p;
    // SAFETY: `m` is kernels/cast.cu's module.
    let k = unsafe { Kernel::new(m, &QUANTIZE_FP8, &[iname, oname])? };
    let n = numel as u64;
    let vec: i32 = (src.is_aligned(16) && dst.is_aligned(16)) as i32;
    // The vector path: chunks of 16 elements.
    let work = if vec == 1 { numel / 16 } else { numel };
    let (block, per_sm) = launch_shape(m.ctx, k.raw())?;
    let grid = if vec == 1 {
        flat_grid(work, block, QROW_U, dev.sm_count, per_sm)?
    } else {
        persistent_grid(work, block as usize, dev.sm_count, per_sm)
    };
    let params = (src, dst, n, scale, amax, sinv, sinv_t, noop, vec);
    // SAFETY: `k` is quantize_fp8_<in>_<out> of kernels/cast.cu, loaded in the stream's
    // context (held by `guard`); its parameters: in, out: pointers; n: u64; scale, amax,
    // scale_inv, columnwise scale_inv, noop: pointers, each NULL or one float; vec: i32.
    // `in` and `out` are the caller's buffers of n elements (TE's contract; NULL checked
    // above); vec is 1 only when both are 16-byte aligned. Any grid and block size is
    // valid (grid-stride loops; block = the launch bounds).
    unsafe { k.launch(((grid, 1, 1), (block, 1, 1)), stream, params) }
}

/// Rowwise and / or columnwise FP8: the cast + transpose kernels (v2, its bench variants,
/// or v1: NVTE_COMM_CAST_TRANSPOSE) of the [rows, cols]
/// input into `dst` (NULL: no rowwise output) and `dst_t`, in the CUDA context `ctx`.
fn cast_transpose(
    (m, dev, ctx): (&nvrtc::Module, &cuda::DeviceInfo, cuda::CtxId),
    (iname, oname): (&str, &str),
    (p, dst, dst_t): (&QuantPtrs, DevPtr, DevPtr),
    (rows, cols): (usize, usize),
    stream: StreamHandle,
) -> Result<()> {
    let QuantPtrs {
        src,
        scale,
        amax,
        sinv,
        sinv_t,
        noop,
    } = *p;
    let (r, c) = (rows as u64, cols as u64);
    let ptrs = [src, dst, dst_t, scale, amax, sinv, sinv_t, noop];
    let ct = CastTranspose::from_env()?;
    if ct == CastTranspose::V1 {
        return cast_transpose_v1(m, dev, (iname, oname), (r, c), ptrs, stream);
    }
    // v2: vector loads and rowwise stores when the input is 16-byte aligned, the rowwise
    // output 8-byte aligned (or absent) and rows hold whole 8-element units; 16-byte
    // transposed stores when out_t is 16-byte aligned and rows % 16 == 0.
    let vec = src.is_aligned(16) && dst.is_aligned(8) && cols % 8 == 0;
    let t_vec: i32 = (dst_t.is_aligned(16) && rows % 16 == 0) as i32;
    let (k, (tile_rows, tile_cols), one_tile_a_block) = ct_kernel(
        (m, dev, ctx),
        ct,
        (iname, oname),
        (vec, dst_t.is_aligned(16)),
        (rows, cols),
    )?;
    // The kernel indexes its threads as (tile rows / 8) x (tile columns / 8) (v2: 2 x tile
    // rows): launch exactly that many (a launch beyond its launch bounds fails instead of
    // running a partial tile).
    let (_, per_sm) = launch_shape(ctx, k.raw())?;
    let block = ((tile_rows / 8) * (tile_cols / 8)) as u32;
    let tiles = rows.div_ceil(tile_rows) * cols.div_ceil(tile_cols);
    let grid = if one_tile_a_block {
        tiles.clamp(1, i32::MAX as usize) as u32
    } else {
        persistent_grid(tiles, 1, dev.sm_count, per_sm)
    };
    let params = (
        src, dst, dst_t, r, c, scale, amax, sinv, sinv_t, noop, t_vec,
    );
    // SAFETY: `k` is ct2_(vec|any)_<in>_<out> or ct3_<in>_<out> of kernels/cast.cu or a
    // ct2x_* / ct3_* bench variant (bf16 -> e4m3) in CAST_VARIANTS, loaded in the stream's context
    // (held by `guard`); its parameters: in, out, out_t: pointers; rows, cols: u64; scale,
    // amax, scale_inv, columnwise scale_inv, noop: pointers, each NULL or one float; t_vec:
    // i32. `in` holds rows*cols elements, `out` (NULL when not requested) as many, `out_t`
    // as many (checked above). The vector kernels run only with the alignment and
    // divisibility they need (`vec`; the v3 ones also whole tiles and out_t 16-byte
    // aligned), the element kernel takes any shape and alignment; t_vec is 1 only when
    // out_t is 16-byte aligned and rows % 16 == 0. The block size is the one the kernel
    // assumes (its tile's threads, its launch bounds); any grid is valid (grid-stride over
    // tiles).
    unsafe { k.launch(((grid, 1, 1), (block, 1, 1)), stream, params) }
}

/// A cast + transpose kernel as a call launches it: (kernel, its tile (rows, columns), one
/// tile a block).
type CtKernel = (Kernel<Ct2Params>, (usize, usize), bool);

/// The cast + transpose kernel of a call (module doc of [`cast_transpose`]): (kernel, its
/// tile (rows, columns), one tile a block). `vec`: the vector
/// path's alignment and divisibility hold; `t_aligned`: out_t is 16-byte aligned.
fn ct_kernel(
    (m, dev, ctx): (&nvrtc::Module, &cuda::DeviceInfo, cuda::CtxId),
    ct: CastTranspose,
    (iname, oname): (&str, &str),
    (vec, t_aligned): (bool, bool),
    (rows, cols): (usize, usize),
) -> Result<CtKernel> {
    // A bench variant runs only where it exists (bf16 -> e4m3, vector path; the v3 ones on
    // whole tiles with out_t 16-byte aligned); else v2.
    let variant = match ct {
        CastTranspose::Bench(k) if vec && iname == "bf16" && oname == "e4m3" => Some(CT2_BENCH[k])
            .filter(|v| {
                !v.whole_tiles || (rows % v.tile_rows == 0 && cols % v.tile_cols == 0 && t_aligned)
            }),
        _ => None,
    };
    // SAFETY (the lookups): `m` is kernels/cast.cu's module, `mv` the same source with
    // its bench variants.
    // v3 (the default): 16-bit inputs on the vector path where its 256 x 128 tiles cover
    // the input exactly and out_t is 16-byte aligned (its bulk stores); else v2.
    let v3 = ct == CastTranspose::V3
        && vec
        && matches!(iname, "bf16" | "f16")
        && rows % CT3_TILE.0 == 0
        && cols % CT3_TILE.1 == 0
        && t_aligned;
    Ok(match variant {
        _ if v3 => (
            unsafe { Kernel::new(m, &CT3_DEFAULT, &[iname, oname])? },
            CT3_TILE,
            true,
        ),
        Some(v) if v.kernel.is_empty() => (
            unsafe { Kernel::new(m, &CT2, &["vec", iname, oname])? },
            (CT2_TILE_ROWS, 128),
            v.one_tile_a_block,
        ),
        Some(v) => {
            let mv = nvrtc::module(&CAST_VARIANTS, ctx, dev)?;
            let b = if v.kernel.starts_with("ct3_") {
                &CT3
            } else {
                &CT2X
            };
            let k = unsafe { Kernel::named(&mv, b, v.kernel)? };
            (k, (v.tile_rows, v.tile_cols), v.one_tile_a_block)
        }
        None => {
            let kind = if vec { "vec" } else { "any" };
            (
                unsafe { Kernel::new(m, &CT2, &[kind, iname, oname])? },
                (CT2_TILE_ROWS, 128),
                false,
            )
        }
    })
}

/// Rows of a v2 cast + transpose tile (CT2_TR of kernels/cast.cu); 128 columns.
const CT2_TILE_ROWS: usize = 128;

/// The bench variants of the cast + transpose (v2's template and v3: kernels/cast.cu under
/// TE_COMM_CT2_VARIANTS), compiled into a module of their own only when asked for.
pub const CAST_VARIANTS: nvrtc::Source = nvrtc::Source {
    name: "cast_ct2_variants.cu",
    code: concat!(
        "#define TE_COMM_CT2_VARIANTS 1\n",
        include_str!("../kernels/cast.cu")
    ),
};

/// A bench variant of the cast + transpose (v2's template or v3's).
#[derive(Clone, Copy, Debug, PartialEq)]
struct Ct2Variant {
    /// Value of NVTE_COMM_CAST_TRANSPOSE that selects it.
    name: &'static str,
    /// Its kernel in CAST_VARIANTS (ct2x_*: v2's template; ct3_*: v3); empty: the
    /// library's ct2_vec_bf16_e4m3.
    kernel: &'static str,
    /// Rows of its tiles.
    tile_rows: usize,
    /// Columns of its tiles (v2: 128).
    tile_cols: usize,
    /// One tile a block (grid = tiles) instead of one persistent wave.
    one_tile_a_block: bool,
    /// Whole tiles only (v3: rows % tile_rows == 0, cols % tile_cols == 0, out_t 16-byte
    /// aligned); v2 runs the other shapes.
    whole_tiles: bool,
}

/// A variant of v2's template (128 columns, any shape).
const fn ct2v(name: &'static str, kernel: &'static str, tile_rows: usize, one: bool) -> Ct2Variant {
    Ct2Variant {
        name,
        kernel,
        tile_rows,
        tile_cols: 128,
        one_tile_a_block: one,
        whole_tiles: false,
    }
}

/// A v3 register-path variant (ct3_r<TR>_c<TC>_b<BS>_m<MINB>), one tile a block.
const fn ct3v(name: &'static str, kernel: &'static str, tr: usize, tc: usize) -> Ct2Variant {
    Ct2Variant {
        name,
        kernel,
        tile_rows: tr,
        tile_cols: tc,
        one_tile_a_block: true,
        whole_tiles: true,
    }
}

/// The bench variants (bf16 -> e4m3 on the vector path; other casts run v2). v3 (whole
/// tiles; kernels/cast.cu, "cast + transpose, v3"): `v3-r256c128` 256 x 128 tiles (256-byte
/// runs of each transposed row a tile; v2-np's 128 x 128 otherwise), `v3-r512c64` 512 x 64
/// (512-byte runs), `-bs` the transposed tile out by bulk stores (the default `v3` is
/// 256 x 128 with them), `v3-r256c64-*` 256 x 64 tiles at least 4 blocks an SM;
/// `v3-nohint` the default v3 without its cache hints (streaming rowwise stores, an L2
/// evict-first policy on the loads and bulk stores), `v3-cs` / `v3-ef` with one of them.
const CT2_BENCH: &[Ct2Variant] = &[
    ct2v("v2-np", "", 128, true),
    ct2v("v2-tr64", "ct2x_tr64_g0_pf1_cs0_m6", 64, false),
    ct2v("v2-tr64-np", "ct2x_tr64_g0_pf1_cs0_m6", 64, true),
    ct2v("v2-tr64-g16", "ct2x_tr64_g16_pf1_cs0_m6", 64, false),
    ct2v("v2-g16", "ct2x_tr128_g16_pf1_cs0_m3", 128, false),
    ct2v("v2-cs", "ct2x_tr128_g0_pf1_cs1_m3", 128, false),
    ct2v("v2-g32-cs", "ct2x_tr128_g32_pf1_cs1_m3", 128, false),
    ct2v("v2-pf0", "ct2x_tr128_g0_pf0_cs0_m3", 128, false),
    ct2v("v2-m4-np", "ct2x_tr128_g0_pf0_cs0_m4", 128, true),
    ct3v("v3-r256c128", "ct3_r256_c128_b0_m2", 256, 128),
    ct3v("v3-r256c64-m4", "ct3_r256_c64_b0_m4", 256, 64),
    ct3v("v3-r256c64-bs-m4", "ct3_r256_c64_b1_m4", 256, 64),
    ct3v("v3-r512c64", "ct3_r512_c64_b0_m2", 512, 64),
    ct3v("v3-r512c64-bs", "ct3_r512_c64_b1_m2", 512, 64),
    ct3v("v3-nohint", "ct3_r256_c128_b1_m2", 256, 128),
    ct3v("v3-cs", "ct3_r256_c128_b3_m2", 256, 128),
    ct3v("v3-ef", "ct3_r256_c128_b5_m2", 256, 128),
];

/// NVTE_COMM_CAST_TRANSPOSE: the kernel of a quantize with columnwise output, read at each
/// such call. `v3` (default): 256 x 128 tiles, one a block, bulk transposed stores
/// (streaming rowwise stores, an L2 evict-first policy on the loads and bulk stores), for
/// 16-bit inputs whose shape the tiles cover exactly (else v2); `v2`: 128 x 128 tiles
/// (any shape); `v1`: the previous kernel
/// (128 x 64 tiles for rows % 16 == 0 and cols % 8 == 0 with aligned pointers, else one
/// element at a time); `v2-*`, `v3-*`: bench variants (bf16 -> e4m3; other casts run v2,
/// and so do shapes a v3 variant does not tile).
#[derive(Clone, Copy, Debug, PartialEq)]
enum CastTranspose {
    V1,
    V2,
    V3,
    Bench(usize),
}

impl CastTranspose {
    fn from_env() -> Result<Self> {
        let names = cast_transpose_variants();
        Ok(match crate::env::CAST_TRANSPOSE.get(&names)? {
            None | Some(0) => Self::V3,
            Some(1) => Self::V2,
            Some(2) => Self::V1,
            Some(k) => Self::Bench(k - 3),
        })
    }
}

/// Every value NVTE_COMM_CAST_TRANSPOSE takes (v3, v2, v1, then the bench variants).
pub fn cast_transpose_variants() -> Vec<&'static str> {
    let mut v = vec!["v3", "v2", "v1"];
    v.extend(CT2_BENCH.iter().map(|x| x.name));
    v
}

/// The previous cast + transpose (NVTE_COMM_CAST_TRANSPOSE=v1): tiles of 128 rows x 64
/// columns when rows % 16 == 0, cols % 8 == 0 and the pointers are aligned, else one
/// element at a time. `ptrs`: in, out, out_t, scale, amax, scale_inv, columnwise
/// scale_inv, noop.
fn cast_transpose_v1(
    m: &nvrtc::Module,
    dev: &cuda::DeviceInfo,
    (iname, oname): (&str, &str),
    (r, c): (u64, u64),
    ptrs: [DevPtr; 8],
    stream: StreamHandle,
) -> Result<()> {
    let [src, dst, dst_t, scale, amax, sinv, sinv_t, noop] = ptrs;
    let (rows, cols) = (r as usize, c as usize);
    // The tiled kernel: 16-byte input and columnwise accesses, 8-byte rowwise ones, whole
    // 16-row units of the transpose and 8-column units of a row.
    let fast = src.is_aligned(16)
        && dst.is_aligned(8)
        && dst_t.is_aligned(16)
        && cols % 8 == 0
        && rows % 16 == 0;
    // SAFETY (the lookups): `m` is kernels/cast.cu's module.
    let (k, grid, block) = if fast {
        let k = unsafe { Kernel::new(m, &CAST_TRANSPOSE, &[iname, oname])? };
        let (block, per_sm) = launch_shape(m.ctx, k.raw())?;
        // Tiles of 128 rows x (block / 16 * 8) columns.
        let tile_cols = (block as usize / 16) * 8;
        let tiles = rows.div_ceil(128) * cols.div_ceil(tile_cols);
        (k, persistent_grid(tiles, 1, dev.sm_count, per_sm), block)
    } else {
        let k = unsafe { Kernel::new(m, &CAST_TRANSPOSE_SLOW, &[iname, oname])? };
        let (block, per_sm) = launch_shape(m.ctx, k.raw())?;
        let grid = persistent_grid(rows * cols, block as usize, dev.sm_count, per_sm);
        (k, grid, block)
    };
    let params = (src, dst, dst_t, r, c, scale, amax, sinv, sinv_t, noop);
    // SAFETY: `k` is cast_transpose(_slow)_<in>_<out> of kernels/cast.cu, loaded in the
    // stream's context (the caller holds it current); its parameters: in, out, out_t:
    // pointers; rows, cols: u64; scale, amax, scale_inv, columnwise scale_inv, noop:
    // pointers, each NULL or one float. `in` holds rows*cols elements, `out` (NULL when not
    // requested) as many, `out_t` as many (checked by the caller). The tiled kernel runs
    // only with the alignment and divisibility it requires (`fast`), with its own block
    // size (its launch bounds) and any grid (grid-stride over tiles); the slow one takes
    // any shape.
    unsafe { k.launch(((grid, 1, 1), (block, 1, 1)), stream, params) }
}

/// The float-to-float cast of nvte_quantize (times the scale when one is set).
fn cast_plain(input: &Tensor, output: &Tensor, stream: StreamHandle) -> Result<()> {
    let (i, o) = (&input.data, &output.data);
    let Some(oname) = short(o.dtype) else {
        unsupported!(
            "tensor `output` dtype {} is not supported: expected an FP8 type or kNVTEFloat32/BFloat16/Float16",
            o.dtype.name()
        );
    };
    need_data(o, "output")?;
    if i.numel() == 0 {
        return Ok(());
    }
    let guard = ContextGuard::for_stream(stream)?;
    let (k, sms) = kernel(&guard, &QUANTIZE, &[short(i.dtype).unwrap(), oname])?;
    let n = i.numel() as u64;
    let (src, dst) = (i.ptr, o.ptr);
    let (scale, amax, sinv) = (
        opt_ptr(&output.scale),
        opt_ptr(&output.amax),
        opt_ptr(&output.scale_inv),
    );
    let params = (src, dst, n, scale, amax, sinv);
    // SAFETY: `k` is quantize_<in>_<out> of kernels/cast.cu, loaded in the stream's context
    // (held by `guard`); its six parameters (in, out, n, scale, amax, scale_inv) are each a
    // pointer-sized value. The data pointers are the caller's tensors of n elements (TE's
    // contract, NULL checked above); the scalars are NULL or single floats.
    unsafe { launch_elementwise(&k, sms, i.numel(), params, stream) }
}

/// One-float component `b` of tensor `what` that a call needs: set, one element, float32.
fn need_scalar(b: &Buffer, what: &str, param: &str) -> Result<DevPtr> {
    if b.ptr.is_null() {
        invalid!("tensor `{what}` has no {param} (set it: one float32)");
    }
    if b.numel() != 1 || b.dtype != DType::F32 {
        invalid!(
            "tensor `{what}` {param} must be one kNVTEFloat32 element, got {} of shape {}",
            b.dtype.name(),
            b.shape
        );
    }
    Ok(b.ptr)
}

/// TE's nvte_compute_amax(_with_config): output.amax = max|input| (zeroed first, then an
/// atomic max per block; the noop flag skips both).
pub fn compute_amax(
    input: Checked<&Tensor>,
    output: Checked<&Tensor>,
    cfg: &QuantConfig,
    stream: StreamHandle,
) -> Result<()> {
    let (input, output) = (*input, *output);
    let i = &input.data;
    if !is_float_input(i.dtype) {
        unsupported!(
            "tensor `input` dtype {} is not supported: the amax input must be unquantized (kNVTEFloat32, kNVTEBFloat16 or kNVTEFloat16)",
            i.dtype.name()
        );
    }
    if i.ptr.is_null() && i.numel() > 0 {
        invalid!("tensor `input` has no data");
    }
    let amax_buf = if output.amax.ptr.is_null() && !output.columnwise_amax.ptr.is_null() {
        &output.columnwise_amax
    } else {
        &output.amax
    };
    let amax = need_scalar(amax_buf, "output", "amax (kNVTEAmax)")?;
    let guard = ContextGuard::for_stream(stream)?;
    let dev = cuda::device_info(guard.device)?;
    let m = nvrtc::module(&nvrtc::CAST, guard.id, &dev)?;
    let noop = cfg.noop;
    // SAFETY: `m` is kernels/cast.cu's module.
    let z = unsafe { Kernel::new(&m, &ZERO_AMAX, &[])? };
    // SAFETY: zero_amax of kernels/cast.cu in the stream's context (held by `guard`); its
    // two parameters are pointers: amax (one float, checked above) and noop (NULL or one
    // float).
    unsafe { z.launch(((1, 1, 1), (1, 1, 1)), stream, (amax, noop))? };
    if i.numel() == 0 {
        return Ok(());
    }
    // SAFETY: as above.
    let k = unsafe { Kernel::new(&m, &AMAX, &[short(i.dtype).unwrap()])? };
    let (src, n) = (i.ptr, i.numel() as u64);
    let vec: i32 = src.is_aligned(16) as i32;
    let work = if vec == 1 { i.numel() / 8 } else { i.numel() };
    let (block, per_sm) = launch_shape(m.ctx, k.raw())?;
    let grid = if vec == 1 {
        flat_grid(work, block, AMAX_U, dev.sm_count, per_sm)?
    } else {
        persistent_grid(work, block as usize, dev.sm_count, per_sm)
    };
    // SAFETY: amax_<in> of kernels/cast.cu in the stream's context; parameters (in: pointer
    // to the caller's n elements, NULL checked; n: u64; amax: one float; noop: NULL or one
    // float; vec: i32, 1 only for a 16-byte aligned input); any grid (grid-stride), its
    // launch-bounds block. Launched as the dependent of zero_amax: it reads the input while
    // that runs and waits for it (griddepcontrol.wait) before touching amax.
    unsafe { k.launch_dependent(grid, block, stream, (src, n, amax, noop, vec)) }
}

/// TE's nvte_compute_scale_from_amax: output.scale = fp8_max / max(amax, epsilon) (amax 0,
/// inf or NaN: 1; an overflowing scale: float max; optionally a power of 2). Only the
/// scale is written (scale_inv is the next quantize's).
pub fn compute_scale_from_amax(
    output: Checked<&Tensor>,
    cfg: &QuantConfig,
    stream: StreamHandle,
) -> Result<()> {
    let output = *output;
    let d = if output.data.ptr.is_null() && !output.columnwise_data.ptr.is_null() {
        output.columnwise_data.dtype
    } else {
        output.data.dtype
    };
    let Some(max) = fp8_max(d) else {
        invalid!(
            "tensor `output` must be FP8 (kNVTEFloat8E4M3 / kNVTEFloat8E5M2), got {}",
            d.name()
        );
    };
    let amax = need_scalar(&output.amax, "output", "amax (kNVTEAmax)")?;
    let scale = need_scalar(&output.scale, "output", "scale (kNVTEScale)")?;
    if !cfg.amax_epsilon.is_finite() || cfg.amax_epsilon < 0.0 {
        invalid!(
            "quantization config amax_epsilon = {} must be finite and >= 0",
            cfg.amax_epsilon
        );
    }
    let guard = ContextGuard::for_stream(stream)?;
    let (k, _) = kernel(&guard, &SCALE_FROM_AMAX, &[])?;
    let (pow2, eps, noop) = (cfg.force_pow_2_scales as i32, cfg.amax_epsilon, cfg.noop);
    // SAFETY: scale_from_amax of kernels/cast.cu in the stream's context; parameters: amax
    // and scale (one float each, checked above), fp8_max (f32), pow2 (i32), epsilon (f32),
    // noop (NULL or one float).
    unsafe {
        k.launch(
            ((1, 1, 1), (1, 1, 1)),
            stream,
            (amax, scale, max, pow2, eps, noop),
        )
    }
}

/// How the delayed-scaling recipe reduces the amax history (TE's amax_compute_algo).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AmaxAlgo {
    MostRecent = 0,
    Max = 1,
}

impl AmaxAlgo {
    /// TE's names: "max" and "most_recent".
    pub fn parse(s: &str) -> Result<AmaxAlgo> {
        match s {
            "max" => Ok(AmaxAlgo::Max),
            "most_recent" => Ok(AmaxAlgo::MostRecent),
            other => invalid!(
                "argument `amax_compute_algo` = {other:?} is not supported: expected \"max\" or \"most_recent\""
            ),
        }
    }
}

/// (history_length, num_scales) of an amax history: `[len]` (one scale) or `[len, num_scales]`.
pub fn history_dims(h: &Buffer, what: &str) -> Result<(usize, usize)> {
    let s = h.shape.as_slice();
    let d = match s.len() {
        1 => (s[0], 1),
        2 => (s[0], s[1]),
        n => invalid!(
            "tensor `{what}` has shape {} ({n} dims): expected [history_length] or [history_length, num_scales]",
            h.shape
        ),
    };
    if h.dtype != DType::F32 {
        invalid!(
            "tensor `{what}` must be kNVTEFloat32, got {}",
            h.dtype.name()
        );
    }
    if d.0 == 0 {
        invalid!("tensor `{what}` has history length 0 (shape {})", h.shape);
    }
    Ok(d)
}

/// TE's nvte_delayed_scaling_recipe_amax_and_scale_update: roll the history by -1 into
/// `updated_history` (its newest row zeroed), amax = "max" of the history or its
/// "most_recent" row, updated_scale = fp8_max * 2^-margin / amax (the old scale when amax
/// is 0, inf or NaN; float max when that overflows). In place allowed.
#[allow(clippy::too_many_arguments)]
pub fn delayed_scaling_update(
    history: Checked<&Tensor>,
    scale: Checked<&Tensor>,
    updated_history: Checked<&Tensor>,
    updated_scale: Checked<&Tensor>,
    algo: AmaxAlgo,
    fp8_dtype: DType,
    margin: f32,
    stream: StreamHandle,
) -> Result<()> {
    let (history, scale) = (*history, *scale);
    let (updated_history, updated_scale) = (*updated_history, *updated_scale);
    let (len, ns) = history_dims(&history.data, "amax_history")?;
    let (ulen, uns) = history_dims(&updated_history.data, "updated_amax_history")?;
    if (ulen, uns) != (len, ns) {
        invalid!(
            "tensor `updated_amax_history` has shape {} but `amax_history` has {}: they must match",
            updated_history.data.shape,
            history.data.shape
        );
    }
    for (t, what) in [(scale, "scale"), (updated_scale, "updated_scale")] {
        if t.data.dtype != DType::F32 || t.data.numel() != ns {
            invalid!(
                "tensor `{what}` must be {ns} kNVTEFloat32 elements (one per history column), got {} of shape {}",
                t.data.dtype.name(),
                t.data.shape
            );
        }
    }
    let Some(max) = fp8_max(fp8_dtype) else {
        invalid!(
            "argument `fp8_dtype` = {} is not an FP8 type: expected kNVTEFloat8E4M3 or kNVTEFloat8E5M2",
            fp8_dtype.name()
        );
    };
    if !margin.is_finite() {
        invalid!("argument `margin` = {margin} must be finite");
    }
    for (b, what) in [
        (&history.data, "amax_history"),
        (&scale.data, "scale"),
        (&updated_history.data, "updated_amax_history"),
        (&updated_scale.data, "updated_scale"),
    ] {
        need_data(b, what)?;
    }
    if ns == 0 {
        return Ok(());
    }
    // TE: fp8_max * 2^-margin in float.
    let scaled_max = max * 2f32.powf(-margin);
    let guard = ContextGuard::for_stream(stream)?;
    let (k, _) = kernel(&guard, &DELAYED_SCALING_UPDATE, &[])?;
    let (h, s, uh, us) = (
        history.data.ptr,
        scale.data.ptr,
        updated_history.data.ptr,
        updated_scale.data.ptr,
    );
    let (l, stride, a) = (len as u64, ns as u64, algo as i32);
    let params = (h, s, uh, us, l, stride, a, scaled_max);
    let grid = u32::try_from(ns).map_err(|_| {
        crate::error::Error::invalid(format!("num_scales = {ns} exceeds the grid limit"))
    })?;
    // SAFETY: delayed_scaling_update of kernels/cast.cu in the stream's context; parameters:
    // four pointers (histories of len*ns floats, scales of ns floats: shapes checked above,
    // NULL checked), len and stride (u64), algo (i32), scaled_max (f32). One block per column.
    unsafe { k.launch(((grid, 1, 1), (256, 1, 1)), stream, params) }
}

/// TE's nvte_transpose: output [cols, rows] = input [rows, cols]^T, both 2-D, same dtype
/// (element sizes 1, 2 and 4 bytes).
pub fn transpose(
    input: Checked<&Tensor>,
    output: Checked<&Tensor>,
    stream: StreamHandle,
) -> Result<()> {
    let (input, output) = (*input, *output);
    let (i, o) = (&input.data, &output.data);
    let (is, os) = (i.shape.as_slice(), o.shape.as_slice());
    if is.len() != 2 || os.len() != 2 {
        invalid!(
            "nvte_transpose takes 2-D tensors: `input` has shape {}, `transposed_output` {}",
            i.shape,
            o.shape
        );
    }
    if os[0] != is[1] || os[1] != is[0] {
        invalid!(
            "tensor `transposed_output` has shape {} but `input` is {}: expected [{}, {}]",
            o.shape,
            i.shape,
            is[1],
            is[0]
        );
    }
    if i.dtype != o.dtype {
        invalid!(
            "tensor `input` is {} but `transposed_output` is {}: they must match",
            i.dtype.name(),
            o.dtype.name()
        );
    }
    let (esize, size_name) = match i.dtype.bits() {
        8 => (1, "1"),
        16 => (2, "2"),
        32 => (4, "4"),
        _ => unsupported!(
            "nvte_transpose of {} is not supported (1-, 2- and 4-byte elements)",
            i.dtype.name()
        ),
    };
    need_data(i, "input")?;
    need_data(o, "transposed_output")?;
    if i.numel() == 0 {
        return Ok(());
    }
    let guard = ContextGuard::for_stream(stream)?;
    let (src, dst, r, c) = (i.ptr, o.ptr, is[0] as u64, is[1] as u64);
    // 16-byte vectors of 16 / esize elements along both dimensions.
    let v = 16 / esize;
    let vec = src.is_aligned(16) && dst.is_aligned(16) && is[0] % v == 0 && is[1] % v == 0;
    let b = if vec { &TRANSPOSE_VEC } else { &TRANSPOSE };
    let (k, sms) = kernel(&guard, b, &[size_name])?;
    let (block, per_sm) = launch_shape(guard.id, k.raw())?;
    // transpose_vec: tiles of 8 v rows x 128 / esize columns; transpose: 32 x 32.
    let (tr, tc) = if vec { (8 * v, 128 / esize) } else { (32, 32) };
    let tiles = is[0].div_ceil(tr) * is[1].div_ceil(tc);
    let grid = persistent_grid(tiles, 1, sms, per_sm);
    // SAFETY: transpose(_vec)_b<size> of kernels/cast.cu in the stream's context, for the
    // tensors' element size; parameters: in and out (pointers to rows*cols elements each,
    // shapes and NULL checked above), rows and cols (u64). The vector kernel only with
    // 16-byte aligned pointers and both dimensions multiples of its vector width; both
    // take any grid (grid-stride over tiles) with their launch-bounds block (256).
    unsafe { k.launch(((grid, 1, 1), (block, 1, 1)), stream, (src, dst, r, c)) }
}

/// TE's nvte_dequantize: output = cast(input * input.scale_inv) from FP8.
pub fn dequantize(
    input: Checked<&Tensor>,
    output: Checked<&Tensor>,
    stream: StreamHandle,
) -> Result<()> {
    let (input, output) = (*input, *output);
    let (i, o) = (&input.data, &output.data);
    if i.numel() != o.numel() {
        invalid!(
            "tensor `input` has {} elements ({}) but `output` has {} ({})",
            i.numel(),
            i.shape,
            o.numel(),
            o.shape
        );
    }
    if !i.dtype.is_fp8() {
        unsupported!(
            "tensor `input` dtype {} is not supported: expected kNVTEFloat8E4M3 or kNVTEFloat8E5M2",
            i.dtype.name()
        );
    }
    if !matches!(o.dtype, DType::F32 | DType::BF16 | DType::F16) {
        unsupported!(
            "tensor `output` dtype {} is not supported: expected kNVTEFloat32, kNVTEBFloat16 or kNVTEFloat16",
            o.dtype.name()
        );
    }
    need_data(i, "input")?;
    need_data(o, "output")?;
    if Tensor::scalar_ptr(&input.scale_inv).is_none() {
        invalid!(
            "tensor `input` is {} but has no scale_inv (set kNVTERowwiseScaleInv)",
            i.dtype.name()
        );
    }
    if i.numel() == 0 {
        return Ok(());
    }
    let guard = ContextGuard::for_stream(stream)?;
    let names = [short(i.dtype).unwrap(), short(o.dtype).unwrap()];
    let (k, sms) = kernel(&guard, &DEQUANTIZE, &names)?;
    let n = i.numel() as u64;
    let (src, dst, sinv) = (i.ptr, o.ptr, opt_ptr(&input.scale_inv));
    let vec: i32 = (src.is_aligned(16) && dst.is_aligned(16)) as i32;
    let work = if vec == 1 { i.numel() / 16 } else { i.numel() };
    let (block, per_sm) = launch_shape(guard.id, k.raw())?;
    let grid = persistent_grid(work, block as usize, sms, per_sm);
    // SAFETY: `k` is dequantize_vec_<in>_<out> of kernels/cast.cu, loaded in the stream's
    // context (held by `guard`); its five parameters: in, out, n, scale_inv: pointer-sized
    // values; vec: i32, 1 only when both pointers are 16-byte aligned. The data pointers
    // are the caller's tensors of n elements (TE's contract, NULL checked above);
    // scale_inv is a single float (checked above). Any grid (grid-stride).
    unsafe {
        k.launch(
            ((grid, 1, 1), (block, 1, 1)),
            stream,
            (src, dst, n, sinv, vec),
        )
    }
}

/// Fill a tensor with uniform random values in [lo, hi) from a counter-based generator:
/// the same (seed, size) always gives the same data.
pub fn fill_uniform(
    t: Checked<&Tensor>,
    seed: u64,
    lo: f32,
    hi: f32,
    stream: StreamHandle,
) -> Result<()> {
    let t = *t;
    let b = &t.data;
    let Some(name) = short(b.dtype) else {
        unsupported!(
            "tensor dtype {} is not supported by fill_uniform: expected a float type",
            b.dtype.name()
        );
    };
    if !(lo.is_finite() && hi.is_finite() && lo <= hi) {
        invalid!("arguments `lo` = {lo}, `hi` = {hi} must be finite with lo <= hi");
    }
    need_data(b, "tensor")?;
    if b.numel() == 0 {
        return Ok(());
    }
    let guard = ContextGuard::for_stream(stream)?;
    let (k, sms) = kernel(&guard, &FILL_UNIFORM, &[name])?;
    let n = b.numel() as u64;
    let dst = b.ptr;
    // SAFETY: `k` is fill_uniform_<type> of kernels/cast.cu, loaded in the stream's context
    // (held by `guard`); its five parameters: out, n: 8 bytes; seed: u64; lo, hi: f32.
    // `dst` is the caller's tensor of n elements (TE's contract, NULL checked above).
    unsafe { launch_elementwise(&k, sms, b.numel(), (dst, n, seed, lo, hi), stream) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::Shape;

    fn buf(dtype: DType, dims: &[usize]) -> Buffer {
        Buffer::new(DevPtr::new(0x1000), dtype, Shape::new(dims).unwrap()).unwrap()
    }

    #[test]
    fn flat_2d_view_is_tes() {
        assert_eq!(flat_2d(&buf(DType::BF16, &[])), (1, 1));
        assert_eq!(flat_2d(&buf(DType::BF16, &[7])), (1, 7));
        assert_eq!(flat_2d(&buf(DType::BF16, &[3, 5])), (3, 5));
        assert_eq!(flat_2d(&buf(DType::BF16, &[2, 3, 4])), (6, 4));
    }

    #[test]
    fn columnwise_shape_is_the_transpose() {
        assert!(check_columnwise_shape(&buf(DType::E4M3, &[64, 32]), 32, 64).is_ok());
        assert!(check_columnwise_shape(&buf(DType::E4M3, &[4, 2, 3]), 6, 4).is_ok());
        assert!(check_columnwise_shape(&buf(DType::E4M3, &[7]), 1, 7).is_ok());
        let e = check_columnwise_shape(&buf(DType::E4M3, &[32, 64]), 32, 64).unwrap_err();
        assert!(e.to_string().contains("[64, 32]"), "{e}");
        assert!(check_columnwise_shape(&buf(DType::E4M3, &[64, 31]), 32, 64).is_err());
        assert!(check_columnwise_shape(&buf(DType::E4M3, &[0]), 0, 16).is_ok());
    }

    #[test]
    fn history_shapes_and_algos() {
        assert_eq!(history_dims(&buf(DType::F32, &[16]), "h").unwrap(), (16, 1));
        assert_eq!(
            history_dims(&buf(DType::F32, &[16, 3]), "h").unwrap(),
            (16, 3)
        );
        assert!(history_dims(&buf(DType::F32, &[2, 3, 4]), "h").is_err());
        assert!(history_dims(&buf(DType::F32, &[0, 3]), "h").is_err());
        assert!(history_dims(&buf(DType::BF16, &[16]), "h").is_err());
        assert_eq!(AmaxAlgo::parse("max").unwrap(), AmaxAlgo::Max);
        assert_eq!(
            AmaxAlgo::parse("most_recent").unwrap(),
            AmaxAlgo::MostRecent
        );
        assert!(AmaxAlgo::parse("MAX").is_err());
        assert_eq!(fp8_max(DType::E4M3), Some(448.0));
        assert_eq!(fp8_max(DType::E5M2), Some(57344.0));
        assert_eq!(fp8_max(DType::BF16), None);
    }

    #[test]
    fn cast_transpose_variants_exist_in_the_source() {
        let names = cast_transpose_variants();
        assert_eq!(&names[..3], &["v3", "v2", "v1"]);
        let mut sorted = names.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(sorted.len(), names.len(), "duplicate variant names");
        let src = CAST_VARIANTS.code;
        assert!(src.starts_with("#define TE_COMM_CT2_VARIANTS"));
        for v in CT2_BENCH {
            if v.kernel.is_empty() {
                assert!(v.name.starts_with("v2-"), "{}", v.name);
                assert_eq!((v.tile_rows, v.tile_cols), (CT2_TILE_ROWS, 128));
                continue;
            }
            // ct2x_tr<TR>_g<G>_pf<PF>_cs<CS>_m<MINB> <- CT2X(TR, G, PF, CS, MINB),
            // ct3_r<TR>_c<TC>_b<BS>_m<MINB> <- CT3(TR, TC, BS, MINB)
            let (family, rest) = v.kernel.split_once('_').unwrap();
            let p: Vec<&str> = rest.split('_').collect();
            let args: Vec<&str> = p
                .iter()
                .map(|x| x.trim_start_matches(char::is_alphabetic))
                .collect();
            let num = |i: usize| args[i].parse::<usize>().unwrap();
            assert_eq!(num(0), v.tile_rows, "{}", v.kernel);
            match family {
                "ct2x" => {
                    assert!(v.name.starts_with("v2-"), "{}", v.name);
                    assert_eq!(p[0], format!("tr{}", v.tile_rows), "{}", v.kernel);
                    assert_eq!(v.tile_cols, 128);
                    assert!(!v.whole_tiles, "{}", v.name);
                }
                "ct3" => {
                    assert!(v.name.starts_with("v3-"), "{}", v.name);
                    assert_eq!(num(1), v.tile_cols, "{}", v.kernel);
                    assert!(v.whole_tiles && v.one_tile_a_block);
                }
                _ => panic!("{}: unknown kernel family", v.kernel),
            }
            let inst = format!("{}({})", family.to_uppercase(), args.join(", "));
            assert!(src.contains(&inst), "{} has no instance {inst}", v.kernel);
        }
        assert!(nvrtc::CAST.code.contains("#define CT2_TR 128"));
    }

    /// The Python lists of NVTE_COMM_CAST_TRANSPOSE values (the sweep of
    /// bench/quantize_bench.py --ct-variants all, the bit-exact tests of
    /// python/tests/test_quantize.py) name every variant.
    #[test]
    fn cast_transpose_variants_are_benched_and_tested() {
        let bench = include_str!("../bench/quantize_bench.py");
        let tests = include_str!("../python/tests/test_quantize.py");
        for name in cast_transpose_variants() {
            let quoted = format!("\"{name}\"");
            assert!(
                bench.contains(&quoted),
                "bench/quantize_bench.py CT_ALL lacks {name}"
            );
            assert!(
                tests.contains(&quoted),
                "python/tests/test_quantize.py lacks {name}"
            );
        }
    }
}
