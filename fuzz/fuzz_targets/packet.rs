//! libFuzzer target `packet`: [`flexstack_fuzz::packet::check_packet`] (the wire crate's packet parser and the ICMP
//! errors built around any packet).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| flexstack_fuzz::require(flexstack_fuzz::packet::check_packet(data)));
