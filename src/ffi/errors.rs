//! Error reporting entry points.
use super::NVTECommStatus;
use crate::error;
use std::ffi::c_char;

/// Message of the calling thread's most recent failed library call: it names the
/// function, the offending argument and its value. Returns "" (never NULL) when the
/// most recent call succeeded. The pointer stays valid until the thread's next call
/// into the library.
#[unsafe(no_mangle)]
pub extern "C" fn nvte_comm_last_error() -> *const c_char {
    entry!(plain, { error::last_error_ptr() })
}

/// Status of the calling thread's most recent library call (NVTE_COMM_SUCCESS if it
/// succeeded). Useful after the TE-compatible functions that return void.
#[unsafe(no_mangle)]
pub extern "C" fn nvte_comm_last_status() -> NVTECommStatus {
    entry!(plain, { super::last_status() })
}

/// Forget the calling thread's last error.
#[unsafe(no_mangle)]
pub extern "C" fn nvte_comm_clear_error() {
    entry!(plain, { error::clear_last_error() })
}

/// Static name of a status value ("NVTE_COMM_ERROR_TIMEOUT", ...), or "unknown status".
#[unsafe(no_mangle)]
pub extern "C" fn nvte_comm_status_string(status: NVTECommStatus) -> *const c_char {
    entry!(plain, {
        macro_rules! lit {
            ($($name:ident),*) => {
                match status {
                    $( NVTECommStatus::$name => concat!(stringify!($name), "\0").as_ptr() as *const c_char, )*
                    _ => c"unknown status".as_ptr(),
                }
            };
        }
        lit!(
            NVTE_COMM_SUCCESS,
            NVTE_COMM_ERROR_INVALID_ARGUMENT,
            NVTE_COMM_ERROR_CUDA,
            NVTE_COMM_ERROR_CUBLAS,
            NVTE_COMM_ERROR_NCCL,
            NVTE_COMM_ERROR_NVRTC,
            NVTE_COMM_ERROR_TIMEOUT,
            NVTE_COMM_ERROR_UNSUPPORTED,
            NVTE_COMM_ERROR_LIBRARY_NOT_FOUND,
            NVTE_COMM_ERROR_OUT_OF_MEMORY,
            NVTE_COMM_ERROR_INTERNAL
        )
    })
}

/// Library version as "MAJOR.MINOR.PATCH".
#[unsafe(no_mangle)]
pub extern "C" fn nvte_comm_version() -> *const c_char {
    entry!(plain, {
        concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr() as *const c_char
    })
}

/// Check that the CUDA driver, cuBLASLt, NVRTC and NCCL can be loaded and that a GPU is
/// visible. Returns NVTE_COMM_ERROR_LIBRARY_NOT_FOUND naming the missing library, or the
/// library too old for this one (a driver for an older CUDA: the message names each
/// entry point it lacks and the version that provides it), or NVTE_COMM_ERROR_CUDA when
/// the driver loads but reports no usable device.
#[unsafe(no_mangle)]
pub extern "C" fn nvte_comm_check_runtime() -> NVTECommStatus {
    entry!(status, {
        crate::cuda::require_all_libraries()?;
        crate::cuda::init_driver()
    })
}

/// Number of visible CUDA devices; 0 (with the reason recorded) when the driver is
/// missing or reports no device.
#[unsafe(no_mangle)]
pub extern "C" fn nvte_comm_device_count() -> i32 {
    entry!(or 0, { crate::cuda::device_count() })
}
