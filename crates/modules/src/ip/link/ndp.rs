//! IPv6 neighbour discovery (RFC 4861): solicitations and advertisements received and sent, the addresses it uses.

use super::{multicast_mac_v6, v6_at, write_ethernet, Count, Link, Mac, Reason, State, OUT_WIRE};
use flexstack_core::{Direction, Output, Packet};
use flexstack_wire::checksum;
use flexstack_wire::packet::proto;
use smoltcp::wire::{
    EthernetAddress, EthernetProtocol, Icmpv6Packet, IpProtocol, Ipv6Packet, Ipv6Repr, NdiscNeighborFlags, NdiscRepr,
    RawHardwareAddress, ETHERNET_HEADER_LEN,
};
use std::net::{IpAddr, Ipv6Addr};

pub(super) const ALL_NODES: Ipv6Addr = Ipv6Addr::new(0xff02, 0, 0, 0, 0, 0, 0, 1);

/// The IPv6 link-local address derived from `mac` (modified EUI-64, RFC 4291 appendix A).
pub fn link_local_of(mac: Mac) -> Ipv6Addr {
    let eui = EthernetAddress(mac).as_eui_64().unwrap_or([0; 8]);
    let mut a = [0u8; 16];
    a[0] = 0xfe;
    a[1] = 0x80;
    a[8..].copy_from_slice(&eui);
    Ipv6Addr::from(a)
}

/// The solicited-node multicast address of `addr` (RFC 4291 2.7.1).
pub fn solicited_node(addr: Ipv6Addr) -> Ipv6Addr {
    let o = addr.octets();
    Ipv6Addr::from([0xff, 0x02, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0xff, o[13], o[14], o[15]])
}

pub(crate) fn is_link_local_v6(a: Ipv6Addr) -> bool {
    a.segments()[0] & 0xffc0 == 0xfe80
}

/// A neighbour discovery message, copied out of the frame.
enum Ndp {
    RouterSolicit,
    RouterAdvert,
    Redirect,
    Solicit { target: Ipv6Addr, lladdr: Option<Mac> },
    Advert { flags: NdiscNeighborFlags, target: Ipv6Addr, lladdr: Option<Mac> },
}

/// A link-layer address option's MAC; `Err` when it is not a unicast Ethernet address.
fn option_mac(raw: Option<RawHardwareAddress>) -> Result<Option<Mac>, ()> {
    match raw {
        None => Ok(None),
        Some(raw) => {
            let b = raw.as_bytes();
            if b.len() < 6 {
                return Err(());
            }
            let mac: Mac = [b[0], b[1], b[2], b[3], b[4], b[5]];
            if mac[0] & 1 != 0 || mac == [0; 6] {
                return Err(());
            }
            Ok(Some(mac))
        }
    }
}

impl Link {
    pub(super) fn receive_ndp(&mut self, p: Packet, eth_src: Mac, out: &mut Output<'_>) {
        let ip = &p.data()[ETHERNET_HEADER_LEN..];
        let plen = usize::from(u16::from_be_bytes([ip[4], ip[5]]));
        if 40 + plen > ip.len() {
            return self.discard(Reason::NdpMalformed, p, out);
        }
        let ip = &ip[..40 + plen];
        let (src, dst, hop_limit) = (v6_at(ip, 8), v6_at(ip, 24), ip[7]);
        let icmp = &ip[40..];
        let pseudo = checksum::pseudo_header(src.into(), dst.into(), proto::ICMPV6, icmp.len() as u32);
        if !checksum::verify(pseudo, icmp) {
            return self.discard(Reason::BadIcmpv6Checksum, p, out);
        }
        let parsed = Icmpv6Packet::new_checked(icmp).and_then(|pkt| Ok((pkt.msg_code(), NdiscRepr::parse(&pkt)?)));
        let (code, msg) = match parsed {
            Ok((code, repr)) => {
                let msg = match repr {
                    NdiscRepr::RouterSolicit { .. } => Ok(Ndp::RouterSolicit),
                    NdiscRepr::RouterAdvert { .. } => Ok(Ndp::RouterAdvert),
                    NdiscRepr::Redirect { .. } => Ok(Ndp::Redirect),
                    NdiscRepr::NeighborSolicit { target_addr, lladdr } => {
                        option_mac(lladdr).map(|lladdr| Ndp::Solicit { target: target_addr, lladdr })
                    }
                    NdiscRepr::NeighborAdvert { flags, target_addr, lladdr } => {
                        option_mac(lladdr).map(|lladdr| Ndp::Advert { flags, target: target_addr, lladdr })
                    }
                };
                (code, msg)
            }
            Err(_) => return self.discard(Reason::NdpMalformed, p, out),
        };
        let Ok(msg) = msg else { return self.discard(Reason::NdpInvalid, p, out) };
        if hop_limit != 255 || code != 0 {
            return self.discard(Reason::NdpInvalid, p, out);
        }
        let valid = match &msg {
            Ndp::Solicit { target, lladdr } => {
                !target.is_multicast()
                    && !src.is_multicast()
                    && (!src.is_unspecified() || (lladdr.is_none() && dst == solicited_node(*target)))
            }
            Ndp::Advert { flags, target, .. } => {
                let solicited_to_multicast = dst.is_multicast() && flags.contains(NdiscNeighborFlags::SOLICITED);
                !(target.is_multicast() || src.is_multicast() || solicited_to_multicast)
            }
            _ => true,
        };
        if !valid {
            return self.discard(Reason::NdpInvalid, p, out);
        }
        drop(p);
        match msg {
            Ndp::RouterSolicit => self.count(Count::RsReceived),
            Ndp::RouterAdvert => self.count(Count::RaReceived),
            Ndp::Redirect => self.count(Count::RedirectsReceived),
            Ndp::Solicit { target, lladdr } => {
                self.count(Count::NsReceived);
                if !self.cfg.owns(target.into()) {
                    return;
                }
                if src.is_unspecified() {
                    // Duplicate address detection for one of our addresses: defend it, to all nodes.
                    let na = self.na_frame(out, multicast_mac_v6(ALL_NODES), target, ALL_NODES, false);
                    self.count(Count::NaSent);
                    out.emit(OUT_WIRE, na);
                    return;
                }
                if let Some(mac) = lladdr {
                    if !self.cfg.owns(src.into()) {
                        self.learn(src.into(), mac, true, out);
                    }
                }
                let na = self.na_frame(out, lladdr.unwrap_or(eth_src), target, src, true);
                self.count(Count::NaSent);
                out.emit(OUT_WIRE, na);
            }
            Ndp::Advert { flags, target, lladdr } => {
                self.count(Count::NaReceived);
                if self.cfg.owns(target.into()) {
                    if lladdr != Some(self.cfg.mac) {
                        self.count(Count::AddressConflicts);
                    }
                    return;
                }
                let Some(e) = self.cache.map.get(&IpAddr::V6(target)) else { return };
                let incomplete = e.state == State::Incomplete;
                // RFC 4861 7.2.5: a known MAC is only replaced with the override flag; a solicited NA without the
                // option confirms the one known.
                let update = match lladdr {
                    Some(mac) if incomplete || mac == e.mac || flags.contains(NdiscNeighborFlags::OVERRIDE) => {
                        Some(mac)
                    }
                    None if !incomplete && flags.contains(NdiscNeighborFlags::SOLICITED) => Some(e.mac),
                    _ => None,
                };
                if let Some(mac) = update {
                    self.learn(target.into(), mac, false, out);
                }
            }
        }
    }

    /// A neighbour advertisement for our `target` to `ip_dst`, with our MAC as target link-layer option.
    fn na_frame(&self, out: &Output<'_>, eth_dst: Mac, target: Ipv6Addr, ip_dst: Ipv6Addr, solicited: bool) -> Packet {
        let mut flags = NdiscNeighborFlags::OVERRIDE;
        if solicited {
            flags |= NdiscNeighborFlags::SOLICITED;
        }
        let repr = NdiscRepr::NeighborAdvert {
            flags,
            target_addr: target,
            lladdr: Some(EthernetAddress(self.cfg.mac).into()),
        };
        self.ndp_frame(out, eth_dst, target, ip_dst, repr)
    }

    /// An Ethernet frame with an IPv6 packet (hop limit 255) carrying `repr`, with its ICMPv6 checksum.
    pub(super) fn ndp_frame(
        &self,
        out: &Output<'_>,
        eth_dst: Mac,
        src: Ipv6Addr,
        dst: Ipv6Addr,
        repr: NdiscRepr<'_>,
    ) -> Packet {
        let len = repr.buffer_len();
        let icmp_at = ETHERNET_HEADER_LEN + 40;
        let mut p = out.pool().alloc();
        let v = p.make_mut();
        v.resize(icmp_at + len, 0);
        write_ethernet(v, eth_dst, self.cfg.mac, EthernetProtocol::Ipv6);
        let ip = Ipv6Repr {
            src_addr: src,
            dst_addr: dst,
            next_header: IpProtocol::Icmpv6,
            payload_len: len,
            hop_limit: 255,
        };
        ip.emit(&mut Ipv6Packet::new_unchecked(&mut v[ETHERNET_HEADER_LEN..icmp_at]));
        repr.emit(&mut Icmpv6Packet::new_unchecked(&mut v[icmp_at..]));
        let pseudo = checksum::pseudo_header(src.into(), dst.into(), proto::ICMPV6, len as u32);
        let c = checksum::finish(checksum::sum(pseudo, &v[icmp_at..]));
        v[icmp_at + 2..icmp_at + 4].copy_from_slice(&c.to_be_bytes());
        p.set_direction(Direction::Down);
        p
    }
}
