"""One Triton launch that loads a decode batch into the CUDA graphs' static buffers
(``StaticDecodeInputs.load``), where the torch way launches a copy and a fill for each of five
buffers and a zeroing and a copy for the block tables: a dozen tiny kernels between two replays
on the device's critical path, each also a launch for the host.

Rows ``[0, n)`` get the batch's ids, positions, slots, sequence and context lengths and
block-table rows; rows ``[n, size)`` the padding (0, 0, -1, 0, 0 and a zero row). Block-table
columns ``[w, zero_width)`` of every row become zero, ``w`` being the batch's table width and
``zero_width`` the widest any earlier load wrote (columns past it are still zero), so no block
id of an earlier step survives where the torch backend could read it.
"""
from __future__ import annotations

import torch

from pagoda.kernels.triton_import import HAS_TRITON, tl, triton

BLOCK_R = 16
BLOCK_C = 128

# Every step calls the kernel with new lengths, widths and view offsets: none of them may pick
# a specialization of its own (each one a JIT compile, a 150 ms stall of the step that first met
# it, seen on an H200 when a table's width first reached 16 blocks).
_INTS = ("n", "size", "width", "zero_width", "stride_bt", "stride_dbt", "pad_slot")
_POINTERS = ("ids_ptr", "pos_ptr", "slot_ptr", "lens_ptr", "ctx_ptr", "bt_ptr")


def step_jit_options(ints: tuple[str, ...], pointers: tuple[str, ...]) -> dict:
    """``triton.jit`` options for a kernel launched every step: no specialization on the values
    of ``ints`` or the alignment of ``pointers`` (where this Triton has the option)."""
    import inspect

    options: dict = {"do_not_specialize": ints}
    if "do_not_specialize_on_alignment" in inspect.signature(triton.jit).parameters:
        options["do_not_specialize_on_alignment"] = pointers
    return options


if HAS_TRITON:

    @triton.jit(**step_jit_options(_INTS, _POINTERS))
    def _load_rows_kernel(ids_ptr, pos_ptr, slot_ptr, lens_ptr, ctx_ptr, bt_ptr,
                          d_ids_ptr, d_pos_ptr, d_slot_ptr, d_lens_ptr, d_ctx_ptr, d_bt_ptr,
                          n, size, width, zero_width, stride_bt, stride_dbt, pad_slot,
                          BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        live = rows < size
        real = rows < n
        tl.store(d_ids_ptr + rows, tl.load(ids_ptr + rows, mask=real, other=0), mask=live)
        tl.store(d_pos_ptr + rows, tl.load(pos_ptr + rows, mask=real, other=0), mask=live)
        tl.store(d_slot_ptr + rows, tl.load(slot_ptr + rows, mask=real, other=pad_slot), mask=live)
        tl.store(d_lens_ptr + rows, tl.load(lens_ptr + rows, mask=real, other=0), mask=live)
        tl.store(d_ctx_ptr + rows, tl.load(ctx_ptr + rows, mask=real, other=0), mask=live)
        r64 = rows.to(tl.int64)[:, None]
        for c0 in range(0, zero_width, BLOCK_C):
            cols = c0 + tl.arange(0, BLOCK_C)[None, :]
            table = tl.load(bt_ptr + r64 * stride_bt + cols, mask=real[:, None] & (cols < width), other=0)
            tl.store(d_bt_ptr + r64 * stride_dbt + cols, table, mask=live[:, None] & (cols < zero_width))


def load_rows(src: tuple[torch.Tensor, ...], dst: tuple[torch.Tensor, ...], n: int, size: int, zero_width: int,
              pad_slot: int) -> None:
    """``src`` (ids, positions, slots, seq_lens, context_lens, block_tables ``[n, w]``) into
    ``dst`` (the static buffers, the same order, ``block_tables`` ``[N, W]``) as the module notes
    say; ``zero_width >= w``."""
    ids, pos, slots, lens, ctx, tables = src
    if any(t.stride(-1) != 1 for t in src + dst):
        raise ValueError("load_rows: every tensor needs a unit inner stride")
    if size == 0:
        return
    _load_rows_kernel[(triton.cdiv(size, BLOCK_R),)](
        ids, pos, slots, lens, ctx, tables, *dst, n, size, tables.shape[1], zero_width, tables.stride(0),
        dst[5].stride(0), pad_slot, BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C, num_warps=4)
