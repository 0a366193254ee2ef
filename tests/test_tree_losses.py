"""The loss helpers on a tree batch equal the same losses over the paths run separately.

A tree batch (``Collator.for_trees``) holds every shared prefix once; the helpers read its *entries*, every
token of every path. A tiny Llama (float64 and float32; its RMSNorm kept in the weights' dtype) runs the
tree with ``use_tree_attention`` (and with SDPA given ``dense_tree_mask`` as its 4-D mask) and each path
alone (its tokens as the examples give them, plain causal SDPA). Every helper's result on the tree
(``token_logprobs``, ``sequence_logprobs``, ``aggregate_loss`` in every verl mode with both ``empty=``
choices, TRL's grpo / bnpo / dr_grpo / dapo, PPO with dual clipping, GSPO's sequence ratio, every KL
estimator, ``sequence_means`` and the DPO family) equals a plain-torch reference over the paths, values
and gradients w.r.t. the model's parameters: float64 to 1e-10, float32 to 1e-5 (the largest difference,
relative to the largest value where it is above 1). Trees of depth 1 to 5 (branchings on a path): GRPO
groups, agentic trajectories branching mid-conversation (trained answers shared by several paths between
untrained tool spans), the same as lists of turns, explicit trees (``node_id``, ``parent_id``), a sequence
that is a prefix of another, identical sequences, ``copy_openers``, ``share="none"`` and ``"batch"``,
padded, padding-free and ``pad_to_multiple_of``; micro-batches of a tree with verl's step count and TRL's
``accumulation_steps``. A hypothesis property over random trees of any depth (no model) checks
``aggregate_loss`` of per-entry and per-token losses in every mode x ``empty`` x one batch, two
micro-batches with ``global_loss_count`` and with ``accumulation_steps``.
"""

from __future__ import annotations

import functools
import itertools
import random
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zephon_collate import Collator, FloatField
from zephon_collate.functional.trees import TreeBlocks, dense_tree_mask, use_tree_attention
from zephon_collate.losses import (
    EMPTY,
    KL_ESTIMATORS,
    MODES,
    PREFERENCE_LOSSES,
    aggregate_loss,
    along_paths,
    clipped_policy_loss,
    global_loss_count,
    importance_ratio,
    kl_penalty,
    preference_loss,
    sequence_logprobs,
    sequence_means,
    token_logprobs,
    unpack,
)

transformers = pytest.importorskip("transformers")

VOCAB = 32
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}
NORMALIZER = 16.0  # Dr. GRPO's constant (TRL's max_completion_length, verl's loss_scale_factor)
KL_BETA, DPO_BETA, SMOOTHING = 0.04, 0.1, 0.1
FIELDS = ["old", FloatField("adv", "sequence")]  # old log-probs per token, one advantage per sequence
MEASURED: dict[str, float] = {}  # the largest difference seen per dtype and kind (for the record)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny tensors: threads only contend (the CPU is shared); restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --- the data: trajectories, turns, explicit trees; each sequence's path as the examples give it --------


@dataclass
class Case:
    examples: list[dict[str, Any]]
    paths: list[tuple[list[int], list[bool]]]  # each sequence's tokens and trained flags, in order
    advantages: list[float]
    options: dict[str, Any] = field(default_factory=dict)

    def supervised(self, index: int) -> list[bool]:
        """What a path alone supervises: its trained tokens but the first (nothing predicts it)."""
        return [flag and t > 0 for t, flag in enumerate(self.paths[index][1])]


def old_logprob(tokens: list[int], trained: list[bool], t: int) -> float:
    """A behaviour log-prob for token ``t``, a function of its prefix (so that a shared token has one),
    exact in float32."""
    return -random.Random(repr((tokens[: t + 1], trained[: t + 1]))).randint(16, 320) / 64


def advantage(rng: random.Random) -> float:
    return rng.choice([-1, 1]) * rng.randint(1, 16) / 8


def trajectories(
    rows: list[list[tuple[list[int], bool]]],
    groups: list[int] | None = None,
    *,
    turns: bool = False,
    seed: int = 0,
    **options: Any,
) -> Case:
    """Trajectories given as spans (tokens, trained): flat examples, or lists of turns (``turns``: one
    turn per span, ``completion_mask`` one value per turn, ``old`` one list per turn)."""
    rng = random.Random(seed)
    examples, paths, advantages = [], [], []
    for index, spans in enumerate(rows):
        tokens = [t for part, _ in spans for t in part]
        trained = [flag for part, flag in spans for _ in part]
        old = [old_logprob(tokens, trained, t) for t in range(len(tokens))]
        example: dict[str, Any] = {"adv": advantage(rng)}
        if turns:
            starts = [0]
            for part, _ in spans:
                starts.append(starts[-1] + len(part))
            example["input_ids"] = [list(part) for part, _ in spans]
            example["completion_mask"] = [int(flag) for _, flag in spans]
            example["old"] = [old[a:b] for a, b in itertools.pairwise(starts)]
        else:
            example.update(input_ids=tokens, completion_mask=[int(f) for f in trained], old=old)
        if groups is not None:
            example["group"] = groups[index]
        examples.append(example)
        paths.append((tokens, trained))
        advantages.append(example["adv"])
    return Case(examples, paths, advantages, options)


def explicit(nodes: list[tuple[int, int, list[int], list[int]]], seed: int = 0, **options: Any) -> Case:
    """An explicit tree, node by node (``node_id``, ``parent_id``, tokens, trained); each leaf a sequence,
    in the order given, its path the nodes from its root."""
    rng = random.Random(seed)
    by_id = {node: (parent, tokens, mask) for node, parent, tokens, mask in nodes}

    def path(node: int) -> tuple[list[int], list[bool]]:
        parent, tokens, mask = by_id[node]
        head = path(parent) if parent >= 0 else ([], [])
        return head[0] + tokens, head[1] + [bool(m) for m in mask]

    parents = {parent for _, parent, _, _ in nodes}
    examples, paths, advantages = [], [], []
    for node, parent, tokens, mask in nodes:
        full, trained = path(node)
        start = len(full) - len(tokens)
        old = [old_logprob(full, trained, t) for t in range(start, len(full))]
        examples.append(
            {"node_id": node, "parent_id": parent, "input_ids": tokens, "completion_mask": mask, "old": old}
        )
        if node not in parents:  # a leaf: a sequence, with its advantage (on inner nodes it is refused)
            examples[-1]["adv"] = advantage(rng)
            paths.append((full, trained))
            advantages.append(examples[-1]["adv"])
    return Case(examples, paths, advantages, options)


PROMPT, ANSWER, TOOL = ([3, 4, 5, 6], False), ([7, 8, 9], True), ([10, 11], False)
AGENTIC = [  # an agent's rollouts of one task: they branch mid-conversation, at every kind of span
    [PROMPT, ANSWER, TOOL, ([12, 13], True), ([14], False), ([15, 16], True)],  # 0
    [PROMPT, ANSWER, TOOL, ([12, 13], True), ([17, 18], False), ([19], True)],  # 1: at the second tool
    [PROMPT, ANSWER, TOOL, ([20, 21, 22], True)],  # 2: at the second answer
    [PROMPT, ANSWER, ([23], False), ([24, 25], True)],  # 3: at the first tool's output
    [PROMPT, ([26, 27], True)],  # 4: at the first answer
    [PROMPT, ANSWER, TOOL, ([12, 13], True), ([14], False), ([15, 16], True)],  # 5: 0 again
    [PROMPT, ANSWER, TOOL, ([12, 13], True)],  # 6: a prefix of 0 and 1, ending where they branch
    [PROMPT, ANSWER, TOOL, ([12, 13], True), ([14], False), ([15, 30, 31], True)],  # 7: inside 0's last
]
GRPO = [  # two prompts, completions branching at their first token (depth 1); one truncated (all masked)
    [([3, 4, 5], False), ([6, 7, 8], True)],
    [([3, 4, 5], False), ([9], True)],
    [([3, 4, 5], False), ([10, 11, 12, 13], True)],
    [([3, 4, 5], False), ([14, 15], False)],
    [([3, 4, 16], False), ([17, 18], True)],
    [([3, 4, 16], False), ([19, 20, 21], True)],
]
PREFIXES = [  # depth 2: a sequence that is a prefix of another, one ending at the prompt, twins
    [([3, 4], False), ([5, 6, 7], True)],
    [([3, 4], False), ([5, 6], True)],
    [([3, 4], False)],
    [([3, 4], False), ([5, 6, 7], True)],
    [([3, 4], False), ([5, 8, 9], True), ([10], False)],
    [([3, 4], False), ([5, 6, 7], True), ([3], True)],
    [([3, 4], False), ([5, 6, 11], True)],
]
NODES = [  # two trees given node by node, listed out of order: depth 3 and a single node
    (104, 101, [11], [1]),
    (100, -1, [3, 4, 5], [0, 0, 0]),
    (101, 100, [6, 7], [1, 1]),
    (102, 101, [8], [0]),
    (103, 102, [9, 10], [1, 1]),
    (108, 102, [12, 9], [1, 0]),
    (105, 100, [13, 14, 15], [1, 0, 1]),
    (106, -1, [16, 17], [0, 1]),
    (107, 100, [6], [1]),
]
PADDED = {"padding_free": False, "pad_token_id": 0}
CASES = {
    "grpo-groups": trajectories(GRPO, [0, 0, 0, 0, 1, 1]),
    "grpo-share-batch": trajectories(GRPO, [0, 0, 0, 0, 1, 1], share="batch"),
    "agentic": trajectories(AGENTIC),
    "agentic-turns": trajectories(AGENTIC, turns=True),
    "agentic-copy-openers": trajectories(AGENTIC, copy_openers=True),
    "agentic-share-none": trajectories(AGENTIC, share="none"),
    "agentic-padded": trajectories(AGENTIC, [0, 0, 0, 1, 1, 1, 0, 0], **PADDED),
    "agentic-pad-to-multiple": trajectories(AGENTIC, pad_token_id=0, pad_to_multiple_of=16),
    "agentic-padded-multiple-copy": trajectories(
        AGENTIC, [0, 1, 0, 1, 0, 1, 0, 1], **PADDED, pad_to_multiple_of=8, copy_openers=True
    ),
    "prefixes": trajectories(PREFIXES),
    "explicit": explicit(NODES),
    "explicit-padded-copy-openers": explicit(NODES, **PADDED, copy_openers=True),
    "explicit-share-none": explicit(NODES, share="none"),
}


def collate(case: Case, examples: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return Collator.for_trees(float_fields=FIELDS, **case.options)(
        case.examples if examples is None else examples
    )


# --- the model: the tree at once, or each path alone ------------------------------------------------------

_MODELS: dict[torch.dtype, tuple[torch.nn.Module, torch.nn.Module]] = {}


def norm_in_own_dtype(norm: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """Llama's RMSNorm, in the weights' dtype: transformers computes it in float32, whose backward rounds a
    float64 model's gradients to float32 (a shared token's, summed over its paths, differs from the sum of
    each path's by 1e-7 then)."""
    return norm.weight * (hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon))


def models(dtype: torch.dtype) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A tiny Llama (grouped-query heads, weights large enough that the attention matters) and another as
    the reference policy."""
    if dtype not in _MODELS:
        transformers.utils.logging.set_verbosity_error()
        built = []
        for seed in (0, 1):
            torch.manual_seed(seed)
            config = transformers.LlamaConfig(
                vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                initializer_range=0.3, pad_token_id=0,
            )  # fmt: skip
            model = transformers.LlamaForCausalLM(config).to(dtype).eval()
            for module in model.modules():
                if isinstance(module, transformers.models.llama.modeling_llama.LlamaRMSNorm):
                    module.forward = functools.partial(norm_in_own_dtype, module)
            built.append(model)
        _MODELS[dtype] = (built[0], built[1])
    return _MODELS[dtype]


def run_tree(model: torch.nn.Module, batch: dict[str, Any], attention: str) -> torch.Tensor:
    """The model on the tree batch: ``use_tree_attention`` and its ``TreeBlocks``, or SDPA with the dense
    tree mask (``"sdpa"``), or plain causal attention over the rows (``"causal"``: wrong on a tree)."""
    ids, positions = batch["input_ids"], batch["position_ids"]
    if attention == "tree":
        use_tree_attention(model)
        return model(ids, position_ids=positions, tree=TreeBlocks.from_batch(batch)).logits
    model.set_attn_implementation("sdpa")
    if attention == "causal":
        return model(ids, position_ids=positions).logits
    return model(ids, position_ids=positions, attention_mask=dense_tree_mask(batch["subtree_end"])).logits


def run_alone(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """``[n]``: each token's log-prob given the path's earlier tokens, the path run by itself (0 first)."""
    model.set_attn_implementation("sdpa")
    ids = torch.tensor([tokens])
    scores = model(ids).logits[0, :-1].log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]
    return torch.cat([scores.new_zeros(1), scores])


# --- the plain references -----------------------------------------------------------------------------


def verl(
    losses: list[torch.Tensor],
    masks: list[torch.Tensor],
    mode: str,
    empty: str,
    normalizer: float = NORMALIZER,
) -> torch.Tensor:
    """verl 0.10's ``agg_loss`` over sequences given one by one (``empty="count"``: every sequence counts
    in a ``seq-mean-*`` mode, else those with a supervised token); a zero count divides by 1."""
    sums = [torch.where(m, loss, 0.0).sum() for loss, m in zip(losses, masks, strict=True)]
    counts = [int(m.sum()) for m in masks]
    if mode == "token-sum":
        return torch.stack(sums).sum()
    if mode == "token-mean":
        return torch.stack(sums).sum() / max(sum(counts), 1)
    sequences = len(counts) if empty == "count" else sum(1 for n in counts if n)
    if mode == "seq-mean-token-mean":
        total = torch.stack([s / n for s, n in zip(sums, counts, strict=True) if n] or [sums[0] * 0]).sum()
    else:
        total = torch.stack(sums).sum()
    value = total / max(sequences, 1)
    return value / normalizer if mode == "seq-mean-token-sum-norm" else value


def ppo(ratio: torch.Tensor, adv: float, low: float, high: float, dual: float | None = None) -> torch.Tensor:
    """PPO's clipped surrogate per token (verl's dual clip for a negative advantage)."""
    loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - low, 1 + high))
    return torch.minimum(loss, torch.full_like(loss, -adv * dual)) if dual is not None and adv < 0 else loss


def kl(lp: torch.Tensor, ref: torch.Tensor, estimator: str) -> torch.Tensor:
    """verl's estimators of KL(pi || ref); ``+``: the value with k2's gradient."""
    diff = lp - ref
    values = {"k1": diff, "abs": diff.abs(), "k2": diff**2 / 2, "k3": torch.exp(-diff) + diff - 1}
    base = values[estimator.rstrip("+")]
    return values["k2"] + (base - values["k2"]).detach() if estimator.endswith("+") else base


def pairs(count: int) -> tuple[list[int], list[int]]:
    """Sequences ``0, 2, ...`` chosen and ``1, 3, ...`` rejected."""
    return list(range(0, count - 1, 2)), list(range(1, count, 2))


def reference_losses(case: Case, policy: torch.nn.Module, reference: torch.nn.Module) -> dict[str, Any]:
    """Every loss over the paths, each run alone, with plain torch."""
    dtype = next(policy.parameters()).dtype
    lps = [run_alone(policy, tokens) for tokens, _ in case.paths]
    with torch.no_grad():
        refs = [run_alone(reference, tokens) for tokens, _ in case.paths]
    masks = [torch.tensor(case.supervised(s)) for s in range(len(case.paths))]
    olds = [
        torch.tensor([old_logprob(tokens, trained, t) for t in range(len(tokens))], dtype=dtype)
        for tokens, trained in case.paths
    ]
    advs = case.advantages
    out: dict[str, Any] = {"token_logprobs": torch.cat(lps)}
    sums = torch.stack([torch.where(m, lp, 0.0).sum() for lp, m in zip(lps, masks, strict=True)])
    out["sequence_logprobs"], out["counts"] = sums, torch.tensor([int(m.sum()) for m in masks])
    for mode in MODES:
        for empty in EMPTY:
            out[f"nll/{mode}/{empty}"] = verl([-lp for lp in lps], masks, mode, empty)
    ratios = [torch.exp(lp - old) for lp, old in zip(lps, olds, strict=True)]
    zipped = list(zip(lps, refs, ratios, advs, strict=True))
    grpo = [ppo(r, a, 0.2, 0.2) + KL_BETA * kl(lp, ref, "k3") * r for lp, ref, r, a in zipped]
    out["grpo"] = verl(grpo, masks, "seq-mean-token-mean", "count")
    out["bnpo"] = verl(
        [ppo(r, a, 0.2, 0.2) for r, a in zip(ratios, advs, strict=True)], masks, "token-mean", "skip"
    )
    out["dr_grpo"] = verl(
        [ppo(r, a, 0.2, 0.2) for r, a in zip(ratios, advs, strict=True)],
        masks,
        "seq-mean-token-sum-norm",
        "count",
    )
    out["dapo"] = verl(
        [ppo(r, a, 0.2, 0.28) for r, a in zip(ratios, advs, strict=True)], masks, "token-mean", "skip"
    )
    out["ppo-dual-clip"] = verl(
        [ppo(r, a, 0.2, 0.2, dual=3.0) for r, a in zip(ratios, advs, strict=True)],
        masks,
        "token-mean",
        "skip",
    )
    means = [
        torch.where(m, lp - old, 0.0).sum() / max(int(m.sum()), 1)
        for lp, old, m in zip(lps, olds, masks, strict=True)
    ]
    out["sequence_means"] = torch.cat([mean.expand(lp.numel()) for mean, lp in zip(means, lps, strict=True)])
    gspo = [
        ppo(torch.exp(mean).expand(lp.numel()), a, 0.2, 0.28)
        for mean, lp, a in zip(means, lps, advs, strict=True)
    ]
    out["gspo"] = verl(gspo, masks, "seq-mean-token-mean", "count")
    for estimator in KL_ESTIMATORS:
        out[f"kl/{estimator}"] = verl(
            [kl(lp, ref, estimator) for lp, ref in zip(lps, refs, strict=True)], masks, "token-mean", "skip"
        )
    chosen, rejected = pairs(len(lps))
    ref_sums = torch.stack([torch.where(m, ref, 0.0).sum() for ref, m in zip(refs, masks, strict=True)])
    margin = (sums[chosen] - ref_sums[chosen]) - (sums[rejected] - ref_sums[rejected])
    out["dpo/plain-sigmoid"] = -F.logsigmoid(DPO_BETA * margin).mean()
    for kind in PREFERENCE_LOSSES:  # the family reads the [P] sums: given the paths' own
        out[f"dpo/{kind}"] = preference_loss(
            sums[chosen], sums[rejected], ref_sums[chosen], ref_sums[rejected], loss_type=kind, beta=DPO_BETA,
            label_smoothing=SMOOTHING, chosen_counts=out["counts"][chosen], rejected_counts=out["counts"][rejected],
        )  # fmt: skip
    return out


def tree_losses(batch: dict[str, Any], logits: torch.Tensor, ref_logits: torch.Tensor) -> dict[str, Any]:
    """Every loss from the tree batch, by the helpers: per-token tensors gathered along the paths,
    per-path values spread with ``along_paths``."""
    tokens = token_logprobs(logits, batch)  # [R, L], token-aligned
    lp = along_paths(tokens, batch)  # [E], per entry
    ref = along_paths(token_logprobs(ref_logits, batch), batch)
    old = along_paths(batch["old"].to(lp.dtype), batch)
    adv = along_paths(batch["adv"].to(lp.dtype), batch)  # [S] spread
    out: dict[str, Any] = {"token_logprobs": lp}
    sequences = sequence_logprobs(logits, batch)
    out["sequence_logprobs"], out["counts"] = sequences.sums, sequences.counts
    for index, mode in enumerate(MODES):
        for empty in EMPTY:  # token-aligned and entry-aligned losses, in turn
            loss = -tokens if index % 2 else -lp
            out[f"nll/{mode}/{empty}"] = aggregate_loss(
                loss, batch, mode=mode, empty=empty, normalizer=NORMALIZER
            )
    ratio = importance_ratio(lp, old, batch)
    grpo = clipped_policy_loss(ratio, adv, clip=0.2) + KL_BETA * kl_penalty(lp, ref, "k3", ratio=ratio)
    out["grpo"] = aggregate_loss(grpo, batch, mode="seq-mean-token-mean", empty="count", accumulation_steps=1)
    out["bnpo"] = aggregate_loss(
        clipped_policy_loss(ratio, adv), batch, mode="token-mean", accumulation_steps=1
    )
    out["dr_grpo"] = aggregate_loss(
        clipped_policy_loss(ratio, adv), batch, mode="seq-mean-token-sum-norm", empty="count",
        normalizer=NORMALIZER, accumulation_steps=1,
    )  # fmt: skip
    out["dapo"] = aggregate_loss(
        clipped_policy_loss(ratio, adv, clip=0.2, clip_high=0.28), batch, mode="token-mean",
        global_count=global_loss_count(batch),
    )  # fmt: skip
    out["ppo-dual-clip"] = aggregate_loss(clipped_policy_loss(ratio, adv, dual_clip=3.0), batch)
    out["sequence_means"] = sequence_means(lp - old, batch)
    gspo = clipped_policy_loss(
        importance_ratio(lp, old, batch, level="sequence"), adv, clip=0.2, clip_high=0.28
    )
    out["gspo"] = aggregate_loss(gspo, batch, mode="seq-mean-token-mean", empty="count")
    for estimator in KL_ESTIMATORS:
        out[f"kl/{estimator}"] = aggregate_loss(kl_penalty(lp, ref, estimator), batch, mode="token-mean")
    chosen, rejected = pairs(batch["num_sequences"])
    sums, counts = sequences.sums, sequences.counts
    ref_sums = sequence_logprobs(ref_logits, batch).sums
    out["dpo/plain-sigmoid"] = preference_loss(
        sums[chosen], sums[rejected], ref_sums[chosen], ref_sums[rejected], beta=DPO_BETA
    )
    for kind in PREFERENCE_LOSSES:
        out[f"dpo/{kind}"] = preference_loss(
            sums[chosen], sums[rejected], ref_sums[chosen], ref_sums[rejected], loss_type=kind, beta=DPO_BETA,
            label_smoothing=SMOOTHING, chosen_counts=counts[chosen], rejected_counts=counts[rejected],
        )  # fmt: skip
    return out


def scalars(values: dict[str, Any]) -> tuple[list[str], torch.Tensor]:
    """The differentiable results as one vector: each scalar, each vector's weighted sum (fixed weights by
    place, so a wrong order shows)."""
    names, parts = [], []
    for name, value in values.items():
        if name == "counts":
            continue
        if value.dim():
            weights = torch.cos(torch.arange(value.numel(), dtype=value.dtype) * 0.7)
            value = (value * weights).sum()
        names.append(name)
        parts.append(value)
    return names, torch.stack(parts)


def gradients(losses: torch.Tensor, model: torch.nn.Module) -> torch.Tensor:
    """``[K, P]``: each loss's gradient w.r.t. every parameter (one batched backward)."""
    params = [p for p in model.parameters()]
    eye = torch.eye(losses.numel(), dtype=losses.dtype)
    grads = torch.autograd.grad(losses, params, grad_outputs=eye, is_grads_batched=True, allow_unused=True)
    return torch.cat(
        [
            (g if g is not None else torch.zeros(losses.numel(), *p.shape, dtype=losses.dtype)).reshape(
                losses.numel(), -1
            )
            for g, p in zip(grads, params, strict=True)
        ],
        dim=1,
    )


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    """Equal to the tolerance of ``dtype``: the largest difference, relative to the largest value above 1."""
    got, want = got.detach().double(), want.detach().double()
    assert got.shape == want.shape, (what, got.shape, want.shape)
    diff = (got - want).abs()
    scaled = float(diff.max() / want.abs().max().clamp(min=1)) if diff.numel() else 0.0
    key = f"{dtype}/{what.split(':')[0]}"
    MEASURED[key] = max(MEASURED.get(key, 0.0), scaled)
    assert scaled <= TOLERANCE[dtype], f"{what}: differs by {scaled:.3g} (relative above 1)"


# --- 1. every helper, every case, against the paths run alone -------------------------------------------

RUNS = [(name, torch.float64, "tree") for name in CASES]
RUNS += [(name, torch.float32, "tree") for name in CASES]
RUNS += [(name, torch.float64, "sdpa") for name in CASES]


@pytest.mark.parametrize(
    ("name", "dtype", "attention"), RUNS, ids=[f"{n}-{str(d)[6:]}-{a}" for n, d, a in RUNS]
)
def test_every_helper_on_a_tree_equals_the_paths_run_alone(name, dtype, attention):
    case = CASES[name]
    batch = collate(case)
    assert batch["num_sequences"] == len(case.paths)
    policy, reference = models(dtype)
    want = reference_losses(case, policy, reference)
    logits = run_tree(policy, batch, attention)
    with torch.no_grad():
        ref_logits = run_tree(reference, batch, attention)
    got = tree_losses(batch, logits, ref_logits)
    assert got["counts"].tolist() == want["counts"].tolist()
    names, got_values = scalars(got)
    want_names, want_values = scalars(want)
    assert names == want_names
    for key in ("token_logprobs", "sequence_logprobs", "sequence_means"):
        assert_close(got[key], want[key], dtype, f"value: {key}")
    for index, key in enumerate(names):
        assert_close(got_values[index], want_values[index], dtype, f"value: {key}")
    got_grads, want_grads = gradients(got_values, policy), gradients(want_values, policy)
    for index, key in enumerate(names):
        assert_close(got_grads[index], want_grads[index], dtype, f"gradient: {key}")
        if key.startswith("nll/") or key in ("token_logprobs", "grpo"):
            assert float(want_grads[index].abs().max()) > 1e-3, key  # the gradient is there to compare
    if dtype == torch.float64 and attention == "tree" and case.options.get("share") != "none":
        # The check has teeth: the rows run causally (branches seeing each other) give other numbers.
        wrong = sequence_logprobs(run_tree(policy, batch, "causal"), batch).sums
        assert float((wrong - want["sequence_logprobs"]).detach().abs().max()) > 1e-3


def test_turns_are_read_as_their_flat_trajectories():
    flat, turns = collate(CASES["agentic"]), collate(CASES["agentic-turns"])
    assert flat.keys() == turns.keys()
    for key, value in flat.items():
        assert torch.equal(value, turns[key]) if isinstance(value, torch.Tensor) else value == turns[key], key


def test_the_cases_cover_every_depth_and_sharing():
    """Depth (the branchings on the deepest path): 1 for GRPO groups, 2 for the prefixes, 3 for the
    explicit tree, 5 for the agentic rollouts; a token shared by several trained paths."""

    def depth(batch: dict[str, Any]) -> int:
        index = batch["logits_index"].reshape(-1).tolist()
        width = batch["input_ids"].shape[1]
        predicted = [0] * len(index)
        for place, before in enumerate(index):
            row = place // width
            if before >= 0:
                predicted[row * width + before] += 1
        best = 0
        for place in range(len(index)):
            count, at = 0, place
            while at >= 0:
                before = index[at]
                if before >= 0:
                    count += predicted[(at // width) * width + before] > 1
                    at = (at // width) * width + before
                else:
                    at = -1
            best = max(best, count)
        return best

    depths = {
        name: depth(collate(CASES[name])) for name in ("grpo-groups", "prefixes", "explicit", "agentic")
    }
    assert depths == {"grpo-groups": 1, "prefixes": 2, "explicit": 3, "agentic": 5}
    batch = collate(CASES["agentic"])
    labels = batch["labels"].reshape(-1)
    paths, offsets = batch["path_index"], batch["path_offsets"]
    shared_trained = torch.bincount(paths, minlength=labels.numel())[labels != -100]
    assert int(shared_trained.max()) == 7  # the first answer: laid out once, trained in 7 of the 8 paths
    assert offsets.numel() == 9 and paths.numel() > batch["input_ids"].numel()


# --- 2. micro-batches of a tree: verl's step count and TRL's accumulation, with the model ----------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_micro_batches_of_trees_equal_the_paths_run_alone(dtype):
    case = CASES["agentic-copy-openers"]
    cut = 3
    halves = [case.examples[:cut], case.examples[cut:]]
    policy, _ = models(dtype)
    params = list(policy.parameters())
    lps = [run_alone(policy, tokens) for tokens, _ in case.paths]
    masks = [torch.tensor(case.supervised(s)) for s in range(len(case.paths))]
    olds = [torch.tensor([old_logprob(t, f, i) for i in range(len(t))], dtype=dtype) for t, f in case.paths]
    per_path = [
        ppo(torch.exp(lp - old), a, 0.2, 0.2) for lp, old, a in zip(lps, olds, case.advantages, strict=True)
    ]
    batches = [collate(case, half) for half in halves]
    losses = []
    for batch in batches:
        lp = along_paths(token_logprobs(run_tree(policy, batch, "tree"), batch), batch)
        ratio = importance_ratio(lp, along_paths(batch["old"].to(dtype), batch), batch)
        losses.append(clipped_policy_loss(ratio, along_paths(batch["adv"].to(dtype), batch)))
    for mode in MODES:
        for empty in EMPTY:
            options = {"mode": mode, "empty": empty, "normalizer": NORMALIZER}
            count = None if mode == "token-sum" else global_loss_count(batches, mode=mode, empty=empty)
            step = sum(
                aggregate_loss(loss, batch, global_count=count, **options)
                for loss, batch in zip(losses, batches, strict=True)
            )
            trl = sum(
                aggregate_loss(loss, batch, accumulation_steps=2, **options)
                for loss, batch in zip(losses, batches, strict=True)
            )
            want_step = verl(per_path, masks, mode, empty)
            want_trl = (
                verl(per_path[:cut], masks[:cut], mode, empty)
                + verl(per_path[cut:], masks[cut:], mode, empty)
            ) / 2
            for got, want, what in ((step, want_step, "verl"), (trl, want_trl, "trl")):
                assert_close(got, want, dtype, f"value: micro-batches {what} {mode} {empty}")
                grads = torch.autograd.grad(got, params, retain_graph=True)
                wanted = torch.autograd.grad(want, params, retain_graph=True)
                assert_close(
                    torch.cat([g.reshape(-1) for g in grads]), torch.cat([g.reshape(-1) for g in wanted]), dtype,
                    f"gradient: micro-batches {what} {mode} {empty}",
                )  # fmt: skip


# --- 3. sequence_means, unpack and along_paths on a tree batch -----------------------------------------


def test_sequence_means_on_a_tree_batch_entry_aligned_in_and_out():
    case = CASES["agentic"]
    batch = collate(case)
    entries = along_paths(batch["old"].double(), batch)
    out = sequence_means(entries, batch)
    assert out.shape == entries.shape
    want = []
    for s, (tokens, trained) in enumerate(case.paths):
        olds = [old_logprob(tokens, trained, t) for t in range(len(tokens))]
        kept = [v for v, m in zip(olds, case.supervised(s), strict=True) if m]
        want += [sum(kept) / max(len(kept), 1)] * len(tokens)
    assert out.tolist() == pytest.approx(want, abs=1e-12)
    # A token-aligned tensor: a shared token has no one mean; refused, naming the fix.
    for helper in (
        lambda: sequence_means(batch["old"], batch),
        lambda: importance_ratio(batch["old"], batch["old"], batch, level="sequence"),
    ):
        with pytest.raises(ValueError, match=r"along_paths\(values, batch\)"):
            helper()


def test_unpack_and_along_paths_on_a_tree_batch():
    for name in (
        "agentic",
        "agentic-padded-multiple-copy",
        "explicit-padded-copy-openers",
        "agentic-share-none",
    ):
        case = CASES[name]
        batch = collate(case)
        tokens = [p[0] for p in case.paths]
        assert [t.tolist() for t in unpack(batch["input_ids"], batch)] == tokens, name
        padded = unpack(batch["input_ids"], batch, padded=True, padding_value=-1)
        width = max(len(t) for t in tokens)
        assert padded.tolist() == [t + [-1] * (width - len(t)) for t in tokens], name
        olds = [[old_logprob(t, f, i) for i in range(len(t))] for t, f in case.paths]
        assert [t.tolist() for t in unpack(batch["old"], batch)] == olds, name
        labels = unpack(batch["labels"], batch)
        assert [(row != -100).tolist() for row in labels] == [case.supervised(s) for s in range(len(tokens))]
        entries = along_paths(batch["input_ids"], batch)
        assert entries.tolist() == [t for row in tokens for t in row], name
        assert [t.tolist() for t in unpack(entries, batch)] == tokens  # entry-aligned in, too
        spread = along_paths(batch["adv"], batch)
        assert spread.tolist() == [a for a, row in zip(case.advantages, tokens, strict=True) for _ in row]
        two = torch.stack([batch["adv"], -batch["adv"]], dim=1)  # [S, 2]: each sequence's pair
        assert along_paths(two, batch).tolist() == [
            [a, -a] for a, row in zip(case.advantages, tokens, strict=True) for _ in row
        ]


def test_shapes_a_tree_batch_cannot_read_are_refused():
    batch = collate(CASES["agentic-padded"])
    rows, length = batch["input_ids"].shape
    sequences, entries = batch["num_sequences"], int(batch["path_offsets"][-1])
    assert len({rows * length, sequences, entries}) == 3
    shape = (
        rf"per token, aligned with input_ids \({rows}, {length}\), or per entry \({entries}, as along_paths"
    )
    for wrong in (torch.zeros(entries + 1), torch.zeros(rows, length + 1), torch.zeros(rows * length)):
        for call in (
            lambda wrong=wrong: along_paths(wrong, batch),
            lambda wrong=wrong: aggregate_loss(wrong, batch),
            lambda wrong=wrong: sequence_means(wrong, batch),
            lambda wrong=wrong: unpack(wrong, batch),
        ):
            with pytest.raises(ValueError, match=shape):
                call()
    with pytest.raises(ValueError, match=r"logits have shape \(2, 3, 32\)"):
        sequence_logprobs(torch.zeros(2, 3, VOCAB), batch)
    with pytest.raises(ValueError, match=r"one \[R, L\] shape"):
        importance_ratio(torch.zeros(entries), torch.zeros(rows, length), batch)
    # path_offsets that do not fit path_index: a RuntimeError of repeat_interleave before the fix.
    offsets = batch["path_offsets"]
    falling = torch.tensor([offsets[0], offsets[2], offsets[1], *offsets[3:]])
    for wrong in (offsets[:-1], offsets + 1, falling):
        for call in (
            lambda wrong=wrong: aggregate_loss(torch.zeros(rows, length), {**batch, "path_offsets": wrong}),
            lambda wrong=wrong: unpack(batch["input_ids"], {**batch, "path_offsets": wrong}),
        ):
            with pytest.raises(
                ValueError, match=rf"path_offsets'\] must rise from 0 to the {entries} places"
            ):
                call()
    with pytest.raises(ValueError, match=rf"path_offsets'\] holds {sequences} sequences.*num_sequences'\] 9"):
        aggregate_loss(torch.zeros(rows, length), {**batch, "num_sequences": 9})
    outside = {**batch, "path_index": batch["path_index"] + rows * length}
    with pytest.raises(ValueError, match=r"path_index.*points outside input_ids"):
        unpack(batch["input_ids"], outside)


def test_an_empty_trajectory_is_a_path_without_entries():
    examples = [
        {"input_ids": [3, 4, 5], "completion_mask": [0, 1, 1], "adv": 1.0},
        {"input_ids": [], "completion_mask": [], "adv": 2.0},
        {"input_ids": [3, 4, 6], "completion_mask": [0, 1, 1], "adv": -1.0},
    ]
    batch = Collator.for_trees(float_fields=[FloatField("adv", "sequence")])(examples)
    assert batch["path_offsets"].tolist() == [0, 3, 3, 6]
    assert [t.tolist() for t in unpack(batch["input_ids"], batch)] == [[3, 4, 5], [], [3, 4, 6]]
    assert along_paths(batch["adv"], batch).tolist() == [1.0] * 3 + [-1.0] * 3
    # The places hold 3 4 5 6: the sequences' sums 3 and 5, over 2 supervised tokens each.
    loss = torch.tensor([[0.0, 1.0, 2.0, 4.0]], dtype=torch.float64)
    assert float(aggregate_loss(loss, batch, mode="seq-mean-token-sum")) == 4.0
    assert float(aggregate_loss(loss, batch, mode="seq-mean-token-sum", empty="count")) == 8 / 3
    assert sequence_logprobs(torch.zeros(1, 4, VOCAB), batch).counts.tolist() == [2, 0, 2]


def test_a_broadcast_per_sequence_value_reaches_every_entry_of_its_path():
    """Each path's value on every entry of it, or a refusal naming FloatField(name, "sequence") and
    along_paths. Before: ``adv`` ``[[0, 0, 0, 1, -1]]``, entries ``[0, 0, 0, 1, 0, 0, 0, -1]`` (the trained
    tokens 2 and 3, shared, got no advantage in either path)."""
    examples = [
        {"input_ids": [1, 2, 3, 4], "completion_mask": [0, 1, 1, 1], "adv": 1.0},
        {"input_ids": [1, 2, 3, 5], "completion_mask": [0, 1, 1, 1], "adv": -1.0},
    ]
    try:
        batch = Collator.for_trees(float_fields=[FloatField("adv", "sequence", broadcast=True)])(examples)
    except ValueError as refusal:  # a refusal that names the fix would do
        assert "along_paths" in str(refusal)
        return
    assert along_paths(batch["adv"], batch).tolist() == [1.0] * 4 + [-1.0] * 4


# --- 4. a property: aggregate_loss over random trees equals the paths, any split ------------------------


def value_of(key: tuple) -> float:
    """A per-token loss, a function of the token's prefix (token ids and what is supervised)."""
    return random.Random(repr(key)).randint(-64, 64) / 16


def path_keys(tokens: list[int], trained: list[bool]) -> list[tuple]:
    """Each token's prefix as a path alone sees it: (id, supervised) pairs up to it."""
    pairs_ = [(t, flag and i > 0) for i, (t, flag) in enumerate(zip(tokens, trained, strict=True))]
    return [tuple(pairs_[: i + 1]) for i in range(len(pairs_))]


def token_values(batch: dict[str, Any]) -> torch.Tensor:
    """``[R, L]``: each place's value from its prefix, read up the tree by ``logits_index`` (not the paths);
    a place is supervised where it is labelled and predicted (a root's first label may be its id)."""
    ids, index, labels = (batch[k].tolist() for k in ("input_ids", "logits_index", "labels"))
    out = torch.zeros(batch["input_ids"].shape, dtype=torch.float64)
    for r, row in enumerate(ids):
        for p in range(len(row)):
            chain, at = [], p
            while at >= 0:
                chain.append((row[at], labels[r][at] != -100 and index[r][at] >= 0))
                at = index[r][at]
            out[r, p] = value_of(tuple(reversed(chain)))
    return out


@st.composite
def random_cases(draw: st.DrawFn) -> tuple[Case, list[int]]:
    """Trajectories (flat or as turns, in random groups) or explicit trees, random supervision, advantages
    and layout; and a micro-batch for each example (whole trees for explicit ones)."""
    options: dict[str, Any] = {
        "share": draw(st.sampled_from(["group", "batch", "group", "batch", "none"])),
        "copy_openers": draw(st.booleans()),
    }
    padding = draw(st.sampled_from(["free", "padded", "multiple"]))
    if padding == "padded":
        options.update(PADDED)
    elif padding == "multiple":
        options.update(
            pad_token_id=0, padding_free=draw(st.booleans()), pad_to_multiple_of=draw(st.sampled_from([4, 8]))
        )
    tokens = st.integers(3, 5)  # a tiny alphabet: prefixes are shared
    trained = st.sampled_from([True, True, False])
    seed = draw(st.integers(0, 2**16))
    kind = draw(st.sampled_from(["explicit", "flat", "turns"]))
    if kind == "explicit":
        count = draw(st.integers(1, 9))
        parents = [draw(st.integers(-1, i - 1)) if i else -1 for i in range(count)]
        nodes = []
        for i, parent in enumerate(parents):
            size = draw(st.integers(1, 3))
            node_tokens = draw(st.lists(tokens, min_size=size, max_size=size))
            mask = [int(flag) for flag in draw(st.lists(trained, min_size=size, max_size=size))]
            nodes.append((100 + i, parent + 100 if parent >= 0 else -1, node_tokens, mask))
        order = draw(st.permutations(range(count)))
        case = explicit([nodes[i] for i in order], seed=seed, **options)
        root_of = {}
        for i, parent in enumerate(parents):
            root_of[100 + i] = root_of[parent + 100] if parent >= 0 else 100 + i
        roots = sorted(set(root_of.values()))
        cut = draw(st.integers(1, max(len(roots) - 1, 1)))  # the trees before it in one micro-batch
        return case, [int(roots.index(root_of[example["node_id"]]) >= cut) for example in case.examples]
    count = draw(st.integers(1, 8))
    groups = draw(st.integers(1, 3))
    bases = [
        (draw(st.lists(tokens, max_size=6)), draw(st.lists(trained, min_size=6, max_size=6)))
        for _ in range(groups)
    ]
    rows, group_of = [], []
    for _ in range(count):
        group = draw(st.integers(0, groups - 1))
        base, base_mask = bases[group]
        keep = draw(st.integers(0, len(base)))
        tail = draw(st.lists(tokens, max_size=5))  # a trajectory may be empty
        tail_mask = draw(st.lists(trained, min_size=len(tail), max_size=len(tail)))
        spans = [([t], f) for t, f in zip(base[:keep] + tail, base_mask[:keep] + tail_mask, strict=True)]
        rows.append(spans)
        group_of.append(group)
    cut = draw(st.integers(1, max(count - 1, 1)))  # the trajectories before it in one micro-batch
    for part in (rows[:cut], rows[cut:]):
        if part and not any(part):  # a batch of empty trajectories only is refused (padding-free)
            part[0].append(([3], True))
    case = trajectories(rows, group_of, turns=kind == "turns", seed=seed, **options)
    return case, [int(i >= cut) for i in range(count)]


def reference_entries(
    case: Case, indices: list[int]
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """For the sequences ``indices``: each path's token values, its per-entry loss and what it supervises."""
    values, losses, masks = [], [], []
    for s in indices:
        tokens, trained = case.paths[s]
        value = torch.tensor([value_of(key) for key in path_keys(tokens, trained)], dtype=torch.float64)
        adv = case.advantages[s]
        values.append(value)
        losses.append(value * adv + adv**2)
        masks.append(torch.tensor(case.supervised(s), dtype=torch.bool))
    return values, losses, masks


def tree_inputs(batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """The token-aligned values ``[R, L]`` and the per-entry loss ``[E]`` (values times the path's
    advantage, plus its square)."""
    values = token_values(batch)
    adv = along_paths(batch["adv"].double(), batch)
    return values, along_paths(values, batch) * adv + adv**2


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_cases())
def test_aggregate_loss_over_random_trees_equals_the_paths(drawn):
    case, side = drawn
    parts = [[i for i, s in enumerate(side) if s == k] for k in (0, 1)]
    parts = [part for part in parts if part]
    batch = collate(case)
    values, per_entry = tree_inputs(batch)
    all_values, all_losses, all_masks = reference_entries(case, list(range(len(case.paths))))
    # The micro-batches: each part's examples, and the sequences they hold (leaves, for explicit trees).
    micro, micro_sequences = [], []
    for part in parts:
        examples = [case.examples[i] for i in part]
        micro.append(collate(case, examples))
        if "node_id" in examples[0]:
            ids = {example["node_id"] for example in examples}
            leaves = [
                ex for ex in case.examples if ex["node_id"] not in {e["parent_id"] for e in case.examples}
            ]
            micro_sequences.append([s for s, leaf in enumerate(leaves) if leaf["node_id"] in ids])
        else:
            micro_sequences.append(part)
    inputs = [tree_inputs(b) for b in micro]
    for mode in MODES:
        for empty in EMPTY:
            options = {"mode": mode, "empty": empty, "normalizer": NORMALIZER}
            whole = verl(all_losses, all_masks, mode, empty)
            assert_close(
                aggregate_loss(per_entry, batch, **options), whole, torch.float64, "value: property entries"
            )
            token = aggregate_loss(values, batch, **options)
            assert_close(
                token, verl(all_values, all_masks, mode, empty), torch.float64, "value: property tokens"
            )
            count = None if mode == "token-sum" else global_loss_count(micro, mode=mode, empty=empty)
            step = sum(
                aggregate_loss(loss, b, global_count=count, **options)
                for b, (_, loss) in zip(micro, inputs, strict=True)
            )
            assert_close(step, whole, torch.float64, "value: property global_count")
            trl = sum(
                aggregate_loss(loss, b, accumulation_steps=len(micro), **options)
                for b, (_, loss) in zip(micro, inputs, strict=True)
            )
            want = sum(
                verl(*reference_entries(case, seqs)[1:], mode, empty) for seqs in micro_sequences
            ) / len(micro)
            assert_close(trl, want, torch.float64, "value: property accumulation_steps")
    supervised = sum(int(m.sum()) for m in all_masks)
    assert int(global_loss_count(batch)) == supervised
    assert int(global_loss_count(micro)) == supervised
    assert int(global_loss_count(micro, mode="seq-mean-token-mean", empty="count")) == len(case.paths)
    assert int(global_loss_count(batch, mode="seq-mean-token-sum")) == sum(1 for m in all_masks if m.any())
