"""The sampler on small hand-made logits: greedy, temperature, top-k, top-p, penalties, seeds, logprobs."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from engine.params import SamplingParams
from engine.sampling import Sampler

# Token probabilities deliberately out of index order, so sorting/scattering mistakes show.
PROBS = [0.15, 0.5, 0.05, 0.3]  # ranks: token 1 > token 3 > token 0 > token 2
PROB_LOGITS = [math.log(p) for p in PROBS]


def row(values: list[float]) -> torch.Tensor:
    return torch.tensor([values], dtype=torch.float32)


def draw(logits: list[float], params: SamplingParams, n: int = 400, seed: int = 0) -> Counter:
    """`n` seeded draws from one row (n identical rows sharing one generator, in one call)."""
    gen = torch.Generator().manual_seed(seed)
    tokens, _ = Sampler()(row(logits).repeat(n, 1), [params] * n, [[] for _ in range(n)], [gen] * n)
    assert len(tokens) == n
    return Counter(tokens)


def draw_one_by_one(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None,
                    n: int) -> list[int]:
    return [Sampler()(logits, [params], [[]], [gen])[0][0] for _ in range(n)]


# ------------------------------------------------------------ greedy and temperature


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=1)])
def test_greedy_is_argmax_and_ignores_the_generator(params):
    logits = torch.tensor([[0.1, 2.0, 1.9, -1.0], [3.0, -2.0, 2.9, 0.0]])
    tokens, infos = Sampler()(logits, [params, params], [[], []], [None, None])
    assert tokens == [1, 0]
    assert infos == [None, None]
    assert set(draw([0.0, 0.2, 0.1], params, n=200)) == {1}


def test_low_temperature_is_almost_always_argmax():
    logits = [3.0, 2.0, 1.0, -2.0]
    at_one = draw(logits, SamplingParams(temperature=1.0), n=500)
    cold = draw(logits, SamplingParams(temperature=0.05), n=500)
    assert at_one[0] < 400  # p(argmax) ~ 0.66 at temperature 1, so the cold result below is temperature's doing
    assert cold[0] >= 495


def test_high_temperature_reaches_the_unlikely_token():
    logits = [3.0, 2.0, 1.0, -2.0]  # p(token 3) ~ 0.004 at temperature 1, ~ 0.04 at 2
    at_one = draw(logits, SamplingParams(temperature=1.0), n=1000, seed=1)
    hot = draw(logits, SamplingParams(temperature=2.0), n=1000, seed=1)
    assert hot[3] >= 10
    assert hot[3] > at_one[3]
    assert hot[0] < at_one[0]  # flatter overall, not just the tail


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_sample_frequencies_follow_softmax_over_temperature(temperature):
    logits = [1.0, 0.0, 2.0, 0.5]
    n = 4000
    counts = draw(logits, SamplingParams(temperature=temperature), n=n, seed=2)
    want = torch.softmax(torch.tensor(logits) / temperature, dim=-1).tolist()
    for tok, p in enumerate(want):
        assert abs(counts[tok] / n - p) < 0.03, (tok, counts[tok] / n, p)


# ------------------------------------------------------------ top-k and top-p


def test_top_k_keeps_only_the_k_highest_logits():
    logits = [1.0, 3.0, 0.5, 2.5, 0.0]
    unrestricted = draw(logits, SamplingParams(temperature=1.0), n=300)
    assert set(unrestricted) == {0, 1, 2, 3, 4}  # without top_k every token shows up in 300 draws
    assert set(draw(logits, SamplingParams(temperature=1.0, top_k=2), n=300)) == {1, 3}
    assert set(draw(logits, SamplingParams(temperature=1.0, top_k=3), n=300)) == {0, 1, 3}


def test_top_k_at_least_the_vocabulary_is_off():
    logits = [1.0, 3.0, 0.5]
    assert set(draw(logits, SamplingParams(temperature=1.0, top_k=10), n=300)) == {0, 1, 2}


def test_top_p_keeps_the_smallest_set_reaching_the_mass():
    assert set(draw(PROB_LOGITS, SamplingParams(temperature=1.0), n=400)) == {0, 1, 2, 3}
    assert set(draw(PROB_LOGITS, SamplingParams(temperature=1.0, top_p=0.6), n=400)) == {1, 3}
    assert set(draw(PROB_LOGITS, SamplingParams(temperature=1.0, top_p=0.4), n=400)) == {1}
    assert set(draw(PROB_LOGITS, SamplingParams(temperature=1.0, top_p=0.9), n=400)) == {0, 1, 3}


def test_top_p_renormalises_what_it_keeps():
    n = 4000
    counts = draw(PROB_LOGITS, SamplingParams(temperature=1.0, top_p=0.6), n=n, seed=3)
    assert abs(counts[1] / n - 0.5 / 0.8) < 0.03
    assert abs(counts[3] / n - 0.3 / 0.8) < 0.03


def test_top_k_then_top_p():
    # top_k=2 leaves tokens 1 and 3 at 0.625 / 0.375; top_p=0.6 then keeps only token 1.
    assert set(draw(PROB_LOGITS, SamplingParams(temperature=1.0, top_k=2, top_p=0.6), n=300)) == {1}


# ------------------------------------------------------------ batches and seeds


def test_each_row_uses_its_own_params():
    logits = torch.tensor([
        [0.0, 5.0, 4.9, 0.0],  # greedy: always token 1, even though token 2 is close
        [1.0, 3.0, 0.5, 2.5],  # top_k=2: tokens 1 and 3
        PROB_LOGITS,  # top_p=0.4: token 1 only
        [0.0, 0.0, 0.0, 0.0],  # plain sampling: everything
    ])
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_k=2),
        SamplingParams(temperature=1.0, top_p=0.4),
        SamplingParams(temperature=1.0),
    ]
    gens = [None] + [torch.Generator().manual_seed(s) for s in (10, 11, 12)]
    seen: list[set[int]] = [set() for _ in params]
    for _ in range(200):
        tokens, _ = Sampler()(logits, params, [[], [], [], []], gens)
        for s, t in zip(seen, tokens):
            s.add(t)
    assert seen == [{1}, {1, 3}, {1}, {0, 1, 2, 3}]


def test_same_seed_same_draws_different_seed_different_draws():
    logits = torch.zeros(1, 8)
    p = SamplingParams(temperature=1.0)
    a = draw_one_by_one(logits, p, torch.Generator().manual_seed(42), 50)
    b = draw_one_by_one(logits, p, torch.Generator().manual_seed(42), 50)
    c = draw_one_by_one(logits, p, torch.Generator().manual_seed(43), 50)
    assert a == b
    assert a != c
    assert len(set(a)) > 1


def test_a_rows_draws_do_not_depend_on_its_batch_neighbours():
    logits = torch.zeros(1, 8)
    p = SamplingParams(temperature=1.0)
    alone = draw_one_by_one(logits, p, torch.Generator().manual_seed(5), 30)
    mine, other = torch.Generator().manual_seed(5), torch.Generator().manual_seed(99)
    batched = []
    for _ in range(30):
        tokens, _ = Sampler()(torch.zeros(3, 8), [p, SamplingParams(temperature=0.0), p], [[], [], []],
                              [other, None, mine])
        batched.append(tokens[2])
    assert batched == alone


# ------------------------------------------------------------ penalties


def greedy_with(out: list[int], **kw) -> int:
    logits = row([2.0, 1.5, 0.0])
    return Sampler()(logits, [SamplingParams(temperature=0.0, **kw)], [out], [None])[0][0]


def test_frequency_penalty_scales_with_the_count():
    assert greedy_with([], frequency_penalty=1.0) == 0  # no history: nothing to penalise
    assert greedy_with([0], frequency_penalty=1.0) == 1  # 2.0 - 1.0 < 1.5
    assert greedy_with([0], frequency_penalty=0.4) == 0  # 2.0 - 0.4 > 1.5
    assert greedy_with([0, 0, 0], frequency_penalty=0.4) == 1  # 2.0 - 3 * 0.4 < 1.5
    assert greedy_with([2, 2], frequency_penalty=1.0) == 0  # penalising another token changes nothing
    assert greedy_with([0], frequency_penalty=0.0) == 0


def test_presence_penalty_does_not_scale_with_the_count():
    assert greedy_with([0], presence_penalty=1.0) == 1  # 2.0 - 1.0 < 1.5
    assert greedy_with([0, 0, 0], presence_penalty=0.4) == 0  # 2.0 - 0.4 > 1.5, however often it was seen


def test_negative_penalty_favours_repeats():
    assert greedy_with([1], frequency_penalty=-1.0) == 1  # 1.5 + 1.0 > 2.0
    assert greedy_with([1], presence_penalty=-1.0) == 1


def test_penalties_are_per_row_and_leave_the_callers_logits_alone():
    logits = torch.tensor([[2.0, 1.5, 0.0], [2.0, 1.5, 0.0]])
    before = logits.clone()
    params = [SamplingParams(temperature=0.0, frequency_penalty=1.0), SamplingParams(temperature=0.0)]
    tokens, _ = Sampler()(logits, params, [[0], [0]], [None, None])
    assert tokens == [1, 0]
    assert torch.equal(logits, before)


# ------------------------------------------------------------ logprobs


def test_top_logprobs_sorted_and_match_log_softmax():
    values = [0.3, 2.0, -1.0, 1.2, 0.9, -0.2]
    want = torch.log_softmax(torch.tensor(values), dim=-1)
    tokens, [info] = Sampler()(row(values), [SamplingParams(temperature=0.0, logprobs=True, top_logprobs=3)],
                               [[]], [None])
    assert tokens == [1]
    assert info.token_id == 1
    assert info.logprob == pytest.approx(want[1].item(), abs=1e-6)
    assert [t for t, _ in info.top] == [1, 3, 4]
    lps = [lp for _, lp in info.top]
    assert lps == sorted(lps, reverse=True)
    for t, lp in info.top:
        assert lp == pytest.approx(want[t].item(), abs=1e-6)
    assert math.fsum(math.exp(v) for v in want.tolist()) == pytest.approx(1.0)


@pytest.mark.parametrize("k", [1, 5, 20])
def test_top_logprobs_count(k):
    values = torch.linspace(-3, 3, 32).flip(0).tolist()
    _, [info] = Sampler()(row(values), [SamplingParams(temperature=0.0, logprobs=True, top_logprobs=k)],
                          [[]], [None])
    assert [t for t, _ in info.top] == list(range(k))


def test_logprobs_without_top_and_rows_without_logprobs():
    logits = torch.tensor([[0.0, 1.0], [1.0, 0.0]])
    params = [SamplingParams(temperature=0.0, logprobs=True), SamplingParams(temperature=0.0)]
    tokens, infos = Sampler()(logits, params, [[], []], [None, None])
    assert tokens == [1, 0]
    assert infos[0].top == [] and infos[0].token_id == 1
    assert infos[0].logprob == pytest.approx(math.log(math.e / (1 + math.e)), abs=1e-6)
    assert infos[1] is None


def test_logprobs_are_of_the_penalised_logits():
    values = [2.0, 1.5, 0.0]
    p = SamplingParams(temperature=0.0, frequency_penalty=0.5, presence_penalty=0.25, logprobs=True,
                       top_logprobs=3)
    tokens, [info] = Sampler()(row(values), [p], [[0, 0, 2]], [None])
    penalised = torch.tensor([2.0 - 2 * 0.5 - 0.25, 1.5, 0.0 - 0.5 - 0.25])
    want = torch.log_softmax(penalised, dim=-1)
    assert tokens == [1]
    assert info.logprob == pytest.approx(want[1].item(), abs=1e-6)
    assert [t for t, _ in info.top] == [1, 0, 2]
    for t, lp in info.top:
        assert lp == pytest.approx(want[t].item(), abs=1e-6)


def test_sampled_token_logprob_is_reported_for_the_token_drawn():
    values = [0.0, 0.5, 1.0, 0.2]
    want = torch.log_softmax(torch.tensor(values), dim=-1)
    gen = torch.Generator().manual_seed(7)
    p = SamplingParams(temperature=1.0, logprobs=True, top_logprobs=2)
    drawn = set()
    for _ in range(100):
        [tok], [info] = Sampler()(row(values), [p], [[]], [gen])
        drawn.add(tok)
        assert info.token_id == tok
        assert info.logprob == pytest.approx(want[tok].item(), abs=1e-6)
        assert [t for t, _ in info.top] == [2, 1]
    assert len(drawn) > 1


# ------------------------------------------------------------ the batched path against a per-row reference


def reference_row(row: torch.Tensor, p: SamplingParams, out: list[int], gen: torch.Generator | None) -> int:
    """One row at a time, written plainly: penalties, temperature, top-k, top-p, then the inverse CDF of
    one uniform draw (the sampler's documented scheme: over the vocabulary in id order, or over the kept
    tokens from the most likely down when top-k or top-p cut the distribution)."""
    row = row.clone()
    for t in set(out):
        row[t] -= p.frequency_penalty * out.count(t) + p.presence_penalty
    if p.greedy:
        return int(row.argmax())
    u = float(torch.rand(1, generator=gen)[0]) if gen is not None else None
    probs = torch.softmax(row / p.temperature, dim=-1)
    truncated = 0 < p.top_k < len(probs) or p.top_p < 1.0
    order = probs.argsort(descending=True, stable=True) if truncated else torch.arange(len(probs))
    kept = probs[order]
    if 0 < p.top_k < len(kept):
        kept[p.top_k:] = 0.0
    kept = kept / kept.sum()
    cum = kept.cumsum(0)
    kept[(cum - kept) >= p.top_p] = 0.0
    cum = kept.cumsum(0)
    pick = int(torch.searchsorted(cum, torch.tensor([u * float(cum[-1])]), right=True)[0])
    return int(order[min(pick, len(kept) - 1)])


def test_batched_sampler_equals_the_per_row_reference():
    """Many rows of mixed params (greedy, seeded temperature / top-k / top-p, penalties) in one call give the
    tokens the plain per-row reference draws with the same seeds."""
    vocab, rows = 300, 48
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, vocab, generator=g) * 3
    kinds = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8),
        SamplingParams(temperature=1.2, top_k=7),
        SamplingParams(temperature=1.0, top_p=0.8),
        SamplingParams(temperature=0.7, top_k=40, top_p=0.9),
        SamplingParams(temperature=1.0, frequency_penalty=0.7, presence_penalty=0.3),
        SamplingParams(temperature=0.0, frequency_penalty=1.5),
        SamplingParams(temperature=1.5, top_p=0.999),
    ]
    params = [kinds[i % len(kinds)] for i in range(rows)]
    outputs = [torch.randint(0, vocab, (i % 5 * 3,), generator=g).tolist() for i in range(rows)]
    for step in range(5):
        seeds = [1000 * step + i for i in range(rows)]
        tokens, _ = Sampler()(logits, params, outputs, [torch.Generator().manual_seed(s) for s in seeds])
        want = [reference_row(logits[i], params[i], outputs[i], torch.Generator().manual_seed(seeds[i]))
                for i in range(rows)]
        assert tokens == want, step
    greedy = [i for i, p in enumerate(params) if p.greedy]
    assert greedy and all(tokens[i] == want[i] for i in greedy)
    assert len({tokens[i] for i in range(rows) if not params[i].greedy}) > 10  # real draws, not all one token


def test_top_p_beyond_the_candidate_window_falls_back_to_the_whole_vocabulary():
    """A flat distribution whose nucleus needs more than the first candidates is sampled over all of it."""
    from engine import sampling

    vocab = sampling.NUCLEUS_CANDIDATES * 3
    logits = torch.zeros(1, vocab)
    p = SamplingParams(temperature=1.0, top_p=0.95)
    seen = {Sampler()(logits, [p], [[]], [torch.Generator().manual_seed(s)])[0][0] for s in range(300)}
    assert max(seen) >= sampling.NUCLEUS_CANDIDATES  # tokens outside the first window are drawn


def test_a_rows_draw_is_the_same_in_any_batch():
    """Rows with their own cuts (top-k over the 1,024 candidates, top-p alone, plain temperature, top-k with
    top-p, a nucleus wider than the candidates, greedy) draw in one batch what each draws alone."""
    torch.manual_seed(0)
    logits = torch.randn(6, 3000) * torch.tensor([[3.0], [3.0], [3.0], [3.0], [0.01], [3.0]])
    params = [SamplingParams(temperature=0.8, top_k=2000, seed=1), SamplingParams(temperature=1.0, top_p=0.9, seed=2),
              SamplingParams(temperature=1.0, seed=3), SamplingParams(temperature=0.7, top_k=20, top_p=0.95, seed=4),
              SamplingParams(temperature=1.0, top_p=0.99, seed=5), SamplingParams(temperature=0.0)]
    def generators(draw: int) -> list[torch.Generator]:
        return [torch.Generator().manual_seed(100 * draw + i) for i in range(6)]

    for draw in range(20):
        together, _ = Sampler()(logits, params, [[]] * 6, generators(draw))
        alone = [Sampler()(logits[i:i + 1], [params[i]], [[]], [generators(draw)[i]])[0][0] for i in range(6)]
        assert together == alone
        assert all(t in logits[0].topk(2000).indices.tolist() for t in together[:1])  # top-k keeps to its k
