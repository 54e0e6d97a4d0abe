//! NVTX ranges (`NVTE_COMM_NVTX=1`), so that Nsight Systems shows each call and each
//! step of the overlap on the timeline, without a build-time dependency: this is the
//! client side of NVTX v3's injection protocol, which the profiler drives. A tool that
//! wants NVTX events sets `NVTX_INJECTION64_PATH` to its injection library; the client
//! loads it and calls its `InitializeInjectionNvtx2(get_export_table)`, and the tool
//! fills the client's function-pointer slots through the callback export table
//! (`GetModuleFunctionTable`: per module, an array of pointers to the slots, indexed by
//! callback id). Slots the tool leaves empty stay no-ops; without a tool (or with
//! `NVTE_COMM_NVTX` unset) nothing is loaded and every call is a branch on a flag.
use std::ffi::{CString, c_char, c_int, c_uint, c_void};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};

// Export table ids and callback modules (NVTX v3, nvtxTypes.h).
const ETID_CALLBACKS: u32 = 1;
const ETID_VERSIONINFO: u32 = 3;
const NVTX_VERSION: u32 = 3;
/// Slots per module, index 0 unused (NVTX_CBID_<module>_SIZE), for modules 1..=6:
/// CORE, CUDA, OPENCL, CUDART, CORE2, SYNC. A tool may ask for any of them.
const MODULE_SIZES: [usize; 6] = [16, 9, 15, 7, 16, 7];
// CORE callback ids used here.
const CBID_MARK_A: usize = 2;
const CBID_RANGE_PUSH_A: usize = 9;
const CBID_RANGE_POP: usize = 11;

/// The slots a tool writes its functions into (one array per module; unused ones too).
static SLOTS: [[AtomicUsize; 17]; 6] = [const { [const { AtomicUsize::new(0) }; 17] }; 6];

/// The per-module tables handed to the tool: pointers to the slots, 0 first and last.
struct Tables([[usize; 18]; 6]);
static TABLES: OnceLock<Tables> = OnceLock::new();

#[repr(C)]
struct ExportTableCallbacks {
    struct_size: usize,
    get_module_function_table: unsafe extern "C" fn(u32, *mut *const usize, *mut c_uint) -> c_int,
}

#[repr(C)]
struct ExportTableVersionInfo {
    struct_size: usize,
    version: u32,
    reserved0: u32,
    set_injection_nvtx_version: unsafe extern "C" fn(u32),
}

static CALLBACKS: ExportTableCallbacks = ExportTableCallbacks {
    struct_size: std::mem::size_of::<ExportTableCallbacks>(),
    get_module_function_table,
};
static VERSION_INFO: ExportTableVersionInfo = ExportTableVersionInfo {
    struct_size: std::mem::size_of::<ExportTableVersionInfo>(),
    version: NVTX_VERSION,
    reserved0: 0,
    set_injection_nvtx_version,
};

unsafe extern "C" fn set_injection_nvtx_version(_v: u32) {}

unsafe extern "C" fn get_module_function_table(
    module: u32,
    out_table: *mut *const usize,
    out_size: *mut c_uint,
) -> c_int {
    let Some(t) = TABLES.get() else { return 0 };
    let m = module as usize;
    if m == 0 || m > MODULE_SIZES.len() {
        return 0;
    }
    if !out_size.is_null() {
        // SAFETY: the tool's out-pointer.
        unsafe { *out_size = MODULE_SIZES[m - 1] as c_uint };
    }
    if !out_table.is_null() {
        // SAFETY: as above; the table is static.
        unsafe { *out_table = t.0[m - 1].as_ptr() };
    }
    1
}

/// The per-module tables (built once): entry i of module m points to slot i.
fn tables() -> &'static Tables {
    TABLES.get_or_init(|| {
        let mut t = [[0usize; 18]; 6];
        for (m, size) in MODULE_SIZES.iter().enumerate() {
            for (i, p) in t[m].iter_mut().enumerate().take(*size).skip(1) {
                *p = &SLOTS[m][i] as *const AtomicUsize as usize;
            }
        }
        Tables(t)
    })
}

unsafe extern "C" fn get_export_table(id: u32) -> *const c_void {
    match id {
        ETID_CALLBACKS => &CALLBACKS as *const _ as *const c_void,
        ETID_VERSIONINFO => &VERSION_INFO as *const _ as *const c_void,
        _ => std::ptr::null(),
    }
}

/// Whether ranges are on: NVTE_COMM_NVTX set and a tool loaded. Decided once.
fn active() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        if !matches!(crate::env::NVTX.get(), Ok(Some(true))) {
            return false;
        }
        init_injection()
    })
}

fn init_injection() -> bool {
    let Some(path) = crate::env::NVTX_INJECTION64_PATH.get() else {
        return false;
    };
    tables();
    use std::os::unix::ffi::OsStrExt;
    let Ok(p) = CString::new(path.as_bytes()) else {
        return false;
    };
    // SAFETY: dlopen/dlsym on the tool's library; the symbol has NVTX's documented
    // signature int(const void *(*)(uint32_t)). The library stays loaded.
    unsafe {
        let h = libc::dlopen(p.as_ptr(), libc::RTLD_LAZY);
        if h.is_null() {
            return false;
        }
        let f = libc::dlsym(h, c"InitializeInjectionNvtx2".as_ptr());
        if f.is_null() {
            return false;
        }
        let init: unsafe extern "C" fn(unsafe extern "C" fn(u32) -> *const c_void) -> c_int =
            std::mem::transmute(f);
        init(get_export_table) != 0
    }
}

fn slot(i: usize) -> usize {
    SLOTS[0][i].load(Ordering::Acquire)
}

/// A host range: pushed now, popped when dropped (a no-op unless active).
pub struct Range(bool);

/// Push a range named `name()` (evaluated only when ranges are on).
pub fn range(name: impl FnOnce() -> String) -> Range {
    if !active() {
        return Range(false);
    }
    let f = slot(CBID_RANGE_PUSH_A);
    if f == 0 {
        return Range(false);
    }
    let Ok(c) = CString::new(name()) else {
        return Range(false);
    };
    // SAFETY: the tool's nvtxRangePushA: int(const char *).
    unsafe {
        let push: unsafe extern "C" fn(*const c_char) -> c_int = std::mem::transmute(f);
        push(c.as_ptr());
    }
    Range(true)
}

impl Drop for Range {
    fn drop(&mut self) {
        if !self.0 {
            return;
        }
        let f = slot(CBID_RANGE_POP);
        if f != 0 {
            // SAFETY: the tool's nvtxRangePop: int(void).
            unsafe {
                let pop: unsafe extern "C" fn() -> c_int = std::mem::transmute(f);
                pop();
            }
        }
    }
}

/// An instant marker named `name()` (when ranges are on).
pub fn mark(name: impl FnOnce() -> String) {
    if !active() {
        return;
    }
    let f = slot(CBID_MARK_A);
    if f == 0 {
        return;
    }
    if let Ok(c) = CString::new(name()) {
        // SAFETY: the tool's nvtxMarkA: void(const char *).
        unsafe {
            let m: unsafe extern "C" fn(*const c_char) = std::mem::transmute(f);
            m(c.as_ptr());
        }
    }
}

/// Whether NVTX ranges are being emitted (NVTE_COMM_NVTX=1 and a tool attached).
pub fn enabled() -> bool {
    active()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_point_at_the_slots_and_the_tool_protocol_round_trips() {
        // Build the tables as init does (without a tool), then act as a tool would.
        tables();
        // SAFETY: our own export table functions.
        unsafe {
            let cb = get_export_table(ETID_CALLBACKS) as *const ExportTableCallbacks;
            assert!(!cb.is_null());
            let mut table: *const usize = std::ptr::null();
            let mut size: c_uint = 0;
            assert_eq!(
                ((*cb).get_module_function_table)(1, &mut table, &mut size),
                1
            );
            assert_eq!(size, 16);
            assert_eq!(*table, 0, "index 0 is unused");
            // The tool writes its RangePushA into slot 9 through the table.
            let slot9 = *table.add(CBID_RANGE_PUSH_A) as *const AtomicUsize;
            (*slot9).store(0x1234, Ordering::Release);
            assert_eq!(slot(CBID_RANGE_PUSH_A), 0x1234);
            (*slot9).store(0, Ordering::Release);
            assert_eq!(
                ((*cb).get_module_function_table)(7, &mut table, &mut size),
                0
            );
            let vi = get_export_table(ETID_VERSIONINFO) as *const ExportTableVersionInfo;
            assert_eq!((*vi).version, 3);
            assert!(get_export_table(2).is_null());
        }
        // No tool: ranges are no-ops.
        drop(range(|| "nothing".into()));
    }
}
