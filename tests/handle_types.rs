//! Driver and library handles are typed: no struct field or function parameter of `src/`
//! named like a handle (a context, stream, event, communicator, graph, module, ...) has a
//! bare `usize` / `u64` type, and no integer is cast into a driver or library handle
//! type outside the handle types' own module. The `extern "C"` signatures and `repr(C)`
//! structs of `src/ffi/` (the C ABI's own types) are the exception: the C boundary
//! converts them into the types listed in [`HANDLE_TYPES`]. The library's own tables of
//! objects are indexed the same way: a comm-GEMM context's engine is an `EngineId`
//! ([`INDEX_TYPES`]), so a parameter or field named `eng` / `engine` is no bare integer.
mod common;
use common::{code_without_comments, rs_files};
use std::path::Path;

/// The handle types (`src/cuda/handles.rs`): each must be defined there.
const HANDLE_TYPES: &[&str] = &[
    "CtxHandle",
    "CtxId",
    "CtxRef",
    "StreamHandle",
    "EventHandle",
    "GraphHandle",
    "GraphExecHandle",
    "ModuleHandle",
    "FunctionHandle",
    "NcclComm",
    "LtHandle",
    "DlHandle",
];

/// The library's own table indices that are typed like handles (type, defining file):
/// the names of [`HANDLE_WORDS`]' `eng` / `engine` hold them.
const INDEX_TYPES: &[(&str, &str)] = &[("EngineId", "src/comm_gemm/call.rs")];

/// The words that make a name a handle's: the name itself, or its last `_` part
/// (`main_stream`, `nccl_comm`), or its first part before `_addr` / `_id` / `_raw`
/// (`ctx_addr`, `ctx_id`).
const HANDLE_WORDS: &[&str] = &[
    "ctx", "context", "stream", "event", "comm", "exec", "graph", "handle", "module", "func",
    "function", "prog", "program", "lt", "eng", "engine",
];

fn handle_like(name: &str) -> bool {
    let parts: Vec<&str> = name.split('_').filter(|p| !p.is_empty()).collect();
    let Some(last) = parts.last() else {
        return false;
    };
    HANDLE_WORDS.contains(last)
        || (parts.len() == 2
            && HANDLE_WORDS.contains(&parts[0])
            && ["addr", "id", "raw", "ptr"].contains(&parts[1]))
}

/// The bare integer a type is (`usize`, `&u64`, `Option<usize>`, `Vec<u64>`, ...), if
/// it is one.
fn bare_integer(ty: &str) -> bool {
    let mut t = ty.trim();
    loop {
        let before = t;
        for p in [
            "&mut ",
            "&",
            "Option<",
            "Vec<",
            "[",
            "Cell<",
            "AtomicU64",
            "Mutex<",
        ] {
            t = t.strip_prefix(p).unwrap_or(t).trim_start();
        }
        if t == before {
            break;
        }
    }
    let word: String = t
        .chars()
        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
        .collect();
    word == "usize" || word == "u64"
}

/// `code` with the spans the C ABI owns blanked: every `extern "C" fn`'s parameter list
/// and every `#[repr(C)]` item's body (only under `src/ffi/`).
fn without_c_abi(code: &str) -> String {
    let mut out = code.to_string();
    for marker in ["extern \"C\" fn", "#[repr(C)]"] {
        let mut from = 0;
        while let Some(i) = out[from..].find(marker) {
            let start = from + i;
            let open = if marker.starts_with('#') { '{' } else { '(' };
            let close = if open == '{' { '}' } else { ')' };
            let Some(o) = out[start..].find(open).map(|o| start + o) else {
                break;
            };
            let mut depth = 0;
            let mut end = o;
            for (j, c) in out[o..].char_indices() {
                if c == open {
                    depth += 1;
                } else if c == close {
                    depth -= 1;
                    if depth == 0 {
                        end = o + j;
                        break;
                    }
                }
            }
            let blank: String = out[o..=end]
                .chars()
                .map(|c| if c == '\n' { '\n' } else { ' ' })
                .collect();
            out.replace_range(o..=end, &blank);
            from = end + 1;
        }
    }
    out
}

/// Every `name: type` of `code` (struct fields, function parameters, closure and
/// tuple-pattern parameters) whose name is handle-like and whose type is a bare integer,
/// as "line: name: type". `let` bindings are locals, not holders: skipped.
fn bare_handles(code: &str) -> Vec<String> {
    let mut found = Vec::new();
    for (n, line) in code.lines().enumerate() {
        let b = line.as_bytes();
        let mut i = 0;
        while let Some(c) = line[i..].find(':') {
            let colon = i + c;
            i = colon + 1;
            if b.get(colon + 1) == Some(&b':') || (colon > 0 && b[colon - 1] == b':') {
                i = colon + 2;
                continue; // a path (`a::b`)
            }
            let name_start = line[..colon]
                .trim_end()
                .rfind(|ch: char| !(ch.is_ascii_alphanumeric() || ch == '_'))
                .map_or(0, |p| p + 1);
            let name = line[name_start..colon].trim();
            if name.is_empty() || !handle_like(name) {
                continue;
            }
            let before = line[..name_start].trim_end();
            if before.ends_with("let")
                || before.ends_with("let mut")
                || before.ends_with("mut") && before.contains("let ")
            {
                continue;
            }
            let ty: String = line[colon + 1..]
                .chars()
                .take_while(|&ch| ch != ',' && ch != ')' && ch != '=' && ch != ';' && ch != '{')
                .collect();
            if bare_integer(&ty) {
                found.push(format!("{}: {name}: {}", n + 1, ty.trim()));
            }
        }
    }
    found
}

fn sources() -> Vec<std::path::PathBuf> {
    let mut files = Vec::new();
    rs_files(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("src"),
        &mut files,
    );
    files.sort();
    files
}

fn rel(p: &Path) -> String {
    p.strip_prefix(env!("CARGO_MANIFEST_DIR"))
        .unwrap()
        .display()
        .to_string()
}

#[test]
fn no_handle_is_held_as_a_bare_integer() {
    let mut bad = Vec::new();
    for f in sources() {
        let mut code = code_without_comments(&f);
        if rel(&f).starts_with("src/ffi/") {
            code = without_c_abi(&code);
        }
        for hit in bare_handles(&code) {
            bad.push(format!("{}:{hit}", rel(&f)));
        }
    }
    assert!(
        bad.is_empty(),
        "handles held as bare integers (use the types of src/cuda/handles.rs: {}; engines: {}):\n{}",
        HANDLE_TYPES.join(", "),
        INDEX_TYPES
            .iter()
            .map(|t| t.0)
            .collect::<Vec<_>>()
            .join(", "),
        bad.join("\n")
    );
}

/// Casts of an integer into a library handle type: only `src/cuda/handles.rs` makes them
/// (through `from_raw` / `from_c` of a typed value).
#[test]
fn only_the_handle_types_cast_integers_into_handles() {
    let targets = [
        "cu::CUcontext",
        "cu::CUstream",
        "cu::CUevent",
        "cu::CUgraph",
        "cu::CUgraphExec",
        "cu::CUmodule",
        "cu::CUfunction",
        "::ncclComm_t",
        "::cublasLtHandle_t",
        "::cudaStream_t",
    ];
    let mut bad = Vec::new();
    for f in sources() {
        if rel(&f) == "src/cuda/handles.rs" {
            continue;
        }
        let code = code_without_comments(&f);
        for (n, line) in code.lines().enumerate() {
            for t in targets {
                let mut from = 0;
                while let Some(i) = line[from..].find(" as ") {
                    let rest = &line[from + i + 4..];
                    let ty: String = rest
                        .chars()
                        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_' || *c == ':')
                        .collect();
                    if ty.ends_with(t)
                        && (ty == t || ty.ends_with(&format!("::{}", t.trim_start_matches(':'))))
                    {
                        bad.push(format!("{}:{}: {}", rel(&f), n + 1, line.trim()));
                    }
                    from += i + 4;
                }
            }
        }
    }
    bad.dedup();
    assert!(
        bad.is_empty(),
        "integer-to-handle casts outside src/cuda/handles.rs:\n{}",
        bad.join("\n")
    );
}

#[test]
fn every_listed_handle_type_is_defined_in_the_handle_module() {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/cuda/handles.rs");
    let code = code_without_comments(&p);
    for t in HANDLE_TYPES {
        let as_struct = format!("pub struct {t}(");
        let as_record = format!("pub struct {t} {{");
        let by_macro = format!("{t} => ");
        assert!(
            code.contains(&as_struct) || code.contains(&as_record) || code.contains(&by_macro),
            "{t} is not defined in src/cuda/handles.rs"
        );
    }
    for (t, file) in INDEX_TYPES {
        let code = code_without_comments(&Path::new(env!("CARGO_MANIFEST_DIR")).join(file));
        assert!(
            code.contains(&format!("pub struct {t}(usize);")),
            "{t} (a private index) is not defined in {file}"
        );
    }
}

#[test]
fn the_checks_find_what_they_look_for() {
    // The reader itself: a field, a parameter and an optional one are found; a `let`, a
    // typed handle, a non-handle name and a path are not.
    let code = "struct S {\n    pub stream: usize,\n    ctx_addr: usize,\n    rows: usize,\n    ev: EventHandle,\n}\n\
                fn f(comm: u64, main_stream: Option<usize>, graph: GraphHandle) {\n    let ctx: u64 = 0;\n    x::y(std::a::b);\n}\n\
                fn g(eng: usize, last_engine: Option<usize>, e: EngineId, engines: usize) {}\n";
    let hits = bare_handles(code);
    assert_eq!(
        hits,
        [
            "2: stream: usize",
            "3: ctx_addr: usize",
            "7: comm: u64",
            "7: main_stream: Option<usize>",
            "11: eng: usize",
            "11: last_engine: Option<usize>"
        ]
    );
    let ffi = "pub extern \"C\" fn nvte_x(stream: usize) {}\n#[repr(C)]\npub struct C {\n    pub comm: u64,\n}\nfn g(stream: usize) {}\n";
    assert_eq!(bare_handles(&without_c_abi(ffi)), ["6: stream: usize"]);
}

/// The primitives that make the GPU write a raw device address are `unsafe fn`s (their
/// callers state why the range is valid); memory the library owns is written through
/// `DevSlice` (checked against its allocation).
#[test]
fn raw_address_writes_are_unsafe() {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/cuda/resources.rs");
    let code = code_without_comments(&p);
    for f in [
        "copy_async",
        "memset_async",
        "write_value32",
        "copy_2d",
        "copy_from_host",
        "copy_from_pinned_async",
        "copy_from_raw",
    ] {
        let safe = format!("pub fn {f}(");
        let unsafe_ = format!("pub unsafe fn {f}(");
        let safe_free_fn = code
            .match_indices(&safe)
            .any(|(i, _)| !code[i + safe.len()..].starts_with("&self"));
        assert!(
            code.contains(&unsafe_) && !safe_free_fn,
            "{f} must be a `pub unsafe fn` in src/cuda/resources.rs"
        );
    }
    for checked in ["zero_async", "copy_from", "write_value", "copy_from_host"] {
        assert!(
            code.contains(&format!("pub fn {checked}(&self")),
            "DevSlice::{checked} (the checked form) is missing"
        );
    }
}
