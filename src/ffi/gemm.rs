//! TE's GEMM entry point (transformer_engine/gemm.h).
use super::{NVTETensor, cudaStream_t, firewall};
use crate::gemm::{self, TeGemm};

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
    firewall("nvte_cublas_gemm", (), || {
        let a = super::handles::TENSORS.get(A as usize, "A")?;
        let b = super::handles::TENSORS.get(B as usize, "B")?;
        let d = super::handles::TENSORS.get(D as usize, "D")?;
        let bias = super::handles::TENSORS.get_opt(bias as usize, "bias")?;
        let pre = super::handles::TENSORS.get_opt(pre_gelu_out as usize, "pre_gelu_out")?;
        let ws = super::handles::TENSORS.get_opt(workspace as usize, "workspace")?;
        let args = TeGemm {
            a: &a,
            b: &b,
            d: &d,
            bias: bias.as_ref(),
            pre_gelu_out: pre.as_ref(),
            transa,
            transb,
            grad,
            workspace: ws.as_ref(),
            accumulate,
            use_split_accumulator,
            math_sm_count,
        };
        gemm::cublas_gemm(&args, stream as usize)
    })
}
