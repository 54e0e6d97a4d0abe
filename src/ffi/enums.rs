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

/// `NVTECommTransport`, made from the transport table's rows (as c_enums! makes the
/// others; the unit tests' rows are values only there).
macro_rules! transport_table {
    (
        $(#[doc = $doc:literal])*
        after $after:ident;
        auto: $auto:ident = $auto_val:literal;
        $( $(#[$m:meta])* $var:ident = $val:literal, $name:literal => $($ctor:ident)::+ ; )*
    ) => {
        $(#[doc = $doc])*
        #[repr(transparent)]
        #[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
        pub struct NVTECommTransport(pub u32);
        impl NVTECommTransport {
            pub const $auto: NVTECommTransport = NVTECommTransport($auto_val);
            $( $(#[$m])* pub const $var: NVTECommTransport = NVTECommTransport($val); )*
            /// The C name of this value, or None when it is not a declared value.
            pub fn name(self) -> Option<&'static str> {
                match self.0 {
                    $auto_val => Some(stringify!($auto)),
                    $( $(#[$m])* $val => Some(stringify!($var)), )*
                    _ => None,
                }
            }
            /// Every declared (name, value) pair, in declaration order.
            pub const ALL: &'static [(&'static str, u32)] = &[
                (stringify!($auto), $auto_val),
                $( $(#[$m])* (stringify!($var), $val), )*
            ];
        }
        impl std::fmt::Display for NVTECommTransport {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                match self.name() {
                    Some(n) => write!(f, "{n}"),
                    None => write!(f, "NVTECommTransport({})", self.0 as i32),
                }
            }
        }
    };
}

include!("../transport/table.in");

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

    /// The C enum of the transports and the registry come from the same rows: each C
    /// value names the transport NVTE_COMM_TRANSPORT calls by the enumerator's suffix.
    #[test]
    fn the_transport_enum_is_the_transport_table() {
        assert!(NVTECommTransport::ALL.len() >= 3);
        for &(cname, v) in NVTECommTransport::ALL {
            let name = crate::transport::choice_name(v);
            assert_eq!(
                cname,
                format!("NVTE_COMM_TRANSPORT_{}", name.to_uppercase())
            );
            assert_eq!(NVTECommTransport(v).name(), Some(cname));
        }
        let values: Vec<u32> = NVTECommTransport::ALL.iter().map(|a| a.1).collect();
        let names: Vec<&str> = crate::transport::choice_names().collect();
        assert_eq!(values, (0..names.len() as u32).collect::<Vec<_>>());
        assert_eq!(NVTECommTransport(9).to_string(), "NVTECommTransport(9)");
    }

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
