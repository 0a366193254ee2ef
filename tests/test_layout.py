"""The package's shape: layers bottom to top, no import circle between files, one signature, one segment rule."""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from zephon_collate import Collator, SampleBatch, functional, to_training, use_host_pass
from zephon_collate.functional.attention import cu_seqlens_from_segment_ids
from zephon_collate.functional.context_parallel import cp_partition_index

PACKAGE = Path(__file__).resolve().parent.parent / "zephon_collate"

# Bottom to top; an area may import from its own level and the levels below.
LEVELS = [
    {"core"},
    {"read"},
    {"functional"},
    {"transforms"},
    {"layouts"},
    {"collate", "types"},
    {"packing", "parallel", "losses"},
    {"inspection", "trainers", "engines"},
    {"__init__"},
]


def _level(module: str) -> int:
    parts = module.split(".")
    area = parts[1] if len(parts) > 1 else "__init__"
    return next(i for i, names in enumerate(LEVELS) if area in names)


def _module_of(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")


def _imports() -> list[tuple[str, str]]:
    edges = []
    for path in PACKAGE.rglob("*.py"):
        module = _module_of(path)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("zephon_collate"):
                for alias in node.names:  # `from zephon_collate.x import y`: y's module where it is one
                    target = f"{node.module}.{alias.name}"
                    is_module = (PACKAGE.parent / Path(*target.split("."))).with_suffix(".py").exists()
                    edges.append((module, target if is_module else node.module or ""))
    return edges


def test_no_area_imports_from_an_area_above_it():
    upward = [(source, target) for source, target in _imports() if _level(target) > _level(source)]
    assert upward == [], upward


def test_importing_the_package_loads_no_data_engine():
    """The engines are optional extras: ``import zephon_collate`` must work without them."""
    code = "import sys, zephon_collate; print(sorted({'grain', 'ray', 'pyarrow'} & set(sys.modules)))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert loaded.stdout.strip() == "[]", loaded.stdout


def test_no_import_circle_between_files():
    """Per file, not per area: no module reaches itself through the modules it imports (packages'
    ``__init__`` files, which only re-export, are left out)."""
    graph: dict[str, set[str]] = {}
    for source, target in _imports():
        if source != target and not (PACKAGE / Path(*target.split(".")[1:]) / "__init__.py").exists():
            graph.setdefault(source, set()).add(target)
    circles = []
    for start in graph:
        stack, seen = list(graph[start]), set()
        while stack:
            node = stack.pop()
            if node == start:
                circles.append(start)
                break
            if node not in seen:
                seen.add(node)
                stack.extend(graph.get(node, ()))
    assert circles == [], circles


def test_to_training_signature_is_the_reference_pages():
    """One signature, shown by both entry points, with the page's names, order and defaults."""
    page = [
        ("tokens_field", "auto"),
        ("return_labels", False),
        ("dtype", "auto"),
        ("extra_fields", ()),
        ("ignore_index", -100),
        ("rename_fields", None),
        ("flatten", False),
        ("exclude_fields", ()),
        ("return_num_valid_tokens", False),
        ("return_loss_mask", False),
        ("return_cu_seqlens", False),
        ("return_padding_mask", False),
        ("eos_mask_loss", False),
        ("eos_token_id", None),
        ("position_mode", "preserve"),
    ]
    for function, leading in ((SampleBatch.to_training, "self"), (to_training, "batch")):
        parameters = list(inspect.signature(function).parameters.values())
        assert parameters[0].name == leading
        assert [(p.name, p.default) for p in parameters[1:]] == page
        assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in parameters[1:])


POSITIONS = torch.tensor([[3, 4, 0, 1, 2], [0, 1, 0, 0, 1]])  # row 0 does not start at zero


def test_every_boundary_follows_the_one_segment_rule():
    """Hand-worked: a segment starts at a row's first token and wherever positions are 0; the fused
    host pass (its NumPy form) and the collate path on it find the same starts."""
    from zephon_collate.functional import host

    starts = [[True, False, True, False, False], [True, False, True, True, False]]
    assert functional.segment_starts(POSITIONS).tolist() == starts
    assert host.segment_starts(POSITIONS.numpy()).tolist() == starts
    flat_starts = [start for row in starts for start in row]
    assert host.ragged_starts(np.array([0, 5, 10]), POSITIONS.numpy().reshape(-1)).tolist() == flat_starts
    cu, top = functional.cu_seqlens_rows(POSITIONS)
    assert cu.tolist() == [[0, 2, 5, 5], [0, 2, 3, 5]] and top.tolist() == [3, 2]
    flat, longest = functional.cu_seqlens_flat(POSITIONS)
    assert flat.tolist() == [0, 2, 5, 7, 8, 10] and int(longest) == 3
    starting = torch.tensor([[0, 1, 2, 0, 1], [0, 1, 0, 0, 1]])  # the collator needs rows from 0
    rows = [{"input_ids": [5] * 5, "positions": p} for p in starting.tolist()]
    for on_host in (True, False):
        with use_host_pass(on_host):
            collated = Collator(return_cu_seqlens=True, extra_fields=["positions"])(rows)
            assert collated["cu_seqlens"].tolist() == functional.cu_seqlens_rows(starting)[0].tolist()
    ids = functional.segment_ids_from_positions(POSITIONS)
    assert ids.tolist() == [[0, 0, 1, 1, 1], [0, 0, 1, 2, 2]]
    assert cu_seqlens_from_segment_ids(ids)[0].tolist() == cu.tolist()


def test_context_parallel_layout_uses_the_same_documents():
    """ContextParallelShard cuts the stream at the same starts: documents of 2 and 3 tokens, then 2, 1, 2."""
    from tensordict import TensorDict

    from zephon_collate.transforms import ContextParallelShard

    shard = ContextParallelShard(1, 0)(TensorDict(positions=POSITIONS, batch_size=[2]))
    assert shard["cu_seqlens"].tolist() == [0, 2, 5, 7, 8, 10]
    assert shard["cu_seqlens_padded"].tolist() == [0, 2, 6, 8, 10, 12]  # each padded to a multiple of 2
    assert cp_partition_index(shard["cu_seqlens_padded"], 1, 0).tolist() == list(range(12))


def _modules() -> list[tuple[str, ast.Module]]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        found.append((module, ast.parse(path.read_text())))
    return found


def test_no_module_imports_another_modules_private_name():
    """A leading underscore means "this module's own": no other module imports such a name."""
    crossing = []
    for module, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("zephon_collate"):
                for alias in node.names:
                    if not alias.name.startswith("_") or alias.name.startswith("__"):
                        continue
                    target = PACKAGE.parent / Path(*f"{node.module}.{alias.name}".split("."))
                    is_module = target.with_suffix(".py").exists() or target.is_dir()
                    if is_module and node.module == module.rpartition(".")[0]:
                        continue  # an area's internal module, used inside the area
                    crossing.append(f"{module} imports {alias.name} from {node.module}")
    assert crossing == [], crossing


def _declared_all(tree: ast.Module) -> list[str] | None:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            try:
                return list(ast.literal_eval(node.value))
            except ValueError:  # built from other lists (types re-exports records.__all__)
                return ["*"]
    return None


def test_every_module_lists_its_public_names_in_all():
    """Complete ``__all__``: each public def, class and constant of a module is listed; the rest is private."""
    problems = []
    for module, tree in _modules():
        names = _declared_all(tree)
        public = [
            target.id if isinstance(node, (ast.Assign, ast.AnnAssign)) else node.name
            for node in tree.body
            if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.Assign, ast.AnnAssign))
            for target in (node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", node)])
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) or isinstance(target, ast.Name)
        ]
        public = [name for name in public if not name.startswith("_") and name not in ("F", "P", "R")]
        if names is None:
            if public and module != "zephon_collate.__main__":
                problems.append(f"{module}: no __all__ (public names {public})")
            continue
        missing = [name for name in public if name not in names and "*" not in names]
        if missing:
            problems.append(f"{module}: public but not in __all__: {missing}")
    assert problems == [], "\n".join(problems)
