"""SequenceRoles: each role's sequences (a pair's chosen and rejected side) and their values, by role."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from zephon_collate.core.checks import check_key
from zephon_collate.core.keys import NUM_SEQUENCES
from zephon_collate.transforms._shapes import check_rank
from zephon_collate.transforms.base import Transform

__all__ = ["SequenceRoles"]


class SequenceRoles(Transform):
    """From each sequence's role: ``{role}_index``, per-sequence values split by role, ``num_sequences``. The
    counts per role are read back from the device.

    Parameters:
        role_key: the roles, ``k`` for ``roles[k]`` (consumed).
        roles: the role names, by number (``()``: no index is written).
        values: ``{per-sequence key: {role: output key}}``; each source is consumed unless an output keeps it.
        count_key: where to write the number of sequences (0-d int64), or ``None``.
        index: write ``{role}_index`` for each role (else only the values split by role).

    Example:
        >>> from tensordict import TensorDict
        >>> td = TensorDict(role=torch.tensor([0, 0, 1, 1]), ref=torch.tensor([-1.0, -2.0, -3.0, -4.0]))
        >>> out = SequenceRoles("role", ("chosen", "rejected"), {"ref": {"chosen": "ref_chosen"}})(td)
        >>> out["chosen_index"].tolist(), out["rejected_index"].tolist(), out["ref_chosen"].tolist()
        ([0, 1], [2, 3], [-1.0, -2.0])
    """

    data_dependent_shape = True

    def __init__(
        self,
        role_key: str,
        roles: Sequence[str],
        values: Mapping[str, Mapping[str, str]] | None = None,
        count_key: str | None = NUM_SEQUENCES,
        *,
        index: bool = True,
    ) -> None:
        super().__init__()
        owner = "SequenceRoles"
        self.role_key = check_key(owner, "role_key", role_key)
        self.roles = tuple(roles)
        self.values = {check_key(owner, "values", k): dict(v) for k, v in (values or {}).items()}
        self.count_key = None if count_key is None else check_key(owner, "count_key", count_key)
        unknown = sorted({role for targets in self.values.values() for role in targets} - set(self.roles))
        if unknown:
            raise ValueError(f"{owner}: values name roles {unknown} beyond the roles {list(self.roles)}")
        self.index = index
        outputs = [f"{role}_index" for role in self.roles] if index else []
        outputs += [target for targets in self.values.values() for target in targets.values()]
        outputs += [] if self.count_key is None else [self.count_key]
        reads = [self.role_key, *self.values]
        self.in_keys, self.out_keys = list(reads), list(outputs)
        self.dropped_keys = tuple(key for key in reads if key not in outputs)

    def check(self, data: Mapping[str, torch.Tensor]) -> None:
        check_rank("SequenceRoles", self.role_key, data[self.role_key], "[S] roles", 1, 1)

    def output_batch_size(self, batch_size: torch.Size) -> torch.Size:
        return torch.Size([])  # entries per sequence and per role, not per row

    def _split(self, data: Mapping[str, object], picks: dict[str, object]) -> dict[str, object]:
        out: dict[str, object] = {f"{role}_index": picks[role] for role in self.roles} if self.index else {}
        for source, targets in self.values.items():
            for role, target in targets.items():
                out[target] = data[source][picks[role]]  # type: ignore[index]
        return out

    def compute(self, data: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        role = data[self.role_key]
        picks: dict[str, object] = {
            name: (role == number).nonzero()[:, 0] for number, name in enumerate(self.roles)
        }
        out = self._split(data, picks)
        if self.count_key is not None:
            out[self.count_key] = torch.tensor(role.shape[0], dtype=torch.int64, device=role.device)
        return out  # type: ignore[return-value]

    def host(self, data: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        role = data[self.role_key]
        picks: dict[str, object] = {
            name: np.flatnonzero(role == number).astype(np.int64) for number, name in enumerate(self.roles)
        }
        out = self._split(data, picks)
        if self.count_key is not None:
            out[self.count_key] = np.array(role.shape[0], dtype=np.int64)
        return out  # type: ignore[return-value]
