//! End-to-end with several data-plane workers (`flexstack daemon --workers 2`): two namespaces joined by two TUN
//! faces (multi-queue, a queue per worker) through `classify`. Many TCP connections and UDP flows at once arrive
//! intact, each flow stayed on one worker (its frames both ways were classified there), both workers carried
//! traffic, the devices' steering program put every frame on its owner's queue (next to no handoff), and every
//! handoff is counted; a stack being edited under traffic loses or duplicates no frame; a stack
//! with a module that needs a global view runs on one worker and says so. Needs root (skips with a reason
//! outside CI).

mod common;

use common::{privileged, sh, through_tun_faces, unique, Daemon, LinkGuard, Netns};
use flexstack_api::ops::{Get, ShowRuntime, Status};
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// A daemon with `workers` workers whose stack joins TUN faces `a` (namespace A, 10.77.0.1 and fd77::1) and `b`
/// (namespace B, .2 and ::2) through a classifier and a direction splitter, plus `more` (TOML tables).
fn two_namespaces(workers: &str, more: &str) -> (Daemon, Netns, Netns) {
    through_tun_faces(
        r#"["a -> cls", "b -> cls", "cls[tcp] -> dir", "cls[udp] -> dir", "cls[icmp] -> dir", "cls[other] -> dir",
            "dir[down] -> b", "dir[up] -> a"]"#,
        "direction = \"up\"\n",
        &format!("[modules.cls]\nkind = \"classify\"\n[modules.dir]\nkind = \"direction\"\n{more}"),
        (&["10.77.0.1/24", "fd77::1/64"], &["10.77.0.2/24", "fd77::2/64"]),
        &["--workers", workers],
    )
}

/// Frames handed between workers in a test, at most: those the kernel queued on a device's first queue before
/// its second opened (the steering program sends every later one to the worker that owns its flow).
const HANDED_AT_MOST: u64 = 16;

/// What `status` says of the data plane (its scheduling, and its workers when it has several).
fn data_plane(d: &Daemon) -> String {
    d.answer::<Status>(&["status"]).dataplane_scheduling
}

/// Every variable matching `pattern`, by name, as u64 (text values are left out).
fn u64s(d: &Daemon, pattern: &str) -> BTreeMap<String, u64> {
    d.answer::<Get>(&["get", pattern])
        .into_iter()
        .filter_map(|(name, v)| serde_json::to_value(&v.value).ok()?.as_u64().map(|x| (name, x)))
        .collect()
}

fn sum(d: &Daemon, pattern: &str) -> u64 {
    u64s(d, pattern).values().sum()
}

/// The TCP server: each connection's bytes until the client's FIN, answered with their SHA-256 (hex).
const TCP_SERVER: &str = r#"
import hashlib, socket, sys, threading
s = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("::", 7000)); s.listen(256)
def serve(c):
    h = hashlib.sha256()
    while True:
        b = c.recv(65536)
        if not b: break
        h.update(b)
    c.sendall(h.hexdigest().encode()); c.close()
while True:
    c, _ = s.accept()
    threading.Thread(target=serve, args=(c,), daemon=True).start()
"#;

/// The UDP server: echoes every datagram.
const UDP_SERVER: &str = r#"
import socket
s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
s.bind(("::", 7001))
while True:
    b, a = s.recvfrom(2048)
    s.sendto(b, a)
"#;

/// The client: `tcp` connections (half over IPv4, half over IPv6) each send their own bytes and compare the
/// server's digest; `udp` flows each send `datagrams` numbered datagrams and count the echoes. Prints one line per
/// flow: `tcp ok`, `tcp BAD ...`, `udp N` (echoes received).
const CLIENT: &str = r#"
import hashlib, random, socket, sys, threading, time
tcp, udp, datagrams, size = map(int, sys.argv[1:5])
out, lock = [], threading.Lock()
def say(line):
    with lock: out.append(line)
def tcp_flow(i):
    host = "10.77.0.2" if i % 2 else "fd77::2"
    data = random.Random(i).randbytes(size + i * 997)
    try:
        c = socket.create_connection((host, 7000), timeout=30)
        c.sendall(data); c.shutdown(socket.SHUT_WR)
        got = b""
        while True:
            b = c.recv(128)
            if not b: break
            got += b
        say("tcp ok" if got.decode() == hashlib.sha256(data).hexdigest() else "tcp BAD %d" % i)
    except Exception as e:
        say("tcp BAD %d %s" % (i, e))
def udp_flow(i):
    host = "10.77.0.2" if i % 2 else "fd77::2"
    fam = socket.AF_INET if i % 2 else socket.AF_INET6
    s = socket.socket(fam, socket.SOCK_DGRAM); s.settimeout(0.5)
    seen = set()
    for n in range(datagrams):
        s.sendto(b"%d:%d:" % (i, n) + b"x" * 200, (host, 7001))
        time.sleep(0.002)
        try:
            while True:
                b, _ = s.recvfrom(2048); seen.add(b.split(b":")[1]); s.settimeout(0.0)
        except (BlockingIOError, socket.timeout):
            s.settimeout(0.5)
    s.settimeout(1.0)
    try:
        while len(seen) < datagrams:
            b, _ = s.recvfrom(2048); seen.add(b.split(b":")[1])
    except socket.timeout:
        pass
    say("udp %d" % len(seen))
threads = [threading.Thread(target=tcp_flow, args=(i,)) for i in range(tcp)]
threads += [threading.Thread(target=udp_flow, args=(i,)) for i in range(udp)]
for t in threads: t.start()
for t in threads: t.join()
print("\n".join(out))
"#;

fn script(dir: &Path, name: &str, text: &str) -> String {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path.to_str().unwrap().to_string()
}

/// Waits until the namespace `ns` reaches `host` (ping), so that the first flows do not race the link coming up.
fn reachable(ns: &Netns, host: &str) {
    for _ in 0..50 {
        if ns.run(&["ping", "-c", "1", "-W", "1", host]).status.success() {
            return;
        }
    }
    panic!("{host} never answered");
}

/// Starts the servers in B and runs the client in A; returns the client's lines.
fn run_flows(ns_a: &Netns, ns_b: &Netns, tcp: usize, udp: usize, datagrams: usize, size: usize) -> Vec<String> {
    let dir = tempfile::tempdir().unwrap();
    let _tcp = ns_b.spawn(&["python3", &script(dir.path(), "tcp.py", TCP_SERVER)]);
    let _udp = ns_b.spawn(&["python3", &script(dir.path(), "udp.py", UDP_SERVER)]);
    reachable(ns_a, "10.77.0.2");
    reachable(ns_a, "fd77::2");
    std::thread::sleep(std::time::Duration::from_millis(300));
    let client = script(dir.path(), "client.py", CLIENT);
    let args = [tcp.to_string(), udp.to_string(), datagrams.to_string(), size.to_string()];
    let out = ns_a.run(&["python3", &client, &args[0], &args[1], &args[2], &args[3]]);
    assert!(out.status.success(), "client: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).lines().map(str::to_string).collect()
}

#[test]
fn many_flows_cross_two_workers_intact_and_each_stays_on_one() {
    if !privileged() {
        return;
    }
    let (d, ns_a, ns_b) = two_namespaces("2", "");
    let status = data_plane(&d);
    assert!(status.ends_with("workers 2 of 2"), "{status}");

    let lines = run_flows(&ns_a, &ns_b, 64, 16, 200, 200_000);
    let tcp_ok = lines.iter().filter(|l| *l == "tcp ok").count();
    assert_eq!(tcp_ok, 64, "every TCP connection's bytes arrived intact: {lines:?}");
    let udp: Vec<&String> = lines.iter().filter(|l| l.starts_with("udp ")).collect();
    assert_eq!(udp.len(), 16, "{lines:?}");
    assert!(udp.iter().all(|l| *l == "udp 200"), "every datagram of every UDP flow came back: {udp:?}");

    // Each flow is in the table once, on one worker: had its frames been classified on both workers, its tuple
    // would be there twice, once per worker. Both directions met there.
    let tuples = d.answer::<Get>(&["get", "flow.*.tuple"]);
    let workers = u64s(&d, "flow.*.worker");
    let (up, down) = (u64s(&d, "flow.*.packets_up_total"), u64s(&d, "flow.*.packets_down_total"));
    let mut seen = BTreeSet::new();
    let mut on = [0usize; 2];
    let mut transport = 0;
    for (name, v) in &tuples {
        let tuple = serde_json::to_value(&v.value).unwrap().as_str().unwrap().to_string();
        assert!(seen.insert(tuple.clone()), "flow {tuple} is in the table twice");
        let id = name.trim_end_matches(".tuple");
        let worker = workers[&format!("{id}.worker")] as usize;
        on[worker] += 1;
        if tuple.starts_with("tcp") && tuple.contains(":7000") || tuple.starts_with("udp") && tuple.contains(":7001") {
            transport += 1;
            assert!(up[&format!("{id}.packets_up_total")] > 0, "{tuple}: answers met it on worker {worker}");
            assert!(down[&format!("{id}.packets_down_total")] > 0, "{tuple}");
        }
    }
    assert!(transport >= 80, "64 TCP and 16 UDP flows in the table: {transport}");
    assert!(on[0] > 0 && on[1] > 0, "flows on both workers: {on:?}");

    // Both workers ran frames; handoffs are counted on the faces and the workers alike; none was dropped.
    let frames = u64s(&d, "worker.*.frames_total");
    assert!(frames["worker.0.frames_total"] > 0 && frames["worker.1.frames_total"] > 0, "{frames:?}");
    let handed = sum(&d, "worker.*.handoff_out_total");
    assert_eq!(handed, d.get_u64("module.a.handoff_total") + d.get_u64("module.b.handoff_total"));
    assert_eq!(handed, sum(&d, "worker.*.handoff_in_total"), "every frame handed over was taken");
    // The devices' steering program put every frame on the queue of the worker that owns its flow, from the
    // first packet of a flow on: of some 18,000 frames, only the few the kernel queued before a device's second
    // queue opened (as its link came up) were handed over (the kernel's own flow table, without the program,
    // handed over 76).
    assert!(handed <= HANDED_AT_MOST, "{handed} frames read by a worker that does not own their flow");
    assert_eq!(sum(&d, "worker.*.drop_stale_total"), 0);
    assert_eq!(
        sum(&d, "worker.*.drop_handoff_total"),
        d.get_u64("module.a.drop_handoff_total") + d.get_u64("module.b.drop_handoff_total")
    );
    // A module's meter is the sum over the workers: the classifier saw every frame the faces read.
    let read = d.get_u64("module.a.rx_packets_total") + d.get_u64("module.b.rx_packets_total");
    assert_eq!(d.get_u64("module.cls.frames_in_total") + sum(&d, "worker.*.drop_handoff_total"), read);

    eprintln!("flows per worker {on:?}, frames per worker {frames:?}, handed over {handed}");
    let rows = d.answer::<ShowRuntime>(&["show", "runtime"]);
    let worker_rows: Vec<_> = rows.iter().filter(|r| r.kind == "worker").collect();
    assert_eq!(worker_rows.len(), 2, "{rows:?}");
    assert!(worker_rows.iter().all(|r| r.frames > 0 && r.busy_ns > 0 && r.calls > 0), "{worker_rows:?}");
}

#[test]
fn edits_under_traffic_on_two_workers_lose_or_duplicate_no_frame() {
    if !privileged() {
        return;
    }
    let (d, ns_a, ns_b) = two_namespaces("2", "[modules.extra]\nkind = \"counter\"\n");
    let dir = tempfile::tempdir().unwrap();
    let payload: Vec<u8> = (0..30_000_000u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8).collect();
    std::fs::write(dir.path().join("blob.bin"), &payload).unwrap();
    let _server = ns_b.serve_http("::", dir.path());
    reachable(&ns_a, "10.77.0.2");
    std::thread::sleep(std::time::Duration::from_millis(500));

    // Edits while 8 downloads run: the direction splitter replaced (its state kept), a counter put into the path
    // and taken out of it again, a knob written.
    let got: Vec<_> = (0..8).map(|i| dir.path().join(format!("got{i}"))).collect();
    let downloads: Vec<_> = got
        .iter()
        .map(|g| {
            std::process::Command::new("ip")
                .args(["netns", "exec", &ns_a.name, "curl", "-sf", "--max-time", "60", "-o"])
                .arg(g)
                .arg("http://10.77.0.2:8080/blob.bin")
                .spawn()
                .unwrap()
        })
        .collect();
    let mut edits = 0;
    let start = std::time::Instant::now();
    while start.elapsed() < std::time::Duration::from_secs(3) {
        d.ok(&["module", "replace", "dir", "direction"]);
        d.ok(&["link", "del", "cls[tcp] -> dir"]);
        d.ok(&["link", "add", "extra -> dir"]);
        d.ok(&["link", "add", "cls[tcp] -> extra"]);
        d.ok(&["link", "del", "cls[tcp] -> extra"]);
        d.ok(&["link", "del", "extra -> dir"]);
        d.ok(&["link", "add", "cls[tcp] -> dir"]);
        edits += 6;
    }
    for mut c in downloads {
        assert!(c.wait().unwrap().success(), "a download under edits");
    }
    for g in &got {
        assert!(std::fs::read(g).unwrap() == payload, "the downloaded file is identical");
    }
    assert!(edits >= 10, "{edits} edits");
    // Every frame read from one face was written to the other, once: none lost in the graph, in a ring or in an
    // edit, none twice. (Between the `link del` and `link add` above, TCP frames have no path and are dropped as
    // the linking table asks: counted on cls's port.)
    let dropped_by_linking = d.get_u64("module.cls.port.tcp.frames_dropped_total");
    let read = d.get_u64("module.a.rx_packets_total") + d.get_u64("module.b.rx_packets_total");
    let written = d.get_u64("module.a.tx_packets_total") + d.get_u64("module.b.tx_packets_total");
    let full = d.get_u64("module.a.drop_queue_full_total") + d.get_u64("module.b.drop_queue_full_total");
    assert_eq!(
        read,
        written + full + dropped_by_linking,
        "read {read}, written {written}, full {full}, unlinked {dropped_by_linking}"
    );
    assert_eq!(sum(&d, "worker.*.drop_stale_total"), 0);
    assert_eq!(sum(&d, "worker.*.drop_handoff_total"), 0);
    // Both workers carried the downloads (each reading its own queues: the steering program sends a flow's
    // frames to its owner, so next to none is handed over).
    let frames = u64s(&d, "worker.*.frames_total");
    assert!(frames.values().all(|&n| n > 0), "{frames:?}");
    let handed = sum(&d, "worker.*.handoff_out_total");
    assert!(handed <= HANDED_AT_MOST, "{handed} frames read by a worker that does not own their flow");
}

#[test]
fn a_module_with_a_global_view_keeps_the_stack_on_one_worker_until_it_is_emptied() {
    if !privileged() {
        return;
    }
    let (d, ns_a, _ns_b) = two_namespaces("2", "");
    assert_eq!(d.get_u64("worker.1.active"), 1);
    d.ok(&["module", "load", "e", "emulator"]);
    let status = data_plane(&d);
    assert!(status.ends_with("workers 1 of 2: module e (emulator) needs a global view"), "{status}");
    assert_eq!(d.get_u64("worker.1.active"), 0);
    // Worker 0 alone carries the traffic now.
    let before = d.get_u64("worker.1.frames_total");
    reachable(&ns_a, "10.77.0.2");
    let out = ns_a.run(&["ping", "-c", "20", "-i", "0.01", "-W", "2", "10.77.0.2"]);
    assert!(out.status.success());
    assert_eq!(d.get_u64("worker.1.frames_total"), before);
    // Unloading it leaves the stack on one worker (until the stack is empty); an empty stack is on both again.
    d.ok(&["module", "unload", "e"]);
    assert!(data_plane(&d).contains("1 of 2"));
    for m in ["dir", "cls", "b", "a"] {
        d.ok(&["module", "unload", m]);
    }
    let status = data_plane(&d);
    assert!(status.ends_with("workers 2 of 2"), "{status}");
}

#[test]
fn one_worker_runs_as_before() {
    if !privileged() {
        return;
    }
    let (d, ns_a, _ns_b) = two_namespaces("1", "");
    let status = data_plane(&d);
    assert!(!status.contains("workers"), "{status}");
    reachable(&ns_a, "10.77.0.2");
    assert_eq!(d.get("flow.1.worker"), 0, "flows are numbered 1, 2, ... as before");
    assert!(d.answer::<ShowRuntime>(&["show", "runtime"]).iter().all(|r| r.kind != "worker"));
    assert_eq!(d.get_u64("module.a.handoff_total"), 0);
}

#[test]
fn link_faces_spread_their_frames_over_two_workers_with_packet_fanout() {
    if !privileged() {
        return;
    }
    // Two veth pairs: flexstack bridges the ends left in this namespace (`packet` faces, a socket per worker in a
    // fanout group); the other ends are the two namespaces' interfaces.
    let (ns_a, ns_b) = (Netns::new("fa"), Netns::new("fb"));
    let (o1, p1, o2, p2) = (unique("o"), unique("p"), unique("o"), unique("p"));
    sh("ip", &["link", "add", &o1, "type", "veth", "peer", "name", &p1]);
    let _l1 = LinkGuard(o1.clone());
    sh("ip", &["link", "add", &o2, "type", "veth", "peer", "name", &p2]);
    let _l2 = LinkGuard(o2.clone());
    ns_a.adopt(&p1, &["10.77.0.1/24", "fd77::1/64"]);
    ns_b.adopt(&p2, &["10.77.0.2/24", "fd77::2/64"]);
    for o in [&o1, &o2] {
        sh("ip", &["link", "set", o, "up"]);
    }
    let stack = format!(
        "links = [\"l1 -> l2\", \"l2 -> l1\"]\n[modules.l1]\nkind = \"packet\"\ninterface = \"{o1}\"\ntake_over = false\n\
         [modules.l2]\nkind = \"packet\"\ninterface = \"{o2}\"\ntake_over = false\n"
    );
    let d = Daemon::start(&stack, &["--workers", "2"]);
    assert!(data_plane(&d).ends_with("workers 2 of 2"));

    let lines = run_flows(&ns_a, &ns_b, 32, 8, 100, 100_000);
    assert_eq!(lines.iter().filter(|l| *l == "tcp ok").count(), 32, "{lines:?}");
    assert!(lines.iter().filter(|l| l.starts_with("udp ")).all(|l| l == "udp 100"), "{lines:?}");
    let frames = u64s(&d, "worker.*.frames_total");
    assert!(frames.values().all(|&n| n > 0), "the fanout gave both workers frames: {frames:?}");
    let read = d.get_u64("module.l1.rx_packets_total") + d.get_u64("module.l2.rx_packets_total");
    let handed = d.get_u64("module.l1.handoff_total") + d.get_u64("module.l2.handoff_total");
    assert_eq!(handed, sum(&d, "worker.*.handoff_in_total"));
    eprintln!("link faces: frames per worker {frames:?}, read {read}, handed over {handed}");
}
