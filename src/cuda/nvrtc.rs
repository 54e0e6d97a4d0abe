//! Run-time kernel compilation. `kernels/*.cu` are embedded in the library, compiled
//! with NVRTC for the exact architecture of the device (sm_90a on Hopper) once per
//! process, cached on disk (by source, options, architecture and NVRTC version), and
//! loaded once per CUDA context.
use super::{CtxId, DeviceInfo, FunctionHandle, Lib, ModuleHandle, check, require};
use crate::error::ErrorKind as K;
use crate::error::{Error, Result};
use cudarc::driver::sys as cu;
use cudarc::nvrtc::sys as nv;
use std::collections::HashMap;
use std::ffi::{CString, c_char};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
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
        "#define GEMM90_NO_BLOCK 1\n",
        include_str!("../../kernels/gemm_sm90.cu")
    ),
};

/// The `_block` kernels of kernels/gemm_sm90.cu alone (block-scaled FP8,
/// NVTE_COMM_BLOCK_GEMM=own / auto): a module of their own, compiled and loaded only when
/// a block-scaled GEMM asks for our kernel, so [`GEMM_SM90`]'s users pay nothing for them.
pub const GEMM_SM90_BLOCK: Source = Source {
    name: "gemm_sm90.cu",
    code: concat!(
        "#define GEMM90_NO_EPI 1\n#define GEMM90_NO_FPACC 1\n#define GEMM90_NO_NN_NT 1\n",
        "#define GEMM90_NO_PLAIN 1\n",
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
pub fn cache_dir() -> Result<Option<PathBuf>> {
    if crate::env::DISABLE_KERNEL_CACHE.get()?.unwrap_or(false) {
        return Ok(None);
    }
    if let Some(d) = crate::env::CACHE_DIR.get() {
        return Ok(Some(PathBuf::from(d)));
    }
    if let Some(d) = crate::env::XDG_CACHE_HOME.get() {
        return Ok(Some(PathBuf::from(d).join("transformer_engine_comm")));
    }
    Ok(crate::env::HOME.get().map(|h| {
        PathBuf::from(h)
            .join(".cache")
            .join("transformer_engine_comm")
    }))
}

/// A stable 128-bit FNV-1a hash of `parts`, each length-prefixed (so that no two lists of
/// parts hash the same stream): the disk cache's key, the same across builds and Rust
/// versions (std's `DefaultHasher` is not).
fn content_hash(parts: &[&[u8]]) -> u128 {
    const PRIME: u128 = 0x0000_0000_0100_0000_0000_0000_0000_013B;
    let mut h: u128 = 0x6c62_272e_07bb_0142_62b8_2175_6295_c58d;
    for part in parts {
        for &b in (part.len() as u64).to_le_bytes().iter().chain(part.iter()) {
            h = (h ^ u128::from(b)).wrapping_mul(PRIME);
        }
    }
    h
}

/// The hash of everything NVRTC compiles for `src` with `opts` (its full text, defines
/// included, and the headers), NVRTC's version and the library's version.
fn program_hash(src: &Source, opts: &[String], ver: (i32, i32)) -> u128 {
    let mut parts: Vec<&[u8]> = vec![src.name.as_bytes(), src.code.as_bytes()];
    for (name, code) in HEADERS {
        parts.extend([name.as_bytes(), code.as_bytes()]);
    }
    parts.extend(opts.iter().map(|o| o.as_bytes()));
    let ver = [ver.0.to_le_bytes(), ver.1.to_le_bytes()].concat();
    parts.extend([&ver[..], env!("CARGO_PKG_VERSION").as_bytes()]);
    content_hash(&parts)
}

/// Whether `b` is a whole 64-bit ELF image: the magic, and the section header table
/// (which NVRTC writes last) inside the file, so an empty or cut-short file is not.
fn is_whole_elf(b: &[u8]) -> bool {
    let field = |at: usize, n: usize| -> Option<u64> {
        let mut v = [0u8; 8];
        v[..n].copy_from_slice(b.get(at..at + n)?);
        Some(u64::from_le_bytes(v))
    };
    if b.len() < 64 || &b[..4] != b"\x7fELF" || b[4] != 2 || b[5] != 1 {
        return false;
    }
    match (field(0x28, 8), field(0x3A, 2), field(0x3C, 2)) {
        (Some(shoff), Some(shentsize), Some(shnum)) => shoff
            .checked_add(shentsize.saturating_mul(shnum))
            .is_some_and(|end| shnum > 0 && end <= b.len() as u64),
        _ => false,
    }
}

/// The cached cubin in `file`: None when it is missing, unreadable or not a whole ELF
/// image (a miss: the caller compiles and rewrites it).
fn read_cached(file: &Path) -> Option<Vec<u8>> {
    std::fs::read(file).ok().filter(|b| is_whole_elf(b))
}

/// Store `bytes` as the cache file `file` (compiled kernels, the autotuner's choices),
/// best effort (a read-only or full disk just means no cache): written to a name of its
/// own (process and call) and renamed into place, so readers and concurrent writers, in
/// this process or another, see a whole file or none.
pub fn write_cached(file: &Path, bytes: &[u8]) {
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let Some(dir) = file.parent() else { return };
    let _ = std::fs::create_dir_all(dir);
    let seq = SEQ.fetch_add(1, Ordering::Relaxed);
    let tmp = file.with_extension(format!("tmp.{}.{seq}", std::process::id()));
    if std::fs::write(&tmp, bytes).is_err() || std::fs::rename(&tmp, file).is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
}

/// Compile `src` for `arch` through the disk cache folder `dir` (None: no disk cache),
/// without the in-process memo of [`compile`]: the cubin, and whether it came from the
/// cache. A miss is a real NVRTC compilation, stored for the next process.
pub fn compile_cached(src: &Source, arch: &str, dir: Option<&Path>) -> Result<(Vec<u8>, bool)> {
    require(Lib::Nvrtc)?;
    let opts = options(arch);
    let hash = program_hash(src, &opts, nvrtc_version()?);
    let stem = src.name.trim_end_matches(".cu");
    let file = dir.map(|d| d.join(format!("{stem}-{arch}-{hash:032x}.cubin")));
    if let Some(b) = file.as_deref().and_then(read_cached) {
        return Ok((b, true));
    }
    let b = compile_uncached(src, &opts)?;
    if let Some(f) = &file {
        write_cached(f, &b);
    }
    Ok((b, false))
}

/// The content hash of `src`'s text and the headers, computed once per copy of the text:
/// the identity of a program in the in-process caches. Not its address: a `const` source
/// may sit at several addresses in the binary (one copy per use site), and two sources of
/// one name (GEMM_SM90, GEMM_SM90_ALL) differ in content.
fn source_id(src: &Source) -> u128 {
    static IDS: Mutex<Option<HashMap<(usize, usize), u128>>> = Mutex::new(None);
    let at = (src.code.as_ptr() as usize, src.code.len());
    let mut ids = IDS.lock().unwrap_or_else(|e| e.into_inner());
    *ids.get_or_insert_with(HashMap::new)
        .entry(at)
        .or_insert_with(|| {
            let hdrs: Vec<&[u8]> = HEADERS.iter().map(|(_, c)| c.as_bytes()).collect();
            content_hash(&[src.code.as_bytes(), &hdrs.concat()])
        })
}

/// Compiled cubins of this process by (source name, [`source_id`], arch): two sources of
/// one name (GEMM_SM90, GEMM_SM90_ALL) are two entries.
type CubinMemo = HashMap<(&'static str, u128, String), Arc<Vec<u8>>>;

/// Compile `src` for `arch` to a cubin (once per process; from the disk cache when present).
pub fn compile(src: &Source, arch: &str) -> Result<Arc<Vec<u8>>> {
    static MEMO: Mutex<Option<CubinMemo>> = Mutex::new(None);
    let key = (src.name, source_id(src), arch.to_string());
    if let Some(c) = MEMO
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get_or_insert_with(HashMap::new)
        .get(&key)
    {
        return Ok(c.clone());
    }
    let (cubin, _) = compile_cached(src, arch, cache_dir()?.as_deref())?;
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
    module: ModuleHandle,
    funcs: Mutex<HashMap<String, FunctionHandle>>,
    /// the id of the context it is loaded in ([`super::ContextGuard::id`])
    pub ctx: CtxId,
}

impl Module {
    pub fn function(&self, name: &str) -> Result<cu::CUfunction> {
        let mut g = self.funcs.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(&f) = g.get(name) {
            return Ok(f.raw());
        }
        let cname = CString::new(name).unwrap();
        let mut f: cu::CUfunction = std::ptr::null_mut();
        // SAFETY: module is loaded; out pointer.
        check(
            unsafe { cu::cuModuleGetFunction(&mut f, self.module.raw(), cname.as_ptr()) },
            &format!("cuModuleGetFunction({name})"),
        )?;
        g.insert(name.to_string(), FunctionHandle::from_raw(f));
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
            unsafe { cu::cuModuleGetGlobal_v2(&mut p, &mut n, self.module.raw(), cname.as_ptr()) },
            &format!("cuModuleGetGlobal({name})"),
        )?;
        Ok((super::DevPtr::new(p), n))
    }
}

/// Loaded modules by (context id, source name, [`source_id`]): two sources of one name
/// (GEMM_SM90, GEMM_SM90_ALL) are two modules, and every copy of one source's text is one.
type LoadedModules = HashMap<(CtxId, &'static str, u128), Arc<Module>>;

/// The module for `src` in the current context, whose id ([`super::ContextGuard::id`])
/// is `ctx`, on device `dev`.
pub fn module(src: &Source, ctx: CtxId, dev: &DeviceInfo) -> Result<Arc<Module>> {
    static LOADED: Mutex<Option<LoadedModules>> = Mutex::new(None);
    let key = (ctx, src.name, source_id(src));
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
        module: ModuleHandle::from_raw(m),
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A minimal 64-bit little-endian ELF image: a header and one section header.
    fn elf() -> Vec<u8> {
        let mut b = vec![0u8; 128];
        b[..6].copy_from_slice(b"\x7fELF\x02\x01");
        b[0x28..0x30].copy_from_slice(&64u64.to_le_bytes()); // e_shoff
        b[0x3A..0x3C].copy_from_slice(&64u16.to_le_bytes()); // e_shentsize
        b[0x3C..0x3E].copy_from_slice(&1u16.to_le_bytes()); // e_shnum
        b
    }

    #[test]
    fn cache_keys_tell_sources_options_and_versions_apart() {
        let opts = options("sm_90a");
        let base = program_hash(&GEMM_SM90, &opts, (13, 0));
        assert_eq!(base, program_hash(&GEMM_SM90, &opts, (13, 0)));
        assert_ne!(base, program_hash(&GEMM_SM90_ALL, &opts, (13, 0)));
        assert_ne!(base, program_hash(&GEMM_SM90, &options("sm_100a"), (13, 0)));
        assert_ne!(base, program_hash(&GEMM_SM90, &opts, (13, 1)));
        // Length prefixes: moving a byte between parts changes the hash.
        assert_ne!(content_hash(&[b"ab", b"c"]), content_hash(&[b"a", b"bc"]));
    }

    #[test]
    fn a_source_is_known_by_its_content_not_its_address() {
        // Two copies of one text at two addresses: one program.
        let copy: &'static str = Box::leak(COMM.code.to_string().into_boxed_str());
        assert_ne!(copy.as_ptr(), COMM.code.as_ptr());
        let twin = Source {
            name: COMM.name,
            code: copy,
        };
        assert_eq!(source_id(&COMM), source_id(&twin));
        // One name, two texts: two programs.
        assert_ne!(source_id(&GEMM_SM90), source_id(&GEMM_SM90_ALL));
    }

    #[test]
    fn empty_cut_short_or_foreign_cache_entries_are_misses() {
        let whole = elf();
        assert!(is_whole_elf(&whole));
        assert!(!is_whole_elf(&[]));
        assert!(!is_whole_elf(&whole[..100]));
        assert!(!is_whole_elf(
            b"not a cubin, just some text of sixty-four bytes or more......"
        ));
        let dir = std::env::temp_dir().join(format!("te_comm_nvrtc_{}", std::process::id()));
        let file = dir.join("k-sm_90a-0.cubin");
        assert_eq!(read_cached(&file), None);
        write_cached(&file, &whole);
        assert_eq!(read_cached(&file).as_deref(), Some(&whole[..]));
        std::fs::write(&file, b"").unwrap();
        assert_eq!(read_cached(&file), None);
        std::fs::write(&file, &whole[..70]).unwrap();
        assert_eq!(read_cached(&file), None);
        let left: Vec<_> = std::fs::read_dir(&dir).unwrap().flatten().collect();
        assert_eq!(left.len(), 1, "no temporary file is left behind");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
