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

// ------------------------------------------------------------- vector loads, conversions

template <class A, class B>
struct same_type {
  static constexpr bool value = false;
};
template <class A>
struct same_type<A, A> {
  static constexpr bool value = true;
};

// One 16-byte load of data that stays unchanged during the kernel (non-coherent path, no
// L1 allocation). H = 1 adds the L2 hint to fetch the whole 256-byte block.
template <int H>
__device__ __forceinline__ void ld16(const void *p, u32 *w) {
  if constexpr (H == 1)
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3])
                 : "l"(p));
  else
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3])
                 : "l"(p));
}

__device__ __forceinline__ void st16(void *p, u32 a, u32 b, u32 c, u32 d) {
  *reinterpret_cast<uint4 *>(p) = make_uint4(a, b, c, d);
}
// An L2 policy marking every access it is given as evict-first (createpolicy), for data
// that streams through once.
__device__ __forceinline__ u64 l2_evict_first() {
  u64 p;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
  return p;
}
// ld16<0> with an L2 cache policy.
__device__ __forceinline__ void ld16_hint(const void *p, u32 *w, u64 pol) {
  asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
               : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3])
               : "l"(p), "l"(pol));
}

// 32-bit words holding 8 elements of I (4 for 16-bit types, 8 for float32).
template <class I>
struct W8 {
  static constexpr int N = 2 * (int)sizeof(typename I::T);
};

// Eight consecutive elements as raw words (16-byte aligned).
template <class I, int H>
__device__ __forceinline__ void ld8(const typename I::T *p, u32 *w) {
  ld16<H>(p, w);
  if constexpr (W8<I>::N == 8) ld16<H>(reinterpret_cast<const char *>(p) + 16, w + 4);
}

template <class I>
__device__ __forceinline__ void cvt8(const u32 *w, float *f);
template <>
__device__ __forceinline__ void cvt8<F32>(const u32 *w, float *f) {
#pragma unroll
  for (int k = 0; k < 8; ++k) f[k] = __uint_as_float(w[k]);
}
template <>
__device__ __forceinline__ void cvt8<BF16>(const u32 *w, float *f) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    f[2 * j] = __uint_as_float(w[j] << 16);
    f[2 * j + 1] = __uint_as_float(w[j] & 0xffff0000u);
  }
}
template <>
__device__ __forceinline__ void cvt8<F16>(const u32 *w, float *f) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    f[2 * j] = F16::load((u16)(w[j] & 0xffff));
    f[2 * j + 1] = F16::load((u16)(w[j] >> 16));
  }
}

// Rows i and i + 1 of a cast + transpose thread's 8 x 8 block (raw words wi, wj) in FP8
// at scale s, two vertically adjacent elements per cvt: h[k] is column k's pair (byte 0
// row i, byte 1 row i + 1), placed in column k's words colw[k][i / 4] (the pair of rows
// i % 4 = 0 in the low half, of rows i % 4 = 2 in the high half); `local` takes their amax.
template <class I, class O>
__device__ __forceinline__ void ct_pair_rows(const u32 *wi, const u32 *wj, int i, float s, float &local,
                                             u32 (&h)[8], u32 (&colw)[8][2]) {
  float a[8], b[8];
  cvt8<I>(wi, a);
  cvt8<I>(wj, b);
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    local = fmaxf(local, fmaxf(fabsf(a[k]), fabsf(b[k])));
    h[k] = fp8_pack2<O>(a[k] * s, b[k] * s);
    if ((i & 2) == 0)
      colw[k][i >> 2] = h[k];
    else
      colw[k][i >> 2] |= h[k] << 16;
  }
}

// Programmatic dependent launch (sm_90+): wait until the grid this one depends on has
// finished and its writes are visible (a no-op for a normal launch), and let the next
// grid start launching.
__device__ __forceinline__ void griddep_wait() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void griddep_launch_dependents() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// ------------------------------------------------------------------ rowwise quantize

// How a streaming kernel's threads walk `nv` vector chunks, U a thread per step: a grid
// that covers them (the library's launch: kernels.rs flat_grid) makes one pass, each block
// over U * blockDim consecutive chunks (its threads' U chunks blockDim apart); a smaller
// one strides over them (thread tid's chunks the grid's thread count apart).
struct ChunkWalk {
  u64 first, apart, next;
};
template <int U>
__device__ __forceinline__ ChunkWalk chunk_walk(u64 nv) {
  const u64 stride = (u64)gridDim.x * blockDim.x;
  if (stride * U >= nv) return {(u64)blockIdx.x * blockDim.x * U + threadIdx.x, (u64)blockDim.x, nv};
  return {(u64)blockIdx.x * blockDim.x + threadIdx.x, stride, U * stride};
}

// Rowwise FP8 quantize of n elements. Vector path (`vec`: both pointers 16-byte
// aligned): chunks of 16 elements (one 16-byte FP8 store), U chunks a thread per step,
// all their loads issued before the first use; the rest (everything when !vec) one
// element at a time. One atomic per block for amax.
// H: ld16's hint (0, 1), or 2: an L2 evict-first policy on the loads and streaming
// (st.global.cs) stores.
template <class I, class O, int U, int H>
__device__ void quantize_fp8_impl(const typename I::T *__restrict__ in, u8 *__restrict__ out, u64 n,
                                  const float *scale, float *amax, float *sinv, float *sinv_t,
                                  const float *noop, int vec) {
  if (noop_set(noop)) return;
  constexpr int NW = W8<I>::N;
  const u64 pol = H == 2 ? l2_evict_first() : 0;
  const float s = scale ? *scale : 1.0f;
  float local = 0.0f;
  const u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x;
  const u64 stride = (u64)gridDim.x * blockDim.x;
  const u64 nv = vec ? n / 16 : 0;
  const ChunkWalk cw = chunk_walk<U>(nv);
  for (u64 v = cw.first; v < nv; v += cw.next) {
    u32 w[U][2][NW];
#pragma unroll
    for (int j = 0; j < U; ++j) {
      const u64 k = v + j * cw.apart;
      if (k < nv) {
        if constexpr (H == 2) {
          const char *p = reinterpret_cast<const char *>(in + k * 16);
#pragma unroll
          for (int h = 0; h < NW / 4; ++h) ld16_hint(p + 16 * h, w[j][0] + 4 * h, pol);
#pragma unroll
          for (int h = 0; h < NW / 4; ++h) ld16_hint(p + 16 * (NW / 4) + 16 * h, w[j][1] + 4 * h, pol);
        } else {
          ld8<I, H>(in + k * 16, w[j][0]);
          ld8<I, H>(in + k * 16 + 8, w[j][1]);
        }
      }
    }
#pragma unroll
    for (int j = 0; j < U; ++j) {
      const u64 k = v + j * cw.apart;
      if (k < nv) {
        float x[16];
        cvt8<I>(w[j][0], x);
        cvt8<I>(w[j][1], x + 8);
        u32 q[4];
#pragma unroll
        for (int m = 0; m < 4; ++m) {
#pragma unroll
          for (int e = 0; e < 4; ++e) local = fmaxf(local, fabsf(x[4 * m + e]));
          q[m] = fp8_pack2<O>(x[4 * m] * s, x[4 * m + 1] * s) |
                 (fp8_pack2<O>(x[4 * m + 2] * s, x[4 * m + 3] * s) << 16);
        }
        if constexpr (H == 2)
          asm volatile("st.global.cs.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(out + k * 16), "r"(q[0]), "r"(q[1]),
                       "r"(q[2]), "r"(q[3])
                       : "memory");
        else
          st16(out + k * 16, q[0], q[1], q[2], q[3]);
      }
    }
  }
  for (u64 i = nv * 16 + tid; i < n; i += stride) {
    const float x = I::load(in[i]);
    local = fmaxf(local, fabsf(x));
    out[i] = O::store(x * s);
  }
  finish_amax(local, amax);
  write_scale_inv(s, sinv, sinv_t);
}

// ------------------------------------------------------------- cast + transpose

// Cast + transpose of a [rows, cols] input (rows % 16 == 0, cols % 8 == 0, input and
// out_t 16-byte aligned, out 8-byte aligned): `out` (may be null) gets the rowwise FP8
// data, `out_t` the FP8 transpose [cols, rows]. A block of TC/8 x 16 threads owns tiles
// of 128 rows x TC columns (grid-stride over tiles); a thread loads its 8 rows x 8 columns
// with 8 (16 for float32) independent 16-byte loads, converts two rows at a time (each
// pair of vertically adjacent elements in one cvt, low byte the upper row) so that each
// column's 8 bytes assemble in two registers, and picks the rowwise bytes out of the same
// pairs with prmt (8-byte stores: TC-byte runs of each output row). The column words go
// through shared memory ([TC columns][128 rows] bytes, 8-byte units XOR-swizzled so that
// both the 8-byte stores and the 16-byte loads are conflict-free) and leave as 128-byte
// runs of each transposed row. With PF, the loads of the block's next tile are issued
// before the current tile's transposed half is written. Partial tiles at the edges take
// the same path with their out-of-range lanes masked.
template <class I, class O, int TC, int PF, int H>
__device__ void cast_transpose_impl(const typename I::T *__restrict__ in, u8 *__restrict__ out,
                                    u8 *__restrict__ out_t, u64 rows, u64 cols, const float *scale,
                                    float *amax, float *sinv, float *sinv_t, const float *noop) {
  constexpr int CG = TC / 8, NT = CG * 16, NW = W8<I>::N;
  __shared__ __align__(16) u8 tile[TC * 128];
  if (noop_set(noop)) return;
  const float s = scale ? *scale : 1.0f;
  float local = 0.0f;
  const int cg = threadIdx.x % CG, rg = threadIdx.x / CG;
  const u64 tiles_c = (cols + TC - 1) / TC, ntiles = ((rows + 127) / 128) * tiles_c;
  u32 w[8][NW];
  // Issue the loads of tile t into w (zeros for lanes past an edge).
  auto load = [&](u64 t) {
    const u64 r0 = (t / tiles_c) * 128, c0 = (t % tiles_c) * TC;
    if (r0 + 8 * rg < rows && c0 + 8 * cg < cols) {
      const typename I::T *src = in + (r0 + 8 * rg) * cols + c0 + 8 * cg;
#pragma unroll
      for (int i = 0; i < 8; ++i) ld8<I, H>(src + (u64)i * cols, w[i]);
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int k = 0; k < NW; ++k) w[i][k] = 0u;
    }
  };
  u64 t = blockIdx.x;
  if (PF && t < ntiles) load(t);
  for (; t < ntiles; t += gridDim.x) {
    if (!PF) load(t);
    const u64 r0 = (t / tiles_c) * 128, c0 = (t % tiles_c) * TC;
    const bool ok = r0 + 8 * rg < rows && c0 + 8 * cg < cols;
    u32 colw[8][2];
    u8 *dst = (out != nullptr && ok) ? out + (r0 + 8 * rg) * cols + c0 + 8 * cg : nullptr;
#pragma unroll
    for (int i = 0; i < 8; i += 2) {
      u32 h[8];
      ct_pair_rows<I, O>(w[i], w[i + 1], i, s, local, h, colw);
      if (dst != nullptr) {
        const u32 t01 = prmt(h[0], h[1], 0x5140), t23 = prmt(h[2], h[3], 0x5140);
        const u32 t45 = prmt(h[4], h[5], 0x5140), t67 = prmt(h[6], h[7], 0x5140);
        *reinterpret_cast<uint2 *>(dst + (u64)i * cols) = make_uint2(prmt(t01, t23, 0x5410), prmt(t45, t67, 0x5410));
        *reinterpret_cast<uint2 *>(dst + (u64)(i + 1) * cols) =
            make_uint2(prmt(t01, t23, 0x7632), prmt(t45, t67, 0x7632));
      }
    }
    if (PF && t + gridDim.x < ntiles) load(t + gridDim.x);
    // Column c = 8 cg + k, rows 8 rg .. 8 rg + 7: 8-byte unit rg of shared row c, stored at
    // unit rg ^ 2 (cg & 7) (16-byte unit (rg / 2) ^ (cg & 7), its half rg & 1).
#pragma unroll
    for (int k = 0; k < 8; ++k)
      *reinterpret_cast<uint2 *>(tile + (8 * cg + k) * 128 + 8 * (rg ^ ((cg & 7) << 1))) =
          make_uint2(colw[k][0], colw[k][1]);
    __syncthreads();
    // 16-byte unit m (rows 16 m .. 16 m + 15) of column c to out_t row c0 + c.
    constexpr int NQ = TC * 8 / NT;
    uint4 v[NQ];
#pragma unroll
    for (int q = 0; q < NQ; ++q) {
      const int j = threadIdx.x + q * NT, c = j >> 3, m = j & 7;
      v[q] = *reinterpret_cast<const uint4 *>(tile + c * 128 + 16 * (m ^ ((c >> 3) & 7)));
    }
#pragma unroll
    for (int q = 0; q < NQ; ++q) {
      const int j = threadIdx.x + q * NT, c = j >> 3, m = j & 7;
      if (c0 + c < cols && r0 + 16 * m < rows) *reinterpret_cast<uint4 *>(out_t + (c0 + c) * rows + r0 + 16 * m) = v[q];
    }
    __syncthreads();
  }
  finish_amax(local, amax);
  write_scale_inv(s, sinv, sinv_t);
}

// ------------------------------------------------------------- cast + transpose, v2

// 8- and 16-byte global stores; CS = 1 marks them streaming (st.global.cs: evict first).
template <int CS>
__device__ __forceinline__ void stg8(void *p, u32 a, u32 b) {
  if constexpr (CS == 1)
    asm volatile("st.global.cs.v2.u32 [%0], {%1, %2};" ::"l"(p), "r"(a), "r"(b) : "memory");
  else
    *reinterpret_cast<uint2 *>(p) = make_uint2(a, b);
}
template <int CS>
__device__ __forceinline__ void stg16(void *p, uint4 v) {
  if constexpr (CS == 1)
    asm volatile("st.global.cs.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
  else
    *reinterpret_cast<uint4 *>(p) = v;
}

// The raw bits of one element (a 32-bit word for float32, the low half for 16-bit types).
template <class I>
__device__ __forceinline__ u32 raw_bits(const typename I::T *p) {
  if constexpr (sizeof(typename I::T) == 4)
    return __float_as_uint(*p);
  else
    return (u32)*p;
}

// Cast + transpose of a [rows, cols] input, any shape: `out` (may be null) gets the rowwise
// FP8 data, `out_t` the FP8 transpose [cols, rows]. Tiles of TR (64 or 128) rows x 128
// columns, NT = 2 TR threads a block, each owning 8 rows x 8 columns of a tile. Lanes map
// to (column group cg, row group rg) so that each 16-byte load instruction of a warp reads
// 2 rows x 256 bytes (bf16) and each half-warp holds 8 column groups of 2 row groups (the
// bank pattern of the shared-memory writes below). A thread's 8 rows are 8 independent
// 16-byte loads (16 for float32); pairs of vertically adjacent elements are converted in one
// cvt (low byte: the upper row), so each column's 8 bytes assemble in two registers and the
// rowwise bytes are picked out of the same pairs with prmt (8-byte stores: 2 rows x 128
// bytes per warp instruction). The column words go to shared memory, double buffered (one
// __syncthreads a tile): column c holds TR bytes, 128 / TR columns a 128-byte line, its
// 8-byte units XOR-swizzled by 2 (cg & 7), which keeps 8-byte stores and 16-byte loads
// conflict-free; they leave as 16-byte stores, 8 threads writing TR contiguous bytes of
// one transposed row. PF: the next tile's loads are issued before the current tile's
// transpose is read back and written. G > 0: tiles run in groups of G tile rows, column-major inside a
// group (blocks running at the same time write longer runs of each transposed row).
// VEC = 1 (input 16-byte aligned, out 8-byte aligned, cols % 8 == 0): vector loads and
// rowwise stores, rows masked one at a time; VEC = 0: element loads and byte stores (any
// shape, any alignment). t_vec (out_t 16-byte aligned, rows % 16 == 0) selects 16-byte
// transposed stores, else bytes. Masked-out elements read as 0 (amax unchanged). One
// atomic a block for amax. Grid-stride over tiles (any grid).
template <class I, class O, int TR, int G, int PF, int CS, int VEC>
__device__ void cast_transpose2_impl(const typename I::T *__restrict__ in, u8 *__restrict__ out,
                                     u8 *__restrict__ out_t, u64 rows, u64 cols, const float *scale,
                                     float *amax, float *sinv, float *sinv_t, const float *noop, int t_vec) {
  static_assert(TR == 64 || TR == 128, "tile rows: 64 or 128");
  constexpr int TC = 128, NT = 2 * TR, NW = W8<I>::N;
  constexpr int UC = TR / 8;       // 8-byte units of one column in shared memory
  constexpr int UT = TR / 16;      // 16-byte units of one column
  constexpr int CPL = 128 / TR;    // columns a 128-byte shared line
  constexpr int NQ = TC * UT / NT; // 16-byte transposed stores a thread (4)
  __shared__ __align__(16) u8 tile[2][TC * TR];
  if (noop_set(noop)) return;
  const float s = scale ? *scale : 1.0f;
  float local = 0.0f;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int cg = (lane & 7) | ((lane >> 4) << 3);
  const int rg = 2 * warp + ((lane >> 3) & 1);
  const u64 tiles_r = (rows + TR - 1) / TR, tiles_c = (cols + TC - 1) / TC, ntiles = tiles_r * tiles_c;
  // Tile t -> its first row and column.
  auto coords = [&](u64 t, u64 &r0, u64 &c0) {
    u64 tr, tc;
    if constexpr (G > 0) {
      const u64 span = (u64)G * tiles_c, g = t / span, within = t - g * span;
      const u64 left = tiles_r - g * G, gr = left < (u64)G ? left : (u64)G;
      tr = g * G + within % gr;
      tc = within / gr;
    } else {
      tr = t / tiles_c;
      tc = t - tr * tiles_c;
    }
    r0 = tr * TR;
    c0 = tc * TC;
  };
  u32 w[8][NW];
  // Issue the loads of tile t into w (zeros past an edge).
  auto load = [&](u64 t) {
    u64 r0, c0;
    coords(t, r0, c0);
    const u64 rb = r0 + 8 * rg, cb = c0 + 8 * cg;
    // Rows of this thread's 8 inside the tensor (0 when its columns are outside).
    const u32 vr = (rb < rows && cb < cols) ? (u32)(rows - rb < 8 ? rows - rb : 8) : 0u;
    if constexpr (VEC == 1) {
      const typename I::T *src = in + rb * cols + cb;  // cols % 8 == 0: 8 columns in or out
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        if ((u32)i < vr) {
          ld8<I, 0>(src + (u64)i * cols, w[i]);
        } else {
#pragma unroll
          for (int k = 0; k < NW; ++k) w[i][k] = 0u;
        }
      }
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) {
#pragma unroll
        for (int k = 0; k < NW; ++k) w[i][k] = 0u;
        if ((u32)i < vr) {
          const typename I::T *src = in + (rb + i) * cols;
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            if (cb + e < cols) {
              const u32 b = raw_bits<I>(src + cb + e);
              if constexpr (NW == 8)
                w[i][e] = b;
              else
                w[i][e >> 1] |= b << (16 * (e & 1));
            }
          }
        }
      }
    }
  };
  u64 t = blockIdx.x;
  if (PF && t < ntiles) load(t);
  int buf = 0;
  for (; t < ntiles; t += gridDim.x, buf ^= 1) {
    if (!PF) load(t);
    u64 r0, c0;
    coords(t, r0, c0);
    const u64 rb = r0 + 8 * rg, cb = c0 + 8 * cg;
    const u32 vr = (rb < rows && cb < cols) ? (u32)(rows - rb < 8 ? rows - rb : 8) : 0u;
    u8 *dst = out != nullptr ? out + rb * cols + cb : nullptr;
    u32 colw[8][2];
#pragma unroll
    for (int i = 0; i < 8; i += 2) {
      u32 h[8];
      ct_pair_rows<I, O>(w[i], w[i + 1], i, s, local, h, colw);
      if (dst != nullptr && (u32)i < vr) {
        u8 *d = dst + (u64)i * cols;
        if constexpr (VEC == 1) {
          const u32 t01 = prmt(h[0], h[1], 0x5140), t23 = prmt(h[2], h[3], 0x5140);
          const u32 t45 = prmt(h[4], h[5], 0x5140), t67 = prmt(h[6], h[7], 0x5140);
          stg8<CS>(d, prmt(t01, t23, 0x5410), prmt(t45, t67, 0x5410));
          if ((u32)i + 1 < vr) stg8<CS>(d + cols, prmt(t01, t23, 0x7632), prmt(t45, t67, 0x7632));
        } else {
#pragma unroll
          for (int k = 0; k < 8; ++k) {
            if (cb + k < cols) {
              d[k] = (u8)(h[k] & 0xff);
              if ((u32)i + 1 < vr) d[cols + k] = (u8)((h[k] >> 8) & 0xff);
            }
          }
        }
      }
    }
    u8 *tl = tile[buf];
    // Column c = 8 cg + k, rows 8 rg .. 8 rg + 7: 8-byte unit (c % CPL) UC + rg of shared
    // line c / CPL, stored at that unit ^ 2 (cg & 7).
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const int c = 8 * cg + k;
      const int unit = (((c % CPL) * UC + rg) ^ ((cg & 7) << 1));
      *reinterpret_cast<uint2 *>(tl + (c / CPL) * 128 + 8 * unit) = make_uint2(colw[k][0], colw[k][1]);
    }
    if (PF && t + gridDim.x < ntiles) load(t + gridDim.x);  // (after colw is dead)
    __syncthreads();  // (double buffer: the next write of this one follows the next barrier)
    // 16-byte unit m (rows 16 m .. 16 m + 15) of column c -> transposed row c0 + c.
    uint4 v[NQ];
#pragma unroll
    for (int q = 0; q < NQ; ++q) {
      const int j = threadIdx.x + q * NT, c = j / UT, m = j % UT;
      const int unit = ((c % CPL) * UT + m) ^ ((c >> 3) & 7);
      v[q] = *reinterpret_cast<const uint4 *>(tl + (c / CPL) * 128 + 16 * unit);
    }
#pragma unroll
    for (int q = 0; q < NQ; ++q) {
      const int j = threadIdx.x + q * NT, c = j / UT, m = j % UT;
      const u64 rr = r0 + 16 * m;
      if (c0 + c < cols && rr < rows) {
        u8 *d = out_t + (c0 + c) * rows + rr;
        if (t_vec) {
          stg16<CS>(d, v[q]);
        } else {
          const u32 vw[4] = {v[q].x, v[q].y, v[q].z, v[q].w};
#pragma unroll
          for (int e = 0; e < 16; ++e)
            if (rr + e < rows) d[e] = (u8)(vw[e >> 2] >> (8 * (e & 3)));
        }
      }
    }
  }
  finish_amax(local, amax);
  write_scale_inv(s, sinv, sinv_t);
}

// Cast + transpose of any shape and alignment, one element at a time (grid-stride).
template <class I, class O>
__device__ void cast_transpose_slow_impl(const typename I::T *__restrict__ in, u8 *__restrict__ out,
                                         u8 *__restrict__ out_t, u64 rows, u64 cols, const float *scale,
                                         float *amax, float *sinv, float *sinv_t, const float *noop) {
  if (noop_set(noop)) return;
  const float s = scale ? *scale : 1.0f;
  float local = 0.0f;
  const u64 n = rows * cols, stride = (u64)gridDim.x * blockDim.x;
  for (u64 e = (u64)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += stride) {
    const u64 r = e / cols, c = e - r * cols;
    const float x = I::load(in[e]);
    local = fmaxf(local, fabsf(x));
    const u8 q = O::store(x * s);
    if (out) out[e] = q;
    if (out_t) out_t[c * rows + r] = q;
  }
  finish_amax(local, amax);
  write_scale_inv(s, sinv, sinv_t);
}

// ------------------------------------------------------------------------- amax

// amax = max(amax, max|in|) (callers zero it first, as TE's nvte_compute_amax does):
// U independent 16-byte loads a thread per step; the atomic waits for the grid this one
// depends on (griddep_wait: the zeroing kernel, when launched as its programmatic
// dependent).
template <class I, int U, int H>
__device__ void amax_impl(const typename I::T *__restrict__ in, u64 n, float *amax, const float *noop, int vec) {
  if (noop_set(noop)) return;
  constexpr int NW = W8<I>::N;
  float local = 0.0f;
  const u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x;
  const u64 stride = (u64)gridDim.x * blockDim.x;
  const u64 nv = vec ? n / 8 : 0;
  const ChunkWalk cw = chunk_walk<U>(nv);
  for (u64 v = cw.first; v < nv; v += cw.next) {
    u32 w[U][NW];
#pragma unroll
    for (int j = 0; j < U; ++j) {
      if (v + j * cw.apart < nv) {
        ld8<I, H>(in + (v + j * cw.apart) * 8, w[j]);
      } else {
#pragma unroll
        for (int k = 0; k < NW; ++k) w[j][k] = 0u;
      }
    }
#pragma unroll
    for (int j = 0; j < U; ++j) {
      float x[8];
      cvt8<I>(w[j], x);
#pragma unroll
      for (int k = 0; k < 8; ++k) local = fmaxf(local, fabsf(x[k]));
    }
  }
  for (u64 i = nv * 8 + tid; i < n; i += stride) local = fmaxf(local, fabsf(I::load(in[i])));
  griddep_wait();
  finish_amax(local, amax);
}

// Launch shapes of the library's instances (kernels.rs reads the block size and the
// occupancy off each function): rowwise quantize U chunks of 16 a thread per step; cast +
// transpose tiles of 128 x CT_TC with CT_PF prefetching, at least CT_MINB blocks an SM;
// amax AMAX_U loads a thread per step.
#ifndef QROW_U
#define QROW_U 2
#endif
#ifndef CT_TC
#define CT_TC 64
#endif
#ifndef CT_PF
#define CT_PF 1
#endif
#ifndef CT_MINB
#define CT_MINB 6
#endif
#ifndef AMAX_U
#define AMAX_U 4
#endif
#ifndef LDG_H
#define LDG_H 0
#endif
#ifndef QROW_H
// The rowwise quantize's loads and stores (quantize_fp8_impl's H): 2, the evict-first
// policy and streaming stores, 73.0-73.4 us against 74.8-75.1 with plain ones (LDG_H 0) at
// 64M bf16 -> e4m3 on one H100, six alternating runs (bench/RESULTS.md, 2026-11-26, fifth
// session).
#define QROW_H 2
#endif

#define QUANTIZE_FP8(iname, I, oname, O)                                                              \
  extern "C" __global__ void __launch_bounds__(256) quantize_fp8_##iname##_##oname(                   \
      const I::T *in, u8 *out, u64 n, const float *scale, float *amax, float *sinv, float *sinv_t,   \
      const float *noop, int vec) {                                                                   \
    quantize_fp8_impl<I, O, QROW_U, QROW_H>(in, out, n, scale, amax, sinv, sinv_t, noop, vec);        \
  }                                                                                                   \
  extern "C" __global__ void __launch_bounds__(CT_TC * 2, CT_MINB) cast_transpose_##iname##_##oname(  \
      const I::T *in, u8 *out, u8 *out_t, u64 rows, u64 cols, const float *scale, float *amax,       \
      float *sinv, float *sinv_t, const float *noop) {                                                \
    cast_transpose_impl<I, O, CT_TC, CT_PF, LDG_H>(in, out, out_t, rows, cols, scale, amax, sinv,     \
                                                   sinv_t, noop);                                     \
  }                                                                                                   \
  extern "C" __global__ void __launch_bounds__(256) cast_transpose_slow_##iname##_##oname(            \
      const I::T *in, u8 *out, u8 *out_t, u64 rows, u64 cols, const float *scale, float *amax,       \
      float *sinv, float *sinv_t, const float *noop) {                                                \
    cast_transpose_slow_impl<I, O>(in, out, out_t, rows, cols, scale, amax, sinv, sinv_t, noop);      \
  }
// The v2 cast + transpose (the library's default; NVTE_COMM_CAST_TRANSPOSE=v1 runs the
// one above): tiles of CT2_TR rows, CT2_G tile-row groups (0: row-major), CT2_PF
// prefetching, CT2_CS streaming stores, at least CT2_MINB blocks an SM (half for float32,
// whose tiles take twice the registers). `ct2_vec_*` is VEC = 1, `ct2_any_*` VEC = 0.
#ifndef CT2_TR
#define CT2_TR 128
#endif
#ifndef CT2_G
#define CT2_G 0
#endif
#ifndef CT2_PF
#define CT2_PF 1
#endif
#ifndef CT2_CS
#define CT2_CS 0
#endif
#ifndef CT2_MINB
#define CT2_MINB 3
#endif
#define CT2_ONE(kind, VEC, iname, I, oname, O, MB)                                                      \
  extern "C" __global__ void __launch_bounds__(CT2_TR * 2, MB) ct2_##kind##_##iname##_##oname(          \
      const I::T *in, u8 *out, u8 *out_t, u64 rows, u64 cols, const float *scale, float *amax,         \
      float *sinv, float *sinv_t, const float *noop, int t_vec) {                                       \
    cast_transpose2_impl<I, O, CT2_TR, CT2_G, CT2_PF, CT2_CS, VEC>(in, out, out_t, rows, cols, scale,   \
                                                                   amax, sinv, sinv_t, noop, t_vec);    \
  }
#define CT2(iname, I, oname, O, MB)        \
  CT2_ONE(vec, 1, iname, I, oname, O, MB) \
  CT2_ONE(any, 0, iname, I, oname, O, MB)
CT2(f32, F32, e4m3, E4M3, (CT2_MINB + 1) / 2)
CT2(f32, F32, e5m2, E5M2, (CT2_MINB + 1) / 2)
CT2(bf16, BF16, e4m3, E4M3, CT2_MINB)
CT2(bf16, BF16, e5m2, E5M2, CT2_MINB)
CT2(f16, F16, e4m3, E4M3, CT2_MINB)
CT2(f16, F16, e5m2, E5M2, CT2_MINB)

#ifdef TE_COMM_CT2_VARIANTS
// Bench variants of the v2 cast + transpose (bf16 -> e4m3, VEC = 1 only), in a module of
// their own (kernels.rs: CAST_VARIANTS, compiled only when NVTE_COMM_CAST_TRANSPOSE names
// one): ct2x_tr<TR>_g<G>_pf<PF>_cs<CS>_m<MINB>.
#define CT2X(TR, G, PF, CS, MB)                                                                         \
  extern "C" __global__ void __launch_bounds__(TR * 2, MB) ct2x_tr##TR##_g##G##_pf##PF##_cs##CS##_m##MB( \
      const u16 *in, u8 *out, u8 *out_t, u64 rows, u64 cols, const float *scale, float *amax,          \
      float *sinv, float *sinv_t, const float *noop, int t_vec) {                                        \
    cast_transpose2_impl<BF16, E4M3, TR, G, PF, CS, 1>(in, out, out_t, rows, cols, scale, amax, sinv,    \
                                                      sinv_t, noop, t_vec);                              \
  }
CT2X(64, 0, 1, 0, 6)
CT2X(128, 16, 1, 0, 3)
CT2X(128, 0, 1, 1, 3)
CT2X(128, 0, 0, 0, 3)
CT2X(128, 0, 0, 0, 4)
CT2X(128, 32, 1, 1, 3)
CT2X(64, 16, 1, 0, 6)
#endif

// ------------------------------------------------------------- cast + transpose, v3
//
// Whole tiles only (rows % TR == 0, cols % TC == 0, in and out_t 16-byte aligned, out
// 8-byte aligned or null: kernels.rs runs v2 for anything else); 16-bit inputs. The
// library's default where its tiles fit (ct3_<in>_<out>: ct3_impl, 256 x 128 tiles, bulk
// transposed stores; below); the other shapes are bench variants (bf16 -> e4m3, under
// TE_COMM_CT2_VARIANTS). A thread's
// work is v2's (8 rows x 8 columns, 8 independent 16-byte loads, pairs of vertically
// adjacent elements in one cvt, 8-byte rowwise stores, the same conversions, amax and
// scale_inv, so the bytes are v2's); what changes is the tile shape, how the transposed
// tile leaves shared memory and how the input arrives:
//   ct3_impl:  register loads as v2, tall tiles (TR up to 512 rows: TR-byte runs of each
//              transposed row per tile, v2 128), transposed stores as 16-byte vectors
//              (BS bit 0 clear) or one bulk copy a column (bit 0 set); bit 1 streaming
//              rowwise stores (st.global.cs), bit 2 an L2 evict-first policy on the input
//              loads and the bulk stores (the default, ct3_*: BS 7).
// (Input tiles by bulk loads on an mbarrier, one tile a block or a persistent pipeline,
// ran at half v2's speed, their 128-byte bulk loads too small: bench/RESULTS.md,
// 2026-11-26 third session; removed.)

__device__ __forceinline__ u32 ct3_saddr(const void *p) { return (u32)__cvta_generic_to_shared(p); }
// `bytes` shared -> global in this thread's current bulk group.
__device__ __forceinline__ void ct3_store_bulk(void *dst, u32 src, u32 bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(src), "r"(bytes)
               : "memory");
}
// The same with an L2 cache policy (createpolicy).
__device__ __forceinline__ void ct3_store_bulk_hint(void *dst, u32 src, u32 bytes, u64 pol) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group.L2::cache_hint [%0], [%1], %2, %3;" ::"l"(dst), "r"(src),
               "r"(bytes), "l"(pol)
               : "memory");
}
__device__ __forceinline__ void ct3_store_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// Wait until every bulk group this thread committed has read its shared source.
__device__ __forceinline__ void ct3_store_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }
// This thread's shared-memory accesses (generic proxy) before later bulk copies (async
// proxy) of the same bytes.
__device__ __forceinline__ void ct3_fence_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// (column group cg, row group rg) of this thread in a tile of TC columns: a quarter warp
// is 8 consecutive column groups of one row group (a 128-byte run of one row: coalesced
// global loads, conflict-free shared loads of an input stage), a half warp holds the row
// groups 2 j and 2 j + 1 (conflict-free transposed stores, see ct3_col). TC = 128 is v2's
// mapping.
template <int TC>
__device__ __forceinline__ void ct3_lanes(int &cg, int &rg) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, sub = lane >> 3;
  if constexpr (TC == 128) {
    cg = (lane & 7) | ((sub >> 1) << 3);
    rg = 2 * warp + (sub & 1);
  } else {
    cg = lane & 7;
    rg = 4 * warp + sub;
  }
}

// Byte offset of column c in a transposed tile of TR rows: each column's TR bytes are
// contiguous (one bulk copy, or TR / 16 vectors), with 16 bytes of padding after every 8
// columns (TR * TC + 2 TC bytes in all). As TR % 128 == 0, the 8-byte store of column
// 8 cg + k, rows 8 rg .. 8 rg + 7 (at ct3_col(8 cg + k) + 8 rg) falls in 8-byte bank pair
// (2 cg + rg) % 16: the 16 lanes of a half warp (8 column groups, row groups 2 j, 2 j + 1)
// hit 16 different pairs; 8 lanes reading 16-byte units m .. m + 7 of one column read 128
// contiguous bytes.
template <int TR>
__device__ __forceinline__ int ct3_col(int c) {
  return c * TR + (c >> 3) * 16;
}

// One thread's 8 x 8 block (raw 16-bit words w of I: rows rb .. rb + 7, columns cb .. cb + 7):
// converted two rows at a time as in v2 (ct_pair_rows: amax into `local`), the rowwise
// bytes stored to `dst` (= out + rb * cols + cb; null: none) with 8-byte stores, the
// column words to the transposed tile `tl` (ct3_col layout).
template <class I, class O, int TR, int CS = 0>
__device__ __forceinline__ void ct3_block(const u32 (&w)[8][4], u8 *dst, u64 cols, u8 *tl, int cg, int rg, float s,
                                          float &local) {
  u32 colw[8][2];
#pragma unroll
  for (int i = 0; i < 8; i += 2) {
    u32 h[8];
    ct_pair_rows<I, O>(w[i], w[i + 1], i, s, local, h, colw);
    if (dst != nullptr) {
      const u32 t01 = prmt(h[0], h[1], 0x5140), t23 = prmt(h[2], h[3], 0x5140);
      const u32 t45 = prmt(h[4], h[5], 0x5140), t67 = prmt(h[6], h[7], 0x5140);
      u8 *d = dst + (u64)i * cols;
      stg8<CS>(d, prmt(t01, t23, 0x5410), prmt(t45, t67, 0x5410));
      stg8<CS>(d + cols, prmt(t01, t23, 0x7632), prmt(t45, t67, 0x7632));
    }
  }
#pragma unroll
  for (int k = 0; k < 8; ++k)
    *reinterpret_cast<uint2 *>(tl + ct3_col<TR>(8 * cg + k) + 8 * rg) = make_uint2(colw[k][0], colw[k][1]);
}

// The transposed tile `tl` (TC columns of TR bytes, complete: after a barrier) to out_t
// rows c0 .. c0 + TC - 1, bytes r0 .. r0 + TR - 1. BS bit 0 set: thread c < TC copies
// column c with one bulk store (with bit 2, under the L2 policy `pol`) and commits it (the
// writers fenced with ct3_fence_async before the barrier; the caller waits for the reads
// before `tl` is written again); bit 0 clear: 16-byte vectors, 8 lanes a 128-byte run, 4
// a thread.
template <int TR, int TC, int BS>
__device__ __forceinline__ void ct3_store_t(const u8 *tl, u8 *out_t, u64 rows, u64 r0, u64 c0, u64 pol) {
  constexpr int NT = (TR / 8) * (TC / 8), UT = TR / 16, NQ = TC * UT / NT;
  if constexpr ((BS & 1) != 0) {
    const int c = threadIdx.x;
    if (c < TC) {
      if constexpr ((BS & 4) != 0)
        ct3_store_bulk_hint(out_t + (c0 + c) * rows + r0, ct3_saddr(tl + ct3_col<TR>(c)), TR, pol);
      else
        ct3_store_bulk(out_t + (c0 + c) * rows + r0, ct3_saddr(tl + ct3_col<TR>(c)), TR);
      ct3_store_commit();
    }
  } else {
    uint4 v[NQ];
#pragma unroll
    for (int q = 0; q < NQ; ++q) {
      const int j = threadIdx.x + q * NT, c = j / UT, m = j % UT;
      v[q] = *reinterpret_cast<const uint4 *>(tl + ct3_col<TR>(c) + 16 * m);
    }
#pragma unroll
    for (int q = 0; q < NQ; ++q) {
      const int j = threadIdx.x + q * NT, c = j / UT, m = j % UT;
      stg16<0>(out_t + (c0 + c) * rows + r0 + 16 * m, v[q]);
    }
  }
}

// v3, register path: tiles of TR (128 .. 512) rows x TC (64 or 128) columns, (TR / 8) x
// (TC / 8) threads, each loading its 8 x 8 block straight into registers (no prefetch).
// Tall tiles give each transposed row a TR-byte run per tile instead of v2's 128 (DRAM
// page locality of the strided writes); the transposed tile leaves shared memory as
// 16-byte vectors (BS = 0) or as one bulk copy a column (BS = 1: few instructions, whole
// runs at once). Meant for one tile a block (grid = tiles, the hardware balances the
// blocks); correct for any grid (a barrier between tiles, before which the bulk stores
// have read the tile).
// (Column-major tiles, the L2 256-byte load hint and 16-byte rowwise stores by row swaps
// were each measured no faster: bench/RESULTS.md, 2026-11-26 third session.)
template <class I, class O, int TR, int TC, int BS>
__device__ void ct3_impl(const u16 *__restrict__ in, u8 *__restrict__ out, u8 *__restrict__ out_t, u64 rows,
                         u64 cols, const float *scale, float *amax, float *sinv, float *sinv_t, const float *noop) {
  static_assert(TC == 64 || TC == 128, "tile columns: 64 or 128");
  static_assert(TR % 128 == 0 && TR <= 512, "tile rows: a multiple of 128, at most 512");
  __shared__ __align__(128) u8 tl[TR * TC + 2 * TC];
  if (noop_set(noop)) return;
  const float s = scale ? *scale : 1.0f;
  float local = 0.0f;
  int cg, rg;
  ct3_lanes<TC>(cg, rg);
  constexpr bool BULK = (BS & 1) != 0, EF = (BS & 4) != 0;
  const u64 pol = EF ? l2_evict_first() : 0;
  const u64 tiles_c = cols / TC, ntiles = (rows / TR) * tiles_c;
  for (u64 t = blockIdx.x; t < ntiles; t += gridDim.x) {
    const u64 tr = t / tiles_c, r0 = tr * TR, c0 = (t - tr * tiles_c) * TC;
    const u64 rb = r0 + 8 * rg, cb = c0 + 8 * cg;
    u32 w[8][4];
    const u16 *src = in + rb * cols + cb;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      if constexpr (EF) ld16_hint(src + (u64)i * cols, w[i], pol);
      else ld16<0>(src + (u64)i * cols, w[i]);
    }
    ct3_block<I, O, TR, (BS & 2) ? 1 : 0>(w, out != nullptr ? out + rb * cols + cb : nullptr, cols, tl, cg, rg, s,
                                         local);
    if constexpr (BULK) ct3_fence_async();
    __syncthreads();
    ct3_store_t<TR, TC, BS>(tl, out_t, rows, r0, c0, pol);
    if (t + gridDim.x < ntiles) {
      if (BULK && threadIdx.x < TC) ct3_store_wait_read();
      __syncthreads();
    }
  }
  if (BULK && threadIdx.x < TC) ct3_store_wait_read();
  finish_amax(local, amax);
  write_scale_inv(s, sinv, sinv_t);
}

#ifdef TE_COMM_CT2_VARIANTS
// ct3_r<TR>_c<TC>_b<BS>_m<MINB>: CT2X's parameters
// (t_vec unused: these run only with out_t 16-byte aligned and rows % 16 == 0).
#define CT3(TR, TC, BS, MB)                                                                              \
  extern "C" __global__ void __launch_bounds__((TR / 8) * (TC / 8), MB) ct3_r##TR##_c##TC##_b##BS##_m##MB( \
      const u16 *in, u8 *out, u8 *out_t, u64 rows, u64 cols, const float *scale, float *amax,           \
      float *sinv, float *sinv_t, const float *noop, int t_vec) {                                         \
    ct3_impl<BF16, E4M3, TR, TC, BS>(in, out, out_t, rows, cols, scale, amax, sinv, sinv_t, noop);      \
  }
CT3(256, 128, 0, 2)
CT3(256, 64, 0, 4)
CT3(256, 64, 1, 4)
CT3(512, 64, 0, 2)
CT3(512, 64, 1, 2)
CT3(256, 128, 1, 2)
CT3(256, 128, 3, 2)
CT3(256, 128, 5, 2)
#endif

#define QUANTIZE_FP8_FROM(iname, I)  \
  QUANTIZE_FP8(iname, I, e4m3, E4M3) \
  QUANTIZE_FP8(iname, I, e5m2, E5M2) \
  extern "C" __global__ void __launch_bounds__(256) amax_##iname(const I::T *in, u64 n, float *amax, \
                                                                 const float *noop, int vec) {       \
    amax_impl<I, AMAX_U, LDG_H>(in, n, amax, noop, vec);                                             \
  }
QUANTIZE_FP8_FROM(f32, F32)
QUANTIZE_FP8_FROM(bf16, BF16)
QUANTIZE_FP8_FROM(f16, F16)

// v3, the library's cast + transpose where its tiles fit (16-bit inputs; kernels.rs):
// 256 x 128 tiles, one a block, the transposed tile out by bulk stores (the fastest of the
// bench variants on one H100 and one H200, bench/RESULTS.md 2026-11-26, third session),
// streaming rowwise stores and an L2 evict-first policy on the loads and the bulk stores
// (BS 7: 97.6-97.9 us against 99.4-99.9 without them at 8192 x 8192 on one H100,
// bench/RESULTS.md 2026-11-26, fifth session).
#define CT3_DEFAULT(iname, I, oname, O)                                                                    \
  extern "C" __global__ void __launch_bounds__(512, 2) ct3_##iname##_##oname(                               \
      const u16 *in, u8 *out, u8 *out_t, u64 rows, u64 cols, const float *scale, float *amax,              \
      float *sinv, float *sinv_t, const float *noop, int t_vec) {                                            \
    ct3_impl<I, O, 256, 128, 7>(in, out, out_t, rows, cols, scale, amax, sinv, sinv_t, noop);              \
  }
CT3_DEFAULT(bf16, BF16, e4m3, E4M3)
CT3_DEFAULT(bf16, BF16, e5m2, E5M2)
CT3_DEFAULT(f16, F16, e4m3, E4M3)
CT3_DEFAULT(f16, F16, e5m2, E5M2)

#ifdef TE_COMM_VARIANTS
// bench variants (bf16 -> e4m3 only), compiled by the sweep script, not by the library.
#define V_QROW(U, H)                                                                                  \
  extern "C" __global__ void __launch_bounds__(256) v_qrow_u##U##_h##H(                               \
      const u16 *in, u8 *out, u64 n, const float *scale, float *amax, float *sinv, float *sinv_t,    \
      const float *noop, int vec) {                                                                   \
    quantize_fp8_impl<BF16, E4M3, U, H>(in, out, n, scale, amax, sinv, sinv_t, noop, vec);            \
  }
V_QROW(1, 0) V_QROW(2, 0) V_QROW(4, 0) V_QROW(2, 1) V_QROW(4, 1)
#define V_CT(TC, PF, H, MB)                                                                           \
  extern "C" __global__ void __launch_bounds__(TC * 2, MB) v_ct_tc##TC##_pf##PF##_h##H##_m##MB(      \
      const u16 *in, u8 *out, u8 *out_t, u64 rows, u64 cols, const float *scale, float *amax,        \
      float *sinv, float *sinv_t, const float *noop) {                                                \
    cast_transpose_impl<BF16, E4M3, TC, PF, H>(in, out, out_t, rows, cols, scale, amax, sinv, sinv_t, \
                                               noop);                                                 \
  }
V_CT(64, 0, 0, 8) V_CT(64, 1, 0, 6) V_CT(64, 1, 0, 4) V_CT(64, 0, 1, 8) V_CT(64, 1, 1, 6)
V_CT(128, 0, 0, 4) V_CT(128, 1, 0, 3) V_CT(128, 1, 0, 2) V_CT(128, 1, 1, 3)
#define V_AMAX(U, H)                                                                                  \
  extern "C" __global__ void __launch_bounds__(256) v_amax_u##U##_h##H(const u16 *in, u64 n,          \
                                                                       float *amax, const float *noop, \
                                                                       int vec) {                     \
    amax_impl<BF16, U, H>(in, n, amax, noop, vec);                                                    \
  }
V_AMAX(2, 0) V_AMAX(4, 0) V_AMAX(8, 0) V_AMAX(4, 1) V_AMAX(8, 1)
#endif

// *amax = 0 unless the noop flag is set (TE zeroes before its atomic-max amax pass). The
// amax kernel may be launched as its programmatic dependent: it reads its input while
// this runs and waits for it (griddep_wait) before its atomics.
extern "C" __global__ void zero_amax(float *amax, const float *noop) {
  griddep_launch_dependents();
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

// out[c, r] = in[r, c] with 16-byte accesses, for E-byte elements (1, 2, 4; V = 16 / E
// a vector) when rows and cols are multiples of V and both pointers 16-byte aligned:
// tiles of 8 V rows x 128 / E columns (128-byte runs of each input and output row),
// grid-stride. The tile goes to shared memory as 16-byte vectors (vector ch of row r at
// ch ^ (r / V % 8): conflict-free stores, and conflict-free element reads down a column);
// a thread then gathers V elements of one column into a 16-byte output vector.
template <int E>
__device__ void transpose_vec_impl(const u8 *__restrict__ in, u8 *__restrict__ out, u64 rows, u64 cols) {
  constexpr int V = 16 / E, TR = 8 * V, TC = 128 / E, NT = 256;
  __shared__ __align__(16) u8 tile[TR * 128];
  const u64 tiles_c = (cols + TC - 1) / TC, ntiles = ((rows + TR - 1) / TR) * tiles_c;
  for (u64 t = blockIdx.x; t < ntiles; t += gridDim.x) {
    const u64 r0 = (t / tiles_c) * TR, c0 = (t % tiles_c) * TC;
    constexpr int NL = TR * 8 / NT;  // input vectors a thread
    u32 w[NL][4];
#pragma unroll
    for (int q = 0; q < NL; ++q) {
      const int j = threadIdx.x + q * NT, r = j >> 3, ch = j & 7;
      if (r0 + r < rows && c0 + ch * V < cols) ld16<0>(in + ((r0 + r) * cols + c0 + ch * V) * E, w[q]);
    }
#pragma unroll
    for (int q = 0; q < NL; ++q) {
      const int j = threadIdx.x + q * NT, r = j >> 3, ch = j & 7;
      st16(tile + r * 128 + 16 * (ch ^ ((r / V) & 7)), w[q][0], w[q][1], w[q][2], w[q][3]);
    }
    __syncthreads();
    constexpr int NS = TC * 8 / NT;  // output vectors a thread
#pragma unroll
    for (int q = 0; q < NS; ++q) {
      const int j = threadIdx.x + q * NT, c = j >> 3, rv = j & 7;
      const u8 *col = tile + 16 * ((c / V) ^ rv) + (c % V) * E + rv * V * 128;
      u32 o[4];
      if constexpr (E == 4) {
#pragma unroll
        for (int k = 0; k < 4; ++k) o[k] = *reinterpret_cast<const u32 *>(col + k * 128);
      } else if constexpr (E == 2) {
#pragma unroll
        for (int k = 0; k < 4; ++k)
          o[k] = (u32) * reinterpret_cast<const u16 *>(col + 2 * k * 128) |
                 ((u32) * reinterpret_cast<const u16 *>(col + (2 * k + 1) * 128) << 16);
      } else {
#pragma unroll
        for (int k = 0; k < 4; ++k)
          o[k] = prmt(prmt(col[4 * k * 128], col[(4 * k + 1) * 128], 0x0040),
                      prmt(col[(4 * k + 2) * 128], col[(4 * k + 3) * 128], 0x0040), 0x5410);
      }
      if (c0 + c < cols && r0 + rv * V < rows) st16(out + ((c0 + c) * rows + r0 + rv * V) * E, o[0], o[1], o[2], o[3]);
    }
    __syncthreads();
  }
}
extern "C" __global__ void __launch_bounds__(256) transpose_vec_b1(const u8 *in, u8 *out, u64 rows, u64 cols) {
  transpose_vec_impl<1>(in, out, rows, cols);
}
extern "C" __global__ void __launch_bounds__(256) transpose_vec_b2(const u8 *in, u8 *out, u64 rows, u64 cols) {
  transpose_vec_impl<2>(in, out, rows, cols);
}
extern "C" __global__ void __launch_bounds__(256) transpose_vec_b4(const u8 *in, u8 *out, u64 rows, u64 cols) {
  transpose_vec_impl<4>(in, out, rows, cols);
}

// out = cast(in * scale_inv) from FP8, 16 elements a thread per step (one 16-byte load,
// U steps' loads issued first) when `vec` (both pointers 16-byte aligned), the rest one
// element at a time.
// Two FP8 values (low byte first) -> f[0], f[1] (times s): one cvt to f16x2 (exact), then f32.
template <class I>
__device__ __forceinline__ void fp8x2_to_f32(u16 v, float *f, float s) {
  u32 h2;
  if constexpr (same_type<I, E4M3>::value)
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(v));
  else
    asm("cvt.rn.f16x2.e5m2x2 %0, %1;" : "=r"(h2) : "h"(v));
  f[0] = F16::load((u16)(h2 & 0xffff)) * s;
  f[1] = F16::load((u16)(h2 >> 16)) * s;
}

template <class I, class O, int U>
__device__ void dequantize_vec_impl(const u8 *__restrict__ in, typename O::T *__restrict__ out, u64 n,
                                    const float *scale_inv, int vec) {
  const float s = scale_inv ? *scale_inv : 1.0f;
  const u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x;
  const u64 stride = (u64)gridDim.x * blockDim.x;
  const u64 nv = vec ? n / 16 : 0;
  for (u64 v = tid; v < nv; v += U * stride) {
    u32 w[U][4];
#pragma unroll
    for (int j = 0; j < U; ++j)
      if (v + j * stride < nv) ld16<0>(in + (v + j * stride) * 16, w[j]);
#pragma unroll
    for (int j = 0; j < U; ++j) {
      const u64 k = v + j * stride;
      if (k < nv) {
        float f[16];
#pragma unroll
        for (int e = 0; e < 16; e += 2) fp8x2_to_f32<I>((u16)(w[j][e / 4] >> (8 * (e % 4))), f + e, s);
        if constexpr (sizeof(typename O::T) == 4) {
#pragma unroll
          for (int e = 0; e < 16; e += 4)
            st16(out + k * 16 + e, __float_as_uint(f[e]), __float_as_uint(f[e + 1]), __float_as_uint(f[e + 2]),
                 __float_as_uint(f[e + 3]));
        } else {
          u32 o[8];
#pragma unroll
          for (int e = 0; e < 8; ++e) o[e] = (u32)O::store(f[2 * e]) | ((u32)O::store(f[2 * e + 1]) << 16);
          st16(out + k * 16, o[0], o[1], o[2], o[3]);
          st16(out + k * 16 + 8, o[4], o[5], o[6], o[7]);
        }
      }
    }
  }
  for (u64 i = nv * 16 + tid; i < n; i += stride) out[i] = O::store(I::load(in[i]) * s);
}
#define DEQUANTIZE_VEC(iname, I, oname, O)                                                          \
  extern "C" __global__ void __launch_bounds__(256) dequantize_vec_##iname##_##oname(              \
      const u8 *in, O::T *out, u64 n, const float *scale_inv, int vec) {                            \
    dequantize_vec_impl<I, O, 2>(in, out, n, scale_inv, vec);                                       \
  }
DEQUANTIZE_VEC(e4m3, E4M3, f32, F32)
DEQUANTIZE_VEC(e4m3, E4M3, bf16, BF16)
DEQUANTIZE_VEC(e4m3, E4M3, f16, F16)
DEQUANTIZE_VEC(e5m2, E5M2, f32, F32)
DEQUANTIZE_VEC(e5m2, E5M2, bf16, BF16)
DEQUANTIZE_VEC(e5m2, E5M2, f16, F16)

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
