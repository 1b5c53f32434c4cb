#!/usr/bin/env python3
"""Reads the results folder of one handoff lab run (labs/handoff-*.toml) and prints a JSON summary per stacked
host (`late`, `early`). Standard library only.

    handoff_results.py RESULTS_DIR [--handoff 7.0]

Per host: the device queue (the knob as sampled), packets lost at the handoff below the binding point (the
scheduler's `wlan.drop_interface_down_total`, not yet started, plus `wlan.tx_interrupted_total`, emitted but cut
on the wire), what the wlan link's emulator dropped when it went down, retransmissions (TCP_INFO total_retrans)
in 0.3 s bins from 6 s before the handoff to 6 s after it, received throughput in 0.1 s bins (Mbit/s), the mean
throughput in the 2 s before the handoff and in the 1 s after it, and their ratio.

Clocks: the sinks (srv-1 for `late`, srv-2 for `early`) and the senders stamp CLOCK_MONOTONIC; the runner's
clock.txt gives the lab's 0 s on that clock, so every series is on the lab's time axis.
"""
import argparse
import csv
import json
import os
import sys

HOSTS = [("late", "srv-1", "lap1"), ("early", "srv-2", "eap1")]
BIN_RETX = 0.3
BIN_TPUT = 0.1


def meters(path):
    """{name: [(t, value)]} from meters.csv."""
    out = {}
    with open(path) as f:
        for row in csv.DictReader(f):
            out.setdefault(row["name"], []).append((float(row["time_s"]), float(row["value"])))
    return out


def last(series, default=None):
    return series[-1][1] if series else default


def sink(path):
    """(start mono, [(bin end mono, bytes)])."""
    start, bins = None, []
    with open(path) as f:
        for line in f:
            a, b = line.strip().split(",")
            if a == "start":
                start = float(b)
            else:
                bins.append((float(a), int(b)))
    return start, bins


def sender(path):
    rows = []
    with open(path) as f:
        for row in csv.DictReader(f):
            rows.append({k: float(v) for k, v in row.items()})
    return rows


def held_before(m, lb, handoff):
    """wlan.queue_len + wlan.device_queue_len in the last meter sample before `handoff` (None: not sampled)."""
    def before(name):
        v = [x for t, x in m.get(lb + name, []) if t < handoff]
        return v[-1] if v else None
    fifo, dev = before("wlan.queue_len"), before("wlan.device_queue_len")
    return None if fifo is None or dev is None else fifo + dev


def summarize(results, handoff):
    m = meters(os.path.join(results, "meters.csv"))
    prog = os.path.join(results, "programs")
    out = {}
    for host, sink_prog, ap in HOSTS:
        lb = f"host.{host}.module.{host}-1-lb."
        if not os.path.exists(os.path.join(prog, f"{host}-1.out")):
            continue
        origin, bins = sink(os.path.join(prog, f"{sink_prog}.out"))
        clock = os.path.join(results, "clock.txt")
        if os.path.exists(clock):  # the lab's 0 s, written by the runner
            origin = float(open(clock).read().split()[1])
        tput = [(round(t - origin, 3), b * 8 / BIN_TPUT / 1e6) for t, b in bins]
        snd = sender(os.path.join(prog, f"{host}-1.out"))
        # Retransmissions per 0.3 s bin around the handoff: the counter's value at each bin edge.
        edges = [handoff + BIN_RETX * k for k in range(-20, 21)]
        def retrans_at(t):
            v = 0
            for r in snd:
                if r["mono_s"] - origin > t:
                    break
                v = r["total_retrans"]
            return v
        at = [retrans_at(e) for e in edges]
        retx = [(round(edges[i] - handoff, 3), at[i + 1] - at[i]) for i in range(len(edges) - 1)]

        def mean(a, b):
            v = [x for t, x in tput if a < t <= b + 1e-9]
            return sum(v) / len(v) if v else 0.0
        pre, post = mean(handoff - 2.0, handoff), mean(handoff, handoff + 1.0)
        flow_rtt = [r["rtt_us"] for r in snd if handoff - 2.0 < r["mono_s"] - origin <= handoff]
        out[host] = {
            "device_queue": last(m.get(lb + "wlan.device_queue", [])),
            "lost_not_started": last(m.get(lb + "wlan.drop_interface_down_total", []), 0),
            "lost_in_transmission": last(m.get(lb + "wlan.tx_interrupted_total", []), 0),
            "link_dropped_at_down": last(m.get(f"link.{host}-{ap}.ab.drop_down_total", []), 0),
            "queued_before_handoff": max((v for t, v in m.get(lb + "queued", []) if handoff - 0.3 <= t < handoff),
                                         default=None),
            # Below the binding point in the last sample before the handoff: early binding's FIFO (queue_len) and,
            # for both, the device queue; what early binding can be expected to lose.
            "held_below_binding_point_before_handoff": held_before(m, lb, handoff),
            "retransmissions_after_handoff": retrans_at(handoff + 3.0) - retrans_at(handoff),
            "retransmissions_total": snd[-1]["total_retrans"] if snd else None,
            "srtt_ms_before_handoff": (sum(flow_rtt) / len(flow_rtt) / 1000) if flow_rtt else None,
            "throughput_before_mbit": pre,
            "throughput_after_mbit": post,
            "throughput_ratio": post / pre if pre else None,
            "retransmissions_bins": retx,
            "throughput_bins": tput,
        }
        out[host]["lost_below_binding_point"] = out[host]["lost_not_started"] + out[host]["lost_in_transmission"]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results")
    ap.add_argument("--handoff", type=float, default=7.0, help="lab time of the handoff, s")
    args = ap.parse_args()
    s = summarize(args.results, args.handoff)
    if not s:
        sys.exit(f"{args.results}: no handoff programs found")
    json.dump(s, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
