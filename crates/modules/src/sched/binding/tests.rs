//! Unit tests of the binding modules, on a switch with a simulated clock: each interface's output goes to a
//! recorder, which notes the switch time at which each packet was emitted.

use super::*;
use crate::flow::testutil::*;
use flexstack_core::{Direction, Switch};
use flexstack_wire::checksum;
use flexstack_wire::packet::{build, proto};
use smoltcp::wire::{IpAddress, Ipv4Packet, Ipv6Packet, TcpPacket, UdpPacket};
use std::net::{Ipv4Addr, Ipv6Addr};
use std::time::Duration;

const APP: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 2);
const REMOTE: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 7);
const A_ADDR: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 10);
const B_ADDR: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 20);

/// A UDP/IPv4 packet of exactly `size` bytes from port `sport`, with a DSCP, its index in the payload.
fn udp(sport: u16, size: usize, dscp: u8, index: u32) -> Vec<u8> {
    let mut data = index.to_be_bytes().to_vec();
    data.resize(size - 28, 0);
    let mut p = build::ipv4(APP, REMOTE, proto::UDP, 64, &build::udp(APP.into(), REMOTE.into(), sport, 9000, &data));
    p[1] = dscp << 2;
    p[10] = 0;
    p[11] = 0;
    let c = checksum::ipv4_header(&p[..20]);
    p[10..12].copy_from_slice(&c.to_be_bytes());
    p
}

/// The source port and the index of a packet made by [`udp`].
fn port_index(data: &[u8]) -> (u16, u32) {
    (u16::from_be_bytes([data[20], data[21]]), u32::from_be_bytes(data[28..32].try_into().unwrap()))
}

/// The settings written as TOML lines (`"a.rate_bps" = 8000000`: dotted knob names are quoted keys in stack
/// files; the command line's `key=value` words do not take them).
fn toml_settings(kind: &str, lines: &[&str]) -> flexstack_core::Settings {
    let text = format!("[modules.s]\nkind = \"{kind}\"\n{}\n", lines.join("\n"));
    let spec = flexstack_core::StackSpec::parse("test.toml", &text).unwrap_or_else(|e| panic!("{e}"));
    spec.modules[0].settings.clone()
}

/// Loads binding module `name` of `kind` with settings written as TOML lines.
fn load_toml(name: &str, kind: &str, lines: &[&str]) -> flexstack_core::Edit {
    let settings = toml_settings(kind, lines);
    let builder = catalog().configure(kind, &settings, None).unwrap_or_else(|e| panic!("{kind}: {e}"));
    flexstack_core::Edit::Load { name: name.into(), kind: kind.into(), settings, builder }
}

/// The configuration error of a module of `kind` with settings written as TOML lines.
fn toml_error(kind: &str, lines: &[&str]) -> String {
    match catalog().configure(kind, &toml_settings(kind, lines), None) {
        Ok(_) => panic!("{kind} {lines:?} configured"),
        Err(e) => e.to_string(),
    }
}

/// A binding module `s` of `kind` whose interfaces `a` and `b` each lead to a recorder of the same name.
fn stack(kind: &str, args: &[&str]) -> (Switch, Log, Log) {
    let mut sw = Switch::default();
    let (a, la) = recorder("a");
    let (b, lb) = recorder("b");
    let mut all = vec!["interfaces=[\"a\", \"b\"]"];
    all.extend_from_slice(args);
    sw.apply(vec![load_toml("s", kind, &all), a, b, link("s[a] -> a"), link("s[b] -> b")]).unwrap();
    sw.run(Time::ZERO);
    (sw, la, lb)
}

/// Injects packets (going down, optionally with a flow id) and runs the switch at `at`.
fn inject(sw: &mut Switch, at: Time, packets: &[Vec<u8>], flow: Option<u64>) {
    let mut batch: Batch = packets
        .iter()
        .map(|d| {
            let mut p = sw.pool().alloc_from(d);
            p.set_direction(Direction::Down);
            if let Some(id) = flow {
                p.meta_mut().set(MetaKey::FLOW_ID, id);
            }
            Frame::Data(p)
        })
        .collect();
    sw.inject("s", "in", &mut batch).unwrap();
    sw.run(at);
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

/// Runs procedure `class` of module `s` through an Exec control frame at `at`; the reply's value or error.
fn exec(sw: &mut Switch, at: Time, argument: &str) -> Result<Value, String> {
    sw.send_control(flexstack_core::ControlFrame {
        op: flexstack_core::ControlOp::Exec,
        sender: flexstack_core::switch::CONTROL_PLANE.into(),
        dest: "s".into(),
        serial: 1,
        param: "class".into(),
        value: Value::Str(argument.into()),
    });
    sw.run(at);
    let reply = sw.take_control_inbox().pop().expect("a reply");
    match reply.op {
        flexstack_core::ControlOp::ExecReply => Ok(reply.value),
        _ => Err(reply.value.to_string()),
    }
}

fn ms(x: u64) -> Time {
    Time::from_millis(x)
}

fn us(x: u64) -> Time {
    Time(x * 1000)
}

/// 8 Mbit/s: one byte per µs, a 1000-byte packet per ms.
const RATE_8M: &str = "\"a.rate_bps\"=8000000";

#[test]
fn device_queue_drains_at_the_rate_and_emits_at_transmission_start() {
    let (mut sw, la, _) = stack(LATE_KIND, &[RATE_8M]);
    let pkts: Vec<Vec<u8>> = (0..5).map(|i| udp(1000, 1000, 0, i)).collect();
    inject(&mut sw, ms(0), &pkts, None);
    // One packet on the (modelled) wire, one waiting in the device queue, three above the binding point.
    assert_eq!(u64_var(&sw, "module.s.a.device_queue_len"), 2);
    assert_eq!(u64_var(&sw, "module.s.queued"), 3);
    assert_eq!(take(&la).len(), 1);
    // The next emission comes exactly when the first transmission ends, not a nanosecond before.
    assert_eq!(sw.next_wakeup(), Some(ms(1)));
    sw.run(Time(ms(1).0 - 1));
    assert!(take(&la).is_empty());
    drain(&mut sw, ms(100));
    let times: Vec<Time> = take(&la).iter().map(|s| s.at).collect();
    assert_eq!(times, [ms(1), ms(2), ms(3), ms(4)]);
    assert_eq!(u64_var(&sw, "module.s.a.bound_packets_total"), 5);
    assert_eq!(u64_var(&sw, "module.s.a.bound_bytes_total"), 5000);
    assert_eq!(u64_var(&sw, "module.s.a.device_queue_len"), 0);
    assert_eq!(sw.next_wakeup(), Some(ms(0) + Duration::from_millis(30_000)), "only the flow sweep is left");
}

#[test]
fn overhead_bytes_lengthen_each_modelled_transmission() {
    // 986 bytes of packet + 14 of Ethernet header: 1000 bytes, 1 ms each at 8 Mbit/s.
    let (mut sw, la, _) = stack(LATE_KIND, &[RATE_8M, "\"a.overhead_bytes\"=14"]);
    let pkts: Vec<Vec<u8>> = (0..3).map(|i| udp(1000, 986, 0, i)).collect();
    inject(&mut sw, ms(0), &pkts, None);
    drain(&mut sw, ms(100));
    let times: Vec<Time> = take(&la).iter().map(|s| s.at).collect();
    assert_eq!(times, [ms(0), ms(1), ms(2)]);
    assert_eq!(u64_var(&sw, "module.s.a.overhead_bytes"), 14);
}

#[test]
fn urgent_class_goes_before_bulk_that_is_above_the_binding_point() {
    let (mut sw, la, _) = stack(LATE_KIND, &[RATE_8M]);
    let bulk: Vec<Vec<u8>> = (0..10).map(|i| udp(1000, 1000, 0, i)).collect();
    inject(&mut sw, ms(0), &bulk, None);
    drain(&mut sw, us(500));
    // EF (46) is urgent: three urgent packets arrive at 0.5 ms behind ten bulk ones.
    let urgent: Vec<Vec<u8>> = (0..3).map(|i| udp(2000, 1000, 46, 100 + i)).collect();
    inject(&mut sw, us(500), &urgent, None);
    drain(&mut sw, ms(100));
    let seen: Vec<(u16, u32, Time)> = take(&la)
        .iter()
        .map(|s| {
            let (p, i) = port_index(&s.data);
            (p, i, s.at)
        })
        .collect();
    // The two bulk packets already below the binding point go first; then urgent, then the rest of bulk.
    let order: Vec<u32> = seen.iter().map(|s| s.1).collect();
    assert_eq!(order, [0, 1, 100, 101, 102, 2, 3, 4, 5, 6, 7, 8, 9]);
    assert_eq!(seen[2].2, ms(2), "the first urgent packet waits only for the device queue");
    assert!(take(&la).is_empty());
    // The class is the flow's, shown in its runtime meters (hashed flow: its id is h<hash>).
    let reg = sw.registry().snapshot();
    let classes: Vec<Value> = reg.matching("flow.*.binding.class").map(|(_, c)| c.get()).collect();
    assert_eq!(classes.len(), 2);
    assert!(classes.contains(&Value::Str("urgent".into())) && classes.contains(&Value::Str("bulk".into())));
}

#[test]
fn class_rules_metadata_and_overrides_decide_the_class() {
    let (mut sw, la, _) = stack(
        LATE_KIND,
        &[RATE_8M, "class_rules=[\"urgent udp port 3000\", \"bulk dscp 46\"]", "\"a.device_queue\"=1"],
    );
    // Flow 7 (bulk by DSCP 0) fills the device queue; the override makes flow 8 (EF, but "bulk dscp 46") urgent
    // before it appears; the port-3000 flow is urgent by rule.
    inject(&mut sw, ms(0), &(0..4).map(|i| udp(1000, 1000, 0, i)).collect::<Vec<_>>(), Some(7));
    assert_eq!(exec(&mut sw, ms(0), "8 interactive"), Ok(Value::Str("flow 8: interactive".into())));
    inject(&mut sw, us(100), &[udp(1001, 1000, 46, 50)], Some(8));
    inject(&mut sw, us(200), &[udp(3000, 1000, 0, 60)], Some(9));
    inject(&mut sw, us(300), &[udp(1002, 1000, 46, 70)], Some(10));
    drain(&mut sw, ms(100));
    let order: Vec<u32> = take(&la).iter().map(|s| port_index(&s.data).1).collect();
    // Flow 10 is bulk by rule and shares with flow 7 by DRR (quantum 1514: one or two 1000-byte packets a round):
    // flow 7 spent its round's quantum on packet 0 (514 bytes left, not enough for packet 1) and waits for the
    // next round, which flow 10, arriving meanwhile, joins after its own turn in the current one.
    assert_eq!(order, [0, 60, 50, 70, 1, 2, 3]);
    assert_eq!(var(&sw, "flow.8.binding.class"), Some(Value::Str("interactive".into())));
    assert_eq!(var(&sw, "flow.9.binding.class"), Some(Value::Str("urgent".into())));
    assert_eq!(var(&sw, "flow.10.binding.class"), Some(Value::Str("bulk".into())));
    assert_eq!(var(&sw, "flow.7.binding.interface"), Some(Value::Str("a".into())));
    assert!(exec(&mut sw, ms(100), "8 fast").unwrap_err().contains("urgent|interactive|bulk"));
    // The override moves a flow that is waiting.
    inject(&mut sw, ms(200), &(0..3).map(|i| udp(1000, 1000, 0, 200 + i)).collect::<Vec<_>>(), Some(7));
    inject(&mut sw, ms(200), &[udp(1003, 1000, 0, 300)], Some(11));
    exec(&mut sw, ms(200), "11 urgent").unwrap();
    drain(&mut sw, ms(300));
    let order: Vec<u32> = take(&la).iter().map(|s| port_index(&s.data).1).collect();
    assert_eq!(order, [200, 300, 201, 202]);
}

#[test]
fn a_flows_class_knob_moves_it_like_the_procedure() {
    let (mut sw, la, _) = stack(LATE_KIND, &[RATE_8M, "\"a.device_queue\"=1"]);
    let set = |sw: &mut Switch, name: &str, class: &str| {
        sw.apply(vec![flexstack_core::Edit::SetVar { name: name.into(), value: Value::Str(class.into()) }])
    };
    // Flow 7 (bulk) has three packets waiting behind the one in the device queue; flow 11 arrives, then its
    // runtime knob makes it urgent: it goes next.
    inject(&mut sw, ms(0), &(0..4).map(|i| udp(1000, 1000, 0, i)).collect::<Vec<_>>(), Some(7));
    inject(&mut sw, us(100), &[udp(1003, 1000, 0, 300)], Some(11));
    assert_eq!(set(&mut sw, "flow.11.binding.class", "urgent"), Ok(Vec::new()));
    assert_eq!(var(&sw, "flow.11.binding.class"), Some(Value::Str("urgent".into())));
    drain(&mut sw, ms(100));
    let order: Vec<u32> = take(&la).iter().map(|s| port_index(&s.data).1).collect();
    assert_eq!(order, [0, 300, 1, 2, 3]);
    // A value the module refuses is a note, and changes nothing; a meter or an unknown name is refused whole.
    let notes = set(&mut sw, "flow.11.binding.class", "fast").unwrap();
    assert!(notes.iter().any(|n| n.contains("expected urgent, interactive or bulk")), "{notes:?}");
    assert_eq!(var(&sw, "flow.11.binding.class"), Some(Value::Str("urgent".into())));
    let e = set(&mut sw, "flow.11.binding.queued", "3").unwrap_err();
    assert!(e.message.contains("meter"), "{e}");
    let e = set(&mut sw, "flow.99.binding.class", "bulk").unwrap_err();
    assert!(e.message.contains("no variable flow.99.binding.class"), "{e}");
}

#[test]
fn deficit_round_robin_shares_bytes_within_one_packet() {
    // Three backlogged bulk flows with packets of 200, 700 and 1500 bytes on a 100 Mbit/s interface.
    let (mut sw, la, _) = stack(LATE_KIND, &["\"a.rate_bps\"=100000000", "queue_limit=100000", "quantum=500"]);
    let sizes = [(1u16, 200usize), (2, 700), (3, 1500)];
    for (port, size) in sizes {
        let n = 3_000_000 / size;
        let pkts: Vec<Vec<u8>> = (0..n as u32).map(|i| udp(port, size, 0, i)).collect();
        inject(&mut sw, ms(0), &pkts, None);
    }
    // 100 ms at 100 Mbit/s is 1.25 MB: every flow stays backlogged.
    drain(&mut sw, ms(100));
    let mut bytes = [0u64; 3];
    for s in take(&la) {
        let (port, _) = port_index(&s.data);
        bytes[port as usize - 1] += s.data.len() as u64;
    }
    let total: u64 = bytes.iter().sum();
    assert!(total > 1_200_000, "{total}");
    let fair = total / 3;
    for (k, b) in bytes.iter().enumerate() {
        assert!(b.abs_diff(fair) <= 1500, "flow {k}: {b} bytes, fair share {fair} ({bytes:?})");
    }
}

#[test]
fn backlogged_flows_stay_within_a_quantum_and_a_packet_of_each_other_at_every_point() {
    // Twenty random cases (fixed seeds): 2-12 bulk flows, each packet of a random size (60-1500 bytes), a random
    // quantum (64-3000 bytes). At every point of the output while every flow still has packets waiting, no two
    // flows have sent more than the quantum plus a largest packet apart (deficit round robin's bound).
    for seed in 1..=20u64 {
        let mut rng = flexstack_fuzzkit::Rng::new(seed);
        let flows = 2 + rng.below(11);
        let quantum = 64 + rng.below(2937) as u64;
        let setting = format!("quantum={quantum}");
        let (mut sw, la, _) = stack(LATE_KIND, &["\"a.rate_bps\"=100000000", "queue_limit=100000", &setting]);
        let per_flow = 200u32;
        // One batch (flows by 5-tuple: the source port), so that every flow is queued before the first binding.
        let pkts: Vec<Vec<u8>> = (0..flows)
            .flat_map(|f| (0..per_flow).map(move |i| (f, i)))
            .map(|(f, i)| udp(1 + f as u16, 60 + rng.below(1441), 0, i))
            .collect();
        inject(&mut sw, ms(0), &pkts, None);
        drain(&mut sw, ms(1000));
        let sent = take(&la);
        assert_eq!(sent.len(), flows * per_flow as usize, "seed {seed}: everything sent");
        let (mut bytes, mut packets) = (vec![0u64; flows], vec![0u32; flows]);
        for (k, s) in sent.iter().enumerate() {
            let f = usize::from(port_index(&s.data).0 - 1);
            bytes[f] += s.data.len() as u64;
            packets[f] += 1;
            if packets.contains(&per_flow) {
                break;
            }
            let (lo, hi) = (bytes.iter().min().unwrap(), bytes.iter().max().unwrap());
            assert!(
                hi - lo <= quantum + 1500,
                "seed {seed}, {flows} flows, quantum {quantum}: after {k} packets the shares are {bytes:?}"
            );
        }
    }
}

#[test]
fn within_a_round_flows_take_turns_packet_by_packet() {
    // Quantum 3000: a round lets each flow send three 1000-byte packets. Flow 1's six packets arrive before flow
    // 2's; classic DRR would send 1,1,1,2,2,2,1,1,1,2,2,2. Here each visit sends one packet and the flow goes to
    // the back of the round while its deficit covers the next: the flows alternate within each round.
    let (mut sw, la, _) = stack(LATE_KIND, &[RATE_8M, "\"a.device_queue\"=1", "quantum=3000"]);
    inject(&mut sw, ms(0), &(0..6).map(|i| udp(1, 1000, 0, i)).collect::<Vec<_>>(), Some(1));
    inject(&mut sw, ms(0), &(0..6).map(|i| udp(2, 1000, 0, 10 + i)).collect::<Vec<_>>(), Some(2));
    drain(&mut sw, ms(100));
    let order: Vec<u32> = take(&la).iter().map(|s| port_index(&s.data).1).collect();
    // Round 1: flow 1 sent packet 0 alone when it arrived (3000 - 1000 left), then the flows alternate until
    // flow 1 has sent its three (0, 1, 2) and flow 2 its three (10, 11, 12). Round 2 alternates from the start.
    assert_eq!(order, [0, 1, 10, 2, 11, 12, 3, 13, 4, 14, 5, 15]);
}

#[test]
fn flows_that_arrive_in_turn_are_served_in_arrival_order() {
    // Four flows, four 1000-byte packets each, arriving in turn (flow 1, 2, 3, 4, 1, 2, ...), default quantum
    // (1514: one packet a round, two every other round). Every flow keeps packets queued, so the service is
    // their arrival order: no flow sends its second packet of a round before the others have sent their first.
    let (mut sw, la, _) = stack(LATE_KIND, &[RATE_8M, "\"a.device_queue\"=1"]);
    for i in 0..16u32 {
        let flow = 1 + i % 4;
        inject(&mut sw, ms(0), &[udp(flow as u16, 1000, 0, i)], Some(u64::from(flow)));
    }
    drain(&mut sw, ms(100));
    let order: Vec<u32> = take(&la).iter().map(|s| port_index(&s.data).1).collect();
    assert_eq!(order, (0..16).collect::<Vec<_>>());
}

#[test]
fn a_blocked_round_lets_the_next_rounds_flows_use_other_interfaces() {
    // Flow 1 is in the current round, its interface full; flow 2 finished the round and waits for the next one.
    // Passing over every flow of the current round starts the next round's flows, which may go elsewhere.
    let mut r = Rounds::default();
    r.push(1);
    r.push(2);
    assert_eq!(r.front(), Some(1));
    r.again();
    assert_eq!(r.front(), Some(2));
    r.later();
    let mut passed = 0;
    assert_eq!(r.front(), Some(1));
    assert!(!r.pass_over(&mut passed), "flow 2 is still to be tried");
    assert_eq!(r.front(), Some(2));
    assert_eq!(r.iter().copied().collect::<Vec<_>>(), [2, 1]);
    assert!(r.pass_over(&mut passed), "both tried: nothing can go");
    // Once the current round is empty, the next one begins.
    let mut r = Rounds::default();
    r.push(3);
    r.later();
    assert_eq!((r.len(), r.front()), (1, Some(3)));
    r.remove_front();
    assert!(r.is_empty());
}

#[test]
fn a_flow_pinned_to_a_full_interface_does_not_hold_up_the_others() {
    // Affinity: flow 1 is pinned to a, flow 2 to b. Then a slows to 1 Mbit/s (8 ms a packet) while b sends one
    // every 1 ms: flow 2 keeps b busy while flow 1 waits for a, whatever round each is in.
    let (mut sw, la, lb) = stack(
        LATE_KIND,
        &[
            "policy=\"affinity\"",
            RATE_8M,
            "\"b.rate_bps\"=8000000",
            "\"a.device_queue\"=1",
            "\"b.device_queue\"=1",
            "quantum=2000",
        ],
    );
    inject(&mut sw, ms(0), &[udp(1, 1000, 0, 0)], Some(1));
    inject(&mut sw, ms(0), &[udp(2, 1000, 0, 100)], Some(2));
    drain(&mut sw, ms(10));
    assert_eq!((take(&la).len(), take(&lb).len()), (1, 1));
    sw.apply(vec![knob("s", "a.rate_bps", Value::U64(1_000_000))]).unwrap();
    inject(&mut sw, ms(10), &(1..40).map(|i| udp(1, 1000, 0, i)).collect::<Vec<_>>(), Some(1));
    inject(&mut sw, ms(10), &(101..140).map(|i| udp(2, 1000, 0, i)).collect::<Vec<_>>(), Some(2));
    drain(&mut sw, ms(42));
    let (a, b) = (take(&la), take(&lb));
    assert!(a.iter().all(|s| port_index(&s.data).0 == 1) && b.iter().all(|s| port_index(&s.data).0 == 2));
    // 32 ms: a sends about 4, b about 32.
    assert!((3..=5).contains(&a.len()), "a sent {}", a.len());
    assert!(b.len() >= 30, "b sent {}: held up by flow 1", b.len());
}

#[test]
fn preferred_fails_over_and_back() {
    let (mut sw, la, lb) = stack(LATE_KIND, &[]);
    inject(&mut sw, ms(0), &[udp(1, 100, 0, 0)], Some(1));
    sw.apply(vec![knob("s", "a.up", Value::Bool(false))]).unwrap();
    inject(&mut sw, ms(1), &[udp(1, 100, 0, 1)], Some(1));
    sw.apply(vec![knob("s", "a.up", Value::Bool(true))]).unwrap();
    inject(&mut sw, ms(2), &[udp(1, 100, 0, 2)], Some(1));
    let a: Vec<u32> = take(&la).iter().map(|s| port_index(&s.data).1).collect();
    let b: Vec<u32> = take(&lb).iter().map(|s| port_index(&s.data).1).collect();
    assert_eq!((a, b), (vec![0, 2], vec![1]));
    assert_eq!(u64_var(&sw, "module.s.rebinds_total"), 2);
    assert_eq!(u64_var(&sw, "module.s.b.rebinds_total"), 1);
    assert_eq!(u64_var(&sw, "module.s.a.rebinds_total"), 1);
}

#[test]
fn affinity_keeps_flows_on_their_interface_while_it_is_up() {
    let (mut sw, la, lb) =
        stack(LATE_KIND, &["policy=\"affinity\"", RATE_8M, "\"b.rate_bps\"=8000000", "\"a.device_queue\"=50"]);
    // Flow 1 goes to a (both idle: the first); flow 2 then finds a busy and goes to b.
    inject(&mut sw, ms(0), &[udp(1, 1000, 0, 0)], Some(1));
    inject(&mut sw, ms(0), &[udp(2, 1000, 0, 0)], Some(2));
    // Flow 1 stays on a even with a backlog there and b idle.
    inject(&mut sw, ms(0), &(1..20).map(|i| udp(1, 1000, 0, i)).collect::<Vec<_>>(), Some(1));
    drain(&mut sw, ms(100));
    let ports = |l: &Log| take(l).iter().map(|s| port_index(&s.data).0).collect::<Vec<_>>();
    assert_eq!(ports(&la), vec![1; 20]);
    assert_eq!(ports(&lb), vec![2]);
    assert_eq!(var(&sw, "flow.1.binding.interface"), Some(Value::Str("a".into())));
    assert_eq!(var(&sw, "flow.2.binding.interface"), Some(Value::Str("b".into())));
    // a goes down: flow 1 is re-pinned to b and stays there when a comes back.
    sw.apply(vec![knob("s", "a.up", Value::Bool(false))]).unwrap();
    inject(&mut sw, ms(200), &[udp(1, 1000, 0, 30)], Some(1));
    sw.apply(vec![knob("s", "a.up", Value::Bool(true))]).unwrap();
    drain(&mut sw, ms(300));
    inject(&mut sw, ms(300), &[udp(1, 1000, 0, 31)], Some(1));
    drain(&mut sw, ms(400));
    assert!(take(&la).is_empty());
    assert_eq!(ports(&lb), vec![1, 1]);
    assert_eq!(u64_var(&sw, "module.s.rebinds_total"), 1);
}

#[test]
fn weighted_splits_flows_by_weight() {
    let (mut sw, la, lb) = stack(LATE_KIND, &["policy=\"weighted\"", "\"a.weight\"=3", "\"b.weight\"=1"]);
    for id in 1..=800u64 {
        inject(&mut sw, ms(id), &[udp(id as u16, 100, 0, 0), udp(id as u16, 100, 0, 1)], Some(id));
    }
    let on = |l: &Log| {
        let seen = take(l);
        let mut flows: Vec<u16> = seen.iter().map(|s| port_index(&s.data).0).collect();
        flows.dedup();
        (seen.len(), flows.len())
    };
    let (pa, fa) = on(&la);
    let (pb, fb) = on(&lb);
    // Both packets of a flow go the same way, and the flows split about 3:1 (600 ± 40 of 800).
    assert_eq!((pa, pb), (2 * fa, 2 * fb));
    assert_eq!(fa + fb, 800);
    assert!(fa.abs_diff(600) <= 40, "{fa} flows on a, {fb} on b");
    assert_eq!(u64_var(&sw, "module.s.rebinds_total"), 0);
    // Weight 0 takes b out of new choices.
    sw.apply(vec![knob("s", "b.weight", Value::U64(0))]).unwrap();
    for id in 1000..1100u64 {
        inject(&mut sw, ms(id), &[udp(id as u16, 100, 0, 0)], Some(id));
    }
    assert_eq!(on(&la).1, 100);
}

#[test]
fn fastest_splits_by_rate() {
    // a: 10 Mbit/s, b: 1 Mbit/s, deep device queues: packets go where they would finish first.
    let (mut sw, la, lb) = stack(
        LATE_KIND,
        &[
            "policy=\"fastest\"",
            "\"a.rate_bps\"=10000000",
            "\"b.rate_bps\"=1000000",
            "\"a.device_queue\"=1000",
            "\"b.device_queue\"=1000",
        ],
    );
    inject(&mut sw, ms(0), &(0..1100).map(|i| udp(1, 1000, 0, i)).collect::<Vec<_>>(), Some(1));
    drain(&mut sw, Time::from_millis(10_000));
    let (a, b) = (take(&la).len(), take(&lb).len());
    assert_eq!(a + b, 1100);
    assert!((990..=1010).contains(&a), "{a} on a, {b} on b");
}

/// Twenty 1000-byte packets at 0 ms on a at 8 Mbit/s; a goes down at 0.5 ms; returns what each side emitted.
fn handoff(kind: &str) -> (Switch, Vec<u32>, Vec<u32>) {
    handoff_with(kind, &[])
}

/// [`handoff`] with more settings.
fn handoff_with(kind: &str, extra: &[&str]) -> (Switch, Vec<u32>, Vec<u32>) {
    let mut args = vec![RATE_8M, "\"b.rate_bps\"=8000000"];
    args.extend_from_slice(extra);
    let (mut sw, la, lb) = stack(kind, &args);
    inject(&mut sw, ms(0), &(0..20).map(|i| udp(1, 1000, 0, i)).collect::<Vec<_>>(), Some(1));
    drain(&mut sw, us(500));
    sw.apply(vec![knob("s", "a.up", Value::Bool(false))]).unwrap();
    sw.run(us(500));
    drain(&mut sw, ms(100));
    let idx = |l: &Log| take(l).iter().map(|s| port_index(&s.data).1).collect::<Vec<_>>();
    let (a, b) = (idx(&la), idx(&lb));
    (sw, a, b)
}

#[test]
fn late_binding_loses_only_the_device_queue_on_interface_down() {
    let (sw, a, b) = handoff(LATE_KIND);
    // Packet 0 was on the wire, packet 1 waited in the 2-packet device queue: it alone is lost.
    assert_eq!(a, [0]);
    assert_eq!(b, (2..20).collect::<Vec<_>>());
    assert_eq!(u64_var(&sw, "module.s.a.drop_interface_down_total"), 1);
    assert_eq!(u64_var(&sw, "module.s.a.tx_interrupted_total"), 1);
    assert_eq!(u64_var(&sw, "module.s.drop_interface_down_total"), 1);
    assert_eq!(u64_var(&sw, "module.s.frames_dropped_total"), 1);
    assert_eq!(u64_var(&sw, "module.s.rebinds_total"), 1);
    assert_eq!(u64_var(&sw, "module.s.b.rebinds_total"), 1);
    assert_eq!(u64_var(&sw, "module.s.queued"), 0);
    let stats = sw.pool().stats();
    assert_eq!(stats.free + stats.released, stats.allocated, "every packet went back to the pool");
}

#[test]
fn a_face_losing_its_link_takes_its_interface_down_and_back_up() {
    // Interface a's face is the module named "a" (here a recorder stands for it).
    let (mut sw, la, lb) = stack(LATE_KIND, &[RATE_8M, "\"b.rate_bps\"=8000000", "\"a.face\"=\"a\""]);
    inject(&mut sw, ms(0), &(0..20).map(|i| udp(1, 1000, 0, i)).collect::<Vec<_>>(), Some(1));
    drain(&mut sw, us(500));
    let a_face = sw.index_of("a").unwrap();
    sw.face_link_changed(a_face, false);
    assert_eq!(sw.registry().snapshot().get("module.s.a.up").map(|c| c.get()), Some(Value::Bool(false)), "the knob");
    sw.run(us(500));
    drain(&mut sw, ms(100));
    let idx = |l: &Log| take(l).iter().map(|s| port_index(&s.data).1).collect::<Vec<_>>();
    // As with the knob: packet 0 was on the wire, packet 1 in the device queue (lost), the rest go over b.
    assert_eq!(idx(&la), [0]);
    assert_eq!(idx(&lb), (2..20).collect::<Vec<_>>());
    assert_eq!(u64_var(&sw, "module.s.a.drop_interface_down_total"), 1);
    // The link comes back: the preferred interface carries the flow again.
    sw.face_link_changed(a_face, true);
    inject(&mut sw, ms(200), &[udp(1, 1000, 0, 20)], Some(1));
    drain(&mut sw, ms(300));
    assert_eq!(idx(&la), [20]);
    // Another face's link changes nothing here (b names no face).
    let b_face = sw.index_of("b").unwrap();
    sw.face_link_changed(b_face, false);
    inject(&mut sw, ms(400), &[udp(1, 1000, 0, 21)], Some(1));
    drain(&mut sw, ms(500));
    assert_eq!(idx(&la), [21]);
}

#[test]
fn early_binding_loses_everything_queued_on_the_interface() {
    let (sw, a, b) = handoff(EARLY_KIND);
    // All twenty were bound to a at enqueue: the 19 not yet on the wire are lost, nothing reaches b.
    assert_eq!(a, [0]);
    assert!(b.is_empty());
    assert_eq!(u64_var(&sw, "module.s.a.drop_interface_down_total"), 19);
    assert_eq!(u64_var(&sw, "module.s.drop_interface_down_total"), 19);
    assert_eq!(u64_var(&sw, "module.s.a.tx_interrupted_total"), 1);
    assert_eq!(u64_var(&sw, "module.s.queued"), 0);
    let stats = sw.pool().stats();
    assert_eq!(stats.free + stats.released, stats.allocated);
}

#[test]
fn early_binding_fifo_limit_and_no_interface() {
    let (mut sw, la, _) = stack(EARLY_KIND, &[RATE_8M, "\"a.fifo_limit\"=5", "\"a.device_queue\"=3"]);
    inject(&mut sw, ms(0), &(0..10).map(|i| udp(1, 1000, 0, i)).collect::<Vec<_>>(), Some(1));
    // FIFO and device queue hold 5 + 3 packets together; the other two are dropped.
    assert_eq!(u64_var(&sw, "module.s.a.drop_queue_full_total"), 2);
    assert_eq!(u64_var(&sw, "module.s.a.device_queue_len"), 3);
    assert_eq!(u64_var(&sw, "module.s.a.queue_len"), 5);
    drain(&mut sw, ms(100));
    assert_eq!(take(&la).len(), 8);
    sw.apply(vec![knob("s", "a.up", Value::Bool(false)), knob("s", "b.up", Value::Bool(false))]).unwrap();
    inject(&mut sw, ms(200), &[udp(1, 1000, 0, 99)], Some(1));
    assert_eq!(u64_var(&sw, "module.s.drop_no_interface_total"), 1);
    assert_eq!(u64_var(&sw, "module.s.frames_dropped_total"), 3);
}

#[test]
fn late_binding_holds_packets_while_no_interface_is_up_up_to_the_limit() {
    let (mut sw, _la, lb) = stack(LATE_KIND, &["queue_limit=4", "\"a.up\"=false", "\"b.up\"=false"]);
    inject(&mut sw, ms(0), &(0..6).map(|i| udp(1, 100, 0, i)).collect::<Vec<_>>(), None);
    assert_eq!(u64_var(&sw, "module.s.queued"), 4);
    assert_eq!(u64_var(&sw, "module.s.drop_queue_full_total"), 2);
    sw.apply(vec![knob("s", "b.up", Value::Bool(true))]).unwrap();
    sw.run(ms(1));
    let got: Vec<u32> = take(&lb).iter().map(|s| port_index(&s.data).1).collect();
    assert_eq!(got, [0, 1, 2, 3]);
}

#[test]
fn device_queue_knob_changes_live() {
    let (mut sw, la, _) = stack(LATE_KIND, &[RATE_8M]);
    inject(&mut sw, ms(0), &(0..20).map(|i| udp(1, 1000, 0, i)).collect::<Vec<_>>(), None);
    assert_eq!(u64_var(&sw, "module.s.a.device_queue_len"), 2);
    sw.apply(vec![knob("s", "a.device_queue", Value::U64(5))]).unwrap();
    sw.run(us(100));
    assert_eq!(u64_var(&sw, "module.s.a.device_queue_len"), 5);
    assert_eq!(u64_var(&sw, "module.s.queued"), 15);
    // Smaller again: no packet is taken back, but none is admitted until the queue is below 1.
    sw.apply(vec![knob("s", "a.device_queue", Value::U64(1))]).unwrap();
    drain(&mut sw, ms(4));
    assert_eq!(u64_var(&sw, "module.s.a.device_queue_len"), 1);
    assert_eq!(u64_var(&sw, "module.s.queued"), 15);
    drain(&mut sw, ms(5));
    assert_eq!(u64_var(&sw, "module.s.queued"), 14);
    assert!(sw.apply(vec![knob("s", "a.device_queue", Value::U64(0))]).is_err());
    drain(&mut sw, ms(100));
    assert_eq!(take(&la).len(), 20);
}

/// Checks a packet with smoltcp's wire types (independent of this crate's checksum code).
fn smoltcp_verifies(pkt: &[u8]) -> (IpAddr, IpAddr) {
    match pkt[0] >> 4 {
        4 => {
            let ip = Ipv4Packet::new_checked(pkt).unwrap();
            assert!(ip.verify_checksum(), "IPv4 header checksum");
            let (s, d) = (IpAddress::from(ip.src_addr()), IpAddress::from(ip.dst_addr()));
            match u8::from(ip.next_header()) {
                proto::UDP => assert!(UdpPacket::new_checked(ip.payload()).unwrap().verify_checksum(&s, &d)),
                proto::TCP => assert!(TcpPacket::new_checked(ip.payload()).unwrap().verify_checksum(&s, &d)),
                proto::ICMP => {
                    assert!(smoltcp::wire::Icmpv4Packet::new_checked(ip.payload()).unwrap().verify_checksum())
                }
                p => panic!("protocol {p}"),
            }
            (ip.src_addr().into(), ip.dst_addr().into())
        }
        _ => {
            let ip = Ipv6Packet::new_checked(pkt).unwrap();
            let (s, d) = (IpAddress::from(ip.src_addr()), IpAddress::from(ip.dst_addr()));
            match u8::from(ip.next_header()) {
                proto::UDP => assert!(UdpPacket::new_checked(ip.payload()).unwrap().verify_checksum(&s, &d)),
                proto::TCP => assert!(TcpPacket::new_checked(ip.payload()).unwrap().verify_checksum(&s, &d)),
                proto::ICMPV6 => assert!(smoltcp::wire::Icmpv6Packet::new_checked(ip.payload())
                    .unwrap()
                    .verify_checksum(&ip.src_addr(), &ip.dst_addr())),
                p => panic!("protocol {p}"),
            }
            (ip.src_addr().into(), ip.dst_addr().into())
        }
    }
}

fn v6(s: &str) -> Ipv6Addr {
    s.parse().unwrap()
}

/// An ICMPv6 echo request with a correct checksum.
fn echo6(s: Ipv6Addr, d: Ipv6Addr) -> Vec<u8> {
    let mut m = vec![128, 0, 0, 0, 0, 7, 0, 1, b'h', b'i'];
    let c = checksum::finish(checksum::sum(checksum::pseudo_header(s.into(), d.into(), proto::ICMPV6, 10), &m));
    m[2..4].copy_from_slice(&c.to_be_bytes());
    build::ipv6(s, d, proto::ICMPV6, 64, &m)
}

#[test]
fn binding_maps_the_source_address_with_correct_checksums() {
    let (app6, rem6, a6) = (v6("fd77:4d:1::2"), v6("2001:db8:99::7"), v6("2001:db8:a::10"));
    let (mut sw, la, lb) = stack(
        LATE_KIND,
        &[
            &format!("\"a.address_v4\"=\"{A_ADDR}\""),
            &format!("\"a.address_v6\"=\"{a6}\""),
            &format!("\"b.address_v4\"=\"{B_ADDR}\""),
        ],
    );
    let packets = vec![
        udp(5000, 300, 0, 1),
        build::ipv4(APP, REMOTE, proto::TCP, 64, &build::tcp(APP.into(), REMOTE.into(), 4000, 80, b"hello")),
        build::ipv4(APP, REMOTE, proto::ICMP, 64, &build::icmpv4_echo(9, 1, b"ping")),
        build::ipv6(app6, rem6, proto::UDP, 64, &build::udp(app6.into(), rem6.into(), 5000, 53, b"query")),
        build::ipv6(app6, rem6, proto::TCP, 64, &build::tcp(app6.into(), rem6.into(), 4000, 443, b"x")),
        echo6(app6, rem6),
    ];
    for p in &packets {
        smoltcp_verifies(p);
    }
    inject(&mut sw, ms(0), &packets, None);
    let seen = take(&la);
    assert_eq!(seen.len(), 6);
    for (s, orig) in seen.iter().zip(&packets) {
        let (src, dst) = smoltcp_verifies(&s.data);
        let want: IpAddr = if orig[0] >> 4 == 4 { A_ADDR.into() } else { a6.into() };
        assert_eq!((src, dst.is_ipv4()), (want, orig[0] >> 4 == 4));
        assert_eq!(s.meta.get(MetaKey::OUT_FACE), Some(0));
        assert_eq!(s.data.len(), orig.len());
    }
    // A UDP datagram without checksum keeps none; b has no IPv6 address: the source is kept.
    let mut nock = udp(6000, 100, 0, 2);
    nock[26] = 0;
    nock[27] = 0;
    sw.apply(vec![knob("s", "a.up", Value::Bool(false))]).unwrap();
    inject(&mut sw, ms(1), &[nock, packets[3].clone()], None);
    let seen = take(&lb);
    assert_eq!(seen.len(), 2);
    assert_eq!(smoltcp_verifies(&seen[0].data).0, IpAddr::from(B_ADDR));
    assert_eq!(seen[0].data[26..28], [0, 0]);
    assert_eq!(seen[1].data, packets[3]);
    assert!(take(&la).is_empty());
}

#[test]
fn the_way_up_maps_interface_addresses_back_to_the_virtual_one() {
    let mut sw = Switch::default();
    let (up, lu) = recorder("up");
    let (a, _) = recorder("a");
    sw.apply(vec![
        load_toml(
            "s",
            LATE_KIND,
            &["interfaces=[\"a\"]", &format!("\"a.address_v4\"=\"{A_ADDR}\""), &format!("virtual_v4=\"{APP}\"")],
        ),
        up,
        a,
        link("s[a] -> a"),
        link("s[up_out] -> up"),
    ])
    .unwrap();
    let reply =
        build::ipv4(REMOTE, A_ADDR, proto::TCP, 64, &build::tcp(REMOTE.into(), A_ADDR.into(), 80, 4000, b"answer"));
    let other = build::ipv4(REMOTE, B_ADDR, proto::UDP, 64, &build::udp(REMOTE.into(), B_ADDR.into(), 1, 2, b"x"));
    send(&mut sw, "s", "up_in", &[reply, other.clone(), vec![0x45, 0]], Direction::Up, 1);
    let seen = take(&lu);
    assert_eq!(seen.len(), 2);
    assert_eq!(smoltcp_verifies(&seen[0].data).1, IpAddr::from(APP));
    assert_eq!(seen[1].data, other);
    assert_eq!(u64_var(&sw, "module.s.up_mapped_total"), 1);
    assert_eq!(u64_var(&sw, "module.s.drop_truncated_total"), 1);
}

#[test]
fn flows_are_forgotten_when_idle_and_their_variables_go() {
    let (mut sw, _la, _) = stack(LATE_KIND, &["flow_idle_ms=100"]);
    inject(&mut sw, ms(0), &[udp(1, 100, 0, 0)], Some(3));
    assert_eq!(u64_var(&sw, "module.s.flows_active"), 1);
    assert_eq!(var(&sw, "flow.3.binding.queue_delay_ns"), Some(Value::U64(0)));
    drain(&mut sw, ms(1000));
    assert_eq!(u64_var(&sw, "module.s.flows_active"), 0);
    assert_eq!(var(&sw, "flow.3.binding.class"), None);
    assert_eq!(sw.next_wakeup(), None);
}

#[test]
fn settings_are_checked() {
    assert!(toml_error(LATE_KIND, &[]).contains("needs `interfaces`"));
    assert!(toml_error(LATE_KIND, &["interfaces=[\"a\", \"a\"]"]).contains("named twice"));
    assert!(toml_error(LATE_KIND, &["interfaces=[\"up_out\"]"]).contains("invalid interface name"));
    assert!(toml_error(LATE_KIND, &["interfaces=[\"a\"]", "policy=\"random\""]).contains("expected preferred"));
    assert!(toml_error(LATE_KIND, &["interfaces=[\"a\"]", "\"a.device_queue\"=0"]).contains("1..=1000000"));
    assert!(toml_error(LATE_KIND, &["interfaces=[\"a\"]", "\"b.up\"=true"]).contains("unknown setting `b.up`"));
    assert!(toml_error(LATE_KIND, &["interfaces=[\"a\"]", "\"a.address_v4\"=\"fd00::1\""]).contains("IPv4"));
    assert!(toml_error(LATE_KIND, &["interfaces=[\"a\"]", "\"a.fifo_limit\"=3"]).contains("unknown setting"));
    let e = toml_error(LATE_KIND, &["interfaces=[\"a\"]", "class_rules=[\"urgent udp port x\"]"]);
    assert!(e.contains("rule 1") && e.contains("port number"), "{e}");
    assert_eq!(
        ClassRule::parse("interactive tcp port 22").unwrap(),
        ClassRule { class: Class::Interactive, protocol: Some(proto::TCP), port: Some(22), dscp: None }
    );
    assert!(ClassRule::parse("bulk dscp 64").is_err());
    assert!(ClassRule::parse("bulk tcp extra").is_err());
    assert_eq!(Class::from_dscp(46), Class::Urgent);
    assert_eq!(Class::from_dscp(34), Class::Interactive);
    assert_eq!(Class::from_dscp(0), Class::Bulk);
    assert_eq!(dscp_of(&udp(1, 100, 46, 0)), 46);
    let mut p6 = echo6(v6("fd00::1"), v6("fd00::2"));
    p6[0] = 0x6b;
    p6[1] = 0x80;
    assert_eq!(dscp_of(&p6), 46);
}

/// The example stack in the repository configures with this crate's kinds (the faces are the daemon's).
#[test]
fn the_example_stack_loads() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../stacks/late-binding-example.toml");
    let text = std::fs::read_to_string(path).expect("stacks/late-binding-example.toml");
    let spec = flexstack_core::StackSpec::parse("late-binding-example.toml", &text).unwrap();
    let catalog = catalog();
    let mut configured = 0;
    for m in &spec.modules {
        if catalog.get(&m.kind).is_some() {
            catalog.configure(&m.kind, &m.settings, m.location.clone()).unwrap_or_else(|e| panic!("{e}"));
            configured += 1;
        } else {
            assert!(["packet", "tun", "emulator"].contains(&m.kind.as_str()), "unknown kind {}", m.kind);
        }
    }
    assert!(spec.modules.iter().any(|m| m.kind == LATE_KIND));
    assert!(configured >= 2);
}

#[test]
fn flow_meters_are_published_at_most_every_100_ms_and_never_left_stale() {
    let (mut sw, la, _) = stack(LATE_KIND, &[RATE_8M]);
    // 1000-byte packets at 8 Mbit/s: one per ms. Five arrive at 0: one on the wire, one in the device queue.
    let pkts: Vec<Vec<u8>> = (0..5).map(|i| udp(1000, 1000, 0, i)).collect();
    inject(&mut sw, ms(0), &pkts, Some(4));
    assert_eq!(var(&sw, "flow.4.binding.queued"), Some(Value::U64(3)), "the first change is published at once");
    // Within the next 100 ms the meter keeps the value it had, then it catches up (the module asks to be woken).
    drain(&mut sw, ms(49));
    assert_eq!(take(&la).len(), 5);
    inject(&mut sw, ms(50), &pkts, Some(4));
    assert_eq!(var(&sw, "flow.4.binding.queued"), Some(Value::U64(3)));
    drain(&mut sw, ms(100));
    assert_eq!(var(&sw, "flow.4.binding.queued"), Some(Value::U64(0)), "published at 100 ms: all sent by 10 ms");
    // The last packet of the second batch waited above the binding point from 50 ms until the third packet
    // before it had left the wire, at 53 ms (the device queue holds the one on the wire and one more).
    assert_eq!(var(&sw, "flow.4.binding.queue_delay_ns"), Some(Value::U64(ms(53).0 - ms(50).0)));
    assert_eq!(take(&la).len(), 5);
    assert_eq!(sw.next_wakeup(), Some(ms(30_000)), "nothing stale: only the idle sweep is due");
}

#[test]
fn a_flow_is_one_cache_line() {
    // What the scheduler reads and writes per packet of a flow: one 64-byte line, in the slab too.
    assert_eq!(std::mem::size_of::<Flow>(), 64);
    assert_eq!(std::mem::size_of::<Option<Flow>>(), 64);
    assert_eq!(std::mem::align_of::<Flow>(), 64);
}

/// What a stack's interface `a` sent (the packets' bytes, in order) and the meters binding leaves.
fn sent_and_meters(sw: &Switch, la: &Log) -> (Vec<Vec<u8>>, Vec<Option<Value>>) {
    let sent = take(la).into_iter().map(|s| s.data).collect();
    let names = [
        "module.s.a.bound_packets_total",
        "module.s.a.bound_bytes_total",
        "module.s.rebinds_total",
        "module.s.queued",
        "module.s.queued_bytes",
        "module.s.frames_dropped_total",
        "module.s.drop_truncated_total",
        "flow.7.binding.interface",
        "flow.7.binding.class",
    ];
    (sent, names.iter().map(|n| var(sw, n)).collect())
}

#[test]
fn a_one_flow_batch_bound_as_it_arrives_is_what_queueing_it_would_give() {
    // Flow 7: packets of several sizes (one truncated, dropped), carrying classify's flow id, one batch.
    let mut batch: Vec<Vec<u8>> = (0..12).map(|i| udp(7, 60 + 97 * i as usize, 0, i)).collect();
    batch[5].truncate(10);
    let later = [udp(7, 300, 0, 50)];
    let args = ["\"a.address_v4\"=\"192.0.2.10\"", "quantum=64"];
    // Interfaces up with room: the batch is bound as it is taken.
    let (mut direct, da, db) = stack(LATE_KIND, &args);
    inject(&mut direct, ms(1), &batch, Some(7));
    let mut d_sent: Vec<Vec<u8>> = take(&da).into_iter().map(|s| s.data).collect();
    assert_eq!(d_sent.len(), 11, "bound within the call that took the batch");
    inject(&mut direct, ms(2), &later, Some(7));
    // The same batch held above the binding point while no interface is up, then served by round robin.
    let (mut queued, qa, qb) = stack(LATE_KIND, &args);
    queued.apply(vec![knob("s", "a.up", Value::Bool(false)), knob("s", "b.up", Value::Bool(false))]).unwrap();
    inject(&mut queued, ms(1), &batch, Some(7));
    assert!(take(&qa).is_empty() && take(&qb).is_empty());
    assert_eq!(u64_var(&queued, "module.s.queued"), 11);
    queued.apply(vec![knob("s", "a.up", Value::Bool(true)), knob("s", "b.up", Value::Bool(true))]).unwrap();
    inject(&mut queued, ms(2), &later, Some(7));
    let (rest, d_meters) = sent_and_meters(&direct, &da);
    d_sent.extend(rest);
    let (q_sent, q_meters) = sent_and_meters(&queued, &qa);
    assert_eq!(d_sent.len(), 12);
    assert_eq!(d_sent, q_sent, "the same packets, rewritten alike, in the same order");
    assert_eq!(d_meters, q_meters);
    assert_eq!(d_meters[0], Some(Value::U64(12)));
    assert_eq!(d_meters[3], Some(Value::U64(0)), "nothing left queued");
    assert_eq!(d_meters[6], Some(Value::U64(1)), "the truncated packet dropped as such");
    let idx: Vec<u32> = d_sent.iter().map(|d| port_index(d).1).collect();
    assert_eq!(idx, [0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 11, 50]);
    for d in &d_sent {
        assert_eq!(smoltcp_verifies(d).0, IpAddr::V4(A_ADDR), "source rewritten, checksums right");
    }
    assert!(take(&db).is_empty() && take(&qb).is_empty());
}

#[test]
fn a_batch_of_several_flows_is_served_by_class_even_when_the_device_queue_has_room() {
    // No rate modelled: every packet is bound within the call; in one batch, bulk packets arrive before urgent
    // ones of another flow (hashed 5-tuple flows): the urgent ones take the device queue first all the same.
    let (mut sw, la, _) = stack(LATE_KIND, &[]);
    let mut pkts: Vec<Vec<u8>> = (0..4).map(|i| udp(1, 200, 0, i)).collect();
    pkts.extend((0..3).map(|i| udp(2, 200, 46, 100 + i)));
    inject(&mut sw, ms(0), &pkts, None);
    let order: Vec<u32> = take(&la).iter().map(|s| port_index(&s.data).1).collect();
    assert_eq!(order, [100, 101, 102, 0, 1, 2, 3]);
}

#[test]
fn a_single_urgent_packet_is_bound_at_once_behind_nothing() {
    // A batch of one packet (no flow id) with room below: bound in the call that took it, as settling would.
    let (mut sw, la, _) = stack(LATE_KIND, &["\"a.address_v4\"=\"192.0.2.10\""]);
    inject(&mut sw, ms(0), &[udp(3, 120, 46, 9)], None);
    let seen = take(&la);
    assert_eq!(seen.len(), 1);
    assert_eq!(port_index(&seen[0].data), (3, 9));
    assert_eq!(seen[0].at, ms(0));
    assert_eq!(u64_var(&sw, "module.s.queued"), 0);
    let reg = sw.registry().snapshot();
    let classes: Vec<Value> = reg.matching("flow.*.binding.class").map(|(_, c)| c.get()).collect();
    assert_eq!(classes, [Value::Str("urgent".into())]);
}

#[test]
fn a_batch_of_several_flows_and_classes_bound_whole_is_what_queueing_it_would_give() {
    // Runs of packets of four flows (as a TUN read of several TCP streams brings them), bulk (ports 1 and 4),
    // urgent (2: EF) and interactive (3: AF31), sizes from 60 to 1400 bytes, one truncated; a quantum of 300
    // bytes, so that round robin reorders them.
    let ports = [1u16, 1, 1, 2, 4, 4, 3, 1, 1, 2, 2, 4, 3, 3, 1, 4, 2, 1];
    let dscp = |port: u16| match port {
        2 => 46,
        3 => 26,
        _ => 0,
    };
    let mut batch: Vec<Vec<u8>> =
        ports.iter().enumerate().map(|(i, &port)| udp(port, 60 + (i * 173) % 1341, dscp(port), i as u32)).collect();
    batch[9].truncate(12);
    let args = ["\"a.address_v4\"=\"192.0.2.10\"", "quantum=300"];
    let meters = |sw: &Switch| {
        ["a.bound_packets_total", "a.bound_bytes_total", "queued", "queued_bytes", "drop_truncated_total"]
            .map(|n| u64_var(sw, &format!("module.s.{n}")))
    };
    let classes = |sw: &Switch| {
        let reg = sw.registry().snapshot();
        // Not queue_delay_ns: the held packets did wait (1 ms), the others none.
        let mut v: Vec<String> = reg
            .matching("flow.*.binding.*")
            .filter(|(n, _)| !n.ends_with("queue_delay_ns"))
            .map(|(n, c)| format!("{n}={}", c.get()))
            .collect();
        v.sort();
        v
    };
    // Interfaces up with room, nothing queued: bound within the call that took the batch.
    let (mut direct, da, _) = stack(LATE_KIND, &args);
    inject(&mut direct, ms(1), &batch, None);
    let d_sent: Vec<Vec<u8>> = take(&da).into_iter().map(|s| s.data).collect();
    // Held above the binding point while no interface is up, then served by settling when a comes up.
    let (mut queued, qa, _) = stack(LATE_KIND, &args);
    queued.apply(vec![knob("s", "a.up", Value::Bool(false)), knob("s", "b.up", Value::Bool(false))]).unwrap();
    inject(&mut queued, ms(1), &batch, None);
    assert!(take(&qa).is_empty());
    queued.apply(vec![knob("s", "a.up", Value::Bool(true)), knob("s", "b.up", Value::Bool(true))]).unwrap();
    // Served at 2 ms (the module's wake-up is due: its meters are stale), not earlier than the batch came.
    queued.run(ms(2));
    drain(&mut queued, ms(500));
    let q_sent: Vec<Vec<u8>> = take(&qa).into_iter().map(|s| s.data).collect();
    assert_eq!(d_sent.len(), ports.len() - 1);
    assert_eq!(d_sent, q_sent, "the same packets, rewritten alike, in the same order");
    drain(&mut direct, ms(500));
    assert_eq!(meters(&direct), meters(&queued));
    assert_eq!(classes(&direct), classes(&queued), "the flows' meters");
    let order: Vec<(u16, u32)> = d_sent.iter().map(|d| port_index(d)).collect();
    assert_eq!(order[..3], [(2, 3), (2, 10), (2, 16)], "urgent first: {order:?}");
    assert_eq!(order[3].0, 3, "then interactive: {order:?}");
    let bulk: Vec<u32> = order.iter().filter(|(p, _)| *p == 1 || *p == 4).map(|o| o.1).collect();
    let mut sorted = bulk.clone();
    sorted.sort_unstable();
    assert_ne!(bulk, sorted, "bulk interleaved by round robin, not in arrival order");
    for d in &d_sent {
        assert_eq!(smoltcp_verifies(d).0, IpAddr::V4(A_ADDR));
    }
}

#[test]
fn a_batch_bound_whole_splits_by_weight_as_queueing_it_would() {
    // Policy weighted over a and b: twelve flows (flow ids), several packets each, in runs, in one batch.
    let args = ["policy=\"weighted\"", "\"a.weight\"=3", "\"b.weight\"=1", "quantum=400"];
    let batch: Vec<(u64, Vec<u8>)> = (0..48u32)
        .map(|i| (u64::from(1 + (i / 3) % 12), udp(1 + ((i / 3) % 12) as u16, 100 + 37 * i as usize, 0, i)))
        .collect();
    let send = |sw: &mut Switch, at: Time| {
        let mut frames: Batch = batch
            .iter()
            .map(|(id, d)| {
                let mut p = sw.pool().alloc_from(d);
                p.set_direction(Direction::Down);
                p.meta_mut().set(MetaKey::FLOW_ID, *id);
                Frame::Data(p)
            })
            .collect();
        sw.inject("s", "in", &mut frames).unwrap();
        sw.run(at);
    };
    let seen = |l: &Log| take(l).iter().map(|s| port_index(&s.data)).collect::<Vec<_>>();
    let (mut direct, da, db) = stack(LATE_KIND, &args);
    send(&mut direct, ms(1));
    let direct_seen = (seen(&da), seen(&db));
    let (mut queued, qa, qb) = stack(LATE_KIND, &args);
    queued.apply(vec![knob("s", "a.up", Value::Bool(false)), knob("s", "b.up", Value::Bool(false))]).unwrap();
    send(&mut queued, ms(1));
    queued.apply(vec![knob("s", "a.up", Value::Bool(true)), knob("s", "b.up", Value::Bool(true))]).unwrap();
    // Served at 2 ms (the module's wake-up is due: its meters are stale), not earlier than the batch came.
    queued.run(ms(2));
    drain(&mut queued, ms(500));
    let queued_seen = (seen(&qa), seen(&qb));
    assert_eq!(direct_seen, queued_seen);
    assert_eq!(direct_seen.0.len() + direct_seen.1.len(), 48);
    assert!(!direct_seen.0.is_empty() && !direct_seen.1.is_empty(), "both interfaces used: {direct_seen:?}");
    for n in ["rebinds_total", "a.bound_packets_total", "b.bound_packets_total", "queued"] {
        let name = format!("module.s.{n}");
        assert_eq!(u64_var(&direct, &name), u64_var(&queued, &name), "{name}");
    }
}

// -------------------------------------------------------------------------------------------------------------
// `<iface>.emit`: packets handed to the interface when they start (default) or when they enter the device queue
// -------------------------------------------------------------------------------------------------------------

/// Packet indices and emission times of what a recorder saw.
fn sent(log: &Log) -> Vec<(u32, Time)> {
    take(log).iter().map(|s| (port_index(&s.data).1, s.at)).collect()
}

#[test]
fn with_admit_a_burst_goes_as_the_device_queue_takes_it_and_one_more_as_each_transmission_ends() {
    // Ten 1000-byte packets (1 ms each at 8 Mbit/s) on a device queue of 4, once per emission point.
    let burst: Vec<Vec<u8>> = (0..10).map(|i| udp(1000, 1000, 0, i)).collect();
    let (mut admit, la, _) = stack(LATE_KIND, &[RATE_8M, "\"a.device_queue\"=4", "\"a.emit\"=\"admit\""]);
    let (mut start, ls, _) = stack(LATE_KIND, &[RATE_8M, "\"a.device_queue\"=4"]);
    assert_eq!(var(&admit, "module.s.a.emit"), Some(Value::Str("admit".into())));
    assert_eq!(var(&start, "module.s.a.emit"), Some(Value::Str("start".into())), "the default");
    inject(&mut admit, ms(0), &burst, None);
    inject(&mut start, ms(0), &burst, None);
    // Admit: the four packets the device queue takes are emitted at once; start: only the one on the wire.
    assert_eq!(sent(&la), [(0, ms(0)), (1, ms(0)), (2, ms(0)), (3, ms(0))]);
    assert_eq!(sent(&ls), [(0, ms(0))]);
    let mut admit_all: Vec<u32> = (0..4).collect();
    let mut start_all = vec![0];
    for i in 1..=10u64 {
        for (sw, what) in [(&admit, "admit"), (&start, "start")] {
            assert_eq!(u64_var(sw, "module.s.a.device_queue_len"), 4.min(10 - (i - 1)), "{what} before {i} ms");
            assert_eq!(u64_var(sw, "module.s.queued"), 6u64.saturating_sub(i - 1), "{what} before {i} ms");
        }
        // Admit wakes only when room frees: at the end of the transmission in progress, not a nanosecond before
        // and at no start in between (the next start is that end).
        assert_eq!(admit.next_wakeup(), Some(ms(i)), "admit, after {} ms", i - 1);
        admit.run(Time(ms(i).0 - 1));
        assert!(take(&la).is_empty(), "nothing before the transmission ends");
        admit.run(ms(i));
        start.run(ms(i));
        // One more packet as each transmission ends, while any wait: admit emits it as it enters the queue.
        let now_admit = sent(&la);
        let expected: Vec<(u32, Time)> = if i <= 6 { vec![(3 + i as u32, ms(i))] } else { vec![] };
        assert_eq!(now_admit, expected, "admit at {i} ms");
        admit_all.extend(now_admit.iter().map(|s| s.0));
        let now_start = sent(&ls);
        assert_eq!(now_start, [(i as u32, ms(i))][..usize::from(i < 10)], "start at {i} ms");
        start_all.extend(now_start.iter().map(|s| s.0));
    }
    assert_eq!(admit_all, start_all, "the same packets in the same order");
    // The flows' meters are refreshed at 100 ms; after that only the sweep is due.
    drain(&mut admit, ms(200));
    drain(&mut start, ms(200));
    for sw in [&admit, &start] {
        assert_eq!(u64_var(sw, "module.s.a.device_queue_len"), 0);
        assert_eq!(u64_var(sw, "module.s.a.bound_packets_total"), 10);
        assert_eq!(sw.next_wakeup(), Some(ms(30_000)), "only the flow sweep is left");
    }
}

#[test]
fn with_admit_a_late_wake_up_still_fills_the_device_queue_at_once() {
    // The data plane wakes the module late (2.5 ms after the burst instead of at 1 ms and 2 ms): two
    // transmissions have ended meanwhile. Admit hands over the two packets the freed room takes; start emits
    // the packets whose start has passed and keeps the others for their start.
    let burst: Vec<Vec<u8>> = (0..10).map(|i| udp(1000, 1000, 0, i)).collect();
    let (mut admit, la, _) = stack(LATE_KIND, &[RATE_8M, "\"a.device_queue\"=4", "\"a.emit\"=\"admit\""]);
    let (mut start, ls, _) = stack(LATE_KIND, &[RATE_8M, "\"a.device_queue\"=4"]);
    inject(&mut admit, ms(0), &burst, None);
    inject(&mut start, ms(0), &burst, None);
    admit.run(us(2500));
    start.run(us(2500));
    assert_eq!(sent(&la).iter().map(|s| s.0).collect::<Vec<_>>(), (0..6).collect::<Vec<_>>());
    assert_eq!(sent(&ls).iter().map(|s| s.0).collect::<Vec<_>>(), [0, 1, 2]);
    for sw in [&admit, &start] {
        assert_eq!(u64_var(sw, "module.s.a.device_queue_len"), 4);
        assert_eq!(u64_var(sw, "module.s.queued"), 4);
    }
}

#[test]
fn late_binding_interface_down_with_admit_counts_interrupted_not_dropped() {
    let (sw, a, b) = handoff_with(LATE_KIND, &["\"a.emit\"=\"admit\""]);
    // Both packets of the 2-packet device queue were handed to a when they entered it; neither is lost here.
    assert_eq!(a, [0, 1]);
    assert_eq!(b, (2..20).collect::<Vec<_>>());
    assert_eq!(u64_var(&sw, "module.s.a.tx_interrupted_total"), 2);
    assert_eq!(u64_var(&sw, "module.s.a.drop_interface_down_total"), 0);
    assert_eq!(u64_var(&sw, "module.s.drop_interface_down_total"), 0);
    assert_eq!(u64_var(&sw, "module.s.frames_dropped_total"), 0);
    assert_eq!(u64_var(&sw, "module.s.queued"), 0);
    let stats = sw.pool().stats();
    assert_eq!(stats.free + stats.released, stats.allocated, "every packet went back to the pool");
}

#[test]
fn early_binding_interface_down_with_admit_counts_interrupted_not_dropped() {
    // Early binding's device queue (50) takes all twenty at enqueue: with admit all went to a at once.
    let (sw, a, b) = handoff_with(EARLY_KIND, &["\"a.emit\"=\"admit\""]);
    assert_eq!(a, (0..20).collect::<Vec<_>>());
    assert!(b.is_empty());
    assert_eq!(u64_var(&sw, "module.s.a.tx_interrupted_total"), 20);
    assert_eq!(u64_var(&sw, "module.s.a.drop_interface_down_total"), 0);
    assert_eq!(u64_var(&sw, "module.s.drop_interface_down_total"), 0);
    assert_eq!(u64_var(&sw, "module.s.frames_dropped_total"), 0);
}

#[test]
fn the_emit_knob_takes_start_or_admit_only() {
    for kind in [LATE_KIND, EARLY_KIND] {
        let e = toml_error(kind, &["interfaces=[\"a\"]", "\"a.emit\"=\"bogus\""]);
        assert!(e.contains("a.emit") && e.contains("expected start or admit") && e.contains("bogus"), "{e}");
        assert!(toml_error(kind, &["interfaces=[\"a\"]", "\"a.emit\"=1"]).contains("a.emit"));
        let (mut sw, _, _) = stack(kind, &["\"b.emit\"=\"admit\""]);
        // The switch commits the edit and reports the module's refusal as a note.
        let notes = sw.apply(vec![knob("s", "a.emit", Value::Str("bogus".into()))]).unwrap();
        assert!(notes.len() == 1 && notes[0].contains("expected start or admit") && notes[0].contains("bogus"));
        assert_eq!(var(&sw, "module.s.a.emit"), Some(Value::Str("start".into())), "unchanged");
        assert_eq!(var(&sw, "module.s.b.emit"), Some(Value::Str("admit".into())));
        sw.apply(vec![knob("s", "a.emit", Value::Str("admit".into()))]).unwrap();
        assert_eq!(var(&sw, "module.s.a.emit"), Some(Value::Str("admit".into())));
    }
}

#[test]
fn switching_emit_live_hands_over_the_held_packets_or_holds_the_next_ones() {
    let (mut sw, la, _) = stack(LATE_KIND, &[RATE_8M, "\"a.device_queue\"=4"]);
    inject(&mut sw, ms(0), &(0..10).map(|i| udp(1, 1000, 0, i)).collect::<Vec<_>>(), None);
    assert_eq!(sent(&la), [(0, ms(0))], "start: packets 1-3 are held for their starts");
    // To admit: the three held packets go at the next call, in ring order; occupancy is unchanged.
    sw.apply(vec![knob("s", "a.emit", Value::Str("admit".into()))]).unwrap();
    sw.run(us(100));
    assert_eq!(sent(&la), [(1, us(100)), (2, us(100)), (3, us(100))]);
    assert_eq!(u64_var(&sw, "module.s.a.device_queue_len"), 4);
    assert_eq!(sw.next_wakeup(), Some(ms(1)), "the next wake-up is the first end");
    drain(&mut sw, ms(1));
    assert_eq!(sent(&la), [(4, ms(1))], "admitted as room frees, emitted at once");
    // Back to start: the packets in the ring stay emitted; the next one bound (at 2 ms) waits for its start, the
    // end of the last one in the ring (packet 4: 4 ms to 5 ms).
    sw.apply(vec![knob("s", "a.emit", Value::Str("start".into()))]).unwrap();
    sw.run(us(1500));
    assert!(sent(&la).is_empty());
    drain(&mut sw, ms(4) + Duration::from_micros(999));
    assert!(sent(&la).is_empty(), "packets 5-7 were bound at 2-4 ms and wait for their starts");
    drain(&mut sw, ms(100));
    let rest = sent(&la);
    assert_eq!(rest, (5..10).map(|i| (i, ms(u64::from(i)))).collect::<Vec<_>>());
}

/// The rate in Mbit/s (`rate_mbit`, as a lab link's `bw`) and by its old name in bit/s (`rate_bps`) is one rate:
/// the same schedule whichever name set it, as a setting or as a knob, both names showing it; and each old name used
/// is reported once to the catalog's alias hook, however often it is used.
#[test]
fn rate_mbit_and_its_old_name_rate_bps_give_the_same_schedule_and_the_old_name_warns_once() {
    let heard = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut catalog = catalog();
    let h = heard.clone();
    catalog.on_alias(move |old, new| h.lock().unwrap().push(format!("{old} -> {new}")));
    // Sends five 1000-byte packets (1 ms each at 8 Mbit/s) after an optional knob write: when `a` sent each, the
    // rate both names show, and whether the stack's description left the old name out.
    let schedule = |rate: &str, knob_write: Option<(&str, Value)>| {
        let mut sw = Switch::default();
        let (a, la) = recorder("a");
        let (b, _lb) = recorder("b");
        let settings = toml_settings(LATE_KIND, &["interfaces=[\"a\", \"b\"]", rate]);
        let builder = catalog.configure(LATE_KIND, &settings, None).unwrap();
        let load = flexstack_core::Edit::Load { name: "s".into(), kind: LATE_KIND.into(), settings, builder };
        sw.apply(vec![load, a, b, link("s[a] -> a"), link("s[b] -> b")]).unwrap();
        if let Some((name, value)) = knob_write {
            sw.apply(vec![knob("s", name, value)]).unwrap();
        }
        sw.run(Time::ZERO);
        inject(&mut sw, ms(0), &(0..5).map(|i| udp(1, 1000, 0, i)).collect::<Vec<_>>(), None);
        drain(&mut sw, ms(100));
        let shown = (var(&sw, "module.s.a.rate_mbit"), var(&sw, "module.s.a.rate_bps"));
        let described = sw.describe().modules[0].settings.clone();
        (sent(&la), shown, described.get("a.rate_bps").is_none())
    };
    let eight = (Some(Value::F64(8.0)), Some(Value::U64(8_000_000)));
    let by_mbit = schedule("\"a.rate_mbit\"=8", None);
    assert_eq!(by_mbit.0, (0..5).map(|i| (i, ms(u64::from(i)))).collect::<Vec<_>>());
    assert_eq!(by_mbit, (by_mbit.0.clone(), eight.clone(), true));
    assert_eq!(schedule(RATE_8M, None), by_mbit, "the old name sets the same rate; saved, it is the new name");
    assert_eq!(schedule(RATE_8M, None), by_mbit);
    assert_eq!(*heard.lock().unwrap(), ["a.rate_bps -> a.rate_mbit"], "once");

    // As knobs: 1 Mbit/s by either name, from 8.
    let one = (Some(Value::F64(1.0)), Some(Value::U64(1_000_000)));
    let by_mbit = schedule("\"a.rate_mbit\"=8", Some(("a.rate_mbit", Value::F64(1.0))));
    assert_eq!(by_mbit.0, (0..5).map(|i| (i, ms(8 * u64::from(i)))).collect::<Vec<_>>());
    assert_eq!(by_mbit.1, one);
    assert_eq!(schedule("\"a.rate_mbit\"=8", Some(("a.rate_bps", Value::U64(1_000_000)))), by_mbit);
    // Each old name is reported once: the knob `a.rate_bps` was reported as a setting; `b.rate_bps` is new.
    for _ in 0..2 {
        schedule("\"a.rate_mbit\"=8", Some(("b.rate_bps", Value::U64(1_000_000))));
    }
    assert_eq!(*heard.lock().unwrap(), ["a.rate_bps -> a.rate_mbit", "b.rate_bps -> b.rate_mbit"]);
}
