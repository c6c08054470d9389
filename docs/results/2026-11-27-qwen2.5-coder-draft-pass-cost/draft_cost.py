"""What one pass of the 0.5B draft model costs against one of the 1.5B target, on each path.

    python draft_cost.py [THREADS]

One-token passes after 300 cached tokens, median of 15, 2 threads by default: the target on its
default path (the GGUF's own int4 blocks), the draft on the path its target's precision gives it
(the GGUF's blocks: 5-bit stored, run at 8 bits), the draft rounded to int4, and that with its
output layer cut to the 32,768 most used tokens. Also the bytes a pass reads (every linear
layer's packed weights and the rest of the parameters once; the embedding one row) and what the
machine's bandwidth makes of them.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from leapdecode.engine.backend import TorchBackend
from leapdecode.engine.draft_head import DraftHeadBackend
from leapdecode.heads.vocabulary import draft_vocabulary
from leapdecode.methods import DraftModel
from leapdecode.models import default_cache_dir, load_model

CONTEXT, REPEATS = 300, 15


def pass_ms(backend: TorchBackend) -> float:
    with torch.inference_mode():
        seq, _ = backend.prefill([1000 + (i * 37) % 20000 for i in range(CONTEXT)])
        times = []
        for _ in range(REPEATS):
            start = time.perf_counter()
            backend.forward(seq, [1234])
            times.append(time.perf_counter() - start)
            backend.rollback(seq, CONTEXT)
    return 1000 * sorted(times)[REPEATS // 2]


def pass_bytes(model: torch.nn.Module, head: torch.nn.Module | None = None) -> int:
    """Bytes a one-token pass reads: packed linear weights, other parameters, one embedding row."""
    embed = model.get_input_embeddings().weight
    total = embed[0].numel() * embed.element_size()
    layers = [m for m in model.modules() if m is not model.get_output_embeddings() or head is None]
    seen: set[int] = {id(embed)}
    for module in [*layers, *([head] if head is not None else [])]:
        for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            if id(tensor) not in seen:
                seen.add(id(tensor))
                total += tensor.numel() * tensor.element_size()
    return total


def main() -> None:
    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
    quiet = lambda message: None  # noqa: E731
    rows = {}
    target = load_model("qwen2.5-coder-1.5b", log=quiet)
    rows["1.5B target, the GGUF's int4 blocks"] = (
        pass_ms(TorchBackend(target.model, exact_tokens=target.exact_tokens)),
        pass_bytes(target.model),
    )
    own = load_model("qwen2.5-coder-0.5b", log=quiet)
    rows["0.5B, the GGUF's blocks (5-bit at 8 bits)"] = (pass_ms(TorchBackend(own.model)), pass_bytes(own.model))
    del own
    draft = DraftModel(model="qwen2.5-coder-0.5b").load_draft(target, quiet)
    rows["0.5B int4 (draft:precision=int4,vocab=0)"] = (pass_ms(TorchBackend(draft.model)), pass_bytes(draft.model))
    size = draft.model.config.get_text_config().vocab_size
    vocab, source = draft_vocabulary(target.tokenizer, 32768, size, sorted(target.eos_token_ids), default_cache_dir())
    trimmed = DraftHeadBackend(draft.model, vocab.ids)
    rows[f"0.5B int4, 32,768-token draft vocabulary ({source})"] = (
        pass_ms(trimmed),
        pass_bytes(draft.model, trimmed.head),
    )
    base = next(iter(rows.values()))[0]
    print("| path | ms a pass | × the target's | MB a pass | GB/s |")
    print("|---|---:|---:|---:|---:|")
    for name, (ms, nbytes) in rows.items():
        print(f"| {name} | {ms:.1f} | {ms / base:.2f} | {nbytes / 2**20:.0f} | {nbytes / ms / 1e6:.1f} |")
    print(json.dumps({k: {"ms": v[0], "bytes": v[1]} for k, v in rows.items()}))


if __name__ == "__main__":
    main()
