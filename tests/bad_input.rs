//! End-to-end: bad input of every kind gets a clear error, and the daemon keeps running.

mod common;

use common::{daemon_fails, Daemon};
use std::time::{Duration, Instant};

const STACK: &str = r#"links = ["src -> sel", "sel[0] -> out"]

[modules.src]
kind = "source"
rate = 0

[modules.sel]
kind = "switch"
outputs = 2

[modules.out]
kind = "sink"
"#;

#[test]
fn bad_stack_files_are_refused_with_file_and_line() {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("bad.toml").display().to_string();

    let e = daemon_fails("links = [\"a -> b\"\n[modules.a]\nkind = \"sink\"\n", tmp.path());
    assert!(e.contains(&format!("{file}:")) && e.contains("invalid TOML"), "{e}");

    let e = daemon_fails("\n[modules.x]\nkind = \"warpdrive\"\n", tmp.path());
    assert!(
        e.contains(&format!("{file}:2:")) && e.contains("unknown module kind `warpdrive`") && e.contains("counter"),
        "{e}"
    );

    let e = daemon_fails("links = [\n  \"c -> ghost\",\n]\n[modules.c]\nkind = \"counter\"\n", tmp.path());
    assert!(e.contains(&format!("{file}:2:")) && e.contains("no module named `ghost`"), "{e}");

    let e = daemon_fails("[modules.c]\nkind = \"counter\"\ncolour = \"blue\"\n", tmp.path());
    assert!(e.contains(&format!("{file}:3:")) && e.contains("unknown setting `colour`"), "{e}");

    let e = daemon_fails("[modules.s]\nkind = \"switch\"\noutputs = 2\nselect = 5\n", tmp.path());
    assert!(e.contains(&format!("{file}:4:")), "{e}");

    let e = daemon_fails(
        "links = [\"a -> b\", \"b -> a\"]\n[modules.a]\nkind = \"counter\"\n[modules.b]\nkind = \"counter\"\n",
        tmp.path(),
    );
    assert!(e.contains("cycle"), "{e}");

    let e = daemon_fails("[modules.c]\nkind = \"counter\"\n\n[modules.t]\nkind = \"tap\"\n", tmp.path());
    assert!(e.contains(&format!("{file}:4:")) && e.contains("`path`") && e.contains("required"), "{e}");

    let e = daemon_fails("[modules.c]\nkind = \"counter\"\n[wat]\nx = 1\n", tmp.path());
    assert!(e.contains(&format!("{file}:3:")) && e.contains("unknown key `wat`"), "{e}");
    assert!(!tmp.path().join("state/control.sock").exists(), "a refused stack leaves no socket");
}

#[test]
fn bad_cli_requests_get_errors_and_change_nothing() {
    let d = Daemon::start(STACK, &[]);
    let before = d.ok(&["config", "show"]);

    // Each is refused with an error that says why.
    let e = d.fails(&["link", "add", "sel -> out"]);
    assert!(e.contains("several output ports") && e.contains("sel[0]"), "{e}");
    let e = d.fails(&["link", "add", "out -> src"]);
    assert!(e.contains("no output port") || e.contains("no input port"), "{e}");
    for (args, why) in [
        (&["link", "add", "sel[1] -> nowhere"][..], "no module named `nowhere`"),
        (&["link", "add", "sel[7] -> out"], "no output port `7`"),
        (&["link", "add", "this is not a link"], "->"),
        (&["link", "add", "sel[1] -> src"], "src has no input port"),
        (&["link", "del", "sel[1] -> out"], "there is no link"),
        (&["set", "module.sel.select", "9"], "within"),
        (&["set", "module.sel.select", "many"], "expected a i64 value"),
        (&["set", "module.sel.frames_total", "1"], "read-only"),
        (&["set", "module.nope.select", "1"], "no variable named"),
        (&["get", "module.nope.*"], "no variable matches"),
        (&["get", "*"], "`**` across them: try **"),
        (&["get", "module.sel.*.frames_in_total"], "try module.sel.**.frames_in_total"),
        (&["module", "load", "x", "warpdrive"], "unknown module kind"),
        (&["module", "load", "x", "counter", "speed=3"], "unknown setting `speed`"),
        (&["module", "load", "sel", "counter"], "already loaded"),
        (&["module", "replace", "sel", "counter"], "no output port `0`"),
        (&["config", "rollback", "99"], "no revision 99"),
    ] {
        let e = d.fails(args);
        assert!(e.contains(why), "{args:?}: {e}");
    }

    assert_eq!(d.ok(&["config", "show"]), before, "refused requests changed nothing");
    assert_eq!(d.json(&["config", "log"]).as_array().unwrap().len(), 1);
}

#[test]
fn malformed_oversized_and_silent_clients() {
    let mut d = Daemon::start(STACK, &["--client-timeout", "0.5"]);

    // Invalid JSON: an error, and the connection stays usable.
    let mut c = d.raw();
    c.send(b"{this is not json\n");
    let r = c.line().unwrap();
    assert_eq!(r["ok"], false);
    assert_eq!(r["error"]["code"], "invalid_json");
    c.send(b"{\"id\": 5, \"op\": \"frobnicate\"}\n");
    let r = c.line().unwrap();
    assert_eq!(r["error"]["code"], "invalid_request");
    c.send(b"{\"id\": 6, \"op\": \"status\"}\n");
    let r = c.line().unwrap();
    assert_eq!((r["id"].as_u64(), r["ok"].as_bool()), (Some(6), Some(true)));
    c.send(b"[1,2,3]\n");
    assert_eq!(c.line().unwrap()["error"]["code"], "invalid_request");
    c.send(b"\xff\xfe\n");
    assert_eq!(c.line().unwrap()["error"]["code"], "invalid_json");

    // A client that connects and sends nothing is told so and disconnected; others are served meanwhile.
    let mut silent = d.raw();
    let t0 = Instant::now();
    assert_eq!(d.json(&["status"])["modules"], 3, "served while a client is silent");
    let r = silent.line().expect("a timeout error");
    assert_eq!(r["error"]["code"], "timeout");
    assert!(t0.elapsed() < Duration::from_secs(5));
    assert!(silent.line().is_none(), "connection closed after the timeout");

    // A request larger than the limit.
    let mut big = d.raw();
    let mut payload = b"{\"op\":\"get\",\"names\":[\"".to_vec();
    payload.extend(std::iter::repeat_n(b'a', 2 << 20));
    payload.extend_from_slice(b"\"]}\n");
    let _ = std::io::Write::write_all(&mut big.writer, &payload);
    let r = big.line().expect("too_large error");
    assert_eq!(r["error"]["code"], "too_large");

    // Half a request, then silence.
    let mut slow = d.raw();
    slow.send(b"{\"op\": \"sta");
    assert_eq!(slow.line().unwrap()["error"]["code"], "timeout");

    // After all that, the daemon still runs and answers.
    assert!(d.alive());
    assert_eq!(d.json(&["status"])["modules"], 3);
}
