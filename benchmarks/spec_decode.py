"""Speculative decoding benchmark: n-gram prompt lookup (LLM(speculative="ngram")) against
plain decoding, same model and settings, side by side in one run on the in-process engine.

Workloads (greedy, `--max-tokens` (192) tokens at most, each prompt in the model's chat
template when it has one):

    copy    the model is asked to give back a passage it was handed, whole: "Repeat the
            following text exactly, word for word.", "Fix the typos in this text and return
            it in full." (the passage with a few letters swapped in every seventh word) or
            "Copy the following text exactly as it is written.", over six distinct passages
            of 100-150 words (a lighthouse keeper, a sourdough recipe, the water cycle,
            release notes, a meeting summary, a museum guide). The output is mostly the
            prompt again: prompt lookup's best case.
    open    open-ended requests with nothing to copy: "Write a short story about ..." and
            "Write a poem about ..." over eight topics. Proposals are rarely accepted: the
            engine's off-switch (engine/spec_decode/speculator.py: a row stops proposing
            when its acceptance does not pay for the checks) must keep it from being slower.
    mixed   copy and open prompts in turn.

Cases (`--cases`), each with its target for speculative / plain output tokens per second:

    copy-b1     the copy prompts one at a time (batch 1)                    >= 1.8x
    open-b1     the open prompts one at a time (batch 1)                    >= 0.95x
    open-sampled-b1  the same, sampled at temperature 1 (seed 0): a small
                model's greedy stories repeat themselves, its sampled ones
                much less, so here proposals mostly fail                     >= 0.95x
    mixed-b32   `--batch` (32) mixed prompts at once, one generate() call   >= 1.0x
    copy-b32    `--batch` copy prompts at once (not run by default)         >= 1.0x

Each case builds a plain LLM and a speculative one (float32 on CPU by default), warms both
up, then times generate() on each in turn for `--repeats` rounds (plain first in even
rounds, speculative first in odd ones, so the machine's drift falls on both alike).
Reported per case: output tokens/s of both (median round); their ratio against the
target (the median of the rounds' ratios: a round's two runs are adjacent, so a
disturbance of the machine that lasts a while falls on both); the acceptance rate
(accepted / proposed) and by position (position i: the share of proposals at position i
that were accepted); tokens emitted per check; the speculator's own estimate of its
speed-up on the rows that checked (`est.`: emitted tokens over what its step-time model
says the checks cost, in decode steps); and the steps each engine took (median round).
Outputs must be identical with and without speculation (greedy; and seeded sampling,
which speculation keeps token for token): every round's are compared, and any difference is reported loudly, with the plain model's top-2 logprob gap
at the first differing token (near 0: a numerical near-tie between two shapes of forward
pass; a wide one: a bug).

Exit status: 2 if any greedy output differed, else 1 if a target was missed, else 0
(`--smoke`: a tiny random model, targets reported but not counted).

    python -m benchmarks.spec_decode                        # SmolLM2-135M, 3 rounds
    python -m benchmarks.spec_decode --cases copy-b1 --repeats 2 --json /tmp/spec.json
    python -m benchmarks.spec_decode --smoke                # seconds: the machinery only
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class Case:
    workload: str  # copy, open or mixed
    batched: bool  # all prompts in one generate() call (else one at a time)
    target: float  # speculative / plain output tokens per second, at least
    temperature: float = 0.0  # 0: greedy; else sampled with seed 0


CASES = {
    "copy-b1": Case("copy", False, 1.8),
    "open-b1": Case("open", False, 0.95),
    "open-sampled-b1": Case("open", False, 0.95, temperature=1.0),
    "mixed-b32": Case("mixed", True, 1.0),
    "copy-b32": Case("copy", True, 1.0),
}
DEFAULT_CASES = "copy-b1,open-b1,open-sampled-b1,mixed-b32"

PASSAGES = [
    "The old lighthouse stood at the edge of the cliff for more than a century. Every night its keeper climbed the "
    "narrow stairs, trimmed the wick and polished the great lens until it shone. Ships passing in the dark relied on "
    "its steady beam to find their way around the rocks, and the fishermen of the village said that as long as the "
    "light burned, no boat would be lost. When the keeper grew old, his granddaughter took over the work, and she "
    "kept the light burning through storms, fog and the long winter nights.",
    "To make a simple sourdough loaf, mix five hundred grams of bread flour with three hundred and fifty grams of "
    "water and let it rest for an hour. Add one hundred grams of active starter and ten grams of salt, then fold the "
    "dough every thirty minutes for the next two hours. Shape it into a round, place it in a floured basket and leave "
    "it in the fridge overnight. In the morning, bake it in a covered pot at two hundred and fifty degrees for twenty "
    "minutes, then uncover it and bake for another twenty minutes until the crust is deep brown.",
    "Water moves around the planet in a continuous cycle. The sun heats oceans, lakes and rivers, and some of the "
    "water evaporates into the air as vapour. As the warm, moist air rises, it cools, and the vapour condenses into "
    "tiny droplets that form clouds. When the droplets grow heavy enough, they fall back to the ground as rain, snow "
    "or hail. Some of that water flows over the land into streams and rivers, some soaks into the soil to become "
    "groundwater, and some is taken up by plants, which release it again through their leaves.",
    "Version 2.4 of the photo editor adds support for layers, so you can now stack several images and adjust each one "
    "on its own. The crop tool remembers the last aspect ratio you used, and the export dialog shows the final file "
    "size before you save. We fixed a bug that made the brush lag on large canvases and another that reset the "
    "colour picker after every undo. Loading a folder with thousands of pictures is now about twice as fast, and the "
    "application uses less memory when several windows are open at the same time.",
    "At Tuesday's meeting the team agreed to move the product launch from March to April, so that the new payment "
    "system can be tested with real customers first. Maria will prepare the test plan by the end of next week, and "
    "Tom will contact the three pilot customers to schedule their sessions. The design of the landing page is "
    "finished, but the text still needs to be reviewed by the legal department. The next meeting will take place on "
    "Monday at ten o'clock, and everyone should bring a short update on their open tasks.",
    "Welcome to the east wing of the museum. In the first room you will find tools and pottery made by farmers who "
    "lived in this valley about six thousand years ago. The large bowl in the centre was found in a field just two "
    "kilometres from here, broken into forty pieces. The second room shows how people wove cloth from wool and flax, "
    "and you can try the small loom by the window yourself. Please do not touch the objects behind glass, and ask any "
    "member of staff if you would like to know more about the collection.",
]
COPY_INSTRUCTIONS = [  # (instruction, whether the passage gets typos)
    ("Repeat the following text exactly, word for word.", False),
    ("Fix the typos in this text and return it in full.", True),
    ("Copy the following text exactly as it is written.", False),
]
TOPICS = ["a lighthouse keeper who finds a message in a bottle", "a robot that learns to paint",
          "a city where it never stops raining", "two friends lost in a forest", "the first day at a new school",
          "a dragon who is afraid of fire", "a train that travels between planets", "an old clock that runs backwards"]
OPEN_TEMPLATES = ["Write a short story about {}.", "Write a poem about {}."]


def with_typos(text: str, every: int = 7) -> str:
    """`text` with two inner letters swapped in every `every`-th word of five letters or more."""
    words = text.split(" ")
    for i in range(every - 1, len(words), every):
        word = words[i]
        if len(word) >= 5 and word[1:4].isalpha():
            words[i] = word[0] + word[2] + word[1] + word[3:]
    return " ".join(words)


def copy_messages() -> list[str]:
    """Every passage under every instruction: passage i under instruction i, i + 1, ... in turn,
    so that the first len(PASSAGES) are the passages once each, the instructions in turn."""
    messages = []
    for shift in range(len(COPY_INSTRUCTIONS)):
        for index, passage in enumerate(PASSAGES):
            instruction, typos = COPY_INSTRUCTIONS[(index + shift) % len(COPY_INSTRUCTIONS)]
            messages.append(f"{instruction}\n\n{with_typos(passage) if typos else passage}")
    return messages


def open_messages() -> list[str]:
    return [template.format(topic) for template in OPEN_TEMPLATES for topic in TOPICS]


def workload_messages(workload: str, count: int) -> list[str]:
    """`count` user messages of `workload`, cycling through its messages."""
    if workload == "mixed":
        pool = [m for pair in zip(copy_messages(), open_messages()) for m in pair]
    else:
        pool = copy_messages() if workload == "copy" else open_messages()
    return [pool[i % len(pool)] for i in range(count)]


def render(llm, message: str) -> list[int]:
    """The prompt's token ids: `message` as the user's turn of the chat template, or the
    message alone where the tokenizer has no template (random-weight models)."""
    tokenizer = llm.get_tokenizer()
    if getattr(tokenizer, "chat_template", None):
        message = tokenizer.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True,
                                                tokenize=False)
    return llm.engine.tokenize(message)


# --------------------------------------------------------------------------- running
def build(args: argparse.Namespace, speculative: bool):
    from engine import LLM

    extra = {"speculative": "ngram", "num_speculative_tokens": args.num_speculative_tokens} if speculative else {}
    if args.device.startswith("cuda"):  # two engines share the GPU: each a fixed cache, not a share of it
        extra.update(kv_cache_memory_bytes=int(args.kv_cache_gib * (1 << 30)), max_model_len=args.max_model_len)
    return LLM(args.model, device=args.device, dtype=args.dtype, num_threads=args.threads,
               max_num_seqs=max(args.batch, 1), **extra)


def generate(llm, prompts: list[list[int]], params, batched: bool) -> tuple[float, list[list[int]], int]:
    """Seconds, each prompt's output tokens, and the engine steps taken: all prompts in one
    generate() call (batched), else one call each, one after the other."""
    steps = llm.get_metrics().num_steps
    started = time.perf_counter()
    if batched:
        outputs = [out.token_ids for out in llm.generate(prompts, params)]
    else:
        outputs = [llm.generate([prompt], params)[0].token_ids for prompt in prompts]
    seconds = time.perf_counter() - started
    return seconds, [list(tokens) for tokens in outputs], llm.get_metrics().num_steps - steps


def spec_counts(llm) -> dict:
    """The speculator's counts so far (engine/spec_decode/speculator.py SpecStats)."""
    stats = llm.engine.speculator.stats()
    return {"num_checks": stats.num_checks, "num_proposed": stats.num_proposed, "num_accepted": stats.num_accepted,
            "num_emitted": stats.num_emitted, "proposed_by_position": list(stats.proposed_by_position),
            "accepted_by_position": list(stats.accepted_by_position), "plain_steps_saved": stats.plain_steps_saved}


def counts_since(before: dict, after: dict) -> dict:
    return {key: ([a - b for a, b in zip(after[key], before[key])] if isinstance(after[key], list)
                  else after[key] - before[key]) for key in after}


def mismatches(plain: list[list[int]], spec: list[list[int]], when: str) -> list[dict]:
    """Each prompt whose speculative output differs from the plain one: where and how."""
    found = []
    for index, (a, b) in enumerate(zip(plain, spec)):
        if a != b:
            position = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            found.append({"when": when, "prompt": index, "position": position, "plain_len": len(a),
                          "spec_len": len(b), "plain_tokens": a[position:position + 8],
                          "spec_tokens": b[position:position + 8]})
    return found


def top2_gap(llm, prompt: list[int], output: list[int], position: int) -> float | None:
    """The plain model's logprob gap between its two likeliest tokens at output `position`
    (None past the end): near 0, the two engines may pick either by rounding."""
    from engine import SamplingParams

    if position >= len(output):
        return None
    prefix = prompt + output[:position]
    out = llm.generate([prefix], SamplingParams(temperature=0.0, max_tokens=1, logprobs=2))[0]
    top = out.logprobs[0].top_logprobs
    return top[0][1] - top[1][1] if len(top) > 1 else None


def run_case(args: argparse.Namespace, name: str, case: Case) -> dict:
    from engine import SamplingParams

    plain, spec = build(args, False), build(args, True)
    count = args.batch if case.batched else args.prompts
    prompts = [render(plain, message) for message in workload_messages(case.workload, count)]
    params = SamplingParams(temperature=case.temperature, max_tokens=args.max_tokens,
                            seed=0 if case.temperature else None)
    engines = {"plain": plain, "ngram": spec}
    found: list[dict] = []
    # Warm-up: the batch's shapes (or a single prompt), and the step-time model's first samples.
    warm = SamplingParams(temperature=0.0, max_tokens=min(32, args.max_tokens))
    warm_prompts = prompts if case.batched else prompts[:1]
    warm_out = {label: generate(llm, warm_prompts, warm, case.batched)[1] for label, llm in engines.items()}
    found += mismatches(warm_out["plain"], warm_out["ngram"], "warm-up")
    rates: dict[str, list[float]] = {"plain": [], "ngram": []}
    steps: dict[str, list[int]] = {"plain": [], "ngram": []}
    tokens: list[int] = []
    before = spec_counts(spec)
    for round_index in range(args.repeats):
        order = ("plain", "ngram") if round_index % 2 == 0 else ("ngram", "plain")
        outputs = {}
        for label in order:
            seconds, outputs[label], num_steps = generate(engines[label], prompts, params, case.batched)
            num_tokens = sum(len(tokens) for tokens in outputs[label])
            rates[label].append(num_tokens / seconds)
            steps[label].append(num_steps)
        tokens.append(sum(len(t) for t in outputs["plain"]))
        found += mismatches(outputs["plain"], outputs["ngram"], f"round {round_index}")
        print(f"  {name} round {round_index}: plain {rates['plain'][-1]:.1f} tok/s, "
              f"ngram {rates['ngram'][-1]:.1f} tok/s ({tokens[-1]} tokens)", flush=True)
    counts = counts_since(before, spec_counts(spec))
    # What the speculating engine's step-time model learnt: a step of the batch, and each proposal's share.
    line = spec.engine.step_time.entry_line()
    counts["step_model_ms"] = {"step": line.seconds(count) * 1e3, "per_proposal": line.per_seq_s * 1e3}
    gaps: dict[tuple[int, int], float | None] = {}
    for item in found:  # the plain model's margin at the first differing token (plain greedy repeats itself)
        key = (item["prompt"], item["position"])
        if key not in gaps:
            gaps[key] = top2_gap(plain, prompts[key[0]], outputs["plain"][key[0]], key[1])
        item["plain_top2_logprob_gap"] = gaps[key]
    del plain, spec, engines
    gc.collect()
    return summarize(name, case, count, prompts, rates, steps, tokens, counts, found)


def summarize(name: str, case: Case, count: int, prompts: list[list[int]], rates: dict, steps: dict,
              tokens: list[int], counts: dict, found: list[dict]) -> dict:
    plain, ngram = statistics.median(rates["plain"]), statistics.median(rates["ngram"])
    # Each round's two runs ran back to back: their ratio is what drift disturbs least.
    ratio = statistics.median(b / a for a, b in zip(rates["plain"], rates["ngram"]))
    emitted, saved = counts["num_emitted"], counts["plain_steps_saved"]
    by_position = [accepted / proposed if proposed else None
                   for accepted, proposed in zip(counts["accepted_by_position"], counts["proposed_by_position"])]
    return {
        "case": name, **asdict(case), "num_prompts": count,
        "mean_prompt_tokens": sum(map(len, prompts)) / len(prompts), "output_tokens_per_round": tokens,
        "plain_tokens_per_s": plain, "ngram_tokens_per_s": ngram, "rounds": rates, "ratio": ratio,
        "passed": ratio >= case.target,
        "acceptance_rate": counts["num_accepted"] / counts["num_proposed"] if counts["num_proposed"] else 0.0,
        "acceptance_by_position": by_position,
        "tokens_per_check": counts["num_emitted"] / counts["num_checks"] if counts["num_checks"] else None,
        # The speculator's own reckoning of its speed-up on the rows that checked (its step-time model's).
        "engine_estimated_speedup": emitted / (emitted - saved) if emitted > saved else None,
        "speculation": counts, "steps": steps, "greedy_mismatches": found,
    }


# ---------------------------------------------------------------------------- report
def print_report(results: list[dict], args: argparse.Namespace) -> None:
    print(f"\nmodel {args.model} ({args.dtype}, {args.device}, {args.threads} threads), greedy, "
          f"max_tokens {args.max_tokens}, num_speculative_tokens {args.num_speculative_tokens}, "
          f"median of {args.repeats} rounds" + (" [smoke: targets not enforced]" if args.smoke else ""))
    print(f"{'case':<15} {'prompts':>7} {'plain tok/s':>11} {'ngram tok/s':>11} {'ratio':>6} {'target':>7} "
          f"{'accept':>6} {'by position':<23} {'tok/check':>9} {'est.':>5} {'steps plain/ngram':>17} "
          f"{'greedy':>8} result")
    for r in results:
        positions = " ".join("-" if a is None else f"{a:.2f}" for a in r["acceptance_by_position"])
        per_check = "-" if r["tokens_per_check"] is None else f"{r['tokens_per_check']:.2f}"
        estimate = "-" if r["engine_estimated_speedup"] is None else f"{r['engine_estimated_speedup']:.2f}x"
        step_counts = f"{statistics.median(r['steps']['plain']):.0f}/{statistics.median(r['steps']['ngram']):.0f}"
        greedy = "same" if not r["greedy_mismatches"] else f"{len(r['greedy_mismatches'])} DIFF"
        print(f"{r['case']:<15} {r['num_prompts']:>7} {r['plain_tokens_per_s']:>11.1f} "
              f"{r['ngram_tokens_per_s']:>11.1f} {r['ratio']:>5.2f}x {'>=' + format(r['target'], '.2f'):>7} "
              f"{r['acceptance_rate']:>6.2f} {positions:<23} {per_check:>9} {estimate:>5} {step_counts:>17} "
              f"{greedy:>8} {'PASS' if r['passed'] else 'FAIL'}")
    for r in results:
        for m in r["greedy_mismatches"]:
            gap = m["plain_top2_logprob_gap"]
            print(f"!! CORRECTNESS MISMATCH {r['case']} {m['when']} prompt {m['prompt']}: first differing output "
                  f"token {m['position']} (plain {m['plain_len']} tokens, ngram {m['spec_len']}): plain "
                  f"{m['plain_tokens']} vs ngram {m['spec_tokens']}; plain top-2 logprob gap there: "
                  f"{'-' if gap is None else format(gap, '.2e')}", file=sys.stderr)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--cases", default=DEFAULT_CASES, help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds per engine")
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=len(PASSAGES), help="prompts of a batch-1 case")
    parser.add_argument("--batch", type=int, default=32, help="prompts of a batched case, sent at once")
    parser.add_argument("--kv-cache-gib", type=float, default=8.0, help="on CUDA: each engine's KV cache")
    parser.add_argument("--max-model-len", type=int, default=4096, help="on CUDA: each engine's")
    parser.add_argument("--smoke", action="store_true",
                        help="dummy:tiny (random weights), 16 tokens, 2 prompts, batch 4, 1 round: the machinery only")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args(argv)
    if args.smoke:
        args.model, args.max_tokens, args.prompts, args.batch, args.repeats = "dummy:tiny", 16, 2, 4, 1
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    names = [name for name in args.cases.split(",") if name]
    unknown = set(names) - set(CASES)
    if unknown:
        raise SystemExit(f"unknown cases: {', '.join(sorted(unknown))} (known: {', '.join(CASES)})")
    results = []
    for name in names:
        print(f"== {name}", flush=True)
        results.append(run_case(args, name, CASES[name]))
    print_report(results, args)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": {k: str(v) if isinstance(v, Path) else v
                                                  for k, v in vars(args).items()}, "cases": results}, indent=2))
    if any(r["greedy_mismatches"] for r in results):
        return 2
    return 0 if args.smoke or all(r["passed"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
