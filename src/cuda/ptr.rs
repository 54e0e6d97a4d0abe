//! Typed device addresses. A [`DevPtr`] is a `CUdeviceptr`: an address in the GPU's
//! virtual address space (this context's memory, a peer's memory mapped through IPC or
//! peer access, or mapped host memory). It is never dereferenced on the host, so
//! holding, offsetting and passing one is safe; what the device does with it is the
//! business of the `unsafe` launch or copy that hands it over.

/// A device address (`CUdeviceptr`), 0 = none. `repr(transparent)` over a 64-bit
/// integer, so it is passed to kernels and stored in kernel-argument structs as the
/// `void *` / `unsigned long long` they declare.
#[repr(transparent)]
#[derive(Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DevPtr(u64);

impl DevPtr {
    /// No address.
    pub const NULL: DevPtr = DevPtr(0);

    /// The address a caller gave (a C `void *` into device memory, a `CUdeviceptr`): not
    /// checked here; calls that use it check what they can (non-null, alignment).
    pub const fn new(addr: u64) -> DevPtr {
        DevPtr(addr)
    }
    /// The address of a C pointer argument (`void *` holding a device address).
    pub fn from_c<T>(p: *const T) -> DevPtr {
        DevPtr(p as usize as u64)
    }
    pub const fn is_null(self) -> bool {
        self.0 == 0
    }
    /// The raw address (driver calls take `CUdeviceptr = u64`).
    pub const fn raw(self) -> u64 {
        self.0
    }
    /// As the `void *` that runtime-style APIs (cuBLASLt, NCCL) take.
    pub fn as_void(self) -> *mut std::ffi::c_void {
        self.0 as usize as *mut std::ffi::c_void
    }
    /// `None` for NULL.
    pub fn non_null(self) -> Option<DevPtr> {
        (!self.is_null()).then_some(self)
    }
    /// Whether the address is a multiple of `align` bytes.
    pub fn is_aligned(self, align: usize) -> bool {
        self.0.is_multiple_of(align as u64)
    }
}

/// `p + bytes`: the address `bytes` further on. Offsets come from checked buffer sizes;
/// an address that would leave the 64-bit space is a bug and panics (the FFI firewall
/// reports it).
impl std::ops::Add<usize> for DevPtr {
    type Output = DevPtr;
    fn add(self, bytes: usize) -> DevPtr {
        DevPtr(
            self.0
                .checked_add(bytes as u64)
                .expect("device address offset overflows"),
        )
    }
}

impl std::fmt::Debug for DevPtr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:#x}", self.0)
    }
}

impl std::fmt::Display for DevPtr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:#x}", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::DevPtr;

    #[test]
    fn device_pointers_offset_print_and_pass_as_64_bit_values() {
        let p = DevPtr::new(0x7f00_0000_1000);
        assert_eq!((p + 0x40).raw(), 0x7f00_0000_1040);
        assert_eq!(format!("{p}"), "0x7f0000001000");
        assert!(p.is_aligned(256) && !(p + 2).is_aligned(4));
        assert!(DevPtr::NULL.is_null() && DevPtr::NULL.non_null().is_none());
        assert_eq!(DevPtr::from_c(0x1234 as *const u8), DevPtr::new(0x1234));
        // What kernels receive: the bytes of a u64.
        assert_eq!(std::mem::size_of::<DevPtr>(), 8);
        assert_eq!(std::mem::align_of::<DevPtr>(), 8);
    }

    #[test]
    #[should_panic(expected = "overflows")]
    fn an_offset_past_the_address_space_panics() {
        let _ = DevPtr::new(u64::MAX - 1) + 2;
    }
}
