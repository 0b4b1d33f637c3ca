"""Expert-tier counters: since start and per request, with Strata's two log lines."""

from __future__ import annotations

from dataclasses import dataclass, fields

GiB = 1 << 30


@dataclass
class ExpertCounters:
    # (layer, expert) pairs a window needed (each once a window and layer)
    lookups: int = 0
    hits: int = 0              # ... found in the device arena
    misses_host: int = 0       # ... copied to the device from host RAM
    misses_file: int = 0       # ... read from the GGUF file first
    decode_lookups: int = 0    # the same for windows without a prompt chunk
    decode_hits: int = 0
    decode_misses: int = 0
    routed: int = 0            # token-to-expert assignments (tokens x top-k)
    bytes_moved: int = 0       # bytes copied into the arena
    evictions: int = 0
    # extra passes: a layer that needed more experts than the arena has slots
    passes: int = 0
    prefetched: int = 0        # experts copied in ahead of their layer by prefetch (not in lookups)
    # lookups that found an expert prefetch had brought (counted in hits too)
    prefetch_hits: int = 0
    # lookups computed from the host tier's blocks (--host-experts), not copied in (window, layer)
    # pairs whose experts were computed there
    host_computed: int = 0
    host_layers: int = 0
    one_program: int = 0       # windows run as one program (--layer-step auto), not layer by layer
    # ... tried as one program, met an expert not in the arena, run again stepped
    redone: int = 0
    # lookups read by the device from host memory over the link (--pcie-frac), not copied in
    streamed: int = 0
    bytes_streamed: int = 0
    # reads from the GGUF file (the file tier) during the window(s), prefetch's included
    file_reads: int = 0
    file_bytes: int = 0

    def add(self, other: ExpertCounters) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def hit_line(self) -> str:
        """Strata's line: `decode expert cache hit rate: 57.9% (271 hits / 468 lookups); 12 more
        read from host (2.5% of all 480 routed)`. Here the misses are what came from the host and
        file tiers."""
        n, h = self.decode_lookups, self.decode_hits
        rate = 100.0 * h / n if n else 0.0
        miss = self.decode_misses
        return (f"decode expert cache hit rate: {rate:.1f}% ({h} hits / {n} lookups); {miss} more "
                f"read from host ({100.0 * miss / n if n else 0.0:.1f}% of all {n} routed)")

    def tier_line(self, tokens: int) -> str:
        """Where the experts of a request's windows came from, every window (prompt and decode):
        `expert tiers: 480 lookups: 271 device hits, 12 copied from host RAM, 197 from the file, 0
        computed on the host; 197 file reads, 788.0 MiB (49.3 MiB a token)`. A window shared by
        several requests counts for each of them."""
        mib = self.file_bytes / 2**20
        return (f"expert tiers: {self.lookups} lookups: {self.hits} device hits, "
                f"{self.misses_host} copied from host RAM, {self.misses_file} from the file, "
                f"{self.host_computed} computed on the host; {self.file_reads} file reads, "
                f"{mib:.1f} MiB ({mib / max(tokens, 1):.1f} MiB a token)")


def resident_line(resident_bytes: int, exchanged: int, file_reads: int,
                  file_bytes: int = 0) -> str:
    return (f"resident RAM: {resident_bytes / GiB:.2f} GiB of experts in RAM, {exchanged} "
            f"exchanged with the device tier, {file_reads} blob reads from the file "
            f"({file_bytes / 2**20:.1f} MiB)")
