//! Raw device addresses stay at the C boundary. The rule, read from the source:
//!
//! 1. A safe function of `src/gemm/`, `src/kernels.rs` / `src/kernels/` or `src/overlap/`
//!    that is visible outside its module (`pub`, `pub(crate)`, `pub(super)`) takes no raw
//!    device operand as a parameter: no `DevPtr`, `GemmDesc` (a GEMM's raw addresses, D
//!    among them), `Tensor`, `Buffer` or `TeGemm` (tensors hold raw addresses), in any
//!    form (`&T`, `Option<T>`, `&[T]`, tuples), outside a `Checked<...>` (`cuda::Checked`:
//!    operands the C boundary vouched for). Such a function is an `unsafe fn` with a
//!    Safety contract, or takes `Checked` operands, or is listed in [`ALLOWED`] with the
//!    reason it is safe (it only reads shapes, or records a plan step that an `unsafe`
//!    launch issues later). The list is exact: an entry that no longer matches fails, so
//!    it only shrinks.
//! 2. `Checked::vouched` (the one way to make a `Checked`) is called only under
//!    `src/ffi/`: only the C boundary vouches for its caller's memory.
//!
//! The parameter list is what is checked, whatever the body writes: a parameter of these
//! types can be written by the GPU through the function, and the type is what a reader and
//! the compiler can see.
mod common;
use common::{code_without_comments, rs_files};
use std::path::{Path, PathBuf};

/// The raw device operand types (whole words).
const RAW: &[&str] = &["DevPtr", "GemmDesc", "Tensor", "Buffer", "TeGemm"];

/// Safe functions that take raw operands, as "file::name", with why.
const ALLOWED: &[(&str, &str)] = &[
    // They read the operands' shapes and types only; nothing reaches the GPU.
    (
        "src/gemm/mod.rs::desc_from_te",
        "validates shapes, builds a descriptor",
    ),
    (
        "src/gemm/mod.rs::desc_from_te_block",
        "validates shapes and block scales, builds a descriptor",
    ),
    (
        "src/gemm/block.rs::block_desc",
        "validates shapes and block scales, builds a descriptor",
    ),
    (
        "src/gemm/block.rs::check_block",
        "validates shapes and block scales",
    ),
    ("src/gemm/block.rs::is_block", "reads the scaling modes"),
    (
        "src/gemm/block.rs::check_gathered_scales",
        "validates a gathered copy's shape, format and block scales",
    ),
    (
        "src/gemm/sm90.rs::supports",
        "reads the descriptor's shape and types",
    ),
    (
        "src/gemm/sm90.rs::supports_kind",
        "reads the descriptor's shape and types",
    ),
    (
        "src/gemm/sm90/block.rs::supports_block",
        "reads the descriptor's shape, types and alignment",
    ),
    ("src/kernels.rs::flat_2d", "reads a shape"),
    ("src/kernels.rs::check_columnwise_shape", "reads a shape"),
    ("src/kernels.rs::history_dims", "reads a shape"),
    (
        "src/overlap/reduce.rs::check_reduce_output",
        "reads a shape and dtype",
    ),
    (
        "src/overlap/reduce.rs::check_fp8_output",
        "reads a shape and dtype",
    ),
    // The planner's step recorders (src/overlap/plan.rs): they append a step to the
    // call's plan and touch no memory; the engine issues the plan (`device.rs`, through
    // `gemm::run` / `run_beside_comm` / our GEMM's `run`, which are unsafe, and the copy
    // and flag primitives of `cuda::resources`, which are unsafe). Not yet typed: the
    // steps' addresses are the call's checked operands and the engine's buffers, offset
    // inside them by the planner (the host protocol tests check every access).
    (
        "src/overlap/plan.rs::begin",
        "records the call's full GEMM (report, check key)",
    ),
    ("src/overlap/plan.rs::gemm", "records a chunk GEMM step"),
    (
        "src/overlap/plan.rs::gemm_copying",
        "records a chunk GEMM step with a side copy",
    ),
    ("src/overlap/plan.rs::put", "records a put step"),
    ("src/overlap/plan.rs::copy", "records a copy step"),
    ("src/overlap/plan.rs::copy_2d", "records a 2-D copy step"),
    ("src/overlap/plan.rs::memset", "records a memset step"),
    (
        "src/overlap/plan.rs::write_flag",
        "records a flag write step",
    ),
    ("src/overlap/plan.rs::wait_flag", "records a flag wait step"),
    (
        "src/overlap/plan.rs::fused_gemm",
        "records a fused GEMM step",
    ),
    (
        "src/overlap/plan.rs::copy_segments",
        "records a segment copy step",
    ),
    (
        "src/overlap/plan.rs::amax_max",
        "records an amax reduction step",
    ),
    (
        "src/overlap/plan.rs::all_reduce",
        "records a collective step",
    ),
    (
        "src/overlap/plan.rs::reduce_scatter",
        "records a collective step",
    ),
    (
        "src/overlap/plan.rs::all_gather",
        "records a collective step",
    ),
    ("src/overlap/rs.rs::chain_rs", "plans the ring's steps"),
    (
        "src/overlap/bulk.rs::put_to_peers",
        "plans the puts, signals and wait of a gather",
    ),
    // The engine's own: the FP8 output's addresses for the plan; the report's record of
    // the full GEMM.
    (
        "src/overlap/reduce.rs::fp8_output",
        "the FP8 output's scale and amax addresses",
    ),
    (
        "src/overlap/report.rs::report_begin",
        "records the call's full GEMM for timing",
    ),
];

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn rel(p: &Path) -> String {
    p.strip_prefix(root()).unwrap().display().to_string()
}

/// The files the rule covers (test-only files left out).
fn covered() -> Vec<PathBuf> {
    let mut files = Vec::new();
    for d in ["src/gemm", "src/overlap", "src/kernels"] {
        if root().join(d).is_dir() {
            rs_files(&root().join(d), &mut files);
        }
    }
    files.push(root().join("src/kernels.rs"));
    files.retain(|f| rel(f) != "src/overlap/protocol.rs"); // #[cfg(test)] mod protocol
    files.sort();
    files
}

/// `code` up to its unit tests (`#[cfg(test)] mod tests`).
fn without_tests(code: &str) -> &str {
    match code.find("#[cfg(test)]\nmod tests") {
        Some(i) => &code[..i],
        None => code,
    }
}

/// `s` with every `Checked<...>` span blanked.
fn without_checked(s: &str) -> String {
    let mut out = s.to_string();
    while let Some(i) = out.find("Checked<") {
        let mut depth = 0;
        let mut end = out.len();
        for (j, c) in out[i..].char_indices() {
            match c {
                '<' => depth += 1,
                '>' => {
                    depth -= 1;
                    if depth == 0 {
                        end = i + j + 1;
                        break;
                    }
                }
                _ => {}
            }
        }
        out.replace_range(i..end, "_");
    }
    out
}

fn has_word(s: &str, w: &str) -> bool {
    s.match_indices(w).any(|(i, _)| {
        let ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
        !s[..i].chars().next_back().is_some_and(ident)
            && !s[i + w.len()..].chars().next().is_some_and(ident)
    })
}

/// The visible safe functions of `code` whose parameters hold a raw operand: (name,
/// parameter list).
fn raw_taking_fns(code: &str) -> Vec<(String, String)> {
    let mut found = Vec::new();
    for (i, _) in code.match_indices("fn ") {
        // The item's qualifiers: from the line's start to `fn`.
        let line_start = code[..i].rfind('\n').map_or(0, |p| p + 1);
        let quals = code[line_start..i].trim();
        if !quals.starts_with("pub") || quals.contains("unsafe") {
            continue;
        }
        let rest = &code[i + 3..];
        let name: String = rest
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        if name.is_empty() {
            continue;
        }
        // The parameter list: the first `(` after the name (past any generics), balanced.
        let Some(open) = rest.find('(') else {
            continue;
        };
        let mut depth = 0;
        let mut close = open;
        for (j, c) in rest[open..].char_indices() {
            match c {
                '(' => depth += 1,
                ')' => {
                    depth -= 1;
                    if depth == 0 {
                        close = open + j;
                        break;
                    }
                }
                _ => {}
            }
        }
        let params = without_checked(&rest[open + 1..close]);
        if RAW.iter().any(|w| has_word(&params, w)) {
            found.push((
                name,
                params.split_whitespace().collect::<Vec<_>>().join(" "),
            ));
        }
    }
    found
}

#[test]
fn safe_functions_take_no_raw_device_operands() {
    let mut bad = Vec::new();
    let mut used = Vec::new();
    for f in covered() {
        let code = code_without_comments(&f);
        for (name, params) in raw_taking_fns(without_tests(&code)) {
            let key = format!("{}::{name}", rel(&f));
            if ALLOWED.iter().any(|(k, _)| *k == key) {
                used.push(key);
            } else {
                bad.push(format!("{key}({params})"));
            }
        }
    }
    assert!(
        bad.is_empty(),
        "safe functions taking raw device operands ({}): make them `unsafe fn` with a Safety contract, or take `cuda::Checked` operands:\n{}",
        RAW.join(", "),
        bad.join("\n")
    );
    let stale: Vec<&str> = ALLOWED
        .iter()
        .map(|(k, _)| *k)
        .filter(|k| !used.iter().any(|u| u == k))
        .collect();
    assert!(
        stale.is_empty(),
        "ALLOWED entries that no longer take raw operands (remove them): {stale:?}"
    );
}

#[test]
fn only_the_c_boundary_vouches_for_memory() {
    let mut files = Vec::new();
    rs_files(&root().join("src"), &mut files);
    let mut bad = Vec::new();
    for f in files {
        let r = rel(&f);
        if r.starts_with("src/ffi/") || r == "src/cuda/checked.rs" {
            continue;
        }
        let code = code_without_comments(&f);
        if code.contains("Checked::vouched(") || code.contains("::vouched(") {
            bad.push(r);
        }
    }
    assert!(bad.is_empty(), "Checked::vouched outside src/ffi/: {bad:?}");
}

#[test]
fn the_safe_entry_points_take_checked_operands() {
    let gemm = code_without_comments(&root().join("src/gemm/mod.rs"));
    assert!(gemm.contains("pub fn cublas_gemm(args: Checked<&TeGemm>"));
    for f in ["run", "run_copying", "run_beside_comm"] {
        assert!(
            gemm.contains(&format!("pub unsafe fn {f}(")),
            "gemm::{f} takes a raw descriptor: it must be unsafe"
        );
    }
    let sm90 = code_without_comments(&root().join("src/gemm/sm90.rs"));
    assert!(sm90.contains("pub unsafe fn run("));
}

#[test]
fn the_reader_finds_what_it_looks_for() {
    let code = "pub fn a(d: DevPtr) {}\n\
                pub(crate) fn b(x: &[(DevPtr, DevPtr, usize)]) {}\n\
                pub unsafe fn c(d: DevPtr) {}\n\
                fn d(t: &Tensor) {}\n\
                pub fn e(t: Checked<&Tensor>, n: usize) -> DevPtr {}\n\
                pub fn f<T: Copy>(g: &GemmDesc, s: Option<&TensorList>) {}\n\
                    pub(super) fn g(\n        &self,\n        out: &Buffer,\n    ) {}\n";
    let names: Vec<String> = raw_taking_fns(code).into_iter().map(|x| x.0).collect();
    assert_eq!(names, ["a", "b", "f", "g"]);
}
