"""kvpool_client.Client against a real kvpool-server: fp16 round trip through INT4 pages,
remote attention, AttendStream decode over gRPC and over the AttendSocket, stats, and status
codes of bad requests."""

import threading
import time

import grpc
import numpy as np
import pytest

from kvpool_client import AttendItem, AttendSocketError, Client

LAYERS, HEADS, DIM, BLOCK = 2, 2, 64, 16


def outlier_kv(tokens, seed):
    """k, v [LAYERS, tokens, HEADS, DIM]: N(0,1) plus a few large fixed-channel outliers."""
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((LAYERS, tokens, HEADS, DIM))
    v = rng.standard_normal((LAYERS, tokens, HEADS, DIM))
    channels = rng.choice(DIM // 2, size=3, replace=False)
    k[..., channels] += 12.0 * rng.choice([-1.0, 1.0], size=3)
    v[..., channels[:2]] *= 5.0
    return k.astype(np.float16), v.astype(np.float16)


def rel_err(x, ref):
    return float(np.linalg.norm(np.asarray(x, np.float64) - ref) / np.linalg.norm(ref))


def attention(q, k, v):
    """fp64 GQA attention of q [q_heads, DIM] over k, v [tokens, HEADS, DIM]."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    group = q.shape[0] // HEADS
    out = np.empty_like(q)
    for h in range(q.shape[0]):
        s = k[:, h // group] @ q[h] / np.sqrt(DIM)
        p = np.exp(s - s.max())
        out[h] = p @ v[:, h // group] / p.sum()
    return out


@pytest.fixture(scope="module")
def client(server):
    with Client(server, timeout=30) as c:
        c.create_namespace("pytest", LAYERS, HEADS, DIM, block_tokens=BLOCK, dtype="int4",
                           rotation_seed=7, capacity_bytes=16 << 20)
        yield c


def put_sequence(client, tokens, seed):
    ids = np.random.default_rng(seed + 1).integers(0, 128000, tokens).tolist()
    k, v = outlier_kv(tokens, seed)
    resp = client.put(ids, k, v, namespace="pytest")
    return ids, k, v, resp


def test_put_match_get_round_trips_fp16_within_int4_tolerance(client):
    ids, k, v, resp = put_sequence(client, 40, seed=11)
    assert (resp.tokens_stored, resp.tokens_ignored) == (32, 8)
    assert resp.bytes_received == k.nbytes + v.nbytes
    m = client.match(ids, namespace="pytest")
    assert m.cached_tokens == 32 and m.num_blocks == 2
    try:
        got = client.get(m.lease_id)
        assert got.k.shape == (LAYERS, 32, HEADS, DIM)
        k_err = rel_err(got.k, k[:, :32].astype(np.float64))
        v_err = rel_err(got.v, v[:, :32].astype(np.float64))
        assert 0 < k_err < 0.15 and 0 < v_err < 0.15, (k_err, v_err)
        raw = client.get(m.lease_id, fmt="raw")
        assert raw.layouts[0].head_dim == DIM and raw.layouts[0].codes_bytes > 0
        assert len(raw.pages[0][0]) == 2 * HEADS * raw.layouts[0].head_page_bytes
    finally:
        client.release(m.lease_id)


def test_get_reports_each_layers_tokens_when_appends_are_in_flight(client):
    ids, k, v, _ = put_sequence(client, 32, seed=15)
    m = client.match(ids, namespace="pytest")
    try:
        new_k, new_v = outlier_kv(1, 16)
        assert client.append(m.lease_id, 0, new_k[0], new_v[0]) == 33
        got = client.get(m.lease_id)  # geometry from the server: not the default namespace's
        assert got.tokens == [33, 32]
        assert got.k.shape == (LAYERS, 33, HEADS, DIM)
        assert not got.k[1, 32].any() and not got.v[1, 32].any()
        assert rel_err(got.k[0, 32:], new_k[0].astype(np.float64)) < 0.15
    finally:
        client.release(m.lease_id)


def test_a_stream_left_on_an_exception_leaves_no_thread_behind(client):
    before = threading.active_count()
    for _ in range(3):
        with pytest.raises(grpc.RpcError):
            with client.attend_stream(timeout=10) as stream:
                stream.step(0, [AttendItem(123456789, np.zeros((4 * HEADS, DIM), np.float16))])
    deadline = time.monotonic() + 5
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threading.active_count() <= before


def test_a_failed_stream_step_ends_its_thread_without_close(client):
    """A step that fails ends the call: gRPC's request-consuming thread ends too, although the
    stream is dropped without close() or a with block."""
    before = threading.active_count()
    for _ in range(3):
        stream = client.attend_stream(timeout=10)
        with pytest.raises(grpc.RpcError):
            stream.step(0, [AttendItem(123456789, np.zeros((4 * HEADS, DIM), np.float16))])
        del stream
    deadline = time.monotonic() + 5
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threading.active_count() <= before


def test_a_dropped_stream_ends_its_thread_after_good_steps(client):
    """A stream dropped without close() or a with block after steps that succeeded ends its call
    and gRPC's request-consuming thread."""
    ids, _, _, _ = put_sequence(client, 32, seed=51)
    m = client.match(ids, namespace="pytest")
    q = np.ones((2 * HEADS, DIM), np.float16)
    try:
        before = threading.active_count()
        for _ in range(3):
            stream = client.attend_stream(timeout=10)
            assert stream.step(0, [AttendItem(m.lease_id, q)]).context_tokens == [32]
            del stream
        deadline = time.monotonic() + 5
        while threading.active_count() > before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert threading.active_count() <= before
    finally:
        client.release(m.lease_id)


def test_a_finished_stream_raises_a_status_on_every_later_step(client):
    """As the AttendSocket's sessions do: a failed stream raises its failure again, a closed one
    FAILED_PRECONDITION."""
    ids, _, _, _ = put_sequence(client, 32, seed=53)
    m = client.match(ids, namespace="pytest")
    q = np.ones((2 * HEADS, DIM), np.float16)
    try:
        stream = client.attend_stream(timeout=10)
        with pytest.raises(grpc.RpcError) as e:
            stream.step(0, [AttendItem(m.lease_id + 1000, q)])
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.RpcError) as e:
            stream.step(0, [AttendItem(m.lease_id, q)])
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        stream = client.attend_stream(timeout=10)
        assert stream.step(0, [AttendItem(m.lease_id, q)]).context_tokens == [32]
        stream.close()
        with pytest.raises(grpc.RpcError) as e:
            stream.step(0, [AttendItem(m.lease_id, q)])
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        client.release(m.lease_id)


def test_second_put_of_a_shared_prefix_is_a_prefix_hit(client):
    ids, k, v, _ = put_sequence(client, 32, seed=21)
    resp = client.put(ids + [5] * 16, np.concatenate([k, k[:, :16]], axis=1),
                      np.concatenate([v, v[:, :16]], axis=1), namespace="pytest")
    assert (resp.tokens_cached, resp.tokens_stored) == (32, 16)


def test_attend_matches_fp64_attention_over_the_fp16_kv(client):
    ids, k, v, _ = put_sequence(client, 48, seed=31)
    m = client.match(ids, namespace="pytest")
    try:
        q = np.random.default_rng(3).standard_normal((4 * HEADS, DIM)).astype(np.float16)
        res = client.attend(1, [AttendItem(m.lease_id, q)], return_lse=True)
        assert res.context_tokens == [48] and not res.server_draining
        assert res.out.shape == (1, 4 * HEADS, DIM) and res.lse.shape == (1, 4 * HEADS)
        # Exact up to rounding against the pool's own (dequantized) K/V; within the INT4
        # error of the recipe (~0.2 with outlier channels) against the fp16 that was sent.
        deq = client.get(m.lease_id)
        assert rel_err(res.out[0], attention(q, deq.k[1], deq.v[1])) < 0.02
        err = rel_err(res.out[0], attention(q, k[1], v[1]))
        assert 0 < err < 0.35, err
    finally:
        client.release(m.lease_id)


@pytest.fixture(scope="module")
def socket_client(server, attend_socket_port, client):
    """A Client whose attend_stream() sessions use the AttendSocket (after `client` made the
    namespace)."""
    with Client(server, timeout=30, attend_socket_port=attend_socket_port) as c:
        yield c


@pytest.fixture(scope="module")
def region_client(server, attend_unix_socket, client):
    """A Client whose attend_stream() sessions use the AttendSocket's Unix socket and a
    shared-memory region."""
    with Client(server, timeout=30, attend_unix_socket=attend_unix_socket,
                attend_region_bytes=1 << 20) as c:
        yield c


@pytest.mark.parametrize("transport", ["grpc", "socket", "region"])
def test_attend_stream_appends_one_token_per_step(client, socket_client, region_client,
                                                   transport):
    decoder = {"grpc": client, "socket": socket_client, "region": region_client}[transport]
    ids, k, v, _ = put_sequence(client, 32, seed=41)
    extra_k, extra_v = outlier_kv(3, seed=42)
    m = client.match(ids, namespace="pytest")
    try:
        with decoder.attend_stream() as stream:
            for step in range(3):
                for layer in range(LAYERS):
                    q = np.random.default_rng(step * 10 + layer).standard_normal(
                        (2 * HEADS, DIM)).astype(np.float16)
                    item = AttendItem(m.lease_id, q, extra_k[layer, step], extra_v[layer, step],
                                      900 + step)
                    res = stream.step(layer, [item])
                    assert res.context_tokens == [33 + step]
                    full_k = np.concatenate([k[layer], extra_k[layer, :step + 1]])
                    full_v = np.concatenate([v[layer], extra_v[layer, :step + 1]])
                    assert rel_err(res.out[0], attention(q, full_k, full_v)) < 0.35
                    # The unary call sees the same context without appending: equal outputs.
                    again = client.attend(layer, [AttendItem(m.lease_id, q)])
                    np.testing.assert_array_equal(again.out, res.out)
    finally:
        client.release(m.lease_id)


def test_attend_socket_bad_step_raises_its_status_and_ends_the_session(socket_client):
    ids, _, _, _ = put_sequence(socket_client, 32, seed=45)
    m = socket_client.match(ids, namespace="pytest")
    q = np.ones((2 * HEADS, DIM), np.float16)
    try:
        with socket_client.attend_stream() as stream:
            assert stream.step(0, [AttendItem(m.lease_id, q)]).context_tokens == [32]
            with pytest.raises(AttendSocketError) as e:
                stream.step(0, [AttendItem(m.lease_id + 1000, q)])
            assert e.value.code() == grpc.StatusCode.NOT_FOUND
            with pytest.raises(AttendSocketError) as e:  # the session stays finished
                stream.step(0, [AttendItem(m.lease_id, q)])
            assert e.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(ValueError):
            Client("unix:/tmp/kvpool.sock", attend_socket_port=1)
    finally:
        socket_client.release(m.lease_id)


def test_attend_socket_answer_over_max_message_bytes_is_resource_exhausted(
        server, attend_socket_port, client):
    ids, _, _, _ = put_sequence(client, 32, seed=47)
    m = client.match(ids, namespace="pytest")
    q = np.ones((2 * HEADS, DIM), np.float16)  # 512 bytes out, 1,024 back (fp32)
    try:
        with Client(server, timeout=30, attend_socket_port=attend_socket_port,
                    max_message_bytes=800) as c, c.attend_stream() as stream:
            with pytest.raises(AttendSocketError) as e:
                stream.step(0, [AttendItem(m.lease_id, q)])
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        client.release(m.lease_id)


def test_attend_socket_without_a_message_limit_steps(server, attend_socket_port, client):
    """max_message_bytes=-1 is gRPC's "no limit", on the AttendSocket too."""
    ids, _, _, _ = put_sequence(client, 32, seed=49)
    m = client.match(ids, namespace="pytest")
    q = np.ones((2 * HEADS, DIM), np.float16)
    try:
        with Client(server, timeout=30, attend_socket_port=attend_socket_port,
                    max_message_bytes=-1) as c, c.attend_stream() as stream:
            assert stream.step(0, [AttendItem(m.lease_id, q)]).context_tokens == [32]
    finally:
        client.release(m.lease_id)


def test_attend_socket_request_over_the_servers_limit_is_resource_exhausted(
        server, attend_socket_port, client):
    """A step over the server's --max_message_bytes (64 MiB) is refused from its frame's header;
    the server reads the rest, so the client's send completes and it reads the status at once."""
    ids, _, _, _ = put_sequence(client, 32, seed=50)
    m = client.match(ids, namespace="pytest")
    q = np.ones(((65 << 20) // (2 * DIM), DIM), np.float16)  # 65 MiB
    try:
        with Client(server, timeout=30, attend_socket_port=attend_socket_port,
                    max_message_bytes=128 << 20) as c, c.attend_stream() as stream:
            start = time.monotonic()
            with pytest.raises(AttendSocketError) as e:
                stream.step(0, [AttendItem(m.lease_id, q)])
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert time.monotonic() - start < 10  # not the session's 30 s timeout
    finally:
        client.release(m.lease_id)


def test_attend_socket_step_past_the_session_deadline_is_not_sent(server, attend_socket_port,
                                                                   client):
    """The step raises DEADLINE_EXCEEDED, appends nothing, and closes the session's socket."""
    ids, _, _, _ = put_sequence(client, 32, seed=48)
    extra_k, extra_v = outlier_kv(1, seed=49)
    m = client.match(ids, namespace="pytest")
    q = np.ones((2 * HEADS, DIM), np.float16)
    try:
        with Client(server, timeout=30, attend_socket_port=attend_socket_port) as c:
            stream = c.attend_stream(timeout=1.0)
            sock = stream._socket._sock  # the connection, to see it closed
            assert stream.step(0, [AttendItem(m.lease_id, q)]).context_tokens == [32]
            time.sleep(1.2)
            with pytest.raises(AttendSocketError) as e:
                stream.step(0, [AttendItem(m.lease_id, q, extra_k[0, 0], extra_v[0, 0], 900)])
            assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert sock.fileno() == -1
        assert client.attend(0, [AttendItem(m.lease_id, q)]).context_tokens == [32]
    finally:
        client.release(m.lease_id)


def test_in_place_steps_match_unary_attend(server, attend_unix_socket, client):
    """q written into the region by the caller, one item appending its K/V from the region too:
    the outputs (views of the region) equal the unary Attend's over the same context."""
    seqs = [put_sequence(client, 32, seed=61 + i) for i in range(2)]
    leases = [client.match(ids, namespace="pytest").lease_id for ids, _, _, _ in seqs]
    try:
        with Client(server, timeout=30, attend_unix_socket=attend_unix_socket,
                    attend_region_bytes=1 << 20) as c, c.attend_in_place() as s:
            for step in range(2):
                rng = np.random.default_rng(70 + step)
                q = rng.standard_normal((2, 2 * HEADS, DIM)).astype(np.float16)
                appends = [step == 1, False]
                extra_k, extra_v = outlier_kv(1, seed=80 + step)
                lay = s.layout(2, 2 * HEADS, DIM, appending=sum(appends), num_kv_heads=HEADS,
                               fp32=True)
                s.region[lay.q:lay.q + q.nbytes] = q.view(np.uint8).reshape(-1)
                if step == 1:
                    k, v = extra_k[0, 0].astype(np.float16), extra_v[0, 0].astype(np.float16)
                    s.region[lay.new_k:lay.new_k + k.nbytes] = k.view(np.uint8).reshape(-1)
                    s.region[lay.new_v:lay.new_v + v.nbytes] = v.view(np.uint8).reshape(-1)
                res = s.step(0, leases, 2 * HEADS, DIM, lay, appends=appends,
                             new_token_ids=[900, -1], fp32=True)
                assert res.context_tokens == [32 + step, 32]
                want = client.attend(0, [AttendItem(leases[0], q[0]), AttendItem(leases[1], q[1])])
                np.testing.assert_array_equal(res.out, want.out)
    finally:
        for lease in leases:
            client.release(lease)


def test_in_place_step_with_another_steps_layout_is_refused_before_it_is_sent(
        server, attend_unix_socket, client):
    """The server lays a step out by its items and appends: a layout made for more items, or for
    another count of appends, would have the output read (or the new V written) elsewhere. The
    step is refused with ValueError, nothing sent, and the session serves the right layout."""
    ids, _, _, _ = put_sequence(client, 32, seed=66)
    lease = client.match(ids, namespace="pytest").lease_id
    try:
        with Client(server, timeout=30, attend_unix_socket=attend_unix_socket,
                    attend_region_bytes=1 << 20) as c, c.attend_in_place() as s:
            q = np.random.default_rng(67).standard_normal((2 * HEADS, DIM)).astype(np.float16)
            for wrong in (s.layout(4, 2 * HEADS, DIM, num_kv_heads=HEADS),
                          s.layout(1, 2 * HEADS, DIM, appending=1, num_kv_heads=HEADS),
                          s.layout(1, 2 * HEADS, DIM, num_kv_heads=HEADS, fp32=True)):
                with pytest.raises(ValueError):
                    s.step(0, [lease], 2 * HEADS, DIM, wrong)
            lay = s.layout(1, 2 * HEADS, DIM, num_kv_heads=HEADS, fp32=True)
            s.region[lay.q:lay.q + q.nbytes] = q.view(np.uint8).reshape(-1)
            res = s.step(0, [lease], 2 * HEADS, DIM, lay, fp32=True)
            assert res.context_tokens == [32]
            np.testing.assert_array_equal(res.out, client.attend(0, [AttendItem(lease, q)]).out)
    finally:
        client.release(lease)


def test_in_place_session_needs_a_region(server, attend_unix_socket):
    with Client(server, timeout=30, attend_unix_socket=attend_unix_socket,
                attend_region_bytes=0) as c:
        with pytest.raises(ValueError):
            c.attend_in_place()


def test_failed_in_place_session_raises_its_error_again(server, attend_unix_socket):
    """An in-place step on an unknown lease ends the session with NOT_FOUND; the next step raises
    that error again (not a new FAILED_PRECONDITION, which a caller might retry)."""
    with Client(server, timeout=30, attend_unix_socket=attend_unix_socket,
                attend_region_bytes=1 << 20) as c, c.attend_in_place() as s:
        lay = s.layout(1, 2 * HEADS, DIM, num_kv_heads=HEADS)
        for _ in range(2):
            with pytest.raises(AttendSocketError) as e:
                s.step(0, [424242], 2 * HEADS, DIM, lay)
            assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_region_step_too_large_for_the_region_raises_invalid_argument(server,
                                                                     attend_unix_socket, client):
    ids, _, _, _ = put_sequence(client, 32, seed=47)
    m = client.match(ids, namespace="pytest")
    q = np.ones((2 * HEADS, DIM), np.float16)
    try:
        with Client(server, timeout=30, attend_unix_socket=attend_unix_socket,
                    attend_region_bytes=4096) as small:
            with small.attend_stream() as stream:
                assert stream.step(0, [AttendItem(m.lease_id, q)]).context_tokens == [32]
                with pytest.raises(AttendSocketError) as e:
                    stream.step(0, [AttendItem(m.lease_id, q)] * 8)
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        client.release(m.lease_id)


def test_stats_report_the_namespace_and_its_compression(client, backend):
    put_sequence(client, 32, seed=51)
    stats = client.stats()
    assert stats.backend == backend
    ns = next(n for n in stats.namespaces if n.name == "pytest")
    assert ns.tokens_stored >= 32
    assert 0 < ns.bytes_per_token < ns.fp16_bytes_per_token
    info = client.namespace("pytest")
    assert info.fp16_bytes_per_token == 2 * LAYERS * HEADS * DIM * 2


def test_nan_in_kv_is_invalid_argument_and_stores_nothing(client):
    ids = list(range(1000, 1032))
    k, v = outlier_kv(32, seed=61)
    k[1, 5, 0, 3] = np.nan
    with pytest.raises(grpc.RpcError) as e:
        client.put(ids, k, v, namespace="pytest")
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    m = client.match(ids, namespace="pytest")
    assert m.cached_tokens == 0
    client.release(m.lease_id)


def test_unknown_lease_and_namespace_are_not_found(client):
    with pytest.raises(grpc.RpcError) as e:
        client.release(987654321)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as e:
        client.match([1, 2, 3], namespace="no-such-namespace")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_raw_get_from_the_first_block_carries_the_exact_sink_rows(client):
    client.create_namespace("pytest-raw-sinks", LAYERS, HEADS, DIM, block_tokens=BLOCK,
                            sink_tokens=4, capacity_bytes=1 << 20)
    ids = np.random.default_rng(41).integers(0, 128000, 2 * BLOCK).tolist()
    k, v = outlier_kv(2 * BLOCK, 42)
    client.put(ids, k, v, namespace="pytest-raw-sinks")
    m = client.match(ids, namespace="pytest-raw-sinks")
    try:
        raw = client.get(m.lease_id, heads=range(1, 2), fmt="raw", max_chunk_bytes=1)
        assert [layout.sink_tokens for layout in raw.layouts] == [4] * LAYERS
        for layer, (sink_k, sink_v) in enumerate(raw.sinks):
            assert sink_k.shape == sink_v.shape == (1, 4, DIM)
            assert np.array_equal(sink_k[0], k[layer, :4, 1])  # bit for bit: fp16 kept as sent
            assert np.array_equal(sink_v[0], v[layer, :4, 1])
        assert client.get(m.lease_id, fmt="raw").sinks[0][0].shape == (HEADS, 4, DIM)
        assert client.get(m.lease_id, fmt="raw", layers=range(1, 2)).sinks[0] is not None
    finally:
        client.release(m.lease_id)
    # A namespace without sinks sends none.
    ids, _, _, _ = put_sequence(client, 16, seed=43)
    m = client.match(ids, namespace="pytest")
    try:
        assert client.get(m.lease_id, fmt="raw").sinks == [None] * LAYERS
    finally:
        client.release(m.lease_id)


def test_default_rotation_block_divides_head_dims_that_are_not_powers_of_two(client, backend):
    if backend != "cpu":
        pytest.skip("the CUDA kernels take head_dim 64, 128 and 256 only")
    info = client.create_namespace("pytest-hd96", LAYERS, HEADS, 96, block_tokens=BLOCK,
                                   capacity_bytes=1 << 20)
    assert info.spec.rotation_block == 32
    ids = np.random.default_rng(51).integers(0, 128000, BLOCK).tolist()
    k = np.random.default_rng(52).standard_normal((LAYERS, BLOCK, HEADS, 96)).astype(np.float16)
    client.put(ids, k, k, namespace="pytest-hd96")
    m = client.match(ids, namespace="pytest-hd96")
    try:
        assert rel_err(client.get(m.lease_id).k, k.astype(np.float64)) < 0.15
    finally:
        client.release(m.lease_id)


def test_sink_pages_are_shared_out_one_per_blocks_per_sink_page(client):
    info = client.create_namespace("pytest-sinks", LAYERS, HEADS, DIM, block_tokens=BLOCK,
                                   sink_tokens=4, blocks_per_sink_page=4, capacity_bytes=1 << 20)
    assert info.spec.blocks_per_sink_page == 4
    assert info.num_sink_blocks == -(-info.num_blocks // 4)
    default = client.create_namespace("pytest-sinks-default", LAYERS, HEADS, DIM,
                                      block_tokens=BLOCK, sink_tokens=4, capacity_bytes=1 << 20)
    assert default.spec.blocks_per_sink_page == 16
    assert default.num_blocks > info.num_blocks  # fewer sink pages, more blocks
