//! End-to-end: FreeNA's client commands on a running sandboxed app (docs/services.md, "Commands for running
//! apps"): `flexstack app list` with its processes, `app stop|continue|kill NAME` on every process of its cgroup,
//! `app output NAME` (what `flexstack run` kept of its stdout and stderr). Needs root (skips with a reason outside
//! CI).

mod common;

use common::{eventually, octets, privileged, text, SandboxDaemon};
use std::time::Duration;

/// The state letter of process `pid` (`R`, `S`, `T` for stopped ...), `None` once it is gone.
fn state(pid: i32) -> Option<char> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    s.rsplit_once(") ").and_then(|(_, rest)| rest.chars().next())
}

/// The parent of process `pid`, `None` once it is gone.
fn parent(pid: i32) -> Option<i32> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    s.rsplit_once(") ").and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse().ok())
}

#[test]
fn app_commands_list_stop_continue_kill_and_show_the_output() {
    if !privileged() {
        return;
    }
    let (app_octet, _) = octets();
    let d = SandboxDaemon::start(app_octet);
    let dir = tempfile::tempdir().unwrap();
    let ticks = dir.path().join("ticks");
    // Two processes (the shell and its sleep loop's child), a line on each of stdout and stderr, and a file that
    // grows while they run.
    let script = format!(
        "echo out-line; echo err-line >&2; sh -c 'while true; do echo t >> {t}; sleep 0.02; done' & wait",
        t = ticks.display()
    );
    let mut run = d.spawn_run(&["--name", "looper", "--", "sh", "-c", &script]);
    d.wait_for_apps(1);
    let cli = |args: &[&str]| d.cli(args);
    // app list: the app with its processes and cgroup. (`flexstack run` itself is in the app's cgroup for a moment
    // while it starts the program, and the loop's short-lived children come and go: the outer shell, the child
    // `flexstack run` started, is the one that stays.)
    let runner = run.id() as i32;
    let mut pids = Vec::new();
    assert!(
        eventually(5, || {
            pids = d.apps().unwrap_or_default().first().map(|a| a.pids.clone()).unwrap_or_default();
            pids.len() >= 2 && !pids.contains(&runner) && pids.iter().any(|&p| parent(p) == Some(runner))
        }),
        "app list shows the app's processes: {:?}",
        d.apps()
    );
    let shell = *pids.iter().find(|&&p| parent(p) == Some(runner)).unwrap();
    let listed = text(&cli(&["app", "list"]));
    assert!(listed.contains("looper") && listed.contains(&shell.to_string()), "{listed}");
    let cgroup = d.apps().unwrap()[0].cgroup.clone();
    assert!(cgroup.ends_with("-looper") && std::path::Path::new(&cgroup).exists(), "{cgroup}");

    // stop: every process stopped, the file no longer grows.
    let out = cli(&["app", "stop", "looper"]);
    assert!(out.status.success(), "{}", text(&out));
    // (The loop's short-lived children come and go: what counts is every process there now.)
    let now = || d.apps().unwrap_or_default().first().map(|a| a.pids.clone()).unwrap_or_default();
    let stopped = || {
        let states: Vec<char> = now().iter().filter_map(|&p| state(p)).collect();
        states.len() >= 2 && states.iter().all(|&s| s == 'T')
    };
    assert!(eventually(5, stopped), "all stopped: {:?}", now().iter().map(|&p| (p, state(p))).collect::<Vec<_>>());
    pids = now().into_iter().filter(|&p| state(p).is_some()).collect();
    let size = |_: ()| std::fs::metadata(&ticks).map(|m| m.len()).unwrap_or(0);
    let frozen = size(());
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(size(()), frozen, "nothing ran while stopped");

    // continue: they run again.
    let out = cli(&["-j", "app", "continue", "looper"]);
    assert!(out.status.success() && text(&out).contains("SIGCONT"), "{}", text(&out));
    assert!(eventually(5, || size(()) > frozen), "the loop goes on");
    assert!(pids.iter().all(|&p| state(p) != Some('T')), "none of them stopped");

    // Unknown apps: the error names the running ones.
    let out = cli(&["app", "stop", "nosuch"]);
    assert!(!out.status.success() && text(&out).contains("running apps: looper"), "{}", text(&out));

    // kill: every process gone, `flexstack run` ends with 128 + 9, and the output stays readable.
    let out = cli(&["app", "kill", "looper"]);
    assert!(out.status.success(), "{}", text(&out));
    let status = run.wait().unwrap();
    assert_eq!(status.code(), Some(137), "run ends as its program was killed");
    assert!(eventually(5, || pids.iter().all(|&p| state(p).is_none())), "every process gone");
    let out = cli(&["app", "output", "looper"]);
    let t = text(&out);
    assert!(out.status.success() && t.contains("out-line") && t.contains("err-line"), "{t}");
    let out = cli(&["app", "output", "nosuch"]);
    assert!(!out.status.success() && text(&out).contains("kept for: looper"), "{}", text(&out));
}
