//! Run-time queries of the CUDA libraries this library bound, and NCCL communicator
//! helpers that go through the bound NCCL (so a framework creating a communicator for
//! this library uses the same NCCL copy as the library does).
use super::NVTECommStatus;
use super::enums::NVTECommLibrary;
use super::overlap::ncclComm_t;
use crate::cuda::{self, Lib, NcclComm};
use crate::invalid;
use crate::transport::nccl::api as nccl;
use once_cell::sync::OnceCell;
use std::collections::HashSet;
use std::ffi::{CString, c_char};
use std::sync::Mutex;

/// Load (bind) `lib` if not yet, and describe the bound copy: `*path` the file (a static
/// string, valid for the life of the process), `*version` its version code (NCCL:
/// ncclGetVersion, e.g. 22809; cuBLASLt: cublasLtGetVersion; driver: cuDriverGetVersion;
/// NVRTC: major * 1000 + minor * 10), `*preloaded` whether that copy was already mapped
/// in the process (a framework's) before this library bound it. Any out-pointer may be
/// NULL; on error they are set to NULL / 0 / false. NCCL and cuBLASLt are bound in this
/// order: NVTE_COMM_NCCL_LIBRARY / NVTE_COMM_CUBLASLT_LIBRARY, a copy already mapped in
/// the process, the library search path.
#[unsafe(no_mangle)]
pub extern "C" fn nvte_comm_library_info(
    lib: NVTECommLibrary,
    path: *mut *const c_char,
    version: *mut i32,
    preloaded: *mut bool,
) -> NVTECommStatus {
    entry!(status, {
        // SAFETY: each out-pointer is NULL or writable, per the contract.
        unsafe {
            if !path.is_null() {
                *path = std::ptr::null();
            }
            if !version.is_null() {
                *version = 0;
            }
            if !preloaded.is_null() {
                *preloaded = false;
            }
        }
        let (which, cell) = match lib {
            NVTECommLibrary::NVTE_COMM_LIB_CUDA_DRIVER => (Lib::Driver, 0),
            NVTECommLibrary::NVTE_COMM_LIB_CUBLASLT => (Lib::CublasLt, 1),
            NVTECommLibrary::NVTE_COMM_LIB_NVRTC => (Lib::Nvrtc, 2),
            NVTECommLibrary::NVTE_COMM_LIB_NCCL => (Lib::Nccl, 3),
            other => invalid!("argument `lib` = {other} is not a valid NVTECommLibrary"),
        };
        let info = cuda::library_info(which)?;
        // One C string per library, kept for the life of the process (the bound copy
        // never changes once bound); an empty path (not found in the link map) is not kept.
        static PATHS: [OnceCell<CString>; 4] = [
            OnceCell::new(),
            OnceCell::new(),
            OnceCell::new(),
            OnceCell::new(),
        ];
        if info.path.is_empty() {
            return Err(crate::error::Error::internal(format!(
                "{which:?} is loaded but its file was not found among the mapped objects"
            )));
        }
        let c = PATHS[cell].get_or_init(|| CString::new(info.path.clone()).unwrap_or_default());
        // SAFETY: out-pointers as above.
        unsafe {
            if !path.is_null() {
                *path = c.as_ptr();
            }
            if !version.is_null() {
                *version = info.version;
            }
            if !preloaded.is_null() {
                *preloaded = info.preloaded;
            }
        }
        Ok(())
    })
}

/// Communicators created by nvte_comm_nccl_comm_init_rank and not yet destroyed: only
/// these are destroyed (a raw ncclComm_t cannot be checked otherwise, and ncclCommDestroy
/// of a stale or foreign pointer would crash the process).
static COMMS: Mutex<Option<HashSet<NcclComm>>> = Mutex::new(None);

fn comms<R>(f: impl FnOnce(&mut HashSet<NcclComm>) -> R) -> R {
    f(COMMS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get_or_insert_with(HashSet::new))
}

/// Write a new NCCL unique id (ncclGetUniqueId of the bound NCCL) into `out[0..128]`;
/// `len` must be at least 128. On error the first min(len, 128) bytes of `out` (when not
/// NULL) are zero.
#[unsafe(no_mangle)]
pub extern "C" fn nvte_comm_nccl_get_unique_id(out: *mut u8, len: usize) -> NVTECommStatus {
    entry!(status, {
        if out.is_null() {
            invalid!("argument `out` is NULL");
        }
        // Zero first: the bytes are zero on every error below.
        // SAFETY: the caller's buffer holds `len` writable bytes.
        unsafe { std::ptr::write_bytes(out, 0, len.min(128)) };
        if len < 128 {
            invalid!("argument `len` = {len} is less than the 128 bytes of an NCCL unique id");
        }
        let id = nccl::unique_id()?;
        // SAFETY: `out` holds at least 128 writable bytes (checked above).
        unsafe { std::ptr::copy_nonoverlapping(id.as_ptr(), out, 128) };
        Ok(())
    })
}

/// ncclCommInitRank through the bound NCCL, on the calling thread's current CUDA device
/// (collective: every rank calls it with the same id). `id` holds `len` >= 128 bytes
/// from nvte_comm_nccl_get_unique_id. `*out` is the communicator, NULL on failure.
#[unsafe(no_mangle)]
pub extern "C" fn nvte_comm_nccl_comm_init_rank(
    id: *const u8,
    len: usize,
    nranks: i32,
    rank: i32,
    out: *mut ncclComm_t,
) -> NVTECommStatus {
    entry!(status, {
        if out.is_null() {
            invalid!("argument `out` is NULL");
        }
        // SAFETY: writable out-pointer (checked).
        unsafe { *out = std::ptr::null_mut() };
        if id.is_null() {
            invalid!("argument `id` is NULL");
        }
        if len < 128 {
            invalid!("argument `len` = {len} is less than the 128 bytes of an NCCL unique id");
        }
        let mut uid = [0u8; 128];
        // SAFETY: `id` holds at least 128 readable bytes (checked).
        unsafe { std::ptr::copy_nonoverlapping(id, uid.as_mut_ptr(), 128) };
        let comm = nccl::comm_init_rank(&uid, nranks, rank)?;
        comms(|c| c.insert(comm));
        // SAFETY: as above.
        unsafe { *out = comm.as_c() };
        Ok(())
    })
}

/// ncclCommDestroy through the bound NCCL, for a communicator from
/// nvte_comm_nccl_comm_init_rank (destroy the contexts that use it first). Any other
/// value (a communicator from elsewhere, or one already destroyed) is an invalid argument.
#[unsafe(no_mangle)]
pub extern "C" fn nvte_comm_nccl_comm_destroy(comm: ncclComm_t) -> NVTECommStatus {
    entry!(status, {
        if comm.is_null() {
            invalid!("argument `comm` is NULL");
        }
        let comm = NcclComm::from_c(comm);
        if !comms(|c| c.remove(&comm)) {
            invalid!(
                "argument `comm` ({:#x}) is not a live communicator of nvte_comm_nccl_comm_init_rank: never created by it, or already destroyed",
                comm.addr()
            );
        }
        let _relaxed = crate::cuda::resources::RelaxedCapture::new(); // NCCL frees device memory
        nccl::comm_destroy(comm)
    })
}
