//! The stream endpoints end to end, with simulated time (docs/streams.md): an app-side smoltcp host, `terminate`,
//! stream modules, `originate` and a server-side smoltcp host (see `streamkit`). Each test runs over IPv4 and IPv6.

mod streamkit;
use streamkit::*;

const MB2: usize = 2 * 1024 * 1024;

#[test]
fn transfers_2mb_both_ways_intact() {
    for v6 in [false, true] {
        let mut lab = Lab::new(v6, &[], &[], &[("p", "stream-pass", vec![])]);
        let srv = lab.listen(80, 65536);
        let cli = lab.connect(80, 65536);
        let mut c = Pump::new(pattern(1, MB2), true);
        let mut s = Pump::new(pattern(2, MB2), true);
        let done = lab.until(60_000, |lab| {
            c.drive(lab.app.tcp(cli));
            s.drive(lab.server.tcp(srv));
            c.got.len() == MB2 && s.got.len() == MB2
        });
        assert!(done, "v6 {v6}: client got {} server got {}", c.got.len(), s.got.len());
        assert!(c.got == pattern(2, MB2), "the server's bytes reach the client intact");
        assert!(s.got == pattern(1, MB2), "the client's bytes reach the server intact");
        assert_eq!(lab.meter("module.p.data_bytes_down_total"), MB2 as u64);
        assert_eq!(lab.meter("module.p.data_bytes_up_total"), MB2 as u64);
        assert_eq!(lab.meter("module.t.data_bytes_out_total"), MB2 as u64);
        assert_eq!(lab.meter("module.o.data_bytes_in_total"), MB2 as u64);
        // Both close: after TIME-WAIT nothing is left.
        lab.run(12_000);
        assert_eq!(lab.meter("module.t.connections_active"), 0, "v6 {v6}");
        assert_eq!(lab.meter("module.o.connections_active"), 0);
        assert_eq!(lab.meter("module.t.aborts_sent_total") + lab.meter("module.o.aborts_sent_total"), 0);
        assert_eq!(lab.meter("module.t.stream_bad_total") + lab.meter("module.o.stream_bad_total"), 0);
        assert!(lab.passed().is_empty() && lab.net_passed().is_empty());
    }
}
