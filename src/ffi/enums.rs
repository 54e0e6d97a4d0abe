//! Rust side of the C enums. Each is a transparent `u32` newtype rather than a Rust
//! `enum`, so that any integer a C caller passes is a valid value (an out-of-range
//! value is reported as an error instead of being undefined behaviour).
#![allow(non_upper_case_globals)]

macro_rules! c_enums {
    ($( $(#[doc = $doc:literal])* $name:ident { $($var:ident = $val:literal),* $(,)? } )*) => {
        $(
            $(#[doc = $doc])*
            #[repr(transparent)]
            #[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
            pub struct $name(pub u32);
            impl $name {
                $( pub const $var: $name = $name($val); )*
                /// The C name of this value, or None when it is not a declared value.
                pub fn name(self) -> Option<&'static str> {
                    match self.0 { $( $val => Some(stringify!($var)), )* _ => None }
                }
                /// Every declared (name, value) pair, in declaration order.
                pub const ALL: &'static [(&'static str, u32)] = &[$( (stringify!($var), $val) ),*];
            }
            impl std::fmt::Display for $name {
                fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                    match self.name() {
                        Some(n) => write!(f, "{n}"),
                        // C enums are ints: a negative value (stored as its u32 bits) prints
                        // as the caller wrote it, e.g. NVTEScalingMode(-1).
                        None => write!(f, "{}({})", stringify!($name), self.0 as i32),
                    }
                }
            }
        )*
    };
}

include!("c_enums.in");

impl NVTECommGemmAlgoType {
    /// kNVTECommGemmAlgoAtomicP2P or kNVTECommGemmAlgoAtomicMulticast: the fused
    /// all-gather (multicast is never used: both run the P2P transport).
    pub fn is_atomic(self) -> bool {
        self == Self::kNVTECommGemmAlgoAtomicP2P || self == Self::kNVTECommGemmAlgoAtomicMulticast
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn undeclared_values_print_as_the_c_int_the_caller_passed() {
        assert_eq!(NVTEScalingMode(u32::MAX).to_string(), "NVTEScalingMode(-1)");
        assert_eq!(
            NVTEScalingMode(-7i32 as u32).to_string(),
            "NVTEScalingMode(-7)"
        );
        assert_eq!(NVTEScalingMode(77).to_string(), "NVTEScalingMode(77)");
        assert_eq!(
            NVTEScalingMode::NVTE_DELAYED_TENSOR_SCALING.to_string(),
            "NVTE_DELAYED_TENSOR_SCALING"
        );
    }
}
