"""A vLLM engine as a user starts one: ``LLM(model=DIR, load_format=...)``, greedy
tokens for the test prompts, printed as one JSON line. With ``--hold`` it then waits for
a line on stdin before exiting (the engine stays up: two engines at once).

    python engine_child.py DIR --out RESULT.json --load-format weightcache [--extra JSON] [--dtype float32] [--hold]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from models import PROMPTS

MAX_TOKENS = 8


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--extra", default=None, help="--model-loader-extra-config JSON")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", required=True, help="where the result goes (written whole, then renamed)")
    ap.add_argument("--hold", action="store_true")
    args = ap.parse_args()
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams

    imported = time.perf_counter()
    kwargs = {} if args.extra is None else {"model_loader_extra_config": json.loads(args.extra)}
    llm = LLM(model=args.model, load_format=args.load_format, dtype=args.dtype, max_model_len=128, max_num_seqs=4,
              enforce_eager=True, seed=0, **kwargs)
    ready = time.perf_counter()
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
    first = time.perf_counter()
    res = {"tokens": [list(o.outputs[0].token_ids) for o in outs], "texts": [o.outputs[0].text for o in outs],
           "import_s": imported - t0, "engine_s": ready - imported, "generate_s": first - ready}
    with open(args.out + ".tmp", "w") as f:
        json.dump(res, f)
    os.replace(args.out + ".tmp", args.out)
    if args.hold:
        sys.stdin.readline()


if __name__ == "__main__":
    main()
