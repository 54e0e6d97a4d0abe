// Shared helpers for the C++ GPU tests and benchmarks: CUDA checks, device buffers,
// TE tensors over them, host decoders for the narrow types, MPI-aware reporting.
#pragma once
#include <cuda_runtime.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "transformer_engine_comm.h"

#define CUDA_OK(x)                                                                          \
  do {                                                                                      \
    cudaError_t e_ = (x);                                                                   \
    if (e_ != cudaSuccess) {                                                                \
      std::fprintf(stderr, "%s:%d: %s failed: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      MPI_Abort(MPI_COMM_WORLD, 2);                                                         \
    }                                                                                       \
  } while (0)

namespace tu {

// CTest's skip code (SKIP_RETURN_CODE in CMakeLists.txt).
constexpr int kSkip = 77;

// Called before MPI_Init: with `--probe N`, exit 0 when N GPUs are usable, else print
// SKIPPED and exit kSkip. Lets the CTest wrapper skip without starting MPI.
inline void probe_or_continue(int argc, char **argv) {
  if (argc >= 3 && std::strcmp(argv[1], "--probe") == 0) {
    int need = std::atoi(argv[2]), have = 0;
    cudaError_t e = cudaGetDeviceCount(&have);
    if (e != cudaSuccess || have < need) {
      // Without any driver the runtime reports "driver version is insufficient"; it also
      // reports driver version 0 then, which tells the two cases apart.
      int driver = 0, runtime = 0;
      char why[256];
      if (e == cudaSuccess) {
        std::snprintf(why, sizeof why, "ok");
      } else if (cudaDriverGetVersion(&driver) == cudaSuccess && driver == 0) {
        std::snprintf(why, sizeof why, "no CUDA driver (libcuda.so.1) found");
      } else if (e == cudaErrorInsufficientDriver && cudaRuntimeGetVersion(&runtime) == cudaSuccess) {
        std::snprintf(why, sizeof why, "%s: driver supports CUDA %d.%d, runtime is %d.%d", cudaGetErrorString(e),
                      driver / 1000, driver % 1000 / 10, runtime / 1000, runtime % 1000 / 10);
      } else {
        std::snprintf(why, sizeof why, "%s", cudaGetErrorString(e));
      }
      std::printf("SKIPPED: needs %d CUDA GPU(s), found %d (%s)\n", need, e == cudaSuccess ? have : 0, why);
      std::exit(kSkip);
    }
    std::exit(0);
  }
}

// probe_or_continue for a test whose ranks may share GPUs: one GPU is enough for any
// rank count, whatever `--probe N` asks.
inline void probe_one_gpu_or_continue(int argc, char **argv) {
  if (argc >= 3 && std::strcmp(argv[1], "--probe") == 0) {
    char one[] = "1";
    char *pa[] = {argv[0], argv[1], one};
    probe_or_continue(3, pa);
  }
}

inline size_t dtype_bytes(NVTEDType t) {
  switch (t) {
    case kNVTEFloat32: case kNVTEInt32: return 4;
    case kNVTEFloat16: case kNVTEBFloat16: case kNVTEInt16: return 2;
    case kNVTEInt64: return 8;
    default: return 1;
  }
}

inline const char *dtype_name(NVTEDType t) {
  switch (t) {
    case kNVTEFloat32: return "f32";
    case kNVTEFloat16: return "f16";
    case kNVTEBFloat16: return "bf16";
    case kNVTEFloat8E4M3: return "e4m3";
    case kNVTEFloat8E5M2: return "e5m2";
    default: return "?";
  }
}

inline bool is_fp8(NVTEDType t) { return t == kNVTEFloat8E4M3 || t == kNVTEFloat8E5M2; }

inline double decode_f16(uint16_t h) {
  int s = h >> 15, e = (h >> 10) & 31, m = h & 1023;
  double v;
  if (e == 0) v = std::ldexp((double)m, -24);
  else if (e == 31) v = m ? NAN : INFINITY;
  else v = std::ldexp(1.0 + m / 1024.0, e - 15);
  return s ? -v : v;
}
inline double decode_bf16(uint16_t b) {
  uint32_t u = (uint32_t)b << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline double decode_e4m3(uint8_t b) {
  int s = b >> 7, e = (b >> 3) & 15, m = b & 7;
  if (e == 15 && m == 7) return NAN;
  double v = e == 0 ? std::ldexp((double)m, -9) : std::ldexp(1.0 + m / 8.0, e - 7);
  return s ? -v : v;
}
inline double decode_e5m2(uint8_t b) {
  int s = b >> 7, e = (b >> 2) & 31, m = b & 3;
  double v;
  if (e == 31) v = m ? NAN : INFINITY;
  else v = e == 0 ? std::ldexp((double)m, -16) : std::ldexp(1.0 + m / 4.0, e - 15);
  return s ? -v : v;
}

// Decode raw device bytes of dtype `t` into doubles.
inline std::vector<double> decode(const std::vector<uint8_t> &raw, NVTEDType t, size_t n) {
  std::vector<double> out(n);
  for (size_t i = 0; i < n; ++i) {
    switch (t) {
      case kNVTEFloat32: { float f; std::memcpy(&f, &raw[4 * i], 4); out[i] = f; break; }
      case kNVTEFloat16: { uint16_t h; std::memcpy(&h, &raw[2 * i], 2); out[i] = decode_f16(h); break; }
      case kNVTEBFloat16: { uint16_t h; std::memcpy(&h, &raw[2 * i], 2); out[i] = decode_bf16(h); break; }
      case kNVTEFloat8E4M3: out[i] = decode_e4m3(raw[i]); break;
      case kNVTEFloat8E5M2: out[i] = decode_e5m2(raw[i]); break;
      default: out[i] = NAN;
    }
  }
  return out;
}

struct DevBuf {
  void *p = nullptr;
  size_t bytes = 0;
  DevBuf() = default;
  explicit DevBuf(size_t b) : bytes(b) { CUDA_OK(cudaMalloc(&p, b ? b : 1)); }
  DevBuf(const DevBuf &) = delete;
  DevBuf &operator=(const DevBuf &) = delete;
  DevBuf(DevBuf &&o) noexcept : p(o.p), bytes(o.bytes) { o.p = nullptr; o.bytes = 0; }
  DevBuf &operator=(DevBuf &&o) noexcept {
    if (this != &o) { release(); p = o.p; bytes = o.bytes; o.p = nullptr; o.bytes = 0; }
    return *this;
  }
  ~DevBuf() { release(); }
  void release() { if (p) cudaFree(p); p = nullptr; }
  std::vector<uint8_t> download() const {
    std::vector<uint8_t> h(bytes);
    CUDA_OK(cudaMemcpy(h.data(), p, bytes, cudaMemcpyDeviceToHost));
    return h;
  }
  // cudaMemcpy from pageable memory may return before the DMA has landed, and cudaMemset
  // is asynchronous; both run on the legacy stream, which the tests' non-blocking
  // streams do not wait for: synchronise it before anything else reads the buffer.
  void upload(const void *h) {
    CUDA_OK(cudaMemcpy(p, h, bytes, cudaMemcpyHostToDevice));
    CUDA_OK(cudaStreamSynchronize(0));
  }
  void poison() {  // NaN in every float format
    CUDA_OK(cudaMemset(p, 0xFF, bytes));
    CUDA_OK(cudaStreamSynchronize(0));
  }
};

inline NVTEBasicTensor basic(void *p, NVTEDType t, std::vector<size_t> shape) {
  NVTEBasicTensor b;
  b.data_ptr = p;
  b.dtype = t;
  b.shape = nvte_make_shape(shape.data(), shape.size());
  return b;
}

// A TE tensor handle that owns its data and, for FP8, its scale / scale_inv / amax.
struct Tensor {
  NVTETensor h = nullptr;
  DevBuf data, scale, scale_inv, amax;
  NVTEDType dtype = kNVTEFloat32;
  std::vector<size_t> shape;
  size_t numel = 0;
  Tensor() = default;
  Tensor(NVTEDType t, std::vector<size_t> s, bool with_scales = false) : dtype(t), shape(s) {
    numel = 1;
    for (size_t d : s) numel *= d;
    data = DevBuf(numel * dtype_bytes(t));
    h = nvte_create_tensor(NVTE_DELAYED_TENSOR_SCALING);
    NVTEBasicTensor b = basic(data.p, t, s);
    nvte_set_tensor_param_v2(h, kNVTERowwiseData, &b, sizeof(b));
    if (with_scales || is_fp8(t)) {
      scale = DevBuf(4); scale_inv = DevBuf(4); amax = DevBuf(4);
      set_scalar(kNVTEScale, scale.p);
      set_scalar(kNVTERowwiseScaleInv, scale_inv.p);
      set_scalar(kNVTEAmax, amax.p);
      set_scale(1.0f);
      CUDA_OK(cudaMemset(amax.p, 0, 4));
      CUDA_OK(cudaStreamSynchronize(0));
    }
  }
  Tensor(const Tensor &) = delete;
  Tensor &operator=(const Tensor &) = delete;
  Tensor(Tensor &&o) noexcept { *this = std::move(o); }
  Tensor &operator=(Tensor &&o) noexcept {
    if (this != &o) {
      if (h) nvte_destroy_tensor(h);
      h = o.h; o.h = nullptr;
      data = std::move(o.data); scale = std::move(o.scale); scale_inv = std::move(o.scale_inv); amax = std::move(o.amax);
      dtype = o.dtype; shape = o.shape; numel = o.numel;
    }
    return *this;
  }
  ~Tensor() { if (h) nvte_destroy_tensor(h); }
  void set_scalar(NVTETensorParam p, void *ptr) {
    NVTEBasicTensor b = basic(ptr, kNVTEFloat32, {1});
    nvte_set_tensor_param_v2(h, p, &b, sizeof(b));
  }
  void set_scale(float s) {
    float inv = 1.0f / s;
    scale.upload(&s);
    scale_inv.upload(&inv);
  }
  float get_f32(const DevBuf &b) const { float v; CUDA_OK(cudaMemcpy(&v, b.p, 4, cudaMemcpyDeviceToHost)); return v; }
  // Values as the GEMM sees them (decoded, times scale_inv for FP8).
  std::vector<double> values() const {
    auto v = decode(data.download(), dtype, numel);
    if (is_fp8(dtype)) { double si = get_f32(scale_inv); for (auto &x : v) x *= si; }
    return v;
  }
};

// Uniform host values in [lo, hi), uploaded as float32 and converted to `t` on the GPU
// with nvte_quantize (FP8: times `fp8_scale`). Returns the tensor; its values() are the
// exact numbers the GPU holds.
struct Rng {
  uint64_t s;
  explicit Rng(uint64_t seed) : s(seed * 0x9E3779B97F4A7C15ull + 1) {}
  uint64_t next() { s ^= s << 13; s ^= s >> 7; s ^= s << 17; return s; }
  double uniform(double lo, double hi) { return lo + (hi - lo) * ((next() >> 11) * (1.0 / 9007199254740992.0)); }
  int range(int lo, int hi) { return lo + (int)(next() % (uint64_t)(hi - lo + 1)); }
};

inline Tensor random_tensor(NVTEDType t, std::vector<size_t> shape, Rng &rng, double lo, double hi,
                            float fp8_scale, cudaStream_t stream, std::string *err) {
  size_t n = 1;
  for (size_t d : shape) n *= d;
  std::vector<float> h(n);
  for (auto &x : h) x = (float)rng.uniform(lo, hi);
  Tensor src(kNVTEFloat32, shape);
  src.data.upload(h.data());
  if (t == kNVTEFloat32) return src;
  Tensor dst(t, shape, is_fp8(t));
  if (is_fp8(t)) dst.set_scale(fp8_scale);
  nvte_quantize(src.h, dst.h, stream);
  if (nvte_comm_last_status() != NVTE_COMM_SUCCESS && err) *err = nvte_comm_last_error();
  CUDA_OK(cudaStreamSynchronize(stream));
  return dst;
}

// ||a - b|| / ||b||; NaN anywhere gives NaN (which never passes a `<` check).
inline double rel_err(const std::vector<double> &a, const std::vector<double> &b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    double d = a[i] - b[i];
    num += d * d;
    den += b[i] * b[i];
  }
  if (a.size() != b.size()) return NAN;
  if (den == 0) return std::sqrt(num);
  return std::sqrt(num / den);
}

// Time `fn` on `s`: `warmup` runs, then `iters` runs between CUDA events; this rank's
// median, then the maximum over ranks (the slowest rank sets a collective's time).
inline double time_ms(cudaStream_t s, int warmup, int iters, const std::function<void()> &fn) {
  for (int i = 0; i < warmup; ++i) fn();
  std::vector<cudaEvent_t> ev(2 * iters);
  for (auto &e : ev) CUDA_OK(cudaEventCreate(&e));
  MPI_Barrier(MPI_COMM_WORLD);
  CUDA_OK(cudaStreamSynchronize(s));
  for (int i = 0; i < iters; ++i) {
    CUDA_OK(cudaEventRecord(ev[2 * i], s));
    fn();
    CUDA_OK(cudaEventRecord(ev[2 * i + 1], s));
  }
  CUDA_OK(cudaStreamSynchronize(s));
  std::vector<float> ms(iters);
  for (int i = 0; i < iters; ++i) CUDA_OK(cudaEventElapsedTime(&ms[i], ev[2 * i], ev[2 * i + 1]));
  for (auto &e : ev) cudaEventDestroy(e);
  std::sort(ms.begin(), ms.end());
  double med = ms[iters / 2], worst;
  MPI_Allreduce(&med, &worst, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return worst;
}

// Several regions timed in interleaved rounds: round after round, each fn runs
// `per_round` times with events around each run, so clock, power and thermal drift hit
// every region alike (one region timed after another would see different clocks). Per fn:
// the median of its rounds x per_round runs on this rank, then the maximum over ranks.
// Every rank must pass the same fns in the same order (collectives inside them).
inline std::vector<double> time_interleaved(cudaStream_t s, int warmup, int rounds, int per_round,
                                            const std::vector<std::function<void()>> &fns) {
  for (auto &f : fns)
    for (int i = 0; i < warmup; ++i) f();
  const size_t nf = fns.size(), per_fn = (size_t)rounds * per_round;
  std::vector<cudaEvent_t> ev(2 * nf * per_fn);
  for (auto &e : ev) CUDA_OK(cudaEventCreate(&e));
  MPI_Barrier(MPI_COMM_WORLD);
  CUDA_OK(cudaStreamSynchronize(s));
  for (int r = 0; r < rounds; ++r)
    for (size_t f = 0; f < nf; ++f)
      for (int i = 0; i < per_round; ++i) {
        size_t k = 2 * (f * per_fn + (size_t)r * per_round + i);
        CUDA_OK(cudaEventRecord(ev[k], s));
        fns[f]();
        CUDA_OK(cudaEventRecord(ev[k + 1], s));
      }
  CUDA_OK(cudaStreamSynchronize(s));
  std::vector<double> med(nf), worst(nf);
  for (size_t f = 0; f < nf; ++f) {
    std::vector<float> ms(per_fn);
    for (size_t i = 0; i < per_fn; ++i) CUDA_OK(cudaEventElapsedTime(&ms[i], ev[2 * (f * per_fn + i)], ev[2 * (f * per_fn + i) + 1]));
    std::sort(ms.begin(), ms.end());
    med[f] = ms[per_fn / 2];
  }
  for (auto &e : ev) cudaEventDestroy(e);
  MPI_Allreduce(med.data(), worst.data(), (int)nf, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return worst;
}

struct Report {
  int rank = 0, passed = 0, failed = 0, skipped = 0;
  FILE *log = stdout;
  void pass(const std::string &what) { ++passed; std::fprintf(log, "[rank %d] PASS %s\n", rank, what.c_str()); }
  void fail(const std::string &what) { ++failed; std::fprintf(log, "[rank %d] FAIL %s\n", rank, what.c_str()); std::fflush(log); }
  void skip(const std::string &what) { ++skipped; std::fprintf(log, "[rank %d] SKIP %s\n", rank, what.c_str()); }
  void check(bool ok, const std::string &what) { ok ? pass(what) : fail(what); }
  // Sums the counts over ranks, prints the closing line on rank 0, returns the exit code.
  int finish(const char *name) {
    int mine[3] = {passed, failed, skipped}, all[3];
    MPI_Allreduce(mine, all, 3, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    if (rank == 0) std::printf("%s: %d passed, %d failed, %d skipped\n", name, all[0], all[1], all[2]);
    return all[1] == 0 && all[0] > 0 ? 0 : 1;
  }
};

}  // namespace tu
