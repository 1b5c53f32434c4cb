#!/usr/bin/env python3
"""The urgent-packet experiment (late-binding paper, Figure 7), both ends. Standard library only.

    udp_urgent.py send HOST PORT [--reps 50] [--burst 1000] [--size 1400] [--gap 0.8]
    udp_urgent.py recv PORT --reps 50 [--timeout 60]

`send`: per repetition, a marker packet, a burst of --burst bulk packets (DSCP 0), then one urgent packet (DSCP
EF, 46), all UDP of --size bytes of payload, as fast as the socket takes them; then --gap seconds of quiet so the
burst drains before the next repetition. `recv`: timestamps every packet in the kernel (SO_TIMESTAMPNS) and prints
CSV `rep,marker_s,urgent_s,delay_ms,send_gap_ms,queue_delay_ms,bulk_before_urgent,bulk_received` per repetition,
after --reps repetitions or --timeout seconds: delay_ms is marker to urgent at the receiver, send_gap_ms how long
the sender took from sending the marker to sending the urgent packet (carried in the urgent packet), and
queue_delay_ms = delay_ms - send_gap_ms, the extra delay the urgent packet met in the stack and the link (empty
when the marker or the urgent packet was lost).
"""
import argparse
import socket
import struct
import sys
import time

MARKER, BULK, URGENT = 0, 1, 2
EF_TOS = 46 << 2
# Linux's SO_TIMESTAMPNS (asm-generic/socket.h); older Pythons do not name it.
SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)


def send(args):
    bulk = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    urgent = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    urgent.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, EF_TOS)
    for s in (bulk, urgent):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
    dest = (args.host, args.port)
    pad = b"\0" * (args.size - 9)
    for rep in range(args.reps):
        t0 = time.monotonic_ns()
        bulk.sendto(struct.pack("!IBI", rep, MARKER, 0) + pad, dest)
        for i in range(args.burst):
            while True:
                try:
                    bulk.sendto(struct.pack("!IBI", rep, BULK, i) + pad, dest)
                    break
                except BlockingIOError:
                    time.sleep(0.0005)
        # The urgent packet carries how long the sender took from the marker to it (in µs): this sender is slower
        # than the kernel at queueing a burst, and the receiver subtracts it.
        gap_us = (time.monotonic_ns() - t0) // 1000
        urgent.sendto(struct.pack("!IBI", rep, URGENT, gap_us) + pad, dest)
        time.sleep(args.gap)


def recv(args):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    s.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
    s.bind(("0.0.0.0", args.port))
    s.settimeout(0.5)
    reps = {}
    end = time.monotonic() + args.timeout
    print("rep,marker_s,urgent_s,delay_ms,send_gap_ms,queue_delay_ms,bulk_before_urgent,bulk_received")
    done = 0
    while done < args.reps and time.monotonic() < end:
        try:
            data, anc, _, _ = s.recvmsg(65536, socket.CMSG_SPACE(16))
        except socket.timeout:
            continue
        stamp = None
        for level, kind, raw in anc:
            if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS:
                sec, nsec = struct.unpack("qq", raw[:16])
                stamp = sec + nsec / 1e9
        if stamp is None:
            stamp = time.time()
        rep, kind, arg = struct.unpack("!IBI", data[:9])
        r = reps.setdefault(rep, {"marker": None, "urgent": None, "bulk": 0, "before": None, "gap": None})
        if kind == MARKER:
            r["marker"] = stamp
        elif kind == BULK:
            r["bulk"] += 1
        else:
            r["urgent"] = stamp
            r["gap"] = arg / 1000
            r["before"] = r["bulk"]
            done += 1
    for rep in sorted(reps):
        r = reps[rep]
        both = r["marker"] is not None and r["urgent"] is not None
        delay = (r["urgent"] - r["marker"]) * 1000 if both else None
        cols = ["" if delay is None else f"{delay:.3f}", "" if r["gap"] is None else f"{r['gap']:.3f}",
                "" if delay is None else f"{delay - r['gap']:.3f}"]
        print(f"{rep},{r['marker'] or ''},{r['urgent'] or ''},{','.join(cols)},"
              f"{'' if r['before'] is None else r['before']},{r['bulk']}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("send")
    a.add_argument("host")
    a.add_argument("port", type=int)
    a.add_argument("--reps", type=int, default=50)
    a.add_argument("--burst", type=int, default=1000)
    a.add_argument("--size", type=int, default=1400, help="UDP payload bytes (>= 9)")
    a.add_argument("--gap", type=float, default=0.8, help="seconds between repetitions")
    b = sub.add_parser("recv")
    b.add_argument("port", type=int)
    b.add_argument("--reps", type=int, default=50)
    b.add_argument("--timeout", type=float, default=60.0)
    args = ap.parse_args()
    send(args) if args.cmd == "send" else recv(args)


if __name__ == "__main__":
    main()
