//! libFuzzer target `carrier`: the peer protocol's parser (`flexstack_modules::stream::carrier::wire`: decoded
//! message by message, whatever decodes re-encodes to the same bytes).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| flexstack_modules::stream::carrier::wire::check_roundtrip(data));
