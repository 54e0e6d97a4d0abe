//! GEMM + reduce-scatter: pipelined (TE: `SPLIT_PIPELINED_RS`) and ring (`SPLIT_PIPELINED_RS_P2P`).
//!
//! The GEMM D = B x op(A) has a partial sum on every rank ([n, m], k split across ranks);
//! rank r receives rows [r n/tp, (r+1) n/tp) of the sum in `rs_output` [n/tp, m].
//! - Pipelined: the GEMM is split into `num_splits` column chunks written into the
//!   registered buffer; as soon as every rank has finished chunk i, a reduction kernel
//!   reads the peers' buffers directly and sums this rank's rows of chunk i while the
//!   next chunk computes.
//! - Ring: step i computes the rows destined for rank (r+i+1) % tp and puts them into
//!   that rank's buffer (copy engine or SM put) while the next step computes; a final
//!   kernel sums the tp partials that landed here.
//! - Accumulating ring (NVTE_COMM_RS_RING=accumulate, or the autotuner's choice): the
//!   partial sums travel along the ring and every GEMM adds its partial to the running
//!   sum that arrived (beta = 1, C = the landed sum); the last step's GEMM writes this
//!   rank's reduced rows, so no closing reduction is left after the last GEMM. Each
//!   chunk is computed and sent in pieces (at least 2), so a step's GEMM starts as soon
//!   as the first piece of the running sum it adds to has landed. For 16/32-bit buffers
//!   with an output of the buffer's type and no per-row epilogue output or accumulation
//!   (else the ring above); any transport (the sums move by the transport's exchange).
//!   Numerics: the running sum is rounded to the buffer type after every step (tp
//!   roundings in all, as the closing reduction rounds each of the tp partials), so the
//!   two rings agree to rounding, not bit for bit; with fp16 an intermediate sum can
//!   overflow where the final one would not (as a single partial can in the other ring).
//! - NCCL transport, tp > 2: the GEMM in column chunks into local staging and
//!   ncclReduceScatter per chunk while the next computes (FP8 buffers, epilogue outputs
//!   and accumulation run the ring over send / recv; the accumulating ring, where chosen,
//!   runs over send / recv too). Over NCCL both entry points run this one.
//!
//! - Fused ring (the policy's fused algorithms: config atomic_gemm, the comm-GEMM API's atomic
//!   algorithms): the ring above (and the ring all-reduce's reduce-scatter) with one
//!   launch of our own GEMM instead of a GEMM per destination: it computes the whole
//!   partial into staging, its tile rows starting at destination r+1's rows (the ring's
//!   order), and signals each piece of a destination's rows as done (a u32 per piece;
//!   the policy's `pieces` per destination); comm stream 0 waits for each signal
//!   (cuStreamWaitValue32: no timeout, but the GEMM waits on nothing itself, so its
//!   signals always come) before that piece's exchange, which stays the transport's
//!   bounded one. Where our GEMM cannot compute the call, the GEMMs per destination as
//!   above; the exchanges (pieces included) are the same either way.
//!
//! FP8 buffers: the GEMMs write FP8 partials with D's scale; the reduction dequantizes
//! with D's scale_inv, sums in fp32 and writes bf16 / fp16 / fp32.
//!
//! The chunk GEMMs of a reduce-scatter run in order on one compute stream: their inputs
//! are all local, so running them concurrently (TE's round-robin over the stream pool)
//! only makes every chunk finish late and delays the first chunk's communication.
//! Measured on 4x H200, tp 4, bf16 (bench/RESULTS.md): ring RS (CE) geomean 1.10x
//! bound in order vs 1.40x round-robin over 3 streams.
use super::plan::{Lane, MAX_FLAGS, Part, Planner, Reduce};
use super::policy::{Algo, Ring, Sum, Tiles};
use super::schedule::{Bounds, PerRank};
use super::{Op, Overlap, eb, key_with, tag};
use crate::cuda::DevPtr;
use crate::cuda::StreamHandle;
use crate::error::Result;
use crate::gemm::sm90::{self, Hooks, TILE_ROWS};
use crate::gemm::{self, GemmDesc, Operands};
use crate::invalid;
use crate::tensor::{Buffer, DType, Shape, Tensor};
use crate::transport::{RecvOp, SendOp, WaitInfo};

/// The compute stream of every chunk GEMM of a reduce-scatter (one stream, in order: see
/// the module doc); their events are recorded there too, apart from the GEMMs
/// (`Planner::chunks_interleaved`).
const IN_ORDER: usize = 0;

/// The operands of a GEMM + reduce-scatter: D is the buffer view carrying FP8 scale /
/// scale_inv, or None for the plain view; the reduced rows go to `rs_output`.
pub struct RsArgs<'a> {
    pub g: Operands<'a, Option<&'a Tensor>>,
    pub rs_output: &'a Tensor,
}

/// The validated GEMM on the full buffer and the reduction's geometry.
pub(super) struct RsPlan {
    pub full: GemmDesc,
    pub m: usize,
    pub nc: usize,
    pub scale_inv: DevPtr,
}

impl Overlap {
    pub fn split_rs(&mut self, x: &RsArgs, stream: StreamHandle) -> Result<()> {
        self.reported(stream, |o| o.run_planned(stream, |p| p.split_rs(x)))
    }

    pub fn split_rs_p2p(&mut self, x: &RsArgs, stream: StreamHandle) -> Result<()> {
        self.reported(stream, |o| o.run_planned(stream, |p| p.split_rs_p2p(x)))
    }
}

impl Planner<'_> {
    /// The buffer view D of the call as [n, m], with the FP8 scaling of the caller's view.
    fn rs_buffer_view(&self, x: &RsArgs, n: usize, m: usize) -> Result<Tensor> {
        let mut d = x.g.d.cloned().unwrap_or_default();
        if let Some(v) = x.g.d {
            if v.data.ptr != self.buffer() {
                invalid!(
                    "tensor `D` must be a view of the overlap buffer (nvte_comm_overlap_get_buffer), or NULL"
                );
            }
            if v.data.dtype != self.dtype() {
                invalid!(
                    "tensor `D` dtype {} differs from the buffer dtype {}",
                    v.data.dtype.name(),
                    self.dtype().name()
                );
            }
        }
        d.data = Buffer::new(self.buffer(), self.dtype(), Shape::new(&[n, m])?)?;
        Ok(d)
    }

    /// [`Self::plan_rs_blocks`] of the algorithms that cut the GEMM along n (the rings):
    /// block-scaled inputs refused, their 1D scales would not follow the cut.
    pub(super) fn plan_rs(&self, x: &RsArgs, comm_sms: bool) -> Result<RsPlan> {
        let p = self.plan_rs_blocks(x, comm_sms)?;
        if p.full.blocks.is_some() {
            crate::unsupported!(
                "the ring reduce-scatter cuts the GEMM along n, which block-scaled FP8 inputs' scales do not follow: the pipelined or collective reduce-scatter (and the chunked all-reduce) take them"
            );
        }
        Ok(p)
    }

    /// The validated GEMM (block-scaled inputs included: its chunks must come from
    /// [`Self::rs_bounds`]) and the reduction's geometry.
    pub(super) fn plan_rs_blocks(&self, x: &RsArgs, comm_sms: bool) -> Result<RsPlan> {
        let tp = self.tp();
        // m and n from A and B as nvte_cublas_gemm defines them.
        let Some((ar, ac)) = x.g.a.data.rows_cols() else {
            invalid!("tensor `A` must have at least 2 dimensions")
        };
        let Some((br, bc)) = x.g.b.data.rows_cols() else {
            invalid!("tensor `B` must have at least 2 dimensions")
        };
        let m = if x.g.transa { ar } else { ac };
        let n = if x.g.transb { bc } else { br };
        if n % tp != 0 {
            invalid!("the scattered rows n = {n} are not divisible by tp = {tp}");
        }
        self.check_capacity("the GEMM output", [n, m])?;
        let d = self.rs_buffer_view(x, n, m)?;
        let mut full = gemm::desc_from_te_block(&Operands {
            math_sm_count: self.math_sms(comm_sms),
            ..x.g.with_d(&d)
        })?;
        let scale_inv = if self.dtype().is_fp8() {
            Tensor::scalar_ptr(&d.scale_inv).ok_or_else(|| {
                crate::error::Error::invalid(
                    "tensor `D` (the FP8 buffer view) needs scale_inv = 1/scale for the reduction",
                )
            })?
        } else {
            DevPtr::NULL
        };
        full.d_amax = DevPtr::NULL; // per-chunk amax would be wrong; not produced for FP8 partials
        let o = &x.rs_output.data;
        self.check_reduce_output(o, "rs_output")?;
        Self::check_fp8_output(x.rs_output, "rs_output")?;
        if o.numel() != (n / tp) * m {
            invalid!(
                "tensor `rs_output` has shape {} but must be [n/tp, m] = [{}, {m}]",
                o.shape,
                n / tp
            );
        }
        Ok(RsPlan {
            full,
            m,
            nc: n / tp,
            scale_inv,
        })
    }

    /// The GEMM of output columns [lo, hi) (A's rows or columns, aux and bias offset to
    /// match), writing its place in the full D. A block-scaled A (always TN) moves its
    /// 2D scales by whole 128-row tiles ([`Self::rs_bounds`] cuts there; a 1D-scaled A
    /// is never cut).
    fn column_chunk(p: &RsPlan, lo: usize, hi: usize) -> GemmDesc {
        let f = &p.full;
        let mut g = *f;
        g.m = hi - lo;
        g.a = f.a + if f.transa { lo * f.lda } else { lo } * eb(f.a_type);
        if f.blocks.is_some() {
            g.a_scale_inv = f.a_scale_inv + block_a_scale_offset(f, lo);
        }
        g.d = f.d + lo * eb(f.d_type);
        if !f.aux.is_null() {
            g.aux = f.aux + lo * eb(f.aux_type);
        }
        if !f.bias.is_null() && f.epilogue != gemm::Epilogue::BGradB {
            g.bias = f.bias + lo * eb(f.bias_type);
        }
        g
    }

    /// Column boundaries of `splits` pipelined chunks (multiples of 16 where possible).
    fn splits(m: usize, splits: usize) -> Bounds {
        super::schedule::column_splits(m, splits)
    }

    /// The column chunks of the reduce-scatter's GEMM `p`: [`Self::splits`]; with
    /// block-scaled inputs, whole 128-row tiles of a 2D-scaled A (its scales stay one
    /// contiguous run per chunk), and one chunk (the GEMM, then the collective) for a
    /// 1D-scaled A, whose GEMM-ready scales [k/128, m] a column chunk would cut across.
    fn rs_bounds(p: &RsPlan, splits: usize) -> Bounds {
        match p.full.blocks {
            None => Self::splits(p.m, splits),
            Some(b) => block_column_bounds(p.m, splits, b[0]),
        }
    }

    /// split_rs's algorithm: the pipelined one with peer memory; else (it loads from the
    /// peers' buffers) the ring entry point's, as at tp 1 inline for plain sums (the
    /// ring's form, one GEMM straight into `rs_output`: the pipelined chunks would only
    /// copy the buffer into it).
    pub(super) fn rs_algo(&self, x: &RsArgs) -> Result<Algo> {
        if gemm::block::is_block(&x.g.with_d(x.rs_output)) {
            return self.block_rs_algo();
        }
        if let Some(a) = self.rs_serial(x)? {
            return Ok(a);
        }
        if !self.e.caps.peer_memory || (self.e.inline && Self::plain_sums_of(x, self.dtype())) {
            return self.rs_p2p_algo(x);
        }
        Ok(Algo::PipelinedRs {
            splits: self.e.policy.splits as usize,
        })
    }

    /// split_rs_p2p's algorithm: without peer memory at tp > 2 with collectives, plain
    /// sums that do not accumulate run the collective per column chunk (at tp 2 the ring
    /// is one send/recv step and was faster: bench/RESULTS.md, 2026-11-21: ring
    /// 0.92-1.03x of NCCL-then-GEMM vs 1.01-1.08x; at tp 4 the collective 0.95-1.13x vs
    /// 1.10-1.60x); else the ring with the policy's parameters.
    pub(super) fn rs_p2p_algo(&self, x: &RsArgs) -> Result<Algo> {
        if gemm::block::is_block(&x.g.with_d(x.rs_output)) {
            return self.block_rs_algo();
        }
        if let Some(a) = self.rs_serial(x)? {
            return Ok(a);
        }
        let ring = self.ring_params();
        if !self.e.caps.peer_memory && self.e.caps.collectives && self.tp() > 2 {
            let p = self.plan_rs(x, false)?;
            if Self::plain_sums(x, &p, self.dtype()) && !self.rs_accumulates(x, &p, ring.sum) {
                return Ok(Algo::CollectiveRs {
                    splits: self.e.policy.splits as usize,
                });
            }
        }
        Ok(Algo::RingRs(ring))
    }

    /// No overlap where the policy says so (`Policy::serial`) at tp > 1: the GEMM whole,
    /// then the reduce-scatter, as one chunk of the pipelined algorithm (peer memory) or
    /// of the transport's collective (plain sums: no FP8 partials, no epilogue output, no
    /// accumulation into D); None elsewhere (the two-sided ring keeps its own steps).
    fn rs_serial(&self, x: &RsArgs) -> Result<Option<Algo>> {
        if !self.e.policy.serial() || self.tp() == 1 || self.e.inline {
            return Ok(None);
        }
        if self.e.caps.peer_memory {
            return Ok(Some(Algo::PipelinedRs { splits: 1 }));
        }
        // (the rings' way of summing is no matter here: nothing runs as a ring)
        if self.e.caps.collectives && Self::plain_sums(x, &self.plan_rs(x, false)?, self.dtype()) {
            return Ok(Some(Algo::CollectiveRs { splits: 1 }));
        }
        Ok(None)
    }

    /// Block-scaled inputs: the column-chunked algorithms, whose chunks keep the block
    /// scales valid ([`Self::rs_bounds`]): pipelined over peer memory, else the
    /// collective per chunk; the rings cut the GEMM along n (B's rows, whose 1D
    /// GEMM-ready scales are columns) and are not taken.
    fn block_rs_algo(&self) -> Result<Algo> {
        let splits = match self.e.policy.serial() {
            true => 1,
            false => self.e.policy.splits as usize,
        };
        if self.e.caps.peer_memory {
            return Ok(Algo::PipelinedRs { splits });
        }
        if self.e.caps.collectives {
            return Ok(Algo::CollectiveRs { splits });
        }
        crate::unsupported!(
            "a GEMM + reduce-scatter with block-scaled FP8 inputs needs peer memory or collectives from the transport"
        )
    }

    /// The ring's parameters in this call's group: how it sums, its pieces, the fused GEMM.
    pub(super) fn ring_params(&self) -> Ring {
        let p = &self.e.policy;
        Ring {
            sum: p.sum(self.tp(), self.e.inline),
            pieces: p.pieces.max(1) as usize,
            fused: p.fused_on().then(|| p.tiles()),
        }
    }

    /// [`Algo::PipelinedRs`]: the pipelined GEMM + reduce-scatter (module doc) in `splits`
    /// column chunks.
    pub(super) fn pipelined_rs(&mut self, x: &RsArgs, splits: usize) -> Result<()> {
        let mut p = self.plan_rs_blocks(x, true)?;
        let bounds = Self::rs_bounds(&p, splits);
        let nchunks = bounds.len() - 1;
        if nchunks == 1 {
            // the reduction runs after the GEMM, which takes every SM
            p.full.sm_count = self.math_sms(false);
        }
        // The chunk GEMMs write this buffer, which peers read: gate them on the barrier.
        // (The chunk count is in the key: ranks that split differently read each other's
        // unwritten columns, which NVTE_COMM_CHECK then reports.)
        let key = key_with(p.full.sum_key(), nchunks as u64);
        self.begin(Op::SplitRs, true, &key, Some(&p.full));
        let fp8 = self.fp8_output(x.rs_output, "rs_output", Lane::Comm(0))?;
        let gemm = |pl: &mut Self, i: usize| {
            let g = Self::column_chunk(&p, bounds[i], bounds[i + 1]);
            pl.step(|| {
                format!(
                    "GEMM columns {}..{} ({} of {nchunks})",
                    bounds[i],
                    bounds[i + 1],
                    i + 1
                )
            });
            pl.gemm(&g, IN_ORDER, false);
            Ok(())
        };
        // (each GEMM's event recorded with its chunk's signal: see chunks_interleaved)
        let signal = |pl: &mut Self, i: usize| {
            pl.record(1 + i, Lane::Compute(IN_ORDER));
            pl.split_rs_signal(i, nchunks)
        };
        let reduce = |pl: &mut Self, i: usize| pl.split_rs_reduction(x, &p, (&bounds, i), fp8);
        self.chunks_interleaved(nchunks, gemm, signal, reduce)?;
        self.finish();
        Ok(())
    }

    /// The pipelined reduce-scatter's signal that this rank computed chunk i (comm
    /// stream 0, after the chunk's GEMM).
    fn split_rs_signal(&mut self, i: usize, nchunks: usize) -> Result<()> {
        let cs = Lane::Comm(0);
        let others = self.others();
        self.step(|| format!("reduce-scatter chunk {} of {nchunks}: computed", i + 1));
        self.wait_event(1 + i, cs);
        self.signal(&others, self.e.slots.rs_ready, tag(i), cs)
    }

    /// The pipelined reduce-scatter's reduction of chunk i on comm stream 0, once every
    /// rank computed it (after [`Self::split_rs_signal`]). `fp8`: rs_output's scale and
    /// amax.
    fn split_rs_reduction(
        &mut self,
        x: &RsArgs,
        p: &RsPlan,
        (bounds, i): (&[usize], usize),
        fp8: (DevPtr, DevPtr),
    ) -> Result<()> {
        let (tp, r) = (self.tp(), self.tp_rank());
        let e = eb(self.dtype());
        let others = self.others();
        let nchunks = bounds.len() - 1;
        let cs = Lane::Comm(0);
        let slot = self.e.slots.rs_ready;
        let (lo, hi) = (bounds[i], bounds[i + 1]);
        self.step(|| format!("reduce-scatter columns {lo}..{hi} ({} of {nchunks})", i + 1));
        let info = WaitInfo {
            op: Op::SplitRs as u32,
            step: i as u32,
        };
        self.wait(&others, (slot, tag(i)), cs, info)?;
        let srcs: PerRank<DevPtr> = (0..tp)
            .map(|q| self.peer(q).map(|b| b + (r * p.nc * p.m + lo) * e))
            .collect::<Result<_>>()?;
        let out = &x.rs_output.data;
        self.reduce(
            Reduce {
                out: out.ptr + lo * eb(out.dtype),
                out_type: out.dtype,
                out_ld: p.m,
                srcs,
                in_ld: p.m,
                rows: p.nc,
                cols: hi - lo,
                in_scale: p.scale_inv,
                fp8_out: fp8,
                tail: i + 1 == nchunks,
            },
            cs,
        );
        Ok(())
    }

    /// [`Algo::CollectiveRs`]: the collective per column chunk, `splits` of them (plain
    /// sums only: refused otherwise, before anything is planned); the chunk GEMMs leave
    /// the transport's kernels the policy's SMs where it asks ([`Planner::comm_on_sms`];
    /// one chunk: nothing runs beside the GEMM).
    pub(super) fn collective_rs(&mut self, x: &RsArgs, splits: usize) -> Result<()> {
        let mut p = self.plan_rs_blocks(x, false)?;
        if !Self::plain_sums(x, &p, self.dtype()) {
            // (block-scaled inputs come here without the other algorithms' check)
            crate::unsupported!(
                "without peer memory the GEMM + reduce-scatter runs the transport's reduce-scatter collective, which sums in the buffer's type into an output of that type only: rs_output of {} with a {} buffer, accumulate, a pre-GELU output or a bias gradient are not supported there",
                x.rs_output.data.dtype.name(),
                self.dtype().name()
            );
        }
        if Self::rs_bounds(&p, splits).len() > 2 {
            // chunks: the collectives run beside the GEMMs
            p.full.sm_count = self.math_sms(self.comm_on_sms());
        }
        self.rs_collective_chunks(&p, x, splits)
    }

    /// [`Algo::RingRs`]: the ring GEMM + reduce-scatter (module doc), accumulating where
    /// `ring.sum` says so and the sums are plain.
    pub(super) fn ring_rs_call(&mut self, x: &RsArgs, ring: Ring) -> Result<()> {
        let p = self.plan_rs(x, self.comm_on_sms())?;
        let acc = self.rs_accumulates(x, &p, ring.sum);
        if !(acc && self.tp() == 1) {
            self.staging()?; // allocated (once) before the call starts (tp 1 chain: unused)
        }
        // GEMMs write local staging only (and read sums that landed after the call's
        // barrier): they need not wait for peers.
        self.begin(
            Op::SplitRsP2p,
            false,
            &self.ring_key(&p, acc, &ring),
            Some(&p.full),
        );
        if acc {
            self.chain_rs(x, &p, Op::SplitRsP2p, None, ring.pieces)?;
        } else {
            self.ring_rs(x, &p, &ring)?;
        }
        self.finish();
        Ok(())
    }

    /// The call's check key (NVTE_COMM_CHECK): the GEMM's, and how the ring sums (the
    /// closing reduction with its exchanges per destination, or the accumulating ring
    /// and its pieces), so that ranks whose environments chose differently fail the
    /// cross-rank check instead of exchanging into slots the other never reads.
    pub(super) fn ring_key(&self, p: &RsPlan, acc: bool, ring: &Ring) -> [u64; 6] {
        let word = if acc {
            1 | (self.chain_pieces(p.nc, ring.pieces) as u64) << 1
        } else {
            (self.fused_rs_pieces(p, ring) as u64) << 1
        };
        key_with(p.full.sum_key(), word)
    }

    /// The row bounds of the accumulating ring's pieces of a chunk of `nc` rows: at
    /// least 2 pieces (with whole chunks every step would wait for the whole transfer of
    /// the one before; at tp 1 there is no transfer: one GEMM), bounded by the events (a
    /// "computed" and a "landed" per piece and step), interior bounds on multiples of 16
    /// rows (aligned operand offsets).
    fn chain_bounds(&self, nc: usize, pieces: usize) -> Bounds {
        let tp = self.tp();
        let max_pieces = (self.e.events / (2 * tp)).max(1);
        let want = if tp == 1 { 1 } else { pieces.max(2) };
        super::schedule::column_splits(nc, want.min(max_pieces))
    }

    fn chain_pieces(&self, nc: usize, pieces: usize) -> usize {
        self.chain_bounds(nc, pieces).len().saturating_sub(1)
    }

    /// Whether this ring reduce-scatter runs the accumulating ring: asked for (`sum`:
    /// NVTE_COMM_RS_RING, where auto the autotuner's choice, and always at tp 1, where it
    /// is one GEMM straight into the output instead of a GEMM and a copy:
    /// `Policy::sum`) and possible (plain sums of the buffer's type). The choice is the
    /// same on every rank (same environment and tuning, same operands per the call check).
    pub(super) fn rs_accumulates(&self, x: &RsArgs, p: &RsPlan, sum: Sum) -> bool {
        sum == Sum::Accumulating && Self::plain_sums(x, p, self.dtype())
    }

    /// Whether the reduce-scatter is plain sums of a 16/32-bit buffer into an output of
    /// the same type, with no per-row epilogue output or accumulation in the partials
    /// (FP8 partials need the scaled fp32 reduction): what a reduce-scatter collective and
    /// the accumulating ring can produce.
    fn plain_sums(x: &RsArgs, p: &RsPlan, dtype: DType) -> bool {
        !dtype.is_fp8()
            && x.rs_output.data.dtype == dtype
            && !x.g.accumulate
            && p.full.aux.is_null()
            && p.full.epilogue != gemm::Epilogue::BGradB
    }

    /// [`Self::plain_sums`] from the operands alone (before the GEMM is planned): no
    /// pre-GELU output, no bias gradient (bias with grad), no accumulation.
    fn plain_sums_of(x: &RsArgs, dtype: DType) -> bool {
        let used = |t: Option<&Tensor>| t.is_some_and(|t| !t.data.ptr.is_null());
        let bias_grad = x.g.grad && used(x.g.bias);
        !dtype.is_fp8()
            && x.rs_output.data.dtype == dtype
            && !x.g.accumulate
            && !used(x.g.pre_gelu_out)
            && !bias_grad
    }

    /// Collectives: the GEMM in column chunks, each written contiguously ([n, m_i]) into
    /// local staging, and the reduce-scatter collective of chunk i (into the buffer, then
    /// a 2-D copy into its columns of `rs_output`) while chunk i+1 computes.
    fn rs_collective_chunks(&mut self, p: &RsPlan, x: &RsArgs, splits: usize) -> Result<()> {
        let tp = self.tp();
        let staging = self.staging()?;
        let bounds = Self::rs_bounds(p, splits);
        let key = key_with(p.full.sum_key(), (bounds.len() - 1) as u64);
        self.begin(Op::SplitRs, false, &key, Some(&p.full));
        let e = eb(self.dtype());
        let n = p.nc * tp;
        let nchunks = bounds.len() - 1;
        let gemm = |pl: &mut Self, i: usize| {
            let (lo, hi) = (bounds[i], bounds[i + 1]);
            // Written contiguously: [n, hi - lo] at the chunk's place in staging.
            let mut g = Self::column_chunk(p, lo, hi);
            g.d = staging + lo * n * e;
            g.ldd = hi - lo;
            pl.gemm(&g, IN_ORDER, false);
            Ok(())
        };
        let cs = Lane::Comm(0);
        let out = x.rs_output.data.ptr;
        let collective = |pl: &mut Self, i: usize| {
            let (lo, hi) = (bounds[i], bounds[i + 1]);
            pl.record(1 + i, Lane::Compute(IN_ORDER));
            pl.wait_event(1 + i, cs);
            let recv = pl.buffer() + lo * p.nc * e;
            let src = staging + lo * n * e;
            pl.reduce_scatter((src, recv, p.nc * (hi - lo)), pl.dtype(), cs)
        };
        // (the chunk's rows out of the buffer: after the next chunk's GEMM)
        let copy_out = |pl: &mut Self, i: usize| {
            let (lo, hi) = (bounds[i], bounds[i + 1]);
            let (w, recv) = (hi - lo, pl.buffer() + lo * p.nc * e);
            pl.copy_2d(out + lo * e, p.m * e, recv, w * e, w * e, p.nc, cs);
            Ok(())
        };
        self.chunks_interleaved(nchunks, gemm, collective, copy_out)?;
        self.finish();
        Ok(())
    }

    /// The ring reduce-scatter of the call (between begin and finish), ending with the
    /// reduction into `x.rs_output` on comm stream 0.
    pub(super) fn ring_rs(&mut self, x: &RsArgs, p: &RsPlan, ring: &Ring) -> Result<()> {
        let staging = self.staging()?;
        let slot_bytes = p.nc * p.m * eb(self.dtype());
        let plan = super::schedule::rs_exchange(self.tp(), self.tp_rank());
        let fp8 = self.fp8_output(x.rs_output, "rs_output", Lane::Comm(0))?;
        let pieces = self.fused_rs_pieces(p, ring);
        let done = match ring.fused {
            Some(tiles) => self.fused_rs_gemm(p, staging, pieces, tiles)?,
            None => None,
        };
        let sizes = (slot_bytes, pieces);
        if done.is_some() {
            for i in 0..plan.steps.len() {
                self.ring_rs_exchange(staging, sizes, &plan.steps, (i, Part::Whole), done)?;
            }
        } else {
            // (the last GEMM, this rank's own partial, has no exchange; each exchange
            // completes after the next GEMM)
            let n = plan.steps.len();
            let gemm = |pl: &mut Self, i: usize| {
                pl.ring_rs_gemm(p, staging, &plan.gemm_dest, i);
                Ok(())
            };
            let exchange = |pl: &mut Self, i: usize, part: Part| {
                if i < n {
                    pl.ring_rs_exchange(staging, sizes, &plan.steps, (i, part), None)
                } else {
                    Ok(())
                }
            };
            let start = |pl: &mut Self, i: usize| {
                pl.record(i, Lane::Compute(IN_ORDER));
                exchange(pl, i, Part::Start)
            };
            let finish = |pl: &mut Self, i: usize| exchange(pl, i, Part::Finish);
            self.chunks_interleaved(plan.gemm_dest.len(), gemm, start, finish)?;
        }
        self.ring_rs_reduce(x, p, staging, fp8, done.map(|d| (d, pieces)))?;
        if let Some(d) = done {
            // every signal back to zero (the next call clears them again before its GEMM)
            self.memset(d, 4 * self.tp() * pieces, Lane::Comm(0));
        }
        Ok(())
    }

    /// Pieces per destination of the fused ring (`ring.fused`; else 1): the ring's
    /// pieces, raised (tp > 1) where one piece's tiles would take more than one round of
    /// the fused GEMM's CTAs (`sm90::rs_pieces`, on [`Self::fused_sms_shared`] SMs), at
    /// most as many as divide the `nc` rows evenly and leave room for a done signal and a
    /// tile counter per piece. Each piece is signalled by our GEMM and exchanged on its
    /// own, so the first exchange starts after 1/pieces of a destination's rows and the
    /// last one after the GEMM is 1/pieces of a block. It depends only on values every
    /// rank shares (the policy, the device's SM count, the shape) and on
    /// NVTE_COMM_FUSED_TILES (the tile width the pieces are sized for: set alike on every
    /// rank), so every rank exchanges the same pieces whichever GEMM it runs (ranks on
    /// devices of different SM counts, or with different knobs, could differ:
    /// `NVTE_COMM_CHECK`'s key includes the pieces).
    fn fused_rs_pieces(&self, p: &RsPlan, ring: &Ring) -> usize {
        let Some(tiles) = ring.fused else {
            return 1;
        };
        let (tp, nc) = (self.tp(), p.nc);
        let want = ring.pieces.max(1);
        let mut pieces = if tp > 1 {
            let narrow = tiles == Tiles::Narrow;
            sm90::rs_pieces(
                want,
                nc,
                p.full.m,
                p.full.n,
                self.fused_sms_shared(),
                narrow,
            )
        } else {
            want
        }
        .min(nc.max(1));
        while pieces > 1 && (!nc.is_multiple_of(pieces) || 2 * tp * pieces > MAX_FLAGS) {
            pieces -= 1;
        }
        pieces
    }

    /// The fused ring's GEMM (module doc), in `tiles`, where our GEMM can compute the call: comm stream 0 clears the done signals, then one launch computes
    /// the whole partial into staging. Returns the signals (u32 per piece of each
    /// destination: `pieces` per destination, in row order), or None (the GEMMs per
    /// destination are the caller's).
    fn fused_rs_gemm(
        &mut self,
        p: &RsPlan,
        staging: DevPtr,
        pieces: usize,
        tiles: Tiles,
    ) -> Result<Option<DevPtr>> {
        let mut g = p.full;
        g.d = staging; // rows d * nc.. of the partial: destination d's slot
        let why = match self.e.own_gemm {
            None => Some("our sm90 GEMM is not loaded"),
            Some(f) => f(&g),
        };
        if let Some(why) = why {
            self.step(|| format!("fused ring: GEMMs per destination on cuBLASLt ({why})"));
            return Ok(None);
        }
        let (tp, r) = (self.tp(), self.tp_rank());
        // signals [tp * pieces], then the kernel's tile counters (it keeps them at zero)
        let done = self.flags()? + 4 * MAX_FLAGS;
        let cs = Lane::Comm(0);
        self.memset(done, 4 * tp * pieces, cs);
        let ev_clear = self.e.events - 1;
        self.record(ev_clear, cs);
        self.wait_event(ev_clear, Lane::Compute(0));
        let hooks = Hooks {
            done,
            done_rows: p.nc / pieces,
            done_value: 1,
            n_tile_rot: (r + 1) % tp * p.nc / TILE_ROWS,
            narrow: tiles == Tiles::Narrow,
            ..Default::default()
        };
        let sms = self.fused_sms(false);
        self.step(|| {
            format!(
                "fused ring: our sm90 GEMM on {sms} SMs, {tp} destinations x {pieces} pieces signalled"
            )
        });
        self.fused_gemm(&g, hooks, sms, 0);
        Ok(Some(done))
    }

    /// GEMM `i`, for destination d = `dests[i]`: B's rows [d nc, (d+1) nc), output [nc, m],
    /// into local staging: the GEMMs never touch the registered buffer, which peers may
    /// still be loading from for the previous call. (Its event `i` is recorded by the
    /// caller, with the exchange's start.)
    fn ring_rs_gemm(&mut self, p: &RsPlan, staging: DevPtr, dests: &[usize], i: usize) {
        let tp = self.tp();
        let slot_bytes = p.nc * p.m * eb(self.dtype());
        let d = dests[i];
        let mut g = p.full;
        g.n = p.nc;
        g.b = p.full.b_from_row(d * p.nc);
        g.d = staging + d * slot_bytes;
        if !p.full.aux.is_null() {
            g.aux = p.full.aux + d * p.nc * p.m * eb(p.full.aux_type);
        }
        if p.full.epilogue == gemm::Epilogue::BGradB {
            g.bias = p.full.bias + d * p.nc * eb(p.full.bias_type);
        }
        self.step(|| format!("GEMM partial for rank {d} ({} of {tp})", i + 1));
        self.gemm(&g, IN_ORDER, false);
        self.mark(Lane::Compute(IN_ORDER), || format!("gemm{i}"));
    }

    /// Step i: our partial for rank d = r+i+1 goes to its slot r, and the partial of rank
    /// s = r-i-1 for us lands in our slot s (the barrier at the start of the call made
    /// sure every rank is done with its buffer from the last call). In `pieces` exchanges
    /// (the fused ring's, also where our GEMM does not run: every rank exchanges the
    /// same), each after our GEMM's done signal of that piece, or all after the
    /// destination's cuBLASLt GEMM.
    fn ring_rs_exchange(
        &mut self,
        staging: DevPtr,
        (slot_bytes, pieces): (usize, usize),
        steps: &[super::schedule::Transfer],
        (i, part): (usize, Part),
        done: Option<DevPtr>,
    ) -> Result<()> {
        let cs = Lane::Comm(0);
        let slot = self.e.slots.rs_p2p;
        // `pieces` divides the slot's rows, so each piece is slot_bytes / pieces bytes.
        let piece = slot_bytes / pieces;
        let t = &steps[i];
        if done.is_none() && part != Part::Finish {
            self.wait_event(i, cs);
        }
        for c in 0..pieces {
            if let Some(d) = done {
                self.wait_flag(d + 4 * (t.to * pieces + c), 1, cs);
            }
            let send = SendOp::contiguous(
                t.to,
                staging + t.to * slot_bytes + c * piece,
                t.send * slot_bytes + c * piece,
                piece,
            );
            let recv = RecvOp::contiguous(t.from, t.recv * slot_bytes + c * piece, piece);
            let q = i * pieces + c;
            let info = WaitInfo {
                op: Op::SplitRsP2p as u32,
                step: q as u32,
            };
            if part != Part::Finish {
                self.step(|| {
                    let of = if pieces > 1 {
                        format!(" (piece {} of {pieces})", c + 1)
                    } else {
                        String::new()
                    };
                    format!(
                        "exchange {}: partial to rank {}, from rank {}{of}",
                        i + 1,
                        t.to,
                        t.from
                    )
                });
            }
            self.exchange_part(send, recv, None, (slot, tag(q)), cs, info, part)?;
        }
        if part != Part::Start {
            self.mark(cs, || format!("exchanged{i}"));
        }
        Ok(())
    }

    /// The closing reduction of the tp partials (this rank's own from staging, the
    /// others' landed in the buffer) into `rs_output`. `done`: the fused ring's signals
    /// and pieces per destination (all of this rank's own are waited for).
    fn ring_rs_reduce(
        &mut self,
        x: &RsArgs,
        p: &RsPlan,
        staging: DevPtr,
        fp8: (DevPtr, DevPtr),
        done: Option<(DevPtr, usize)>,
    ) -> Result<()> {
        let (tp, r) = (self.tp(), self.tp_rank());
        let slot_bytes = p.nc * p.m * eb(self.dtype());
        let cs = Lane::Comm(0);
        match done {
            Some((d, pieces)) => {
                for c in 0..pieces {
                    self.wait_flag(d + 4 * (r * pieces + c), 1, cs);
                }
            }
            None => self.wait_event(tp - 1, cs),
        }
        let srcs: PerRank<DevPtr> = (0..tp)
            .map(|s| {
                if s == r {
                    staging + r * slot_bytes
                } else {
                    self.buffer() + s * slot_bytes
                }
            })
            .collect();
        let out = &x.rs_output.data;
        self.reduce(
            Reduce {
                out: out.ptr,
                out_type: out.dtype,
                out_ld: p.m,
                srcs,
                in_ld: p.m,
                rows: p.nc,
                cols: p.m,
                in_scale: p.scale_inv,
                fp8_out: fp8,
                tail: true,
            },
            cs,
        );
        self.mark(cs, || "reduced".into());
        Ok(())
    }

    /// The accumulating ring of the call (between begin and finish; module doc), ending
    /// with this rank's reduced rows in `x.rs_output`. `gather` = (half, D), the
    /// all-reduce: each finished piece of those rows is also pushed into every peer's
    /// buffer at byte offset half + (its place in D), and the peers' pieces that land here
    /// are copied into the rest of D (`x.rs_output` is this rank's rows of D).
    pub(super) fn chain_rs(
        &mut self,
        x: &RsArgs,
        p: &RsPlan,
        op: Op,
        gather: Option<(usize, DevPtr)>,
        pieces: usize,
    ) -> Result<()> {
        let tp = self.tp();
        let bounds = self.chain_bounds(p.nc, pieces);
        self.chain_steps(x, p, op, &bounds)?;
        // (finish() joins the compute stream: the caller waits for the last GEMMs.)
        // (At tp 1 there is nothing to gather.)
        let Some((half, d)) = gather.filter(|_| tp > 1) else {
            return Ok(());
        };
        self.chain_gather(x, p, op, &bounds, (half, d))
    }

    /// The accumulating ring's steps: step i computes the partial of chunk
    /// `plan.chunk[i]`'s rows, piece by piece, adding the running sum that arrived.
    fn chain_steps(&mut self, x: &RsArgs, p: &RsPlan, op: Op, bounds: &[usize]) -> Result<()> {
        let (tp, r) = (self.tp(), self.tp_rank());
        let staging = self.staging()?;
        let e = eb(self.dtype());
        let slot_bytes = p.nc * p.m * e;
        let plan = super::schedule::rs_chain(tp, r);
        let np = bounds.len() - 1;
        let computed = |i: usize, j: usize| i * np + j;
        let landed = |i: usize, j: usize| (tp + i) * np + j;
        let (cs, cmp) = (Lane::Comm(0), Lane::Compute(0));
        let out = x.rs_output.data.ptr;
        let slot = self.e.slots.rs_p2p;
        for (i, &c) in plan.chunk.iter().enumerate() {
            let last = i + 1 == tp;
            self.step(|| chain_step_name(i, c, tp));
            for j in 0..np {
                let (lo, hi) = (bounds[j], bounds[j + 1]);
                let off = lo * p.m * e;
                if i > 0 {
                    // Piece j of step i - 1's sums: ours to `to`, `from`'s to slot i - 1.
                    let k = (i - 1) * np + j;
                    let at = (i - 1) * slot_bytes + off;
                    let bytes = (hi - lo) * p.m * e;
                    self.wait_event(computed(i - 1, j), cs);
                    let send = SendOp::contiguous(plan.to, staging + at, at, bytes);
                    let recv = RecvOp::contiguous(plan.from, at, bytes);
                    let info = WaitInfo {
                        op: op as u32,
                        step: k as u32,
                    };
                    self.exchange(send, recv, (slot, tag(k)), cs, info)?;
                    self.record(landed(i - 1, j), cs);
                    self.wait_event(landed(i - 1, j), cmp);
                }
                let mut g = p.full;
                g.n = hi - lo;
                g.b = p.full.b_from_row(c * p.nc + lo);
                g.d = if last {
                    out + off
                } else {
                    staging + i * slot_bytes + off
                };
                if i > 0 {
                    g.accumulate = true;
                    g.c = self.buffer() + (i - 1) * slot_bytes + off;
                }
                self.gemm(&g, 0, false);
                if !self.e.inline {
                    // (inline: one stream, program order)
                    self.record(computed(i, j), cmp);
                }
            }
            self.mark(cmp, || format!("gemm{i}"));
        }
        Ok(())
    }

    /// All-reduce: push each reduced piece to every peer as soon as it is computed (comm
    /// stream 2, so no push queues behind the ring's exchanges), and copy the peers'
    /// pieces into D as they land (comm stream 1). A peer's piece j lands about when this
    /// rank computed its own: the wait for it starts then, not at the call's start (a
    /// wait kernel spins on an SM, and its timeout counts from its start).
    fn chain_gather(
        &mut self,
        x: &RsArgs,
        p: &RsPlan,
        op: Op,
        bounds: &[usize],
        (half, d): (usize, DevPtr),
    ) -> Result<()> {
        let (tp, r) = (self.tp(), self.tp_rank());
        let e = eb(self.dtype());
        let slot_bytes = p.nc * p.m * e;
        let np = bounds.len() - 1;
        let computed = |i: usize, j: usize| i * np + j;
        let out = x.rs_output.data.ptr;
        let others = self.others();
        let mine = r * slot_bytes;
        let slot = self.e.slots.ar_reduced;
        let push = Lane::Comm(2);
        for j in 0..np {
            let (lo, hi) = (bounds[j], bounds[j + 1]);
            let off = lo * p.m * e;
            self.wait_event(computed(tp - 1, j), push);
            for k in 1..tp {
                let q = (r + k) % tp;
                self.put(q, half + mine + off, out + off, (hi - lo) * p.m * e, push)?;
            }
            self.signal(&others, slot, tag(j), push)?;
        }
        let land = Lane::Comm(1);
        for j in 0..np {
            let (lo, hi) = (bounds[j], bounds[j + 1]);
            let off = lo * p.m * e;
            self.wait_event(computed(tp - 1, j), land);
            let info = WaitInfo {
                op: op as u32,
                step: (tp * np + j) as u32,
            };
            self.wait(&others, (slot, tag(j)), land, info)?;
            for &q in &others {
                let at = q * slot_bytes + off;
                self.copy(d + at, self.buffer() + half + at, (hi - lo) * p.m * e, land);
            }
        }
        self.mark(land, || "gathered".into());
        Ok(())
    }
}

/// The NVTX name of the accumulating ring's step i (chunk c).
fn chain_step_name(i: usize, c: usize, tp: usize) -> String {
    if i + 1 == tp {
        format!("GEMM of the own rows, adding the sums that arrived ({tp} of {tp})")
    } else {
        format!(
            "GEMM partial of rank {c}'s rows{} ({} of {tp})",
            if i > 0 {
                " added to the sum that arrived"
            } else {
                ""
            },
            i + 1
        )
    }
}

/// Bytes from a block-scaled A's 2D scales to those of its rows from `lo` (a multiple of
/// 128): whole tiles of [ceil(m/128), pad4(ceil(k/128))] float32 (TE's GEMM-ready 2D
/// layout). 0 for a 1D-scaled A (never cut: [`block_column_bounds`]).
fn block_a_scale_offset(f: &GemmDesc, lo: usize) -> usize {
    match f.blocks {
        Some([crate::tensor::BlockMode::TwoD, _]) => {
            let row = crate::tensor::scale_shape::two_d_rowwise(f.m, f.k)[1];
            (lo / 128) * row * 4
        }
        _ => 0,
    }
}

/// Column chunks of a block-scaled GEMM of m columns: at most `splits` runs of whole
/// 128-row tiles of a 2D-scaled A, one chunk for a 1D-scaled A.
pub(super) fn block_column_bounds(m: usize, splits: usize, a: crate::tensor::BlockMode) -> Bounds {
    if a != crate::tensor::BlockMode::TwoD || m == 0 {
        return [0, m].into_iter().collect();
    }
    let tiles = m.div_ceil(128);
    let s = splits.clamp(1, tiles);
    (0..=s).map(|i| (i * tiles / s * 128).min(m)).collect()
}
