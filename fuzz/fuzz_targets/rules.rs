//! libFuzzer target `rules`: [`flexstack_fuzz::rules::check`] (rule files: parser, checker, rendering, engine).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    flexstack_fuzz::require(flexstack_fuzz::rules::check(&String::from_utf8_lossy(data)));
});
