//! Bulk overlap [TE: BULK_OVERLAP_AG, BULK_OVERLAP_RS]: a collective on the pre-filled
//! buffer runs on the comm stream while an unrelated GEMM (e.g. the wgrad GEMM beside the
//! dgrad reduce-scatter) runs on a compute stream, with the GEMM leaving the comm SMs
//! free when the collective uses SMs.
//! - AG: every rank's chunk of the buffer (rows [r rows/tp, ...)) is put into every peer's
//!   buffer, leaving the whole buffer gathered on every rank.
//! - RS: the buffer [rows, cols] is summed over ranks; rank r gets its rows in
//!   `rs_output` [rows/tp, cols].
use super::{Op, Overlap, eb, tag};
use crate::cuda::DevPtr;
use crate::error::Result;
use crate::gemm::{self, TeGemm};
use crate::tensor::Tensor;
use crate::transport::{Slot, WaitInfo};
use crate::{invalid, unsupported};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BulkKind {
    AllGather,
    ReduceScatter,
}

pub struct BulkArgs<'a> {
    pub kind: BulkKind,
    pub gemm: TeGemm<'a>,
    /// The buffer view, carrying scale_inv for an FP8 reduce-scatter (None: plain).
    pub buffer_view: Option<&'a Tensor>,
    pub rs_output: Option<&'a Tensor>,
}

impl Overlap {
    pub fn bulk(&mut self, x: &BulkArgs, stream: usize) -> Result<()> {
        let guard = self.enter(stream)?;
        let (tp, r) = (self.tp(), self.tp_rank());
        let comm_sms = x.kind == BulkKind::ReduceScatter || !self.cfg.use_ce;
        let mut g: TeGemm = x.gemm;
        g.math_sm_count = self.math_sms(comm_sms);
        let desc = gemm::desc_from_te(&g)?;
        let rc = self.rows / tp;
        let e = eb(self.dtype);
        let mut scale_inv = DevPtr::NULL;
        if let Some(v) = x.buffer_view {
            if v.data.ptr != self.buffer() || v.data.dtype != self.dtype {
                invalid!(
                    "tensor `buffer` must be a view of the overlap buffer (nvte_comm_overlap_get_buffer) of its dtype"
                );
            }
            scale_inv = Tensor::scalar_ptr(&v.scale_inv).unwrap_or_default();
        }
        if x.kind == BulkKind::ReduceScatter {
            let Some(o) = x.rs_output else {
                invalid!("tensor `rs_output` is required for a bulk reduce-scatter")
            };
            self.check_reduce_output(&o.data, "rs_output")?;
            Self::check_fp8_output(o, "rs_output")?;
            if self.t.nccl().is_some() && o.data.dtype != self.dtype {
                unsupported!(
                    "a bulk reduce-scatter over NCCL writes the buffer's dtype {}: tensor `rs_output` is {}",
                    self.dtype.name(),
                    o.data.dtype.name()
                );
            }
            if o.data.numel() != rc * self.cols {
                invalid!(
                    "tensor `rs_output` has shape {} but must be [rows/tp, cols] = [{rc}, {}]",
                    o.data.shape,
                    self.cols
                );
            }
            if self.dtype.is_fp8() && scale_inv.is_null() {
                invalid!(
                    "an FP8 bulk reduce-scatter needs tensor `buffer` with scale_inv (1/scale of the buffer's data)"
                );
            }
        }
        self.begin(
            stream,
            if x.kind == BulkKind::AllGather {
                Op::BulkAg
            } else {
                Op::BulkRs
            },
            false,
            &desc.check_key(),
            None,
        )?;
        let others = self.others();
        let cs = self.comm_stream(0)?;
        let info = WaitInfo {
            op: if x.kind == BulkKind::AllGather {
                Op::BulkAg
            } else {
                Op::BulkRs
            } as u32,
            step: 0,
        };
        let chunk_bytes = rc * self.cols * e;
        match (x.kind, self.t.nccl()) {
            (BulkKind::AllGather, Some(comm)) => {
                // In place: this rank's chunk is already at its offset in the buffer.
                comm.all_gather_bytes(
                    self.buffer() + r * chunk_bytes,
                    self.buffer(),
                    chunk_bytes,
                    cs,
                )?;
            }
            (BulkKind::ReduceScatter, Some(comm)) => {
                let out = &x.rs_output.unwrap().data; // dtype checked before the call
                comm.reduce_scatter(self.buffer(), out.ptr, rc * self.cols, self.dtype, cs)?;
            }
            (BulkKind::AllGather, None) => {
                // Spread the puts over both comm streams (two copy engines / SM groups).
                for (j, &p) in others.iter().enumerate() {
                    let st = self.comm_stream(j % 2)?;
                    self.t.put(
                        p,
                        r * chunk_bytes,
                        self.buffer() + r * chunk_bytes,
                        chunk_bytes,
                        st,
                    )?;
                    self.t.signal(&[p], Slot::Bulk, tag(0), st)?;
                }
                if others.len() > 1 {
                    // comm stream 1 carried puts: comm stream 0 waits for them
                    self.ev_chunk[1].record(self.comm_stream(1)?)?;
                    self.ev_chunk[1].wait_on(cs)?;
                }
                self.t.wait(&others, Slot::Bulk, tag(0), cs, info)?;
            }
            (BulkKind::ReduceScatter, None) => {
                self.t.signal(&others, Slot::Bulk, tag(0), cs)?;
                self.t.wait(&others, Slot::Bulk, tag(0), cs, info)?;
                let srcs: super::schedule::PerRank<DevPtr> = (0..tp)
                    .map(|q| self.t.peer_buffer(q).unwrap() + r * chunk_bytes)
                    .collect();
                let o = x.rs_output.unwrap();
                let fp8 = Self::fp8_output(o, "rs_output", cs)?;
                self.reduce(
                    &o.data, 0, self.cols, &srcs, self.cols, rc, self.cols, scale_inv, fp8, cs,
                    false,
                )?;
            }
        }
        self.run_gemm(&desc, &guard, 0, false)?;
        self.finish(stream)
    }
}
