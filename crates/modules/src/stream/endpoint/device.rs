//! The smoltcp `Device` of an endpoint: two in-memory queues of pooled packets. The endpoint puts a connection's
//! packets in `rx` before it polls that connection's socket, and takes what smoltcp sent from `tx` afterwards; no
//! packet is copied on the way in, and the ones smoltcp writes are taken from the switch's pool.

use flexstack_core::{Packet, PacketPool};
use smoltcp::phy::{self, DeviceCapabilities, Medium};
use smoltcp::time::Instant;
use std::collections::VecDeque;

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
}

impl Queues {
    pub fn new(mtu: usize) -> Queues {
        Queues { rx: VecDeque::new(), tx: Vec::new(), pool: PacketPool::new(2048, 64), mtu }
    }
}

pub(crate) struct Rx(Packet);

pub(crate) struct Tx<'a> {
    tx: &'a mut Vec<Packet>,
    pool: &'a PacketPool,
}

impl phy::RxToken for Rx {
    fn consume<R, F: FnOnce(&[u8]) -> R>(self, f: F) -> R {
        f(self.0.data())
    }
}

impl phy::TxToken for Tx<'_> {
    fn consume<R, F: FnOnce(&mut [u8]) -> R>(self, len: usize, f: F) -> R {
        let mut p = self.pool.alloc();
        let buf = p.make_mut();
        buf.resize(len, 0);
        let r = f(buf);
        self.tx.push(p);
        r
    }
}

impl phy::Device for Queues {
    type RxToken<'a> = Rx;
    type TxToken<'a> = Tx<'a>;

    fn receive(&mut self, _now: Instant) -> Option<(Rx, Tx<'_>)> {
        let p = self.rx.pop_front()?;
        Some((Rx(p), Tx { tx: &mut self.tx, pool: &self.pool }))
    }

    fn transmit(&mut self, _now: Instant) -> Option<Tx<'_>> {
        Some(Tx { tx: &mut self.tx, pool: &self.pool })
    }

    fn capabilities(&self) -> DeviceCapabilities {
        let mut caps = DeviceCapabilities::default();
        caps.medium = Medium::Ip;
        caps.max_transmission_unit = self.mtu;
        caps
    }
}
