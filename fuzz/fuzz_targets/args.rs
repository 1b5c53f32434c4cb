//! libFuzzer target `args`: [`flexstack_fuzz::parsers::check_args`].
#![no_main]

use flexstack_fuzz::{parsers, require, scratch};

libfuzzer_sys::fuzz_target!(|data: &[u8]| require(parsers::check_args(data, scratch())));
