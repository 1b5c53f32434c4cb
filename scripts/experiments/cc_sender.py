#!/usr/bin/env python3
"""Bulk TCP sender of the adaptive congestion-control lab (CRAWLER's TCP use case, docs/experiments/cc-adaptive.md).
Standard library plus flexstack's application module (clients/python/flexstack_app.py).

It sends as fast as TCP lets it to HOST:PORT for --duration seconds and, every --every seconds, reads the kernel's
TCP_INFO and publishes what it measured as application variables of the flexstack daemon at $FLEXSTACK_STATE_DIR
(the lab runner sets it), under `app.<--app>.`:

- `retrans_rate` (f64, %): bytes retransmitted / bytes sent during the last interval;
- `loss` (f64, %): the same ratio over the last --window seconds (the loss a rule acts on);
- `goodput_mbit` (f64, Mbit/s): bytes acknowledged during the last interval;
- `cc_bbr` (bool): whether the socket now uses bbr (a number, so the lab samples it into meters.csv);
- with --knob: the knob `cc` (str), whose callback applies setsockopt(TCP_CONGESTION) to the socket, so a rule's
  `set("app.<name>.cc", "bbr")` switches the running connection's congestion control. Names other than reno,
  cubic and bbr are refused (the writer sees the refusal).

Output (stdout), CSV with a header: `kind,mono_s,cc,bytes_sent,bytes_retrans,bytes_acked,retrans_pct,loss_pct,
rtt_us,cwnd` where kind is `sample` (every interval) or `switch` (the knob changed cc; bytes_* are then empty and
`cc` is the new algorithm). mono_s is CLOCK_MONOTONIC, the clock of the lab's clock.txt and of tcp_sink.py.

    cc_sender.py HOST PORT --duration 60 --cc cubic --app adaptive [--knob] [--every 0.1] [--window 1.0] [--no-app]
"""
import argparse
import collections
import os
import socket
import struct
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "..", "clients", "python")]
from flexstack_app import App, Refused  # noqa: E402
from tcp_bulk import U32_FIELDS  # noqa: E402
from tcpcc import connect, sender_socket, set_congestion_control  # noqa: E402

ALGORITHMS = ("reno", "cubic", "bbr")

# struct tcp_info (linux/tcp.h): 8 one-byte fields, the 24 32-bit fields tcp_bulk.py reads (U32_FIELDS), then
# (offset 104) the 64-bit counters pacing_rate, max_pacing_rate, bytes_acked, bytes_received, six 32-bit fields
# (segs_out ... data_segs_out), delivery_rate, busy_time, rwnd_limited, sndbuf_limited, two 32-bit fields
# (delivered, delivered_ce), bytes_sent, bytes_retrans (kernel >= 4.19).
TAIL = struct.Struct("<4Q6I4Q2I2Q")
TAIL_FIELDS = ["pacing_rate", "max_pacing_rate", "bytes_acked", "bytes_received", "segs_out", "segs_in",
               "notsent_bytes", "min_rtt", "data_segs_in", "data_segs_out", "delivery_rate", "busy_time",
               "rwnd_limited", "sndbuf_limited", "delivered", "delivered_ce", "bytes_sent", "bytes_retrans"]
HEAD_LEN = 8 + 4 * len(U32_FIELDS)


def tcp_info(sock):
    """The fields of TCP_INFO named above, as a dict."""
    raw = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, HEAD_LEN + TAIL.size)
    if len(raw) < HEAD_LEN + TAIL.size:
        raise OSError("TCP_INFO too short (%d bytes): this kernel has no bytes_sent/bytes_retrans" % len(raw))
    info = dict(zip(U32_FIELDS, struct.unpack_from("<%dI" % len(U32_FIELDS), raw, 8)))
    info.update(zip(TAIL_FIELDS, TAIL.unpack_from(raw, HEAD_LEN)))
    return info


def current_cc(sock):
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).split(b"\0")[0].decode()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("host")
    ap.add_argument("port", type=int)
    ap.add_argument("--duration", type=float, required=True, help="seconds of sending")
    ap.add_argument("--cc", default="cubic", choices=ALGORITHMS, help="initial congestion control")
    ap.add_argument("--app", default="sender", help="application name: variables are app.<name>.*")
    ap.add_argument("--knob", action="store_true", help="register the knob app.<name>.cc (else cc stays fixed)")
    ap.add_argument("--every", type=float, default=0.1, help="TCP_INFO sampling and publishing period, seconds")
    ap.add_argument("--window", type=float, default=1.0, help="seconds over which `loss` is measured")
    ap.add_argument("--no-app", action="store_true", help="publish nothing (no flexstack daemon needed)")
    args = ap.parse_args()

    sock = sender_socket(args.cc, "cc_sender")
    out = sys.stdout
    out.write("kind,mono_s,cc,bytes_sent,bytes_retrans,bytes_acked,retrans_pct,loss_pct,rtt_us,cwnd\n")
    lock = threading.Lock()  # the knob callback and the sampler both write `out`

    def on_cc(_name, value):
        if value not in ALGORITHMS:
            raise Refused("unknown congestion control %r: expected one of %s" % (value, ", ".join(ALGORITHMS)))
        try:
            set_congestion_control(sock, value)
        except OSError as e:
            raise Refused(e.strerror)
        with lock:
            out.write("switch,%.6f,%s,,,,,,,\n" % (time.monotonic(), value))
            out.flush()

    app = None
    if not args.no_app:
        app = App()
        for name, unit, what in [("retrans_rate", "%", "bytes retransmitted / sent, last interval"),
                                 ("loss", "%", "bytes retransmitted / sent over the window"),
                                 ("goodput_mbit", "Mbit/s", "bytes acknowledged, last interval")]:
            app.meter(name, "f64", unit, what)
        app.meter("cc_bbr", "bool", "", "the socket uses bbr")
        if args.knob:
            app.knob("cc", "str", args.cc, on_cc, "", "congestion control of the socket (reno, cubic, bbr)")
        app.register(args.app)

    connect(sock, args.host, args.port, "cc_sender")
    stop = threading.Event()
    failure = []

    def pump():
        chunk = b"\0" * 65536
        try:
            while not stop.is_set():
                sock.send(chunk)
        except OSError as e:
            if not stop.is_set():
                failure.append(e)

    sender = threading.Thread(target=pump, daemon=True)
    sender.start()
    keep = max(1, round(args.window / args.every))
    recent = collections.deque(maxlen=keep)  # (d_sent, d_retrans) per interval
    last = tcp_info(sock)
    end = time.monotonic() + args.duration
    next_sample = time.monotonic() + args.every
    while time.monotonic() < end and not failure:
        if app is not None:
            app.poll(max(0.0, next_sample - time.monotonic()))
        else:
            time.sleep(max(0.0, next_sample - time.monotonic()))
        if time.monotonic() < next_sample:
            continue
        next_sample += args.every
        info = tcp_info(sock)
        d_sent = info["bytes_sent"] - last["bytes_sent"]
        d_retrans = info["bytes_retrans"] - last["bytes_retrans"]
        d_acked = info["bytes_acked"] - last["bytes_acked"]
        last = info
        recent.append((d_sent, d_retrans))
        retrans_pct = 100.0 * d_retrans / d_sent if d_sent else 0.0
        window_sent = sum(s for s, _ in recent)
        loss_pct = 100.0 * sum(r for _, r in recent) / window_sent if window_sent else 0.0
        cc = current_cc(sock)
        with lock:
            out.write("sample,%.6f,%s,%d,%d,%d,%.4f,%.4f,%d,%d\n" % (
                time.monotonic(), cc, info["bytes_sent"], info["bytes_retrans"], info["bytes_acked"], retrans_pct,
                loss_pct, info["rtt"], info["snd_cwnd"]))
            out.flush()
        if app is not None:
            app.update("retrans_rate", round(retrans_pct, 4))
            app.update("loss", round(loss_pct, 4))
            app.update("goodput_mbit", round(d_acked * 8 / args.every / 1e6, 4))
            app.update("cc_bbr", cc == "bbr")
    stop.set()
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
    if app is not None:
        app.close()
    if failure:
        sys.exit(f"cc_sender: sending failed: {failure[0]}")


if __name__ == "__main__":
    main()
