"""The conversation cache: evicted conversations' KV in host RAM, in blocks keyed by their exact
token prefix.

When a slot's kept KV is about to be overwritten by an unrelated request, its full blocks (BLOCK
tokens each) are copied to host RAM. A block's key is a hash chained over the token prefix up to the
block's end (key_i = H(key_{i-1} || tokens of block i)); the index maps a key to the blocks stored
under it, and each block holds its own tokens and its parent block. A lookup walks the prompt block
by block and accepts a block only when its parent is the block accepted just before and its tokens
equal the prompt's: so a match is the exact token prefix by induction, and a hash collision (tests
use a deliberately weak hash) can never hand one conversation's KV to another (llama.cpp issue
27148). A chain stored under a cache_salt starts from the salt (its first key is H(salt || tokens)),
and each block keeps the salt, which a lookup compares too: blocks of one salt never match a prompt
of another (prefix_cache.py).

Bounds: --conversation-cache-mib M (bytes of KV) and --conversation-cache-slots N (conversations; 0
= no bound on their number), least recently used conversation out first. A conversation is the chain
of blocks saved from one slot; conversations that share a prefix (a system prompt) share its blocks
(reference counts), and a later turn of a conversation replaces the earlier turn's entry, whose
chain it extends.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np


def blake2b_key(parent: bytes, tokens: np.ndarray) -> bytes:
    """The chained key of a block: 16 bytes of BLAKE2b over the parent's key and the block's
    tokens."""
    return hashlib.blake2b(parent + np.ascontiguousarray(tokens, np.int32).tobytes(),
                           digest_size=16).digest()


def _root(salt: str | None) -> bytes:
    """The key a chain starts from: b"" without a salt (the keys of before), else the salt's
    bytes."""
    return b"" if salt is None else b"salt:" + salt.encode("utf-8", "surrogatepass")


@dataclass(eq=False)
class Block:
    key: bytes
    parent: Block | None
    # [B] int32: exactly the tokens whose KV this block holds
    tokens: np.ndarray
    # name -> [layers, B, kv_heads(, head_dim)]: k, v (and int8 scales)
    kv: dict[str, np.ndarray]
    nbytes: int
    refs: int = 0                           # conversations holding this block
    salt: str | None = None                 # the cache_salt it was stored under


@dataclass(eq=False)
class Conversation:
    id: int
    blocks: list[Block] = field(default_factory=list)


class ConversationCache:
    def __init__(self, block: int, max_bytes: int, max_conversations: int,
                 key_fn: Callable[[bytes, np.ndarray], bytes] = blake2b_key):
        self.block = block
        self.max_bytes = max_bytes
        self.max_conversations = max_conversations          # 0: no bound on their number
        self.key_fn = key_fn
        # key -> blocks under it (more than one only on a collision)
        self.index: dict[bytes, list[Block]] = {}
        # least recently used first
        self.conversations: OrderedDict[int, Conversation] = OrderedDict()
        self.bytes = 0
        self._ids = itertools.count(1)
        self.counters = {"lookups": 0, "hits": 0, "restored_tokens": 0, "stored_blocks": 0,
                         "stored_bytes": 0, "evicted_blocks": 0, "evicted_conversations": 0,
                         "restored_bytes": 0}

    # ---- lookups ---------------------------------------------------------------------------------

    def lookup(self, prompt: list[int] | np.ndarray, limit: int,
               salt: str | None = None) -> list[Block]:
        """match, counted as a lookup (a request's prompt looked for here: the hit rate's
        denominator)."""
        self.counters["lookups"] += 1
        return self.match(prompt, limit, salt)

    def match(self, prompt: list[int] | np.ndarray, limit: int,
              salt: str | None = None) -> list[Block]:
        """The longest run of stored blocks (stored under `salt`) that is exactly prompt's prefix,
        covering at most `limit` tokens."""
        toks = np.asarray(prompt, np.int32)
        B, out, parent, key = self.block, [], None, _root(salt)
        for i in range(min(limit, len(toks)) // B):
            want = toks[i * B:(i + 1) * B]
            key = self.key_fn(key, want)
            found = next((b for b in self.index.get(key, ())
                          if b.parent is parent and b.salt == salt
                          and np.array_equal(b.tokens, want)), None)
            if found is None:
                break
            out.append(found)
            parent = found
        return out

    def touch(self, blocks: list[Block]) -> None:
        """A restore used these blocks: the conversations that hold the last one become the most
        recent."""
        if not blocks:
            return
        last = blocks[-1]
        for cid, conv in list(self.conversations.items()):
            if last in conv.blocks:
                self.conversations.move_to_end(cid)

    # ---- storing ---------------------------------------------------------------------------------

    def store(self, tokens: list[int], read_block: Callable[[int], dict[str, np.ndarray]],
              salt: str | None = None) -> tuple[int, int]:
        """Keep the full blocks of a slot's `tokens` (its kept KV, of a request with cache_salt
        `salt`); read_block(i) copies block i's KV from the device (only for blocks not stored yet).
        -> (new blocks, evicted blocks)."""
        toks = np.asarray(tokens, np.int32)
        B = self.block
        n = len(toks) // B
        if n == 0 or self.max_bytes <= 0:
            return 0, 0
        # blocks already here (a shared prefix, an earlier turn)
        chain = self.match(toks, n * B, salt)
        # all stored already (a conversation holds them): touch it
        if len(chain) == n:
            self.touch(chain)
            return 0, 0
        for b in chain:
            # held by the new entry, so evictions below keep them
            b.refs += 1
        new, evicted = 0, 0
        conv = Conversation(next(self._ids), list(chain))
        parent, key = (chain[-1], chain[-1].key) if chain else (None, _root(salt))
        for i in range(len(chain), n):
            want = toks[i * B:(i + 1) * B].copy()
            kv = read_block(i)
            nbytes = sum(int(a.nbytes) for a in kv.values()) + want.nbytes
            evicted += self._make_room(nbytes, keep=conv)
            # even alone it does not fit: keep the prefix stored so far
            if self.bytes + nbytes > self.max_bytes:
                break
            key = self.key_fn(key, want)
            blk = Block(key, parent, want, kv, nbytes, refs=1, salt=salt)
            self.index.setdefault(key, []).append(blk)
            self.bytes += nbytes
            conv.blocks.append(blk)
            parent = blk
            new += 1
            self.counters["stored_blocks"] += 1
            self.counters["stored_bytes"] += nbytes
        if not conv.blocks:
            return new, evicted
        # An entry whose chain is a prefix of this one (the same conversation's earlier turn) is
        # replaced.
        for cid, old in list(self.conversations.items()):
            if (len(old.blocks) <= len(conv.blocks)
                    and conv.blocks[len(old.blocks) - 1] is old.blocks[-1]):
                evicted += self._drop(cid, count=False)
        self.conversations[conv.id] = conv
        while self.max_conversations and len(self.conversations) > self.max_conversations:
            evicted += self._drop(next(iter(self.conversations)))
        return new, evicted

    def _make_room(self, nbytes: int, keep: Conversation) -> int:
        evicted = 0
        while self.bytes + nbytes > self.max_bytes and self.conversations:
            evicted += self._drop(next(iter(self.conversations)))
        return evicted

    def _drop(self, cid: int, count: bool = True) -> int:
        """Forget a conversation; its blocks that no other conversation holds leave RAM. -> blocks
        freed."""
        conv = self.conversations.pop(cid)
        freed = 0
        for b in conv.blocks:
            b.refs -= 1
            if b.refs == 0:
                bucket = self.index[b.key]
                bucket.remove(b)
                if not bucket:
                    del self.index[b.key]
                self.bytes -= b.nbytes
                freed += 1
        self.counters["evicted_blocks"] += freed
        if count:
            self.counters["evicted_conversations"] += 1
        return freed

    def stats(self) -> dict:
        return {**self.counters, "blocks": sum(len(v) for v in self.index.values()),
                "bytes": self.bytes,
                "conversations": len(self.conversations), "block_tokens": self.block,
                "max_bytes": self.max_bytes, "max_conversations": self.max_conversations}
