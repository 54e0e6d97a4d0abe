// A persistent, warp-specialized Hopper GEMM of our own (issue 22), for sm_90a,
// self-contained (NVRTC 13 ships no cuda_bf16.h / cuda_fp8.h; everything below is inline
// PTX). The library (src/gemm/sm90.rs) launches the plain TN kernels for its fused
// (atomic) all-gather and ring reduce-scatter, compiling only those (GEMM90_NO_*);
// bench/own_gemm.cpp (scripts/own-gemm-gpu.sh) checks every kernel against cuBLASLt:
// on one H100 (2026-11-27, twelfth session, with the staged epilogue) the plain TN
// kernels, with the tile rule's widths (the BN-192 ping-pong kernel on one anchor), were
// correct on every case and ran at 0.997-0.999 of cuBLASLt's speed (bf16 geomean over the
// per-rank anchor shapes at tp 2/4/8, worst 0.981) and 1.000-1.012 (e4m3, worst 0.963),
// with pre-set arrival flags costing 0.4-0.5 %. The _epi / _fpacc kernels and the NN / NT
// layouts (below) were correct on every feature case as well (452 cases, bench/RESULTS.md).
//
// Layouts (nvte_cublas_gemm's transa / transb, row-major names; fp32 accumulation):
// - TN: D[n, m] = B[n, k] . A[m, k]^T, K contiguous for both operands;
// - NN: D[n, m] = B[n, k] . A[k, m] (A's m contiguous: TE's dgrad);
// - NT: D[n, m] = B[k, n]^T . A[k, m] (both MN-contiguous: TE's wgrad).
// In wgmma's terms B is the "A" operand (rows = wgmma M) and A the "B" operand (rows =
// wgmma N); K-major operands use the default wgmma layout, MN-major ones (16-bit types
// only: wgmma has no transposed FP8) the transpose bits and MN-major descriptors.
//
// Kernel names: gemm_sm90_<layout>_<a>_<b>_<out>_<BN>[_<variant>], layout tn / nn / nt,
// a / b the types of A / B (bf16, f16, e4m3, e5m2), out the type of D (bf16, f16, f32,
// e4m3, e5m2), BN 256, 192 (ping-pong, plain only) or 128, variant:
// - (none) plain, the fast path: epilogue must be 0; d_scale / d_amax / bias / aux unused;
// - _epi: Gemm90Args::epilogue, a bit set: EPI_BIAS = 1, EPI_GELU = 2 (with aux when
//   aux != null), EPI_ACCUM = 4 (see "Epilogue" below); 0 = none;
//   FP8 D (D = saturate(result * *d_scale)), d_amax (when non-null: atomicMax of
//   max |result| before scaling, on the float's bits: *d_amax must start at 0 (or at a
//   running maximum));
// - _fpacc: _epi plus full-precision FP8 accumulation (TE's use_split_accumulator,
//   cuBLASLt FAST_ACCUM = 0): each 128-deep K stage is accumulated by wgmma into a zeroed
//   fp32 set, then added into the main accumulators; BN 128 only (two 64-register sets).
// - _block: _fpacc's main loop with TE's block scales (Float8BlockScaling, 1D / 2D; see
//   "block-scaled FP8" below) applied to each stage's partial sums; e4m3 x e4m3, BN 128,
//   16/32-bit D, epilogue bits EPI_BIAS / EPI_ACCUM; no arrival flags or done signals.
// Instantiated, 67 kernels (what TE uses; NVRTC time grows with every kernel: ~0.5 s
// each, 33-36 s for the whole file on a 2-core x86 host, 2.3 s for the plain ones):
// - plain: tn bf16 x bf16 and e4m3 x e4m3 -> bf16, f32; BN 256, 128 (8); -> bf16, BN 192
//   (ping-pong, 2);
// - _epi, tn: bf16 x bf16 -> bf16, f32; f16 x f16 -> f16, f32; e4m3 x e4m3 -> bf16, f16,
//   f32, e4m3, e5m2; e4m3 x e5m2 and e5m2 x e4m3 (TE's backward GEMMs; e5m2 x e5m2 is not
//   supported, as in cuBLASLt) -> bf16, f16, f32; BN 256, 128 (30);
// - _fpacc, tn, BN 128: e4m3 x e4m3 -> bf16, f16, f32, e4m3; e4m3 x e5m2 and e5m2 x e4m3
//   -> bf16, f32 (8);
// - _epi, nn and nt: bf16 x bf16 -> bf16, f32; f16 x f16 -> f16, f32; BN 256, 128 (16);
// - _block, tn, BN 128: e4m3 x e4m3 -> bf16, f16, f32 (3).
// Groups of them can be left out at compile time (-D or a #define before the source):
// GEMM90_NO_EPI (all _epi tn), GEMM90_NO_FPACC, GEMM90_NO_NN_NT, GEMM90_NO_BLOCK,
// GEMM90_NO_PLAIN (the plain and ping-pong ones). (The library's modules, src/cuda/nvrtc.rs:
// GEMM_SM90 keeps the plain kernels, GEMM_SM90_BLOCK the _block ones, compiled and loaded
// only when a block-scaled GEMM asks for our kernel.)
//
// Epilogue (_epi, _fpacc), in cuBLASLt's order: v = scale * acc (scale = a_scale_inv *
// b_scale_inv for FP8 inputs, else 1); EPI_ACCUM: v += beta * D_old (16/32-bit D; TE's
// accumulate is beta = 1); EPI_BIAS: v += bias[col] (bias: m elements, one per column of
// D); EPI_GELU: aux[row, col] = v when aux != null (TE's pre_gelu_out), v = gelu(v)
// (tanh approximation, as cuBLASLt's GELU / GELU_AUX epilogues); amax; FP8 D:
// v = saturate(v * d_scale) (satfinite: +-448 / +-57344, NaN stays NaN). bias and aux
// have D's type for 16/32-bit D and bf16 for FP8 D.
//
// Structure (one CTA per SM, 384 threads):
// - warpgroup 0, the producer: one thread walks the CTA's tiles and issues the TMA loads
//   (cp.async.bulk.tensor, 128B swizzle) of each K slice into a ring of STAGES shared
//   memory stages guarded by full / empty mbarriers (expect_tx on full); an MN-major
//   operand takes one {64 x 64} box per 64 rows of the tile;
// - warpgroups 1 and 2, the consumers: each owns 64 of the tile's 128 rows of D and issues
//   wgmma.mma_async m64nBNk16 (16-bit) or m64nBNk32 (FP8) from the stage, keeps one K
//   slice of wgmma in flight (not in _fpacc, which waits for each stage's partial sums),
//   releases a stage when its wgmma has retired, then stores its accumulators
//   (bounds-checked; the plain bf16-out cooperative kernels through a per-warp staging
//   chunk of shared memory, see store_tile_staged; the others straight from registers).
//   BN 192 (ping-pong): each consumer warpgroup owns every other tile of its CTA, all
//   128 rows (see pingpong_tiles).
// - tiles: 128 rows of D (n) x BN columns (m, 256, 192 or 128), K slices of 128 bytes (64
//   16-bit or 128 FP8 elements); a static persistent schedule (tile = blockIdx.x + i *
//   gridDim.x) in grouped rasterization: `group_n` tile rows at a time, columns within a
//   group, tile rows rotated by `n_tile_rot` (so that a chosen row block, e.g. the local
//   one in AG, comes first). The host's choice of BN and group_n: pick_tile in
//   src/gemm/sm90.rs (bench/own_gemm.cpp mirrors it).
// - AG hook: with `flags` non-null, before loading the first K slice of a tile the
//   producer spins (ld.acquire.sys) until flags[r] has reached flag_value for every row
//   block r (`rows_per_flag` rows of B each) the tile's rows touch, then fences the
//   generic proxy against the async (TMA) proxy; a block once seen is not read again by
//   that CTA. flags == nullptr (or rows_per_flag <= 0): no waits. Scope .sys: the flags
//   are set by copy engines or peer GPUs. With k_pieces > 1 a block arrives as k_pieces K
//   slices (flag r * k_pieces + c for slice c): the producer waits for each slice before
//   loading that slice's first K block, so that a block's tiles run while it still
//   arrives.
//   A wait gives up after `stall_ns` (with `stall` non-null): it records the flag in
//   `stall` and the tile goes on with whatever B holds, so that a launch whose flags
//   never come (their writers starved of SMs, a peer gone) ends instead of hanging; the
//   host turns the record into an error (see wait_row_blocks).
// - RS hook: see signal_done.
// - Side copy (copy_bytes != 0): see side_copy.
//
// Knobs (-D at compile time): GEMM90_STAGES_256 / _192 / _128 (pipeline depth, 4 / 5 / 6),
// GEMM90_SIGNAL_WARP (who runs the RS done signals and how, default 2: see its definition),
// GEMM90_EPI_STAGED (the plain bf16-out cooperative kernels' staged epilogue, default 1:
// see store_tile_staged), GEMM90_EPI_WIDE (16-byte epilogue stores of the other plain
// kernels, default 1: 0.996 vs 0.929 of cuBLASLt, bf16, H100, 2026-11-26; the _epi
// epilogue always stores wide).
//
// Constraints (not checked here; a caller must, bench/own_gemm.cpp runs only shapes that
// meet them): k > 0; every TMA row stride a multiple of 16 bytes: TN k * sizeof(in)
// (k % 8 for 16-bit, k % 16 for FP8), NN k % 8 and m % 8, NT m % 8 and n % 8 (k of any
// size there); m a multiple of 8, any n >= 1; A, B, D, aux, bias 16-byte aligned,
// ldd == m (aux likewise); partial tiles are handled by TMA's zero fill (loads) and
// predicated stores. FP8: TN only, scale_inv pointers (a_scale_inv * b_scale_inv applied
// in the epilogue), FP8 D only from FP8 inputs; EPI_ACCUM not with FP8 D.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

// The driver's CUtensorMap: 128 opaque bytes, 64-byte aligned, made on the host by
// cuTensorMapEncodeTiled and passed by value as a __grid_constant__ kernel parameter.
struct __align__(64) GemmTmaDesc {
  u64 opaque[16];
};
static_assert(sizeof(GemmTmaDesc) == 128, "a CUtensorMap: 128 bytes");

// The kernel's arguments besides the two tensor maps (one struct, passed by value as a
// __grid_constant__ parameter; hosts mirror it field for field: 8-byte pointers first,
// then 4-byte fields, no padding). Fields marked "_epi" are read by _epi / _fpacc
// kernels only (plain kernels ignore them: keep them null / 0 there).
struct Gemm90Args {
  void *d;                   // D [n, m] row-major (ldd == m)
  const void *bias;          // _epi, EPI_BIAS: bias [m] (D's type; bf16 for FP8 D)
  void *aux;                 // _epi, EPI_GELU: pre-GELU output [n, m] (bias's type), or null
  const float *a_scale_inv;  // FP8 inputs: read when the inputs are FP8
  const float *b_scale_inv;
  const float *d_scale;      // _epi, FP8 D: D = saturate(result * *d_scale) (null: 1)
  float *d_amax;             // _epi: atomicMax(max |result|) before scaling, or null
  const unsigned *flags;     // AG arrivals, or null: see wait_row_blocks
  unsigned *done;            // RS signals, or null: see signal_done
  int m, n, k;
  int rows_per_flag;         // rows of B (and of D) per arrival flag (<= 0: no waits)
  int done_rows;             // rows of D per done signal (<= 0: none)
  int group_n;               // grouped rasterization: tile rows per group
  int n_tile_rot;            // tile rows rotated by this many (the first one computed first)
  unsigned flag_value;       // a row block has arrived once (int)(flag - flag_value) >= 0
  unsigned done_value;       // written to done[j] when row block j of D is stored
  float beta;                // _epi, EPI_ACCUM: D = beta * D_old + result (TE: 1)
  int epilogue;              // _epi: EPI_* bits (gemm90 namespace); plain kernels: 0
  int k_pieces;              // AG: arrival flags per row block, one per K slice (<= 1: one)
  const void *copy_src;      // side copy (see side_copy): copy_bytes from copy_src to
  void *copy_dst;            // copy_dst, beside the GEMM (0 bytes: none)
  u64 copy_bytes;
  unsigned *stall;           // AG: the record of a wait that gave up, or null (never gives up):
  u64 stall_ns;              // {flag + 1, claim, waited ns (u64)}; see wait_row_blocks
};
static_assert(sizeof(Gemm90Args) == 160,
              "hosts mirror Gemm90Args: 9 pointers, 12 4-byte fields, 3 pointers, 2 u64");

namespace gemm90 {

constexpr int BM = 128;               // rows of D per tile (n), 64 per consumer warpgroup
constexpr int K_BYTES = 128;          // bytes of K per stage: one 128B-swizzle row
constexpr int THREADS = 384;          // producer warpgroup + 2 consumer warpgroups
constexpr int CONSUMER_WARPS = 8;     // arrivals on an empty barrier per use

__device__ __forceinline__ u32 smem_u32(const void *p) {
  return (u32)__cvta_generic_to_shared(p);
}

// ---- mbarrier ----
__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx(u32 bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
// Wait until the phase of parity `parity` has completed (a fresh barrier is in phase 0,
// so waiting on parity 1 returns at once: the producer's first pass over the ring).
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
  u32 done;
  do {
    asm volatile(
        "{\n.reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}

// ---- TMA ----
__device__ __forceinline__ void tma_prefetch_desc(const GemmTmaDesc *d) {
  asm volatile("prefetch.tensormap [%0];" ::"l"((u64)d) : "memory");
}
// 2D tile load: c0 = element index along K (inner), c1 = row; completes on `bar`.
__device__ __forceinline__ void tma_load_2d(u32 dst, const GemmTmaDesc *d, u32 bar, int c0,
                                            int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4}], [%2];" ::"r"(dst),
      "l"((u64)d), "r"(bar), "r"(c0), "r"(c1)
      : "memory");
}

// ---- wgmma ----
// Shared-memory matrix descriptor of a K-major tile in the 128B swizzle as TMA writes
// it: rows of 128 bytes, 8-row (1024-byte) swizzle atoms stacked along M/N. Start address
// bits 0-13 (>> 4), leading byte offset bits 16-29 (unused for swizzled K-major, 1 by
// convention), stride byte offset bits 32-45 (1024 >> 4: from one 8-row group to the
// next), base offset bits 49-51 (0: stages are 1024-aligned), layout bits 62-63 (1 =
// 128B swizzle). The k-th 32-byte step along K inside the row adds 32 bytes (2 in the
// >>4 units) to the start address; the hardware applies the swizzle to the final address.
__device__ __forceinline__ u64 smem_desc_sw128(u32 addr) {
  u64 d = 0;
  d |= (u64)((addr & 0x3FFFF) >> 4);
  d |= (u64)1 << 16;
  d |= (u64)(1024 >> 4) << 32;
  d |= (u64)1 << 62;
  return d;
}
// The same for an MN-major tile (16-bit types only; NN / NT layouts) as TMA writes it from
// boxes of {64 elements along M/N (128 bytes), 64 rows along K}: each K row is 128 bytes
// of 64 consecutive M/N elements, 8 K rows make a 1024-byte swizzle atom; the stride
// byte offset (bits 32-45) steps 8 rows along K (1024 bytes), the leading byte offset
// (bits 16-29) steps 64 elements along M/N (the next box: 64 rows x 128 bytes = 8 KiB).
// A K step of 16 elements inside the stage adds 16 rows (2048 bytes, 128 in >> 4 units).
constexpr int MN_BOX_BYTES = 64 * 128;
__device__ __forceinline__ u64 smem_desc_sw128_mn(u32 addr) {
  u64 d = 0;
  d |= (u64)((addr & 0x3FFFF) >> 4);
  d |= (u64)(MN_BOX_BYTES >> 4) << 16;
  d |= (u64)(1024 >> 4) << 32;
  d |= (u64)1 << 62;
  return d;
}
__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// Keeps the compiler from moving accumulator reads/writes across the asm above.
template <int R>
__device__ __forceinline__ void fence_regs(float (&d)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// wgmma wrappers: d = (scale_d ? d : 0) + A.B over one K step, operands from descriptors.
// The accumulator operands "+f"(d[o]) .. "+f"(d[o + 7]); 64 from o; all 128.
#define WG_D8(o)                                                                          \
  "+f"(d[(o)]), "+f"(d[(o) + 1]), "+f"(d[(o) + 2]), "+f"(d[(o) + 3]), "+f"(d[(o) + 4]),   \
      "+f"(d[(o) + 5]), "+f"(d[(o) + 6]), "+f"(d[(o) + 7])
#define WG_D64(o)                                                                         \
  WG_D8(o), WG_D8((o) + 8), WG_D8((o) + 16), WG_D8((o) + 24), WG_D8((o) + 32),            \
      WG_D8((o) + 40), WG_D8((o) + 48), WG_D8((o) + 56)
#define WG_D128 WG_D64(0), WG_D64(64)
#define WG_D96 WG_D64(0), WG_D8(64), WG_D8(72), WG_D8(80), WG_D8(88)
// Their placeholders in the instruction: %0 .. %63, %0 .. %127.
#define WG_R64 \
  "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15," \
  "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31," \
  "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47," \
  "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63"
#define WG_R96 \
  "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15," \
  "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31," \
  "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47," \
  "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63," \
  "%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79," \
  "%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95"
#define WG_R128 \
  "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15," \
  "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31," \
  "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47," \
  "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63," \
  "%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79," \
  "%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95," \
  "%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111," \
  "%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127"
// NAME(d[NR], da, db, scale_d): one wgmma.mma_async.SHAPE; TAIL: the operands after the
// scale-d predicate; IA / IB / IS: the operand numbers of da, db and scale_d.
#define WGMMA_FN(NAME, NR, SHAPE, TAIL, REGS, DOPS, IA, IB, IS)                            \
  __device__ __forceinline__ void NAME(float(&d)[NR], u64 da, u64 db, u32 scale_d) {      \
    asm volatile(                                                                         \
        "{\n.reg .pred p;\n"                                                              \
        "setp.ne.b32 p, %" IS ", 0;\n"                                                    \
        "wgmma.mma_async.sync.aligned." SHAPE " {" REGS "},"                              \
        " %" IA ", %" IB ", p, " TAIL ";\n}\n"                                            \
        : DOPS                                                                            \
        : "l"(da), "l"(db), "r"(scale_d));                                                \
  }
// Operand types (template parameters and kernel names): our A [m, k] is wgmma's B
// operand, our B [n, k] wgmma's A operand, so an FP8 wgmma names B's type first.
// Transpose bits (16-bit types only): tnspA = our B is MN-major (NT), tnspB = our A is
// MN-major (NN, NT).
WGMMA_FN(wgmma_bf16_n256, 128, "m64n256k16.f32.bf16.bf16", "1, 1, 0, 0", WG_R128, WG_D128, "128", "129", "130")
WGMMA_FN(wgmma_e4m3_n256, 128, "m64n256k32.f32.e4m3.e4m3", "1, 1", WG_R128, WG_D128, "128", "129", "130")
WGMMA_FN(wgmma_bf16_n128, 64, "m64n128k16.f32.bf16.bf16", "1, 1, 0, 0", WG_R64, WG_D64(0), "64", "65", "66")
WGMMA_FN(wgmma_e4m3_n128, 64, "m64n128k32.f32.e4m3.e4m3", "1, 1", WG_R64, WG_D64(0), "64", "65", "66")
WGMMA_FN(wgmma_f16_n256, 128, "m64n256k16.f32.f16.f16", "1, 1, 0, 0", WG_R128, WG_D128, "128", "129", "130")
WGMMA_FN(wgmma_f16_n128, 64, "m64n128k16.f32.f16.f16", "1, 1, 0, 0", WG_R64, WG_D64(0), "64", "65", "66")
WGMMA_FN(wgmma_bf16_nn_n256, 128, "m64n256k16.f32.bf16.bf16", "1, 1, 0, 1", WG_R128, WG_D128, "128", "129", "130")
WGMMA_FN(wgmma_bf16_nn_n128, 64, "m64n128k16.f32.bf16.bf16", "1, 1, 0, 1", WG_R64, WG_D64(0), "64", "65", "66")
WGMMA_FN(wgmma_f16_nn_n256, 128, "m64n256k16.f32.f16.f16", "1, 1, 0, 1", WG_R128, WG_D128, "128", "129", "130")
WGMMA_FN(wgmma_f16_nn_n128, 64, "m64n128k16.f32.f16.f16", "1, 1, 0, 1", WG_R64, WG_D64(0), "64", "65", "66")
WGMMA_FN(wgmma_bf16_nt_n256, 128, "m64n256k16.f32.bf16.bf16", "1, 1, 1, 1", WG_R128, WG_D128, "128", "129", "130")
WGMMA_FN(wgmma_bf16_nt_n128, 64, "m64n128k16.f32.bf16.bf16", "1, 1, 1, 1", WG_R64, WG_D64(0), "64", "65", "66")
WGMMA_FN(wgmma_f16_nt_n256, 128, "m64n256k16.f32.f16.f16", "1, 1, 1, 1", WG_R128, WG_D128, "128", "129", "130")
WGMMA_FN(wgmma_f16_nt_n128, 64, "m64n128k16.f32.f16.f16", "1, 1, 1, 1", WG_R64, WG_D64(0), "64", "65", "66")
// n192: the ping-pong tiles' wgmmas (plain TN kernels, see pingpong_tiles).
WGMMA_FN(wgmma_bf16_n192, 96, "m64n192k16.f32.bf16.bf16", "1, 1, 0, 0", WG_R96, WG_D96, "96", "97", "98")
WGMMA_FN(wgmma_e4m3_n192, 96, "m64n192k32.f32.e4m3.e4m3", "1, 1", WG_R96, WG_D96, "96", "97", "98")
// FP8 mixes, wgmma's A (our B) type first: e5m2.e4m3 = A e4m3 x B e5m2.
WGMMA_FN(wgmma_e5m2_e4m3_n256, 128, "m64n256k32.f32.e5m2.e4m3", "1, 1", WG_R128, WG_D128, "128", "129", "130")
WGMMA_FN(wgmma_e5m2_e4m3_n128, 64, "m64n128k32.f32.e5m2.e4m3", "1, 1", WG_R64, WG_D64(0), "64", "65", "66")
WGMMA_FN(wgmma_e4m3_e5m2_n256, 128, "m64n256k32.f32.e4m3.e5m2", "1, 1", WG_R128, WG_D128, "128", "129", "130")
WGMMA_FN(wgmma_e4m3_e5m2_n128, 64, "m64n128k32.f32.e4m3.e5m2", "1, 1", WG_R64, WG_D64(0), "64", "65", "66")

// Element types (kernel template parameters and name parts).
enum : int { T_BF16 = 0, T_F16 = 1, T_E4M3 = 2, T_E5M2 = 3, T_F32 = 4 };
__host__ __device__ constexpr bool is_fp8(int t) { return t == T_E4M3 || t == T_E5M2; }
__host__ __device__ constexpr int type_bytes(int t) { return t == T_F32 ? 4 : is_fp8(t) ? 1 : 2; }
// Layouts (nvte_cublas_gemm's transa / transb): TN: A [m, k], B [n, k] (both K-major);
// NN: A [k, m] (MN-major), B [n, k]; NT: A [k, m], B [k, n] (both MN-major).
enum : int { L_TN = 0, L_NN = 1, L_NT = 2 };

// One K step (16 or 32 elements) of the tile: TA / TB the types of our A / B.
template <int BN, int TA, int TB, int L>
__device__ __forceinline__ void wgmma_tile(float (&d)[BN / 2], u64 da, u64 db, u32 s) {
  if constexpr (BN == 256) {
    if constexpr (TA == T_BF16 && L == L_TN) wgmma_bf16_n256(d, da, db, s);
    else if constexpr (TA == T_BF16 && L == L_NN) wgmma_bf16_nn_n256(d, da, db, s);
    else if constexpr (TA == T_BF16 && L == L_NT) wgmma_bf16_nt_n256(d, da, db, s);
    else if constexpr (TA == T_F16 && L == L_TN) wgmma_f16_n256(d, da, db, s);
    else if constexpr (TA == T_F16 && L == L_NN) wgmma_f16_nn_n256(d, da, db, s);
    else if constexpr (TA == T_F16 && L == L_NT) wgmma_f16_nt_n256(d, da, db, s);
    else if constexpr (TA == T_E4M3 && TB == T_E4M3) wgmma_e4m3_n256(d, da, db, s);
    else if constexpr (TA == T_E4M3 && TB == T_E5M2) wgmma_e5m2_e4m3_n256(d, da, db, s);
    else if constexpr (TA == T_E5M2 && TB == T_E4M3) wgmma_e4m3_e5m2_n256(d, da, db, s);
  } else {
    if constexpr (TA == T_BF16 && L == L_TN) wgmma_bf16_n128(d, da, db, s);
    else if constexpr (TA == T_BF16 && L == L_NN) wgmma_bf16_nn_n128(d, da, db, s);
    else if constexpr (TA == T_BF16 && L == L_NT) wgmma_bf16_nt_n128(d, da, db, s);
    else if constexpr (TA == T_F16 && L == L_TN) wgmma_f16_n128(d, da, db, s);
    else if constexpr (TA == T_F16 && L == L_NN) wgmma_f16_nn_n128(d, da, db, s);
    else if constexpr (TA == T_F16 && L == L_NT) wgmma_f16_nt_n128(d, da, db, s);
    else if constexpr (TA == T_E4M3 && TB == T_E4M3) wgmma_e4m3_n128(d, da, db, s);
    else if constexpr (TA == T_E4M3 && TB == T_E5M2) wgmma_e5m2_e4m3_n128(d, da, db, s);
    else if constexpr (TA == T_E5M2 && TB == T_E4M3) wgmma_e4m3_e5m2_n128(d, da, db, s);
  }
}

// ---- schedule ----
// Linear tile index -> (tile row tn over n, tile column tm over m): `group_n` tile rows
// at a time, walking columns within the group (tile rows fastest), then rotated by `rot`.
__device__ __forceinline__ void tile_coords(int t, int tiles_n, int tiles_m, int group_n,
                                            int rot, int &tn, int &tm) {
  int per_group = group_n * tiles_m;
  int g = t / per_group;
  int first = g * group_n;
  int gs = min(group_n, tiles_n - first);
  int r = t - g * per_group;
  tn = first + r % gs;
  tm = r / gs;
  tn += rot;
  if (tn >= tiles_n) tn -= tiles_n;
}

// Side copy: `bytes` (a multiple of 16; both pointers 16-byte aligned, the host checks)
// from `src` to `dst`, by the producer warpgroup's warps 1-3 of every CTA (idle otherwise:
// one thread issues the loads), 16 bytes a thread per step, while the GEMM runs. Ordered
// with nothing in the GEMM (the caller passes a copy the GEMM does not read or write);
// done when the kernel is. Lets a caller that needs a copy beside a GEMM (the tp-1
// all-gather's shard into its buffer) launch one kernel instead of two.
__device__ __forceinline__ void side_copy(const void *src, void *dst, u64 bytes) {
  const uint4 *s = reinterpret_cast<const uint4 *>(src);
  uint4 *d = reinterpret_cast<uint4 *>(dst);
  const u64 n = bytes / 16, step = (u64)gridDim.x * 96;
  for (u64 i = (u64)blockIdx.x * 96 + (threadIdx.x - 32); i < n; i += step) d[i] = s[i];
}

__device__ __forceinline__ u32 ld_acquire_flag(const u32 *p) {
  u32 v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Spin until every row block of B that rows [row0, row1) touch has arrived (its flag has
// reached `value`, wrap-around safe, so that a caller may count epochs instead of
// resetting flags), then order
// the TMA (async proxy) reads that follow after the acquire (generic proxy). Block r's flag
// is flags[r * k_pieces + c]: K slice c of it where blocks arrive in k_pieces K slices,
// else k_pieces = 1, c = 0. Flags only go from 0 to non-zero during a launch, so a flag
// seen set (bit r * k_pieces + c of `seen`, for the first 64 flags) is not read again: a
// CTA pays one acquire per flag, not per tile.
// With `stall` non-null, a flag not set within `stall_ns` (globaltimer) is given up: the
// first CTA to give up claims stall[1], writes the time it waited into stall[2..3], then
// publishes stall[0] = flag + 1 (host-mapped: a host that sees stall[0] set also sees the
// time); every other wait of the launch sees stall[1] claimed at its next look and gives
// up at once, so that a launch whose flags never come costs one stall_ns, not one per
// flag.
__device__ __forceinline__ u64 gemm_globaltimer() {
  u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ void wait_row_blocks(const u32 *flags, int rows_per_flag, int k_pieces, int c,
                                                u32 value, int row0, int row1, u64 &seen, u32 *stall,
                                                u64 stall_ns) {
  bool acquired = false;
  for (int r = row0 / rows_per_flag; r <= (row1 - 1) / rows_per_flag; ++r) {
    const int f = r * k_pieces + c;
    if (f < 64 && ((seen >> f) & 1)) continue;
    u64 t0 = 0;
    u32 polls = 0;
    // Back off between polls: 131 producers spinning flat out on sys-scope loads slowed
    // copy-engine arrivals several-fold (emulated link, H100, 2026-11-26).
    while ((int)(ld_acquire_flag(flags + f) - value) < 0) {
      asm volatile("nanosleep.u32 256;" ::: "memory");
      if (stall != nullptr && (++polls & 255) == 0) {  // a look at the clock every ~100 us
        if (*(volatile u32 *)(stall + 1) != 0) break;  // another wait gave up: so does this one
        const u64 now = gemm_globaltimer();
        if (t0 == 0) {
          t0 = now;
        } else if (now - t0 > stall_ns) {
          if (atomicCAS(stall + 1, 0u, 1u) == 0u) {  // claimed: the time, then the flag last
            *(volatile u64 *)(stall + 2) = now - t0;
            __threadfence_system();
            *(volatile u32 *)stall = (u32)f + 1u;
            __threadfence_system();
          }
          break;
        }
      }
    }
    if (f < 64) seen |= 1ull << f;
    acquired = true;
  }
  if (acquired) asm volatile("fence.proxy.async.global;" ::: "memory");
}

__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
  u32 r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// Epilogue knob: 0 stores each thread's column pairs straight from the
// fragments (4- or 8-byte stores); 1 first transposes the pairs across each quad of lanes
// so that every thread stores 8 consecutive columns (default; 16-byte stores, 64 contiguous bytes
// per row per quad).
#ifndef GEMM90_EPI_WIDE
#define GEMM90_EPI_WIDE 1
#endif

// One butterfly stage of quad_transpose: the lanes whose bit `bit` is set send their
// (a_lo, b_lo) and receive into them, the others send and receive (a_hi, b_hi).
__device__ __forceinline__ void quad_swap(u32 &a_lo, u32 &a_hi, u32 &b_lo, u32 &b_hi, bool hi,
                                          int bit) {
  u32 a = hi ? a_lo : a_hi, b = hi ? b_lo : b_hi;
  a = __shfl_xor_sync(0xffffffffu, a, bit);
  b = __shfl_xor_sync(0xffffffffu, b, bit);
  if (hi) {
    a_lo = a;
    b_lo = b;
  } else {
    a_hi = a;
    b_hi = b;
  }
}

// 4 x 4 transpose across the lanes of a quad: lane q's slot g goes to lane g's slot q,
// in two butterfly stages (xor 1, xor 2), each swapping the slots whose bit differs
// from the lane's bit.
__device__ __forceinline__ void quad_transpose(u32 &x0, u32 &x1, u32 &x2, u32 &x3, int q) {
  quad_swap(x0, x1, x2, x3, q & 1, 1);
  quad_swap(x0, x2, x1, x3, q & 2, 2);
}

// The wide epilogue: for each block of 4 column groups (32 columns) and each of the two
// rows (row, row + 8), lane q of a quad ends up with the 8 columns of group 4 jj + q.
// Needs m % 8 == 0 (a group is all in or all out of bounds) and 16-byte aligned D.
template <int BN, bool OUT_F32>
__device__ __forceinline__ void store_tile_wide(float (&acc)[BN / 2], float scale, void *d_out,
                                                int m, int n, int row, int m0, int lane) {
  const int q = lane % 4;
#pragma unroll
  for (int jj = 0; jj < BN / 32; ++jj) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = row + 8 * h;
      const int col = m0 + 8 * (4 * jj + q);
      const bool ok = r < n && col < m;
      const u64 off = (u64)r * (u64)m + (u64)col;
      if (OUT_F32) {
        u32 lo[4], hi[4];
#pragma unroll
        for (int g = 0; g < 4; ++g) {
          lo[g] = __float_as_uint(acc[4 * (4 * jj + g) + 2 * h] * scale);
          hi[g] = __float_as_uint(acc[4 * (4 * jj + g) + 2 * h + 1] * scale);
        }
        quad_transpose(lo[0], lo[1], lo[2], lo[3], q);
        quad_transpose(hi[0], hi[1], hi[2], hi[3], q);
        if (ok) {
          uint4 *p = reinterpret_cast<uint4 *>(reinterpret_cast<float *>(d_out) + off);
          p[0] = make_uint4(lo[0], hi[0], lo[1], hi[1]);
          p[1] = make_uint4(lo[2], hi[2], lo[3], hi[3]);
        }
      } else {
        u32 x[4];
#pragma unroll
        for (int g = 0; g < 4; ++g)
          x[g] = pack_bf16x2(acc[4 * (4 * jj + g) + 2 * h] * scale,
                             acc[4 * (4 * jj + g) + 2 * h + 1] * scale);
        quad_transpose(x[0], x[1], x[2], x[3], q);
        if (ok)
          *reinterpret_cast<uint4 *>(reinterpret_cast<u16 *>(d_out) + off) =
              make_uint4(x[0], x[1], x[2], x[3]);
      }
    }
  }
}

// Staged epilogue (GEMM90_EPI_STAGED, plain cooperative kernels with bf16 D): each warp
// writes its 16 rows of the tile 64 columns at a time into a 2 KiB chunk of shared memory
// with stmatrix (8 x 8 bf16 matrices straight from the accumulator fragments: no shuffles
// or selects) in a 128-byte XOR swizzle (16-byte unit u of row r at u ^ (r % 8):
// conflict-free for stmatrix's rows and for the read-back), reads it back a full row of
// 128 bytes per 8 lanes (ld.shared.v4) and stores 16 bytes per lane, whole 128-byte lines
// of D. Two chunks per warp in turn (4 KiB a warp, 32 KiB a CTA, after the barriers). It
// replaces store_tile_wide's quad transposes (64 SHFL and ~190 SEL a thread per 128 x 256
// tile, while the tensor cores idle): on one H100 (bench/RESULTS.md, twelfth session, same
// call) our kernel alone went from 0.987 to 1.012 of cuBLASLt (e4m3 geomean over the
// per-rank anchors at tp 2/4/8) and from 0.993 to 0.999 (bf16). 0: store_tile_wide (the
// f32-out and ping-pong kernels use it either way).
#ifndef GEMM90_EPI_STAGED
#define GEMM90_EPI_STAGED 1
#endif
constexpr int EPI_CHUNK_BYTES = 16 * 128;  // a warp's 16 rows x 64 bf16 columns
constexpr int EPI_CHUNKS = 2;  // per warp, used in turn

__device__ __forceinline__ void stmatrix_x4(u32 addr, u32 r0, u32 r1, u32 r2, u32 r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(r0),
               "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}
__device__ __forceinline__ uint4 lds_v4(u32 addr) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(addr)
               : "memory");
  return v;
}

// Thread (warp, lane) holds rows row0 + lane / 4 (+ 8) of the warp's 16 (row0: the warp's
// first row of D), columns 8 j + 2 (lane % 4) (+1) for j < BN / 8 (m64nBN fragments); buf:
// the warp's two chunks. Needs m % 8 == 0 and 16-byte aligned D (as store_tile_wide).
template <int BN>
__device__ __forceinline__ void store_tile_staged(const float (&acc)[BN / 2], float scale, void *d_out, int m,
                                                  int n, int row0, int m0, int lane, u32 buf) {
  // stmatrix: lanes 8 q .. 8 q + 7 address the rows of matrix q; matrix q of step p holds
  // rows 8 (q % 2) .. +7 and columns 8 (2 p + q / 2) .. +7 of the chunk.
  const int rr = lane & 7, q = lane >> 3;
  const int r_st = 8 * (q & 1) + rr;
#pragma unroll
  for (int c = 0; c < BN / 64; ++c) {
    const u32 cb = buf + (u32)(c % EPI_CHUNKS) * EPI_CHUNK_BYTES;
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      const int u = 2 * p + (q >> 1);
      const int j = 8 * c + 2 * p;  // fragments j (matrices 0, 1) and j + 1 (2, 3)
      stmatrix_x4(cb + r_st * 128 + ((u ^ rr) << 4), pack_bf16x2(acc[4 * j] * scale, acc[4 * j + 1] * scale),
                  pack_bf16x2(acc[4 * j + 2] * scale, acc[4 * j + 3] * scale),
                  pack_bf16x2(acc[4 * j + 4] * scale, acc[4 * j + 5] * scale),
                  pack_bf16x2(acc[4 * j + 6] * scale, acc[4 * j + 7] * scale));
    }
    __syncwarp();
#pragma unroll
    for (int t = 0; t < 4; ++t) {
      const int r = (lane >> 3) + 4 * t, u = lane & 7;
      const uint4 v = lds_v4(cb + r * 128 + ((u ^ (r & 7)) << 4));
      const int row = row0 + r, col = m0 + 64 * c + 8 * u;
      if (row < n && col < m) *reinterpret_cast<uint4 *>(reinterpret_cast<u16 *>(d_out) + (u64)row * (u64)m + col) = v;
    }
    // (The next stmatrix into this chunk, two chunks on, comes after the next
    // __syncwarp: every lane's read-back above is ordered before it.)
  }
}

// Pipeline depth per tile width (a tuning knob: -D at compile time; the kernels export
// their shared memory size, gemm_sm90_smem_bytes_<BN>, so hosts need not mirror it).
#ifndef GEMM90_STAGES_256
#define GEMM90_STAGES_256 4
#endif
#ifndef GEMM90_STAGES_128
#define GEMM90_STAGES_128 6
#endif
#ifndef GEMM90_STAGES_192
#define GEMM90_STAGES_192 5
#endif

// RS done signals (GEMM90_SIGNAL_WARP, default 2): the producer warpgroup's otherwise idle
// warp 1 (the signaller) runs signal_done for each stored tile, so that its system-scope
// fence (it waits until the tile's stores are visible system-wide) does not hold up the
// consumers (a side copy, which runs first on the signaller, can: the consumers then wait
// at their second tile's hand-off until it is done). 2: every consumer thread arrives on the `stored` mbarrier after its
// stores of a tile (a release at CTA scope) and goes on to the next tile; the signaller
// waits on it (an acquire), signals, and arrives on `signalled`, which the consumers wait
// for before handing over the next tile (so the signaller never waits on a phase more
// than one ahead; in practice it has long arrived). Emulated link on one H100
// (bench/RESULTS.md, eleventh session, same call): RS fused / ideal bf16 1.047 / 1.045
// -> 1.037 / 1.035, e4m3 1.062 / 1.060 -> 1.058 / 1.058. 1: the consumers and the
// signaller meet at named barrier 1 (288 threads) after each tile, so both consumer
// warpgroups wait for each other and for the signaller (eighth session: RS bf16 1.046-1.051
// against 1.062-1.065 with 0). 0: a consumer thread signals after a 256-thread barrier.
// (The ping-pong kernels always meet their warpgroup's named barrier, 2 or 3.)
#ifndef GEMM90_SIGNAL_WARP
#define GEMM90_SIGNAL_WARP 2
#endif

template <int BN>
struct Cfg {
  static constexpr int A_BYTES = BM * K_BYTES;   // rows of B (wgmma A): 16 KiB
  static constexpr int B_BYTES = BN * K_BYTES;   // rows of A (wgmma B): 32 or 16 KiB
  static constexpr int STAGE_BYTES = A_BYTES + B_BYTES;
  static constexpr int STAGES = BN == 256 ? GEMM90_STAGES_256 : BN == 192 ? GEMM90_STAGES_192 : GEMM90_STAGES_128;
  // + barriers (full and empty per stage, the two ping-pong order barriers, the signaller's
  // two: see GEMM90_SIGNAL_WARP), + 1024 for aligning the dynamic shared memory base by hand.
  // The staged epilogue's chunks (GEMM90_EPI_STAGED; not the ping-pong kernels) after the
  // barriers, at STAGES * STAGE_BYTES + BAR_BYTES.
  static constexpr int BAR_BYTES = 1024;
  static constexpr int EPI_BYTES = (GEMM90_EPI_STAGED && BN != 192) ? 8 * EPI_CHUNKS * EPI_CHUNK_BYTES : 0;
  static constexpr int SMEM_BYTES =
      STAGES * STAGE_BYTES + (EPI_BYTES ? BAR_BYTES + EPI_BYTES : 2 * STAGES * 8 + 32) + 1024;
  static_assert(2 * STAGES * 8 + 32 <= BAR_BYTES, "barriers");
  // One CTA's dynamic shared memory on sm_90 (227 KiB). Every kernel of a width shares this
  // size (hosts read gemm_sm90_smem_bytes_<BN>), so the _epi / _fpacc / f32-out kernels
  // reserve the staging chunks too, unused.
  static_assert(SMEM_BYTES <= 232448, "shared memory over the sm_90 per-block limit");
};

// RS hook: once every tile of D that touches row block j (rows [j * done_rows, ...)) is
// stored, done[j] = done_value (st.release.sys: the stores before it are visible to a
// copy engine or peer that acquires it). done[nblk + j] (nblk = ceil(n / done_rows)) is
// block j's tile counter: zero at launch, and reset to zero by the kernel when block j
// completes, so that the next launch (or a CUDA-graph replay) finds it zero again.
// Called by one thread after both consumer warpgroups stored the tile (GEMM90_SIGNAL_WARP).
__device__ __forceinline__ void signal_done(u32 *done, int done_rows, u32 done_value, int n,
                                            int tiles_m, int n0, int n1) {
  const int nblk = (n + done_rows - 1) / done_rows;
  asm volatile("fence.acq_rel.sys;" ::: "memory");
  for (int j = n0 / done_rows; j <= (n1 - 1) / done_rows; ++j) {
    // Tiles touching block j: the tile rows overlapping it, each tiles_m tiles wide.
    const int r0 = j * done_rows, r1 = min(r0 + done_rows, n);
    const u32 need = (u32)((r1 - 1) / BM - r0 / BM + 1) * (u32)tiles_m;
    const u32 old = atomicAdd(done + nblk + j, 1u);
    if (old + 1 == need) {
      // Acquire the other tiles' counts (each released by its CTA's fence above), so that
      // their stores too come before the release below in the memory model, not only in
      // practice.
      asm volatile("fence.acq_rel.gpu;" ::: "memory");
      done[nblk + j] = 0;
      asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(done + j), "r"(done_value) : "memory");
    }
  }
}

// ---- the epilogue of the _epi / _fpacc kernels ----
// Gemm90Args::epilogue bits (read by _epi and _fpacc kernels only; plain kernels need 0).
enum : int {
  EPI_BIAS = 1,    // + bias[col] (length m; type: see epi_type)
  EPI_GELU = 2,    // D = gelu_tanh(pre); with aux != null, aux[n, m] = pre (type: epi_type)
  EPI_ACCUM = 4,   // + beta * D (the old D, read before the store; 16/32-bit D only)
};
// The type of bias and aux: D's type for 16/32-bit D, bf16 for FP8 D.
__host__ __device__ constexpr int epi_type(int to) { return is_fp8(to) ? T_BF16 : to; }

__device__ __forceinline__ float bf16_to_f32(u32 h) { return __uint_as_float(h << 16); }
__device__ __forceinline__ float f16_to_f32(u32 h) {
  float f;
  asm("{\n.reg .b16 t;\ncvt.u16.u32 t, %1;\ncvt.f32.f16 %0, t;\n}" : "=f"(f) : "r"(h));
  return f;
}
__device__ __forceinline__ u32 pack_f16x2(float lo, float hi) {
  u32 r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
// Four floats -> four saturated FP8 bytes (x0 in the lowest byte); NaN stays NaN.
template <int T>
__device__ __forceinline__ u32 pack_fp8x4(float x0, float x1, float x2, float x3) {
  u32 lo, hi;
  if constexpr (T == T_E4M3) {
    asm("{\n.reg .b16 t;\ncvt.rn.satfinite.e4m3x2.f32 t, %1, %2;\ncvt.u32.u16 %0, t;\n}" : "=r"(lo) : "f"(x1), "f"(x0));
    asm("{\n.reg .b16 t;\ncvt.rn.satfinite.e4m3x2.f32 t, %1, %2;\ncvt.u32.u16 %0, t;\n}" : "=r"(hi) : "f"(x3), "f"(x2));
  } else {
    asm("{\n.reg .b16 t;\ncvt.rn.satfinite.e5m2x2.f32 t, %1, %2;\ncvt.u32.u16 %0, t;\n}" : "=r"(lo) : "f"(x1), "f"(x0));
    asm("{\n.reg .b16 t;\ncvt.rn.satfinite.e5m2x2.f32 t, %1, %2;\ncvt.u32.u16 %0, t;\n}" : "=r"(hi) : "f"(x3), "f"(x2));
  }
  return lo | (hi << 16);
}
// 8 consecutive elements of type T at p + off (16-byte aligned for 16-bit types, 32 for
// f32) as floats, and back.
template <int T>
__device__ __forceinline__ void load8(const void *p, u64 off, float (&v)[8]) {
  if constexpr (T == T_F32) {
    const uint4 *q = reinterpret_cast<const uint4 *>(reinterpret_cast<const float *>(p) + off);
    const uint4 a = q[0], b = q[1];
    v[0] = __uint_as_float(a.x); v[1] = __uint_as_float(a.y); v[2] = __uint_as_float(a.z); v[3] = __uint_as_float(a.w);
    v[4] = __uint_as_float(b.x); v[5] = __uint_as_float(b.y); v[6] = __uint_as_float(b.z); v[7] = __uint_as_float(b.w);
  } else {
    const uint4 a = *reinterpret_cast<const uint4 *>(reinterpret_cast<const u16 *>(p) + off);
    const u32 w[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      v[2 * i] = T == T_BF16 ? bf16_to_f32(w[i] & 0xffff) : f16_to_f32(w[i] & 0xffff);
      v[2 * i + 1] = T == T_BF16 ? bf16_to_f32(w[i] >> 16) : f16_to_f32(w[i] >> 16);
    }
  }
}
template <int T>
__device__ __forceinline__ void store8(void *p, u64 off, const float (&v)[8]) {
  if constexpr (T == T_F32) {
    uint4 *q = reinterpret_cast<uint4 *>(reinterpret_cast<float *>(p) + off);
    q[0] = make_uint4(__float_as_uint(v[0]), __float_as_uint(v[1]), __float_as_uint(v[2]), __float_as_uint(v[3]));
    q[1] = make_uint4(__float_as_uint(v[4]), __float_as_uint(v[5]), __float_as_uint(v[6]), __float_as_uint(v[7]));
  } else if constexpr (is_fp8(T)) {
    *reinterpret_cast<uint2 *>(reinterpret_cast<u8 *>(p) + off) =
        make_uint2(pack_fp8x4<T>(v[0], v[1], v[2], v[3]), pack_fp8x4<T>(v[4], v[5], v[6], v[7]));
  } else {
    u32 w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
      w[i] = T == T_BF16 ? pack_bf16x2(v[2 * i], v[2 * i + 1]) : pack_f16x2(v[2 * i], v[2 * i + 1]);
    *reinterpret_cast<uint4 *>(reinterpret_cast<u16 *>(p) + off) = make_uint4(w[0], w[1], w[2], w[3]);
  }
}
// GELU, tanh approximation (as cuBLASLt's GELU epilogues):
// 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), tanh(u) = 1 - 2 / (exp(2u) + 1).
__device__ __forceinline__ float gelu_tanh(float x) {
  const float u = 0.7978845608028654f * (x + 0.044715f * x * x * x);
  float e;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(2.8853900817779268f * u));  // exp(2u)
  const float t = 1.f - __fdividef(2.f, e + 1.f);
  return 0.5f * x * (1.f + t);
}

// The _epi epilogue (the wide store's quad transpose, on floats): each lane gets 8
// consecutive columns of one row, then v = scale * acc (+ beta * D_old) (+ bias);
// aux = v; v = gelu(v); amax = max(amax, |v|); FP8 D: v *= d_scale (saturating cast).
// Needs m % 8 == 0 and 16-byte aligned D, aux and bias.
template <int BN, int TO>
__device__ __forceinline__ void store_tile_epi(float (&acc)[BN / 2], float scale, const Gemm90Args &g,
                                               int row, int m0, int lane, float d_scale, float &amax) {
  constexpr int TX = epi_type(TO);
  const int q = lane % 4;
  const int m = g.m, n = g.n, epi = g.epilogue;
#pragma unroll
  for (int jj = 0; jj < BN / 32; ++jj) {
    const int col = m0 + 8 * (4 * jj + q);
    const bool col_ok = col < m;
    float bias[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) bias[i] = 0.f;
    if ((epi & EPI_BIAS) && col_ok) load8<TX>(g.bias, (u64)col, bias);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = row + 8 * h;
      u32 lo[4], hi[4];
#pragma unroll
      for (int gg = 0; gg < 4; ++gg) {
        lo[gg] = __float_as_uint(acc[4 * (4 * jj + gg) + 2 * h] * scale);
        hi[gg] = __float_as_uint(acc[4 * (4 * jj + gg) + 2 * h + 1] * scale);
      }
      quad_transpose(lo[0], lo[1], lo[2], lo[3], q);
      quad_transpose(hi[0], hi[1], hi[2], hi[3], q);
      if (r < n && col_ok) {
        const u64 off = (u64)r * (u64)m + (u64)col;
        float v[8];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          v[2 * i] = __uint_as_float(lo[i]) + bias[2 * i];
          v[2 * i + 1] = __uint_as_float(hi[i]) + bias[2 * i + 1];
        }
        if constexpr (!is_fp8(TO)) {
          if (epi & EPI_ACCUM) {
            float old[8];
            load8<TO>(g.d, off, old);
#pragma unroll
            for (int i = 0; i < 8; ++i) v[i] = fmaf(g.beta, old[i], v[i]);
          }
        }
        if (epi & EPI_GELU) {
          if (g.aux != nullptr) store8<TX>(g.aux, off, v);
#pragma unroll
          for (int i = 0; i < 8; ++i) v[i] = gelu_tanh(v[i]);
        }
#pragma unroll
        for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(v[i]));
        if constexpr (is_fp8(TO)) {
#pragma unroll
          for (int i = 0; i < 8; ++i) v[i] *= d_scale;
        }
        store8<TO>(g.d, off, v);
      }
    }
  }
}

// Variant bits (template parameter V; kernel name suffixes): plain kernels (V = 0) have
// the fast path only (epilogue must be 0, d_scale / d_amax unused).
enum : int {
  V_EPI = 1,    // _epi: the epilogue bits, FP8 D with d_scale, d_amax
  V_FPACC = 2,  // _fpacc (FP8 in; implies V_EPI): full-precision accumulation
  V_BLOCK = 4,  // _block (e4m3 x e4m3, BN 128; implies V_EPI): block-scaled FP8 (below)
};

// ---- block-scaled FP8 (_block kernels) ----
// TE's Float8BlockScaling: one float32 scale_inv per 128 consecutive K values of a row (1D)
// or per 128 x 128 tile (2D), in TE's GEMM-ready layouts: 1D [ceil(k / 128), roundup(rows,
// 4)] (K-block major, rows contiguous), 2D [ceil(rows / 128), roundup(ceil(k / 128), 4)].
// a_scale_inv / b_scale_inv point at A's / B's (16-byte aligned); Gemm90Args::epilogue's
// BLOCK_A_2D / BLOCK_B_2D bits say which operand is 2D (else 1D). A stage is one 128-deep
// K block: its wgmmas accumulate into a zeroed fp32 set `part`, which is then promoted
// into the main accumulators with acc = fma(part, sb[row, kb] * sa[col, kb], acc) (the
// technique of DeepGEMM's FP8 GEMMs). The producer copies each stage's scale slices with
// the stage's data (cp.async.bulk, completing on the stage's full barrier) into a 1 KiB
// area per stage (rows' scales, then columns'; a 2D operand: the 16 bytes holding K block
// kb's scale), so the consumers read them from shared memory while the stage's wgmmas
// run. A partial last K block is zero-filled by TMA, so any k (a multiple of 16) works.
// Measured (one H200, 2026-12-02, tests_c/test_block_gemm --bench, 8192 x 7168 x 8192 and
// three more anchors): correct (outputs bit-identical to cuBLASLt's block-scaled GEMM) but
// slower: 820-850 TFLOP/s in 2D x 1D (0.68-0.70 of cuBLASLt's 1186-1222) and 682-710 in
// 1D x 1D (0.79-0.80 of 867-903); the one-set loop before block_k_loop's two sets took 2D
// x 1D to 0.70-0.74 but 1D x 1D only to 0.70-0.71. Likely limits: 128 x 128 tiles (two
// 64-register sets beside the accumulators leave no room for 256 columns) read 1.5x the
// L2 bytes of 128 x 256 ones, without the cluster multicast cuBLASLt can use.
enum : int {
  BLOCK_A_2D = 8,   // A's scales are 128 x 128 tiles (else 1D, per row and K block)
  BLOCK_B_2D = 16,  // B's likewise
};
constexpr int SCALE_STAGE_BYTES = 1024;  // a stage's scales: 128 rows', 128 columns'
// One operand's scales of K block kb for the 128 rows (of B) or columns (of A) from r0: the
// source and the byte count of the copy (a multiple of 16; 1D: never past the padded row).
struct ScaleSlice {
  const float *src;
  u32 bytes;
};
__device__ __forceinline__ ScaleSlice scale_slice(const float *s, bool two_d, int rows, int kblocks, int r0,
                                                  int kb) {
  if (two_d) {
    const int ld = (kblocks + 3) & ~3;
    return {s + (u64)(r0 / 128) * (u64)ld + (u64)(kb & ~3), 16u};
  }
  const int ld = (rows + 3) & ~3;
  return {s + (u64)kb * (u64)ld + (u64)r0, (u32)min(128, ld - r0) * 4u};
}
// 1-D bulk copy global -> shared (16-byte aligned, a multiple of 16 bytes), completing on `bar`.
__device__ __forceinline__ void bulk_load(u32 dst, const void *src, u32 bytes, u32 bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
               "l"((u64)src), "r"(bytes), "r"(bar)
               : "memory");
}
__device__ __forceinline__ float lds_f32(u32 addr) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(addr) : "memory");
  return v;
}
__device__ __forceinline__ float2 lds_f32x2(u32 addr) {
  float2 v;
  asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "r"(addr) : "memory");
  return v;
}
__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
// The producer's part of a stage: each scale slice's bytes added to what the stage's full
// barrier expects (before the producer's arrival, so the phase cannot complete without
// them), then its copy into the stage's scale area `sc` (rows', then columns'). One slice
// at a time: the producer runs on 40 registers.
__device__ __forceinline__ void load_block_scales(const Gemm90Args &g, int kblocks, int n0, int m0, int kb, u32 sc,
                                                  u32 full) {
  const ScaleSlice b = scale_slice(g.b_scale_inv, (g.epilogue & BLOCK_B_2D) != 0, g.n, kblocks, n0, kb);
  mbar_expect_tx(full, b.bytes);
  bulk_load(sc, b.src, b.bytes, full);
  const ScaleSlice a = scale_slice(g.a_scale_inv, (g.epilogue & BLOCK_A_2D) != 0, g.m, kblocks, m0, kb);
  mbar_expect_tx(full, a.bytes);
  bulk_load(sc + SCALE_STAGE_BYTES / 2, a.src, a.bytes, full);
}

// A consumer warpgroup's K loop of one tile of a _block kernel (see above): acc = sum over
// K blocks of the block's partial sums times the product of its rows' and columns' scales.
// Thread (warp, lane) holds tile rows r = 64 cw + 16 warp + lane / 4 and r + 8, columns
// 8 j + 2 (lane % 4) (+1) for j < BN / 8 (m64nBN fragments). `it`: the ring position of
// K block 0.
//
// Two partial-sum sets in turn (p0, p1: 64 registers each beside the 64 of acc): K block
// kb + 1's wgmmas are issued before K block kb's partial sums are promoted, so the tensor
// cores always have the next block's work while the warpgroup scales and adds (one set,
// waiting for each block's wgmmas before promoting it, ran at 0.70-0.74 of cuBLASLt's
// block-scaled speed on one H200: both consumer warpgroups promoted in step while the
// tensor cores idled).
template <int BN, int TA, int TB>
__device__ __forceinline__ void block_issue(float (&part)[BN / 2], u32 base, u32 bars, u32 pos, int cw) {
  typedef Cfg<BN> C;
  const u32 s = pos % C::STAGES;
  mbar_wait(bars + 8 * s, (pos / C::STAGES) & 1);
  const u32 st = base + s * C::STAGE_BYTES;
  const u64 da = smem_desc_sw128(st + cw * 64 * K_BYTES);
  const u64 db = smem_desc_sw128(st + C::A_BYTES);
  wgmma_fence();
  fence_regs(part);
#pragma unroll
  for (int kk = 0; kk < K_BYTES / 32; ++kk) wgmma_tile<BN, TA, TB, L_TN>(part, da + 2 * kk, db + 2 * kk, kk != 0);
  wgmma_commit();
  fence_regs(part);
}
// acc += part * (row scale * column scale) for K block kb at ring position `pos` (its
// wgmmas retired), then the stage goes back to the producer.
template <int BN>
__device__ __forceinline__ void block_promote(float (&acc)[BN / 2], float (&part)[BN / 2], u32 bars, u32 pos, int kb,
                                              int r, int q, int lane, bool a2d, bool b2d) {
  typedef Cfg<BN> C;
  const u32 s = pos % C::STAGES;
  const u32 sc = bars + C::BAR_BYTES + s * SCALE_STAGE_BYTES;
  const u32 sca = sc + SCALE_STAGE_BYTES / 2;
  const u32 k4 = 4u * (u32)(kb & 3);
  const float sr0 = lds_f32(b2d ? sc + k4 : sc + 4u * (u32)r);
  const float sr1 = lds_f32(b2d ? sc + k4 : sc + 4u * (u32)(r + 8));
  if (a2d) {
    // One column scale for the whole tile (BN 128 = one 2D block): a product per row.
    const float v = lds_f32(sca + k4);
    const float s0 = sr0 * v, s1 = sr1 * v;
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
      acc[4 * j] = fmaf(part[4 * j], s0, acc[4 * j]);
      acc[4 * j + 1] = fmaf(part[4 * j + 1], s0, acc[4 * j + 1]);
      acc[4 * j + 2] = fmaf(part[4 * j + 2], s1, acc[4 * j + 2]);
      acc[4 * j + 3] = fmaf(part[4 * j + 3], s1, acc[4 * j + 3]);
    }
  } else {
    // 1D columns: a scale pair per fragment column pair, read as the promotion goes (32 up
    // front would not fit beside the three accumulator sets).
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
      const float2 v = lds_f32x2(sca + 4u * (u32)(8 * j + 2 * q));
      acc[4 * j] = fmaf(part[4 * j], sr0 * v.x, acc[4 * j]);
      acc[4 * j + 1] = fmaf(part[4 * j + 1], sr0 * v.y, acc[4 * j + 1]);
      acc[4 * j + 2] = fmaf(part[4 * j + 2], sr1 * v.x, acc[4 * j + 2]);
      acc[4 * j + 3] = fmaf(part[4 * j + 3], sr1 * v.y, acc[4 * j + 3]);
    }
  }
  // Every lane's reads of the stage (wgmma's, the scales above: their values are used)
  // before it is handed back.
  __syncwarp();
  if (lane == 0) mbar_arrive(bars + 8 * (C::STAGES + s));
}
template <int BN, int TA, int TB>
__device__ __forceinline__ void block_k_loop(float (&acc)[BN / 2], u32 base, u32 bars, u32 &it, int kblocks, int cw,
                                             int warp, int lane, int epilogue) {
  const bool a2d = (epilogue & BLOCK_A_2D) != 0, b2d = (epilogue & BLOCK_B_2D) != 0;
  const int r = cw * 64 + warp * 16 + lane / 4, q = lane % 4;
  float p0[BN / 2], p1[BN / 2];
#pragma unroll
  for (int i = 0; i < BN / 2; ++i) acc[i] = 0.f;
  // Issue and retire in a fixed pattern (the loop always has two groups in flight at its
  // waits, the tail ends with wait 0), so that ptxas can tell which set is complete.
  block_issue<BN, TA, TB>(p0, base, bars, it, cw);
  int kb = 0;
  for (; kb + 2 < kblocks; kb += 2) {
    // p0: K block kb in flight.
    block_issue<BN, TA, TB>(p1, base, bars, it + kb + 1, cw);
    wgmma_wait<1>();
    fence_regs(p0);
    block_promote<BN>(acc, p0, bars, it + kb, kb, r, q, lane, a2d, b2d);
    block_issue<BN, TA, TB>(p0, base, bars, it + kb + 2, cw);
    wgmma_wait<1>();
    fence_regs(p1);
    block_promote<BN>(acc, p1, bars, it + kb + 1, kb + 1, r, q, lane, a2d, b2d);
  }
  // p0: K block kb in flight; one or two K blocks left.
  if (kb + 1 < kblocks) {
    block_issue<BN, TA, TB>(p1, base, bars, it + kb + 1, cw);
    wgmma_wait<1>();
    fence_regs(p0);
    block_promote<BN>(acc, p0, bars, it + kb, kb, r, q, lane, a2d, b2d);
    wgmma_wait<0>();
    fence_regs(p1);
    block_promote<BN>(acc, p1, bars, it + kb + 1, kb + 1, r, q, lane, a2d, b2d);
  } else {
    wgmma_wait<0>();
    fence_regs(p0);
    block_promote<BN>(acc, p0, bars, it + kb, kb, r, q, lane, a2d, b2d);
  }
  it += (u32)kblocks;
}

// The ping-pong consumers (the BN-192 kernels): consumer warpgroup cw computes the CTA's
// tiles j = cw, cw + 2, ... whole, 128 x 192 each (two m64n192 accumulator sets, rows 0-63
// and 64-127 of the tile), so that one warpgroup's epilogue runs while the other's wgmmas
// keep the tensor cores busy (the cooperative kernels stop both warpgroups for every
// epilogue: about 9 % of the consumers' time on e4m3 8192 x 3584 x 8192, ncu, H100,
// 2026-11-27). The producer loads every tile's K blocks in the CTA's order, as for the
// cooperative kernels; only the consuming warpgroup releases a stage (empty barriers
// count CONSUMER_WARPS / 2). 128 x 128 tiles a warpgroup were slower than the cooperative
// 128 x 256 ones everywhere (32 KiB of loads per 512 tensor cycles against 48 KiB per 1024);
// 128 x 192 pays where the epilogue is a large share (short K) and 192 divides m well
// (bench/RESULTS.md, eleventh session); the hosts' tile rule (src/gemm/sm90.rs pick_tile)
// takes it only there.
// Order barriers (bars + 16 STAGES + 8 w, one per warpgroup w): a warpgroup starts a
// tile's K loop only once the other has gone through its previous tile's whole K loop
// (waited for each stage and issued its wgmmas). Without them a warpgroup would wait on
// the full barrier of a stage many ring turns ahead, and a parity wait only tells the
// current phase from the one before: it would take another tile's data.
template <int BNP, int TA>
__device__ __forceinline__ void wgmma_pp(float (&d)[BNP / 2], u64 da, u64 db, u32 s) {
  static_assert(BNP == 192 && (TA == T_BF16 || TA == T_E4M3), "ping-pong: BN 192, bf16 or e4m3");
  if constexpr (TA == T_BF16) wgmma_bf16_n192(d, da, db, s);
  else wgmma_e4m3_n192(d, da, db, s);
}
template <int BNP, int TA, int TB, bool OUT_F32>
__device__ __forceinline__ void pingpong_tiles(const Gemm90Args &g, u32 base, u32 bars, int tiles, int tiles_n,
                                               int tiles_m, int gn, int kblocks, int cw, int warp, int lane,
                                               float scale) {
  typedef Cfg<BNP> C;
  float acc0[BNP / 2], acc1[BNP / 2];
  u32 it = 0;
  for (int t = blockIdx.x, j = 0; t < tiles; t += gridDim.x, ++j) {
    if ((j & 1) != cw) {
      it += (u32)kblocks;
      continue;
    }
    int tn, tm;
    tile_coords(t, tiles_n, tiles_m, gn, g.n_tile_rot, tn, tm);
    const int n0 = tn * BM, m0 = tm * BNP;
    // Tile j > 0 waits for the other warpgroup's K loop of tile j - 1: completion (j - 1)
    // / 2 of this warpgroup's order barrier.
    if (j > 0) mbar_wait(bars + 16 * C::STAGES + 8 * cw, (u32)((j - 1) / 2) & 1);
    u32 prev = 0;
    for (int kb = 0; kb < kblocks; ++kb, ++it) {
      const u32 s = it % C::STAGES;
      mbar_wait(bars + 8 * s, (it / C::STAGES) & 1);
      const u32 st = base + s * C::STAGE_BYTES;
      const u64 da0 = smem_desc_sw128(st), da1 = smem_desc_sw128(st + 64 * K_BYTES);
      const u64 db = smem_desc_sw128(st + C::A_BYTES);
      wgmma_fence();
      fence_regs(acc0);
      fence_regs(acc1);
#pragma unroll
      for (int kk = 0; kk < K_BYTES / 32; ++kk) {
        wgmma_pp<BNP, TA>(acc0, da0 + 2 * kk, db + 2 * kk, (kb | kk) != 0);
        wgmma_pp<BNP, TA>(acc1, da1 + 2 * kk, db + 2 * kk, (kb | kk) != 0);
      }
      wgmma_commit();
      fence_regs(acc0);
      fence_regs(acc1);
      if (kb > 0) {
        wgmma_wait<1>();
        fence_regs(acc0);
        fence_regs(acc1);
        if (lane == 0) mbar_arrive(bars + 8 * (C::STAGES + prev));
      }
      prev = s;
    }
    // This tile's K loop is issued: the other warpgroup may start its next tile.
    if (lane == 0) mbar_arrive(bars + 16 * C::STAGES + 8 * (cw ^ 1));
    wgmma_wait<0>();
    fence_regs(acc0);
    fence_regs(acc1);
    if (lane == 0) mbar_arrive(bars + 8 * (C::STAGES + prev));
    const int row = n0 + warp * 16 + lane / 4;
    store_tile_wide<BNP, OUT_F32>(acc0, scale, g.d, g.m, g.n, row, m0, lane);
    store_tile_wide<BNP, OUT_F32>(acc1, scale, g.d, g.m, g.n, row + 64, m0, lane);
    if (g.done != nullptr && g.done_rows > 0) {
      if (GEMM90_SIGNAL_WARP) {
        asm volatile("bar.sync %0, 160;" ::"r"(2 + cw) : "memory");
      } else {
        asm volatile("bar.sync %0, 128;" ::"r"(2 + cw) : "memory");
        if (threadIdx.x % 128 == 0)
          signal_done(g.done, g.done_rows, g.done_value, g.n, tiles_m, n0, min(n0 + BM, g.n));
      }
    }
  }
}

template <int BN, int L, int TA, int TB, int TO, int V>
__device__ __forceinline__ void gemm(const GemmTmaDesc *tmap_b, const GemmTmaDesc *tmap_a,
                                     const Gemm90Args &g) {
  constexpr bool FP8 = is_fp8(TA);
  constexpr bool OUT_F32 = TO == T_F32;
  constexpr bool EPI = (V & (V_EPI | V_FPACC | V_BLOCK)) != 0;
  constexpr bool FPACC = (V & V_FPACC) != 0;
  constexpr bool BLOCK = (V & V_BLOCK) != 0;
  static_assert(!FP8 || L == L_TN, "FP8 operands are K-major only (wgmma)");
  static_assert(FP8 == is_fp8(TB), "both inputs FP8 or both 16-bit");
  static_assert(FP8 || TA == TB, "16-bit inputs of one type");
  static_assert(EPI || TO == T_BF16 || TO == T_F32, "plain kernels store bf16 or f32");
  static_assert(!FPACC || (FP8 && BN == 128), "_fpacc: FP8 inputs, BN 128");
  static_assert(!BLOCK || (TA == T_E4M3 && TB == T_E4M3 && BN == 128 && L == L_TN && !FPACC),
                "_block: TN e4m3 x e4m3, BN 128");
  static_assert(!BLOCK || Cfg<BN>::EPI_BYTES >= Cfg<BN>::STAGES * SCALE_STAGE_BYTES,
                "_block: the stages' scales live in the staging chunks' space (GEMM90_EPI_STAGED)");
  static_assert(!BLOCK || !is_fp8(TO), "_block: 16/32-bit D");
  // BN 192: the ping-pong kernels (plain TN, bf16 or e4m3 in, bf16 out; pingpong_tiles).
  constexpr bool PP = BN == 192;
  static_assert(!PP || (V == 0 && L == L_TN && TO == T_BF16), "BN 192: plain TN, bf16 out");
  constexpr bool A_MN = L != L_TN;  // A [k, m]
  constexpr bool B_MN = L == L_NT;  // B [k, n]
  void *const d_out = g.d;
  const int m = g.m, n = g.n, k = g.k;
  const u32 *const flags = g.flags;
  const int rows_per_flag = g.rows_per_flag, group_n = g.group_n, n_tile_rot = g.n_tile_rot;
  typedef Cfg<BN> C;
  constexpr int K_ELEMS = FP8 ? K_BYTES : K_BYTES / 2;
  extern __shared__ __align__(1024) u8 smem_raw[];
  const u32 base = (smem_u32(smem_raw) + 1023u) & ~1023u;
  const u32 bars = base + C::STAGES * C::STAGE_BYTES;
  // full[s] = bars + 8 s, empty[s] = bars + 8 (STAGES + s)

  const int tiles_n = (n + BM - 1) / BM;
  const int tiles_m = (m + BN - 1) / BN;
  const int tiles = tiles_n * tiles_m;
  const int kblocks = (k + K_ELEMS - 1) / K_ELEMS;
  const int gn = group_n > 0 ? group_n : 1;
  const int wg = threadIdx.x / 128;

  if (threadIdx.x == 0) {
    for (int s = 0; s < C::STAGES; ++s) {
      mbar_init(bars + 8 * s, 1);
      mbar_init(bars + 8 * (C::STAGES + s), PP ? CONSUMER_WARPS / 2 : CONSUMER_WARPS);
    }
    if (PP) {
      mbar_init(bars + 16 * C::STAGES, CONSUMER_WARPS / 2);
      mbar_init(bars + 16 * C::STAGES + 8, CONSUMER_WARPS / 2);
    }
    if (GEMM90_SIGNAL_WARP == 2) {
      mbar_init(bars + 16 * C::STAGES + 16, 256);  // stored: every consumer thread, per tile
      mbar_init(bars + 16 * C::STAGES + 24, 1);    // signalled: the signaller, per tile
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    tma_prefetch_desc(tmap_b);
    tma_prefetch_desc(tmap_a);
  }
  __syncthreads();

  if (wg == 0) {
    // Producer: one thread issues every load; the rest of the warpgroup gives back its
    // registers (warps 1-3 then run the side copy, if any).
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (threadIdx.x >= 32 && g.copy_bytes != 0) side_copy(g.copy_src, g.copy_dst, g.copy_bytes);
    if (GEMM90_SIGNAL_WARP && g.done != nullptr && g.done_rows > 0 && threadIdx.x / 32 == 1) {
      // The signaller (warp 1): this CTA's tiles in the consumers' order; each, once both
      // consumer warpgroups have stored it (see GEMM90_SIGNAL_WARP), signalled by lane 0.
      for (int t = blockIdx.x, j = 0; t < tiles; t += gridDim.x, ++j) {
        int tn, tm;
        tile_coords(t, tiles_n, tiles_m, gn, n_tile_rot, tn, tm);
        const int n0 = tn * BM;
        // Ping-pong: tile j is warpgroup (j & 1)'s alone (named barrier 2 or 3, 160 threads).
        if (PP) asm volatile("bar.sync %0, 160;" ::"r"(2 + (j & 1)) : "memory");
        else if (GEMM90_SIGNAL_WARP == 2) mbar_wait(bars + 16 * C::STAGES + 16, (u32)j & 1);
        else asm volatile("bar.sync 1, 288;" ::: "memory");
        if (threadIdx.x == 32) signal_done(g.done, g.done_rows, g.done_value, n, tiles_m, n0, min(n0 + BM, n));
        if (!PP && GEMM90_SIGNAL_WARP == 2) {
          __syncwarp();
          if (threadIdx.x == 32) mbar_arrive(bars + 16 * C::STAGES + 24);
        }
      }
    }
    if (threadIdx.x == 0) {
      u32 it = 0;
      u64 seen = 0;
      // AG with K slices (k_pieces > 1): a row block arrives as kp slices of K (slice c:
      // K blocks [c kblocks / kp, (c + 1) kblocks / kp), empty where kp > kblocks), each
      // with its flag; a tile waits for each slice before loading its first K block (for
      // every slice that starts there), so that the tiles of a block run while the block
      // is still arriving, and the last block's tiles end one slice's compute after the
      // link (not one tile's).
      // (_block kernels: no arrival flags, which leaves their producer the registers for the scales)
      const bool waits = !BLOCK && flags != nullptr && rows_per_flag > 0;
      const int kp = waits ? max(1, g.k_pieces) : 1;
      for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
        int tn, tm;
        tile_coords(t, tiles_n, tiles_m, gn, n_tile_rot, tn, tm);
        const int n0 = tn * BM, m0 = tm * BN;
        if (waits && kp == 1)
          wait_row_blocks(flags, rows_per_flag, 1, 0, g.flag_value, n0, min(n0 + BM, n), seen, g.stall, g.stall_ns);
        int piece = 0, next_piece = 0;  // the next K slice and its first K block (kp > 1)
        for (int kb = 0; kb < kblocks; ++kb, ++it) {
          while (kp > 1 && kb == next_piece) {
            wait_row_blocks(flags, rows_per_flag, kp, piece, g.flag_value, n0, min(n0 + BM, n), seen, g.stall,
                            g.stall_ns);
            ++piece;
            next_piece = piece < kp ? (int)((long long)piece * kblocks / kp) : kblocks;
          }
          const u32 s = it % C::STAGES;
          const u32 phase = (it / C::STAGES) & 1;
          mbar_wait(bars + 8 * (C::STAGES + s), phase ^ 1);
          const u32 full = bars + 8 * s;
          const u32 st = base + s * C::STAGE_BYTES;
          // Zero-filled out-of-bounds bytes count too: always the whole box.
          if constexpr (BLOCK) load_block_scales(g, kblocks, n0, m0, kb, bars + C::BAR_BYTES + s * SCALE_STAGE_BYTES, full);
          mbar_arrive_expect_tx(full, C::STAGE_BYTES);
          if constexpr (B_MN) {
            // B [k, n]: boxes of 64 columns x 64 rows of K, MN_BOX_BYTES apart.
#pragma unroll
            for (int c = 0; c < BM / 64; ++c)
              tma_load_2d(st + c * MN_BOX_BYTES, tmap_b, full, n0 + 64 * c, kb * K_ELEMS);
          } else {
            tma_load_2d(st, tmap_b, full, kb * K_ELEMS, n0);
          }
          if constexpr (A_MN) {
#pragma unroll
            for (int c = 0; c < BN / 64; ++c)
              tma_load_2d(st + C::A_BYTES + c * MN_BOX_BYTES, tmap_a, full, m0 + 64 * c, kb * K_ELEMS);
          } else {
            tma_load_2d(st + C::A_BYTES, tmap_a, full, kb * K_ELEMS, m0);
          }
        }
      }
    }
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
    const int cw = wg - 1;                  // which 64 rows of the tile
    const int warp = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32;
    float acc[BN / 2];
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) acc[i] = 0.f;
    float scale = 1.f;
    if (FP8 && !BLOCK) scale = *g.a_scale_inv * *g.b_scale_inv;
    float d_scale = 1.f, amax = 0.f;
    if constexpr (EPI && is_fp8(TO)) {
      if (g.d_scale != nullptr) d_scale = *g.d_scale;
    }
    // Descriptor steps per K step (16 or 32 elements) inside a stage: K-major +32 bytes,
    // MN-major +16 rows of 128 bytes (both in >> 4 units).
    constexpr u64 A_STEP = B_MN ? 128 : 2;   // wgmma A = our B
    constexpr u64 B_STEP = A_MN ? 128 : 2;   // wgmma B = our A
    u32 it = 0;
    if constexpr (PP) {
      pingpong_tiles<BN, TA, TB, OUT_F32>(g, base, bars, tiles, tiles_n, tiles_m, gn, kblocks, cw, warp, lane, scale);
    } else {
      for (int t = blockIdx.x, jt = 0; t < tiles; t += gridDim.x, ++jt) {
        int tn, tm;
        tile_coords(t, tiles_n, tiles_m, gn, n_tile_rot, tn, tm);
        const int n0 = tn * BM, m0 = tm * BN;
        u32 prev = 0;
        if constexpr (BLOCK) {
          block_k_loop<BN, TA, TB>(acc, base, bars, it, kblocks, cw, warp, lane, g.epilogue);
        } else if constexpr (FPACC) {
          // Full-precision accumulation: each stage's wgmmas (4 K steps of 32) into `part`
          // (starting from zero), then acc += part in fp32: wgmma's own (fast) accumulation
          // spans at most 128 products.
          float part[BN / 2];
#pragma unroll
          for (int i = 0; i < BN / 2; ++i) acc[i] = 0.f;
          for (int kb = 0; kb < kblocks; ++kb, ++it) {
            const u32 s = it % C::STAGES;
            const u32 phase = (it / C::STAGES) & 1;
            mbar_wait(bars + 8 * s, phase);
            const u32 st = base + s * C::STAGE_BYTES;
            const u64 da = smem_desc_sw128(st + cw * 64 * K_BYTES);
            const u64 db = smem_desc_sw128(st + C::A_BYTES);
            wgmma_fence();
            fence_regs(part);
#pragma unroll
            for (int kk = 0; kk < K_BYTES / 32; ++kk)
              wgmma_tile<BN, TA, TB, L>(part, da + 2 * kk, db + 2 * kk, kk != 0);
            wgmma_commit();
            wgmma_wait<0>();
            fence_regs(part);
            if (lane == 0) mbar_arrive(bars + 8 * (C::STAGES + s));
#pragma unroll
            for (int i = 0; i < BN / 2; ++i) acc[i] += part[i];
          }
        } else {
        for (int kb = 0; kb < kblocks; ++kb, ++it) {
          const u32 s = it % C::STAGES;
          const u32 phase = (it / C::STAGES) & 1;
          mbar_wait(bars + 8 * s, phase);
          const u32 st = base + s * C::STAGE_BYTES;
          u64 da, db;
          if constexpr (B_MN) da = smem_desc_sw128_mn(st + cw * MN_BOX_BYTES);
          else da = smem_desc_sw128(st + cw * 64 * K_BYTES);
          if constexpr (A_MN) db = smem_desc_sw128_mn(st + C::A_BYTES);
          else db = smem_desc_sw128(st + C::A_BYTES);
          wgmma_fence();
          fence_regs(acc);
#pragma unroll
          for (int kk = 0; kk < K_BYTES / 32; ++kk) {
            // The first wgmma of a tile overwrites the accumulators (scale-d = 0).
            wgmma_tile<BN, TA, TB, L>(acc, da + A_STEP * kk, db + B_STEP * kk, (kb | kk) != 0);
          }
          wgmma_commit();
          fence_regs(acc);
          if (kb > 0) {
            // The previous slice's wgmma has retired: give its stage back.
            wgmma_wait<1>();
            fence_regs(acc);
            if (lane == 0) mbar_arrive(bars + 8 * (C::STAGES + prev));
          }
          prev = s;
        }
        wgmma_wait<0>();
        fence_regs(acc);
        if (lane == 0) mbar_arrive(bars + 8 * (C::STAGES + prev));
        }

        if constexpr (EPI) {
          store_tile_epi<BN, TO>(acc, scale, g, n0 + cw * 64 + warp * 16 + lane / 4, m0, lane, d_scale, amax);
        } else if (C::EPI_BYTES && !OUT_F32) {
          store_tile_staged<BN>(acc, scale, d_out, m, n, n0 + cw * 64 + warp * 16, m0, lane,
                                bars + C::BAR_BYTES + (u32)(4 * cw + warp) * EPI_CHUNKS * EPI_CHUNK_BYTES);
        } else if (GEMM90_EPI_WIDE) {
          store_tile_wide<BN, OUT_F32>(acc, scale, d_out, m, n, n0 + cw * 64 + warp * 16 + lane / 4, m0, lane);
        } else {
          // Epilogue from the accumulator fragments of m64nBN: thread (warp w, lane l) holds,
          // for j < BN/8, rows w*16 + l/4 (+8) and columns 8j + 2(l%4) (+1).
          const int row = n0 + cw * 64 + warp * 16 + lane / 4;
          const int col0 = m0 + 2 * (lane % 4);
          #pragma unroll
          for (int j = 0; j < BN / 8; ++j) {
            const int col = col0 + 8 * j;
          #pragma unroll
            for (int h = 0; h < 2; ++h) {
              const int r = row + 8 * h;
              if (r < n && col < m) {
                float v0 = acc[4 * j + 2 * h] * scale, v1 = acc[4 * j + 2 * h + 1] * scale;
                const u64 off = (u64)r * (u64)m + (u64)col;
                if (OUT_F32) {
                  float2 v;
                  v.x = v0;
                  v.y = v1;
                  *reinterpret_cast<float2 *>(reinterpret_cast<float *>(d_out) + off) = v;
                } else {
                  *reinterpret_cast<u32 *>(reinterpret_cast<u16 *>(d_out) + off) = pack_bf16x2(v0, v1);
                }
              }
            }
          }
        }
        if (g.done != nullptr && g.done_rows > 0) {
          // Both consumer warpgroups' stores of this tile, then one signal (GEMM90_SIGNAL_WARP:
          // by the signaller warp).
          if (GEMM90_SIGNAL_WARP == 2) {
            // Hand the tile over without waiting for the signaller: arrive on `stored` (a
            // release at CTA scope; the signaller's wait acquires it, and its system-scope
            // fence then publishes these stores), after the signaller has taken the previous
            // tile (so that it never waits on a phase more than one ahead).
            if (jt > 0) mbar_wait(bars + 16 * C::STAGES + 24, (u32)(jt - 1) & 1);
            mbar_arrive(bars + 16 * C::STAGES + 16);
          } else if (GEMM90_SIGNAL_WARP) {
            asm volatile("bar.sync 1, 288;" ::: "memory");
          } else {
            asm volatile("bar.sync 1, 256;" ::: "memory");
            if (threadIdx.x == 128) signal_done(g.done, g.done_rows, g.done_value, n, tiles_m, n0, min(n0 + BM, n));
          }
        }
      }
    }
    if constexpr (EPI) {
      // amax of D before scaling: a warp's maximum, then one atomicMax on the float's
      // bits (non-negative floats order like their bits); *d_amax must start at 0.
      if (g.d_amax != nullptr) {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
        if (lane == 0) atomicMax(reinterpret_cast<unsigned *>(g.d_amax), __float_as_uint(amax));
      }
    }
  }
}

}  // namespace gemm90

// Kernels: gemm_sm90_<layout>_<a>_<b>_<out>_<BN>[_<variant>] (see the header). Grid:
// min(tiles, SMs) CTAs of 384 threads, gemm_sm90_smem_bytes_<BN> bytes of dynamic shared
// memory (set the function attribute). Tensor maps (both 128B swizzle): a K-major operand
// (A [m, k] in TN; B [n, k] in TN, NN) box {K_BYTES / sizeof(in), rows: 128 for B, BN for
// A}; an MN-major one (A [k, m] in NN, NT; B [k, n] in NT) box {64, 64} (64 elements of
// m or n, 64 rows of k). The scale_inv pointers are read for FP8 inputs only.
#define GEMM90_KERNEL(NAME, BN, L, TA, TB, TO, V)                                           \
  extern "C" __global__ void __launch_bounds__(gemm90::THREADS, 1)                          \
      NAME(const __grid_constant__ GemmTmaDesc tmap_b, const __grid_constant__ GemmTmaDesc  \
                                                           tmap_a,                          \
           const __grid_constant__ Gemm90Args args) {                                       \
    gemm90::gemm<BN, L, TA, TB, TO, V>(&tmap_b, &tmap_a, args);                             \
  }
// Both tile widths of one kernel.
#define GEMM90_KERNEL2(NAME, L, TA, TB, TO, V)       \
  GEMM90_KERNEL(NAME##_256, 256, L, TA, TB, TO, V)   \
  GEMM90_KERNEL(NAME##_128, 128, L, TA, TB, TO, V)
#define GEMM90_KERNEL2_EPI(NAME, L, TA, TB, TO)                    \
  GEMM90_KERNEL(NAME##_256_epi, 256, L, TA, TB, TO, gemm90::V_EPI) \
  GEMM90_KERNEL(NAME##_128_epi, 128, L, TA, TB, TO, gemm90::V_EPI)

extern "C" __constant__ int gemm_sm90_smem_bytes_256 = gemm90::Cfg<256>::SMEM_BYTES;
extern "C" __constant__ int gemm_sm90_smem_bytes_128 = gemm90::Cfg<128>::SMEM_BYTES;
extern "C" __constant__ int gemm_sm90_smem_bytes_192 = gemm90::Cfg<192>::SMEM_BYTES;

using namespace gemm90;
#ifndef GEMM90_NO_PLAIN
// Plain (the fast path): TN, bf16 x bf16 and e4m3 x e4m3, bf16 or f32 out.
GEMM90_KERNEL2(gemm_sm90_tn_bf16_bf16_bf16, L_TN, T_BF16, T_BF16, T_BF16, 0)
GEMM90_KERNEL2(gemm_sm90_tn_bf16_bf16_f32, L_TN, T_BF16, T_BF16, T_F32, 0)
GEMM90_KERNEL2(gemm_sm90_tn_e4m3_e4m3_bf16, L_TN, T_E4M3, T_E4M3, T_BF16, 0)
GEMM90_KERNEL2(gemm_sm90_tn_e4m3_e4m3_f32, L_TN, T_E4M3, T_E4M3, T_F32, 0)
// Ping-pong, 128 x 192 tiles a warpgroup (bf16 out).
GEMM90_KERNEL(gemm_sm90_tn_bf16_bf16_bf16_192, 192, L_TN, T_BF16, T_BF16, T_BF16, 0)
GEMM90_KERNEL(gemm_sm90_tn_e4m3_e4m3_bf16_192, 192, L_TN, T_E4M3, T_E4M3, T_BF16, 0)
#endif
#ifndef GEMM90_NO_EPI
// _epi, TN, 16-bit inputs (out: the input type or f32).
GEMM90_KERNEL2_EPI(gemm_sm90_tn_bf16_bf16_bf16, L_TN, T_BF16, T_BF16, T_BF16)
GEMM90_KERNEL2_EPI(gemm_sm90_tn_bf16_bf16_f32, L_TN, T_BF16, T_BF16, T_F32)
GEMM90_KERNEL2_EPI(gemm_sm90_tn_f16_f16_f16, L_TN, T_F16, T_F16, T_F16)
GEMM90_KERNEL2_EPI(gemm_sm90_tn_f16_f16_f32, L_TN, T_F16, T_F16, T_F32)
// _epi, TN, FP8: e4m3 x e4m3 to every output; the mixes (backward GEMMs) to 16/32-bit.
GEMM90_KERNEL2_EPI(gemm_sm90_tn_e4m3_e4m3_bf16, L_TN, T_E4M3, T_E4M3, T_BF16)
GEMM90_KERNEL2_EPI(gemm_sm90_tn_e4m3_e4m3_f16, L_TN, T_E4M3, T_E4M3, T_F16)
GEMM90_KERNEL2_EPI(gemm_sm90_tn_e4m3_e4m3_f32, L_TN, T_E4M3, T_E4M3, T_F32)
GEMM90_KERNEL2_EPI(gemm_sm90_tn_e4m3_e4m3_e4m3, L_TN, T_E4M3, T_E4M3, T_E4M3)
GEMM90_KERNEL2_EPI(gemm_sm90_tn_e4m3_e4m3_e5m2, L_TN, T_E4M3, T_E4M3, T_E5M2)
GEMM90_KERNEL2_EPI(gemm_sm90_tn_e4m3_e5m2_bf16, L_TN, T_E4M3, T_E5M2, T_BF16)
GEMM90_KERNEL2_EPI(gemm_sm90_tn_e4m3_e5m2_f16, L_TN, T_E4M3, T_E5M2, T_F16)
GEMM90_KERNEL2_EPI(gemm_sm90_tn_e4m3_e5m2_f32, L_TN, T_E4M3, T_E5M2, T_F32)
GEMM90_KERNEL2_EPI(gemm_sm90_tn_e5m2_e4m3_bf16, L_TN, T_E5M2, T_E4M3, T_BF16)
GEMM90_KERNEL2_EPI(gemm_sm90_tn_e5m2_e4m3_f16, L_TN, T_E5M2, T_E4M3, T_F16)
GEMM90_KERNEL2_EPI(gemm_sm90_tn_e5m2_e4m3_f32, L_TN, T_E5M2, T_E4M3, T_F32)
#endif
#ifndef GEMM90_NO_FPACC
// _fpacc (BN 128 only): full-precision FP8 accumulation, with the _epi epilogue.
GEMM90_KERNEL(gemm_sm90_tn_e4m3_e4m3_bf16_128_fpacc, 128, L_TN, T_E4M3, T_E4M3, T_BF16, V_FPACC)
GEMM90_KERNEL(gemm_sm90_tn_e4m3_e4m3_f16_128_fpacc, 128, L_TN, T_E4M3, T_E4M3, T_F16, V_FPACC)
GEMM90_KERNEL(gemm_sm90_tn_e4m3_e4m3_f32_128_fpacc, 128, L_TN, T_E4M3, T_E4M3, T_F32, V_FPACC)
GEMM90_KERNEL(gemm_sm90_tn_e4m3_e4m3_e4m3_128_fpacc, 128, L_TN, T_E4M3, T_E4M3, T_E4M3, V_FPACC)
GEMM90_KERNEL(gemm_sm90_tn_e4m3_e5m2_bf16_128_fpacc, 128, L_TN, T_E4M3, T_E5M2, T_BF16, V_FPACC)
GEMM90_KERNEL(gemm_sm90_tn_e4m3_e5m2_f32_128_fpacc, 128, L_TN, T_E4M3, T_E5M2, T_F32, V_FPACC)
GEMM90_KERNEL(gemm_sm90_tn_e5m2_e4m3_bf16_128_fpacc, 128, L_TN, T_E5M2, T_E4M3, T_BF16, V_FPACC)
GEMM90_KERNEL(gemm_sm90_tn_e5m2_e4m3_f32_128_fpacc, 128, L_TN, T_E5M2, T_E4M3, T_F32, V_FPACC)
#endif
#ifndef GEMM90_NO_BLOCK
// _block (BN 128 only): block-scaled e4m3 x e4m3 (TE's Float8BlockScaling), the _epi
// epilogue (bias, accumulate) on 16/32-bit D.
GEMM90_KERNEL(gemm_sm90_tn_e4m3_e4m3_bf16_128_block, 128, L_TN, T_E4M3, T_E4M3, T_BF16, V_BLOCK)
GEMM90_KERNEL(gemm_sm90_tn_e4m3_e4m3_f16_128_block, 128, L_TN, T_E4M3, T_E4M3, T_F16, V_BLOCK)
GEMM90_KERNEL(gemm_sm90_tn_e4m3_e4m3_f32_128_block, 128, L_TN, T_E4M3, T_E4M3, T_F32, V_BLOCK)
#endif
#ifndef GEMM90_NO_NN_NT
// NN (dgrad) and NT (wgrad), 16-bit inputs, _epi (NT with EPI_ACCUM: wgrad into fp32
// main_grad).
GEMM90_KERNEL2_EPI(gemm_sm90_nn_bf16_bf16_bf16, L_NN, T_BF16, T_BF16, T_BF16)
GEMM90_KERNEL2_EPI(gemm_sm90_nn_bf16_bf16_f32, L_NN, T_BF16, T_BF16, T_F32)
GEMM90_KERNEL2_EPI(gemm_sm90_nn_f16_f16_f16, L_NN, T_F16, T_F16, T_F16)
GEMM90_KERNEL2_EPI(gemm_sm90_nn_f16_f16_f32, L_NN, T_F16, T_F16, T_F32)
GEMM90_KERNEL2_EPI(gemm_sm90_nt_bf16_bf16_bf16, L_NT, T_BF16, T_BF16, T_BF16)
GEMM90_KERNEL2_EPI(gemm_sm90_nt_bf16_bf16_f32, L_NT, T_BF16, T_BF16, T_F32)
GEMM90_KERNEL2_EPI(gemm_sm90_nt_f16_f16_f16, L_NT, T_F16, T_F16, T_F16)
GEMM90_KERNEL2_EPI(gemm_sm90_nt_f16_f16_f32, L_NT, T_F16, T_F16, T_F32)
#endif
