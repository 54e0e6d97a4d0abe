// Element-wise kernels: quantize (with scale, amax and scale_inv as TE's delayed scaling
// defines them), dequantize, and a counter-based uniform random fill.
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
