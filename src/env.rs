//! The library's environment knobs, parsed strictly, all in one table: [`KNOBS`].
//!
//! This module is the only one that reads the environment (tests/env_table.rs checks it):
//! every other module reads a knob through its entry here ([`TIMEOUT_MS`]`.get()`, ...),
//! never by a name. Every knob is read by the call that uses it; a value that does not
//! parse, is out of range or would be truncated is an NVTE_COMM_ERROR_INVALID_ARGUMENT of
//! that call, naming the variable and its value (never ignored, never wrapped). Unset, or
//! set to an empty (all-blank) value, means the documented default. Surrounding blanks
//! are ignored. Booleans: `1`/`0`, also `true`/`false`, `yes`/`no`, `on`/`off` (any case).
use crate::error::{Error, Result};
use std::ffi::OsString;

/// How a knob's value is parsed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// A boolean ([`parse_bool`]).
    Flag,
    /// A decimal integer in `lo..=hi` ([`parse_int`]).
    Int { lo: i128, hi: i128 },
    /// One of these words, any case ([`parse_choice`]); the index of the word.
    Choice(&'static [&'static str]),
    /// One of the words the reader passes (a list another module owns), any case.
    Variants,
    /// A path, taken as set (blank: unset).
    Path,
    /// A path, taken as set even when blank (the NVTX loader's own rule).
    Raw,
}

/// One environment knob: its name, how it parses, its default and what it does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Knob {
    pub name: &'static str,
    pub kind: Kind,
    /// The default (unset or blank), in words.
    pub default: &'static str,
    /// What it does, in one line (docs/knobs.md has the whole story).
    pub doc: &'static str,
}

/// A boolean knob.
pub struct Flag(pub Knob);
/// An integer knob in `lo..=hi`.
pub struct Int<T> {
    pub knob: Knob,
    lo: T,
    hi: T,
}
/// A knob that is one of the table's words.
pub struct Choice(pub Knob);
/// A knob that is one of the reader's words.
pub struct Variants(pub Knob);
/// A path knob (blank: unset).
pub struct Path(pub Knob);
/// A path knob taken as set, blank included.
pub struct Raw(pub Knob);

const fn knob(name: &'static str, kind: Kind, default: &'static str, doc: &'static str) -> Knob {
    Knob {
        name,
        kind,
        default,
        doc,
    }
}

impl Flag {
    const fn new(name: &'static str, default: &'static str, doc: &'static str) -> Flag {
        Flag(knob(name, Kind::Flag, default, doc))
    }
    /// The value; None when unset or blank.
    pub fn get(&self) -> Result<Option<bool>> {
        flag(self.0.name)
    }
}

impl Int<i32> {
    const fn new(
        name: &'static str,
        lo: i32,
        hi: i32,
        default: &'static str,
        doc: &'static str,
    ) -> Self {
        let kind = Kind::Int {
            lo: lo as i128,
            hi: hi as i128,
        };
        Int {
            knob: knob(name, kind, default, doc),
            lo,
            hi,
        }
    }
}

impl Int<i64> {
    const fn new(
        name: &'static str,
        lo: i64,
        hi: i64,
        default: &'static str,
        doc: &'static str,
    ) -> Self {
        let kind = Kind::Int {
            lo: lo as i128,
            hi: hi as i128,
        };
        Int {
            knob: knob(name, kind, default, doc),
            lo,
            hi,
        }
    }
}

impl<T> Int<T>
where
    T: Copy + std::fmt::Display + TryFrom<i128> + Into<i128>,
{
    /// The value; None when unset or blank.
    pub fn get(&self) -> Result<Option<T>> {
        int(self.knob.name, self.lo, self.hi)
    }
}

impl Choice {
    const fn new(
        name: &'static str,
        words: &'static [&'static str],
        default: &'static str,
        doc: &'static str,
    ) -> Choice {
        Choice(knob(name, Kind::Choice(words), default, doc))
    }
    /// The index of the value among the table's words; None when unset or blank.
    pub fn get(&self) -> Result<Option<usize>> {
        match self.0.kind {
            Kind::Choice(words) => choice(self.0.name, words),
            _ => choice(self.0.name, &[]),
        }
    }
}

impl Variants {
    const fn new(name: &'static str, default: &'static str, doc: &'static str) -> Variants {
        Variants(knob(name, Kind::Variants, default, doc))
    }
    /// The index of the value among `words`; None when unset or blank.
    pub fn get(&self, words: &[&str]) -> Result<Option<usize>> {
        choice(self.0.name, words)
    }
}

impl Path {
    const fn new(name: &'static str, default: &'static str, doc: &'static str) -> Path {
        Path(knob(name, Kind::Path, default, doc))
    }
    /// The raw value: None when unset or blank.
    pub fn get(&self) -> Option<OsString> {
        os(self.0.name)
    }
    pub fn name(&self) -> &'static str {
        self.0.name
    }
}

impl Raw {
    const fn new(name: &'static str, default: &'static str, doc: &'static str) -> Raw {
        Raw(knob(name, Kind::Raw, default, doc))
    }
    /// The raw value as set (a blank value included); None when unset.
    pub fn get(&self) -> Option<OsString> {
        std::env::var_os(self.0.name)
    }
}

// The engine's config (`nvte_comm_overlap_config_default`, a NULL config at create).
pub static TIMEOUT_MS: Int<i64> = Int::<i64>::new(
    "NVTE_COMM_TIMEOUT_MS",
    1,
    i64::MAX,
    "60000",
    "timeout of every wait for a peer, ms",
);
pub static OVERLAP_NUM_SPLITS: Int<i32> = Int::<i32>::new(
    "NVTE_COMM_OVERLAP_NUM_SPLITS",
    1,
    64,
    "3",
    "chunks of the pipelined reduce-scatter",
);
pub static OVERLAP_MAX_STREAMS: Int<i32> = Int::<i32>::new(
    "NVTE_COMM_OVERLAP_MAX_STREAMS",
    1,
    8,
    "3",
    "compute streams of the ring all-gather",
);
pub static OVERLAP_NUM_SM: Int<i32> = Int::<i32>::new(
    "NVTE_COMM_OVERLAP_NUM_SM",
    1,
    i32::MAX,
    "16",
    "SMs of communication kernels (below the device's SM count, checked at create)",
);
pub static OVERLAP_USE_CE: Flag = Flag::new(
    "NVTE_COMM_OVERLAP_USE_CE",
    "1",
    "1: copy-engine puts, 0: SM puts",
);
pub static OVERLAP_AGGREGATE: Flag = Flag::new(
    "NVTE_COMM_OVERLAP_AGGREGATE",
    "0",
    "1: bidirectional ring all-gather",
);
pub static OVERLAP_SM_MARGIN: Flag = Flag::new(
    "NVTE_COMM_OVERLAP_SM_MARGIN",
    "1",
    "1: GEMMs leave the comm SMs free while SM kernels communicate",
);
/// NVTE_COMM_TRANSPORT's words: the transport table's names (src/transport/table.in), at
/// the index of their C value.
const TRANSPORT_NAMES: &[&str] = {
    macro_rules! transport_table {
        (
            $(#[doc = $doc:literal])*
            after $after:ident;
            auto: $auto:ident = $auto_val:literal;
            $( $(#[$m:meta])* $var:ident = $val:literal, $name:literal => $($ctor:ident)::+ ; )*
        ) => {
            &["auto", $( $(#[$m])* $name, )*]
        };
    }
    include!("transport/table.in")
};
pub static TRANSPORT: Choice = Choice::new(
    "NVTE_COMM_TRANSPORT",
    TRANSPORT_NAMES,
    "auto",
    "the transport of overlap objects and comm-GEMM contexts (index = the transport's value)",
);
// Read when an overlap object / comm-GEMM context is created.
pub static AR_ALGO: Choice = Choice::new(
    "NVTE_COMM_AR_ALGO",
    &["auto", "ring", "chunked"],
    "auto",
    "GEMM + all-reduce over IPC: ring or chunked",
);
pub static RS_RING: Choice = Choice::new(
    "NVTE_COMM_RS_RING",
    &["auto", "reduce", "accumulate"],
    "auto",
    "how the ring reduce-scatter sums",
);
pub static AG_PIECES: Choice = Choice::new(
    "NVTE_COMM_AG_PIECES",
    &["auto", "rows", "k"],
    "auto",
    "the fused all-gather's pieces: row or K slices",
);
pub static FUSED_TILES: Choice = Choice::new(
    "NVTE_COMM_FUSED_TILES",
    &["auto", "rule", "narrow"],
    "auto",
    "the tile width of the fused algorithms' GEMM",
);
pub static OVERLAP: Choice = Choice::new(
    "NVTE_COMM_OVERLAP",
    &["auto", "on", "off"],
    "auto",
    "overlap the communication with the GEMM (on), never (off: the collective whole, then one GEMM, or the GEMM, then the collective), or as tuned (auto)",
);
pub static TRACE: Flag = Flag::new(
    "NVTE_COMM_TRACE",
    "0",
    "1: print each step's finish time of an object's last call at destroy",
);
pub static CHECK: Flag = Flag::new(
    "NVTE_COMM_CHECK",
    "0",
    "1: every call compares its descriptor with every peer's",
);
pub static REPORT: Flag = Flag::new(
    "NVTE_COMM_REPORT",
    "0",
    "1: per-call overlap report (call time against GEMM-alone and comm-alone)",
);
pub static GEMM_FP8_FAST_ACCUM: Flag = Flag::new(
    "NVTE_COMM_GEMM_FP8_FAST_ACCUM",
    "0",
    "1: comm-GEMM FP8 GEMMs with cuBLASLt's fast accumulation",
);
// The comm-GEMM autotuner (read when a context is created).
pub static TUNE: Choice = Choice::new(
    "NVTE_COMM_TUNE",
    &["0", "1", "force"],
    "1",
    "comm-GEMM autotuning: off, on, or re-tune ignoring the cache",
);
pub static TUNE_BUDGET_MS: Int<i32> = Int::<i32>::new(
    "NVTE_COMM_TUNE_BUDGET_MS",
    1,
    i32::MAX,
    "3000",
    "time for one key's candidates, ms",
);
pub static TUNE_PICK: Int<i32> = Int::<i32>::new(
    "NVTE_COMM_TUNE_PICK",
    0,
    1 << 20,
    "unset: the fastest",
    "tests: use candidate PICK mod (candidates measured)",
);
pub static TUNE_VERBOSE: Flag = Flag::new(
    "NVTE_COMM_TUNE_VERBOSE",
    "0",
    "1: rank 0 prints each tuning decision",
);
// The GEMMs and kernels.
pub static OWN_GEMM: Flag = Flag::new(
    "NVTE_COMM_OWN_GEMM",
    "1",
    "1: small GEMMs our Hopper kernel computes run on it (read once)",
);
pub static BLOCK_GEMM: Choice = Choice::new(
    "NVTE_COMM_BLOCK_GEMM",
    &["cublaslt", "own", "auto"],
    "cublaslt",
    "block-scaled FP8 GEMMs: cuBLASLt, our Hopper kernel, or our kernel where measured faster (read at each block-scaled GEMM)",
);
pub static GEMM_TUNE: Flag = Flag::new(
    "NVTE_COMM_GEMM_TUNE",
    "1",
    "1: time cuBLASLt's top algorithms on each shape's first eager run",
);
pub static GEMM_GRAPHS: Flag = Flag::new(
    "NVTE_COMM_GEMM_GRAPHS",
    "1",
    "1: repeated cuBLASLt GEMMs replay a CUDA graph (read once)",
);
pub static QUANT_GRID: Choice = Choice::new(
    "NVTE_COMM_QUANT_GRID",
    &["flat", "persistent"],
    "flat",
    "grid of the rowwise quantize and amax kernels (read once)",
);
pub static CAST_TRANSPOSE: Variants = Variants::new(
    "NVTE_COMM_CAST_TRANSPOSE",
    "v3",
    "kernel of a quantize with columnwise output: v3, v2, v1 or a bench variant",
);
pub static BLOCK_QUANT: Choice = Choice::new(
    "NVTE_COMM_BLOCK_QUANT",
    &["fast", "shared", "previous", "regs"],
    "fast",
    "paths of the FP8 block-scaling quantize: fast (the register path for 16-bit inputs \
     without an activation, a bias gradient or the compact format; else shared), shared \
     (the shared-memory kernel's fast paths), previous, or regs (the register path \
     wherever it applies) (read at each call)",
);
// The kernel cache.
pub static DISABLE_KERNEL_CACHE: Flag = Flag::new(
    "NVTE_COMM_DISABLE_KERNEL_CACHE",
    "0",
    "1: compile kernels every process, no disk cache",
);
pub static CACHE_DIR: Path = Path::new(
    "NVTE_COMM_CACHE_DIR",
    "$XDG_CACHE_HOME/transformer_engine_comm",
    "folder of the compiled-kernel (and tuning) cache",
);
pub static XDG_CACHE_HOME: Path = Path::new(
    "XDG_CACHE_HOME",
    "$HOME/.cache",
    "the cache's parent folder where NVTE_COMM_CACHE_DIR is unset",
);
pub static HOME: Path = Path::new(
    "HOME",
    "none: no disk cache",
    "the cache's parent folder ($HOME/.cache) where XDG_CACHE_HOME is unset",
);
// Profiling, libraries, errors.
pub static NVTX: Flag = Flag::new(
    "NVTE_COMM_NVTX",
    "0",
    "1: NVTX ranges for Nsight Systems (read once per process)",
);
pub static NVTX_INJECTION64_PATH: Raw = Raw::new(
    "NVTX_INJECTION64_PATH",
    "unset: no NVTX tool",
    "the profiler's NVTX injection library (set by the profiler)",
);
pub static NCCL_LIBRARY: Path = Path::new(
    "NVTE_COMM_NCCL_LIBRARY",
    "the copy in the process or on the search path",
    "bind this NCCL file",
);
pub static CUBLASLT_LIBRARY: Path = Path::new(
    "NVTE_COMM_CUBLASLT_LIBRARY",
    "the copy in the process or on the search path",
    "bind this cuBLASLt file",
);
pub static DEBUG: Flag = Flag::new(
    "NVTE_COMM_DEBUG",
    "0",
    "1: also print every recorded error (and caught panics) to stderr",
);

/// Every knob the library reads.
pub static KNOBS: &[&Knob] = &[
    &TIMEOUT_MS.knob,
    &OVERLAP_NUM_SPLITS.knob,
    &OVERLAP_MAX_STREAMS.knob,
    &OVERLAP_NUM_SM.knob,
    &OVERLAP_USE_CE.0,
    &OVERLAP_AGGREGATE.0,
    &OVERLAP_SM_MARGIN.0,
    &TRANSPORT.0,
    &AR_ALGO.0,
    &RS_RING.0,
    &AG_PIECES.0,
    &FUSED_TILES.0,
    &OVERLAP.0,
    &TRACE.0,
    &CHECK.0,
    &REPORT.0,
    &GEMM_FP8_FAST_ACCUM.0,
    &TUNE.0,
    &TUNE_BUDGET_MS.knob,
    &TUNE_PICK.knob,
    &TUNE_VERBOSE.0,
    &OWN_GEMM.0,
    &BLOCK_GEMM.0,
    &GEMM_TUNE.0,
    &GEMM_GRAPHS.0,
    &QUANT_GRID.0,
    &CAST_TRANSPOSE.0,
    &BLOCK_QUANT.0,
    &DISABLE_KERNEL_CACHE.0,
    &CACHE_DIR.0,
    &XDG_CACHE_HOME.0,
    &HOME.0,
    &NVTX.0,
    &NVTX_INJECTION64_PATH.0,
    &NCCL_LIBRARY.0,
    &CUBLASLT_LIBRARY.0,
    &DEBUG.0,
];

/// Knobs of the crate's own unit tests (never set: their names appear in messages).
#[cfg(test)]
pub static TEST_UNSET_LIBGCC: Path = Path::new("NVTE_COMM_TEST_UNSET_LIBGCC", "unset", "tests");
#[cfg(test)]
pub static TEST_UNSET_NOTHING: Path = Path::new("NVTE_COMM_TEST_UNSET_NOTHING", "unset", "tests");

/// The raw value of `name`: None when unset or blank.
fn os(name: &str) -> Option<OsString> {
    std::env::var_os(name).filter(|v| !v.to_string_lossy().trim().is_empty())
}

/// The text of `name`: None when unset or blank; an error when it is not UTF-8.
fn text(name: &str) -> Result<Option<String>> {
    match os(name) {
        None => Ok(None),
        Some(v) => match v.into_string() {
            Ok(s) => Ok(Some(s.trim().to_string())),
            Err(v) => Err(bad(name, &v.to_string_lossy(), "is not valid UTF-8")),
        },
    }
}

fn bad(name: &str, value: &str, why: &str) -> Error {
    Error::invalid(format!(
        "environment variable {name} = {value:?} {why} (unset it for the default)"
    ))
}

/// Parse `value` of `name` as a decimal integer in `lo..=hi`.
pub fn parse_int<T>(name: &str, value: &str, lo: T, hi: T) -> Result<T>
where
    T: Copy + std::fmt::Display + TryFrom<i128> + Into<i128>,
{
    let v = value.trim();
    let why = || format!("is not an integer in {lo}..={hi}");
    let n: i128 = v.parse().map_err(|_| bad(name, value, &why()))?;
    if n < lo.into() || n > hi.into() {
        return Err(bad(name, value, &why()));
    }
    T::try_from(n).map_err(|_| bad(name, value, &why()))
}

/// Parse `value` of `name` as a boolean.
pub fn parse_bool(name: &str, value: &str) -> Result<bool> {
    match value.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Ok(true),
        "0" | "false" | "no" | "off" => Ok(false),
        _ => Err(bad(
            name,
            value,
            "is not a boolean (1 or 0; also true/false, yes/no, on/off)",
        )),
    }
}

/// Parse `value` of `name` as one of `choices` (any case); the index of the choice.
pub fn parse_choice(name: &str, value: &str, choices: &[&str]) -> Result<usize> {
    let v = value.trim();
    choices
        .iter()
        .position(|c| c.eq_ignore_ascii_case(v))
        .ok_or_else(|| {
            bad(
                name,
                value,
                &format!("is not one of {}", choices.join(", ")),
            )
        })
}

/// `name` as an integer in `lo..=hi`; None when unset or blank.
fn int<T>(name: &str, lo: T, hi: T) -> Result<Option<T>>
where
    T: Copy + std::fmt::Display + TryFrom<i128> + Into<i128>,
{
    text(name)?.map(|v| parse_int(name, &v, lo, hi)).transpose()
}

/// `name` as a boolean; None when unset or blank.
fn flag(name: &str) -> Result<Option<bool>> {
    text(name)?.map(|v| parse_bool(name, &v)).transpose()
}

/// `name` as one of `choices` (its index); None when unset or blank.
fn choice(name: &str, choices: &[&str]) -> Result<Option<usize>> {
    text(name)?
        .map(|v| parse_choice(name, &v, choices))
        .transpose()
}

/// A knob read once per process: `read`'s value, or its error, kept in `cell` and given
/// again to every later call (an error stays an InvalidArgument naming the knob).
pub fn once<T: Clone>(
    cell: &'static std::sync::OnceLock<std::result::Result<T, String>>,
    read: impl FnOnce() -> Result<T>,
) -> Result<T> {
    cell.get_or_init(|| read().map_err(|e| e.msg))
        .clone()
        .map_err(Error::invalid)
}

/// NVTE_COMM_TIMEOUT_MS: how long any wait for a peer may take, ms (>= 1; default 60 s).
/// The engine's config default and the setup exchanges read it alike.
pub fn timeout_ms() -> Result<i64> {
    Ok(TIMEOUT_MS.get()?.unwrap_or(60_000))
}

/// NVTE_COMM_DEBUG, read where an error is being recorded (so it cannot be reported as
/// an error itself): on for a true value, off when unset, blank or false; a value that
/// is not a boolean turns it on, with a note saying so.
pub fn debug() -> bool {
    match DEBUG.get() {
        Ok(v) => v.unwrap_or(false),
        Err(e) => {
            use std::io::Write;
            let _ = writeln!(
                std::io::stderr().lock(),
                "[transformer_engine_comm] {}: printing errors as for {}=1",
                e.msg,
                DEBUG.0.name
            );
            true
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind as K;

    fn err<T: std::fmt::Debug>(r: Result<T>) -> String {
        let e = r.unwrap_err();
        assert_eq!(e.kind, K::InvalidArgument);
        e.msg
    }

    #[test]
    fn integers_are_strict() {
        let n = "NVTE_COMM_OVERLAP_NUM_SPLITS";
        assert_eq!(parse_int::<i32>(n, "4", 1, 64).unwrap(), 4);
        assert_eq!(parse_int::<i32>(n, " 64 ", 1, 64).unwrap(), 64);
        assert_eq!(parse_int::<i32>(n, "+1", 1, 64).unwrap(), 1);
        for v in [
            "4294967299",
            "abc",
            "0",
            "65",
            "-1",
            "3x",
            "3.0",
            "0x10",
            "99999999999999999999999999999999999999999",
        ] {
            let m = err(parse_int::<i32>(n, v, 1, 64));
            assert!(
                m.contains(n) && m.contains(&format!("{v:?}")) && m.contains("1..=64"),
                "{m}"
            );
        }
        let t = "NVTE_COMM_TIMEOUT_MS";
        assert_eq!(
            parse_int::<i64>(t, "9223372036854775807", 1, i64::MAX).unwrap(),
            i64::MAX
        );
        err(parse_int::<i64>(t, "9223372036854775808", 1, i64::MAX));
        err(parse_int::<i64>(t, "-5", 1, i64::MAX));
    }

    #[test]
    fn booleans_and_choices_are_strict() {
        let n = "NVTE_COMM_OVERLAP_USE_CE";
        for v in ["1", "true", "TRUE", "Yes", "on", " 1 "] {
            assert!(parse_bool(n, v).unwrap(), "{v}");
        }
        for v in ["0", "false", "False", "no", "OFF"] {
            assert!(!parse_bool(n, v).unwrap(), "{v}");
        }
        for v in ["2", "enable", "-1", "yes please", "10"] {
            let m = err(parse_bool(n, v));
            assert!(m.contains(n) && m.contains(&format!("{v:?}")), "{m}");
        }
        let t = "NVTE_COMM_TRANSPORT";
        let c = ["auto", "ipc", "nccl"];
        assert_eq!(parse_choice(t, "NCCL", &c).unwrap(), 2);
        assert_eq!(parse_choice(t, " ipc", &c).unwrap(), 1);
        let m = err(parse_choice(t, "tcp", &c));
        assert!(
            m.contains(t) && m.contains("\"tcp\"") && m.contains("auto, ipc, nccl"),
            "{m}"
        );
    }
}
