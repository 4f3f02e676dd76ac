"""What tests read of an OpenAI answer's usage beyond its token counts: the prompt tokens it
says came from the prefix cache. The client types the usage, its prompt_tokens_details and
their cached_tokens as optional at every level; an answer that leaves one out fails here."""

from openai.types import CompletionUsage


def cached_tokens(usage: CompletionUsage | None) -> int:
    """usage.prompt_tokens_details.cached_tokens, which the answer must report."""
    assert usage is not None and usage.prompt_tokens_details is not None, usage
    cached = usage.prompt_tokens_details.cached_tokens
    assert cached is not None, usage
    return cached
