//! End-to-end crash safety (issue 18, items 1, 2 and 7), each in a dedicated "host" namespace whose default routes
//! lead into a gateway namespace ([`common::HostNet`]): the real host's routes, forwarding and nftables are never
//! touched.
//! - Nothing of a sandbox leaves the host when the daemon and/or the `flexstack run` client are killed (SIGKILL)
//!   mid-transfer, TCP and UDP, nor after a normal detach while another app keeps the daemon's table: the gateway
//!   captures 0 packets from or to the app prefixes; forwarding is restored once flexstack's state is gone.
//! - Every process of a sandbox ends with it: after SIGKILL of the client, and after SIGKILL of both the client
//!   and the daemon once a daemon starts again.
//! - Two daemons side by side: each picks a free subnet, `--subnet` asks for one, and the cleanup of a daemon that
//!   is gone never touches a live one's apps.
//!
//! Needs root (skips with a reason outside CI).

mod common;

use common::{eventually, privileged, process_alive, text, HostDaemon, HostNet};
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Stdio};
use std::time::Duration;

const CAPTURE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/leak_capture.py");
const LATE_UDP: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/late_udp.py");

/// The gateway's servers: HTTP on 8080 (a 64 MB file, `blob`) and late UDP replies on 9999 (v4 and v6) for 20 s.
struct Servers {
    _www: tempfile::TempDir,
    _procs: Vec<common::Background>,
}

fn servers(net: &HostNet) -> Servers {
    let www = tempfile::tempdir().unwrap();
    std::fs::File::create(www.path().join("blob")).unwrap().set_len(64 << 20).unwrap();
    let procs = vec![
        net.gw.serve_http("::", www.path()),
        net.gw.spawn(&["python3", LATE_UDP, HostNet::GW_V4, "9999", "20"]),
        net.gw.spawn(&["python3", LATE_UDP, HostNet::GW_V6, "9999", "20"]),
    ];
    assert!(
        eventually(10, || net
            .host
            .run(&[
                "curl",
                "-sf",
                "-m",
                "1",
                "-r",
                "0-9",
                "-o",
                "/dev/null",
                &format!("http://{}:8080/blob", HostNet::GW_V4)
            ])
            .status
            .success()),
        "the gateway's HTTP server answers"
    );
    Servers { _www: www, _procs: procs }
}

/// The gateway's capture of packets from or to the app prefixes (10.77.0.0/16, fd77:4d::/32), see
/// tests/data/leak_capture.py.
struct Capture {
    child: Child,
    dir: tempfile::TempDir,
}

impl Capture {
    fn start(net: &HostNet) -> Capture {
        let dir = tempfile::tempdir().unwrap();
        let (mark, stop) = (dir.path().join("mark"), dir.path().join("stop"));
        let mut child = std::process::Command::new("ip")
            .args(["netns", "exec", &net.gw.name, "python3", CAPTURE, &net.gw_dev, "10.77.0.0/16", "fd77:4d::/32"])
            .args([HostNet::HOST_V4, common::path_str(&mark), common::path_str(&stop)])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.as_mut().unwrap()).read_line(&mut line).unwrap();
        assert_eq!(line.trim(), "ready");
        Capture { child, dir }
    }

    /// From now on, packets to the host count as late.
    fn mark(&self) {
        std::fs::write(self.dir.path().join("mark"), "").unwrap();
    }

    /// Stops; (packets of the app prefixes, the first of them, packets to the host since the mark).
    fn stop(mut self) -> (u64, String, u64) {
        std::fs::write(self.dir.path().join("stop"), "").unwrap();
        let out = self.child.wait_with_output_ref();
        let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("{e}: {out}"));
        (v["leaked"].as_u64().unwrap(), v["first"].as_str().unwrap().to_string(), v["late_to_host"].as_u64().unwrap())
    }
}

trait WaitOutput {
    fn wait_with_output_ref(&mut self) -> String;
}

impl WaitOutput for Child {
    fn wait_with_output_ref(&mut self) -> String {
        let mut s = String::new();
        std::io::Read::read_to_string(self.stdout.as_mut().unwrap(), &mut s).unwrap();
        self.wait().unwrap();
        s
    }
}

/// What the app does: late UDP replies asked for over v4 and v6, and a download at 2 MB/s (far from done when the
/// test kills something); it writes its shell's pid to `pidfile`.
fn transfer_script(pidfile: &Path) -> String {
    let udp = |family: &str, addr: &str| {
        format!(
            "python3 -c \"import socket,time; s=socket.socket(socket.{family}, socket.SOCK_DGRAM); \
             s.sendto(b'x', ('{addr}', 9999)); time.sleep(1000)\" &"
        )
    };
    format!(
        "echo $$ > {pid}; {u4} {u6} curl -s --limit-rate 2M -o /dev/null http://{gw}:8080/blob; wait",
        pid = pidfile.display(),
        u4 = udp("AF_INET", HostNet::GW_V4),
        u6 = udp("AF_INET6", HostNet::GW_V6),
        gw = HostNet::GW_V4,
    )
}

fn read_pid(path: &Path) -> u32 {
    assert!(eventually(10, || std::fs::read_to_string(path).is_ok_and(|s| s.trim().parse::<u32>().is_ok())));
    std::fs::read_to_string(path).unwrap().trim().parse().unwrap()
}

fn kill9(child: &mut Child) {
    child.kill().unwrap();
    child.wait().unwrap();
}

/// SIGKILL for the daemon and the client at once: both are stopped first, so that neither sees the other go and
/// cleans up after it.
fn kill_both(d: &mut HostDaemon, client: &mut Child) {
    use nix::sys::signal::{kill, Signal};
    for pid in [d.child.id(), client.id()] {
        kill(nix::unistd::Pid::from_raw(pid as i32), Signal::SIGSTOP).unwrap();
    }
    d.kill();
    kill9(client);
}

/// Checks that nothing of flexstack's is left in the host namespace: no table, forwarding back to off.
fn assert_host_restored(net: &HostNet, what: &str) {
    assert!(
        eventually(10, || !net.nft_tables().contains("flexstack_") && net.forwarding() == ("0".into(), "0".into())),
        "{what}: the host is as it was: tables {:?}, forwarding {:?}",
        net.nft_tables(),
        net.forwarding()
    );
}

/// Item 1: kill the daemon and/or the client with SIGKILL while the app downloads over TCP and gets UDP replies;
/// the gateway must see nothing from or to the app prefixes, before or after.
fn no_leak_when_killed(kill_daemon: bool, kill_client: bool) {
    let net = HostNet::new();
    let _servers = servers(&net);
    let capture = Capture::start(&net);
    let mut d = HostDaemon::start(&net, &[]);
    let dir = tempfile::tempdir().unwrap();
    let pidfile = dir.path().join("app.pid");
    let mut client = d.spawn_run(&net, &["--", "sh", "-c", &transfer_script(&pidfile)]);
    let app_pid = read_pid(&pidfile);
    d.wait_for_apps(1);
    // Mid-transfer: the download and the UDP replies flow through the sandbox.
    std::thread::sleep(Duration::from_millis(1500));
    assert!(process_alive(app_pid), "the app runs: {}", d.log());
    capture.mark();
    match (kill_daemon, kill_client) {
        (true, true) => kill_both(&mut d, &mut client),
        (true, false) => d.kill(),
        _ => kill9(&mut client),
    }
    // TCP retransmissions and the UDP replies keep coming from the gateway for seconds.
    std::thread::sleep(Duration::from_secs(4));
    let (leaked, first, late) = capture.stop();
    let case = format!("kill daemon {kill_daemon}, kill client {kill_client}");
    assert_eq!(leaked, 0, "{case}: packets of the app prefixes left the host (first: {first}); log: {}", d.log());
    assert!(late > 0, "{case}: the gateway kept sending to the host after the kill (a leak had its chance)");
    assert!(eventually(10, || !process_alive(app_pid)) || (kill_daemon && kill_client), "{case}: the app ended");
    if !kill_client {
        let status = client.wait().unwrap();
        assert!(!status.success(), "{case}: the program was stopped");
    }
    if kill_daemon && kill_client {
        // Nobody was left to clean up: the guard holds until the next daemon removes what is left.
        assert!(net.nft_tables().contains("flexstack_"), "the dead daemon's table (the guard) stays");
        let table = format!("flexstack_{}", d.child.id());
        let chain = text(&net.host.run(&["nft", "list", "chain", "inet", &table, "guard"]));
        let dropped: u64 = chain
            .split("counter packets ")
            .skip(1)
            .filter_map(|rest| rest.split_whitespace().next()?.parse::<u64>().ok())
            .sum();
        assert!(dropped > 0, "the guard is what stopped the replies: {chain}");
        let _next = HostDaemon::start(&net, &[]);
        assert!(eventually(10, || !process_alive(app_pid)), "the next daemon killed the app left behind");
    }
    assert_host_restored(&net, &case);
}

#[test]
fn nothing_leaks_when_the_daemon_is_killed() {
    if privileged() {
        no_leak_when_killed(true, false);
    }
}

#[test]
fn nothing_leaks_when_the_client_is_killed() {
    if privileged() {
        no_leak_when_killed(false, true);
    }
}

#[test]
fn nothing_leaks_when_both_are_killed() {
    if privileged() {
        no_leak_when_killed(true, true);
    }
}

/// Item 1, the case found with UDP: an app asks for late replies and ends normally while another app keeps the
/// daemon's table (and forwarding) alive; the replies must not follow the app's address out of the host.
#[test]
fn late_replies_after_a_detach_do_not_leak() {
    if !privileged() {
        return;
    }
    let net = HostNet::new();
    let _servers = servers(&net);
    let capture = Capture::start(&net);
    let d = HostDaemon::start(&net, &[]);
    let mut keeper = d.spawn_run(&net, &["--name", "keeper", "--", "sleep", "30"]);
    d.wait_for_apps(1);
    let asks = format!(
        "python3 -c \"import socket,time; s=socket.socket(socket.AF_INET, socket.SOCK_DGRAM); \
         s.sendto(b'x', ('{}', 9999)); s.recv(100); s.recv(100)\"",
        HostNet::GW_V4
    );
    let out = d.spawn_run(&net, &["--name", "asker", "--", "sh", "-c", &asks]).wait_with_output().unwrap();
    assert!(out.status.success(), "{}", text(&out));
    capture.mark();
    assert_eq!(d.wait_for_apps(1)[0].name, "keeper");
    let tracked = net.host.run(&["conntrack", "-L", "-s", "10.77.0.0/16"]);
    assert!(text(&tracked).contains(" 0 flow entries"), "the detached app's flows were flushed: {}", text(&tracked));
    std::thread::sleep(Duration::from_secs(2));
    let (leaked, first, late) = capture.stop();
    assert_eq!(leaked, 0, "late replies left the host with the detached app's address (first: {first})");
    assert!(late > 0, "the gateway kept replying after the detach");
    kill9(&mut keeper);
    d.wait_for_apps(0);
    assert_host_restored(&net, "after the last app");
}

/// Item 2: `sleep 1000` and a process it left in the background end with the sandbox when the client is killed
/// (the daemon detaches the app), and, when the daemon is killed too, once a daemon starts again.
#[test]
fn apps_do_not_outlive_their_sandbox() {
    if !privileged() {
        return;
    }
    let net = HostNet::new();
    let dir = tempfile::tempdir().unwrap();
    for kill_daemon in [false, true] {
        let mut d = HostDaemon::start(&net, &[]);
        let (pidfile, bgfile) = (dir.path().join("pid"), dir.path().join("bg"));
        let _ = std::fs::remove_file(&pidfile);
        let _ = std::fs::remove_file(&bgfile);
        let script = format!(
            "setsid sleep 1001 & echo $! > {bg}; echo $$ > {pid}; exec sleep 1000",
            bg = bgfile.display(),
            pid = pidfile.display()
        );
        let mut client = d.spawn_run(&net, &["--", "sh", "-c", &script]);
        let (app, bg) = (read_pid(&pidfile), read_pid(&bgfile));
        d.wait_for_apps(1);
        assert!(process_alive(app) && process_alive(bg));
        if kill_daemon {
            kill_both(&mut d, &mut client);
        } else {
            kill9(&mut client);
        }
        if kill_daemon {
            // Nobody is left to stop it: the first daemon to start (this one, or one of a test running meanwhile)
            // finds the cgroup of a daemon that is gone and kills it.
            let _next = HostDaemon::start(&net, &[]);
            assert!(eventually(10, || !process_alive(app) && !process_alive(bg)), "the next daemon killed them");
        } else {
            assert!(eventually(10, || !process_alive(app) && !process_alive(bg)), "{}", d.log());
            d.wait_for_apps(0);
        }
    }
}

/// Item 7: two daemons at once on one host, both with the default app subnet: each app gets a /24 of its own and
/// both work; `--subnet` gives an app the /24 it asks for and refuses one in use; when one daemon dies, a daemon
/// starting cleans up after it and leaves the live one's app alone.
#[test]
fn two_daemons_share_a_host() {
    if !privileged() {
        return;
    }
    let net = HostNet::new();
    let _servers = servers(&net);
    let mut a = HostDaemon::start(&net, &[]);
    let b = HostDaemon::start(&net, &[]);
    let fetch = format!("curl -sf -m 10 -r 0-999 -o /dev/null http://{}:8080/blob && exec sleep 30", HostNet::GW_V4);
    let mut ca = a.spawn_run(&net, &["--", "sh", "-c", &fetch]);
    let app_a = a.wait_for_apps(1).remove(0);
    let mut cb = b.spawn_run(&net, &["--", "sh", "-c", &fetch]);
    let app_b = b.wait_for_apps(1).remove(0);
    assert_ne!(app_a.ipv4, app_b.ipv4, "each daemon's app has an address of its own");
    let status = std::fs::read_to_string(format!("/proc/{}/status", a.child.id())).unwrap();
    assert!(status.contains("NoNewPrivs:\t1"), "the daemon sets no-new-privileges for what it starts: {status}");
    assert_ne!(app_a.netns, app_b.netns);
    assert!(app_a.ipv4.starts_with("10.77.") && app_b.ipv4.starts_with("10.77."), "{app_a:?} {app_b:?}");

    // An app with a subnet of its choice; one in use is refused.
    let out = net
        .command(common::bin())
        .arg("--state-dir")
        .arg(b.state.path())
        .args(["run", "--subnet", "10.90.3.0/24", "--", "sh", "-c"])
        .arg(format!("ip -br addr && curl -sf -m 10 -r 0-999 -o /dev/null http://{}:8080/blob", HostNet::GW_V4))
        .output()
        .unwrap();
    assert!(out.status.success() && text(&out).contains("10.90.3.2/24"), "{}", text(&out));
    let taken = format!("{}.0/24", app_a.ipv4.rsplit_once('.').unwrap().0);
    let out = net
        .command(common::bin())
        .arg("--state-dir")
        .arg(b.state.path())
        .args(["run", "--subnet", &taken, "--", "true"])
        .output()
        .unwrap();
    assert!(!out.status.success() && text(&out).contains("in use"), "{}", text(&out));

    // Daemon a and its client die; a new daemon cleans up after a, not after b.
    a.kill();
    kill9(&mut ca);
    let _c = HostDaemon::start(&net, &[]);
    assert!(eventually(10, || !Path::new("/run/netns").join(&app_a.netns).exists()), "a's sandbox is removed");
    assert!(Path::new("/run/netns").join(&app_b.netns).exists(), "b's sandbox is left alone");
    assert_eq!(b.apps().len(), 1, "b's app is still attached");
    assert!(cb.try_wait().unwrap().is_none(), "b's app still runs");
    let url = format!("http://{}:8080/blob", HostNet::GW_V4);
    let out = std::process::Command::new("ip")
        .args(["netns", "exec", &app_b.netns, "curl", "-sf", "-m", "5", "-r", "0-9", "-o", "/dev/null", &url])
        .output()
        .unwrap();
    assert!(out.status.success(), "b's app still reaches the gateway: {}", text(&out));
    kill9(&mut cb);
    b.wait_for_apps(0);
}

/// Two daemons whose apps come and go side by side keep the host forwarding for each other: the one whose app
/// ends last restores the settings, none while the other's apps run (each app reaches the gateway through the
/// host). The apps run the kernel back-ends' server role, whose nftables table of its own
/// (`flexstack_kserver_<port>`) is not a daemon's: the settings come back after it too.
#[test]
fn daemons_coming_and_going_keep_forwarding_for_each_other() {
    if !privileged() {
        return;
    }
    let net = HostNet::new();
    let _servers = servers(&net);
    let dir = tempfile::tempdir().unwrap();
    let stack = dir.path().join("server-role.toml");
    let matches = r#"["tcp dport 8080 role server", "tcp *"]"#;
    std::fs::write(&stack, common::terminate_stack("kernel", "kernel", matches)).unwrap();
    let stack = stack.to_str().unwrap();
    let daemons = [HostDaemon::start(&net, &[]), HostDaemon::start(&net, &[])];
    let fetch = format!("curl -sSf -m 5 -r 0-999 -o /dev/null http://{}:8080/blob", HostNet::GW_V4);
    std::thread::scope(|s| {
        for (n, d) in daemons.iter().enumerate() {
            let (net, fetch) = (&net, &fetch);
            s.spawn(move || {
                for i in 0..6 {
                    let app = d.spawn_run(net, &["--stack", stack, "--", "sh", "-c", fetch]);
                    let out = app.wait_with_output().unwrap();
                    assert!(out.status.success(), "daemon {n}, app {i}: {}", text(&out));
                }
            });
        }
    });
    assert_host_restored(&net, "after the last app");
}

/// Item 8: a tap on an app's chain goes with the app (it recorded nothing else).
#[test]
fn a_tap_on_an_apps_chain_goes_with_the_app() {
    if !privileged() {
        return;
    }
    let net = HostNet::new();
    let d = HostDaemon::start(&net, &[]);
    let mut client = d.spawn_run(&net, &["--name", "tapped", "--", "sleep", "30"]);
    d.wait_for_apps(1);
    let file = d.state.path().join("app.pcapng");
    let out = d.cli(&["tap", "add", "tapped", common::path_str(&file)]);
    assert!(out.status.success(), "{}", text(&out));
    let taps = || {
        let list = common::answer::<flexstack_api::ops::ModuleList>(&d.cli(&["-j", "module", "list"])).unwrap();
        list.into_iter().filter(|m| m.kind == "tap").count()
    };
    assert_eq!(taps(), 1);
    kill9(&mut client);
    d.wait_for_apps(0);
    assert_eq!(taps(), 0, "the app's tap was unloaded with it");
    assert!(file.exists(), "its capture stays");
}

/// Item 8: a daemon started by `flexstack run` does not wipe the log of the one before (which may have crashed).
#[test]
fn the_log_of_the_daemon_before_is_kept() {
    if !privileged() {
        return;
    }
    let net = HostNet::new();
    let state = tempfile::tempdir().unwrap();
    for (n, code) in [(1, "3"), (2, "4")] {
        let out = net
            .command(common::bin())
            .arg("--state-dir")
            .arg(state.path())
            .args(["run", "--name", &format!("run{n}"), "--", "sh", "-c", &format!("exit {code}")])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(code.parse().unwrap()), "{}", text(&out));
        // The daemon it started exits with its app; the next run starts another.
        assert!(eventually(10, || !state.path().join("control.sock").exists()), "the daemon exited");
    }
    let log = |f: &str| std::fs::read_to_string(state.path().join(f)).unwrap_or_default();
    assert!(log("daemon.log.1").contains("app=run1"), "the first daemon's log is kept: {:?}", log("daemon.log.1"));
    assert!(log("daemon.log").contains("app=run2") && !log("daemon.log").contains("app=run1"), "{}", log("daemon.log"));
}
