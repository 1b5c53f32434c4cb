//! Checks rule files without a daemon: prints every error and warning as `file:line:column: ...`, or the rules
//! each file defines with their commands. Variables named in `get`/`set` are checked against an empty registry,
//! so every name outside flow./iface./app. is reported as unknown.
//!
//! Run: `cargo run -p flexstack-rules --example check -- FILE...`

use flexstack_rules::{compile, MemoryEnv, Program};
use std::process::ExitCode;

fn main() -> ExitCode {
    let mut failed = false;
    for path in std::env::args().skip(1) {
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) => {
                eprintln!("{path}: {e}");
                failed = true;
                continue;
            }
        };
        match compile(&path, &text, &Program::default(), &MemoryEnv::new()) {
            Ok(c) => {
                for w in &c.warnings {
                    println!("{path}:{w}");
                }
                for name in &c.defined {
                    println!("{name}: {}", c.program.rules[name].commands().join("; "));
                }
            }
            Err(diags) => {
                failed = true;
                for d in diags {
                    println!("{path}:{d}");
                }
            }
        }
    }
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
