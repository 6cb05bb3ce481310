"""AttendStream's decode steps over the server's AttendSocket: the same AttendRequest /
AttendResponse messages in length-prefixed frames over plain TCP (--attend_socket_port), without
gRPC, or over its Unix socket (--attend_unix_socket) with the bulk bytes in a shared-memory region
the server passes to the client. The wire format is documented in proto/kvpool/v1/attend_socket.h
and attend_region.h. No TLS.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import socket
import struct
import time
from typing import Optional, Union

import grpc

from .v1 import kvpool_pb2 as pb

_MAGIC = 0x3141564B  # "KVA1" as a little-endian word
_HEADER = struct.Struct("<IHHII")  # magic, type, status code, payload length, zero
_REQUEST, _RESPONSE, _STATUS, _ATTACH, _REGION, _REGION_REQUEST = 1, 2, 3, 4, 5, 6
_SIZE = struct.Struct("<Q")  # the payload of attach and region frames
_ALIGN = 64  # region arrays start on cache lines (RegionStepLayout)
_CODES = {c.value[0]: c for c in grpc.StatusCode}


class AttendSocketError(grpc.RpcError):
    """A failed AttendSocket session (or a finished AttendStream), with a gRPC status code like
    the stubs' errors."""

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


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


@dataclasses.dataclass(frozen=True)
class RegionStepLayout:
    """Byte offsets of one region step's arrays (proto/kvpool/v1/attend_region.h): q
    [items][num_q_heads][head_dim] fp16, new_k and new_v [appending items][num_kv_heads][head_dim]
    fp16 in item order, out [items][num_q_heads][head_dim] in the output dtype; `end` is the bytes
    the step needs. q_bytes and kv_bytes are an item's q and new_k (new_v) bytes, which a region
    request carries as region_q_bytes and region_kv_bytes."""
    q: int
    new_k: int
    new_v: int
    out: int
    end: int
    q_bytes: int
    kv_bytes: int


def region_step_layout(items: int, appending: int, q_bytes: int, kv_bytes: int,
                       out_bytes: int) -> RegionStepLayout:
    """The layout of `items` items of which `appending` append, with q_bytes and kv_bytes per item
    and out_bytes of output per item."""
    new_k = _align(items * q_bytes)
    new_v = _align(new_k + appending * kv_bytes)
    out = _align(new_v + appending * kv_bytes)
    return RegionStepLayout(0, new_k, new_v, out, out + items * out_bytes, q_bytes, kv_bytes)


class AttendSocketSession:
    """One AttendSocket connection for a decode loop: request(req) sends an AttendRequest and
    returns its AttendResponse. `address` is (host, port) for TCP or a Unix socket path; over a
    Unix socket with `region_bytes` > 0 the session attaches a shared-memory region of that size
    and each request's q, new_k, new_v and the output travel through it. After an error the
    session is closed and raises that error again. `timeout` (seconds, None = none) bounds the
    whole session."""

    def __init__(self, address: Union[tuple, str], timeout: Optional[float],
                 max_message_bytes: int, region_bytes: int = 0):
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._max = max_message_bytes if max_message_bytes >= 0 else (1 << 32) - 1  # -1: none
        self._error: Optional[AttendSocketError] = None
        self._region: Optional[mmap.mmap] = None
        self._sock: Optional[socket.socket] = None
        try:
            if isinstance(address, str):
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self._sock.settimeout(self._left())
                self._sock.connect(address)
            else:
                self._sock = socket.create_connection(address, timeout=self._left())
                self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except (OSError, AttendSocketError) as e:  # _left() raises past the deadline
            if self._sock is not None:
                self._sock.close()
            if isinstance(e, AttendSocketError):
                raise
            raise AttendSocketError(grpc.StatusCode.UNAVAILABLE,
                                    f"AttendSocket cannot connect to {address}: {e}") from e
        if region_bytes > 0:
            self._attach(region_bytes)

    def _left(self) -> Optional[float]:
        if self._deadline is None:
            return None
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise AttendSocketError(grpc.StatusCode.DEADLINE_EXCEEDED, "AttendSocket deadline")
        return left

    def _read(self, n: int, prefix: bytes = b"") -> bytes:
        buf = bytearray(n)
        buf[:len(prefix)] = prefix
        view, got = memoryview(buf), len(prefix)
        while got < n:
            self._sock.settimeout(self._left())
            r = self._sock.recv_into(view[got:])
            if r == 0:
                raise AttendSocketError(grpc.StatusCode.UNAVAILABLE,
                                        "AttendSocket closed by the server")
            got += r
        return bytes(buf)

    def _attach(self, size: int):
        """Asks for a region and maps the memfd the server passes with its answer."""
        try:
            self._sock.settimeout(self._left())
            self._sock.sendall(_HEADER.pack(_MAGIC, _ATTACH, 0, _SIZE.size, 0) + _SIZE.pack(size))
            first, fds, _, _ = socket.recv_fds(self._sock, _HEADER.size, 1)
            try:
                if not first:
                    raise AttendSocketError(grpc.StatusCode.UNAVAILABLE,
                                            "AttendSocket closed by the server")
                magic, kind, code, length, zero = _HEADER.unpack(self._read(_HEADER.size, first))
                if magic != _MAGIC or zero != 0 or length > self._max:
                    raise AttendSocketError(grpc.StatusCode.INTERNAL,
                                            "AttendSocket: the server's answer is not a frame")
                body = self._read(length)
                if kind == _STATUS:
                    raise AttendSocketError(_CODES.get(code, grpc.StatusCode.UNKNOWN),
                                            body.decode("utf-8", "replace"))
                if kind != _REGION or body != _SIZE.pack(size) or len(fds) != 1 \
                        or os.fstat(fds[0]).st_size != size:
                    raise AttendSocketError(grpc.StatusCode.INTERNAL,
                                            "AttendSocket: the answer to an attach is not a region")
                self._region = mmap.mmap(fds[0], size)
            finally:
                for fd in fds:
                    os.close(fd)
        except AttendSocketError as e:
            self._fail(e)
        except OSError as e:
            self._fail(AttendSocketError(grpc.StatusCode.UNAVAILABLE, f"AttendSocket: {e}"))

    def _fail(self, error: AttendSocketError):
        self._error = error
        self.close()
        raise error

    def _stage(self, req: "pb.AttendRequest"):
        """Copies req's bulk bytes into the region; the request to send and the output's
        (offset, size)."""
        items = req.items
        q_bytes = len(items[0].q) if items else 0
        kv = [it for it in items if it.new_k]
        kv_bytes = len(kv[0].new_k) if kv else 0
        if any(len(it.q) != q_bytes or len(it.new_k) != len(it.new_v) or
               (it.new_k and len(it.new_k) != kv_bytes) for it in items):
            raise AttendSocketError(grpc.StatusCode.INVALID_ARGUMENT, "AttendSocket region steps "
                                    "need equal q sizes and equal new_k / new_v sizes")
        out_item = q_bytes // 2 * (4 if req.output_dtype == pb.OUTPUT_DTYPE_FP32 else 2)
        layout = region_step_layout(len(items), len(kv), q_bytes, kv_bytes, out_item)
        if not items or layout.end > len(self._region):
            raise AttendSocketError(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"AttendSocket step of {len(items)} items does not fit the "
                                    f"{len(self._region)}-byte region (attend_region_bytes)")
        sent = pb.AttendRequest(layer=req.layer, num_q_heads=req.num_q_heads,
                                sm_scale=req.sm_scale, output_dtype=req.output_dtype,
                                return_lse=req.return_lse, region_q_bytes=q_bytes,
                                region_kv_bytes=kv_bytes)
        appended = 0
        for i, it in enumerate(items):
            self._region[i * q_bytes:(i + 1) * q_bytes] = it.q
            item = sent.items.add(lease_id=it.lease_id, new_token_id=it.new_token_id)
            if it.new_k:
                k_at = layout.new_k + appended * kv_bytes
                v_at = layout.new_v + appended * kv_bytes
                self._region[k_at:k_at + kv_bytes] = it.new_k
                self._region[v_at:v_at + kv_bytes] = it.new_v
                item.append_in_region = True
                appended += 1
        return sent, layout.out, len(items) * out_item

    @property
    def region(self) -> Optional[mmap.mmap]:
        """The attached region (None without one), for callers that fill it themselves."""
        return self._region

    def request_in_place(self, req: "pb.AttendRequest") -> "pb.AttendResponse":
        """Sends `req`, whose items carry no q, new_k or new_v (append_in_region marks an
        append), as a region request: its arrays are in the region already, at the offsets of
        region_step_layout (whose q_bytes and kv_bytes req carries as region_q_bytes and
        region_kv_bytes), and so is the output when this returns (the response's `out` is
        empty)."""
        self._check_open()  # a failed session raises its error again (it has no region now)
        if self._region is None:
            raise AttendSocketError(grpc.StatusCode.FAILED_PRECONDITION,
                                    "request_in_place needs a session with a region")
        return self._exchange(_REGION_REQUEST, req)

    def request(self, req: "pb.AttendRequest") -> "pb.AttendResponse":
        if self._region is None:
            return self._exchange(_REQUEST, req)
        self._check_open()
        try:
            sent, out_at, out_size = self._stage(req)
        except AttendSocketError as e:
            self._fail(e)
        resp = self._exchange(_REGION_REQUEST, sent)
        resp.out = self._region[out_at:out_at + out_size]
        return resp

    def _check_open(self):
        if self._error is not None:
            raise self._error
        if self._sock is None:
            raise AttendSocketError(grpc.StatusCode.FAILED_PRECONDITION, "session finished")

    def _exchange(self, kind_sent: int, req: "pb.AttendRequest") -> "pb.AttendResponse":
        """Sends `req` as a frame of `kind_sent` and reads the response frame."""
        self._check_open()
        payload = req.SerializeToString()
        try:
            left = self._left()  # past the deadline nothing more is sent
        except AttendSocketError as e:
            self._fail(e)
        sent = True
        try:
            self._sock.settimeout(left)
            self._sock.sendall(_HEADER.pack(_MAGIC, kind_sent, 0, len(payload), 0) + payload)
        except OSError:
            sent = False  # the server may have closed after a status frame: read it
        try:
            magic, kind, code, length, zero = _HEADER.unpack(self._read(_HEADER.size))
            if magic != _MAGIC or zero != 0 or kind not in (_RESPONSE, _STATUS):
                self._fail(AttendSocketError(grpc.StatusCode.INTERNAL,
                                             "AttendSocket: the server's answer is not a frame"))
            if length > self._max:
                self._fail(AttendSocketError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"AttendSocket: a {length}-byte answer, over max_message_bytes {self._max}"))
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
        if self._region is not None:
            try:
                self._region.close()
            except BufferError:
                pass  # views of it (an in-place step's output) live on: unmapped when they go
            self._region = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
