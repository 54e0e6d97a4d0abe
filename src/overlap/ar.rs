//! GEMM + all-reduce (the GEMM has k split across ranks, so every rank holds a partial
//! [n, m]; every rank gets the sum in D). Two algorithms over IPC:
//! - Ring (default where n is divisible by tp and the buffer holds twice D): the ring
//!   reduce-scatter of `rs.rs` (one GEMM per destination's rows, each partial pushed by
//!   the copy engine while the next GEMM runs) reduces this rank's rows straight into D;
//!   then the reduced rows are pushed into every peer's buffer and copied into D there.
//!   Only copy-engine pushes cross NVLink.
//! - Chunked: the GEMM is split into `num_splits` row chunks; as soon as chunk i is
//!   computed it is all-reduced into D while chunk i+1 computes:
//!   - large chunks (two-shot): the chunk's elements are cut into tp slices; slice q of
//!     every rank's partial is pushed into rank q's buffer by the copy engines, rank q
//!     sums the tp copies of its slice (a local reduction), and every rank loads the
//!     reduced slices from their owners' buffers into D;
//!   - small chunks (one-shot): every rank sums the whole chunk by loading it from all
//!     the buffers (latency-bound sizes, where one kernel beats three copy steps).
//! - NCCL transport: chunked, with ncclAllReduce per chunk from the buffer into D.
//!
//! Measured on 2x and 4x H200 (bench/RESULTS.md, 2026-11-21): ring beat GEMM-then-
//! ncclAllReduce on every anchor shape (0.77-0.96x) and was as fast as or faster than
//! chunked everywhere; chunked lost to GEMM-then-ncclAllReduce at tp 4 on four of six.
use super::plan::{Lane, Planner, Reduce};
use super::policy::{Algo, Ring};
use super::rs::RsArgs;
use super::schedule::{Bounds, PerRank};
use super::{Op, Overlap, eb, tag};
use crate::cuda::DevPtr;
use crate::cuda::StreamHandle;
use crate::error::Result;
use crate::gemm::{self, Epilogue, GemmDesc, Operands, TeGemm};
use crate::tensor::{Buffer, DType, Shape, Tensor};
use crate::transport::WaitInfo;
use crate::{invalid, unsupported};

/// Events ev_chunk[REDUCED_EVENTS + i]: chunk i's slice is reduced (chunk GEMMs use
/// ev_chunk[1..=64]).
const REDUCED_EVENTS: usize = 64;

/// Chunks at most this large (bytes) are all-reduced one-shot.
pub(crate) const ONE_SHOT_MAX_BYTES: usize = 1 << 20;

/// The operands of a GEMM + all-reduce: D is the full output [n, m] on every rank.
pub type ArArgs<'a> = TeGemm<'a>;

/// How the two-shot all-reduce cuts a chunk of `elems` elements into `tp` slices: slice
/// q is elements [start(q), start(q) + len(q)) of the chunk. Slices are multiples of 8
/// elements (16-byte accesses for 16-bit types) except possibly the last non-empty one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Slices {
    pub elems: usize,
    pub tp: usize,
    pub step: usize,
}

impl Slices {
    pub fn new(elems: usize, tp: usize) -> Slices {
        Slices {
            elems,
            tp,
            step: elems.div_ceil(tp).div_ceil(8) * 8,
        }
    }
    pub fn start(&self, q: usize) -> usize {
        (q * self.step).min(self.elems)
    }
    pub fn len(&self, q: usize) -> usize {
        self.start(q + 1) - self.start(q)
    }
    /// Where, in the receiving rank's region of this chunk, the copy of its slice sent by
    /// `sender` lands: the tp-1 senders after the receiver in ring order, one slot each.
    pub fn slot_offset(&self, receiver: usize, sender: usize) -> usize {
        let j = (sender + self.tp - receiver - 1) % self.tp;
        j * self.step
    }
    /// Whether the tp-1 received copies of every slice fit in the chunk's own region.
    pub fn fits(&self) -> bool {
        (self.tp - 1) * self.step <= self.elems
    }
}

impl Overlap {
    pub fn split_ar(&mut self, x: &ArArgs, stream: StreamHandle) -> Result<()> {
        self.reported(stream, |o| {
            check_ar(x, o.shape().2)?;
            o.run_planned(stream, |p| p.split_ar(x))
        })
    }
}

/// The all-reduce's argument checks that need no engine state but its dtype (made before
/// the call enters the engine); D's [n, m].
fn check_ar(x: &ArArgs, dtype: DType) -> Result<(usize, usize)> {
    let db = &x.d.data;
    if db.dtype != dtype || dtype.is_fp8() {
        unsupported!(
            "the all-reduce sums in the output dtype: tensor `D` ({}) must match the buffer dtype ({}), and not be FP8",
            db.dtype.name(),
            dtype.name()
        );
    }
    if x.accumulate {
        unsupported!("accumulate = true with an all-reduce would add D to every rank's partial");
    }
    if x.pre_gelu_out.is_some() || (x.grad && x.bias.is_some()) {
        unsupported!(
            "GELU and bias-gradient epilogues cannot be applied to partial sums before the all-reduce"
        );
    }
    let Some((n, m)) = db.rows_cols() else {
        invalid!("tensor `D` must have at least 2 dimensions")
    };
    Ok((n, m))
}

/// Refuse the epilogues that cannot apply to partial sums.
fn check_partial_epilogue(full: &GemmDesc) -> Result<()> {
    if full.epilogue.uses_aux() || full.epilogue == Epilogue::BGradB {
        unsupported!(
            "epilogue {:?} cannot be applied to partial sums before the all-reduce",
            full.epilogue
        );
    }
    Ok(())
}

impl Planner<'_> {
    /// split_ar's algorithm (after the call's checks): at tp 1 inline the GEMM itself;
    /// else the ring where it fits and the policy prefers it (`Policy::ar_ring`:
    /// NVTE_COMM_AR_ALGO, else the tuning's, the ring by default: measured on 2x and 4x
    /// H200, bench/RESULTS.md, it was as fast or faster than the chunked algorithm on
    /// every anchor shape), else chunked.
    pub(super) fn ar_algo(&self, x: &ArArgs) -> Result<Algo> {
        let (n, m) = check_ar(x, self.dtype())?;
        if self.e.inline {
            return Ok(Algo::GemmOnly);
        }
        if gemm::block::is_block(x) {
            // The GEMM whole, then the all-reduce: the ring and the row chunks cut the
            // GEMM along n (B's rows), whose 1D GEMM-ready scales are columns.
            return Ok(Algo::ChunkedAr { splits: 1 });
        }
        if self.e.policy.serial() {
            // No overlap: the GEMM whole, then the all-reduce.
            return Ok(Algo::ChunkedAr { splits: 1 });
        }
        let (tp, e) = (self.tp(), eb(self.dtype()));
        // The ring pushes reduced rows into the peers' buffers: it needs peer memory.
        let ring_fits =
            self.e.caps.peer_memory && n.is_multiple_of(tp) && 2 * n * m * e <= self.e.buffer_bytes;
        Ok(if ring_fits && self.e.policy.ar_ring() {
            Algo::RingAr(self.ring_params())
        } else {
            Algo::ChunkedAr {
                splits: self.e.policy.splits as usize,
            }
        })
    }

    /// [`Algo::GemmOnly`]: tp 1, the sum of the one partial is the GEMM itself, straight
    /// into D.
    pub(super) fn gemm_only_ar(&mut self, x: &ArArgs) -> Result<()> {
        check_ar(x, self.dtype())?;
        let full = gemm::desc_from_te_block(&TeGemm {
            accumulate: false,
            math_sm_count: self.math_sms(true),
            ..*x
        })?;
        check_partial_epilogue(&full)?;
        self.begin(Op::SplitAr, false, &full.sum_key(), Some(&full));
        self.step(|| "GEMM (tp 1: the all-reduce of one partial is the GEMM)".into());
        self.gemm(&full, 0, false);
        self.finish();
        Ok(())
    }

    /// [`Algo::RingAr`]: this rank's rows of D reduced by the ring, then gathered.
    pub(super) fn ring_ar_call(&mut self, x: &ArArgs, ring: Ring) -> Result<()> {
        let (n, m) = check_ar(x, self.dtype())?;
        let db = &x.d.data;
        let e = eb(self.dtype());
        let nc = n / self.tp();
        let rows = Tensor {
            data: Buffer::new(
                db.ptr + self.tp_rank() * nc * m * e,
                db.dtype,
                Shape::new(&[nc, m])?,
            )?,
            ..Default::default()
        };
        let rs = RsArgs {
            g: Operands {
                accumulate: false,
                ..x.with_d(None)
            },
            rs_output: &rows,
        };
        self.ring_ar(&rs, db.ptr, &ring)
    }

    /// [`Algo::ChunkedAr`] in `splits` row chunks (at most one a row).
    pub(super) fn chunked_ar_call(&mut self, x: &ArArgs, splits: usize) -> Result<()> {
        let (n, m) = check_ar(x, self.dtype())?;
        self.chunked_ar(x, n, m, splits)
    }

    /// The chunked all-reduce: row chunks, each all-reduced (one-shot, two-shot, or the
    /// transport's collective) while the next computes.
    fn chunked_ar(&mut self, x: &ArArgs, n: usize, m: usize, splits: usize) -> Result<()> {
        let (tp, e) = (self.tp(), eb(self.dtype()));
        self.check_capacity("the GEMM output", [n, m])?;
        // Block-scaled inputs: one chunk (`ar_algo`), whatever the caller planned.
        let splits = if gemm::block::is_block(x) { 1 } else { splits };
        let s = splits.clamp(1, n.max(1));
        let bounds: Bounds = (0..=s).map(|i| i * n / s).collect();
        // Without peer memory, the transport's all-reduce collective per chunk.
        let collective = !self.e.caps.peer_memory;
        // Two-shot over the copy engines when every chunk is large enough; the partials
        // are then computed into local staging (peers never read them), else into the
        // registered buffer that peers load from (one-shot) or the collective reads.
        let two_shot = !collective
            && tp > 1
            && bounds.windows(2).all(|w| {
                let rows = w[1] - w[0];
                rows * m * e > self.e.one_shot_max_bytes && Slices::new(rows * m, tp).fits()
            });
        let partials = if two_shot {
            self.staging()?
        } else {
            self.buffer()
        };
        let mut dv = x.d.clone();
        dv.data = Buffer::new(partials, self.dtype(), Shape::new(&[n, m])?)?;
        // SMs the communication uses beside the GEMMs (peer memory: the reductions, and
        // SM puts; the collective's kernels where the policy leaves them SMs; with one
        // chunk nothing runs beside the GEMM).
        let comm_sms = s > 1 && (!collective || self.comm_on_sms());
        let full = gemm::desc_from_te_block(&TeGemm {
            d: &dv,
            accumulate: false,
            math_sm_count: self.math_sms(comm_sms),
            ..*x
        })?;
        check_partial_epilogue(&full)?;
        // (the chunk count is in the key: ranks must cut the same chunks)
        let key = super::key_with(full.sum_key(), s as u64);
        self.begin(Op::SplitAr, !two_shot, &key, Some(&full));
        let gemm = |pl: &mut Self, i: usize| {
            let (lo, hi) = (bounds[i], bounds[i + 1]);
            let mut g = full;
            g.n = hi - lo;
            g.b = full.b_from_row(lo);
            g.d = full.d + lo * m * e;
            pl.step(|| format!("GEMM chunk {i} of {s} (rows {lo}..{hi})"));
            pl.gemm(&g, 0, false);
            pl.mark(Lane::Compute(0), || format!("gemm{i}"));
            Ok(())
        };
        let d = x.d.data.ptr;
        // The GEMM's event with its chunk's start (see chunks_interleaved); two-shot: the
        // scatter's puts, then after the next chunk's GEMM the rest; one-shot: the signal
        // (the collective), then the wait and the reduction.
        let start = |pl: &mut Self, i: usize| {
            pl.record(1 + i, Lane::Compute(0));
            if two_shot {
                let sl = Slices::new((bounds[i + 1] - bounds[i]) * m, tp);
                pl.two_shot_scatter(i, bounds[i] * m, &sl, partials)
            } else {
                pl.ar_one_shot_start(d, collective, m, (&bounds, i))
            }
        };
        let finish = |pl: &mut Self, i: usize| match (two_shot, collective) {
            (true, _) => pl.ar_two_shot(d, partials, m, (&bounds, i)),
            (false, false) => pl.ar_one_shot(d, m, (&bounds, i)),
            (false, true) => Ok(()),
        };
        self.chunks_interleaved(s, gemm, start, finish)?;
        self.finish();
        Ok(())
    }

    /// The start of chunk i of the one-shot all-reduce (comm stream 0, after its GEMM):
    /// the transport's collective, or (peer memory) the signal that this rank's partial is
    /// in place.
    fn ar_one_shot_start(
        &mut self,
        d: DevPtr,
        collective: bool,
        m: usize,
        (bounds, i): (&[usize], usize),
    ) -> Result<()> {
        let e = eb(self.dtype());
        let cs = Lane::Comm(0);
        let (lo, hi) = (bounds[i], bounds[i + 1]);
        self.wait_event(1 + i, cs);
        if collective {
            let src = self.buffer() + lo * m * e;
            return self.all_reduce((src, d + lo * m * e, (hi - lo) * m), self.dtype(), cs);
        }
        let others = self.others();
        self.signal(&others, self.e.slots.rs_ready, tag(i), cs)
    }

    /// The rest of chunk i of the one-shot all-reduce over peer memory (after
    /// [`Self::ar_one_shot_start`]): every rank's partial loaded and summed once all are
    /// in place.
    fn ar_one_shot(&mut self, d: DevPtr, m: usize, (bounds, i): (&[usize], usize)) -> Result<()> {
        let (tp, e) = (self.tp(), eb(self.dtype()));
        let s = bounds.len() - 1;
        let cs = Lane::Comm(0);
        let others = self.others();
        let slot = self.e.slots.rs_ready;
        let (lo, hi) = (bounds[i], bounds[i + 1]);
        let info = WaitInfo {
            op: Op::SplitAr as u32,
            step: i as u32,
        };
        self.wait(&others, (slot, tag(i)), cs, info)?;
        let srcs: PerRank<DevPtr> = (0..tp)
            .map(|q| self.peer(q).map(|b| b + lo * m * e))
            .collect::<Result<_>>()?;
        self.reduce(
            Reduce {
                out: d + lo * m * e,
                out_type: self.dtype(),
                out_ld: m,
                srcs,
                in_ld: m,
                rows: hi - lo,
                cols: m,
                in_scale: DevPtr::NULL,
                fp8_out: (DevPtr::NULL, DevPtr::NULL),
                tail: i + 1 == s,
            },
            cs,
        );
        Ok(())
    }

    /// The two-shot all-reduce of chunk i of `partials` (local staging) into `d`, after
    /// its scatter's puts ([`Self::two_shot_scatter`]): their signal, the reduction and the
    /// gather. Chunk i's region of the registered buffer receives the tp-1 copies of this rank's
    /// slice (slots); the reduction writes the reduced slice over its own place in the
    /// region, and every rank loads the reduced slices from their owners' regions into D.
    /// Scatter: copy-engine pushes (outbound NVLink, no SMs). Gather: SM loads (inbound;
    /// copy-engine pulls from all peers at once run ~3x slower than pushes:
    /// bench/ce_probe.cu, 4x H200: 115 vs 330 GB/s per GPU), which write D directly, so no
    /// second round of flags and no local copy. Three streams (scatter, reduce, gather),
    /// so that the steps of consecutive chunks overlap.
    fn ar_two_shot(
        &mut self,
        d: DevPtr,
        partials: DevPtr,
        m: usize,
        (bounds, i): (&[usize], usize),
    ) -> Result<()> {
        let s = bounds.len() - 1;
        let base = bounds[i] * m; // chunk start, elements
        let sl = Slices::new((bounds[i + 1] - bounds[i]) * m, self.tp());
        self.step(|| format!("all-reduce chunk {i} of {s}: scatter, reduce, gather"));
        let (scatter, others) = (Lane::Comm(0), self.others());
        self.signal(&others, self.e.slots.rs_p2p, tag(i), scatter)?;
        self.mark(scatter, || format!("scattered{i}"));
        self.two_shot_reduce(i, base, &sl, partials, i + 1 == s)?;
        self.two_shot_gather(i, base, &sl, d, i + 1 == s)
    }

    /// Scatter: slice q of this rank's partial to rank q's slots (comm stream 0); the
    /// signal that they landed follows in [`Self::ar_two_shot`] (after the next chunk's
    /// GEMM: see `chunks_interleaved`).
    fn two_shot_scatter(
        &mut self,
        i: usize,
        base: usize,
        sl: &Slices,
        partials: DevPtr,
    ) -> Result<()> {
        let (tp, r, e) = (self.tp(), self.tp_rank(), eb(self.dtype()));
        let scatter = Lane::Comm(0);
        self.wait_event(1 + i, scatter);
        for k in 1..tp {
            let q = (r + k) % tp;
            let src = partials + (base + sl.start(q)) * e;
            self.put(
                q,
                (base + sl.slot_offset(q, r)) * e,
                src,
                sl.len(q) * e,
                scatter,
            )?;
        }
        Ok(())
    }

    /// Reduce (comm stream 1): own partial + the tp-1 received copies, written to this
    /// slice's place in the region, which is slot r's range or past the slots: each
    /// element is read before it is written, by the same thread.
    fn two_shot_reduce(
        &mut self,
        i: usize,
        base: usize,
        sl: &Slices,
        partials: DevPtr,
        tail: bool,
    ) -> Result<()> {
        let (tp, r, e) = (self.tp(), self.tp_rank(), eb(self.dtype()));
        let reduce = Lane::Comm(1);
        let others = self.others();
        let region = self.buffer() + base * e;
        let (at, len) = (sl.start(r), sl.len(r));
        self.wait_event(1 + i, reduce);
        let info = WaitInfo {
            op: Op::SplitAr as u32,
            step: i as u32,
        };
        self.wait(&others, (self.e.slots.rs_p2p, tag(i)), reduce, info)?;
        self.mark(reduce, || format!("received{i}"));
        let mut srcs: PerRank<DevPtr> = (0..tp - 1).map(|j| region + j * sl.step * e).collect();
        srcs.push(partials + (base + at) * e);
        srcs.rotate_right(1); // own partial first
        self.reduce(
            Reduce {
                out: region + at * e,
                out_type: self.dtype(),
                out_ld: len,
                srcs,
                in_ld: len,
                rows: 1,
                cols: len,
                in_scale: DevPtr::NULL,
                fp8_out: (DevPtr::NULL, DevPtr::NULL),
                tail,
            },
            reduce,
        );
        self.signal(&others, self.e.slots.ar_reduced, tag(i), reduce)?;
        self.record(REDUCED_EVENTS + i, reduce);
        self.mark(reduce, || format!("reduced{i}"));
        Ok(())
    }

    /// Gather (comm stream 2): every reduced slice (this rank's too) from its owner into
    /// D.
    fn two_shot_gather(
        &mut self,
        i: usize,
        base: usize,
        sl: &Slices,
        d: DevPtr,
        tail: bool,
    ) -> Result<()> {
        let (tp, r, e) = (self.tp(), self.tp_rank(), eb(self.dtype()));
        let gather = Lane::Comm(2);
        let others = self.others();
        self.wait_event(REDUCED_EVENTS + i, gather);
        let info = WaitInfo {
            op: Op::SplitAr as u32,
            step: i as u32,
        };
        self.wait(&others, (self.e.slots.ar_reduced, tag(i)), gather, info)?;
        self.mark(gather, || format!("peers_reduced{i}"));
        let segs: PerRank<(DevPtr, DevPtr, usize)> = (0..tp)
            .map(|k| {
                let q = (r + k) % tp;
                let off = (base + sl.start(q)) * e;
                self.peer(q).map(|b| (d + off, b + off, sl.len(q) * e))
            })
            .collect::<Result<_>>()?;
        self.copy_segments(&segs, gather, tail);
        self.mark(gather, || format!("gathered{i}"));
        Ok(())
    }

    /// GEMM + all-reduce as a ring reduce-scatter (each rank's rows of D reduced into D)
    /// followed by an all-gather of the reduced rows: each rank pushes its rows into the
    /// second half of every peer's buffer (copy engine), and every rank copies the rows
    /// that landed into D. Needs n divisible by tp and a buffer of twice D.
    fn ring_ar(&mut self, x: &RsArgs, d: DevPtr, ring: &Ring) -> Result<()> {
        let p = self.plan_rs(x, self.comm_on_sms())?;
        let (tp, r, e) = (self.tp(), self.tp_rank(), eb(self.dtype()));
        let n = p.nc * tp;
        self.check_capacity("the all-reduce's partials and gathered rows", [2 * n, p.m])?;
        self.staging()?; // allocated (once) before the call starts
        let acc = self.rs_accumulates(x, &p, ring.sum);
        self.begin(
            Op::SplitAr,
            false,
            &self.ring_key(&p, acc, ring),
            Some(&p.full),
        );
        let half = n * p.m * e;
        if acc {
            self.chain_rs(x, &p, Op::SplitAr, Some((half, d)), ring.pieces)?;
            self.finish();
            return Ok(());
        }
        self.ring_rs(x, &p, ring)?;
        let cs = Lane::Comm(0);
        let rows = p.nc * p.m * e; // bytes of one rank's rows
        let others = self.others();
        for k in 1..tp {
            let q = (r + k) % tp;
            self.put(q, half + r * rows, d + r * rows, rows, cs)?;
        }
        let slot = self.e.slots.ar_reduced;
        self.signal(&others, slot, tag(0), cs)?;
        let info = WaitInfo {
            op: Op::SplitAr as u32,
            step: 0,
        };
        self.wait(&others, (slot, tag(0)), cs, info)?;
        // The peers' rows: before and after this rank's.
        let landed = self.buffer() + half;
        self.copy(d, landed, r * rows, cs);
        let after = (tp - r - 1) * rows;
        self.copy(d + (r + 1) * rows, landed + (r + 1) * rows, after, cs);
        self.finish();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::Slices;

    #[test]
    fn slices_cover_the_chunk_and_received_copies_fit() {
        for tp in [2usize, 3, 4, 8] {
            for elems in [8 * tp * 3, 1000, 4096 * 5 + 3, 1 << 20, 123_457] {
                let sl = Slices::new(elems, tp);
                let total: usize = (0..tp).map(|q| sl.len(q)).sum();
                assert_eq!(total, elems);
                for q in 0..tp {
                    assert_eq!(sl.start(q) % 8, 0);
                    assert!(sl.len(q) <= sl.step);
                }
                if sl.fits() {
                    // The tp-1 slots of every receiver are disjoint and inside the chunk.
                    for recv in 0..tp {
                        let mut offs: Vec<usize> = (0..tp)
                            .filter(|&s| s != recv)
                            .map(|s| sl.slot_offset(recv, s))
                            .collect();
                        offs.sort();
                        offs.dedup();
                        assert_eq!(offs.len(), tp - 1);
                        assert!(offs.iter().all(|&o| o + sl.len(recv) <= elems));
                    }
                }
            }
        }
    }
}
