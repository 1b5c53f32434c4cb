//! Issue 18, item 3: nothing survives a restart. The daemon keeps every stack revision and rules change in
//! `STATE_DIR/journal` (crates/daemon/src/journal.rs, docs/persistence.md); `flexstack daemon --restore` comes
//! back to the last state after a SIGKILL, a damaged journal is reported with the byte offset and record number
//! of the damage and restored up to it, and compaction keeps the state.
//!
//! On main these fail: `--restore` is not an option there, so the restarted daemon never answers (run them with
//! `FLEXSTACK_TEST_BIN=/work/main/target/ci/flexstack`).

mod common;

use common::{chain, Daemon};
use flexstack_api::ops::{ConfigLog, ModuleList, PeerList, RevisionInfo, RulesList, RulesLog};
use flexstack_daemon::journal::{self, Record, MAGIC};
use std::path::PathBuf;

/// The revisions of `config log` as (number, user, change).
fn revisions(d: &Daemon) -> Vec<(u64, String, String)> {
    let log: Vec<RevisionInfo> = d.answer::<ConfigLog>(&["config", "log"]);
    log.into_iter().map(|r| (r.revision, r.user, r.change)).collect()
}

/// The rules revisions of `rules log` as (number, what).
fn rules_revisions(d: &Daemon) -> Vec<(u64, String)> {
    d.answer::<RulesLog>(&["rules", "log"]).revisions.into_iter().map(|r| (r.number, r.what)).collect()
}

fn journal_path(d: &Daemon) -> PathBuf {
    journal::Journal::path_in(&d.state_dir())
}

/// The journal's records and the byte offset of each.
fn records(d: &Daemon) -> (Vec<u8>, Vec<(usize, Record)>) {
    let bytes = std::fs::read(journal_path(d)).expect("the journal exists");
    let scan = journal::scan(&bytes);
    assert_eq!(scan.damage, None, "the journal written by the daemon is whole");
    let mut at = MAGIC.len();
    let mut out = Vec::new();
    for r in scan.records {
        let len = journal::encode(&r).len();
        out.push((at, r));
        at += len;
    }
    assert_eq!(at, bytes.len());
    (bytes, out)
}

/// The files of the state directory whose names start with `prefix`.
fn files_named(d: &Daemon, prefix: &str) -> Vec<String> {
    let names =
        std::fs::read_dir(d.state_dir()).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned());
    names.filter(|n| n.starts_with(prefix)).collect()
}

fn rules_file(d: &Daemon, name: &str, text: &str) -> String {
    let path = d.path(name);
    std::fs::write(&path, text).unwrap();
    path.display().to_string()
}

/// A knob changed, a module loaded and linked, rules files loaded, a rule unloaded and one deleted; SIGKILL; `--restore`:
/// the revision history and its numbering, the module (with its link: it counts frames), the knob's value and the
/// rules with their revisions are back.
#[test]
fn a_killed_daemon_comes_back_with_its_revisions_module_knob_and_rules() {
    let mut d = Daemon::start(&chain("rate = 1000", "", ""), &[]);
    d.ok(&["set", "module.src.rate", "321"]);
    d.ok(&["module", "load", "extra", "counter"]);
    d.ok(&["link", "add", "count -> extra"]);
    let hot = rules_file(&d, "hot.rules", "hot: Threshold(get(\"module.count.frames_in_total\"), 5, 1)\n");
    let cold = rules_file(&d, "cold.rules", "cold: Not(hot)\n");
    d.ok(&["rules", "load", &hot]);
    d.ok(&["rules", "load", &cold]);
    d.ok(&["rules", "unload", "cold"]);
    let warm = rules_file(&d, "warm.rules", "warm: Not(hot)\n");
    d.ok(&["rules", "load", &warm]);
    d.ok(&["rules", "delete", "warm"]);
    let before = revisions(&d);
    assert_eq!(before.len(), 4, "{before:?}");
    let rules_before = rules_revisions(&d);
    assert_eq!(rules_before.len(), 5, "{rules_before:?}");

    d.kill_and_restart(&["--restore"], "restored.log");
    assert_eq!(revisions(&d), before, "config log after --restore");
    assert_eq!(rules_revisions(&d), rules_before, "rules log after --restore");
    assert_eq!(d.get("module.src.rate"), 321.0);
    let modules = d.answer::<ModuleList>(&["module", "list"]);
    assert!(modules.iter().any(|m| m.name == "extra" && m.kind == "counter"), "{modules:?}");
    let start = d.get_u64("module.extra.frames_in_total");
    d.wait_for("the restored module to count frames through its restored link", 10, |d| {
        d.get_u64("module.extra.frames_in_total") > start
    });
    let rules = d.answer::<RulesList>(&["rules", "list"]);
    let loaded = |name: &str| rules.iter().find(|r| r.name == name).map(|r| r.explicit);
    assert_eq!((loaded("hot"), loaded("cold"), loaded("warm")), (Some(true), Some(false), None), "{rules:?}");
    // The numbering goes on, and the new revision is in the journal too.
    d.ok(&["set", "module.src.rate", "500"]);
    assert_eq!(revisions(&d).last().unwrap().0, 5);
    d.ok(&["rules", "load", &cold]);
    assert_eq!(rules_revisions(&d).last().unwrap().0, 6);
    d.kill_and_restart(&["--restore"], "restored2.log");
    assert_eq!(d.get("module.src.rate"), 500.0);
    assert_eq!(rules_revisions(&d).len(), 6);
    let journal_mode =
        std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(journal_path(&d)).unwrap().permissions());
    assert_eq!(journal_mode & 0o777, 0o600, "the journal holds the rules texts: only its owner reads it");
}

/// The peer table is in the journal: `--restore` brings the peers back as they were (one added, one removed), and
/// before the stack, whose carrier names one of them (a carrier looks its peer up when it is loaded). A carrier that
/// connects does so only for a flow, so nothing is sent to the made-up address.
#[test]
fn peers_come_back_before_the_stack_whose_carrier_names_them() {
    let mut d = Daemon::start(&chain("rate = 1000", "", ""), &[]);
    let fp = "ab".repeat(32);
    d.ok(&["peer", "add", "gw", "127.0.0.1:7300", &fp]);
    d.ok(&["peer", "add", "old", "127.0.0.1:7301", &"cd".repeat(32)]);
    d.ok(&["peer", "del", "old"]);
    d.ok(&["module", "load", "car", "carrier", "peer=\"gw\""]);
    let table = |d: &Daemon| {
        let peers = d.answer::<PeerList>(&["peer", "list"]);
        peers.into_iter().map(|p| (p.name, p.addr, p.fingerprint)).collect::<Vec<_>>()
    };
    let before = table(&d);
    assert_eq!(before, [("gw".to_string(), "127.0.0.1:7300".to_string(), fp)]);
    d.kill_and_restart(&["--restore"], "peers.log");
    assert_eq!(table(&d), before, "peer list after --restore");
    let modules = d.answer::<ModuleList>(&["module", "list"]);
    assert!(modules.iter().any(|m| m.name == "car" && m.kind == "carrier"), "{modules:?}");
    // A fresh start forgets them, like the stack.
    d.kill_and_restart(&[], "fresh-peers.log");
    assert!(table(&d).is_empty());
}

/// Without --restore the daemon starts fresh, and the old journal is kept under a name with the time.
#[test]
fn without_restore_the_daemon_starts_fresh_and_keeps_the_old_journal() {
    let mut d = Daemon::start(&chain("rate = 1000", "", ""), &[]);
    d.ok(&["set", "module.src.rate", "222"]);
    let old = std::fs::read(journal_path(&d)).unwrap();
    d.kill_and_restart(&[], "fresh.log");
    assert_eq!(revisions(&d).len(), 1, "a fresh start has only the --stack revision");
    assert_eq!(d.get("module.src.rate"), 1000.0);
    let kept = files_named(&d, "journal.2");
    assert_eq!(kept.len(), 1, "{kept:?}");
    assert_eq!(std::fs::read(d.state_dir().join(&kept[0])).unwrap(), old, "the old journal is kept as it was");
}

/// A flipped byte in the middle of the journal, then a record cut at its end: each time the daemon says where the
/// damage is (file, byte offset, record number) and starts from the last good revision before it.
#[test]
fn a_damaged_journal_is_reported_where_it_is_damaged_and_restored_up_to_there() {
    let mut d = Daemon::start(&chain("rate = 1000", "", ""), &[]);
    for rate in [10, 20, 30, 40] {
        d.ok(&["set", "module.src.rate", &rate.to_string()]);
    }
    // Revisions 1..=5; flip a byte in the middle of revision 4's record (rate 30).
    let (mut bytes, recs) = records(&d);
    let (i, (at, _)) = recs
        .iter()
        .enumerate()
        .find(|(_, (_, r))| matches!(r, Record::Revision(r) if r.number == 4))
        .expect("revision 4 is in the journal");
    let middle = at + journal::encode(&recs[i].1).len() / 2;
    bytes[middle] ^= 0x20;
    std::fs::write(journal_path(&d), &bytes).unwrap();
    d.kill_and_restart(&["--restore"], "flipped.log");
    let log = std::fs::read_to_string(d.path("flipped.log")).unwrap();
    let path = journal_path(&d).display().to_string();
    let place = format!("record {} at byte {at}", i + 1);
    assert!(log.contains(&path) && log.contains(&place) && log.contains("checksum mismatch"), "{place}: {log}");
    assert_eq!(d.get("module.src.rate"), 20.0, "revision 3, the last good one");
    let revs = revisions(&d);
    assert_eq!(revs.iter().map(|r| r.0).collect::<Vec<_>>(), [1, 2, 3, 4], "{revs:?}");
    assert!(revs[3].2.contains("damaged") && revs[3].2.contains(&place), "config log says what happened: {revs:?}");
    assert_eq!(files_named(&d, "journal.damaged.").len(), 1, "the damaged journal is kept");

    // Now a record cut at the end: the last change (rate 50) is lost, the one before stays.
    d.ok(&["set", "module.src.rate", "50"]);
    let (bytes, recs) = records(&d);
    let (last_at, _) = recs.last().unwrap();
    std::fs::write(journal_path(&d), &bytes[..bytes.len() - 7]).unwrap();
    d.kill_and_restart(&["--restore"], "cut.log");
    let log = std::fs::read_to_string(d.path("cut.log")).unwrap();
    let place = format!("record {} at byte {last_at}", recs.len());
    assert!(log.contains(&place) && log.contains("cut"), "{place}: {log}");
    assert_eq!(d.get("module.src.rate"), 20.0);
    assert_eq!(revisions(&d).last().unwrap().0, 5, "the numbering goes on after the last good revision");
}

/// With a small limit the journal is compacted again and again; it stays bounded and a restore still brings back
/// the latest state, the rules, and the numbering.
#[test]
fn compaction_keeps_the_state_and_bounds_the_journal() {
    let limit = 8192u64;
    let mut d = Daemon::start(&chain("rate = 1000", "", ""), &["--journal-max-bytes", &limit.to_string()]);
    let hot = rules_file(&d, "hot.rules", "hot: Threshold(get(\"module.count.frames_in_total\"), 5, 1)\n");
    d.ok(&["rules", "load", &hot]);
    let mut largest = 0;
    for rate in 1..=60 {
        d.ok(&["set", "module.src.rate", &(rate * 10).to_string()]);
        largest = largest.max(std::fs::metadata(journal_path(&d)).unwrap().len());
    }
    let (_, recs) = records(&d);
    let record_max = recs.iter().map(|(_, r)| journal::encode(r).len() as u64).max().unwrap();
    assert!(largest <= limit + record_max, "the journal grew to {largest} bytes with a limit of {limit}");
    let first = recs.iter().find_map(|(_, r)| match r {
        Record::Revision(r) => Some(r.number),
        Record::Rules(_) | Record::Peers(_) => None,
    });
    assert!(first.is_some_and(|n| n > 1), "compaction dropped the oldest revisions: first kept {first:?}");
    assert!(matches!(recs[0].1, Record::Rules(_)), "the rules change is kept");
    let before = revisions(&d);

    d.kill_and_restart(&["--restore", "--journal-max-bytes", &limit.to_string()], "compacted.log");
    assert_eq!(d.get("module.src.rate"), 600.0);
    let after = revisions(&d);
    assert_eq!(after.last(), before.last(), "the latest revision is back");
    assert_eq!(after.first().map(|r| r.0), first, "the history starts at the oldest revision kept");
    assert!(after.iter().all(|r| before.contains(r)), "the kept revisions are the daemon's: {after:?}");
    assert_eq!(rules_revisions(&d).len(), 1);
    d.ok(&["set", "module.src.rate", "7"]);
    assert_eq!(revisions(&d).last().unwrap().0, 62);
}

/// A sandboxed app's modules are in the journal's stack, but its namespace and program go with the daemon: a restore
/// leaves them out (with their links) and says so in `config log`, and keeps the rest.
#[test]
fn a_restore_leaves_out_the_modules_of_sandboxed_apps() {
    if !common::privileged() {
        return;
    }
    let (octet, _) = common::octets();
    let subnet = format!("10.{}.0.0", octet.wrapping_add(60));
    let mut d = Daemon::start(&chain("rate = 1000", "", ""), &["--app-subnet", &subnet]);
    let app = common::unique("p");
    let mut client = std::process::Command::new(common::bin())
        .arg("--state-dir")
        .arg(d.state_dir())
        .args(["run", "--name", &app, "--", "sleep", "30"])
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("flexstack run");
    struct Reap<'a>(&'a mut std::process::Child);
    impl Drop for Reap<'_> {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let client = Reap(&mut client);
    d.wait_for("the app to attach", 15, |d| d.answer::<ModuleList>(&["module", "list"]).iter().any(|m| m.name == app));

    let app_modules: Vec<String> = d
        .answer::<ModuleList>(&["module", "list"])
        .into_iter()
        .map(|m| m.name)
        .filter(|n| n.starts_with(&app))
        .collect();
    assert!(app_modules.len() >= 2, "{app_modules:?}");
    d.ok(&["set", "module.src.rate", "432"]);
    let before = revisions(&d);

    // The client is stopped first: seeing its daemon gone, it would attach again, starting a daemon of its own in the
    // state directory when none answers yet (`run` does), and race the restored one for the control socket.
    let stopped = std::process::Command::new("kill").args(["-STOP", &client.0.id().to_string()]).status();
    assert!(stopped.is_ok_and(|s| s.success()), "SIGSTOP the client");
    d.kill_and_restart(&["--restore", "--app-subnet", &subnet], "apps.log");
    drop(client);
    let names: Vec<String> = d.answer::<ModuleList>(&["module", "list"]).into_iter().map(|m| m.name).collect();
    assert!(names.iter().all(|n| !n.starts_with(&app)), "no app module is restored: {names:?}");
    let log = || std::fs::read_to_string(d.path("apps.log")).unwrap_or_default();
    let all = ["src", "count", "sel", "sink0", "sink1"].iter().all(|m| names.iter().any(|n| n == m));
    assert!(all, "{names:?}\nrevisions: {:?}\nlog: {}", revisions(&d), log());
    assert_eq!(d.get("module.src.rate"), 432.0);
    let after = revisions(&d);
    assert_eq!(after[..before.len()], before[..], "the history is kept");
    // The restore says what it left out (the dropped client's own detach may be logged after it).
    let new = &after[before.len()..];
    let note = new.iter().map(|r| &r.2).find(|c| c.contains("modules of sandboxed apps not restored"));
    assert!(note.is_some_and(|c| c.contains(&app_modules[0])), "{new:?}\nbefore: {before:?}\nlog: {}", log());
}

/// A full disk: a change whose record cannot be written stays made but is not acknowledged as saved (the client
/// gets an error saying so), nothing half-written is left in the journal, and once there is room again the next
/// change rewrites the journal from memory, so a restore brings back both.
#[test]
fn a_change_that_cannot_be_journaled_is_reported_and_saved_once_there_is_room() {
    if !common::privileged() {
        return;
    }
    let mut d = Daemon::start(&chain("rate = 1000", "", ""), &[]);
    d.kill();
    // The state directory on a small tmpfs of its own, unmounted (lazily: the daemon may still hold it) on drop.
    struct Tmpfs(PathBuf);
    impl Drop for Tmpfs {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount").arg("-l").arg(&self.0).status();
        }
    }
    common::sh("mount", &["-t", "tmpfs", "-o", "size=256k,mode=0711", "fs-persist", common::path_str(&d.state_dir())]);
    let _mount = Tmpfs(d.state_dir());
    d.restart(&[], "full.log");
    let fill = d.state_dir().join("fill");
    {
        use std::io::Write;
        let mut f = std::fs::File::create(&fill).unwrap();
        while f.write_all(&[0u8; 4096]).is_ok() {}
    }
    // Records go into the journal's last page as long as they fit: change until one does not.
    let mut refused = None;
    for rate in 1..=20u64 {
        let out = d.cli(&["set", "module.src.rate", &rate.to_string()]);
        if !out.status.success() {
            refused = Some((rate, String::from_utf8_lossy(&out.stderr).into_owned()));
            break;
        }
    }
    let (rate, message) = refused.expect("a change on a full disk is reported");
    assert!(message.contains("could not be written to the journal"), "{message}");
    assert_eq!(d.get("module.src.rate"), rate as f64, "the change itself is made");
    let scan = journal::scan(&std::fs::read(journal_path(&d)).unwrap());
    assert_eq!(scan.damage, None, "no half record is left behind");

    std::fs::remove_file(&fill).unwrap();
    d.ok(&["set", "module.src.rate", "999"]);
    let before = revisions(&d);
    assert!(before.iter().any(|r| r.2 == format!("set module.src.rate {rate}")), "{before:?}");
    d.kill_and_restart(&["--restore"], "after-full.log");
    assert_eq!(revisions(&d), before, "the refused change's revision was written with the next change");
    assert_eq!(d.get("module.src.rate"), 999.0);
}

/// The knob writes of rules are coalesced entries of the log (one per rule and window): they come back as entries
/// of the same rule and window, and the knob keeps the value the rule wrote.
#[test]
fn entries_of_rules_knob_writes_come_back_as_such() {
    let mut d = Daemon::start(&chain("rate = 1000", "", ""), &[]);
    let route = rules_file(
        &d,
        "route.rules",
        "busy: Threshold(get(\"module.count.frames_in_total\"), 5, 1)\nroute: set(\"module.sel.select\", If(busy, 1, 0))\n",
    );
    d.ok(&["rules", "load", &route]);
    d.wait_for("the rule to route", 10, |d| d.get_u64("module.sel.select") == 1);
    let log: Vec<RevisionInfo> = d.answer::<ConfigLog>(&["config", "log"]);
    let entries: Vec<&RevisionInfo> = log.iter().filter(|r| r.rule.is_some()).collect();
    assert!(!entries.is_empty() && entries.iter().all(|r| r.user == "rules"), "{log:?}");

    d.kill_and_restart(&["--restore"], "rules-writes.log");
    let after: Vec<RevisionInfo> = d.answer::<ConfigLog>(&["config", "log"]);
    assert_eq!(after[0], log[0]);
    // The rules run again after the restore, and their first writes, within a second of the restored entry's
    // first one, are merged into it (a later number, more writes); later ones make entries of their own.
    let (was, now) = (entries.last().unwrap(), after.iter().find(|r| r.rule.is_some()).expect("the entry is back"));
    let (w, n) = (was.rule.as_ref().unwrap(), now.rule.as_ref().unwrap());
    assert_eq!((&n.rule, n.first_ms), (&w.rule, w.first_ms), "{after:?}");
    assert!(n.writes >= w.writes && now.revision >= was.revision, "{was:?} -> {now:?}");
    assert_eq!(d.get_u64("module.sel.select"), 1);
}
