//! The settings of a `link` module: its MAC, the addresses it owns with their prefixes, gateways, and the limits
//! of its neighbour cache (knobs).

use super::{is_link_local_v6, link_local_of, parse_mac, Mac, DECL, KIND};
use flexstack_core::{ConfigError, Settings};
use flexstack_wire::cidr::Prefix;
use std::fmt::Write as _;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::time::Duration;

/// Default `neighbour_timeout_ms`.
pub const DEFAULT_NEIGHBOUR_TIMEOUT_MS: u64 = 60_000;
/// Default `resolve_retries`.
pub const DEFAULT_RESOLVE_RETRIES: u64 = 3;
/// Default `resolve_interval_ms`.
pub const DEFAULT_RESOLVE_INTERVAL_MS: u64 = 1000;
/// Default `queue_per_neighbour`.
pub const DEFAULT_QUEUE_PER_NEIGHBOUR: u64 = 64;
/// Default `max_queued`.
pub const DEFAULT_MAX_QUEUED: u64 = 1024;
/// Default `max_neighbours`.
pub const DEFAULT_MAX_NEIGHBOURS: u64 = 1024;

/// The knobs' values (`Default` is a blank to read them into: the defaults are declared in `DECL`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Limits {
    pub(super) neighbour_timeout_ms: u64,
    pub(super) resolve_retries: u64,
    pub(super) resolve_interval_ms: u64,
    pub(super) queue_per_neighbour: u64,
    pub(super) max_queued: u64,
    pub(super) max_neighbours: u64,
}

impl Limits {
    pub(super) fn timeout(&self) -> Duration {
        Duration::from_millis(self.neighbour_timeout_ms)
    }

    pub(super) fn interval(&self) -> Duration {
        Duration::from_millis(self.resolve_interval_ms)
    }
}

/// Parses an owned address `10.0.0.2/24`, `fd00::2/64` or a bare address (a host prefix).
fn parse_owned(text: &str) -> Result<(IpAddr, Prefix), String> {
    let text = text.trim();
    let (a, len) = match text.split_once('/') {
        Some((a, l)) => (a, Some(l)),
        None => (text, None),
    };
    let addr: IpAddr = a
        .parse()
        .map_err(|_| format!("expected an address with its prefix like 10.0.0.2/24 or fd00::2/64, got {text:?}"))?;
    let max = if addr.is_ipv4() { 32 } else { 128 };
    let len = match len {
        None => max,
        Some(l) => l
            .parse::<u8>()
            .ok()
            .filter(|n| *n <= max && !l.starts_with('+'))
            .ok_or_else(|| format!("expected a prefix length 0..={max} after `/` in {text:?}"))?,
    };
    let bad = match addr {
        IpAddr::V4(v) => v.is_unspecified() || v.is_multicast() || v.is_broadcast() || v.is_loopback(),
        IpAddr::V6(v) => v.is_unspecified() || v.is_multicast() || v.is_loopback(),
    };
    if bad {
        return Err(format!("{text:?}: not a unicast address"));
    }
    let prefix = Prefix::new(addr, len)?;
    if let IpAddr::V4(v) = addr {
        if len <= 30 && (v == broadcast_of(&prefix) || IpAddr::V4(v) == prefix.addr()) {
            return Err(format!("{text:?}: the network or broadcast address of its prefix"));
        }
    }
    Ok((addr, prefix))
}

/// The directed broadcast address of an IPv4 prefix.
pub(crate) fn broadcast_of(prefix: &Prefix) -> Ipv4Addr {
    match prefix.addr() {
        IpAddr::V4(n) => {
            let host = u32::MAX.checked_shr(u32::from(prefix.len())).unwrap_or(0);
            Ipv4Addr::from(u32::from(n) | host)
        }
        IpAddr::V6(_) => Ipv4Addr::UNSPECIFIED,
    }
}

/// A `link` module's settings and knobs.
#[derive(Clone, Debug)]
pub(crate) struct Config {
    pub(super) mac: Mac,
    pub(super) v4: Vec<(Ipv4Addr, Prefix)>,
    pub(super) v6: Vec<(Ipv6Addr, Prefix)>,
    pub(super) link_local: bool,
    pub(super) gateway_v4: Option<Ipv4Addr>,
    pub(super) gateway_v6: Option<Ipv6Addr>,
    pub(super) limits: Limits,
}

impl Config {
    pub(super) fn owns(&self, ip: IpAddr) -> bool {
        match ip {
            IpAddr::V4(a) => self.v4.iter().any(|(o, _)| *o == a),
            IpAddr::V6(a) => self.v6.iter().any(|(o, _)| *o == a),
        }
    }

    /// True if `ip` is on the link: in one of our prefixes, or IPv6 link-local while we own an IPv6 address.
    pub(super) fn on_link(&self, ip: IpAddr) -> bool {
        match ip {
            IpAddr::V4(_) => self.v4.iter().any(|(_, p)| p.contains(ip)),
            IpAddr::V6(a) => {
                (is_link_local_v6(a) && !self.v6.is_empty()) || self.v6.iter().any(|(_, p)| p.contains(ip))
            }
        }
    }

    /// The owned addresses with their prefix lengths, then the gateways: the `addresses` procedure's answer.
    pub(super) fn addresses_text(&self) -> String {
        let mut text = String::new();
        for (a, p) in &self.v4 {
            let _ = writeln!(text, "{a}/{}", p.len());
        }
        for (a, p) in &self.v6 {
            let _ = writeln!(text, "{a}/{}", p.len());
        }
        if let Some(g) = self.gateway_v4 {
            let _ = writeln!(text, "gateway {g}");
        }
        if let Some(g) = self.gateway_v6 {
            let _ = writeln!(text, "gateway {g}");
        }
        text
    }
}

/// Reads and checks the settings of a `link` module.
pub(crate) fn configure(settings: &Settings) -> Result<Config, ConfigError> {
    let mut r = settings.reader(KIND);
    let Some(mac_text) = r.string("mac")? else {
        return Err(ConfigError::new(
            None,
            "a link module needs `mac`, the interface's MAC address (e.g. mac = \"02:00:00:00:00:01\")",
        ));
    };
    let mac = parse_mac(&mac_text).ok_or_else(|| {
        r.error("mac", format_args!("expected a MAC address like 02:00:00:00:00:01, got {mac_text:?}"))
    })?;
    if mac[0] & 1 != 0 || mac == [0; 6] {
        return Err(r.error("mac", format_args!("{mac_text:?} is not a unicast MAC address")));
    }
    let words: Vec<String> = match settings.get("addresses").map(|s| &s.value) {
        Some(toml::Value::String(_)) => {
            let text = r.string("addresses")?.unwrap_or_default();
            text.split([',', ' ']).filter(|w| !w.is_empty()).map(str::to_string).collect()
        }
        _ => r.strings("addresses")?.unwrap_or_default(),
    };
    let mut cfg = Config {
        mac,
        v4: Vec::new(),
        v6: Vec::new(),
        link_local: false,
        gateway_v4: None,
        gateway_v6: None,
        limits: Limits::default(),
    };
    for w in &words {
        let (addr, prefix) = parse_owned(w).map_err(|e| r.error("addresses", e))?;
        if cfg.owns(addr) {
            return Err(r.error("addresses", format_args!("{addr} is listed twice")));
        }
        match addr {
            IpAddr::V4(a) => cfg.v4.push((a, prefix)),
            IpAddr::V6(a) => cfg.v6.push((a, prefix)),
        }
    }
    // `link_local` and the knobs; the gateways are checked against every owned address, so they come last.
    DECL.read(&mut r, &mut cfg)?;
    if cfg.link_local {
        let ll = link_local_of(mac);
        if !cfg.owns(ll.into()) {
            let prefix = Prefix::new(ll.into(), 64).map_err(|e| r.error("link_local", e))?;
            cfg.v6.push((ll, prefix));
        }
    }
    for key in ["gateway_v4", "gateway_v6"] {
        let Some(text) = r.string(key)? else { continue };
        let gw: IpAddr = text.trim().parse().map_err(|_| r.error(key, format_args!("{text:?} is not an address")))?;
        let family_ok = gw.is_ipv4() == (key == "gateway_v4");
        let unicast = match gw {
            IpAddr::V4(a) => !(a.is_unspecified() || a.is_multicast() || a.is_broadcast() || a.is_loopback()),
            IpAddr::V6(a) => !(a.is_unspecified() || a.is_multicast() || a.is_loopback()),
        };
        if !family_ok || !unicast {
            let family = if key == "gateway_v4" { "IPv4" } else { "IPv6" };
            return Err(r.error(key, format_args!("{gw} is not a unicast {family} address")));
        }
        if cfg.owns(gw) {
            return Err(r.error(key, format_args!("{gw} is one of the module's own addresses")));
        }
        if !cfg.on_link(gw) {
            return Err(r.error(key, format_args!("{gw} is not in an on-link prefix of `addresses`")));
        }
        match gw {
            IpAddr::V4(a) => cfg.gateway_v4 = Some(a),
            IpAddr::V6(a) => cfg.gateway_v6 = Some(a),
        }
    }
    r.finish()?;
    Ok(cfg)
}
