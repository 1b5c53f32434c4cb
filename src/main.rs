//! The `flexstack` binary: see [`flexstack::cli`].
#![deny(unsafe_code)]

fn main() -> std::process::ExitCode {
    flexstack::cli::main()
}
