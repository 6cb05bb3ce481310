"""Client.get() against a stub that answers with crafted messages: blocks missing at a layer's
start or inside it, K and V of other sizes than the blocks hold, or more heads or tokens than
asked raise, instead of arrays shaped by the server's word."""

import pytest

from kvpool_client import Client
from kvpool_client.v1 import kvpool_pb2 as pb


def part(layer, begin, blocks, heads=1, tokens=None):
    """fp16 blocks of one token of head_dim 1 per head (2 bytes per head and block)."""
    m = pb.GetResponse(layer=layer, block_begin=begin, num_blocks=blocks,
                       valid_tokens=blocks if tokens is None else tokens,
                       k=b"\x00\x3c" * blocks * heads, v=b"\x00\x3c" * blocks * heads)
    if begin == 0:
        m.layout.block_tokens, m.layout.head_dim = 1, 1
    return m


class FakeStub:
    def __init__(self, msgs):
        self.msgs = msgs

    def Get(self, req, timeout=None):  # pylint: disable=invalid-name
        return iter(self.msgs)


@pytest.fixture
def offline_client():
    c = Client("127.0.0.1:1")  # never connects: the stub is replaced
    yield c
    c.close()


def test_well_formed_messages_give_their_arrays(offline_client):
    offline_client._stub = FakeStub([part(0, 1, 2), part(0, 0, 1)])
    got = offline_client.get(1)
    assert got.k.shape == (1, 3, 1, 1) and got.tokens == [3]


@pytest.mark.parametrize("msgs,heads", [
    ([part(0, 1, 1)], None),                      # block 0 missing
    ([part(0, 0, 1), part(0, 2, 1)], None),       # block 1 missing
    ([pb.GetResponse(layer=0, num_blocks=2, valid_tokens=1, k=b"\x00\x3c", v=b"\x00\x3c",
                     layout=pb.PageLayoutDescriptor(block_tokens=1, head_dim=1))], None),
    ([part(0, 0, 1, heads=2)], range(0, 1)),      # two heads' bytes for the one asked
    ([part(0, 0, 1, tokens=2)], None),            # more tokens than the block holds
])
def test_malformed_messages_raise(offline_client, msgs, heads):
    offline_client._stub = FakeStub(msgs)
    with pytest.raises(RuntimeError):
        offline_client.get(1, heads=heads)


def raw_part(sink_k, sink_v, sink_tokens=2):
    """A RAW block of one head (a 2-byte head page) with sink rows of head_dim 1."""
    m = pb.GetResponse(layer=0, block_begin=0, num_blocks=1, valid_tokens=1, k=b"\x00\x3c",
                       v=b"\x00\x3c", sink_k=sink_k, sink_v=sink_v)
    m.layout.block_tokens, m.layout.head_dim, m.layout.head_page_bytes = 1, 1, 2
    m.layout.sink_tokens = sink_tokens
    return m


def test_raw_sink_rows_come_back_shaped(offline_client):
    offline_client._stub = FakeStub([raw_part(b"\x00\x3c\x00\x40", b"\x00\x42\x00\x44")])
    (sink_k, sink_v), = offline_client.get(1, fmt="raw").sinks
    assert sink_k.shape == (1, 2, 1) and sink_k.tolist() == [[[1.0], [2.0]]]
    assert sink_v.tolist() == [[[3.0], [4.0]]]


@pytest.mark.parametrize("msg", [
    raw_part(b"\x00\x3c\x00\x40", b"\x00\x42"),                  # V shorter than K
    raw_part(b"\x00\x3c\x00\x40\x00\x3c", b"\x00\x42\x00\x44\x00\x42"),  # three rows, not two
    raw_part(b"\x00\x3c\x00\x40", b"\x00\x42\x00\x44", sink_tokens=0),  # rows the layout lacks
])
def test_malformed_sink_rows_raise(offline_client, msg):
    offline_client._stub = FakeStub([msg])
    with pytest.raises(RuntimeError):
        offline_client.get(1, fmt="raw")
