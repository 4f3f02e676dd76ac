"""kvfence engine: a paged-attention LLM engine whose KV reads are tag-checked.

Importing this package must not import torch: the `kvfence` command (and the operator image)
use it without the engine's heavy dependencies.
"""

__version__ = "0.1.0"
