//! `emulator`: emulates one direction of a link (delay, jitter, rate, bounded queue, loss, duplication, corruption,
//! up/down) on whatever frames pass through it.
//!
//! It brings netem's job into flexstack for kernels without netem. It is a sans-IO delay line: time comes only from
//! [`Output::now`], frames are held in the module (one reused `VecDeque` of `(release time, frame)`) and released
//! from `process` or `poll` once their release time has come; the module asks for a poll at the next release time
//! with [`Output::wake_at`], so it breaks cycles.
//!
//! What happens to a frame arriving at `now`, in this order:
//!
//! 0. **GSO**: a GSO super-frame (a packet carrying `MetaKey::GSO`, e.g. up to 64 KiB of TCP read whole by a
//!    `packet` face) stands for several on-wire packets, its segments. While an impairment that acts per packet is
//!    on (`loss_pct`, Gilbert-Elliott, `duplicate_pct`, `corrupt_pct` above 0, or any `jitter_ms`, which draws a
//!    delay per packet), it is cut into its segments first (tun-rs's `gso_split`, as the `tun` face does; each
//!    segment gets complete checksums, so no `MetaKey::CSUM_PARTIAL`, and the other metadata) and each goes through
//!    the steps below on its own, so every on-wire packet has its own fate, exactly as if the sender had sent
//!    segments. Otherwise it stays whole, and steps 3 and 4 count its segments: it takes as many places in the
//!    queue, and occupies the wire for the bytes of all its segments (each repeats the headers). If only some of
//!    its segments fit in the queue it is cut, and the segments that do not fit are dropped, as a queue receiving
//!    them back to back would. It is released when its last segment is due, never earlier.
//! 1. **up**: if `up` is false the frame is dropped (`drop_down_total`). Setting `up` to false also drops every frame
//!    held (at the poll that follows the knob write) and frees the wire.
//! 2. **loss**: with Gilbert-Elliott active (`ge_p > 0`) the state first moves (good → bad with probability `ge_p`,
//!    bad → good with `ge_r`), then the frame is lost with the loss probability of the new state (`ge_loss_bad_pct`
//!    or `ge_loss_good_pct`); `loss_pct` is not used then. Otherwise it is lost with probability `loss_pct`.
//!    Lost frames count in `drop_loss_total`. A surviving frame is then duplicated with probability
//!    `duplicate_pct` (the copy shares the bytes and goes through the steps below right behind the original,
//!    `duplicated_total`), and a data frame is corrupted with probability `corrupt_pct`: one random bit is flipped,
//!    copy-on-write, so other holders of the packet do not see it (`corrupted_total`). A partial transport
//!    checksum (`MetaKey::CSUM_PARTIAL`, from a `packet` face) is completed before the flip, as netem does, so that
//!    the receiver's checksum check rejects the frame as it would one corrupted on a wire. Frames that are not
//!    corrupted keep their partial checksums (the face writing them hands them back to the kernel to complete).
//! 3. **queue limit**: on-wire packets that have not started on the wire at `now` are the queue; a packet finding
//!    `queue_packets` of them is dropped (`drop_queue_full_total`). With `rate_mbit = 0` nothing ever waits.
//! 4. **rate**: the packet starts on the wire when the previous one has left it (or `now`), and occupies it for
//!    `len * 8 / rate` seconds; with `rate_mbit = 0` it leaves at once.
//! 5. **delay/jitter**: it is due `delay_ms` plus a uniform sample of `±jitter_ms` (never less than 0) after it left
//!    the wire. Unless `reorder` is true, its release time is the later of that and the previous frame's release
//!    time, so frames stay in order; with `reorder`, a frame with an earlier due time overtakes.
//! 6. **release**: the frame is emitted on `out` at the first call (`process` or `poll`) at or after its release
//!    time (`delivered_total`, `bytes_delivered_total`).
//!
//! Randomness comes from a splitmix64 generator seeded with `seed`; a random number is drawn only for an impairment
//! whose probability is strictly between 0 and 100 %, so the same seed, settings and traffic give exactly the same
//! drops. Writing `seed` (even the same value) re-seeds the generator and puts the Gilbert-Elliott state back to
//! good. Knob changes apply to frames arriving after them; held frames keep their release times.
//!
//! Its ports, knobs (each also accepted as a setting) and meters are declared once, in `DECL` below;
//! docs/modules.md lists them with their units, defaults and ranges. Gilbert-Elliott is active when `ge_p > 0`;
//! the mean length of a bad run is then `1 / ge_r` frames. Frames held, dropped or delivered are counted per frame
//! (segments once cut); `wire_packets_total` counts on-wire packets (a whole super-frame counts its segments).
//! `wire_wait_ns_s_total` (ns × s) is the integral over time of the wire backlog (how long a packet arriving then
//! would wait before it starts on the wire), up to the last call; read twice, its increase divided by the seconds
//! between gives the mean wait a packet arriving at a random moment in between meets in the model.
//! `scripts/bench-emulator.sh` subtracts it from measured delays to find the emulator's own delay error.
//! `late_ns_total` (ns) sums how late each released frame left (the time of the call that emitted it minus its
//! release time): the part of that error due to the module being called late. Every drop also goes through
//! [`Output::drop_frame`].
//!
//! No state is handed over on `module replace`: held frames are lost with the old module.

use flexstack_core::frame::{Gso, GsoKind, MetaKey};
use flexstack_core::module::port_type;
use flexstack_core::{
    field, kind_from_decl, Batch, ConfigError, Frame, KindDecl, Meter, MeterDecl, Module, ModuleBuilder, ModuleKind,
    Output, Packet, Param, PortDecl, Settings, Time, Value,
};
use std::collections::VecDeque;

/// The kind's name in stack files.
pub const KIND: &str = "emulator";

/// Longest delay or jitter, in ms (one hour).
const MAX_DELAY_MS: f64 = 3_600_000.0;
/// Highest rate, in Mbit/s.
const MAX_RATE_MBIT: f64 = 1_000_000.0;
/// Longest queue, in frames.
const MAX_QUEUE: u64 = 10_000_000;

/// The `emulator` module kind.
pub struct EmulatorKind;

/// The emulator's parameters (its knobs). `Default` is only a blank to read the settings into: the defaults are
/// declared in `DECL`.
#[derive(Clone, Debug, Default, PartialEq)]
struct Config {
    delay_ms: f64,
    jitter_ms: f64,
    reorder: bool,
    rate_mbit: f64,
    queue_packets: u64,
    loss_pct: f64,
    ge_p: f64,
    ge_r: f64,
    ge_loss_bad_pct: f64,
    ge_loss_good_pct: f64,
    duplicate_pct: f64,
    corrupt_pct: f64,
    up: bool,
    seed: u64,
}

type P = Param<Config>;

/// The kind: ports, knobs and meters.
const DECL: KindDecl<Config, Meters> = KindDecl {
    inputs: &[PortDecl::new("in", port_type::ANY, "frames entering the link")],
    outputs: &[PortDecl::new("out", port_type::ANY, "frames leaving the link, when their time has come")],
    params: &[
        P::f64("delay_ms", "ms", "one-way delay", 0.0, field!(delay_ms)).range(0.0, MAX_DELAY_MS),
        P::f64("jitter_ms", "ms", "uniform jitter around the delay (±)", 0.0, field!(jitter_ms)).range(0.0, MAX_DELAY_MS),
        P::f64("rate_mbit", "Mbit/s", "wire rate; 0 = unlimited", 0.0, field!(rate_mbit)).range(0.0, MAX_RATE_MBIT),
        P::f64("loss_pct", "%", "random loss (when Gilbert-Elliott is off)", 0.0, field!(loss_pct)).range(0.0, 100.0),
        P::f64("ge_p", "", "Gilbert-Elliott: probability good -> bad per frame; > 0 turns the model on", 0.0, field!(ge_p))
            .range(0.0, 1.0),
        P::f64("ge_r", "", "Gilbert-Elliott: probability bad -> good per frame", 0.0, field!(ge_r)).range(0.0, 1.0),
        P::f64("ge_loss_bad_pct", "%", "Gilbert-Elliott: loss in the bad state", 100.0, field!(ge_loss_bad_pct))
            .range(0.0, 100.0),
        P::f64("ge_loss_good_pct", "%", "Gilbert-Elliott: loss in the good state", 0.0, field!(ge_loss_good_pct))
            .range(0.0, 100.0),
        P::f64("duplicate_pct", "%", "frames sent twice", 0.0, field!(duplicate_pct)).range(0.0, 100.0),
        P::f64("corrupt_pct", "%", "data frames with one bit flipped", 0.0, field!(corrupt_pct)).range(0.0, 100.0),
        P::bool("reorder", "let jitter reorder frames", false, field!(reorder)),
        P::u64(
            "queue_packets",
            "packets",
            "most on-wire packets waiting for the wire (a GSO super-frame counts its segments)",
            1000,
            field!(queue_packets),
        )
        .range(0.0, MAX_QUEUE as f64),
        P::bool("up", "false drops everything arriving and held", true, field!(up)),
        P::u64("seed", "", "seed of the random generator; writing it re-seeds", 1, field!(seed)),
    ],
    meters: &[
        MeterDecl::u64("frames_total", "frames", "frames arrived", |m| &mut m.frames),
        MeterDecl::u64("delivered_total", "frames", "frames released on `out`", |m| &mut m.delivered),
        MeterDecl::u64("queued", "frames", "frames held now", |m| &mut m.queued),
        MeterDecl::u64("drop_loss_total", "frames", "frames lost (random or Gilbert-Elliott)", |m| &mut m.drop_loss),
        MeterDecl::u64("drop_queue_full_total", "frames", "frames dropped because the queue was full", |m| {
            &mut m.drop_queue
        }),
        MeterDecl::u64("drop_down_total", "frames", "frames dropped while the link was down", |m| &mut m.drop_down),
        MeterDecl::u64("duplicated_total", "frames", "extra copies sent", |m| &mut m.duplicated),
        MeterDecl::u64("corrupted_total", "frames", "frames with a bit flipped", |m| &mut m.corrupted),
        MeterDecl::u64("bytes_delivered_total", "bytes", "bytes of the data frames released", |m| &mut m.bytes),
        MeterDecl::u64(
            "wire_packets_total",
            "packets",
            "on-wire packets sent on the wire (a GSO super-frame counts its segments)",
            |m| &mut m.wire_packets,
        ),
        MeterDecl::u64("gso_split_total", "frames", "GSO super-frames cut into their segments", |m| &mut m.gso_split),
        MeterDecl::u64(
            "gso_split_errors_total",
            "frames",
            "GSO super-frames that could not be cut (they travel whole)",
            |m| &mut m.gso_split_errors,
        ),
        MeterDecl::u64(
            "wire_wait_ns_s_total",
            "ns*s",
            "integral over time of the wire backlog: its increase over an interval divided by the interval in s is \
             the mean wait of a packet arriving at a random moment",
            |m| &mut m.wire_wait,
        ),
        MeterDecl::u64(
            "late_ns_total",
            "ns",
            "sum over released frames of how late they left (now - release time)",
            |m| &mut m.late,
        ),
    ],
    breaks_cycles: true,
    // One queue model of the whole link: the stack runs on one data-plane worker.
    global_view: true,
    // It cuts super-packets itself when an impairment acts per on-wire packet (step 0).
    accepts_gso: true,
    ..KindDecl::new(
        KIND,
        "emulates a link direction: delay, jitter, rate, queue, loss (random, Gilbert-Elliott), duplicate, corrupt, up/down",
    )
};

impl ModuleKind for EmulatorKind {
    kind_from_decl!(DECL);

    fn configure(&self, settings: &Settings) -> Result<Box<dyn ModuleBuilder>, ConfigError> {
        DECL.configure(settings, Config::default(), |cfg, m, _| Box::new(Emulator::new(cfg, m)))
    }
}

/// The emulator's meters.
#[derive(Default)]
struct Meters {
    frames: Meter,
    delivered: Meter,
    queued: Meter,
    drop_loss: Meter,
    drop_queue: Meter,
    drop_down: Meter,
    duplicated: Meter,
    corrupted: Meter,
    bytes: Meter,
    wire_packets: Meter,
    gso_split: Meter,
    gso_split_errors: Meter,
    wire_wait: Meter,
    late: Meter,
}

/// splitmix64: small, fast, and the same sequence everywhere for a seed.
#[derive(Clone, Debug)]
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// True with probability `p` (0..=1); draws a number only when 0 < p < 1.
    fn chance(&mut self, p: f64) -> bool {
        if p <= 0.0 {
            false
        } else if p >= 1.0 {
            true
        } else {
            self.unit() < p
        }
    }
}

/// The GSO description of a data frame that is a super-frame of more than one segment.
fn gso_of(frame: &Frame) -> Option<Gso> {
    let p = frame.packet()?;
    Gso::of(p.meta()).filter(|g| g.gso_size > 0 && g.segments(p.len()) > 1)
}

/// Length of segment `i` of a super-frame of `len` bytes with `hdr` bytes of headers and `size` bytes of payload
/// per segment.
fn segment_len(len: usize, hdr: usize, size: usize, i: usize) -> usize {
    let payload = len.saturating_sub(hdr);
    hdr + payload.saturating_sub(i * size).min(size)
}

/// A running emulator.
pub struct Emulator {
    cfg: Config,
    rng: Rng,
    /// Gilbert-Elliott state: true when bad.
    ge_bad: bool,
    /// Frames held, by release time (in order of release).
    held: VecDeque<(Time, Frame)>,
    /// Start times on the wire of the on-wire packets that had not started at the last arrival (ascending).
    waiting: VecDeque<Time>,
    /// When the wire is free again.
    wire_free: Time,
    /// Release time of the last frame queued (for FIFO).
    last_release: Time,
    m: Meters,
    /// Segment buffers for cutting GSO super-frames, and their lengths.
    scratch: Vec<Vec<u8>>,
    sizes: Vec<usize>,
    /// Integral of the wire backlog up to `integrated_until`, in ns × s.
    wire_wait_sum: f64,
    integrated_until: Time,
}

fn ms_to_ns(ms: f64) -> f64 {
    ms * 1e6
}

impl Emulator {
    fn new(cfg: Config, m: Meters) -> Emulator {
        Emulator {
            rng: Rng::new(cfg.seed),
            cfg,
            ge_bad: false,
            held: VecDeque::with_capacity(1024),
            waiting: VecDeque::with_capacity(1024),
            wire_free: Time::ZERO,
            last_release: Time::ZERO,
            m,
            scratch: Vec::new(),
            sizes: Vec::new(),
            wire_wait_sum: 0.0,
            integrated_until: Time::ZERO,
        }
    }

    /// Step 2: true if the frame is lost.
    fn lost(&mut self) -> bool {
        if self.cfg.ge_p > 0.0 {
            let flip = if self.ge_bad { self.cfg.ge_r } else { self.cfg.ge_p };
            if self.rng.chance(flip) {
                self.ge_bad = !self.ge_bad;
            }
            let pct = if self.ge_bad { self.cfg.ge_loss_bad_pct } else { self.cfg.ge_loss_good_pct };
            self.rng.chance(pct / 100.0)
        } else {
            self.rng.chance(self.cfg.loss_pct / 100.0)
        }
    }

    /// Flips one random bit of a non-empty data frame; true if it did. A partial transport checksum
    /// (`MetaKey::CSUM_PARTIAL`) is completed first, as netem does (skb_checksum_help before corrupting): the
    /// frame then leaves with a checksum that no longer matches, and the receiver rejects it as it would a frame
    /// corrupted on a wire (written partial, the kernel would checksum the corrupted bytes and the receiver would
    /// take them).
    fn corrupt(&mut self, frame: &mut Frame) -> bool {
        let Some(p) = frame.packet_mut() else { return false };
        if p.is_empty() {
            return false;
        }
        flexstack_wire::checksum::complete_partial(p);
        let bit = self.rng.next_u64() % (p.len() as u64 * 8);
        p.data_mut()[(bit / 8) as usize] ^= 1 << (bit % 8);
        true
    }

    /// Steps 3 to 5 for a frame that survived loss: queue limit, wire, delay; holds it or drops it.
    fn enqueue(&mut self, now: Time, frame: Frame, out: &mut Output<'_>) {
        while self.waiting.front().is_some_and(|&t| t <= now) {
            self.waiting.pop_front();
        }
        let rate = self.cfg.rate_mbit;
        let gso = gso_of(&frame);
        let left_wire = if rate > 0.0 {
            let Some(gso) = gso else {
                if self.waiting.len() as u64 >= self.cfg.queue_packets {
                    self.m.drop_queue.add(1);
                    out.drop_frame(frame);
                    return;
                }
                self.m.wire_packets.add(1);
                let left = self.occupy_wire(now, frame.len());
                return self.delay(left, frame);
            };
            let len = frame.len();
            let (n, hdr, size) = (gso.segments(len), usize::from(gso.hdr_len), usize::from(gso.gso_size));
            if !self.segments_fit(now, n, |i| segment_len(len, hdr, size, i)) {
                // Only some segments fit: each goes on its own, the excess is dropped.
                let Frame::Data(p) = frame else { unreachable!("gso_of returns Some for data frames only") };
                for segment in self.split(p, &gso, out) {
                    self.enqueue(now, Frame::Data(segment), out);
                }
                return;
            }
            self.m.wire_packets.add(n as u64);
            let mut left = now;
            for i in 0..n {
                left = self.occupy_wire(now, segment_len(len, hdr, size, i));
            }
            left
        } else {
            self.m.wire_packets.add(gso.map_or(1, |g| g.segments(frame.len())) as u64);
            now
        };
        self.delay(left_wire, frame);
    }

    /// True if `n` on-wire packets of lengths `len(i)` arriving at `now` all find room in the queue.
    fn segments_fit(&self, now: Time, n: usize, len: impl Fn(usize) -> usize) -> bool {
        // The same test as for one packet, segment after segment: the queue must not be full when it arrives.
        let mut waiting = self.waiting.len() as u64;
        let mut free = self.wire_free.max(now);
        for i in 0..n {
            if waiting >= self.cfg.queue_packets {
                return false;
            }
            if free > now {
                waiting += 1;
            }
            free = Time(free.0.saturating_add(self.busy_ns(len(i))));
        }
        true
    }

    /// Nanoseconds `len` bytes occupy the wire: len * 8 bits / (rate * 1e6 bit/s).
    fn busy_ns(&self, len: usize) -> u64 {
        (len as f64 * 8e3 / self.cfg.rate_mbit).round() as u64
    }

    /// Puts an on-wire packet of `len` bytes arriving at `now` on the wire (rate > 0); returns when it has left.
    fn occupy_wire(&mut self, now: Time, len: usize) -> Time {
        let start = self.wire_free.max(now);
        if start > now {
            self.waiting.push_back(start);
        }
        self.wire_free = Time(start.0.saturating_add(self.busy_ns(len)));
        self.wire_free
    }

    /// Step 5: holds `frame`, which left the wire at `left_wire`, until its release time.
    fn delay(&mut self, left_wire: Time, frame: Frame) {
        let mut delay = ms_to_ns(self.cfg.delay_ms);
        if self.cfg.jitter_ms > 0.0 {
            delay += (self.rng.unit() * 2.0 - 1.0) * ms_to_ns(self.cfg.jitter_ms);
        }
        let due = Time(left_wire.0.saturating_add(delay.max(0.0).round() as u64));
        if self.cfg.reorder {
            let at = self.held.partition_point(|(t, _)| *t <= due);
            self.held.insert(at, (due, frame));
            self.last_release = self.last_release.max(due);
        } else {
            let release = due.max(self.last_release);
            self.last_release = release;
            self.held.push_back((release, frame));
        }
    }

    /// True while an impairment that acts per on-wire packet is on: GSO super-frames are then cut first.
    fn per_packet_impairments(&self) -> bool {
        let c = &self.cfg;
        c.loss_pct > 0.0 || c.ge_p > 0.0 || c.duplicate_pct > 0.0 || c.corrupt_pct > 0.0 || c.jitter_ms > 0.0
    }

    /// Cuts super-frame `p` into its segments (complete checksums, the other metadata and the direction kept); a
    /// frame whose description does not match its bytes comes back whole, without the key, and is counted.
    fn split(&mut self, mut p: Packet, gso: &Gso, out: &mut Output<'_>) -> Vec<Packet> {
        let l3 = usize::from(gso.l3_offset);
        let n = gso.segments(p.len());
        let seg_max = usize::from(gso.hdr_len) + usize::from(gso.gso_size);
        if self.scratch.len() < n {
            self.scratch.resize_with(n, Vec::new);
            self.sizes.resize(n, 0);
        }
        for b in &mut self.scratch[..n] {
            b.resize(seg_max, 0);
        }
        let hdr = tun_rs::VirtioNetHdr {
            flags: 1,
            gso_type: gso.kind.virtio_type(),
            hdr_len: gso.hdr_len.saturating_sub(u16::from(gso.l3_offset)),
            gso_size: gso.gso_size,
            csum_start: gso.csum_start.saturating_sub(u16::from(gso.l3_offset)),
            csum_offset: gso.kind.csum_offset(),
        };
        // gso_split trusts the type: the IP version is checked here.
        let version = p.data().get(l3).map(|b| b >> 4);
        let is_v6 = version == Some(6);
        let version_ok = match gso.kind {
            GsoKind::TcpV4 => version == Some(4),
            GsoKind::TcpV6 => is_v6,
            GsoKind::UdpL4 => version == Some(4) || is_v6,
        };
        let (direction, mut meta) = (p.direction(), *p.meta());
        // Segments carry complete checksums (gso_split computes them): neither key applies to them.
        meta.remove(MetaKey::GSO);
        meta.remove(MetaKey::CSUM_PARTIAL);
        let data = p.data_mut();
        let result = match data.get_mut(l3..) {
            Some(ip) if version_ok => {
                tun_rs::gso_split(ip, hdr, &mut self.scratch[..n], &mut self.sizes[..n], l3, is_v6)
            }
            _ => Err(std::io::Error::other("the IP header does not match the GSO type")),
        };
        match result {
            Ok(count) => {
                self.m.gso_split.add(1);
                (0..count)
                    .map(|i| {
                        let b = &mut self.scratch[i];
                        b[..l3].copy_from_slice(&data[..l3]);
                        let mut s = out.pool().alloc_from(&b[..l3 + self.sizes[i]]);
                        s.set_direction(direction);
                        *s.meta_mut() = meta;
                        s
                    })
                    .collect()
            }
            Err(_) => {
                self.m.gso_split_errors.add(1);
                p.meta_mut().remove(MetaKey::GSO);
                vec![p]
            }
        }
    }

    /// Step 6: emits every frame due by `now`.
    fn release(&mut self, now: Time, out: &mut Output<'_>) {
        let (mut n, mut bytes, mut late) = (0u64, 0u64, 0u64);
        while self.held.front().is_some_and(|(t, _)| *t <= now) {
            let (t, frame) = self.held.pop_front().expect("front exists");
            late += now.0 - t.0;
            n += 1;
            bytes += frame.len() as u64;
            out.emit(0, frame);
        }
        self.m.delivered.add(n);
        self.m.bytes.add(bytes);
        self.m.late.add(late);
    }

    /// Adds the wire backlog's integral from the last call up to `now` (before anything changes the wire).
    fn integrate(&mut self, now: Time) {
        let (from, free) = (self.integrated_until.0, self.wire_free.0);
        if now.0 <= from {
            return;
        }
        // The backlog falls from (free - from) at one ns per ns, down to 0 at `free` (or to (free - now)).
        if free > from {
            let b0 = (free - from) as f64;
            let b1 = free.saturating_sub(now.0) as f64;
            let span = b0 - b1;
            self.wire_wait_sum += (b0 + b1) / 2.0 * span * 1e-9;
        }
        self.integrated_until = now;
    }

    /// Drops every held frame (the link went down) and frees the wire.
    fn drop_held(&mut self, now: Time, out: &mut Output<'_>) {
        let n = self.held.len() as u64;
        for (_, frame) in self.held.drain(..) {
            out.drop_frame(frame);
        }
        self.m.drop_down.add(n);
        self.waiting.clear();
        self.wire_free = now;
        self.last_release = now;
    }

    /// Publishes the queue length and asks for a poll at the next release.
    fn settle(&mut self, out: &mut Output<'_>) -> Option<Time> {
        self.m.queued.set(self.held.len() as u64);
        self.m.wire_wait.set(self.wire_wait_sum.round() as u64);
        let next = self.held.front().map(|(t, _)| *t);
        if let Some(t) = next {
            out.wake_at(t);
        }
        next
    }
}

impl Module for Emulator {
    fn process(&mut self, _port: usize, input: &mut Batch, out: &mut Output<'_>) {
        let now = out.now();
        self.integrate(now);
        self.m.frames.add(input.len() as u64);
        if !self.cfg.up {
            self.drop_held(now, out);
            self.m.drop_down.add(input.len() as u64);
            for f in input.drain(..) {
                out.drop_frame(f);
            }
            self.settle(out);
            return;
        }
        // Frames due before these arrivals leave first.
        self.release(now, out);
        let split = self.per_packet_impairments();
        for frame in input.drain(..) {
            match (split, gso_of(&frame), frame) {
                (true, Some(gso), Frame::Data(p)) => {
                    for segment in self.split(p, &gso, out) {
                        self.arrive(now, Frame::Data(segment), out);
                    }
                }
                (_, _, frame) => self.arrive(now, frame, out),
            }
        }
        self.release(now, out);
        self.settle(out);
    }

    fn poll(&mut self, out: &mut Output<'_>) -> Option<Time> {
        let now = out.now();
        self.integrate(now);
        if !self.cfg.up {
            self.drop_held(now, out);
        } else {
            self.release(now, out);
        }
        self.settle(out)
    }

    fn write_knob(&mut self, knob: &str, value: &Value) -> Result<(), String> {
        self.set_knob(knob, value)
    }
}

impl Emulator {
    /// Steps 2 to 5 for one frame (an on-wire packet, or a GSO super-frame left whole).
    fn arrive(&mut self, now: Time, mut frame: Frame, out: &mut Output<'_>) {
        {
            if self.lost() {
                self.m.drop_loss.add(1);
                out.drop_frame(frame);
                return;
            }
            let copy = if self.rng.chance(self.cfg.duplicate_pct / 100.0) {
                self.m.duplicated.add(1);
                Some(frame.clone())
            } else {
                None
            };
            if self.rng.chance(self.cfg.corrupt_pct / 100.0) && self.corrupt(&mut frame) {
                self.m.corrupted.add(1);
            }
            self.enqueue(now, frame, out);
            if let Some(copy) = copy {
                self.enqueue(now, copy, out);
            }
        }
    }

    fn set_knob(&mut self, knob: &str, value: &Value) -> Result<(), String> {
        DECL.write(&mut self.cfg, knob, value)?;
        if knob == "seed" {
            self.rng = Rng::new(self.cfg.seed);
            self.ge_bad = false;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use crate::testutil::*;
    use flexstack_core::frame::{CsumPartial, Gso, GsoKind, MetaKey};
    use flexstack_core::{Batch, Frame, Switch, Time, Value};
    use flexstack_wire::checksum;
    use std::time::Duration;

    fn stack(args: &[&str]) -> (Switch, Log) {
        let (mut sw, log) = recorded("e", "emulator", args);
        sw.run(Time::ZERO);
        (sw, log)
    }

    /// `n` packets of `size` (>= 4) bytes numbered `from..` (big-endian u32 in the first 4 bytes).
    fn numbered(sw: &Switch, from: u32, n: u32, size: usize) -> Batch {
        (from..from + n)
            .map(|i| {
                let mut p = sw.pool().alloc();
                p.make_mut().resize(size, 0);
                p.make_mut()[..4].copy_from_slice(&i.to_be_bytes());
                Frame::Data(p)
            })
            .collect()
    }

    fn number(data: &[u8]) -> u32 {
        u32::from_be_bytes(data[..4].try_into().unwrap())
    }

    fn send_batch(sw: &mut Switch, at: Time, mut batch: Batch) {
        sw.inject("e", "in", &mut batch).unwrap();
        sw.run(at);
    }

    /// Injects `n` numbered packets (see [`numbered`]) and runs the switch at `at`.
    fn send(sw: &mut Switch, at: Time, from: u32, n: u32, size: usize) {
        let batch = numbered(sw, from, n, size);
        send_batch(sw, at, batch);
    }

    /// Runs the switch at each time it asks for, up to `until`.
    fn drain(sw: &mut Switch, until: Time) {
        while let Some(t) = sw.next_wakeup() {
            if t > until {
                break;
            }
            sw.run(t);
        }
    }

    fn f(v: f64) -> Value {
        Value::F64(v)
    }

    #[test]
    fn delay_releases_each_frame_exactly_d_later() {
        let (mut sw, log) = stack(&["delay_ms=2.5"]);
        let d = Duration::from_micros(2500);
        let sent = [Time::from_millis(1), Time(1_300_000), Time::from_millis(4), Time(4_000_001)];
        for (i, &t) in sent.iter().enumerate() {
            drain(&mut sw, t);
            send(&mut sw, t, 2 * i as u32, 2, 60);
            if i == 1 {
                // Nothing comes early: one nanosecond before the first frame is due, nothing has left.
                assert_eq!(sw.next_wakeup(), Some(sent[0] + d));
                sw.run(Time((sent[0] + d).0 - 1));
                assert!(log.lock().unwrap().is_empty());
            }
        }
        drain(&mut sw, Time::from_millis(100));
        let log = log.lock().unwrap();
        assert_eq!(log.len(), 8);
        for s in log.iter() {
            let i = number(&s.data) as usize / 2;
            assert_eq!(s.at, sent[i] + d, "frame sent at {}", sent[i]);
        }
        assert_eq!(u64_var(&sw, "module.e.delivered_total"), 8);
        assert_eq!(u64_var(&sw, "module.e.bytes_delivered_total"), 8 * 60);
        assert_eq!(u64_var(&sw, "module.e.queued"), 0);
        assert_eq!(sw.next_wakeup(), None);
        assert_eq!(u64_var(&sw, "module.e.late_ns_total"), 0, "every frame left on time");
        // Called 300 µs after the release time: both frames count as 300 µs late.
        drop(log);
        send(&mut sw, Time::from_millis(200), 100, 2, 60);
        sw.run(Time::from_millis(200) + d + std::time::Duration::from_micros(300));
        assert_eq!(u64_var(&sw, "module.e.late_ns_total"), 2 * 300_000);
    }

    #[test]
    fn zero_delay_passes_frames_at_once_and_any_frame_type() {
        let (mut sw, log) = stack(&[]);
        send(&mut sw, Time::from_millis(3), 0, 5, 10);
        assert_eq!(log.lock().unwrap().len(), 5);
        assert!(log.lock().unwrap().iter().all(|s| s.at == Time::from_millis(3)));
    }

    #[test]
    fn jitter_stays_in_bounds_and_keeps_order_unless_reorder() {
        let (mut sw, log) = stack(&["delay_ms=10", "jitter_ms=5", "seed=3"]);
        for k in 0..200u32 {
            let t = Time(k as u64 * 100_000);
            send(&mut sw, t, k, 1, 8);
        }
        drain(&mut sw, Time::from_millis(100));
        let log = log.lock().unwrap();
        assert_eq!(log.len(), 200);
        let nums: Vec<u32> = log.iter().map(|s| number(&s.data)).collect();
        assert_eq!(nums, (0..200).collect::<Vec<_>>(), "FIFO by default");
        for s in log.iter() {
            let sent = Time(number(&s.data) as u64 * 100_000);
            let d = s.at - sent;
            assert!(d >= Duration::from_millis(5) && d <= Duration::from_millis(15) + Duration::from_millis(5));
        }
        drop(log);

        let (mut sw, log) = stack(&["delay_ms=10", "jitter_ms=5", "seed=3", "reorder=true"]);
        for k in 0..200u32 {
            send(&mut sw, Time(k as u64 * 100_000), k, 1, 8);
        }
        drain(&mut sw, Time::from_millis(100));
        let log = log.lock().unwrap();
        assert_eq!(log.len(), 200);
        let nums: Vec<u32> = log.iter().map(|s| number(&s.data)).collect();
        assert!(nums.windows(2).any(|w| w[1] < w[0]), "reordered");
        for s in log.iter() {
            let d = s.at - Time(number(&s.data) as u64 * 100_000);
            assert!(d >= Duration::from_millis(5) && d <= Duration::from_millis(15), "{d:?}");
        }
    }

    #[test]
    fn rate_serializes_frames() {
        // 8 Mbit/s = 1 byte/µs: a 1000-byte frame takes 1 ms on the wire; 100 of them take 100 ms.
        let (mut sw, log) = stack(&["rate_mbit=8"]);
        send(&mut sw, Time::ZERO, 0, 100, 1000);
        assert_eq!(u64_var(&sw, "module.e.queued"), 100);
        drain(&mut sw, Time::from_millis(1000));
        let seen = log.lock().unwrap();
        assert_eq!(seen.len(), 100);
        let frame_time = Duration::from_millis(1);
        let total = seen.last().unwrap().at - Time::ZERO;
        let expected = Duration::from_millis(100);
        assert!(total.abs_diff(expected) <= frame_time, "{total:?}");
        for (k, s) in seen.iter().enumerate() {
            assert_eq!(s.at, Time::from_millis(k as u64 + 1));
        }
        drop(seen);

        // Rate plus delay: the delay counts from the end of serialization.
        sw.apply(vec![knob("e", "delay_ms", f(5.0))]).unwrap();
        let t0 = Time::from_millis(2000);
        send(&mut sw, t0, 0, 10, 1000);
        drain(&mut sw, t0 + Duration::from_secs(1));
        assert_eq!(u64_var(&sw, "module.e.delivered_total"), 110);
        let log = log.lock().unwrap();
        assert_eq!(log[100].at, t0 + Duration::from_millis(1 + 5));
        assert_eq!(log[109].at, t0 + Duration::from_millis(10 + 5));
    }

    #[test]
    fn the_wire_wait_integral_is_the_area_under_the_backlog() {
        // 8 Mbit/s: a 1000-byte frame at 0 leaves a backlog falling from 1 ms to 0: 1e6 ns * 1e-3 s / 2 = 500.
        // Three more at 10 ms: backlog 3 ms falling to 0 (4500); polls in between must not change the sum.
        let (mut sw, _log) = stack(&["rate_mbit=8"]);
        send(&mut sw, Time::ZERO, 0, 1, 1000);
        sw.run(Time(400_000));
        drain(&mut sw, Time::from_millis(5));
        send(&mut sw, Time::from_millis(10), 1, 3, 1000);
        drain(&mut sw, Time::from_millis(20));
        send(&mut sw, Time::from_millis(30), 4, 0, 0);
        sw.run(Time::from_millis(30));
        assert_eq!(u64_var(&sw, "module.e.wire_wait_ns_s_total"), 500 + 4500);
        // Without a rate nothing waits.
        let (mut sw, _log) = stack(&[]);
        send(&mut sw, Time::ZERO, 0, 10, 1000);
        sw.run(Time::from_millis(10));
        assert_eq!(u64_var(&sw, "module.e.wire_wait_ns_s_total"), 0);
    }

    #[test]
    fn queue_limit_drops_the_excess() {
        let (mut sw, log) = stack(&["rate_mbit=8", "queue_packets=10"]);
        // The first frame goes on the wire at once, ten wait, the other 39 find the queue full.
        send(&mut sw, Time::ZERO, 0, 50, 1000);
        assert_eq!(u64_var(&sw, "module.e.drop_queue_full_total"), 39);
        assert_eq!(u64_var(&sw, "module.e.frames_dropped_total"), 39);
        drain(&mut sw, Time::from_millis(1000));
        assert_eq!(log.lock().unwrap().len(), 11);
        // Once the wire drained, there is room again; 5.5 ms later 5 frames have left, so 5 more fit.
        send(&mut sw, Time::from_millis(2000), 100, 11, 1000);
        send(&mut sw, Time(2_005_500_000), 200, 10, 1000);
        assert_eq!(u64_var(&sw, "module.e.drop_queue_full_total"), 39 + 5);
        assert_eq!(u64_var(&sw, "module.e.frames_total"), 71);
    }

    fn delivered_numbers(args: &[&str], n: u32) -> (Vec<u32>, Switch) {
        let (mut sw, log) = stack(args);
        for k in 0..n / 1000 {
            send(&mut sw, Time::from_millis(k as u64), k * 1000, 1000, 8);
        }
        let nums = log.lock().unwrap().iter().map(|s| number(&s.data)).collect();
        (nums, sw)
    }

    #[test]
    fn random_loss_within_the_binomial_interval() {
        let n = 100_000u32;
        let (got, sw) = delivered_numbers(&["loss_pct=10"], n);
        let lost = u64_var(&sw, "module.e.drop_loss_total");
        assert_eq!(lost + got.len() as u64, n as u64);
        // 99 % interval: 10000 ± 2.576 * sqrt(n p (1-p)) = ± 244.
        assert!(lost.abs_diff(10_000) <= 244, "lost {lost}");
        assert_eq!(u64_var(&sw, "module.e.frames_dropped_total"), lost);
    }

    #[test]
    fn same_seed_same_drops() {
        let (a, _) = delivered_numbers(&["loss_pct=30", "seed=7"], 10_000);
        let (b, _) = delivered_numbers(&["loss_pct=30", "seed=7"], 10_000);
        let (c, _) = delivered_numbers(&["loss_pct=30", "seed=8"], 10_000);
        assert_eq!(a, b);
        assert_ne!(a, c);
        let (g1, _) = delivered_numbers(&["ge_p=0.05", "ge_r=0.3", "seed=9"], 10_000);
        let (g2, _) = delivered_numbers(&["ge_p=0.05", "ge_r=0.3", "seed=9"], 10_000);
        assert_eq!(g1, g2);

        // Writing the seed knob restarts the sequence.
        let (mut sw, log) = stack(&["loss_pct=30", "seed=7"]);
        send(&mut sw, Time::ZERO, 0, 1000, 8);
        sw.apply(vec![knob("e", "seed", Value::U64(7))]).unwrap();
        send(&mut sw, Time::from_millis(1), 0, 1000, 8);
        let log = log.lock().unwrap();
        let nums: Vec<u32> = log.iter().map(|s| number(&s.data)).collect();
        let half = nums.len() / 2;
        assert_eq!(nums[..half], nums[half..]);
        assert_eq!(nums[..half], a.iter().copied().filter(|&x| x < 1000).collect::<Vec<_>>()[..]);
    }

    #[test]
    fn gilbert_elliott_mean_burst_is_one_over_r() {
        let n = 400_000u32;
        let r = 0.25;
        let (got, sw) = delivered_numbers(&["ge_p=0.01", "ge_r=0.25", "seed=42"], n);
        let mut bursts = Vec::new();
        let mut prev: i64 = -1;
        for &x in got.iter().chain(std::iter::once(&n)) {
            let gap = x as i64 - prev - 1;
            if gap > 0 {
                bursts.push(gap as f64);
            }
            prev = x as i64;
        }
        let mean = bursts.iter().sum::<f64>() / bursts.len() as f64;
        assert!(bursts.len() > 1000, "{} bursts", bursts.len());
        assert!((mean - 1.0 / r).abs() <= 0.1 / r, "mean burst {mean}");
        // Loss rate ≈ p / (p + r) = 0.0385.
        let lost = u64_var(&sw, "module.e.drop_loss_total") as f64 / n as f64;
        assert!((lost - 0.01 / 0.26).abs() < 0.005, "loss {lost}");
    }

    #[test]
    fn down_drops_held_and_arriving_frames() {
        let (mut sw, log) = stack(&["delay_ms=100"]);
        send(&mut sw, Time::ZERO, 0, 20, 50);
        assert_eq!(u64_var(&sw, "module.e.queued"), 20);
        sw.apply(vec![knob("e", "up", Value::Bool(false))]).unwrap();
        sw.run(Time::from_millis(1));
        assert_eq!(u64_var(&sw, "module.e.drop_down_total"), 20);
        assert_eq!(u64_var(&sw, "module.e.queued"), 0);
        send(&mut sw, Time::from_millis(2), 20, 5, 50);
        assert_eq!(u64_var(&sw, "module.e.drop_down_total"), 25);
        assert_eq!(u64_var(&sw, "module.e.frames_dropped_total"), 25);
        drain(&mut sw, Time::from_millis(500));
        assert!(log.lock().unwrap().is_empty());
        sw.apply(vec![knob("e", "up", Value::Bool(true))]).unwrap();
        send(&mut sw, Time::from_millis(600), 30, 3, 50);
        drain(&mut sw, Time::from_millis(1000));
        let log = log.lock().unwrap();
        assert_eq!(log.len(), 3);
        assert!(log.iter().all(|s| s.at == Time::from_millis(700)));
        // Every packet went back to the pool: nothing leaked while held or dropped.
        let stats = sw.pool().stats();
        assert_eq!(stats.free + stats.released, stats.allocated);
    }

    #[test]
    fn knob_changes_take_effect_between_runs() {
        let (mut sw, log) = stack(&["delay_ms=10"]);
        send(&mut sw, Time::ZERO, 0, 1, 8);
        drain(&mut sw, Time::from_millis(100));
        sw.apply(vec![knob("e", "delay_ms", Value::U64(50))]).unwrap();
        assert_eq!(var(&sw, "module.e.delay_ms"), f(50.0));
        send(&mut sw, Time::from_millis(100), 1, 1, 8);
        drain(&mut sw, Time::from_millis(1000));
        let times: Vec<Time> = log.lock().unwrap().iter().map(|s| s.at).collect();
        assert_eq!(times, [Time::from_millis(10), Time::from_millis(150)]);

        sw.apply(vec![knob("e", "loss_pct", f(100.0))]).unwrap();
        send(&mut sw, Time::from_millis(1000), 2, 10, 8);
        assert_eq!(u64_var(&sw, "module.e.drop_loss_total"), 10);
        sw.apply(vec![knob("e", "loss_pct", f(0.0)), knob("e", "duplicate_pct", f(100.0))]).unwrap();
        send(&mut sw, Time::from_millis(2000), 20, 4, 8);
        drain(&mut sw, Time::from_millis(3000));
        assert_eq!(u64_var(&sw, "module.e.duplicated_total"), 4);
        let nums: Vec<u32> = log.lock().unwrap()[2..].iter().map(|s| number(&s.data)).collect();
        assert_eq!(nums, [20, 20, 21, 21, 22, 22, 23, 23]);

        // Out-of-range values are refused by the switch.
        assert!(sw.apply(vec![knob("e", "loss_pct", f(100.5))]).is_err());
        assert!(sw.apply(vec![knob("e", "delay_ms", f(-1.0))]).is_err());
        assert!(sw.apply(vec![knob("e", "ge_p", f(1.5))]).is_err());
        assert!(sw.apply(vec![knob("e", "up", Value::U64(1))]).is_err());
    }

    #[test]
    fn corruption_flips_one_bit_copy_on_write() {
        let (mut sw, log) = stack(&["corrupt_pct=100"]);
        let batch = numbered(&sw, 0, 20, 64);
        let originals: Vec<Frame> = batch.to_vec();
        send_batch(&mut sw, Time::from_millis(1), batch);
        assert_eq!(u64_var(&sw, "module.e.corrupted_total"), 20);
        let log = log.lock().unwrap();
        assert_eq!(log.len(), 20);
        for (i, (s, o)) in log.iter().zip(&originals).enumerate() {
            // The test's own references still see the original bytes.
            let o = o.packet().unwrap().data();
            assert_eq!(o[4..], [0; 60]);
            assert_eq!(number(o), i as u32);
            let bits: u32 = s.data.iter().zip(o).map(|(a, b)| (a ^ b).count_ones()).sum();
            assert_eq!(bits, 1);
        }
    }

    /// An Ethernet + IPv4 + TCP super-frame with `payload` bytes of data starting at sequence number `seq`, valid
    /// checksums, and the GSO key for segments of `mss` bytes.
    fn tcp_super_frame(sw: &Switch, seq: u32, payload: usize, mss: u16) -> Frame {
        let mut f = vec![0u8; 14 + 20 + 20 + payload];
        f[12..14].copy_from_slice(&0x0800u16.to_be_bytes());
        let ip_len = (20 + 20 + payload) as u16;
        f[14] = 0x45;
        f[16..18].copy_from_slice(&ip_len.to_be_bytes());
        f[18..20].copy_from_slice(&77u16.to_be_bytes());
        f[22] = 64;
        f[23] = 6;
        f[26..30].copy_from_slice(&[10, 0, 0, 1]);
        f[30..34].copy_from_slice(&[10, 0, 0, 2]);
        let ip_sum = checksum::ipv4_header(&f[14..34]);
        f[24..26].copy_from_slice(&ip_sum.to_be_bytes());
        f[34..36].copy_from_slice(&5000u16.to_be_bytes());
        f[36..38].copy_from_slice(&80u16.to_be_bytes());
        f[38..42].copy_from_slice(&seq.to_be_bytes());
        f[46] = 5 << 4;
        f[47] = 0x18; // ACK, PSH
        for (i, b) in f[54..].iter_mut().enumerate() {
            *b = (i % 251) as u8;
        }
        let c = tcp_checksum(&f);
        f[50..52].copy_from_slice(&c.to_be_bytes());
        let mut p = sw.pool().alloc_from(&f);
        let gso = Gso { kind: GsoKind::TcpV4, gso_size: mss, hdr_len: 54, csum_start: 34, l3_offset: 14, ecn: false };
        p.meta_mut().set(MetaKey::GSO, gso.pack());
        p.meta_mut().set(MetaKey::SEQ, 9);
        Frame::Data(p)
    }

    /// The TCP checksum of an Ethernet + IPv4 (20 bytes) + TCP frame, its checksum field taken as zero.
    fn tcp_checksum(f: &[u8]) -> u16 {
        let src = std::net::IpAddr::from(<[u8; 4]>::try_from(&f[26..30]).unwrap());
        let dst = std::net::IpAddr::from(<[u8; 4]>::try_from(&f[30..34]).unwrap());
        let mut t = f[34..].to_vec();
        t[16..18].fill(0);
        checksum::finish(checksum::sum(checksum::pseudo_header(src, dst, 6, t.len() as u32), &t))
    }

    fn tcp_seq(f: &[u8]) -> u32 {
        u32::from_be_bytes(f[38..42].try_into().unwrap())
    }

    #[test]
    fn a_gso_frame_occupies_the_wire_for_all_its_segments_and_leaves_whole() {
        // 8 Mbit/s = 1 byte/µs. 10,000 bytes at 1000 per segment: 10 segments of 54 + 1000 bytes = 10,540 µs.
        let (mut sw, log) = stack(&["rate_mbit=8", "delay_ms=1"]);
        let mut batch = vec![tcp_super_frame(&sw, 1, 10_000, 1000)];
        batch.extend(numbered(&sw, 0, 1, 1000));
        send_batch(&mut sw, Time::ZERO, batch);
        drain(&mut sw, Time::from_millis(1000));
        let log = log.lock().unwrap();
        assert_eq!(log.len(), 2);
        assert_eq!(log[0].at, Time(10_540_000 + 1_000_000), "released when its last segment is due");
        assert_eq!(log[0].data.len(), 54 + 10_000);
        assert!(Gso::of(&log[0].meta).is_some(), "still a super-frame");
        assert_eq!(log[1].at, Time(10_540_000 + 1_000_000 + 1_000_000), "the next frame waited for all of it");
        assert_eq!(u64_var(&sw, "module.e.wire_packets_total"), 11);
        assert_eq!(u64_var(&sw, "module.e.gso_split_total"), 0);
        assert_eq!(u64_var(&sw, "module.e.delivered_total"), 2);
    }

    #[test]
    fn the_queue_counts_segments_and_cuts_a_gso_frame_that_does_not_fit() {
        let (mut sw, log) = stack(&["rate_mbit=8", "queue_packets=5"]);
        // The first segment goes on the wire at once, five wait, the last four find the queue full.
        // Its checksum partial, as a `packet` face reads it from a sender that offloads checksums.
        let frame = with_partial_checksum(tcp_super_frame(&sw, 1000, 10_000, 1000));
        send_batch(&mut sw, Time::ZERO, vec![frame]);
        assert_eq!(u64_var(&sw, "module.e.drop_queue_full_total"), 4);
        assert_eq!(u64_var(&sw, "module.e.gso_split_total"), 1);
        drain(&mut sw, Time::from_millis(1000));
        let log = log.lock().unwrap();
        assert_eq!(log.len(), 6);
        for (i, s) in log.iter().enumerate() {
            assert_eq!(s.data.len(), 54 + 1000);
            assert_eq!(s.at, Time(1_054_000 * (i as u64 + 1)));
            assert_eq!(tcp_seq(&s.data), 1000 + 1000 * i as u32);
            assert_eq!(u16::from_be_bytes([s.data[50], s.data[51]]), tcp_checksum(&s.data), "segment {i}");
            assert_eq!(checksum::ipv4_header(&s.data[14..34]), 0, "IPv4 header checksum of segment {i}");
            assert_eq!(u16::from_be_bytes([s.data[16], s.data[17]]), 20 + 20 + 1000);
            assert_eq!(Gso::of(&s.meta), None);
            assert_eq!(s.meta.get(MetaKey::CSUM_PARTIAL), None, "segment {i}: its checksum is complete");
            assert_eq!(s.meta.get(MetaKey::SEQ), Some(9), "other metadata kept");
        }
    }

    /// `frame` (Ethernet + IPv4 + TCP, complete checksum) with its TCP checksum made partial: the field holds
    /// the pseudo-header sum and the packet carries `MetaKey::CSUM_PARTIAL`.
    fn with_partial_checksum(mut frame: Frame) -> Frame {
        let p = frame.packet_mut().unwrap();
        let f = p.make_mut();
        let src = std::net::IpAddr::from(<[u8; 4]>::try_from(&f[26..30]).unwrap());
        let dst = std::net::IpAddr::from(<[u8; 4]>::try_from(&f[30..34]).unwrap());
        let pseudo = checksum::pseudo_header(src, dst, 6, (f.len() - 34) as u32);
        f[50..52].copy_from_slice(&(!checksum::finish(pseudo)).to_be_bytes());
        p.meta_mut().set(MetaKey::CSUM_PARTIAL, CsumPartial { start: 34, offset: 16 }.pack());
        frame
    }

    #[test]
    fn corruption_completes_a_partial_checksum_first_so_the_receiver_rejects_the_frame() {
        let (mut sw, log) = stack(&["corrupt_pct=100", "seed=3"]);
        let complete = tcp_super_frame(&sw, 7, 500, 1000);
        let complete_bytes = complete.packet().unwrap().data().to_vec();
        let partial = with_partial_checksum(complete);
        assert_ne!(partial.packet().unwrap().data(), &complete_bytes[..]);
        send_batch(&mut sw, Time::ZERO, vec![partial]);
        let log = log.lock().unwrap();
        assert_eq!(log.len(), 1);
        assert_eq!(log[0].meta.get(MetaKey::CSUM_PARTIAL), None, "written whole, its checksum as it now is");
        // One bit away from the frame with its checksum completed: the checksum no longer matches the bytes.
        let bits: u32 = log[0].data.iter().zip(&complete_bytes).map(|(a, b)| (a ^ b).count_ones()).sum();
        assert_eq!(bits, 1);
        let at = log[0].data.iter().zip(&complete_bytes).position(|(a, b)| a != b).unwrap();
        assert!(at >= 14, "seed 3 flips a bit past the Ethernet header (which no checksum covers), at {at}");
        let mut check = log[0].data.clone();
        let stored = u16::from_be_bytes([check[50], check[51]]);
        let ip_ok = checksum::ipv4_header(&check[14..34]) == 0;
        check[50..52].fill(0);
        assert!(stored != tcp_checksum(&check) || !ip_ok, "the receiver would reject it");
    }

    #[test]
    fn with_per_packet_impairments_each_segment_has_the_fate_of_an_ordinary_packet() {
        // A 20-segment super-frame through 50 % loss drops exactly the segments that 20 ordinary packets lose
        // with the same seed.
        let (mut sw, log) = stack(&["loss_pct=50", "seed=5"]);
        let frame = tcp_super_frame(&sw, 0, 20 * 100, 100);
        send_batch(&mut sw, Time::ZERO, vec![frame]);
        assert_eq!(u64_var(&sw, "module.e.gso_split_total"), 1);
        let got: Vec<u32> = log.lock().unwrap().iter().map(|s| tcp_seq(&s.data) / 100).collect();
        let (want, _) = delivered_numbers(&["loss_pct=50", "seed=5"], 1000);
        let want: Vec<u32> = want.into_iter().filter(|&k| k < 20).collect();
        assert_eq!(got, want);
        assert!(!got.is_empty() && got.len() < 20, "{got:?}");
        assert_eq!(u64_var(&sw, "module.e.drop_loss_total") + got.len() as u64, 20);

        // Jitter draws a delay per segment too; without impairments the frame stays whole.
        let (mut sw, log) = stack(&["delay_ms=5", "jitter_ms=1"]);
        let frame = tcp_super_frame(&sw, 0, 3000, 1000);
        send_batch(&mut sw, Time::ZERO, vec![frame]);
        drain(&mut sw, Time::from_millis(1000));
        assert_eq!(log.lock().unwrap().len(), 3);
        let (mut sw, log) = stack(&["delay_ms=5"]);
        let frame = tcp_super_frame(&sw, 0, 3000, 1000);
        send_batch(&mut sw, Time::ZERO, vec![frame]);
        drain(&mut sw, Time::from_millis(1000));
        assert_eq!(log.lock().unwrap().len(), 1);
        assert_eq!(u64_var(&sw, "module.e.wire_packets_total"), 3);
    }

    #[test]
    fn a_gso_frame_that_does_not_match_its_description_travels_whole_and_is_counted() {
        let (mut sw, log) = stack(&["loss_pct=0.000001"]);
        let mut frame = tcp_super_frame(&sw, 0, 3000, 1000);
        // Not IPv4 after all: the split fails.
        frame.packet_mut().unwrap().make_mut()[14] = 0x65;
        send_batch(&mut sw, Time::ZERO, vec![frame]);
        assert_eq!(u64_var(&sw, "module.e.gso_split_errors_total"), 1);
        let log = log.lock().unwrap();
        assert_eq!(log.len(), 1);
        assert_eq!(log[0].data.len(), 3054);
        assert_eq!(Gso::of(&log[0].meta), None, "the key is gone: the frame is one packet now");
    }

    #[test]
    fn rejects_bad_settings_with_their_location() {
        assert_config_error("[modules.e]\nkind = \"emulator\"\nloss_pct = 101\n", Some(3), &["`loss_pct`", "0..=100"]);
        assert_config_error("[modules.e]\nkind = \"emulator\"\n\ndelay_ms = -1\n", Some(4), &[]);
        assert_config_error("[modules.e]\nkind = \"emulator\"\ndelay = 1\n", None, &["unknown setting `delay`"]);
        assert!(configure_toml(
            "[modules.e]\nkind = \"emulator\"\ndelay_ms = 5\nrate_mbit = 10\nge_p = 0.1\nup = false\nseed = 3\n"
        )
        .is_ok());
    }
}
