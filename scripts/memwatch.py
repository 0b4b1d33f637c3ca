"""Memory over time, for runs on models larger than RAM (issue 36): every few seconds, the resident
memory of the processes whose command line matches a pattern (anonymous and file-backed apart,
summed over the matching processes: a server and its engine child), the page cache, and
MemAvailable, one tab-separated line each, until stopped (Ctrl-C / SIGTERM) or `--seconds` pass.

    python scripts/memwatch.py --match 'strata_jax|llama-server' --every 5 --out mem.tsv &
    ... the run ...
    python scripts/memwatch.py --plot mem.tsv --out mem.png [--marks ladder.json]

Columns: unix time, processes matched, RSS MiB, RssAnon MiB, RssFile MiB, page cache MiB
(`Cached` of /proc/meminfo), MemAvailable MiB, disk reads MiB since start (the matched processes'
/proc/PID/io read_bytes, the storage they waited on).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
import time
from pathlib import Path

from strata_jax.engine.host_memory import meminfo

COLUMNS = ("time", "procs", "rss_mib", "anon_mib", "file_mib", "cache_mib", "available_mib",
           "read_mib")


def _kib(text: str, key: str) -> int:
    m = re.search(rf"^{key}:\s+(\d+) kB", text, re.MULTILINE)
    return int(m.group(1)) if m else 0


def matching(pattern: re.Pattern) -> list[int]:
    """The pids (not this one) whose command line matches."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if pattern.search(cmd):
            pids.append(int(d.name))
    return pids


def sample(pattern: re.Pattern) -> tuple[int, int, int, int]:
    """(processes, RssAnon KiB, RssFile KiB, bytes read from storage), summed over the matching
    ones."""
    n = anon = file = read = 0
    for pid in matching(pattern):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            io = Path(f"/proc/{pid}/io").read_text()
        except OSError:                              # it ended meanwhile
            continue
        n += 1
        anon += _kib(status, "RssAnon")
        file += _kib(status, "RssFile") + _kib(status, "RssShmem")
        m = re.search(r"^read_bytes:\s+(\d+)", io, re.MULTILINE)
        read += int(m.group(1)) if m else 0
    return n, anon, file, read


def watch(args) -> None:
    pattern = re.compile(args.match)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    with (open(args.out, "w", buffering=1) if args.out else
          open(sys.stdout.fileno(), "w", buffering=1, closefd=False)) as out:
        _watch(pattern, args, stop, out)


def _watch(pattern: re.Pattern, args, stop: list, out) -> None:
    print("\t".join(COLUMNS), file=out)
    start, first_read = time.time(), None
    try:
        while not stop and (args.seconds is None or time.time() - start < args.seconds):
            n, anon, file, read = sample(pattern)
            first_read = read if first_read is None else first_read
            row = (f"{time.time():.1f}", n, (anon + file) // 1024, anon // 1024, file // 1024,
                   (meminfo("Cached") or 0) >> 20, (meminfo("MemAvailable") or 0) >> 20,
                   max(read - first_read, 0) >> 20)
            print("\t".join(str(v) for v in row), file=out)
            time.sleep(args.every)
    except KeyboardInterrupt:
        pass


def plot(args) -> None:
    import json

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [line.split("\t") for line in Path(args.plot).read_text().splitlines()[1:] if line]
    t0 = float(rows[0][0])
    t = [(float(r[0]) - t0) / 60 for r in rows]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for col, label in ((2, "RSS"), (3, "RSS anonymous"), (5, "page cache"), (6, "MemAvailable")):
        ax.plot(t, [int(r[col]) / 1024 for r in rows], label=label)
    ax.set_xlabel("minutes")
    ax.set_ylabel("GiB")
    lines = ax.get_legend_handles_labels()
    if args.marks:        # the ladder's levels (its --json): where each began, its waves' tok/s
        times, rates = [], []
        for level in json.loads(Path(args.marks).read_text()).get("levels", []):
            if "started" not in level:
                continue
            ax.axvline((level["started"] - t0) / 60, color="grey", lw=0.5)
            end = level["started"]
            for wave in level.get("waves", []):       # back to back (prompts are made before)
                end += wave["wall_s"]
                times.append((end - t0) / 60)
                rates.append(wave["aggregate_tps"] or 0)
        if rates:
            ax2 = ax.twinx()
            ax2.plot(times, rates, "k.", ms=4, label="tok/s a wave (generated / wall)")
            ax2.set_ylabel("tok/s")
            ax2.set_ylim(0, max(rates) * 1.3)
            more = ax2.get_legend_handles_labels()
            lines = (lines[0] + more[0], lines[1] + more[1])
    ax.set_title(args.title or Path(args.plot).name)
    ax.legend(*lines, loc="center left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--match", default=r"strata_jax|strata-jax",
                   help="regex on the command line of the processes to sum")
    p.add_argument("--every", type=float, default=5.0, help="seconds between samples")
    p.add_argument("--seconds", type=float, help="stop after this long (default: until stopped)")
    p.add_argument("--out", help="the TSV (default stdout); with --plot, the PNG")
    p.add_argument("--plot", metavar="TSV", help="plot a TSV this script wrote, to --out")
    p.add_argument("--marks", metavar="LADDER.json", help="with --plot: the ladder's levels")
    p.add_argument("--title")
    args = p.parse_args()
    if args.plot:
        if not args.out:
            p.error("--plot needs --out FILE.png")
        plot(args)
    else:
        watch(args)


if __name__ == "__main__":
    main()
