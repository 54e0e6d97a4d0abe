//! The library's environment knobs (`NVTE_COMM_*`), parsed strictly.
//!
//! Every knob is read by the call that uses it; a value that does not parse, is out of
//! range or would be truncated is an NVTE_COMM_ERROR_INVALID_ARGUMENT of that call,
//! naming the variable and its value (never ignored, never wrapped). Unset, or set to an
//! empty (all-blank) value, means the documented default. Surrounding blanks are ignored.
//! Booleans: `1`/`0`, also `true`/`false`, `yes`/`no`, `on`/`off` (any case).
use crate::error::{Error, Result};
use std::ffi::OsString;

/// The raw value of `name`: None when unset or blank.
pub fn os(name: &str) -> Option<OsString> {
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
pub fn int<T>(name: &str, lo: T, hi: T) -> Result<Option<T>>
where
    T: Copy + std::fmt::Display + TryFrom<i128> + Into<i128>,
{
    text(name)?.map(|v| parse_int(name, &v, lo, hi)).transpose()
}

/// `name` as a boolean; None when unset or blank.
pub fn flag(name: &str) -> Result<Option<bool>> {
    text(name)?.map(|v| parse_bool(name, &v)).transpose()
}

/// `name` as one of `choices` (its index); None when unset or blank.
pub fn choice(name: &str, choices: &[&str]) -> Result<Option<usize>> {
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
    Ok(int("NVTE_COMM_TIMEOUT_MS", 1, i64::MAX)?.unwrap_or(60_000))
}

/// NVTE_COMM_DEBUG, read where an error is being recorded (so it cannot be reported as
/// an error itself): on for a true value, off when unset, blank or false; a value that
/// is not a boolean turns it on, with a note saying so.
pub fn debug() -> bool {
    const NAME: &str = "NVTE_COMM_DEBUG";
    match flag(NAME) {
        Ok(v) => v.unwrap_or(false),
        Err(e) => {
            use std::io::Write;
            let _ = writeln!(
                std::io::stderr().lock(),
                "[transformer_engine_comm] {}: printing errors as for {NAME}=1",
                e.msg
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
