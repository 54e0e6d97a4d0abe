//! Binding of NCCL and cuBLASLt at run time: one copy per process.
//!
//! A framework process (PyTorch, JAX) already has its own NCCL and cuBLASLt mapped,
//! usually from its wheels, while the system may hold other copies on the search path.
//! Handing a communicator created by one NCCL copy to another fails ("invalid argument")
//! or corrupts state, so these libraries are bound in this order:
//! 1. the file named by `NVTE_COMM_NCCL_LIBRARY` / `NVTE_COMM_CUBLASLT_LIBRARY`;
//! 2. a copy already mapped in the process (found with `dl_iterate_phdr`, opened with
//!    `RTLD_NOLOAD`, so the very same copy is used);
//! 3. the search path, soname first (`libnccl.so.2`, `libcublasLt.so.13`).
//!
//! The binding happens at the first use and holds for the life of the process:
//! frameworks must be imported before the first NCCL call of this library.
//! [`nccl_sys`] and [`cublaslt_sys`] are drop-in replacements of cudarc's `sys`
//! functions for the calls this library makes (cudarc's types are reused).
use super::DlHandle;
use super::entry_points;
use crate::error::{Error, ErrorKind};
use std::ffi::{CStr, CString, c_int, c_void};
use std::sync::OnceLock;

/// A library bound for the life of the process.
#[derive(Debug)]
pub struct Bound {
    handle: DlHandle,
    /// The file that was bound.
    pub path: String,
    /// True when the copy was already mapped in the process before this library bound it.
    pub preloaded: bool,
    /// How it was found (for messages).
    pub how: &'static str,
}

/// What to look for.
pub struct Spec {
    /// For messages: "NCCL", "cuBLASLt".
    pub name: &'static str,
    /// Environment variable naming the file to bind.
    pub env: &'static crate::env::Path,
    /// File-name prefix of a mapped copy ("libnccl.so").
    pub prefix: &'static str,
    /// Names tried on the search path, in order.
    pub candidates: &'static [&'static str],
    /// A symbol every usable copy exports (checked after binding).
    pub probe: &'static str,
    /// The entry points this library calls, all checked after binding (a copy too old
    /// for this library is refused with a message naming the missing ones).
    pub entry_points: &'static entry_points::Table,
    /// The bound copy's version for that message ("NCCL 2.12.12"), from its handle.
    pub version: fn(DlHandle) -> Option<String>,
}

pub const NCCL: Spec = Spec {
    name: "NCCL",
    env: &crate::env::NCCL_LIBRARY,
    prefix: "libnccl.so",
    candidates: &["libnccl.so.2", "libnccl.so"],
    probe: "ncclCommInitRank",
    entry_points: &entry_points::NCCL,
    version: nccl_version,
};

pub const CUBLASLT: Spec = Spec {
    name: "cuBLASLt",
    env: &crate::env::CUBLASLT_LIBRARY,
    prefix: "libcublasLt.so",
    candidates: &["libcublasLt.so.13", "libcublasLt.so"],
    probe: "cublasLtMatmul",
    entry_points: &entry_points::CUBLASLT,
    version: cublaslt_version,
};

/// The address of `name` in `handle`, if it exports it.
fn address(handle: DlHandle, name: &str) -> Option<*mut c_void> {
    let s = CString::new(name).ok()?;
    // SAFETY: a live handle and a NUL-terminated name.
    let p = unsafe { libc::dlsym(handle.raw(), s.as_ptr()) };
    (!p.is_null()).then_some(p)
}

/// "NCCL 2.12.12" from ncclGetVersion of the copy `handle` (codes below 10000 count
/// minor versions in hundreds: 2708 is 2.7.8).
fn nccl_version(handle: DlHandle) -> Option<String> {
    let p = address(handle, "ncclGetVersion")?;
    type F = unsafe extern "C" fn(*mut c_int) -> nccl_sys::ncclResult_t;
    // SAFETY: ncclGetVersion has this signature in every NCCL that exports it.
    let f: F = unsafe { std::mem::transmute::<*mut c_void, F>(p) };
    let mut v: c_int = 0;
    // SAFETY: out pointer.
    if unsafe { f(&mut v) } != nccl_sys::ncclResult_t::ncclSuccess {
        return None;
    }
    let (major, rest) = if v >= 10000 {
        (v / 10000, v % 10000)
    } else {
        (v / 1000, v % 1000)
    };
    Some(format!("NCCL {major}.{}.{}", rest / 100, rest % 100))
}

/// "cuBLASLt 130100" (cublasLtGetVersion's code) of the copy `handle`.
fn cublaslt_version(handle: DlHandle) -> Option<String> {
    let p = address(handle, "cublasLtGetVersion")?;
    type F = unsafe extern "C" fn() -> usize;
    // SAFETY: cublasLtGetVersion has this signature in every cuBLASLt.
    let f: F = unsafe { std::mem::transmute::<*mut c_void, F>(p) };
    // SAFETY: no arguments.
    Some(format!("cuBLASLt version {}", unsafe { f() }))
}

unsafe extern "C" fn collect(
    info: *mut libc::dl_phdr_info,
    _size: usize,
    data: *mut c_void,
) -> c_int {
    // SAFETY: dl_iterate_phdr passes a valid info record; `data` is the Vec given below.
    let (info, out) = unsafe { (&*info, &mut *(data as *mut Vec<String>)) };
    if !info.dlpi_name.is_null() {
        // SAFETY: NUL-terminated path owned by the dynamic linker.
        let name = unsafe { CStr::from_ptr(info.dlpi_name) };
        if !name.is_empty() {
            out.push(name.to_string_lossy().into_owned());
        }
    }
    0
}

/// Paths of the objects mapped in this process whose file name starts with `prefix`,
/// in link-map (load) order.
pub fn mapped(prefix: &str) -> Vec<String> {
    let mut all: Vec<String> = Vec::new();
    // SAFETY: the callback only reads the records and appends to `all`.
    unsafe { libc::dl_iterate_phdr(Some(collect), &mut all as *mut Vec<String> as *mut c_void) };
    all.into_iter()
        .filter(|p| {
            std::path::Path::new(p)
                .file_name()
                .and_then(|f| f.to_str())
                .is_some_and(|f| f.starts_with(prefix))
        })
        .collect()
}

fn dl_error() -> String {
    // SAFETY: dlerror returns NULL or a thread-local NUL-terminated string.
    let e = unsafe { libc::dlerror() };
    if e.is_null() {
        "unknown dlopen error".into()
    } else {
        // SAFETY: see above.
        unsafe { CStr::from_ptr(e) }.to_string_lossy().into_owned()
    }
}

fn open(name: &str, flags: c_int) -> Result<DlHandle, String> {
    let c = CString::new(name).map_err(|_| format!("{name:?} contains a NUL byte"))?;
    // SAFETY: plain dlopen of a NUL-terminated name.
    let h = unsafe { libc::dlopen(c.as_ptr(), flags) };
    if h.is_null() {
        Err(dl_error())
    } else {
        Ok(DlHandle::from_raw(h))
    }
}

/// The path of the object that defines `sym` in `handle`.
fn path_of(handle: DlHandle, sym: &str) -> Option<String> {
    let s = CString::new(sym).ok()?;
    // SAFETY: a live handle and a NUL-terminated name.
    let p = unsafe { libc::dlsym(handle.raw(), s.as_ptr()) };
    path_of_address(p as usize)
}

/// The path of the mapped object that holds address `addr` (a symbol's), if any.
pub fn path_of_address(addr: usize) -> Option<String> {
    if addr == 0 {
        return None;
    }
    let p = addr as *const c_void;
    // SAFETY: zeroed POD out-record.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: dladdr only compares `p` with the mapped objects' ranges; info is written.
    if unsafe { libc::dladdr(p, &mut info) } == 0 || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: NUL-terminated path owned by the dynamic linker.
    Some(
        unsafe { CStr::from_ptr(info.dli_fname) }
            .to_string_lossy()
            .into_owned(),
    )
}

fn has_symbol(handle: DlHandle, sym: &str) -> bool {
    address(handle, sym).is_some()
}

/// Bind `spec` by the policy of this module. The error names what was tried.
pub fn bind(spec: &Spec) -> Result<Bound, String> {
    let flags = libc::RTLD_NOW | libc::RTLD_LOCAL;
    let probed = |b: Bound| -> Result<Bound, String> {
        if has_symbol(b.handle, spec.probe) {
            Ok(b)
        } else {
            Err(format!(
                "{} does not export {}: not a {} library",
                b.path, spec.probe, spec.name
            ))
        }
    };
    // A copy of the library that is too old is refused, not passed over: binding another
    // copy beside one already mapped is what this module avoids.
    let checked = |b: Bound| -> Result<Bound, String> {
        let b = probed(b)?;
        spec.entry_points
            .check(
                |name| has_symbol(b.handle, name),
                || entry_points::Loaded {
                    path: Some(b.path.clone()),
                    version: (spec.version)(b.handle),
                },
            )
            .map(|_| b)
    };
    if let Some(file) = spec.env.get() {
        let file = file.to_string_lossy().into_owned();
        let before = mapped(spec.prefix);
        let handle = open(&file, flags)
            .map_err(|e| format!("{}={file} could not be loaded: {e}", spec.env.name()))?;
        let path = path_of(handle, spec.probe).unwrap_or(file);
        let preloaded = before.contains(&path);
        return checked(Bound {
            handle,
            path,
            preloaded,
            how: "named by the environment",
        });
    }
    for p in mapped(spec.prefix) {
        if let Ok(handle) = open(&p, flags | libc::RTLD_NOLOAD)
            && let Ok(b) = probed(Bound {
                handle,
                path: p,
                preloaded: true,
                how: "already loaded in the process",
            })
        {
            return checked(b);
        }
    }
    let mut tried = Vec::new();
    for name in spec.candidates {
        match open(name, flags) {
            Ok(handle) => {
                let path = path_of(handle, spec.probe).unwrap_or_else(|| name.to_string());
                return checked(Bound {
                    handle,
                    path,
                    preloaded: false,
                    how: "found on the library search path",
                });
            }
            Err(e) => tried.push(format!("{name} ({e})")),
        }
    }
    Err(format!(
        "could not load {}: none mapped in the process, {} not set, and the search path has none of: {} (set LD_LIBRARY_PATH or {})",
        spec.name,
        spec.env.name(),
        tried.join("; "),
        spec.env.name()
    ))
}

fn bound(
    cell: &'static OnceLock<Result<Bound, String>>,
    spec: &Spec,
) -> Result<&'static Bound, String> {
    cell.get_or_init(|| bind(spec))
        .as_ref()
        .map_err(|e| e.clone())
}

/// NCCL, bound once per process.
pub fn nccl() -> Result<&'static Bound, String> {
    static B: OnceLock<Result<Bound, String>> = OnceLock::new();
    bound(&B, &NCCL)
}

/// cuBLASLt, bound once per process.
pub fn cublaslt() -> Result<&'static Bound, String> {
    static B: OnceLock<Result<Bound, String>> = OnceLock::new();
    bound(&B, &CUBLASLT)
}

/// The address of `name` in `lib`. Panics when the library is not bound or lacks the
/// symbol, with the error as the payload (kind `LibraryNotFound`: the FFI firewall
/// reports the payload's kind, LIBRARY_NOT_FOUND); callers check `crate::cuda::require`
/// first, and binding checks every forwarded name (`entry_points`), so neither happens.
pub fn symbol(lib: fn() -> Result<&'static Bound, String>, name: &str) -> usize {
    let missing =
        |msg: String| -> ! { std::panic::panic_any(Error::new(ErrorKind::LibraryNotFound, msg)) };
    let b = match lib() {
        Ok(b) => b,
        Err(e) => missing(format!("Unable to dynamically load: {e}")),
    };
    let s = CString::new(name).expect("symbol names have no NUL");
    // SAFETY: a live handle and a NUL-terminated name.
    let p = unsafe { libc::dlsym(b.handle.raw(), s.as_ptr()) };
    if p.is_null() {
        missing(format!(
            "Unable to dynamically load {name}: {} does not export it (too old?)",
            b.path
        ));
    }
    p as usize
}

/// Declare `pub unsafe fn NAME(args) -> ret` forwarding to the bound library's symbol.
macro_rules! forward {
    ($lib:path; $( fn $name:ident ( $($arg:ident : $ty:ty),* $(,)? ) -> $ret:ty ; )*) => {
        /// The names forwarded here (each is in `entry_points`, checked when binding).
        pub const FORWARDED: &[&str] = &[$(stringify!($name)),*];
        $(
            /// Forwards to the bound library's symbol of the same name.
            ///
            /// # Safety
            /// The C function's contract.
            pub unsafe fn $name($($arg: $ty),*) -> $ret {
                type F = unsafe extern "C" fn($($ty),*) -> $ret;
                static P: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
                let p = *P.get_or_init(|| super::symbol($lib, stringify!($name)));
                // SAFETY: `p` is the address of the C function with exactly this signature
                // (NCCL's / cuBLASLt's headers).
                let f: F = unsafe { std::mem::transmute::<usize, F>(p) };
                // SAFETY: forwarded under the caller's obligations.
                unsafe { f($($arg),*) }
            }
        )*
    };
}

/// NCCL entry points through the bound copy (names and types as cudarc's `nccl::sys`).
#[allow(non_snake_case, clippy::missing_safety_doc)]
pub mod nccl_sys {
    pub use cudarc::nccl::sys::{
        cudaStream_t, ncclComm_t, ncclConfig_t, ncclDataType_t, ncclRedOp_t, ncclResult_t,
        ncclUniqueId,
    };
    use std::ffi::{c_char, c_int, c_void};

    forward! { super::nccl;
        fn ncclGetVersion(version: *mut c_int) -> ncclResult_t;
        fn ncclGetErrorString(result: ncclResult_t) -> *const c_char;
        fn ncclGetUniqueId(id: *mut ncclUniqueId) -> ncclResult_t;
        fn ncclCommInitRank(comm: *mut ncclComm_t, nranks: c_int, id: ncclUniqueId, rank: c_int) -> ncclResult_t;
        fn ncclCommInitRankConfig(comm: *mut ncclComm_t, nranks: c_int, id: ncclUniqueId, rank: c_int, config: *mut ncclConfig_t) -> ncclResult_t;
        fn ncclCommDestroy(comm: ncclComm_t) -> ncclResult_t;
        fn ncclCommFinalize(comm: ncclComm_t) -> ncclResult_t;
        fn ncclCommAbort(comm: ncclComm_t) -> ncclResult_t;
        fn ncclCommGetAsyncError(comm: ncclComm_t, async_error: *mut u32) -> ncclResult_t;
        fn ncclCommUserRank(comm: ncclComm_t, rank: *mut c_int) -> ncclResult_t;
        fn ncclCommCount(comm: ncclComm_t, count: *mut c_int) -> ncclResult_t;
        fn ncclGroupStart() -> ncclResult_t;
        fn ncclGroupEnd() -> ncclResult_t;
        fn ncclSend(buf: *const c_void, count: usize, t: ncclDataType_t, peer: c_int, comm: ncclComm_t, stream: cudaStream_t) -> ncclResult_t;
        fn ncclRecv(buf: *mut c_void, count: usize, t: ncclDataType_t, peer: c_int, comm: ncclComm_t, stream: cudaStream_t) -> ncclResult_t;
        fn ncclAllGather(send: *const c_void, recv: *mut c_void, count: usize, t: ncclDataType_t, comm: ncclComm_t, stream: cudaStream_t) -> ncclResult_t;
        fn ncclAllReduce(send: *const c_void, recv: *mut c_void, count: usize, t: ncclDataType_t, op: ncclRedOp_t, comm: ncclComm_t, stream: cudaStream_t) -> ncclResult_t;
        fn ncclReduceScatter(send: *const c_void, recv: *mut c_void, count: usize, t: ncclDataType_t, op: ncclRedOp_t, comm: ncclComm_t, stream: cudaStream_t) -> ncclResult_t;
    }
}

/// cuBLASLt entry points through the bound copy (names and types as cudarc's
/// `cublaslt::sys`).
#[allow(non_snake_case, clippy::missing_safety_doc, clippy::too_many_arguments)]
pub mod cublaslt_sys {
    pub use cudarc::cublaslt::sys::{
        cublasComputeType_t, cublasLtEpilogue_t, cublasLtHandle_t, cublasLtMatmulAlgo_t,
        cublasLtMatmulDesc_t, cublasLtMatmulDescAttributes_t, cublasLtMatmulHeuristicResult_t,
        cublasLtMatmulPreference_t, cublasLtMatmulPreferenceAttributes_t, cublasLtMatrixLayout_t,
        cublasStatus_t, cudaDataType, cudaDataType_t, cudaStream_t,
    };
    use std::ffi::{c_char, c_int, c_void};

    forward! { super::cublaslt;
        fn cublasLtGetVersion() -> usize;
        fn cublasLtGetStatusName(status: cublasStatus_t) -> *const c_char;
        fn cublasLtCreate(handle: *mut cublasLtHandle_t) -> cublasStatus_t;
        fn cublasLtMatrixLayoutCreate(l: *mut cublasLtMatrixLayout_t, t: cudaDataType, rows: u64, cols: u64, ld: i64) -> cublasStatus_t;
        fn cublasLtMatrixLayoutDestroy(l: cublasLtMatrixLayout_t) -> cublasStatus_t;
        fn cublasLtMatmulDescCreate(d: *mut cublasLtMatmulDesc_t, compute: cublasComputeType_t, scale: cudaDataType_t) -> cublasStatus_t;
        fn cublasLtMatmulDescDestroy(d: cublasLtMatmulDesc_t) -> cublasStatus_t;
        fn cublasLtMatmulDescSetAttribute(d: cublasLtMatmulDesc_t, a: cublasLtMatmulDescAttributes_t, buf: *const c_void, size: usize) -> cublasStatus_t;
        fn cublasLtMatmulPreferenceCreate(p: *mut cublasLtMatmulPreference_t) -> cublasStatus_t;
        fn cublasLtMatmulPreferenceDestroy(p: cublasLtMatmulPreference_t) -> cublasStatus_t;
        fn cublasLtMatmulPreferenceSetAttribute(p: cublasLtMatmulPreference_t, a: cublasLtMatmulPreferenceAttributes_t, buf: *const c_void, size: usize) -> cublasStatus_t;
        fn cublasLtMatmulAlgoGetHeuristic(h: cublasLtHandle_t, desc: cublasLtMatmulDesc_t, a: cublasLtMatrixLayout_t, b: cublasLtMatrixLayout_t, c: cublasLtMatrixLayout_t, d: cublasLtMatrixLayout_t, pref: cublasLtMatmulPreference_t, requested: c_int, results: *mut cublasLtMatmulHeuristicResult_t, returned: *mut c_int) -> cublasStatus_t;
        fn cublasLtMatmul(h: cublasLtHandle_t, desc: cublasLtMatmulDesc_t, alpha: *const c_void, a: *const c_void, adesc: cublasLtMatrixLayout_t, b: *const c_void, bdesc: cublasLtMatrixLayout_t, beta: *const c_void, c: *const c_void, cdesc: cublasLtMatrixLayout_t, d: *mut c_void, ddesc: cublasLtMatrixLayout_t, algo: *const cublasLtMatmulAlgo_t, workspace: *mut c_void, workspace_bytes: usize, stream: cudaStream_t) -> cublasStatus_t;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// This process's own symbols as a bound library (`dlopen(NULL)`).
    fn this_process() -> Result<&'static Bound, String> {
        static B: OnceLock<Bound> = OnceLock::new();
        Ok(B.get_or_init(|| Bound {
            // SAFETY: dlopen(NULL) returns the handle of the program itself.
            handle: DlHandle::from_raw(unsafe { libc::dlopen(std::ptr::null(), libc::RTLD_NOW) }),
            path: "this process".into(),
            preloaded: true,
            how: "test",
        }))
    }

    fn unbound() -> Result<&'static Bound, String> {
        Err("libexample.so.1 is not on the search path".into())
    }

    /// The kind of the error `symbol` panics with (none: it did not panic with one).
    fn symbol_panic(lib: fn() -> Result<&'static Bound, String>, name: &str) -> Option<Error> {
        let payload = std::panic::catch_unwind(|| symbol(lib, name)).err()?;
        payload.downcast::<Error>().ok().map(|e| *e)
    }

    #[test]
    fn a_missing_library_or_symbol_panics_with_its_error_value() {
        assert_ne!(symbol(this_process, "malloc"), 0);
        let e = symbol_panic(unbound, "ncclGetVersion").expect("an Error payload");
        assert_eq!(e.kind, ErrorKind::LibraryNotFound);
        assert!(
            e.msg.contains("libexample.so.1 is not on the search path"),
            "{}",
            e.msg
        );
        let e = symbol_panic(this_process, "nvte_no_such_symbol").expect("an Error payload");
        assert_eq!(e.kind, ErrorKind::LibraryNotFound);
        assert!(e.msg.contains("nvte_no_such_symbol"), "{}", e.msg);
    }

    #[test]
    fn mapped_finds_the_c_library_of_this_process() {
        let libc_paths = mapped("libc.so");
        assert!(
            libc_paths.iter().any(|p| p.contains("libc.so.6")),
            "{libc_paths:?}"
        );
        assert!(mapped("libdefinitely_not_here.so").is_empty());
    }

    /// libgcc_s as a stand-in library: mapped in every Rust test binary on Linux (std
    /// unwinds with it), with a search-path candidate that does not exist.
    fn libgcc_spec(table: &'static entry_points::Table) -> Spec {
        Spec {
            name: "libgcc_s",
            env: &crate::env::TEST_UNSET_LIBGCC,
            prefix: "libgcc_s.so",
            candidates: &["libgcc_s_nonexistent.so"],
            probe: "_Unwind_Resume",
            entry_points: table,
            version: |_| None,
        }
    }

    #[test]
    fn an_already_mapped_copy_is_bound_before_the_search_path() {
        // libgcc_s is mapped in every Rust test binary on Linux (std unwinds with it);
        // the only search-path candidate does not exist, so only the mapped copy can bind.
        let spec = libgcc_spec(&entry_points::NONE);
        let b = bind(&spec).expect("libgcc_s is mapped");
        assert!(b.preloaded, "{b:?}");
        assert_eq!(b.how, "already loaded in the process");
        assert_eq!(Some(b.path.clone()), mapped("libgcc_s.so").first().cloned());
    }

    #[test]
    fn every_forwarded_entry_point_is_checked_when_binding() {
        for (forwarded, table) in [
            (nccl_sys::FORWARDED, &entry_points::NCCL),
            (cublaslt_sys::FORWARDED, &entry_points::CUBLASLT),
        ] {
            let mut f: Vec<&str> = forwarded.to_vec();
            let mut t: Vec<&str> = table.entries.iter().map(|e| e.name).collect();
            f.sort();
            t.sort();
            assert_eq!(f, t, "{}: forwarded vs entry_points", table.library);
        }
    }

    #[test]
    fn a_copy_too_old_is_refused_naming_what_it_lacks() {
        // libgcc_s as a stand-in library whose table lists one symbol it has and one it
        // lacks.
        static OLD: entry_points::Table = entry_points::Table {
            library: "libgcc_s",
            release: "GCC",
            advice: "use a newer one",
            entries: &[
                entry_points::EntryPoint {
                    name: "_Unwind_Resume",
                    since: entry_points::Version::new(3, 0),
                },
                entry_points::EntryPoint {
                    name: "_Unwind_From_The_Future",
                    since: entry_points::Version::new(99, 1),
                },
            ],
        };
        let spec = Spec {
            version: |_| Some("GCC 0.1".into()),
            ..libgcc_spec(&OLD)
        };
        let e = bind(&spec).unwrap_err();
        let path = mapped("libgcc_s.so").first().cloned().unwrap();
        assert_eq!(
            e,
            format!(
                "libgcc_s ({path}, GCC 0.1) lacks an entry point this library calls: _Unwind_From_The_Future (GCC 99.1). This library needs GCC 99.1 or newer: use a newer one"
            )
        );
    }

    #[test]
    fn a_missing_library_names_what_was_tried() {
        let spec = Spec {
            name: "Nothing",
            env: &crate::env::TEST_UNSET_NOTHING,
            prefix: "libnothing_here.so",
            candidates: &["libnothing_here.so.7"],
            probe: "nothing",
            entry_points: &entry_points::NONE,
            version: |_| None,
        };
        let e = bind(&spec).unwrap_err();
        assert!(e.contains("libnothing_here.so.7"), "{e}");
        assert!(e.contains(crate::env::TEST_UNSET_NOTHING.name()), "{e}");
    }
}
