//! Benchmark of the late-binding scheduler's per-packet cost against the number of flows queued (issue 5:
//! "10,000 concurrent flows queued without the per-packet cost growing by more than 20 %").
//!
//! Run: `cargo bench -p flexstack-modules --bench binding`.
//!
//! What is measured, for N = 1, 100 and 10,000 flows, as nanoseconds per packet (wall clock, one thread): a
//! `late-binding` module with one interface (10 Gbit/s modelled) is driven directly with a simulated clock, in
//! the two ways below. First every flow gets its backlog of 1000-byte packets (flow ids 1..=N in
//! [`MetaKey::FLOW_ID`], so N flows wait above the binding point). Then each step advances the clock by B
//! packets' transmission time (800 ns each) and polls the module once (the modelled transmissions that ended
//! leave the device queue, the scheduler picks the next packets by class and deficit round robin and binds them,
//! rewriting their source addresses with incremental checksums, and emits those whose transmission starts), then
//! hands it B new packets, of the next flows in turn, in ONE `process` call (parse, flow lookup, enqueue), so
//! the backlog stays as it was. The emitted packets are dropped back to the pool. Allocating and filling the
//! packets from the pool is included, the same for every N.
//!
//! - **Batched, B = 32 (the daemon's case; the acceptance figure)**: the data plane (`crates/daemon/src/dataplane.rs`) reads up
//!   to 256 frames per face per wake-up into one batch, and `Switch::run` calls a module's `process` once per
//!   batch and its `poll` once when its wake-up time has come, not per packet. Under load, when a backlog of
//!   10,000 flows builds up, packets arrive in batches, so the module sees many packets per call. The device
//!   queue is B packets here (`max(2, B)`), so that one poll per B packets' time keeps the modelled link busy as
//!   a NIC ring refilled once per wake-up would (the B - 2 packets more it holds are sent first, so that the
//!   same backlog waits above the binding point at every B).
//! - **Unbatched, B = 1 (the bench as it was)**: one poll and one packet per `process` call, one packet's time
//!   apart, device queue 2. This is the module's worst case, every call's fixed work paid by one packet; the
//!   daemon does it only when packets trickle in one per wake-up, which is not when 10,000 flows are queued.
//!
//! Four sets are measured: (a) 40,000 packets queued in all whatever N (40,000 in one flow, 400 in each of 100,
//! 4 in each of 10,000), flows arriving in turn, with a quantum of one packet, which isolates what the number of
//! flows costs; (c) the same with the module's default quantum (1514 bytes for 1000-byte packets: a flow's share
//! is one or two packets a round; the rounds are interleaved, one packet per visit, so the flows still leave in
//! the order they arrived); (d) as (c) with each flow's packets arriving in runs of 4 (as a TCP sender's window
//! comes), so that the flows, served in turn, leave in another order than they arrived and the pool buffers,
//! about 46 MB of them, are visited in a scrambled order; (b) 4 packets per flow, so the backlog (and the memory
//! the queued packets occupy: 40,000 pool buffers at N = 10,000) grows with N, which adds the cache misses of a
//! deep queue to the scheduler's own cost. Each set is read against a reference measured in the same run
//! (`Bare`): the same packets, arriving the same way, through per-flow FIFOs served in turn with no scheduler,
//! which shows what the order of the packets costs the memory system by itself. Rounds interleave the
//! configurations of a set, both B's (7 rounds of 200,000 packets each); the figure is the median over rounds.
//! The ratio printed is cost(N) / cost(1) at the same B; the target is <= 1.2 at N = 10,000. Besides wall-clock
//! time, each round's CPU time of the bench's thread is read (`/proc/thread-self/schedstat`, where the kernel has
//! it): on a shared machine the wall clock also counts the time the thread waited for a core, CPU time does not
//! (caches shared with others still show in both). The kernel updates that figure at its scheduler ticks (4 ms at
//! HZ=250), so a round of 200,000 packets at 200 ns is read to within about 10 % (figures come in steps of 20 ns
//! per packet there): a check on the wall clock, not a finer measure. After the run the bench checks that every
//! packet it sent was emitted or is still queued, and that none was dropped.
//!
//! `BINDING_BENCH_BATCH=B` sets the batched mode's B (default 32).

use flexstack_core::frame::{Batch, PacketPool};
use flexstack_core::module::{Module, Output};
use flexstack_core::vars::ModuleVars;
use flexstack_core::{Catalog, Frame, MetaKey, Packet, StackSpec, Time};
use flexstack_modules::sched::binding;
use flexstack_wire::packet::{build, proto};
use std::collections::VecDeque;
use std::hint::black_box;
use std::net::Ipv4Addr;
use std::time::Instant;

const FLOWS: [usize; 3] = [1, 100, 10_000];
/// Packets queued per flow in the second set; the first set queues TOTAL packets whatever the number of flows.
const BACKLOG: usize = 4;
/// Set (d): packets a flow sends in a row before the next flow's.
const RUN: usize = 4;
const TOTAL: usize = 40_000;
const ROUNDS: usize = 7;
/// Packets per round (STEPS / B steps of B packets).
const STEPS: usize = 200_000;
const SIZE: usize = 1000;
/// 10 Gbit/s: 1000 bytes take 800 ns.
const TX_NS: u64 = 800;
const TARGET_RATIO: f64 = 1.2;
/// The module's default DRR quantum (bytes).
const DEFAULT_QUANTUM: usize = 1514;
/// Packets per `process` call in the batched mode, unless `BINDING_BENCH_BATCH` says otherwise.
const DEFAULT_BATCH: usize = 32;
/// The device queue of the unbatched mode (the module's default).
const DEVICE_QUEUE: usize = 2;

/// The packets a configuration is sent: copies of one 1000-byte UDP/IPv4 packet in pool buffers, of flows 1..=N
/// taken in turn, `run` packets of a flow in a row.
struct Arrivals {
    pool: PacketPool,
    packet: Vec<u8>,
    flows: usize,
    /// Packets each flow sends in a row before the next flow's (1: flows take turns packet by packet).
    run: usize,
    next_flow: usize,
    /// Packets of the current run sent so far.
    in_run: usize,
}

impl Arrivals {
    fn new(flows: usize, run: usize) -> Arrivals {
        let (app, remote) = (Ipv4Addr::new(10, 77, 0, 2), Ipv4Addr::new(198, 51, 100, 7));
        let udp = build::udp(app.into(), remote.into(), 5000, 9000, &[0u8; SIZE - 28]);
        let packet = build::ipv4(app, remote, proto::UDP, 64, &udp);
        Arrivals { pool: PacketPool::default(), packet, flows, run, next_flow: 0, in_run: 0 }
    }

    /// The next packet, its flow id in [`MetaKey::FLOW_ID`], and its flow's index (the id less one).
    fn next(&mut self) -> (Packet, usize) {
        let flow = self.next_flow;
        let mut p = self.pool.alloc_from(&self.packet);
        p.meta_mut().set(MetaKey::FLOW_ID, 1 + flow as u64);
        self.in_run += 1;
        if self.in_run == self.run {
            self.in_run = 0;
            self.next_flow = (self.next_flow + 1) % self.flows;
        }
        (p, flow)
    }
}

/// One scheduler under test, with its clock and counts.
struct Bench {
    module: Box<dyn Module>,
    arrivals: Arrivals,
    ports: Vec<Batch>,
    input: Batch,
    now: Time,
    /// Packets per `process` call (and per poll).
    batch: usize,
    /// The modelled device queue: `max(DEVICE_QUEUE, batch)`.
    device_queue: usize,
    sent: u64,
    emitted: u64,
    dropped: u64,
    vars: ModuleVars,
}

impl Bench {
    fn new(flows: usize, backlog: usize, quantum: usize, batch: usize, run: usize) -> Bench {
        let mut catalog = Catalog::new();
        flexstack_modules::register(&mut catalog);
        let device_queue = DEVICE_QUEUE.max(batch);
        let text = r#"
[modules.lb]
kind = "late-binding"
interfaces = ["a"]
queue_limit = 1000000
"a.rate_mbit" = 10000
"a.device_queue" = DEVICE_QUEUE
"a.address_v4" = "192.0.2.10"
quantum = QUANTUM
"#;
        let text = text.replace("QUANTUM", &quantum.to_string()).replace("DEVICE_QUEUE", &device_queue.to_string());
        let spec = StackSpec::parse("bench.toml", &text).expect("bench stack");
        let m = &spec.modules[0];
        let builder = catalog.configure(&m.kind, &m.settings, None).expect("late-binding configures");
        let vars = ModuleVars::new(&builder.interface().vars);
        let module = builder.build(&vars);
        let mut b = Bench {
            module,
            arrivals: Arrivals::new(flows, run),
            ports: vec![Vec::with_capacity(64.max(batch)), Vec::with_capacity(64)],
            input: Vec::with_capacity(batch),
            now: Time(1),
            batch,
            device_queue,
            sent: 0,
            emitted: 0,
            dropped: 0,
            vars,
        };
        for _ in 0..backlog {
            for _ in 0..flows {
                b.send(1);
            }
        }
        // A device queue longer than the default holds packets of the backlog: as many more are sent, so that the
        // same backlog waits above the binding point at every B.
        for _ in DEVICE_QUEUE..device_queue {
            b.send(1);
        }
        b
    }

    /// Hands `n` packets, of the next `n` flows in turn, to the module in one `process` call at the current time.
    fn send(&mut self, n: usize) {
        for _ in 0..n {
            self.input.push(Frame::Data(self.arrivals.next().0));
        }
        let mut control = Vec::new();
        let mut serial = 0;
        let mut out = Output::detached(self.now, "lb", &self.arrivals.pool, &mut self.ports, &mut control, &mut serial);
        self.module.process(0, &mut self.input, &mut out);
        self.dropped += out.dropped();
        self.sent += n as u64;
        self.emitted += self.ports[0].len() as u64;
        self.ports[0].clear();
    }

    /// One step: `batch` transmissions end (one poll), then `batch` packets arrive (one `process` call).
    fn step(&mut self) {
        self.now = Time(self.now.0 + TX_NS * self.batch as u64);
        let mut control = Vec::new();
        let mut serial = 0;
        let mut out = Output::detached(self.now, "lb", &self.arrivals.pool, &mut self.ports, &mut control, &mut serial);
        black_box(self.module.poll(&mut out));
        self.dropped += out.dropped();
        self.emitted += self.ports[0].len() as u64;
        self.ports[0].clear();
        self.send(self.batch);
    }

    fn queued(&self) -> u64 {
        match self.vars.cell("queued").map(|c| c.get()) {
            Some(flexstack_core::Value::U64(q)) => q,
            other => panic!("queued is {other:?}"),
        }
    }
}

/// What [`measure`] drives: a configuration that takes `batch` packets per step.
trait Subject {
    fn step(&mut self);
    fn batch(&self) -> usize;
    fn flows(&self) -> usize;
    /// Packets waiting (the last column of the table).
    fn queued(&self) -> u64;
    /// Panics unless every packet sent was handed on or is still held, none dropped.
    fn check(&self);
}

impl Subject for Bench {
    fn step(&mut self) {
        Bench::step(self);
    }
    fn batch(&self) -> usize {
        self.batch
    }
    fn flows(&self) -> usize {
        self.arrivals.flows
    }
    fn queued(&self) -> u64 {
        Bench::queued(self)
    }
    fn check(&self) {
        assert_eq!(self.dropped, 0, "no packet dropped");
        // Of the packets in the device queue, all but the one in (modelled) transmission are not yet emitted.
        assert_eq!(
            self.sent,
            self.emitted + self.queued() + self.device_queue as u64 - 1,
            "every packet emitted or queued"
        );
    }
}

/// The reference each set is read against, measured in the same run: the same packets, arriving the same way,
/// through no scheduler at all. Each flow has a FIFO (`VecDeque`); the flows are served one packet each in turn
/// (the order any fair scheduler gives backlogged flows of equal packets); each packet gets what binding writes
/// (its source address, `OUT_FACE`) and is dropped back to the pool, with the next packet's slot and bytes
/// prefetched one packet ahead as the scheduler does. What it costs more at N flows than at 1 is what visiting
/// the queued packets in that order costs the memory system, whatever the scheduler.
struct Bare {
    arrivals: Arrivals,
    queues: Vec<VecDeque<Packet>>,
    /// The flow served next.
    turn: usize,
    batch: usize,
    sent: u64,
    served: u64,
}

impl Bare {
    fn new(flows: usize, backlog: usize, batch: usize, run: usize) -> Bare {
        let mut b = Bare {
            arrivals: Arrivals::new(flows, run),
            queues: (0..flows).map(|_| VecDeque::new()).collect(),
            turn: 0,
            batch,
            sent: 0,
            served: 0,
        };
        for _ in 0..backlog * flows {
            b.arrive();
        }
        b
    }

    /// The next packet (as [`Bench::send`] sends them) joins its flow's FIFO.
    fn arrive(&mut self) {
        let (p, flow) = self.arrivals.next();
        self.queues[flow].push_back(p);
        self.sent += 1;
    }

    /// The next flow from `from` on, in turn, with a packet queued.
    fn next_busy(&self, from: usize) -> Option<usize> {
        let n = self.queues.len();
        (0..n).map(|i| (from + i) % n).find(|&k| !self.queues[k].is_empty())
    }
}

impl Subject for Bare {
    fn step(&mut self) {
        let n = self.queues.len();
        // The flow served next, found once: arrivals come after the loop.
        let mut busy = self.next_busy(self.turn);
        for _ in 0..self.batch {
            let Some(k) = busy else { break };
            let Some(mut p) = self.queues[k].pop_front() else { break };
            self.turn = (k + 1) % n;
            busy = self.next_busy(self.turn);
            if let Some(next) = busy.and_then(|j| self.queues[j].front()) {
                let meta = next.meta() as *const _ as usize;
                for at in [meta.wrapping_sub(64), meta, meta + 64] {
                    binding::prefetch(at);
                }
                let data = next.data().as_ptr() as usize;
                for at in (0..next.len()).step_by(64) {
                    binding::prefetch(data + at);
                }
            }
            p.make_mut()[12..16].copy_from_slice(&[192, 0, 2, 10]);
            p.meta_mut().set(MetaKey::OUT_FACE, 0);
            black_box(&p);
            self.served += 1;
        }
        for _ in 0..self.batch {
            self.arrive();
        }
    }
    fn batch(&self) -> usize {
        self.batch
    }
    fn flows(&self) -> usize {
        self.queues.len()
    }
    fn queued(&self) -> u64 {
        self.queues.iter().map(|q| q.len() as u64).sum()
    }
    fn check(&self) {
        assert_eq!(self.sent, self.served + self.queued(), "every packet served or queued");
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// CPU time this thread has run, ns (`/proc/thread-self/schedstat`), if the kernel tells it.
fn thread_cpu_ns() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    text.split_whitespace().next()?.parse().ok()
}

/// The ratios cost(N) / cost(1) at the largest N, wall clock and CPU time (CPU: NaN if unknown), for one B.
#[derive(Clone, Copy)]
struct Ratios {
    wall: f64,
    cpu: f64,
}

/// Runs the rounds over `benches` (every configuration of `batches` x [`FLOWS`], in that order) and prints a
/// table per B; returns, per B, the ratios at the largest N.
fn measure<S: Subject>(title: &str, batches: &[usize], benches: &mut [S]) -> Vec<Ratios> {
    let mut costs: Vec<Vec<f64>> = vec![Vec::new(); benches.len()];
    let mut cpu_costs: Vec<Vec<f64>> = vec![Vec::new(); benches.len()];
    for _ in 0..ROUNDS {
        for (k, b) in benches.iter_mut().enumerate() {
            let steps = STEPS / b.batch();
            let packets = (steps * b.batch()) as f64;
            let cpu_start = thread_cpu_ns();
            let start = Instant::now();
            for _ in 0..steps {
                b.step();
            }
            costs[k].push(start.elapsed().as_nanos() as f64 / packets);
            if let (Some(a), Some(z)) = (cpu_start, thread_cpu_ns()) {
                cpu_costs[k].push(z.saturating_sub(a) as f64 / packets);
            }
        }
    }
    println!("{title}");
    let mut ratios = Vec::new();
    for (g, &batch) in batches.iter().enumerate() {
        let group = g * FLOWS.len()..(g + 1) * FLOWS.len();
        let base = median(costs[group.start].clone());
        let cpu_base = (cpu_costs[group.start].len() == ROUNDS).then(|| median(cpu_costs[group.start].clone()));
        println!(
            "{:>6} {:>8} {:>12} {:>10} {:>12} {:>10} {:>10}",
            "B", "flows", "ns/packet", "ratio", "cpu ns/pkt", "cpu ratio", "queued"
        );
        let mut last = Ratios { wall: f64::NAN, cpu: f64::NAN };
        for k in group {
            let b = &benches[k];
            let c = median(costs[k].clone());
            last.wall = c / base;
            let (cpu, cpu_ratio) = match cpu_base {
                Some(cb) if cpu_costs[k].len() == ROUNDS => {
                    let cpu = median(cpu_costs[k].clone());
                    last.cpu = cpu / cb;
                    (format!("{cpu:.1}"), format!("{:.3}", last.cpu))
                }
                _ => ("-".to_string(), "-".to_string()),
            };
            println!(
                "{:>6} {:>8} {:>12.1} {:>10.3} {:>12} {:>10} {:>10}",
                batch,
                b.flows(),
                c,
                last.wall,
                cpu,
                cpu_ratio,
                b.queued()
            );
        }
        ratios.push(last);
    }
    for b in benches.iter() {
        b.check();
    }
    ratios
}

fn env_usize(name: &str) -> Option<usize> {
    std::env::var(name).ok().and_then(|s| s.parse().ok())
}

/// Profiling aid: `BINDING_BENCH_ONLY=a:10000` (or `b:100`, `c:1`, `d:10000`, ...) runs only that
/// configuration, 3 rounds of `BINDING_BENCH_STEPS` packets (default 200,000), in batches of
/// `BINDING_BENCH_BATCH` (default 32), with the set's quantum (1000 for (a) and (b), the module's default 1514 for
/// (c) and (d)) unless `BINDING_BENCH_QUANTUM` says otherwise, so that `perf record` or
/// `valgrind --tool=callgrind` see one configuration alone.
fn only() -> Option<(char, usize, usize, usize)> {
    let v = std::env::var("BINDING_BENCH_ONLY").ok()?;
    let (set, n) = v.split_once(':')?;
    let set = set.chars().next()?;
    let steps = env_usize("BINDING_BENCH_STEPS").unwrap_or(STEPS);
    let default = if matches!(set, 'c' | 'd') { DEFAULT_QUANTUM } else { SIZE };
    let quantum = env_usize("BINDING_BENCH_QUANTUM").unwrap_or(default);
    Some((set, n.parse().ok()?, steps, quantum))
}

fn main() {
    let batch = env_usize("BINDING_BENCH_BATCH").filter(|&b| b >= 1).unwrap_or(DEFAULT_BATCH);
    if let Some((set, n, packets, quantum)) = only() {
        let run = if set == 'd' { RUN } else { 1 };
        let mut b = Bench::new(n, if set == 'b' { BACKLOG } else { TOTAL / n }, quantum, batch, run);
        let steps = 3 * (packets / batch).max(1);
        let cpu_start = thread_cpu_ns();
        let start = Instant::now();
        for _ in 0..steps {
            b.step();
        }
        let per = |ns: f64| ns / (steps * batch) as f64;
        let cpu = match (cpu_start, thread_cpu_ns()) {
            (Some(a), Some(z)) => format!("{:.1}", per(z.saturating_sub(a) as f64)),
            _ => "-".to_string(),
        };
        println!("{set}:{n} B={batch}: {:.1} ns/packet, cpu {cpu} ns/packet", per(start.elapsed().as_nanos() as f64));
        return;
    }
    let batches = [1, batch];
    println!(
        "late-binding scheduler: ns per packet (enqueue + select + bind + emit), median of {ROUNDS} rounds; \
         B = packets per process call: 1 (unbatched, device queue {DEVICE_QUEUE}) and {batch} (batched, the daemon's \
         case, device queue {})",
        DEVICE_QUEUE.max(batch)
    );
    let configs = |backlog: &dyn Fn(usize) -> usize, quantum: usize, run: usize| -> Vec<Bench> {
        batches
            .iter()
            .flat_map(|&b| FLOWS.iter().map(move |&n| (b, n)))
            .map(|(b, n)| Bench::new(n, backlog(n), quantum, b, run))
            .collect()
    };
    let references = |backlog: &dyn Fn(usize) -> usize, run: usize| -> Vec<Bare> {
        batches
            .iter()
            .flat_map(|&b| FLOWS.iter().map(move |&n| (b, n)))
            .map(|(b, n)| Bare::new(n, backlog(n), b, run))
            .collect()
    };
    let mut same_total = configs(&|n| TOTAL / n, SIZE, 1);
    let a = measure(
        &format!("(a) {TOTAL} packets queued in all, spread over N flows; quantum {SIZE} (served in arrival order)"),
        &batches,
        &mut same_total,
    );
    for b in &same_total {
        assert_eq!(b.queued(), (TOTAL - DEVICE_QUEUE) as u64, "the backlog stayed");
    }
    drop(same_total);
    let mut default_quantum = configs(&|n| TOTAL / n, DEFAULT_QUANTUM, 1);
    let c = measure(
        &format!(
            "(c) as (a) with the default quantum {DEFAULT_QUANTUM} (a flow's share is one or two packets a round)"
        ),
        &batches,
        &mut default_quantum,
    );
    drop(default_quantum);
    let mut bare = references(&|n| TOTAL / n, 1);
    let ref_ac = measure(
        "reference for (a) and (c): the same packets through per-flow FIFOs served in turn, no scheduler",
        &batches,
        &mut bare,
    );
    drop(bare);
    let mut in_runs = configs(&|n| TOTAL / n, DEFAULT_QUANTUM, RUN);
    let d = measure(
        &format!(
            "(d) as (c) with each flow's packets arriving in runs of {RUN} (served in another order than they arrived)"
        ),
        &batches,
        &mut in_runs,
    );
    drop(in_runs);
    let mut bare = references(&|n| TOTAL / n, RUN);
    let ref_d = measure(
        "reference for (d): its packets through per-flow FIFOs served in turn, no scheduler",
        &batches,
        &mut bare,
    );
    drop(bare);
    let mut per_flow = configs(&|_| BACKLOG, SIZE, 1);
    let b =
        measure(&format!("(b) {BACKLOG} packets queued per flow (the backlog grows with N)"), &batches, &mut per_flow);
    drop(per_flow);
    let mut bare = references(&|_| BACKLOG, 1);
    let ref_b = measure(
        "reference for (b): its packets through per-flow FIFOs served in turn, no scheduler",
        &batches,
        &mut bare,
    );
    drop(bare);
    let n = FLOWS[FLOWS.len() - 1];
    let verdict = |r: f64| if r <= TARGET_RATIO { "met" } else { "NOT met" };
    for (g, &batch) in batches.iter().enumerate() {
        let mode = if batch == 1 { "unbatched" } else { "batched, the acceptance figure" };
        println!(
            "B = {batch} ({mode}): cost at {n} flows / cost at 1 flow, wall clock (CPU time); target <= {TARGET_RATIO}"
        );
        let sets = [
            ("(a) same backlog", a[g], ref_ac[g]),
            ("(c) default quantum", c[g], ref_ac[g]),
            ("(d) arriving in runs", d[g], ref_d[g]),
            ("(b) 4 packets per flow", b[g], ref_b[g]),
        ];
        for (name, r, bare) in sets {
            println!(
                "  {name}: {:.3} ({:.3}): {}; reference without a scheduler {:.3} ({:.3})",
                r.wall,
                r.cpu,
                verdict(r.wall),
                bare.wall,
                bare.cpu
            );
        }
    }
}
