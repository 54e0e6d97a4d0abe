//! All-gather + GEMM by ring exchange [TE: SPLIT_PIPELINED_AG_P2P].
//!
//! B (tokens x k) is gathered along its rows into the buffer, one chunk of n/tp rows per
//! rank. Each rank starts with its own chunk's GEMM while it sends that chunk to its ring
//! neighbour; every received chunk is forwarded and multiplied as soon as it lands, its
//! output rows written straight into their place in D. Unidirectional: tp-1 steps to the
//! next rank. Bidirectional (config `aggregate`): chunks travel both ways at once, so the
//! gather takes about tp/2 steps, on two comm streams.
//!
//! The fused all-gather + GEMM (`fused_ag`, config `atomic_gemm` / the comm-GEMM API's
//! kNVTECommGemmAlgoAtomicP2P) gathers the same way along the backward ring alone and
//! runs one launch of our own GEMM that waits on per-piece arrival flags.
//!
//! Block-scaled FP8 B (NVTE_BLOCK_SCALING_1D / 2D): each rank's shard [n/tp, k] comes with
//! its own GEMM-ready scales, which travel with it into per-rank scale slots behind the
//! gathered data in the buffer ([`ag_block_layout`]): in the same exchange step as their
//! chunk, after its bytes and before the step's one signal, so they never go ahead of the
//! data (about 1/32 of a 1D chunk's bytes). Each chunk's GEMM then reads its chunk's data
//! and its own slot's scales, whole (no row pieces: a piece's rows would need scales of
//! their own layout); the fused GEMM takes no block scales, so the ring runs them.
use super::plan::{Lane, MAX_FLAGS, Part, Planner};
use super::policy::{Algo, Tiles};
use super::schedule::AgRing;
use super::{MAX_AMAX_SLOTS, Op, Overlap, eb, tag};
use crate::cuda::DevPtr;
use crate::cuda::StreamHandle;
use crate::error::Result;
use crate::gemm::sm90::{Hooks, SideCopy, TILE_ROWS, k_blocks, k_slice_bytes};
use crate::gemm::{self, Epilogue, GemmDesc, TeGemm};
use crate::tensor::{BlockMode, Buffer, Shape, Tensor};
use crate::transport::{RecvOp, SendOp, WaitInfo};
use crate::{invalid, unsupported};

/// K slices per chunk of the fused all-gather with NVTE_COMM_AG_PIECES=k (at least; the
/// tuned piece count where larger): the granularity the one-GPU emulated link measured.
const K_SLICES: usize = 4;

/// The operands of an all-gather + GEMM (B: this rank's shard or the buffer view), and
/// where to keep a copy of the gathered B.
pub struct AgArgs<'a> {
    pub g: TeGemm<'a>,
    pub b_copy: Option<&'a Tensor>,
    /// The m every rank's cross-rank check key carries instead of this rank's own (None:
    /// its own). The comm-GEMM API splits m unevenly across the ranks (numroc): its calls
    /// pass the global m, so ranks with different shares of m agree.
    pub key_m: Option<usize>,
}

impl Overlap {
    /// D = gather(B) x op(A). `B` is either the buffer view (its local chunk already
    /// filled, e.g. by copy_into_buffer) or this rank's shard [n/tp, k], copied in first.
    pub fn split_ag(&mut self, x: &AgArgs, stream: StreamHandle) -> Result<()> {
        self.reported(stream, |o| o.run_planned(stream, |p| p.split_ag(x)))
    }
}

/// The all-gather's geometry, validated: the gathered B is [n, k] (chunks of nc rows),
/// the GEMM on all of it `full`, split into `pieces` per remote chunk.
struct AgShape {
    k: usize,
    nc: usize,
    is_view: bool,
    /// where this rank's chunk is read from (the shard, or its place in the buffer)
    local_src: DevPtr,
    full: GemmDesc,
    pieces: usize,
    /// Pieces are K slices of a whole chunk (all its rows, the K columns of
    /// [`k_slice_bytes`]), not row slices: our fused GEMM's tiles then start on a chunk
    /// while it still arrives, and the last chunk's tiles end one slice's work after the
    /// ring (bench/RESULTS.md, 2026-11-27 tenth session). With NVTE_COMM_AG_PIECES=k, where
    /// the transport moves strided pieces and our kernel takes the call.
    k_slices: bool,
    /// FP8 output: per-GEMM amax slots (NULL: none)
    amax_slots: DevPtr,
    /// the fused GEMM's tiles
    tiles: Tiles,
    /// block-scaled B: where each chunk's scales are
    scales: Option<AgScales>,
}

/// Block-scaled B's scales in an all-gather: this rank's own (the shard's scale_inv) and
/// the buffer's scale slots, one per rank's chunk.
#[derive(Clone, Copy, Debug)]
struct AgScales {
    /// the shard's GEMM-ready scales
    local: DevPtr,
    /// buffer offset of slot 0 and the distance between slots (bytes)
    base: usize,
    slot: usize,
    /// bytes of one chunk's scales
    bytes: usize,
    /// B_copy's scales, when a B_copy was given
    out: Option<ScaleOut>,
}

impl AgScales {
    /// Buffer offset of chunk c's scale slot.
    fn at(&self, c: usize) -> usize {
        self.base + c * self.slot
    }
}

/// Where a chunk's GEMM-ready scales go in B_copy's (the GEMM-ready scales of all of B):
/// chunk c's `height` rows of `width` bytes (a row `spitch` apart in its slot) to
/// `dst + c * step`, a row `dpitch` apart. 1D: the chunk's rows are columns of the k/128
/// scale rows; 2D: its whole 128-row tiles are rows of B_copy's.
#[derive(Clone, Copy, Debug)]
struct ScaleOut {
    dst: DevPtr,
    dpitch: usize,
    spitch: usize,
    width: usize,
    height: usize,
    step: usize,
}

/// B_copy of block-scaled B (all of B [n, k], chunks of nc rows, each with `mode`'s
/// GEMM-ready scales of the shape of `local`, this rank's): its data checked as any
/// B_copy's (by the caller), its scaling mode B's, its scales f32 of the GEMM-ready shape
/// of [n, k]; with 2D scales at tp > 1, chunks of whole 128-row tiles (B_copy's scale rows
/// are the tiles of all of B, and a tile cannot hold two ranks' scales).
fn block_copy_out(
    bc: &Tensor,
    mode: BlockMode,
    local: &Buffer,
    nc: usize,
    n: usize,
    k: usize,
) -> Result<ScaleOut> {
    gemm::block::check_gathered_scales(bc, "B_copy", mode, n, k)?;
    let s = &bc.scale_inv; // (checked: the GEMM-ready shape of [n, k])
    let (sr, sc) = match local.shape.as_slice() {
        &[r, c] => (r, c),
        _ => invalid!("B's block scales must be 2-D, got {}", local.shape),
    };
    Ok(match mode {
        BlockMode::OneD => ScaleOut {
            dst: s.ptr,
            dpitch: s.shape.as_slice()[1] * 4,
            spitch: sc * 4,
            width: nc * 4,
            height: sr,
            step: nc * 4,
        },
        BlockMode::TwoD if nc != n && !nc.is_multiple_of(128) => unsupported!(
            "B_copy of 2D-scaled B needs each rank's rows n/tp = {nc} in whole 128-row tiles (B_copy's scales are the tiles of all of B)"
        ),
        BlockMode::TwoD => ScaleOut {
            dst: s.ptr,
            dpitch: sc * 4,
            spitch: sc * 4,
            width: sc * 4,
            height: sr,
            step: sr * sc * 4,
        },
    })
}

/// The buffer layout of an all-gather of block-scaled B: `data_bytes` of gathered data,
/// then `tp` scale slots of `scale_bytes` (one chunk's scales) each, 256-byte aligned.
/// Returns (offset of slot 0, distance between slots, bytes of the buffer needed).
pub fn ag_block_layout(data_bytes: usize, scale_bytes: usize, tp: usize) -> (usize, usize, usize) {
    let base = data_bytes.next_multiple_of(256);
    let slot = scale_bytes.next_multiple_of(256);
    (base, slot, base + tp * slot)
}

/// The extra key word of [`Algo::GatherThenGemm`] ("serialAG").
const GATHER_THEN_GEMM_KEY: u64 = u64::from_le_bytes(*b"serialAG");

impl AgShape {
    fn chunk_bytes(&self, e: usize) -> usize {
        self.nc * self.k * e
    }
    /// Rows [lo, hi) of a chunk are piece j's.
    fn rows(&self, j: usize) -> (usize, usize) {
        (self.nc * j / self.pieces, self.nc * (j + 1) / self.pieces)
    }
}

impl Planner<'_> {
    /// split_ag's algorithm: no overlap where the policy says so and it can be
    /// ([`Self::ag_serial`]); the fused all-gather where the policy asks for the fused
    /// algorithms, the transport exchanges two-sided and the inputs are not block-scaled
    /// (our fused GEMM takes no block scales); else the ring.
    pub(super) fn ag_algo(&self, x: &AgArgs) -> Algo {
        let p = &self.e.policy;
        let pieces = p.pieces.max(1) as usize;
        if self.ag_serial(x) {
            Algo::GatherThenGemm
        } else if p.fused_on() && self.e.caps.two_sided && !gemm::block::is_block(&x.g) {
            Algo::FusedAg {
                pieces,
                k_slices: p.ag_k_slices(),
                tiles: p.tiles(),
            }
        } else {
            Algo::RingAg {
                bidirectional: p.bidirectional(),
                pieces,
            }
        }
    }

    /// No overlap ([`Algo::GatherThenGemm`]) where the policy says so
    /// ([`Policy::serial`](super::policy::Policy::serial)),
    /// at tp > 1 on the comm streams, with B's chunks one matrix once gathered (transb =
    /// false; not block-scaled: each chunk's scales are in a slot of their own), and a
    /// transport that gathers whole (collectives or peer memory).
    fn ag_serial(&self, x: &AgArgs) -> bool {
        let c = &self.e.caps;
        self.e.policy.serial()
            && self.tp() > 1
            && !self.e.inline
            && !x.g.transb
            && !gemm::block::is_block(&x.g)
            && (c.collectives || c.peer_memory)
    }

    /// [`Algo::GatherThenGemm`]: no overlap, the fallback where overlapping loses. B
    /// gathered whole into the buffer (the transport's all-gather from the shard, or in
    /// place from the buffer view; without collectives, the shard put into every peer's
    /// buffer and copied into this rank's), then one GEMM over all of B on every SM
    /// (nothing communicates beside it), and B_copy from the buffer beside that GEMM.
    pub(super) fn gather_then_gemm(&mut self, x: &AgArgs) -> Result<()> {
        let sh = self.ag_shape(x, 1)?;
        let mut key = sh.full.check_key();
        if let Some(m) = x.key_m {
            key[0] = m as u64;
        }
        // (a word more than the overlapped all-gathers' keys: ranks that differ in
        // NVTE_COMM_OVERLAP are a mismatch NVTE_COMM_CHECK reports)
        let key = super::key_with(key, GATHER_THEN_GEMM_KEY);
        let full = GemmDesc {
            sm_count: self.math_sms(false),
            ..sh.full
        };
        self.begin(Op::SplitAg, false, &key, Some(&full));
        let (tp, r) = (self.tp(), self.tp_rank());
        let cb = sh.chunk_bytes(eb(self.dtype()));
        let mine = self.buffer() + r * cb;
        let cs = Lane::Comm(0);
        self.step(|| format!("all-gather of B ({tp} chunks of {cb} bytes)"));
        if self.e.caps.collectives {
            self.all_gather(sh.local_src, self.buffer(), cb, cs)?;
        } else {
            self.put_to_peers(sh.local_src, r * cb, cb, Op::SplitAg)?;
            if !sh.is_view {
                self.copy(mine, sh.local_src, cb, cs);
            }
        }
        self.record(0, cs);
        if let Some(bc) = x.b_copy {
            self.copy(bc.data.ptr, self.buffer(), tp * cb, cs);
        }
        self.wait_event(0, Lane::Compute(0));
        self.step(|| format!("GEMM of all {} rows of B", full.n));
        self.gemm(&full, 0, false);
        self.finish();
        Ok(())
    }

    /// [`Algo::RingAg`]: the ring all-gather + GEMM (module
    /// doc), both ways at once where `bidirectional`, each remote chunk in at most
    /// `pieces` pieces.
    pub(super) fn ring_ag(&mut self, x: &AgArgs, bidirectional: bool, pieces: usize) -> Result<()> {
        let sh = self.ag_shape(x, pieces)?;
        let mut key = sh.full.check_key();
        if let Some(m) = x.key_m {
            key[0] = m as u64;
        }
        self.begin(Op::SplitAg, false, &key, Some(&sh.full));
        let ring = super::schedule::ag_ring(self.tp(), self.tp_rank(), bidirectional);
        let gemms = self.ag_ring_and_gemms(x, &sh, &ring)?;
        self.finish();
        if !sh.amax_slots.is_null() {
            self.amax_max(sh.full.d_amax, sh.amax_slots, gemms);
        }
        Ok(())
    }

    /// B's gathered shape from B (the buffer view or this rank's shard) and transb.
    fn ag_dims(&self, x: &AgArgs) -> Result<(usize, usize, bool)> {
        let tp = self.tp();
        let bb = &x.g.b.data;
        if bb.dtype != self.dtype() {
            invalid!(
                "tensor `B` dtype {} differs from the buffer dtype {}",
                bb.dtype.name(),
                self.dtype().name()
            );
        }
        let Some((r0, c0)) = bb.rows_cols() else {
            invalid!(
                "tensor `B` must have at least 2 dimensions, got {}",
                bb.shape
            )
        };
        let is_view = bb.ptr == self.buffer();
        // transb = false: B is [n, k], gathered along its rows; transb = true: this rank's
        // shard is [k, n/tp] and the buffer holds the tp shards one after the other.
        let (n, k) = if x.g.transb {
            if is_view {
                unsupported!(
                    "with transb = true, B must be this rank's shard [k, n/tp], not the buffer view"
                );
            }
            (c0 * tp, r0)
        } else if is_view {
            (r0, c0)
        } else {
            (r0 * tp, c0)
        };
        if n % tp != 0 {
            invalid!("the gathered rows n = {n} are not divisible by tp = {tp}");
        }
        self.check_capacity("gathering B into", [n, k])?;
        if !is_view && bb.ptr.is_null() {
            invalid!("tensor `B` has a NULL data pointer");
        }
        Ok((n, k, is_view))
    }

    /// Validate the call and plan its geometry (before the call begins).
    fn ag_shape(&mut self, x: &AgArgs, pieces: usize) -> Result<AgShape> {
        if gemm::block::is_block(&x.g) {
            return self.ag_block_shape(x);
        }
        let (tp, r) = (self.tp(), self.tp_rank());
        let (n, k, is_view) = self.ag_dims(x)?;
        let e = eb(self.dtype());
        let nc = n / tp;
        // Validate the whole GEMM once, on B = the gathered buffer.
        let mut gathered = x.g.b.clone();
        let gshape = if x.g.transb { [k, n] } else { [n, k] };
        gathered.data = Buffer::new(self.buffer(), self.dtype(), Shape::new(&gshape)?)?;
        let comm_sms = self.comm_on_sms();
        let full = gemm::desc_from_te(&TeGemm {
            b: &gathered,
            math_sm_count: self.math_sms(comm_sms),
            ..x.g
        })?;
        if full.epilogue == Epilogue::DGeluBGrad {
            unsupported!(
                "the DGELU + bias-gradient epilogue reduces over all tokens: it cannot be split into token chunks"
            );
        }
        // Pieces per remote chunk (finer pipeline: each piece travels and is multiplied
        // on its own, so the last GEMM after the last arrival is 1/pieces of a chunk's):
        // the configured count where B's chunks are row blocks (transb = false) and the
        // epilogue is per row; bounded by the events and amax slots there are.
        let fp8_amax = full.d_type.is_fp8() && !full.d_amax.is_null();
        let limit = if fp8_amax {
            MAX_AMAX_SLOTS
        } else {
            self.e.events
        } / tp;
        let pieces = if x.g.transb || full.epilogue == Epilogue::BGradB {
            1
        } else {
            pieces.clamp(1, nc.max(1)).min(limit.max(1))
        };
        // FP8 output: each GEMM scales its rows and writes its own amax slot; the slots'
        // maximum goes into D's amax after the call.
        // (At tp 1 the one GEMM writes D's amax itself.)
        let amax_slots = if fp8_amax && tp > 1 {
            if tp > MAX_AMAX_SLOTS {
                unsupported!("an FP8 output with amax at tp = {tp} > {MAX_AMAX_SLOTS}");
            }
            self.amax_slots()?
        } else {
            DevPtr::NULL
        };
        if let Some(c) = x.b_copy {
            self.check_b_copy_data(c, n, k)?;
        }
        let local_src = if is_view {
            self.buffer() + r * nc * k * e
        } else {
            x.g.b.data.ptr
        };
        Ok(AgShape {
            k,
            nc,
            is_view,
            local_src,
            full,
            pieces,
            k_slices: false,
            tiles: Tiles::Rule,
            amax_slots,
            scales: None,
        })
    }

    /// [`Self::ag_shape`] of block-scaled inputs: B is this rank's shard [n/tp, k]
    /// (rowwise data, transb = false) with its GEMM-ready scales, validated as the local
    /// chunk's GEMM; the gathered GEMM is that one over all n rows, with every chunk's
    /// scales in its slot ([`ag_block_layout`]). One piece per chunk.
    fn ag_block_shape(&mut self, x: &AgArgs) -> Result<AgShape> {
        let tp = self.tp();
        if x.g.transb {
            unsupported!(
                "the all-gather with block-scaled FP8 inputs takes B as [n/tp, k] with transb = false (its rowwise data and scales are gathered along its rows)"
            );
        }
        let shard = &x.g.b.data;
        if shard.ptr == self.buffer() {
            unsupported!(
                "with block-scaled FP8 inputs, B must be this rank's shard [n/tp, k] with its scales, not the buffer view (the buffer's chunks carry no scales of their own)"
            );
        }
        let Some((nc, k)) = shard.rows_cols() else {
            invalid!(
                "tensor `B` must have at least 2 dimensions, got {}",
                shard.shape
            );
        };
        let n = nc * tp;
        // B_copy: the gathered data and, chunk by chunk, the scales in its GEMM-ready ones.
        let out = match (x.b_copy, x.g.b.block_mode()) {
            (Some(bc), Some(mode)) => {
                self.check_b_copy_data(bc, n, k)?;
                Some(block_copy_out(bc, mode, &x.g.b.scale_inv, nc, n, k)?)
            }
            _ => None,
        };
        let (m, dt) = (x.g.d.data.rows_cols().map_or(0, |d| d.1), x.g.d.data.dtype);
        block_outputs_gathered(&x.g, n, m)?;
        // The local chunk's GEMM checks the operands: D's and pre_gelu_out's first nc rows.
        let view = |t: &Tensor| -> Result<Tensor> {
            let mut v = t.clone();
            v.data = Buffer::new(t.data.ptr, t.data.dtype, Shape::new(&[nc, m])?)?;
            Ok(v)
        };
        let d_chunk = view(x.g.d)?;
        let aux_chunk = x.g.pre_gelu_out.map(view).transpose()?;
        let comm_sms = self.comm_on_sms();
        let mut full = gemm::desc_from_te_block(&TeGemm {
            d: &d_chunk,
            pre_gelu_out: aux_chunk.as_ref(),
            math_sm_count: self.math_sms(comm_sms),
            ..x.g
        })?;
        if self.dtype() != full.b_type {
            invalid!(
                "tensor `B` dtype {} differs from the buffer dtype {}",
                full.b_type.name(),
                self.dtype().name()
            );
        }
        let e = eb(self.dtype());
        let scale_bytes = x.g.b.scale_inv.bytes();
        let (base, slot, need) = ag_block_layout(n * k * e, scale_bytes, tp);
        if need > self.e.buffer_bytes {
            invalid!(
                "the buffer is too small: gathering block-scaled B [{n}, {k}] of {} with {tp} scale slots of {scale_bytes} bytes needs {need} bytes, the buffer has {} ([{}, {}])",
                dt.name(),
                self.e.buffer_bytes,
                self.e.rows,
                self.e.cols
            );
        }
        let scales = AgScales {
            local: full.b_scale_inv,
            base,
            slot,
            bytes: scale_bytes,
            out,
        };
        // The gathered GEMM: its B the buffer, its scales the slots (each chunk's GEMM
        // takes its own slot's). Run whole only by NVTE_COMM_REPORT's GEMM-alone timing,
        // into scratch: the slots span at least the gathered layout's bytes (tp slots of
        // [k/128, pad4(n/tp)] or [ceil(n/tp/128), ..] against [k/128, pad4(n)] or
        // [ceil(n/128), ..]), so it reads in bounds; its values only time it.
        full.n = n;
        full.b = self.buffer();
        full.b_scale_inv = self.buffer() + base;
        Ok(AgShape {
            k,
            nc,
            is_view: false,
            local_src: shard.ptr,
            full,
            pieces: 1,
            k_slices: false,
            tiles: Tiles::Rule,
            amax_slots: DevPtr::NULL,
            scales: Some(scales),
        })
    }

    /// `B_copy` of the all-gather: [n, k] of the buffer's type, with data.
    fn check_b_copy_data(&self, c: &Tensor, n: usize, k: usize) -> Result<()> {
        let cb = &c.data;
        if cb.dtype != self.dtype() || cb.numel() != n * k || cb.ptr.is_null() {
            invalid!(
                "tensor `B_copy` must be [{n}, {k}] of {} with data, got {} of {}",
                self.dtype().name(),
                cb.shape,
                cb.dtype.name()
            );
        }
        Ok(())
    }

    /// B_copy of chunk c's rows [lo, hi), on `lane`; block-scaled B's whole chunk brings
    /// its scales (from its slot in the buffer) into B_copy's.
    fn ag_copy_out(
        &mut self,
        x: &AgArgs,
        sh: &AgShape,
        c: usize,
        (lo, hi): (usize, usize),
        lane: Lane,
    ) {
        if let Some(bc) = x.b_copy {
            let e = eb(self.dtype());
            let at = c * sh.chunk_bytes(e) + lo * sh.k * e;
            self.copy(
                bc.data.ptr + at,
                self.buffer() + at,
                (hi - lo) * sh.k * e,
                lane,
            );
        }
        if let Some((sc, o)) = sh.scales.and_then(|sc| sc.out.map(|o| (sc, o))) {
            let src = self.buffer() + sc.at(c);
            self.copy_scales_out(o, c, src, lane);
        }
    }

    /// Chunk c's scales (at `src`, as in its slot) into B_copy's.
    fn copy_scales_out(&mut self, o: ScaleOut, c: usize, src: DevPtr, lane: Lane) {
        self.copy_2d(
            o.dst + c * o.step,
            o.dpitch,
            src,
            o.spitch,
            o.width,
            o.height,
            lane,
        );
    }

    /// Comm streams: the rings; ev_chunk[c * pieces + j] marks piece j of chunk c landed,
    /// and so does flags[c * pieces + j] = 1 where `flags` are given (the fused
    /// all-gather). The first send of each ring reads the caller's shard directly when
    /// one was given.
    fn ag_rings(
        &mut self,
        x: &AgArgs,
        sh: &AgShape,
        ring: &AgRing,
        flags: Option<DevPtr>,
    ) -> Result<()> {
        for step in arrival_steps(ring) {
            for j in 0..sh.pieces {
                self.ag_ring_piece(x, sh, ring, step, j, flags)?;
            }
        }
        Ok(())
    }

    /// Piece `j` of step `s` of ring direction `dir` (0 forward, 1 backward): its exchange, then (on the same comm
    /// stream) its copy into B_copy, its event and its flag.
    fn ag_ring_piece(
        &mut self,
        x: &AgArgs,
        sh: &AgShape,
        ring: &AgRing,
        (dir, s): (usize, usize),
        j: usize,
        flags: Option<DevPtr>,
    ) -> Result<()> {
        let e = eb(self.dtype());
        let (k, pieces) = (sh.k, sh.pieces);
        let off = |c: usize| c * sh.chunk_bytes(e);
        let (t, slot) = if dir == 0 {
            (&ring.forward[s], self.e.slots.ag_forward)
        } else {
            (&ring.backward[s], self.e.slots.ag_backward)
        };
        // Exchanges that must not run on two streams at once share comm stream 0.
        let st = if self.e.caps.concurrent_exchange {
            Lane::Comm(dir)
        } else {
            Lane::Comm(0)
        };
        // Our chunk at s = 0 (from the shard), else the one received at step s-1.
        let (c, rc) = (t.send, t.recv);
        let src = if s == 0 {
            sh.local_src
        } else {
            self.buffer() + off(c)
        };
        let (lo, hi) = sh.rows(j);
        let (send, recv) = if sh.k_slices {
            // K slice j of the whole chunk: nc runs of its bytes, a row apart.
            let (c0, c1) = k_slice_bytes(k, e, pieces, j);
            let send = SendOp {
                rows: sh.nc,
                pitch: k * e,
                ..SendOp::contiguous(t.to, src + c0, off(c) + c0, c1 - c0)
            };
            let recv = RecvOp {
                rows: sh.nc,
                pitch: k * e,
                ..RecvOp::contiguous(t.from, off(rc) + c0, c1 - c0)
            };
            (send, recv)
        } else {
            let bytes = (hi - lo) * k * e;
            (
                SendOp::contiguous(t.to, src + lo * k * e, off(c) + lo * k * e, bytes),
                RecvOp::contiguous(t.from, off(rc) + lo * k * e, bytes),
            )
        };
        self.step(|| {
            format!(
                "ring {dir} step {}: chunk {c} to rank {}, chunk {rc} from rank {} (piece {} of {pieces})",
                s + 1,
                t.to,
                t.from,
                j + 1
            )
        });
        let info = WaitInfo {
            op: Op::SplitAg as u32,
            step: (s + 1) as u32,
        };
        // Block scales: chunk c's slot behind its data (from the shard's own
        // scales at s = 0), in the same step.
        let then = sh.scales.map(|sc| {
            let from = if s == 0 {
                sc.local
            } else {
                self.buffer() + sc.at(c)
            };
            (
                SendOp::contiguous(t.to, from, sc.at(c), sc.bytes),
                RecvOp::contiguous(t.from, sc.at(rc), sc.bytes),
            )
        });
        let key = (slot, tag(s * pieces + j));
        self.exchange_part(send, recv, then, key, st, info, Part::Whole)?;
        if !sh.k_slices {
            self.ag_copy_out(x, sh, rc, (lo, hi), st);
        }
        self.record(rc * pieces + j, st);
        if let Some(f) = flags {
            self.write_flag(f + 4 * (rc * pieces + j), 1, st);
        }
        if sh.k_slices && j + 1 == pieces {
            // (after the last slice's flag: our GEMM does not read B_copy, and
            // the chunk's copy would delay the last block's tail)
            self.ag_copy_out(x, sh, rc, (0, sh.nc), st);
        }
        Ok(())
    }

    /// Off the critical path, on comm stream 1 after its ring: the shard into the
    /// buffer's local chunk (the buffer holds all of B after the call), and B_copy.
    /// (At tp 1 there is no ring: comm stream 0 copies, and no other stream is forked.)
    /// Returns the copy left to the local chunk's GEMM (`beside_gemm`, inline, the
    /// shard's copy alone: one launch with the GEMM where our kernel computes it), else
    /// none.
    fn ag_local_copies(
        &mut self,
        x: &AgArgs,
        sh: &AgShape,
        ring: &AgRing,
        beside_gemm: bool,
    ) -> SideCopy {
        let r = self.tp_rank();
        let cb = sh.chunk_bytes(eb(self.dtype()));
        let mine = self.buffer() + r * cb;
        if self.e.inline {
            // Inline (tp 1): the shard into the buffer and into B_copy by one copy kernel
            // on the caller's stream (a launch costs the host less than a device-to-device
            // cuMemcpyAsync), or the shard's copy alone beside the GEMM.
            if beside_gemm && !sh.is_view && x.b_copy.is_none() && sh.scales.is_none() {
                return SideCopy {
                    dst: mine,
                    src: x.g.b.data.ptr,
                    bytes: cb,
                };
            }
            let mut segs: crate::host::Small<(DevPtr, DevPtr, usize), 3> = Default::default();
            if !sh.is_view {
                segs.push((mine, x.g.b.data.ptr, cb));
            }
            if let Some(sc) = sh.scales {
                segs.push((self.buffer() + sc.at(r), sc.local, sc.bytes));
            }
            if let Some(bc) = x.b_copy {
                segs.push((bc.data.ptr + r * cb, sh.local_src, cb));
            }
            self.copy_segments(&segs, Lane::Caller, true);
            if let Some((sc, o)) = sh.scales.and_then(|sc| sc.out.map(|o| (sc, o))) {
                self.copy_scales_out(o, r, sc.local, Lane::Caller);
            }
            return SideCopy::default();
        }
        let c1 = if ring.forward.is_empty() && ring.backward.is_empty() {
            Lane::Comm(0)
        } else {
            Lane::Comm(1)
        };
        if !sh.is_view {
            self.copy(mine, x.g.b.data.ptr, cb, c1);
        }
        if let Some(sc) = sh.scales {
            // (the buffer holds every chunk's scales after the call, this rank's too)
            self.copy(self.buffer() + sc.at(r), sc.local, sc.bytes, c1);
        }
        self.ag_copy_out(x, sh, r, (0, sh.nc), c1);
        SideCopy::default()
    }

    /// The ring all-gather's work in the order it is issued: the local chunk's GEMM (its
    /// chunk is in place already), then each piece of each ring step followed by its
    /// GEMM, then the local copies. Issued so, the work also overlaps where
    /// every stream shares one hardware queue (`CUDA_DEVICE_MAX_CONNECTIONS=1`, TE's and
    /// Megatron's setting), which runs it in issue order and holds its head at a stream
    /// wait: a chunk's GEMM goes once its step landed, and the next step runs beside it.
    /// With the whole ring issued first, no GEMM started before the last step had landed
    /// (the protocol simulator's one-queue mode); with each step one chunk ahead, a GEMM
    /// waited for the next chunk's step too. Returns the GEMMs issued (each its own amax
    /// slot).
    fn ag_ring_and_gemms(&mut self, x: &AgArgs, sh: &AgShape, ring: &AgRing) -> Result<usize> {
        let mut gemms = 0;
        if self.e.inline {
            // (tp 1: no ring; the shard's copy may go beside the GEMM)
            let side = self.ag_local_copies(x, sh, ring, true);
            self.ag_chunk_gemms(x, sh, ring, 0, side, &mut gemms);
            return Ok(gemms);
        }
        self.ag_chunk_gemms(x, sh, ring, 0, SideCopy::default(), &mut gemms);
        let steps = arrival_steps(ring);
        debug_assert!(steps.iter().enumerate().all(|(i, &(d, s))| {
            let t = if d == 0 {
                &ring.forward[s]
            } else {
                &ring.backward[s]
            };
            t.recv == ring.order[i + 1]
        }));
        let none = SideCopy::default();
        for (i, &step) in steps.iter().enumerate() {
            // Each row piece's GEMM right after its exchange (K slices: the chunk's GEMM
            // after its last slice)
            for jp in 0..sh.pieces {
                self.ag_ring_piece(x, sh, ring, step, jp, None)?;
                if !sh.k_slices {
                    self.ag_piece_gemm(x, sh, ring, (i + 1, jp), none, &mut gemms);
                }
            }
            if sh.k_slices {
                self.ag_chunk_gemms(x, sh, ring, i + 1, none, &mut gemms);
            }
        }
        self.ag_local_copies(x, sh, ring, false);
        Ok(gemms)
    }

    /// The GEMMs of the `j`-th chunk in arrival order (`ring.order[j]`, the local one
    /// first): the local chunk in one GEMM, a remote one piece by piece (K slices: whole,
    /// after the chunk's last slice). `side`: a copy for the local chunk's GEMM (see
    /// ag_local_copies). Counts the GEMMs in `gemms` (each its own amax slot).
    fn ag_chunk_gemms(
        &mut self,
        x: &AgArgs,
        sh: &AgShape,
        ring: &AgRing,
        j: usize,
        side: SideCopy,
        gemms: &mut usize,
    ) {
        for q in 0..self.ag_gemm_parts(sh, ring, j) {
            self.ag_piece_gemm(x, sh, ring, (j, q), side, gemms);
        }
    }

    /// How many GEMMs the `j`-th chunk in arrival order takes (see ag_chunk_gemms).
    fn ag_gemm_parts(&self, sh: &AgShape, ring: &AgRing, j: usize) -> usize {
        if ring.order[j] == self.tp_rank() || sh.k_slices {
            1
        } else {
            sh.pieces
        }
    }

    /// GEMM `q` of the `j`-th chunk in arrival order, on compute stream j mod the stream
    /// count, after its piece's event where the chunk is remote (see ag_chunk_gemms).
    fn ag_piece_gemm(
        &mut self,
        x: &AgArgs,
        sh: &AgShape,
        ring: &AgRing,
        (j, q): (usize, usize),
        side: SideCopy,
        gemms: &mut usize,
    ) {
        let (tp, r) = (self.tp(), self.tp_rank());
        let (full, nc, k, pieces) = (&sh.full, sh.nc, sh.k, sh.pieces);
        debug_assert_eq!(ring.order.len(), tp);
        let c = ring.order[j];
        let (eb_d, eb_b) = (eb(full.d_type), eb(self.dtype()));
        let si = j % self.e.compute_streams;
        let parts = self.ag_gemm_parts(sh, ring, j);
        let (lo, hi) = if parts == 1 { (0, nc) } else { sh.rows(q) };
        let mut g = *full;
        g.n = hi - lo;
        if c == r {
            g.b = sh.local_src;
        } else {
            let last = if sh.k_slices { pieces - 1 } else { q };
            self.wait_event(c * pieces + last, Lane::Compute(si));
            g.b = full.b + (c * nc + lo) * k * eb_b;
        }
        if x.g.transb {
            g.ldb = nc; // each shard [k, nc] is its own matrix (pieces: 1)
        }
        if let Some(sc) = sh.scales {
            // (pieces: 1) the chunk's own scales: the shard's, or its slot's
            g.b_scale_inv = if c == r {
                sc.local
            } else {
                self.buffer() + sc.at(c)
            };
        }
        g.d = full.d + (c * nc + lo) * full.ldd * eb_d;
        if !full.aux.is_null() {
            g.aux = full.aux + (c * nc + lo) * full.ldd * eb(full.aux_type);
        }
        if full.epilogue == Epilogue::BGradB {
            g.bias = full.bias + c * nc * eb(full.bias_type); // pieces: 1
        }
        if !sh.amax_slots.is_null() {
            g.d_amax = sh.amax_slots + 4 * *gemms;
        }
        *gemms += 1;
        self.step(|| format!("GEMM chunk {c} rows {lo}..{hi} ({} of {tp})", j + 1));
        let side = if c == r { side } else { SideCopy::default() };
        self.gemm_copying(&g, si, true, side);
    }
}

/// The ring's steps as (direction, step), in the order their chunks arrive
/// (`ring.order[1..]`: forward and backward alternating).
fn arrival_steps(ring: &AgRing) -> Vec<(usize, usize)> {
    let (f, b) = (ring.forward.len(), ring.backward.len());
    let mut v = Vec::with_capacity(f + b);
    for s in 0..f.max(b) {
        if s < f {
            v.push((0, s));
        }
        if s < b {
            v.push((1, s));
        }
    }
    v
}

/// Pieces per chunk of the fused all-gather: at most `pieces`, dividing the chunk's `nc`
/// rows (one flag per piece, `nc / pieces` rows each), every piece of every chunk its own
/// flag and event, and one event left for the flags' clearing.
fn fused_pieces(pieces: usize, nc: usize, tp: usize, events: usize) -> usize {
    let most = MAX_FLAGS.min(events.saturating_sub(1));
    let mut p = pieces.max(1);
    while p > 1 && (!nc.is_multiple_of(p) || tp * p > most) {
        p -= 1;
    }
    p
}

impl Planner<'_> {
    /// The fused all-gather + GEMM [TE: ATOMIC_GEMM_AG_P2P]: the chunks of B travel the
    /// backward ring (rank r receives chunks r+1, r+2, ... in that order) exactly as the
    /// split all-gather's do, but where our own GEMM can compute the call, one launch of
    /// it computes all of D: its tile rows start at this rank's chunk and wait on a local
    /// arrival flag per piece, which the ring's stream writes after each piece has landed
    /// (after the transport's bounded wait: a peer that fails makes that wait time out
    /// and report, the flag is still written and the GEMM still ends). Elsewhere (our
    /// GEMM not loaded, or a GEMM it does not compute: the reason is the call's NVTX step)
    /// the same ring feeds cuBLASLt GEMMs per chunk. The protocol (ring, pieces) is the
    /// same on every rank whichever GEMM each one runs.
    /// ([`Algo::FusedAg`]: at most `pieces` pieces per chunk,
    /// K slices where `k_slices` asks and they can be, our GEMM in `tiles`.)
    pub(super) fn fused_ag(
        &mut self,
        x: &AgArgs,
        pieces: usize,
        k_slices: bool,
        tiles: Tiles,
    ) -> Result<()> {
        let mut sh = self.ag_shape(x, pieces)?;
        sh.tiles = tiles;
        let (tp, r) = (self.tp(), self.tp_rank());
        sh.pieces = fused_pieces(sh.pieces, sh.nc, tp, self.e.events);
        if tp * sh.pieces + 1 > self.e.events {
            unsupported!("the fused all-gather at tp = {tp} needs {} events", tp + 1);
        }
        // Pieces as K slices or as row slices: the same on every rank (each rank's puts land
        // in the others' buffers, and each forwards what it received), so chosen from what
        // the ranks share: the transport, the shape, the knob, and whether our GEMM takes
        // calls of this kind whatever the rank's m and pointers (m is this rank's share and
        // may differ between ranks; a rank whose own GEMM our kernel then refuses
        // multiplies each chunk whole after its last slice, as does a rank whose kernel
        // failed to load: `own_gemm_kind` is the device type's, not the load's). Part of
        // the cross-rank check's key.
        let kernel_takes_kind = self.e.own_gemm_kind.is_some_and(|f| f(&sh.full).is_none());
        // K slices: at least K_SLICES of them (the tuned count where larger), at most one a
        // K block and as many as the flags and events allow.
        let k_pieces = sh
            .pieces
            .max(K_SLICES)
            .min(k_blocks(sh.k, eb(self.dtype())))
            .min((self.e.events - 1) / tp)
            .min(MAX_FLAGS / tp);
        sh.k_slices = k_slices
            && self.e.caps.strided_exchange
            && kernel_takes_kind
            && sh.scales.is_none()
            && sh.amax_slots.is_null()
            && !x.g.transb
            && k_pieces > 1;
        if sh.k_slices {
            sh.pieces = k_pieces;
        }
        let full_key = sh.full.check_key();
        let mut key = [0u64; 6];
        key[..5].copy_from_slice(&full_key);
        if let Some(m) = x.key_m {
            key[0] = m as u64;
        }
        key[5] = sh.pieces as u64 | (sh.k_slices as u64) << 32;
        self.begin(Op::FusedAg, false, &key, Some(&sh.full));
        let ring = super::schedule::ag_ring_backward(tp, r);
        let mut gemms = 0;
        match self.own_gemm_refusal(x, &sh) {
            None => self.fused_ag_kernel(x, &sh, &ring)?,
            Some(why) => {
                self.step(|| format!("fused_ag: GEMMs per chunk on cuBLASLt ({why})"));
                gemms = self.ag_ring_and_gemms(x, &sh, &ring)?;
            }
        }
        self.finish();
        if !sh.amax_slots.is_null() {
            self.amax_max(sh.full.d_amax, sh.amax_slots, gemms);
        }
        Ok(())
    }

    /// The GEMM one launch of our own would compute (B: the gathered buffer, or at tp 1
    /// the shard itself), or why it cannot.
    fn own_gemm_refusal(&self, x: &AgArgs, sh: &AgShape) -> Option<&'static str> {
        let Some(f) = self.e.own_gemm else {
            return Some("our sm90 GEMM is not loaded: not an sm_90 device, or it failed to load");
        };
        if sh.scales.is_some() {
            return Some("block-scaled FP8 inputs (our GEMM takes no block scales)");
        }
        if !sh.amax_slots.is_null() {
            return Some("an FP8 output with amax");
        }
        let mut g = sh.full;
        if self.tp() == 1 && !sh.is_view {
            g.b = x.g.b.data.ptr;
        }
        f(&g)
    }

    /// SMs our GEMM may use while the call communicates: all but the comm SMs (at least
    /// one SM stays free: the transport's waits and SM puts are kernels, which a GEMM
    /// holding every SM while it waits for their flags would starve). Where copy engines
    /// move the bytes (CE puts into peer memory on other devices) and the call copies
    /// nothing within this device meanwhile (`local_copies` false: such a copy is a
    /// kernel too), only the transport's one-CTA flag kernels need SMs: `CE_RESERVE` stay
    /// free instead of num_comm_sm. 0: all (tp 1).
    pub(super) fn fused_sms(&self, local_copies: bool) -> usize {
        if self.tp() == 1 {
            return 0;
        }
        self.fused_budget(self.e.caps.remote_peers && !local_copies)
    }

    /// [`Self::fused_sms`] as every rank computes it alike (from the policy and the
    /// device's SM count only; `caps.remote_peers` may differ between ranks that share
    /// devices): for choices all ranks must make the same, such as the fused
    /// reduce-scatter's pieces (at tp > 1: its only caller leaves tp 1 alone). Equal to
    /// `fused_sms(false)` wherever the ranks' peers are on other devices.
    pub(super) fn fused_sms_shared(&self) -> usize {
        self.fused_budget(true)
    }

    /// The SMs left beside the transport's kernels: all but `CE_RESERVE` where copy
    /// engines move the bytes (`ce_only`, with `use_ce`), else all but num_comm_sm.
    fn fused_budget(&self, ce_only: bool) -> usize {
        /// SMs left to the flag kernels (32 threads, one CTA each; several fit on one SM)
        /// when copy engines move the data.
        const CE_RESERVE: i32 = 2;
        let c = &self.e.policy.comm;
        let reserve = if c.use_ce && ce_only {
            CE_RESERVE.min(c.sms.max(1))
        } else {
            c.sms.max(1)
        };
        let sm_count = self.e.sm_count;
        if sm_count > reserve {
            (sm_count - reserve) as usize
        } else {
            1
        }
    }

    /// [`Self::fused_ag`] with our GEMM: the ring writes the remote chunks' flags (after
    /// clearing them), compute stream 0 puts the local chunk in place, sets its flags,
    /// runs the GEMM, clears every flag again and copies the local chunk out.
    fn fused_ag_kernel(&mut self, x: &AgArgs, sh: &AgShape, ring: &AgRing) -> Result<()> {
        let (tp, r, pieces) = (self.tp(), self.tp_rank(), sh.pieces);
        let mut g = sh.full;
        if tp == 1 {
            if !sh.is_view {
                g.b = x.g.b.data.ptr;
            }
            self.step(|| "fused_ag: our sm90 GEMM".into());
            self.fused_gemm(&g, Hooks::default(), 0, 0);
            self.ag_local_copies(x, sh, ring, false);
            return Ok(());
        }
        let flags = self.flags()?;
        // The ring's lane (as ag_rings picks it for the backward ring) clears the remote
        // chunks' flags before it writes any (a call that failed before its GEMM ran may
        // have left some set), and the GEMM starts after that.
        let lane = if self.e.caps.concurrent_exchange {
            Lane::Comm(1)
        } else {
            Lane::Comm(0)
        };
        self.memset(flags, 4 * r * pieces, lane);
        self.memset(
            flags + 4 * (r + 1) * pieces,
            4 * (tp - r - 1) * pieces,
            lane,
        );
        let ev_clear = self.e.events - 1;
        self.record(ev_clear, lane);
        let c0 = Lane::Compute(0);
        let cb = sh.chunk_bytes(eb(self.dtype()));
        // After the arrival barrier (ev_clear follows it): a peer may still read this
        // rank's buffer for its previous call (a reduce-scatter's or all-reduce's
        // partials) until every rank arrived at this one.
        self.wait_event(ev_clear, c0);
        if !sh.is_view {
            self.copy(self.buffer() + r * cb, x.g.b.data.ptr, cb, c0);
        }
        for j in 0..pieces {
            self.write_flag(flags + 4 * (r * pieces + j), 1, c0);
        }
        let hooks = Hooks {
            flags,
            rows_per_flag: if sh.k_slices { sh.nc } else { sh.nc / pieces },
            k_pieces: if sh.k_slices { pieces } else { 0 },
            flag_value: 1,
            n_tile_rot: r * sh.nc / TILE_ROWS,
            narrow: sh.tiles == Tiles::Narrow,
            ..Default::default()
        };
        // (B_copy: each row piece is copied out of the buffer between its arrival and its
        // flag; with K slices the whole chunk after its last slice's flag)
        let sms = self.fused_sms(x.b_copy.is_some());
        self.step(|| {
            let kind = if sh.k_slices {
                "K slices"
            } else {
                "row pieces"
            };
            format!("fused_ag: our sm90 GEMM on {sms} SMs, {tp} chunks ({pieces} {kind} each)")
        });
        self.fused_gemm(&g, hooks, sms, 0);
        // The ring after the GEMM that waits for its flags: with one hardware queue
        // (CUDA_DEVICE_MAX_CONNECTIONS=1) the GEMM then starts on the local chunk at once;
        // issued behind the whole ring, it started after the last step had landed.
        self.ag_rings(x, sh, ring, Some(flags))?;
        // Every flag back to zero: the next call (or graph replay) starts from zero.
        self.memset(flags, 4 * tp * pieces, c0);
        self.ag_copy_out(x, sh, r, (0, sh.nc), c0);
        Ok(())
    }
}

/// The block all-gather's D and pre_gelu_out (the DGELU epilogue's input) are [n, m]: the
/// gathered rows, every chunk's GEMM reading its own rows of each.
fn block_outputs_gathered(g: &TeGemm, n: usize, m: usize) -> Result<()> {
    if g.d.data.rows_cols() != Some((n, m)) {
        invalid!(
            "tensor `D` has shape {} but must be [n, m] with n = {n} (the gathered rows)",
            g.d.data.shape
        );
    }
    if let Some(p) = g.pre_gelu_out
        && p.data.rows_cols() != Some((n, m))
    {
        invalid!(
            "tensor `pre_gelu_out` has shape {} but must be [n, m] = [{n}, {m}], like D (every chunk's GEMM reads its rows)",
            p.data.shape
        );
    }
    Ok(())
}
