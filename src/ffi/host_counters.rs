//! The host cost of the library's calls, for benchmarks and tests.
use super::NVTECommStatus;

/// The calling thread's running totals since it started: `*heap_allocations`, the host
/// heap allocations (and reallocations) this library made on this thread;
/// `*library_calls`, the CUDA driver, cuBLASLt and NCCL calls it made on this thread (every
/// checked call). The difference of two readings around a call is that call's host cost:
/// a steady-state call of the overlap and comm-GEMM APIs allocates nothing. Either
/// pointer may be NULL. Allocates nothing and calls no CUDA library itself.
#[unsafe(no_mangle)]
pub extern "C" fn nvte_comm_host_counters(
    heap_allocations: *mut u64,
    library_calls: *mut u64,
) -> NVTECommStatus {
    entry!(status, {
        let (allocs, calls) = crate::host::counters();
        // SAFETY: each out-pointer is NULL or writable, per the contract.
        unsafe {
            if !heap_allocations.is_null() {
                *heap_allocations = allocs;
            }
            if !library_calls.is_null() {
                *library_calls = calls;
            }
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_counters_count_this_threads_allocations_and_allow_null() {
        let (mut a0, mut c0) = (0u64, 0u64);
        assert_eq!(
            nvte_comm_host_counters(&mut a0, &mut c0),
            NVTECommStatus::NVTE_COMM_SUCCESS
        );
        let v: Vec<u8> = Vec::with_capacity(64);
        drop(v);
        let mut a1 = 0u64;
        assert_eq!(
            nvte_comm_host_counters(&mut a1, std::ptr::null_mut()),
            NVTECommStatus::NVTE_COMM_SUCCESS
        );
        assert_eq!(
            a1,
            a0 + 1,
            "one Vec, one allocation; the reading itself none"
        );
        // A checked library call counts (no driver needed: the check of a result).
        let mut c1 = 0u64;
        let _ = crate::cuda::check(cudarc::driver::sys::CUresult::CUDA_SUCCESS, "x");
        nvte_comm_host_counters(std::ptr::null_mut(), &mut c1);
        assert_eq!(c1, c0 + 1);
    }
}
