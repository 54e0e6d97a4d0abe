//! The per-call overlap report (NVTE_COMM_REPORT=1): the last call's figures.
use super::comm_gemm::{NVTECommGemmCtx, ctx as ctx_of};
use super::enums::NVTECommStatus;
use super::overlap::{NVTECommOverlap, object};
use crate::error::Result;
use crate::invalid;
use crate::overlap::Op;
use crate::overlap::report::Figures;
use std::ffi::c_char;

/// The figures of one call of an overlap object or comm-GEMM engine, measured with
/// NVTE_COMM_REPORT=1 (set on every rank when the object / context is created): its
/// time on the caller's stream, and the object's estimates for its shape, bound =
/// max(GEMM alone, comm alone). Estimates are NaN for calls that accumulate into D or
/// were captured into a CUDA graph (captured calls are not timed: the last eager call is
/// reported).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct NVTECommCallReport {
    /// the object's call number of this call
    pub call: u64,
    /// the operation ("split_ag", "split_rs", "split_rs_p2p", "split_ar", "bulk_ag",
    /// "bulk_rs"; a static string)
    pub op: *const c_char,
    /// the whole GEMM's m, n, k (0 for bulk calls)
    pub m: i64,
    pub n: i64,
    pub k: i64,
    /// the call, on the caller's stream, ms
    pub call_ms: f32,
    /// the whole GEMM alone (unsplit, every SM), ms
    pub gemm_alone_ms: f32,
    /// the call's communication alone (its GEMMs skipped), ms
    pub comm_alone_ms: f32,
    /// max(gemm_alone_ms, comm_alone_ms)
    pub bound_ms: f32,
    /// call_ms / bound_ms
    pub ratio: f32,
}

fn op_cname(op: Op) -> &'static std::ffi::CStr {
    match op {
        Op::SplitAg => c"split_ag",
        Op::SplitRs => c"split_rs",
        Op::SplitRsP2p => c"split_rs_p2p",
        Op::SplitAr => c"split_ar",
        Op::FusedAg => c"fused_ag",
        Op::BulkAg => c"bulk_ag",
        Op::BulkRs => c"bulk_rs",
        Op::CopyIntoBuffer => c"copy_into_buffer",
        Op::Destroy => c"destroy",
    }
}

fn write(out: *mut NVTECommCallReport, f: Option<Figures>, what: &str) -> Result<()> {
    let Some(f) = f else {
        invalid!(
            "no call to report: NVTE_COMM_REPORT=1 must be set when the {what} is created, and a call must have run eagerly (not captured) since"
        );
    };
    let r = NVTECommCallReport {
        call: f.call,
        op: op_cname(f.op).as_ptr(),
        m: f.m as i64,
        n: f.n as i64,
        k: f.k as i64,
        call_ms: f.call_ms,
        gemm_alone_ms: f.gemm_ms,
        comm_alone_ms: f.comm_ms,
        bound_ms: f.bound_ms(),
        ratio: f.ratio(),
    };
    // SAFETY: non-null (checked by the callers), the caller's struct.
    unsafe { std::ptr::write_unaligned(out, r) };
    Ok(())
}

/// The last timed call of `overlap` (waits, bounded by the timeout, for it to complete).
/// INVALID_ARGUMENT when NVTE_COMM_REPORT was not set at creation or no call was timed.
#[unsafe(no_mangle)]
pub extern "C" fn nvte_comm_overlap_last_report(
    overlap: *mut NVTECommOverlap,
    out: *mut NVTECommCallReport,
) -> NVTECommStatus {
    entry!(status, {
        if out.is_null() {
            invalid!("argument `out` is NULL");
        }
        let o = object(overlap)?;
        let mut g = o.lock().unwrap_or_else(|e| e.into_inner());
        let f = g.last_report()?;
        write(out, f, "object")
    })
}

/// The last timed call of the comm-GEMM context `ctx` (its engine of that call), as
/// `nvte_comm_overlap_last_report`.
#[unsafe(no_mangle)]
pub extern "C" fn nvte_comm_gemm_last_report(
    ctx: *mut NVTECommGemmCtx,
    out: *mut NVTECommCallReport,
) -> NVTECommStatus {
    entry!(status, {
        if out.is_null() {
            invalid!("argument `out` is NULL");
        }
        let c = ctx_of(ctx)?;
        let mut g = c.lock().unwrap_or_else(|e| e.into_inner());
        let f = g.last_report()?;
        write(out, f, "context")
    })
}
