"""kvpool_client.rendezvous_shard and shard_for place sequences exactly as the C++ client's
RendezvousShard and ShardedKvPoolClient::ShardFor do (the table is the one
tests/client/kvpool_client_test.cc pins for the C++ side), keep sequences that share their first
block together, and move only the removed shard's sequences when a shard goes."""

import random

import pytest

from kvpool_client import rendezvous_shard, shard_for

T3 = ["kvpool-0:50051", "kvpool-1:50051", "kvpool-2:50051"]
T8 = [f"10.0.0.{i}:50051" for i in range(1, 9)]
A = list(range(1, 17))
B = [128000 - 7 * i for i in range(16)]
C = [2147483647, 0, 5, 99999, 42]


@pytest.mark.parametrize("targets,namespace,ids,shard", [
    (T3, "other", A, 1), (T3, "", A, 0), (T3, "default", B, 0), (T8, "llama", A, 2),
    (T8, "llama", B, 3), (T8, "qwen", C, 6), (T8, "", [], 0), (T8, "llama", C, 5)])
def test_placement_equals_the_cpp_clients(targets, namespace, ids, shard):
    assert rendezvous_shard(targets, namespace, ids) == shard


def test_the_default_namespace_spelled_either_way_places_alike():
    rng = random.Random(3)
    for _ in range(50):
        ids = [rng.randrange(128000) for _ in range(16)]
        assert rendezvous_shard(T8, "", ids) == rendezvous_shard(T8, "default", ids)


def test_prompts_sharing_their_first_block_share_a_shard():
    rng = random.Random(11)
    system = [rng.randrange(128000) for _ in range(16)]
    want = shard_for(T8, system, 16, "llama")
    for _ in range(20):
        prompt = system + [rng.randrange(128000) for _ in range(40)]
        assert shard_for(T8, prompt, 16, "llama") == want


def test_removing_a_shard_moves_only_its_own_sequences():
    four, three = ["a:1", "b:1", "c:1", "d:1"], ["a:1", "b:1", "d:1"]
    rng = random.Random(5)
    counts = [0] * 4
    for _ in range(2000):
        ids = [rng.randrange(128000) for _ in range(16)]
        before = rendezvous_shard(four, "ns", ids)
        counts[before] += 1
        if four[before] != "c:1":
            assert three[rendezvous_shard(three, "ns", ids)] == four[before]
    assert all(400 < c < 600 for c in counts), counts


def test_no_targets_is_an_error():
    with pytest.raises(ValueError):
        rendezvous_shard([], "", [1])
