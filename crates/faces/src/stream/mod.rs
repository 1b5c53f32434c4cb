//! The `kernel` back-end of the stream endpoints (`terminate`, `originate` with `backend = "kernel"`;
//! docs/streams.md, "The kernel back-end"): the host kernel's TCP does the transport, and the flows' sockets live
//! at the edge like faces, in the data plane's epoll loop.
//!
//! - [`install`] hands the builder to `flexstack_modules::stream::backend` (the daemon's catalog calls it once).
//! - `engine`: what both sides share: flows and their sockets, the stream protocol and its credit, one epoll set.
//! - `kernel_app`: `terminate`'s listener in the app's namespace and the nftables redirect to it, and the server
//!   role's transparent sockets into that namespace.
//! - `kernel_net`: `originate`'s non-blocking sockets towards the original destinations (TCP and UDP), and the
//!   server role's listener in the daemon's namespace with its redirect.
//!
//! The module is a face: its device is the engine's epoll set, which the data plane waits on with the other
//! devices. Frames read from it (every stream frame the endpoint emits) leave on its first output port, `stream`
//! (the back-end's interface lists it first; the ports have the smoltcp back-end's names, so a stack changes back-end
//! by its setting alone). Stream frames arriving on `stream_in` are queued for the device. Packets arriving on `in`
//! carry none of its sockets' flows: they leave on `pass` unchanged, except, for a `terminate` whose match table
//! selects UDP, the app's UDP flows, which the smoltcp back-end's engine terminates in the data plane beside the
//! sockets (UDP has no kernel state to take over; its flows keep ids from 1, the sockets' count from
//! [`KERNEL_IDS`]). The module is
//! polled every [`METER_PERIOD`] while it holds flows: timeouts, and the per-flow meters (registered for new flows,
//! refreshed from `TCP_INFO` and the socket queues, removed for flows that ended).

mod engine;
mod kernel_app;
mod kernel_net;

use engine::{spare_descriptor, AppSide, Engine, Sock};
use flexstack_core::frame::Metadata;
use flexstack_core::{
    Batch, Direction, FaceDevice, Frame, Module, ModuleBuilder, ModuleInterface, ModuleVars, Output, Packet, Time,
    Value, ValueType, VarSpec,
};
use flexstack_modules::stream::backend::{self, Config, KernelRequest, Meters, Ports, Side};
use std::collections::HashMap;
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// The first flow id of a kernel `terminate` that also terminates UDP in the data plane (whose ids count from 1).
pub const KERNEL_IDS: u64 = 1 << 32;

/// An idle flow's meters are read every this many periods (10 s).
const IDLE_PERIODS: u64 = 100;

/// How often the module refreshes its flows' meters and checks their timeouts.
pub const METER_PERIOD: Duration = Duration::from_millis(100);

/// Installs the kernel back-end of `terminate` and `originate` (once per process; later calls change nothing).
pub fn install() {
    backend::install_kernel(build);
}

/// The limit of open files the daemon asks for: a kernel `terminate` and `originate` hold two sockets per
/// connection, so `max_connections` (16,384 in the shipped stacks) needs about 33,000.
const OPEN_FILES: u64 = 1 << 20;

/// Raises the process's limit of open files, once: each terminated connection holds one socket per kernel
/// endpoint, and the usual soft limit (1,024) would stop a kernel `terminate` and `originate` at about 500
/// connections, a hard limit of 20,000 at about 10,000. With CAP_SYS_RESOURCE (the daemon calls this at start-up,
/// before it drops the capabilities it does not keep) both limits go up to 1,048,576 (`OPEN_FILES`) or the kernel's
/// `fs.nr_open`, whichever is lower; without it the soft limit goes up to the hard one. Returns the soft limit in
/// force afterwards.
pub fn raise_open_files_limit() -> u64 {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    static LIMIT: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *LIMIT.get_or_init(|| {
        let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE) else { return 0 };
        let nr_open = std::fs::read_to_string("/proc/sys/fs/nr_open")
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok())
            .unwrap_or(OPEN_FILES);
        let want = OPEN_FILES.min(nr_open);
        if hard < want && setrlimit(Resource::RLIMIT_NOFILE, want, want).is_ok() {
            return want;
        }
        if soft < hard {
            if let Err(e) = setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
                tracing::warn!(error = %e, "cannot raise the limit of open files");
                return soft;
            }
        }
        hard.max(soft)
    })
}

/// Builds the kernel back-end from what the kind read.
fn build(req: KernelRequest) -> Result<Box<dyn ModuleBuilder>, String> {
    let files = raise_open_files_limit();
    let KernelRequest { side, cfg, matcher, netns, host_dev, mut interface, decl, smoltcp } = req;
    // terminate and originate together hold two descriptors per connection. Said once per process: every app's
    // kernel modules would repeat it.
    static WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if files < 2 * cfg.max_connections + 256 && !WARNED.swap(true, std::sync::atomic::Ordering::Relaxed) {
        tracing::warn!(
            limit = files,
            max_connections = cfg.max_connections,
            "the limit of open files allows about {} kernel-terminated connections, fewer than max_connections; \
             beyond, new connections are refused (raise `ulimit -Hn` before starting the daemon)",
            files.saturating_sub(256) / 2
        );
    }
    // The device's frames leave on output 0: put `stream` first.
    if let Some(i) = interface.outputs.iter().position(|p| p.name == "stream") {
        let stream = interface.outputs.remove(i);
        interface.outputs.insert(0, stream);
    }
    // terminate: the UDP flows its match table selects are terminated in the data plane by the smoltcp back-end
    // (which uses no sockets for UDP), with the whole table (the TCP flows it selects are redirected before they
    // reach it) and this back-end's ports.
    let port = |list: &[flexstack_core::PortSpec], name: &str| list.iter().position(|p| p.name == name);
    let ports = Ports {
        ip_in: port(&interface.inputs, "in").unwrap_or(0),
        stream_in: port(&interface.inputs, "stream_in").unwrap_or(1),
        ip_out: port(&interface.outputs, "out").unwrap_or(1),
        stream_out: 0,
        pass: port(&interface.outputs, "pass").unwrap_or(2),
    };
    let udp = (side == Side::App && kernel_app::terminates_udp(&matcher)).then(|| smoltcp(ports));
    // terminate listens for the app's connections (and opens the server role's into its namespace); originate
    // listens for the network's when its table has the server role.
    let (accepting, namespaces) = match side {
        Side::App => {
            let (listeners, redirect) = kernel_app::open(&netns, &matcher, &cfg.app)?;
            (Some((listeners, Vec::new(), redirect)), Some(engine::Namespaces::open(&netns)?))
        }
        Side::Net => (kernel_net::open_server(&host_dev, &matcher, &cfg.app)?, None),
    };
    let app = accepting.map(|(l, u, r)| (l, u, r, AppSide { matcher, hits: Vec::new(), app: cfg.app.clone() }));
    Ok(Box::new(KernelBuilder { side, cfg, interface, decl, app, udp, namespaces }))
}

type Decl = &'static flexstack_core::KindDecl<Config, Meters>;

struct KernelBuilder {
    side: Side,
    cfg: Config,
    interface: ModuleInterface,
    decl: Decl,
    /// The endpoint that accepts: its TCP listeners, UDP sockets (originate's server role), redirect, match table.
    app: Option<(Vec<std::net::TcpListener>, Vec<std::net::UdpSocket>, kernel_app::Redirect, AppSide)>,
    /// terminate with UDP rules: the smoltcp back-end, for them.
    udp: Option<Box<dyn ModuleBuilder>>,
    /// terminate: the app's namespace (the server role's connections are opened there).
    namespaces: Option<engine::Namespaces>,
}

impl ModuleBuilder for KernelBuilder {
    fn interface(&self) -> ModuleInterface {
        self.interface.clone()
    }

    /// Its sockets, listener and redirect are one set (as the smoltcp back-end's endpoints, which declare it):
    /// the stack runs on one data-plane worker.
    fn global_view(&self) -> bool {
        true
    }

    fn build(self: Box<Self>, vars: &ModuleVars) -> Box<dyn Module> {
        let KernelBuilder { side, cfg, interface, decl, app, udp, namespaces } = *self;
        // The smoltcp back-end for UDP binds the same knobs and meters; the gauges it would share are told apart
        // (see `Engine::counts`).
        let inner = udp.map(|b| b.build(vars));
        decl.publish(&cfg, vars);
        let m = decl.meters(vars);
        let port = |list: &[flexstack_core::PortSpec], name: &str| list.iter().position(|p| p.name == name);
        let pass = port(&interface.outputs, "pass").unwrap_or(2);
        let stream_in = port(&interface.inputs, "stream_in").unwrap_or(0);
        let prefix = cfg.vars_prefix.clone();
        let hits = |n: usize| (1..=n).map(|i| vars.meter(&format!("rule{i}_matches_total"))).collect::<Vec<_>>();
        let mut engine = Engine::new(side, cfg.clone(), m).expect("an epoll instance and an eventfd");
        if inner.is_some() {
            // Flow ids apart from the smoltcp back-end's (which counts from 1), and its gauge of UDP flows.
            engine.next_id = KERNEL_IDS;
            engine.shares_udp = true;
        }
        let mut redirect = None;
        if let Some((listeners, sockets, r, mut a)) = app {
            redirect = Some(r);
            a.hits = hits(a.matcher.rules.len());
            for l in listeners {
                if let Err(e) = engine.add_listener(l) {
                    tracing::error!(error = %e, "cannot watch the kernel listener");
                }
            }
            for s in sockets {
                if let Err(e) = engine.add_udp_listener(s) {
                    tracing::error!(error = %e, "cannot watch the server role's UDP socket");
                }
            }
            engine.app = Some(a);
            engine.spare = spare_descriptor();
            if side == Side::Net {
                // The server role's flows: ids of their own, as smoltcp's originate numbers them.
                engine.next_id = flexstack_modules::stream::originate::SERVER_IDS;
            }
        }
        engine.netns = namespaces;
        let epoll = engine.epoll();
        let name = format!("kernel-{}", if side == Side::App { "terminate" } else { "originate" });
        let (tcp, udp) = (tcp_specs(), backend::flow_specs());
        let device = Arc::new(KernelDevice::new(name, side.out_dir(), epoll, engine));
        Box::new(KernelEndpoint {
            device,
            decl,
            cfg,
            prefix,
            pass,
            stream_in,
            egress: Vec::new(),
            flows: HashMap::new(),
            sweep: Default::default(),
            slots: slots(&tcp, &udp),
            tcp_specs: tcp,
            udp_specs: udp,
            inner,
            _redirect: redirect,
        })
    }
}

/// What an [`EpollDevice`] serves: the I/O state of a face whose frames are stream frames (the kernel back-end's
/// engine, a carrier's connections), behind the device's mutex.
pub(crate) trait FrameEngine: Send {
    /// Reads one frame into `buf` and its metadata into `meta` without blocking; `Ok(false)` when none is waiting.
    fn read_frame(&mut self, buf: &mut Vec<u8>, meta: &mut Metadata) -> std::io::Result<bool>;
    /// Takes the frames the module queued for the device.
    fn write_frames(&mut self, packets: &[&Packet]);
}

/// The device the data plane sees for an engine whose sockets are in one epoll set: the data plane waits on the
/// set, reads frames and writes them through the engine, which the module reaches through [`EpollDevice::engine`].
pub(crate) struct EpollDevice<E> {
    name: String,
    dir: Direction,
    epoll: Arc<nix::sys::epoll::Epoll>,
    engine: Mutex<E>,
}

impl<E> EpollDevice<E> {
    pub(crate) fn new(name: String, dir: Direction, epoll: Arc<nix::sys::epoll::Epoll>, engine: E) -> Self {
        EpollDevice { name, dir, epoll, engine: Mutex::new(engine) }
    }

    pub(crate) fn engine(&self) -> MutexGuard<'_, E> {
        self.engine.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl<E: FrameEngine> FaceDevice for EpollDevice<E> {
    fn name(&self) -> &str {
        &self.name
    }

    fn fd(&self) -> BorrowedFd<'_> {
        self.epoll.0.as_fd()
    }

    fn direction(&self) -> Direction {
        self.dir
    }

    fn read_packet(&self, buf: &mut Vec<u8>) -> std::io::Result<bool> {
        // The data plane reads with read_frame (stream frames are their metadata); this is that without it.
        self.read_frame(buf, &mut Metadata::default())
    }

    fn read_frame(&self, buf: &mut Vec<u8>, meta: &mut Metadata) -> std::io::Result<bool> {
        self.engine().read_frame(buf, meta)
    }

    fn write_packet(&self, _packet: &[u8]) -> std::io::Result<()> {
        Err(std::io::Error::new(std::io::ErrorKind::Unsupported, format!("{} takes stream frames", self.name)))
    }

    fn write_frames(&self, packets: &[&Packet]) -> std::io::Result<()> {
        self.engine().write_frames(packets);
        Ok(())
    }
}

type KernelDevice = EpollDevice<Engine>;

impl FrameEngine for Engine {
    fn read_frame(&mut self, buf: &mut Vec<u8>, meta: &mut Metadata) -> std::io::Result<bool> {
        Engine::read_frame(self, buf, meta)
    }

    fn write_frames(&mut self, packets: &[&Packet]) {
        Engine::write_frames(self, packets);
    }
}

/// The meters of one flow.
struct FlowVars {
    name: String,
    vars: ModuleVars,
}

/// A running kernel endpoint.
struct KernelEndpoint {
    device: Arc<KernelDevice>,
    decl: Decl,
    cfg: Config,
    prefix: String,
    pass: usize,
    stream_in: usize,
    egress: Batch,
    flows: HashMap<u64, FlowVars>,
    /// Every flow's id, in the order their meters are next read while idle.
    sweep: std::collections::VecDeque<u64>,
    /// The runtime variables of a TCP and of a UDP flow, built once.
    tcp_specs: Vec<VarSpec>,
    udp_specs: Vec<VarSpec>,
    /// Where the variables it refreshes are in a flow's (see [`slots`]).
    slots: [usize; 13],
    /// terminate with UDP rules: the data plane's UDP termination (the smoltcp back-end).
    inner: Option<Box<dyn Module>>,
    /// terminate: the redirect in the app's namespace, removed with the module.
    _redirect: Option<kernel_app::Redirect>,
}

/// The runtime variables of one TCP flow of the kernel back-end, under `<vars_prefix>.<flow>`.
/// The per-flow variables the module refreshes, by their index in [`SLOT_NAMES`] (the first four are a UDP flow's
/// too: `backend::flow_specs` comes first in both lists).
const BYTES_UP: usize = 0;
const BYTES_DOWN: usize = 1;
const IN_FLIGHT: usize = 2;
const QUEUED: usize = 3;
const STATE: usize = 4;
const SRTT: usize = 5;
const CWND: usize = 6;
const BYTES_IN_FLIGHT: usize = 7;
const RETRANS: usize = 8;
const DELIVERY_RATE: usize = 9;
const SEND_QUEUE: usize = 10;
const RECV_QUEUE: usize = 11;
const CC: usize = 12;
const SLOT_NAMES: [&str; 13] = [
    "bytes_up_total",
    "bytes_down_total",
    "in_flight_bytes",
    "queued_bytes",
    "tcp.state",
    "tcp.srtt_us",
    "tcp.cwnd",
    "tcp.bytes_in_flight",
    "tcp.retrans_total",
    "tcp.delivery_rate",
    "tcp.send_queue",
    "tcp.recv_queue",
    "tcp.cc",
];

/// Where each of [`SLOT_NAMES`] is in a TCP flow's variables (found once: no lookup by name per refresh).
fn slots(tcp: &[VarSpec], udp: &[VarSpec]) -> [usize; 13] {
    let at = |list: &[VarSpec], n: &str| {
        list.iter().position(|v| v.name == n).unwrap_or_else(|| panic!("a flow declares {n}"))
    };
    let s = SLOT_NAMES.map(|n| at(tcp, n));
    debug_assert!((0..4).all(|i| at(udp, SLOT_NAMES[i]) == s[i]), "a UDP flow's first variables are a TCP flow's");
    s
}

fn tcp_specs() -> Vec<VarSpec> {
    let mut v = backend::flow_specs();
    v.extend([
        VarSpec::meter("tcp.state", ValueType::Str, "", "TCP state of the endpoint's kernel socket (TCP_INFO)"),
        VarSpec::meter("tcp.srtt_us", ValueType::U64, "us", "smoothed round-trip time (TCP_INFO)"),
        VarSpec::meter("tcp.cwnd", ValueType::U64, "segments", "congestion window (TCP_INFO)"),
        VarSpec::meter(
            "tcp.bytes_in_flight",
            ValueType::U64,
            "bytes",
            "sent, not acknowledged: unacked segments x MSS",
        ),
        VarSpec::meter("tcp.retrans_total", ValueType::U64, "frames", "segments sent again (TCP_INFO)"),
        VarSpec::meter("tcp.delivery_rate", ValueType::U64, "bytes/s", "the latest delivery rate (TCP_INFO)"),
        VarSpec::meter("tcp.send_queue", ValueType::U64, "bytes", "bytes in the socket's send queue (SIOCOUTQ)"),
        VarSpec::meter("tcp.recv_queue", ValueType::U64, "bytes", "bytes in the socket's receive queue (SIOCINQ)"),
        VarSpec::knob("tcp.cc", ValueType::Str, "", "congestion control of this connection (TCP_CONGESTION)"),
    ]);
    v
}

impl KernelEndpoint {
    /// Registers the meters of new flows, removes those of ended ones, and refreshes the others.
    fn meters(&mut self, e: &mut Engine, out: &mut Output<'_>) {
        for id in std::mem::take(&mut e.gone) {
            if let Some(v) = self.flows.remove(&id) {
                out.unregister_vars(&v.name);
            }
        }
        for id in std::mem::take(&mut e.born) {
            let Some(f) = e.flows.get(&id) else { continue };
            let name = format!("{}.{id}", self.prefix);
            let specs = if matches!(f.sock, Sock::Tcp(_)) { &self.tcp_specs } else { &self.udp_specs };
            // Another module owning the prefix (a misconfiguration) leaves the meters unpublished, never the flow.
            let vars = out.register_vars(&name, specs).unwrap_or_else(|_| ModuleVars::new(specs));
            vars.meter("tuple").store(&Value::Str(f.info.to_string()));
            self.flows.insert(id, FlowVars { name, vars });
            self.sweep.push_back(id);
        }
        // The meters of the flows touched since the last period, and of a slice of the others, so that every flow's
        // are read at least every IDLE_PERIODS: 10,000 idle connections cost neither a walk of every flow nor
        // 300,000 system calls a second.
        let mut due = e.gauges();
        for _ in 0..self.flows.len().div_ceil(IDLE_PERIODS as usize) {
            let Some(id) = self.sweep.pop_front() else { break };
            if self.flows.contains_key(&id) {
                due.push(id);
                self.sweep.push_back(id);
            }
        }
        let down = e.out_is_down();
        let (out_m, in_m) = if down { (BYTES_DOWN, BYTES_UP) } else { (BYTES_UP, BYTES_DOWN) };
        for id in due {
            let (Some(f), Some(v)) = (e.flows.get(&id), self.flows.get(&id)) else { continue };
            let cells = v.vars.cells();
            let m = |i: usize| &cells[self.slots[i]];
            m(out_m).set_u64(f.bytes_out);
            m(in_m).set_u64(f.bytes_in);
            m(IN_FLIGHT).set_u64(f.credit.in_flight());
            m(QUEUED).set_u64(f.queued);
            let Sock::Tcp(s) = &f.sock else { continue };
            if let Ok(t) = flexstack_sys::tcp_info(s.as_fd()) {
                let state = flexstack_sys::tcp_state_name(t.state);
                if !matches!(m(STATE).get(), Value::Str(ref now) if now == state) {
                    m(STATE).store(&Value::Str(state.into()));
                }
                m(SRTT).set_u64(u64::from(t.srtt_us));
                m(CWND).set_u64(u64::from(t.cwnd));
                m(BYTES_IN_FLIGHT).set_u64(u64::from(t.unacked) * u64::from(t.snd_mss));
                m(RETRANS).set_u64(u64::from(t.total_retrans));
                m(DELIVERY_RATE).set_u64(t.delivery_rate);
            }
            if let Ok((outq, inq)) = flexstack_sys::socket_queues(s.as_fd()) {
                m(SEND_QUEUE).set_u64(u64::from(outq));
                m(RECV_QUEUE).set_u64(u64::from(inq));
            }
            if !matches!(m(CC).get(), Value::Str(ref now) if *now == f.cc) {
                m(CC).store(&Value::Str(f.cc.clone()));
            }
        }
    }

    /// A write of `<vars_prefix>.<flow>.tcp.cc`: the flow's socket gets that congestion control at once.
    fn flow_cc(&mut self, knob: &str, value: &Value) -> Option<Result<(), String>> {
        let rest = knob.strip_prefix(&self.prefix)?.strip_prefix('.')?;
        let id: u64 = rest.strip_suffix(".tcp.cc")?.parse().ok()?;
        let Value::Str(name) = value else { return Some(Err(format!("{knob} takes a string"))) };
        let mut e = self.device.engine();
        let Some(f) = e.flows.get_mut(&id) else { return Some(Err(format!("no flow {id}"))) };
        let Sock::Tcp(s) = &f.sock else { return Some(Err(format!("flow {id} is not TCP"))) };
        Some(match engine::set_cc(s, name) {
            Ok(()) => {
                f.cc = engine::cc_of(s);
                Ok(())
            }
            Err(err) => Err(format!("congestion control {name:?}: {err} (offered: {})", available_cc())),
        })
    }
}

/// What `net.ipv4.tcp_available_congestion_control` lists.
fn available_cc() -> String {
    std::fs::read_to_string("/proc/sys/net/ipv4/tcp_available_congestion_control")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

impl Module for KernelEndpoint {
    fn process(&mut self, port: usize, input: &mut Batch, out: &mut Output<'_>) {
        let Some(inner) = self.inner.as_mut() else {
            if port == self.stream_in {
                self.egress.append(input);
            } else {
                // Packets: none of its flows travels as packets (the app's TCP is redirected, the server's reaches
                // its sockets), so they pass unchanged, counted as the smoltcp back-end counts them.
                self.device.engine().m.passed.add(input.len() as u64);
                out.emit_all(self.pass, input);
            }
            return;
        };
        if port != self.stream_in {
            inner.process(port, input, out); // UDP it terminates; the rest passes
        } else {
            // Stream frames of its kernel flows to the sockets, the others to the data plane's UDP flows.
            let kernel = |f: &Frame| f.packet().and_then(Packet::stream_flow).is_some_and(|id| id >= KERNEL_IDS);
            let mut udp: Batch = Vec::new();
            for f in input.drain(..) {
                if kernel(&f) {
                    self.egress.push(f);
                } else {
                    udp.push(f);
                }
            }
            if !udp.is_empty() {
                inner.process(port, &mut udp, out);
            }
        }
        self.device.engine().counts();
    }

    fn poll(&mut self, out: &mut Output<'_>) -> Option<Time> {
        let device = self.device.clone();
        let mut e = device.engine();
        e.tick(Instant::now());
        self.meters(&mut e, out);
        let next = out.now() + METER_PERIOD;
        let inner = self.inner.as_mut().and_then(|i| i.poll(out));
        e.counts();
        Some(inner.map_or(next, |t| t.min(next)))
    }

    fn write_knob(&mut self, knob: &str, value: &Value) -> Result<(), String> {
        if let Some(r) = self.flow_cc(knob, value) {
            return r;
        }
        if knob == "cc" {
            // Any the kernel offers (`none`: the kernel's default), for new connections.
            let Value::Str(name) = value else { return Err("cc takes a string".into()) };
            let offered = available_cc();
            if name != "none" && !offered.split_whitespace().any(|c| c == name) {
                return Err(format!("expected one of: none {offered}, got {name:?}"));
            }
            self.device.engine().cc = (name != "none").then(|| name.clone());
            return Ok(());
        }
        self.decl.write(&mut self.cfg, knob, value)?;
        self.device.engine().cfg = self.cfg.clone();
        if let Some(inner) = self.inner.as_mut() {
            inner.write_knob(knob, value)?;
        }
        Ok(())
    }

    fn device(&self) -> Option<Arc<dyn FaceDevice>> {
        Some(self.device.clone())
    }

    fn take_egress(&mut self, into: &mut Batch) {
        into.append(&mut self.egress);
    }
}

#[cfg(test)]
mod tests {
    use flexstack_core::{Frame, ModuleVars, Output, PacketPool, StackSpec, Time, Value};

    /// Packets reaching a kernel endpoint's `in` port belong to none of its flows: they leave on `pass`, unchanged,
    /// and count in `passed_total` as with the smoltcp back-end (a forwarded flow's answers through `originate`).
    #[test]
    fn packets_through_a_kernel_endpoint_pass_and_are_counted() {
        super::install();
        let spec = StackSpec::parse("s.toml", "[modules.e]\nkind = \"originate\"\nbackend = \"kernel\"\n").unwrap();
        let b = flexstack_modules::catalog().configure("originate", &spec.modules[0].settings, None).unwrap();
        let iface = b.interface();
        let port = |list: &[flexstack_core::PortSpec], n: &str| list.iter().position(|p| p.name == n).unwrap();
        let (input, pass) = (port(&iface.inputs, "in"), port(&iface.outputs, "pass"));
        let vars = ModuleVars::new(&iface.vars);
        let mut m = b.build(&vars);
        let pool = PacketPool::default();
        let mut batch: Vec<Frame> = (0..3u8).map(|i| Frame::from(pool.alloc_from(&[0x45, i]))).collect();
        let (mut ports, mut control, mut serial) = (vec![Vec::new(); iface.outputs.len()], Vec::new(), 0);
        let mut out = Output::detached(Time::ZERO, "e", &pool, &mut ports, &mut control, &mut serial);
        m.process(input, &mut batch, &mut out);
        let passed: Vec<u8> = ports[pass].iter().filter_map(|f| f.packet()).map(|p| p.data()[1]).collect();
        assert_eq!(passed, [0, 1, 2], "passed unchanged, in order");
        assert_eq!(vars.cell("passed_total").unwrap().get(), Value::U64(3));
    }
}
