"""`python -m ctopd_jax.from_gguf SRC.gguf OUT_DIR [--sha256 HEX]`: a llama.cpp GGUF model
(Llama or Qwen2) as a transformers folder that train, evaluate and inspect_pair read.

The work is `gguf_convert.convert_gguf`; this is its command line: one line per bad input
(another architecture, a truncated file, a wrong checksum, an existing output folder) and exit
status 2, with nothing left at OUT_DIR.
"""
from __future__ import annotations

import sys

from tqdm import tqdm

from ctopd_jax.common.cli import Parser, run
from ctopd_jax.models.gguf_convert import convert_gguf

PROG = "python -m ctopd_jax.from_gguf"


def main(argv: list[str]) -> int:
    parser = Parser(prog=PROG, description=__doc__)
    parser.add_argument("src", help="the .gguf file")
    parser.add_argument("out_dir", help="the folder to write (must not exist)")
    parser.add_argument("--sha256", help="refuse the file unless its sha256 is this")
    args = parser.parse_args(argv)
    bars = []   # the bar starts at the first tensor: every check of the input comes before it

    def progress(name: str) -> None:
        if not bars:
            bars.append(tqdm(desc="tensors", unit="", file=sys.stderr, leave=False, disable=None))
        bars[0].update(1)

    try:
        out = convert_gguf(args.src, args.out_dir, sha256=args.sha256, progress=progress)
    finally:
        for bar in bars:
            bar.close()
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(run(main, None, PROG))
