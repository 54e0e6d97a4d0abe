//! The C ABI's entry points, checked on the source: each `extern "C"` function's body is
//! one `entry!` (src/ffi/mod.rs), which names the function from its own declaration, so
//! that src/ffi holds at most 5 string literals of entry-point names (the grep-able check
//! `git grep -E '"nvte_[a-z0-9_]+"' src/ffi | wc -l`).
mod common;
use common::rs_files;
use std::path::{Path, PathBuf};

fn ffi_files() -> Vec<PathBuf> {
    let mut files = Vec::new();
    rs_files(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("src/ffi"),
        &mut files,
    );
    files.sort();
    assert!(files.len() > 10, "{files:?}");
    files
}

/// The string literals in `text` that are `"nvte_` followed by one or more of
/// `[a-z0-9_]` and a closing `"` (the regex `"nvte_[a-z0-9_]+"`).
fn name_literals(text: &str) -> Vec<String> {
    let prefix = concat!('"', "nvte_");
    let mut out = Vec::new();
    for (i, _) in text.match_indices(prefix) {
        let rest = &text[i + prefix.len()..];
        let end = rest
            .find(|c: char| !(c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'))
            .unwrap_or(rest.len());
        if end > 0 && rest[end..].starts_with('"') {
            out.push(format!("nvte_{}", &rest[..end]));
        }
    }
    out
}

#[test]
fn src_ffi_has_at_most_5_entry_name_literals() {
    let mut found = Vec::new();
    for f in ffi_files() {
        let text = std::fs::read_to_string(&f).unwrap();
        for n in name_literals(&text) {
            found.push(format!("{}: {n}", f.display()));
        }
    }
    assert!(
        found.len() <= 5,
        "{} string literals of entry-point names in src/ffi (at most 5; entry! names the function itself):\n{}",
        found.len(),
        found.join("\n")
    );
}

#[test]
fn the_literal_scanner_matches_the_regex() {
    let q = '"';
    let text = format!(
        "f({q}nvte_a_1{q}); g({q}nvte_{q}); h({q}nvte_x: msg{q}); {q}nvte_B{q} {q}nvte_z9{q}"
    );
    assert_eq!(name_literals(&text), ["nvte_a_1", "nvte_z9"]);
}

/// Every `extern "C"` function of src/ffi (callback types aside) has a body whose first
/// statement is `entry!(`.
#[test]
fn every_entry_point_body_is_one_entry_macro() {
    let mut count = 0;
    let mut bad = Vec::new();
    for f in ffi_files() {
        let text = std::fs::read_to_string(&f).unwrap();
        for (i, _) in text.match_indices("extern \"C\" fn ") {
            let line_start = text[..i].rfind('\n').map_or(0, |j| j + 1);
            let line = text[line_start..].lines().next().unwrap_or("");
            if !line.starts_with("pub ") {
                continue; // a callback type (`unsafe extern "C" fn(...)`)
            }
            count += 1;
            let body = &text[i..];
            let open = body.find("{\n").expect("a body");
            let first = body[open + 2..].lines().next().unwrap_or("").trim();
            if !first.starts_with("entry!(") {
                bad.push(format!("{}: {line}", f.display()));
            }
        }
    }
    assert!(count >= 80, "found {count} entry points");
    assert!(bad.is_empty(), "bodies not an entry!:\n{}", bad.join("\n"));
}
