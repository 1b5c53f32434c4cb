#!/usr/bin/env python3
"""Bulk TCP sender for the handoff labs: sends as fast as TCP lets it for --duration seconds and samples the
kernel's TCP_INFO every --every seconds. Standard library only.

Output (stdout), CSV: `mono_s,total_retrans,lost,unacked,cwnd,rtt_us,bytes_sent`, one line per sample, where
mono_s is CLOCK_MONOTONIC (the same clock in every network namespace, so it lines up with tcp_sink.py's stamps).

    tcp_bulk.py HOST PORT --duration 11 [--cc cubic] [--sndbuf BYTES] [--every 0.01]
"""
import argparse
import socket
import struct
import sys
import threading
import time

from tcpcc import connect, sender_socket

# struct tcp_info (linux/tcp.h): 8 one-byte fields, then 32-bit fields in this order.
U32_FIELDS = ["rto", "ato", "snd_mss", "rcv_mss", "unacked", "sacked", "lost", "retrans", "fackets",
              "last_data_sent", "last_ack_sent", "last_data_recv", "last_ack_recv", "pmtu", "rcv_ssthresh",
              "rtt", "rttvar", "snd_ssthresh", "snd_cwnd", "advmss", "reordering", "rcv_rtt", "rcv_space",
              "total_retrans"]


def tcp_info(sock):
    """The 32-bit fields of TCP_INFO as a dict."""
    raw = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8 + 4 * len(U32_FIELDS))
    return dict(zip(U32_FIELDS, struct.unpack_from("<%dI" % len(U32_FIELDS), raw, 8)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("host")
    ap.add_argument("port", type=int)
    ap.add_argument("--duration", type=float, required=True, help="seconds of sending")
    ap.add_argument("--cc", default="cubic", help="congestion control (TCP_CONGESTION)")
    ap.add_argument("--sndbuf", type=int, default=0, help="SO_SNDBUF in bytes (0: kernel autotuning)")
    ap.add_argument("--every", type=float, default=0.01, help="TCP_INFO sampling period, seconds")
    args = ap.parse_args()

    sock = sender_socket(args.cc, "tcp_bulk")
    if args.sndbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, args.sndbuf)
    connect(sock, args.host, args.port, "tcp_bulk")
    sent = [0]
    stop = threading.Event()

    def pump():
        chunk = b"\0" * 65536
        try:
            while not stop.is_set():
                sent[0] += sock.send(chunk)
        except OSError as e:
            if not stop.is_set():
                print(f"tcp_bulk: send failed: {e}", file=sys.stderr)

    t = threading.Thread(target=pump, daemon=True)
    t.start()
    out = sys.stdout
    out.write("mono_s,total_retrans,lost,unacked,cwnd,rtt_us,bytes_sent\n")
    end = time.monotonic() + args.duration
    next_sample = time.monotonic()
    while True:
        now = time.monotonic()
        if now >= end:
            break
        if now < next_sample:
            time.sleep(next_sample - now)
            continue
        i = tcp_info(sock)
        out.write(f"{now:.6f},{i['total_retrans']},{i['lost']},{i['unacked']},{i['snd_cwnd']},{i['rtt']},{sent[0]}\n")
        next_sample += args.every
    stop.set()
    out.flush()
    try:
        sock.shutdown(socket.SHUT_RDWR)  # unblocks the pump
    except OSError:
        pass
    t.join(1.0)


if __name__ == "__main__":
    main()
