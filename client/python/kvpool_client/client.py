"""Python client of the kvpool gRPC service (proto/kvpool/v1/kvpool.proto).

Tensors go in and out as numpy arrays; they travel as fp16. RPC failures raise grpc.RpcError
with the server's status code (INVALID_ARGUMENT, NOT_FOUND, RESOURCE_EXHAUSTED, ...).
"""

from __future__ import annotations

import dataclasses
import queue
from typing import Iterable, Iterator, List, Optional, Sequence

import grpc
import numpy as np

try:
    from .attend_socket import (AttendSocketError, AttendSocketSession, RegionStepLayout,
                                region_step_layout, socket_address)
    from .v1 import kvpool_pb2 as pb
    from .v1 import kvpool_pb2_grpc as pb_grpc
except ImportError as e:  # pragma: no cover - a checkout without generated stubs
    raise ImportError(
        f"kvpool_client.v1 stubs are missing or need a newer protobuf ({e}): run "
        "client/python/gen_proto.sh (or pip install client/python)") from e

_DTYPES = {
    "": pb.KV_DTYPE_UNSPECIFIED,
    "fp16": pb.KV_DTYPE_FP16,
    "fp8_e4m3": pb.KV_DTYPE_FP8_E4M3,
    "int8": pb.KV_DTYPE_INT8,
    "int4": pb.KV_DTYPE_INT4,
}


def _fp16_bytes(x) -> bytes:
    return np.ascontiguousarray(np.asarray(x), dtype=np.float16).tobytes()


@dataclasses.dataclass
class AttendItem:
    """One sequence of a decode step: its lease, q [num_q_heads, head_dim], and optionally the
    new token's k/v [num_kv_heads, head_dim], appended before attending."""
    lease_id: int
    q: np.ndarray
    new_k: Optional[np.ndarray] = None
    new_v: Optional[np.ndarray] = None
    new_token_id: int = -1


@dataclasses.dataclass
class AttendResult:
    out: np.ndarray                 # [items, num_q_heads, head_dim] float32 (in place: as asked)
    lse: Optional[np.ndarray]       # [items, num_q_heads] when asked
    context_tokens: List[int]       # tokens attended per item
    # The server began a graceful shutdown: start no new sequence there (AttendResponse).
    server_draining: bool = False


@dataclasses.dataclass
class GetResult:
    """tokens[i]: the real tokens layers[i] holds (layers may differ while a decode step's
    appends are in flight). fp16: k, v are [layers, max(tokens), heads, head_dim] float16, rows
    past a layer's tokens zero. raw: pages[i] = (k bytes, v bytes) of layers[i], and when the
    read starts at block 0 of a namespace with sink tokens, sinks[i] = (k, v) float16
    [heads, layouts[i].sink_tokens, head_dim]: the exact sink rows (else None). layouts[i]:
    layers[i]'s page layout descriptor."""
    layers: List[int]
    tokens: List[int]
    layouts: List[object]
    k: Optional[np.ndarray] = None
    v: Optional[np.ndarray] = None
    pages: Optional[List[tuple]] = None
    sinks: Optional[List[Optional[tuple]]] = None


def _attend_request(layer, items: Sequence[AttendItem], sm_scale, return_lse):
    req = pb.AttendRequest(layer=layer, sm_scale=sm_scale, return_lse=return_lse,
                           output_dtype=pb.OUTPUT_DTYPE_FP32)
    for it in items:
        q = np.asarray(it.q)
        req.num_q_heads = q.shape[0]
        item = req.items.add(lease_id=it.lease_id, q=_fp16_bytes(q),
                             new_token_id=it.new_token_id)
        if it.new_k is not None:
            item.new_k = _fp16_bytes(it.new_k)
            item.new_v = _fp16_bytes(it.new_v)
    return req


def _attend_result(resp, items: Sequence[AttendItem], return_lse) -> AttendResult:
    q_heads, dim = np.asarray(items[0].q).shape
    out = np.frombuffer(resp.out, dtype=np.float32).reshape(len(items), q_heads, dim)
    lse = np.asarray(resp.lse, dtype=np.float32).reshape(len(items), q_heads) if return_lse \
        else None
    return AttendResult(out=out, lse=lse, context_tokens=list(resp.context_tokens),
                        server_draining=resp.server_draining)


class AttendStream:
    """A decode loop's session, kept open: step() sends one request and returns its response.
    An AttendStream RPC, or an AttendSocket connection when the Client has an
    attend_unix_socket (with a shared-memory region) or an attend_socket_port. Use as a context
    manager, or call close(). Once the session has failed or is closed, step() raises a
    grpc.RpcError: the failure again, or FAILED_PRECONDITION after close()."""

    _END = object()

    def __init__(self, stub, timeout, socket_session: Optional[AttendSocketSession] = None):
        self._socket = socket_session
        self._ended: Optional[grpc.RpcError] = None  # the gRPC call is over: what step() raises
        if socket_session is None:
            self._requests: "queue.Queue" = queue.Queue()
            self._responses = stub.AttendStream(iter(self._requests.get, self._END),
                                                timeout=timeout)

    def step(self, layer: int, items: Sequence[AttendItem], sm_scale: float = 0.0,
             return_lse: bool = False) -> AttendResult:
        req = _attend_request(layer, items, sm_scale, return_lse)
        if self._socket is not None:
            return _attend_result(self._socket.request(req), items, return_lse)
        if self._ended is not None:
            raise self._ended
        self._requests.put(req)
        try:
            resp = next(self._responses)
        except StopIteration:  # ended with OK but no answer to this step
            self._end(AttendSocketError(grpc.StatusCode.INTERNAL,
                                        "AttendStream: the server ended the call without an answer"))
            raise self._ended from None
        except grpc.RpcError as e:
            self._end(e)
            raise
        except BaseException:
            self._cancel("interrupted")
            raise
        return _attend_result(resp, items, return_lse)

    def _end(self, why: grpc.RpcError):
        self._ended = why
        self._requests.put(self._END)  # the call is over: gRPC's request-consuming thread ends

    def _cancel(self, why: str):
        self._end(AttendSocketError(grpc.StatusCode.CANCELLED, f"AttendStream: {why}"))
        self._responses.cancel()

    def close(self):
        if self._socket is not None:
            self._socket.close()
            return
        if self._ended is not None:
            return
        self._end(AttendSocketError(grpc.StatusCode.FAILED_PRECONDITION,
                                    "AttendStream: the stream is closed"))
        for _ in self._responses:  # drains and surfaces the final status
            pass

    def __del__(self):  # dropped without close(): the call and gRPC's thread end
        if getattr(self, "_responses", None) is not None and self._ended is None:
            self._cancel("dropped without close()")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if exc[0] is None or self._socket is not None:
            self.close()
        elif self._ended is None:
            self._cancel("left on an exception")


class InPlaceAttendStream:
    """A decode loop over the AttendSocket's Unix socket whose caller writes each step's q (and
    new K/V) into the shared-memory `region` itself, at the offsets of layout(), and reads the
    output there: the session copies nothing (e.g. copy between a GPU tensor and the region,
    registered with CUDA for DMA). Use as a context manager, or call close()."""

    def __init__(self, session: AttendSocketSession):
        self._session = session
        self.region = np.frombuffer(session.region, dtype=np.uint8)  # writable view

    @staticmethod
    def layout(items: int, num_q_heads: int, head_dim: int, appending: int = 0,
               num_kv_heads: int = 0, fp32: bool = False) -> RegionStepLayout:
        return region_step_layout(items, appending, num_q_heads * head_dim * 2,
                                  num_kv_heads * head_dim * 2,
                                  num_q_heads * head_dim * (4 if fp32 else 2))

    def step(self, layer: int, lease_ids: Sequence[int], num_q_heads: int, head_dim: int,
             layout: RegionStepLayout, appends: Optional[Sequence[bool]] = None,
             new_token_ids: Optional[Sequence[int]] = None, sm_scale: float = 0.0,
             return_lse: bool = False, fp32: bool = False) -> AttendResult:
        """Runs the step whose arrays are in the region at `layout` (appending items, marked in
        `appends`, have their K and V at layout.new_k / new_v in item order), which must be
        layout() of this step's items and appends (ValueError otherwise, nothing sent: the server
        lays the step out by its items and appends). The result's `out` is a view of the region,
        overwritten by the next step and zeros once the session is closed (on an error too): copy
        it to keep it."""
        n = len(lease_ids)
        appending = sum(bool(a) for a in appends) if appends is not None else 0
        want = region_step_layout(n, appending, num_q_heads * head_dim * 2, layout.kv_bytes,
                                  num_q_heads * head_dim * (4 if fp32 else 2))
        if layout != want:
            raise ValueError(f"layout {layout} is not this step's ({n} items, {appending} "
                             f"appending, fp32={fp32}): {want}")
        req = pb.AttendRequest(layer=layer, num_q_heads=num_q_heads, sm_scale=sm_scale,
                               return_lse=return_lse,
                               output_dtype=pb.OUTPUT_DTYPE_FP32 if fp32 else pb.OUTPUT_DTYPE_FP16,
                               region_q_bytes=layout.q_bytes, region_kv_bytes=layout.kv_bytes)
        for i, lease in enumerate(lease_ids):
            req.items.add(lease_id=lease,
                          new_token_id=new_token_ids[i] if new_token_ids is not None else -1,
                          append_in_region=bool(appends[i]) if appends is not None else False)
        resp = self._session.request_in_place(req)
        dtype = np.float32 if fp32 else np.float16
        out = self.region[layout.out:layout.out + n * num_q_heads * head_dim *
                          np.dtype(dtype).itemsize].view(dtype).reshape(n, num_q_heads, head_dim)
        lse = np.asarray(resp.lse, dtype=np.float32).reshape(n, num_q_heads) if return_lse \
            else None
        return AttendResult(out=out, lse=lse, context_tokens=list(resp.context_tokens),
                        server_draining=resp.server_draining)

    def close(self):
        self.region = None
        self._session.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Client:
    """Wraps every kvpool RPC. `timeout` (seconds) is the default deadline of each call and
    stream; every method also takes its own `timeout`."""

    def __init__(self, target: str, timeout: float = 60.0, max_message_bytes: int = 64 << 20,
                 max_chunk_bytes: int = 4 << 20, attend_socket_port: int = 0,
                 attend_unix_socket: str = "", attend_region_bytes: int = 16 << 20):
        self._channel = grpc.insecure_channel(target, options=[
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
        ])
        self._stub = pb_grpc.KvPoolStub(self._channel)
        self._timeout = timeout
        self._max_chunk_bytes = max_chunk_bytes
        self._max_message_bytes = max_message_bytes
        # attend_stream() sessions go over the server's AttendSocket on this port of the target's
        # host (its --attend_socket_port) instead of gRPC; 0 = gRPC.
        self._attend_socket = socket_address(target, attend_socket_port) \
            if attend_socket_port else None
        # Or over its Unix socket (--attend_unix_socket; this host only), with each step's q,
        # new K/V and output in a shared-memory region of attend_region_bytes. Takes precedence.
        self._attend_unix_socket = attend_unix_socket
        self._attend_region_bytes = attend_region_bytes

    def close(self):
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _t(self, timeout):
        return self._timeout if timeout is None else timeout

    # ---- namespaces -----------------------------------------------------------------------
    def create_namespace(self, name: str, num_layers: int, num_kv_heads: int, head_dim: int,
                         block_tokens: int = 16, dtype: str = "int4",
                         layer_dtypes: Sequence[str] = (), rotation_block: int = 0,
                         rotation_disabled: bool = False, rotation_seed: int = 0,
                         group_size: int = 0, sink_tokens: int = 0, capacity_bytes: int = 0,
                         blocks_per_sink_page: int = 0, timeout=None):
        """Creates a namespace (NamespaceSpec's fields; 0 = the server's default). capacity_bytes
        0 reserves all of the pool no namespace has reserved yet: give it when more namespaces
        are to follow."""
        spec = pb.NamespaceSpec(
            name=name, num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
            block_tokens=block_tokens, default_dtype=_DTYPES[dtype],
            layer_dtypes=[_DTYPES[d] for d in layer_dtypes], rotation_block=rotation_block,
            rotation_disabled=rotation_disabled, rotation_seed=rotation_seed,
            group_size=group_size, sink_tokens=sink_tokens, capacity_bytes=capacity_bytes,
            blocks_per_sink_page=blocks_per_sink_page)
        return self._stub.CreateNamespace(pb.CreateNamespaceRequest(spec=spec),
                                          timeout=self._t(timeout)).info

    def list_namespaces(self, timeout=None):
        return list(self._stub.ListNamespaces(pb.ListNamespacesRequest(),
                                              timeout=self._t(timeout)).namespaces)

    def namespace(self, name: str = "", timeout=None):
        """NamespaceInfo of `name` ("" = the server's default, listed first)."""
        for info in self.list_namespaces(timeout):
            if not name or info.spec.name == name:
                return info
        raise KeyError(f"no namespace {name!r}")

    # ---- put / match / get ----------------------------------------------------------------
    def put(self, token_ids: Sequence[int], k, v, namespace: str = "", token_begin: int = 0,
            timeout=None):
        """Streams k, v [layers, tokens, heads, head_dim] (any float dtype; sent as fp16) of
        tokens [token_begin, token_begin + tokens) of the sequence `token_ids`."""
        k = np.asarray(k)
        v = np.asarray(v)
        if k.ndim != 4 or k.shape != v.shape:
            raise ValueError("k and v must both be [layers, tokens, heads, head_dim]")
        layers, tokens, heads, dim = k.shape
        chunk = max(1, self._max_chunk_bytes // (2 * heads * dim * 2))

        def messages() -> Iterator:
            yield pb.PutRequest(header=pb.PutHeader(namespace=namespace,
                                                    token_ids=list(token_ids)))
            for layer in range(layers):
                for t in range(0, tokens, chunk):
                    n = min(chunk, tokens - t)
                    yield pb.PutRequest(chunk=pb.PutChunk(
                        layer=layer, token_begin=token_begin + t, num_tokens=n,
                        k=_fp16_bytes(k[layer, t:t + n]), v=_fp16_bytes(v[layer, t:t + n])))

        return self._stub.Put(messages(), timeout=self._t(timeout))

    def match(self, token_ids: Sequence[int], namespace: str = "", ttl_ms: int = 0,
              timeout=None):
        return self._stub.Match(pb.MatchRequest(namespace=namespace, token_ids=list(token_ids),
                                                ttl_ms=ttl_ms), timeout=self._t(timeout))

    def release(self, lease_id: int, timeout=None):
        self._stub.Release(pb.ReleaseRequest(lease_id=lease_id), timeout=self._t(timeout))

    def get(self, lease_id: int, layers: Optional[range] = None, heads: Optional[range] = None,
            fmt: str = "fp16", max_chunk_bytes: int = 0, timeout=None) -> GetResult:
        """Reads a lease's blocks; layers/heads are contiguous ranges of the lease's namespace
        (None = all). fp16 arrays are shaped by the page layout the server sends with each
        layer."""
        req = pb.GetRequest(lease_id=lease_id,
                            layer_begin=layers.start if layers is not None else 0,
                            layer_end=layers.stop if layers is not None else 0,
                            head_begin=heads.start if heads is not None else 0,
                            head_end=heads.stop if heads is not None else 0,
                            format=pb.GET_FORMAT_RAW if fmt == "raw" else pb.GET_FORMAT_FP16,
                            max_chunk_bytes=max_chunk_bytes)
        parts = {}
        for msg in self._stub.Get(req, timeout=self._t(timeout)):
            parts.setdefault(msg.layer, []).append(msg)
        result = GetResult(layers=sorted(parts), tokens=[], layouts=[])
        pages, sinks = [], []
        for layer in result.layers:
            msgs = sorted(parts[layer], key=lambda m: m.block_begin)
            expect = 0
            for m in msgs:
                if m.block_begin != expect:
                    raise RuntimeError(f"Get: layer {layer} is missing blocks [{expect}, "
                                       f"{m.block_begin})")
                expect += m.num_blocks
            k, v = b"".join(m.k for m in msgs), b"".join(m.v for m in msgs)
            blocks, tokens = expect, sum(m.valid_tokens for m in msgs)
            layout = next((m.layout for m in msgs if m.HasField("layout")),
                          pb.PageLayoutDescriptor())
            # Whole blocks of whole heads (len(heads) of them when named), no more tokens.
            head_block = (layout.head_page_bytes if fmt == "raw"
                          else layout.block_tokens * layout.head_dim * 2)
            if (not blocks or not head_block or not k or len(v) != len(k)
                    or len(k) % (blocks * head_block)
                    or (heads is not None and len(k) != blocks * head_block * len(heads))
                    or tokens > blocks * layout.block_tokens):
                raise RuntimeError(f"Get: layer {layer} holds {len(k)} K and {len(v)} V bytes "
                                   f"for {blocks} blocks of {tokens} tokens")
            sink_k, sink_v = b"".join(m.sink_k for m in msgs), b"".join(m.sink_v for m in msgs)
            head_sinks = layout.sink_tokens * layout.head_dim * 2
            if len(sink_v) != len(sink_k) or (sink_k and (
                    not head_sinks or len(sink_k) != len(k) // (blocks * head_block) * head_sinks)):
                raise RuntimeError(f"Get: layer {layer} holds {len(sink_k)} K and {len(sink_v)} V "
                                   "bytes of sink rows")
            sinks.append(tuple(np.frombuffer(x, dtype=np.float16).reshape(
                -1, layout.sink_tokens, layout.head_dim) for x in (sink_k, sink_v))
                         if sink_k else None)
            pages.append((k, v, blocks))
            result.tokens.append(tokens)
            result.layouts.append(layout)
        if fmt == "raw":
            result.pages = [(k, v) for k, v, _ in pages]
            result.sinks = sinks
            return result
        if not pages:
            return result

        def rows(data, blocks, layout):  # [blocks * block_tokens, heads, head_dim]
            x = np.frombuffer(data, dtype=np.float16)
            return x.reshape(blocks * layout.block_tokens, -1, layout.head_dim)
        first = rows(pages[0][0], pages[0][2], result.layouts[0])
        shape = (len(pages), max(result.tokens), first.shape[1], first.shape[2])
        result.k, result.v = np.zeros(shape, np.float16), np.zeros(shape, np.float16)
        for i, (k, v, blocks) in enumerate(pages):
            n = result.tokens[i]
            result.k[i, :n] = rows(k, blocks, result.layouts[i])[:n]
            result.v[i, :n] = rows(v, blocks, result.layouts[i])[:n]
        return result

    # ---- decode ---------------------------------------------------------------------------
    def append(self, lease_id: int, layer: int, k, v, token_ids: Iterable[int] = (),
               timeout=None) -> int:
        """Appends k, v [tokens, heads, head_dim] to `layer` of the lease's tail; returns the
        tokens now held for that layer."""
        k = np.asarray(k)
        return self._stub.Append(pb.AppendRequest(
            lease_id=lease_id, layer=layer, token_ids=list(token_ids), num_tokens=k.shape[0],
            k=_fp16_bytes(k), v=_fp16_bytes(v)), timeout=self._t(timeout)).layer_tokens

    def attend(self, layer: int, items: Sequence[AttendItem], sm_scale: float = 0.0,
               return_lse: bool = False, timeout=None) -> AttendResult:
        resp = self._stub.Attend(_attend_request(layer, items, sm_scale, return_lse),
                                 timeout=self._t(timeout))
        return _attend_result(resp, items, return_lse)

    def attend_in_place(self, timeout=None) -> InPlaceAttendStream:
        """An InPlaceAttendStream over the server's Unix socket (the Client's attend_unix_socket)
        with a region of attend_region_bytes."""
        if not self._attend_unix_socket:
            raise ValueError("attend_in_place needs the Client's attend_unix_socket")
        if self._attend_region_bytes <= 0:
            raise ValueError("attend_in_place needs the Client's attend_region_bytes > 0")
        return InPlaceAttendStream(AttendSocketSession(
            self._attend_unix_socket, self._t(timeout), self._max_message_bytes,
            self._attend_region_bytes))

    def attend_stream(self, timeout=None) -> AttendStream:
        if self._attend_unix_socket:
            return AttendStream(None, None, AttendSocketSession(
                self._attend_unix_socket, self._t(timeout), self._max_message_bytes,
                self._attend_region_bytes))
        if self._attend_socket is not None:
            return AttendStream(None, None, AttendSocketSession(
                self._attend_socket, self._t(timeout), self._max_message_bytes))
        return AttendStream(self._stub, self._t(timeout))

    def stats(self, timeout=None):
        return self._stub.Stats(pb.StatsRequest(), timeout=self._t(timeout))
