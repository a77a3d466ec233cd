"""Write the configs a `bench_kernels.py` run tuned into the kernel modules' tables, so later
runs (and the runtime) use them without tuning:

    python3 benchmarks/gpu/apply_tuned.py RUN_OUTPUT.txt [--dry-run]

The run ends with lines such as ``#   mla_decode.DECODE_CONFIGS[('bf16', 256, 1024)] = {...}``;
each sets that key of the dict literal ``DECODE_CONFIGS`` in ``kernels/mla_decode.py``
(other keys stay). Top-k's are keyed (rows, row length); an older run's
``topk.TOPK_CONFIGS[64] (n=32768)`` is read as key (64, 32768). Prints what changed.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

KERNELS = Path(__file__).resolve().parents[2] / "kernels"
TUNED = re.compile(r"^\s+tuned (.+?): best ")
ALONE = re.compile(r"^\s+tuned (.+?): best .* \(of 1: ")
LINE = re.compile(r"^#\s+(\w+)\.(\w+)\[(.+?)\](?: \(n=(\d+)\))? = (\{.*\})\s*$")


def tuned(lines) -> dict[tuple[str, str], dict]:
    """(module, table) -> {key: config} from a run's output. A config timed alone (the tuning
    ran out of time after the committed one, or ran with --no-tune) was not tuned: skipped."""
    out: dict[tuple[str, str], dict] = {}
    alone: set[str] = set()  # as of the latest "tuned" line of each name (outputs may be concatenated)
    for line in lines:
        tuned_line = TUNED.match(line)
        if tuned_line:
            (alone.add if ALONE.match(line) else alone.discard)(tuned_line.group(1))
            continue
        m = LINE.match(line)
        if m and line.split(" = ", 1)[0].replace("#", "").strip() in alone:
            continue
        if not m:
            continue
        module, table, key, n, cfg = m.groups()
        value = ast.literal_eval(cfg)
        if "error" in value:
            continue
        key = ast.literal_eval(key)
        if n is not None:  # the older form: the row length outside the brackets
            key = (key, int(n))
        out.setdefault((module, table), {})[key] = value
    return out


def rewrite(path: Path, table: str, updates: dict, dry_run: bool) -> list[str]:
    """Set `updates` in the dict literal `table` of `path` (one entry per line)."""
    src = path.read_text().splitlines(keepends=True)
    head = re.compile(rf"^{table}(: [^=]+)? = \{{\s*$")
    start = next((i for i, s in enumerate(src) if head.match(s)), None)
    if start is None:
        raise SystemExit(f"{path}: no dict literal `{table} = {{` at the start of a line")
    end = next(i for i in range(start, len(src)) if src[i].rstrip() == "}")
    current = ast.literal_eval("{" + "".join(src[start + 1:end]) + "}")
    changed = [f"{table}[{k!r}]: {current.get(k)} -> {v}" for k, v in updates.items() if current.get(k) != v]
    current.update(updates)
    body = [f"    {k!r}: {v!r},\n" for k, v in current.items()]
    if changed and not dry_run:
        path.write_text("".join(src[:start + 1] + body + src[end:]))
    return changed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("output", help="a bench_kernels.py run's output (stdout)")
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args()
    found = tuned(Path(args.output).read_text().splitlines())
    if not found:
        sys.exit(f"{args.output}: no tuned-config lines")
    for (module, table), updates in found.items():
        for change in rewrite(KERNELS / f"{module}.py", table, updates, args.dry_run):
            print(f"{module}: {change}")


if __name__ == "__main__":
    main()
