// CUDA graphs: every algorithm of both APIs captured with cudaStreamBeginCapture on the
// caller's stream, in global and thread-local capture modes, then replayed back to back
// (no host synchronisation between replays) with fresh random inputs written into the
// captured input buffers before every replay (nvte_comm_fill_uniform with a new seed), an
// eager call of the same operation on the same object / context after every tenth replay,
// and every replay's output kept and checked afterwards against a reference computed
// eagerly (NCCL collective + nvte_cublas_gemm) by relative error.
// - Engine (nvte_comm_overlap_*, IPC): split_ag unidirectional and bidirectional, the
//   fused all-gather and the fused ring reduce-scatter (config atomic_gemm),
//   split_rs (pipelined), split_rs_p2p (ring), bulk AG and bulk RS (copy_into_buffer
//   captured with them); copy-engine puts, and SM puts for the rings. Thread-local mode
//   after an eager warm-up call; global mode with the very first call of a fresh object
//   inside the capture (it must work), and nvte_comm_overlap_synchronize during the open
//   capture (it must be refused, leaving the capture intact).
// - comm-GEMM (comm_gemm.h): nvte_all_gather_gemm, nvte_gemm_reduce_scatter and
//   nvte_gemm_all_reduce with NVTE_COMM_AR_ALGO=ring and =chunked (and ring with SM puts)
//   at the shape of the reported failure (4096 tokens x k 4096 x m 8192, bf16, TN). In
//   global mode the first call of a fresh context is made inside a capture: it must fail
//   cleanly (UNSUPPORTED, nothing captured, the capture still valid); then an eager warm-up
//   call and the capture work. A graph must survive an eager call that replaces its engine
//   with a larger one. The NCCL transport too (smaller shapes).
// - A comm-GEMM context (IPC, NCCL) and a userbuffers object destroyed on another thread
//   during a global-mode capture leave the capture valid; a destroy while a capture
//   holding the object's own calls is open is refused, the capture left intact.
// Options: --replays N (default 100); --only TEXT (the cases whose name contains TEXT);
// --skip-first-call (every capture after an eager warm-up call; no first-call checks).
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <thread>

#include "nccl_util.hpp"
#include "test_util.hpp"

using namespace tu;

namespace {

int g_replays = 100;
std::string g_only;
bool g_skip_first = false;

bool selected(const std::string &label) { return g_only.empty() || label.find(g_only) != std::string::npos; }
constexpr int kEagerEvery = 10;  // an eager call after replays j with j % 10 == 5
const int64_t kTimeoutMs = 20000;

struct Env {
  int rank, size;
  ncclComm_t nccl;
  cudaStream_t s;
  DevBuf ws;
  NVTETensor ws_t = nullptr;
  Report *rep;
};

// A tensor handle over memory the caller owns (destroyed by the holder).
struct View {
  NVTETensor h = nullptr;
  View() = default;
  View(void *p, NVTEDType t, std::vector<size_t> shape) {
    if (nvte_comm_tensor_create_simple(p, t, shape.data(), shape.size(), &h) != NVTE_COMM_SUCCESS) {
      std::fprintf(stderr, "tensor_create_simple: %s\n", nvte_comm_last_error());
      MPI_Abort(MPI_COMM_WORLD, 4);
    }
  }
  View(const View &) = delete;
  View &operator=(const View &) = delete;
  ~View() { if (h) nvte_destroy_tensor(h); }
};

void fill(Tensor &t, uint64_t seed, cudaStream_t s) {
  if (nvte_comm_fill_uniform(t.h, seed, -1.0f, 1.0f, s) != NVTE_COMM_SUCCESS) {
    std::fprintf(stderr, "fill: %s\n", nvte_comm_last_error());
    MPI_Abort(MPI_COMM_WORLD, 4);
  }
}

void poison(void *p, size_t bytes, cudaStream_t s) { CUDA_OK(cudaMemsetAsync(p, 0xFF, bytes, s)); }

// The same answer on every rank: true when `ok` holds on all of them.
bool all_ok(bool ok) {
  int mine = ok ? 1 : 0, all = 0;
  MPI_Allreduce(&mine, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  return all == 1;
}

std::string status_text(NVTECommStatus st) {
  return std::string(nvte_comm_status_string(st)) + (st == NVTE_COMM_SUCCESS ? "" : std::string(": ") + nvte_comm_last_error());
}

// ---------------------------------------------------------------- host comparison
struct Pinned {
  void *p = nullptr;
  size_t bytes = 0;
  void *get(size_t b) {
    if (b > bytes) {
      if (p) CUDA_OK(cudaFreeHost(p));
      CUDA_OK(cudaMallocHost(&p, b));
      bytes = b;
    }
    return p;
  }
  ~Pinned() { if (p) cudaFreeHost(p); }
};
Pinned g_ha, g_hb;

template <int T>
inline double ld(const void *base, size_t i) {
  if (T == 0) return ((const float *)base)[i];
  if (T == 1) {
    uint32_t u = (uint32_t)((const uint16_t *)base)[i] << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  return decode_f16(((const uint16_t *)base)[i]);
}

int code(NVTEDType t) { return t == kNVTEFloat32 ? 0 : t == kNVTEBFloat16 ? 1 : 2; }

template <int A, int B>
void sums(const void *a, const void *b, size_t lo, size_t hi, double *num, double *den) {
  double x = 0, y = 0;
  for (size_t i = lo; i < hi; ++i) {
    double r = ld<B>(b, i), d = ld<A>(a, i) - r;
    x += d * d;
    y += r * r;
  }
  *num = x, *den = y;
}

// ||a - b|| / ||b|| of two device arrays of n elements (f32 / bf16 / f16); NaN anywhere
// gives NaN (never passes a `<` check).
double rel_err_dev(const void *a, NVTEDType ta, const void *b, NVTEDType tb, size_t n) {
  if (n == 0) return 0;
  void *ha = g_ha.get(n * dtype_bytes(ta)), *hb = g_hb.get(n * dtype_bytes(tb));
  CUDA_OK(cudaMemcpy(ha, a, n * dtype_bytes(ta), cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(hb, b, n * dtype_bytes(tb), cudaMemcpyDeviceToHost));
  const int nt = 8;
  double num[nt], den[nt];
  std::vector<std::thread> th;
  for (int t = 0; t < nt; ++t)
    th.emplace_back([&, t] {
      size_t lo = n * t / nt, hi = n * (t + 1) / nt;
      switch (code(ta) * 3 + code(tb)) {
        case 0: sums<0, 0>(ha, hb, lo, hi, &num[t], &den[t]); break;
        case 1: sums<0, 1>(ha, hb, lo, hi, &num[t], &den[t]); break;
        case 2: sums<0, 2>(ha, hb, lo, hi, &num[t], &den[t]); break;
        case 3: sums<1, 0>(ha, hb, lo, hi, &num[t], &den[t]); break;
        case 4: sums<1, 1>(ha, hb, lo, hi, &num[t], &den[t]); break;
        case 5: sums<1, 2>(ha, hb, lo, hi, &num[t], &den[t]); break;
        case 6: sums<2, 0>(ha, hb, lo, hi, &num[t], &den[t]); break;
        case 7: sums<2, 1>(ha, hb, lo, hi, &num[t], &den[t]); break;
        default: sums<2, 2>(ha, hb, lo, hi, &num[t], &den[t]); break;
      }
    });
  for (auto &t : th) t.join();
  double x = 0, y = 0;
  for (int t = 0; t < nt; ++t) x += num[t], y += den[t];
  return y == 0 ? std::sqrt(x) : std::sqrt(x / y);
}

// 0 when the two device ranges hold the same bytes, else infinity.
double exact_dev(const void *a, const void *b, size_t bytes) {
  void *ha = g_ha.get(bytes), *hb = g_hb.get(bytes);
  CUDA_OK(cudaMemcpy(ha, a, bytes, cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(hb, b, bytes, cudaMemcpyDeviceToHost));
  return std::memcmp(ha, hb, bytes) == 0 ? 0.0 : INFINITY;
}

// ---------------------------------------------------------------- the case runner
// One output of the captured call, kept after every replay.
struct Out {
  std::string what;
  void *ptr;        // where the captured call writes it
  void *eager_ptr;  // where the interleaved eager calls write it (may be ptr)
  NVTEDType t;
  size_t n;
  bool poison;      // user memory: NaN before every call (registered buffers are never
                    // written from outside the library: peers may still read them)
};

// The reference of an output (computed on e.s after fill()).
struct Ref {
  const void *ptr;
  NVTEDType t;
  bool exact;  // bytes must match (then t is the output's type)
  double tol;  // relative error bound otherwise
};

struct Case {
  std::string name;
  std::function<void(uint64_t)> fill;                  // fresh inputs into the captured buffers
  std::function<NVTECommStatus(bool eager)> call;      // the operation on e.s (eager: eager outputs)
  std::vector<Out> outs;
  std::function<std::vector<Ref>()> reference;
  std::function<NVTECommStatus()> synchronize;         // engine: nvte_comm_overlap_synchronize
  std::function<void()> after_capture;                 // optional: eager work between capture and replays
};

struct Mode {
  cudaStreamCaptureMode mode;
  const char *name;
};
const Mode kThreadLocal{cudaStreamCaptureModeThreadLocal, "thread-local"};
const Mode kGlobal{cudaStreamCaptureModeGlobal, "global"};

// Capture c.call on e.s; the instantiated graph, or nullptr (failure reported).
// `check_sync`: nvte_comm_overlap_synchronize during the open capture must be refused.
cudaGraphExec_t capture(Env &e, Case &c, const Mode &m, const std::string &name, bool check_sync) {
  CUDA_OK(cudaStreamBeginCapture(e.s, m.mode));
  NVTECommStatus st = c.call(false);
  std::string msg = status_text(st);
  if (st == NVTE_COMM_SUCCESS && check_sync && c.synchronize) {
    NVTECommStatus ss = c.synchronize();
    std::string smsg = status_text(ss);
    e.rep->check(ss == NVTE_COMM_ERROR_UNSUPPORTED && smsg.find("capture") != std::string::npos,
                 name + ": nvte_comm_overlap_synchronize during the open capture is refused -> " + smsg);
  }
  cudaGraph_t g = nullptr;
  cudaError_t ce = cudaStreamEndCapture(e.s, &g);
  if (st != NVTE_COMM_SUCCESS) {
    e.rep->fail(name + ": the call inside the capture -> " + msg);
    if (g) cudaGraphDestroy(g);
    cudaGetLastError();
    return nullptr;
  }
  if (ce != cudaSuccess || !g) {
    e.rep->fail(name + ": cudaStreamEndCapture -> " + cudaGetErrorString(ce) + " (the call invalidated the capture)");
    cudaGetLastError();
    return nullptr;
  }
  cudaGraphExec_t x = nullptr;
  cudaError_t ie = cudaGraphInstantiate(&x, g, 0);
  cudaGraphDestroy(g);
  if (ie != cudaSuccess) {
    e.rep->fail(name + ": cudaGraphInstantiate -> " + cudaGetErrorString(ie));
    cudaGetLastError();
    return nullptr;
  }
  return x;
}

uint64_t seed_of(const Env &e, uint64_t salt, int j) { return 1000003ull * (uint64_t)(j + 2) + 7919ull * e.rank + 104729ull * salt; }

// Warm-up (optional), capture, R replays back to back with fresh inputs and interleaved
// eager calls, then every kept output against its reference.
void run_case(Env &e, Case &c, const Mode &m, bool warmup, bool check_sync, uint64_t salt) {
  const std::string name = c.name + " [" + m.name + " capture, " +
                           (warmup ? "after an eager warm-up" : "first call of the object inside the capture") + "]";
  const int R = g_replays;
  const auto t0 = std::chrono::steady_clock::now();
  bool ok = true;
  if (warmup) {
    c.fill(seed_of(e, salt, -1));
    NVTECommStatus st = c.call(false);
    if (st != NVTE_COMM_SUCCESS) {
      e.rep->fail(name + ": eager warm-up call -> " + status_text(st));
      ok = false;
    }
    CUDA_OK(cudaStreamSynchronize(e.s));
  }
  if (!all_ok(ok)) return;
  cudaGraphExec_t x = capture(e, c, m, name, check_sync);
  if (!all_ok(x != nullptr)) {
    if (x) cudaGraphExecDestroy(x);
    return;
  }
  if (c.after_capture) c.after_capture();
  // Kept outputs: ring[k] holds output k of every replay, ering[k] of every eager call.
  int neager = 0;
  for (int j = 0; j < R; ++j) neager += j % kEagerEvery == kEagerEvery / 2;
  std::vector<DevBuf> ring, ering;
  for (auto &o : c.outs) {
    ring.emplace_back(o.n * dtype_bytes(o.t) * R);
    ering.emplace_back(o.n * dtype_bytes(o.t) * std::max(neager, 1));
  }
  auto slot = [&](DevBuf &b, size_t k, int i) { return (char *)b.p + (size_t)i * c.outs[k].n * dtype_bytes(c.outs[k].t); };
  int eager_failed = 0;
  std::string eager_msg;
  for (int j = 0, ie = 0; j < R; ++j) {
    c.fill(seed_of(e, salt, j));
    for (auto &o : c.outs)
      if (o.poison) poison(o.ptr, o.n * dtype_bytes(o.t), e.s);
    CUDA_OK(cudaGraphLaunch(x, e.s));
    for (size_t k = 0; k < c.outs.size(); ++k)
      CUDA_OK(cudaMemcpyAsync(slot(ring[k], k, j), c.outs[k].ptr, c.outs[k].n * dtype_bytes(c.outs[k].t), cudaMemcpyDeviceToDevice, e.s));
    if (j % kEagerEvery == kEagerEvery / 2) {  // an eager call on the same inputs, same object
      for (auto &o : c.outs)
        if (o.poison) poison(o.eager_ptr, o.n * dtype_bytes(o.t), e.s);
      NVTECommStatus st = c.call(true);
      if (st != NVTE_COMM_SUCCESS && eager_failed++ == 0) eager_msg = status_text(st);
      for (size_t k = 0; k < c.outs.size(); ++k)
        CUDA_OK(cudaMemcpyAsync(slot(ering[k], k, ie), c.outs[k].eager_ptr, c.outs[k].n * dtype_bytes(c.outs[k].t),
                                cudaMemcpyDeviceToDevice, e.s));
      ++ie;
    }
  }
  CUDA_OK(cudaStreamSynchronize(e.s));
  cudaGraphExecDestroy(x);
  if (eager_failed) e.rep->fail(name + ": " + std::to_string(eager_failed) + " interleaved eager call(s) failed, first: " + eager_msg);
  if (c.synchronize) {
    NVTECommStatus st = c.synchronize();
    e.rep->check(st == NVTE_COMM_SUCCESS, name + ": nvte_comm_overlap_synchronize after the replays -> " + status_text(st));
  }
  // Check every replay and eager call against the reference of its inputs.
  std::vector<double> worst(c.outs.size(), 0.0);
  std::vector<int> bad(c.outs.size(), 0);
  int first_bad = -1;
  auto judge = [&](size_t k, const void *got, const Ref &r, int j) {
    const Out &o = c.outs[k];
    double err = r.exact ? exact_dev(got, r.ptr, o.n * dtype_bytes(o.t)) : rel_err_dev(got, o.t, r.ptr, r.t, o.n);
    bool pass = r.exact ? err == 0.0 : err < r.tol;
    if (!pass) {
      ++bad[k];
      if (first_bad < 0) first_bad = j;
    }
    if (std::isnan(err) || (!std::isnan(worst[k]) && err > worst[k])) worst[k] = err;  // NaN sticks
  };
  for (int j = 0, ie = 0; j < R; ++j) {
    c.fill(seed_of(e, salt, j));
    std::vector<Ref> refs = c.reference();
    CUDA_OK(cudaStreamSynchronize(e.s));
    for (size_t k = 0; k < c.outs.size(); ++k) judge(k, slot(ring[k], k, j), refs[k], j);
    if (j % kEagerEvery == kEagerEvery / 2) {
      for (size_t k = 0; k < c.outs.size(); ++k) judge(k, slot(ering[k], k, ie), refs[k], j);
      ++ie;
    }
  }
  std::string detail = ": " + std::to_string(R) + " replays + " + std::to_string(neager) + " eager calls;";
  bool pass = true;
  for (size_t k = 0; k < c.outs.size(); ++k) {
    char b[160];
    std::snprintf(b, sizeof b, " %s: worst error %.3g, %d bad;", c.outs[k].what.c_str(), worst[k], bad[k]);
    detail += b;
    pass = pass && bad[k] == 0;
  }
  if (first_bad >= 0) detail += " first bad at replay " + std::to_string(first_bad) + ";";
  char tb[48];
  std::snprintf(tb, sizeof tb, " %.1f s", std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  detail += tb;
  e.rep->check(pass, name + detail);
}

// ---------------------------------------------------------------- engine cases
NVTECommOverlap *create(Env &e, size_t rows, size_t cols, bool use_ce, bool aggregate, const std::string &name,
                        bool atomic = false) {
  NVTECommOverlapConfig cfg;
  nvte_comm_overlap_config_default(&cfg);
  cfg.tp_size = e.size;
  cfg.use_ce = use_ce;
  cfg.aggregate = aggregate;
  cfg.atomic_gemm = atomic;
  cfg.transport = NVTE_COMM_TRANSPORT_IPC;
  cfg.timeout_ms = kTimeoutMs;
  NVTECommBootstrap bs{};
  bs.nccl_comm = e.nccl;
  NVTECommOverlap *o = nullptr;
  if (nvte_comm_overlap_create(&bs, &cfg, rows, cols, kNVTEBFloat16, &o) != NVTE_COMM_SUCCESS) {
    e.rep->fail(name + ": create: " + nvte_comm_last_error());
    return nullptr;
  }
  return o;
}

const NVTEDType bf = kNVTEBFloat16, f32 = kNVTEFloat32;

// The engine cases run in both modes: thread-local after a warm-up, and global with the
// first call of a fresh object inside the capture.
void engine_modes(const std::function<void(const Mode &, bool warmup)> &one) {
  one(kThreadLocal, true);
  one(kGlobal, g_skip_first);
}

// split_ag: B [n, k] gathered from shards [n/tp, k]; D [n, m] = B A^T; B_copy [n, k].
// `atomic`: config atomic_gemm (the fused all-gather: one launch of our GEMM on arrival
// flags, which every call and replay must leave zero).
void engine_ag(Env &e, bool aggregate, bool use_ce, uint64_t salt, bool atomic = false) {
  const size_t n = 4096, k = 4096, m = 2048, nc = n / e.size;
  const std::string label = std::string(atomic ? "engine fused_ag (atomic_gemm) " : "engine split_ag ") +
                            (aggregate ? "bidirectional" : "unidirectional") +
                            (use_ce ? " CE" : " SM") + " bf16 TN n=4096 k=4096 m=2048 tp=" + std::to_string(e.size);
  if (!selected(label)) return;
  engine_modes([&](const Mode &mode, bool warmup) {
    NVTECommOverlap *o = create(e, n, k, use_ce, aggregate, label, atomic);
    if (!all_ok(o != nullptr)) { if (o) nvte_comm_overlap_destroy(o); return; }
    Tensor A(bf, {m, k}), Bs(bf, {nc, k}), D(bf, {n, m}), D2(bf, {n, m}), Bc(bf, {n, k}), Bc2(bf, {n, k});
    Tensor Bfull(bf, {n, k}), Dref(f32, {n, m});
    Case c;
    c.name = label;
    c.fill = [&](uint64_t s) { fill(A, s, e.s); fill(Bs, s + 1, e.s); };
    c.call = [&](bool eager) {
      return nvte_comm_overlap_split_ag(o, A.h, true, Bs.h, false, eager ? D2.h : D.h, nullptr, nullptr, false, e.ws_t, false, true,
                                        eager ? Bc2.h : Bc.h, e.s);
    };
    c.outs = {{"D", D.data.p, D2.data.p, bf, n * m, true}, {"B_copy", Bc.data.p, Bc2.data.p, bf, n * k, true}};
    c.reference = [&]() {
      NCCL_OK(ncclAllGather(Bs.data.p, Bfull.data.p, nc * k * 2, ncclUint8, e.nccl, e.s));
      nvte_cublas_gemm(A.h, Bfull.h, Dref.h, nullptr, nullptr, true, false, false, e.ws_t, false, true, 0, e.s);
      return std::vector<Ref>{{Dref.data.p, f32, false, 1e-2}, {Bfull.data.p, bf, true, 0}};
    };
    c.synchronize = [&]() { return nvte_comm_overlap_synchronize(o); };
    run_case(e, c, mode, warmup, !warmup, salt);
    nvte_comm_overlap_destroy(o);
    MPI_Barrier(MPI_COMM_WORLD);
  });
}

// split_rs / split_rs_p2p: partial D = B A^T [n, m] (k split), rs_output [n/tp, m].
void engine_rs(Env &e, bool p2p, bool use_ce, uint64_t salt, bool atomic = false) {
  const size_t n = 4096, m = 8192, kl = 4096 / e.size, nc = n / e.size;
  const char *rs_ring = std::getenv("NVTE_COMM_RS_RING");
  const std::string label = std::string("engine ") + (p2p ? "split_rs_p2p (ring)" : "split_rs (pipelined)") + (use_ce ? " CE" : " SM") +
                            " bf16 TN n=4096 k=4096 m=8192 tp=" + std::to_string(e.size) +
                            (rs_ring ? std::string(" RS_RING=") + rs_ring : std::string()) +
                            (atomic ? " atomic_gemm (our GEMM, done signals)" : "");
  if (!selected(label)) return;
  engine_modes([&](const Mode &mode, bool warmup) {
    NVTECommOverlap *o = create(e, n, m, use_ce, false, label, atomic);
    if (!all_ok(o != nullptr)) { if (o) nvte_comm_overlap_destroy(o); return; }
    Tensor A(bf, {m, kl}), B(bf, {n, kl}), out(bf, {nc, m}), out2(bf, {nc, m}), full(f32, {n, m}), ref(f32, {nc, m});
    Case c;
    c.name = label;
    c.fill = [&](uint64_t s) { fill(A, s, e.s); fill(B, s + 1, e.s); };
    c.call = [&](bool eager) {
      auto fn = p2p ? nvte_comm_overlap_split_rs_p2p : nvte_comm_overlap_split_rs;
      return fn(o, A.h, true, B.h, false, nullptr, nullptr, nullptr, false, e.ws_t, false, true, eager ? out2.h : out.h, e.s);
    };
    c.outs = {{"rs_output", out.data.p, out2.data.p, bf, nc * m, true}};
    c.reference = [&]() {
      nvte_cublas_gemm(A.h, B.h, full.h, nullptr, nullptr, true, false, false, e.ws_t, false, true, 0, e.s);
      NCCL_OK(ncclReduceScatter(full.data.p, ref.data.p, nc * m, ncclFloat32, ncclSum, e.nccl, e.s));
      return std::vector<Ref>{{ref.data.p, f32, false, 1e-2}};
    };
    c.synchronize = [&]() { return nvte_comm_overlap_synchronize(o); };
    run_case(e, c, mode, warmup, !warmup, salt);
    nvte_comm_overlap_destroy(o);
    MPI_Barrier(MPI_COMM_WORLD);
  });
}

// bulk: copy_into_buffer + the collective on the buffer beside an unrelated GEMM, both in
// the graph. AG: the whole buffer gathered (exact); RS: rs_output [n/tp, cols].
void engine_bulk(Env &e, bool ag, uint64_t salt) {
  const size_t n = 4096, cols = 4096, nc = n / e.size, gm = 256, gk = 512, gn = 512;
  const std::string label = std::string("engine bulk ") + (ag ? "AG" : "RS") + " CE bf16 buffer [4096, 4096] + GEMM tp=" + std::to_string(e.size);
  if (!selected(label)) return;
  engine_modes([&](const Mode &mode, bool warmup) {
    NVTECommOverlap *o = create(e, n, cols, true, false, label);
    if (!all_ok(o != nullptr)) { if (o) nvte_comm_overlap_destroy(o); return; }
    Tensor A(bf, {gm, gk}), B(bf, {gn, gk}), D(bf, {gn, gm}), D2(bf, {gn, gm}), Dref(f32, {gn, gm});
    Tensor X(bf, ag ? std::vector<size_t>{nc, cols} : std::vector<size_t>{n, cols});
    Tensor out(bf, {nc, cols}), out2(bf, {nc, cols}), gathered(bf, {n, cols}), Xf(f32, {ag ? 1 : n * cols}), ref(f32, {nc, cols});
    void *bufp = nullptr;  // the registered buffer (the gathered output of AG)
    {
      Tensor v;
      nvte_comm_overlap_get_buffer(o, false, &v.h);
      bufp = nvte_tensor_data(v.h);
    }
    View Xflat(X.data.p, bf, {X.numel});
    Case c;
    c.name = label;
    c.fill = [&](uint64_t s) { fill(A, s, e.s); fill(B, s + 1, e.s); fill(X, s + 2, e.s); };
    c.call = [&](bool eager) {
      NVTECommStatus st = nvte_comm_overlap_copy_into_buffer(o, X.h, ag, e.s);
      if (st != NVTE_COMM_SUCCESS) return st;
      return nvte_comm_overlap_bulk(o, ag ? NVTE_COMM_OVERLAP_AG : NVTE_COMM_OVERLAP_RS, A.h, true, B.h, false, eager ? D2.h : D.h, nullptr,
                                    nullptr, false, e.ws_t, false, true, nullptr, ag ? nullptr : (eager ? out2.h : out.h), e.s);
    };
    if (ag)
      c.outs = {{"gathered buffer (exact)", bufp, bufp, bf, n * cols, false}};
    else
      c.outs = {{"rs_output", out.data.p, out2.data.p, bf, nc * cols, true}};
    c.outs.push_back({"concurrent GEMM D", D.data.p, D2.data.p, bf, gn * gm, true});
    c.reference = [&]() {
      std::vector<Ref> r;
      if (ag) {
        NCCL_OK(ncclAllGather(X.data.p, gathered.data.p, nc * cols * 2, ncclUint8, e.nccl, e.s));
        r.push_back({gathered.data.p, bf, true, 0});
      } else {
        nvte_quantize(Xflat.h, Xf.h, e.s);  // bf16 -> f32
        NCCL_OK(ncclReduceScatter(Xf.data.p, ref.data.p, nc * cols, ncclFloat32, ncclSum, e.nccl, e.s));
        r.push_back({ref.data.p, f32, false, 1e-2});
      }
      nvte_cublas_gemm(A.h, B.h, Dref.h, nullptr, nullptr, true, false, false, e.ws_t, false, true, 0, e.s);
      r.push_back({Dref.data.p, f32, false, 1e-2});
      return r;
    };
    c.synchronize = [&]() { return nvte_comm_overlap_synchronize(o); };
    run_case(e, c, mode, warmup, !warmup, salt);
    nvte_comm_overlap_destroy(o);
    MPI_Barrier(MPI_COMM_WORLD);
  });
}

// ---------------------------------------------------------------- comm-GEMM cases
enum class Op { AG, RS, AR };

struct CgShape {
  int64_t m, n, k;
};

// The first call of a fresh context inside a capture: UNSUPPORTED, nothing captured, the
// capture still valid.
void first_call_refused(Env &e, Case &c, const Mode &m) {
  CUDA_OK(cudaStreamBeginCapture(e.s, m.mode));
  NVTECommStatus st = c.call(false);
  std::string msg = status_text(st);
  cudaGraph_t g = nullptr;
  cudaError_t ce = cudaStreamEndCapture(e.s, &g);
  size_t nodes = (size_t)-1;
  if (ce == cudaSuccess && g) {
    CUDA_OK(cudaGraphGetNodes(g, nullptr, &nodes));
    cudaGraphDestroy(g);
  } else {
    cudaGetLastError();
  }
  char b[160];
  std::snprintf(b, sizeof b, "; cudaStreamEndCapture -> %s, %lld node(s) captured", cudaGetErrorString(ce), (long long)nodes);
  e.rep->check(st == NVTE_COMM_ERROR_UNSUPPORTED && msg.find("capture") != std::string::npos && ce == cudaSuccess && nodes == 0,
               c.name + " [" + m.name + " capture]: the first call of a fresh context inside a capture fails cleanly -> " + msg + b);
}

// One comm-GEMM operation: fresh context per mode. `grow`: after the capture, an eager
// call of a larger all-reduce replaces the context's engine; the graph must still work.
void comm_gemm(Env &e, Op op, CgShape sh, const char *transport, const char *ar_algo, bool sm_puts, bool grow,
               const std::vector<Mode> &modes, uint64_t salt) {
  const int64_t m = sh.m, n = sh.n, k = sh.k;
  const size_t ml = m / e.size, nl = n / e.size, kl = k / e.size;
  char lb[300];
  const char *rs_ring = std::getenv("NVTE_COMM_RS_RING");
  std::snprintf(lb, sizeof lb, "comm-GEMM %s %s%s%s%s%s%s bf16 TN m=%lld n=%lld k=%lld tp=%d%s",
                op == Op::AG ? "nvte_all_gather_gemm" : op == Op::RS ? "nvte_gemm_reduce_scatter" : "nvte_gemm_all_reduce", transport,
                ar_algo ? " AR=" : "", ar_algo ? ar_algo : "", sm_puts ? " SM puts" : "", rs_ring ? " RS_RING=" : "",
                rs_ring ? rs_ring : "", (long long)m, (long long)n, (long long)k, e.size,
                grow ? " (engine replaced by a larger one after the capture)" : "");
  const std::string label = lb;
  if (!selected(label)) return;
  // Local shares (shapes divisible by tp): AG splits m and n, RS / AR split k.
  const size_t ar_ = op == Op::AG ? ml : m, ac = op == Op::AG ? k : kl;
  const size_t br = op == Op::AG ? nl : n, bc = op == Op::AG ? k : kl;
  const size_t dr = op == Op::RS ? nl : n, dc = op == Op::AG ? ml : m;
  for (const Mode &mode : modes) {
    setenv("NVTE_COMM_TRANSPORT", transport, 1);
    if (sm_puts) setenv("NVTE_COMM_OVERLAP_USE_CE", "0", 1);
    if (ar_algo) setenv("NVTE_COMM_AR_ALGO", ar_algo, 1);
    NVTECommGemmCtx *ctx = nvte_comm_gemm_ctx_create(e.nccl, e.size, e.rank);
    if (!all_ok(ctx != nullptr)) {
      e.rep->fail(label + ": ctx_create: " + nvte_comm_last_error());
      if (ctx) nvte_comm_gemm_ctx_destroy(ctx);
      continue;
    }
    Tensor A(bf, {ar_, ac}), B(bf, {br, bc}), D(bf, {dr, dc}), D2(bf, {dr, dc}), ref(f32, {dr, dc});
    // AG: the gathered B; RS / AR: the full local partial.
    Tensor Bfull(bf, {op == Op::AG ? (size_t)n : 1, (size_t)k}), full(f32, {op == Op::AG ? 1 : (size_t)n, (size_t)m});
    auto fn = op == Op::AG ? nvte_all_gather_gemm : op == Op::RS ? nvte_gemm_reduce_scatter : nvte_gemm_all_reduce;
    Case c;
    c.name = label;
    c.fill = [&](uint64_t s) { fill(A, s, e.s); fill(B, s + 1, e.s); };
    c.call = [&](bool eager) {
      fn(ctx, m, n, k, A.h, B.h, eager ? D2.h : D.h, nullptr, nullptr, true, false, false, false, 0, e.s, kNVTECommGemmAlgoDefault);
      return nvte_comm_last_status();
    };
    c.outs = {{"D", D.data.p, D2.data.p, bf, dr * dc, true}};
    c.reference = [&]() {
      if (op == Op::AG) {
        NCCL_OK(ncclAllGather(B.data.p, Bfull.data.p, nl * k * 2, ncclUint8, e.nccl, e.s));
        nvte_cublas_gemm(A.h, Bfull.h, ref.h, nullptr, nullptr, true, false, false, e.ws_t, false, true, 0, e.s);
      } else {
        nvte_cublas_gemm(A.h, B.h, full.h, nullptr, nullptr, true, false, false, e.ws_t, false, true, 0, e.s);
        if (op == Op::RS)
          NCCL_OK(ncclReduceScatter(full.data.p, ref.data.p, nl * m, ncclFloat32, ncclSum, e.nccl, e.s));
        else
          NCCL_OK(ncclAllReduce(full.data.p, ref.data.p, (size_t)n * m, ncclFloat32, ncclSum, e.nccl, e.s));
      }
      return std::vector<Ref>{{ref.data.p, f32, false, 1e-2}};
    };
    // A larger all-reduce (twice m and n): needs a larger engine than the captured call's.
    if (grow)
      c.after_capture = [&]() {
        Tensor ga(bf, {2 * (size_t)m, kl}), gb(bf, {2 * (size_t)n, kl}), gd(bf, {2 * (size_t)n, 2 * (size_t)m});
        fill(ga, 11, e.s);
        fill(gb, 12, e.s);
        nvte_gemm_all_reduce(ctx, 2 * m, 2 * n, k, ga.h, gb.h, gd.h, nullptr, nullptr, true, false, false, false, 0, e.s,
                             kNVTECommGemmAlgoDefault);
        NVTECommStatus st = nvte_comm_last_status();
        e.rep->check(st == NVTE_COMM_SUCCESS, label + ": the larger eager all-reduce after the capture -> " + status_text(st));
        CUDA_OK(cudaStreamSynchronize(e.s));
      };
    bool global = mode.mode == cudaStreamCaptureModeGlobal;
    if (global && !g_skip_first) first_call_refused(e, c, mode);
    run_case(e, c, mode, true, false, salt);
    nvte_comm_gemm_ctx_destroy(ctx);
    unsetenv("NVTE_COMM_TRANSPORT");
    unsetenv("NVTE_COMM_OVERLAP_USE_CE");
    unsetenv("NVTE_COMM_AR_ALGO");
    MPI_Barrier(MPI_COMM_WORLD);
  }
}

// An object released on another thread while this thread captures in global mode (as a
// garbage collector's finalizer or an autograd worker may do): its syncs, frees and NCCL
// teardown must leave the capture valid (CUDA refuses, and invalidates the capture for,
// potentially unsafe calls from any thread beside a global-mode capture; the library makes
// them with its thread's capture mode relaxed). The capture holds a memset of `scratch`;
// `destroy` runs on the other thread, then the graph is instantiated and replayed.
void check_destroy_beside_capture(Env &e, const std::string &label, const std::function<NVTECommStatus()> &destroy,
                                  void *scratch, size_t bytes) {
  MPI_Barrier(MPI_COMM_WORLD);
  CUDA_OK(cudaStreamBeginCapture(e.s, cudaStreamCaptureModeGlobal));
  CUDA_OK(cudaMemsetAsync(scratch, 0, bytes, e.s));
  NVTECommStatus dst = NVTE_COMM_SUCCESS;
  std::string derr;
  cudaStreamCaptureMode after = cudaStreamCaptureModeRelaxed;
  std::thread([&] {
    dst = destroy();
    if (dst != NVTE_COMM_SUCCESS) derr = nvte_comm_last_error();
    // The destroying thread's own mode is back to the default (global) afterwards.
    cudaStreamCaptureMode m = cudaStreamCaptureModeGlobal;
    if (cudaThreadExchangeStreamCaptureMode(&m) == cudaSuccess) {
      after = m;
      cudaThreadExchangeStreamCaptureMode(&m);
    }
  }).join();
  cudaGraph_t g = nullptr;
  const cudaError_t ce = cudaStreamEndCapture(e.s, &g);
  bool ok = ce == cudaSuccess && g != nullptr;
  std::string what = label + ": cudaStreamEndCapture -> " + cudaGetErrorString(ce);
  if (ok) {
    cudaGraphExec_t x = nullptr;
    const cudaError_t ie = cudaGraphInstantiate(&x, g, 0);
    const cudaError_t le = ie == cudaSuccess ? cudaGraphLaunch(x, e.s) : ie;
    const cudaError_t se = le == cudaSuccess ? cudaStreamSynchronize(e.s) : le;
    ok = se == cudaSuccess;
    what += std::string("; instantiate + replay -> ") + cudaGetErrorString(se);
    if (x) cudaGraphExecDestroy(x);
  }
  if (g) cudaGraphDestroy(g);
  (void)cudaGetLastError();
  e.rep->check(ok && dst == NVTE_COMM_SUCCESS && after == cudaStreamCaptureModeGlobal,
               what + "; the destroy -> " + status_text(dst) + (derr.empty() ? "" : " (" + derr + ")") +
                   "; its thread's capture mode afterwards " +
                   (after == cudaStreamCaptureModeGlobal ? "global" : "NOT global"));
  MPI_Barrier(MPI_COMM_WORLD);
}

// A comm-GEMM context (after an eager call: scratch and workspace memory; with `engine`,
// NVTE_COMM_REPORT gives it an engine at one rank too, with its transport, streams and
// events) destroyed beside a global-mode capture. Not with an engine on the NCCL
// transport: NCCL's teardown frees memory on NCCL's own threads, in their (global) mode,
// which still invalidates another thread's global-mode capture (README, CUDA graphs).
// Beyond one rank every context has an engine (its transport), so the NCCL case is
// skipped there, saying why (2x H200, 2026-11-27: the capture invalidated, as documented).
void ctx_destroy_beside_capture(Env &e, const char *transport, bool engine) {
  const std::string label = std::string("comm-GEMM context (") + transport +
                            (engine ? ", with an engine" : ", no engine") +
                            ") destroyed on another thread during a global-mode capture";
  if (!selected(label)) return;
  if (std::string(transport) == "nccl" && (engine || e.size > 1)) {
    e.rep->skip(label + ": at " + std::to_string(e.size) +
                " ranks the context's engine holds an NCCL communicator, whose teardown frees memory on NCCL's "
                "own threads and so invalidates another thread's global-mode capture (a documented limitation: "
                "README, 'Destroys beside captures')");
    return;
  }
  setenv("NVTE_COMM_TRANSPORT", transport, 1);
  if (engine) setenv("NVTE_COMM_REPORT", "1", 1);
  NVTECommGemmCtx *ctx = nvte_comm_gemm_ctx_create(e.nccl, e.size, e.rank);
  unsetenv("NVTE_COMM_TRANSPORT");
  unsetenv("NVTE_COMM_REPORT");
  if (!all_ok(ctx != nullptr)) {
    e.rep->fail(label + ": ctx_create: " + nvte_comm_last_error());
    if (ctx) nvte_comm_gemm_ctx_destroy(ctx);
    return;
  }
  const size_t m = 1024, n = 1024, k = 1024, kl = k / e.size, nl = n / e.size;
  Tensor A(bf, {m, kl}), B(bf, {n, kl}), D(bf, {nl, m});
  fill(A, 1, e.s);
  fill(B, 2, e.s);
  nvte_gemm_reduce_scatter(ctx, m, n, k, A.h, B.h, D.h, nullptr, nullptr, true, false, false, false, 0, e.s,
                           kNVTECommGemmAlgoDefault);
  const NVTECommStatus st = nvte_comm_last_status();
  CUDA_OK(cudaStreamSynchronize(e.s));
  if (!all_ok(st == NVTE_COMM_SUCCESS)) {
    e.rep->fail(label + ": the eager call -> " + status_text(st));
    nvte_comm_gemm_ctx_destroy(ctx);
    return;
  }
  check_destroy_beside_capture(e, label, [&] {
    nvte_comm_gemm_ctx_destroy(ctx);
    return nvte_comm_last_status();
  }, D.data.p, nl * m * 2);
}

// A small userbuffers object (IPC) and the operands of its split_ag, after one eager
// call (its buffer, flags and streams in use): `o` null when that failed (reported).
struct WarmOverlap {
  NVTECommOverlap *o = nullptr;
  Tensor A, Bs, D;
  size_t d_bytes = 0;
  NVTECommStatus split_ag(Env &e) {
    return nvte_comm_overlap_split_ag(o, A.h, true, Bs.h, false, D.h, nullptr, nullptr, false, e.ws_t, false, true,
                                      nullptr, e.s);
  }
};

void warm_overlap(Env &e, const std::string &label, WarmOverlap &w) {
  const size_t n = 1024, k = 1024, m = 512, nc = n / e.size;
  NVTECommOverlap *o = create(e, n, k, true, false, label);
  if (!all_ok(o != nullptr)) {
    if (o) nvte_comm_overlap_destroy(o);
    return;
  }
  w.A = Tensor(bf, {m, k});
  w.Bs = Tensor(bf, {nc, k});
  w.D = Tensor(bf, {n, m});
  w.d_bytes = n * m * 2;
  fill(w.A, 1, e.s);
  fill(w.Bs, 2, e.s);
  w.o = o;
  const NVTECommStatus st = w.split_ag(e);
  CUDA_OK(cudaStreamSynchronize(e.s));
  if (!all_ok(st == NVTE_COMM_SUCCESS)) {
    e.rep->fail(label + ": the eager split_ag -> " + status_text(st));
    nvte_comm_overlap_destroy(o);
    w.o = nullptr;
  }
}

// A userbuffers object (IPC, after an eager split_ag: its buffer, flags and streams)
// destroyed beside a global-mode capture.
void overlap_destroy_beside_capture(Env &e) {
  const std::string label = "userbuffers object (ipc) destroyed on another thread during a global-mode capture";
  if (!selected(label)) return;
  WarmOverlap w;
  warm_overlap(e, label, w);
  if (!w.o) return;
  check_destroy_beside_capture(e, label, [&] { return nvte_comm_overlap_destroy(w.o); }, w.D.data.p, w.d_bytes);
}

// A destroy while a capture holding the object's own calls is open is refused
// (UNSUPPORTED: the graph being captured uses its memory), the capture left intact; once
// the capture has ended (and its graph is destroyed) the destroy succeeds.
void destroy_refused_during_own_capture(Env &e) {
  const std::string label = "userbuffers object destroyed while a capture holding its calls is open";
  if (!selected(label)) return;
  WarmOverlap w;
  warm_overlap(e, label, w);
  if (!w.o) return;
  MPI_Barrier(MPI_COMM_WORLD);
  CUDA_OK(cudaStreamBeginCapture(e.s, cudaStreamCaptureModeGlobal));
  const NVTECommStatus captured = w.split_ag(e);
  const NVTECommStatus refused = nvte_comm_overlap_destroy(w.o);
  const std::string msg = nvte_comm_last_error();
  cudaGraph_t g = nullptr;
  const cudaError_t ce = cudaStreamEndCapture(e.s, &g);
  bool ok = captured == NVTE_COMM_SUCCESS && refused == NVTE_COMM_ERROR_UNSUPPORTED && ce == cudaSuccess && g;
  if (ok) {
    cudaGraphExec_t x = nullptr;
    ok = cudaGraphInstantiate(&x, g, 0) == cudaSuccess && cudaGraphLaunch(x, e.s) == cudaSuccess &&
         cudaStreamSynchronize(e.s) == cudaSuccess;
    if (x) cudaGraphExecDestroy(x);
  }
  if (g) cudaGraphDestroy(g);
  (void)cudaGetLastError();
  const NVTECommStatus later = nvte_comm_overlap_destroy(w.o);
  e.rep->check(ok && later == NVTE_COMM_SUCCESS,
               label + ": the captured call -> " + status_text(captured) + "; the destroy in the capture -> " +
                   status_text(refused) + " (" + msg + "); cudaStreamEndCapture -> " + cudaGetErrorString(ce) +
                   "; the replay " + (ok ? "ok" : "FAILED") + "; the destroy after it -> " + status_text(later));
  MPI_Barrier(MPI_COMM_WORLD);
}

}  // namespace

int main(int argc, char **argv) {
  probe_or_continue(argc, argv);
  MPI_Init(&argc, &argv);
  Report rep;
  Env e{};
  e.rep = &rep;
  MPI_Comm_rank(MPI_COMM_WORLD, &e.rank);
  MPI_Comm_size(MPI_COMM_WORLD, &e.size);
  rep.rank = e.rank;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--replays") && i + 1 < argc) g_replays = std::max(1, std::atoi(argv[++i]));
    else if (!std::strcmp(argv[i], "--only") && i + 1 < argc) g_only = argv[++i];
    else if (!std::strcmp(argv[i], "--skip-first-call")) g_skip_first = true;
  }
  int ndev;
  CUDA_OK(cudaGetDeviceCount(&ndev));
  CUDA_OK(cudaSetDevice(e.rank % ndev));
  CUDA_OK(cudaStreamCreateWithFlags(&e.s, cudaStreamNonBlocking));
  e.ws = DevBuf(32u << 20);
  View wsv(e.ws.p, kNVTEByte, {e.ws.bytes});
  e.ws_t = wsv.h;
  {
    ncclUniqueId id;
    if (e.rank == 0) NCCL_OK(ncclGetUniqueId(&id));
    MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, MPI_COMM_WORLD);
    NCCL_OK(ncclCommInitRank(&e.nccl, e.size, id, e.rank));
  }
  // Waits for peers time out sooner than the default: a broken schedule fails, not hangs.
  char tmo[32];
  std::snprintf(tmo, sizeof tmo, "%lld", (long long)kTimeoutMs);
  setenv("NVTE_COMM_TIMEOUT_MS", tmo, 0);
  if (e.rank == 0) std::printf("test_graph: %d rank(s), %d replays per capture\n", e.size, g_replays);

  uint64_t salt = 0;
  // Engine algorithms (IPC).
  engine_ag(e, false, true, ++salt);
  engine_ag(e, true, true, ++salt);
  engine_ag(e, false, false, ++salt);
  engine_ag(e, false, true, ++salt, true);
  engine_ag(e, false, false, ++salt, true);
  engine_rs(e, true, true, ++salt, true);
  engine_rs(e, false, true, ++salt);
  engine_rs(e, true, true, ++salt);
  engine_rs(e, true, false, ++salt);
  engine_bulk(e, true, ++salt);
  engine_bulk(e, false, ++salt);
  // The accumulating ring reduce-scatter (read at every call, captured ones too): the
  // engine's ring, and the comm-GEMM all-reduce ring (its pieces pushed as computed).
  setenv("NVTE_COMM_RS_RING", "accumulate", 1);
  engine_rs(e, true, true, ++salt);
  engine_rs(e, true, false, ++salt);
  comm_gemm(e, Op::AR, {8192, 4096, 4096}, "ipc", "ring", false, false, {kThreadLocal, kGlobal}, ++salt);
  comm_gemm(e, Op::RS, {2048, 1024, 1024}, "nccl", nullptr, false, false, {kGlobal}, ++salt);
  unsetenv("NVTE_COMM_RS_RING");
  // comm-GEMM at the reported shape (4096 tokens x k 4096 x m 8192), IPC.
  const CgShape big{8192, 4096, 4096};
  const std::vector<Mode> both{kThreadLocal, kGlobal}, global_only{kGlobal};
  comm_gemm(e, Op::AG, big, "ipc", nullptr, false, false, both, ++salt);
  comm_gemm(e, Op::RS, big, "ipc", nullptr, false, false, both, ++salt);
  comm_gemm(e, Op::AR, big, "ipc", "ring", false, false, both, ++salt);
  comm_gemm(e, Op::AR, big, "ipc", "chunked", false, false, both, ++salt);
  comm_gemm(e, Op::AR, big, "ipc", "ring", true, false, global_only, ++salt);
  // A graph outlives the engine it was captured with.
  comm_gemm(e, Op::AR, {1024, 512, 512}, "ipc", "ring", false, true, global_only, ++salt);
  // The NCCL transport (the one used across nodes).
  const CgShape mid{2048, 1024, 1024};
  comm_gemm(e, Op::AG, mid, "nccl", nullptr, false, false, global_only, ++salt);
  comm_gemm(e, Op::RS, mid, "nccl", nullptr, false, false, global_only, ++salt);
  comm_gemm(e, Op::AR, mid, "nccl", nullptr, false, false, global_only, ++salt);

  // Releases beside a capture (another thread's destroy).
  ctx_destroy_beside_capture(e, "ipc", true);
  ctx_destroy_beside_capture(e, "nccl", false);
  overlap_destroy_beside_capture(e);
  destroy_refused_during_own_capture(e);

  int rc = rep.finish("test_graph");
  ncclCommDestroy(e.nccl);
  nvte_destroy_tensor(wsv.h);
  wsv.h = nullptr;
  e.ws = DevBuf();
  MPI_Finalize();
  return rc;
}
