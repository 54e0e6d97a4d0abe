//! The entry points of the run-time-loaded libraries (`src/cuda/entry_points.rs`):
//! the tables cover every call the source makes, and a CUDA driver too old for the
//! library is named, with what it lacks, instead of panicking at a missing symbol. The
//! driver case runs without a GPU: a stub libcuda (built here with `cc`) that reports
//! CUDA 11.8 and exports only what CUDA 11.8 has is put first on LD_LIBRARY_PATH of a
//! child process (this test binary again), which calls the library.
mod common;
use common::rs_files;
use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;
use transformer_engine_comm::cuda::entry_points::{self, Table, Version};

/// The source of src/ without `//` comments.
fn source() -> Vec<(String, String)> {
    let mut files = Vec::new();
    rs_files(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("src"),
        &mut files,
    );
    files
        .into_iter()
        .map(|f| {
            let code = common::code_without_comments(&f);
            (f.display().to_string(), code)
        })
        .collect()
}

/// The names `<module>::<name>` in `code` where `<module>` is one of `modules`, `<name>`
/// starts with `prefix` and an upper-case letter, and (when `call`) `(` follows.
fn named(code: &str, modules: &[&str], prefix: &str, call: bool) -> Vec<String> {
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let mut out = Vec::new();
    for (i, _) in code.match_indices("::") {
        let before = code[..i].trim_end_matches(|c: char| c.is_whitespace());
        let module_start = before.rfind(|c: char| !ident(c)).map_or(0, |j| j + 1);
        if !modules.contains(&&before[module_start..]) {
            continue;
        }
        let rest = &code[i + 2..];
        let end = rest.find(|c: char| !ident(c)).unwrap_or(rest.len());
        let name = &rest[..end];
        let upper_next = name[prefix.len().min(name.len())..]
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_uppercase());
        if !name.starts_with(prefix) || !upper_next {
            continue;
        }
        if call && !rest[end..].trim_start().starts_with('(') {
            continue;
        }
        out.push(name.to_string());
    }
    out
}

/// Every name the source uses is in `table`, and every one in `table` is used.
fn table_matches_source(table: &Table, used: BTreeSet<String>) {
    let listed: BTreeSet<String> = table.entries.iter().map(|e| e.name.into()).collect();
    let unlisted: Vec<_> = used.difference(&listed).collect();
    assert!(
        unlisted.is_empty(),
        "{} entry points called but not in src/cuda/entry_points.rs (add each with the release that introduced it): {unlisted:?}",
        table.library
    );
    let unused: Vec<_> = listed.difference(&used).collect();
    assert!(
        unused.is_empty(),
        "{} entry points in src/cuda/entry_points.rs that nothing calls (remove them: they raise the minimum): {unused:?}",
        table.library
    );
}

#[test]
fn every_driver_and_nvrtc_call_is_in_the_tables() {
    let (mut driver, mut nvrtc) = (BTreeSet::new(), BTreeSet::new());
    for (_, code) in source() {
        // The driver: cudarc's `driver::sys`, imported as `cu` (or spelled out).
        driver.extend(named(&code, &["cu", "sys"], "cu", false));
        nvrtc.extend(named(&code, &["nv", "sys"], "nvrtc", true));
    }
    assert!(
        driver.contains("cuCtxGetId") && driver.len() > 40,
        "{driver:?}"
    );
    assert!(nvrtc.contains("nvrtcGetCUBIN"), "{nvrtc:?}");
    table_matches_source(&entry_points::DRIVER, driver);
    table_matches_source(&entry_points::NVRTC, nvrtc);
}

#[test]
fn the_scanner_finds_calls_and_skips_types() {
    let code = "unsafe { cu::cuCtxGetId(c, &mut id) }; let s: cu::CUresult = x; \
                cudarc::driver::sys::cuMemsetD8Async (p, 0, n, s); cu::cuuint64_t; \
                nv::nvrtcResult::NVRTC_SUCCESS; nv::nvrtcVersion(&mut a, &mut b); lt::cuNot(";
    assert_eq!(
        named(code, &["cu", "sys"], "cu", false),
        ["cuCtxGetId", "cuMemsetD8Async"]
    );
    assert_eq!(named(code, &["nv"], "nvrtc", true), ["nvrtcVersion"]);
}

const CHILD: &str = "TE_COMM_ENTRY_POINTS_CHILD";
/// The CUDA version the stub driver reports (and the newest whose entry points it has).
const STUB_VERSION: Version = Version::new(11, 8);

/// C source of a libcuda that reports CUDA 11.8 and exports every entry point of the
/// table that CUDA 11.8 has (each returning CUDA_SUCCESS), none of the newer ones.
fn stub_source() -> String {
    let mut c = String::from(
        "int cuDriverGetVersion(int *v) { *v = 11080; return 0; }\n\
         int cuDeviceGetCount(int *n) { *n = 0; return 0; }\n",
    );
    for e in entry_points::DRIVER.entries {
        if e.since <= STUB_VERSION && !c.contains(&format!(" {}(", e.name)) {
            c += &format!("int {}(void) {{ return 0; }}\n", e.name);
        }
    }
    c
}

/// The driver too old: nvte_comm_check_runtime and nvte_comm_device_count report it
/// (status LIBRARY_NOT_FOUND, the message naming each missing entry point and the CUDA
/// version it needs), and a context guard (every call on a stream enters one) fails
/// with the same message instead of panicking at cuCtxGetId. Checked twice: the answer
/// is cached.
#[test]
fn a_driver_too_old_is_named_with_what_it_lacks() {
    if std::env::var_os(CHILD).is_some() {
        return child();
    }
    let dir = std::env::temp_dir().join(format!("te_comm_old_driver_{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let src = dir.join("libcuda_stub.c");
    std::fs::write(&src, stub_source()).unwrap();
    // cudarc tries "libcuda.so" first, then versioned names; LD_LIBRARY_PATH comes
    // before the system's directories, so the stub is loaded even where a driver is.
    let st = Command::new("cc")
        .args(["-shared", "-fPIC", "-o"])
        .arg(dir.join("libcuda.so"))
        .arg(&src)
        .status()
        .expect("cc (a C compiler) is needed to build the stub CUDA driver");
    assert!(st.success());
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "a_driver_too_old_is_named_with_what_it_lacks",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD, &dir)
        .env("LD_LIBRARY_PATH", &dir)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "child failed:\n{text}");
    assert!(text.contains("1 passed"), "the child ran no test:\n{text}");
    let _ = std::fs::remove_dir_all(&dir);
}

unsafe extern "C" {
    fn nvte_comm_check_runtime() -> transformer_engine_comm::ffi::NVTECommStatus;
    fn nvte_comm_device_count() -> i32;
    fn nvte_comm_last_error() -> *const std::ffi::c_char;
    fn nvte_comm_last_status() -> transformer_engine_comm::ffi::NVTECommStatus;
}

fn last_error() -> String {
    // SAFETY: a NUL-terminated string valid until this thread's next library call.
    unsafe { std::ffi::CStr::from_ptr(nvte_comm_last_error()) }
        .to_string_lossy()
        .into_owned()
}

fn assert_names_what_is_missing(msg: &str, dir: &str) {
    let missing: Vec<_> = entry_points::DRIVER
        .entries
        .iter()
        .filter(|e| e.since > STUB_VERSION)
        .collect();
    assert!(missing.len() >= 4, "{missing:?}");
    for e in &missing {
        assert!(
            msg.contains(&format!("{} (CUDA {})", e.name, e.since)),
            "{}: {msg}",
            e.name
        );
    }
    let need = entry_points::DRIVER.minimum().unwrap();
    for want in [
        "the CUDA driver (",
        dir,
        "supports CUDA 11.8) lacks entry points this library calls: ",
        &format!("This library needs CUDA {need} or newer: update the NVIDIA driver"),
    ] {
        assert!(msg.contains(want), "lacks {want:?}: {msg}");
    }
    assert!(!msg.contains("cuCtxGetCurrent"), "{msg}");
    assert!(!msg.contains("panic"), "{msg}");
}

/// In the child process, with the stub first on the search path.
fn child() {
    use transformer_engine_comm::cuda::{self, ContextGuard, Lib, StreamHandle};
    use transformer_engine_comm::ffi::NVTECommStatus as S;
    let dir = std::env::var(CHILD).unwrap();
    for _ in 0..2 {
        // SAFETY: C entry points without arguments.
        let s = unsafe { nvte_comm_check_runtime() };
        let msg = last_error();
        println!("nvte_comm_check_runtime: {s}: {msg}");
        assert_eq!(s, S::NVTE_COMM_ERROR_LIBRARY_NOT_FOUND, "{msg}");
        assert!(msg.starts_with("nvte_comm_check_runtime: "), "{msg}");
        assert_names_what_is_missing(&msg, &dir);

        // SAFETY: as above.
        assert_eq!(unsafe { nvte_comm_device_count() }, 0);
        // SAFETY: as above.
        assert_eq!(
            unsafe { nvte_comm_last_status() },
            S::NVTE_COMM_ERROR_LIBRARY_NOT_FOUND
        );
        assert_names_what_is_missing(&last_error(), &dir);
    }
    let e = ContextGuard::for_stream(StreamHandle::NULL)
        .err()
        .expect("no context without a usable driver");
    assert_eq!(
        e.kind,
        transformer_engine_comm::error::ErrorKind::LibraryNotFound
    );
    assert_names_what_is_missing(&e.msg, &dir);
    assert!(cuda::library_info(Lib::Driver).is_err());
    // Releases in Drops relax the capture mode only with a usable driver: no call.
    drop(cuda::resources::RelaxedCapture::new());
}
