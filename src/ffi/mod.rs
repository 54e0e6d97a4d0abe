//! The C ABI. This module tree is the only place with `extern "C"` functions and the
//! only place that dereferences the caller's raw pointers (the core handles device
//! addresses, which it never dereferences on the host). Every entry point runs inside `firewall`: panics are caught and
//! turned into NVTE_COMM_ERROR_INTERNAL with the panic message (LIBRARY_NOT_FOUND for a
//! panic whose payload is a library error), never unwinding into C.
mod comm_gemm;
pub mod config;
pub mod enums;
mod errors;
mod gemm;
mod handles;
mod host_counters;
mod kernels;
mod overlap;
mod packed;
mod report;
mod runtime;
mod tensor;
mod xla;

pub use enums::{
    NVTECommStatus, NVTEDType, NVTEQuantizationConfigAttribute, NVTEScalingMode, NVTETensorParam,
};
pub use tensor::{NVTEBasicTensor, NVTEShape, NVTETensor};

use crate::error::{Error, Result, clear_last_error, set_last_error};
use std::cell::RefCell;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Once;

/// CUDA stream handle as the C header declares it (`struct CUstream_st *`).
#[allow(non_camel_case_types)]
pub type cudaStream_t = *mut std::ffi::c_void;

thread_local! {
    static PANIC_MSG: RefCell<Option<String>> = const { RefCell::new(None) };
}

fn install_panic_hook() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let payload = info.payload();
            let msg = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .or_else(|| payload.downcast_ref::<Error>().map(|e| e.msg.clone()))
                .unwrap_or_else(|| "unknown panic".to_string());
            let loc = info
                .location()
                .map(|l| format!(" at {}:{}", l.file(), l.line()))
                .unwrap_or_default();
            // try_with: during thread teardown the slot may be gone; never panic here.
            let _ = PANIC_MSG.try_with(|p| {
                if let Ok(mut p) = p.try_borrow_mut() {
                    *p = Some(format!("{msg}{loc}"));
                }
            });
            if crate::env::debug() {
                previous(info);
            }
        }));
    });
}

/// Run `f` for the C function `func`: clears the thread's last error, catches panics,
/// records any error, and returns `on_error(&error)` in that case.
pub(crate) fn firewall_with<T>(
    func: &'static str,
    on_error: impl FnOnce(&Error) -> T,
    f: impl FnOnce() -> Result<T>,
) -> T {
    install_panic_hook();
    clear_last_error();
    let err = match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(v)) => return v,
        Ok(Err(e)) => e,
        Err(payload) => {
            let msg = PANIC_MSG
                .try_with(|p| p.try_borrow_mut().ok().and_then(|mut p| p.take()))
                .ok()
                .flatten()
                .unwrap_or_else(|| "unknown panic".into());
            // A panic with an error as its payload (`cuda::dynlib::symbol`: a library
            // that is not bound) is reported with that error's kind (LIBRARY_NOT_FOUND),
            // any other as internal: its value decides, never its message.
            match payload.downcast::<Error>() {
                Ok(e) => Error::new(e.kind, msg),
                Err(_) => Error::internal(format!("internal error (caught panic): {msg}")),
            }
        }
    };
    set_last_error(func, &err, crate::env::debug());
    on_error(&err)
}

/// The C status of an error kind: the one place the core's kinds meet the C enum.
pub(crate) fn status_of(kind: crate::error::ErrorKind) -> NVTECommStatus {
    use crate::error::ErrorKind as K;
    match kind {
        K::InvalidArgument => NVTECommStatus::NVTE_COMM_ERROR_INVALID_ARGUMENT,
        K::Cuda => NVTECommStatus::NVTE_COMM_ERROR_CUDA,
        K::Cublas => NVTECommStatus::NVTE_COMM_ERROR_CUBLAS,
        K::Nccl => NVTECommStatus::NVTE_COMM_ERROR_NCCL,
        K::Nvrtc => NVTECommStatus::NVTE_COMM_ERROR_NVRTC,
        K::Timeout => NVTECommStatus::NVTE_COMM_ERROR_TIMEOUT,
        K::Unsupported => NVTECommStatus::NVTE_COMM_ERROR_UNSUPPORTED,
        K::LibraryNotFound => NVTECommStatus::NVTE_COMM_ERROR_LIBRARY_NOT_FOUND,
        K::OutOfMemory => NVTECommStatus::NVTE_COMM_ERROR_OUT_OF_MEMORY,
        K::Internal => NVTECommStatus::NVTE_COMM_ERROR_INTERNAL,
    }
}

/// The status of the calling thread's last call.
pub(crate) fn last_status() -> NVTECommStatus {
    crate::error::last_kind().map_or(NVTECommStatus::NVTE_COMM_SUCCESS, status_of)
}

/// [`firewall_with`] returning a fixed value on error (TE's void / value functions).
pub(crate) fn firewall<T>(func: &'static str, on_error: T, f: impl FnOnce() -> Result<T>) -> T {
    firewall_with(func, |_| on_error, f)
}

/// [`firewall_with`] for functions that return a status.
pub(crate) fn status_call(func: &'static str, f: impl FnOnce() -> Result<()>) -> NVTECommStatus {
    firewall_with(
        func,
        |e| status_of(e.kind),
        || f().map(|_| NVTECommStatus::NVTE_COMM_SUCCESS),
    )
}

/// The core's stream handle of a C `cudaStream_t`.
pub(crate) fn stream_of(s: cudaStream_t) -> crate::cuda::StreamHandle {
    crate::cuda::StreamHandle::from_raw(s as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn firewall_turns_panics_into_internal_errors() {
        let s = status_call("nvte_test_panic", || panic!("boom {}", 42));
        assert_eq!(s, NVTECommStatus::NVTE_COMM_ERROR_INTERNAL);
        let msg = crate::error::last_error_string();
        assert!(
            msg.starts_with("nvte_test_panic: internal error (caught panic): boom 42"),
            "{msg}"
        );
        // The next call clears it.
        assert_eq!(
            status_call("nvte_test_ok", || Ok(())),
            NVTECommStatus::NVTE_COMM_SUCCESS
        );
        assert_eq!(crate::error::last_error_string(), "");
    }

    #[test]
    fn firewall_tells_a_missing_library_by_its_error_value_not_its_message() {
        use crate::error::ErrorKind as K;
        // A panic carrying a LibraryNotFound error (cuda::dynlib::symbol's), whatever
        // its wording, is LIBRARY_NOT_FOUND with its message.
        let s = status_call("nvte_test_lib", || {
            std::panic::panic_any(Error::new(K::LibraryNotFound, "libexample.so.1 is absent"))
        });
        assert_eq!(s, NVTECommStatus::NVTE_COMM_ERROR_LIBRARY_NOT_FOUND);
        let msg = crate::error::last_error_string();
        assert!(
            msg.starts_with("nvte_test_lib: libexample.so.1 is absent"),
            "{msg}"
        );
        // A plain panic is internal, even when its message reads like a load failure.
        let s = status_call("nvte_test_text", || {
            panic!("Unable to dynamically load libexample.so.1")
        });
        assert_eq!(s, NVTECommStatus::NVTE_COMM_ERROR_INTERNAL);
        // The real thing: a forwarded NCCL entry point whose library is not bound.
        fn unbound() -> std::result::Result<&'static crate::cuda::dynlib::Bound, String> {
            Err("NCCL is not bound".into())
        }
        let s = status_call("nvte_test_symbol", || {
            crate::cuda::dynlib::symbol(unbound, "ncclGetVersion");
            Ok(())
        });
        assert_eq!(s, NVTECommStatus::NVTE_COMM_ERROR_LIBRARY_NOT_FOUND);
    }

    #[test]
    fn firewall_reports_the_error_status_and_message() {
        let s = status_call("nvte_test_err", || {
            crate::invalid!("argument `x` = {} is bad", 7)
        });
        assert_eq!(s, NVTECommStatus::NVTE_COMM_ERROR_INVALID_ARGUMENT);
        assert_eq!(
            crate::error::last_error_string(),
            "nvte_test_err: argument `x` = 7 is bad"
        );
        assert_eq!(
            last_status(),
            NVTECommStatus::NVTE_COMM_ERROR_INVALID_ARGUMENT
        );
    }

    #[test]
    fn config_transport_values_are_the_c_enum() {
        use crate::overlap::{TRANSPORT_AUTO, TRANSPORT_IPC, TRANSPORT_NCCL};
        use enums::NVTECommTransport as T;
        for (core, c) in [
            (TRANSPORT_AUTO, T::NVTE_COMM_TRANSPORT_AUTO),
            (TRANSPORT_IPC, T::NVTE_COMM_TRANSPORT_IPC),
            (TRANSPORT_NCCL, T::NVTE_COMM_TRANSPORT_NCCL),
        ] {
            assert_eq!(core.0, c.0);
        }
        assert_eq!(T::ALL.len(), 3);
    }
}
