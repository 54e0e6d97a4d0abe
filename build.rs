//! Generates `include/transformer_engine_comm.h` with cbindgen.
//!
//! The C enums come from `src/ffi/c_enums.in`, the same table that defines the Rust
//! types, so the header and the library can never disagree on a value. The header is
//! committed; CI rebuilds it and fails when the committed copy is stale.
use std::fmt::Write as _;
use std::path::PathBuf;

macro_rules! c_enums {
    ($( $(#[doc = $doc:literal])* $name:ident { $($var:ident = $val:literal),* $(,)? } )*) => {{
        let mut s = String::new();
        $(
            $( writeln!(s, "/**{} */", $doc).unwrap(); )*
            writeln!(s, "typedef enum {} {{", stringify!($name)).unwrap();
            $( writeln!(s, "  {} = {},", stringify!($var), $val).unwrap(); )*
            writeln!(s, "}} {};\n", stringify!($name)).unwrap();
        )*
        s
    }};
}

/// The C enum `NVTECommTransport` from the transport table's rows (the unit tests' rows,
/// `#[cfg(test)]`, are left out: a build script is not a test), and the enum it follows.
macro_rules! transport_table {
    (
        $(#[doc = $doc:literal])*
        after $after:ident;
        auto: $auto:ident = $auto_val:literal;
        $( $(#[$m:meta])* $var:ident = $val:literal, $name:literal => $($ctor:ident)::+ ; )*
    ) => {{
        let mut s = String::new();
        $( writeln!(s, "/**{} */", $doc).unwrap(); )*
        writeln!(s, "typedef enum NVTECommTransport {{").unwrap();
        writeln!(s, "  {} = {},", stringify!($auto), $auto_val).unwrap();
        $(
            $(#[$m])*
            writeln!(s, "  {} = {},", stringify!($var), $val).unwrap();
        )*
        writeln!(s, "}} NVTECommTransport;\n").unwrap();
        (s, stringify!($after))
    }};
}

/// `enums` with the transport enum `t` placed after the enum `after`.
fn with_transport_enum(enums: &str, (t, after): (String, &str)) -> String {
    let end = format!("}} {after};\n\n");
    let at = enums
        .find(&end)
        .map(|i| i + end.len())
        .unwrap_or_else(|| panic!("src/transport/table.in: no enum {after} to follow"));
    format!("{}{t}{}", &enums[..at], &enums[at..])
}

const PRELUDE: &str = r#"
/* CUDA and NCCL handle types, declared compatibly with the real headers so that
 * including cuda_runtime.h / nccl.h before or after this header also compiles. */
#if !defined(__DRIVER_TYPES_H__) && !defined(TE_COMM_NO_CUDA_TYPEDEFS)
typedef struct CUstream_st *cudaStream_t;
#endif
#if !defined(NCCL_H_) && !defined(TE_COMM_NO_NCCL_TYPEDEFS)
typedef struct ncclComm *ncclComm_t;
#endif
"#;

fn main() {
    let crate_dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap());
    println!("cargo:rerun-if-changed=src");
    println!("cargo:rerun-if-changed=cbindgen.toml");
    println!("cargo:rerun-if-changed=build.rs");
    // A proper SONAME, so that executables record "libtransformer_engine_comm.so"
    // rather than the path they were linked against.
    if std::env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("linux") {
        println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libtransformer_engine_comm.so");
    }

    let enums: String = include!("src/ffi/c_enums.in");
    let enums = with_transport_enum(&enums, include!("src/transport/table.in"));
    let mut config = cbindgen::Config::from_file(crate_dir.join("cbindgen.toml"))
        .expect("cbindgen.toml must parse");
    config.after_includes = Some(format!("{PRELUDE}\n{enums}"));

    let out = crate_dir.join("include").join("transformer_engine_comm.h");
    let bindings = cbindgen::Builder::new()
        .with_crate(&crate_dir)
        .with_config(config)
        .generate()
        .expect("cbindgen failed to generate the C header");
    // write_to_file only rewrites when the content changed (keeps mtimes stable).
    bindings.write_to_file(&out);
}
