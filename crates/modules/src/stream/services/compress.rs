//! `compress`: zstd on the byte stream, framed so that a `compress` in `mode = "decompress"` at the other end (the
//! peer flexstack, or further down the same chain) restores the bytes exactly.
//!
//! - `mode = "compress"` (the app's end) compresses the data travelling down and decompresses the data coming up;
//!   `mode = "decompress"` (the far end) does the opposite. So one of each, in either order of a chain, give both
//!   directions back as they were.
//! - The frame: the input becomes blocks of at most 64 KiB, each a 4-byte big-endian header and a payload: bit 31 of the header set means the payload is the bytes as they were (stored, when zstd would not
//!   make them smaller), bits 0-30 are the payload's length. A UDP datagram is one block, so one datagram still.
//! - Blocks are as big as the input at hand allows: the consecutive `Data` chunks of a TCP flow's direction in one
//!   batch are compressed together (up to 64 KiB a block; `terminate` hands over what its socket holds in chunks of
//!   16 KiB), and what is gathered leaves as a block at the end of the batch, so nothing waits for more input (a
//!   small message is sent as it comes; zstd's cost per call and its ratio favour big blocks).
//! - Copies: each byte is copied once on its way to zstd. The chunks are gathered into a buffer that is the block's
//!   input and goes to a compression thread as it is; zstd compresses it in one call straight into a buffer behind
//!   the header (nothing zeroed first), and that buffer becomes the outgoing packet's (swapped in, not copied). The
//!   packet's former buffer and the emptied input come back for the next blocks ([`SPARE_BUFFERS`] of each kept).
//! - The compression threads run under SCHED_BATCH: a thread woken by a block waits for a free core or the next tick
//!   instead of taking the core from the data-plane worker that handed the block over, and the worker (woken by
//!   packets, or by a block made) still takes the core from a thread. With the app, the worker and the threads on
//!   two cores, the bulk transfer was about 10 % faster for it (BENCHMARKS.md, "Services overhead", session 17).
//! - Where zstd runs (setting `offload`, true by default): blocks are compressed on a small pool of compression
//!   threads the process shares ([`THREADS`] at most, started at the first block), in parallel with the data plane
//!   and with each other, and leave strictly in order per flow and direction. The module stays sans-IO: it hands a
//!   block over and goes on; a block not made yet is not emitted yet; the thread that made a block has the module
//!   polled at once through the switch's [`Notifier`] (it wakes the data-plane worker; setting `notify`, true by
//!   default). With `notify = false`, without a notifier (a switch without a waker), or while its blocks wait for
//!   room with none of its own out, it asks to be polled every half of the time a block took lately instead
//!   ([`POLL_EVERY`] to start with; from [`POLL_MIN`] to [`POLL_MAX`]). It collects finished blocks in every
//!   `process` too, and emits the blocks made since,
//!   from the head of each direction's queue. Anything else of that direction that comes meanwhile (a switch mark,
//!   raw bytes, the `Fin`) queues behind them. Bounded: at most [`FLOW_IN_FLIGHT`] blocks of a flow's direction and
//!   [`TOTAL_IN_FLIGHT`] in the process are on the threads; the rest wait in their flow's queue as input bytes not
//!   yet acked, so the flow's credit (its `budget`) stops its producer; input that comes meanwhile joins the last
//!   block waiting (up to 64 KiB), so blocks stay big while the threads are behind. A block smaller than [`INLINE_BELOW`] of a
//!   direction with nothing queued is compressed at once on the worker: a small message does not wait for a hop to
//!   another thread and back. Why a pool and not zstd's own multithreading (`NbWorkers`): a block ends its zstd frame
//!   before it leaves, and with workers that call waits for the frame, cut into jobs of at least 512 KiB: a block
//!   of at most 64 KiB would be one job, made while the data-plane thread waits (docs/architecture.md, "Stream
//!   services off the data plane").
//!   `offload = false` compresses every block on the worker (the way before; for comparisons). Restoring stays on
//!   the worker (zstd decompresses several times faster than it compresses).
//! - Acks: the lengths change, so it keeps an `AckMap` per flow and direction (docs/streams.md): the input bytes of
//!   a block are acknowledged upstream when the output made from them is. Bytes of a block not yet whole wait in a
//!   buffer of the flow (at most one block: 64 KiB + 1 KiB).
//! - A header that announces more than a block, or a payload zstd cannot read, aborts the flow both ways (reason
//!   `compress`), counted in `errors_total`.
//! - `level` is a knob (zstd levels 1 to 19; the next block uses it).
//! - `module replace` with blocks out: the replacement takes over the flows with their queues and the channel the
//!   threads answer on, so the blocks out are emitted by it, in order; nothing is lost.
//! - `active` is a knob: false takes the service out of its flows' paths while they run, true puts it back. Each
//!   direction switches at a point both ends agree on, marked in the stream by the end that compresses it: a block
//!   header with bit 30 set and length 0 ends the blocks (the bytes after it pass as they are), and a `Data` frame
//!   with no bytes starts them again. The restoring end follows the marks, whatever its own knob says, so the two
//!   ends need not be switched together; both start framed, and a flow opened while inactive begins with the end
//!   mark (docs/services.md, "Changing services while flows run").

use super::active;
use super::flows::{
    ack, read_select, slot, translate_ack, Flows, HandedFlows, Seen, SelectRule, SelectionMeters, SELECT, SELECT_DOC,
};
use crate::stream::{BOTH_WAYS_IN, BOTH_WAYS_OUT};
use flexstack_core::module::handed_over;
use flexstack_core::stream::{AckMap, Protocol, StreamFrame, StreamKind};
use flexstack_core::{
    field, kind_from_decl, Batch, ConfigError, Direction, Frame, KindDecl, Meter, MeterDecl, Module, ModuleBuilder,
    ModuleInterface, ModuleKind, ModuleVars, Notifier, Output, Packet, Param, Settings, Time, Value, ValueType,
};
use std::borrow::Cow;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::Duration;
use zstd::zstd_safe::{self, CCtx, CParameter, InBuffer, OutBuffer, ResetDirective};

/// The kind's name in stack files.
pub const KIND: &str = "compress";

/// Most input bytes in one block.
pub const MAX_BLOCK: usize = 64 * 1024;

/// Longest payload a header may announce (zstd's bound for a block, rounded up).
pub const MAX_PAYLOAD: usize = MAX_BLOCK + 1024;

/// A block smaller than this, of a direction with nothing queued, is compressed on the data-plane worker at once.
pub const INLINE_BELOW: usize = 8 * 1024;

/// Most blocks of one flow's direction on the compression threads at once.
pub const FLOW_IN_FLIGHT: usize = 4;

/// Most blocks on the compression threads at once, all modules of the process together.
pub const TOTAL_IN_FLIGHT: usize = 64;

/// Most compression threads (fewer on a machine with fewer cores).
pub const THREADS: usize = 4;

/// Most buffers of each kind (blocks' input, blocks made) a module keeps for its next blocks.
pub const SPARE_BUFFERS: usize = 2 * FLOW_IN_FLIGHT;

/// How soon a module with blocks out asks to be polled again.
pub const POLL_EVERY: Duration = Duration::from_micros(50);

/// The shortest time between two polls while blocks are out.
pub const POLL_MIN: Duration = Duration::from_micros(20);

/// The longest time between two polls while blocks are out.
pub const POLL_MAX: Duration = Duration::from_micros(500);

/// Header bit: the payload is stored, not compressed.
const STORED: u32 = 1 << 31;

/// Header bit (with length 0): the blocks end here; the bytes after pass as they are (the service was taken out).
const SWITCH_OFF: u32 = 1 << 30;

/// The `compress` module kind.
pub struct CompressKind;

/// Settings and knobs.
struct Config {
    level: u64,
    decompress: bool,
    active: bool,
    offload: bool,
    notify: bool,
}

type P = Param<Config>;

const DECL: KindDecl<Config, Meters> = KindDecl {
    inputs: BOTH_WAYS_IN,
    outputs: BOTH_WAYS_OUT,
    params: &[
        P::text(
            "mode",
            "compress: compresses data going down, restores data coming up (the app's end); decompress: the opposite",
            "compress",
            |c| if c.decompress { "decompress".into() } else { "compress".into() },
            |c, t| {
                c.decompress = match t {
                    "compress" => false,
                    "decompress" => true,
                    _ => return Err(format!("expected compress or decompress, got {t:?}")),
                };
                Ok(())
            },
        )
        .setting(),
        P::u64("level", "", "zstd's compression level (higher: smaller and slower)", 3, field!(level)).range(1.0, 19.0),
        P::bool(
            "offload",
            "true: blocks are compressed on the process's compression threads, in parallel with the data plane; \
             false: on the data-plane worker",
            true,
            field!(offload),
        )
        .setting(),
        P::bool(
            "notify",
            "true: a compression thread has the module polled as soon as it made a block (it wakes the worker); \
             false: the module polls on a timer while blocks are out (the way before; for comparisons)",
            true,
            field!(notify),
        )
        .setting(),
        active::param(field!(active)),
        P::manual(SELECT, "array of strings", SELECT_DOC, "[\"use *\"]"),
    ],
    meters: &[
        MeterDecl::u64("bytes_in_total", "bytes", "data bytes received, both directions", |m| &mut m.bytes_in),
        MeterDecl::u64("bytes_out_total", "bytes", "data bytes sent on, both directions", |m| &mut m.bytes_out),
        MeterDecl::u64("plain_bytes_total", "bytes", "bytes compressed (before)", |m| &mut m.plain),
        MeterDecl::u64("packed_bytes_total", "bytes", "what they became, headers included", |m| &mut m.packed),
        MeterDecl::new("ratio", ValueType::F64, "", "packed / plain bytes so far (below 1: smaller)", |m| &mut m.ratio),
        MeterDecl::u64("blocks_total", "blocks", "blocks made", |m| &mut m.blocks),
        MeterDecl::u64(
            "stored_blocks_total",
            "blocks",
            "blocks stored as they were (zstd would not shrink them)",
            |m| &mut m.stored,
        ),
        MeterDecl::u64("errors_total", "flows", "flows aborted: a block that could not be read", |m| &mut m.errors),
        MeterDecl::u64(
            "switches_total",
            "marks",
            "marks sent: a direction taken out of or put back into the path",
            |m| &mut m.switches,
        ),
        MeterDecl::u64("raw_bytes_total", "bytes", "data bytes passed as they were (out of the path)", |m| &mut m.raw),
    ],
    more_meters: SelectionMeters::specs,
    breaks_cycles: true,
    ..KindDecl::new(KIND, "a stream service: zstd, framed in length-prefixed blocks; decompress mode restores them")
};

/// The meters.
#[derive(Default)]
struct Meters {
    bytes_in: Meter,
    bytes_out: Meter,
    plain: Meter,
    packed: Meter,
    ratio: Meter,
    blocks: Meter,
    stored: Meter,
    errors: Meter,
    switches: Meter,
    raw: Meter,
}

impl ModuleKind for CompressKind {
    kind_from_decl!(DECL);

    fn configure(&self, settings: &Settings) -> Result<Box<dyn ModuleBuilder>, ConfigError> {
        let mut r = settings.reader(KIND);
        let mut cfg = Config { level: 0, decompress: false, active: true, offload: true, notify: true };
        DECL.read(&mut r, &mut cfg)?;
        let select = read_select(&mut r)?;
        r.finish()?;
        Ok(Box::new(CompressBuilder { cfg, select }))
    }
}

struct CompressBuilder {
    cfg: Config,
    select: Vec<SelectRule>,
}

impl ModuleBuilder for CompressBuilder {
    fn interface(&self) -> ModuleInterface {
        DECL.interface(&self.cfg)
    }

    fn build(self: Box<Self>, vars: &ModuleVars) -> Box<dyn Module> {
        Box::new(self.make(vars))
    }
}

impl CompressBuilder {
    fn make(self, vars: &ModuleVars) -> Compress {
        DECL.publish(&self.cfg, vars);
        let zc = context(self.cfg.level as i32);
        let zd = zstd::bulk::Decompressor::new().expect("zstd context");
        Compress {
            cfg: self.cfg,
            m: DECL.meters(vars),
            flows: Flows::new(self.select, vars),
            zc,
            zd,
            gathering: None,
            gathered: Vec::with_capacity(MAX_BLOCK),
            offload: Offload::shared(),
        }
    }
}

/// One flow: per direction, the map of its acks, (restoring) the bytes of a block not yet whole, and whether its
/// bytes pass as they are (after an end mark; both directions start framed).
#[derive(Default)]
struct Flow {
    acks: [AckMap; 2],
    partial: [Vec<u8>; 2],
    raw: [bool; 2],
    /// A UDP flow: each datagram stays one block (never gathered with the next).
    udp: bool,
    /// (Compressing) what is to leave, in order, once the blocks at its head are made.
    queue: [VecDeque<Pending>; 2],
    /// (Compressing) blocks on the threads.
    working: [usize; 2],
}

/// What waits in a direction's queue.
enum Pending {
    /// A block: its number, its input bytes' length, and where it is.
    Block(u64, u64, Block),
    /// A frame to pass after the blocks before it, and the input bytes it stands for.
    Frame(Packet, u64),
    /// The direction's `Fin`.
    Fin(Packet),
}

/// Where a block is.
enum Block {
    /// Not handed to the threads yet (the limits): its input.
    Waiting(Vec<u8>),
    /// On a thread.
    Working,
    /// Made: the frame's bytes (header and payload), and whether it is stored.
    Made(Vec<u8>, bool),
}

/// A block for a compression thread.
struct Job {
    flow: u64,
    dir: Direction,
    seq: u64,
    level: i32,
    input: Vec<u8>,
    /// Where to write the block (a buffer to reuse: what it holds is overwritten).
    output: Vec<u8>,
    reply: Sender<Done>,
    /// Has the module polled once the block is sent back (`None`: it polls on a timer).
    notify: Option<Notifier>,
}

/// A block made by a compression thread.
struct Done {
    flow: u64,
    dir: Direction,
    seq: u64,
    block: Vec<u8>,
    stored: bool,
    /// The job's input buffer, emptied, for the module's next block.
    input: Vec<u8>,
    /// How long zstd took for it.
    took: Duration,
}

/// The compression threads of the process: where jobs go, and how many are queued or being made.
struct Pool {
    jobs: Arc<Jobs>,
    total: Arc<AtomicUsize>,
}

impl Pool {
    /// The process's pool, started at the first call.
    fn get() -> &'static Pool {
        static POOL: OnceLock<Pool> = OnceLock::new();
        POOL.get_or_init(|| {
            let jobs = Arc::new(Jobs::default());
            let total = Arc::new(AtomicUsize::new(0));
            let n = std::thread::available_parallelism().map_or(1, |n| n.get()).clamp(1, THREADS);
            for i in 0..n {
                let (jobs, total) = (jobs.clone(), total.clone());
                jobs.state().threads += 1;
                std::thread::Builder::new()
                    .name(format!("fs-compress-{i}"))
                    .spawn(move || serve(&jobs, &total))
                    .expect("a compression thread");
            }
            Pool { jobs, total }
        })
    }
}

/// The queue of blocks to make, which the compression threads share. A thread with nothing to do sleeps on it; a
/// block handed over wakes one only if one sleeps and none is woken yet (a `Mutex` around a channel's receiver woke
/// two threads per block: the receiver's holder, and, as it let go of the lock, the other one, which went back to
/// sleep in the receiver).
#[derive(Default)]
struct Jobs {
    state: Mutex<JobsState>,
    ready: Condvar,
}

#[derive(Default)]
struct JobsState {
    queue: VecDeque<Job>,
    /// Threads serving the queue (a thread that panics leaves).
    threads: usize,
    /// Threads sleeping on `ready`.
    idle: usize,
    /// Of those, how many were woken and have not run yet.
    woken: usize,
}

impl Jobs {
    fn state(&self) -> std::sync::MutexGuard<'_, JobsState> {
        // A poisoned lock: a thread panicked holding it, between whole changes of the state.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queues a job for the threads; gives it back if no thread is left.
    fn push(&self, job: Job) -> Result<(), Job> {
        let mut st = self.state();
        if st.threads == 0 {
            return Err(job);
        }
        st.queue.push_back(job);
        let wake = st.idle > st.woken;
        if wake {
            st.woken += 1;
        }
        // Woken after the lock is let go: a thread woken while it is held would sleep again at once, on the lock.
        drop(st);
        if wake {
            self.ready.notify_one();
        }
        Ok(())
    }

    /// The next job, waiting for one.
    fn pop(&self) -> Job {
        let mut st = self.state();
        loop {
            if let Some(job) = st.queue.pop_front() {
                return job;
            }
            st.idle += 1;
            st = self.ready.wait(st).unwrap_or_else(|e| e.into_inner());
            st.idle -= 1;
            st.woken = st.woken.saturating_sub(1);
        }
    }

    /// The jobs queued (for tests: a queue no thread serves).
    #[cfg(test)]
    fn take(&self) -> Vec<Job> {
        self.state().queue.drain(..).collect()
    }
}

/// A compression thread: makes the blocks it is given, one at a time (for ever: the pool is the process's).
fn serve(jobs: &Jobs, total: &AtomicUsize) {
    /// Counts the thread out if it panics.
    struct Leaving<'a>(&'a Jobs);
    impl Drop for Leaving<'_> {
        fn drop(&mut self) {
            self.0.state().threads -= 1;
        }
    }
    let _leaving = Leaving(jobs);
    // A block handed over wakes a thread, which would otherwise take the core from the data-plane worker that woke
    // it (the worker, the app and the threads share the cores): under SCHED_BATCH it waits for a free core or the
    // next tick, and the worker, woken by packets or by a block made, still takes the core from it.
    if let Err(e) = flexstack_sys::set_batch_policy() {
        tracing::warn!("compress: a compression thread stays under the normal policy (SCHED_BATCH: {e})");
    }
    let mut zc: Option<(i32, CCtx<'static>)> = None;
    loop {
        let (reply, notify, done) = run(&mut zc, jobs.pop());
        total.fetch_sub(1, Ordering::AcqRel);
        // The module may be gone (unloaded): its blocks go with it.
        if reply.send(done).is_ok() {
            if let Some(n) = notify {
                n.notify();
            }
        }
    }
}

/// A zstd compression context at `level` (`None`: zstd could not make one).
fn context(level: i32) -> Option<CCtx<'static>> {
    let mut c = CCtx::try_create()?;
    c.set_parameter(CParameter::CompressionLevel(level)).ok()?;
    Some(c)
}

/// Makes a job's block, into the job's output buffer, with a context kept for its level (one per thread: its
/// tables and buffers are reused from block to block).
fn run(zc: &mut Option<(i32, CCtx<'static>)>, job: Job) -> (Sender<Done>, Option<Notifier>, Done) {
    let Job { flow, dir, seq, level, mut input, mut output, reply, notify } = job;
    if zc.as_ref().is_none_or(|(l, _)| *l != level) {
        *zc = context(level).map(|c| (level, c));
    }
    let start = std::time::Instant::now();
    let stored = make_block(zc.as_mut().map(|(_, c)| c), &input, &mut output);
    let took = start.elapsed();
    input.clear();
    (reply, notify, Done { flow, dir, seq, block: output, stored, input, took })
}

/// Writes the block of `piece` (header and payload) into `b` (what it held is overwritten; it grows to zstd's
/// bound for the piece, and is not zeroed first); returns true if it is stored as it was (zstd would not make it
/// smaller, or failed, or there is no context: `zc` is `None`).
///
/// One `ZSTD_compressStream2` call with `ZSTD_e_end` and room for zstd's bound: zstd compresses the piece in place
/// straight into `b` behind the header (the one-shot path of `ZSTD_compress2`, the frame sized by the piece), with
/// no copy of the input and no output buffered in the context.
fn make_block(zc: Option<&mut CCtx<'_>>, piece: &[u8], b: &mut Vec<u8>) -> bool {
    let Some(zc) = zc else { return store_block(piece, b) };
    b.clear();
    b.extend_from_slice(&[0; 4]);
    b.reserve(zstd_safe::compress_bound(piece.len()));
    let mut output = OutBuffer::around_pos(b, 4);
    let mut input = InBuffer::around(piece);
    let res = zc.compress_stream2(&mut output, &mut input, zstd_safe::zstd_sys::ZSTD_EndDirective::ZSTD_e_end);
    let n = output.pos() - 4;
    match res {
        Ok(0) if n < piece.len() => {
            b.truncate(4 + n);
            b[..4].copy_from_slice(&(n as u32).to_be_bytes());
            false
        }
        Ok(0) => store_block(piece, b),
        _ => {
            // The frame did not end (no room: not with zstd's bound) or zstd failed: abandoned, so the context
            // starts the next block afresh.
            let _ = zc.reset(ResetDirective::SessionOnly);
            store_block(piece, b)
        }
    }
}

/// Writes `piece` as a stored block into `b`.
fn store_block(piece: &[u8], b: &mut Vec<u8>) -> bool {
    b.clear();
    b.extend_from_slice(&(piece.len() as u32 | STORED).to_be_bytes());
    b.extend_from_slice(piece);
    true
}

/// A module's way to the compression threads: where its jobs go, the pool's count and limit, and the channel its
/// blocks come back on (handed to its replacement with the flows).
struct Offload {
    jobs: Arc<Jobs>,
    total: Arc<AtomicUsize>,
    limit: usize,
    done_tx: Sender<Done>,
    done_rx: Receiver<Done>,
    /// The flows' directions with something queued (flow, direction).
    busy: Vec<(u64, Direction)>,
    /// The number of the next block handed to the threads.
    next_seq: u64,
    /// How long to wait between polls while blocks are out: half of what a block took lately (a moving average).
    poll_every: Duration,
    /// Blocks of this module's flows on the threads (handed over, not yet collected).
    working: usize,
    /// How the threads have the module polled when a block is made (from the switch; `None`: poll on a timer).
    notifier: Option<Notifier>,
    /// Emptied input buffers the threads gave back, for the next blocks (at most [`SPARE_BUFFERS`]).
    spare_in: Vec<Vec<u8>>,
    /// Buffers for the threads to write the next blocks into: the packet buffers the blocks made replaced (at most
    /// [`SPARE_BUFFERS`]).
    spare_out: Vec<Vec<u8>>,
}

impl Offload {
    /// To the process's pool.
    fn shared() -> Offload {
        let pool = Pool::get();
        Offload::to(pool.jobs.clone(), pool.total.clone(), TOTAL_IN_FLIGHT)
    }

    fn to(jobs: Arc<Jobs>, total: Arc<AtomicUsize>, limit: usize) -> Offload {
        let (done_tx, done_rx) = mpsc::channel();
        Offload {
            jobs,
            total,
            limit,
            done_tx,
            done_rx,
            busy: Vec::new(),
            next_seq: 0,
            poll_every: POLL_EVERY,
            working: 0,
            notifier: None,
            spare_in: Vec::new(),
            spare_out: Vec::new(),
        }
    }

    /// An empty buffer for a block's input: one given back, or a new one of a block's size.
    fn input_buffer(&mut self) -> Vec<u8> {
        self.spare_in.pop().unwrap_or_else(|| Vec::with_capacity(MAX_BLOCK))
    }

    /// Keeps an input buffer for a next block (emptied), unless enough are kept.
    fn keep_input(&mut self, mut b: Vec<u8>) {
        if self.spare_in.len() < SPARE_BUFFERS && b.capacity() >= MAX_BLOCK {
            b.clear();
            self.spare_in.push(b);
        }
    }

    /// Keeps a buffer for the threads to write a next block into, unless enough are kept.
    fn keep_output(&mut self, b: Vec<u8>) {
        if self.spare_out.len() < SPARE_BUFFERS {
            self.spare_out.push(b);
        }
    }
}

/// What a `compress` hands to its replacement.
struct Handed {
    flows: HandedFlows<Flow>,
    done: (Sender<Done>, Receiver<Done>),
    busy: Vec<(u64, Direction)>,
    next_seq: u64,
    working: usize,
}

/// A running `compress`.
pub struct Compress {
    cfg: Config,
    m: Meters,
    flows: Flows<Flow>,
    /// The context for the blocks made on the worker (`None`: zstd could not make one; they are stored).
    zc: Option<CCtx<'static>>,
    zd: zstd::bulk::Decompressor<'static>,
    /// The flow and direction whose chunks are being gathered into a block in this batch, and their bytes (less
    /// than a block; empty between batches): the buffer is the block's input, handed to the threads as it is.
    gathering: Option<(u64, Direction)>,
    gathered: Vec<u8>,
    offload: Offload,
}

/// The other direction.
fn back(d: Direction) -> Direction {
    match d {
        Direction::Down => Direction::Up,
        Direction::Up => Direction::Down,
    }
}

impl Compress {
    /// True if data travelling `d` is compressed here (else restored).
    fn compresses(&self, d: Direction) -> bool {
        (d == Direction::Down) != self.cfg.decompress
    }

    /// `input` bytes travelling `d` became `output` bytes: acks at once what the flow's map frees.
    fn produced(&mut self, flow: u64, d: Direction, input: u64, output: u64, out: &mut Output<'_>) {
        self.m.bytes_out.add(output);
        let st = self.flows.get_mut(flow).expect("a flow it works on");
        let free = st.acks[slot(d)].produced(input, output);
        ack(out, flow, back(d), free);
    }

    /// Compresses a chunk into blocks, each emitted (and mapped for the acks) once made, in order.
    fn pack(&mut self, flow: u64, d: Direction, bytes: &[u8], out: &mut Output<'_>) {
        for piece in bytes.chunks(MAX_BLOCK) {
            self.block(flow, d, Cow::Borrowed(piece), out);
        }
    }

    /// One block of input: made here at once (`offload` off, or a small block of a direction with nothing queued),
    /// or queued for the threads. Input in a buffer of its own (`Cow::Owned`, a gathered block) goes to the threads
    /// as it is; borrowed input is copied once, into a buffer for them.
    fn block(&mut self, flow: u64, d: Direction, piece: Cow<'_, [u8]>, out: &mut Output<'_>) {
        let st = self.flows.get_mut(flow).expect("a flow it works on");
        let s = slot(d);
        if !self.cfg.offload || (piece.len() < INLINE_BELOW && st.queue[s].is_empty()) {
            // Made in the pooled packet itself: the block is not copied.
            let (zc, mut stored) = (&mut self.zc, false);
            let frame = StreamFrame::data_with(out.pool(), flow, d, |b| stored = make_block(zc.as_mut(), &piece, b));
            self.made(flow, d, piece.len() as u64, frame, stored, out);
            if let Cow::Owned(b) = piece {
                self.offload.keep_input(b);
            }
            return;
        }
        // A block waiting for the threads (the flow has as many out as it may) takes more input while it has room
        // (not a UDP flow's: a datagram is a block): while the threads are behind, blocks stay big.
        if let Some(Pending::Block(_, plain, Block::Waiting(waiting))) = st.queue[s].back_mut() {
            if !st.udp && waiting.len() + piece.len() <= MAX_BLOCK {
                waiting.extend_from_slice(&piece);
                *plain += piece.len() as u64;
                if let Cow::Owned(b) = piece {
                    self.offload.keep_input(b);
                }
                return;
            }
        }
        // Numbered across the module's flows: a block of a flow aborted and opened again under the same id cannot
        // be taken for one of the new flow's.
        let seq = self.offload.next_seq;
        self.offload.next_seq += 1;
        if st.queue[s].is_empty() {
            self.offload.busy.push((flow, d));
        }
        let plain = piece.len() as u64;
        let input = match piece {
            Cow::Owned(b) => b,
            Cow::Borrowed(bytes) => {
                let mut b = self.offload.input_buffer();
                b.extend_from_slice(bytes);
                b
            }
        };
        st.queue[s].push_back(Pending::Block(seq, plain, Block::Waiting(input)));
        self.submit(flow, d);
    }

    /// A block made: counted and emitted.
    fn made(&mut self, flow: u64, d: Direction, input: u64, frame: Packet, stored: bool, out: &mut Output<'_>) {
        self.m.blocks.add(1);
        if stored {
            self.m.stored.add(1);
        }
        let made = frame.len() as u64;
        self.m.plain.add(input);
        self.m.packed.add(made);
        let plain = self.m.plain.get();
        if plain > 0 {
            self.m.ratio.set_f64(self.m.packed.get() as f64 / plain as f64);
        }
        out.emit(0, frame);
        self.produced(flow, d, input, made, out);
    }

    /// Hands the direction's waiting blocks to the threads, in order, as far as the limits allow.
    fn submit(&mut self, flow: u64, d: Direction) {
        let Some(st) = self.flows.get_mut(flow) else { return };
        let s = slot(d);
        let level = self.cfg.level as i32;
        for p in st.queue[s].iter_mut() {
            if st.working[s] >= FLOW_IN_FLIGHT {
                return;
            }
            let Pending::Block(seq, _, b @ Block::Waiting(_)) = p else { continue };
            if self.offload.total.fetch_add(1, Ordering::AcqRel) >= self.offload.limit {
                self.offload.total.fetch_sub(1, Ordering::AcqRel);
                return;
            }
            let Block::Waiting(input) = std::mem::replace(b, Block::Working) else { unreachable!() };
            let notify = self.offload.notifier.clone();
            let output = self.offload.spare_out.pop().unwrap_or_default();
            let reply = self.offload.done_tx.clone();
            let job = Job { flow, dir: d, seq: *seq, level, input, output, reply, notify };
            match self.offload.jobs.push(job) {
                Ok(()) => {
                    st.working[s] += 1;
                    self.offload.working += 1;
                }
                Err(job) => {
                    // No thread left (they panicked): the block is made here.
                    self.offload.total.fetch_sub(1, Ordering::AcqRel);
                    tracing::error!("compress: no compression thread left; compressing on the data plane");
                    let mut block = job.output;
                    let stored = make_block(self.zc.as_mut(), &job.input, &mut block);
                    *b = Block::Made(block, stored);
                }
            }
        }
    }

    /// Collects what the threads made ([`Self::collect`]) and says when to be polled again: never with nothing out
    /// or waiting; when a thread notifies that a block is made (the switch's [`Notifier`]); on a timer (half of what
    /// a block took lately) without a notifier, or while blocks wait with none of this module's on the threads
    /// (other modules' blocks hold the process's limit, and their notifications reach those modules, not this one).
    fn collect_and_schedule(&mut self, out: &mut Output<'_>) -> Option<Time> {
        let busy = self.collect(out);
        let notified = self.offload.notifier.is_some() && self.offload.working > 0;
        (busy && !notified).then(|| out.now() + self.offload.poll_every)
    }

    /// Takes the switch's notifier for the blocks handed to the threads from now on, if it has none yet.
    fn take_notifier(&mut self, out: &Output<'_>) {
        if self.offload.notifier.is_none() && self.cfg.notify {
            self.offload.notifier = out.notifier();
        }
    }

    /// Takes the blocks the threads made, emits what is ready at the head of each queue, hands the threads what
    /// waits; true if blocks are still out or waiting.
    fn collect(&mut self, out: &mut Output<'_>) -> bool {
        while let Ok(done) = self.offload.done_rx.try_recv() {
            self.offload.working = self.offload.working.saturating_sub(1);
            let s = slot(done.dir);
            // An average of the last blocks' times (weight 1/8), halved, within bounds.
            let every = (self.offload.poll_every * 7 + done.took / 2) / 8;
            self.offload.poll_every = every.clamp(POLL_MIN, POLL_MAX);
            self.offload.keep_input(done.input);
            // A flow aborted meanwhile: its blocks go with it.
            let Some(st) = self.flows.get_mut(done.flow) else { continue };
            st.working[s] = st.working[s].saturating_sub(1);
            let entry = st.queue[s].iter_mut().find(|p| matches!(p, Pending::Block(seq, ..) if *seq == done.seq));
            if let Some(Pending::Block(_, _, b)) = entry {
                *b = Block::Made(done.block, done.stored);
            }
        }
        let mut i = 0;
        while i < self.offload.busy.len() {
            let (flow, d) = self.offload.busy[i];
            self.release(flow, d, out);
            self.submit(flow, d);
            if self.flows.get_mut(flow).is_some_and(|st| !st.queue[slot(d)].is_empty()) {
                i += 1;
            } else {
                self.offload.busy.swap_remove(i);
            }
        }
        !self.offload.busy.is_empty()
    }

    /// Emits what is ready at the head of the direction's queue.
    fn release(&mut self, flow: u64, d: Direction, out: &mut Output<'_>) {
        let s = slot(d);
        loop {
            let Some(st) = self.flows.get_mut(flow) else { return };
            let ready = matches!(
                st.queue[s].front(),
                Some(Pending::Block(_, _, Block::Made(..)) | Pending::Frame(..) | Pending::Fin(_))
            );
            if !ready {
                return;
            }
            match st.queue[s].pop_front().expect("a head") {
                Pending::Block(_, plain, Block::Made(mut block, stored)) => {
                    // The block becomes the packet's buffer (not copied), and the packet's buffer the threads'
                    // next block's.
                    let frame = StreamFrame::data_with(out.pool(), flow, d, |b| std::mem::swap(b, &mut block));
                    self.offload.keep_output(block);
                    self.made(flow, d, plain, frame, stored, out);
                }
                Pending::Frame(p, input) => {
                    let n = p.len() as u64;
                    out.emit(0, p);
                    self.produced(flow, d, input, n, out);
                }
                Pending::Fin(p) => {
                    self.flows.fin(flow, d);
                    out.emit(0, p);
                }
                Pending::Block(..) => unreachable!("a block not made is not ready"),
            }
        }
    }

    /// True if something of the direction waits for blocks before it.
    fn queued(&mut self, flow: u64, d: Direction) -> bool {
        self.flows.get_mut(flow).is_some_and(|st| !st.queue[slot(d)].is_empty())
    }

    /// Emits a frame of the direction standing for `input` bytes, or queues it behind the blocks not made yet.
    fn emit_in_order(&mut self, flow: u64, d: Direction, p: Packet, input: u64, out: &mut Output<'_>) {
        if self.queued(flow, d) {
            let st = self.flows.get_mut(flow).expect("a flow it works on");
            st.queue[slot(d)].push_back(Pending::Frame(p, input));
        } else {
            let n = p.len() as u64;
            out.emit(0, p);
            self.produced(flow, d, input, n, out);
        }
    }

    /// Takes a chunk of framed bytes, emits the blocks it completes, restored; returns the bytes emitted, or an error
    /// if a block is bad.
    fn unpack(&mut self, flow: u64, d: Direction, bytes: &[u8], out: &mut Output<'_>) -> Result<u64, String> {
        let st = self.flows.get_mut(flow).expect("a flow it works on");
        let buf = &mut st.partial[slot(d)];
        buf.extend_from_slice(bytes);
        let mut at = 0;
        let mut total = 0;
        while buf.len() - at >= 4 {
            let header = u32::from_be_bytes(buf[at..at + 4].try_into().expect("4 bytes"));
            if header == SWITCH_OFF {
                // The blocks end: what follows passes as it is.
                at += 4;
                st.raw[slot(d)] = true;
                if at < buf.len() {
                    let rest = StreamFrame::data(out.pool(), flow, d, &buf[at..]);
                    total += rest.len() as u64;
                    self.m.raw.add(rest.len() as u64);
                    out.emit(0, rest);
                }
                at = buf.len();
                break;
            }
            let len = (header & !(STORED | SWITCH_OFF)) as usize;
            if header & SWITCH_OFF != 0 {
                return Err(format!("a bad mark {header:#010x}"));
            }
            if len > MAX_PAYLOAD {
                return Err(format!("a block of {len} bytes announced (at most {MAX_PAYLOAD})"));
            }
            if buf.len() - at - 4 < len {
                break;
            }
            let payload = &buf[at + 4..at + 4 + len];
            let frame = if header & STORED != 0 {
                StreamFrame::data(out.pool(), flow, d, payload)
            } else {
                let zd = &mut self.zd;
                let mut failed = None;
                let f = StreamFrame::data_with(out.pool(), flow, d, |b| {
                    b.clear();
                    b.reserve(MAX_BLOCK);
                    if let Err(e) = zd.decompress_to_buffer(payload, b) {
                        failed = Some(e.to_string());
                    }
                });
                if let Some(e) = failed {
                    return Err(format!("zstd: {e}"));
                }
                f
            };
            total += frame.len() as u64;
            out.emit(0, frame);
            at += 4 + len;
        }
        buf.drain(..at);
        Ok(total)
    }

    /// Adds a chunk to the block being gathered for `flow` going `d` (a TCP flow's data to compress); full blocks
    /// leave at once, the rest with [`Self::flush`]. The gathering buffer is the block's input: a full block is
    /// handed on as it is and a fresh buffer gathers the next, so each byte is copied once on its way to zstd. With
    /// `offload` off, a chunk of a block's size or more with nothing gathered is compressed where it is (no copy).
    fn gather(&mut self, flow: u64, d: Direction, bytes: &[u8], out: &mut Output<'_>) {
        if self.gathering != Some((flow, d)) {
            self.flush(out);
            self.gathering = Some((flow, d));
        }
        let mut bytes = bytes;
        if !self.cfg.offload && self.gathered.is_empty() {
            let whole = bytes.len() - bytes.len() % MAX_BLOCK;
            if whole > 0 {
                self.pack(flow, d, &bytes[..whole], out);
                bytes = &bytes[whole..];
            }
        }
        while !bytes.is_empty() {
            if self.gathered.capacity() < MAX_BLOCK {
                self.gathered.reserve_exact(MAX_BLOCK - self.gathered.len());
            }
            let take = bytes.len().min(MAX_BLOCK - self.gathered.len());
            self.gathered.extend_from_slice(&bytes[..take]);
            bytes = &bytes[take..];
            if self.gathered.len() == MAX_BLOCK {
                self.cut(flow, d, out);
            }
        }
    }

    /// The block being gathered leaves (the batch ended, or another frame comes between).
    fn flush(&mut self, out: &mut Output<'_>) {
        let Some((flow, d)) = self.gathering.take() else { return };
        if !self.gathered.is_empty() {
            self.cut(flow, d, out);
        }
    }

    /// The gathered bytes become a block, their buffer its input; a fresh buffer gathers the next.
    fn cut(&mut self, flow: u64, d: Direction, out: &mut Output<'_>) {
        let fresh = self.offload.input_buffer();
        let input = std::mem::replace(&mut self.gathered, fresh);
        self.block(flow, d, Cow::Owned(input), out);
    }

    /// Marks in the stream that this direction leaves the path (the end mark) or comes back (a `Data` frame with no
    /// bytes), as `raw` now says.
    fn switch(&mut self, flow: u64, d: Direction, out: &mut Output<'_>) {
        self.m.switches.add(1);
        if self.cfg.active {
            let p = StreamFrame::data(out.pool(), flow, d, &[]);
            self.emit_in_order(flow, d, p, 0, out);
        } else {
            let p = StreamFrame::data(out.pool(), flow, d, &SWITCH_OFF.to_be_bytes());
            self.emit_in_order(flow, d, p, 0, out);
        }
    }

    /// Passes a chunk as it is (this direction is out of the path).
    fn pass_raw(&mut self, flow: u64, d: Direction, p: Packet, out: &mut Output<'_>) {
        let n = p.len() as u64;
        self.m.raw.add(n);
        self.emit_in_order(flow, d, p, n, out);
    }

    fn abort(&mut self, flow: u64, why: &str, out: &mut Output<'_>) {
        tracing::warn!(flow, why, "compress: aborting the flow");
        self.m.errors.add(1);
        self.flows.close(flow, KIND, out);
    }
}

impl Module for Compress {
    fn process(&mut self, _port: usize, input: &mut Batch, out: &mut Output<'_>) {
        self.take_notifier(out);
        for frame in input.drain(..) {
            let Frame::Data(p) = frame else {
                self.flush(out);
                out.emit(0, frame);
                continue;
            };
            let d = p.direction();
            // Only more data of the flow and direction being gathered joins the block; anything else sends it first.
            let joins = self.gathering.is_some_and(|(flow, dir)| {
                dir == d && p.stream_flow() == Some(flow) && p.stream_kind() == Some(StreamKind::Data)
            });
            if !joins {
                self.flush(out);
            }
            match self.flows.see(&p, |info| Flow { udp: info.protocol == Protocol::Udp, ..Flow::default() }).0 {
                Seen::Data(flow) => {
                    let n = p.len() as u64;
                    self.m.bytes_in.add(n);
                    let compresses = self.compresses(d);
                    let st = self.flows.get_mut(flow).expect("a flow it works on");
                    let (raw, udp) = (st.raw[slot(d)], st.udp);
                    if compresses {
                        let active = self.cfg.active;
                        if raw == active {
                            // The knob changed since this direction's last chunk: mark the switch here.
                            self.flush(out);
                            let st = self.flows.get_mut(flow).expect("a flow it works on");
                            st.raw[slot(d)] = !active;
                            self.switch(flow, d, out);
                        }
                        if active && !udp {
                            self.gather(flow, d, p.data(), out);
                        } else if active {
                            self.pack(flow, d, p.data(), out);
                        } else {
                            self.pass_raw(flow, d, p, out);
                        }
                    } else if raw {
                        if n == 0 {
                            st.raw[slot(d)] = false; // the blocks start again
                        } else {
                            self.pass_raw(flow, d, p, out);
                        }
                    } else {
                        match self.unpack(flow, d, p.data(), out) {
                            Ok(made) => self.produced(flow, d, n, made, out),
                            Err(why) => self.abort(flow, &why, out),
                        }
                    }
                    // Otherwise `p` is consumed: its bytes left in the frames just made.
                }
                Seen::Ack(flow, n) => {
                    // `p` is consumed: translated.
                    let st = self.flows.get_mut(flow).expect("a flow it works on");
                    translate_ack(&mut st.acks, flow, d, n, out);
                }
                Seen::Fin(flow) => {
                    let partial = self.flows.get_mut(flow).is_some_and(|st| !st.partial[slot(d)].is_empty());
                    if self.queued(flow, d) {
                        // After the blocks not made yet.
                        let st = self.flows.get_mut(flow).expect("a flow it works on");
                        st.queue[slot(d)].push_back(Pending::Fin(p));
                    } else if partial {
                        self.abort(flow, "the stream ended inside a block", out);
                    // replaces the Fin
                    } else {
                        self.flows.fin(flow, d);
                        out.emit(0, p);
                    }
                }
                _ => out.emit(0, p),
            }
        }
        self.flush(out);
        if let Some(t) = self.collect_and_schedule(out) {
            out.wake_at(t);
        }
    }

    fn poll(&mut self, out: &mut Output<'_>) -> Option<Time> {
        self.take_notifier(out);
        self.collect_and_schedule(out)
    }

    fn write_knob(&mut self, knob: &str, value: &Value) -> Result<(), String> {
        DECL.write(&mut self.cfg, knob, value)?;
        if knob == "level" {
            if let Some(c) = &mut self.zc {
                c.set_parameter(CParameter::CompressionLevel(self.cfg.level as i32))
                    .map_err(|e| format!("zstd: {}", zstd_safe::get_error_name(e)))?;
            }
        }
        Ok(())
    }

    fn take_state(&mut self) -> Option<Box<dyn std::any::Any>> {
        // The blocks out come back on this module's channel: it goes with the flows (a fresh one stays here).
        let (tx, rx) = mpsc::channel();
        let done = (std::mem::replace(&mut self.offload.done_tx, tx), std::mem::replace(&mut self.offload.done_rx, rx));
        let busy = std::mem::take(&mut self.offload.busy);
        let working = std::mem::take(&mut self.offload.working);
        Some(Box::new(Handed { flows: self.flows.take(), done, busy, next_seq: self.offload.next_seq, working }))
    }

    fn adopt_state(&mut self, state: Box<dyn std::any::Any>) -> Result<(), String> {
        let h = handed_over::<Handed>(state, "a compress's flows")?;
        self.flows.adopt(h.flows);
        // Blocks of the handed flows may still be out, and answer on the old channel: this module takes it over.
        // Its own channel holds nothing yet (adopted before its first block).
        (self.offload.done_tx, self.offload.done_rx) = h.done;
        self.offload.busy.extend(h.busy);
        self.offload.next_seq = self.offload.next_seq.max(h.next_seq);
        // Their threads notify the switch's mark of this module's place, which the replacement keeps.
        self.offload.working += h.working;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flexstack_core::stream::FlowInfo;
    use flexstack_core::{MetaKey, PacketPool};

    /// A `compress` whose blocks go to a channel the test holds (its own limit of blocks out), run by hand.
    struct Harness {
        m: Compress,
        vars: ModuleVars,
        jobs: Arc<Jobs>,
        pool: PacketPool,
    }

    impl Harness {
        fn new(limit: usize) -> Harness {
            let cfg = Config { level: 3, decompress: false, active: true, offload: true, notify: true };
            let vars = ModuleVars::new(&DECL.interface(&cfg).vars);
            let mut m = CompressBuilder { cfg, select: vec![SelectRule::ALL] }.make(&vars);
            let jobs = Arc::new(Jobs::default());
            jobs.state().threads = 1; // the test, by hand
            m.offload = Offload::to(jobs.clone(), Arc::new(AtomicUsize::new(0)), limit);
            Harness { m, vars, jobs, pool: PacketPool::default() }
        }

        /// Processes `frames` at `ms`; returns what it emitted and when it asks to be polled.
        fn process(&mut self, ms: u64, frames: Vec<Packet>) -> (Vec<Packet>, Option<Time>) {
            let mut ports = vec![Vec::new()];
            let (mut control, mut serial) = (Vec::new(), 0);
            let mut out =
                Output::detached(Time::from_millis(ms), "z", &self.pool, &mut ports, &mut control, &mut serial);
            let mut input: Batch = frames.into_iter().map(Frame::Data).collect();
            self.m.process(0, &mut input, &mut out);
            let wake = out.requested_wakeup();
            (packets(ports), wake)
        }

        fn poll(&mut self, ms: u64) -> (Vec<Packet>, Option<Time>) {
            let mut ports = vec![Vec::new()];
            let (mut control, mut serial) = (Vec::new(), 0);
            let mut out =
                Output::detached(Time::from_millis(ms), "z", &self.pool, &mut ports, &mut control, &mut serial);
            let next = self.m.poll(&mut out);
            (packets(ports), next)
        }

        /// The jobs handed to the threads so far.
        fn jobs(&self) -> Vec<Job> {
            self.jobs.take()
        }

        fn meter(&self, name: &str) -> u64 {
            match self.vars.cell(name).unwrap().get() {
                Value::U64(v) => v,
                other => panic!("{name}: {other:?}"),
            }
        }
    }

    fn packets(mut ports: Vec<Batch>) -> Vec<Packet> {
        ports.remove(0).into_iter().map(|f| if let Frame::Data(p) = f { p } else { panic!("a data frame") }).collect()
    }

    /// A harness with flow 1 opened and `blocks` blocks of text (from `seed`) sent down in one chunk, at 1 ms;
    /// returns it, the text, what it emitted and when it asked to be polled.
    fn sending(seed: usize, blocks: usize) -> (Harness, Vec<u8>, Vec<Packet>, Option<Time>) {
        let mut h = Harness::new(TOTAL_IN_FLIGHT);
        let pool = h.pool.clone();
        let input = text(seed, blocks * MAX_BLOCK);
        let (seen, wake) = h.process(1, vec![open(&pool, 1), StreamFrame::data(&pool, 1, Direction::Down, &input)]);
        (h, input, seen, wake)
    }

    /// What a compression thread does with a job.
    fn finish(job: Job) {
        let (reply, _, done) = run(&mut None, job);
        reply.send(done).unwrap();
    }

    fn text(seed: usize, len: usize) -> Vec<u8> {
        let mut v = Vec::new();
        let mut i = 0;
        while v.len() < len {
            v.extend_from_slice(format!("{seed} line {i}: the quick brown fox jumps over the lazy dog\n").as_bytes());
            i += 1;
        }
        v.truncate(len);
        v
    }

    fn open(pool: &PacketPool, flow: u64) -> Packet {
        let info = FlowInfo::tcp(
            "10.0.0.2:40000".parse().unwrap(),
            "192.0.2.1:80".parse().unwrap(),
            "app",
            flexstack_core::stream::Role::Client,
        );
        StreamFrame::open(pool, flow, Direction::Down, &info)
    }

    fn kind(p: &Packet) -> Option<StreamKind> {
        p.stream_kind()
    }

    fn acked(p: &Packet) -> Option<u64> {
        (kind(p) == Some(StreamKind::Ack)).then(|| p.meta().get(MetaKey::STREAM).unwrap() >> 8)
    }

    /// Restores blocks.
    fn unframe(blocks: &[Packet]) -> Vec<u8> {
        let mut plain = Vec::new();
        for p in blocks {
            let b = p.data();
            let header = u32::from_be_bytes(b[..4].try_into().unwrap());
            assert_eq!((header & !STORED) as usize, b.len() - 4, "one block a frame");
            if header & STORED != 0 {
                plain.extend_from_slice(&b[4..]);
            } else {
                plain.extend(zstd::decode_all(&b[4..]).unwrap());
            }
        }
        plain
    }

    #[test]
    fn blocks_made_out_of_order_leave_in_order_with_the_fin_after_them() {
        let mut h = Harness::new(TOTAL_IN_FLIGHT);
        let pool = h.pool.clone();
        let input: Vec<Vec<u8>> = (0..3).map(|i| text(i, MAX_BLOCK)).collect();
        let mut frames = vec![open(&pool, 1)];
        frames.extend(input.iter().map(|b| StreamFrame::data(&pool, 1, Direction::Down, b)));
        frames.push(StreamFrame::fin(&pool, 1, Direction::Down));
        let (seen, wake) = h.process(1, frames);
        assert_eq!(seen.len(), 1, "the Open only: the blocks are out, the Fin waits behind them");
        assert_eq!(wake, Some(Time::from_millis(1) + POLL_EVERY), "polled again soon");
        let mut jobs = h.jobs();
        assert_eq!(jobs.iter().map(|j| j.seq).collect::<Vec<_>>(), [0, 1, 2]);
        // The last block is made first: nothing may leave before the first.
        finish(jobs.pop().unwrap());
        let (seen, next) = h.poll(2);
        assert!(seen.is_empty(), "block 2 waits for blocks 0 and 1");
        assert!(next.is_some());
        finish(jobs.remove(0));
        let (seen, next) = h.poll(3);
        assert_eq!(seen.len(), 1, "block 0");
        assert!(unframe(&seen) == input[0]);
        assert!(next.is_some(), "block 1 is still out");
        finish(jobs.remove(0));
        let (seen, next) = h.poll(4);
        assert_eq!(next, None, "nothing out any more");
        assert_eq!(
            seen.iter().map(kind).collect::<Vec<_>>(),
            [Some(StreamKind::Data); 2].into_iter().chain([Some(StreamKind::Fin)]).collect::<Vec<_>>()
        );
        assert!(unframe(&seen[..2]) == [input[1].clone(), input[2].clone()].concat());
        assert_eq!(h.meter("blocks_total"), 3);
        assert_eq!(h.meter("plain_bytes_total"), 3 * MAX_BLOCK as u64);
    }

    #[test]
    fn blocks_out_are_bounded_per_flow_and_in_total_and_their_input_stays_unacked() {
        let mut h = Harness::new(6);
        let pool = h.pool.clone();
        // Two flows of 10 blocks each, in one batch.
        let mut frames = vec![open(&pool, 1), open(&pool, 2)];
        let data = text(7, 10 * MAX_BLOCK);
        for flow in [1, 2] {
            frames.push(StreamFrame::data(&pool, flow, Direction::Down, &data));
        }
        let (seen, _) = h.process(1, frames);
        assert_eq!(seen.len(), 2, "the Opens");
        let jobs = h.jobs();
        let of = |f: u64| jobs.iter().filter(|j| j.flow == f).count();
        assert_eq!((of(1), of(2)), (FLOW_IN_FLIGHT, 6 - FLOW_IN_FLIGHT), "4 of flow 1, then the total's 6");
        assert_eq!(h.m.offload.total.load(Ordering::Acquire), 6);
        // One block made: it leaves, and one more goes out (flow 2's: flow 1 is at its limit again).
        let mut jobs = jobs.into_iter();
        finish(jobs.next().unwrap());
        h.m.offload.total.fetch_sub(1, Ordering::AcqRel); // as the pool's thread does
        let (seen, _) = h.poll(2);
        assert_eq!(seen.len(), 1, "flow 1's first block");
        let more = h.jobs();
        assert_eq!(more.len(), 1);
        assert_eq!(h.m.offload.total.load(Ordering::Acquire), 6, "at the limit again");
        // Nothing of the input was acked upstream: the flows' credit holds their producers.
        assert!(seen.iter().all(|p| acked(p).is_none()));
        let st = h.m.flows.get_mut(1).unwrap();
        assert_eq!(st.acks[0].unacked_input(), MAX_BLOCK as u64, "the block sent, not acked downstream yet");
        assert_eq!(st.queue[0].len(), 9, "the rest waits in the flow, as input bytes");
        // Its output acked: its input is acked upstream.
        let out = seen[0].len() as u64;
        let (seen, _) = h.process(3, vec![StreamFrame::ack(&pool, 1, Direction::Up, out)]);
        assert_eq!(seen.iter().filter_map(acked).collect::<Vec<_>>(), [MAX_BLOCK as u64]);
    }

    #[test]
    fn a_replacement_takes_over_the_blocks_out_and_emits_them_in_order() {
        let (mut old, input, seen, _) = sending(3, 3);
        let pool = old.pool.clone();
        assert_eq!(seen.len(), 1);
        let mut jobs = old.jobs();
        assert_eq!(jobs.len(), 3);
        finish(jobs.remove(1)); // made before the replacement, not emitted yet
        let state = old.m.take_state().unwrap();
        let mut new = Harness::new(TOTAL_IN_FLIGHT);
        new.m.adopt_state(state).unwrap();
        // The others are made after it: they answer on the channel the new module took over.
        for j in jobs {
            finish(j);
        }
        assert!(old.poll(2).0.is_empty(), "the old module has nothing left");
        let (seen, next) = new.poll(2);
        assert_eq!(next, None);
        assert_eq!(seen.len(), 3, "all three blocks, from the new module");
        assert!(unframe(&seen) == input, "in order, nothing lost");
        // Their acks are mapped by the new module: all output acked frees all input.
        let out: u64 = seen.iter().map(|p| p.len() as u64).sum();
        let (seen, _) = new.process(3, vec![StreamFrame::ack(&pool, 1, Direction::Up, out)]);
        assert_eq!(seen.iter().filter_map(acked).sum::<u64>(), input.len() as u64);
    }

    #[test]
    fn a_bad_block_coming_up_aborts_the_flow_and_its_blocks_out_are_dropped_even_if_its_id_comes_back() {
        let (mut h, _, _, wake) = sending(5, 2);
        let pool = h.pool.clone();
        assert!(wake.is_some());
        // Up data is restored here: a block announcing 2 GB is an error; the flow is aborted both ways at once.
        let (seen, _) = h.process(2, vec![StreamFrame::data(&pool, 1, Direction::Up, &[0x7f, 0xff, 0xff, 0xff, 1])]);
        assert_eq!(seen.iter().map(kind).collect::<Vec<_>>(), [Some(StreamKind::Abort); 2]);
        assert_eq!(h.meter("errors_total"), 1);
        // The flow's id opens again, with a block of its own out, before the old blocks come back.
        let stale = h.jobs();
        let fresh = text(6, MAX_BLOCK);
        h.process(3, vec![open(&pool, 1), StreamFrame::data(&pool, 1, Direction::Down, &fresh)]);
        let new = h.jobs();
        assert_eq!(new.len(), 1);
        // The old blocks come back: dropped with the flow they were of, not taken for the new flow's.
        for j in stale {
            finish(j);
        }
        let (seen, next) = h.poll(4);
        assert!(seen.is_empty(), "nothing of the aborted flow");
        assert!(next.is_some(), "the new flow's block is out");
        for j in new {
            finish(j);
        }
        let (seen, next) = h.poll(5);
        assert!(unframe(&seen) == fresh);
        assert_eq!(next, None);
        assert!(h.m.offload.busy.is_empty());
    }

    #[test]
    fn a_small_message_is_compressed_at_once_and_one_behind_blocks_out_waits_for_them() {
        let mut h = Harness::new(TOTAL_IN_FLIGHT);
        let pool = h.pool.clone();
        let request = b"GET /status HTTP/1.1\r\nHost: x\r\n\r\n";
        let (seen, wake) = h.process(1, vec![open(&pool, 1), StreamFrame::data(&pool, 1, Direction::Down, request)]);
        assert_eq!(seen.len(), 2, "the Open and the request's block, in the same call");
        assert_eq!(wake, None, "nothing out");
        assert!(h.jobs().is_empty());
        assert!(unframe(&seen[1..]) == request);
        // A big block goes out; a small one after it waits behind it (in order), then both leave.
        let big = text(1, MAX_BLOCK);
        let (seen, _) = h.process(2, vec![StreamFrame::data(&pool, 1, Direction::Down, &big)]);
        assert!(seen.is_empty());
        let (seen, _) = h.process(3, vec![StreamFrame::data(&pool, 1, Direction::Down, request)]);
        assert!(seen.is_empty(), "behind the big block");
        let jobs = h.jobs();
        assert_eq!(jobs.len(), 2, "queued behind a block out, the small one goes to the threads too");
        for j in jobs.into_iter().rev() {
            finish(j);
        }
        let (seen, _) = h.poll(4);
        assert!(unframe(&seen) == [&big[..], request].concat());
    }

    #[test]
    fn input_behind_a_full_pipeline_joins_the_block_waiting_for_the_threads() {
        let (mut h, first, _, _) = sending(2, FLOW_IN_FLIGHT);
        let pool = h.pool.clone();
        let mut jobs = h.jobs();
        assert_eq!(jobs.len(), FLOW_IN_FLIGHT);
        // Small batches while the flow has as many blocks out as it may: one waiting block gathers them.
        let more = text(3, 12 * 10_000);
        for (i, c) in more.chunks(10_000).enumerate() {
            let (seen, _) = h.process(2 + i as u64, vec![StreamFrame::data(&pool, 1, Direction::Down, c)]);
            assert!(seen.is_empty());
        }
        assert!(h.jobs().is_empty(), "none handed over: the flow is at its limit");
        assert_eq!(h.m.flows.get_mut(1).unwrap().queue[0].len(), FLOW_IN_FLIGHT + 2, "6 + 6 chunks: two blocks");
        jobs.drain(..).for_each(finish);
        let (seen, _) = h.poll(20);
        assert_eq!(seen.len(), FLOW_IN_FLIGHT);
        jobs = h.jobs();
        assert_eq!(jobs.iter().map(|j| j.input.len()).collect::<Vec<_>>(), [60_000, 60_000]);
        jobs.drain(..).for_each(finish);
        let (rest, next) = h.poll(21);
        assert_eq!(next, None);
        assert!(unframe(&[seen, rest].concat()) == [first, more].concat());
    }

    #[test]
    fn in_a_switch_with_a_waker_the_threads_wake_it_for_each_block_and_no_timer_polls() {
        let cfg = Config { level: 3, decompress: false, active: true, offload: true, notify: true };
        let builder = CompressBuilder { cfg, select: vec![SelectRule::ALL] };
        let mut sw = flexstack_core::Switch::default();
        let (woke, wakes) = mpsc::channel();
        let woke = Mutex::new(woke);
        sw.set_waker(move || {
            let _ = woke.lock().unwrap().send(());
        });
        sw.apply(vec![flexstack_core::Edit::load_built("z", KIND, Box::new(builder))]).unwrap();
        fn sw_meter(sw: &flexstack_core::Switch, name: &str) -> u64 {
            sw.registry().snapshot().get(&format!("module.z.{name}")).map_or(0, |v| v.load_u64())
        }
        let pool = sw.pool().clone();
        let input = text(4, 5 * MAX_BLOCK);
        let mut frames: Batch =
            vec![open(&pool, 1).into(), StreamFrame::data(&pool, 1, Direction::Down, &input).into()];
        sw.inject("z", BOTH_WAYS_IN[0].name, &mut frames).unwrap();
        sw.run(Time::from_millis(1));
        let mut made = sw_meter(&sw, "blocks_total");
        assert!(made < 5, "the blocks are on the threads");
        let mut ms = 2;
        while made < 5 {
            assert_eq!(sw.next_wakeup(), None, "no timer while blocks are out: the threads wake the switch");
            wakes.recv_timeout(Duration::from_secs(10)).expect("a thread woke the switch");
            sw.run(Time::from_millis(ms));
            ms += 1;
            made = sw_meter(&sw, "blocks_total");
        }
        assert_eq!(sw_meter(&sw, "plain_bytes_total"), input.len() as u64);
        assert_eq!(sw.next_wakeup(), None);
    }

    #[test]
    fn a_block_gathered_from_many_chunks_of_a_batch_restores_exactly() {
        let mut h = Harness::new(TOTAL_IN_FLIGHT);
        let pool = h.pool.clone();
        // Chunks of uneven sizes (1 byte to 16 KiB), 3.5 blocks' worth, in one batch.
        let input = text(11, 3 * MAX_BLOCK + MAX_BLOCK / 2);
        let mut frames = vec![open(&pool, 1)];
        let (mut at, mut n) = (0, 0);
        while at < input.len() {
            let len = [1, 16384, 777, 4096, 12345, 3][n % 6].min(input.len() - at);
            frames.push(StreamFrame::data(&pool, 1, Direction::Down, &input[at..at + len]));
            (at, n) = (at + len, n + 1);
        }
        let (seen, _) = h.process(1, frames);
        assert_eq!(seen.len(), 1, "the Open: the blocks are on the threads");
        let jobs = h.jobs();
        let sizes: Vec<usize> = jobs.iter().map(|j| j.input.len()).collect();
        assert_eq!(sizes, [MAX_BLOCK, MAX_BLOCK, MAX_BLOCK, MAX_BLOCK / 2], "full blocks, then the rest");
        jobs.into_iter().for_each(finish);
        let (seen, next) = h.poll(2);
        assert_eq!(next, None);
        assert!(unframe(&seen) == input, "restored exactly, in order");
    }

    #[test]
    fn the_buffers_of_blocks_are_reused_and_the_spares_bounded() {
        let (mut h, first, _, _) = sending(12, 3);
        let pool = h.pool.clone();
        let jobs = h.jobs();
        // The buffer gathering now, and those the threads have.
        let mut inputs: Vec<*const u8> = jobs.iter().map(|j| j.input.as_ptr()).collect();
        inputs.push(h.m.gathered.as_ptr());
        jobs.into_iter().for_each(finish);
        let (seen, _) = h.poll(2);
        assert!(unframe(&seen) == first);
        // The threads gave the input buffers back; the packets' buffers the blocks replaced are kept for the next.
        assert!(h.m.offload.spare_in.len() >= 2 && h.m.offload.spare_out.len() == 3);
        let outputs: Vec<*const u8> = h.m.offload.spare_out.iter().map(|b| b.as_ptr()).collect();
        // The next blocks are gathered into those input buffers and written into those output buffers.
        let more = text(13, 2 * MAX_BLOCK);
        h.process(3, vec![StreamFrame::data(&pool, 1, Direction::Down, &more)]);
        let jobs = h.jobs();
        assert_eq!(jobs.len(), 2);
        assert!(jobs.iter().all(|j| inputs.contains(&j.input.as_ptr())), "input buffers reused");
        assert!(jobs.iter().all(|j| outputs.contains(&j.output.as_ptr())), "output buffers reused");
        jobs.into_iter().for_each(finish);
        let (seen, _) = h.poll(4);
        assert!(unframe(&seen) == more);
        // Many blocks at once: no more spares kept than the bound.
        let lots = text(14, 3 * SPARE_BUFFERS * MAX_BLOCK);
        h.process(5, vec![StreamFrame::data(&pool, 1, Direction::Down, &lots)]);
        let mut got = Vec::new();
        for ms in 6..200 {
            h.jobs().into_iter().for_each(finish);
            let (seen, next) = h.poll(ms);
            got.extend(seen);
            if next.is_none() {
                break;
            }
        }
        assert!(unframe(&got) == lots);
        assert!(h.m.offload.spare_in.len() <= SPARE_BUFFERS && h.m.offload.spare_out.len() <= SPARE_BUFFERS);
    }

    #[test]
    fn a_block_written_over_a_used_buffer_holds_the_block_only() {
        let mut zc = context(3).unwrap();
        let piece = text(15, 40_000);
        // A buffer with stale bytes, longer than the block, and one too small for it.
        for mut b in [vec![0xa5; 3 * MAX_BLOCK], vec![7; 10]] {
            assert!(!make_block(Some(&mut zc), &piece, &mut b));
            let header = u32::from_be_bytes(b[..4].try_into().unwrap());
            assert_eq!(header as usize, b.len() - 4);
            assert!(zstd::decode_all(&b[4..]).unwrap() == piece);
        }
        // What zstd cannot shrink is stored, over the same buffer.
        let mut noise = vec![0u8; 5000];
        let mut x = 0x1234_5678u32;
        for v in noise.iter_mut() {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            *v = x as u8;
        }
        let mut b = vec![0xa5; 3 * MAX_BLOCK];
        assert!(make_block(Some(&mut zc), &noise, &mut b));
        assert_eq!(u32::from_be_bytes(b[..4].try_into().unwrap()), noise.len() as u32 | STORED);
        assert!(b[4..] == noise[..]);
        // And the context goes on making blocks after it.
        assert!(!make_block(Some(&mut zc), &piece, &mut b));
        assert!(zstd::decode_all(&b[4..]).unwrap() == piece);
    }

    #[test]
    fn threads_sharing_the_queue_make_every_block_once_and_without_threads_the_worker_makes_them() {
        let jobs = Arc::new(Jobs::default());
        let total = Arc::new(AtomicUsize::new(0));
        for _ in 0..3 {
            let (jobs, total) = (jobs.clone(), total.clone());
            jobs.state().threads += 1;
            // They sleep on the queue when the test is done (test threads are not joined).
            std::thread::spawn(move || serve(&jobs, &total));
        }
        let (reply, done) = mpsc::channel();
        let input = text(16, 40 * 10_000);
        for (seq, piece) in input.chunks(10_000).enumerate() {
            total.fetch_add(1, Ordering::AcqRel);
            let job = Job {
                flow: 1,
                dir: Direction::Down,
                seq: seq as u64,
                level: 3,
                input: piece.to_vec(),
                output: Vec::new(),
                reply: reply.clone(),
                notify: None,
            };
            assert!(jobs.push(job).is_ok());
            if seq % 7 == 0 {
                std::thread::sleep(Duration::from_millis(1)); // let the threads fall asleep now and then
            }
        }
        let mut made: Vec<Done> = (0..40).map(|_| done.recv_timeout(Duration::from_secs(10)).unwrap()).collect();
        assert!(done.try_recv().is_err(), "each block once");
        made.sort_by_key(|d| d.seq);
        assert_eq!(made.iter().map(|d| d.seq).collect::<Vec<_>>(), (0..40).collect::<Vec<_>>());
        let mut plain = Vec::new();
        for d in &made {
            assert!(!d.stored && d.input.is_empty() && d.input.capacity() >= 10_000, "the input comes back emptied");
            plain.extend(zstd::decode_all(&d.block[4..]).unwrap());
        }
        assert!(plain == input);
        assert_eq!(total.load(Ordering::Acquire), 0);
        // No thread left: a block handed over is made on the worker.
        let mut h = Harness::new(TOTAL_IN_FLIGHT);
        h.jobs.state().threads = 0;
        let pool = h.pool.clone();
        let big = text(17, 2 * MAX_BLOCK);
        let (seen, next) = h.process(1, vec![open(&pool, 1), StreamFrame::data(&pool, 1, Direction::Down, &big)]);
        assert!(h.jobs().is_empty());
        assert_eq!(next, None);
        assert!(unframe(&seen[1..]) == big);
    }

    #[test]
    fn the_shared_pool_makes_the_blocks() {
        let cfg = Config { level: 3, decompress: false, active: true, offload: true, notify: true };
        let vars = ModuleVars::new(&DECL.interface(&cfg).vars);
        let mut m = CompressBuilder { cfg, select: vec![SelectRule::ALL] }.make(&vars);
        let pool = PacketPool::default();
        let input = text(9, 5 * MAX_BLOCK + 100);
        let mut got = Vec::new();
        let mut frames: Batch =
            vec![open(&pool, 1).into(), StreamFrame::data(&pool, 1, Direction::Down, &input).into()];
        for ms in 1..10_000 {
            let mut ports = vec![Vec::new()];
            let (mut control, mut serial) = (Vec::new(), 0);
            let mut out = Output::detached(Time::from_millis(ms), "z", &pool, &mut ports, &mut control, &mut serial);
            if frames.is_empty() {
                m.poll(&mut out);
            } else {
                m.process(0, &mut frames, &mut out);
            }
            got.extend(packets(ports).into_iter().filter(|p| kind(p) == Some(StreamKind::Data)));
            if got.len() == 6 {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(unframe(&got) == input);
    }
}
