//! The check of the lab file parser (`flexstack_lab::Lab::parse`, `labs/*.toml`), shared by the stable-Rust fuzz
//! tests of `crates/lab/tests/` (which include this file through their `common` module) and the libFuzzer target
//! `lab`.

use flexstack_core::config::ConfigError;
use flexstack_lab::Lab;

/// The error is located in `file` at a line of `text` (or just after its end) and a column of that line.
pub fn located(e: &ConfigError, file: &str, text: &str) -> Result<(), String> {
    let loc = e.location.as_ref().ok_or_else(|| format!("error without a location: {e}"))?;
    let lines: Vec<&str> = text.split('\n').collect();
    let width = lines.get(loc.line.wrapping_sub(1)).map_or(0, |l| l.chars().count());
    if &*loc.file != file || loc.line < 1 || loc.line > lines.len() || loc.column < 1 || loc.column > width + 1 {
        return Err(format!("location outside the file ({} lines, line width {width}): {e}", lines.len()));
    }
    Ok(())
}

/// `Lab::parse` on a lab file: an accepted lab has a deterministic timeline and its events in time order; a refused
/// one has an error located inside the file. Input that is not UTF-8 is not a lab file: skipped.
pub fn check_lab(input: &[u8]) -> Result<(), String> {
    let Ok(text) = std::str::from_utf8(input) else { return Ok(()) };
    match Lab::parse("fuzz.toml", text) {
        Ok(lab) => {
            if lab.timeline() != lab.timeline() {
                return Err("timeline not deterministic".into());
            }
            if lab.events.windows(2).any(|w| w[0].at > w[1].at) {
                return Err("events not sorted".into());
            }
            Ok(())
        }
        Err(e) => located(&e, "fuzz.toml", text),
    }
}
