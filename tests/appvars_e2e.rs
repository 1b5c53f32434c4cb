//! End-to-end: application variables. The C example (built with cc from clients/c) and the Python example
//! (clients/python) register `app.<name>.ticks` (a meter) and `app.<name>.level` (a knob) with a real daemon;
//! `flexstack get` reads the meter, `flexstack set` reaches the knob's callback (and a refusal by the callback
//! fails the set), a rule drives the knob from the meter, and the variables go when the program ends.

mod common;

use common::Daemon;
use flexstack_api::ops::AppVarList;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

const STACK: &str = "[modules.sink]\nkind = \"sink\"\n";

/// A running example program; its stdout lines are collected; killed on drop.
struct Example {
    child: Child,
    lines: Arc<Mutex<Vec<String>>>,
}

impl Example {
    fn start(mut cmd: Command, d: &Daemon) -> Example {
        let mut child = cmd
            .env("FLEXSTACK_STATE_DIR", d.state_dir())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start the example");
        let lines: Arc<Mutex<Vec<String>>> = Arc::default();
        let (out, sink) = (child.stdout.take().unwrap(), lines.clone());
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines().map_while(Result::ok) {
                sink.lock().unwrap().push(l);
            }
        });
        Example { child, lines }
    }

    fn printed(&self, line: &str) -> bool {
        self.lines.lock().unwrap().iter().any(|l| l == line)
    }
}

impl Drop for Example {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn exercise(d: &Daemon, mut ex: Example, app: &str) {
    let ticks = format!("app.{app}.ticks");
    let level = format!("app.{app}.level");
    d.wait_for("the app to register", 10, |d| d.cli(&["get", &ticks]).status.success());
    // The meter counts up.
    let first = d.get_u64(&ticks);
    d.wait_for("ticks to grow", 10, |d| d.get_u64(&ticks) > first + 2);
    // The knob: a set reaches the callback, which accepts it.
    assert_eq!(d.get(&level), 0);
    d.ok(&["set", &level, "7"]);
    assert_eq!(d.get(&level), 7);
    d.wait_for("the callback to print level=7", 5, |_| ex.printed("level=7"));
    // The callback refuses -1: the set fails, the knob keeps its value. The daemon's validation refuses text.
    let err = d.fails(&["set", &level, "-1"]);
    assert!(err.contains("refused by application") && err.contains("within 0..100"), "{err}");
    assert_eq!(d.get(&level), 7);
    let err = d.fails(&["set", &level, "high"]);
    assert!(err.contains("expected a i64") || err.contains("i64"), "{err}");
    // The meter is read-only from outside.
    assert!(d.fails(&["set", &ticks, "1"]).contains("meter"));
    // Who registered is recorded.
    let vars = d.answer::<AppVarList>(&["app", "vars"]);
    let entry = vars.iter().find(|a| a.app == app).expect("listed").clone();
    assert_eq!(i64::from(entry.pid), i64::from(ex.child.id()));
    assert_eq!(entry.uid, nix::unistd::getuid().as_raw());

    // A rule drives the knob from the meter.
    let rule = format!("lvl: set(\"{level}\", If(Greater(get(\"{ticks}\"), 0), 42, 1))\n");
    let file = d.path(&format!("{app}.rules"));
    std::fs::write(&file, rule).unwrap();
    d.ok(&["rules", "load", file.to_str().unwrap()]);
    d.wait_for("the rule's write to reach the callback", 10, |_| ex.printed("level=42"));
    // The callback prints before its acceptance travels back to the daemon: wait for the value.
    d.wait_for("the knob to read 42", 5, |d| d.get(&level) == 42);
    d.ok(&["rules", "unload", "lvl"]);

    // The lease: the variables go with the program.
    let _ = ex.child.kill();
    let _ = ex.child.wait();
    d.wait_for("the variables to go", 10, |d| !d.cli(&["get", &ticks]).status.success());
    assert_eq!(d.answer::<AppVarList>(&["app", "vars"]), []);
    drop(ex);
}

#[test]
fn the_c_library_example_registers_a_meter_and_a_knob() {
    let build = tempfile::tempdir().unwrap();
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("clients/c");
    let out = Command::new("make")
        .arg("-C")
        .arg(&src)
        .arg(format!("O={}", build.path().display()))
        .output()
        .expect("run make (needs make and cc)");
    assert!(out.status.success(), "building the C example failed: {}", common::text(&out));
    let d = Daemon::start(STACK, &[]);
    let mut cmd = Command::new(build.path().join("example"));
    cmd.args(["cdemo", "60"]);
    exercise(&d, Example::start(cmd, &d), "cdemo");

    // A second registration of a taken name is refused; after the first goes, the name is free again.
    let mut one = Command::new(build.path().join("example"));
    one.args(["twice", "60"]);
    let _one = Example::start(one, &d);
    d.wait_for("the first to register", 10, |d| d.cli(&["get", "app.twice.ticks"]).status.success());
    let second = Command::new(build.path().join("example"))
        .args(["twice", "1"])
        .env("FLEXSTACK_STATE_DIR", d.state_dir())
        .output()
        .unwrap();
    assert!(!second.status.success());
    assert!(String::from_utf8_lossy(&second.stderr).contains("already registered"), "{}", common::text(&second));
    std::thread::sleep(Duration::from_millis(50));
}

#[test]
fn the_python_module_example_registers_a_meter_and_a_knob() {
    let d = Daemon::start(STACK, &[]);
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("clients/python/example.py");
    let mut cmd = Command::new("python3");
    cmd.arg(script).args(["pydemo", "60"]);
    exercise(&d, Example::start(cmd, &d), "pydemo");
}

#[test]
fn the_app_socket_accepts_only_app_requests() {
    let d = Daemon::start(STACK, &[]);
    let sock = d.state_dir().join("apps.sock");
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(std::fs::metadata(&sock).unwrap().permissions().mode() & 0o777, 0o666);
    assert_eq!(std::fs::metadata(d.state_dir()).unwrap().permissions().mode() & 0o777, 0o711);
    let mut s = std::os::unix::net::UnixStream::connect(&sock).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut r = BufReader::new(s.try_clone().unwrap());
    let mut ask = |line: &str| {
        use std::io::Write;
        s.write_all(format!("{line}\n").as_bytes()).unwrap();
        let mut out = String::new();
        r.read_line(&mut out).unwrap();
        serde_json::from_str::<serde_json::Value>(&out).unwrap()
    };
    // Control requests are not app requests.
    let e = ask(r#"{"op":"set","name":"module.sink.x","value":1}"#);
    assert_eq!(e["error"]["code"], "invalid_request", "{e}");
    let e = ask(r#"{"op":"register","app":"../etc","vars":[{"name":"x","kind":"meter","type":"u64"}]}"#);
    assert!(e["error"]["message"].as_str().unwrap().contains("invalid variable prefix"), "{e}");
    let ok = ask(r#"{"op":"register","app":"raw","vars":[{"name":"x","kind":"meter","type":"u64"}]}"#);
    assert_eq!(ok["ok"], true, "{ok}");
    let e = ask(r#"{"op":"update","name":"x","value":"many"}"#);
    assert_eq!(e["error"]["code"], "invalid_value", "{e}");
    assert_eq!(ask(r#"{"op":"update","name":"x","value":5}"#)["ok"], true);
    assert_eq!(d.get_u64("app.raw.x"), 5);
}
