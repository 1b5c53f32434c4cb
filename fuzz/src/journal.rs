//! The check of the daemon's persistence journal reader (`flexstack_daemon::journal::scan`, docs/persistence.md),
//! shared by the stable-Rust fuzz test `tests/journal_fuzz.rs` (which includes this file) and the libFuzzer target
//! `journal`: the good part is a prefix of whole records that read back the same when written again; the damage, if
//! any, starts right after it and covers the rest; the records fold into a state that a revision log takes back
//! without overflowing, and that writes back as the same state.

use flexstack_daemon::actions::RevisionLog;
use flexstack_daemon::journal::{self, Record, State, MAGIC};

/// The journal `records` make.
pub fn journal_of(records: &[Record]) -> Vec<u8> {
    let mut bytes = MAGIC.to_vec();
    for r in records {
        bytes.extend_from_slice(&journal::encode(r));
    }
    bytes
}

/// Reads `input` as a journal and checks what the reader says about it.
pub fn check(input: &[u8]) -> Result<(), String> {
    let scan = journal::scan(input);
    let good = usize::try_from(scan.good_bytes).map_err(|e| e.to_string())?;
    if good > input.len() {
        return Err(format!("good part of {good} bytes in an input of {}", input.len()));
    }
    // The good part is the records, written again byte for byte (they were written by `encode`, or their
    // checksum would not match) — or, when a mutation planted a valid record, read back equal.
    if !scan.records.is_empty() {
        let again = journal::scan(&journal_of(&scan.records));
        if again.records != scan.records || again.damage.is_some() {
            return Err(format!("the records do not read back: {again:?}"));
        }
        let good_only = journal::Scan { damage: None, ..scan.clone() };
        if journal::scan(&input[..good]) != good_only {
            return Err("the good part alone does not read as the same records".into());
        }
    }
    match &scan.damage {
        None if good != input.len() && !input.is_empty() => return Err(format!("{good} good bytes, no damage")),
        Some(d) => {
            let header = d.record == 0;
            if d.offset != scan.good_bytes && !header {
                return Err(format!("damage at {} but the good part ends at {good}", d.offset));
            }
            if d.offset + d.ignored != input.len() as u64 {
                return Err(format!("damage {d} does not cover the rest of {} bytes", input.len()));
            }
            if !header && d.record != scan.records.len() as u64 + 1 {
                return Err(format!("damage in record {} after {} good ones", d.record, scan.records.len()));
            }
            if d.to_string().is_empty() || d.reason.contains('\n') {
                return Err(format!("a damage report is one line: {d:?}"));
            }
        }
        None => {}
    }
    let state = State::from_records(scan.records);
    if State::from_records(state.records().collect()) != state {
        return Err("the state does not write back as itself".into());
    }
    let mut log = RevisionLog::default();
    for r in &state.revisions {
        log.restore(flexstack_daemon::actions::Revision::from(r));
    }
    let latest = state.revisions.last().map_or(0, |r| r.number);
    if log.latest() != latest {
        return Err(format!("the log's latest is {} after restoring up to {latest}", log.latest()));
    }
    // The numbering goes on.
    let next = log.push(0, "fuzz", String::new(), Vec::new(), String::new());
    if next != latest + 1 {
        return Err(format!("revision {next} after {latest}"));
    }
    Ok(())
}
