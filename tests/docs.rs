//! The documentation stays honest (no GPU, no network): the README stays short and free of
//! history references, every script it names exists and every script is in its table,
//! `bench/RESULTS.md` stays a summary, markdown tables hold no block content, and every
//! relative link in the README, `bench/RESULTS.md` and `docs/` resolves to a file.
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(root().join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

/// Every markdown file the checks cover: README.md, bench/RESULTS.md and docs/**.md.
fn markdown_files() -> Vec<PathBuf> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for e in entries.flatten() {
            let p = e.path();
            if p.is_dir() {
                walk(&p, out);
            } else if p.extension().is_some_and(|x| x == "md") {
                out.push(p);
            }
        }
    }
    let mut out = vec![root().join("README.md"), root().join("bench/RESULTS.md")];
    walk(&root().join("docs"), &mut out);
    out.sort();
    out
}

/// The text outside fenced code blocks, one entry per line (line number, text).
fn prose_lines(text: &str) -> Vec<(usize, &str)> {
    let mut fenced = false;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if !fenced {
            out.push((i + 1, line));
        }
    }
    out
}

/// The scripts in scripts/ (file names), without the internal helper common.sh.
fn scripts() -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(root().join("scripts"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".sh") && n != "common.sh")
        .collect();
    v.sort();
    v
}

/// The `scripts/NAME.sh` names a text mentions.
fn scripts_named(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(i) = rest.find("scripts/") {
        let tail = &rest[i + "scripts/".len()..];
        let name: String = tail
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '-' || *c == '_' || *c == '.')
            .collect();
        let name = name.trim_end_matches('.');
        if name
            .strip_suffix(".sh")
            .is_some_and(|stem| !stem.is_empty())
        {
            out.push(name.to_string());
        }
        rest = tail;
    }
    out.sort();
    out.dedup();
    out
}

#[test]
fn readme_is_short() {
    let n = read("README.md").lines().count();
    assert!(
        n <= 250,
        "README.md has {n} lines; at most 250 (the detail goes to docs/)"
    );
}

#[test]
fn results_is_a_summary() {
    let n = read("bench/RESULTS.md").lines().count();
    assert!(
        n <= 200,
        "bench/RESULTS.md has {n} lines; at most 200 (the history goes to docs/results/)"
    );
}

#[test]
fn readme_names_no_history() {
    let text = read("README.md");
    let lower = text.to_lowercase();
    let mut bad = Vec::new();
    for (no, line) in lower.lines().enumerate() {
        let words: Vec<&str> = line
            .split(|c: char| !c.is_ascii_alphanumeric() && c != '-')
            .filter(|w| !w.is_empty())
            .collect();
        for (i, w) in words.iter().enumerate() {
            let next_is_number = words
                .get(i + 1)
                .is_some_and(|n| n.chars().all(|c| c.is_ascii_digit()));
            if (*w == "issue" || *w == "issues") && next_is_number {
                bad.push(format!("line {}: issue number", no + 1));
            }
            if w.starts_with("session") {
                bad.push(format!("line {}: session", no + 1));
            }
            if w.starts_with("seed-0") {
                bad.push(format!("line {}: seed number", no + 1));
            }
        }
        for ordinal in [
            "first", "second", "third", "fourth", "fifth", "sixth", "seventh",
        ] {
            if line.contains(&format!("{ordinal} session")) {
                bad.push(format!("line {}: {ordinal} session", no + 1));
            }
        }
    }
    assert!(bad.is_empty(), "README.md names history: {bad:?}");
}

#[test]
fn readme_scripts_exist_and_all_are_listed() {
    let readme = read("README.md");
    let have = scripts();
    let missing: Vec<String> = scripts_named(&readme)
        .into_iter()
        .filter(|n| !have.contains(n))
        .collect();
    assert!(
        missing.is_empty(),
        "README.md names scripts that do not exist: {missing:?}"
    );
    // The script table: rows whose first cell names a script.
    let rows: Vec<&str> = readme
        .lines()
        .filter(|l| l.starts_with("| `scripts/"))
        .collect();
    let unlisted: Vec<&String> = have
        .iter()
        .filter(|s| {
            !rows
                .iter()
                .any(|r| r.starts_with(&format!("| `scripts/{s}")))
        })
        .collect();
    assert!(
        unlisted.is_empty(),
        "scripts missing from README.md's script table: {unlisted:?}"
    );
}

#[test]
fn tables_hold_no_block_content() {
    let mut bad = Vec::new();
    for path in markdown_files() {
        let text = std::fs::read_to_string(&path).unwrap();
        let rel = path.strip_prefix(root()).unwrap().display().to_string();
        let lines: Vec<&str> = text.lines().collect();
        let mut fenced = false;
        let mut in_table = false;
        for (i, line) in lines.iter().enumerate() {
            let t = line.trim_start();
            if t.starts_with("```") {
                if in_table {
                    bad.push(format!(
                        "{rel}:{}: code block right after a table row",
                        i + 1
                    ));
                }
                fenced = !fenced;
                in_table = false;
                continue;
            }
            if fenced {
                continue;
            }
            if t.starts_with('|') {
                // A row outside a table must be a header: the separator row follows it.
                // (Rows after a paragraph or a code block that interrupted a table do not
                // render.)
                let separator = |l: &str| {
                    let l = l.trim();
                    l.starts_with('|')
                        && l.chars().all(|c| matches!(c, '|' | '-' | ':' | ' '))
                        && l.contains('-')
                };
                if !in_table && !lines.get(i + 1).is_some_and(|n| separator(n)) {
                    bad.push(format!("{rel}:{}: table row outside a table", i + 1));
                }
                in_table = true;
                if rel == "README.md" && line.chars().count() > 300 {
                    bad.push(format!("{rel}:{}: table row over 300 characters", i + 1));
                }
            } else {
                in_table = false;
            }
        }
    }
    assert!(bad.is_empty(), "markdown tables: {bad:#?}");
}

/// The `](target)` links of a line.
fn links(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = line;
    while let Some(i) = rest.find("](") {
        let tail = &rest[i + 2..];
        if let Some(j) = tail.find(')') {
            out.push(tail[..j].to_string());
            rest = &tail[j..];
        } else {
            break;
        }
    }
    out
}

#[test]
fn relative_links_resolve() {
    let mut bad = Vec::new();
    for path in markdown_files() {
        let text = std::fs::read_to_string(&path).unwrap();
        let rel = path.strip_prefix(root()).unwrap().display().to_string();
        for (no, line) in prose_lines(&text) {
            for target in links(line) {
                if target.contains("://")
                    || target.starts_with('#')
                    || target.starts_with("mailto:")
                {
                    continue;
                }
                let file = target.split('#').next().unwrap();
                let resolved = path.parent().unwrap().join(file);
                if !resolved.exists() {
                    bad.push(format!("{rel}:{no}: {target}"));
                }
            }
        }
    }
    assert!(
        bad.is_empty(),
        "relative links that do not resolve: {bad:#?}"
    );
}

#[test]
fn docs_scripts_exist() {
    // docs/ may name old script names only in the history (docs/results/).
    let exists = |name: &str| root().join("scripts").join(name).is_file();
    let mut bad = Vec::new();
    for path in markdown_files() {
        let rel = path.strip_prefix(root()).unwrap().display().to_string();
        if rel.starts_with("docs/results/") || rel == "bench/RESULTS.md" {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        for name in scripts_named(&text) {
            if !exists(&name) {
                bad.push(format!("{rel}: scripts/{name}"));
            }
        }
    }
    assert!(
        bad.is_empty(),
        "docs name scripts that do not exist: {bad:?}"
    );
}
