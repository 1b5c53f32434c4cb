//! libFuzzer target `carrier_datagram`: the `quic` carrier's DATAGRAM payload parser
//! (`flexstack_modules::stream::carrier::wire::decode_datagram`: whatever decodes re-encodes to the same bytes).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| flexstack_modules::stream::carrier::wire::check_datagram(data));
