//! Host protocol tests of the comm-GEMM calls (tests only): `call::run`, the calls'
//! steps as the context runs them, over a host backend whose engines plan and enqueue
//! their algorithms as the overlap engine does, checked by the overlap engine's protocol
//! harness (`crate::overlap::protocol`): every rank's D and b_gathered against the global
//! product, each byte written once, at tp 1..8 (tp 1: the direct GEMM), n divisible and
//! padded, on both fake transport flavours.
use super::call::{CallBackend, EngineId};
use super::{GemmCall, Kind, numroc};
use crate::cuda::DevPtr;
use crate::error::Result;
use crate::gemm::TeGemm;
use crate::overlap::plan::Planner;
use crate::overlap::protocol::{
    CALLER, Cfg, Dev, Mem, Res, all, block_partials, buffers, expect_once, matmul_nt, new_log,
    rank_call, simulate, tensor, values,
};
use crate::overlap::{ag::AgArgs, ar::ArArgs, rs::RsArgs};
use crate::tensor::DType;
use crate::transport::fake::{Rec, SharedLog};
use std::collections::HashMap;

/// The comm-GEMM calls' host backend of one rank: engines sized as the context sizes them
/// (one group of buffers per engine size, shared by the ranks), the caller's stream's
/// copies and the engine calls into the group's log.
struct HostCall<'a> {
    tp: usize,
    rank: usize,
    cfg: Cfg,
    /// the reduce-scatter's configuration: ring (else pipelined)
    ring: bool,
    mem: &'a mut Mem,
    /// engine rows -> the group's buffers
    engines: &'a mut HashMap<usize, Vec<DevPtr>>,
    log: SharedLog<Dev>,
    /// the engine of the call (rows) and its element type
    rows: Option<usize>,
    dtype: DType,
}

/// The comm-GEMM context's engine columns.
const CG_COLS: usize = 256;

impl HostCall<'_> {
    fn push(&self, d: Dev) {
        self.log.lock().unwrap().ranks[self.rank].push((CALLER, Rec::Device(d)));
    }
    fn engine_call(&mut self, f: &mut dyn FnMut(&mut Planner) -> Result<()>) -> Result<()> {
        let rows = self.rows.expect("an engine was made");
        let bufs = self.engines[&rows].clone();
        let (tp, r) = (self.tp, self.rank);
        let cfg = self.cfg.with_dtype(self.dtype);
        rank_call((tp, r), (rows, CG_COLS), cfg, self.mem, &bufs, &self.log, f)
            .map_err(crate::error::Error::internal)
    }
}

impl CallBackend for HostCall<'_> {
    fn ranks(&self) -> (usize, usize) {
        (self.tp, self.rank)
    }
    fn direct(&self) -> bool {
        self.tp == 1
    }
    fn fast_accum(&self) -> bool {
        false
    }
    fn preparing(&self) -> bool {
        false
    }
    fn direct_call(
        &mut self,
        _c: &GemmCall,
        _dtype: DType,
        _bytes: usize,
        g: &TeGemm,
        copies: &[(DevPtr, DevPtr, usize)],
    ) -> Result<()> {
        // (block-scaled inputs: the block GEMM, as the context's `run_block`)
        let desc = crate::gemm::desc_from_te_block(g)?;
        for &(d, s, n) in copies {
            self.push(Dev::Copy(d, s, n));
        }
        self.push(Dev::Gemm(desc));
        Ok(())
    }
    fn engine(&mut self, _kind: Kind, dtype: DType, bytes: usize) -> Result<EngineId> {
        let e = dtype.bits() / 8;
        let rows = bytes.div_ceil(CG_COLS * e).div_ceil(self.tp).max(1) * self.tp;
        let tp = self.tp;
        let mem = &mut *self.mem;
        self.engines
            .entry(rows)
            .or_insert_with(|| buffers(mem, tp, rows * CG_COLS * e));
        self.rows = Some(rows);
        self.dtype = dtype;
        Ok(EngineId::new(0))
    }
    fn configure(&mut self, _eng: EngineId, _c: &GemmCall) -> Result<bool> {
        Ok(self.ring)
    }
    fn scratch(&mut self, slot: usize, bytes: usize) -> Result<DevPtr> {
        Ok(self
            .mem
            .alloc(&format!("scratch {slot} of rank {}", self.rank), bytes))
    }
    fn memset(&mut self, dst: DevPtr, bytes: usize) -> Result<()> {
        self.push(Dev::Memset(dst, bytes));
        Ok(())
    }
    fn copy(&mut self, dst: DevPtr, src: DevPtr, bytes: usize) -> Result<()> {
        self.push(Dev::Copy(dst, src, bytes));
        Ok(())
    }
    fn copy_2d(
        &mut self,
        dst: DevPtr,
        dpitch: usize,
        src: DevPtr,
        spitch: usize,
        width: usize,
        height: usize,
    ) -> Result<()> {
        self.push(Dev::Copy2d {
            dst,
            dpitch,
            src,
            spitch,
            width,
            height,
        });
        Ok(())
    }
    fn split_ag(&mut self, _eng: EngineId, x: &AgArgs) -> Result<()> {
        self.engine_call(&mut |p| p.split_ag(x))
    }
    fn split_rs(&mut self, _eng: EngineId, x: &RsArgs, ring: bool) -> Result<()> {
        self.engine_call(&mut |p| {
            if ring {
                p.split_rs_p2p(x)
            } else {
                p.split_rs(x)
            }
        })
    }
    fn split_ar(&mut self, _eng: EngineId, x: &ArArgs) -> Result<()> {
        self.engine_call(&mut |p| p.split_ar(x))
    }
}

/// A TN comm-GEMM call of `kind` (global m, n, k) of A `a` and B `b` into `d`, with no
/// bias, epilogue, accumulation, gathered B, tuning or SM margin (set those by struct
/// update).
fn tn_call<'a>(
    kind: Kind,
    (m, n, k): (usize, usize, usize),
    a: &'a crate::tensor::Tensor,
    b: &'a crate::tensor::Tensor,
    d: &'a crate::tensor::Tensor,
) -> GemmCall<'a> {
    GemmCall {
        kind,
        m: m as i64,
        n: n as i64,
        k: k as i64,
        a,
        b,
        d,
        bias: None,
        pre_act_out: None,
        transa: true,
        transb: false,
        grad: false,
        accumulate: false,
        comm_sm_count: 0,
        b_gathered: None,
        tune: false,
        atomic: false,
    }
}

/// Rank `r` of `tp` runs `call` (workspace `ws`) through `call::run` on the host backend
/// (`cfg`, the reduce-scatter `ring` or pipelined), its engines' buffers in `engines`,
/// its device work recorded in `log`.
fn run_rank(
    (tp, r): (usize, usize),
    (cfg, ring): (Cfg, bool),
    mem: &mut Mem,
    engines: &mut HashMap<usize, Vec<DevPtr>>,
    log: &SharedLog<Dev>,
    call: &GemmCall,
    ws: &crate::tensor::Tensor,
) -> Res {
    let mut host = HostCall {
        tp,
        rank: r,
        cfg,
        ring,
        mem,
        engines,
        log: log.clone(),
        rows: None,
        dtype: DType::F32,
    };
    super::call::run(&mut host, call, ws).map_err(|e| format!("rank {r}: {}", e.msg))
}

/// Replay the group's recorded device work (`log`) on `mem`, over the buffers of its
/// engine (the first made; none at tp 1's direct calls).
fn simulate_group(
    log: &SharedLog<Dev>,
    mem: &mut Mem,
    engines: &HashMap<usize, Vec<DevPtr>>,
) -> Res {
    let bufs = engines.values().next().cloned().unwrap_or_default();
    simulate(log, mem, &bufs)
}

/// Each rank's D (at its pointer) holds its expected values, written once.
fn expect_each_rank(mem: &Mem, outs: &[(DevPtr, Vec<f32>)]) -> Res {
    for (r, (pd, want)) in outs.iter().enumerate() {
        expect_once(mem, *pd, want, &format!("rank {r}: D"))?;
    }
    Ok(())
}

/// Rank r's shares of the global A [m, k] and B [n, k] (with their shapes) and its D's
/// shape: the all-gather splits m and n, the reductions split k.
#[allow(clippy::type_complexity)]
fn comm_gemm_shares(
    kind: Kind,
    (tp, r): (usize, usize),
    (m, n, k): (usize, usize, usize),
    (a, bg): (&[f32], &[f32]),
) -> ((Vec<f32>, [usize; 2]), (Vec<f32>, [usize; 2]), [usize; 2]) {
    let share = |g: usize| numroc(g as i64, tp, r) as usize;
    if kind == Kind::AllGather {
        let (m0, ml) = (r * m.div_ceil(tp), share(m));
        let (n0, nl) = (r * n.div_ceil(tp), share(n));
        let al = a[m0.min(m) * k..(m0 + ml).min(m) * k].to_vec();
        let bl = bg[n0.min(n) * k..(n0 + nl).min(n) * k].to_vec();
        return ((al, [ml, k]), (bl, [nl, k]), [n, ml]);
    }
    let (k0, kl) = ((r * k.div_ceil(tp)).min(k), share(k));
    let cols = |x: &[f32], rows: usize| -> Vec<f32> {
        (0..rows)
            .flat_map(|i| x[i * k + k0..i * k + k0 + kl].to_vec())
            .collect()
    };
    let dshape = if kind == Kind::AllReduce {
        [n, m]
    } else {
        [share(n), m]
    };
    ((cols(a, m), [m, kl]), (cols(bg, n), [n, kl]), dshape)
}

/// A comm-GEMM call of kind `kind` with global m, n, k at tp ranks (block distribution,
/// padded where n does not divide), with a bias or none: every rank's result checked
/// against the global product (plus the bias, added once).
fn check_comm_gemm(
    tp: usize,
    cfg: Cfg,
    (ring, with_bias): (bool, bool),
    kind: Kind,
    (m, n, k): (usize, usize, usize),
) -> Res {
    let mut mem = Mem::default();
    let mut engines = HashMap::new();
    let log = new_log(tp);
    // Global operands: A [m, k], B [n, k] (row-major, TN); D = B A^T [n, m].
    let a = values(500, m * k);
    let bg = values(600, n * k);
    let bias = values(800, m);
    let mut d_full = matmul_nt(&bg, &a, n, k, m);
    if with_bias {
        for (e, x) in d_full.iter_mut().enumerate() {
            *x += bias[e % m];
        }
    }
    let ws = tensor(mem.alloc("workspace", 4), &[1]);
    let mut outs = Vec::new();
    for r in 0..tp {
        let (al, bl, dshape) = comm_gemm_shares(kind, (tp, r), (m, n, k), (&a, &bg));
        let gathered =
            (kind == Kind::AllGather).then(|| mem.alloc(&format!("b_gathered{r}"), n * k * 4));
        let pa = mem.input(&format!("A{r}"), &al.0);
        let pb = mem.input(&format!("B{r}"), &bl.0);
        let pd = mem.alloc(&format!("D{r}"), dshape[0] * dshape[1] * 4);
        let (ta, tb, td) = (tensor(pa, &al.1), tensor(pb, &bl.1), tensor(pd, &dshape));
        let tg = gathered.map(|p| tensor(p, &[n, k]));
        // The bias of D's columns: this rank's m-share (all-gather), all of m (reductions).
        let bl = match kind {
            Kind::AllGather => {
                let m0 = (r * m.div_ceil(tp)).min(m);
                bias[m0..m0 + dshape[1]].to_vec()
            }
            _ => bias.clone(),
        };
        let tbias = tensor(mem.input(&format!("bias{r}"), &bl), &[bl.len()]);
        let call = GemmCall {
            bias: with_bias.then_some(&tbias),
            b_gathered: tg.as_ref(),
            ..tn_call(kind, (m, n, k), &ta, &tb, &td)
        };
        run_rank(
            (tp, r),
            (cfg, ring),
            &mut mem,
            &mut engines,
            &log,
            &call,
            &ws,
        )?;
        outs.push((pd, dshape, gathered));
    }
    simulate_group(&log, &mut mem, &engines)?;
    for (r, (pd, dshape, gathered)) in outs.into_iter().enumerate() {
        let want: Vec<f32> = match kind {
            Kind::AllGather => {
                let m0 = r * m.div_ceil(tp);
                (0..n)
                    .flat_map(|t| (0..dshape[1]).map(move |i| (t, m0 + i)))
                    .map(|(t, i)| d_full[t * m + i])
                    .collect()
            }
            Kind::AllReduce => d_full.clone(),
            Kind::ReduceScatter => {
                let n0 = r * n.div_ceil(tp);
                d_full[n0.min(n) * m..(n0.min(n) + dshape[0]) * m].to_vec()
            }
        };
        expect_once(&mem, pd, &want, &format!("rank {r}: D"))?;
        if let Some(g) = gathered {
            expect_once(&mem, g, &bg, &format!("rank {r}: b_gathered"))?;
        }
    }
    Ok(())
}

#[test]
fn comm_gemm_calls() {
    for (extra, with_bias) in [(0usize, false), (3, false), (0, true), (3, true)] {
        let what = format!(
            "n {}, bias {with_bias}",
            if extra == 0 { "divisible" } else { "padded" }
        );
        all(
            &format!("comm-GEMM all-gather ({what}, m uneven: {})", extra > 0),
            |tp, f| {
                // m + extra is not divisible by tp > 1 either: the ranks' shares of m (and of
                // the bias) differ, and their cross-rank check keys must still agree.
                let dims = (16 * tp + extra, 4 * tp + extra, 8);
                check_comm_gemm(tp, Cfg::new(f), (true, with_bias), Kind::AllGather, dims)
            },
        );
        // The fused all-gather (kNVTECommGemmAlgoAtomicP2P), our GEMM refusing odd m:
        // with m uneven, ranks differ in the GEMM they run, never in the protocol.
        all(
            &format!(
                "comm-GEMM fused all-gather ({what}, m uneven: {})",
                extra > 0
            ),
            |tp, f| {
                let dims = (16 * tp + extra, 4 * tp + extra, 8);
                let cfg = Cfg::fused(f, true);
                check_comm_gemm(tp, cfg, (true, with_bias), Kind::AllGather, dims)
            },
        );
        for ring in [true, false] {
            all(
                &format!("comm-GEMM reduce-scatter ({what}, ring {ring})"),
                |tp, f| {
                    let dims = (32, 4 * tp + extra, 4 * tp + 1);
                    check_comm_gemm(
                        tp,
                        Cfg::new(f),
                        (ring, with_bias),
                        Kind::ReduceScatter,
                        dims,
                    )
                },
            );
        }
        all(&format!("comm-GEMM all-reduce ({what})"), |tp, f| {
            let dims = (32, 4 * tp + extra, 4 * tp + 1);
            check_comm_gemm(tp, Cfg::new(f), (true, with_bias), Kind::AllReduce, dims)
        });
    }
}

/// A comm-GEMM reduce-scatter or all-reduce with block-scaled inputs (a 2D-scaled A with
/// a 1D-scaled B, and both 1D; k split, every rank's own quantized shares): every rank's
/// D against the sum of the dequantized partials, through `call::run` (tp 1: the direct
/// block GEMM).
fn check_block_comm_gemm(
    tp: usize,
    cfg: Cfg,
    ring: bool,
    kind: Kind,
    modes: [crate::tensor::BlockMode; 2],
) -> Res {
    let (nl, kl, m) = (8, 144, 136);
    let n = nl * tp;
    let mut mem = Mem::default();
    let mut engines = HashMap::new();
    let log = new_log(tp);
    let ws = tensor(mem.alloc("workspace", 4), &[1]);
    let (ops, sum) = block_partials(&mut mem, tp, (n, kl, m), modes);
    let mut outs = Vec::new();
    for (r, (a, b)) in ops.iter().enumerate() {
        let rows = if kind == Kind::AllReduce { n } else { nl };
        let pd = mem.alloc(&format!("D{r}"), rows * m * 4);
        let td = tensor(pd, &[rows, m]);
        let call = tn_call(kind, (m, n, kl * tp), &a.t, &b.t, &td);
        run_rank(
            (tp, r),
            (cfg, ring),
            &mut mem,
            &mut engines,
            &log,
            &call,
            &ws,
        )?;
        let want = if kind == Kind::AllReduce {
            sum.clone()
        } else {
            sum[r * nl * m..(r + 1) * nl * m].to_vec()
        };
        outs.push((pd, want));
    }
    simulate_group(&log, &mut mem, &engines)?;
    expect_each_rank(&mem, &outs)
}

#[test]
fn comm_gemm_block_scaled_reductions() {
    use crate::tensor::BlockMode::{OneD, TwoD};
    for modes in [[TwoD, OneD], [OneD, OneD]] {
        for ring in [true, false] {
            all(
                &format!("comm-GEMM reduce-scatter (block {modes:?}, ring {ring})"),
                |tp, f| check_block_comm_gemm(tp, Cfg::new(f), ring, Kind::ReduceScatter, modes),
            );
        }
        all(
            &format!("comm-GEMM all-reduce (block {modes:?})"),
            |tp, f| check_block_comm_gemm(tp, Cfg::new(f), true, Kind::AllReduce, modes),
        );
    }
}

#[test]
fn comm_gemm_block_scaled_refusals() {
    use crate::tensor::BlockMode::{OneD, TwoD};
    let mut mem = Mem::default();
    let (ops, _) = block_partials(&mut mem, 1, (12, 144, 136), [TwoD, OneD]);
    let d = tensor(mem.alloc("D", 12 * 136 * 4), &[12, 136]);
    let call = |kind, n: usize| tn_call(kind, (136, n, 144), &ops[0].0.t, &ops[0].1.t, &d);
    let msg = |r: Result<()>| r.expect_err("refused").msg;
    let ag = msg(super::call::check_block(
        &call(Kind::AllGather, 12),
        8,
        false,
    ));
    assert!(ag.contains("divisible by nranks = 8"), "{ag}");
    super::call::check_block(&call(Kind::AllGather, 12), 4, false).unwrap();
    let rs = msg(super::call::check_block(
        &call(Kind::ReduceScatter, 12),
        8,
        false,
    ));
    assert!(rs.contains("divisible by nranks = 8"), "{rs}");
    // One rank (direct) takes all three; more ranks the reductions with n divisible.
    for kind in [Kind::AllGather, Kind::ReduceScatter, Kind::AllReduce] {
        super::call::check_block(&call(kind, 12), 1, true).unwrap();
    }
    super::call::check_block(&call(Kind::ReduceScatter, 12), 4, false).unwrap();
    super::call::check_block(&call(Kind::AllReduce, 12), 8, false).unwrap();
    // An FP8 D: refused alike at one rank and at more, before anything runs.
    let d8 = tensor(mem.alloc("D8", 12 * 136), &[12, 136]);
    let d8 = crate::tensor::Tensor {
        data: crate::tensor::Buffer::new(d8.data.ptr, DType::E4M3, d8.data.shape).unwrap(),
        ..d8
    };
    for (nranks, direct) in [(1, true), (4, false)] {
        for kind in [Kind::AllGather, Kind::ReduceScatter, Kind::AllReduce] {
            let c = GemmCall {
                d: &d8,
                ..call(kind, 12)
            };
            let e = msg(super::call::check_block(&c, nranks, direct));
            assert!(e.contains("write no FP8 output"), "{e}");
        }
    }
}

#[test]
fn comm_gemm_block_operands_fail_before_any_rank_waits() {
    use crate::tensor::BlockMode::{OneD, TwoD};
    let mut mem = Mem::default();
    // Rank 1 of 2 of an all-gather: A its m-share [136, 144], B its shard [8, 144].
    let (ops, _) = block_partials(&mut mem, 1, (8, 144, 136), [TwoD, OneD]);
    let d = tensor(mem.alloc("D", 16 * 136 * 4), &[16, 136]);
    let b = ops[0].1.t.clone();
    let mut bad = b.clone();
    let call = |b| tn_call(Kind::AllGather, (272, 16, 144), &ops[0].0.t, b, &d);
    super::call::check_block_operands(&call(&b), (2, 1), false).unwrap();
    // The shard's scales in the wrong layout: the rank's own check, with no device call
    // (CommGemmCtx::check_operands, whose verdict NVTE_COMM_CHECK agrees on).
    bad.scale_inv = crate::tensor::Buffer::new(
        b.scale_inv.ptr,
        DType::F32,
        crate::tensor::Shape::new(&[8, 2]).unwrap(),
    )
    .unwrap();
    let e = super::call::check_block_operands(&call(&bad), (2, 1), false)
        .expect_err("wrong scale layout")
        .msg;
    assert!(e.contains("scale_inv"), "{e}");
}

#[test]
fn a_columnwise_only_block_operand_is_shaped_by_its_columnwise_data() {
    use crate::tensor::BlockMode::OneD;
    use crate::tensor::{Buffer, Shape, Tensor};
    let mut mem = Mem::default();
    // A weight quantized for transa = false: columnwise data [k, m] = [144, 136] alone.
    let p = mem.alloc("A^T", 144 * 136);
    let a = Tensor {
        scaling_mode: crate::tensor::BlockMode::TwoD.scaling_mode(),
        columnwise_data: Buffer::new(p, DType::E4M3, Shape::new(&[144, 136]).unwrap()).unwrap(),
        ..Default::default()
    };
    super::expect_shape(&a, "a", [136, 144], "test").unwrap();
    let e = super::expect_shape(&a, "a", [144, 136], "test")
        .expect_err("the transposed shape")
        .msg;
    assert!(e.contains("columnwise data [144, 136], transposed"), "{e}");
    // With transa = true the GEMM reads A's rowwise data: the check names it as missing.
    let (ops, _) = block_partials(&mut mem, 1, (8, 144, 136), [OneD, OneD]);
    let d = tensor(mem.alloc("D", 8 * 136 * 4), &[8, 136]);
    let call = tn_call(Kind::AllReduce, (136, 8, 144), &a, &ops[0].1.t, &d);
    let a1 = Tensor {
        scaling_mode: OneD.scaling_mode(),
        ..a.clone()
    };
    let e = super::call::check_block_operands(&GemmCall { a: &a1, ..call }, (1, 0), true)
        .expect_err("no rowwise data")
        .msg;
    assert!(e.contains("missing rowwise data"), "{e}");
}

/// A comm-GEMM all-gather with block-scaled inputs: every rank's own A_r [16, 144] (its
/// m-share) and B shard [8, 144] (1D or 2D scales); D_r [8 tp, 16] on every rank is the
/// gathered, dequantized B times A_r^T, through `call::run` (tp 1: the direct block
/// GEMM; more: the engine's ring with the scale slots); with `with_bg`, every rank's
/// b_gathered (GEMM-ready scales of all of B) holds all of B, data and scales.
fn check_block_comm_gemm_ag(
    tp: usize,
    cfg: Cfg,
    modes: [crate::tensor::BlockMode; 2],
    with_bg: bool,
) -> Res {
    use crate::overlap::protocol::{block_copy, expect_block_values};
    let (nl, k, ml) = (8, 144, 16);
    let n = nl * tp;
    let mut mem = Mem::default();
    let mut engines = HashMap::new();
    let log = new_log(tp);
    let ws = tensor(mem.alloc("workspace", 4), &[1]);
    let (ops, _) = block_partials(&mut mem, tp, (nl, k, ml), modes);
    let gathered: Vec<f32> = ops.iter().flat_map(|(_, b)| b.deq.clone()).collect();
    let bgs: Vec<_> = (0..tp * with_bg as usize)
        .map(|r| block_copy(&mut mem, r, modes[1], (n, k)))
        .collect();
    let mut outs = Vec::new();
    for (r, (a, b)) in ops.iter().enumerate() {
        let pd = mem.alloc(&format!("D{r}"), n * ml * 4);
        let td = tensor(pd, &[n, ml]);
        let call = GemmCall {
            b_gathered: bgs.get(r),
            ..tn_call(Kind::AllGather, (ml * tp, n, k), &a.t, &b.t, &td)
        };
        run_rank(
            (tp, r),
            (cfg, true),
            &mut mem,
            &mut engines,
            &log,
            &call,
            &ws,
        )?;
        outs.push((pd, matmul_nt(&gathered, &a.deq, n, k, ml)));
    }
    simulate_group(&log, &mut mem, &engines)?;
    for (r, bg) in bgs.iter().enumerate() {
        expect_block_values(&mem, bg, &gathered, &format!("rank {r}: b_gathered"))?;
    }
    expect_each_rank(&mem, &outs)
}

#[test]
fn comm_gemm_block_scaled_all_gather() {
    use crate::tensor::BlockMode::{OneD, TwoD};
    for modes in [[TwoD, OneD], [OneD, OneD], [OneD, TwoD]] {
        all(
            &format!("comm-GEMM all-gather (block {modes:?})"),
            |tp, f| check_block_comm_gemm_ag(tp, Cfg::new(f), modes, false),
        );
        // kNVTECommGemmAlgoAtomicP2P: the fused policy, which plans the ring for them.
        all(
            &format!("comm-GEMM fused all-gather (block {modes:?})"),
            |tp, f| check_block_comm_gemm_ag(tp, Cfg::fused(f, false), modes, false),
        );
    }
    // b_gathered: all of B, data and scales (2D-scaled shards of 8 rows: at tp 1 only;
    // more ranks refuse them before anything runs).
    for modes in [[TwoD, OneD], [OneD, OneD]] {
        all(
            &format!("comm-GEMM all-gather (block {modes:?}, b_gathered)"),
            |tp, f| check_block_comm_gemm_ag(tp, Cfg::new(f), modes, true),
        );
    }
    all(
        "comm-GEMM all-gather (block 2D B of 8 rows a rank, b_gathered)",
        |tp, f| match check_block_comm_gemm_ag(tp, Cfg::new(f), [OneD, TwoD], true) {
            Ok(()) if tp == 1 => Ok(()),
            Err(e) if tp > 1 && e.contains("whole 128-row tiles") => Ok(()),
            other => Err(format!("tp {tp}: {other:?}")),
        },
    );
}
