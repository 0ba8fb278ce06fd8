//! Fuzz target `hf_dir`: see `kapitsa_fuzz_harness::hf_dir` for the input format and the contract.
#![no_main]

libfuzzer_sys::fuzz_target!(init: kapitsa_fuzz_harness::fuzz_init(), |data: &[u8]| {
    let _ = kapitsa_fuzz_harness::hf_dir(data);
});
