"""A long fuzz campaign: the properties of tests/test_invariants.py with many more examples.

Not part of CI: pytest collects ``test_*.py`` files only, and importing this
module (``--doctest-modules`` does) runs nothing. Run it from the repository
root::

    python tests/fuzz/fuzz_to_training.py --seconds 300
    python tests/fuzz/fuzz_to_training.py --examples 50000 --max-corruptions 5

It cycles through the properties in rounds of ``--round`` examples each, with
fresh randomness every round, until ``--examples`` cases were tried or
``--seconds`` passed. A failing round is shrunk by hypothesis, recorded (one
entry per distinct error and place) and the campaign goes on. It prints the
cases tried, how many ended in a documented error or a checked output, and the
failures found; the exit status is 1 if any.

Properties:

- ``to_training``: any batch and options (``hostile_batches``) through
  to_training, SampleBatch.to_training, Collator and Collator.stack/finish: a
  documented error (the same from each) or the reference's output with every
  invariant; inputs unchanged.
- ``pack_flat``: any documents into pack_flat: a documented error, or rows
  holding every token that to_training accepts.
- ``transforms``: any TensorDict into any transform: a documented error or an
  output; the input unchanged.
- ``floats``: whole-number floats near and beyond every integer output dtype's
  range: exact, or a documented ValueError (tests/test_hostile.py).
- ``eos``: ``eos_token_id`` against every output dtype, the NumPy and the torch
  path equal and equal to the reference, or a documented ValueError.
- ``paths``: to_training through the NumPy twins against the torch kernels
  over the option space.
- ``states``: a packer state with junk at a random key: a documented error
  naming the state, or valid rows.
- ``narrow``: narrow payload dtypes through the Collator's padding: the int64
  payloads' batch, or the same documented error.
- ``fields``: packing with any ``fields=``: tokens kept, ``overflow="auto"``
  refusing a long document with a prompt whatever is packed.
- ``hf``: Hugging Face field combinations (``tests/test_hf_peers.py``) through
  ``Collator.for_transformers`` and the collator it replaces
  (``DataCollatorForSeq2Seq``, ``DataCollatorWithFlattening``,
  ``DataCollatorForLanguageModeling``, TRL's): equal batches, both refusing, or
  a documented difference (needs ``transformers`` and ``trl``; left out without).
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import sys
import time
import traceback
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent


def _load():
    """Import the properties (tests/ on the path, as pytest's ``pythonpath`` setting has it)."""
    for path in (str(TESTS), str(TESTS.parent)):
        if path not in sys.path:
            sys.path.insert(0, path)
    import test_hostile
    import test_invariants
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st
    from strategies import hostile_batches

    return test_invariants, test_hostile, HealthCheck, Phase, given, settings, st, hostile_batches


def build_properties(max_corruptions: int, outcomes: collections.Counter, tried: collections.Counter) -> dict:
    """name -> function(settings) returning a hypothesis test of that property for one round."""
    inv, hostile, _, _, given, _, st, hostile_batches = _load()
    batches = hostile_batches(max_corruptions=max_corruptions)

    def to_training_round(config):
        @config
        @given(spec=batches)
        def run(spec):
            tried["to_training"] += 1
            outcomes["to_training", inv.check_case(spec)] += 1

        return run

    def pack_flat_round(config):
        @config
        @given(spec=batches, seq_len=st.integers(1, 9), strategy=st.sampled_from(["greedy", "best_fit"]))
        def run(spec, seq_len, strategy):
            tried["pack_flat"] += 1
            spec.pop("not_records", None)
            outcomes["pack_flat", inv.check_pack_case(spec, seq_len, strategy)] += 1

        return run

    def transforms_round(config):
        @config
        @given(td=inv.hostile_tensordicts(), index=st.integers(0, len(inv.TRANSFORMS) - 1))
        def run(td, index):
            tried["transforms"] += 1
            inv.check_transform_case(td, index)
            outcomes["transforms", "checked"] += 1

        return run

    def hostile_round(name, strategy, check):
        def make(config):
            @config
            @given(case=strategy)
            def run(case):
                tried[name] += 1
                outcomes[name, check(*case)] += 1

            return run

        return make

    def hf_round(config):
        import test_hf_peers  # transformers and TRL: imported for this property only

        return hostile_round("hf", test_hf_peers.hf_cases(), test_hf_peers.check_hf_case)(config)

    return {
        "hf": hf_round,
        "to_training": to_training_round,
        "pack_flat": pack_flat_round,
        "transforms": transforms_round,
        "floats": hostile_round("floats", hostile.float_cases(), hostile.check_float_case),
        "eos": hostile_round("eos", hostile.eos_cases(), hostile.check_eos_case),
        "paths": hostile_round("paths", hostile.path_cases(), hostile.check_paths_case),
        "states": hostile_round("states", hostile.corrupt_states(), hostile.check_state_case),
        "narrow": hostile_round("narrow", hostile.narrow_padding_cases(), hostile.check_narrow_padding_case),
        "fields": hostile_round("fields", hostile.packing_field_cases(), hostile.check_packing_fields_case),
    }


def signature(error: BaseException) -> str:
    """One line per distinct failure: the error and the innermost place in zephon_collate or the tests."""
    frames = traceback.extract_tb(error.__traceback__)
    ours = [f for f in frames if "zephon_collate" in f.filename or "/tests/" in f.filename] or frames
    place = f"{Path(ours[-1].filename).name}:{ours[-1].lineno}" if ours else "?"
    first = str(error).splitlines()[0][:160] if str(error) else ""
    return f"{type(error).__name__} at {place}: {first}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--examples", type=int, default=None, help="stop after this many cases (all properties)"
    )
    parser.add_argument("--seconds", type=float, default=None, help="stop after this many seconds")
    parser.add_argument("--round", type=int, default=500, help="examples per hypothesis round (default 500)")
    parser.add_argument(
        "--max-corruptions", type=int, default=3, help="corruptions per generated batch (default 3)"
    )
    parser.add_argument(
        "--property",
        action="append",
        choices=[
            "to_training",
            "pack_flat",
            "transforms",
            "floats",
            "eos",
            "paths",
            "states",
            "narrow",
            "fields",
            "hf",
        ],
        help="run only these properties (repeatable; default all, to_training weighted 3)",
    )
    args = parser.parse_args(argv)
    if args.examples is None and args.seconds is None:
        args.seconds = 60.0
    _, _, HealthCheck, Phase, _, settings, _, _ = _load()
    outcomes: collections.Counter = collections.Counter()
    tried: collections.Counter = collections.Counter()
    properties = build_properties(args.max_corruptions, outcomes, tried)
    peers = all(importlib.util.find_spec(name) for name in ("transformers", "trl"))
    names = args.property or [
        *["to_training"] * 3,
        *["pack_flat", "transforms", "floats", "eos", "paths", "states", "narrow", "fields"],
        *(["hf"] if peers else []),
    ]
    failures: dict[str, tuple[str, int]] = {}
    start = last_report = time.monotonic()
    rounds = 0

    def done() -> bool:
        over_time = args.seconds is not None and time.monotonic() - start >= args.seconds
        over_count = args.examples is not None and sum(tried.values()) >= args.examples
        return over_time or over_count

    while not done():
        name = names[rounds % len(names)]
        rounds += 1
        size = args.round
        if args.examples is not None:
            size = max(1, min(size, args.examples - sum(tried.values())))
        config = settings(
            max_examples=size,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
            phases=[Phase.generate, Phase.shrink],
        )
        before = sum(tried.values())
        try:
            properties[name](config)()
        except KeyboardInterrupt:
            break
        except Exception as error:  # a failure of the property: record it, go on
            errors = list(getattr(error, "exceptions", [error]))  # hypothesis groups distinct failures
            for item in errors:
                key = f"[{name}] {signature(item)}"
                notes = "\n".join(getattr(item, "__notes__", []))
                previous = failures.get(key, (notes, 0))
                failures[key] = (previous[0], previous[1] + 1)
            if sum(tried.values()) == before:
                print(f"round {rounds}: {name} could not run a single case; stopping", flush=True)
                break
        if time.monotonic() - last_report >= 10 or done():
            last_report = time.monotonic()
            print(
                f"round {rounds:4d}  cases {sum(tried.values()):8d}  failures {len(failures):3d}  "
                f"{last_report - start:7.1f} s",
                flush=True,
            )
    elapsed = time.monotonic() - start
    print()
    print(f"cases tried: {sum(tried.values())} in {elapsed:.0f} s ({rounds} rounds)")
    for name in sorted(tried):
        detail = ", ".join(
            f"{outcome} {count}" for (prop, outcome), count in sorted(outcomes.items()) if prop == name
        )
        print(f"  {name:11s} {tried[name]:8d}  ({detail})")
    print(f"failures found: {len(failures)}")
    for key, (notes, count) in failures.items():
        print(f"- {key} (x{count})")
        for line in notes.splitlines()[:40]:
            print(f"    {line}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
