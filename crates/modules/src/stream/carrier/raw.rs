//! The raw (packet) stack of a carrier (docs/peers.md, "The raw stack"): IP packets that the app's chain does not
//! terminate travel to the peer as the `Data` of one pseudo-flow per peer connection, a UDP flow to itself marked
//! by [`RAW_APP`], so that every transport carries them as it carries a UDP flow's datagrams (`quic` DATAGRAM
//! frames, `udp` and `udpplus` datagrams; `tcp` messages). Only a peer whose `Hello` offered [`RAW_CAP`] gets them.
//!
//! Sans-IO: the setting, the pseudo-flow's `Open`, the check of a packet that comes from the peer
//! ([`check_packet`], fuzzed through [`check`]), the choice of packets ([`carried`]) and the accepting side's table
//! of the addresses each raw flow brought ([`RawPeers`]), which routes the replies back.

use flexstack_core::stream::{FlowInfo, Protocol, Role};
use flexstack_wire::cidr::Prefix;
use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

/// The capability of a peer that takes raw packets (its carrier has `raw` other than `none`).
pub const RAW_CAP: &str = "raw";
/// The id the connecting side gives its raw pseudo-flow (above every id `terminate` and `classify` hand out).
pub const RAW_FLOW: u64 = 1 << 60;
/// The app name of the raw pseudo-flow's `Open` (a UDP flow from and to `0.0.0.0:0`, which no app can open).
pub const RAW_APP: &str = "<raw>";
/// Most addresses the accepting side remembers (their replies go back to the raw flow that brought them).
pub const MAX_ADDRS: usize = 4096;

/// Which packets of `raw_in` go to the peer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RawMode {
    /// None: they leave on `raw_pass` unchanged (and an accepting carrier does not offer `raw`).
    #[default]
    None,
    /// Every packet of `raw_in` whose destination is in `prefixes` (all if empty), unicast and not link-local.
    AllUnterminated,
}

impl RawMode {
    /// The mode named `t` (as in settings).
    pub fn parse(t: &str) -> Result<RawMode, String> {
        match t {
            "none" => Ok(RawMode::None),
            "all-unterminated" => Ok(RawMode::AllUnterminated),
            _ => Err(format!("expected none or all-unterminated, got {t:?}")),
        }
    }

    /// Its name in settings.
    pub fn name(self) -> &'static str {
        match self {
            RawMode::None => "none",
            RawMode::AllUnterminated => "all-unterminated",
        }
    }
}

/// The `Open` of the raw pseudo-flow.
pub fn open_info() -> FlowInfo {
    let any = SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0);
    FlowInfo { protocol: Protocol::Udp, src: any, dst: any, app: RAW_APP.into(), role: Role::Client }
}

/// True for the `Open` of a raw pseudo-flow (encoded).
pub fn is_raw_open(bytes: &[u8]) -> bool {
    FlowInfo::decode(bytes).is_ok_and(|i| i == open_info())
}

/// Why a raw packet was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RawError(pub &'static str);

/// Checks that `b` is one whole IPv4 or IPv6 packet (version, header length, total length equal to its bytes) and
/// returns its source and destination; what is not is dropped and counted (`raw_drop_malformed_total`).
pub fn check_packet(b: &[u8]) -> Result<(IpAddr, IpAddr), RawError> {
    match b.first().map(|v| v >> 4) {
        Some(4) => {
            if b.len() < 20 {
                return Err(RawError("short"));
            }
            let ihl = usize::from(b[0] & 0x0f) * 4;
            let total = usize::from(u16::from_be_bytes([b[2], b[3]]));
            if ihl < 20 || ihl > total {
                return Err(RawError("bad header length"));
            }
            if total != b.len() {
                return Err(RawError("bad total length"));
            }
            let a = |at: usize| IpAddr::V4(Ipv4Addr::new(b[at], b[at + 1], b[at + 2], b[at + 3]));
            Ok((a(12), a(16)))
        }
        Some(6) => {
            if b.len() < 40 {
                return Err(RawError("short"));
            }
            if usize::from(u16::from_be_bytes([b[4], b[5]])) + 40 != b.len() {
                return Err(RawError("bad payload length"));
            }
            let a = |at: usize| {
                let o: [u8; 16] = b[at..at + 16].try_into().expect("16 bytes");
                IpAddr::V6(Ipv6Addr::from(o))
            };
            Ok((a(8), a(24)))
        }
        Some(_) => Err(RawError("bad version")),
        None => Err(RawError("empty")),
    }
}

/// Whether a packet to `dst` goes to the peer: a unicast address that is not link-local, loopback or unspecified
/// (those stay on the app's link), in `prefixes` (all if empty).
pub fn carried(dst: IpAddr, prefixes: &[Prefix]) -> bool {
    let local = match dst {
        IpAddr::V4(a) => {
            a.is_multicast() || a.is_link_local() || a.is_broadcast() || a.is_loopback() || a.is_unspecified()
        }
        IpAddr::V6(a) => {
            a.is_multicast() || a.is_loopback() || a.is_unspecified() || (a.segments()[0] & 0xffc0) == 0xfe80
        }
    };
    !local && (prefixes.is_empty() || prefixes.iter().any(|p| p.contains(dst)))
}

/// The accepting side's raw flows and the source addresses each brought: a reply to one of them goes back on that
/// flow (the last flow that sent from an address has it). At most [`MAX_ADDRS`] addresses.
#[derive(Debug, Default)]
pub struct RawPeers {
    flows: HashMap<u64, Vec<IpAddr>>,
    by_addr: HashMap<IpAddr, u64>,
}

impl RawPeers {
    /// Flow `flow` (a local id) is a raw flow.
    pub fn open(&mut self, flow: u64) {
        self.flows.entry(flow).or_default();
    }

    /// True for a raw flow.
    pub fn is_raw(&self, flow: u64) -> bool {
        self.flows.contains_key(&flow)
    }

    /// A packet from `src` came on raw flow `flow`; false when the table is full (the address is not learned).
    pub fn learn(&mut self, flow: u64, src: IpAddr) -> bool {
        if self.by_addr.get(&src) == Some(&flow) {
            return true;
        }
        if !self.by_addr.contains_key(&src) && self.by_addr.len() >= MAX_ADDRS {
            return false;
        }
        if let Some(old) = self.by_addr.insert(src, flow) {
            if let Some(v) = self.flows.get_mut(&old) {
                v.retain(|a| *a != src);
            }
        }
        self.flows.entry(flow).or_default().push(src);
        true
    }

    /// The raw flow a packet to `dst` goes back on.
    pub fn route(&self, dst: IpAddr) -> Option<u64> {
        self.by_addr.get(&dst).copied()
    }

    /// Raw flow `flow` ended: its addresses are forgotten.
    pub fn close(&mut self, flow: u64) {
        for a in self.flows.remove(&flow).unwrap_or_default() {
            self.by_addr.remove(&a);
        }
    }
}

/// A property check for the fuzz targets: checking any bytes never panics, and a packet that passes has the
/// addresses its header holds and exactly the length it says.
pub fn check(buf: &[u8]) {
    if let Ok((src, dst)) = check_packet(buf) {
        match (src, dst) {
            (IpAddr::V4(s), IpAddr::V4(d)) => {
                assert_eq!(buf[0] >> 4, 4);
                assert_eq!(&s.octets(), &buf[12..16]);
                assert_eq!(&d.octets(), &buf[16..20]);
                assert_eq!(usize::from(u16::from_be_bytes([buf[2], buf[3]])), buf.len());
            }
            (IpAddr::V6(s), IpAddr::V6(d)) => {
                assert_eq!(buf[0] >> 4, 6);
                assert_eq!(&s.octets(), &buf[8..24]);
                assert_eq!(&d.octets(), &buf[24..40]);
            }
            _ => panic!("mixed families"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v4(len: usize) -> Vec<u8> {
        let mut p = vec![0u8; len];
        p[0] = 0x45;
        p[2..4].copy_from_slice(&(len as u16).to_be_bytes());
        p[12..16].copy_from_slice(&[10, 0, 0, 2]);
        p[16..20].copy_from_slice(&[10, 9, 9, 9]);
        p
    }

    fn v6(payload: usize) -> Vec<u8> {
        let mut p = vec![0u8; 40 + payload];
        p[0] = 0x60;
        p[4..6].copy_from_slice(&(payload as u16).to_be_bytes());
        p[23] = 2;
        p[24] = 0xfd;
        p[39] = 9;
        p
    }

    #[test]
    fn whole_packets_pass_and_others_are_refused_with_a_reason() {
        assert_eq!(check_packet(&v4(84)), Ok(("10.0.0.2".parse().unwrap(), "10.9.9.9".parse().unwrap())));
        assert_eq!(check_packet(&v6(16)), Ok(("::2".parse().unwrap(), "fd00::9".parse().unwrap())));
        let mut long = v4(84);
        long.push(0);
        let mut ihl = v4(84);
        ihl[0] = 0x44;
        let mut v6_short = v6(16);
        v6_short.pop();
        for (b, why) in [
            (vec![], "empty"),
            (vec![0x45; 19], "short"),
            (long, "bad total length"),
            (ihl, "bad header length"),
            (vec![0x60; 39], "short"),
            (v6_short, "bad payload length"),
            (vec![0x20; 60], "bad version"),
        ] {
            assert_eq!(check_packet(&b), Err(RawError(why)), "{b:?}");
            check(&b);
        }
        // Deterministic random bytes never panic.
        let mut x = 0x2545_f491_4f6c_dd1du64;
        for _ in 0..20_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let n = (x % 80) as usize;
            let mut b: Vec<u8> = (0..n).map(|i| (x >> (i % 56)) as u8).collect();
            if let Some(f) = b.first_mut() {
                *f = if x & 1 == 0 { 0x45 } else { 0x60 };
            }
            if n >= 4 && x & 2 == 0 {
                b[2..4].copy_from_slice(&(n as u16).to_be_bytes());
            }
            check(&b);
        }
    }

    #[test]
    fn only_unicast_destinations_in_the_prefixes_are_carried() {
        let all: Vec<Prefix> = Vec::new();
        for local in ["224.0.0.251", "255.255.255.255", "169.254.1.1", "127.0.0.1", "ff02::1", "fe80::1", "::1", "::"] {
            assert!(!carried(local.parse().unwrap(), &all), "{local}");
        }
        assert!(carried("10.9.9.9".parse().unwrap(), &all));
        assert!(carried("fd00::9".parse().unwrap(), &all));
        let some = vec![Prefix::parse("10.9.0.0/16").unwrap()];
        assert!(carried("10.9.9.9".parse().unwrap(), &some));
        assert!(!carried("10.8.9.9".parse().unwrap(), &some));
    }

    #[test]
    fn the_raw_open_is_recognised_and_replies_find_their_flow() {
        let mut b = Vec::new();
        open_info().encode(&mut b);
        assert!(is_raw_open(&b));
        let mut other = Vec::new();
        FlowInfo { app: "curl".into(), ..open_info() }.encode(&mut other);
        assert!(!is_raw_open(&other), "an app's flow is not the raw one");
        let mut t = RawPeers::default();
        let (a, c): (IpAddr, IpAddr) = ("10.0.0.2".parse().unwrap(), "fd00::2".parse().unwrap());
        t.open(7);
        t.open(8);
        assert!(t.is_raw(7) && !t.is_raw(9));
        assert!(t.learn(7, a) && t.learn(7, c));
        assert_eq!(t.route(a), Some(7));
        assert!(t.learn(8, a), "the latest flow from an address has it");
        assert_eq!((t.route(a), t.route(c)), (Some(8), Some(7)));
        t.close(7);
        assert_eq!((t.route(a), t.route(c)), (Some(8), None));
        for i in 0..MAX_ADDRS as u32 {
            t.learn(9, IpAddr::V4(Ipv4Addr::from(i)));
        }
        assert!(!t.learn(9, "10.1.1.1".parse().unwrap()), "bounded");
    }
}
