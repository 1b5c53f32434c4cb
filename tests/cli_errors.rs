//! The CLI's messages for common mistakes (issue 19): each says what went wrong and what to do.
//!
//! - not root: the command needs root or sudo, and says which operation needed it;
//! - `flexstack run curl -s ...` without `--`: a hint with the corrected command line;
//! - a program that does not exist: exit code 127 and `command not found`, as a shell does, before any sandbox;
//! - a daemon that answers with an error and closes while the request is still being written: its message, not
//!   "Broken pipe" (a fake daemon in the test does exactly that);
//! - a request over the 1 MiB limit: refused before anything is sent (the fake daemon sees no byte);
//! - `get P1 P2` where P2 matches nothing: a warning for P2, the values of P1.
//!
//! The tests of the first item run the binary as `nobody` (setpriv) and need root for that; the others need none.

mod common;

use common::{bin, chain, path_str, privileged, text, Daemon};
use std::io::{Read, Write};
use std::os::unix::net::UnixListener;
use std::process::{Command, Output, Stdio};

/// Runs `flexstack ARGS` as the user nobody.
fn as_nobody(args: &[&str]) -> Output {
    Command::new("setpriv")
        .args(["--reuid", "65534", "--regid", "65534", "--clear-groups", "--", bin()])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run setpriv")
}

fn flexstack(args: &[&str]) -> Output {
    Command::new(bin()).args(args).stdin(Stdio::null()).output().expect("run flexstack")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).to_string()
}

#[test]
fn not_root_says_it_needs_root_or_sudo_and_for_what() {
    if !privileged() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let state = path_str(dir.path());
    let lab = dir.path().join("l.toml");
    std::fs::write(&lab, "[lab]\nname = \"fsnr\"\nduration = \"1s\"\n[hosts.a]\n").unwrap();
    nix::unistd::chown(dir.path(), Some(nix::unistd::Uid::from_raw(65534)), None).unwrap();

    let out = as_nobody(&["--state-dir", state, "lab", "up", path_str(&lab)]);
    assert!(!out.status.success());
    let e = stderr(&out);
    assert!(e.contains("flexstack lab up needs root") && e.contains("network namespaces") && e.contains("sudo"), "{e}");
    assert!(!std::path::Path::new("/run/netns/fl-lab.fsnr").exists(), "nothing may be created");

    let out = as_nobody(&["--state-dir", state, "run", "--", "true"]);
    assert!(!out.status.success());
    let e = stderr(&out);
    assert!(e.contains("flexstack run needs root") && e.contains("sudo"), "{e}");

    // A daemon run by root: its control socket is root's.
    let daemon = Daemon::start(&chain("", "", ""), &[]);
    let out = as_nobody(&["--state-dir", path_str(&daemon.state_dir()), "status"]);
    assert_eq!(out.status.code(), Some(3), "{}", text(&out));
    let e = stderr(&out);
    assert!(
        e.contains("connect to the daemon's control socket") && e.contains("needs root") && e.contains("sudo"),
        "{e}"
    );
    assert!(e.contains(path_str(&daemon.state_dir().join("control.sock"))), "which socket: {e}");
}

#[test]
fn a_program_after_run_without_the_separator_gets_a_hint() {
    let out = flexstack(&["run", "curl", "-s", "http://127.0.0.1/"]);
    assert_eq!(out.status.code(), Some(2));
    let e = stderr(&out);
    assert!(e.contains("hint:"), "{e}");
    assert!(e.contains("flexstack run -- curl -s http://127.0.0.1/"), "{e}");
    let out = flexstack(&["lab", "exec", "h1", "ping", "-c", "1", "h2"]);
    assert!(stderr(&out).contains("flexstack lab exec h1 -- ping -c 1 h2"), "{}", stderr(&out));
    // With `--`, no hint (the command fails for another reason or not at all).
    let out = flexstack(&["run", "--bogus", "--", "true"]);
    assert!(!stderr(&out).contains("hint:"), "{}", stderr(&out));
}

#[test]
fn a_program_that_does_not_exist_exits_127_like_a_shell_and_creates_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let out = flexstack(&["--state-dir", path_str(&state), "run", "--", "fs-no-such-program", "-x"]);
    assert_eq!(out.status.code(), Some(127), "{}", text(&out));
    assert_eq!(stderr(&out).trim(), "flexstack run: fs-no-such-program: command not found");
    assert!(!state.exists(), "no daemon may be started for it");
    let out = flexstack(&["--state-dir", path_str(&state), "run", "--", "./fs-not/here"]);
    assert_eq!(out.status.code(), Some(127));
    assert!(stderr(&out).contains("./fs-not/here: No such file or directory"), "{}", stderr(&out));
}

/// A fake daemon at `<dir>/control.sock`: takes one connection, reads `read` bytes of it, optionally answers
/// `answer`, closes. Returns how many bytes it read.
fn fake_daemon(dir: &std::path::Path, read: usize, answer: Option<&'static str>) -> std::thread::JoinHandle<usize> {
    let listener = UnixListener::bind(dir.join("control.sock")).unwrap();
    std::thread::spawn(move || {
        let (mut conn, _) = listener.accept().unwrap();
        conn.set_read_timeout(Some(std::time::Duration::from_secs(5))).unwrap();
        let mut buf = vec![0u8; read];
        let n = conn.read(&mut buf).unwrap_or(0);
        if let Some(a) = answer {
            conn.write_all(a.as_bytes()).unwrap();
        }
        n
    })
}

#[test]
fn a_daemon_that_answers_and_closes_is_heard_not_a_broken_pipe() {
    let dir = tempfile::tempdir().unwrap();
    // A rule file of 900 kB: under the limit, far more than the socket buffers hold, so the CLI is still writing
    // when the daemon answers and closes.
    let rules = dir.path().join("big.rules");
    std::fs::write(&rules, "# padding\n".repeat(90_000)).unwrap();
    let answer = "{\"ok\":false,\"error\":{\"code\":\"busy\",\"message\":\"too many clients (64); try again\"}}\n";
    let server = fake_daemon(dir.path(), 4096, Some(answer));
    let out = flexstack(&["--state-dir", path_str(dir.path()), "rules", "load", path_str(&rules)]);
    server.join().unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let e = stderr(&out);
    assert!(e.contains("too many clients (64); try again"), "{e}");
    assert!(!e.contains("Broken pipe"), "{e}");
}

#[test]
fn a_request_over_the_limit_is_refused_before_it_is_sent() {
    let dir = tempfile::tempdir().unwrap();
    let rules = dir.path().join("huge.rules");
    std::fs::write(&rules, "# padding\n".repeat(110_000)).unwrap();
    let server = fake_daemon(dir.path(), 4096, None);
    let out = flexstack(&["--state-dir", path_str(dir.path()), "rules", "load", path_str(&rules)]);
    let read = server.join().unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let e = stderr(&out);
    assert!(e.contains("over the daemon's limit of 1048576 bytes (1 MiB); nothing was sent"), "{e}");
    assert_eq!(read, 0, "the daemon got bytes of a request over the limit");
}

#[test]
fn get_warns_for_a_pattern_that_matches_nothing_and_shows_the_others() {
    let daemon = Daemon::start(&chain("", "", ""), &[]);
    let out = daemon.cli(&["get", "module.count.frames_in_total", "module.fs-nothing.*"]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(String::from_utf8_lossy(&out.stdout).contains("module.count.frames_in_total"), "{}", text(&out));
    assert!(stderr(&out).contains("warning: no variable matches module.fs-nothing.*"), "{}", text(&out));
    // Nothing matches: an error, as with one pattern.
    let out = daemon.cli(&["get", "module.fs-a.*", "module.fs-b.*"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("module.fs-a.*") && stderr(&out).contains("module.fs-b.*"), "{}", text(&out));
}
