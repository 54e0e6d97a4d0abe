//! Our own Hopper GEMM (`kernels/gemm_sm90.cu`, issue 22) as a GEMM backend: the GEMM of
//! the fused (atomic) comm-GEMM algorithms, which wait on per-row-block arrival flags
//! (all-gather) and signal per-row-block completion (reduce-scatter) inside one launch.
//!
//! [`supports`] says exactly which [`GemmDesc`]s the kernel computes today: TE's TN
//! (`transa`, not `transb`: D[n, m] = B[n, k] . A[m, k]^T, row-major, K contiguous), bf16
//! or e4m3 inputs (both the same; e4m3 with both scale_invs and fast accumulation), bf16
//! or fp32 output, no epilogue, bias, aux, accumulation or FP8 output scaling, k * the
//! input size a multiple of 16 bytes, m a multiple of 8, A, B and D 16-byte aligned with
//! their leading dimensions packed. Everything else stays on cuBLASLt; the caller records
//! the reason the answer gives.
//!
//! [`Sm90Gemm`] is the module loaded in one context (once per context, outside or inside
//! a graph capture: the loading runs with the capture mode relaxed and reads the
//! kernel's shared-memory size on a stream of its own), its kernels' dynamic shared memory
//! allowed, and a small cache of tensor maps by (address, rows, k, box, type): a map
//! depends on nothing else, so a cached one is always right.
use super::{Epilogue, GemmDesc};
use crate::cuda::kernel::{Binding, Kernel, KernelArg, ParamInfo, Signature};
use crate::cuda::resources::{Stream, with_relaxed_capture};
use crate::cuda::{ContextGuard, DevPtr, StreamHandle, check, device_info, nvrtc};
use crate::error::{Error, Result};
use crate::tensor::DType;
use cudarc::driver::sys as cu;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

mod block;
pub use block::supports_block;

/// The driver's CUtensorMap as the kernel takes it (`GemmTmaDesc`: 128 opaque bytes,
/// 64-byte aligned), by value.
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TmaDesc(pub [u64; 16]);

/// The kernel's `Gemm90Args`, field for field (8-byte pointers, then 4-byte fields, then
/// the side copy's two pointers and size, then the stall record and its time; 160
/// bytes). Reserved fields stay zero.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Gemm90Args {
    pub d: DevPtr,
    pub bias: DevPtr,
    pub aux: DevPtr,
    pub a_scale_inv: DevPtr,
    pub b_scale_inv: DevPtr,
    pub d_scale: DevPtr,
    pub d_amax: DevPtr,
    pub flags: DevPtr,
    pub done: DevPtr,
    pub m: i32,
    pub n: i32,
    pub k: i32,
    pub rows_per_flag: i32,
    pub done_rows: i32,
    pub group_n: i32,
    pub n_tile_rot: i32,
    pub flag_value: u32,
    pub done_value: u32,
    pub beta: f32,
    pub epilogue: i32,
    pub k_pieces: i32,
    pub copy_src: DevPtr,
    pub copy_dst: DevPtr,
    pub copy_bytes: u64,
    pub stall: DevPtr,
    pub stall_ns: u64,
}

// SAFETY: a repr(C) struct passed by value: the Struct class and its own size.
unsafe impl KernelArg for TmaDesc {
    const INFO: ParamInfo = ParamInfo::by_value::<TmaDesc>();
}
// SAFETY: as above.
unsafe impl KernelArg for Gemm90Args {
    const INFO: ParamInfo = ParamInfo::by_value::<Gemm90Args>();
}

/// The kernels' parameters: the tensor maps of B and A, then the arguments.
type Gemm90Params = (TmaDesc, TmaDesc, Gemm90Args);

// SAFETY: gemm_sm90_tn_<a>_<b>_<out>_<BN>(GemmTmaDesc tmap_b, GemmTmaDesc tmap_a,
// Gemm90Args args) of kernels/gemm_sm90.cu, all three by value (`__grid_constant__`).
const GEMM90: Binding<Gemm90Params> =
    unsafe { Binding::new(&nvrtc::GEMM_SM90, "gemm_sm90_tn_{}_{}_{}_{}", "gemm_sm90") };

/// The kernel bindings of this backend (checked against kernels/gemm_sm90.cu by
/// tests/kernel_signatures.rs).
pub fn kernel_signatures() -> Vec<Signature> {
    vec![GEMM90.signature(), block::GEMM90_BLOCK.signature()]
}

/// `Gemm90Args`'s fields as (name, offset, size), for the host test that compares them
/// with the C struct of kernels/gemm_sm90.cu.
pub fn args_layout() -> Vec<(&'static str, usize, usize)> {
    use std::mem::{offset_of, size_of};
    macro_rules! f {
        ($($n:ident: $t:ty),+) => {
            vec![$((stringify!($n), offset_of!(Gemm90Args, $n), size_of::<$t>())),+]
        };
    }
    f!(d: DevPtr, bias: DevPtr, aux: DevPtr, a_scale_inv: DevPtr, b_scale_inv: DevPtr,
       d_scale: DevPtr, d_amax: DevPtr, flags: DevPtr, done: DevPtr, m: i32, n: i32, k: i32,
       rows_per_flag: i32, done_rows: i32, group_n: i32, n_tile_rot: i32, flag_value: u32,
       done_value: u32, beta: f32, epilogue: i32, k_pieces: i32, copy_src: DevPtr,
       copy_dst: DevPtr, copy_bytes: u64, stall: DevPtr, stall_ns: u64)
}

/// The record a fused GEMM's arrival waits write when one gives up ([`Hooks::stall`]), in
/// host-mapped memory: the kernel's `{flag + 1, claim, waited ns}` (the flag published
/// last).
pub struct StallRecord {
    mem: crate::cuda::resources::HostMapped,
}

/// A wait of our GEMM that gave up: the arrival flag it waited for, and for how long.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Stall {
    pub flag: u32,
    pub waited_ms: f64,
}

impl StallRecord {
    /// A zeroed record in the current context.
    pub fn new() -> Result<StallRecord> {
        Ok(StallRecord {
            mem: crate::cuda::resources::HostMapped::new(16)?,
        })
    }

    /// Its device address, for [`Hooks::stall`].
    pub fn device(&self) -> DevPtr {
        self.mem.device
    }

    /// The wait that gave up, if one did.
    pub fn read(&self) -> Option<Stall> {
        // SAFETY: 16 live host-mapped bytes, written by the device: volatile loads; the
        // flag (word 0) is published after the time and a system fence.
        unsafe { Self::decode(self.mem.host as *const u32) }
    }

    /// The record at `p` (16 readable bytes).
    unsafe fn decode(p: *const u32) -> Option<Stall> {
        use std::sync::atomic::{AtomicU32, Ordering};
        // SAFETY: (caller) 16 readable, 8-byte aligned bytes. An acquire load of the flag
        // (published last): the time read after it is at least as new.
        let code = unsafe { (*(p as *const AtomicU32)).load(Ordering::Acquire) };
        if code == 0 {
            return None;
        }
        // SAFETY: as above.
        let ns = unsafe { (p.add(2) as *const u64).read_volatile() };
        Some(Stall {
            flag: code - 1,
            waited_ms: ns as f64 / 1e6,
        })
    }
}

/// Rows of D per tile (the kernel's BM).
pub(crate) const TILE_ROWS: usize = 128;
/// Tile rows per group of the grouped rasterization (at most; with arrival flags no more
/// than a flag's rows, so that a group never waits on a later block; with done signals
/// see [`group_n`]).
const GROUP_N: usize = 8;
const THREADS: u32 = 384;

/// Why the kernel cannot compute `g` (None: it can). Exactly the kernel's constraints
/// (module doc): [`supports_kind`], then what depends on m and on the pointers.
pub fn supports(g: &GemmDesc) -> Option<&'static str> {
    if let Some(why) = supports_kind(g) {
        return Some(why);
    }
    let checks: [(bool, &'static str); 5] = [
        (g.m > 0, "an empty dimension"),
        (g.m <= i32::MAX as usize, "a dimension beyond 32 bits"),
        (
            g.m.is_multiple_of(8),
            "k * input size not a multiple of 16 bytes, or m not a multiple of 8",
        ),
        (g.ldd == g.m, "leading dimensions not packed"),
        (
            g.a.is_aligned(16) && g.b.is_aligned(16) && g.d.is_aligned(16),
            "A, B or D not 16-byte aligned",
        ),
    ];
    checks.iter().find(|c| !c.0).map(|c| c.1)
}

/// Why the kernel cannot compute GEMMs of `g`'s kind, whatever their m and pointers (None:
/// it can where those fit): the layout, the types, the epilogue, the FP8 scaling and
/// accumulation, n and k. The tensor-parallel ranks of one call share all of it (m may
/// be each rank's share), so the fused all-gather decides rank-uniform things from it.
pub fn supports_kind(g: &GemmDesc) -> Option<&'static str> {
    if g.blocks.is_some() {
        return Some("block-scaled FP8 inputs (the _block kernels: Sm90Gemm::run_block)");
    }
    let es = g.a_type.bits() / 8;
    let checks: [(bool, &'static str); 12] = [
        (g.transa && !g.transb, "layout is not TN"),
        (g.a_type == g.b_type, "A and B types differ"),
        (
            matches!(g.a_type, DType::BF16 | DType::E4M3),
            "inputs are neither bf16 nor e4m3",
        ),
        (
            matches!(g.d_type, DType::BF16 | DType::F32),
            "output is neither bf16 nor fp32",
        ),
        (
            g.epilogue == Epilogue::None && g.bias.is_null() && g.aux.is_null(),
            "an epilogue (bias / GELU)",
        ),
        (!g.accumulate && g.c.is_null(), "accumulation"),
        (
            g.d_scale.is_null() && g.d_amax.is_null(),
            "FP8 output scaling / amax",
        ),
        (
            !g.a_type.is_fp8()
                || (!g.a_scale_inv.is_null() && !g.b_scale_inv.is_null() && g.fast_accum),
            "FP8 without both scale_invs or with split (full-precision) accumulation",
        ),
        (g.n > 0 && g.k > 0, "an empty dimension"),
        (
            g.n <= i32::MAX as usize && g.k <= i32::MAX as usize,
            "a dimension beyond 32 bits",
        ),
        (
            (g.k * es).is_multiple_of(16),
            "k * input size not a multiple of 16 bytes, or m not a multiple of 8",
        ),
        (
            g.lda == g.k && g.ldb == g.k,
            "leading dimensions not packed",
        ),
    ];
    checks.iter().find(|c| !c.0).map(|c| c.1)
}

/// The fused algorithms' hooks into one launch (all off by default).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Hooks {
    /// arrival flags (u32 per `rows_per_flag` rows of B): a tile waits until its blocks'
    /// flags reach `flag_value` (NULL: no waits)
    pub flags: DevPtr,
    pub rows_per_flag: usize,
    /// K slices per block: with more than one, each block of `rows_per_flag` rows arrives
    /// as this many K slices, flag `block * k_pieces + c` for slice c (K blocks
    /// `[c kb / k_pieces, (c + 1) kb / k_pieces)` of the kernel's `kb` = [`k_blocks`]
    /// 128-byte K blocks), and a tile waits for each slice before loading it (see
    /// kernels/gemm_sm90.cu); 0 or 1: a flag per block
    pub k_pieces: usize,
    pub flag_value: u32,
    /// tile rows rotated so that this tile row is computed first
    pub n_tile_rot: usize,
    /// done signals (u32 [2 * blocks]: the signals, then the kernel's self-resetting
    /// counters, zero before the first launch); `done[j] = done_value` once every tile of
    /// rows [j * done_rows, ..) of D is stored (NULL: none)
    pub done: DevPtr,
    pub done_rows: usize,
    pub done_value: u32,
    /// a copy run beside the GEMM by its otherwise idle producer warps (one launch for
    /// both; none where `bytes` is 0): [`SideCopy::fits`] must hold
    pub side: SideCopy,
    /// 128-wide tiles whatever the tile rule says (a tuning choice of the fused
    /// algorithms, see `pick_tile`)
    pub narrow: bool,
    /// where a wait for an arrival flag that gave up records it (host-mapped, zero before
    /// the launch: `{flag + 1, claim, waited ns as u64}`), and after how long it gives up
    /// (NULL or 0: waits never give up). The tile then reads whatever B holds: the
    /// caller turns a set record into an error (see [`StallRecord`]).
    pub stall: DevPtr,
    pub stall_ns: u64,
}

impl Hooks {
    /// The arrival flags of a GEMM of `n` rows of B (0 without flags).
    pub fn n_flags(&self, n: usize) -> usize {
        if self.flags.is_null() {
            return 0;
        }
        n.div_ceil(self.rows_per_flag.max(1)) * self.k_pieces.max(1)
    }
}

/// The kernel's K blocks for `k` elements of `elem_bytes` bytes: 128 bytes of K each (a
/// K slice of [`Hooks::k_pieces`] is a run of them).
pub fn k_blocks(k: usize, elem_bytes: usize) -> usize {
    (k * elem_bytes).div_ceil(128)
}

/// Bytes `[lo, hi)` of a row of K (`k` elements of `elem_bytes`) that K slice `c` of
/// `pieces` covers, as the kernel splits the K blocks (see [`Hooks::k_pieces`]).
pub fn k_slice_bytes(k: usize, elem_bytes: usize, pieces: usize, c: usize) -> (usize, usize) {
    let (kb, row) = (k_blocks(k, elem_bytes), k * elem_bytes);
    let edge = |c: usize| (c * kb / pieces * 128).min(row);
    (edge(c), edge(c + 1))
}

/// A copy of `bytes` from `src` to `dst` that a GEMM neither reads nor writes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SideCopy {
    pub dst: DevPtr,
    pub src: DevPtr,
    pub bytes: usize,
}

impl SideCopy {
    /// Whether our kernel can run it: both pointers 16-byte aligned, whole 16-byte units.
    pub fn fits(&self) -> bool {
        self.bytes.is_multiple_of(16) && self.src.is_aligned(16) && self.dst.is_aligned(16)
    }
}

/// Tile width: 256 unless 128 fills the last wave clearly better (as bench/own_gemm.cpp).
fn pick_bn(m: usize, n: usize, sms: usize) -> usize {
    let eff = |bn: usize| {
        let t = n.div_ceil(TILE_ROWS) * m.div_ceil(bn);
        let waves = t.div_ceil(sms.max(1));
        let useful = (m * n) as f64 / (t * TILE_ROWS * bn) as f64;
        useful * t as f64 / (waves * sms.max(1)) as f64
    };
    if eff(128) > eff(256) + 0.05 { 128 } else { 256 }
}

/// Tile width of a GEMM that waits on arrival flags (the fused all-gather): as
/// [`pick_bn`], but 128 wide where 256-wide tiles fill at most `FEW_WAVES` waves. Each
/// tile that waits for the last piece to land runs after it, so the GEMM ends about one
/// tile's time after the last arrival: with few waves that tail is a large part of the
/// GEMM, and half-width tiles halve it. Measured on the emulated link (bench/RESULTS.md,
/// 2026-11-26, third session, one H200): fused/bound 1.23 -> 1.12 and 1.11 -> 1.06 on the two such
/// tp-8 anchor rows, while 128-wide tiles cost 5-9 % on the rows with more waves. Not for
/// arrivals in K slices ([`Hooks::k_pieces`]): there the tail after the last arrival is
/// one slice's share of a tile, and 256-wide tiles won (bench/RESULTS.md, 2026-11-27 tenth
/// session: 1.12-1.15 against 1.25-1.28 on the tp-8 8192 x 4096 x 2048 row).
fn pick_bn_waiting(m: usize, n: usize, sms: usize) -> usize {
    const FEW_WAVES: usize = 4;
    let bn = pick_bn(m, n, sms);
    let tiles = n.div_ceil(TILE_ROWS) * m.div_ceil(256);
    if bn == 256 && tiles <= FEW_WAVES * sms.max(1) {
        128
    } else {
        bn
    }
}

/// Pieces per destination block (`rows` rows of D [n, m]) of the fused reduce-scatter on
/// `sms` SMs, the tuner having asked for `want`: at least as many as make one piece's tiles
/// fit in one round of CTAs, so that the first piece, which the link waits for, is done
/// after one tile's time rather than several. The fewest such pieces of whole tile rows
/// dividing the block (every tile row its own piece where none fits); `want` where that is
/// more, where the tuner asked for whole blocks (1), or where the block is not whole tile
/// rows. The tile width is the one the fused kernel takes (`pick_bn`: no ping-pong with
/// done signals; 128 where the tuning asks for `narrow` tiles). On the emulated link
/// (bench/RESULTS.md, twelfth session, one H100, 131 SMs) the one anchor this changes
/// (e4m3 tp 4, 16384 x 2048 x 8192 per rank: 1024 tiles a block, 8 pieces instead of 4)
/// went from 1.063 to 1.041 x max(GEMM, link); with fewer SMs (a larger `num_comm_sm`)
/// more anchors get more pieces (unmeasured).
pub fn rs_pieces(want: usize, rows: usize, m: usize, n: usize, sms: usize, narrow: bool) -> usize {
    if want <= 1 || rows == 0 || !rows.is_multiple_of(TILE_ROWS) {
        return want;
    }
    let bn = if narrow { 128 } else { pick_bn(m, n, sms) };
    let (tile_rows, per_row) = (rows / TILE_ROWS, m.div_ceil(bn));
    let fits = (1..=tile_rows)
        .filter(|p| tile_rows.is_multiple_of(*p))
        .find(|p| tile_rows / p * per_row <= sms.max(1))
        .unwrap_or(tile_rows);
    fits.max(want)
}

/// Whether the ping-pong kernel (128 x 192 tiles a consumer warpgroup, bf16 out) beats
/// the cooperative one of width `bn` on D [n, m] with depth k: a model in units of one
/// K element of a 256-wide cooperative tile. A cooperative round of tiles costs its K plus
/// the epilogue (`epi`: the consumers store while the tensor cores idle, about 9 % of them
/// on e4m3 8192 x 3584 x 8192, ncu, H100, 2026-11-27). A ping-pong tile has 3/4 of the
/// wgmma work (192 of 256 columns) and its one warpgroup stores 1.5 times what a
/// cooperative warpgroup stores; with two warpgroups in turn a round takes the longer of
/// the tensor cores' 3/4 k and half of one warpgroup's 3/4 k + 1.5 epi, and the last
/// epilogue shows. (With short K the stores bound both kernels alike: no gain.) Ping-pong
/// only where the model says 7 % or more, and with two rounds or more: on one H200
/// (bench/RESULTS.md, eleventh session) that kept every measured win (e4m3 m = 8192 with k
/// of 1024 to 4096: 3-14 % faster alone; bf16 m = 8192, k 1024 / 2048: 5 / 2 %) and
/// every loss out (m of 1024 to 7168 where 192 wastes part of a tile, 1-12 % slower;
/// k = 8192 and m = 8192 with k >= 3584 in bf16: ties).
fn pingpong_pays(m: usize, n: usize, k: usize, fp8: bool, bn: usize, sms: usize) -> bool {
    const MARGIN: f64 = 0.93;
    let epi = if fp8 { 320.0 } else { 160.0 };
    let sms = sms.max(1);
    let rows = n.div_ceil(TILE_ROWS);
    let rounds = |w: usize| (rows * m.div_ceil(w)).div_ceil(sms) as f64;
    if rounds(192) < 2.0 {
        // One round: most CTAs would hold a single tile and leave a consumer warpgroup idle
        // (not measured; every measured win had many rounds).
        return false;
    }
    let (w, k) = (bn as f64 / 256.0, k as f64);
    let coop = rounds(bn) * (k + epi) * w;
    let pp = rounds(192) * (0.75 * k).max(0.375 * k + 0.75 * epi) + 0.75 * epi;
    pp <= MARGIN * coop
}

/// The tile width of our kernel for `g` with `hooks` on `sms` SMs: 128 / 256
/// ([`pick_bn`], [`pick_bn_waiting`]), or 192 (the ping-pong kernel: bf16 D, where
/// [`pingpong_pays`]) for GEMMs without arrival flags or done signals. The overlapped ones
/// keep the cooperative widths: a ping-pong tile that starts after the last arrival ends
/// 1.5 cooperative tiles later when both warpgroups run (each at half the tensor rate),
/// against one; and on the emulated link (bench/RESULTS.md, eleventh session, one H100)
/// the fused reduce-scatter rows where the rule would take it (m = 8192, k = 1024 / 2048
/// per rank, link-bound) came out 0.7-1.5 % slower with it, though the kernel alone was
/// 6-14 % faster: its tiles finish in a different order, and the link waits on the first
/// pieces.
///
/// `hooks.narrow` (the tuner's choice for a fused algorithm) takes 128 whatever the rule:
/// half a tile's time for the first piece a fused reduce-scatter's link waits for and for
/// the tiles after an all-gather's last arrival, at the cost of the GEMM's own speed, so it
/// pays only where the link is the longer. The tile rule cannot tell (it does not know the
/// link); the tuner measures. On the emulated link (bench/RESULTS.md, thirteenth session,
/// one H100) 128-wide tiles won 0.4-2.6 % on the six rows the link bounds most (e4m3 RS tp
/// 8 8192 x 2048 x 4096: 1.13 -> 1.10 x bound; AG tp 8 16384 x 8192 x 1024: 1.037 -> 1.023)
/// and lost 4-27 % on the other eighteen.
fn pick_tile(g: &GemmDesc, hooks: &Hooks, sms: usize) -> usize {
    if hooks.narrow {
        return 128;
    }
    if !hooks.flags.is_null() {
        return if hooks.k_pieces > 1 {
            pick_bn(g.m, g.n, sms)
        } else {
            pick_bn_waiting(g.m, g.n, sms)
        };
    }
    let bn = pick_bn(g.m, g.n, sms);
    if g.d_type == DType::BF16
        && hooks.done.is_null()
        && pingpong_pays(g.m, g.n, g.k, g.a_type.is_fp8(), bn, sms)
    {
        192
    } else {
        bn
    }
}

/// A tensor map's key: (address, rows, k, box rows, FP8).
type MapKey = (u64, usize, usize, usize, bool);

/// The backend in one context: the kernels, their shared memory, tensor maps.
pub struct Sm90Gemm {
    /// [e4m3][f32 out][BN 256]
    kernels: [[[Kernel<Gemm90Params>; 2]; 2]; 2],
    /// The ping-pong kernels (BN 192, bf16 out): [e4m3]
    pingpong: [Kernel<Gemm90Params>; 2],
    /// The block-scaled e4m3 kernels (BN 128, [`block::BLOCK_OUTS`]): their own module,
    /// loaded by [`Self::get_with_block`] when a block-scaled GEMM first asks for them.
    block: std::sync::OnceLock<[Kernel<Gemm90Params>; 3]>,
    /// Dynamic shared memory: [BN 128, BN 256, BN 192]
    smem: [u32; 3],
    sms: usize,
    maps: Mutex<HashMap<MapKey, TmaDesc>>,
}

/// Let `kern` (a function of a loaded gemm_sm90 module) take `bytes` of dynamic shared
/// memory.
fn set_dynamic_smem(kern: &Kernel<Gemm90Params>, bytes: u32) -> Result<()> {
    // SAFETY: a function of a loaded module; a plain attribute.
    check(
        unsafe {
            cu::cuFuncSetAttribute(
                kern.raw(),
                cu::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                bytes as i32,
            )
        },
        "cuFuncSetAttribute(gemm_sm90 dynamic shared memory)",
    )
}

/// The device of `guard`'s context (a guard made without the device lookup, e.g.
/// nvte_cublas_gemm's, says -1).
fn guard_device(guard: &ContextGuard) -> Result<i32> {
    if guard.device >= 0 {
        Ok(guard.device)
    } else {
        crate::cuda::current_device()
    }
}

/// Whether our kernels are built for devices like `dev` (sm_90: Hopper). What every rank
/// of a group of one device type decides alike, whether or not the load then works.
pub fn device_takes_it(dev: &crate::cuda::DeviceInfo) -> bool {
    (dev.cc_major, dev.cc_minor) == (9, 0)
}

impl Sm90Gemm {
    /// The backend of the current context (`guard`'s), loaded at its first use; an
    /// `Unsupported` error on a device other than sm_90.
    pub fn get(guard: &ContextGuard) -> Result<Arc<Sm90Gemm>> {
        static LOADED: Mutex<Option<HashMap<crate::cuda::CtxId, Arc<Sm90Gemm>>>> = Mutex::new(None);
        let mut g = LOADED.lock().unwrap_or_else(|e| e.into_inner());
        let map = g.get_or_insert_with(HashMap::new);
        if let Some(b) = map.get(&guard.id) {
            return Ok(b.clone());
        }
        let b = Arc::new(with_relaxed_capture(|| Self::load(guard))?);
        map.insert(guard.id, b.clone());
        Ok(b)
    }

    fn load(guard: &ContextGuard) -> Result<Sm90Gemm> {
        let device = guard_device(guard)?;
        let dev = device_info(device)?;
        if !device_takes_it(&dev) {
            crate::unsupported!(
                "our sm90 GEMM needs an sm_90 (Hopper) device, this one is sm_{}{}",
                dev.cc_major,
                dev.cc_minor
            );
        }
        let m = nvrtc::module(&nvrtc::GEMM_SM90, guard.id, &dev)?;
        let smem = [
            read_i32(&m, "gemm_sm90_smem_bytes_128")?,
            read_i32(&m, "gemm_sm90_smem_bytes_256")?,
            read_i32(&m, "gemm_sm90_smem_bytes_192")?,
        ];
        let smem = smem.map(|v| v.max(0) as u32);
        // bn: an index into `smem` (0: 128, 1: 256, 2: 192)
        let k = |i: &str, o: &str, bn: usize| -> Result<Kernel<Gemm90Params>> {
            let bn_s = ["128", "256", "192"][bn];
            // SAFETY: `m` is kernels/gemm_sm90.cu's module, the bindings' source.
            let kern = unsafe { Kernel::new(&m, &GEMM90, &[i, i, o, bn_s])? };
            set_dynamic_smem(&kern, smem[bn])?;
            Ok(kern)
        };
        let per_in = |i: &str| -> Result<[[Kernel<Gemm90Params>; 2]; 2]> {
            Ok([
                [k(i, "bf16", 0)?, k(i, "bf16", 1)?],
                [k(i, "f32", 0)?, k(i, "f32", 1)?],
            ])
        };
        Ok(Sm90Gemm {
            kernels: [per_in("bf16")?, per_in("e4m3")?],
            pingpong: [k("bf16", "bf16", 2)?, k("e4m3", "bf16", 2)?],
            block: std::sync::OnceLock::new(),
            smem,
            sms: dev.sm_count.max(1) as usize,
            maps: Mutex::new(HashMap::new()),
        })
    }

    /// The device's SM count.
    pub fn sm_count(&self) -> usize {
        self.sms
    }

    /// The tensor map of a row-major [rows, k] operand at `ptr`, `box_rows` rows per box.
    fn map(
        &self,
        ptr: DevPtr,
        rows: usize,
        k: usize,
        box_rows: usize,
        fp8: bool,
    ) -> Result<TmaDesc> {
        let key = (ptr.raw(), rows, k, box_rows, fp8);
        let mut maps = self.maps.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(t) = maps.get(&key) {
            return Ok(*t);
        }
        let t = encode(ptr, rows, k, box_rows, fp8)?;
        if maps.len() >= 1024 {
            maps.clear(); // a bounded cache: the maps are cheap to make again
        }
        maps.insert(key, t);
        Ok(t)
    }

    /// D = B . A^T (`g`, which [`supports`] accepts) on `stream` with `hooks`, on at most
    /// `sms` SMs (0: all; the grid is min(tiles, SMs)).
    ///
    /// # Safety
    ///
    /// `g`'s operands as `gemm::run` requires them; the hooks' flags, done signals and side
    /// copy name device memory of the extents their counts imply (the fused algorithms'
    /// own flag slots and buffers), alive until the launch completes.
    pub unsafe fn run(
        &self,
        g: &GemmDesc,
        hooks: &Hooks,
        sms: usize,
        stream: StreamHandle,
    ) -> Result<()> {
        if let Some(why) = supports(g) {
            return Err(Error::internal(format!(
                "our sm90 GEMM cannot compute this GEMM: {why}"
            )));
        }
        let sms = if sms == 0 {
            self.sms
        } else {
            sms.min(self.sms)
        };
        let bn = pick_tile(g, hooks, sms);
        let fp8 = g.a_type == DType::E4M3;
        let tb = self.map(g.b, g.n, g.k, TILE_ROWS, fp8)?;
        let ta = self.map(g.a, g.m, g.k, bn, fp8)?;
        let args = args_of(g, hooks, g.m.div_ceil(bn), sms)?;
        let tiles = g.n.div_ceil(TILE_ROWS) * g.m.div_ceil(bn);
        let grid = tiles.min(sms).max(1) as u32;
        let (kern, smem) = if bn == 192 {
            (&self.pingpong[fp8 as usize], self.smem[2])
        } else {
            let b256 = (bn == 256) as usize;
            let f32_out = (g.d_type == DType::F32) as usize;
            (&self.kernels[fp8 as usize][f32_out][b256], self.smem[b256])
        };
        // SAFETY: the module stays loaded (the cache never unloads) in the current
        // context; the maps and `args` describe memory the caller's GemmDesc validated
        // (`supports`: shapes, packing, alignment); grid, block and shared memory are the
        // kernel's documented launch shape.
        unsafe {
            kern.launch_shared(
                ((grid, 1, 1), (THREADS, 1, 1)),
                smem,
                stream,
                (tb, ta, args),
            )
        }
    }
}

/// The kernel's arguments for `g` with `hooks`, `tiles_m` tiles a tile row, on `sms` SMs.
fn args_of(g: &GemmDesc, h: &Hooks, tiles_m: usize, sms: usize) -> Result<Gemm90Args> {
    let i = |v: usize, what: &str| -> Result<i32> {
        i32::try_from(v)
            .map_err(|_| Error::internal(format!("sm90 GEMM {what} = {v} exceeds 32 bits")))
    };
    if h.side.bytes != 0 && !h.side.fits() {
        return Err(Error::internal(format!(
            "sm90 GEMM side copy of {} bytes ({:#x} -> {:#x}): whole 16-byte units between 16-byte aligned pointers only",
            h.side.bytes,
            h.side.src.raw(),
            h.side.dst.raw()
        )));
    }
    let fp8 = g.a_type.is_fp8();
    Ok(Gemm90Args {
        d: g.d,
        a_scale_inv: if fp8 { g.a_scale_inv } else { DevPtr::NULL },
        b_scale_inv: if fp8 { g.b_scale_inv } else { DevPtr::NULL },
        flags: h.flags,
        done: h.done,
        m: i(g.m, "m")?,
        n: i(g.n, "n")?,
        k: i(g.k, "k")?,
        rows_per_flag: if h.flags.is_null() {
            0
        } else {
            i(h.rows_per_flag.max(1), "rows_per_flag")?
        },
        done_rows: if h.done.is_null() {
            0
        } else {
            i(h.done_rows.max(1), "done_rows")?
        },
        group_n: group_n(h, tiles_m, sms) as i32,
        k_pieces: if h.flags.is_null() {
            0
        } else {
            i(h.k_pieces, "k_pieces")?
        },
        n_tile_rot: i(h.n_tile_rot % g.n.div_ceil(TILE_ROWS).max(1), "n_tile_rot")?,
        flag_value: h.flag_value,
        done_value: h.done_value,
        copy_src: h.side.src,
        copy_dst: h.side.dst,
        copy_bytes: h.side.bytes as u64,
        stall: if h.flags.is_null() || h.stall_ns == 0 {
            DevPtr::NULL
        } else {
            h.stall
        },
        stall_ns: h.stall_ns,
        ..Default::default()
    })
}

/// The grouped rasterization's tile rows per group for `h` (see [`GROUP_N`]), with
/// `tiles_m` tiles a tile row on `sms` SMs. Arrival flags: at most a flag's rows (a group
/// never waits on a later block). Done signals: as many whole pieces (`done_rows`) as one
/// round of tiles holds, at least one (but never more than `GROUP_N` tile rows, even where
/// a piece has more): a group of pieces whose tiles fit in one round finishes them about
/// as early as groups of one piece would (each piece's tiles are within one round:
/// [`rs_pieces`]; rounds and groups need not align), and larger groups read A's tiles
/// from L2 fewer times. (A group may span two destination blocks; only when the pieces
/// are done changes, not what is signalled.) On the emulated link (bench/RESULTS.md, twelfth session,
/// one H100, two runs each) groups of 8 instead of 4 (pieces of 4 tile rows, 16 tiles a
/// row) took tp 4 8192 x 4096 x 4096 per rank from 1.057-1.059 to 1.043 of the bound
/// (e4m3) and from 1.034-1.054 to 1.031-1.046 (bf16), while groups larger than a round
/// lost 1-6 % (their first piece finishes a round later).
fn group_n(h: &Hooks, tiles_m: usize, sms: usize) -> usize {
    let mut g = GROUP_N;
    if !h.flags.is_null() {
        g = g.min((h.rows_per_flag / TILE_ROWS).max(1));
    }
    if !h.done.is_null() {
        let piece = (h.done_rows / TILE_ROWS).max(1);
        let fit = sms / tiles_m.max(1) / piece * piece;
        g = g.min(piece.max(fit));
    }
    g
}

/// cuTensorMapEncodeTiled for a row-major [rows, k] operand: box {128 bytes of K,
/// box_rows}, 128B swizzle (what the kernel's loads expect).
fn encode(ptr: DevPtr, rows: usize, k: usize, box_rows: usize, fp8: bool) -> Result<TmaDesc> {
    let es = if fp8 { 1u64 } else { 2 };
    let dims = [k as u64, rows as u64];
    let strides = [k as u64 * es];
    let boxd = [(128 / es) as u32, box_rows as u32];
    let estr = [1u32, 1];
    // SAFETY: plain-old data, written by the driver below.
    let mut t: cu::CUtensorMap = unsafe { std::mem::zeroed() };
    use cu::CUtensorMapDataType as T;
    // SAFETY: out pointer to a CUtensorMap; the arrays hold rank (2) entries (strides
    // rank - 1); the address is only recorded in the map.
    let r = unsafe {
        cu::cuTensorMapEncodeTiled(
            &mut t,
            if fp8 {
                T::CU_TENSOR_MAP_DATA_TYPE_UINT8
            } else {
                T::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
            },
            2,
            ptr.as_void(),
            dims.as_ptr(),
            strides.as_ptr(),
            boxd.as_ptr(),
            estr.as_ptr(),
            cu::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            cu::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            cu::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            cu::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    check(
        r,
        &format!("cuTensorMapEncodeTiled(rows {rows}, k {k}, box rows {box_rows})"),
    )?;
    Ok(TmaDesc(t.opaque))
}

/// A `__constant__ int` of module `m`, read on a stream of its own (no legacy-stream
/// synchronisation: safe while another stream is being captured).
fn read_i32(m: &nvrtc::Module, name: &str) -> Result<i32> {
    let (p, n) = m.global(name)?;
    if n != 4 {
        return Err(Error::internal(format!("{name} has {n} bytes, not 4")));
    }
    let s = Stream::new(0)?;
    let mut v = 0i32;
    // SAFETY: 4 bytes from a module global into `v`; the stream is synchronised before
    // `v` is read or dropped.
    check(
        unsafe { cu::cuMemcpyDtoHAsync_v2(&mut v as *mut i32 as *mut _, p.raw(), 4, s.raw().cu()) },
        &format!("cuMemcpyDtoHAsync({name})"),
    )?;
    s.synchronize()?;
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(super) fn tn(m: usize, n: usize, k: usize, t: DType) -> GemmDesc {
        let fp8 = t.is_fp8();
        let si = |a: u64| if fp8 { DevPtr::new(a) } else { DevPtr::NULL };
        GemmDesc {
            m,
            n,
            k,
            a: DevPtr::new(1 << 20),
            b: DevPtr::new(2 << 20),
            d: DevPtr::new(3 << 20),
            c: DevPtr::NULL,
            lda: k,
            ldb: k,
            ldd: m,
            a_type: t,
            b_type: t,
            d_type: DType::BF16,
            transa: true,
            transb: false,
            epilogue: Epilogue::None,
            bias: DevPtr::NULL,
            bias_type: DType::BF16,
            aux: DevPtr::NULL,
            aux_type: DType::BF16,
            a_scale_inv: si(4 << 20),
            b_scale_inv: si(5 << 20),
            d_scale: DevPtr::NULL,
            d_amax: DevPtr::NULL,
            accumulate: false,
            fast_accum: fp8,
            sm_count: 0,
            workspace: DevPtr::NULL,
            workspace_bytes: 0,
            blocks: None,
        }
    }

    #[test]
    fn a_stall_record_reads_the_flag_and_the_wait() {
        let none = [0u64; 2];
        // SAFETY: 16 readable, aligned bytes.
        assert_eq!(
            unsafe { StallRecord::decode(none.as_ptr() as *const u32) },
            None
        );
        // flag 7 (word 0 = flag + 1, word 1 the claim), 2.5 s
        let set = [8u64 | 1 << 32, 2_500_000_000];
        // SAFETY: as above.
        let read = unsafe { StallRecord::decode(set.as_ptr() as *const u32) };
        assert_eq!(
            read,
            Some(Stall {
                flag: 7,
                waited_ms: 2500.0
            })
        );
    }

    #[test]
    fn stall_fields_reach_the_kernel_only_with_arrival_flags() {
        let g = tn(4096, 2048, 1024, DType::BF16);
        let stall = DevPtr::new(0x1000);
        let with = Hooks {
            flags: DevPtr::new(0x2000),
            rows_per_flag: 512,
            flag_value: 1,
            stall,
            stall_ns: 5_000_000,
            ..Default::default()
        };
        let a = args_of(&g, &with, 16, 132).unwrap();
        assert_eq!((a.stall, a.stall_ns), (stall, 5_000_000));
        let no_flags = Hooks {
            flags: DevPtr::NULL,
            ..with
        };
        assert_eq!(args_of(&g, &no_flags, 16, 132).unwrap().stall, DevPtr::NULL);
        let forever = Hooks {
            stall_ns: 0,
            ..with
        };
        assert_eq!(args_of(&g, &forever, 16, 132).unwrap().stall, DevPtr::NULL);
    }

    #[test]
    fn the_struct_mirrors_have_the_kernels_sizes() {
        assert_eq!(std::mem::size_of::<Gemm90Args>(), 160);
        assert_eq!(std::mem::size_of::<TmaDesc>(), 128);
        assert_eq!(std::mem::align_of::<TmaDesc>(), 64);
        assert_eq!(
            std::mem::size_of::<cu::CUtensorMap>(),
            std::mem::size_of::<TmaDesc>()
        );
    }

    #[test]
    fn supports_exactly_the_kernels_cases() {
        assert_eq!(supports(&tn(4096, 2048, 1024, DType::BF16)), None);
        assert_eq!(supports(&tn(4096, 2048, 1024, DType::E4M3)), None);
        let no = |f: &dyn Fn(&mut GemmDesc)| {
            let mut g = tn(4096, 2048, 1024, DType::E4M3);
            f(&mut g);
            supports(&g).is_some()
        };
        assert!(no(&|g| g.transa = false));
        assert!(no(&|g| g.transb = true));
        assert!(no(&|g| g.b_type = DType::BF16));
        assert!(no(&|g| (g.a_type, g.b_type) = (DType::E5M2, DType::E5M2)));
        assert!(no(&|g| g.d_type = DType::E4M3));
        assert!(no(&|g| g.epilogue = Epilogue::Bias));
        assert!(no(&|g| g.bias = DevPtr::new(64)));
        assert!(no(&|g| g.accumulate = true));
        assert!(no(&|g| g.d_amax = DevPtr::new(64)));
        assert!(no(&|g| g.fast_accum = false));
        assert!(no(&|g| g.b_scale_inv = DevPtr::NULL));
        assert!(no(&|g| (g.k, g.lda, g.ldb) = (1000, 1000, 1000)));
        assert!(no(&|g| (g.m, g.ldd) = (4092, 4092)));
        assert!(no(&|g| g.ldb = 2048));
        assert!(no(&|g| g.d = g.d + 8));
        assert!(no(&|g| g.n = 0));
        // bf16: k * 2 bytes a multiple of 16 (k = 1000 fits, 1004 does not)
        let mut g = tn(4096, 2048, 1000, DType::BF16);
        assert_eq!(supports(&g), None);
        (g.k, g.lda, g.ldb) = (1004, 1004, 1004);
        assert!(supports(&g).is_some());
    }

    /// The fused all-gather decides rank-uniform things from supports_kind: it refuses
    /// what supports refuses for the call's kind, never for this rank's m or pointers.
    #[test]
    fn the_kind_check_leaves_out_m_and_the_pointers() {
        let g = tn(4096, 2048, 1024, DType::BF16);
        assert_eq!(supports_kind(&g), None);
        let rank_only = |f: &dyn Fn(&mut GemmDesc)| {
            let mut g = tn(4096, 2048, 1024, DType::E4M3);
            f(&mut g);
            supports(&g).is_some() && supports_kind(&g).is_none()
        };
        assert!(rank_only(&|g| (g.m, g.ldd) = (4092, 4092)));
        assert!(rank_only(&|g| g.ldd = 8192));
        assert!(rank_only(&|g| (g.m, g.ldd) = (0, 0)));
        assert!(rank_only(&|g| g.d = g.d + 8));
        assert!(rank_only(&|g| g.a = g.a + 4));
        let kind = |f: &dyn Fn(&mut GemmDesc)| {
            let mut g = tn(4096, 2048, 1024, DType::E4M3);
            f(&mut g);
            supports(&g).is_some() && supports_kind(&g).is_some()
        };
        assert!(kind(&|g| g.fast_accum = false));
        assert!(kind(&|g| g.d_amax = DevPtr::new(64)));
        assert!(kind(&|g| g.transb = true));
        assert!(kind(&|g| (g.k, g.lda, g.ldb) = (1000, 1000, 1000)));
    }

    /// K slices: the host's byte ranges are the kernel's K-block ranges (`[c kb / p,
    /// (c + 1) kb / p)` of 128-byte blocks), the last clipped to the row; empty slices where
    /// there are more slices than blocks.
    #[test]
    fn k_slices_follow_the_kernels_k_blocks() {
        assert_eq!(k_blocks(2048, 2), 32);
        assert_eq!(k_blocks(100, 2), 2);
        let edges = |k, e, p| -> Vec<(usize, usize)> {
            (0..p).map(|c| k_slice_bytes(k, e, p, c)).collect()
        };
        assert_eq!(edges(2048, 2, 3), [(0, 1280), (1280, 2688), (2688, 4096)]);
        assert_eq!(
            edges(4096, 1, 4),
            [(0, 1024), (1024, 2048), (2048, 3072), (3072, 4096)]
        );
        assert_eq!(edges(100, 2, 3), [(0, 0), (0, 128), (128, 200)]);
        let h = Hooks {
            flags: DevPtr::new(4096),
            rows_per_flag: 1024,
            k_pieces: 4,
            ..Default::default()
        };
        assert_eq!(h.n_flags(8192), 32);
        assert_eq!(Hooks::default().n_flags(8192), 0);
    }

    #[test]
    fn arguments_carry_the_hooks() {
        let g = tn(512, 1000, 256, DType::BF16);
        let h = Hooks {
            flags: DevPtr::new(4096),
            rows_per_flag: 250,
            flag_value: 1,
            n_tile_rot: 9, // 8 tile rows: wraps to 1
            ..Default::default()
        };
        let a = args_of(&g, &h, 2, 132).unwrap();
        assert_eq!(
            (a.m, a.n, a.k, a.rows_per_flag, a.n_tile_rot),
            (512, 1000, 256, 250, 1)
        );
        assert_eq!(
            (a.done, a.done_rows, a.a_scale_inv),
            (DevPtr::NULL, 0, DevPtr::NULL)
        );
        assert_eq!(a.group_n, 1); // 250 rows per flag: one tile row per group
        let a = args_of(&g, &Hooks::default(), 2, 132).unwrap();
        assert_eq!((a.flags, a.rows_per_flag, a.group_n), (DevPtr::NULL, 0, 8));
        let h = Hooks {
            done: DevPtr::new(4096),
            done_rows: 512,
            ..Default::default()
        };
        // Done signals of 4 tile rows: groups of 4 where a round holds only one piece's
        // tiles (tiles_m 32 on 131 SMs), of 8 where it holds two (tiles_m 16), never more
        // than GROUP_N, never less than a piece (of at most GROUP_N tile rows).
        assert_eq!(args_of(&g, &h, 32, 131).unwrap().group_n, 4);
        assert_eq!(args_of(&g, &h, 16, 131).unwrap().group_n, 8);
        assert_eq!(args_of(&g, &h, 2, 131).unwrap().group_n, 8);
        assert_eq!(args_of(&g, &h, 64, 131).unwrap().group_n, 4);
        let h2 = Hooks {
            done: DevPtr::new(4096),
            done_rows: 256,
            ..Default::default()
        };
        assert_eq!(args_of(&g, &h2, 32, 131).unwrap().group_n, 4);
        assert_eq!(args_of(&g, &h2, 48, 131).unwrap().group_n, 2);
        assert_eq!(pick_bn(4096, 4096, 132), 256);
        // Waiting on flags: 128 wide at 4 waves or fewer (tp-8 anchors: AG 8192 x 2048
        // and 16384 x 1024 per rank), else as pick_bn (8192 x 3584: 6.8 waves).
        assert_eq!(pick_bn_waiting(2048, 8192, 131), 128);
        assert_eq!(pick_bn_waiting(1024, 16384, 131), 128);
        assert_eq!(pick_bn_waiting(3584, 8192, 131), 256);
        assert_eq!(pick_bn_waiting(2048, 16384, 131), 256);
    }

    #[test]
    fn reduce_scatter_pieces_fit_one_round_of_tiles() {
        // The e4m3 / bf16 RS anchors at tp 4 and 8 (rows per block, m, n) on 131 SMs: only
        // 16384 x 2048 x 8192 at tp 4 (1024 tiles a block) needs more than 4 pieces.
        for (rows, m, n, want) in [
            (2048, 8192, 8192, 4),
            (2048, 4096, 8192, 4),
            (4096, 8192, 16384, 8),
            (1024, 8192, 8192, 4),
            (1024, 4096, 8192, 4),
            (2048, 8192, 16384, 4),
        ] {
            assert_eq!(rs_pieces(4, rows, m, n, 131, false), want, "{rows} x {m}");
        }
        assert_eq!(rs_pieces(1, 4096, 8192, 16384, 131, false), 1); // whole blocks stay whole
        assert_eq!(rs_pieces(16, 4096, 8192, 16384, 131, false), 16); // the tuner's more stays
        assert_eq!(rs_pieces(4, 4000, 8192, 16000, 131, false), 4); // not whole tile rows
        // One tile row is more than a round: every tile row its own piece.
        assert_eq!(rs_pieces(2, 512, 65536, 4096, 131, false), 4);
        // 3 tile rows of 64 tiles: 3 pieces (the fewest dividing the block).
        assert_eq!(rs_pieces(2, 384, 16384, 3072, 131, false), 3);
        // Narrow (128-wide) tiles: twice the tiles a row, so pieces of half the rows where a
        // piece would no longer fit (tp 4 16384 x 2048 x 8192: 16 pieces); the tp-8 8192 x
        // 2048 x 4096 row's 4 pieces (64 narrow tiles each) still fit.
        assert_eq!(rs_pieces(4, 4096, 8192, 16384, 131, true), 16);
        assert_eq!(rs_pieces(4, 1024, 4096, 8192, 131, true), 4);
    }

    #[test]
    fn narrow_hooks_take_128_wide_tiles() {
        let g = tn(8192, 8192, 4096, DType::E4M3);
        let done = Hooks {
            done: DevPtr::new(4096),
            done_rows: 256,
            ..Default::default()
        };
        let flags = Hooks {
            flags: DevPtr::new(4096),
            rows_per_flag: 1024,
            k_pieces: 4,
            ..Default::default()
        };
        for h in [done, flags] {
            assert_eq!(pick_tile(&g, &h, 131), 256);
            let narrow = Hooks { narrow: true, ..h };
            assert_eq!(pick_tile(&g, &narrow, 131), 128);
        }
    }

    /// The ping-pong width where the eleventh session measured it faster (e4m3 and bf16 at
    /// m = 8192 with short k), the cooperative ones where it was slower or even; never for
    /// fp32 D (no such kernel) or a GEMM that waits on arrival flags.
    #[test]
    fn the_tile_rule_takes_pingpong_where_it_was_measured_faster() {
        let tile = |m, n, k, t, h: &Hooks, sms| pick_tile(&tn(m, n, k, t), h, sms);
        let none = Hooks::default();
        let (e4, bf) = (DType::E4M3, DType::BF16);
        for (m, n, k) in [
            (8192, 8192, 4096),
            (8192, 8192, 3584),
            (8192, 16384, 2048),
            (8192, 16384, 1024),
        ] {
            assert_eq!(tile(m, n, k, e4, &none, 132), 192, "e4m3 {m} x {n} x {k}");
        }
        for (m, n, k) in [(8192, 16384, 1024), (8192, 16384, 2048)] {
            assert_eq!(tile(m, n, k, bf, &none, 132), 192, "bf16 {m} x {n} x {k}");
        }
        for (m, n, k, t) in [
            (4096, 8192, 4096, e4),
            (7168, 8192, 8192, e4),
            (2048, 16384, 8192, e4),
            (3584, 8192, 8192, e4),
            (1024, 16384, 8192, e4),
            (14336, 8192, 8192, e4),
            (2048, 8192, 4096, e4),
            (8192, 8192, 3584, bf),
            (8192, 8192, 4096, bf),
            (7168, 8192, 8192, bf),
        ] {
            assert_eq!(tile(m, n, k, t, &none, 132), 256, "{t:?} {m} x {n} x {k}");
        }
        // One SM fewer: 8192 x 3584 needs a 22nd ping-pong round (2752 tiles on 131 CTAs).
        assert_eq!(tile(8192, 8192, 3584, e4, &none, 131), 256);
        // A single round of ping-pong tiles (one a CTA at most): cooperative.
        assert_ne!(tile(1024, 1024, 1024, bf, &none, 132), 192);
        assert_ne!(tile(128, 128, 64, e4, &none, 132), 192);
        // Short K: the stores bound both kernels (NVTE_COMM_OWN_GEMM's small GEMMs).
        assert_ne!(tile(3072, 4096, 64, bf, &none, 132), 192);
        assert_ne!(tile(8192, 4096, 64, e4, &none, 132), 192);
        // Overlapped GEMMs (done signals, arrival flags) keep the cooperative widths.
        let done = Hooks {
            done: DevPtr::new(4096),
            done_rows: 1024,
            ..Default::default()
        };
        assert_eq!(tile(8192, 16384, 1024, e4, &done, 132), 256);
        let flags = Hooks {
            flags: DevPtr::new(4096),
            rows_per_flag: 2048,
            ..Default::default()
        };
        assert_eq!(tile(8192, 16384, 1024, e4, &flags, 132), 256);
        let mut g = tn(8192, 16384, 1024, e4);
        g.d_type = DType::F32;
        assert_eq!(pick_tile(&g, &none, 132), 256);
        // test_fused's all-gather cases that run it at one rank (no flags there).
        assert_eq!(tile(3072, 4096, 1024, bf, &none, 132), 192);
        assert_eq!(tile(3072, 4096, 1024, e4, &none, 132), 192);
    }
}
