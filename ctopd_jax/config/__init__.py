"""Run configuration: frozen dataclass sections, YAML files, `--set a.b=c` and `--mesh` overrides.

Every field is typed; `load_config` rejects unknown keys, values of the wrong type and impossible
values with one `ConfigError` that names the field (`optimizer.lr`) and says how to fix it,
before any model is loaded. Values given on the command line are parsed as YAML scalars
(`--set optimizer.lr=1e-5`, `--set rollout.engine=vllm`, `--set optimizer.betas=[0.9,0.95]`).
Numbers are read as people write them (`1e-5`, `1E5`, `.5`, `-2e-6`; see `YamlLoader`), in
files and `--set` alike; a float field rejects `.inf` / `nan`, an integer field takes `1e3`.

The package, one module per job: `sections` (the dataclasses of every YAML section and
`TrainConfig`), `yaml_text` (the YAML reader), `coerce` (a section from a mapping, by type
hint), `overrides` (`--set` parsing), `loading` (`load_config`, `from_dict`), `validate` (the
whole config's checks), `teachers` (per-teacher views), `served` (the served-engine settings the
teacher client shares), `algorithm_settings` (each objective's settings class, by name).
"""
from ctopd_jax.config.algorithm_settings import algorithm_class, objectives_defining
from ctopd_jax.config.errors import ConfigError, require
from ctopd_jax.config.loading import PATH_FIELDS, from_dict, load_config
from ctopd_jax.config.overrides import parse_override
from ctopd_jax.config.sections import (LORA_TARGETS, AlgorithmSection, CheckpointSection,
                                       DataSection, EvaluationSection, GuardSection,
                                       LoggingSection, LoraSection, MeshSection, ModelSection,
                                       NamedTeacherSection, OptimizerSection, RolloutSection,
                                       TeacherSection, TrainConfig)
from ctopd_jax.config.teachers import default_teacher, teacher_views
from ctopd_jax.config.validate import SEED_LIMIT, device_count_hint, validate
from ctopd_jax.config.yaml_text import DuplicateKeyError, YamlLoader, load_yaml

__all__ = ["LORA_TARGETS", "PATH_FIELDS", "SEED_LIMIT", "AlgorithmSection", "CheckpointSection",
           "ConfigError", "DataSection", "DuplicateKeyError", "EvaluationSection",
           "GuardSection", "LoggingSection", "LoraSection", "MeshSection", "ModelSection",
           "NamedTeacherSection", "OptimizerSection", "RolloutSection", "TeacherSection",
           "TrainConfig", "YamlLoader", "algorithm_class", "default_teacher",
           "device_count_hint", "from_dict", "load_config", "load_yaml", "objectives_defining",
           "parse_override", "require", "teacher_views",
           "validate"]
