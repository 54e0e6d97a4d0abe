//! FP8 block scaling (TE's `Float8BlockScaling` recipe): the checked plans and typed
//! launches of `kernels/block_quant.cu`'s quantize (rowwise and / or columnwise from one
//! read of each 128x128 tile) and dequantize. The layouts are `crate::tensor`'s
//! (`BlockLayout`: TE's GEMM-ready and compact formats).
use super::{ContextGuard, flat_2d, launch_shape, persistent_grid, short};
use crate::cuda::{
    self, Binding, Checked, DevPtr, Kernel, KernelArg, ParamInfo, Signature, StreamHandle,
};
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
    /// FLAG_ROWS8 | FLAG_PACKED | FLAG_GELU | FLAG_DGELU (kernels/block_quant.cu's BQ_*).
    pub flags: i32,
}

// SAFETY: a repr(C) struct passed by value: the Struct class and its own size.
unsafe impl KernelArg for BlockQuantArgs {
    const INFO: ParamInfo = ParamInfo::by_value::<BlockQuantArgs>();
}

/// block_quantize_<1d|2d|regs1d|regs2d>_<in>_<out>(const I::T *in, u8 *out, u8 *out_t, float *sinv,
/// float *sinv_t, const float *noop, float *dbias, const I::T *act_in, BlockQuantArgs args)
type QuantParams = (
    DevPtr,
    DevPtr,
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
    /// Quantize GELU(x) (tanh approximation in float32, rounded once to the input type)
    /// instead of x: an activation fused into its cast.
    pub gelu: bool,
    /// The GELU's input (NULL: none), the input's shape and type: quantize x *
    /// GELU'(dgelu_input) (x the gradient at the GELU's output), rounded to the input
    /// type: the GELU's backward fused into its gradient's cast. Not with `gelu`.
    pub dgelu_input: Buffer,
    /// f32 [rows / 128, cols] (NULL: none): each 128-row tile's column sums of the values
    /// quantized, the partials of a bias gradient (summed over the first dimension); not
    /// written when `noop` holds 1.
    pub dbias_parts: Buffer,
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
    /// in, out, out_t, sinv, sinv_t (NULL where a direction is absent), dbias partials
    /// and the DGELU input (NULL: none)
    pub ptrs: [DevPtr; 7],
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
            flags: 0,
        }
    }
    /// The scale format the quantization writes (what the output records).
    pub fn format(&self) -> ScaleFormat {
        self.row
            .or(self.col)
            .map_or(ScaleFormat::GemmReady, |l| l.format)
    }
}

/// The checks of [`quantize`] (shapes, layouts, types, alignment), without device work.
pub fn check_quantize(
    input: Checked<&Tensor>,
    output: Checked<&Tensor>,
    cfg: &BlockQuantConfig,
) -> Result<()> {
    plan_quantize(input.get(), output.get(), cfg).map(|_| ())
}

/// Compile and load the module of a later [`quantize`] from `in_dtype` to `out_dtype` on
/// `stream` (NVRTC, cuModuleLoadData: no stream work, which a stream capture may refuse),
/// so that the call itself only looks it up: for a stage outside any capture (XLA's
/// initialize stage) ahead of a call that may be captured.
pub fn prepare_quantize(in_dtype: DType, out_dtype: DType, stream: StreamHandle) -> Result<()> {
    if !in_dtype.is_high_precision() || !out_dtype.is_fp8() {
        unsupported!(
            "a block-scaled quantization reads kNVTEFloat32, kNVTEBFloat16 or kNVTEFloat16 and writes FP8, not {} to {}",
            in_dtype.name(),
            out_dtype.name()
        );
    }
    let guard = ContextGuard::for_stream(stream)?;
    let dev = cuda::device_info(guard.device)?;
    nvrtc::module(&BLOCK_QUANT, guard.id, &dev).map(|_| ())
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
fn plan_quantize(
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
    let (rows, cols) = flat_2d(i);
    if i.numel() > 0 && (dims.len() < 2 || rows % TILE != 0 || cols % TILE != 0) {
        invalid!(
            "tensor `input` of shape {} ([{rows}, {cols}] as 2-D) cannot be quantized with {}: the last dimension and the row count (the product of the leading dimensions) must be multiples of {TILE}, with at least 2 dimensions (TE's Float8BlockQuantizer.is_quantizable)",
            i.shape,
            mode.name()
        );
    }
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
            dbias_parts(&cfg.dbias_parts, rows, cols)?,
            dgelu_input(cfg, i)?,
        ],
    }))
}

/// The pointer of a quantization's DGELU input, checked: NULL, or the input's type and
/// shape, 16-byte aligned, and not with `gelu`.
fn dgelu_input(cfg: &BlockQuantConfig, input: &Buffer) -> Result<DevPtr> {
    let b = &cfg.dgelu_input;
    if b.ptr.is_null() {
        return Ok(DevPtr::NULL);
    }
    if cfg.gelu {
        invalid!("a quantization fuses the GELU (its forward) or its backward (DGELU), not both");
    }
    if b.dtype != input.dtype || b.shape != input.shape {
        invalid!(
            "the DGELU input is {} of shape {}: it must be the input's type and shape ({} {})",
            b.dtype.name(),
            b.shape,
            input.dtype.name(),
            input.shape
        );
    }
    check_aligned(b, 16, "the DGELU input")?;
    Ok(b.ptr)
}

/// The pointer of a quantization's bias-gradient partials, checked: NULL, or f32 [rows /
/// 128, cols], 4-byte aligned.
fn dbias_parts(b: &Buffer, rows: usize, cols: usize) -> Result<DevPtr> {
    if b.ptr.is_null() {
        return Ok(DevPtr::NULL);
    }
    let want = [rows / TILE, cols];
    if b.dtype != DType::F32 || b.shape.as_slice() != want {
        invalid!(
            "the bias-gradient partials are {} of shape {}: they must be kNVTEFloat32 [{}, {}] (one row a 128-row tile of the [{rows}, {cols}] input)",
            b.dtype.name(),
            b.shape,
            want[0],
            want[1]
        );
    }
    check_aligned(b, 4, "the bias-gradient partials")?;
    Ok(b.ptr)
}

/// Let the function take at least `bytes` of dynamic shared memory: its limit per (context,
/// function) is only ever raised (a lower limit set later would refuse a larger launch).
fn allow_shared(ctx: cuda::CtxId, f: cudarc::driver::sys::CUfunction, bytes: u32) -> Result<()> {
    use cudarc::driver::sys as cu;
    type Key = (cuda::CtxId, cuda::FunctionHandle);
    static SET: Mutex<Vec<(Key, u32)>> = Mutex::new(Vec::new());
    let key = (ctx, cuda::FunctionHandle::from_raw(f));
    let mut set = SET.lock().unwrap_or_else(|e| e.into_inner());
    let slot = set.iter().position(|(k, _)| *k == key);
    if slot.is_some_and(|i| set[i].1 >= bytes) {
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
    match slot {
        Some(i) => set[i].1 = bytes,
        None => set.push((key, bytes)),
    }
    Ok(())
}

/// BlockQuantArgs::flags: the 1D rowwise scales computed once a row (one transposing
/// reduction of 8 rows' amaxes over the row's 16 threads, one division a thread) instead
/// of once a thread and pass.
const FLAG_ROWS8: i32 = 1;
/// BlockQuantArgs::flags: 16-bit inputs' amaxes (the 2D tile's, the FLAG_ROWS8 rows
/// pass's, the 1D columns') on packed pairs (bf16x2 / f16x2 abs and max).
const FLAG_PACKED: i32 = 2;
/// BlockQuantArgs::flags: GELU(x) quantized (BlockQuantConfig::gelu).
const FLAG_GELU: i32 = 4;
/// BlockQuantArgs::flags: x * GELU'(act_in) quantized (BlockQuantConfig::dgelu_input).
const FLAG_DGELU: i32 = 8;

/// Where a quantize launch takes the register path (kernels/block_quant.cu,
/// block_quantize_regs<mode>_*: the tile loaded straight into registers, no shared-memory
/// copy of it). It applies only to 16-bit inputs without an activation or a bias gradient;
/// elsewhere the shared-memory kernel runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum RegsPath {
    Never,
    /// Wherever it applies but for the compact columnwise format (measured faster or tied
    /// in every other mode on an H200, slower there: docs/results/2026-12.md, eighth
    /// session).
    NotCompact,
    Everywhere,
}

/// A quantize launch as NVTE_COMM_BLOCK_QUANT selects it (read at each call).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Launch {
    /// The shared-memory kernel's flags: FLAG_ROWS8 and FLAG_PACKED but for `previous`
    /// (neither: the previous kernel's paths).
    flags: i32,
    regs: RegsPath,
}

fn quant_launch() -> Result<Launch> {
    Ok(launch_of(crate::env::BLOCK_QUANT.get()?))
}

/// quant_launch's value for the knob's choice (its index in the knob's words: `fast` (the
/// default), `shared`, `previous`, `regs`).
fn launch_of(choice: Option<usize>) -> Launch {
    const FAST: i32 = FLAG_ROWS8 | FLAG_PACKED;
    let (flags, regs) = match choice {
        None | Some(0) => (FAST, RegsPath::NotCompact),
        Some(1) => (FAST, RegsPath::Never),
        Some(2) => (0, RegsPath::Never),
        Some(_) => (FAST, RegsPath::Everywhere),
    };
    Launch { flags, regs }
}

/// Whether `plan` runs on the register path under `regs` (`act`: FLAG_GELU / FLAG_DGELU or
/// 0; `dbias`: whether bias-gradient partials are written).
fn takes_regs(regs: RegsPath, plan: &QuantizePlan, act: i32, dbias: bool) -> bool {
    let applies = plan.in_dtype.bits() == 16 && act == 0 && !dbias;
    let compact = plan.col.is_some_and(|l| !l.transposed);
    match regs {
        RegsPath::Never => false,
        RegsPath::NotCompact => applies && !compact,
        RegsPath::Everywhere => applies,
    }
}

/// The register path's shared memory (kernels/block_quant.cu, bq_regs_columns): the 128 x
/// 128 FP8 staging area of the transposed columnwise output.
const REGS_STAGE_BYTES: u32 = (TILE * TILE) as u32;

/// TE's nvte_quantize into an NVTE_BLOCK_SCALING_1D / _2D tensor: FP8 rowwise data and / or
/// columnwise data (transposed, or 1D compact: the input's layout) with their float32
/// scale inverses in TE's layout, from one read of the input. Returns the format written.
pub fn quantize(
    input: Checked<&Tensor>,
    output: Checked<&Tensor>,
    cfg: &BlockQuantConfig,
    stream: StreamHandle,
) -> Result<ScaleFormat> {
    let Some(plan) = plan_quantize(input.get(), output.get(), cfg)? else {
        return Ok(cfg.format);
    };
    let launch = quant_launch()?;
    let guard = ContextGuard::for_stream(stream)?;
    let dev = cuda::device_info(guard.device)?;
    let m = nvrtc::module(&BLOCK_QUANT, guard.id, &dev)?;
    let [src, dst, dst_t, sinv, sinv_t, dbias, act_in] = plan.ptrs;
    let act = match (cfg.gelu, act_in.is_null()) {
        (true, _) => FLAG_GELU,
        (false, false) => FLAG_DGELU,
        (false, true) => 0,
    };
    let regs = takes_regs(launch.regs, &plan, act, !dbias.is_null());
    let mode = match (plan.mode, regs) {
        (BlockMode::OneD, false) => "1d",
        (BlockMode::TwoD, false) => "2d",
        (BlockMode::OneD, true) => "regs1d",
        (BlockMode::TwoD, true) => "regs2d",
    };
    let names = [
        mode,
        short(plan.in_dtype).unwrap(),
        short(plan.out_dtype).unwrap(),
    ];
    // SAFETY: `m` is kernels/block_quant.cu's module, the binding's source.
    let k = unsafe { Kernel::new(&m, &BLOCK_QUANTIZE, &names)? };
    let smem = match regs {
        true => REGS_STAGE_BYTES,
        false => (TILE * TILE * plan.in_dtype.bits() / 8) as u32,
    };
    allow_shared(guard.id, k.raw(), smem)?;
    let grid = ((plan.rows / TILE) * (plan.cols / TILE)) as u32;
    let args = BlockQuantArgs {
        flags: launch.flags | act,
        ..plan.args(cfg)
    };
    let params = (src, dst, dst_t, sinv, sinv_t, cfg.noop, dbias, act_in, args);
    // SAFETY: `k` is block_quantize_<mode>_<in>_<out> of kernels/block_quant.cu, loaded in
    // the stream's context (held by `guard`), with its dynamic shared memory allowed
    // (`smem`: at least one 128x128 input tile, the kernel's use; the register path's:
    // its 128x128 FP8 staging area, for 16-bit inputs only, without dbias and act_in,
    // which it does not read). Checked by plan_quantize: the input holds rows *
    // cols elements, rows and cols multiples of 128 (fewer than 2^31 tiles), 16-byte
    // aligned; each FP8 output present holds rows * cols bytes (16-byte aligned) with its
    // scale_inv of TE's shape for the strides given (4-byte aligned), absent ones NULL; noop
    // NULL or one float; dbias NULL or f32 [rows / 128, cols] (4-byte aligned); act_in NULL
    // or the input's type and size (16-byte aligned), with FLAG_DGELU exactly when not NULL;
    // flags any of the kernel's. The grid is one block of THREADS a tile
    // (the kernel's launch bounds).
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
fn plan_dequantize(input: &Tensor, output: &Tensor) -> Result<Option<DequantizePlan>> {
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
pub fn dequantize(
    input: Checked<&Tensor>,
    output: Checked<&Tensor>,
    stream: StreamHandle,
) -> Result<()> {
    let Some(p) = plan_dequantize(input.get(), output.get())? else {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::Shape;

    // ------------------------------------------------- a reference from TE's definitions

    /// TE's compute_scale_from_amax for an FP8 maximum and the input type's largest value.
    fn ref_scale(amax: f32, eps: f32, pow2: bool, fp8_max: f32, in_max: f32) -> f32 {
        let amax = if amax < eps { eps } else { amax };
        if amax.is_infinite() || amax == 0.0 || amax.is_nan() {
            return 1.0;
        }
        let mut s = fp8_max / amax;
        if s.is_infinite() {
            s = in_max;
        }
        if pow2 {
            s = f32::from_bits(s.to_bits() & 0xff80_0000);
        }
        s
    }

    /// float -> e4m3, round to nearest even, saturating to +-448; NaN -> 0x7f.
    fn e4m3(x: f32) -> u8 {
        if x.is_nan() {
            return 0x7f;
        }
        let s = if x.is_sign_negative() { 0x80 } else { 0 };
        let a = (x as f64).abs();
        if a >= 448.0 {
            return s | 0x7e;
        }
        if a < 2f64.powi(-6) {
            return s | (a * 512.0).round_ties_even() as u8;
        }
        let mut e = a.log2().floor() as i32;
        let mut q = ((a / 2f64.powi(e) - 1.0) * 8.0).round_ties_even() as i32;
        if q == 8 {
            q = 0;
            e += 1;
        }
        s | (((e + 7) << 3) | q).min(0x7e) as u8
    }

    fn e4m3_value(b: u8) -> f64 {
        let (e, m) = ((b >> 3) & 15, (b & 7) as f64);
        let v = if e == 0 {
            m * 2f64.powi(-9)
        } else {
            (1.0 + m / 8.0) * 2f64.powi(e as i32 - 7)
        };
        if b & 0x80 != 0 { -v } else { v }
    }

    /// Quantize a [rows, cols] matrix into layout `l` (e4m3): data in the layout's storage
    /// order and the scale inverses (NaN where no block's scale goes: the padding).
    fn ref_quantize(x: &[f32], l: &BlockLayout, eps: f32, pow2: bool) -> (Vec<u8>, Vec<f32>) {
        let (br, bc) = l.block_dims();
        let (mut data, mut sinv) = (vec![0u8; l.rows * l.cols], vec![f32::NAN; l.scale_numel()]);
        for r0 in (0..l.rows).step_by(br) {
            for c0 in (0..l.cols).step_by(bc) {
                let block = || (r0..r0 + br).flat_map(|r| (c0..c0 + bc).map(move |c| (r, c)));
                let amax = block().fold(0f32, |m, (r, c)| m.max(x[r * l.cols + c].abs()));
                let s = ref_scale(amax, eps, pow2, 448.0, f32::MAX);
                sinv[l.scale_index(r0, c0)] = 1.0 / s;
                for (r, c) in block() {
                    let at = if l.transposed {
                        c * l.rows + r
                    } else {
                        r * l.cols + c
                    };
                    data[at] = e4m3(x[r * l.cols + c] * s);
                }
            }
        }
        (data, sinv)
    }

    #[test]
    fn scales_follow_te() {
        let s = |amax, eps, pow2| ref_scale(amax, eps, pow2, 448.0, f32::MAX);
        assert_eq!(s(0.0, 0.0, false), 1.0, "amax 0: scale 1");
        assert_eq!(s(f32::INFINITY, 0.0, true), 1.0, "amax inf: scale 1");
        assert_eq!(s(f32::NAN, 0.0, false), 1.0, "amax NaN: scale 1");
        assert_eq!(s(2.0, 0.0, false), 224.0);
        assert_eq!(s(3.0, 0.0, false), 448.0f32 / 3.0);
        assert_eq!(s(3.0, 0.0, true), 128.0, "pow2 rounds 149.3 down to 128");
        assert_eq!(s(0.1, 0.5, false), 896.0, "epsilon raises the amax");
        assert_eq!(
            s(0.0, 0.5, false),
            896.0,
            "epsilon applies to a zero block too"
        );
        assert_eq!(
            s(1e-40, 0.0, false),
            f32::MAX,
            "an overflowing scale is the input's max"
        );
        assert_eq!(s(1e-40, 0.0, true), 2f32.powi(127));
        assert_eq!(
            ref_scale(1e-40, 0.0, false, 448.0, 65504.0),
            65504.0,
            "fp16 input"
        );
        // pow2 scales and their inverses are exact powers of 2.
        for amax in [0.3f32, 1.0, 7.5, 448.0, 1000.0, 1e-20] {
            let sc = s(amax, 0.0, true);
            assert_eq!(sc.to_bits() & 0x007f_ffff, 0, "{amax}: {sc}");
            assert!(amax * sc <= 448.0 && amax * sc > 224.0, "{amax}: {sc}");
            assert_eq!((1.0 / sc) * sc, 1.0);
        }
    }

    #[test]
    fn e4m3_rounds_to_nearest_even_and_saturates() {
        for b in 0u8..=255 {
            if b & 0x7f == 0x7f {
                continue; // NaN
            }
            assert_eq!(e4m3(e4m3_value(b) as f32), b, "code {b:#04x}");
        }
        assert_eq!(e4m3(1.0625), 0x38, "tie between 1 and 1.125: even");
        assert_eq!(e4m3(1.1875), 0x3a, "tie between 1.125 and 1.25: even");
        assert_eq!(e4m3(464.0), 0x7e, "saturates instead of 480");
        assert_eq!(e4m3(-1e30), 0xfe);
        assert_eq!(e4m3(f32::INFINITY), 0x7e);
        assert_eq!(
            e4m3(2f32.powi(-10)),
            0x00,
            "half the smallest subnormal: even"
        );
        assert_eq!(e4m3(3.0 * 2f32.powi(-10)), 0x02);
        assert_eq!(e4m3(f32::NAN), 0x7f);
    }

    /// A matrix whose blocks differ in magnitude (deterministic).
    fn matrix(rows: usize, cols: usize) -> Vec<f32> {
        let mut z = 0x9e37_79b9_7f4a_7c15u64;
        (0..rows * cols)
            .map(|i| {
                z ^= z << 13;
                z ^= z >> 7;
                z ^= z << 17;
                let u = (z >> 40) as f32 / (1u64 << 24) as f32;
                let (r, c) = (i / cols, i % cols);
                let e = ((r / 128) * 5 + (c / 128) * 3 + r % 3) as i32 % 13 - 6;
                (u * 2.0 - 1.0) * 2f32.powi(e)
            })
            .collect()
    }

    #[test]
    fn the_reference_quantization_meets_te_bounds() {
        let (rows, cols) = (256, 384);
        let x = matrix(rows, cols);
        for mode in [BlockMode::OneD, BlockMode::TwoD] {
            for dir in [Direction::Rowwise, Direction::Columnwise] {
                for pow2 in [false, true] {
                    let l = BlockLayout::new(mode, dir, ScaleFormat::GemmReady, rows, cols);
                    let (q, sinv) = ref_quantize(&x, &l, 0.0, pow2);
                    let (br, bc) = l.block_dims();
                    let (nr, nc) = l.block_counts();
                    assert_eq!(sinv.iter().filter(|v| !v.is_nan()).count(), nr * nc);
                    for rb in 0..nr {
                        for cb in 0..nc {
                            let si = sinv[l.scale_index(rb * br, cb * bc)];
                            let mut top = 0u8;
                            for r in rb * br..(rb + 1) * br {
                                for c in cb * bc..(cb + 1) * bc {
                                    let at = if l.transposed {
                                        c * rows + r
                                    } else {
                                        r * cols + c
                                    };
                                    top = top.max(q[at] & 0x7f);
                                    // Dequantized within half an e4m3 step (relative 2^-4,
                                    // or the subnormal step).
                                    let v = x[r * cols + c] as f64;
                                    let d = e4m3_value(q[at]) * si as f64;
                                    let tol =
                                        (v.abs() * 2f64.powi(-4)).max(2f64.powi(-10) * si as f64);
                                    assert!(
                                        (d - v).abs() <= tol,
                                        "{mode:?} {dir:?} ({r},{c}): {v} -> {d}"
                                    );
                                }
                            }
                            // The block's largest value lands on 448 (pow2: at least 224).
                            let want = if pow2 { 0x76 } else { 0x7e };
                            assert!(
                                top >= want,
                                "{mode:?} {dir:?} block ({rb},{cb}): top code {top:#x}"
                            );
                        }
                    }
                }
            }
        }
    }

    // ------------------------------------------------------------------------ the plans

    fn buf(ptr: usize, dtype: DType, dims: &[usize]) -> Buffer {
        Buffer::new(
            DevPtr::from_c(ptr as *const u8),
            dtype,
            Shape::new(dims).unwrap(),
        )
        .unwrap()
    }

    fn input(dtype: DType, dims: &[usize]) -> Tensor {
        Tensor {
            data: buf(0x10_0000, dtype, dims),
            ..Default::default()
        }
    }

    /// A block-scaled output for [rows, cols] in `mode` / `format` (its buffers' shapes
    /// from TE's rules).
    fn output(
        mode: BlockMode,
        format: ScaleFormat,
        rows: usize,
        cols: usize,
        row: bool,
        col: bool,
    ) -> Tensor {
        let mut t = Tensor {
            scaling_mode: mode.scaling_mode(),
            ..Default::default()
        };
        if row {
            let l = BlockLayout::new(mode, Direction::Rowwise, format, rows, cols);
            t.data = buf(0x20_0000, DType::E4M3, &l.data_shape_2d());
            t.scale_inv = buf(0x30_0000, DType::F32, &l.scale_shape);
        }
        if col {
            let l = BlockLayout::new(mode, Direction::Columnwise, format, rows, cols);
            t.columnwise_data = buf(0x40_0000, DType::E4M3, &l.data_shape_2d());
            t.columnwise_scale_inv = buf(0x50_0000, DType::F32, &l.scale_shape);
        }
        t
    }

    fn cfg(format: ScaleFormat) -> BlockQuantConfig {
        BlockQuantConfig {
            force_pow_2_scales: true,
            amax_epsilon: 0.5,
            format,
            ..Default::default()
        }
    }

    #[test]
    fn the_launch_knob_names_every_launch() {
        let words = match crate::env::BLOCK_QUANT.0.kind {
            crate::env::Kind::Choice(words) => words,
            _ => panic!("NVTE_COMM_BLOCK_QUANT is a choice"),
        };
        assert_eq!(words, ["fast", "shared", "previous", "regs"]);
        let fast = FLAG_ROWS8 | FLAG_PACKED;
        let l = |flags, regs| Launch { flags, regs };
        assert_eq!(launch_of(None), l(fast, RegsPath::NotCompact));
        assert_eq!(launch_of(Some(0)), l(fast, RegsPath::NotCompact));
        assert_eq!(launch_of(Some(1)), l(fast, RegsPath::Never));
        assert_eq!(launch_of(Some(2)), l(0, RegsPath::Never));
        assert_eq!(launch_of(Some(3)), l(fast, RegsPath::Everywhere));
        // Distinct flag bits.
        let flags = [FLAG_ROWS8, FLAG_PACKED, FLAG_GELU, FLAG_DGELU];
        for (i, a) in flags.iter().enumerate() {
            assert_eq!(a.count_ones(), 1);
            assert!(flags[i + 1..].iter().all(|b| a & b == 0));
        }
    }

    #[test]
    fn args_layout_is_the_kernels() {
        assert_eq!(std::mem::size_of::<BlockQuantArgs>(), 64);
        assert_eq!(std::mem::offset_of!(BlockQuantArgs, eps), 48);
        assert_eq!(std::mem::offset_of!(BlockQuantArgs, col_mode), 56);
        assert_eq!(std::mem::offset_of!(BlockQuantArgs, flags), 60);
    }

    #[test]
    fn plans_give_the_kernel_te_layouts() {
        use ScaleFormat::*;
        let i = input(DType::BF16, &[256, 384]);
        // 1D GEMM-ready, both directions.
        let o = output(BlockMode::OneD, GemmReady, 256, 384, true, true);
        let p = plan_quantize(&i, &o, &cfg(GemmReady)).unwrap().unwrap();
        let a = p.args(&cfg(GemmReady));
        assert_eq!(
            (a.rows, a.cols, a.s_r, a.s_c, a.t_r, a.t_c),
            (256, 384, 1, 256, 384, 1)
        );
        assert_eq!((a.pow2, a.eps, a.col_mode), (1, 0.5, 1));
        assert_eq!(
            p.ptrs.map(|q| q.is_null()),
            [false, false, false, false, false, true, true]
        );
        // 1D compact: rowwise scales [rows, cols / 128], columnwise data untransposed.
        let o = output(BlockMode::OneD, Compact, 256, 384, true, true);
        let p = plan_quantize(&i, &o, &cfg(Compact)).unwrap().unwrap();
        let a = p.args(&cfg(Compact));
        assert_eq!((a.s_r, a.s_c, a.t_r, a.t_c, a.col_mode), (3, 1, 384, 1, 2));
        assert_eq!(p.format(), Compact);
        // 2D, columnwise only: the transpose; the format option does not apply.
        let o = output(BlockMode::TwoD, GemmReady, 256, 384, false, true);
        let p = plan_quantize(&i, &o, &cfg(Compact)).unwrap().unwrap();
        let a = p.args(&cfg(Compact));
        assert_eq!((a.t_r, a.t_c, a.col_mode), (1, 4, 1));
        assert!(p.ptrs[1].is_null() && p.ptrs[3].is_null());
        // N-D input: [2, 128, 384] is [256, 384]; columnwise data [384, 2, 128].
        let i3 = input(DType::F32, &[2, 128, 384]);
        let mut o = output(BlockMode::OneD, GemmReady, 256, 384, true, true);
        o.data.shape = Shape::new(&[2, 128, 384]).unwrap();
        o.columnwise_data.shape = Shape::new(&[384, 2, 128]).unwrap();
        assert!(plan_quantize(&i3, &o, &cfg(GemmReady)).unwrap().is_some());
        // An empty input: nothing to do.
        let e = input(DType::F32, &[0, 384]);
        let o = output(BlockMode::OneD, GemmReady, 0, 384, true, false);
        assert!(plan_quantize(&e, &o, &cfg(GemmReady)).unwrap().is_none());
    }

    #[test]
    fn the_register_path_takes_plain_16_bit_quantizations() {
        use RegsPath::*;
        use ScaleFormat::*;
        let plan = |dtype, format| {
            let o = output(BlockMode::OneD, format, 256, 384, true, true);
            plan_quantize(&input(dtype, &[256, 384]), &o, &cfg(format))
                .unwrap()
                .unwrap()
        };
        let (bf16, f16, f32) = (
            plan(DType::BF16, GemmReady),
            plan(DType::F16, GemmReady),
            plan(DType::F32, GemmReady),
        );
        let compact = plan(DType::BF16, Compact);
        for p in [&bf16, &f16] {
            assert!(takes_regs(NotCompact, p, 0, false));
            assert!(takes_regs(Everywhere, p, 0, false));
            assert!(!takes_regs(Never, p, 0, false));
            // an activation or a bias gradient: the shared-memory kernel
            for (act, dbias) in [(FLAG_GELU, false), (FLAG_DGELU, false), (0, true)] {
                assert!(!takes_regs(Everywhere, p, act, dbias));
            }
        }
        assert!(!takes_regs(Everywhere, &f32, 0, false));
        assert!(!takes_regs(NotCompact, &compact, 0, false));
        assert!(takes_regs(Everywhere, &compact, 0, false));
    }

    /// The fused-cast tests' operands: a bf16 [256, 384] input and its 1D GEMM-ready
    /// output, columnwise, and rowwise when `rowwise`.
    fn fused_case(rowwise: bool) -> (Tensor, Tensor) {
        let i = input(DType::BF16, &[256, 384]);
        let o = output(
            BlockMode::OneD,
            ScaleFormat::GemmReady,
            256,
            384,
            rowwise,
            true,
        );
        (i, o)
    }

    #[test]
    fn bias_gradient_partials_are_one_row_a_tile() {
        let (i, o) = fused_case(false);
        let with = |dtype, dims: &[usize], at| BlockQuantConfig {
            gelu: true,
            dbias_parts: buf(at, dtype, dims),
            ..cfg(ScaleFormat::GemmReady)
        };
        let c = with(DType::F32, &[2, 384], 0x60_0000);
        let p = plan_quantize(&i, &o, &c).unwrap().unwrap();
        assert_eq!(p.ptrs[5], c.dbias_parts.ptr);
        for (dtype, dims, at) in [
            (DType::F32, &[1usize, 384][..], 0x60_0000),
            (DType::F32, &[2, 256], 0x60_0000),
            (DType::BF16, &[2, 384], 0x60_0000),
        ] {
            refused(&i, &o, &with(dtype, dims, at), "kNVTEFloat32 [2, 384]");
        }
        refused(
            &i,
            &o,
            &with(DType::F32, &[2, 384], 0x60_0002),
            "4-byte aligned",
        );
    }

    #[test]
    fn the_dgelu_input_is_the_inputs_shape_and_not_with_gelu() {
        let (i, o) = fused_case(true);
        let with = |gelu, dtype, dims: &[usize], at| BlockQuantConfig {
            gelu,
            dgelu_input: buf(at, dtype, dims),
            ..cfg(ScaleFormat::GemmReady)
        };
        let c = with(false, DType::BF16, &[256, 384], 0x70_0000);
        let p = plan_quantize(&i, &o, &c).unwrap().unwrap();
        assert_eq!(p.ptrs[6], c.dgelu_input.ptr);
        refused(
            &i,
            &o,
            &with(true, DType::BF16, &[256, 384], 0x70_0000),
            "not both",
        );
        refused(
            &i,
            &o,
            &with(false, DType::F32, &[256, 384], 0x70_0000),
            "the input's type and shape",
        );
        refused(
            &i,
            &o,
            &with(false, DType::BF16, &[384, 256], 0x70_0000),
            "the input's type and shape",
        );
        refused(
            &i,
            &o,
            &with(false, DType::BF16, &[256, 384], 0x70_0008),
            "16-byte aligned",
        );
    }

    fn refused(i: &Tensor, o: &Tensor, c: &BlockQuantConfig, want: &str) {
        let e = plan_quantize(i, o, c).unwrap_err().to_string();
        assert!(e.contains(want), "expected {want:?} in: {e}");
    }

    #[test]
    fn plans_refuse_what_te_refuses() {
        use ScaleFormat::*;
        let g = cfg(GemmReady);
        for (dims, mode) in [
            (&[100usize, 128][..], BlockMode::OneD),
            (&[128, 100], BlockMode::OneD),
            (&[384, 130], BlockMode::TwoD),
            (&[2, 100, 128], BlockMode::TwoD),
            (&[256], BlockMode::OneD),
        ] {
            let k = *dims.last().unwrap();
            let o = output(
                mode,
                GemmReady,
                dims.iter().product::<usize>() / k,
                k,
                true,
                false,
            );
            refused(&input(DType::F32, dims), &o, &g, "multiples of 128");
        }
        let i = input(DType::BF16, &[256, 384]);
        refused(
            &i,
            &output(BlockMode::OneD, GemmReady, 256, 384, true, true),
            &cfg(Compact),
            "is GEMM_READY",
        );
        refused(
            &i,
            &output(BlockMode::OneD, Compact, 256, 384, true, false),
            &g,
            "is COMPACT",
        );
        refused(
            &i,
            &output(BlockMode::OneD, GemmReady, 256, 256, true, false),
            &g,
            "needs [256, 384]",
        );
        refused(
            &i,
            &output(BlockMode::OneD, GemmReady, 256, 384, false, false),
            &g,
            "neither rowwise nor columnwise",
        );
        refused(
            &input(DType::E4M3, &[256, 384]),
            &output(BlockMode::OneD, GemmReady, 256, 384, true, false),
            &g,
            "reads kNVTEFloat32",
        );
        let mut o = output(BlockMode::OneD, GemmReady, 256, 384, true, false);
        o.scale_inv.shape = Shape::new(&[3, 255]).unwrap();
        refused(&i, &o, &g, "fits no layout");
        let mut o = output(BlockMode::TwoD, GemmReady, 256, 384, true, true);
        o.columnwise_data.dtype = DType::E5M2;
        refused(&i, &o, &g, "same FP8 type");
        o.columnwise_data.dtype = DType::BF16;
        refused(&i, &o, &g, "writes FP8");
        let mut o = output(BlockMode::TwoD, GemmReady, 256, 384, true, false);
        o.scale_inv = Buffer::default();
        refused(&i, &o, &g, "(not set)");
        let mut o = output(BlockMode::TwoD, GemmReady, 256, 384, true, false);
        o.data.ptr = o.data.ptr + 8;
        refused(&i, &o, &g, "16-byte aligned");
        let mut u = i.clone();
        u.data.ptr = u.data.ptr + 2;
        refused(
            &u,
            &output(BlockMode::TwoD, GemmReady, 256, 384, true, false),
            &g,
            "16-byte aligned",
        );
        refused(&i, &input(DType::E4M3, &[256, 384]), &g, "not block-scaled");
    }

    #[test]
    fn dequantize_plans_read_either_direction() {
        use ScaleFormat::*;
        let out = input(DType::BF16, &[256, 384]);
        let o = output(BlockMode::OneD, GemmReady, 256, 384, true, true);
        let p = plan_dequantize(&o, &out).unwrap().unwrap();
        assert_eq!(p.layout.direction, Direction::Rowwise);
        let o = output(BlockMode::TwoD, GemmReady, 256, 384, false, true);
        let p = plan_dequantize(&o, &out).unwrap().unwrap();
        assert!(p.layout.transposed);
        assert_eq!((p.layout.rows, p.layout.cols), (256, 384));
        let e = plan_dequantize(&o, &input(DType::BF16, &[384, 256]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("[256, 384]"), "{e}");
        let e = plan_dequantize(&o, &input(DType::E4M3, &[256, 384]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("not supported"), "{e}");
    }
}
