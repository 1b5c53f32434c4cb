#!/usr/bin/env python3
"""Sequence-numbered UDP datagrams for the lab end-to-end tests (tests/lab_e2e.rs).

    udp_seq.py send HOST PORT COUNT INTERVAL_S   send COUNT datagrams 0..COUNT-1, one every INTERVAL_S seconds
    udp_seq.py recv PORT IDLE_S MAX_S            print the sequence numbers received, one per line, sorted, once
                                                 IDLE_S seconds passed without a datagram after the first one
                                                 (or MAX_S seconds in all); a summary goes to stderr

The sender paces against absolute deadlines (a late datagram does not shift the ones after it), so the rate is
steady; each datagram is 64 bytes: the sequence number in ASCII, zero-padded.
"""

import socket
import sys
import time


def send(host, port, count, interval):
    addr = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_DGRAM)[0][4]
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    start = time.monotonic()
    for seq in range(count):
        due = start + seq * interval
        delay = due - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        s.sendto(b"%08d" % seq + b"." * 56, addr)
    print(f"sent {count} datagrams in {time.monotonic() - start:.3f} s", file=sys.stderr)


def recv(port, idle, limit):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    s.bind(("0.0.0.0", port))
    got = set()
    start = time.monotonic()
    last = None
    while True:
        now = time.monotonic()
        if now - start > limit or (last is not None and now - last > idle):
            break
        s.settimeout(0.1)
        try:
            data = s.recv(2048)
        except socket.timeout:
            continue
        got.add(int(data[:8]))
        last = time.monotonic()
    sys.stdout.write("".join(f"{n}\n" for n in sorted(got)))
    print(f"received {len(got)} distinct datagrams", file=sys.stderr)


def main(argv):
    if len(argv) == 6 and argv[1] == "send":
        send(argv[2], int(argv[3]), int(argv[4]), float(argv[5]))
    elif len(argv) == 5 and argv[1] == "recv":
        recv(int(argv[2]), float(argv[3]), float(argv[4]))
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv)
