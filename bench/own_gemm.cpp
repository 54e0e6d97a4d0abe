// Standalone check of kernels/gemm_sm90.cu (issue 22, step 1; the kernel is a prototype,
// not used by the library): correctness against an fp32 reference GEMM and an fp64 CPU
// check on sampled elements, speed against cuBLASLt, the cost of the arrival-flag waits,
// and an AG-style run where row blocks of B and their flags arrive by copy engine while
// the kernel runs. Plain C++ (no nvcc needed): the kernel is compiled with NVRTC exactly
// as the library compiles its kernels (same options, sm_90a), the reference kernels
// likewise; driver functions come through cudaGetDriverEntryPointByVersion.
//
// Build + run in one call: scripts/own-gemm-gpu.sh (writes under $OUT). By hand:
//   g++ -std=c++17 -O2 bench/own_gemm.cpp -I$CUDA/include -L$CUDA/lib64
//       -lcudart -lnvrtc -lcublasLt -o own_gemm && ./own_gemm [options]
// Options: --kernel FILE (default kernels/gemm_sm90.cu), --iters N (timed iterations,
// median; default 30), --quick (small shapes only), --compile-only (NVRTC only, no GPU),
// --bn 128|192|256 (force the tile width of the timed runs; 192: the ping-pong kernel,
// bf16 out only), --group G (tile rows per rasterization group, default 8), --no-fp8,
// --define NAME=VALUE (a -D for the kernel's
// compilation, e.g. GEMM90_STAGES_256=3; repeatable), --no-give-up (skip the test of the
// arrival waits' give-up: for a kernel from before it, which would hang there).
// Exit status: 0 all checks passed, 1 a wrong result (or a hang in the flag test),
// 2 a setup error.
#include <cublasLt.h>
#include <cuda.h>
#include <cuda_runtime.h>
#include <nvrtc.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "gemm90_host.hpp"

// Error handling (CK, NV, LT, CU: a setup error ends the process with status 2), the
// driver's entry points (g90::drv), launches and NVRTC: bench/gemm90_host.hpp, shared with
// own_gemm_link.cpp.
using g90::die;
using g90::drv;
using g90::Gemm90Args;
using g90::launch;
using g90::load_driver;
using g90::read_text;
using g90::bn_idx;
using g90::bn_of;

// ---------------------------------------------------------------- NVRTC
// The library's options (src/cuda/nvrtc.rs `options`), for the device's architecture,
// and the -D knobs of --define.
static std::vector<std::string> g_defines;  // --define NAME=VALUE (tuning knobs)
static std::vector<char> nvrtc_compile(const std::string &src, const char *name,
                                       const std::string &arch, bool verbose) {
  std::vector<std::string> defs;
  for (auto &d : g_defines) defs.push_back("-D" + d);
  return g90::nvrtc_compile(src, name, arch, defs, verbose);
}

// ---------------------------------------------------------------- reference kernels
// Compiled by NVRTC too (self-contained: no CUDA headers there either).
static const char *REF_SRC = R"SRC(
typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

__device__ __forceinline__ u32 mix(u64 x) {
  x ^= x >> 33; x *= 0xff51afd7ed558ccdULL; x ^= x >> 33; x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33; return (u32)x;
}
__device__ __forceinline__ float uni(u64 seed, u64 i) {   // [-1, 1)
  return (float)(mix(seed * 0x9E3779B97F4A7C15ULL + i) >> 8) * (2.0f / 16777216.0f) - 1.0f;
}
__device__ __forceinline__ float bf16_to_f(u16 v) { return __uint_as_float(((u32)v) << 16); }
__device__ __forceinline__ u16 f_to_bf16(float f) {
  u16 r; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f)); return r;
}
__device__ __forceinline__ float e4m3_to_f(u8 v) {
  u32 h2; u16 in = v; u16 h;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(in));
  h = (u16)(h2 & 0xffff);
  float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f;
}
__device__ __forceinline__ u8 f_to_e4m3(float f) {
  u16 r; asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(0.0f), "f"(f));
  return (u8)(r & 0xff);
}

extern "C" __global__ void fill_bf16(u16 *p, u64 count, u64 seed) {
  for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < count; i += (u64)gridDim.x * blockDim.x)
    p[i] = f_to_bf16(uni(seed, i));
}
// e4m3 values in [-4, 4): the format's whole mantissa range gets exercised.
extern "C" __global__ void fill_e4m3(u8 *p, u64 count, u64 seed) {
  for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < count; i += (u64)gridDim.x * blockDim.x)
    p[i] = f_to_e4m3(4.0f * uni(seed, i));
}
extern "C" __global__ void fill_u32(u32 *p, u64 count, u32 v) {
  for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < count; i += (u64)gridDim.x * blockDim.x)
    p[i] = v;
}

// R[n, m] (fp32) = scale * sum_k B[r, k] * A[c, k], fp32 accumulation; 64 x 64 tiles,
// 16 x 16 threads of 4 x 4 outputs.
template <bool FP8>
__device__ __forceinline__ float ld_in(const void *p, u64 i) {
  return FP8 ? e4m3_to_f(((const u8 *)p)[i]) : bf16_to_f(((const u16 *)p)[i]);
}
template <bool FP8>
__device__ void ref_body(const void *A, const void *B, float *R, int m, int n, int k, float scale) {
  __shared__ float Bs[16][65];
  __shared__ float As[16][65];
  const int tx = threadIdx.x, ty = threadIdx.y, tid = ty * 16 + tx;
  const int row0 = blockIdx.y * 64, col0 = blockIdx.x * 64;
  float acc[4][4];
  for (int i = 0; i < 4; ++i) for (int j = 0; j < 4; ++j) acc[i][j] = 0.f;
  for (int k0 = 0; k0 < k; k0 += 16) {
    for (int e = tid; e < 1024; e += 256) {
      const int r = e / 16, kk = e % 16, gk = k0 + kk;
      Bs[kk][r] = (row0 + r < n && gk < k) ? ld_in<FP8>(B, (u64)(row0 + r) * k + gk) : 0.f;
      As[kk][r] = (col0 + r < m && gk < k) ? ld_in<FP8>(A, (u64)(col0 + r) * k + gk) : 0.f;
    }
    __syncthreads();
    for (int kk = 0; kk < 16; ++kk) {
      float b[4], a[4];
      for (int i = 0; i < 4; ++i) { b[i] = Bs[kk][ty + 16 * i]; a[i] = As[kk][tx + 16 * i]; }
      for (int i = 0; i < 4; ++i) for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(b[i], a[j], acc[i][j]);
    }
    __syncthreads();
  }
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 4; ++j) {
      const int r = row0 + ty + 16 * i, c = col0 + tx + 16 * j;
      if (r < n && c < m) R[(u64)r * m + c] = acc[i][j] * scale;
    }
}
extern "C" __global__ void ref_gemm_bf16(const void *A, const void *B, float *R, int m, int n, int k, float s) {
  ref_body<false>(A, B, R, m, n, k, s);
}
extern "C" __global__ void ref_gemm_e4m3(const void *A, const void *B, float *R, int m, int n, int k, float s) {
  ref_body<true>(A, B, R, m, n, k, s);
}

__device__ __forceinline__ float ld_out(const void *p, int f32, u64 i) {
  return f32 ? ((const float *)p)[i] : bf16_to_f(((const u16 *)p)[i]);
}
extern "C" __global__ void sum_sq(const void *R, int r_f32, u64 count, double *out) {
  double s = 0;
  for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < count; i += (u64)gridDim.x * blockDim.x) {
    const double v = ld_out(R, r_f32, i); s += v * v;
  }
  for (int o = 16; o > 0; o >>= 1) s += __shfl_down_sync(0xffffffffu, s, o);
  if ((threadIdx.x & 31) == 0) atomicAdd(out, s);
}
// stats[0]: elements with e > tol or not finite, stats[1]: not finite, stats[2]: max e
// (as float bits; e >= 0 so the bits order like the values), e = |d - r| / (|r| + rms).
// first_bad: the lowest index of a bad element (all ones: none).
extern "C" __global__ void compare(const void *D, int d_f32, const void *R, int r_f32, u64 count,
                                   float rms, float tol, u32 *stats, u64 *first_bad) {
  u32 bad = 0, nonfinite = 0; float emax = 0.f; u64 first = ~0ULL;
  for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < count; i += (u64)gridDim.x * blockDim.x) {
    const float d = ld_out(D, d_f32, i), r = ld_out(R, r_f32, i);
    if ((__float_as_uint(d) & 0x7f800000u) == 0x7f800000u) {
      ++nonfinite; ++bad; first = first < i ? first : i; continue;
    }
    const float e = fabsf(d - r) / (fabsf(r) + rms);
    if (!(e <= tol)) { ++bad; first = first < i ? first : i; }
    emax = fmaxf(emax, e);
  }
  if (first != ~0ULL) atomicMin(first_bad, first);
  for (int o = 16; o > 0; o >>= 1) {
    bad += __shfl_down_sync(0xffffffffu, bad, o);
    nonfinite += __shfl_down_sync(0xffffffffu, nonfinite, o);
    emax = fmaxf(emax, __shfl_down_sync(0xffffffffu, emax, o));
  }
  if ((threadIdx.x & 31) == 0) {
    if (bad) atomicAdd(&stats[0], bad);
    if (nonfinite) atomicAdd(&stats[1], nonfinite);
    atomicMax(&stats[2], __float_as_uint(emax));
  }
}

// ---- generic types for the feature cases: 0 bf16, 1 f16, 2 e4m3, 3 e5m2, 4 f32 (the
// kernel's T_* codes).
__device__ __forceinline__ float f16_to_f(u16 v) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v)); return f; }
__device__ __forceinline__ u16 f_to_f16(float f) { u16 r; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(f)); return r; }
__device__ __forceinline__ float e5m2_to_f(u8 v) {
  u32 h2; u16 in = v;
  asm("cvt.rn.f16x2.e5m2x2 %0, %1;" : "=r"(h2) : "h"(in));
  return f16_to_f((u16)(h2 & 0xffff));
}
__device__ __forceinline__ u8 f_to_e5m2(float f) {
  u16 r; asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(r) : "f"(0.0f), "f"(f));
  return (u8)(r & 0xff);
}
__device__ __forceinline__ float ld_t(const void *p, int t, u64 i) {
  switch (t) {
    case 0: return bf16_to_f(((const u16 *)p)[i]);
    case 1: return f16_to_f(((const u16 *)p)[i]);
    case 2: return e4m3_to_f(((const u8 *)p)[i]);
    case 3: return e5m2_to_f(((const u8 *)p)[i]);
    default: return ((const float *)p)[i];
  }
}
__device__ __forceinline__ void st_t(void *p, int t, u64 i, float v) {
  switch (t) {
    case 0: ((u16 *)p)[i] = f_to_bf16(v); break;
    case 1: ((u16 *)p)[i] = f_to_f16(v); break;
    case 2: ((u8 *)p)[i] = f_to_e4m3(v); break;
    case 3: ((u8 *)p)[i] = f_to_e5m2(v); break;
    default: ((float *)p)[i] = v;
  }
}
// Uniform values in [lo, hi) of type t.
extern "C" __global__ void fill_t(void *p, u64 count, u64 seed, int t, float lo, float hi) {
  for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < count; i += (u64)gridDim.x * blockDim.x)
    st_t(p, t, i, lo + (hi - lo) * 0.5f * (uni(seed, i) + 1.0f));
}
// R[n, m] = scale * sum_k B(r, k) A(c, k) in fp32, any input types and layout (0 TN: A
// [m, k], B [n, k]; 1 NN: A [k, m], B [n, k]; 2 NT: A [k, m], B [k, n]).
extern "C" __global__ void ref_gemm_t(const void *A, const void *B, float *R, int m, int n, int k, float scale,
                                      int ta, int tb, int layout) {
  __shared__ float Bs[16][65];
  __shared__ float As[16][65];
  const int tx = threadIdx.x, ty = threadIdx.y, tid = ty * 16 + tx;
  const int row0 = blockIdx.y * 64, col0 = blockIdx.x * 64;
  float acc[4][4];
  for (int i = 0; i < 4; ++i) for (int j = 0; j < 4; ++j) acc[i][j] = 0.f;
  for (int k0 = 0; k0 < k; k0 += 16) {
    for (int e = tid; e < 1024; e += 256) {
      const int r = e / 16, kk = e % 16, gk = k0 + kk;
      const u64 bi = layout == 2 ? (u64)gk * n + (row0 + r) : (u64)(row0 + r) * k + gk;
      const u64 ai = layout == 0 ? (u64)(col0 + r) * k + gk : (u64)gk * m + (col0 + r);
      Bs[kk][r] = (row0 + r < n && gk < k) ? ld_t(B, tb, bi) : 0.f;
      As[kk][r] = (col0 + r < m && gk < k) ? ld_t(A, ta, ai) : 0.f;
    }
    __syncthreads();
    for (int kk = 0; kk < 16; ++kk) {
      float b[4], a[4];
      for (int i = 0; i < 4; ++i) { b[i] = Bs[kk][ty + 16 * i]; a[i] = As[kk][tx + 16 * i]; }
      for (int i = 0; i < 4; ++i) for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(b[i], a[j], acc[i][j]);
    }
    __syncthreads();
  }
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 4; ++j) {
      const int r = row0 + ty + 16 * i, c = col0 + tx + 16 * j;
      if (r < n && c < m) R[(u64)r * m + c] = acc[i][j] * scale;
    }
}
// The epilogue's reference (kernel header: EPI_BIAS 1, EPI_GELU 2, EPI_ACCUM 4), in fp32
// with precise tanhf: Pre = R (+ beta C) (+ bias[col]); Fin = gelu(Pre) or Pre; amax of
// |Fin| into amax_bits; with sat > 0 (FP8 D), Fin = clamp(Fin * d_scale, +-sat) / d_scale
// (the value a saturating cast would round, in D's units).
extern "C" __global__ void ref_epi(const float *R, float *Pre, float *Fin, const void *C, int tc, const void *bias,
                                   int tbias, float beta, int epi, int m, u64 count, float d_scale, float sat,
                                   u32 *amax_bits) {
  float amax = 0.f;
  for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < count; i += (u64)gridDim.x * blockDim.x) {
    float v = R[i];
    if (epi & 4) v += beta * ld_t(C, tc, i);
    if (epi & 1) v += ld_t(bias, tbias, i % (u64)m);
    Pre[i] = v;
    if (epi & 2) v = 0.5f * v * (1.f + tanhf(0.7978845608028654f * (v + 0.044715f * v * v * v)));
    amax = fmaxf(amax, fabsf(v));
    if (sat > 0.f) v = fminf(fmaxf(v * d_scale, -sat), sat) / d_scale;
    Fin[i] = v;
  }
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_down_sync(0xffffffffu, amax, o));
  if ((threadIdx.x & 31) == 0) atomicMax(amax_bits, __float_as_uint(amax));
}
extern "C" __global__ void sum_sq_t(const void *R, int t, u64 count, double *out) {
  double s = 0;
  for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < count; i += (u64)gridDim.x * blockDim.x) {
    const double v = ld_t(R, t, i); s += v * v;
  }
  for (int o = 16; o > 0; o >>= 1) s += __shfl_down_sync(0xffffffffu, s, o);
  if ((threadIdx.x & 31) == 0) atomicAdd(out, s);
}
// compare() for any D type, D's values multiplied by d_mul (1 / d_scale for FP8 D).
extern "C" __global__ void compare_t(const void *D, int td, float d_mul, const float *R, u64 count, float rms,
                                     float tol, u32 *stats, u64 *first_bad) {
  u32 bad = 0, nonfinite = 0; float emax = 0.f; u64 first = ~0ULL;
  for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < count; i += (u64)gridDim.x * blockDim.x) {
    const float d = ld_t(D, td, i) * d_mul, r = R[i];
    if ((__float_as_uint(d) & 0x7f800000u) == 0x7f800000u) {
      ++nonfinite; ++bad; first = first < i ? first : i; continue;
    }
    const float e = fabsf(d - r) / (fabsf(r) + rms);
    if (!(e <= tol)) { ++bad; first = first < i ? first : i; }
    emax = fmaxf(emax, e);
  }
  if (first != ~0ULL) atomicMin(first_bad, first);
  for (int o = 16; o > 0; o >>= 1) {
    bad += __shfl_down_sync(0xffffffffu, bad, o);
    nonfinite += __shfl_down_sync(0xffffffffu, nonfinite, o);
    emax = fmaxf(emax, __shfl_down_sync(0xffffffffu, emax, o));
  }
  if ((threadIdx.x & 31) == 0) {
    if (bad) atomicAdd(&stats[0], bad);
    if (nonfinite) atomicAdd(&stats[1], nonfinite);
    atomicMax(&stats[2], __float_as_uint(emax));
  }
}
)SRC";

// ---------------------------------------------------------------- kernel configuration
// gemm90::THREADS in kernels/gemm_sm90.cu; the shared memory sizes come from the module
// (gemm_sm90_smem_bytes_<BN>).
static const int THREADS = 384;
// The plain kernels, their shared memory sizes and whether the BN-192 ping-pong ones are
// there: g90::gemm_mod (bench/gemm90_host.hpp), loaded in main.
static int smem_of(int bn) { return g90::gemm_mod.smem[bn_idx(bn)]; }
static bool has_pp() { return g90::gemm_mod.has_pp; }

struct Mods {
  CUmodule gemm = nullptr, ref = nullptr;  // gemm: g90::gemm_mod's module
  CUfunction fill_bf16, fill_e4m3, fill_u32, ref_bf16, ref_e4m3, sum_sq, compare;
  CUfunction fill_t, ref_gemm_t, ref_epi, sum_sq_t, compare_t;
};
static Mods M;

static void fill(void *p, size_t count, bool fp8, uint64_t seed) {
  uint64_t c = count;
  launch(fp8 ? M.fill_e4m3 : M.fill_bf16, 1024, 1, 256, 1, 0, 0, {&p, &c, &seed});
}
static void fill_u32(void *p, size_t count, uint32_t v, cudaStream_t s = 0) {
  uint64_t c = count;
  launch(M.fill_u32, 1024, 1, 256, 1, 0, s, {&p, &c, &v});
}

// ---- element types and layouts of the feature cases (the kernel's T_* / L_* codes)
constexpr int T_BF16 = 0, T_F16 = 1, T_E4M3 = 2, T_E5M2 = 3, T_F32 = 4;
constexpr int L_TN = 0, L_NN = 1, L_NT = 2;
// Gemm90Args::epilogue bits
constexpr int EPI_BIAS = 1, EPI_GELU = 2, EPI_ACCUM = 4;
static const char *T_NAME[5] = {"bf16", "f16", "e4m3", "e5m2", "f32"};
static const char *L_NAME[3] = {"tn", "nn", "nt"};
static bool t_fp8(int t) { return t == T_E4M3 || t == T_E5M2; }
static int t_bytes(int t) { return t == T_F32 ? 4 : t_fp8(t) ? 1 : 2; }
static int epi_type(int to) { return t_fp8(to) ? T_BF16 : to; }  // bias / aux type
static float fp8_max(int t) { return t == T_E4M3 ? 448.f : 57344.f; }

static void fill_t(void *p, size_t count, int t, uint64_t seed, float lo, float hi) {
  uint64_t c = count;
  launch(M.fill_t, 1024, 1, 256, 1, 0, 0, {&p, &c, &seed, &t, &lo, &hi});
}

// A kernel of the GEMM module by name (looked up once; its shared memory attribute set).
static CUfunction own_kernel(const std::string &name, int bn) {
  static std::vector<std::pair<std::string, CUfunction>> cache;
  for (auto &e : cache)
    if (e.first == name) return e.second;
  CUfunction f;
  CUresult r = drv.ModuleGetFunction(&f, M.gemm, name.c_str());
  if (r != CUDA_SUCCESS) die(("no kernel " + name + " in the module").c_str(), __FILE__, __LINE__);
  CU(drv.FuncSetAttribute(f, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem_of(bn)));
  cache.emplace_back(name, f);
  return f;
}
// The kernel naming scheme of gemm_sm90.cu: gemm_sm90_<layout>_<a>_<b>_<out>_<BN>[_<variant>].
static std::string own_name(int layout, int ta, int tb, int to, int bn, const char *variant) {
  std::string n = std::string("gemm_sm90_") + L_NAME[layout] + "_" + T_NAME[ta] + "_" + T_NAME[tb] + "_" +
                  T_NAME[to] + "_" + std::to_string(bn);
  if (variant && *variant) n += std::string("_") + variant;
  return n;
}

// Any tensor map of the kernel: K-major ([rows, k], box {128 bytes of k, box_rows}) or
// MN-major ([k, rows] with rows contiguous, box {64, 64}; 16-bit types only).
static bool tmap_t(CUtensorMap &t, void *ptr, int type, bool mn_major, int rows, int k, int box_rows) {
  const int es = t_bytes(type);
  const CUtensorMapDataType dt = es == 1          ? CU_TENSOR_MAP_DATA_TYPE_UINT8
                                 : type == T_F16 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16
                                                 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  cuuint64_t dims[2], strides[1];
  cuuint32_t box[2], estr[2] = {1, 1};
  if (mn_major) {
    dims[0] = (cuuint64_t)rows;
    dims[1] = (cuuint64_t)k;
    strides[0] = (cuuint64_t)rows * es;
    box[0] = 64;
    box[1] = 64;
  } else {
    dims[0] = (cuuint64_t)k;
    dims[1] = (cuuint64_t)rows;
    strides[0] = (cuuint64_t)k * es;
    box[0] = (cuuint32_t)(128 / es);
    box[1] = (cuuint32_t)box_rows;
  }
  CUresult r = drv.TensorMapEncodeTiled(&t, dt, 2, ptr, dims, strides, box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                        CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                        CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    const char *e = "unknown";
    drv.GetErrorString(r, &e);
    std::printf("  cuTensorMapEncodeTiled refused %s %s rows %d k %d: %s\n", T_NAME[type], mn_major ? "MN" : "K",
                rows, k, e);
  }
  return r == CUDA_SUCCESS;
}

// false (with the driver's reason printed) when the driver refuses the map.
static bool tmap(CUtensorMap &t, void *ptr, bool fp8, int rows, int k, int box_rows) {
  const int es = fp8 ? 1 : 2;
  cuuint64_t dims[2] = {(cuuint64_t)k, (cuuint64_t)rows};
  cuuint64_t strides[1] = {(cuuint64_t)k * es};
  cuuint32_t box[2] = {(cuuint32_t)(128 / es), (cuuint32_t)box_rows};
  cuuint32_t estr[2] = {1, 1};
  CUresult r = drv.TensorMapEncodeTiled(&t, fp8 ? CU_TENSOR_MAP_DATA_TYPE_UINT8 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                                        2, ptr, dims, strides, box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                        CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                        CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    const char *e = "unknown";
    drv.GetErrorString(r, &e);
    std::printf("  cuTensorMapEncodeTiled refused rows %d k %d box %d x %d: %s\n", rows, k, 128 / es, box_rows, e);
  }
  return r == CUDA_SUCCESS;
}

// Waits for stream s; a kernel still running after `seconds` is reported as a hang and
// the process ends (status 1) so that the log says where.
static void sync_or_hang(cudaStream_t s, const char *what, int seconds = 30) {
  const auto t0 = std::chrono::steady_clock::now();
  while (cudaStreamQuery(s) == cudaErrorNotReady) {
    if (std::chrono::steady_clock::now() - t0 > std::chrono::seconds(seconds)) {
      std::printf("HANG: %s still running after %d s\n", what, seconds);
      std::fflush(stdout);
      std::_Exit(1);
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  CK(cudaStreamSynchronize(s));
  CK(cudaGetLastError());
}

static int g_sms = 132;


// Our GEMM: D[n, m] = B[n, k] . A[m, k]^T (* a_si * b_si for e4m3).
struct Own {
  bool fp8, out_f32;
  int m, n, k, bn, group_n = 8, rot = 0, rows_per_flag = 0, done_rows = 0;
  const uint32_t *flags = nullptr;
  uint32_t flag_value = 1, done_value = 1;
  uint32_t *done = nullptr;  // RS signals (2 * ceil(n / done_rows) words, zeroed)
  uint32_t *stall = nullptr;  // {flag + 1, claim, waited ns}: an arrival wait that gave up (null: none do)
  unsigned long long stall_ns = 0;
  void *A, *B, *D;
  const float *a_si = nullptr, *b_si = nullptr;
  CUtensorMap ta, tb;
  bool prepare() { return tmap(tb, B, fp8, n, k, 128) && tmap(ta, A, fp8, m, k, bn); }
  int tiles() const { return ((n + 127) / 128) * ((m + bn - 1) / bn); }
  void run(cudaStream_t s) {
    CUfunction f = g90::gemm_mod.fn[fp8][out_f32][bn_idx(bn)];  // gemm_sm90_tn_<in>_<in>_<out>_<BN>
    int grid = std::min(tiles(), g_sms);
    Gemm90Args g;
    std::memset(&g, 0, sizeof g);
    g.d = D;
    g.a_scale_inv = a_si;
    g.b_scale_inv = b_si;
    g.flags = flags;
    g.done = done;
    g.m = m;
    g.n = n;
    g.k = k;
    g.rows_per_flag = flags ? (rows_per_flag > 0 ? rows_per_flag : 128) : 0;
    g.done_rows = done ? done_rows : 0;
    g.group_n = group_n;
    g.n_tile_rot = rot;
    g.flag_value = flag_value;
    g.done_value = done_value;
    g.stall = stall;
    g.stall_ns = stall_ns;
    launch(f, grid, 1, THREADS, 1, smem_of(bn), s, {&tb, &ta, &g});
  }
};

// ---- the tile rule (the library reuses it; keep the two in step)
// BN (tile width over m): 256, unless 128 fills the GPU clearly better: the wave
// efficiency eff(bn) = useful work / (waves * SMs * tile), where useful work discounts
// partial tiles (m not a multiple of bn, n not a multiple of 128) and waves counts the
// last, partly empty wave of the persistent schedule in full; 128 wins when it is more
// than 0.05 better. _fpacc kernels exist at BN 128 only (two 64-register accumulator
// sets per thread). group_n (tile rows per rasterization group): 8, the measured
// default of the anchor table (every CTA of a wave works on <= 8 tile rows of B, so
// their rows stay in L2 while the wave walks the tile columns), capped at the number of
// tile rows. Not yet tuned per shape beyond this.
struct Tile {
  int bn, group_n;
};
static Tile pick_tile(int m, int n, bool fpacc) {
  auto eff = [&](int bn) {
    long t = (long)((n + 127) / 128) * ((m + bn - 1) / bn);
    long waves = (t + g_sms - 1) / g_sms;
    double useful = (double)m * n / ((double)t * 128 * bn);  // partial tiles waste
    return useful * t / (double)(waves * g_sms);
  };
  Tile r;
  r.bn = fpacc ? 128 : eff(128) > eff(256) + 0.05 ? 128 : 256;
  r.group_n = std::max(1, std::min(8, (n + 127) / 128));
  return r;
}
static int pick_bn(int m, int n) { return pick_tile(m, n, false).bn; }
// A plain kernel's width (the timed cases): as the library, the ping-pong BN 192 for bf16 D
// where g90::pingpong_pays says so (src/gemm/sm90.rs pick_tile, no arrival flags).
static int pick_plain(int m, int n, int k, bool fp8, bool out_f32) {
  const int bn = pick_bn(m, n);
  return has_pp() && !out_f32 && g90::pingpong_pays(m, n, k, fp8, bn, g_sms) ? 192 : bn;
}

// ---------------------------------------------------------------- cuBLASLt
struct Lt {
  cublasLtHandle_t h = nullptr;
  void *ws = nullptr;
  size_t wsz = 64 << 20;
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, ld = nullptr;
  cublasLtMatmulHeuristicResult_t heurs[8];
  int nheur = 0, pick = 0;
  cublasStatus_t last = CUBLAS_STATUS_SUCCESS;
  void init() {
    LT(cublasLtCreate(&h));
    CK(cudaMalloc(&ws, wsz));
  }
  void release() {
    if (op) cublasLtMatmulDescDestroy(op);
    if (la) cublasLtMatrixLayoutDestroy(la);
    if (lb) cublasLtMatrixLayoutDestroy(lb);
    if (ld) cublasLtMatrixLayoutDestroy(ld);
    op = nullptr;
    la = lb = ld = nullptr;
  }
  // nvte_cublas_gemm's TN in column-major terms: D(m x n, ld m) = A(k x m)^T . B(k x n).
  bool setup(bool fp8, bool out_f32, int m, int n, int k, const float *a_si, const float *b_si) {
    release();
    LT(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    LT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    LT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    if (fp8) {
      LT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &a_si, sizeof a_si));
      LT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &b_si, sizeof b_si));
      int8_t fast = 1;  // our kernel has wgmma's fast accumulation only
      LT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof fast));
    }
    cudaDataType_t tin = fp8 ? CUDA_R_8F_E4M3 : CUDA_R_16BF, tout = out_f32 ? CUDA_R_32F : CUDA_R_16BF;
    LT(cublasLtMatrixLayoutCreate(&la, tin, k, m, k));
    LT(cublasLtMatrixLayoutCreate(&lb, tin, k, n, k));
    LT(cublasLtMatrixLayoutCreate(&ld, tout, m, n, m));
    cublasLtMatmulPreference_t pref;
    LT(cublasLtMatmulPreferenceCreate(&pref));
    LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsz, sizeof wsz));
    nheur = 0;
    pick = 0;
    cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(h, op, la, lb, ld, ld, pref, 8, heurs, &nheur);
    cublasLtMatmulPreferenceDestroy(pref);
    return st == CUBLAS_STATUS_SUCCESS && nheur > 0;
  }
  cublasStatus_t try_run(const void *A, const void *B, void *D, cudaStream_t s) {
    const float alpha = 1.f, beta = 0.f;
    return cublasLtMatmul(h, op, &alpha, A, la, B, lb, &beta, D, ld, D, ld, &heurs[pick].algo, ws, wsz, s);
  }
  // The first heuristic candidate that runs (cuBLASLt 13.1 answered NOT_SUPPORTED for the
  // top e4m3 candidate of a 128x128x64 problem on an H100, 2026-11-26); false if none.
  bool first_run(const void *A, const void *B, void *D, cudaStream_t s) {
    for (pick = 0; pick < nheur; ++pick) {
      last = try_run(A, B, D, s);
      if (last == CUBLAS_STATUS_SUCCESS) return true;
    }
    pick = 0;
    return false;
  }
  void run(const void *A, const void *B, void *D, cudaStream_t s) { LT(try_run(A, B, D, s)); }
  // The picked algorithm's configuration as cublasLt.h's enum numbers (algo id, tile,
  // stages, cluster shape, CTA swizzling, split-K, custom option), for the log.
  std::string config() const {
    const cublasLtMatmulAlgoConfigAttributes_t at[] = {
        CUBLASLT_ALGO_CONFIG_ID,           CUBLASLT_ALGO_CONFIG_TILE_ID,       CUBLASLT_ALGO_CONFIG_STAGES_ID,
        CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, CUBLASLT_ALGO_CONFIG_SPLITK_NUM,
        CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION};
    const char *nm[] = {"id", "tile", "stages", "cluster", "swizzle", "splitk", "custom"};
    std::string r;
    for (size_t i = 0; i < sizeof at / sizeof at[0]; ++i) {
      uint32_t v = 0;
      uint16_t v16 = 0;  // the cluster shape is a uint16_t
      size_t got = 0;
      const bool small = at[i] == CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID;
      const bool ok = cublasLtMatmulAlgoConfigGetAttribute(&heurs[pick].algo, at[i], small ? (void *)&v16 : &v,
                                                           small ? sizeof v16 : sizeof v, &got) ==
                      CUBLAS_STATUS_SUCCESS;
      if (small) v = v16;
      r += std::string(i ? " " : "") + nm[i] + " " + (ok ? std::to_string(v) : std::string("?"));
    }
    return r;
  }
};

// ---------------------------------------------------------------- checks
struct Cmp {
  uint32_t bad, nonfinite;
  float emax;
  uint64_t first_bad;  // index of the first bad element, ~0 if none
};
static double rms_of(const void *R, bool f32, size_t count) {
  double *d;
  CK(cudaMalloc(&d, sizeof(double)));
  CK(cudaMemset(d, 0, sizeof(double)));
  int r32 = f32;
  uint64_t c = count;
  launch(M.sum_sq, 1024, 1, 256, 1, 0, 0, {(void *)&R, &r32, &c, &d});
  double h;
  CK(cudaMemcpy(&h, d, sizeof h, cudaMemcpyDeviceToHost));
  CK(cudaFree(d));
  return std::sqrt(h / (double)count);
}
static Cmp compare(const void *D, bool d_f32, const void *R, bool r_f32, size_t count, float rms, float tol) {
  uint32_t *st;
  uint64_t *fb;
  CK(cudaMalloc(&st, 3 * sizeof(uint32_t)));
  CK(cudaMalloc(&fb, sizeof(uint64_t)));
  CK(cudaMemset(st, 0, 3 * sizeof(uint32_t)));
  CK(cudaMemset(fb, 0xff, sizeof(uint64_t)));
  int d32 = d_f32, r32 = r_f32;
  uint64_t c = count;
  launch(M.compare, 1024, 1, 256, 1, 0, 0, {(void *)&D, &d32, (void *)&R, &r32, &c, &rms, &tol, &st, &fb});
  uint32_t h[3];
  Cmp r;
  CK(cudaMemcpy(h, st, sizeof h, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(&r.first_bad, fb, sizeof(uint64_t), cudaMemcpyDeviceToHost));
  CK(cudaFree(st));
  CK(cudaFree(fb));
  r.bad = h[0];
  r.nonfinite = h[1];
  std::memcpy(&r.emax, &h[2], 4);
  return r;
}

static float h_bf16(uint16_t v);
// For a failed check: where the first bad elements are, in tile terms, to tell a
// descriptor / swizzle / fragment-layout mistake (a pattern inside tiles) from a
// scheduling one (whole tiles poisoned).
static void print_bad(const Cmp &c, const void *D, bool d_f32, const float *R, int m, int bn) {
  if (c.bad == 0 || c.first_bad == ~0ULL) return;
  std::printf("  %u bad elements (%u not finite); first ones (row n, col m: ours vs ref; tile row/col, "
              "offset in tile):\n", c.bad, c.nonfinite);
  for (uint64_t i = c.first_bad, shown = 0; shown < 6 && i < c.first_bad + 64; ++i) {
    float d, r;
    if (d_f32) {
      CK(cudaMemcpy(&d, (const float *)D + i, 4, cudaMemcpyDeviceToHost));
    } else {
      uint16_t v;
      CK(cudaMemcpy(&v, (const uint16_t *)D + i, 2, cudaMemcpyDeviceToHost));
      d = h_bf16(v);
    }
    CK(cudaMemcpy(&r, R + i, 4, cudaMemcpyDeviceToHost));
    const long row = (long)(i / m), col = (long)(i % m);
    std::printf("    [%ld, %ld]: %g vs %g (tile %ld/%ld, +%ld/+%ld)\n", row, col, d, r, row / 128, col / bn, row % 128,
                col % bn);
    ++shown;
  }
}

static float h_bf16(uint16_t v) {
  uint32_t u = (uint32_t)v << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
static float h_e4m3(uint8_t v) {
  const int s = v >> 7, e = (v >> 3) & 15, mt = v & 7;
  float f;
  if (e == 15 && mt == 7) return NAN;
  if (e == 0)
    f = std::ldexp((float)mt / 8.f, -6);
  else
    f = std::ldexp(1.f + (float)mt / 8.f, e - 7);
  return s ? -f : f;
}
static float h_f16(uint16_t v) {
  const int s = v >> 15, e = (v >> 10) & 31, mt = v & 1023;
  float f;
  if (e == 31) return mt ? NAN : (s ? -INFINITY : INFINITY);
  if (e == 0)
    f = std::ldexp((float)mt / 1024.f, -14);
  else
    f = std::ldexp(1.f + (float)mt / 1024.f, e - 15);
  return s ? -f : f;
}
static float h_e5m2(uint8_t v) { return h_f16((uint16_t)v << 8); }
// Element i of a host buffer of type t.
static double h_val(const std::vector<uint8_t> &b, int t, size_t i) {
  switch (t) {
    case T_BF16: {
      uint16_t x;
      std::memcpy(&x, &b[2 * i], 2);
      return h_bf16(x);
    }
    case T_F16: {
      uint16_t x;
      std::memcpy(&x, &b[2 * i], 2);
      return h_f16(x);
    }
    case T_E4M3: return h_e4m3(b[i]);
    case T_E5M2: return h_e5m2(b[i]);
    default: {
      float x;
      std::memcpy(&x, &b[4 * i], 4);
      return x;
    }
  }
}
static std::vector<uint8_t> to_host(const void *p, size_t bytes) {
  std::vector<uint8_t> h(bytes);
  if (bytes) CK(cudaMemcpy(h.data(), p, bytes, cudaMemcpyDeviceToHost));
  return h;
}

// fp64 on the CPU at sampled elements: the max normalized error of ours and of the fp32
// reference, e = |x - r64| / (|r64| + rms64).
struct CpuCheck {
  double e_own = 0, e_ref = 0;
};
static CpuCheck cpu_check(bool fp8, bool out_f32, int m, int n, int k, const void *A, const void *B,
                          const void *D, const float *R, float scale, int samples) {
  const size_t es = fp8 ? 1 : 2;
  std::vector<uint8_t> ha((size_t)m * k * es), hb((size_t)n * k * es);
  CK(cudaMemcpy(ha.data(), A, ha.size(), cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(hb.data(), B, hb.size(), cudaMemcpyDeviceToHost));
  auto in = [&](const std::vector<uint8_t> &v, size_t i) {
    if (fp8) return (double)h_e4m3(v[i]);
    uint16_t x;
    std::memcpy(&x, &v[2 * i], 2);
    return (double)h_bf16(x);
  };
  uint64_t st = 0x1234567ULL ^ ((uint64_t)m << 40) ^ ((uint64_t)n << 20) ^ (uint64_t)k;
  std::vector<double> r64(samples), own(samples), ref(samples);
  double ss = 0;
  for (int s = 0; s < samples; ++s) {
    st = st * 6364136223846793005ULL + 1442695040888963407ULL;
    const int r = (int)((st >> 33) % (uint64_t)n);
    st = st * 6364136223846793005ULL + 1442695040888963407ULL;
    const int c = (int)((st >> 33) % (uint64_t)m);
    double acc = 0;
    for (int kk = 0; kk < k; ++kk) acc += in(hb, (size_t)r * k + kk) * in(ha, (size_t)c * k + kk);
    r64[s] = acc * scale;
    ss += r64[s] * r64[s];
    const size_t off = (size_t)r * m + c;
    float rv;
    CK(cudaMemcpy(&rv, R + off, 4, cudaMemcpyDeviceToHost));
    ref[s] = rv;
    if (out_f32) {
      float dv;
      CK(cudaMemcpy(&dv, (const float *)D + off, 4, cudaMemcpyDeviceToHost));
      own[s] = dv;
    } else {
      uint16_t dv;
      CK(cudaMemcpy(&dv, (const uint16_t *)D + off, 2, cudaMemcpyDeviceToHost));
      own[s] = h_bf16(dv);
    }
  }
  const double rms = std::sqrt(ss / samples) + 1e-30;
  CpuCheck out;
  for (int s = 0; s < samples; ++s) {
    const double den = std::fabs(r64[s]) + rms;
    const double eo = std::fabs(own[s] - r64[s]) / den, er = std::fabs(ref[s] - r64[s]) / den;
    out.e_own = std::isfinite(eo) ? std::max(out.e_own, eo) : INFINITY;
    out.e_ref = std::max(out.e_ref, er);
  }
  return out;
}

// ---------------------------------------------------------------- timing
static float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}
// Times several launchers interleaved (one iteration of each in turn), median ms each.
static std::vector<float> time_ms(std::vector<std::function<void(cudaStream_t)>> fs, int iters, cudaStream_t s) {
  for (int w = 0; w < 3; ++w)
    for (auto &f : fs) f(s);
  std::vector<std::vector<float>> t(fs.size());
  std::vector<cudaEvent_t> ev(2 * fs.size() * iters);
  for (auto &e : ev) CK(cudaEventCreate(&e));
  for (int i = 0; i < iters; ++i)
    for (size_t j = 0; j < fs.size(); ++j) {
      CK(cudaEventRecord(ev[2 * (i * fs.size() + j)], s));
      fs[j](s);
      CK(cudaEventRecord(ev[2 * (i * fs.size() + j) + 1], s));
    }
  CK(cudaStreamSynchronize(s));
  for (int i = 0; i < iters; ++i)
    for (size_t j = 0; j < fs.size(); ++j) {
      float ms;
      CK(cudaEventElapsedTime(&ms, ev[2 * (i * fs.size() + j)], ev[2 * (i * fs.size() + j) + 1]));
      t[j].push_back(ms);
    }
  for (auto &e : ev) CK(cudaEventDestroy(e));
  std::vector<float> out;
  for (auto &v : t) out.push_back(median(v));
  return out;
}

// ---------------------------------------------------------------- cases
struct Case {
  int m, n, k, tp;  // D[n, m] = B[n, k] . A[m, k]^T; tp 0: not an anchor
  bool fp8, out_f32;
  int bn;  // 0: pick_bn
  int group_n = 8, rot = 0;
  bool timed = false;
};
struct Row {
  Case c;
  int bn;
  float own_ms = 0, lt_ms = 0, own_flags_ms = 0, own_done_ms = 0;
  Cmp vs_ref{}, vs_lt{};
  CpuCheck cpu;
  bool lt_ok = false, ok = false;
};

static float tol_of(bool fp8, bool out_f32) {
  // wgmma's fast FP8 accumulation keeps fewer mantissa bits than fp32 over the whole K
  // (about 14 by public accounts): up to ~1e-2 of the rms at K = 8192 if its rounding is
  // biased. A layout or pipeline mistake gives errors of order 1.
  if (fp8) return 5e-2f;
  return out_f32 ? 2e-3f : 1e-2f;  // accumulation order; bf16 output rounding
}

static Row run_case(const Case &c, Lt &lt, int iters, cudaStream_t s) {
  Row row;
  row.c = c;
  row.bn = c.bn ? c.bn : pick_plain(c.m, c.n, c.k, c.fp8, c.out_f32);
  const size_t es = c.fp8 ? 1 : 2, os = c.out_f32 ? 4 : 2;
  const size_t nd = (size_t)c.m * c.n;
  void *A, *B, *D, *Dlt;
  float *R, *si;
  uint32_t *flags;
  CK(cudaMalloc(&A, (size_t)c.m * c.k * es));
  CK(cudaMalloc(&B, (size_t)c.n * c.k * es));
  CK(cudaMalloc(&D, nd * os));
  CK(cudaMalloc(&Dlt, nd * os));
  CK(cudaMalloc(&R, nd * 4));
  // The two scale_invs 256 bytes apart, as separate tensors would be (with b's 4 bytes
  // after a's, every e4m3 cuBLASLt candidate answered NOT_SUPPORTED, H100, 2026-11-26).
  CK(cudaMalloc(&si, 128 * sizeof(float)));
  const int tp = c.tp > 0 ? c.tp : 4;
  const int rpf = std::max(1, (c.n + tp - 1) / tp);
  const int nflags = (c.n + rpf - 1) / rpf;
  CK(cudaMalloc(&flags, nflags * sizeof(uint32_t)));
  // Done signals as the fused reduce-scatter's: 4 pieces per destination block.
  const int done_rows = std::max(1, (c.n + 4 * tp - 1) / (4 * tp));
  const int ndone = (c.n + done_rows - 1) / done_rows;
  uint32_t *done;
  CK(cudaMalloc(&done, 2 * ndone * sizeof(uint32_t)));
  CK(cudaMemset(done, 0, 2 * ndone * sizeof(uint32_t)));
  fill(A, (size_t)c.m * c.k, c.fp8, 1000 + c.m + c.k);
  fill(B, (size_t)c.n * c.k, c.fp8, 2000 + c.n + c.k);
  const float hsi[2] = {c.fp8 ? 0.5f : 1.f, c.fp8 ? 0.25f : 1.f};
  CK(cudaMemcpy(si, hsi, sizeof(float), cudaMemcpyHostToDevice));
  CK(cudaMemcpy(si + 64, hsi + 1, sizeof(float), cudaMemcpyHostToDevice));
  fill_u32(flags, nflags, 1);
  // Poison: NaN in both output types (0x7fc0 bf16 pairs / 0x7fc07fc0 as f32 is NaN too).
  fill_u32(D, nd * os / 4, 0x7fc07fc0u);
  fill_u32(Dlt, nd * os / 4, 0x7fc07fc0u);
  CK(cudaDeviceSynchronize());

  const float scale = hsi[0] * hsi[1];
  launch(c.fp8 ? M.ref_e4m3 : M.ref_bf16, (c.m + 63) / 64, (c.n + 63) / 64, 16, 16, 0, 0,
         {&A, &B, &R, (void *)&c.m, (void *)&c.n, (void *)&c.k, (void *)&scale});

  Own own;
  own.fp8 = c.fp8;
  own.out_f32 = c.out_f32;
  own.m = c.m;
  own.n = c.n;
  own.k = c.k;
  own.bn = row.bn;
  own.group_n = c.group_n;
  own.rot = c.rot;
  own.A = A;
  own.B = B;
  own.D = D;
  own.a_si = si;
  own.b_si = si + 64;
  const bool mapped = own.prepare();
  if (mapped) {
    own.run(s);
    sync_or_hang(s, "our kernel");
  }

  const float rms = (float)rms_of(R, true, nd);
  const float tol = tol_of(c.fp8, c.out_f32);
  row.vs_ref = compare(D, c.out_f32, R, true, nd, rms, tol);
  print_bad(row.vs_ref, D, c.out_f32, R, c.m, row.bn);
  row.cpu = cpu_check(c.fp8, c.out_f32, c.m, c.n, c.k, A, B, D, R, scale, c.timed ? 256 : 512);
  row.lt_ok = lt.setup(c.fp8, c.out_f32, c.m, c.n, c.k, si, si + 64);
  if (row.lt_ok && !lt.first_run(A, B, Dlt, s)) {
    std::printf("cuBLASLt: none of %d heuristic candidates runs (last status %d)\n", lt.nheur, (int)lt.last);
    row.lt_ok = false;
  }
  if (row.lt_ok) {
    if (c.timed) std::printf("  cuBLASLt algo (candidate %d of %d): %s\n", lt.pick + 1, lt.nheur, lt.config().c_str());
    CK(cudaStreamSynchronize(s));
    row.vs_lt = compare(D, c.out_f32, Dlt, c.out_f32, nd, rms, tol);
  }
  row.ok = mapped && row.vs_ref.bad == 0 && row.cpu.e_own <= tol && row.cpu.e_ref <= tol;

  // Flags set beforehand: the same kernel with waits, and the result again.
  Own flagged = own;
  flagged.flags = flags;
  flagged.rows_per_flag = rpf;
  // Done signals that nobody waits for: their cost inside the kernel.
  Own signalling = own;
  signalling.done = done;
  signalling.done_rows = done_rows;
  if (c.timed && mapped) {
    std::vector<std::function<void(cudaStream_t)>> fs = {[&](cudaStream_t st) { own.run(st); },
                                                         [&](cudaStream_t st) { flagged.run(st); },
                                                         [&](cudaStream_t st) { signalling.run(st); }};
    if (row.lt_ok) fs.push_back([&](cudaStream_t st) { lt.run(A, B, Dlt, st); });
    auto t = time_ms(fs, iters, s);
    row.own_ms = t[0];
    row.own_flags_ms = t[1];
    row.own_done_ms = t[2];
    if (row.lt_ok) row.lt_ms = t[3];
  }
  fill_u32(D, nd * os / 4, 0x7fc07fc0u);
  if (mapped) {
    flagged.run(s);
    sync_or_hang(s, "our kernel with pre-set flags");
  }
  Cmp fl = compare(D, c.out_f32, R, true, nd, rms, tol);
  if (fl.bad) {
    std::printf("  flags-set run of %dx%dx%d: %u bad elements\n", c.m, c.n, c.k, fl.bad);
    row.ok = false;
  }

  CK(cudaFree(done));
  CK(cudaFree(A));
  CK(cudaFree(B));
  CK(cudaFree(D));
  CK(cudaFree(Dlt));
  CK(cudaFree(R));
  CK(cudaFree(si));
  CK(cudaFree(flags));
  return row;
}

// ---------------------------------------------------------------- feature cases
// One case of the kernels beyond the plain fast path: input types, output types,
// epilogues (bias, GELU with aux, accumulate), FP8 output with d_scale and amax,
// full-precision FP8 accumulation, NN / NT layouts. Checked against ref_gemm_t +
// ref_epi (fp32 on the GPU, every element) and fp64 CPU samples, with D (and aux)
// NaN-poisoned beforehand (D holds the old values instead with EPI_ACCUM).
struct FCase {
  const char *feature;
  int layout, ta, tb, to;
  const char *variant;  // "epi" or "fpacc"
  int epi;              // EPI_* bits
  bool amax;
  int m, n, k;
  int bn = 0;           // 0: the tile rule
  bool stress = false;  // FP8 inputs all positive in [0, 4): accumulation error grows with k
  bool report_only = false;  // errors reported, not judged (the fast side of the precision test)
};
struct FResult {
  bool ok = false;
  double e_gpu = 0, e_cpu = 0, e_aux = 0, e_amax = 0;
};
static double rms_t(const void *R, int t, size_t count) {
  double *d;
  CK(cudaMalloc(&d, sizeof(double)));
  CK(cudaMemset(d, 0, sizeof(double)));
  uint64_t c = count;
  launch(M.sum_sq_t, 1024, 1, 256, 1, 0, 0, {(void *)&R, &t, &c, &d});
  double h;
  CK(cudaMemcpy(&h, d, sizeof h, cudaMemcpyDeviceToHost));
  CK(cudaFree(d));
  return std::sqrt(h / (double)count);
}
static Cmp compare_t(const void *D, int td, float d_mul, const float *R, size_t count, float rms, float tol) {
  uint32_t *st;
  uint64_t *fb;
  CK(cudaMalloc(&st, 3 * sizeof(uint32_t)));
  CK(cudaMalloc(&fb, sizeof(uint64_t)));
  CK(cudaMemset(st, 0, 3 * sizeof(uint32_t)));
  CK(cudaMemset(fb, 0xff, sizeof(uint64_t)));
  uint64_t c = count;
  launch(M.compare_t, 1024, 1, 256, 1, 0, 0, {(void *)&D, &td, &d_mul, (void *)&R, &c, &rms, &tol, &st, &fb});
  uint32_t h[3];
  Cmp r;
  CK(cudaMemcpy(h, st, sizeof h, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(&r.first_bad, fb, sizeof(uint64_t), cudaMemcpyDeviceToHost));
  CK(cudaFree(st));
  CK(cudaFree(fb));
  r.bad = h[0];
  r.nonfinite = h[1];
  std::memcpy(&r.emax, &h[2], 4);
  return r;
}
// Tolerance (normalized error |x - r| / (|r| + rms)) of an output of type t from inputs
// of type ta: accumulation order (FP8: wgmma's fast accumulation) plus the output's
// rounding (FP8 D: half a step of 3 or 2 mantissa bits, 1/16 or 1/8).
static float tol_t(int ta, int t) {
  float base = t_fp8(ta) ? 5e-2f : 2e-3f;
  if (t == T_BF16) base += 8e-3f;
  if (t == T_F16) base += 2e-3f;
  if (t == T_E4M3) base += 0.07f;
  if (t == T_E5M2) base += 0.13f;
  return base;
}

static FResult run_fcase(const FCase &c, bool verbose = true) {
  FResult res;
  const bool fpacc = std::string(c.variant) == "fpacc";
  const Tile tile = pick_tile(c.m, c.n, fpacc);
  const int bn = c.bn ? c.bn : tile.bn;
  const int tx = epi_type(c.to);
  const size_t nd = (size_t)c.m * c.n;
  const bool gelu = c.epi & EPI_GELU, bias_on = c.epi & EPI_BIAS, accum = c.epi & EPI_ACCUM;
  const bool fp8_out = t_fp8(c.to), fp8_in = t_fp8(c.ta);
  void *A, *B, *D, *C = nullptr, *aux = nullptr, *bias = nullptr;
  float *R, *Pre, *Fin, *si;
  uint32_t *amax_own, *amax_ref;
  CK(cudaMalloc(&A, (size_t)c.m * c.k * t_bytes(c.ta)));
  CK(cudaMalloc(&B, (size_t)c.n * c.k * t_bytes(c.tb)));
  CK(cudaMalloc(&D, nd * t_bytes(c.to) + 16));
  CK(cudaMalloc(&R, nd * 4));
  CK(cudaMalloc(&Pre, nd * 4));
  CK(cudaMalloc(&Fin, nd * 4));
  CK(cudaMalloc(&si, 256 * sizeof(float)));
  CK(cudaMalloc(&amax_own, 64));
  CK(cudaMalloc(&amax_ref, 64));
  CK(cudaMemset(amax_own, 0, 64));
  CK(cudaMemset(amax_ref, 0, 64));
  const uint64_t seed = 7000 + (uint64_t)c.m * 31 + (uint64_t)c.n * 17 + c.k + 101 * c.ta + 211 * c.tb + 307 * c.to;
  const float lo = c.stress ? 0.f : fp8_in ? -4.f : -1.f, hi = fp8_in ? 4.f : 1.f;
  fill_t(A, (size_t)c.m * c.k, c.ta, seed, lo, hi);
  fill_t(B, (size_t)c.n * c.k, c.tb, seed + 1, lo, hi);
  if (accum) {
    CK(cudaMalloc(&C, nd * t_bytes(c.to)));
    fill_t(C, nd, c.to, seed + 2, -4.f, 4.f);
    CK(cudaMemcpy(D, C, nd * t_bytes(c.to), cudaMemcpyDeviceToDevice));
  } else {
    fill_u32(D, (nd * t_bytes(c.to) + 3) / 4, fp8_out ? 0x7f7f7f7fu : 0x7fc07fc0u);
  }
  if (gelu) {
    CK(cudaMalloc(&aux, nd * t_bytes(tx) + 16));
    fill_u32(aux, (nd * t_bytes(tx) + 3) / 4, 0x7fc07fc0u);
  }
  if (bias_on) {
    CK(cudaMalloc(&bias, (size_t)c.m * t_bytes(tx)));
    fill_t(bias, c.m, tx, seed + 3, -2.f, 2.f);
  }
  const float hsi[2] = {fp8_in ? 0.5f : 1.f, fp8_in ? 0.25f : 1.f};
  CK(cudaMemcpy(si, hsi, sizeof(float), cudaMemcpyHostToDevice));
  CK(cudaMemcpy(si + 64, hsi + 1, sizeof(float), cudaMemcpyHostToDevice));
  const float scale = hsi[0] * hsi[1];
  {
    int m = c.m, n = c.n, k = c.k, ta = c.ta, tb = c.tb, l = c.layout;
    launch(M.ref_gemm_t, (m + 63) / 64, (n + 63) / 64, 16, 16, 0, 0,
           {&A, &B, &R, &m, &n, &k, (void *)&scale, &ta, &tb, &l});
  }
  // The reference epilogue; for FP8 D first without saturation to choose d_scale so that
  // values beyond 3 rms saturate.
  float beta = 1.f, d_scale = 1.f, sat = 0.f;
  auto ref_epi = [&](float dsc, float st) {
    int tc = c.to, tbias = tx, epi = c.epi, m = c.m;
    uint64_t cnt = nd;
    CK(cudaMemset(amax_ref, 0, 4));
    launch(M.ref_epi, 1024, 1, 256, 1, 0, 0,
           {&R, &Pre, &Fin, &C, &tc, &bias, &tbias, &beta, &epi, &m, &cnt, &dsc, &st, &amax_ref});
  };
  ref_epi(1.f, 0.f);
  const double rms_pre = rms_t(Pre, T_F32, nd);
  if (fp8_out) {
    d_scale = (float)(fp8_max(c.to) / (3.0 * rms_pre + 1e-30));
    sat = fp8_max(c.to);
    ref_epi(d_scale, sat);
  }
  CK(cudaMemcpy(si + 128, &d_scale, sizeof(float), cudaMemcpyHostToDevice));
  CK(cudaDeviceSynchronize());

  // Our kernel.
  CUtensorMap tmb, tma;
  const bool mapped = tmap_t(tmb, B, c.tb, c.layout == L_NT, c.n, c.k, 128) &&
                      tmap_t(tma, A, c.ta, c.layout != L_TN, c.m, c.k, bn);
  const std::string name = own_name(c.layout, c.ta, c.tb, c.to, bn, c.variant);
  if (mapped) {
    Gemm90Args g;
    std::memset(&g, 0, sizeof g);
    g.d = D;
    g.bias = bias;
    g.aux = aux;
    g.a_scale_inv = si;
    g.b_scale_inv = si + 64;
    g.d_scale = fp8_out ? si + 128 : nullptr;
    g.d_amax = c.amax ? reinterpret_cast<float *>(amax_own) : nullptr;
    g.m = c.m;
    g.n = c.n;
    g.k = c.k;
    g.group_n = tile.group_n;
    g.beta = beta;
    g.epilogue = c.epi;
    const int tiles = ((c.n + 127) / 128) * ((c.m + bn - 1) / bn);
    launch(own_kernel(name, bn), std::min(tiles, g_sms), 1, THREADS, 1, smem_of(bn), 0, {&tmb, &tma, &g});
    sync_or_hang(0, name.c_str(), 10);  // small shapes: a hang shows in 10 s
  }
  const float tol = tol_t(c.ta, c.to);
  const float rms = (float)rms_pre;
  Cmp cd = compare_t(D, c.to, fp8_out ? 1.f / d_scale : 1.f, Fin, nd, rms, tol);
  res.e_gpu = cd.emax;
  bool ok = mapped && cd.bad == 0;
  Cmp ca{};
  const float tol_aux = tol_t(c.ta, tx);
  if (gelu) {
    ca = compare_t(aux, tx, 1.f, Pre, nd, rms, tol_aux);
    res.e_aux = ca.emax;
    ok &= ca.bad == 0;
  }
  if (c.amax) {
    uint32_t a[2];
    CK(cudaMemcpy(&a[0], amax_own, 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(&a[1], amax_ref, 4, cudaMemcpyDeviceToHost));
    float fa[2];
    std::memcpy(fa, a, 8);
    res.e_amax = std::fabs((double)fa[0] - fa[1]) / (std::fabs((double)fa[1]) + 1e-30);
    ok &= res.e_amax <= (fp8_in ? 5e-2 : 1e-2);
  }

  // fp64 CPU samples: the whole chain (GEMM, epilogue, saturation) in double.
  {
    auto ha = to_host(A, (size_t)c.m * c.k * t_bytes(c.ta)), hb = to_host(B, (size_t)c.n * c.k * t_bytes(c.tb));
    auto hd = to_host(D, nd * t_bytes(c.to));
    std::vector<uint8_t> hc, hbias, haux;
    if (accum) hc = to_host(C, nd * t_bytes(c.to));
    if (bias_on) hbias = to_host(bias, (size_t)c.m * t_bytes(tx));
    if (gelu) haux = to_host(aux, nd * t_bytes(tx));
    const int samples = 384;
    uint64_t st = 0x9E3779B97F4A7C15ULL ^ seed;
    std::vector<double> pre(samples), fin(samples), dv(samples), av(samples);
    double ss = 0;
    for (int sidx = 0; sidx < samples; ++sidx) {
      st = st * 6364136223846793005ULL + 1442695040888963407ULL;
      const int r = (int)((st >> 33) % (uint64_t)c.n);
      st = st * 6364136223846793005ULL + 1442695040888963407ULL;
      const int col = (int)((st >> 33) % (uint64_t)c.m);
      double acc = 0;
      for (int kk = 0; kk < c.k; ++kk) {
        const size_t bi = c.layout == L_NT ? (size_t)kk * c.n + r : (size_t)r * c.k + kk;
        const size_t ai = c.layout == L_TN ? (size_t)col * c.k + kk : (size_t)kk * c.m + col;
        acc += h_val(hb, c.tb, bi) * h_val(ha, c.ta, ai);
      }
      const size_t off = (size_t)r * c.m + col;
      double v = acc * scale;
      if (accum) v += beta * h_val(hc, c.to, off);
      if (bias_on) v += h_val(hbias, tx, col);
      pre[sidx] = v;
      if (gelu) v = 0.5 * v * (1.0 + std::tanh(0.7978845608028654 * (v + 0.044715 * v * v * v)));
      if (fp8_out) v = std::min(std::max(v * d_scale, -(double)sat), (double)sat) / d_scale;
      fin[sidx] = v;
      dv[sidx] = h_val(hd, c.to, off) * (fp8_out ? 1.0 / d_scale : 1.0);
      if (gelu) av[sidx] = h_val(haux, tx, off);
      ss += pre[sidx] * pre[sidx];
    }
    const double rms64 = std::sqrt(ss / samples) + 1e-30;
    for (int sidx = 0; sidx < samples; ++sidx) {
      const double e = std::fabs(dv[sidx] - fin[sidx]) / (std::fabs(fin[sidx]) + rms64);
      res.e_cpu = std::isfinite(e) ? std::max(res.e_cpu, e) : INFINITY;
      if (gelu) {
        const double ea = std::fabs(av[sidx] - pre[sidx]) / (std::fabs(pre[sidx]) + rms64);
        res.e_aux = std::isfinite(ea) ? std::max(res.e_aux, ea) : INFINITY;
      }
    }
    ok &= res.e_cpu <= tol && (!gelu || res.e_aux <= tol_aux);
  }
  res.ok = ok;
  if (verbose || !ok) {
    std::printf("[%s] %s %dx%dx%d epi %d%s: vs fp32 ref bad %u (nonfinite %u) max e %.3g; fp64 samples max e %.3g",
                c.feature, name.c_str(), c.m, c.n, c.k, c.epi, c.amax ? " amax" : "", cd.bad, cd.nonfinite, cd.emax,
                res.e_cpu);
    if (gelu) std::printf("; aux bad %u max e %.3g", ca.bad, res.e_aux);
    if (c.amax) std::printf("; amax rel err %.3g", res.e_amax);
    if (fp8_out) std::printf("; d_scale %.4g", d_scale);
    std::printf(" -> %s\n", c.report_only ? "(reported only)" : ok ? "ok" : "FAIL");
    if (cd.bad && cd.first_bad != ~0ULL)
      std::printf("  first bad element: row %llu col %llu (tile %llu/%llu)\n",
                  (unsigned long long)(cd.first_bad / c.m), (unsigned long long)(cd.first_bad % c.m),
                  (unsigned long long)(cd.first_bad / c.m / 128), (unsigned long long)(cd.first_bad % c.m / bn));
    std::fflush(stdout);
  }
  for (void *p : {A, B, D, C, aux, bias, (void *)R, (void *)Pre, (void *)Fin, (void *)si, (void *)amax_own,
                  (void *)amax_ref})
    if (p) CK(cudaFree(p));
  return res;
}

// Every feature case at small and odd shapes (partial tiles in m, n and k; one row; a
// multi-tile square), each kernel at both tile widths where it has both.
static std::vector<FCase> feature_cases() {
  std::vector<FCase> v;
  const int shapes[][3] = {{192, 320, 144}, {1000, 77, 208}, {8, 1, 16}, {768, 640, 1024}};
  auto add = [&](const char *f, int l, int ta, int tb, int to, const char *var, int epi, bool amax, int m, int n,
                 int k, int bn) {
    FCase c{f, l, ta, tb, to, var, epi, amax, m, n, k};
    c.bn = bn;
    v.push_back(c);
  };
  // 1. types: every input pair x output type of the _epi kernels, epilogue 0.
  struct Ty {
    int ta, tb, to;
  };
  const Ty types[] = {{T_BF16, T_BF16, T_BF16}, {T_BF16, T_BF16, T_F32}, {T_F16, T_F16, T_F16},
                      {T_F16, T_F16, T_F32},    {T_E4M3, T_E4M3, T_BF16}, {T_E4M3, T_E4M3, T_F16},
                      {T_E4M3, T_E4M3, T_F32},  {T_E4M3, T_E5M2, T_BF16}, {T_E4M3, T_E5M2, T_F16},
                      {T_E4M3, T_E5M2, T_F32},  {T_E5M2, T_E4M3, T_BF16}, {T_E5M2, T_E4M3, T_F16},
                      {T_E5M2, T_E4M3, T_F32}};
  for (auto &t : types)
    for (int bn : {128, 256})
      for (int si = 0; si < 4; ++si) {
        if (si == 3 && bn == 128) continue;
        add("types", L_TN, t.ta, t.tb, t.to, "epi", 0, false, shapes[si][0], shapes[si][1], shapes[si][2], bn);
      }
  // 2. epilogues: bias, GELU with aux, bias + GELU, accumulate, bias + accumulate, for
  // every type combination of the _epi kernels (FP8 D: below).
  const int epis[] = {EPI_BIAS, EPI_GELU, EPI_BIAS | EPI_GELU, EPI_ACCUM, EPI_BIAS | EPI_ACCUM};
  for (auto &t : types)
    for (int epi : epis)
      for (int bn : {128, 256})
        add("epilogue", L_TN, t.ta, t.tb, t.to, "epi", epi, false, bn == 128 ? 1000 : 768, bn == 128 ? 77 : 640,
            bn == 128 ? 208 : 1024, bn);
  // 3. FP8 output with d_scale (saturating) and amax, plain and with bias + GELU; amax
  // also with a 16-bit D.
  for (int to : {T_E4M3, T_E5M2})
    for (int epi : {0, EPI_BIAS, EPI_BIAS | EPI_GELU})
      for (int bn : {128, 256})
        for (int si : {1, 3}) add("fp8-out", L_TN, T_E4M3, T_E4M3, to, "epi", epi, true, shapes[si][0],
                                  shapes[si][1], shapes[si][2], bn);
  add("fp8-out", L_TN, T_E4M3, T_E4M3, T_BF16, "epi", EPI_BIAS, true, 1000, 77, 208, 256);
  // 4. _fpacc: every instantiated kernel, epilogue 0 at three shapes, then each epilogue
  // (FP8 D: bias, bias + GELU; with amax) at the odd shape.
  const Ty fp[] = {{T_E4M3, T_E4M3, T_BF16}, {T_E4M3, T_E4M3, T_F16}, {T_E4M3, T_E4M3, T_F32},
                   {T_E4M3, T_E4M3, T_E4M3}, {T_E4M3, T_E5M2, T_BF16}, {T_E4M3, T_E5M2, T_F32},
                   {T_E5M2, T_E4M3, T_BF16}, {T_E5M2, T_E4M3, T_F32}};
  for (auto &t : fp) {
    for (int si : {0, 1, 3})
      add("fpacc", L_TN, t.ta, t.tb, t.to, "fpacc", 0, t_fp8(t.to), shapes[si][0], shapes[si][1], shapes[si][2], 128);
    for (int epi : epis)
      if (!t_fp8(t.to) || !(epi & EPI_ACCUM))
        add("fpacc", L_TN, t.ta, t.tb, t.to, "fpacc", epi, true, 1000, 77, 208, 128);
  }
  // 5. NN (A [k, m]) and NT (A [k, m], B [k, n]): n % 8 == 0 for NT, k of any size there.
  for (int l : {L_NN, L_NT})
    for (auto &t : {Ty{T_BF16, T_BF16, T_BF16}, Ty{T_BF16, T_BF16, T_F32}, Ty{T_F16, T_F16, T_F16},
                    Ty{T_F16, T_F16, T_F32}})
      for (int bn : {128, 256}) {
        const int nodd = l == L_NT ? 88 : 77, kodd = l == L_NT ? 203 : 200;
        add("layout", l, t.ta, t.tb, t.to, "epi", 0, false, 1000, nodd, kodd, bn);
        add("layout", l, t.ta, t.tb, t.to, "epi", 0, false, 192, 320, 144, bn);
        add("layout", l, t.ta, t.tb, t.to, "epi", 0, false, 8, 8, 16, bn);
        add("layout", l, t.ta, t.tb, t.to, "epi", 0, false, 768, 640, 1024, bn);
        // Every epilogue (TE: dgrad with bias + GELU on NN, wgrad accumulating on NT).
        for (int epi : epis) add("layout", l, t.ta, t.tb, t.to, "epi", epi, false, 1000, nodd, kodd, bn);
      }
  return v;
}

// Full-precision FP8 accumulation against wgmma's fast one on data that stresses it:
// k = 8192, all products positive (the sum grows to ~4e3 after scaling, so the fast
// accumulator's dropped low bits add up). Both kernels see the same inputs; the fp64
// samples' max normalized error of the _fpacc kernel must be clearly smaller (< 1/4).
static bool fpacc_precision_test(double &e_fast, double &e_full) {
  FCase fast{"fpacc-precision", L_TN, T_E4M3, T_E4M3, T_F32, "epi", 0, false, 512, 256, 8192};
  fast.bn = 128;
  fast.stress = true;
  fast.report_only = true;
  FCase full = fast;
  full.variant = "fpacc";
  full.report_only = false;
  FResult a = run_fcase(fast), b = run_fcase(full);
  e_fast = a.e_cpu;
  e_full = b.e_cpu;
  const bool ok = b.ok && e_full * 4 < e_fast;
  std::printf("fpacc precision (e4m3, 512x256x8192, positive data, f32 out): fp64-sample max e fast %.3g, "
              "full precision %.3g (%.1fx smaller) -> %s\n",
              e_fast, e_full, e_full > 0 ? e_fast / e_full : INFINITY, ok ? "ok" : "FAIL");
  return ok;
}

// Speed of the feature kernels against the plain fast path on one anchor shape (tp 4 of
// 8192 x 8192 x 28672: D [8192, 7168], k 8192), random data, median of `iters`; cuBLASLt
// (plain, fast accumulation) for reference. Printed as a markdown table.
static std::string g_speed_summary;  // "<types> <what>: ratio to plain; ..."
static void feature_timing(Lt &lt, int iters, cudaStream_t s) {
  const int m = 7168, n = 8192, k = 8192;
  struct T {
    const char *what;
    int layout, ta, tb, to;
    const char *variant;  // "" plain
    int epi;
    bool amax;
  };
  const T rows[] = {
      {"plain", L_TN, T_BF16, T_BF16, T_BF16, "", 0, false},
      {"_epi, epilogue 0", L_TN, T_BF16, T_BF16, T_BF16, "epi", 0, false},
      {"_epi, bias", L_TN, T_BF16, T_BF16, T_BF16, "epi", EPI_BIAS, false},
      {"_epi, bias + GELU + aux", L_TN, T_BF16, T_BF16, T_BF16, "epi", EPI_BIAS | EPI_GELU, false},
      {"plain", L_TN, T_BF16, T_BF16, T_F32, "", 0, false},
      {"_epi, accumulate", L_TN, T_BF16, T_BF16, T_F32, "epi", EPI_ACCUM, false},
      {"_epi, epilogue 0", L_TN, T_F16, T_F16, T_F16, "epi", 0, false},
      {"plain", L_TN, T_E4M3, T_E4M3, T_BF16, "", 0, false},
      {"_epi, epilogue 0", L_TN, T_E4M3, T_E4M3, T_BF16, "epi", 0, false},
      {"_epi, bias + GELU + aux", L_TN, T_E4M3, T_E4M3, T_BF16, "epi", EPI_BIAS | EPI_GELU, false},
      {"_epi, e4m3 x e5m2", L_TN, T_E4M3, T_E5M2, T_BF16, "epi", 0, false},
      {"_epi, FP8 D + amax", L_TN, T_E4M3, T_E4M3, T_E4M3, "epi", 0, true},
      {"_fpacc (BN 128)", L_TN, T_E4M3, T_E4M3, T_BF16, "fpacc", 0, false},
      {"plain", L_TN, T_BF16, T_BF16, T_BF16, "", 0, false},
      {"_epi NN, epilogue 0", L_NN, T_BF16, T_BF16, T_BF16, "epi", 0, false},
      {"plain", L_TN, T_BF16, T_BF16, T_F32, "", 0, false},
      {"_epi NT, accumulate", L_NT, T_BF16, T_BF16, T_F32, "epi", EPI_ACCUM, false},
  };
  void *A, *B, *D, *aux, *bias;
  float *si;
  CK(cudaMalloc(&A, (size_t)m * k * 2));
  CK(cudaMalloc(&B, (size_t)n * k * 2));
  CK(cudaMalloc(&D, (size_t)m * n * 4));
  CK(cudaMalloc(&aux, (size_t)m * n * 2));
  CK(cudaMalloc(&bias, (size_t)m * 4));
  CK(cudaMalloc(&si, 256 * sizeof(float)));
  fill_u32(si, 256, 0x3f800000u);  // all scales 1
  fill_u32(bias, m, 0);
  std::printf("\n## feature kernels vs the plain fast path, %dx%dx%d (tokens x K x N/tp at tp 4)\n\n", n, k, m);
  std::printf("| A x B -> D | layout | kernel | BN | ms | TFLOP/s | vs plain (same types) | vs cuBLASLt plain |\n");
  std::printf("|---|---|---|---|---|---|---|---|\n");
  double plain_ms[5] = {0, 0, 0, 0, 0};  // by D type, of the last plain row
  int last_in = -1, last_b = -1;
  double lt_ms = 0;
  for (const T &r : rows) {
    const bool fp8 = t_fp8(r.ta);
    if (r.ta != last_in) {
      // Fresh inputs of this type (and cuBLASLt's plain time for bf16 / e4m3).
      fill_t(A, (size_t)m * k, r.ta, 77, fp8 ? -4.f : -1.f, fp8 ? 4.f : 1.f);
      fill_t(B, (size_t)n * k, r.tb, 78, fp8 ? -4.f : -1.f, fp8 ? 4.f : 1.f);
      lt_ms = 0;
      if ((r.ta == T_BF16 || r.ta == T_E4M3) && r.ta == r.tb && lt.setup(fp8, false, m, n, k, si, si + 64) &&
          lt.first_run(A, B, D, s))
        lt_ms = time_ms({[&](cudaStream_t st) { lt.run(A, B, D, st); }}, iters, s)[0];
      last_in = r.ta;
      last_b = r.tb;
    }
    if (r.tb != last_b) {
      fill_t(B, (size_t)n * k, r.tb, 78, fp8 ? -4.f : -1.f, fp8 ? 4.f : 1.f);
      last_b = r.tb;
    }
    const bool fpacc = std::string(r.variant) == "fpacc";
    const int bn = pick_tile(m, n, fpacc).bn, group = pick_tile(m, n, fpacc).group_n;
    CUtensorMap tmb, tma;
    if (!tmap_t(tmb, B, r.tb, r.layout == L_NT, n, k, 128) || !tmap_t(tma, A, r.ta, r.layout != L_TN, m, k, bn))
      continue;
    const std::string name = own_name(r.layout, r.ta, r.tb, r.to, bn, r.variant);
    CUfunction f = own_kernel(name, bn);
    Gemm90Args g;
    std::memset(&g, 0, sizeof g);
    g.d = D;
    g.a_scale_inv = si;
    g.b_scale_inv = si + 64;
    if (*r.variant) {
      g.bias = bias;
      g.aux = aux;
      g.d_scale = si + 128;
      g.d_amax = r.amax ? si + 192 : nullptr;
      g.beta = 1.f;
      g.epilogue = r.epi;
    }
    g.m = m;
    g.n = n;
    g.k = k;
    g.group_n = group;
    const int tiles = ((n + 127) / 128) * ((m + bn - 1) / bn);
    fill_u32(D, (size_t)m * n, 0);
    CK(cudaDeviceSynchronize());
    const float ms = time_ms({[&](cudaStream_t st) {
                               launch(f, std::min(tiles, g_sms), 1, THREADS, 1, smem_of(bn), st, {&tmb, &tma, &g});
                             }},
                             iters, s)[0];
    sync_or_hang(s, name.c_str());
    if (!*r.variant) plain_ms[r.to] = ms;
    const double fl = 2.0 * m * n * (double)k;
    const double base = plain_ms[t_fp8(r.to) ? T_BF16 : r.to];
    std::printf("| %s x %s -> %s | %s | %s (%s) | %d | %.3f | %.0f | %s | %s |\n", T_NAME[r.ta], T_NAME[r.tb],
                T_NAME[r.to], L_NAME[r.layout], r.what, name.c_str(), bn, ms, fl / ms / 1e9,
                base > 0 ? std::to_string(base / ms).substr(0, 5).c_str() : "-",
                lt_ms > 0 ? std::to_string(lt_ms / ms).substr(0, 5).c_str() : "-");
    std::fflush(stdout);
    if (*r.variant && base > 0) {
      char b[160];
      std::snprintf(b, sizeof b, " %s%s%s -> %s %s: %.3f;", T_NAME[r.ta], r.ta == r.tb ? "" : " x ",
                    r.ta == r.tb ? "" : T_NAME[r.tb], T_NAME[r.to], r.what, base / ms);
      g_speed_summary += b;
    }
  }
  for (void *p : {A, B, D, aux, bias, (void *)si}) CK(cudaFree(p));
}

// AG-style arrival: B starts as other data, flags at 0; the kernel is launched, then a
// second stream (copy engine, after a 50 ms host delay so that the kernel is already
// waiting) copies row block r of the true B and then sets flag r, blocks in the order
// 2, 0, 3, 1; tiles are rotated so that block 2's tiles come first. The result must
// match the reference; a kernel still running 30 s later counts as a hang.
// RS hook: with done signals on, every row block's flag ends at done_value and every
// counter back at zero (so a second launch, with the next value, signals again), and D is
// still right. Run twice (values 1 and 2) for row blocks aligned and not aligned to the
// 128-row tiles; a consumer stream waits on the last block's signal (cuStreamWaitValue32)
// and copies it out, and that copy must equal the reference.
static bool done_signal_test(int m, int n, int k) {
  void *A, *B, *D, *Blk;
  float *R;
  uint32_t *done;
  CK(cudaMalloc(&A, (size_t)m * k * 2));
  CK(cudaMalloc(&B, (size_t)n * k * 2));
  CK(cudaMalloc(&D, (size_t)m * n * 2));
  CK(cudaMalloc(&Blk, (size_t)m * n * 2));
  CK(cudaMalloc(&R, (size_t)m * n * 4));
  CK(cudaMalloc(&done, 4096 * sizeof(uint32_t)));
  fill(A, (size_t)m * k, false, 21);
  fill(B, (size_t)n * k, false, 22);
  float one = 1.f;
  launch(M.ref_bf16, (m + 63) / 64, (n + 63) / 64, 16, 16, 0, 0, {&A, &B, &R, &m, &n, &k, &one});
  cudaStream_t s1, s2;
  CK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
  bool ok = true;
  for (int rows : {n / 4, 300}) {
    const int nblk = (n + rows - 1) / rows;
    fill_u32(done, 2 * nblk, 0);
    for (uint32_t v = 1; v <= 2; ++v) {
      fill_u32(D, (size_t)m * n / 2, 0x7fc07fc0u);
      fill_u32(Blk, (size_t)m * n / 2, 0x7fc07fc0u);
      CK(cudaDeviceSynchronize());
      Own own;
      own.fp8 = false;
      own.out_f32 = false;
      own.m = m;
      own.n = n;
      own.k = k;
      own.bn = 256;
      own.A = A;
      own.B = B;
      own.D = D;
      own.done = done;
      own.done_rows = rows;
      own.done_value = v;
      if (!own.prepare()) die("tensor map for the done-signal test", __FILE__, __LINE__);
      // The consumer first: it waits for the last block, then copies it.
      const int j = nblk - 1;
      const size_t off = (size_t)j * rows * m * 2, bytes = (size_t)(n - j * rows) * m * 2;
      CU(drv.StreamWaitValue32((CUstream)s2, (CUdeviceptr)(done + j), v, CU_STREAM_WAIT_VALUE_EQ));
      CK(cudaMemcpyAsync((char *)Blk + off, (char *)D + off, bytes, cudaMemcpyDeviceToDevice, s2));
      own.run(s1);
      sync_or_hang(s1, "our kernel (done signals)");
      sync_or_hang(s2, "the consumer of the last block's done signal");
      std::vector<uint32_t> h(2 * nblk);
      CK(cudaMemcpy(h.data(), done, h.size() * 4, cudaMemcpyDeviceToHost));
      int bad_flags = 0;
      for (int b = 0; b < nblk; ++b) bad_flags += h[b] != v || h[nblk + b] != 0;
      const float rms = (float)rms_of(R, true, (size_t)m * n);
      Cmp c = compare(D, false, R, true, (size_t)m * n, rms, tol_of(false, false));
      Cmp cb = compare((char *)Blk + off, false, (const char *)R + (size_t)j * rows * m * 4, true,
                       bytes / 2, rms, tol_of(false, false));
      const bool good = bad_flags == 0 && c.bad == 0 && cb.bad == 0;
      std::printf("done-signal test (%dx%dx%d, %d blocks of %d rows, value %u): %d bad signals, %u bad in D, "
                  "%u bad in the consumer's copy -> %s\n",
                  m, n, k, nblk, rows, v, bad_flags, c.bad, cb.bad, good ? "ok" : "FAIL");
      ok &= good;
    }
  }
  CK(cudaStreamDestroy(s1));
  CK(cudaStreamDestroy(s2));
  for (void *p : {A, B, D, Blk, (void *)R, (void *)done}) CK(cudaFree(p));
  return ok;
}

// With `missing` >= 0, row block `missing` never arrives (neither its data nor its flag):
// the waits give up after 200 ms (the stall record, host-mapped), the kernel must end
// within 30 s all the same, the record must name the missing block's flag and a wait of
// at least 200 ms, and every row of D outside that block must still be right.
static bool flag_arrival_test(int m, int n, int k, int tp, int missing = -1) {
  const size_t nb = (size_t)n * k * 2;
  void *A, *B, *D;
  float *R;
  uint32_t *flags;
  CK(cudaMalloc(&A, (size_t)m * k * 2));
  CK(cudaMalloc(&B, nb));
  CK(cudaMalloc(&D, (size_t)m * n * 2));
  CK(cudaMalloc(&R, (size_t)m * n * 4));
  CK(cudaMalloc(&flags, tp * sizeof(uint32_t)));
  fill(A, (size_t)m * k, false, 11);
  fill(B, (size_t)n * k, false, 12);
  float one = 1.f;
  launch(M.ref_bf16, (m + 63) / 64, (n + 63) / 64, 16, 16, 0, 0, {&A, &B, &R, &m, &n, &k, &one});
  uint16_t *hB;
  uint32_t *hone;
  CK(cudaMallocHost(&hB, nb));
  CK(cudaMallocHost(&hone, sizeof(uint32_t)));
  *hone = 1;
  uint32_t *stall_h = nullptr, *stall_d = nullptr;  // {flag + 1, claim, waited ns}
  CK(cudaHostAlloc((void **)&stall_h, 16, cudaHostAllocMapped));
  std::memset(stall_h, 0, 16);
  CK(cudaHostGetDevicePointer((void **)&stall_d, stall_h, 0));
  CK(cudaMemcpy(hB, B, nb, cudaMemcpyDeviceToHost));
  fill(B, (size_t)n * k, false, 99);  // stale data until the blocks arrive
  fill_u32(flags, tp, 0);
  fill_u32(D, (size_t)m * n / 2, 0x7fc07fc0u);
  CK(cudaDeviceSynchronize());

  cudaStream_t s1, s2;
  CK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
  const int rpf = n / tp;
  const int order[4] = {2, 0, 3, 1};
  Own own;
  own.fp8 = false;
  own.out_f32 = false;
  own.m = m;
  own.n = n;
  own.k = k;
  own.bn = 256;
  own.A = A;
  own.B = B;
  own.D = D;
  own.flags = flags;
  own.rows_per_flag = rpf;
  own.rot = (order[0] * rpf) / 128;
  if (missing >= 0) {
    own.stall = stall_d;
    own.stall_ns = 200ull * 1000 * 1000;
  }
  if (!own.prepare()) die("tensor map for the flag arrival test", __FILE__, __LINE__);
  own.run(s1);
  CK(cudaLaunchHostFunc(
      s2, [](void *) { std::this_thread::sleep_for(std::chrono::milliseconds(50)); }, nullptr));
  for (int i = 0; i < tp; ++i) {
    const int r = order[i % 4] % tp;
    if (r == missing) continue;
    CK(cudaMemcpyAsync((char *)B + (size_t)r * rpf * k * 2, (char *)hB + (size_t)r * rpf * k * 2,
                       (size_t)rpf * k * 2, cudaMemcpyHostToDevice, s2));
    CK(cudaMemcpyAsync(flags + r, hone, sizeof(uint32_t), cudaMemcpyHostToDevice, s2));
  }
  const auto t0 = std::chrono::steady_clock::now();
  while (cudaStreamQuery(s1) == cudaErrorNotReady) {
    if (std::chrono::steady_clock::now() - t0 > std::chrono::seconds(30)) {
      std::printf("flag arrival test: HANG (kernel still waiting after 30 s)\n");
      std::fflush(stdout);
      std::_Exit(1);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  CK(cudaStreamSynchronize(s1));
  CK(cudaStreamSynchronize(s2));
  CK(cudaGetLastError());
  const float rms = (float)rms_of(R, true, (size_t)m * n);
  bool good;
  if (missing < 0) {
    Cmp c = compare(D, false, R, true, (size_t)m * n, rms, tol_of(false, false));
    print_bad(c, D, false, R, m, 256);
    good = c.bad == 0;
    std::printf("flag arrival test (%dx%dx%d, %d row blocks arriving by copy engine during the kernel): "
                "%u bad, max e %.3g -> %s\n",
                m, n, k, tp, c.bad, c.emax, good ? "ok" : "FAIL");
  } else {
    // Rows [0, missing * rpf) and [(missing + 1) * rpf, n) arrived.
    unsigned bad = 0;
    const size_t lo = (size_t)missing * rpf * m, hi = (size_t)(missing + 1) * rpf * m;
    bad += compare(D, false, R, true, lo, rms, tol_of(false, false)).bad;
    bad += compare((char *)D + hi * 2, false, (const char *)R + hi * 4, true, (size_t)m * n - hi, rms,
                   tol_of(false, false)).bad;
    const uint32_t code = *(volatile uint32_t *)stall_h;
    const double waited_ms = (double)*(volatile unsigned long long *)(stall_h + 2) / 1e6;
    good = bad == 0 && code == (uint32_t)missing + 1 && waited_ms >= 200.0;
    std::printf("flag give-up test (%dx%dx%d, row block %d of %d never arrives, waits give up after 200 ms): "
                "record flag %d, waited %.1f ms, %u bad rows elsewhere -> %s\n",
                m, n, k, missing, tp, (int)code - 1, waited_ms, bad, good ? "ok" : "FAIL");
  }
  CK(cudaFreeHost(hB));
  CK(cudaFreeHost(hone));
  CK(cudaFreeHost(stall_h));
  CK(cudaStreamDestroy(s1));
  CK(cudaStreamDestroy(s2));
  CK(cudaFree(A));
  CK(cudaFree(B));
  CK(cudaFree(D));
  CK(cudaFree(R));
  CK(cudaFree(flags));
  return good;
}

int main(int argc, char **argv) {
  g90::g_prog = "own_gemm";
  std::string kernel_path = "kernels/gemm_sm90.cu";
  int iters = 30, force_bn = 0, group = 0;
  bool quick = false, compile_only = false, fp8 = true, features = true, plain = true, give_up = true;
  int only[4] = {0, 0, 0, -1};  // --shape N,K,M,DT: only this timed case (DT 0 bf16, 1 e4m3)
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> const char * {
      if (i + 1 >= argc) die(("missing value after " + a).c_str(), __FILE__, __LINE__);
      return argv[++i];
    };
    if (a == "--kernel") kernel_path = next();
    else if (a == "--iters") iters = std::max(1, std::atoi(next()));
    else if (a == "--bn") force_bn = std::atoi(next());
    else if (a == "--group") group = std::max(1, std::atoi(next()));
    else if (a == "--quick") quick = true;
    else if (a == "--no-give-up") give_up = false;
    else if (a == "--compile-only") compile_only = true;
    else if (a == "--no-fp8") fp8 = false;
    else if (a == "--no-features") features = false;
    else if (a == "--features-only") plain = false;
    else if (a == "--define") g_defines.push_back(next());
    else if (a == "--shape") {
      // for profilers: one timed case only (no small shapes, tests or features)
      if (std::sscanf(next(), "%d,%d,%d,%d", &only[0], &only[1], &only[2], &only[3]) != 4)
        die("--shape takes TOKENS,K,M,DTYPE (DTYPE 0 bf16, 1 e4m3)", __FILE__, __LINE__);
      plain = features = false;
    } else {
      std::printf("usage: own_gemm [--kernel FILE] [--iters N] [--bn 128|192|256] [--group G] [--quick] "
                  "[--no-give-up] [--compile-only] [--no-fp8] [--no-features] [--features-only] [--define NAME=VALUE ...] "
                  "[--shape TOKENS,K,M,DTYPE]\n");
      return a == "--help" ? 0 : 2;
    }
  }
  if (force_bn != 0 && force_bn != 128 && force_bn != 256 && force_bn != 192)
    die("--bn takes 128, 192 or 256", __FILE__, __LINE__);
  const std::string src = read_text(kernel_path);

  std::string arch = "sm_90a";
  if (!compile_only) {
    CK(cudaSetDevice(0));
    CK(cudaFree(nullptr));
    cudaDeviceProp p;
    CK(cudaGetDeviceProperties(&p, 0));
    g_sms = p.multiProcessorCount;
    if (p.major != 9) {
      std::printf("own_gemm: needs a Hopper GPU (sm_90a); device 0 is %s (sm_%d%d)\n", p.name, p.major, p.minor);
      return 2;
    }
    std::printf("device: %s, %d SMs; NVRTC for %s\n", p.name, g_sms, arch.c_str());
  }
  auto cubin = nvrtc_compile(src, "gemm_sm90.cu", arch, true);
  auto ref_cubin = nvrtc_compile(REF_SRC, "own_gemm_ref.cu", arch, false);
  std::printf("compiled: gemm_sm90.cu %zu bytes, reference kernels %zu bytes\n", cubin.size(), ref_cubin.size());
  if (compile_only) return 0;

  load_driver();
  // The plain kernels and their shared memory: the module loader the other benchmarks use.
  g90::gemm_mod.load(cubin);
  M.gemm = g90::gemm_mod.mod;
  CU(drv.ModuleLoadData(&M.ref, ref_cubin.data()));
  for (int w = 0; w < 3; ++w) std::printf("gemm_sm90_smem_bytes_%d = %d\n", bn_of(w), g90::gemm_mod.smem[w]);
  if (!has_pp()) std::printf("no BN-192 (ping-pong) kernels in this kernel file: widths 128 and 256 only\n");
  if (force_bn == 192 && !has_pp()) die("--bn 192: the kernel file has no BN-192 kernels", __FILE__, __LINE__);
  const char *in_names[2] = {"bf16", "e4m3"}, *out_names[2] = {"bf16", "f32"};
  CU(drv.ModuleGetFunction(&M.fill_bf16, M.ref, "fill_bf16"));
  CU(drv.ModuleGetFunction(&M.fill_e4m3, M.ref, "fill_e4m3"));
  CU(drv.ModuleGetFunction(&M.fill_u32, M.ref, "fill_u32"));
  CU(drv.ModuleGetFunction(&M.ref_bf16, M.ref, "ref_gemm_bf16"));
  CU(drv.ModuleGetFunction(&M.ref_e4m3, M.ref, "ref_gemm_e4m3"));
  CU(drv.ModuleGetFunction(&M.sum_sq, M.ref, "sum_sq"));
  CU(drv.ModuleGetFunction(&M.compare, M.ref, "compare"));
  CU(drv.ModuleGetFunction(&M.fill_t, M.ref, "fill_t"));
  CU(drv.ModuleGetFunction(&M.ref_gemm_t, M.ref, "ref_gemm_t"));
  CU(drv.ModuleGetFunction(&M.ref_epi, M.ref, "ref_epi"));
  CU(drv.ModuleGetFunction(&M.sum_sq_t, M.ref, "sum_sq_t"));
  CU(drv.ModuleGetFunction(&M.compare_t, M.ref, "compare_t"));

  Lt lt;
  lt.init();
  // A blocking stream: the fills, reference and compare kernels run on the legacy default
  // stream and must stay ordered with our kernel and cuBLASLt.
  cudaStream_t s;
  CK(cudaStreamCreate(&s));

  // Small and odd shapes, every kernel (both tile widths, both outputs, both inputs):
  // partial tiles in m, n and k, one row, a single tile, multi-wave squares with other
  // rasterization groups and rotations.
  std::vector<Case> cases;
  if (plain && only[3] < 0) {  // --shape: that case alone (profilers count launches)
  // (8192 x 4096 x 64: many tiles a CTA with one K block each, fewer than the stages: the
  // ping-pong kernel's order barriers.)
  const int small[][3] = {{128, 128, 64}, {256, 128, 128}, {192, 320, 144}, {1000, 77, 208},
                          {8, 1, 16},     {384, 1000, 1024}, {4096, 4096, 4096}, {8192, 4096, 64}};
  for (auto &sh : small)
    for (int f8 = 0; f8 < (fp8 ? 2 : 1); ++f8)
      for (int o = 0; o < 2; ++o)
        for (int bn : {128, 256, 192}) {
          if (bn == 192 && (o == 1 || !has_pp())) continue;  // BN 192: bf16 out only
          Case c{sh[0], sh[1], sh[2], 0, f8 == 1, o == 1, bn};
          cases.push_back(c);
        }
  {
    Case c{4096, 4096, 4096, 0, false, false, 256};
    c.group_n = 3;
    c.rot = 5;
    cases.push_back(c);
    c.group_n = 1;
    c.rot = 31;
    cases.push_back(c);
  }
  // The per-rank anchor shapes of issue 22 (tokens x K x N/tp): n = tokens, k = K, m = N/tp.
  if (!quick)
    for (int f8 = 0; f8 < (fp8 ? 2 : 1); ++f8)
      for (int tp : {2, 4, 8})
        for (auto sh : {std::array<int, 3>{8192, 8192, 28672}, std::array<int, 3>{8192, 4096, 16384},
                        std::array<int, 3>{16384, 8192, 8192}}) {
          Case c{sh[2] / tp, sh[0], sh[1], tp, f8 == 1, false, force_bn};
          c.group_n = group ? group : pick_tile(c.m, c.n, false).group_n;
          c.timed = true;
          cases.push_back(c);
        }
  }

  if (only[3] >= 0) {
    Case c{only[2], only[0], only[1], 1, only[3] == 1, false, force_bn};
    c.group_n = group ? group : pick_tile(c.m, c.n, false).group_n;
    c.timed = true;
    cases.push_back(c);
  }
  bool all_ok = true;
  std::vector<Row> rows;
  for (size_t i = 0; i < cases.size(); ++i) {
    const Case &c = cases[i];
    std::printf("case %zu/%zu: %s %dx%dx%d -> %s bn %d\n", i + 1, cases.size(), in_names[c.fp8], c.m, c.n, c.k,
                out_names[c.out_f32], c.bn ? c.bn : pick_plain(c.m, c.n, c.k, c.fp8, c.out_f32));
    std::fflush(stdout);
    Row r = run_case(c, lt, iters, s);
    std::printf("%-5s %5dx%5dx%5d -> %-4s bn %d group %d rot %d: vs fp32 ref bad %u (nonfinite %u) max e %.3g; "
                "fp64 samples: ours %.3g ref %.3g; vs cuBLASLt max e %s%.3g -> %s\n",
                in_names[c.fp8], c.m, c.n, c.k, out_names[c.out_f32], r.bn, c.group_n, c.rot, r.vs_ref.bad,
                r.vs_ref.nonfinite, r.vs_ref.emax, r.cpu.e_own, r.cpu.e_ref, r.lt_ok ? "" : "(no algo) ",
                r.vs_lt.emax, r.ok ? "ok" : "FAIL");
    std::fflush(stdout);
    all_ok &= r.ok;
    rows.push_back(r);
  }
  bool flags_ok = true, done_ok = true;
  if (plain) {
    flags_ok = flag_arrival_test(2048, 4096, 4096, 4);
    if (give_up) flags_ok &= flag_arrival_test(2048, 4096, 4096, 4, 1);
    all_ok &= flags_ok;
    done_ok = done_signal_test(2048, 4096, 1024);
    all_ok &= done_ok;
  }

  // The kernels beyond the plain fast path, feature by feature.
  std::vector<std::pair<std::string, std::array<int, 2>>> feat;  // feature -> {cases, ok}
  double e_fast = 0, e_full = 0;
  bool prec_ok = true;
  std::vector<std::string> failed;  // the first failing feature cases
  if (features) {
    const auto fc = feature_cases();
    std::printf("feature cases: %zu\n", fc.size());
    // The layout cases last (after the precision test): a fully out-of-bounds MN-major
    // box that never completes would hang, and a hang ends the run.
    for (int pass = 0; pass < 2; ++pass) {
      if (pass == 1) {
        prec_ok = fpacc_precision_test(e_fast, e_full);
        all_ok &= prec_ok;
      }
      for (const FCase &c : fc) {
        if ((std::string(c.feature) == "layout") != (pass == 1)) continue;
        const FResult r = run_fcase(c);
        if (!r.ok && failed.size() < 12) {
          char b[200];
          std::snprintf(b, sizeof b, "%s %dx%dx%d epi %d", own_name(c.layout, c.ta, c.tb, c.to,
                        c.bn ? c.bn : pick_tile(c.m, c.n, std::string(c.variant) == "fpacc").bn, c.variant).c_str(),
                        c.m, c.n, c.k, c.epi);
          failed.push_back(b);
        }
        size_t i = 0;
        while (i < feat.size() && feat[i].first != c.feature) ++i;
        if (i == feat.size()) feat.push_back({c.feature, {0, 0}});
        feat[i].second[0]++;
        feat[i].second[1] += r.ok;
        all_ok &= r.ok;
      }
    }
    if (!quick) feature_timing(lt, iters, s);
  }

  // Markdown last.
  std::printf("\n## own GEMM (kernels/gemm_sm90.cu) vs cuBLASLt, TN, D[n,m] = B[n,k] A[m,k]^T\n\n");
  std::printf("Median of %d back-to-back runs (CUDA events). Speed = cuBLASLt time / our time "
              "(> 1: ours faster). Flag cost = time with all arrival flags pre-set / time without flags. "
              "Done cost = time with done signals (4 per 1/tp of the rows, as the fused reduce-scatter's; "
              "nobody waits) / time without.\n\n",
              iters);
  std::printf("| in | tp | tokens x K x N/tp | BN | ours ms | cuBLASLt ms | ours TFLOP/s | cuBLASLt TFLOP/s | "
              "speed | flag cost | done cost | max err | ok |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  // Geometric means of the positive ratios added.
  struct Geomean {
    double logs = 0;
    int n = 0;
    void add(double x) {
      if (x > 0) logs += std::log(x), n++;
    }
    double get() const { return std::exp(logs / n); }
  };
  Geomean speed[2], flag_cost, done_cost;
  double worst[2] = {1e9, 1e9};
  for (auto &r : rows) {
    if (!r.c.timed) continue;
    const double fl = 2.0 * r.c.m * r.c.n * (double)r.c.k;
    const double sp = r.lt_ok && r.own_ms > 0 ? r.lt_ms / r.own_ms : 0;
    const double fc = r.own_ms > 0 ? r.own_flags_ms / r.own_ms : 0;
    const double dc = r.own_ms > 0 ? r.own_done_ms / r.own_ms : 0;
    std::printf("| %s | %d | %dx%dx%d | %d | %.3f | %.3f | %.0f | %.0f | %.3f | %.4f | %.4f | %.2g | %s |\n",
                in_names[r.c.fp8], r.c.tp, r.c.n, r.c.k, r.c.m, r.bn, r.own_ms, r.lt_ms, fl / r.own_ms / 1e9,
                r.lt_ok ? fl / r.lt_ms / 1e9 : 0.0, sp, fc, dc, r.vs_ref.emax, r.ok ? "yes" : "NO");
    speed[r.c.fp8].add(sp);
    if (sp > 0) worst[r.c.fp8] = std::min(worst[r.c.fp8], sp);
    flag_cost.add(fc);
    done_cost.add(dc);
  }
  std::printf("\n");
  for (int f8 = 0; f8 < 2; ++f8)
    if (speed[f8].n)
      std::printf("- %s: geomean speed vs cuBLASLt %.3f (bar: %s), worst %.3f (bar 0.80)\n", in_names[f8],
                  speed[f8].get(), f8 ? ">= 0.90" : ">= 0.95", worst[f8]);
  if (flag_cost.n) std::printf("- flag waits (pre-set): geomean cost %.4f (bar <= 1.01)\n", flag_cost.get());
  if (done_cost.n) std::printf("- done signals (nobody waiting): geomean cost %.4f\n", done_cost.get());
  int nsmall = 0, nsmall_ok = 0;
  for (auto &r : rows)
    if (!r.c.timed) {
      nsmall++;
      nsmall_ok += r.ok;
    }
  std::printf("- small/odd shapes: %d of %d correct; flag arrival test: %s; done-signal test: %s\n", nsmall_ok,
              nsmall, flags_ok ? "ok" : "FAIL", done_ok ? "ok" : "FAIL");
  for (auto &f : feat)
    std::printf("- feature %s: %d of %d correct\n", f.first.c_str(), f.second[1], f.second[0]);
  if (features)
    std::printf("- feature fpacc-precision: fp64-sample max e fast %.3g vs full precision %.3g (bar: < 1/4) -> %s\n",
                e_fast, e_full, prec_ok ? "ok" : "FAIL");
  if (!failed.empty()) {
    std::printf("- feature failures (first %zu):", failed.size());
    for (auto &f : failed) std::printf(" %s;", f.c_str());
    std::printf("\n");
  }
  if (!g_speed_summary.empty())
    std::printf("- feature speed vs the plain kernel (tp-4 anchor, 1 = same):%s\n", g_speed_summary.c_str());
  if (plain) {
    std::printf("- tile rule (BN bf16 / e4m3, group_n) on the anchors:");
    for (auto &r : rows)
      if (r.c.timed && !r.c.fp8) {
        const Tile t = pick_tile(r.c.m, r.c.n, false);
        std::printf(" %dx%dx%d: %d / %d, %d;", r.c.n, r.c.m, r.c.k, pick_plain(r.c.m, r.c.n, r.c.k, false, false),
                    pick_plain(r.c.m, r.c.n, r.c.k, true, false), t.group_n);
      }
    std::printf("\n");
  }
  std::printf("- overall: %s\n", all_ok ? "PASS" : "FAIL (wrong results)");
  return all_ok ? 0 : 1;
}
