"""AttendStream's decode steps over the server's AttendSocket (--attend_socket_port): the same
AttendRequest / AttendResponse messages in length-prefixed frames over plain TCP, without gRPC.
The wire format is documented in proto/kvpool/v1/attend_socket.h. No TLS.
"""

from __future__ import annotations

import socket
import struct
import time
from typing import Optional

import grpc

from .v1 import kvpool_pb2 as pb

_MAGIC = 0x3141564B  # "KVA1" as a little-endian word
_HEADER = struct.Struct("<IHHII")  # magic, type, status code, payload length, zero
_REQUEST, _RESPONSE, _STATUS = 1, 2, 3
_CODES = {c.value[0]: c for c in grpc.StatusCode}


class AttendSocketError(grpc.RpcError):
    """A failed AttendSocket session, with a gRPC status code like the stubs' errors."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def socket_address(target: str, port: int):
    """(host, port) of `port` on the host of a "host:port" gRPC target."""
    for scheme in ("dns:///", "ipv4:", "ipv6:"):
        if target.startswith(scheme):
            target = target[len(scheme):]
    host, sep, target_port = target.rpartition(":")
    if not sep or not host or not target_port.isdigit() or "/" in host or "," in host or (
            ":" in host and not host.startswith("[")):
        raise ValueError(f"attend_socket_port needs a host:port target, not {target!r}")
    return host.strip("[]"), port


class AttendSocketSession:
    """One AttendSocket connection for a decode loop: request(req) sends an AttendRequest and
    returns its AttendResponse. After an error the session is closed and raises that error
    again. `timeout` (seconds, None = none) bounds the whole session."""

    def __init__(self, address, timeout: Optional[float], max_message_bytes: int):
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._max = max_message_bytes
        self._error: Optional[AttendSocketError] = None
        try:
            self._sock = socket.create_connection(address, timeout=self._left())
        except OSError as e:
            raise AttendSocketError(grpc.StatusCode.UNAVAILABLE,
                                    f"AttendSocket cannot connect to {address}: {e}") from e
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def _left(self) -> Optional[float]:
        if self._deadline is None:
            return None
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise AttendSocketError(grpc.StatusCode.DEADLINE_EXCEEDED, "AttendSocket deadline")
        return left

    def _read(self, n: int) -> bytes:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            self._sock.settimeout(self._left())
            r = self._sock.recv_into(view[got:])
            if r == 0:
                raise AttendSocketError(grpc.StatusCode.UNAVAILABLE,
                                        "AttendSocket closed by the server")
            got += r
        return bytes(buf)

    def _fail(self, error: AttendSocketError):
        self._error = error
        self.close()
        raise error

    def request(self, req: "pb.AttendRequest") -> "pb.AttendResponse":
        if self._error is not None:
            raise self._error
        if self._sock is None:
            raise AttendSocketError(grpc.StatusCode.FAILED_PRECONDITION, "session finished")
        payload = req.SerializeToString()
        sent = True
        try:
            self._sock.settimeout(self._left())
            self._sock.sendall(_HEADER.pack(_MAGIC, _REQUEST, 0, len(payload), 0) + payload)
        except OSError:
            sent = False  # the server may have closed after a status frame: read it
        try:
            magic, kind, code, length, zero = _HEADER.unpack(self._read(_HEADER.size))
            if (magic != _MAGIC or zero != 0 or kind not in (_RESPONSE, _STATUS)
                    or length > self._max):
                self._fail(AttendSocketError(grpc.StatusCode.INTERNAL,
                                             "AttendSocket: the server's answer is not a frame"))
            body = self._read(length)
        except AttendSocketError as e:
            self._fail(e)
        except OSError as e:
            code = grpc.StatusCode.DEADLINE_EXCEEDED if isinstance(e, socket.timeout) \
                else grpc.StatusCode.UNAVAILABLE
            self._fail(AttendSocketError(code, f"AttendSocket: {e}" if sent else
                                         f"AttendSocket send failed: {e}"))
        if kind == _STATUS:
            self._fail(AttendSocketError(_CODES.get(code, grpc.StatusCode.UNKNOWN),
                                         body.decode("utf-8", "replace")))
        return pb.AttendResponse.FromString(body)

    def close(self):
        if self._sock is not None:
            self._sock.close()
            self._sock = None
