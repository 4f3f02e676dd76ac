"""Keys for the tenant-scoped prefix cache: which full prompt pages may be reused, and by whom.

A page's key chains (server secret, tenant, client salt, parent page's key, the page's token
ids) through keyed BLAKE2b: without the secret nobody can compute a key (so nobody can engineer
a collision or predict one), and two tenants sending the same tokens get unrelated keys, so a
lookup by one never finds the other's pages. The client's `cache_salt` is one more field: it can
only narrow sharing within the tenant, never widen it. Every field is length-prefixed and the
whole is domain-separated, so no two different inputs encode to the same bytes.

No torch here: keys are computed at admission, on any thread.
"""

import hashlib
import os
import struct
from pathlib import Path

DOMAIN = b"kvfence/prefix-page/v1"
SECRET_BYTES = 32
# Decode never computes a prompt's KV (prefill sends all of it, cached prefix included), so it
# has no cache to look up. The flag is accepted there as a no-op, said once in the log: a
# deployment passes its engines one set of flags (the CRD's engine.extraArgs) for both roles.
DECODE_HAS_NO_PREFIX_CACHE = (
    "--prefix-cache: no effect in the decode role, which receives each prompt's whole KV from "
    "prefill (where the cache is); /v1/kvpool reports prefix_cache false here"
)


def _field(data: bytes) -> bytes:
    return struct.pack(">Q", len(data)) + data


class PrefixKeys:
    """Computes the chained keys of a prompt's full pages for one engine process."""

    def __init__(self, secret: bytes, page_size: int, *, scope_by_tenant: bool = True) -> None:
        if len(secret) < 16:
            raise ValueError("the prefix-cache secret must be at least 16 bytes")
        self._secret = secret[:64]  # BLAKE2b takes a key of at most 64 bytes
        self.page_size = page_size
        # Only the cross-tenant-prefix fault turns this off: the tenant leaves the key.
        self.scope_by_tenant = scope_by_tenant

    @classmethod
    def random(cls, page_size: int, *, scope_by_tenant: bool = True) -> "PrefixKeys":
        return cls(os.urandom(SECRET_BYTES), page_size, scope_by_tenant=scope_by_tenant)

    @classmethod
    def from_file(cls, path: Path, page_size: int, *, scope_by_tenant: bool = True) -> "PrefixKeys":
        return cls(path.read_bytes().strip(), page_size, scope_by_tenant=scope_by_tenant)

    def page_keys(self, tenant: str, salt: str | None, token_ids: list[int]) -> list[bytes]:
        """One key per full page of `token_ids`, in order; a partial last page has none."""
        scope = _field(tenant.encode("utf-8", "surrogatepass") if self.scope_by_tenant else b"")
        scope += _field(b"" if salt is None else b"\x01" + salt.encode("utf-8", "surrogatepass"))
        keys: list[bytes] = []
        parent = b""
        size = self.page_size
        for start in range(0, len(token_ids) - size + 1, size):
            page = struct.pack(f"<{size}q", *token_ids[start : start + size])
            h = hashlib.blake2b(key=self._secret, digest_size=32, person=b"kvfence-prefix")
            h.update(_field(DOMAIN) + scope + _field(parent) + _field(page))
            parent = h.digest()
            keys.append(parent)
        return keys
