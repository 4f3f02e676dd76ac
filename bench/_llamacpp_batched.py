"""llama.cpp's own batched decoding, for bench/vs_llamacpp.py at concurrency 16: run by the
python of the llama-cpp-python venv (never the project's), through llama.cpp's C API as its
`batched` example uses it: one context with a sequence per prompt, every prompt prefilled in
one `llama_decode` batch, then one batch per step holding each sequence's next token.

Greedy, exactly `max_tokens` new tokens per prompt: end-of-generation tokens are masked (as
the server's `min_tokens` does). Untimed: loading and one warm-up pass of the same batch.

    python _llamacpp_batched.py GGUF THREADS MAX_TOKENS PROMPTS.json

loads the model, prints `ready`, then for each line read on stdin generates the whole batch
once and prints one JSON line: {"tokens_per_s": ..., "prompt_tokens": [...], "texts": [...]}.
It lives for the whole benchmark, so the bench knows its pid (a round's CPU is its own).
"""

import ctypes
import json
import sys
import time

import llama_cpp as L
import numpy as np


def tokenize(vocab, text: str) -> list[int]:
    raw = text.encode()
    room = len(raw) + 16
    out = (L.llama_token * room)()
    n = L.llama_tokenize(vocab, raw, len(raw), out, room, False, True)  # parse special tokens
    if n < 0:
        raise SystemExit(f"tokenize failed ({n})")
    return list(out[:n])


def piece(vocab, token: int) -> str:
    buf = ctypes.create_string_buffer(256)
    n = L.llama_token_to_piece(vocab, token, buf, len(buf), 0, False)
    return buf.raw[: max(n, 0)].decode("utf-8", errors="replace")


def generate(
    ctx, vocab, prompts: list[list[int]], max_tokens: int, eog: np.ndarray
) -> list[list[int]]:
    L.llama_memory_clear(L.llama_get_memory(ctx), True)
    n_vocab = L.llama_vocab_n_tokens(vocab)
    total = sum(len(p) for p in prompts)
    batch = L.llama_batch_init(max(total, len(prompts)), 0, len(prompts))
    try:
        # prefill: every prompt in one batch, logits at each prompt's last token
        batch.n_tokens = 0
        last = []
        for seq, prompt in enumerate(prompts):
            for pos, token in enumerate(prompt):
                i = batch.n_tokens
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
                batch.seq_id[i][0] = seq
                batch.logits[i] = pos == len(prompt) - 1
                batch.n_tokens += 1
            last.append(batch.n_tokens - 1)
        out: list[list[int]] = [[] for _ in prompts]
        for step in range(max_tokens):
            if L.llama_decode(ctx, batch) != 0:
                raise SystemExit("llama_decode failed")
            chosen = []
            for index in last:
                logits = np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, index), (n_vocab,))
                chosen.append(int(np.argmax(np.where(eog, -np.inf, logits))))
            for seq, token in enumerate(chosen):
                out[seq].append(token)
            if step == max_tokens - 1:
                break
            batch.n_tokens = 0
            last = []
            for seq, token in enumerate(chosen):
                i = batch.n_tokens
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, len(prompts[seq]) + step, 1
                batch.seq_id[i][0] = seq
                batch.logits[i] = True
                batch.n_tokens += 1
                last.append(i)
        return out
    finally:
        L.llama_batch_free(batch)


def main() -> None:
    gguf, threads, max_tokens, prompts_file = (
        sys.argv[1],
        int(sys.argv[2]),
        int(sys.argv[3]),
        sys.argv[4],
    )
    with open(prompts_file) as f:
        texts = json.load(f)
    L.llama_backend_init()
    model = L.llama_model_load_from_file(gguf.encode(), L.llama_model_default_params())
    vocab = L.llama_model_get_vocab(model)
    prompts = [tokenize(vocab, t) for t in texts]
    longest = max(len(p) for p in prompts) + max_tokens
    params = L.llama_context_default_params()
    params.n_seq_max = len(prompts)
    params.n_ctx = len(prompts) * (longest + 16)
    params.n_batch = params.n_ubatch = max(sum(len(p) for p in prompts), 512)
    params.n_threads = params.n_threads_batch = threads
    ctx = L.llama_init_from_model(model, params)
    n_vocab = L.llama_vocab_n_tokens(vocab)
    eog = np.array([bool(L.llama_vocab_is_eog(vocab, t)) for t in range(n_vocab)])
    generate(ctx, vocab, prompts, max_tokens, eog)  # warm-up
    print("ready", flush=True)
    for _ in sys.stdin:
        start = time.perf_counter()
        out = generate(ctx, vocab, prompts, max_tokens, eog)
        seconds = time.perf_counter() - start
        result = {
            "tokens_per_s": len(prompts) * max_tokens / seconds,
            "prompt_tokens": [len(p) for p in prompts],
            "texts": ["".join(piece(vocab, t) for t in o) for o in out],
        }
        print(json.dumps(result), flush=True)
    L.llama_free(ctx)
    L.llama_model_free(model)


if __name__ == "__main__":
    main()
