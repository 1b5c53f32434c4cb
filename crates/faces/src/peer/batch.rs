//! Batched datagram I/O for the `quic`, `udp` and `udpplus` carriers and the kernel endpoints' UDP flows
//! (`stream::engine`): what a carrier (or a flow) sends in one pass goes into an
//! [`Outbox`] and leaves with one system call per run of equal-sized datagrams to the same address (UDP GSO,
//! `UDP_SEGMENT`), and [`recv`] takes what the kernel coalesced (UDP GRO, `UDP_GRO`) in one call. The wire stays
//! the same: the kernel (or the NIC) cuts a run into the datagrams it was made of, and a receiver without GRO gets
//! them one by one. Where GSO is refused (a device without checksum offload: `EIO`; a segment beyond the path's
//! MTU: `EINVAL`), the run goes as single datagrams, and the outbox stops trying what failed.

use crate::sock::socket_addr;
use nix::errno::Errno;
use nix::sys::socket::{
    recvmsg, sendmsg, setsockopt, sockopt, ControlMessage, ControlMessageOwned, MsgFlags, SockaddrStorage,
};
use std::io::{ErrorKind, IoSlice, IoSliceMut};
use std::net::{SocketAddr, UdpSocket};
use std::os::fd::AsRawFd;

/// Most datagrams in one GSO send (the kernel's `UDP_MAX_SEGMENTS`).
pub(crate) const MAX_SEGMENTS: usize = 64;
/// Most bytes in one GSO send (an IP packet's payload, less the UDP header, with room for IPv6's).
const MAX_RUN_BYTES: usize = 65_000;

/// A run of datagrams to one address, back to back in the outbox's buffer: all `seg` bytes long but the last, which
/// may be shorter (and then ends the run).
struct Run {
    to: SocketAddr,
    seg: usize,
    start: usize,
    end: usize,
    count: usize,
}

impl Run {
    /// A datagram shorter than `seg` ended it: nothing more may join.
    fn closed(&self) -> bool {
        self.end - self.start < self.count * self.seg
    }
}

/// The datagrams a carrier sends in one pass, until [`Outbox::flush`].
pub(crate) struct Outbox {
    buf: Vec<u8>,
    runs: Vec<Run>,
    /// GSO works on this socket (until a send says otherwise).
    gso: bool,
    /// The longest segment GSO took or has not refused yet (`EINVAL`: beyond the path's MTU).
    gso_max_seg: usize,
}

impl Default for Outbox {
    fn default() -> Self {
        Outbox { buf: Vec::new(), runs: Vec::new(), gso: true, gso_max_seg: usize::MAX }
    }
}

impl Outbox {
    /// Adds a datagram to `to`: `write` appends its bytes to the buffer it is given (nothing: no datagram).
    pub(crate) fn push_with(&mut self, to: SocketAddr, write: impl FnOnce(&mut Vec<u8>)) {
        let start = self.buf.len();
        write(&mut self.buf);
        let len = self.buf.len() - start;
        if len == 0 {
            return;
        }
        if let Some(r) = self.runs.last_mut() {
            if r.to == to
                && !r.closed()
                && r.count < MAX_SEGMENTS
                && len <= r.seg
                && r.end - r.start + len <= MAX_RUN_BYTES
            {
                r.end += len;
                r.count += 1;
                return;
            }
        }
        self.runs.push(Run { to, seg: len, start, end: start + len, count: 1 });
    }

    /// Adds a datagram to `to`.
    pub(crate) fn push(&mut self, to: SocketAddr, bytes: &[u8]) {
        self.push_with(to, |b| b.extend_from_slice(bytes));
    }

    /// Datagrams waiting.
    pub(crate) fn is_empty(&self) -> bool {
        self.runs.is_empty()
    }

    /// Drops the datagrams waiting.
    pub(crate) fn clear(&mut self) {
        self.runs.clear();
        self.buf.clear();
    }

    /// Sends what waits from `socket`; returns the bytes sent. A datagram the socket does not take (its buffer full,
    /// an error) is lost, as the network may lose it: the carriers recover what must arrive.
    pub(crate) fn flush(&mut self, socket: &UdpSocket) -> u64 {
        self.send(socket, false).0
    }

    /// Sends what waits from `socket`, a connected socket (the runs' addresses are not given to the kernel: only
    /// the socket's own peer is written to, through its cached route); returns the bytes sent and the datagrams the
    /// socket did not take (its buffer full, an error such as an ICMP error reported on it).
    pub(crate) fn flush_connected(&mut self, socket: &UdpSocket) -> (u64, u64) {
        self.send(socket, true)
    }

    fn send(&mut self, socket: &UdpSocket, connected: bool) -> (u64, u64) {
        let (mut sent, mut lost) = (0, 0);
        for r in &self.runs {
            let bytes = &self.buf[r.start..r.end];
            let to = (!connected).then(|| SockaddrStorage::from(r.to));
            if r.count > 1 && self.gso && r.seg <= self.gso_max_seg {
                let seg = r.seg as u16;
                let cmsg = [ControlMessage::UdpGsoSegments(&seg)];
                match sendmsg(socket.as_raw_fd(), &[IoSlice::new(bytes)], &cmsg, MsgFlags::empty(), to.as_ref()) {
                    Ok(n) => {
                        sent += n as u64;
                        continue;
                    }
                    Err(Errno::EAGAIN) => {
                        lost += r.count as u64;
                        continue;
                    }
                    Err(Errno::EIO | Errno::ENOPROTOOPT | Errno::EOPNOTSUPP) => {
                        tracing::info!("no UDP segmentation offload on this path; sending datagrams singly");
                        self.gso = false;
                    }
                    Err(Errno::EINVAL) => self.gso_max_seg = r.seg - 1,
                    Err(_) => {} // an error reported on the socket (ICMP): the datagrams singly, as below
                }
            }
            for (i, d) in bytes.chunks(r.seg).enumerate() {
                let result = if connected { socket.send(d) } else { socket.send_to(d, r.to) };
                match result {
                    Ok(n) => sent += n as u64,
                    Err(e) if e.kind() == ErrorKind::WouldBlock => {
                        lost += (r.count - i) as u64;
                        break;
                    }
                    Err(_) => lost += 1,
                }
            }
        }
        self.runs.clear();
        self.buf.clear();
        (sent, lost)
    }
}

/// Asks the kernel to hand `socket` runs of datagrams coalesced (UDP GRO): [`recv`] cuts them again. Fails where the
/// kernel lacks it (before Linux 5.0); the socket then receives datagrams singly, as it did.
pub(crate) fn enable_gro(socket: &UdpSocket) -> nix::Result<()> {
    setsockopt(socket, sockopt::UdpGroSegment, &true)
}

/// Receives from `socket` into `buf`: the bytes, the sender and the length of each datagram in them (`None`: one
/// datagram; `Some(seg)`: datagrams of `seg` bytes back to back, the last maybe shorter).
pub(crate) fn recv(socket: &UdpSocket, buf: &mut [u8]) -> std::io::Result<(usize, SocketAddr, Option<usize>)> {
    let mut cmsg = nix::cmsg_space!(i32);
    let mut iov = [IoSliceMut::new(buf)];
    let msg = recvmsg::<SockaddrStorage>(socket.as_raw_fd(), &mut iov, Some(&mut cmsg), MsgFlags::empty())?;
    let from = msg.address.as_ref().and_then(socket_addr).ok_or(ErrorKind::InvalidData)?;
    let seg = msg.cmsgs().ok().and_then(|mut c| {
        c.find_map(|m| match m {
            ControlMessageOwned::UdpGroSegments(seg) if seg > 0 => Some(seg as usize),
            _ => None,
        })
    });
    Ok((msg.bytes, from, seg.filter(|&s| s < msg.bytes)))
}

/// The datagrams of what [`recv`] received: `n` bytes of `buf`, `seg` bytes each.
pub(crate) fn datagrams(buf: &mut [u8], n: usize, seg: Option<usize>) -> std::slice::ChunksMut<'_, u8> {
    buf[..n].chunks_mut(seg.unwrap_or(n.max(1)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn pair() -> (UdpSocket, UdpSocket) {
        let a = UdpSocket::bind("127.0.0.1:0").unwrap();
        let b = UdpSocket::bind("127.0.0.1:0").unwrap();
        b.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        (a, b)
    }

    /// Everything received, datagram by datagram, as the carriers cut it.
    fn received(b: &UdpSocket, count: usize) -> Vec<Vec<u8>> {
        let mut buf = vec![0u8; 65536];
        let mut got = Vec::new();
        while got.len() < count {
            let (n, _, seg) = recv(b, &mut buf).unwrap();
            got.extend(datagrams(&mut buf, n, seg).map(|d| d.to_vec()));
        }
        got
    }

    #[test]
    fn runs_of_datagrams_arrive_as_the_datagrams_they_were() {
        for gro in [false, true] {
            let (a, b) = pair();
            if gro {
                enable_gro(&b).unwrap();
            }
            let to = b.local_addr().unwrap();
            let mut out = Outbox::default();
            // Equal sizes (one run), a shorter one ending it, a longer one, then more than a run holds (the default
            // receive buffer holds them all).
            let mut sent: Vec<Vec<u8>> = (0..5u8).map(|i| vec![i; 1000]).collect();
            sent.push(vec![9; 10]);
            sent.push(vec![7; 1200]);
            sent.extend((0..70u8).map(|i| vec![i; 600]));
            for d in &sent {
                out.push(to, d);
            }
            assert_eq!(out.runs.len(), 4, "1000 x 5 + 10, 1200, 600 x 64 (MAX_SEGMENTS), 600 x 6");
            let bytes = out.flush(&a);
            assert_eq!(bytes, sent.iter().map(|d| d.len() as u64).sum::<u64>());
            assert!(out.is_empty());
            assert_eq!(received(&b, sent.len()), sent, "gro {gro}");
        }
    }

    #[test]
    fn a_connected_socket_sends_runs_to_its_peer_and_counts_what_it_did_not_take() {
        let (a, b) = pair();
        let to = b.local_addr().unwrap();
        a.connect(to).unwrap();
        let mut out = Outbox::default();
        let sent: Vec<Vec<u8>> = (0..70u8).map(|i| vec![i; 1400]).chain([vec![1; 3]]).collect();
        for d in &sent {
            // The address is only the runs' key: the socket writes to its peer whatever it says.
            out.push("127.0.0.1:9".parse().unwrap(), d);
        }
        let total = sent.iter().map(|d| d.len() as u64).sum::<u64>();
        assert_eq!(out.flush_connected(&a), (total, 0));
        assert_eq!(received(&b, sent.len()), sent);
        // Its peer gone: the port unreachable that comes back is reported on the next send, which loses its
        // datagrams (at least the first) and says so.
        drop(b);
        out.push(to, &[0; 100]);
        out.flush_connected(&a);
        std::thread::sleep(Duration::from_millis(50));
        for _ in 0..3 {
            out.push(to, &[0; 100]);
        }
        let (bytes, lost) = out.flush_connected(&a);
        assert!(lost >= 1 && bytes + lost * 100 == 300, "{bytes} bytes sent, {lost} lost");
        assert!(out.is_empty());
    }

    #[test]
    fn runs_end_at_another_address_or_a_shorter_datagram() {
        let (x, y) = ("127.0.0.1:1".parse().unwrap(), "127.0.0.1:2".parse().unwrap());
        let mut out = Outbox::default();
        for (to, len) in [(x, 100), (x, 100), (y, 100), (y, 50), (y, 50), (y, 100)] {
            out.push(to, &vec![0; len]);
        }
        let runs: Vec<(usize, usize)> = out.runs.iter().map(|r| (r.seg, r.count)).collect();
        assert_eq!(runs, [(100, 2), (100, 2), (50, 1), (100, 1)]);
        // At most MAX_RUN_BYTES a run.
        let mut out = Outbox::default();
        for _ in 0..60 {
            out.push(x, &[0; 1300]);
        }
        let runs: Vec<usize> = out.runs.iter().map(|r| r.count).collect();
        assert_eq!(runs, [50, 10]);
    }
}
