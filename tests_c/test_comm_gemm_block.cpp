// The comm-GEMM API with block-scaled FP8 inputs (TE's Float8BlockScaling: a 2D-scaled
// weight A with a 1D-scaled activation B, and both 1D): nvte_gemm_reduce_scatter and
// nvte_gemm_all_reduce at every tp (k split: each rank's A [m, k/tp] and B [n, k/tp]),
// nvte_all_gather_gemm at every tp (m and n split: each rank's A [m/tp, k] and its B shard
// [128, k] of whole 128-row blocks, gathered with its block scales; also a 1D A with a
// 2D B, and the fused algorithm's value kNVTECommGemmAlgoAtomicP2P, which runs the ring
// for block inputs), float32 and bfloat16 outputs, against a float64 reference on the
// dequantized inputs. The operands are quantized on the GPU by nvte_quantize (GEMM-ready
// scales) and dequantized by nvte_dequantize, so the reference sees exactly the values
// the GEMM reads. m = 384 is three 128-row tiles of A: the pipelined reduce-scatter cuts
// a 2D-scaled A at whole tiles; the all-gather's m = 128 tp (each rank's A one tile). Then each operation captured in a CUDA graph and replayed
// into a poisoned D, checked again. The userbuffers API on the same operands:
// nvte_comm_overlap_split_rs and _split_rs_p2p (float32 buffer), and
// nvte_comm_overlap_split_ag with this rank's block-scaled shard (an e4m3 buffer with room
// for the gathered B and every rank's scales), eager and replayed, without and with a
// B_copy (then all of B, data and GEMM-ready scales: dequantized, every shard's values).
//
// Tolerance per element: |d - ref| <= 2e-3 sum_l |a_l b_l| + (tp + 1) u sum_l |a_l b_l|,
// with u the unit roundoff of D's type (0 for float32, 2^-8 for bfloat16): the FP8 tensor
// cores' reduced-precision accumulation inside a 128-value block (test_block_gemm
// measures 1e-4 .. 2.7e-4 relative on an H200) and the rounding of the partial sums in
// D's type along the reduction.
//
// Contexts come from MPI allgather / barrier callbacks over the IPC transport, so any
// number of ranks may share one GPU (run_mpi.sh N: rank r uses GPU r % count).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>

#include "test_util.hpp"

using namespace tu;

namespace {

int mpi_allgather(void *, void *global, size_t, const void *local, size_t local_bytes) {
  return MPI_Allgather(local, (int)local_bytes, MPI_BYTE, global, (int)local_bytes, MPI_BYTE, MPI_COMM_WORLD);
}
int mpi_barrier(void *) { return MPI_Barrier(MPI_COMM_WORLD); }

size_t ceil_div(size_t a, size_t b) { return (a + b - 1) / b; }
size_t pad4(size_t a) { return ceil_div(a, 4) * 4; }

// A block-scaled e4m3 tensor [R, C] (rowwise data, GEMM-ready scales) quantized on the GPU
// from host values, and its dequantized values.
struct Block {
  NVTETensor h = nullptr;
  DevBuf data, sinv;
  std::vector<double> deq;
  Block(const std::vector<float> &x, size_t R, size_t C, bool two_d, cudaStream_t s) {
    std::vector<size_t> sshape = two_d ? std::vector<size_t>{ceil_div(R, 128), pad4(ceil_div(C, 128))}
                                       : std::vector<size_t>{ceil_div(C, 128), pad4(R)};
    h = nvte_create_tensor(two_d ? NVTE_BLOCK_SCALING_2D : NVTE_BLOCK_SCALING_1D);
    data = DevBuf(R * C);
    sinv = DevBuf(4 * sshape[0] * sshape[1]);
    NVTEBasicTensor d = basic(data.p, kNVTEFloat8E4M3, {R, C}), sc = basic(sinv.p, kNVTEFloat32, sshape);
    nvte_set_tensor_param_v2(h, kNVTERowwiseData, &d, sizeof(d));
    nvte_set_tensor_param_v2(h, kNVTERowwiseScaleInv, &sc, sizeof(sc));
    Tensor src(kNVTEFloat32, {R, C});
    src.data.upload(x.data());
    // Each call's status on its own (a later successful call resets the last status).
    nvte_quantize(src.h, h, s);
    ok = nvte_comm_last_status() == NVTE_COMM_SUCCESS;
    if (!ok) { err = nvte_comm_last_error(); return; }
    Tensor back(kNVTEFloat32, {R, C});
    nvte_dequantize(h, back.h, s);
    CUDA_OK(cudaStreamSynchronize(s));
    ok = nvte_comm_last_status() == NVTE_COMM_SUCCESS;
    if (!ok) err = nvte_comm_last_error();
    if (ok) deq = decode(back.data.download(), kNVTEFloat32, R * C);
  }
  Block(const Block &) = delete;
  Block &operator=(const Block &) = delete;
  ~Block() { if (h) nvte_destroy_tensor(h); }
  bool ok = false;
  std::string err;
};

// Columns [c0, c0 + nc) of a row-major [rows, cols] host matrix.
std::vector<float> cols_of(const std::vector<float> &h, size_t rows, size_t cols, size_t c0, size_t nc) {
  std::vector<float> o(rows * nc);
  for (size_t i = 0; i < rows; ++i)
    for (size_t j = 0; j < nc; ++j) o[i * nc + j] = h[i * cols + c0 + j];
  return o;
}

NVTECommGemmCtx *make_ctx(int rank, int size) {
  setenv("NVTE_COMM_TRANSPORT", "ipc", 1);
  setenv("NVTE_COMM_TUNE", "0", 1);
  NVTECommBootstrap bs{};
  bs.world_rank = rank;
  bs.world_size = size;
  bs.allgather = mpi_allgather;
  bs.barrier = mpi_barrier;
  NVTECommGemmCtx *ctx = nullptr;
  NVTECommStatus st = nvte_comm_gemm_ctx_create_bootstrap(&bs, &ctx);
  unsetenv("NVTE_COMM_TUNE");
  unsetenv("NVTE_COMM_TRANSPORT");
  return st == NVTE_COMM_SUCCESS ? ctx : nullptr;
}

enum Op { kAg, kRs, kAr };
const char *op_name(Op o) { return o == kAg ? "all_gather_gemm" : o == kRs ? "gemm_reduce_scatter" : "gemm_all_reduce"; }

struct Case {
  Op op;
  bool a_2d;
  NVTEDType td;
  bool b_2d = false;
  NVTECommGemmAlgoType algo = kNVTECommGemmAlgoSplitP2P;
};

// D [rows, m] on the host against the reference rows [row0, row0 + rows) of ref / mag.
int compare(Report &rep, const std::string &what, const DevBuf &d, NVTEDType td, const std::vector<double> &ref,
            const std::vector<double> &mag, int64_t row0, int64_t rows, int64_t m, int size) {
  std::vector<double> got = decode(d.download(), td, rows * m);
  const double u = td == kNVTEBFloat16 ? std::ldexp(1.0, -8) : 0.0;
  int bad = 0;
  double worst = 0;
  for (int64_t i = 0; i < rows * m; ++i) {
    double want = ref[row0 * m + i], bound = (2e-3 + (size + 1) * u) * mag[row0 * m + i] + 1e-6;
    double err = std::fabs(got[i] - want);
    if (!(err <= bound)) ++bad;
    worst = std::max(worst, std::isnan(err) ? INFINITY : err / bound);
  }
  char b[160];
  std::snprintf(b, sizeof b, ": %d of %lld outside the bound (largest err / bound %.3f)", bad, (long long)(rows * m), worst);
  rep.check(bad == 0, what + b);
  return bad;
}

// The userbuffers objects: the reduce-scatter's (float32 GEMM output [n, m]) and the
// all-gather's (e4m3: the gathered B [n, k] and every rank's scale slot behind it).
struct Overlaps {
  NVTECommOverlap *rs = nullptr;
  NVTECommOverlap *ag = nullptr;
};

// The userbuffers API's GEMM + reduce-scatter (both entry points) on the same block-scaled
// operands: the GEMM into the buffer ([n, m], float32), rs_output [n/tp, m].
void run_overlap_rs(Report &rep, NVTECommOverlap *ov, const std::string &what, NVTETensor a, NVTETensor b,
                    const std::vector<double> &ref, const std::vector<double> &mag, int64_t n, int64_t m, int rank, int size,
                    cudaStream_t s) {
  Tensor W(kNVTEByte, {(size_t)32 << 20});
  const int64_t rows = n / size;
  for (bool p2p : {false, true}) {
    Tensor out(kNVTEFloat32, {(size_t)rows, (size_t)m});
    out.data.poison();
    auto fn = p2p ? nvte_comm_overlap_split_rs_p2p : nvte_comm_overlap_split_rs;
    NVTECommStatus st = fn(ov, a, true, b, false, nullptr, nullptr, nullptr, false, W.h, false, true, out.h, s);
    std::string msg = nvte_comm_last_error();
    CUDA_OK(cudaStreamSynchronize(s));
    const std::string w = what + (p2p ? " [userbuffers split_rs_p2p]" : " [userbuffers split_rs]");
    if (st != NVTE_COMM_SUCCESS) {
      rep.fail(w + ": " + nvte_comm_status_string(st) + ": " + msg);
      continue;
    }
    compare(rep, w, out.data, kNVTEFloat32, ref, mag, rank * rows, rows, m, size);
  }
}

// `call` (which enqueues on `s` and returns its status) into a poisoned D, checked; then
// captured in a CUDA graph and replayed twice into a poisoned D, checked again. `after`
// (when given) runs after each of the three checks, with its label.
void eager_and_replayed(Report &rep, const std::string &what, const std::function<NVTECommStatus()> &call, DevBuf &d,
                        NVTEDType td, const std::vector<double> &ref, const std::vector<double> &mag, int64_t row0,
                        int64_t rows, int64_t m, int size, cudaStream_t s,
                        const std::function<void(const std::string &)> &after = nullptr) {
  d.poison();
  NVTECommStatus st = call();
  std::string msg = nvte_comm_last_error();
  CUDA_OK(cudaStreamSynchronize(s));
  if (st != NVTE_COMM_SUCCESS) {
    rep.fail(what + ": " + nvte_comm_status_string(st) + ": " + msg);
    return;
  }
  if (compare(rep, what + " (eager)", d, td, ref, mag, row0, rows, m, size) != 0) return;
  if (after) after(" (eager)");
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  st = call();
  msg = nvte_comm_last_error();
  CUDA_OK(cudaStreamEndCapture(s, &graph));
  if (st != NVTE_COMM_SUCCESS) {
    rep.fail(what + ": captured call: " + msg);
  } else {
    CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
    for (int replay = 0; replay < 2; ++replay) {
      d.poison();
      CUDA_OK(cudaGraphLaunch(exec, s));
      CUDA_OK(cudaStreamSynchronize(s));
      compare(rep, what + " (graph replay " + std::to_string(replay) + ")", d, td, ref, mag, row0, rows, m, size);
      if (after) after(" (graph replay " + std::to_string(replay) + ")");
    }
    CUDA_OK(cudaGraphExecDestroy(exec));
  }
  if (graph) CUDA_OK(cudaGraphDestroy(graph));
}

// ref / mag [n, m] += the dequantized product of b [n, ks] and a [m, ks] (rows j0.. of ref).
void accumulate_ref(std::vector<double> &ref, std::vector<double> &mag, const Block &a, const Block &b, int64_t j0,
                    int64_t nb, int64_t m, int64_t ks) {
  for (int64_t j = 0; j < nb; ++j)
    for (int64_t i = 0; i < m; ++i) {
      double acc = 0, am = 0;
      for (int64_t l = 0; l < ks; ++l) {
        double p = b.deq[j * ks + l] * a.deq[i * ks + l];
        acc += p;
        am += std::fabs(p);
      }
      ref[(j0 + j) * m + i] += acc;
      mag[(j0 + j) * m + i] += am;
    }
}

// A B_copy of block-scaled B [n, k]: e4m3 data with B's block mode and the GEMM-ready
// scales of all of B, poisoned.
struct Gathered {
  NVTETensor h = nullptr;
  DevBuf data, sinv;
  Gathered(size_t n, size_t k, bool two_d) {
    std::vector<size_t> sshape = two_d ? std::vector<size_t>{ceil_div(n, 128), pad4(ceil_div(k, 128))}
                                       : std::vector<size_t>{ceil_div(k, 128), pad4(n)};
    h = nvte_create_tensor(two_d ? NVTE_BLOCK_SCALING_2D : NVTE_BLOCK_SCALING_1D);
    data = DevBuf(n * k);
    sinv = DevBuf(4 * sshape[0] * sshape[1]);
    data.poison();
    sinv.poison();
    NVTEBasicTensor d = basic(data.p, kNVTEFloat8E4M3, {n, k}), sc = basic(sinv.p, kNVTEFloat32, sshape);
    nvte_set_tensor_param_v2(h, kNVTERowwiseData, &d, sizeof(d));
    nvte_set_tensor_param_v2(h, kNVTERowwiseScaleInv, &sc, sizeof(sc));
  }
  Gathered(const Gathered &) = delete;
  Gathered &operator=(const Gathered &) = delete;
  ~Gathered() { nvte_destroy_tensor(h); }
};

// The userbuffers API's all-gather + GEMM on this rank's block-scaled shard B [n/tp, k]
// and A [m/tp, k]: D [n, m/tp] (float32), eager and replayed; with a B_copy, which then
// holds all of B: dequantized by nvte_dequantize, every rank's shard values (`b_all`)
// exactly.
void run_overlap_ag(Report &rep, NVTECommOverlap *ov, const std::string &what, NVTETensor a, NVTETensor b,
                    const std::vector<double> &ref, const std::vector<double> &mag, int64_t n, int64_t ml, int size,
                    cudaStream_t s, const std::vector<double> *b_all = nullptr, bool b_2d = false) {
  Tensor W(kNVTEByte, {(size_t)32 << 20});
  Tensor D(kNVTEFloat32, {(size_t)n, (size_t)ml});
  const size_t k = b_all ? b_all->size() / n : 0;
  std::unique_ptr<Gathered> bc(b_all ? new Gathered(n, k, b_2d) : nullptr);
  auto call = [&] {
    return nvte_comm_overlap_split_ag(ov, a, true, b, false, D.h, nullptr, nullptr, false, W.h, false, true,
                                      bc ? bc->h : nullptr, s);
  };
  const std::string name = what + (bc ? " [userbuffers split_ag, B_copy]" : " [userbuffers split_ag]");
  // After each run: B_copy dequantized against the shards, then poisoned again (each
  // replay must write it too).
  auto check_copy = [&](const std::string &when) {
    Tensor back(kNVTEFloat32, {(size_t)n, k});
    nvte_dequantize(bc->h, back.h, s);
    const bool ok = nvte_comm_last_status() == NVTE_COMM_SUCCESS;
    CUDA_OK(cudaStreamSynchronize(s));
    std::vector<double> got = ok ? decode(back.data.download(), kNVTEFloat32, n * k) : std::vector<double>();
    size_t bad = 0;
    for (size_t i = 0; i < got.size(); ++i) bad += got[i] != (*b_all)[i];
    rep.check(ok && bad == 0, name + when + ": B_copy dequantized equals every rank's shard (" +
                                  std::to_string(bad) + " elements differ" +
                                  (ok ? ")" : "; " + std::string(nvte_comm_last_error()) + ")"));
    bc->data.poison();
    bc->sinv.poison();
  };
  std::function<void(const std::string &)> after;
  if (bc) after = check_copy;
  eager_and_replayed(rep, name, call, D.data, kNVTEFloat32, ref, mag, 0, n, ml, size, s, after);
}

void run_case(Report &rep, NVTECommGemmCtx *ctx, const Overlaps &ovs, const Case &c, uint64_t seed, int rank, int size,
              cudaStream_t s) {
  const bool ag = c.op == kAg;
  // B's rows: whole 128-row blocks per rank; the all-gather's A rows too (m split: each
  // rank quantizes its own [m/tp, k], which nvte_quantize takes in whole 128-row blocks).
  const int64_t m = ag ? 128 * size : 384, n = 128 * size, kpr = 256;
  const int64_t k = ag ? kpr : kpr * size;
  // The all-gather splits m and n (each rank's A rows and B shard), the reductions k.
  const int64_t ml = ag ? m / size : m, nb = ag ? n / size : n, ks = ag ? k : kpr;
  char buf[256];
  std::snprintf(buf, sizeof buf, "tp %d %s A %s x B %s -> %s m=%lld n=%lld k=%lld%s", size, op_name(c.op),
                c.a_2d ? "2D" : "1D", c.b_2d ? "2D" : "1D", dtype_name(c.td), (long long)m, (long long)n, (long long)k,
                c.algo == kNVTECommGemmAlgoAtomicP2P ? " (AtomicP2P)" : "");
  const std::string what = buf;
  Rng rng(seed);
  std::vector<float> A(m * k), B(n * k);
  for (auto &x : A) x = (float)rng.uniform(-2, 2);
  for (auto &x : B) x = (float)rng.uniform(-3, 3);
  // Every rank's share quantized here (the same kernel on the same values gives every
  // rank the same bytes); the reference sums their dequantized products in float64.
  // All-gather: this rank's A rows, every rank's B shard; reductions: every k share.
  const int shares = size;
  std::vector<double> ref(n * ml, 0.0), mag(n * ml, 0.0);
  Block *mine_a = nullptr, *mine_b = nullptr;
  std::vector<Block *> keep;
  std::vector<double> b_all;  // the all-gather: every rank's B shard, dequantized, in order
  for (int q = 0; q < shares; ++q) {
    Block *a = nullptr;
    if (!ag || q == 0) {
      std::vector<float> as = ag ? std::vector<float>(A.begin() + rank * ml * k, A.begin() + (rank + 1) * ml * k)
                                 : cols_of(A, m, k, q * ks, ks);
      a = new Block(as, ml, ks, c.a_2d, s);
      keep.push_back(a);
    } else {
      a = mine_a;
    }
    std::vector<float> bs = ag ? std::vector<float>(B.begin() + q * nb * k, B.begin() + (q + 1) * nb * k)
                               : cols_of(B, n, k, q * ks, ks);
    auto *b = new Block(bs, nb, ks, c.b_2d, s);
    keep.push_back(b);
    if (!a->ok || !b->ok) {
      rep.fail(what + ": nvte_quantize / nvte_dequantize: " + (a->ok ? b->err : a->err));
      for (Block *x : keep) delete x;
      return;
    }
    accumulate_ref(ref, mag, *a, *b, ag ? q * nb : 0, nb, ml, ks);
    if (ag) b_all.insert(b_all.end(), b->deq.begin(), b->deq.end());
    if (ag ? q == 0 : q == rank) mine_a = a;
    if (q == rank) mine_b = b;
  }
  const int64_t rows = c.op == kRs ? n / size : n, row0 = c.op == kRs ? rank * (n / size) : 0;
  Tensor D(c.td, {(size_t)rows, (size_t)ml});
  auto fn = c.op == kAg ? nvte_all_gather_gemm : c.op == kRs ? nvte_gemm_reduce_scatter : nvte_gemm_all_reduce;
  auto call = [&] {
    fn(ctx, m, n, k, mine_a->h, mine_b->h, D.h, nullptr, nullptr, true, false, false, false, 0, s, c.algo);
    return nvte_comm_last_status();
  };
  eager_and_replayed(rep, what, call, D.data, c.td, ref, mag, row0, rows, ml, size, s);
  if (c.op == kRs && c.td == kNVTEFloat32 && ovs.rs)
    run_overlap_rs(rep, ovs.rs, what, mine_a->h, mine_b->h, ref, mag, n, m, rank, size, s);
  if (ag && c.td == kNVTEFloat32 && c.algo == kNVTECommGemmAlgoSplitP2P && ovs.ag) {
    run_overlap_ag(rep, ovs.ag, what, mine_a->h, mine_b->h, ref, mag, n, ml, size, s);
    run_overlap_ag(rep, ovs.ag, what, mine_a->h, mine_b->h, ref, mag, n, ml, size, s, &b_all, c.b_2d);
  }
  for (Block *x : keep) delete x;
}

// A userbuffers object over the IPC transport: a [rows, cols] buffer of `dtype`.
NVTECommOverlap *make_overlap(Report &rep, int rank, int size, size_t rows, size_t cols, NVTEDType dtype) {
  NVTECommOverlapConfig cfg;
  nvte_comm_overlap_config_default(&cfg);
  cfg.transport = NVTE_COMM_TRANSPORT_IPC;
  NVTECommBootstrap bs{};
  bs.world_rank = rank;
  bs.world_size = size;
  bs.allgather = mpi_allgather;
  bs.barrier = mpi_barrier;
  NVTECommOverlap *ov = nullptr;
  if (nvte_comm_overlap_create(&bs, &cfg, rows, cols, dtype, &ov) != NVTE_COMM_SUCCESS) {
    rep.fail(std::string("nvte_comm_overlap_create: ") + nvte_comm_last_error());
    return nullptr;
  }
  return ov;
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
  cudaDeviceProp prop{};
  CUDA_OK(cudaGetDeviceProperties(&prop, rank % ndev));
  if (prop.major != 9) {
    // Block-scaled GEMMs run on Hopper only (cuBLASLt's block scale modes).
    if (rank == 0) std::printf("SKIPPED: block-scaled FP8 GEMMs need Hopper (sm_90); device is sm_%d%d\n", prop.major, prop.minor);
    MPI_Finalize();
    return 77;
  }
  cudaStream_t s;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  NVTECommGemmCtx *ctx = make_ctx(rank, size);
  Overlaps ovs;
  // The reduce-scatter's GEMM output [n, m] = [128 tp, 384] float32; the all-gather's B
  // [128 tp, 256] e4m3 and tp scale slots of at most 1 KiB each (1D scales of a [128, 256]
  // shard: [2, 128] float32), 256-byte aligned: 4 more rows of 256 bytes per rank.
  ovs.rs = make_overlap(rep, rank, size, 128 * (size_t)size, 384, kNVTEFloat32);
  ovs.ag = make_overlap(rep, rank, size, 132 * (size_t)size, 256, kNVTEFloat8E4M3);
  if (!ctx) {
    rep.fail(std::string("ctx_create_bootstrap: ") + nvte_comm_last_error());
  } else {
    uint64_t seed = 4100;
    for (Op op : {kRs, kAr, kAg})
      for (bool a_2d : {true, false})
        for (NVTEDType td : {kNVTEFloat32, kNVTEBFloat16})
          run_case(rep, ctx, ovs, Case{op, a_2d, td}, ++seed, rank, size, s);
    // The all-gather with a 2D-scaled B (1D A), and with the fused algorithm's value.
    run_case(rep, ctx, ovs, Case{kAg, false, kNVTEFloat32, true}, ++seed, rank, size, s);
    run_case(rep, ctx, ovs, Case{kAg, true, kNVTEBFloat16, false, kNVTECommGemmAlgoAtomicP2P}, ++seed, rank, size, s);
    nvte_comm_gemm_ctx_destroy(ctx);
  }
  if (ovs.rs) nvte_comm_overlap_destroy(ovs.rs);
  if (ovs.ag) nvte_comm_overlap_destroy(ovs.ag);
  CUDA_OK(cudaStreamDestroy(s));
  int rc = rep.finish("test_comm_gemm_block");
  MPI_Finalize();
  return rc;
}
