"""The host and file tiers on real GGUF files (experts/host.py): the RAM budget held to the byte by
the tier's own accounting, file reads (pread on the part's descriptor) giving the file's exact
blocks from many threads at once, and a part truncated under the tier an ExpertReadError naming the
file, layer and expert, while what RAM holds is still served."""

from __future__ import annotations

import os
import shutil
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from strata_jax.experts.host import ExpertReadError, HostTier
from strata_jax.gguf import GGUFModel

MOE = {"arch": "qwen3moe", "layers": 2, "hidden": 64, "experts": 8, "experts_used": 2,
       "expert_ffn": 64, "split": 2}


def _tier(path, budget_experts: float | None, workers: int = 4) -> tuple[HostTier, GGUFModel]:
    model = GGUFModel.open(path)
    probe = HostTier(model, list(model.spec.moe_layers), 0, 1)
    one = probe.expert_bytes[0]
    probe.close()
    budget = None if budget_experts is None else int(budget_experts * one)
    return HostTier(model, list(model.spec.moe_layers), budget, workers), model


def _copy_parts(src, folder):
    """Every part of the model whose part 1 is `src`, copied into `folder` -> the copy's part 1."""
    for p in src.parent.iterdir():
        shutil.copy(p, folder / p.name)
    return folder / src.name


def test_the_ram_budget_is_held_to_the_byte(tiny_model):
    path = tiny_model(**MOE)
    for experts in (0, 1, 5.5, 11, 16):
        tier, _ = _tier(path, experts)
        one = tier.expert_bytes[0]
        budget = int(experts * one)
        assert tier.resident_bytes <= budget < tier.resident_bytes + one, experts
        assert tier.resident_bytes == len(tier.resident) * one == sum(
            a.nbytes for blocks in tier.resident.values() for a in blocks.values())
        tier.close()


def test_file_reads_from_many_threads_give_the_files_blocks(tiny_model):
    path = tiny_model(**MOE)
    tier, model = _tier(path, 3, workers=4)          # 3 experts of layer 0 in RAM, 13 in the file
    wanted = [(layer, e) for layer in (0, 1) for e in range(8)] * 4

    def fetch(pair):
        layer, e = pair
        return pair, tier.get(layer, [e])[0]

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(fetch, wanted))
    names = {"exp_gate": "gate", "exp_up": "up", "exp_down": "down"}
    for (layer, e), blocks in got:
        for n, a in blocks.items():
            t = model.tensors[f"blk.{layer}.ffn_{names[n]}_exps.weight"]
            assert np.array_equal(a, t.data[e]) and a.ctypes.data % 64 == 0, (layer, e, n)
    from_file = sum(1 for (layer, e), _ in got if tier.tier_of(layer, e) == "file")
    assert tier.file_reads == from_file == 4 * 13
    assert tier.file_bytes == from_file * tier.expert_bytes[0]
    tier.close()


def test_a_part_truncated_under_the_tier_is_a_clear_error_and_ram_still_serves(tiny_model,
                                                                              tmp_path):
    path = _copy_parts(tiny_model(**MOE), tmp_path)   # a copy of both parts, to cut one of them
    tier, model = _tier(path, 2)                     # experts 0 and 1 of layer 0 in RAM
    last = model.tensors["blk.1.ffn_down_exps.weight"]
    cut_at = last.offset + 5 * last.data[0].nbytes   # expert 5 of layer 1 onwards is gone
    os.truncate(last.path, cut_at)
    with pytest.raises(ExpertReadError) as e:
        tier.get(1, [6])
    msg = str(e.value)
    assert str(last.path) in msg and "expert 6 of layer 1" in msg and "truncated" in msg, msg
    assert tier.get(1, [0])[0]["exp_down"].shape == last.data[0].shape      # before the cut
    assert tier.get(0, [1])[0]["exp_gate"] is tier.resident[(0, 1)]["exp_gate"]   # RAM
    tier.close()


def _on_disk(tmp_path):
    """A folder on a disk-backed file system (a tmpfs's pages cannot be dropped from the cache):
    tmp_path unless /proc/mounts says it is tmpfs, else a folder beside the tests."""
    best, fstype = "", ""
    with open("/proc/mounts") as f:
        for line in f:
            _, point, kind = line.split()[:3]
            if str(tmp_path).startswith(point) and len(point) > len(best):
                best, fstype = point, kind
    if fstype != "tmpfs":
        return tmp_path, None
    import tempfile
    from pathlib import Path

    d = Path(tempfile.mkdtemp(dir=Path(__file__).parent))
    return d, d


def _cached(path, start: int, end: int) -> tuple[int, int]:
    """(pages in the page cache, pages) of the whole pages of `path` inside bytes [start, end):
    mincore(2) on a fresh map of the file, which itself loads nothing."""
    import ctypes
    import mmap

    page = mmap.PAGESIZE
    first, last = -(-start // page), end // page
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    size = os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        vec = (ctypes.c_ubyte * (last - first))()
        assert libc.mincore(ctypes.c_void_p(addr + first * page),
                            ctypes.c_size_t((last - first) * page), vec) == 0, ctypes.get_errno()
        libc.munmap(ctypes.c_void_p(addr), ctypes.c_size_t(size))
    finally:
        os.close(fd)
    return sum(v & 1 for v in vec), last - first


def test_what_ram_holds_leaves_the_page_cache(tiny_model, tmp_path):
    """The host tier's copies are the only copies: the file's pages of the experts RAM holds leave
    the page cache (posix_fadvise DONTNEED) and the process's map; the rest stay cached. Experts
    of 136 KiB here: the page cache keeps large folios, and a folio that reaches past the range (or
    holds a page still mapped) stays, so only the range's two ends may remain."""
    folder, made = _on_disk(tmp_path)
    try:
        path = _copy_parts(tiny_model(**dict(MOE, hidden=256, expert_ffn=512)), folder)
        for p in folder.glob("*.gguf"):
            with open(p, "rb") as f:                      # written back (a dirty page cannot be
                os.fsync(f.fileno())                      # dropped), then every page cached
                f.read()
        tier, model = _tier(path, 5)     # experts 0-4 of layer 0 in RAM
        for name in ("gate", "up", "down"):
            t = model.tensors[f"blk.0.ffn_{name}_exps.weight"]
            one = t.data[0].nbytes
            held = _cached(t.path, t.offset, t.offset + 5 * one)
            rest = _cached(t.path, t.offset + 5 * one, t.offset + 8 * one)
            assert held[1] >= 160 and held[0] * 10 < held[1], (name, held)
            assert rest[0] == rest[1] > 0, (name, rest)
        tier.close()
    finally:
        if made is not None:
            shutil.rmtree(made)


def test_reading_the_model_file_is_progress_for_the_heartbeat(tmp_path):
    """A window of a model larger than RAM waits on its file (the file tier's preads, the memory
    map's page faults): the worker's heartbeat counts storage reads as progress (worker_process.
    storage_reads grows by what the disk served), so the watchdog never kills a slow but moving
    engine; the loop's own turns and program builds count as before."""
    from strata_jax.serve.worker.worker_process import storage_reads, stuck_seconds

    folder, made = _on_disk(tmp_path)
    try:
        path = folder / "blob"
        with open(path, "wb") as f:
            f.write(os.urandom(8 << 20))
            f.flush()
            os.fsync(f.fileno())
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)        # the next read is the disk's
        before = storage_reads()
        os.pread(fd, 8 << 20, 0)
        after = storage_reads()
        os.close(fd)
        assert before is not None and after - before >= 8 << 20
    finally:
        if made is not None:
            shutil.rmtree(made)
    assert stuck_seconds(100.0, loop_turn_at=10.0, reading_at=0.0, building=False) == 90.0
    assert stuck_seconds(100.0, loop_turn_at=10.0, reading_at=97.5, building=False) == 2.5
    assert stuck_seconds(100.0, loop_turn_at=10.0, reading_at=0.0, building=True) == 0.0


def test_a_part_cut_under_a_running_server_fails_the_requests_that_read_it_and_serves_on(
        tiny_model, tmp_path):
    """The real server, every expert in the file (`--resident-budget-gib 0`, read by pread:
    `--host-experts off`, so no window computes from the file's memory map). Part 1 cut inside layer
    0's down experts: a request whose window must read one of them ends with an error naming the
    file, layer and expert; the engine goes on (no restart) and, the file whole again, answers as
    before. A part removed from its folder is still read, through the engine's open descriptor."""
    import httpx
    import openai

    from strata_jax.serve.launch import ServerProcess

    path = _copy_parts(tiny_model(**MOE), tmp_path)
    tensors = GGUFModel.open(path).tensors
    down = tensors["blk.0.ffn_down_exps.weight"]
    cut_at = down.offset + 2 * down.data[0].nbytes    # experts 2-7 of layer 0's down blocks gone
    # and nothing else the engine reads from the file after loading (norms are copied at load)
    beyond = [t.name for t in tensors.values() if t.path == down.path
              and t.offset + t.n_bytes > cut_at and t is not down and len(t.shape) > 1]
    assert beyond == [], beyond
    whole = down.path.read_bytes()
    args = [str(path), "--parallel", "2", "--max-context", "128", "--expert-cache", "2",
            "--resident-budget-gib", "0", "--host-experts", "off", "--pool-workers", "2"]
    with ServerProcess(args) as srv:
        srv.wait_ready()
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0,
                               timeout=120)

        def complete(prompt: str) -> str:
            return client.completions.create(model="m", prompt=prompt, max_tokens=8,
                                             temperature=0).choices[0].text

        prompts = [f"{i} the quick brown fox jumps over the lazy dog {i}" for i in range(3)]
        answers = [complete(p) for p in prompts]
        os.truncate(down.path, cut_at)
        with pytest.raises(openai.APIError) as e:
            # a new prompt routes its 12 tokens to more experts than the 2 slots hold
            complete("an unseen prompt of a dozen words needs experts the cache lacks")
        msg = str(e.value)
        assert down.path.name in msg and "of layer 0" in msg and "truncated" in msg, msg
        assert srv.health().status_code == 200
        down.path.write_bytes(whole)
        assert [complete(p) for p in prompts] == answers
        # a part that vanishes from its folder is still read through the descriptor the engine
        # holds (the file lives until it is closed)
        moved = down.path.with_name("moved.gguf")
        down.path.rename(moved)
        complete("yet another prompt that the cache has not seen before, to read experts")
        moved.rename(down.path)
        metrics = httpx.get(srv.url + "/metrics").text
        assert "strata_engine_restarts_total 0.0" in metrics
        assert len(srv.engine_pids()) == 1
        assert "expert tiers: " in srv.log() and "MiB a token)" in srv.log()
