//! The scripts in scripts/, checked on the host: each is named by what it checks (no issue
//! or other bare numbers in a name), and each answers `--help` with its usage text and exit
//! status 0 before doing any work: no file written, no GPU, build or MPI tool started.
//!
//! Each script runs from a copy of scripts/ in a temporary folder (its repository root then
//! holds nothing else, so every file a script writes shows), with a clean environment and a
//! PATH whose first folder holds stand-ins for the tools a script's work would start
//! (nvidia-smi, cargo, cmake, mpirun, ...): each stand-in leaves a file and fails.
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The tools a script's work starts; with `--help`, none may run.
const TOOLS: &[&str] = &[
    "nvidia-smi",
    "cargo",
    "cmake",
    "ctest",
    "mpirun",
    "nvcc",
    "python3",
    "pip",
    "torchrun",
];

/// The library's helper, sourced by the others: not a script of its own.
const HELPERS: &[&str] = &["common.sh"];

/// The seconds one `--help` may take.
const HELP_LIMIT: Duration = Duration::from_secs(20);

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The file names of scripts/*.sh, sorted.
fn script_names() -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(repo().join("scripts"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".sh"))
        .collect();
    names.sort();
    names
}

/// Every file and folder under `dir`, relative to it.
fn tree(dir: &Path) -> BTreeSet<PathBuf> {
    fn walk(base: &Path, dir: &Path, out: &mut BTreeSet<PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            out.insert(p.strip_prefix(base).unwrap().to_path_buf());
            if p.is_dir() && !p.is_symlink() {
                walk(base, &p, out);
            }
        }
    }
    let mut out = BTreeSet::new();
    walk(dir, dir, &mut out);
    out
}

/// A fresh sandbox: `root/scripts` (a copy of scripts/), `root/work` (the working folder),
/// `stubs` (the stand-in tools, each writing `root/ran-TOOL` when started).
fn sandbox(tag: &str) -> PathBuf {
    let dir =
        std::env::temp_dir().join(format!("te_comm_scripts_help_{}_{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let (root, stubs) = (dir.join("root"), dir.join("stubs"));
    for d in [root.join("scripts"), root.join("work"), stubs.clone()] {
        std::fs::create_dir_all(d).unwrap();
    }
    for name in script_names() {
        std::fs::copy(
            repo().join("scripts").join(&name),
            root.join("scripts").join(&name),
        )
        .unwrap();
    }
    for tool in TOOLS {
        let stub = stubs.join(tool);
        let marker = root.join(format!("ran-{tool}"));
        let body = format!("#!/bin/sh\ntouch '{}'\nexit 1\n", marker.display());
        std::fs::write(&stub, body).unwrap();
        let mut perm = std::fs::metadata(&stub).unwrap().permissions();
        std::os::unix::fs::PermissionsExt::set_mode(&mut perm, 0o755);
        std::fs::set_permissions(&stub, perm).unwrap();
    }
    dir
}

/// `bash scripts/NAME ARG` in the sandbox: (exit status, stdout + stderr); None on a
/// timeout (the script is then killed).
fn run_script(dir: &Path, name: &str, arg: &str) -> Option<(i32, String)> {
    let root = dir.join("root");
    let path = format!("{}:/usr/bin:/bin", dir.join("stubs").display());
    let mut child = Command::new("/bin/bash")
        .arg(root.join("scripts").join(name))
        .arg(arg)
        .current_dir(root.join("work"))
        .env_clear()
        .env("PATH", path)
        .env("HOME", root.join("work"))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("bash runs");
    let t0 = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if t0.elapsed() > HELP_LIMIT {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    Some((out.status.code().unwrap_or(-1), text))
}

/// What is wrong with one script's answer to `arg` (empty: nothing).
fn help_problems(dir: &Path, name: &str, arg: &str) -> Vec<String> {
    let root = dir.join("root");
    let before = tree(&root);
    let Some((code, text)) = run_script(dir, name, arg) else {
        return vec![format!("{name} {arg}: no answer in {HELP_LIMIT:?}")];
    };
    let mut bad = Vec::new();
    let head: String = text.lines().take(8).collect::<Vec<_>>().join("\n");
    if code != 0 {
        bad.push(format!("{name} {arg}: exit status {code}:\n{head}"));
    }
    if !text.to_lowercase().contains("usage") {
        bad.push(format!("{name} {arg}: no usage text:\n{head}"));
    }
    if text.lines().count() < 3 {
        bad.push(format!("{name} {arg}: a help text of under 3 lines"));
    }
    let made: Vec<String> = tree(&root)
        .difference(&before)
        .map(|p| p.display().to_string())
        .collect();
    // (removed again, so that the next script's own traces show)
    for p in made.iter().rev() {
        let p = root.join(p);
        let _ = std::fs::remove_file(&p).or_else(|_| std::fs::remove_dir_all(&p));
    }
    if !made.is_empty() {
        bad.push(format!("{name} {arg}: wrote or ran {made:?}"));
    }
    bad.extend(
        numbered_mentions(&text)
            .into_iter()
            .map(|m| format!("{name} {arg}: names {m:?}")),
    );
    bad
}

/// Mentions of an issue, a seed or a session by number ("issue 21", "issue #22",
/// "seed-002", "thirteenth session"): a script says what it checks instead.
fn numbered_mentions(text: &str) -> Vec<String> {
    let lower = text.to_lowercase();
    let words: Vec<&str> = lower
        .split(|c: char| !(c.is_alphanumeric() || c == '#'))
        .filter(|w| !w.is_empty())
        .collect();
    let number = |w: &str| {
        let w = w.trim_start_matches('#');
        !w.is_empty() && w.chars().all(|c| c.is_ascii_digit())
    };
    let glued = |w: &str, stem: &str| w.strip_prefix(stem).is_some_and(number);
    let mut found = Vec::new();
    for (i, w) in words.iter().enumerate() {
        let next = words.get(i + 1).copied().unwrap_or("");
        for stem in ["issue", "seed"] {
            if (*w == stem && number(next)) || glued(w, stem) {
                found.push(format!("{w} {next}"));
            }
        }
        let ordinal = ["first", "second", "third"].contains(w) || w.ends_with("th");
        if next == "session" && (ordinal || number(w)) {
            found.push(format!("{w} session"));
        }
    }
    found
}

#[test]
fn script_names_say_what_they_check() {
    let names = script_names();
    assert!(names.len() >= 10, "scripts/*.sh: {names:?}");
    let mut bad = Vec::new();
    for name in &names {
        let stem = name.trim_end_matches(".sh");
        let numbered = stem
            .split(['-', '_', '.'])
            .any(|seg| !seg.is_empty() && seg.chars().all(|c| c.is_ascii_digit()));
        if stem.to_lowercase().contains("issue") || numbered {
            bad.push(name.clone());
        }
    }
    assert!(bad.is_empty(), "scripts named by a number: {bad:?}");
}

#[test]
fn every_script_answers_help_without_work() {
    let dir = sandbox("help");
    let mut bad = Vec::new();
    for name in script_names() {
        if HELPERS.contains(&name.as_str()) {
            continue;
        }
        bad.extend(help_problems(&dir, &name, "--help"));
    }
    // The short form too, on a script that reads its own options and on one that does not.
    for name in ["bench.sh", "fused-gpu.sh"] {
        bad.extend(help_problems(&dir, name, "-h"));
    }
    let _ = std::fs::remove_dir_all(&dir);
    assert!(bad.is_empty(), "{}", bad.join("\n\n"));
}

#[test]
fn numbered_mentions_are_found() {
    let text = "The issue 21 check; see issue #22, seed-002 and the thirteenth session.";
    assert_eq!(
        numbered_mentions(text),
        ["issue 21", "issue #22", "seed 002", "thirteenth session"]
    );
    assert!(numbered_mentions("the issue's tests, 21 passed; a seed of 7").is_empty());
}
