//! The persistence journal: an append-only file in the state directory (`STATE_DIR/journal`) holding every stack
//! revision and every change of the rules, so that `flexstack daemon --restore` comes back to the last state
//! (docs/persistence.md).
//!
//! The file is a header ([`MAGIC`]) followed by records, each `length (u32 LE) | crc32 (u32 LE) | payload`, where
//! the payload is a [`Record`] as JSON and the CRC-32 (IEEE, `crc32fast`) covers the length's four bytes and the
//! payload, so a damaged length is caught as surely as a damaged payload. A record is written, and for changes a
//! client asked for synced to disk, before the change is acknowledged.
//!
//! - [`scan`] reads a journal's bytes (sans-IO, fuzzed by tests/journal_fuzz.rs): the good records up to the first
//!   damage (a bad header, a cut record, a checksum that does not match, a payload that is no record), and where
//!   that damage is: byte offset and record number.
//! - [`State::from_records`] folds records into what a restore needs: the stack's revisions (a later record with a
//!   revision's number replaces it) and the rules' changes, in order.
//! - [`Journal`] is the open file: [`Journal::append`], and [`Journal::rewrite`] (compaction: the records of the
//!   state to keep, written to `journal.tmp`, synced, and renamed over the journal).
//! - [`set_aside`] moves an old journal out of the way (a daemon started without `--restore`, or a damaged journal
//!   restored from), under a name with the time, keeping the last [`KEEP_SET_ASIDE`] of each kind.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

/// The journal's name in the state directory.
pub const JOURNAL_NAME: &str = "journal";

/// The first bytes of every journal (the `1` is the format's version).
pub const MAGIC: &[u8; 8] = b"FSJRNL1\n";

/// Largest record read or written (a whole stack description is at most 4 MiB; rules texts are smaller).
pub const MAX_RECORD: usize = 16 << 20;

/// Size past which the journal is compacted, by default (`daemon --journal-max-bytes`).
pub const DEFAULT_MAX_BYTES: u64 = 16 << 20;

/// How many set-aside journals of each kind (`journal.<time>`, `journal.damaged.<time>`) are kept.
pub const KEEP_SET_ASIDE: usize = 5;

/// Highest revision number read (2^53: exact in JSON everywhere, and a daemon can count on from it).
pub const MAX_NUMBER: u64 = 1 << 53;

/// Bytes before each record's payload: its length and checksum.
const RECORD_HEADER: usize = 8;

/// One entry of the journal.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "record", rename_all = "snake_case", deny_unknown_fields)]
pub enum Record {
    /// A stack revision (`config log`), with the whole stack after it.
    Revision(StoredRevision),
    /// A change of the rules (`rules log`), replayed in order at a restore.
    Rules(RulesChange),
    /// The peer table after a change (`peer add`, `peer del`); the last one is the table a restore brings back.
    Peers(StoredPeers),
}

/// The peer table as the journal holds it (docs/peers.md).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StoredPeers {
    /// Every peer, by name.
    pub peers: Vec<StoredPeer>,
}

/// One peer as `peer add` took it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StoredPeer {
    /// Its name.
    pub name: String,
    /// `ADDR:PORT`.
    pub addr: String,
    /// Its certificate's SHA-256, 64 hex digits.
    pub fingerprint: String,
}

/// A stack revision as the journal holds it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StoredRevision {
    /// Its number (from 1).
    pub number: u64,
    /// When, in milliseconds since the Unix epoch.
    pub time_ms: u64,
    /// Who asked for it.
    pub user: String,
    /// What changed.
    pub change: String,
    /// The switch's notes.
    #[serde(default)]
    pub notes: Vec<String>,
    /// The whole stack after it, as TOML.
    pub stack: String,
    /// The modules of the stack that belong to sandboxed apps (not restored: their namespaces are gone).
    #[serde(default)]
    pub app_modules: Vec<String>,
    /// For an entry of a rule's knob writes (coalesced, `config log`): the rule, how many writes, since when. A
    /// later entry of the same rule and window replaces it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rule: Option<RuleWrites>,
}

/// The knob writes of one rule that a revision stands for.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RuleWrites {
    /// The rule that wrote.
    pub rule: String,
    /// How many writes.
    pub writes: u64,
    /// When the first of them was made, in milliseconds since the Unix epoch.
    pub first_ms: u64,
}

/// A change of the rules and the rules revision it made.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RulesChange {
    /// The rules revision it became.
    pub revision: u64,
    /// What was done.
    pub op: RulesOp,
}

/// The rules requests that change the rules.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum RulesOp {
    /// `rules load`: a text and the name it was read from.
    Load {
        /// The text's name (a file name).
        source: String,
        /// The text.
        text: String,
    },
    /// `rules unload NAME...` (`ALL`).
    Unload {
        /// The names.
        names: Vec<String>,
    },
    /// `rules delete NAME...` (`ALL`).
    Delete {
        /// The names.
        names: Vec<String>,
    },
    /// `rules replace OLD NEW`.
    Replace {
        /// The rule replaced.
        old: String,
        /// The rule replacing it.
        new: String,
    },
    /// `rules rollback REV`.
    Rollback {
        /// The revision returned to.
        revision: u64,
    },
}

/// Where a journal is damaged.
#[derive(Clone, Debug, PartialEq)]
pub struct Damage {
    /// Byte offset of the damaged record (or of the header).
    pub offset: u64,
    /// The damaged record's number, from 1 (0: the header).
    pub record: u64,
    /// What is wrong.
    pub reason: String,
    /// Bytes from `offset` to the end, ignored.
    pub ignored: u64,
}

impl std::fmt::Display for Damage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.record == 0 {
            write!(f, "the header at byte {}", self.offset)?;
        } else {
            write!(f, "record {} at byte {}", self.record, self.offset)?;
        }
        write!(f, ": {}; the {} bytes from there on are ignored", self.reason, self.ignored)
    }
}

/// What [`scan`] read.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Scan {
    /// The good records, in order.
    pub records: Vec<Record>,
    /// Bytes up to the end of the last good record (the header included).
    pub good_bytes: u64,
    /// The first damage, if any: nothing after it is read.
    pub damage: Option<Damage>,
}

/// The checksum of a record: over its length's bytes and its payload.
fn checksum(len: [u8; 4], payload: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    h.update(&len);
    h.update(payload);
    h.finalize()
}

/// A record as bytes: length, checksum, JSON payload.
pub fn encode(record: &Record) -> Vec<u8> {
    let payload = serde_json::to_vec(record).expect("a record encodes");
    let len = u32::try_from(payload.len()).expect("a record fits in u32").to_le_bytes();
    let mut out = Vec::with_capacity(RECORD_HEADER + payload.len());
    out.extend_from_slice(&len);
    out.extend_from_slice(&checksum(len, &payload).to_le_bytes());
    out.extend_from_slice(&payload);
    out
}

/// Reads a journal's bytes: every good record up to the first damage. An empty input is an empty journal.
pub fn scan(bytes: &[u8]) -> Scan {
    let total = bytes.len() as u64;
    let mut scan = Scan::default();
    if bytes.is_empty() {
        return scan;
    }
    if bytes.len() < MAGIC.len() || &bytes[..MAGIC.len()] != MAGIC {
        let reason = "not a flexstack journal (its first bytes are not the header FSJRNL1)".to_string();
        scan.damage = Some(Damage { offset: 0, record: 0, reason, ignored: total });
        return scan;
    }
    let mut at = MAGIC.len();
    scan.good_bytes = at as u64;
    let mut number = 0u64;
    while at < bytes.len() {
        number += 1;
        let rest = &bytes[at..];
        let damaged = |reason: String| Damage { offset: at as u64, record: number, reason, ignored: total - at as u64 };
        if rest.len() < RECORD_HEADER {
            scan.damage = Some(damaged(format!("cut: {} bytes where a record's 8-byte header starts", rest.len())));
            return scan;
        }
        let len_bytes: [u8; 4] = rest[..4].try_into().expect("4 bytes");
        let stored = u32::from_le_bytes(rest[4..8].try_into().expect("4 bytes"));
        let len = u32::from_le_bytes(len_bytes) as usize;
        if len > MAX_RECORD {
            scan.damage = Some(damaged(format!("length {len} is over the limit of {MAX_RECORD} bytes")));
            return scan;
        }
        if rest.len() - RECORD_HEADER < len {
            let have = rest.len() - RECORD_HEADER;
            scan.damage = Some(damaged(format!("cut: {have} of its {len} bytes are there")));
            return scan;
        }
        let payload = &rest[RECORD_HEADER..RECORD_HEADER + len];
        let computed = checksum(len_bytes, payload);
        if computed != stored {
            scan.damage =
                Some(damaged(format!("checksum mismatch (stored {stored:#010x}, computed {computed:#010x})")));
            return scan;
        }
        match serde_json::from_slice::<Record>(payload) {
            Ok(Record::Revision(r)) if r.number == 0 || r.number > MAX_NUMBER => {
                let reason = format!("its checksum matches but its revision number {} is out of range", r.number);
                scan.damage = Some(damaged(reason));
                return scan;
            }
            Ok(r) => scan.records.push(r),
            Err(e) => {
                scan.damage = Some(damaged(format!("its checksum matches but it is not a journal record: {e}")));
                return scan;
            }
        }
        at += RECORD_HEADER + len;
        scan.good_bytes = at as u64;
    }
    scan
}

/// What the records of a journal add up to.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct State {
    /// The stack's revisions, oldest first, each number once (the last record of a number wins).
    pub revisions: Vec<StoredRevision>,
    /// The rules' changes, in order.
    pub rules: Vec<RulesChange>,
    /// The peer table of the last peers record (None: the journal has none).
    pub peers: Option<StoredPeers>,
}

impl State {
    /// Folds records into a state.
    pub fn from_records(records: Vec<Record>) -> State {
        let mut revisions = BTreeMap::new();
        let mut rules = Vec::new();
        let mut peers = None;
        for r in records {
            match r {
                Record::Revision(rev) => {
                    if let Some(w) = &rev.rule {
                        // The same rule's entry of the same window, merged into this one.
                        let same = |r: &StoredRevision| {
                            r.rule.as_ref().is_some_and(|o| o.rule == w.rule && o.first_ms == w.first_ms)
                        };
                        revisions.retain(|_, r| !same(r));
                    }
                    revisions.insert(rev.number, rev);
                }
                Record::Rules(change) => rules.push(change),
                Record::Peers(table) => peers = Some(table),
            }
        }
        State { revisions: revisions.into_values().collect(), rules, peers }
    }

    /// The records that write this state again: the peer table first, then rules changes, then revisions.
    pub fn records(&self) -> impl Iterator<Item = Record> + '_ {
        let peers = self.peers.iter().cloned().map(Record::Peers);
        let rules = self.rules.iter().cloned().map(Record::Rules);
        peers.chain(rules).chain(self.revisions.iter().cloned().map(Record::Revision))
    }

    /// True when there is nothing to restore.
    pub fn is_empty(&self) -> bool {
        self.revisions.is_empty() && self.rules.is_empty() && self.peers.is_none()
    }
}

/// The journal file, open for appending.
#[derive(Debug)]
pub struct Journal {
    path: PathBuf,
    file: File,
    size: u64,
}

fn io_error(path: &Path, what: &str, e: std::io::Error) -> String {
    format!("{}: cannot {what}: {e}", path.display())
}

/// Syncs a folder, so that a rename in it is on disk.
fn sync_dir(dir: &Path) -> Result<(), String> {
    File::open(dir).and_then(|d| d.sync_all()).map_err(|e| io_error(dir, "sync the folder", e))
}

impl Journal {
    /// The journal of state directory `dir`.
    pub fn path_in(dir: &Path) -> PathBuf {
        dir.join(JOURNAL_NAME)
    }

    /// Writes `records` as the whole journal at `path`: to `path.tmp`, synced, then renamed over `path` (a crash
    /// leaves either the old journal or the new one), and opens it for appending.
    pub fn rewrite(path: &Path, records: impl Iterator<Item = Record>) -> Result<Journal, String> {
        let tmp = path.with_extension("tmp");
        let mut bytes = MAGIC.to_vec();
        for r in records {
            bytes.extend_from_slice(&encode(&r));
        }
        // 0600: it holds the stack and the rules texts, and the state directory lets others reach files by name.
        let mut file = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)
            .map_err(|e| io_error(&tmp, "create", e))?;
        file.write_all(&bytes).and_then(|()| file.sync_all()).map_err(|e| io_error(&tmp, "write", e))?;
        std::fs::rename(&tmp, path).map_err(|e| io_error(path, "rename the rewritten journal into place", e))?;
        sync_dir(path.parent().unwrap_or(Path::new(".")))?;
        let file = OpenOptions::new().append(true).open(path).map_err(|e| io_error(path, "open", e))?;
        Ok(Journal { path: path.to_path_buf(), file, size: bytes.len() as u64 })
    }

    /// Appends a record; with `sync`, it is on disk when this returns.
    pub fn append(&mut self, record: &Record, sync: bool) -> Result<(), String> {
        let bytes = encode(record);
        if bytes.len() - RECORD_HEADER > MAX_RECORD {
            return Err(format!("{}: a record of {} bytes is over the limit", self.path.display(), bytes.len()));
        }
        if let Err(e) = self.file.write_all(&bytes) {
            // Part of the record may be there (a full disk): cut it off, so that what follows is read.
            let _ = self.file.set_len(self.size);
            return Err(io_error(&self.path, "append", e));
        }
        self.size += bytes.len() as u64;
        if sync {
            self.file.sync_data().map_err(|e| io_error(&self.path, "sync", e))?;
        }
        Ok(())
    }

    /// The file's size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Where it is.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Reads the journal at `path` (none: an empty scan).
pub fn read(path: &Path) -> Result<Scan, String> {
    match std::fs::read(path) {
        Ok(bytes) => Ok(scan(&bytes)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Scan::default()),
        Err(e) => Err(io_error(path, "read", e)),
    }
}

/// Keeps the journal at `path` as `journal.<kind><UTC time>` too (`kind` is "" or "damaged."), for when a new
/// journal is about to replace it ([`Journal::rewrite`]); keeps the last [`KEEP_SET_ASIDE`] of that kind; returns
/// the new name.
pub fn set_aside(path: &Path, kind: &str) -> Result<PathBuf, String> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let stem = format!("{JOURNAL_NAME}.{kind}");
    let time = humantime::format_rfc3339_millis(std::time::SystemTime::now()).to_string();
    let mut to = dir.join(format!("{stem}{time}"));
    let mut n = 1;
    while to.exists() {
        to = dir.join(format!("{stem}{time}.{n}"));
        n += 1;
    }
    // A second name for the file: the journal keeps its own until the daemon's new one is renamed over it, so a
    // daemon that dies before then leaves it where it was.
    std::fs::hard_link(path, &to).map_err(|e| io_error(path, &format!("keep it as {}", to.display()), e))?;
    // The set-aside journals of this kind, oldest first (the names sort by time), the last few kept.
    let mut old: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| io_error(dir, "list", e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
            name.strip_prefix(&stem).is_some_and(|rest| rest.starts_with(|c: char| c.is_ascii_digit()))
        })
        .collect();
    old.retain(|p| p != &to);
    old.sort();
    let excess = old.len().saturating_sub(KEEP_SET_ASIDE - 1);
    for p in &old[..excess] {
        if let Err(e) = std::fs::remove_file(p) {
            tracing::warn!(file = %p.display(), error = %e, "cannot remove an old set-aside journal");
        }
    }
    Ok(to)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn revision(number: u64, stack: &str) -> Record {
        Record::Revision(StoredRevision {
            number,
            time_ms: 1000 + number,
            user: "root".into(),
            change: format!("change {number}"),
            notes: vec![],
            stack: stack.into(),
            app_modules: vec![],
            rule: None,
        })
    }

    fn journal(records: &[Record]) -> Vec<u8> {
        let mut bytes = MAGIC.to_vec();
        for r in records {
            bytes.extend_from_slice(&encode(r));
        }
        bytes
    }

    #[test]
    fn records_read_back_and_a_later_revision_of_a_number_wins() {
        let load = Record::Rules(RulesChange {
            revision: 1,
            op: RulesOp::Load { source: "a.rules".into(), text: "x: 1\n".into() },
        });
        let records = vec![revision(1, "a"), load.clone(), revision(2, "b"), revision(2, "b2")];
        let bytes = journal(&records);
        let s = scan(&bytes);
        assert_eq!(s.damage, None);
        assert_eq!(s.good_bytes, bytes.len() as u64);
        assert_eq!(s.records, records);
        let state = State::from_records(s.records);
        assert_eq!(state.revisions.iter().map(|r| r.stack.as_str()).collect::<Vec<_>>(), ["a", "b2"]);
        assert_eq!(state.rules.len(), 1);
        assert_eq!(State::from_records(state.records().collect()), state);
    }

    #[test]
    fn the_last_peer_table_wins_and_is_written_first() {
        let peer =
            |name: &str| StoredPeer { name: name.into(), addr: "10.0.0.2:7300".into(), fingerprint: "ab".repeat(32) };
        let table = |names: &[&str]| Record::Peers(StoredPeers { peers: names.iter().map(|n| peer(n)).collect() });
        let records = vec![table(&["a"]), revision(1, "s"), table(&["a", "b"]), table(&["b"])];
        let bytes = journal(&records);
        let state = State::from_records(scan(&bytes).records);
        assert_eq!(state.peers, Some(StoredPeers { peers: vec![peer("b")] }));
        let again: Vec<Record> = state.records().collect();
        assert_eq!(again.first(), Some(&table(&["b"])));
        assert_eq!(State::from_records(again), state);
        assert!(!State::from_records(vec![table(&[])]).is_empty(), "an emptied table is still restored");
    }

    #[test]
    fn a_rules_entry_replaces_the_earlier_entry_of_its_rule_and_window() {
        let entry = |number, rule: &str, writes, first_ms| {
            let Record::Revision(mut r) = revision(number, "s") else { unreachable!() };
            r.rule = Some(RuleWrites { rule: rule.into(), writes, first_ms });
            Record::Revision(r)
        };
        let records =
            vec![entry(2, "flip", 1, 10), entry(3, "flop", 1, 10), entry(4, "flip", 2, 10), entry(5, "flip", 1, 2000)];
        let numbers: Vec<u64> = State::from_records(records).revisions.iter().map(|r| r.number).collect();
        assert_eq!(numbers, [3, 4, 5]);
    }

    #[test]
    fn damage_is_found_with_its_offset_and_record_number() {
        let records = [revision(1, "a"), revision(2, "b"), revision(3, "c")];
        let bytes = journal(&records);
        let second = MAGIC.len() + encode(&records[0]).len();
        // A flipped byte in the second record's payload.
        let mut flipped = bytes.clone();
        flipped[second + 20] ^= 0x40;
        let s = scan(&flipped);
        assert_eq!(s.records, records[..1]);
        let d = s.damage.unwrap();
        assert_eq!((d.offset, d.record), (second as u64, 2));
        assert!(d.reason.contains("checksum mismatch"), "{d}");
        assert_eq!(d.ignored, (bytes.len() - second) as u64);
        // A flipped bit in a length is caught by the checksum (or the limit), never read as a shorter record.
        let mut len = bytes.clone();
        len[second] ^= 0x01;
        assert_eq!(scan(&len).damage.unwrap().record, 2);
        // A record cut at the end.
        let cut = &bytes[..bytes.len() - 3];
        let d = scan(cut).damage.unwrap();
        assert_eq!(d.record, 3);
        assert!(d.reason.starts_with("cut:"), "{d}");
        assert_eq!(scan(cut).records.len(), 2);
        // A header cut short, and a file that is no journal.
        let d = scan(&bytes[..bytes.len() - encode(&records[2]).len() + 5]).damage.unwrap();
        assert!(d.reason.contains("8-byte header"), "{d}");
        assert_eq!(scan(b"hello world").damage.unwrap().record, 0);
        assert_eq!(scan(b""), Scan::default());
    }

    #[test]
    fn rewrite_and_append_make_a_journal_that_reads_back_and_set_aside_keeps_the_last_few() {
        let dir = tempfile::tempdir().unwrap();
        let path = Journal::path_in(dir.path());
        let mut j = Journal::rewrite(&path, [revision(1, "a")].into_iter()).unwrap();
        j.append(&revision(2, "b"), true).unwrap();
        assert_eq!(j.size(), std::fs::metadata(&path).unwrap().len());
        let s = read(&path).unwrap();
        assert_eq!((s.records.len(), s.damage), (2, None));
        for i in 0..KEEP_SET_ASIDE as u64 + 2 {
            std::thread::sleep(std::time::Duration::from_millis(2));
            let to = set_aside(&path, "").unwrap();
            assert_eq!(std::fs::read(&to).unwrap(), std::fs::read(&path).unwrap());
            Journal::rewrite(&path, [revision(3 + i, "c")].into_iter()).unwrap();
            assert_ne!(std::fs::read(&to).unwrap(), std::fs::read(&path).unwrap(), "the kept one is not replaced");
        }
        let names: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names.len(), KEEP_SET_ASIDE + 1, "{names:?}");
        assert!(names.iter().all(|n| n == "journal" || n.starts_with("journal.2")), "{names:?}");
    }
}
