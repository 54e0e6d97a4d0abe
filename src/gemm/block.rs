//! Block-scaled FP8 GEMM (TE's Float8BlockScaling: NVTE_BLOCK_SCALING_1D, one float32
//! scale per 128 consecutive values of a row; NVTE_BLOCK_SCALING_2D, one per 128 x 128
//! tile) on cuBLASLt's block scale modes (VEC128_32F / BLK128x128_32F, cuBLAS 12.9+,
//! Hopper) or, as NVTE_COMM_BLOCK_GEMM chooses, on our sm90 kernel's `_block` variants
//! (`sm90::Sm90Gemm::run_block`), and the alpha / beta GEMMs of nvte_cublas_gemm_scaled
//! and nvte_cublas_gemm_v2 ([`cublas_gemm_scaled`]).
//!
//! The combinations are TE's (common/gemm/cublaslt_gemm.cu): 1D x 1D, 1D x 2D and 2D x
//! 1D (2D x 2D refused), the cuBLASLt GEMM always TN: A's rowwise data with transa, its
//! columnwise (transposed) data without; B's rowwise data without transb, its
//! columnwise data with; the scales are the chosen data's scale_inv in TE's GEMM-ready
//! layout ([`gemm_ready_scale_shape`]). Output bf16 / fp16 / fp32; epilogues none, bias
//! and DGELU (what TE allows with block scaling). Everything is checked before any
//! device work: a refused call leaves D untouched.
use super::*;
use crate::tensor::{BlockMode, ScaleFormat, scale_shape};
use cudarc::cublaslt::sys::cublasLtMatmulMatrixScale_t as Scale;

/// The cuBLASLt scale mode of a block-scaled operand.
fn lt_scale_mode(b: BlockMode) -> Scale {
    match b {
        BlockMode::OneD => Scale::CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F,
        BlockMode::TwoD => Scale::CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F,
    }
}

/// The float32 scale_inv shape of FP8 data stored as `rows` x `cols` (row-major, blocks
/// along a row) in TE's GEMM-ready layout (`tensor::scale_shape`): a rowwise buffer's
/// and equally a GEMM-ready columnwise one's (the transpose, [cols, rows] of the tensor).
pub fn gemm_ready_scale_shape(b: BlockMode, rows: usize, cols: usize) -> [usize; 2] {
    match b {
        BlockMode::OneD => scale_shape::one_d_rowwise_gemm_ready(rows, cols),
        BlockMode::TwoD => scale_shape::two_d_rowwise(rows, cols),
    }
}

/// A gathered copy `t` (named `what`) of block-scaled B of `mode` (all of B, [n, k] rows
/// of k values): B's scaling mode in the GEMM-ready format, rowwise data [n, k], with f32
/// scales of the GEMM-ready shape of [n, k].
pub fn check_gathered_scales(
    t: &Tensor,
    what: &str,
    mode: BlockMode,
    n: usize,
    k: usize,
) -> Result<()> {
    let want = gemm_ready_scale_shape(mode, n, k);
    let s = &t.scale_inv;
    if t.data.rows_cols() != Some((n, k)) {
        invalid!(
            "tensor `{what}` of block-scaled B holds all of B as rowwise data [{n}, {k}], got {}",
            t.data.shape
        );
    }
    if t.block_format == ScaleFormat::Compact {
        unsupported!(
            "tensor `{what}` of block-scaled B is flagged for the COMPACT scale format: it receives GEMM-ready scales"
        );
    }
    if t.block_mode() != Some(mode)
        || s.dtype != DType::F32
        || s.shape.as_slice() != want
        || s.ptr.is_null()
    {
        invalid!(
            "tensor `{what}` of block-scaled B must be {} with f32 scale_inv {want:?} (the GEMM-ready scales of all of B [{n}, {k}]), got scaling mode {} with scale_inv {} of {}",
            mode.name(),
            mode_name(t.scaling_mode),
            s.shape,
            s.dtype.name()
        );
    }
    Ok(())
}

/// TE's name of a scaling mode value (the C enum lives in `ffi`).
fn mode_name(mode: u32) -> String {
    if let Some(b) = BlockMode::from_scaling_mode(mode) {
        return b.name().into();
    }
    match mode {
        0 => "NVTE_DELAYED_TENSOR_SCALING".into(),
        1 => "NVTE_MXFP8_1D_SCALING".into(),
        4 => "NVTE_NVFP4_1D_SCALING".into(),
        m => format!("NVTEScalingMode({})", m as i32),
    }
}

/// The per-tensor GEMM path ([`desc_from_te`], which every GEMM and overlap operation
/// takes) refuses inputs of any other scaling mode: it would read their scale_inv as one
/// scalar.
/// `modes`: A's and B's scaling modes.
pub(super) fn require_per_tensor(modes: [u32; 2]) -> Result<()> {
    for (m, w) in modes.into_iter().zip(["A", "B"]) {
        if m != 0 {
            unsupported!(
                "tensor `{w}` has scaling mode {}: this operation takes per-tensor scaling only (block-scaled FP8 GEMMs: nvte_cublas_gemm, nvte_cublas_gemm_scaled, nvte_cublas_gemm_v2)",
                mode_name(m)
            );
        }
    }
    Ok(())
}

/// TE's nvte_cublas_gemm_scaled: D = alpha * op(A) op(B) (+ epilogue) + beta * D (beta = 0:
/// D is not read), for per-tensor and block-scaled inputs, on operands the C boundary
/// vouched for, whose `accumulate` is `beta != 0`. The plain cases (alpha = 1, beta = 0
/// or 1, not block-scaled) take nvte_cublas_gemm's path unchanged ([`cublas_gemm`]).
pub fn cublas_gemm_scaled(
    args: Checked<&TeGemm>,
    alpha: f32,
    beta: f32,
    stream: StreamHandle,
) -> Result<()> {
    if args.accumulate != (beta != 0.0) {
        return Err(Error::internal(format!(
            "GEMM operands with accumulate = {} for beta = {beta}",
            args.accumulate
        )));
    }
    let block = [args.a.scaling_mode, args.b.scaling_mode]
        .iter()
        .any(|&m| BlockMode::from_scaling_mode(m).is_some());
    if !block {
        if alpha == 1.0 && (beta == 0.0 || beta == 1.0) {
            return cublas_gemm(args, stream);
        }
        let g = desc_from_te(&args)?;
        // SAFETY: `desc_from_te` validated the operands against each other; `Checked`
        // carries the C caller's contract that they are live device memory of those
        // extents.
        return unsafe { run_scaled(&g, None, alpha, beta, stream) };
    }
    let (g, modes) = block_desc(&args)?;
    // SAFETY: `block_desc` validated the data, scales, output, epilogue buffers and
    // workspace against each other; `Checked` carries the C caller's contract.
    unsafe { run_scaled(&g, Some(modes), alpha, beta, stream) }
}

/// Whether either GEMM operand is block-scaled (NVTE_BLOCK_SCALING_1D / 2D): such a call
/// takes [`run_block`], never the per-tensor [`desc_from_te`].
pub fn is_block(g: &TeGemm) -> bool {
    [g.a.scaling_mode, g.b.scaling_mode]
        .iter()
        .any(|&m| BlockMode::from_scaling_mode(m).is_some())
}

/// Check a block-scaled GEMM's operands (the checks of [`run_block`], no device call):
/// what the comm-GEMM calls run before anything is made.
pub fn check_block(g: &TeGemm) -> Result<()> {
    block_desc(g).map(|_| ())
}

/// The block-scaled GEMM of TE's operands `g` (D = op(A) op(B) (+ D when `accumulate`),
/// epilogues none / bias / DGELU): what the comm-GEMM calls run where their GEMM is the
/// whole call (one rank). Everything is checked before any device work.
///
/// # Safety
///
/// `g`'s tensors are live device memory of the extents their shapes state (operands the
/// C boundary resolved, or the caller's own scratch), until `stream` runs the GEMM.
pub unsafe fn run_block(g: &TeGemm, stream: StreamHandle) -> Result<()> {
    let (desc, modes) = block_desc(g)?;
    let beta = if g.accumulate { 1.0 } else { 0.0 };
    // SAFETY: `block_desc` validated the data, scales, output, epilogue buffers and
    // workspace against each other; the caller guarantees they are live.
    unsafe { run_scaled(&desc, Some(modes), 1.0, beta, stream) }
}

/// Both operands' blocks: block-scaled both, not both 2D.
fn operand_blocks(g: &TeGemm) -> Result<[BlockMode; 2]> {
    let (am, bm) = (g.a.scaling_mode, g.b.scaling_mode);
    match (
        BlockMode::from_scaling_mode(am),
        BlockMode::from_scaling_mode(bm),
    ) {
        (Some(BlockMode::TwoD), Some(BlockMode::TwoD)) => unsupported!(
            "A and B are both NVTE_BLOCK_SCALING_2D: block-scaled GEMMs take 1D x 1D, 1D x 2D and 2D x 1D (as TE; quantize the activation or gradient with 1D blocks)"
        ),
        (Some(a), Some(b)) => Ok([a, b]),
        _ => unsupported!(
            "A ({}) and B ({}) mix block scaling with another scaling mode: both must be NVTE_BLOCK_SCALING_1D / 2D",
            mode_name(am),
            mode_name(bm)
        ),
    }
}

/// A block-scaled tensor's logical 2-D shape (rows, cols): its rowwise data's, or from
/// its columnwise data alone ([cols, rest...]: the transpose), as TE's Tensor::shape.
fn logical_2d(t: &Tensor, what: &str) -> Result<(usize, usize)> {
    let present = |b: &Buffer| !b.ptr.is_null() || b.numel() > 0;
    if present(&t.data) {
        return two_d(&t.data, what);
    }
    if present(&t.columnwise_data) {
        let s = t.columnwise_data.shape.as_slice();
        if s.len() < 2 {
            invalid!(
                "tensor `{what}`'s columnwise data must have at least 2 dimensions, got shape {}",
                t.columnwise_data.shape
            );
        }
        return Ok((s[1..].iter().product(), s[0]));
    }
    invalid!("tensor `{what}` holds no data (neither rowwise nor columnwise)")
}

/// One operand of the TN GEMM: its FP8 data of `rows` x `k` (row-major) and the scales.
struct BlockOperand {
    data: DevPtr,
    dtype: DType,
    scale_inv: DevPtr,
}

/// Operand `what` of `t`: its rowwise data when `rowwise`, else its columnwise data,
/// checked to be FP8 [rows, k] with float32 scales in the GEMM-ready layout of `blocks`.
fn block_operand(
    t: &Tensor,
    what: &str,
    rowwise: bool,
    (rows, k): (usize, usize),
    blocks: BlockMode,
) -> Result<BlockOperand> {
    let (data, scale, usage, param) = if rowwise {
        (&t.data, &t.scale_inv, "rowwise", "kNVTERowwiseScaleInv")
    } else {
        (
            &t.columnwise_data,
            &t.columnwise_scale_inv,
            "columnwise",
            "kNVTEColumnwiseScaleInv",
        )
    };
    let trans = if what == "A" { "transa" } else { "transb" };
    if data.ptr.is_null() {
        invalid!(
            "tensor `{what}` is missing {usage} data: the block-scaled GEMM reads it for {trans} = {} (TE's TN rule)",
            what == "A" && rowwise || what == "B" && !rowwise
        );
    }
    if !data.dtype.is_fp8() {
        unsupported!(
            "tensor `{what}`'s {usage} data is {}: block-scaled GEMMs take FP8 (e4m3 / e5m2) data",
            data.dtype.name()
        );
    }
    if data.rows_cols() != Some((rows, k)) {
        invalid!(
            "tensor `{what}`'s {usage} data has shape {} but the GEMM needs [{rows}, {k}]",
            data.shape
        );
    }
    if blocks == BlockMode::OneD && t.block_format == ScaleFormat::Compact {
        unsupported!(
            "tensor `{what}` holds 1D block scales in the COMPACT format: the GEMM reads the GEMM_READY format (quantize with it)"
        );
    }
    let want = gemm_ready_scale_shape(blocks, rows, k);
    if scale.ptr.is_null() || scale.dtype != DType::F32 || scale.shape.as_slice() != want {
        invalid!(
            "tensor `{what}`'s {usage} scale_inv ({param}) is {} of shape {}{} but {} data [{rows}, {k}] needs kNVTEFloat32 {want:?} (TE's GEMM-ready layout)",
            scale.dtype.name(),
            scale.shape,
            if scale.ptr.is_null() { ", NULL" } else { "" },
            blocks.name()
        );
    }
    Ok(BlockOperand {
        data: data.ptr,
        dtype: data.dtype,
        scale_inv: scale.ptr,
    })
}

/// The GEMM's sizes (m, n, k) from the logical shapes, with D checked to be [n, m].
fn block_dims(g: &TeGemm) -> Result<(usize, usize, usize)> {
    let (a0, a1) = logical_2d(g.a, "A")?;
    let (b0, b1) = logical_2d(g.b, "B")?;
    let (m, k) = if g.transa { (a0, a1) } else { (a1, a0) };
    let (n, kb) = if g.transb { (b1, b0) } else { (b0, b1) };
    if kb != k {
        invalid!(
            "inner dimensions differ: A [{a0}, {a1}] with transa = {} gives k = {k}, but B [{b0}, {b1}] with transb = {} gives k = {kb}",
            g.transa,
            g.transb
        );
    }
    let (dr, dc) = two_d(&g.d.data, "D")?;
    if (dr, dc) != (n, m) {
        invalid!(
            "tensor `D` has shape {} but must be [n, m] = [{n}, {m}]",
            g.d.data.shape
        );
    }
    require_data(&g.d.data, "D")?;
    for (x, w) in [(m, "m"), (n, "n"), (k, "k")] {
        if x > i32::MAX as usize {
            unsupported!("{w} = {x} exceeds cuBLASLt's 32-bit dimension limit");
        }
    }
    if g.math_sm_count < 0 {
        invalid!(
            "argument `math_sm_count` = {} must be >= 0",
            g.math_sm_count
        );
    }
    Ok((m, n, k))
}

/// cuBLASLt's alignment rules for block-scaled operands (TE's checks): k a multiple of
/// 16 (the leading dimension of both FP8 operands), m of 8, n of 8 when B is 1D.
fn block_alignment((m, n, k): (usize, usize, usize), b: BlockMode) -> Result<()> {
    if k % 16 != 0 {
        unsupported!(
            "block-scaled GEMM needs k to be a multiple of 16 (FP8 leading dimension); got k = {k}: pad it"
        );
    }
    if m % 8 != 0 {
        unsupported!("block-scaled GEMM needs m to be a multiple of 8; got m = {m}: pad it");
    }
    if b == BlockMode::OneD && n % 8 != 0 {
        unsupported!(
            "block-scaled GEMM with a 1D-scaled B needs n to be a multiple of 8; got n = {n}: pad it"
        );
    }
    Ok(())
}

/// Validate a block-scaled GEMM and translate it into the TN [`GemmDesc`] cuBLASLt runs
/// (the scale_inv pointers are the block scales), with both operands' blocks.
pub(super) fn block_desc(g: &TeGemm) -> Result<(GemmDesc, [BlockMode; 2])> {
    let blocks = operand_blocks(g)?;
    let (m, n, k) = block_dims(g)?;
    let a = block_operand(g.a, "A", g.transa, (m, k), blocks[0])?;
    let b = block_operand(g.b, "B", !g.transb, (n, k), blocks[1])?;
    if a.dtype == DType::E5M2 && b.dtype == DType::E5M2 {
        unsupported!(
            "FP8 GEMM with both inputs kNVTEFloat8E5M2 is not supported by cuBLASLt (use e4m3 for at least one)"
        );
    }
    block_alignment((m, n, k), blocks[1])?;
    let dt = g.d.data.dtype;
    if !matches!(dt, DType::BF16 | DType::F16 | DType::F32) {
        unsupported!(
            "block-scaled GEMM output must be kNVTEBFloat16, kNVTEFloat16 or kNVTEFloat32; got {}",
            dt.name()
        );
    }
    let ep = epilogue_operands(g, (m, n), true)?;
    if !matches!(
        ep.epilogue,
        Epilogue::None | Epilogue::Bias | Epilogue::DGelu
    ) {
        unsupported!(
            "epilogue {:?} is not available for block-scaled FP8 GEMMs in cuBLASLt: none, bias (forward) and DGELU (grad with pre_gelu_out, no bias) are",
            ep.epilogue
        );
    }
    let (workspace, workspace_bytes) = match g.workspace {
        Some(w) if !w.data.ptr.is_null() => (w.data.ptr, w.data.bytes()),
        _ => (DevPtr::NULL, 0),
    };
    let desc = GemmDesc {
        m,
        n,
        k,
        a: a.data,
        b: b.data,
        d: g.d.data.ptr,
        c: DevPtr::NULL,
        lda: k,
        ldb: k,
        ldd: m,
        a_type: a.dtype,
        b_type: b.dtype,
        d_type: dt,
        transa: true,
        transb: false,
        epilogue: ep.epilogue,
        bias: ep.bias,
        bias_type: ep.bias_type,
        aux: ep.aux,
        aux_type: ep.aux_type,
        a_scale_inv: a.scale_inv,
        b_scale_inv: b.scale_inv,
        d_scale: DevPtr::NULL,
        d_amax: DevPtr::NULL,
        accumulate: g.accumulate,
        fast_accum: !g.use_split_accumulator,
        sm_count: g.math_sm_count,
        workspace,
        workspace_bytes,
        blocks: None,
    };
    Ok((desc, blocks))
}

/// NVTE_COMM_BLOCK_GEMM: the backend of block-scaled GEMMs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum BlockBackend {
    /// cuBLASLt's block scale modes (the default)
    CublasLt,
    /// our sm90 kernel's `_block` variants wherever they compute the call, else cuBLASLt
    Own,
    /// ours where [`own_block_pays`], else cuBLASLt
    Auto,
}

/// NVTE_COMM_BLOCK_GEMM, read at each block-scaled GEMM (one environment lookup, small
/// beside the GEMM), so that one process can time both backends.
fn block_backend() -> Result<BlockBackend> {
    Ok(match crate::env::BLOCK_GEMM.get()?.unwrap_or(0) {
        1 => BlockBackend::Own,
        2 => BlockBackend::Auto,
        _ => BlockBackend::CublasLt,
    })
}

/// Whether our `_block` kernel is the faster backend for `g` (NVTE_COMM_BLOCK_GEMM=auto):
/// nowhere measured so far. On one H200 (2026-12-02, docs/results/2026-12.md, 933afeb,
/// `test_block_gemm --bench`, the four anchor shapes) it ran at 0.68-0.70 of cuBLASLt's
/// speed in 2D x 1D and 0.79-0.80 in 1D x 1D (bit-identical outputs), so auto keeps
/// cuBLASLt; a shape or mode where it wins belongs here once measured.
fn own_block_pays(_g: &GemmDesc) -> bool {
    false
}

/// Our kernel for the block-scaled `g` (its `blocks` set) with `alpha` and `beta` when
/// NVTE_COMM_BLOCK_GEMM routes it there: `own` wherever the kernel computes the call
/// (`sm90::supports_block`; an error where it cannot load: the knob asks for it), `auto`
/// where it also pays ([`own_block_pays`]) and loads (tried once per context; where it
/// cannot, cuBLASLt), `cublaslt` never. None: cuBLASLt runs the call.
fn own_block_gemm(
    g: &GemmDesc,
    alpha: f32,
    beta: f32,
    guard: &ContextGuard,
) -> Result<Option<std::sync::Arc<sm90::Sm90Gemm>>> {
    static LOADED: LoadedPerContext = Mutex::new(None);
    let backend = block_backend()?;
    let why = sm90::supports_block(g, alpha, beta);
    match backend {
        BlockBackend::CublasLt => Ok(None),
        BlockBackend::Own if why.is_some() => Ok(None),
        BlockBackend::Own => sm90::Sm90Gemm::get_with_block(guard).map(Some),
        BlockBackend::Auto if why.is_some() || !own_block_pays(g) => Ok(None),
        BlockBackend::Auto => Ok(load_once_per_context(&LOADED, guard.id, || {
            sm90::Sm90Gemm::get_with_block(guard)
        })),
    }
}

/// The oldest cuBLASLt with the block scale modes.
const BLOCK_CUBLASLT: usize = 120900;

/// Block-scaled GEMMs run on Hopper (sm_90) with cuBLASLt 12.9+ only.
fn require_block_support() -> Result<()> {
    // The guard's context is current (`for_stream_no_device` leaves its device unset).
    let device = cuda::current_device()?;
    let info = cuda::device_info(device)?;
    if (info.cc_major, info.cc_minor) != (9, 0) {
        unsupported!(
            "block-scaled FP8 GEMMs (NVTE_BLOCK_SCALING_1D / 2D) run on Hopper (sm_90) only; device {} is sm_{}{}",
            device,
            info.cc_major,
            info.cc_minor
        );
    }
    cuda::require(Lib::CublasLt)?;
    // SAFETY: plain query of the bound library.
    let v = unsafe { lt::cublasLtGetVersion() };
    if v < BLOCK_CUBLASLT {
        unsupported!(
            "block-scaled FP8 GEMMs need cuBLASLt 12.9 or newer (block scale modes); the loaded one is {v}"
        );
    }
    Ok(())
}

/// Plans of the scaled / block-scaled GEMMs kept per thread (beside `PLANS`: their
/// descriptors carry the scale modes).
const MAX_SCALED_PLANS: usize = 64;

/// A scaled plan's key: the plan's and the block scale modes.
type ScaledKey = (PlanKey, Option<[BlockMode; 2]>);

thread_local! {
    static SCALED_PLANS: RefCell<HashMap<ScaledKey, Plan>> =
        RefCell::new(HashMap::new());
}

/// Run a validated GEMM with `alpha` and `beta` (and the block scale modes `modes`): a
/// block-scaled one on our kernel where NVTE_COMM_BLOCK_GEMM routes it there
/// ([`own_block_gemm`]), else on cuBLASLt from a per-thread plan (no CUDA graph; the
/// heuristic's candidates timed on the plan's first eager run with beta = 0, as
/// `run_impl`).
///
/// # Safety
///
/// `g`'s addresses are live device memory of the extents its sizes and leading
/// dimensions imply (validated descriptors of vouched operands), as for [`run`].
pub(super) unsafe fn run_scaled(
    g: &GemmDesc,
    modes: Option<[BlockMode; 2]>,
    alpha: f32,
    beta: f32,
    stream: StreamHandle,
) -> Result<()> {
    if g.m == 0 || g.n == 0 {
        return Ok(());
    }
    if g.k == 0 {
        invalid!("k = 0: the GEMM has no inner dimension (TE requires k > 0 here)");
    }
    let guard = ContextGuard::for_stream_no_device(stream)?;
    if modes.is_some() {
        let gb = GemmDesc {
            blocks: modes,
            ..*g
        };
        if let Some(own) = own_block_gemm(&gb, alpha, beta, &guard)? {
            // SAFETY: the caller's contract; `run_block` checks the kernel's constraints
            // (`supports_block`) before the launch.
            return unsafe { own.run_block(&gb, beta, g.sm_count.max(0) as usize, stream) };
        }
        require_block_support()?;
    }
    let h = handle(guard.id)?;
    let key = (plan_key(g, &guard), modes);
    SCALED_PLANS.with(|plans| {
        let mut plans = plans.borrow_mut();
        if !plans.contains_key(&key) {
            if plans.len() >= MAX_SCALED_PLANS {
                for ((k, _), p) in plans.drain() {
                    p.destroy(k.ctx);
                }
            }
            let p = build_with(h, g, &key.0, guard.ctx, |d| set_modes(d, modes))?;
            plans.insert(key, p);
        }
        let p = plans.get_mut(&key).expect("inserted above");
        set_pointers(p.desc, g, &mut p.ptrs)?;
        // The plan's first eager run that overwrites D times the heuristic's candidates
        // (NVTE_COMM_GEMM_TUNE), as nvte_cublas_gemm's plans do.
        if !p.untimed.is_empty() && beta == 0.0 && !capture_status(stream)?.active() {
            p.algo = fastest(h, p, g, stream)?;
            p.untimed.clear();
            TIMED_PLANS.with(|c| c.set(c.get() + 1));
        }
        matmul_scaled(h, p, g, (alpha, beta), stream)
    })
}

/// The plan key of `g` (as `run_impl`'s).
fn plan_key(g: &GemmDesc, guard: &ContextGuard) -> PlanKey {
    PlanKey {
        ctx: guard.id,
        m: g.m,
        n: g.n,
        k: g.k,
        lda: g.lda,
        ldb: g.ldb,
        ldd: g.ldd,
        types: [g.a_type, g.b_type, g.d_type, g.bias_type, g.aux_type],
        transa: g.transa,
        transb: g.transb,
        epilogue: g.epilogue,
        fp8_ptrs: [
            !g.a_scale_inv.is_null(),
            !g.b_scale_inv.is_null(),
            !g.d_scale.is_null(),
            !g.d_amax.is_null(),
        ],
        fast_accum: g.fast_accum,
        sm_count: g.sm_count,
        workspace_bytes: g.workspace_bytes,
        align: [
            alignment(g.a),
            alignment(g.b),
            alignment(g.d),
            alignment(g.d),
        ],
    }
}

/// CUBLASLT_MATMUL_DESC_A_SCALE_MODE / B_SCALE_MODE of a block-scaled GEMM.
fn set_modes(desc: lt::cublasLtMatmulDesc_t, modes: Option<[BlockMode; 2]>) -> Result<()> {
    use lt::cublasLtMatmulDescAttributes_t as A;
    if let Some([a, b]) = modes {
        set_attr(
            desc,
            A::CUBLASLT_MATMUL_DESC_A_SCALE_MODE,
            &lt_scale_mode(a),
        )?;
        set_attr(
            desc,
            A::CUBLASLT_MATMUL_DESC_B_SCALE_MODE,
            &lt_scale_mode(b),
        )?;
    }
    Ok(())
}

/// `matmul` with the caller's alpha and beta (host values; C is D, not read at beta 0).
fn matmul_scaled(
    h: lt::cublasLtHandle_t,
    p: &Plan,
    g: &GemmDesc,
    (alpha, beta): (f32, f32),
    stream: StreamHandle,
) -> Result<()> {
    let c = if g.d_type.is_fp8() {
        std::ptr::null()
    } else {
        g.d.as_void() as *const c_void
    };
    // SAFETY: descriptors match the pointers validated by block_desc / desc_from_te;
    // alpha and beta are host floats read during the call.
    let s = unsafe {
        lt::cublasLtMatmul(
            h,
            p.desc,
            &alpha as *const f32 as *const c_void,
            g.a.as_void() as *const c_void,
            p.a,
            g.b.as_void() as *const c_void,
            p.b,
            &beta as *const f32 as *const c_void,
            c,
            p.c,
            g.d.as_void(),
            p.d,
            &p.algo,
            g.workspace.as_void(),
            g.workspace_bytes,
            stream.rt(),
        )
    };
    lt_check(s, "cublasLtMatmul")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::Shape;

    fn buf(ptr: u64, dtype: DType, dims: &[usize]) -> Buffer {
        Buffer::new(DevPtr::new(ptr), dtype, Shape::new(dims).unwrap()).unwrap()
    }

    /// A block-scaled tensor of logical shape [rows, cols] with rowwise and / or
    /// columnwise data and scales in the GEMM-ready layout.
    fn block_tensor(
        mode: BlockMode,
        rows: usize,
        cols: usize,
        rowwise: bool,
        colwise: bool,
    ) -> Tensor {
        let b = mode;
        let mut t = Tensor {
            scaling_mode: mode.scaling_mode(),
            ..Default::default()
        };
        if rowwise {
            t.data = buf(0x10000, DType::E4M3, &[rows, cols]);
            t.scale_inv = buf(0x20000, DType::F32, &gemm_ready_scale_shape(b, rows, cols));
        }
        if colwise {
            t.columnwise_data = buf(0x30000, DType::E4M3, &[cols, rows]);
            t.columnwise_scale_inv =
                buf(0x40000, DType::F32, &gemm_ready_scale_shape(b, cols, rows));
        }
        t
    }

    #[test]
    fn a_gathered_copy_is_all_of_b_with_gemm_ready_scales() {
        use BlockMode::{OneD, TwoD};
        let msg = |t: &Tensor, mode| check_gathered_scales(t, "B_copy", mode, 256, 384);
        for mode in [OneD, TwoD] {
            let ok = block_tensor(mode, 256, 384, true, false);
            msg(&ok, mode).unwrap();
            let other = if mode == OneD { TwoD } else { OneD };
            let e = msg(&ok, other).unwrap_err().msg;
            assert!(e.contains("scale_inv"), "{e}");
            let e = msg(&block_tensor(mode, 384, 256, true, false), mode)
                .unwrap_err()
                .msg;
            assert!(e.contains("rowwise data [256, 384]"), "{e}");
            let compact = Tensor {
                block_format: ScaleFormat::Compact,
                ..ok.clone()
            };
            let e = msg(&compact, mode).unwrap_err().msg;
            assert!(e.contains("COMPACT"), "{e}");
            let small = Tensor {
                scale_inv: buf(0x20000, DType::F32, &[1, 4]),
                ..ok.clone()
            };
            assert!(msg(&small, mode).is_err());
        }
    }

    fn out(n: usize, m: usize, dtype: DType) -> Tensor {
        Tensor {
            data: buf(0x50000, dtype, &[n, m]),
            ..Default::default()
        }
    }

    fn args<'a>(a: &'a Tensor, b: &'a Tensor, d: &'a Tensor, ta: bool, tb: bool) -> TeGemm<'a> {
        Operands {
            a,
            b,
            d,
            bias: None,
            pre_gelu_out: None,
            transa: ta,
            transb: tb,
            grad: false,
            workspace: None,
            accumulate: false,
            use_split_accumulator: true,
            math_sm_count: 0,
        }
    }

    #[test]
    fn scale_shapes_are_te_gemm_ready() {
        // TE's Float8BlockQuantizer::get_scale_shape for a [300, 1000] tensor.
        assert_eq!(gemm_ready_scale_shape(BlockMode::OneD, 300, 1000), [8, 300]);
        assert_eq!(gemm_ready_scale_shape(BlockMode::OneD, 301, 1000), [8, 304]);
        assert_eq!(
            gemm_ready_scale_shape(BlockMode::OneD, 1000, 300),
            [3, 1000]
        );
        assert_eq!(gemm_ready_scale_shape(BlockMode::TwoD, 300, 1000), [3, 8]);
        assert_eq!(gemm_ready_scale_shape(BlockMode::TwoD, 1000, 300), [8, 4]);
        assert_eq!(gemm_ready_scale_shape(BlockMode::TwoD, 128, 128), [1, 4]);
    }

    #[test]
    fn every_layout_reads_the_data_te_reads() {
        let (m, n, k) = (256, 128, 512);
        for (ta, tb) in [(true, false), (false, false), (true, true), (false, true)] {
            // A: logical [m, k] with transa, [k, m] without; B: [n, k] / [k, n] with transb.
            let a = if ta {
                block_tensor(BlockMode::TwoD, m, k, true, false)
            } else {
                block_tensor(BlockMode::TwoD, k, m, false, true)
            };
            let b = if tb {
                block_tensor(BlockMode::OneD, k, n, false, true)
            } else {
                block_tensor(BlockMode::OneD, n, k, true, false)
            };
            let d = out(n, m, DType::BF16);
            let (g, modes) = block_desc(&args(&a, &b, &d, ta, tb)).unwrap();
            assert_eq!((g.m, g.n, g.k, g.transa, g.transb), (m, n, k, true, false));
            assert_eq!((g.lda, g.ldb, g.ldd), (k, k, m));
            assert_eq!(modes, [BlockMode::TwoD, BlockMode::OneD]);
            let a_ptr = if ta { 0x10000 } else { 0x30000 };
            let b_ptr = if tb { 0x30000 } else { 0x10000 };
            assert_eq!((g.a.raw(), g.b.raw()), (a_ptr, b_ptr), "{ta} {tb}");
            assert_eq!(g.a_scale_inv.raw(), a_ptr + 0x10000);
            assert_eq!(g.b_scale_inv.raw(), b_ptr + 0x10000);
            // The usage TE needs is missing: named.
            let a_wrong = if ta {
                block_tensor(BlockMode::TwoD, m, k, false, true)
            } else {
                block_tensor(BlockMode::TwoD, k, m, true, false)
            };
            let e = block_desc(&args(&a_wrong, &b, &d, ta, tb)).unwrap_err();
            assert!(e.msg.contains("tensor `A` is missing"), "{}", e.msg);
        }
    }

    #[test]
    fn unsupported_combinations_are_refused_with_their_reason() {
        let (m, n, k) = (256, 128, 512);
        let d = out(n, m, DType::BF16);
        let a2 = block_tensor(BlockMode::TwoD, m, k, true, true);
        let b2 = block_tensor(BlockMode::TwoD, n, k, true, true);
        let e = block_desc(&args(&a2, &b2, &d, true, false)).unwrap_err();
        assert_eq!(e.kind, K::Unsupported);
        assert!(e.msg.contains("both NVTE_BLOCK_SCALING_2D"), "{}", e.msg);
        // Mixing block and per-tensor scaling.
        let pt = Tensor {
            data: buf(0x60000, DType::E4M3, &[n, k]),
            scale_inv: buf(0x70000, DType::F32, &[1]),
            ..Default::default()
        };
        let e = block_desc(&args(&a2, &pt, &d, true, false)).unwrap_err();
        assert!(e.msg.contains("mix block scaling"), "{}", e.msg);
        // The per-tensor path refuses block tensors.
        let e = desc_from_te(&args(&pt, &a2, &d, true, false)).unwrap_err();
        assert!(e.msg.contains("per-tensor scaling only"), "{}", e.msg);
        // FP8 output, unaligned shapes, wrong scale layouts, forward GELU.
        let b1 = block_tensor(BlockMode::OneD, n, k, true, true);
        let d8 = out(n, m, DType::E4M3);
        let e = block_desc(&args(&a2, &b1, &d8, true, false)).unwrap_err();
        assert!(e.msg.contains("output must be"), "{}", e.msg);
        let a_odd = block_tensor(BlockMode::OneD, m, 520, true, false);
        let b_odd = block_tensor(BlockMode::OneD, n, 520, true, false);
        let e = block_desc(&args(&a_odd, &b_odd, &d, true, false)).unwrap_err();
        assert!(e.msg.contains("multiple of 16"), "{}", e.msg);
        let mut compact = block_tensor(BlockMode::OneD, m, k, true, false);
        compact.scale_inv = buf(0x20000, DType::F32, &[m, k / 128]);
        let e = block_desc(&args(&compact, &b1, &d, true, false)).unwrap_err();
        assert!(e.msg.contains("GEMM-ready"), "{}", e.msg);
        let mut flagged = block_tensor(BlockMode::OneD, m, k, true, false);
        flagged.block_format = ScaleFormat::Compact;
        let e = block_desc(&args(&flagged, &b1, &d, true, false)).unwrap_err();
        assert!(e.msg.contains("COMPACT"), "{}", e.msg);
        let aux = out(n, m, DType::BF16);
        let mut g = args(&a2, &b1, &d, true, false);
        g.pre_gelu_out = Some(&aux);
        let e = block_desc(&g).unwrap_err();
        assert!(e.msg.contains("GeluAux"), "{}", e.msg);
        g.grad = true; // DGELU is available.
        assert_eq!(block_desc(&g).unwrap().0.epilogue, Epilogue::DGelu);
        // Mismatched k and a D of the wrong shape.
        let b_k = block_tensor(BlockMode::OneD, n, 384, true, false);
        let e = block_desc(&args(&a2, &b_k, &d, true, false)).unwrap_err();
        assert!(e.msg.contains("inner dimensions differ"), "{}", e.msg);
        let d_bad = out(m, n, DType::BF16);
        let e = block_desc(&args(&a2, &b1, &d_bad, true, false)).unwrap_err();
        assert!(e.msg.contains("must be [n, m]"), "{}", e.msg);
    }
}
