//! The smoltcp `Device` of an endpoint: two in-memory queues of pooled packets. The endpoint puts a connection's
//! packets in `rx` before it polls that connection's socket, and takes what smoltcp sent from `tx` afterwards; no
//! packet is copied on the way in, and the ones smoltcp writes are taken from the switch's pool.
//!
//! Segmentation offload (TSO for the user-space TCP): with `gso`, smoltcp may write a TCP segment over IPv4 of up
//! to 64 KiB when its peer's window and its congestion window allow, with the size to cut it at (the MSS); the
//! packet leaves as a GSO super-packet (`MetaKey::GSO`), which the switch cuts before a module that does not take
//! super-packets whole and a TUN face writes to the kernel whole. Segments larger than the MSS come in whole too
//! (the app's kernel sends super-packets): smoltcp takes any length it is given. (smoltcp 0.14 drops an IPv6
//! packet beyond the MTU even when it asks for segmentation, so IPv6 keeps segments of one MSS.)
//!
//! TCP checksums are the endpoint's, not smoltcp's: smoltcp neither checks nor computes them. The endpoint checks
//! those of the segments it feeds (`tcp_checksum_ok`; a super-packet or a packet with a partial checksum comes
//! from a local kernel, which leaves the checksum to offload), and the transmit token completes those of the
//! segments smoltcp wrote (a super-packet gets the pseudo-header sum, as one read from a TUN device has, since
//! whoever cuts or writes it computes its segments' checksums): a 64 KiB segment is never summed twice.

use flexstack_core::frame::{CsumPartial, Gso, GsoKind};
use flexstack_core::{MetaKey, Packet, PacketPool};
use flexstack_wire::checksum;
use flexstack_wire::packet::{proto, PacketInfo};
use smoltcp::phy::{self, Checksum, DeviceCapabilities, Medium, PacketMeta};
use smoltcp::time::Instant;
use std::collections::VecDeque;
use std::num::NonZeroUsize;

/// The largest segment smoltcp may write with segmentation offload, as an IP packet: 62 KiB. A kernel forwards a
/// super-packet whole only while it is below the device's `gso_max_size` (64 KiB) with its link header (a 14-byte
/// Ethernet header on a veth): above, it cuts it in software. (A kernel's TCP keeps its super-packets as far below.)
const GSO_MAX: usize = 62 * 1024;

/// Room for the largest IP and TCP headers (60 bytes each).
const HEADERS: usize = 120;

/// Raw IP in, raw IP out.
pub(crate) struct Queues {
    /// Packets for smoltcp to read, oldest first.
    pub rx: VecDeque<Packet>,
    /// Packets smoltcp wrote, in order.
    pub tx: Vec<Packet>,
    /// Where written packets come from (the switch's pool; a private one until the first call).
    pub pool: PacketPool,
    /// The IP MTU smoltcp may send (and derives its MSS from).
    pub mtu: usize,
    /// smoltcp may write TCP segments over IPv4 larger than the MSS, sent as GSO super-packets.
    pub gso: bool,
}

impl Queues {
    pub fn new(mtu: usize, gso: bool) -> Queues {
        Queues { rx: VecDeque::new(), tx: Vec::new(), pool: PacketPool::new(2048, 64), mtu, gso }
    }
}

pub(crate) struct Rx(Packet);

pub(crate) struct Tx<'a> {
    tx: &'a mut Vec<Packet>,
    pool: &'a PacketPool,
    /// The segment size smoltcp asked the device to cut the packet at, if it did.
    mss: Option<u16>,
}

impl phy::RxToken for Rx {
    fn consume<R, F: FnOnce(&[u8]) -> R>(self, f: F) -> R {
        f(self.0.data())
    }
}

impl phy::TxToken for Tx<'_> {
    fn consume<R, F: FnOnce(&mut [u8]) -> R>(self, len: usize, f: F) -> R {
        // A pooled buffer keeps its last bytes: only the headers' room is zeroed (smoltcp writes every payload
        // byte), not a 62 KiB segment's whole length before smoltcp overwrites it; and a slot that already holds
        // `len` bytes is chosen (one that last held a small packet would be zeroed up to `len` by `resize`).
        let mut p = self.pool.alloc_for_overwrite_len(len);
        let buf = p.make_mut();
        buf.truncate(len);
        buf.resize(len, 0);
        buf[..len.min(HEADERS)].fill(0);
        let r = f(buf);
        finish_tcp(&mut p, self.mss);
        self.tx.push(p);
        r
    }

    fn set_meta(&mut self, meta: PacketMeta) {
        self.mss = meta.segmentation_offload_size.map(u16::from);
    }
}

/// Completes what smoltcp left of a TCP segment it wrote (its checksum is not computed: `Checksum::None`): a
/// segment longer than `mss` becomes a GSO super-packet with the pseudo-header sum in its checksum field, any
/// other gets its complete checksum.
fn finish_tcp(p: &mut Packet, mss: Option<u16>) {
    let Ok(info) = PacketInfo::parse(p.data()) else { return };
    if info.protocol != proto::TCP || info.fragment.is_some() {
        return;
    }
    let (start, end) = (info.l4_offset, info.total_len);
    let Some(&offset) = p.data().get(start + 12) else { return };
    let hdr = start + usize::from(offset >> 4) * 4;
    let field = start + 16;
    if hdr > end || field + 2 > end {
        return;
    }
    let pseudo = checksum::pseudo_header(info.src, info.dst, proto::TCP, (end - start) as u32);
    let gso = mss.filter(|&m| m > 0 && end - hdr > usize::from(m)).map(|gso_size| Gso {
        kind: if info.src.is_ipv4() { GsoKind::TcpV4 } else { GsoKind::TcpV6 },
        gso_size,
        hdr_len: hdr as u16,
        csum_start: start as u16,
        l3_offset: 0,
        ecn: false,
    });
    let data = p.make_mut();
    if gso.is_some() && info.src.is_ipv4() && data[6] & 0x40 == 0 {
        // Don't fragment, as a kernel's TCP sends: the kernel forwards a super-packet without it only after cutting
        // it in software (its TSO keeps the IPv4 ids only of packets that cannot be fragmented).
        data[6] |= 0x40;
        data[10..12].fill(0);
        let c = checksum::ipv4_header(&data[..start]);
        data[10..12].copy_from_slice(&c.to_be_bytes());
    }
    data[field..field + 2].fill(0);
    let value = match gso {
        Some(_) => !checksum::finish(pseudo),
        None => checksum::finish(checksum::sum(pseudo, &data[start..end])),
    };
    data[field..field + 2].copy_from_slice(&value.to_be_bytes());
    if let Some(g) = gso {
        p.meta_mut().set(MetaKey::GSO, g.pack());
    }
}

/// Whether TCP packet `p` (parsed as `info`) may be given to smoltcp, which does not check checksums: its
/// checksum is right, or it is left to offload (a GSO super-packet or a partial checksum: a local kernel sent it).
pub(crate) fn tcp_checksum_ok(p: &Packet, info: &PacketInfo) -> bool {
    let meta = p.meta();
    if meta.get(MetaKey::GSO).is_some() || CsumPartial::of(meta).is_some() {
        return true;
    }
    let (start, end) = (info.l4_offset, info.total_len);
    let Some(segment) = p.data().get(start..end) else { return false };
    checksum::verify(checksum::pseudo_header(info.src, info.dst, proto::TCP, segment.len() as u32), segment)
}

impl phy::Device for Queues {
    type RxToken<'a> = Rx;
    type TxToken<'a> = Tx<'a>;

    fn receive(&mut self, _now: Instant) -> Option<(Rx, Tx<'_>)> {
        let p = self.rx.pop_front()?;
        Some((Rx(p), Tx { tx: &mut self.tx, pool: &self.pool, mss: None }))
    }

    fn transmit(&mut self, _now: Instant) -> Option<Tx<'_>> {
        Some(Tx { tx: &mut self.tx, pool: &self.pool, mss: None })
    }

    fn capabilities(&self) -> DeviceCapabilities {
        let mut caps = DeviceCapabilities::default();
        caps.medium = Medium::Ip;
        caps.max_transmission_unit = self.mtu;
        caps.checksum.tcp = Checksum::None;
        if self.gso {
            caps.segmentation.tcpv4 = NonZeroUsize::new(GSO_MAX);
        }
        caps
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An IPv4 TCP segment from 10.0.0.1:1000 to 10.0.0.2:80 with `payload` bytes, checksum zero.
    fn segment(payload: usize) -> Vec<u8> {
        let len = 40 + payload;
        let mut p = vec![0u8; len];
        p[0] = 0x45;
        p[2..4].copy_from_slice(&(len as u16).to_be_bytes());
        p[8] = 64;
        p[9] = proto::TCP;
        p[12..16].copy_from_slice(&[10, 0, 0, 1]);
        p[16..20].copy_from_slice(&[10, 0, 0, 2]);
        let c = checksum::ipv4_header(&p[..20]);
        p[10..12].copy_from_slice(&c.to_be_bytes());
        p[20..22].copy_from_slice(&1000u16.to_be_bytes());
        p[22..24].copy_from_slice(&80u16.to_be_bytes());
        p[32] = 5 << 4;
        p[33] = 0x18;
        for (i, b) in p[40..].iter_mut().enumerate() {
            *b = i as u8;
        }
        p
    }

    /// What smoltcp writes leaves complete: a segment of one MSS with its checksum, a longer one (segmentation
    /// asked for) as a super-packet that cuts into segments with theirs; a segment fed back is checked.
    #[test]
    fn written_segments_get_their_checksums_or_become_super_packets() {
        let pool = PacketPool::new(2048, 4);
        let mut small = pool.alloc_from(&segment(1000));
        finish_tcp(&mut small, Some(1460));
        assert!(small.meta().get(MetaKey::GSO).is_none());
        let info = PacketInfo::parse(small.data()).unwrap();
        assert!(tcp_checksum_ok(&small, &info), "a complete checksum");
        let mut bad = small.clone();
        bad.make_mut()[60] ^= 1;
        assert!(!tcp_checksum_ok(&bad, &PacketInfo::parse(bad.data()).unwrap()), "a flipped bit is seen");

        let mut big = pool.alloc_from(&segment(4000));
        finish_tcp(&mut big, Some(1460));
        let gso = Gso::of(big.meta()).expect("a super-packet");
        assert_eq!((gso.kind, gso.gso_size, gso.hdr_len, gso.csum_start), (GsoKind::TcpV4, 1460, 40, 20));
        assert!(tcp_checksum_ok(&big, &PacketInfo::parse(big.data()).unwrap()), "left to whoever cuts it");
        let mut cut = Vec::new();
        let mut seg = Vec::new();
        for i in 0..gso.segments(big.len()) {
            gso.segment_into(big.data(), i, &mut seg);
            let p = pool.alloc_from(&seg);
            assert!(tcp_checksum_ok(&p, &PacketInfo::parse(p.data()).unwrap()), "segment {i}");
            cut.extend_from_slice(&seg[40..]);
        }
        assert_eq!(cut, segment(4000)[40..], "the payload, in order");
        // Without a segment size (segmentation not asked for), a long segment keeps a complete checksum.
        let mut whole = pool.alloc_from(&segment(4000));
        finish_tcp(&mut whole, None);
        assert!(whole.meta().get(MetaKey::GSO).is_none());
        assert!(tcp_checksum_ok(&whole, &PacketInfo::parse(whole.data()).unwrap()));
    }
}
