//! FP8 block scaling (TE's `Float8BlockScaling` recipe): the checked plans and typed
//! launches of `kernels/block_quant.cu`'s quantize (rowwise and / or columnwise from one
//! read of each 128x128 tile) and dequantize. The layouts are `crate::tensor`'s
//! (`BlockLayout`: TE's GEMM-ready and compact formats).
use super::{ContextGuard, flat_2d, launch_shape, persistent_grid, short};
use crate::cuda::{self, Binding, DevPtr, Kernel, KernelArg, ParamInfo, Signature, StreamHandle};
use crate::cuda::{nvrtc, nvrtc::Source};
use crate::error::Result;
use crate::tensor::{BlockLayout, BlockMode, Buffer, DType, Direction, ScaleFormat, Tensor};
use crate::{invalid, unsupported};
use std::sync::Mutex;

/// kernels/block_quant.cu.
pub const BLOCK_QUANT: Source = Source {
    name: "block_quant.cu",
    code: include_str!("../../kernels/block_quant.cu"),
};

/// The sizes and options of a quantization (kernels/block_quant.cu's BlockQuantArgs, same
/// layout: 64 bytes, asserted there and in this module's tests).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct BlockQuantArgs {
    pub rows: u64,
    pub cols: u64,
    /// Rowwise scale-inverse strides: block (rb, cb) at rb * s_r + cb * s_c.
    pub s_r: u64,
    pub s_c: u64,
    /// Columnwise scale-inverse strides.
    pub t_r: u64,
    pub t_c: u64,
    pub eps: f32,
    pub pow2: i32,
    /// 0: no columnwise output, 1: transposed ([cols, rows]), 2: compact (the input's layout).
    pub col_mode: i32,
    pub pad: i32,
}

// SAFETY: a repr(C) struct passed by value: the Struct class and its own size.
unsafe impl KernelArg for BlockQuantArgs {
    const INFO: ParamInfo = ParamInfo::by_value::<BlockQuantArgs>();
}

/// block_quantize_<1d|2d>_<in>_<out>(const I::T *in, u8 *out, u8 *out_t, float *sinv,
/// float *sinv_t, const float *noop, BlockQuantArgs args)
type QuantParams = (
    DevPtr,
    DevPtr,
    DevPtr,
    DevPtr,
    DevPtr,
    DevPtr,
    BlockQuantArgs,
);
// SAFETY: the parameter list of every kernel of kernels/block_quant.cu the pattern names
// (checked by tests/kernel_signatures.rs).
const BLOCK_QUANTIZE: Binding<QuantParams> = unsafe {
    Binding::new(
        &BLOCK_QUANT,
        "block_quantize_{}_{}_{}",
        "quantize (FP8 block scaling)",
    )
};
/// block_dequantize_<in>_<out>(const u8 *in, O::T *out, const float *sinv, u64 rows, u64
/// cols, int transposed, u64 br, u64 bc, u64 s_r, u64 s_c)
type DequantParams = (DevPtr, DevPtr, DevPtr, u64, u64, i32, u64, u64, u64, u64);
// SAFETY: as above.
const BLOCK_DEQUANTIZE: Binding<DequantParams> = unsafe {
    Binding::new(
        &BLOCK_QUANT,
        "block_dequantize_{}_{}",
        "dequantize (FP8 block scaling)",
    )
};

/// The kernel bindings of this module (checked against kernels/block_quant.cu by
/// tests/kernel_signatures.rs).
pub fn kernel_signatures() -> Vec<Signature> {
    vec![BLOCK_QUANTIZE.signature(), BLOCK_DEQUANTIZE.signature()]
}

/// Threads of a quantize block and the tile it quantizes (kernels/block_quant.cu).
const THREADS: u32 = 256;
const TILE: usize = BlockMode::LEN;

/// Options of a block quantization (TE's NVTEQuantizationConfig, resolved for a call).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct BlockQuantConfig {
    /// Round each scale down to a power of 2 (kNVTEQuantizationConfigForcePow2Scales).
    pub force_pow_2_scales: bool,
    /// Lower bound of each block's amax (kNVTEQuantizationConfigAmaxEpsilon).
    pub amax_epsilon: f32,
    /// Device float: the kernel does nothing when it holds 1 (NULL: none).
    pub noop: DevPtr,
    /// The layout to write (kNVTEQuantizationConfigFloat8BlockScaleTensorFormat; 2D
    /// tensors have one layout).
    pub format: ScaleFormat,
}

/// A checked block quantization: what the kernel is given.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct QuantizePlan {
    pub mode: BlockMode,
    pub in_dtype: DType,
    pub out_dtype: DType,
    pub rows: usize,
    pub cols: usize,
    pub row: Option<BlockLayout>,
    pub col: Option<BlockLayout>,
    /// in, out, out_t, sinv, sinv_t (NULL where a direction is absent)
    pub ptrs: [DevPtr; 5],
}

impl QuantizePlan {
    /// The kernel's arguments.
    pub fn args(&self, cfg: &BlockQuantConfig) -> BlockQuantArgs {
        let (s_r, s_c) = self.row.map_or((0, 0), |l| l.scale_strides);
        let (t_r, t_c) = self.col.map_or((0, 0), |l| l.scale_strides);
        let col_mode = match self.col {
            None => 0,
            Some(l) if l.transposed => 1,
            Some(_) => 2,
        };
        BlockQuantArgs {
            rows: self.rows as u64,
            cols: self.cols as u64,
            s_r: s_r as u64,
            s_c: s_c as u64,
            t_r: t_r as u64,
            t_c: t_c as u64,
            eps: cfg.amax_epsilon,
            pow2: cfg.force_pow_2_scales as i32,
            col_mode,
            pad: 0,
        }
    }
    /// The scale format the quantization writes (what the output records).
    pub fn format(&self) -> ScaleFormat {
        self.row
            .or(self.col)
            .map_or(ScaleFormat::GemmReady, |l| l.format)
    }
}

/// The shape TE gives the data of layout `l` of an input of dimensions `dims`: the input's,
/// or [last, leading...] when transposed.
fn data_dims(l: &BlockLayout, dims: &[usize]) -> Vec<usize> {
    match dims.split_last() {
        Some((&last, lead)) if l.transposed => {
            std::iter::once(last).chain(lead.iter().copied()).collect()
        }
        _ => dims.to_vec(),
    }
}

fn check_aligned(b: &Buffer, align: usize, what: &str) -> Result<()> {
    if !b.ptr.is_aligned(align) {
        invalid!(
            "{what} at {:p} is not {align}-byte aligned (FP8 block-scaling kernels need it)",
            b.ptr.as_void()
        );
    }
    Ok(())
}

/// One direction of the output: its layout (None: absent), checked against the input's
/// dimensions, the FP8 type and the configured format.
fn output_direction(
    out: &Tensor,
    dir: Direction,
    dims: &[usize],
    format: ScaleFormat,
) -> Result<Option<BlockLayout>> {
    let Some(l) = out.block_layout(dir)? else {
        return Ok(None);
    };
    let (data, sinv) = out.direction_buffers(dir);
    if !data.dtype.is_fp8() {
        unsupported!(
            "tensor `output` {} data is {}: a block-scaled quantization writes FP8 (kNVTEFloat8E4M3 / kNVTEFloat8E5M2)",
            dir.name(),
            data.dtype.name()
        );
    }
    let want = data_dims(&l, dims);
    if data.shape.as_slice() != want.as_slice() {
        invalid!(
            "tensor `output` {} data has shape {} but the input {dims:?} needs {want:?} ({} layout)",
            dir.name(),
            data.shape,
            l.format.name()
        );
    }
    if l.mode == BlockMode::OneD && l.format != format {
        let other = BlockLayout::new(l.mode, dir, format, l.rows, l.cols);
        invalid!(
            "kNVTEQuantizationConfigFloat8BlockScaleTensorFormat is {} but tensor `output` {} data {} with scale_inv {} is {}: {} needs data {:?} and scale_inv {:?}",
            format.name(),
            dir.name(),
            data.shape,
            sinv.shape,
            l.format.name(),
            format.name(),
            data_dims(&other, dims),
            other.scale_shape
        );
    }
    check_aligned(data, 16, &format!("tensor `output` {} data", dir.name()))?;
    check_aligned(
        sinv,
        4,
        &format!("tensor `output` {} scale_inv", dir.name()),
    )?;
    Ok(Some(l))
}

/// The checks of nvte_quantize into a block-scaled `output` (TE's, and what TE's
/// `Float8BlockQuantizer.is_quantizable` requires: rows and the last dimension multiples
/// of 128); None for an empty input (nothing to do). Nothing is touched on an error.
pub fn plan_quantize(
    input: &Tensor,
    output: &Tensor,
    cfg: &BlockQuantConfig,
) -> Result<Option<QuantizePlan>> {
    let Some(mode) = output.block_mode() else {
        invalid!("tensor `output` is not block-scaled");
    };
    let i = &input.data;
    if !i.dtype.is_high_precision() {
        unsupported!(
            "tensor `input` dtype {} is not supported: a block-scaled quantization reads kNVTEFloat32, kNVTEBFloat16 or kNVTEFloat16",
            i.dtype.name()
        );
    }
    let dims = i.shape.as_slice().to_vec();
    let out = Tensor {
        block_format: cfg.format,
        ..output.clone()
    };
    let row = output_direction(&out, Direction::Rowwise, &dims, cfg.format)?;
    let col = output_direction(&out, Direction::Columnwise, &dims, cfg.format)?;
    let out_dtype = match (row, col) {
        (None, None) => invalid!(
            "tensor `output` has neither rowwise nor columnwise data (set kNVTERowwiseData and / or kNVTEColumnwiseData)"
        ),
        (Some(_), Some(_)) if output.data.dtype != output.columnwise_data.dtype => invalid!(
            "tensor `output` rowwise data is {} but its columnwise data is {}: both must be the same FP8 type",
            output.data.dtype.name(),
            output.columnwise_data.dtype.name()
        ),
        (Some(_), _) => output.data.dtype,
        (None, Some(_)) => output.columnwise_data.dtype,
    };
    if i.numel() == 0 {
        return Ok(None);
    }
    let (rows, cols) = flat_2d(i);
    if dims.len() < 2 || rows % TILE != 0 || cols % TILE != 0 {
        invalid!(
            "tensor `input` of shape {} ([{rows}, {cols}] as 2-D) cannot be quantized with {}: the last dimension and the row count (the product of the leading dimensions) must be multiples of {TILE}, with at least 2 dimensions (TE's Float8BlockQuantizer.is_quantizable)",
            i.shape,
            mode.name()
        );
    }
    if i.ptr.is_null() {
        invalid!(
            "tensor `input` has {} elements but a NULL data pointer",
            i.numel()
        );
    }
    check_aligned(i, 16, "tensor `input` data")?;
    if (rows / TILE).saturating_mul(cols / TILE) > i32::MAX as usize {
        invalid!(
            "tensor `input` of shape {} has too many 128x128 tiles",
            i.shape
        );
    }
    let (o, ot) = (&output.data, &output.columnwise_data);
    let ptr = |l: Option<BlockLayout>, b: &Buffer| if l.is_some() { b.ptr } else { DevPtr::NULL };
    Ok(Some(QuantizePlan {
        mode,
        in_dtype: i.dtype,
        out_dtype,
        rows,
        cols,
        row,
        col,
        ptrs: [
            i.ptr,
            ptr(row, o),
            ptr(col, ot),
            ptr(row, &output.scale_inv),
            ptr(col, &output.columnwise_scale_inv),
        ],
    }))
}

/// Raise the function's dynamic shared-memory limit to `bytes` once per (context, function).
fn allow_shared(ctx: u64, f: cudarc::driver::sys::CUfunction, bytes: u32) -> Result<()> {
    use cudarc::driver::sys as cu;
    static DONE: Mutex<Vec<(u64, usize, u32)>> = Mutex::new(Vec::new());
    let key = (ctx, f as usize, bytes);
    let mut done = DONE.lock().unwrap_or_else(|e| e.into_inner());
    if done.contains(&key) {
        return Ok(());
    }
    // SAFETY: `f` is a function of a loaded module; a plain attribute.
    cuda::check(
        unsafe {
            cu::cuFuncSetAttribute(
                f,
                cu::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                bytes as i32,
            )
        },
        "cuFuncSetAttribute(block_quantize dynamic shared memory)",
    )?;
    done.push(key);
    Ok(())
}

/// TE's nvte_quantize into an NVTE_BLOCK_SCALING_1D / _2D tensor: FP8 rowwise data and / or
/// columnwise data (transposed, or 1D compact: the input's layout) with their float32
/// scale inverses in TE's layout, from one read of the input. Returns the format written.
pub fn quantize(
    input: &Tensor,
    output: &Tensor,
    cfg: &BlockQuantConfig,
    stream: StreamHandle,
) -> Result<ScaleFormat> {
    let Some(plan) = plan_quantize(input, output, cfg)? else {
        return Ok(cfg.format);
    };
    let guard = ContextGuard::for_stream(stream)?;
    let dev = cuda::device_info(guard.device)?;
    let m = nvrtc::module(&BLOCK_QUANT, guard.id, &dev)?;
    let mode = match plan.mode {
        BlockMode::OneD => "1d",
        BlockMode::TwoD => "2d",
    };
    let names = [
        mode,
        short(plan.in_dtype).unwrap(),
        short(plan.out_dtype).unwrap(),
    ];
    // SAFETY: `m` is kernels/block_quant.cu's module, the binding's source.
    let k = unsafe { Kernel::new(&m, &BLOCK_QUANTIZE, &names)? };
    let smem = (TILE * TILE * plan.in_dtype.bits() / 8) as u32;
    allow_shared(guard.id, k.raw(), smem)?;
    let grid = ((plan.rows / TILE) * (plan.cols / TILE)) as u32;
    let [src, dst, dst_t, sinv, sinv_t] = plan.ptrs;
    let params = (src, dst, dst_t, sinv, sinv_t, cfg.noop, plan.args(cfg));
    // SAFETY: `k` is block_quantize_<mode>_<in>_<out> of kernels/block_quant.cu, loaded in
    // the stream's context (held by `guard`), with its dynamic shared memory allowed
    // (`smem`: one 128x128 input tile). Checked by plan_quantize: the input holds rows *
    // cols elements, rows and cols multiples of 128, 16-byte aligned; each FP8 output
    // present holds rows * cols bytes (16-byte aligned) with its scale_inv of TE's shape
    // for the strides given (4-byte aligned), absent ones NULL; noop NULL or one float.
    // The grid is one block of THREADS a tile (the kernel's launch bounds).
    unsafe { k.launch_shared(((grid, 1, 1), (THREADS, 1, 1)), smem, stream, params)? };
    Ok(plan.format())
}

/// A checked block dequantization.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DequantizePlan {
    pub layout: BlockLayout,
    pub in_dtype: DType,
    pub out_dtype: DType,
    /// in, out, scale_inv
    pub ptrs: [DevPtr; 3],
}

/// The checks of nvte_dequantize of a block-scaled `input` (its rowwise data, else its
/// columnwise data) into the high-precision `output` of the same logical shape; None for
/// an empty input.
pub fn plan_dequantize(input: &Tensor, output: &Tensor) -> Result<Option<DequantizePlan>> {
    let l = match input.block_layout(Direction::Rowwise)? {
        Some(l) => l,
        None => match input.block_layout(Direction::Columnwise)? {
            Some(l) => l,
            None => invalid!("tensor `input` has neither rowwise nor columnwise data"),
        },
    };
    let (data, sinv) = input.direction_buffers(l.direction);
    let o = &output.data;
    if !data.dtype.is_fp8() {
        unsupported!(
            "tensor `input` {} data dtype {} is not supported: expected kNVTEFloat8E4M3 or kNVTEFloat8E5M2",
            l.direction.name(),
            data.dtype.name()
        );
    }
    if !o.dtype.is_high_precision() {
        unsupported!(
            "tensor `output` dtype {} is not supported: expected kNVTEFloat32, kNVTEBFloat16 or kNVTEFloat16",
            o.dtype.name()
        );
    }
    if flat_2d(o) != (l.rows, l.cols) || o.numel() != l.rows * l.cols {
        invalid!(
            "tensor `output` has shape {} but the input is [{}, {}] as 2-D",
            o.shape,
            l.rows,
            l.cols
        );
    }
    if o.numel() == 0 {
        return Ok(None);
    }
    if o.ptr.is_null() {
        invalid!(
            "tensor `output` has {} elements but a NULL data pointer",
            o.numel()
        );
    }
    let inner = l.data_shape_2d()[1];
    if inner % 4 != 0 {
        unsupported!(
            "tensor `input` {} data rows of {inner} values: dequantization needs a multiple of 4",
            l.direction.name()
        );
    }
    check_aligned(data, 4, "tensor `input` data")?;
    check_aligned(sinv, 4, "tensor `input` scale_inv")?;
    check_aligned(o, o.dtype.bits() / 8, "tensor `output` data")?;
    Ok(Some(DequantizePlan {
        layout: l,
        in_dtype: data.dtype,
        out_dtype: o.dtype,
        ptrs: [data.ptr, o.ptr, sinv.ptr],
    }))
}

/// TE's nvte_dequantize of a block-scaled tensor: output = cast(value * its block's
/// scale_inv), from the rowwise data (else the columnwise data).
pub fn dequantize(input: &Tensor, output: &Tensor, stream: StreamHandle) -> Result<()> {
    let Some(p) = plan_dequantize(input, output)? else {
        return Ok(());
    };
    let guard = ContextGuard::for_stream(stream)?;
    let dev = cuda::device_info(guard.device)?;
    let m = nvrtc::module(&BLOCK_QUANT, guard.id, &dev)?;
    let names = [short(p.in_dtype).unwrap(), short(p.out_dtype).unwrap()];
    // SAFETY: `m` is kernels/block_quant.cu's module, the binding's source.
    let k = unsafe { Kernel::new(&m, &BLOCK_DEQUANTIZE, &names)? };
    let (block, per_sm) = launch_shape(guard.id, k.raw())?;
    let l = p.layout;
    let grid = persistent_grid(l.rows * l.cols / 4, block as usize, dev.sm_count, per_sm);
    let (br, bc) = l.block_dims();
    let (s_r, s_c) = l.scale_strides;
    let [src, dst, sinv] = p.ptrs;
    let params = (
        src,
        dst,
        sinv,
        l.rows as u64,
        l.cols as u64,
        l.transposed as i32,
        br as u64,
        bc as u64,
        s_r as u64,
        s_c as u64,
    );
    // SAFETY: `k` is block_dequantize_<in>_<out> of kernels/block_quant.cu, loaded in the
    // stream's context (held by `guard`). Checked by plan_dequantize: the input data holds
    // rows * cols FP8 values in the layout `transposed` states (stored rows a multiple of 4
    // long, 4-byte aligned), its scale_inv has TE's shape for the strides and block dims
    // given (every index in range), the output holds rows * cols elements. Any grid
    // (grid-stride).
    unsafe { k.launch(((grid, 1, 1), (block, 1, 1)), stream, params) }
}
