"""Choosing a socket's TCP congestion control, with a clear error when the kernel refuses it; a sender's socket with
its congestion control, connected to a sink that may not listen yet.

Used by the experiment programs (tcp_bulk.py, cc_sender.py). Linux lets a program without CAP_NET_ADMIN pick only
the algorithms listed in net.ipv4.tcp_allowed_congestion_control (and the default one). Lab programs run as the
invoking user (SUDO_UID when run through sudo), so on a machine whose list lacks the experiment's algorithm the
setsockopt fails with EPERM; the message says what to do instead of a bare traceback.
"""

import socket
import sys
import time

PROC = "/proc/sys/net/ipv4/"


def _read(name):
    try:
        with open(PROC + name) as f:
            return f.read().strip()
    except OSError as e:
        return "(unreadable: %s)" % e


def explain(name, error):
    """The message for a refused TCP_CONGESTION `name` (`error` is the OSError)."""
    available = _read("tcp_available_congestion_control")
    if name not in available.split():
        return ("TCP congestion control %r is not available on this kernel (%s; available: %s); "
                "load its module (e.g. modprobe tcp_%s)" % (name, error, available, name))
    allowed = _read("tcp_allowed_congestion_control")
    return ("TCP congestion control %r was refused (%s): programs without CAP_NET_ADMIN may only choose the "
            "algorithms in net.ipv4.tcp_allowed_congestion_control (%s). Run the lab as root (not through sudo, "
            "whose user the programs run as), or allow it: sysctl -w "
            "net.ipv4.tcp_allowed_congestion_control=\"%s %s\"" % (name, error, allowed, allowed, name))


def set_congestion_control(sock, name):
    """Sets TCP_CONGESTION on `sock`; raises OSError with an explaining message when the kernel refuses."""
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, name.encode())
    except OSError as e:
        raise OSError(e.errno, explain(name, e.strerror)) from e


def sender_socket(name, program):
    """A TCP socket using congestion control `name`; exits naming `program` if the kernel refuses it."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        set_congestion_control(sock, name)
    except OSError as e:
        sys.exit("%s: %s" % (program, e.strerror))
    return sock


def connect(sock, host, port, program):
    """Connects `sock` to HOST:PORT, trying for 5 s (the sink may not listen yet); exits naming `program` if it
    cannot."""
    for attempt in range(50):
        try:
            sock.connect((host, port))
            return
        except OSError as e:
            if attempt == 49:
                sys.exit(f"{program}: cannot connect to {host}:{port}: {e}")
            time.sleep(0.1)
