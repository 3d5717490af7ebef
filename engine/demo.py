"""`python -m engine.demo`: run the offline engine on the default model and print the answers.

The engine alone, without the gateway and workers of `make run` (`make demo`):
loads SmolLM2-135M-Instruct, answers a few chat prompts in one continuous batch,
and prints the scheduler's metrics.
"""

from __future__ import annotations

import argparse
import time

from engine import LLM, SamplingParams

DEFAULT_QUESTIONS = (
    "What is the capital of France?",
    "Give me three tips for staying focused.",
    "Write a short poem about autumn.",
    "What is 12 times 12?",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("questions", nargs="*", default=list(DEFAULT_QUESTIONS))
    args = parser.parse_args()

    print(f"loading {args.model} ...", flush=True)
    llm = LLM(args.model, dtype="float32", num_threads=args.threads)
    tokenizer = llm.get_tokenizer()
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
        )
        for q in args.questions
    ]
    started = time.perf_counter()
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=args.max_tokens))
    seconds = time.perf_counter() - started
    for question, out in zip(args.questions, outputs):
        print(f"\n> {question}\n{out.text.strip()}\n[{len(out.token_ids)} tokens, finish: {out.finish_reason}]")
    stats = llm.get_metrics()
    num_tokens = sum(len(o.token_ids) for o in outputs)
    print(
        f"\n{num_tokens} tokens in {seconds:.1f} s ({num_tokens / seconds:.1f} tok/s), "
        f"{stats.num_steps} steps, {stats.mean_seqs_per_step:.1f} sequences per step"
    )


if __name__ == "__main__":
    main()
