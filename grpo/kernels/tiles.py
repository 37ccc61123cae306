"""Launch tiles of the decode kernels: tuned per device as data, guessed for a device no sweep has tuned.

A memory-bound kernel's best tiles depend on the device: its SM count decides how many programs fill it, its
shared memory how many loads a program keeps in flight. So the tuned choices are data, one JSON file a device
in `grpo/kernels/tuned/`, named by the device's key (`device_key`: compute capability and SM count, such as
`sm90-132sm`), and written on that device by one probe run:

    PYTHONPATH=$PWD python3 benchmarks/probes/decode_gemm_tiles.py --write-table   # the decode GEMMs' tiles
    PYTHONPATH=$PWD python3 benchmarks/probes/attention_tiles.py --write-table     # the attention's launch

A file holds the GEMM tiles by the rows its sweep ran at ("16": launches of up to 32 rows, "64": the sampler's
wider batches), each entry keyed by `GemmKey` (kind, output features in all, K, fp8, and for FP8 launches on fp16
activations "activations": "fp16"), and the attention's launch. A device without a file, or a shape its file
lacks, gets `untuned_gemm_tiles`' guess and `AttentionTiles()`; an fp16-activations launch the file lacks gets
its bf16 twin's tiles first.

A table is read once per CUDA device, by the first launch that asks for it: nothing is read or probed at
import. Non-CUDA devices (Triton's interpreter on the CPU, in the tests) get no table and `HOST_SM_COUNT`.

What this module is not: it launches nothing and knows no model; the kernels' modules ask it for their tiles,
and `decode_gemm.tuning(tiles=...)` overrides them for a block of code (sweeps, tests).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch

TABLES = Path(__file__).resolve().parent / "tuned"

# What a non-CUDA device plans with (the interpreter): enough programs that a small test problem still
# splits its work as a GPU's launch does.
HOST_SM_COUNT = 64


class GemmKey(NamedTuple):
    """What a decode GEMM launch's tiles are chosen by. A plain (kind, n, k, fp8) tuple reads as the bf16 key."""

    kind: str  # "proj" or "gated"
    n: int  # output features in all
    k: int
    fp8: bool  # FP8 block weights
    activations: str = "bf16"  # what the launch reads; "fp16" only for FP8 weights (W x^T: decode_gemm._w_first)


_GEMM_FIELDS = GemmKey._fields


@dataclass(frozen=True)
class TileConfig:
    """One decode GEMM launch's tiles."""

    block_n: int = 32  # output features per program
    block_k: int = 256  # reduction step (FP8 weights: in 128-wide sub-blocks, one scale each)
    num_warps: int = 4
    stages: int = 3  # software-pipelined loads in flight
    split_k: int = 1  # K slices, one program each, for projections with few tiles (q/k/v, o, down)


@dataclass(frozen=True)
class AttentionTiles:
    """The attention's chunk launch: positions a loop step reads, warps a program, loads in flight (Triton's
    software pipelining of the loop over positions), and the programs its chunking aims for on each SM. The
    defaults are the swept best where a sweep ran (benchmarks/RESULTS.md, "The measured defaults")."""

    block_s: int = 64
    num_warps: int = 4
    stages: int = 3
    programs_per_sm: int = 2


def _power_of_two(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def tile_problem(kind: str, fp8: bool, cfg: TileConfig) -> str | None:
    """Why the GEMM kernels cannot launch `cfg` for a `kind` launch (fp8: FP8 block weights), or None."""
    if fp8 and (128 % cfg.block_n or cfg.block_k % 128):
        return "block_n must divide 128 and block_k be a multiple of it for FP8 weights (128-wide scale blocks)"
    if not (_power_of_two(cfg.block_n) and _power_of_two(cfg.block_k) and cfg.block_n >= 16 and cfg.block_k >= 16):
        return "block_n and block_k must be powers of 2 from 16 (tensor-core tiles)"
    if not _power_of_two(cfg.num_warps) or cfg.stages < 1:
        return "num_warps must be a power of 2 and stages at least 1"
    if cfg.split_k < 1 or (cfg.split_k != 1 and kind != "proj"):
        return f"split_k is >= 1, and only projections take it (a {kind} launch)"
    return None


def untuned_gemm_tiles(kind: str, n: int, k: int, sm_count: int) -> TileConfig:
    """Tiles for a shape no sweep has tuned on this device: 32 outputs a tile from 2048 outputs, 16 below; a
    projection with fewer tiles than the device has SMs and a long K (1024 or more) splits K in up to 4
    slices of whole K steps, none left empty, so that its programs fill the device. A guess until
    `decode_gemm_tiles.py --write-table` sweeps the shape on the device."""
    block_n, block_k = (32 if n >= 2048 else 16), 256
    split_k = 1
    if kind == "proj" and -(-n // block_n) < sm_count and k >= 1024:
        steps = -(-k // block_k)
        split_k = -(-steps // -(-steps // min(4, steps)))  # as many slices as the K steps fill: 6 steps -> 3
    return TileConfig(block_n, block_k, 4, 4, split_k=split_k)


@dataclass(frozen=True)
class DeviceTable:
    """One device's launch choices. gemm: the rows a sweep ran at -> GemmKey -> tiles."""

    key: str
    sm_count: int
    gemm: Mapping[int, Mapping[GemmKey, TileConfig]] = field(default_factory=dict)
    attention: AttentionTiles = AttentionTiles()

    def __post_init__(self) -> None:  # plain (kind, n, k, fp8) tuples as keys read as the bf16 GemmKeys they are
        gemm = {rows: {GemmKey(*key): cfg for key, cfg in section.items()} for rows, section in self.gemm.items()}
        object.__setattr__(self, "gemm", gemm)

    def gemm_tiles(self, key: tuple, block_m: int) -> TileConfig:
        """The tiles of a launch whose rows pad to `block_m` (16, 32 or 64): those swept at that many rows, else
        at the nearest fewer, else at the nearest more; for fp16 activations the same for its bf16 twin; else the
        guess."""
        key = GemmKey(*key)
        nearest = sorted(self.gemm, key=lambda rows: (rows > block_m, abs(rows - block_m)))
        for wanted in dict.fromkeys((key, key._replace(activations="bf16"))):
            for rows in nearest:
                if wanted in self.gemm[rows]:
                    return self.gemm[rows][wanted]
        return untuned_gemm_tiles(key.kind, key.n, key.k, self.sm_count)


def device_key(capability: tuple[int, int], sm_count: int) -> str:
    """The name of a device's table: compute capability and SM count, e.g. (9, 0) with 132 SMs -> sm90-132sm."""
    return f"sm{capability[0]}{capability[1]}-{sm_count}sm"


def load_table(path: Path, sm_count: int) -> DeviceTable:
    """The table in `path` (named by its device key), every GEMM entry checked against the kernels' limits."""
    data = json.loads(Path(path).read_text())
    gemm: dict[int, dict[GemmKey, TileConfig]] = {}
    for rows, entries in data.get("decode_gemm", {}).items():
        section = gemm[int(rows)] = {}
        for entry in entries:
            key = GemmKey(*(entry[name] for name in _GEMM_FIELDS if name in entry))
            cfg = TileConfig(**{name: value for name, value in entry.items() if name not in _GEMM_FIELDS})
            problem = tile_problem(key.kind, key.fp8, cfg)
            if problem is not None:
                raise ValueError(f"{path}: the {rows}-row entry {entry}: {problem}; correct it or rerun "
                                 "benchmarks/probes/decode_gemm_tiles.py --write-table on the device")
            section[key] = cfg
    attention = AttentionTiles(**data["decode_attention"]) if "decode_attention" in data else AttentionTiles()
    return DeviceTable(Path(path).stem, sm_count, gemm, attention)


def write_table(path: Path, *, gemm: Mapping[int, Mapping[GemmKey, TileConfig]] | None = None,
                attention: AttentionTiles | None = None) -> None:
    """Write the given choices into the table at `path`, keeping what it holds for other shapes, row counts and
    kernels; one GEMM entry a line, sorted, so that a re-tuning reads as a small diff."""
    path = Path(path)
    merged: dict[int, dict[GemmKey, TileConfig]] = {}
    kept_attention = None
    if path.exists():
        merged = {rows: dict(section) for rows, section in load_table(path, 0).gemm.items()}
        kept_attention = json.loads(path.read_text()).get("decode_attention")
    for rows, section in (gemm or {}).items():
        for key, cfg in section.items():
            key = GemmKey(*key)
            problem = tile_problem(key.kind, key.fp8, cfg)
            if problem is not None:
                raise ValueError(f"write_table: {key} -> {cfg}: {problem}")
            merged.setdefault(rows, {})[key] = cfg
    entries = {str(rows): [{**_key_fields(key), **asdict(cfg)} for key, cfg in sorted(merged[rows].items())]
               for rows in sorted(merged)}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(_dumps(entries, asdict(attention) if attention is not None else kept_attention))


def _key_fields(key: GemmKey) -> dict:
    """A key's fields as a table entry holds them: "activations" only where it is not bf16, so that the entries
    written before it existed read the same."""
    fields = key._asdict()
    if fields["activations"] == "bf16":
        del fields["activations"]
    return fields


def _dumps(gemm: Mapping[str, list[dict]], attention: dict | None) -> str:
    """A table as JSON, one GEMM entry a line."""
    sections = [f'    "{rows}": [\n' + ",\n".join(f"      {json.dumps(entry)}" for entry in entries) + "\n    ]"
                for rows, entries in gemm.items()]
    parts = ['  "decode_gemm": {\n' + ",\n".join(sections) + "\n  }"]
    if attention is not None:
        parts.append(f'  "decode_attention": {json.dumps(attention)}')
    return "{\n" + ",\n".join(parts) + "\n}\n"


def table_for(capability: tuple[int, int], sm_count: int, folder: Path = TABLES) -> DeviceTable:
    """The table of a device of this capability and SM count: its file in `folder`, else an empty one."""
    key = device_key(capability, sm_count)
    path = Path(folder) / f"{key}.json"
    return load_table(path, sm_count) if path.exists() else DeviceTable(key, sm_count)


_HOST_TABLE = DeviceTable("host", HOST_SM_COUNT)


def device_table(device: torch.device) -> DeviceTable:
    """The table of the device a launch runs on, read on the first call for each CUDA device."""
    if device.type != "cuda":
        return _HOST_TABLE
    return _cuda_table(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _cuda_table(index: int) -> DeviceTable:
    props = torch.cuda.get_device_properties(index)
    return table_for((props.major, props.minor), props.multi_processor_count)
