//! The steps of a comm-GEMM call, written once against [`CallBackend`]: the context's
//! engines and the caller's stream on the GPU (`super::CommGemmCtx`), a host fake in the
//! protocol tests (`crate::overlap::protocol`). Each call: its engine (sized by the call),
//! the engine's configuration, the argument checks that follow them, the scratch buffers
//! of a padded call, then the work: padding copies on the caller's stream, the engine's
//! algorithm, and the copies out of the padding.
use super::{GemmCall, Kind, expect_shape, numroc, rebased};
use crate::cuda::DevPtr;
use crate::error::Result;
use crate::gemm::{Operands, TeGemm};
use crate::overlap::{ag::AgArgs, ar::ArArgs, rs::RsArgs};
use crate::tensor::{DType, Tensor};
use crate::{invalid, unsupported};

/// What a comm-GEMM call runs on.
pub(crate) trait CallBackend {
    /// Ranks, this rank, and whether calls are their GEMM alone (one rank, `direct`).
    fn ranks(&self) -> (usize, usize);
    fn direct(&self) -> bool;
    /// NVTE_COMM_GEMM_FP8_FAST_ACCUM at the context's creation.
    fn fast_accum(&self) -> bool;
    /// `prepare`: make engines and buffers, enqueue nothing.
    fn preparing(&self) -> bool;
    /// The one-rank call: GEMM `g` after `copies` (dst, src, bytes each); `dtype` and
    /// `bytes` size the warm-up rule as an engine would be sized.
    fn direct_call(
        &mut self,
        c: &GemmCall,
        dtype: DType,
        bytes: usize,
        g: &TeGemm,
        copies: &[(DevPtr, DevPtr, usize)],
    ) -> Result<()>;
    /// The engine of buffer type `dtype` with at least `bytes` (made or grown here).
    fn engine(&mut self, kind: Kind, dtype: DType, bytes: usize) -> Result<EngineId>;
    /// Configure engine `eng` for `c` (the tuning's choice); whether a reduce-scatter
    /// runs the ring (else pipelined).
    fn configure(&mut self, eng: EngineId, c: &GemmCall) -> Result<bool>;
    /// Scratch buffer `slot` of at least `bytes`.
    fn scratch(&mut self, slot: usize, bytes: usize) -> Result<DevPtr>;
    /// On the caller's stream.
    fn memset(&mut self, dst: DevPtr, bytes: usize) -> Result<()>;
    fn copy(&mut self, dst: DevPtr, src: DevPtr, bytes: usize) -> Result<()>;
    #[allow(clippy::too_many_arguments)]
    fn copy_2d(
        &mut self,
        dst: DevPtr,
        dpitch: usize,
        src: DevPtr,
        spitch: usize,
        width: usize,
        height: usize,
    ) -> Result<()>;
    /// The engine's algorithms on the caller's stream.
    fn split_ag(&mut self, eng: EngineId, x: &AgArgs) -> Result<()>;
    fn split_rs(&mut self, eng: EngineId, x: &RsArgs, ring: bool) -> Result<()>;
    fn split_ar(&mut self, eng: EngineId, x: &ArArgs) -> Result<()>;
}

/// An engine of a comm-GEMM context: its place in the context's engine table, handed out
/// by [`CallBackend::engine`] for the call that asked (a later call may re-create the
/// table's engines), never a number computed elsewhere.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EngineId(usize);

impl EngineId {
    /// The engine at `index` of the context's table (the backends' own).
    pub(super) fn new(index: usize) -> EngineId {
        EngineId(index)
    }
    /// Its index in the context's table.
    pub(super) fn index(self) -> usize {
        self.0
    }
}

/// Element bytes.
fn eb(d: DType) -> usize {
    d.bits() / 8
}

/// Whether either GEMM input is block-scaled (NVTE_BLOCK_SCALING_1D / 2D).
pub(crate) fn is_block(c: &GemmCall) -> bool {
    [c.a.scaling_mode, c.b.scaling_mode]
        .iter()
        .any(|&m| crate::tensor::BlockMode::from_scaling_mode(m).is_some())
}

/// Block-scaled FP8 inputs (NVTE_BLOCK_SCALING_1D / 2D), checked before anything is
/// made (and, under NVTE_COMM_CHECK, before the ranks agree: every rank's verdict is
/// part of the agreement): at one rank (`direct`) every operation is its block-scaled
/// GEMM; at more ranks the reduce-scatter and all-reduce run the engine's block-aware
/// algorithms (whole 128-row tiles of a 2D-scaled A per chunk, else the GEMM whole, then
/// the collective), with n divisible by the ranks for the reduce-scatter (B's block
/// scales cannot be padded); the all-gather gathers each rank's B shard [n/tp, k] with
/// its scales (n divisible by the ranks, transb = false; a b_gathered gets the gathered
/// data and scales, n/tp whole 128-row tiles with 2D scales). D is never FP8: block-scaled
/// GEMMs write 16- or 32-bit outputs (TE's too), at any number of ranks alike.
pub(crate) fn check_block(c: &GemmCall, nranks: usize, direct: bool) -> Result<()> {
    if !is_block(c) {
        return Ok(());
    }
    if c.d.data.dtype.is_fp8() {
        unsupported!(
            "{} with block-scaled FP8 inputs writes D as kNVTEBFloat16, kNVTEFloat16 or kNVTEFloat32 (block-scaled GEMMs write no FP8 output, as TE's); D is {}: quantize D after the call",
            c.kind.api_name(),
            c.d.data.dtype.name()
        );
    }
    if direct {
        return Ok(());
    }
    let divisible = c.n % nranks as i64 == 0;
    match c.kind {
        Kind::AllGather if !divisible => unsupported!(
            "nvte_all_gather_gemm with block-scaled FP8 inputs needs n = {} divisible by nranks = {nranks} (every rank's B shard is gathered with its own block scales, which cannot be padded)",
            c.n
        ),
        Kind::AllGather if c.transb => unsupported!(
            "nvte_all_gather_gemm with block-scaled FP8 inputs needs transb = false: B's rowwise data [n/nranks, k] and its scales are gathered along its rows"
        ),
        Kind::AllGather
            if nranks > 1
                && c.b_gathered.is_some()
                && c.b.block_mode() == Some(crate::tensor::BlockMode::TwoD)
                && (c.n / nranks as i64) % 128 != 0 =>
        {
            unsupported!(
                "b_gathered of 2D-scaled B needs each rank's rows n/nranks = {} in whole 128-row tiles (b_gathered's scales are the tiles of all of B)",
                c.n / nranks as i64
            )
        }
        Kind::ReduceScatter if !divisible => unsupported!(
            "nvte_gemm_reduce_scatter with block-scaled FP8 inputs needs n = {} divisible by nranks = {nranks} (B's block scales cannot be padded)",
            c.n
        ),
        _ => Ok(()),
    }
}

/// The block-scaled GEMM this rank runs (the whole one at one rank; its all-gather
/// chunk, or its partial over its share of k at more), checked as the GEMM checks it
/// (data, scales and their layouts, alignment, epilogue) with no device call: so that a
/// bad operand fails on its rank before any rank waits for it (NVTE_COMM_CHECK agrees on
/// this verdict). `c`'s shapes were checked already.
pub(crate) fn check_block_operands(
    c: &GemmCall,
    (nranks, rank): (usize, usize),
    direct: bool,
) -> Result<()> {
    if !is_block(c) {
        return Ok(());
    }
    let (m, n) = (c.m as usize, c.n as usize);
    let share = |g: usize| numroc(g as i64, nranks, rank) as usize;
    // D (and pre_act_out) of the GEMM this rank runs: [rows, cols] at D's address.
    let (rows, cols) = match c.kind {
        _ if direct => (n, m),
        Kind::AllGather => (share(n), share(m)),
        Kind::ReduceScatter | Kind::AllReduce => (n, m),
    };
    let d = rebased(c.d, c.d.data.ptr, &[rows, cols])?;
    let aux = match c.pre_act_out {
        Some(p) if direct || c.kind == Kind::AllGather => {
            Some(rebased(p, p.data.ptr, &[rows, cols])?)
        }
        _ => None,
    };
    let none = Tensor::default();
    let g = TeGemm {
        bias: c.bias,
        pre_gelu_out: aux.as_ref(),
        grad: c.grad && (direct || c.kind == Kind::AllGather),
        accumulate: c.accumulate,
        workspace: None,
        ..c.operands(c.b, &d, &none, false)
    };
    crate::gemm::block::check_block(&g)
}

/// The call `c` (its operands checked already) with workspace `ws`.
pub(crate) fn run<B: CallBackend>(b: &mut B, c: &GemmCall, ws: &Tensor) -> Result<()> {
    let (nr, r) = b.ranks();
    check_block(c, nr, b.direct())?;
    check_block_operands(c, (nr, r), b.direct())?;
    match c.kind {
        Kind::AllGather => all_gather(b, c, ws),
        Kind::ReduceScatter | Kind::AllReduce => reduction(b, c, ws),
    }
}

/// The all-gather GEMM: m and n split, B gathered along n.
fn all_gather<B: CallBackend>(b: &mut B, c: &GemmCall, ws: &Tensor) -> Result<()> {
    let (n, k) = (c.n as usize, c.k as usize);
    let (nr, r) = b.ranks();
    let ml = numroc(c.m, nr, r) as usize;
    let bn = n.div_ceil(nr);
    let dt = c.b.data.dtype;
    let e = eb(dt);
    let aux = c.pre_act_out;
    let g = TeGemm {
        bias: c.bias,
        pre_gelu_out: aux,
        grad: c.grad,
        accumulate: c.accumulate,
        ..c.operands(c.b, c.d, ws, b.fast_accum())
    };
    if b.direct() {
        if let Some(p) = aux {
            expect_shape(p, "pre_act_out", [n, ml], "like D")?;
        }
        // b_gathered is B itself: its data, and with block-scaled B its scales (of the
        // same shape, checked) too.
        let mut copies = crate::host::Small::<(DevPtr, DevPtr, usize), 2>::default();
        if let Some(bg) = c.b_gathered {
            copies.push((bg.data.ptr, c.b.data.ptr, n * k * e));
            if is_block(c) {
                copies.push((bg.scale_inv.ptr, c.b.scale_inv.ptr, c.b.scale_inv.bytes()));
            }
        }
        return b.direct_call(c, dt, bn * nr * k * e, &g, &copies);
    }
    // Block-scaled B: every rank's scales in a slot of their own behind the data.
    let bytes = if is_block(c) {
        let scales = c.b.scale_inv.bytes();
        crate::overlap::ag::ag_block_layout(bn * nr * k * e, scales, nr).2
    } else {
        bn * nr * k * e
    };
    let eng = b.engine(c.kind, dt, bytes)?;
    if let Some(p) = aux {
        expect_shape(p, "pre_act_out", [n, ml], "like D")?;
    }
    b.configure(eng, c)?;
    let padded = bn * nr != n || bn != numroc(c.n, nr, r) as usize;
    if !padded {
        if b.preparing() {
            return Ok(());
        }
        let args = AgArgs {
            g,
            b_copy: c.b_gathered,
            key_m: Some(c.m as usize),
        };
        return b.split_ag(eng, &args);
    }
    all_gather_padded(b, c, ws, eng)
}

/// The all-gather when n is not divisible by the ranks: this rank's B share padded to a
/// full block, gathered, and D's first n rows kept.
fn all_gather_padded<B: CallBackend>(
    b: &mut B,
    c: &GemmCall,
    ws: &Tensor,
    eng: EngineId,
) -> Result<()> {
    let (n, k) = (c.n as usize, c.k as usize);
    let (nr, r) = b.ranks();
    let (ml, nl) = (numroc(c.m, nr, r) as usize, numroc(c.n, nr, r) as usize);
    let bn = n.div_ceil(nr);
    let e = eb(c.b.data.dtype);
    let aux = c.pre_act_out;
    if c.grad || c.accumulate {
        unsupported!("grad / accumulate with n = {n} not divisible by nranks = {nr}");
    }
    if c.d.data.dtype.is_fp8() && c.bias.is_some() {
        unsupported!(
            "an FP8 output with bias when n = {n} is not divisible by nranks = {nr}: the padding rows would count in D's amax"
        );
    }
    // Every scratch buffer first, then the work.
    let de = eb(c.d.data.dtype);
    let b_pad = b.scratch(0, bn * k * e)?;
    let d_pad = b.scratch(1, bn * nr * ml * de)?;
    let ap = match aux {
        Some(p) => {
            let ptr = b.scratch(2, bn * nr * ml * eb(p.data.dtype))?;
            Some(rebased(p, ptr, &[bn * nr, ml])?)
        }
        None => None,
    };
    // The gathered B of the padded rows: block distribution puts every valid row before
    // the padding, so its first n rows are B gathered.
    let bg = match c.b_gathered {
        Some(g) => {
            let ptr = b.scratch(3, bn * nr * k * e)?;
            Some((g, rebased(g, ptr, &[bn * nr, k])?))
        }
        None => None,
    };
    if b.preparing() {
        return Ok(());
    }
    b.memset(b_pad, bn * k * e)?;
    if c.transb {
        b.copy_2d(b_pad, bn * e, c.b.data.ptr, nl * e, nl * e, k)?;
    } else {
        b.copy(b_pad, c.b.data.ptr, nl * k * e)?;
    }
    let bp = rebased(c.b, b_pad, &if c.transb { [k, bn] } else { [bn, k] })?;
    let dp = rebased(c.d, d_pad, &[bn * nr, ml])?;
    let args = AgArgs {
        g: TeGemm {
            bias: c.bias,
            pre_gelu_out: ap.as_ref(),
            ..c.operands(&bp, &dp, ws, b.fast_accum())
        },
        b_copy: bg.as_ref().map(|(_, p)| p),
        key_m: Some(c.m as usize),
    };
    b.split_ag(eng, &args)?;
    b.copy(c.d.data.ptr, d_pad, n * ml * de)?;
    if let Some((g, p)) = &bg {
        b.copy(g.data.ptr, p.data.ptr, n * k * e)?;
    }
    if let (Some(p), Some(q)) = (aux, ap.as_ref()) {
        b.copy(p.data.ptr, q.data.ptr, n * ml * eb(p.data.dtype))?;
    }
    Ok(())
}

/// The checks of a reduce-scatter / all-reduce before anything is made: epilogues that
/// cannot apply to partial sums, the bias length, FP8 outputs. The bias to pass (rank
/// 0's partial adds it once).
fn check_reduction<'a>(c: &GemmCall<'a>, nr: usize, r: usize) -> Result<Option<&'a Tensor>> {
    let m = c.m as usize;
    if c.pre_act_out.is_some() && nr > 1 {
        unsupported!(
            "pre_act_out (GELU) cannot be applied before the reduction over k; compute the activation after the call"
        );
    }
    if c.grad && nr > 1 {
        unsupported!(
            "grad epilogues cannot be applied to partial sums before the reduction over k"
        );
    }
    if let Some(b) = c.bias
        && b.data.numel() != m
    {
        invalid!(
            "tensor `bias` has {} elements but must have m = {m}",
            b.data.numel()
        );
    }
    if c.d.data.dtype.is_fp8() && c.kind == Kind::AllReduce {
        unsupported!(
            "an FP8 output D of the all-reduce is not supported: use fp16, bf16 or fp32 (the reduce-scatter takes FP8 outputs)"
        );
    }
    Ok(if r == 0 { c.bias } else { None })
}

/// The refusal of accumulate = true by the reductions.
fn no_accumulate(c: &GemmCall) -> Result<()> {
    if c.accumulate {
        unsupported!(
            "{}",
            if c.kind == Kind::AllReduce {
                "accumulate = true with an all-reduce would add D to every rank's partial"
            } else {
                "accumulate = true is not supported by the reduce-scatter (it would add D to every rank's partial)"
            }
        );
    }
    Ok(())
}

/// The GEMM reduce-scatter and all-reduce: k split; D scattered along n, or whole on
/// every rank.
fn reduction<B: CallBackend>(b: &mut B, c: &GemmCall, ws: &Tensor) -> Result<()> {
    let (m, n) = (c.m as usize, c.n as usize);
    let (nr, r) = b.ranks();
    let bias = check_reduction(c, nr, r)?;
    let dt = c.d.data.dtype;
    let de = eb(dt);
    let bn = n.div_ceil(nr);
    // FP8 output: bf16 partials, summed in fp32 and scaled into D (with amax).
    let pdt = if dt.is_fp8() { DType::BF16 } else { dt };
    // (cuBLASLt writes FP8 outputs from FP8 inputs only: 16-bit inputs take the engine's
    // bf16 partials)
    // (block-scaled GEMMs write no FP8 output: `check_block` refused such a call)
    if b.direct() && (!dt.is_fp8() || c.a.data.dtype.is_fp8()) {
        no_accumulate(c)?;
        // One rank: nothing is reduced, so the GEMM's own epilogues apply as in
        // nvte_cublas_gemm (GELU with pre_act_out, the grad epilogues).
        if let Some(p) = c.pre_act_out {
            expect_shape(p, "pre_act_out", [n, m], "like D")?;
        }
        let g = TeGemm {
            bias,
            pre_gelu_out: c.pre_act_out,
            grad: c.grad,
            ..c.operands(c.b, c.d, ws, b.fast_accum())
        };
        let (bdt, bytes) = if c.kind == Kind::AllReduce {
            (dt, 2 * n * m * de)
        } else {
            (pdt, bn * nr * m * eb(pdt))
        };
        return b.direct_call(c, bdt, bytes, &g, &[]);
    }
    if c.pre_act_out.is_some() || c.grad {
        // (only the one-rank direct GEMM above applies them; the engine's partials would
        // silently drop them)
        unsupported!(
            "pre_act_out / grad epilogues of {} at one rank need the direct GEMM: not with NVTE_COMM_REPORT / NVTE_COMM_TRACE or an FP8 output from 16-bit inputs",
            c.kind.api_name()
        );
    }
    if c.kind == Kind::AllReduce {
        // Twice D: the ring all-reduce's partials and gathered rows.
        let eng = b.engine(c.kind, dt, 2 * n * m * de)?;
        b.configure(eng, c)?;
        if b.preparing() {
            return Ok(());
        }
        let args: ArArgs = TeGemm {
            bias,
            accumulate: c.accumulate,
            ..c.operands(c.b, c.d, ws, b.fast_accum())
        };
        return b.split_ar(eng, &args);
    }
    if dt.is_fp8() && c.bias.is_some() && (bn * nr != n || bn != numroc(c.n, nr, r) as usize) {
        unsupported!(
            "an FP8 output with bias when n = {n} is not divisible by nranks = {nr}: the padding rows would count in D's amax"
        );
    }
    let eng = b.engine(c.kind, pdt, bn * nr * m * eb(pdt))?;
    let ring = b.configure(eng, c)?;
    no_accumulate(c)?;
    reduce_scatter(b, c, ws, (eng, ring), bias)
}

/// The engine's reduce-scatter, n padded to a multiple of the ranks where needed (B's
/// rows padded with zeros, D's share copied out of the padded output).
fn reduce_scatter<B: CallBackend>(
    b: &mut B,
    c: &GemmCall,
    ws: &Tensor,
    (eng, ring): (EngineId, bool),
    bias: Option<&Tensor>,
) -> Result<()> {
    let (m, n) = (c.m as usize, c.n as usize);
    let (nr, r) = b.ranks();
    let (kl, nl) = (numroc(c.k, nr, r) as usize, numroc(c.n, nr, r) as usize);
    let bn = n.div_ceil(nr);
    let de = eb(c.d.data.dtype);
    let padded = bn * nr != n || bn != nl;
    let (bp, dp);
    let (b_use, d_use) = if padded {
        let be = eb(c.b.data.dtype);
        let b_pad = b.scratch(0, bn * nr * kl * be)?;
        let d_pad = b.scratch(1, bn * m * de)?;
        if b.preparing() {
            return Ok(());
        }
        b.memset(b_pad, bn * nr * kl * be)?;
        if c.transb {
            b.copy_2d(b_pad, bn * nr * be, c.b.data.ptr, n * be, n * be, kl)?;
        } else {
            b.copy(b_pad, c.b.data.ptr, n * kl * be)?;
        }
        let shape = if c.transb {
            [kl, bn * nr]
        } else {
            [bn * nr, kl]
        };
        bp = rebased(c.b, b_pad, &shape)?;
        dp = rebased(c.d, d_pad, &[bn, m])?;
        (&bp, &dp)
    } else {
        if b.preparing() {
            return Ok(());
        }
        (c.b, c.d)
    };
    let args = RsArgs {
        g: Operands {
            bias,
            ..c.operands(b_use, None, ws, b.fast_accum())
        },
        rs_output: d_use,
    };
    b.split_rs(eng, &args, ring)?;
    if padded {
        b.copy(c.d.data.ptr, d_use.data.ptr, nl * m * de)?;
    }
    Ok(())
}
