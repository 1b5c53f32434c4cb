//! A two-endpoint lab for the stream endpoints, with simulated time: an app-side smoltcp host (the "app", its own
//! `Interface`) <-> `terminate` <-> [stream modules] <-> `originate` <-> a server-side smoltcp host, all IP packets
//! moved between them by the test loop, the endpoints and the stream modules in one `Switch`.
//!
//! ```text
//!  app host ──Down──▶ t[in]          t[stream] ─▶ mid… ─▶ sdir ─[down]▶ o[stream_in]     o[out] ──▶ server host
//!  app host ◀──Up──── t[out]         o[stream] ─▶ mid…        ─[up]──▶ t[stream_in]     o[in] ◀── server host
//!                     t[pass] ─▶ `passed` log                                            o[pass] ─▶ `net_passed` log
//! ```
#![allow(dead_code)] // each test file uses what it needs

use flexstack_core::frame::{Gso, GsoKind};
use flexstack_core::testing::{take, Log, Recorder, Seen};
use flexstack_core::{Batch, Direction, Edit, Frame, LinkSpec, MetaKey, Settings, Switch, Time, Value};
use smoltcp::iface::{Config, Interface, SocketHandle, SocketSet};
use smoltcp::phy::{self, DeviceCapabilities, Medium};
use smoltcp::socket::tcp;
use smoltcp::time::Instant;
use smoltcp::wire::{HardwareAddress, IpAddress, IpCidr, Ipv4Address, Ipv6Address};
use std::collections::VecDeque;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

pub const APP4: &str = "10.0.0.2";
pub const SERVER4: &str = "192.0.2.1";
pub const APP6: &str = "fd77::2";
pub const SERVER6: &str = "2001:db8::1";

/// A smoltcp `Device` over two queues of byte vectors. With `tso`, smoltcp may write TCP segments over IPv4 larger
/// than the MSS (as a kernel with TSO does): the size to cut them at is in `tx_mss`, one entry per packet of `tx`.
#[derive(Default)]
pub struct Wire {
    pub rx: VecDeque<Vec<u8>>,
    pub tx: Vec<Vec<u8>>,
    pub tx_mss: Vec<Option<u16>>,
    pub tso: bool,
}

pub struct RxT(Vec<u8>);
pub struct TxT<'a>(&'a mut Vec<Vec<u8>>, &'a mut Vec<Option<u16>>, Option<u16>, bool);

impl phy::RxToken for RxT {
    fn consume<R, F: FnOnce(&[u8]) -> R>(self, f: F) -> R {
        f(&self.0)
    }
}

impl phy::TxToken for TxT<'_> {
    fn consume<R, F: FnOnce(&mut [u8]) -> R>(self, len: usize, f: F) -> R {
        let mut b = vec![0; len];
        let r = f(&mut b);
        if self.3 && tcp_gso(&b, self.2).is_none() {
            fill_tcp_checksum(&mut b);
        }
        self.0.push(b);
        self.1.push(self.2);
        r
    }

    fn set_meta(&mut self, meta: phy::PacketMeta) {
        self.2 = meta.segmentation_offload_size.map(u16::from);
    }
}

impl phy::Device for Wire {
    type RxToken<'a> = RxT;
    type TxToken<'a> = TxT<'a>;
    fn receive(&mut self, _: Instant) -> Option<(RxT, TxT<'_>)> {
        let p = self.rx.pop_front()?;
        Some((RxT(p), TxT(&mut self.tx, &mut self.tx_mss, None, self.tso)))
    }
    fn transmit(&mut self, _: Instant) -> Option<TxT<'_>> {
        Some(TxT(&mut self.tx, &mut self.tx_mss, None, self.tso))
    }
    fn capabilities(&self) -> DeviceCapabilities {
        let mut c = DeviceCapabilities::default();
        c.medium = Medium::Ip;
        c.max_transmission_unit = 1500;
        if self.tso {
            // smoltcp leaves the checksums of TCP segments to such a device: `TxT` computes those of the others.
            c.segmentation.tcpv4 = std::num::NonZeroUsize::new(65_535);
            c.checksum.tcp = phy::Checksum::Rx;
        }
        c
    }
}

/// The GSO description of TCP packet `data` to be cut at `mss`, if it is longer than one segment.
pub fn tcp_gso(data: &[u8], mss: Option<u16>) -> Option<Gso> {
    let mss = mss?;
    let (l4, kind) =
        if data[0] >> 4 == 4 { (usize::from(data[0] & 0x0f) * 4, GsoKind::TcpV4) } else { (40, GsoKind::TcpV6) };
    let hdr = l4 + usize::from(data[l4 + 12] >> 4) * 4;
    (data.len() > hdr + usize::from(mss)).then_some(Gso {
        kind,
        gso_size: mss,
        hdr_len: hdr as u16,
        csum_start: l4 as u16,
        l3_offset: 0,
        ecn: false,
    })
}

/// Computes the checksum of TCP packet `data` (the stack left it to a device with TSO).
fn fill_tcp_checksum(data: &mut [u8]) {
    use flexstack_wire::checksum;
    let Ok(info) = flexstack_wire::packet::PacketInfo::parse(data) else { return };
    if info.protocol != 6 {
        return;
    }
    let (start, end) = (info.l4_offset, info.total_len);
    data[start + 16..start + 18].fill(0);
    let sum = checksum::pseudo_header(info.src, info.dst, 6, (end - start) as u32);
    let c = checksum::finish(checksum::sum(sum, &data[start..end]));
    data[start + 16..start + 18].copy_from_slice(&c.to_be_bytes());
}

/// What a host's kernel makes of a packet it is given: a GSO super-packet is cut into its segments.
fn segments(p: Seen) -> (Vec<Vec<u8>>, bool) {
    let Some(gso) = Gso::of(&p.meta) else { return (vec![p.data], false) };
    let cut = (0..gso.segments(p.data.len()))
        .map(|i| {
            let mut s = Vec::new();
            gso.segment_into(&p.data, i, &mut s);
            s
        })
        .collect();
    (cut, true)
}

/// A host: one smoltcp interface and its sockets.
pub struct Host {
    pub iface: Interface,
    pub wire: Wire,
    pub sockets: SocketSet<'static>,
    pub addr: IpAddr,
}

fn smol(t: Time) -> Instant {
    Instant::from_micros((t.as_nanos() / 1000) as i64)
}

impl Host {
    pub fn new(addr4: &str, addr6: &str, v6: bool, seed: u64) -> Host {
        Host::with_tso(addr4, addr6, v6, seed, false)
    }

    /// A host whose wire has `tso` (smoltcp reads it when the interface is made).
    pub fn with_tso(addr4: &str, addr6: &str, v6: bool, seed: u64, tso: bool) -> Host {
        let mut wire = Wire { tso, ..Wire::default() };
        let mut c = Config::new(HardwareAddress::Ip);
        c.random_seed = seed;
        let mut iface = Interface::new(c, &mut wire, Instant::ZERO);
        let a4: Ipv4Address = addr4.parse().unwrap();
        let a6: Ipv6Address = addr6.parse().unwrap();
        iface.update_ip_addrs(|a| {
            a.push(IpCidr::new(IpAddress::Ipv4(a4), 24)).unwrap();
            a.push(IpCidr::new(IpAddress::Ipv6(a6), 64)).unwrap();
        });
        // Everything else through a gateway: the device is IP, so any gateway address does.
        let g4 = Ipv4Address::from_octets({
            let mut o = a4.octets();
            o[3] = 254;
            o
        });
        let mut g6 = a6.octets();
        g6[15] = 0xfe;
        iface.routes_mut().add_default_ipv4_route(g4).unwrap();
        iface.routes_mut().add_default_ipv6_route(Ipv6Address::from_octets(g6)).unwrap();
        let addr = if v6 { IpAddr::V6(a6) } else { IpAddr::V4(a4) };
        Host { iface, wire, sockets: SocketSet::new(Vec::new()), addr }
    }

    /// Polls the interface; returns what it sent.
    pub fn poll(&mut self, now: Time) -> Vec<Vec<u8>> {
        self.poll_mss(now).into_iter().map(|(p, _)| p).collect()
    }

    /// Polls the interface; returns what it sent, each packet with the size to cut it at (`Wire::tso`).
    pub fn poll_mss(&mut self, now: Time) -> Vec<Sent> {
        self.iface.poll(smol(now), &mut self.wire, &mut self.sockets);
        let mss = std::mem::take(&mut self.wire.tx_mss);
        std::mem::take(&mut self.wire.tx).into_iter().zip(mss).collect()
    }

    pub fn tcp(&mut self, h: SocketHandle) -> &mut tcp::Socket<'static> {
        self.sockets.get_mut::<tcp::Socket>(h)
    }

    /// A socket listening on `port`.
    pub fn listen(&mut self, port: u16, buffer: usize) -> SocketHandle {
        let mut s = self.socket(buffer);
        s.listen(port).unwrap();
        self.sockets.add(s)
    }

    /// A socket connecting from local port `local` to `to`:`port`.
    pub fn connect(&mut self, to: IpAddr, port: u16, local: u16, buffer: usize) -> SocketHandle {
        let mut s = self.socket(buffer);
        s.connect(self.iface.context(), (IpAddress::from(to), port), local).unwrap();
        self.sockets.add(s)
    }

    pub fn socket(&mut self, buffer: usize) -> tcp::Socket<'static> {
        let mut s = tcp::Socket::new(tcp::SocketBuffer::new(vec![0; buffer]), tcp::SocketBuffer::new(vec![0; buffer]));
        s.set_nagle_enabled(false);
        s
    }
}

/// A packet a host sent, with the size to cut it at (`Wire::tso`).
pub type Sent = (Vec<u8>, Option<u16>);

/// The lab.
pub struct Lab {
    pub sw: Switch,
    pub now: Time,
    pub app: Host,
    pub server: Host,
    pub v6: bool,
    pub to_app: Log,
    pub to_net: Log,
    pub passed: Log,
    pub net_passed: Log,
    /// Packets towards the server are lost (an unreachable network) while true.
    pub blackhole: bool,
    /// Every packet that went to the app or to the network, for tests that look at segments.
    pub seen_to_app: Vec<Vec<u8>>,
    pub seen_to_net: Vec<Vec<u8>>,
    /// Every packet the app sent.
    pub seen_from_app: Vec<Vec<u8>>,
    pub keep_seen: bool,
    /// One-way delay between originate and the server (both ways); 0: none.
    pub net_delay: Duration,
    to_server: VecDeque<(Time, Sent)>,
    from_server: VecDeque<(Time, Sent)>,
    /// The app's last local port; the next `connect` takes the one after.
    pub next_port: u16,
    /// GSO super-packets the hosts sent (TSO: `Wire::tso`) and received (cut into segments, as a kernel does).
    pub gso_from_app: usize,
    pub gso_from_server: usize,
    pub gso_to_app: usize,
    pub gso_to_net: usize,
    /// Real time each step also waits (for modules whose work runs on threads of their own, as `compress`'s
    /// blocks do: simulated time would otherwise run ahead of them); zero: none.
    pub pace: std::time::Duration,
}

pub fn load(name: &str, kind: &str, args: &[String]) -> Edit {
    let settings = Settings::from_args(args).expect("settings");
    let builder =
        flexstack_modules::catalog().configure(kind, &settings, None).unwrap_or_else(|e| panic!("{kind}: {e}"));
    Edit::Load { name: name.into(), kind: kind.into(), settings, builder }
}

pub fn link(text: &str) -> Edit {
    Edit::Link(LinkSpec::parse(text).expect("link"))
}

pub fn args(a: &[&str]) -> Vec<String> {
    a.iter().map(|s| s.to_string()).collect()
}

impl Lab {
    /// `terminate` with `t_args` (plus a fixed seed), `originate` with `o_args`, and `middle` stream modules
    /// (name, kind, settings) chained between them.
    pub fn new(v6: bool, t_args: &[&str], o_args: &[&str], middle: &[(&str, &str, Vec<String>)]) -> Lab {
        let mut sw = Switch::default();
        // Meters published at once (the tests read them from the first packet on), unless a test says otherwise.
        let given = |a: &[&str]| a.iter().any(|s| s.starts_with("meters_after_ms="));
        let mut t = args(if given(t_args) { &["seed=11"] } else { &["seed=11", "meters_after_ms=0"] });
        t.extend(args(t_args));
        let mut o = args(if given(o_args) { &["seed=12"] } else { &["seed=12", "meters_after_ms=0"] });
        o.extend(args(o_args));
        let (r1, to_app) = Recorder::load("to_app");
        let (r2, to_net) = Recorder::load("to_net");
        let (r3, passed) = Recorder::load("passed");
        let (r4, net_passed) = Recorder::load("net_passed");
        let mut edits = vec![load("t", "terminate", &t), load("o", "originate", &o), load("sdir", "direction", &[])];
        edits.extend([r1, r2, r3, r4]);
        for (name, kind, a) in middle {
            edits.push(load(name, kind, a));
        }
        let first = middle.first().map_or("sdir", |m| m.0);
        edits.push(link(&format!("t[stream] -> {first}")));
        edits.push(link(&format!("o[stream] -> {first}")));
        for w in middle.windows(2) {
            edits.push(link(&format!("{} -> {}", w[0].0, w[1].0)));
        }
        if let Some(last) = middle.last() {
            edits.push(link(&format!("{} -> sdir", last.0)));
        }
        edits.extend([
            link("sdir[down] -> o[stream_in]"),
            link("sdir[up] -> t[stream_in]"),
            link("t[out] -> to_app"),
            link("t[pass] -> passed"),
            link("o[out] -> to_net"),
            link("o[pass] -> net_passed"),
        ]);
        sw.apply(edits).unwrap();
        Lab {
            sw,
            now: Time::from_millis(1),
            app: Host::new(APP4, APP6, v6, 1),
            server: Host::new(SERVER4, SERVER6, v6, 2),
            v6,
            to_app,
            to_net,
            passed,
            net_passed,
            blackhole: false,
            seen_to_app: Vec::new(),
            seen_to_net: Vec::new(),
            seen_from_app: Vec::new(),
            keep_seen: false,
            net_delay: Duration::ZERO,
            to_server: VecDeque::new(),
            from_server: VecDeque::new(),
            next_port: 40000,
            gso_from_app: 0,
            gso_from_server: 0,
            gso_to_app: 0,
            gso_to_net: 0,
            pace: std::time::Duration::ZERO,
        }
    }

    /// Both hosts send TCP super-packets (`Wire::tso`): made again, before any connection.
    pub fn tso(&mut self) {
        self.app = Host::with_tso(APP4, APP6, self.v6, 1, true);
        self.server = Host::with_tso(SERVER4, SERVER6, self.v6, 2, true);
    }

    pub fn server_addr(&self) -> IpAddr {
        self.server.addr
    }

    pub fn app_addr(&self) -> IpAddr {
        self.app.addr
    }

    /// Injects raw packets into module `m`'s `port`, travelling `dir`.
    pub fn inject(&mut self, m: &str, port: &str, packets: Vec<Vec<u8>>, dir: Direction) {
        self.inject_mss(m, port, packets.into_iter().map(|p| (p, None)).collect(), dir);
    }

    /// Injects raw packets, each with the size to cut it at: those longer than one segment as GSO super-packets.
    /// Returns how many were super-packets.
    pub fn inject_mss(&mut self, m: &str, port: &str, packets: Vec<Sent>, dir: Direction) -> usize {
        if packets.is_empty() {
            return 0;
        }
        let mut supers = 0;
        let mut batch: Batch = packets
            .into_iter()
            .map(|(d, mss)| {
                let mut p = self.sw.pool().alloc_from(&d);
                p.set_direction(dir);
                if let Some(g) = tcp_gso(&d, mss) {
                    p.meta_mut().set(MetaKey::GSO, g.pack());
                    supers += 1;
                }
                Frame::Data(p)
            })
            .collect();
        self.sw.inject(m, port, &mut batch).unwrap();
        supers
    }

    /// Runs the switch at the current time until nothing is pending.
    pub fn run_switch(&mut self) {
        for _ in 0..1000 {
            self.sw.run(self.now);
            if !self.sw.has_pending() {
                return;
            }
        }
        panic!("the switch never settles");
    }

    /// One exchange at the current time: hosts send, the switch runs, packets are delivered. True if anything moved.
    pub fn round(&mut self) -> bool {
        let now = self.now;
        while self.to_server.front().is_some_and(|(t, _)| *t <= now) {
            let (_, (p, _)) = self.to_server.pop_front().unwrap();
            self.server.wire.rx.push_back(p);
        }
        let a = self.app.poll_mss(now);
        for p in self.server.poll_mss(now) {
            self.from_server.push_back((now + self.net_delay, p));
        }
        let mut s = Vec::new();
        while self.from_server.front().is_some_and(|(t, _)| *t <= now) {
            s.push(self.from_server.pop_front().unwrap().1);
        }
        let moved = !a.is_empty() || !s.is_empty();
        if self.keep_seen {
            self.seen_from_app.extend(a.iter().map(|(p, _)| p.clone()));
        }
        self.gso_from_app += self.inject_mss("t", "in", a, Direction::Down);
        self.gso_from_server += self.inject_mss("o", "in", s, Direction::Up);
        self.run_switch();
        let to_app = take(&self.to_app);
        let to_net = take(&self.to_net);
        let moved = moved || !to_app.is_empty() || !to_net.is_empty();
        for p in to_app {
            assert_eq!(p.direction, Direction::Up, "packets to the app travel up");
            let (cut, whole) = segments(p);
            self.gso_to_app += usize::from(whole);
            for p in cut {
                if self.keep_seen {
                    self.seen_to_app.push(p.clone());
                }
                self.app.wire.rx.push_back(p);
            }
        }
        for p in to_net {
            assert_eq!(p.direction, Direction::Down, "packets to the network travel down");
            let (cut, whole) = segments(p);
            self.gso_to_net += usize::from(whole);
            for p in cut {
                if self.keep_seen {
                    self.seen_to_net.push(p.clone());
                }
                if !self.blackhole {
                    self.to_server.push_back((now + self.net_delay, (p, None)));
                }
            }
        }
        moved
    }

    /// Exchanges until quiet, then advances the clock by 1 ms.
    pub fn step(&mut self) {
        for _ in 0..10_000 {
            if !self.round() {
                break;
            }
        }
        self.now = self.now + Duration::from_millis(1);
        if !self.pace.is_zero() {
            std::thread::sleep(self.pace);
        }
    }

    /// Steps until `done` holds (checked after each step) or `max_ms` passed; true if it held.
    pub fn until(&mut self, max_ms: u64, mut done: impl FnMut(&mut Lab) -> bool) -> bool {
        for _ in 0..max_ms {
            self.step();
            if done(self) {
                return true;
            }
        }
        false
    }

    /// Steps for `ms` milliseconds.
    pub fn run(&mut self, ms: u64) {
        for _ in 0..ms {
            self.step();
        }
    }

    /// A server socket listening on `port` (buffers of `buffer` bytes).
    pub fn listen(&mut self, port: u16, buffer: usize) -> SocketHandle {
        self.server.listen(port, buffer)
    }

    /// An app socket connecting to the server's `port` (buffers of `buffer` bytes).
    pub fn connect(&mut self, port: u16, buffer: usize) -> SocketHandle {
        self.next_port += 1;
        self.app.connect(self.server.addr, port, self.next_port, buffer)
    }

    /// The server role: an app socket listening on `port` (buffers of `buffer` bytes).
    pub fn app_listen(&mut self, port: u16, buffer: usize) -> SocketHandle {
        self.app.listen(port, buffer)
    }

    /// The server role: a socket of the network's host connecting to the app's `port` (buffers of `buffer` bytes).
    pub fn net_connect(&mut self, port: u16, buffer: usize) -> SocketHandle {
        self.next_port += 1;
        self.server.connect(self.app.addr, port, self.next_port, buffer)
    }

    /// Steps until socket `h` (of the app's host if `app`, else of the network's) is closed, then asserts that it
    /// was refused: never established, an RST and no SYN-ACK among the packets sent to it (the lab must keep them:
    /// `keep_seen`).
    pub fn assert_refused(&mut self, app: bool, h: SocketHandle, what: &str) {
        let mut states = Vec::new();
        let done = self.until(5_000, |lab| {
            let s = if app { lab.app.tcp(h) } else { lab.server.tcp(h) };
            states.push(s.state());
            s.state() == tcp::State::Closed
        });
        assert!(done, "{what}: the connection ends");
        assert!(!states.contains(&tcp::State::Established), "{what}: never connected: {states:?}");
        let seen = if app { &self.seen_to_app } else { &self.seen_to_net };
        let flags: Vec<u8> = seen.iter().filter_map(|p| tcp_flags(p)).collect();
        assert!(flags.iter().any(|f| f & 0x04 != 0), "{what}: an RST: {flags:?}");
        assert!(!flags.iter().any(|f| f & 0x12 == 0x12), "{what}: no SYN-ACK was sent: {flags:?}");
    }

    /// A server socket on port 80 and an app socket connected to it (buffers of 64 KiB): (server, app).
    pub fn pair(&mut self) -> (SocketHandle, SocketHandle) {
        (self.listen(80, 65536), self.connect(80, 65536))
    }

    /// A lab with no settings that keeps the packets it sees (`seen_to_app`, `seen_to_net`).
    pub fn watched(v6: bool) -> Lab {
        let mut lab = Lab::new(v6, &[], &[], &[]);
        lab.keep_seen = true;
        lab
    }

    /// Runs `ms` more milliseconds, then neither endpoint may hold a connection.
    pub fn assert_empty_after(&mut self, ms: u64) {
        self.run(ms);
        assert_eq!(self.connections(), 0, "connections left after {ms} ms");
    }

    /// TCP connections both endpoints (`t`, `o`) still hold.
    pub fn connections(&self) -> u64 {
        self.meter("module.t.connections_active") + self.meter("module.o.connections_active")
    }

    /// A u64 meter of the registry.
    pub fn meter(&self, name: &str) -> u64 {
        match self.sw.registry().snapshot().get(name).unwrap_or_else(|| panic!("no variable {name}")).get() {
            Value::U64(v) => v,
            other => panic!("{name} is {other:?}"),
        }
    }

    /// A text meter of the registry.
    pub fn text(&self, name: &str) -> Option<String> {
        match self.sw.registry().snapshot().get(name)?.get() {
            Value::Str(s) => Some(s),
            other => panic!("{name} is {other:?}"),
        }
    }

    pub fn passed(&self) -> Vec<Seen> {
        take(&self.passed)
    }

    pub fn net_passed(&self) -> Vec<Seen> {
        take(&self.net_passed)
    }
}

/// Deterministic pseudo-random bytes.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// A transfer in progress on one socket: what to send, what was sent, what arrived.
#[derive(Default)]
pub struct Pump {
    pub out: Vec<u8>,
    pub sent: usize,
    pub got: Vec<u8>,
    pub close_after: bool,
    pub closed: bool,
}

impl Pump {
    pub fn new(out: Vec<u8>, close_after: bool) -> Pump {
        Pump { out, close_after, ..Pump::default() }
    }

    /// Sends what the socket takes, reads what it has, closes when all was sent (if asked).
    pub fn drive(&mut self, s: &mut tcp::Socket<'static>) {
        if s.can_send() && self.sent < self.out.len() {
            self.sent += s.send_slice(&self.out[self.sent..]).unwrap_or(0);
        }
        while s.can_recv() {
            let got = &mut self.got;
            let _ = s.recv(|b| {
                got.extend_from_slice(b);
                (b.len(), ())
            });
        }
        if self.close_after && !self.closed && self.sent == self.out.len() && s.may_send() {
            s.close();
            self.closed = true;
        }
    }
}

/// The TCP flags of each packet, for packets that are TCP (IPv4 without options, or IPv6 without extension headers).
pub fn tcp_flags(packet: &[u8]) -> Option<u8> {
    let l4 = match packet.first()? >> 4 {
        4 if packet.get(9) == Some(&6) => usize::from(packet[0] & 0x0f) * 4,
        6 if packet.get(6) == Some(&6) => 40,
        _ => return None,
    };
    packet.get(l4 + 13).copied()
}

/// The endpoints of an address family as socket addresses.
/// True for a TCP segment with RST set.
pub fn is_rst(packet: &[u8]) -> bool {
    tcp_flags(packet).is_some_and(|f| f & 0x04 != 0)
}

pub fn sa(ip: IpAddr, port: u16) -> SocketAddr {
    SocketAddr::new(ip, port)
}

/// An IP packet from `src` to `dst` carrying `l4` (the transport bytes, checksum already in place).
pub fn ip(src: IpAddr, dst: IpAddr, protocol: u8, l4: &[u8]) -> Vec<u8> {
    use flexstack_wire::checksum;
    let mut p = Vec::new();
    match (src, dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            let total = 20 + l4.len();
            p.extend_from_slice(&[0x45, 0, (total >> 8) as u8, total as u8, 0, 1, 0x40, 0, 64, protocol, 0, 0]);
            p.extend_from_slice(&s.octets());
            p.extend_from_slice(&d.octets());
            let c = checksum::ipv4_header(&p);
            p[10..12].copy_from_slice(&c.to_be_bytes());
        }
        (IpAddr::V6(s), IpAddr::V6(d)) => {
            let len = l4.len();
            p.extend_from_slice(&[0x60, 0, 0, 0, (len >> 8) as u8, len as u8, protocol, 64]);
            p.extend_from_slice(&s.octets());
            p.extend_from_slice(&d.octets());
        }
        _ => panic!("mixed families"),
    }
    p.extend_from_slice(l4);
    p
}

/// A UDP datagram with a right checksum.
pub fn udp(src: SocketAddr, dst: SocketAddr, payload: &[u8]) -> Vec<u8> {
    use flexstack_wire::checksum;
    let len = 8 + payload.len();
    let mut u = Vec::with_capacity(len);
    u.extend_from_slice(&src.port().to_be_bytes());
    u.extend_from_slice(&dst.port().to_be_bytes());
    u.extend_from_slice(&(len as u16).to_be_bytes());
    u.extend_from_slice(&[0, 0]);
    u.extend_from_slice(payload);
    let c = checksum::finish_transport(checksum::sum(checksum::pseudo_header(src.ip(), dst.ip(), 17, len as u32), &u));
    u[6..8].copy_from_slice(&c.to_be_bytes());
    ip(src.ip(), dst.ip(), 17, &u)
}

/// A TCP segment with `options` (padded to 4 bytes), `flags` and a right checksum (unless `bad_checksum`).
#[allow(clippy::too_many_arguments)]
pub fn tcp(
    src: SocketAddr,
    dst: SocketAddr,
    seq: u32,
    ack: u32,
    flags: u8,
    options: &[u8],
    payload: &[u8],
    bad_checksum: bool,
) -> Vec<u8> {
    use flexstack_wire::checksum;
    let mut opts = options.to_vec();
    while !opts.len().is_multiple_of(4) {
        opts.push(0);
    }
    let doff = (20 + opts.len()) / 4;
    let mut t = Vec::new();
    t.extend_from_slice(&src.port().to_be_bytes());
    t.extend_from_slice(&dst.port().to_be_bytes());
    t.extend_from_slice(&seq.to_be_bytes());
    t.extend_from_slice(&ack.to_be_bytes());
    t.extend_from_slice(&[(doff as u8) << 4, flags, 0xff, 0xff, 0, 0, 0, 0]);
    t.extend_from_slice(&opts);
    t.extend_from_slice(payload);
    let mut c = checksum::finish(checksum::sum(checksum::pseudo_header(src.ip(), dst.ip(), 6, t.len() as u32), &t));
    if bad_checksum {
        c ^= 0x5555;
    }
    t[16..18].copy_from_slice(&c.to_be_bytes());
    ip(src.ip(), dst.ip(), 6, &t)
}

/// The payload of a UDP packet (IPv4 without options, or IPv6 without extension headers) and its endpoints.
pub fn parse_udp(p: &[u8]) -> Option<(SocketAddr, SocketAddr, Vec<u8>)> {
    let info = flexstack_wire::packet::PacketInfo::parse(p).ok()?;
    (info.protocol == 17).then(|| {
        (
            SocketAddr::new(info.src, info.src_port),
            SocketAddr::new(info.dst, info.dst_port),
            p[info.l4_offset + 8..info.total_len].to_vec(),
        )
    })
}

/// An ICMP destination unreachable (port) from `from` to `to` quoting `original`.
pub fn icmp_unreachable(from: std::net::IpAddr, to: std::net::IpAddr, original: &[u8]) -> Vec<u8> {
    use flexstack_wire::checksum;
    let quote = &original[..original.len().min(if from.is_ipv4() { 28 } else { 48 })];
    let mut m = vec![if from.is_ipv4() { 3 } else { 1 }, if from.is_ipv4() { 3 } else { 4 }, 0, 0, 0, 0, 0, 0];
    m.extend_from_slice(quote);
    let proto = if from.is_ipv4() { 1 } else { 58 };
    let init = if from.is_ipv4() { 0 } else { checksum::pseudo_header(from, to, 58, m.len() as u32) };
    let c = checksum::finish(checksum::sum(init, &m));
    m[2..4].copy_from_slice(&c.to_be_bytes());
    ip(from, to, proto, &m)
}
