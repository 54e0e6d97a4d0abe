// Communication kernels of the overlap engine: flag signal / wait with timeouts, SM
// puts, and the reductions of the reduce-scatter algorithms (element types: types.cuh).
#include "types.cuh"

#define MAX_PEERS 16

// ---------------------------------------------------------------- flags, timeouts
// Error record in host-mapped memory: the first wait that times out fills it; every
// later wait sees `code` set and returns at once, so a broken peer costs one timeout.
// The first failing thread claims the record (`claim`), fills it, and publishes `code`
// last, so a host that sees `code` set also sees the fields.
struct ErrorRecord {
  u32 code;  // 0 none, 1 timeout, 2 call mismatch (NVTE_COMM_CHECK), 3 transport error
  u32 peer;  // world rank of the peer that never signalled / that called differently
  u32 op;    // operation id (engine's enum)
  u32 step;  // algorithm step
  u64 seq;   // call number (the device-side call counter)
  u64 waited_ns;
  u64 peer_desc;  // mismatch: the peer's call descriptor
  u64 peer_seq;   // mismatch: the peer's call number
  u32 claim;      // set (atomicCAS) by the one thread that records
  u32 pad;
};

// Record a failure once: claim, fill, then publish the code (after a system fence).
__device__ __forceinline__ void record_failure(ErrorRecord *err, u32 code, u32 peer, u32 op, u32 step, u64 seq,
                                               u64 waited_ns, u64 peer_desc, u64 peer_seq) {
  if (atomicCAS(&err->claim, 0u, 1u) != 0u) return;
  volatile ErrorRecord *e = err;
  e->peer = peer;
  e->op = op;
  e->step = step;
  e->seq = seq;
  e->waited_ns = waited_ns;
  e->peer_desc = peer_desc;
  e->peer_seq = peer_seq;
  __threadfence_system();
  e->code = code;
  __threadfence_system();
}

// A peer's call descriptor for a call: {descriptor, call number}, written by the peer
// (IPC: into this rank's flag memory before its arrival signal; NCCL: received in the
// arrival exchange). The descriptor is a hash of the call's operation and shapes, the
// operation id in its top byte.
struct CheckSet {
  const u64 *slot[MAX_PEERS];  // {desc, seq} of each peer (local memory)
  u32 peer[MAX_PEERS];         // world rank of each
  u32 n;
};

// Compare every peer's {desc, seq} with this rank's; the first difference is recorded
// (code 2), after which every wait of the object returns at once. False where this
// thread found a difference or a failure already recorded.
__device__ __forceinline__ bool check_peers(const CheckSet &c, u64 seq, u64 desc, ErrorRecord *err, u32 op) {
  const u32 i = threadIdx.x;
  if (i >= c.n) return true;
  volatile ErrorRecord *e = err;
  if (e->code != 0) return false;
  const volatile u64 *s = c.slot[i];
  const u64 pd = s[0], ps = s[1];
  if (pd == desc && ps == seq) return true;
  record_failure(err, 2, c.peer[i], op, 0, seq, 0, pd, ps);
  return false;
}

struct FlagSet {
  u64 *flag[MAX_PEERS];  // flag addresses (local memory for waits, peer memory for signals)
  u32 peer[MAX_PEERS];   // world rank each flag belongs to (for the error message)
  u32 n;
};

__device__ __forceinline__ u64 globaltimer() {
  u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ u64 ld_acquire_sys(const u64 *p) {
  u64 v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_sys(u64 *p, u64 v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// Flag values come from device memory, never from the host. Each overlap object has, on
// every rank, a call counter in its own device memory: `begin_call` increments it on the
// stream at the start of every call, and every signal / wait of the call reads it, so a
// value is (call number << 16) + tag (tag: algorithm step + 1). A call captured into a
// CUDA graph thus gets a new, larger number at every replay (a number written into the
// kernel arguments on the host would be frozen by the capture: after the first replay
// every wait would already be satisfied). All ranks make the same calls, so their
// counters agree.
__device__ __forceinline__ u64 flag_value(const u64 *counter, u64 tag) {
  return (*(const volatile u64 *)counter << 16) + tag;
}

// Sizes shared with the Rust side (src/transport: ErrorRecord, CheckSet; FlagSet in
// ipc.rs; Progress in nccl.rs), whose unit tests assert the same sizes and the offsets
// (NVRTC has no offsetof).
static_assert(sizeof(ErrorRecord) == 56, "ErrorRecord layout");
static_assert(sizeof(CheckSet) == 200, "CheckSet layout");
static_assert(sizeof(FlagSet) == 200, "FlagSet layout");

// Thread i: wait until *set.flag[i] >= expected, or until timeout_ns has passed (then
// record the error, with the call number, and return). Returns at once if an error is
// already recorded. False if it gave up.
__device__ __forceinline__ bool wait_one(const FlagSet &set, u64 expected, u64 timeout_ns, ErrorRecord *err, u32 op,
                                         u32 step) {
  const u32 i = threadIdx.x;
  volatile ErrorRecord *e = err;
  if (e->code != 0) return false;
  const u64 t0 = globaltimer();
  u32 spins = 0;
  while (ld_acquire_sys(set.flag[i]) < expected) {
    if ((++spins & 63) == 0) {
      if (e->code != 0) return false;
      const u64 dt = globaltimer() - t0;
      if (dt > timeout_ns) {
        record_failure(err, 1, set.peer[i], op, step, expected >> 16, dt, 0, 0);
        return false;
      }
      __nanosleep(64);
    }
  }
  return true;
}

// The IPC transport's failure mark beside its call counter (counter[1], device memory,
// set by a wait that failed or found a failure recorded): what signal_flags reads, where
// the host-mapped record would cost a trip over the bus on every signal.
__device__ __forceinline__ void mark_failed(const u64 *counter) { ((volatile u64 *)counter)[1] = 1; }

// One thread per flag: wait until *flag >= (call number << 16) + tag, or time out.
extern "C" __global__ void wait_flags(FlagSet set, const u64 *counter, u64 tag, u64 timeout_ns, ErrorRecord *err, u32 op,
                                      u32 step) {
  if (threadIdx.x >= set.n) return;
  if (!wait_one(set, flag_value(counter, tag), timeout_ns, err, op, step)) mark_failed(counter);
}

// The arrival barrier of a call with the cross-rank check (NVTE_COMM_CHECK): wait for
// every peer's arrival (tag 1), then compare the {descriptor, call number} each peer
// wrote before it signalled with this rank's.
extern "C" __global__ void wait_arrival_checked(FlagSet set, CheckSet check, const u64 *counter, u64 desc,
                                                u64 timeout_ns, ErrorRecord *err, u32 op) {
  const u64 seq = *(const volatile u64 *)counter;
  bool ok = true;
  if (threadIdx.x < set.n) ok = wait_one(set, (seq << 16) + 1, timeout_ns, err, op, 0);
  ok = __syncthreads_and(ok);
  if (ok) ok = check_peers(check, seq, desc, err, op);
  if (!ok) mark_failed(counter);
}

// One thread per flag: make this stream's earlier writes visible system-wide, then
// publish (call number << 16) + tag to every flag (peers' flag memory). With `data` set,
// nothing once this rank's waits failed (counter[1], see mark_failed): such a rank has
// not received what it would forward, and a signal would make its peers take that data
// as valid (they time out instead, naming it). ("Done" signals pass data 0: they only
// say that this rank no longer touches the peers' buffers, true after a failure too.)
extern "C" __global__ void signal_flags(FlagSet set, const u64 *counter, u64 tag, u32 data) {
  const u32 i = threadIdx.x;
  if (i >= set.n) return;
  if (data && ((const volatile u64 *)counter)[1] != 0) return;
  const u64 v = flag_value(counter, tag);
  __threadfence_system();
  st_release_sys(set.flag[i], v);
}

// The start of a call: increment the call counter, write {desc, new number} into every
// peer's check slot for this rank (`check`: the slots' addresses in peers' memory), then
// signal the new number (tag 1) to every flag of `set` (the peers' arrival flags). One
// block; every thread reads the old count before thread 0 writes the new one.
extern "C" __global__ void begin_call(FlagSet set, FlagSet check, u64 *counter, u64 desc) {
  const u32 i = threadIdx.x;
  const u64 seq = *(volatile u64 *)counter + 1;
  __syncthreads();
  if (i == 0) *(volatile u64 *)counter = seq;
  if (i >= set.n) return;
  volatile u64 *c = check.flag[i];
  c[0] = desc;
  c[1] = seq;
  __threadfence_system();
  st_release_sys(set.flag[i], (seq << 16) + 1);
}

// ---------------------------------------------------------------- NCCL transport
// The NCCL transport's per-call progress, in host-mapped memory, read by its watchdog
// thread (which aborts the group's communicator when a call does not complete in time).
struct Progress {
  u64 started;   // call number of the last call that started on the GPU
  u64 finished;  // call number of the last call that finished on the GPU
  u64 op;        // operation of the last call started
  u64 arrived;   // call number whose arrival tokens `tokens` holds
  u64 tokens[MAX_PEERS][2];  // {desc, seq} received from each group member (by tp rank)
};

static_assert(sizeof(Progress) == 32 + 16 * MAX_PEERS, "Progress layout");

// Start of a call: increment the counter, write this rank's token {desc, seq} (sent to
// every peer in the arrival exchange), record "started".
extern "C" __global__ void nccl_begin(u64 *counter, u64 *token, u64 desc, u32 op, Progress *p) {
  const u64 seq = *(volatile u64 *)counter + 1;
  *(volatile u64 *)counter = seq;
  token[0] = desc;
  token[1] = seq;
  volatile Progress *v = p;
  v->op = op;
  __threadfence_system();
  v->started = seq;
  __threadfence_system();
}

// After the arrival exchange: copy the received tokens to the host-mapped progress
// record (the watchdog names the peers that never arrived from it), and with the check
// compare them with this rank's.
extern "C" __global__ void nccl_arrived(const u64 *tokens, CheckSet check, const u64 *counter, u64 desc, u32 do_check,
                                        ErrorRecord *err, u32 op, Progress *p, u32 tp) {
  const u32 i = threadIdx.x;
  const u64 seq = *(const volatile u64 *)counter;
  volatile Progress *v = p;
  if (i < tp) {
    v->tokens[i][0] = tokens[2 * i];
    v->tokens[i][1] = tokens[2 * i + 1];
  }
  __threadfence_system();
  __syncthreads();
  if (i == 0) v->arrived = seq;
  if (do_check) check_peers(check, seq, desc, err, op);
}

// End of a call: record "finished".
extern "C" __global__ void nccl_end(const u64 *counter, Progress *p) {
  __threadfence_system();
  ((volatile Progress *)p)->finished = *(const volatile u64 *)counter;
  __threadfence_system();
}

// ---------------------------------------------------------------- SM put
// Copy `bytes` from src to dst (either may be a peer's memory) with 16-byte accesses
// where both are aligned; runs on the grid the caller chose (the comm SM budget).
// *out = max(in[0..n)): the amaxes of an all-gather's chunk GEMMs (each writes its own
// slot) into the FP8 output's amax. One warp.
extern "C" __global__ void amax_max(float *out, const float *in, u32 n) {
  float m = 0.0f;
  for (u32 i = threadIdx.x; i < n; i += 32) m = fmaxf(m, in[i]);
#pragma unroll
  for (int o = 16; o > 0; o /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  if (threadIdx.x == 0) *out = m;
}

extern "C" __global__ void put_bytes(u8 *dst, const u8 *src, u64 bytes) {
  const u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x;
  const u64 stride = (u64)gridDim.x * blockDim.x;
  if ((((u64)dst | (u64)src) & 15) == 0) {
    const u64 n16 = bytes >> 4;
    uint4 *d = (uint4 *)dst;
    const uint4 *s = (const uint4 *)src;
    for (u64 i = tid; i < n16; i += stride) d[i] = s[i];
    for (u64 i = (n16 << 4) + tid; i < bytes; i += stride) dst[i] = src[i];
  } else {
    for (u64 i = tid; i < bytes; i += stride) dst[i] = src[i];
  }
}

// Up to MAX_PEERS independent copies in one launch (the gather step of the all-reduce:
// each peer's reduced slice, loaded from its buffer, into the local output). Every
// thread keeps four 16-byte loads in flight; unaligned segments go byte by byte.
struct CopySet {
  const u8 *src[MAX_PEERS];
  u8 *dst[MAX_PEERS];
  u64 bytes[MAX_PEERS];
  u32 n;
};
static_assert(sizeof(CopySet) == 392, "CopySet layout");

extern "C" __global__ void copy_segments(CopySet s) {
  const u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x;
  const u64 stride = (u64)gridDim.x * blockDim.x;
  for (u32 k = 0; k < s.n; ++k) {
    const u8 *src = s.src[k];
    u8 *dst = s.dst[k];
    const u64 bytes = s.bytes[k];
    if ((((u64)dst | (u64)src) & 15) == 0) {
      const u64 n16 = bytes >> 4;
      const uint4 *a = (const uint4 *)src;
      uint4 *b = (uint4 *)dst;
      u64 i = tid;
      for (; i + 3 * stride < n16; i += 4 * stride) {
        uint4 x0 = a[i], x1 = a[i + stride], x2 = a[i + 2 * stride], x3 = a[i + 3 * stride];
        b[i] = x0, b[i + stride] = x1, b[i + 2 * stride] = x2, b[i + 3 * stride] = x3;
      }
      for (; i < n16; i += stride) b[i] = a[i];
      for (u64 j = (n16 << 4) + tid; j < bytes; j += stride) dst[j] = src[j];
    } else {
      for (u64 j = tid; j < bytes; j += stride) dst[j] = src[j];
    }
  }
}

// ---------------------------------------------------------------- reductions
struct SrcSet {
  const void *src[MAX_PEERS];
  u32 n;
};
static_assert(sizeof(SrcSet) == 136, "SrcSet layout");

// out[r, c] = sum_i load(src_i[r, c]) * in_scale (+ out[r, c] when accumulate), for a
// rows x cols block. Sources have row stride in_ld, the output out_ld (elements).
// Sums in fp32. Used by the pipelined reduce-scatter (sources: the peers' buffers) and
// the ring reduce-scatter (sources: the received slots). V columns per thread (V = 8:
// one 16-byte access for 16-bit types), sources loaded four at a time before they are
// summed so that several remote / local loads are in flight per thread.
template <class T, int V>
struct Vec {
  T v[V];
};

template <class T, int V>
__device__ __forceinline__ Vec<T, V> load_vec(const T *p) {
  Vec<T, V> r;
  if (V * sizeof(T) == 16) {
    *(uint4 *)r.v = *(const uint4 *)p;
  } else if (V * sizeof(T) == 32) {
    ((uint4 *)r.v)[0] = ((const uint4 *)p)[0];
    ((uint4 *)r.v)[1] = ((const uint4 *)p)[1];
  } else if (V * sizeof(T) == 8) {
    *(uint2 *)r.v = *(const uint2 *)p;
  } else {
#pragma unroll
    for (int v = 0; v < V; ++v) r.v[v] = p[v];
  }
  return r;
}

template <class T, int V>
__device__ __forceinline__ void store_vec(T *p, const Vec<T, V> &r) {
  if (V * sizeof(T) == 16) {
    *(uint4 *)p = *(const uint4 *)r.v;
  } else if (V * sizeof(T) == 32) {
    ((uint4 *)p)[0] = ((const uint4 *)r.v)[0];
    ((uint4 *)p)[1] = ((const uint4 *)r.v)[1];
  } else {
#pragma unroll
    for (int v = 0; v < V; ++v) p[v] = r.v[v];
  }
}

// FP8 outputs: out_scale_ptr (the output's scale) multiplies each sum before the cast,
// and amax_ptr (zeroed by the caller before the call's first reduction) gets max |sum|
// (an atomic max of the float's bits: exact for non-negative floats).
template <class I, class O, int V>
__device__ void reduce_impl(typename O::T *out, u64 out_ld, SrcSet s, u64 in_ld, u64 rows, u64 cols,
                            const float *in_scale_ptr, int accumulate, const float *out_scale_ptr, float *amax_ptr) {
  typedef typename I::T TI;
  typedef typename O::T TO;
  const float in_scale = in_scale_ptr ? *in_scale_ptr : 1.0f;
  const float out_scale = out_scale_ptr ? *out_scale_ptr : 1.0f;
  float amax = 0.0f;
  const u64 vcols = cols / V;
  const u64 total = rows * vcols;
  const u64 stride = (u64)gridDim.x * blockDim.x;
  for (u64 idx = (u64)blockIdx.x * blockDim.x + threadIdx.x; idx < total; idx += stride) {
    const u64 r = idx / vcols, c = (idx - r * vcols) * V;
    const u64 off = r * in_ld + c;
    float acc[V];
#pragma unroll
    for (int v = 0; v < V; ++v) acc[v] = 0.0f;
    for (u32 i0 = 0; i0 < s.n; i0 += 4) {
      Vec<TI, V> x[4];
#pragma unroll
      for (int j = 0; j < 4; ++j)
        if (i0 + j < s.n) x[j] = load_vec<TI, V>((const TI *)s.src[i0 + j] + off);
#pragma unroll
      for (int j = 0; j < 4; ++j)
        if (i0 + j < s.n) {
#pragma unroll
          for (int v = 0; v < V; ++v) acc[v] += I::load(x[j].v[v]);
        }
    }
    TO *q = out + r * out_ld + c;
    Vec<TO, V> y;
    if (accumulate) y = load_vec<TO, V>(q);
#pragma unroll
    for (int v = 0; v < V; ++v) {
      float f = acc[v] * in_scale;
      if (accumulate) f += O::load(y.v[v]);
      amax = fmaxf(amax, fabsf(f));
      y.v[v] = O::store(f * out_scale);
    }
    store_vec<TO, V>(q, y);
  }
  if (amax_ptr) {
#pragma unroll
    for (int o = 16; o > 0; o /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    if ((threadIdx.x & 31) == 0) atomicMax((int *)amax_ptr, __float_as_int(amax));
  }
}

#define REDUCE(iname, I, oname, O)                                                                              \
  extern "C" __global__ void reduce_##iname##_##oname##_v8(O::T *out, u64 out_ld, SrcSet s, u64 in_ld, u64 rows, \
                                                           u64 cols, const float *sc, int acc, const float *osc,  \
                                                           float *amax) {                                      \
    reduce_impl<I, O, 8>(out, out_ld, s, in_ld, rows, cols, sc, acc, osc, amax);                                \
  }                                                                                                             \
  extern "C" __global__ void reduce_##iname##_##oname##_v1(O::T *out, u64 out_ld, SrcSet s, u64 in_ld, u64 rows, \
                                                           u64 cols, const float *sc, int acc, const float *osc,  \
                                                           float *amax) {                                      \
    reduce_impl<I, O, 1>(out, out_ld, s, in_ld, rows, cols, sc, acc, osc, amax);                                \
  }
REDUCE(f32, F32, f32, F32)
REDUCE(bf16, BF16, bf16, BF16)
REDUCE(f16, F16, f16, F16)
REDUCE(bf16, BF16, f32, F32)
REDUCE(f16, F16, f32, F32)
REDUCE(e4m3, E4M3, bf16, BF16)
REDUCE(e4m3, E4M3, f16, F16)
// FP8 outputs of 16/32-bit partials (scaled, with amax).
REDUCE(bf16, BF16, e4m3, E4M3)
REDUCE(f16, F16, e4m3, E4M3)
REDUCE(f32, F32, e4m3, E4M3)
REDUCE(bf16, BF16, e5m2, E5M2)
REDUCE(f16, F16, e5m2, E5M2)
REDUCE(f32, F32, e5m2, E5M2)
REDUCE(e4m3, E4M3, f32, F32)
REDUCE(e5m2, E5M2, bf16, BF16)
REDUCE(e5m2, E5M2, f16, F16)
REDUCE(e5m2, E5M2, f32, F32)
