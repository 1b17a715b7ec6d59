"""oneDNN-packed linear layers and the few-row gemv kernel on CPU: same results as ``F.linear``,
dense copies dropped where no kernel reads them, and ``PAGODA_CPU_GEMM`` honoured."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagoda.layers import cpu_gemm
from pagoda.kernels import select
from pagoda.layers.embedding import ParallelLMHead
from pagoda.layers.linear import QKVParallelLinear, ReplicatedLinear, RowParallelLinear

needs_onednn = pytest.mark.skipif(not cpu_gemm.onednn_available(), reason="torch built without oneDNN")


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear_for_any_row_count(bias: bool, monkeypatch) -> None:
    monkeypatch.setenv(cpu_gemm.ENV_VAR, "onednn")  # oneDNN for every row count
    torch.manual_seed(0)
    layer = ReplicatedLinear(96, 160, bias, torch.float32)
    layer.weight.data.normal_(0, 0.1)
    if bias:
        layer.bias.data.normal_()
    dense = layer.weight.data.clone()
    x = torch.randn(67, 96)
    assert layer.pack_weight()
    assert layer.weight.numel() == 0  # the dense copy is gone
    full = layer(x)
    torch.testing.assert_close(full, F.linear(x, dense, layer.bias), rtol=1e-5, atol=1e-5)
    for rows in (1, 5, 33):  # a row's result does not depend on the rest of the batch
        assert torch.equal(layer(x[:rows].contiguous()), full[:rows])


@needs_onednn
def test_pack_model_packs_every_linear_and_keeps_tied_embedding(monkeypatch) -> None:
    monkeypatch.delenv(cpu_gemm.ENV_VAR, raising=False)
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({
        "qkv": QKVParallelLinear(64, 16, 4, 2, True, torch.float32),
        "o": RowParallelLinear(64, 64, False, torch.float32),
        "head": ParallelLMHead(50, 64, torch.float32),
    })
    for p in model.parameters():
        p.data.normal_(0, 0.1)
    model["head"].tied = True
    head_dense = model["head"].weight.data.clone()
    h = torch.randn(9, 64)
    expected = F.linear(h, head_dense)
    assert cpu_gemm.pack_model(model) == 3
    assert torch.equal(model["head"].weight.data, head_dense)  # the token lookup still needs it
    torch.testing.assert_close(model["head"].compute_logits(h), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(160, 96), (37, 77)])  # in-features a multiple of 32, and not
def test_gemv_kernel_matches_f_linear(dtype: torch.dtype, shape: tuple[int, int]) -> None:
    from pagoda.kernels import gemv as cpu_gemv

    if not select.kernels_enabled():
        pytest.skip("PAGODA_CPU_KERNELS=0")
    torch.manual_seed(0)
    w = torch.randn(*shape).to(dtype)
    bias = torch.randn(shape[0]).to(dtype)
    for rows in range(1, cpu_gemv.MAX_ROWS + 1):
        x = torch.randn(rows, shape[1]).to(dtype)
        expected = F.linear(x.float(), w.float(), bias.float())
        got = cpu_gemv.gemv(x, w, bias)
        assert got.dtype == dtype and got.shape == expected.shape
        # float32 sums either way; bfloat16 output rounding is 2**-8 relative
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(got.float(), expected, rtol=tol, atol=tol * 10)
    x3 = torch.randn(2, 1, shape[1]).to(dtype)  # leading dims are flattened and restored
    assert cpu_gemv.gemv(x3, w, None).shape == (2, 1, shape[0])


@needs_onednn
def test_layer_uses_gemv_for_few_rows_and_onednn_for_more(monkeypatch) -> None:
    from pagoda.kernels import gemv as cpu_gemv

    if not select.kernels_enabled():
        pytest.skip("PAGODA_CPU_KERNELS=0")
    monkeypatch.setenv(cpu_gemm.ENV_VAR, "gemv")
    torch.manual_seed(0)
    layer = ReplicatedLinear(64, 48, False, torch.float32)
    layer.weight.data.normal_(0, 0.1)
    dense = layer.weight.data.clone()
    assert layer.pack_weight()
    assert torch.equal(layer.weight.data, dense)  # kept for the gemv kernel
    calls = []
    real = cpu_gemv.gemv
    monkeypatch.setattr(cpu_gemv, "gemv", lambda *a: calls.append(a[0].shape) or real(*a))
    for rows in (0, 1, cpu_gemv.MAX_ROWS, cpu_gemv.MAX_ROWS + 1, 40):  # 0: a step with no logits rows
        x = torch.randn(rows, 64)
        torch.testing.assert_close(layer(x), F.linear(x, dense), rtol=1e-5, atol=1e-5)
    assert [c[0] for c in calls] == [1, cpu_gemv.MAX_ROWS]
    monkeypatch.setenv(cpu_gemm.ENV_VAR, "onednn")  # never the gemv kernel; the dense copy goes
    other = ReplicatedLinear(64, 48, False, torch.float32)
    assert other.pack_weight() and other.weight.numel() == 0


def test_env_var_turns_packing_off_and_rejects_unknown_values(monkeypatch) -> None:
    layer = torch.nn.ModuleDict({"a": ReplicatedLinear(8, 8, False, torch.float32)})
    monkeypatch.setenv(cpu_gemm.ENV_VAR, "torch")
    assert cpu_gemm.pack_model(layer) == 0 and layer["a"].packed is None
    assert layer["a"].weight.shape == (8, 8)
    monkeypatch.setenv(cpu_gemm.ENV_VAR, "mkl")
    with pytest.raises(ValueError, match="PAGODA_CPU_GEMM='mkl'"):
        cpu_gemm.pack_model(layer)


def test_tensor_parallel_workers_wait_passively(monkeypatch) -> None:
    """pagoda's own spin default is replaced by the passive policy for the tensor-parallel
    workers it starts beside each other; a user's choice is passed on untouched."""
    import pagoda
    from pagoda.omp import passive_env

    monkeypatch.setitem(pagoda.OMP_DEFAULTS_SET, "GOMP_SPINCOUNT", "10000")
    env = passive_env({"GOMP_SPINCOUNT": "10000", "X": "1"})
    assert env == {"OMP_WAIT_POLICY": "PASSIVE", "X": "1"}
    monkeypatch.delitem(pagoda.OMP_DEFAULTS_SET, "GOMP_SPINCOUNT")
    assert passive_env({"GOMP_SPINCOUNT": "123"}) == {"GOMP_SPINCOUNT": "123"}


def test_dtype_auto_on_cpu_follows_the_checkpoint_and_the_cpu(monkeypatch) -> None:
    """bfloat16 only for half-precision checkpoints on CPUs with bfloat16 dot products
    (AVX512-BF16 or AMX); float32 checkpoints stay float32 everywhere; an explicit dtype always
    wins."""
    from pagoda import config, cpu_features

    for native, ckpt, expected in [(True, "bfloat16", torch.bfloat16), (True, "float16", torch.bfloat16),
                                   (True, "float32", torch.float32), (False, "bfloat16", torch.float32),
                                   (False, None, torch.float32)]:
        monkeypatch.setattr(cpu_features, "prefers_bf16", lambda native=native: native)
        assert config._resolve_dtype("auto", ckpt, "cpu") == expected, (native, ckpt)
    monkeypatch.setattr(cpu_features, "prefers_bf16", lambda: False)
    assert config._resolve_dtype("bfloat16", "float32", "cpu") == torch.bfloat16
    monkeypatch.undo()  # the real choice on this machine
    flags = cpu_features.cpu_flags()
    assert isinstance(flags, frozenset)
    assert cpu_features.prefers_bf16() == bool({"amx_bf16", "avx512_bf16"} & flags)


def _tile_kernel_here(dtype: torch.dtype):
    """The tile kernel a ``dtype`` layer takes on this machine by default (skip where none runs)."""
    picked = cpu_gemm._tile_kernel(dtype, "auto")
    if picked is None or not picked[0].supports(torch.empty(1, 1, dtype=dtype)) or not cpu_gemm.onednn_available():
        pytest.skip(f"no tile kernel for {dtype} here (or no oneDNN)")
    return picked[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_measured_tile_choice_sets_the_row_limit(monkeypatch, dtype) -> None:
    """By default a layer keeps what the timing chose for its shape: here (as if measured) its tile
    kernel (float32 panels; AMX, or bfloat16 panels without it) for up to 16 rows, oneDNN beyond;
    a shape where the kernel lost keeps its other kernels."""
    kernel = _tile_kernel_here(dtype)
    monkeypatch.setenv(cpu_gemm.ENV_VAR, "auto")
    monkeypatch.setitem(cpu_gemm._TILE_CHOICE, (dtype, 48, 64), 16)
    monkeypatch.setitem(cpu_gemm._TILE_CHOICE, (dtype, 40, 64), 0)
    torch.manual_seed(0)
    layer = ReplicatedLinear(64, 48, False, dtype)
    layer.weight.data.normal_(0, 0.1)
    dense = layer.weight.data.clone()
    assert layer.pack_weight() and layer.packed.pagoda_tiles_rows == 16 and layer.weight.numel() == 0
    assert layer.packed.pagoda_tiles_kernel is kernel
    calls = []
    real = kernel.linear
    monkeypatch.setattr(kernel, "linear", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    for rows in (1, 16, 17):
        x = torch.randn(rows, 64).to(dtype)
        torch.testing.assert_close(layer(x).float(), F.linear(x.float(), dense.float()), rtol=2e-2, atol=2e-2)
    assert calls == [1, 16]
    lost = ReplicatedLinear(64, 40, False, dtype)
    assert lost.pack_weight() and getattr(lost.packed, "pagoda_tiles", None) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_timed_tile_choice_runs(monkeypatch, dtype) -> None:
    """The start-up timing itself: a verdict of 0 (not chosen), 4, 16 or MAX_ROWS rows, and a layer
    that follows it."""
    kernel = _tile_kernel_here(dtype)
    monkeypatch.setenv(cpu_gemm.ENV_VAR, "auto")
    monkeypatch.setenv(select.CHOICE_CACHE_VAR, "off")  # timed here, not read from an earlier run's file
    monkeypatch.delitem(cpu_gemm._TILE_CHOICE, (dtype, 72, 96), raising=False)
    layer = ReplicatedLinear(96, 72, False, dtype)
    assert layer.pack_weight()
    verdict = cpu_gemm._TILE_CHOICE[(dtype, 72, 96)]
    assert verdict in (0, 4, 16, kernel.MAX_ROWS)
    assert getattr(layer.packed, "pagoda_tiles_rows", 0) == verdict


# ---- the timed choices kept on disk ----------------------------------------------------------------

def test_choice_cache_is_read_back_only_by_the_same_machine_identity(tmp_path) -> None:
    """A second start with the same identity reads what the first wrote; another identity (here a
    thread count) has a file of its own and finds nothing; a corrupt file counts as empty."""
    from pagoda.kernels import choice_cache

    identity = choice_cache.machine_identity(threads=2)
    assert {"cpu", "flags", "level", "variant", "torch", "threads", "sources"} <= set(identity)
    first = choice_cache.ChoiceCache(tmp_path, identity, "cpu-gemm")
    assert first.get("gemv 8x8 torch.float32") is None
    first.put("gemv 8x8 torch.float32", True)
    first.put("tiles x 8x8", 16)
    again = choice_cache.ChoiceCache(tmp_path, dict(identity), "cpu-gemm")
    assert again.path == first.path and again.get("gemv 8x8 torch.float32") is True and again.get("tiles x 8x8") == 16
    other = choice_cache.ChoiceCache(tmp_path, choice_cache.machine_identity(threads=3), "cpu-gemm")
    assert other.path != first.path and len(other) == 0
    first.path.write_text("{not json")
    assert len(choice_cache.ChoiceCache(tmp_path, identity, "cpu-gemm")) == 0
    assert len(choice_cache.ChoiceCache(None, identity, "cpu-gemm")) == 0  # off: nothing kept


def test_choice_cache_dir_follows_the_environment(monkeypatch, tmp_path) -> None:
    for var in (select.CHOICE_CACHE_VAR, "PAGODA_CACHE_DIR", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert select.choice_cache_dir() == tmp_path / "home" / ".cache" / "pagoda" / "kernel-choices"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert select.choice_cache_dir() == tmp_path / "xdg" / "pagoda" / "kernel-choices"
    monkeypatch.setenv("PAGODA_CACHE_DIR", str(tmp_path / "pagoda"))
    assert select.choice_cache_dir() == tmp_path / "pagoda" / "kernel-choices"
    monkeypatch.setenv(select.CHOICE_CACHE_VAR, str(tmp_path / "mine"))
    assert select.choice_cache_dir() == tmp_path / "mine"
    monkeypatch.setenv(select.CHOICE_CACHE_VAR, "off")
    assert select.choice_cache_dir() is None


@needs_onednn
def test_a_second_start_reads_the_few_row_choice_instead_of_timing(monkeypatch, tmp_path) -> None:
    """The first layer of a shape times the kernels and writes the verdict; a later process (its
    in-memory choices empty) reads it and times nothing; another thread count times again."""
    from pagoda.kernels import gemv as cpu_gemv

    if not select.kernels_enabled() or not cpu_gemv.supports(torch.empty(56, 72)):
        pytest.skip("no gemv kernel here")
    monkeypatch.setenv(cpu_gemm.ENV_VAR, "auto")
    monkeypatch.setenv(select.CHOICE_CACHE_VAR, str(tmp_path))
    monkeypatch.delitem(cpu_gemm._GEMV_CHOICE, (56, 72, torch.float32), raising=False)
    timings = []
    real = cpu_gemm._best_of
    # the few-row timings (a float32 tile kernel, where the CPU has one, is timed too)
    monkeypatch.setattr(cpu_gemm, "_best_of", lambda *a: (a[2][0][0] == "gemv" and timings.append(a[2])) or real(*a))

    def start() -> bool:
        layer = ReplicatedLinear(72, 56, False, torch.float32)
        assert layer.pack_weight()
        return bool(getattr(layer.packed, "pagoda_gemv", False))

    first = start()
    assert [pairs[0][:2] for pairs in timings] == [("gemv", "onednn")]
    files = list(tmp_path.glob("cpu-gemm-*.json"))
    assert len(files) == 1 and "gemv 56x72 torch.float32" in files[0].read_text()
    cpu_gemm._GEMV_CHOICE.pop((56, 72, torch.float32))  # a new process: nothing in memory
    monkeypatch.setattr(cpu_gemm, "_STATS", cpu_gemm._Choices())
    from pagoda.kernels import choice_cache
    monkeypatch.setattr(choice_cache, "_CACHES", {})
    assert start() == first and len(timings) == 1 and cpu_gemm._STATS.read >= 1
    cpu_gemm._GEMV_CHOICE.pop((56, 72, torch.float32))
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if threads > 1 else 2)
    try:
        start()
    finally:
        torch.set_num_threads(threads)
    assert len(timings) == 2 and len(list(tmp_path.glob("cpu-gemm-*.json"))) == 2
    cpu_gemm._GEMV_CHOICE.pop((56, 72, torch.float32))


def test_cold_copies_stop_at_the_models_own_size(monkeypatch) -> None:
    """A weight is timed over copies passing 96 MiB, or the model's own weight bytes where those
    are fewer (a decode step streams no more between two uses of one weight); never under one."""
    w = torch.empty(1024, 1024)  # 4 MiB
    monkeypatch.setattr(cpu_gemm, "_stream_bytes", None)
    assert cpu_gemm.cold_copies(w) == 24
    monkeypatch.setattr(cpu_gemm, "_stream_bytes", 20 << 20)
    assert cpu_gemm.cold_copies(w) == 5
    monkeypatch.setattr(cpu_gemm, "_stream_bytes", 1 << 20)
    assert cpu_gemm.cold_copies(w) == 1
    monkeypatch.setattr(cpu_gemm, "_stream_bytes", 1 << 40)
    assert cpu_gemm.cold_copies(w) == 24
