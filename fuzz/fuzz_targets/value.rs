//! libFuzzer target `value`: [`flexstack_fuzz::parsers::check_value`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| flexstack_fuzz::require(flexstack_fuzz::parsers::check_value(data)));
