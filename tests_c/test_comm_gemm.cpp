// TE's comm_gemm.h contract (nvte_comm_gemm_ctx_*, nvte_all_gather_gemm,
// nvte_gemm_reduce_scatter, nvte_gemm_all_reduce, nvte_comm_gemm_numroc) on both
// transports (NVTE_COMM_TRANSPORT=ipc and =nccl): every rank builds the global A and B
// from one seed, takes its block-distributed share, and compares its result with
// nvte_cublas_gemm on the global data (fp32 output: an fp32 reduction over k).
#include <nccl.h>

#include <algorithm>

#include "test_util.hpp"

using namespace tu;

namespace {

struct Env {
  int rank, size;
  ncclComm_t comm;
  cudaStream_t s;
  Report *rep;
};

int64_t numroc(int64_t g, int nr, int r) {
  int64_t b = (g + nr - 1) / nr;
  return std::max<int64_t>(0, std::min<int64_t>(b, g - r * b));
}

// Host matrix (row-major rows x cols) -> device tensor of dtype t (FP8: scale 1).
Tensor upload(const std::vector<float> &h, size_t rows, size_t cols, NVTEDType t, cudaStream_t s) {
  Tensor f(kNVTEFloat32, {rows, cols});
  if (!h.empty()) f.data.upload(h.data());
  if (t == kNVTEFloat32) return f;
  Tensor q(t, {rows, cols}, is_fp8(t));
  if (rows * cols) nvte_quantize(f.h, q.h, s);
  CUDA_OK(cudaStreamSynchronize(s));
  return q;
}

// Rows [r0, r0+nr) and columns [c0, c0+nc) of a row-major host matrix with `cols` columns.
std::vector<float> slice(const std::vector<float> &h, size_t cols, size_t r0, size_t nr, size_t c0, size_t nc) {
  std::vector<float> o(nr * nc);
  for (size_t i = 0; i < nr; ++i)
    for (size_t j = 0; j < nc; ++j) o[i * nc + j] = h[(r0 + i) * cols + c0 + j];
  return o;
}

enum class Op { AG, RS, AR };
const char *op_name(Op o) { return o == Op::AG ? "all_gather_gemm" : o == Op::RS ? "gemm_reduce_scatter" : "gemm_all_reduce"; }

void run_case(Env &e, NVTECommGemmCtx *ctx, const char *transport, Op op, int64_t m, int64_t n, int64_t k, NVTEDType ta_t,
              NVTEDType tb_t, NVTEDType td_t, bool transa, bool transb, bool with_bias, uint64_t seed, int reps = 1,
              NVTECommGemmAlgoType algo = kNVTECommGemmAlgoDefault) {
  char what[256];
  std::snprintf(what, sizeof what, "%s %s (m,n,k)=(%lld,%lld,%lld) %s x %s -> %s %c%c%s x%d%s", transport, op_name(op), (long long)m,
                (long long)n, (long long)k, dtype_name(ta_t), dtype_name(tb_t), dtype_name(td_t), transa ? 'T' : 'N',
                transb ? 'T' : 'N', with_bias ? " +bias" : "", reps,
                algo == kNVTECommGemmAlgoAtomicP2P ? " AtomicP2P" : algo == kNVTECommGemmAlgoAtomicMulticast ? " AtomicMulticast" : "");
  // Global matrices, identical on every rank: op(A) is m x k, op(B) is k x n.
  Rng rng(seed);
  size_t ar = transa ? m : k, ac = transa ? k : m, br = transb ? k : n, bc = transb ? n : k;
  std::vector<float> A(ar * ac), B(br * bc), bias(m);
  for (auto &x : A) x = (float)rng.uniform(-1, 1);
  for (auto &x : B) x = (float)rng.uniform(-1, 1);
  for (auto &x : bias) x = (float)rng.uniform(-1, 1);
  // Reference: the global GEMM with an fp32 output (its reduction over k is in fp32).
  Tensor Ag = upload(A, ar, ac, ta_t, e.s), Bg = upload(B, br, bc, tb_t, e.s), Dref(kNVTEFloat32, {(size_t)n, (size_t)m});
  nvte_cublas_gemm(Ag.h, Bg.h, Dref.h, nullptr, nullptr, transa, transb, false, nullptr, false, true, 0, e.s);
  if (nvte_comm_last_status() != NVTE_COMM_SUCCESS) { e.rep->fail(std::string(what) + ": reference: " + nvte_comm_last_error()); return; }
  CUDA_OK(cudaStreamSynchronize(e.s));
  std::vector<double> ref = decode(Dref.data.download(), kNVTEFloat32, n * m);
  // The bias in D's type; bf16 for an FP8 D (cuBLASLt's FP8 GEMMs take a 16-bit bias,
  // and the reduce-scatter's partials are bf16).
  const NVTEDType bias_t = is_fp8(td_t) ? kNVTEBFloat16 : td_t;
  std::vector<double> biasq;  // the bias as the op sees it (rounded to its type)
  if (with_bias) {
    Tensor bq = upload(bias, 1, m, bias_t, e.s);
    biasq = decode(bq.data.download(), bias_t, m);
    for (int64_t j = 0; j < n; ++j)
      for (int64_t i = 0; i < m; ++i) ref[j * m + i] += biasq[i];
  }
  // This rank's shares.
  int64_t ml = numroc(m, e.size, e.rank), nl = numroc(n, e.size, e.rank), kl = numroc(k, e.size, e.rank);
  int64_t m0 = e.rank * ((m + e.size - 1) / e.size), n0 = e.rank * ((n + e.size - 1) / e.size), k0 = e.rank * ((k + e.size - 1) / e.size);
  e.rep->check(nvte_comm_gemm_numroc(ctx, m) == ml && nvte_comm_gemm_numroc(ctx, n) == nl, std::string(what) + ": numroc");
  std::vector<float> Al, Bl, biasl;
  size_t alr, alc, blr, blc, dr, dc;
  if (op == Op::AG) {  // m and n split
    Al = transa ? slice(A, ac, m0, ml, 0, k) : slice(A, ac, 0, k, m0, ml);
    alr = transa ? ml : k, alc = transa ? k : ml;
    Bl = transb ? slice(B, bc, 0, k, n0, nl) : slice(B, bc, n0, nl, 0, k);
    blr = transb ? k : nl, blc = transb ? nl : k;
    dr = n, dc = ml;
    biasl = slice(bias, m, 0, 1, m0, ml);
  } else {  // k split
    Al = transa ? slice(A, ac, 0, m, k0, kl) : slice(A, ac, k0, kl, 0, m);
    alr = transa ? m : kl, alc = transa ? kl : m;
    Bl = transb ? slice(B, bc, k0, kl, 0, n) : slice(B, bc, 0, n, k0, kl);
    blr = transb ? kl : n, blc = transb ? n : kl;
    dr = op == Op::RS ? nl : n, dc = m;
    biasl = bias;
  }
  Tensor Aloc = upload(Al, alr, alc, ta_t, e.s), Bloc = upload(Bl, blr, blc, tb_t, e.s), D(td_t, {dr, dc});
  Tensor bt = upload(biasl, 1, biasl.size(), bias_t, e.s);
  Tensor bias1(bias_t, {biasl.size()});  // 1-D bias, same data
  CUDA_OK(cudaMemcpy(bias1.data.p, bt.data.p, bt.data.bytes, cudaMemcpyDeviceToDevice));
  CUDA_OK(cudaStreamSynchronize(0));  // legacy-stream op: let it land
  CUDA_OK(cudaMemsetAsync(D.data.p, 0xFF, D.data.bytes, e.s));
  auto fn = op == Op::AG ? nvte_all_gather_gemm : op == Op::RS ? nvte_gemm_reduce_scatter : nvte_gemm_all_reduce;
  // reps back-to-back calls (no host synchronisation between them): the buffers and flags
  // of one call must not be touched by a peer's next call too early.
  NVTECommStatus st = NVTE_COMM_SUCCESS;
  std::string msg;
  for (int rep = 0; rep < reps && st == NVTE_COMM_SUCCESS; ++rep) {
    fn(ctx, m, n, k, Aloc.h, Bloc.h, D.h, with_bias ? bias1.h : nullptr, nullptr, transa, transb, false, false, 0, e.s, algo);
    st = nvte_comm_last_status();
    msg = nvte_comm_last_error();
  }
  CUDA_OK(cudaStreamSynchronize(e.s));
  if (st != NVTE_COMM_SUCCESS) { e.rep->fail(std::string(what) + ": " + nvte_comm_status_string(st) + ": " + msg); return; }
  // The matching part of the reference.
  std::vector<double> want(dr * dc);
  for (size_t j = 0; j < dr; ++j)
    for (size_t i = 0; i < dc; ++i) {
      size_t gj = op == Op::RS ? n0 + j : j, gi = op == Op::AG ? m0 + i : i;
      want[j * dc + i] = ref[gj * m + gi];
    }
  std::vector<double> got = decode(D.data.download(), td_t, dr * dc);
  double err = dr * dc ? rel_err(got, want) : 0.0;
  if (is_fp8(td_t) && dr * dc) {  // FP8 output (scale 1): D's amax is max |D| before scaling
    float amax = 0;
    CUDA_OK(cudaMemcpy(&amax, D.amax.p, 4, cudaMemcpyDeviceToHost));
    double want_amax = 0;
    for (double v : want) want_amax = std::max(want_amax, std::fabs(v));
    char a[160];
    std::snprintf(a, sizeof a, "%s: amax %.4g vs reference %.4g", what, amax, want_amax);
    e.rep->check(std::fabs(amax - want_amax) <= 1e-2 * want_amax + 1e-6, a);
  }
  double tol = is_fp8(ta_t) || is_fp8(tb_t) || is_fp8(td_t) ? 6e-2 : 1e-2;
  char b[96];
  std::snprintf(b, sizeof b, ": local D [%zu, %zu] rel_err=%.3g (tol %.0e)", dr, dc, err, tol);
  std::string detail = b;
  if (!(err < tol) && op != Op::AG) {  // the same local GEMM straight through nvte_cublas_gemm
    Tensor D2(kNVTEFloat32, {(size_t)n, (size_t)m});
    nvte_cublas_gemm(Aloc.h, Bloc.h, D2.h, nullptr, nullptr, transa, transb, false, nullptr, false, true, 0, e.s);
    CUDA_OK(cudaStreamSynchronize(e.s));
    std::vector<double> g2 = decode(D2.data.download(), kNVTEFloat32, n * m);
    std::snprintf(b, sizeof b, " [direct local GEMM vs ref (np=1 only meaningful): %.3g]", rel_err(g2, ref));
    detail += b;
  }
  if (!(err < tol)) {  // where: the error of each eighth of D's rows
    for (int q = 0; q < 8; ++q) {
      size_t r0 = dr * q / 8, r1 = dr * (q + 1) / 8;
      std::vector<double> gq(got.begin() + r0 * dc, got.begin() + r1 * dc), wq(want.begin() + r0 * dc, want.begin() + r1 * dc);
      std::snprintf(b, sizeof b, " rows[%zu,%zu)=%.2g", r0, r1, rel_err(gq, wq));
      detail += b;
    }
  }
  e.rep->check(err < tol, std::string(what) + detail);
}

void expect(Env &e, NVTECommStatus want, const char *what) {
  NVTECommStatus got = nvte_comm_last_status();
  std::string msg = nvte_comm_last_error();
  e.rep->check(got == want && !msg.empty(), std::string("error: ") + what + " -> " + nvte_comm_status_string(got) + ": " + msg);
}

void errors(Env &e, NVTECommGemmCtx *ctx) {
  Tensor a(kNVTEBFloat16, {64, 64}), b(kNVTEBFloat16, {64, 64}), d(kNVTEBFloat16, {64, 64});
  nvte_all_gather_gemm(nullptr, 64, 64, 64, a.h, b.h, d.h, nullptr, nullptr, true, false, false, false, 0, e.s, kNVTECommGemmAlgoDefault);
  expect(e, NVTE_COMM_ERROR_INVALID_ARGUMENT, "NULL ctx");
  if (e.size > 1) {  // a share that disagrees with numroc
    nvte_all_gather_gemm(ctx, 64, 64, 64, a.h, b.h, d.h, nullptr, nullptr, true, false, false, false, 0, e.s, kNVTECommGemmAlgoDefault);
    expect(e, NVTE_COMM_ERROR_INVALID_ARGUMENT, "local shapes disagree with numroc");
  }
  int64_t ml = numroc(64, e.size, e.rank);
  Tensor a2(kNVTEBFloat16, {(size_t)ml, 64}), d2(kNVTEBFloat16, {64, (size_t)ml});
  Tensor bl(kNVTEInt32, {(size_t)numroc(64, e.size, e.rank), 64});
  nvte_all_gather_gemm(ctx, 64, 64, 64, a2.h, bl.h, d2.h, nullptr, nullptr, true, false, false, false, 0, e.s, kNVTECommGemmAlgoDefault);
  expect(e, NVTE_COMM_ERROR_UNSUPPORTED, "int32 B");
  Tensor dfp8(kNVTEFloat8E4M3, {64, 64});
  int64_t kl = numroc(64, e.size, e.rank);
  Tensor ak(kNVTEBFloat16, {64, (size_t)kl}), bk(kNVTEBFloat16, {64, (size_t)kl});
  nvte_gemm_all_reduce(ctx, 64, 64, 64, ak.h, bk.h, dfp8.h, nullptr, nullptr, true, false, false, false, 0, e.s, kNVTECommGemmAlgoDefault);
  expect(e, NVTE_COMM_ERROR_UNSUPPORTED, "FP8 output of an all-reduce");
  nvte_gemm_all_reduce(ctx, 64, 64, 64, ak.h, bk.h, d.h, nullptr, nullptr, true, false, false, false, 0, e.s, (NVTECommGemmAlgoType)9);
  expect(e, NVTE_COMM_ERROR_INVALID_ARGUMENT, "algo 9");
  nvte_comm_gemm_numroc(ctx, -5);
  expect(e, NVTE_COMM_ERROR_INVALID_ARGUMENT, "numroc of a negative size");
  NVTECommGemmCtx *bad = nvte_comm_gemm_ctx_create(e.comm, e.size + 1, e.rank);
  e.rep->check(bad == nullptr, std::string("error: nranks inconsistent with the communicator -> NULL: ") + nvte_comm_last_error());
  bad = nvte_comm_gemm_ctx_create(nullptr, e.size, e.rank);
  e.rep->check(bad == nullptr, std::string("error: NULL communicator -> NULL: ") + nvte_comm_last_error());
  CUDA_OK(cudaStreamSynchronize(e.s));
}

}  // namespace

// The per-call comm_sm_count reaches the SM-put kernels (it once stayed at the value the
// engine was created with): an all-gather-heavy call (large B, small GEMM) with SM puts
// (NVTE_COMM_OVERLAP_USE_CE=0) on 1 SM must take clearly longer than on 32 SMs.
void sm_count_reaches_puts(Env &e) {
  if (e.size < 2) return;
  setenv("NVTE_COMM_TRANSPORT", "ipc", 1);
  setenv("NVTE_COMM_OVERLAP_USE_CE", "0", 1);
  NVTECommGemmCtx *ctx = nvte_comm_gemm_ctx_create(e.comm, e.size, e.rank);
  unsetenv("NVTE_COMM_OVERLAP_USE_CE");
  unsetenv("NVTE_COMM_TRANSPORT");
  if (!ctx) { e.rep->fail(std::string("sm count: ctx_create: ") + nvte_comm_last_error()); return; }
  const int64_t m = 64 * e.size, n = 16384 * e.size, k = 4096;
  const size_t ml = m / e.size, nl = n / e.size;
  Tensor a(kNVTEBFloat16, {ml, (size_t)k}), b(kNVTEBFloat16, {nl, (size_t)k}), d(kNVTEBFloat16, {(size_t)n, ml});
  CUDA_OK(cudaMemset(a.data.p, 0, a.data.bytes));
  CUDA_OK(cudaMemset(b.data.p, 0, b.data.bytes));
  CUDA_OK(cudaStreamSynchronize(0));
  cudaEvent_t t0, t1;
  CUDA_OK(cudaEventCreate(&t0));
  CUDA_OK(cudaEventCreate(&t1));
  float ms[2] = {0, 0};
  const int sms[2] = {1, 32};
  bool ok = true;
  for (int w = 0; w < 2; ++w)
    for (int i = 0; i < 2; ++i) {  // the first of each is a warm-up
      MPI_Barrier(MPI_COMM_WORLD);
      CUDA_OK(cudaEventRecord(t0, e.s));
      // SplitP2P, not Default: the autotuner must not replace the SM puts chosen above.
      nvte_all_gather_gemm(ctx, m, n, k, a.h, b.h, d.h, nullptr, nullptr, true, false, false, false, sms[w], e.s,
                           kNVTECommGemmAlgoSplitP2P);
      ok = ok && nvte_comm_last_status() == NVTE_COMM_SUCCESS;
      CUDA_OK(cudaEventRecord(t1, e.s));
      CUDA_OK(cudaEventSynchronize(t1));
      CUDA_OK(cudaEventElapsedTime(&ms[w], t0, t1));
    }
  char b2[160];
  std::snprintf(b2, sizeof b2, "per-call comm_sm_count reaches the SM puts: AG of %.0f MiB per rank on 1 SM %.2f ms, on 32 SMs %.2f ms",
                nl * k * 2.0 / (1 << 20), ms[0], ms[1]);
  e.rep->check(ok && ms[0] > 2.0f * ms[1], b2);
  cudaEventDestroy(t0);
  cudaEventDestroy(t1);
  nvte_comm_gemm_ctx_destroy(ctx);
  MPI_Barrier(MPI_COMM_WORLD);
}

// NVTE_COMM_REPORT=1: calls stay correct (the first call of each shape measures the
// GEMM alone and the comm alone, then runs again), and the last call's figures are there.
// The autotuner is off (NVTE_COMM_TUNE=0) so that the report names the default algorithm:
// with it on, a tiny shape at tp 4 may pick the pipelined reduce-scatter (split_rs).
void report_cases(Env &e) {
  for (const char *transport : {"ipc", "nccl"}) {
    setenv("NVTE_COMM_TRANSPORT", transport, 1);
    setenv("NVTE_COMM_REPORT", "1", 1);
    setenv("NVTE_COMM_TUNE", "0", 1);
    NVTECommGemmCtx *ctx = nvte_comm_gemm_ctx_create(e.comm, e.size, e.rank);
    unsetenv("NVTE_COMM_TUNE");
    unsetenv("NVTE_COMM_REPORT");
    unsetenv("NVTE_COMM_TRANSPORT");
    if (!ctx) { e.rep->fail(std::string("report: ctx_create: ") + nvte_comm_last_error()); continue; }
    NVTECommCallReport r{};
    NVTECommStatus st0 = nvte_comm_gemm_last_report(ctx, &r);
    e.rep->check(st0 == NVTE_COMM_ERROR_INVALID_ARGUMENT,
                 std::string(transport) + " report before any call: INVALID_ARGUMENT: " + nvte_comm_last_error());
    struct S { Op op; int64_t m, n, k; const char *name; };
    const int64_t t = e.size;
    for (S s : {S{Op::AG, 512 * t, 1024 * t, 512, "split_ag"}, S{Op::RS, 512, 1024 * t, 512 * t, "split_rs_p2p"},
                S{Op::AR, 512, 1024 * t, 512 * t, "split_ar"}}) {
      std::string tag = std::string(transport) + " report";
      run_case(e, ctx, tag.c_str(), s.op, s.m, s.n, s.k, kNVTEBFloat16, kNVTEBFloat16, kNVTEBFloat16, true, false, true,
               777 + (uint64_t)s.op, 3);
      NVTECommStatus st = nvte_comm_gemm_last_report(ctx, &r);
      char b[320];
      std::snprintf(b, sizeof b,
                    "%s report %s: status %d, op %s, call %llu, m %lld n %lld k %lld: call %.3f ms, GEMM alone %.3f ms, "
                    "comm alone %.3f ms, bound %.3f ms, ratio %.3f",
                    transport, op_name(s.op), (int)st, st == NVTE_COMM_SUCCESS ? r.op : "-", (unsigned long long)r.call,
                    (long long)r.m, (long long)r.n, (long long)r.k, r.call_ms, r.gemm_alone_ms, r.comm_alone_ms, r.bound_ms,
                    r.ratio);
      bool ok = st == NVTE_COMM_SUCCESS && r.call_ms > 0 && r.gemm_alone_ms > 0 && r.comm_alone_ms > 0 &&
                r.bound_ms == std::max(r.gemm_alone_ms, r.comm_alone_ms) && r.ratio > 0 && r.ratio < 1e3 && r.k > 0;
      // Over IPC the all-reduce may take the ring (an RS + AG) or the chunked path; the
      // comm-GEMM reduce-scatter runs the ring (p2p) algorithm, except over NCCL at tp > 2,
      // where it runs a collective reduce-scatter per chunk (reported as split_rs).
      const char *want = s.op == Op::RS && t > 2 && std::strcmp(transport, "nccl") == 0 ? "split_rs" : s.name;
      if (s.op != Op::AR) ok = ok && std::strcmp(r.op, want) == 0;
      e.rep->check(ok, b);
    }
    nvte_comm_gemm_ctx_destroy(ctx);
    MPI_Barrier(MPI_COMM_WORLD);
  }
}

// kNVTECommGemmAlgoAtomicP2P: the fused all-gather GEMM (our sm90 GEMM on arrival flags
// where it computes the call: TN, bf16 in, bf16 / fp32 out, no bias, m share a multiple of
// 8; else cuBLASLt per chunk on the same ring: bias, FP8 with full-precision accumulation,
// odd shares); m = 62 at 4 ranks gives shares 16, 16, 16, 14: ranks run different GEMMs
// on the same protocol. 5 back-to-back calls each (the flags of one call must not leak
// into the next). The ring reduce-scatter and the ring all-reduce run our GEMM in one
// launch with done signals (bias: GEMMs per destination); AtomicMulticast runs as
// AtomicP2P. Then FP8 with fast accumulation (our GEMM's e4m3 path).
void atomic_cases(Env &e, NVTECommGemmCtx *ctx, const char *transport, uint64_t &seed) {
  const NVTEDType bf = kNVTEBFloat16, e4 = kNVTEFloat8E4M3, f32 = kNVTEFloat32;
  const auto P2P = kNVTECommGemmAlgoAtomicP2P;
  struct C { Op op; int64_t m, n, k; NVTEDType in, out; bool bias; };
  for (const C &c : {C{Op::AG, 1024, 512, 256, bf, bf, false}, C{Op::AG, 1024, 512, 256, bf, f32, false},
                     C{Op::AG, 1024, 512, 256, bf, bf, true}, C{Op::AG, 1024, 512, 256, e4, bf, false},
                     C{Op::AG, 62, 128, 64, bf, bf, false}, C{Op::AG, 256, 126, 64, bf, bf, false},
                     C{Op::RS, 64, 128, 256, bf, bf, false}, C{Op::RS, 512, 1024, 512, bf, bf, false},
                     C{Op::AR, 64, 256, 256, bf, bf, false}, C{Op::AR, 64, 256, 256, bf, bf, true}})
    run_case(e, ctx, transport, c.op, c.m, c.n, c.k, c.in, c.in, c.out, true, false, c.bias, ++seed, 5, P2P);
  run_case(e, ctx, transport, Op::AG, 1024, 512, 256, bf, bf, bf, true, false, false, ++seed, 2, kNVTECommGemmAlgoAtomicMulticast);
  setenv("NVTE_COMM_GEMM_FP8_FAST_ACCUM", "1", 1);
  NVTECommGemmCtx *fctx = nvte_comm_gemm_ctx_create(e.comm, e.size, e.rank);
  unsetenv("NVTE_COMM_GEMM_FP8_FAST_ACCUM");
  if (!fctx) {
    e.rep->fail(std::string(transport) + ": ctx_create (FP8 fast accumulation): " + nvte_comm_last_error());
    return;
  }
  std::string tag = std::string(transport) + " FP8_FAST_ACCUM";
  run_case(e, fctx, tag.c_str(), Op::AG, 1024, 512, 256, e4, e4, bf, true, false, false, ++seed, 5, P2P);
  run_case(e, fctx, tag.c_str(), Op::AG, 1024, 512, 256, e4, e4, f32, true, false, false, ++seed, 5, P2P);
  nvte_comm_gemm_ctx_destroy(fctx);
}

int main(int argc, char **argv) {
  probe_or_continue(argc, argv);
  MPI_Init(&argc, &argv);
  Report rep;
  Env e{};
  e.rep = &rep;
  MPI_Comm_rank(MPI_COMM_WORLD, &e.rank);
  MPI_Comm_size(MPI_COMM_WORLD, &e.size);
  rep.rank = e.rank;
  int ndev;
  CUDA_OK(cudaGetDeviceCount(&ndev));
  CUDA_OK(cudaSetDevice(e.rank % ndev));
  CUDA_OK(cudaStreamCreateWithFlags(&e.s, cudaStreamNonBlocking));
  ncclUniqueId id;
  if (e.rank == 0) ncclGetUniqueId(&id);
  MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, MPI_COMM_WORLD);
  if (ncclCommInitRank(&e.comm, e.size, id, e.rank) != ncclSuccess) MPI_Abort(MPI_COMM_WORLD, 3);

  const NVTEDType f16 = kNVTEFloat16, bf = kNVTEBFloat16, e4 = kNVTEFloat8E4M3, e5 = kNVTEFloat8E5M2;
  struct Types { NVTEDType a, b, d; };
  const Types types[] = {{f16, f16, f16}, {bf, bf, bf}, {e4, e4, f16}, {e4, e5, f16}, {e5, e4, f16}};
  struct Layout { bool ta, tb; };
  const Layout layouts[] = {{false, false}, {false, true}, {true, false}};  // NN, NT, TN
  struct Shape { Op op; int64_t m, n, k; };
  const Shape shapes[] = {{Op::AG, 256, 128, 64}, {Op::RS, 64, 128, 256}, {Op::AR, 64, 256, 256}, {Op::AR, 128, 512, 512}};
  const Shape uneven[] = {{Op::AG, 250, 126, 64}, {Op::RS, 64, 126, 250}, {Op::AR, 64, 250, 250}, {Op::AG, 64, 3, 48}};
  // All-reduces with chunks over 1 MiB (the copy-engine two-shot path), 16-byte aligned
  // or not (m = 1000: chunk starts are not), with an uneven k.
  const Shape large_ar[] = {{Op::AR, 1024, 2048, 512}, {Op::AR, 1000, 2050, 250}};
  uint64_t seed = 12345;
  bool only_ar = false, quick = false;  // --quick: bf16 only (for the slow sanitizer tools)
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--only-ar")) only_ar = true;
    if (!std::strcmp(argv[i], "--quick")) quick = true;
  }
  for (const char *transport : {"ipc", "nccl"}) {
    setenv("NVTE_COMM_TRANSPORT", transport, 1);
    NVTECommGemmCtx *ctx = nvte_comm_gemm_ctx_create(e.comm, e.size, e.rank);
    if (!ctx) {
      rep.fail(std::string(transport) + ": ctx_create: " + nvte_comm_last_error());
      continue;
    }
    for (const Shape &s : shapes)
      if (!only_ar || s.op == Op::AR)
      for (const Types &t : types)
        for (const Layout &l : layouts) {
          if (quick && t.a != bf) continue;
          if ((is_fp8(t.a) || is_fp8(t.b)) && !(l.ta && !l.tb)) continue;  // FP8: TN only on Hopper
          for (bool bias : {false, true}) run_case(e, ctx, transport, s.op, s.m, s.n, s.k, t.a, t.b, t.d, l.ta, l.tb, bias, ++seed);
        }
    for (const Shape &s : uneven)
      for (const Layout &l : layouts)
        run_case(e, ctx, transport, s.op, s.m, s.n, s.k, bf, bf, bf, l.ta, l.tb, true, ++seed);
    // FP8 outputs (scale 1; D's amax checked): the all-gather GEMM (every chunk's amax
    // into D's) and the reduce-scatter (bf16 partials summed in fp32, scaled into D), even
    // sizes and an uneven n without bias; FP8 and bf16 inputs.
    for (const Shape &s : {Shape{Op::AG, 256, 128, 64}, Shape{Op::AG, 256, 126, 64}, Shape{Op::RS, 64, 128, 256},
                           Shape{Op::RS, 64, 126, 250}})
      for (NVTEDType in : {e4, bf})
        for (bool bias : {false, true}) {
          if (bias && s.n % e.size) continue;
          if (in == e4 && s.k % (16 * e.size)) continue;  // FP8 GEMMs: 16-aligned k shares
          if (in == bf && s.op == Op::AG) continue;       // cuBLASLt: FP8 outputs need FP8 inputs
          run_case(e, ctx, transport, s.op, s.m, s.n, s.k, in, in, e4, true, false, bias, ++seed);
        }
    // Both IPC all-reduce algorithms (the NCCL transport ignores the choice).
    for (const char *algo : {"chunked", "ring"}) {
      setenv("NVTE_COMM_AR_ALGO", algo, 1);
      for (const Shape &s : large_ar)
        for (const Types &t : {types[0], types[1], types[2]})
          for (const Layout &l : layouts) {
            if (quick && t.a != bf) continue;
            if (is_fp8(t.a) && (!(l.ta && !l.tb) || s.m % 16 || s.k % (16 * e.size))) continue;  // FP8: TN, 16-aligned
            std::string tag = std::string(transport) + " AR=" + algo;
            run_case(e, ctx, tag.c_str(), s.op, s.m, s.n, s.k, t.a, t.b, t.d, l.ta, l.tb, true, ++seed, 20);
          }
    }
    unsetenv("NVTE_COMM_AR_ALGO");
    // The accumulating ring (NVTE_COMM_RS_RING=accumulate) in a context without the
    // autotuner (so the reduce-scatter runs the ring): reduce-scatters on both transports,
    // even and padded n; the all-reduce ring over IPC (NCCL: ncclAllReduce); with bias,
    // back-to-back calls.
    setenv("NVTE_COMM_RS_RING", "accumulate", 1);
    setenv("NVTE_COMM_AR_ALGO", "ring", 1);
    setenv("NVTE_COMM_TUNE", "0", 1);
    NVTECommGemmCtx *actx = nvte_comm_gemm_ctx_create(e.comm, e.size, e.rank);
    unsetenv("NVTE_COMM_TUNE");
    if (!actx) {
      rep.fail(std::string(transport) + ": ctx_create (RS_RING=accumulate): " + nvte_comm_last_error());
    } else {
      const Shape acc[] = {{Op::RS, 64, 128, 256}, {Op::RS, 512, 1024, 512}, {Op::RS, 64, 126, 250}, large_ar[0], large_ar[1]};
      for (const Shape &s : acc)
        for (const Types &t : {types[0], types[1], types[2]})
          for (const Layout &l : layouts) {
            if (quick && t.a != bf) continue;
            if (is_fp8(t.a) && (!(l.ta && !l.tb) || s.m % 16 || s.k % (16 * e.size))) continue;  // FP8: TN, 16-aligned
            std::string tag = std::string(transport) + " RS_RING=accumulate";
            run_case(e, actx, tag.c_str(), s.op, s.m, s.n, s.k, t.a, t.b, t.d, l.ta, l.tb, true, ++seed, 5);
          }
      nvte_comm_gemm_ctx_destroy(actx);
    }
    unsetenv("NVTE_COMM_AR_ALGO");
    unsetenv("NVTE_COMM_RS_RING");
    atomic_cases(e, ctx, transport, seed);
    errors(e, ctx);
    nvte_comm_gemm_ctx_destroy(ctx);
    MPI_Barrier(MPI_COMM_WORLD);
  }
  sm_count_reaches_puts(e);
  report_cases(e);
  int rc = rep.finish("test_comm_gemm");
  ncclCommDestroy(e.comm);
  MPI_Finalize();
  return rc;
}
