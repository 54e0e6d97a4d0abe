//! One-call form of a per-tensor FP8 cast for bindings whose every foreign call is
//! costly (Python's ctypes): `nvte_comm_cast_packed` runs up to four of TE's quantization
//! steps — the amax, the scale from it, the cast, the delayed-scaling update — on one
//! stream, from one struct the caller fills once and updates per call. No tensor handles
//! are created or looked up; each step is the kernel the matching `nvte_*` function runs
//! (`crate::kernels`), with that function's checks.
use super::cudaStream_t;
use super::enums::{NVTECommStatus, NVTEDType};
use super::kernels::checked;
use crate::cuda::DevPtr;
use crate::error::Result;
use crate::invalid;
use crate::kernels::{self, AmaxAlgo, QuantConfig};
use crate::tensor::{Buffer, DType, Shape, Tensor};
use std::ffi::c_void;

/// Step of `NVTECommCastPacked::steps`: `amax = max|input|` (overwritten), as
/// nvte_compute_amax.
pub const NVTE_COMM_CAST_AMAX: u32 = 1;
/// Step: `scale` from `amax` (`amax_epsilon`, `force_pow_2_scales`), as
/// nvte_compute_scale_from_amax.
pub const NVTE_COMM_CAST_SCALE: u32 = 2;
/// Step: the cast, as nvte_quantize: the FP8 `rowwise` [rows, cols] and / or `columnwise`
/// [cols, rows] data of `input * scale`, `scale_inv = 1 / scale`, and, where `amax` is
/// given, `amax = max(amax, max|input|)` (after the amax step, a value it already holds). An
/// empty input launches nothing, as nvte_quantize.
pub const NVTE_COMM_CAST_QUANTIZE: u32 = 4;
/// Step: TE's delayed-scaling update of `amax_history` [history_len] and `scale`, in
/// place, as nvte_delayed_scaling_recipe_amax_and_scale_update.
pub const NVTE_COMM_CAST_UPDATE: u32 = 8;
const ALL_STEPS: u32 =
    NVTE_COMM_CAST_AMAX | NVTE_COMM_CAST_SCALE | NVTE_COMM_CAST_QUANTIZE | NVTE_COMM_CAST_UPDATE;

/// The arguments of one packed cast. Pointers a step does not read may be NULL.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct NVTECommCastPacked {
    /// NVTE_COMM_CAST_* bits; the steps run in the order amax, scale, quantize, update.
    pub steps: u32,
    /// the high-precision input [rows, cols] (float32, bfloat16 or float16, row-major)
    pub input: *const c_void,
    pub input_dtype: NVTEDType,
    pub rows: usize,
    pub cols: usize,
    /// kNVTEFloat8E4M3 or kNVTEFloat8E5M2
    pub fp8_dtype: NVTEDType,
    /// the cast's outputs: [rows, cols] and [cols, rows] FP8 (NULL: not written; the
    /// quantize step writes at least one)
    pub rowwise: *mut c_void,
    pub columnwise: *mut c_void,
    /// device float32 scalars
    pub scale: *mut f32,
    pub amax: *mut f32,
    pub scale_inv: *mut f32,
    /// the scale step's options (TE's quantization config)
    pub amax_epsilon: f32,
    pub force_pow_2_scales: bool,
    /// the update step: a float32 history of `history_len` entries (entry 0 the newest),
    /// `amax_compute_algo` 0 "most_recent" or 1 "max", and TE's margin
    pub amax_history: *mut f32,
    pub history_len: usize,
    pub amax_compute_algo: i32,
    pub margin: f32,
    pub stream: cudaStream_t,
}

fn buffer(p: *const c_void, dtype: DType, dims: &[usize]) -> Result<Buffer> {
    Buffer::new(DevPtr::from_c(p as *mut c_void), dtype, Shape::new(dims)?)
}

/// A float32 scalar argument of the steps that read it (`need`), checked for NULL.
fn scalar(p: *mut f32, what: &str, need: bool) -> Result<Buffer> {
    if p.is_null() && need {
        invalid!("argument `args->{what}` is NULL but a requested step needs it");
    }
    super::packed::scalar(p)
}

/// The cast's tensors: the input, and the output with its FP8 data, scale, amax and
/// scale_inv (the amax and scale steps read only its dtype, amax and scale).
fn tensors(p: &NVTECommCastPacked) -> Result<(Tensor, Tensor)> {
    let steps = p.steps;
    let fp8 = DType::from_c(p.fp8_dtype)?;
    if !fp8.is_fp8() {
        invalid!(
            "argument `args->fp8_dtype` is {}: expected kNVTEFloat8E4M3 or kNVTEFloat8E5M2",
            fp8.name()
        );
    }
    let input = Tensor {
        data: buffer(p.input, DType::from_c(p.input_dtype)?, &[p.rows, p.cols])?,
        ..Default::default()
    };
    let quantize = steps & NVTE_COMM_CAST_QUANTIZE != 0;
    // What the steps' kernels would refuse, refused before any step is enqueued.
    if steps & (NVTE_COMM_CAST_AMAX | NVTE_COMM_CAST_QUANTIZE) != 0 {
        let d = input.data.dtype;
        if !kernels::is_float_input(d) {
            invalid!(
                "argument `args->input_dtype` is {}: the input is float32, bfloat16 or float16",
                d.name()
            );
        }
        if p.input.is_null() && p.rows > 0 && p.cols > 0 {
            invalid!(
                "argument `args->input` is NULL with {} x {} elements",
                p.rows,
                p.cols
            );
        }
    }
    if steps & NVTE_COMM_CAST_SCALE != 0 && !(p.amax_epsilon.is_finite() && p.amax_epsilon >= 0.0) {
        invalid!(
            "argument `args->amax_epsilon` = {} must be finite and >= 0",
            p.amax_epsilon
        );
    }
    let needs_scale = steps & (NVTE_COMM_CAST_SCALE | NVTE_COMM_CAST_UPDATE) != 0 || quantize;
    let output = Tensor {
        data: buffer(p.rowwise, fp8, &[p.rows, p.cols])?,
        columnwise_data: buffer(p.columnwise, fp8, &[p.cols, p.rows])?,
        scale: scalar(p.scale, "scale", needs_scale)?,
        amax: scalar(
            p.amax,
            "amax",
            steps & (NVTE_COMM_CAST_AMAX | NVTE_COMM_CAST_SCALE) != 0,
        )?,
        scale_inv: scalar(p.scale_inv, "scale_inv", false)?,
        ..Default::default()
    };
    if quantize && p.rowwise.is_null() && p.columnwise.is_null() && p.rows > 0 && p.cols > 0 {
        invalid!(
            "arguments `args->rowwise` and `args->columnwise` are both NULL: the cast writes neither"
        );
    }
    Ok((input, output))
}

/// The update step's history and scale tensors (in place), and its algorithm.
fn update_tensors(p: &NVTECommCastPacked) -> Result<(Tensor, Tensor, AmaxAlgo)> {
    if p.amax_history.is_null() || p.history_len == 0 {
        invalid!(
            "argument `args->amax_history` is NULL or `args->history_len` is 0: the update step needs the history"
        );
    }
    if !p.margin.is_finite() {
        invalid!("argument `args->margin` = {} must be finite", p.margin);
    }
    let algo = match p.amax_compute_algo {
        0 => AmaxAlgo::MostRecent,
        1 => AmaxAlgo::Max,
        v => invalid!(
            "argument `args->amax_compute_algo` = {v} is not an algorithm (0: \"most_recent\", 1: \"max\")"
        ),
    };
    let h = Tensor {
        data: buffer(
            p.amax_history as *const c_void,
            DType::F32,
            &[p.history_len],
        )?,
        ..Default::default()
    };
    let s = Tensor {
        data: buffer(p.scale as *const c_void, DType::F32, &[1])?,
        ..Default::default()
    };
    Ok((h, s, algo))
}

/// Run the steps of `*args` on `args->stream`, in the order amax, scale, quantize,
/// update: each as the matching TE function with the same tensors (nvte_compute_amax,
/// nvte_compute_scale_from_amax with `amax_epsilon` and `force_pow_2_scales`,
/// nvte_quantize, nvte_delayed_scaling_recipe_amax_and_scale_update in place), with its
/// checks. Every field a requested step reads is checked before the first step is
/// enqueued (dtypes, NULL pointers, shapes, epsilon, margin, the algorithm), so a refused
/// call writes nothing; only a failure of the device calls themselves (a launch, a
/// driver error) can stop the call after its first steps. Returns the status (its message:
/// nvte_comm_last_error()). `*args` is only read: a binding keeps
/// one struct per tensor role and changes the pointers and the stream between calls.
///
/// The usual calls: current scaling, `AMAX | SCALE | QUANTIZE` (a rank group reducing
/// the amax between them calls `AMAX`, then `SCALE | QUANTIZE`); delayed scaling with
/// `amax` the history's entry 0, `QUANTIZE | UPDATE` (or `QUANTIZE`, the reduction, then
/// `UPDATE`).
#[unsafe(no_mangle)]
pub extern "C" fn nvte_comm_cast_packed(args: *const NVTECommCastPacked) -> NVTECommStatus {
    entry!(status, {
        if args.is_null() {
            invalid!("argument `args` is NULL");
        }
        // SAFETY: non-null, points to the caller's struct (read as is; the enum fields are
        // transparent integers and the bool a C bool).
        let p = unsafe { std::ptr::read_unaligned(args) };
        if p.steps == 0 || p.steps & !ALL_STEPS != 0 {
            invalid!(
                "argument `args->steps` = {:#x} is not a set of steps (NVTE_COMM_CAST_AMAX 1, _SCALE 2, _QUANTIZE 4, _UPDATE 8)",
                p.steps
            );
        }
        let (input, output) = tensors(&p)?;
        let update = if p.steps & NVTE_COMM_CAST_UPDATE != 0 {
            Some(update_tensors(&p)?)
        } else {
            None
        };
        let cfg = QuantConfig {
            force_pow_2_scales: p.force_pow_2_scales,
            amax_epsilon: p.amax_epsilon,
            ..Default::default()
        };
        let stream = crate::ffi::stream_of(p.stream);
        let fp8 = output.data.dtype;
        if p.steps & NVTE_COMM_CAST_AMAX != 0 {
            kernels::compute_amax(checked(&input), checked(&output), &cfg, stream)?;
        }
        if p.steps & NVTE_COMM_CAST_SCALE != 0 {
            kernels::compute_scale_from_amax(checked(&output), &cfg, stream)?;
        }
        if p.steps & NVTE_COMM_CAST_QUANTIZE != 0 {
            kernels::quantize(checked(&input), checked(&output), &cfg, stream)?;
        }
        if let Some((h, s, algo)) = update {
            let (hc, sc, uh, us) = (checked(&h), checked(&s), checked(&h), checked(&s));
            kernels::delayed_scaling_update(hc, sc, uh, us, algo, fp8, p.margin, stream)?;
        }
        Ok(())
    })
}
