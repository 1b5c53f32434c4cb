//! End-to-end: `flexstack run` puts unmodified programs (ping, curl, sh, sleep) in sandboxes behind flexstack and
//! reaches a server in another namespace through the host face. Checks addresses, exit codes, the user the program
//! runs as, several sandboxes on one daemon, Ctrl-C, a daemon crash, and that nothing is left behind.
//! Needs root (skips with a reason outside CI).

mod common;

use common::{bin, privileged, sh, SandboxDaemon as Daemon, Server};
use std::process::Command;
use std::time::{Duration, Instant};

use common::octets;

use common::text;

#[test]
fn unmodified_programs_reach_a_server_through_the_host_face() {
    if !privileged() {
        return;
    }
    let (app_octet, srv_octet) = octets();
    let blob: Vec<u8> = (0..2_000_000u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
    let srv = Server::new(srv_octet, &blob);
    let d = Daemon::start(app_octet);
    let want = sh(
        "sh",
        &[
            "-c",
            &format!(
                "python3 -c 'import hashlib,sys; print(hashlib.sha256(open(\"{}\",\"rb\").read()).hexdigest())'",
                srv.www.path().join("blob").display()
            ),
        ],
    );

    // ping (v4 and v6) and curl (v4 and v6) in one sandbox; the file arrives intact both ways.
    let script = format!(
        "ping -c 2 -W 2 {v4} && ping -6 -c 2 -W 2 {v6} && curl -sf -m 60 http://{v4}:8080/blob | sha256sum && \
         curl -sf -m 60 'http://[{v6}]:8080/blob' | sha256sum && ip -br addr show",
        v4 = srv.v4,
        v6 = srv.v6
    );
    let out = d.run(&["--", "sh", "-c", &script]);
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    assert_eq!(t.matches(want.trim()).count(), 2, "both downloads are intact: {t}");
    assert!(t.contains(&format!("10.{app_octet}.1.2/24")), "the sandbox has its virtual IPv4 address: {t}");
    assert!(t.contains(&format!("fd77:{app_octet:x}:1::2/64")), "and its IPv6 address: {t}");

    // The exit code is passed through; the program runs as the invoking user.
    assert_eq!(d.run(&["--", "sh", "-c", "exit 7"]).status.code(), Some(7));
    let out = Command::new(bin())
        .arg("--state-dir")
        .arg(d.state.path())
        .args(["run", "--", "id", "-u"])
        .env("SUDO_UID", "65534")
        .env("SUDO_GID", "65534")
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "65534", "{}", text(&out));

    // Two sandboxes at once on one daemon, each listed; both gone when they end.
    let mut a = d.spawn_run(&["--name", "web", "--", "sleep", "2"]);
    let mut b = d.spawn_run(&["--name", "dns", "--", "sleep", "2"]);
    d.wait_for_apps(2);
    let apps = d.apps().unwrap();
    let names: Vec<&str> = apps.iter().map(|a| a.name.as_str()).collect();
    assert!(names.contains(&"web") && names.contains(&"dns"), "{apps:?}");
    assert!(a.wait().unwrap().success() && b.wait().unwrap().success());
    d.wait_for_apps(0);

    // Ctrl-C reaches the program; the sandbox is cleaned up.
    let mut c = d.spawn_run(&["--", "sleep", "30"]);
    d.wait_for_apps(1);
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(c.id() as i32), nix::sys::signal::Signal::SIGINT).unwrap();
    let status = c.wait().unwrap();
    assert_eq!(status.code(), Some(130), "sleep was interrupted");
    d.wait_for_apps(0);

    assert!(d.namespaces_left().is_empty(), "namespaces left: {:?}", d.namespaces_left());
    assert!(!d.table_exists(), "the nftables table goes with the last app");
    drop(srv);
}

#[test]
fn a_daemon_crash_stops_the_program_and_leaves_nothing() {
    if !privileged() {
        return;
    }
    let (app_octet, _) = octets();
    let mut d = Daemon::start(app_octet.wrapping_add(50));
    let mut c = d.spawn_run(&["--", "sleep", "30"]);
    d.wait_for_apps(1);
    assert_eq!(d.namespaces_left().len(), 1);
    assert!(d.table_exists());
    d.child.kill().unwrap();
    d.child.wait().unwrap();
    let t0 = Instant::now();
    let status = c.wait().unwrap();
    assert!(t0.elapsed() < Duration::from_secs(10));
    assert!(!status.success(), "the program was stopped");
    assert!(d.namespaces_left().is_empty(), "namespaces left: {:?}", d.namespaces_left());
    assert!(!d.table_exists(), "the dead daemon's nftables table was removed");
}

#[test]
fn run_starts_a_daemon_of_its_own_and_stops_it() {
    if !privileged() {
        return;
    }
    let state = tempfile::tempdir().unwrap();
    let out = Command::new(bin())
        .arg("--state-dir")
        .arg(state.path())
        .args(["run", "--", "sh", "-c", "ip -br addr; exit 3"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(3), "{}", text(&out));
    assert!(String::from_utf8_lossy(&out.stdout).contains("10.77."), "{}", text(&out));
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline && state.path().join("control.sock").exists() {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(!state.path().join("control.sock").exists(), "the daemon it started has exited");
    assert!(state.path().join("daemon.log").exists());

    // A refused attach (a template without the app's face) fails the run, and the daemon started for it exits too.
    let template = state.path().join("bad.toml");
    std::fs::write(&template, "[modules.other]\nkind = \"counter\"\n").unwrap();
    let out = Command::new(bin())
        .arg("--state-dir")
        .arg(state.path())
        .args(["run", "--stack", template.to_str().unwrap(), "--", "true"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(text(&out).contains("must have a module named {app}"), "{}", text(&out));
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline && state.path().join("control.sock").exists() {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(!state.path().join("control.sock").exists(), "no daemon is left behind by a refused attach");
}
