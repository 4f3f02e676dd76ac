"""Who may call a local `up`: the tenants of `--tenant KEY=NAME`, `--api-key` and `--api-keys
FILE`, checked before anything starts.

On a cluster the tenants are the `api-keys` of `spec.router.apiKeysSecret`, a file the routers
re-read when it changes. Locally the same two forms exist: entries given on the command line,
which `up` writes into the router's keys file in its state folder at every start (with the
canary's two tenants), and keys files of the user's own, which the router reads where they are,
re-reading them when they change (a key revoked there stops working without a restart). The
state folder's file is `up`'s, rewritten each time; nothing the user gave is kept only there.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvfence_engine.router.keys import KeysFileError, entry_problem, parse_keys_files
from kvfence_operator.builders.secret import CANARY_TENANTS

# `--api-key KEY` (and the default key) is this tenant's.
LOCAL_TENANT = "local"


class TenantsError(ValueError):
    """Tenants that cannot be served; the message says which flag and why (never a key)."""


@dataclass(frozen=True, slots=True)
class LocalTenants:
    entries: tuple[tuple[str, str], ...]  # (key, tenant) from --api-key and --tenant
    files: tuple[Path, ...]  # --api-keys FILE, absolute: handed to the router as they are
    names_in_files: tuple[str, ...]  # the files' tenants when `up` started

    @classmethod
    def make(
        cls, api_key: str | None, tenants: Sequence[tuple[str, str]], files: Sequence[Path]
    ) -> "LocalTenants":
        """`api_key` is LOCAL_TENANT's; `tenants` are --tenant's (key, name). Checks everything
        the router would refuse, and what it would not but must not be: a key given twice (two
        tenants for one key), a tenant named as the canary's."""
        entries = [(api_key, LOCAL_TENANT)] if api_key is not None else []
        entries += tenants
        if not entries and not files:
            raise TenantsError("no tenant: give --tenant KEY=NAME, --api-key or --api-keys")
        seen: dict[str, str] = {}
        for key, tenant in entries:
            problem = entry_problem(key, tenant)
            if problem is None and key in seen:
                problem = f"a key of tenant {tenant!r} is also given for tenant {seen[key]!r}"
            if problem:
                raise TenantsError(f"--tenant: {problem}")
            seen[key] = tenant
        absolute = tuple(path.resolve() for path in files)
        try:
            in_files = parse_keys_files([str(path) for path in absolute])
        except (KeysFileError, OSError) as exc:
            raise TenantsError(f"--api-keys: {exc}") from None
        for key, tenant in in_files.items():
            if key in seen:
                raise TenantsError(
                    f"--api-keys: a key of tenant {tenant!r} is also given for tenant {seen[key]!r}"
                )
        for tenant in {t for _, t in entries} | set(in_files.values()):
            if tenant in CANARY_TENANTS:
                raise TenantsError(
                    f"tenant {tenant!r} is the canary's own: give your tenant another name"
                )
        return cls(tuple(entries), absolute, tuple(sorted(set(in_files.values()))))

    def keys_file_lines(self) -> str:
        """The entries, as the router's keys file has them ('KEY TENANT' a line)."""
        return "".join(f"{key} {tenant}\n" for key, tenant in self.entries)

    def names(self) -> list[str]:
        return sorted({t for _, t in self.entries} | set(self.names_in_files))

    def describe(self) -> str:
        """For the serving line: one key of the local tenant is shown (the default one is no
        secret); otherwise the tenants' names, never their keys."""
        if not self.files and len(self.entries) == 1 and self.entries[0][1] == LOCAL_TENANT:
            return f"api key: {self.entries[0][0]}"
        names = self.names()
        return f"{len(names)} tenant{'s' if len(names) != 1 else ''}: {', '.join(names)}"
