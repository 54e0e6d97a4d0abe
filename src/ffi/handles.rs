//! The one handle table of the C API: tensors, overlap objects and comm-GEMM contexts
//! are all entries of a [`Table`], keyed by values from [`crate::handle::next`] (a keyed
//! bijection of a sequence number, so a corrupted or stale handle is "not live", never
//! another object).
use crate::comm_gemm::CommGemmCtx;
use crate::error::{Error, Result};
use crate::overlap::Overlap;
use crate::tensor::Tensor;
use once_cell::sync::Lazy;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};

/// `NVTETensor` handles.
pub static TENSORS: Table<Tensor> = Table::new(
    "tensor",
    "NVTETensor",
    "never created by nvte_create_tensor",
);
/// `NVTECommOverlap` handles (an object is used by one call at a time: its mutex).
pub static OVERLAPS: Table<Arc<Mutex<Overlap>>> =
    Table::new("overlap object", "NVTECommOverlap", "never created");
/// `NVTECommGemmCtx` handles.
pub static CONTEXTS: Table<Arc<Mutex<CommGemmCtx>>> =
    Table::new("context", "NVTECommGemmCtx", "never created");

/// Live objects of one C type.
pub struct Table<T> {
    map: Lazy<RwLock<HashMap<usize, T>>>,
    /// How a handle of this table is named in messages: the noun ("tensor"), the C type
    /// and how such handles are made, e.g. "never created by nvte_create_tensor".
    noun: &'static str,
    c_type: &'static str,
    origin: &'static str,
}

impl<T: Clone> Table<T> {
    pub const fn new(noun: &'static str, c_type: &'static str, origin: &'static str) -> Self {
        Table {
            map: Lazy::new(|| RwLock::new(HashMap::new())),
            noun,
            c_type,
            origin,
        }
    }

    /// "argument `x` is NULL" / "... is not a live ..." for handle `h` named `what`.
    fn null(&self, what: &str) -> Error {
        Error::invalid(format!("{} `{what}` is NULL", self.role()))
    }
    fn not_live(&self, h: usize, what: &str) -> Error {
        Error::invalid(format!(
            "{} `{what}` ({} {h:#x}) is not a live {}: {}, or already destroyed",
            self.role(),
            self.c_type,
            self.noun,
            self.origin
        ))
    }
    fn role(&self) -> &'static str {
        if self.noun == "tensor" {
            "tensor"
        } else {
            "argument"
        }
    }

    /// Register `v`; its new handle.
    pub fn insert(&self, v: T) -> usize {
        let h = crate::handle::next();
        self.map
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(h, v);
        h
    }

    /// Remove handle `h` (NULL is an error: callers that accept NULL check first). The
    /// value is returned, to be dropped outside the table's lock.
    pub fn remove(&self, h: usize, what: &str) -> Result<T> {
        if h == 0 {
            return Err(self.null(what));
        }
        let v = self
            .map
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&h);
        v.ok_or_else(|| self.not_live(h, what))
    }

    /// A clone of the value of `h` (objects are `Arc`s: a clone is a reference).
    pub fn get(&self, h: usize, what: &str) -> Result<T> {
        if h == 0 {
            return Err(self.null(what));
        }
        self.map
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&h)
            .cloned()
            .ok_or_else(|| self.not_live(h, what))
    }

    /// `get`, with NULL as None.
    pub fn get_opt(&self, h: usize, what: &str) -> Result<Option<T>> {
        if h == 0 {
            Ok(None)
        } else {
            self.get(h, what).map(Some)
        }
    }

    /// Run `f` on the value of `h` under the table's write lock.
    pub fn update<R>(
        &self,
        h: usize,
        what: &str,
        f: impl FnOnce(&mut T) -> Result<R>,
    ) -> Result<R> {
        if h == 0 {
            return Err(self.null(what));
        }
        let mut m = self.map.write().unwrap_or_else(|e| e.into_inner());
        let v = m.get_mut(&h).ok_or_else(|| self.not_live(h, what))?;
        f(v)
    }

    pub fn len(&self) -> usize {
        self.map.read().unwrap_or_else(|e| e.into_inner()).len()
    }
}

impl<U> Table<Arc<Mutex<U>>> {
    /// Destroy object `h`, refused (UNSUPPORTED, the object kept) while
    /// `in_open_capture` says a CUDA-graph capture holding its calls is still open (its
    /// memory is in use; `refusal` says so); else removed and dropped here, outside the
    /// table's lock, with this thread's capture mode relaxed (a destroy may run beside
    /// another thread's capture: `RelaxedCapture`).
    pub fn destroy(
        &self,
        h: usize,
        what: &str,
        in_open_capture: impl FnOnce(&U) -> bool,
        refusal: &str,
    ) -> Result<()> {
        let o = self.get(h, what)?;
        if in_open_capture(&o.lock().unwrap_or_else(|e| e.into_inner())) {
            crate::unsupported!("{refusal}");
        }
        drop(o);
        let _relaxed = crate::cuda::resources::RelaxedCapture::new();
        self.remove(h, what).map(drop)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_table_names_null_destroyed_and_corrupted_handles() {
        static T: Table<u32> =
            Table::new("widget", "NVTEWidget", "never created by nvte_make_widget");
        let h = T.insert(7);
        assert_eq!(T.get(h, "w").unwrap(), 7);
        T.update(h, "w", |v| {
            *v = 8;
            Ok(())
        })
        .unwrap();
        assert_eq!(T.get_opt(h, "w").unwrap(), Some(8));
        assert_eq!(T.get_opt(0, "w").unwrap(), None);
        let e = T.get(h ^ 0x100, "w").unwrap_err();
        assert!(e.msg.contains("is not a live widget"), "{}", e.msg);
        assert!(
            T.get(0, "w")
                .unwrap_err()
                .msg
                .contains("argument `w` is NULL")
        );
        assert_eq!(T.remove(h, "w").unwrap(), 8);
        assert!(T.remove(h, "w").is_err());
        assert_eq!(T.len(), 0);
    }
}
