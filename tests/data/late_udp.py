#!/usr/bin/env python3
"""A UDP server that answers each datagram on PORT with a reply every 20 ms for SECONDS (late replies)."""
import socket, sys, threading, time

addr, port, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
s = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET, socket.SOCK_DGRAM)
s.bind((addr, port))

def answer(peer):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        s.sendto(b"late reply", peer)
        time.sleep(0.02)

while True:
    _, peer = s.recvfrom(2048)
    threading.Thread(target=answer, args=(peer,), daemon=True).start()
