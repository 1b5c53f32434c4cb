//! End-to-end: the app socket (STATE_DIR/apps.sock) against a hostile local user. Unprivileged clients run as
//! `nobody` (and another uid) through `setpriv`: one user holding many connections cannot block another app's
//! registration (a cap per uid), a name stays bound to the uid that registered it first, connections that do not
//! register or go silent are closed (the libraries answer the daemon's pings, so a quiet app stays), and
//! `--app-socket-group` restricts the socket to a group (mode 0660).

mod common;

use common::Daemon;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::net::UnixStream;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const STACK: &str = "[modules.sink]\nkind = \"sink\"\n";
const NOBODY: u32 = 65534;
/// Another unprivileged uid (no passwd entry needed).
const OTHER: u32 = 65533;

/// A daemon whose state directory other users can reach by name (the temporary folder is 0700).
fn daemon(extra: &[&str]) -> Option<Daemon> {
    if !common::privileged() {
        return None;
    }
    let d = Daemon::start(STACK, extra);
    std::fs::set_permissions(d.dir.path(), std::fs::Permissions::from_mode(0o711)).unwrap();
    Some(d)
}

/// Runs a Python program (the system python3: root's pyenv is not readable by others) as `uid` (its group too, no supplementary groups unless `groups`), with the socket path
/// as its argument; `setpriv` drops root for it.
fn python_as(uid: u32, groups: &str, sock: &std::path::Path, program: &str) -> Command {
    let mut cmd = Command::new("setpriv");
    cmd.arg(format!("--reuid={uid}")).arg(format!("--regid={uid}"));
    if groups.is_empty() {
        cmd.arg("--clear-groups");
    } else {
        cmd.arg(format!("--groups={groups}"));
    }
    cmd.args(["/usr/bin/python3", "-c", program]).arg(sock).env("PYTHONPATH", clients_python());
    cmd
}

fn clients_python() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("clients/python")
}

/// Registers `app` (one meter `x`) as `uid` and prints the daemon's answer; stays `hold` seconds.
fn register_as(uid: u32, sock: &std::path::Path, app: &str, hold: f64) -> Output {
    let program = format!(
        r#"import socket, sys, time
s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])
s.sendall(b'{{"id":1,"op":"register","app":"{app}","vars":[{{"name":"x","kind":"meter","type":"u64"}}]}}\n')
print(s.makefile().readline().strip(), flush=True)
time.sleep({hold})"#
    );
    python_as(uid, "", sock, &program).output().expect("run setpriv python3")
}

/// One request line on a raw connection and its answer.
fn ask(s: &mut UnixStream, line: &str) -> serde_json::Value {
    s.write_all(format!("{line}\n").as_bytes()).unwrap();
    let mut r = BufReader::new(s.try_clone().unwrap());
    let mut out = String::new();
    r.read_line(&mut out).unwrap();
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("{out:?}: {e}"))
}

const REGISTER_X: &str = r#"{"op":"register","app":"real","vars":[{"name":"x","kind":"meter","type":"u64"}]}"#;

#[test]
fn a_user_holding_many_connections_cannot_block_an_apps_registration() {
    let Some(d) = daemon(&[]) else { return };
    let sock = d.state_dir().join("apps.sock");
    // nobody opens 40 connections and keeps them; it reports how many were not refused at once.
    let hog = r#"import socket, sys, time
held = []
for i in range(40):
    s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); s.settimeout(0.3)
    try:
        line = s.recv(4096)
        if b'"busy"' in line: continue
    except socket.timeout:
        pass
    held.append(s)
print("held", len(held), flush=True)
time.sleep(30)"#;
    let mut child = python_as(NOBODY, "", &sock, hog).stdout(Stdio::piped()).spawn().expect("run the hog");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let held: usize = line.trim().strip_prefix("held ").and_then(|n| n.parse().ok()).unwrap_or(0);
    // The real app registers while nobody still holds its connections (well within the 5 s deadline).
    let mut s = UnixStream::connect(&sock).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let reg = ask(&mut s, REGISTER_X);
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(reg["ok"], true, "the real app's registration failed while nobody held {held} connections: {reg}");
    assert!(held <= 8, "one uid held {held} connections (at most 8 by default)");
    assert!(held >= 1, "nobody could not connect at all: {line:?}");
    assert_eq!(d.get_u64("app.real.x"), 0);
}

#[test]
fn an_app_name_stays_bound_to_the_uid_that_registered_it() {
    let Some(d) = daemon(&[]) else { return };
    let sock = d.state_dir().join("apps.sock");
    // OTHER registers "voip" and leaves; the name is still OTHER's: nobody cannot take it, OTHER can again.
    let first = register_as(OTHER, &sock, "voip", 0.0);
    assert!(String::from_utf8_lossy(&first.stdout).contains(r#""ok":true"#), "{}", common::text(&first));
    d.wait_for("the first registration to go", 5, |d| !d.cli(&["get", "app.voip.x"]).status.success());
    let thief = register_as(NOBODY, &sock, "voip", 0.0);
    let out = String::from_utf8_lossy(&thief.stdout);
    assert!(out.contains(r#""ok":false"#) && out.contains("bound to uid 65533"), "{}", common::text(&thief));
    let again = register_as(OTHER, &sock, "voip", 0.0);
    assert!(String::from_utf8_lossy(&again.stdout).contains(r#""ok":true"#), "{}", common::text(&again));
    // nobody's own names work.
    let own = register_as(NOBODY, &sock, "mine", 0.0);
    assert!(String::from_utf8_lossy(&own.stdout).contains(r#""ok":true"#), "{}", common::text(&own));
}

#[test]
fn silent_connections_are_closed_and_pinged_apps_stay() {
    let Some(d) = daemon(&["--app-register-timeout", "0.5", "--app-idle-timeout", "1"]) else { return };
    let sock = d.state_dir().join("apps.sock");
    // A connection that never registers: closed with a timeout error after 0.5 s.
    let started = Instant::now();
    let quiet = UnixStream::connect(&sock).unwrap();
    quiet.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut r = BufReader::new(quiet.try_clone().unwrap());
    let mut line = String::new();
    r.read_line(&mut line).unwrap();
    assert!(line.contains(r#""code":"timeout""#), "{line}");
    assert!(started.elapsed() >= Duration::from_millis(450), "{:?}", started.elapsed());
    line.clear();
    assert_eq!(r.read_line(&mut line).unwrap(), 0, "still open: {line}");

    // A registered connection that answers nothing: pinged after 0.5 s, closed after 1 s, its variables gone.
    let mut deaf = UnixStream::connect(&sock).unwrap();
    deaf.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    assert_eq!(ask(&mut deaf, REGISTER_X)["ok"], true);
    let mut r = BufReader::new(deaf.try_clone().unwrap());
    let mut lines = Vec::new();
    loop {
        let mut l = String::new();
        if r.read_line(&mut l).unwrap() == 0 {
            break;
        }
        lines.push(l);
    }
    assert!(lines[0].contains(r#""op":"ping""#), "{lines:?}");
    assert!(lines.last().unwrap().contains("timeout"), "{lines:?}");
    assert!(!d.cli(&["get", "app.real.x"]).status.success());

    // The Python library answers pings: an app that only polls stays registered for 3 idle timeouts.
    let app = r#"import sys, time, flexstack_app
a = flexstack_app.App(sys.argv[1]); a.knob("k", "u64"); a.register("poller")
print("registered", flush=True)
end = time.time() + 3.5
while time.time() < end: a.poll(0.2)
print("alive", flush=True)"#;
    let out = python_as(NOBODY, "", &sock, app).output().unwrap();
    assert!(String::from_utf8_lossy(&out.stdout).contains("alive"), "{}", common::text(&out));

    // So does the C library.
    let c = r#"#include "flexstack_app.h"
#include <stdio.h>
#include <time.h>
int main(int argc, char **argv) {
    fs_app *a = fs_app_open(argv[1]);
    if (!a || fs_app_knob(a, "k", FS_U64, NULL, NULL, NULL) || fs_app_register(a, "cpoller")) return 1;
    time_t end = time(NULL) + 4;
    while (time(NULL) < end)
        if (fs_app_poll(a, 200) < 0) { fprintf(stderr, "%s\n", fs_app_error(a)); return 1; }
    puts("alive");
    return 0;
}
"#;
    let src = d.path("poller.c");
    std::fs::write(&src, c).unwrap();
    let lib = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("clients/c");
    let exe = d.path("poller");
    let cc = Command::new("cc")
        .args(["-std=c99", "-Wall", "-Werror", "-I"])
        .arg(&lib)
        .arg("-o")
        .arg(&exe)
        .arg(&src)
        .arg(lib.join("flexstack_app.c"))
        .output()
        .unwrap();
    assert!(cc.status.success(), "{}", common::text(&cc));
    let out = Command::new(&exe).arg(&sock).output().unwrap();
    assert!(String::from_utf8_lossy(&out.stdout).contains("alive"), "{}", common::text(&out));
}

#[test]
fn the_group_option_restricts_the_socket_to_that_group() {
    let Some(d) = daemon(&["--app-socket-group", "daemon"]) else { return };
    let sock = d.state_dir().join("apps.sock");
    let meta = std::fs::metadata(&sock).unwrap();
    assert_eq!(meta.permissions().mode() & 0o777, 0o660);
    assert_eq!(meta.gid(), 1, "the group daemon is gid 1");
    let try_connect = r#"import socket, sys
s = socket.socket(socket.AF_UNIX)
try:
    s.connect(sys.argv[1]); print("connected")
except PermissionError:
    print("refused")"#;
    let outside = python_as(NOBODY, "", &sock, try_connect).output().unwrap();
    assert_eq!(String::from_utf8_lossy(&outside.stdout).trim(), "refused", "{}", common::text(&outside));
    let member = python_as(NOBODY, "1", &sock, try_connect).output().unwrap();
    assert_eq!(String::from_utf8_lossy(&member.stdout).trim(), "connected", "{}", common::text(&member));
    // An unknown group is an error at start.
    let out = Command::new(common::bin())
        .args(["daemon", "--app-socket-group", "fs-no-such-group", "--state-dir"])
        .arg(d.path("other-state"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("fs-no-such-group: no such group"), "{}", common::text(&out));
}
