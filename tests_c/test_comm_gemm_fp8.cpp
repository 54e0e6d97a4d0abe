// FP8 accumulation of the comm-GEMM API (issue 21, item 7): nvte_gemm_reduce_scatter and
// nvte_gemm_all_reduce with FP8 inputs (e4m3 x e4m3, e4m3 x e5m2, e5m2 x e4m3) and fp16 /
// bf16 outputs, k per rank 256 and 512, FP8 values of magnitude 60..125 (random signs,
// scale_inv 1/64), compared with TE's reference: nvte_cublas_gemm(...,
// use_split_accumulator = true) on each rank's K-slice (the partial P_r, fp32 output),
// summed in fp32 over the ranks. Then a context created with
// NVTE_COMM_GEMM_FP8_FAST_ACCUM=1 against the same reference built with fast
// accumulation (use_split_accumulator = false). At tp 1 (one GEMM straight into D) both
// are also checked bit for bit against nvte_cublas_gemm into D's type with the context's
// workspace size: the knob reaches cuBLASLt, and the default context accumulates at full
// precision.
//
// Tolerance, per element: |d - ref| <= rtol |ref| + atol + (tp + 1) u sum_r |P_r|, with
// rtol = atol = 5e-2 (TE's GemmRs / GemmAr tolerance, tests/cpp_distributed/
// test_comm_gemm.cu: what the two accumulations of one FP8 GEMM may differ by) and u the
// unit roundoff of D's type (bf16 2^-8, fp16 2^-11). The last term is the rounding of the
// output type along the reduction, which TE's fixed tolerance leaves out: the library
// sums partials held in D's type, not fp32. The accumulating ring rounds the running sum
// S_i = P_a + ... + P_i to D's type after each of its tp GEMMs (the ring with a closing
// reduction rounds each of the tp partials instead, then sums in fp32 and rounds once
// more); each rounding errs by at most u |S_i| <= u sum_r |P_r|, so tp + 1 roundings err
// by at most (tp + 1) u sum_r |P_r|, whatever the order. With cancellation (|P_r| ~ 200,
// |sum| small) that is several units where |ref| is near 0: a fixed atol = rtol = 0.05
// cannot hold for one ulp of 200 in bf16 (1.0), while an exact fp32 sum of the partials
// (the reference) has none of it.
//
// Also checked: on Hopper (compute capability 9.x) the two accumulations really differ
// (the fp32 partials of use_split_accumulator = true and = false are not all equal, and
// the outputs of the default and the fast context are not all equal), so the bit-for-bit
// checks at tp 1 tell the default (full precision) from the fast one.
//
// The contexts come from MPI allgather / barrier callbacks over the IPC transport, so any
// number of ranks may share one GPU (run_mpi.sh N with fewer GPUs: rank r uses GPU
// r % count); no NCCL communicator is needed.
#include <algorithm>
#include <cmath>

#include "test_util.hpp"

using namespace tu;

namespace {

int mpi_allgather(void *, void *global, size_t, const void *local, size_t local_bytes) {
  return MPI_Allgather(local, (int)local_bytes, MPI_BYTE, global, (int)local_bytes, MPI_BYTE, MPI_COMM_WORLD);
}
int mpi_barrier(void *) { return MPI_Barrier(MPI_COMM_WORLD); }

const double kTol = 5e-2;  // TE's GemmRs / GemmAr tolerance (rtol = atol)

// Unit roundoff of the output type (round to nearest: half an ulp of 1).
double unit_roundoff(NVTEDType t) { return t == kNVTEFloat16 ? std::ldexp(1.0, -11) : t == kNVTEBFloat16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -24); }

// FP8 tensor [rows, cols] from host values (quantized with scale 1), scale_inv 1/64.
Tensor fp8_tensor(const std::vector<float> &h, size_t rows, size_t cols, NVTEDType t, cudaStream_t s) {
  Tensor f(kNVTEFloat32, {rows, cols});
  f.data.upload(h.data());
  Tensor q(t, {rows, cols}, true);
  nvte_quantize(f.h, q.h, s);
  CUDA_OK(cudaStreamSynchronize(s));
  float inv = 1.0f / 64.0f;
  q.scale_inv.upload(&inv);
  return q;
}

// Columns [c0, c0 + nc) of a row-major [rows, cols] host matrix.
std::vector<float> cols_of(const std::vector<float> &h, size_t rows, size_t cols, size_t c0, size_t nc) {
  std::vector<float> o(rows * nc);
  for (size_t i = 0; i < rows; ++i)
    for (size_t j = 0; j < nc; ++j) o[i * nc + j] = h[i * cols + c0 + j];
  return o;
}

NVTECommGemmCtx *make_ctx(int rank, int size, bool fast) {
  setenv("NVTE_COMM_TRANSPORT", "ipc", 1);
  setenv("NVTE_COMM_TUNE", "0", 1);
  if (fast) setenv("NVTE_COMM_GEMM_FP8_FAST_ACCUM", "1", 1);
  NVTECommBootstrap bs{};
  bs.world_rank = rank;
  bs.world_size = size;
  bs.allgather = mpi_allgather;
  bs.barrier = mpi_barrier;
  NVTECommGemmCtx *ctx = nullptr;
  NVTECommStatus st = nvte_comm_gemm_ctx_create_bootstrap(&bs, &ctx);
  unsetenv("NVTE_COMM_GEMM_FP8_FAST_ACCUM");
  unsetenv("NVTE_COMM_TUNE");
  unsetenv("NVTE_COMM_TRANSPORT");
  return st == NVTE_COMM_SUCCESS ? ctx : nullptr;
}

struct Result {
  int bad = 0;
  double max_err = 0, max_ref = 0;
  double acc_diff = 0;  // max |P_r(full) - P_r(fast)| over the fp32 partials of every rank
  std::vector<double> d;
};

// One op on one context; checked against the reference with accumulation `split`.
Result run(Report &rep, NVTECommGemmCtx *ctx, bool all_reduce, bool split, NVTEDType ta, NVTEDType tb, NVTEDType td,
           int64_t kpr, uint64_t seed, int rank, int size, cudaStream_t s, const char *label) {
  const int64_t m = 128, n = 64 * size, k = kpr * size;
  char what[256];
  std::snprintf(what, sizeof what, "tp %d %s %s x %s -> %s m=%lld n=%lld k=%lld (%lld per rank), %s accumulation", size,
                all_reduce ? "gemm_all_reduce" : "gemm_reduce_scatter", dtype_name(ta), dtype_name(tb), dtype_name(td),
                (long long)m, (long long)n, (long long)k, (long long)kpr, label);
  Result res;
  // Global A [m, k] and B [n, k] (TN), the same on every rank: magnitudes 60..125.
  Rng rng(seed);
  auto fill = [&](std::vector<float> &v) {
    for (auto &x : v) x = (float)(rng.uniform(60, 125) * (rng.next() & 1 ? 1 : -1));
  };
  std::vector<float> A(m * k), B(n * k);
  fill(A);
  fill(B);
  // Reference: every rank's K-slice GEMM P_q (fp32 out, the given accumulation), summed in
  // fp32, and sum_q |P_q| (the rounding term of the bound). The same partials with the
  // other accumulation give how far the two accumulations differ.
  std::vector<float> ref(n * m, 0.0f);
  std::vector<double> sum_abs(n * m, 0.0);
  for (int q = 0; q < size; ++q) {
    Tensor Aq = fp8_tensor(cols_of(A, m, k, q * kpr, kpr), m, kpr, ta, s);
    Tensor Bq = fp8_tensor(cols_of(B, n, k, q * kpr, kpr), n, kpr, tb, s);
    Tensor Dq(kNVTEFloat32, {(size_t)n, (size_t)m}), Do(kNVTEFloat32, {(size_t)n, (size_t)m});
    nvte_cublas_gemm(Aq.h, Bq.h, Dq.h, nullptr, nullptr, true, false, false, nullptr, false, split, 0, s);
    bool ok = nvte_comm_last_status() == NVTE_COMM_SUCCESS;
    nvte_cublas_gemm(Aq.h, Bq.h, Do.h, nullptr, nullptr, true, false, false, nullptr, false, !split, 0, s);
    if (!ok || nvte_comm_last_status() != NVTE_COMM_SUCCESS) {
      rep.fail(std::string(what) + ": reference: " + nvte_comm_last_error());
      res.bad = -1;
      return res;
    }
    CUDA_OK(cudaStreamSynchronize(s));
    std::vector<double> dq = decode(Dq.data.download(), kNVTEFloat32, n * m);
    std::vector<double> dother = decode(Do.data.download(), kNVTEFloat32, n * m);
    for (size_t i = 0; i < dq.size(); ++i) {
      ref[i] += (float)dq[i];
      sum_abs[i] += std::fabs(dq[i]);
      res.acc_diff = std::max(res.acc_diff, std::fabs(dq[i] - dother[i]));
    }
  }
  // This rank's operands and output.
  Tensor Al = fp8_tensor(cols_of(A, m, k, rank * kpr, kpr), m, kpr, ta, s);
  Tensor Bl = fp8_tensor(cols_of(B, n, k, rank * kpr, kpr), n, kpr, tb, s);
  const int64_t nl = n / size, rows = all_reduce ? n : nl, row0 = all_reduce ? 0 : rank * nl;
  Tensor D(td, {(size_t)rows, (size_t)m});
  D.data.poison();
  auto fn = all_reduce ? nvte_gemm_all_reduce : nvte_gemm_reduce_scatter;
  fn(ctx, m, n, k, Al.h, Bl.h, D.h, nullptr, nullptr, true, false, false, false, 0, s, kNVTECommGemmAlgoSplitP2P);
  NVTECommStatus st = nvte_comm_last_status();
  std::string msg = nvte_comm_last_error();
  CUDA_OK(cudaStreamSynchronize(s));
  if (st != NVTE_COMM_SUCCESS) {
    rep.fail(std::string(what) + ": " + nvte_comm_status_string(st) + ": " + msg);
    res.bad = -1;
    return res;
  }
  res.d = decode(D.data.download(), td, rows * m);
  const double u = unit_roundoff(td);
  double max_round = 0, max_used = 0;  // the largest rounding term; the largest err / bound
  for (int64_t i = 0; i < rows * m; ++i) {
    double want = ref[row0 * m + i], got = res.d[i];
    double err = std::fabs(got - want);
    double rounding = (size + 1) * u * sum_abs[row0 * m + i];
    double bound = kTol * std::fabs(want) + kTol + rounding;
    if (!(err <= bound)) ++res.bad;
    res.max_err = std::max(res.max_err, std::isnan(err) ? INFINITY : err);
    res.max_ref = std::max(res.max_ref, std::fabs(want));
    max_round = std::max(max_round, rounding);
    max_used = std::max(max_used, std::isnan(err) ? INFINITY : err / bound);
  }
  char b[640];
  std::snprintf(b, sizeof b,
                "%s: %d of %lld outside rtol |ref| + atol + (tp+1) u sum|P_r| (rtol = atol = %.2g, u = 2^%d; max |err| %.4g, "
                "max |ref| %.4g, largest rounding term %.4g, largest err / bound %.3f)",
                what, res.bad, (long long)(rows * m), kTol, (int)std::lround(std::log2(u)), res.max_err, res.max_ref, max_round,
                max_used);
  rep.check(res.bad == 0, b);
  if (size == 1) {
    // tp 1: the call is one GEMM into D; nvte_cublas_gemm with the same operands, D's
    // type, the same accumulation and the context's workspace size gives the same bits.
    Tensor W(kNVTEByte, {(size_t)32 << 20});
    Tensor Dr(td, {(size_t)n, (size_t)m});
    nvte_cublas_gemm(Al.h, Bl.h, Dr.h, nullptr, nullptr, true, false, false, W.h, false, split, 0, s);
    CUDA_OK(cudaStreamSynchronize(s));
    bool same = nvte_comm_last_status() == NVTE_COMM_SUCCESS && Dr.data.download() == D.data.download();
    rep.check(same, std::string(what) + ": bit for bit equal to nvte_cublas_gemm(use_split_accumulator = " +
                        (split ? "true" : "false") + ")");
  }
  return res;
}

}  // namespace

int main(int argc, char **argv) {
  probe_one_gpu_or_continue(argc, argv);  // ranks may share GPUs
  MPI_Init(&argc, &argv);
  Report rep;
  int rank, size, ndev = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  rep.rank = rank;
  CUDA_OK(cudaGetDeviceCount(&ndev));
  CUDA_OK(cudaSetDevice(rank % ndev));
  cudaStream_t s;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  NVTECommGemmCtx *full = make_ctx(rank, size, false), *fast = make_ctx(rank, size, true);
  if (!full || !fast) {
    rep.fail(std::string("ctx_create_bootstrap: ") + nvte_comm_last_error());
  } else {
    const NVTEDType e4 = kNVTEFloat8E4M3, e5 = kNVTEFloat8E5M2;
    const NVTEDType ins[3][2] = {{e4, e4}, {e4, e5}, {e5, e4}};
    uint64_t seed = 2100;
    double max_diff = 0, acc_diff = 0;  // fast vs full: the outputs, and the fp32 partials
    for (bool ar : {false, true})
      for (auto &in : ins)
        for (NVTEDType td : {kNVTEFloat16, kNVTEBFloat16})
          for (int64_t kpr : {256, 512}) {
            ++seed;
            Result a = run(rep, full, ar, true, in[0], in[1], td, kpr, seed, rank, size, s, "full-precision (default)");
            Result b = run(rep, fast, ar, false, in[0], in[1], td, kpr, seed, rank, size, s,
                           "fast (NVTE_COMM_GEMM_FP8_FAST_ACCUM=1)");
            for (size_t i = 0; i < std::min(a.d.size(), b.d.size()); ++i) max_diff = std::max(max_diff, std::fabs(a.d[i] - b.d[i]));
            acc_diff = std::max({acc_diff, a.acc_diff, b.acc_diff});
          }
    double mine[2] = {max_diff, acc_diff}, all[2] = {0, 0};
    MPI_Allreduce(mine, all, 2, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    if (rank == 0)
      std::printf("tp %d: max |fast - full-precision| over every case: %.4g (outputs), %.4g (fp32 partials)\n", size, all[0], all[1]);
    // Where the two accumulations are expected to differ (Hopper's FP8 tensor cores
    // accumulate with reduced precision unless the accumulator is split), they must: else
    // the tp-1 bit-for-bit checks could not tell the default from the fast context.
    int dev = 0;
    cudaDeviceProp prop{};
    CUDA_OK(cudaGetDevice(&dev));
    CUDA_OK(cudaGetDeviceProperties(&prop, dev));
    char b[256];
    std::snprintf(b, sizeof b,
                  "tp %d, compute capability %d.%d: full-precision and fast accumulation differ (max |diff| of the fp32 partials %.4g, "
                  "of the default and the fast context's outputs %.4g)",
                  size, prop.major, prop.minor, all[1], all[0]);
    if (prop.major == 9)
      rep.check(all[0] > 0 && all[1] > 0, b);
    else if (rank == 0)
      std::printf("(not checked off Hopper) %s\n", b);
  }
  // A value that is not a boolean is refused at creation, naming the knob.
  setenv("NVTE_COMM_GEMM_FP8_FAST_ACCUM", "maybe", 1);
  NVTECommGemmCtx *badctx = make_ctx(rank, size, false);
  unsetenv("NVTE_COMM_GEMM_FP8_FAST_ACCUM");
  rep.check(badctx == nullptr && nvte_comm_last_status() == NVTE_COMM_ERROR_INVALID_ARGUMENT &&
                std::strstr(nvte_comm_last_error(), "NVTE_COMM_GEMM_FP8_FAST_ACCUM") != nullptr,
            std::string("NVTE_COMM_GEMM_FP8_FAST_ACCUM=maybe is refused at creation: ") + nvte_comm_last_error());
  if (badctx) nvte_comm_gemm_ctx_destroy(badctx);
  if (full) nvte_comm_gemm_ctx_destroy(full);
  if (fast) nvte_comm_gemm_ctx_destroy(fast);
  int rc = rep.finish("test_comm_gemm_fp8");
  MPI_Finalize();
  return rc;
}
