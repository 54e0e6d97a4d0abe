//! How a call runs is one value, `overlap::Policy` (src/overlap/policy.rs): checked on the
//! sources, in `cargo test`.
//! - The engine objects are resources plus a policy: `Overlap` and `CommGemmCtx` have at
//!   most 15 fields each (their parts are sub-structs).
//! - No second settings struct: outside the policy's own file and the C ABI's
//!   `NVTECommOverlapConfig` (src/ffi/config.rs), no struct of `src/` declares three or
//!   more of the algorithm knobs' field names, and no struct of the policy's modules is
//!   named like a settings shape (`*Config`, `*Settings`, `*Tuning`, `*Tuned`,
//!   `*Choice`, `*Knobs`; but the C struct and the tuner's exchange record).
mod common;
use common::{code_without_comments, rs_files};
use std::path::{Path, PathBuf};

/// Fields an engine object may have.
const MAX_FIELDS: usize = 15;

/// The field names of the algorithm knobs (the policy's per-call choices and pins, and
/// their names before it): a struct with three or more of them is a settings shape.
const KNOB_FIELDS: &[&str] = &[
    "use_ce",
    "aggregate",
    "bidirectional",
    "num_splits",
    "splits",
    "ring",
    "accumulate",
    "rs_accumulate",
    "ar_ring",
    "atomic",
    "atomic_gemm",
    "fused",
    "narrow",
    "num_comm_sm",
    "comm_sms",
    "set_sm_margin",
    "sm_margin",
    "ar_algo",
    "rs_ring",
    "ag_pieces",
    "fused_tiles",
];

/// Where settings-shaped structs belong: the policy's types, and the C struct the header
/// declares (the ABI, converted into the policy at the boundary).
const ALLOWED: &[&str] = &["src/overlap/policy.rs", "src/ffi/config.rs"];

/// The modules that hold "how a call runs" (no settings-named struct there but the
/// C ABI's `Config`).
const POLICY_MODULES: &[&str] = &[
    "src/overlap",
    "src/comm_gemm",
    "src/comm_gemm.rs",
    "src/tune.rs",
    "src/ffi/config.rs",
];

/// A struct of a source file: its name and its field names.
#[derive(Debug)]
struct Struct {
    name: String,
    fields: Vec<String>,
}

/// The braced structs declared in `code` (comments stripped) and their field names:
/// the identifiers before a `:` at the top level of the body (generics, tuples, arrays
/// and nested braces skipped).
fn structs(code: &str) -> Vec<Struct> {
    let code = code.replace("->", "  ");
    let mut out = Vec::new();
    let mut rest = code.as_str();
    while let Some(i) = find_struct(rest) {
        let after = &rest[i + "struct ".len()..];
        let name: String = after
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        let head_end = after.find(['{', ';', '(']).unwrap_or(after.len());
        if after[head_end..].starts_with('{') {
            let body = &after[head_end + 1..];
            out.push(Struct {
                name,
                fields: fields_of(body),
            });
        }
        rest = &after[head_end.min(after.len())..];
    }
    out
}

/// The position of the next `struct ` keyword (a whole word) in `s`.
fn find_struct(s: &str) -> Option<usize> {
    let mut from = 0;
    while let Some(j) = s[from..].find("struct ") {
        let at = from + j;
        let before = s[..at].chars().last();
        if before.is_none_or(|c| !(c.is_alphanumeric() || c == '_')) {
            return Some(at);
        }
        from = at + 1;
    }
    None
}

/// The field names of a struct body that starts right after its `{`.
fn fields_of(body: &str) -> Vec<String> {
    let (mut depth, mut seg, mut fields) = (0i32, String::new(), Vec::new());
    let push = |seg: &str, fields: &mut Vec<String>| {
        // (attributes start a segment: `#[...] name: T`)
        let s = seg.trim();
        let s = match s.rfind(']') {
            Some(k) if s.starts_with('#') => s[k + 1..].trim(),
            _ => s,
        };
        let s = match s.strip_prefix("pub(") {
            Some(v) => v.split_once(')').map_or(v, |x| x.1),
            None => s.strip_prefix("pub ").unwrap_or(s),
        }
        .trim();
        if let Some((name, _)) = s.split_once(':') {
            let name = name.trim();
            if !name.is_empty() && name.chars().all(|c| c.is_alphanumeric() || c == '_') {
                fields.push(name.to_string());
            }
        }
    };
    for c in body.chars() {
        match c {
            '{' | '(' | '[' | '<' => depth += 1,
            ')' | ']' | '>' => depth -= 1,
            '}' if depth == 0 => break,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                push(&seg, &mut fields);
                seg.clear();
                continue;
            }
            _ => {}
        }
        seg.push(c);
    }
    push(&seg, &mut fields);
    fields
}

fn src_files() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    rs_files(&root.join("src"), &mut files);
    files
}

fn rel(p: &Path) -> String {
    p.strip_prefix(env!("CARGO_MANIFEST_DIR"))
        .unwrap()
        .to_string_lossy()
        .replace('\\', "/")
}

fn struct_in(file: &str, name: &str) -> Struct {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join(file);
    structs(&code_without_comments(&p))
        .into_iter()
        .find(|s| s.name == name)
        .unwrap_or_else(|| panic!("struct {name} not found in {file}"))
}

#[test]
fn the_engine_objects_have_at_most_15_fields() {
    for (file, name) in [
        ("src/overlap/mod.rs", "Overlap"),
        ("src/comm_gemm.rs", "CommGemmCtx"),
    ] {
        let s = struct_in(file, name);
        assert!(
            s.fields.len() <= MAX_FIELDS,
            "{name} ({file}) has {} fields (at most {MAX_FIELDS}: group its parts into sub-structs): {:?}",
            s.fields.len(),
            s.fields
        );
        assert!(
            s.fields.iter().any(|f| f == "policy"),
            "{name} runs by a policy field: {:?}",
            s.fields
        );
    }
}

#[test]
fn no_settings_struct_besides_the_policy() {
    let mut bad = Vec::new();
    let mut allowed_seen = Vec::new();
    for f in src_files() {
        let file = rel(&f);
        let in_policy_modules = POLICY_MODULES.iter().any(|m| file.starts_with(m));
        for s in structs(&code_without_comments(&f)) {
            let knobs: Vec<&String> = s
                .fields
                .iter()
                .filter(|x| KNOB_FIELDS.contains(&x.as_str()))
                .collect();
            if knobs.len() >= 3 {
                if ALLOWED.contains(&file.as_str()) {
                    allowed_seen.push(file.clone());
                } else {
                    bad.push(format!(
                        "{file}: struct {} declares the knob fields {knobs:?}: make it part of overlap::Policy",
                        s.name
                    ));
                }
            }
            let named_like_settings = ["Config", "Settings", "Tuning", "Tuned", "Choice", "Knobs"]
                .iter()
                .any(|w| s.name.ends_with(w));
            let c_abi = file == "src/ffi/config.rs" && s.name == "Config";
            // (the tuner's cross-rank exchange record, not settings: its size is in the
            // C header as Settings_BYTES, which cbindgen names after it)
            let tune_exchange = file == "src/tune.rs" && s.name == "Settings";
            if in_policy_modules && named_like_settings && !c_abi && !tune_exchange {
                bad.push(format!(
                    "{file}: struct {} is named like a settings shape: the policy is overlap::Policy",
                    s.name
                ));
            }
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
    // The allowed places hold what the check looks for (the check is not vacuous).
    for a in ALLOWED {
        assert!(
            allowed_seen.iter().any(|f| f == a),
            "{a} holds no settings-shaped struct: the check's allow list is stale"
        );
    }
}

/// The reader finds fields through attributes, generics and function-pointer types, and
/// the knob rule flags a settings-shaped struct.
#[test]
fn the_struct_reader_finds_the_fields() {
    let code = "pub struct A<'a> {\n    #[allow(x)] pub use_ce: bool,\n    pub(crate) map: HashMap<String, (u8, u8)>,\n    f: Option<fn(&G) -> Option<&'static str>>,\n    narrow: bool, splits: usize,\n}\nstruct Unit;\nstruct T(u8);\nstruct B { x: [u8; 4] }";
    let s = structs(code);
    assert_eq!(s.len(), 2, "{s:?}");
    assert_eq!(s[0].name, "A");
    assert_eq!(s[0].fields, ["use_ce", "map", "f", "narrow", "splits"]);
    assert_eq!(s[1].fields, ["x"]);
    let knobs = s[0]
        .fields
        .iter()
        .filter(|x| KNOB_FIELDS.contains(&x.as_str()))
        .count();
    assert_eq!(knobs, 3);
}
