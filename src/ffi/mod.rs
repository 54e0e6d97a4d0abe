//! The C ABI. This module tree is the only place with `extern "C"` functions and the
//! only place that dereferences the caller's raw pointers (the core handles device
//! addresses, which it never dereferences on the host). Every entry point runs inside `firewall`: panics are caught and
//! turned into NVTE_COMM_ERROR_INTERNAL with the panic message (LIBRARY_NOT_FOUND for a
//! panic whose payload is a library error), never unwinding into C.
//!
//! Every `extern "C"` function's body is one `entry!` (rustls-ffi's
//! `ffi_panic_boundary!` is the model): it names the function once, by its own
//! declaration, and runs the firewall. The signatures stay written out, with their
//! documentation, because cbindgen makes the header from them and does not expand macros.

/// The name of the function this expands in (`nvte_comm_overlap_destroy`): the last
/// segment of the type name of a nested item, `...::nvte_comm_overlap_destroy::here`.
/// The type name is a `&'static str` the compiler made; [`name_of`] slices it (a
/// backwards byte search, no allocation). Expand it in the function's body itself, not
/// in a closure (whose type name ends `{{closure}}`).
macro_rules! entry_name {
    () => {{
        fn here() {}
        $crate::ffi::name_of(::std::any::type_name_of_val(&here))
    }};
}

/// The body of an `extern "C"` function: runs `$body` (a block evaluating to a
/// `Result`, `?` and `return` as in a closure) inside the firewall under the function's
/// own name ([`entry_name!`]), which prefixes the recorded message. One arm per kind of
/// entry point:
/// - `entry!(status, { .. })`: returns an `NVTECommStatus` ([`status_call`]);
/// - `entry!(void, { .. })`: TE's void functions: the error is recorded only;
/// - `entry!(or DEFAULT, { .. })`: returns a value, `DEFAULT` on error (0, NULL, an
///   empty shape, an invalid enum value; [`firewall`]);
/// - `entry!(named, |name| EXPR)`: `EXPR` with the function's name bound to `name`, for
///   the XLA handlers, which run the firewall themselves ([`firewall_with`]) and put the
///   name into XLA's error too;
/// - `entry!(plain, { .. })`: `$body` as it is, no firewall, for the few functions that
///   read or clear the thread's error state (which the firewall would clear) or only
///   read a value: they cannot fail or panic.
macro_rules! entry {
    (status, $body:block) => {
        $crate::ffi::status_call(entry_name!(), || $body)
    };
    (void, $body:block) => {
        $crate::ffi::firewall(entry_name!(), (), || $body)
    };
    (or $default:expr, $body:block) => {
        $crate::ffi::firewall(entry_name!(), $default, || $body)
    };
    (named, |$name:ident| $body:expr) => {{
        let $name: &'static str = entry_name!();
        $body
    }};
    (plain, $body:block) => {
        $body
    };
}

mod comm_gemm;
pub mod config;
pub mod enums;
mod errors;
mod gemm;
mod handles;
mod host_counters;
mod kernels;
mod matmul_config;
mod overlap;
mod packed;
mod packed_cast;
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

/// TE's config attribute read (quantization and matmul configs): `*size_written` (when
/// not NULL) gets the attribute's `size`; a NULL `buf` only asks for it; else `buf`, of
/// `size_in_bytes >= size` bytes, gets the attribute's bytes from `get`.
fn read_config_attribute(
    attr: impl std::fmt::Display,
    size: usize,
    buf: *mut std::ffi::c_void,
    size_in_bytes: usize,
    size_written: *mut usize,
    get: impl FnOnce() -> Result<Vec<u8>>,
) -> Result<()> {
    if !size_written.is_null() {
        // SAFETY: non-null output pointer supplied by the caller.
        unsafe { *size_written = size };
    }
    if buf.is_null() {
        return Ok(());
    }
    if size_in_bytes < size {
        crate::invalid!(
            "argument `size_in_bytes` = {size_in_bytes} is too small for {attr}: it needs {size} bytes"
        );
    }
    let bytes = get()?;
    // SAFETY: `buf` is non-null with at least `size` writable bytes (the caller's promise
    // for size_in_bytes >= size), and `get` gives the attribute's `size` bytes.
    unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), buf as *mut u8, bytes.len()) };
    Ok(())
}

/// TE's config attribute write: the `size` bytes of the caller's `buf`, checked to be
/// non-NULL with `size_in_bytes >= size`.
fn config_attribute_bytes<'a>(
    attr: impl std::fmt::Display,
    size: usize,
    buf: *const std::ffi::c_void,
    size_in_bytes: usize,
) -> Result<&'a [u8]> {
    if size_in_bytes < size {
        crate::invalid!(
            "argument `size_in_bytes` = {size_in_bytes} is too small for {attr}: it needs {size} bytes"
        );
    }
    if buf.is_null() {
        crate::invalid!("argument `buf` is NULL");
    }
    // SAFETY: non-null with at least `size` readable bytes per the caller.
    Ok(unsafe { std::slice::from_raw_parts(buf as *const u8, size) })
}

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

/// The function name in the type name `path` of [`entry_name!`]'s nested item
/// (`crate::ffi::m::nvte_x::here` -> `nvte_x`): a slice of it, found by a backwards
/// byte search (nanoseconds per call, no allocation).
#[inline]
pub(crate) fn name_of(path: &'static str) -> &'static str {
    let p = path.strip_suffix("::here").unwrap_or(path);
    p.rfind(':').map_or(p, |i| &p[i + 1..])
}

/// The core's stream handle of a C `cudaStream_t`.
pub(crate) fn stream_of(s: cudaStream_t) -> crate::cuda::StreamHandle {
    crate::cuda::StreamHandle::from_raw(s as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    // Entry points for the firewall's tests, named by their own declarations.
    fn nvte_test_panic() -> NVTECommStatus {
        entry!(status, { panic!("boom {}", 42) })
    }
    fn nvte_test_ok() -> NVTECommStatus {
        entry!(status, { Ok(()) })
    }
    fn nvte_test_lib() -> NVTECommStatus {
        entry!(status, {
            std::panic::panic_any(Error::new(
                crate::error::ErrorKind::LibraryNotFound,
                "libexample.so.1 is absent",
            ))
        })
    }
    fn nvte_test_text() -> NVTECommStatus {
        entry!(status, {
            panic!("Unable to dynamically load libexample.so.1")
        })
    }
    fn nvte_test_symbol() -> NVTECommStatus {
        // A forwarded NCCL entry point whose library is not bound.
        fn unbound() -> std::result::Result<&'static crate::cuda::dynlib::Bound, String> {
            Err("NCCL is not bound".into())
        }
        entry!(status, {
            crate::cuda::dynlib::symbol(unbound, "ncclGetVersion");
            Ok(())
        })
    }
    fn nvte_test_err() -> NVTECommStatus {
        entry!(status, { crate::invalid!("argument `x` = {} is bad", 7) })
    }

    #[test]
    fn firewall_turns_panics_into_internal_errors() {
        assert_eq!(nvte_test_panic(), NVTECommStatus::NVTE_COMM_ERROR_INTERNAL);
        let msg = crate::error::last_error_string();
        assert!(
            msg.starts_with("nvte_test_panic: internal error (caught panic): boom 42"),
            "{msg}"
        );
        // The next call clears it.
        assert_eq!(nvte_test_ok(), NVTECommStatus::NVTE_COMM_SUCCESS);
        assert_eq!(crate::error::last_error_string(), "");
    }

    #[test]
    fn firewall_tells_a_missing_library_by_its_error_value_not_its_message() {
        // A panic carrying a LibraryNotFound error (cuda::dynlib::symbol's), whatever
        // its wording, is LIBRARY_NOT_FOUND with its message.
        assert_eq!(
            nvte_test_lib(),
            NVTECommStatus::NVTE_COMM_ERROR_LIBRARY_NOT_FOUND
        );
        let msg = crate::error::last_error_string();
        assert!(
            msg.starts_with("nvte_test_lib: libexample.so.1 is absent"),
            "{msg}"
        );
        // A plain panic is internal, even when its message reads like a load failure.
        assert_eq!(nvte_test_text(), NVTECommStatus::NVTE_COMM_ERROR_INTERNAL);
        // The real thing: a forwarded NCCL entry point whose library is not bound.
        assert_eq!(
            nvte_test_symbol(),
            NVTECommStatus::NVTE_COMM_ERROR_LIBRARY_NOT_FOUND
        );
    }

    #[test]
    fn firewall_reports_the_error_status_and_message() {
        assert_eq!(
            nvte_test_err(),
            NVTECommStatus::NVTE_COMM_ERROR_INVALID_ARGUMENT
        );
        assert_eq!(
            crate::error::last_error_string(),
            "nvte_test_err: argument `x` = 7 is bad"
        );
        assert_eq!(
            last_status(),
            NVTECommStatus::NVTE_COMM_ERROR_INVALID_ARGUMENT
        );
    }

    /// Calls the entry point `$f` with `$args` and asserts that the recorded message is
    /// prefixed by its identifier: the name `entry!` derived is the function's own.
    macro_rules! assert_named {
        ($f:path [$($arg:expr),*]) => {{
            let _ = $f($($arg),*);
            let msg = crate::error::last_error_string();
            let name = stringify!($f).rsplit("::").next().unwrap().trim();
            assert!(msg.starts_with(&format!("{name}: ")), "{name}: {msg}");
        }};
    }

    #[test]
    fn every_arm_names_its_function() {
        fn null<T>() -> *mut T {
            std::ptr::null_mut()
        }
        // status
        assert_named!(overlap::nvte_comm_overlap_config_default[null()]);
        assert_named!(overlap::nvte_comm_overlap_synchronize[null()]);
        assert_named!(overlap::nvte_comm_overlap_tp[null(), null(), null()]);
        assert_named!(runtime::nvte_comm_nccl_get_unique_id[null(), 0]);
        assert_named!(overlap::nvte_comm_overlap_split_rs[
            null(), null(), false, null(), false, null(), null(), null(), false, null(), false, false, null(),
            null()
        ]);
        assert_named!(overlap::nvte_comm_overlap_split_rs_p2p[
            null(), null(), false, null(), false, null(), null(), null(), false, null(), false, false, null(),
            null()
        ]);
        // void
        assert_named!(kernels::nvte_quantize[null(), null(), null()]);
        assert_named!(tensor::nvte_get_tensor_param_v2[
            null(),
            NVTETensorParam::kNVTERowwiseData,
            null(),
            0,
            std::ptr::null_mut()
        ]);
        let algo = enums::NVTECommGemmAlgoType::kNVTECommGemmAlgoDefault;
        assert_named!(comm_gemm::nvte_gemm_reduce_scatter[
            null(), 1, 1, 1, null(), null(), null(), null(), null(), false, false, false, false, 0, null(),
            algo
        ]);
        // or DEFAULT
        assert_named!(tensor::nvte_tensor_ndims[null()]);
        assert_named!(tensor::nvte_tensor_scaling_mode[null()]);
        assert_named!(comm_gemm::nvte_comm_gemm_numroc[null(), 8]);
    }

    fn nvte_test_named() -> &'static str {
        entry!(named, |name| name)
    }

    #[test]
    fn the_name_is_a_slice_of_the_type_name() {
        assert_eq!(nvte_test_named(), stringify!(nvte_test_named));
        assert_eq!(name_of("a::b::f_x::here"), "f_x");
        assert_eq!(name_of("f_x::here"), "f_x");
        assert_eq!(name_of("odd"), "odd");
        // Nanoseconds per call, no allocation: a million lookups well under the 10 us
        // budget of one C call (generous for a debug build on a loaded machine).
        let t = std::time::Instant::now();
        for _ in 0..1_000_000 {
            std::hint::black_box(nvte_test_named());
        }
        let per_call = t.elapsed().as_secs_f64() * 1e3; // ns per call (1e6 calls)
        assert!(per_call < 1000.0, "{per_call} ns per name lookup");
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
        // Every row of the transport table (the unit tests' fake included here).
        assert_eq!(T::ALL.len(), crate::transport::choice_names().count());
    }
}
