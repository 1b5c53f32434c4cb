//! The check of the app-variable protocol on the daemon's side (`flexstack_daemon::appvars`: the connection handler
//! an application talks to), shared by the stable-Rust fuzz test `tests/appvars_fuzz.rs` (which includes this
//! file) and the libFuzzer target `appreq`.

use flexstack_core::SharedRegistry;
use flexstack_daemon::appvars::{AppSocketOptions, AppVars};
use serde_json::Value as Json;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::Duration;

/// Runs one session: writes `input`, closes the writing side, returns every line the daemon answered.
pub fn session(vars: &Arc<AppVars>, input: &[u8]) -> Result<Vec<String>, String> {
    let (mut client, server) = UnixStream::pair().map_err(|e| e.to_string())?;
    let v = vars.clone();
    let opts = AppSocketOptions { register_timeout: Duration::from_secs(5), ..AppSocketOptions::default() };
    let t = std::thread::spawn(move || v.connection(server, &opts));
    client.set_read_timeout(Some(Duration::from_secs(10))).map_err(|e| e.to_string())?;
    // Write from a thread: the daemon's answers are read meanwhile, so neither side blocks on a full buffer.
    let mut w = client.try_clone().map_err(|e| e.to_string())?;
    let data = input.to_vec();
    let writer = std::thread::spawn(move || {
        let _ = w.write_all(&data);
        let _ = w.shutdown(std::net::Shutdown::Write);
    });
    let mut out = Vec::new();
    client.read_to_end(&mut out).map_err(|e| format!("reading the answers: {e}"))?;
    writer.join().map_err(|_| "writer panicked")?;
    t.join().map_err(|_| "the connection handler panicked".to_string())?;
    Ok(String::from_utf8_lossy(&out).lines().map(str::to_string).collect())
}

/// How many answers `input` must get: one per non-empty line that is not an `ack` (a line over 64 KiB ends it).
pub fn expected_answers(input: &[u8]) -> Option<usize> {
    let text = String::from_utf8_lossy(input);
    let mut n = 0;
    for line in text.split_inclusive('\n') {
        if line.trim().is_empty() {
            continue;
        }
        let parsed: Option<Json> = serde_json::from_str(line).ok();
        if parsed.as_ref().and_then(|v| v.get("op")).and_then(Json::as_str) == Some("ack") {
            return None; // an ack may or may not be well formed: it is counted loosely below
        }
        n += 1;
    }
    Some(n)
}

/// One session of lines an application sends (register, update, ack ...) through [`AppVars::connection`] over a
/// socket pair: every answer is JSON with `ok` (and `error.code` when false) or an event, every non-empty line but
/// an `ack` gets exactly one answer, and no variable of the session is left once the connection closed.
pub fn check_session(vars: &Arc<AppVars>, registry: &SharedRegistry, input: &[u8]) -> Result<(), String> {
    let answers = session(vars, input)?;
    for a in &answers {
        let v: Json = serde_json::from_str(a).map_err(|e| format!("answer {a:?} is not JSON: {e}"))?;
        match v.get("ok").and_then(Json::as_bool) {
            Some(true) => {}
            Some(false) if v["error"]["code"].is_string() => {}
            _ if v["event"]["op"].is_string() => {}
            _ => return Err(format!("answer without ok or error.code: {a}")),
        }
    }
    let replies = answers.iter().filter(|a| !a.starts_with("{\"event\"")).count();
    let too_large = answers.iter().any(|a| a.contains("too_large"));
    if let (Some(n), false) = (expected_answers(input), too_large) {
        if replies != n {
            return Err(format!("{n} request lines got {replies} answers: {answers:?}"));
        }
    }
    if !vars.list().is_empty() || registry.snapshot().matching("app.**").next().is_some() {
        return Err(format!("variables left after the connection closed: {:?}", vars.list()));
    }
    Ok(())
}
