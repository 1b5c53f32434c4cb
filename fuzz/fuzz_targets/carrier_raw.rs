//! libFuzzer target `carrier_raw`: the check of the raw packets a peer sends over the raw stack
//! (`flexstack_modules::stream::carrier::raw::check_packet`: one whole IPv4 or IPv6 packet, its addresses read).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| flexstack_modules::stream::carrier::raw::check(data));
