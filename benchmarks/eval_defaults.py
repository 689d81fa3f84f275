"""What the data defaults cost at evaluation: one evaluation of ``crosstrain train``'s default run (tiny GPT,
embedded corpus, the 5% token split) with the default ``eval.max_batches`` against the whole split
(``eval.max_batches=all``), same process, same weights.

Last line: JSON ``{"val_tokens", "batches_default", "batches_all", "eval_s_default", "eval_s_all", "speedup"}``.
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=2, help="evaluations timed per setting (the best is kept)")
    parser.add_argument("--set", action="append", default=[], help="extra config overrides")
    args = parser.parse_args()
    from crosstrain.config import load_config
    from crosstrain.engine.run import build_run

    out: dict[str, float] = {}
    for name, value in (("default", None), ("all", "all")):
        sets = ["backend=cpu", "parallel.compile=false", *args.set]
        cfg = load_config(None, sets + ([f"eval.max_batches={value}"] if value else []))
        run = build_run(cfg, for_eval=True)
        try:
            assert run.eval is not None
            times = []
            for _ in range(args.repeat):
                start = time.perf_counter()
                run.evaluate()
                times.append(time.perf_counter() - start)
            out[f"batches_{name}"] = run.eval.batches
            out[f"eval_s_{name}"] = round(min(times), 3)
            out["val_tokens"] = int(run.recipe.data_split().get("val_tokens", 0))
        finally:
            run.close()
    out["speedup"] = round(out["eval_s_all"] / out["eval_s_default"], 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
