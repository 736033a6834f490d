"""lm-eval's ``local-completions`` model against a running ``vtcore serve``, checked against transformers.

    vtcore serve --device cpu --port 8765 &
    pip install "lm_eval[api]"               (not a vtcore dependency)
    python3 scripts/lm_eval_check.py http://127.0.0.1:8765/v1 [MODEL_DIR]

Through lm-eval's own client (``LocalCompletionsAPI``: batched token-id prompts, ``echo``, ``logprobs=1``,
``max_tokens`` 0 or 1) it asks the server for loglikelihoods (with lm-eval's is-greedy flag), a rolling
loglikelihood and a greedy generation, and compares each with transformers' model class on the same
checkpoint (float32; MODEL_DIR defaults to the embedded model). Exits non-zero on a mismatch.
"""
from __future__ import annotations

import sys

import torch
from lm_eval.api.instance import Instance
from lm_eval.models.openai_completions import LocalCompletionsAPI
from transformers import AutoModelForCausalLM, AutoTokenizer

from vtcore.bench.http import served_model
from vtcore.config import DEFAULT_MODEL

PAIRS = [("The cat and the", " dog"), ("Once upon a time", " there was a little girl"), ("Hello", ","),
         ("The meaning of life is", " to be happy.")]
DOCUMENT = "Once upon a time there was a little girl who lived in a house by the river."
TOLERANCE = 1e-3  # nats: float32 on both sides, different kernels


def main() -> int:
    if len(sys.argv) not in (2, 3):
        sys.exit(f"usage: {sys.argv[0]} BASE_URL [MODEL_DIR]   (BASE_URL: a server's /v1, e.g. "
                 "http://127.0.0.1:8000/v1; got " + (" ".join(map(repr, sys.argv[1:])) or "nothing") + ")")
    url, model_dir = sys.argv[1].rstrip("/"), sys.argv[2] if len(sys.argv) > 2 else DEFAULT_MODEL
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)

    def oracle(context: list[int], continuation: list[int]) -> tuple[float, bool]:
        lp = logprobs(context + continuation)
        rows = lp[len(context) - 1:-1]
        picked = rows[torch.arange(len(continuation)), torch.tensor(continuation)]
        return picked.sum().item(), bool((rows.argmax(dim=-1) == torch.tensor(continuation)).all())

    # one pair whose continuation is the greedy token, so the is-greedy flag is checked both ways
    first = tokenizer.encode(PAIRS[0][0])
    pairs = [*PAIRS, (PAIRS[0][0], tokenizer.decode([int(logprobs(first)[-1].argmax())]))]
    served = served_model(url)
    lm = LocalCompletionsAPI(model=served, base_url=url + "/completions", tokenizer_backend="huggingface",
                             tokenizer=model_dir, num_concurrent=2)
    got = lm.loglikelihood([Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)])
    bad = 0
    for (context, continuation), (value, greedy) in zip(pairs, got):
        whole, ctx = tokenizer.encode(context + continuation), tokenizer.encode(context)
        want, want_greedy = oracle(ctx, whole[len(ctx):])  # (lm-eval splits the pair's tokens this way)
        ok = abs(value - want) <= TOLERANCE and greedy == want_greedy
        bad += not ok
        print(f"{'ok ' if ok else 'BAD'} loglikelihood {context!r} + {continuation!r}: served {value:.5f} "
              f"greedy={greedy}, transformers {want:.5f} greedy={want_greedy}")
    [rolling] = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (DOCUMENT,), 0)])
    start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    want = oracle([start], tokenizer.encode(DOCUMENT))[0]
    ok = abs(rolling - want) <= TOLERANCE
    bad += not ok
    print(f"{'ok ' if ok else 'BAD'} rolling loglikelihood: served {rolling:.5f}, transformers {want:.5f}")
    contexts = [context for context, _ in PAIRS]
    texts = lm.generate_until([Instance("generate_until", {}, (c, {"until": ["\n\n"], "max_gen_toks": 16,
                                                                   "do_sample": False}), i)
                               for i, c in enumerate(contexts)])
    for context, text in zip(contexts, texts):
        prompt = tokenizer.encode(context)
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)
        want = tokenizer.decode(out[0, len(prompt):], skip_special_tokens=True).split("\n\n")[0]
        ok = text == want
        bad += not ok
        print(f"{'ok ' if ok else 'BAD'} greedy generation after {context!r}: served {text!r}, transformers {want!r}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
