//! The settings of a binding module: interfaces, policy, classes, limits, and their checks.

use super::{ClassRule, EARLY_KIND, LATE_KIND, MAX_INTERFACES};
use flexstack_core::config::{valid_name, SettingsReader};
use flexstack_core::{ConfigError, Settings};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

pub(crate) const MAX_RATE_BPS: u64 = 1_000_000_000_000;
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
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    /// The first interface that is up, in the order of `interfaces`.
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
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Emit {
    /// At its modelled transmission start (the default): the model paces the packets itself.
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

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Mode {
    Late,
    Early,
}

impl Mode {
    pub(super) fn kind(self) -> &'static str {
        match self {
            Mode::Late => LATE_KIND,
            Mode::Early => EARLY_KIND,
        }
    }
}

/// One interface's configuration (knobs included).
#[derive(Clone, Debug)]
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

#[derive(Clone, Debug)]
pub(crate) struct Config {
    pub(super) mode: Mode,
    pub(super) ifaces: Vec<IfaceConfig>,
    pub(super) policy: Policy,
    pub(super) quantum: u64,
    pub(super) queue_limit: u64,
    pub(super) flow_idle_ms: u64,
    pub(super) rules: Vec<ClassRule>,
    pub(super) virtual_v4: Option<Ipv4Addr>,
    pub(super) virtual_v6: Option<Ipv6Addr>,
    pub(super) vars_prefix: String,
}

/// The per-interface setting names (`<iface>.<key>`), in the order `configure` reads them.
const IFACE_KEYS: [&str; 10] = [
    "address_v4",
    "address_v6",
    "rate_bps",
    "device_queue",
    "up",
    "weight",
    "fifo_limit",
    "overhead_bytes",
    "face",
    "emit",
];

/// Reads an address setting of family v6 (or v4).
fn read_addr<'a>(r: &mut SettingsReader<'a>, key: &'a str, v6: bool) -> Result<Option<IpAddr>, ConfigError> {
    let Some(t) = r.string(key)? else { return Ok(None) };
    match t.parse::<IpAddr>() {
        Ok(a) if a.is_ipv6() == v6 => Ok(Some(a)),
        _ => Err(r.error(key, format_args!("expected an IPv{} address, got {t:?}", if v6 { 6 } else { 4 }))),
    }
}

pub(crate) fn configure(mode: Mode, settings: &Settings) -> Result<Config, ConfigError> {
    let kind = mode.kind();
    // The interface names come first: the other settings' names depend on them.
    let names = {
        let mut r = settings.reader(kind);
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
    let keys: Vec<String> = names.iter().flat_map(|n| IFACE_KEYS.iter().map(move |k| format!("{n}.{k}"))).collect();
    let mut r = settings.reader(kind);
    r.strings("interfaces")?;
    let policy_text = r.string("policy")?.unwrap_or_else(|| "preferred".into());
    let policy = Policy::parse(&policy_text).ok_or_else(|| {
        r.error("policy", format_args!("expected preferred, affinity, weighted or fastest, got {policy_text:?}"))
    })?;
    let quantum = r.u64_in("quantum", 1514, MIN_QUANTUM, MAX_QUANTUM)?;
    let queue_limit = r.u64_in("queue_limit", 10_000, 1, MAX_QUEUE_LIMIT)?;
    let flow_idle_ms = r.u64_in("flow_idle_ms", 30_000, 1, MAX_IDLE_MS)?;
    let rules = r
        .strings("class_rules")?
        .unwrap_or_default()
        .iter()
        .enumerate()
        .map(|(i, t)| {
            ClassRule::parse(t).map_err(|e| r.error("class_rules", format_args!("rule {} {t:?}: {e}", i + 1)))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let v4 = |a: Option<IpAddr>| match a {
        Some(IpAddr::V4(a)) => Some(a),
        _ => None,
    };
    let v6 = |a: Option<IpAddr>| match a {
        Some(IpAddr::V6(a)) => Some(a),
        _ => None,
    };
    let virtual_v4 = v4(read_addr(&mut r, "virtual_v4", false)?);
    let virtual_v6 = v6(read_addr(&mut r, "virtual_v6", true)?);
    let vars_prefix = r.string("vars_prefix")?.unwrap_or_else(|| "flow".into());
    if !(vars_prefix == "flow" || vars_prefix.strip_prefix("flow.").is_some_and(|rest| rest.split('.').all(valid_name)))
    {
        return Err(r.error("vars_prefix", format_args!("expected `flow` or `flow.NAME`, got {vars_prefix:?}")));
    }
    let default_dq = if mode == Mode::Late { 2 } else { 50 };
    let mut ifaces = Vec::new();
    for (name, k) in names.iter().zip(keys.chunks(IFACE_KEYS.len())) {
        let address_v4 = v4(read_addr(&mut r, &k[0], false)?);
        let address_v6 = v6(read_addr(&mut r, &k[1], true)?);
        let rate_bps = r.u64_in(&k[2], 0, 0, MAX_RATE_BPS)?;
        let device_queue = r.u64_in(&k[3], default_dq, 1, MAX_DEVICE_QUEUE)?;
        let up = r.bool(&k[4])?.unwrap_or(true);
        let weight = r.u64_in(&k[5], 1, 0, MAX_WEIGHT)?;
        let fifo_limit = if mode == Mode::Early { r.u64_in(&k[6], 1000, 0, MAX_QUEUE_LIMIT)? } else { 0 };
        let overhead_bytes = r.u64_in(&k[7], 0, 0, MAX_OVERHEAD)?;
        let face = r.string(&k[8])?;
        let emit_text = r.string(&k[9])?.unwrap_or_else(|| Emit::Start.name().into());
        let emit = Emit::parse(&emit_text)
            .ok_or_else(|| r.error(&k[9], format_args!("expected start or admit, got {emit_text:?}")))?;
        ifaces.push(IfaceConfig {
            name: name.clone(),
            address_v4,
            address_v6,
            rate_bps,
            overhead_bytes,
            device_queue,
            up,
            weight,
            fifo_limit,
            emit,
            face,
        });
    }
    r.finish()?;
    Ok(Config { mode, ifaces, policy, quantum, queue_limit, flow_idle_ms, rules, virtual_v4, virtual_v6, vars_prefix })
}
