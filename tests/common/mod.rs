//! Helpers shared by the integration tests that read the crate's own sources.
// Each test crate uses a part of this module.
#![allow(dead_code)]
use std::path::{Path, PathBuf};

/// Every `.rs` file below `dir`, recursively, appended to `out`.
pub fn rs_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rs_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The text of the source file `p` without `//` comments (doc comments name modules,
/// knobs and functions the code does not use).
pub fn code_without_comments(p: &Path) -> String {
    std::fs::read_to_string(p)
        .unwrap()
        .lines()
        .map(|l| l.split("//").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n")
}
