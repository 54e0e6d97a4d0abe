//! The engine's own kernels around the chunk GEMMs: sums of chunks from the peers'
//! buffers (reductions, with FP8 output scaling and amax), segment copies, and the FP8
//! amax of split GEMMs. The algorithms (ag, rs, ar, bulk) call these; the kernels are in
//! kernels/comm.cu.
use super::Overlap;
use super::plan::{Lane, Planner, Reduce};
use crate::cuda::StreamHandle;
use crate::cuda::{self, DevPtr, arg};
use crate::error::Result;
use crate::tensor::{Buffer, DType, Tensor};
use crate::transport::MAX_PEERS;
use crate::{invalid, unsupported};

/// The sources of a reduction: kernels/comm.cu's `SrcSet` (same layout, asserted there
/// and in this module's tests).
#[repr(C)]
struct SrcSet {
    src: [DevPtr; MAX_PEERS],
    n: u32,
}

/// The segments of one copy kernel: kernels/comm.cu's `CopySet`.
#[repr(C)]
struct CopySet {
    src: [DevPtr; MAX_PEERS],
    dst: [DevPtr; MAX_PEERS],
    bytes: [u64; MAX_PEERS],
    n: u32,
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
        let mut name = crate::host::StackStr::<32>::new();
        std::fmt::Write::write_fmt(
            &mut name,
            format_args!(
                "reduce_{}_{}_{}",
                short(self.dtype),
                short(out_type),
                if vec_ok { "v8" } else { "v1" }
            ),
        )
        .map_err(|_| crate::error::Error::internal("a reduction kernel name is too long"))?;
        let name = name.as_str();
        let f = self.module.function(name)?;
        let mut set = SrcSet {
            src: [DevPtr::NULL; MAX_PEERS],
            n: srcs.len() as u32,
        };
        set.src[..srcs.len()].copy_from_slice(srcs);
        let (o, old, ild, r, c, sc, acc) = (
            out_ptr,
            out_ld as u64,
            in_ld as u64,
            rows as u64,
            cols as u64,
            in_scale,
            0i32,
        );
        let mut args = [
            arg(&o),
            arg(&old),
            arg(&set),
            arg(&ild),
            arg(&r),
            arg(&c),
            arg(&sc),
            arg(&acc),
            arg(&out_scale),
            arg(&out_amax),
        ];
        let work = rows * cols / if vec_ok { 8 } else { 1 };
        // Overlapped with GEMMs: the comm SM budget. On the critical tail (nothing left
        // to overlap), or inline (in order with the GEMMs): the whole GPU.
        let cap = if tail || self.inline.is_some() {
            4 * self.dev.sm_count as u32
        } else {
            2 * self.settings.num_comm_sm as u32
        };
        let blocks = (work.div_ceil(512) as u32).clamp(1, cap);
        // SAFETY: `f` is reduce_<in>_<out>_<v8|v1>(out, out_ld, SrcSet, in_ld, rows, cols,
        // scale, acc, out_scale, amax) of kernels/comm.cu in this object's module (its device's context,
        // current for calls on `stream`); `set` is repr(C) like the kernel's SrcSet. `out`
        // and the sources are the caller's / peers' mapped buffers holding rows x cols
        // elements at their leading dimensions (the callers' contract).
        unsafe { cuda::launch(f, (blocks, 1, 1), (512, 1, 1), 0, stream, &mut args, name) }
    }

    /// Copy each (dst, src, bytes) segment (up to MAX_PEERS; either side may be a peer's
    /// buffer) with one SM kernel on `stream`; `tail` as for [`Overlap::reduce`].
    pub(super) fn copy_segments(
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
        let f = self.module.function("copy_segments")?;
        let mut args = [arg(&set)];
        let cap = if tail || self.inline.is_some() {
            4 * self.dev.sm_count as u32
        } else {
            2 * self.settings.num_comm_sm as u32
        };
        let blocks = (total.div_ceil(16 * 512 * 4) as u32).clamp(1, cap);
        // SAFETY: `f` is copy_segments(CopySet) of kernels/comm.cu in this object's module
        // (its device's context, current for calls on `stream`); `set` is repr(C) like the
        // kernel's CopySet, each segment a device range of the caller's or a peer's mapped
        // buffer (the callers' contract).
        unsafe {
            cuda::launch(
                f,
                (blocks, 1, 1),
                (512, 1, 1),
                0,
                stream,
                &mut args,
                "copy_segments",
            )
        }
    }

    /// *out = max of the `n` amax slots, on `stream` (after the chunk GEMMs).
    pub(super) fn reduce_amax(
        &self,
        out: DevPtr,
        slots: DevPtr,
        n: usize,
        stream: StreamHandle,
    ) -> Result<()> {
        let f = self.module.function("amax_max")?;
        let n = n as u32;
        let mut args = [arg(&out), arg(&slots), arg(&n)];
        // SAFETY: `f` is amax_max(float *out, const float *in, u32 n) of kernels/comm.cu
        // in this object's module; `slots` holds n <= MAX_AMAX_SLOTS floats written by the
        // chunk GEMMs, `out` is the output tensor's amax (validated by desc_from_te).
        unsafe { cuda::launch(f, (1, 1, 1), (32, 1, 1), 0, stream, &mut args, "amax_max") }
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
