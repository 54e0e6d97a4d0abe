//! Per-call overlap report (NVTE_COMM_REPORT=1, read when an object is created): how long
//! each call took against what it could take at best, bound = max(GEMM alone, comm alone).
//!
//! - The call's time: timed events on the caller's stream around the call (from its first
//!   enqueued work, the arrival barrier included, to the join of its streams).
//! - The estimates, measured by this object on the first call of each shape (operation,
//!   m, n, k, types, layout: the call descriptor), right after that call, on its stream:
//!   *GEMM alone* is the whole GEMM, unsplit, on every SM, into scratch memory; *comm
//!   alone* is the same call with its GEMMs skipped (the algorithm's own transfers,
//!   signals and reductions). Each is the mean of 3 runs after a warm-up run; then the
//!   call runs once more, so its outputs are those of a real call. Every rank measures
//!   at the same call (the descriptor agrees across ranks), so NVTE_COMM_REPORT must be
//!   set on every rank of the group. Calls that accumulate into D, or are captured into a
//!   CUDA graph, are timed without estimates (NaN).
//! - `nvte_comm_overlap_last_report` / `nvte_comm_gemm_last_report` give the last call's
//!   figures; at destroy each rank prints one line per shape to stderr, with the
//!   algorithm (`policy::Algo`) and the policy of the shape's last timed call.
use super::policy::{Algo, Policy};
use super::{Op, Overlap};
use crate::cuda::StreamHandle;
use crate::cuda::resources::{DeviceMem, Event, capture_status, mean_time};
use crate::cuda::{ContextGuard, DevPtr};
use crate::error::Result;
use crate::gemm::{self, GemmDesc};
use std::collections::HashMap;

/// One call's figures (`NVTECommCallReport` in the C API).
#[derive(Clone, Copy, Debug)]
pub struct Figures {
    pub op: Op,
    pub call: u64,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub call_ms: f32,
    pub gemm_ms: f32,
    pub comm_ms: f32,
}

impl Figures {
    pub fn bound_ms(&self) -> f32 {
        self.gemm_ms.max(self.comm_ms)
    }
    pub fn ratio(&self) -> f32 {
        self.call_ms / self.bound_ms()
    }
}

/// What identifies a shape for the estimates. It must be the same on every rank of a
/// call, since every rank decides from it whether this call is calibrated (collective
/// extra runs): the operation, the buffer's element type and the GEMM's dimensions as
/// the caller states them (the comm-GEMM context passes the global m, n, k, which every
/// rank shares; block shares differ with uneven sizes) — not the epilogue (the comm-GEMM
/// reductions add the bias on rank 0 only).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub(super) struct ShapeKey {
    op: u32,
    dtype: u32,
    dims: [i64; 3],
}

struct Shape {
    /// the estimates were measured (or cannot be: accumulating calls)
    calibrated: bool,
    op: Op,
    m: usize,
    n: usize,
    k: usize,
    gemm_ms: f32,
    comm_ms: f32,
    calls: Vec<f32>,
    /// the algorithm and policy of the last timed call
    algo: Option<Algo>,
    policy: Option<Policy>,
}

pub(super) struct Report {
    ev_start: Event,
    ev_end: Event,
    /// calibration in progress: its calls are not timed as calls
    pub(super) calibrating: bool,
    /// comm-alone runs: the chunk GEMMs are skipped
    pub(super) skip_gemms: bool,
    /// the last call (its events hold its time until read)
    last_key: Option<ShapeKey>,
    last_full: Option<GemmDesc>,
    last_op: Op,
    /// the algorithm of the call being enqueued (set when it is planned) and of the last
    pub(super) next_algo: Option<Algo>,
    last_algo: Option<Algo>,
    last_call: u64,
    last_timed: bool,
    pending: bool,
    last: Option<Figures>,
    shapes: HashMap<ShapeKey, Shape>,
    scratch: Option<DeviceMem>,
    scratch_aux: Option<DeviceMem>,
}

impl Shape {
    /// A shape of `op` with `full`'s m, n, k (0s without a GEMM), no estimates yet.
    fn new(op: Op, full: Option<&GemmDesc>, calibrated: bool) -> Shape {
        let (m, n, k) = full.map(|g| (g.m, g.n, g.k)).unwrap_or((0, 0, 0));
        Shape {
            calibrated,
            op,
            m,
            n,
            k,
            gemm_ms: f32::NAN,
            comm_ms: f32::NAN,
            calls: Vec::new(),
            algo: None,
            policy: None,
        }
    }
}

impl Report {
    pub(super) fn new() -> Result<Report> {
        Ok(Report {
            ev_start: Event::timed()?,
            ev_end: Event::timed()?,
            calibrating: false,
            skip_gemms: false,
            last_key: None,
            last_full: None,
            last_op: Op::SplitAg,
            next_algo: None,
            last_algo: None,
            last_call: 0,
            last_timed: false,
            pending: false,
            last: None,
            shapes: HashMap::new(),
            scratch: None,
            scratch_aux: None,
        })
    }
}

impl Overlap {
    /// NVTE_COMM_REPORT (a boolean; default off).
    pub fn report_enabled() -> Result<bool> {
        Ok(crate::env::REPORT.get()?.unwrap_or(false))
    }

    /// Turn the report on for this object (the comm-GEMM context does, for its engines,
    /// when NVTE_COMM_REPORT was set at the context's creation).
    pub fn enable_report(&mut self) -> Result<()> {
        if self.diag.report.is_none() {
            let _guard = ContextGuard::for_stream(StreamHandle::NULL)?;
            self.diag.report = Some(Box::new(Report::new()?));
        }
        Ok(())
    }

    /// The comm-GEMM context's global m, n, k of the next calls (the report's shape key).
    pub fn set_report_dims(&mut self, dims: Option<[i64; 3]>) {
        self.diag.report_dims = dims;
    }

    /// begin(): the call's start, its shape and GEMM. A captured call leaves the report
    /// alone: the last eager call stays the reported one.
    pub(super) fn report_begin(
        &mut self,
        stream: StreamHandle,
        op: Op,
        full: Option<&GemmDesc>,
    ) -> Result<()> {
        let (capturing, calls, dtype, dims) = (
            self.call.capturing,
            self.call.calls,
            self.dtype as u32,
            self.diag.report_dims,
        );
        let Some(r) = self.diag.report.as_deref_mut() else {
            return Ok(());
        };
        if r.calibrating || capturing {
            r.last_timed = r.last_timed && !capturing;
            return Ok(());
        }
        let local = full
            .map(|g| [g.m as i64, g.n as i64, g.k as i64])
            .unwrap_or([0; 3]);
        r.last_key = Some(ShapeKey {
            op: op as u32,
            dtype,
            dims: dims.unwrap_or(local),
        });
        r.last_full = full.copied();
        r.last_op = op;
        r.last_algo = r.next_algo;
        r.last_call = calls;
        r.last_timed = true;
        r.pending = false;
        r.ev_start.record(stream)?;
        Ok(())
    }

    /// finish(): the call's end on the caller's stream.
    pub(super) fn report_end(&mut self, stream: StreamHandle) -> Result<()> {
        let Some(r) = self.diag.report.as_deref_mut() else {
            return Ok(());
        };
        if r.calibrating || !r.last_timed || self.call.capturing {
            return Ok(());
        }
        r.ev_end.record(stream)?;
        r.pending = true;
        Ok(())
    }

    /// Whether the chunk GEMMs are skipped (comm-alone runs).
    pub(super) fn skipping_gemms(&self) -> bool {
        self.diag.report.as_ref().is_some_and(|r| r.skip_gemms)
    }

    /// Read the last call's time (waiting for it when `block`, bounded) into its shape.
    fn collect(&mut self, block: bool) -> Result<()> {
        let (timeout_ms, policy) = (self.policy.timeout_ms, self.policy);
        let Some(r) = self.diag.report.as_deref_mut() else {
            return Ok(());
        };
        if !r.pending {
            return Ok(());
        }
        // Relaxed: the query must not disturb another thread's global-mode capture.
        if !block && !crate::cuda::resources::with_relaxed_capture(|| r.ev_end.done())? {
            return Ok(());
        }
        r.ev_end
            .wait_bounded(timeout_ms, "NVTE_COMM_REPORT: the reported call")?;
        r.pending = false;
        let ms = r.ev_end.elapsed_since(&r.ev_start)?;
        let Some(key) = r.last_key else {
            return Ok(());
        };
        let (op, full) = (r.last_op, r.last_full);
        let (m, n, k) = full.map(|g| (g.m, g.n, g.k)).unwrap_or((0, 0, 0));
        let s = r
            .shapes
            .entry(key)
            .or_insert_with(|| Shape::new(op, full.as_ref(), false));
        s.calls.push(ms);
        s.algo = r.last_algo;
        s.policy = Some(policy);
        r.last = Some(Figures {
            op: r.last_op,
            call: r.last_call,
            m,
            n,
            k,
            call_ms: ms,
            gemm_ms: s.gemm_ms,
            comm_ms: s.comm_ms,
        });
        Ok(())
    }

    /// Run `call` (one operation with its arguments) with the report's bookkeeping: on the
    /// first timed call of a shape, measure the estimates and run the call again.
    pub(super) fn reported(
        &mut self,
        stream: StreamHandle,
        call: impl Fn(&mut Self) -> Result<()>,
    ) -> Result<()> {
        let Some(r) = self.diag.report.as_deref_mut() else {
            return call(self);
        };
        // Left set only by a calibration that panicked (errors reset them): not in one now.
        r.calibrating = false;
        r.skip_gemms = false;
        // No event may be queried while the caller's stream is being captured.
        if capture_status(stream)?.active() {
            return call(self);
        }
        self.collect(false)?;
        call(self)?;
        let r = self.diag.report.as_deref_mut().unwrap();
        let (Some(key), Some(full), true) = (r.last_key, r.last_full, r.last_timed) else {
            return Ok(()); // captured, or no GEMM (not an overlap-with-GEMM call)
        };
        if r.shapes.get(&key).is_some_and(|s| s.calibrated) {
            return Ok(());
        }
        if full.accumulate {
            // A second run would accumulate twice: no estimates, and no host wait.
            let op = r.last_op;
            r.shapes
                .entry(key)
                .or_insert_with(|| Shape::new(op, Some(&full), true));
            return Ok(());
        }
        self.collect(true)?;
        self.diag.report.as_deref_mut().unwrap().calibrating = true;
        let est = self.estimates(stream, full, &call);
        let r = self.diag.report.as_deref_mut().unwrap();
        r.skip_gemms = false;
        let (comm_ms, gemm_ms) = match est {
            Ok(v) => v,
            Err(e) => {
                r.calibrating = false;
                return Err(e);
            }
        };
        if let Some(s) = r.shapes.get_mut(&key) {
            s.gemm_ms = gemm_ms;
            s.comm_ms = comm_ms;
            s.calibrated = true;
        }
        if let Some(f) = r.last.as_mut() {
            f.gemm_ms = gemm_ms;
            f.comm_ms = comm_ms;
        }
        // Once more for real (still calibrating: not a new reported call), so that the
        // outputs are a real call's.
        let res = call(self);
        self.diag.report.as_deref_mut().unwrap().calibrating = false;
        res
    }

    /// The shape's estimates, measured on `stream` (each a warm-up, then 3 timed runs):
    /// the call with its GEMMs skipped (comm alone), and the whole GEMM on every SM into
    /// scratch (GEMM alone). The caller resets the flags this sets.
    fn estimates(
        &mut self,
        stream: StreamHandle,
        full: GemmDesc,
        call: &impl Fn(&mut Self) -> Result<()>,
    ) -> Result<(f32, f32)> {
        let guard = ContextGuard::for_stream(stream)?;
        self.diag.report.as_deref_mut().unwrap().skip_gemms = true;
        let comm_ms = self.time_runs(stream, call)?;
        let mut g = full;
        let r = self.diag.report.as_deref_mut().unwrap();
        r.skip_gemms = false;
        let dbytes = g.n * g.ldd * g.d_type.bits() / 8;
        if r.scratch.as_ref().is_none_or(|s| s.bytes < dbytes) {
            r.scratch = Some(DeviceMem::new_relaxed(dbytes.max(1))?);
        }
        g.d = r.scratch.as_ref().unwrap().ptr;
        if !g.aux.is_null() {
            let abytes = g.n * g.ldd * g.aux_type.bits() / 8;
            if r.scratch_aux.as_ref().is_none_or(|s| s.bytes < abytes) {
                r.scratch_aux = Some(DeviceMem::new_relaxed(abytes.max(1))?);
            }
            g.aux = r.scratch_aux.as_ref().unwrap().ptr;
        }
        g.d_amax = DevPtr::NULL;
        g.sm_count = 0;
        // SAFETY: the call's full descriptor (validated from the caller's tensors, which
        // outlive the call) with D and aux redirected into this report's scratch, sized
        // above for n columns at D's pitch; no amax; the same workspace as the call's.
        let gemm_ms = self.time_runs(stream, |_| unsafe {
            gemm::run_beside_comm(&g, &guard, stream)
        })?;
        Ok((comm_ms, gemm_ms))
    }

    /// Mean time of `run` on `stream`: a warm-up, then 3 timed runs.
    fn time_runs(
        &mut self,
        stream: StreamHandle,
        run: impl FnMut(&mut Self) -> Result<()>,
    ) -> Result<f32> {
        let timeout_ms = self.policy.timeout_ms;
        mean_time(
            self,
            stream,
            timeout_ms,
            "NVTE_COMM_REPORT: the timed runs",
            3,
            run,
        )
    }

    /// The last timed call's figures (waits, bounded, for it to complete). None when the
    /// report is off or no call was timed yet.
    pub fn last_report(&mut self) -> Result<Option<Figures>> {
        if self.diag.report.is_none() {
            return Ok(None);
        }
        self.collect(true)?;
        Ok(self.diag.report.as_ref().and_then(|r| r.last))
    }

    /// At destroy: one line per shape (median of its calls) on stderr.
    pub(super) fn print_report(&mut self) {
        let _ = self.collect(false);
        let Some(r) = self.diag.report.as_deref() else {
            return;
        };
        let mut shapes: Vec<&Shape> = r.shapes.values().collect();
        shapes.sort_by_key(|s| (s.op as u32, s.m, s.n, s.k));
        for s in shapes {
            let mut c = s.calls.clone();
            c.sort_by(|a, b| a.total_cmp(b));
            let med = c.get(c.len() / 2).copied().unwrap_or(f32::NAN);
            let bound = s.gemm_ms.max(s.comm_ms);
            let algo = s.algo.map_or("?".to_string(), |a| a.to_string());
            let policy = s.policy.map_or("?".to_string(), |p| p.summary());
            eprintln!(
                "[te_comm report] world rank {}: {:?} m={} n={} k={}: {} calls, median {:.3} ms; GEMM alone {:.3} ms, comm alone {:.3} ms, bound {:.3} ms, median/bound {:.3}; algorithm {algo}; policy {policy}",
                self.group.world_rank,
                s.op,
                s.m,
                s.n,
                s.k,
                c.len(),
                med,
                s.gemm_ms,
                s.comm_ms,
                bound,
                med / bound
            );
        }
    }
}
