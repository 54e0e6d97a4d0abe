// Diagnostic: copy-engine and SM peer-transfer bandwidth between the GPUs of one node,
// with every GPU transferring at once (the pattern of the overlap algorithms).
// Build and run: nvcc -O2 -arch=native -o /tmp/ce_probe bench/ce_probe.cu && /tmp/ce_probe
// Prints one line per pattern: GB/s per GPU (bytes leaving or entering each GPU / time).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CK(x)                                                                              \
  do {                                                                                     \
    cudaError_t e_ = (x);                                                                  \
    if (e_ != cudaSuccess) {                                                               \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                        \
    }                                                                                      \
  } while (0)

__global__ void sm_copy(uint4 *dst, const uint4 *src, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) dst[i] = src[i];
}

int g;
std::vector<char *> buf, buf2;
std::vector<std::vector<cudaStream_t>> st;
const size_t kBytes = 96u << 20;

// Time fn (which enqueues on every GPU's streams) : median of 9 after 2 warm-ups, in ms.
template <class F>
double timed(F fn) {
  std::vector<float> t;
  for (int it = 0; it < 11; ++it) {
    for (int d = 0; d < g; ++d) { CK(cudaSetDevice(d)); CK(cudaDeviceSynchronize()); }
    CK(cudaSetDevice(0));
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    CK(cudaEventRecord(a, st[0][0]));
    for (int d = 0; d < g; ++d)
      for (auto s : st[d]) { CK(cudaSetDevice(d)); CK(cudaStreamWaitEvent(s, a, 0)); }
    fn();
    CK(cudaSetDevice(0));
    for (int d = 0; d < g; ++d)
      for (auto s : st[d]) {
        cudaEvent_t e;
        CK(cudaSetDevice(d));
        CK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
        CK(cudaEventRecord(e, s));
        CK(cudaSetDevice(0));
        CK(cudaStreamWaitEvent(st[0][0], e, 0));
      }
    CK(cudaEventRecord(b, st[0][0]));
    CK(cudaEventSynchronize(b));
    float ms;
    CK(cudaEventElapsedTime(&ms, a, b));
    if (it >= 2) t.push_back(ms);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

void report(const char *name, size_t bytes_per_gpu, double ms) {
  std::printf("%-58s %8.3f ms %8.1f GB/s per GPU\n", name, ms, bytes_per_gpu / ms / 1e6);
}

int main() {
  CK(cudaGetDeviceCount(&g));
  if (g < 2) { std::printf("needs 2+ GPUs\n"); return 0; }
  buf.resize(g), buf2.resize(g), st.resize(g);
  for (int d = 0; d < g; ++d) {
    CK(cudaSetDevice(d));
    for (int p = 0; p < g; ++p)
      if (p != d) CK(cudaDeviceEnablePeerAccess(p, 0));
    CK(cudaMalloc(&buf[d], kBytes));
    CK(cudaMalloc(&buf2[d], kBytes));
    CK(cudaMemset(buf[d], d + 1, kBytes));
    for (int i = 0; i < g; ++i) {
      cudaStream_t s;
      CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
      st[d].push_back(s);
    }
  }
  const size_t part = kBytes / (g - 1) / 4096 * 4096, all = part * (g - 1);
  auto cp = [](int dev, int s, char *dst, const char *src, size_t n) {
    CK(cudaSetDevice(dev));
    CK(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToDevice, st[dev][s]));
  };
  std::printf("GPUs: %d, %zu MiB per GPU per pattern\n", g, all >> 20);
  report("CE push to next GPU, one copy", all, timed([&] { for (int d = 0; d < g; ++d) cp(d, 0, buf2[(d + 1) % g], buf[d], all); }));
  report("CE pull from next GPU, one copy", all, timed([&] { for (int d = 0; d < g; ++d) cp(d, 0, buf2[d], buf[(d + 1) % g], all); }));
  report("CE push to all peers, in sequence on one stream", all, timed([&] {
    for (int d = 0; d < g; ++d) for (int k = 1; k < g; ++k) cp(d, 0, buf2[(d + k) % g] + (k - 1) * part, buf[d] + (k - 1) * part, part); }));
  report("CE push to all peers, one stream each", all, timed([&] {
    for (int d = 0; d < g; ++d) for (int k = 1; k < g; ++k) cp(d, k, buf2[(d + k) % g] + (k - 1) * part, buf[d] + (k - 1) * part, part); }));
  report("CE pull from all peers, in sequence on one stream", all, timed([&] {
    for (int d = 0; d < g; ++d) for (int k = 1; k < g; ++k) cp(d, 0, buf2[d] + (k - 1) * part, buf[(d + k) % g] + (k - 1) * part, part); }));
  report("CE pull from all peers, one stream each", all, timed([&] {
    for (int d = 0; d < g; ++d) for (int k = 1; k < g; ++k) cp(d, k, buf2[d] + (k - 1) * part, buf[(d + k) % g] + (k - 1) * part, part); }));
  report("CE push (stream 0) and pull (stream 1) at once, in sequence", 2 * all, timed([&] {
    for (int d = 0; d < g; ++d) for (int k = 1; k < g; ++k) {
      cp(d, 0, buf2[(d + k) % g] + (k - 1) * part, buf[d] + (k - 1) * part, part / 2);
      cp(d, 1, buf2[d] + (k - 1) * part + part / 2, buf[(d + k) % g] + (k - 1) * part + part / 2, part / 2); } }));
  report("CE local copy", all, timed([&] { for (int d = 0; d < g; ++d) cp(d, 0, buf2[d], buf[d], all); }));
  for (int blocks : {16, 32, 66, 132}) {
    char name[96];
    std::snprintf(name, sizeof name, "SM push to all peers, %d blocks x 1024 per peer", blocks);
    report(name, all, timed([&] {
      for (int d = 0; d < g; ++d) for (int k = 1; k < g; ++k) {
        CK(cudaSetDevice(d));
        sm_copy<<<blocks, 1024, 0, st[d][k]>>>((uint4 *)(buf2[(d + k) % g] + (k - 1) * part), (const uint4 *)(buf[d] + (k - 1) * part), part / 16); } }));
    std::snprintf(name, sizeof name, "SM pull from all peers, %d blocks x 1024 per peer", blocks);
    report(name, all, timed([&] {
      for (int d = 0; d < g; ++d) for (int k = 1; k < g; ++k) {
        CK(cudaSetDevice(d));
        sm_copy<<<blocks, 1024, 0, st[d][k]>>>((uint4 *)(buf2[d] + (k - 1) * part), (const uint4 *)(buf[(d + k) % g] + (k - 1) * part), part / 16); } }));
  }
  return 0;
}
