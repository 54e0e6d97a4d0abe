// Element-wise kernels: quantize (with scale, amax and scale_inv as TE's per-tensor
// scaling defines them; FP8 outputs vectorized, optionally with the transposed
// (columnwise) output from the same pass), amax, the scale from an amax (current
// scaling), the delayed-scaling amax-history / scale update, transpose, dequantize, and a
// counter-based uniform random fill.
//
// The element types come from types.cuh.
#include "types.cuh"

// Max of non-negative floats: their bit patterns order like integers.
__device__ __forceinline__ void atomic_max_nonneg(float *addr, float v) {
  atomicMax(reinterpret_cast<int *>(addr), __float_as_int(v));
}

__device__ __forceinline__ float block_max(float v) {
  __shared__ float warp_max[32];
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) warp_max[warp] = v;
  __syncthreads();
  const int nwarps = (blockDim.x + 31) >> 5;
  v = (threadIdx.x < nwarps) ? warp_max[threadIdx.x] : 0.0f;
  if (warp == 0)
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// out = cast(in * scale); amax = max(amax, max|in|); scale_inv = 1 / scale.
// scale, amax and scale_inv may each be null (scale null means 1).
template <class I, class O>
__device__ void quantize_impl(const typename I::T *in, typename O::T *out, u64 n, const float *scale,
                              float *amax, float *scale_inv) {
  const float s = scale ? *scale : 1.0f;
  float local = 0.0f;
  const u64 stride = (u64)gridDim.x * blockDim.x;
  for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    const float v = I::load(in[i]);
    local = fmaxf(local, fabsf(v));
    out[i] = O::store(v * s);
  }
  if (amax != nullptr) {
    const float b = block_max(local);
    if (threadIdx.x == 0) atomic_max_nonneg(amax, b);
  }
  if (scale_inv != nullptr && blockIdx.x == 0 && threadIdx.x == 0) *scale_inv = 1.0f / s;
}

// out = cast(in * scale_inv)
template <class I, class O>
__device__ void dequantize_impl(const typename I::T *in, typename O::T *out, u64 n, const float *scale_inv) {
  const float s = scale_inv ? *scale_inv : 1.0f;
  const u64 stride = (u64)gridDim.x * blockDim.x;
  for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) out[i] = O::store(I::load(in[i]) * s);
}

__device__ __forceinline__ u64 mix64(u64 z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// out[i] = cast(lo + (hi - lo) * u_i), u_i uniform in [0, 1) from (seed, i).
template <class O>
__device__ void fill_uniform_impl(typename O::T *out, u64 n, u64 seed, float lo, float hi) {
  const u64 stride = (u64)gridDim.x * blockDim.x;
  const u64 key = mix64(seed + 0x9e3779b97f4a7c15ull);
  for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    const u32 bits = (u32)(mix64(key ^ (i * 0x9e3779b97f4a7c15ull)) >> 40);  // 24 random bits
    const float u = (float)bits * (1.0f / 16777216.0f);
    out[i] = O::store(lo + (hi - lo) * u);
  }
}

#define QUANTIZE(iname, I, oname, O)                                                             \
  extern "C" __global__ void quantize_##iname##_##oname(const I::T *in, O::T *out, u64 n,       \
                                                        const float *scale, float *amax,         \
                                                        float *scale_inv) {                      \
    quantize_impl<I, O>(in, out, n, scale, amax, scale_inv);                                     \
  }
#define QUANTIZE_FROM(iname, I)   \
  QUANTIZE(iname, I, f32, F32)    \
  QUANTIZE(iname, I, bf16, BF16)  \
  QUANTIZE(iname, I, f16, F16)    \
  QUANTIZE(iname, I, e4m3, E4M3)  \
  QUANTIZE(iname, I, e5m2, E5M2)
QUANTIZE_FROM(f32, F32)
QUANTIZE_FROM(bf16, BF16)
QUANTIZE_FROM(f16, F16)

#define DEQUANTIZE(iname, I, oname, O)                                                           \
  extern "C" __global__ void dequantize_##iname##_##oname(const I::T *in, O::T *out, u64 n,     \
                                                          const float *scale_inv) {              \
    dequantize_impl<I, O>(in, out, n, scale_inv);                                                \
  }
DEQUANTIZE(e4m3, E4M3, f32, F32)
DEQUANTIZE(e4m3, E4M3, bf16, BF16)
DEQUANTIZE(e4m3, E4M3, f16, F16)
DEQUANTIZE(e5m2, E5M2, f32, F32)
DEQUANTIZE(e5m2, E5M2, bf16, BF16)
DEQUANTIZE(e5m2, E5M2, f16, F16)

#define FILL(oname, O)                                                                           \
  extern "C" __global__ void fill_uniform_##oname(O::T *out, u64 n, u64 seed, float lo, float hi) { \
    fill_uniform_impl<O>(out, n, seed, lo, hi);                                                  \
  }
FILL(f32, F32)
FILL(bf16, BF16)
FILL(f16, F16)
FILL(e4m3, E4M3)
FILL(e5m2, E5M2)

// ------------------------------------------------------------------ FP8 quantization

// TE's noop flag (kNVTEQuantizationConfigNoopTensor): a kernel given a flag that holds 1
// does nothing, so a captured graph can skip it.
__device__ __forceinline__ bool noop_set(const float *noop) { return noop != nullptr && *noop == 1.0f; }

// scale_inv (and the columnwise one, when it is a different buffer) = 1 / scale, once.
__device__ __forceinline__ void write_scale_inv(float s, float *sinv, float *sinv_t) {
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    float r;
    asm("rcp.rn.f32 %0, %1;" : "=f"(r) : "f"(s));
    if (sinv != nullptr) *sinv = r;
    if (sinv_t != nullptr && sinv_t != sinv) *sinv_t = r;
  }
}

__device__ __forceinline__ void finish_amax(float local, float *amax) {
  if (amax != nullptr) {
    const float b = block_max(local);
    if (threadIdx.x == 0) atomic_max_nonneg(amax, b);
  }
}

// Rowwise FP8 quantize of n elements: 16 elements a thread per step (16-byte FP8 stores,
// 16- or 32-byte-aligned loads) when `vec` (both pointers 16-byte aligned), the rest
// (or everything when !vec) one element at a time. One atomic per block for amax.
template <class I, class O>
__device__ void quantize_fp8_impl(const typename I::T *__restrict__ in, u8 *__restrict__ out, u64 n,
                                  const float *scale, float *amax, float *sinv, float *sinv_t,
                                  const float *noop, int vec) {
  if (noop_set(noop)) return;
  const float s = scale ? *scale : 1.0f;
  float local = 0.0f;
  const u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x;
  const u64 stride = (u64)gridDim.x * blockDim.x;
  const u64 nv = vec ? n / 16 : 0;
  for (u64 v = tid; v < nv; v += stride) {
    float x[16];
    load8<I>(in + v * 16, x);
    load8<I>(in + v * 16 + 8, x + 8);
    u32 w[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
      for (int k = 0; k < 4; ++k) local = fmaxf(local, fabsf(x[4 * j + k]));
      w[j] = fp8_pack2<O>(x[4 * j] * s, x[4 * j + 1] * s) |
             (fp8_pack2<O>(x[4 * j + 2] * s, x[4 * j + 3] * s) << 16);
    }
    *reinterpret_cast<uint4 *>(out + v * 16) = make_uint4(w[0], w[1], w[2], w[3]);
  }
  for (u64 i = nv * 16 + tid; i < n; i += stride) {
    const float x = I::load(in[i]);
    local = fmaxf(local, fabsf(x));
    out[i] = O::store(x * s);
  }
  finish_amax(local, amax);
  write_scale_inv(s, sinv, sinv_t);
}

// Cast + transpose of a [rows, cols] input: `out` (may be null) gets the rowwise FP8
// data, `out_t` (may be null) the FP8 transpose [cols, rows]. Each warp owns 64x64 tiles
// (grid-stride over tiles); a lane converts 16 rows x 8 columns: two rows at a time, each
// pair of vertically adjacent elements in one cvt (low byte the upper row), so the bytes
// of a column's 16 rows assemble in registers as one 16-byte word; the rowwise bytes are
// picked out of the same pairs with prmt. The column words go through shared memory
// (swizzled: conflict-free 16-byte stores and loads) so that the transposed tile leaves
// as 64-byte runs of each output row. Tiles past an edge, or any tile when `fast` is 0
// (unaligned pointers, cols % 8 or rows % 16 non-zero), go element by element.
#define CT_WARPS 8
template <class I, class O>
__device__ void cast_transpose_impl(const typename I::T *__restrict__ in, u8 *__restrict__ out,
                                    u8 *__restrict__ out_t, u64 rows, u64 cols, const float *scale,
                                    float *amax, float *sinv, float *sinv_t, const float *noop,
                                    int fast) {
  __shared__ uint4 tile_t[CT_WARPS][64 * 4];  // per warp: 64 columns x 64 rows of FP8
  if (noop_set(noop)) return;
  const float s = scale ? *scale : 1.0f;
  float local = 0.0f;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int rg = lane & 3, cg = lane >> 2;  // 16-row group, 8-column group
  const u64 tiles_c = (cols + 63) / 64, ntiles = ((rows + 63) / 64) * tiles_c;
  uint4 *sm = tile_t[warp];
  for (u64 t = (u64)blockIdx.x * CT_WARPS + warp; t < ntiles; t += (u64)gridDim.x * CT_WARPS) {
    const u64 r0 = (t / tiles_c) * 64, c0 = (t % tiles_c) * 64;
    if (fast && r0 + 64 <= rows && c0 + 64 <= cols) {
      u32 pk[8][4];
      const typename I::T *src = in + (r0 + 16 * rg) * cols + c0 + 8 * cg;
      u8 *dst = out ? out + (r0 + 16 * rg) * cols + c0 + 8 * cg : nullptr;
#pragma unroll
      for (int i = 0; i < 16; i += 2) {
        float a[8], b[8];
        load8<I>(src + (u64)i * cols, a);
        load8<I>(src + (u64)(i + 1) * cols, b);
        u32 h[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          local = fmaxf(local, fmaxf(fabsf(a[k]), fabsf(b[k])));
          h[k] = fp8_pack2<O>(a[k] * s, b[k] * s);  // byte 0: row i, byte 1: row i + 1
          if ((i & 2) == 0)
            pk[k][i >> 2] = h[k];
          else
            pk[k][i >> 2] |= h[k] << 16;
        }
        if (dst != nullptr) {
          const u32 t01 = prmt(h[0], h[1], 0x5140), t23 = prmt(h[2], h[3], 0x5140);
          const u32 t45 = prmt(h[4], h[5], 0x5140), t67 = prmt(h[6], h[7], 0x5140);
          *reinterpret_cast<uint2 *>(dst + (u64)i * cols) = make_uint2(prmt(t01, t23, 0x5410), prmt(t45, t67, 0x5410));
          *reinterpret_cast<uint2 *>(dst + (u64)(i + 1) * cols) =
              make_uint2(prmt(t01, t23, 0x7632), prmt(t45, t67, 0x7632));
        }
      }
      if (out_t != nullptr) {
        // Column c's rows 16*rg.. go to 16-byte unit rg of shared row (c ^ (c/8 & 1)):
        // the 8 lanes of a store phase (rg 0..3, two adjacent cg) hit 8 different units.
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          const int c = 8 * cg + k, pc = c ^ (cg & 1);
          sm[pc * 4 + rg] = make_uint4(pk[k][0], pk[k][1], pk[k][2], pk[k][3]);
        }
        __syncwarp();
#pragma unroll
        for (int it = 0; it < 8; ++it) {
          const int u = lane & 3, c = 8 * it + (lane >> 2), pc = c ^ (it & 1);
          *reinterpret_cast<uint4 *>(out_t + (c0 + c) * rows + r0 + 16 * u) = sm[pc * 4 + u];
        }
        __syncwarp();
      }
    } else {
      const u64 rn = (rows - r0 < 64) ? rows - r0 : 64, cn = (cols - c0 < 64) ? cols - c0 : 64;
      for (u64 e = lane; e < rn * cn; e += 32) {
        const u64 r = r0 + e / cn, c = c0 + e % cn;
        const float x = I::load(in[r * cols + c]);
        local = fmaxf(local, fabsf(x));
        const u8 q = O::store(x * s);
        if (out) out[r * cols + c] = q;
        if (out_t) out_t[c * rows + r] = q;
      }
    }
  }
  finish_amax(local, amax);
  write_scale_inv(s, sinv, sinv_t);
}

// amax = max(amax, max|in|) (callers zero it first, as TE's nvte_compute_amax does).
template <class I>
__device__ void amax_impl(const typename I::T *__restrict__ in, u64 n, float *amax, const float *noop, int vec) {
  if (noop_set(noop)) return;
  float local = 0.0f;
  const u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x;
  const u64 stride = (u64)gridDim.x * blockDim.x;
  const u64 nv = vec ? n / 16 : 0;
  for (u64 v = tid; v < nv; v += stride) {
    float x[16];
    load8<I>(in + v * 16, x);
    load8<I>(in + v * 16 + 8, x + 8);
#pragma unroll
    for (int k = 0; k < 16; ++k) local = fmaxf(local, fabsf(x[k]));
  }
  for (u64 i = nv * 16 + tid; i < n; i += stride) local = fmaxf(local, fabsf(I::load(in[i])));
  finish_amax(local, amax);
}

#define QUANTIZE_FP8(iname, I, oname, O)                                                              \
  extern "C" __global__ void __launch_bounds__(256) quantize_fp8_##iname##_##oname(                   \
      const I::T *in, u8 *out, u64 n, const float *scale, float *amax, float *sinv, float *sinv_t,   \
      const float *noop, int vec) {                                                                   \
    quantize_fp8_impl<I, O>(in, out, n, scale, amax, sinv, sinv_t, noop, vec);                        \
  }                                                                                                   \
  extern "C" __global__ void __launch_bounds__(256, 2) cast_transpose_##iname##_##oname(              \
      const I::T *in, u8 *out, u8 *out_t, u64 rows, u64 cols, const float *scale, float *amax,       \
      float *sinv, float *sinv_t, const float *noop, int fast) {                                      \
    cast_transpose_impl<I, O>(in, out, out_t, rows, cols, scale, amax, sinv, sinv_t, noop, fast);     \
  }
#define QUANTIZE_FP8_FROM(iname, I)  \
  QUANTIZE_FP8(iname, I, e4m3, E4M3) \
  QUANTIZE_FP8(iname, I, e5m2, E5M2) \
  extern "C" __global__ void __launch_bounds__(256) amax_##iname(const I::T *in, u64 n, float *amax, \
                                                                 const float *noop, int vec) {       \
    amax_impl<I>(in, n, amax, noop, vec);                                                            \
  }
QUANTIZE_FP8_FROM(f32, F32)
QUANTIZE_FP8_FROM(bf16, BF16)
QUANTIZE_FP8_FROM(f16, F16)

// *amax = 0 unless the noop flag is set (TE zeroes before its atomic-max amax pass).
extern "C" __global__ void zero_amax(float *amax, const float *noop) {
  if (!noop_set(noop)) *amax = 0.0f;
}

// TE's per-tensor current scaling: scale = fp8_max / max(amax, epsilon); amax 0, inf or
// NaN gives 1; a scale that overflows float gives float max; optionally rounded down to a
// power of 2 (mantissa cleared). Writes only the scale, as TE does.
extern "C" __global__ void scale_from_amax(const float *amax, float *scale, float fp8_max, int pow2,
                                           float epsilon, const float *noop) {
  if (noop_set(noop)) return;
  float a = *amax;
  if (a < epsilon) a = epsilon;
  float sc = 1.0f;
  if (!(isinf(a) || a == 0.0f || isnan(a))) {
    asm("div.rn.f32 %0, %1, %2;" : "=f"(sc) : "f"(fp8_max), "f"(a));
    if (isinf(sc)) sc = 3.402823466e+38f;
    if (pow2) sc = __uint_as_float(__float_as_uint(sc) & 0xff800000u);
  }
  *scale = sc;
}

// TE's delayed-scaling recipe for one scale (block = 256 threads, grid = num_scales):
// history [len, num_scales] (column `blockIdx.x`) rolled by -1 into `upd_hist` with the
// newest slot (row 0) zeroed; amax = the rolled-out row 0 ("most_recent", algo 0) or the
// max over the whole history ("max", algo 1); scale = scaled_max / amax when amax is finite
// and > 0, else the old scale; an infinite scale becomes float max. In place allowed.
extern "C" __global__ void __launch_bounds__(256) delayed_scaling_update(
    const float *hist, const float *scale, float *upd_hist, float *upd_scale, u64 len, u64 stride,
    int algo, float scaled_max) {
  __shared__ float red[256];
  const u64 tid = threadIdx.x, col = blockIdx.x;
  const float *h = hist + col;
  float *uh = upd_hist + col;
  const float last = h[0];
  float m = 0.0f;
  for (u64 off = 0; off < len; off += 256) {
    const u64 i = off + tid;
    float a = 0.0f;
    if (i < len) {
      a = (i < len - 1) ? h[(i + 1) * stride] : last;
      m = fmaxf(m, a);
    }
    __syncthreads();  // every read of this round before any write (in-place roll)
    if (i < len) uh[i * stride] = (i > 0) ? a : 0.0f;
  }
  float amax;
  if (algo == 0) {
    amax = last;
  } else {
    red[tid] = m;
    __syncthreads();
    for (u32 o = 128; o > 0; o >>= 1) {
      if (tid < o) red[tid] = fmaxf(red[tid], red[tid + o]);
      __syncthreads();
    }
    amax = red[0];
  }
  if (tid == 0) {
    float sc;
    if (isfinite(amax) && amax > 0.0f)
      asm("div.rn.f32 %0, %1, %2;" : "=f"(sc) : "f"(scaled_max), "f"(amax));
    else
      sc = scale[col];
    if (isinf(sc)) sc = 3.402823466e+38f;
    upd_scale[col] = sc;
  }
}

// out[c, r] = in[r, c] for elements of 1, 2 or 4 bytes: 32x32 tiles through padded shared
// memory (grid-stride over tiles; 32x8 threads, 4 rows each).
template <class T>
__device__ void transpose_impl(const T *__restrict__ in, T *__restrict__ out, u64 rows, u64 cols) {
  __shared__ T tile[32][33];
  const u64 tiles_c = (cols + 31) / 32, ntiles = ((rows + 31) / 32) * tiles_c;
  const int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;
  for (u64 t = blockIdx.x; t < ntiles; t += gridDim.x) {
    const u64 r0 = (t / tiles_c) * 32, c0 = (t % tiles_c) * 32;
#pragma unroll
    for (int j = 0; j < 32; j += 8) {
      const u64 r = r0 + ty + j, c = c0 + tx;
      if (r < rows && c < cols) tile[ty + j][tx] = in[r * cols + c];
    }
    __syncthreads();
#pragma unroll
    for (int j = 0; j < 32; j += 8) {
      const u64 c = c0 + ty + j, r = r0 + tx;
      if (r < rows && c < cols) out[c * rows + r] = tile[tx][ty + j];
    }
    __syncthreads();
  }
}
extern "C" __global__ void __launch_bounds__(256) transpose_b1(const u8 *in, u8 *out, u64 rows, u64 cols) {
  transpose_impl<u8>(in, out, rows, cols);
}
extern "C" __global__ void __launch_bounds__(256) transpose_b2(const u16 *in, u16 *out, u64 rows, u64 cols) {
  transpose_impl<u16>(in, out, rows, cols);
}
extern "C" __global__ void __launch_bounds__(256) transpose_b4(const u32 *in, u32 *out, u64 rows, u64 cols) {
  transpose_impl<u32>(in, out, rows, cols);
}
