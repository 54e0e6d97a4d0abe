//! The engine's side of plan + enqueue: the [`Env`] a call plans with, the scratch memory
//! it may need, and the GPU [`Device`] that issues a plan's steps on the engine's streams
//! (the same CUDA calls, in the same order, as the algorithms made before they were
//! plans).
use super::plan::{self, Device, Env, Lane, Planner, Reduce, Scratch};
use super::{MAX_AMAX_SLOTS, Op, Overlap};
use crate::cuda::StreamHandle;
use crate::cuda::resources::{
    DeviceMem, copy_2d, copy_async, memset_async, wait_value32_geq, with_relaxed_capture,
    write_value32,
};
use crate::cuda::{ContextGuard, DevPtr, nvtx};
use crate::error::Result;
use crate::gemm::GemmDesc;
use crate::gemm::sm90::{Hooks, SideCopy, Sm90Gemm, StallRecord};
use crate::transport::Transport;

/// The engine's lazily made scratch memory.
struct EngineScratch<'a> {
    staging: &'a mut Option<DeviceMem>,
    amax_slots: &'a mut Option<DeviceMem>,
    flags: &'a mut Option<DeviceMem>,
    buffer_bytes: usize,
}

impl Scratch for EngineScratch<'_> {
    /// Local staging for the ring reduce-scatter's partials: as large as the buffer,
    /// allocated on first use (nothing can be using it yet, so no synchronisation; inside
    /// a graph capture too: the allocation is made outside the capture's rules and kept
    /// for the object's life).
    fn staging(&mut self) -> Result<DevPtr> {
        if self.staging.is_none() {
            *self.staging = Some(DeviceMem::new_relaxed(self.buffer_bytes)?);
        }
        Ok(self.staging.as_ref().map_or(DevPtr::NULL, |m| m.ptr))
    }
    /// Per-chunk amax slots (MAX_AMAX_SLOTS floats; FP8 outputs of split GEMMs).
    fn amax_slots(&mut self) -> Result<DevPtr> {
        if self.amax_slots.is_none() {
            *self.amax_slots = Some(DeviceMem::new_relaxed(MAX_AMAX_SLOTS * 4)?);
        }
        Ok(self.amax_slots.as_ref().map_or(DevPtr::NULL, |m| m.ptr))
    }
    /// The fused algorithms' flags, zeroed once (on a stream of their own, the capture
    /// mode relaxed); every call leaves them zero.
    fn flags(&mut self) -> Result<DevPtr> {
        if self.flags.is_none() {
            let m = DeviceMem::new_relaxed(2 * plan::MAX_FLAGS * 4)?;
            with_relaxed_capture(|| m.zero())?;
            *self.flags = Some(m);
        }
        Ok(self.flags.as_ref().map_or(DevPtr::NULL, |m| m.ptr))
    }
}

/// The plan's view of our GEMM (`plan::Env`'s `own_gemm`, `own_gemm_kind`) from its slot
/// (None: not asked for; else loaded, or why not). The kind's verdict is what the ranks
/// decide alike: whether the device type takes our GEMM, not whether its load worked here
/// (an NVRTC or memory failure on one rank alone must not give that rank another protocol
/// than its peers': it runs cuBLASLt within the same one).
fn own_gemm_fns(
    slot: Option<&super::OwnGemmSlot>,
    dev: &crate::cuda::DeviceInfo,
) -> (Option<plan::OwnGemm>, Option<plan::OwnGemm>) {
    let loaded = match slot {
        Some(Ok(_)) => Some(crate::gemm::sm90::supports as plan::OwnGemm),
        _ => None,
    };
    let kind = match slot {
        Some(_) if crate::gemm::sm90::device_takes_it(dev) => {
            Some(crate::gemm::sm90::supports_kind as plan::OwnGemm)
        }
        _ => None,
    };
    (loaded, kind)
}

impl Overlap {
    /// What this object's calls plan with now.
    fn env(&self) -> Env {
        let peers = match self.t.peer_memory() {
            Some(pm) => (0..self.tp()).map(|q| pm.peer_buffer(q)).collect(),
            None => Default::default(),
        };
        let (own_gemm, own_gemm_kind) = own_gemm_fns(self.own_gemm.as_ref(), &self.group.dev);
        Env {
            tp: self.tp(),
            rank: self.tp_rank(),
            dtype: self.dtype,
            rows: self.rows,
            cols: self.cols,
            buffer: self.t.buffer(),
            buffer_bytes: self.t.buffer_bytes(),
            peers,
            caps: self.group.caps,
            slots: self.group.slots,
            policy: self.policy,
            sm_count: self.group.dev.sm_count,
            one_shot_max_bytes: super::ar::ONE_SHOT_MAX_BYTES,
            events: self.streams.ev_chunk.len(),
            compute_streams: self.streams.compute.len(),
            inline: self.inline_ok(),
            own_gemm,
            own_gemm_kind,
            nvtx: nvtx::enabled(),
            trace: self.diag.trace.is_some() && !self.call.capturing,
        }
    }

    /// One call: enter the object on `stream`, plan the call with `algo` (the algorithm's
    /// choice, its validation and its steps, no device work), then enqueue the plan's
    /// steps.
    pub(super) fn run_planned(
        &mut self,
        stream: StreamHandle,
        algo: impl FnOnce(&mut Planner) -> Result<()>,
    ) -> Result<()> {
        let guard = self.enter(stream)?;
        if self.policy.fused_on() && self.own_gemm.is_none() {
            self.own_gemm = Some(Sm90Gemm::get(&guard).map_err(|e| e.msg));
        }
        if matches!(self.own_gemm, Some(Ok(_))) && self.mem.stall.is_none() {
            self.mem.stall = Some(with_relaxed_capture(StallRecord::new)?);
        }
        let env = self.env();
        let mut plan = std::mem::take(&mut self.call.plan);
        plan.steps.clear();
        plan.algo = None;
        let planned = {
            let mut scratch = EngineScratch {
                staging: &mut self.mem.staging,
                amax_slots: &mut self.mem.amax_slots,
                flags: &mut self.mem.flags,
                buffer_bytes: env.buffer_bytes,
            };
            algo(&mut Planner {
                e: &env,
                res: &mut scratch,
                plan: &mut plan,
            })
        };
        self.call.caller = stream;
        if let Some(r) = self.diag.report.as_deref_mut() {
            r.next_algo = plan.algo;
        }
        let r = planned.and_then(|()| {
            plan::enqueue(
                &plan,
                &mut GpuDevice {
                    o: self,
                    guard: &guard,
                },
            )
        });
        self.call.plan = plan;
        r
    }
}

/// The GPU device of a call: the engine's streams, events, GEMMs and kernels.
struct GpuDevice<'a> {
    o: &'a mut Overlap,
    guard: &'a ContextGuard,
}

impl Device for GpuDevice<'_> {
    fn transport(&self) -> &dyn Transport {
        self.o.t.as_ref()
    }
    fn begin(
        &mut self,
        op: Op,
        gate_compute: bool,
        key: &[u64],
        full: Option<&GemmDesc>,
    ) -> Result<()> {
        let stream = self.o.call.caller;
        self.o.begin(stream, op, gate_compute, key, full)
    }
    fn finish(&mut self) -> Result<()> {
        let stream = self.o.call.caller;
        self.o.finish(stream)
    }
    fn lane(&self, lane: Lane) -> Result<StreamHandle> {
        match lane {
            Lane::Compute(i) => self.o.compute_stream(i),
            Lane::Comm(j) => self.o.comm_stream(j),
            Lane::Caller => Ok(self.o.call.caller),
        }
    }
    fn gemm(&self, g: &GemmDesc, index: usize, concurrent: bool, side: SideCopy) -> Result<()> {
        self.o.run_gemm(g, self.guard, (index, concurrent), side)
    }
    fn record(&self, ev: usize, stream: StreamHandle) -> Result<()> {
        self.o.streams.ev_chunk[ev].record(stream)
    }
    fn wait_event(&self, ev: usize, stream: StreamHandle) -> Result<()> {
        self.o.streams.ev_chunk[ev].wait_on(stream)
    }
    fn copy(&self, dst: DevPtr, src: DevPtr, bytes: usize, stream: StreamHandle) -> Result<()> {
        // SAFETY: a plan's step: the planner placed both ranges inside the engine's
        // buffers and the call's checked tensors (`plan.rs`; the host protocol tests check
        // every access in bounds).
        unsafe { copy_async(dst, src, bytes, stream) }
    }
    fn copy_2d(
        &self,
        dst: DevPtr,
        dpitch: usize,
        src: DevPtr,
        spitch: usize,
        width: usize,
        height: usize,
        stream: StreamHandle,
    ) -> Result<()> {
        // SAFETY: as `copy`: the plan's pitched ranges lie in the engine's buffers and the
        // call's checked tensors.
        unsafe { copy_2d(dst, dpitch, src, spitch, width, height, stream) }
    }
    fn memset(&self, dst: DevPtr, bytes: usize, stream: StreamHandle) -> Result<()> {
        // SAFETY: as `copy`: a plan's range of the engine's own memory.
        unsafe { memset_async(dst, bytes, stream) }
    }
    fn write_flag(&self, dst: DevPtr, value: u32, stream: StreamHandle) -> Result<()> {
        // SAFETY: a plan's flag: a u32 of this engine's or a peer's mapped flag memory.
        unsafe { write_value32(dst, value, stream) }
    }
    fn wait_flag(&self, ptr: DevPtr, value: u32, stream: StreamHandle) -> Result<()> {
        wait_value32_geq(ptr, value, stream)
    }
    fn fused_gemm(&self, g: &GemmDesc, hooks: &Hooks, sms: usize, index: usize) -> Result<()> {
        self.o.run_fused(g, hooks, sms, index)
    }
    fn reduce(&self, r: &Reduce, stream: StreamHandle) -> Result<()> {
        self.o.reduce(r, stream)
    }
    fn copy_segments(
        &self,
        segs: &[(DevPtr, DevPtr, usize)],
        stream: StreamHandle,
        tail: bool,
    ) -> Result<()> {
        // SAFETY: a plan's segments: ranges of this engine's or a peer's mapped buffers
        // and of the call's operands, inside them (the planner's offsets).
        unsafe { self.o.copy_segments(segs, stream, tail) }
    }
    fn amax_max(&self, out: DevPtr, slots: DevPtr, n: usize) -> Result<()> {
        if self.o.skipping_gemms() {
            return Ok(()); // NVTE_COMM_REPORT's comm-alone runs wrote no slot
        }
        // SAFETY: the plan's amax step: `slots` are this engine's n amax slots, `out` the
        // output tensor's amax (an f32 of the call's checked operands).
        unsafe { self.o.reduce_amax(out, slots, n, self.o.call.caller) }
    }
    fn nvtx(&self, name: &str) {
        self.o.step(|| name.to_string());
    }
    fn mark(&mut self, stream: StreamHandle, name: &str) -> Result<()> {
        self.o.mark(stream, || name.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::own_gemm_fns;
    use crate::cuda::DeviceInfo;

    #[test]
    fn a_failed_load_keeps_the_device_types_verdict_on_the_kind() {
        let dev = |cc_major, cc_minor| DeviceInfo {
            ordinal: 0,
            sm_count: 132,
            cc_major,
            cc_minor,
        };
        let failed: super::super::OwnGemmSlot = Err("NVRTC failed (test)".into());
        // Hopper, the load failed on this rank: no GEMM of ours, but the kind's verdict
        // as on its peers whose load worked.
        let (own, kind) = own_gemm_fns(Some(&failed), &dev(9, 0));
        assert!(own.is_none() && kind.is_some());
        // Another device type: neither (every rank of that type alike).
        let (own, kind) = own_gemm_fns(Some(&failed), &dev(10, 0));
        assert!(own.is_none() && kind.is_none());
        // Not asked for (no fused algorithm): neither.
        let (own, kind) = own_gemm_fns(None, &dev(9, 0));
        assert!(own.is_none() && kind.is_none());
    }
}
