"""The planner: parameter counts, verdicts and exit codes, and its activation figures against
XLA's compile-only memory analysis of the real Decoder on CPU (no allocation: eval_shape).

Tolerance of the compile-only checks: the estimate must land within [0.8, 1.25] of XLA's
`temp_size_in_bytes`. The planner counts the tensors a layer keeps for its backward; XLA fuses
some element-wise ops away and keeps a few extra copies (transposes, the embedding gradient's
scatter buffer), which moved the ratio between 0.86 and 1.08 over 12 shapes here. A term left
out or counted twice is a factor of 1.5 to 3 at these shapes (the [T, T] scores alone are 3x the
rest at T = 512), so the window separates "the formula is right" from "a term is wrong".
Shapes are float32 because XLA CPU computes bf16 in float32 internally (docs/architecture.md,
"Scale"), so a bf16 estimate could not be checked here.
"""
from __future__ import annotations

import dataclasses
import json

import pytest

from ctopd_jax.common.cli import run
from ctopd_jax.models import PRESETS, ModelConfig
from ctopd_jax.plan import model as plan_model, planner as plan


def _cli(argv):
    return run(plan.main, argv, "python -m ctopd_jax.plan")


def test_param_counts_match_the_published_models():
    # Published totals of meta-llama/Llama-3.2-3B (tied) and Qwen/Qwen2.5-7B (untied).
    assert plan_model.param_count(PRESETS["llama3_2_3b"]()) == 3_212_749_824
    assert plan_model.param_count(PRESETS["qwen2_5_7b"]()) == 7_615_616_512


@pytest.mark.parametrize("spec,preset", [
    ("checkpoints/Llama-3.2-3B-Instruct", "llama3_2_3b"),
    ("/models/qwen2.5-7b-instruct", "qwen2_5_7b"),
    ("preset:tiny_qwen2", "tiny_qwen2"),
    ("tiny_llama", "tiny_llama"),
    ("checkpoints/Mistral-7B", None),
])
def test_presets_are_matched_by_directory_name(spec, preset):
    assert plan_model.preset_for_name(spec) == preset


def test_an_hf_config_json_wins_over_the_name(tmp_path):
    model_dir = tmp_path / "Llama-3.2-3B-Instruct"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(PRESETS["tiny_llama"]().to_hf_dict()))
    cfg, source = plan_model.resolve_model(str(model_dir), None, "student", "bfloat16", "float32")
    assert cfg.hidden_size == 128 and cfg.num_layers == 2
    assert source.endswith("config.json")


def test_einsum_attention_grows_quadratically_and_blockwise_linearly():
    cfg = PRESETS["llama3_2_3b"]()
    for kind, expected in (("einsum", 3.5), ("blockwise", 2.0)):
        short = plan_model.activation_bytes(cfg, 1, 5120, remat=True, attention=kind)
        long = plan_model.activation_bytes(cfg, 1, 10240, remat=True, attention=kind)
        assert long / short == pytest.approx(expected, rel=0.15), kind


def test_the_shipped_configs_fit_where_their_headers_say(capsys):
    # The two 8-GPU configs on 8 H100s with the launchers' XLA pool (0.55), the single-GPU one
    # on an H200 with its launcher's 0.75; planned for blockwise / cuDNN attention (an einsum's
    # [T, T] scores cannot fit 10k tokens, see the next test).
    for name, device, gpus, pool in (("paper_8gpu_strict_full", "h100", "8", "0.55"),
                                     ("paper_8gpu_strict_top16", "h100", "8", "0.55"),
                                     ("single_gpu_full_workload", "h200", "1", "0.75")):
        assert _cli(["--config", f"configs/{name}.yaml", "--device", device, "--gpus", gpus,
                     "--attention", "blockwise", "--xla-mem-fraction", pool]) == 0, name
        assert capsys.readouterr().out.strip().splitlines()[-1].startswith("FITS")


# Qwen/Qwen2.5-1.5B-Instruct's published config.json (no preset: the planner reads it from the
# checkpoint directory, as a user's run would).
QWEN2_5_1_5B = {"architectures": ["Qwen2ForCausalLM"], "hidden_act": "silu", "hidden_size": 1536,
                "intermediate_size": 8960, "max_position_embeddings": 32768, "model_type": "qwen2",
                "num_attention_heads": 12, "num_hidden_layers": 28, "num_key_value_heads": 2,
                "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "tie_word_embeddings": True,
                "torch_dtype": "bfloat16", "use_sliding_window": False, "vocab_size": 151936,
                "bos_token_id": 151643, "eos_token_id": 151645}


def test_the_gsm8k_lora_config_loads_and_fits_one_h100(tmp_path, capsys):
    from ctopd_jax.config import load_config, validate

    config = load_config("configs/gsm8k_lora_opd.yaml")
    validate(config, device_count=1)
    assert (config.algorithm.name, config.lora.rank, config.mesh.data) == ("opd", 16, 1)
    assert config.data.path != config.evaluation.dataset   # evaluation on the held-out split
    student = tmp_path / "Qwen2.5-1.5B-Instruct"
    student.mkdir()
    (student / "config.json").write_text(json.dumps(QWEN2_5_1_5B))
    assert _cli(["--config", "configs/gsm8k_lora_opd.yaml", "--device", "h100",
                 "--set", f"model.student={student}"]) == 0
    out = capsys.readouterr().out
    assert "LoRA rank 16" in out
    assert out.strip().splitlines()[-1].startswith("FITS")


def test_too_large_a_micro_batch_names_the_item_and_the_setting(capsys):
    code = _cli(["--config", "configs/paper_8gpu_strict_full.yaml", "--device", "h100",
                 "--attention", "blockwise", "--set", "optimizer.micro_batch_size=128"])
    out = capsys.readouterr().out
    assert code == 1
    verdict = out.strip().splitlines()[-1]
    assert verdict.startswith("DOES NOT FIT") and "micro_batch_size" in verdict


def test_einsum_attention_at_10k_tokens_does_not_fit_on_an_h100(capsys):
    code = _cli(["--config", "configs/paper_8gpu_strict_full.yaml", "--device", "h100",
                 "--attention", "einsum"])
    assert code == 1
    assert "student activations" in capsys.readouterr().out.strip().splitlines()[-1]


def test_fsdp_divides_the_persistent_state(capsys):
    rows = {}
    for fsdp in (1, 8):
        assert _cli(["--config", "configs/paper_8gpu_strict_full.yaml", "--device", "b200",
                     "--gpus", "8", "--mesh", f"data={8 // fsdp},fsdp={fsdp},tensor=1",
                     "--json"]) in (0, 1)
        out = json.loads(capsys.readouterr().out)
        rows[fsdp] = {r["item"]: r["bytes"] for r in out["rows"]}
    for item in ("student parameters", "optimizer state (AdamW m, v)", "teacher weights"):
        assert rows[1][item] == pytest.approx(8 * rows[8][item])


SERVED = ["--set", "teacher.engine=vllm_server", "--set", "teacher.url=http://teacher:8000",
          "--set", "algorithm.name=teacher_topk_strict"]


def test_a_served_teacher_shows_the_memory_it_takes_off_each_device(capsys):
    """paper_8gpu_strict_full on 8 H100s: the Qwen2.5-7B teacher (7,615,616,512 parameters,
    published) in bf16, FSDP over 8, leaves each device, and the strict loss chunk (2,048 rows,
    the student step is the peak) loses the teacher's float32 logits and log-softmax
    (2 x V_T = 2 x 152,064) and the projected V∩ pair (2 x 109,567)."""
    want = 7_615_616_512 * 2 / 8 + 2048 * 4 * (2 * 152_064 + 2 * 109_567)
    plans = {}
    for engine, extra in (("local", []), ("served", SERVED)):
        assert _cli(["--config", "configs/paper_8gpu_strict_full.yaml", "--device", "h100",
                     "--gpus", "8", "--attention", "blockwise", "--json", *extra]) == 0
        plans[engine] = json.loads(capsys.readouterr().out)
    local, served = plans["local"], plans["served"]
    assert local["saved"] is None
    assert served["saved"]["bytes"] == pytest.approx(want, rel=1e-12)
    assert served["saved"]["item"] == "saved by serving the teacher"
    items = {r["item"]: r["bytes"] for r in served["rows"]}
    assert "teacher weights" not in items and "teacher scoring (prefill)" not in items
    assert items["loss chunk working set"] == 2048 * 4 * 3 * 128_256   # 3 x V_S of Llama-3
    total = lambda p: sum(r["bytes"] for r in p["rows"])
    assert total(local) - total(served) == pytest.approx(want, rel=1e-12)
    assert _cli(["--config", "configs/paper_8gpu_strict_full.yaml", "--device", "h100",
                 "--gpus", "8", "--attention", "blockwise", *SERVED]) == 0
    out = capsys.readouterr().out
    assert "| saved by serving the teacher" in out and "teacher served at http://teacher:8000" in out


@pytest.mark.parametrize("argv,field", [
    (["--config", "configs/missing.yaml", "--device", "h100"], "--config"),
    (["--config", "configs/paper_8gpu_strict_full.yaml", "--device", "h100", "--gpus", "3"],
     "mesh"),
    (["--config", "configs/paper_8gpu_strict_full.yaml", "--device", "h100",
      "--set", "model.student=checkpoints/Mistral-7B"], "--student-preset"),
    (["--config", "configs/paper_8gpu_strict_full.yaml", "--device", "h100",
      "--set", "optimizer.micro_batch_size=0"], "optimizer.micro_batch_size"),
    (["--config", "configs/paper_8gpu_strict_full.yaml", "--device", "a100"], "--device"),
])
def test_bad_input_is_one_line_and_exit_2(argv, field, capsys):
    assert _cli(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and field in err and "Traceback" not in err


# ----------------------------------------------------------------------------- compile-only
def _decoder_temp(cfg, batch, seq):
    """temp_size_in_bytes of jit(grad(loss)) for the Decoder, from shapes only."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from ctopd_jax.models import Decoder

    graphdef, state = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))))

    def loss(state, ids):
        model = nnx.merge(graphdef, state)
        positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))
        return jnp.sum(model.hidden_states(ids, positions).astype(jnp.float32))

    ids = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    compiled = jax.jit(jax.grad(loss)).lower(state, ids).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def _tiny(layers, attention):
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    extra = {"attention": attention} if "attention" in fields else {}
    if attention != "einsum" and not extra:
        pytest.skip("this Decoder has only einsum attention")
    return PRESETS["tiny_llama"](num_layers=layers, dtype="float32", param_dtype="float32",
                                 **extra)


@pytest.mark.slow
@pytest.mark.parametrize("attention,layers,batch,seq", [
    ("einsum", 2, 16, 32),      # attention a small part
    ("einsum", 4, 2, 512),      # the [T, T] scores dominate: checks that they are counted
    ("blockwise", 2, 16, 32),
    ("blockwise", 2, 1, 2048),  # four 512-blocks: tiles a small part
])
def test_activation_estimate_matches_compile_only_memory_analysis(attention, layers, batch, seq):
    cfg = _tiny(layers, attention)
    measured = _decoder_temp(cfg, batch, seq)
    estimate = plan_model.activation_bytes(cfg, batch, seq, remat=False,
                                     attention=plan_model.attention_kind(cfg))
    assert 0.8 <= estimate / measured <= 1.25, (estimate, measured)


@pytest.mark.slow
@pytest.mark.parametrize("layers", [2, 8])
def test_remat_estimate_matches_a_scanned_layer_stack(layers):
    """The Decoder unrolls its layers, and XLA CPU ignores jax.checkpoint on unrolled layers
    (docs/architecture.md, "Scale"), so remat is checked on the Decoder's own DecoderLayer under
    lax.scan, where CPU honours it: L layer inputs plus one layer's live set, not L layers' sets."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from ctopd_jax.models.decoder import DecoderLayer, rope_cos_sin

    batch, seq = 16, 32
    cfg = _tiny(1, "einsum")
    graphdef, state = nnx.split(nnx.eval_shape(lambda: DecoderLayer(cfg, rngs=nnx.Rngs(0))))
    stacked = jax.tree.map(lambda s: jax.ShapeDtypeStruct((layers,) + s.shape, s.dtype), state)

    def loss(stacked, x):
        positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))
        cos, sin = rope_cos_sin(cfg, positions)
        try:  # the O(T) mask of models/attention.py, else the older dense [B, T, T] mask
            from ctopd_jax.models.attention import AttentionMask
            mask = AttentionMask(jnp.arange(seq, dtype=jnp.int32), jnp.ones((batch, seq), bool))
        except ImportError:
            mask = jnp.broadcast_to(jnp.tril(jnp.ones((seq, seq), bool))[None], (batch, seq, seq))

        @jax.checkpoint
        def body(x, layer_state):
            return nnx.merge(graphdef, layer_state)(x, cos, sin, mask)[0], None

        return jnp.sum(jax.lax.scan(body, x, stacked)[0])

    x = jax.ShapeDtypeStruct((batch, seq, cfg.hidden_size), jnp.float32)
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(stacked, x).compile()
    measured = compiled.memory_analysis().temp_size_in_bytes
    stack_cfg = cfg.replace(num_layers=layers)
    estimate = plan_model.layer_stack_bytes(stack_cfg, batch, seq, remat=True,
                                      attention=plan_model.attention_kind(stack_cfg))
    assert 0.8 <= estimate / measured <= 1.25, (estimate, measured)
    without = plan_model.layer_stack_bytes(stack_cfg, batch, seq, remat=False, attention="einsum")
    if layers == 8:
        assert measured < 0.5 * without  # remat really is honoured in this probe


def test_several_teachers_plan_each_local_teachers_weights(tmp_path, capsys):
    """paper_8gpu_strict_full on 8 H100s with teachers: a Qwen2.5-7B on the mesh, a Llama-3.2-3B
    on the mesh, and a second Qwen2.5-7B served: one weights row per local teacher (published
    parameter counts, bf16, FSDP 8), none for the served one, which is what serving saves (the
    same model stays local, so the transient peak does not move)."""
    import yaml

    tree = yaml.safe_load(open("configs/paper_8gpu_strict_full.yaml"))
    tree["teachers"] = [{"name": "math", "checkpoint": "checkpoints/Qwen2.5-7B-Instruct"},
                        {"name": "small", "checkpoint": "preset:llama3_2_3b"},
                        {"name": "far", "checkpoint": "checkpoints/Qwen2.5-7B-Instruct",
                         "engine": "vllm_server", "url": "http://teacher:8000"}]
    tree["model"].pop("teacher_tokenizer", None)
    config = tmp_path / "teachers.yaml"
    config.write_text(yaml.safe_dump(tree))
    assert _cli(["--config", str(config), "--device", "h100", "--gpus", "8", "--attention",
                 "blockwise", "--json"]) == 0
    several = json.loads(capsys.readouterr().out)
    items = {r["item"]: r["bytes"] for r in several["rows"]}
    assert items["teacher weights (math)"] == 7_615_616_512 * 2 / 8
    assert items["teacher weights (small)"] == 3_212_749_824 * 2 / 8
    assert not any("far" in item for item in items)
    assert several["saved"]["bytes"] == pytest.approx(7_615_616_512 * 2 / 8, rel=1e-12)
    assert _cli(["--config", "configs/paper_8gpu_strict_full.yaml", "--device", "h100", "--gpus",
                 "8", "--attention", "blockwise", "--json"]) == 0
    one = json.loads(capsys.readouterr().out)
    total = lambda p: sum(r["bytes"] for r in p["rows"])
    assert total(several) - total(one) == pytest.approx(3_212_749_824 * 2 / 8, rel=1e-12)


def test_the_rollout_time_is_the_decode_floor_of_the_vllm_share(capsys):
    # The seed's single-GPU config (vLLM, 0.20 of an H200): the share holds 16 full-length
    # sequences; a step reads the bf16 weights and their KV at the mean length 2,048 + 4,096.
    assert _cli(["--config", "configs/single_gpu_full_workload.yaml", "--device", "h200",
                 "--attention", "blockwise", "--xla-mem-fraction", "0.75", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    weights = 3_212_749_824 * 2
    kv_token = 28 * 2 * 8 * 128 * 2                     # layers x (K, V) x kv heads x dim x bf16
    step = weights + 16 * (2048 + 4096) * kv_token
    tok_s = 16 * 4.8e12 / step
    assert out["time"]["seconds"]["rollout"] == pytest.approx(512 * 8192 / tok_s)
    assert 900 < out["time"]["seconds"]["rollout"] < 1100   # not the 366 s of an MFU guess
    assert any("decode floor (vLLM share): 16 samples" in n for n in out["notes"])


def test_the_jax_sampler_plan_counts_pages_beside_the_trainers_state(capsys):
    # The same config with the JAX sampler: during the rollout the H200's 0.9 pool holds the
    # float32 student (12.85 GB), AdamW m and v (25.70), the bf16 teacher (15.23) and the bf16
    # decode copy (6.43); the rest is pages. A full-length sample takes 128 prompt + 512 new
    # pages of 16 tokens.
    argv = ["--config", "configs/single_gpu_full_workload.yaml", "--device", "h200",
            "--attention", "blockwise", "--set", "rollout.engine=jax"]
    assert _cli(argv + ["--set", "rollout.jax_kv_cache_budget_gb=60", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    live = (3_212_749_824 * (4 + 8 + 2) + 7_615_616_512 * 2) / 1e9
    room = 0.9 * 141 - live
    page = 16 * 28 * 2 * 8 * 128 * 2 / 1e9
    fit, fit_offloaded = int(room / page // 640), int((room + 25.70) / page // 640)
    assert (fit, fit_offloaded) == (56, 78)
    note = next(n for n in out["notes"] if n.startswith("room during the rollout"))
    assert f"= {fit} concurrent samples" in note and f"= {fit_offloaded} samples" in note
    rows = {r["item"]: r for r in out["rows"]}
    assert rows["decode weights (compute-dtype copy)"]["bytes"] == 3_212_749_824 * 2
    # A budget past the room fails in the rollout phase, naming the setting.
    assert _cli(argv + ["--set", "rollout.jax_kv_cache_budget_gb=70"]) == 1
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("DOES NOT FIT: during the rollout") and "jax_kv_cache_budget_gb" in last


@pytest.mark.parametrize("device,tb_s", [("h100", 3.35), ("h200", 4.8), ("b200", 8.0)])
def test_the_decode_floor_scales_with_hbm_bandwidth(device, tb_s):
    cfg = PRESETS["llama3_2_3b"]()
    floor = plan.decode_floor(1e9, cfg, 2, device, 64, 512, 1024, 512)
    step = 2e9 + 64 * (1024 + 256) * plan.kv_bytes_per_token(cfg, 2)
    assert floor.bytes_per_step == step and floor.concurrent == 64
    assert floor.tok_s == pytest.approx(64 * tb_s * 1e12 / step)
