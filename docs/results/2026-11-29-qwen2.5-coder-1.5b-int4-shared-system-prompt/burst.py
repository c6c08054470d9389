"""A burst of chat requests that share one long system prompt, with and without the prefix cache.

CLIENTS requests arrive together, each the same system prompt (about 330 tokens: an assistant's
house rules) and a question of its own (the first turns of Spec-Bench's multi-turn, QA and math
categories), 64 new tokens each, greedy; served through the scheduler as `serve` runs it, plain
rows and the default method, each with the prefix cache (8,192 tokens) and without, in
alternating order for ROUNDS rounds; then `llama-server` with a slot per request, with
`cache_prompt` and without. With the cache, the requests that join while the first is
being prefilled wait for it to pass the system prompt and start from copies of its cache: the
system prompt is prefilled once, not CLIENTS times. Every output is checked against plain
decoding's alone.

    python burst.py [CLIENTS] [ROUNDS]
"""

from __future__ import annotations

import statistics
import sys

import torch

from leapdecode.api import Decoder
from leapdecode.bench.concurrent import run_concurrent
from leapdecode.bench.datasets import load_dataset
from leapdecode.bench.llamacpp_server import gguf_of, run_llama_server
from leapdecode.engine.cost import measure_batch_cost
from leapdecode.methods import backend_for
from leapdecode.models import default_cache_dir, load_model

DATASETS = "spec-bench:multi-turn+spec-bench:qa+spec-bench:math_reasoning"
NEW_TOKENS = 64
MAX_ROWS = 128
PREFIX_CACHE_TOKENS = 8192
SYSTEM = "\n".join(
    [
        "You are the support assistant of Northwind Outfitters, an online shop for hiking and camping gear.",
        "Follow these rules in every answer.",
        ("1. Be accurate. If you do not know something, say so plainly and suggest where the customer could find out."),
        "2. Be brief: answer in at most three short paragraphs unless the customer asks for detail.",
        "3. Use plain language. Avoid jargon; when a technical term is needed, explain it in one sentence.",
        "4. Never invent order numbers, prices, stock levels, delivery dates or tracking links.",
        (
            "5. Orders ship within two working days. Standard delivery takes three to five working days; express "
            "takes one to two."
        ),
        (
            "6. Returns are free within 30 days of delivery for unused items in their original packaging. Worn "
            "footwear cannot be returned unless faulty."
        ),
        (
            "7. Faulty items are repaired or replaced under a two-year warranty. Ask for a photo of the fault and"
            " the order number."
        ),
        "8. Gift cards are valid for three years and cannot be exchanged for cash.",
        "9. When a customer is upset, acknowledge the problem first, then give the next concrete step.",
        "10. Do not discuss competitors' products or prices.",
        (
            "11. For safety questions (avalanche risk, river crossings, altitude sickness, stove use in tents), "
            "give general guidance only and advise consulting local authorities or a qualified guide."
        ),
        (
            "12. If a question has nothing to do with the shop, you may still help, briefly and politely, "
            "following the same rules."
        ),
        "13. Do not ask for payment details, passwords or full card numbers, ever.",
        "14. End every answer with one line that offers further help.",
        (
            "Our opening hours for phone support are 8:00 to 18:00, Monday to Saturday. Email support answers "
            "within one working day."
        ),
        "Store locations: Bristol, Leeds and Edinburgh, each open 9:00 to 17:30 every day but Sunday.",
    ]
)


def main() -> None:
    torch.set_num_threads(2)
    clients = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    lm = load_model("qwen2.5-coder-1.5b", log=lambda message: None)
    questions = [p.text for p in load_dataset(DATASETS, 3) if not p.earlier][:clients]
    prompts = [
        list(
            lm.tokenizer.apply_chat_template(
                [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
        )
        for q in questions
    ]
    plain = Decoder(lm, "ar")
    reference = [plain.generate(p, max_new_tokens=NEW_TOKENS).token_ids for p in prompts]
    print(
        f"{len(prompts)} requests, {sum(map(len, prompts))} prompt tokens, "
        f"{len(lm.tokenizer(SYSTEM)['input_ids'])} of each in the system prompt",
        flush=True,
    )
    cost = measure_batch_cost(backend_for(lm), MAX_ROWS, clients)
    decoders = {"ar": plain, "default": Decoder(lm)}
    decoders["default"].generate(prompts[0], max_new_tokens=8)  # warm
    print(
        "| round | method | prefix cache | tok/s | first token p50 s | last request done s "
        "| prompt tokens cached | identical |\n"
        "|---|---|---|---:|---:|---:|---:|---:|"
    )
    for round_ in range(rounds):
        for name, decoder in decoders.items():
            for tokens in (PREFIX_CACHE_TOKENS, 0) if round_ % 2 == 0 else (0, PREFIX_CACHE_TOKENS):
                result = run_concurrent(
                    decoder, cost, prompts, NEW_TOKENS, clients, reference, MAX_ROWS, prefix_cache_tokens=tokens
                )
                print(
                    f"| {round_ + 1} | {name} | {'on' if tokens else 'off'} | {result.tokens_per_s:.1f} | "
                    f"{statistics.median(result.first_token_s):.2f} | {result.wall_s:.1f} | "
                    f"{result.cached_tokens} | {result.identical}/{result.requests} |",
                    flush=True,
                )
    gguf = gguf_of("qwen2.5-coder-1.5b", default_cache_dir())
    for cache_prompt in (True, False):
        result = run_llama_server(
            gguf, prompts, NEW_TOKENS, clients, reference, torch.get_num_threads(), cache_prompt=cache_prompt
        )
        print(
            f"| - | llama-server | {'on' if cache_prompt else 'off'} | {result.tokens_per_s:.1f} | "
            f"{statistics.median(result.first_token_s):.2f} | {result.wall_s:.1f} | - | "
            f"{result.identical}/{result.requests} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
