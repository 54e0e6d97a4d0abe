//! The transport table (`src/transport/table.in`) is the one place a transport's identity
//! is written: the header's `NVTECommTransport` is generated from it (checked here
//! against the committed header), and the Python package's `Transport` enum and the
//! NVTE_COMM_TRANSPORT documentation must name the same transports with the same values.
mod common;
use std::path::Path;

fn read(rel: &str) -> String {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(rel)).unwrap()
}

/// The table's public rows as (C enumerator, value, name), auto first; the unit tests'
/// rows (`#[cfg(test)]`) left out.
fn table() -> Vec<(String, u32, String)> {
    let code = common::code_without_comments(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("src/transport/table.in"),
    );
    let mut rows = Vec::new();
    let mut test_only = false;
    for line in code.lines().map(str::trim) {
        if line == "#[cfg(test)]" {
            test_only = true;
            continue;
        }
        let row = line.strip_prefix("auto:").unwrap_or(line).trim();
        let Some((var, rest)) = row.split_once(" = ") else {
            continue;
        };
        let value: String = rest.chars().take_while(|c| c.is_ascii_digit()).collect();
        let name = match rest.split_once('"') {
            Some((_, n)) => n.split('"').next().unwrap().to_string(),
            None => "auto".to_string(),
        };
        if !std::mem::take(&mut test_only) {
            rows.push((var.to_string(), value.parse().unwrap(), name));
        }
    }
    rows
}

#[test]
fn the_table_has_auto_and_the_transports() {
    let t = table();
    let names: Vec<&str> = t.iter().map(|r| r.2.as_str()).collect();
    assert_eq!(names[0], "auto");
    assert!(
        names.contains(&"ipc") && names.contains(&"nccl"),
        "{names:?}"
    );
    assert!(
        !names.contains(&"fake"),
        "the fake transport is the unit tests' only"
    );
    for (i, (var, value, name)) in t.iter().enumerate() {
        assert_eq!(*value as usize, i, "{var}: the values are the rows' order");
        assert_eq!(*var, format!("NVTE_COMM_TRANSPORT_{}", name.to_uppercase()));
    }
}

#[test]
fn the_header_enum_is_the_table() {
    let h = read("include/transformer_engine_comm.h");
    let start = h
        .find("typedef enum NVTECommTransport {")
        .expect("NVTECommTransport in the header");
    let body = &h[start..start + h[start..].find("} NVTECommTransport;").unwrap()];
    let got: Vec<String> = body
        .lines()
        .skip(1)
        .map(|l| l.trim().trim_end_matches(',').to_string())
        .collect();
    let want: Vec<String> = table()
        .iter()
        .map(|(var, v, _)| format!("{var} = {v}"))
        .collect();
    assert_eq!(got, want);
}

/// `class Transport(enum.IntEnum)` of python/transformer_engine_comm/_core.py: its
/// members, in order.
fn python_transport_enum() -> Vec<(String, u32)> {
    let py = read("python/transformer_engine_comm/_core.py");
    let start = py
        .find("class Transport(enum.IntEnum):")
        .expect("_core.py defines Transport");
    let mut members = Vec::new();
    for line in py[start..].lines().skip(1) {
        if !line.is_empty() && !line.starts_with(' ') {
            break; // the next top-level statement
        }
        if let Some((k, v)) = line.trim().split_once(" = ") {
            members.push((k.to_string(), v.trim().parse().unwrap()));
        }
    }
    members
}

#[test]
fn the_python_enum_is_the_table() {
    let want: Vec<(String, u32)> = table().into_iter().map(|(k, v, _)| (k, v)).collect();
    let got = python_transport_enum();
    assert_eq!(
        got,
        want,
        "python/transformer_engine_comm/_core.py's Transport differs from src/transport/table.in; it should read:\n{}",
        want.iter()
            .map(|(k, v)| format!("    {k} = {v}"))
            .collect::<Vec<_>>()
            .join("\n")
    );
}

#[test]
fn the_knob_documentation_names_the_table() {
    let doc = read("docs/knobs.md");
    let row = doc
        .lines()
        .find(|l| l.starts_with("| `NVTE_COMM_TRANSPORT` |"))
        .expect("NVTE_COMM_TRANSPORT in docs/knobs.md");
    for (_, _, name) in table() {
        assert!(row.contains(&format!("`{name}`")), "{name} missing: {row}");
    }
}
