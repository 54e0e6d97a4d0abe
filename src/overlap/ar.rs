//! GEMM + all-reduce, pipelined: the GEMM (k split across ranks, so every rank holds a
//! partial [n, m]) is split into `num_splits` row chunks written into the buffer; as
//! soon as every rank has chunk i, it is all-reduced into D while chunk i+1 computes.
//! - IPC, small chunks: one-shot (every rank sums the whole chunk from all buffers).
//! - IPC, large chunks: two-shot (each rank sums its 1/tp slice in place, then copies the
//!   peers' reduced slices with the copy engine), moving 2(tp-1)/tp of the chunk per rank
//!   instead of tp-1.
//! - NCCL: ncclAllReduce per chunk, from the buffer into D.
use super::{Op, Overlap, eb, val};
use crate::cuda::resources::copy_async;
use crate::error::Result;
use crate::gemm::{self, Epilogue, TeGemm};
use crate::tensor::{Buffer, Shape, Tensor};
use crate::transport::{Slot, WaitInfo, nccl};
use crate::{invalid, unsupported};

/// Chunks at most this large (bytes) are all-reduced one-shot.
const ONE_SHOT_MAX_BYTES: usize = 1 << 20;

pub struct ArArgs<'a> {
    pub a: &'a Tensor,
    pub transa: bool,
    pub b: &'a Tensor,
    pub transb: bool,
    /// The full output [n, m] on every rank.
    pub d: &'a Tensor,
    pub bias: Option<&'a Tensor>,
    pub pre_gelu_out: Option<&'a Tensor>,
    pub grad: bool,
    pub workspace: Option<&'a Tensor>,
    pub accumulate: bool,
    pub use_split_accumulator: bool,
}

impl Overlap {
    pub fn split_ar(&mut self, x: &ArArgs, stream: usize) -> Result<()> {
        let guard = self.enter(stream)?;
        let (tp, r) = (self.tp(), self.tp_rank());
        let db = &x.d.data;
        if db.dtype != self.dtype || self.dtype.is_fp8() {
            unsupported!(
                "the all-reduce sums in the output dtype: tensor `D` ({}) must match the buffer dtype ({}), and not be FP8",
                db.dtype.name(),
                self.dtype.name()
            );
        }
        if x.accumulate {
            unsupported!(
                "accumulate = true with an all-reduce would add D to every rank's partial"
            );
        }
        let Some((n, m)) = db.rows_cols() else {
            invalid!("tensor `D` must have at least 2 dimensions")
        };
        let e = eb(self.dtype);
        self.check_capacity("the GEMM output", [n, m])?;
        // The partial GEMM writes the buffer viewed as D.
        let mut dv = x.d.clone();
        dv.data = Buffer::new(self.buffer(), self.dtype, Shape::new(&[n, m])?)?;
        let full = gemm::desc_from_te(&TeGemm {
            a: x.a,
            b: x.b,
            d: &dv,
            bias: x.bias,
            pre_gelu_out: x.pre_gelu_out,
            transa: x.transa,
            transb: x.transb,
            grad: x.grad,
            workspace: x.workspace,
            accumulate: false,
            use_split_accumulator: x.use_split_accumulator,
            math_sm_count: self.math_sms(self.t.nccl_comm().is_none()),
        })?;
        if full.epilogue.uses_aux() || full.epilogue == Epilogue::BGradB {
            unsupported!(
                "epilogue {:?} cannot be applied to partial sums before the all-reduce",
                full.epilogue
            );
        }
        let s = (self.cfg.num_splits as usize).clamp(1, n.max(1));
        let bounds: Vec<usize> = (0..=s).map(|i| i * n / s).collect();
        let seq = self.begin(stream, Op::SplitAr, true)?;
        let others = self.others();
        let eb_b = eb(full.b_type);
        for i in 0..s {
            let (lo, hi) = (bounds[i], bounds[i + 1]);
            let mut g = full;
            g.n = hi - lo;
            g.b = full.b + if x.transb { lo } else { lo * full.ldb } * eb_b;
            g.d = full.d + lo * m * e;
            self.run_gemm(&g, &guard, 0, false)?;
            self.ev_chunk[1 + i].record(self.compute[0].raw())?;
        }
        let cs = self.comm[0].raw();
        let out = Buffer::new(db.ptr, db.dtype, Shape::new(&[n, m])?)?;
        for i in 0..s {
            let (lo, hi) = (bounds[i], bounds[i + 1]);
            let rows = hi - lo;
            self.ev_chunk[1 + i].wait_on(cs)?;
            if let Some(comm) = self.t.nccl_comm() {
                nccl::all_reduce(
                    comm,
                    self.buffer() + lo * m * e,
                    db.ptr + lo * m * e,
                    rows * m,
                    self.dtype,
                    cs,
                )?;
                continue;
            }
            let info = |step: usize| WaitInfo {
                op: Op::SplitAr as u32,
                step: step as u32,
                seq,
            };
            self.t.signal(&others, Slot::RsReady, val(seq, i), cs)?;
            self.t
                .wait(&others, Slot::RsReady, val(seq, i), cs, info(i))?;
            let last = i + 1 == s;
            if rows * m * e <= ONE_SHOT_MAX_BYTES || rows < tp {
                let srcs: Vec<usize> = (0..tp)
                    .map(|q| self.t.peer_buffer(q).unwrap() + lo * m * e)
                    .collect();
                self.reduce(&out, lo * m, m, &srcs, m, rows, m, 0, cs, last)?;
            } else {
                // Two-shot: my slice of the chunk, reduced in place, then every slice copied.
                let sr = rows.div_ceil(tp);
                let slice = |q: usize| (lo + (q * sr).min(rows), lo + ((q + 1) * sr).min(rows));
                let (a0, a1) = slice(r);
                let srcs: Vec<usize> = (0..tp)
                    .map(|q| self.t.peer_buffer(q).unwrap() + a0 * m * e)
                    .collect();
                let mine = Buffer::new(self.buffer(), self.dtype, Shape::new(&[n, m])?)?;
                self.reduce(&mine, a0 * m, m, &srcs, m, a1 - a0, m, 0, cs, last)?;
                self.t.signal(&others, Slot::ArReduced, val(seq, i), cs)?;
                self.t
                    .wait(&others, Slot::ArReduced, val(seq, i), cs, info(i))?;
                for q in 0..tp {
                    let (q0, q1) = slice(q);
                    let src = self.t.peer_buffer(q).unwrap() + q0 * m * e;
                    copy_async(db.ptr + q0 * m * e, src, (q1 - q0) * m * e, cs)?;
                }
            }
        }
        self.finish(seq, stream)
    }
}
