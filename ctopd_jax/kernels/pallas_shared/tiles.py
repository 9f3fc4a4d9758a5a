"""How the Pallas strict kernels stream tiles: padding, backend, `Tiles`, the pallas call.

Tiling (fits shared memory at any vocabulary width): one program per block of 64 rows
(`block_rows` in the kernel's table of sizes: the row tile of Mosaic GPU's WGMMA register
layout); the inputs and the gradient stay in
global memory and every pass streams [64, tile] blocks through shared memory with
`plgpu.emit_pipeline` (TMA copies, two stages in flight). A program's shared memory is then
2 stages × (2 inputs + 1 output) × 64 × 128 × 4 B = 192 KiB at the 128-column tile (`block_cols`)
(plus 512 B for the block's row weights and losses), independent of V∩ (H100/H200 allow
227 KiB). Row vectors (max, sums, argmax) live in registers in the reduced-WGMMA
("row") layout.

Interpret mode (CPU tests) streams the same tiles with a fori_loop over views of the whole
arrays: the per-tile math is the same code, only the tile transport and the layout hints differ.

Backend: interpret=True runs anywhere (a grid `pallas_call`). Compiled GPU kernels use Mosaic
GPU (Hopper) through `plgpu.kernel`, the form jax 0.10 to 0.12 all lower (jax 0.11 dropped the
Mosaic GPU lowering of grid `pallas_call`s). They lower on CPU for the real width
(tests/kernels/test_pallas_cuda_lowering.py exports them with platforms=["cuda"]) and ran
compiled on an H200 in the GPU check (benchmarks/RESULTS.md).
CTOPD_PALLAS_GPU_BACKEND=triton selects the Triton lowering instead: the same kernel body with
the interpret-mode tile loop (each [64, tile] tile loaded from global memory into registers);
it lowers too (to Triton IR; Triton's own register and shared-memory allocation happens when
XLA compiles it on a GPU, so lowering on CPU cannot check it).
"""
from __future__ import annotations

import dataclasses
import inspect
import os
from typing import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

PIPELINE_STAGES = 2
ROW_AXIS = "row_blocks"  # the grid axis name of the Mosaic GPU kernel


def _mosaic_gpu():
    """jax.experimental.pallas.mosaic_gpu, imported on first use: its import takes ~2.7 s, and
    only a compiled GPU kernel needs it (not a CPU run, not interpret mode)."""
    from jax.experimental.pallas import mosaic_gpu   # ~2.7 s: only on first GPU use
    return mosaic_gpu


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def pad_to(x, rows: int, cols: int, value):
    pad_r, pad_c = rows - x.shape[0], cols - x.shape[1]
    if pad_r == 0 and pad_c == 0:
        return x
    return jnp.pad(x, ((0, pad_r), (0, pad_c)), constant_values=value)


def pad_blocks(zs_bar, zt_bar, w, block_rows: int, block_cols: int):
    """Pad student/teacher rows [c, V∩] and weights [c] to whole row blocks and column tiles.

    Padding columns are -inf (no mass, after every real column, so top-k never picks one);
    padding rows get finite zeros so they stay NaN-free, and weight 0 so they add nothing.
    Returns (zs, zt, wp, tile).
    """
    rows, cols = zs_bar.shape
    tile = min(block_cols, round_up(cols, 8))
    cols_p, rows_p = round_up(cols, tile), round_up(max(rows, 1), block_rows)
    zs = pad_to(zs_bar.astype(jnp.float32), rows_p, cols_p, -jnp.inf)
    zt = pad_to(zt_bar.astype(jnp.float32), rows_p, cols_p, -jnp.inf)
    if rows_p > rows:
        pad_row = jnp.arange(rows_p)[:, None] >= rows
        zs = jnp.where(pad_row, 0.0, zs)
        zt = jnp.where(pad_row, 0.0, zt)
    wp = jnp.pad(w.astype(jnp.float32), (0, rows_p - rows))
    return zs, zt, wp, tile


def gpu_backend() -> str:
    """The Pallas GPU backend for compiled kernels: CTOPD_PALLAS_GPU_BACKEND, default mosaic."""
    backend = os.environ.get("CTOPD_PALLAS_GPU_BACKEND", "mosaic").lower()
    if backend not in ("mosaic", "triton"):
        raise ValueError(f"CTOPD_PALLAS_GPU_BACKEND={backend!r}; use 'mosaic' or 'triton'")
    return backend


def kernel_mode(interpret: bool) -> str:
    """"interpret", or the GPU backend ("mosaic" / "triton") of a compiled kernel."""
    return "interpret" if interpret else gpu_backend()


@dataclasses.dataclass(frozen=True)
class Tiles:
    """How one program walks its [block_rows, cols_p] slab in [block_rows, tile] tiles.

    mode "mosaic": compiled Mosaic GPU (refs in global memory, tiles pipelined through shared
    memory by TMA, explicit register layouts). "interpret" and "triton": a fori_loop over views
    of the whole arrays (Triton loads each tile from global memory into registers).
    """
    block_rows: int
    tile: int
    n_tiles: int
    mode: str
    block: object = None   # this program's row block once read (`fixed`), else read per stream

    @property
    def gpu(self) -> bool:
        """Mosaic GPU: explicit layouts and pipelines."""
        return self.mode == "mosaic"

    @property
    def shape(self):
        return (self.block_rows, self.tile)

    def _layouts(self):
        plgpu = _mosaic_gpu()
        return plgpu, plgpu.Layout.WGMMA, plgpu.Layout.WGMMA.reduce(1)

    def row_vec(self, value, dtype=jnp.float32):
        """A constant [block_rows] row vector (in the row layout on GPU)."""
        v = jnp.full((self.block_rows,), value, dtype)
        if self.gpu:
            plgpu, _, row = self._layouts()
            v = plgpu.layout_cast(v, row)
        return v

    def load(self, ref):
        """A [block_rows, tile] tile from a (shared-memory) tile ref, as float32."""
        if self.gpu:
            plgpu, tiled, _ = self._layouts()
            return _gpu_load(plgpu, ref, tiled).astype(jnp.float32)
        return ref[...].astype(jnp.float32)

    def load_rows(self, ref):
        """A [block_rows] vector block (row weights) in the row layout."""
        if self.gpu:
            plgpu, _, row = self._layouts()
            return _gpu_load(plgpu, ref, row).astype(jnp.float32)
        return ref[...].astype(jnp.float32)

    def cols(self, j):
        """Global column index of every element of tile j (int32 [block_rows, tile])."""
        if self.gpu:
            plgpu, tiled, _ = self._layouts()
            local = plgpu.broadcasted_iota(jnp.int32, self.shape, 1, layout=tiled)
        else:
            local = jax.lax.broadcasted_iota(jnp.int32, self.shape, 1)
        return local + j * self.tile

    def bcast(self, v):
        """Row vector [block_rows] -> [block_rows, tile]."""
        return jax.lax.broadcast_in_dim(v, self.shape, (0,))

    def block_index(self):
        """This program's row block: a grid axis of plgpu.kernel on Mosaic GPU."""
        if self.block is not None:
            return self.block
        return jax.lax.axis_index(ROW_AXIS) if self.gpu else pl.program_id(0)

    def fixed(self) -> "Tiles":
        """These tiles with the row block read once, for streams inside a loop body (where
        interpret mode cannot read a program id)."""
        return dataclasses.replace(self, block=self.block_index())

    def stream(self, body: Callable, ins, outs=(), init=None):
        """carry = body(j, *in_tiles, *out_tiles, carry) for every tile j of this row block.

        Input tiles are refs to read with `load`; output tiles are refs to assign whole.
        """
        i = self.block_index()
        if self.gpu:
            plgpu = _mosaic_gpu()
            spec = pl.BlockSpec(self.shape, lambda j: (i, j))
            steps = min(PIPELINE_STAGES, self.n_tiles)
            if init is None:
                def step(idx, *refs):
                    body(idx[0], *refs, None)
            else:
                def step(idx, *refs):
                    *refs, carry = refs
                    return body(idx[0], *refs, carry)
            return plgpu.emit_pipeline(
                step, grid=(self.n_tiles,), in_specs=[spec] * len(ins),
                out_specs=[spec] * len(outs), max_concurrent_steps=steps,
                init_carry=init)(*ins, *outs)

        def step(j, carry):
            views = [r.at[pl.ds(i * self.block_rows, self.block_rows),
                          pl.ds(j * self.tile, self.tile)] for r in (*ins, *outs)]
            return body(j, *views, carry)

        return jax.lax.fori_loop(0, self.n_tiles, step, init)


def _gpu_load(plgpu, ref, layout):
    """A whole shared-memory ref into registers. jax 0.10 takes the index as an argument of its
    own, 0.11 deprecates it and 0.12 removes it."""
    idx = inspect.signature(plgpu.load).parameters.get("idx")
    if idx is not None and idx.default is inspect.Parameter.empty:
        return plgpu.load(ref, (), layout=layout, optimized=False)
    return plgpu.load(ref, layout=layout, optimized=False)


def strict_pallas_call(kernel, zs, zt, wp, *, tiles: Tiles, name: str):
    """(per-row loss [rows_p], gradient [rows_p, cols_p]) of a divergence_passes kernel."""
    rows_p, cols_p = zs.shape
    out_shape = (jax.ShapeDtypeStruct((rows_p,), jnp.float32),
                 jax.ShapeDtypeStruct((rows_p, cols_p), jnp.float32))
    if tiles.gpu:
        return _mosaic_gpu_call(kernel, zs, zt, wp, tiles=tiles, out_shape=out_shape)
    whole = pl.BlockSpec(memory_space=pl.ANY)
    interpret = tiles.mode == "interpret"
    row_vec = pl.BlockSpec((tiles.block_rows,), lambda i: (i,))
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(rows_p // tiles.block_rows,),
        in_specs=[whole, whole, row_vec],
        out_specs=(row_vec, whole),
        interpret=interpret,
        compiler_params=None if interpret else _triton_params(),
        name=name,
    )(zs, zt, wp)


def _triton_params():
    return pltriton.CompilerParams(num_warps=4, num_stages=1)


def _mosaic_gpu_call(kernel, zs, zt, wp, *, tiles: Tiles, out_shape):
    """The kernel as a Mosaic GPU `plgpu.kernel` (jax >= 0.11 lowers Mosaic GPU only this way).

    Every operand stays in global memory; the block's row weights come in and its per-row
    losses go out through [block_rows] shared-memory buffers (one TMA copy each way).
    """
    plgpu = _mosaic_gpu()

    def body(zs_ref, zt_ref, w_gmem, loss_gmem, grad_ref, w_smem, loss_smem, barrier):
        rows = pl.ds(tiles.block_index() * tiles.block_rows, tiles.block_rows)
        plgpu.copy_gmem_to_smem(w_gmem.at[rows], w_smem, barrier)
        plgpu.barrier_wait(barrier)
        kernel(zs_ref, zt_ref, w_smem, loss_smem, grad_ref)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(loss_smem, loss_gmem.at[rows])
        plgpu.wait_smem_to_gmem(0)

    row_buffer = plgpu.SMEM((tiles.block_rows,), jnp.float32)
    return plgpu.kernel(
        body, out_type=out_shape,
        scratch_types=(row_buffer, row_buffer, plgpu.Barrier(num_arrivals=1)),
        grid=(zs.shape[0] // tiles.block_rows,), grid_names=(ROW_AXIS,),
        compiler_params=plgpu.CompilerParams())(zs, zt, wp)
