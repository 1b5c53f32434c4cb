//! libFuzzer target `journal`: [`flexstack_fuzz::journal::check`] (the daemon's persistence journal, read by
//! `flexstack_daemon::journal::scan` and folded into a revision log).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    flexstack_fuzz::require(flexstack_fuzz::journal::check(data));
});
