//! End-to-end test of a flow's class as a runtime knob: an app sandboxed behind a `late-binding` scheduler (the
//! default app chain with the scheduler between the flow table and the host face) sends UDP to a server namespace;
//! its flow appears as `flow.<app>.<id>.binding.class` = bulk, `flexstack set` makes it urgent through the real
//! control API, the scheduler's urgent-class counters move, a refused value and a meter are answered as such, and
//! the flow's packets keep arriving. Needs root (skips with a reason outside CI).

mod common;

use common::{answer, as_u64, privileged, server_and_daemon, text, SandboxDaemon};
use flexstack_api::ops::{Get, Status};
use flexstack_api::Value;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// The default app template (stacks/app-default.toml) with a late-binding module `{app}-lb` in front of the host
/// face; one interface, `host`, unmodelled.
fn template() -> String {
    let default = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/stacks/app-default.toml")).unwrap();
    let linked = default.replace(
        "\"{app}-dir[down] -> {app}-host\",",
        "\"{app}-dir[down] -> {app}-lb[in]\",\n  \"{app}-lb[host] -> {app}-host\",",
    );
    assert_ne!(linked, default, "the default template's link to the host face moved");
    format!("{linked}\n[modules.\"{{app}}-lb\"]\nkind = \"late-binding\"\ninterfaces = [\"host\"]\nvars_prefix = \"flow.{{app}}\"\n")
}

/// The variables matching `pattern`, as name -> value.
fn get(d: &SandboxDaemon, pattern: &str) -> BTreeMap<String, Value> {
    let out = d.cli(&["-j", "get", pattern]);
    answer::<Get>(&out).unwrap_or_default().into_iter().map(|(k, v)| (k, v.value)).collect()
}

#[test]
fn a_flows_class_is_a_knob_set_through_the_control_api() {
    if !privileged() {
        return;
    }
    let (srv, d) = server_and_daemon(30, b"");
    std::thread::sleep(Duration::from_millis(300));
    let dir = tempfile::tempdir().unwrap();
    let template_file = dir.path().join("lb-app.toml");
    std::fs::write(&template_file, template()).unwrap();
    // One UDP datagram every 20 ms for 20 s (the test stops it earlier).
    let sender = format!(
        "import socket, time\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n\
         for i in range(1000):\n    s.sendto(b'x' * 100, ('{}', 9999))\n    time.sleep(0.02)\n",
        srv.v4
    );
    let mut app =
        d.spawn_run(&["--name", "kb", "--stack", template_file.to_str().unwrap(), "--", "python3", "-c", &sender]);

    // The flow appears, bulk by its DSCP (0).
    let deadline = Instant::now() + Duration::from_secs(20);
    let knob = loop {
        let classes = get(&d, "flow.kb.*.binding.class");
        if let Some((name, class)) = classes.into_iter().next() {
            assert_eq!(class, Value::Str("bulk".into()), "{name}");
            break name;
        }
        assert!(Instant::now() < deadline, "no flow of app kb: {}", text(&d.cli(&["get", "flow.**"])));
        std::thread::sleep(Duration::from_millis(50));
    };
    let bound = |d: &SandboxDaemon| {
        as_u64(&get(d, "module.kb-lb.host.bound_packets_total")["module.kb-lb.host.bound_packets_total"]).unwrap_or(0)
    };

    // Set through the control API: the value shows at once, and is not a stack revision.
    let revision = |d: &SandboxDaemon| answer::<Status>(&d.cli(&["-j", "status"])).unwrap().revision;
    let before = revision(&d);
    let out = d.cli(&["set", &knob, "urgent"]);
    assert!(out.status.success(), "set {knob} urgent: {}", text(&out));
    assert_eq!(get(&d, &knob)[&knob], Value::Str("urgent".into()));
    assert_eq!(revision(&d), before, "a runtime knob is not a revision");

    // The flow's packets keep being bound.
    let at = bound(&d);
    let deadline = Instant::now() + Duration::from_secs(10);
    while bound(&d) < at + 10 {
        assert!(Instant::now() < deadline, "the flow stopped after its class changed ({} bound)", bound(&d));
        std::thread::sleep(Duration::from_millis(50));
    }

    // A value the scheduler refuses changes nothing; a meter is not writable.
    let out = d.cli(&["set", &knob, "fastest"]);
    assert!(!out.status.success() && text(&out).contains("expected urgent, interactive or bulk"), "{}", text(&out));
    assert_eq!(get(&d, &knob)[&knob], Value::Str("urgent".into()));
    let queued = knob.replace(".class", ".queued");
    let out = d.cli(&["set", &queued, "3"]);
    assert!(!out.status.success() && text(&out).contains("meter"), "set {queued}: {}", text(&out));

    nix::sys::signal::kill(nix::unistd::Pid::from_raw(app.id() as i32), nix::sys::signal::Signal::SIGTERM).unwrap();
    app.wait().unwrap();
    d.wait_for_apps(0);
}
