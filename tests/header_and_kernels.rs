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
        "void nvte_cublas_gemm_scaled(NVTETensor A,",
        "void nvte_cublas_gemm_v2(int32_t transa,",
        "NVTEMatmulConfig nvte_create_matmul_config(void);",
        "void nvte_set_matmul_config_attribute(NVTEMatmulConfig config,",
        "typedef void *NVTEMatmulConfig;",
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
    // A real NVRTC compilation for the exact Hopper target on a cache miss, kept in the
    // library's disk cache (NVTE_COMM_CACHE_DIR, else $XDG_CACHE_HOME or ~/.cache; keyed by
    // the full source with its defines, the headers, the options and NVRTC's version), so
    // an unchanged kernel is compiled once per machine; NVTE_COMM_DISABLE_KERNEL_CACHE=1
    // compiles every one afresh. The sources compile in parallel threads.
    // GEMM_SM90: the plain kernels the library launches; GEMM_SM90_BLOCK: its _block
    // kernels (loaded on demand); GEMM_SM90_ALL: every kernel of the file
    // (bench/own_gemm.cpp runs them on a GPU): three programs, all compiled.
    // CAST_VARIANTS: the bench variants of the cast + transpose (NVTE_COMM_CAST_TRANSPOSE).
    let sources = [
        ("cast.cu", nvrtc::CAST),
        (
            "block_quant.cu",
            transformer_engine_comm::kernels::block::BLOCK_QUANT,
        ),
        ("comm.cu", nvrtc::COMM),
        ("gemm_sm90.cu (the library's kernels)", nvrtc::GEMM_SM90),
        ("gemm_sm90.cu (the _block kernels)", nvrtc::GEMM_SM90_BLOCK),
        ("gemm_sm90.cu (every kernel)", nvrtc::GEMM_SM90_ALL),
        (
            "cast variants",
            transformer_engine_comm::kernels::CAST_VARIANTS,
        ),
    ];
    let dir = nvrtc::cache_dir().expect("the kernel cache folder");
    let t0 = std::time::Instant::now();
    let results: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = sources
            .iter()
            .map(|(_, src)| s.spawn(|| nvrtc::compile_cached(src, "sm_90a", dir.as_deref())))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut compiled = 0;
    for ((what, _), result) in sources.iter().zip(results) {
        let (cubin, cached) =
            result.unwrap_or_else(|e| panic!("kernels/{what} must compile for sm_90a: {e}"));
        assert!(
            cubin.len() > 1000 && &cubin[..4] == b"\x7fELF",
            "NVRTC did not return an ELF cubin for {what}"
        );
        compiled += usize::from(!cached);
        // The library's two gemm_sm90 modules hold the kernels it binds from each: the
        // plain ones (no _block) and the _block ones alone (loaded on demand).
        let has = |name: &str| cubin.windows(name.len()).any(|w| w == name.as_bytes());
        let (want, not): (&[&str], &[&str]) = match *what {
            "gemm_sm90.cu (the library's kernels)" => (
                &[
                    "gemm_sm90_tn_e4m3_e4m3_bf16_128",
                    "gemm_sm90_tn_bf16_bf16_bf16_192",
                ],
                &["_128_block"],
            ),
            "gemm_sm90.cu (the _block kernels)" => (
                &[
                    "gemm_sm90_tn_e4m3_e4m3_bf16_128_block",
                    "gemm_sm90_tn_e4m3_e4m3_f16_128_block",
                    "gemm_sm90_tn_e4m3_e4m3_f32_128_block",
                ],
                &["gemm_sm90_tn_bf16_bf16_bf16_192"],
            ),
            _ => (&[], &[]),
        };
        for k in want {
            assert!(has(k), "{what}: the cubin lacks `{k}`");
        }
        for k in not {
            assert!(!has(k), "{what}: the cubin holds `{k}`");
        }
    }
    eprintln!(
        "kernels_compile_for_hopper_with_nvrtc: {compiled} of {} compiled with NVRTC, the rest from the cache at {} ({:.1} s)",
        sources.len(),
        dir.as_deref()
            .map_or("(none)".into(), |d| d.display().to_string()),
        t0.elapsed().as_secs_f64()
    );
}
