//! transformer_engine_comm: tensor-parallel communication/GEMM overlap for NVIDIA GPUs
//! behind a Transformer-Engine-compatible C ABI.
//!
//! Layout (core first, the C boundary last):
//! - `overlap`: the engine (buffers, streams, call begin / finish, timeouts, trace) and
//!   its algorithms (`ag`, `rs`, `ar`, `bulk`), with their schedules as pure functions
//!   (`overlap::schedule`); `comm_gemm`: TE's comm_gemm.h API on top of it;
//! - `transport`: how chunks move between the ranks of a group (`ipc` peer memory,
//!   `inproc` peers in this process, `nccl`), chosen by `transport::create`; `bootstrap`:
//!   the setup-time exchange among ranks;
//! - `gemm` (cuBLASLt plans and epilogues), `kernels` (typed launches of
//!   `kernels/*.cu`), `cuda` (driver, NVRTC, contexts, device memory), `tensor` (TE tensors,
//!   element types, shapes);
//! - `error` (`ErrorKind` + message, the thread's last error), `env` (the `NVTE_COMM_*`
//!   knobs, parsed strictly), `handle` (handle values), `host` (the hot path's
//!   fixed-capacity lists, allocation and library-call counters);
//! - `ffi`: the only `extern "C"` code: the panic firewall, the handle table, the C
//!   enums and the mapping of error kinds to `NVTECommStatus`.
pub mod bootstrap;
pub mod comm_gemm;
pub mod cuda;
pub mod env;
pub mod error;
pub mod ffi;
pub mod gemm;
pub mod handle;
pub mod host;
pub mod kernels;
pub mod overlap;
pub mod tensor;
pub mod transport;
// (between `transport` and `tune`: the generated header lists the crate's public
// constants in module order)
pub mod timing;
pub mod tune;

/// Counts each thread's heap allocations (`host::counters`); otherwise the system allocator.
#[global_allocator]
static ALLOC: host::CountingAlloc = host::CountingAlloc;
