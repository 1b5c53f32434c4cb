//! libFuzzer target `carrier_udp`: the `udp` and `udpplus` carriers' datagram and item parser
//! (`flexstack_modules::stream::carrier::dgram`: whatever decodes re-encodes to the same bytes).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| flexstack_modules::stream::carrier::dgram::check(data));
