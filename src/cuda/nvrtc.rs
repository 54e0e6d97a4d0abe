//! Run-time kernel compilation. `kernels/*.cu` are embedded in the library, compiled
//! with NVRTC for the exact architecture of the device (sm_90a on Hopper) once per
//! process, cached on disk (by source, options, architecture and NVRTC version), and
//! loaded once per CUDA context.
use super::{DeviceInfo, Lib, check, require};
use crate::error::ErrorKind as K;
use crate::error::{Error, Result};
use cudarc::driver::sys as cu;
use cudarc::nvrtc::sys as nv;
use std::collections::HashMap;
use std::ffi::{CString, c_char};
use std::hash::{Hash, Hasher};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

/// A kernel source file shipped in `kernels/`.
#[derive(Clone, Copy, Debug)]
pub struct Source {
    pub name: &'static str,
    pub code: &'static str,
}

pub const CAST: Source = Source {
    name: "cast.cu",
    code: include_str!("../../kernels/cast.cu"),
};
/// Headers every kernel source may include, given to NVRTC in memory.
pub const HEADERS: &[(&str, &str)] = &[("types.cuh", include_str!("../../kernels/types.cuh"))];

pub const COMM: Source = Source {
    name: "comm.cu",
    code: include_str!("../../kernels/comm.cu"),
};

/// Our own persistent Hopper GEMM (issue 22): the fused (atomic) comm-GEMM algorithms'
/// GEMM (`gemm::sm90`), benchmarked by bench/own_gemm.cpp. The library compiles only the
/// plain kernels it launches (the file's feature kernels, 54 of its 62, would make the
/// first fused call's compile about 30 s instead of about 3; host, 2026-11-26).
pub const GEMM_SM90: Source = Source {
    name: "gemm_sm90.cu",
    code: concat!(
        "#define GEMM90_NO_EPI 1\n#define GEMM90_NO_FPACC 1\n#define GEMM90_NO_NN_NT 1\n",
        include_str!("../../kernels/gemm_sm90.cu")
    ),
};

/// The whole of kernels/gemm_sm90.cu, every feature kernel included (the kernel test
/// compiles it; bench/own_gemm.cpp runs it).
pub const GEMM_SM90_ALL: Source = Source {
    name: "gemm_sm90.cu",
    code: include_str!("../../kernels/gemm_sm90.cu"),
};

fn nvrtc_check(r: nv::nvrtcResult, call: &str) -> Result<()> {
    if r == nv::nvrtcResult::NVRTC_SUCCESS {
        return Ok(());
    }
    // SAFETY: returns a static string.
    let s = unsafe { std::ffi::CStr::from_ptr(nv::nvrtcGetErrorString(r)) }
        .to_string_lossy()
        .into_owned();
    Err(Error::new(K::Nvrtc, format!("{call} failed: {s}")))
}

fn nvrtc_version() -> Result<(i32, i32)> {
    let (mut a, mut b) = (0, 0);
    // SAFETY: out pointers.
    nvrtc_check(unsafe { nv::nvrtcVersion(&mut a, &mut b) }, "nvrtcVersion")?;
    Ok((a, b))
}

fn options(arch: &str) -> Vec<String> {
    vec![
        format!("--gpu-architecture={arch}"),
        "--std=c++17".into(),
        "--device-as-default-execution-space".into(),
        "-lineinfo".into(),
    ]
}

/// The disk cache's folder: None when NVTE_COMM_DISABLE_KERNEL_CACHE is true (a value
/// that is not a boolean is an error) or no folder is known.
pub(crate) fn cache_dir() -> Result<Option<PathBuf>> {
    if crate::env::flag("NVTE_COMM_DISABLE_KERNEL_CACHE")?.unwrap_or(false) {
        return Ok(None);
    }
    if let Some(d) = crate::env::os("NVTE_COMM_CACHE_DIR") {
        return Ok(Some(PathBuf::from(d)));
    }
    if let Some(d) = crate::env::os("XDG_CACHE_HOME") {
        return Ok(Some(PathBuf::from(d).join("transformer_engine_comm")));
    }
    Ok(crate::env::os("HOME").map(|h| {
        PathBuf::from(h)
            .join(".cache")
            .join("transformer_engine_comm")
    }))
}

/// Compiled cubins of this process by (source name, arch).
type CubinMemo = HashMap<(String, String), Arc<Vec<u8>>>;

/// Compile `src` for `arch` to a cubin (from the disk cache when present).
pub fn compile(src: &Source, arch: &str) -> Result<Arc<Vec<u8>>> {
    static MEMO: Mutex<Option<CubinMemo>> = Mutex::new(None);
    let key = (src.name.to_string(), arch.to_string());
    if let Some(c) = MEMO
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get_or_insert_with(HashMap::new)
        .get(&key)
    {
        return Ok(c.clone());
    }
    let dir = cache_dir()?;
    require(Lib::Nvrtc)?;
    let ver = nvrtc_version()?;
    let opts = options(arch);
    let mut h = std::collections::hash_map::DefaultHasher::new();
    (src.code, HEADERS, &opts, ver, env!("CARGO_PKG_VERSION")).hash(&mut h);
    let file = dir.map(|d| {
        d.join(format!(
            "{}-{arch}-{:016x}.cubin",
            src.name.trim_end_matches(".cu"),
            h.finish()
        ))
    });
    let cubin = match file
        .as_ref()
        .and_then(|f| std::fs::read(f).ok())
        .filter(|b| !b.is_empty())
    {
        Some(b) => b,
        None => {
            let b = compile_uncached(src, &opts)?;
            if let Some(f) = &file {
                // Best effort: a read-only home just means no disk cache.
                let _ = std::fs::create_dir_all(f.parent().unwrap());
                let tmp = f.with_extension(format!("tmp{}", std::process::id()));
                if std::fs::write(&tmp, &b).is_ok() {
                    let _ = std::fs::rename(&tmp, f);
                }
            }
            b
        }
    };
    let cubin = Arc::new(cubin);
    MEMO.lock()
        .unwrap_or_else(|e| e.into_inner())
        .get_or_insert_with(HashMap::new)
        .insert(key, cubin.clone());
    Ok(cubin)
}

/// Compile `src` for `arch` now, bypassing both caches.
pub fn compile_fresh(src: &Source, arch: &str) -> Result<Vec<u8>> {
    require(Lib::Nvrtc)?;
    compile_uncached(src, &options(arch))
}

fn compile_uncached(src: &Source, opts: &[String]) -> Result<Vec<u8>> {
    let code = CString::new(src.code).map_err(|_| Error::internal("kernel source contains NUL"))?;
    let name = CString::new(src.name).unwrap();
    let hdr_code: Vec<CString> = HEADERS
        .iter()
        .map(|(_, c)| CString::new(*c).unwrap())
        .collect();
    let hdr_name: Vec<CString> = HEADERS
        .iter()
        .map(|(n, _)| CString::new(*n).unwrap())
        .collect();
    let hdr_code_ptrs: Vec<*const c_char> = hdr_code.iter().map(|c| c.as_ptr()).collect();
    let hdr_name_ptrs: Vec<*const c_char> = hdr_name.iter().map(|c| c.as_ptr()).collect();
    let mut prog: nv::nvrtcProgram = std::ptr::null_mut();
    // SAFETY: valid C strings; the header arrays have HEADERS.len() entries each.
    nvrtc_check(
        unsafe {
            nv::nvrtcCreateProgram(
                &mut prog,
                code.as_ptr(),
                name.as_ptr(),
                HEADERS.len() as i32,
                hdr_code_ptrs.as_ptr(),
                hdr_name_ptrs.as_ptr(),
            )
        },
        "nvrtcCreateProgram",
    )?;
    let copts: Vec<CString> = opts
        .iter()
        .map(|o| CString::new(o.as_str()).unwrap())
        .collect();
    let ptrs: Vec<*const c_char> = copts.iter().map(|c| c.as_ptr()).collect();
    // SAFETY: prog is valid; options are valid C strings.
    let r = unsafe { nv::nvrtcCompileProgram(prog, ptrs.len() as i32, ptrs.as_ptr()) };
    let result = (|| {
        if r != nv::nvrtcResult::NVRTC_SUCCESS {
            let mut n = 0usize;
            // SAFETY: prog valid, buffers sized from the size query.
            unsafe { nv::nvrtcGetProgramLogSize(prog, &mut n) };
            let mut log = vec![0u8; n.max(1)];
            unsafe { nv::nvrtcGetProgramLog(prog, log.as_mut_ptr() as *mut c_char) };
            let log = String::from_utf8_lossy(&log)
                .trim_end_matches('\0')
                .to_string();
            return Err(Error::new(
                K::Nvrtc,
                format!(
                    "compiling kernels/{} with options {opts:?} failed:\n{log}",
                    src.name
                ),
            ));
        }
        let mut n = 0usize;
        // SAFETY: prog compiled; buffer sized from the query.
        nvrtc_check(
            unsafe { nv::nvrtcGetCUBINSize(prog, &mut n) },
            "nvrtcGetCUBINSize",
        )?;
        let mut bin = vec![0u8; n];
        nvrtc_check(
            unsafe { nv::nvrtcGetCUBIN(prog, bin.as_mut_ptr() as *mut c_char) },
            "nvrtcGetCUBIN",
        )?;
        Ok(bin)
    })();
    // SAFETY: destroys the program created above.
    unsafe { nv::nvrtcDestroyProgram(&mut prog) };
    result
}

/// A module loaded into one context, with its functions looked up once.
pub struct Module {
    module: usize,
    funcs: Mutex<HashMap<String, usize>>,
    /// the id of the context it is loaded in ([`super::ContextGuard::id`])
    pub ctx: u64,
}

impl Module {
    pub fn function(&self, name: &str) -> Result<cu::CUfunction> {
        let mut g = self.funcs.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(&f) = g.get(name) {
            return Ok(f as cu::CUfunction);
        }
        let cname = CString::new(name).unwrap();
        let mut f: cu::CUfunction = std::ptr::null_mut();
        // SAFETY: module is loaded; out pointer.
        check(
            unsafe { cu::cuModuleGetFunction(&mut f, self.module as cu::CUmodule, cname.as_ptr()) },
            &format!("cuModuleGetFunction({name})"),
        )?;
        g.insert(name.to_string(), f as usize);
        Ok(f)
    }
}

impl Module {
    /// The device address and size of the module's global `name` (a `__constant__` or
    /// `__device__` variable of the source).
    pub fn global(&self, name: &str) -> Result<(super::DevPtr, usize)> {
        let cname = CString::new(name)
            .map_err(|_| Error::internal(format!("global name {name:?} has a NUL byte")))?;
        let (mut p, mut n): (cu::CUdeviceptr, usize) = (0, 0);
        // SAFETY: module is loaded; out pointers.
        check(
            unsafe {
                cu::cuModuleGetGlobal_v2(
                    &mut p,
                    &mut n,
                    self.module as cu::CUmodule,
                    cname.as_ptr(),
                )
            },
            &format!("cuModuleGetGlobal({name})"),
        )?;
        Ok((super::DevPtr::new(p), n))
    }
}

/// Loaded modules by (context id, source name).
type LoadedModules = HashMap<(u64, &'static str), Arc<Module>>;

/// The module for `src` in the current context, whose id ([`super::ContextGuard::id`])
/// is `ctx`, on device `dev`.
pub fn module(src: &Source, ctx: u64, dev: &DeviceInfo) -> Result<Arc<Module>> {
    static LOADED: Mutex<Option<LoadedModules>> = Mutex::new(None);
    let key = (ctx, src.name);
    if let Some(m) = LOADED
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get_or_insert_with(HashMap::new)
        .get(&key)
    {
        return Ok(m.clone());
    }
    let cubin = compile(src, &dev.nvrtc_arch())?;
    let mut m: cu::CUmodule = std::ptr::null_mut();
    // SAFETY: cubin is a complete image for this device's architecture.
    check(
        unsafe { cu::cuModuleLoadData(&mut m, cubin.as_ptr() as *const _) },
        &format!("cuModuleLoadData(kernels/{})", src.name),
    )?;
    let module = Arc::new(Module {
        module: m as usize,
        funcs: Mutex::new(HashMap::new()),
        ctx,
    });
    LOADED
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get_or_insert_with(HashMap::new)
        .insert(key, module.clone());
    Ok(module)
}
