"""What the sampling features cost, side by side in one run on the in-process engine.

    structured   decode throughput at batch B (32) with a JSON schema on every row against
                 the same batch without one. The schema asks for more tokens than
                 max_tokens, so every row of both runs decodes exactly max_tokens: the
                 difference is the grammar's work (the masks filled on the host, the
                 bitmask applied in the sampler). Target: >= 0.85x.
    penalties    the same batch with presence, frequency and repetition penalties, a
                 logit_bias and bad words on every row, against none. Reported, no target.
    choices      n = 4 on one prompt of P (1,000) tokens against 4 separate requests for
                 it sent at once (each prefilled: none is cached yet when they start), C
                 (16) tokens each; a new random prompt every round. Target: >= 3x.

Rounds alternate the variants (A, B, A, B, ...) and each variant's best round counts, so
the shared machine's drift falls on both alike.

    python -m benchmarks.sampling                          # SmolLM2-135M, batch 32, 64 tokens, 3 rounds
    python -m benchmarks.sampling --model dummy:llama-3.2-1b --device cuda
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "minLength": 10, "maxLength": 40},
        "tags": {"type": "array", "items": {"type": "string", "minLength": 4, "maxLength": 12},
                 "minItems": 8, "maxItems": 8},
        "rating": {"type": "integer", "minimum": 0, "maximum": 10},
        "notes": {"type": "string", "minLength": 80, "maxLength": 200},
    },
    "required": ["title", "tags", "rating", "notes"],
    "additionalProperties": False,
}
PROMPT = "Describe a book you like as JSON with a title, eight tags, a rating and notes."


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--choices-prompt", type=int, default=1000, help="tokens of the n = 4 prompt")
    parser.add_argument("--choices-tokens", type=int, default=16, help="tokens each choice generates")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    return parser.parse_args(argv)


def variants(batch: int, max_tokens: int) -> dict[str, list]:
    from engine import SamplingParams
    from engine.structured_output import StructuredOutput

    spec = StructuredOutput(json_schema=json.dumps(SCHEMA))
    base = dict(temperature=1.0, max_tokens=max_tokens)
    return {
        "plain": [SamplingParams(**base, seed=i, ignore_eos=True) for i in range(batch)],
        "json_schema": [SamplingParams(**base, seed=i, structured_output=spec) for i in range(batch)],
        "penalties": [SamplingParams(**base, seed=i, ignore_eos=True, presence_penalty=0.5, frequency_penalty=0.3,
                                     repetition_penalty=1.1, logit_bias={100 + i: 2.0, 200: -5.0},
                                     bad_words=["however", "indeed"]) for i in range(batch)],
    }


def run(args: argparse.Namespace) -> dict:
    from engine import LLM

    llm = LLM(args.model, device=args.device, **({"dtype": args.dtype} if args.dtype else {}))
    prompt = llm.engine.tokenize(PROMPT)
    runs = variants(args.batch, args.max_tokens)
    llm.generate([prompt] * args.batch, runs["json_schema"])  # compiles the schema, warms every path
    best: dict[str, float] = {}
    tokens: dict[str, int] = {}
    for _ in range(args.rounds):
        for name, params in runs.items():
            started = time.perf_counter()
            outputs = llm.generate([prompt] * args.batch, params)
            seconds = time.perf_counter() - started
            count = sum(len(out.token_ids) for out in outputs)
            if name == "json_schema":
                assert all(out.finish_reason == "length" for out in outputs), "the schema must outlast max_tokens"
            tokens[name] = count
            best[name] = max(best.get(name, 0.0), count / seconds)
    choices = choices_section(llm, args)
    return {
        "model": args.model, "device": args.device, "batch": args.batch, "max_tokens": args.max_tokens,
        "tokens_per_s": best, "tokens": tokens,
        "json_schema_vs_plain": best["json_schema"] / best["plain"],
        "penalties_vs_plain": best["penalties"] / best["plain"],
        "choices": choices,
    }


def choices_section(llm, args: argparse.Namespace) -> dict:
    """Throughput (output tokens/s) of n = 4 against 4 separate requests, best round each."""
    import random

    from engine import SamplingParams

    rng = random.Random(0)
    vocab = llm.engine.vocab_size
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=args.choices_tokens, ignore_eos=True)
    best = {"n4": 0.0, "separate": 0.0}
    for _ in range(args.rounds):
        for name in best:
            prompt = [rng.randrange(100, vocab) for _ in range(args.choices_prompt)]
            started = time.perf_counter()
            if name == "n4":
                outputs = llm.generate([prompt], [replace(params, n=4)])
            else:
                outputs = llm.generate([prompt] * 4, [params.choice(i) for i in range(4)])
            seconds = time.perf_counter() - started
            best[name] = max(best[name], sum(len(o.token_ids) for o in outputs) / seconds)
    return {"tokens_per_s": best, "n4_vs_separate": best["n4"] / best["separate"],
            "prompt_tokens": args.choices_prompt, "tokens_per_choice": args.choices_tokens}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    for name, rate in result["tokens_per_s"].items():
        print(f"{name:12s} {rate:10.1f} tok/s  ({result['tokens'][name]} tokens)")
    ratio = result["json_schema_vs_plain"]
    print(f"json_schema / plain: {ratio:.3f}  (target >= 0.85: {'PASS' if ratio >= 0.85 else 'FAIL'})")
    print(f"penalties / plain:   {result['penalties_vs_plain']:.3f}")
    choices = result["choices"]
    for name, rate in choices["tokens_per_s"].items():
        print(f"{name:12s} {rate:10.1f} tok/s  ({choices['prompt_tokens']}-token prompt)")
    n4 = choices["n4_vs_separate"]
    print(f"n=4 / 4 separate:    {n4:.3f}  (target >= 3: {'PASS' if n4 >= 3 else 'FAIL'})")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1))
    return 0 if ratio >= 0.85 and n4 >= 3 else 1


if __name__ == "__main__":
    sys.exit(main())
