"""Tiny end-to-end run configs for the trainer tests (random tiny models, committed tokenizers)."""
import os
import subprocess
from pathlib import Path

import pytest
import yaml

FIXTURES = Path(__file__).parent / "fixtures"


def tiny_tree(out_dir, **changes):
    tree = {
        "output_dir": str(out_dir), "steps": 4, "seed": 3,
        "model": {"student": "tiny_llama", "teacher": "tiny_qwen2",
                  "student_tokenizer": "tiny_unigram", "teacher_tokenizer": "tiny_bpe"},
        "mesh": {"data": -1},
        "rollout": {"rollout_batch_size": 4, "n_samples_per_prompt": 2, "generate_max_len": 12,
                    "max_prompt_len": 64},
        "algorithm": {"name": "topk_strict", "ctkd_topk": 8, "chunked_loss_size": 64},
        "optimizer": {"lr": 1e-3, "train_batch_size": 8, "micro_batch_size": 4},
        "data": {"path": str(FIXTURES / "prompts.jsonl")},
        "checkpoint": {"every": 2, "keep": 5, "export_hf": False},
        "logging": {"tensorboard": False, "progress": False},
    }
    for dotted, value in changes.items():
        node = tree
        *head, last = dotted.split(".")
        for key in head:
            node = node.setdefault(key, {})
        node[last] = value
    return tree


@pytest.fixture
def write_config(tmp_path):
    def write(name="run", **changes):
        tree = tiny_tree(tmp_path / name, **{k.replace("__", "."): v for k, v in changes.items()})
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(tree))
        return path, Path(tree["output_dir"])
    return write


@pytest.fixture(scope="session")
def compile_cache(tmp_path_factory):
    """A persistent XLA cache for the tests' subprocesses (`subprocess_env`), so a program they
    share compiles once: `CTOPD_TEST_COMPILE_CACHE` when set (`make test` gives the pytest
    processes of each of its jobs one, so a later process reuses an earlier one's programs;
    jobs that run at once never share one), else a folder of this session. The pytest process
    itself does not use it: jaxlib crashed (segfault) inside the cache write,
    `executable.serialize()`, in the long-lived suite process, on different tests in different
    runs and never when a test ran alone; short-lived subprocesses have not."""
    return os.environ.get("CTOPD_TEST_COMPILE_CACHE") or str(tmp_path_factory.mktemp("xla_cache"))


def subprocess_env(compile_cache, devices=8, **extra):
    env = dict(os.environ)
    env.update({"XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", "JAX_PLATFORMS": "cpu",
                "JAX_COMPILATION_CACHE_DIR": compile_cache,
                "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
                "TOKENIZERS_PARALLELISM": "false"})
    env.update(extra)
    return env


@pytest.fixture
def read_only_dir(tmp_path):
    """A read-only tmpfs (root may write anywhere else); skipped where mounting is not allowed."""
    mount = tmp_path / "ro"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(mount)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a read-only tmpfs here (needs root)")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)
