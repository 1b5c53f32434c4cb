//! flexstack-modules: the built-in module kinds, one family a folder.
//!
//! | family | kinds |
//! |---|---|
//! | [`basic`] | `counter`, `direction`, `select` (Click's Switch), `sink`, `source`, `tap` (pcapng) |
//! | [`ip`] | `ip`, `reassemble`, `icmp` (its error builder), `ethernet` (Ethernet, ARP, NDP; in `link.rs`) |
//! | [`flow`] | `classify` (the flow table), `nat`, `firewall` |
//! | [`sched`] | `emulator`, `late-binding`, `early-binding` |
//! | [`stream`] | `terminate`, `originate` (user-space TCP/UDP endpoints), `stream-pass`, `stream-tap` (docs/streams.md) |
//!
//! Every kind is a sans-IO state machine: it reads no clock (time comes from [`Output::now`]), sleeps never and
//! spawns no thread; only the taps touch files (`tap` opens its file when it is configured; `stream-tap` creates
//! its folder then, and one file per direction of each flow it records when the flow starts). Every knob is also
//! accepted as a setting of the same name, so a stack saved with its current knob values loads again.
//!
//! A new kind goes in its family's folder and gets one line in [`kinds`]. A renamed kind keeps its old name as an
//! alias ([`ALIASES`]), which still loads and makes the daemon log a deprecation warning once.
//!
//! [`Output::now`]: flexstack_core::Output::now
#![deny(unsafe_code)]
#![warn(missing_docs)]

pub mod basic;
pub mod flow;
pub mod ip;
pub mod sched;
pub mod stream;

use flexstack_core::{Catalog, ModuleKind};

/// Every built-in kind: the registration list (the catalog lists them by name).
pub fn kinds() -> Vec<Box<dyn ModuleKind>> {
    let built_in: Vec<Box<dyn ModuleKind>> = vec![
        Box::new(basic::counter::CounterKind),
        Box::new(basic::direction::DirectionKind),
        Box::new(sched::emulator::EmulatorKind),
        Box::new(basic::sink::SinkKind),
        Box::new(basic::source::SourceKind),
        Box::new(basic::select::SelectKind),
        Box::new(basic::tap::TapKind),
        Box::new(ip::reassemble::ReassembleKind),
        Box::new(ip::ip::IpKind),
        Box::new(ip::icmp::IcmpKind),
        Box::new(flow::classify::ClassifyKind),
        Box::new(flow::firewall::FirewallKind),
        Box::new(flow::nat::NatKind),
        Box::new(ip::link::LinkKind),
        Box::new(sched::binding::LateBindingKind),
        Box::new(sched::binding::EarlyBindingKind),
        Box::new(stream::pass::StreamPassKind),
        Box::new(stream::tap::StreamTapKind),
        Box::new(stream::terminate::TerminateKind),
        Box::new(stream::originate::OriginateKind),
        Box::new(stream::carrier::CarrierKind),
    ];
    built_in.into_iter().chain(stream::services::kinds()).collect()
}

/// Old names of renamed kinds, and their new names: `switch` is the runtime that drives the graph, and a link is an
/// edge of the linking table.
pub const ALIASES: [(&str, &str); 2] = [("switch", basic::select::KIND), ("link", ip::link::KIND)];

/// Adds every built-in kind, and the old names of renamed ones, to `catalog`.
pub fn register(catalog: &mut Catalog) {
    for kind in kinds() {
        catalog.register(kind);
    }
    for (old, new) in ALIASES {
        catalog.alias(old, new);
    }
}

/// A catalog holding every built-in kind.
pub fn catalog() -> Catalog {
    let mut c = Catalog::new();
    register(&mut c);
    c
}

#[cfg(test)]
pub(crate) mod testutil {
    //! Helpers shared by the modules' tests: loading modules into a switch, reading meters, a recording module.

    use flexstack_core::frame::{Gso, GsoKind};
    use flexstack_core::{
        Batch, ConfigError, Direction, Edit, Frame, ModuleBuilder, PacketPool, Settings, StackSpec, Switch, Time, Value,
    };
    use std::net::IpAddr;

    /// Settings from `key=value` words.
    pub fn settings(args: &[&str]) -> Settings {
        let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        Settings::from_args(&args).expect("valid test settings")
    }

    /// A `Load` edit for a module of a built-in kind.
    pub fn load(name: &str, kind: &str, args: &[&str]) -> Edit {
        let settings = settings(args);
        let builder = crate::catalog().configure(kind, &settings, None).unwrap_or_else(|e| panic!("{kind}: {e}"));
        Edit::Load { name: name.into(), kind: kind.into(), settings, builder }
    }

    /// A `Link` edit.
    pub fn link(text: &str) -> Edit {
        Edit::Link(flexstack_core::LinkSpec::parse(text).expect("valid link"))
    }

    /// A `SetKnob` edit.
    pub fn knob(module: &str, knob: &str, value: Value) -> Edit {
        Edit::SetKnob { module: module.into(), knob: knob.into(), value }
    }

    /// Configures the first module of a stack description with the built-in catalog.
    pub fn configure_toml(text: &str) -> Result<Box<dyn ModuleBuilder>, ConfigError> {
        let spec = StackSpec::parse("test.toml", text).expect("valid stack description");
        let m = &spec.modules[0];
        crate::catalog().configure(&m.kind, &m.settings, m.location.clone())
    }

    /// Configures the first module of `text` (a stack description) expecting an error; asserts that the error
    /// points at line `line` (when given) and that its message contains each of `needles`.
    pub fn assert_config_error(text: &str, line: Option<usize>, needles: &[&str]) {
        let e = configure_toml(text).err().unwrap_or_else(|| panic!("configured: {text:?}"));
        if let Some(line) = line {
            assert_eq!(e.location.as_ref().map(|l| l.line), Some(line), "{e}");
        }
        for needle in needles {
            assert!(e.message.contains(needle), "{needle:?} not in: {e}");
        }
    }

    /// The value of a registry variable.
    pub fn var(sw: &Switch, name: &str) -> Value {
        sw.registry().snapshot().get(name).unwrap_or_else(|| panic!("no variable {name}")).get()
    }

    /// The value of a u64 registry variable.
    pub fn u64_var(sw: &Switch, name: &str) -> u64 {
        match var(sw, name) {
            Value::U64(v) => v,
            other => panic!("{name} is {other:?}, not u64"),
        }
    }

    /// `n` packets of `size` bytes, each carrying its index in its first byte.
    pub fn packets(pool: &PacketPool, n: usize, size: usize) -> Batch {
        (0..n)
            .map(|i| {
                let mut p = pool.alloc();
                p.make_mut().resize(size, 0);
                if size > 0 {
                    p.make_mut()[0] = i as u8;
                }
                Frame::Data(p)
            })
            .collect()
    }

    /// Injects packets with the given bytes, travelling in `direction`, into input `port` of `module`.
    pub fn inject_into<P: AsRef<[u8]>>(sw: &mut Switch, module: &str, port: &str, packets: &[P], direction: Direction) {
        let mut batch: Batch = packets
            .iter()
            .map(|b| {
                let mut p = sw.pool().alloc_from(b.as_ref());
                p.set_direction(direction);
                Frame::Data(p)
            })
            .collect();
        sw.inject(module, port, &mut batch).expect("inject");
    }

    pub use flexstack_core::testing::{Log, Recorder};

    /// A switch holding one module, `name` of `kind` with `args`, whose output goes to a recorder (`r`), and the
    /// recorder's log.
    pub fn recorded(name: &str, kind: &str, args: &[&str]) -> (Switch, Log) {
        let mut sw = Switch::default();
        let (rec, log) = Recorder::load("r");
        sw.apply(vec![load(name, kind, args), rec, link(&format!("{name} -> r"))]).unwrap();
        (sw, log)
    }

    /// A TCP super-packet as a TUN face reads it: IPv4 (DF) or IPv6 from `src` to `dst`, ports 1000 -> 2000,
    /// flags ACK|PSH, `payload` bytes, segments of `mss`; its checksum field holds the pseudo-header sum only.
    pub fn tcp_super_packet(src: IpAddr, dst: IpAddr, payload: usize, mss: u16) -> (Vec<u8>, Gso) {
        use flexstack_wire::packet::build;
        let data: Vec<u8> = (0..payload).map(|i| (i * 7 + 3) as u8).collect();
        let mut tcp = build::tcp(src, dst, 1000, 2000, &data);
        tcp[13] = 0x18;
        let pseudo = flexstack_wire::checksum::pseudo_header(src, dst, 6, tcp.len() as u32);
        tcp[16..18].copy_from_slice(&(!flexstack_wire::checksum::finish(pseudo)).to_be_bytes());
        let (packet, ip, kind) = match (src, dst) {
            (IpAddr::V4(s), IpAddr::V4(d)) => (build::ipv4(s, d, 6, 64, &tcp), 20, GsoKind::TcpV4),
            (IpAddr::V6(s), IpAddr::V6(d)) => (build::ipv6(s, d, 6, 64, &tcp), 40, GsoKind::TcpV6),
            _ => panic!("addresses of one family"),
        };
        (packet, Gso { kind, gso_size: mss, hdr_len: ip + 20, csum_start: ip, l3_offset: 0, ecn: false })
    }

    /// The on-wire packets a recorded frame stands for: a super-packet's segments, cut, or the frame itself.
    fn cut_seen(s: &flexstack_core::testing::Seen) -> Vec<Vec<u8>> {
        match Gso::of(&s.meta) {
            Some(g) if g.segments(s.data.len()) > 1 => (0..g.segments(s.data.len()))
                .map(|i| {
                    let mut v = Vec::new();
                    g.segment_into(&s.data, i, &mut v);
                    v
                })
                .collect(),
            _ => vec![s.data.clone()],
        }
    }

    /// Asserts that a module of `kind` (which must take GSO super-packets whole) does to super-packets what it does
    /// to their segments: `packets` (bytes, description, direction) go into input `input` of a module `m` once as
    /// super-packets and once cut first, each time into a fresh switch; what leaves each of `outputs`, cut, is
    /// the same bytes (checksums included) in the same order, and the meters `meters` of `m` (or, named
    /// `flow.…`, those of its flows) read the same.
    /// Returns how many frames left whole as super-packets (so that a test can tell they were not cut).
    pub fn assert_same_as_cut_first(
        kind: &str,
        args: &[&str],
        input: &str,
        outputs: &[&str],
        packets: &[(Vec<u8>, Gso, Direction)],
        meters: &[&str],
    ) -> usize {
        let takes = crate::catalog().get(kind).is_some_and(|k| k.reference().accepts_gso);
        assert!(takes, "{kind} does not take super-packets whole: the switch would cut them before it");
        let run = |cut_first: bool| {
            let mut sw = Switch::default();
            let mut edits = vec![load("m", kind, args)];
            let mut logs = Vec::new();
            for (i, port) in outputs.iter().enumerate() {
                let (rec, log) = Recorder::load(&format!("r{i}"));
                edits.extend([rec, link(&format!("m[{port}] -> r{i}"))]);
                logs.push(log);
            }
            sw.apply(edits).unwrap();
            let pool = sw.pool().clone();
            let mut batch: Batch = packets
                .iter()
                .map(|(bytes, gso, direction)| {
                    let mut p = pool.alloc_from(bytes);
                    p.set_direction(*direction);
                    p.meta_mut().set(flexstack_core::MetaKey::GSO, gso.pack());
                    Frame::Data(p)
                })
                .collect();
            if cut_first {
                flexstack_core::switch::segment_batch(&pool, &mut batch);
            }
            sw.inject("m", input, &mut batch).unwrap();
            sw.run(Time::ZERO);
            let seen: Vec<Vec<flexstack_core::testing::Seen>> =
                logs.iter().map(flexstack_core::testing::take).collect();
            let whole = seen.iter().flatten().filter(|s| cut_seen(s).len() > 1).count();
            let bytes: Vec<Vec<Vec<u8>>> = seen.iter().map(|l| l.iter().flat_map(cut_seen).collect()).collect();
            let name = |m: &str| if m.starts_with("flow.") { m.to_string() } else { format!("module.m.{m}") };
            let read: Vec<u64> = meters.iter().map(|m| u64_var(&sw, &name(m))).collect();
            (bytes, read, whole)
        };
        let (whole_bytes, whole_meters, whole) = run(false);
        let (cut_bytes, cut_meters, _) = run(true);
        assert!(whole_bytes.iter().any(|o| !o.is_empty()), "nothing left {kind}");
        // Where they first differ, without printing kilobytes of packets.
        for (port, (w, c)) in outputs.iter().zip(whole_bytes.iter().zip(&cut_bytes)) {
            assert_eq!(w.len(), c.len(), "{kind}[{port}]: packets out, super-packets cut vs segments handled");
            for (i, (a, b)) in w.iter().zip(c).enumerate() {
                let at = a.iter().zip(b).position(|(x, y)| x != y);
                assert!(
                    a == b,
                    "{kind}[{port}] packet {i}: {} vs {} bytes, first difference at {at:?}",
                    a.len(),
                    b.len()
                );
            }
        }
        assert_eq!(whole_meters, cut_meters, "{kind}: meters {meters:?}");
        whole
    }

    /// Drives a switch with `run` at every `step` from `from` up to and including `to`.
    pub fn run_every(sw: &mut Switch, from: Time, to: Time, step: std::time::Duration) {
        let mut t = from;
        while t <= to {
            sw.run(t);
            t = t + step;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::testutil::*;
    use flexstack_core::{Edit, StackSpec, Switch};

    #[test]
    fn catalog_has_the_built_in_kinds() {
        // Every registered kind is in the catalog once, by its own name (two kinds of one name would hide one),
        // and none of the known kinds is missing. A new kind needs no change here: only its registration line.
        let names: Vec<&str> = super::catalog().kinds().map(|k| k.name()).collect();
        let registered: std::collections::BTreeSet<&str> = super::kinds().iter().map(|k| k.name()).collect();
        assert_eq!(registered.len(), super::kinds().len(), "two kinds share a name");
        assert_eq!(names, registered.into_iter().collect::<Vec<_>>());
        for known in [
            "classify",
            "counter",
            "direction",
            "early-binding",
            "emulator",
            "ethernet",
            "carrier",
            "firewall",
            "icmp",
            "ip",
            "late-binding",
            "nat",
            "originate",
            "reassemble",
            "select",
            "sink",
            "source",
            "stream-pass",
            "stream-tap",
            "tap",
            "terminate",
        ] {
            assert!(names.contains(&known), "{known} is not in the catalog: {names:?}");
        }
        for k in super::catalog().kinds() {
            assert!(!k.summary().is_empty());
        }
    }

    #[test]
    fn kinds_say_whether_their_modules_need_a_global_view() {
        // The data plane asks the kind (its declaration's `global_view`), then the builder.
        let c = super::catalog();
        for kind in
            ["nat", "ethernet", "tap", "stream-tap", "late-binding", "early-binding", "emulator", "record", "shape"]
        {
            assert!(c.get(kind).unwrap().global_view(), "{kind}");
        }
        for kind in ["counter", "classify", "ip"] {
            assert!(!c.get(kind).unwrap().global_view(), "{kind}");
        }
    }

    /// Stack files written with the old names of renamed kinds still load them.
    #[test]
    fn old_kind_names_still_load() {
        let c = super::catalog();
        assert_eq!(c.canonical("switch"), Some("select"));
        assert_eq!(c.canonical("link"), Some("ethernet"));
        let text =
            "links = [\"sel[1] -> s\"]\n[modules.sel]\nkind = \"switch\"\nselect = 1\n[modules.s]\nkind = \"sink\"\n";
        let spec = StackSpec::parse("old.toml", text).unwrap();
        let mut edits = Vec::new();
        for m in &spec.modules {
            let builder = c.configure(&m.kind, &m.settings, m.location.clone()).unwrap();
            edits.push(Edit::Load {
                name: m.name.clone(),
                kind: m.kind.clone(),
                settings: m.settings.clone(),
                builder,
            });
        }
        edits.extend(spec.links.iter().map(|l| Edit::Link(l.link.clone())));
        let mut sw = Switch::default();
        sw.apply(edits).unwrap();
        assert_eq!(var(&sw, "module.sel.select"), flexstack_core::Value::I64(1));
        let e = c.configure("link", &Default::default(), None).err().unwrap();
        assert!(e.message.contains("`mac`"), "the link kind is the ethernet kind: {e}");
    }

    /// A running stack written back with its knobs as settings (as the daemon saves it) configures again.
    #[test]
    fn saved_stack_with_knob_values_loads_again() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.pcapng");
        let path_arg = format!("path={}", path.display());
        let mut sw = Switch::default();
        sw.apply(vec![
            load("src", "source", &["rate=250.5", "size=100", "count=7"]),
            load("c", "counter", &[]),
            load("sel", "select", &["outputs=3", "select=2"]),
            load("t", "tap", &[&path_arg, "linktype=\"ethernet\""]),
            load("s", "sink", &[]),
            link("src -> c"),
            link("c -> sel"),
            link("sel[2] -> t"),
            link("t -> s"),
        ])
        .unwrap();
        sw.apply(vec![knob("sel", "select", flexstack_core::Value::I64(-1))]).unwrap();
        let text = sw.describe().to_toml();
        let spec = StackSpec::parse("saved.toml", &text).unwrap();
        let cat = super::catalog();
        let mut edits = Vec::new();
        for m in &spec.modules {
            let builder = cat.configure(&m.kind, &m.settings, m.location.clone()).unwrap_or_else(|e| panic!("{e}"));
            edits.push(Edit::Load {
                name: m.name.clone(),
                kind: m.kind.clone(),
                settings: m.settings.clone(),
                builder,
            });
        }
        for l in &spec.links {
            edits.push(Edit::Link(l.link.clone()));
        }
        let mut again = Switch::default();
        again.apply(edits).unwrap();
        assert_eq!(var(&again, "module.sel.select"), flexstack_core::Value::I64(-1));
        assert_eq!(var(&again, "module.src.rate"), flexstack_core::Value::F64(250.5));
        assert_eq!(u64_var(&again, "module.src.size"), 100);
        assert_eq!(u64_var(&again, "module.src.count"), 7);
        assert_eq!(var(&again, "module.t.enabled"), flexstack_core::Value::Bool(true));
    }
}
