//! CUDA driver plumbing: run-time loading checks, context handling, device properties,
//! checked driver calls, and kernel launches. Uses cudarc's raw `sys` bindings, which
//! load libcuda / libcublasLt / libnvrtc / libnccl on first use.
pub mod checked;
pub mod dynlib;
pub mod entry_points;
pub mod handles;
pub mod kernel;
pub mod nvrtc;
pub mod nvtx;
pub mod ptr;
pub mod resources;

use crate::error::ErrorKind as K;
use crate::error::{Error, Result};
use cudarc::driver::sys as cu;
use once_cell::sync::OnceCell;
use std::collections::HashMap;
use std::sync::Mutex;

pub use checked::Checked;
pub use handles::{
    CtxHandle, CtxId, CtxRef, DlHandle, EventHandle, FunctionHandle, GraphExecHandle, GraphHandle,
    LtHandle, ModuleHandle, NcclComm, StreamHandle,
};
pub use kernel::{ArgClass, Binding, Kernel, KernelArg, ParamInfo, Params, Signature};
pub use ptr::DevPtr;

/// A CUDA library loaded at run time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Lib {
    Driver,
    CublasLt,
    Nvrtc,
    Nccl,
}

impl Lib {
    pub fn describe(self) -> &'static str {
        match self {
            Lib::Driver => "the CUDA driver (libcuda.so.1, from the NVIDIA driver)",
            Lib::CublasLt => {
                "cuBLASLt (libcublasLt.so.13, from the CUDA toolkit or the nvidia-cublas wheel)"
            }
            Lib::Nvrtc => {
                "NVRTC (libnvrtc.so.13, from the CUDA toolkit or the nvidia-cuda-nvrtc wheel)"
            }
            Lib::Nccl => "NCCL (libnccl.so.2, from libnccl2 or the nvidia-nccl wheel)",
        }
    }
    /// Ok when the library can be loaded; else the reason. NCCL and cuBLASLt are bound
    /// by [`dynlib`] (the copy already in the process first).
    fn present(self) -> std::result::Result<(), String> {
        let found = |ok: bool| {
            if ok {
                Ok(())
            } else {
                Err(format!(
                    "could not load {}: not found on the library search path (set LD_LIBRARY_PATH)",
                    self.describe()
                ))
            }
        };
        match self {
            // SAFETY: these only try to dlopen candidate names.
            Lib::Driver => {
                found(unsafe { cu::is_culib_present() }).and_then(|_| driver_entry_points())
            }
            // SAFETY: as above.
            Lib::Nvrtc => found(unsafe { cudarc::nvrtc::sys::is_culib_present() })
                .and_then(|_| nvrtc_entry_points()),
            Lib::CublasLt => dynlib::cublaslt().map(|_| ()),
            Lib::Nccl => dynlib::nccl().map(|_| ()),
        }
    }
}

/// `table`'s check on a library cudarc loaded, given its symbol lookup `addr`: the
/// message (only on failure) names the file that defines `version_symbol` and the
/// `version()` it reports.
fn check_loaded(
    table: &entry_points::Table,
    addr: impl Fn(&str) -> Option<*const std::ffi::c_void>,
    version_symbol: &str,
    version: impl FnOnce() -> Option<String>,
) -> std::result::Result<(), String> {
    table.check(
        |name| addr(name).is_some(),
        || {
            let sym = addr(version_symbol);
            entry_points::Loaded {
                path: sym.and_then(|p| dynlib::path_of_address(p as usize)),
                version: sym.and_then(|_| version()),
            }
        },
    )
}

/// Every entry point of [`entry_points::DRIVER`] in the libcuda cudarc loads (its first
/// loadable candidate, which the caller found), else the message naming the missing
/// ones, the driver's file and the CUDA version it supports.
fn driver_entry_points() -> std::result::Result<(), String> {
    // SAFETY: a candidate loads (checked by the caller), so culib opens it and does not
    // panic; the handle lives for the process.
    let lib = unsafe { cu::culib() };
    let addr = |name: &str| {
        // SAFETY: only looks the name up; nothing is called here.
        let sym = unsafe { lib.get::<*const std::ffi::c_void>(name.as_bytes()) };
        sym.ok().map(|s| *s)
    };
    check_loaded(&entry_points::DRIVER, addr, "cuDriverGetVersion", || {
        let mut v = 0;
        // SAFETY: the driver exports it (check_loaded resolved it); an out pointer; it
        // needs no cuInit.
        let r = unsafe { cu::cuDriverGetVersion(&mut v) };
        (r == cu::CUresult::CUDA_SUCCESS)
            .then(|| format!("supports CUDA {}", entry_points::Version::of_cuda_code(v)))
    })
}

/// Every entry point of [`entry_points::NVRTC`] in the NVRTC cudarc loads, else the
/// message naming the missing ones and the NVRTC version.
fn nvrtc_entry_points() -> std::result::Result<(), String> {
    use cudarc::nvrtc::sys as nv;
    // SAFETY: as for the driver: a candidate loads, so culib does not panic.
    let lib = unsafe { nv::culib() };
    let addr = |name: &str| {
        // SAFETY: only looks the name up; nothing is called here.
        let sym = unsafe { lib.get::<*const std::ffi::c_void>(name.as_bytes()) };
        sym.ok().map(|s| *s)
    };
    check_loaded(&entry_points::NVRTC, addr, "nvrtcVersion", || {
        let (mut major, mut minor) = (0, 0);
        // SAFETY: NVRTC exports it (check_loaded resolved it); out pointers.
        let r = unsafe { nv::nvrtcVersion(&mut major, &mut minor) };
        (r == nv::nvrtcResult::NVRTC_SUCCESS).then(|| format!("NVRTC {major}.{minor}"))
    })
}

/// Fail with NVTE_COMM_ERROR_LIBRARY_NOT_FOUND, naming the library, when it cannot be
/// loaded or lacks an entry point this library calls (too old: the message names each
/// missing one and the release that provides it, see [`entry_points`]). The answer is
/// computed once per process and library; every path to a library's functions passes
/// here first (the driver's: [`init_driver`]), so none reaches a missing symbol.
pub fn require(lib: Lib) -> Result<()> {
    type Found = std::result::Result<(), String>;
    static PRESENT: Mutex<Option<HashMap<Lib, Found>>> = Mutex::new(None);
    let mut g = PRESENT.lock().unwrap_or_else(|e| e.into_inner());
    g.get_or_insert_with(HashMap::new)
        .entry(lib)
        .or_insert_with(|| lib.present())
        .clone()
        .map_err(|msg| Error::new(K::LibraryNotFound, msg))
}

/// Which file a library was bound to, its version code and whether that copy was
/// already mapped in the process before this library loaded it.
#[derive(Clone, Debug)]
pub struct LibInfo {
    pub path: String,
    pub version: i32,
    pub preloaded: bool,
}

/// Load (bind) `lib` if not yet and describe the bound copy. Versions: NCCL's
/// ncclGetVersion code (22809), cublasLtGetVersion (130100), cuDriverGetVersion (13000),
/// NVRTC major * 1000 + minor * 10.
pub fn library_info(lib: Lib) -> Result<LibInfo> {
    let bound = |b: std::result::Result<&'static dynlib::Bound, String>| {
        b.map_err(|m| Error::new(K::LibraryNotFound, m))
    };
    // The driver and NVRTC are loaded by cudarc, lazily at their first call: the path is
    // the mapped copy after the version call below.
    let mapped_path = |prefix: &str| {
        dynlib::mapped(prefix)
            .into_iter()
            .next()
            .unwrap_or_default()
    };
    match lib {
        Lib::Nccl => {
            let b = bound(dynlib::nccl())?;
            let mut v = 0;
            // SAFETY: out pointer.
            nccl_check(
                unsafe { dynlib::nccl_sys::ncclGetVersion(&mut v) },
                "ncclGetVersion",
            )?;
            Ok(LibInfo {
                path: b.path.clone(),
                version: v,
                preloaded: b.preloaded,
            })
        }
        Lib::CublasLt => {
            let b = bound(dynlib::cublaslt())?;
            // SAFETY: no arguments.
            let v = unsafe { dynlib::cublaslt_sys::cublasLtGetVersion() };
            Ok(LibInfo {
                path: b.path.clone(),
                version: i32::try_from(v).unwrap_or(i32::MAX),
                preloaded: b.preloaded,
            })
        }
        Lib::Driver => {
            static PRE: OnceCell<bool> = OnceCell::new();
            let preloaded = *PRE.get_or_init(|| !dynlib::mapped("libcuda.so").is_empty());
            require(lib)?;
            let mut v = 0;
            // SAFETY: out pointer.
            check(
                unsafe { cu::cuDriverGetVersion(&mut v) },
                "cuDriverGetVersion",
            )?;
            Ok(LibInfo {
                path: mapped_path("libcuda.so"),
                version: v,
                preloaded,
            })
        }
        Lib::Nvrtc => {
            static PRE: OnceCell<bool> = OnceCell::new();
            let preloaded = *PRE.get_or_init(|| !dynlib::mapped("libnvrtc.so").is_empty());
            require(lib)?;
            let (mut major, mut minor) = (0, 0);
            // SAFETY: out pointers.
            unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
            Ok(LibInfo {
                path: mapped_path("libnvrtc.so"),
                version: major * 1000 + minor * 10,
                preloaded,
            })
        }
    }
}

pub fn require_all_libraries() -> Result<()> {
    for lib in [Lib::Driver, Lib::CublasLt, Lib::Nvrtc, Lib::Nccl] {
        require(lib)?;
    }
    Ok(())
}

pub fn error_name(r: cu::CUresult) -> String {
    let mut p: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: cuGetErrorName writes a static string pointer.
    let ok = unsafe { cu::cuGetErrorName(r, &mut p) } == cu::CUresult::CUDA_SUCCESS;
    if ok && !p.is_null() {
        // SAFETY: static NUL-terminated string owned by the driver.
        unsafe { std::ffi::CStr::from_ptr(p) }
            .to_string_lossy()
            .into_owned()
    } else {
        format!("{r:?}")
    }
}

/// Turn a driver result into a Result, naming the call (counted: `host::counters`).
pub fn check(r: cu::CUresult, call: &str) -> Result<()> {
    check_with(r, || call.to_string())
}

/// [`check`] with the call's name made only on failure (no formatting on the hot path).
pub fn check_with(r: cu::CUresult, call: impl FnOnce() -> String) -> Result<()> {
    crate::host::count_lib_call();
    if r == cu::CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    let call = call();
    let status = if r == cu::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
        K::OutOfMemory
    } else {
        K::Cuda
    };
    Err(Error::new(
        status,
        format!("{call} failed: {} ({})", error_name(r), r as i32),
    ))
}

/// cuInit once per process; the result (success or the reason) is remembered.
/// An NCCL result (from the bound NCCL) as an error naming the call.
pub fn nccl_check(r: dynlib::nccl_sys::ncclResult_t, call: &str) -> Result<()> {
    use dynlib::nccl_sys as nc;
    crate::host::count_lib_call();
    if r == nc::ncclResult_t::ncclSuccess {
        return Ok(());
    }
    // SAFETY: NCCL returns a static string.
    let s = unsafe { std::ffi::CStr::from_ptr(nc::ncclGetErrorString(r)) }
        .to_string_lossy()
        .into_owned();
    Err(Error::new(K::Nccl, format!("{call} failed: {s}")))
}

pub fn init_driver() -> Result<()> {
    static INIT: OnceCell<std::result::Result<(), Error>> = OnceCell::new();
    INIT.get_or_init(|| {
        require(Lib::Driver)?;
        // SAFETY: plain driver call.
        check(unsafe { cu::cuInit(0) }, "cuInit")
    })
    .clone()
}

pub fn device_count() -> Result<i32> {
    init_driver()?;
    let mut n = 0;
    // SAFETY: plain driver call with an out pointer.
    check(unsafe { cu::cuDeviceGetCount(&mut n) }, "cuDeviceGetCount")?;
    Ok(n)
}

/// Properties of one device that the library needs.
#[derive(Clone, Debug)]
pub struct DeviceInfo {
    pub ordinal: i32,
    pub sm_count: i32,
    pub cc_major: i32,
    pub cc_minor: i32,
}

impl DeviceInfo {
    /// NVRTC architecture: the arch-specific variant (sm_90a) where one exists.
    pub fn nvrtc_arch(&self) -> String {
        let base = format!("sm_{}{}", self.cc_major, self.cc_minor);
        if self.cc_major >= 9 {
            format!("{base}a")
        } else {
            base
        }
    }
}

fn attr(dev: cu::CUdevice, a: cu::CUdevice_attribute) -> Result<i32> {
    let mut v = 0;
    // SAFETY: plain driver call with an out pointer.
    check(
        unsafe { cu::cuDeviceGetAttribute(&mut v, a, dev) },
        "cuDeviceGetAttribute",
    )?;
    Ok(v)
}

/// The device's model name (cuDeviceGetName), e.g. "NVIDIA H100 80GB HBM3".
pub fn device_name(ordinal: i32) -> Result<String> {
    init_driver()?;
    let mut dev = 0;
    // SAFETY: plain driver calls with out pointers; the name buffer is 256 bytes.
    check(unsafe { cu::cuDeviceGet(&mut dev, ordinal) }, "cuDeviceGet")?;
    let mut buf = [0 as std::ffi::c_char; 256];
    check(
        unsafe { cu::cuDeviceGetName(buf.as_mut_ptr(), buf.len() as i32, dev) },
        "cuDeviceGetName",
    )?;
    // SAFETY: NUL-terminated by the driver within the buffer.
    Ok(unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) }
        .to_string_lossy()
        .into_owned())
}

pub fn device_info(ordinal: i32) -> Result<DeviceInfo> {
    static CACHE: Mutex<Vec<DeviceInfo>> = Mutex::new(Vec::new());
    if let Some(d) = CACHE
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .find(|d| d.ordinal == ordinal)
    {
        return Ok(d.clone());
    }
    init_driver()?;
    let mut dev = 0;
    // SAFETY: plain driver call with an out pointer.
    check(unsafe { cu::cuDeviceGet(&mut dev, ordinal) }, "cuDeviceGet")?;
    use cu::CUdevice_attribute as A;
    let info = DeviceInfo {
        ordinal,
        sm_count: attr(dev, A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?,
        cc_major: attr(dev, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
        cc_minor: attr(dev, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
    };
    CACHE
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push(info.clone());
    Ok(info)
}

/// While alive, the context of the caller's stream (or the current / primary context)
/// is current on this thread; the caller's previous current context is restored on drop.
/// When that context is current already (the usual case: a framework thread on its
/// device, or a guard inside another), nothing is pushed or popped.
pub struct ContextGuard {
    /// the context, for driver calls that take one
    pub ctx: CtxHandle,
    /// its process-unique id (cuCtxGetId): the key of every per-context cache (a context
    /// made at the address of a destroyed one, as after `cudaDeviceReset`, gets a new id)
    pub id: CtxId,
    pub device: i32,
    /// the context was pushed (and is popped on drop)
    pushed: bool,
}

impl ContextGuard {
    /// Enter the context that `stream` belongs to. NULL and the special handles
    /// cudaStreamLegacy (1) / cudaStreamPerThread (2) use the current context, or the
    /// primary context of device 0 when the thread has none.
    pub fn for_stream(stream: StreamHandle) -> Result<ContextGuard> {
        let mut g = Self::for_stream_no_device(stream)?;
        let mut dev: cu::CUdevice = 0;
        // SAFETY: a context is current (the guard's).
        check(unsafe { cu::cuCtxGetDevice(&mut dev) }, "cuCtxGetDevice")?;
        g.device = dev;
        Ok(g)
    }

    /// [`Self::for_stream`] without the device lookup (`device` is -1; [`current_device`]
    /// gives it while the guard lives): the hot paths that only need the context (a GEMM,
    /// an overlap call on its object's context) save a driver call.
    pub fn for_stream_no_device(stream: StreamHandle) -> Result<ContextGuard> {
        init_driver()?;
        let mut cur: cu::CUcontext = std::ptr::null_mut();
        // SAFETY: out pointer.
        check(unsafe { cu::cuCtxGetCurrent(&mut cur) }, "cuCtxGetCurrent")?;
        let mut ctx: cu::CUcontext = cur;
        if stream.raw() > 2 {
            // SAFETY: the caller passes a stream handle; an invalid one yields an error code.
            check(
                unsafe { cu::cuStreamGetCtx(stream.cu(), &mut ctx) },
                "cuStreamGetCtx(stream)",
            )
            .map_err(|e| {
                e.context(format!(
                    "argument `stream` ({:#x}) is not a usable CUDA stream",
                    stream.raw()
                ))
            })?;
        } else if ctx.is_null() {
            let mut dev = 0;
            // SAFETY: out pointers; the primary context stays retained for the process.
            check(unsafe { cu::cuDeviceGet(&mut dev, 0) }, "cuDeviceGet(0)")?;
            check(
                unsafe { cu::cuDevicePrimaryCtxRetain(&mut ctx, dev) },
                "cuDevicePrimaryCtxRetain",
            )?;
        }
        let pushed = ctx != cur;
        if pushed {
            // SAFETY: ctx is a valid context.
            check(unsafe { cu::cuCtxPushCurrent_v2(ctx) }, "cuCtxPushCurrent")?;
        }
        // Made before anything else can fail: a pushed context is popped on drop.
        Ok(ContextGuard {
            ctx: CtxHandle::from_raw(ctx),
            id: context_id(ctx),
            device: -1,
            pushed,
        })
    }
}

#[cfg(test)]
impl ContextGuard {
    /// A guard that entered nothing, for host tests of code that only passes it on (no
    /// driver call sees its NULL context; its drop pops nothing).
    pub(crate) fn host_test() -> ContextGuard {
        ContextGuard {
            ctx: CtxHandle::NULL,
            id: CtxId(0),
            device: 0,
            pushed: false,
        }
    }
}

/// The current context (handle and id), or None when none is current.
pub(crate) fn current_context() -> Option<CtxRef> {
    let mut c: cu::CUcontext = std::ptr::null_mut();
    // SAFETY: out pointer.
    let r = unsafe { cu::cuCtxGetCurrent(&mut c) };
    (r == cu::CUresult::CUDA_SUCCESS && !c.is_null()).then(|| CtxRef {
        handle: CtxHandle::from_raw(c),
        id: context_id(c),
    })
}

/// Whether the context `c` (from [`current_context`]) still exists: a context
/// destroyed since, or the primary context reset since (same address, new id), does not;
/// its handles and memory went with it and must not be released again.
pub(crate) fn context_alive(c: CtxRef) -> bool {
    let mut now: std::ffi::c_ulonglong = 0;
    // SAFETY: out pointer; the driver checks the handle (an error for a destroyed one).
    let r = unsafe { cu::cuCtxGetId(c.handle.raw(), &mut now) };
    r == cu::CUresult::CUDA_SUCCESS && CtxId(now as u64) == c.id
}

/// A process-unique id of context `ctx` (cuCtxGetId): the key of the per-context caches
/// (modules, cuBLASLt handles and plans, our GEMM's backend), so that a context made at
/// the address of a destroyed one (the primary context after `cudaDeviceReset`, a
/// `cuCtxDestroy` then `cuCtxCreate`) is never served the old one's modules and handles.
/// Where the driver refuses, the address with the top bit set (no id has it).
fn context_id(ctx: cu::CUcontext) -> CtxId {
    let mut id: std::ffi::c_ulonglong = 0;
    // SAFETY: out pointer; an error code for an invalid context.
    if unsafe { cu::cuCtxGetId(ctx, &mut id) } == cu::CUresult::CUDA_SUCCESS {
        CtxId(id as u64)
    } else {
        CtxId(ctx as u64 | 1 << 63)
    }
}

/// The device of the current context (e.g. inside a [`ContextGuard`]).
pub fn current_device() -> Result<i32> {
    let mut dev: cu::CUdevice = 0;
    // SAFETY: out pointer; an error code when no context is current.
    check(unsafe { cu::cuCtxGetDevice(&mut dev) }, "cuCtxGetDevice")?;
    Ok(dev)
}

impl Drop for ContextGuard {
    fn drop(&mut self) {
        if !self.pushed {
            return;
        }
        let mut old: cu::CUcontext = std::ptr::null_mut();
        // SAFETY: pops the context pushed in for_stream.
        unsafe { cu::cuCtxPopCurrent_v2(&mut old) };
    }
}
