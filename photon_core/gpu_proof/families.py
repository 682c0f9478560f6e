"""The proof's model fixtures: Whisper's and Moondream 2's decode steps on random weights of real
shapes, built through their families' own megakernel classes (so each family's weight gathering is
on the path), with the rows and inputs a step runs at and each family's own reference_step. (Families
compiled from their step graph alone use photon_core.megakernel.graph_family.GraphFamily.)

A family here answers what the parts ask: load(dev), build(batch, advance) -> a compiled step (a
family whose buckets share one weights arena keeps the first it builds), rows(batch, purpose),
inputs(batch, tokens), ref_weights(dtype) (the weights as the arena of that dtype holds them, for
run_reference), own_state(caches) and own_reference(...); and says
advance (its step writes the next token and position itself), perop (a per-op step exists to
time against), batches, dtypes and stress_dtype.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Callable

from photon_core.megakernel.graph_family import Rows, logit_bias, make_rows

if TYPE_CHECKING:
    import torch

    from photon_core.models.whisper.decoder_step import WhisperDecoderWeights


class WhisperFamily:
    """Whisper's decoder step (models/whisper/decoder_step.py) on WhisperDecoderWeights.random."""
    advance = True     # the step graph can advance itself: replays decode onwards with no host write

    def __init__(self, name: str, d: int, heads: int, layers: int, vocab: int, max_len: int, enc_len: int,
                 tiling: Callable[[int], Any], batches: tuple[int, ...], dtypes: tuple[str, ...],
                 stress_dtype: str, steps_rows: tuple[int, int], fixed_rows: tuple[int, int],
                 perop: bool = True) -> None:
        self.name, self.shape = name, (d, heads, layers, vocab)
        self.max_len, self.enc_len, self.tiling = max_len, enc_len, tiling
        self.batches, self.dtypes, self.stress_dtype = batches, dtypes, stress_dtype
        self.steps_rows, self.fixed_rows, self.perop = steps_rows, fixed_rows, perop
        self.wt: WhisperDecoderWeights | None = None
        self._ref: dict = {}

    def load(self, dev) -> None:
        from photon_core.models.whisper.decoder_step import WhisperDecoderWeights
        if self.wt is None:
            d, h, layers, vocab = self.shape
            self.wt = WhisperDecoderWeights.random(d, h, layers, vocab, n_ctx=self.max_len, seed=0, device=dev)

    def build(self, batch: int, advance: bool):
        from photon_core.models.whisper.decoder_step import WhisperDecoderMegakernel
        if self.wt is None:
            raise RuntimeError(f"{self.name}: load() the weights before building a step")
        return WhisperDecoderMegakernel(self.wt, batch, self.max_len, self.enc_len, self.tiling(batch),
                                        advance=advance)

    def rows(self, batch: int, purpose: str) -> Rows:
        return make_rows(batch, self.shape[3], self.steps_rows if purpose == "steps" else self.fixed_rows,
                         [self.enc_len - max(1, self.enc_len // 30) * r for r in range(batch)])

    def inputs(self, batch: int, tokens: list[int]) -> dict:
        return {}

    def ref_weights(self, dtype) -> dict:
        """name -> fp32 tensor as the weights arena of `dtype` holds it, for run_reference."""
        from photon_core.models.whisper.decoder_step import step_weights
        return step_weights(self._rounded(dtype))

    def _rounded(self, dtype):
        import dataclasses

        import torch
        if dtype == torch.float32:
            return self.wt
        if dtype not in self._ref:
            def rnd(t):
                return t.to(dtype).float()
            wt = self.wt
            layers = [dataclasses.replace(lw, **{f.name: rnd(getattr(lw, f.name)) for f in dataclasses.fields(lw)})
                      for lw in wt.layers]
            self._ref[dtype] = dataclasses.replace(wt, token_embedding=rnd(wt.token_embedding),
                                                   positional_embedding=rnd(wt.positional_embedding),
                                                   layers=layers, ln_w=rnd(wt.ln_w), ln_b=rnd(wt.ln_b))
        return self._ref[dtype]

    def own_state(self, caches: dict) -> dict:
        """Separate copies of the self-attention caches for decoder_step.reference_step (it appends
        in place) and the cross caches (read only)."""
        n = self.shape[2]
        return dict(self_kv=[(caches[f"L{i}.kcache"].clone(), caches[f"L{i}.vcache"].clone()) for i in range(n)],
                    cross_kv=[(caches[f"L{i}.xk"], caches[f"L{i}.xv"]) for i in range(n)])

    def own_reference(self, dtype, state: dict, tokens, positions, rows: Rows, inputs: dict) -> dict:
        from photon_core.models.whisper.decoder_step import reference_step
        return {"logits": reference_step(self._rounded(dtype), tokens, positions, state["self_kv"],
                                         state["cross_kv"], rows.cross_len)}


class MoondreamFamily:
    """Moondream 2's decode step (models/moondream/decoder_step.py) on random weights of the config's
    dims, built through MoondreamDecoderMegakernel from text/region weight objects of the model's
    layout (so gather_weights is on the path too)."""
    advance = False
    feeds_embeddings = True   # its step reads an input embedding (`x`), from the token table `emb`
    perop = False      # no per-op step function exists for this family (decoder_step has none)

    def __init__(self, name: str, cfg, max_len: int, tiling: Callable[[int], Any], batches: tuple[int, ...],
                 dtypes: tuple[str, ...], stress_dtype: str, steps_rows: tuple[int, int],
                 fixed_rows: tuple[int, int]) -> None:
        self.name, self.cfg, self.max_len, self.tiling = name, cfg, max_len, tiling
        self.batches, self.dtypes, self.stress_dtype = batches, dtypes, stress_dtype
        self.steps_rows, self.fixed_rows = steps_rows, fixed_rows
        self.master: dict | None = None
        self.arena32: torch.Tensor | None = None   # the first bucket's weights arena, which later buckets share
        self._ref: dict = {}
        self._bias: dict = {}

    def load(self, dev) -> None:
        import torch

        from photon_core.models.moondream.decoder_step import dims_of, weight_shapes
        if self.master is not None:
            return
        self.dm = dm = dims_of(self.cfg)
        self.dev = dev
        g = torch.Generator(device=dev).manual_seed(0)

        def randn(*shape: int, scale: float) -> torch.Tensor:
            return torch.randn(*shape, generator=g, device=dev) * scale

        # Rotary tables as TextWeights.from_state computes them; the rest random, scaled so that
        # activations stay O(1) through 24 layers.
        inv = 1.0 / (self.cfg.text.rope_theta ** (torch.arange(0, dm.rot, 2, dtype=torch.float32) / dm.rot))
        angles = (torch.arange(dm.max_context, dtype=torch.float32)[:, None] * inv[None, :]).to(dev)
        master = {}
        for k, shape in weight_shapes(dm).items():
            if k in ("rope_cos", "rope_sin"):
                master[k] = angles.cos() if k == "rope_cos" else angles.sin()
            elif k.endswith("ln.w"):
                master[k] = 1 + randn(*shape, scale=0.1)
            elif len(shape) == 1:
                master[k] = randn(*shape, scale=0.1)
            else:
                master[k] = randn(*shape, scale=shape[1] ** -0.5)
        self.master = master
        self.emb = randn(dm.vocab, dm.d, scale=1.0)     # input embeddings of the tokens decoded

    @staticmethod
    def _objects(w: dict) -> tuple[Any, Any]:
        """text.TextWeights- and region.RegionWeights-like objects (gather_weights' inverse)."""
        def pair(i: int, part: str) -> tuple:
            return (w[f"L{i}.ln.w"], w[f"L{i}.ln.b"]) if part == "ln" else (w[f"L{i}.{part}_w"], w[f"L{i}.{part}_b"])

        n = 1 + max(int(k.split(".")[0][1:]) for k in w if k.startswith("L"))
        blocks = [SimpleNamespace(**{part: pair(i, part) for part in ("ln", "qkv", "proj", "fc1", "fc2")})
                  for i in range(n)]
        text_w = SimpleNamespace(blocks=blocks, post_ln=(w["post_ln.w"], w["post_ln.b"]),
                                 lm_head=(w["lm_w"], w["lm_b"]), cos=w["rope_cos"], sin=w["rope_sin"])
        region_w = SimpleNamespace(coord_fc1=(w["c_fc1_w"], w["c_fc1_b"]), coord_fc2=(w["c_fc2_w"], w["c_fc2_b"]),
                                   size_fc1=(w["s_fc1_w"], w["s_fc1_b"]), size_fc2=(w["s_fc2_w"], w["s_fc2_b"]))
        return text_w, region_w

    def object_decode(self, dev) -> Any:
        """What object_rounds.ObjectRounds reads of a MegakernelDecode: the model's token table
        (`emb`), random region encoders of the config's shapes, the Triton ops, the config, and
        spatial_tokens_fed (False: Moondream 2 feeds every answer token as its embedding)."""
        import torch

        from photon_core.backends.select import get_backend
        from photon_core.models.moondream import region, text
        r, d = self.cfg.region, self.dm.d
        g = torch.Generator(device=dev).manual_seed(1)

        def randn(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=g, device=dev) * (shape[-1] ** -0.5 if len(shape) > 1 else 0.1)
        encoders = SimpleNamespace(coord_features=randn(1, r.coord_feat_dim // 2) * 10,
                                   coord_encoder=(randn(d, r.coord_feat_dim), randn(d)),
                                   size_features=randn(2, r.size_feat_dim // 2) * 10,
                                   size_encoder=(randn(d, r.size_feat_dim), randn(d)))
        model = SimpleNamespace(region_w=encoders, region_impl=region, text_impl=text,
                                text_w=SimpleNamespace(wte=self.emb), ops=get_backend("triton", dev),
                                spatial_tokens_fed=False)
        return SimpleNamespace(model=model, config=self.cfg)

    def _master(self) -> dict:
        if self.master is None:
            raise RuntimeError(f"{self.name}: load() the weights first")
        return self.master

    def build(self, batch: int, advance: bool):
        from photon_core.models.moondream.decoder_step import MoondreamDecoderMegakernel
        text_w, region_w = self._objects(self._master())
        # Every bucket streams one copy of the weights, as MegakernelDecode does.
        step = MoondreamDecoderMegakernel(text_w, region_w, self.cfg, batch, self.max_len, self.tiling(batch),
                                          weights=self.arena32)
        if self.arena32 is None:
            self.arena32 = step.weights
        return step

    def rows(self, batch: int, purpose: str) -> Rows:
        return make_rows(batch, self.dm.vocab, self.steps_rows if purpose == "steps" else self.fixed_rows)

    def bias(self, batch: int):
        """Per-row logit bias over the vocabulary (graph_family.logit_bias), made once per batch."""
        if batch not in self._bias:
            self._bias[batch] = logit_bias(batch, self.dm.vocab, self.dev)
        return self._bias[batch]

    def inputs(self, batch: int, tokens: list[int]) -> dict:
        import torch
        return {"x": self.emb[torch.tensor(tokens, device=self.dev)], "logit_bias": self.bias(batch)}

    def ref_weights(self, dtype) -> dict:
        import torch
        if dtype == torch.float32:
            return self._master()
        if dtype not in self._ref:
            self._ref[dtype] = {k: v.to(dtype).float() for k, v in self._master().items()}
        return self._ref[dtype]

    def own_state(self, caches: dict) -> dict:
        k, v = caches["kcache"].clone(), caches["vcache"].clone()
        return dict(rows=[SimpleNamespace(k=k[:, r:r + 1], v=v[:, r:r + 1], length=k.shape[3])
                          for r in range(k.shape[1])])

    def own_reference(self, dtype, state: dict, tokens, positions, rows: Rows, inputs: dict) -> dict:
        from photon_core.models.moondream.decoder_step import reference_step
        text_w, region_w = self._objects(self.ref_weights(dtype))
        want = reference_step(text_w, region_w, self.cfg, state["rows"], inputs["x"], positions,
                              inputs["logit_bias"])
        return {"logits": want["logits"], "hidden": want["hidden"]}
