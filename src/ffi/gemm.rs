//! TE's GEMM entry points (transformer_engine/gemm.h): nvte_cublas_gemm,
//! nvte_cublas_gemm_scaled and nvte_cublas_gemm_v2 (its config: `matmul_config`). All
//! three take per-tensor and block-scaled inputs (`gemm::block`).
use super::handles::TENSORS;
use super::matmul_config::{MATMUL_CONFIGS, MatmulAttrs, NVTEMatmulConfig};
use super::{NVTETensor, cudaStream_t};
use crate::cuda::Checked;
use crate::error::Result;
use crate::gemm::{self, Operands};
use crate::invalid;
use crate::tensor::Tensor;

/// The flags of TE's wide GEMM entry points (nvte_cublas_gemm's order). Each entry point
/// writes its `TeFlags { transa, transb, grad, accumulate, use_split_accumulator }` literal
/// out (the C parameters by name, in field shorthand): a deliberate repetition.
pub(super) struct TeFlags {
    pub transa: bool,
    pub transb: bool,
    pub grad: bool,
    pub accumulate: bool,
    pub use_split_accumulator: bool,
}

/// The optional tensors of TE's wide GEMM entry points (bias, pre_gelu_out, workspace),
/// resolved from their handles in that order. Each entry point resolves A, B and its
/// outputs before them and its own extra tensors (B_copy; buffer, rs_output) after them,
/// so that the first bad handle in TE's order is the one named. They build the operands
/// every GEMM and overlap operation takes.
pub(super) struct GemmExtras {
    bias: Option<Tensor>,
    pre_gelu_out: Option<Tensor>,
    workspace: Option<Tensor>,
}

impl GemmExtras {
    pub(super) fn resolve(
        bias: NVTETensor,
        pre_gelu_out: NVTETensor,
        workspace: NVTETensor,
    ) -> Result<GemmExtras> {
        Ok(GemmExtras {
            bias: TENSORS.get_opt(bias as usize, "bias")?,
            pre_gelu_out: TENSORS.get_opt(pre_gelu_out as usize, "pre_gelu_out")?,
            workspace: TENSORS.get_opt(workspace as usize, "workspace")?,
        })
    }
    /// The operands A, B, output `d`, these tensors and `f`.
    pub(super) fn operands<'a, D>(
        &'a self,
        a: &'a Tensor,
        b: &'a Tensor,
        d: D,
        f: TeFlags,
        math_sm_count: i32,
    ) -> Operands<'a, D> {
        Operands {
            a,
            b,
            d,
            bias: self.bias.as_ref(),
            pre_gelu_out: self.pre_gelu_out.as_ref(),
            transa: f.transa,
            transb: f.transb,
            grad: f.grad,
            workspace: self.workspace.as_ref(),
            accumulate: f.accumulate,
            use_split_accumulator: f.use_split_accumulator,
            math_sm_count,
        }
    }
}

/// D = op(A) * op(B) with TE's semantics: row-major tensors, m = transa ? A.size(0) :
/// A.size(1), k = transa ? A.size(1) : A.size(0), n = transb ? B.size(1) : B.size(0),
/// D is [n, m]. `bias` / `pre_gelu_out` (NULL or empty for none) and `grad` select the
/// epilogue: bias -> BIAS (grad: bias gradient of B, length n), pre_gelu_out -> GELU
/// with the pre-activation stored (grad: DGELU reading it), both -> GELU_AUX_BIAS (grad:
/// DGELU + bias gradient, length m). FP8 inputs need TN and scale_inv; an FP8 D needs
/// scale (amax optional). `accumulate` adds into D; `use_split_accumulator` = false
/// enables fast FP8 accumulation; `math_sm_count` > 0 limits the SMs the GEMM targets.
/// Errors are recorded for nvte_comm_last_error(); nothing is launched then.
#[unsafe(no_mangle)]
#[allow(non_snake_case)]
pub extern "C" fn nvte_cublas_gemm(
    A: NVTETensor,
    B: NVTETensor,
    D: NVTETensor,
    bias: NVTETensor,
    pre_gelu_out: NVTETensor,
    transa: bool,
    transb: bool,
    grad: bool,
    workspace: NVTETensor,
    accumulate: bool,
    use_split_accumulator: bool,
    math_sm_count: i32,
    stream: cudaStream_t,
) {
    entry!(void, {
        let flags = TeFlags {
            transa,
            transb,
            grad,
            accumulate,
            use_split_accumulator,
        };
        let beta = if accumulate { 1.0 } else { 0.0 };
        let tensors = [A, B, D, bias, pre_gelu_out, workspace];
        te_gemm(tensors, flags, [1.0, beta], math_sm_count, stream)
    })
}

/// nvte_cublas_gemm and nvte_cublas_gemm_scaled: the handles `[A, B, D, bias,
/// pre_gelu_out, workspace]` looked up, D = alpha * op(A) op(B) (+ epilogue) + beta * D.
fn te_gemm(
    tensors: [NVTETensor; 6],
    flags: TeFlags,
    [alpha, beta]: [f32; 2],
    math_sm_count: i32,
    stream: cudaStream_t,
) -> Result<()> {
    let [a, b, d, bias, pre_gelu_out, workspace] = tensors;
    let a = TENSORS.get(a as usize, "A")?;
    let b = TENSORS.get(b as usize, "B")?;
    let d = TENSORS.get(d as usize, "D")?;
    let extras = GemmExtras::resolve(bias, pre_gelu_out, workspace)?;
    let args = extras.operands(&a, &b, &d, flags, math_sm_count);
    gemm::block::cublas_gemm_scaled(vouch(&args), alpha, beta, crate::ffi::stream_of(stream))
}

/// nvte_cublas_gemm with D = alpha * op(A) op(B) (+ bias, GELU as nvte_cublas_gemm) +
/// beta * D: `beta` = 0 overwrites D (it is not read), any other value accumulates
/// (not with an FP8 D). Block-scaled FP8 inputs (NVTE_BLOCK_SCALING_1D / 2D) are taken
/// as by nvte_cublas_gemm (see docs/c-api.md). TE deprecates it for nvte_cublas_gemm_v2.
#[unsafe(no_mangle)]
#[allow(non_snake_case)]
pub extern "C" fn nvte_cublas_gemm_scaled(
    A: NVTETensor,
    B: NVTETensor,
    D: NVTETensor,
    bias: NVTETensor,
    pre_gelu_out: NVTETensor,
    transa: bool,
    transb: bool,
    grad: bool,
    workspace: NVTETensor,
    alpha: f32,
    beta: f32,
    use_split_accumulator: bool,
    math_sm_count: i32,
    stream: cudaStream_t,
) {
    entry!(void, {
        let flags = TeFlags {
            transa,
            transb,
            grad,
            accumulate: beta != 0.0,
            use_split_accumulator,
        };
        let tensors = [A, B, D, bias, pre_gelu_out, workspace];
        te_gemm(tensors, flags, [alpha, beta], math_sm_count, stream)
    })
}

/// TE 2.20's GEMM: D = alpha * op(A) op(B) + beta * C, with op = transpose where
/// `transa` / `transb` are nonzero, A, B and D row-major as in nvte_cublas_gemm (D is
/// [n, m]). `alpha` and `beta` are host pointers to one float each. C must be D (TE's
/// rule). `config` (NULL: the defaults) sets the epilogue (bias, bias gradient, GELU
/// with its aux tensor, GELU backward), the split accumulator and the SM count
/// (nvte_set_matmul_config_attribute). Inputs as nvte_cublas_gemm: bf16 / fp16 / fp32,
/// per-tensor FP8, block-scaled FP8 on Hopper. Errors are recorded for
/// nvte_comm_last_error(); D is left untouched then.
#[unsafe(no_mangle)]
#[allow(non_snake_case)]
pub extern "C" fn nvte_cublas_gemm_v2(
    transa: i32,
    transb: i32,
    alpha: *const f32,
    A: NVTETensor,
    B: NVTETensor,
    beta: *const f32,
    C: NVTETensor,
    D: NVTETensor,
    workspace: NVTETensor,
    config: NVTEMatmulConfig,
    stream: cudaStream_t,
) {
    entry!(void, {
        let a = TENSORS.get(A as usize, "A")?;
        let b = TENSORS.get(B as usize, "B")?;
        TENSORS.get(C as usize, "C")?;
        let d = TENSORS.get(D as usize, "D")?;
        if C != D {
            invalid!(
                "tensors `C` and `D` differ: nvte_cublas_gemm_v2 accumulates into D only (C must be D, as in TE)"
            );
        }
        let (alpha, beta) = host_scalars(alpha, beta)?;
        let workspace = TENSORS.get_opt(workspace as usize, "workspace")?;
        let cfg = if config.is_null() {
            MatmulAttrs::default()
        } else {
            MATMUL_CONFIGS.get(config as usize, "config")?
        };
        let (bias, aux, grad) = cfg.epilogue()?;
        let args = Operands {
            a: &a,
            b: &b,
            d: &d,
            bias: bias.as_ref(),
            pre_gelu_out: aux.as_ref(),
            transa: transa != 0,
            transb: transb != 0,
            grad,
            workspace: workspace.as_ref(),
            accumulate: beta != 0.0,
            use_split_accumulator: cfg.use_split_accumulator,
            math_sm_count: cfg.sm_count,
        };
        gemm::block::cublas_gemm_scaled(vouch(&args), alpha, beta, crate::ffi::stream_of(stream))
    })
}

/// The GEMM entry points' operands, resolved from the caller's handles, as the checked
/// operands the GEMM takes.
fn vouch<'a>(args: &'a gemm::TeGemm<'a>) -> Checked<&'a gemm::TeGemm<'a>> {
    // SAFETY: the caller's tensors, resolved from live handles (their shapes and dtypes
    // as TE set them); the GEMM entry points' contract (TE's): their buffers are device
    // memory of those extents, alive until the GEMM on the caller's stream completes.
    unsafe { Checked::vouched(args) }
}

/// The values of nvte_cublas_gemm_v2's `alpha` and `beta` (host pointers, as TE reads
/// them).
fn host_scalars(alpha: *const f32, beta: *const f32) -> Result<(f32, f32)> {
    if alpha.is_null() {
        invalid!("argument `alpha` is NULL (a host pointer to one float)");
    }
    if beta.is_null() {
        invalid!("argument `beta` is NULL (a host pointer to one float)");
    }
    // SAFETY: non-null host pointers to one float each, per the API's contract.
    Ok(unsafe { (alpha.read_unaligned(), beta.read_unaligned()) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::DevPtr;
    use crate::error::{ErrorKind, last_error_string, last_kind};
    use crate::tensor::{BlockMode, Buffer, DType, Shape, scale_shape};

    fn buf(ptr: u64, dtype: DType, dims: &[usize]) -> Buffer {
        Buffer::new(DevPtr::new(ptr), dtype, Shape::new(dims).unwrap()).unwrap()
    }

    /// A live handle of a block-scaled [rows, cols] tensor with rowwise data (fake
    /// device addresses: the calls below are refused before any device work).
    fn block(mode: BlockMode, rows: usize, cols: usize) -> NVTETensor {
        let scales = match mode {
            BlockMode::OneD => scale_shape::one_d_rowwise_gemm_ready(rows, cols),
            BlockMode::TwoD => scale_shape::two_d_rowwise(rows, cols),
        };
        TENSORS.insert(Tensor {
            scaling_mode: mode.scaling_mode(),
            data: buf(0x10000, DType::E4M3, &[rows, cols]),
            scale_inv: buf(0x20000, DType::F32, &scales),
            ..Default::default()
        }) as NVTETensor
    }

    fn plain(dtype: DType, dims: &[usize]) -> NVTETensor {
        TENSORS.insert(Tensor {
            data: buf(0x30000, dtype, dims),
            ..Default::default()
        }) as NVTETensor
    }

    fn expect(kind: ErrorKind, piece: &str) {
        let msg = last_error_string();
        assert_eq!(last_kind(), Some(kind), "{msg}");
        assert!(msg.contains(piece), "{msg}");
    }

    #[test]
    fn the_entry_points_refuse_before_any_device_work() {
        let (a1, a2) = (
            block(BlockMode::OneD, 256, 512),
            block(BlockMode::TwoD, 256, 512),
        );
        let b2 = block(BlockMode::TwoD, 128, 512);
        let d = plain(DType::BF16, &[128, 256]);
        let other = plain(DType::BF16, &[128, 256]);
        let null = std::ptr::null_mut();
        nvte_cublas_gemm(
            a2, b2, d, null, null, true, false, false, null, false, true, 0, null,
        );
        expect(ErrorKind::Unsupported, "both NVTE_BLOCK_SCALING_2D");
        assert!(last_error_string().starts_with("nvte_cublas_gemm"));
        nvte_cublas_gemm_scaled(
            a1, d, d, null, null, true, false, false, null, 2.0, 0.5, true, 0, null,
        );
        expect(ErrorKind::Unsupported, "mix block scaling");
        let (one, zero) = (1.0f32, 0.0f32);
        nvte_cublas_gemm_v2(1, 0, &one, a1, b2, &zero, other, d, null, null, null);
        expect(ErrorKind::InvalidArgument, "`C` and `D` differ");
        nvte_cublas_gemm_v2(1, 0, &one, a1, b2, std::ptr::null(), d, d, null, null, null);
        expect(ErrorKind::InvalidArgument, "`beta` is NULL");
        nvte_cublas_gemm_v2(1, 0, &one, a1, b2, &zero, d, d, null, 0x77 as _, null);
        expect(ErrorKind::InvalidArgument, "not a live matmul config");
        // A config's epilogue: forward GELU is not available with block scaling.
        let cfg = super::super::matmul_config::nvte_create_matmul_config();
        let yes = 1u8;
        let aux = other;
        let set = super::super::matmul_config::nvte_set_matmul_config_attribute;
        use super::super::enums::NVTEMatmulConfigAttribute as Attr;
        set(
            cfg,
            Attr::kNVTEMatmulConfigWithGELUEpilogue,
            &yes as *const u8 as _,
            1,
        );
        set(
            cfg,
            Attr::kNVTEMatmulConfigEpilogueAuxTensor,
            &aux as *const NVTETensor as _,
            8,
        );
        nvte_cublas_gemm_v2(1, 0, &one, a1, b2, &zero, d, d, null, cfg, null);
        expect(ErrorKind::Unsupported, "GeluAux");
        super::super::matmul_config::nvte_destroy_matmul_config(cfg);
        // The per-tensor path (the overlap operations' too) refuses block tensors.
        let pt = plain(DType::E4M3, &[128, 512]);
        nvte_cublas_gemm(
            pt, a1, d, null, null, true, false, false, null, false, true, 0, null,
        );
        expect(ErrorKind::Unsupported, "mix block scaling");
        for t in [a1, a2, b2, d, other, pt] {
            TENSORS.remove(t as usize, "t").unwrap();
        }
    }
}
