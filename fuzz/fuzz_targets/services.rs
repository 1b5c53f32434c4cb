//! libFuzzer target `services`: [`flexstack_fuzz::parsers::check_services`].
#![no_main]

use flexstack_fuzz::{parsers, require};

libfuzzer_sys::fuzz_target!(|data: &[u8]| require(parsers::check_services(data)));
