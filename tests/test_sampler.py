"""The sampler: raw logprobs against HF, the truncations by a chi-square test, seeds, penalties, stops.

Distribution tests call ``vtcore.worker.sampler.Sampler`` directly on fixed logits over a small
vocabulary; the expected distributions are computed here independently (plain python). Engine
tests run the tiny HF checkpoint through ``LLM`` and compare with HF's teacher-forced logits.
"""
from __future__ import annotations

import math
import random
from fractions import Fraction
from types import SimpleNamespace
from typing import Any, Sequence

import pytest
import torch

from vtcore import LLM, SamplingParams
from vtcore.engine.request import Request
from vtcore.testing.oracle import teacher_forced_logits
from vtcore.worker.sampler import SampleMeta, Sampler

TOL = 1e-5
BLOCK = 4


def rand_prompt(n: int, seed: int, vocab: int = 512) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


def make_request(params: SamplingParams, prompt: Sequence[int] = (0,), output: Sequence[int] = (),
                 rid: str = "r", seed_generator: bool = False) -> Request:
    req = Request(rid, list(prompt), params, 1024, 0)
    req.token_ids += list(output)
    if seed_generator and params.seed is not None:
        req.generator = torch.Generator().manual_seed(params.seed)
    return req


def _batch(sampler: Sampler, reqs: Sequence[Request]) -> tuple[Any, torch.Tensor]:
    """The runner's view of a sampling step: each request was fed its last token."""
    metas = [SampleMeta(r, len(r.token_ids) - 1, r.num_output_tokens) for r in reqs]
    return sampler.prepare(metas), torch.tensor([r.token_ids[-1] for r in reqs])


def run_sampler(sampler: Sampler, logits: torch.Tensor, reqs: Sequence[Request]) -> SimpleNamespace:
    """prepare + sample, with the results on the host."""
    batch, fed = _batch(sampler, reqs)
    out = sampler.sample(logits, batch, fed)
    host = {k: v.tolist() for k, v in out.items()}
    return SimpleNamespace(token_ids=host["tokens"], logprobs=host.get("logprobs"), ranks=host.get("ranks"),
                           top_ids=host.get("top_ids"), top_logprobs=host.get("top_logprobs"))


def hf_logprobs(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    return torch.log_softmax(teacher_forced_logits(model, ids).double(), dim=-1)


# ============================================================================ chi-square helpers
#: Upper 0.001 critical values of chi-square (standard tables), to cross-check the approximation.
CHI2_CRIT_001 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322, 8: 26.124,
                 9: 27.877, 10: 29.588, 11: 31.264, 12: 32.909, 13: 34.528, 14: 36.123, 15: 37.697}
Z_999 = 3.090232  # the standard normal's 0.999 quantile


def chi2_critical(df: int) -> float:
    """Wilson-Hilferty: chi2_df(1 - a) ~ df * (1 - 2/(9 df) + z sqrt(2/(9 df)))^3."""
    c = 2.0 / (9.0 * df)
    return df * (1.0 - c + Z_999 * math.sqrt(c)) ** 3


def test_wilson_hilferty_matches_table() -> None:
    for df, crit in CHI2_CRIT_001.items():
        if df >= 3:  # the approximation is loose at 1-2 degrees of freedom; use the table there
            assert abs(chi2_critical(df) - crit) / crit < 0.02, df


def critical(df: int) -> float:
    return CHI2_CRIT_001.get(df) or chi2_critical(df)


VOCAB = 12
#: Distinct logits in a shuffled order (so "top" is not "first"), no ties.
LOGITS = [0.3, 2.0, -0.5, 1.2, 0.1, 1.5, -1.0, 0.7, 1.0, -0.2, 0.5, -0.8]


def softmax(xs: Sequence[float]) -> list[float]:
    m = max(xs)
    e = [math.exp(x - m) for x in xs]
    s = sum(e)
    return [v / s for v in e]


def expected_distribution(logits: Sequence[float], temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                          min_p: float = 0.0) -> list[float]:
    """Temperature, top-k, top-p over the top-k renormalised, min-p vs the top probability; renormalised."""
    scaled = [x / temperature for x in logits]
    keep = set(range(len(scaled)))
    order = sorted(keep, key=lambda i: -scaled[i])
    if top_k:
        keep = set(order[:top_k])
    probs = softmax([scaled[i] if i in keep else -math.inf for i in range(len(scaled))])
    if top_p < 1.0:
        kept, mass = set(), 0.0
        for i in order:
            if i not in keep:
                continue
            kept.add(i)
            mass += probs[i]
            if mass >= top_p:
                break
        keep = kept
        probs = [p if i in keep else 0.0 for i, p in enumerate(probs)]
        total = sum(probs)
        probs = [p / total for p in probs]
    if min_p > 0.0:
        top = max(probs)
        probs = [p if p >= min_p * top else 0.0 for p in probs]
        total = sum(probs)
        probs = [p / total for p in probs]
    return probs


def draw_counts(params: SamplingParams, n: int = 20000, rows: int = 2000, logits: Sequence[float] = LOGITS,
                seed: int = 1234) -> list[int]:
    sampler = Sampler(len(logits), torch.device("cpu"), [], seed)
    reqs = [make_request(params, rid=str(i)) for i in range(rows)]
    batch = torch.tensor([list(logits)] * rows, dtype=torch.float32)
    counts = [0] * len(logits)
    for _ in range(n // rows):
        for t in run_sampler(sampler, batch, reqs).token_ids:
            counts[t] += 1
    return counts


def assert_fits(counts: list[int], expected: list[float]) -> None:
    n = sum(counts)
    support = [i for i, p in enumerate(expected) if p > 0]
    outside = {i: c for i, c in enumerate(counts) if expected[i] == 0 and c}
    assert not outside, f"tokens outside the truncated set were drawn: {outside}"
    assert all(n * expected[i] >= 5 for i in support), "chi-square needs expected counts >= 5"
    stat = sum((counts[i] - n * expected[i]) ** 2 / (n * expected[i]) for i in support)
    df = len(support) - 1
    if df == 0:
        return
    assert stat < critical(df), f"chi2={stat:.2f} >= {critical(df):.2f} (df={df}); counts={counts}, " \
                                f"expected={[round(n * p) for p in expected]}"


CASES = {
    "plain": dict(temperature=1.0),
    "temperature": dict(temperature=0.6),
    "top_k": dict(temperature=1.0, top_k=4),
    "top_k-hot": dict(temperature=1.7, top_k=6),
    "top_p": dict(temperature=1.0, top_p=0.5),
    "top_p-cold": dict(temperature=0.8, top_p=0.85),
    "top_k+top_p": dict(temperature=1.0, top_k=6, top_p=0.75),
    "min_p": dict(temperature=1.0, min_p=0.2),
    "min_p-hot": dict(temperature=2.0, min_p=0.5),
    "all": dict(temperature=1.3, top_k=8, top_p=0.9, min_p=0.15),
}


@pytest.mark.parametrize("case", list(CASES))
def test_truncated_distribution_chi_square(case: str) -> None:
    kw = CASES[case]
    expected = expected_distribution(LOGITS, **kw)
    kept = sum(p > 0 for p in expected)
    if any(k in kw for k in ("top_k", "top_p", "min_p")):
        assert 1 < kept < VOCAB, "the case must truncate, yet leave something to test"
    counts = draw_counts(SamplingParams(**kw))
    assert_fits(counts, expected)


def test_expected_truncation_sets() -> None:
    """The reference truncation itself, checked by hand on the sorted order 1, 5, 3, 8, 7, 10, 0, 4, ..."""
    def support(**kw: Any) -> set[int]:
        return {i for i, p in enumerate(expected_distribution(LOGITS, **kw)) if p > 0}

    assert support(top_k=4) == {1, 5, 3, 8}
    p = softmax(LOGITS)
    # top-p: the smallest prefix of the sorted order whose mass reaches 0.5
    assert p[1] + p[5] < 0.5 <= p[1] + p[5] + p[3]
    assert support(top_p=0.5) == {1, 5, 3}
    # top-p over the top-k renormalised: within the top 3, 1 and 5 already reach 0.6
    q = softmax([LOGITS[i] for i in (1, 5, 3)])
    assert q[0] < 0.6 <= q[0] + q[1]
    assert support(top_k=3, top_p=0.6) == {1, 5}
    assert p[1] + p[5] < 0.6  # (without the renormalisation, 3 would be kept too)
    # min-p: p >= 0.2 * p_max  <=>  logit >= 2.0 + ln 0.2 = 0.39
    assert support(min_p=0.2) == {1, 5, 3, 8, 7, 10}


def test_mixed_rows_each_follow_their_params() -> None:
    """Rows of different truncations in one batch: each row's counts fit its own distribution."""
    kinds = [dict(temperature=1.0, top_k=3), dict(temperature=1.0, top_p=0.5), dict(temperature=1.0, min_p=0.3),
             dict(temperature=1.0)]
    rows_per = 500
    sampler = Sampler(VOCAB, torch.device("cpu"), [], 7)
    reqs = [make_request(SamplingParams(**kinds[i % 4]), rid=str(i)) for i in range(4 * rows_per)]
    batch = torch.tensor([LOGITS] * len(reqs))
    counts = [[0] * VOCAB for _ in kinds]
    for _ in range(8):
        for i, t in enumerate(run_sampler(sampler, batch, reqs).token_ids):
            counts[i % 4][t] += 1
    for kw, c in zip(kinds, counts):
        assert_fits(c, expected_distribution(LOGITS, **kw))


def test_greedy_rows_take_the_argmax_beside_random_rows() -> None:
    sampler = Sampler(VOCAB, torch.device("cpu"), [], 0)
    reqs = [make_request(SamplingParams(temperature=0.0 if i % 2 else 1.0), rid=str(i)) for i in range(64)]
    tokens = run_sampler(sampler, torch.tensor([LOGITS] * 64), reqs).token_ids
    assert all(t == 1 for t in tokens[1::2])
    assert len(set(tokens[0::2])) > 1


def test_top_k_one_and_tiny_top_p_are_greedy() -> None:
    sampler = Sampler(VOCAB, torch.device("cpu"), [], 0)
    for params in (SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=1.0, top_p=0.01),
                   SamplingParams(temperature=1.0, min_p=1.0)):
        reqs = [make_request(params, rid=str(i)) for i in range(200)]
        assert set(run_sampler(sampler, torch.tensor([LOGITS] * 200), reqs).token_ids) == {1}


def test_sampler_seeded_rows_ignore_the_batch() -> None:
    """A seeded row draws from its own generator: the same tokens whatever else is in the batch."""
    params = SamplingParams(temperature=1.0, seed=123)

    def run(batch_size: int, at: int) -> list[int]:
        sampler = Sampler(VOCAB, torch.device("cpu"), [], 99 + batch_size)
        reqs = [make_request(SamplingParams(temperature=1.0, seed=s) if s else SamplingParams(temperature=1.0),
                             rid=str(i), seed_generator=True)
                for i, s in enumerate([None, 5, None, 9][:batch_size])]
        me = make_request(params, rid="me", seed_generator=True)
        reqs.insert(at, me)
        logits = torch.tensor([LOGITS] * len(reqs))
        return [run_sampler(sampler, logits, reqs).token_ids[at] for _ in range(30)]

    alone = run(0, 0)
    assert run(4, 2) == alone
    assert run(3, 3) == alone
    assert len(set(alone)) > 1


# ============================================================================ penalties and bias (unit)
def process(params: SamplingParams, logits: Sequence[float], prompt: Sequence[int], output: Sequence[int],
            eos: Sequence[int] = ()) -> list[float]:
    sampler = Sampler(len(logits), torch.device("cpu"), list(eos), 0)
    raw = torch.tensor([list(logits)])
    reqs = [make_request(params, prompt, output)]
    batch, fed = _batch(sampler, reqs)
    out = sampler._edit(raw, batch, fed)
    assert raw.tolist() == [list(logits)], "processing must not modify the caller's logits"
    return out[0].tolist()


PEN_LOGITS = [1.5, -0.5, 2.0, 0.0, -1.25, 0.75, 3.0, -2.0]


def test_repetition_penalty_matches_hand_computation() -> None:
    prompt, output = [0, 1, 1], [3, 4, 0]  # seen: 0, 1, 3, 4 (prompt and output alike, once each)
    got = process(SamplingParams(repetition_penalty=2.0), PEN_LOGITS, prompt, output)
    want = [1.5 / 2, -0.5 * 2, 2.0, 0.0, -1.25 * 2, 0.75, 3.0, -2.0]
    assert got == pytest.approx(want, abs=1e-6)
    got = process(SamplingParams(repetition_penalty=0.5), PEN_LOGITS, prompt, [])  # < 1 rewards: prompt only
    assert got == pytest.approx([1.5 / 0.5, -0.5 * 0.5, 2.0, 0.0, -1.25, 0.75, 3.0, -2.0], abs=1e-6)


def test_presence_and_frequency_penalties_match_hand_computation() -> None:
    prompt, output = [2, 2, 6], [5, 5, 5, 1, 7]  # the prompt is not counted
    got = process(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), PEN_LOGITS, prompt, output)
    want = list(PEN_LOGITS)
    for tok, count in {5: 3, 1: 1, 7: 1}.items():
        want[tok] -= 0.25 * count + 0.5
    assert got == pytest.approx(want, abs=1e-6)
    # negative penalties reward repetition
    got = process(SamplingParams(presence_penalty=-1.0), PEN_LOGITS, prompt, output)
    assert got == pytest.approx([x + (1.0 if i in (5, 1, 7) else 0.0) for i, x in enumerate(PEN_LOGITS)], abs=1e-6)
    # no output yet: nothing to penalise
    assert process(SamplingParams(frequency_penalty=2.0, presence_penalty=2.0), PEN_LOGITS, prompt, []) == \
        pytest.approx(PEN_LOGITS)


def test_bias_then_penalties_in_order() -> None:
    """logit_bias first, then repetition (on the biased value), then presence/frequency."""
    params = SamplingParams(logit_bias={0: -3.0, 3: 1.0, 6: 0.5}, repetition_penalty=1.5, presence_penalty=0.2,
                            frequency_penalty=0.1)
    prompt, output = [0, 4], [3, 3]
    got = process(params, PEN_LOGITS, prompt, output)
    want = list(PEN_LOGITS)
    want[0] = (1.5 - 3.0) * 1.5  # biased to -1.5, then multiplied
    want[3] = (0.0 + 1.0) / 1.5 - (0.1 * 2 + 0.2)  # biased to 1.0, divided, then output counts
    want[4] = -1.25 * 1.5
    want[6] = 3.0 + 0.5
    assert got == pytest.approx(want, abs=1e-6)


def test_min_tokens_masks_stop_ids_until_reached() -> None:
    eos = [7]
    params = SamplingParams(min_tokens=3, stop_token_ids=[2, 5])
    for n_out in range(5):
        got = process(params, PEN_LOGITS, [1], [0] * n_out, eos=eos)
        masked = {i for i, x in enumerate(got) if x == -math.inf}
        assert masked == ({2, 5, 7} if n_out < 3 else set()), n_out
    # ignore_eos: EOS may come at once, the stop ids still wait
    params = SamplingParams(min_tokens=2, stop_token_ids=[2], ignore_eos=True)
    got = process(params, PEN_LOGITS, [1], [], eos=eos)
    assert {i for i, x in enumerate(got) if x == -math.inf} == {2}


def test_logprobs_are_raw_despite_processing() -> None:
    """Bias, penalties and temperature change the draw, never the reported logprobs."""
    sampler = Sampler(len(PEN_LOGITS), torch.device("cpu"), [], 0)
    raw = torch.tensor([PEN_LOGITS] * 2)
    lp = torch.log_softmax(raw[0].double(), -1)
    reqs = [make_request(SamplingParams(temperature=0.0, logprobs=3, logit_bias={7: 50.0}, repetition_penalty=3.0),
                         [6], [6], rid="a"),
            make_request(SamplingParams(temperature=0.3, logprobs=1, top_k=1, logit_bias={4: 50.0}), rid="b")]
    res = run_sampler(sampler, raw, reqs)
    assert res.token_ids == [7, 4]
    assert res.logprobs == pytest.approx([lp[7].item(), lp[4].item()], abs=TOL)
    assert res.ranks == [8, 7]  # ranks in the raw distribution
    assert res.top_ids[0][:3] == [6, 2, 0]
    assert res.top_logprobs[0][:3] == pytest.approx([lp[6].item(), lp[2].item(), lp[0].item()], abs=TOL)


# ============================================================================ engine: logprobs vs HF
@pytest.fixture(scope="module")
def llm(tiny_checkpoint: tuple[str, Any]) -> LLM:
    return LLM(tiny_checkpoint[0], device="cpu", block_size=BLOCK, num_kv_blocks=64, max_model_len=128, seed=0)


def check_position(entry: dict, token: int, lp: torch.Tensor, k: int) -> None:
    """``entry`` (id -> Logprob) holds ``token`` with its raw logprob and rank, plus HF's top k."""
    assert token in entry
    got = entry[token]
    value = lp[token].item()
    assert got.logprob == pytest.approx(value, abs=TOL)
    lo, hi = int((lp > value + TOL).sum()) + 1, int((lp > value - TOL).sum()) + 1
    assert lo <= got.rank <= hi, (got.rank, lo, hi)
    top = lp.topk(k)
    for rank, (tid, v) in enumerate(zip(top.indices.tolist(), top.values.tolist()), start=1):
        assert tid in entry, f"HF's rank-{rank} token {tid} missing"
        assert entry[tid].logprob == pytest.approx(v, abs=TOL)
        assert entry[tid].rank == rank
    extra = set(entry) - set(top.indices.tolist()) - {token}
    assert not extra, f"unexpected ids {extra}"
    assert len(entry) in (k, k + 1)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("k", [0, 1, 5])
def test_logprobs_match_hf(llm: LLM, tiny_checkpoint: tuple[str, Any], temperature: float, k: int) -> None:
    _, model = tiny_checkpoint
    prompt = rand_prompt(7, seed=k)
    (out,) = llm.generate([{"prompt_token_ids": prompt}],
                          SamplingParams(temperature=temperature, seed=11, max_tokens=10, ignore_eos=True, logprobs=k))
    comp = out.outputs[0]
    assert len(comp.token_ids) == len(comp.logprobs) == 10
    lp = hf_logprobs(model, prompt + comp.token_ids[:-1])[len(prompt) - 1:]
    for i, (tok, entry) in enumerate(zip(comp.token_ids, comp.logprobs)):
        check_position(entry, tok, lp[i], k)
        if temperature == 0.0:
            assert entry[tok].rank == 1 or lp[i].max() - lp[i, tok] < 1e-4
    assert comp.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(comp.token_ids, comp.logprobs)),
                                                    abs=1e-4)
    assert out.prompt_logprobs is None


def test_logprobs_differ_per_request_in_a_batch(llm: LLM, tiny_checkpoint: tuple[str, Any]) -> None:
    """One batch, different k (and none): each request gets its own k."""
    _, model = tiny_checkpoint
    prompts = [rand_prompt(n, seed=50 + n) for n in (3, 6, 9)]
    ks = [2, None, 6]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [SamplingParams(temperature=1.0, seed=i, max_tokens=6, ignore_eos=True, logprobs=k)
                         for i, k in enumerate(ks)])
    for prompt, k, out in zip(prompts, ks, outs):
        comp = out.outputs[0]
        if k is None:
            assert comp.logprobs is None and comp.cumulative_logprob is None
            continue
        lp = hf_logprobs(model, prompt + comp.token_ids[:-1])[len(prompt) - 1:]
        for i, (tok, entry) in enumerate(zip(comp.token_ids, comp.logprobs)):
            check_position(entry, tok, lp[i], k)


def check_prompt_logprobs(model: torch.nn.Module, prompt: list[int], plp: list, k: int) -> None:
    assert plp is not None and len(plp) == len(prompt), f"{len(plp)} entries for a {len(prompt)}-token prompt"
    assert plp[0] is None
    lp = hf_logprobs(model, prompt)
    for i in range(1, len(prompt)):
        check_position(plp[i], prompt[i], lp[i - 1], k)


@pytest.mark.parametrize("prompt_len,k", [(1, 3), (2, 0), (9, 3), (17, 1)])
def test_prompt_logprobs_match_hf(llm: LLM, tiny_checkpoint: tuple[str, Any], prompt_len: int, k: int) -> None:
    _, model = tiny_checkpoint
    prompt = rand_prompt(prompt_len, seed=70 + prompt_len)
    (out,) = llm.generate([{"prompt_token_ids": prompt}],
                          SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=k))
    check_prompt_logprobs(model, prompt, out.prompt_logprobs, k)
    assert len(out.outputs[0].token_ids) == 3


def test_prompt_logprobs_with_max_tokens_zero(llm: LLM, tiny_checkpoint: tuple[str, Any]) -> None:
    _, model = tiny_checkpoint
    prompt = rand_prompt(6, seed=80)
    (out,) = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=0, prompt_logprobs=2))
    check_prompt_logprobs(model, prompt, out.prompt_logprobs, 2)
    assert out.outputs[0].token_ids == [] and out.outputs[0].finish_reason == "length"


def test_prompt_logprobs_chunked_prefill(tiny_checkpoint: tuple[str, Any]) -> None:
    path, model = tiny_checkpoint
    llm = LLM(path, device="cpu", block_size=BLOCK, num_kv_blocks=64, max_model_len=128, max_num_batched_tokens=5)
    prompts = [rand_prompt(n, seed=90 + n) for n in (23, 4, 11)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=2, logprobs=2))
    for prompt, out in zip(prompts, outs):
        check_prompt_logprobs(model, prompt, out.prompt_logprobs, 2)
        comp = out.outputs[0]
        lp = hf_logprobs(model, prompt + comp.token_ids[:-1])[len(prompt) - 1:]
        for i, (tok, entry) in enumerate(zip(comp.token_ids, comp.logprobs)):
            check_position(entry, tok, lp[i], 2)


def test_prompt_logprobs_survive_preemption_mid_prefill(tiny_checkpoint: tuple[str, Any]) -> None:
    path, model = tiny_checkpoint
    llm = LLM(path, device="cpu", block_size=4, num_kv_blocks=6, max_model_len=64, max_num_batched_tokens=5)
    a, b = rand_prompt(4, seed=1), rand_prompt(20, seed=2)
    outs = llm.generate([{"prompt_token_ids": a}, {"prompt_token_ids": b}],
                        [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
                         SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=1)])
    assert llm.engine.scheduler.num_preemptions > 0
    check_prompt_logprobs(model, b, outs[1].prompt_logprobs, 1)


# ============================================================================ engine: seeds
def sample(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [o.outputs[0].token_ids for o in outs]


def hot(seed: int | None = None, n: int = 12, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=n, ignore_eos=True, **kw)


def test_seeded_request_is_batch_independent(llm: LLM) -> None:
    prompt = rand_prompt(5, seed=5)
    (alone,) = sample(llm, [prompt], [hot(123)])
    assert len(alone) == 12
    others = [rand_prompt(n, seed=n) for n in (3, 8, 2, 6)]
    batch = sample(llm, [others[0], others[1], prompt, others[2], others[3], prompt],
                   [hot(), hot(7), hot(123), SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
                    hot(None, 20), hot(123, top_k=0)])
    assert batch[2] == alone
    assert batch[5] == alone, "two requests with one seed draw the same tokens"
    (again,) = sample(llm, [prompt], [hot(123)])
    assert again == alone
    (other,) = sample(llm, [prompt], [hot(124)])
    assert other != alone


def test_greedy_ignores_seeds(tiny_checkpoint: tuple[str, Any], llm: LLM) -> None:
    prompt = rand_prompt(6, seed=6)
    greedy = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, seed=s) for s in (None, 1, 2)]
    base = sample(llm, [prompt] * 3, greedy)
    assert base[0] == base[1] == base[2]
    other_engine = LLM(tiny_checkpoint[0], device="cpu", block_size=BLOCK, num_kv_blocks=32, max_model_len=128, seed=7)
    assert sample(other_engine, [prompt], greedy[:1])[0] == base[0]


def test_unseeded_sampling_follows_the_engine_seed(tiny_checkpoint: tuple[str, Any]) -> None:
    path = tiny_checkpoint[0]
    prompt = rand_prompt(6, seed=6)

    def run(engine_seed: int) -> list[list[int]]:
        llm = LLM(path, device="cpu", block_size=BLOCK, num_kv_blocks=32, max_model_len=128, seed=engine_seed)
        return sample(llm, [prompt, prompt], [hot(), hot(42)])

    s0, s0_again, s1 = run(0), run(0), run(1)
    assert s0 == s0_again, "a fresh engine with the same seed must reproduce unseeded sampling"
    assert s0[0] != s1[0], "unseeded sampling must follow the engine seed"
    assert s0[1] == s1[1], "a seeded request must not depend on the engine seed"


def test_seeded_sampling_and_logprobs_survive_preemption(tiny_checkpoint: tuple[str, Any]) -> None:
    """Recompute after preemption draws nothing: seeded tokens and their logprobs match a roomy run."""
    path, model = tiny_checkpoint
    prompts = [rand_prompt(n, seed=700 + n) for n in (6, 5, 7, 4)]
    params = [hot(100 + i, 10, logprobs=2) for i in range(4)]
    runs = []
    for blocks in (64, 7):
        llm = LLM(path, device="cpu", block_size=BLOCK, num_kv_blocks=blocks, max_model_len=64)
        runs.append(llm.generate([{"prompt_token_ids": p} for p in prompts], params))
    assert llm.engine.scheduler.num_preemptions > 0
    for roomy, tight, prompt in zip(*runs, prompts):
        assert tight.outputs[0].token_ids == roomy.outputs[0].token_ids
        comp = tight.outputs[0]
        assert len(comp.token_ids) == len(comp.logprobs) == 10
        lp = hf_logprobs(model, prompt + comp.token_ids[:-1])[len(prompt) - 1:]
        for i, (tok, entry) in enumerate(zip(comp.token_ids, comp.logprobs)):
            check_position(entry, tok, lp[i], 2)


# ============================================================================ engine: penalties vs HF
def penalised(logits: torch.Tensor, params: SamplingParams, context: list[int], n_prompt: int) -> torch.Tensor:
    """The documented processing, written out independently (float64)."""
    x = logits.double().clone()
    for tok, b in (params.logit_bias or {}).items():
        x[tok] += b
    if params.allowed_token_ids is not None:
        barred = torch.ones_like(x, dtype=torch.bool)
        barred[params.allowed_token_ids] = False
        x[barred] = float("-inf")
    if params.repetition_penalty != 1.0:
        for tok in set(context):
            x[tok] = x[tok] / params.repetition_penalty if x[tok] > 0 else x[tok] * params.repetition_penalty
    out = context[n_prompt:]
    for tok in set(out):
        x[tok] -= params.frequency_penalty * out.count(tok) + params.presence_penalty
    return x


@pytest.mark.parametrize("kw", [dict(repetition_penalty=1.8), dict(repetition_penalty=0.6),
                                dict(presence_penalty=1.5), dict(frequency_penalty=0.9),
                                dict(frequency_penalty=-0.6, presence_penalty=0.3),
                                dict(logit_bias={17: 0.5, 300: -4.0}, repetition_penalty=1.3),
                                dict(allowed_token_ids=[3, 17, 42, 300, 511], repetition_penalty=1.5)],
                         ids=["rep>1", "rep<1", "presence", "frequency", "freq<0+presence", "bias+rep", "allowed+rep"])
def test_penalties_greedy_against_hf(llm: LLM, tiny_checkpoint: tuple[str, Any], kw: dict) -> None:
    """Greedy with penalties: every token is the argmax of HF's logits penalised by hand."""
    _, model = tiny_checkpoint
    prompt = rand_prompt(8, seed=8)
    n = 16
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)
    plain, tokens = sample(llm, [prompt, prompt], [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
                                                   params])
    assert len(tokens) == n
    assert tokens != plain, "the penalty should change this greedy output (else the test shows nothing)"
    logits = teacher_forced_logits(model, prompt + tokens[:-1])
    for i, tok in enumerate(tokens):
        pos = len(prompt) + i
        x = penalised(logits[pos - 1], params, prompt + tokens[:i], len(prompt))
        gap = (x.max() - x[tok]).item()
        assert gap < 1e-4, f"position {i}: ours {tok}, expected {int(x.argmax())} (gap {gap})"


def test_logit_bias_forces_a_token(llm: LLM) -> None:
    prompt = rand_prompt(5, seed=9)
    for params in (SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logit_bias={42: 100.0}),
                   SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, logit_bias={42: 100.0}, seed=3),
                   SamplingParams(temperature=0.7, top_p=0.5, max_tokens=6, ignore_eos=True, logit_bias={42: 100.0})):
        (tokens,) = sample(llm, [prompt], [params])
        assert tokens == [42] * 6
    # a huge negative bias bans the greedy favourite
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    (plain,) = sample(llm, [prompt], [greedy])
    banned = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logit_bias={plain[0]: -100.0})
    (tokens,) = sample(llm, [prompt], [banned])
    assert plain[0] not in tokens


def test_allowed_token_ids_hold_sampled_rows_too_and_name_a_bad_id(llm: LLM) -> None:
    allowed = [3, 17, 42]
    params = SamplingParams(temperature=1.0, seed=4, max_tokens=24, ignore_eos=True, allowed_token_ids=allowed)
    (tokens,) = sample(llm, [rand_prompt(5, seed=10)], [params])
    assert set(tokens) <= set(allowed) and len(set(tokens)) > 1
    with pytest.raises(ValueError, match=r"allowed_token_ids=\[2000\]: expected token ids in \[0, "):
        llm.generate([{"prompt_token_ids": [1, 2]}], SamplingParams(allowed_token_ids=[3, 2000]))
    with pytest.raises(ValueError, match=r"allowed_token_ids=\[\]: expected a non-empty list"):
        SamplingParams(allowed_token_ids=[])


def test_truncate_prompt_tokens_keeps_the_last_k(llm: LLM) -> None:
    prompt = rand_prompt(20, seed=11)
    greedy = dict(temperature=0.0, max_tokens=5, ignore_eos=True)
    cut, whole = llm.generate([{"prompt_token_ids": prompt}, {"prompt_token_ids": prompt[-6:]}],
                              [SamplingParams(**greedy, truncate_prompt_tokens=6), SamplingParams(**greedy)])
    assert cut.prompt_token_ids == prompt[-6:] and cut.outputs[0].token_ids == whole.outputs[0].token_ids
    (kept,) = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(**greedy, truncate_prompt_tokens=-1))
    assert kept.prompt_token_ids == prompt  # -1: up to max_model_len
    with pytest.raises(ValueError, match=r"truncate_prompt_tokens=0: expected an integer >= 1"):
        SamplingParams(truncate_prompt_tokens=0)


# ============================================================================ engine: stopping
class _Int(int):
    """An integer of another type than int (as a numpy integer is), for CI machines without numpy."""


def _integer_types() -> list[Any]:
    try:
        import numpy
    except ImportError:
        return [_Int]
    return [_Int, numpy.int64, numpy.int32]


@pytest.mark.parametrize("integer", _integer_types())
def test_integers_of_other_types_are_taken_as_ints_as_in_vllm(llm: LLM, integer: Any) -> None:
    """vLLM compares its parameters, so numpy's integers and floats work there: here they are taken as Python ints
    and floats, in the parameters and in a prompt's ids (a bool still is none); ``logprobs=True`` asks for one
    alternative (False for none) and repeated stop_token_ids count once, as vLLM's ``__post_init__`` has them."""
    assert (SamplingParams(logprobs=False).logprobs, SamplingParams(prompt_logprobs=False).prompt_logprobs) == (0, 0)
    p = SamplingParams(max_tokens=integer(3), seed=integer(4), top_k=integer(5), logprobs=True, prompt_logprobs=True,
                       stop_token_ids=[integer(9), 9, 8], allowed_token_ids=[integer(1), 2])
    assert (p.max_tokens, p.seed, p.top_k, p.logprobs, p.prompt_logprobs, p.stop_token_ids, p.allowed_token_ids) == (
        3, 4, 5, 1, 1, [9, 8], [1, 2])
    assert {type(v) for v in (p.max_tokens, p.seed, p.top_k, *p.stop_token_ids, *p.allowed_token_ids)} == {int}
    assert SamplingParams(temperature=Fraction(1, 2), top_p=Fraction(9, 10)).temperature == 0.5  # any real number
    ids = rand_prompt(5, seed=3)
    want = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=3, temperature=0))[0]
    got = llm.generate([{"prompt_token_ids": [integer(t) for t in ids]}],
                       SamplingParams(max_tokens=3, temperature=0), priority=iter([integer(0)]))[0]
    assert got.prompt_token_ids == ids and {type(t) for t in got.prompt_token_ids} == {int}
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    with pytest.raises(ValueError, match=r"prompt_token_ids=\[5, True\]: expected a list of ints"):
        llm.generate([{"prompt_token_ids": [5, True]}], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="SamplingParams.max_tokens=True"):
        SamplingParams(max_tokens=True)


def test_a_ported_vllm_scripts_prompts_and_parameters_are_taken(llm: LLM) -> None:
    """What a vLLM script passes: ``TokensPrompt`` / ``TextPrompt``, ids as a numpy array or a tensor, the older
    ``guided_decoding`` (and ``GuidedDecodingParams``), ``spaces_between_special_tokens`` and an empty
    ``logits_processors``; a logits processor, or both constraint fields, is refused by name."""
    import numpy
    import torch

    from vtcore import TextPrompt, TokensPrompt
    from vtcore.sampling_params import GuidedDecodingParams

    ids = rand_prompt(5, seed=4)
    greedy = SamplingParams(max_tokens=3, temperature=0)
    want = llm.generate([{"prompt_token_ids": ids}], greedy)[0].outputs[0].token_ids
    outs = llm.generate([TokensPrompt(prompt_token_ids=ids), {"prompt_token_ids": numpy.array(ids)},
                         {"prompt_token_ids": torch.tensor(ids)}], greedy)
    assert [o.outputs[0].token_ids for o in outs] == [want] * 3
    assert {type(t) for o in outs for t in o.prompt_token_ids} == {int}
    assert TextPrompt(prompt="hi") == {"prompt": "hi"}
    with pytest.raises(ValueError, match=r"prompt_token_ids=array\(\[1.5\]\): expected a list of ints"):
        llm.generate([{"prompt_token_ids": numpy.array([1.5])}], greedy)
    choice = GuidedDecodingParams(choice=["yes", "no"])
    p = SamplingParams(guided_decoding=choice, spaces_between_special_tokens=False, logits_processors=[])
    assert (p.structured_outputs, p.guided_decoding) == (choice, None)
    with pytest.raises(ValueError, match=r"^SamplingParams.guided_decoding=.*: expected None beside structured_"):
        SamplingParams(guided_decoding=choice, structured_outputs=choice)
    with pytest.raises(ValueError, match=r"^SamplingParams.logits_processors=\[.*: expected None: per-request logits "
                                         r"processors are not supported"):
        SamplingParams(logits_processors=[lambda ids, logits: logits])
    with pytest.raises(ValueError, match=r"^SamplingParams.spaces_between_special_tokens=1: expected a bool"):
        SamplingParams(spaces_between_special_tokens=1)


def test_max_tokens_finishes_with_length(llm: LLM) -> None:
    outs = llm.generate([{"prompt_token_ids": rand_prompt(4, seed=s)} for s in range(3)],
                        [SamplingParams(temperature=t, max_tokens=m, ignore_eos=True) for t, m in
                         ((0.0, 1), (1.0, 7), (0.0, 13))])
    for out, m in zip(outs, (1, 7, 13)):
        assert len(out.outputs[0].token_ids) == m
        assert out.outputs[0].finish_reason == "length"
        assert out.outputs[0].stop_reason is None


def test_stop_token_ids_end_the_request(llm: LLM) -> None:
    prompt = rand_prompt(6, seed=12)
    (plain,) = sample(llm, [prompt], [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)])
    stop = plain[4]
    cut = plain.index(stop)
    never = next(t for t in range(512) if t not in plain)
    (out,) = llm.generate([{"prompt_token_ids": prompt}],
                          SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[never, stop]))
    comp = out.outputs[0]
    assert comp.token_ids == plain[:cut + 1], "the stop id is the last token"
    assert comp.finish_reason == "stop"
    assert comp.stop_reason == stop


@pytest.mark.parametrize("min_tokens", [0, 1, 4])
def test_min_tokens_delays_stop_token_ids(llm: LLM, min_tokens: int) -> None:
    stop = 77
    (out,) = llm.generate([{"prompt_token_ids": rand_prompt(5, seed=13)}],
                          SamplingParams(temperature=0.0, max_tokens=10, min_tokens=min_tokens, stop_token_ids=[stop],
                                         logit_bias={stop: 50.0}))
    comp = out.outputs[0]
    assert stop not in comp.token_ids[:min_tokens]
    assert comp.token_ids[min_tokens:] == [stop]
    assert len(comp.token_ids) == min_tokens + 1
    assert comp.finish_reason == "stop" and comp.stop_reason == stop


@pytest.fixture(scope="module")
def eos_llm(make_checkpoint: Any) -> tuple[LLM, int]:
    path, _ = make_checkpoint(eos_token_id=7)
    llm = LLM(path, device="cpu", block_size=BLOCK, num_kv_blocks=32, max_model_len=128)
    assert 7 in llm.engine.eos_token_ids
    return llm, 7


@pytest.mark.parametrize("min_tokens", [0, 3])
def test_eos_stops_after_min_tokens(eos_llm: tuple[LLM, int], min_tokens: int) -> None:
    llm, eos = eos_llm
    prompt = rand_prompt(4, seed=14)
    for temperature in (0.0, 1.0):
        (out,) = llm.generate([{"prompt_token_ids": prompt}],
                              SamplingParams(temperature=temperature, seed=1, max_tokens=10, min_tokens=min_tokens,
                                             logit_bias={eos: 50.0}))
        comp = out.outputs[0]
        assert len(comp.token_ids) == min_tokens + 1
        assert comp.token_ids[-1] == eos and eos not in comp.token_ids[:-1]
        assert comp.finish_reason == "stop" and comp.stop_reason is None


def test_an_eos_id_the_generation_config_adds_is_the_stop_reason_as_in_vllm() -> None:
    """The embedded default's tokenizer ends text with id 2 and its generation config also with 0: ending on 2
    gives stop_reason None, on 0 (vLLM puts such ids in stop_token_ids) stop_reason 0."""
    llm = LLM(device="cpu", num_kv_blocks=32)
    assert llm.engine.tokenizer.eos_token_id == 2 and llm.engine.eos_token_ids == [0, 2]
    for eos, reason in ((2, None), (0, 0)):
        (out,) = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=4, logit_bias={eos: 100.0}))
        comp = out.outputs[0]
        assert comp.token_ids == [eos] and comp.finish_reason == "stop" and comp.stop_reason == reason


def test_ignore_eos_runs_to_max_tokens(eos_llm: tuple[LLM, int]) -> None:
    llm, eos = eos_llm
    (out,) = llm.generate([{"prompt_token_ids": rand_prompt(4, seed=15)}],
                          SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logit_bias={eos: 50.0}))
    assert out.outputs[0].token_ids == [eos] * 5
    assert out.outputs[0].finish_reason == "length"
