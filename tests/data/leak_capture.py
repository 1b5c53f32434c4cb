#!/usr/bin/env python3
"""Counts, on interface IFACE, the packets whose IPv4 source or destination is in PREFIX4 (a.b.0.0/16) or whose
IPv6 source or destination starts with PREFIX6 (the first 4 bytes, fd77:B::/32): packets of a sandbox that left the
host. Also counts the packets sent to HOST (the host's address) after the file MARK exists. Runs until the file STOP
exists, then prints one JSON line: {"leaked": n, "late_to_host": m, "total": t, "first": "..."}.
Usage: leak_capture.py IFACE PREFIX4 PREFIX6 HOST MARK STOP"""
import ipaddress, json, os, socket, sys, time

iface, p4, p6, host, mark, stop = sys.argv[1:7]
net4 = ipaddress.ip_network(p4)
net6 = ipaddress.ip_network(p6)
host = ipaddress.ip_address(host)
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))
s.bind((iface, 0))
s.settimeout(0.05)
print("ready", flush=True)
leaked = late = total = 0
first = ""
marked = False
last_check = 0.0
while True:
    now = time.monotonic()
    if now - last_check > 0.05:
        last_check = now
        if not marked and os.path.exists(mark):
            marked = True
        if os.path.exists(stop):
            break
    try:
        frame = s.recv(65535)
    except socket.timeout:
        continue
    total += 1
    eth = int.from_bytes(frame[12:14], "big")
    ip = frame[14:]
    if eth == 0x0800 and len(ip) >= 20:
        src, dst = ipaddress.ip_address(ip[12:16]), ipaddress.ip_address(ip[16:20])
        nets = net4
    elif eth == 0x86DD and len(ip) >= 40:
        src, dst = ipaddress.ip_address(ip[8:24]), ipaddress.ip_address(ip[24:40])
        nets = net6
    else:
        continue
    if src in nets or dst in nets:
        leaked += 1
        if not first:
            first = f"{src} -> {dst} proto {ip[9] if eth == 0x0800 else ip[6]}"
    if marked and dst == host:
        late += 1
print(json.dumps({"leaked": leaked, "late_to_host": late, "total": total, "first": first}), flush=True)
