"""Measured GPU operator timings in Vidur's profile layout, and the compact form kept in the repository.

Vidur (microsoft/vidur, MIT licence) profiled a transformer layer's ops on
A100, H100 and A40 GPUs. Two layouts exist: the older one
(``<version>/<gpu>/mlp.csv``, ``attention.csv``, ``all_reduce.csv``) and the
later one (``<version>/compute/<gpu>/<org>/<model>/mlp.csv`` and
``<version>/network/<gpu>_<topology>/all_reduce.csv``). Each op has
``time_stats.<op>.{min,max,mean,median,std}`` columns in milliseconds.

``read_vidur_dir`` reads either layout (a directory holding version
directories, or one version directory); ``read_compact``/``write_compact``
the repository's medians-only copy (three CSV files). Only medians are kept.
"""

from __future__ import annotations

import csv
import gzip
import io
from dataclasses import dataclass, fields
from pathlib import Path

from llmsched.core.errors import ConfigError

# Vidur's per-layer ops in mlp.csv, in its order.
MLP_OPS = (
    "emb",
    "input_layernorm",
    "attn_pre_proj",
    "attn_rope",
    "attn_post_proj",
    "post_attention_layernorm",
    "mlp_up_proj",
    "mlp_act",
    "mlp_down_proj",
    "add",
)
GEMM_OPS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj")
# Which elementwise kernel kind (KernelFit.elementwise) each other op is.
ELEMENTWISE_OP_KIND = {
    "emb": "emb",
    "input_layernorm": "norm",
    "post_attention_layernorm": "norm",
    "attn_rope": "rope",
    "mlp_act": "act",
    "add": "add",
}


@dataclass(frozen=True, slots=True)
class OpRow:
    """One measured median of one MLP-side op (milliseconds)."""

    version: str
    gpu: str
    op: str
    n_head: int
    n_kv_head: int
    n_embd: int
    n_expanded_embd: int
    vocab_size: int
    gated: bool
    tp: int
    tokens: int
    median_ms: float

    @property
    def shape(self) -> str:
        """The model shape this row belongs to (leave-one-out groups by it)."""
        g = "g" if self.gated else "u"
        return (
            f"h{self.n_embd}-i{self.n_expanded_embd}-q{self.n_head}-kv{self.n_kv_head}-v{self.vocab_size}-{g}"
        )


@dataclass(frozen=True, slots=True)
class AttnRow:
    """One measured median of a prefill or decode attention kernel (one layer, milliseconds)."""

    version: str
    gpu: str
    n_embd: int
    n_q_head: int
    n_kv_head: int
    tp: int
    batch: int
    chunk: int
    kv_cache: int
    prefill: bool
    median_ms: float


@dataclass(frozen=True, slots=True)
class CollRow:
    """One measured median of a collective over ``world`` GPUs; ``size`` is fp16 elements."""

    version: str
    gpu: str
    topology: str
    collective: str
    world: int
    size: int
    median_ms: float


@dataclass
class VidurData:
    """All rows read from one place."""

    ops: list[OpRow]
    attention: list[AttnRow]
    collectives: list[CollRow]


def _bool(s: str) -> bool:
    return s.strip().lower() in ("true", "1")


def _num(row: dict, key: str, path: Path) -> float | None:
    v = row.get(key, "")
    if v is None or v == "":
        return None
    try:
        return float(v)
    except ValueError:
        raise ConfigError(f"{path}: column {key!r} holds {v!r}, not a number") from None


def _need(header: list[str] | None, cols: tuple[str, ...], path: Path) -> None:
    missing = [c for c in cols if c not in (header or [])]
    if missing:
        raise ConfigError(f"{path}: not a Vidur profile, missing columns {missing}")


_MLP_COLS = ("n_head", "n_kv_head", "n_embd", "n_expanded_embd", "vocab_size", "use_gated_mlp")


def _read_mlp(path: Path, version: str, gpu: str) -> list[OpRow]:
    out: list[OpRow] = []
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        _need(reader.fieldnames, (*_MLP_COLS, "num_tokens", "num_tensor_parallel_workers"), path)
        for r in reader:
            cfg = (
                int(r["n_head"]),
                int(r["n_kv_head"]),
                int(r["n_embd"]),
                int(r["n_expanded_embd"]),
                int(r["vocab_size"]),
                _bool(r["use_gated_mlp"]),
                int(r["num_tensor_parallel_workers"]),
                int(r["num_tokens"]),
            )
            for op in MLP_OPS:
                v = _num(r, f"time_stats.{op}.median", path)
                if v is not None and v > 0:
                    out.append(OpRow(version, gpu, op, *cfg, v))
    return out


def _read_attention(path: Path, version: str, gpu: str) -> list[AttnRow]:
    out: list[AttnRow] = []
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        _need(reader.fieldnames, ("n_embd", "n_q_head", "batch_size", "kv_cache_size", "is_prefill"), path)
        for r in reader:
            prefill = _bool(r["is_prefill"])
            v = _num(r, f"time_stats.attn_{'prefill' if prefill else 'decode'}.median", path)
            if v is None or v <= 0:
                continue
            out.append(
                AttnRow(
                    version,
                    gpu,
                    int(r["n_embd"]),
                    int(r["n_q_head"]),
                    int(r["n_kv_head"]),
                    int(r["num_tensor_parallel_workers"]),
                    int(r["batch_size"]),
                    int(r["prefill_chunk_size"]),
                    int(r["kv_cache_size"]),
                    prefill,
                    v,
                )
            )
    return out


def _read_collective(path: Path, version: str, gpu: str, topology: str) -> list[CollRow]:
    out: list[CollRow] = []
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        _need(reader.fieldnames, ("num_workers", "size", "collective"), path)
        for r in reader:
            kind = r["collective"]
            v = _num(r, f"time_stats.{kind}.median", path)
            if v is None or v <= 0:
                continue
            out.append(CollRow(version, gpu, topology, kind, int(r["num_workers"]), int(r["size"]), v))
    return out


def _read_version(vdir: Path) -> VidurData:
    data = VidurData([], [], [])
    version = vdir.name
    if (vdir / "compute").is_dir():
        for p in sorted((vdir / "compute").glob("*/*/*/mlp.csv")):
            data.ops += _read_mlp(p, version, p.parts[-4])
        for p in sorted((vdir / "compute").glob("*/*/*/attention.csv")):
            data.attention += _read_attention(p, version, p.parts[-4])
        for p in sorted((vdir / "network").glob("*/all_reduce.csv")):
            gpu, _, topo = p.parent.name.partition("_")
            data.collectives += _read_collective(p, version, gpu, topo)
        return data
    for gdir in sorted(d for d in vdir.iterdir() if d.is_dir()):
        if (gdir / "mlp.csv").is_file():
            data.ops += _read_mlp(gdir / "mlp.csv", version, gdir.name)
        if (gdir / "attention.csv").is_file():
            data.attention += _read_attention(gdir / "attention.csv", version, gdir.name)
        if (gdir / "all_reduce.csv").is_file():
            data.collectives += _read_collective(gdir / "all_reduce.csv", version, gdir.name, "node")
    return data


def read_vidur_dir(path: str | Path) -> VidurData:
    """Every MLP-side, attention and all-reduce median under ``path`` (either Vidur layout)."""
    root = Path(path)
    if not root.is_dir():
        raise ConfigError(f"Vidur profile directory {str(root)!r} does not exist")
    looks_like_version = (root / "compute").is_dir() or any(root.glob("*/mlp.csv"))
    versions = [root] if looks_like_version else sorted(d for d in root.iterdir() if d.is_dir())
    data = VidurData([], [], [])
    for v in versions:
        part = _read_version(v)
        data.ops += part.ops
        data.attention += part.attention
        data.collectives += part.collectives
    if not (data.ops or data.attention or data.collectives):
        raise ConfigError(f"{root}: no Vidur mlp.csv, attention.csv or all_reduce.csv found")
    return data


# ---- the compact, medians-only copy -------------------------------------------------

_COMPACT = {"ops.csv.gz": OpRow, "attention.csv.gz": AttnRow, "collectives.csv.gz": CollRow}


def write_compact(data: VidurData, out_dir: str | Path) -> list[Path]:
    """Write ``data`` as three gzipped CSV files (one column per field); returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for (name, cls), rows in zip(_COMPACT.items(), (data.ops, data.attention, data.collectives)):
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        names = [f.name for f in fields(cls)]
        w.writerow(names)
        for r in rows:
            w.writerow([getattr(r, n) for n in names])
        p = out / name
        # mtime=0: the same rows give the same bytes.
        with p.open("wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as gz:
            gz.write(buf.getvalue().encode())
        paths.append(p)
    return paths


def _typed(cls: type, row: dict, path: Path) -> object:
    kw = {}
    for f in fields(cls):
        if f.name not in row:
            raise ConfigError(f"{path}: missing column {f.name!r}")
        v = row[f.name]
        kw[f.name] = (
            _bool(v)
            if f.type == "bool"
            else int(v)
            if f.type == "int"
            else (float(v) if f.type == "float" else v)
        )
    return cls(**kw)


def read_compact(in_dir: str | Path) -> VidurData:
    """The rows ``write_compact`` wrote."""
    d = Path(in_dir)
    lists: list[list] = []
    for name, cls in _COMPACT.items():
        p = d / name
        if not p.is_file():
            raise ConfigError(f"compact Vidur data: {p} is missing")
        with gzip.open(p, "rt", newline="") as f:
            lists.append([_typed(cls, r, p) for r in csv.DictReader(f)])
    return VidurData(*lists)
