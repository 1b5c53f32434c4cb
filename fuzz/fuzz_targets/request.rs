//! libFuzzer target `request`: [`flexstack_fuzz::parsers::check_request`].
#![no_main]

use flexstack_fuzz::{parsers, require, scratch};

libfuzzer_sys::fuzz_target!(|data: &[u8]| require(parsers::check_request(data, scratch())));
