// One-GPU overlap benchmark with an emulated link (issue 22, deliverable 5): how close our
// fused comm-GEMM kernel (kernels/gemm_sm90.cu with AG arrival flags / RS done signals)
// and the chunked cuBLASLt algorithm come to max(GEMM alone, link alone) per rank, when
// the tensor-parallel peers are replaced by a paced producer (AG) or consumer (RS) on
// the same GPU.
//
// Method. Per row (dtype bf16 or e4m3 in, bf16 out; tp 4 or 8; the per-rank anchor shapes
// of issue 22; this GPU plays rank `me`, default 1):
// - Pieces: every block moves in P pieces (--pieces, default 4, a flag per piece; the
//   library's fused algorithms, src/overlap/ag.rs and rs.rs, send whole blocks unless
//   their tuner picks pieces (AG 2, RS 4), and the all-gather 4 K slices with
//   NVTE_COMM_AG_PIECES=k; P is lowered per row,
//   with a note, to the largest divisor of the block's 128-row tiles, so that every piece
//   is whole tiles; RS: raised per row, with a note, where one piece's tiles would not fit
//   in one round of the fused kernel's CTAs, as the library does: src/gemm/sm90.rs
//   rs_pieces). T = bytes_per_block / BW (BW default 350 GB/s per peer, --bw); piece
//   c takes its share, T * c / P to T * (c + 1) / P. AG pieces are row slices of a block,
//   as the library's fused all-gather sends them by default; --k-pieces: K slices of the
//   whole block (all its rows, the K columns of the kernel's K slice c; a 2D copy in the
//   copies variant), as the library sends them with NVTE_COMM_AG_PIECES=k where its
//   transport moves strided pieces (src/overlap/ag.rs k_slices).
// - AG (tokens x K x N/tp): B = the gathered activations [tokens, K] in tp row blocks of
//   tokens/tp rows; block `me` is local, the others arrive in ring order me+1, me+2, ...:
//   piece c of the i-th remote block (i = 0, 1, ...) has arrived at t0 + i * (T + L) + L +
//   T * (c + 1) / P (L: --step-us, default 0). A = this rank's weights [N/tp, K]; D
//   [tokens, N/tp].
// - RS (tokens x K/tp x N): A = weights [N, K/tp], B = activations [tokens, K/tp], D
//   [tokens, N] partial sums in tp row blocks by destination rank. The emulated consumer
//   takes the blocks in send order me+1, me+2, ... (the local block is last and not sent),
//   piece by piece: each piece waits until it is computed (fused: its done signal; chunked:
//   its block's ready word) and until the previous piece's scheduled end (a block's first
//   piece: then L more), then takes its share of T. The link alone: every block ready at
//   t0, (tp - 1) * (T + L) in all.
// The link is paced by a one-thread kernel on a side stream (the "pacer") that reads
// %globaltimer; its start is t0. Two link variants: "flags": no data moves, the pacer
// itself writes each AG arrival flag (one per piece) at its scheduled time
// (st.release.sys), and in RS only keeps the schedule; "copies": the data really moves on
// a copy stream (device to device, --copy-api: cudaMemcpyBatchAsync with the hint to
// overlap with compute, else cudaMemcpyAsync), each piece after a cuStreamWaitValue32 on
// its go word, which the pacer writes at the piece's scheduled start (AG: the previous
// piece's scheduled arrival; RS: the piece's start above); after
// each AG piece the copy stream writes the piece's "copied" word (cuStreamWriteValue32),
// and the pacer writes the piece's flag (st.release.sys) once the piece's scheduled
// arrival has passed and it has seen that word. So every word our kernel waits on is
// written by the resident pacer, which never waits without a timeout (2 s, counted, the
// flag written anyway): whatever the copy stream does, our kernel cannot wait for it
// forever. (The first H100 run hung in this variant's first fused run when the copy
// stream itself wrote the flags; see the copy-engine check.) RS copies go from D into a
// separate receive buffer. The copies read and write this GPU's HBM (a real link only
// writes it on AG / only reads it on RS), so they cost the GEMM more memory traffic than
// a real link would. A start-up check runs the copy stream's steps (waits, copies,
// writes) while every SM is held by a kernel on the compute stream and times each: where
// one of them needs an SM or waits for the busy SMs, the copies variant is skipped (exit
// status 2), or (only the write's memory barrier) the copied words go without it.
// Against the same schedule:
// - fused: ONE launch of our kernel; AG: waits on the arrival flags (rows_per_flag = a
//   piece's rows), local block's tile rows first, then the others in arrival order
//   (n_tile_rot), flag_value an epoch that grows per iteration (no resets); RS: done
//   signals per piece (done_rows = a piece's rows; done_value the epoch), tile rows
//   rotated so that the first block to send is computed first; the pacer waits on the
//   done signals. Tile-row groups (grouped rasterization) of at most a piece's tile rows
//   (AG), of as many whole pieces as one round of tiles holds (RS), at most --group, as
//   the library picks them (src/gemm/sm90.rs group_n; --fused-group overrides).
// - chunked: one cuBLASLt GEMM per row block on the compute stream, local block first;
//   AG: each after a cuStreamWaitValue32 on its block's last piece flag (a chunked
//   algorithm GEMMs a whole block); RS: in send order, each followed by a
//   cuStreamWriteValue32 of the block's ready word that the pacer waits on (for all of the
//   block's pieces).
// Start of an iteration: the pacer is launched first and announces itself; the compute
// stream waits for that (cuStreamWaitValue32, untimed), so the pacer (1 warp) is resident
// on an SM before any GEMM fills them and the schedule cannot be held up behind a GEMM.
// Then the compute stream records the start event and writes a start word
// (cuStreamWriteValue32) that the pacer polls: t0 is when the pacer sees it; the GEMM
// is launched right after. The pacer's SM is its own: it is launched with all the shared
// memory one CTA may have, which with the per-CTA reserve fills the SM, so no CTA of a GEMM
// can land beside it (on the first H100 run a CTA of ours beside a spinning pacer was
// slowed enough that our static persistent schedule took 1.7x as long). Whenever a pacer
// is resident the GEMMs therefore get SMs - 1: our fused kernel runs on SMs - 1 CTAs, and
// cuBLASLt's chunks get CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET = SMs - 1 (the same budget).
// The pacer sleeps (nanosleep, halving towards each deadline; polls every ~0.25 us) rather
// than spinning. A probe per row times both GEMMs alone on all SMs, alone on SMs - 1 and
// beside a resident pacer: "blocked" (some CTA waited for the pacer's SM: not run) and
// "slowed" (beside > 1.05x alone on all SMs) go to the row's notes. The bound below uses
// the GEMM alone on ALL SMs, so the one SM the link emulation takes counts against fused
// and chunked alike (about 1/SMs at most).
// Timing: CUDA events on the compute stream, from the start event to the end of
// everything of the iteration (the GEMM and, joined into the compute stream, the pacer
// and the copies); the alone runs from an event just before their launch. For AG that is
// the GEMM's end (it cannot end before the last arrival); for RS it is the later of the
// GEMM's end and the last block's delivery (its scheduled end and its copy's end). The
// iterations of all configurations of a row run interleaved (one of each in turn), each
// group of rounds enqueued behind a gate kernel that the host opens after enqueueing it, so
// that the host's enqueue speed never paces the GPU. Median over --iters iterations after
// --warmup.
//
// Columns. Lt ms: cuBLASLt alone on the whole problem (no waits, no link, all SMs). ours
// ms: our kernel alone (no waits, full grid: all SMs). link ms: the link schedule alone (pacer, and the
// copies in the copies variant; RS: every block ready at t0). bound = max(Lt, link).
// fused ms / chunked ms: as above. fused/bound, chunked/bound: <= 1 is perfect overlap.
// f vs c = chunked / fused (> 1: fused faster). ok: fused D equals our no-wait D bit for
// bit, chunked D matches cuBLASLt's whole-GEMM D within tolerance (|d - r| <= tol (|r| +
// rms), tol 1e-2, 5e-2 for e4m3 inputs, as bench/own_gemm.cpp) (and in RS
// copies, every delivered block equals the block it was copied from, bit for bit); plus
// our no-wait D against cuBLASLt's within tolerance; checked on a run whose AG remote rows
// of B (copies variant) and outputs start as NaN, and again after the timed runs. late us:
// the pacer's largest delay past a scheduled time over the timed runs. Bar lines last.
//
// Build + run: scripts/emulated-link-gpu.sh (writes under $OUT). By hand:
//   g++ -std=c++17 -O2 bench/own_gemm_link.cpp -I$CUDA/include -L$CUDA/lib64
//       -lcudart -lnvrtc -lcublasLt -o own_gemm_link && ./own_gemm_link [options]
// Options: --kernel FILE (default kernels/gemm_sm90.cu), --iters N (default 30; --quick:
// 10), --warmup N (default 5), --bw GBPS (link per peer, default 350), --step-us U (each
// block's extra link latency: flag latency and per-step handshakes, added before its
// first piece, in the schedule and the nominal link time; default 0), --pieces P (pieces
// per block: AG flags, RS done signals and transfers, copies; default 4), --me R (default
// 1), --group G (our tile-row groups, default 8), --quick (one shape per op), --only
// ag|rs, --dtype bf16|e4m3|both, --tp LIST (e.g. 8 or 4,8), --out FILE (the markdown
// table, also printed), --compile-only, --define NAME=VALUE (a -D for our kernel),
// --budget SECONDS (default 150: no row starts later; those rows are reported as not
// run), --gemm-sms N (the fused kernel's and the chunks' SM budget, default SMs - 1),
// --copy-api memcpy|batch (the copies' API, default batch: cudaMemcpyBatchAsync, one copy
// per call, cudaMemcpyFlagPreferOverlapWithCompute, the source read in stream order; a
// refusal or a wrong probe copy falls back to cudaMemcpyAsync, said in the log and table),
// --fused-group G (the fused kernel's tile-row groups; default as the library,
// src/gemm/sm90.rs group_n: min(--group, a piece's tile rows); our kernel alone: --group).
// --bn 128|192|256 (our kernels' tile width, fused and alone; default as the library picks it:
// pick_bn, for AG pick_bn_waiting).
// A run that does not end (20 s for a verification run, 30 s for a row's timed runs) is a
// hang: the program prints where it is stuck, without waiting on the device ('  hang:'
// lines: which streams are busy; the pacer's progress from a host-mapped mirror of what it
// wrote and read; for a verification run, which of its steps completed and when, from
// events recorded after each; the flags / signal words, read by a copy on a stream of its
// own if that completes within 2 s), then the table of the rows done so far, and exits 1.
// Exit status: 0 every result right, 1 a wrong result, a hang or a pacer timeout, 2 a
// setup error (or a row that could not run).
#include "gemm90_host.hpp"

#include <array>
#include <atomic>
#include <cmath>
#include <functional>

using namespace g90;

// ---------------------------------------------------------------- helper kernels
// Compiled by NVRTC too (self-contained, no CUDA headers).
static const char *HELP_SRC = R"SRC(
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
__device__ __forceinline__ u8 f_to_e4m3(float f) {
  u16 r; asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(0.0f), "f"(f));
  return (u8)(r & 0xff);
}
extern "C" __global__ void fill_bf16(u16 *p, u64 count, u64 seed) {
  for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < count; i += (u64)gridDim.x * blockDim.x)
    p[i] = f_to_bf16(uni(seed, i));
}
extern "C" __global__ void fill_e4m3(u8 *p, u64 count, u64 seed) {
  for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < count; i += (u64)gridDim.x * blockDim.x)
    p[i] = f_to_e4m3(4.0f * uni(seed, i));
}
extern "C" __global__ void fill_u32(u32 *p, u64 count, u32 v) {
  for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < count; i += (u64)gridDim.x * blockDim.x)
    p[i] = v;
}
// Sum of squares of bf16 values (out: one double, zeroed by the caller).
extern "C" __global__ void sum_sq_bf16(const u16 *r, u64 count, double *out) {
  double s = 0;
  for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < count; i += (u64)gridDim.x * blockDim.x) {
    const double v = bf16_to_f(r[i]); s += v * v;
  }
  for (int o = 16; o > 0; o >>= 1) s += __shfl_down_sync(0xffffffffu, s, o);
  if ((threadIdx.x & 31) == 0) atomicAdd(out, s);
}
// bf16 D against bf16 R: stats[0] elements with e > tol or not finite, stats[1] not
// finite, stats[2] max e as float bits, e = |d - r| / (|r| + rms); first: lowest bad index.
extern "C" __global__ void compare_bf16(const u16 *D, const u16 *R, u64 count, float rms, float tol, u32 *stats,
                                        u64 *first) {
  u32 bad = 0, nonfinite = 0; float emax = 0.f; u64 f = ~0ULL;
  for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < count; i += (u64)gridDim.x * blockDim.x) {
    const float d = bf16_to_f(D[i]), r = bf16_to_f(R[i]);
    if ((__float_as_uint(d) & 0x7f800000u) == 0x7f800000u || (__float_as_uint(r) & 0x7f800000u) == 0x7f800000u) {
      ++nonfinite; ++bad; f = f < i ? f : i; continue;
    }
    const float e = fabsf(d - r) / (fabsf(r) + rms);
    if (!(e <= tol)) { ++bad; f = f < i ? f : i; }
    emax = fmaxf(emax, e);
  }
  if (f != ~0ULL) atomicMin(first, f);
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
// Words that differ (bit for bit); first: lowest differing word.
extern "C" __global__ void bitdiff(const u32 *a, const u32 *b, u64 words, u32 *count, u64 *first) {
  u32 n = 0; u64 f = ~0ULL;
  for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < words; i += (u64)gridDim.x * blockDim.x)
    if (a[i] != b[i]) { ++n; f = f < i ? f : i; }
  if (f != ~0ULL) atomicMin(first, f);
  for (int o = 16; o > 0; o >>= 1) n += __shfl_down_sync(0xffffffffu, n, o);
  if ((threadIdx.x & 31) == 0 && n) atomicAdd(count, n);
}
)SRC";

// The pacer and the gate: compiled with --maxrregcount=32 (one warp, no stack frame). The
// pacer is launched with all the shared memory one CTA may have, so that its SM holds
// nothing else (see the header); it sleeps (nanosleep) between its deadlines and polls.
static const char *PACE_SRC = R"SRC(
typedef unsigned int u32;
typedef unsigned long long u64;

__device__ __forceinline__ u64 gtime() {
  u64 t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t;
}
__device__ __forceinline__ void nsleep(u32 ns) { asm volatile("nanosleep.u32 %0;" ::"r"(ns)); }
__device__ __forceinline__ void st_rel(u32 *p, u32 v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ u32 ld_acq(const u32 *p) {
  u32 v; asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory"); return v;
}
__device__ __forceinline__ u32 ld_acq_generic(const u32 *p) {
  u32 v; asm volatile("ld.acquire.sys.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory"); return v;
}
// Sleeps until the global timer reaches t; returns how late it woke (ns). nanosleep(d)
// sleeps anywhere in [0, 2 d] (PTX ISA), so each sleep is at most half of what is left
// (never past t): a few halvings down to 2 us, then 128 ns naps (at most 256 ns), then
// 32 ns naps for the last 256 ns. A deadline 100 us away costs ~30 wake-ups, not ~100.
__device__ __forceinline__ u64 sleep_until(u64 t) {
  u64 now;
  while ((now = gtime()) < t) {
    const u64 left = t - now;
    nsleep(left > 2048 ? (u32)(left > 2000000 ? 1000000 : left >> 1) : left > 256 ? 128u : 32u);
  }
  return now - t;
}
// Polls *p until it reaches e (wrap-around safe) or the timer passes dl; one acquire load
// per ~0.25 us (128 ns naps). Returns the last value read; *ok: reached.
__device__ __forceinline__ u32 wait_word(const u32 *p, u32 e, u64 dl, bool *ok) {
  u32 v;
  while ((int)((v = ld_acq(p)) - e) < 0) {
    if (gtime() > dl) { *ok = false; return v; }
    nsleep(128);
  }
  *ok = true;
  return v;
}

// Mirrored by the host's PaceArgs (120 bytes). The order is packed so that nothing indexes
// the parameters at run time (which would put a copy of them on the stack). Pieces: each
// block travels in `pieces` pieces (the same granularity as the library's fused
// all-gather: a flag per piece); piece q = i * pieces + c is piece c of the i-th block in
// arrival (AG) / send (RS) order.
struct PaceArgs {
  u32 *flags;        // AG: arrival flags [tp * pieces], block b's piece c at b * pieces + c: the
                     // local block's at the start, the others at their pieces' arrivals
  const u32 *ready;  // RS: ready words (see ready_pieces), or null (every block ready at t0)
  u32 *sig;          // [0] started, then go[nsend * pieces], due[nsend * pieces], fin (due[q]:
                     // AG: piece q's flag written; RS: piece q's transfer started)
  u32 *status;       // [0] timeouts, [1] largest lateness (ns, clamped), [3] hold CTAs started, [4] copy wait
  const u32 *start;  // t0 is when this word reaches the epoch (written by the compute stream)
  const u32 *copied; // AG copies: copied[q] reaches the epoch once piece q (arrival order) is in B
  u32 *mirror;       // host-mapped (or null): the pacer's progress, for a hang report (MIR_*)
  u64 block_ns;      // one block's link time (a piece: its share, the pieces adding up to it)
  u64 step_ns;       // each block's extra link latency (--step-us), before its first piece
  u64 hold_ns;       // mode 2
  u64 timeout_ns;    // per wait for a word (start, ready, copied)
  int mode;          // 0 AG, 1 RS, 2 hold (the co-residence probe; flags: see the copy-engine check)
  int nsend, pieces, copies, local;
  u32 epoch;
  u32 order;         // blocks in arrival / send order, 4 bits each (entry i: bits 4i..4i+3)
  int ready_pieces;  // RS: ready words per block: `pieces` (our done signals, ready[j * pieces +
                     // c]) or 1 (the chunks' ready words, ready[j]: a block's pieces wait on it)
};
static_assert(sizeof(PaceArgs) == 120, "the host's PaceArgs mirrors this struct");

// The mirror (host-mapped, read by the host when a run hangs; the host's MIR_* match).
// PHASE = (what << 16) | index, written before each sleep of more than 2 us and before
// each wait whose first poll fails, never between a deadline and the release store it
// gates (a st.release.sys after a store to host memory would first wait for that store to
// drain over PCIe). index: a piece q = i * pieces + c (block #i in arrival / send order,
// its piece c). what: 1 waiting for the start word; 3 AG: sleeping to piece `index`'s
// scheduled arrival, RS: to piece `index`'s transfer start (the previous piece's scheduled
// end); 4 AG copies: waiting for piece `index`'s copied word (the next piece's go word
// written); 5 RS: waiting for piece `index`'s ready word; 6 holding; 7 RS: sleeping to the
// last piece's end; 8 done. (2 is not used.)
#define MIR_EPOCH 0     // the epoch of the latest launch (written first)
#define MIR_PHASE 1
#define MIR_LAST 2      // on a timeout: the last value read from the word waited on
#define MIR_TIMEOUTS 3  // on a timeout: timeouts so far
#define MIR_EXIT 4      // the epoch, once done
#define MIR_WORDS 8
__device__ __forceinline__ void mput(u32 *m, int i, u32 v) {
  if (m) *(volatile u32 *)(m + i) = v;
}
__device__ __forceinline__ u64 sleep_to(u64 t, u32 *m, u32 phase) {
  if (m && t > gtime() + 2000) mput(m, MIR_PHASE, phase);
  return sleep_until(t);
}
// wait_word, the phase written only when the first poll fails.
__device__ __forceinline__ bool wait_for(const u32 *p, u32 e, u64 timeout_ns, u32 *m, u32 phase) {
  if ((int)(ld_acq(p) - e) >= 0) return true;
  mput(m, MIR_PHASE, phase);
  bool ok;
  const u32 v = wait_word(p, e, gtime() + timeout_ns, &ok);
  if (!ok) mput(m, MIR_LAST, v);
  return ok;
}
__device__ __forceinline__ u64 umax(u64 a, u64 b) { return a > b ? a : b; }

// The link schedule of one iteration. T = block_ns, L = step_ns, P = pieces; piece c of a
// block takes its share of T: from T * c / P to T * (c + 1) / P (integer ns; the shares add
// up to T), after the block's latency L.
// AG: remote block #i's piece c arrives at t0 + i * (T + L) + L + T * (c + 1) / P: then its flag is
// written (copies: also once its copied word is seen; the next piece's go word is written
// at the same time, the scheduled start of that piece's copy; with L > 0 a block's first
// piece's go word is written at t0 + i * (T + L) + L instead). RS: piece q starts at the
// later of its ready word seen and piece q - 1's scheduled end (a block's first piece: L
// after that), and takes its share of T (copies: its go word written at its start); the
// pieces of one block follow each other.
// Every wait has a timeout (counted; after one, later waits are skipped and the words are
// written on schedule), so every word our kernel or a stream waits on is written.
extern "C" __global__ void link_pacer(const PaceArgs a) {
  u64 t0 = gtime();
  if (a.mode == 2) {
    // The hold: every thread stays until its end, so that the CTA keeps its thread slots
    // and registers as well as its shared memory (a kernel that needs no shared memory,
    // such as a device-to-device copy kernel, could otherwise run beside it).
    if (threadIdx.x == 0) {
      atomicAdd(a.status + 3, 1u);  // CTAs resident
      st_rel(a.sig, a.epoch);
      // The copy-engine check: CTA 0 writes flags[0] half way through the hold (a stream
      // wait released while every SM is held).
      if (a.flags && blockIdx.x == 0) {
        sleep_until(t0 + a.hold_ns / 2);
        st_rel(a.flags, a.epoch);
      }
    }
    sleep_until(t0 + a.hold_ns);
    return;
  }
  if (threadIdx.x != 0) return;
  const u64 T = a.block_ns, L = a.step_ns;
  const int P = a.pieces > 0 ? a.pieces : 1;
  const int NQ = a.nsend * P;  // pieces sent / received in an iteration
  u32 *go = a.sig + 1, *due = go + NQ, *fin = due + NQ;
  u32 *const m = a.mirror;
  u64 late = 0;
  u32 timeouts = 0;
  for (int i = 1; i < MIR_WORDS; ++i) mput(m, i, 0);
  mput(m, MIR_EPOCH, a.epoch);
  if (a.mode == 0 && a.flags)  // the local block is there
    for (int c = 0; c < P; ++c) st_rel(a.flags + a.local * P + c, a.epoch);
  st_rel(a.sig, a.epoch);  // resident
  if (a.start && !wait_for(a.start, a.epoch, a.timeout_ns, m, 1u << 16)) mput(m, MIR_TIMEOUTS, ++timeouts);
  t0 = gtime();
  if (a.mode == 0) {
    bool dead = false;  // a copy never ended: later pieces are not waited for
    u64 cwait = 0;      // the longest wait for a copy past its piece's scheduled arrival
    for (int i = 0; i < a.nsend; ++i) {
      u32 *const fb = a.flags + ((a.order >> (4 * i)) & 15u) * P;  // block #i's flags
      const u64 s = t0 + (u64)i * (T + L) + L;
      // A block's first copy starts at s (after its latency L; with L = 0 at t0, then at
      // the previous piece's arrival, below).
      if (a.copies && (L > 0 || i == 0)) {
        if (L > 0) sleep_to(s, m, (3u << 16) | (u32)(i * P));
        st_rel(go + i * P, a.epoch);
      }
      for (int c = 0; c < P; ++c) {
        const int q = i * P + c;
        const u64 e = s + (T * (u64)(c + 1)) / (u64)P;  // piece q's scheduled arrival
        // Lateness only where the deadline was still ahead (not where a copy that ended
        // late held the pacer past it: that is the copies' lag, status[4]).
        const bool on_time = gtime() <= e;
        sleep_to(e, m, (3u << 16) | (u32)q);
        if (on_time) late = umax(late, gtime() - e);
        if (a.copies) {
          // the next piece's copy may start (a next block's first piece: at its s when L > 0)
          if (q + 1 < NQ && (L == 0 || c + 1 < P)) st_rel(go + q + 1, a.epoch);
          // The piece's flag once its copy has ended too (the copy stream writes copied[q]
          // after the piece). The flag is written even when the copy never ends (a timeout,
          // counted): our kernel never waits on the copy stream, only on us.
          if (!dead) {
            if (!wait_for(a.copied + q, a.epoch, a.timeout_ns, m, (4u << 16) | (u32)q)) {
              dead = true;
              mput(m, MIR_TIMEOUTS, ++timeouts);
            }
            cwait = umax(cwait, gtime() - e);
          }
        }
        st_rel(fb + c, a.epoch);
        st_rel(due + q, a.epoch);  // (for the hang report: piece q's flag is written)
      }
    }
    st_rel(fin, a.epoch);
    if (a.copies) atomicMax(a.status + 4, (u32)(cwait < 0xffffffffULL ? cwait : 0xffffffffULL));
  } else {
    u64 E = t0;  // the previous piece's scheduled end
    bool dead = false;
    const bool per_piece = a.ready_pieces == P;  // else one ready word per block
    for (int s = 0; s < a.nsend; ++s) {
      const int j = (int)((a.order >> (4 * s)) & 15u);
      for (int c = 0; c < P; ++c) {
        const int q = s * P + c;
        if (a.ready && !dead && (per_piece || c == 0)) {
          const u32 *w = per_piece ? a.ready + j * P + c : a.ready + j;
          if (!wait_for(w, a.epoch, a.timeout_ns, m, (5u << 16) | (u32)q)) {
            dead = true;
            mput(m, MIR_TIMEOUTS, ++timeouts);
          }
        }
        // A block's latency: its first piece starts L after the link is free and it is ready.
        if (c == 0 && L > 0) E = umax(E, gtime()) + L;
        // Ready before the link is free: starting later than E is lateness (else the
        // piece starts when its ready word was seen).
        const bool on_time = gtime() <= E;
        sleep_to(E, m, (3u << 16) | (u32)q);
        const u64 S = gtime();
        if (on_time) late = umax(late, S - E);
        if (a.copies) st_rel(go + q, a.epoch);
        st_rel(due + q, a.epoch);
        // The piece's scheduled end: from E where it was ready in time (the pacer's wake-up
        // delay does not push the schedule back, piece after piece), else from S.
        E = (on_time ? E : S) + (T * (u64)(c + 1)) / (u64)P - (T * (u64)c) / (u64)P;
      }
    }
    sleep_to(E, m, 7u << 16);
    st_rel(fin, a.epoch);
    late = umax(late, gtime() - E);
  }
  if (timeouts) atomicAdd(a.status, timeouts);
  atomicMax(a.status + 1, (u32)(late < 0xffffffffULL ? late : 0xffffffffULL));
  mput(m, MIR_PHASE, 8u << 16);
  mput(m, MIR_EXIT, a.epoch);
}

// Holds its stream until the host has written `value` (or more) into the mapped host word
// (the host enqueues a group of iterations first), or timeout_ns passed (counted in
// status[2]).
extern "C" __global__ void gate(const u32 *host_word, u32 value, u64 timeout_ns, u32 *status) {
  if (threadIdx.x != 0) return;
  const u64 t0 = gtime();
  while ((int)(ld_acq_generic(host_word) - value) < 0) {
    if (gtime() - t0 > timeout_ns) { atomicAdd(status + 2, 1u); return; }
    nsleep(1000);
  }
}
)SRC";

struct PaceArgs {
  uint32_t *flags;
  const uint32_t *ready;
  uint32_t *sig;
  uint32_t *status;
  const uint32_t *start;
  const uint32_t *copied;
  uint32_t *mirror;
  uint64_t block_ns, step_ns, hold_ns, timeout_ns;
  int32_t mode, nsend, pieces, copies, local;
  uint32_t epoch;
  uint32_t order;        // 4 bits per entry
  int32_t ready_pieces;  // RS: ready words per block (pieces or 1)
};
static_assert(sizeof(PaceArgs) == 120, "PaceArgs mirrors the pacer's struct (PACE_SRC asserts 120 too)");
// The pacer's mirror words (PACE_SRC's MIR_*).
enum { MIR_EPOCH, MIR_PHASE, MIR_LAST, MIR_TIMEOUTS, MIR_EXIT, MIR_WORDS = 8 };

struct Helpers {
  CUmodule help = nullptr, pace = nullptr;
  CUfunction fill_bf16, fill_e4m3, fill_u32, sum_sq, compare, bitdiff, pacer, gate;
  int pacer_regs = 0;
};
static Helpers H;

// ---------------------------------------------------------------- globals
static cudaStream_t g_comp, g_prod, g_copy;  // compute, pacer, copy engine
static uint32_t *g_status;  // [0] pacer timeouts [1] lateness ns [2] gate timeouts [3] hold CTAs [4] copy wait ns
static volatile uint32_t *g_gate_host;       // mapped pinned word the gate kernel reads
static uint32_t *g_gate_dev;
static uint32_t g_gate_value = 0;
static int g_iters = 30, g_warmup = 5, g_pieces = 4, g_me = 1, g_group = 8;
static int g_bn = 0;           // --bn: our kernels' tile width, 128, 192 (ping-pong) or 256 (0: as the library)
static bool g_k_pieces = false;  // --k-pieces: AG pieces are K slices of a block (default: row slices)
static int g_fused_group = 0;  // --fused-group: the fused kernel's tile-row groups (0: as the library)
// --gemm-sms N: the SM budget of the fused kernel and of the chunks (default SMs - 1, the
// pacer's SM left free). Fewer leave SMs to copies that run as kernels: a same-device
// cudaMemcpyAsync may be an SM kernel, not a copy engine, and then it queues behind a
// persistent kernel that holds every SM it can (the library leaves num_comm_sm free).
static int g_gemm_sms = 0;
static int gemm_budget() { return g_gemm_sms > 0 ? std::min(g_gemm_sms, g_sms - 1) : g_sms - 1; }
static double g_bw = 350.0;  // GB/s = bytes per ns
static double g_step_us = 0.0;  // each block's extra link latency (--step-us)
static double g_budget = 150.0;  // seconds: rows not started by then are not run (the table still comes out)
static const uint64_t TIMEOUT_NS = 2000000000ull;  // a pacer's wait for a ready word
static bool g_copies_need_sms = false;  // ce_check: the copies are kernels (the stream words are not)
static bool g_copies_ok = true;  // device-to-device copies run on a copy engine (ce_check)
// How a stream writes a word the pacer waits on while other work runs (an AG block's
// copied word on the copy stream, an RS chunk's ready word on the compute stream): with
// the default memory barrier, or without it where the copy-engine check found that such a
// write waits for the busy SMs (the work before it in its stream has ended either way).
static unsigned g_signal_write = CU_STREAM_WRITE_VALUE_DEFAULT;
static int g_hold_smem = 0;      // the copy-engine check's hold CTAs (two an SM): half an SM's shared memory each
static int g_pacer_smem = 0;     // the pacer's dynamic shared memory: all a CTA may have (its SM to itself)
static bool g_pacer_alone = false;  // no CTA of any kernel fits beside it (shared memory left < a CTA's reserve)
static int nvariants() { return g_copies_ok ? 2 : 1; }
// The hang report's means: the pacer's mirror (host-mapped, MIR_* words), a stream of its
// own for best-effort reads of device words, and event marks through the verification
// runs (below).
static volatile uint32_t *g_mirror_host = nullptr;
static uint32_t *g_mirror_dev = nullptr;
static cudaStream_t g_diag;
static std::vector<std::pair<uint32_t, std::string>> g_pacer_log;  // (epoch, configuration) per pacer launch

// Events recorded on the three streams at each step of a verification run (off in the
// timed runs), read without waiting: which steps have completed, and when (ms after the
// first mark, "compute: pacer announced").
struct Marks {
  static const int N = 160;
  cudaEvent_t ev[N];
  std::string name[N];
  int used = 0, dropped = 0;
  bool on = false;
  void create() {
    for (auto &x : ev) CK(cudaEventCreate(&x));
  }
  void reset(bool enable) {
    used = dropped = 0;
    on = enable;
  }
  void mark(cudaStream_t s, const std::string &n) {
    if (!on) return;
    if (used >= N) {
      ++dropped;
      return;
    }
    CK(cudaEventRecord(ev[used], s));
    name[used++] = n;
  }
  // State of mark i without waiting: "+x.xxx ms", "pending" or an error.
  std::string state(int i) const {
    const cudaError_t q = cudaEventQuery(ev[i]);
    if (q == cudaErrorNotReady) return "PENDING";
    if (q != cudaSuccess) return cudaGetErrorString(q);
    float ms = 0;
    if (cudaEventQuery(ev[0]) != cudaSuccess || cudaEventElapsedTime(&ms, ev[0], ev[i]) != cudaSuccess) return "done";
    char b[32];
    std::snprintf(b, sizeof b, "+%.3f ms", ms);
    return b;
  }
  // One line per mark (hang report) or all on one line (a failed verification run).
  void print(const char *prefix, bool one_line) const {
    std::string l;
    for (int i = 0; i < used; ++i) {
      if (one_line) l += (i ? ", " : "") + name[i] + " " + state(i);
      else std::printf("%s%-44s %s\n", prefix, name[i].c_str(), state(i).c_str());
    }
    if (one_line) std::printf("%s%s\n", prefix, l.c_str());
    if (dropped) std::printf("%s(%d more marks not recorded)\n", prefix, dropped);
  }
};
static Marks g_marks;
static std::string g_stage;  // what the host waits for (a verification run), for the hang report

static void fill_rand(void *p, size_t count, bool fp8, uint64_t seed, cudaStream_t s) {
  uint64_t c = count;
  launch(fp8 ? H.fill_e4m3 : H.fill_bf16, 1024, 1, 256, 1, 0, s, {&p, &c, &seed});
}
static void fill_words(void *p, size_t bytes, uint32_t v, cudaStream_t s) {
  if (bytes % 4) die("fill_words: bytes not a multiple of 4", __FILE__, __LINE__);
  uint64_t c = bytes / 4;
  launch(H.fill_u32, 1024, 1, 256, 1, 0, s, {&p, &c, &v});
}
// NaN in the element type: bf16 0x7fc0 pairs, e4m3 0x7f bytes.
static void poison(void *p, size_t bytes, bool fp8, cudaStream_t s) {
  fill_words(p, bytes, fp8 ? 0x7f7f7f7fu : 0x7fc07fc0u, s);
}
// The copies' API (--copy-api): "batch", cudaMemcpyBatchAsync (CUDA 12.8+) with one copy
// per call, attributes cudaMemcpyFlagPreferOverlapWithCompute (a hint to overlap the copy
// with compute work, i.e. to use a copy engine rather than SMs) and the source read in
// stream order; or "memcpy", cudaMemcpyAsync (device to device: on one GPU the driver may
// do it with an SM kernel, which queues behind a kernel that holds every SM).
enum CopyApi { COPY_MEMCPY = 0, COPY_BATCH = 1 };
static int g_copy_api = COPY_BATCH;
static std::string g_copy_note;  // why the batch API is not used (the fallback), if so
static const char *copy_api_name() {
  return g_copy_api == COPY_BATCH ? "cudaMemcpyBatchAsync (PreferOverlapWithCompute, one copy per call)"
                                  : "cudaMemcpyAsync";
}
static cudaError_t memcpy_batch1(void *dst, const void *src, size_t bytes, cudaStream_t s) {
#if CUDART_VERSION >= 12080
  cudaMemcpyAttributes at;
  std::memset(&at, 0, sizeof at);
  at.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  at.flags = cudaMemcpyFlagPreferOverlapWithCompute;
  void *dsts[1] = {dst};
  void *srcs[1] = {const_cast<void *>(src)};
  size_t sizes[1] = {bytes}, idx[1] = {0};
#if CUDART_VERSION >= 13000
  return cudaMemcpyBatchAsync(dsts, srcs, sizes, 1, &at, idx, 1, s);
#else
  size_t fail_idx = 0;
  return cudaMemcpyBatchAsync(dsts, srcs, sizes, 1, &at, idx, 1, &fail_idx, s);
#endif
#else
  (void)dst, (void)src, (void)bytes, (void)s;
  return cudaErrorNotSupported;  // built against a CUDA older than 12.8
#endif
}
// Switches to cudaMemcpyAsync for the rest of the run, saying why (once).
static void copy_fallback(const std::string &why) {
  g_copy_api = COPY_MEMCPY;
  g_copy_note = "cudaMemcpyBatchAsync " + why + ": cudaMemcpyAsync instead";
  std::printf("note: %s\n", g_copy_note.c_str());
}
// A device-to-device copy on stream s (the copies variant's pieces, the copy-engine check),
// by the chosen API; a refused batch call falls back to cudaMemcpyAsync from then on.
static void copy_d2d(void *dst, const void *src, size_t bytes, cudaStream_t s) {
  if (g_copy_api == COPY_BATCH) {
    const cudaError_t e = memcpy_batch1(dst, src, bytes, s);
    if (e == cudaSuccess) return;
    (void)cudaGetLastError();  // not sticky: clear it, or the next wait_stream would take it for a failure
    copy_fallback(std::string("refused (") + cudaGetErrorString(e) + ")");
  }
  CK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, s));
}
static void sync_all(const char *what, int seconds = 60) {
  wait_stream(g_comp, what, seconds);
  wait_stream(g_prod, what, seconds);
  wait_stream(g_copy, what, seconds);
}

struct Cmp {
  uint32_t bad = 0, nonfinite = 0;
  float emax = 0;
  uint64_t first = ~0ull;
};
static double rms_bf16(const void *R, size_t count) {
  double *d;
  CK(cudaMalloc(&d, sizeof(double)));
  CK(cudaMemsetAsync(d, 0, sizeof(double), g_comp));
  uint64_t c = count;
  launch(H.sum_sq, 1024, 1, 256, 1, 0, g_comp, {(void *)&R, &c, &d});
  double h = 0;
  CK(cudaMemcpyAsync(&h, d, sizeof h, cudaMemcpyDeviceToHost, g_comp));
  wait_stream(g_comp, "rms");
  CK(cudaFree(d));
  return std::sqrt(h / (double)count);
}
static Cmp compare_tol(const void *D, const void *R, size_t count, float rms, float tol) {
  uint32_t *st;
  uint64_t *fb;
  CK(cudaMalloc(&st, 3 * sizeof(uint32_t)));
  CK(cudaMalloc(&fb, sizeof(uint64_t)));
  CK(cudaMemsetAsync(st, 0, 3 * sizeof(uint32_t), g_comp));
  CK(cudaMemsetAsync(fb, 0xff, sizeof(uint64_t), g_comp));
  uint64_t c = count;
  launch(H.compare, 1024, 1, 256, 1, 0, g_comp, {(void *)&D, (void *)&R, &c, &rms, &tol, &st, &fb});
  uint32_t h[3];
  Cmp r;
  CK(cudaMemcpyAsync(h, st, sizeof h, cudaMemcpyDeviceToHost, g_comp));
  CK(cudaMemcpyAsync(&r.first, fb, sizeof(uint64_t), cudaMemcpyDeviceToHost, g_comp));
  wait_stream(g_comp, "compare");
  CK(cudaFree(st));
  CK(cudaFree(fb));
  r.bad = h[0];
  r.nonfinite = h[1];
  std::memcpy(&r.emax, &h[2], 4);
  return r;
}
// Differing 32-bit words between two buffers of `bytes` bytes.
static Cmp compare_bits(const void *a, const void *b, size_t bytes) {
  uint32_t *cnt;
  uint64_t *fb;
  CK(cudaMalloc(&cnt, sizeof(uint32_t)));
  CK(cudaMalloc(&fb, sizeof(uint64_t)));
  CK(cudaMemsetAsync(cnt, 0, sizeof(uint32_t), g_comp));
  CK(cudaMemsetAsync(fb, 0xff, sizeof(uint64_t), g_comp));
  uint64_t w = bytes / 4;
  launch(H.bitdiff, 1024, 1, 256, 1, 0, g_comp, {(void *)&a, (void *)&b, &w, &cnt, &fb});
  Cmp r;
  CK(cudaMemcpyAsync(&r.bad, cnt, sizeof(uint32_t), cudaMemcpyDeviceToHost, g_comp));
  CK(cudaMemcpyAsync(&r.first, fb, sizeof(uint64_t), cudaMemcpyDeviceToHost, g_comp));
  wait_stream(g_comp, "bitdiff");
  CK(cudaFree(cnt));
  CK(cudaFree(fb));
  return r;
}
static float tol_of(bool fp8) { return fp8 ? 5e-2f : 1e-2f; }  // as bench/own_gemm.cpp, bf16 out

static void read_status(uint32_t out[5]) {
  CK(cudaMemcpyAsync(out, g_status, 5 * sizeof(uint32_t), cudaMemcpyDeviceToHost, g_comp));
  wait_stream(g_comp, "status");
}
static void reset_status() {
  CK(cudaMemsetAsync(g_status, 0, 8 * sizeof(uint32_t), g_comp));
  wait_stream(g_comp, "status reset");
}

// Per-row word arrays (flags, ready, done, copied: WORD_ARRAY words each) and the pacer's
// signal words (sig: SIG_WORDS, the start word last).
static const int WORD_ARRAY = 1024, SIG_WORDS = 1024, SIG_START = SIG_WORDS - 1;

// ---------------------------------------------------------------- one row
// IDEAL: our kernel without waits or signals (the fused kernel's CTAs) beside the link
// schedule alone, in the fused runs' iteration (pacer, start word, joins): what a perfect
// overlap with our kernel would take in this harness (flags variant only).
enum Kind { LT_ALONE, OWN_ALONE, LINK, FUSED, CHUNKED, IDEAL };
struct Cfg {
  Kind kind;
  int copies;  // link variant: 0 flags, 1 copies
};

struct Row {
  bool rs = false, fp8 = false;
  int tp = 0, tokens = 0, K = 0, N = 0;  // the anchor: tokens x K x N (AG: N/tp per rank; RS: K/tp)
  int m = 0, n = 0, k = 0, bn = 0, rows_blk = 0;
  int pieces = 1;      // pieces per block (--pieces, fewer where the block has fewer 128-row tiles)
  int grid_fused = 0;  // our kernel's CTAs in the fused runs
  double block_bytes = 0, nominal_link_ms = 0;
  float lt_ms = 0, own_ms = 0, ideal_ms = 0;
  float link_ms[2] = {0, 0}, fused_ms[2] = {0, 0}, chunk_ms[2] = {0, 0};
  bool fused_ok[2] = {false, false}, chunk_ok[2] = {false, false};
  bool own_ok = false;  // our no-wait D vs cuBLASLt's
  bool ran = false, timed = false, hung = false;
  float late_us = 0;
  std::string notes;
  bool ok() const {
    return ran && own_ok && fused_ok[0] && chunk_ok[0] && (!g_copies_ok || (fused_ok[1] && chunk_ok[1]));
  }
};

// The kernel's 128-byte K blocks of a row of B (src/gemm/sm90.rs k_blocks).
static size_t k_blocks_of(const Row &r) { return ((size_t)r.k * (r.fp8 ? 1 : 2) + 127) / 128; }
// AG pieces as K slices (as the library's fused all-gather where its transport moves
// strided pieces, src/overlap/ag.rs k_slices): piece c of a block is all its rows, the
// bytes [lo, hi) of each row that the kernel's K slice c covers (src/gemm/sm90.rs
// k_slice_bytes); needs at least as many 128-byte K blocks as pieces.
static bool k_slices_of(const Row &r) {
  return !r.rs && g_k_pieces && r.pieces > 1 && (size_t)r.pieces <= k_blocks_of(r);
}
static std::pair<size_t, size_t> k_slice_bytes(const Row &r, int c) {
  const size_t row = (size_t)r.k * (r.fp8 ? 1 : 2), kb = k_blocks_of(r);
  auto edge = [&](size_t j) { return std::min(j * kb / r.pieces * 128, row); };
  return {edge(c), edge(c + 1)};
}

struct Ctx {
  Row &r;
  size_t es = 2, os = 2;  // element sizes of inputs and of D
  void *A = nullptr, *B = nullptr, *Bsrc = nullptr, *Down = nullptr, *Dlt = nullptr, *Df = nullptr, *Dc = nullptr,
       *recv = nullptr;
  float *si = nullptr;
  uint32_t *flags = nullptr, *ready = nullptr, *done = nullptr, *sig = nullptr, *copied = nullptr;
  Own own_plain, own_fused;
  LtPlan lt_whole, lt_chunk;
  std::array<int, 8> order{};  // arrival / send order
  uint32_t epoch = 0;
  cudaEvent_t join_prod = nullptr, join_copy = nullptr;

  explicit Ctx(Row &row) : r(row) {}
  size_t b_off(int blk) const { return (size_t)blk * r.rows_blk * r.k * es; }  // bytes into B
  size_t d_off(int blk) const { return (size_t)blk * r.rows_blk * r.m * os; }  // bytes into D
  size_t d_bytes() const { return (size_t)r.n * r.m * os; }
  size_t blk_d_bytes() const { return (size_t)r.rows_blk * r.m * os; }
  size_t blk_b_bytes() const { return (size_t)r.rows_blk * r.k * es; }

  // rdy_pieces: RS, ready words per block in rdy (r.pieces: our done signals; 1: the chunks').
  PaceArgs pace(int mode, bool copies, const uint32_t *rdy, int rdy_pieces, uint32_t e) const {
    PaceArgs p;
    std::memset(&p, 0, sizeof p);
    p.flags = r.rs || mode == 2 ? nullptr : flags;
    p.ready = rdy;
    p.sig = sig;
    p.status = g_status;
    p.start = mode == 2 ? nullptr : start();
    p.copied = copied;
    p.mirror = g_mirror_dev;
    p.block_ns = (uint64_t)std::llround(r.block_bytes / g_bw);
    p.step_ns = (uint64_t)std::llround(g_step_us * 1e3);
    p.hold_ns = 100000000ull;  // the probe: 100 ms
    p.timeout_ns = TIMEOUT_NS;
    p.mode = mode;
    p.nsend = r.tp - 1;
    p.pieces = r.pieces;
    p.copies = copies;
    p.local = g_me;
    p.epoch = e;
    for (int i = 0; i < 8; ++i) p.order |= (uint32_t)(order[i] & 15) << (4 * i);
    p.ready_pieces = rdy_pieces;
    return p;
  }
  // Pieces q = i * P + c (block order[i], its piece c): go[q], due[q], then fin.
  int npieces() const { return (r.tp - 1) * r.pieces; }
  uint32_t *go() const { return sig + 1; }
  uint32_t *due() const { return go() + npieces(); }
  uint32_t *fin() const { return due() + npieces(); }
  uint32_t *start() const { return sig + SIG_START; }  // beyond go / due / fin (at most 1 + 2 * 7 * 64 + 1 words)
  int rows_piece() const { return r.rows_blk / r.pieces; }

  // The copy stream's part of one iteration (copies variant): piece q of the send / arrival
  // order after its go word; AG: then its copied word (the pacer writes the piece's flag
  // once its scheduled arrival passed and it has seen that word).
  void enqueue_copies(Kind kind, uint32_t e) {
    const int P = r.pieces, rp = rows_piece();
    for (int i = 0; i < r.tp - 1; ++i) {
      const int blk = order[i];
      for (int c = 0; c < P; ++c) {
        const int q = i * P + c;
        wait_geq(g_copy, go() + q, e);
        if (!r.rs && k_slices_of(r)) {
          // K slice c of the block: its rows' bytes [lo, hi), one 2D copy.
          const auto [lo, hi] = k_slice_bytes(r, c);
          const size_t off = b_off(blk) + lo, pitch = (size_t)r.k * es;
          CK(cudaMemcpy2DAsync((char *)B + off, pitch, (const char *)Bsrc + off, pitch, hi - lo, r.rows_blk,
                               cudaMemcpyDeviceToDevice, g_copy));
          write_value(g_copy, copied + q, e, g_signal_write);
        } else if (!r.rs) {
          const size_t off = b_off(blk) + (size_t)c * rp * r.k * es, bytes = (size_t)rp * r.k * es;
          copy_d2d((char *)B + off, (const char *)Bsrc + off, bytes, g_copy);
          write_value(g_copy, copied + q, e, g_signal_write);
          if (g_marks.on)
            g_marks.mark(g_copy, "copy: block " + std::to_string(blk) + " piece " + std::to_string(c) +
                                     " copied, word written");
        } else {
          const void *src = kind == FUSED ? Df : kind == CHUNKED ? Dc : Down;
          const size_t off = d_off(blk) + (size_t)c * rp * r.m * os, bytes = (size_t)rp * r.m * os;
          copy_d2d((char *)recv + off, (const char *)src + off, bytes, g_copy);
          if (g_marks.on)
            g_marks.mark(g_copy, "copy: block " + std::to_string(blk) + " piece " + std::to_string(c) + " delivered");
        }
      }
    }
    if (r.rs) {
      wait_geq(g_copy, fin(), e);
      if (g_marks.on) g_marks.mark(g_copy, "copy: the pacer's fin seen");
    }
  }

  // One iteration of a configuration with epoch e, between events e0 and e1 on the compute
  // stream (either may be null).
  void enqueue(Cfg cfg, uint32_t e, cudaEvent_t e0, cudaEvent_t e1) {
    if (cfg.kind == LT_ALONE) {
      if (e0) CK(cudaEventRecord(e0, g_comp));
      lt_whole.run(A, B, Dlt, g_comp);
    } else if (cfg.kind == OWN_ALONE) {
      if (e0) CK(cudaEventRecord(e0, g_comp));
      own_plain.run(g_comp);
    } else {
      const bool copies = cfg.copies != 0;
      // Both side streams start after what precedes on the compute stream.
      CK(cudaEventRecord(join_prod, g_comp));
      CK(cudaStreamWaitEvent(g_prod, join_prod, 0));
      if (copies) CK(cudaStreamWaitEvent(g_copy, join_prod, 0));
      // RS: the pacer waits on our done signals (one per piece) or the chunks' ready words
      // (one per block: a chunk is a whole block); the link alone has every block ready at t0.
      const uint32_t *rdy = nullptr;
      int rdy_pieces = 1;
      if (r.rs && cfg.kind == FUSED) rdy = done, rdy_pieces = r.pieces;
      if (r.rs && cfg.kind == CHUNKED) rdy = ready;
      PaceArgs p = pace(r.rs ? 1 : 0, copies, rdy, rdy_pieces, e);
      launch(H.pacer, 1, 1, 32, 1, (unsigned)g_pacer_smem, g_prod, {&p});
      if (g_pacer_log.size() < 4096)
        g_pacer_log.push_back({e, std::string(cfg.kind == LINK    ? "link alone"
                                              : cfg.kind == FUSED ? "fused"
                                              : cfg.kind == IDEAL ? "ideal"
                                                                  : "chunked") +
                                      (copies ? " (copies)" : " (flags)")});
      // Untimed: the pacer is resident (on an SM before the GEMM fills them). Then the
      // start event, and the start word that the pacer takes as t0; the GEMM right after
      // (in GPU time: a gate holds the timed iterations until all are enqueued).
      wait_geq(g_comp, sig, e);
      g_marks.mark(g_comp, "compute: pacer announced");
      if (e0) CK(cudaEventRecord(e0, g_comp));
      write_value(g_comp, start(), e);
      g_marks.mark(g_comp, "compute: start word written");
      // Enqueue order: what is waited on first (AG: the copies, which write the flags the
      // GEMM waits on; RS: the GEMM, whose signals the copies wait on through the pacer),
      // so that even streams sharing one hardware queue would only serialize, never wait
      // on each other in a cycle.
      if (copies && !r.rs) enqueue_copies(cfg.kind, e);
      if (cfg.kind == FUSED) {
        if (r.rs) own_fused.done_value = e;
        else own_fused.flag_value = e;
        own_fused.run(g_comp);
        g_marks.mark(g_comp, "compute: our kernel ended");
      } else if (cfg.kind == IDEAL) {
        Own o = own_plain;
        o.grid = own_fused.grid;
        o.run(g_comp);
      } else if (cfg.kind == CHUNKED) {
        for (int idx = 0; idx < r.tp; ++idx) {
          // AG: local block first, then in arrival order; RS: send order, local last.
          // AG: a chunk waits for its block's last piece (the pacer writes a block's flags in
          // piece order: the last one means the whole block is there).
          const int blk = r.rs ? (g_me + 1 + idx) % r.tp : (g_me + idx) % r.tp;
          if (!r.rs && idx > 0) wait_geq(g_comp, flags + blk * r.pieces + r.pieces - 1, e);
          lt_chunk.run(A, (const char *)B + b_off(blk), (char *)Dc + d_off(blk), g_comp);
          if (g_marks.on) g_marks.mark(g_comp, "compute: chunk of block " + std::to_string(blk) + " ended");
          if (r.rs) write_value(g_comp, ready + blk, e, g_signal_write);
        }
      }
      if (copies && r.rs) enqueue_copies(cfg.kind, e);
      g_marks.mark(g_prod, "pacer: kernel ended");
      CK(cudaEventRecord(join_prod, g_prod));
      CK(cudaStreamWaitEvent(g_comp, join_prod, 0));
      if (copies) {
        CK(cudaEventRecord(join_copy, g_copy));
        CK(cudaStreamWaitEvent(g_comp, join_copy, 0));
      }
    }
    if (e1) CK(cudaEventRecord(e1, g_comp));
    g_marks.mark(g_comp, "compute: iteration ended (joins)");
  }

  // Runs fn `reps` times back to back on the compute stream while a pacer (hold mode,
  // 100 ms) sits on its SM (beside = true), or alone; returns fn's shortest time in ms, and
  // in *longest its longest (beside: about 100 or more when some CTA of fn waited for the
  // pacer's SM; the runs after the hold would not show it).
  float timed(const std::function<void(cudaStream_t)> &fn, bool beside, float *longest = nullptr, int reps = 3) {
    std::vector<cudaEvent_t> ev((size_t)reps + 1);
    for (auto &x : ev) CK(cudaEventCreate(&x));
    if (beside) {
      const uint32_t e = ++epoch;
      PaceArgs p = pace(2, false, nullptr, 1, e);
      launch(H.pacer, 1, 1, 32, 1, (unsigned)g_pacer_smem, g_prod, {&p});
      wait_geq(g_comp, sig, e);
    }
    CK(cudaEventRecord(ev[0], g_comp));
    for (int i = 0; i < reps; ++i) {
      fn(g_comp);
      CK(cudaEventRecord(ev[(size_t)i + 1], g_comp));
    }
    sync_all(beside ? "co-residence probe" : "alone run", 20);
    float best = 1e30f, worst = 0;
    for (int i = 0; i < reps; ++i) {
      float ms = 0;
      CK(cudaEventElapsedTime(&ms, ev[(size_t)i], ev[(size_t)i + 1]));
      best = std::min(best, ms);
      worst = std::max(worst, ms);
    }
    for (auto &x : ev) CK(cudaEventDestroy(x));
    if (longest) *longest = worst;
    return best;
  }
};

static const float PROBE_BLOCKED_MS = 50.f;  // the hold is 100 ms; our GEMMs take < 10 ms
static const float PROBE_SLOWED = 1.05f;     // beside the pacer (SMs - 1) vs alone on all SMs

// The pacer's mirror, decoded (host-mapped: read without the device). P: pieces per block
// (the row's), piece index q = block #(q / P) in arrival / send order, its piece q % P.
static Row *g_cur_row = nullptr;  // the row being run, for the hang report
static void print_mirror(const char *prefix) {
  if (!g_mirror_host) return;
  uint32_t m[MIR_WORDS];
  for (int i = 0; i < MIR_WORDS; ++i) m[i] = g_mirror_host[i];
  const uint32_t what = m[MIR_PHASE] >> 16, idx = m[MIR_PHASE] & 0xffff;
  const uint32_t P = (uint32_t)std::max(1, g_cur_row ? g_cur_row->pieces : g_pieces);
  std::string cfg = "?";
  for (auto it = g_pacer_log.rbegin(); it != g_pacer_log.rend(); ++it)
    if (it->first == m[MIR_EPOCH]) {
      cfg = it->second;
      break;
    }
  char ph[320];
  switch (what) {
    case 0: std::snprintf(ph, sizeof ph, "started (no wait or sleep of its own so far)"); break;
    case 1: std::snprintf(ph, sizeof ph, "WAITING FOR THE START WORD (the compute stream writes it)"); break;
    case 3:
      std::snprintf(ph, sizeof ph,
                    "sleeping to the scheduled arrival (AG) / transfer start (RS) of piece %u (block #%u piece %u)", idx,
                    idx / P, idx % P);
      break;
    case 4:
      std::snprintf(ph, sizeof ph,
                    "WAITING FOR THE COPIED WORD of piece %u (block #%u piece %u, arrival order; the copy stream "
                    "writes it after the piece's copy; the remote flags of the %u pieces before it and the go words "
                    "up to the next piece's written)",
                    idx, idx / P, idx % P, idx);
      break;
    case 5:
      std::snprintf(ph, sizeof ph,
                    "WAITING FOR THE READY WORD of piece %u (block #%u piece %u, send order: our done signal per "
                    "piece / the chunk's per block)",
                    idx, idx / P, idx % P);
      break;
    case 6: std::snprintf(ph, sizeof ph, "holding (probe)"); break;
    case 7: std::snprintf(ph, sizeof ph, "sleeping to the last piece's scheduled end"); break;
    case 8: std::snprintf(ph, sizeof ph, "done"); break;
    default: std::snprintf(ph, sizeof ph, "? (%u)", m[MIR_PHASE]);
  }
  std::printf("%slatest launch: epoch %u (%s); %s; timeouts %u (last value read %u); exit epoch %u\n", prefix,
              m[MIR_EPOCH], cfg.c_str(), ph, m[MIR_TIMEOUTS], m[MIR_LAST], m[MIR_EXIT]);
}

// One verification run of the fused or chunked configuration: inputs / outputs poisoned
// first, then the result checked. Returns true when right.
static bool verify(Ctx &c, Kind kind, int copies, float rms) {
  Row &r = c.r;
  const char *vname = copies ? "copies" : "flags";
  const char *kname = kind == FUSED ? "fused" : "chunked";
  void *D = kind == FUSED ? c.Df : c.Dc;
  poison(D, c.d_bytes(), false, g_comp);
  if (!r.rs && copies)
    for (int i = 0; i < r.tp - 1; ++i) poison((char *)c.B + c.b_off(c.order[i]), c.blk_b_bytes(), r.fp8, g_comp);
  if (r.rs && copies) poison(c.recv, c.d_bytes(), false, g_comp);
  wait_stream(g_comp, "poison");
  reset_status();
  char what[96];
  std::snprintf(what, sizeof what, "%s (%s) verification run", kname, vname);
  g_stage = what;
  g_marks.reset(true);
  c.enqueue({kind, copies}, ++c.epoch, nullptr, nullptr);
  g_marks.on = false;
  sync_all(what, 20);
  uint32_t st[5];
  read_status(st);
  bool ok = st[0] == 0;
  if (st[0]) {
    std::printf("  %s: the pacer timed out waiting %u time(s)\n", what, st[0]);
    print_mirror("  pacer: ");
  }
  Cmp m;
  if (kind == FUSED) {
    m = compare_bits(D, c.Down, c.d_bytes());
    if (m.bad)
      std::printf("  %s: %u words differ from our no-wait D (first word %llu: row %llu)\n", what, m.bad,
                  (unsigned long long)m.first, (unsigned long long)(m.first * 4 / (r.m * c.os)));
  } else {
    m = compare_tol(D, c.Dlt, (size_t)r.n * r.m, rms, tol_of(r.fp8));
    if (m.bad)
      std::printf("  %s: %u elements off cuBLASLt's whole D (%u not finite, max e %.3g; first %llu: row %llu)\n",
                  what, m.bad, m.nonfinite, m.emax, (unsigned long long)m.first,
                  (unsigned long long)(m.first / r.m));
  }
  ok &= m.bad == 0;
  if (r.rs && copies)
    for (int i = 0; i < r.tp - 1; ++i) {
      const int blk = c.order[i];
      Cmp b = compare_bits((char *)c.recv + c.d_off(blk), (char *)D + c.d_off(blk), c.blk_d_bytes());
      if (b.bad) std::printf("  %s: delivered block %d differs from D in %u words\n", what, blk, b.bad);
      ok &= b.bad == 0;
    }
  // The steps' times: on a failure, and once (the first copies run) for the record.
  static bool shown = false;
  if (!ok || (copies && !shown)) {
    shown = shown || copies;
    std::printf("  timeline of the %s (ms after the pacer announced itself):\n", what);
    g_marks.print("  timeline: ", true);
  }
  g_marks.reset(false);
  g_stage.clear();
  return ok;
}

// The batch API once, before the copy-engine check: a refusal, or a copy that is not bit
// for bit the source, and the run uses cudaMemcpyAsync instead (said so).
static void probe_copy_api() {
  if (g_copy_api != COPY_BATCH) return;
  const size_t bytes = 1u << 20;
  void *a, *b;
  CK(cudaMalloc(&a, bytes));
  CK(cudaMalloc(&b, bytes));
  fill_words(a, bytes, 0x3f813f82u, g_comp);
  fill_words(b, bytes, 0, g_comp);
  wait_stream(g_comp, "copy API probe setup");
  copy_d2d(b, a, bytes, g_copy);
  wait_stream(g_copy, "copy API probe (one 1 MiB copy)", 20);
  if (g_copy_api == COPY_BATCH) {
    const Cmp m = compare_bits(a, b, bytes);
    if (m.bad) copy_fallback("copied wrong (" + std::to_string(m.bad) + " of " + std::to_string(bytes / 4) +
                             " words differ)");
  }
  CK(cudaFree(a));
  CK(cudaFree(b));
}

// Can the copy stream do its part of the copies variant while every SM is busy? A hold
// kernel (the pacer in hold mode, 100 ms: two CTAs of 1024 threads per SM, each with half
// the SM's shared memory, every thread staying: no thread slot, register or shared memory
// is left, so nothing else fits anywhere; with one-warp CTAs a copy kernel needing no
// shared memory fit beside them and the check wrongly found a copy engine, H100
// 2026-11-26) runs on the COMPUTE stream, where our fused
// kernel runs; meanwhile the copy stream does what it does in an iteration, by the chosen
// copy API (--copy-api), each step timed with events: (1) a 64 MiB device-to-device copy
// after a cuStreamWaitValue32 on a word the hold CTAs wrote, (2) four 8 MiB pieces at
// offsets, each after a (satisfied) cuStreamWaitValue32, (3) a cuStreamWriteValue32
// without the memory barrier, (4) one with it, (5) an 8 MiB piece after a
// cuStreamWaitValue32 on a word that the hold kernel writes half way through the hold (as
// the pacer's go words are written while our kernel holds the SMs; (1)-(4) find theirs
// already there). A step that needed an SM (a copy done by a kernel) or waited for the
// busy SMs (a write whose barrier waits for them) takes most of the hold. Then the copies
// variant would make the pacer time out (no longer deadlock: the pacer writes our kernel's
// flags); so: (1)-(3) slow: copies variant skipped; only (4) slow: the copied words (and
// RS chunks' ready words) are written without the barrier (the work before still
// completes first in stream order; the verification runs check the data bit for bit).
// (5) only goes to the log and the table's "copies variant" line (ended near the hold's
// end: expect the copies to crawl while our kernel holds the SMs, as on the first H100
// runs, whose check of (1)-(4) passed).
static std::string g_ce_summary;  // the check's line, for the table
static bool ce_check() {
  const size_t bytes = 64u << 20, piece = 8u << 20;
  const float hold_ms = 100.f;
  void *a, *b;
  uint32_t *w, *st;
  CK(cudaMalloc(&a, bytes));
  CK(cudaMalloc(&b, bytes));
  CK(cudaMalloc(&w, 64 * sizeof(uint32_t)));
  CK(cudaMalloc(&st, 8 * sizeof(uint32_t)));
  fill_words(w, 64 * sizeof(uint32_t), 0, g_comp);
  fill_words(w, sizeof(uint32_t), 1, g_comp);  // w[0] = 1: the pieces' waits pass
  fill_words(st, 8 * sizeof(uint32_t), 0, g_comp);
  fill_words(a, bytes, 0x3f803f80u, g_comp);
  wait_stream(g_comp, "copy-engine check setup");
  PaceArgs p;
  std::memset(&p, 0, sizeof p);
  p.flags = w + 3;  // (5): CTA 0 writes it half way through the hold
  p.sig = w + 32;
  p.status = st;
  p.hold_ns = (uint64_t)(hold_ms * 1e6f);
  p.mode = 2;
  p.epoch = 1;
  cudaEvent_t ev[6];
  for (auto &x : ev) CK(cudaEventCreate(&x));
  // Two CTAs of 1024 threads an SM, each with half the SM's shared memory: every thread
  // slot, the registers and the shared memory are taken, so a copy done by a kernel has
  // nowhere to run until the hold ends.
  launch(H.pacer, 2u * (unsigned)g_sms, 1, 1024, 1, (unsigned)g_hold_smem, g_comp, {&p});
  wait_geq(g_copy, st + 3, (uint32_t)g_sms);  // g_sms of them resident (no wait for a second wave)
  CK(cudaEventRecord(ev[0], g_copy));
  copy_d2d(b, a, bytes, g_copy);
  CK(cudaEventRecord(ev[1], g_copy));
  for (size_t c = 0; c < 4; ++c) {
    const size_t off = 4096 + c * (piece + 4096);
    wait_geq(g_copy, w, 1);
    copy_d2d((char *)b + off, (const char *)a + off, piece, g_copy);
  }
  CK(cudaEventRecord(ev[2], g_copy));
  write_value(g_copy, w + 1, 1, CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER);
  CK(cudaEventRecord(ev[3], g_copy));
  write_value(g_copy, w + 2, 1, CU_STREAM_WRITE_VALUE_DEFAULT);
  CK(cudaEventRecord(ev[4], g_copy));
  wait_geq(g_copy, w + 3, 1);  // released half way through the hold
  copy_d2d((char *)b + 4096, (const char *)a + 4096, piece, g_copy);
  CK(cudaEventRecord(ev[5], g_copy));
  sync_all("copy-engine check", 20);
  float t[4], t5 = 0;
  for (int i = 0; i < 4; ++i) CK(cudaEventElapsedTime(&t[i], ev[i], ev[i + 1]));
  CK(cudaEventElapsedTime(&t5, ev[0], ev[5]));
  t5 -= hold_ms / 2;  // about the time from the release to the piece's end
  const float slow = 50.f;
  const bool copy_ok = t[0] < slow && t[1] < slow, nb_ok = t[2] < slow, def_ok = nb_ok && t[3] < slow;
  const bool ok = copy_ok && nb_ok, late_ok = t5 < hold_ms / 4;
  g_copies_need_sms = !copy_ok && nb_ok;
  g_signal_write = def_ok ? CU_STREAM_WRITE_VALUE_DEFAULT : CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER;
  char line[1024];
  std::snprintf(line, sizeof line,
                "copy-engine check (every SM held by a kernel on the compute stream; copies by %s): 64 MiB copy %.3f "
                "ms (%.0f GB/s), 4 x 8 MiB pieces after waits %.3f ms, write without barrier %.3f ms, with barrier "
                "%.3f ms, 8 MiB piece after a wait released mid-hold %.3f ms after the release (%s) -> %s",
                copy_api_name(), t[0], bytes / (t[0] * 1e6), t[1], t[2], t[3], t5,
                late_ok ? "ok" : "WAITED FOR THE SMs: expect the copies to crawl beside our kernel",
                !copy_ok ? "the copies NEED SMs: copies variant skipped"
                : !nb_ok ? "a stream write waits for the SMs: copies variant skipped"
                : !def_ok ? "the write's memory barrier waits for the SMs: copied / ready words written without it"
                          : "copy engine, nothing waits for the SMs: the copies variant runs");
  std::printf("%s\n", line);
  g_ce_summary = line;
  for (auto &x : ev) CK(cudaEventDestroy(x));
  for (void *q : {a, b, (void *)w, (void *)st}) CK(cudaFree(q));
  return ok;
}

static float median(std::vector<float> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

static Ctx *g_cur = nullptr;  // the row being run, for the hang report

static void run_row(Row &r, cublasLtHandle_t lth, void *ws, size_t wsz) {
  Ctx c(r);
  g_cur = &c;
  g_cur_row = &r;
  g_pacer_log.clear();
  c.es = r.fp8 ? 1 : 2;
  c.os = 2;
  if (r.rs) {
    r.m = r.N;
    r.k = r.K / r.tp;
  } else {
    r.m = r.N / r.tp;
    r.k = r.K;
  }
  r.n = r.tokens;
  r.rows_blk = r.n / r.tp;
  if (r.n % r.tp || r.rows_blk % BM || (r.rs ? r.K : r.N) % r.tp || !shape_ok(r.fp8, r.m, r.n, r.k) ||
      g_me >= r.tp) {
    r.notes = "shape not supported (row blocks must be whole 128-row tiles)";
    return;
  }
  // Pieces per block: at most --pieces, whole 128-row tiles each, dividing the block (the
  // largest divisor of the block's tile rows that is <= --pieces).
  {
    const int tiles_blk = r.rows_blk / BM;
    int P = std::min(g_pieces, tiles_blk);
    while (tiles_blk % P) --P;
    r.pieces = P;
    if (P != g_pieces) {
      char nb[160];
      std::snprintf(nb, sizeof nb, "%d pieces per block, not %d (a block's %d rows in whole 128-row pieces); ", P,
                    g_pieces, r.rows_blk);
      r.notes += nb;
      std::printf("  %d pieces per block, not %d: pieces are whole 128-row tiles dividing the block's %d rows\n", P,
                  g_pieces, r.rows_blk);
    }
  }
  // The fused kernel's tile width as the library picks it for the SMs it gets (AG: it
  // waits on flags, pick_bn_waiting; never the ping-pong width, which src/gemm/sm90.rs
  // pick_tile leaves out with flags or done signals); our kernel alone runs the same
  // width, as its bit-for-bit reference.
  r.bn = g_bn > 0                  ? g_bn
         : r.rs || k_slices_of(r) ? pick_bn(r.m, r.n, gemm_budget())
                                  : pick_bn_waiting(r.m, r.n, gemm_budget());
  // RS: the pieces raised as the library raises them (src/gemm/sm90.rs rs_pieces), so that
  // one piece's tiles (of the width the fused kernel runs) fit in one round of its CTAs.
  if (r.rs) {
    const int P = rs_pieces(r.pieces, r.rows_blk, r.m, r.bn, gemm_budget());
    if (P != r.pieces) {
      char nb[160];
      std::snprintf(nb, sizeof nb, "%d pieces per block, not %d (one piece's tiles in one round of CTAs, as the library); ",
                    P, r.pieces);
      r.notes += nb;
      std::printf("  %d pieces per block, not %d: one piece's tiles in one round of CTAs, as the library's fused "
                  "reduce-scatter (the block's %d rows)\n", P, r.pieces, r.rows_blk);
      r.pieces = P;
    }
  }
  // Word arrays: flags tp * P, done 2 * tp * P (signals, counters), copied (tp - 1) * P;
  // sig 1 + 2 * (tp - 1) * P + 1 below the start word.
  if (2 * r.tp * r.pieces > WORD_ARRAY || 2 + 2 * (r.tp - 1) * r.pieces > SIG_START)
    die("too many pieces", __FILE__, __LINE__);
  r.block_bytes = r.rs ? (double)r.rows_blk * r.m * 2 : (double)r.rows_blk * r.k * c.es;
  r.nominal_link_ms = (r.tp - 1) * (r.block_bytes / g_bw + g_step_us * 1e3) / 1e6;
  for (int i = 0; i < r.tp - 1; ++i) c.order[i] = (g_me + 1 + i) % r.tp;

  const size_t a_bytes = (size_t)r.m * r.k * c.es, b_bytes = (size_t)r.n * r.k * c.es;
  CK(cudaMalloc(&c.A, a_bytes));
  CK(cudaMalloc(&c.B, b_bytes));
  if (!r.rs) CK(cudaMalloc(&c.Bsrc, b_bytes));
  for (void **p : {&c.Down, &c.Dlt, &c.Df, &c.Dc}) CK(cudaMalloc(p, c.d_bytes()));
  if (r.rs) CK(cudaMalloc(&c.recv, c.d_bytes()));
  CK(cudaMalloc(&c.si, 128 * sizeof(float)));
  for (uint32_t **p : {&c.flags, &c.ready, &c.done, &c.copied}) CK(cudaMalloc(p, WORD_ARRAY * sizeof(uint32_t)));
  CK(cudaMalloc(&c.sig, SIG_WORDS * sizeof(uint32_t)));
  CK(cudaEventCreateWithFlags(&c.join_prod, cudaEventDisableTiming));
  CK(cudaEventCreateWithFlags(&c.join_copy, cudaEventDisableTiming));
  fill_rand(c.A, (size_t)r.m * r.k, r.fp8, 1000 + r.m + r.k, g_comp);
  fill_rand(c.B, (size_t)r.n * r.k, r.fp8, 2000 + r.n + r.k, g_comp);
  if (!r.rs) CK(cudaMemcpyAsync(c.Bsrc, c.B, b_bytes, cudaMemcpyDeviceToDevice, g_comp));
  for (void *p : {c.Down, c.Dlt, c.Df, c.Dc}) poison(p, c.d_bytes(), false, g_comp);
  if (r.rs) poison(c.recv, c.d_bytes(), false, g_comp);
  for (uint32_t *p : {c.flags, c.ready, c.done, c.copied}) fill_words(p, WORD_ARRAY * sizeof(uint32_t), 0, g_comp);
  fill_words(c.sig, SIG_WORDS * sizeof(uint32_t), 0, g_comp);
  // e4m3: the scale_invs 256 bytes apart, as separate tensors would be.
  const float hsi[2] = {r.fp8 ? 0.5f : 1.f, r.fp8 ? 0.25f : 1.f};
  CK(cudaMemcpyAsync(c.si, hsi, sizeof(float), cudaMemcpyHostToDevice, g_comp));
  CK(cudaMemcpyAsync(c.si + 64, hsi + 1, sizeof(float), cudaMemcpyHostToDevice, g_comp));
  wait_stream(g_comp, "row setup");

  auto cleanup = [&]() {
    sync_all("row cleanup");
    for (void *p : {c.A, c.B, c.Bsrc, c.Down, c.Dlt, c.Df, c.Dc, c.recv, (void *)c.si, (void *)c.flags,
                    (void *)c.ready, (void *)c.done, (void *)c.sig, (void *)c.copied})
      if (p) CK(cudaFree(p));
    CK(cudaEventDestroy(c.join_prod));
    CK(cudaEventDestroy(c.join_copy));
    c.lt_whole.release();
    c.lt_chunk.release();
  };

  // Our kernel: plain (no waits) and fused (flags or done signals).
  Own &o = c.own_plain;
  o.fp8 = r.fp8;
  o.out_f32 = false;
  o.m = r.m;
  o.n = r.n;
  o.k = r.k;
  o.bn = r.bn;
  o.group_n = g_group;
  o.A = c.A;
  o.B = c.B;
  o.D = c.Down;
  o.a_si = c.si;
  o.b_si = c.si + 64;
  if (!o.prepare()) {
    r.notes = "tensor maps refused";
    cleanup();
    return;
  }
  Own &f = c.own_fused;
  f = o;
  f.D = c.Df;
  if (r.rs) {
    f.done = c.done;
    f.done_rows = c.rows_piece();  // a done signal per piece: done[blk * P + c]
    f.rot = ((g_me + 1) % r.tp) * (r.rows_blk / BM);
  } else {
    f.flags = c.flags;
    f.rows_per_flag = c.rows_piece();  // a flag per piece: flags[blk * P + c]
    f.rot = g_me * (r.rows_blk / BM);
    if (k_slices_of(r)) {
      // Piece c of a block = its K slice c (flags[blk * P + c] as before): the fused kernel
      // waits per K slice of each whole block.
      f.rows_per_flag = r.rows_blk;
      f.k_pieces = r.pieces;
    }
  }
  // The fused kernel's tile-row groups as the library picks them (src/gemm/sm90.rs
  // group_n): at most a piece's tile rows, so that the first tiles in the schedule need
  // (AG) / complete (RS) the first pieces only; with --group 8 and a piece of 2 tile rows,
  // the first wave's tiles would span all of a block's pieces (and a done signal would
  // wait for the whole group). --fused-group G overrides it.
  // RS (done signals): as many whole pieces as one round of tiles holds, at least one
  // (src/gemm/sm90.rs group_n).
  const int piece_rows = std::max(1, (f.k_pieces > 1 ? r.rows_blk : c.rows_piece()) / BM);
  const int round_fit = gemm_budget() / ((r.m + r.bn - 1) / r.bn) / piece_rows * piece_rows;
  f.group_n = g_fused_group > 0 ? g_fused_group
              : r.rs            ? std::min(g_group, std::max(piece_rows, round_fit))
                                : std::min(g_group, piece_rows);
  std::printf("  %d pieces per block of %d rows (%d rows each: a flag / done signal per piece); our fused kernel in "
              "tile-row groups of %d (alone: %d)\n",
              r.pieces, r.rows_blk, c.rows_piece(), f.group_n, o.group_n);
  o.run(g_comp);
  wait_stream(g_comp, "our kernel (no waits)", 20);

  // cuBLASLt: the whole GEMM and the per-block chunks.
  if (!c.lt_whole.setup(lth, ws, wsz, r.fp8, false, r.m, r.n, r.k, c.si, c.si + 64) ||
      !c.lt_whole.first_run(c.A, c.B, c.Dlt, g_comp)) {
    r.notes = "cuBLASLt: no algorithm runs the whole GEMM";
    cleanup();
    return;
  }
  wait_stream(g_comp, "cuBLASLt whole", 20);
  auto setup_chunk = [&](LtPlan &plan, int target) {
    return plan.setup(lth, ws, wsz, r.fp8, false, r.m, r.rows_blk, r.k, c.si, c.si + 64, target) &&
           plan.first_run(c.A, c.B, c.Dc, g_comp);
  };
  // Chunks planned for all SMs (only to time them alone) and for SMs - 1 (the chunked
  // runs: the pacer has an SM to itself; the same budget as our fused kernel).
  LtPlan lt_chunk_all;
  if (!setup_chunk(lt_chunk_all, 0)) {
    r.notes = "cuBLASLt: no algorithm runs a chunk";
    lt_chunk_all.release();
    cleanup();
    return;
  }
  if (!setup_chunk(c.lt_chunk, gemm_budget())) {
    lt_chunk_all.release();
    r.notes = "cuBLASLt: no algorithm runs a chunk with SM count target " + std::to_string(gemm_budget());
    cleanup();
    return;
  }
  wait_stream(g_comp, "cuBLASLt chunk", 20);
  const float rms = (float)rms_bf16(c.Dlt, (size_t)r.n * r.m);
  {
    Cmp m = compare_tol(c.Down, c.Dlt, (size_t)r.n * r.m, rms, tol_of(r.fp8));
    r.own_ok = m.bad == 0;
    if (m.bad)
      std::printf("  our no-wait D vs cuBLASLt: %u bad (%u not finite), max e %.3g\n", m.bad, m.nonfinite, m.emax);
  }

  // The GEMMs beside a resident pacer (see the header): ours on SMs - 1 CTAs and cuBLASLt's
  // chunks with SM count target SMs - 1, each timed alone on all SMs, alone on SMs - 1 and
  // beside the pacer. "blocked": beside took the pacer's whole hold (some CTA waited for
  // its SM); "slowed": beside > 1.05x alone on all SMs (the cost of the budget and of the
  // pacer, which the bound, taken on all SMs, does not pay).
  {
    const int budget = gemm_budget();
    c.own_fused.grid = budget;
    r.grid_fused = c.own_fused.grid_used();
    auto own_fn = [&](int grid) {
      return [&c, grid](cudaStream_t s) {
        Own o = c.own_plain;
        o.grid = grid;
        o.run(s);
      };
    };
    auto chunks_fn = [&](LtPlan &plan) {
      return [&c, &r, &plan](cudaStream_t s) {
        for (int b = 0; b < r.tp; ++b) plan.run(c.A, (char *)c.B + c.b_off(b), (char *)c.Dc + c.d_off(b), s);
      };
    };
    // Shortest of 3 runs each; beside: blocked if the longest took the hold.
    float own_max = 0, lt_max = 0;
    const float own_all = c.timed(own_fn(0), false), own_bud = c.timed(own_fn(budget), false),
                own_bes = c.timed(own_fn(budget), true, &own_max);
    const float lt_all = c.timed(chunks_fn(lt_chunk_all), false), lt_bud = c.timed(chunks_fn(c.lt_chunk), false),
                lt_bes = c.timed(chunks_fn(c.lt_chunk), true, &lt_max);
    lt_chunk_all.release();
    const bool own_blocked = own_max > PROBE_BLOCKED_MS, lt_blocked = lt_max > PROBE_BLOCKED_MS;
    auto verdict = [](bool blocked, float bes, float all) {
      return blocked ? "BLOCKED" : bes > PROBE_SLOWED * all ? "slowed" : "ok";
    };
    std::printf("  beside a resident pacer (its own SM; GEMMs on %d SMs): ours %.3f ms (alone: %.3f on %d SMs, %.3f "
                "on %d; %.3fx) %s, cuBLASLt chunks %.3f ms (alone: %.3f, %.3f; %.3fx) %s\n",
                budget, own_bes, own_all, g_sms, own_bud, budget, own_bes / own_all, verdict(own_blocked, own_bes, own_all),
                lt_bes, lt_all, lt_bud, lt_bes / lt_all, verdict(lt_blocked, lt_bes, lt_all));
    char nb[192];
    if (own_blocked || own_bes > PROBE_SLOWED * own_all) {
      std::snprintf(nb, sizeof nb, "ours %s beside the pacer: %.3fx alone on all SMs (%.3fx on %d alone); ",
                    verdict(own_blocked, own_bes, own_all), own_bes / own_all, own_bes / own_bud, budget);
      r.notes += nb;
    }
    if (lt_blocked || lt_bes > PROBE_SLOWED * lt_all) {
      std::snprintf(nb, sizeof nb, "chunks %s beside the pacer: %.3fx alone on all SMs (%.3fx on %d alone)%s; ",
                    verdict(lt_blocked, lt_bes, lt_all), lt_bes / lt_all, lt_bes / lt_bud, budget,
                    lt_blocked ? ": chunked is penalized" : "");
      r.notes += nb;
    }
    if (own_blocked) {
      std::printf("  our kernel on %d CTAs waits for the pacer's SM: not run\n", budget);
      r.notes += "not run; ";
      cleanup();
      return;
    }
  }

  // Verification runs (before timing).
  for (int v = 0; v < nvariants(); ++v) {
    r.fused_ok[v] = verify(c, FUSED, v, rms);
    r.chunk_ok[v] = verify(c, CHUNKED, v, rms);
  }
  r.ran = true;
  if (!r.ok()) {
    std::printf("  wrong results: not timed\n");
    cleanup();
    return;
  }

  // Timed runs: every configuration interleaved, groups of rounds behind a gate.
  std::vector<Cfg> cfgs = {{LT_ALONE, 0}, {OWN_ALONE, 0}, {LINK, 0}, {FUSED, 0}, {CHUNKED, 0}};
  if (g_copies_ok) cfgs.insert(cfgs.end(), {{LINK, 1}, {FUSED, 1}, {CHUNKED, 1}});
  cfgs.push_back({IDEAL, 0});  // last: the variants' indices above stay
  const int rounds = g_warmup + g_iters;
  std::vector<cudaEvent_t> ev((size_t)rounds * cfgs.size() * 2);
  for (auto &e : ev) CK(cudaEventCreate(&e));
  reset_status();
  const int per_gate = 2;  // rounds per gate: a few ms of GPU work, a few hundred stream operations
  for (int r0 = 0; r0 < rounds; r0 += per_gate) {
    const uint32_t gv = ++g_gate_value;
    uint64_t gate_timeout = 500000000ull;  // 0.5 s
    launch(H.gate, 1, 1, 32, 1, 0, g_comp, {&g_gate_dev, (void *)&gv, &gate_timeout, &g_status});
    for (int it = r0; it < std::min(rounds, r0 + per_gate); ++it)
      for (size_t j = 0; j < cfgs.size(); ++j)
        c.enqueue(cfgs[j], ++c.epoch, ev[2 * (it * cfgs.size() + j)], ev[2 * (it * cfgs.size() + j) + 1]);
    __atomic_store_n(g_gate_host, gv, __ATOMIC_SEQ_CST);
  }
  sync_all("timed runs", 30);
  std::vector<std::vector<float>> t(cfgs.size());
  for (int it = g_warmup; it < rounds; ++it)
    for (size_t j = 0; j < cfgs.size(); ++j) {
      float ms = 0;
      CK(cudaEventElapsedTime(&ms, ev[2 * (it * cfgs.size() + j)], ev[2 * (it * cfgs.size() + j) + 1]));
      t[j].push_back(ms);
    }
  for (auto &e : ev) CK(cudaEventDestroy(e));
  uint32_t st[5];
  read_status(st);
  r.late_us = st[1] / 1000.f;
  if (st[0]) {
    std::printf("  timed runs: the pacer timed out %u time(s)\n", st[0]);
    r.fused_ok[0] = r.fused_ok[1] = false;
  }
  if (st[2]) r.notes += "gate opened by timeout " + std::to_string(st[2]) + "x; ";
  if (g_copies_ok && !r.rs) {
    char nb[96];
    std::snprintf(nb, sizeof nb, "copies: a piece's copy ended at most %.1f us after its scheduled arrival; ",
                  st[4] / 1000.0);
    r.notes += nb;
  }
  r.lt_ms = median(t[0]);
  r.own_ms = median(t[1]);
  for (int v = 0; v < nvariants(); ++v) {
    r.link_ms[v] = median(t[2 + 3 * v]);
    r.fused_ms[v] = median(t[3 + 3 * v]);
    r.chunk_ms[v] = median(t[4 + 3 * v]);
  }
  r.ideal_ms = median(t.back());
  r.timed = true;
  // After the timed runs (the last ones were the copies variant, if any): the outputs again.
  {
    const int v = nvariants() - 1;
    Cmp fb = compare_bits(c.Df, c.Down, c.d_bytes());
    Cmp cb = compare_tol(c.Dc, c.Dlt, (size_t)r.n * r.m, rms, tol_of(r.fp8));
    if (fb.bad || cb.bad) {
      std::printf("  after the timed runs: fused %u words differ, chunked %u elements off\n", fb.bad, cb.bad);
      r.fused_ok[v] = r.fused_ok[v] && fb.bad == 0;
      r.chunk_ok[v] = r.chunk_ok[v] && cb.bad == 0;
    }
  }
  cleanup();
}

// ---------------------------------------------------------------- the table
static std::string fmt3(double x) {
  char b[32];
  std::snprintf(b, sizeof b, "%.3f", x);
  return b;
}
static std::string shape_str(const Row &r) {
  char b[64];
  if (r.rs) std::snprintf(b, sizeof b, "%dx(%d/%d)x%d", r.tokens, r.K, r.tp, r.N);
  else std::snprintf(b, sizeof b, "%dx%dx(%d/%d)", r.tokens, r.K, r.N, r.tp);
  return std::string(b);
}
// Prints the markdown table and the bar lines (and writes them to out_path); returns the
// exit status: 1 a wrong result or a hang, 2 a row or variant that did not run, else 0.
static int emit_table(const std::vector<Row> &rows, const std::string &out_path) {
  std::ostringstream md;
  char line[2048];
  md << "\n## Emulated-link overlap, one GPU (our fused kernel vs chunked cuBLASLt)\n\n";
  const std::string fused_groups =
      g_fused_group > 0 ? "tile-row groups of " + std::to_string(g_fused_group) + " (--fused-group)"
                        : "tile-row groups of min(" + std::to_string(g_group) +
                              ", AG: a piece's tile rows (with K slices: a block's); RS: the whole pieces one round "
                              "of tiles holds, at least one), as the library picks them";
  std::snprintf(line, sizeof line,
                "Link %.0f GB/s per peer plus %.3f us a block (--step-us), each block in %d pieces (AG: an arrival flag per piece, %s, RS: a done signal "
                "per piece, each piece sent on its own; other piece counts where the notes say; the chunked baseline "
                "GEMMs whole blocks: AG after a block's last piece, RS its ready word per block; our fused kernel in "
                "%s), rank %d; median "
                "of %d iterations, from t0 "
                "(the start event, the pacer's schedule starting with it) to the end of the GEMM and the link; ms. "
                "bound = max(Lt, link), Lt on all %d SMs; fused and chunked run on %d (the pacer has an SM to itself); "
                "f vs c = chunked / fused (> 1: fused faster).\n\n",
                g_bw, g_step_us, g_pieces,
                g_k_pieces ? "AG pieces are K slices of the whole block (--k-pieces: its rows' K columns; a 2D copy "
                             "in the copies variant)"
                           : "AG pieces are row slices",
                fused_groups.c_str(), g_me, g_iters, g_sms, gemm_budget());
  md << line;
  md << "| op | in | tp | shape | link | Lt alone | ours alone | link alone | bound | fused | chunked | fused/bound | "
        "chunked/bound | f vs c | late us | ok | notes |\n";
  md << "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n";
  bool all_ok = true, all_ran = true;
  double lsum[2][2][2] = {};  // [variant][fp8][rs]
  int lcnt[2][2][2] = {};
  double isum[2] = {}, hsum[2] = {};  // [fp8]: log fused / ideal, log ideal / max(ours alone, link), flags
  int icnt[2] = {};
  int tp8_rows = 0, tp8_faster = 0, tp8_v[2] = {0, 0}, tp8_vn[2] = {0, 0};
  for (auto &r : rows) {
    if (!r.ran) all_ran = false;
    if ((r.ran && !r.ok()) || r.hung) all_ok = false;
    if (!r.timed) {
      std::snprintf(line, sizeof line, "| %s | %s | %d | %s | - | - | - | - | - | - | - | - | - | - | - | %s | %s |\n",
                    r.rs ? "RS" : "AG", r.fp8 ? "e4m3" : "bf16", r.tp, shape_str(r).c_str(),
                    r.hung ? "HANG" : r.ran ? "NO" : "not run", r.notes.c_str());
      md << line;
      continue;
    }
    if (r.ideal_ms > 0 && r.fused_ms[0] > 0) {
      isum[r.fp8] += std::log(r.fused_ms[0] / r.ideal_ms);
      hsum[r.fp8] += std::log(r.ideal_ms / std::max(r.own_ms, r.link_ms[0]));
      icnt[r.fp8]++;
    }
    for (int v = 0; v < nvariants(); ++v) {
      const double bound = std::max(r.lt_ms, r.link_ms[v]);
      const double fb = r.fused_ms[v] / bound, cb = r.chunk_ms[v] / bound, fc = r.chunk_ms[v] / r.fused_ms[v];
      const bool ok = r.fused_ok[v] && r.chunk_ok[v] && r.own_ok;
      std::snprintf(line, sizeof line,
                    "| %s | %s | %d | %s | %s | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f | %.1f | "
                    "%s | %s |\n",
                    r.rs ? "RS" : "AG", r.fp8 ? "e4m3" : "bf16", r.tp, shape_str(r).c_str(), v ? "copies" : "flags",
                    r.lt_ms, r.own_ms, r.link_ms[v], bound, r.fused_ms[v], r.chunk_ms[v], fb, cb, fc, r.late_us,
                    ok ? "yes" : "NO",
                    (r.notes + (v == 0 && r.ideal_ms > 0 ? "ideal " + fmt3(r.ideal_ms) + " (fused / ideal " +
                                                                fmt3(r.fused_ms[0] / r.ideal_ms) + "); "
                                                          : std::string()))
                        .c_str());
      md << line;
      if (fb > 0 && std::isfinite(fb)) {
        lsum[v][r.fp8][r.rs] += std::log(fb);
        lcnt[v][r.fp8][r.rs]++;
      }
      if (r.tp == 8) {
        tp8_rows++;
        tp8_vn[v]++;
        if (r.fused_ms[v] < r.chunk_ms[v]) {
          tp8_faster++;
          tp8_v[v]++;
        }
      }
    }
  }
  md << "\n";
  for (int v = 0; v < 2; ++v)
    for (int f8 = 0; f8 < 2; ++f8) {
      const int n = lcnt[v][f8][0] + lcnt[v][f8][1];
      if (!n) continue;
      const double g = std::exp((lsum[v][f8][0] + lsum[v][f8][1]) / n);
      auto part = [&](int rs) {
        return lcnt[v][f8][rs] ? std::exp(lsum[v][f8][rs] / lcnt[v][f8][rs]) : 0.0;
      };
      std::snprintf(line, sizeof line,
                    "- %s, %s: fused <= 1.05x max(GEMM, link), geomean over tp 4 and 8 rows: %.3f (%s; %d rows: AG "
                    "%.3f, RS %.3f)\n",
                    v ? "real copies" : "flags only", f8 ? "e4m3" : "bf16", g, g <= 1.05 ? "met" : "missed", n,
                    part(0), part(1));
      md << line;
    }
  for (int f8 = 0; f8 < 2; ++f8)
    if (icnt[f8]) {
      std::snprintf(line, sizeof line,
                    "- flags only, %s: fused / ideal (our kernel without waits beside the link schedule, in the same "
                    "iteration: pacer, start word, joins) geomean %.3f; ideal / max(ours alone, link alone) %.3f "
                    "(the harness and the shared SM; %d rows)\n",
                    f8 ? "e4m3" : "bf16", std::exp(isum[f8] / icnt[f8]), std::exp(hsum[f8] / icnt[f8]), icnt[f8]);
      md << line;
    }
  if (tp8_rows) {
    std::snprintf(line, sizeof line,
                  "- fused faster than chunked on %d of %d tp-8 rows (bar >= 80 %%: %s; flags only %d of %d, real "
                  "copies %d of %d)\n",
                  tp8_faster, tp8_rows, tp8_faster * 5 >= tp8_rows * 4 ? "met" : "missed", tp8_v[0], tp8_vn[0],
                  tp8_v[1], tp8_vn[1]);
    md << line;
  }
  md << "- copies variant: by " << copy_api_name() << (g_copy_note.empty() ? "" : " (" + g_copy_note + ")") << "; "
     << (g_ce_summary.empty() ? "copy-engine check not run" : g_ce_summary) << "\n";
  if (!g_copies_ok) {
    md << "- real copies: NOT RUN (device-to-device copies needed SMs on this device; see the copy-engine check)\n";
    all_ran = false;
  }
  std::snprintf(line, sizeof line, "- correctness: %s%s\n", all_ok ? "every row right" : "WRONG RESULTS",
                all_ran ? "" : " (some rows or variants did not run)");
  md << line;
  std::printf("%s", md.str().c_str());
  if (!out_path.empty()) {
    std::ofstream f(out_path);
    f << md.str();
  }
  std::fflush(stdout);
  if (!all_ok) return 1;
  return all_ran ? 0 : 2;
}

// ---------------------------------------------------------------- the hang report
// Called by wait_stream when a run does not end: what is stuck, read without waiting on
// the device (stream and event queries, the pacer's host-mapped mirror; device words only
// through a copy on a stream of its own, given up after 2 s), then the table of the rows
// done so far. The process then ends with status 1.
static std::vector<Row> *g_rows = nullptr;
static std::string g_out_path;
static uint32_t *g_diag_host = nullptr;  // pinned, DIAG_WORDS words
static const int DIAG_WORDS = 4096;
static std::atomic<int> g_diag_issued{0};

static void on_hang(const char *what) {
  auto q = [](cudaStream_t s) -> std::string {
    const cudaError_t e = cudaStreamQuery(s);
    return e == cudaSuccess ? "idle" : e == cudaErrorNotReady ? "BUSY" : cudaGetErrorString(e);
  };
  std::printf("  hang: %s; streams now: compute %s, pacer %s, copies %s\n", what, q(g_comp).c_str(),
              q(g_prod).c_str(), q(g_copy).c_str());
  print_mirror("  hang: pacer: ");
  if (g_marks.used) {
    std::printf("  hang: steps of the %s (events recorded after each, queried without waiting):\n", g_stage.c_str());
    g_marks.print("  hang:   ", false);
  }
  if (g_cur && g_diag_host) {
    Ctx &c = *g_cur;
    const int tp = c.r.tp, P = c.r.pieces;
    struct Span {
      const uint32_t *src;
      int words;
      const char *name;
    };
    // At most 512 + 448 + 1024 + 8 + 898 + 1 words (tp 8, 64 pieces) < DIAG_WORDS.
    const int nsig = 1 + 2 * (tp - 1) * P + 1;
    char pn[64];
    std::snprintf(pn, sizeof pn, "%d pieces per block", P);
    std::printf("  hang: %s; piece q = i * %d + c: piece c of the i-th block in arrival / send order\n", pn, P);
    const Span spans[] = {{c.flags, tp * P, "flags (block b's piece c at b * P + c)"},
                          {c.copied, (tp - 1) * P, "copied (piece q, arrival order)"},
                          {c.done, 2 * tp * P, "done (signals per piece at b * P + c, then counters)"},
                          {c.ready, tp, "ready (the chunks', per block)"},
                          {c.sig, nsig, "sig (started, go[q]..., due[q]..., fin)"},
                          {c.start(), 1, "start"}};
    std::printf("  hang: the latest epoch enqueued is %u; device words (a copy on a stream of its own):\n", c.epoch);
    std::fflush(stdout);
    g_diag_issued = 0;
    std::vector<Span> sp(std::begin(spans), std::end(spans));
    std::thread([sp]() {
      int off = 0;
      for (const Span &x : sp) {
        if (x.src && off + x.words <= DIAG_WORDS)
          cudaMemcpyAsync(g_diag_host + off, x.src, (size_t)x.words * 4, cudaMemcpyDeviceToHost, g_diag);
        off += x.words;
      }
      g_diag_issued = 1;
    }).detach();
    const auto t0 = std::chrono::steady_clock::now();
    bool done = false;
    while (std::chrono::steady_clock::now() - t0 < std::chrono::seconds(2)) {
      if (g_diag_issued && cudaStreamQuery(g_diag) == cudaSuccess) {
        done = true;
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    if (!done) {
      std::printf("  hang:   (not readable: the copy %s in 2 s)\n", g_diag_issued ? "did not complete" : "was not even issued");
    } else {
      int off = 0;
      for (const Span &x : sp) {
        std::string l;
        for (int i = 0; i < x.words && off + i < DIAG_WORDS; ++i) l += " " + std::to_string(g_diag_host[off + i]);
        std::printf("  hang:   %s:%s\n", x.name, x.src ? l.c_str() : " (none)");
        off += x.words;
      }
    }
  }
  if (g_cur_row) {
    g_cur_row->hung = true;
    g_cur_row->notes += std::string("HANG: ") + what + " (the log's 'hang:' lines say where); ";
  }
  if (g_rows) {
    std::printf("  hang: the table of the rows so far:\n");
    emit_table(*g_rows, g_out_path);
  }
  std::fflush(stdout);
}

// ---------------------------------------------------------------- main
int main(int argc, char **argv) {
  const auto t_start = std::chrono::steady_clock::now();
  g_prog = "own_gemm_link";
  std::string kernel_path = "kernels/gemm_sm90.cu", only, dtype = "both", tps = "4,8", out_path;
  std::vector<std::string> defines;
  bool quick = false, compile_only = false, iters_set = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> const char * {
      if (i + 1 >= argc) die(("missing value after " + a).c_str(), __FILE__, __LINE__);
      return argv[++i];
    };
    if (a == "--kernel") kernel_path = next();
    else if (a == "--iters") g_iters = std::max(1, std::atoi(next())), iters_set = true;
    else if (a == "--warmup") g_warmup = std::max(0, std::atoi(next()));
    else if (a == "--bw") g_bw = std::atof(next());
    else if (a == "--step-us") g_step_us = std::atof(next());
    else if (a == "--pieces") g_pieces = std::atoi(next());
    else if (a == "--me") g_me = std::atoi(next());
    else if (a == "--group") g_group = std::max(1, std::atoi(next()));
    else if (a == "--fused-group") g_fused_group = std::max(0, std::atoi(next()));
    else if (a == "--k-pieces") g_k_pieces = true;
    else if (a == "--row-pieces") g_k_pieces = false;
    else if (a == "--bn") {
      g_bn = std::atoi(next());
      if (g_bn != 128 && g_bn != 256 && g_bn != 192) die("--bn takes 128, 192 or 256", __FILE__, __LINE__);
    }
    else if (a == "--quick") quick = true;
    else if (a == "--only") only = next();
    else if (a == "--dtype") dtype = next();
    else if (a == "--tp") tps = next();
    else if (a == "--out") out_path = next();
    else if (a == "--compile-only") compile_only = true;
    else if (a == "--define") defines.push_back(std::string("-D") + next());
    else if (a == "--budget") g_budget = std::atof(next());
    else if (a == "--gemm-sms") g_gemm_sms = std::atoi(next());
    else if (a == "--copy-api") {
      const std::string v = next();
      if (v != "memcpy" && v != "batch") die("--copy-api takes memcpy or batch", __FILE__, __LINE__);
      g_copy_api = v == "batch" ? COPY_BATCH : COPY_MEMCPY;
    } else {
      std::printf("usage: own_gemm_link [--kernel FILE] [--iters N] [--warmup N] [--bw GBPS] [--step-us U] "
                  "[--pieces P] [--me R] [--group G] [--quick] [--only ag|rs] [--dtype bf16|e4m3|both] [--tp 4,8] [--out FILE] "
                  "[--compile-only] [--define NAME=VALUE ...] [--budget SECONDS] [--gemm-sms N] "
                  "[--copy-api memcpy|batch] [--fused-group G] [--bn 128|192|256]\n");
      return a == "--help" ? 0 : 2;
    }
  }
  if (quick && !iters_set) g_iters = 10;
  if (!(g_bw > 0) || !(g_step_us >= 0) || g_pieces < 1 || g_pieces > 64 || g_me < 0)
    die("bad --bw / --step-us / --pieces / --me", __FILE__, __LINE__);
  if (!only.empty() && only != "ag" && only != "rs") die("--only takes ag or rs", __FILE__, __LINE__);
  if (dtype != "both" && dtype != "bf16" && dtype != "e4m3") die("--dtype takes bf16, e4m3 or both", __FILE__, __LINE__);
  std::vector<int> tp_list;
  {
    std::stringstream ss(tps);
    std::string x;
    while (std::getline(ss, x, ',')) {
      const int t = std::atoi(x.c_str());
      if (t < 2 || t > 8) die("--tp values must be 2..8", __FILE__, __LINE__);
      tp_list.push_back(t);
    }
    if (tp_list.empty()) die("--tp: empty list", __FILE__, __LINE__);
  }

  const std::string src = read_text(kernel_path);
  const std::string arch = "sm_90a";
  if (!compile_only) {
    CK(cudaSetDevice(0));
    CK(cudaFree(nullptr));
    cudaDeviceProp p;
    CK(cudaGetDeviceProperties(&p, 0));
    g_sms = p.multiProcessorCount;
    if (p.major != 9) {
      std::printf("own_gemm_link: needs a Hopper GPU (sm_90a); device 0 is %s (sm_%d%d)\n", p.name, p.major, p.minor);
      return 2;
    }
    const char *conn = std::getenv("CUDA_DEVICE_MAX_CONNECTIONS"), *ml = std::getenv("CUDA_MODULE_LOADING");
    std::printf("device: %s, %d SMs, %zu KB shared memory per SM, %d copy engines; NVRTC for %s; "
                "CUDA_DEVICE_MAX_CONNECTIONS=%s, CUDA_MODULE_LOADING=%s\n",
                p.name, g_sms, p.sharedMemPerMultiprocessor / 1024, p.asyncEngineCount, arch.c_str(),
                conn ? conn : "(unset: 8)", ml ? ml : "(unset: lazy)");
  }
  const auto gemm_cubin = nvrtc_compile(src, "gemm_sm90.cu", arch, defines, false);
  const auto help_cubin = nvrtc_compile(HELP_SRC, "own_gemm_link_help.cu", arch, {}, false);
  const auto pace_cubin = nvrtc_compile(PACE_SRC, "own_gemm_link_pace.cu", arch, {"--maxrregcount=32"}, true);
  std::printf("compiled: gemm_sm90.cu %zu bytes, helpers %zu, pacer %zu\n", gemm_cubin.size(), help_cubin.size(),
              pace_cubin.size());
  if (compile_only) return 0;

  load_driver();
  gemm_mod.load(gemm_cubin);
  if (g_bn == 192 && !gemm_mod.has_pp) die("--bn 192: the kernel file has no BN-192 kernels", __FILE__, __LINE__);
  CU(drv.ModuleLoadData(&H.help, help_cubin.data()));
  CU(drv.ModuleLoadData(&H.pace, pace_cubin.data()));
  CU(drv.ModuleGetFunction(&H.fill_bf16, H.help, "fill_bf16"));
  CU(drv.ModuleGetFunction(&H.fill_e4m3, H.help, "fill_e4m3"));
  CU(drv.ModuleGetFunction(&H.fill_u32, H.help, "fill_u32"));
  CU(drv.ModuleGetFunction(&H.sum_sq, H.help, "sum_sq_bf16"));
  CU(drv.ModuleGetFunction(&H.compare, H.help, "compare_bf16"));
  CU(drv.ModuleGetFunction(&H.bitdiff, H.help, "bitdiff"));
  CU(drv.ModuleGetFunction(&H.pacer, H.pace, "link_pacer"));
  CU(drv.ModuleGetFunction(&H.gate, H.pace, "gate"));
  // The pacer takes all the shared memory one CTA may have: with the SM's per-CTA reserve
  // that is the whole SM, so no CTA of a GEMM (or of anything else) can land beside it and
  // none is slowed by it (a CTA of ours beside the spinning pacer made our static
  // persistent schedule 1.7x slower on the first H100 run). The GEMMs get SMs - 1.
  {
    int optin = 0, per_sm = 0, reserve = 0;
    CK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0));
    CK(cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, 0));
    CK(cudaDeviceGetAttribute(&reserve, cudaDevAttrReservedSharedMemoryPerBlock, 0));
    g_pacer_smem = std::min(optin, per_sm - reserve);
    g_hold_smem = std::min(optin, (per_sm - 2 * reserve) / 2);
    const int left = per_sm - reserve - g_pacer_smem;  // what another CTA could get, its reserve included
    g_pacer_alone = left < std::max(reserve, 1);
    CU(drv.FuncSetAttribute(H.pacer, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, g_pacer_smem));
    CU(drv.FuncSetAttribute(H.pacer, CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 100));
    std::printf("pacer: one warp with %d bytes of shared memory (SM %d, reserve %d per CTA): %s\n", g_pacer_smem,
                per_sm, reserve,
                g_pacer_alone ? "its SM holds nothing else; the GEMMs beside it run on SMs - 1"
                              : "ANOTHER CTA COULD SHARE ITS SM (see the probe's 'slowed')");
  }
  CU(drv.FuncGetAttribute(&H.pacer_regs, CU_FUNC_ATTRIBUTE_NUM_REGS, H.pacer));
  std::printf("registers per thread: ours %d (bf16 256), pacer %d; ours' shared memory %d / %d bytes (BN 256 / 128)\n",
              gemm_mod.regs[0][0][1], H.pacer_regs, gemm_mod.smem[1], gemm_mod.smem[0]);

  CK(cudaStreamCreateWithFlags(&g_comp, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithFlags(&g_prod, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithFlags(&g_copy, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithFlags(&g_diag, cudaStreamNonBlocking));
  {
    void *hp = nullptr, *dp = nullptr;
    CK(cudaHostAlloc(&hp, 64 * sizeof(uint32_t), cudaHostAllocMapped));
    CK(cudaHostGetDevicePointer(&dp, hp, 0));
    std::memset(hp, 0, 64 * sizeof(uint32_t));
    g_mirror_host = (volatile uint32_t *)hp;
    g_mirror_dev = (uint32_t *)dp;
    CK(cudaHostAlloc(&hp, DIAG_WORDS * sizeof(uint32_t), cudaHostAllocDefault));
    g_diag_host = (uint32_t *)hp;
  }
  g_marks.create();
  g_on_hang = on_hang;
  CK(cudaMalloc(&g_status, 8 * sizeof(uint32_t)));
  {
    void *hp = nullptr, *dp = nullptr;
    CK(cudaHostAlloc(&hp, 64, cudaHostAllocMapped));
    CK(cudaHostGetDevicePointer(&dp, hp, 0));
    g_gate_host = (volatile uint32_t *)hp;
    *g_gate_host = 0;
    g_gate_dev = (uint32_t *)dp;
  }
  probe_copy_api();
  std::printf("copies (copies variant): %s%s%s\n", copy_api_name(), g_copy_note.empty() ? "" : "; ",
              g_copy_note.c_str());
  g_copies_ok = ce_check();
  if (!g_copies_ok && g_copies_need_sms && gemm_budget() < g_sms - 1) {
    // The copies are kernels: they run on the SMs --gemm-sms leaves free (the pacer's SM
    // and the rest), as a real transport's SM puts would.
    g_copies_ok = true;
    g_ce_summary += "; the copies variant runs anyway: its copies (kernels) get the " +
                    std::to_string(g_sms - gemm_budget()) + " SMs --gemm-sms leaves free";
    std::printf("copies variant: the copies are kernels; they run on the %d SMs --gemm-sms leaves free\n",
                g_sms - gemm_budget());
  }

  cublasLtHandle_t lth;
  LT(cublasLtCreate(&lth));
  void *ws;
  const size_t wsz = 64u << 20;
  CK(cudaMalloc(&ws, wsz));

  // The rows: per-rank anchor shapes of issue 22 (tokens, K, N).
  const std::array<int, 3> ag_shapes[3] = {{8192, 8192, 28672}, {8192, 4096, 16384}, {16384, 8192, 8192}};
  const std::array<int, 3> rs_shapes[3] = {{8192, 28672, 8192}, {8192, 16384, 4096}, {16384, 8192, 8192}};
  std::vector<Row> rows;
  g_rows = &rows;
  g_out_path = out_path;
  for (int rs = 0; rs < 2; ++rs) {
    if (!only.empty() && only != (rs ? "rs" : "ag")) continue;
    for (int f8 = 0; f8 < 2; ++f8) {
      if ((f8 && dtype == "bf16") || (!f8 && dtype == "e4m3")) continue;
      for (int tp : tp_list)
        for (int s = 0; s < (quick ? 1 : 3); ++s) {
          const auto &sh = rs ? rs_shapes[quick ? 1 : s] : ag_shapes[quick ? 1 : s];
          Row r;
          r.rs = rs;
          r.fp8 = f8;
          r.tp = tp;
          r.tokens = sh[0];
          r.K = sh[1];
          r.N = sh[2];
          rows.push_back(r);
        }
    }
  }
  std::printf("link: %.0f GB/s per peer plus %.3f us a block, %d pieces per block (flags, done signals, copies); this "
              "GPU is rank %d; %d timed iterations after %d warm-up (median)\n",
              g_bw, g_step_us, g_pieces, g_me, g_iters, g_warmup);
  for (size_t i = 0; i < rows.size(); ++i) {
    Row &r = rows[i];
    std::printf("row %zu/%zu: %s %s tp %d %s\n", i + 1, rows.size(), r.rs ? "RS" : "AG", r.fp8 ? "e4m3" : "bf16", r.tp,
                shape_str(r).c_str());
    std::fflush(stdout);
    const double spent = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
    if (spent > g_budget) {
      r.notes = "not run: the time budget (--budget " + std::to_string((int)g_budget) + " s) was spent";
      std::printf("  not timed: %s\n", r.notes.c_str());
      continue;
    }
    run_row(r, lth, ws, wsz);
    g_cur = nullptr;
    g_cur_row = nullptr;
    if (r.timed)
      std::printf("  Lt %.3f ours %.3f | flags: link %.3f fused %.3f chunked %.3f ideal %.3f | copies: link %.3f "
                  "fused %.3f chunked %.3f ms (nominal link %.3f) late %.1f us -> %s\n",
                  r.lt_ms, r.own_ms, r.link_ms[0], r.fused_ms[0], r.chunk_ms[0], r.ideal_ms, r.link_ms[1],
                  r.fused_ms[1], r.chunk_ms[1], r.nominal_link_ms, r.late_us, r.ok() ? "ok" : "WRONG");
    else
      std::printf("  not timed: %s%s\n", r.ran ? "wrong results " : "", r.notes.c_str());
    std::fflush(stdout);
  }

  // Markdown table and bar lines last.
  const int status = emit_table(rows, out_path);
  CK(cudaFree(ws));
  LT(cublasLtDestroy(lth));
  return status;
}
