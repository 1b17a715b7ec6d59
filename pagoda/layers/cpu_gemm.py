"""Linear layers on CPU through oneDNN with weights packed once at start-up.

``torch.nn.functional.linear`` on a CPU float32 tensor calls the BLAS library torch was built
with. oneDNN (shipped inside torch) can instead multiply by a weight that was reordered once into
its own blocked layout, which skips the per-call packing a BLAS gemm does and picks kernels for
the CPU it runs on. For the shapes of a serving step (a few to a few hundred tokens times a
768-4096 wide weight) this is 2-4x faster than the BLAS call on the 2-core AMD machines pagoda is
developed on, and a row's result does not depend on how many other rows are in the batch.

At one to four rows (a decode step of up to four sequences) the work is a pass over the
weights, and oneDNN's and BLAS's blocked kernels leave much of the memory bandwidth unused there.
``cpu_gemv`` streams the plain ``[out, in]`` weight instead. Which kernel serves the few-row
products of a layer is chosen at start-up, per weight shape and dtype, by timing both on this
machine (``choose_gemv``); where the gemv kernel wins the layer keeps its dense weight beside
the packed one (the packed one still serves more rows), else the dense copy is dropped.

On CPUs with AMX-BF16 a bfloat16 layer may instead keep its weight in ``cpu_amx``'s tile
layout (without AMX, on AVX512-BF16, in ``cpu_panel``'s bfloat16 panels), and on CPUs with
AVX-512 a float32 layer its weight in ``cpu_panel``'s 16-column panels, for up to four, 16 or the
kernel's ``MAX_ROWS`` rows (a decode step): chosen, per shape, by timing it against whatever
would serve one row (the gemv kernel or oneDNN) and against oneDNN at 16 and ``MAX_ROWS`` rows;
the dense copy is then dropped, so no weight is held more than twice (``choose_tiles``).

``PAGODA_CPU_GEMM=torch`` turns packing off (every layer then calls ``F.linear``);
``PAGODA_CPU_GEMM=onednn`` packs and never uses the gemv, AMX or panel kernels, and makes a missing
oneDNN an error instead of a silent fallback; ``PAGODA_CPU_GEMM=gemv`` uses the gemv kernel for
every few-row product without timing; ``PAGODA_CPU_GEMM=amx`` uses the AMX kernel for every
bfloat16 product of up to ``cpu_amx.MAX_ROWS`` rows without timing (an error where it cannot
run), ``PAGODA_CPU_GEMM=panel`` likewise ``cpu_panel`` for every float32 or bfloat16 one.
``pagoda bench gemm --model DIR`` times the kernels on the model's shapes.

The timed verdicts are kept on disk (``pagoda.kernels.choice_cache``, one file per CPU, variant,
torch version, thread count and kernel sources), so only a machine's first start times them; each
timed shape and the total are logged (``pack_model``).
"""
from __future__ import annotations

import logging
import time

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.kernels import amx as cpu_amx
from pagoda.kernels import gemv as cpu_gemv
from pagoda.kernels import panel as cpu_panel
from pagoda.kernels import select

logger = logging.getLogger(__name__)

ENV_VAR = select.GEMM_VAR


def mode() -> str:
    """``PAGODA_CPU_GEMM`` (read by pagoda/kernels/select.py)."""
    return select.gemm_mode()


def onednn_available() -> bool:
    return (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight in oneDNN's layout, or ``None`` where oneDNN cannot take this dtype here
    (float16 needs AVX512-FP16 or AVX-NE-CONVERT, for example)."""
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())
    except RuntimeError:
        return None


def pack_parameter(weight: nn.Parameter, keep_dense: bool) -> torch.Tensor | None:
    """Pack a CPU layer's weight; unless ``keep_dense`` (another module reads it, as a tied
    embedding does) or the gemv kernel serves this layer's few-row products, drop the dense
    copy so the weights are not held twice. ``None`` where nothing was packed: not on CPU, or
    oneDNN cannot take it."""
    if weight.device.type != "cpu":
        return None
    packed = pack(weight.data)
    if packed is None:
        _refuse_forced_tiles(weight.data)  # e.g. bfloat16 on an AVX2 CPU: no oneDNN layout, no tile kernel
        return None
    copies = _ColdCopies(weight.data, packed)  # made only if a choice is timed, shared by both
    use_gemv = choose_gemv(weight.data, packed, copies)
    tiles = choose_tiles(weight.data, packed, use_gemv, copies)
    del copies
    if tiles is not None:  # read by ``linear`` and the fused decode blocks
        packed.pagoda_tiles, packed.pagoda_tiles_rows, packed.pagoda_tiles_kernel = tiles  # type: ignore[attr-defined]
        packed.pagoda_out = weight.shape[0]  # type: ignore[attr-defined]
        use_gemv = False
    if use_gemv:
        packed.pagoda_gemv = True  # type: ignore[attr-defined]  # read by ``linear``
    elif not keep_dense:
        weight.data = torch.empty(0, dtype=weight.dtype)
    return packed


# (out, in, dtype) -> whether the gemv kernel beat oneDNN at one row, measured once per process.
_GEMV_CHOICE: dict[tuple[int, int, torch.dtype], bool] = {}


# Bytes of weight copies the choice is timed over, so that each copy comes from memory.
_COLD_BYTES = 96 << 20
# Weights smaller than this (test-sized models: every real model's layers are larger) are timed
# over a few copies only: such a model stays in cache between steps anyway, and 128 copies of each
# shape, packed twice, made every start-up of a tiny model take seconds.
_SMALL_BYTES = 256 << 10


# Bytes a decode step reads between two uses of one weight: the model's own weights, set by
# ``pack_model`` while it packs (None: unknown, ``_COLD_BYTES``).
_stream_bytes: int | None = None


def cold_copies(weight: torch.Tensor) -> int:
    """How many copies of ``weight`` pass ``_COLD_BYTES``, or the model's own weight bytes where
    those are fewer: timed in turn, each comes from as far as in a serving step, where the rest
    of the model's weights stream through the caches between two uses of one (a model smaller
    than the caches stays in them, and copies past its size would time it colder than it runs,
    at start-up cost). 8 at most for a weight under ``_SMALL_BYTES``."""
    nbytes = weight.numel() * weight.element_size()
    target = _COLD_BYTES if _stream_bytes is None else max(nbytes, min(_COLD_BYTES, _stream_bytes))
    return min(8 if nbytes < _SMALL_BYTES else 128, max(1, -(-target // nbytes)))


class _ColdCopies:
    """Copies of one weight (``cold_copies`` of them, the weight itself first) and their oneDNN
    packs, for the start-up timings of its layer: made on first use, shared by ``choose_gemv``
    and ``choose_tiles``, so a layer timed by both packs its copies once."""

    def __init__(self, weight: torch.Tensor, packed: torch.Tensor) -> None:
        self.weight, self.first_pack = weight, packed
        self._weights: list[torch.Tensor] | None = None
        self._packs: list[torch.Tensor] | None = None

    @property
    def weights(self) -> list[torch.Tensor]:
        if self._weights is None:
            self._weights = [self.weight] + [self.weight.clone() for _ in range(cold_copies(self.weight) - 1)]
        return self._weights

    @property
    def packs(self) -> list[torch.Tensor]:
        if self._packs is None:
            self._packs = [self.first_pack] + [pack(w) for w in self.weights[1:]]
        return self._packs


# Rounds of a timing: at least MIN_ROUNDS, and up to MAX_ROUNDS while a comparison it decides is
# closer than SETTLED (a clear verdict needs no more; a near tie gets the rounds to tell).
MIN_ROUNDS, MAX_ROUNDS, SETTLED = 3, 7, 0.15


def _best_of(fns: dict, per: int, pairs: list[tuple[str, str, float]]) -> dict[str, float]:
    """Best seconds per product of each function (interleaved rounds; a call runs ``per``).
    ``pairs``: the comparisons the verdict makes, (a, b, factor) for ``a < factor * b``; rounds
    stop once each is at least ``SETTLED`` away from its threshold."""
    best = {name: float("inf") for name in fns}
    for r in range(MAX_ROUNDS):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], (time.perf_counter() - start) / per)
        if r + 1 >= MIN_ROUNDS and all(abs(best[a] / (f * best[b]) - 1) > SETTLED for a, b, f in pairs):
            break
    return best


class _Choices:
    """The timed choices of this process: in memory (per shape) and on disk
    (``pagoda.kernels.choice_cache``, so a later start on this machine reads them), and how many
    were timed or read and how long that took, for ``pack_model``'s log line."""

    def __init__(self) -> None:
        self.timed = self.read = 0
        self.seconds = 0.0

    def disk(self):
        from pagoda.kernels import choice_cache

        return choice_cache.for_this_machine("cpu-gemm")

    def lookup(self, key: str):
        value = self.disk().get(key)
        if value is not None:
            self.read += 1
        return value

    def begin(self) -> float:
        """Start timing one shape (the first says so in the log); returns the start time."""
        if not self.timed:
            path = self.disk().path
            logger.info("timing the CPU product kernels per weight shape (once per machine, variant, torch and "
                        "thread count; kept in %s)", path or "memory only: PAGODA_CPU_CHOICE_CACHE=off")
        self.timed += 1
        return time.perf_counter()

    def store(self, key: str, value, start: float, what: str) -> None:
        seconds = time.perf_counter() - start
        self.seconds += seconds
        self.disk().put(key, value)
        logger.info("%s (timed in %.1fs)", what, seconds)


_STATS = _Choices()


def choose_gemv(weight: torch.Tensor, packed: torch.Tensor, copies: _ColdCopies | None = None) -> bool:
    """Whether few-row products with ``weight`` should use the gemv kernel: always with
    ``PAGODA_CPU_GEMM=gemv``, never with ``onednn``; by default when it is faster than the
    packed oneDNN product at one row on this machine, or within 5% of it.

    Both are timed as a decode step runs them: on weights that come from memory (every weight
    of the model streams through the caches between two uses of one). A copy of a small weight
    would stay in cache when timed alone, where oneDNN's blocked kernels (AMX on Intel Xeons)
    look better than they are in a step, so enough copies to pass ``_COLD_BYTES`` are timed in
    turn (transient memory, at start-up only); best of interleaved rounds, which is the figure
    least disturbed by other load. ``copies``: the layer's shared copies (else made here)."""
    choice = mode()
    if choice in ("onednn", "torch") or not cpu_gemv.supports(weight):
        return False
    if choice == "gemv":
        return True
    key = (weight.shape[0], weight.shape[1], weight.dtype)
    disk_key = f"gemv {weight.shape[0]}x{weight.shape[1]} {weight.dtype} copies={cold_copies(weight)}"
    if key not in _GEMV_CHOICE and isinstance(stored := _STATS.lookup(disk_key), bool):
        _GEMV_CHOICE[key] = stored
    if key not in _GEMV_CHOICE:
        start = _STATS.begin()
        copies = copies or _ColdCopies(weight, packed)
        weights, packs = copies.weights, copies.packs
        x = torch.randn(1, weight.shape[1]).to(weight.dtype)
        # Ties go to the gemv kernel: inside a decode step there is no dispatcher and no
        # per-call primitive lookup in front of it. The two are often within 10% on large
        # weights: such a near tie gets the full rounds.
        best = _best_of({"gemv": lambda: [cpu_gemv.gemv(x, w, None) for w in weights],
                         "onednn": lambda: [_LINEAR(x, p, None, "none", [], "") for p in packs]}, len(weights),
                        [("gemv", "onednn", 1.05)])
        _GEMV_CHOICE[key] = best["gemv"] < 1.05 * best["onednn"]
        _STATS.store(disk_key, _GEMV_CHOICE[key], start,
                     f"few-row kernel for {tuple(weight.shape)} {weight.dtype}: "
                     f"{'gemv' if _GEMV_CHOICE[key] else 'oneDNN'} (gemv {best['gemv'] * 1e6:.1f} us, "
                     f"oneDNN {best['onednn'] * 1e6:.1f} us, {len(weights)} copies)")
    return _GEMV_CHOICE[key]


# (dtype, out, in) -> up to how many rows the tile kernel of that dtype (``_tile_kernel``) serves a
# weight of that shape (0: it does not), measured once per process.
_TILE_CHOICE: dict[tuple[torch.dtype, int, int], int] = {}

def _tile_kernel(dtype: torch.dtype, choice: str) -> tuple[object, bool, str] | None:
    """The tile kernel for ``dtype`` weights under mode ``choice``: (its module, whether the mode
    forces it, what it needs). Float32: the panel kernel. Bfloat16: the AMX kernel where this CPU
    runs it (or ``amx`` forces it), else the bfloat16 panel kernel (or ``panel`` forces it)."""
    if dtype == torch.float32:
        return cpu_panel, choice == "panel", "AVX-512"
    if dtype != torch.bfloat16:
        return None
    if choice == "amx" or (choice != "panel" and cpu_amx.supported()):
        return cpu_amx, choice == "amx", "AMX-BF16"
    return cpu_panel, choice == "panel", "AVX512-BF16"


def choose_tiles(weight: torch.Tensor, packed: torch.Tensor, use_gemv: bool,
                 copies: _ColdCopies | None = None) -> tuple[torch.Tensor, int, object] | None:
    """The weight in its dtype's tile kernel's layout (``_tile_kernel``: ``cpu_panel`` for float32,
    ``cpu_amx`` for bfloat16 where the CPU has AMX, else ``cpu_panel``'s bfloat16 panels) and up to
    how many rows that kernel should serve this layer's products, and the kernel, else None. Always (every row
    count up to ``MAX_ROWS``) with ``PAGODA_CPU_GEMM=amx`` (bfloat16) or ``panel`` (float32 and
    bfloat16), an error where the kernel cannot run; never with ``onednn``/``gemv``/``torch``. By
    default, timed as ``choose_gemv`` times (weights from memory, best of interleaved rounds):
    where it is within 5% of the one-row kernel it replaces (the gemv kernel where that was
    chosen, else oneDNN), since the layer then drops its dense copy, it serves up to the gemv
    kernel's four rows; up to 16 where it also beats oneDNN at 16 rows, and up to ``MAX_ROWS``
    where it beats oneDNN there too. (On the 2-vCPU development VM the AMX kernel, whose two
    threads share one core's AMX unit, leads at 2-16 rows and is level with oneDNN at 32; the
    float32 panels lead at 1-32.) ``copies``: the layer's shared copies (else made here)."""
    choice = mode()
    picked = None if choice in ("onednn", "gemv", "torch") else _tile_kernel(weight.dtype, choice)
    if picked is None:
        return None
    kernel, forced, _ = picked
    if forced:
        _refuse_forced_tiles(weight)
        return kernel.pack(weight), kernel.MAX_ROWS, kernel
    if not kernel.supports(weight):
        return None
    key = (weight.dtype, weight.shape[0], weight.shape[1])
    disk_key = (f"tiles {kernel.__name__} {weight.shape[0]}x{weight.shape[1]} {weight.dtype} gemv={use_gemv} "
                f"copies={cold_copies(weight)}")
    if key not in _TILE_CHOICE and isinstance(stored := _STATS.lookup(disk_key), int):
        _TILE_CHOICE[key] = stored
    if _TILE_CHOICE.get(key) == 0:
        return None
    timing = key not in _TILE_CHOICE
    start = _STATS.begin() if timing else 0.0
    tiles = kernel.pack(weight)
    if timing:
        copies = copies or _ColdCopies(weight, packed)
        weights, packs = copies.weights, copies.packs
        packed_tiles = [tiles] + [kernel.pack(w) for w in weights[1:]]
        linear_op, n, k, top = kernel.linear_op(), weight.shape[0], weight.shape[1], kernel.MAX_ROWS
        xs = {m: torch.randn(m, k).to(weight.dtype) for m in (1, 16, top)}

        def on_tiles(x: torch.Tensor):
            return lambda: [linear_op(x, t, n) for t in packed_tiles]

        def on_onednn(x: torch.Tensor):
            return lambda: [_LINEAR(x, p, None, "none", [], "") for p in packs]

        fns = {f"tiles{m}": on_tiles(x) for m, x in xs.items()}
        fns.update({f"onednn{m}": on_onednn(x) for m, x in xs.items() if m > 1})
        fns["one"] = ((lambda: [cpu_gemv.gemv(xs[1], w, None) for w in weights]) if use_gemv else on_onednn(xs[1]))
        best = _best_of(fns, len(weights), [("tiles1", "one", 1.05), ("tiles16", "onednn16", 1.0),
                                            (f"tiles{top}", f"onednn{top}", 1.0)])
        del packed_tiles
        rows = 0
        if best["tiles1"] < 1.05 * best["one"]:  # it may replace the one-row kernel: up to its rows
            rows = cpu_gemv.MAX_ROWS
            if best["tiles16"] < best["onednn16"]:
                rows = top if best[f"tiles{top}"] < best[f"onednn{top}"] else 16
        _TILE_CHOICE[key] = rows
        _STATS.store(disk_key, rows, start,
                     f"{kernel.__name__} kernel for {key[1:]} {key[0]}: up to {rows} rows (us, it / other: 1 row "
                     f"{best['tiles1'] * 1e6:.1f} / {best['one'] * 1e6:.1f}, 16 rows {best['tiles16'] * 1e6:.1f} / "
                     f"{best['onednn16'] * 1e6:.1f}, {top} rows {best[f'tiles{top}'] * 1e6:.1f} / "
                     f"{best[f'onednn{top}'] * 1e6:.1f})")
    return (tiles, _TILE_CHOICE[key], kernel) if _TILE_CHOICE[key] else None


def linear(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None,
           bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, through the packed weight when there is one, through the
    tile kernel of its dtype (``cpu_amx``, ``cpu_panel``) for as many rows as the layer chose it
    for, and through the gemv kernel for at most ``cpu_gemv.MAX_ROWS`` rows where that layer
    chose it."""
    if packed is not None:
        tiles = getattr(packed, "pagoda_tiles", None)
        if tiles is not None and 0 < x.numel() <= packed.pagoda_tiles_rows * x.shape[-1]:
            return packed.pagoda_tiles_kernel.linear(x, tiles, packed.pagoda_out, bias)
        if 0 < x.numel() <= cpu_gemv.MAX_ROWS * x.shape[-1] and getattr(packed, "pagoda_gemv", False):
            return cpu_gemv.gemv(x, weight, bias)
        return _LINEAR(x, packed, bias, "none", [], "")
    return F.linear(x, weight, bias)


# The resolved overload, so a call skips the op-namespace lookup (tens of calls per step).
_LINEAR = torch.ops.mkldnn._linear_pointwise.default if onednn_available() else None


def _refuse_forced_tiles(weight: torch.Tensor) -> None:
    """``RuntimeError`` where ``PAGODA_CPU_GEMM`` forces a tile kernel (``amx``, ``panel``) for
    ``weight``'s dtype that cannot run here; nothing otherwise."""
    choice = mode()
    picked = _tile_kernel(weight.dtype, choice) if choice in ("amx", "panel") else None
    if picked is not None and picked[1] and not picked[0].supports(weight):
        raise RuntimeError(f"{ENV_VAR}={choice} but its kernel cannot run here (needs {picked[2]} and a compiler for it)")


def pack_model(model: nn.Module) -> int:
    """Pack every linear layer of ``model`` that supports it (those with a ``pack_weight``
    method). Returns how many were packed; 0 when packing is off or oneDNN is missing."""
    choice = mode()
    if choice == "torch":
        return 0
    if not onednn_available():
        if choice == "onednn":
            raise RuntimeError(f"{ENV_VAR}=onednn but this torch build has no oneDNN linear ops")
        return 0
    global _stream_bytes
    layers = [m for m in model.modules() if hasattr(m, "pack_weight")]
    start, timed, read, seconds = time.perf_counter(), _STATS.timed, _STATS.read, _STATS.seconds
    weights = [getattr(layer, "weight", None) for layer in layers]
    _stream_bytes = sum(w.numel() * w.element_size() for w in weights if isinstance(w, torch.Tensor)) or None
    try:
        packed = sum(1 for layer in layers if layer.pack_weight())
    finally:
        _stream_bytes = None
    if _STATS.timed > timed or _STATS.read > read:
        cache = _STATS.disk().path
        logger.info("CPU product kernels for %d layers chosen in %.1fs: %d weight shapes timed (%.1fs), %d choices "
                    "read from %s", len(layers), time.perf_counter() - start, _STATS.timed - timed,
                    _STATS.seconds - seconds, _STATS.read - read, cache or "nowhere (PAGODA_CPU_CHOICE_CACHE=off)")
    if packed < len(layers):
        logger.info("oneDNN packed %d of %d linear layers; the rest use torch's gemm", packed, len(layers))
    if choice == "onednn" and packed == 0 and layers:
        raise RuntimeError(f"{ENV_VAR}=onednn but oneDNN cannot pack this model's weights")
    return packed
