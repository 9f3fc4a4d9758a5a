"""The rollout's memory-bound floor, for the planner (`python -m ctopd_jax.plan`).

A decode step reads the decode weights once and the K/V of every token that exists in the
batch, and writes almost nothing, so its time is at least

    bytes per step / HBM bandwidth,   bytes per step = W + B x L x kv,

with W the decode weights (parameters x compute-dtype bytes: the sampler's bf16 copy, vLLM's
bf16 weights), B the samples decoded together, L their mean cached length and kv the bytes one
cached token takes over all layers (K and V). A step yields B tokens, so the floor on the
throughput is B x bandwidth / bytes per step and the rollout takes at least generated tokens /
that. Averaged over a sample's life its cached length is prompt + fill x new / 2.

B is what the cache holds. The JAX sampler's page pool is what the XLA pool leaves during the
rollout beside the trainer's persistent state (student parameters, optimizer state, teacher
weights, the decode copy; gradients and activations are not live then), in pages of
`rollout.jax_page_size` tokens; the n samples of a prompt share its prompt pages. Moving the
optimizer state to host memory for the rollout (`optimizer.offload_during_rollout`) frees its
bytes for pages. vLLM's B is the full-length sequences its share holds.

Bandwidths are the vendors' HBM figures (a lead, not a reading): H100 SXM 3.35 TB/s, H200 4.8,
B200 8.0. FLOPs do not bound a decode step at these batch sizes (a 3B model at B = 64 needs
~0.4 TFLOP a step, well under a millisecond of tensor-core time).
"""
from __future__ import annotations

import dataclasses
import math

HBM_TB_S = {"h100": 3.35, "h200": 4.8, "b200": 8.0}


def kv_bytes_per_token(cfg, c: int = 2) -> int:
    return cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * c


@dataclasses.dataclass(frozen=True)
class DecodeFloor:
    concurrent: int        # samples decoded together
    mean_len: float        # mean cached tokens per sample over its life
    bytes_per_step: float
    tok_s: float           # floor on decode tokens / s
    seconds: float         # floor on the rollout's decode time

    def describe(self, device: str) -> str:
        return (f"{self.concurrent} samples x {self.mean_len:.0f} mean cached tokens: "
                f"{self.bytes_per_step / 1e9:.2f} GB per step / {HBM_TB_S[device]:g} TB/s -> "
                f"<= {self.tok_s:,.0f} tok/s, >= {self.seconds:,.0f} s of decode")


def decode_floor(params: int, cfg, c: int, device: str, concurrent: float, samples: int,
                 prompt: int, new: float) -> DecodeFloor:
    """The floor for `samples` samples of `new` generated tokens after `prompt`-token prompts,
    decoded `concurrent` at a time (fewer if there are fewer samples)."""
    b = max(1, min(int(concurrent), samples))
    mean_len = prompt + new / 2
    step = params * c + b * mean_len * kv_bytes_per_token(cfg, c)
    tok_s = b * HBM_TB_S[device] * 1e12 / step
    return DecodeFloor(b, mean_len, step, tok_s, samples * new / tok_s)


def sampler_concurrency(room_bytes: float, cfg, c: int, page: int, prompt: int, new: float,
                        n: int, slots: int) -> tuple[int, int]:
    """(pages, samples) the JAX sampler holds in `room_bytes`: a sample takes its own pages
    for its tail and generated tokens plus 1/n of its prompt's shared pages."""
    pages = max(0, int(room_bytes // (kv_bytes_per_token(cfg, c) * page)))
    per_sample = prompt // page / n + math.ceil((prompt % page + new) / page)
    return pages, min(slots, int(pages // per_sample))


def rollout_floor(r, student, c: int, device: str, params: int, gpus: int, tensor: int,
                  fill: float, notes: list, *, vllm_seqs=None, pool=0.0, live=0.0,
                  optimizer=0.0) -> DecodeFloor:
    """The decode floor of the rollout section `r` on one engine, with its lines in `notes`:
    vLLM decodes `vllm_seqs` at a time; the JAX sampler what its budget holds, and the room
    the XLA `pool` leaves beside the `live` trainer state (with and without the `optimizer`
    state offloaded) is reported."""
    samples = math.ceil(r.rollout_batch_size * r.n_samples_per_prompt * tensor / gpus)
    new = fill * r.generate_max_len
    if vllm_seqs is not None:
        floor = decode_floor(params / tensor, student, c, device, vllm_seqs, samples,
                             r.max_prompt_len, new)
        notes.append(f"decode floor (vLLM share): {floor.describe(device)}")
        return floor
    kv = kv_bytes_per_token(student, c) / tensor
    shape = (student, c, r.jax_page_size, r.max_prompt_len, new, r.n_samples_per_prompt,
             r.jax_decode_slots)
    room = pool - live
    pages, conc = sampler_concurrency(min(room, r.jax_kv_cache_budget_gb * 1e9) * tensor, *shape)
    room_pages, room_conc = sampler_concurrency(room * tensor, *shape)
    off_pages, off_conc = sampler_concurrency((room + optimizer) * tensor, *shape)
    floor = decode_floor(params / tensor, student, c, device, conc, samples, r.max_prompt_len,
                         new)
    notes.append(f"JAX sampler: {kv / 1e3:.1f} kB per cached token; the budget "
                 f"({r.jax_kv_cache_budget_gb:g} GB) holds {pages:,} pages of {r.jax_page_size} "
                 f"tokens = {conc} concurrent samples (of {r.jax_decode_slots} slots)")
    notes.append(f"room during the rollout beside the trainer's state ({live / 1e9:.1f} GB): "
                 f"{max(room, 0) / 1e9:.1f} GB = {room_pages:,} pages = {room_conc} concurrent "
                 f"samples; with optimizer.offload_during_rollout {(room + optimizer) / 1e9:.1f} "
                 f"GB = {off_pages:,} pages = {off_conc} samples")
    notes.append(f"decode floor (JAX sampler): {floor.describe(device)}")
    return floor
