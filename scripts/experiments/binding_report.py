#!/usr/bin/env python3
"""Writes docs/experiments/late-binding.md and its SVG plots from the lab runs of scripts/experiment-binding.sh.
Standard library only (the SVG is written by hand).

    binding_report.py WORK OUT --command "the command that regenerates it"

WORK holds handoff-b<B>-s<S>/summary.json (scripts/experiments/handoff_results.py) and urgent-b<B>/programs/
{lr1-1,er1-1}.out (scripts/experiments/udp_urgent.py recv); OUT gets late-binding.md, fig4-retransmissions.svg,
fig4-lost.svg, fig5-throughput.svg and fig7-urgent-cdf.svg.
"""
import argparse
import csv
import glob
import json
import math
import os
import re
import statistics

# The urgent-packet labs' wlan rate (labs/urgent-b*.toml, bw = 20) and one 1428-byte packet's transmission time
# there with the 38 bytes of Ethernet overhead the stack templates model.
URGENT_RATE_BPS = 20e6
PACKET_MS = (1428 + 38) * 8 / URGENT_RATE_BPS * 1000
COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"]


def esc(s):
    return str(s).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def nice_ticks(lo, hi, n=6):
    if hi <= lo:
        hi = lo + 1
    step = 10 ** math.floor(math.log10((hi - lo) / n))
    for m in (1, 2, 5, 10):
        if (hi - lo) / (step * m) <= n:
            step *= m
            break
    t = math.floor(lo / step) * step
    out = []
    while t <= hi + 1e-9:
        out.append(round(t, 10))
        t += step
    return out


def line_plot(path, title, xlabel, ylabel, series, logx=False, vline=None, step=False, floor=1e-9):
    """series: [(label, [(x, y)], dashed)]. Writes an SVG of 760 x 420. With logx, x values below `floor` are
    drawn at `floor`."""
    W, H, L, R, T, B = 760, 420, 70, 200, 40, 50
    xs = [x for _, pts, _ in series for x, _ in pts]
    ys = [y for _, pts, _ in series for _, y in pts]
    if not xs:
        xs, ys = [0, 1], [0, 1]
    fx = (lambda v: math.log10(max(v, floor))) if logx else (lambda v: v)
    x0, x1 = min(fx(x) for x in xs), max(fx(x) for x in xs)
    if logx:
        x0, x1 = math.floor(x0), math.ceil(x1)
    y0, y1 = 0.0, max(ys) * 1.05 if max(ys) > 0 else 1.0
    px = lambda v: L + (fx(v) - x0) / ((x1 - x0) or 1) * (W - L - R)
    py = lambda v: H - B - (v - y0) / ((y1 - y0) or 1) * (H - T - B)
    o = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
         f'<rect width="{W}" height="{H}" fill="white"/>',
         f'<text x="{W / 2 - R / 2}" y="22" text-anchor="middle" font-size="15">{esc(title)}</text>']
    for t in nice_ticks(y0, y1):
        if t > y1:
            continue
        o.append(f'<line x1="{L}" x2="{W - R}" y1="{py(t):.1f}" y2="{py(t):.1f}" stroke="#ddd"/>')
        o.append(f'<text x="{L - 6}" y="{py(t) + 4:.1f}" text-anchor="end">{t:g}</text>')
    xt = [10 ** e for e in range(int(x0), int(x1) + 1)] if logx else nice_ticks(x0, x1)
    for t in xt:
        o.append(f'<line x1="{px(t):.1f}" x2="{px(t):.1f}" y1="{T}" y2="{H - B}" stroke="#eee"/>')
        o.append(f'<text x="{px(t):.1f}" y="{H - B + 16}" text-anchor="middle">{t:g}</text>')
    o.append(f'<rect x="{L}" y="{T}" width="{W - L - R}" height="{H - T - B}" fill="none" stroke="#333"/>')
    o.append(f'<text x="{(L + W - R) / 2}" y="{H - 12}" text-anchor="middle">{esc(xlabel)}</text>')
    o.append(f'<text transform="translate(18,{(T + H - B) / 2}) rotate(-90)" text-anchor="middle">{esc(ylabel)}</text>')
    if vline is not None:
        o.append(f'<line x1="{px(vline[0]):.1f}" x2="{px(vline[0]):.1f}" y1="{T}" y2="{H - B}" stroke="#888" '
                 f'stroke-dasharray="4,3"/><text x="{px(vline[0]) + 4:.1f}" y="{T + 14}" fill="#555">'
                 f'{esc(vline[1])}</text>')
    for i, (label, pts, dashed) in enumerate(series):
        c = COLORS[i % len(COLORS)]
        coords = []
        for j, (x, y) in enumerate(pts):
            if step and j > 0:
                coords.append(f"{px(x):.1f},{py(pts[j - 1][1]):.1f}")
            coords.append(f"{px(x):.1f},{py(y):.1f}")
        dash = ' stroke-dasharray="6,3"' if dashed else ""
        o.append(f'<polyline fill="none" stroke="{c}" stroke-width="1.8"{dash} points="{" ".join(coords)}"/>')
        ly = T + 10 + i * 18
        o.append(f'<line x1="{W - R + 12}" x2="{W - R + 36}" y1="{ly}" y2="{ly}" stroke="{c}" stroke-width="2"{dash}/>')
        o.append(f'<text x="{W - R + 42}" y="{ly + 4}">{esc(label)}</text>')
    o.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(o) + "\n")


def bar_plot(path, title, ylabel, bars):
    """bars: [(label, mean, sd, color index)]; a log-free bar chart with error bars."""
    W, H, L, T, B = 760, 380, 70, 40, 70
    top = max((m + s for _, m, s, _ in bars), default=1) * 1.1 or 1
    bw = (W - L - 20) / max(len(bars), 1)
    py = lambda v: H - B - v / top * (H - T - B)
    o = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
         f'<rect width="{W}" height="{H}" fill="white"/>',
         f'<text x="{W / 2}" y="22" text-anchor="middle" font-size="15">{esc(title)}</text>']
    for t in nice_ticks(0, top):
        if t <= top:
            o.append(f'<line x1="{L}" x2="{W - 20}" y1="{py(t):.1f}" y2="{py(t):.1f}" stroke="#ddd"/>'
                     f'<text x="{L - 6}" y="{py(t) + 4:.1f}" text-anchor="end">{t:g}</text>')
    for i, (label, m, s, ci) in enumerate(bars):
        x = L + i * bw + bw * 0.15
        o.append(f'<rect x="{x:.1f}" y="{py(m):.1f}" width="{bw * 0.7:.1f}" height="{py(0) - py(m):.1f}" '
                 f'fill="{COLORS[ci % len(COLORS)]}"/>')
        cx = x + bw * 0.35
        o.append(f'<line x1="{cx:.1f}" x2="{cx:.1f}" y1="{py(max(m - s, 0)):.1f}" y2="{py(m + s):.1f}" stroke="#000"/>')
        o.append(f'<text x="{cx:.1f}" y="{py(m) - 5:.1f}" text-anchor="middle">{m:.1f}</text>')
        o.append(f'<text x="{cx:.1f}" y="{H - B + 16}" text-anchor="middle">{esc(label)}</text>')
    o.append(f'<text transform="translate(18,{(T + H - B) / 2}) rotate(-90)" text-anchor="middle">{esc(ylabel)}</text>')
    o.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(o) + "\n")


def mean_sd(v):
    v = [x for x in v if x is not None]
    if not v:
        return (float("nan"), 0.0)
    return (statistics.mean(v), statistics.stdev(v) if len(v) > 1 else 0.0)


def mean_series(runs, key):
    """Averages [(x, y)] lists point by point (same x grid, up to the shortest)."""
    n = min(len(r[key]) for r in runs)
    return [(runs[0][key][i][0], statistics.mean(r[key][i][1] for r in runs)) for i in range(n)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("work")
    ap.add_argument("out")
    ap.add_argument("--command", required=True)
    ap.add_argument("--load", help="the machine's load while the labs ran, as text for the page")
    args = ap.parse_args()
    handoff = {}  # (mode, buffer) -> [summary]
    for p in sorted(glob.glob(os.path.join(args.work, "handoff-b*-s*/summary.json"))):
        b = int(re.search(r"handoff-b(\d+)-s", p).group(1))
        for mode, s in json.load(open(p)).items():
            handoff.setdefault((mode, b), []).append(s)
    urgent = {}  # (mode, buffer) -> [delay ms or None]
    for d in sorted(glob.glob(os.path.join(args.work, "urgent-b*"))):
        if not os.path.isdir(d):
            continue
        b = int(re.search(r"urgent-b(\d+)", d).group(1))
        for mode, prog in (("late", "lr1-1"), ("early", "er1-1")):
            f = os.path.join(d, "programs", prog + ".out")
            if os.path.exists(f):
                with open(f) as fh:
                    urgent[(mode, b)] = [(float(r["delay_ms"]), float(r["queue_delay_ms"])) if r["delay_ms"] else None
                                         for r in csv.DictReader(fh)]
    buffers = sorted({b for _, b in list(handoff) + list(urgent)}, reverse=True)
    modes = ["late", "early"]
    md = ["# Late binding in emulated labs: handoff without loss, urgent packets first", "",
          "Reproduces the experiments of the late-binding paper (Figures 4, 5 and 7) with flexstack's "
          "`late-binding` and `early-binding` modules (docs/binding.md) in lab runs (labs/handoff-b*.toml, "
          "labs/urgent-b*.toml; stack templates stacks/lab-late-binding.toml and stacks/lab-early-binding.toml).",
          "", "Regenerate (root, ~13 min with the defaults):", "", "```sh", args.command, "```", ""]
    if args.load:
        md += [f"Machine: {args.load}", ""]
    # ---------------- handoff
    if handoff:
        seeds = max(len(v) for v in handoff.values())
        md += ["## Handoff (Figures 4 and 5)", "",
               "A bulk TCP CUBIC flow (python sender, kernel TCP in the app's sandbox) from a stacked host with two "
               "uplinks, wlan and lte (5 Mbit/s, 2 ms each, then 48 ms to the server: base RTT 100 ms), starts at "
               "1 s over wlan; at 7 s wlan's link goes down, a pulled cable: the host's eth0 loses its carrier, "
               "the daemon's link watcher sees it and the scheduler's wlan interface, which names that face "
               "(`wlan.face`), goes down with it; the flow continues over lte. ACKs come back over lte throughout. "
               "`late` and "
               "`early` run side by side in the same lab run, with the same device buffer below the binding point "
               f"(knob events at 0.6 s); {seeds} seeded runs per buffer size. The sender fills whatever buffering "
               "it is given (kernel socket-buffer autotuning): above the binding point (late: per-flow queues, "
               "limit 1000) or in the interface's FIFO (early: 1000 + device buffer), so the RTT under load is "
               "several hundred ms (column srtt).", "",
               "Columns: **lost below BP** = the scheduler's `wlan.drop_interface_down_total` (not yet started) + "
               "`wlan.tx_interrupted_total` (in modelled transmission), the packets early or late binding itself "
               "lost; **link drop** = frames the wlan link's emulator held (its wire queue and 2 ms of propagation) "
               "and dropped when the link went down, lost in both modes alike; **retx 3 s** = TCP retransmissions "
               "(TCP_INFO total_retrans) in the 3 s after the handoff; **tput before** = received throughput in the "
               "2 s before, **after** = in the 1 s after, **ratio** = after / before. Mean ± sd over the runs; "
               "**max lost** = the worst run.", "",
               "| binding | device buffer | runs | lost below BP | max lost | link drop | retx 3 s | srtt before (ms) "
               "| tput before (Mbit/s) | tput after (Mbit/s) | ratio | min ratio |",
               "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for b in buffers:
            for mode in modes:
                runs = handoff.get((mode, b))
                if not runs:
                    continue
                f = lambda k: mean_sd([r[k] for r in runs])
                lost, link, retx = f("lost_below_binding_point"), f("link_dropped_at_down"), \
                    f("retransmissions_after_handoff")
                rtt, pre, post, ratio = f("srtt_ms_before_handoff"), f("throughput_before_mbit"), \
                    f("throughput_after_mbit"), f("throughput_ratio")
                md.append(f"| {mode} | {b} | {len(runs)} | {lost[0]:.1f} ± {lost[1]:.1f} | "
                          f"{max(r['lost_below_binding_point'] for r in runs):.0f} | {link[0]:.1f} | "
                          f"{retx[0]:.1f} ± {retx[1]:.1f} | {rtt[0]:.0f} | {pre[0]:.2f} | {post[0]:.2f} | "
                          f"{ratio[0]:.2f} | {min(r['throughput_ratio'] or 0 for r in runs):.2f} |")
        md.append("")
        line_plot(os.path.join(args.out, "fig4-retransmissions.svg"),
                  "TCP retransmissions per 0.3 s around the handoff (mean over runs)",
                  "time since wlan went down (s)", "retransmissions per 0.3 s",
                  [(f"{m} binding, {b} pkt", mean_series(handoff[(m, b)], "retransmissions_bins"), m == "early")
                   for b in buffers for m in modes if (m, b) in handoff], vline=(0, "wlan down"), step=True)
        bars = []
        for i, b in enumerate(buffers):
            for m in modes:
                if (m, b) in handoff:
                    mu, sd = mean_sd([r["lost_below_binding_point"] for r in handoff[(m, b)]])
                    bars.append((f"{m} {b}", mu, sd, 0 if m == "late" else 1))
        bar_plot(os.path.join(args.out, "fig4-lost.svg"),
                 "Packets lost below the binding point at the handoff (mean ± sd)", "packets", bars)
        line_plot(os.path.join(args.out, "fig5-throughput.svg"),
                  "Received throughput, 0.1 s bins (mean over runs)", "lab time (s)", "Mbit/s",
                  [(f"{m} binding, {b} pkt", [(t, y) for t, y in mean_series(handoff[(m, b)], "throughput_bins")
                                               if 4 <= t <= 11], m == "early")
                   for b in buffers for m in modes if (m, b) in handoff], vline=(7.0, "wlan down"))
        md += ["![retransmissions](fig4-retransmissions.svg)", "", "![lost](fig4-lost.svg)", "",
               "![throughput](fig5-throughput.svg)", ""]
    # ---------------- urgent
    if urgent:
        md += ["## Urgent packets (Figure 7)", "",
               "Per repetition the sender (an app on the stacked host) sends a marker packet, a burst of 1,000 bulk "
               "UDP packets (1428 bytes each) and one urgent packet (DSCP EF); the receiver on the other end of "
               f"the wlan link ({URGENT_RATE_BPS / 1e6:.0f} Mbit/s, 2 ms) timestamps them in the kernel (SO_TIMESTAMPNS) and reports the "
               "marker-to-urgent delay; 50 repetitions 1.6 s apart in one lab run, `late` and `early` side by "
               "side. The python sender needs tens of ms to hand the burst to its socket (the kernel in the "
               "paper's setup: about 1 ms), so the urgent packet carries the sender's own marker-to-urgent time "
               "and the receiver subtracts it: **queue delay** = received delay - sender's gap, the delay the "
               "stack and the link added; **raw** = the received delay itself. A packet of 1428 bytes takes "
               f"{PACKET_MS:.3f} ms at {URGENT_RATE_BPS / 1e6:.0f} Mbit/s with the modelled 38 bytes of Ethernet "
               f"overhead; **bound** = 1 ms + (device buffer + 1) x {PACKET_MS:.3f} ms (the packets in the modelled "
               "device queue, the one on the wire included, and one more the emulated link may still be "
               "sending); the acceptance target for late binding is a median queue delay within it. Queue delays "
               "below 0 are the measurement's noise: the sender, the daemons and the receivers share the "
               "machine's cores while the burst is written, so the marker itself can reach the receiver a few ms "
               "late, which shortens the measured marker-to-urgent time.", "",
               "| binding | device buffer | repetitions | urgent received | median queue delay (ms) | p10 | p90 "
               "| max | median raw (ms) | bound (ms) |",
               "|---|---|---|---|---|---|---|---|---|---|"]
        series = []
        for b in buffers:
            for mode in modes:
                d = urgent.get((mode, b))
                if d is None:
                    continue
                got = sorted(x[1] for x in d if x is not None)
                raw = sorted(x[0] for x in d if x is not None)
                q = lambda p: got[min(len(got) - 1, int(p * len(got)))] if got else float("nan")
                med = statistics.median(got) if got else float("nan")
                bound = 1 + (b + 1) * PACKET_MS
                md.append(f"| {mode} | {b} | {len(d)} | {len(got)} | {med:.2f} | {q(0.1):.2f} | {q(0.9):.2f} | "
                          f"{(got[-1] if got else float('nan')):.2f} | "
                          f"{(statistics.median(raw) if raw else float('nan')):.2f} | {bound:.2f} |")
                if got:
                    series.append((f"{mode} binding, {b} pkt",
                                   [(x, (i + 1) / len(got)) for i, x in enumerate(got)], mode == "early"))
        md.append("")
        line_plot(os.path.join(args.out, "fig7-urgent-cdf.svg"), "CDF of the urgent packet's queue delay (marker to urgent)",
                  "queue delay (ms, log scale; 0.1 ms and less drawn at 0.1)", "fraction of repetitions", series,
                  logx=True, step=True, floor=0.1)
        md += ["![urgent CDF](fig7-urgent-cdf.svg)", ""]
    md += ["## How it is measured", "",
           "- scripts/experiment-binding.sh copies each lab file with a unique name and a seed, runs it with "
           "`flexstack lab run`, and keeps every results folder (meters.csv, timeline.csv, programs/*.out).",
           "- scripts/experiments/handoff_results.py: drop counters from the scheduler's meters (sampled every "
           "100 ms), retransmissions from the sender's TCP_INFO samples (every 10 ms), throughput from the sink's "
           "byte counts (0.1 s bins); all on CLOCK_MONOTONIC, put on the lab's time axis with the runner's "
           "clock.txt.",
           "- scripts/experiments/udp_urgent.py: sender and receiver of the urgent-packet experiment.",
           "- scripts/experiments/binding_report.py: this page and its plots.", ""]
    with open(os.path.join(args.out, "late-binding.md"), "w") as f:
        f.write("\n".join(md))


if __name__ == "__main__":
    main()
