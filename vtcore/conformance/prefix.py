"""The prefix-cache workload: requests sharing prefixes of a first one, sent while it runs and after it
finished, with the cached tokens the block hashes promise each of them.

A follower shares ``shared`` leading tokens of the first request's prompt and then goes its own way;
the cache can give it the full blocks of that shared part, but never its own last token. Followers
that arrive together are admitted in one step, so they find the first request's blocks, not each
other's. The numbers depend only on the prompts and the block size, never on the family.

A second turn (:func:`next_turn`) then resends the first prompt and as many of the first request's
own output tokens as end a block, plus new tokens: its cached prefix ends inside what the first
request decoded (for a family with per-request state, a snapshot its decode steps took).
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


def next_turn(vocab_size: int, seed: int, block: int, base: list[int], first_output: list[int]) -> PrefixCase:
    """The follow-up to ``base`` (the first prompt), whose request answered ``first_output``: the
    conversation so far up to a block's end inside the answer, then 4 new tokens."""
    rng = random.Random(seed + 1)
    answered = (-len(base)) % block or block
    if answered > len(first_output):
        raise ValueError(f"the first request answered {len(first_output)} tokens; the next turn needs {answered}")
    ids = base + first_output[:answered] + [rng.randrange(vocab_size) for _ in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
    return PrefixCase({0: [("next-turn", ids, params)]}, {"next-turn": len(base) + answered},
                      {"next-turn": (ids, params)})
