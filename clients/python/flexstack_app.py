"""flexstack_app: register an application's own variables with a flexstack daemon.

An application declares meters (values it measures and updates) and knobs (settings that rules or
``flexstack set`` may change; the module calls the knob's callback), registers them under its name, and then
calls :meth:`App.poll` from its loop. The variables appear in the daemon as ``app.<name>.<var>`` for as long as
the connection lasts.

    app = App()                                    # $FLEXSTACK_STATE_DIR/apps.sock, default /run/flexstack
    app.meter("loss", "f64")
    app.knob("cc", "str", "cubic", on_cc)           # on_cc("cc", "bbr") when it is set; raise Refused to refuse
    app.register("sender")
    while True:
        app.update("loss", measure())
        app.poll(0.1)

Protocol: JSON lines on STATE_DIR/apps.sock (docs/control-api.md, "Application variables"). Standard library
only; not thread-safe (use one thread).
"""

import json
import os
import select
import socket

__all__ = ["App", "Refused", "FlexstackError"]


class FlexstackError(Exception):
    """The daemon refused a request, or the connection failed."""


class Refused(Exception):
    """Raised by a knob callback to refuse a value; its message is sent to the writer."""


class App:
    """A connection to the daemon's app socket (see the module docs)."""

    REPLY_TIMEOUT = 5.0

    def __init__(self, socket_path=None):
        if socket_path is None:
            state = os.environ.get("FLEXSTACK_STATE_DIR") or "/run/flexstack"
            socket_path = os.path.join(state, "apps.sock")
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.connect(socket_path)
        self._buf = b""
        self._vars = []
        self._callbacks = {}
        self._next_id = 1
        self.name = None

    def meter(self, name, type_, unit="", description=""):
        """Declares a meter of type u64, i64, f64, bool or str (before register)."""
        self._vars.append({"name": name, "kind": "meter", "type": type_, "unit": unit, "description": description})

    def knob(self, name, type_, initial=None, callback=None, unit="", description=""):
        """Declares a knob; callback(name, value) runs when it is set (value as text; raise Refused to refuse)."""
        decl = {"name": name, "kind": "knob", "type": type_, "unit": unit, "description": description}
        if initial is not None:
            decl["value"] = initial
        self._vars.append(decl)
        self._callbacks[name] = callback

    def register(self, name):
        """Registers the declared variables as app.<name>.*; returns their full names."""
        result = self._request({"op": "register", "app": name, "vars": self._vars})
        self.name = name
        return result["vars"]

    def update(self, name, value):
        """Stores a new value of one of the app's variables."""
        self._request({"op": "update", "name": name, "value": value})

    def poll(self, timeout=0.0):
        """Waits up to timeout seconds (None: forever) for knob writes and runs their callbacks; returns how many."""
        handled = 0
        while True:
            line = self._line(timeout if handled == 0 else 0.0)
            if line is None:
                return handled
            if "event" in line:
                self._event(line["event"])
                handled += 1

    def fileno(self):
        """The socket, for select/poll loops (readable: call poll(0))."""
        return self._sock.fileno()

    def close(self):
        """Closes the connection: the daemon removes the variables."""
        self._sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- internals ----

    def _send(self, obj):
        self._sock.sendall((json.dumps(obj) + "\n").encode())

    def _line(self, timeout):
        while b"\n" not in self._buf:
            ready, _, _ = select.select([self._sock], [], [], timeout)
            if not ready:
                return None
            chunk = self._sock.recv(65536)
            if not chunk:
                raise FlexstackError("the daemon closed the connection")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def _event(self, ev):
        callback = self._callbacks.get(ev.get("name"))
        ack = {"op": "ack", "serial": ev["serial"], "ok": True}
        try:
            if callback is not None:
                callback(ev["name"], ev["text"])
        except Refused as e:
            ack = {"op": "ack", "serial": ev["serial"], "ok": False, "error": str(e) or "refused"}
        self._send(ack)

    def _request(self, obj):
        obj = dict(obj, id=self._next_id)
        self._next_id += 1
        self._send(obj)
        while True:
            line = self._line(self.REPLY_TIMEOUT)
            if line is None:
                raise FlexstackError("no answer from the daemon within %.0f s" % self.REPLY_TIMEOUT)
            if "event" in line:
                self._event(line["event"])
                continue
            if line.get("ok"):
                return line.get("result", {})
            raise FlexstackError(line.get("error", {}).get("message", str(line)))
