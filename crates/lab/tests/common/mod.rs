//! Shared by the lab crate's fuzz tests.

use flexstack_core::config::ConfigError;

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
