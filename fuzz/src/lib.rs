//! The checks behind flexstack's libFuzzer targets (`fuzz/fuzz_targets/`, run by `scripts/fuzz.sh`): one function
//! per parser. The stable-Rust fuzz tests include the same files (`#[path]`), so a property checked by one is
//! checked by the other, and a crash found by libFuzzer replays in `cargo test` once its input is a corpus seed.

#![deny(unsafe_code)]

pub mod appvars;
pub mod journal;
pub mod lab;
pub mod packet;
pub mod parsers;
pub mod rules;

use std::path::Path;
use std::sync::OnceLock;

/// A folder for the files checks may create (a tap's capture file), made once per process inside `$TMPDIR`
/// (`scripts/fuzz.sh` points it at a folder of its own and removes that afterwards: libFuzzer exits without
/// running destructors).
pub fn scratch() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| tempfile::tempdir().expect("a scratch folder in $TMPDIR")).path()
}

/// Ends the run with the check's problem: libFuzzer writes the input as a crash artifact.
pub fn require<T>(result: Result<T, String>) {
    if let Err(problem) = result {
        panic!("{problem}");
    }
}
