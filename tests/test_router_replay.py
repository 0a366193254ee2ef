"""MoE router replay through a packed batch: the experts picked at rollout time route the training pass.

In a mixture-of-experts model every token is sent, in every MoE layer, to the ``k`` experts its router
scores highest. In RL the rollout engine and the trainer compute those scores in different kernels,
batch shapes and precisions, so a near tie can send a token to different experts in the two passes,
and the trainer then scores tokens under a policy that did not sample them. *Router replay* records the
experts each token was routed to during the rollout (``routes [tokens, layers, k]``) and makes the
training forward use exactly those experts; only the routing weights are recomputed from the trainer's
router logits (the softmax probabilities at the replayed experts, renormalised as the model does), so
the router still gets its gradient.

For that the routes must reach the trainer token-aligned: after packing, token ``t`` of the packed row
must carry the routes of that very token. This test builds a tiny ``Qwen2MoeForCausalLM`` (2 MoE layers,
8 experts, top-2, a shared expert), runs each example alone and records the experts its router picks,
collates the examples with their routes as ``TensorField("routes", align="input", dtype=torch.int64, shape=(L, k))``
(padding-free and padded, and ``pack_flat`` rows through the shifted native ``Collator``), and runs the
batch with the collated routes replayed. It shows:

- replaying the routes a model picks itself leaves its logits unchanged (the patched router is the
  model's router, with only the choice of experts taken from outside);
- packed padding-free (``input_ids``/``position_ids [1, N]``, no attention mask) with the replay of
  ``batch["routes"][0]``, every token's logits equal that example's logits alone (float32 and float64);
- padded (right padding, ``attention_mask``), with the replay of ``batch["routes"]`` flattened to
  tokens, every real token's logits equal the example's alone (the padding routes to the fill's
  expert, twice; no real token attends to it);
- ``pack_flat`` rows collated by the native ``Collator`` (shifted: ``input_ids`` are the row but its last
  token) with routes declared ``align="input"``: every real token's logits equal its example's alone;
  declared ``"token"`` the routes go with the labels, one token ahead of the inputs, and the logits move;
- routes that are off by one token, rolled between examples or given for the wrong layer change the
  logits far beyond the tolerance: the comparisons can fail.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

from zephon_collate import Collator, TensorField, pack_flat

torch.set_num_threads(1)

LAYERS, EXPERTS, TOP_K, VOCAB = 2, 8, 2, 128
ROUTES = TensorField("routes", align="input", dtype=torch.int64, shape=(LAYERS, TOP_K))
TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-12}
MISALIGNED = 1e-2  # a wrong route moves some logit by more than this (measured: 0.6 and more)


@functools.cache
def tiny_moe(dtype: torch.dtype, norm_topk_prob: bool) -> Qwen2MoeForCausalLM:
    """A seeded 2-layer Qwen2-MoE in ``dtype``, eval mode: every layer an MoE block with a shared expert.

    ``initializer_range=0.1`` (not 0.02) gives logits of a few units and a router whose choice of experts
    moves them well beyond the tolerances (a wrong route: at least 0.6 here, against 0.01 at 0.02).
    ``experts_implementation="eager"``: the per-expert loop of ``Qwen2MoeExperts``; the default
    ``grouped_mm`` refuses float64 (and is slower on the CPU).
    """
    config = Qwen2MoeConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=4,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        norm_topk_prob=norm_topk_prob,
        max_position_embeddings=256,
        initializer_range=0.1,
        attn_implementation="sdpa",
        experts_implementation="eager",
    )
    torch.manual_seed(0)
    model = Qwen2MoeForCausalLM(config).to(dtype).eval()
    assert all(hasattr(layer.mlp, "gate") for layer in model.model.layers), "every layer is an MoE block"
    return model


def _gates(model: Qwen2MoeForCausalLM) -> list[torch.nn.Module]:
    return [layer.mlp.gate for layer in model.model.layers]


@contextmanager
def router_replay(model: Qwen2MoeForCausalLM, routes: torch.Tensor) -> Iterator[None]:
    """Route every token through the experts ``routes [tokens, layers, k]`` names, not the router's top-k.

    Each layer's ``Qwen2MoeTopKRouter.forward`` is replaced (on the instance) by the model's own
    computation with the choice of experts taken from ``routes[:, layer]``: the router logits
    ``hidden @ weight.T``, their softmax (in float32, as the model does), the probabilities gathered at
    the replayed experts, renormalised over the ``k`` of them when ``norm_topk_prob``, in the logits'
    dtype. The sparse MoE block flattens ``[batch, seq]`` to tokens row by row, so ``routes`` is indexed
    in that order.
    """
    originals = {}

    def replayed(gate: torch.nn.Module, layer: int, hidden_states: torch.Tensor):
        hidden_states = hidden_states.reshape(-1, gate.hidden_dim)
        if routes.shape != (hidden_states.shape[0], LAYERS, gate.top_k):
            raise ValueError(f"routes {tuple(routes.shape)} for {hidden_states.shape[0]} tokens")
        router_logits = F.linear(hidden_states, gate.weight)
        router_probs = F.softmax(router_logits, dtype=torch.float, dim=-1)
        indices = routes[:, layer].to(device=router_logits.device, dtype=torch.long)
        weights = router_probs.gather(-1, indices)
        if gate.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return router_logits, weights.to(router_logits.dtype), indices

    for layer, gate in enumerate(_gates(model)):
        originals[layer] = gate.__dict__.get("forward")
        gate.forward = functools.partial(replayed, gate, layer)
    try:
        yield
    finally:
        for layer, gate in enumerate(_gates(model)):
            del gate.forward
            if originals[layer] is not None:
                gate.forward = originals[layer]


@contextmanager
def recorded_routes(model: Qwen2MoeForCausalLM) -> Iterator[list[torch.Tensor]]:
    """The experts each layer's router picks, ``[tokens, k]`` per layer (a forward hook on each router)."""
    picked: list[torch.Tensor] = [torch.empty(0)] * LAYERS

    def hook(layer: int, _module, _args, output) -> None:
        picked[layer] = output[2].detach().clone()

    handles = [gate.register_forward_hook(functools.partial(hook, i)) for i, gate in enumerate(_gates(model))]
    try:
        yield picked
    finally:
        for handle in handles:
            handle.remove()


def make_examples(seed: int, count: int) -> list[torch.Tensor]:
    """``count`` random token rows of 5 to 40 tokens (ids 1..127: 0 is the padding id)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, 41, (count,), generator=generator).tolist()
    return [torch.randint(1, VOCAB, (n,), generator=generator) for n in lengths]


def alone(model: Qwen2MoeForCausalLM, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One example run by itself, no replay: its logits ``[n, V]`` and the routes it picked ``[n, L, k]``."""
    with torch.no_grad(), recorded_routes(model) as picked:
        logits = model(input_ids=ids[None], use_cache=False).logits[0]
    return logits, torch.stack(picked, dim=1)


def payloads(rows: Sequence[torch.Tensor], routes: Sequence[torch.Tensor]) -> list[dict]:
    return [{"input_ids": ids.tolist(), "routes": r.tolist()} for ids, r in zip(rows, routes, strict=True)]


def packed_logits(model: Qwen2MoeForCausalLM, batch: dict, routes: torch.Tensor | None) -> torch.Tensor:
    """The padding-free batch run as one row, with ``routes [N, L, k]`` replayed (None: the router's)."""
    with torch.no_grad():
        if routes is None:
            out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)
        else:
            with router_replay(model, routes):
                out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)
    return out.logits[0]


CASES = [(seed, 3 + seed % 3) for seed in range(3)]  # 3, 4 and 5 examples


@pytest.mark.parametrize("norm_topk_prob", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_replay_of_own_routes_is_the_model(dtype: torch.dtype, norm_topk_prob: bool) -> None:
    """The patched router, given the experts the model picks, computes what the model computes."""
    model = tiny_moe(dtype, norm_topk_prob)
    for ids in make_examples(7, 4):
        logits, routes = alone(model, ids)
        with torch.no_grad(), router_replay(model, routes):
            replayed = model(input_ids=ids[None], use_cache=False).logits[0]
        torch.testing.assert_close(replayed, logits, rtol=0, atol=0)
        # the replay does decide the experts: other routes give other logits
        with torch.no_grad(), router_replay(model, (routes + 1) % EXPERTS):
            other = model(input_ids=ids[None], use_cache=False).logits[0]
        assert (other - logits).abs().max() > MISALIGNED
    assert "forward" not in _gates(model)[0].__dict__, "the patch is undone"


@pytest.mark.parametrize("norm_topk_prob", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("seed", "count"), CASES)
def test_packed_replay_equals_each_example_alone(
    seed: int, count: int, dtype: torch.dtype, norm_topk_prob: bool
) -> None:
    model = tiny_moe(dtype, norm_topk_prob)
    rows = make_examples(seed, count)
    runs = [alone(model, ids) for ids in rows]
    routes_alone = [routes for _, routes in runs]
    batch = Collator.for_transformers(padding_free=True, float_fields=[ROUTES])(payloads(rows, routes_alone))

    n = sum(len(ids) for ids in rows)
    assert batch["input_ids"].shape == (1, n) and batch["position_ids"].shape == (1, n)
    assert batch["routes"].shape == (1, n, LAYERS, TOP_K) and batch["routes"].dtype == torch.int64
    assert torch.equal(batch["input_ids"][0], torch.cat(rows))
    assert torch.equal(batch["routes"][0], torch.cat(routes_alone)), "the routes are token-aligned"

    expected = torch.cat([logits for logits, _ in runs])
    got = packed_logits(model, batch, batch["routes"][0])
    difference = (got - expected).abs().max().item()
    print(f"packed {dtype} norm_topk_prob={norm_topk_prob} seed={seed}: max |diff| {difference:.3g}")
    assert difference <= TOLERANCE[dtype]

    # misaligned replays: off by one token, rolled between examples, the layers swapped
    routes = batch["routes"][0]
    wrong = {
        "shifted one token": routes.roll(1, dims=0),
        "rolled between examples": torch.cat(routes_alone[1:] + routes_alone[:1]),
        "layers swapped": routes.flip(1),
    }
    for what, misaligned in wrong.items():
        assert not torch.equal(misaligned, routes), what
        moved = (packed_logits(model, batch, misaligned) - expected).abs().max().item()
        print(f"  {what}: moved {moved:.3g}")
        assert moved > MISALIGNED, f"{what}: the logits moved only {moved:.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("seed", "count"), CASES)
def test_padded_replay_equals_each_example_alone(seed: int, count: int, dtype: torch.dtype) -> None:
    model = tiny_moe(dtype, False)
    rows = make_examples(100 + seed, count)
    runs = [alone(model, ids) for ids in rows]
    routes_alone = [routes for _, routes in runs]
    spec = TensorField("routes", align="input", dtype=torch.int64, shape=(LAYERS, TOP_K), fill=0)
    batch = Collator.for_transformers(pad_token_id=0, float_fields=[spec])(payloads(rows, routes_alone))

    width = max(len(ids) for ids in rows)
    assert batch["routes"].shape == (count, width, LAYERS, TOP_K)
    mask = batch["attention_mask"].bool()
    assert torch.equal(batch["routes"][mask], torch.cat(routes_alone))
    assert (batch["routes"][~mask] == 0).all(), "the padding holds the fill"

    with torch.no_grad(), router_replay(model, batch["routes"].reshape(-1, LAYERS, TOP_K)):
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
    difference = max(
        (out.logits[b, : len(ids)] - runs[b][0]).abs().max().item() for b, ids in enumerate(rows)
    )
    print(f"padded {dtype} seed={seed}: max |diff| {difference:.3g}")
    assert difference <= TOLERANCE[dtype]

    shifted = batch["routes"].roll(1, dims=1).reshape(-1, LAYERS, TOP_K)
    with torch.no_grad(), router_replay(model, shifted):
        moved = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
    change = ((moved.logits - out.logits).abs() * mask[..., None]).max().item()
    print(f"  shifted one token: moved {change:.3g}")
    assert change > MISALIGNED


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("seed", "count"), CASES)
def test_packed_rows_replay_through_the_shifted_collator(seed: int, count: int, dtype: torch.dtype) -> None:
    """Routes read by the model at each input token stay beside ``input_ids`` when the tokens are shifted."""
    model = tiny_moe(dtype, False)
    rows = make_examples(200 + seed, count)
    runs = [alone(model, ids) for ids in rows]
    routes_alone = torch.cat([routes for _, routes in runs])
    n = sum(len(ids) for ids in rows)
    packed = pack_flat(
        payloads(rows, [routes for _, routes in runs]), seq_len=n + 3, pad_token_id=0, float_fields=[ROUTES]
    )
    assert len(packed) == 1, "one row: every example and 3 tokens of padding"
    batch = Collator(return_labels=True, float_fields=[ROUTES])(packed)
    assert batch["input_ids"].shape == (1, n + 2), "the row but its last token"
    assert torch.equal(batch["input_ids"][0, :n], torch.cat(rows))
    assert torch.equal(batch["routes"][0, :n], routes_alone), "each token's own routes, beside it"

    def replayed(routes: torch.Tensor) -> torch.Tensor:
        with torch.no_grad(), router_replay(model, routes):
            out = model(input_ids=batch["input_ids"], position_ids=batch["positions"], use_cache=False)
        return out.logits[0, :n]

    expected = torch.cat([logits for logits, _ in runs])
    difference = (replayed(batch["routes"][0]) - expected).abs().max().item()
    print(f"native shifted {dtype} seed={seed}: max |diff| {difference:.3g}")
    assert difference <= TOLERANCE[dtype]

    # declared "token", a field goes with the labels: position t holds token t + 1's routes
    as_token = TensorField("routes", dtype=torch.int64, shape=(LAYERS, TOP_K))
    token_batch = Collator(return_labels=True, float_fields=[as_token])(
        pack_flat(
            payloads(rows, [routes for _, routes in runs]),
            seq_len=n + 3,
            pad_token_id=0,
            float_fields=[as_token],
        )
    )
    assert torch.equal(token_batch["routes"][0, : n - 1], routes_alone[1:])
    moved = (replayed(token_batch["routes"][0]) - expected).abs().max().item()
    assert moved > MISALIGNED, f"routes one token ahead moved the logits only {moved:.3g}"
