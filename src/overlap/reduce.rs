//! The engine's own kernels around the chunk GEMMs: sums of chunks from the peers'
//! buffers (reductions, with FP8 output scaling and amax), segment copies, and the FP8
//! amax of split GEMMs. The algorithms (ag, rs, ar, bulk) call these; the kernels are in
//! kernels/comm.cu.
use super::Overlap;
use super::plan::{Lane, Planner, Reduce};
use crate::cuda::StreamHandle;
use crate::cuda::{Binding, DevPtr, Kernel, KernelArg, ParamInfo, Signature, nvrtc};
use crate::error::Result;
use crate::tensor::{Buffer, DType, Tensor};
use crate::transport::MAX_PEERS;
use crate::{invalid, unsupported};

/// The sources of a reduction: kernels/comm.cu's `SrcSet` (same layout, asserted there
/// and in this module's tests).
#[repr(C)]
#[derive(Clone, Copy)]
struct SrcSet {
    src: [DevPtr; MAX_PEERS],
    n: u32,
}

/// The segments of one copy kernel: kernels/comm.cu's `CopySet`.
#[repr(C)]
#[derive(Clone, Copy)]
struct CopySet {
    src: [DevPtr; MAX_PEERS],
    dst: [DevPtr; MAX_PEERS],
    bytes: [u64; MAX_PEERS],
    n: u32,
}

// SAFETY: repr(C) structs passed by value, kernels/comm.cu's SrcSet and CopySet (same
// layouts: asserted there and in this module's tests).
unsafe impl KernelArg for SrcSet {
    const INFO: ParamInfo = ParamInfo::by_value::<SrcSet>();
}
// SAFETY: as above.
unsafe impl KernelArg for CopySet {
    const INFO: ParamInfo = ParamInfo::by_value::<CopySet>();
}

/// reduce_<in>_<out>_<v8|v1>(O::T *out, u64 out_ld, SrcSet, u64 in_ld, u64 rows, u64 cols,
/// const float *scale, int acc, const float *out_scale, float *amax)
type ReduceParams = (
    DevPtr,
    u64,
    SrcSet,
    u64,
    u64,
    u64,
    DevPtr,
    i32,
    DevPtr,
    DevPtr,
);

// SAFETY: the parameter list of every reduce_<in>_<out>_<v8|v1> of kernels/comm.cu
// (pointers are DevPtr, repr(transparent) u64; SrcSet is the kernels' layout).
const REDUCE: Binding<ReduceParams> = unsafe { Binding::new(&nvrtc::COMM, "reduce_{}_{}_{}", "") };
// SAFETY: copy_segments(CopySet) of kernels/comm.cu.
const COPY_SEGMENTS: Binding<(CopySet,)> =
    unsafe { Binding::new(&nvrtc::COMM, "copy_segments", "") };
// SAFETY: amax_max(float *out, const float *in, u32 n) of kernels/comm.cu.
const AMAX_MAX: Binding<(DevPtr, DevPtr, u32)> =
    unsafe { Binding::new(&nvrtc::COMM, "amax_max", "") };

/// The kernel bindings of the engine (checked against kernels/comm.cu by
/// tests/kernel_signatures.rs).
pub fn kernel_signatures() -> Vec<Signature> {
    vec![
        REDUCE.signature(),
        COPY_SEGMENTS.signature(),
        AMAX_MAX.signature(),
    ]
}

/// The engine's kernels, looked up once at creation (outside any graph capture).
pub(super) struct EngineKernels {
    /// the buffer's dtype: the reductions' input
    dtype: DType,
    /// reduce_<dtype>_<out>_{v8, v1} for each `out` of `reduce_outputs(dtype)`
    reduce: Vec<(DType, [Kernel<ReduceParams>; 2])>,
    copy_segments: Kernel<(CopySet,)>,
    amax_max: Kernel<(DevPtr, DevPtr, u32)>,
}

impl EngineKernels {
    /// The kernels of `m` (kernels/comm.cu's module) for a buffer of `dtype`.
    pub(super) fn new(m: &nvrtc::Module, dtype: DType) -> Result<EngineKernels> {
        let mut reduce = Vec::new();
        for &o in reduce_outputs(dtype) {
            // SAFETY: `m` is kernels/comm.cu's module, the bindings' source.
            let k = |v| unsafe { Kernel::new(m, &REDUCE, &[short(dtype), short(o), v]) };
            reduce.push((o, [k("v8")?, k("v1")?]));
        }
        // SAFETY: as above.
        unsafe {
            Ok(EngineKernels {
                dtype,
                reduce,
                copy_segments: Kernel::new(m, &COPY_SEGMENTS, &[])?,
                amax_max: Kernel::new(m, &AMAX_MAX, &[])?,
            })
        }
    }
}

/// A dtype's name in the reduction kernels' names.
pub(super) fn short(d: DType) -> &'static str {
    match d {
        DType::F32 => "f32",
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        DType::E4M3 => "e4m3",
        _ => "e5m2",
    }
}

/// The output types a reduction of a `d` buffer can write (see `check_reduce_output`).
pub(super) fn reduce_outputs(d: DType) -> &'static [DType] {
    match d {
        DType::F32 => &[DType::F32, DType::E4M3, DType::E5M2],
        DType::BF16 => &[DType::BF16, DType::F32, DType::E4M3, DType::E5M2],
        DType::F16 => &[DType::F16, DType::F32, DType::E4M3, DType::E5M2],
        _ => &[DType::BF16, DType::F16, DType::F32],
    }
}

impl Overlap {
    /// The reduction `r` (kernels/comm.cu `reduce_<in>_<out>_<v8|v1>`) on `stream`.
    pub(super) fn reduce(&self, r: &Reduce, stream: StreamHandle) -> Result<()> {
        let Reduce {
            out: out_ptr,
            out_type,
            out_ld,
            ref srcs,
            in_ld,
            rows,
            cols,
            in_scale,
            fp8_out,
            tail,
        } = *r;
        if rows == 0 || cols == 0 {
            return Ok(());
        }
        let (out_scale, out_amax) = fp8_out;
        let vec_ok = cols.is_multiple_of(8)
            && in_ld.is_multiple_of(8)
            && out_ld.is_multiple_of(8)
            && srcs.iter().all(|&p| p.is_aligned(16))
            && out_ptr.is_aligned(16);
        let k = self.reduce_kernel(out_type, vec_ok)?;
        let mut set = SrcSet {
            src: [DevPtr::NULL; MAX_PEERS],
            n: srcs.len() as u32,
        };
        set.src[..srcs.len()].copy_from_slice(srcs);
        let params = (
            out_ptr,
            out_ld as u64,
            set,
            in_ld as u64,
            rows as u64,
            cols as u64,
            in_scale,
            0i32,
            out_scale,
            out_amax,
        );
        let work = rows * cols / if vec_ok { 8 } else { 1 };
        // Overlapped with GEMMs: the comm SM budget. On the critical tail (nothing left
        // to overlap), or inline (in order with the GEMMs): the whole GPU.
        let cap = if tail || self.call.inline.is_some() {
            4 * self.group.dev.sm_count as u32
        } else {
            2 * self.policy.comm.sms as u32
        };
        let blocks = (work.div_ceil(512) as u32).clamp(1, cap);
        // SAFETY: `k` is reduce_<in>_<out>_<v8|v1> of kernels/comm.cu in this object's
        // module (its device's context, current for calls on `stream`). `out` and the
        // sources are the caller's / peers' mapped buffers holding rows x cols elements at
        // their leading dimensions (the callers' contract); the v8 kernel only when
        // `vec_ok`. Any grid (grid-stride), 512 threads a block.
        unsafe { k.launch(((blocks, 1, 1), (512, 1, 1)), stream, params) }
    }

    /// reduce_<dtype>_<out_type>_<v8|v1>: looked up at creation for the output types the
    /// buffer's dtype reduces to; any other looked up now, as a by-name lookup would.
    fn reduce_kernel(&self, out_type: DType, vec_ok: bool) -> Result<Kernel<ReduceParams>> {
        let k = &self.code.kernels;
        if let Some((_, pair)) = k.reduce.iter().find(|(o, _)| *o == out_type) {
            return Ok(pair[if vec_ok { 0 } else { 1 }]);
        }
        let v = if vec_ok { "v8" } else { "v1" };
        // SAFETY: this object's module is kernels/comm.cu's.
        unsafe {
            Kernel::new(
                &self.code.module,
                &REDUCE,
                &[short(k.dtype), short(out_type), v],
            )
        }
    }

    /// Copy each (dst, src, bytes) segment (up to MAX_PEERS; either side may be a peer's
    /// buffer) with one SM kernel on `stream`; `tail` as for [`Overlap::reduce`].
    ///
    /// # Safety
    ///
    /// Each segment's destination is writable and its source readable device memory of
    /// its bytes (this engine's buffers, a peer's mapped buffer, or the call's checked
    /// operands), alive and not accessed by other work until the copy completes on
    /// `stream`.
    pub(super) unsafe fn copy_segments(
        &self,
        segs: &[(DevPtr, DevPtr, usize)],
        stream: StreamHandle,
        tail: bool,
    ) -> Result<()> {
        let mut set = CopySet {
            src: [DevPtr::NULL; MAX_PEERS],
            dst: [DevPtr::NULL; MAX_PEERS],
            bytes: [0; MAX_PEERS],
            n: 0,
        };
        let mut total = 0;
        for &(d, s, b) in segs.iter().filter(|x| x.2 > 0) {
            let k = set.n as usize;
            set.dst[k] = d;
            set.src[k] = s;
            set.bytes[k] = b as u64;
            set.n += 1;
            total += b;
        }
        if set.n == 0 {
            return Ok(());
        }
        let cap = if tail || self.call.inline.is_some() {
            4 * self.group.dev.sm_count as u32
        } else {
            2 * self.policy.comm.sms as u32
        };
        let blocks = (total.div_ceil(16 * 512 * 4) as u32).clamp(1, cap);
        let k = &self.code.kernels.copy_segments;
        // SAFETY: copy_segments(CopySet) of kernels/comm.cu in this object's module (its
        // device's context, current for calls on `stream`); each segment of `set` is a
        // device range of the caller's or a peer's mapped buffer (the callers' contract).
        unsafe { k.launch(((blocks, 1, 1), (512, 1, 1)), stream, (set,)) }
    }

    /// *out = max of the `n` amax slots, on `stream` (after the chunk GEMMs).
    ///
    /// # Safety
    ///
    /// `out` is a writable f32 and `slots` `n` readable f32s of device memory, alive until
    /// the kernel completes on `stream`.
    pub(super) unsafe fn reduce_amax(
        &self,
        out: DevPtr,
        slots: DevPtr,
        n: usize,
        stream: StreamHandle,
    ) -> Result<()> {
        let k = &self.code.kernels.amax_max;
        // SAFETY: amax_max(float *out, const float *in, u32 n) of kernels/comm.cu in this
        // object's module; `out` and the `n` slots as the caller's contract states (the
        // plan's: the chunk GEMMs' slots, the output tensor's amax).
        unsafe { k.launch(((1, 1, 1), (32, 1, 1)), stream, (out, slots, n as u32)) }
    }
}

impl Planner<'_> {
    /// The output types a reduction of this buffer can write.
    pub(super) fn check_reduce_output(&self, out: &Buffer, what: &str) -> Result<()> {
        if !reduce_outputs(self.dtype()).contains(&out.dtype) {
            unsupported!(
                "tensor `{what}` dtype {} cannot receive a reduction of a {} buffer",
                out.dtype.name(),
                self.dtype().name()
            );
        }
        if out.ptr.is_null() && out.numel() > 0 {
            invalid!("tensor `{what}` has a NULL data pointer");
        }
        Ok(())
    }

    /// Before a call starts (a failure after `begin` breaks the object): an FP8 reduction
    /// output needs its scale.
    pub(super) fn check_fp8_output(t: &Tensor, what: &str) -> Result<()> {
        if t.data.dtype.is_fp8() && Tensor::scalar_ptr(&t.scale).is_none() {
            invalid!(
                "tensor `{what}` is FP8 ({}): it needs its scale (kNVTEScale) for the reduction's output",
                t.data.dtype.name()
            );
        }
        Ok(())
    }

    /// An FP8 reduction output's scale (required) and amax (optional) pointers, and the
    /// amax zeroed on `lane` (before the call's first reduction on it); (0, 0) for
    /// 16/32-bit outputs.
    pub(super) fn fp8_output(
        &mut self,
        t: &Tensor,
        what: &str,
        lane: Lane,
    ) -> Result<(DevPtr, DevPtr)> {
        if !t.data.dtype.is_fp8() {
            return Ok((DevPtr::NULL, DevPtr::NULL));
        }
        Self::check_fp8_output(t, what)?;
        let scale = Tensor::scalar_ptr(&t.scale).unwrap_or_default();
        let amax = Tensor::scalar_ptr(&t.amax).unwrap_or_default();
        if !amax.is_null() {
            self.memset(amax, 4, lane);
        }
        Ok((scale, amax))
    }
}

#[cfg(test)]
mod tests {
    /// Every reduction kernel the engine looks up at creation is instantiated in
    /// kernels/comm.cu (`REDUCE(in, IN, out, OUT)` gives reduce_<in>_<out>_v8 and _v1).
    #[test]
    fn every_reduction_the_engine_looks_up_is_instantiated() {
        use super::{REDUCE, reduce_outputs, short};
        use crate::tensor::DType;
        let src = crate::cuda::nvrtc::COMM.code;
        for d in [
            DType::F32,
            DType::BF16,
            DType::F16,
            DType::E4M3,
            DType::E5M2,
        ] {
            for &o in reduce_outputs(d) {
                let (i, o) = (short(d), short(o));
                let inst = format!(
                    "REDUCE({i}, {}, {o}, {})",
                    i.to_uppercase(),
                    o.to_uppercase()
                );
                assert!(src.contains(&inst), "kernels/comm.cu has no {inst}");
                for v in ["v8", "v1"] {
                    let name = REDUCE.name(&[i, o, v]).unwrap();
                    assert_eq!(name.as_str(), format!("reduce_{i}_{o}_{v}"));
                }
            }
        }
    }

    /// The layouts kernels/comm.cu asserts with static_assert (same numbers).
    #[test]
    fn kernel_argument_sets_have_the_kernels_layout() {
        use super::{CopySet, SrcSet};
        use std::mem::{offset_of, size_of};
        assert_eq!(size_of::<SrcSet>(), 136);
        assert_eq!(offset_of!(SrcSet, n), 128);
        assert_eq!(size_of::<CopySet>(), 392);
        assert_eq!(offset_of!(CopySet, dst), 128);
        assert_eq!(offset_of!(CopySet, bytes), 256);
        assert_eq!(offset_of!(CopySet, n), 384);
    }
}
