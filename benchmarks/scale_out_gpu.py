"""GPU check of scale-out: 1 vs 2 SGLang servers on the one GPU behind sglang-router, GRPO steps.

    python3 benchmarks/scale_out_gpu.py [--model /tmp/models/tiny] [--out $OUT/scale_out.csv]
        [any other benchmarks/scale_out_sim.py flag]

Runs benchmarks/scale_out_sim.py with the GPU defaults: engine sglang, N = 1 then 2 (the one-GPU
plan gives two servers 0.35 of the GPU's memory each, one server 0.45), 16 groups x 8 samples
per step, 4 counted steps after a warm-up step. Prints the table (step time, rollout tokens/s,
hit rate vs theoretical, each worker's share of prompt tokens) and writes every step to the CSV
(default $OUT/scale_out.csv). On the H200 host: `bash tools/gpu/install.sh && bash
tools/gpu/validate.sh models scale-out` (the router's wheels come from .whl-router with .whl-web; the
SGLang bundle does not fit beside them in one carry, so install it in the call just before).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import scale_out_sim  # noqa: E402  (the benchmark next to this file)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    out = Path(os.environ.get("OUT", "/tmp/artsg-out")) / "scale_out.csv"
    if "--out" in argv:
        i = argv.index("--out")
        out = Path(argv[i + 1])
        del argv[i:i + 2]
    defaults = ["--engine", "sglang", "--servers", "1", "2", "--groups", "16", "--group-size", "8", "--steps", "4",
                "--csv", str(out)]
    if Path("/tmp/models/tiny/config.json").exists():  # validate.sh's `models` phase builds it there
        defaults += ["--model", "/tmp/models/tiny"]
    return scale_out_sim.main(defaults + argv)  # later flags win


if __name__ == "__main__":
    raise SystemExit(main())
