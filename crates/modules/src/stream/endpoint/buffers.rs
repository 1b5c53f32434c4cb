//! The buffers of the endpoints' TCP sockets, and the sockets the process keeps for reuse.
//!
//! A socket's receive and send buffers are one page buffer of `flexstack_sys::pages` (the receive ring first), so
//! that one `madvise` gives both back to the kernel when neither holds a byte: an idle connection (nothing queued
//! either way, no out-of-order data held, for `idle_discard_ms`) and a socket kept for reuse cost no resident
//! buffer page. Those buffers are never freed (smoltcp does not hand a buffer back), so a socket is never dropped
//! either: an endpoint keeps up to `socket_pool` ended sockets as they are (their pages still resident, for the
//! next connections), and the rest, discarded, go to the process's spare sockets, which every endpoint draws on
//! before it makes a new one (an endpoint that is unloaded leaves all of its sockets there).

use smoltcp::iface::{SocketHandle, SocketSet};
use smoltcp::socket::tcp;
use std::collections::HashMap;
use std::sync::{LazyLock, Mutex};

/// A TCP socket alone in its set, with the place of its buffers.
pub(crate) struct Sock {
    pub sockets: SocketSet<'static>,
    pub handle: SocketHandle,
    /// Address and length of its buffers (one page buffer), if they are page buffers (else the heap's).
    pub bufs: Option<(usize, usize)>,
}

impl Sock {
    /// A new closed socket with buffers of `rx` and `tx` bytes: page buffers, or the heap's if no mapping can be
    /// made.
    pub fn new(rx: usize, tx: usize) -> Sock {
        let (rxb, txb, bufs) = match flexstack_sys::pages::buffer(rx + tx) {
            Ok(buf) => {
                let bufs = (buf.as_ptr() as usize, buf.len());
                let (r, t) = buf.split_at_mut(rx);
                (tcp::SocketBuffer::new(r), tcp::SocketBuffer::new(&mut t[..tx]), Some(bufs))
            }
            Err(_) => (tcp::SocketBuffer::new(vec![0u8; rx]), tcp::SocketBuffer::new(vec![0u8; tx]), None),
        };
        let mut sockets = SocketSet::new(Vec::with_capacity(1));
        let handle = sockets.add(tcp::Socket::new(rxb, txb));
        Sock { sockets, handle, bufs }
    }

    pub fn socket(&mut self) -> &mut tcp::Socket<'static> {
        self.sockets.get_mut::<tcp::Socket>(self.handle)
    }

    /// Gives the pages of its buffers back to the kernel (they read as zeros next time). Only while neither ring
    /// holds a byte the socket still needs. Returns whether pages were discarded.
    pub fn discard(&self) -> bool {
        self.bufs.is_some_and(|(addr, len)| flexstack_sys::pages::discard(addr, len))
    }

    /// Its buffers' sizes: (receive, send).
    fn sizes(&mut self) -> (usize, usize) {
        let s = self.socket();
        (s.recv_capacity(), s.send_capacity())
    }
}

/// Sockets by their buffers' sizes (receive, send).
type BySizes = HashMap<(usize, usize), Vec<Sock>>;

/// Sockets of ended connections that no endpoint keeps, closed and discarded.
static SPARE: LazyLock<Mutex<BySizes>> = LazyLock::new(Default::default);

/// A spare socket with buffers of `rx` and `tx` bytes, if the process has one.
pub(crate) fn take_spare(rx: usize, tx: usize) -> Option<Sock> {
    SPARE.lock().unwrap_or_else(|e| e.into_inner()).get_mut(&(rx, tx))?.pop()
}

/// Keeps socket `s` for any endpoint: closed at once without a word to its peer, its buffers discarded. Sockets
/// whose buffers are the heap's are dropped (they free their buffers).
pub(crate) fn give_spare(mut s: Sock) {
    if s.bufs.is_none() {
        return;
    }
    s.socket().abort();
    s.discard();
    let sizes = s.sizes();
    SPARE.lock().unwrap_or_else(|e| e.into_inner()).entry(sizes).or_default().push(s);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spare_socket_is_reused_by_its_sizes() {
        let mut s = Sock::new(20_000, 12_000);
        assert_eq!(s.sizes(), (20_000, 12_000));
        let (addr, len) = s.bufs.expect("page buffers");
        assert!(len >= 32_000 && addr % 4096 == 0);
        give_spare(s);
        assert!(take_spare(12_000, 20_000).is_none(), "other sizes");
        let mut again = take_spare(20_000, 12_000).expect("kept");
        assert_eq!(again.bufs, Some((addr, len)));
        assert_eq!(again.socket().state(), tcp::State::Closed);
        assert_eq!(flexstack_sys::pages::resident_pages(addr, len).unwrap(), 0);
    }
}
