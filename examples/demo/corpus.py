"""The demo corpus: real text found on every machine with Python, turned into records.

By default the documents come from the Python standard library's own source
files (``sysconfig.get_paths()["stdlib"]``, test suites and third-party
``site-packages`` left out), split two ways, one mixture component each:

- **component 0, source**: the modules' code, in top-level blocks; every
  token is supervised.
- **component 1, docstring -> body**: each function (or method) with a
  docstring, short enough to fit a row, as a chat-style example: the
  signature and docstring are the prompt (``loss_mask`` 0), the body is the
  response (``loss_mask`` 1). Their lines are taken out of the source
  component, so no text is seen twice.

``--corpus`` swaps in a folder (``.py`` files split the same way, other text
files in blank-line separated blocks) or a JSONL file, one object per line:
``{"text": ...}`` (component 0) or ``{"prompt": ..., "response": ...}``
(component 1).
"""

from __future__ import annotations

import ast
import itertools
import json
import random
import re
import sysconfig
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np

from demo.tokenizer import ByteTokenizer
from zephon_collate.core.records import SampleMeta, SampleRecord

__all__ = [
    "CHAT",
    "COMPONENTS",
    "SOURCE",
    "Document",
    "fields",
    "load_documents",
    "read_jsonl",
    "split_python",
    "split_text",
    "stdlib_root",
    "to_records",
]


def fields(record: SampleRecord) -> dict[str, Any]:
    """A demo record's payload: the dict of NumPy arrays :func:`to_records` and ``pack_flat`` write."""
    return cast(dict[str, Any], record.payload)


SOURCE, CHAT = 0, 1
COMPONENTS = {SOURCE: "source", CHAT: "docstring->body"}
_SKIPPED_DIRS = {"__pycache__", "test", "tests", "idlelib", "lib2to3", "turtledemo"}
_SKIPPED_DIRS |= {"site-packages", "dist-packages"}  # third-party code
_STDLIB_SKIPPED_DIRS = {"encodings", "pydoc_data"}  # generated tables, not code people wrote
_MAX_BLOCK_CHARS = 4096
_MIN_BLOCK_CHARS = 64
_MIN_RESPONSE_CHARS = 16
_TOP_LEVEL = re.compile(r"\n\s*\n(?=\S)")  # a blank line, then an unindented line


@dataclass(frozen=True)
class Document:
    """One document: ``text`` (component 0) or ``prompt`` + ``response`` (component 1).

    ``shard`` is the index of the file it came from, ``index`` its place in that file.
    """

    component: int
    text: str = ""
    prompt: str = ""
    response: str = ""
    shard: int = 0
    index: int = 0


def stdlib_root() -> Path:
    """The folder of the running Python's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def _cut(block: str, max_chars: int) -> list[str]:
    """``block`` in pieces of at most ``max_chars``, cut after a newline where there is one."""
    pieces = []
    while len(block) > max_chars:
        cut = block.rfind("\n", 0, max_chars) + 1 or max_chars
        pieces.append(block[:cut])
        block = block[cut:]
    return [*pieces, block] if block.strip() else pieces


def _blocks(text: str, min_chars: int = _MIN_BLOCK_CHARS, max_chars: int = _MAX_BLOCK_CHARS) -> list[str]:
    """``text`` cut before each unindented line that follows a blank line; short blocks join the
    next one, long ones are cut at line ends into pieces of at most ``max_chars``."""
    cuts = [0, *(match.end() for match in _TOP_LEVEL.finditer(text)), len(text)]
    blocks: list[str] = []
    pending = ""
    for start, end in itertools.pairwise(cuts):
        pending += text[start:end]
        if len(pending.strip()) >= min_chars:
            blocks += _cut(pending.strip("\n") + "\n", max_chars)
            pending = ""
    if pending.strip():
        blocks += _cut(pending.strip("\n") + "\n", max_chars)
    return blocks


def split_text(text: str, shard: int = 0) -> list[Document]:
    """Plain text as component-0 documents, one per block of paragraphs."""
    return [Document(SOURCE, text=block, shard=shard, index=i) for i, block in enumerate(_blocks(text))]


def _documented_functions(tree: ast.AST) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    """Functions with a docstring, outermost first; the functions nested in one are not visited."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and ast.get_docstring(node):
            yield node
        else:
            yield from _documented_functions(node)


def _dedent(text: str, width: int) -> str:
    """Remove ``width`` leading blanks from each line that has them (other lines stay as they are)."""
    return "".join(line[width:] if not line[:width].strip() else line for line in text.splitlines(True))


def split_python(source: str, max_chars: int, shard: int = 0) -> list[Document]:
    """Python source as chat examples (documented functions of at most ``max_chars``) and source blocks.

    A function's lines from its first decorator to the end of its docstring are
    the prompt, the rest of it the response, both dedented as one. Source
    that does not parse is all component 0.

    Example:
        >>> code = '''import os
        ...
        ...
        ... class A:
        ...     def f(self, x):
        ...         \"\"\"Double x.\"\"\"
        ...         return sum([x, x])
        ... '''
        >>> for document in split_python(code, 200):
        ...     print(document.component, [document.text or document.prompt, document.response])
        1 ['def f(self, x):\\n    \"\"\"Double x.\"\"\"\\n', '    return sum([x, x])\\n']
        0 ['import os\\n\\n\\nclass A:\\n', '']
    """
    try:
        with warnings.catch_warnings():  # e.g. invalid escape sequences in someone else's code
            warnings.simplefilter("ignore")
            tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return split_text(source, shard)
    lines = source.splitlines(keepends=True)
    taken = [False] * len(lines)
    documents: list[Document] = []
    for node in _documented_functions(tree):
        first = min([node.lineno, *(d.lineno for d in node.decorator_list)]) - 1
        split = node.body[0].end_lineno or node.lineno
        end = node.end_lineno or split
        prompt, response = "".join(lines[first:split]), "".join(lines[split:end])
        if len(prompt) + len(response) > max_chars or len(response.strip()) < _MIN_RESPONSE_CHARS:
            continue
        prompt, response = _dedent(prompt, node.col_offset), _dedent(response, node.col_offset)
        documents.append(Document(CHAT, prompt=prompt, response=response, shard=shard))
        taken[first:end] = [True] * (end - first)
    rest = "".join(line for line, used in zip(lines, taken, strict=True) if not used)
    documents += split_text(rest, shard)
    return [Document(d.component, d.text, d.prompt, d.response, shard, i) for i, d in enumerate(documents)]


def _folder_files(root: Path, stdlib: bool) -> list[Path]:
    skipped = _SKIPPED_DIRS | _STDLIB_SKIPPED_DIRS if stdlib else _SKIPPED_DIRS
    files = []
    for path in sorted(root.rglob("*.py" if stdlib else "*")):
        parts = path.relative_to(root).parts
        if path.is_file() and not any(p.startswith(".") or p in skipped for p in parts):
            files.append(path)
    return files


def _size(document: Document) -> int:
    return len(document.text) + len(document.prompt) + len(document.response)


def _read_folder(
    root: Path, *, stdlib: bool, max_chars: int, budget_chars: int, chat_share: float, seed: int
) -> list[Document]:
    """Documents from the files of ``root`` (shuffled), about ``budget_chars`` characters in all.

    Files are read until the chat examples reach ``chat_share`` of the budget
    and the source the rest, or the files run out, or (the source budget met)
    ten budgets' worth of text has been read; then each component is cut to
    its share, the source taking what the chat examples leave.
    """
    files = _folder_files(root, stdlib)
    random.Random(seed).shuffle(files)
    found: dict[int, list[Document]] = {SOURCE: [], CHAT: []}
    sizes = {SOURCE: 0, CHAT: 0}
    wanted = {CHAT: int(budget_chars * chat_share), SOURCE: budget_chars - int(budget_chars * chat_share)}
    for shard, path in enumerate(files):
        if sizes[SOURCE] >= wanted[SOURCE] and (
            sizes[CHAT] >= wanted[CHAT] or sum(sizes.values()) >= 10 * budget_chars
        ):
            break
        data = path.read_bytes()
        if b"\x00" in data:
            continue  # binary
        text = data.decode("utf-8", errors="replace")
        python = path.suffix == ".py"
        for document in split_python(text, max_chars, shard) if python else split_text(text, shard):
            found[document.component].append(document)
            sizes[document.component] += _size(document)
    documents = []
    left = budget_chars
    for component in (CHAT, SOURCE):
        room = min(left, wanted[CHAT]) if component == CHAT else left
        for document in found[component]:
            if room <= 0:
                break
            documents.append(document)
            room -= _size(document)
            left -= _size(document)
    return documents


def read_jsonl(path: Path) -> list[Document]:
    """A JSONL file's documents, in file order: ``{"text": ...}`` or ``{"prompt": ..., "response": ...}``."""
    documents = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        item = json.loads(line)
        if isinstance(item, dict) and isinstance(item.get("text"), str):
            documents.append(Document(SOURCE, text=item["text"], index=number))
        elif isinstance(item, dict) and isinstance(item.get("prompt"), str) and "response" in item:
            prompt, response = item["prompt"], str(item["response"])
            documents.append(Document(CHAT, prompt=prompt, response=response, index=number))
        else:
            raise ValueError(
                f"{path}:{number}: each line must be a JSON object with a 'text' string, or 'prompt' and "
                f"'response' strings; got {line[:80]!r}"
            )
    return documents


def load_documents(
    corpus: str | Path | None = None,
    *,
    max_chars: int = 512,
    budget_chars: int = 10**6,
    chat_share: float = 0.3,
    seed: int = 0,
) -> list[Document]:
    """The documents of ``corpus`` (the standard library's ``.py`` files when ``None``), shuffled.

    A folder gives about ``budget_chars`` characters, ``chat_share`` of them
    chat examples (fewer if its functions run out), read from its files in an
    order shuffled with ``seed``; chat examples have at most ``max_chars``
    characters. A JSONL file is read whole.

    Raises:
        FileNotFoundError: if ``corpus`` does not exist.
        ValueError: if it yields no document, or a JSONL line is malformed.
    """
    path = stdlib_root() if corpus is None else Path(corpus)
    if not path.exists():
        raise FileNotFoundError(
            f"corpus {str(path)!r} does not exist; pass a folder of text files or a JSONL file"
        )
    if path.is_dir():
        documents = _read_folder(
            path,
            stdlib=corpus is None,
            max_chars=max_chars,
            budget_chars=budget_chars,
            chat_share=chat_share,
            seed=seed,
        )
    else:
        documents = read_jsonl(path)
    if not documents:
        raise ValueError(f"corpus {str(path)!r} holds no text; pass a folder of text files or a JSONL file")
    random.Random(seed).shuffle(documents)
    return documents


def to_records(documents: list[Document], tokenizer: ByteTokenizer | None = None) -> list[SampleRecord]:
    """One record per document: ``input_ids`` (BOS ... EOS) and ``loss_mask``, with its metadata.

    The metadata: ``sample_id = (component, shard, index)``, ``lane_id`` the
    component (one lane per mixture component), ``chunk_id`` the file (shard)
    and ``chunk_offset`` the place in it, ``component_sample_counts =
    {component: 1}``. ``pack_flat`` turns these into the rows' component token
    counts.

    Example:
        >>> record = to_records([Document(CHAT, prompt="a", response="b", shard=4, index=2)])[0]
        >>> record.payload["input_ids"].tolist(), record.payload["loss_mask"].tolist()
        ([1, 100, 101, 2], [0, 0, 1, 1])
        >>> record.meta.sample_id, record.meta.lane_id, record.meta.component_sample_counts
        ((1, 4, 2), 1, {1: 1})
    """
    tokenizer = tokenizer or ByteTokenizer()
    records = []
    for doc in documents:
        if doc.component == CHAT:
            prompt = tokenizer.encode(doc.prompt, bos=True)
            response = tokenizer.encode(doc.response, eos=True)
            tokens = np.concatenate([prompt, response])
            mask = np.concatenate([np.zeros(prompt.size, np.int8), np.ones(response.size, np.int8)])
        else:
            tokens = tokenizer.encode(doc.text, bos=True, eos=True)
            mask = np.ones(tokens.size, np.int8)
        meta = SampleMeta(
            sample_id=(doc.component, doc.shard, doc.index),
            lane_id=doc.component,
            chunk_id=doc.shard,
            chunk_offset=doc.index,
            component_sample_counts={doc.component: 1},
        )
        records.append(SampleRecord(meta, {"input_ids": tokens, "loss_mask": mask}))
    return records
