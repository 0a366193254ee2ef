"""The loss library against the real verl (0.9.1), both fed the same numbers, float64, values and gradients.

verl's ``agg_loss`` (every mode; its trainer's global batch info, and alone), ``kl_penalty`` (every name),
``compute_policy_loss_vanilla`` / ``_gspo``, its trainer's whole ``ppo_loss`` over 2 ranks x 2 micro-batches,
and a tiny Llama's log-probs both ways verl computes them. Rows are verl's (prompt left padded, response right
padded, per-token fields ``[batch, response_length]``), read with ``FloatField(name, align="response")``.
"""

from __future__ import annotations

import random
from functools import partial

import pytest
import torch
import verl_apart  # noqa: F401  (verl on the path, where make test installs it)
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("verl.trainer.ppo.core_algos")

import verl.trainer.ppo.core_algos as ca
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu
from verl.utils.model import compute_position_id_with_mask
from verl.utils.torch_functional import logprobs_from_logits
from verl.workers.config import ActorConfig
from verl.workers.utils.losses import ppo_loss
from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

from zephon_collate import Collator, FloatField, aggregate_loss, global_loss_count, token_logprobs
from zephon_collate.losses import MODES, clipped_policy_loss, importance_ratio, kl_penalty

D = torch.float64
close = partial(torch.testing.assert_close, rtol=0, atol=1e-12)
pick = st.sampled_from
P, R = 4, 6  # verl's prompt and response widths
FIELDS = ("old_log_probs", "ref_log_prob", "advantages", "loss", "grad")
LAYOUTS = {
    "padded": {"pad_token_id": 0},
    "padding-free": {"padding_free": True},
    "padded-shared": {"pad_token_id": 0, "shared_prompt": True},
    "padding-free-shared-pad8": {"padding_free": True, "shared_prompt": True, "pad_token_id": 0, "pad_to_multiple_of": 8},
}  # fmt: skip


def actor(**overrides) -> ActorConfig:
    return ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, **overrides)


def verl_rows(rng: random.Random, n: int) -> dict[str, torch.Tensor]:
    """A micro-batch as verl keeps it: two prompts (a shared prompt lays each out once), holes in the
    response mask, sometimes a row masked out whole; per-token fields hold 9.0 under the padding."""
    shared = [[rng.randint(1, 31) for _ in range(rng.randint(1, P))] for _ in range(2)]
    prompts = [rng.choice(shared) for _ in range(n)]
    lengths = [rng.randint(1, R) for _ in range(n)]
    out = {
        "prompts": torch.tensor([[0] * (P - len(p)) + p for p in prompts]),
        "responses": torch.tensor([[rng.randint(1, 31) for _ in range(k)] + [0] * (R - k) for k in lengths]),
        "attention_mask": torch.tensor([[0] * (P - len(p)) + [1] * (len(p) + k) + [0] * (R - k) for p, k in zip(prompts, lengths, strict=True)]),
        "response_mask": torch.tensor([[int(rng.random() < 0.85) for _ in range(k)] + [0] * (R - k) for k in lengths]),
    }  # fmt: skip
    if rng.random() < 0.5:
        out["response_mask"][rng.randrange(n)] = 0  # truncated, masked out
    out["input_ids"] = torch.cat([out["prompts"], out["responses"]], 1)
    inside = out["attention_mask"][:, P:].bool()
    for name, low, high in (("old_log_probs", -3, 0), ("ref_log_prob", -3, 0), ("loss", -2, 3)):
        values = torch.tensor([[rng.uniform(low, high) for _ in range(R)] for _ in range(n)], dtype=D)
        out[name] = torch.where(inside, values, 9.0)
    out["advantages"] = torch.tensor([[rng.gauss(0, 1)] * R for _ in range(n)], dtype=D)  # GRPO's
    return out


def ours(rows: dict[str, torch.Tensor], layout: dict) -> dict:
    fields = [FloatField(name, align="response", dtype=D) for name in FIELDS if name in rows]
    given_rows = {k: v for k, v in rows.items() if k not in ("prompts", "responses")}
    return Collator.for_rollouts(**layout, float_fields=fields)(given_rows)


def step(seed: int) -> list[dict[str, torch.Tensor]]:
    """2 ranks x 2 micro-batches (rank-major), uneven row counts."""
    rng = random.Random(seed)
    return [verl_rows(rng, rng.randint(1, 4)) for _ in range(4)]


def trainer_info(micro: list[dict[str, torch.Tensor]]) -> dict[str, int]:
    """What verl's trainer passes ``agg_loss`` over 2 ranks: the mini-batch's tokens (all-reduced), rows."""
    tokens = sum(int(m["response_mask"].sum()) for m in micro)
    return {"dp_size": 2, "batch_num_tokens": tokens, "global_batch_size": sum(len(m["input_ids"]) for m in micro)}  # fmt: skip


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 9999), pick(sorted(LAYOUTS)), pick(MODES), st.booleans())
def test_aggregate_loss_is_verls_agg_loss(seed, layout, mode, trainer):
    """Per micro-batch, value and gradient. ``trainer``: verl's trainer (2 ranks, ``batch_num_tokens`` and
    ``global_batch_size`` of the mini-batch, a ``loss_scale_factor``) against ``global_count=
    global_loss_count(..., empty="count")``; else ``agg_loss`` alone (one rank, nothing global) against
    ``mode=m`` (verl alone divides ``"seq-mean-token-sum-norm"`` by the response width)."""
    micro = step(seed) if trainer else step(seed)[:1]
    extra = {**trainer_info(micro), "loss_scale_factor": 5} if trainer else {}
    wants = []
    for rows in micro:
        loss = rows["loss"].clone().requires_grad_()
        wants.append(ca.agg_loss(loss, rows["response_mask"].bool(), mode, **extra))
        (rows["grad"],) = torch.autograd.grad(wants[-1], loss)
    batches = [ours(rows, LAYOUTS[layout]) for rows in micro]
    count = None
    if trainer and mode != "token-sum":
        count = global_loss_count(batches, mode=mode, empty="count")
    for rows, batch, want in zip(micro, batches, wants, strict=True):
        per_token = batch["loss"].clone().requires_grad_()
        norm, world = (5, 2) if trainer else (R, None)
        got = aggregate_loss(
            per_token, batch, mode=mode, global_count=count, normalizer=norm, world_size=world
        )
        if not trainer and mode != "token-sum" and not rows["response_mask"].any():
            assert want.isnan() and got == 0  # verl alone divides 0 by 0 where nothing is trained
            continue
        close(got, want)
        (grad,) = torch.autograd.grad(got, per_token)
        close(grad, batch["grad"])  # 0 on the prompt and padding
        assert grad.abs().sum() > 0 or rows["response_mask"].sum() == 0


NAMES = ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "kl+", "k1+", "abs+", "mse+", "k2+", "low_var_kl+", "k3+"]  # fmt: skip


@pytest.mark.parametrize("name", NAMES)
def test_kl_penalty_is_verls_with_clamp(name):
    """Every name verl's ``kl_penalty`` takes, log ratios from -60 to 60 (past verl's clamps of k3: the log
    ratio to +-20, the estimate to +-10), values and gradients; without ``clamp`` the same inside them."""
    diff = torch.tensor([-60.0, -21, -20, -10, -2.4, -0.3, 0, 0.7, 2, 12, 19.9, 20, 20.5, 60], dtype=D)
    ref = torch.linspace(-5, 0, len(diff), dtype=D)
    want_in = (diff + ref).requires_grad_()
    want = ca.kl_penalty(want_in, ref, name)
    got_in = (diff + ref).requires_grad_()
    got = kl_penalty(got_in, ref, name, clamp=True)
    close(got, want)
    close(*torch.autograd.grad(got.sum(), got_in), *torch.autograd.grad(want.sum(), want_in))
    inside = diff.abs() < 2.2  # k3 < 10 there
    close(kl_penalty(diff + ref, ref, name)[inside], want.detach()[inside])
    if name.rstrip("+") in ("low_var_kl", "k3"):
        assert want[0] == want[-1] == 10  # the clamps were reached


@settings(max_examples=40, deadline=None)
@given(
    st.integers(0, 9999), pick([None, 0.1, 0.2]), pick([None, 0.28]), pick([1.5, 3, 10]), pick([0.05, 1, 6])
)
def test_clipped_policy_loss_is_verls_vanilla(seed, low, high, dual, spread):
    """Per token (the gradient in ``rollout_is_weights`` of a token sum is the token's loss) and the
    gradient in the log-probs, log ratios inside verl's +-20; ``clip_ratio_low/high`` of None fall back to
    ``clip_ratio``."""
    g = torch.Generator().manual_seed(seed)
    old = -3 * torch.rand(5, R, generator=g, dtype=D)
    logps = old + (spread * torch.randn(5, R, generator=g, dtype=D)).clamp(-19.5, 19.5)
    advantages = torch.randn(5, R, generator=g, dtype=D)
    mask = torch.rand(5, R, generator=g) < 0.8
    config = actor(clip_ratio=0.15, clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=dual)
    verl_in, weights = logps.clone().requires_grad_(), torch.ones(5, R, dtype=D, requires_grad=True)
    want, _ = ca.compute_policy_loss_vanilla(old, verl_in, advantages, mask, "token-sum", config, weights)
    want_token, want_grad = torch.autograd.grad(want, (weights, verl_in))
    got_in = logps.clone().requires_grad_()
    clip = 0.15 if low is None else low
    per_token = clipped_policy_loss(
        importance_ratio(got_in, old, {}), advantages, clip=clip, clip_high=high or 0.15, dual_clip=dual
    )
    close(torch.where(mask, per_token, 0), want_token, rtol=1e-12, atol=1e-12)
    (got_grad,) = torch.autograd.grad((per_token * mask).sum(), got_in)
    close(got_grad, want_grad, rtol=1e-12, atol=1e-12)
    assert (want_token * mask != 0).any()


def test_gspo_gradient_is_verls_only_with_one_advantage_per_sequence():
    """verl's GSPO is GSPO-token (``sg[s_i] * pi_t / sg[pi_t]``): its gradient in token t's log-prob is
    ``-A_t s_i``; ``importance_ratio(level="sequence")`` (TRL's GSPO) spreads ``-mean(A) s_i`` over the
    sequence. One response, two tokens, ratio 1, advantages [1, -1]: same value, gradients [-1, 1] vs [0, 0]."""
    batch = Collator.for_rollouts(padding_free=True)([{"input_ids": [1, 2, 3], "completion_mask": [0, 1, 1]}])
    advantages = torch.tensor([[0.0, 1.0, -1.0]], dtype=D)
    logps = torch.zeros(1, 3, dtype=D, requires_grad=True)
    got = clipped_policy_loss(importance_ratio(logps, logps.detach(), batch, level="sequence"), advantages)
    verl_in = torch.zeros(1, 2, dtype=D, requires_grad=True)
    mask = torch.ones(1, 2, dtype=torch.bool)
    want, _ = ca.compute_policy_loss_gspo(
        verl_in.detach(), verl_in, advantages[:, 1:], mask, "token-sum", actor()
    )
    assert got[:, 1:].sum().item() == want.item() == 0.0
    assert torch.autograd.grad(got[:, 1:].sum(), logps)[0].tolist() == [[0.0, 0.0, 0.0]]
    assert torch.autograd.grad(want, verl_in)[0].tolist() == [[-1.0, 1.0]]


PPO_CASES = [  # loss_scale_factor None: verl divides by the response width
    ("vanilla", "token-mean", "low_var_kl", None), ("vanilla", "seq-mean-token-mean", "k3+", None),
    ("vanilla", "seq-mean-token-sum-norm", "abs", None), ("vanilla", "token-sum", "mse", None),
    ("gspo", "seq-mean-token-mean", "low_var_kl", None), ("gspo", "seq-mean-token-sum", "k1", None),
    ("gspo", "seq-mean-token-sum-norm", "low_var_kl+", 7),
]  # fmt: skip


@pytest.mark.parametrize(("loss_mode", "mode", "kl", "scale"), PPO_CASES)
def test_ppo_loss_of_verls_trainer(loss_mode, mode, kl, scale):
    """verl's trainer loss (policy loss + KL loss, each aggregated with the global batch info) on each of
    2 ranks x 2 micro-batches, against the docs' sketch on the packed batch: the clipped surrogate plus the
    KL per token, aggregated once. Both take the same leaf: verl's packed log-probs (token j+1's at j)."""
    micro = step(len(mode) + len(kl))
    config = actor(
        clip_ratio_low=0.2, clip_ratio_high=0.28, loss_agg_mode=mode, loss_scale_factor=scale, use_kl_loss=True,
        kl_loss_type=kl, kl_loss_coef=0.1, policy_loss={"loss_mode": loss_mode},
    )  # fmt: skip
    batches = [ours(rows, LAYOUTS["padding-free"]) for rows in micro]
    count = None if mode == "token-sum" else global_loss_count(batches, mode=mode, empty="count")
    g = torch.Generator().manual_seed(1)
    for rows, batch in zip(micro, batches, strict=True):
        noise = 0.3 * torch.randn(batch["input_ids"].shape, generator=g, dtype=D)
        logps = (batch["old_log_probs"] + noise).requires_grad_()
        data = TensorDict(dict(rows), batch_size=[len(rows["input_ids"])])
        tu.assign_non_tensor(data, **trainer_info(micro))
        want, _ = ppo_loss(config, {"log_probs": torch.roll(logps[0], -1)}, data)
        level = "token" if loss_mode == "vanilla" else "sequence"
        ratio = importance_ratio(logps, batch["old_log_probs"], batch, level=level)
        dual = 3.0 if level == "token" else None  # verl's GSPO does not dual-clip
        per_token = clipped_policy_loss(ratio, batch["advantages"], clip=0.2, clip_high=0.28, dual_clip=dual)
        per_token = per_token + 0.1 * kl_penalty(logps, batch["ref_log_prob"], kl, clamp=True)
        got = aggregate_loss(
            per_token, batch, mode=mode, global_count=count, normalizer=scale or R, world_size=2
        )
        close(got, want)
        got_grad, want_grad = (torch.autograd.grad(loss, logps)[0] for loss in (got, want))
        close(got_grad, want_grad)
        assert want_grad.abs().sum() > 0 or rows["response_mask"].sum() == 0


def test_verl_log_probs_meet_token_logprobs():
    """A tiny Llama's response log-probs, verl's two ways: the padded batch (positions from
    ``compute_position_id_with_mask``, ``logprobs_from_logits`` on ``logits[:, -R - 1:-1]``) and the packed
    one (``left_right_2_no_padding``, labels rolled, ``no_padding_2_padding``): equal to each other and to
    ``token_logprobs`` on ``for_rollouts``' packed batch at every trained token."""
    transformers = pytest.importorskip("transformers")
    transformers.utils.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).double().eval()
    rows = verl_rows(random.Random(3), 5)
    with torch.no_grad():
        position_ids = compute_position_id_with_mask(rows["attention_mask"])
        logits = model(
            rows["input_ids"], attention_mask=rows["attention_mask"], position_ids=position_ids
        ).logits
        padded_way = logprobs_from_logits(logits[:, -R - 1 : -1], rows["responses"])
        data = TensorDict({**rows, "position_ids": position_ids}, batch_size=[5])
        data = left_right_2_no_padding(data)
        flat, flat_positions = data["input_ids"].values()[None], data["position_ids"].values()[None]
        flat_logits = model(flat, position_ids=flat_positions, use_cache=False).logits[0]
        packed_way = no_padding_2_padding(logprobs_from_logits(flat_logits, torch.roll(flat[0], -1)), data)
        inside = rows["attention_mask"][:, P:].bool()
        close(packed_way[inside], padded_way[inside])
        batch = ours({**rows, "old_log_probs": packed_way}, LAYOUTS["padding-free"])
        new = token_logprobs(
            model(batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits, batch
        )
    trained = batch["labels"] != -100
    assert int(trained.sum()) == int(rows["response_mask"].sum())
    close(new[trained], batch["old_log_probs"][trained])
    assert torch.equal(batch["old_log_probs"][trained], packed_way[rows["response_mask"].bool()])
