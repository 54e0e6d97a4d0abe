//! Bulk overlap [TE: BULK_OVERLAP_AG, BULK_OVERLAP_RS]: a collective on the pre-filled
//! buffer runs on the comm stream while an unrelated GEMM (e.g. the wgrad GEMM beside the
//! dgrad reduce-scatter) runs on a compute stream, with the GEMM leaving the comm SMs
//! free when the collective uses SMs.
//! - AG: every rank's chunk of the buffer (rows [r rows/tp, ...)) is put into every peer's
//!   buffer, leaving the whole buffer gathered on every rank.
//! - RS: the buffer [rows, cols] is summed over ranks; rank r gets its rows in
//!   `rs_output` [rows/tp, cols].
use super::plan::{Lane, Planner, Reduce};
use super::schedule::PerRank;
use super::{Op, Overlap, eb, tag};
use crate::cuda::DevPtr;
use crate::cuda::StreamHandle;
use crate::error::Result;
use crate::gemm::{self, TeGemm};
use crate::tensor::Tensor;
use crate::transport::WaitInfo;
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
    pub fn bulk(&mut self, x: &BulkArgs, stream: StreamHandle) -> Result<()> {
        self.run_planned(stream, |p| p.bulk(x))
    }
}

impl Planner<'_> {
    /// [`Algo::Bulk`](super::policy::Algo::Bulk): the collective on the buffer (peer
    /// memory: puts and a reduction of the peers' buffers; else the transport's
    /// collectives) beside the unrelated GEMM, which leaves the comm SMs free where SM
    /// kernels move the bytes (the reduce-scatter, or puts without `use_ce`).
    pub(super) fn bulk_call(&mut self, x: &BulkArgs, use_ce: bool) -> Result<()> {
        let comm_sms = x.kind == BulkKind::ReduceScatter || !use_ce;
        let mut g: TeGemm = x.gemm;
        g.math_sm_count = self.math_sms(comm_sms);
        let desc = gemm::desc_from_te(&g)?;
        let scale_inv = self.bulk_check(x)?;
        let op = if x.kind == BulkKind::AllGather {
            Op::BulkAg
        } else {
            Op::BulkRs
        };
        self.begin(op, false, &desc.check_key(), None);
        if self.e.caps.peer_memory {
            self.bulk_peer_memory(x, op, scale_inv)?;
        } else {
            self.bulk_collective(x)?;
        }
        self.gemm(&desc, 0, false);
        self.finish();
        Ok(())
    }

    /// The arguments' checks; the buffer's scale_inv (FP8 reduce-scatter).
    fn bulk_check(&self, x: &BulkArgs) -> Result<DevPtr> {
        let rc = self.e.rows / self.tp();
        let mut scale_inv = DevPtr::NULL;
        if let Some(v) = x.buffer_view {
            if v.data.ptr != self.buffer() || v.data.dtype != self.dtype() {
                invalid!(
                    "tensor `buffer` must be a view of the overlap buffer (nvte_comm_overlap_get_buffer) of its dtype"
                );
            }
            scale_inv = Tensor::scalar_ptr(&v.scale_inv).unwrap_or_default();
        }
        if x.kind != BulkKind::ReduceScatter {
            return Ok(scale_inv);
        }
        let Some(o) = x.rs_output else {
            invalid!("tensor `rs_output` is required for a bulk reduce-scatter")
        };
        self.check_reduce_output(&o.data, "rs_output")?;
        Self::check_fp8_output(o, "rs_output")?;
        if !self.e.caps.peer_memory && o.data.dtype != self.dtype() {
            unsupported!(
                "a bulk reduce-scatter by the transport's collective writes the buffer's dtype {}: tensor `rs_output` is {}",
                self.dtype().name(),
                o.data.dtype.name()
            );
        }
        if o.data.numel() != rc * self.e.cols {
            invalid!(
                "tensor `rs_output` has shape {} but must be [rows/tp, cols] = [{rc}, {}]",
                o.data.shape,
                self.e.cols
            );
        }
        if self.dtype().is_fp8() && scale_inv.is_null() {
            invalid!(
                "an FP8 bulk reduce-scatter needs tensor `buffer` with scale_inv (1/scale of the buffer's data)"
            );
        }
        Ok(scale_inv)
    }

    /// Without peer memory: the transport's all-gather (in place) or reduce-scatter.
    fn bulk_collective(&mut self, x: &BulkArgs) -> Result<()> {
        let r = self.tp_rank();
        let rc = self.e.rows / self.tp();
        let chunk_bytes = rc * self.e.cols * eb(self.dtype());
        let cs = Lane::Comm(0);
        match (x.kind, x.rs_output) {
            (BulkKind::AllGather, _) => {
                // In place: this rank's chunk is already at its offset in the buffer.
                self.all_gather(
                    self.buffer() + r * chunk_bytes,
                    self.buffer(),
                    chunk_bytes,
                    cs,
                )
            }
            (BulkKind::ReduceScatter, Some(o)) => {
                let count = rc * self.e.cols;
                self.reduce_scatter((self.buffer(), o.data.ptr, count), self.dtype(), cs)
            }
            (BulkKind::ReduceScatter, None) => invalid!("tensor `rs_output` is required"),
        }
    }

    /// With peer memory: `bytes` at `src` put at offset `at` of every peer's buffer, the
    /// puts spread over both comm streams (two copy engines / SM groups), each followed by
    /// its signal; comm stream 0 then waits for every peer's puts into this rank's buffer
    /// (every rank calls it with its own chunk: an all-gather). Uses event 1.
    pub(super) fn put_to_peers(
        &mut self,
        src: DevPtr,
        at: usize,
        bytes: usize,
        op: Op,
    ) -> Result<()> {
        let others = self.others();
        let cs = Lane::Comm(0);
        let slot = self.e.slots.bulk;
        for (j, &p) in others.iter().enumerate() {
            let st = Lane::Comm(j % 2);
            self.put(p, at, src, bytes, st)?;
            self.signal(&[p], slot, tag(0), st)?;
        }
        if others.len() > 1 {
            // comm stream 1 carried puts: comm stream 0 waits for them
            self.record(1, Lane::Comm(1));
            self.wait_event(1, cs);
        }
        let info = WaitInfo {
            op: op as u32,
            step: 0,
        };
        self.wait(&others, (slot, tag(0)), cs, info)
    }

    /// With peer memory: AG puts this rank's chunk into every peer's buffer; RS sums
    /// this rank's rows of every buffer.
    fn bulk_peer_memory(&mut self, x: &BulkArgs, op: Op, scale_inv: DevPtr) -> Result<()> {
        let (tp, r) = (self.tp(), self.tp_rank());
        let rc = self.e.rows / tp;
        let cols = self.e.cols;
        let chunk_bytes = rc * cols * eb(self.dtype());
        let others = self.others();
        let cs = Lane::Comm(0);
        let slot = self.e.slots.bulk;
        let info = WaitInfo {
            op: op as u32,
            step: 0,
        };
        if x.kind == BulkKind::AllGather {
            let mine = self.buffer() + r * chunk_bytes;
            return self.put_to_peers(mine, r * chunk_bytes, chunk_bytes, op);
        }
        self.signal(&others, slot, tag(0), cs)?;
        self.wait(&others, (slot, tag(0)), cs, info)?;
        let srcs: PerRank<DevPtr> = (0..tp)
            .map(|q| self.peer(q).map(|b| b + r * chunk_bytes))
            .collect::<Result<_>>()?;
        let Some(o) = x.rs_output else {
            invalid!("tensor `rs_output` is required for a bulk reduce-scatter")
        };
        let fp8_out = self.fp8_output(o, "rs_output", cs)?;
        self.reduce(
            Reduce {
                out: o.data.ptr,
                out_type: o.data.dtype,
                out_ld: cols,
                srcs,
                in_ld: cols,
                rows: rc,
                cols,
                in_scale: scale_inv,
                fp8_out,
                tail: false,
            },
            cs,
        );
        Ok(())
    }
}
