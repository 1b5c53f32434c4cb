//! The settings, knobs and meters of a binding module, declared once (one declaration per kind, and one for each
//! kind's per-interface group), and the settings read by hand: interfaces, classes, addresses.

use super::{ClassRule, IfaceMeters, Meters, EARLY_KIND, LATE_KIND, MAX_INTERFACES};
use flexstack_core::config::{valid_name, SettingsReader};
use flexstack_core::module::port_type;
use flexstack_core::{field, ConfigError, GroupDecl, KindDecl, MeterDecl, Param, PortDecl, Settings};
use flexstack_wire::packet::ParseDrops;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// Highest rate, in Mbit/s (10^12 bit/s).
pub(crate) const MAX_RATE_MBIT: f64 = 1_000_000.0;
pub(crate) const MAX_DEVICE_QUEUE: u64 = 1_000_000;
/// Largest per-packet link-layer overhead modelled, in bytes.
pub(crate) const MAX_OVERHEAD: u64 = 1024;
pub(crate) const MAX_QUEUE_LIMIT: u64 = 10_000_000;
pub(crate) const MAX_QUANTUM: u64 = 1_000_000;
pub(crate) const MIN_QUANTUM: u64 = 64;
pub(crate) const MAX_WEIGHT: u64 = 1_000_000;
pub(crate) const MAX_IDLE_MS: u64 = 7 * 24 * 3_600_000;
/// Most class overrides remembered for flows not seen yet.
pub(crate) const MAX_OVERRIDES: usize = 65_536;
/// Port names an interface may not take.
const RESERVED: [&str; 4] = ["in", "up_in", "up_out", "ctl"];

/// How the interface of a packet is chosen.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Policy {
    /// The first interface that is up, in the order of `interfaces`.
    #[default]
    Preferred,
    /// A flow stays on its interface while it is up; first choice: the fastest.
    Affinity,
    /// Flows split over the up interfaces in proportion to their weights.
    Weighted,
    /// Per packet, the up interface whose modelled transmission would end first.
    Fastest,
}

impl Policy {
    const NAMES: [(&'static str, Policy); 4] = [
        ("preferred", Policy::Preferred),
        ("affinity", Policy::Affinity),
        ("weighted", Policy::Weighted),
        ("fastest", Policy::Fastest),
    ];

    /// The policy named `s`.
    pub fn parse(s: &str) -> Option<Policy> {
        Self::NAMES.iter().find(|(n, _)| *n == s).map(|(_, p)| *p)
    }

    /// The policy's name.
    pub fn name(self) -> &'static str {
        Self::NAMES.iter().find(|(_, p)| *p == self).map_or("", |(n, _)| n)
    }
}

/// When a bound packet is handed to its interface's output port (knob `<iface>.emit`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Emit {
    /// At its modelled transmission start (the default): the model paces the packets itself.
    #[default]
    Start,
    /// At binding, when it is admitted to the modelled device queue: the link behind the port paces them, the
    /// model only decides when there is room.
    Admit,
}

impl Emit {
    const NAMES: [(&'static str, Emit); 2] = [("start", Emit::Start), ("admit", Emit::Admit)];

    /// The emission point named `s`.
    pub fn parse(s: &str) -> Option<Emit> {
        Self::NAMES.iter().find(|(n, _)| *n == s).map(|(_, e)| *e)
    }

    /// The emission point's name.
    pub fn name(self) -> &'static str {
        Self::NAMES.iter().find(|(_, e)| *e == self).map_or("", |(n, _)| n)
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) enum Mode {
    #[default]
    Late,
    Early,
}

impl Mode {
    /// The kind's declaration.
    pub(super) fn decl(self) -> &'static KindDecl<Config, Meters> {
        match self {
            Mode::Late => &LATE,
            Mode::Early => &EARLY,
        }
    }

    /// The declaration of the kind's per-interface settings, knobs and meters.
    pub(super) fn iface_decl(self) -> &'static GroupDecl<IfaceConfig, IfaceMeters> {
        match self {
            Mode::Late => &LATE_IFACE,
            Mode::Early => &EARLY_IFACE,
        }
    }
}

/// One interface's configuration (knobs included). `Default` is a blank to read it into: the defaults are
/// declared in the kind's per-interface group.
#[derive(Clone, Debug, Default)]
pub(crate) struct IfaceConfig {
    pub(super) name: String,
    pub(super) address_v4: Option<Ipv4Addr>,
    pub(super) address_v6: Option<Ipv6Addr>,
    pub(super) rate_bps: u64,
    pub(super) overhead_bytes: u64,
    pub(super) device_queue: u64,
    pub(super) up: bool,
    pub(super) weight: u64,
    pub(super) fifo_limit: u64,
    /// When a bound packet is emitted: at its modelled transmission start, or at once.
    pub(super) emit: Emit,
    /// The face module whose link state drives `up` (carrier lost: down; back: up).
    pub(super) face: Option<String>,
}

/// The module's settings and knobs besides the interfaces' (`Default` is a blank to read them into: the defaults
/// are declared in `LATE` and `EARLY`).
#[derive(Clone, Debug, Default)]
pub(crate) struct Config {
    pub(super) mode: Mode,
    pub(super) policy: Policy,
    pub(super) quantum: u64,
    pub(super) queue_limit: u64,
    pub(super) flow_idle_ns: u64,
    pub(super) rules: Vec<ClassRule>,
    pub(super) virtual_v4: Option<Ipv4Addr>,
    pub(super) virtual_v6: Option<Ipv6Addr>,
    pub(super) vars_prefix: String,
}

type P = Param<Config>;

const INTERFACES: P = P::manual(
    "interfaces",
    "array of strings",
    "the interfaces, in order of preference: one output port each (not `in`, `up_in`, `up_out`, `ctl`)",
    "required",
);
const POLICY: P = P::text(
    "policy",
    "preferred, affinity, weighted or fastest",
    "preferred",
    |c| c.policy.name().into(),
    |c, t| {
        c.policy =
            Policy::parse(t).ok_or_else(|| format!("expected preferred, affinity, weighted or fastest, got {t:?}"))?;
        Ok(())
    },
);
const FLOW_IDLE: P = P::u64(
    "flow_idle_ms",
    "ms",
    "a flow with nothing queued is forgotten after this",
    30_000,
    (|c| c.flow_idle_ns / 1_000_000, |c, ms| c.flow_idle_ns = ms * 1_000_000),
)
.range(1.0, MAX_IDLE_MS as f64);
const QUANTUM: P = P::u64("quantum", "bytes", "deficit round robin: bytes per flow per round", 1514, field!(quantum))
    .range(MIN_QUANTUM as f64, MAX_QUANTUM as f64);
const QUEUE_LIMIT: P =
    P::u64("queue_limit", "frames", "most packets above the binding point", 10_000, field!(queue_limit))
        .range(1.0, MAX_QUEUE_LIMIT as f64);
const CLASS_RULES: P = P::manual(
    "class_rules",
    "array of strings",
    "class rules (`CLASS [PROTOCOL] [port PORTS] [dscp N]`), in order: the first that matches a new flow decides",
    "none",
);
const VIRTUAL_V4: P =
    P::manual("virtual_v4", "str", "address packets coming up to an interface's IPv4 address are mapped to", "none");
const VIRTUAL_V6: P =
    P::manual("virtual_v6", "str", "address packets coming up to an interface's IPv6 address are mapped to", "none");
const VARS_PREFIX: P = P::text(
    "vars_prefix",
    "prefix of the flows' variables: `flow` or `flow.NAME`",
    "flow",
    |c| c.vars_prefix.clone(),
    |c, t| {
        if !(t == "flow" || t.strip_prefix("flow.").is_some_and(|rest| rest.split('.').all(valid_name))) {
            return Err(format!("expected `flow` or `flow.NAME`, got {t:?}"));
        }
        c.vars_prefix = t.into();
        Ok(())
    },
)
.setting();

const INPUTS: &[PortDecl] = &[
    PortDecl::new("in", port_type::IP, "packets going down, to bind to an interface"),
    PortDecl::new("up_in", port_type::IP, "packets coming up"),
];
const OUTPUTS: &[PortDecl] = &[
    PortDecl::new("<iface>", port_type::IP, "one port per interface, named after it: the packets bound to it"),
    PortDecl::new("up_out", port_type::IP, "the packets coming up, mapped to the virtual address"),
];

/// The module-level meters.
const METERS: &[MeterDecl<Meters>] = &[
    MeterDecl::u64("queued", "frames", "packets waiting above the binding point (late) or in the FIFOs (early)", |m| {
        &mut m.queued
    }),
    MeterDecl::u64(
        "queued_bytes",
        "bytes",
        "bytes waiting above the binding point (late) or in the FIFOs (early)",
        |m| &mut m.queued_bytes,
    ),
    MeterDecl::u64("flows_active", "flows", "flows the scheduler knows", |m| &mut m.flows_active),
    MeterDecl::u64(
        "rebinds_total",
        "frames",
        "packets bound to another interface than their flow's previous packet",
        |m| &mut m.rebinds,
    ),
    MeterDecl::u64(
        "drop_queue_full_total",
        "frames",
        "packets dropped: queue_limit (late) or an interface's FIFO (early) full",
        |m| &mut m.drop_full,
    ),
    MeterDecl::u64(
        "drop_no_interface_total",
        "frames",
        "packets dropped on arrival with no interface up (early)",
        |m| &mut m.drop_no_iface,
    ),
    MeterDecl::u64(
        "drop_interface_down_total",
        "frames",
        "packets lost below the binding point when their interface went down",
        |m| &mut m.drop_down,
    ),
    MeterDecl::u64(
        "up_mapped_total",
        "frames",
        "packets coming up whose destination was mapped to the virtual address",
        |m| &mut m.up_mapped,
    ),
    MeterDecl::u64(
        "flow_vars_unpublished_total",
        "flows",
        "flows whose runtime variables could not be registered",
        |m| &mut m.unpublished,
    ),
];

/// The `late-binding` kind.
const LATE: KindDecl<Config, Meters> = KindDecl {
    inputs: INPUTS,
    outputs: OUTPUTS,
    params: &[INTERFACES, POLICY, FLOW_IDLE, QUANTUM, QUEUE_LIMIT, CLASS_RULES, VIRTUAL_V4, VIRTUAL_V6, VARS_PREFIX],
    meters: METERS,
    more_meters: || ParseDrops::specs(true),
    // Schedules every flow of its interfaces together: the stack runs on one data-plane worker.
    global_view: true,
    ..KindDecl::new(
        LATE_KIND,
        "per-flow queues above a binding point; each packet bound to an interface (policy, address) only when it has room",
    )
};

/// The `early-binding` kind: `quantum` and `queue_limit` are accepted, but unused.
const EARLY: KindDecl<Config, Meters> = KindDecl {
    params: &[
        INTERFACES,
        POLICY,
        FLOW_IDLE,
        QUANTUM.setting(),
        QUEUE_LIMIT.setting(),
        CLASS_RULES,
        VIRTUAL_V4,
        VIRTUAL_V6,
        VARS_PREFIX,
    ],
    name: EARLY_KIND,
    summary: "stock-Linux comparison: interface chosen at enqueue, per-interface FIFO and device buffer, lost when it \
              goes down",
    ..LATE
};

type I = Param<IfaceConfig>;

const ADDRESS_V4: I =
    I::manual("address_v4", "str", "source address of the IPv4 packets bound to the interface; none: kept", "none");
const ADDRESS_V6: I =
    I::manual("address_v6", "str", "source address of the IPv6 packets bound to the interface; none: kept", "none");
/// `mbit` Mbit/s in bit/s, as the model counts: a rate above 0 stays above 0 (0 is unmodelled).
fn bps_of(mbit: f64) -> u64 {
    let bps = (mbit * 1e6).round() as u64;
    if mbit > 0.0 {
        bps.max(1)
    } else {
        0
    }
}

const RATE: I = I::f64(
    "rate_mbit",
    "Mbit/s",
    "modelled transmit rate, as a lab link's `bw`; 0 = unmodelled",
    0.0,
    (|c| c.rate_bps as f64 / 1e6, |c, mbit| c.rate_bps = bps_of(mbit)),
)
.range(0.0, MAX_RATE_MBIT);
/// `rate_mbit`'s old name, in bit/s.
const RATE_BPS: I = I::u64("rate_bps", "bit/s", "the rate in bit/s", 0, field!(rate_bps))
    .range(0.0, MAX_RATE_MBIT * 1e6)
    .renamed_to("rate_mbit");
const OVERHEAD: I = I::u64(
    "overhead_bytes",
    "bytes",
    "link-layer bytes added to each packet in the modelled transmission time (Ethernet: 14)",
    0,
    field!(overhead_bytes),
)
.range(0.0, MAX_OVERHEAD as f64);
/// The size of the modelled device queue, by default `default`.
const fn device_queue(default: u64) -> I {
    I::u64("device_queue", "frames", "size of the modelled device queue", default, field!(device_queue))
        .range(1.0, MAX_DEVICE_QUEUE as f64)
}
const EMIT: I = I::text(
    "emit",
    "start (emit a packet at its modelled transmission start) or admit (at once, when it enters the device queue)",
    "start",
    |c| c.emit.name().into(),
    |c, t| {
        c.emit = Emit::parse(t).ok_or_else(|| format!("expected start or admit, got {t:?}"))?;
        Ok(())
    },
);
const UP: I = I::bool("up", "the interface is up", true, field!(up));
const WEIGHT: I =
    I::u64("weight", "", "share of flows (policy weighted)", 1, field!(weight)).range(0.0, MAX_WEIGHT as f64);
const FIFO_LIMIT: I = I::u64("fifo_limit", "frames", "most packets in the FIFO", 1000, field!(fifo_limit))
    .range(0.0, MAX_QUEUE_LIMIT as f64);
const FACE: I = I::manual("face", "str", "the face module whose link drives `up` (carrier lost: down)", "none");

/// The per-interface meters.
const IFACE_METERS: &[MeterDecl<IfaceMeters>] = &[
    MeterDecl::u64("queue_len", "frames", "packets in the interface's FIFO (early binding)", |m| &mut m.queue_len),
    MeterDecl::u64("device_queue_len", "frames", "packets in the modelled device queue", |m| &mut m.device_queue_len),
    MeterDecl::u64("bound_packets_total", "frames", "packets bound to the interface", |m| &mut m.bound_packets),
    MeterDecl::u64("bound_bytes_total", "bytes", "bytes bound to the interface", |m| &mut m.bound_bytes),
    MeterDecl::u64("rebinds_total", "frames", "packets bound here whose flow's previous packet went elsewhere", |m| {
        &mut m.rebinds
    }),
    MeterDecl::u64(
        "drop_interface_down_total",
        "frames",
        "packets lost (not yet started) when the interface went down",
        |m| &mut m.drop_down,
    ),
    MeterDecl::u64(
        "drop_queue_full_total",
        "frames",
        "packets dropped because the FIFO was full (early binding)",
        |m| &mut m.drop_full,
    ),
    MeterDecl::u64(
        "tx_interrupted_total",
        "frames",
        "packets whose modelled transmission was cut by the interface going down",
        |m| &mut m.interrupted,
    ),
];

/// Each interface of a `late-binding` module.
const LATE_IFACE: GroupDecl<IfaceConfig, IfaceMeters> = GroupDecl {
    item: "<iface>",
    params: &[ADDRESS_V4, ADDRESS_V6, RATE, RATE_BPS, OVERHEAD, device_queue(2), EMIT, UP, WEIGHT, FACE],
    meters: IFACE_METERS,
};

/// Each interface of an `early-binding` module: a FIFO in front of the device queue.
const EARLY_IFACE: GroupDecl<IfaceConfig, IfaceMeters> = GroupDecl {
    params: &[ADDRESS_V4, ADDRESS_V6, RATE, RATE_BPS, OVERHEAD, device_queue(50), EMIT, UP, WEIGHT, FIFO_LIMIT, FACE],
    ..LATE_IFACE
};

/// Reads an address setting of family v6 (or v4).
fn read_addr(r: &mut SettingsReader<'_>, key: &str, v6: bool) -> Result<Option<IpAddr>, ConfigError> {
    let Some(t) = r.string(key)? else { return Ok(None) };
    match t.parse::<IpAddr>() {
        Ok(a) if a.is_ipv6() == v6 => Ok(Some(a)),
        _ => Err(r.error(key, format_args!("expected an IPv{} address, got {t:?}", if v6 { 6 } else { 4 }))),
    }
}

fn v4(a: Option<IpAddr>) -> Option<Ipv4Addr> {
    match a {
        Some(IpAddr::V4(a)) => Some(a),
        _ => None,
    }
}

fn v6(a: Option<IpAddr>) -> Option<Ipv6Addr> {
    match a {
        Some(IpAddr::V6(a)) => Some(a),
        _ => None,
    }
}

/// Reads the settings of a binding module of `mode`: the module's, then each interface's.
pub(crate) fn configure(mode: Mode, settings: &Settings) -> Result<(Config, Vec<IfaceConfig>), ConfigError> {
    let kind = mode.decl().name;
    let mut r = settings.reader(kind);
    // The interface names come first: the other settings' names depend on them.
    let names = {
        let names = r.strings("interfaces")?;
        let err = |m: String| r.error("interfaces", m);
        let names = names.ok_or_else(|| {
            ConfigError::new(None, format!("a {kind} module needs `interfaces`, e.g. interfaces = [\"wlan\", \"lte\"]"))
        })?;
        if names.is_empty() || names.len() > MAX_INTERFACES {
            return Err(err(format!("expected 1 to {MAX_INTERFACES} interface names, got {}", names.len())));
        }
        for (i, n) in names.iter().enumerate() {
            if !valid_name(n) || RESERVED.contains(&n.as_str()) {
                return Err(err(format!(
                    "invalid interface name {n:?}: expected lowercase letters, digits, '_' or '-', not one of {}",
                    RESERVED.join(", ")
                )));
            }
            if names[..i].contains(n) {
                return Err(err(format!("interface {n:?} is named twice")));
            }
        }
        names
    };
    let mut cfg = Config { mode, ..Config::default() };
    mode.decl().read(&mut r, &mut cfg)?;
    cfg.rules = r
        .strings("class_rules")?
        .unwrap_or_default()
        .iter()
        .enumerate()
        .map(|(i, t)| {
            ClassRule::parse(t).map_err(|e| r.error("class_rules", format_args!("rule {} {t:?}: {e}", i + 1)))
        })
        .collect::<Result<Vec<_>, _>>()?;
    cfg.virtual_v4 = v4(read_addr(&mut r, "virtual_v4", false)?);
    cfg.virtual_v6 = v6(read_addr(&mut r, "virtual_v6", true)?);
    let mut ifaces = Vec::new();
    for name in names {
        let key = |k: &str| format!("{name}.{k}");
        let address_v4 = v4(read_addr(&mut r, &key("address_v4"), false)?);
        let address_v6 = v6(read_addr(&mut r, &key("address_v6"), true)?);
        let mut iface = IfaceConfig { address_v4, address_v6, ..IfaceConfig::default() };
        mode.iface_decl().read(&mut r, &name, &mut iface)?;
        iface.face = r.string(&key("face"))?;
        iface.name = name;
        ifaces.push(iface);
    }
    r.finish()?;
    Ok((cfg, ifaces))
}
