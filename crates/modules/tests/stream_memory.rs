//! Memory of idle terminated connections, measured: 1,000 connections through `terminate` and `originate` with the
//! buffers of stacks/app-terminate.toml (256 KiB receive and send buffers per socket), each after a small request
//! and answer, then idle. The process's resident memory grows by the endpoints' state plus the pages of their
//! buffers the bytes touched (a ring buffer restarts at its beginning whenever it empties, so an idle connection
//! that only ever held small messages touches one page of each), plus the test's own hosts. As in the daemon, the
//! endpoints run on a thread of their own, after a large block was freed (which raises glibc's own threshold for
//! fresh mappings above the buffers' size). What this cannot show: in a fresh process glibc's heap is fresh too, so
//! buffers from it would stay lazy here even without the endpoint's fixed threshold; in the daemon, where heap
//! memory is reused, they were resident in full (scripts/bench-flows.sh, 10,000 idle connections: 0.7-2.2 GiB
//! before the fix, 0.4 GiB after). Alone in its file, so that no other test's memory is counted. docs/streams.md, "Memory", has the
//! numbers.

mod streamkit;
use streamkit::*;

/// Resident memory of this process, in bytes (Linux).
fn rss() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * 4096)
}

#[test]
fn idle_connections_cost_little_resident_memory() {
    std::thread::spawn(idle_connections).join().expect("the measuring thread");
}

fn idle_connections() {
    let n = 1000;
    // A large block freed: glibc would now serve blocks of up to its size from the heap.
    drop(std::hint::black_box(vec![1u8; 4 << 20]));
    let big = ["rx_buffer=262144", "tx_buffer=262144"];
    let mut lab = Lab::new(false, &big, &big, &[]);
    lab.step();
    let Some(before) = rss() else { return };
    let srv: Vec<_> = (0..n).map(|_| lab.listen(80, 1024)).collect();
    let cli: Vec<_> = (0..n).map(|_| lab.connect(80, 1024)).collect();
    let mut c: Vec<Pump> = (0..n).map(|i| Pump::new(pattern(i as u64, 200), false)).collect();
    let mut s: Vec<Pump> = (0..n).map(|i| Pump::new(pattern(i as u64 + 7, 500), false)).collect();
    assert!(lab.until(5_000, |lab| {
        for i in 0..n {
            c[i].drive(lab.app.tcp(cli[i]));
            s[i].drive(lab.server.tcp(srv[i]));
        }
        c.iter().all(|p| p.got.len() == 500) && s.iter().all(|p| p.got.len() == 200)
    }));
    lab.run(100);
    assert_eq!(lab.meter("module.t.connections_active"), n as u64);
    assert_eq!(lab.meter("module.o.connections_active"), n as u64);
    let after = rss().unwrap();
    let per = after.saturating_sub(before) / n as u64;
    let slots = lab.sw.pool().stats().peak;
    println!("resident memory per idle terminated connection (both endpoints and the test's hosts): {per} bytes");
    println!(
        "pool slots at most: {slots} (each up to one page resident, ~{} bytes per connection)",
        slots * 4096 / n as u64
    );
    // Both endpoints' sockets reserve 4 x 256 KiB; resident is far less while connections are idle.
    assert!(per < 96 * 1024, "{per} bytes per idle connection");
}
