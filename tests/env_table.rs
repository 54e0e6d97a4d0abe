//! The environment is read in one module, from one table: no file of `src/` but
//! `src/env.rs` reads a variable or names a knob, every knob of `env::KNOBS` is documented
//! in docs/knobs.md (and every library knob documented there is in the table), and no
//! name is in the table twice.
mod common;
use common::rs_files;
use std::collections::BTreeSet;
use std::path::Path;
use transformer_engine_comm::env::KNOBS;

fn code(p: &Path) -> String {
    common::code_without_comments(p)
}

/// The string literals of `s` that look like a knob's name (`"NVTE_COMM_X"`,
/// `"TE_COMM_X"`), the status names (`NVTE_COMM_ERROR_*`) aside.
fn knob_literals(s: &str) -> Vec<String> {
    let mut out = Vec::new();
    for (i, _) in s.match_indices('"') {
        let rest = &s[i + 1..];
        let Some(end) = rest.find('"') else { break };
        let lit = &rest[..end];
        let named = ["NVTE_COMM_", "TE_COMM_"].iter().any(|p| {
            lit.strip_prefix(p).is_some_and(|t| {
                !t.is_empty()
                    && t.chars()
                        .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')
            })
        });
        if named && !lit.starts_with("NVTE_COMM_ERROR_") {
            out.push(lit.to_string());
        }
    }
    out
}

#[test]
fn only_the_env_module_reads_the_environment() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rs_files(&src, &mut files);
    let mut bad = Vec::new();
    for f in files.iter().filter(|f| !f.ends_with("env.rs")) {
        let c = code(f);
        for pat in ["std::env::var", "env::var_os", "env::vars", "getenv"] {
            if c.contains(pat) {
                bad.push(format!("{}: {pat}", f.display()));
            }
        }
        for lit in knob_literals(&c) {
            bad.push(format!("{}: \"{lit}\"", f.display()));
        }
    }
    assert!(
        bad.is_empty(),
        "read knobs through src/env.rs's table:\n{}",
        bad.join("\n")
    );
}

#[test]
fn the_table_has_no_duplicate_names() {
    let mut seen = BTreeSet::new();
    for k in KNOBS {
        assert!(seen.insert(k.name), "{} is in the table twice", k.name);
        assert!(!k.doc.is_empty() && !k.default.is_empty(), "{}", k.name);
    }
}

/// The `NVTE_COMM_*` names of docs/knobs.md's library table (its first section).
fn documented_library_knobs(doc: &str) -> BTreeSet<String> {
    let first = doc.split("\n## ").next().unwrap();
    let mut out = BTreeSet::new();
    for line in first.lines().filter(|l| l.starts_with("| `")) {
        let cell = line.split('|').nth(1).unwrap();
        for name in cell.split('`').filter(|w| w.starts_with("NVTE_COMM_")) {
            out.insert(name.to_string());
        }
    }
    out
}

#[test]
fn every_knob_is_documented_and_every_documented_knob_is_in_the_table() {
    let doc = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/knobs.md"))
        .unwrap();
    for k in KNOBS {
        let word = |i: usize| {
            let before = doc[..i].chars().next_back();
            let after = doc[i + k.name.len()..].chars().next();
            let part = |c: Option<char>| c.is_some_and(|c| c.is_alphanumeric() || c == '_');
            !part(before) && !part(after)
        };
        assert!(
            doc.match_indices(k.name).any(|(i, _)| word(i)),
            "{} is not in docs/knobs.md",
            k.name
        );
    }
    let table: BTreeSet<&str> = KNOBS.iter().map(|k| k.name).collect();
    let documented = documented_library_knobs(&doc);
    assert!(documented.len() > 20, "{documented:?}");
    for name in &documented {
        assert!(
            table.contains(name.as_str()),
            "docs/knobs.md documents {name}, which src/env.rs's table lacks"
        );
    }
}
