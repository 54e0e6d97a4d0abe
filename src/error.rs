//! Error type of the library and the thread-local "last error" that the C API exposes.
use crate::ffi::enums::NVTECommStatus;
use std::cell::RefCell;
use std::ffi::CString;

/// An error: a status for the C caller and a message that names what went wrong.
#[derive(Debug, Clone)]
pub struct Error {
    pub status: NVTECommStatus,
    pub msg: String,
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub fn new(status: NVTECommStatus, msg: impl Into<String>) -> Self {
        Error {
            status,
            msg: msg.into(),
        }
    }
    pub fn invalid(msg: impl Into<String>) -> Self {
        Self::new(NVTECommStatus::NVTE_COMM_ERROR_INVALID_ARGUMENT, msg)
    }
    pub fn unsupported(msg: impl Into<String>) -> Self {
        Self::new(NVTECommStatus::NVTE_COMM_ERROR_UNSUPPORTED, msg)
    }
    pub fn internal(msg: impl Into<String>) -> Self {
        Self::new(NVTECommStatus::NVTE_COMM_ERROR_INTERNAL, msg)
    }
    /// Prefix the message with context (e.g. the argument being checked).
    pub fn context(mut self, ctx: impl std::fmt::Display) -> Self {
        self.msg = format!("{ctx}: {}", self.msg);
        self
    }
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.msg, self.status)
    }
}

/// `return Err(Error::invalid(format!(...)))` in one line.
#[macro_export]
macro_rules! invalid {
    ($($arg:tt)*) => { return Err($crate::error::Error::invalid(format!($($arg)*))) };
}

/// `return Err(Error::unsupported(format!(...)))` in one line.
#[macro_export]
macro_rules! unsupported {
    ($($arg:tt)*) => { return Err($crate::error::Error::unsupported(format!($($arg)*))) };
}

struct LastError {
    status: NVTECommStatus,
    msg: CString,
}

thread_local! {
    static LAST: RefCell<LastError> = RefCell::new(LastError {
        status: NVTECommStatus::NVTE_COMM_SUCCESS,
        msg: CString::default(),
    });
}

pub fn set_last_error(func: &str, e: &Error) {
    let text = format!("{func}: {}", e.msg).replace('\0', "\\0");
    if std::env::var_os("NVTE_COMM_DEBUG").is_some() {
        eprintln!("[transformer_engine_comm] {text} ({})", e.status);
    }
    LAST.with(|l| {
        let mut l = l.borrow_mut();
        l.status = e.status;
        l.msg = CString::new(text).unwrap_or_default();
    });
}

pub fn clear_last_error() {
    LAST.with(|l| {
        let mut l = l.borrow_mut();
        l.status = NVTECommStatus::NVTE_COMM_SUCCESS;
        l.msg = CString::default();
    });
}

/// Pointer to the thread's last message; valid until the thread's next library call.
pub fn last_error_ptr() -> *const std::ffi::c_char {
    LAST.with(|l| l.borrow().msg.as_ptr())
}

pub fn last_status() -> NVTECommStatus {
    LAST.with(|l| l.borrow().status)
}

pub fn last_error_string() -> String {
    LAST.with(|l| l.borrow().msg.to_string_lossy().into_owned())
}
