//! Helpers shared by the integration tests that read the crate's own sources.
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
