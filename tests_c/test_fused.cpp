// The fused (atomic) algorithms with ranks that may share one GPU (no NCCL: callback
// bootstrap over the IPC transport, references computed on every rank from the global
// data): our sm90 GEMM in one launch on arrival flags (all-gather) or with done signals
// (ring reduce-scatter, ring all-reduce).
// - comm-GEMM API, kNVTECommGemmAlgoAtomicP2P (NVTE_COMM_TUNE=0): all-gather bf16 -> bf16 /
//   fp32 (our GEMM), with bias and FP8 with full-precision accumulation (cuBLASLt per chunk
//   on the same ring), m = 62 (shares 16, 16, 16, 14 at 4 ranks: ranks run different GEMMs
//   on one protocol), n = 126 (padded); e4m3 with NVTE_COMM_GEMM_FP8_FAST_ACCUM=1 (our
//   GEMM's FP8 path); reduce-scatter and all-reduce bf16; 5 back-to-back calls each; and
//   all-gather bf16 and e4m3 at m = 3072, n = 4096, k = 1024, where at one rank the tile
//   rule takes the ping-pong kernel (3 calls each).
// - engine API (config atomic_gemm = true): split_ag (shard and buffer-view B, B_copy) and
//   split_rs_p2p, 20 back-to-back calls with fresh inputs; split_ag and split_rs_p2p
//   captured into a CUDA graph (thread-local mode, after an eager call) and replayed 5
//   times with fresh inputs before every replay (flags and signals must start from zero
//   at every replay).
// Options: --calls N (engine calls per case, default 20).
#include <algorithm>
#include <functional>

#include "test_util.hpp"

using namespace tu;

namespace {

int g_calls = 20;

int mpi_allgather(void *, void *global, size_t, const void *local, size_t local_bytes) {
  return MPI_Allgather(local, (int)local_bytes, MPI_BYTE, global, (int)local_bytes, MPI_BYTE, MPI_COMM_WORLD);
}
int mpi_barrier(void *) { return MPI_Barrier(MPI_COMM_WORLD); }

struct Env {
  int rank, size;
  cudaStream_t s;
  Report *rep;
  DevBuf ws;
};

NVTECommBootstrap bootstrap(const Env &e) {
  NVTECommBootstrap bs{};
  bs.world_rank = e.rank;
  bs.world_size = e.size;
  bs.allgather = mpi_allgather;
  bs.barrier = mpi_barrier;
  return bs;
}

NVTECommGemmCtx *make_ctx(const Env &e, bool fast) {
  setenv("NVTE_COMM_TRANSPORT", "ipc", 1);
  setenv("NVTE_COMM_TUNE", "0", 1);
  if (fast) setenv("NVTE_COMM_GEMM_FP8_FAST_ACCUM", "1", 1);
  NVTECommBootstrap bs = bootstrap(e);
  NVTECommGemmCtx *ctx = nullptr;
  NVTECommStatus st = nvte_comm_gemm_ctx_create_bootstrap(&bs, &ctx);
  unsetenv("NVTE_COMM_GEMM_FP8_FAST_ACCUM");
  unsetenv("NVTE_COMM_TUNE");
  unsetenv("NVTE_COMM_TRANSPORT");
  if (st != NVTE_COMM_SUCCESS) e.rep->fail(std::string("ctx_create_bootstrap: ") + nvte_comm_last_error());
  return st == NVTE_COMM_SUCCESS ? ctx : nullptr;
}

int64_t numroc(int64_t g, int nr, int r) {
  int64_t b = (g + nr - 1) / nr;
  return std::max<int64_t>(0, std::min<int64_t>(b, g - r * b));
}

// Host matrix -> device tensor of type t (FP8: scale 1).
void upload_into(Tensor &dst, const std::vector<float> &h, cudaStream_t s) {
  if (dst.dtype == kNVTEFloat32) {
    if (!h.empty()) dst.data.upload(h.data());
    return;
  }
  Tensor f(kNVTEFloat32, dst.shape);
  if (!h.empty()) f.data.upload(h.data());
  if (!h.empty()) nvte_quantize(f.h, dst.h, s);
  CUDA_OK(cudaStreamSynchronize(s));
}
std::vector<float> rows_of(const std::vector<float> &h, size_t cols, size_t r0, size_t nr) {
  return std::vector<float>(h.begin() + r0 * cols, h.begin() + (r0 + nr) * cols);
}
std::vector<float> cols_of(const std::vector<float> &h, size_t rows, size_t cols, size_t c0, size_t nc) {
  std::vector<float> o(rows * nc);
  for (size_t i = 0; i < rows; ++i)
    for (size_t j = 0; j < nc; ++j) o[i * nc + j] = h[i * cols + c0 + j];
  return o;
}
std::vector<float> random(size_t n, uint64_t seed) {
  Rng rng(seed);
  std::vector<float> v(n);
  for (auto &x : v) x = (float)rng.uniform(-1, 1);
  return v;
}

// D_ref [n, m] = B [n, k] A[m, k]^T (+ bias), fp32, from host data quantized to `t`.
std::vector<double> reference(const std::vector<float> &A, const std::vector<float> &B, const std::vector<float> *bias, int64_t m,
                              int64_t n, int64_t k, NVTEDType t, NVTEDType bias_t, cudaStream_t s) {
  Tensor Ag(t, {(size_t)m, (size_t)k}, is_fp8(t)), Bg(t, {(size_t)n, (size_t)k}, is_fp8(t)), D(kNVTEFloat32, {(size_t)n, (size_t)m});
  upload_into(Ag, A, s);
  upload_into(Bg, B, s);
  nvte_cublas_gemm(Ag.h, Bg.h, D.h, nullptr, nullptr, true, false, false, nullptr, false, true, 0, s);
  CUDA_OK(cudaStreamSynchronize(s));
  std::vector<double> r = decode(D.data.download(), kNVTEFloat32, n * m);
  if (bias) {
    Tensor bq(bias_t, {(size_t)m});
    upload_into(bq, *bias, s);
    std::vector<double> b = decode(bq.data.download(), bias_t, m);
    for (int64_t j = 0; j < n; ++j)
      for (int64_t i = 0; i < m; ++i) r[j * m + i] += b[i];
  }
  return r;
}

enum class Op { AG, RS, AR };

// One comm-GEMM case (TN), `reps` back-to-back calls, checked against the global GEMM.
void comm_gemm_case(Env &e, NVTECommGemmCtx *ctx, const char *tag, Op op, int64_t m, int64_t n, int64_t k, NVTEDType in,
                    NVTEDType out, bool with_bias, uint64_t seed, int reps = 5,
                    NVTECommGemmAlgoType algo = kNVTECommGemmAlgoAtomicP2P) {
  char what[256];
  std::snprintf(what, sizeof what, "%s %s (m,n,k)=(%lld,%lld,%lld) %s -> %s%s x%d tp=%d", tag,
                op == Op::AG ? "all_gather_gemm" : op == Op::RS ? "gemm_reduce_scatter" : "gemm_all_reduce", (long long)m,
                (long long)n, (long long)k, dtype_name(in), dtype_name(out), with_bias ? " +bias" : "", reps, e.size);
  std::vector<float> A = random(m * k, seed), B = random(n * k, seed + 1), bias = random(m, seed + 2);
  const NVTEDType bias_t = is_fp8(out) ? kNVTEBFloat16 : out;
  std::vector<double> ref = reference(A, B, with_bias ? &bias : nullptr, m, n, k, in, bias_t, e.s);
  const int64_t ml = numroc(m, e.size, e.rank), nl = numroc(n, e.size, e.rank), kl = numroc(k, e.size, e.rank);
  const int64_t m0 = e.rank * ((m + e.size - 1) / e.size), n0 = e.rank * ((n + e.size - 1) / e.size),
                k0 = e.rank * ((k + e.size - 1) / e.size);
  std::vector<float> Al, Bl, bl;
  size_t dr, dc;
  if (op == Op::AG) {
    Al = rows_of(A, k, m0, ml), Bl = rows_of(B, k, n0, nl), bl = std::vector<float>(bias.begin() + m0, bias.begin() + m0 + ml);
    dr = n, dc = ml;
  } else {
    Al = cols_of(A, m, k, k0, kl), Bl = cols_of(B, n, k, k0, kl), bl = bias;
    dr = op == Op::RS ? nl : n, dc = m;
  }
  const size_t ak = op == Op::AG ? k : kl;
  Tensor Aloc(in, {op == Op::AG ? (size_t)ml : (size_t)m, ak}, is_fp8(in)), Bloc(in, {op == Op::AG ? (size_t)nl : (size_t)n, ak}, is_fp8(in));
  Tensor D(out, {dr, dc}, is_fp8(out)), bt(bias_t, {bl.size()});
  upload_into(Aloc, Al, e.s);
  upload_into(Bloc, Bl, e.s);
  upload_into(bt, bl, e.s);
  CUDA_OK(cudaMemsetAsync(D.data.p, 0xFF, D.data.bytes, e.s));
  auto fn = op == Op::AG ? nvte_all_gather_gemm : op == Op::RS ? nvte_gemm_reduce_scatter : nvte_gemm_all_reduce;
  NVTECommStatus st = NVTE_COMM_SUCCESS;
  std::string msg;
  for (int i = 0; i < reps && st == NVTE_COMM_SUCCESS; ++i) {
    fn(ctx, m, n, k, Aloc.h, Bloc.h, D.h, with_bias ? bt.h : nullptr, nullptr, true, false, false, false, 0, e.s, algo);
    st = nvte_comm_last_status();
    msg = nvte_comm_last_error();
  }
  CUDA_OK(cudaStreamSynchronize(e.s));
  if (st != NVTE_COMM_SUCCESS) {
    e.rep->fail(std::string(what) + ": " + nvte_comm_status_string(st) + ": " + msg);
    return;
  }
  std::vector<double> want(dr * dc);
  for (size_t j = 0; j < dr; ++j)
    for (size_t i = 0; i < dc; ++i) want[j * dc + i] = ref[(op == Op::RS ? n0 + j : j) * m + (op == Op::AG ? m0 + i : i)];
  double err = dr * dc > 0 ? rel_err(decode(D.data.download(), out, dr * dc), want) : 0.0;
  double tol = is_fp8(in) || is_fp8(out) ? 6e-2 : 1e-2;
  char b[96];
  std::snprintf(b, sizeof b, ": rel_err=%.3g (tol %.0e)", err, tol);
  e.rep->check(err < tol, std::string(what) + b);
}

void comm_gemm_cases(Env &e) {
  const NVTEDType bf = kNVTEBFloat16, f32 = kNVTEFloat32, e4 = kNVTEFloat8E4M3;
  NVTECommGemmCtx *ctx = make_ctx(e, false), *fast = make_ctx(e, true);
  if (ctx && fast) {
    uint64_t seed = 500;
    comm_gemm_case(e, ctx, "ipc AtomicP2P", Op::AG, 1024, 512, 256, bf, bf, false, ++seed);
    comm_gemm_case(e, ctx, "ipc AtomicP2P", Op::AG, 1024, 512, 256, bf, f32, false, ++seed);
    comm_gemm_case(e, ctx, "ipc AtomicP2P (cuBLASLt: bias)", Op::AG, 1024, 512, 256, bf, bf, true, ++seed);
    comm_gemm_case(e, ctx, "ipc AtomicP2P (cuBLASLt: FP8 full-precision accumulation)", Op::AG, 1024, 512, 256, e4, bf, false, ++seed);
    comm_gemm_case(e, ctx, "ipc AtomicP2P (mixed shares)", Op::AG, 62, 128, 64, bf, bf, false, ++seed);
    comm_gemm_case(e, ctx, "ipc AtomicP2P (padded n)", Op::AG, 256, 126, 64, bf, bf, false, ++seed);
    comm_gemm_case(e, ctx, "ipc AtomicMulticast", Op::AG, 1024, 512, 256, bf, bf, false, ++seed, 2, kNVTECommGemmAlgoAtomicMulticast);
    comm_gemm_case(e, fast, "ipc AtomicP2P FP8_FAST_ACCUM", Op::AG, 1024, 512, 256, e4, bf, false, ++seed);
    comm_gemm_case(e, fast, "ipc AtomicP2P FP8_FAST_ACCUM", Op::AG, 4096, 2048, 1024, e4, bf, false, ++seed);
    comm_gemm_case(e, ctx, "ipc AtomicP2P", Op::AG, 4096, 2048, 1024, bf, bf, false, ++seed);
    comm_gemm_case(e, ctx, "ipc AtomicP2P", Op::RS, 512, 1024, 512, bf, bf, false, ++seed);
    comm_gemm_case(e, ctx, "ipc AtomicP2P", Op::RS, 2048, 4096, 1024, bf, bf, false, ++seed);
    comm_gemm_case(e, fast, "ipc AtomicP2P FP8_FAST_ACCUM", Op::RS, 512, 1024, 512, e4, bf, false, ++seed);
    comm_gemm_case(e, ctx, "ipc AtomicP2P", Op::AR, 512, 1024, 512, bf, bf, false, ++seed);
    comm_gemm_case(e, ctx, "ipc AtomicP2P (cuBLASLt: bias)", Op::AR, 512, 1024, 512, bf, bf, true, ++seed);
    // m = 3072, n = 4096, k = 1024: at one rank (no arrival flags) the tile rule takes the
    // ping-pong kernel (BN 192; src/gemm/sm90.rs pick_tile); with more ranks the
    // cooperative one, as every GEMM that waits on flags.
    comm_gemm_case(e, ctx, "ipc AtomicP2P (ping-pong tiles at 1 rank)", Op::AG, 3072, 4096, 1024, bf, bf, false, ++seed,
                   3);
    comm_gemm_case(e, fast, "ipc AtomicP2P FP8_FAST_ACCUM (ping-pong tiles at 1 rank)", Op::AG, 3072, 4096, 1024, e4, bf,
                   false, ++seed, 3);
    comm_gemm_case(e, ctx, "ipc SplitP2P (control)", Op::AG, 1024, 512, 256, bf, bf, false, ++seed, 2, kNVTECommGemmAlgoSplitP2P);
  }
  if (ctx) nvte_comm_gemm_ctx_destroy(ctx);
  if (fast) nvte_comm_gemm_ctx_destroy(fast);
  MPI_Barrier(MPI_COMM_WORLD);
}

// ---------------------------------------------------------------- engine API
NVTECommOverlap *make_engine(Env &e, size_t rows, size_t cols, bool use_ce) {
  NVTECommOverlapConfig cfg;
  nvte_comm_overlap_config_default(&cfg);
  cfg.atomic_gemm = true;
  cfg.use_ce = use_ce;
  cfg.transport = NVTE_COMM_TRANSPORT_IPC;
  NVTECommBootstrap bs = bootstrap(e);
  NVTECommOverlap *o = nullptr;
  NVTECommStatus st = nvte_comm_overlap_create(&bs, &cfg, rows, cols, kNVTEBFloat16, &o);
  e.rep->check(st == NVTE_COMM_SUCCESS, std::string("engine create (atomic_gemm): ") + nvte_comm_status_string(st) + " " +
                                            nvte_comm_last_error());
  return st == NVTE_COMM_SUCCESS ? o : nullptr;
}

NVTETensor ws_tensor(Env &e, Tensor &holder) {
  holder.h = nvte_create_tensor(NVTE_DELAYED_TENSOR_SCALING);
  NVTEBasicTensor b = basic(e.ws.p, kNVTEByte, {e.ws.bytes});
  nvte_set_tensor_param_v2(holder.h, kNVTERowwiseData, &b, sizeof b);
  return holder.h;
}

// split_ag (ag) or split_rs_p2p on an atomic_gemm engine: `calls` calls with fresh inputs
// each (eagerly, or `graph`: one capture after an eager call, replayed with fresh inputs
// written into the captured buffers before every replay), each output checked.
void engine_case(Env &e, bool ag, bool use_ce, bool view, bool graph) {
  const size_t nc = 512, n = nc * e.size, k = 1024, m = 768, kl = k / e.size;
  const NVTEDType bf = kNVTEBFloat16;
  char what[200];
  std::snprintf(what, sizeof what, "engine %s atomic_gemm %s%s%s n=%zu k=%zu m=%zu tp=%d", ag ? "split_ag (fused)" : "split_rs_p2p (fused ring)",
                use_ce ? "CE" : "SM", view ? " buffer-view B" : "", graph ? " CUDA graph" : "", n, k, m, e.size);
  NVTECommOverlap *o = make_engine(e, n, ag ? k : m, use_ce);
  if (!o) return;
  Tensor wsh;
  NVTETensor ws = ws_tensor(e, wsh);
  Tensor A(bf, {m, ag ? k : kl}), B(bf, {ag ? nc : n, ag ? k : kl}), D(bf, {ag ? n : nc, m}), Bc(bf, {n, k});
  NVTETensor view_h = nullptr, bview = nullptr;
  nvte_comm_overlap_get_buffer(o, false, &view_h);
  if (view) nvte_comm_overlap_get_buffer(o, true, &bview);  // this rank's chunk of the buffer
  auto call = [&]() {
    NVTECommStatus st;
    if (ag)
      st = nvte_comm_overlap_split_ag(o, A.h, true, view ? view_h : B.h, false, D.h, nullptr, nullptr, false, ws, false, true, Bc.h, e.s);
    else
      st = nvte_comm_overlap_split_rs_p2p(o, A.h, true, B.h, false, view_h, nullptr, nullptr, false, ws, false, true, D.h, e.s);
    return st;
  };
  int bad = 0, calls = graph ? 5 : g_calls;
  double worst = 0;
  std::string fail;
  cudaGraphExec_t exec = nullptr;
  for (int it = 0; it < calls && fail.empty(); ++it) {
    uint64_t seed = 9000 + 31 * it + (ag ? 0 : 7) + (view ? 3 : 0);
    std::vector<float> Ag = random(m * k, seed), Bg = random(n * k, seed + 1);
    std::vector<float> Al = ag ? Ag : cols_of(Ag, m, k, e.rank * kl, kl);
    std::vector<float> Bl = ag ? rows_of(Bg, k, e.rank * nc, nc) : cols_of(Bg, n, k, e.rank * kl, kl);
    upload_into(A, Al, e.s);
    upload_into(B, Bl, e.s);
    if (view) CUDA_OK(cudaMemcpyAsync(nvte_tensor_data(bview), B.data.p, B.data.bytes, cudaMemcpyDeviceToDevice, e.s));
    CUDA_OK(cudaMemsetAsync(D.data.p, 0xFF, D.data.bytes, e.s));
    NVTECommStatus st = NVTE_COMM_SUCCESS;
    if (graph && it == 0) {
      st = call();  // eager warm-up, then the capture
      CUDA_OK(cudaStreamSynchronize(e.s));
      cudaGraph_t g = nullptr;
      CUDA_OK(cudaStreamBeginCapture(e.s, cudaStreamCaptureModeThreadLocal));
      NVTECommStatus cst = call();
      cudaError_t ce = cudaStreamEndCapture(e.s, &g);
      if (cst != NVTE_COMM_SUCCESS || ce != cudaSuccess) {
        fail = std::string("capture: ") + nvte_comm_status_string(cst) + " " + nvte_comm_last_error() + " / " + cudaGetErrorString(ce);
        break;
      }
      CUDA_OK(cudaGraphInstantiate(&exec, g, 0));
      cudaGraphDestroy(g);
      CUDA_OK(cudaMemsetAsync(D.data.p, 0xFF, D.data.bytes, e.s));
    }
    if (graph) {
      if (view) CUDA_OK(cudaMemcpyAsync(nvte_tensor_data(bview), B.data.p, B.data.bytes, cudaMemcpyDeviceToDevice, e.s));
      CUDA_OK(cudaGraphLaunch(exec, e.s));
    } else {
      st = call();
    }
    CUDA_OK(cudaStreamSynchronize(e.s));
    if (st != NVTE_COMM_SUCCESS) {
      fail = std::string("call ") + std::to_string(it) + ": " + nvte_comm_status_string(st) + ": " + nvte_comm_last_error();
      break;
    }
    std::vector<double> ref = reference(Ag, Bg, nullptr, m, n, k, bf, bf, e.s);
    std::vector<double> want = ag ? ref : std::vector<double>(ref.begin() + e.rank * nc * m, ref.begin() + (e.rank + 1) * nc * m);
    double err = rel_err(decode(D.data.download(), bf, want.size()), want);
    if (!(err < 1e-2)) ++bad;
    if (!(err <= worst)) worst = err;
    if (ag) {  // B_copy: the gathered B, bit for bit as quantized
      Tensor Bq(bf, {n, k});
      upload_into(Bq, Bg, e.s);
      if (Bq.data.download() != Bc.data.download()) ++bad;
    }
  }
  if (exec) cudaGraphExecDestroy(exec);
  NVTECommStatus sy = nvte_comm_overlap_synchronize(o);
  char b[160];
  std::snprintf(b, sizeof b, ": %d %s, worst rel_err=%.3g (tol 1e-2), %d bad%s", calls, graph ? "replays" : "calls", worst, bad,
                sy == NVTE_COMM_SUCCESS ? "" : " (synchronize failed)");
  e.rep->check(fail.empty() && bad == 0 && sy == NVTE_COMM_SUCCESS, std::string(what) + (fail.empty() ? b : ": " + fail));
  nvte_comm_overlap_destroy(o);
  MPI_Barrier(MPI_COMM_WORLD);
}

}  // namespace

int main(int argc, char **argv) {
  probe_one_gpu_or_continue(argc, argv);  // ranks may share GPUs
  MPI_Init(&argc, &argv);
  Report rep;
  Env e{};
  e.rep = &rep;
  MPI_Comm_rank(MPI_COMM_WORLD, &e.rank);
  MPI_Comm_size(MPI_COMM_WORLD, &e.size);
  rep.rank = e.rank;
  for (int i = 1; i + 1 < argc; ++i)
    if (!std::strcmp(argv[i], "--calls")) g_calls = std::max(1, std::atoi(argv[i + 1]));
  int ndev = 0;
  CUDA_OK(cudaGetDeviceCount(&ndev));
  CUDA_OK(cudaSetDevice(e.rank % ndev));
  CUDA_OK(cudaStreamCreateWithFlags(&e.s, cudaStreamNonBlocking));
  e.ws = DevBuf(32u << 20);
  if (e.rank == 0) std::printf("test_fused: %d rank(s) on %d GPU(s)\n", e.size, ndev);
  comm_gemm_cases(e);
  for (bool ag : {true, false}) {
    engine_case(e, ag, true, false, false);
    engine_case(e, ag, false, false, false);
    engine_case(e, ag, true, false, true);
  }
  engine_case(e, true, true, true, false);
  int rc = rep.finish("test_fused");
  e.ws = DevBuf();
  MPI_Finalize();
  return rc;
}
