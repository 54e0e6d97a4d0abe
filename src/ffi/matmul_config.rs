//! TE's matmul config (gemm.h: `NVTEMatmulConfig`, nvte_create / destroy / set / get
//! _matmul_config[_attribute]): the options of nvte_cublas_gemm_v2. A config is an entry
//! of the handle table ([`Table`]) like a tensor: a NULL, destroyed or corrupted handle
//! is reported, never dereferenced.
use super::enums::NVTEMatmulConfigAttribute;
use super::enums::NVTEMatmulConfigAttribute as Attr;
use super::handles::{TENSORS, Table};
use crate::error::Result;
use crate::invalid;
use crate::tensor::Tensor;
use std::ffi::c_void;

/// Opaque matmul config handle (TE: `typedef void *NVTEMatmulConfig;`).
pub type NVTEMatmulConfig = *mut c_void;

/// The stored attributes of a config, as TE's MatmulConfig holds them (tensor handles
/// as their values: they are looked up when a GEMM uses the config).
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct MatmulAttrs {
    pub bias_tensor: usize,
    pub dbias_tensor: usize,
    pub with_gelu_epilogue: bool,
    pub with_dgelu_epilogue: bool,
    pub epilogue_aux_tensor: usize,
    pub use_split_accumulator: bool,
    pub sm_count: i32,
}

/// `NVTEMatmulConfig` handles.
pub(crate) static MATMUL_CONFIGS: Table<MatmulAttrs> = Table::new(
    "matmul config",
    "NVTEMatmulConfig",
    "never created by nvte_create_matmul_config",
);

const PTR: usize = std::mem::size_of::<usize>();

impl MatmulAttrs {
    /// Size in bytes of attribute `a` (TE's MatmulConfig::attr_sizes).
    pub(crate) fn size(a: Attr) -> Result<usize> {
        Ok(match a {
            Attr::kNVTEMatmulConfigBiasTensor
            | Attr::kNVTEMatmulConfigDBiasTensor
            | Attr::kNVTEMatmulConfigEpilogueAuxTensor => PTR,
            Attr::kNVTEMatmulConfigWithGELUEpilogue
            | Attr::kNVTEMatmulConfigWithDGELUEpilogue
            | Attr::kNVTEMatmulConfigUseSplitAccumulator => 1,
            Attr::kNVTEMatmulConfigSMCount => 4,
            a => invalid!(
                "argument `attr` = {a} is not a valid NVTEMatmulConfigAttribute (expected 0..=6)"
            ),
        })
    }

    /// Set attribute `a` from its bytes (at least `size(a)` of them).
    pub(crate) fn set(&mut self, a: Attr, b: &[u8]) -> Result<()> {
        let need = Self::size(a)?;
        if b.len() < need {
            invalid!(
                "argument `size_in_bytes` = {} is too small for {a}: it needs {need} bytes",
                b.len()
            );
        }
        let word = || {
            let mut w = [0u8; PTR];
            w.copy_from_slice(&b[..PTR]);
            usize::from_ne_bytes(w)
        };
        match a {
            Attr::kNVTEMatmulConfigBiasTensor => self.bias_tensor = word(),
            Attr::kNVTEMatmulConfigDBiasTensor => self.dbias_tensor = word(),
            Attr::kNVTEMatmulConfigWithGELUEpilogue => self.with_gelu_epilogue = b[0] != 0,
            Attr::kNVTEMatmulConfigWithDGELUEpilogue => self.with_dgelu_epilogue = b[0] != 0,
            Attr::kNVTEMatmulConfigEpilogueAuxTensor => self.epilogue_aux_tensor = word(),
            Attr::kNVTEMatmulConfigUseSplitAccumulator => self.use_split_accumulator = b[0] != 0,
            _ => {
                let v = i32::from_ne_bytes([b[0], b[1], b[2], b[3]]);
                if v < 0 {
                    invalid!("{a} = {v} must be >= 0 (0: cuBLASLt's choice)");
                }
                self.sm_count = v;
            }
        }
        Ok(())
    }

    /// The bytes of attribute `a` (`size(a)` of them).
    pub(crate) fn get(&self, a: Attr) -> Result<Vec<u8>> {
        Self::size(a)?;
        Ok(match a {
            Attr::kNVTEMatmulConfigBiasTensor => self.bias_tensor.to_ne_bytes().to_vec(),
            Attr::kNVTEMatmulConfigDBiasTensor => self.dbias_tensor.to_ne_bytes().to_vec(),
            Attr::kNVTEMatmulConfigWithGELUEpilogue => vec![self.with_gelu_epilogue as u8],
            Attr::kNVTEMatmulConfigWithDGELUEpilogue => vec![self.with_dgelu_epilogue as u8],
            Attr::kNVTEMatmulConfigEpilogueAuxTensor => {
                self.epilogue_aux_tensor.to_ne_bytes().to_vec()
            }
            Attr::kNVTEMatmulConfigUseSplitAccumulator => vec![self.use_split_accumulator as u8],
            _ => self.sm_count.to_ne_bytes().to_vec(),
        })
    }

    /// The GEMM's epilogue as nvte_cublas_gemm's arguments, by TE's rule: a gradient
    /// epilogue (dbias and / or dgelu) takes neither bias nor gelu; bias -> BIAS, dbias ->
    /// the bias gradient of B, gelu / dgelu need the aux tensor (the pre-activation
    /// output / input). Returns (bias, pre_gelu_out, grad), tensors resolved from
    /// their handles (named by the attribute).
    pub(crate) fn epilogue(&self) -> Result<(Option<Tensor>, Option<Tensor>, bool)> {
        let grad = self.dbias_tensor != 0 || self.with_dgelu_epilogue;
        let describe = || {
            format!(
                "(bias = {}, dbias = {}, gelu = {}, dgelu = {})",
                self.bias_tensor != 0,
                self.dbias_tensor != 0,
                self.with_gelu_epilogue,
                self.with_dgelu_epilogue
            )
        };
        if grad && (self.bias_tensor != 0 || self.with_gelu_epilogue) {
            invalid!(
                "invalid epilogue {}: a gradient epilogue (dbias / dgelu) takes neither a bias nor GELU",
                describe()
            );
        }
        let bias_handle = if grad {
            self.dbias_tensor
        } else {
            self.bias_tensor
        };
        let bias_name = if grad {
            "kNVTEMatmulConfigDBiasTensor"
        } else {
            "kNVTEMatmulConfigBiasTensor"
        };
        let bias = TENSORS.get_opt(bias_handle, bias_name)?;
        let aux = if self.with_gelu_epilogue || self.with_dgelu_epilogue {
            if self.epilogue_aux_tensor == 0 {
                invalid!(
                    "epilogue {} requested without an aux tensor (kNVTEMatmulConfigEpilogueAuxTensor)",
                    describe()
                );
            }
            Some(TENSORS.get(
                self.epilogue_aux_tensor,
                "kNVTEMatmulConfigEpilogueAuxTensor",
            )?)
        } else {
            None
        };
        Ok((bias, aux, grad))
    }
}

/// Create a matmul config with TE's defaults (no epilogue tensors, no GELU, split
/// accumulator off, SM count 0 = cuBLASLt's choice). Destroy it with
/// nvte_destroy_matmul_config.
#[unsafe(no_mangle)]
pub extern "C" fn nvte_create_matmul_config() -> NVTEMatmulConfig {
    entry!(or std::ptr::null_mut(), {
        Ok(MATMUL_CONFIGS.insert(MatmulAttrs::default()) as NVTEMatmulConfig)
    })
}

/// Read attribute `attr` of `config` into `buf` (`size_in_bytes` bytes). `*size_written`
/// (when not NULL) gets the attribute's size; a NULL `buf` only asks for that size (TE).
#[unsafe(no_mangle)]
pub extern "C" fn nvte_get_matmul_config_attribute(
    config: NVTEMatmulConfig,
    attr: NVTEMatmulConfigAttribute,
    buf: *mut c_void,
    size_in_bytes: usize,
    size_written: *mut usize,
) {
    entry!(void, {
        let size = MatmulAttrs::size(attr)?;
        super::read_config_attribute(attr, size, buf, size_in_bytes, size_written, || {
            MATMUL_CONFIGS.get(config as usize, "config")?.get(attr)
        })
    })
}

/// Set attribute `attr` of `config` from `buf` (`size_in_bytes` bytes, at least the
/// attribute's size: NVTETensor for the tensors, uint8_t for the flags, int32_t for the
/// SM count). Tensors are looked up when a GEMM uses the config.
#[unsafe(no_mangle)]
pub extern "C" fn nvte_set_matmul_config_attribute(
    config: NVTEMatmulConfig,
    attr: NVTEMatmulConfigAttribute,
    buf: *const c_void,
    size_in_bytes: usize,
) {
    entry!(void, {
        let size = MatmulAttrs::size(attr)?;
        let bytes = super::config_attribute_bytes(attr, size, buf, size_in_bytes)?;
        MATMUL_CONFIGS.update(config as usize, "config", |c| c.set(attr, bytes))
    })
}

/// Destroy a matmul config (NULL is a no-op, as in TE).
#[unsafe(no_mangle)]
pub extern "C" fn nvte_destroy_matmul_config(config: NVTEMatmulConfig) {
    entry!(void, {
        if !config.is_null() {
            MATMUL_CONFIGS.remove(config as usize, "config")?;
        }
        Ok(())
    })
}

/// Number of live matmul configs (for leak checks in tests).
#[unsafe(no_mangle)]
pub extern "C" fn nvte_comm_live_matmul_config_count() -> usize {
    entry!(plain, { MATMUL_CONFIGS.len() })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attribute_sizes_are_te_sizes() {
        let sizes: Vec<usize> = (0..7)
            .map(|a| MatmulAttrs::size(Attr(a)).unwrap())
            .collect();
        assert_eq!(sizes, vec![PTR, PTR, 1, 1, PTR, 1, 4]);
        assert!(MatmulAttrs::size(Attr::kNVTEMatmulConfigNumAttributes).is_err());
        assert!(MatmulAttrs::size(Attr(u32::MAX)).is_err());
    }

    #[test]
    fn attributes_round_trip_and_are_checked() {
        let mut c = MatmulAttrs::default();
        c.set(
            Attr::kNVTEMatmulConfigBiasTensor,
            &0x1234usize.to_ne_bytes(),
        )
        .unwrap();
        c.set(Attr::kNVTEMatmulConfigWithGELUEpilogue, &[1])
            .unwrap();
        c.set(Attr::kNVTEMatmulConfigSMCount, &66i32.to_ne_bytes())
            .unwrap();
        c.set(Attr::kNVTEMatmulConfigUseSplitAccumulator, &[7])
            .unwrap();
        assert_eq!(c.bias_tensor, 0x1234);
        assert!(c.with_gelu_epilogue && c.use_split_accumulator);
        assert_eq!(c.sm_count, 66);
        assert_eq!(
            c.get(Attr::kNVTEMatmulConfigSMCount).unwrap(),
            66i32.to_ne_bytes()
        );
        assert_eq!(
            c.get(Attr::kNVTEMatmulConfigBiasTensor).unwrap(),
            0x1234usize.to_ne_bytes()
        );
        assert_eq!(
            c.get(Attr::kNVTEMatmulConfigUseSplitAccumulator).unwrap(),
            [1]
        );
        assert!(c.set(Attr::kNVTEMatmulConfigSMCount, &[1, 0]).is_err());
        assert!(
            c.set(Attr::kNVTEMatmulConfigSMCount, &(-3i32).to_ne_bytes())
                .is_err()
        );
        assert_eq!(c.sm_count, 66, "a rejected value changes nothing");
        assert!(c.get(Attr(9)).is_err());
    }

    #[test]
    fn epilogues_follow_te_rules() {
        let none = MatmulAttrs::default().epilogue().unwrap();
        assert!(none.0.is_none() && none.1.is_none() && !none.2);
        // Gradient epilogues exclude bias and GELU.
        let bad = MatmulAttrs {
            dbias_tensor: 8,
            with_gelu_epilogue: true,
            ..Default::default()
        };
        let e = bad.epilogue().unwrap_err();
        assert!(e.msg.contains("gradient epilogue"), "{}", e.msg);
        // GELU without its aux tensor.
        let no_aux = MatmulAttrs {
            with_dgelu_epilogue: true,
            ..Default::default()
        };
        let e = no_aux.epilogue().unwrap_err();
        assert!(e.msg.contains("without an aux tensor"), "{}", e.msg);
        // A stale tensor handle is named by its attribute.
        let stale = MatmulAttrs {
            bias_tensor: 0x5,
            ..Default::default()
        };
        let e = stale.epilogue().unwrap_err();
        assert!(e.msg.contains("kNVTEMatmulConfigBiasTensor"), "{}", e.msg);
    }
}

#[cfg(test)]
mod c_api_tests {
    use super::*;
    use crate::error::{last_error_string, last_kind};

    #[test]
    fn a_config_lives_from_create_to_destroy_through_the_handle_table() {
        let c = nvte_create_matmul_config();
        assert!(!c.is_null());
        // (Other tests create configs at the same time: the count is at least this one.)
        assert!(nvte_comm_live_matmul_config_count() >= 1);
        // Sizes without a buffer, as TE.
        let mut size = 0usize;
        for (a, want) in [(0, PTR), (2, 1), (6, 4)] {
            nvte_get_matmul_config_attribute(c, Attr(a), std::ptr::null_mut(), 0, &mut size);
            assert_eq!((last_kind(), size), (None, want), "attr {a}");
        }
        let sm = 32i32;
        nvte_set_matmul_config_attribute(
            c,
            Attr::kNVTEMatmulConfigSMCount,
            &sm as *const i32 as _,
            4,
        );
        assert_eq!(last_kind(), None, "{}", last_error_string());
        let mut got = 0i32;
        nvte_get_matmul_config_attribute(
            c,
            Attr::kNVTEMatmulConfigSMCount,
            &mut got as *mut i32 as _,
            4,
            &mut size,
        );
        assert_eq!((got, size), (32, 4));
        // Too small a buffer, an invalid attribute, a NULL buffer: errors, value kept.
        nvte_set_matmul_config_attribute(
            c,
            Attr::kNVTEMatmulConfigSMCount,
            &sm as *const i32 as _,
            2,
        );
        assert!(
            last_error_string().contains("too small"),
            "{}",
            last_error_string()
        );
        nvte_set_matmul_config_attribute(c, Attr(7), &sm as *const i32 as _, 8);
        assert!(last_error_string().contains("not a valid NVTEMatmulConfigAttribute"));
        nvte_set_matmul_config_attribute(c, Attr::kNVTEMatmulConfigSMCount, std::ptr::null(), 4);
        assert!(last_error_string().contains("`buf` is NULL"));
        nvte_destroy_matmul_config(c);
        assert_eq!(last_kind(), None);
        // Destroyed: every use is an error naming the handle, never a crash.
        nvte_set_matmul_config_attribute(
            c,
            Attr::kNVTEMatmulConfigSMCount,
            &sm as *const i32 as _,
            4,
        );
        assert!(
            last_error_string().contains("not a live matmul config"),
            "{}",
            last_error_string()
        );
        nvte_destroy_matmul_config(c);
        assert!(last_error_string().contains("not a live matmul config"));
        nvte_destroy_matmul_config(std::ptr::null_mut());
        assert_eq!(last_kind(), None, "NULL is a no-op");
    }
}
