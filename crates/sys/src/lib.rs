//! flexstack-sys: every `unsafe` block of flexstack, each with its reason. The rest of the workspace denies
//! unsafe code (`#![deny(unsafe_code)]`) and calls these safe wrappers.
//!
//! - The few system calls that have no safe wrapper in `nix`: binding an AF_PACKET socket to an interface, setting
//!   packet-socket options, reading a frame into a buffer's spare capacity, and a thread's scheduling policy.
//! - [`tcp_info`]: a TCP socket's `TCP_INFO` with the fields glibc's struct lacks (the delivery rate), and
//!   [`socket_queues`]: the bytes in a socket's send and receive queues.
//! - [`prefetch`]: the CPU's hint to load a cache line, for the late-binding scheduler's deep backlogs.
//! - [`pages`]: page-aligned socket buffers whose pages can be given back to the kernel while they hold nothing.
//! - [`HugeWords`]: zeroed words in a mapping of their own, on transparent huge pages (large tables read at random).
#![allow(unsafe_code)]
#![warn(missing_docs)]

pub mod pages;

mod huge;
pub use huge::{HugeBuf, HugeWords};

use nix::errno::Errno;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

/// A libc call's result: -1 becomes the error in errno (nix's `Errno::result`), anything else is kept.
fn checked(rc: libc::c_int) -> io::Result<libc::c_int> {
    Errno::result(rc).map_err(io::Error::from)
}

/// EtherType "all protocols" for a packet socket, in network byte order.
pub const ETH_P_ALL_BE: u16 = (libc::ETH_P_ALL as u16).to_be();

/// Binds packet socket `fd` to interface `ifindex`, receiving every protocol.
pub fn bind_packet(fd: BorrowedFd<'_>, ifindex: u32) -> io::Result<()> {
    // SAFETY: sockaddr_ll is plain old data; zeroed is a valid value before the fields are set.
    let mut addr: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
    addr.sll_family = libc::AF_PACKET as u16;
    addr.sll_protocol = ETH_P_ALL_BE;
    addr.sll_ifindex = ifindex as i32;
    // SAFETY: `addr` is a valid sockaddr_ll that outlives the call, and the length passed is its size; `fd` is an
    // open socket borrowed for the duration of the call.
    checked(unsafe {
        libc::bind(
            fd.as_raw_fd(),
            &addr as *const libc::sockaddr_ll as *const libc::sockaddr,
            std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t,
        )
    })
    .map(drop)
}

/// Sets PACKET_QDISC_BYPASS on packet socket `fd`: frames it sends skip the interface's queueing discipline.
pub fn set_qdisc_bypass(fd: BorrowedFd<'_>) -> io::Result<()> {
    set_packet_option(fd, libc::PACKET_QDISC_BYPASS, 1)
}

/// Sets PACKET_VNET_HDR on packet socket `fd`: every frame read or written is preceded by a 10-byte
/// `virtio_net_hdr`, which says whether the frame's transport checksum is still to be completed (offloaded by
/// its sender) and whether it is a large segment.
pub fn set_packet_vnet_hdr(fd: BorrowedFd<'_>) -> io::Result<()> {
    set_packet_option(fd, libc::PACKET_VNET_HDR, 1)
}

/// Joins packet socket `fd` (bound to an interface) to fanout group `group` of its network namespace, in hash mode
/// with defragmentation: the kernel spreads the interface's frames over the group's sockets by a hash of each
/// frame's flow (fragments reassembled first, so a datagram's fragments reach one socket).
pub fn join_packet_fanout(fd: BorrowedFd<'_>, group: u16) -> io::Result<()> {
    let mode = (libc::PACKET_FANOUT_HASH | libc::PACKET_FANOUT_FLAG_DEFRAG) as libc::c_int;
    set_packet_option(fd, libc::PACKET_FANOUT, libc::c_int::from(group) | (mode << 16))
}

/// Sets the SOL_PACKET integer option `name` of `fd` to `value`.
fn set_packet_option(fd: BorrowedFd<'_>, name: libc::c_int, value: libc::c_int) -> io::Result<()> {
    // SAFETY: the option value points to a c_int that outlives the call, with its size as the length; `fd` is an
    // open socket borrowed for the duration of the call.
    checked(unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_PACKET,
            name,
            &value as *const libc::c_int as *const libc::c_void,
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    })
    .map(drop)
}

/// What one read of a packet socket ([`recv_packet`]) gave.
#[derive(Clone, Copy, Debug)]
pub struct PacketRead {
    /// Bytes the kernel returned, header included (the whole datagram's size when `truncated`).
    pub bytes: usize,
    /// The frame's `sll_pkttype` (PACKET_HOST, PACKET_OUTGOING, ...), if the kernel gave an address.
    pub pkttype: Option<u8>,
    /// The frame did not fit (MSG_TRUNC).
    pub truncated: bool,
}

/// The two iovecs of a read with a header: `header`, then `buf`'s spare capacity once `buf` is made `start` bytes
/// long (keeping what it held there, zeroing only what it lacked) with room for `room` bytes more.
fn header_and_spare(header: &mut [u8], buf: &mut Vec<u8>, start: usize, room: usize) -> [libc::iovec; 2] {
    buf.resize(start, 0);
    buf.reserve(room);
    let spare = buf.spare_capacity_mut();
    [
        libc::iovec { iov_base: header.as_mut_ptr().cast(), iov_len: header.len() },
        libc::iovec { iov_base: spare.as_mut_ptr().cast(), iov_len: spare.len() },
    ]
}

/// Reads one frame from packet socket `fd` without blocking: the first `header.len()` bytes into `header`, the rest
/// into `buf` from offset `start` on, and sets `buf`'s length to `start` plus what was read there. `buf` is cut to
/// `start` bytes (the headroom before the frame: kept, or zeroed where `buf` was shorter) and given room for `room`
/// bytes more first, but not zeroed: the kernel writes straight into its spare capacity. nix's `recvmsg` takes
/// initialized buffers only, and zeroing a 64 KiB buffer before each read (a pooled buffer that held a small frame
/// last) was 4 % of the emulated link's CPU time.
pub fn recv_packet(
    fd: BorrowedFd<'_>,
    header: &mut [u8],
    buf: &mut Vec<u8>,
    start: usize,
    room: usize,
) -> io::Result<PacketRead> {
    let mut iov = header_and_spare(header, buf, start, room);
    // SAFETY: sockaddr_ll and msghdr are plain old data; zeroed is a valid value before the fields are set.
    let mut addr: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_name = (&mut addr as *mut libc::sockaddr_ll).cast();
    msg.msg_namelen = std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t;
    msg.msg_iov = iov.as_mut_ptr();
    msg.msg_iovlen = iov.len();
    // SAFETY: every pointer in `msg` (the address, the iovec array and the two buffers it names, with their true
    // lengths) is valid for writes and outlives the call; `fd` is an open socket borrowed for the call.
    let n = unsafe { libc::recvmsg(fd.as_raw_fd(), &mut msg, libc::MSG_DONTWAIT) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let bytes = n as usize;
    let body = bytes.saturating_sub(header.len()).min(iov[1].iov_len);
    // SAFETY: the kernel initialized the first `body` bytes of the spare capacity (recvmsg filled the iovecs in
    // order: the header first, then `body` bytes of the second buffer), and `body` is at most its capacity.
    unsafe { buf.set_len(start + body) };
    let has_addr = msg.msg_namelen as usize > std::mem::offset_of!(libc::sockaddr_ll, sll_pkttype);
    Ok(PacketRead {
        bytes,
        pkttype: has_addr.then_some(addr.sll_pkttype),
        truncated: msg.msg_flags & libc::MSG_TRUNC != 0,
    })
}

/// Reads one packet from `fd` (a TUN device; with virtio-net headers, or with an empty `header` without) with
/// `readv`: the first `header.len()` bytes into `header`, the rest into `buf` from offset `start` on, whose length is set to `start` plus what was read
/// there; as [`recv_packet`], `buf` is cut to `start` bytes and given room for `room` more but not zeroed (a
/// pooled 64 KiB buffer read into again after a small packet is not cleared first). Returns the bytes read, header
/// included.
pub fn read_with_header(
    fd: BorrowedFd<'_>,
    header: &mut [u8],
    buf: &mut Vec<u8>,
    start: usize,
    room: usize,
) -> io::Result<usize> {
    let iov = header_and_spare(header, buf, start, room);
    // SAFETY: both iovecs name buffers valid for writes of their lengths that outlive the call; `fd` is an open
    // file borrowed for the call.
    let n = unsafe { libc::readv(fd.as_raw_fd(), iov.as_ptr(), iov.len() as libc::c_int) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let bytes = n as usize;
    let body = bytes.saturating_sub(header.len()).min(iov[1].iov_len);
    // SAFETY: readv filled the iovecs in order, the header first, then `body` bytes of the spare capacity, and
    // `body` is at most its capacity.
    unsafe { buf.set_len(start + body) };
    Ok(bytes)
}

/// Starts `cmd` inside the cgroup (v2) whose `cgroup.procs` file `procs` is open for writing: the child moves
/// itself there (writing "0" moves the writer) between fork and exec, so the program and all its descendants are
/// born in the cgroup and the caller never enters it. Spawning fails with the write's error if the move is refused.
pub fn spawn_in_cgroup(cmd: &mut std::process::Command, procs: &std::fs::File) -> io::Result<std::process::Child> {
    use std::os::unix::process::CommandExt;
    let fd = procs.as_raw_fd();
    // SAFETY: the closure runs in the forked child before exec and calls write(2) only, which is
    // async-signal-safe; `fd` stays open in the child (it is the parent's descriptor, closed at exec at the
    // earliest) and the buffer is a static byte.
    unsafe {
        cmd.pre_exec(move || {
            if libc::write(fd, b"0".as_ptr().cast(), 1) == 1 {
                Ok(())
            } else {
                Err(io::Error::last_os_error())
            }
        });
    }
    cmd.spawn()
}

/// Restores the default action of SIGPIPE (terminate quietly), which the Rust runtime sets to "ignore": a command
/// whose output goes to a pipe that closed early (`flexstack monitor ... | head`) then ends as other Unix tools do,
/// instead of panicking in `println!`. Only for commands that do nothing but talk and print: the daemon and the
/// lab runner keep SIGPIPE ignored, so that a peer closing a socket is an error they handle, not their death.
pub fn default_sigpipe() {
    // SAFETY: SIG_DFL is a valid disposition for SIGPIPE; called once at startup before any other thread exists,
    // so nothing races with the change.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

/// Puts the calling thread under SCHED_FIFO at `priority` (1-99): it then runs as soon as it wakes, before any
/// thread of the normal policy (see `sched(7)`; the kernel's real-time throttling still leaves the others 5 % of
/// each second by default). Needs CAP_SYS_NICE (or RLIMIT_RTPRIO). A thread created afterwards by this one inherits
/// the policy.
pub fn set_fifo_priority(priority: i32) -> io::Result<()> {
    set_scheduler(libc::SCHED_FIFO, priority)
}

/// Keeps the calling thread under SCHED_FIFO at `priority` (its current one) and adds SCHED_RESET_ON_FORK: a thread
/// or process it creates starts under the normal policy instead of inheriting the real-time one. Needs no privilege
/// at the current priority (the flag can be set, not cleared, without CAP_SYS_NICE).
pub fn set_fifo_reset_on_fork(priority: i32) -> io::Result<()> {
    set_scheduler(libc::SCHED_FIFO | libc::SCHED_RESET_ON_FORK, priority)
}

/// Puts the calling thread back under the normal policy (SCHED_OTHER), which needs no privilege.
pub fn set_normal_policy() -> io::Result<()> {
    set_scheduler(libc::SCHED_OTHER, 0)
}

/// Puts the calling thread under SCHED_BATCH (from the normal policy; needs no privilege): a CPU-bound thread that,
/// when it wakes, does not preempt the thread running (it waits for a free core or the next tick), while a thread of
/// the normal policy that wakes still preempts it (see `sched(7)`).
pub fn set_batch_policy() -> io::Result<()> {
    set_scheduler(libc::SCHED_BATCH, 0)
}

fn set_scheduler(policy: libc::c_int, priority: i32) -> io::Result<()> {
    let param = libc::sched_param { sched_priority: priority };
    // SAFETY: `param` is a valid sched_param that outlives the call; pid 0 is the calling thread.
    checked(unsafe { libc::sched_setscheduler(0, policy, &param) }).map(drop)
}

/// The calling thread's SCHED_FIFO priority (with or without SCHED_RESET_ON_FORK), or None under another policy.
pub fn fifo_priority() -> io::Result<Option<i32>> {
    // SAFETY: no arguments but the calling thread's id (0).
    let policy = checked(unsafe { libc::sched_getscheduler(0) })?;
    if policy & !libc::SCHED_RESET_ON_FORK != libc::SCHED_FIFO {
        return Ok(None);
    }
    let mut param = libc::sched_param { sched_priority: 0 };
    // SAFETY: `param` is a valid, writable sched_param that outlives the call; pid 0 is the calling thread.
    checked(unsafe { libc::sched_getparam(0, &mut param) })?;
    Ok(Some(param.sched_priority))
}

/// Asks the CPU to start loading the cache line holding `addr` into its caches: a hint only, never a read (a
/// stale or unmapped address is ignored), so it costs no wait. A no-op where there is no such instruction.
#[inline(always)]
pub fn prefetch(addr: usize) {
    #[cfg(all(target_arch = "x86_64", target_feature = "sse"))]
    // SAFETY: `_mm_prefetch` is unsafe only because it is a `#[target_feature(enable = "sse")]` function; SSE is
    // statically enabled here (the cfg above; it is in every x86_64 target's baseline). Rust (1.95) still asks for
    // `unsafe`: such a function may be called without it only from a function that enables the feature itself,
    // not from code the whole build enables it for (and `#[inline(always)]` does not go with `#[target_feature]`).
    // PREFETCHT0 does not access memory architecturally: it never faults and reads or writes nothing the program
    // can observe, whatever the address.
    unsafe {
        core::arch::x86_64::_mm_prefetch::<{ core::arch::x86_64::_MM_HINT_T0 }>(addr as *const i8)
    }
    #[cfg(not(all(target_arch = "x86_64", target_feature = "sse")))]
    let _ = addr;
}

/// The kernel's `struct tcp_info` (include/uapi/linux/tcp.h) up to `tcpi_delivery_rate`: glibc's copy of the struct
/// (libc's `tcp_info` on gnu targets) stops at `tcpi_total_retrans`, before the pacing and delivery rates. A kernel
/// that fills less leaves the rest zero; one that knows more fields is cut at this size (getsockopt copies at most
/// the length it is given).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct RawTcpInfo {
    state: u8,
    ca_state: u8,
    retransmits: u8,
    probes: u8,
    backoff: u8,
    options: u8,
    wscale: u8,
    app_limited: u8,
    rto: u32,
    ato: u32,
    snd_mss: u32,
    rcv_mss: u32,
    unacked: u32,
    sacked: u32,
    lost: u32,
    retrans: u32,
    fackets: u32,
    last_data_sent: u32,
    last_ack_sent: u32,
    last_data_recv: u32,
    last_ack_recv: u32,
    pmtu: u32,
    rcv_ssthresh: u32,
    rtt: u32,
    rttvar: u32,
    snd_ssthresh: u32,
    snd_cwnd: u32,
    advmss: u32,
    reordering: u32,
    rcv_rtt: u32,
    rcv_space: u32,
    total_retrans: u32,
    pacing_rate: u64,
    max_pacing_rate: u64,
    bytes_acked: u64,
    bytes_received: u64,
    segs_out: u32,
    segs_in: u32,
    notsent_bytes: u32,
    min_rtt: u32,
    data_segs_in: u32,
    data_segs_out: u32,
    delivery_rate: u64,
}

/// What a TCP socket's `TCP_INFO` tells about its connection (the fields flexstack's meters use).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TcpInfo {
    /// The TCP state (`TCP_ESTABLISHED` = 1 ... `TCP_CLOSING` = 11, as in the kernel's `tcp_states.h`).
    pub state: u8,
    /// Smoothed round-trip time, microseconds.
    pub srtt_us: u32,
    /// Congestion window, segments.
    pub cwnd: u32,
    /// Largest segment it sends, bytes.
    pub snd_mss: u32,
    /// Segments sent and not yet acknowledged.
    pub unacked: u32,
    /// Segments retransmitted over the connection's life.
    pub total_retrans: u32,
    /// The most recent delivery rate, bytes per second (0 before the kernel measured one).
    pub delivery_rate: u64,
    /// Bytes the peer acknowledged.
    pub bytes_acked: u64,
    /// Bytes received.
    pub bytes_received: u64,
}

/// The name of a kernel TCP state (`TcpInfo::state`, sock_diag's `idiag_state`: `TCP_ESTABLISHED` = 1 ...), as
/// smoltcp's are written.
pub fn tcp_state_name(state: u8) -> &'static str {
    match state {
        1 => "established",
        2 => "syn-sent",
        3 => "syn-received",
        4 => "fin-wait-1",
        5 => "fin-wait-2",
        6 => "time-wait",
        7 => "closed",
        8 => "close-wait",
        9 => "last-ack",
        10 => "listen",
        11 => "closing",
        12 => "new-syn-received",
        _ => "unknown",
    }
}

/// Reads `TCP_INFO` of TCP socket `fd`.
pub fn tcp_info(fd: BorrowedFd<'_>) -> io::Result<TcpInfo> {
    let mut raw = RawTcpInfo::default();
    let mut len = std::mem::size_of::<RawTcpInfo>() as libc::socklen_t;
    // SAFETY: `raw` is a plain-old-data struct of `len` bytes that outlives the call and is valid for writes of up
    // to `len` bytes (the kernel writes at most `len` and sets `len` to what it wrote); `fd` is an open socket
    // borrowed for the duration of the call.
    checked(unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            (&mut raw as *mut RawTcpInfo).cast(),
            &mut len,
        )
    })?;
    Ok(TcpInfo {
        state: raw.state,
        srtt_us: raw.rtt,
        cwnd: raw.snd_cwnd,
        snd_mss: raw.snd_mss,
        unacked: raw.unacked,
        total_retrans: raw.total_retrans,
        delivery_rate: raw.delivery_rate,
        bytes_acked: raw.bytes_acked,
        bytes_received: raw.bytes_received,
    })
}

/// Frames packet socket `fd` dropped since the last call because its receive queue was full (`PACKET_STATISTICS`'s
/// `tp_drops`; reading the statistics resets the kernel's counters, so the caller adds up what each call returns).
pub fn packet_drops(fd: BorrowedFd<'_>) -> io::Result<u32> {
    // SAFETY: tpacket_stats is plain old data (two u32s); zeroed is a valid value.
    let mut stats: libc::tpacket_stats = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tpacket_stats>() as libc::socklen_t;
    // SAFETY: the kernel writes at most `len` bytes into `stats`, which lives for the call, and updates `len`;
    // `fd` is an open socket borrowed for the duration of the call.
    checked(unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::SOL_PACKET,
            libc::PACKET_STATISTICS,
            &mut stats as *mut libc::tpacket_stats as *mut libc::c_void,
            &mut len,
        )
    })?;
    Ok(stats.tp_drops)
}

/// The network namespace the TUN device behind `fd` lives in now (`TUNGETDEVNETNS`, Linux 5.2): the device may have
/// been moved since it was created (an app's NIC is moved into the app's namespace).
pub fn tun_netns(fd: BorrowedFd<'_>) -> io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    /// `_IO('T', 227)` from linux/if_tun.h (the libc crate does not name it).
    const TUNGETDEVNETNS: libc::Ioctl = 0x54e3;
    // SAFETY: the request takes no argument and returns a new file descriptor or -1; `fd` is an open TUN file
    // borrowed for the duration of the call.
    let ns = checked(unsafe { libc::ioctl(fd.as_raw_fd(), TUNGETDEVNETNS) })?;
    // SAFETY: `ns` was just returned by the kernel as a new descriptor that nothing else owns.
    Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(ns) })
}

/// The bytes in socket `fd`'s send queue (not yet acknowledged by the peer, for TCP: `SIOCOUTQ`) and receive queue
/// (not yet read: `SIOCINQ`/`FIONREAD`).
pub fn socket_queues(fd: BorrowedFd<'_>) -> io::Result<(u32, u32)> {
    let (mut out, mut inq): (libc::c_int, libc::c_int) = (0, 0);
    // SAFETY: both requests write one c_int through the pointer, which points to a live c_int for the call; `fd`
    // is an open socket borrowed for the duration of the calls.
    checked(unsafe { libc::ioctl(fd.as_raw_fd(), libc::TIOCOUTQ, &mut out as *mut libc::c_int) })?;
    // SAFETY: as above.
    checked(unsafe { libc::ioctl(fd.as_raw_fd(), libc::FIONREAD, &mut inq as *mut libc::c_int) })?;
    Ok((out.max(0) as u32, inq.max(0) as u32))
}

/// Fixes glibc's threshold above which `malloc` and `calloc` map fresh pages from the kernel (`M_MMAP_THRESHOLD`) to
/// `bytes`, turning off glibc's dynamic threshold (which otherwise rises to the size of any such block freed, after
/// which large blocks come from the heap and `calloc` writes their zeros, making every page resident). With a fixed
/// threshold a large zeroed buffer (`vec![0; n]`, e.g. a socket's ring buffer) stays lazily zeroed: only the pages
/// written are resident. Process-wide; returns false where the C library has no such setting.
pub fn fix_mmap_threshold(bytes: usize) -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        let Ok(bytes) = libc::c_int::try_from(bytes) else { return false };
        // SAFETY: mallopt only changes the allocator's parameters; it takes no pointers.
        unsafe { libc::mallopt(libc::M_MMAP_THRESHOLD, bytes) == 1 }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        let _ = bytes;
        false
    }
}

/// Asks the kernel to back the whole 4 KiB pages inside `buf` with transparent huge pages (`on`: 2 MiB pages where an
/// aligned 2 MiB range of it is mapped; `madvise(MADV_HUGEPAGE)`) or never to (`MADV_NOHUGEPAGE`). A large table
/// read at random (a flow table) then costs one TLB entry per 2 MiB instead of one per page: with thousands of
/// pages each lookup would otherwise also miss the TLB, and a page walk in a virtual machine reads both the guest's
/// and the host's tables. Only advice: where the system has no transparent huge pages (or they are `never`), the
/// memory stays as it was and an error is returned for the caller to ignore or count. Memory the allocator later
/// gives back keeps no advice that matters (it is unmapped or reused as ordinary memory).
pub fn advise_huge_pages(buf: &[u8], on: bool) -> io::Result<()> {
    let page = 4096;
    let start = (buf.as_ptr() as usize).next_multiple_of(page);
    let end = (buf.as_ptr() as usize + buf.len()) & !(page - 1);
    if end <= start {
        return Ok(());
    }
    let advice = if on { libc::MADV_HUGEPAGE } else { libc::MADV_NOHUGEPAGE };
    // SAFETY: [start, end) lies inside `buf`, which is mapped memory of this process (a live borrow); MADV_HUGEPAGE
    // and MADV_NOHUGEPAGE change how the kernel backs those pages, never their contents, and touch no other range.
    checked(unsafe { libc::madvise(start as *mut libc::c_void, end - start, advice) })?;
    Ok(())
}

/// Gives the free memory inside every malloc arena back to the kernel (glibc's `malloc_trim(0)`): memory freed by
/// the data plane (the state of thousands of ended connections, packets beyond the pool's spare ones) otherwise
/// stays resident in its arena. Costs a walk of the free lists (a few milliseconds); returns false where the C
/// library has no such call or nothing was released.
pub fn trim_heap() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: malloc_trim only walks the allocator's own free lists; it takes no pointers of ours.
        unsafe { libc::malloc_trim(0) == 1 }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}

/// `bpf(2)`'s attributes for BPF_PROG_LOAD (the leading fields of `union bpf_attr`; the kernel reads the rest as 0).
#[repr(C)]
#[derive(Default)]
struct BpfProgLoad {
    prog_type: u32,
    insn_cnt: u32,
    insns: u64,
    license: u64,
    log_level: u32,
    log_size: u32,
    log_buf: u64,
}

/// `bpf(2)`'s attributes for BPF_PROG_TEST_RUN (the leading fields).
#[repr(C)]
#[derive(Default)]
struct BpfTestRun {
    prog_fd: u32,
    retval: u32,
    data_size_in: u32,
    data_size_out: u32,
    data_in: u64,
    data_out: u64,
    repeat: u32,
    duration: u32,
}

fn bpf<T>(cmd: libc::c_long, attr: &mut T) -> io::Result<libc::c_long> {
    // SAFETY: `attr` is a live, initialised `#[repr(C)]` prefix of `union bpf_attr` of the size passed, for the
    // command given; every pointer in it points to memory that outlives the call (the callers keep it).
    let rc = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr as *mut T, std::mem::size_of::<T>()) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(rc)
}

/// Loads an eBPF program of type BPF_PROG_TYPE_SOCKET_FILTER (license GPL): `insns` are `struct bpf_insn`s, each as
/// the u64 of its little-endian layout (opcode, registers, offset, immediate). The verifier's log is in the error
/// when it refuses the program. Needs CAP_BPF (or root).
pub fn bpf_load_socket_filter(insns: &[u64]) -> io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    const BPF_PROG_LOAD: libc::c_long = 5;
    let words: Vec<u64> = insns.iter().map(|i| u64::from_le(*i)).collect();
    let license = c"GPL";
    let mut log = vec![0u8; 1 << 16];
    let mut attr = BpfProgLoad {
        prog_type: 1, // BPF_PROG_TYPE_SOCKET_FILTER
        insn_cnt: u32::try_from(words.len()).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?,
        insns: words.as_ptr() as u64,
        license: license.as_ptr() as u64,
        ..BpfProgLoad::default()
    };
    let fd = match bpf(BPF_PROG_LOAD, &mut attr) {
        Ok(fd) => fd,
        Err(e) if e.raw_os_error() == Some(libc::EACCES) || e.raw_os_error() == Some(libc::EINVAL) => {
            // Again with the verifier's log, to say why.
            attr.log_level = 1;
            attr.log_size = log.len() as u32;
            attr.log_buf = log.as_mut_ptr() as u64;
            let _ = bpf(BPF_PROG_LOAD, &mut attr);
            let end = log.iter().position(|b| *b == 0).unwrap_or(log.len());
            return Err(io::Error::new(e.kind(), format!("{e}: {}", String::from_utf8_lossy(&log[..end]).trim())));
        }
        Err(e) => return Err(e),
    };
    // SAFETY: the kernel just returned `fd` as a new descriptor that nothing else owns.
    Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd as libc::c_int) })
}

/// Runs a loaded socket-filter program once on `frame` (an Ethernet frame: the program sees what follows the
/// Ethernet header, as a device's transmit path shows it an IP packet) and returns what it returned
/// (BPF_PROG_TEST_RUN).
pub fn bpf_test_run(prog: BorrowedFd<'_>, frame: &[u8]) -> io::Result<u32> {
    const BPF_PROG_TEST_RUN: libc::c_long = 10;
    let mut out = vec![0u8; frame.len() + 256];
    let mut attr = BpfTestRun {
        prog_fd: prog.as_raw_fd() as u32,
        data_size_in: frame.len() as u32,
        data_size_out: out.len() as u32,
        data_in: frame.as_ptr() as u64,
        data_out: out.as_mut_ptr() as u64,
        repeat: 1,
        ..BpfTestRun::default()
    };
    bpf(BPF_PROG_TEST_RUN, &mut attr)?;
    Ok(attr.retval)
}

/// Attaches steering program `prog` (a socket filter; see [`bpf_load_socket_filter`]) to the multi-queue TUN device
/// of `tun`: the kernel then puts each packet it sends to the device on queue `return value % queues`
/// (TUNSETSTEERINGEBPF) instead of its own flow table's choice.
pub fn tun_set_steering_ebpf(tun: BorrowedFd<'_>, prog: BorrowedFd<'_>) -> io::Result<()> {
    /// `_IOR('T', 224, int)` from linux/if_tun.h.
    const TUNSETSTEERINGEBPF: libc::Ioctl = 0x8004_54e0u32 as libc::Ioctl;
    let fd: libc::c_int = prog.as_raw_fd();
    // SAFETY: the request reads one c_int (the program's descriptor) through the pointer, which points to a live
    // c_int for the call; `tun` is an open TUN file borrowed for the duration of the call.
    checked(unsafe { libc::ioctl(tun.as_raw_fd(), TUNSETSTEERINGEBPF, &fd as *const libc::c_int) })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::os::fd::AsFd;

    /// The layout matches the kernel's: `tcpi_delivery_rate` sits at byte 160 (tcp.h since Linux 4.9).
    #[test]
    fn tcp_info_has_the_kernels_layout() {
        assert_eq!(std::mem::offset_of!(RawTcpInfo, rtt), 68);
        assert_eq!(std::mem::offset_of!(RawTcpInfo, snd_cwnd), 80);
        assert_eq!(std::mem::offset_of!(RawTcpInfo, total_retrans), 100);
        assert_eq!(std::mem::offset_of!(RawTcpInfo, delivery_rate), 160);
    }

    /// A loopback connection that carried bytes reads as established, with a round-trip time and a window.
    #[test]
    fn tcp_info_of_a_loopback_connection() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (mut server, _) = listener.accept().unwrap();
        client.write_all(&[7u8; 100_000]).unwrap();
        let mut buf = vec![0u8; 100_000];
        server.read_exact(&mut buf).unwrap();
        let info = tcp_info(client.as_fd()).unwrap();
        assert_eq!(info.state, 1, "{info:?}");
        assert!(info.srtt_us > 0 && info.cwnd >= 2 && info.snd_mss > 0, "{info:?}");
        assert_eq!(info.bytes_acked, 100_001, "{info:?}"); // the SYN counts one
        client.write_all(&[1u8; 1000]).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert_eq!(socket_queues(server.as_fd()).unwrap(), (0, 1000));
        // Not a TCP socket: an error, not garbage.
        let udp = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        assert!(tcp_info(udp.as_fd()).is_err());
    }
}
