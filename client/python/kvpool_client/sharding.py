"""Shard placement of a sequence over kvpool servers, the same as the C++ client's
RendezvousShard (client/kvpool_client.h): rendezvous (highest random weight) hashing of the
namespace and the token ids of the sequence's first block, with a hash that is stable across
processes, builds and languages, so Python and C++ workers place a shared system prompt on the
same shard. "" hashes as "default", the name kvpool-server gives its default namespace."""

from typing import Sequence

_MASK = (1 << 64) - 1


def _mix(z: int) -> int:
    """splitmix64's finalizer (64-bit)."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def _hash_bytes(data: bytes, seed: int) -> int:
    """FNV-1a over the bytes, then mixed."""
    h = 0xCBF29CE484222325 ^ seed
    for c in data:
        h = ((h ^ c) * 0x100000001B3) & _MASK
    return _mix(h)


def rendezvous_shard(targets: Sequence[str], namespace: str,
                     first_block_token_ids: Sequence[int]) -> int:
    """Index in `targets` (non-empty) of the shard for a sequence whose first block holds
    `first_block_token_ids` (all its ids when it is shorter than a block)."""
    if not targets:
        raise ValueError("no shard targets")
    key = _hash_bytes((namespace or "default").encode(), 0)
    for token in first_block_token_ids:
        key = (_mix(key ^ (int(token) & 0xFFFFFFFF)) + 0x9E3779B97F4A7C15) & _MASK
    best, best_weight = 0, -1
    for i, target in enumerate(targets):
        weight = _mix(_hash_bytes(target.encode(), 0x6B76706F6F6C) ^ key)
        if weight > best_weight:
            best, best_weight = i, weight
    return best


def shard_for(targets: Sequence[str], token_ids: Sequence[int], block_tokens: int,
              namespace: str = "") -> int:
    """The shard of a sequence of a namespace whose blocks hold `block_tokens` tokens, as
    ShardedKvPoolClient::ShardFor places it. A lease lives on the shard that issued it: keep that
    shard for the lease's later calls (a sequence shorter than one block moves as it grows)."""
    n = min(len(token_ids), block_tokens if block_tokens > 0 else 16)
    return rendezvous_shard(targets, namespace, list(token_ids[:n]))
