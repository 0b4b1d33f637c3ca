#!/usr/bin/env python3
"""Passed / failed per file of llama.cpp's server tests, before and after, from pytest's JUnit XML
files (docs/LLAMA_SERVER_TESTS.md has the command that makes them).

    python scripts/llama_tests_table.py before.xml after.xml [--failures]

--failures also lists every test that fails after, with the first line of its failure.
"""

from __future__ import annotations

import argparse
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict


def outcomes(path: str) -> dict[str, dict[str, tuple[str, str]]]:
    """file -> test name -> (passed | failed | skipped, the first line of the failure)."""
    out: dict[str, dict[str, tuple[str, str]]] = defaultdict(dict)
    for case in ET.parse(path).getroot().iter("testcase"):
        file = case.get("classname", "").replace(".", "/") + ".py"
        status, why = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                status, why = ("failed", (child.get("message") or child.text
                                          or "").strip().splitlines()[0][:160])
            elif child.tag == "skipped":
                status, why = "skipped", (child.get("message") or "")[:160]
        out[file][case.get("name", "")] = (status, why)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("before")
    p.add_argument("after")
    p.add_argument("--failures", action="store_true")
    args = p.parse_args()
    before, after = outcomes(args.before), outcomes(args.after)
    print("| file | before: passed / failed | after: passed / failed |")
    print("|---|---:|---:|")
    totals = [Counter(), Counter()]
    for file in sorted(set(before) | set(after)):
        cells = []
        for k, run in enumerate((before, after)):
            c = Counter(status for status, _ in run.get(file, {}).values())
            totals[k].update(c)
            skipped = f" ({c['skipped']} skipped)" if c["skipped"] else ""
            cells.append(f"{c['passed']} / {c['failed']}{skipped}")
        print(f"| `{file}` | {cells[0]} | {cells[1]} |")
    b, a = totals
    print(f"| all | {b['passed']} / {b['failed']} | {a['passed']} / {a['failed']} |")
    if args.failures:
        for file in sorted(after):
            for name, (status, why) in sorted(after[file].items()):
                if status == "failed":
                    print(f"{file}::{name}: {why}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
