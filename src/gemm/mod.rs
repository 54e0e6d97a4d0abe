//! GEMM on cuBLASLt with TE's semantics (`nvte_cublas_gemm`): row-major tensors seen by
//! cuBLAS as column-major, epilogues (bias, GELU with aux, DGELU, bias gradient), FP8
//! scaling, accumulate, fast FP8 accumulation and an SM budget. Descriptors and the
//! heuristic's choice are cached per thread and shape ("plans").
pub mod block;
mod graphs;
pub mod sm90;

use crate::cuda::StreamHandle;
use crate::cuda::dynlib::cublaslt_sys as lt;
use crate::cuda::resources::{Event, capture_status};
use crate::cuda::{self, Checked, ContextGuard, CtxHandle, CtxId, DevPtr, Lib, LtHandle};
use crate::error::ErrorKind as K;
use crate::error::{Error, Result};
use crate::tensor::{Buffer, DType, Tensor};
use crate::{invalid, unsupported};
use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Mutex;

/// The epilogue TE selects from (bias, gelu aux, grad).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Epilogue {
    None,
    Bias,
    GeluAux,
    GeluAuxBias,
    DGelu,
    DGeluBGrad,
    BGradB,
}

impl Epilogue {
    pub fn select(bias: bool, gelu: bool, grad: bool) -> Epilogue {
        match (bias, gelu, grad) {
            (false, false, _) => Epilogue::None,
            (true, false, false) => Epilogue::Bias,
            (true, false, true) => Epilogue::BGradB,
            (false, true, false) => Epilogue::GeluAux,
            (false, true, true) => Epilogue::DGelu,
            (true, true, false) => Epilogue::GeluAuxBias,
            (true, true, true) => Epilogue::DGeluBGrad,
        }
    }
    fn to_lt(self) -> lt::cublasLtEpilogue_t {
        use lt::cublasLtEpilogue_t as E;
        match self {
            Epilogue::None => E::CUBLASLT_EPILOGUE_DEFAULT,
            Epilogue::Bias => E::CUBLASLT_EPILOGUE_BIAS,
            Epilogue::GeluAux => E::CUBLASLT_EPILOGUE_GELU_AUX,
            Epilogue::GeluAuxBias => E::CUBLASLT_EPILOGUE_GELU_AUX_BIAS,
            Epilogue::DGelu => E::CUBLASLT_EPILOGUE_DGELU,
            Epilogue::DGeluBGrad => E::CUBLASLT_EPILOGUE_DGELU_BGRAD,
            Epilogue::BGradB => E::CUBLASLT_EPILOGUE_BGRADB,
        }
    }
    pub fn uses_bias(self) -> bool {
        matches!(
            self,
            Epilogue::Bias | Epilogue::GeluAuxBias | Epilogue::DGeluBGrad | Epilogue::BGradB
        )
    }
    pub fn uses_aux(self) -> bool {
        matches!(
            self,
            Epilogue::GeluAux | Epilogue::GeluAuxBias | Epilogue::DGelu | Epilogue::DGeluBGrad
        )
    }
}

/// A fully validated GEMM in cuBLAS (column-major) terms:
/// D[m x n] = op(A)[m x k] * op(B)[k x n] (+ C if accumulate; C is D unless `c` is set),
/// epilogue applied.
/// Pointers are device addresses; the overlap engine builds these for chunks directly.
#[derive(Clone, Copy, Debug)]
pub struct GemmDesc {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub a: DevPtr,
    pub b: DevPtr,
    pub d: DevPtr,
    /// What an accumulating GEMM adds: NULL = D itself (in place), else a matrix laid out
    /// like D (D's leading dimension; D's type, or for an FP8 D the bias type as cuBLASLt
    /// requires; not overlapping D). Set only by the overlap algorithms, never from
    /// caller arguments. Not part of `check_key`: where the sum comes from is the
    /// algorithm's business (the algorithms' own keys say it).
    pub c: DevPtr,
    pub lda: usize,
    pub ldb: usize,
    pub ldd: usize,
    pub a_type: DType,
    pub b_type: DType,
    pub d_type: DType,
    pub transa: bool,
    pub transb: bool,
    pub epilogue: Epilogue,
    pub bias: DevPtr,
    pub bias_type: DType,
    pub aux: DevPtr,
    pub aux_type: DType,
    pub a_scale_inv: DevPtr,
    pub b_scale_inv: DevPtr,
    pub d_scale: DevPtr,
    pub d_amax: DevPtr,
    pub accumulate: bool,
    pub fast_accum: bool,
    pub sm_count: i32,
    pub workspace: DevPtr,
    pub workspace_bytes: usize,
    /// Block-scaled FP8 operands (A's and B's blocks; `a_scale_inv` / `b_scale_inv` are
    /// their GEMM-ready block scales, the GEMM TN): only [`desc_from_te_block`] sets it,
    /// and such a descriptor runs on cuBLASLt's block scale modes or, as
    /// NVTE_COMM_BLOCK_GEMM chooses, our kernel's `_block` variants (`block::run_scaled`).
    pub blocks: Option<[crate::tensor::BlockMode; 2]>,
}

impl GemmDesc {
    /// B's address for the GEMM of output rows [row, ..) (row = n index: a row of B, or
    /// with transb a column of the stored B): what the row-chunk GEMMs of the overlap
    /// algorithms pass.
    pub fn b_from_row(&self, row: usize) -> DevPtr {
        self.b + if self.transb { row } else { row * self.ldb } * (self.b_type.bits() / 8)
    }

    /// What must agree on every rank of a collective call with this GEMM (the cross-rank
    /// check, NVTE_COMM_CHECK): shape, types, layout, epilogue and accumulation, not the
    /// addresses or the SM budget.
    pub fn check_key(&self) -> [u64; 5] {
        let t = |d: DType| d as u64 & 0xff;
        [
            self.m as u64,
            self.n as u64,
            self.k as u64,
            t(self.a_type) | t(self.b_type) << 8 | t(self.d_type) << 16 | t(self.aux_type) << 24,
            self.transa as u64
                | (self.transb as u64) << 1
                | (self.accumulate as u64) << 2
                | (!self.bias.is_null() as u64) << 3
                | (!self.aux.is_null() as u64) << 4
                | (self.epilogue as u64) << 8
                | match self.blocks {
                    None => 0,
                    Some([a, b]) => (1 | (a as u64) << 1 | (b as u64) << 2) << 16,
                },
        ]
    }

    /// [`Self::check_key`] of a GEMM whose partial sums are reduced across the ranks (k
    /// split: each rank's k is its share, and one rank adds the bias): without k and the
    /// bias (a bias-only epilogue counts as none), which legitimately differ from rank to
    /// rank.
    pub fn sum_key(&self) -> [u64; 5] {
        let epilogue = match self.epilogue {
            Epilogue::Bias => Epilogue::None,
            e => e,
        };
        let mut k = Self {
            k: 0,
            bias: DevPtr::NULL,
            epilogue,
            ..*self
        }
        .check_key();
        k[2] = 0;
        k
    }
}

fn lt_type(d: DType) -> lt::cudaDataType_t {
    use lt::cudaDataType_t as T;
    match d {
        DType::F32 => T::CUDA_R_32F,
        DType::F16 => T::CUDA_R_16F,
        DType::BF16 => T::CUDA_R_16BF,
        DType::E4M3 => T::CUDA_R_8F_E4M3,
        DType::E5M2 => T::CUDA_R_8F_E5M2,
        // Rejected by validation before any descriptor is built.
        _ => T::CUDA_R_32F,
    }
}

fn require_data(b: &Buffer, what: &str) -> Result<()> {
    if b.numel() > 0 && b.ptr.is_null() {
        invalid!(
            "tensor `{what}` has shape {} but a NULL data pointer",
            b.shape
        );
    }
    Ok(())
}

fn two_d(b: &Buffer, what: &str) -> Result<(usize, usize)> {
    b.rows_cols().ok_or_else(|| {
        Error::invalid(format!(
            "tensor `{what}` must have at least 2 dimensions, got shape {} (ndim {})",
            b.shape, b.shape.ndim
        ))
    })
}

/// TE's GEMM operands (nvte_cublas_gemm's arguments, resolved to tensors): the one
/// operands struct of the GEMM and of every overlap operation, built once per call by
/// ffi/. `D` is the output's type: a tensor, or for the reduce-scatter operations an
/// optional view of the engine's buffer (`overlap::rs::RsArgs`).
#[derive(Clone, Copy)]
pub struct Operands<'a, D = &'a Tensor> {
    pub a: &'a Tensor,
    pub b: &'a Tensor,
    pub d: D,
    pub bias: Option<&'a Tensor>,
    pub pre_gelu_out: Option<&'a Tensor>,
    pub transa: bool,
    pub transb: bool,
    pub grad: bool,
    pub workspace: Option<&'a Tensor>,
    pub accumulate: bool,
    pub use_split_accumulator: bool,
    pub math_sm_count: i32,
}

/// nvte_cublas_gemm's operands (a tensor output).
pub type TeGemm<'a> = Operands<'a>;

impl<'a, D> Operands<'a, D> {
    /// The same operands with output `d`.
    pub fn with_d<E>(&self, d: E) -> Operands<'a, E> {
        Operands {
            a: self.a,
            b: self.b,
            d,
            bias: self.bias,
            pre_gelu_out: self.pre_gelu_out,
            transa: self.transa,
            transb: self.transb,
            grad: self.grad,
            workspace: self.workspace,
            accumulate: self.accumulate,
            use_split_accumulator: self.use_split_accumulator,
            math_sm_count: self.math_sm_count,
        }
    }
}

/// Validate TE's arguments and translate them into a [`GemmDesc`]: the shapes, the
/// element types, the FP8 scaling factors, the epilogue's operands, the workspace.
pub fn desc_from_te(g: &TeGemm) -> Result<GemmDesc> {
    block::require_per_tensor([g.a.scaling_mode, g.b.scaling_mode])?;
    let dims = te_dims(g)?;
    let (m, n, k) = (dims.m, dims.n, dims.k);
    let (at, bt, dt) = (g.a.data.dtype, g.b.data.dtype, g.d.data.dtype);
    let fp8 = check_types(g, (m, k))?;
    let (a_scale_inv, b_scale_inv, d_scale, d_amax) = fp8_scales(g)?;
    let ep = epilogue_operands(g, (m, n), fp8)?;
    let (workspace, workspace_bytes) = match g.workspace {
        Some(w) if !w.data.ptr.is_null() => (w.data.ptr, w.data.bytes()),
        _ => (DevPtr::NULL, 0),
    };
    Ok(GemmDesc {
        m,
        n,
        k,
        a: g.a.data.ptr,
        b: g.b.data.ptr,
        d: g.d.data.ptr,
        c: DevPtr::NULL,
        lda: dims.lda,
        ldb: dims.ldb,
        ldd: dims.ldd,
        a_type: at,
        b_type: bt,
        d_type: dt,
        transa: g.transa,
        transb: g.transb,
        epilogue: ep.epilogue,
        bias: ep.bias,
        bias_type: ep.bias_type,
        aux: ep.aux,
        aux_type: ep.aux_type,
        a_scale_inv,
        b_scale_inv,
        d_scale,
        d_amax,
        accumulate: g.accumulate,
        fast_accum: fp8 && !g.use_split_accumulator,
        sm_count: g.math_sm_count,
        workspace,
        workspace_bytes,
        blocks: None,
    })
}

/// [`desc_from_te`] that also takes block-scaled FP8 operands (NVTE_BLOCK_SCALING_1D /
/// 2D; `GemmDesc::blocks` set, the GEMM TN with the GEMM-ready scales): for the overlap
/// algorithms that keep a block descriptor's scales valid for each GEMM they run (whole
/// GEMMs, or chunks along whole 128-row tiles of a 2D-scaled operand).
pub fn desc_from_te_block(g: &TeGemm) -> Result<GemmDesc> {
    if block::is_block(g) {
        block::block_desc(g).map(|(mut d, modes)| {
            d.blocks = Some(modes);
            d
        })
    } else {
        desc_from_te(g)
    }
}

/// A GEMM's sizes and leading dimensions (cuBLAS's column-major terms).
struct Dims {
    m: usize,
    n: usize,
    k: usize,
    lda: usize,
    ldb: usize,
    ldd: usize,
}

/// The layout, the operands' shapes (A, B and D agree), their data and the SM count.
fn te_dims(g: &TeGemm) -> Result<Dims> {
    let (ab, bb, db) = (&g.a.data, &g.b.data, &g.d.data);
    if g.transa && g.transb {
        invalid!(
            "layout TT (transa = true, transb = true) is not allowed (TE supports TN, NN, NT)"
        );
    }
    let (ar, ac) = two_d(ab, "A")?;
    let (br, bc) = two_d(bb, "B")?;
    let (dr, dc) = two_d(db, "D")?;
    let (m, k) = if g.transa { (ar, ac) } else { (ac, ar) };
    let (n, kb) = if g.transb { (bc, br) } else { (br, bc) };
    if kb != k {
        invalid!(
            "inner dimensions differ: A {} with transa = {} gives k = {k}, but B {} with transb = {} gives k = {kb}",
            ab.shape,
            g.transa,
            bb.shape,
            g.transb
        );
    }
    if (dr, dc) != (n, m) {
        invalid!(
            "tensor `D` has shape {} but must be [n, m] = [{n}, {m}] for A {} and B {}",
            db.shape,
            ab.shape,
            bb.shape
        );
    }
    for (b, w) in [(ab, "A"), (bb, "B"), (db, "D")] {
        require_data(b, w)?;
    }
    if g.math_sm_count < 0 {
        invalid!(
            "argument `math_sm_count` = {} must be >= 0",
            g.math_sm_count
        );
    }
    for (x, w) in [(m, "m"), (n, "n"), (k, "k")] {
        if x > i32::MAX as usize {
            unsupported!("{w} = {x} exceeds cuBLASLt's 32-bit dimension limit");
        }
    }
    Ok(Dims {
        m,
        n,
        k,
        lda: if g.transa { k } else { m },
        ldb: if g.transb { n } else { k },
        ldd: m,
    })
}

/// The element types cuBLASLt takes (with the FP8 rules); whether the GEMM is FP8.
fn check_types(g: &TeGemm, (m, k): (usize, usize)) -> Result<bool> {
    let (at, bt, dt) = (g.a.data.dtype, g.b.data.dtype, g.d.data.dtype);
    let fp8 = at.is_fp8() || bt.is_fp8();
    let gemm_types = [
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::E4M3,
        DType::E5M2,
    ];
    for (t, w) in [(at, "A"), (bt, "B"), (dt, "D")] {
        if !gemm_types.contains(&t) {
            unsupported!(
                "tensor `{w}` dtype {} is not supported by the GEMM (float32, float16, bfloat16, fp8 e4m3/e5m2)",
                t.name()
            );
        }
    }
    if fp8 {
        if !(at.is_fp8() && bt.is_fp8()) {
            unsupported!(
                "mixed FP8 / non-FP8 inputs ({} x {}) are not supported by cuBLASLt: quantize both",
                at.name(),
                bt.name()
            );
        }
        if at == DType::E5M2 && bt == DType::E5M2 {
            unsupported!(
                "FP8 GEMM with both inputs kNVTEFloat8E5M2 is not supported by cuBLASLt (use e4m3 for at least one)"
            );
        }
        if !g.transa || g.transb {
            unsupported!(
                "FP8 GEMM requires the TN layout (transa = true, transb = false) on Hopper; got transa = {}, transb = {}",
                g.transa,
                g.transb
            );
        }
        if k % 16 != 0 || m % 16 != 0 {
            unsupported!(
                "FP8 GEMM needs k and m to be multiples of 16 (cuBLASLt alignment); got m = {m}, k = {k}"
            );
        }
    } else {
        if at != bt {
            unsupported!(
                "A dtype {} and B dtype {} differ: non-FP8 GEMMs need equal input types",
                at.name(),
                bt.name()
            );
        }
        if dt.is_fp8() {
            unsupported!("FP8 output ({}) needs FP8 inputs", dt.name());
        }
        if dt != at && dt != DType::F32 {
            unsupported!(
                "output dtype {} with {} inputs is not supported: use {} or kNVTEFloat32",
                dt.name(),
                at.name(),
                at.name()
            );
        }
    }
    Ok(fp8)
}

/// The FP8 scaling factors: A's and B's scale_inv, D's scale and amax (NULL where the
/// tensor is not FP8).
fn fp8_scales(g: &TeGemm) -> Result<(DevPtr, DevPtr, DevPtr, DevPtr)> {
    let (at, bt, dt) = (g.a.data.dtype, g.b.data.dtype, g.d.data.dtype);
    let scalar = |b: &Buffer, which: &str, name: &str| -> Result<DevPtr> {
        Tensor::scalar_ptr(b)
            .ok_or_else(|| Error::invalid(format!("tensor `{which}` is FP8 but has no {name}")))
    };
    let a_scale_inv = if at.is_fp8() {
        scalar(&g.a.scale_inv, "A", "scale_inv (kNVTERowwiseScaleInv)")?
    } else {
        DevPtr::NULL
    };
    let b_scale_inv = if bt.is_fp8() {
        scalar(&g.b.scale_inv, "B", "scale_inv (kNVTERowwiseScaleInv)")?
    } else {
        DevPtr::NULL
    };
    let (d_scale, d_amax) = if dt.is_fp8() {
        if g.accumulate {
            unsupported!(
                "accumulate = true is not supported with an FP8 output ({})",
                dt.name()
            );
        }
        (
            scalar(&g.d.scale, "D", "scale (kNVTEScale)")?,
            Tensor::scalar_ptr(&g.d.amax).unwrap_or_default(),
        )
    } else {
        (DevPtr::NULL, DevPtr::NULL)
    };
    Ok((a_scale_inv, b_scale_inv, d_scale, d_amax))
}

/// The epilogue and its operands.
struct EpilogueOperands {
    epilogue: Epilogue,
    bias: DevPtr,
    bias_type: DType,
    aux: DevPtr,
    aux_type: DType,
}

/// The epilogue from the bias, the pre-GELU output and `grad`, with its operands checked.
fn epilogue_operands(g: &TeGemm, (m, n): (usize, usize), fp8: bool) -> Result<EpilogueOperands> {
    let dt = g.d.data.dtype;
    let bias = g.bias.map(|t| &t.data).filter(|b| !b.ptr.is_null());
    let aux = g.pre_gelu_out.map(|t| &t.data).filter(|b| !b.ptr.is_null());
    let epilogue = Epilogue::select(bias.is_some(), aux.is_some(), g.grad);
    let (mut bias_ptr, mut bias_type) = (DevPtr::NULL, if dt.is_fp8() { DType::BF16 } else { dt });
    if let Some(bb) = bias {
        check_bias(bb, epilogue, (m, n), dt, fp8)?;
        bias_ptr = bb.ptr;
        bias_type = bb.dtype;
    }
    let (mut aux_ptr, mut aux_type) = (DevPtr::NULL, dt);
    if let Some(xb) = aux {
        check_aux(xb, (m, n), dt, fp8)?;
        aux_ptr = xb.ptr;
        aux_type = xb.dtype;
    }
    Ok(EpilogueOperands {
        epilogue,
        bias: bias_ptr,
        bias_type,
        aux: aux_ptr,
        aux_type,
    })
}

/// The bias: its length (m, or n for the bias gradient of B) and type.
fn check_bias(
    bb: &Buffer,
    epilogue: Epilogue,
    (m, n): (usize, usize),
    dt: DType,
    fp8: bool,
) -> Result<()> {
    let want = if epilogue == Epilogue::BGradB { n } else { m };
    if bb.numel() != want {
        let what = if epilogue == Epilogue::BGradB {
            "n (bias gradient of B)"
        } else {
            "m"
        };
        invalid!(
            "tensor `bias` has {} elements (shape {}) but must have {what} = {want}",
            bb.numel(),
            bb.shape
        );
    }
    if fp8 {
        // cuBLASLt's FP8 table: the bias is typed like a 16-bit output, bf16 for a
        // float32 output, and bf16 or fp16 for an FP8 output.
        let ok = match dt {
            DType::F16 => bb.dtype == DType::F16,
            DType::BF16 | DType::F32 => bb.dtype == DType::BF16,
            _ => matches!(bb.dtype, DType::BF16 | DType::F16),
        };
        if !ok {
            unsupported!(
                "bias dtype {} is not supported with FP8 inputs and output {} (cuBLASLt: bf16 bias for bf16/float32 output, fp16 for fp16, bf16 or fp16 for FP8)",
                bb.dtype.name(),
                dt.name()
            );
        }
    } else if bb.dtype != dt {
        unsupported!(
            "bias dtype {} must equal the output dtype {} for non-FP8 GEMMs",
            bb.dtype.name(),
            dt.name()
        );
    }
    Ok(())
}

/// The pre-GELU output: [n, m], 16/32-bit, typed like D for non-FP8 GEMMs.
fn check_aux(xb: &Buffer, (m, n): (usize, usize), dt: DType, fp8: bool) -> Result<()> {
    if xb.numel() != n * m {
        invalid!(
            "tensor `pre_gelu_out` has {} elements (shape {}) but must be [n, m] = [{n}, {m}]",
            xb.numel(),
            xb.shape
        );
    }
    if xb.dtype.is_fp8() {
        unsupported!("an FP8 pre_gelu_out ({}) is not supported", xb.dtype.name());
    }
    if !fp8 && xb.dtype != dt {
        unsupported!(
            "pre_gelu_out dtype {} must equal the output dtype {} for non-FP8 GEMMs",
            xb.dtype.name(),
            dt.name()
        );
    }
    if m % 8 != 0 {
        unsupported!(
            "GELU epilogues need m to be a multiple of 8 (cuBLASLt aux leading dimension); got m = {m}"
        );
    }
    Ok(())
}

fn lt_check(s: lt::cublasStatus_t, call: &str) -> Result<()> {
    lt_check_with(s, || call.to_string())
}

/// [`lt_check`] with the call's name made only on failure (counted: `host::counters`).
fn lt_check_with(s: lt::cublasStatus_t, call: impl FnOnce() -> String) -> Result<()> {
    crate::host::count_lib_call();
    if s == lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        return Ok(());
    }
    // SAFETY: returns a static string.
    let name = unsafe { std::ffi::CStr::from_ptr(lt::cublasLtGetStatusName(s)) }
        .to_string_lossy()
        .into_owned();
    let status = match s {
        lt::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED => K::Unsupported,
        lt::cublasStatus_t::CUBLAS_STATUS_ALLOC_FAILED => K::OutOfMemory,
        _ => K::Cublas,
    };
    Err(Error::new(status, format!("{} failed: {name}", call())))
}

/// One cuBLASLt handle per context (by its id: a reset device's new context gets its
/// own), created on first use and kept for the process.
fn handle(ctx: CtxId) -> Result<lt::cublasLtHandle_t> {
    static HANDLES: Mutex<Vec<(CtxId, LtHandle)>> = Mutex::new(Vec::new());
    let mut g = HANDLES.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(&(_, h)) = g.iter().find(|(c, _)| *c == ctx) {
        return Ok(h.raw());
    }
    cuda::require(Lib::CublasLt)?;
    let mut h: lt::cublasLtHandle_t = std::ptr::null_mut();
    // SAFETY: out pointer; the context is current.
    lt_check(unsafe { lt::cublasLtCreate(&mut h) }, "cublasLtCreate")?;
    g.push((ctx, LtHandle::from_raw(h)));
    Ok(h)
}

fn alignment(p: DevPtr) -> u32 {
    if p.is_null() {
        256
    } else {
        (1u32 << p.raw().trailing_zeros().min(8)).min(256)
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
struct PlanKey {
    /// the context's id ([`cuda::ContextGuard::id`])
    ctx: CtxId,
    m: usize,
    n: usize,
    k: usize,
    lda: usize,
    ldb: usize,
    ldd: usize,
    types: [DType; 5],
    transa: bool,
    transb: bool,
    epilogue: Epilogue,
    fp8_ptrs: [bool; 4],
    fast_accum: bool,
    sm_count: i32,
    workspace_bytes: usize,
    align: [u32; 4],
}

struct Plan {
    desc: lt::cublasLtMatmulDesc_t,
    a: lt::cublasLtMatrixLayout_t,
    b: lt::cublasLtMatrixLayout_t,
    c: lt::cublasLtMatrixLayout_t,
    d: lt::cublasLtMatrixLayout_t,
    algo: lt::cublasLtMatmulAlgo_t,
    /// the heuristic's other algorithms, timed on the plan's first eager run
    /// (NVTE_COMM_GEMM_TUNE) and then dropped
    untimed: Vec<lt::cublasLtMatmulAlgo_t>,
    /// the pointer attributes the descriptor holds (`set_pointers`)
    ptrs: [DevPtr; 6],
    /// the plan's calls replayed as CUDA graphs (NVTE_COMM_GEMM_GRAPHS)
    graphs: graphs::Graphs,
    /// the plan's context (its id is the key's): its graphs are destroyed only while
    /// that context exists
    ctx_addr: CtxHandle,
}

/// Heuristic algorithms a plan considers (NVTE_COMM_GEMM_TUNE: timed on first use).
const GEMM_CANDIDATES: usize = 8;
/// Only GEMMs of at least this many multiply-adds (m n k) are timed: below it the
/// timing costs more than a better algorithm can save.
const TUNE_MIN_MNK: usize = 1 << 30;
/// At most this many plans are timed per thread (workloads with ever new shapes, e.g.
/// varying sequence lengths, must not keep timing).
const TUNE_MAX_PLANS: usize = 256;

/// NVTE_COMM_OWN_GEMM (a boolean, read once; default on): a GEMM below [`TUNE_MIN_MNK`]
/// multiply-adds that our own sm90 kernel computes ([`sm90::supports`]: TN, bf16 / e4m3
/// in, bf16 / fp32 out, no epilogue) runs on it instead of cuBLASLt. At such sizes the
/// host's cost decides: one launch with cached tensor maps against cuBLASLt's descriptor
/// and heuristic path (a bare cublasLtMatmul alone took 8.4-9.1 us of host at 256^3 on
/// an H100, 2026-11-26, above the 10 us a whole library call may cost). Where the kernel
/// cannot load (not sm_90, no NVRTC) cuBLASLt runs, and the load is not retried.
fn own_gemm_enabled() -> Result<bool> {
    static V: std::sync::OnceLock<std::result::Result<bool, String>> = std::sync::OnceLock::new();
    crate::env::once(&V, || Ok(crate::env::OWN_GEMM.get()?.unwrap_or(true)))
}

/// Our kernel for `g` when NVTE_COMM_OWN_GEMM routes it there (see [`own_gemm_enabled`]).
fn small_own_gemm(
    g: &GemmDesc,
    guard: &ContextGuard,
) -> Result<Option<std::sync::Arc<sm90::Sm90Gemm>>> {
    static LOADED: LoadedPerContext = Mutex::new(None);
    if g.blocks.is_some()
        || !own_gemm_enabled()?
        || g.m.saturating_mul(g.n).saturating_mul(g.k) >= TUNE_MIN_MNK
        || sm90::supports(g).is_some()
    {
        return Ok(None);
    }
    Ok(load_once_per_context(&LOADED, guard.id, || {
        sm90::Sm90Gemm::get(guard)
    }))
}

/// Our sm90 kernel by context, as [`load_once_per_context`] keeps it: None where its load
/// failed (not retried).
type LoadedPerContext = Mutex<Option<HashMap<CtxId, Option<std::sync::Arc<sm90::Sm90Gemm>>>>>;

/// The kernel of context `ctx` in `cache`, loaded by `load` at its first use there (an
/// NVRTC compile, outside the lock: other threads' and contexts' GEMMs go on meanwhile). A
/// context where the load fails keeps None, and cuBLASLt runs its GEMMs.
fn load_once_per_context(
    cache: &LoadedPerContext,
    ctx: CtxId,
    load: impl FnOnce() -> Result<std::sync::Arc<sm90::Sm90Gemm>>,
) -> Option<std::sync::Arc<sm90::Sm90Gemm>> {
    let lock = || cache.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(b) = lock().get_or_insert_with(HashMap::new).get(&ctx) {
        return b.clone();
    }
    let b = load().ok();
    lock()
        .get_or_insert_with(HashMap::new)
        .entry(ctx)
        .or_insert(b)
        .clone()
}

/// NVTE_COMM_GEMM_TUNE (a boolean; default on): time the heuristic's top algorithms
/// on each GEMM shape's first eager run that does not accumulate, keep the fastest.
pub fn tune_enabled() -> Result<bool> {
    Ok(crate::env::GEMM_TUNE.get()?.unwrap_or(true))
}

impl Plan {
    /// Release the plan: its cuBLASLt descriptors (host objects), and its graphs where
    /// their context (address, `id`) still exists; after a device reset the reset has
    /// freed them, and their handles may name the new context's graphs.
    fn destroy(mut self, id: CtxId) {
        let execs = self.graphs.take();
        let _relaxed = cuda::resources::RelaxedCapture::new();
        let owner = cuda::CtxRef {
            handle: self.ctx_addr,
            id,
        };
        if cuda::context_alive(owner) {
            graphs::destroy(execs);
        }
        // SAFETY: descriptors created by `build`, destroyed once when evicted.
        unsafe {
            lt::cublasLtMatmulDescDestroy(self.desc);
            for l in [self.a, self.b, self.c, self.d] {
                lt::cublasLtMatrixLayoutDestroy(l);
            }
        }
    }
}

const MAX_PLANS: usize = 512;

thread_local! {
    static PLANS: RefCell<HashMap<PlanKey, Plan, crate::host::FxBuild>> =
        RefCell::new(HashMap::default());
    static TIMED_PLANS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

fn set_attr<T>(
    desc: lt::cublasLtMatmulDesc_t,
    attr: lt::cublasLtMatmulDescAttributes_t,
    v: &T,
) -> Result<()> {
    // SAFETY: `v` is a value of the type cuBLASLt documents for `attr`.
    lt_check_with(
        unsafe {
            lt::cublasLtMatmulDescSetAttribute(
                desc,
                attr,
                v as *const T as *const c_void,
                std::mem::size_of::<T>(),
            )
        },
        || format!("cublasLtMatmulDescSetAttribute({attr:?})"),
    )
}

/// The per-call pointer attributes of a GEMM: bias, aux, A / B scale_inv, D scale, D
/// amax (NULL: not set; which ones a plan uses is part of its key).
fn pointers(g: &GemmDesc) -> [DevPtr; 6] {
    [
        if g.epilogue.uses_bias() {
            g.bias
        } else {
            DevPtr::NULL
        },
        if g.epilogue.uses_aux() {
            g.aux
        } else {
            DevPtr::NULL
        },
        g.a_scale_inv,
        g.b_scale_inv,
        g.d_scale,
        g.d_amax,
    ]
}

/// Set the pointer attributes of a descriptor that differ from `last` (what it holds;
/// all NULL for a fresh descriptor), and record them there: a plan used again with the
/// same pointers makes no cuBLASLt call here.
fn set_pointers(
    desc: lt::cublasLtMatmulDesc_t,
    g: &GemmDesc,
    last: &mut [DevPtr; 6],
) -> Result<()> {
    use lt::cublasLtMatmulDescAttributes_t as A;
    const ATTRS: [A; 6] = [
        A::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
        A::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER,
        A::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
        A::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
        A::CUBLASLT_MATMUL_DESC_D_SCALE_POINTER,
        A::CUBLASLT_MATMUL_DESC_AMAX_D_POINTER,
    ];
    let now = pointers(g);
    for i in 0..6 {
        if now[i] != last[i] && !now[i].is_null() {
            set_attr(desc, ATTRS[i], &(now[i].as_void() as *const c_void))?;
            last[i] = now[i];
        }
    }
    Ok(())
}

fn layout(t: DType, rows: usize, cols: usize, ld: usize) -> Result<lt::cublasLtMatrixLayout_t> {
    let mut l: lt::cublasLtMatrixLayout_t = std::ptr::null_mut();
    // SAFETY: out pointer.
    lt_check(
        unsafe {
            lt::cublasLtMatrixLayoutCreate(&mut l, lt_type(t), rows as u64, cols as u64, ld as i64)
        },
        "cublasLtMatrixLayoutCreate",
    )?;
    Ok(l)
}

fn c_type(g: &GemmDesc) -> DType {
    // For an FP8 output cuBLASLt wants C typed like the bias (bf16 by default).
    if g.d_type.is_fp8() {
        g.bias_type
    } else {
        g.d_type
    }
}

fn build(
    h: lt::cublasLtHandle_t,
    g: &GemmDesc,
    key: &PlanKey,
    ctx_addr: CtxHandle,
) -> Result<Plan> {
    build_with(h, g, key, ctx_addr, |_| Ok(()))
}

/// [`build`] with `prepare` setting more matmul attributes (e.g. the block scale modes)
/// after the description and before the heuristic runs.
fn build_with(
    h: lt::cublasLtHandle_t,
    g: &GemmDesc,
    key: &PlanKey,
    ctx_addr: CtxHandle,
    prepare: impl FnOnce(lt::cublasLtMatmulDesc_t) -> Result<()>,
) -> Result<Plan> {
    let mut desc: lt::cublasLtMatmulDesc_t = std::ptr::null_mut();
    // SAFETY: out pointer. Full fp32 compute (no TF32) for every input type, as TE.
    lt_check(
        unsafe {
            lt::cublasLtMatmulDescCreate(
                &mut desc,
                lt::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                lt::cudaDataType_t::CUDA_R_32F,
            )
        },
        "cublasLtMatmulDescCreate",
    )?;
    let mut plan = Plan {
        desc,
        a: std::ptr::null_mut(),
        b: std::ptr::null_mut(),
        c: std::ptr::null_mut(),
        d: std::ptr::null_mut(),
        algo: lt::cublasLtMatmulAlgo_t { data: [0; 8] },
        untimed: Vec::new(),
        ptrs: [DevPtr::NULL; 6],
        graphs: graphs::Graphs::default(),
        ctx_addr,
    };
    let r = describe(desc, g, &mut plan)
        .and_then(|()| prepare(desc))
        .and_then(|()| choose_algo(h, desc, g, key, &mut plan));
    match r {
        Ok(()) => Ok(plan),
        Err(e) => {
            plan.destroy(key.ctx);
            Err(e)
        }
    }
}

/// The plan's matmul attributes (layout, SM target, fast accumulation, epilogue and
/// its types), pointers and matrix layouts.
fn describe(desc: lt::cublasLtMatmulDesc_t, g: &GemmDesc, plan: &mut Plan) -> Result<()> {
    use lt::cublasLtMatmulDescAttributes_t as A;
    let (ta, tb) = (g.transa as i32, g.transb as i32);
    set_attr(desc, A::CUBLASLT_MATMUL_DESC_TRANSA, &ta)?;
    set_attr(desc, A::CUBLASLT_MATMUL_DESC_TRANSB, &tb)?;
    if g.sm_count > 0 {
        set_attr(desc, A::CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET, &g.sm_count)?;
    }
    if g.a_type.is_fp8() {
        let fast: i8 = g.fast_accum as i8;
        set_attr(desc, A::CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast)?;
    }
    let epi = g.epilogue.to_lt();
    set_attr(desc, A::CUBLASLT_MATMUL_DESC_EPILOGUE, &epi)?;
    if g.epilogue.uses_bias() && (g.a_type.is_fp8() || g.bias_type != g.d_type) {
        let bt = lt_type(g.bias_type);
        set_attr(desc, A::CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt)?;
    }
    if g.epilogue.uses_aux() {
        let ld = g.ldd as i64;
        set_attr(desc, A::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &ld)?;
        if g.aux_type != g.d_type {
            let at = lt_type(g.aux_type);
            set_attr(desc, A::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE, &at)?;
        }
    }
    set_pointers(desc, g, &mut plan.ptrs)?;
    let (ar, ac) = if g.transa { (g.k, g.m) } else { (g.m, g.k) };
    let (br, bc) = if g.transb { (g.n, g.k) } else { (g.k, g.n) };
    plan.a = layout(g.a_type, ar, ac, g.lda)?;
    plan.b = layout(g.b_type, br, bc, g.ldb)?;
    plan.c = layout(c_type(g), g.m, g.n, g.ldd)?;
    plan.d = layout(g.d_type, g.m, g.n, g.ldd)?;
    Ok(())
}

/// The heuristic's algorithm for the plan (and, when GEMM plans are timed, its other
/// candidates).
fn choose_algo(
    h: lt::cublasLtHandle_t,
    desc: lt::cublasLtMatmulDesc_t,
    g: &GemmDesc,
    key: &PlanKey,
    plan: &mut Plan,
) -> Result<()> {
    use lt::cublasLtMatmulPreferenceAttributes_t as P;
    let mut pref: lt::cublasLtMatmulPreference_t = std::ptr::null_mut();
    // SAFETY: out pointer.
    lt_check(
        unsafe { lt::cublasLtMatmulPreferenceCreate(&mut pref) },
        "cublasLtMatmulPreferenceCreate",
    )?;
    let set_pref = |a: P, v: u64| -> Result<()> {
        let v32 = v as u32;
        let (p, n) = if a == P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES {
            (&v as *const u64 as *const c_void, 8)
        } else {
            (&v32 as *const u32 as *const c_void, 4)
        };
        // SAFETY: value of the documented type (u64 workspace size, u32 alignments).
        lt_check(
            unsafe { lt::cublasLtMatmulPreferenceSetAttribute(pref, a, p, n) },
            "cublasLtMatmulPreferenceSetAttribute",
        )
    };
    let res = (|| {
        set_pref(
            P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
            g.workspace_bytes as u64,
        )?;
        set_pref(
            P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
            key.align[0] as u64,
        )?;
        set_pref(
            P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
            key.align[1] as u64,
        )?;
        set_pref(
            P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
            key.align[2] as u64,
        )?;
        set_pref(
            P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
            key.align[3] as u64,
        )?;
        heuristic(h, desc, g, pref, plan)
    })();
    // SAFETY: created above.
    unsafe { lt::cublasLtMatmulPreferenceDestroy(pref) };
    res
}

/// The heuristic's algorithms for the plan under the preferences `pref`.
fn heuristic(
    h: lt::cublasLtHandle_t,
    desc: lt::cublasLtMatmulDesc_t,
    g: &GemmDesc,
    pref: lt::cublasLtMatmulPreference_t,
    plan: &mut Plan,
) -> Result<()> {
    // SAFETY: zeroed POD result structs.
    let mut results: [lt::cublasLtMatmulHeuristicResult_t; GEMM_CANDIDATES] =
        unsafe { std::mem::zeroed() };
    let timed = tune_enabled()?
        && g.m.saturating_mul(g.n).saturating_mul(g.k) >= TUNE_MIN_MNK
        && TIMED_PLANS.with(|c| c.get()) < TUNE_MAX_PLANS;
    let want = if timed { GEMM_CANDIDATES } else { 1 };
    let mut count = 0;
    // SAFETY: all descriptors are valid.
    let s = unsafe {
        lt::cublasLtMatmulAlgoGetHeuristic(
            h,
            desc,
            plan.a,
            plan.b,
            plan.c,
            plan.d,
            pref,
            want as i32,
            results.as_mut_ptr(),
            &mut count,
        )
    };
    // NOT_SUPPORTED, INVALID_VALUE (a type combination cuBLASLt rejects) or no result.
    if matches!(
        s,
        lt::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED
            | lt::cublasStatus_t::CUBLAS_STATUS_INVALID_VALUE
    ) || (s == lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS && count == 0)
    {
        unsupported!(
            "cuBLASLt has no algorithm for this GEMM ({s:?}): {} x {} -> {}, {}{} m={} n={} k={}, epilogue {:?}, bias {}, aux {}, workspace {} bytes",
            g.a_type.name(),
            g.b_type.name(),
            g.d_type.name(),
            if g.transa { "T" } else { "N" },
            if g.transb { "T" } else { "N" },
            g.m,
            g.n,
            g.k,
            g.epilogue,
            g.bias_type.name(),
            g.aux_type.name(),
            g.workspace_bytes
        );
    }
    lt_check(s, "cublasLtMatmulAlgoGetHeuristic")?;
    plan.algo = results[0].algo;
    let ok = (count.max(0) as usize).min(want);
    plan.untimed = results[1..ok]
        .iter()
        .filter(|r| r.state == lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS)
        .map(|r| r.algo)
        .collect();
    Ok(())
}

/// Run a validated GEMM on `stream`. The stream's context must be current.
///
/// # Safety
///
/// `g` is a validated descriptor ([`desc_from_te`], or a chunk of one that the overlap
/// planner derived inside its extents, or the library's own buffers): A and B (and C,
/// bias, the scale inverses) are readable device memory of the extents their sizes,
/// leading dimensions and types imply; D, aux, d_amax and the workspace (its
/// `workspace_bytes`) are writable device memory of those extents that nothing else
/// accesses until the GEMM completes on `stream`; all alive until then.
pub unsafe fn run(g: &GemmDesc, guard: &ContextGuard, stream: StreamHandle) -> Result<()> {
    // SAFETY: the caller's contract.
    unsafe { run_impl(g, guard, stream, true) }
}

/// Bytes at most of a copy run beside our GEMM in its launch: a few of its CTAs' idle
/// warps copy it, one 16-byte load in flight a thread, so a large copy would outlast a
/// small GEMM (at 256^3 the 128 KiB shard already paces the launch: bench/RESULTS.md).
const SIDE_COPY_MAX: usize = 256 << 10;

/// `g` and a copy that the GEMM neither reads nor writes (`side`) in one launch of our own
/// kernel (its producer warps copy while the GEMM runs), where our kernel computes `g`
/// (small, supported, loaded) and the copy is small and fits it. Returns whether it ran;
/// false: nothing was enqueued, the caller copies and runs the GEMM itself. One launch less
/// on the host where it matters: small GEMMs (the tp-1 all-gather's shard into its buffer
/// beside its GEMM).
///
/// # Safety
///
/// `g` is a validated descriptor ([`desc_from_te`], or a chunk of one that the overlap
/// planner derived inside its extents, or the library's own buffers): A and B (and C,
/// bias, the scale inverses) are readable device memory of the extents their sizes,
/// leading dimensions and types imply; D, aux, d_amax and the workspace (its
/// `workspace_bytes`) are writable device memory of those extents that nothing else
/// accesses until the GEMM completes on `stream`; all alive until then.
/// `side`'s destination is writable device memory of its bytes, its source readable,
/// neither overlapping the GEMM's operands.
pub unsafe fn run_copying(
    g: &GemmDesc,
    side: sm90::SideCopy,
    guard: &ContextGuard,
    stream: StreamHandle,
) -> Result<bool> {
    if side.bytes == 0
        || side.bytes > SIDE_COPY_MAX
        || !side.fits()
        || g.m == 0
        || g.n == 0
        || g.k == 0
    {
        return Ok(false);
    }
    let Some(own) = small_own_gemm(g, guard)? else {
        return Ok(false);
    };
    let hooks = sm90::Hooks {
        side,
        ..Default::default()
    };
    // SAFETY: the caller's contract (the GEMM's operands and the side copy's ranges).
    unsafe { own.run(g, &hooks, g.sm_count.max(0) as usize, stream)? };
    Ok(true)
}

/// [`run`] for a GEMM that shares the GPU with communication kernels (an overlap engine's
/// chunk GEMM at tp > 1, and its NVTE_COMM_REPORT timing): always cuBLASLt, whose CTAs
/// retire as they finish, never our persistent kernel, which would hold its SMs until its
/// last tile and make SM puts and wait kernels queue behind the whole GEMM.
///
/// # Safety
///
/// `g` is a validated descriptor ([`desc_from_te`], or a chunk of one that the overlap
/// planner derived inside its extents, or the library's own buffers): A and B (and C,
/// bias, the scale inverses) are readable device memory of the extents their sizes,
/// leading dimensions and types imply; D, aux, d_amax and the workspace (its
/// `workspace_bytes`) are writable device memory of those extents that nothing else
/// accesses until the GEMM completes on `stream`; all alive until then.
pub unsafe fn run_beside_comm(
    g: &GemmDesc,
    guard: &ContextGuard,
    stream: StreamHandle,
) -> Result<()> {
    // SAFETY: the caller's contract.
    unsafe { run_impl(g, guard, stream, false) }
}

/// A GEMM with k = 0 (m, n > 0): D = C (accumulating into C), D unchanged (in place), or
/// D = 0.
///
/// # Safety
///
/// [`run`]'s.
unsafe fn run_k0(g: &GemmDesc, stream: StreamHandle) -> Result<()> {
    if g.epilogue != Epilogue::None {
        unsupported!("k = 0 with an epilogue ({:?}) is not supported", g.epilogue);
    }
    if g.accumulate && !g.c.is_null() {
        // D = C + 0.
        let (row, pitch) = (g.m * g.d_type.bits() / 8, g.ldd * g.d_type.bits() / 8);
        // SAFETY: C and D hold n columns of m elements at pitch ldd (the caller's
        // contract: `desc_from_te` / the engine's plan check the tensors' sizes).
        return unsafe {
            crate::cuda::resources::copy_2d(g.d, pitch, g.c, pitch, row, g.n, stream)
        };
    }
    if !g.accumulate {
        let bytes = g.ldd * (g.n - 1) * g.d_type.bits() / 8 + g.m * g.d_type.bits() / 8;
        // SAFETY: D spans these bytes (the caller's contract).
        cuda::check(
            unsafe { cudarc::driver::sys::cuMemsetD8Async(g.d.raw(), 0, bytes, stream.cu()) },
            "cuMemsetD8Async(D)",
        )?;
    }
    Ok(())
}

/// [`run`] (`own`: our GEMM where it takes the call) or [`run_beside_comm`].
///
/// # Safety
///
/// [`run`]'s.
unsafe fn run_impl(
    g: &GemmDesc,
    guard: &ContextGuard,
    stream: StreamHandle,
    own: bool,
) -> Result<()> {
    if g.m == 0 || g.n == 0 {
        return Ok(());
    }
    if g.k == 0 {
        // SAFETY: the caller's contract.
        return unsafe { run_k0(g, stream) };
    }
    if let Some(modes) = g.blocks {
        if !g.c.is_null() {
            return Err(Error::internal(
                "a block-scaled GEMM accumulating from a separate C".to_string(),
            ));
        }
        let beta = if g.accumulate { 1.0 } else { 0.0 };
        // SAFETY: the caller's contract (a block descriptor of `desc_from_te_block`, or
        // a chunk of one whose scale pointers the planner moved with its rows).
        return unsafe { block::run_scaled(g, Some(modes), 1.0, beta, stream) };
    }
    if let Some(own) = if own { small_own_gemm(g, guard)? } else { None } {
        // SAFETY: the caller's contract; default hooks add no flags or copies.
        return unsafe {
            own.run(
                g,
                &sm90::Hooks::default(),
                g.sm_count.max(0) as usize,
                stream,
            )
        };
    }
    let h = handle(guard.id)?;
    let key = PlanKey {
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
            alignment(if g.c.is_null() { g.d } else { g.c }),
            alignment(g.d),
        ],
    };
    PLANS.with(|plans| {
        let mut plans = plans.borrow_mut();
        // Steady state: one lookup (FxHash of the key); a new plan: build, insert, look up.
        let p = match plans.get_mut(&key) {
            Some(p) => p,
            None => {
                if plans.len() >= MAX_PLANS {
                    for (k, p) in plans.drain() {
                        p.destroy(k.ctx);
                    }
                }
                let p = build(h, g, &key, guard.ctx)?;
                plans.entry(key).or_insert(p)
            }
        };
        if p.untimed.is_empty()
            && graphs_enabled()?
            && let Some(done) = via_graph(h, p, g, stream)?
        {
            return Ok(done);
        }
        set_pointers(p.desc, g, &mut p.ptrs)?;
        // First eager run of a plan with candidates: time them (the run that follows
        // overwrites D; a GEMM that accumulates or is being captured is not timed).
        if !p.untimed.is_empty() && !g.accumulate && !capture_status(stream)?.active() {
            p.algo = fastest(h, p, g, stream)?;
            p.untimed.clear();
            TIMED_PLANS.with(|c| c.set(c.get() + 1));
        }
        matmul(h, p, &p.algo, g, stream)
    })
}

/// NVTE_COMM_GEMM_GRAPHS (a boolean, read once; default on): a plan's repeated calls
/// replay a CUDA graph of their matmul (see `graphs`).
fn graphs_enabled() -> Result<bool> {
    static V: std::sync::OnceLock<std::result::Result<bool, String>> = std::sync::OnceLock::new();
    crate::env::once(&V, || Ok(crate::env::GEMM_GRAPHS.get()?.unwrap_or(true)))
}

/// The plan's call `g` through its graph when the policy says so: Some(()) when it ran
/// (replayed, or captured then replayed), None for the direct call. A capture that fails
/// turns the plan's graphs off (the direct call then runs, and reports any real error).
fn via_graph(
    h: lt::cublasLtHandle_t,
    p: &mut Plan,
    g: &GemmDesc,
    stream: StreamHandle,
) -> Result<Option<()>> {
    let capturing = !capture_status(stream)?.none();
    let key = graphs::CallKey {
        ptrs: [
            g.a.raw(),
            g.b.raw(),
            g.c.raw(),
            g.d.raw(),
            g.workspace.raw(),
            g.bias.raw(),
            g.aux.raw(),
            g.a_scale_inv.raw(),
            g.b_scale_inv.raw(),
            g.d_scale.raw(),
            g.d_amax.raw(),
        ],
        accumulate: g.accumulate,
        stream,
    };
    let mut evicted = None;
    let action = p.graphs.decide(&key, capturing, &mut evicted);
    graphs::destroy(evicted);
    match action {
        graphs::Action::Launch(exec) => graphs::launch(exec, stream).map(Some),
        graphs::Action::Direct => Ok(None),
        graphs::Action::TurnedOff => {
            graphs::destroy(p.graphs.take());
            Ok(None)
        }
        graphs::Action::Capture => {
            set_pointers(p.desc, g, &mut p.ptrs)?;
            match graphs::capture(|s| matmul(h, p, &p.algo, g, s)) {
                Ok(exec) => {
                    p.graphs.captured(&key, exec);
                    graphs::launch(exec, stream).map(Some)
                }
                Err(e) => {
                    if crate::env::debug() {
                        use std::io::Write;
                        let _ = writeln!(
                            std::io::stderr().lock(),
                            "[transformer_engine_comm] a {}x{}x{} GEMM's CUDA graph capture failed \
                             ({}); its calls go to cuBLASLt directly from now on",
                            g.m,
                            g.n,
                            g.k,
                            e.msg
                        );
                    }
                    graphs::destroy(p.graphs.failed());
                    Ok(None)
                }
            }
        }
    }
}

fn matmul(
    h: lt::cublasLtHandle_t,
    p: &Plan,
    algo: &lt::cublasLtMatmulAlgo_t,
    g: &GemmDesc,
    stream: StreamHandle,
) -> Result<()> {
    let alpha = 1.0f32;
    let beta = if g.accumulate { 1.0f32 } else { 0.0f32 };
    let c = if !g.c.is_null() {
        g.c.as_void() as *const c_void
    } else if g.d_type.is_fp8() {
        std::ptr::null()
    } else {
        g.d.as_void() as *const c_void
    };
    // SAFETY: descriptors match the pointers validated in desc_from_te.
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
            algo,
            g.workspace.as_void(),
            g.workspace_bytes,
            stream.rt(),
        )
    };
    lt_check(s, "cublasLtMatmul")
}

/// Runs per timing of [`fastest`] (each of the autotuner's `timing::ROUNDS` rounds times
/// every candidate once).
const RUNS_PER_TIMING: usize = 2;

/// The plan's algorithm, or one of its untimed candidates when that is clearly faster on
/// this GEMM, by the autotuner's rule (`timing::medians`, `timing::pick_with_margin`): a
/// warm-up of every candidate, then `timing::ROUNDS` interleaved rounds (so clock ramps and
/// transient neighbours hit every candidate alike), the median per candidate, and a
/// candidate replaces the heuristic's choice (index 0) only when `timing::MARGIN` faster;
/// single timings of one GEMM differ by a few percent, and a choice made on noise would
/// cost on every later call of the shape. A candidate whose warm-up or any timed run
/// fails to launch is never chosen; when the heuristic's fails, the fastest other is.
fn fastest(
    h: lt::cublasLtHandle_t,
    p: &Plan,
    g: &GemmDesc,
    stream: StreamHandle,
) -> Result<lt::cublasLtMatmulAlgo_t> {
    let (t0, t1) = (Event::timed()?, Event::timed()?);
    // Index 0: the heuristic's choice.
    let algos: Vec<lt::cublasLtMatmulAlgo_t> = std::iter::once(p.algo)
        .chain(p.untimed.iter().copied())
        .collect();
    let mut ok: Vec<bool> = algos
        .iter()
        .map(|algo| matmul(h, p, algo, g, stream).is_ok())
        .collect();
    if ok.iter().filter(|&&o| o).count() < 2 {
        // Nothing to compare: the heuristic's choice, or the one that launches.
        return Ok(algos[ok.iter().position(|&o| o).unwrap_or(0)]);
    }
    let timeout = crate::env::timeout_ms()?;
    let rounds = crate::timing::ROUNDS;
    let mut times = vec![Vec::with_capacity(rounds); algos.len()];
    for _ in 0..rounds {
        for (i, algo) in algos.iter().enumerate() {
            if !ok[i] {
                continue;
            }
            t0.record(stream)?;
            ok[i] = (0..RUNS_PER_TIMING).all(|_| matmul(h, p, algo, g, stream).is_ok());
            t1.record(stream)?;
            t1.wait_bounded(timeout, "timing a GEMM algorithm")?;
            times[i].push(t1.elapsed_since(&t0)?);
        }
    }
    // A failed candidate's median is NaN: never chosen.
    for (t, &ok) in times.iter_mut().zip(&ok) {
        if !ok {
            t.push(f32::NAN);
        }
    }
    let medians = crate::timing::medians(&times);
    Ok(algos[crate::timing::pick_with_margin(&medians, crate::timing::MARGIN)])
}

/// TE's nvte_cublas_gemm, on operands the C boundary vouched for.
pub fn cublas_gemm(args: Checked<&TeGemm>, stream: StreamHandle) -> Result<()> {
    let g = desc_from_te(&args)?;
    if g.m == 0 || g.n == 0 {
        return Ok(()); // empty output: nothing to launch (and no device needed)
    }
    // The stream's context (made current if it is not): all a GEMM needs of it.
    let guard = ContextGuard::for_stream_no_device(stream)?;
    // SAFETY: `desc_from_te` validated the operands' shapes, types, epilogue buffers and
    // workspace against each other; `Checked` carries the C caller's contract that the
    // tensors are live device memory of those extents.
    unsafe { run(&g, &guard, stream) }
}
