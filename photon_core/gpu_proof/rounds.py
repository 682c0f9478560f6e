"""Part "rounds": the production decode loop (photon_core.megakernel.decode_loop) run three ways
from the same state: the host driving each step (launch, error flag, claim count and token read
back), one captured step replayed per token with one read each, and rounds of up to 8 steps per
CUDA-graph replay with one read per round (plus rounds whose token torch ops pick from the exposed
logits); for a step fed embeddings (Moondream 2), host-driven vs rounds whose device ops embed each
token, and its detect/point rounds captured vs launched eagerly. Tokens identical; time per token."""
from __future__ import annotations

import functools
import statistics
import time

from photon_core.gpu_proof.build import build, fill, preserved
from photon_core.gpu_proof.checks import Ctx
from photon_core.megakernel.graph_family import dtype_of


def compare_ways(ctx: Ctx, ways: dict, n: int, what: str) -> tuple[bool, dict[str, float]]:
    """Each way of decoding ({name: (step, () -> tokens per row)}, "host" first) run round_repeats
    times from the same state (restored after each): whether all give host's tokens (a check, which
    also fails if the tokens never change), and each way's median time per token in us."""
    tokens: dict[str, list[list[int]]] = {}
    secs: dict[str, list[float]] = {k: [] for k in ways}
    for _ in range(ctx.sizes.round_repeats):
        for k, (s, fn) in ways.items():
            with preserved(s):
                ctx.sync()
                t = time.perf_counter()
                tokens[k] = fn()
                ctx.sync()
                secs[k].append(time.perf_counter() - t)
    same = all(t == tokens["host"] for t in tokens.values())
    varied = len({t for row in tokens["host"] for t in row}) > 1
    ctx.checks.expect(same and varied, f"{what}: tokens differ between the ways of decoding "
                                       f"({ {k: v[0][:6] for k, v in tokens.items()} }) or never change")
    return same, {k: statistics.median(v) / (n - 1) * 1e6 for k, v in secs.items()}


def prove_rounds(ctx: Ctx, fam, batch: int) -> dict | None:
    """The production decode loop's ways give the same tokens; time per token each."""
    import torch

    from photon_core.megakernel.decode_loop import DeviceDecode
    b = build(ctx, fam, batch)
    step = b.step(advance=True)
    g = step.graph_def
    result = next((n.args["name"] for n in g.nodes if n.op == "argmax" and n.args["advance"]), None)
    if result is None or any(n.op == "input" for n in g.nodes):
        return None   # the host must write something every step: nothing to run in rounds
    # "pick": rounds whose token device torch ops choose after each launch (the path Whisper's
    # logit rules take): torch's argmax of the exposed logits, on the same graph without advance
    # (the loop steps positions itself), its own arena filled with the same history.
    plain = b.step(advance=False) if "logits" in g.exposed else None
    dtype, B = dtype_of(fam.stress_dtype), batch
    for s in filter(None, (step, plain)):
        b.kernel(s)
        b.use_dtype(s, dtype)   # before capture: graphs keep the arena they saw
    # Built before the states are filled: on a GPU building captures the rounds, which runs steps.
    loops = {"replay": (step, DeviceDecode(step, result, chunk=1)), "rounds": (step, DeviceDecode(step, result))}
    if plain is not None:
        logits = plain.view("logits")
        loops["pick"] = (plain, DeviceDecode(plain, pick=lambda: torch.argmax(logits[:B], dim=-1)))
    rows = fam.rows(batch, "fixed")
    for s in filter(None, (step, plain)):
        fill(s, rows, seed=60 + batch)
        s.set_step(rows.tokens, rows.positions)
    n, kernel = ctx.sizes.round_tokens, b.kernel(step)
    col = g.results.index(result)

    def host_driven() -> list[list[int]]:
        out = [[t] for t in rows.tokens]
        for _ in range(n - 1):
            kernel.launch()
            kernel.raise_on_error()                        # two reads: the error flag, the claim count
            step.out.view(B, -1)[:, col].tolist()          # the token column, as the old loop read it
            for r, t in enumerate(step.dyn[:B].tolist()):
                out[r].append(t)
        return out

    ways = {"host": (step, host_driven),
            **{k: (s, functools.partial(lp.generate, rows.tokens, n, ())) for k, (s, lp) in loops.items()}}
    same, us = compare_ways(ctx, ways, n, f"rounds {fam.name} B{batch}")
    pick = f", rounds picking by torch ops {us['pick']:.1f}" if "pick" in us else ""
    res = dict(family=fam.name, batch=batch, dtype=fam.stress_dtype, tokens=n, same=same, ways=list(ways),
               us_per_token=us, rounds_read=loops["rounds"][1].rounds, x_host=us["rounds"] / us["host"])
    print(f"  {fam.name:22s} B{batch} {fam.stress_dtype}: {n - 1} steps, tokens identical {same}; us/token "
          f"host-driven {us['host']:.1f}, replay + read per token {us['replay']:.1f}, rounds of 8 "
          f"{us['rounds']:.1f} ({res['x_host']:.2f}x host-driven){pick}", flush=True)
    return res


def prove_feed_rounds(ctx: Ctx, fam, batch: int) -> dict | None:
    """Rounds of a step fed input embeddings (Moondream 2's caption/query): the host driving each
    step (launch, flags, the token column read, its embedding and the next positions written) vs
    rounds whose token column's embedding device ops write into the next input (decode_loop's
    `feed`), captured as CUDA graphs. Tokens identical; time per token of each."""
    import torch

    from photon_core.megakernel.decode_loop import DeviceDecode
    b = build(ctx, fam, batch)
    step = b.step(advance=False)
    g, B = step.graph_def, batch
    text = ("token",)
    kernel = b.kernel(step, text)
    b.use_dtype(step, dtype_of(fam.stress_dtype))   # before capture: graphs keep the arena they saw
    x, col = step.view("x"), step.out.view(B, -1)[:, g.results.index("token")]

    def feed(tok) -> None:
        x.copy_(fam.emb[tok.long()])
    # Built before the state is filled: on a GPU building captures the rounds, which runs steps.
    loop = DeviceDecode(step, pick=lambda: col, results=text, feed=feed)
    rows = fam.rows(batch, "fixed")
    fill(step, rows, seed=60 + batch)
    b.apply_inputs(step, rows.tokens, rows.positions)
    n = ctx.sizes.round_tokens

    def host_driven() -> list[list[int]]:
        out, pos = [[t] for t in rows.tokens], list(rows.positions)
        for _ in range(n - 1):
            kernel.launch()
            kernel.raise_on_error()
            toks = col.tolist()
            for r, t in enumerate(toks):
                out[r].append(t)
            pos = [p + 1 for p in pos]
            step.set_step(None, pos)
            x.copy_(fam.emb[torch.tensor(toks, device=x.device)])
        return out

    ways = {"host": (step, host_driven), "rounds": (step, lambda: loop.generate(rows.tokens, n, ()))}
    same, us = compare_ways(ctx, ways, n, f"rounds {fam.name} B{batch} (feed)")
    res = dict(family=fam.name, batch=batch, dtype=fam.stress_dtype, tokens=n, same=same, ways=list(ways),
               us_per_token=us, rounds_read=loop.rounds, x_host=us["rounds"] / us["host"], feed=True)
    print(f"  {fam.name:22s} B{batch} {fam.stress_dtype}: {n - 1} steps fed embeddings, tokens identical {same}; "
          f"us/token host-driven {us['host']:.1f}, rounds of 8 {us['rounds']:.1f} ({res['x_host']:.2f}x)", flush=True)
    return res


def prove_object_rounds(ctx: Ctx, fam, batch: int) -> dict:
    """Moondream 2's detect/point rounds (models/moondream/object_rounds.py): rounds of
    captured CUDA graphs whose device ops choose each row's next input (the encoded coordinate or
    size, or the token's embedding) and its next phase, against the same rounds run launch by
    launch without graphs, from the same state: records, phases and inputs identical (the CPU tests
    prove the eager rounds equal to the host's protocol); time per step of each."""
    import torch

    from photon_core.models.moondream.object_rounds import ObjectRounds
    b = build(ctx, fam, batch)
    step = b.step(advance=False)
    b.kernel(step)
    b.use_dtype(step, dtype_of(fam.stress_dtype))   # before capture: graphs keep the arena they saw
    fm = fam.object_decode(ctx.dev)
    # Built before the state is filled: on a GPU building captures the rounds, which runs steps.
    ways = {"graphs": ObjectRounds(fm, step), "eager": ObjectRounds(fm, step, cuda_graphs=False)}
    rows = fam.rows(batch, "fixed")
    fill(step, rows, seed=70 + batch)
    tk, B = fam.cfg.tokenizer, batch
    phases = [r % 4 for r in range(B)]                      # boundary, y, size, answer rows
    detect = [r % 3 != 1 for r in range(B)]                 # detect rows and point rows
    bias = torch.zeros(B, fam.dm.vocab, device=ctx.dev)
    # Object rows choose between coord and eos at a boundary, so rows both start objects and stop.
    bias[[r for r in range(B) if phases[r] != 3]] = float("-inf")
    bias[[r for r in range(B) if phases[r] != 3], tk.coord_id] = 2.0     # objects more often than not
    bias[[r for r in range(B) if phases[r] != 3], tk.eos_id] = 0.0
    x0 = fam.emb[torch.tensor(rows.tokens, device=ctx.dev)]
    sizes, got, secs = ctx.sizes.object_rounds, {}, {}
    for name, dev_rounds in ways.items():
        with preserved(step):
            step.set_step(None, rows.positions)
            step.set_input("logit_bias", bias)
            step.view("x").copy_(x0)
            dev_rounds.phase.copy_(torch.tensor(phases))
            dev_rounds.detect.copy_(torch.tensor(detect))
            ctx.sync()
            t = time.perf_counter()
            records = [dev_rounds.loop.run_round(n)[0] for n in sizes]   # on a GPU 3 and 5: several graphs a round
            ctx.sync()
            secs[name] = time.perf_counter() - t
            got[name] = (records, dev_rounds.phase.tolist(), step.view("x").clone())
    (rg, pg, xg), (re, pe, xe) = got["graphs"], got["eager"]
    same = rg == re and pg == pe and bool(torch.equal(xg, xe))
    starts = sum(rec[r][0] == tk.coord_id for rnd in re for rec in rnd for r in range(B) if phases[r] != 3)
    ctx.checks.expect(same and starts > 0, f"object rounds {fam.name} B{batch}: captured rounds differ from the "
                                           f"same rounds launched eagerly, or no row started an object ({starts})")
    us = {k: v / sum(sizes) * 1e6 for k, v in secs.items()}
    print(f"  {fam.name:22s} B{batch} {fam.stress_dtype}: detect/point rounds of {sizes}, captured == eager "
          f"{same}; us/step captured {us['graphs']:.1f}, eager {us['eager']:.1f}", flush=True)
    return dict(family=fam.name, batch=batch, dtype=fam.stress_dtype, steps=sum(sizes), rounds=list(sizes),
                same=same, objects_started=starts, ways=["graphs", "eager"], us_per_token=us, objects=True)
