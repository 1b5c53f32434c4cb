//! libFuzzer target `stack`: [`flexstack_fuzz::parsers::check_stack`].
#![no_main]

use flexstack_fuzz::{parsers, require, scratch};

libfuzzer_sys::fuzz_target!(|data: &[u8]| require(parsers::check_stack(data, scratch())));
