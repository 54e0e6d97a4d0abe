// A group of test ranks as forked processes, without MPI: a rank may die (a fault
// injected on purpose) and the others must go on, report and exit cleanly, which an MPI
// job does not allow (mpirun tears the job down when a rank exits). The ranks share an
// anonymous shared mapping made before the fork, over which they run the library's
// bootstrap callbacks (allgather, barrier: bounded waits, never a hang) and exchange an
// NCCL unique id. The parent never initialises CUDA (a forked child could not use it).
#pragma once
#include <cuda_runtime.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "transformer_engine_comm.h"

namespace pg {

constexpr int kMaxRanks = 16;
constexpr size_t kSlot = 64 * 1024;
constexpr int kSkip = 77;     // CTest's skip code
constexpr int kVictim = 99;   // exit code of a rank that dies on purpose

struct Shared {
  std::atomic<uint64_t> arrive;
  std::atomic<uint64_t> generation;
  std::atomic<int> device_count;
  int n;
  uint8_t data[kMaxRanks][kSlot];
};

struct Rank {
  int rank = 0, n = 1, ndev = 0;
  // The ranks are threads of one process (run_threads): no setenv (other threads read
  // the environment), and peers are reached as in-process peers.
  bool threaded = false;
  Shared *sh = nullptr;
  double barrier_timeout_s = 60.0;
  // More ranks than GPUs: ranks share a GPU (IPC only; NCCL refuses duplicate GPUs).
  bool shared_gpu() const { return n > ndev; }
  int device() const { return rank % ndev; }
};

// Sense-reversing barrier over the shared mapping; false after `timeout_s` (a rank died).
inline bool barrier(Rank &r) {
  Shared *s = r.sh;
  uint64_t g = s->generation.load(std::memory_order_acquire);
  if (s->arrive.fetch_add(1, std::memory_order_acq_rel) == (uint64_t)s->n - 1) {
    s->arrive.store(0, std::memory_order_relaxed);
    s->generation.fetch_add(1, std::memory_order_acq_rel);
    return true;
  }
  auto t0 = std::chrono::steady_clock::now();
  while (s->generation.load(std::memory_order_acquire) == g) {
    if (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() > r.barrier_timeout_s) return false;
    usleep(20);
  }
  return true;
}

inline bool allgather(Rank &r, void *global, size_t global_bytes, const void *local, size_t local_bytes) {
  if (local_bytes > kSlot || global_bytes < local_bytes * (size_t)r.n) return false;
  std::memcpy(r.sh->data[r.rank], local, local_bytes);
  if (!barrier(r)) return false;
  for (int q = 0; q < r.n; ++q) std::memcpy((uint8_t *)global + q * local_bytes, r.sh->data[q], local_bytes);
  return barrier(r);
}

// The library's bootstrap callbacks.
inline int32_t cb_allgather(void *user, void *global, size_t gb, const void *local, size_t lb) {
  return allgather(*(Rank *)user, global, gb, local, lb) ? 0 : 1;
}
inline int32_t cb_barrier(void *user) { return barrier(*(Rank *)user) ? 0 : 1; }

inline NVTECommBootstrap bootstrap(Rank &r) {
  NVTECommBootstrap b;
  std::memset(&b, 0, sizeof b);
  b.world_rank = r.rank;
  b.world_size = r.n;
  b.nccl_comm = nullptr;
  b.allgather = cb_allgather;
  b.barrier = cb_barrier;
  b.user_data = &r;
  return b;
}

// An NCCL communicator of all ranks through the library's bound NCCL (distinct GPUs only).
inline ncclComm_t nccl_world(Rank &r) {
  uint8_t id[128] = {0};
  if (r.rank == 0 && nvte_comm_nccl_get_unique_id(id, sizeof id) != NVTE_COMM_SUCCESS) return nullptr;
  std::vector<uint8_t> all(128 * r.n);
  if (!allgather(r, all.data(), all.size(), id, 128)) return nullptr;
  ncclComm_t c = nullptr;
  if (nvte_comm_nccl_comm_init_rank(all.data(), 128, r.n, r.rank, &c) != NVTE_COMM_SUCCESS) return nullptr;
  return c;
}

// One rank's life in a group: its device (rank % #GPUs, or a skip without a GPU), then
// `body`. Returns the rank's exit code.
inline int run_rank(Shared *sh, int i, int n, bool threaded, const std::function<int(Rank &)> &body) {
  Rank r;
  r.rank = i;
  r.n = n;
  r.sh = sh;
  r.threaded = threaded;
  int nd = 0;
  if (cudaGetDeviceCount(&nd) != cudaSuccess) nd = 0;
  r.ndev = nd;
  if (nd == 0) {
    if (i == 0) std::printf("SKIPPED: no CUDA GPU\n");
    return kSkip;
  }
  cudaSetDevice(r.device());
  return body(r);
}

// The group's result from its ranks' exit codes: the worst failure, kSkip when every rank
// skipped, 0 otherwise; a listed victim's kVictim counts as nothing. Each failure printed.
inline int summarize(const std::vector<int> &codes, const std::vector<int> &victims, const char *what) {
  int worst = 0;
  bool all_skip = true;
  for (int i = 0; i < (int)codes.size(); ++i) {
    int c = codes[i];
    bool victim = std::find(victims.begin(), victims.end(), i) != victims.end();
    if (victim && c == kVictim) continue;
    if (c != kSkip) all_skip = false;
    if (c != 0 && c != kSkip) {
      std::printf("FAIL %s: rank %d exited with %d%s\n", what, i, c, c >= 128 ? " (killed by a signal: a crash)" : "");
      worst = c;
    }
  }
  return worst == 0 && all_skip ? kSkip : worst;
}

// Run `body` on `n` forked ranks; returns the worst exit code (0: all passed, kSkip: the
// ranks skipped, kVictim counts as 0 for ranks listed in `victims`). A group that is not
// done after `deadline_s` is killed and reported as a hang.
inline int run(int n, double deadline_s, const std::function<int(Rank &)> &body, const char *what,
               std::vector<int> victims = {}) {
  void *m = mmap(nullptr, sizeof(Shared), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) { std::perror("mmap"); return 2; }
  Shared *sh = new (m) Shared();
  sh->n = n;
  std::fflush(stdout);
  std::vector<pid_t> pids;
  for (int i = 0; i < n; ++i) {
    pid_t p = fork();
    if (p == 0) {
      int code = run_rank(sh, i, n, false, body);
      std::fflush(stdout);
      _exit(code);
    }
    pids.push_back(p);
  }
  auto t0 = std::chrono::steady_clock::now();
  std::vector<int> codes(n, -1);
  int left = n;
  while (left > 0) {
    for (int i = 0; i < n; ++i) {
      if (codes[i] != -1) continue;
      int st = 0;
      pid_t w = waitpid(pids[i], &st, WNOHANG);
      if (w == pids[i]) {
        codes[i] = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + (WIFSIGNALED(st) ? WTERMSIG(st) : 0);
        --left;
      }
    }
    if (left > 0 && std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() > deadline_s) {
      for (int i = 0; i < n; ++i)
        if (codes[i] == -1) {
          std::printf("FAIL %s: rank %d still running after %.0f s (a hang): killed\n", what, i, deadline_s);
          kill(pids[i], SIGKILL);
          waitpid(pids[i], nullptr, 0);
          codes[i] = 124;
        }
      left = 0;
    }
    usleep(2000);
  }
  munmap(m, sizeof(Shared));
  return summarize(codes, victims, what);
}

// Run `body` on `n` threads of this process (one CUDA device each, rank % #GPUs): the
// library's in-process peers. A group not done after `deadline_s` ends the process (a
// hang cannot be recovered from inside it).
inline int run_threads(int n, double deadline_s, const std::function<int(Rank &)> &body, const char *what) {
  auto *sh = new Shared();
  sh->n = n;
  std::vector<int> codes(n, -1);
  std::atomic<int> done{0};
  std::vector<std::thread> ts;
  for (int i = 0; i < n; ++i)
    ts.emplace_back([&, i] {
      codes[i] = run_rank(sh, i, n, true, body);
      done.fetch_add(1);
    });
  auto t0 = std::chrono::steady_clock::now();
  while (done.load() < n) {
    if (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() > deadline_s) {
      std::printf("FAIL %s: threads still running after %.0f s (a hang): exiting\n", what, deadline_s);
      std::fflush(stdout);
      _exit(124);
    }
    usleep(2000);
  }
  for (auto &t : ts) t.join();
  delete sh;
  return summarize(codes, {}, what);
}

// Per-rank check counting; a rank's exit code is 0 iff nothing failed.
struct Report {
  int rank = 0, passed = 0, failed = 0;
  void check(bool ok, const std::string &what) {
    if (ok) ++passed;
    else ++failed;
    std::printf("[rank %d] %s %s\n", rank, ok ? "PASS" : "FAIL", what.c_str());
    std::fflush(stdout);
  }
  int code() const { return failed ? 1 : 0; }
};

}  // namespace pg
