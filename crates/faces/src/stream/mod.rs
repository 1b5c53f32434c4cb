//! The `kernel` back-end of the stream endpoints (`terminate`, `originate` with `backend = "kernel"`;
//! docs/streams.md, "The kernel back-end"): the host kernel's TCP does the transport, and the flows' sockets live
//! at the edge like faces, in the data plane's epoll loop.
//!
//! - [`install`] hands the builder to `flexstack_modules::stream::backend` (the daemon's catalog calls it once).
//! - `engine`: what both sides share: flows and their sockets, the stream protocol and its credit, one epoll set.
//! - `kernel_app`: `terminate`'s listener in the app's namespace and the nftables redirect to it.
//! - `kernel_net`: `originate`'s non-blocking sockets towards the original destinations (TCP and UDP).
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

use engine::{AppSide, Engine, Sock};
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

/// An idle flow's meters are read every this many periods.
const IDLE_PERIODS: u64 = 50;

/// How often the module refreshes its flows' meters and checks their timeouts.
pub const METER_PERIOD: Duration = Duration::from_millis(100);

/// Installs the kernel back-end of `terminate` and `originate` (once per process; later calls change nothing).
pub fn install() {
    backend::install_kernel(build);
}

/// Raises the process's soft limit of open files to its hard limit, once: each terminated connection holds one
/// socket per kernel endpoint, and the usual soft limit (1,024) would stop a kernel `terminate` and `originate`
/// at about 500 connections.
fn more_files() {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE) {
            if soft < hard {
                if let Err(e) = setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
                    tracing::warn!(error = %e, "cannot raise the limit of open files");
                }
            }
        }
    });
}

/// Builds the kernel back-end from what the kind read.
fn build(req: KernelRequest) -> Result<Box<dyn ModuleBuilder>, String> {
    more_files();
    let KernelRequest { side, cfg, matcher, netns, mut interface, decl, smoltcp } = req;
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
    let app = match side {
        Side::App => {
            let (listeners, redirect) = kernel_app::open(&netns, &matcher, &cfg.app)?;
            Some((listeners, redirect, AppSide { matcher, hits: Vec::new(), app: cfg.app.clone() }))
        }
        Side::Net => None,
    };
    Ok(Box::new(KernelBuilder { side, cfg, interface, decl, app, udp }))
}

type Decl = &'static flexstack_core::KindDecl<Config, Meters>;

struct KernelBuilder {
    side: Side,
    cfg: Config,
    interface: ModuleInterface,
    decl: Decl,
    app: Option<(Vec<std::net::TcpListener>, kernel_app::Redirect, AppSide)>,
    /// terminate with UDP rules: the smoltcp back-end, for them.
    udp: Option<Box<dyn ModuleBuilder>>,
}

impl ModuleBuilder for KernelBuilder {
    fn interface(&self) -> ModuleInterface {
        self.interface.clone()
    }

    fn build(self: Box<Self>, vars: &ModuleVars) -> Box<dyn Module> {
        let KernelBuilder { side, cfg, interface, decl, app, udp } = *self;
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
        if let Some((listeners, r, mut a)) = app {
            redirect = Some(r);
            a.hits = hits(a.matcher.rules.len());
            for l in listeners {
                if let Err(e) = engine.add_listener(l) {
                    tracing::error!(error = %e, "cannot watch the kernel listener");
                }
            }
            engine.app = Some(a);
        }
        let epoll = engine.epoll();
        let name = format!("kernel-{}", if side == Side::App { "terminate" } else { "originate" });
        let device = Arc::new(KernelDevice { name, dir: side.out_dir(), epoll, engine: Mutex::new(engine) });
        Box::new(KernelEndpoint {
            device,
            decl,
            cfg,
            prefix,
            pass,
            stream_in,
            egress: Vec::new(),
            flows: HashMap::new(),
            tcp_specs: tcp_specs(),
            udp_specs: backend::flow_specs(),
            inner,
            _redirect: redirect,
        })
    }
}

/// The device the data plane sees: the engine's epoll set.
struct KernelDevice {
    name: String,
    dir: Direction,
    epoll: Arc<nix::sys::epoll::Epoll>,
    engine: Mutex<Engine>,
}

impl KernelDevice {
    fn engine(&self) -> MutexGuard<'_, Engine> {
        self.engine.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl FaceDevice for KernelDevice {
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
        Err(std::io::Error::new(std::io::ErrorKind::Unsupported, "a kernel endpoint takes stream frames"))
    }

    fn write_frames(&self, packets: &[&Packet]) -> std::io::Result<()> {
        self.engine().write_frames(packets);
        Ok(())
    }
}

/// The meters of one flow.
struct FlowVars {
    name: String,
    vars: ModuleVars,
    /// Bytes out and in at the last refresh, and the refreshes since they last moved.
    seen: (u64, u64),
    idle: u64,
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
    /// The runtime variables of a TCP and of a UDP flow, built once.
    tcp_specs: Vec<VarSpec>,
    udp_specs: Vec<VarSpec>,
    /// terminate with UDP rules: the data plane's UDP termination (the smoltcp back-end).
    inner: Option<Box<dyn Module>>,
    /// terminate: the redirect in the app's namespace, removed with the module.
    _redirect: Option<kernel_app::Redirect>,
}

/// The runtime variables of one TCP flow of the kernel back-end, under `<vars_prefix>.<flow>`.
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
            self.flows.insert(id, FlowVars { name, vars, seen: (u64::MAX, 0), idle: 0 });
        }
        e.gauges();
        let down = e.out_is_down();
        for (id, v) in &mut self.flows {
            let Some(f) = e.flows.get(id) else { continue };
            // The kernel's meters of an idle flow change little: read every period while bytes move, else every
            // IDLE_PERIODS (10,000 idle connections would otherwise cost 300,000 system calls a second).
            let moved = (f.bytes_out, f.bytes_in) != v.seen;
            v.seen = (f.bytes_out, f.bytes_in);
            v.idle = if moved { 0 } else { v.idle + 1 };
            if !moved && v.idle % IDLE_PERIODS != 1 {
                continue;
            }
            let m = |n: &str| v.vars.meter(n);
            let (out_m, in_m) =
                if down { ("bytes_down_total", "bytes_up_total") } else { ("bytes_up_total", "bytes_down_total") };
            m(out_m).set(f.bytes_out);
            m(in_m).set(f.bytes_in);
            m("in_flight_bytes").set(f.credit.in_flight());
            m("queued_bytes").set(f.queued);
            let Sock::Tcp(s) = &f.sock else { continue };
            if let Ok(t) = flexstack_sys::tcp_info(s.as_fd()) {
                m("tcp.state").store(&Value::Str(flexstack_sys::tcp_state_name(t.state).into()));
                m("tcp.srtt_us").set(u64::from(t.srtt_us));
                m("tcp.cwnd").set(u64::from(t.cwnd));
                m("tcp.bytes_in_flight").set(u64::from(t.unacked) * u64::from(t.snd_mss));
                m("tcp.retrans_total").set(u64::from(t.total_retrans));
                m("tcp.delivery_rate").set(t.delivery_rate);
            }
            if let Ok((outq, inq)) = flexstack_sys::socket_queues(s.as_fd()) {
                m("tcp.send_queue").set(u64::from(outq));
                m("tcp.recv_queue").set(u64::from(inq));
            }
            m("tcp.cc").store(&Value::Str(f.cc.clone()));
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
        Some(match kernel_net::set_cc(s, name) {
            Ok(()) => {
                f.cc = kernel_net::cc_of(s);
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
