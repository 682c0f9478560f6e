"""Loading Moondream 3 with the megakernel backend never holds a tensor twice on the target device:
the checkpoint is read to the CPU, the compiled step's weights arena is laid out on the device from
there, and every other weight goes to the device once. So the device's peak during the load is at
most what stays resident afterwards plus one tensor in transit (the arena fill's `t.to(device)`).

Proven without a GPU: the load runs on the "meta" device (building the arena, lowering and checking
the step launch no kernel), and a TorchDispatchMode follows every meta storage that any op creates,
alive until its last tensor is gone (a weak reference to the storage itself, so views count once).
The checkpoint is test_moondream3_megakernel's reduced one (FP8 experts with their row scales).
"""
import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton

import torch  # noqa: E402
from torch.multiprocessing.reductions import StorageWeakRef  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

import test_moondream3_megakernel as tm  # noqa: E402
from photon_core.models.moondream3 import load_moondream3  # noqa: E402
from photon_core.models.moondream3 import weights as weights_io  # noqa: E402
from photon_core.models.moondream3.decoder_step import map_tensors  # noqa: E402
from photon_core.models.moondream3.memory import load_memory  # noqa: E402


class DeviceBytes(TorchDispatchMode):
    """Live bytes of the storages on `device` created while the mode is on, and their peak."""

    def __init__(self, device: str = "meta") -> None:
        super().__init__()
        self.device = torch.device(device)
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def now(self) -> int:
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        return sum(n for _, n in self.live.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device == self.device:
                s = t.untyped_storage()
                if s._cdata not in self.live:
                    self.live[s._cdata] = (StorageWeakRef(s), s.nbytes())
        # measured after every op: a transient freed by the next op still counts
        self.peak = max(self.peak, self.now())
        return out


def test_megakernel_load_peak_is_resident_bytes_plus_one_tensor():
    path = tm.checkpoint()
    import photon_core.megakernel as megakernel_ops   # not at collection: it imports the Triton kernels
    with DeviceBytes("meta") as mem:
        model = load_moondream3(path, device="meta", backend=megakernel_ops, tiling=tm.TILING)
        resident = mem.now()
    # the largest tensor as it travels (the dtype the CPU copy has when it goes to the device)
    cpu = weights_io.load_tensors(path / "model.safetensors", torch.float32, "cpu", keep_fp8=True)
    largest = max(t.numel() * t.element_size() for t in cpu.values())
    text_bytes = sum(t.numel() * t.element_size() for k, t in cpu.items() if k.startswith("text.blocks."))
    step = model.decode.decoder(1)
    arena = step.weights.numel() * step.weights.element_size()
    # so the bound below has no room for the arena's weights twice (loaded copies beside the arena)
    assert largest < arena / 2
    # every weight the model holds is on the target device (none left behind on the CPU), and the
    # arena, the step's state and the per-op weights are what stays
    held: list[torch.Tensor] = []
    for w in (model.vision_w, model.text_w, model.region_w):
        map_tensors(w, lambda t: held.append(t) or t)
    assert len(held) > 50 and all(t.device.type == "meta" for t in held)
    assert step.weights.device.type == "meta"
    assert resident >= arena + step.state.numel() * 4 + model.text_w.wte.numel() * 4
    # the per-op text weights are the arena's views (one copy), e.g. the MoE experts
    moe = model.text_w.blocks[1]
    assert moe.experts_gate_up.untyped_storage()._cdata == step.weights.untyped_storage()._cdata
    # memory.load_memory's prediction from the shapes (its 9B-A2B figure is test_moondream3_memory's)
    # is what the load holds: resident bytes to 1% (the model's two vocabulary masks are not in it)
    cfg = model.config
    predicted = load_memory(cfg, max_len=model.decode.max_len, dtype=torch.float32, kv_dtype=torch.float32,
                            tiling=tm.TILING)
    transit = predicted.pop("load: one tensor in transit")
    assert abs(resident - sum(predicted.values())) <= 0.01 * resident
    assert mem.peak <= 1.01 * (sum(predicted.values()) + transit) and transit <= largest
    assert mem.peak <= resident + largest, (
        f"load peak {mem.peak} B > resident {resident} B + largest tensor {largest} B "
        f"(text weights {text_bytes} B)")
