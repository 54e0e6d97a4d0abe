//! CPU-only checks: the committed header matches the enum table, and the kernels
//! compile with NVRTC for Hopper (NVRTC needs no GPU; CI installs it from a wheel).
use transformer_engine_comm::cuda::{self, Lib, nvrtc};
use transformer_engine_comm::ffi::{NVTECommStatus, NVTEDType, NVTEScalingMode, NVTETensorParam};

fn header() -> String {
    std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/include/transformer_engine_comm.h"
    ))
    .unwrap()
}

#[test]
fn header_declares_every_enum_value() {
    let h = header();
    let tables: [(&str, &[(&str, u32)]); 4] = [
        ("NVTEDType", NVTEDType::ALL),
        ("NVTETensorParam", NVTETensorParam::ALL),
        ("NVTEScalingMode", NVTEScalingMode::ALL),
        ("NVTECommStatus", NVTECommStatus::ALL),
    ];
    for (ty, values) in tables {
        assert!(
            h.contains(&format!("typedef enum {ty} {{")),
            "{ty} is not a C enum in the header"
        );
        for (name, v) in values {
            assert!(
                h.contains(&format!("  {name} = {v},")),
                "{ty}::{name} = {v} missing from the header"
            );
        }
    }
    // TE's values, spot-checked independently of the table.
    assert_eq!(NVTEDType::kNVTEFloat8E4M3.0, 7);
    assert_eq!(NVTETensorParam::kNVTEColumnwiseAmax.0, 6);
    assert_eq!(NVTEScalingMode::NVTE_INVALID_SCALING.0, 100);
}

#[test]
fn header_declares_te_functions_with_te_signatures() {
    let h = header();
    for decl in [
        "NVTETensor nvte_create_tensor(NVTEScalingMode scaling_mode);",
        "void nvte_destroy_tensor(NVTETensor tensor);",
        "NVTEShape nvte_make_shape(const size_t *data, size_t ndim);",
        "void nvte_set_tensor_param_v2(NVTETensor tensor,",
        "void nvte_get_tensor_param_v2(NVTETensor tensor,",
        "void nvte_quantize(NVTETensor input, NVTETensor output, cudaStream_t stream);",
        "void nvte_cublas_gemm(NVTETensor A,",
        "const char *nvte_comm_last_error(void);",
        "typedef struct CUstream_st *cudaStream_t;",
        "typedef struct ncclComm *ncclComm_t;",
    ] {
        assert!(h.contains(decl), "header lacks `{decl}`");
    }
}

#[test]
fn kernels_compile_for_hopper_with_nvrtc() {
    if cuda::require(Lib::Nvrtc).is_err() {
        assert!(
            std::env::var_os("NVTE_COMM_REQUIRE_NVRTC").is_none(),
            "NVTE_COMM_REQUIRE_NVRTC is set but NVRTC cannot be loaded"
        );
        eprintln!(
            "SKIPPED kernels_compile_for_hopper_with_nvrtc: libnvrtc not found (scripts/install-deps.sh provides it)"
        );
        return;
    }
    // Always a real compilation (no disk cache), for the exact Hopper target.
    // GEMM_SM90: the plain kernels the library launches; GEMM_SM90_ALL: every kernel of
    // the file (bench/own_gemm.cpp runs them on a GPU).
    // CAST_VARIANTS: the bench variants of the cast + transpose (NVTE_COMM_CAST_TRANSPOSE).
    for src in [
        nvrtc::CAST,
        nvrtc::COMM,
        nvrtc::GEMM_SM90,
        nvrtc::GEMM_SM90_ALL,
        transformer_engine_comm::kernels::CAST_VARIANTS,
    ] {
        let cubin = nvrtc::compile_fresh(&src, "sm_90a")
            .unwrap_or_else(|e| panic!("kernels/{} must compile for sm_90a: {e}", src.name));
        assert!(
            cubin.len() > 1000 && &cubin[..4] == b"\x7fELF",
            "NVRTC did not return an ELF cubin for {}",
            src.name
        );
    }
}
