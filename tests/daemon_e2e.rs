//! End-to-end: a real daemon process driven by the real CLI over its control socket.
//!
//! Starts the daemon with a stack, drives frames through it, changes links, knobs and modules from the CLI,
//! reads meters back, rolls back a revision, saves the stack and starts a second daemon from the saved file.

mod common;

use common::Daemon;
use flexstack_api::ops::*;
use flexstack_api::{Value, VarKind};
use serde_json::Value as Json;
use std::os::unix::fs::PermissionsExt;

fn stack(tap: &std::path::Path) -> String {
    let tap = format!("\n[modules.tap]\nkind = \"tap\"\npath = \"{}\"\npassthrough = false\n", tap.display());
    common::chain("rate = 200000\ncount = 1000\nsize = 100", ", tap", &tap)
}

fn names(list: &[ModuleInfo]) -> Vec<String> {
    list.iter().map(|m| m.name.clone()).collect()
}

#[test]
fn drive_change_inspect_and_roll_back_a_running_stack() {
    let tmp = tempfile::tempdir().unwrap();
    let tap = tmp.path().join("branch1.pcapng");
    let d = Daemon::start(&stack(&tap), &[]);

    // The control socket is private.
    let mode = std::fs::metadata(d.state_dir().join("control.sock")).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600, "socket mode {mode:o}");

    // Frames flow: the source sends exactly 1000 frames, all down branch 0.
    d.wait_for("source done", 20, |d| d.get("module.src.done") == Json::Bool(true));
    d.wait_for("sink0 to count 1000", 10, |d| d.get_u64("module.sink0.frames_total") == 1000);
    assert_eq!(d.get_u64("module.count.frames_total"), 1000);
    assert_eq!(d.get_u64("module.count.bytes_total"), 100_000);
    assert_eq!(d.get_u64("module.sink1.frames_total"), 0);
    assert_eq!(d.get_u64("module.sel.port.0.frames_out_total"), 1000);

    // Wildcards.
    let all_in = d.answer::<Get>(&["get", "module.*.frames_in_total"]);
    assert_eq!(all_in.len(), 6, "one per module: {all_in:?}");
    assert_eq!(all_in["module.sink0.frames_in_total"].value, Value::U64(1000));

    // A knob change routes the next frames down branch 1 (sink1 and the tap get copies).
    d.ok(&["set", "module.sel.select", "1"]);
    assert_eq!(d.get("module.sel.select"), 1);
    d.ok(&["set", "module.src.count", "1500"]);
    d.wait_for("sink1 to count 500", 10, |d| d.get_u64("module.sink1.frames_total") == 500);
    d.wait_for("tap to write 500", 10, |d| d.get_u64("module.tap.frames_total") == 500);
    assert_eq!(d.get_u64("module.sink0.frames_total"), 1000);

    // Links and modules change at runtime: a second counter on a fan-out copy.
    d.ok(&["module", "load", "c2", "counter"]);
    d.ok(&["link", "add", "count -> c2"]);
    let links = d.answer::<LinkList>(&["link", "list"]);
    assert!(links.links.iter().any(|l| l == "count -> sel, c2"), "{links:?}");
    d.ok(&["set", "module.src.count", "1700"]);
    d.wait_for("c2 to count 200", 10, |d| d.get_u64("module.c2.frames_total") == 200);
    d.wait_for("sink1 to count 700", 10, |d| d.get_u64("module.sink1.frames_total") == 700);

    // Replacing the counter keeps its counts (state handed over) and its links.
    d.ok(&["module", "replace", "count", "counter"]);
    assert_eq!(d.get_u64("module.count.frames_total"), 1700);
    d.ok(&["set", "module.src.count", "1800"]);
    d.wait_for("count to reach 1800", 10, |d| d.get_u64("module.count.frames_total") == 1800);
    assert_eq!(d.get_u64("module.c2.frames_total"), 300);

    // Pausing one module holds frames at its input; resuming delivers every one of them.
    d.ok(&["pause", "sel"]);
    let listed = d.answer::<ModuleList>(&["module", "list"]);
    let sel = listed.iter().find(|m| m.name == "sel").unwrap().clone();
    assert_eq!(sel.state, "paused");
    // Loaded as `switch`, its old kind name, the selector is recorded under its current name.
    assert_eq!(sel.kind, "select");
    d.ok(&["set", "module.src.count", "2000"]);
    d.wait_for("200 frames held at sel", 10, |d| d.get_u64("module.sel.held_frames") == 200);
    assert_eq!(d.get_u64("module.sink1.frames_total"), 800);
    d.ok(&["resume", "sel"]);
    d.wait_for("held frames delivered", 10, |d| d.get_u64("module.sink1.frames_total") == 1000);
    assert_eq!(d.get_u64("module.sel.frames_dropped_total"), 0);

    // Pausing the whole stack stops the source; resuming continues it.
    d.ok(&["pause"]);
    assert!(d.answer::<Status>(&["status"]).paused);
    d.ok(&["set", "module.src.count", "2100"]);
    std::thread::sleep(std::time::Duration::from_millis(300));
    assert_eq!(d.get_u64("module.src.frames_total"), 2000, "nothing is sent while paused");
    d.ok(&["resume"]);
    d.wait_for("source to continue", 10, |d| d.get_u64("module.sink1.frames_total") == 1100);

    // show runtime: calls, frames, frames per call, ns per frame.
    let rt = d.answer::<ShowRuntime>(&["show", "runtime"]);
    let count_row = rt.iter().find(|r| r.module == "count").unwrap();
    assert_eq!(count_row.frames, 2100);
    assert!(count_row.calls > 0);
    assert!(count_row.frames_per_call >= 1.0);
    let text = d.ok(&["show", "runtime"]);
    assert!(text.starts_with("MODULE") && text.contains("NS/FRAME"), "{text}");

    // var list: every meter and knob with type, unit and description.
    let vars = d.answer::<VarList>(&["var", "list", "module.sel.*"]);
    let select = &vars.iter().find(|v| v.spec.name == "module.sel.select").unwrap().spec;
    assert_eq!(select.kind, VarKind::Knob);
    assert!(!select.description.is_empty());

    // watch streams samples.
    let w = d.ok(&["-j", "watch", "-i", "20", "-n", "3", "module.count.frames_total"]);
    let events: Vec<WatchEvent> = w.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(events.len(), 3);
    assert_eq!(events[0].values["module.count.frames_total"], Value::U64(2100));

    // Revisions: the log names each change; rollback to revision 1 removes c2 and restores select = 0.
    let log = d.answer::<ConfigLog>(&["config", "log"]);
    let changes: Vec<&str> = log.iter().map(|r| r.change.as_str()).collect();
    assert!(changes[0].starts_with("daemon --stack"), "{changes:?}");
    assert!(changes.contains(&"set module.sel.select 1"), "{changes:?}");
    assert!(changes.contains(&"link add count -> c2"), "{changes:?}");
    assert!(!log[1].user.is_empty());
    let shown = d.ok(&["config", "show", "1"]);
    assert!(shown.contains("[modules.sel]") && !shown.contains("c2"), "{shown}");

    d.ok(&["config", "rollback", "1"]);
    assert_eq!(names(&d.answer::<ModuleList>(&["module", "list"])), ["src", "count", "sel", "sink0", "sink1", "tap"]);
    assert_eq!(d.get("module.sel.select"), 0);
    // The counter was kept (same kind and settings): its state survives the rollback.
    assert_eq!(d.get_u64("module.count.frames_total"), 2100);
    // The source's count knob went back to 1000; raise it and frames go down branch 0 again.
    assert_eq!(d.get("module.src.count"), 1000);
    d.ok(&["set", "module.src.count", "2200"]);
    d.wait_for("sink0 after rollback", 10, |d| d.get_u64("module.sink0.frames_total") == 1100);
    let log = d.answer::<ConfigLog>(&["config", "log"]);
    assert_eq!(log.iter().filter(|r| r.change == "config rollback 1").count(), 1);

    // config save writes a description that starts the same stack.
    let saved = tmp.path().join("saved.toml");
    d.ok(&["config", "save", saved.to_str().unwrap()]);
    let text = std::fs::read_to_string(&saved).unwrap();
    let tap2 = tmp.path().join("second.pcapng");
    let text2 = text.replace(tap.to_str().unwrap(), tap2.to_str().unwrap());
    let d2 = Daemon::start(&text2, &[]);
    assert_eq!(
        names(&d2.answer::<ModuleList>(&["module", "list"])),
        names(&d.answer::<ModuleList>(&["module", "list"]))
    );
    assert_eq!(d2.answer::<LinkList>(&["link", "list"]).links, d.answer::<LinkList>(&["link", "list"]).links);
    assert_eq!(d2.get("module.src.count"), 2200);

    // The tap's file is a pcapng that holds the 500 + 200 + 100 + 100 frames of branch 1 (read back in Rust).
    drop(d2);
    let mut d = d;
    assert!(d.terminate().success(), "daemon exits 0 on SIGTERM");
    assert!(!d.state_dir().join("control.sock").exists(), "socket removed on exit");
    let file = std::fs::File::open(&tap).unwrap();
    let mut reader = pcap_file::pcapng::PcapNgReader::new(file).unwrap();
    let mut packets = 0;
    while let Some(block) = reader.next_block() {
        if let pcap_file::pcapng::Block::EnhancedPacket(p) = block.unwrap() {
            assert_eq!(p.data.len(), 100);
            packets += 1;
        }
    }
    assert_eq!(packets, 1100);
}

#[test]
fn daemons_side_by_side_and_stale_sockets() {
    let mut a = Daemon::start("[modules.c]\nkind = \"counter\"\n", &[]);
    let b = Daemon::start("[modules.k]\nkind = \"sink\"\n", &[]);
    assert_eq!(names(&a.answer::<ModuleList>(&["module", "list"])), ["c"]);
    assert_eq!(names(&b.answer::<ModuleList>(&["module", "list"])), ["k"]);

    // A second daemon on the same state directory is refused while the first runs.
    let out =
        std::process::Command::new(common::bin()).args(["daemon", "--state-dir"]).arg(a.state_dir()).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("already running"));

    // After a crash (SIGKILL) the stale socket is detected and replaced.
    let state = a.state_dir();
    a.child.kill().unwrap();
    a.child.wait().unwrap();
    assert!(state.join("control.sock").exists(), "SIGKILL leaves the socket behind");
    let mut c = std::process::Command::new(common::bin())
        .args(["daemon", "--state-dir"])
        .arg(&state)
        .env("FLEXSTACK_LOG", "warn")
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let mut up = false;
    while std::time::Instant::now() < deadline && !up {
        up = std::process::Command::new(common::bin())
            .args(["status", "--state-dir"])
            .arg(&state)
            .output()
            .unwrap()
            .status
            .success();
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let _ = c.kill();
    let _ = c.wait();
    assert!(up, "daemon restarted over a stale socket");

    // With no daemon the CLI says so and exits 3.
    let out = std::process::Command::new(common::bin())
        .args(["status", "--state-dir", "/nonexistent/flexstack"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(3));
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot reach the flexstack daemon"));
}

#[test]
fn control_frames_run_procedures_and_a_tap_on_ctl_observes_them() {
    let tmp = tempfile::tempdir().unwrap();
    let tap = tmp.path().join("ctl.pcapng");
    let stack = format!(
        r#"links = ["sel[0] -> a", "sel[1] -> b", "sel[ctl] -> watch"]
[modules.sel]
kind = "switch"
[modules.a]
kind = "sink"
[modules.b]
kind = "sink"
[modules.watch]
kind = "tap"
path = "{}"
passthrough = false
"#,
        tap.display()
    );
    let mut d = Daemon::start(&stack, &[]);
    let r = d.answer::<ModuleExec>(&["module", "exec", "sel", "select", "1"]);
    assert_eq!(r.result, Value::U64(0), "the procedure returns the previous selection: {r:?}");
    assert_eq!(d.get("module.sel.select"), 1);
    let e = d.fails(&["module", "exec", "ghost", "select", "1"]);
    assert!(e.contains("no module named ghost"), "{e}");
    let e = d.fails(&["module", "exec", "sel", "teleport"]);
    assert!(e.contains("teleport"), "{e}");
    d.wait_for("the tap to see control frames", 10, |d| d.get_u64("module.watch.frames_total") >= 2);
    assert!(d.terminate().success());

    // The tap wrote sel's replies as USER0 packets on its second interface.
    let mut reader = pcap_file::pcapng::PcapNgReader::new(std::fs::File::open(&tap).unwrap()).unwrap();
    let mut control_texts = Vec::new();
    while let Some(block) = reader.next_block() {
        if let pcap_file::pcapng::Block::EnhancedPacket(p) = block.unwrap() {
            if p.interface_id == 1 {
                control_texts.push(String::from_utf8_lossy(&p.data).to_string());
            }
        }
    }
    assert!(
        control_texts.iter().any(|t| t.contains("exec_reply") && t.contains("\"sender\":\"sel\"")),
        "{control_texts:?}"
    );
    assert!(control_texts.iter().any(|t| t.contains("\"op\":\"error\"")), "{control_texts:?}");
}
