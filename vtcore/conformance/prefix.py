"""The prefix-cache workload: requests sharing prefixes of a first one, sent while it runs and after it
finished, with the cached tokens the block hashes promise each of them.

A follower shares ``shared`` leading tokens of the first request's prompt and then goes its own way;
the cache can give it the full blocks of that shared part, but never its own last token. Followers
that arrive together are admitted in one step, so they find the first request's blocks, not each
other's. The numbers depend only on the prompts and the block size, never on the family.
"""
from __future__ import annotations

import random

import attrs

from vtcore.conformance.harness import Arrivals
from vtcore.sampling_params import SamplingParams

BASE_LEN = 29  # the first request's prompt: three full 8-token blocks and 5 tokens
#: (name, arrival step, tokens shared with the first prompt, tokens of its own); the first request
#: runs steps 0 to 12 (12 greedy tokens), so step 3 is while it runs and step 20 after it finished
FOLLOWERS = (("while-running", 3, 24, 4), ("under-a-block", 20, 5, 6), ("one-block", 20, 8, 5),
             ("blocks-and-part", 20, 19, 4), ("whole-prompt", 20, BASE_LEN, 0))


@attrs.frozen
class PrefixCase:
    arrivals: Arrivals
    expected: dict[str, int]  # request id -> prompt tokens the hashes promise from the cache
    prompts: dict[str, tuple[list[int], SamplingParams]]


def prefix_workload(vocab_size: int, seed: int, block: int) -> PrefixCase:
    rng = random.Random(seed)
    base = [rng.randrange(vocab_size) for _ in range(BASE_LEN)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)
    arrivals: Arrivals = {0: [("first", base, params)]}
    expected, prompts = {"first": 0}, {"first": (base, params)}
    for name, at, shared, own in FOLLOWERS:
        tail = [rng.randrange(vocab_size) for _ in range(own)]
        if tail and shared < BASE_LEN and tail[0] == base[shared]:
            tail[0] = (tail[0] + 1) % vocab_size  # shares exactly ``shared`` tokens
        ids = base[:shared] + tail
        follower = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
        arrivals.setdefault(at, []).append((name, ids, follower))
        expected[name] = min(shared // block, (len(ids) - 1) // block) * block
        prompts[name] = (ids, follower)
    return PrefixCase(arrivals, expected, prompts)
