// FP8 block scaling (TE's Float8BlockScaling recipe): quantize a [rows, cols] float32 /
// bfloat16 / float16 matrix into FP8 with one float32 scale per 1x128 values (1D, rowwise;
// 128x1 columnwise) or per 128x128 tile (2D), and dequantize back.
//
// Quantize: one block of 256 threads per 128x128 tile (rows and cols multiples of 128, every
// pointer 16-byte aligned: src/kernels/block.rs checks both). Two kernels: the register
// path (block_quantize_regs*, below block_quantize_impl: 16-bit inputs without an
// activation or a bias gradient, the tile loaded straight into registers) and the
// shared-memory kernel (up to 5 blocks an SM for 16-bit inputs), where the tile is read
// from global memory once (cp.async into shared memory), then:
//   2D:                    the tile's amax (all 16384 values), one scale;
//   1D columnwise:         each column's amax over the tile's 128 rows (in the rowwise pass
//                          when both directions are written with BQ_ROWS8, but for
//                          float16's compact format: BqCompactInRows);
//   rowwise:               each row's amax (1D) over its 128 values, the row quantized and
//                          stored (8-byte stores; a warp writes two whole 128-byte rows);
//   columnwise compact:    (1D) stored in the input's layout with the column scales, in the
//                          rowwise pass;
//   columnwise transposed: each column quantized, staged transposed in shared memory and
//                          stored as 128-byte runs of the [cols, rows] output.
// The launch's flags (BlockQuantArgs::flags; NVTE_COMM_BLOCK_QUANT: on by default) pick
// the faster paths: the 1D row scales once a row (bq_rows_1d) and 16-bit inputs' amaxes on
// packed pairs; every path writes the same bytes. BQ_GELU quantizes GELU(x) (the tanh
// approximation in float32, rounded once to the input type) in place of x, BQ_DGELU x * GELU'(act_in) (the GELU's backward: x the gradient at its
// output, act_in its input, same shape and type) rounded the same way: the tile is
// transformed in shared memory once it lands. A non-null `dbias`
// receives each tile's column sums (f32, over its 128 rows, of the values quantized):
// dbias[rb * cols + c], the partials of a bias gradient (their sum over rb). With the noop
// flag set, nothing is written, the partials included.
// Scale (TE's compute_scale_from_amax): amax raised to epsilon; amax 0, inf or NaN gives 1;
// scale = fp8_max / amax (IEEE division), an overflow becomes the input type's largest
// value; pow2 keeps only sign and exponent (rounds down to a power of 2). Values:
// cvt.rn.satfinite(float(x) * scale). scale_inv = 1 / scale (IEEE reciprocal: equal to TE's
// double-precision 1.0 / scale rounded to float).
// Scale inverses go to sinv[rb * s_r + cb * s_c] for block (rb, cb) of the logical matrix
// (rowwise: block (row, col / 128) in 1D; columnwise: (row / 128, col); 2D: (row / 128,
// col / 128)), the strides giving TE's GEMM-ready or compact layout.
#include "types.cuh"

#define BQ_THREADS 256
#define BQ_TILE 128

// TE's largest finite value of the input type (the scale given for an infinite one).
template <class I>
struct InMax;
template <>
struct InMax<F32> {
  static constexpr float v = 3.40282346638528859812e+38f;
};
template <>
struct InMax<BF16> {
  static constexpr float v = 3.38953138925153547590e+38f;  // 0x7f7f
};
template <>
struct InMax<F16> {
  static constexpr float v = 65504.0f;
};

template <class O>
struct Fp8Max;
template <>
struct Fp8Max<E4M3> {
  static constexpr float v = 448.0f;
};
template <>
struct Fp8Max<E5M2> {
  static constexpr float v = 57344.0f;
};

template <class I, class O>
__device__ __forceinline__ float bq_scale(float amax, float eps, int pow2) {
  if (amax < eps) amax = eps;
  if (isinf(amax) || amax == 0.0f || isnan(amax)) return 1.0f;
  float s = __fdiv_rn(Fp8Max<O>::v, amax);
  if (isinf(s)) s = InMax<I>::v;
  if (pow2) s = __uint_as_float(__float_as_uint(s) & 0xff800000u);
  return s;
}

__device__ __forceinline__ float bq_rcp(float s) {
  float r;
  asm("rcp.rn.f32 %0, %1;" : "=f"(r) : "f"(s));
  return r;
}

__device__ __forceinline__ void bq_cp_async16(void *smem, const void *g) {
  const u32 s = (u32)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(g) : "memory");
}

// Eight consecutive values of a row of the shared tile as floats.
template <class I>
__device__ __forceinline__ void bq_load8(const typename I::T *p, float *f) {
  load8<I>(p, f);
}

// Columns c and c + 1 of one row of the shared tile.
template <class I>
__device__ __forceinline__ void bq_load_pair(const typename I::T *p, float &a, float &b) {
  a = I::load(p[0]);
  b = I::load(p[1]);
}
template <>
__device__ __forceinline__ void bq_load_pair<BF16>(const u16 *p, float &a, float &b) {
  const u32 w = *reinterpret_cast<const u32 *>(p);
  a = __uint_as_float(w << 16);
  b = __uint_as_float(w & 0xffff0000u);
}
template <>
__device__ __forceinline__ void bq_load_pair<F32>(const float *p, float &a, float &b) {
  const float2 v = *reinterpret_cast<const float2 *>(p);
  a = v.x;
  b = v.y;
}

// Amaxes on packed 16-bit pairs (bf16x2 / f16x2; float32: none): Pk<I>::ok, the largest
// magnitude of the 8 values of a 16-byte chunk as one pair (abs and max, which, as fmaxf,
// returns the other operand where one is NaN), and a pair's halves as floats (exact).
template <class I>
struct Pk {
  static constexpr bool ok = false;
  static __device__ __forceinline__ u32 abs2(u32) { return 0; }
  static __device__ __forceinline__ u32 amax8(uint4) { return 0; }
  static __device__ __forceinline__ u32 max2(u32, u32) { return 0; }
  static __device__ __forceinline__ float lo(u32) { return 0.0f; }
  static __device__ __forceinline__ float hi(u32) { return 0.0f; }
};
#define BQ_PACKED_TYPE(I, TY, LO, HI)                                                     \
  template <>                                                                             \
  struct Pk<I> {                                                                          \
    static constexpr bool ok = true;                                                      \
    static __device__ __forceinline__ u32 abs2(u32 w) {                                   \
      u32 r;                                                                              \
      asm("abs." TY " %0, %1;" : "=r"(r) : "r"(w));                                       \
      return r;                                                                           \
    }                                                                                     \
    static __device__ __forceinline__ u32 max2(u32 a, u32 b) {                            \
      u32 r;                                                                              \
      asm("max." TY " %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));                           \
      return r;                                                                           \
    }                                                                                     \
    static __device__ __forceinline__ u32 amax8(uint4 v) {                                \
      return max2(max2(abs2(v.x), abs2(v.y)), max2(abs2(v.z), abs2(v.w)));                \
    }                                                                                     \
    static __device__ __forceinline__ float lo(u32 w) { return LO; }                      \
    static __device__ __forceinline__ float hi(u32 w) { return HI; }                      \
  };
BQ_PACKED_TYPE(BF16, "bf16x2", __uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u))
BQ_PACKED_TYPE(F16, "f16x2", F16::load((u16)(w & 0xffff)), F16::load((u16)(w >> 16)))
#undef BQ_PACKED_TYPE

// The float amax (from 0, NaN ignored as fmaxf does) of a packed pair of magnitudes.
template <class I>
__device__ __forceinline__ float bq_pair_amax(u32 m2) {
  return fmaxf(fmaxf(0.0f, Pk<I>::lo(m2)), Pk<I>::hi(m2));
}

// Eight values times their scales into eight FP8 bytes (two words, low byte first).
template <class O>
__device__ __forceinline__ uint2 bq_pack8(const float *v, const float *s) {
  uint2 r;
  r.x = fp8_pack2<O>(v[0] * s[0], v[1] * s[1]) | (fp8_pack2<O>(v[2] * s[2], v[3] * s[3]) << 16);
  r.y = fp8_pack2<O>(v[4] * s[4], v[5] * s[5]) | (fp8_pack2<O>(v[6] * s[6], v[7] * s[7]) << 16);
  return r;
}

__device__ __forceinline__ void bq_st8(void *p, uint2 v) {
  asm volatile("st.global.v2.u32 [%0], {%1, %2};" ::"l"(p), "r"(v.x), "r"(v.y) : "memory");
}
__device__ __forceinline__ void bq_st16(void *p, uint4 v) {
  asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}

// Max over the block (every thread gets it); `red` holds 8 floats.
__device__ __forceinline__ float bq_block_max(float v, float *red) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  float m = red[0];
#pragma unroll
  for (int w = 1; w < BQ_THREADS / 32; ++w) m = fmaxf(m, red[w]);
  return m;
}

// The column mode of a quantization: none, transposed (GEMM-ready [cols, rows] data) or
// compact (1D only: the input's layout).
#define BQ_COL_NONE 0
#define BQ_COL_TRANSPOSED 1
#define BQ_COL_COMPACT 2

// The sizes and options of a quantization (src/kernels/block.rs BlockQuantArgs, same
// layout): the [rows, cols] matrix, the scale strides of the rowwise (s_r, s_c) and
// columnwise (t_r, t_c) scale inverses, epsilon, pow2 (0 / 1), col_mode (BQ_COL_*), flags
// (BQ_ROWS8: the 1D rows pass is bq_rows_1d, else bq_rows; BQ_PACKED: 16-bit inputs'
// amaxes (2D tile, bq_rows_1d's, 1D columns') on packed pairs; BQ_GELU: GELU(x) is
// quantized; BQ_DGELU: x * GELU'(act_in)).
#define BQ_ROWS8 1
#define BQ_PACKED 2
#define BQ_GELU 4
#define BQ_DGELU 8
struct BlockQuantArgs {
  u64 rows, cols, s_r, s_c, t_r, t_c;
  float eps;
  int pow2, col_mode, flags;
};
static_assert(sizeof(BlockQuantArgs) == 64, "BlockQuantArgs is 64 bytes (src/kernels/block.rs)");

// A block's static shared memory (4 KiB).
// col_part: 1D columnwise, per column, partial amaxes (4 or 8 a column); col_scale: the
// columns' scales, over col_part[0] (bq_finish_column_scales: thread t reads column t's
// parts, then writes its scale); red: the 2D block max's 8 partials (2D: no col_part).
struct BqShared {
  float col_part[8][BQ_TILE];
  __device__ __forceinline__ float *col_scale() { return col_part[0]; }
  __device__ __forceinline__ const float *col_scale() const { return col_part[0]; }
  __device__ __forceinline__ float *red() { return col_part[7]; }
};

// The FP8 columns c, c + 1 over rows rq .. + 31 (wa, wb: 4 rows a word, low byte first) of
// every thread, once every read of the tile is done, staged transposed in the tile's shared
// memory, row c of it holding column c (16-byte chunks swizzled by (c / 2) % 8:
// conflict-free both ways), and stored as whole 128-byte runs of the [cols, rows] output
// (8 threads a run).
__device__ __forceinline__ void bq_stage_store_columns(u8 *stage, const u32 *wa, const u32 *wb, int c, int rq,
                                                       u8 *out_t, u64 rows, u64 r0, u64 c0) {
  __syncthreads();  // the tile's last reader is done: its memory becomes the staging area
  const int sw = (c >> 1) & 7, k0 = rq / 16;
  uint4 *sa_row = reinterpret_cast<uint4 *>(stage + c * BQ_TILE);
  uint4 *sb_row = reinterpret_cast<uint4 *>(stage + (c + 1) * BQ_TILE);
  sa_row[k0 ^ sw] = make_uint4(wa[0], wa[1], wa[2], wa[3]);
  sa_row[(k0 + 1) ^ sw] = make_uint4(wa[4], wa[5], wa[6], wa[7]);
  sb_row[k0 ^ sw] = make_uint4(wb[0], wb[1], wb[2], wb[3]);
  sb_row[(k0 + 1) ^ sw] = make_uint4(wb[4], wb[5], wb[6], wb[7]);
  __syncthreads();
#pragma unroll
  for (int i = 0; i < BQ_TILE * BQ_TILE / 16 / BQ_THREADS; ++i) {
    const int q = i * BQ_THREADS + threadIdx.x, row = q >> 3, k = q & 7;
    const uint4 v = reinterpret_cast<const uint4 *>(stage + row * BQ_TILE)[k ^ ((row >> 1) & 7)];
    bq_st16(out_t + (c0 + row) * rows + r0 + 16 * k, v);
  }
}

// Columns of the tile: warp w takes columns (w / 4) * 64 + 2 * lane, + 1 over rows
// (w % 4) * 32 .. + 31, quantized in registers; then (every read of the tile done) the FP8
// transpose is staged in the tile's shared memory, row c of it holding column c (16-byte
// chunks swizzled by (c / 2) % 8: conflict-free both ways), and leaves as whole 128-byte
// runs of the [cols, rows] output (8 threads a run).
template <class I, class O, int TWO_D>
__device__ __forceinline__ void bq_columns_transposed(const typename I::T *tile, u8 *stage, const BqShared &sh,
                                                      float tile_scale, u8 *out_t, u64 rows, u64 r0, u64 c0) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int c = (warp >> 2) * 64 + 2 * lane, rq = (warp & 3) * 32;
  const float sa = TWO_D ? tile_scale : sh.col_scale()[c], sb = TWO_D ? tile_scale : sh.col_scale()[c + 1];
  u32 wa[8], wb[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    float a[4], b[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) bq_load_pair<I>(tile + (rq + 4 * k + j) * BQ_TILE + c, a[j], b[j]);
    wa[k] = fp8_pack2<O>(a[0] * sa, a[1] * sa) | (fp8_pack2<O>(a[2] * sa, a[3] * sa) << 16);
    wb[k] = fp8_pack2<O>(b[0] * sb, b[1] * sb) | (fp8_pack2<O>(b[2] * sb, b[3] * sb) << 16);
  }
  bq_stage_store_columns(stage, wa, wb, c, rq, out_t, rows, r0, c0);
}

// A rows pass's end (1D columnwise amaxes): the warp's two half-warps' column amaxes
// cm[0..8) of columns cc.. (a half-warp covers the tile's 128 columns) combined, and
// stored as warp `warp`'s partial in sh.col_part.
__device__ __forceinline__ void bq_store_col_part(BqShared &sh, float (&cm)[8], int lane, int warp, int cc) {
#pragma unroll
  for (int j = 0; j < 8; ++j) cm[j] = fmaxf(cm[j], __shfl_xor_sync(0xffffffffu, cm[j], 16));
  if (lane < 16) {
#pragma unroll
    for (int j = 0; j < 8; ++j) sh.col_part[warp][cc + j] = cm[j];
  }
}

// 1D columnwise scales from the partial amaxes sh.col_part[0 .. parts)[c] (written before
// the call): scale and scale_inv (sinv_t[rb * s_r + col * s_c]) of column c in
// sh.col_scale()[c].
template <class I, class O, int PARTS>
__device__ __forceinline__ void bq_finish_column_scales(BqShared &sh, float *sinv_t, u64 s_r, u64 s_c, u64 rb,
                                                        u64 c0, float eps, int pow2) {
  __syncthreads();
  if (threadIdx.x < BQ_TILE) {
    const int t = threadIdx.x;
    float m = sh.col_part[0][t];
#pragma unroll
    for (int p = 1; p < PARTS; ++p) m = fmaxf(m, sh.col_part[p][t]);
    const float s = bq_scale<I, O>(m, eps, pow2);
    sh.col_scale()[t] = s;
    sinv_t[rb * s_r + (c0 + t) * s_c] = bq_rcp(s);
  }
  __syncthreads();
}

// Per-column partials over a quarter of the tile's rows, folded by `step` from 0: warp w
// takes columns (w / 4) * 64 + 2 * lane, + 1 over rows (w % 4) * 32 .. + 31, in order,
// into sh.col_part[w % 4] (bq_column_scales' amaxes, bq_column_sums' sums).
struct BqAbsMax {
  __device__ __forceinline__ float operator()(float m, float v) const { return fmaxf(m, fabsf(v)); }
};
struct BqSum {
  __device__ __forceinline__ float operator()(float s, float v) const { return s + v; }
};
template <class I, class Step>
__device__ __forceinline__ void bq_column_quarters(const typename I::T *tile, BqShared &sh, Step step) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int c = (warp >> 2) * 64 + 2 * lane, rq = (warp & 3) * 32;
  float pa = 0.0f, pb = 0.0f;
#pragma unroll 8
  for (int r = 0; r < 32; ++r) {
    float a, b;
    bq_load_pair<I>(tile + (rq + r) * BQ_TILE + c, a, b);
    pa = step(pa, a);
    pb = step(pb, b);
  }
  sh.col_part[warp & 3][c] = pa;
  sh.col_part[warp & 3][c + 1] = pb;
}

// 1D columnwise scales read off the tile: each column's amax over the tile's rows (warp w:
// columns (w / 4) * 64 + 2 * lane, + 1 over rows (w % 4) * 32 .. + 31; PACKED, 16-bit
// inputs: on the packed pairs of the two columns), then bq_finish_column_scales.
template <class I, class O, bool PACKED>
__device__ __forceinline__ void bq_column_scales(const typename I::T *tile, BqShared &sh, float *sinv_t, u64 s_r,
                                                 u64 s_c, u64 rb, u64 c0, float eps, int pow2) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int c = (warp >> 2) * 64 + 2 * lane, rq = (warp & 3) * 32;
  if (PACKED && Pk<I>::ok) {
    u32 m2 = 0;
#pragma unroll 8
    for (int r = 0; r < 32; ++r)
      m2 = Pk<I>::max2(m2, Pk<I>::abs2(*reinterpret_cast<const u32 *>(tile + (rq + r) * BQ_TILE + c)));
    sh.col_part[warp & 3][c] = fmaxf(0.0f, Pk<I>::lo(m2));
    sh.col_part[warp & 3][c + 1] = fmaxf(0.0f, Pk<I>::hi(m2));
  } else {
    bq_column_quarters<I>(tile, sh, BqAbsMax());
  }
  bq_finish_column_scales<I, O, 4>(sh, sinv_t, s_r, s_c, rb, c0, eps, pow2);
}

// Rows of the tile: 16 threads a row (8 values each), a warp two rows, 8 passes. ROW: the
// rowwise output `out` (1D: each row's own scale; 2D: the tile's); COMPACT: the compact
// columnwise output `out_c` (the column scales); COL_AMAX (1D with the transposed
// columnwise output): the columns' partial amaxes over the rows this warp saw, into
// sh.col_part[warp] (the tile is read once for both directions' amaxes). The flags are
// template arguments: each combination is its own loop, without tests inside.
template <class I, class O, int TWO_D, bool ROW, bool COMPACT, bool COL_AMAX>
__device__ __forceinline__ void bq_rows(const typename I::T *tile, BqShared &sh, float tile_scale, u8 *out, u8 *out_c,
                                        float *sinv, u64 s_r, u64 s_c, u64 cols, u64 r0, u64 c0, float eps,
                                        int pow2) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int cc = (lane & 15) * 8, r_first = warp * 2 + (lane >> 4);
  float cm[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  float csc[8];  // the column scales (compact output)
  if (COMPACT) {
#pragma unroll
    for (int j = 0; j < 8; ++j) csc[j] = sh.col_scale()[cc + j];
  }
  // This thread's first row's 8 bytes (rowwise, compact) and scale inverse; each pass
  // moves 16 rows down.
  const u64 g = (r0 + r_first) * cols + c0 + cc, g_step = 16 * cols;
  u8 *po = ROW ? out + g : nullptr;
  u8 *pc = COMPACT ? out_c + g : nullptr;
  float *ps = ROW && !TWO_D ? sinv + (r0 + r_first) * s_r + (c0 / BQ_TILE) * s_c : nullptr;
  const u64 s_step = 16 * s_r;
  const typename I::T *pt = tile + r_first * BQ_TILE + cc;
#pragma unroll 2
  for (int it = 0; it < 8; ++it) {
    float v[8];
    bq_load8<I>(pt + it * 16 * BQ_TILE, v);
    if (COL_AMAX) {
#pragma unroll
      for (int j = 0; j < 8; ++j) cm[j] = fmaxf(cm[j], fabsf(v[j]));
    }
    if (ROW) {
      float s = tile_scale;
      if (!TWO_D) {
        float m = 0.0f;
#pragma unroll
        for (int j = 0; j < 8; ++j) m = fmaxf(m, fabsf(v[j]));
#pragma unroll
        for (int o = 8; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        s = bq_scale<I, O>(m, eps, pow2);
        if ((lane & 15) == 0) *ps = bq_rcp(s);
        ps += s_step;
      }
      const float rs[8] = {s, s, s, s, s, s, s, s};
      bq_st8(po, bq_pack8<O>(v, rs));
      po += g_step;
    }
    if (COMPACT) {
      bq_st8(pc, bq_pack8<O>(v, csc));
      pc += g_step;
    }
  }
  if (COL_AMAX) bq_store_col_part(sh, cm, lane, warp, cc);
}

// The 8 columns of 16-byte chunks (16-bit inputs, packed pairs): each chunk x of a column
// run folded into the pairs' amaxes cm2 (from 0), then those as 8 floats (exact).
template <class I>
__device__ __forceinline__ void bq_col_amax8_step(u32 (&cm2)[4], const uint4 &x) {
  cm2[0] = Pk<I>::max2(cm2[0], Pk<I>::abs2(x.x));
  cm2[1] = Pk<I>::max2(cm2[1], Pk<I>::abs2(x.y));
  cm2[2] = Pk<I>::max2(cm2[2], Pk<I>::abs2(x.z));
  cm2[3] = Pk<I>::max2(cm2[3], Pk<I>::abs2(x.w));
}
template <class I>
__device__ __forceinline__ void bq_col_amax8_floats(const u32 (&cm2)[4], float (&cm)[8]) {
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    cm[2 * k] = fmaxf(0.0f, Pk<I>::lo(cm2[k]));
    cm[2 * k + 1] = fmaxf(0.0f, Pk<I>::hi(cm2[k]));
  }
}

// Eight rows' partial amaxes m[0..8) of each of the 16 threads j = lane % 16 of a half-warp
// (thread j: 8 of each row's 128 values) reduced by one transposing exchange (each step
// trades half of a thread's rows with its partner: 8 shuffles for 8 rows, not 32): thread
// j gets the whole amax of row j / 2.
__device__ __forceinline__ float bq_rows8_amax(const float (&m)[8], int j) {
  // Offsets 8, 4, 2: keep the half of the rows named by this thread's bit, send the other.
  const bool b3 = (j & 8) != 0, b2 = (j & 4) != 0, b1 = (j & 2) != 0;
  float n[4], p[2];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float send = b3 ? m[k] : m[k + 4], keep = b3 ? m[k + 4] : m[k];
    n[k] = fmaxf(keep, __shfl_xor_sync(0xffffffffu, send, 8));
  }
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const float send = b2 ? n[k] : n[k + 2], keep = b2 ? n[k + 2] : n[k];
    p[k] = fmaxf(keep, __shfl_xor_sync(0xffffffffu, send, 4));
  }
  const float q = fmaxf(b1 ? p[1] : p[0], __shfl_xor_sync(0xffffffffu, b1 ? p[0] : p[1], 2));
  return fmaxf(q, __shfl_xor_sync(0xffffffffu, q, 1));
}

// The 1D rows pass with the row scales computed once a row: 16 threads a row (8 values
// each), a warp two rows a pass, as bq_rows, but first every pass's partial row amax
// (8 a thread), then one transposing reduction over the 16 threads of a row (each step
// trades half of a thread's rows with its partner: 8 shuffles for 8 rows, not 32) leaves
// thread j of the 16 with the amax of pass j / 2's row: its scale is computed there (one
// division a thread, not 8) and broadcast to the pass by a shuffle; then the values are
// read again, quantized and stored. Same flags and results as bq_rows (1D, ROW), but
// COMPACT with COL_AMAX: the columns' amaxes are taken in the first read (with the rows'),
// and their scales (sinv_t, strides a.t_r, a.t_c) finished before the values are read
// again: one read of the tile fewer than bq_column_scales, then this pass.
template <class I, class O, bool COMPACT, bool COL_AMAX, bool PACKED>
__device__ __forceinline__ void bq_rows_1d(const typename I::T *tile, BqShared &sh, u8 *out, u8 *out_c, float *sinv,
                                           float *sinv_t, const BlockQuantArgs &a, u64 r0, u64 c0) {
  const u64 s_r = a.s_r, s_c = a.s_c, cols = a.cols;
  const float eps = a.eps;
  const int pow2 = a.pow2;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, j = lane & 15;
  const int cc = j * 8, r_first = warp * 2 + (lane >> 4);
  const typename I::T *pt = tile + r_first * BQ_TILE + cc;
  float cm[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  float m[8];  // m[it]: the amax of this thread's 8 values of pass it's row
  if (PACKED && Pk<I>::ok) {  // (PACKED: on packed pairs)
    u32 cm2[4] = {0, 0, 0, 0};
#pragma unroll
    for (int it = 0; it < 8; ++it) {
      const uint4 x = *reinterpret_cast<const uint4 *>(pt + it * 16 * BQ_TILE);
      m[it] = bq_pair_amax<I>(Pk<I>::amax8(x));
      if (COL_AMAX) bq_col_amax8_step<I>(cm2, x);
    }
    if (COL_AMAX) bq_col_amax8_floats<I>(cm2, cm);
  } else {
#pragma unroll
    for (int it = 0; it < 8; ++it) {
      float v[8];
      bq_load8<I>(pt + it * 16 * BQ_TILE, v);
      m[it] = 0.0f;
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        m[it] = fmaxf(m[it], fabsf(v[k]));
        if (COL_AMAX) cm[k] = fmaxf(cm[k], fabsf(v[k]));
      }
    }
  }
  if (COMPACT && COL_AMAX) bq_store_col_part(sh, cm, lane, warp, cc);  // (cm's registers free)
  const float s_own = bq_scale<I, O>(bq_rows8_amax(m, j), eps, pow2);  // pass j / 2's row
  if ((j & 1) == 0) sinv[(r0 + (j >> 1) * 16 + r_first) * s_r + (c0 / BQ_TILE) * s_c] = bq_rcp(s_own);
  if (COMPACT && COL_AMAX)  // the column scales now, from the amaxes of the first read
    bq_finish_column_scales<I, O, BQ_THREADS / 32>(sh, sinv_t, a.t_r, a.t_c, r0 / BQ_TILE, c0, eps, pow2);
  float csc[8];  // the column scales (compact output)
  if (COMPACT) {
#pragma unroll
    for (int k = 0; k < 8; ++k) csc[k] = sh.col_scale()[cc + k];
  }
  const u64 g = (r0 + r_first) * cols + c0 + cc, g_step = 16 * cols;
  u8 *po = out + g;
  u8 *pc = COMPACT ? out_c + g : nullptr;
#pragma unroll 2
  for (int it = 0; it < 8; ++it) {
    float v[8];
    bq_load8<I>(pt + it * 16 * BQ_TILE, v);
    const float s = __shfl_sync(0xffffffffu, s_own, (lane & 16) | (2 * it));
    const float rs[8] = {s, s, s, s, s, s, s, s};
    bq_st8(po, bq_pack8<O>(v, rs));
    po += g_step;
    if (COMPACT) {
      bq_st8(pc, bq_pack8<O>(v, csc));
      pc += g_step;
    }
  }
  if (COL_AMAX && !COMPACT) bq_store_col_part(sh, cm, lane, warp, cc);
}

// The tile's amax (2D); PACKED (16-bit inputs): on packed pairs.
template <class I, bool PACKED>
__device__ __forceinline__ float bq_tile_amax(const typename I::T *tile, BqShared &sh) {
  float m = 0.0f;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int cc = (lane & 15) * 8;
  if (PACKED && Pk<I>::ok) {
    u32 m2 = 0;
#pragma unroll
    for (int it = 0; it < 8; ++it) {
      const int r = it * 16 + warp * 2 + (lane >> 4);
      m2 = Pk<I>::max2(m2, Pk<I>::amax8(*reinterpret_cast<const uint4 *>(tile + r * BQ_TILE + cc)));
    }
    return bq_block_max(bq_pair_amax<I>(m2), sh.red());
  }
#pragma unroll 2
  for (int it = 0; it < 8; ++it) {
    const int r = it * 16 + warp * 2 + (lane >> 4);
    float v[8];
    bq_load8<I>(tile + r * BQ_TILE + cc, v);
#pragma unroll
    for (int j = 0; j < 8; ++j) m = fmaxf(m, fabsf(v[j]));
  }
  return bq_block_max(m, sh.red());
}

// GELU, tanh approximation: 0.5 x (1 + tanh(u)) = x s with s = 1 / (1 + exp(-2 u)), u =
// sqrt(2 / pi) (x + 0.044715 x^3); exp as ex2.approx (a few float ulps from the exact
// value, below the 16-bit types' rounding). Its derivative: s + 2 x s (1 - s) du/dx.
__device__ __forceinline__ float bq_gelu_sigmoid(float x) {
  const float k = -2.0f * 0.7978845608028654f * 1.4426950408889634f;  // -2 sqrt(2/pi) log2(e)
  const float t = k * x * fmaf(0.044715f, x * x, 1.0f);
  float e;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(t));
  return __fdividef(1.0f, 1.0f + e);
}
__device__ __forceinline__ float bq_gelu(float x) { return x * bq_gelu_sigmoid(x); }
__device__ __forceinline__ float bq_dgelu(float x) {
  const float s = bq_gelu_sigmoid(x);
  const float du = 0.7978845608028654f * fmaf(3.0f * 0.044715f, x * x, 1.0f);
  return fmaf(2.0f * x * du * s, 1.0f - s, s);
}

// The activation (flags: BQ_GELU, or BQ_DGELU with act_in) of the tile (r0, c0), in place,
// each value rounded to the input type: every thread its own 16-byte chunks
// (bq_load_tile's), which its own cp.async wrote (complete for it after the wait, before
// the block's barrier); act_in's chunks read from global memory, the tile's place in it.
template <class I>
__device__ __forceinline__ void bq_act_own_chunks(typename I::T *tile, const typename I::T *act_in, u64 cols, u64 r0,
                                                  u64 c0, int flags) {
  typedef typename I::T T;
  constexpr int per = 16 / (int)sizeof(T), per_row = BQ_TILE / per;
  union Chunk {
    uint4 u;
    T v[per];
  };
#pragma unroll 4
  for (int i = 0; i < BQ_TILE * BQ_TILE / per / BQ_THREADS; ++i) {
    const int q = i * BQ_THREADS + threadIdx.x;
    T *p = tile + q * per;
    Chunk c;
    c.u = *reinterpret_cast<const uint4 *>(p);
    if ((flags & BQ_DGELU) != 0) {
      Chunk a;
      a.u = __ldg(reinterpret_cast<const uint4 *>(act_in + (r0 + q / per_row) * cols + c0 + (q % per_row) * per));
#pragma unroll
      for (int j = 0; j < per; ++j) c.v[j] = I::store(I::load(c.v[j]) * bq_dgelu(I::load(a.v[j])));
    } else {
#pragma unroll
      for (int j = 0; j < per; ++j) c.v[j] = I::store(bq_gelu(I::load(c.v[j])));
    }
    *reinterpret_cast<uint4 *>(p) = c.u;
  }
}

// The tile's column sums (f32, rows in order within each quarter, then the quarters in
// order) into dbias[c] for its 128 columns: the quarters' sums (bq_column_quarters), then
// thread c adds the four. Done (barrier) before anything else uses sh.
template <class I>
__device__ __forceinline__ void bq_column_sums(const typename I::T *tile, BqShared &sh, float *dbias) {
  bq_column_quarters<I>(tile, sh, BqSum());
  __syncthreads();
  if (threadIdx.x < BQ_TILE) {
    const int t = threadIdx.x;
    dbias[t] = ((sh.col_part[0][t] + sh.col_part[1][t]) + sh.col_part[2][t]) + sh.col_part[3][t];
  }
  __syncthreads();
}

// Issue the cp.async loads of tile (r0, c0) of the input into `tile`.
template <class I>
__device__ __forceinline__ void bq_load_tile(typename I::T *tile, const typename I::T *in, u64 cols, u64 r0, u64 c0) {
  typedef typename I::T T;
  constexpr int per_row = BQ_TILE * (int)sizeof(T) / 16;  // 16-byte chunks a row (16 or 32)
  constexpr int chunks = BQ_TILE * per_row, rows_per_pass = BQ_THREADS / per_row;
  // Chunk i * BQ_THREADS + threadIdx.x: row i * rows_per_pass + threadIdx.x / per_row,
  // chunk threadIdx.x % per_row of it (the tile's rows are contiguous in shared memory).
  T *s0 = tile + threadIdx.x * (16 / sizeof(T));
  const T *g0 = in + (r0 + threadIdx.x / per_row) * cols + c0 + (threadIdx.x % per_row) * (16 / sizeof(T));
#pragma unroll
  for (int i = 0; i < chunks / BQ_THREADS; ++i) {
    T *s = s0 + i * BQ_THREADS * (16 / sizeof(T));
    const T *g = g0 + i * rows_per_pass * cols;
    bq_cp_async16(s, g);
  }
}

// Whether bq_rows_1d takes the compact columnwise output's column amaxes in its first read
// (COMPACT with COL_AMAX): float16 does not, as its 64 registers (4 blocks an SM) would spill.
template <class I>
struct BqCompactInRows {
  static constexpr bool ok = true;
};
template <>
struct BqCompactInRows<F16> {
  static constexpr bool ok = false;
};

// 2D: tile (rb, cb)'s scale inverse, by thread 0, to the rowwise output's scales (when it
// is written: `row`) and the columnwise output's (when col_mode has one).
__device__ __forceinline__ void bq_store_tile_sinv(float tile_scale, bool row, float *sinv, float *sinv_t,
                                                   const BlockQuantArgs &a, u64 rb, u64 cb) {
  if (threadIdx.x != 0) return;
  const float r = bq_rcp(tile_scale);
  if (row) sinv[rb * a.s_r + cb * a.s_c] = r;
  if (a.col_mode != BQ_COL_NONE) sinv_t[rb * a.t_r + cb * a.t_c] = r;
}

// Quantize tile (rb, cb), already in shared memory (`stage`: the tile, reused as the
// transpose's staging area once read); its column sums to dbias when not null.
template <class I, class O, int TWO_D>
__device__ __forceinline__ void bq_process_tile(unsigned char *stage, BqShared &sh, u8 *out, u8 *out_t, float *sinv,
                                                float *sinv_t, float *dbias, const BlockQuantArgs &a, u64 rb,
                                                u64 cb) {
  const u64 r0 = rb * BQ_TILE, c0 = cb * BQ_TILE;
  const typename I::T *tile = reinterpret_cast<const typename I::T *>(stage);
  const int col_mode = a.col_mode;
  if (dbias != nullptr) bq_column_sums<I>(tile, sh, dbias + rb * a.cols + c0);
  float tile_scale = 1.0f;
  if (TWO_D) {
    const float amax = (a.flags & BQ_PACKED) != 0 ? bq_tile_amax<I, true>(tile, sh) : bq_tile_amax<I, false>(tile, sh);
    tile_scale = bq_scale<I, O>(amax, a.eps, a.pow2);
    bq_store_tile_sinv(tile_scale, out != nullptr, sinv, sinv_t, a, rb, cb);
  }
  // 1D rowwise + transposed columnwise: the rows pass also takes the columns' amaxes (and
  // with the compact columnwise output and BQ_ROWS8, bq_rows_1d finishes their scales too,
  // where BqCompactInRows allows it).
  const bool fused = !TWO_D && out != nullptr && col_mode == BQ_COL_TRANSPOSED;
  const bool compact_in_rows = BqCompactInRows<I>::ok && !TWO_D && out != nullptr && col_mode == BQ_COL_COMPACT &&
                               (a.flags & BQ_ROWS8) != 0;
  if (!TWO_D && col_mode != BQ_COL_NONE && !fused && !compact_in_rows) {
    if ((a.flags & BQ_PACKED) != 0)
      bq_column_scales<I, O, true>(tile, sh, sinv_t, a.t_r, a.t_c, rb, c0, a.eps, a.pow2);
    else
      bq_column_scales<I, O, false>(tile, sh, sinv_t, a.t_r, a.t_c, rb, c0, a.eps, a.pow2);
  }
  const bool compact = col_mode == BQ_COL_COMPACT;
#define BQ_ROWS_1D(COMPACT, COL_AMAX)                                                                        \
  ((a.flags & BQ_PACKED) != 0                                                                                \
       ? bq_rows_1d<I, O, COMPACT, COL_AMAX, true>(tile, sh, out, out_t, sinv, sinv_t, a, r0, c0)           \
       : bq_rows_1d<I, O, COMPACT, COL_AMAX, false>(tile, sh, out, out_t, sinv, sinv_t, a, r0, c0))
#define BQ_ROWS(ROW, COMPACT, COL_AMAX)                                                                       \
  bq_rows<I, O, TWO_D, ROW, COMPACT, COL_AMAX>(tile, sh, tile_scale, out, out_t, sinv, a.s_r, a.s_c, a.cols, r0, \
                                               c0, a.eps, a.pow2)
  if (!TWO_D && out != nullptr && (a.flags & BQ_ROWS8) != 0) {
    if (fused)
      BQ_ROWS_1D(false, true);
    else if (compact && BqCompactInRows<I>::ok)
      BQ_ROWS_1D(true, true);
    else if (compact)
      BQ_ROWS_1D(true, false);
    else
      BQ_ROWS_1D(false, false);
  } else if (fused)
    BQ_ROWS(true, false, true);
  else if (out != nullptr && compact)
    BQ_ROWS(true, true, false);
  else if (out != nullptr)
    BQ_ROWS(true, false, false);
  else if (compact)
    BQ_ROWS(false, true, false);
#undef BQ_ROWS
#undef BQ_ROWS_1D
  if (fused) bq_finish_column_scales<I, O, BQ_THREADS / 32>(sh, sinv_t, a.t_r, a.t_c, rb, c0, a.eps, a.pow2);
  if (col_mode == BQ_COL_TRANSPOSED)
    bq_columns_transposed<I, O, TWO_D>(tile, stage, sh, tile_scale, out_t, a.rows, r0, c0);
}

// Tiles blockIdx.x, + gridDim.x, ... (tile t: tile row t / (cols / 128), tile column t %
// (cols / 128); the host launches one block a tile), each loaded into shared memory, then
// quantized. out: rowwise FP8 [rows, cols] or null; out_t: columnwise FP8 ([cols, rows] when
// col_mode is transposed, [rows, cols] when compact) or null (col_mode none); sinv / sinv_t:
// their scale inverses (strides in `a`); noop: TE's noop flag (1: do nothing) or null;
// dbias: f32 [rows / 128, cols], each tile's column sums, or null; act_in: BQ_DGELU's
// activation input ([rows, cols] of the input's type), else unused.
template <class I, class O, int TWO_D>
__device__ __forceinline__ void block_quantize_impl(const typename I::T *in, u8 *out, u8 *out_t, float *sinv,
                                                    float *sinv_t, const float *noop, float *dbias,
                                                    const typename I::T *act_in, const BlockQuantArgs &a) {
  if (noop != nullptr && *noop == 1.0f) return;
  extern __shared__ __align__(16) unsigned char bq_smem[];
  __shared__ BqShared sh;
  const u32 tiles_c = (u32)(a.cols / BQ_TILE), tiles = (u32)(a.rows / BQ_TILE) * tiles_c;
  for (u32 t = blockIdx.x; t < tiles; t += gridDim.x) {  // t + gridDim.x < 2^32: tiles < 2^31 (block.rs)
    bq_load_tile<I>(reinterpret_cast<typename I::T *>(bq_smem), in, a.cols, (u64)(t / tiles_c) * BQ_TILE,
                    (u64)(t % tiles_c) * BQ_TILE);
    asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;" ::: "memory");
    if ((a.flags & (BQ_GELU | BQ_DGELU)) != 0)
      bq_act_own_chunks<I>(reinterpret_cast<typename I::T *>(bq_smem), act_in, a.cols, (u64)(t / tiles_c) * BQ_TILE,
                           (u64)(t % tiles_c) * BQ_TILE, a.flags);
    __syncthreads();
    bq_process_tile<I, O, TWO_D>(bq_smem, sh, out, out_t, sinv, sinv_t, dbias, a, t / tiles_c, t % tiles_c);
    __syncthreads();  // every read of the tile (and of `sh`) done before it is refilled
  }
}

// The register path (NVTE_COMM_BLOCK_QUANT=fast, the default, for 16-bit inputs without an
// activation, a bias gradient or the compact format; =regs: the compact format too): the
// tile goes from global memory straight into registers, without the shared-memory copy. Thread t holds an 8 x 8 block of it, rows 8 (t / 16) .. + 7 and
// columns 8 (t % 16) .. + 7 (x[j]: row j of it, one 16-byte load each; a warp's load
// covers two whole 256-byte rows). Row amaxes as bq_rows_1d's (bq_rows8_amax), column
// amaxes over the thread's 8 rows, then across the warps (sh.col_part); rowwise and
// compact columnwise values are stored from the registers (8 bytes a row), transposed
// columnwise values are staged in `stage` (16 KiB: row c holds column c, its 8-byte slots
// g = row / 8 swizzled by c / 8) and leave as whole 128-byte runs of the [cols, rows]
// output. The same bytes as block_quantize_impl's paths.
template <class I>
__device__ __forceinline__ float bq_elem(const uint4 &v, int i) {  // value i of the 8
  const u32 w = i < 2 ? v.x : i < 4 ? v.y : i < 6 ? v.z : v.w;
  return (i & 1) ? Pk<I>::hi(w) : Pk<I>::lo(w);
}

// Rows 8 g .. + 7 of the tile (r0, c0) from x: each row's scale (1D; 2D: tile_scale), its
// scale inverse (1D: thread j = 2 r' of the half-warp writes row r''s) and its 8 FP8 bytes.
template <class I, class O, int TWO_D>
__device__ __forceinline__ void bq_regs_rows(const uint4 (&x)[8], float tile_scale, u8 *out, float *sinv,
                                             const BlockQuantArgs &a, u64 r0, u64 c0) {
  const int lane = threadIdx.x & 31, k = threadIdx.x & 15, g = threadIdx.x >> 4;
  float s_own = tile_scale;
  if (!TWO_D) {
    float m[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) m[j] = bq_pair_amax<I>(Pk<I>::amax8(x[j]));
    s_own = bq_scale<I, O>(bq_rows8_amax(m, k), a.eps, a.pow2);  // row 8 g + k / 2's
    if ((k & 1) == 0) sinv[(r0 + 8 * g + (k >> 1)) * a.s_r + (c0 / BQ_TILE) * a.s_c] = bq_rcp(s_own);
  }
  u8 *po = out + (r0 + 8 * g) * a.cols + c0 + 8 * k;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const float s = TWO_D ? tile_scale : __shfl_sync(0xffffffffu, s_own, (lane & 16) | (2 * j));
    float v[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = bq_elem<I>(x[j], i);
    const float rs[8] = {s, s, s, s, s, s, s, s};
    bq_st8(po + j * a.cols, bq_pack8<O>(v, rs));
  }
}

// 1D: the columns' amaxes over the tile (the thread's 8 rows, then every warp's), their
// scales and scale inverses (bq_finish_column_scales): sh.col_scale() after the call.
template <class I, class O>
__device__ __forceinline__ void bq_regs_column_scales(const uint4 (&x)[8], BqShared &sh, float *sinv_t,
                                                      const BlockQuantArgs &a, u64 rb, u64 c0) {
  u32 cm2[4] = {0, 0, 0, 0};
#pragma unroll
  for (int j = 0; j < 8; ++j) bq_col_amax8_step<I>(cm2, x[j]);
  float cm[8];
  bq_col_amax8_floats<I>(cm2, cm);
  bq_store_col_part(sh, cm, threadIdx.x & 31, threadIdx.x >> 5, 8 * (threadIdx.x & 15));
  bq_finish_column_scales<I, O, BQ_THREADS / 32>(sh, sinv_t, a.t_r, a.t_c, rb, c0, a.eps, a.pow2);
}

// The columnwise FP8 values of the thread's 8 x 8 block (column scales: sh.col_scale(), or
// tile_scale for 2D): compact, stored as rows; transposed, staged (column c's 8 bytes at
// slot g ^ (c / 8) of stage row c), then, once every thread's are, stored as 128-byte runs.
template <class I, class O, int TWO_D>
__device__ __forceinline__ void bq_regs_columns(const uint4 (&x)[8], const BqShared &sh, float tile_scale,
                                                u8 *stage, u8 *out_t, const BlockQuantArgs &a, u64 r0, u64 c0) {
  const int k = threadIdx.x & 15, g = threadIdx.x >> 4;
  float cs[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) cs[i] = TWO_D ? tile_scale : sh.col_scale()[8 * k + i];
  if (a.col_mode == BQ_COL_COMPACT) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      float v[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = bq_elem<I>(x[j], i);
      bq_st8(out_t + (r0 + 8 * g + j) * a.cols + c0 + 8 * k, bq_pack8<O>(v, cs));
    }
    return;
  }
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    float v[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = bq_elem<I>(x[j], i);
    const float s8[8] = {cs[i], cs[i], cs[i], cs[i], cs[i], cs[i], cs[i], cs[i]};
    reinterpret_cast<uint2 *>(stage + (8 * k + i) * BQ_TILE)[g ^ k] = bq_pack8<O>(v, s8);
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < BQ_TILE * BQ_TILE / 16 / BQ_THREADS; ++i) {
    const int q = i * BQ_THREADS + threadIdx.x, row = q >> 3, kk = q & 7, sw = row >> 3;
    // logical slots 2 kk, 2 kk + 1 sit at 2 kk ^ sw, (2 kk + 1) ^ sw: one 16-byte chunk,
    // its halves swapped when sw is odd
    uint4 v = reinterpret_cast<const uint4 *>(stage + row * BQ_TILE)[kk ^ (sw >> 1)];
    if (sw & 1) v = make_uint4(v.z, v.w, v.x, v.y);
    bq_st16(out_t + (c0 + row) * a.rows + r0 + 16 * kk, v);
  }
}

// One tile (rb, cb) by the register path.
template <class I, class O, int TWO_D>
__device__ __forceinline__ void bq_regs_tile(const typename I::T *in, u8 *stage, BqShared &sh, u8 *out, u8 *out_t,
                                             float *sinv, float *sinv_t, const BlockQuantArgs &a, u64 rb, u64 cb) {
  const u64 r0 = rb * BQ_TILE, c0 = cb * BQ_TILE;
  const int k = threadIdx.x & 15, g = threadIdx.x >> 4;
  uint4 x[8];
  const typename I::T *p = in + (r0 + 8 * g) * a.cols + c0 + 8 * k;
#pragma unroll
  for (int j = 0; j < 8; ++j) x[j] = __ldg(reinterpret_cast<const uint4 *>(p + j * a.cols));
  float tile_scale = 1.0f;
  if (TWO_D) {
    u32 m2 = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) m2 = Pk<I>::max2(m2, Pk<I>::amax8(x[j]));
    tile_scale = bq_scale<I, O>(bq_block_max(bq_pair_amax<I>(m2), sh.red()), a.eps, a.pow2);
    bq_store_tile_sinv(tile_scale, out != nullptr, sinv, sinv_t, a, rb, cb);
  }
  if (out != nullptr) bq_regs_rows<I, O, TWO_D>(x, tile_scale, out, sinv, a, r0, c0);
  if (a.col_mode == BQ_COL_NONE) return;
  if (!TWO_D) bq_regs_column_scales<I, O>(x, sh, sinv_t, a, rb, c0);
  bq_regs_columns<I, O, TWO_D>(x, sh, tile_scale, stage, out_t, a, r0, c0);
}

// The register path's kernel body: tiles blockIdx.x, + gridDim.x, ... as
// block_quantize_impl's (same arguments; dbias and act_in unused: the host sends neither).
template <class I, class O, int TWO_D>
__device__ __forceinline__ void block_quantize_regs_impl(const typename I::T *in, u8 *out, u8 *out_t, float *sinv,
                                                         float *sinv_t, const float *noop, const BlockQuantArgs &a) {
  if (noop != nullptr && *noop == 1.0f) return;
  extern __shared__ __align__(16) unsigned char bq_smem[];
  __shared__ BqShared sh;
  const u32 tiles_c = (u32)(a.cols / BQ_TILE), tiles = (u32)(a.rows / BQ_TILE) * tiles_c;
  for (u32 t = blockIdx.x; t < tiles; t += gridDim.x) {
    bq_regs_tile<I, O, TWO_D>(in, bq_smem, sh, out, out_t, sinv, sinv_t, a, t / tiles_c, t % tiles_c);
    __syncthreads();  // every read of `stage` and `sh` done before the next tile writes them
  }
}

// Blocks an SM should hold (the launch bounds' minimum, what registers allow without
// spills; shared memory allows 6 with a 32 KiB tile, 3 with 64 KiB): bf16 5 (48
// registers), fp16 4, float32 3. (At 6, 40 registers, bf16 measured no faster.)
#define BQ_MINB_f32 3
#define BQ_MINB_bf16 5
#define BQ_MINB_f16 4
#define BLOCK_QUANTIZE(mname, TWO_D, iname, I, oname, O)                                                \
  extern "C" __global__ void __launch_bounds__(BQ_THREADS, BQ_MINB_##iname)                           \
      block_quantize_##mname##_##iname##_##oname(const I::T *in, u8 *out, u8 *out_t, float *sinv,     \
                                                 float *sinv_t, const float *noop, float *dbias,      \
                                                 const I::T *act_in, BlockQuantArgs args) {           \
    block_quantize_impl<I, O, TWO_D>(in, out, out_t, sinv, sinv_t, noop, dbias, act_in, args);        \
  }
#define BLOCK_QUANTIZE_IN(mname, TWO_D, iname, I)   \
  BLOCK_QUANTIZE(mname, TWO_D, iname, I, e4m3, E4M3) \
  BLOCK_QUANTIZE(mname, TWO_D, iname, I, e5m2, E5M2)
#define BLOCK_QUANTIZE_MODE(mname, TWO_D)      \
  BLOCK_QUANTIZE_IN(mname, TWO_D, f32, F32)    \
  BLOCK_QUANTIZE_IN(mname, TWO_D, bf16, BF16)  \
  BLOCK_QUANTIZE_IN(mname, TWO_D, f16, F16)
BLOCK_QUANTIZE_MODE(1d, 0)
BLOCK_QUANTIZE_MODE(2d, 1)

// The register path's kernels (16-bit inputs; src/kernels/block.rs, takes_regs, says when
// the host names them): block_quantize_regs<1d|2d>_<in>_<out>, the same parameters.
#define BQ_REGS_MINB 4
#define BLOCK_QUANTIZE_REGS(mname, TWO_D, iname, I, oname, O)                                      \
  extern "C" __global__ void __launch_bounds__(BQ_THREADS, BQ_REGS_MINB)                         \
      block_quantize_regs##mname##_##iname##_##oname(const I::T *in, u8 *out, u8 *out_t, float *sinv, \
                                                     float *sinv_t, const float *noop, float *dbias,  \
                                                     const I::T *act_in, BlockQuantArgs args) {       \
    block_quantize_regs_impl<I, O, TWO_D>(in, out, out_t, sinv, sinv_t, noop, args);               \
  }
#define BLOCK_QUANTIZE_REGS_IN(mname, TWO_D, iname, I)   \
  BLOCK_QUANTIZE_REGS(mname, TWO_D, iname, I, e4m3, E4M3) \
  BLOCK_QUANTIZE_REGS(mname, TWO_D, iname, I, e5m2, E5M2)
BLOCK_QUANTIZE_REGS_IN(1d, 0, bf16, BF16)
BLOCK_QUANTIZE_REGS_IN(1d, 0, f16, F16)
BLOCK_QUANTIZE_REGS_IN(2d, 1, bf16, BF16)
BLOCK_QUANTIZE_REGS_IN(2d, 1, f16, F16)

// Dequantize: out[r, c] = cast(fp8 value * scale_inv of its block) for the [rows, cols]
// logical matrix, from FP8 data stored as [rows, cols] (transposed = 0) or [cols, rows]
// (transposed = 1); the scale of element (r, c) is sinv[(r / br) * s_r + (c / bc) * s_c].
// Grid-stride over the stored elements, 4 at a time (stored rows are multiples of 4 long).
template <class E, class O>
__device__ __forceinline__ void block_dequantize_impl(const u8 *in, typename O::T *out, const float *sinv, u64 rows,
                                                      u64 cols, int transposed, u64 br, u64 bc, u64 s_r, u64 s_c) {
  const u64 n4 = rows * cols / 4;
  const u64 inner = transposed ? rows : cols;  // length of a stored row
  for (u64 q = (u64)blockIdx.x * blockDim.x + threadIdx.x; q < n4; q += (u64)gridDim.x * blockDim.x) {
    const u32 w = *reinterpret_cast<const u32 *>(in + 4 * q);
    const u64 i = (4 * q) / inner, j0 = (4 * q) % inner;  // stored row, first stored column
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const u64 r = transposed ? j0 + k : i, c = transposed ? i : j0 + k;
      const float s = sinv[(r / br) * s_r + (c / bc) * s_c];
      out[r * cols + c] = O::store(E::load((u8)(w >> (8 * k))) * s);
    }
  }
}

#define BLOCK_DEQUANTIZE(ename, E, oname, O)                                                                  \
  extern "C" __global__ void block_dequantize_##ename##_##oname(const u8 *in, O::T *out, const float *sinv,  \
                                                                u64 rows, u64 cols, int transposed, u64 br,  \
                                                                u64 bc, u64 s_r, u64 s_c) {                  \
    block_dequantize_impl<E, O>(in, out, sinv, rows, cols, transposed, br, bc, s_r, s_c);                    \
  }
#define BLOCK_DEQUANTIZE_FROM(ename, E)    \
  BLOCK_DEQUANTIZE(ename, E, f32, F32)    \
  BLOCK_DEQUANTIZE(ename, E, bf16, BF16)  \
  BLOCK_DEQUANTIZE(ename, E, f16, F16)
BLOCK_DEQUANTIZE_FROM(e4m3, E4M3)
BLOCK_DEQUANTIZE_FROM(e5m2, E5M2)
