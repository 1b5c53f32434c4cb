//! Benchmark of the runtime variables with many flows (issue 13): 10,000 flows, each registering the 24 runtime
//! variables a terminated TCP connection has (two endpoints of 12), then what a reader pays: `snapshot()` (the
//! OpenMetrics scrape, `flow list`, the rules thread and the flow-meter poller each take one), a snapshot plus a read of
//! every value (a scrape's walk), a lookup by name, and the cost of registering and unregistering one flow.
//!
//! Run: `cargo bench -p flexstack-core --bench registry` (FLOWS=N to change the number of flows). Figures are the
//! medians of 9 rounds, wall clock, one thread.

use flexstack_core::vars::{DynamicVars, SharedRegistry, VarSpec, VarSpecs};
use flexstack_core::ValueType;
use std::time::{Duration, Instant};

/// The 12 variables of one endpoint's TCP flow (as `terminate`/`originate` declare them).
fn flow_specs() -> Vec<VarSpec> {
    let mut v =
        vec![VarSpec::meter("tuple", ValueType::Str, "", "protocol, the app's side and the original destination")];
    for name in ["bytes_down_total", "bytes_up_total", "in_flight_bytes", "queued_bytes"] {
        v.push(VarSpec::meter(name, ValueType::U64, "bytes", "stream bytes of the flow, one direction or state"));
    }
    v.push(VarSpec::meter("tcp.state", ValueType::Str, "", "TCP state of the endpoint's socket (established ...)"));
    for name in ["tcp.srtt_us", "tcp.bytes_in_flight", "tcp.retrans_total", "tcp.send_queue", "tcp.recv_queue"] {
        v.push(VarSpec::meter(name, ValueType::U64, "bytes", "a transport meter of the endpoint's socket"));
    }
    v.push(VarSpec::knob("tcp.cc", ValueType::Str, "", "congestion control of this connection: none, reno or cubic"));
    v
}

/// This process's resident memory, KiB.
fn rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap_or("VmRSS: 0 kB");
    line.split_whitespace().nth(1).and_then(|v| v.parse().ok()).unwrap_or(0)
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn main() {
    let flows: usize = std::env::var("FLOWS").ok().and_then(|s| s.parse().ok()).unwrap_or(10_000);
    let shared = SharedRegistry::default();
    let mut dynamic = DynamicVars::new(shared.clone());
    // Declared once and shared by every flow, as the endpoints do.
    let specs = VarSpecs::from(flow_specs());
    let mut keep = Vec::new();
    let rss0 = rss_kib();
    let start = Instant::now();
    for id in 0..flows {
        for side in ["term", "orig"] {
            keep.push(dynamic.register("m", &format!("flow.app.{side}.{id}"), &specs).expect("registers"));
        }
    }
    let register_all = start.elapsed();
    let rss = rss_kib().saturating_sub(rss0);
    let vars = shared.snapshot().len();
    assert_eq!(vars, flows * 2 * specs.len(), "every variable is in the snapshot");
    let (mut snap, mut walk, mut get, mut churn) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for _ in 0..9 {
        let t = Instant::now();
        let s = shared.snapshot();
        snap.push(t.elapsed());
        let t = Instant::now();
        let mut sum = 0u64;
        let mut n = 0usize;
        for (name, cell) in shared.snapshot().iter() {
            sum = sum.wrapping_add(name.len() as u64);
            if let Some(x) = cell.get().as_f64() {
                sum = sum.wrapping_add(x as u64);
            }
            n += 1;
        }
        walk.push(t.elapsed());
        assert_eq!(n, vars);
        std::hint::black_box(sum);
        let t = Instant::now();
        for id in (0..flows).step_by((flows / 1000).max(1)) {
            assert!(s.get(&format!("flow.app.term.{id}.tcp.srtt_us")).is_some());
        }
        get.push(t.elapsed() / 1000);
        let t = Instant::now();
        for i in 0..1000 {
            let prefix = format!("flow.app.x.{i}");
            let v = dynamic.register("m", &prefix, &specs).expect("registers");
            std::hint::black_box(v);
            dynamic.unregister("m", &prefix);
        }
        churn.push(t.elapsed() / 1000);
    }
    println!("registry, {flows} flows x 2 endpoints x {} variables = {vars} variables", specs.len());
    println!("  register all:                 {:>10.1} ms", register_all.as_secs_f64() * 1e3);
    println!(
        "  memory:                       {:>10.0} bytes per flow (both endpoints; RSS growth)",
        rss as f64 * 1024.0 / flows as f64
    );
    println!("  snapshot():                   {:>10.3} ms (median of 9)", median(snap).as_secs_f64() * 1e3);
    println!("  snapshot() + read every value: {:>9.3} ms", median(walk).as_secs_f64() * 1e3);
    println!("  get(name) on a snapshot:      {:>10.3} us", median(get).as_secs_f64() * 1e6);
    println!("  register + unregister a flow: {:>10.3} us", median(churn).as_secs_f64() * 1e6);
    drop(keep);
}
