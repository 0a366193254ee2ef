"""Post-training workloads whose sequences share prefixes at many levels, as token lists.

Each workload is a list of *groups*; a group is a list of trajectories, each ``(tokens, trained)``:

- ``grpo``: a prompt of 200-800 tokens and 8 completions of 50-1,000 tokens (shared: the prompt);
- ``agentic``: a 1-3k-token system and tool prompt, then 4-8 turns of 50-400 assistant tokens
  (trained) and 100-2,000 tool tokens (not trained), branching 2 ways at three turns: ``early``
  (turns 1-3), ``late`` (turns 4-6) or ``spread`` (turns 2, 5, 8): 8 trajectories a group;
- ``sft_history``: reasoning SFT, each turn its own example: the conversation so far with the
  earlier turns' thinking stripped, then this turn's thinking and answer (trained); 6 or 12 turns.

Tokens are drawn from a large vocabulary, so trajectories share only what the workload shares.
"""

from __future__ import annotations

import numpy as np

Trajectory = tuple[list[int], list[bool]]
VOCAB = 4_096


def _span(rng: np.random.Generator, low: int, high: int) -> list[int]:
    return rng.integers(3, VOCAB, int(rng.integers(low, high + 1))).tolist()


def grpo(groups: int = 4, seed: int = 0, *, completions: int = 8) -> list[list[Trajectory]]:
    """GRPO groups: one prompt, ``completions`` sampled completions."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(groups):
        prompt = _span(rng, 200, 800)
        group = []
        for _ in range(completions):
            completion = _span(rng, 50, 1000)
            group.append((prompt + completion, [False] * len(prompt) + [True] * len(completion)))
        out.append(group)
    return out


BRANCHES = {"early": (1, 2, 3), "late": (4, 5, 6), "spread": (2, 5, 8)}


def agentic(shape: str, groups: int = 2, seed: int = 0, *, scale: float = 1.0) -> list[list[Trajectory]]:
    """Agentic rollouts branching 2 ways at the turns of ``shape`` (``BRANCHES``); ``scale`` shrinks every
    span (for a step that must run on a CPU)."""
    rng = np.random.default_rng(seed)
    at = BRANCHES[shape]

    def span(low: int, high: int) -> list[int]:
        return _span(rng, max(1, int(low * scale)), max(1, int(high * scale)))

    out = []
    for _ in range(groups):
        turns = int(rng.integers(max(4, at[-1]), 9))
        system = span(1000, 3000)

        def grow(tokens: list[int], trained: list[bool], turn: int, turns: int = turns) -> list[Trajectory]:
            if turn > turns:
                return [(tokens, trained)]
            branches = 2 if turn in at else 1
            done: list[Trajectory] = []
            for _ in range(branches):
                answer, tool = span(50, 400), span(100, 2000)
                done += grow(
                    tokens + answer + tool,
                    trained + [True] * len(answer) + [False] * len(tool),
                    turn + 1,
                    turns,
                )
            return done

        out.append(grow(system, [False] * len(system), 1))
    return out


def sft_history(turns: int, groups: int = 2, seed: int = 0) -> list[list[Trajectory]]:
    """Multi-turn reasoning SFT, each turn an example whose history drops the earlier thinking."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(groups):
        history = _span(rng, 200, 600)  # the system prompt
        group = []
        for _ in range(turns):
            user = _span(rng, 30, 300)
            thinking, answer = _span(rng, 200, 1500), _span(rng, 50, 400)
            prompt = history + user
            group.append(
                (prompt + thinking + answer, [False] * len(prompt) + [True] * (len(thinking) + len(answer)))
            )
            history = prompt + answer
        out.append(group)
    return out


def bound(groups: list[list[Trajectory]]) -> int:
    """The prefix trie's token count: each distinct (tokens, supervision) prefix of a group once."""
    total = 0
    for group in groups:
        root: dict[tuple[int, bool], dict] = {}  # type: ignore[type-arg]
        for tokens, trained in group:
            node = root
            for pair in zip(tokens, trained, strict=True):
                child = node.get(pair)
                if child is None:
                    child = node[pair] = {}
                    total += 1
                node = child
    return total
