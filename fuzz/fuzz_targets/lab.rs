//! libFuzzer target `lab`: [`flexstack_fuzz::lab::check_lab`] (lab files, `labs/*.toml`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| flexstack_fuzz::require(flexstack_fuzz::lab::check_lab(data)));
