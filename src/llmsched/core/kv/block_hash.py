"""Chained block hashes for prefix caching, identical in every process.

A full block's hash covers its parent's hash, its token ids and its extra
keys, so equal hashes mean equal prefixes. The bytes fed to the hash are
fixed-width (a 32-byte parent, 8 bytes per token, length-prefixed extras),
which keeps the encoding unambiguous without pickle; nothing in it depends
on the process, unlike Python's salted ``hash()``.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable

from llmsched.core.errors import ConfigError
from llmsched.core.request import Request

HashFn = Callable[[bytes], bytes]


def _packer(num_blocks: int, block_size: int) -> Callable[..., bytes]:
    """Packs ``num_blocks`` blocks' ids, each block as a hash input's tail without extra keys.

    Each block becomes four zero bytes (the extras' length) and its ids as
    little-endian signed 64-bit integers, so a block's whole input is its
    parent plus one slice. ``struct`` packs a list about three times as fast
    as building an ``array`` from it.
    """
    return struct.Struct("<" + f"4x{block_size}q" * num_blocks).pack


def _splitter(num_blocks: int, block_size: int) -> Callable[[bytes], tuple[bytes, ...]]:
    """Splits ``_packer``'s bytes into its blocks' tails, in one call rather than a slice per block."""
    return struct.Struct(f"{4 + block_size * 8}s" * num_blocks).unpack


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _blake2b(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=32).digest()


def _xxh3_128_digest() -> Callable[[bytes], bytes]:
    """xxhash's 16-byte xxh3_128 digest function."""
    try:
        import xxhash  # optional: a faster, non-cryptographic choice
    except ImportError as e:
        raise ConfigError(
            "prefix_caching_hash_algo='xxh3_128' needs the xxhash package "
            "(pip install xxhash); use 'sha256' or 'blake2b' otherwise"
        ) from e
    return xxhash.xxh3_128_digest


def _xxh3_128() -> HashFn:
    digest = _xxh3_128_digest()
    # Padded to 32 bytes so every algorithm chains with the same layout.
    return lambda data: digest(data) * 2


HASH_ALGOS = ("sha256", "blake2b", "xxh3_128")


def get_hash_fn(name: str) -> HashFn:
    """The hash function called ``name`` (one of HASH_ALGOS)."""
    if name == "sha256":
        return _sha256
    if name == "blake2b":
        return _blake2b
    if name == "xxh3_128":
        return _xxh3_128()
    raise ConfigError(f"prefix_caching_hash_algo={name!r} is unknown; choose one of {', '.join(HASH_ALGOS)}")


# Parent of every request's first block: a constant, so hashes agree across
# processes and runs. Use cache_salt to keep tenants' caches apart.
ROOT_HASH = hashlib.sha256(b"llmsched/prefix-cache/root").digest()


def block_extra_keys(request: Request, block_index: int, block_size: int = 16) -> bytes:
    """Extra key bytes of one block: LoRA on every block, encoder inputs it overlaps, salt on the first only.

    The salt needs to sit in the first block alone because every later hash
    chains through it.
    """
    extra = b""
    # Each field is tagged and length-prefixed so no adapter name can pose as
    # an adapter plus a salt.
    if request.lora_name is not None:
        name = request.lora_name.encode()
        extra += b"L" + len(name).to_bytes(4, "little") + name
    if request.mm_items:
        extra += _mm_extra_keys(request, block_index * block_size, (block_index + 1) * block_size)
    if block_index == 0 and request.cache_salt:
        salt = request.cache_salt.encode()
        extra += b"S" + len(salt).to_bytes(4, "little") + salt
    return extra


def _mm_extra_keys(request: Request, start: int, end: int) -> bytes:
    """Content hash and block-relative offset of every encoder input overlapping ``[start, end)``.

    The same placeholder tokens with another image then hash differently,
    and so does the same image at another position in the block.
    """
    extra = b""
    for it in request.mm_items:
        if it.offset >= end:
            break
        if it.offset + it.length > start:
            ident = it.identifier.encode()
            extra += (
                b"M"
                + len(ident).to_bytes(4, "little")
                + ident
                + (it.offset - start).to_bytes(8, "little", signed=True)
            )
    return extra


class BlockHasher:
    """Computes request block hashes lazily, only as far as they are needed."""

    __slots__ = ("_digest16", "_pack", "_pack1", "_packers", "block_size", "hash_fn")

    def __init__(self, block_size: int, algo: str = "sha256") -> None:
        self.block_size = block_size
        self.hash_fn = get_hash_fn(algo)
        self._pack = struct.Struct(f"<{block_size}q").pack
        # (packer, splitter) by number of blocks packed at once (at most
        # max_model_len / block_size of them).
        self._packers: dict[int, tuple[Callable[..., bytes], Callable[[bytes], tuple[bytes, ...]]]] = {}
        self._pack1 = _packer(1, block_size)
        # xxh3_128's unpadded digest, called directly in extend()'s loop:
        # the padding lambda is a Python call per block, which costs more
        # than the hash itself.
        self._digest16 = _xxh3_128_digest() if algo == "xxh3_128" else None

    def hash_block(self, parent: bytes, token_ids: list[int], extra: bytes = b"") -> bytes:
        """Hash of one full block given its parent's hash."""
        return self.hash_fn(parent + len(extra).to_bytes(4, "little") + extra + self._pack(*token_ids))

    def extend(self, request: Request, num_blocks: int) -> list[bytes]:
        """Make ``request.block_hashes`` cover its first ``num_blocks`` full blocks.

        Blocks are capped at the full blocks the request's tokens fill. Hashes
        never change once computed, so computing them late gives the same
        values as computing them when the tokens arrived.
        """
        hashes = request.block_hashes
        bs = self.block_size
        num_blocks = min(num_blocks, request.num_tokens // bs)
        i = len(hashes)
        if i >= num_blocks:
            return hashes
        tokens = request.token_ids
        parent = hashes[-1] if hashes else ROOT_HASH
        if request.lora_name is None and not request.cache_salt and not request.mm_items:
            n = num_blocks - i
            digest16 = self._digest16
            if n == 1 and digest16 is not None:
                # A decode step's block: _extend_plain's arithmetic for one block, inline.
                d = digest16(parent + self._pack1(*tokens[i * bs : num_blocks * bs]))
                hashes.append(d + d)
                return hashes
            codec = self._packers.get(n)
            if codec is None:
                codec = self._packers[n] = (_packer(n, bs), _splitter(n, bs))
            pack, split = codec
            end = num_blocks * bs
            # A whole prompt of full blocks is packed without copying it first.
            ids = tokens if i == 0 and end == len(tokens) else tokens[i * bs : end]
            self._extend_plain(hashes, parent, split(pack(*ids)))
            return hashes
        while i < num_blocks:
            start = i * bs
            parent = self.hash_block(parent, tokens[start : start + bs], block_extra_keys(request, i, bs))
            hashes.append(parent)
            i += 1
        return hashes

    def _extend_plain(self, hashes: list[bytes], parent: bytes, tails: tuple[bytes, ...]) -> None:
        """Append the chained hashes of the blocks whose inputs' tails are ``tails`` (no extra keys)."""
        append = hashes.append
        digest16 = self._digest16
        if digest16 is not None:
            for tail in tails:
                d = digest16(parent + tail)
                parent = d + d
                append(parent)
            return
        hash_fn = self.hash_fn
        for tail in tails:
            parent = hash_fn(parent + tail)
            append(parent)
