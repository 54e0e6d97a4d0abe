//! Error type of the library and the thread-local "last error" that the C API exposes.
//! The core speaks [`ErrorKind`]; only `ffi` maps kinds to the C status enum.
use std::cell::RefCell;
use std::ffi::CString;

/// What went wrong, in the core's terms (`ffi::status_of` gives the C status).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    InvalidArgument,
    Cuda,
    Cublas,
    Nccl,
    Nvrtc,
    Timeout,
    Unsupported,
    LibraryNotFound,
    OutOfMemory,
    Internal,
}

/// An error: its kind and a message that names what went wrong.
#[derive(Debug, Clone)]
pub struct Error {
    pub kind: ErrorKind,
    pub msg: String,
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub fn new(kind: ErrorKind, msg: impl Into<String>) -> Self {
        Error {
            kind,
            msg: msg.into(),
        }
    }
    pub fn invalid(msg: impl Into<String>) -> Self {
        Self::new(ErrorKind::InvalidArgument, msg)
    }
    pub fn unsupported(msg: impl Into<String>) -> Self {
        Self::new(ErrorKind::Unsupported, msg)
    }
    pub fn internal(msg: impl Into<String>) -> Self {
        Self::new(ErrorKind::Internal, msg)
    }
    /// Prefix the message with context (e.g. the argument being checked).
    pub fn context(mut self, ctx: impl std::fmt::Display) -> Self {
        self.msg = format!("{ctx}: {}", self.msg);
        self
    }
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({:?})", self.msg, self.kind)
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
    /// None: the last call succeeded.
    kind: Option<ErrorKind>,
    /// None: no message ("").
    msg: Option<CString>,
}

thread_local! {
    static LAST: RefCell<LastError> = const {
        RefCell::new(LastError {
            kind: None,
            msg: None,
        })
    };
}

/// Where errors go on a thread whose thread-locals are already destroyed (an `atexit`
/// handler, a C++ static destructor, a thread-key destructor): one shared slot, so that
/// the library still reports instead of panicking outside the firewall (which aborts).
static TEARDOWN: std::sync::Mutex<LastError> = std::sync::Mutex::new(LastError {
    kind: None,
    msg: None,
});

/// Run `f` on the calling thread's slot, or on the shared teardown slot once the
/// thread's locals are gone. Never panics.
fn with_last<R>(f: impl Fn(&mut LastError) -> R) -> R {
    match LAST.try_with(|l| l.try_borrow_mut().ok().map(|mut l| f(&mut l))) {
        Ok(Some(r)) => r,
        _ => f(&mut TEARDOWN.lock().unwrap_or_else(|e| e.into_inner())),
    }
}

/// Record `e` of C function `func` as the thread's last error; `print`: also write it
/// to stderr (NVTE_COMM_DEBUG, which the caller reads: this module reads no environment).
pub fn set_last_error(func: &str, e: &Error, print: bool) {
    let text = format!("{func}: {}", e.msg).replace('\0', "\\0");
    if print {
        // Never eprintln!: it panics when stderr is a closed pipe (SIGPIPE ignored).
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr().lock(),
            "[transformer_engine_comm] {text} ({:?})",
            e.kind
        );
    }
    let msg = CString::new(text).unwrap_or_default();
    with_last(|l| {
        l.kind = Some(e.kind);
        l.msg = Some(msg.clone());
    });
}

pub fn clear_last_error() {
    with_last(|l| {
        l.kind = None;
        l.msg = None;
    });
}

/// Pointer to the thread's last message; valid until the thread's next library call.
pub fn last_error_ptr() -> *const std::ffi::c_char {
    with_last(|l| l.msg.as_ref().map_or(c"".as_ptr(), |m| m.as_ptr()))
}

/// The kind of the thread's last error; None when its last call succeeded.
pub fn last_kind() -> Option<ErrorKind> {
    with_last(|l| l.kind)
}

pub fn last_error_string() -> String {
    with_last(|l| {
        l.msg
            .as_ref()
            .map(|m| m.to_string_lossy().into_owned())
            .unwrap_or_default()
    })
}
