//! The source's shape, checked on the host: the modules' imports follow the layers (no
//! import points up a layer, so there is no loop), and no function of `src/` is longer
//! than 100 lines.
mod common;
use common::rs_files;
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// The layers, top first: a module may import only modules of lower layers (or of its
/// own layer where listed in `SIDEWAYS`).
const LAYERS: &[&[&str]] = &[
    &["ffi"],
    &["comm_gemm"],
    &["tune"],
    &["overlap"],
    &["gemm", "kernels", "transport"],
    &["bootstrap"],
    &["tensor"],
    &["cuda"],
    &["env", "host", "handle", "timing"],
    &["error"],
];

/// Imports within one layer that are allowed.
const SIDEWAYS: &[(&str, &str)] = &[("env", "error")];

fn code(p: &Path) -> String {
    common::code_without_comments(p)
}

/// The top-level module of a file under src/.
fn module_of(src: &Path, p: &Path) -> Option<String> {
    let rel = p.strip_prefix(src).ok()?;
    let first = rel.components().next()?.as_os_str().to_str()?;
    let m = first.trim_end_matches(".rs");
    (m != "lib").then(|| m.to_string())
}

/// The crate's exported macros (`crate::invalid!`): the error module's.
const MACROS: &[&str] = &["invalid", "unsupported"];

/// The top-level modules named by the path after one `crate::`: `x::...`, or each of a
/// group `{x::..., y, ...}`.
fn imported(rest: &str) -> Vec<String> {
    let ident = |s: &str| -> String {
        s.trim_start()
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect()
    };
    let names: Vec<String> = if let Some(group) = rest.strip_prefix('{') {
        let (mut depth, mut end) = (1, group.len());
        for (i, c) in group.char_indices() {
            depth += (c == '{') as i32 - (c == '}') as i32;
            if depth == 0 {
                end = i;
                break;
            }
        }
        let (mut parts, mut d, mut start) = (Vec::new(), 0, 0);
        let body = &group[..end];
        for (i, c) in body.char_indices() {
            match c {
                '{' => d += 1,
                '}' => d -= 1,
                ',' if d == 0 => {
                    parts.push(ident(&body[start..i]));
                    start = i + 1;
                }
                _ => {}
            }
        }
        parts.push(ident(&body[start..]));
        parts
    } else {
        vec![ident(rest)]
    };
    names
        .into_iter()
        .filter(|n| !n.is_empty() && n != "self")
        .map(|n| {
            if MACROS.contains(&n.as_str()) {
                "error".to_string()
            } else {
                n
            }
        })
        .collect()
}

fn imports() -> BTreeMap<String, BTreeSet<String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rs_files(&src, &mut files);
    let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for f in &files {
        let Some(m) = module_of(&src, f) else {
            continue;
        };
        let text = code(f);
        let deps = g.entry(m.clone()).or_default();
        for (i, _) in text.match_indices("crate::") {
            for name in imported(&text[i + 7..]) {
                if name != m {
                    deps.insert(name);
                }
            }
        }
    }
    g
}

fn layer(m: &str) -> usize {
    LAYERS
        .iter()
        .position(|l| l.contains(&m))
        .unwrap_or_else(|| panic!("module `{m}` is in no layer of tests/layering.rs"))
}

#[test]
fn no_import_points_up_a_layer() {
    let g = imports();
    let mut bad = Vec::new();
    for (m, deps) in &g {
        for d in deps {
            let (lm, ld) = (layer(m), layer(d));
            let sideways = lm == ld && SIDEWAYS.contains(&(m.as_str(), d.as_str()));
            if ld < lm || (ld == lm && !sideways) {
                bad.push(format!("{m} (layer {lm}) imports {d} (layer {ld})"));
            }
        }
    }
    assert!(
        bad.is_empty(),
        "imports against the layering:\n{}",
        bad.join("\n")
    );
    // Every layer's modules exist (the table is not stale).
    for m in LAYERS.iter().flat_map(|l| l.iter()) {
        assert!(
            g.contains_key(*m),
            "module `{m}` of the layer table is gone"
        );
    }
}

/// `line` with its char literals (`'{'`, `'"'`, `'\\''`) blanked; lifetimes stay.
fn without_chars(line: &str) -> String {
    let c: Vec<char> = line.chars().collect();
    let mut out = String::new();
    let mut i = 0;
    while i < c.len() {
        if c[i] == '\'' {
            let len = if c.get(i + 1) == Some(&'\\') { 4 } else { 3 };
            if c.get(i + len - 1) == Some(&'\'') {
                out.push_str("' '");
                i += len;
                continue;
            }
        }
        out.push(c[i]);
        i += 1;
    }
    out
}

/// Lines of each `fn` body in `text` (a brace count that skips strings and chars).
fn function_lengths(text: &str) -> Vec<(usize, String, usize)> {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let l = lines[i].trim_start();
        let is_fn = [
            "fn ",
            "pub fn ",
            "pub(crate) fn ",
            "pub(super) fn ",
            "unsafe fn ",
        ]
        .iter()
        .any(|p| l.starts_with(p))
            || l.starts_with("pub unsafe fn ")
            || l.starts_with("pub unsafe extern \"C\" fn ")
            || l.starts_with("pub extern \"C\" fn ");
        if !is_fn {
            i += 1;
            continue;
        }
        let name: String = l[l.find("fn ").unwrap() + 3..]
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        let (mut depth, mut started, mut j) = (0i64, false, i);
        'body: while j < lines.len() {
            let mut in_str = false;
            let mut prev = ' ';
            let code = without_chars(lines[j].split("//").next().unwrap_or(""));
            for c in code.chars() {
                match c {
                    '"' if prev != '\\' && prev != '\'' => in_str = !in_str,
                    '{' if !in_str => {
                        depth += 1;
                        started = true
                    }
                    '}' if !in_str => depth -= 1,
                    _ => {}
                }
                prev = c;
            }
            if started && depth == 0 {
                break 'body;
            }
            if !started && code.trim_end().ends_with(';') {
                break 'body;
            }
            j += 1;
        }
        out.push((i + 1, name, j - i + 1));
        i = if started { j + 1 } else { i + 1 };
    }
    out
}

#[test]
fn no_function_is_over_100_lines() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rs_files(&src, &mut files);
    let mut long = Vec::new();
    for f in &files {
        let text = std::fs::read_to_string(f).unwrap();
        for (line, name, n) in function_lengths(&text) {
            if n > 100 {
                long.push(format!("{}:{line} {name}: {n} lines", f.display()));
            }
        }
    }
    assert!(
        long.is_empty(),
        "functions over 100 lines:\n{}",
        long.join("\n")
    );
    // The counter counts: this file's own function above is found, with its length.
    let me = std::fs::read_to_string(file!()).unwrap();
    let lens = function_lengths(&me);
    let (_, _, n) = lens
        .iter()
        .find(|(_, name, _)| name == "function_lengths")
        .expect("found");
    assert!((40..100).contains(n), "function_lengths counted {n} lines");
    // A long function (with braces in strings and chars) is found with its length.
    let body = "    let s = \"}}\"; let c = '{';\n".repeat(150);
    let long = format!("fn long() {{\n{body}}}\nfn short() {{}}\n");
    let lens = function_lengths(&long);
    assert_eq!(lens[0], (1, "long".to_string(), 152));
    assert_eq!(lens[1], (153, "short".to_string(), 1));
}
