//! Configuring the kernel's network through netlink, synchronously and in batches: network namespaces, veth pairs,
//! links up and down or moved to another namespace, addresses, routes and static neighbours (IPv4 and IPv6), and the
//! namespace's sysctls. The lab runner builds labs of hundreds of hosts with it in a few netlink round trips instead
//! of one `ip` process per address, route or link.
//!
//! How the parts are called:
//! - [`add_netns`] creates a named network namespace as `ip netns add` does (a bind mount of the namespace under
//!   `/run/netns`, which `ip netns exec` and `nsenter --net=` find), from a helper thread that unshares its own
//!   network namespace; [`del_netns`] removes the name (the kernel frees the namespace, its links with it, once no
//!   process or socket holds it); [`open_netns`] opens one for [`Rtnl::open_in`] and [`in_netns`].
//! - An [`Rtnl`] is a NETLINK_ROUTE socket in one namespace (opened there by a helper thread: a socket stays in the
//!   namespace it was made in). Its `add_*`/`set_*` calls only queue requests; [`Rtnl::commit`] sends them, many in
//!   one datagram, and collects every acknowledgement, keeping at most [`WINDOW`] requests in flight so the answers
//!   never overflow the socket's receive buffer. A failed request is reported with what it was
//!   ([`NetconfError`]); the requests after it in the same commit are still carried out.
//! - [`in_netns`] runs a closure on a helper thread inside a namespace, for what netlink does not do: the
//!   namespace's sysctls ([`write_sysctls`]: `/proc/sys/net` shows the namespace of the thread that opens it).
//!
//! Messages are built and parsed with `netlink-packet-route`; nothing here is unsafe: `setns` and `unshare` are nix's.

use netlink_packet_core::{
    NetlinkHeader, NetlinkMessage, NetlinkPayload, NLM_F_ACK, NLM_F_CREATE, NLM_F_DUMP, NLM_F_EXCL, NLM_F_REPLACE,
    NLM_F_REQUEST,
};
use netlink_packet_route::address::{AddressAttribute, AddressMessage};
use netlink_packet_route::link::{InfoData, InfoKind, InfoVeth, LinkAttribute, LinkFlags, LinkInfo, LinkMessage};
use netlink_packet_route::neighbour::{NeighbourAddress, NeighbourAttribute, NeighbourMessage, NeighbourState};
use netlink_packet_route::route::{RouteAddress, RouteAttribute, RouteMessage, RouteProtocol, RouteScope, RouteType};
use netlink_packet_route::{AddressFamily, RouteNetlinkMessage};
use netlink_sys::{protocols::NETLINK_ROUTE, Socket, SocketAddr};
use std::fmt;
use std::io;
use std::net::IpAddr;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};

/// Where named network namespaces are, as iproute2 keeps them.
pub const NETNS_RUN_DIR: &str = "/run/netns";

/// Most requests in flight on one socket: their acknowledgements (a few hundred bytes of buffer each) fit in the
/// socket's receive buffer many times over.
pub const WINDOW: usize = 128;

/// Seconds a socket waits for the kernel's next answer before the commit fails.
const ANSWER_TIMEOUT_S: i64 = 30;

/// A request that failed: what it was and the kernel's answer.
#[derive(Debug)]
pub struct NetconfError {
    /// What the request did (`add address 10.0.0.1/24 to eth0`), or the operation that failed before any request.
    pub what: String,
    /// The error.
    pub error: io::Error,
    /// How many other requests of the same commit failed too.
    pub more: usize,
}

impl fmt::Display for NetconfError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.what, self.error)?;
        if self.more > 0 {
            write!(f, " (and {} more failed requests)", self.more)?;
        }
        Ok(())
    }
}

impl std::error::Error for NetconfError {}

impl NetconfError {
    fn new(what: impl Into<String>, error: io::Error) -> NetconfError {
        NetconfError { what: what.into(), error, more: 0 }
    }

    /// True if the kernel refused for want of privileges (EPERM or EACCES).
    pub fn is_permission(&self) -> bool {
        self.error.kind() == io::ErrorKind::PermissionDenied
    }
}

/// The result of a netconf call.
pub type Result<T> = std::result::Result<T, NetconfError>;

/// The path of the named namespace `name`.
pub fn netns_path(name: &str) -> PathBuf {
    Path::new(NETNS_RUN_DIR).join(name)
}

/// Makes `/run/netns` a shared mount point, as `ip netns add` does, so that removing a name there reaches every
/// mount namespace (and the namespace can be freed sooner).
fn prepare_run_dir() -> Result<()> {
    use nix::mount::{mount, MsFlags};
    static DONE: std::sync::OnceLock<std::result::Result<(), String>> = std::sync::OnceLock::new();
    let done = DONE.get_or_init(|| {
        std::fs::create_dir_all(NETNS_RUN_DIR).map_err(|e| format!("create {NETNS_RUN_DIR}: {e}"))?;
        let shared =
            || mount(None::<&str>, NETNS_RUN_DIR, Some("none"), MsFlags::MS_SHARED | MsFlags::MS_REC, None::<&str>);
        match shared() {
            Ok(()) => Ok(()),
            Err(nix::errno::Errno::EINVAL) => {
                // Not a mount point yet: make it one, then shared.
                mount(
                    Some(NETNS_RUN_DIR),
                    NETNS_RUN_DIR,
                    Some("none"),
                    MsFlags::MS_BIND | MsFlags::MS_REC,
                    None::<&str>,
                )
                .and_then(|()| shared())
                .map_err(|e| format!("make {NETNS_RUN_DIR} a shared mount: {e}"))
            }
            Err(e) => Err(format!("make {NETNS_RUN_DIR} a shared mount: {e}")),
        }
    });
    done.clone().map_err(|e| NetconfError::new(e, io::Error::from(io::ErrorKind::PermissionDenied)))
}

/// Runs `f` on a helper thread whose network namespace is `netns`; the caller's threads stay where they are.
pub fn in_netns<T: Send>(netns: BorrowedFd<'_>, f: impl FnOnce() -> io::Result<T> + Send) -> io::Result<T> {
    std::thread::scope(|s| {
        s.spawn(|| {
            nix::sched::setns(netns, nix::sched::CloneFlags::CLONE_NEWNET)?;
            f()
        })
        .join()
        .map_err(|_| io::Error::other("the namespace helper thread panicked"))?
    })
}

/// Creates the named network namespace `name` (`ip netns add NAME`) and returns it open. Fails if the name exists.
pub fn add_netns(name: &str) -> Result<OwnedFd> {
    use nix::mount::{mount, MsFlags};
    use std::os::unix::fs::OpenOptionsExt;
    let what = || format!("create network namespace {name}");
    if name.is_empty() || name.contains('/') || name == "." || name == ".." {
        return Err(NetconfError::new(what(), io::Error::from(io::ErrorKind::InvalidInput)));
    }
    prepare_run_dir()?;
    let path = netns_path(name);
    std::fs::OpenOptions::new()
        .read(true)
        .create_new(true)
        .write(true)
        .mode(0o000)
        .open(&path)
        .map_err(|e| NetconfError::new(format!("{} ({})", what(), path.display()), e))?;
    let made = std::thread::scope(|s| {
        s.spawn(|| -> io::Result<()> {
            nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET)?;
            mount(Some("/proc/thread-self/ns/net"), &path, Some("none"), MsFlags::MS_BIND, None::<&str>)?;
            Ok(())
        })
        .join()
        .unwrap_or_else(|_| Err(io::Error::other("the namespace helper thread panicked")))
    });
    if let Err(e) = made {
        let _ = std::fs::remove_file(&path);
        return Err(NetconfError::new(what(), e));
    }
    open_netns(name)
}

/// Opens the named network namespace `name`.
pub fn open_netns(name: &str) -> Result<OwnedFd> {
    let path = netns_path(name);
    std::fs::File::open(&path).map(OwnedFd::from).map_err(|e| NetconfError::new(format!("open {}", path.display()), e))
}

/// Removes the named network namespace `name` (`ip netns del NAME`): its name goes at once; the kernel frees it,
/// and its links, when nothing holds it any more. Quiet when it does not exist.
pub fn del_netns(name: &str) -> Result<()> {
    use nix::mount::{umount2, MntFlags};
    let path = netns_path(name);
    match umount2(&path, MntFlags::MNT_DETACH) {
        Ok(()) | Err(nix::errno::Errno::EINVAL) | Err(nix::errno::Errno::ENOENT) => {}
        Err(e) => return Err(NetconfError::new(format!("unmount {}", path.display()), e.into())),
    }
    match std::fs::remove_file(&path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(NetconfError::new(format!("remove {}", path.display()), e)),
    }
}

/// Removes the named network namespaces `names` ([`del_netns`]) from several threads at once: each removal waits
/// for an RCU grace period (~10 ms), and removals on different threads wait together. Returns the failures.
pub fn del_netns_all(names: &[&str]) -> Vec<NetconfError> {
    const THREADS: usize = 32;
    let per = names.len().div_ceil(THREADS).max(1);
    std::thread::scope(|s| {
        let workers: Vec<_> = names
            .chunks(per)
            .map(|chunk| s.spawn(move || chunk.iter().filter_map(|n| del_netns(n).err()).collect::<Vec<_>>()))
            .collect();
        workers.into_iter().flat_map(|w| w.join().unwrap_or_default()).collect()
    })
}

/// Writes sysctls (`("net.ipv4.ip_forward", "1")`) in the current thread's network namespace.
pub fn write_sysctls(settings: &[(&str, &str)]) -> io::Result<()> {
    for (name, value) in settings {
        let path = Path::new("/proc/sys").join(name.replace('.', "/"));
        std::fs::write(&path, value).map_err(|e| io::Error::new(e.kind(), format!("sysctl {name}={value}: {e}")))?;
    }
    Ok(())
}

/// An address of a link, as [`Rtnl::addresses`] lists it and [`Rtnl::restore_address`] puts it back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Address {
    /// The address.
    pub address: IpAddr,
    /// Its prefix length.
    pub prefix: u8,
    /// Its broadcast address (IPv4), if it has one.
    pub broadcast: Option<std::net::Ipv4Addr>,
}

/// A veth pair to create with [`Rtnl::add_veth`]: `name` in the socket's namespace, `peer` in `peer_netns` (or the
/// socket's namespace). With `up`, `name` is created up; the peer is always created down ([`Rtnl::set_up`] it).
#[derive(Debug, Clone, Default)]
pub struct Veth<'a> {
    /// This end's name.
    pub name: &'a str,
    /// The other end's name.
    pub peer: &'a str,
    /// The other end's namespace (default: the socket's).
    pub peer_netns: Option<BorrowedFd<'a>>,
    /// The other end's MAC address (default: random).
    pub peer_mac: Option<[u8; 6]>,
    /// The MTU of both ends (default: the kernel's, 1500).
    pub mtu: Option<u32>,
    /// Create this end up.
    pub up: bool,
}

/// Parses a MAC address written `02:00:0a:00:00:01`.
pub fn parse_mac(text: &str) -> Option<[u8; 6]> {
    let mut out = [0u8; 6];
    let mut parts = text.split(':');
    for b in &mut out {
        *b = u8::from_str_radix(parts.next()?, 16).ok()?;
    }
    parts.next().is_none().then_some(out)
}

/// A NETLINK_ROUTE socket in one network namespace with the requests queued on it (see the module's docs).
pub struct Rtnl {
    socket: Socket,
    seq: u32,
    /// Serialized requests not sent yet, and what each does.
    queued: Vec<(Vec<u8>, String)>,
    buf: Vec<u8>,
    /// Requests sent so far (the whole life of the socket).
    sent: u64,
}

impl Rtnl {
    /// A socket in the caller's namespace.
    pub fn open() -> Result<Rtnl> {
        let fail = |e| NetconfError::new("open a netlink socket", e);
        let mut socket = Socket::new(NETLINK_ROUTE).map_err(fail)?;
        socket.bind_auto().map_err(fail)?;
        socket.connect(&SocketAddr::new(0, 0)).map_err(fail)?;
        // Errors without a copy of the request: the acknowledgements stay small.
        socket.set_cap_ack(true).map_err(fail)?;
        let _ = socket.set_rx_buf_sz(1 << 20);
        // An answer that never comes (lost to a full buffer) is an error after a while, not a hang.
        let limit = nix::sys::time::TimeVal::new(ANSWER_TIMEOUT_S, 0);
        nix::sys::socket::setsockopt(&socket, nix::sys::socket::sockopt::ReceiveTimeout, &limit)
            .map_err(|e| fail(e.into()))?;
        Ok(Rtnl { socket, seq: 1, queued: Vec::new(), buf: vec![0; 64 * 1024], sent: 0 })
    }

    /// A socket in the namespace `netns` (opened there by a helper thread).
    pub fn open_in(netns: BorrowedFd<'_>) -> Result<Rtnl> {
        in_netns(netns, || Rtnl::open().map_err(|e| e.error))
            .map_err(|e| NetconfError::new("open a netlink socket in a namespace", e))
    }

    /// Requests queued and not committed yet.
    pub fn queued(&self) -> usize {
        self.queued.len()
    }

    /// Requests sent over this socket's life.
    pub fn sent(&self) -> u64 {
        self.sent
    }

    fn queue(&mut self, flags: u16, message: RouteNetlinkMessage, what: String) {
        let mut header = NetlinkHeader::default();
        header.flags = NLM_F_REQUEST | NLM_F_ACK | flags;
        let mut message = NetlinkMessage::new(header, NetlinkPayload::from(message));
        message.finalize();
        let mut bytes = vec![0u8; message.buffer_len()];
        message.serialize(&mut bytes);
        self.queued.push((bytes, what));
    }

    /// Queues the creation of a veth pair.
    pub fn add_veth(&mut self, v: &Veth<'_>) {
        let mut peer = LinkMessage::default();
        peer.attributes.push(LinkAttribute::IfName(v.peer.to_string()));
        if let Some(ns) = v.peer_netns {
            peer.attributes.push(LinkAttribute::NetNsFd(ns.as_raw_fd()));
        }
        if let Some(mac) = v.peer_mac {
            peer.attributes.push(LinkAttribute::Address(mac.to_vec()));
        }
        let mut link = LinkMessage::default();
        link.attributes.push(LinkAttribute::IfName(v.name.to_string()));
        if let Some(mtu) = v.mtu {
            link.attributes.push(LinkAttribute::Mtu(mtu));
            peer.attributes.push(LinkAttribute::Mtu(mtu));
        }
        if v.up {
            // Only this end: the kernel configures the peer before pairing it, and a veth cannot be opened
            // without its peer (ENOTCONN). The peer is set up afterwards, from its namespace's socket.
            link.header.flags = LinkFlags::Up;
            link.header.change_mask = LinkFlags::Up;
        }
        link.attributes.push(LinkAttribute::LinkInfo(vec![
            LinkInfo::Kind(InfoKind::Veth),
            LinkInfo::Data(InfoData::Veth(InfoVeth::Peer(peer))),
        ]));
        let what = format!("create veth pair {} and {}", v.name, v.peer);
        self.queue(NLM_F_CREATE | NLM_F_EXCL, RouteNetlinkMessage::NewLink(link), what);
    }

    /// Queues setting link `index` up or down.
    pub fn set_up(&mut self, index: u32, up: bool) {
        let mut link = LinkMessage::default();
        link.header.index = index;
        link.header.flags = if up { LinkFlags::Up } else { LinkFlags::empty() };
        link.header.change_mask = LinkFlags::Up;
        let what = format!("set link {index} {}", if up { "up" } else { "down" });
        self.queue(0, RouteNetlinkMessage::SetLink(link), what);
    }

    /// Queues moving link `index` to the namespace `netns`.
    pub fn move_link(&mut self, index: u32, netns: BorrowedFd<'_>) {
        let mut link = LinkMessage::default();
        link.header.index = index;
        link.attributes.push(LinkAttribute::NetNsFd(netns.as_raw_fd()));
        self.queue(0, RouteNetlinkMessage::SetLink(link), format!("move link {index} to another namespace"));
    }

    /// Queues adding `address/prefix` to link `index`.
    pub fn add_address(&mut self, index: u32, address: IpAddr, prefix: u8) {
        self.address(index, address, prefix, false);
    }

    /// [`Rtnl::add_address`] without duplicate address detection (`nodad`): an IPv6 address usable at once.
    pub fn add_address_nodad(&mut self, index: u32, address: IpAddr, prefix: u8) {
        self.address(index, address, prefix, true);
    }

    fn address(&mut self, index: u32, address: IpAddr, prefix: u8, nodad: bool) {
        let mut m = AddressMessage::default();
        m.header.family = family(address);
        m.header.prefix_len = prefix;
        m.header.index = index;
        if nodad {
            m.header.flags |= netlink_packet_route::address::AddressHeaderFlags::Nodad;
        }
        m.attributes.push(AddressAttribute::Local(address));
        m.attributes.push(AddressAttribute::Address(address));
        let what = format!("add address {address}/{prefix} to link {index}");
        self.queue(NLM_F_CREATE | NLM_F_EXCL, RouteNetlinkMessage::NewAddress(m), what);
    }

    /// Queues a route to `destination/prefix` (`0.0.0.0/0` or `::/0`: the default route) via `via` (none: on
    /// the link) out of link `index`, in the main table.
    pub fn add_route(&mut self, destination: IpAddr, prefix: u8, via: Option<IpAddr>, index: u32) {
        let mut m = RouteMessage::default();
        m.header.address_family = family(destination);
        m.header.destination_prefix_length = prefix;
        m.header.table = netlink_packet_route::route::RouteHeader::RT_TABLE_MAIN;
        m.header.protocol = RouteProtocol::Static;
        m.header.scope = if via.is_some() { RouteScope::Universe } else { RouteScope::Link };
        m.header.kind = RouteType::Unicast;
        if prefix > 0 {
            m.attributes.push(RouteAttribute::Destination(RouteAddress::from(destination)));
        }
        if let Some(g) = via {
            m.attributes.push(RouteAttribute::Gateway(RouteAddress::from(g)));
        }
        m.attributes.push(RouteAttribute::Oif(index));
        let gw = via.map(|g| format!(" via {g}")).unwrap_or_default();
        let what = format!("add route {destination}/{prefix}{gw} on link {index}");
        self.queue(NLM_F_CREATE | NLM_F_EXCL, RouteNetlinkMessage::NewRoute(m), what);
    }

    /// Queues the policy rule `fwmark MARK lookup TABLE` of `v6`'s family (the server role of the kernel
    /// back-end: docs/streams.md).
    pub fn add_fwmark_rule(&mut self, v6: bool, mark: u32, table: u32) {
        let mut m = netlink_packet_route::rule::RuleMessage::default();
        m.header.family = if v6 { AddressFamily::Inet6 } else { AddressFamily::Inet };
        m.header.action = netlink_packet_route::rule::RuleAction::ToTable;
        m.attributes.push(netlink_packet_route::rule::RuleAttribute::FwMark(mark));
        m.attributes.push(netlink_packet_route::rule::RuleAttribute::Table(table));
        let what = format!("add rule fwmark {mark:#x} lookup {table}");
        self.queue(NLM_F_CREATE | NLM_F_EXCL, RouteNetlinkMessage::NewRule(m), what);
    }

    /// Whether a policy rule `fwmark MARK` of `v6`'s family is in the namespace (whatever its table). Fails if
    /// requests are queued (commit them first).
    pub fn has_fwmark_rule(&mut self, v6: bool, mark: u32) -> Result<bool> {
        use netlink_packet_route::rule::{RuleAttribute, RuleMessage};
        let mut m = RuleMessage::default();
        m.header.family = if v6 { AddressFamily::Inet6 } else { AddressFamily::Inet };
        let mut found = false;
        self.dump("list rules", RouteNetlinkMessage::GetRule(m), |m| {
            if let RouteNetlinkMessage::NewRule(r) = m {
                found |= r.attributes.iter().any(|a| matches!(a, RuleAttribute::FwMark(f) if *f == mark));
            }
        })?;
        Ok(found)
    }

    /// Queues `local default dev INDEX` (every destination delivered locally) in table `table`, of `v6`'s family.
    pub fn add_local_default(&mut self, v6: bool, table: u32, index: u32) {
        let mut m = RouteMessage::default();
        m.header.address_family = if v6 { AddressFamily::Inet6 } else { AddressFamily::Inet };
        m.header.table = netlink_packet_route::route::RouteHeader::RT_TABLE_UNSPEC;
        m.header.protocol = RouteProtocol::Static;
        m.header.scope = RouteScope::Host;
        m.header.kind = RouteType::Local;
        m.attributes.push(RouteAttribute::Table(table));
        m.attributes.push(RouteAttribute::Oif(index));
        let what = format!("add route local default on link {index} in table {table}");
        self.queue(NLM_F_CREATE | NLM_F_EXCL, RouteNetlinkMessage::NewRoute(m), what);
    }

    /// Queues a permanent neighbour: `address` is at `mac` on link `index` (replacing what the kernel knew).
    pub fn add_neighbour(&mut self, index: u32, address: IpAddr, mac: [u8; 6]) {
        let mut m = NeighbourMessage::default();
        m.header.family = family(address);
        m.header.ifindex = index;
        m.header.state = NeighbourState::Permanent;
        m.attributes.push(NeighbourAttribute::Destination(match address {
            IpAddr::V4(a) => NeighbourAddress::Inet(a),
            IpAddr::V6(a) => NeighbourAddress::Inet6(a),
        }));
        m.attributes.push(NeighbourAttribute::LinkLayerAddress(mac.to_vec()));
        let what = format!("add neighbour {address} on link {index}");
        self.queue(NLM_F_CREATE | NLM_F_REPLACE, RouteNetlinkMessage::NewNeighbour(m), what);
    }

    /// Sends every queued request and waits for all their acknowledgements. The first failure is returned (with
    /// how many more failed); every request was tried.
    pub fn commit(&mut self) -> Result<usize> {
        let queued = std::mem::take(&mut self.queued);
        let total = queued.len();
        let mut first: Option<NetconfError> = None;
        let mut failed = 0usize;
        let mut chunk: Vec<u8> = Vec::new();
        for window in queued.chunks(WINDOW) {
            chunk.clear();
            let base = self.seq;
            for (i, (bytes, _)) in window.iter().enumerate() {
                let start = chunk.len();
                chunk.extend_from_slice(bytes);
                let seq = base.wrapping_add(i as u32);
                // The sequence number sits at bytes 8..12 of the header.
                chunk[start + 8..start + 12].copy_from_slice(&seq.to_ne_bytes());
            }
            self.seq = base.wrapping_add(window.len() as u32);
            self.socket
                .send(&chunk, 0)
                .map_err(|e| NetconfError::new(format!("send to netlink ({})", window[0].1), e))?;
            self.sent += window.len() as u64;
            let mut answered = vec![false; window.len()];
            let mut left = window.len();
            while left > 0 {
                let n = self
                    .socket
                    .recv(&mut &mut self.buf[..], 0)
                    .map_err(|e| NetconfError::new("receive from netlink", e))?;
                for_each_message(&self.buf[..n], |seq, payload| {
                    let i = seq.wrapping_sub(base) as usize;
                    if i >= window.len() || answered[i] {
                        return;
                    }
                    if let NetlinkPayload::Error(e) = payload {
                        answered[i] = true;
                        left -= 1;
                        if e.code.is_some() {
                            failed += 1;
                            if first.is_none() {
                                first = Some(NetconfError::new(window[i].1.clone(), e.to_io()));
                            }
                        }
                    }
                })
                .map_err(|e| NetconfError::new("parse a netlink answer", io::Error::other(e)))?;
            }
        }
        match first {
            Some(mut e) => {
                e.more = failed - 1;
                Err(e)
            }
            None => Ok(total),
        }
    }

    /// The links of the socket's namespace: `(index, name)`. Fails if requests are queued (commit them first).
    pub fn links(&mut self) -> Result<Vec<(u32, String)>> {
        let mut out = Vec::new();
        self.dump("list links", RouteNetlinkMessage::GetLink(LinkMessage::default()), |m| {
            if let RouteNetlinkMessage::NewLink(l) = m {
                let name = l.attributes.iter().find_map(|a| match a {
                    LinkAttribute::IfName(n) => Some(n.clone()),
                    _ => None,
                });
                out.push((l.header.index, name.unwrap_or_default()));
            }
        })?;
        Ok(out)
    }

    /// Packets link `name` dropped, as the kernel counts them (`tx_dropped + rx_dropped` of its 64-bit
    /// statistics); `None` if no link has that name here. Fails if requests are queued (commit them first).
    pub fn dropped(&mut self, name: &str) -> Result<Option<u64>> {
        let mut out = None;
        self.dump("list links", RouteNetlinkMessage::GetLink(LinkMessage::default()), |m| {
            let RouteNetlinkMessage::NewLink(l) = m else { return };
            if !l.attributes.iter().any(|a| matches!(a, LinkAttribute::IfName(n) if n == name)) {
                return;
            }
            out = l.attributes.iter().find_map(|a| match a {
                LinkAttribute::Stats64(s) => Some(s.tx_dropped + s.rx_dropped),
                _ => None,
            });
        })?;
        Ok(out)
    }

    /// The addresses of link `index`, IPv4 and IPv6 (link-local ones too).
    pub fn addresses(&mut self, index: u32) -> Result<Vec<Address>> {
        let mut out = Vec::new();
        self.dump("list addresses", RouteNetlinkMessage::GetAddress(AddressMessage::default()), |m| {
            let RouteNetlinkMessage::NewAddress(a) = m else { return };
            if a.header.index != index {
                return;
            }
            let (mut local, mut address, mut broadcast) = (None, None, None);
            for attr in a.attributes {
                match attr {
                    AddressAttribute::Local(l) => local = Some(l),
                    AddressAttribute::Address(l) => address = Some(l),
                    AddressAttribute::Broadcast(b) => broadcast = Some(b),
                    _ => {}
                }
            }
            if let Some(address) = local.or(address) {
                out.push(Address { address, prefix: a.header.prefix_len, broadcast });
            }
        })?;
        Ok(out)
    }

    /// The default routes (`0.0.0.0/0`, `::/0`, unicast, in any table) that leave through link `index`, directly or
    /// as one of their next hops, as `ip route` would print their destination and gateway.
    pub fn default_routes_via(&mut self, index: u32) -> Result<Vec<String>> {
        let mut out = Vec::new();
        self.dump("list routes", RouteNetlinkMessage::GetRoute(RouteMessage::default()), |m| {
            let RouteNetlinkMessage::NewRoute(r) = m else { return };
            if r.header.destination_prefix_length != 0 || r.header.kind != RouteType::Unicast {
                return;
            }
            let mut oifs = Vec::new();
            let mut gateway = None;
            for attr in &r.attributes {
                match attr {
                    RouteAttribute::Oif(i) => oifs.push(*i),
                    RouteAttribute::Gateway(RouteAddress::Inet(g)) => gateway = Some(g.to_string()),
                    RouteAttribute::Gateway(RouteAddress::Inet6(g)) => gateway = Some(g.to_string()),
                    RouteAttribute::MultiPath(hops) => oifs.extend(hops.iter().map(|h| h.interface_index)),
                    _ => {}
                }
            }
            if oifs.contains(&index) {
                let dest = if r.header.address_family == AddressFamily::Inet6 { "::/0" } else { "0.0.0.0/0" };
                let via = gateway.map(|g| format!(" via {g}")).unwrap_or_default();
                out.push(format!("{dest}{via}"));
            }
        })?;
        Ok(out)
    }

    /// Queues removing `address/prefix` from link `index`.
    pub fn del_address(&mut self, index: u32, address: IpAddr, prefix: u8) {
        let mut m = AddressMessage::default();
        m.header.family = family(address);
        m.header.prefix_len = prefix;
        m.header.index = index;
        m.attributes.push(AddressAttribute::Local(address));
        let what = format!("remove address {address}/{prefix} from link {index}");
        self.queue(0, RouteNetlinkMessage::DelAddress(m), what);
    }

    /// Queues adding `a` to link `index` again (as [`Rtnl::addresses`] listed it, with its broadcast address);
    /// an address the link has already is left as it is.
    pub fn restore_address(&mut self, index: u32, a: &Address) {
        let mut m = AddressMessage::default();
        m.header.family = family(a.address);
        m.header.prefix_len = a.prefix;
        m.header.index = index;
        m.attributes.push(AddressAttribute::Local(a.address));
        m.attributes.push(AddressAttribute::Address(a.address));
        if let Some(b) = a.broadcast {
            m.attributes.push(AddressAttribute::Broadcast(b));
        }
        let what = format!("add address {}/{} to link {index}", a.address, a.prefix);
        self.queue(NLM_F_CREATE | NLM_F_REPLACE, RouteNetlinkMessage::NewAddress(m), what);
    }

    /// Sends the dump request `request` and calls `f` with each message of the answer. Fails if requests are
    /// queued (commit them first).
    fn dump(&mut self, what: &str, request: RouteNetlinkMessage, mut f: impl FnMut(RouteNetlinkMessage)) -> Result<()> {
        if !self.queued.is_empty() {
            return Err(NetconfError::new(what, io::Error::other("requests are queued: commit them first")));
        }
        let mut header = NetlinkHeader::default();
        header.flags = NLM_F_REQUEST | NLM_F_DUMP;
        header.sequence_number = self.seq;
        let seq = self.seq;
        self.seq = self.seq.wrapping_add(1);
        let mut message = NetlinkMessage::new(header, NetlinkPayload::from(request));
        message.finalize();
        let mut bytes = vec![0u8; message.buffer_len()];
        message.serialize(&mut bytes);
        let fail = |e| NetconfError::new(what, e);
        self.socket.send(&bytes, 0).map_err(fail)?;
        let mut done = false;
        let mut error = None;
        while !done {
            let n = self.socket.recv(&mut &mut self.buf[..], 0).map_err(fail)?;
            for_each_message(&self.buf[..n], |s, payload| {
                if s != seq {
                    return;
                }
                match payload {
                    NetlinkPayload::Done(_) => done = true,
                    NetlinkPayload::Error(e) => {
                        done = true;
                        if e.code.is_some() {
                            error = Some(e.to_io());
                        }
                    }
                    NetlinkPayload::InnerMessage(m) => f(m),
                    _ => {}
                }
            })
            .map_err(|e| fail(io::Error::other(e)))?;
        }
        match error {
            Some(e) => Err(fail(e)),
            None => Ok(()),
        }
    }

    /// The index of link `name`.
    pub fn index_of(&mut self, name: &str) -> Result<u32> {
        self.links()?
            .into_iter()
            .find(|(_, n)| n == name)
            .map(|(i, _)| i)
            .ok_or_else(|| NetconfError::new(format!("find link {name}"), io::Error::from(io::ErrorKind::NotFound)))
    }
}

impl AsFd for Rtnl {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.socket.as_fd()
    }
}

fn family(a: IpAddr) -> AddressFamily {
    match a {
        IpAddr::V4(_) => AddressFamily::Inet,
        IpAddr::V6(_) => AddressFamily::Inet6,
    }
}

/// Calls `f(sequence number, payload)` for each message of one netlink datagram.
fn for_each_message(
    mut bytes: &[u8],
    mut f: impl FnMut(u32, NetlinkPayload<RouteNetlinkMessage>),
) -> std::result::Result<(), String> {
    while bytes.len() >= 16 {
        let len = u32::from_ne_bytes(bytes[0..4].try_into().expect("4 bytes")) as usize;
        if len < 16 || len > bytes.len() {
            return Err(format!("a netlink message of {len} bytes in {} bytes", bytes.len()));
        }
        let message = NetlinkMessage::<RouteNetlinkMessage>::deserialize(&bytes[..len]).map_err(|e| e.to_string())?;
        f(message.header.sequence_number, message.payload);
        let step = ((len + 3) & !3).min(bytes.len());
        bytes = &bytes[step..];
    }
    Ok(())
}

/// Runs an nftables script as one transaction (`nft -f -`), in namespace `netns` (`ip netns exec`) or in this
/// process's own; the error carries nft's message.
pub fn nft(netns: Option<&str>, script: &str) -> std::result::Result<(), String> {
    use std::io::Write;
    let mut cmd = match netns {
        Some(ns) => {
            let mut c = std::process::Command::new("ip");
            c.args(["netns", "exec", ns, "nft"]);
            c
        }
        None => std::process::Command::new("nft"),
    };
    let mut child = cmd
        .args(["-f", "-"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| format!("nft: {e} (is nftables installed?)"))?;
    if let Some(mut stdin) = child.stdin.take() {
        let _ = stdin.write_all(script.as_bytes());
    }
    let out = child.wait_with_output().map_err(|e| format!("nft: {e}"))?;
    if !out.status.success() {
        return Err(format!("nft failed: {}", String::from_utf8_lossy(&out.stderr).trim()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn macs_parse() {
        assert_eq!(parse_mac("02:00:0a:00:01:ff"), Some([2, 0, 10, 0, 1, 255]));
        assert_eq!(parse_mac("02:00:0a:00:01"), None);
        assert_eq!(parse_mac("02:00:0a:00:01:ff:00"), None);
        assert_eq!(parse_mac("zz:00:0a:00:01:ff"), None);
    }

    #[test]
    fn requests_are_queued_until_commit_with_what_they_do() {
        let Ok(mut nl) = Rtnl::open() else { return };
        nl.add_address(7, "10.0.0.1".parse().unwrap(), 24);
        nl.add_route("0.0.0.0".parse().unwrap(), 0, Some("10.0.0.2".parse().unwrap()), 7);
        assert_eq!(nl.queued(), 2);
        assert_eq!(nl.queued[1].1, "add route 0.0.0.0/0 via 10.0.0.2 on link 7");
        assert!(nl.links().is_err(), "a dump waits for the queue to be committed");
    }
}
