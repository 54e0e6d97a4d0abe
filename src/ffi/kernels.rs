//! Element-wise kernel entry points: TE's nvte_quantize / nvte_dequantize and a
//! random fill used by tests and benchmarks.
use super::{NVTECommStatus, NVTETensor, cudaStream_t, firewall, status_call};
use crate::kernels;

/// Cast `input` into `output`'s dtype (TE semantics for delayed scaling): for an FP8
/// output, output = cast(input * scale), amax updated with max|input| (atomic max: zero
/// it first), scale_inv = 1/scale. Errors are recorded (nvte_comm_last_error).
#[unsafe(no_mangle)]
pub extern "C" fn nvte_quantize(input: NVTETensor, output: NVTETensor, stream: cudaStream_t) {
    firewall("nvte_quantize", (), || {
        let i = super::handles::TENSORS.get(input as usize, "input")?;
        let o = super::handles::TENSORS.get(output as usize, "output")?;
        kernels::quantize(&i, &o, stream as usize)
    })
}

/// output = cast(input * input.scale_inv) from FP8 to float32/bfloat16/float16.
#[unsafe(no_mangle)]
pub extern "C" fn nvte_dequantize(input: NVTETensor, output: NVTETensor, stream: cudaStream_t) {
    firewall("nvte_dequantize", (), || {
        let i = super::handles::TENSORS.get(input as usize, "input")?;
        let o = super::handles::TENSORS.get(output as usize, "output")?;
        kernels::dequantize(&i, &o, stream as usize)
    })
}

/// Fill `tensor` (float32/bf16/fp16/fp8) with uniform values in [lo, hi), determined by
/// `seed` and the element index.
#[unsafe(no_mangle)]
pub extern "C" fn nvte_comm_fill_uniform(
    tensor: NVTETensor,
    seed: u64,
    lo: f32,
    hi: f32,
    stream: cudaStream_t,
) -> NVTECommStatus {
    status_call("nvte_comm_fill_uniform", || {
        let t = super::handles::TENSORS.get(tensor as usize, "tensor")?;
        kernels::fill_uniform(&t, seed, lo, hi, stream as usize)
    })
}
