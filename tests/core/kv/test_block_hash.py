"""Chained block hashing: chaining, stability across processes, LoRA and salt keys, algorithms."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import llmsched
from llmsched.core.errors import ConfigError
from llmsched.core.kv.block_hash import ROOT_HASH, BlockHasher, block_extra_keys, get_hash_fn
from llmsched.core.request import Request

BS = 4
TOKENS = list(range(100, 116))  # four full blocks of 4


def make_request(tokens: list[int] = TOKENS, **kw: object) -> Request:
    """A request over ``tokens`` with the given keyword options (lora_id, cache_salt, ...)."""
    return Request("r", tokens, arrival_time=0.0, **kw)  # type: ignore[arg-type]


def hashes_of(tokens: list[int], algo: str = "sha256", bs: int = BS, **kw: object) -> list[bytes]:
    """Every full block's hash for a fresh request over ``tokens``."""
    req = make_request(tokens, **kw)
    return list(BlockHasher(bs, algo).extend(req, len(tokens)))


# ---- algorithms --------------------------------------------------------------


def test_sha256_is_sha256() -> None:
    assert get_hash_fn("sha256")(b"abc") == hashlib.sha256(b"abc").digest()


def test_blake2b_is_32_byte_blake2b() -> None:
    assert get_hash_fn("blake2b")(b"abc") == hashlib.blake2b(b"abc", digest_size=32).digest()


@pytest.mark.parametrize("algo", ["sha256", "blake2b"])
def test_supported_algorithms_hash_blocks(algo: str) -> None:
    hs = hashes_of(TOKENS, algo)
    assert len(hs) == 4
    assert all(len(x) == 32 for x in hs)
    assert len(set(hs)) == 4
    assert hashes_of(TOKENS, algo) == hs


def test_algorithms_give_different_hashes() -> None:
    assert set(hashes_of(TOKENS, "sha256")).isdisjoint(hashes_of(TOKENS, "blake2b"))


@pytest.mark.parametrize("algo", ["md5", "SHA256", "", "crc32"])
def test_unknown_algorithm_names_it(algo: str) -> None:
    with pytest.raises(ConfigError) as exc_info:
        get_hash_fn(algo)
    assert repr(algo) in str(exc_info.value)
    with pytest.raises(ConfigError):
        BlockHasher(BS, algo)


def test_xxh3_128_needs_xxhash() -> None:
    if importlib.util.find_spec("xxhash") is None:
        with pytest.raises(ConfigError) as exc_info:
            get_hash_fn("xxh3_128")
        assert "xxhash" in str(exc_info.value)
    else:
        hs = hashes_of(TOKENS, "xxh3_128")
        assert len(hs) == 4
        assert all(len(x) == 32 for x in hs)


# ---- chaining ----------------------------------------------------------------


def test_only_full_blocks_are_hashed() -> None:
    assert len(hashes_of(TOKENS[:15])) == 3
    assert len(hashes_of(TOKENS[:3])) == 0
    assert hashes_of(TOKENS[:15]) == hashes_of(TOKENS)[:3]


def test_extend_caps_at_full_blocks() -> None:
    req = make_request(TOKENS[:10])
    assert len(BlockHasher(BS).extend(req, 10)) == 2
    assert len(req.block_hashes) == 2


def test_hashes_follow_the_chain_rule() -> None:
    hasher = BlockHasher(BS)
    hs = hashes_of(TOKENS)
    parent = ROOT_HASH
    for i, got in enumerate(hs):
        assert got == hasher.hash_block(parent, TOKENS[i * BS : (i + 1) * BS])
        parent = got


@pytest.mark.parametrize("changed_block", [0, 1, 2, 3])
def test_changing_one_token_changes_that_block_and_later(changed_block: int) -> None:
    base = hashes_of(TOKENS)
    tokens = list(TOKENS)
    tokens[changed_block * BS + 1] += 1000
    changed = hashes_of(tokens)
    for i in range(4):
        if i < changed_block:
            assert changed[i] == base[i]
        else:
            assert changed[i] != base[i]


def test_same_block_tokens_at_different_position_hash_differently() -> None:
    block = [7, 7, 7, 7]
    hs = hashes_of(block * 3)
    assert len(set(hs)) == 3


def test_token_order_within_block_matters() -> None:
    assert hashes_of([1, 2, 3, 4]) != hashes_of([2, 1, 3, 4])


def test_large_token_ids_distinct() -> None:
    assert hashes_of([2**40, 0, 0, 0]) != hashes_of([0, 2**40, 0, 0])
    assert hashes_of([2**32, 0, 0, 0]) != hashes_of([0, 1, 0, 0])


def test_lazy_extension_matches_eager() -> None:
    hasher = BlockHasher(BS)
    req = make_request(TOKENS)
    hasher.extend(req, 1)
    assert len(req.block_hashes) == 1
    hasher.extend(req, 1)
    assert len(req.block_hashes) == 1
    hasher.extend(req, 3)
    assert len(req.block_hashes) == 3
    hasher.extend(req, 4)
    assert req.block_hashes == hashes_of(TOKENS)


def test_hashes_extend_over_generated_tokens() -> None:
    hasher = BlockHasher(BS)
    req = make_request(TOKENS[:6])
    hasher.extend(req, 10)
    assert len(req.block_hashes) == 1
    for t in TOKENS[6:]:
        req.append_output_token(t)
    hasher.extend(req, 10)
    assert req.block_hashes == hashes_of(TOKENS)


def test_block_size_enters_the_hash() -> None:
    by4 = hashes_of(TOKENS, bs=4)
    by8 = hashes_of(TOKENS, bs=8)
    assert len(by8) == 2
    assert set(by4).isdisjoint(by8)


# ---- extra keys: LoRA and cache salt -------------------------------------------


def test_no_extra_keys_for_plain_request() -> None:
    req = make_request()
    assert block_extra_keys(req, 0) == b""
    assert block_extra_keys(req, 3) == b""


def test_lora_changes_every_block() -> None:
    base = hashes_of(TOKENS)
    with_lora = hashes_of(TOKENS, lora_id=1)
    assert all(a != b for a, b in zip(base, with_lora))
    assert len(with_lora) == len(base)


def test_lora_is_in_every_blocks_extra_keys() -> None:
    req = make_request(lora_id=2, lora_name="sql")
    for i in range(4):
        assert b"sql" in block_extra_keys(req, i)


def test_lora_enters_each_block_not_only_through_chain() -> None:
    hasher = BlockHasher(BS)
    with_lora = hashes_of(TOKENS, lora_id=1)
    # Block 1 chained from the LoRA block 0 but without its own LoRA key differs.
    assert with_lora[1] != hasher.hash_block(with_lora[0], TOKENS[BS : 2 * BS])
    req = make_request(lora_id=1)
    assert with_lora[1] == hasher.hash_block(with_lora[0], TOKENS[BS : 2 * BS], block_extra_keys(req, 1))


def test_different_loras_differ_same_lora_agrees() -> None:
    a = hashes_of(TOKENS, lora_id=1, lora_name="a")
    b = hashes_of(TOKENS, lora_id=2, lora_name="b")
    assert all(x != y for x, y in zip(a, b))
    assert hashes_of(TOKENS, lora_id=1, lora_name="a") == a


def test_cache_salt_only_in_first_block_extra_keys() -> None:
    salted = make_request(cache_salt="tenant-7")
    plain = make_request()
    assert b"tenant-7" in block_extra_keys(salted, 0)
    for i in range(1, 4):
        assert b"tenant-7" not in block_extra_keys(salted, i)
        assert block_extra_keys(salted, i) == block_extra_keys(plain, i)


def test_cache_salt_changes_later_hashes_through_chain() -> None:
    base = hashes_of(TOKENS)
    salted = hashes_of(TOKENS, cache_salt="tenant-7")
    assert all(a != b for a, b in zip(base, salted))
    hasher = BlockHasher(BS)
    # Later blocks carry no salt of their own: plain chaining from the salted parent.
    for i in range(1, 4):
        assert salted[i] == hasher.hash_block(salted[i - 1], TOKENS[i * BS : (i + 1) * BS])


def test_different_salts_differ_same_salt_agrees() -> None:
    a = hashes_of(TOKENS, cache_salt="a")
    assert hashes_of(TOKENS, cache_salt="a") == a
    assert all(x != y for x, y in zip(a, hashes_of(TOKENS, cache_salt="b")))


def test_salt_and_lora_together() -> None:
    both = hashes_of(TOKENS, lora_id=1, cache_salt="s")
    assert set(both).isdisjoint(hashes_of(TOKENS, lora_id=1))
    assert set(both).isdisjoint(hashes_of(TOKENS, cache_salt="s"))


# ---- stability across processes -----------------------------------------------

_CHILD = textwrap.dedent(
    """
    import json
    from llmsched.core.kv.block_hash import BlockHasher
    from llmsched.core.request import Request

    out = {}
    for name, kw in [("plain", {}), ("lora", {"lora_id": 3}), ("salt", {"cache_salt": "s1"})]:
        for algo in ("sha256", "blake2b"):
            req = Request("r", list(range(100, 116)), arrival_time=0.0, **kw)
            out[f"{name}-{algo}"] = [x.hex() for x in BlockHasher(4, algo).extend(req, 4)]
    print(json.dumps(out))
    """
)


def child_hashes(hash_seed: str) -> dict[str, list[str]]:
    """Hashes computed in a fresh interpreter with the given PYTHONHASHSEED."""
    src = str(Path(llmsched.__file__).resolve().parents[1])
    path = os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONHASHSEED=hash_seed, PYTHONPATH=path)
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, check=True, timeout=60
    )
    return json.loads(proc.stdout)


def test_hashes_identical_across_processes() -> None:
    first = child_hashes("1")
    second = child_hashes("987654")
    assert first == second
    here: dict[str, list[str]] = {}
    for name, kw in [("plain", {}), ("lora", {"lora_id": 3}), ("salt", {"cache_salt": "s1"})]:
        for algo in ("sha256", "blake2b"):
            here[f"{name}-{algo}"] = [x.hex() for x in hashes_of(TOKENS, algo, **kw)]
    assert first == here
    assert len(first["plain-sha256"]) == 4


def test_lora_name_cannot_pose_as_lora_plus_salt() -> None:
    # Equal hashes must mean equal (tokens, adapter, salt): the extra-key fields
    # need their own framing, not only the extras' total length.
    lora_only = hashes_of(TOKENS, lora_id=1, lora_name="a\x00Sb")
    lora_and_salt = hashes_of(TOKENS, lora_id=1, lora_name="a", cache_salt="b")
    assert lora_only[0] != lora_and_salt[0]
