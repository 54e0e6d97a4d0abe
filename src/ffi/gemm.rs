//! TE's GEMM entry point (transformer_engine/gemm.h).
use super::handles::TENSORS;
use super::{NVTETensor, cudaStream_t};
use crate::error::Result;
use crate::gemm::{self, Operands};
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
        let a = TENSORS.get(A as usize, "A")?;
        let b = TENSORS.get(B as usize, "B")?;
        let d = TENSORS.get(D as usize, "D")?;
        let extras = GemmExtras::resolve(bias, pre_gelu_out, workspace)?;
        let flags = TeFlags {
            transa,
            transb,
            grad,
            accumulate,
            use_split_accumulator,
        };
        let args = extras.operands(&a, &b, &d, flags, math_sm_count);
        // SAFETY: the caller's tensors, resolved from live handles (their shapes and
        // dtypes as TE set them); nvte_cublas_gemm's contract: their buffers are device
        // memory of those extents, alive until the GEMM on `stream` completes.
        let args = unsafe { crate::cuda::Checked::vouched(&args) };
        gemm::cublas_gemm(args, crate::ffi::stream_of(stream))
    })
}
