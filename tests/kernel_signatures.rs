//! The typed launches, checked on the host: every kernel binding of `src/` (a
//! `cuda::Binding<P>`: a source file, a name pattern and the parameter list `P`) names
//! kernels that exist in that file of `kernels/`, and `P` matches each one's C parameter
//! list in count, order, class (pointer, integer, float, struct by value) and size. The C
//! side is read from the `extern "C" __global__` declarations of `kernels/*.cu`, after
//! expanding the function-like macros that instantiate them (`QUANTIZE(f32, F32, ...)`,
//! `REDUCE(...)`, with `##` pasting); by-value struct sizes come from the sources'
//! `static_assert(sizeof(X) == N, ...)`, or else from the struct's definition laid out
//! as C does (fields of scalar, pointer or array-of-scalar type, natural alignment,
//! `__align__(N)`; a struct with any other field has no size, and a kernel taking it
//! fails the check).
mod common;
use common::rs_files;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use transformer_engine_comm::cuda::kernel::pattern_matches;
use transformer_engine_comm::cuda::{ArgClass, ParamInfo, Signature};

/// Every binding of the library.
fn bindings() -> Vec<Signature> {
    let mut v = transformer_engine_comm::kernels::kernel_signatures();
    v.extend(transformer_engine_comm::kernels::block::kernel_signatures());
    v.extend(transformer_engine_comm::overlap::reduce::kernel_signatures());
    v.extend(transformer_engine_comm::transport::ipc::kernel_signatures());
    v.extend(transformer_engine_comm::transport::nccl::kernel_signatures());
    v.extend(transformer_engine_comm::gemm::sm90::kernel_signatures());
    v
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Source with comments removed and backslash-newlines joined (string literals kept).
fn clean(src: &str) -> String {
    let src = src.replace("\\\r\n", " ").replace("\\\n", " ");
    let b = src.as_bytes();
    let (mut out, mut i) = (String::new(), 0);
    while i < b.len() {
        if b[i] == b'"' {
            let start = i;
            i += 1;
            while i < b.len() && b[i] != b'"' {
                i += if b[i] == b'\\' { 2 } else { 1 };
            }
            i = (i + 1).min(b.len());
            out.push_str(&src[start..i]);
        } else if src[i..].starts_with("//") {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if src[i..].starts_with("/*") {
            i = src[i + 2..].find("*/").map_or(b.len(), |e| i + 2 + e + 2);
            out.push(' ');
        } else {
            let c = src[i..].chars().next().unwrap();
            out.push(c);
            i += c.len_utf8();
        }
    }
    out
}

/// A function-like macro: parameters and body.
type Macros = HashMap<String, (Vec<String>, String)>;

/// The function-like `#define`s of `text`, and the text without its directive lines.
fn split_directives(text: &str) -> (Macros, String) {
    let (mut macros, mut rest) = (Macros::new(), String::new());
    for line in text.lines() {
        let t = line.trim_start();
        let Some(d) = t.strip_prefix('#') else {
            rest.push_str(line);
            rest.push('\n');
            continue;
        };
        let Some(def) = d.trim_start().strip_prefix("define") else {
            continue;
        };
        let def = def.trim_start();
        let name: String = def.chars().take_while(is_ident).collect();
        let Some(after) = def[name.len()..].strip_prefix('(') else {
            continue; // object-like: not needed for names or parameter lists
        };
        let close = after.find(')').expect("macro parameter list");
        let params = after[..close]
            .split(',')
            .map(|p| p.trim().to_string())
            .filter(|p| !p.is_empty())
            .collect();
        macros.insert(name, (params, after[close + 1..].to_string()));
    }
    (macros, rest)
}

fn is_ident(c: &char) -> bool {
    c.is_ascii_alphanumeric() || *c == '_'
}

/// The arguments of a call whose `(` is at `open`: (arguments, index after `)`). Commas
/// and parentheses inside string literals (`"1, 1"`) are the string's.
fn call_args(s: &str, open: usize) -> (Vec<String>, usize) {
    let (mut depth, mut args, mut start) = (0, Vec::new(), open + 1);
    let mut in_str = false;
    let mut prev = ' ';
    for (i, c) in s[open..].char_indices() {
        let i = open + i;
        let escaped = prev == '\\';
        prev = if escaped { ' ' } else { c };
        if in_str {
            in_str = c != '"' || escaped;
            continue;
        }
        match c {
            '"' => in_str = true,
            '(' => depth += 1,
            ')' => {
                depth -= 1;
                if depth == 0 {
                    args.push(s[start..i].trim().to_string());
                    return (args, i + 1);
                }
            }
            ',' if depth == 1 => {
                args.push(s[start..i].trim().to_string());
                start = i + 1;
            }
            _ => {}
        }
    }
    panic!("unbalanced parentheses after {}", &s[open..open + 40]);
}

/// `text` with every invocation of a function-like macro expanded (arguments substituted
/// as whole identifiers, `##` pasted, the result expanded again).
fn expand(text: &str, macros: &Macros, depth: usize) -> String {
    assert!(depth < 16, "macro expansion too deep");
    let (mut out, mut i) = (String::new(), 0);
    while i < text.len() {
        let c = text[i..].chars().next().unwrap();
        if c == '"' {
            let end = text[i + 1..]
                .find('"')
                .map_or(text.len(), |e| i + 1 + e + 1);
            out.push_str(&text[i..end]);
            i = end;
            continue;
        }
        if !(c.is_ascii_alphabetic() || c == '_') {
            out.push(c);
            i += c.len_utf8();
            continue;
        }
        let ident: String = text[i..].chars().take_while(is_ident).collect();
        let after = i + ident.len();
        let open = after + (text[after..].len() - text[after..].trim_start().len());
        match macros.get(&ident) {
            Some((params, body)) if text[open..].starts_with('(') => {
                let (args, end) = call_args(text, open);
                let args = if params.is_empty() { vec![] } else { args };
                assert_eq!(args.len(), params.len(), "arguments of {ident}");
                let subst = substitute(body, params, &args).replace("##", "\u{0}");
                let pasted = subst
                    .split('\u{0}')
                    .map(str::trim)
                    .collect::<Vec<_>>()
                    .join("");
                out.push_str(&expand(&pasted, macros, depth + 1));
                out.push(' ');
                i = end;
            }
            _ => {
                out.push_str(&ident);
                i = after;
            }
        }
    }
    out
}

/// `body` with each identifier that is a parameter replaced by its argument.
fn substitute(body: &str, params: &[String], args: &[String]) -> String {
    let (mut out, mut i) = (String::new(), 0);
    while i < body.len() {
        let c = body[i..].chars().next().unwrap();
        if c.is_ascii_alphanumeric() || c == '_' {
            let word: String = body[i..].chars().take_while(is_ident).collect();
            match params.iter().position(|p| *p == word) {
                Some(k) if !c.is_ascii_digit() => out.push_str(&args[k]),
                _ => out.push_str(&word),
            }
            i += word.len();
        } else {
            out.push(c);
            i += c.len_utf8();
        }
    }
    out
}

/// One C parameter: its class and size (0: a struct of unknown size).
fn c_param(decl: &str, structs: &HashMap<String, usize>) -> Result<ParamInfo, String> {
    let decl = decl.trim();
    // Drop the parameter's name (the last identifier), keep the type.
    let ty = decl
        .trim_end_matches(|c: char| is_ident(&c))
        .trim()
        .to_string();
    let (class, size) = if ty.contains('*') {
        (ArgClass::Pointer, 8)
    } else {
        let words: Vec<&str> = ty
            .split_whitespace()
            .filter(|w| {
                !matches!(
                    *w,
                    "const" | "volatile" | "__restrict__" | "__grid_constant__"
                )
            })
            .collect();
        match words.join(" ").as_str() {
            "int" | "unsigned" | "unsigned int" | "u32" | "int32_t" | "uint32_t" => {
                (ArgClass::Int, 4)
            }
            "long long" | "unsigned long long" | "u64" | "size_t" | "int64_t" | "uint64_t" => {
                (ArgClass::Int, 8)
            }
            "float" => (ArgClass::Float, 4),
            "double" => (ArgClass::Float, 8),
            name => match structs.get(name) {
                Some(&n) => (ArgClass::Struct, n),
                None => return Err(format!("parameter `{decl}`: unknown type `{name}`")),
            },
        }
    };
    Ok(ParamInfo { class, size })
}

/// A kernel's C parameters (or why one could not be read).
type CParams = Result<Vec<ParamInfo>, String>;

/// The `extern "C" __global__` kernels of expanded source `text`, by name.
fn kernels_of(text: &str, structs: &HashMap<String, usize>) -> BTreeMap<String, CParams> {
    let mut found = BTreeMap::new();
    let key = "extern \"C\"";
    let mut rest = text;
    while let Some(p) = rest.find(key) {
        rest = &rest[p + key.len()..];
        let t = rest.trim_start();
        let Some(mut t) = t.strip_prefix("__global__") else {
            continue;
        };
        // void, __launch_bounds__(...), then the name and its parameter list.
        let name = loop {
            t = t.trim_start();
            let word: String = t.chars().take_while(is_ident).collect();
            assert!(!word.is_empty(), "kernel declaration at {}", &t[..40]);
            t = t[word.len()..].trim_start();
            match word.as_str() {
                "void" => {}
                "__launch_bounds__" => t = &t[call_args(t, 0).1..],
                _ => break word,
            }
        };
        assert!(t.starts_with('('), "kernel {name}: no parameter list");
        let (args, _) = call_args(t, 0);
        let params = args
            .iter()
            .filter(|a| !a.is_empty() && a.as_str() != "void")
            .map(|a| c_param(a, structs))
            .collect();
        found.insert(name, params);
    }
    found
}

/// `sizeof(X) == N` of every `static_assert` in `text`.
fn struct_sizes(text: &str, sizes: &mut HashMap<String, usize>) {
    for part in text.split("static_assert(sizeof(").skip(1) {
        let Some((name, rest)) = part.split_once(')') else {
            continue;
        };
        let Some(n) = rest.trim_start().strip_prefix("==") else {
            continue;
        };
        let digits: String = n
            .trim_start()
            .chars()
            .take_while(char::is_ascii_digit)
            .collect();
        let after = n.trim_start()[digits.len()..].trim_start();
        // Only plain numbers (an expression such as `32 + 16 * MAX_PEERS` is skipped).
        if !digits.is_empty() && after.starts_with(',') {
            sizes.insert(name.trim().to_string(), digits.parse().unwrap());
        }
    }
}

/// A field's C size and alignment (None: not a scalar or pointer type).
fn field_type(ty: &str) -> Option<usize> {
    if ty.contains('*') {
        return Some(8);
    }
    let words: Vec<&str> = ty
        .split_whitespace()
        .filter(|w| !matches!(*w, "const" | "volatile"))
        .collect();
    Some(match words.join(" ").as_str() {
        "u8" | "char" | "unsigned char" | "uint8_t" | "bool" => 1,
        "u16" | "short" | "unsigned short" | "uint16_t" => 2,
        "int" | "unsigned" | "unsigned int" | "u32" | "int32_t" | "uint32_t" | "float" => 4,
        "u64" | "long long" | "unsigned long long" | "uint64_t" | "int64_t" | "size_t"
        | "double" => 8,
        _ => return None,
    })
}

/// The fields of `struct name { ... }` in `text` laid out as C does: (name, offset, size)
/// each, and the struct's size (None: no such struct, or a field this reading does not
/// know).
/// Fields (name, offset, size) and the struct's size.
type Layout = (Vec<(String, usize, usize)>, usize);

fn struct_layout(text: &str, name: &str) -> Option<Layout> {
    let mut at = 0;
    let (align, body) = loop {
        let p = at + text[at..].find("struct ")?;
        at = p + 7;
        let mut rest = text[at..].trim_start();
        let mut align = 1;
        if let Some(r) = rest.strip_prefix("__align__(") {
            let close = r.find(')')?;
            align = r[..close].trim().parse().ok()?;
            rest = r[close + 1..].trim_start();
        }
        let Some(r) = rest.strip_prefix(name) else {
            continue;
        };
        let r = r.trim_start();
        if let Some(r) = r.strip_prefix('{') {
            break (align, &r[..r.find('}')?]);
        }
    };
    let (mut fields, mut off, mut max_align) = (Vec::new(), 0usize, align);
    for decl in body.split(';').map(str::trim).filter(|d| !d.is_empty()) {
        // `type a, *b, c[4]`: the type is the first declarator's words but its name.
        let mut parts = decl.split(',');
        let first = parts.next()?.trim();
        let name_start = first.rfind(|c: char| !(is_ident(&c) || c == '[' || c == ']'))? + 1;
        let base = first[..name_start].trim_end_matches('*').trim().to_string();
        let mut decls = vec![first[name_start..].to_string()];
        let stars0 = first[..name_start].matches('*').count();
        let mut stars = vec![stars0];
        for d in parts {
            let d = d.trim();
            stars.push(d.matches('*').count());
            decls.push(d.trim_start_matches('*').trim().to_string());
        }
        for (d, st) in decls.iter().zip(stars) {
            let (fname, count) = match d.split_once('[') {
                Some((n, c)) => (
                    n.trim(),
                    c.trim_end_matches(']').trim().parse::<usize>().ok()?,
                ),
                None => (d.as_str(), 1),
            };
            let ty = if st > 0 {
                format!("{base} *")
            } else {
                base.clone()
            };
            let sz = field_type(&ty)?;
            off = off.div_ceil(sz) * sz;
            fields.push((fname.to_string(), off, sz * count));
            off += sz * count;
            max_align = max_align.max(sz);
        }
    }
    Some((fields, off.div_ceil(max_align) * max_align))
}

/// The size of every struct defined in `text` that `static_assert` did not size already.
fn struct_defs(text: &str, sizes: &mut HashMap<String, usize>) {
    for part in text.split("struct ").skip(1) {
        let t = part.trim_start();
        let t = match t.strip_prefix("__align__(") {
            Some(r) => r.split_once(')').map_or("", |x| x.1).trim_start(),
            None => t,
        };
        let name: String = t.chars().take_while(is_ident).collect();
        if name.is_empty() || sizes.contains_key(&name) {
            continue;
        }
        if let Some((_, n)) = struct_layout(text, &name) {
            sizes.insert(name, n);
        }
    }
}

/// The kernels of every `kernels/*.cu`, by file name, then kernel name.
fn c_kernels() -> BTreeMap<String, BTreeMap<String, CParams>> {
    let dir = root().join("kernels");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    let text = |p: &Path| clean(&std::fs::read_to_string(p).unwrap());
    let mut sizes = HashMap::new();
    for f in &files {
        struct_sizes(&text(f), &mut sizes);
    }
    for f in &files {
        struct_defs(&text(f), &mut sizes);
    }
    files
        .iter()
        .filter(|f| f.extension().is_some_and(|e| e == "cu"))
        .map(|f| {
            let (macros, rest) = split_directives(&text(f));
            let name = f.file_name().unwrap().to_str().unwrap().to_string();
            (name, kernels_of(&expand(&rest, &macros, 0), &sizes))
        })
        .collect()
}

fn show(p: &[ParamInfo]) -> String {
    let v: Vec<String> = p
        .iter()
        .map(|x| format!("{:?}:{}", x.class, x.size))
        .collect();
    format!("({})", v.join(", "))
}

/// The reading of the sources itself: known kernels with known parameter lists.
#[test]
fn the_kernel_sources_are_read_as_the_compiler_sees_them() {
    let k = c_kernels();
    let (cast, comm) = (&k["cast.cu"], &k["comm.cu"]);
    use ArgClass::*;
    let p = |c, s| ParamInfo { class: c, size: s };
    // A macro instance (QUANTIZE_FROM -> QUANTIZE), one nested in __launch_bounds__, a
    // plain kernel, and by-value structs.
    assert_eq!(
        cast["quantize_bf16_e4m3"].as_ref().unwrap(),
        &[
            p(Pointer, 8),
            p(Pointer, 8),
            p(Int, 8),
            p(Pointer, 8),
            p(Pointer, 8),
            p(Pointer, 8)
        ]
    );
    assert_eq!(cast["ct2_vec_f16_e5m2"].as_ref().unwrap().len(), 11);
    assert!(cast.contains_key("ct2x_tr64_g0_pf1_cs0_m6"));
    assert_eq!(
        cast["scale_from_amax"].as_ref().unwrap(),
        &[
            p(Pointer, 8),
            p(Pointer, 8),
            p(Float, 4),
            p(Int, 4),
            p(Float, 4),
            p(Pointer, 8)
        ]
    );
    assert_eq!(comm["copy_segments"].as_ref().unwrap(), &[p(Struct, 392)]);
    assert_eq!(
        comm["reduce_e5m2_f32_v1"].as_ref().unwrap()[2],
        p(Struct, 136)
    );
    assert_eq!(comm["wait_flags"].as_ref().unwrap()[0], p(Struct, 200));
    // Every REDUCE(...) line gives two kernels; every dtype pair of QUANTIZE_FROM one.
    assert_eq!(
        comm.keys().filter(|n| n.starts_with("reduce_")).count(),
        2 * 17
    );
    assert_eq!(
        cast.keys()
            .filter(|n| pattern_matches("quantize_{}_{}", n))
            .count(),
        15
    );
}

/// Our GEMM's argument struct: the Rust mirror (`gemm::sm90::Gemm90Args`) has the C
/// struct's fields, in order, at the same offsets and sizes; its tensor map is 128 bytes;
/// and the kernels take (map, map, args) by value.
#[test]
fn the_gemm_argument_struct_is_mirrored_field_for_field() {
    let text = clean(&std::fs::read_to_string(root().join("kernels/gemm_sm90.cu")).unwrap());
    let (c_fields, c_size) = struct_layout(&text, "Gemm90Args").expect("struct Gemm90Args");
    let rust: Vec<(String, usize, usize)> = transformer_engine_comm::gemm::sm90::args_layout()
        .into_iter()
        .map(|(n, o, s)| (n.to_string(), o, s))
        .collect();
    assert_eq!(c_fields, rust);
    assert_eq!(
        c_size,
        std::mem::size_of::<transformer_engine_comm::gemm::sm90::Gemm90Args>()
    );
    assert_eq!(struct_layout(&text, "GemmTmaDesc").unwrap().1, 128);
    let k = c_kernels();
    let p = |s| ParamInfo {
        class: ArgClass::Struct,
        size: s,
    };
    assert_eq!(
        k["gemm_sm90.cu"]["gemm_sm90_tn_e4m3_e4m3_f32_128"]
            .as_ref()
            .unwrap(),
        &[p(128), p(128), p(160)]
    );
    assert_eq!(
        k["gemm_sm90.cu"]
            .keys()
            .filter(|n| pattern_matches("gemm_sm90_tn_{}_{}_{}_{}", n))
            .count(),
        10
    );
}

/// Each binding names kernels of its file, and its parameter list is theirs.
#[test]
fn every_binding_matches_its_kernels_parameter_lists() {
    let k = c_kernels();
    let mut errors = Vec::new();
    for b in bindings() {
        let Some(file) = k.get(b.file) else {
            errors.push(format!("{}: no kernels/{}", b.pattern, b.file));
            continue;
        };
        let matching: Vec<_> = file
            .iter()
            .filter(|(n, _)| pattern_matches(b.pattern, n))
            .collect();
        if matching.is_empty() {
            errors.push(format!(
                "{}: no kernel of {} has that name",
                b.pattern, b.file
            ));
        }
        for (name, c) in matching {
            match c {
                Err(e) => errors.push(format!("{name} ({}): {e}", b.file)),
                Ok(c) if c.as_slice() != b.params => errors.push(format!(
                    "{name} ({}): the C parameters are {} but the binding {} takes {}",
                    b.file,
                    show(c),
                    b.pattern,
                    show(b.params)
                )),
                Ok(_) => {}
            }
        }
    }
    assert!(errors.is_empty(), "{}", errors.join("\n"));
}

fn code_of(p: &Path) -> String {
    common::code_without_comments(p)
}

/// Every launch is typed: the only raw launches are in src/cuda/kernel.rs, and every
/// binding in src/ is among those this test checks.
#[test]
fn every_launch_goes_through_a_checked_binding() {
    let src = root().join("src");
    let mut files = Vec::new();
    rs_files(&src, &mut files);
    let (mut declared, mut raw) = (0, Vec::new());
    for f in &files {
        let code = code_of(f);
        if f.ends_with("cuda/kernel.rs") {
            continue; // the launch primitives and their unit tests
        }
        if f.ends_with("cuda/entry_points.rs") {
            continue; // the table of the driver's entry points names them, calls none
        }
        declared += code.matches("Binding::new(").count();
        if code.contains("cuLaunchKernel") || code.contains("cuLaunchCooperativeKernel") {
            raw.push(f.display().to_string());
        }
    }
    assert!(
        raw.is_empty(),
        "raw launches outside src/cuda/kernel.rs: {raw:?}"
    );
    assert_eq!(
        declared,
        bindings().len(),
        "src/ declares {declared} kernel bindings but the modules' kernel_signatures() list {}: add the new one to its module's list",
        bindings().len()
    );
}

/// The own GEMM's kernels (kernels/gemm_sm90.cu) follow its naming scheme,
/// gemm_sm90_<layout>_<a>_<b>_<out>_<BN>[_<variant>], and all take (tensor map B, tensor
/// map A, Gemm90Args) by value: hosts build kernel names from the scheme.
#[test]
fn own_gemm_kernels_follow_the_naming_scheme() {
    let k = c_kernels();
    let gemm = &k["gemm_sm90.cu"];
    let p = |c, s| ParamInfo { class: c, size: s };
    let params = [
        p(ArgClass::Struct, 128),
        p(ArgClass::Struct, 128),
        p(ArgClass::Struct, 160),
    ];
    let types = ["bf16", "f16", "e4m3", "e5m2"];
    let mut count = 0;
    for (name, c) in gemm {
        let parts: Vec<&str> = name.split('_').collect();
        assert!(
            (7..=8).contains(&parts.len()) && parts[0] == "gemm" && parts[1] == "sm90",
            "{name}: not gemm_sm90_<layout>_<a>_<b>_<out>_<BN>[_<variant>]"
        );
        assert!(["tn", "nn", "nt"].contains(&parts[2]), "{name}: layout");
        assert!(
            types.contains(&parts[3]) && types.contains(&parts[4]),
            "{name}: input types"
        );
        assert!(
            types.contains(&parts[5]) || parts[5] == "f32",
            "{name}: output type"
        );
        assert!(["128", "256", "192"].contains(&parts[6]), "{name}: BN");
        if parts[6] == "192" {
            assert!(
                parts.len() == 7 && parts[5] == "bf16",
                "{name}: BN 192 is plain, bf16 out"
            );
        }
        if parts.len() == 8 {
            assert!(
                ["epi", "fpacc", "block"].contains(&parts[7]),
                "{name}: variant"
            );
        }
        assert_eq!(
            c.as_ref().unwrap().as_slice(),
            &params,
            "{name}: parameters"
        );
        count += 1;
    }
    assert_eq!(count, 67, "the instantiation list of the header");
}
