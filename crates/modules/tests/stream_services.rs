//! The stream services (docs/services.md) with simulated time: alone in a switch with recorded output, and between
//! real endpoints (`streamkit`: an app-side smoltcp host, `terminate`, the services, `originate`, a server host).

mod streamkit;
use streamkit::*;

use flexstack_core::stream::{FlowInfo, Role, StreamEvent, StreamFrame};
use flexstack_core::testing::{take, Log, Recorder, Seen};
use flexstack_core::{Batch, Direction, Edit, MetaKey, Switch, Time, Value};
use flexstack_modules::stream::services::chain_links;
use flexstack_modules::stream::services::file::ServiceFile;
use std::time::Duration;

/// A switch with one module `m` of `kind` (settings `a`) whose output is recorded.
fn alone(kind: &str, a: &[&str]) -> (Switch, Log) {
    let mut sw = Switch::default();
    let (rec, log) = Recorder::load("r");
    sw.apply(vec![load("m", kind, &args(a)), rec, link("m -> r")]).unwrap();
    (sw, log)
}

fn tcp(port: u16) -> FlowInfo {
    FlowInfo::tcp("10.0.0.2:40000".parse().unwrap(), format!("192.0.2.1:{port}").parse().unwrap(), "app", Role::Client)
}

fn meter(sw: &Switch, name: &str) -> u64 {
    match sw.registry().snapshot().get(name).unwrap_or_else(|| panic!("no {name}")).get() {
        Value::U64(v) => v,
        other => panic!("{name}: {other:?}"),
    }
}

fn kind_of(s: &Seen) -> u64 {
    s.meta.get(MetaKey::STREAM).unwrap() & 0xff
}

/// A lab whose stream chain is `services` (name, kind, settings), chained as `flexstack run --services` chains
/// them: Down in order, Up in reverse, a `direction` module after each (the last one is the lab's `sdir`).
fn chained(services: &[(&str, &str, Vec<String>)]) -> Lab {
    let mut lab = Lab::new(false, &[], &[], &[]);
    let names: Vec<String> = services.iter().map(|s| s.0.to_string()).collect();
    let n = names.len();
    let dirs: Vec<String> =
        (0..n).map(|i| if i + 1 == n { "sdir".into() } else { format!("{}-dir", names[i]) }).collect();
    let mut edits: Vec<Edit> =
        ["t[stream] -> sdir", "o[stream] -> sdir", "sdir[down] -> o[stream_in]", "sdir[up] -> t[stream_in]"]
            .iter()
            .map(|l| Edit::Unlink(flexstack_core::LinkSpec::parse(l).unwrap()))
            .collect();
    for (i, (name, kind, a)) in services.iter().enumerate() {
        edits.push(load(name, kind, a));
        if i + 1 < n {
            edits.push(load(&dirs[i], "direction", &[]));
        }
    }
    edits.extend(chain_links("t", "o", &names, &dirs).iter().map(|l| link(l)));
    lab.sw.apply(edits).unwrap();
    if services.iter().any(|s| s.1 == "compress") {
        // Its blocks are made on threads, in real time.
        lab.pace = Duration::from_micros(100);
    }
    lab
}

/// Runs the switch from `ms` on, a millisecond at a time (and as much in real time), until no module waits for a
/// poll (a `compress`'s blocks out on its threads are back and sent); returns the time it stopped at.
fn settle(sw: &mut Switch, ms: u64) -> u64 {
    let mut t = ms;
    for _ in 0..10_000 {
        if sw.next_wakeup().is_none() {
            return t;
        }
        std::thread::sleep(Duration::from_millis(1));
        t += 1;
        sw.run(Time::from_millis(t));
    }
    panic!("the switch still waits for a poll at {t} ms");
}

/// Compressible bytes: lines of text with a counter.
fn text_bytes(len: usize) -> Vec<u8> {
    let mut v = Vec::with_capacity(len + 64);
    let mut i = 0;
    while v.len() < len {
        v.extend_from_slice(format!("line {i}: the quick brown fox jumps over the lazy dog\n").as_bytes());
        i += 1;
    }
    v.truncate(len);
    v
}

#[test]
fn compress_then_decompress_in_one_chain_restores_both_directions() {
    let mut lab = chained(&[("z", "compress", args(&["level=3"])), ("u", "compress", args(&["mode=\"decompress\""]))]);
    let (srv, cli) = lab.pair();
    let (up, down) = (text_bytes(1_500_000), pattern(3, 300_000)); // compressible down to the app, random up
    let mut c = Pump::new(down.clone(), true);
    let mut s = Pump::new(up.clone(), true);
    let done = lab.until(60_000, |lab| {
        c.drive(lab.app.tcp(cli));
        s.drive(lab.server.tcp(srv));
        c.got.len() == up.len() && s.got.len() == down.len()
    });
    assert!(done, "client got {} server got {}", c.got.len(), s.got.len());
    assert!(c.got == up, "the server's bytes reach the app intact");
    assert!(s.got == down, "the app's bytes reach the server intact");
    // Between the two, the server's text travelled compressed (z restores it coming up; u compressed it).
    let (plain, packed) = (lab.meter("module.u.plain_bytes_total"), lab.meter("module.u.packed_bytes_total"));
    assert_eq!(plain, up.len() as u64);
    assert!(packed * 5 < plain, "text shrinks at least 5 times: {packed} of {plain}");
    // Random bytes do not shrink: stored, 4 bytes a block more.
    assert_eq!(lab.meter("module.z.plain_bytes_total"), down.len() as u64);
    assert_eq!(lab.meter("module.z.stored_blocks_total"), lab.meter("module.z.blocks_total"));
    assert_eq!(lab.meter("module.z.errors_total") + lab.meter("module.u.errors_total"), 0);
    lab.run(12_000);
    assert_eq!(lab.connections(), 0, "both closed: every ack found its way back");
    assert_eq!(lab.meter("module.t.stream_bad_total") + lab.meter("module.o.stream_bad_total"), 0, "no ack was wrong");
}

#[test]
fn compress_acks_input_only_when_its_output_is_acked_and_aborts_on_garbage() {
    let (mut sw, log) = alone("compress", &[]);
    let pool = sw.pool().clone();
    let text = text_bytes(100_000); // two blocks
    let mut b: Batch = vec![
        StreamFrame::open(&pool, 1, Direction::Down, &tcp(80)).into(),
        StreamFrame::data(&pool, 1, Direction::Down, &text).into(),
    ];
    sw.inject("m", "in", &mut b).unwrap();
    sw.run(Time::from_millis(1));
    let t = settle(&mut sw, 1); // the blocks are made on the compression threads
    let seen = take(&log);
    assert_eq!(seen.len(), 3, "open and two blocks");
    let out: u64 = seen[1..].iter().map(|s| s.data.len() as u64).sum();
    // An ack of all but one output byte frees nothing of the second block's input.
    let mut b: Batch = vec![StreamFrame::ack(&pool, 1, Direction::Up, out - 1).into()];
    sw.inject("m", "in", &mut b).unwrap();
    sw.run(Time::from_millis(t + 1));
    let acks: Vec<u64> = take(&log).iter().map(|s| s.meta.get(MetaKey::STREAM).unwrap() >> 8).collect();
    assert_eq!(acks, [65536], "the first block's input");
    let mut b: Batch = vec![StreamFrame::ack(&pool, 1, Direction::Up, 1).into()];
    sw.inject("m", "in", &mut b).unwrap();
    sw.run(Time::from_millis(t + 2));
    let acks: Vec<u64> = take(&log).iter().map(|s| s.meta.get(MetaKey::STREAM).unwrap() >> 8).collect();
    assert_eq!(acks, [100_000 - 65536]);
    // Up data is restored here: a header announcing 2 GB is garbage and aborts the flow both ways.
    let mut b: Batch = vec![StreamFrame::data(&pool, 1, Direction::Up, &[0x7f, 0xff, 0xff, 0xff, 1, 2]).into()];
    sw.inject("m", "in", &mut b).unwrap();
    sw.run(Time::from_millis(t + 3));
    let seen = take(&log);
    assert_eq!(seen.iter().map(kind_of).collect::<Vec<_>>(), [4, 4], "two aborts");
    assert_eq!((seen[0].direction, seen[1].direction), (Direction::Down, Direction::Up));
    assert_eq!(meter(&sw, "module.m.errors_total"), 1);
    assert_eq!(meter(&sw, "module.m.selected_flows_active"), 0);
}

/// Frames of one flow, `chunks` of data travelling down.
fn flow_frames(pool: &flexstack_core::PacketPool, flow: u64, port: u16, chunks: &[&[u8]]) -> Batch {
    let mut b: Batch = vec![StreamFrame::open(pool, flow, Direction::Down, &tcp(port)).into()];
    b.extend(chunks.iter().map(|c| StreamFrame::data(pool, flow, Direction::Down, c).into()));
    b
}

/// Restores the blocks `compress` made (its framing: a 4-byte header, bit 31 set for a stored payload).
fn unframe(blocks: &[Seen]) -> Vec<u8> {
    let mut plain = Vec::new();
    for s in blocks {
        let header = u32::from_be_bytes(s.data[..4].try_into().unwrap());
        assert_eq!((header & 0x3fff_ffff) as usize, s.data.len() - 4, "one block a frame");
        if header & 1 << 31 != 0 {
            plain.extend_from_slice(&s.data[4..]);
        } else {
            plain.extend(zstd::decode_all(&s.data[4..]).unwrap());
        }
    }
    plain
}

#[test]
fn compress_gathers_a_batchs_chunks_into_blocks_and_sends_a_lone_message_at_once() {
    let (mut sw, log) = alone("compress", &[]);
    let pool = sw.pool().clone();
    // Five 16 KiB chunks of one flow in one batch (as `terminate` hands over what its socket holds): one block of
    // 64 KiB and one of the rest, not five.
    let text = text_bytes(5 * 16384);
    let chunks: Vec<&[u8]> = text.chunks(16384).collect();
    let mut b = flow_frames(&pool, 1, 80, &chunks);
    sw.inject("m", "in", &mut b).unwrap();
    sw.run(Time::from_millis(1));
    let t = settle(&mut sw, 1); // the blocks are made on the compression threads
    let seen = take(&log);
    assert_eq!(seen.len(), 3, "open and two blocks");
    assert_eq!(meter(&sw, "module.m.blocks_total"), 2);
    assert!(unframe(&seen[1..]) == text, "the blocks restore the chunks");
    // An interactive request alone in its batch leaves at once, as one block, in the same run (nothing waits for
    // more input, no timer): its response is not delayed by the gathering.
    let request = b"GET /status HTTP/1.1\r\nHost: x\r\n\r\n";
    let mut b: Batch = vec![StreamFrame::data(&pool, 1, Direction::Down, request).into()];
    sw.inject("m", "in", &mut b).unwrap();
    sw.run(Time::from_millis(t + 1));
    let seen = take(&log);
    assert_eq!(seen.len(), 1, "the request's block");
    assert_eq!(seen[0].at, Time::from_millis(t + 1), "sent in the run that took it (compressed on the worker)");
    assert_eq!(unframe(&seen), request);
    // Two flows' chunks interleaved, and a Fin: each flow's bytes keep their order, and the Fin follows its data.
    let mut b: Batch = vec![StreamFrame::open(&pool, 2, Direction::Down, &tcp(81)).into()];
    for c in chunks.iter().take(2) {
        b.push(StreamFrame::data(&pool, 1, Direction::Down, c).into());
        b.push(StreamFrame::data(&pool, 1, Direction::Down, c).into());
        b.push(StreamFrame::data(&pool, 2, Direction::Down, c).into());
    }
    b.push(StreamFrame::fin(&pool, 1, Direction::Down).into());
    sw.inject("m", "in", &mut b).unwrap();
    sw.run(Time::from_millis(t + 2));
    settle(&mut sw, t + 2);
    let seen = take(&log);
    let flow = |s: &Seen| s.meta.get(MetaKey::FLOW_ID).unwrap();
    let (one, two): (Vec<Seen>, Vec<Seen>) = seen[1..].iter().cloned().partition(|s| flow(s) == 1);
    assert_eq!(kind_of(one.last().unwrap()), 3, "flow 1's Fin comes after its data");
    let pair = [chunks[0], chunks[0], chunks[1], chunks[1]].concat();
    assert!(unframe(&one[..one.len() - 1]) == pair);
    assert!(unframe(&two) == [chunks[0], chunks[1]].concat());
    assert_eq!(one.len() - 1 + two.len(), 4, "a block for each run of one flow's chunks");
}

#[test]
fn inspect_finds_patterns_across_chunk_boundaries_and_closes_the_flow() {
    let (mut sw, log) = alone(
        "inspect",
        &[r#"patterns=["count literal secret", "alert regex pass(word|phrase)=[0-9]+", "close literal DROP TABLE"]"#],
    );
    let pool = sw.pool().clone();
    // "secret" cut in three, a regex match cut in two, then the closing pattern straddling two chunks.
    let mut b = flow_frames(
        &pool,
        1,
        80,
        &[b"xx sec", b"r", b"et yy passw", b"ord=1234 ok", b"; DROP T", b"ABLE users", b"never"],
    );
    sw.inject("m", "in", &mut b).unwrap();
    sw.run(Time::from_millis(1));
    let seen = take(&log);
    let kinds: Vec<u64> = seen.iter().map(kind_of).collect();
    // open, 5 data chunks passed, then the two aborts; "ABLE users" (the chunk that completed the match) and what
    // came after it are not passed (the flow is gone; what follows an abort is the endpoints' to drop).
    assert_eq!(&kinds[..8], &[1, 2, 2, 2, 2, 2, 4, 4], "{kinds:?}");
    assert_eq!(seen[6].data, b"inspect");
    assert_eq!((seen[6].direction, seen[7].direction), (Direction::Down, Direction::Up));
    assert!(!seen.iter().any(|s| s.data == b"ABLE users"), "the matching chunk is held back");
    assert_eq!(meter(&sw, "module.m.rule1_matches_total"), 1);
    assert_eq!(meter(&sw, "module.m.rule2_matches_total"), 1);
    assert_eq!(meter(&sw, "module.m.rule3_matches_total"), 1);
    assert_eq!(meter(&sw, "module.m.alerts_total"), 1);
    assert_eq!(meter(&sw, "module.m.closed_total"), 1);
    // A match is counted once, though the tail is searched again with the next chunk.
    let mut b = flow_frames(&pool, 2, 80, &[b"secret", b"s", b"", b"abc"]);
    sw.inject("m", "in", &mut b).unwrap();
    sw.run(Time::from_millis(2));
    assert_eq!(meter(&sw, "module.m.rule1_matches_total"), 2);
    assert_eq!(take(&log).len(), 5, "nothing else held or dropped");
}

#[test]
fn inspect_keeps_to_its_direction_window_and_selection() {
    let (mut sw, log) =
        alone("inspect", &["patterns=[\"count up literal abcdef\"]", "window=4", "select=[\"use tcp port 80\"]"]);
    let pool = sw.pool().clone();
    let mut b = flow_frames(&pool, 1, 80, &[b"abcdef"]); // down: not its direction
    b.push(StreamFrame::data(&pool, 1, Direction::Up, b"abcdef").into());
    for part in [b"ab", b"cd", b"ef"] {
        // Cut in three, the match is longer than what the window keeps between chunks.
        b.push(StreamFrame::data(&pool, 1, Direction::Up, part).into());
    }
    b.extend(flow_frames(&pool, 2, 443, &[b"abcdef"])); // not selected
    b.push(StreamFrame::data(&pool, 2, Direction::Up, b"abcdef").into());
    sw.inject("m", "in", &mut b).unwrap();
    sw.run(Time::from_millis(1));
    assert_eq!(take(&log).len(), 9);
    assert_eq!(meter(&sw, "module.m.rule1_matches_total"), 1);
    assert_eq!(meter(&sw, "module.m.flows_selected_total"), 1);
    assert_eq!(meter(&sw, "module.m.flows_unselected_total"), 1);
}

#[test]
fn inspect_refuses_huge_patterns_and_runs_nested_quantifiers_in_linear_time() {
    let e = configure_error("inspect", &[r#"patterns=["count literal ok", "close regex (a{1000}){1000}"]"#]);
    assert!(e.contains("rule 2: pattern too large"), "{e}");
    let e = configure_error("inspect", &[r#"patterns=["drop literal x"]"#]);
    assert!(e.contains("expected an action: count, alert or close"), "{e}");
    let e = configure_error("inspect", &[r#"patterns=["close regex (unclosed"]"#]);
    assert!(e.contains("bad regex"), "{e}");
    // (a+)+$ backtracks exponentially elsewhere; here 64 KiB of `a` and a `b` take one linear pass.
    let (mut sw, _log) = alone("inspect", &["patterns=[\"count regex (a+)+b$\"]", "window=65536"]);
    let pool = sw.pool().clone();
    let a = vec![b'a'; 65536];
    let mut b = flow_frames(&pool, 1, 80, &[&a, &a[..1000], b"c"]);
    let t = std::time::Instant::now();
    sw.inject("m", "in", &mut b).unwrap();
    sw.run(Time::from_millis(1));
    assert!(t.elapsed() < Duration::from_secs(5), "took {:?}", t.elapsed());
    assert_eq!(meter(&sw, "module.m.rule1_matches_total"), 0);
    assert_eq!(meter(&sw, "module.m.bytes_scanned_total"), 65536 + 1001);
}

fn configure_error(kind: &str, a: &[&str]) -> String {
    let settings = flexstack_core::Settings::from_args(&args(a)).unwrap();
    match flexstack_modules::catalog().configure(kind, &settings, None) {
        Ok(_) => panic!("{kind} {a:?} was accepted"),
        Err(e) => e.to_string(),
    }
}

/// Bytes of Data that left `log` so far, and when the last of them did.
fn drain_bytes(log: &Log) -> u64 {
    take(log).iter().filter(|s| kind_of(s) == 2).map(|s| s.data.len() as u64).sum()
}

#[test]
fn shape_holds_a_flow_to_its_rate_and_releases_on_time() {
    let (mut sw, log) = alone("shape", &["rate=100000", "burst=10000"]);
    let pool = sw.pool().clone();
    let chunk = vec![7u8; 5000];
    let chunks: Vec<&[u8]> = (0..100).map(|_| &chunk[..]).collect(); // 500 KB at once
    let mut b = flow_frames(&pool, 1, 80, &chunks);
    b.push(StreamFrame::fin(&pool, 1, Direction::Down).into());
    b.push(StreamFrame::ack(&pool, 1, Direction::Up, 5).into()); // acks are never held
    sw.inject("m", "in", &mut b).unwrap();
    let mut now = Time::from_millis(1);
    sw.run(now);
    let first = take(&log);
    assert_eq!(first.iter().filter(|s| kind_of(s) == 5).count(), 1, "the ack passed at once");
    let mut sent: u64 = first.iter().filter(|s| kind_of(s) == 2).map(|s| s.data.len() as u64).sum();
    assert_eq!(sent, 15000, "the burst (10 KB) and one chunk into debt");
    assert_eq!(meter(&sw, "module.m.held_bytes"), 500_000 - 15000);
    // Driven by its own wake-ups only: after each run the switch says when it wants to run next.
    let mut at_2s = 0;
    let mut fin = false;
    while let Some(next) = sw.next_wakeup() {
        assert!(next > now, "it asks for a later time");
        now = next;
        sw.run(now);
        for s in take(&log) {
            assert!(!fin, "nothing after the fin");
            match kind_of(&s) {
                2 => sent += s.data.len() as u64,
                3 => fin = true,
                k => panic!("kind {k}"),
            }
        }
        if now <= Time::from_millis(2001) {
            at_2s = sent;
        }
        if sent == 500_000 {
            break;
        }
    }
    // 10 KB of burst, then 100 KB/s: 200 KB after 2 s (within a chunk), all 500 KB at 4.9 s.
    assert!((205_000..=215_000).contains(&at_2s), "{at_2s} bytes after 2 s");
    let end = now.as_nanos() as f64 / 1e9;
    assert!((4.84..=4.90).contains(&end), "the last byte left at {end} s");
    assert!(fin, "the fin follows the data");
    assert_eq!(meter(&sw, "module.m.held_bytes"), 0);
}

#[test]
fn shape_per_app_shares_one_bucket_and_the_rate_knob_is_live() {
    let (mut sw, log) = alone("shape", &["rate=50000", "burst=1000", "per=\"app\""]);
    let pool = sw.pool().clone();
    let chunk = vec![1u8; 1000];
    let chunks: Vec<&[u8]> = (0..200).map(|_| &chunk[..]).collect();
    let mut b = flow_frames(&pool, 1, 80, &chunks);
    b.extend(flow_frames(&pool, 2, 81, &chunks));
    sw.inject("m", "in", &mut b).unwrap();
    let mut per_flow = [0u64; 2];
    let mut run_until = |sw: &mut Switch, end: Time| {
        let mut now = Time::from_millis(1);
        sw.run(now);
        while let Some(next) = sw.next_wakeup().filter(|n| *n <= end) {
            now = next;
            sw.run(now);
        }
        for s in take(&log).iter().filter(|s| kind_of(s) == 2) {
            per_flow[s.flow().unwrap() as usize - 1] += s.data.len() as u64;
        }
    };
    run_until(&mut sw, Time::from_millis(1001));
    let total = per_flow[0] + per_flow[1];
    assert!((50_000..=53_000).contains(&total), "two flows share 50 KB/s: {per_flow:?}");
    assert!(per_flow[0].abs_diff(per_flow[1]) <= 1000, "in turns: {per_flow:?}");
    sw.apply(vec![Edit::SetKnob { module: "m".into(), knob: "rate".into(), value: Value::U64(0) }]).unwrap();
    sw.run(Time::from_millis(1002));
    assert!(drain_bytes(&log) > 100_000, "what waited left at once");
    assert_eq!(meter(&sw, "module.m.held_bytes"), 0, "rate 0: no limit, everything left");
}

#[test]
fn record_writes_both_directions_with_timestamps_for_selected_flows_only() {
    let dir = tempfile::tempdir().unwrap();
    let path = format!("path={:?}", dir.path().display().to_string());
    let (mut sw, log) = alone("record", &[&path, "select=[\"skip * port 53\", \"use tcp\"]"]);
    let pool = sw.pool().clone();
    let mut b = flow_frames(&pool, 1, 80, &[b"GET / HTTP/1.0\r\n\r\n"]);
    sw.inject("m", "in", &mut b).unwrap();
    sw.run(Time::from_millis(5));
    let mut b: Batch = vec![
        StreamFrame::data(&pool, 1, Direction::Up, b"HTTP/1.0 200 OK\r\n").into(),
        StreamFrame::fin(&pool, 1, Direction::Down).into(),
        StreamFrame::fin(&pool, 1, Direction::Up).into(),
    ];
    b.extend(flow_frames(&pool, 2, 53, &[b"not recorded"]));
    sw.inject("m", "in", &mut b).unwrap();
    sw.run(Time::from_millis(7));
    assert_eq!(take(&log).len(), 7, "every frame passes");
    let read = |n: &str| std::fs::read_to_string(dir.path().join(n)).unwrap();
    assert_eq!(read("1.down"), "GET / HTTP/1.0\r\n\r\n");
    assert_eq!(read("1.up"), "HTTP/1.0 200 OK\r\n");
    assert_eq!(
        read("1.times"),
        "5000000 down 0 18\n7000000 up 0 17\n7000000 fin down\n7000000 fin up\n7000000 end fin\n"
    );
    assert_eq!(
        read("index"),
        "5000000 1 open tcp 10.0.0.2:40000 -> 192.0.2.1:80 app \"app\" client\n7000000 1 end fin down 18 up 17\n"
    );
    assert!(!dir.path().join("2.down").exists());
    assert_eq!(meter(&sw, "module.m.flows_unselected_total"), 1);
}

#[test]
fn null_passes_everything_and_counts_its_flows() {
    let (mut sw, log) = alone("null", &["select=[\"use udp\", \"skip *\"]"]);
    let pool = sw.pool().clone();
    let mut b = flow_frames(&pool, 1, 80, &[b"abc"]);
    let udp = FlowInfo::udp("10.0.0.2:5000".parse().unwrap(), "10.0.0.1:53".parse().unwrap(), "dig", Role::Client);
    b.push(StreamFrame::open(&pool, 2, Direction::Down, &udp).into());
    b.push(StreamFrame::data(&pool, 2, Direction::Down, b"query").into());
    b.push(pool.alloc_from(b"not a stream frame").into());
    sw.inject("m", "in", &mut b).unwrap();
    sw.run(Time::from_millis(1));
    assert_eq!(take(&log).len(), 5);
    assert_eq!(meter(&sw, "module.m.bytes_down_total"), 5, "the udp flow's only");
    assert_eq!(meter(&sw, "module.m.flows_selected_total"), 1);
    assert_eq!(meter(&sw, "module.m.selected_flows_active"), 1);
    let mut b: Batch = vec![StreamFrame::fin(&pool, 2, Direction::Up).into()];
    sw.inject("m", "in", &mut b).unwrap();
    sw.run(Time::from_millis(2));
    assert_eq!(meter(&sw, "module.m.selected_flows_active"), 0, "one fin ends a UDP flow");
}

/// FreeNA's example (its Fig. 3): a firewall and TLS for TCP server port 8080 by a global rule, TLS alone for
/// ports 8020-8021 by a local rule, nothing otherwise (here `inspect` and `compress` stand for them).
const FREENA: &str = r#"# FreeNA's example
[[rule]]
use = true
transport = "TCP"
port = 8080
role = "server"

[[rule]]
use = false
transport = "*"
port = "*"
role = "*"

[[service]]
kind = "inspect"
name = "firewall"
patterns = ["close literal DROP TABLE"]

[[service]]
kind = "compress"
[[service.rule]]
use = true
transport = "TCP"
port = "8020-8021"
role = "*"
"#;

#[test]
fn the_freena_example_chooses_services_per_flow_and_what_terminate_takes() {
    let f = ServiceFile::parse("web.toml", FREENA).unwrap();
    let flow = |port: u16, role: Role| {
        FlowInfo::tcp("10.0.0.2:1".parse().unwrap(), format!("10.0.0.9:{port}").parse().unwrap(), "web", role)
    };
    assert_eq!(f.services_for(&flow(8080, Role::Server)), [0, 1], "both by the global rule");
    assert_eq!(f.services_for(&flow(8080, Role::Client)), Vec::<usize>::new(), "not a server");
    assert_eq!(f.services_for(&flow(8020, Role::Client)), [1], "the local rule, either role");
    assert_eq!(f.services_for(&flow(8021, Role::Server)), [1]);
    assert_eq!(f.services_for(&flow(8022, Role::Server)), Vec::<usize>::new());
    let udp = FlowInfo::udp("10.0.0.2:1".parse().unwrap(), "10.0.0.9:8020".parse().unwrap(), "web", Role::Client);
    assert_eq!(f.services_for(&udp), Vec::<usize>::new());
    assert_eq!(
        f.match_table(256).unwrap(),
        ["tcp dport 8020-8021 role client", "tcp dport 8020-8021,8080 role server"],
        "terminate takes exactly those flows"
    );
    // The module settings carry the rules, local ones first.
    let s = f.settings_of(1);
    let select: Vec<&str> =
        s.get("select").unwrap().value.as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
    assert_eq!(select, ["use tcp port 8020-8021", "use tcp port 8080 role server", "skip *"]);
    f.check(&flexstack_modules::catalog()).unwrap();
    // The chain replaces `{app}-streams` of the terminating template.
    let base =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../stacks/app-terminate.toml")).unwrap();
    let t =
        f.template(&base, 256).unwrap().replace("{app}", "web").replace("{app_dev}", "a").replace("{host_dev}", "h");
    let spec = flexstack_core::StackSpec::parse("t", &t).unwrap();
    let names: Vec<&str> = spec.modules.iter().map(|m| m.name.as_str()).collect();
    assert!(!names.contains(&"web-streams"), "{names:?}");
    for m in ["web-firewall", "web-firewall-dir", "web-compress", "web-sdir"] {
        assert!(names.contains(&m), "{m}: {names:?}");
    }
    let links: Vec<String> = spec.links.iter().map(|l| l.link.to_string()).collect();
    for l in [
        "web-term[stream] -> web-firewall",
        "web-orig[stream] -> web-compress",
        "web-firewall-dir[down] -> web-compress",
        "web-sdir[up] -> web-firewall",
        "web-firewall-dir[up] -> web-term[stream_in]",
        "web-sdir[down] -> web-orig[stream_in]",
    ] {
        assert!(links.contains(&l.to_string()), "{l}: {links:?}");
    }
    assert!(!links.iter().any(|l| l.contains("streams")), "{links:?}");
    let term = spec.modules.iter().find(|m| m.name == "web-term").unwrap();
    let table = term.settings.get("match").unwrap().value.as_array().unwrap().len();
    assert_eq!(table, 2, "the derived match table");
    // A file without `backend` leaves the base's; one with it sets both endpoints'.
    let backends = |t: &str| -> Vec<String> {
        let t = t.replace("{app}", "web").replace("{app_dev}", "a").replace("{host_dev}", "h");
        let spec = flexstack_core::StackSpec::parse("t", &t).unwrap();
        ["web-term", "web-orig"]
            .iter()
            .map(|n| spec.modules.iter().find(|m| m.name == *n).unwrap().settings.get("backend").unwrap())
            .map(|s| s.value.as_str().unwrap().to_string())
            .collect()
    };
    assert_eq!(backends(&f.template(&base, 256).unwrap()), ["smoltcp", "smoltcp"]);
    let kernel = ServiceFile { backend: Some("kernel".into()), ..f.clone() };
    assert_eq!(backends(&kernel.template(&base, 256).unwrap()), ["kernel", "kernel"]);
}

#[test]
fn with_a_carrier_the_services_sit_before_it() {
    let f = ServiceFile::parse(
        "peer.toml",
        "[[rule]]\nuse = true\ntransport = \"tcp\"\n[[service]]\nkind = \"null\"\n[[service]]\nkind = \"compress\"\n",
    )
    .unwrap();
    let base = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../stacks/app-peer.toml")).unwrap();
    let t =
        f.template(&base, 256).unwrap().replace("{app}", "web").replace("{app_dev}", "a").replace("{host_dev}", "h");
    let spec = flexstack_core::StackSpec::parse("t", &t).unwrap();
    let links: Vec<String> = spec.links.iter().map(|l| l.link.to_string()).collect();
    for l in [
        "web-term[stream] -> web-null",
        "web-null-dir[down] -> web-compress",
        "web-sdir[down] -> web-peer",
        "web-peer[stream] -> web-compress",
        "web-orig[stream] -> web-compress",
        "web-peer[pass] -> web-orig[stream_in]",
        "web-sdir[up] -> web-null",
        "web-null-dir[up] -> web-term[stream_in]",
    ] {
        assert!(links.contains(&l.to_string()), "{l}: {links:?}");
    }
    assert!(!links
        .iter()
        .any(|l| l.contains("streams") || l.ends_with("web-orig[stream_in]") && l.starts_with("web-sdir")));
    let names: Vec<&str> = spec.modules.iter().map(|m| m.name.as_str()).collect();
    assert!(names.contains(&"web-peer") && !names.contains(&"web-streams"), "{names:?}");
}

#[test]
fn a_file_where_every_service_takes_every_flow_terminates_everything() {
    let f = ServiceFile::parse(
        "all.toml",
        "[[rule]]\nuse = true\n[[service]]\nkind = \"null\"\n[[service]]\nkind = \"null\"\n",
    )
    .unwrap();
    assert_eq!(f.match_table(256).unwrap(), ["tcp *", "udp *"]);
    assert_eq!(f.services.iter().map(|s| s.name.as_str()).collect::<Vec<_>>(), ["null", "null2"]);
    let none = ServiceFile::parse("none.toml", "[[rule]]\nuse = false\n[[service]]\nkind = \"null\"\n").unwrap();
    assert_eq!(none.match_table(256).unwrap(), Vec::<String>::new(), "no flow is terminated");
}

#[test]
fn a_services_file_with_errors_says_where() {
    for (text, line, needle) in [
        ("[[service]]\nkind = \"null\"\n[[rule]]\nuse = true\ntransport = \"sctp\"\n", 5, "expected a transport: tcp, udp or *"),
        ("[[rule]]\nuse = true\nport = \"90000\"\n[[service]]\nkind = \"null\"\n", 3, "port"),
        ("[[rule]]\nuse = true\nrole = \"peer\"\n[[service]]\nkind = \"null\"\n", 3, "expected a role"),
        ("[[rule]]\ntransport = \"tcp\"\n[[service]]\nkind = \"null\"\n", 1, "`use` is required"),
        ("[[rule]]\nuse = \"yes\"\n[[service]]\nkind = \"null\"\n", 2, "must be true or false"),
        ("[[rule]]\nuse = true\nportz = 1\n[[service]]\nkind = \"null\"\n", 3, "unknown key `portz`"),
        ("[[rule]]\nuse = true\n\n[[service]]\nkind = \"tls2\"\n", 5, "unknown kind \"tls2\""),
        ("[[rule]]\nuse = true\n\n[[service]]\nlevel = 3\n", 4, "`kind` is required"),
        ("\n[[service]]\nkind = \"null\"\n", 2, "no rule and there are no global rules"),
        ("[[rule]]\nuse = true\n", 1, "no service"),
        ("services = 1\n", 1, "unknown key `services`"),
        ("[[rule]]\nuse = true\n[[service]]\nkind = \"null\"\nname = \"x\"\n[[service]]\nkind = \"shape\"\nname = \"x\"\n", 8, "two services named `x`"),
        ("[[rule]]\nuse = true\n[[service]]\nkind = \"null\"\nselect = [\"use *\"]\n", 5, "made from the rules"),
        ("[[rule]\nuse = true\n", 1, "invalid TOML"),
        ("backend = \"dpdk\"\n[[rule]]\nuse = true\n[[service]]\nkind = \"null\"\n", 1, "backend: expected \"kernel\""),
        ("[[rule]]\nuse = true\nbackend = \"kernel\"\n[[service]]\nkind = \"null\"\n", 3, "goes at the top"),
    ] {
        let e = ServiceFile::parse("bad.toml", text).err().unwrap_or_else(|| panic!("accepted: {text}"));
        let at = e.location.as_ref().unwrap_or_else(|| panic!("{e}: no location"));
        assert_eq!((&*at.file, at.line), ("bad.toml", line), "{text:?}: {e}");
        assert!(e.message.contains(needle), "{text:?}: {e}");
    }
    // Settings are the kinds' own, checked where they are written.
    for (text, line, needle) in [
        ("[[rule]]\nuse = true\n[[service]]\nkind = \"shape\"\nrate = -1\n", 5, "rate"),
        ("[[rule]]\nuse = true\n[[service]]\nkind = \"compress\"\nlevel = 30\n", 5, "within 1..=19"),
        ("[[rule]]\nuse = true\n[[service]]\nkind = \"inspect\"\n\npatterns = [\"close regex (\"]\n", 6, "bad regex"),
        ("[[rule]]\nuse = true\n[[service]]\nkind = \"null\"\nbogus = 1\n", 5, "unknown setting `bogus`"),
        ("[[rule]]\nuse = true\n[[service]]\nkind = \"tls\"\nca = \"/nonexistent/ca.pem\"\n", 5, "cannot read"),
        ("[[rule]]\nuse = true\n[[service]]\nkind = \"tls\"\n", 3, "`ca`"),
    ] {
        let f = ServiceFile::parse("bad.toml", text).unwrap();
        let e = f.check(&flexstack_modules::catalog()).err().unwrap_or_else(|| panic!("accepted: {text}"));
        let at = e.location.as_ref().unwrap_or_else(|| panic!("{e}: no location"));
        assert_eq!((&*at.file, at.line), ("bad.toml", line), "{text:?}: {e}");
        assert!(e.message.contains(needle), "{text:?}: {e}");
    }
}

#[test]
fn the_stream_event_of_an_open_survives_the_services() {
    // Open frames pass every service unchanged (the far endpoint reads them).
    for (kind, a) in [("null", vec![]), ("shape", vec!["rate=10"]), ("inspect", vec![]), ("compress", vec![])] {
        let (mut sw, log) = alone(kind, &a);
        let pool = sw.pool().clone();
        let mut b: Batch = vec![StreamFrame::open(&pool, 9, Direction::Down, &tcp(80)).into()];
        sw.inject("m", "in", &mut b).unwrap();
        sw.run(Time::from_millis(1));
        let seen = take(&log);
        let p = pool.alloc_from(&seen[0].data);
        let info = FlowInfo::decode(p.data()).unwrap();
        assert_eq!(info, tcp(80), "{kind}");
        assert!(matches!(StreamEvent::Open(info), StreamEvent::Open(_)));
    }
}

/// `module replace` of a service, keeping its state.
fn replace(name: &str, kind: &str, a: &[&str]) -> Edit {
    let settings = flexstack_core::Settings::from_args(&args(a)).unwrap();
    let builder = flexstack_modules::catalog().configure(kind, &settings, None).unwrap();
    Edit::Replace { name: name.into(), kind: kind.into(), settings, builder, keep_state: true }
}

#[test]
fn a_replaced_shape_keeps_what_it_held_and_goes_on_at_its_new_rate() {
    let (mut sw, log) = alone("shape", &["rate=10000", "burst=1000"]);
    let pool = sw.pool().clone();
    let chunks: Vec<Vec<u8>> = (0..50u8).map(|i| vec![i; 1000]).collect();
    let refs: Vec<&[u8]> = chunks.iter().map(|c| &c[..]).collect();
    let mut b = flow_frames(&pool, 1, 80, &refs);
    sw.inject("m", "in", &mut b).unwrap();
    sw.run(Time::from_millis(1));
    let mut got: Vec<u8> = take(&log).iter().filter(|s| kind_of(s) == 2).flat_map(|s| s.data.clone()).collect();
    assert_eq!(got.len(), 2000, "the burst and one chunk");
    // A new module, ten times faster; the 48 chunks held go on from it, in order.
    let notes = sw.apply(vec![replace("m", "shape", &["rate=100000", "burst=1000"])]).unwrap();
    assert!(notes.iter().all(|n| !n.contains("not handed over")), "{notes:?}");
    assert_eq!(meter(&sw, "module.m.held_bytes"), 48_000);
    let mut now = Time::from_millis(2);
    sw.run(now);
    while let Some(next) = sw.next_wakeup().filter(|_| got.len() < 50_000) {
        now = next;
        sw.run(now);
        got.extend(take(&log).iter().filter(|s| kind_of(s) == 2).flat_map(|s| s.data.clone()));
    }
    assert_eq!(got, chunks.concat(), "every byte, in order");
    let end = now.as_nanos() as f64 / 1e9;
    assert!(end < 0.6, "at 100 KB/s, not 10 KB/s: done at {end} s");
}

#[test]
fn compress_replaced_mid_transfer_keeps_its_flows_and_acks() {
    let mut lab = chained(&[("z", "compress", args(&["level=1"])), ("u", "compress", args(&["mode=\"decompress\""]))]);
    let (srv, cli) = lab.pair();
    let up = text_bytes(2_000_000);
    let mut c = Pump::new(Vec::new(), false);
    let mut s = Pump::new(up.clone(), true);
    let mut replaced = false;
    let done = lab.until(60_000, |lab| {
        c.drive(lab.app.tcp(cli));
        s.drive(lab.server.tcp(srv));
        if !replaced && c.got.len() > 500_000 {
            // Both ends, mid-stream, with another level: the flow goes on through the new modules.
            let edits = vec![
                replace("z", "compress", &["level=9"]),
                replace("u", "compress", &["mode=\"decompress\"", "level=9"]),
            ];
            lab.sw.apply(edits).unwrap();
            replaced = true;
        }
        c.got.len() == up.len()
    });
    assert!(replaced && done, "got {}", c.got.len());
    assert!(c.got == up, "intact across the replacement");
    assert_eq!(lab.meter("module.u.selected_flows_active"), 1, "the new module has the flow");
    assert_eq!(lab.meter("module.t.stream_bad_total") + lab.meter("module.o.stream_bad_total"), 0, "no ack was wrong");
}

#[test]
fn the_example_services_file_is_valid() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../stacks/services-example.toml");
    let f = ServiceFile::parse(path, &std::fs::read_to_string(path).unwrap()).unwrap();
    f.check(&flexstack_modules::catalog()).unwrap();
    assert_eq!(f.match_table(256).unwrap(), ["tcp *"]);
    assert_eq!(f.services.iter().map(|s| s.name.as_str()).collect::<Vec<_>>(), ["inspect", "shape"]);
}

/// Sets a knob of a module of the lab.
fn set_knob(lab: &mut Lab, module: &str, knob: &str, value: Value) {
    lab.sw.apply(vec![Edit::SetKnob { module: module.into(), knob: knob.into(), value }]).unwrap();
}

#[test]
fn compress_taken_out_and_put_back_while_flows_run_keeps_both_directions_intact() {
    let mut lab = chained(&[("z", "compress", args(&["level=1"])), ("u", "compress", args(&["mode=\"decompress\""]))]);
    let (srv, cli) = lab.pair();
    let (up, down) = (text_bytes(2_000_000), text_bytes(600_000));
    let mut c = Pump::new(down.clone(), true);
    let mut s = Pump::new(up.clone(), true);
    let (mut flips, mut last, mut u_marks, mut u_on, mut u_changes) = (0u32, 0usize, 0u64, true, 0u64);
    let done = lab.until(120_000, |lab| {
        c.drive(lab.app.tcp(cli));
        s.drive(lab.server.tcp(srv));
        // Each time bytes reached the app, flip: both ends together, or one alone (the marks, not the knobs, decide).
        // After a flip of u's knob, not before u marked it in the stream (its blocks are made on threads: flips
        // coming while it waits for them could cancel out before it sees a chunk to mark the switch at).
        let u_now = lab.meter("module.u.switches_total");
        if c.got.len() > last && u_now >= u_marks && flips < 100 {
            last = c.got.len();
            let on = Value::Bool(flips % 2 == 1);
            match flips % 3 {
                0 => set_knob(lab, "u", "active", on),
                1 => set_knob(lab, "z", "active", on),
                _ => {
                    set_knob(lab, "z", "active", on.clone());
                    set_knob(lab, "u", "active", on);
                }
            }
            if flips % 3 != 1 && u_on != (flips % 2 == 1) {
                (u_marks, u_on) = (u_now + 1, flips % 2 == 1);
                u_changes += 1;
            }
            flips += 1;
        }
        c.got.len() == up.len() && s.got.len() == down.len()
    });
    assert!(done, "client got {} server got {} after {flips} flips", c.got.len(), s.got.len());
    assert!(flips >= 20, "the knobs flipped during the transfer: {flips}");
    assert!(c.got == up, "the server's bytes reach the app intact");
    assert!(s.got == down, "the app's bytes reach the server intact");
    // Up, u compresses: part of the text went as blocks, part as it was (u's raw bytes also count what it passed
    // down as z sent it), and u marked each switch it made.
    let (plain, raw) = (lab.meter("module.u.plain_bytes_total"), lab.meter("module.u.raw_bytes_total"));
    assert!(plain > 100_000 && raw > 100_000, "{plain} packed, {raw} raw");
    assert!((up.len()..=up.len() + down.len()).contains(&((plain + raw) as usize)), "{plain} packed, {raw} raw");
    let u_switches = lab.meter("module.u.switches_total");
    // Every change of u's knob was marked (the last one maybe not: the data may have ended before it).
    assert!(u_switches >= 6 && u_switches + 1 >= u_changes, "u switched {u_switches} times for {u_changes} changes");
    assert!(lab.meter("module.z.raw_bytes_total") > 0, "z passed what u sent as it was");
    assert_eq!(lab.meter("module.z.errors_total") + lab.meter("module.u.errors_total"), 0);
    lab.run(12_000);
    assert_eq!(lab.connections(), 0, "both closed: every ack found its way back");
    assert_eq!(lab.meter("module.t.stream_bad_total") + lab.meter("module.o.stream_bad_total"), 0, "no ack was wrong");
}

#[test]
fn every_switchable_service_leaves_and_rejoins_running_flows_by_its_active_knob() {
    let dir = tempfile::tempdir().unwrap();
    let path = format!("path={:?}", dir.path().display().to_string());
    let mut lab = chained(&[
        ("i", "inspect", args(&["patterns=[\"count literal fox\"]"])),
        ("s", "shape", args(&["rate=400000"])),
        ("r", "record", args(&[&path])),
        ("n", "null", vec![]),
    ]);
    let (srv, cli) = lab.pair();
    let (up, down) = (text_bytes(1_000_000), text_bytes(200_000));
    let mut c = Pump::new(down.clone(), true);
    let mut s = Pump::new(up.clone(), true);
    let (mut flips, mut last) = (0u32, 0usize);
    let mut elapsed = 0;
    let done = lab.until(20_000, |lab| {
        elapsed += 1;
        c.drive(lab.app.tcp(cli));
        s.drive(lab.server.tcp(srv));
        // Each time bytes reached the app, every service leaves the path or comes back.
        if c.got.len() > last {
            last = c.got.len();
            let on = Value::Bool(flips % 2 == 1);
            for m in ["i", "s", "r", "n"] {
                set_knob(lab, m, "active", on.clone());
            }
            flips += 1;
        }
        c.got.len() == up.len() && s.got.len() == down.len()
    });
    assert!(done, "client got {} server got {} after {flips} flips", c.got.len(), s.got.len());
    assert!(flips >= 10, "{flips} flips");
    assert!(c.got == up && s.got == down, "both directions intact");
    let total = (up.len() + down.len()) as u64;
    let scanned = lab.meter("module.i.bytes_scanned_total");
    assert!(scanned > 0 && scanned < total, "inspect searched part of the bytes: {scanned} of {total}");
    let (n_up, n_down) = (lab.meter("module.n.bytes_up_total"), lab.meter("module.n.bytes_down_total"));
    assert!(n_up > 0 && n_up < up.len() as u64, "null counted part of the bytes up: {n_up}");
    assert!(n_down <= down.len() as u64, "{n_down}");
    // At 400 kB/s the megabyte up would take 2.5 s with shape always in the path.
    assert!(elapsed < 2_200, "shape let part through unshaped: {elapsed} ms");
    // record wrote the chunks that passed while it was in the path, and kept the flow's files open.
    let ups: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "up"))
        .collect();
    assert_eq!(ups.len(), 1, "{ups:?}");
    let recorded = std::fs::metadata(&ups[0]).unwrap().len();
    assert!(recorded > 0 && recorded < up.len() as u64, "record wrote part of the bytes up: {recorded}");
    lab.run(12_000);
    assert_eq!(lab.connections(), 0, "both closed");
    assert_eq!(lab.meter("module.t.stream_bad_total") + lab.meter("module.o.stream_bad_total"), 0, "no ack was wrong");
}

/// A self-signed certificate for `ip` and its key, PEM files in `dir`, made by openssl.
fn self_signed(dir: &std::path::Path, ip: &str) -> (String, String) {
    let (cert, key) = (dir.join("c.pem"), dir.join("k.pem"));
    let out = std::process::Command::new("openssl")
        .args(["req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "1"])
        .args(["-subj", "/CN=t", "-addext", &format!("subjectAltName=IP:{ip}"), "-keyout"])
        .arg(&key)
        .arg("-out")
        .arg(&cert)
        .output()
        .expect("openssl");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    (cert.display().to_string(), key.display().to_string())
}

#[test]
fn tls_refuses_to_leave_the_path_and_a_failure_sends_the_alert_then_the_close() {
    let dir = tempfile::tempdir().unwrap();
    let (cert, key) = self_signed(dir.path(), "10.0.0.2");
    let (c, k) = (format!("cert={cert:?}"), format!("key={key:?}"));
    let e = configure_error("tls", &["mode=\"server\"", &c, &k, "active=false"]);
    assert!(e.contains("tls cannot leave a running flow's path"), "{e}");
    let (mut sw, log) = alone("tls", &["mode=\"server\"", &c, &k]);
    // The switch reports a knob its module refused as a note of the edit.
    let notes =
        sw.apply(vec![Edit::SetKnob { module: "m".into(), knob: "active".into(), value: Value::Bool(false) }]).unwrap();
    let e = notes.join("\n");
    assert!(e.contains("tls cannot leave a running flow's path"), "{e}");
    sw.apply(vec![Edit::SetKnob { module: "m".into(), knob: "active".into(), value: Value::Bool(true) }]).unwrap();
    // A network client (server role: its frames come up) sends garbage instead of a ClientHello.
    let pool = sw.pool().clone();
    let info = FlowInfo::tcp("192.0.2.1:40000".parse().unwrap(), "10.0.0.2:8443".parse().unwrap(), "app", Role::Server);
    let garbage = b"GET / HTTP/1.0 this is not a ClientHello\r\n";
    let mut b: Batch = vec![
        StreamFrame::open(&pool, 1, Direction::Up, &info).into(),
        StreamFrame::data(&pool, 1, Direction::Up, garbage).into(),
    ];
    sw.inject("m", "in", &mut b).unwrap();
    sw.run(Time::from_millis(1));
    let seen = take(&log);
    let order: Vec<(u64, Direction)> = seen.iter().map(|s| (kind_of(s), s.direction)).collect();
    // Open passed; then the alert down, the close down, the app's end aborted.
    assert_eq!(
        order,
        [(1, Direction::Up), (2, Direction::Down), (3, Direction::Down), (4, Direction::Up)],
        "{order:?}"
    );
    assert_eq!(seen[1].data[0], 21, "an alert record: {:?}", seen[1].data);
    assert_eq!(meter(&sw, "module.m.failures_total"), 1);
    // What the client sends until it closes is acked and dropped; its Fin ends the flow.
    let mut b: Batch = vec![
        StreamFrame::data(&pool, 1, Direction::Up, b"more").into(),
        StreamFrame::fin(&pool, 1, Direction::Up).into(),
    ];
    sw.inject("m", "in", &mut b).unwrap();
    sw.run(Time::from_millis(2));
    let seen = take(&log);
    let order: Vec<(u64, Direction)> = seen.iter().map(|s| (kind_of(s), s.direction)).collect();
    assert_eq!(order, [(5, Direction::Down)], "only an ack of the 4 bytes: {order:?}");
    assert_eq!(seen[0].meta.get(MetaKey::STREAM).unwrap() >> 8, 4);
    assert_eq!(meter(&sw, "module.m.selected_flows_active"), 0, "the flow ended");
}
