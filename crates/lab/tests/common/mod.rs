//! Shared by the lab crate's fuzz tests: the checks of `fuzz/src/lab.rs`, which the libFuzzer target `lab` uses too.

#[allow(dead_code)]
#[path = "../../../../fuzz/src/lab.rs"]
mod checks;

#[allow(unused_imports)]
pub use checks::{check_lab, located};
