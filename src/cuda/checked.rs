//! Operands whose device memory was vouched for where it entered the library.
//!
//! A [`Checked<T>`] holds a value naming device memory (a TE tensor, TE's GEMM operands)
//! that the C boundary (`src/ffi/`) received from its caller and validated: handles
//! resolved, shapes and dtypes checked, pointers non-NULL where they have elements. What
//! no check can see (that a pointer is a live allocation of that size) is the C caller's
//! contract, stated once, in the `unsafe` block that makes the value
//! ([`Checked::vouched`]). The safe GEMM and kernel entry points (`gemm::cublas_gemm`,
//! the `kernels` wrappers) take only `Checked` operands; the forms that take raw
//! addresses or descriptors (`gemm::run`, ...) are `unsafe fn`s with a Safety contract.
//! `tests/device_writes_are_checked.rs` keeps it so: `Checked::vouched` is called only
//! under `src/ffi/`, and a safe function of `src/gemm`, `src/kernels*` or `src/overlap`
//! that takes raw device operands is either `unsafe` or on its list, with the reason.

/// `T`'s device memory, vouched for by the C boundary (module doc).
#[derive(Clone, Copy, Debug)]
pub struct Checked<T>(T);

impl<T> Checked<T> {
    /// `t` as a checked operand.
    ///
    /// # Safety
    ///
    /// Every device address `t` names (a tensor's data, scale, amax, scale-inverse and
    /// column-wise buffers; every tensor of GEMM operands) must be device memory of the
    /// current context, or mapped into it, of at least the extent its shape and dtype
    /// imply, alive until the work enqueued with it completes, and not written by other
    /// work meanwhile unless the caller orders it (its stream). Only the C boundary
    /// (`src/ffi/`) makes these, for its caller's tensors, after validating them.
    pub unsafe fn vouched(t: T) -> Checked<T> {
        Checked(t)
    }

    /// The operand.
    pub fn get(&self) -> &T {
        &self.0
    }
}

impl<T> std::ops::Deref for Checked<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}
