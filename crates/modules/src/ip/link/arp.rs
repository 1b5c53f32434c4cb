//! ARP (RFC 826) for the link's IPv4 addresses: requests and replies received, answers and requests sent.

use super::{write_ethernet, Count, Link, Mac, Reason, OUT_WIRE};
use flexstack_core::{Direction, Output, Packet};
use smoltcp::wire::{ArpOperation, ArpPacket, ArpRepr, EthernetAddress, EthernetProtocol, ETHERNET_HEADER_LEN};
use std::net::Ipv4Addr;

impl Link {
    pub(super) fn receive_arp(&mut self, p: Packet, out: &mut Output<'_>) {
        let parsed = ArpPacket::new_checked(&p.data()[ETHERNET_HEADER_LEN..]).and_then(|a| ArpRepr::parse(&a));
        let Ok(ArpRepr::EthernetIpv4 {
            operation,
            source_hardware_addr: sha,
            source_protocol_addr: spa,
            target_protocol_addr: tpa,
            ..
        }) = parsed
        else {
            return self.discard(Reason::ArpMalformed, p, out);
        };
        let request = match operation {
            ArpOperation::Request => true,
            ArpOperation::Reply => false,
            ArpOperation::Unknown(_) => return self.discard(Reason::ArpMalformed, p, out),
        };
        if !sha.is_unicast() || sha.0 == [0; 6] || spa.is_multicast() || spa.is_broadcast() || spa.is_loopback() {
            return self.discard(Reason::ArpMalformed, p, out);
        }
        drop(p);
        self.count(if request { Count::ArpRequestsReceived } else { Count::ArpRepliesReceived });
        let spa_ours = self.cfg.owns(spa.into());
        if spa_ours && sha.0 != self.cfg.mac {
            self.count(Count::AddressConflicts);
        }
        let tpa_ours = self.cfg.owns(tpa.into());
        if !spa.is_unspecified() && !spa_ours {
            // RFC 826: update a known sender; add it when we are the target.
            self.learn(spa.into(), sha.0, tpa_ours, out);
        }
        if tpa_ours && request {
            let reply = self.arp_frame(out, sha.0, ArpOperation::Reply, tpa, sha.0, spa);
            self.count(Count::ArpRequestsAnswered);
            out.emit(OUT_WIRE, reply);
        }
    }

    pub(super) fn arp_frame(
        &self,
        out: &Output<'_>,
        eth_dst: Mac,
        operation: ArpOperation,
        spa: Ipv4Addr,
        tha: Mac,
        tpa: Ipv4Addr,
    ) -> Packet {
        let repr = ArpRepr::EthernetIpv4 {
            operation,
            source_hardware_addr: EthernetAddress(self.cfg.mac),
            source_protocol_addr: spa,
            target_hardware_addr: EthernetAddress(tha),
            target_protocol_addr: tpa,
        };
        let mut p = out.pool().alloc();
        let v = p.make_mut();
        v.resize(ETHERNET_HEADER_LEN + repr.buffer_len(), 0);
        write_ethernet(v, eth_dst, self.cfg.mac, EthernetProtocol::Arp);
        repr.emit(&mut ArpPacket::new_unchecked(&mut v[ETHERNET_HEADER_LEN..]));
        p.set_direction(Direction::Down);
        p
    }
}
