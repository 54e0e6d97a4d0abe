//! Typed launches of the element-wise kernels in `kernels/cast.cu`.
use crate::cuda::{self, ContextGuard, DevPtr, arg, nvrtc};
use crate::error::Result;
use crate::tensor::{Buffer, DType, Tensor};
use crate::{invalid, unsupported};

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

/// Look up `prefix_<types>` in the cast module of the current context.
/// Launch element-wise kernel `f` over `n` elements (grid-stride loops; BLOCK threads a
/// block, at most 8 blocks an SM).
///
/// # Safety
/// `args` are exactly `f`'s parameters, with pointers valid for the kernel's run.
unsafe fn launch_elementwise(
    f: cudarc::driver::sys::CUfunction,
    sms: i32,
    n: usize,
    args: &mut [*mut std::ffi::c_void],
    stream: usize,
    what: &str,
) -> Result<()> {
    // SAFETY: the caller's obligations.
    unsafe {
        cuda::launch(
            f,
            (grid_for(n, sms), 1, 1),
            (BLOCK, 1, 1),
            0,
            stream,
            args,
            what,
        )
    }
}

fn function(guard: &ContextGuard, name: String) -> Result<(cudarc::driver::sys::CUfunction, i32)> {
    let dev = cuda::device_info(guard.device)?;
    let m = nvrtc::module(&nvrtc::CAST, guard.ctx, &dev)?;
    Ok((m.function(&name)?, dev.sm_count))
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

/// TE's nvte_quantize for delayed scaling: output = cast(input * output.scale), with
/// output.amax = max(output.amax, max|input|) and output.scale_inv = 1/output.scale.
pub fn quantize(input: &Tensor, output: &Tensor, stream: usize) -> Result<()> {
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
    if !matches!(i.dtype, DType::F32 | DType::BF16 | DType::F16) {
        unsupported!(
            "tensor `input` dtype {} is not supported: expected kNVTEFloat32, kNVTEBFloat16 or kNVTEFloat16",
            i.dtype.name()
        );
    }
    let Some(oname) = short(o.dtype) else {
        unsupported!(
            "tensor `output` dtype {} is not supported: expected an FP8 type or kNVTEFloat32/BFloat16/Float16",
            o.dtype.name()
        );
    };
    need_data(i, "input")?;
    need_data(o, "output")?;
    if o.dtype.is_fp8() && Tensor::scalar_ptr(&output.scale).is_none() {
        invalid!(
            "tensor `output` is {} but has no scale (set kNVTEScale)",
            o.dtype.name()
        );
    }
    if i.numel() == 0 {
        return Ok(());
    }
    let guard = ContextGuard::for_stream(stream)?;
    let (f, sms) = function(
        &guard,
        format!("quantize_{}_{oname}", short(i.dtype).unwrap()),
    )?;
    let n = i.numel() as u64;
    let (src, dst) = (i.ptr, o.ptr);
    let (scale, amax, sinv) = (
        opt_ptr(&output.scale),
        opt_ptr(&output.amax),
        opt_ptr(&output.scale_inv),
    );
    let mut args = [
        arg(&src),
        arg(&dst),
        arg(&n),
        arg(&scale),
        arg(&amax),
        arg(&sinv),
    ];
    // SAFETY: `f` is quantize_<in>_<out> of kernels/cast.cu, loaded in the stream's context
    // (held by `guard`); `args` are its six parameters (in, out, n, scale, amax, scale_inv),
    // each a pointer-sized value. The data pointers are the caller's tensors of n elements
    // (TE's contract, NULL checked above); the scalars are NULL or single floats.
    unsafe { launch_elementwise(f, sms, i.numel(), &mut args, stream, "quantize") }
}

/// TE's nvte_dequantize: output = cast(input * input.scale_inv) from FP8.
pub fn dequantize(input: &Tensor, output: &Tensor, stream: usize) -> Result<()> {
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
    let (f, sms) = function(
        &guard,
        format!(
            "dequantize_{}_{}",
            short(i.dtype).unwrap(),
            short(o.dtype).unwrap()
        ),
    )?;
    let n = i.numel() as u64;
    let (src, dst, sinv) = (i.ptr, o.ptr, opt_ptr(&input.scale_inv));
    let mut args = [arg(&src), arg(&dst), arg(&n), arg(&sinv)];
    // SAFETY: `f` is dequantize_<in>_<out> of kernels/cast.cu, loaded in the stream's context
    // (held by `guard`); `args` are its four parameters (in, out, n, scale_inv), each a
    // pointer-sized value. The data pointers are the caller's tensors of n elements (TE's
    // contract, NULL checked above); scale_inv is a single float (checked above).
    unsafe { launch_elementwise(f, sms, i.numel(), &mut args, stream, "dequantize") }
}

/// Fill a tensor with uniform random values in [lo, hi) from a counter-based generator:
/// the same (seed, size) always gives the same data.
pub fn fill_uniform(t: &Tensor, seed: u64, lo: f32, hi: f32, stream: usize) -> Result<()> {
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
    let (f, sms) = function(&guard, format!("fill_uniform_{name}"))?;
    let n = b.numel() as u64;
    let dst = b.ptr;
    let mut args = [arg(&dst), arg(&n), arg(&seed), arg(&lo), arg(&hi)];
    // SAFETY: `f` is fill_uniform_<type> of kernels/cast.cu, loaded in the stream's context
    // (held by `guard`); `args` are its five parameters (out, n: 8 bytes; seed: u64; lo, hi:
    // f32). `dst` is the caller's tensor of n elements (TE's contract, NULL checked above).
    unsafe { launch_elementwise(f, sms, b.numel(), &mut args, stream, "fill_uniform") }
}
