//! The NVTX client against a fake injection library (tests_c/nvtx_fake_tool.c, built
//! here with `cc`) that follows NVTX v3's protocol as Nsight Systems does: ranges and
//! markers reach the tool with their names and nesting, and nothing happens without
//! NVTE_COMM_NVTX. One process: NVTX initialises once.
use std::process::Command;

#[test]
fn ranges_reach_an_injected_tool() {
    let root = env!("CARGO_MANIFEST_DIR");
    let dir = std::env::temp_dir().join(format!("te_comm_nvtx_{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let lib = dir.join("libnvtx_fake_tool.so");
    let log = dir.join("events.log");
    let st = Command::new("cc")
        .args(["-shared", "-fPIC", "-o"])
        .arg(&lib)
        .arg(format!("{root}/tests_c/nvtx_fake_tool.c"))
        .status()
        .expect("cc (a C compiler) is needed to build the fake NVTX tool");
    assert!(st.success());
    // SAFETY: set before any other thread of this test binary reads the environment
    // (this file has one test).
    unsafe {
        std::env::set_var("NVTX_INJECTION64_PATH", &lib);
        std::env::set_var("NVTX_FAKE_TOOL_LOG", &log);
        std::env::set_var("NVTE_COMM_NVTX", "1");
    }
    use transformer_engine_comm::cuda::nvtx;
    assert!(nvtx::enabled(), "the tool was not injected");
    {
        let _call = nvtx::range(|| "te_comm SplitAg call 1".into());
        for i in 0..2 {
            let _step = nvtx::range(|| format!("step {i}"));
        }
        nvtx::mark(|| "marker".into());
    }
    let text = std::fs::read_to_string(&log).unwrap();
    let want = "init core_size 16\npush 1 te_comm SplitAg call 1\npush 2 step 0\npop 2\npush 2 step 1\npop 2\nmark 1 marker\npop 1\n";
    assert_eq!(text, want);
    let _ = std::fs::remove_dir_all(&dir);
}
