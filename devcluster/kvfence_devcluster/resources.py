"""Resource kinds and the API's errors: what the store, the HTTP layer and the controllers share."""

import random
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

NAME_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"  # what Kubernetes uses for generated suffixes


def now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def random_suffix(length: int = 5) -> str:
    return "".join(random.choices(NAME_ALPHABET, k=length))


@dataclass(frozen=True, slots=True)
class ResourceType:
    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool
    subresources: frozenset[str] = frozenset()
    custom: bool = False

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def qualified(self) -> str:
        """As Kubernetes names it in messages: `deployments.apps`, `pods`."""
        return f"{self.plural}.{self.group}" if self.group else self.plural

    @property
    def has_status(self) -> bool:
        return "status" in self.subresources

    @property
    def tracks_generation(self) -> bool:
        return self.custom or self.group in ("apps", "batch")

    @property
    def default_propagation(self) -> str:
        # batch/v1 Jobs orphan their pods unless told otherwise (kept for compatibility).
        return "Orphan" if (self.group, self.plural) == ("batch", "jobs") else "Background"


class ApiError(Exception):
    """A Kubernetes API failure, rendered as a metav1.Status."""

    def __init__(
        self, code: int, reason: str, message: str, details: dict[str, Any] | None = None
    ) -> None:
        super().__init__(f"{code} {reason}: {message}")
        self.code, self.reason, self.message, self.details = code, reason, message, details

    def status(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }
        if self.details:
            body["details"] = self.details
        return body


def _details(rt: ResourceType, name: str) -> dict[str, Any]:
    return {"name": name, "group": rt.group, "kind": rt.plural}


def not_found(rt: ResourceType, name: str) -> ApiError:
    return ApiError(404, "NotFound", f'{rt.qualified} "{name}" not found', _details(rt, name))


def already_exists(rt: ResourceType, name: str) -> ApiError:
    message = f'{rt.qualified} "{name}" already exists'
    return ApiError(409, "AlreadyExists", message, _details(rt, name))


def conflict(rt: ResourceType, name: str, why: str) -> ApiError:
    message = f'Operation cannot be fulfilled on {rt.qualified} "{name}": {why}'
    return ApiError(409, "Conflict", message, _details(rt, name))


def invalid(rt: ResourceType, name: str, why: str) -> ApiError:
    return ApiError(422, "Invalid", f'{rt.kind} "{name}" is invalid: {why}', _details(rt, name))


def bad_request(message: str) -> ApiError:
    return ApiError(400, "BadRequest", message)
