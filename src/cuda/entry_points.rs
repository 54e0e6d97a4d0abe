//! Every entry point the library calls in the libraries it loads at run time, with the
//! oldest release that provides it, checked once when the library is loaded
//! ([`crate::cuda::require`], [`crate::cuda::dynlib::bind`]): a library too old for this
//! one fails there with `NVTE_COMM_ERROR_LIBRARY_NOT_FOUND` and a message naming each
//! missing entry point and the release it needs, instead of a panic at its first call.
//!
//! The names are the symbols as they are resolved (cudarc's and `dynlib`'s `dlsym`
//! names, e.g. `cuMemAlloc_v2`); `tests/entry_points.rs` checks that every entry point
//! the source calls is listed here and that every one listed is called. The CUDA
//! versions are those of the `PFN_<name>_v<version>` typedefs of CUDA's
//! `cudaTypedefs.h` for that ABI variant, or of the first `cuda.h` that declares it
//! (cudarc's `cuda-<version>` binding features), whichever is later.
use std::fmt;

/// A release: CUDA 12.8, NCCL 2.14.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Version {
    pub major: u32,
    pub minor: u32,
}

impl Version {
    pub const fn new(major: u32, minor: u32) -> Version {
        Version { major, minor }
    }
    /// A CUDA version code (`cuDriverGetVersion`, `CUDA_VERSION`): 12080 is 12.8.
    pub fn of_cuda_code(code: i32) -> Version {
        let c = code.max(0) as u32;
        Version::new(c / 1000, c % 1000 / 10)
    }
}

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

/// One entry point and the oldest release that exports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EntryPoint {
    pub name: &'static str,
    pub since: Version,
}

const fn ep(name: &'static str, major: u32, minor: u32) -> EntryPoint {
    EntryPoint {
        name,
        since: Version::new(major, minor),
    }
}

/// The entry points of one library and how to word its messages.
pub struct Table {
    /// The library, for messages: "the CUDA driver".
    pub library: &'static str,
    /// The release line the versions count in: "CUDA", "NCCL".
    pub release: &'static str,
    /// What to do, after "This library needs {release} {version} or newer: ".
    pub advice: &'static str,
    pub entries: &'static [EntryPoint],
}

/// The CUDA driver (libcuda), as cudarc's `driver::sys` resolves it.
pub const DRIVER: Table = Table {
    library: "the CUDA driver",
    release: "CUDA",
    advice: "update the NVIDIA driver to one that supports it (`nvidia-smi` shows the newest CUDA version the installed driver supports)",
    entries: &[
        ep("cuInit", 2, 0),
        ep("cuDriverGetVersion", 2, 2),
        ep("cuGetErrorName", 6, 0),
        ep("cuDeviceGet", 2, 0),
        ep("cuDeviceGetCount", 2, 0),
        ep("cuDeviceGetName", 2, 0),
        ep("cuDeviceGetAttribute", 2, 0),
        ep("cuDeviceGetUuid_v2", 11, 4),
        ep("cuDeviceCanAccessPeer", 4, 0),
        ep("cuDevicePrimaryCtxRetain", 7, 0),
        ep("cuCtxGetCurrent", 4, 0),
        ep("cuCtxGetDevice", 2, 0),
        ep("cuCtxGetId", 12, 0),
        ep("cuCtxGetStreamPriorityRange", 5, 5),
        ep("cuCtxPushCurrent_v2", 4, 0),
        ep("cuCtxPopCurrent_v2", 4, 0),
        ep("cuCtxEnablePeerAccess", 4, 0),
        ep("cuStreamCreateWithPriority", 5, 5),
        ep("cuStreamDestroy_v2", 4, 0),
        ep("cuStreamGetCtx", 9, 2),
        ep("cuStreamQuery", 2, 0),
        ep("cuStreamSynchronize", 2, 0),
        ep("cuStreamWaitEvent", 3, 2),
        ep("cuStreamWaitValue32_v2", 11, 7),
        ep("cuStreamWriteValue32_v2", 11, 7),
        ep("cuStreamBeginCapture_v2", 10, 1),
        ep("cuStreamEndCapture", 10, 0),
        ep("cuStreamGetCaptureInfo_v3", 12, 3),
        ep("cuThreadExchangeStreamCaptureMode", 10, 1),
        ep("cuEventCreate", 2, 0),
        ep("cuEventDestroy_v2", 4, 0),
        ep("cuEventRecord", 2, 0),
        ep("cuEventQuery", 2, 0),
        ep("cuEventElapsedTime_v2", 12, 8),
        ep("cuMemAlloc_v2", 3, 2),
        ep("cuMemFree_v2", 3, 2),
        ep("cuMemHostAlloc", 2, 2),
        ep("cuMemFreeHost", 2, 0),
        ep("cuMemHostGetDevicePointer_v2", 3, 2),
        ep("cuMemcpyHtoD_v2", 3, 2),
        ep("cuMemcpyDtoH_v2", 3, 2),
        ep("cuMemcpyHtoDAsync_v2", 3, 2),
        ep("cuMemcpyDtoHAsync_v2", 3, 2),
        ep("cuMemcpyDtoDAsync_v2", 3, 2),
        ep("cuMemcpy2DAsync_v2", 3, 2),
        ep("cuMemsetD8Async", 3, 2),
        ep("cuIpcGetMemHandle", 4, 1),
        ep("cuIpcOpenMemHandle_v2", 11, 0),
        ep("cuIpcCloseMemHandle", 4, 1),
        ep("cuModuleLoadData", 2, 0),
        ep("cuModuleGetFunction", 2, 0),
        ep("cuModuleGetGlobal_v2", 3, 2),
        ep("cuFuncGetAttribute", 2, 2),
        ep("cuFuncSetAttribute", 9, 0),
        ep("cuOccupancyMaxActiveBlocksPerMultiprocessor", 6, 5),
        ep("cuLaunchKernel", 4, 0),
        // cudaTypedefs.h says v11060, but cuda.h declares it from CUDA 11.8 on.
        ep("cuLaunchKernelEx", 11, 8),
        ep("cuTensorMapEncodeTiled", 12, 0),
        ep("cuGraphInstantiateWithFlags", 11, 4),
        ep("cuGraphLaunch", 10, 0),
        ep("cuGraphDestroy", 10, 0),
        ep("cuGraphExecDestroy", 10, 0),
    ],
};

/// NVRTC, as cudarc's `nvrtc::sys` resolves it.
pub const NVRTC: Table = Table {
    library: "NVRTC",
    release: "CUDA",
    advice: "use that CUDA's NVRTC (libnvrtc.so.13 from the CUDA toolkit or the nvidia-cuda-nvrtc wheel, on LD_LIBRARY_PATH)",
    entries: &[
        ep("nvrtcVersion", 7, 0),
        ep("nvrtcGetErrorString", 7, 0),
        ep("nvrtcCreateProgram", 7, 0),
        ep("nvrtcCompileProgram", 7, 0),
        ep("nvrtcDestroyProgram", 7, 0),
        ep("nvrtcGetProgramLogSize", 7, 0),
        ep("nvrtcGetProgramLog", 7, 0),
        ep("nvrtcGetCUBINSize", 11, 1),
        ep("nvrtcGetCUBIN", 11, 1),
    ],
};

/// NCCL, as `dynlib::nccl_sys` forwards to it (versions: NCCL's release notes).
pub const NCCL: Table = Table {
    library: "NCCL",
    release: "NCCL",
    advice: "point NVTE_COMM_NCCL_LIBRARY or LD_LIBRARY_PATH at a newer libnccl.so.2 (libnccl2 or the nvidia-nccl wheel)",
    entries: &[
        ep("ncclGetVersion", 2, 3),
        ep("ncclGetErrorString", 2, 0),
        ep("ncclGetUniqueId", 2, 0),
        ep("ncclCommInitRank", 2, 0),
        ep("ncclCommInitRankConfig", 2, 14),
        ep("ncclCommDestroy", 2, 0),
        ep("ncclCommFinalize", 2, 14),
        ep("ncclCommAbort", 2, 4),
        ep("ncclCommGetAsyncError", 2, 4),
        ep("ncclCommUserRank", 2, 0),
        ep("ncclCommCount", 2, 0),
        ep("ncclGroupStart", 2, 0),
        ep("ncclGroupEnd", 2, 0),
        ep("ncclSend", 2, 7),
        ep("ncclRecv", 2, 7),
        ep("ncclAllGather", 2, 0),
        ep("ncclAllReduce", 2, 0),
        ep("ncclReduceScatter", 2, 0),
    ],
};

/// cuBLASLt, as `dynlib::cublaslt_sys` forwards to it. These entry points are older than
/// CUDA 13, but the library is built for CUDA 13's cuBLASLt (libcublasLt.so.13, its
/// types and enum values), so that is the release named.
pub const CUBLASLT: Table = Table {
    library: "cuBLASLt",
    release: "CUDA",
    advice: "use that CUDA's cuBLASLt (libcublasLt.so.13 from the CUDA toolkit or the nvidia-cublas wheel; NVTE_COMM_CUBLASLT_LIBRARY or LD_LIBRARY_PATH)",
    entries: &[
        ep("cublasLtGetVersion", 13, 0),
        ep("cublasLtGetStatusName", 13, 0),
        ep("cublasLtCreate", 13, 0),
        ep("cublasLtMatrixLayoutCreate", 13, 0),
        ep("cublasLtMatrixLayoutDestroy", 13, 0),
        ep("cublasLtMatmulDescCreate", 13, 0),
        ep("cublasLtMatmulDescDestroy", 13, 0),
        ep("cublasLtMatmulDescSetAttribute", 13, 0),
        ep("cublasLtMatmulPreferenceCreate", 13, 0),
        ep("cublasLtMatmulPreferenceDestroy", 13, 0),
        ep("cublasLtMatmulPreferenceSetAttribute", 13, 0),
        ep("cublasLtMatmulAlgoGetHeuristic", 13, 0),
        ep("cublasLtMatmul", 13, 0),
    ],
};

/// A table with no entries (a library bound without an entry-point check).
pub const NONE: Table = Table {
    library: "",
    release: "",
    advice: "",
    entries: &[],
};

/// The loaded copy, for messages.
#[derive(Clone, Debug, Default)]
pub struct Loaded {
    /// Its file, where known.
    pub path: Option<String>,
    /// Its version as the library reports it ("CUDA 11.8", "NCCL 2.12.12"), where it can.
    pub version: Option<String>,
}

impl Table {
    /// The entry point called `name`.
    pub fn get(&self, name: &str) -> Option<&'static EntryPoint> {
        self.entries.iter().find(|e| e.name == name)
    }

    /// The newest release any entry point needs: the oldest the library works with.
    pub fn minimum(&self) -> Option<Version> {
        self.entries.iter().map(|e| e.since).max()
    }

    /// The entry points that `resolves` does not find, in table order.
    pub fn missing(&self, mut resolves: impl FnMut(&str) -> bool) -> Vec<&'static EntryPoint> {
        self.entries.iter().filter(|e| !resolves(e.name)).collect()
    }

    /// Ok when `resolves` finds every entry point; else the message naming the library
    /// (`loaded()` is asked only then), each missing entry point with the release that
    /// provides it, and what to do.
    pub fn check(
        &self,
        resolves: impl FnMut(&str) -> bool,
        loaded: impl FnOnce() -> Loaded,
    ) -> Result<(), String> {
        let missing = self.missing(resolves);
        if missing.is_empty() {
            return Ok(());
        }
        Err(self.message(&missing, &loaded()))
    }

    /// The message for `missing` (not empty) in the copy `loaded`.
    pub fn message(&self, missing: &[&EntryPoint], loaded: &Loaded) -> String {
        let what: Vec<&str> = [loaded.path.as_deref(), loaded.version.as_deref()]
            .into_iter()
            .flatten()
            .collect();
        let what = if what.is_empty() {
            String::new()
        } else {
            format!(" ({})", what.join(", "))
        };
        let mut missing = missing.to_vec();
        missing.sort_by_key(|e| e.since);
        let names: Vec<String> = missing
            .iter()
            .map(|e| format!("{} ({} {})", e.name, self.release, e.since))
            .collect();
        let need = missing
            .iter()
            .map(|e| e.since)
            .max()
            .unwrap_or(Version::new(0, 0));
        let n = if missing.len() == 1 {
            "an entry point"
        } else {
            "entry points"
        };
        format!(
            "{}{what} lacks {n} this library calls: {}. This library needs {} {need} or newer: {}",
            self.library,
            names.join(", "),
            self.release,
            self.advice
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_message_names_every_missing_entry_point_and_its_release() {
        // A CUDA 11.8 driver: everything before 12.0 resolves, and one older symbol is
        // absent too (a broken install).
        let resolves = |name: &str| {
            DRIVER.get(name).unwrap().since <= Version::new(11, 8) && name != "cuMemsetD8Async"
        };
        let loaded = || Loaded {
            path: Some("/usr/lib/libcuda.so.1".into()),
            version: Some("CUDA 11.8".into()),
        };
        let msg = DRIVER.check(resolves, loaded).unwrap_err();
        for (name, since) in [
            ("cuMemsetD8Async", "CUDA 3.2"),
            ("cuCtxGetId", "CUDA 12.0"),
            ("cuTensorMapEncodeTiled", "CUDA 12.0"),
            ("cuStreamGetCaptureInfo_v3", "CUDA 12.3"),
            ("cuEventElapsedTime_v2", "CUDA 12.8"),
        ] {
            assert!(msg.contains(&format!("{name} ({since})")), "{name}: {msg}");
        }
        assert!(
            msg.starts_with(
                "the CUDA driver (/usr/lib/libcuda.so.1, CUDA 11.8) lacks entry points"
            ),
            "{msg}"
        );
        assert!(msg.contains("needs CUDA 12.8 or newer"), "{msg}");
        assert!(msg.contains("update the NVIDIA driver"), "{msg}");
        assert!(!msg.contains("cuCtxGetCurrent"), "{msg}");
    }

    #[test]
    fn one_missing_entry_point_reads_in_the_singular_and_loaded_is_asked_only_on_failure() {
        let msg = NCCL
            .check(|n| n != "ncclCommInitRankConfig", Loaded::default)
            .unwrap_err();
        assert_eq!(
            msg,
            format!(
                "NCCL lacks an entry point this library calls: ncclCommInitRankConfig (NCCL 2.14). This library needs NCCL 2.14 or newer: {}",
                NCCL.advice
            )
        );
        let ok = DRIVER.check(|_| true, || panic!("not asked when all resolve"));
        assert!(ok.is_ok());
    }

    #[test]
    fn tables_list_each_entry_point_once_and_the_driver_needs_cuda_12_8() {
        for t in [&DRIVER, &NVRTC, &NCCL, &CUBLASLT] {
            let mut names: Vec<_> = t.entries.iter().map(|e| e.name).collect();
            names.sort();
            let n = names.len();
            names.dedup();
            assert_eq!(n, names.len(), "{} lists an entry point twice", t.library);
        }
        assert_eq!(DRIVER.minimum(), Some(Version::new(12, 8)));
        assert_eq!(NCCL.minimum(), Some(Version::new(2, 14)));
        assert_eq!(Version::of_cuda_code(12080).to_string(), "12.8");
        assert_eq!(Version::of_cuda_code(11040).to_string(), "11.4");
    }
}
