// Shared by the kernels in this folder (given to NVRTC as an in-memory header): the
// integer aliases and the element types, each with load (to fp32) and store (from fp32,
// round to nearest even; FP8 saturating). Self-contained on purpose: NVRTC 13 ships no
// cuda_bf16.h / cuda_fp16.h / cuda_fp8.h, so the narrow types are bit patterns converted
// with PTX (sm_89+ for FP8).
#pragma once
typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

struct F32 {
  typedef float T;
  static __device__ __forceinline__ float load(float v) { return v; }
  static __device__ __forceinline__ float store(float f) { return f; }
};

struct BF16 {
  typedef u16 T;
  static __device__ __forceinline__ float load(u16 v) { return __uint_as_float(((u32)v) << 16); }
  static __device__ __forceinline__ u16 store(float f) {
    u16 r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
    return r;
  }
};

struct F16 {
  typedef u16 T;
  static __device__ __forceinline__ float load(u16 v) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v));
    return f;
  }
  static __device__ __forceinline__ u16 store(float f) {
    u16 r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(f));
    return r;
  }
};

// FP8: the x2 conversions put their first source in the upper byte, so the value of
// interest goes second and lands in the low byte.
struct E4M3 {
  typedef u8 T;
  static __device__ __forceinline__ float load(u8 v) {
    u32 h2;
    u16 in = v;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(in));
    return F16::load((u16)(h2 & 0xffff));
  }
  static __device__ __forceinline__ u8 store(float f) {
    u16 r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(0.0f), "f"(f));
    return (u8)(r & 0xff);
  }
};

struct E5M2 {
  typedef u8 T;
  static __device__ __forceinline__ float load(u8 v) {
    u32 h2;
    u16 in = v;
    asm("cvt.rn.f16x2.e5m2x2 %0, %1;" : "=r"(h2) : "h"(in));
    return F16::load((u16)(h2 & 0xffff));
  }
  static __device__ __forceinline__ u8 store(float f) {
    u16 r;
    asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(r) : "f"(0.0f), "f"(f));
    return (u8)(r & 0xff);
  }
};

// Two FP8 values from a pair of floats in one conversion: `lo` lands in the low byte.
// Saturating round-to-nearest-even; NaN stays NaN (cvt ... satfinite).
template <class O>
__device__ __forceinline__ u32 fp8_pack2(float lo, float hi);
template <>
__device__ __forceinline__ u32 fp8_pack2<E4M3>(float lo, float hi) {
  u16 r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
}
template <>
__device__ __forceinline__ u32 fp8_pack2<E5M2>(float lo, float hi) {
  u16 r;
  asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
}

__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
  u32 d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

// Eight consecutive elements (16-byte aligned for 16-bit types, 32 for float32) as floats.
template <class I>
__device__ __forceinline__ void load8(const typename I::T *p, float *f);
template <>
__device__ __forceinline__ void load8<F32>(const float *p, float *f) {
  const float4 a = reinterpret_cast<const float4 *>(p)[0], b = reinterpret_cast<const float4 *>(p)[1];
  f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w;
  f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
}
template <>
__device__ __forceinline__ void load8<BF16>(const u16 *p, float *f) {
  const uint4 v = *reinterpret_cast<const uint4 *>(p);
  const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    f[2 * j] = __uint_as_float(w[j] << 16);
    f[2 * j + 1] = __uint_as_float(w[j] & 0xffff0000u);
  }
}
template <>
__device__ __forceinline__ void load8<F16>(const u16 *p, float *f) {
  const uint4 v = *reinterpret_cast<const uint4 *>(p);
  const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    f[2 * j] = F16::load((u16)(w[j] & 0xffff));
    f[2 * j + 1] = F16::load((u16)(w[j] >> 16));
  }
}
