"""Command line of zephon_collate.

  python -m demo demo [--steps N] [--seq-len N] [--batch-size N] [--corpus PATH]
                                [--device DEV] [--compile] [--out DIR]
      train a small language model on the standard library's source, through the whole package
  python -m demo show (--demo-batch | --tree-batch | FILE.jsonl | FILE.pt) [--png PATH] [--no-color] ...
      render a collated batch token by token (a tree batch node by node), with warnings

See docs/demo.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {text}")
    return value


def _token(text: str) -> tuple[int, int]:
    """``PLACE`` (row 0) or ``ROW:PLACE``."""
    try:
        parts = [int(part) for part in text.split(":")]
    except ValueError:
        parts = []
    if len(parts) not in (1, 2) or min(parts) < 0:
        raise argparse.ArgumentTypeError(f"must be PLACE or ROW:PLACE (ints >= 0), got {text}")
    return (0, parts[0]) if len(parts) == 1 else (parts[0], parts[1])


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser(
        "demo",
        help="train a small language model on the standard library's source (a few minutes on a CPU)",
        description="Train a byte-level transformer on packed documents: corpus -> pack_flat -> DataLoader "
        "workers + Collator -> document-masked attention. Writes OUT/loss_curve.png.",
    )
    demo.add_argument("--corpus", help="a folder of text files or a JSONL file (default: the Python stdlib)")
    demo.add_argument("--seq-len", type=_positive, default=256, help="model input length (default 256)")
    demo.add_argument("--steps", type=_positive, default=200, help="optimizer steps (default 200)")
    demo.add_argument("--batch-size", type=_positive, default=12, help="rows per step (default 12)")
    demo.add_argument("--device", help="torch device (default: cuda when available, else cpu)")
    demo.add_argument("--compile", action="store_true", help="torch.compile the model and the collator")
    demo.add_argument("--out", default="out", help="folder for loss_curve.png (default ./out)")
    demo.add_argument("--workers", type=int, default=2, help="DataLoader worker processes (default 2)")
    demo.add_argument(
        "--threads",
        type=_positive,
        help="CPU threads for torch (default: the cores this process may use, less one)",
    )
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--no-progress", action="store_true", help="no progress bar")

    show = commands.add_parser(
        "show",
        help="render a collated batch token by token (terminal colours, or a PNG)",
        description="Render a collated batch: per token its input, label, supervision, padding, position "
        "and segment starts, with warnings. FILE.jsonl: one record per line, either text "
        '({"text": ...} or {"prompt": ..., "response": ...}, byte-tokenized as in the demo) or tokens '
        '({"input_ids": [...], optional "loss_mask", "positions"}); they are packed into rows of --seq-len '
        "+ 1 tokens (or kept one per row with --no-pack) and collated. FILE.pt: a batch saved with "
        "torch.save(batch_dict), shown as it is. A tree batch (Collator.for_trees, or shared_prompt=True) is "
        "drawn as its trees, node by node, with what each token attends to.",
    )
    source = show.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "file", nargs="?", help="a .jsonl file of records or a .pt file holding a collated batch"
    )
    source.add_argument("--demo-batch", action="store_true", help="a batch of the demo's pipeline")
    source.add_argument(
        "--tree-batch",
        action="store_true",
        help="a small tree batch: five byte-tokenized answers to two prompts, shared prefixes laid out once "
        "(Collator.for_trees)",
    )
    show.add_argument("--corpus", help="with --demo-batch: the demo's --corpus")
    show.add_argument("--seq-len", type=_positive, default=128, help="packed row length (default 128)")
    show.add_argument("--batch-size", type=_positive, default=4, help="rows in the batch (default 4)")
    show.add_argument(
        "--min-documents",
        type=_positive,
        default=1,
        help="--demo-batch: only rows packing this many documents",
    )
    show.add_argument("--no-pack", action="store_true", help="FILE.jsonl: one record per row, right-padded")
    show.add_argument(
        "--trees",
        action="store_true",
        help="FILE.jsonl: every record is a trajectory (prompt/response text, or input_ids, completion_mask "
        "and an optional group), collated by Collator.for_trees",
    )
    show.add_argument(
        "--token",
        type=_token,
        metavar="[ROW:]PLACE",
        help="a tree batch: show this token in full, with its paths and every token it attends to",
    )
    show.add_argument(
        "--overflow",
        choices=("auto", "split", "truncate"),
        default="auto",
        help="FILE.jsonl: pack_flat's overflow= for records longer than a row (default auto)",
    )
    show.add_argument("--pad-id", type=int, default=0, help="token records: the padding id (default 0)")
    show.add_argument("--eos-id", type=int, help="token records: mask labels after this EOS id")
    show.add_argument(
        "--tokenizer", choices=("byte", "ids"), help="show tokens as bytes or ids (default: byte for text)"
    )
    show.add_argument("--rows", type=_positive, help="show only the first ROWS rows")
    show.add_argument("--max-tokens", type=_positive, help="show only the first MAX_TOKENS tokens of a row")
    show.add_argument("--width", type=_positive, help="wrap at this width (default: the terminal's)")
    show.add_argument(
        "--no-color", action="store_true", help="plain text (also when not a terminal, or NO_COLOR)"
    )
    show.add_argument("--png", help="also draw the batch into this PNG file (needs matplotlib)")
    show.add_argument("--seed", type=int, default=0)
    return parser


def _run_demo(args: argparse.Namespace) -> int:
    from demo.train import DemoConfig, run_demo

    config = DemoConfig(
        corpus=args.corpus,
        seq_len=args.seq_len,
        steps=args.steps,
        batch_size=args.batch_size,
        device=args.device,
        compile=args.compile,
        out=args.out,
        workers=args.workers,
        seed=args.seed,
        progress=not args.no_progress,
        threads=args.threads,
    )
    run_demo(config)
    return 0


def _jsonl_batch(args: argparse.Namespace) -> tuple[dict[str, Any], bool]:
    """The collated batch of a JSONL file's records, and whether they were text (byte-tokenized)."""
    from demo.corpus import read_jsonl, to_records
    from demo.tokenizer import EOS, PAD
    from zephon_collate import Collator, SampleMeta, SampleRecord, pack_flat

    lines = [line for line in Path(args.file).read_text(encoding="utf-8").splitlines() if line.strip()]
    items = [json.loads(line) for line in lines]
    if not items:
        raise ValueError(f"{args.file} holds no records")
    texts = all(isinstance(item, dict) and ("text" in item or "prompt" in item) for item in items)
    if texts:
        records, pad_id, eos_id = to_records(read_jsonl(Path(args.file))), PAD, EOS
    else:
        records = [SampleRecord(SampleMeta((0, 0, i), 0, 0, i), item) for i, item in enumerate(items)]
        pad_id, eos_id = args.pad_id, args.eos_id
    if args.no_pack:
        records = _pad_records(records, pad_id)
    else:
        records = pack_flat(
            records, args.seq_len + 1, pad_token_id=pad_id, strategy="greedy", overflow=args.overflow
        )
    has_positions = all(isinstance(r.payload, dict) and "positions" in r.payload for r in records)
    collator = Collator(
        return_labels=True,
        return_loss_mask=True,
        return_padding_mask=True,
        return_cu_seqlens=has_positions,
        eos_mask_loss=eos_id is not None,
        eos_token_id=eos_id,
    )
    return collator(records[: args.batch_size]), texts


def _trajectories(tokenizer: Any) -> list[dict[str, Any]]:
    """``--tree-batch``'s examples: answers to two prompts, some sharing their first tokens."""
    answers = {"Q:2+2? ": ["A:4", "A:four", "A:4, sure"], "Q:hi ": ["A:hello", "A:hey"]}
    examples = []
    for group, (prompt, responses) in enumerate(answers.items()):
        for response in responses:
            head, tail = tokenizer.encode(prompt, bos=True), tokenizer.encode(response, eos=True)
            mask = [0] * head.size + [1] * tail.size
            examples.append({"input_ids": [*head, *tail], "completion_mask": mask, "group": group})
    return examples


def _jsonl_trees(args: argparse.Namespace) -> tuple[dict[str, Any], bool]:
    """``FILE.jsonl --trees``: the records as trajectories, collated by ``Collator.for_trees``."""
    from demo.corpus import read_jsonl, to_records
    from zephon_collate import Collator

    lines = [line for line in Path(args.file).read_text(encoding="utf-8").splitlines() if line.strip()]
    items = [json.loads(line) for line in lines]
    if not items:
        raise ValueError(f"{args.file} holds no records")
    texts = all(isinstance(item, dict) and ("text" in item or "prompt" in item) for item in items)
    if texts:
        records = to_records(read_jsonl(Path(args.file)))
        items = [
            {"input_ids": r.payload["input_ids"].tolist(), "completion_mask": r.payload["loss_mask"].tolist()}
            for r in records
        ]
    return Collator.for_trees()(items), texts


def _pad_records(records: list[Any], pad_id: int) -> list[Any]:
    """Records right-padded to the longest, with their ``_padding_length`` tag (for ``--no-pack``)."""
    import numpy as np

    from zephon_collate import SampleMeta, SampleRecord
    from zephon_collate.core.keys import TOKEN_FIELD_CANDIDATES

    def tokens_of(payload: dict[str, Any]) -> str:
        return next(name for name in TOKEN_FIELD_CANDIDATES if name in payload)

    longest = max(len(r.payload[tokens_of(r.payload)]) for r in records)
    padded = []
    for record in records:
        name = tokens_of(record.payload)
        missing = longest - len(record.payload[name])
        payload = {}
        for key, value in record.payload.items():
            if isinstance(value, (list, np.ndarray)) and len(value) == len(record.payload[name]):
                fill = pad_id if key == name else 0
                value = np.concatenate([np.asarray(value), np.full(missing, fill, np.asarray(value).dtype)])
                if key == "positions" and missing:
                    value[-missing:] = np.arange(missing)
            payload[key] = value
        meta = record.meta
        tags = {**meta.tags, "_padding_length": missing}
        padded.append(
            SampleRecord(SampleMeta(meta.sample_id, meta.lane_id, meta.chunk_id, tags=tags), payload)
        )
    return padded


def _run_show(args: argparse.Namespace) -> int:
    from demo.tokenizer import ByteTokenizer
    from zephon_collate.inspection.render import render_batch, render_batch_png
    from zephon_collate.inspection.tree_render import render_tree
    from zephon_collate.inspection.trees import is_tree_batch

    if args.demo_batch:
        from demo.pipeline import demo_batch

        sizes = {"seq_len": args.seq_len, "batch_size": args.batch_size, "min_documents": args.min_documents}
        batch = demo_batch(args.corpus, **sizes, seed=args.seed)
        text = True
    elif args.tree_batch:
        from zephon_collate import Collator

        batch, text = Collator.for_trees()(_trajectories(ByteTokenizer())), True
    elif args.file.endswith(".pt"):
        import torch

        batch, text = torch.load(args.file, weights_only=True), False
    elif args.trees:
        batch, text = _jsonl_trees(args)
    else:
        batch, text = _jsonl_batch(args)
    byte = args.tokenizer == "byte" or (args.tokenizer is None and text)
    tokenizer = ByteTokenizer() if byte else None
    color = not args.no_color and sys.stdout.isatty() and not os.environ.get("NO_COLOR")
    width = args.width or shutil.get_terminal_size((100, 24)).columns
    limits = {"max_rows": args.rows, "max_tokens": args.max_tokens}
    if is_tree_batch(batch):
        tree = {"max_rows": args.rows, "max_node_tokens": args.max_tokens, "token": args.token}
        print(render_tree(batch, tokenizer, color=color, width=width, **tree))
    elif args.token is not None:
        raise ValueError("--token needs a tree batch (Collator.for_trees, or a shared-prompt batch)")
    else:
        print(render_batch(batch, tokenizer, color=color, width=width, **limits))
    if args.png:
        title = (
            f"demo batch, seq_len {args.seq_len}"
            if args.demo_batch
            else "tree batch, 5 answers to 2 prompts"
            if args.tree_batch
            else Path(args.file).name
        )
        limits = {"max_rows": args.rows or 4, "max_tokens": args.max_tokens or 128}
        path = render_batch_png(batch, args.png, tokenizer, title=f"zephon_collate show: {title}", **limits)
        print(f"wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    if getattr(args, "corpus", None) and not Path(args.corpus).exists():
        parser.error(f"--corpus {args.corpus}: no such file or folder")
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(errors="backslashreplace")
    try:
        if args.command == "demo":
            return _run_demo(args)
        try:
            return _run_show(args)
        except (OSError, ValueError, TypeError, KeyError) as error:  # bad input: one line, no traceback
            if isinstance(error, BrokenPipeError):
                raise
            message = error.args[0] if isinstance(error, KeyError) and error.args else error
            print(f"python -m demo show: error: {message}", file=sys.stderr)
            return 2
    except BrokenPipeError:  # e.g. piped into head: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
