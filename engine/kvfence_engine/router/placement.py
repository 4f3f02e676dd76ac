"""Prefix-aware choice of a prefill instance (issue 17): requests of one tenant that begin with
the same tokens go to the same instance, where its prefix cache holds their pages.

The routing key chains (routing secret, tenant, the prompt's first tokens) through keyed
BLAKE2b, length-prefixed and domain-separated as the prefix cache's own keys are; each instance
is scored by rendezvous (highest random weight) hashing of that key and its URL. Without the
secret nobody can compute where a prompt lands, so placement cannot be steered or mapped from
outside (e.g. to make a victim's prompt share an instance with an attacker's probes, or to read
a tenant's traffic from which instance is slow). The tenant comes from authentication only.

Bounded loads (Mirrokni, Thorup, Zadimoroghaddam, "Consistent Hashing with Bounded Loads"): an
instance takes a request only while its outstanding requests are under
ceil(LOAD_FACTOR x (all outstanding + 1) / instances), and never below MIN_LOAD_BOUND (a prefill
engine batches a few prompts at once, and at low load a spill costs a cache miss for nothing);
otherwise, or when it is down, the key
goes to its next instance by rank, so a hot prefix spills over to a stable second instance
rather than piling up on one. Removing an instance moves only the keys it ranked first.

Pure: no I/O, no clock; BackendPool supplies the candidates and their loads.
"""

import hashlib
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

DOMAIN = b"kvfence/prefill-route/v1"
MIN_SECRET_BYTES = 16
LOAD_FACTOR = 1.25
MIN_LOAD_BOUND = 4
# The prompt's first tokens that place it: 4 pages of 16. Enough that a single-tenant deployment
# (every request tenant 'default', sharing a chat template's opening) still spreads by system
# prompt; few enough that every turn of a conversation shares them.
DEFAULT_PREFIX_TOKENS = 64


def _field(data: bytes) -> bytes:
    return struct.pack(">Q", len(data)) + data


@dataclass(frozen=True, slots=True)
class Candidate:
    """An instance the request may go to: its URL (its identity for hashing) and load."""

    url: str
    outstanding: int
    alive: bool = True


class PrefixRouting:
    """The routing secret and how many leading tokens form the key."""

    def __init__(self, secret: bytes, prefix_tokens: int = DEFAULT_PREFIX_TOKENS) -> None:
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"the routing secret must be at least {MIN_SECRET_BYTES} bytes")
        if prefix_tokens < 1:
            raise ValueError("prefix_tokens must be at least 1")
        self._secret = secret[:64]  # BLAKE2b takes a key of at most 64 bytes
        self.prefix_tokens = prefix_tokens

    @classmethod
    def from_file(cls, path: Path, prefix_tokens: int = DEFAULT_PREFIX_TOKENS) -> "PrefixRouting":
        try:
            return cls(path.read_bytes().strip(), prefix_tokens)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None

    def key(self, tenant: str, prompt_ids: Sequence[int]) -> bytes:
        """The request's routing key: the tenant and its first prefix_tokens tokens (all of a
        shorter prompt), under the secret."""
        head = prompt_ids[: self.prefix_tokens]
        h = hashlib.blake2b(key=self._secret, digest_size=32, person=b"kvfence-route")
        h.update(_field(DOMAIN))
        h.update(_field(tenant.encode("utf-8", "surrogatepass")))
        h.update(_field(struct.pack(f"<{len(head)}q", *head)))
        return h.digest()

    def ranking(self, key: bytes, urls: Sequence[str]) -> list[str]:
        """The instances by rendezvous score for this key, best first (ties by URL)."""
        scores = {url: _score(key, url) for url in urls}
        return sorted(urls, key=lambda u: (-scores[u], u))

    def choose(
        self, tenant: str, prompt_ids: Sequence[int], candidates: Sequence[Candidate]
    ) -> str:
        """The URL to send the prompt to: the first live instance by rank whose load is within
        the bound, else the least-outstanding live one. ValueError when none is alive."""
        alive = [c for c in candidates if c.alive]
        if not alive:
            raise ValueError("no live instance")
        bound = load_bound(sum(c.outstanding for c in alive), len(alive))
        by_url = {c.url: c for c in alive}
        for url in self.ranking(self.key(tenant, prompt_ids), list(by_url)):
            if by_url[url].outstanding < bound:
                return url
        # Not reached while LOAD_FACTOR > 1 (the least loaded is under the average, so under
        # the bound); kept so that a change of factor cannot leave a request unplaced.
        return min(alive, key=lambda c: c.outstanding).url


def load_bound(total_outstanding: int, instances: int) -> int:
    """How many outstanding requests an instance may hold before a new key passes it by."""
    return max(MIN_LOAD_BOUND, math.ceil(LOAD_FACTOR * (total_outstanding + 1) / instances))


def _score(key: bytes, url: str) -> int:
    h = hashlib.blake2b(key=key, digest_size=8, person=b"kvfence-hrw")
    h.update(_field(url.encode()))
    return int.from_bytes(h.digest(), "big")
