#!/usr/bin/env python3
"""The embedder's memory and time over many batch shapes: exact packed widths against widths rounded up
(``pack_width_multiple``), the default config's embedder engine in a fresh process each.

``--batches`` embed calls of 1-6 texts of 3-120 words each (seeded, the same in both arms), as the soak's
embeddings, ingests and queries send them. Every 250 calls: the distinct input shapes the model has seen,
malloc's bytes in use after a trim, the process's RSS and the seconds so far. Then each arm's vectors for the
same texts are compared (cosine): rounding changes only the padding, which the mask hides.

    python scripts/bench/embed_shapes.py [--batches 1500] [--multiples 1 16]
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORDS = ("the water runs down the headrace to the wheel while the miller weighs grain and the river floods "
         "its banks each spring").split()


def texts_for(batches: int) -> list[list[str]]:
    rng = random.Random(0)
    return [[" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 120))) for _ in range(rng.randint(1, 6))]
            for _ in range(batches)]


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def arm(multiple: int, batches: int, out: Path) -> None:
    import anyio
    import torch

    from headrace.daemon import heap
    from headrace.plugins.engines.retrieval import st_embed
    from headrace.plugins.protocols import EngineEnv, EngineSpec

    async def go() -> None:
        spec = EngineSpec(name="emb", plugin="sentence-transformers", options={"pack_width_multiple": multiple})
        env = EngineEnv(data_dir=out.parent, cache_dir=out.parent, lookup=lambda name: None,
                        observe_batch=lambda *a: None)
        engine = st_embed.factory(spec, env)
        shapes: set[tuple[int, ...]] = set()
        vectors = []
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)
            model = engine._model[0].auto_model
            forward = model.forward
            model.forward = lambda input_ids, **kw: (shapes.add(tuple(input_ids.shape)), forward(input_ids, **kw))[1]
            start = time.perf_counter()
            for n, texts in enumerate(texts_for(batches), 1):
                vectors.append(await engine.embed(texts))
                if n % 250 == 0:
                    heap.trim()
                    usage = heap.usage()
                    print(json.dumps({"multiple": multiple, "batches": n, "shapes": len(shapes),
                                      "malloc_in_use_mib": round(usage.in_use / 2**20, 1) if usage else None,
                                      "rss_mib": round(rss_mib(), 1),
                                      "seconds": round(time.perf_counter() - start, 1)}), flush=True)
            tg.cancel_scope.cancel()
        torch.save(torch.cat(vectors), out)

    anyio.run(go)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, default=1500)
    p.add_argument("--multiples", type=int, nargs="+", default=[1, 16])
    p.add_argument("--arm", type=int, help=argparse.SUPPRESS)  # one arm, in this process
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.arm is not None:
        arm(args.arm, args.batches, args.out)
        return
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        outs = {}
        for multiple in args.multiples:
            outs[multiple] = Path(tmp) / f"vectors-{multiple}.pt"
            subprocess.run([sys.executable, __file__, "--arm", str(multiple), "--batches", str(args.batches),
                            "--out", str(outs[multiple])], check=True)
        first, *rest = args.multiples
        for multiple in rest:
            cosine = (torch.load(outs[first]) * torch.load(outs[multiple])).sum(-1)
            print(json.dumps({"cosine": f"multiple {first} against {multiple}", "min": round(cosine.min().item(), 6),
                              "mean": round(cosine.mean().item(), 6)}))


if __name__ == "__main__":
    main()
