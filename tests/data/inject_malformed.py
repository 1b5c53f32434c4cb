#!/usr/bin/env python3
"""Sends malformed IPv4/IPv6 packets (and a fragment flood) into a TUN device through an AF_PACKET socket, for
flexstack's end-to-end robustness test. Each kind is sent `--rounds` times; prints how many of each it sent.

usage: inject_malformed.py DEVICE SRC4 DST4 SRC6 DST6 [--rounds N] [--flood N] [--mac DST_MAC]

On an Ethernet device give --mac (the destination MAC of every frame): it then also sends malformed Ethernet
frames themselves (truncated, unknown EtherType, malformed ARP) through a raw socket.
"""
import ipaddress
import socket
import struct
import sys
import time


def csum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    s = sum(struct.unpack("!%dH" % (len(data) // 2), data))
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    return ~s & 0xFFFF


def ipv4(src, dst, proto, payload, ihl=5, total=None, ident=0x1234, frag=0x4000, ttl=64, fix_checksum=True):
    total = 20 + len(payload) if total is None else total
    h = struct.pack("!BBHHHBBH4s4s", 0x40 | ihl, 0, total, ident, frag, ttl, proto, 0, src, dst)
    if fix_checksum:
        h = h[:10] + struct.pack("!H", csum(h)) + h[12:]
    return h + payload


def udp(sport, dport, data):
    return struct.pack("!HHHH", sport, dport, 8 + len(data), 0) + data


def main():
    dev, s4, d4, s6, d6 = sys.argv[1:6]
    rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 20
    flood = int(sys.argv[sys.argv.index("--flood") + 1]) if "--flood" in sys.argv else 2000
    src, dst = socket.inet_aton(s4), socket.inet_aton(d4)
    src6, dst6 = ipaddress.IPv6Address(s6).packed, ipaddress.IPv6Address(d6).packed
    mac = bytes.fromhex(sys.argv[sys.argv.index("--mac") + 1].replace(":", "")) if "--mac" in sys.argv else None
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_DGRAM)
    good_udp = udp(40000, 9, b"x" * 32)

    def send(pkt, proto=0x0800):
        if mac is None:
            sock.sendto(pkt, (dev, proto))
        else:
            sock.sendto(pkt, (dev, proto, 0, 0, mac))

    kinds = {
        "truncated": lambda: ipv4(src, dst, 17, good_udp)[:12],
        "ihl_below_5": lambda: ipv4(src, dst, 17, good_udp, ihl=4),
        "ihl_beyond_buffer": lambda: ipv4(src, dst, 17, b"", ihl=15),
        "total_length_beyond_buffer": lambda: ipv4(src, dst, 17, good_udp, total=1400),
        "bad_header_checksum": lambda: ipv4(src, dst, 17, good_udp, fix_checksum=False)[:10] + b"\xde\xad" + ipv4(src, dst, 17, good_udp)[12:],
        "tcp_data_offset_below_5": lambda: ipv4(src, dst, 6, struct.pack("!HHIIBBHHH", 40000, 80, 1, 0, 0x40, 0x02, 1024, 0, 0)),
        "truncated_udp": lambda: ipv4(src, dst, 17, b"\x9c\x40\x00"),
        "ipv6_truncated": lambda: struct.pack("!IHBB", 0x60000000, 8, 17, 64) + src6[:8],
        "ipv6_payload_length_beyond_buffer": lambda: struct.pack("!IHBB", 0x60000000, 900, 17, 64) + src6 + dst6 + good_udp,
        "ipv6_bad_extension_header": lambda: struct.pack("!IHBB", 0x60000000, 8, 0, 64) + src6 + dst6 + bytes([17, 9, 0, 0, 0, 0, 0, 0]),
    }
    sent = {}
    for r in range(rounds):
        for name, make in kinds.items():
            pkt = make()
            send(pkt, 0x86DD if pkt[0] >> 4 == 6 else 0x0800)
            sent[name] = sent.get(name, 0) + 1
        ident = 0x5000 + r
        data = b"A" * 64
        # Overlapping: bytes 0-63 then 32-95 of the same datagram.
        send(ipv4(src, dst, 17, udp(40001, 9, data)[:64], ident=ident, frag=0x2000))
        send(ipv4(src, dst, 17, data, ident=ident, frag=0x2000 | 4))
        # Duplicate: the same first fragment twice, then its end.
        send(ipv4(src, dst, 17, udp(40002, 9, data)[:64], ident=ident + 1000, frag=0x2000))
        send(ipv4(src, dst, 17, udp(40002, 9, data)[:64], ident=ident + 1000, frag=0x2000))
        send(ipv4(src, dst, 17, data[:8], ident=ident + 1000, frag=8))
        # Tiny: a first fragment of 4 bytes.
        send(ipv4(src, dst, 17, b"\x9c\x40\x00\x09", ident=ident + 2000, frag=0x2000))
        for k in ("overlapping_fragments", "duplicate_fragments", "tiny_fragment"):
            sent[k] = sent.get(k, 0) + 1
    # A flood of first fragments of datagrams that never complete.
    for i in range(flood):
        send(ipv4(src, dst, 17, udp(40003, 9, b"F" * 56), ident=(0x9000 + i) & 0xFFFF, frag=0x2000))
        if i % 200 == 199:
            time.sleep(0.005)  # paced, so the kernel's TUN queue is not what drops them
    sent["fragment_flood"] = flood
    if mac is not None:
        raw = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
        raw.bind((dev, 0))
        me = raw.getsockname()[4]
        junk = {
            "ethernet_truncated": mac[:4],
            "ethernet_unknown_ethertype": mac + me + b"\x88\xb5" + b"\0" * 46,
            "arp_malformed": mac + me + b"\x08\x06" + b"\x00\x01\x08\x00\x06",
        }
        for _ in range(rounds):
            for name, frame in junk.items():
                try:
                    raw.send(frame)
                    sent[name] = sent.get(name, 0) + 1
                except OSError:
                    sent[name + "_refused_by_kernel"] = sent.get(name + "_refused_by_kernel", 0) + 1
    print(" ".join(f"{k}={v}" for k, v in sorted(sent.items())))


if __name__ == "__main__":
    main()
