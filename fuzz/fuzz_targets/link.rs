//! libFuzzer target `link`: [`flexstack_fuzz::parsers::check_link`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| flexstack_fuzz::require(flexstack_fuzz::parsers::check_link(data)));
