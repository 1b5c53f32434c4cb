//! Benchmark of `classify`'s own per-packet cost against the number of flows in its table (issue 16: "per-packet
//! cost with 100,000 flows in the flow table within 20 % of 10 flows").
//!
//! Run: `cargo bench --profile ci -p flexstack-modules --bench classify` (`CLASSIFY_BENCH_FLOWS="10 100000"` and
//! `CLASSIFY_BENCH_BATCHES="1 4 32"` choose the configurations).
//!
//! What is measured: a classifier (`max_flows` = 262,144) driven directly, on one thread, with 64-byte UDP/IPv4
//! datagrams of N flows taken in turn (source ports 1024-65023 of consecutive source addresses, as
//! `bench/udp_flows.c` sends them), B datagrams per `process` call. Every flow is sent once before the measured rounds
//! (the table holds N flows), and the rounds send each flow's datagrams again (lookups, accounting, no new flows).
//! Copying the datagrams into pool buffers and dropping them after the call is included, the same for every N.
//! Unlike `scripts/bench-flowscale.sh` (the daemon's CPU time per datagram delivered), this leaves out the faces'
//! system calls, the kernel's work on them, how many datagrams a wake-up finds and how many the TUN face coalesces
//! into one write: what is left is the flow table's cost, which is what grows with N.
//!
//! The figure is ns per packet, the median over rounds that interleave the configurations, from the thread's CPU
//! time (`/proc/thread-self/schedstat`, so the time the thread waited for a core on a shared machine is left out)
//! and from the wall clock; the ratio is cost(N) / cost(first N) at the same B.
//!
//! `CLASSIFY_BENCH_POLLUTE_MB=M` writes a line of every 64 bytes of an M MiB buffer before each call, as other work
//! between the daemon's wake-ups would evict the caches; then only the calls are timed (wall clock, both columns).

use flexstack_core::frame::{Batch, PacketPool};
use flexstack_core::module::{Module, Output};
use flexstack_core::vars::ModuleVars;
use flexstack_core::{Catalog, Frame, MetaKey, StackSpec, Time};
use flexstack_wire::packet::{build, proto};
use std::net::Ipv4Addr;
use std::time::Instant;

const ROUNDS: usize = 7;
/// Packets per round and configuration.
const PACKETS: usize = 400_000;
/// Flows of one source address (ports 1024..65024).
const PORTS: usize = 64_000;

/// A classifier with N flows in its table, and the datagrams it is sent.
struct Bench {
    module: Box<dyn Module>,
    pool: PacketPool,
    /// One datagram per source address (its ports rewritten per flow; UDP checksum 0: none).
    templates: Vec<Vec<u8>>,
    flows: usize,
    next: usize,
    batch: usize,
    input: Batch,
    ports: Vec<Batch>,
    now: Time,
    _vars: ModuleVars,
    /// Written before each measured call (`CLASSIFY_BENCH_POLLUTE_MB`); empty: none.
    pollute: Vec<u8>,
}

impl Bench {
    fn new(flows: usize, batch: usize) -> Bench {
        let mut catalog = Catalog::new();
        flexstack_modules::register(&mut catalog);
        let spec =
            StackSpec::parse("bench.toml", "[modules.c]\nkind = \"classify\"\nmax_flows = 262144\n").expect("stack");
        let m = &spec.modules[0];
        let builder = catalog.configure(&m.kind, &m.settings, None).expect("classify configures");
        let vars = ModuleVars::new(&builder.interface().vars);
        let module = builder.build(&vars);
        let dst = Ipv4Addr::new(10, 217, 1, 0);
        let templates = (0..flows.div_ceil(PORTS))
            .map(|i| {
                let src = Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 217, 0, 1)) + i as u32);
                let mut udp = build::udp(src.into(), dst.into(), 40_000, 9, &[0x66; 36]);
                udp[6..8].copy_from_slice(&[0, 0]);
                build::ipv4(src, dst, proto::UDP, 64, &udp)
            })
            .collect();
        let mut b = Bench {
            module,
            pool: PacketPool::default(),
            templates,
            flows,
            next: 0,
            batch,
            input: Vec::with_capacity(batch),
            ports: (0..4).map(|_| Vec::with_capacity(batch)).collect(),
            now: Time(1),
            _vars: vars,
            pollute: pollution(list("CLASSIFY_BENCH_POLLUTE_MB", &[0])[0] << 20),
        };
        let mut sent = 0;
        while sent < flows {
            let n = batch.min(flows - sent);
            b.call(n);
            sent += n;
        }
        b.next = 0;
        b
    }

    /// One `process` call with the next `n` datagrams; checks that each left with a flow id.
    fn call(&mut self, n: usize) {
        for _ in 0..n {
            let f = self.next;
            self.next = (self.next + 1) % self.flows;
            let mut p = self.pool.alloc_from(&self.templates[f / PORTS]);
            let port = (1024 + f % PORTS) as u16;
            p.data_mut()[20..22].copy_from_slice(&port.to_be_bytes());
            self.input.push(Frame::Data(p));
        }
        self.now = Time(self.now.0 + 1_000);
        let (mut control, mut serial) = (Vec::new(), 0);
        let mut out = Output::detached(self.now, "c", &self.pool, &mut self.ports, &mut control, &mut serial);
        self.module.process(0, &mut self.input, &mut out);
        let udp = &mut self.ports[flexstack_modules::flow::classify::OUT_UDP];
        assert_eq!(udp.len(), n, "every datagram leaves on the udp port");
        assert!(
            udp.iter().all(|f| matches!(f, Frame::Data(p) if p.meta().get(MetaKey::FLOW_ID).is_some())),
            "every datagram has a flow"
        );
        udp.clear();
    }

    /// One round: CPU and wall ns per packet.
    fn round(&mut self) -> (f64, f64) {
        if !self.pollute.is_empty() {
            let mut ns = 0;
            for i in 0..PACKETS / self.batch {
                for line in self.pollute.chunks_mut(64) {
                    line[0] = line[0].wrapping_add(i as u8);
                }
                std::hint::black_box(&mut self.pollute);
                let t = Instant::now();
                self.call(self.batch);
                ns += t.elapsed().as_nanos();
            }
            let per = ns as f64 / (PACKETS / self.batch * self.batch) as f64;
            return (per, per);
        }
        let (cpu0, wall0) = (cpu_ns(), Instant::now());
        for _ in 0..PACKETS / self.batch {
            self.call(self.batch);
        }
        let packets = (PACKETS / self.batch * self.batch) as f64;
        ((cpu_ns() - cpu0) as f64 / packets, wall0.elapsed().as_nanos() as f64 / packets)
    }
}

/// This thread's CPU time, ns.
fn cpu_ns() -> u64 {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .expect("/proc/thread-self/schedstat")
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn list(var: &str, default: &[usize]) -> Vec<usize> {
    std::env::var(var)
        .map_or_else(|_| default.to_vec(), |s| s.split_whitespace().map(|x| x.parse().expect("a number")).collect())
}

fn main() {
    if std::env::args().any(|a| a == "--list" || a == "--test") {
        return; // `cargo test --benches` runs benches with --test: nothing to check quickly here
    }
    let flows = list("CLASSIFY_BENCH_FLOWS", &[10, 1_000, 100_000]);
    let batches = list("CLASSIFY_BENCH_BATCHES", &[1, 4, 32]);
    let mut benches: Vec<(usize, usize, Bench)> = batches
        .iter()
        .flat_map(|&b| flows.iter().map(move |&f| (b, f)))
        .map(|(b, f)| (b, f, Bench::new(f, b)))
        .collect();
    let mut figures: Vec<(Vec<f64>, Vec<f64>)> = vec![(Vec::new(), Vec::new()); benches.len()];
    for round in 0..ROUNDS {
        eprintln!("classify bench: round {}/{ROUNDS}", round + 1);
        for (i, (_, _, b)) in benches.iter_mut().enumerate() {
            let (cpu, wall) = b.round();
            figures[i].0.push(cpu);
            figures[i].1.push(wall);
        }
    }
    println!("classify, 64-byte UDP/IPv4, {PACKETS} packets a round, medians of {ROUNDS} rounds (ns per packet)");
    println!("{:>6} {:>8} {:>8} {:>8} {:>8} {:>8}", "batch", "flows", "cpu ns", "x first", "wall ns", "x first");
    let mut first = (0.0, 0.0);
    for (i, (b, f, _)) in benches.iter().enumerate() {
        let (cpu, wall) = (median(figures[i].0.clone()), median(figures[i].1.clone()));
        if *f == flows[0] {
            first = (cpu, wall);
        }
        println!("{b:>6} {f:>8} {cpu:>8.0} {:>8.2} {wall:>8.0} {:>8.2}", cpu / first.0, wall / first.1);
    }
}

/// The buffer written between calls (`CLASSIFY_BENCH_POLLUTE_MB`), in 4 KiB pages (never transparent huge pages), so
/// that writing it evicts TLB entries as well as cache lines, as other work between wake-ups would.
fn pollution(bytes: usize) -> Vec<u8> {
    let v = vec![0; bytes];
    if bytes > 0 {
        flexstack_sys::advise_huge_pages(&v, false).expect("madvise(MADV_NOHUGEPAGE)");
    }
    v
}
